"""Finalizing a batch: its output file (one line per succeeded request) and its error file (one line per
request that failed, was cancelled or expired, or never became a job), in input order.

Guarded twice, so that two API processes never both write files: a conditional UPDATE claims the batch
(``-> finalizing``, with its lease), committed before any file is written; the files and the final status are
then written in ONE transaction fenced on that claim (a claim that lapsed and was taken over writes nothing).
A process that dies mid-way leaves the batch ``finalizing`` with a lapsing lease, and the next one starts
over. The input is walked a part at a time, with the jobs of that part's lines, and the files are written a
part at a time (``PartWriter``), so a 50,000-line batch is never held in memory.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from inferq.batch_files import PartWriter, new_file_id, split_lines
from inferq.batches import LEASE_SECONDS
from inferq.db import Batch, BatchRequest, FilePart, Job, Result, StoredFile, UsageEntry, utcnow
from inferq.log import get_logger

log = get_logger("inferq.batches")

# (job, its result, its ledger row) of a succeeded request -> the response body (the endpoint's object)
Render = Callable[[Job, "Result | None", "UsageEntry | None"], dict[str, Any]]


def claim(session_factory: sessionmaker, batch_id: str, owner: str) -> bool:
    """Claim the batch for finalizing (``-> finalizing``); also a ``finalizing`` batch whose finalizer's lease
    lapsed. True when this call won."""
    now = utcnow()
    with session_factory() as session:
        won = session.execute(
            update(Batch).where(Batch.id == batch_id, or_(
                Batch.status.in_(("validating", "in_progress", "cancelling")),
                (Batch.status == "finalizing") & or_(Batch.lease_owner == owner, Batch.lease_until < now)))
            .values(status="finalizing", finalizing_at=now, lease_owner=owner,
                    lease_until=now + dt.timedelta(seconds=LEASE_SECONDS))
            .execution_options(synchronize_session=False)).rowcount == 1
        session.commit()
    return won


def finalize(session_factory: sessionmaker, batch_id: str, owner: str, render: Render) -> str | None:
    """Claim, write the output and error files, and end the batch (``completed``, ``cancelled`` or
    ``expired``); returns that status, or None when another process finalizes it."""
    if not claim(session_factory, batch_id, owner):
        return None
    with session_factory() as write, session_factory() as read:
        batch = write.get(Batch, batch_id)
        assert batch is not None
        final = "cancelled" if batch.cancelling_at else "expired" if batch.expired_at else "completed"
        files = _Outputs(write, batch)
        for part in read.execute(select(FilePart.seq, FilePart.first_line, FilePart.last_line, FilePart.requests)
                                 .where(FilePart.file_id == batch.input_file_id).order_by(FilePart.seq)).all():
            _write_part(read, batch, part, files, final, render)
            read.expunge_all()
        output_id, error_id = files.close()
        now = utcnow()
        values: dict[str, Any] = {"status": final, "output_file_id": output_id, "error_file_id": error_id,
                                  "completed": files.succeeded, "failed": files.failed, "lease_owner": None,
                                  "lease_until": None}
        if final != "expired":
            values[f"{final}_at"] = now
        fenced = write.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "finalizing",
                                                   Batch.lease_owner == owner)
                               .values(**values).execution_options(synchronize_session=False)).rowcount == 1
        if not fenced:  # our claim lapsed and another process took over: it writes the files
            write.rollback()
            return None
        write.commit()
    log.info("batch finalized", batch_id=batch_id, status=final, completed=files.succeeded, failed=files.failed)
    return final


class _Outputs:
    """The output and error files of a batch, each created with its first line (none without lines)."""

    def __init__(self, session: Session, batch: Batch) -> None:
        self.session, self.batch = session, batch
        self.writers: dict[str, tuple[StoredFile, PartWriter]] = {}
        self.succeeded = self.failed = 0

    def add(self, kind: str, line: dict[str, Any]) -> None:
        if kind not in self.writers:
            name = f"{self.batch.id}_{kind}.jsonl"
            row = StoredFile(id=new_file_id(), tenant_id=self.batch.tenant_id, filename=name,
                             purpose="batch_output", bytes=0, line_count=0, last_line=0)
            self.session.add(row)
            self.session.flush()
            self.writers[kind] = (row, PartWriter(self.session, row.id))
        _, writer = self.writers[kind]
        writer.add(writer.line_count + 1, json.dumps(line, ensure_ascii=False).encode() + b"\n")
        if kind == "output":
            self.succeeded += 1
        else:
            self.failed += 1

    def close(self) -> tuple[str | None, str | None]:
        for row, writer in self.writers.values():
            writer.flush()
            row.bytes, row.line_count, row.last_line = writer.bytes, writer.line_count, writer.last_line
        self.session.flush()
        ids = {kind: row.id for kind, (row, _) in self.writers.items()}
        return ids.get("output"), ids.get("error")


def _write_part(read: Session, batch: Batch, part: Any, files: _Outputs, final: str, render: Render) -> None:
    """The output or error line of each request of one input part, in line order."""
    rows = {r[0].line: r for r in read.execute(
        select(BatchRequest, Job, Result, UsageEntry)
        .outerjoin(Job, Job.id == BatchRequest.job_id)
        .outerjoin(Result, Result.job_id == Job.id)
        .outerjoin(UsageEntry, UsageEntry.job_id == Job.id)
        .where(BatchRequest.batch_id == batch.id, BatchRequest.line.between(part.first_line, part.last_line)))}
    unlinked: dict[int, str] = {}
    if len(rows) < part.requests:  # lines never submitted (cancelled or expired first): their ids from the file
        content = read.scalar(select(FilePart.content).where(FilePart.file_id == batch.input_file_id,
                                                             FilePart.seq == part.seq)) or b""
        for number, raw in split_lines(content, part.first_line):
            if number not in rows and raw.strip():
                unlinked[number] = str(json.loads(raw).get("custom_id"))
    for line in sorted([*rows, *unlinked]):
        if line in unlinked:
            code = "batch_cancelled" if final == "cancelled" else "batch_expired"
            files.add("error", _error_line(f"{batch.id}_{line}", unlinked[line], code, _REASONS[code]))
            continue
        link, job, result, ledger = rows[line]
        if job is not None and job.status == "succeeded":
            files.add("output", {"id": _request_id(job.id), "custom_id": link.custom_id, "error": None,
                                 "response": {"status_code": 200, "request_id": job.id,
                                              "body": render(job, result, ledger)}})
        else:
            code, message = _failure(batch, link, job)
            files.add("error", _error_line(_request_id(job.id) if job is not None else f"{batch.id}_{line}",
                                           link.custom_id, code, message))


_REASONS = {"batch_cancelled": "the batch was cancelled before this request ran",
            "batch_expired": "the batch's completion window passed before this request finished"}


def _failure(batch: Batch, link: BatchRequest, job: Job | None) -> tuple[str, str]:
    """The error code and message of a request that did not succeed."""
    if job is None:
        error = link.error or {}
        return str(error.get("code") or "submission_failed"), str(error.get("message") or "not submitted")
    if job.status == "failed":
        return "generation_failed", job.error or "the generation failed"
    if job.status == "expired" and batch.expired_at is None:
        return "deadline_exceeded", job.error or "the job's deadline passed"
    if job.status == "cancelled" and batch.cancelling_at is None:
        return "cancelled", job.error or "the job was cancelled"
    code = "batch_cancelled" if batch.cancelling_at is not None else "batch_expired"
    return code, _REASONS[code]


def _request_id(job_id: str) -> str:
    return "batch_req_" + job_id.replace("-", "")


def _error_line(request_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    return {"id": request_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
