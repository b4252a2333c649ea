"""SSE over real HTTP: deltas from the per-job Redis stream (written here exactly as the worker writes
them, with inferq.jobs.publish_events), the final event with usage from PostgreSQL, resumption, and the
expired-stream fallback."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from inferq import jobs
from inferq.contract import events_key
from inferq.db import utcnow
from tests.service_fixtures import expected_cost_micros, private_redis  # noqa: F401

pytestmark = pytest.mark.integration

BODY = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}


def read_sse(resp: httpx.Response) -> list[tuple[str, str | None, dict]]:
    events = []
    event, id_, data = None, None, []
    for line in resp.iter_lines():
        if line == "":
            if event is not None or data:
                events.append((event or "message", id_, json.loads("\n".join(data))))
            event, id_, data = None, None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("id:"):
            id_ = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    return events


def _start(db, job_id: str) -> None:
    with db() as s:
        assert jobs.transition(s, job_id, "queued", "running", attempts=1, started_at=utcnow(), worker="w1")
        s.commit()


def _finish(db, redis_client, settings, job_id: str, text: str) -> jobs.Outcome:
    outcome = jobs.Outcome(status="succeeded", text=text, finish_reason="length", prompt_tokens=30,
                           completion_tokens=20, compute_seconds=0.01)
    with db() as s:
        assert jobs.finish(s, job_id, outcome)
        s.commit()
    pipe = redis_client.pipeline()
    jobs.publish_events(pipe, settings, job_id, jobs.done_event(outcome))
    pipe.execute()
    return outcome


def _delta(redis_client, settings, job_id: str, text: str) -> None:
    pipe = redis_client.pipeline()
    jobs.publish_events(pipe, settings, job_id, jobs.delta_event(text, [1]))
    pipe.execute()


def test_sse_live_deltas_then_final(client, tenant, db, redis_client, settings):
    job_id = client.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"]

    def worker() -> None:
        time.sleep(0.3)
        _start(db, job_id)
        for piece in ("Hel", "lo", " world"):
            _delta(redis_client, settings, job_id, piece)
            time.sleep(0.05)
        _finish(db, redis_client, settings, job_id, "Hello world")

    th = threading.Thread(target=worker)
    th.start()
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=tenant.headers, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = read_sse(r)
    th.join()
    assert [e[0] for e in events] == ["delta", "delta", "delta", "final"]
    assert "".join(e[2]["text"] for e in events[:3]) == "Hello world"
    final = events[-1][2]
    assert final["status"] == "succeeded" and final["text"] == "Hello world" and final["finish_reason"] == "length"
    assert final["usage"]["prompt_tokens"] == 30 and final["usage"]["completion_tokens"] == 20
    assert final["cost"]["micros"] == expected_cost_micros(settings, "interactive", prompt=30, cached=0, completion=20)
    assert final["id"] == job_id
    # resume after the first delta: the rest only
    with client.stream("GET", f"/v1/jobs/{job_id}/events",
                       headers={**tenant.headers, "Last-Event-ID": events[0][1]}) as r:
        resumed = read_sse(r)
    assert [e[2].get("text") for e in resumed[:-1]] == ["lo", " world"] and resumed[-1][0] == "final"


def test_sse_stream_expired(serve, settings, tenant, db, private_redis):  # noqa: F811
    """A finished job whose event stream is gone is answered from PostgreSQL at once, without waiting on
    the stream: not a single XREAD (counted on a private Redis server, where only this test runs commands)."""
    import redis

    settings = settings.model_copy(update={"redis_url": private_redis.url})
    redis_client = redis.Redis.from_url(private_redis.url)
    with httpx.Client(base_url=serve(settings), timeout=30) as client:
        job_id = client.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"]
        _start(db, job_id)
        _delta(redis_client, settings, job_id, "partial")
        _finish(db, redis_client, settings, job_id, "The whole text.")
        redis_client.delete(events_key(settings.stream_prefix, job_id))  # as if its TTL had passed
        redis_client.config_resetstat()
        with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=tenant.headers) as r:
            events = read_sse(r)
    xreads = redis_client.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)
    redis_client.close()
    assert xreads == 0, f"{xreads} XREAD calls: the stream was waited on"
    assert [e[0] for e in events] == ["delta", "final"]
    assert events[0][2] == {"text": "The whole text."}
    assert events[1][2]["status"] == "succeeded" and events[1][2]["usage"]["total_tokens"] == 50


def test_sse_cancel_while_queued(client, tenant):
    job_id = client.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"]

    def cancel() -> None:
        time.sleep(0.3)
        client_b = httpx.Client(base_url=str(client.base_url))
        client_b.post(f"/v1/jobs/{job_id}/cancel", headers=tenant.headers)
        client_b.close()

    th = threading.Thread(target=cancel)
    th.start()
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=tenant.headers, timeout=30) as r:
        events = read_sse(r)
    th.join()
    assert [e[0] for e in events] == ["final"]
    assert events[0][2]["status"] == "cancelled" and events[0][2]["finish_reason"] == "abort"


def test_sse_final_from_db_when_no_done_event(client, tenant, db, redis_client, settings):
    """A job that ends without a `done` entry (e.g. the worker could not publish it) still ends the stream,
    from PostgreSQL, without repeating text already sent."""
    job_id = client.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"]
    _start(db, job_id)
    _delta(redis_client, settings, job_id, "Hi")
    with db() as s:
        assert jobs.finish(s, job_id, jobs.Outcome(status="failed", text="Hi", finish_reason="error", error="boom"))
        s.commit()
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=tenant.headers, timeout=30) as r:
        events = read_sse(r)
    assert [e[0] for e in events] == ["delta", "final"]
    assert events[0][2] == {"text": "Hi"}
    assert events[1][2]["status"] == "failed" and events[1][2]["error"] == "boom"


def test_sse_401_404(client, make_tenant):
    a, b = make_tenant(), make_tenant()
    job_id = client.post("/v1/jobs", json=BODY, headers=a.headers).json()["id"]
    assert client.get(f"/v1/jobs/{job_id}/events").status_code == 401
    assert client.get(f"/v1/jobs/{job_id}/events", headers=b.headers).status_code == 404


async def _aread_sse(resp: httpx.Response) -> list[tuple[str, str | None, dict]]:
    lines = [line async for line in resp.aiter_lines()]
    return read_sse(type("Lines", (), {"iter_lines": lambda self: iter(lines)})())


def test_sse_many_concurrent_streams(client, tenant, db, redis_client, settings):
    """More concurrent streams than redis-py's default asyncio pool (100 connections) all get their
    deltas and final event: every stream blocks in XREAD at the same time before anything is published."""
    n = 120
    ids = [client.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"] for _ in range(n)]

    def publish() -> None:
        for jid in ids:
            _start(db, jid)
            _delta(redis_client, settings, jid, f"text-{jid[:8]}")
            _finish(db, redis_client, settings, jid, f"text-{jid[:8]}")

    async def main() -> list[tuple[int, list]]:
        opened = 0
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60, limits=limits) as ac:
            async def consume(jid: str) -> tuple[int, list]:
                nonlocal opened
                async with ac.stream("GET", f"/v1/jobs/{jid}/events", headers=tenant.headers) as r:
                    opened += 1
                    if r.status_code != 200:
                        return r.status_code, []
                    return r.status_code, await _aread_sse(r)

            tasks = [asyncio.create_task(consume(jid)) for jid in ids]
            deadline = time.monotonic() + 30
            while opened < n and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)  # every stream is now blocked in XREAD on its own key
            await asyncio.get_running_loop().run_in_executor(None, publish)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

    results = asyncio.run(main())
    bad = [(jid, r) for jid, r in zip(ids, results, strict=True)
           if isinstance(r, BaseException) or r[0] != 200 or [e[0] for e in r[1]] != ["delta", "final"]]
    assert not bad, f"{len(bad)} of {n} streams failed, e.g. {bad[:3]}"
    for jid, (_, events) in zip(ids, results, strict=True):
        assert events[0][2] == {"text": f"text-{jid[:8]}"} and events[1][2]["status"] == "succeeded"


def test_sse_stream_limit_503(serve, settings, make_tenant, db, redis_client):
    """Above ``sse_max_streams`` open streams a new one is refused with a clear 503; a slot is freed as
    soon as a client disconnects."""
    base = serve(settings.model_copy(update={"sse_max_streams": 2}))
    tenant = make_tenant()
    with httpx.Client(base_url=base, timeout=30) as c:
        ids = [c.post("/v1/jobs", json=BODY, headers=tenant.headers).json()["id"] for _ in range(3)]
        s1 = c.stream("GET", f"/v1/jobs/{ids[0]}/events", headers=tenant.headers)
        s2 = c.stream("GET", f"/v1/jobs/{ids[1]}/events", headers=tenant.headers)
        r1, r2 = s1.__enter__(), s2.__enter__()
        try:
            assert r1.status_code == 200 and r2.status_code == 200
            r3 = c.get(f"/v1/jobs/{ids[2]}/events", headers=tenant.headers)
            assert r3.status_code == 503, r3.text
            err = r3.json()["error"]
            assert err["type"] == "unavailable" and "event streams" in err["message"] and "2" in err["message"]
            assert r3.headers["Retry-After"]
        finally:
            s1.__exit__(None, None, None)
        # the first client went away: its slot comes back (within the XREAD block time)
        _start(db, ids[2])
        _finish(db, redis_client, settings, ids[2], "done")

        def third() -> int:
            with c.stream("GET", f"/v1/jobs/{ids[2]}/events", headers=tenant.headers) as r:
                if r.status_code != 200:
                    return r.status_code
                assert [e[0] for e in read_sse(r)] == ["final"]
                return 200

        deadline = time.monotonic() + 10
        while (code := third()) != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert code == 200
        s2.__exit__(None, None, None)
