"""The Batch API's store: a batch's row, its status and request counts, its lease, cancelling and expiring it
(SQL through SQLAlchemy, like inferq/jobs/). No HTTP and no OpenAI shapes here: the API layer passes in how a
line becomes a job (``batch_feed``) and how a finished job is written out (``batch_output``).

A batch moves ``validating`` (created) -> ``in_progress`` (its lines are being submitted as batch-tier jobs,
a chunk at a time, by the API process that holds its lease) -> ``finalizing`` (every line ended: the output
and error files are being written) -> ``completed``. A cancel makes it ``cancelling`` (its queued jobs are
cancelled at once, its running ones aborted by their workers) and then ``cancelled``; when its completion
window passes first, its queued jobs and unsubmitted lines expire (its jobs' deadline is the window's end)
and it ends ``expired``. Each move is a conditional UPDATE on the status, so two API processes never both
make it. ``failed`` (OpenAI's "the input did not validate") never happens here: the input is validated line
by line at upload, and its endpoints when the batch is created (a 400 then).

``batch_requests`` links each line to the job it became (or says why it never became one); the counts are
read from the jobs through it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, select, tuple_, update
from sqlalchemy.orm import Session, sessionmaker

from inferq import jobs
from inferq.db import Batch, BatchRequest, Job, StoredFile, as_aware, utcnow
from inferq.jobs.bulk import finish_queued_many, publish_done_many
from inferq.jobs.lifecycle import Outcome
from inferq.log import get_logger
from inferq.settings import Settings

log = get_logger("inferq.batches")

ACTIVE = ("validating", "in_progress", "cancelling", "finalizing")
FEEDING = ("validating", "in_progress")
LEASE_SECONDS = 30.0  # a driver renews its lease at every step (about every second); a dead one's lapses
STOP_CHUNK = 1000
CANCELLED = Outcome(status="cancelled", finish_reason="abort", error="cancelled with its batch")
EXPIRED = Outcome(status="expired", finish_reason="deadline", error="the batch's completion window passed")


class BatchInputError(ValueError):
    """The batch cannot be made from this input (a 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


@dataclass
class Counts:
    """A batch's requests: ``succeeded`` and ``failed`` (failed, cancelled or expired jobs, and lines that
    never became jobs) are OpenAI's ``completed`` and ``failed``; ``linked``: lines submitted or failed."""

    total: int
    succeeded: int = 0
    failed: int = 0
    queued: int = 0
    running: int = 0
    linked: int = 0

    @property
    def unfinished(self) -> int:
        return self.queued + self.running

    def as_openai(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.succeeded, "failed": self.failed}


def create_batch(session_factory: sessionmaker, tenant_id: str, input_file: StoredFile, endpoint: str,
                 metadata: dict[str, str] | None, window_seconds: float) -> Batch:
    """Store a new ``validating`` batch of ``input_file``'s lines; ``BatchInputError`` when a line asks for
    another endpoint (named with its line number)."""
    other = [(line, url) for url, line in (input_file.endpoints or {}).items() if url != endpoint]
    if other:
        line, url = min(other)
        raise BatchInputError(f"line {line} of {input_file.id} is a request to {url}, but the batch's endpoint is "
                              f"{endpoint}: every line must use the batch's endpoint", param="endpoint")
    now = utcnow()
    batch = Batch(id=new_batch_id(), tenant_id=tenant_id, endpoint=endpoint, input_file_id=input_file.id,
                  completion_window="24h", status="validating", meta=metadata, total=input_file.line_count,
                  next_line=1, completed=0, failed=0, created_at=now,
                  expires_at=now + dt.timedelta(seconds=window_seconds))
    with session_factory() as session:
        session.add(batch)
        session.commit()
    log.info("batch created", batch_id=batch.id, tenant=tenant_id, requests=batch.total, endpoint=endpoint)
    return batch


def get_batch(session: Session, tenant_id: str, batch_id: str) -> Batch | None:
    """The tenant's batch, or None (another tenant's batch is None too)."""
    batch = session.get(Batch, batch_id)
    return batch if batch is not None and batch.tenant_id == tenant_id else None


def list_batches(session: Session, tenant_id: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    """A page of the tenant's batches, newest first, and whether more follow; ``after``: the last batch id of
    the previous page (``KeyError`` when it is not the tenant's)."""
    stmt = select(Batch).where(Batch.tenant_id == tenant_id)
    if after:
        cursor = get_batch(session, tenant_id, after)
        if cursor is None:
            raise KeyError(after)
        stmt = stmt.where(tuple_(Batch.created_at, Batch.id) < tuple_(cursor.created_at, cursor.id))
    rows = list(session.scalars(stmt.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def counts(session: Session, batch: Batch) -> Counts:
    """The batch's request counts: stored once it has ended, else read from its jobs."""
    if batch.status not in ACTIVE:
        return Counts(batch.total, succeeded=batch.completed, failed=batch.failed, linked=batch.total)
    rows = session.execute(
        select(Job.status, func.count()).select_from(BatchRequest)
        .outerjoin(Job, Job.id == BatchRequest.job_id)
        .where(BatchRequest.batch_id == batch.id).group_by(Job.status)).all()
    c = Counts(batch.total)
    for status, n in rows:
        c.linked += n
        if status == "succeeded":
            c.succeeded += n
        elif status == "queued":
            c.queued += n
        elif status == "running":
            c.running += n
        else:  # failed, cancelled, expired, or (no job) a line that never became one
            c.failed += n
    return c


def finished(batch: Batch, c: Counts) -> bool:
    """Whether every line of the batch has ended (so it can be finalized): when cancelled or expired, every job
    it has; otherwise every line submitted (or failed) and every job ended."""
    if batch.status not in ACTIVE:
        return False
    if batch.status == "finalizing" or batch.cancelling_at is not None or batch.expired_at is not None:
        return c.unfinished == 0
    return c.linked >= batch.total and c.unfinished == 0


def take_lease(session_factory: sessionmaker, batch_id: str, owner: str) -> tuple[Batch, bool] | None:
    """Hold (or renew) the batch's lease for ``LEASE_SECONDS``: only its holder submits its lines and moves it
    along. Returns ``(batch, taken_over)`` (``taken_over``: the previous holder's lease had lapsed, so it may
    have died mid-chunk), or None when the batch has ended or another process holds it."""
    now = utcnow()
    until = now + dt.timedelta(seconds=LEASE_SECONDS)
    with session_factory() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status not in ACTIVE:
            return None
        previous = batch.lease_owner
        if previous not in (None, owner) and (as_aware(batch.lease_until) or now) > now:
            return None
        changed = session.execute(
            update(Batch).where(Batch.id == batch_id, Batch.status == batch.status,
                                or_(Batch.lease_owner.is_(None), Batch.lease_owner == owner, Batch.lease_until < now))
            .values(lease_owner=owner, lease_until=until).execution_options(synchronize_session=False)).rowcount
        if changed != 1:
            return None
        session.commit()
    batch.lease_owner, batch.lease_until = owner, until
    return batch, previous not in (None, owner)


def release_lease(session_factory: sessionmaker, batch_id: str, owner: str) -> None:
    with session_factory() as session:
        session.execute(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner)
                        .values(lease_owner=None, lease_until=None).execution_options(synchronize_session=False))
        session.commit()


def unleased(session_factory: sessionmaker, limit: int = 100) -> list[str]:
    """Unfinished batches nobody drives (never started here, or their process died): for a sweep to adopt."""
    now = utcnow()
    with session_factory() as session:
        return list(session.scalars(
            select(Batch.id).where(Batch.status.in_(ACTIVE), or_(Batch.lease_until.is_(None), Batch.lease_until < now))
            .order_by(Batch.created_at).limit(limit)))


def request_cancel(session_factory: sessionmaker, tenant_id: str, batch_id: str) -> Batch | None:
    """``validating``/``in_progress`` -> ``cancelling`` (any other status: unchanged); the batch, or None when
    the tenant has no such batch."""
    now = utcnow()
    with session_factory() as session:
        session.execute(update(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id,
                                            Batch.status.in_(FEEDING))
                        .values(status="cancelling", cancelling_at=now).execution_options(synchronize_session=False))
        session.commit()
        batch = get_batch(session, tenant_id, batch_id)
    if batch is not None and batch.status == "cancelling":
        log.info("batch cancelling", batch_id=batch_id)
    return batch


def expire_if_due(session_factory: sessionmaker, batch: Batch) -> bool:
    """Once the completion window has passed: stamp ``expired_at`` (its lines stop being submitted). True when
    the batch is (now or already) expiring."""
    if batch.expired_at is not None:
        return True
    now = utcnow()
    if batch.status not in FEEDING or (as_aware(batch.expires_at) or now) > now:
        return False
    with session_factory() as session:
        session.execute(update(Batch).where(Batch.id == batch.id, Batch.expired_at.is_(None),
                                            Batch.status.in_(FEEDING))
                        .values(expired_at=now).execution_options(synchronize_session=False))
        session.commit()
        batch.expired_at = session.scalar(select(Batch.expired_at).where(Batch.id == batch.id))
    if batch.expired_at is not None:
        log.info("batch expiring: its completion window passed", batch_id=batch.id)
    return batch.expired_at is not None


def stop_jobs(session_factory: sessionmaker, redis: Any, settings: Settings, batch: Batch) -> int:
    """End what is left of a cancelling or expiring batch, walking its lines once, ``STOP_CHUNK`` at a time in
    line order (a key range of ``batch_requests``, then each job by its key: no plan can make it quadratic):
    its queued jobs ended in bulk (cancelled, or expired), and (cancelling) its running ones aborted by their
    workers. Expiring running jobs end by themselves: their deadline is the window's end. Returns how many jobs
    it ended or asked to stop."""
    outcome = CANCELLED if batch.cancelling_at is not None else EXPIRED
    stopped, after = 0, 0
    while True:
        with session_factory() as session:
            page = session.execute(
                select(BatchRequest.line, Job.id, Job.status, Job.cancel_requested)
                .join(Job, Job.id == BatchRequest.job_id)
                .where(BatchRequest.batch_id == batch.id, BatchRequest.line > after)
                .order_by(BatchRequest.line).limit(STOP_CHUNK)).all()
            ended = finish_queued_many(session, [r[1] for r in page if r[2] == "queued"], outcome)
            session.commit()
        publish_done_many(redis, settings, ended, outcome)
        running = [r[1] for r in page if r[2] == "running" and not r[3]] if outcome is CANCELLED else []
        for job_id in running:
            jobs.cancel(session_factory, redis, settings, job_id)
        stopped += len(ended) + len(running)
        if len(page) < STOP_CHUNK:
            break
        after = page[-1][0]
    if stopped:
        log.info("batch jobs stopped", batch_id=batch.id, jobs=stopped, outcome=outcome.status)
    return stopped


def fed_all(session: Session, batch: Batch) -> bool:
    """Whether every line of the batch has been submitted or recorded as failed (cheap: no counting)."""
    last = session.scalar(select(StoredFile.last_line).where(StoredFile.id == batch.input_file_id))
    return last is None or batch.next_line > last
