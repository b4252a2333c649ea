"""Checks on a submission beyond ``JobCreate`` itself, shared by REST and Celery: webhook URLs that must not
be called. (NUL characters, which PostgreSQL cannot store, are refused by ``JobCreate`` itself.) Also the
query parameter types whose text form must be exactly what the OpenAPI document says."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from pydantic import BeforeValidator

from api.webhooks import UnsafeURL, check_webhook_url
from inferq.contract import NUL_REASON, JobCreate

NO_NUL_PATTERN = "^[^\\u0000]*$"  # the same rule, for the OpenAPI document (see api.app._refine_openapi)

__all__ = ["NO_NUL_PATTERN", "NUL_REASON", "IsoDate", "IsoDateTime", "body_errors"]


def _iso_datetime(value: Any) -> Any:
    """Only ISO 8601 text is a ``date-time`` (pydantic would also take ``0.5`` as Unix seconds)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            return dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        except ValueError:
            raise ValueError("not an ISO 8601 datetime (e.g. 2026-01-31T12:00:00Z)") from None
    return value


def _iso_date_or_datetime(value: Any) -> Any:
    """An ISO 8601 date (``YYYY-MM-DD``) or datetime; numbers are neither."""
    if isinstance(value, str) and len(value.strip()) == 10:
        try:
            return dt.date.fromisoformat(value.strip())
        except ValueError:
            pass
    try:
        return _iso_datetime(value)
    except ValueError:
        raise ValueError("not a date (YYYY-MM-DD) or an ISO 8601 datetime") from None


IsoDateTime = Annotated[dt.datetime, BeforeValidator(_iso_datetime)]
IsoDate = Annotated[dt.datetime | dt.date, BeforeValidator(_iso_date_or_datetime)]


def body_errors(body: JobCreate, allowlist: list[str]) -> list[dict[str, str]]:
    """Each problem as ``{"field", "reason"}`` (empty when the body can be submitted)."""
    errors: list[dict[str, str]] = []
    if body.webhook_url is not None:
        try:
            check_webhook_url(body.webhook_url, allowlist)
        except UnsafeURL as exc:
            errors.append({"field": "webhook_url", "reason": str(exc)})
    return errors
