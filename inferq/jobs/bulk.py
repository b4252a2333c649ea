"""Ending many queued jobs at once (a batch cancelled or expired): ``lifecycle.finish``'s rules, in bulk.

One conditional UPDATE (``status = 'queued'``: a job a worker claimed meanwhile is left to its worker), then
each job's result row and its one ledger row (zero tokens, zero cost) in the same transaction, as ``finish``
writes them one job at a time; then one Redis pipeline publishes their final events, so anyone following a
job's event stream sees it end. A worker that later reads such a job's message finds it no longer queued and
drops it (its claim fails).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from inferq.db import TRANSITIONS, Job, Result, UsageEntry, utcnow
from inferq.jobs.events import done_event, publish_events
from inferq.jobs.lifecycle import Outcome
from inferq.log import get_logger
from inferq.settings import Settings

log = get_logger("inferq.jobs")


def finish_queued_many(session: Session, job_ids: Sequence[str], outcome: Outcome) -> list[str]:
    """Move those of ``job_ids`` still queued to ``outcome.status`` with their result and ledger rows, in the
    caller's transaction (does not commit). Returns the ids it ended."""
    if outcome.status not in TRANSITIONS["queued"] - {"running"}:
        raise ValueError(f"illegal job transition queued -> {outcome.status}")
    if not job_ids:
        return []
    now = utcnow()
    values: dict[str, Any] = {"status": outcome.status, "finished_at": now, "error": outcome.error}
    if outcome.status == "cancelled":
        values["cancel_requested"] = True
    rows = session.execute(
        update(Job).where(Job.id.in_(list(job_ids)), Job.status == "queued").values(**values)
        .returning(Job.id, Job.tenant_id, Job.model, Job.tier, Job.price_id)
        .execution_options(synchronize_session=False)).all()
    if not rows:
        return []
    session.execute(insert(Result.__table__), [  # Core: a multi-row INSERT, no ORM bookkeeping
        {"job_id": r[0], "text": "", "finish_reason": outcome.finish_reason, "token_ids": None, "created_at": now}
        for r in rows])
    session.execute(insert(UsageEntry.__table__), [
        {"job_id": r[0], "tenant_id": r[1], "model": r[2], "tier": r[3], "status": outcome.status,
         "prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 0, "compute_seconds": 0.0,
         "cost_micros": 0, "price_id": r[4], "created_at": now}
        for r in rows])
    return [r[0] for r in rows]


def publish_done_many(redis: Any, settings: Settings, job_ids: Sequence[str], outcome: Outcome) -> None:
    """The final event of each job, in one pipeline; a Redis failure is logged, never raised (the results are
    in PostgreSQL, where a follower's stream falls back to)."""
    if not job_ids:
        return
    try:
        pipe = redis.pipeline(transaction=False)
        for job_id in job_ids:
            publish_events(pipe, settings, job_id, done_event(outcome))
        pipe.execute()
    except Exception as exc:  # noqa: BLE001 - best effort, as publish_done
        log.warning("could not publish final events", jobs=len(job_ids), error=str(exc))
