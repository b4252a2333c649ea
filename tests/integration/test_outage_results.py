"""Issue 18, item 7: results a worker has computed survive a PostgreSQL outage longer than
``db_retry_max_seconds``. One real worker subprocess (tiny random model) reaches PostgreSQL through a TCP
proxy the test cuts; the test side talks to PostgreSQL directly and cancels through Redis, so jobs finish
while the worker cannot write. Past ``db_retry_max_seconds`` the worker abandons its unfinished job (as
before: reclaimed later) but keeps the finished results and writes them once the database is back: same
attempt, nothing computed twice. A held result is still fenced: when another worker took the job over in
the meantime, the late result is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sqlalchemy import update
from sqlalchemy.engine import make_url

from inferq import jobs
from inferq.db import Job, utcnow
from tests.service_behaviour_helpers import ENDLESS, Service, make_long_context_model
from tests.service_fixtures import TcpProxy, private_redis, wait_for  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(170)]

GIVE_UP = "database down too long; abandoning in-flight jobs to reclaim"
DISCARDED = "job no longer ours (taken over, or finished elsewhere); result discarded"


@pytest.fixture
def svc(pg_url, private_redis, tmp_path) -> Iterator[Service]:  # noqa: F811
    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    # 3 s: ample for the cancels to reach the engine before the worker gives up
    # no decode-ahead windows: one token a step keeps the lone ENDLESS job running past the give-up (a tiny
    # model in windows of 16-32 tokens can decode its 15,000 tokens in about 3 s)
    s = Service(pg_url, private_redis.url, make_long_context_model(tmp_path / "model"), tmp_path,
                db_retry_max_seconds=3.0, decode_ahead_ms=0.0, decode_ahead_wake_ms=0.0)
    s.proxy = proxy
    s.main = s.start_worker(database_url=proxied)
    yield s
    s.close()
    proxy.close()


def _log_lines(svc: Service, event: str, job_id: str | None = None) -> list[dict]:
    out = []
    for line in svc.main.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == event and job_id in (None, entry.get("job_id")):
            out.append(entry)
    return out


def _started(svc: Service, ids: list[str]) -> bool:
    return all(svc.job(j).first_token_at is not None for j in ids)


def test_results_held_through_a_long_outage_are_written_once_fenced(svc):
    kept, taken, running = (svc.submit(max_tokens=ENDLESS, ignore_eos=True) for _ in range(3))
    svc.wait_status([kept, taken, running], ("running",), timeout=60)
    wait_for(lambda: _started(svc, [kept, taken, running]), 60, what="every job to generate")
    svc.proxy.cut()
    try:
        for job_id in (kept, taken):  # they end now, on the worker, which cannot write their results
            jobs.cancel(svc.db, svc.redis, svc.settings, job_id)
        wait_for(lambda: all(_log_lines(svc, "cancel requested", j) for j in (kept, taken)), 30,
                 what="the cancels to reach the engine")
        with svc.db() as s:  # meanwhile another worker takes `taken` over (its attempt fences the held one)
            s.execute(update(Job).where(Job.id == taken).values(attempts=Job.attempts + 1, worker="intruder",
                                                               heartbeat_at=utcnow()))
            s.commit()
        gave_up = wait_for(lambda: _log_lines(svc, GIVE_UP), 60, what="the worker to give up on the database")
        assert gave_up[0]["results_held"] == 2 and gave_up[0]["in_flight"] == 1, gave_up
        assert svc.statuses([kept, taken, running]) == {kept: "running", taken: "running", running: "running"}
    finally:
        svc.proxy.restore()

    assert svc.wait_status([kept]) == {kept: "cancelled"}
    _, ledger = svc.one_result(kept)
    job = svc.job(kept)
    assert (job.attempts, job.worker) == (1, svc.main.name)  # written by the attempt that computed it
    assert ledger.completion_tokens > 0

    wait_for(lambda: _log_lines(svc, DISCARDED, taken), 30, what="the fenced-out result to be refused")
    assert svc.wait_status([taken]) == {taken: "cancelled"}  # ended for the intruder's attempt, cancel pending
    _, ledger = svc.one_result(taken)
    assert ledger.completion_tokens == 0, svc.logs()  # not the held result: its tokens were computed by attempt 1

    wait_for(lambda: svc.job(running).attempts == 2 and svc.job(running).status == "running", 60,
             what="the abandoned job to be reclaimed")
    jobs.cancel(svc.db, svc.redis, svc.settings, running)
    assert svc.wait_status([running]) == {running: "cancelled"}
    svc.one_result(running)
    assert svc.main.alive()
