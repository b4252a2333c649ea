"""Checks on a submission beyond ``JobCreate`` itself, shared by REST and Celery: text PostgreSQL cannot
store (NUL characters in fields the job request keeps) and webhook URLs that must not be called."""

from __future__ import annotations

from api.webhooks import UnsafeURL, check_webhook_url
from inferq.contract import JobCreate

NO_NUL_PATTERN = "^[^\\u0000]*$"
NUL_REASON = "must not contain NUL (\\u0000) characters"


def body_errors(body: JobCreate, allowlist: list[str]) -> list[dict[str, str]]:
    """Each problem as ``{"field", "reason"}`` (empty when the body can be submitted)."""
    errors: list[dict[str, str]] = []
    if body.model is not None and "\x00" in body.model:
        errors.append({"field": "model", "reason": NUL_REASON})
    if body.prompt is not None and "\x00" in body.prompt:
        errors.append({"field": "prompt", "reason": NUL_REASON})
    for i, m in enumerate(body.messages or []):
        if "\x00" in m.content:
            errors.append({"field": f"messages.{i}.content", "reason": NUL_REASON})
    for i, s in enumerate(body.stop):
        if "\x00" in s:
            errors.append({"field": f"stop.{i}", "reason": NUL_REASON})
    if body.webhook_url is not None:
        try:
            check_webhook_url(body.webhook_url, allowlist)
        except UnsafeURL as exc:
            errors.append({"field": "webhook_url", "reason": str(exc)})
    return errors
