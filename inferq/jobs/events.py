"""A job's event stream (``events_key``): ``delta`` entries with text as it is generated, then one ``done``
entry with the status and usage. Capped and expiring; read by the API's SSE endpoint and the Celery task.

A job can run more than once (its worker died or was stopped and another took it over, or it was re-run
after a long database outage), and each attempt generates its text from the beginning. So every delta
carries its ``attempt``, and a worker starting attempt N > 1 first replaces the stream with one ``reset``
entry (``attempt`` N): the earlier attempts' text is gone from the stream, and a reader that already
has some of it is told to discard it. A worker that lost its job may still add a few deltas of its old
attempt afterwards (it learns of the takeover at its next heartbeat): readers ignore deltas of an attempt
older than the newest seen. ``AttemptFilter`` is that rule, and ``final_text`` applies it to stored
entries; a reader that follows it ends with exactly the final attempt's text."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from inferq.contract import events_key
from inferq.log import get_logger
from inferq.settings import Settings

if TYPE_CHECKING:
    from inferq.jobs.lifecycle import Outcome

log = get_logger("inferq.jobs")

EVENT_DELTA = "delta"
EVENT_RESET = "reset"
EVENT_DONE = "done"


def done_event(outcome: Outcome) -> dict[str, str]:
    """The final event of a job's event stream (fields ``event`` and ``data``, data is JSON)."""
    return {"event": EVENT_DONE, "data": json.dumps({
        "status": outcome.status, "finish_reason": outcome.finish_reason, "error": outcome.error,
        "usage": {"prompt_tokens": outcome.prompt_tokens, "cached_prompt_tokens": outcome.cached_prompt_tokens,
                  "completion_tokens": outcome.completion_tokens,
                  "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                  "compute_seconds": outcome.compute_seconds,
                  "spec_proposed_tokens": outcome.spec_proposed_tokens,
                  "spec_accepted_tokens": outcome.spec_accepted_tokens}})}


def delta_event(text_delta: str, token_ids: list[int] | None, attempt: int = 1) -> dict[str, str]:
    return {"event": EVENT_DELTA,
            "data": json.dumps({"text": text_delta, "token_ids": token_ids or [], "attempt": attempt})}


def reset_event(attempt: int) -> dict[str, str]:
    """Attempt ``attempt`` starts: discard the text of the earlier ones."""
    return {"event": EVENT_RESET, "data": json.dumps({"attempt": attempt})}


def publish_events(pipe: Any, settings: Settings, job_id: str, *events: dict[str, str]) -> None:
    """Queue XADDs of events to the job's capped event stream (plus its TTL) on a Redis pipeline."""
    key = events_key(settings.stream_prefix, job_id)
    for ev in events:
        pipe.xadd(key, ev, maxlen=settings.event_stream_maxlen, approximate=True)
    pipe.expire(key, settings.event_stream_ttl_seconds)


def publish_reset(pipe: Any, settings: Settings, job_id: str, attempt: int) -> None:
    """Queue the replacement of the job's stream by one ``reset`` entry (a new attempt starts) on a pipeline:
    the earlier attempts' entries are deleted, so a reader starting now never sees their text."""
    pipe.delete(events_key(settings.stream_prefix, job_id))
    publish_events(pipe, settings, job_id, reset_event(attempt))


def publish_done(redis: Any, settings: Settings, job_id: str, outcome: Outcome) -> None:
    """Publish the final event now; a Redis failure is logged, never raised (the result is in PostgreSQL)."""
    try:
        pipe = redis.pipeline(transaction=False)
        publish_events(pipe, settings, job_id, done_event(outcome))
        pipe.execute()
    except Exception as exc:
        log.warning("could not publish the final event", job_id=job_id, error=str(exc))


class AttemptFilter:
    """The readers' rule for a job's events, in stream order: ``see(kind, attempt)`` says whether to ``"keep"``
    an entry, ``"drop"`` it (a delta of an attempt older than the newest seen: a worker that lost the job), or
    ``"reset"`` (discard the text so far: a new attempt starts; also when a newer attempt's delta arrives
    without its ``reset`` entry, e.g. after a resume past it). An entry without ``attempt`` is attempt 1."""

    def __init__(self) -> None:
        self.attempt = 0

    def see(self, kind: str, attempt: Any) -> str:
        n = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 1
        if kind == EVENT_RESET:
            if n < self.attempt:
                return "drop"
            self.attempt = n
            return "reset"
        if kind != EVENT_DELTA:
            return "keep"
        if n < self.attempt:
            return "drop"
        if n > self.attempt:
            newer, self.attempt = self.attempt > 0, n
            return "reset" if newer else "keep"
        return "keep"


def final_text(entries: Iterable[dict[str, Any]]) -> str:
    """The text a reader of stored entries ends with (each entry decoded: ``event`` and the JSON ``data``
    merged, as ``api.events.decode_fields`` gives them): the deltas of the newest attempt only."""
    rule, parts = AttemptFilter(), []
    for entry in entries:
        kind = str(entry.get("event") or entry.get("kind") or EVENT_DELTA)
        verdict = rule.see(kind, entry.get("attempt"))
        if verdict == "reset":
            parts.clear()
        if kind == EVENT_DELTA and verdict != "drop":
            parts.append(str(entry.get("text", "")))
    return "".join(parts)
