"""api/events.py's ``job_event_items`` for a job the caller has just created (``fresh``, the OpenAI routes'
streams): no PostgreSQL lookup before the first event, which would run while the worker claims the job; a
stream of an existing job (``GET /v1/jobs/{id}/events``) still asks PostgreSQL first when Redis holds nothing
of it. Real Redis."""

from __future__ import annotations

import asyncio
import uuid

import redis as redis_lib
import redis.asyncio as aioredis

from api.events import job_event_items
from inferq import jobs
from tests.conftest import TEST_REDIS_URL


def _events(fresh: bool) -> tuple[list[str], list[str]]:
    """The events of a job whose delta and done entries are written 0.2 s after the stream starts, and what the
    stream's ``load_view`` was asked for, in order with the events (``view``)."""
    prefix = f"t-fresh-{uuid.uuid4().hex[:8]}"
    job_id = str(uuid.uuid4())
    seen: list[str] = []

    class _Settings:
        stream_prefix, event_stream_maxlen, event_stream_ttl_seconds = prefix, 100, 60

    def load_view():
        seen.append("view")
        return {"id": job_id, "status": "queued", "text": None}

    def publish() -> None:
        r = redis_lib.Redis.from_url(TEST_REDIS_URL)
        pipe = r.pipeline()
        jobs.publish_events(pipe, _Settings, job_id, jobs.delta_event("hi", [1]),
                            jobs.done_event(jobs.Outcome(status="succeeded", text="hi", finish_reason="stop")))
        pipe.execute()
        r.close()

    async def run() -> list[str]:
        client = aioredis.from_url(TEST_REDIS_URL)
        names: list[str] = []
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, publish)
        async for name, _data, _id in job_event_items(client, prefix, job_id, load_view, fresh=fresh):
            names.append(name)
            seen.append(name)
        await client.aclose()
        return names

    return asyncio.run(run()), seen


def test_a_fresh_jobs_stream_waits_for_its_first_event_without_asking_the_database():
    names, seen = _events(fresh=True)
    assert names == ["delta", "final"]
    assert seen[0] == "delta"  # the only lookup is the final view's


def test_a_stream_of_an_existing_job_asks_the_database_when_redis_has_nothing():
    names, seen = _events(fresh=False)
    assert names == ["delta", "final"]
    assert seen[0] == "view"
