"""OpenAI-compatible ``POST /v1/chat/completions`` and ``POST /v1/completions`` over inferq's jobs.

Each request is submitted exactly as ``POST /v1/jobs`` submits (same batcher, quotas and ledger), then
followed on the job's own event stream (``api/events.py``): streamed as ``chat.completion.chunk`` /
``text_completion`` SSE chunks ending with ``data: [DONE]``, or awaited for one response object. The tier is
interactive unless the ``X-Inferq-Tier: batch`` header or ``service_tier: "flex"`` asks for the batch tier.
A client that disconnects before the end cancels its job (it pays only for what was computed).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api import openai_schemas as oa
from api.auth import Principal, require_key
from api.errors import ApiError
from api.events import (
    STREAM_OUTAGES,
    LimitedStreamingResponse,
    job_event_items,
    outage_body,
    sse_response_doc,
)
from api.metrics import SUBMITTED
from api.openai_route import OpenAIRoute
from api.views import get_job_view
from inferq import jobs
from inferq.log import get_logger

log = get_logger("inferq.api.openai")
router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)

# ApiError types of the shared submission path, in OpenAI's vocabulary
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          429: "rate_limit_exceeded", 503: "server_error"}
_UNFINISHED = {"failed": (400, "generation_failed"), "expired": (408, "deadline_exceeded"),
               "cancelled": (409, "cancelled")}
_DOC = ("OpenAI-compatible; point the official client at this service (`OpenAI(base_url=.../v1, api_key=...)`). "
        "Errors are `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`. See docs/API.md.")
_ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"error": {
    "type": "object", "properties": {k: {"type": ["string", "null"]} for k in ("message", "type", "param", "code")}}}}}}}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion object, or with `stream: true` an event stream of chunks ending with "
                         "`data: [DONE]`.",
          "content": {"application/json": {"schema": {"type": "object"}},
                      **sse_response_doc("", events=None)["content"]}},
    **{code: {"description": why, **_ERROR} for code, why in (
        (400, "Invalid or unsupported request (the field is in `error.param`), or the generation failed."),
        (401, "Missing or invalid API key."), (404, "Unknown model."), (408, "The job's deadline passed."),
        (409, "The job was cancelled."), (413, "The body is too large."),
        (429, "Quota exceeded; retry after `Retry-After` seconds."), (503, "A dependency is unavailable."))},
}
_TierHeader = Annotated[str | None, Header(alias="X-Inferq-Tier", pattern="^(interactive|batch)$",
                                           description="Run in this tier (default interactive).")]


@router.post("/chat/completions", summary="Chat completion (OpenAI-compatible)", description=_DOC,
             responses=_RESPONSES, openapi_extra={"requestBody": oa.request_body(oa.ChatCompletionRequest)})
async def chat_completions(request: Request, principal: Principal = Depends(require_key),
                           tier: _TierHeader = None) -> Any:
    return await _complete(request, principal, oa.ChatCompletionRequest, tier)


@router.post("/completions", summary="Text completion (OpenAI-compatible)", description=_DOC,
             responses=_RESPONSES, openapi_extra={"requestBody": oa.request_body(oa.CompletionRequest)})
async def completions(request: Request, principal: Principal = Depends(require_key), tier: _TierHeader = None) -> Any:
    return await _complete(request, principal, oa.CompletionRequest, tier)


async def _complete(request: Request, principal: Principal, kind: type, tier: str | None) -> Any:
    state = request.app.state.inferq
    try:
        body = oa.parse(kind, await _json_body(request))
        job = body.to_job(tier)
        if body.stream and not state.streams.try_acquire():
            raise oa.OpenAIError(503, f"too many event streams open on this API process (limit {state.streams.limit})",
                                 type_="server_error", headers={"Retry-After": "5"})
        try:
            view, _ = await state.batcher.submit(principal, job, None)
        except BaseException:
            if body.stream:
                state.streams.release()
            raise
    except oa.OpenAIError as exc:
        return _error(exc)
    except ApiError as exc:  # a 422 of the shared path (e.g. context_length_exceeded) is OpenAI's 400
        status = 400 if exc.status == 422 else exc.status
        return _error(oa.OpenAIError(status, exc.message, type_=_TYPES.get(exc.status, "invalid_request_error"),
                                     param=exc.fields[0]["field"] if exc.fields else None, code=exc.type,
                                     headers=exc.headers))
    SUBMITTED.labels(job.tier).inc()
    follow = _Follow(state, view["id"], principal.tenant_id)
    chat = kind is oa.ChatCompletionRequest
    if body.stream:
        chunks = _stream(follow, view["model"], chat, body.include_usage)
        return LimitedStreamingResponse(chunks, state.streams, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    final = await _wait(request, follow)
    if final is None:  # the client went away: nobody to answer
        return JSONResponse({}, status_code=499)
    if final.get("status") != "succeeded":
        return _error(_job_error(final))
    return JSONResponse(oa.chat_completion(final) if chat else oa.text_completion(final))


class _Follow:
    """One job's event stream as ``(event, data)`` pairs, and its cancellation."""

    def __init__(self, state: Any, job_id: str, tenant_id: str) -> None:
        self.state, self.job_id, self.tenant_id = state, job_id, tenant_id

    def load_view(self) -> dict[str, Any] | None:
        with self.state.session_factory() as s:
            return get_job_view(s, self.job_id, self.tenant_id)

    async def events(self) -> AsyncIterator[tuple[str | None, dict[str, Any] | None]]:
        """``(event, data)``; ``(None, None)`` for a keep-alive; one ``error`` ends it on an outage."""
        items = job_event_items(self.state.async_redis(), self.state.settings.stream_prefix, self.job_id,
                                self.load_view, fresh=True)  # created by this request
        try:
            async for event, data, _ in items:
                yield event, data
        except STREAM_OUTAGES as exc:
            yield "error", outage_body(exc, self.job_id)

    def cancel_soon(self) -> None:
        """Cancel the job from a worker thread (callable from a closing generator, which must not await)."""
        def cancel() -> None:
            try:
                jobs.cancel(self.state.session_factory, self.state.redis, self.state.settings, self.job_id,
                            tenant_id=self.tenant_id)
                log.info("job cancelled: client disconnected", job_id=self.job_id, tenant_id=self.tenant_id)
            except Exception as exc:  # noqa: BLE001 - best effort; the job still ends by its own limits
                log.warning("cancel after disconnect failed", job_id=self.job_id, error=str(exc)[:200])

        asyncio.get_running_loop().run_in_executor(self.state.submit_executor, cancel)


async def _wait(request: Request, follow: _Follow) -> dict[str, Any] | None:
    """The job's final view, or None (and the job cancelled) if the client disconnects first."""
    async def final() -> dict[str, Any]:
        async for event, data in follow.events():
            if event == "final" and data is not None:
                return data
            if event == "error":
                raise oa.OpenAIError(503, (data or {}).get("error", {}).get("message", "unavailable"),
                                     type_="server_error")
        view = await run_in_threadpool(follow.load_view)  # the stream ended without a final event
        return view or {"status": "failed", "error": "the job is gone"}

    task = asyncio.ensure_future(final())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                follow.cancel_soon()
                return None
    except oa.OpenAIError as exc:
        return {"status": "failed", "error": exc.message}


class _StreamedText:
    """The text an OpenAI stream has sent, kept a prefix of the job's final text across retries.

    A job retried after its worker died starts its text again (a ``reset`` event); OpenAI's stream cannot take
    back what it sent, so the new attempt's text is held until it runs past what was sent and only the rest
    goes out. Greedy and seeded jobs regenerate the same text, so the client sees exactly the final text; an
    unseeded sample that differs is reported as an error instead of a text that was never generated."""

    def __init__(self) -> None:
        self.sent = ""
        self.attempt = ""

    def reset(self) -> None:
        self.attempt = ""

    def add(self, delta: str) -> str:
        """What to send for this delta of the current attempt ("" while it is behind what was sent)."""
        self.attempt += delta
        return self._advance(self.attempt)

    def finish(self, final_text: str) -> str | None:
        """The final text's unsent rest, or None if it does not continue what was sent."""
        return self._advance(final_text) if final_text.startswith(self.sent) else None

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        rest, self.sent = text[len(self.sent):], text
        return rest


async def _stream(follow: _Follow, model: str, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    created, finished = int(time.time()), False
    chunk = oa.chat_chunk if chat else oa.text_chunk

    def text_chunk(text: str) -> str:
        return _data(chunk(follow.job_id, model, created, **({"delta": {"content": text}} if chat else {"text": text})))

    def finish_chunk(reason: str) -> str:
        return _data(chunk(follow.job_id, model, created, finish=reason))

    streamed = _StreamedText()
    try:
        if chat:
            yield _data(oa.chat_chunk(follow.job_id, model, created, delta={"role": "assistant", "content": ""}))
        async for event, data in follow.events():
            if event is None:
                yield ": keepalive\n\n"
            elif event == "reset":
                streamed.reset()
            elif event == "delta" and data and data.get("text") and (text := streamed.add(data["text"])):
                yield text_chunk(text)
            elif event == "final" and data is not None:
                finished = True
                for line in _final_lines(follow.job_id, data, streamed, text_chunk, finish_chunk):
                    yield line
                if data.get("status") == "succeeded" and include_usage:
                    yield _data(chunk(follow.job_id, model, created, usage_=oa.usage(data), choices=False))
                yield "data: [DONE]\n\n"
                return
            elif event == "error":
                finished = True
                message = ((data or {}).get("error") or {}).get("message", "unavailable")
                yield _data(oa.OpenAIError(503, message, type_="server_error").body())
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:  # the client disconnected (or the stream broke): stop paying for the rest
            follow.cancel_soon()


def _final_lines(job_id: str, view: dict[str, Any], streamed: _StreamedText, text_chunk: Callable[[str], str],
                 finish_chunk: Callable[[str], str]) -> list[str]:
    """The end of a stream: any text not yet sent and the finish chunk, or the job's error."""
    if view.get("status") != "succeeded":
        return [_data(_job_error(view).body())]
    rest = streamed.finish(view.get("text") or "")
    if rest is None:
        return [_data(oa.OpenAIError(500, "the job was retried after a worker failure and its final text differs "
                                     f"from the text streamed; read it from GET /v1/jobs/{job_id}",
                                     type_="server_error", code="retried_with_other_text").body())]
    return ([text_chunk(rest)] if rest else []) + [finish_chunk(oa.finish_reason(view.get("finish_reason")))]


def _job_error(view: dict[str, Any]) -> oa.OpenAIError:
    status, code = _UNFINISHED.get(view.get("status", "failed"), (400, "generation_failed"))
    return oa.OpenAIError(status, view.get("error") or f"the job ended {view.get('status')}", code=code)


def _error(exc: oa.OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _data(obj: dict[str, Any]) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


async def _json_body(request: Request) -> Any:
    """The body's JSON; a 400 for anything else, including JSON nested past Python's recursion limit (about a
    thousand ``[``, far within the body limit), which the parser raises as ``RecursionError``."""
    raw = await request.body()
    try:
        return json.loads(raw) if raw else None
    except ValueError as exc:
        raise oa.OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise oa.OpenAIError(400, "the request body is JSON nested too deeply") from None
