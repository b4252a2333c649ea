"""The lines of a batch input file, as OpenAI defines them: ``{"custom_id", "method": "POST", "url", "body"}``.

A line's ``body`` is exactly a ``POST /v1/chat/completions`` or ``POST /v1/completions`` request, so it goes
through the very converters of those routes (api/openai_schemas.py): checked at upload (``check_line``, a
``LineError`` naming the line and the field), made into its batch-tier job when submitted (``to_job``), and
its job's answer written to the output file as the endpoint's own object (``renderer``).
"""

from __future__ import annotations

import json
from typing import Any

from api import openai_schemas as oa
from api.views import job_view
from inferq.batch_files import LineError
from inferq.batch_output import Render
from inferq.contract import JobCreate
from inferq.db import Job, Result, UsageEntry

ENDPOINTS: dict[str, type[oa._Common]] = {"/v1/chat/completions": oa.ChatCompletionRequest,
                                          "/v1/completions": oa.CompletionRequest}
MAX_CUSTOM_ID_CHARS = 512


def check_line(number: int, raw: bytes) -> tuple[str, str] | None:
    """``(custom_id, url)`` of a valid request line, None for a blank line; ``LineError`` otherwise."""
    if not raw.strip():
        return None
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise LineError(number, f"not valid JSON ({exc})") from None
    except RecursionError:  # about a thousand "[" in a line: the parser's own limit, not a server fault
        raise LineError(number, "JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise LineError(number, "must be a JSON object with custom_id, method, url and body")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(number, "custom_id must be a non-empty string", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS or "\x00" in custom_id:
        raise LineError(number, f"custom_id must be at most {MAX_CUSTOM_ID_CHARS} characters, without NUL",
                        "custom_id")
    if obj.get("method") != "POST":
        raise LineError(number, f"method must be \"POST\" (got {str(obj.get('method'))[:40]!r})", "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError(number, f"url must be one of {', '.join(ENDPOINTS)} (got {str(url)[:100]!r})", "url")
    if not isinstance(obj.get("body"), dict):
        raise LineError(number, "body must be a JSON object: the request to the url", "body")
    try:
        to_job(obj)
    except oa.OpenAIError as exc:
        raise LineError(number, f"body: {exc.message}", f"body.{exc.param}" if exc.param else "body") from None
    return custom_id, url


def to_job(obj: dict[str, Any]) -> JobCreate:
    """The batch-tier job of a request line, exactly as its endpoint would submit the body."""
    request = oa.parse(ENDPOINTS[obj["url"]], obj["body"])
    if request.stream:
        raise oa.OpenAIError(400, "stream is not supported in a batch", param="stream")
    return request.to_job("batch")


def renderer(endpoint: str) -> Render:
    """The response body of a succeeded request: the endpoint's ``chat.completion`` / ``text_completion``."""
    build = oa.chat_completion if endpoint == "/v1/chat/completions" else oa.text_completion

    def render(job: Job, result: Result | None, ledger: UsageEntry | None) -> dict[str, Any]:
        return build(job_view(job, result, ledger))

    return render
