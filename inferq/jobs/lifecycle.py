"""The job lifecycle in SQL: status transitions, a worker's claim and heartbeat, finishing, cancelling.

Every change is a conditional UPDATE (``... WHERE id = ? AND status IN (...)``, optionally fenced on the
attempt number and the worker) so exactly one caller wins a race and a worker whose job was taken over
cannot write a result; ``finish`` writes the result row and the job's one ledger row in the same transaction
as the status change. Nothing here commits except ``cancel``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from inferq.contract import cancel_channel
from inferq.db import TERMINAL_STATUSES, TRANSITIONS, Job, Price, Result, UsageEntry, cost_micros, utcnow
from inferq.jobs.events import publish_done
from inferq.log import get_logger
from inferq.settings import Settings

log = get_logger("inferq.jobs")

# finish reason (engine) -> terminal job status
STATUS_FOR_FINISH = {"stop": "succeeded", "length": "succeeded", "abort": "cancelled", "deadline": "expired",
                     "error": "failed"}


def stale_after_seconds(settings: Settings) -> float:
    """A running job whose heartbeat is older than this belongs to a dead (or partitioned) worker."""
    return max(settings.claim_idle_ms / 1000.0, 3.0 * settings.heartbeat_seconds)


def worker_key(prefix: str, worker: str) -> str:
    """Redis hash with a worker's live statistics (busy_seconds, steps, in-flight jobs, ...)."""
    return f"{prefix}:worker:{worker}"


def _check_transition(from_statuses: Iterable[str], to_status: str) -> list[str]:
    froms = [from_statuses] if isinstance(from_statuses, str) else list(from_statuses)
    for f in froms:
        if to_status not in TRANSITIONS.get(f, frozenset()) and not (f == to_status == "running"):
            raise ValueError(f"illegal job transition {f} -> {to_status}")
    return froms


def transition(session: Session, job_id: str, from_statuses: Iterable[str] | str, to_status: str, *,
               where: Sequence[Any] = (), **values: Any) -> bool:
    """``UPDATE jobs SET status=to_status, **values WHERE id=job_id AND status IN from_statuses [AND where]``.
    True when this call made the change (exactly one caller wins a race). Does not commit.
    ``running -> running`` is the takeover of a job whose worker is gone (pass a staleness condition)."""
    froms = _check_transition(from_statuses, to_status)
    if to_status in TERMINAL_STATUSES:
        values.setdefault("finished_at", utcnow())
    stmt = (update(Job).where(Job.id == job_id, Job.status.in_(froms), *where)
            .values(status=to_status, **values).execution_options(synchronize_session=False))
    return session.execute(stmt).rowcount == 1


def claim(session: Session, job_id: str, worker: str, stale_seconds: float) -> tuple[int, bool] | None:
    """A worker takes a job: ``queued -> running``, or ``running -> running`` when the previous worker's
    heartbeat is older than ``stale_seconds`` (it died; its message was reclaimed). Bumps ``attempts``,
    which fences the previous attempt's ``finish``. Returns ``(attempt, cancel_requested)``, or None when
    the job is not there to take (finished, cancelled, expired, or alive on another worker). Does not
    commit."""
    now = utcnow()
    cutoff = now - dt.timedelta(seconds=stale_seconds)
    takeable = (Job.status == "queued") | (
        (Job.status == "running") & (Job.heartbeat_at.is_(None) | (Job.heartbeat_at < cutoff)))
    row = session.execute(
        update(Job).where(Job.id == job_id, takeable)
        .values(status="running", attempts=Job.attempts + 1, worker=worker, started_at=now, heartbeat_at=now)
        .returning(Job.attempts, Job.cancel_requested)
        .execution_options(synchronize_session=False)).first()
    return (int(row[0]), bool(row[1])) if row is not None else None


def heartbeat(session: Session, worker: str, job_ids: Sequence[str]) -> dict[str, tuple[int, bool]]:
    """Refresh ``heartbeat_at`` of this worker's running jobs; returns {job_id: (attempt, cancel_requested)}
    for the jobs it still owns (a missing id was taken over or finished elsewhere). Does not commit."""
    if not job_ids:
        return {}
    rows = session.execute(
        update(Job).where(Job.id.in_(list(job_ids)), Job.status == "running", Job.worker == worker)
        .values(heartbeat_at=utcnow())
        .returning(Job.id, Job.attempts, Job.cancel_requested)
        .execution_options(synchronize_session=False)).all()
    return {r[0]: (int(r[1]), bool(r[2])) for r in rows}


def owned_by(attempt: int, worker: str) -> tuple[Any, Any]:
    """The fence of a worker's own attempt, for ``transition(where=...)``: the update applies only while
    no other worker has taken the job over."""
    return (Job.attempts == attempt, Job.worker == worker)


def status_of(session: Session, job_id: str) -> str | None:
    """The job's status, or None when there is no such job."""
    return session.scalar(select(Job.status).where(Job.id == job_id))


def owner_of(session: Session, job_id: str) -> tuple[str, str | None, int] | None:
    """``(status, worker, attempts)`` of a job, or None: tells a worker whether a result it could not
    confirm was written by it (a lost commit acknowledgement) or the job is no longer its own."""
    row = session.execute(select(Job.status, Job.worker, Job.attempts).where(Job.id == job_id)).first()
    return None if row is None else (row[0], row[1], int(row[2]))


def record_first_tokens(session: Session, first_token_at: dict[str, dt.datetime]) -> None:
    """Set ``first_token_at`` of many jobs in one statement, where it is not set yet. Does not commit."""
    if not first_token_at:
        return
    session.execute(update(Job).where(Job.id.in_(list(first_token_at)), Job.first_token_at.is_(None))
                    .values(first_token_at=case(first_token_at, value=Job.id))
                    .execution_options(synchronize_session=False))


@dataclass
class Outcome:
    """What ``finish`` records for a job reaching a terminal status."""

    status: str
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    compute_seconds: float = 0.0
    error: str | None = None
    spec_proposed_tokens: int = 0  # speculative decoding: proposals verified, and accepted (ledger only)
    spec_accepted_tokens: int = 0
    first_token_at: dt.datetime | None = None


def finish(session: Session, job_id: str, outcome: Outcome, *, from_statuses: Iterable[str] | str = ("running",),
           attempt: int | None = None, worker: str | None = None, where: Sequence[Any] = (),
           **values: Any) -> bool:
    """Move a job to a terminal status and write its result row and its single ledger row, all in the
    caller's transaction (commit afterwards; roll back when False). Fenced: with ``attempt`` the update
    only applies if the job is still on that attempt (a newer worker took it over otherwise)."""
    froms = _check_transition(from_statuses, outcome.status)
    if outcome.status not in TERMINAL_STATUSES:
        raise ValueError(f"{outcome.status} is not a terminal status")
    now = utcnow()
    conds: list[Any] = [Job.id == job_id, Job.status.in_(froms), *where]
    if attempt is not None:
        conds.append(Job.attempts == attempt)
    if worker is not None:
        conds.append(Job.worker == worker)
    vals: dict[str, Any] = {"status": outcome.status, "finished_at": now, **values}
    if outcome.error is not None:
        vals["error"] = outcome.error
    if outcome.first_token_at is not None:
        vals["first_token_at"] = func.coalesce(Job.first_token_at, outcome.first_token_at)
    row = session.execute(update(Job).where(*conds).values(**vals)
                          .returning(Job.tenant_id, Job.model, Job.tier, Job.price_id)
                          .execution_options(synchronize_session=False)).first()
    if row is None:
        return False
    tenant_id, model, tier, price_id = row
    price = session.get(Price, price_id) if price_id is not None else None
    session.add(Result(job_id=job_id, text=(outcome.text or "").replace("\x00", "\ufffd"), finish_reason=outcome.finish_reason,
                       token_ids=outcome.token_ids, created_at=now))
    session.add(UsageEntry(
        job_id=job_id, tenant_id=tenant_id, model=model, tier=tier, status=outcome.status,
        prompt_tokens=outcome.prompt_tokens, cached_prompt_tokens=outcome.cached_prompt_tokens,
        completion_tokens=outcome.completion_tokens, compute_seconds=float(outcome.compute_seconds),
        spec_proposed_tokens=outcome.spec_proposed_tokens, spec_accepted_tokens=outcome.spec_accepted_tokens,
        cost_micros=cost_micros(outcome.prompt_tokens, outcome.cached_prompt_tokens, outcome.completion_tokens, price),
        price_id=price_id, created_at=now))
    session.flush()
    return True


def cancel(session_factory: sessionmaker, redis: Any, settings: Settings, job_id: str,
           tenant_id: str | None = None) -> Job | None:
    """Cancel a job. Queued: cancelled at once (result + zero ledger row). Running: ``cancel_requested`` is
    set and the worker is nudged on ``cancel_channel``; it aborts the request within one engine step and
    the job ends ``cancelled`` (paying for what was computed). Terminal: unchanged. Returns the job (None
    when unknown or owned by another tenant)."""
    for _ in range(5):
        with session_factory() as session:
            job = session.get(Job, job_id)
            if job is None or (tenant_id is not None and job.tenant_id != tenant_id):
                return None
            if job.status in TERMINAL_STATUSES:
                return job
            if job.status == "queued":
                outcome = Outcome(status="cancelled", finish_reason="abort", error="cancelled")
                if finish(session, job_id, outcome, from_statuses=("queued",), cancel_requested=True):
                    session.commit()
                    publish_done(redis, settings, job_id, outcome)
                    log.info("queued job cancelled", job_id=job_id)
                    session.refresh(job)
                    return job
            elif job.status == "running":
                changed = session.execute(
                    update(Job).where(Job.id == job_id, Job.status == "running").values(cancel_requested=True)
                    .execution_options(synchronize_session=False)).rowcount
                if changed:
                    session.commit()
                    try:
                        redis.publish(cancel_channel(settings.stream_prefix), job_id)
                    except Exception as exc:  # the worker also polls the flag at each heartbeat
                        log.warning("cancel publish failed", job_id=job_id, error=str(exc))
                    log.info("cancel requested", job_id=job_id)
                    session.refresh(job)
                    return job
            session.rollback()
    with session_factory() as session:
        return session.get(Job, job_id)
