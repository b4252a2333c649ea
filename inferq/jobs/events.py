"""A job's event stream (``events_key``): ``delta`` entries with text as it is generated, then one ``done``
entry with the status and usage. Capped and expiring; read by the API's SSE endpoint and the Celery task."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from inferq.contract import events_key
from inferq.log import get_logger
from inferq.settings import Settings

if TYPE_CHECKING:
    from inferq.jobs.lifecycle import Outcome

log = get_logger("inferq.jobs")

EVENT_DELTA = "delta"
EVENT_DONE = "done"


def done_event(outcome: Outcome) -> dict[str, str]:
    """The final event of a job's event stream (fields ``event`` and ``data``, data is JSON)."""
    return {"event": EVENT_DONE, "data": json.dumps({
        "status": outcome.status, "finish_reason": outcome.finish_reason, "error": outcome.error,
        "usage": {"prompt_tokens": outcome.prompt_tokens, "cached_prompt_tokens": outcome.cached_prompt_tokens,
                  "completion_tokens": outcome.completion_tokens,
                  "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                  "compute_seconds": outcome.compute_seconds}})}


def delta_event(text_delta: str, token_ids: list[int] | None) -> dict[str, str]:
    return {"event": EVENT_DELTA, "data": json.dumps({"text": text_delta, "token_ids": token_ids or []})}


def publish_events(pipe: Any, settings: Settings, job_id: str, *events: dict[str, str]) -> None:
    """Queue XADDs of events to the job's capped event stream (plus its TTL) on a Redis pipeline."""
    key = events_key(settings.stream_prefix, job_id)
    for ev in events:
        pipe.xadd(key, ev, maxlen=settings.event_stream_maxlen, approximate=True)
    pipe.expire(key, settings.event_stream_ttl_seconds)


def publish_done(redis: Any, settings: Settings, job_id: str, outcome: Outcome) -> None:
    """Publish the final event now; a Redis failure is logged, never raised (the result is in PostgreSQL)."""
    try:
        pipe = redis.pipeline(transaction=False)
        publish_events(pipe, settings, job_id, done_event(outcome))
        pipe.execute()
    except Exception as exc:
        log.warning("could not publish the final event", job_id=job_id, error=str(exc))
