"""Routes whose every error is in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

The Files and Batch routes (api/routes_files.py, api/routes_batches.py) use ``OpenAIRoute``: it turns
FastAPI's validation errors into a 400 naming the parameter (as OpenAI answers), and inferq's own errors
(401 from the key check, 413, 429, 503 when PostgreSQL or Redis is down) into the same shape with their
status, so the official client raises the matching exception with a readable message.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import psycopg
import redis.exceptions as redis_exc
import sqlalchemy.exc as sa_exc
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.errors import ApiError, db_unavailable_reason, first_line, validation_fields
from api.openai_schemas import OpenAIError
from inferq.log import get_logger

log = get_logger("inferq.api.openai")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_exceeded", 503: "server_error"}
_OUTAGES = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, psycopg.OperationalError,
            psycopg.InterfaceError, redis_exc.ConnectionError, redis_exc.TimeoutError)

_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "properties": {k: {"type": ["string", "null"]} for k in ("message", "type", "param", "code")}}}}
_WHY = {400: "Invalid request: `error.param` names the field, `error.message` says why (and which line).",
        401: "Missing or invalid API key.", 404: "No such object for this tenant (other tenants' are 404 too).",
        409: "The file is the input of a batch that has not finished.", 413: "The upload is too large.",
        429: "Quota exceeded; retry after `Retry-After` seconds.", 503: "PostgreSQL or Redis is unavailable."}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses (401 and 503 always), in OpenAI's shape."""
    return {s: {"description": _WHY[s], "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
            for s in sorted({*statuses, 401, 503})}


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def not_found(kind: str, object_id: str, param: str = "id") -> OpenAIError:
    return OpenAIError(404, f"No such {kind}: {object_id[:100]!r}", param=param, code="not_found")


def as_openai(exc: Exception) -> OpenAIError:
    """Any error a route can meet, as an ``OpenAIError`` (re-raises what is not an answer to the client)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        fields = validation_fields(list(exc.errors()))
        param = fields[0]["field"] if fields else None
        return OpenAIError(400, "; ".join(f"{f['field']}: {f['reason']}" for f in fields) or "invalid request",
                           param=param)
    if isinstance(exc, ApiError):
        return OpenAIError(exc.status, exc.message, type_=TYPES.get(exc.status, "invalid_request_error"),
                           param=exc.fields[0]["field"] if exc.fields else None, code=exc.type, headers=exc.headers)
    if isinstance(exc, StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), type_=TYPES.get(exc.status_code, "invalid_request_error"),
                           headers=dict(exc.headers or {}))
    if isinstance(exc, sa_exc.DataError):  # a value PostgreSQL cannot store: the client's input
        return OpenAIError(400, f"value rejected by the database: {first_line(exc)}")
    if isinstance(exc, _OUTAGES):
        log.warning("dependency unavailable", error=str(exc)[:300])
        reason = db_unavailable_reason(exc) if isinstance(exc, sa_exc.SQLAlchemyError | psycopg.Error) else (
            f"redis unavailable: {first_line(exc)}")
        return OpenAIError(503, reason, type_="server_error", headers={"Retry-After": "5"})
    raise exc


class OpenAIRoute(APIRoute):
    """An ``APIRoute`` that answers every error in OpenAI's shape (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - as_openai re-raises what it does not answer
                return error_response(as_openai(exc))

        return route
