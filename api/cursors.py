"""The job list's page cursor: a keyset position, ``<created_at in microseconds since the epoch>_<job id as 32
hex digits>``; the next page holds the jobs strictly before it (newest first).

Every string that matches ``CURSOR_PATTERN`` is a position, so every cursor the OpenAPI document allows is
one the API accepts (an opaque encoding had strings that matched its pattern yet were refused, ``cursor=0``);
anything else is refused by the pattern itself, with a 422 naming ``query.cursor``."""

from __future__ import annotations

import datetime as dt
import uuid

CURSOR_PATTERN = r"^[0-9]{1,16}_[0-9a-f]{32}$"  # 16 digits of microseconds reach the year 2286
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def encode_cursor(created_at: dt.datetime, job_id: str) -> str:
    """The position of a job: its creation time (naive means UTC) and its id."""
    if created_at.tzinfo is None:
        created_at = created_at.replace(tzinfo=dt.timezone.utc)
    micros = (created_at - _EPOCH) // dt.timedelta(microseconds=1)
    return f"{max(0, micros)}_{uuid.UUID(job_id).hex}"


def decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    """``(created_at, job id)`` of a cursor that matches ``CURSOR_PATTERN`` (the route's query check)."""
    micros, _, hex_id = cursor.partition("_")
    return _EPOCH + dt.timedelta(microseconds=int(micros)), str(uuid.UUID(hex=hex_id))
