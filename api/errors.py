"""One error envelope for every non-2xx answer, and the exception handlers that produce it:

    {"error": {"type": "not_found", "message": "no job abc", "fields": []}}

422 lists each bad field with its reason; 429 carries Retry-After; a database or Redis outage is a
503 with the reason (never a 500)."""

from __future__ import annotations

import math
import re
from typing import Any

import psycopg
import redis.exceptions as redis_exc
import sqlalchemy.exc as sa_exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from inferq.log import get_logger

log = get_logger("inferq.api")


class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, *, fields: list[dict[str, str]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.fields = fields or []
        self.headers = headers or {}


def unauthorized(message: str = "missing or invalid API key") -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", what)


def invalid(field: str, reason: str) -> ApiError:
    return ApiError(422, "validation_error", f"{field}: {reason}", fields=[{"field": field, "reason": reason}])


def too_many(message: str, retry_after: float) -> ApiError:
    secs = max(1, math.ceil(retry_after or 1))
    return ApiError(429, "quota_exceeded", message, headers={"Retry-After": str(secs)})


def unavailable(reason: str) -> ApiError:
    return ApiError(503, "unavailable", reason, headers={"Retry-After": "5"})


def error_body(type_: str, message: str, fields: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message, "fields": fields or []}}


def _json(status: int, type_: str, message: str, fields: list[dict[str, str]] | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(type_, message, fields), status_code=status, headers=headers)


def _ascii_safe(text: str) -> str:
    """Text from the request (a field name) rendered so that the answer is always UTF-8: a lone surrogate in a
    JSON key becomes its ``\\ud800`` escape instead of breaking the response."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [_ascii_safe(str(p)) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        where, rest = parts[0], parts[1:]
        if where == "header":
            rest = [r.lower() for r in rest]
        return (".".join(rest) or where) if where == "body" else f"{where}.{'.'.join(rest)}" if rest else where
    return ".".join(parts)


def validation_fields(errors: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for e in errors:
        if e.get("type") == "json_invalid":  # FastAPI's loc is ("body", <character position>): "body.0"
            out.append({"field": "body", "reason": _json_reason(e)})
            continue
        msg = _pattern_reason(e) or str(e.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        out.append({"field": _loc(e.get("loc", ())) or "body", "reason": _ascii_safe(msg)})
    return out


def _json_reason(e: dict[str, Any]) -> str:
    """A body that is not JSON: say so, and where, instead of pydantic's "0: JSON decode error"."""
    loc, detail = e.get("loc", ()), (e.get("ctx") or {}).get("error")
    where = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
    return f"not valid JSON{where}" + (f" ({detail})" if detail else "") + "; send a JSON object"


# a list-of-names pattern such as group_by's: ^(day|model|tier)(,(day|model|tier))*$
_NAME_LIST = re.compile(r"\^\(([\w|]+)\)\(,\(\1\)\)\*\$")


def _pattern_reason(e: dict[str, Any]) -> str | None:
    """A pattern mismatch said in words when the pattern is a comma-separated list of names, not as the
    raw regex (the caller should not have to read one to learn what is allowed)."""
    if e.get("type") != "string_pattern_mismatch":
        return None
    m = _NAME_LIST.fullmatch(str((e.get("ctx") or {}).get("pattern", "")))
    if m is None:
        return None
    got = e.get("input")
    return f"must be a comma-separated list of: {', '.join(m[1].split('|'))}" + (f" (got {got!r})" if got else "")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (a DBAPI error's own message when wrapped), <= 300 chars."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


def db_unavailable_reason(exc: BaseException) -> str:
    return f"database unavailable: {first_line(exc)}"


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> str:
    """Every method some route serves at this path, for a 405's ``Allow`` header (Starlette lists only the
    methods of the first route whose path matched, e.g. ``POST`` alone for ``/v1/jobs``). Asked of the
    routes themselves, method by method, so included routers are covered however they are nested."""
    routes = request.app.router.routes
    served = [m for m in _METHODS
              if any(route.matches({**request.scope, "method": m})[0] == Match.FULL for route in routes)]
    return ", ".join(served)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _json(exc.status, exc.type, exc.message, exc.fields, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        fields = validation_fields(list(exc.errors()))
        message = "; ".join(f"{f['field']}: {f['reason']}" for f in fields) or "invalid request"
        return _json(422, "validation_error", message, fields)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        types = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                 406: "not_acceptable", 413: "payload_too_large", 415: "unsupported_media_type"}
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = allowed_methods(request)
        if exc.status_code == 400:  # FastAPI could not read the body (not UTF-8): invalid input like bad JSON
            reason = "not a JSON document in UTF-8"
            return _json(422, "validation_error", f"body: {reason}", [{"field": "body", "reason": reason}])
        return _json(exc.status_code, types.get(exc.status_code, "error"), str(exc.detail), headers=headers)

    @app.exception_handler(sa_exc.DataError)
    async def _data(_: Request, exc: sa_exc.DataError) -> JSONResponse:
        # a value PostgreSQL cannot store (e.g. a NUL character in a text field): the client's input
        reason = first_line(exc)
        return _json(422, "validation_error", f"value rejected by the database: {reason}",
                     [{"field": "body", "reason": reason}])

    async def _db_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable", error=str(exc)[:300])
        return _json(503, "unavailable", db_unavailable_reason(exc), headers={"Retry-After": "5"})

    # psycopg's own errors too: the admission fast path runs statements on raw pooled psycopg connections
    for cls in (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
                psycopg.OperationalError, psycopg.InterfaceError):
        app.add_exception_handler(cls, _db_down)

    async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable", error=str(exc)[:300])
        return _json(503, "unavailable", f"redis unavailable: {first_line(exc)}", headers={"Retry-After": "5"})

    for rcls in (redis_exc.ConnectionError, redis_exc.TimeoutError, redis_exc.BusyLoadingError):
        app.add_exception_handler(rcls, _redis_down)
