"""The job as clients see it: one dict shared by GET /v1/jobs/{id}, the job list, the Celery
``inferq.generate`` result and the webhook body (so all four always agree)."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferq.contract import events_key
from inferq.db import Job, Result, UsageEntry
from inferq.jobs import final_text
from inferq.log import get_logger

log = get_logger("inferq.api")


def dollars(micros: int) -> str:
    sign = "-" if micros < 0 else ""
    micros = abs(int(micros))
    return f"{sign}{micros // 1_000_000}.{micros % 1_000_000:06d}"


def iso(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    if t.tzinfo is None:  # SQLite hands back naive UTC
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.isoformat()


_SURROGATE = re.compile("[\ud800-\udfff]")


def readable_json(value: Any) -> Any:
    """``value`` with any lone surrogate replaced by U+FFFD: a row stored before such text was refused (a JSON
    column can hold a ``\\ud800`` escape) must still render as UTF-8, never as a 500 on every GET and list."""
    if isinstance(value, str):
        return value if value.isascii() or not _SURROGATE.search(value) else _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {readable_json(str(k)): readable_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [readable_json(v) for v in value]
    return value


def job_view(job: Job, result: Result | None = None, ledger: UsageEntry | None = None) -> dict[str, Any]:
    base = f"/v1/jobs/{job.id}"
    usage = cost = None
    if ledger is not None:
        usage = {
            "prompt_tokens": ledger.prompt_tokens,
            "cached_prompt_tokens": ledger.cached_prompt_tokens,
            "completion_tokens": ledger.completion_tokens,
            "total_tokens": ledger.prompt_tokens + ledger.completion_tokens,
            "compute_seconds": float(ledger.compute_seconds or 0.0),
            "spec_proposed_tokens": int(ledger.spec_proposed_tokens or 0),
            "spec_accepted_tokens": int(ledger.spec_accepted_tokens or 0),
        }
        cost = {"micros": int(ledger.cost_micros), "dollars": dollars(ledger.cost_micros)}
    return {
        "id": job.id,
        "object": "job",
        "status": job.status,
        "model": job.model,
        "tier": job.tier,
        "priority": job.priority or 0,
        "text": result.text if result is not None else None,
        "finish_reason": result.finish_reason if result is not None else None,
        "error": job.error,
        "usage": usage,
        "cost": cost,
        "timings": {
            "created_at": iso(job.created_at),
            "queued_at": iso(job.queued_at),
            "started_at": iso(job.started_at),
            "first_token_at": iso(job.first_token_at),
            "finished_at": iso(job.finished_at),
            "deadline_at": iso(job.deadline_at),
        },
        "attempts": job.attempts or 0,
        "cancel_requested": bool(job.cancel_requested),
        "idempotency_key": job.idempotency_key,
        "webhook_url": job.webhook_url,
        "metadata": readable_json(job.meta) if job.meta else job.meta,
        "links": {"self": base, "events": f"{base}/events", "cancel": f"{base}/cancel"},
    }


def full_view(session: Session, job: Job) -> dict[str, Any]:
    result = session.get(Result, job.id)
    ledger = session.scalar(select(UsageEntry).where(UsageEntry.job_id == job.id))
    return job_view(job, result, ledger)


def get_job_view(session: Session, job_id: str, tenant_id: str | None = None) -> dict[str, Any] | None:
    """One query for the job, its result and its ledger row."""
    row = session.execute(
        select(Job, Result, UsageEntry)
        .outerjoin(Result, Result.job_id == Job.id)
        .outerjoin(UsageEntry, UsageEntry.job_id == Job.id)
        .where(Job.id == job_id)
    ).first()
    if row is None or (tenant_id is not None and row[0].tenant_id != tenant_id):
        return None
    return job_view(row[0], row[1], row[2])


def text_so_far(redis: Any, prefix: str, job_id: str) -> str | None:
    """The text a running job has generated so far: the ``delta`` events of its current attempt joined (the
    job's result row is written only at the end). None when the event stream is gone or Redis does not answer: a poll still
    works, only without the partial text."""
    try:
        entries = redis.xrange(events_key(prefix, job_id))
    except Exception as exc:  # Redis down: the rest of the view comes from PostgreSQL
        log.warning("no partial text: redis unavailable", job_id=job_id, error=str(exc)[:200])
        return None
    if not entries:
        return None
    decoded = [{**_json_object(fields.get(b"data")), "event": fields.get(b"event", b"").decode()} for _, fields in entries]
    return readable_json(final_text(decoded))  # the newest attempt's deltas only (a retried job starts over)


def _json_object(data: bytes | None) -> dict[str, Any]:
    try:
        value = json.loads(data or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
