"""Server-sent events for one job: text deltas from the per-job Redis stream
(``inferq.contract.events_key``), then one ``final`` event.

Events (``data`` is JSON):

* ``event: delta`` — ``{"text": "..."}``, ``id`` = the Redis stream entry id (resume with ``Last-Event-ID``);
* ``event: reset`` — ``{"attempt": n}``: the job started again (attempt n: its worker died or stopped, or a
  database outage outlasted it) and its text is sent again from the beginning: discard the text received
  so far. Deltas of older attempts that arrive later are not sent (``inferq.jobs.AttemptFilter``);
* ``event: final`` — the job as ``GET /v1/jobs/{id}`` returns it (status, text, finish_reason, usage, cost).

When the stream is gone (expired or never written, e.g. a job cancelled while queued) and the job is
terminal, the whole text from PostgreSQL is sent as one delta, then the final event. While the job is
queued the connection stays open (comment lines keep proxies from timing it out). If Redis or PostgreSQL
fails mid-stream, one ``event: error`` (the usual error envelope) ends it.

Capacity: a stream holds at most one Redis connection at a time (only while it reads), so an API process
serves up to ``sse_max_streams`` streams with a Redis pool of that size (``StreamLimiter``); one more is
refused with 503 before it starts, never left hanging on the pool.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis.exceptions as redis_exc
import sqlalchemy.exc as sa_exc
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.errors import error_body, first_line
from inferq.contract import events_key
from inferq.db import TERMINAL_STATUSES
from inferq.jobs.events import AttemptFilter
from inferq.log import get_logger

log = get_logger("inferq.api")

BLOCK_MS = 1000
DB_CHECK_SECONDS = 2.0
KEEPALIVE_SECONDS = 15.0
FINAL_WAIT_SECONDS = 3.0  # after a stream `final`, how long to wait for PostgreSQL to show the job terminal
_ENTRY_ID = re.compile(r"^\d+-\d+$")
EVENT_NAMES = ("delta", "reset", "final", "error")
KEEPALIVE = ": keepalive\n\n"
Item = tuple[str | None, dict[str, Any] | None, str | None]  # (event, data, id); (None, None, None): keep-alive


def sse_response_doc(description: str, events: tuple[str, ...] | None = EVENT_NAMES) -> dict[str, Any]:
    """The OpenAPI ``responses`` entry of an event stream. OpenAPI 3.1 has a ``text/event-stream`` media
    type's schema describe ONE event (the fields ``event``, ``data``, ``id``, ``retry``), not the stream as
    a string; ``events`` lists the event names it sends (None: events without a name, data lines only)."""
    props: dict[str, Any] = {
        "data": {"type": "string", "description": "The event's data (JSON, or `[DONE]` at the end of an "
                                                  "OpenAI-style stream)."},
        "id": {"type": "string", "description": "Resume after this event with `Last-Event-ID`."},
        "retry": {"type": "integer", "minimum": 0},
    }
    required = ["data"]
    if events:
        props["event"] = {"type": "string", "enum": list(events)}
        required.append("event")
    schema = {"type": "object", "properties": props, "required": required}
    return {"content": {"text/event-stream": {"schema": schema}}, "description": description}


class StreamLimiter:
    """Open event streams of this process (all event loops), capped at ``limit`` so that the Redis pool,
    sized to the same limit, can never run out under the streams."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self._lock = threading.Lock()

    def try_acquire(self) -> bool:
        with self._lock:
            if self.open >= self.limit:
                return False
            self.open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.open = max(0, self.open - 1)


class LimitedStreamingResponse(StreamingResponse):
    """Gives its ``StreamLimiter`` slot back however the response ends (finished, client gone, error)."""

    def __init__(self, content: AsyncIterator[str], limiter: StreamLimiter, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._limiter: StreamLimiter | None = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter.release()
            self._limiter = None


# the headers are sent already when these happen: end the stream with an error event, not a traceback
STREAM_OUTAGES = (redis_exc.RedisError, sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)


async def guarded(events: AsyncIterator[str], job_id: str) -> AsyncIterator[str]:
    """``events``, ended by one ``event: error`` if Redis or PostgreSQL fails mid-stream."""
    try:
        async for chunk in events:
            yield chunk
    except STREAM_OUTAGES as exc:
        yield sse("error", outage_body(exc, job_id))


def outage_body(exc: BaseException, job_id: str) -> dict[str, Any]:
    """The ``error`` event's data for a Redis or PostgreSQL failure mid-stream (logged here)."""
    what = "redis" if isinstance(exc, redis_exc.RedisError) else "database"
    log.warning("event stream aborted", job_id=job_id, error=first_line(exc))
    return error_body("unavailable", f"{what} unavailable: {first_line(exc)}")


def sse(event: str, data: dict[str, Any], id_: str | None = None) -> str:
    lines = []
    if id_:
        lines.append(f"id: {id_}")
    lines.append(f"event: {event}")
    lines.append("data: " + json.dumps(data, separators=(",", ":")))
    return "\n".join(lines) + "\n\n"


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def decode_fields(fields: dict[Any, Any]) -> dict[str, Any]:
    """A stream entry as written by ``inferq.jobs.publish_events``: ``event`` (delta | done) and ``data``
    (JSON: ``text`` for deltas; status, finish_reason, error, usage for done). Flat fields (``type``,
    ``text``, ``usage``) are accepted too."""
    raw = {_s(k): _s(v) for k, v in fields.items()}
    out: dict[str, Any] = {}
    data = raw.get("data")
    if data:
        try:
            parsed = json.loads(data)
            if isinstance(parsed, dict):
                out.update(parsed)
        except ValueError:
            pass
    for k, v in raw.items():
        if k == "data":
            continue
        if k == "usage" and v[:1] == "{":
            try:
                out[k] = json.loads(v)
                continue
            except ValueError:
                pass
        out.setdefault(k, v)
    out["kind"] = raw.get("event") or raw.get("type") or "delta"
    return out


def resume_from(last_event_id: str | None) -> str:
    return last_event_id if last_event_id and _ENTRY_ID.match(last_event_id) else "0-0"


async def job_events(aredis: Any, prefix: str, job_id: str, load_view: Callable[[], dict[str, Any] | None],
                     last_event_id: str | None = None) -> AsyncIterator[str]:
    """The SSE stream. ``load_view`` (sync, run in a thread) returns the job's GET view from PostgreSQL."""
    async for name, data, id_ in job_event_items(aredis, prefix, job_id, load_view, last_event_id):
        yield KEEPALIVE if name is None else sse(name, data or {}, id_)


async def job_event_items(aredis: Any, prefix: str, job_id: str, load_view: Callable[[], dict[str, Any] | None],
                          last_event_id: str | None = None, *, fresh: bool = False) -> AsyncIterator[Item]:
    """``job_events`` as ``(event, data, id)`` before SSE formatting: the OpenAI routes re-frame each event,
    so they take it unformatted (no JSON written here only to be parsed back, per token). ``fresh``: the caller
    has just created the job (the OpenAI routes), so the PostgreSQL lookup made when Redis holds nothing of the
    job is skipped: it can only find it queued, and it ran while the worker claimed the job, on the same cores
    as that claim and the prefill; the periodic check below still covers a job that never gets an event."""
    key = events_key(prefix, job_id)
    last = resume_from(last_event_id)
    sent_delta = last != "0-0"
    attempts = AttemptFilter()
    next_db_check = time.monotonic() + DB_CHECK_SECONDS
    last_output = time.monotonic()
    if not fresh and not await aredis.exists(key):  # expired, or nothing published yet: PostgreSQL knows if it is over
        view = await run_in_threadpool(load_view)
        if view is None:
            return
        if view["status"] in TERMINAL_STATUSES and not await aredis.exists(key):
            if view.get("text"):
                yield "delta", {"text": view["text"]}, "text"
            yield "final", view, "final"
            return
    while True:
        resp = await aredis.xread({key: last}, count=256, block=BLOCK_MS)
        if resp:
            for entry_id, raw in resp[0][1]:
                last = _s(entry_id)
                f = decode_fields(raw)
                kind = f["kind"]
                if kind in ("done", "final"):
                    yield "final", await _final_view(load_view, f), "final"
                    return
                for item in _text_events(attempts, kind, f, last):
                    sent_delta = item[0] == "delta"  # after a reset the client holds no text
                    last_output = time.monotonic()
                    yield item
            continue
        now = time.monotonic()
        if now >= next_db_check:
            next_db_check = now + DB_CHECK_SECONDS
            view = await run_in_threadpool(load_view)
            if view is None:  # deleted meanwhile
                return
            if view["status"] in TERMINAL_STATUSES:
                # one last non-blocking read: the final entry may have been added just now
                tail = await aredis.xread({key: last}, count=1)
                if tail:
                    continue
                if not sent_delta and view.get("text"):
                    yield "delta", {"text": view["text"]}, "text"
                yield "final", view, "final"
                return
        if now - last_output >= KEEPALIVE_SECONDS:
            last_output = now
            yield None, None, None


def _text_events(attempts: AttemptFilter, kind: str, fields: dict[str, Any], entry_id: str) -> list[Item]:
    """The events for one stream entry: a ``reset`` when a new attempt starts, then the delta's text unless it
    belongs to an older attempt."""
    verdict = attempts.see(kind, fields.get("attempt"))
    out: list[Item] = []
    if verdict == "reset":
        out.append(("reset", {"attempt": attempts.attempt}, entry_id))
    text = fields.get("text", "") if kind == "delta" and verdict != "drop" else ""
    if text:
        out.append(("delta", {"text": text}, entry_id))
    return out


async def _final_view(load_view: Callable[[], dict[str, Any] | None], fields: dict[str, Any]) -> dict[str, Any]:
    """The job from PostgreSQL (authoritative usage and cost); if the worker published ``final`` before
    committing, wait briefly, then fall back to what the stream entry says."""
    deadline = time.monotonic() + FINAL_WAIT_SECONDS
    view: dict[str, Any] | None = None
    while True:
        view = await run_in_threadpool(load_view)
        if view is None or view["status"] in TERMINAL_STATUSES or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    view = dict(view or {})
    if view.get("status") not in TERMINAL_STATUSES:
        view.setdefault("finish_reason", None)
        if not view.get("finish_reason") and fields.get("finish_reason"):
            view["finish_reason"] = fields["finish_reason"]
        if view.get("usage") is None and isinstance(fields.get("usage"), dict):
            u = fields["usage"]
            view["usage"] = {
                "prompt_tokens": int(u.get("prompt_tokens", 0)),
                "cached_prompt_tokens": int(u.get("cached_prompt_tokens", 0)),
                "completion_tokens": int(u.get("completion_tokens", 0)),
                "total_tokens": int(u.get("prompt_tokens", 0)) + int(u.get("completion_tokens", 0)),
                "compute_seconds": float(u.get("compute_seconds", 0.0)),
            }
        if fields.get("text") and view.get("text") is None:
            view["text"] = fields["text"]
    return view
