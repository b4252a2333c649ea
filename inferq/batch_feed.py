"""Submitting a batch's lines as batch-tier jobs, one chunk per call (``feed``), through ``jobs.submit_many``.

A chunk is at most one part of the input file (its lines are read from PostgreSQL a part at a time) and is
submitted like a group of ``POST /v1/jobs`` requests: one statement, one commit and one Redis MULTI for the
tenant's group, under the same quotas, prices and ledger as any job. A batch submits only while its tenant has
fewer than ``QUEUE_SHARE`` of its queued-jobs limit queued, so the tenant's interactive requests still find
room and the queue never holds more of it than the workers can take soon; the rest waits in the file. A line the quotas
refuse now (429) is retried after ``Retry-After``; a line that can never run is recorded as failed.

Each call records what it submitted (``batch_requests``) and moves ``next_line`` (every line before it is
linked or failed) in one transaction that locks the batch row: a batch cancelled or expired meanwhile gets
the jobs just submitted stopped at once. A process that dies between the submission's commit and that record
leaves jobs without links: the next lease holder links them (``relink_orphans``, from the jobs' metadata).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions as redis_exc
from sqlalchemy import exc as sa_exc
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from inferq import jobs
from inferq.batch_files import split_lines
from inferq.batches import CANCELLED, EXPIRED, FEEDING
from inferq.contract import JobCreate
from inferq.db import Batch, BatchRequest, FilePart, Job, Tenant, as_aware, utcnow
from inferq.jobs import quotas
from inferq.jobs.bulk import finish_queued_many, publish_done_many
from inferq.log import get_logger
from inferq.settings import Settings

log = get_logger("inferq.batches")

FEED_CHUNK = 256
QUEUE_SHARE = 0.5  # batches submit while their tenant's queued jobs are below this share of its limit
WAIT_SECONDS = 1.0
RETRYABLE = (jobs.QuotaExceeded, sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
             redis_exc.ConnectionError, redis_exc.TimeoutError)

# a request line (its JSON object) -> its job, as the endpoint would submit it; raises on an invalid line
Convert = Callable[[dict[str, Any]], JobCreate]
_Link = tuple[int, str, "str | None", "dict[str, str] | None"]  # (line, custom_id, job_id, error)


@dataclass
class FeedResult:
    submitted: int = 0
    retry_after: float | None = None  # quota or outage, or the batch's share is queued: call again after this
    done: bool = True  # nothing left to submit (all lines linked, or the batch stopped feeding)
    throttled: bool = False  # a quota (or an outage) refused some lines: they are tried again


@dataclass
class _Chunk:
    batch_id: str
    tenant: Tenant
    expires_at: dt.datetime
    lines: list[tuple[int, bytes]] = field(default_factory=list)
    next_line: int = 1  # where the following chunk starts, when this one is submitted in full
    room: int = 0


def feed(session_factory: sessionmaker, redis: Any, settings: Settings, batch_id: str, owner: str,
         convert: Convert, max_lines: int = FEED_CHUNK) -> FeedResult:
    """Submit the batch's next lines (at most ``max_lines``, one file part, its queue share) if ``owner``
    holds its lease and it still feeds."""
    with session_factory() as session:
        chunk = _next_chunk(session, settings, batch_id, owner, max_lines)
    if chunk is None:
        return FeedResult()
    if chunk.room <= 0:
        _record(session_factory, redis, settings, chunk.batch_id, [], None)
        return FeedResult(retry_after=WAIT_SECONDS, done=False)
    links, retry_line, retry_after = _submit(session_factory, redis, settings, chunk, convert)
    _record(session_factory, redis, settings, chunk.batch_id, links, retry_line or chunk.next_line)
    submitted = sum(1 for link in links if link[2] is not None)
    return FeedResult(submitted=submitted, retry_after=retry_after, done=False, throttled=retry_line is not None)


def _next_chunk(session: Session, settings: Settings, batch_id: str, owner: str, max_lines: int) -> _Chunk | None:
    batch = session.get(Batch, batch_id)
    if batch is None or batch.lease_owner != owner or batch.status not in FEEDING or batch.expired_at is not None:
        return None
    part = session.scalars(select(FilePart).where(FilePart.file_id == batch.input_file_id,
                                                  FilePart.last_line >= batch.next_line)
                           .order_by(FilePart.seq).limit(1)).first()
    if part is None:
        return None
    tenant = session.get(Tenant, batch.tenant_id)
    assert tenant is not None  # the batch would be gone with it (ON DELETE CASCADE)
    session.expunge(tenant)
    chunk = _Chunk(batch.id, tenant, as_aware(batch.expires_at) or utcnow(), next_line=batch.next_line)
    chunk.room = _queue_room(session, settings, tenant)
    linked = set(session.scalars(select(BatchRequest.line).where(
        BatchRequest.batch_id == batch.id, BatchRequest.line.between(batch.next_line, part.last_line))))
    limit = min(max_lines, max(chunk.room, 0))
    for number, raw in split_lines(part.content, part.first_line):
        if number < batch.next_line:
            continue
        if len(chunk.lines) >= limit:
            break
        chunk.next_line = number + 1
        if number not in linked and raw.strip():
            chunk.lines.append((number, raw))
    return chunk


def _queue_room(session: Session, settings: Settings, tenant: Tenant) -> int:
    """How many more jobs a batch may queue now: up to ``QUEUE_SHARE`` of the tenant's queued-jobs limit, counting
    every queued job of the tenant (its interactive ones and its other batches too), so the rest of the limit
    stays free for them. Counted on the tenant's queued jobs only (partial index ``ix_jobs_tenant_queued``)."""
    max_queued, _ = quotas.limits(settings, tenant)
    queued = session.scalar(select(func.count()).select_from(Job)
                            .where(Job.tenant_id == tenant.id, Job.status == "queued")) or 0
    return max(1, int(max_queued * QUEUE_SHARE)) - queued


def _submit(session_factory: sessionmaker, redis: Any, settings: Settings, chunk: _Chunk,
            convert: Convert) -> tuple[list[_Link], int | None, float | None]:
    """Submit the chunk's lines; returns their links (a job, or why never), the first line to retry (a quota
    or an outage refused it) and after how long."""
    remaining = (chunk.expires_at - utcnow()).total_seconds()
    if remaining <= 0:
        return [], chunk.lines[0][0] if chunk.lines else None, WAIT_SECONDS
    links: list[_Link] = []
    items: list[tuple[int, str, JobCreate]] = []
    retry_line: int | None = None
    retry_after: float | None = None
    for number, raw in chunk.lines:
        custom_id = f"line-{number}"
        try:
            obj = json.loads(raw)
            custom_id = str(obj["custom_id"])
            job = convert(obj)
        except RETRYABLE as exc:  # e.g. Redis down while checking the model: this line and the rest later
            retry_line, retry_after = number, _retry_after(exc)
            break
        except Exception as exc:  # noqa: BLE001 - a line that cannot run: recorded, never retried
            links.append((number, custom_id, None, _line_error(exc)))
            continue
        meta = {**(job.metadata or {}), "batch_id": chunk.batch_id, "custom_id": custom_id}
        items.append((number, custom_id, job.model_copy(update={
            "tier": "batch", "metadata": meta, "deadline_seconds": min(remaining, 7 * 86400.0)})))
    results = jobs.submit_many(session_factory, redis, settings, [(chunk.tenant, job, None) for *_, job in items])
    for (number, custom_id, _), result in zip(items, results, strict=True):
        if isinstance(result, RETRYABLE):
            retry_line = number if retry_line is None else min(retry_line, number)
            retry_after = max(retry_after or 0.0, _retry_after(result))
        elif isinstance(result, Exception):
            links.append((number, custom_id, None, _line_error(result, "submission_failed")))
        else:
            links.append((number, custom_id, result[0].id, None))
    if retry_line is not None:
        log.info("batch submission paused", batch_id=chunk.batch_id, line=retry_line, retry_after=retry_after)
    return links, retry_line, retry_after


def _retry_after(exc: BaseException) -> float:
    return float(getattr(exc, "retry_after", 0.0) or WAIT_SECONDS)


def _line_error(exc: BaseException, default_code: str = "invalid_request") -> dict[str, str]:
    """``{code, message}`` of a line that cannot run (an API error's type, an OpenAI error's code)."""
    code = getattr(exc, "code", None) or getattr(exc, "type", None) or default_code
    return {"code": str(code), "message": str(getattr(exc, "message", None) or exc)[:1000]}


def _record(session_factory: sessionmaker, redis: Any, settings: Settings, batch_id: str, links: list[_Link],
            next_line: int | None) -> None:
    """Link the submitted lines and move ``next_line`` in one transaction, under the batch row's lock: when the
    batch was cancelled or expired meanwhile, the jobs just submitted are stopped in the same transaction."""
    now = utcnow()
    with session_factory() as session:
        batch = session.execute(select(Batch).where(Batch.id == batch_id).with_for_update()).scalar_one_or_none()
        if batch is None:
            return
        duplicates = _insert_links(session, batch_id, links)
        if batch.status in FEEDING and batch.expired_at is None:
            values: dict[str, Any] = {}
            if next_line is not None and next_line > batch.next_line:
                values["next_line"] = next_line
            if batch.status == "validating":
                values.update(status="in_progress", in_progress_at=now)
            if values:
                session.execute(update(Batch).where(Batch.id == batch_id).values(**values)
                                .execution_options(synchronize_session=False))
            outcome = CANCELLED
        else:
            duplicates += [link[2] for link in links if link[2] is not None]
            outcome = CANCELLED if batch.cancelling_at is not None else EXPIRED
        stopped = finish_queued_many(session, duplicates, outcome)
        session.commit()
    publish_done_many(redis, settings, stopped, outcome)


def _insert_links(session: Session, batch_id: str, links: list[_Link]) -> list[str]:
    """Insert the links; a line already linked (another lease holder got there first) keeps its link, and the
    job submitted again for it is returned, to be stopped."""
    if not links:
        return []
    rows = [{"batch_id": batch_id, "line": line, "custom_id": custom_id, "job_id": job_id, "error": error}
            for line, custom_id, job_id, error in links]
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    else:  # pragma: no cover - PostgreSQL in production, SQLite for `inferq up`
        session.execute(insert(BatchRequest.__table__), rows)
        return []
    table = BatchRequest.__table__  # Core, not the ORM's bulk path: one multi-row INSERT (insertmanyvalues)
    stmt = dialect_insert(table).on_conflict_do_nothing().returning(table.c.line)
    inserted = set(session.execute(stmt, rows).scalars())
    return [job_id for line, _, job_id, _ in links if line not in inserted and job_id is not None]


def relink_orphans(session_factory: sessionmaker, redis: Any, settings: Settings, batch_id: str) -> int:
    """Link the jobs a dead lease holder submitted but did not record (found by their ``batch_id`` metadata,
    among the tenant's jobs since the batch was created; they lie at or after ``next_line``). Runs once per
    takeover. Returns how many it linked."""
    with session_factory() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return 0
        linked = select(BatchRequest.job_id).where(BatchRequest.batch_id == batch_id,
                                                   BatchRequest.job_id.is_not(None))
        orphans = {str((meta or {}).get("custom_id")): job_id for job_id, meta in session.execute(
            select(Job.id, Job.meta).where(Job.tenant_id == batch.tenant_id, Job.created_at >= batch.created_at,
                                           Job.meta["batch_id"].as_string() == batch_id, Job.id.not_in(linked)))}
        if not orphans:
            return 0
        links = _lines_of(session, batch, orphans)
        duplicates = _insert_links(session, batch_id, links)
        duplicates += [job_id for cid, job_id in orphans.items() if cid not in {link[1] for link in links}]
        stopped = finish_queued_many(session, duplicates, CANCELLED)
        session.commit()
    publish_done_many(redis, settings, stopped, CANCELLED)
    log.info("batch orphans linked", batch_id=batch_id, orphans=len(orphans), stopped=len(stopped))
    return len(links)


def _lines_of(session: Session, batch: Batch, orphans: dict[str, str]) -> list[_Link]:
    """The links of ``orphans`` (custom_id -> job id), their lines found in the file from ``next_line`` on."""
    links: list[_Link] = []
    parts = session.execute(select(FilePart.seq).where(FilePart.file_id == batch.input_file_id,
                                                       FilePart.last_line >= batch.next_line)
                            .order_by(FilePart.seq)).scalars().all()
    for seq in parts:
        part = session.get(FilePart, (batch.input_file_id, seq))
        assert part is not None
        for number, raw in split_lines(part.content, part.first_line):
            if number >= batch.next_line and raw.strip():
                custom_id = str(json.loads(raw).get("custom_id"))
                if custom_id in orphans:
                    links.append((number, custom_id, orphans[custom_id], None))
        session.expunge(part)
        if len(links) == len(orphans):
            break
    return links
