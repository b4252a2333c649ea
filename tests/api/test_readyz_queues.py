"""``/readyz`` reports the autoscaling signal per model and tier (issue 17, item 3): backlog (not yet
delivered), pending (delivered, unfinished), the oldest waiting job's age and the live workers' busy seats,
over every stream of the tier (tenant lanes and routed lanes included). Real Redis and PostgreSQL; the
workers are stand-ins (registered, never reading), so the numbers are exactly what the test put there."""

from __future__ import annotations

import time

from inferq import jobs
from inferq.contract import model_id
from tests.registry_helpers import register_worker


def test_readyz_reports_backlog_pending_oldest_age_and_busy_seats(client, settings, tenant, redis_client):
    name = model_id(settings.model)
    register_worker(settings, "w-a"), register_worker(settings, "w-b")
    redis_client.hset(jobs.worker_key(settings.stream_prefix, "w-a"),
                      mapping={"busy_seats:interactive": 3, "busy_seats:batch": 1, "seats": 8})
    redis_client.hset(jobs.worker_key(settings.stream_prefix, "w-b"), mapping={"busy_seats:interactive": 2, "seats": 8})
    for k in range(3):  # different prompts: with two live workers they are routed, some to each
        r = client.post("/v1/jobs", json={"prompt": f"{k} " * 200, "max_tokens": 4, "model": name},
                        headers={"Authorization": f"Bearer {tenant.key}"})
        assert r.status_code in (200, 201, 202), r.text
    time.sleep(0.2)
    q = client.get("/readyz").json()["queues"][name]
    assert q["interactive"]["backlog"] == 3 and q["interactive"]["pending"] == 0
    assert 0.15 <= q["interactive"]["oldest_waiting_seconds"] < 30
    assert (q["interactive"]["busy_seats"], q["interactive"]["seats"]) == (5, 16)
    assert q["batch"] == {"backlog": 0, "pending": 0, "oldest_waiting_seconds": 0.0, "busy_seats": 1, "seats": 16}

    # a worker takes one job: it moves from the backlog to pending
    streams = [s for s in jobs.tier_streams(redis_client, settings.stream_prefix, name, "interactive")
               if redis_client.xlen(s)]
    redis_client.xgroup_create(streams[0], settings.consumer_group, id="0", mkstream=True)
    assert redis_client.xreadgroup(settings.consumer_group, "w-a", {streams[0]: ">"}, count=1)
    q = client.get("/readyz").json()["queues"][name]["interactive"]
    assert (q["backlog"], q["pending"]) == (2, 1)
