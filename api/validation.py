"""Checks on a submission beyond ``JobCreate`` itself, shared by REST and Celery: webhook URLs that must not
be called. (NUL characters, which PostgreSQL cannot store, are refused by ``JobCreate`` itself.)"""

from __future__ import annotations

from api.webhooks import UnsafeURL, check_webhook_url
from inferq.contract import NUL_REASON, JobCreate

NO_NUL_PATTERN = "^[^\\u0000]*$"  # the same rule, for the OpenAPI document (see api.app._refine_openapi)

__all__ = ["NO_NUL_PATTERN", "NUL_REASON", "body_errors"]


def body_errors(body: JobCreate, allowlist: list[str]) -> list[dict[str, str]]:
    """Each problem as ``{"field", "reason"}`` (empty when the body can be submitted)."""
    errors: list[dict[str, str]] = []
    if body.webhook_url is not None:
        try:
            check_webhook_url(body.webhook_url, allowlist)
        except UnsafeURL as exc:
            errors.append({"field": "webhook_url", "reason": str(exc)})
    return errors
