"""Issue 18, item 5: a job's event stream after a retry. A worker subprocess (tiny random model) is killed
with SIGKILL mid-job; a second one takes the job over (attempt 2) and generates its text from the beginning.
A client that was reading ``GET /v1/jobs/{id}/events`` all along, and follows docs/API.md (discard the text
it has on ``event: reset``), ends with exactly the job's final text; so does a client that reads the
stream afterwards, and a reader of the stored Redis entries following ``inferq.jobs.final_text``. A delta
that a lost worker of attempt 1 adds late is ignored by all of them. Real uvicorn, PostgreSQL and Redis."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api.events import decode_fields
from api.tenants import create_key, create_tenant
from inferq import jobs
from inferq.contract import events_key
from inferq.db import Tenant
from tests.service_behaviour_helpers import ENDLESS, Service, make_long_context_model
from tests.service_fixtures import private_redis, wait_for  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(170)]


@pytest.fixture
def svc(pg_url, private_redis, tmp_path) -> Iterator[Service]:  # noqa: F811
    s = Service(pg_url, private_redis.url, make_long_context_model(tmp_path / "model"), tmp_path)
    yield s
    s.close()


@pytest.fixture
def api(svc, serve) -> Iterator[tuple[httpx.Client, Tenant]]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    create_tenant(svc.db, name)
    key = create_key(svc.db, name).key
    with svc.db() as s:
        tenant = s.query(Tenant).filter_by(name=name).one()
        s.expunge(tenant)
    with httpx.Client(base_url=serve(svc.settings), timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
        yield c, tenant


def read_events(c: httpx.Client, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """Every ``(event, data)`` of one connection, up to the final event."""
    got: list[tuple[str, dict[str, Any]]] = []
    event, data = None, []
    with c.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and event is not None:
                got.append((event, json.loads("\n".join(data))))
                if event in ("final", "error"):
                    break
                event, data = None, []
    return got


def client_text(events: list[tuple[str, dict[str, Any]]]) -> str:
    """What a client that follows docs/API.md holds at the end: deltas appended, discarded on ``reset``."""
    text = ""
    for event, data in events:
        if event == "reset":
            text = ""
        elif event == "delta":
            text += data["text"]
    return text


def _stored(svc: Service, job_id: str) -> list[dict[str, Any]]:
    return [decode_fields(fields) for _, fields in svc.redis.xrange(events_key(svc.prefix, job_id))]


def _entry_id(raw: bytes) -> tuple[int, int]:
    ms, seq = raw.decode().split("-")
    return int(ms), int(seq)


def _deltas_after(svc: Service, job_id: str, after: tuple[int, int]) -> int:
    """Delta entries added after the entry id ``after`` (by the worker now running the job)."""
    entries = svc.redis.xrange(events_key(svc.prefix, job_id))
    return sum(1 for i, f in entries if _entry_id(i) > after and decode_fields(f)["kind"] == "delta")


def test_text_after_a_takeover_is_exactly_the_final_text(svc, api):
    c, tenant = api
    first = svc.start_worker()
    job_id = svc.submit(tenant=tenant, max_tokens=ENDLESS, ignore_eos=True)  # greedy: both attempts agree
    live: list[tuple[str, dict[str, Any]]] = []
    reader = threading.Thread(target=lambda: live.extend(read_events(c, job_id)), daemon=True)
    reader.start()
    wait_for(lambda: sum(e["kind"] == "delta" for e in _stored(svc, job_id)) >= 5, 60, what="attempt 1's text")
    first.kill9()  # mid-job: its partial text is on the stream and on the live client
    killed_at = _entry_id(svc.redis.xrevrange(events_key(svc.prefix, job_id), count=1)[0][0])
    svc.start_worker()  # reclaims the idle message: attempt 2
    wait_for(lambda: _deltas_after(svc, job_id, killed_at) >= 3, 90, what="attempt 2's text")
    stale = {"event": "delta", "data": json.dumps({"text": "STALE", "token_ids": [], "attempt": 1})}
    svc.redis.xadd(events_key(svc.prefix, job_id), stale)  # what a lost attempt-1 worker might still add
    wait_for(lambda: _deltas_after(svc, job_id, killed_at) >= 7, 60, what="more of attempt 2's text")
    jobs.cancel(svc.db, svc.redis, svc.settings, job_id)
    reader.join(60)

    result, _ = svc.one_result(job_id)
    assert svc.job(job_id).attempts == 2 and result.text
    assert live and live[-1][0] == "final", live[-3:]
    assert live[-1][1]["text"] == result.text
    assert client_text(live) == result.text  # the live client: no repeat, no stale delta
    assert [e for e, _ in live].count("reset") == 1, [e for e, _ in live]
    after = read_events(c, job_id)
    assert client_text(after) == result.text  # a client arriving afterwards
    stored = _stored(svc, job_id)
    assert stored[0]["kind"] == "reset" and stored[0]["attempt"] == 2  # attempt 1's entries are gone
    assert jobs.final_text(stored) == result.text  # the stored entries, read by the documented rule


def test_openai_stream_after_a_takeover_continues_without_repeating(svc, api):
    """OpenAI's stream cannot take text back: after the worker is killed the route holds attempt 2's text
    until it runs past what was sent, so the streamed text stays a prefix of the job's text, with no repeat.
    Seeded sampling: both attempts draw the same tokens, and a random text cannot repeat itself by chance."""
    c, _ = api
    first = svc.start_worker()
    streamed: list[str] = []
    seen: dict[str, str] = {}

    def read() -> None:
        body = {"model": svc.model, "prompt": "hello", "max_tokens": ENDLESS, "stream": True, "temperature": 1.0,
                "seed": 7, "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "id" in chunk:
                    seen["job_id"] = chunk["id"].removeprefix("cmpl-")
                if chunk.get("choices"):
                    streamed.append(chunk["choices"][0].get("text") or "")
                if "error" in chunk:
                    seen["error"] = chunk["error"].get("code") or ""

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: "job_id" in seen and sum(e["kind"] == "delta" for e in _stored(svc, seen["job_id"])) >= 5, 60,
             what="attempt 1's text")
    job_id = seen["job_id"]
    first.kill9()
    killed_at = _entry_id(svc.redis.xrevrange(events_key(svc.prefix, job_id), count=1)[0][0])
    sent_by_attempt_1 = len("".join(streamed))
    svc.start_worker()
    # attempt 2 regenerates attempt 1's text, then goes on: wait until the client got text past it
    wait_for(lambda: _deltas_after(svc, job_id, killed_at) >= 3 and len("".join(streamed)) > sent_by_attempt_1 + 20,
             90, what="attempt 2's text past attempt 1's")
    jobs.cancel(svc.db, svc.redis, svc.settings, job_id)
    reader.join(60)

    result, _ = svc.one_result(job_id)
    text = "".join(streamed)
    assert svc.job(job_id).attempts == 2 and sent_by_attempt_1 > 0
    assert result.text.startswith(text) and len(text) > sent_by_attempt_1, (text[:200], result.text[:200])
    assert seen.get("error") == "cancelled"  # a cancelled job ends with its error
