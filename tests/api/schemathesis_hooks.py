"""schemathesis hooks for the CLI run in tests/api/test_contract.py (loaded through ``SCHEMATHESIS_HOOKS``).

A generated ``webhook_url`` that matches the schema's pattern gets a host the test's API allow-lists: whether
a host resolves to public addresses depends on DNS at the time of the call, which no schema can say (and
resolving generated names would only wait for DNS timeouts). A value that breaks the pattern is sent as
generated, so the API must still refuse it."""

from __future__ import annotations

import re
from typing import Any

import schemathesis

from inferq.contract import WEBHOOK_URL_PATTERN

ALLOWED_HOOK = "http://127.0.0.1:9/hook"
_SYNTAX = re.compile(WEBHOOK_URL_PATTERN)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("webhook_url"), str) and _SYNTAX.fullmatch(body["webhook_url"]):
        body["webhook_url"] = ALLOWED_HOOK


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """``/readyz`` answers 503 by design while a dependency is missing (here: no worker serves a model yet),
    as documented; schemathesis counts every 5xx as a server error. Every other failure is kept."""
    documented_not_ready = case.operation.path == "/readyz" and response.status_code == 503
    return not (documented_not_ready and type(failure).__name__ == "ServerError")
