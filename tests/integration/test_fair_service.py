"""Fair share through the service (issue 18): a tenant's backlog in Redis does not queue another tenant's
job behind it. Jobs wait in one stream lane per tenant (``stream_key(..., tenant)``), which a worker reads
round-robin, lanes it holds fewest jobs of first, and a few jobs of tenants it holds none of are read even when
its engine is full, where the scheduler's seat claim runs them at once. A real worker subprocess, PostgreSQL
and a private Redis; the same run with fair share off shows the arrival order the test guards against."""

from __future__ import annotations

import pytest

from inferq import jobs
from inferq.contract import stream_key
from tests.service_behaviour_helpers import TERMINAL, Service, make_long_context_model
from tests.service_fixtures import make_tenant, private_redis, wait_for  # noqa: F401

pytestmark = pytest.mark.integration

HEAVY_JOBS = 24
HEAVY_TOKENS = 400  # each heavy job runs many steps: the backlog takes seconds to drain on two seats


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_long_context_model(tmp_path_factory.mktemp("fair-model"))


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "arrival-order"])
def test_a_light_tenant_is_not_queued_behind_a_heavy_backlog(pg_url, private_redis, model, tmp_path,  # noqa: F811
                                                              fair):
    svc = Service(pg_url, private_redis.url, model, tmp_path, max_num_seqs=2, fair_share=fair)
    heavy: list[str] = []
    try:
        svc.start_worker()
        heavy = [svc.submit(max_tokens=HEAVY_TOKENS, ignore_eos=True) for _ in range(HEAVY_JOBS)]
        light_tenant = make_tenant(svc.db)
        light = svc.submit(tenant=light_tenant, max_tokens=8, ignore_eos=True)
        svc.wait_status([light], timeout=120)
        left = sum(s not in TERMINAL for s in svc.statuses(heavy).values())
        if fair:
            # the light job ran while nearly all of the backlog still waited (2 seats: at most a few heavy
            # jobs can end while it runs)
            assert left >= HEAVY_JOBS - 4, left
            _, ledger = svc.one_result(light)
            assert ledger.completion_tokens == 8
            # it was queued in its own tenant's lane, not behind the heavy tenant's messages
            lane = stream_key(svc.prefix, svc.model, "interactive", light_tenant.id)
            assert lane in jobs.tier_streams(svc.redis, svc.prefix, svc.model, "interactive")
        else:
            assert left <= 2, left  # it waited for (nearly) the whole backlog: what fair share prevents
    finally:
        for job_id in heavy:
            jobs.cancel(svc.db, svc.redis, svc.settings, job_id)
        if heavy and svc.workers:
            svc.wait_status(heavy, timeout=60)
        svc.close()


def test_reading_deals_the_room_over_the_lanes_and_reads_newcomers_beyond_it(private_redis):  # noqa: F811
    """``StreamConsumer.read`` on a real Redis: the room is dealt evenly over the lanes that have undelivered
    jobs (never more than the room), lanes already held count against their tenant, and jobs of a tenant
    this worker holds none of are read beyond the room."""
    import uuid

    import redis

    from inferq.contract import lanes_key
    from inferq.log import get_logger
    from inferq.settings import Settings
    from worker.metrics import WorkerMetrics
    from worker.streams import StreamConsumer

    settings = Settings(redis_url=private_redis.url, stream_prefix=f"lanes-{uuid.uuid4().hex[:8]}")
    r = redis.Redis.from_url(private_redis.url)

    def queue(tenant: str, count: int) -> str:
        lane = stream_key(settings.stream_prefix, "m", "interactive", tenant)
        for i in range(count):
            r.xadd(lane, {"m": f"{tenant}-{i}".encode()})
        r.sadd(lanes_key(settings.stream_prefix, "m", "interactive"), lane)
        return lane

    heavy, light = queue("heavy", 10), queue("light", 2)
    consumer = StreamConsumer(r, settings, "m", "c1", WorkerMetrics(model="m"), get_logger("test"))
    consumer.ensure_groups()
    held: list = []

    def read(n: int, newcomers: int = 0) -> list[str]:
        got = consumer.read(n, False, lambda: held, newcomers=newcomers)
        held.extend(got)
        return sorted(m.raw.decode() for m in got)

    assert read(4) == ["heavy-0", "heavy-1", "light-0", "light-1"]
    assert read(3) == ["heavy-2", "heavy-3", "heavy-4"]  # the light lane is empty now
    newcomer = queue("new", 3)
    consumer.refresh_lanes(force=True)  # the worker looks for new lanes every LANE_REFRESH_SECONDS
    assert read(0, newcomers=2) == ["new-0"]  # one of the tenant held nowhere, beyond a full engine
    assert read(0, newcomers=2) == []  # ... and no more: it holds one now
    assert read(2) == ["heavy-5", "new-1"]  # the lane held least goes first: new (1 held), then heavy (5)
    assert {m.stream for m in held} == {heavy, light, newcomer}
