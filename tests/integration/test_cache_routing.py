"""Cache-aware routing across workers (issue 17, item 2) with two real worker subprocesses, PostgreSQL and a
private Redis: jobs sharing a prompt prefix land on one worker, so more prompt tokens come from the prefix
cache than with routing off; and when a job's owner is SIGKILLed mid-run, the other worker leaves (SIGTERM:
it hands its unfinished jobs back) and a new one joins, every job still finishes exactly once (one result row, one
ledger row). Plus the routed lanes' reading rules on a real Redis, without workers."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from inferq.db import Job
from tests.service_behaviour_helpers import Service
from tests.service_fixtures import private_redis, wait_for  # noqa: F401

pytestmark = pytest.mark.integration

GROUPS = 8  # distinct shared prefixes (one tenant)
WAVES = 3  # jobs per prefix, submitted one wave after another (the first of each computes the prefix)
PREFIX = 48  # tokens: 3 full blocks of 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("routing-model"), arch="llama", max_position_embeddings=1024)


def _prompt(group: int, wave: int) -> list[int]:
    shared = [(group * 37 + i * 11) % 300 + 5 for i in range(PREFIX)]
    return shared + [(group + wave * 7 + i) % 300 + 5 for i in range(5)]


def _workers_of(svc: Service, ids: list[str]) -> dict[str, str]:
    with svc.db() as s:
        return dict(s.execute(select(Job.id, Job.worker).where(Job.id.in_(ids))).all())


def _run_prefix_waves(svc: Service) -> tuple[int, list[list[str]]]:
    """Submit the waves (each waited for), return the prompt tokens served from cache and the job ids by group."""
    by_group: list[list[str]] = [[] for _ in range(GROUPS)]
    for wave in range(WAVES):
        ids = [svc.submit(prompt_ids=_prompt(g, wave), max_tokens=2, ignore_eos=True) for g in range(GROUPS)]
        for g, job_id in enumerate(ids):
            by_group[g].append(job_id)
        svc.wait_status(ids, ("succeeded",), timeout=60)
    cached = sum(svc.one_result(j)[1].cached_prompt_tokens for ids in by_group for j in ids)
    return cached, by_group


def test_routing_puts_a_shared_prefix_on_one_worker_and_hits_more(pg_url, private_redis, model, tmp_path):  # noqa: F811
    cached: dict[bool, int] = {}
    for routing_on in (True, False):
        (tmp_path / str(routing_on)).mkdir()
        svc = Service(pg_url, private_redis.url, model, tmp_path / str(routing_on), cache_routing=routing_on,
                      cache_routing_max_wait_ms=5000)
        try:
            svc.start_worker()
            svc.start_worker()
            cached[routing_on], by_group = _run_prefix_waves(svc)
            if routing_on:  # every group ran on one worker, and the groups are spread over both
                owners = [set(_workers_of(svc, ids).values()) for ids in by_group]
                assert all(len(o) == 1 for o in owners), owners
                assert len(set().union(*owners)) == 2, owners
                # the tenant's fairness lane is kept: routed lanes are per lane (tenant) and owner
                from inferq.contract import stream_key
                from inferq.jobs import routes
                tenant_lane = stream_key(svc.prefix, svc.model, "interactive", svc.tenant.id)
                assert set(routes.routed_lanes(svc.redis, svc.prefix, svc.model, "interactive")) == {
                    f"{tenant_lane}:to:{w.name}" for w in svc.workers}
        finally:
            svc.close()
    # with routing, every later wave reuses its group's full prefix blocks
    assert cached[True] >= GROUPS * (WAVES - 1) * PREFIX, cached
    assert cached[True] > cached[False], cached


def test_no_job_lost_or_run_twice_when_an_owner_dies_and_workers_join_and_leave(
        pg_url, private_redis, model, tmp_path):  # noqa: F811
    """Routed jobs wait in w1's and w2's lanes (and run on them) when w1 is SIGKILLed and w2 then leaves with
    SIGTERM; a worker joining afterwards takes all of it over (dead owner's lanes and pending messages, the
    leaver's handed-back jobs): every job succeeds with exactly one result and one ledger row."""
    svc = Service(pg_url, private_redis.url, model, tmp_path, cache_routing=True, cache_routing_max_wait_ms=300,
                  max_num_seqs=2)
    try:
        w1 = svc.start_worker()
        w2 = svc.start_worker()
        ids = [svc.submit(prompt_ids=_prompt(g % GROUPS, g), max_tokens=100, ignore_eos=True) for g in range(24)]

        def running_on(w) -> list[str]:
            with svc.db() as s:
                return list(s.scalars(select(Job.id).where(Job.id.in_(ids), Job.worker == w.name,
                                                           Job.status == "running")).all())

        wait_for(lambda: running_on(w1), 60, interval=0.05, what="w1 running a job")
        w1.kill9()
        on_w1 = running_on(w1)  # still "running" (w1 is dead): to be taken over
        wait_for(lambda: running_on(w2), 60, interval=0.05, what="w2 running a job")
        assert w2.terminate() == 0  # another leaves: it hands its unfinished jobs back to its routed lanes
        assert set(svc.statuses(ids).values()) - {"succeeded"}, "nothing left for the joining worker"
        svc.start_worker()  # a worker joins mid-run: it alone must finish everything the others left
        svc.wait_status(ids, ("succeeded",), timeout=60)
        for job_id in ids:
            svc.one_result(job_id)  # exactly one result and one ledger row each
        finished_on = _workers_of(svc, ids)
        assert on_w1 and all(finished_on[j] != w1.name for j in on_w1), (on_w1, finished_on)
    finally:
        svc.close()


def test_reading_routed_lanes_takeover_prune_and_requeue(private_redis):  # noqa: F811
    """``StreamConsumer`` on a real Redis: a worker reads its own routed lane at once; another worker's only
    once the message waited the bound, or at once when the owner's heartbeat is gone; a long-gone owner's
    empty lane is pruned, and a job handed back to a pruned lane re-registers it (nothing is stranded)."""
    import time
    import uuid

    import redis

    from inferq import routing
    from inferq.contract import stream_key
    from inferq.jobs import routes
    from inferq.log import get_logger
    from inferq.models_registry import workers_key
    from inferq.settings import Settings
    from worker.metrics import WorkerMetrics
    from worker.streams import StreamConsumer

    settings = Settings(redis_url=private_redis.url, stream_prefix=f"routes-{uuid.uuid4().hex[:8]}",
                        cache_routing_max_wait_ms=300)
    prefix, r = settings.stream_prefix, redis.Redis.from_url(private_redis.url)
    lane = stream_key(prefix, "m", "interactive", "tenant")
    r.zadd(workers_key(prefix, "m"), {"w-a": time.time() + 60, "w-b": time.time() + 60})

    def route(owner: str, body: str) -> None:
        pipe = r.pipeline(transaction=True)
        routes.push_routed(pipe, prefix, "m", "interactive", lane, owner, body.encode())
        pipe.execute()

    metrics = WorkerMetrics(model="m")
    a = StreamConsumer(r, settings, "m", "w-a", metrics, get_logger("test"))
    a.ensure_groups()
    held: list = []

    def read_a() -> list[str]:
        a.refresh_lanes(force=True)
        got = a.read(4, False, lambda: held)
        held.extend(got)
        return [m.raw.decode() for m in got]

    route("w-a", "mine")
    assert read_a() == ["mine"]  # its own routed lane: read at once
    route("w-b", "young")
    assert read_a() == []  # w-b is live and the message is young
    time.sleep(0.35)
    assert read_a() == ["young"]  # waited the bound: taken over
    r.zrem(workers_key(prefix, "m"), "w-b")
    route("w-b", "orphan")
    assert read_a() == ["orphan"]  # the owner's heartbeat is gone: taken at once
    assert metrics.routed_taken_over._metric.labels("m")._value.get() == 2

    pipe = r.pipeline()
    for m in held:
        a.ack(pipe, m, None)
    pipe.execute()
    b_lane = routing.routed_lane(lane, "w-b")
    assert routes.prune_routes(r, prefix, "m", "interactive") == 1  # w-b is gone and its lane empty
    assert not r.exists(b_lane) and set(routes.routed_lanes(r, prefix, "m", "interactive")) == {
        routing.routed_lane(lane, "w-a")}
    pipe = r.pipeline()
    a.requeue(pipe, held[1], None)  # a job taken from w-b's lane handed back there: the lane is registered again
    pipe.execute()
    assert r.xlen(b_lane) == 1 and routes.routed_lanes(r, prefix, "m", "interactive")[b_lane] == "w-b"
    assert read_a() == ["young"]  # and taken at once (its owner is gone)
