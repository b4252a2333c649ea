"""Job-service behaviours of docs/SERVICE.md that only a real worker shows, one worker subprocess
(``python -m worker.service``, tiny random model) against the real PostgreSQL and a private real Redis:

* a duplicate message (what the reconciler makes when it re-adds a job that still had one) runs the job
  once, and both messages are acknowledged;
* a cancel whose pub/sub message was missed is still delivered: the flag is read back on the heartbeat;
* the prefix cache is per tenant namespace through the whole service, a message without a namespace is
  refused (never run with a shared empty one), and a ledger row with cached prompt tokens costs exactly
  what the price version says;
* a PostgreSQL outage longer than ``db_retry_max_seconds``: the worker abandons its jobs without
  acknowledging them and they are reclaimed once the database is back: one result, one ledger row;
* a job claimed after ``max_job_attempts`` lost attempts fails with the reason instead of starting.

The worker's PostgreSQL connections go through a TCP proxy that the outage test cuts."""

from __future__ import annotations

import json
import signal
import time

import msgpack
import pytest
import redis as redis_lib
from sqlalchemy import update
from sqlalchemy.engine import make_url

from inferq import jobs
from inferq.contract import JobCreate, dead_letter_key, encode_message, stream_key
from inferq.db import Job, Price
from tests.service_behaviour_helpers import ENDLESS, Service, make_long_context_model
from tests.service_fixtures import TcpProxy, free_port, make_tenant, private_redis, wait_for  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(170)]

DB_RETRY_MAX_SECONDS = 1.0
ABANDON_LOG = "database down too long; abandoning in-flight jobs"


@pytest.fixture(scope="module")
def svc(pg_url, private_redis, tmp_path_factory):  # noqa: F811
    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    s = Service(pg_url, private_redis.url, make_long_context_model(tmp_path_factory.mktemp("model")),
                tmp_path_factory.mktemp("svc"), db_retry_max_seconds=DB_RETRY_MAX_SECONDS)
    s.proxy = proxy
    s.main = s.start_worker(database_url=proxied)
    yield s
    s.close()
    proxy.close()


def _stream(svc: Service) -> str:
    return stream_key(svc.prefix, svc.model, "interactive")


def _counts(svc: Service) -> tuple[int, int]:
    """(entries, pending) over the interactive tier's streams (its own and the tenant lanes)."""
    return jobs.queue_counts(svc.redis, svc.prefix, svc.model, "interactive", svc.settings.consumer_group)


def _drained(svc: Service) -> bool:
    """Every message of the interactive streams acknowledged and deleted."""
    return _counts(svc) == (0, 0)


def _log_events(svc: Service, event: str, job_id: str) -> list[dict]:
    lines = [json.loads(x) for x in svc.main.log_text().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("event") == event and x.get("job_id") == job_id]


def test_duplicate_message_runs_the_job_once_and_is_acknowledged(svc):
    job_id = svc.submit(max_tokens=40, ignore_eos=True)
    with svc.db() as s:  # a second message for the same job, exactly as the reconciler writes one
        jobs.enqueue(svc.redis, svc.settings, s.get(Job, job_id), svc.tenant.cache_namespace)
    assert svc.wait_status([job_id]) == {job_id: "succeeded"}
    result, ledger = svc.one_result(job_id)
    assert svc.job(job_id).attempts == 1 and ledger.completion_tokens == len(result.token_ids) == 40
    wait_for(lambda: _drained(svc), 30, what="both messages acknowledged")
    assert len(_log_events(svc, "job started", job_id)) == 1
    assert svc.main.alive()


def test_cancel_flag_is_read_on_the_heartbeat_when_pubsub_is_missed(svc):
    job_id = svc.submit(max_tokens=ENDLESS, ignore_eos=True)
    svc.wait_status([job_id], ("running",), timeout=30)
    with svc.db() as s:  # what jobs.cancel does, minus the PUBLISH: the worker never hears of it
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
        s.commit()
    assert svc.wait_status([job_id], timeout=60) == {job_id: "cancelled"}
    result, ledger = svc.one_result(job_id)
    assert result.finish_reason == "abort" and 0 < ledger.completion_tokens < ENDLESS  # pays for what ran
    assert _log_events(svc, "cancel requested (flag)", job_id)


# a 40-token prompt: two full 16-token KV blocks that a later request of the same namespace can reuse
PREFIX_PROMPT = [(7 * i + 3) % 300 + 20 for i in range(40)]
CACHEABLE = 32


def _expected_cost(price: Price, prompt: int, cached: int, completion: int) -> int:
    """docs/SERVICE.md: uncached prompt, cached prompt and completion tokens at their per-1M-token prices,
    in micro-dollars rounded half up."""
    nano = (prompt - cached) * price.prompt_per_mtok + cached * price.cached_prompt_per_mtok
    return (nano + completion * price.completion_per_mtok + 500_000) // 1_000_000


def test_prefix_cache_is_per_tenant_namespace_and_cached_tokens_are_priced(svc):
    other = make_tenant(svc.db)
    run = {}
    for who, tenant in (("first", svc.tenant), ("other_tenant", other), ("again", svc.tenant)):
        job_id = svc.submit(tenant=tenant, prompt_ids=PREFIX_PROMPT, max_tokens=4, ignore_eos=True)
        assert svc.wait_status([job_id]) == {job_id: "succeeded"}  # one at a time: each sees the last's cache
        run[who] = (job_id, *svc.one_result(job_id))
    cached = {who: ledger.cached_prompt_tokens for who, (_, _, ledger) in run.items()}
    assert cached == {"first": 0, "other_tenant": 0, "again": CACHEABLE}
    first, again = run["first"][1], run["again"][1]
    assert first.token_ids == again.token_ids  # the cached blocks hold what was computed
    job_id, _, ledger = run["again"]
    with svc.db() as s:
        price = s.get(Price, svc.job(job_id).price_id)
    assert 0 < price.cached_prompt_per_mtok < price.prompt_per_mtok  # so the figure tells the two apart
    assert (ledger.prompt_tokens, ledger.completion_tokens) == (40, 4)
    assert ledger.cost_micros == _expected_cost(price, 40, CACHEABLE, 4)
    assert ledger.cost_micros < run["first"][2].cost_micros  # cheaper than the same job uncached


def test_message_without_a_namespace_is_dead_lettered_not_run_in_a_shared_one(svc):
    """A message missing ``ns`` must not run under a default (empty) namespace that every such message
    would share: it is dead-lettered. The job itself is not lost: the reconciler enqueues it again with its
    tenant's namespace and it runs once."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    unreachable = redis_lib.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    job, created = jobs.submit(svc.db, unreachable, svc.settings, svc.tenant,
                               JobCreate(model=svc.model, prompt_ids=PREFIX_PROMPT, max_tokens=4, temperature=0))
    assert created and svc.job(job.id).status == "queued"  # committed; its message was never written
    wire = msgpack.unpackb(encode_message(job.id, job.tenant_id, "ns-dropped", job.model, job.tier, 0, job.request,
                                          None, time.time()))
    del wire["ns"]
    svc.redis.xadd(_stream(svc), {"m": msgpack.packb(wire)})
    dead = wait_for(lambda: [f for _, f in svc.redis.xrange(dead_letter_key(svc.prefix))
                             if msgpack.unpackb(f[b"m"]).get("job_id") == job.id], 30, what="the dead letter")
    assert b"'ns'" in dead[0][b"error"]
    assert svc.wait_status([job.id], timeout=60) == {job.id: "succeeded"}  # re-added by the reconciler
    _, ledger = svc.one_result(job.id)
    assert svc.job(job.id).attempts == 1 and ledger.prompt_tokens == len(PREFIX_PROMPT)
    wait_for(lambda: _drained(svc), 10, what="every message acknowledged")


def test_outage_longer_than_db_retry_max_seconds_abandons_then_reclaims(svc):
    """docs/SERVICE.md, database outages: past ``db_retry_max_seconds`` the worker drops its in-flight jobs
    without acknowledging them (their messages stay pending, no longer heartbeated); once the database is
    back the messages are reclaimed and the jobs taken over (attempt 2). Nothing is lost, nothing is billed
    twice, nothing stays running."""
    ids = [svc.submit(max_tokens=ENDLESS, ignore_eos=True) for _ in range(2)]
    svc.wait_status(ids, ("running",), timeout=30)
    svc.proxy.cut()
    try:
        wait_for(lambda: ABANDON_LOG in svc.main.log_text(), 30, what="the worker to abandon its jobs")
        wait_for(lambda: svc.stats(svc.main).get("in_flight") == "0", 10, what="the engine to drop them")
        assert _counts(svc)[1] == 2  # abandoned, not acknowledged
        assert set(svc.statuses(ids).values()) == {"running"}  # nothing was written meanwhile
    finally:
        svc.proxy.restore()
    wait_for(lambda: all(svc.job(j).attempts == 2 and svc.job(j).status == "running" for j in ids), 60,
             what="the abandoned jobs to be reclaimed and restarted")
    for job_id in ids:
        jobs.cancel(svc.db, svc.redis, svc.settings, job_id)
    assert set(svc.wait_status(ids, timeout=60).values()) == {"cancelled"}
    for job_id in ids:
        _, ledger = svc.one_result(job_id)  # one row: the final attempt's
        assert svc.job(job_id).worker == svc.main.name and ledger.completion_tokens > 0
    wait_for(lambda: _drained(svc), 10, what="the reclaimed messages acknowledged")
    assert svc.main.alive()


def test_a_job_whose_attempts_all_lost_their_worker_fails_instead_of_starting(svc):
    """A job claimed after ``max_job_attempts`` attempts that each ended without a result (an input that crashes
    the engine would go on taking down worker after worker) fails with the reason instead of starting; one
    attempt fewer still runs. The worker is held (SIGSTOP) while the rows are set as a crash loop leaves them."""
    limit = svc.settings.max_job_attempts
    svc.main.proc.send_signal(signal.SIGSTOP)
    try:
        doomed = svc.submit(max_tokens=5)
        last_chance = svc.submit(max_tokens=5)
        with svc.db() as s:
            s.execute(update(Job).where(Job.id == doomed).values(attempts=limit))
            s.execute(update(Job).where(Job.id == last_chance).values(attempts=limit - 1))
            s.commit()
    finally:
        svc.main.proc.send_signal(signal.SIGCONT)
    assert svc.wait_status([doomed, last_chance]) == {doomed: "failed", last_chance: "succeeded"}
    failed = svc.job(doomed)
    assert failed.attempts == limit + 1 and f"each of its {limit} attempts" in (failed.error or "")
    assert svc.job(last_chance).attempts == limit
    wait_for(lambda: _drained(svc), 30, what="both messages acknowledged")
    assert svc.main.alive()
