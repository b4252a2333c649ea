"""OpenAI-compatible Batch API on the throughput tier: ``POST /v1/batches``, ``GET /v1/batches/{id}``,
``POST /v1/batches/{id}/cancel``, ``GET /v1/batches``.

A batch's lines become batch-tier jobs (billed at the batch discount, under the tenant's quotas), submitted
in chunks by this process's driver (api/batch_driver.py), each job's metadata carrying ``batch_id`` and
``custom_id``. Status and ``request_counts`` are read from those jobs; once every line has ended the batch is
finalized (on the GET that finds it so, or by its driver): its output file has one line per succeeded request
(the endpoint's own response object), its error file one per failed, cancelled or expired request. The store
and its rules: inferq/batches.py. A tenant sees only its own batches: another tenant's are 404.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.auth import Principal, require_key
from api.batch_driver import BatchDriver, driver_for
from api.batch_schemas import BatchCreate, BatchList, BatchObject, batch_object, page
from api.openai_route import OpenAIRoute, error_responses, not_found
from api.openai_schemas import OpenAIError
from inferq import batch_files, batches
from inferq.db import Batch

router = APIRouter(prefix="/v1", tags=["batches"], route_class=OpenAIRoute)

_DOC = " OpenAI-compatible: the official client's `client.batches` methods work against it. See docs/API.md."


@router.post("/batches", response_model=BatchObject, summary="Create a batch",
             description="Makes a batch of the lines of `input_file_id` (uploaded with purpose `batch`): "
                         "answered at once (`validating`); its lines are then submitted as batch-tier jobs in "
                         "chunks (`in_progress`). Every line's `url` must be `endpoint` (else a 400 naming the "
                         "line)." + _DOC, responses=error_responses(400, 404))
async def create_batch(request: Request, body: BatchCreate, principal: Principal = Depends(require_key)) -> JSONResponse:
    driver = driver_for(request)
    batch = await run_in_threadpool(_create, request.app.state.inferq, principal.tenant_id, body)
    driver.ensure(batch.id)
    return JSONResponse(batch_object(batch, batches.Counts(batch.total)))


def _create(state: Any, tenant_id: str, body: BatchCreate) -> Batch:
    with state.session_factory() as session:
        input_file = batch_files.get_file(session, tenant_id, body.input_file_id)
    if input_file is None:
        raise not_found("file", body.input_file_id, "input_file_id")
    if input_file.purpose != "batch":
        raise OpenAIError(400, f"file {input_file.id} has purpose {input_file.purpose!r}: a batch reads a file "
                          "uploaded with purpose \"batch\"", param="input_file_id")
    try:
        return batches.create_batch(state.session_factory, tenant_id, input_file, body.endpoint, body.metadata,
                                    state.settings.batch_completion_window_seconds)
    except batches.BatchInputError as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from None


@router.get("/batches/{batch_id}", response_model=BatchObject, summary="Get a batch",
            description="Its status and `request_counts`, read from its jobs; a batch whose lines have all "
                        "ended is finalized by this call (`output_file_id`, `error_file_id`)." + _DOC,
            responses=error_responses(404))
async def retrieve_batch(request: Request, batch_id: str, principal: Principal = Depends(require_key)) -> JSONResponse:
    driver = driver_for(request)
    found = await run_in_threadpool(driver.refresh, principal.tenant_id, batch_id)
    return _answer(driver, batch_id, found)


@router.post("/batches/{batch_id}/cancel", response_model=BatchObject, summary="Cancel a batch",
             description="`cancelling`: its queued jobs are cancelled at once and its running ones aborted by "
                         "their workers (they pay for what was computed); `cancelled` once all have ended, "
                         "with what succeeded before in the output file. An ended batch is returned "
                         "unchanged." + _DOC, responses=error_responses(404))
async def cancel_batch(request: Request, batch_id: str, principal: Principal = Depends(require_key)) -> JSONResponse:
    driver = driver_for(request)
    state = request.app.state.inferq

    def cancel() -> tuple[Batch, batches.Counts] | None:
        if batches.request_cancel(state.session_factory, principal.tenant_id, batch_id) is None:
            return None
        return driver.refresh(principal.tenant_id, batch_id)  # its driver stops its jobs (next step)

    return _answer(driver, batch_id, await run_in_threadpool(cancel))


def _answer(driver: BatchDriver, batch_id: str, found: tuple[Batch, batches.Counts] | None) -> JSONResponse:
    if found is None:
        raise not_found("batch", batch_id, "batch_id")
    batch, counts = found
    if batch.status in batches.ACTIVE:
        driver.ensure(batch.id)  # adopts it if the process that drove it is gone
    return JSONResponse(batch_object(batch, counts))


@router.get("/batches", response_model=BatchList, summary="List batches",
            description="The tenant's batches, newest first; page on with `after=<last_id>` while "
                        "`has_more`." + _DOC, responses=error_responses(400, 404))
async def list_batches(
    request: Request, principal: Principal = Depends(require_key),
    after: Annotated[str | None, Query(max_length=100, description="The last batch id of the previous page.")] = None,
    limit: Annotated[int, Query(ge=1, le=100, description="Page size.")] = 20,
) -> JSONResponse:
    driver = driver_for(request)

    def load() -> tuple[list[tuple[Batch, batches.Counts]], bool]:
        with request.app.state.inferq.session_factory() as session:
            try:
                rows, has_more = batches.list_batches(session, principal.tenant_id, after, limit)
            except KeyError:
                raise OpenAIError(404, f"no batch {str(after)[:64]!r} to page after", param="after",
                                  code="not_found") from None
            return [(b, batches.counts(session, b)) for b in rows], has_more

    found, has_more = await run_in_threadpool(load)
    for batch, _ in found:
        if batch.status in batches.ACTIVE:
            driver.ensure(batch.id)
    return JSONResponse(page([batch_object(b, c) for b, c in found], has_more))
