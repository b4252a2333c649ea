"""A limit on the size of request bodies (``INFERQ_MAX_REQUEST_BYTES``), answered 413 with a reason.

Why: a body is read and parsed in the API process before any quota applies, so an unbounded one costs
memory and CPU for free. A declared ``Content-Length`` over the limit is refused before anything is read;
a chunked body is counted as it arrives and refused as soon as it passes the limit."""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body


def too_large_reason(limit: int) -> str:
    return f"request body larger than {limit} bytes (INFERQ_MAX_REQUEST_BYTES)"


class BodySizeLimit:
    """Pure ASGI middleware (it must see the body stream, which ``BaseHTTPMiddleware`` would buffer)."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits or {}  # paths with a limit of their own (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _send_413(send, limit)
            return
        await self.app(scope, self._counting(receive, limit), send)

    def _counting(self, receive: Receive, limit: int) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # the route's body parsing re-raises HTTPException as it is
                    raise HTTPException(413, too_large_reason(limit))
            return message

        return counted


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_413(send: Send, limit: int) -> None:
    body = json.dumps(error_body("payload_too_large", too_large_reason(limit))).encode()
    headers: list[Any] = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                          (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
