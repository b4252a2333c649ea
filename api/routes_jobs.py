"""/v1/jobs: submit, get, list, cancel, events."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy import select, tuple_

from api.admission import Admitted
from api.auth import Principal, require_key
from api.cursors import CURSOR_PATTERN, decode_cursor, encode_cursor
from api.errors import ApiError, invalid, not_found, too_many, unavailable
from api.events import LimitedStreamingResponse, guarded, job_events, sse_response_doc
from api.metrics import REJECTED, SSE_STREAMS, SUBMITTED
from api.reports import to_utc
from api.schemas import ErrorResponse, JobList, JobResponse, JobStatus
from api.validation import IsoDateTime, body_errors
from api.views import get_job_view, job_view, text_so_far
from inferq import jobs
from inferq.contract import JobCreate
from inferq.db import Job, Result, UsageEntry

router = APIRouter(prefix="/v1", tags=["jobs"])

_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")

AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "Missing, invalid or revoked API key."},
    503: {"model": ErrorResponse, "description": "The database or Redis is unreachable (the reason is given)."},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse, "description": "No such job for this tenant (other tenants' jobs are 404 too)."}}
INVALID: dict[int | str, dict[str, Any]] = {422: {"model": ErrorResponse, "description": "Invalid parameters: `error.fields` lists each field and why."}}


def _state(request: Request) -> Any:
    return request.app.state.inferq


def _uuid_or_404(job_id: str) -> str:
    try:
        return str(uuid.UUID(job_id))
    except (ValueError, AttributeError):
        raise not_found(f"no job {job_id[:64]!r}") from None


@router.post(
    "/jobs",
    status_code=202,
    response_model=JobResponse,
    summary="Submit a job",
    description=(
        "Stores the job in PostgreSQL, then queues it on Redis; answers **202** only once the job is durably "
        "stored. With an `Idempotency-Key`, a retry with the same key and body returns the same job (**200**), "
        "and the same key with another body is **409**. Quotas (the tenant's queued jobs, tokens per minute, "
        "the tier's queue cap) answer **429** with `Retry-After`. A `webhook_url` that resolves to a loopback, "
        "private, link-local or metadata address is refused (**422**) unless allow-listed. A model no worker "
        "serves is **404** `model_not_found`; a prompt that does not fit the model's context is **422** "
        "`prompt_too_long`, and one whose `max_tokens` does not fit is **422** `context_length_exceeded` (an "
        "omitted `max_tokens` is lowered to what the context leaves)."
    ),
    responses={
        200: {"model": JobResponse, "description": "Idempotent retry: the job created earlier with this key and body."},
        202: {"description": "Accepted: the job is stored and queued.", "headers": {
            "Location": {"description": "URL of the job.", "schema": {"type": "string"}}}},
        404: {"model": ErrorResponse, "description": "`model_not_found`: no worker serves this model (the message "
              "lists the models served)."},
        409: {"model": ErrorResponse, "description": "Idempotency-Key reused with a different body."},
        429: {"model": ErrorResponse, "description": "Quota exceeded; retry after `Retry-After` seconds.",
              "headers": {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}}},
        **AUTH_ERRORS, **INVALID,
    },
)
async def create_job(
    request: Request,
    body: Annotated[JobCreate, Body(description="The job. Exactly one of prompt, messages or prompt_ids.")],
    principal: Principal = Depends(require_key),
    idempotency_key: Annotated[str | None, Header(
        alias="Idempotency-Key", pattern=r"^[\x21-\x7e]{1,200}$", description="Client-chosen key (1-200 printable ASCII characters): retries with "
        "the same key and body return the same job.", examples=["order-1234"])] = None,
) -> JSONResponse:
    # Parsing, validation and the response stay on the event loop; everything that blocks (the Redis health
    # probe, the database and the XADD) runs on the submit pool, for a group of submissions at a time.
    state = _state(request)
    if idempotency_key is not None and not _IDEMPOTENCY_KEY.match(idempotency_key):
        raise invalid("header.idempotency-key", "must be 1-200 printable ASCII characters without spaces")
    if body.webhook_url is not None:
        # the webhook URL's DNS check may be slow: on a hop of its own, so it never holds up a group
        await asyncio.get_running_loop().run_in_executor(state.submit_executor, _check_webhook, state, body)
    view, created = await state.batcher.submit(principal, body, idempotency_key)
    if created:
        SUBMITTED.labels(body.tier).inc()
    return JSONResponse(view, status_code=202 if created else 200, headers={"Location": f"/v1/jobs/{view['id']}"})


_Submission = tuple[Principal, JobCreate, "str | None"]


class SubmitBatcher:
    """Hands submissions to the submit pool in groups: at most ``max_in_flight`` groups run at once, and the
    submissions that arrive meanwhile wait and go together in the next group (``jobs.submit_many``: one
    statement, one commit and one Redis MULTI per tenant and group). Unloaded, a group is one submission and
    waits for nothing; under load, one thread hop and one round trip serve many requests. Every submission
    still gets its own answer, only after its row is committed."""

    def __init__(self, state: Any, *, max_in_flight: int = 2, max_batch: int = 64) -> None:
        self.state = state
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self.in_flight = 0
        self.pending: list[tuple[Principal, JobCreate, str | None, asyncio.Future[Any]]] = []
        self.scheduled = False

    async def submit(self, principal: Principal, body: JobCreate, key: str | None) -> tuple[dict[str, Any], bool]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self.pending.append((principal, body, key, fut))
        if not self.scheduled and self.in_flight < self.max_in_flight:
            # after this loop iteration: requests parsed in the same iteration join the group
            self.scheduled = True
            loop.call_soon(self._dispatch)
        return await fut

    def _dispatch(self) -> None:
        self.scheduled = False
        loop = asyncio.get_running_loop()
        while self.pending and self.in_flight < self.max_in_flight:
            group, self.pending = self.pending[:self.max_batch], self.pending[self.max_batch:]
            items = [(p, b, k) for p, b, k, _ in group]
            try:
                done = loop.run_in_executor(self.state.submit_executor, _submit_group, self.state, items)
            except RuntimeError as exc:  # the pool is shut down (the app is stopping): answer, never hang
                for *_, fut in group:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.in_flight += 1
            done.add_done_callback(lambda f, group=group: self._finished(f, group))

    def _finished(self, done: asyncio.Future[Any], group: list[Any]) -> None:
        self.in_flight -= 1
        exc = done.exception()
        results = [exc] * len(group) if exc is not None else done.result()
        for (_, _, _, fut), result in zip(group, results, strict=True):
            if fut.done():  # the client went away
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)
        self._dispatch()


def _submit_group(state: Any, items: list[_Submission]) -> list[tuple[dict[str, Any], bool] | Exception]:
    """Runs on the submit pool: each submission's answer (view, created), or the exception to raise for it.
    Each is first checked against its model (``api/admission.py``: served, fits the context)."""
    try:
        state.redis_health.check(state.redis)
    except Exception as exc:  # noqa: BLE001 - every submission of the group gets the 503
        return [exc] * len(items)
    out: list[Any] = [None] * len(items)
    admitted: list[tuple[int, Principal, Admitted, str | None]] = []
    for i, (principal, body, key) in enumerate(items):
        try:
            admitted.append((i, principal, state.admission.admit(body), key))
        except ApiError as exc:
            REJECTED.labels(exc.type).inc()
            out[i] = exc
        except Exception as exc:  # noqa: BLE001 - e.g. Redis down: handed to the request it belongs to
            out[i] = exc
    results = jobs.submit_many(state.session_factory, state.redis, state.settings,
                               [(principal.tenant, a.body, key) for _, principal, a, key in admitted],
                               prompt_tokens=[a.prompt_tokens for _, _, a, _ in admitted])
    for (i, *_), result in zip(admitted, results, strict=True):
        try:
            out[i] = _answer(state, result)
        except Exception as exc:  # noqa: BLE001 - handed to the request it belongs to
            out[i] = exc
    return out


def _check_webhook(state: Any, body: JobCreate) -> None:
    errors = body_errors(body, state.settings.allowlist)
    if errors:
        REJECTED.labels(errors[0]["field"].split(".")[0]).inc()
        raise ApiError(422, "validation_error", "; ".join(f"{e['field']}: {e['reason']}" for e in errors),
                       fields=errors)


def _answer(state: Any, result: tuple[Any, bool] | Exception) -> tuple[dict[str, Any], bool]:
    if isinstance(result, jobs.Conflict):
        REJECTED.labels("conflict").inc()
        raise ApiError(409, "conflict", str(result)) from None
    if isinstance(result, jobs.QuotaExceeded):
        REJECTED.labels(result.limit or "quota").inc()
        raise too_many(str(result), result.retry_after) from None
    if isinstance(result, Exception):
        raise result
    job, created = result
    if created:
        return job_view(job), True
    with state.session_factory() as s:
        return get_job_view(s, job.id) or job_view(job), False


@router.get("/jobs/{job_id}", response_model=JobResponse, summary="Get a job",
            description="Status, text, finish reason, usage, cost (micro-dollars and dollars) and timings.",
            responses={**NOT_FOUND, **AUTH_ERRORS, **INVALID})
def get_job(request: Request, job_id: str, principal: Principal = Depends(require_key)) -> JSONResponse:
    jid = _uuid_or_404(job_id)
    state = _state(request)
    with state.session_factory() as s:
        view = get_job_view(s, jid, principal.tenant_id)
    if view is None:
        raise not_found(f"no job {jid}")
    if view["status"] == "running" and view["text"] is None:  # polling shows the text as it is generated
        view["text"] = text_so_far(state.redis, state.settings.stream_prefix, jid)
    return JSONResponse(view)


@router.get("/jobs", response_model=JobList, summary="List jobs",
            description="The tenant's jobs, newest first, with opaque cursor pagination: pass `next_cursor` back "
                        "as `cursor` until `has_more` is false.",
            responses={**AUTH_ERRORS, **INVALID})
def list_jobs(
    request: Request,
    principal: Principal = Depends(require_key),
    status: Annotated[JobStatus | None, Query(description="Only jobs with this status.")] = None,
    since: Annotated[IsoDateTime | None, Query(description="Only jobs created at or after this time (ISO 8601).")] = None,
    limit: Annotated[int, Query(ge=1, le=200, description="Page size.")] = 20,
    cursor: Annotated[str | None, Query(pattern=CURSOR_PATTERN, description="`next_cursor` of the previous page.")] = None,
) -> JSONResponse:
    stmt = (
        select(Job, Result, UsageEntry)
        .outerjoin(Result, Result.job_id == Job.id)
        .outerjoin(UsageEntry, UsageEntry.job_id == Job.id)
        .where(Job.tenant_id == principal.tenant_id)
    )
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if since is not None:
        since = to_utc(since)
        stmt = stmt.where(Job.created_at >= since)
    if cursor:
        c_time, c_id = decode_cursor(cursor)
        stmt = stmt.where(tuple_(Job.created_at, Job.id) < tuple_(c_time, c_id))
    stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    with _state(request).session_factory() as s:
        rows = s.execute(stmt).all()
    has_more = len(rows) > limit
    rows = rows[:limit]
    data = [job_view(j, r, u) for j, r, u in rows]
    next_cursor = encode_cursor(rows[-1][0].created_at, rows[-1][0].id) if has_more and rows else None
    return JSONResponse({"object": "list", "data": data, "has_more": has_more, "next_cursor": next_cursor})


@router.post("/jobs/{job_id}/cancel", response_model=JobResponse, summary="Cancel a job",
             description="A queued job is cancelled at once; a running job is aborted by its worker within one "
                         "engine step (it pays for what was computed). A finished job is returned unchanged.",
             responses={**NOT_FOUND, **AUTH_ERRORS, **INVALID})
def cancel_job(request: Request, job_id: str, principal: Principal = Depends(require_key)) -> JSONResponse:
    jid = _uuid_or_404(job_id)
    state = _state(request)
    job = jobs.cancel(state.session_factory, state.redis, state.settings, jid, tenant_id=principal.tenant_id)
    if job is None:
        raise not_found(f"no job {jid}")
    with state.session_factory() as s:
        view = get_job_view(s, jid, principal.tenant_id)
    if view is None:
        raise not_found(f"no job {jid}")
    return JSONResponse(view)


@router.get(
    "/jobs/{job_id}/events",
    summary="Stream a job's text (server-sent events)",
    description=(
        "`event: delta` with `data: {\"text\": ...}` for each piece of text as it is generated (the `id` is "
        "the Redis stream entry id: reconnect with `Last-Event-ID` to resume), `event: reset` when the job "
        "started again after a retry (discard the text received so far), then one `event: final` whose "
        "data is the job as `GET /v1/jobs/{id}` returns it (status, text, finish_reason, usage, cost). For a "
        "finished job whose stream has expired: the whole text as one delta, then the final event."
    ),
    response_class=StreamingResponse,
    responses={200: sse_response_doc("An event stream that ends after the final event."),
               **NOT_FOUND, **AUTH_ERRORS, **INVALID,
               503: {"model": ErrorResponse, "description": "The database or Redis is unreachable, or this API "
                     "process already serves `INFERQ_SSE_MAX_STREAMS` streams (the reason is given)."}},
)
def job_event_stream(
    request: Request,
    job_id: str,
    principal: Principal = Depends(require_key),
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", description="Resume after this event id.")] = None,
) -> StreamingResponse:
    jid = _uuid_or_404(job_id)
    state = _state(request)
    tenant_id = principal.tenant_id
    with state.session_factory() as s:
        exists = s.scalar(select(Job.id).where(Job.id == jid, Job.tenant_id == tenant_id))
    if exists is None:
        raise not_found(f"no job {jid}")
    state.redis_health.check(state.redis)
    if not state.streams.try_acquire():
        SSE_STREAMS.labels("refused").inc()
        raise unavailable(f"too many event streams open on this API process (limit {state.streams.limit}, "
                          "INFERQ_SSE_MAX_STREAMS); retry later, or poll GET /v1/jobs/{id}")

    def load_view() -> dict[str, Any] | None:
        with state.session_factory() as s:
            return get_job_view(s, jid, tenant_id)

    async def stream() -> Any:
        SSE_STREAMS.labels("redis").inc()
        events = job_events(state.async_redis(), state.settings.stream_prefix, jid, load_view, last_event_id)
        async for chunk in guarded(events, jid):
            yield chunk

    return LimitedStreamingResponse(stream(), state.streams, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
