"""Files of the OpenAI-compatible Files API, stored in PostgreSQL: a ``files`` row, its bytes in ``file_parts``.

Why PostgreSQL, rather than a directory or an object store: one source of truth (a file, the batch made
from it and that batch's jobs live in one database, backed up and restored together); transactional with the
batch (a batch's output and error files are written in the very transaction that marks it finished, so a
crash leaves neither a finished batch without its files nor files without their batch); and no shared volume
or bucket between API replicas: the database they already share is all they need.

Why parts (``bytea``, at most ``PART_MAX_BYTES`` and ``PART_MAX_LINES`` whole lines each) rather than one
value: an upload is read in chunks and written a part at a time, and a download or a batch's feeding reads a
part at a time, so no process holds a whole file in memory, and PostgreSQL never rewrites a growing value.
Parts hold whole lines, numbered from 1 over the whole file, so a batch takes its requests a part at a time.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import BinaryIO

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from inferq.db import Batch, FilePart, StoredFile

PART_MAX_BYTES = 1 << 20
PART_MAX_LINES = 256
READ_CHUNK_BYTES = 1 << 16
ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "cancelling", "finalizing")

# check_line(number, raw line) -> (custom_id, url) of a request line, None for a blank line; raises LineError
LineCheck = Callable[[int, bytes], "tuple[str, str] | None"]


class LineError(ValueError):
    """A line of an upload that is not a valid request; ``line`` is its number, from 1."""

    def __init__(self, line: int, reason: str, param: str | None = None) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason, self.param = line, reason, param


class UploadTooLarge(ValueError):
    """The upload passed ``INFERQ_BATCH_FILE_MAX_BYTES``."""


class FileInUse(ValueError):
    """The file is the input of a batch that has not finished."""


class UnknownCursor(ValueError):
    """``after`` names no object of this tenant."""


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def iter_lines(stream: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """``(number, line)`` for each line of ``stream`` (the line with its newline), read ``READ_CHUNK_BYTES`` at a
    time; a line longer than ``max_line_bytes`` is a ``LineError``."""
    pending = bytearray()
    number = 0
    while chunk := stream.read(READ_CHUNK_BYTES):
        start = 0
        while (newline := chunk.find(b"\n", start)) >= 0:
            pending += chunk[start:newline + 1]
            start = newline + 1
            number += 1
            if len(pending) > max_line_bytes:
                raise LineError(number, f"longer than {max_line_bytes} bytes")
            yield number, bytes(pending)
            pending.clear()
        pending += chunk[start:]
        if len(pending) > max_line_bytes:
            raise LineError(number + 1, f"longer than {max_line_bytes} bytes")
    if pending:
        yield number + 1, bytes(pending)


def split_lines(content: bytes, first_line: int) -> Iterator[tuple[int, bytes]]:
    """``(number, line)`` of each line of a part whose first line is ``first_line`` (split on newlines only, as
    ``iter_lines`` numbered them)."""
    lines = content.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    for i, raw in enumerate(lines):
        yield first_line + i, raw


class PartWriter:
    """Writes whole lines into the ``file_parts`` of one file; each part is flushed and forgotten by the session
    as soon as it fills, so a long file never accumulates in memory (the caller commits)."""

    def __init__(self, session: Session, file_id: str) -> None:
        self.session, self.file_id = session, file_id
        self.seq = self.first = self.last = self.lines = self.requests = 0
        self.buf = bytearray()
        self.bytes = self.line_count = self.last_line = 0

    def add(self, number: int, raw: bytes, request: bool = True) -> None:
        """Line ``number`` (with its newline); ``request``: a non-blank line."""
        if self.buf and (len(self.buf) + len(raw) > PART_MAX_BYTES or self.lines >= PART_MAX_LINES):
            self.flush()
        if not self.buf:
            self.first = number
        self.buf += raw
        self.last = number
        self.lines += 1
        self.bytes += len(raw)
        if request:
            self.requests += 1
            self.line_count += 1
            self.last_line = number

    def flush(self) -> None:
        if not self.buf:
            return
        part = FilePart(file_id=self.file_id, seq=self.seq, first_line=self.first, last_line=self.last,
                        requests=self.requests, content=bytes(self.buf))
        self.session.add(part)
        self.session.flush()
        self.session.expunge(part)
        self.seq += 1
        self.buf = bytearray()
        self.lines = self.requests = 0


def store_upload(session_factory: sessionmaker, tenant_id: str, filename: str, purpose: str, stream: BinaryIO, *,
                 max_bytes: int, max_lines: int, max_line_bytes: int, check_line: LineCheck) -> StoredFile:
    """Validate ``stream`` line by line while writing it, and commit the file only if every line is valid
    (``LineError`` naming the first bad line, ``UploadTooLarge`` otherwise; nothing is stored then).
    ``custom_id`` must be unique within the file."""
    seen: dict[str, int] = {}
    endpoints: dict[str, int] = {}
    with session_factory() as session:
        row = StoredFile(id=new_file_id(), tenant_id=tenant_id, filename=filename, purpose=purpose, bytes=0,
                         line_count=0, last_line=0)
        session.add(row)
        session.flush()
        writer = PartWriter(session, row.id)
        for number, raw in iter_lines(stream, max_line_bytes):
            if writer.bytes + len(raw) > max_bytes:
                raise UploadTooLarge(f"the file is larger than {max_bytes} bytes (INFERQ_BATCH_FILE_MAX_BYTES)")
            checked = check_line(number, raw)
            if checked is not None:
                custom_id, url = checked
                if custom_id in seen:
                    raise LineError(number, f"custom_id {custom_id[:100]!r} is already used on line "
                                    f"{seen[custom_id]}: each must be unique within the file", "custom_id")
                if writer.line_count >= max_lines:
                    raise LineError(number, f"more than {max_lines} requests in one file (INFERQ_BATCH_MAX_LINES)")
                seen[custom_id] = number
                endpoints.setdefault(url, number)
            writer.add(number, raw, request=checked is not None)
        writer.flush()
        if writer.line_count == 0:
            raise LineError(1, "the file has no requests")
        row.bytes, row.line_count, row.last_line, row.endpoints = (writer.bytes, writer.line_count,
                                                                   writer.last_line, endpoints)
        session.commit()
        return row


def get_file(session: Session, tenant_id: str, file_id: str) -> StoredFile | None:
    """The tenant's file, or None (another tenant's file is None too)."""
    row = session.get(StoredFile, file_id)
    return row if row is not None and row.tenant_id == tenant_id else None


def list_files(session: Session, tenant_id: str, *, purpose: str | None, after: str | None, limit: int,
               ascending: bool) -> tuple[list[StoredFile], bool]:
    """A page of the tenant's files by creation time, and whether more follow; ``after``: the last file id of
    the previous page (``UnknownCursor`` when it is not the tenant's)."""
    stmt = select(StoredFile).where(StoredFile.tenant_id == tenant_id)
    if purpose:
        stmt = stmt.where(StoredFile.purpose == purpose)
    key = tuple_(StoredFile.created_at, StoredFile.id)
    if after:
        cursor = get_file(session, tenant_id, after)
        if cursor is None:
            raise UnknownCursor(f"no file {after[:64]!r}")
        mark = tuple_(cursor.created_at, cursor.id)
        stmt = stmt.where(key > mark if ascending else key < mark)
    order = (StoredFile.created_at.asc(), StoredFile.id.asc()) if ascending else (
        StoredFile.created_at.desc(), StoredFile.id.desc())
    rows = list(session.scalars(stmt.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def iter_content(session_factory: sessionmaker, file_id: str) -> Iterator[bytes]:
    """The file's bytes, one part at a time (a short session per part: a slow reader holds no connection)."""
    seq = 0
    while True:
        with session_factory() as session:
            content = session.scalar(select(FilePart.content).where(FilePart.file_id == file_id,
                                                                    FilePart.seq == seq))
        if content is None:
            return
        yield content
        seq += 1


def delete_file(session_factory: sessionmaker, tenant_id: str, file_id: str) -> bool:
    """Delete the tenant's file and its parts; False when there is none. ``FileInUse`` while it is the input
    of an unfinished batch (the batch still reads its requests from it)."""
    with session_factory() as session:
        row = get_file(session, tenant_id, file_id)
        if row is None:
            return False
        user = session.scalar(select(Batch.id).where(Batch.input_file_id == file_id,
                                                     Batch.status.in_(ACTIVE_BATCH_STATUSES)).limit(1))
        if user is not None:
            raise FileInUse(f"file {file_id} is the input of batch {user}, which has not finished")
        session.delete(row)
        session.commit()
        return True
