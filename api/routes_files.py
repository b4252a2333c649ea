"""OpenAI-compatible Files API: ``POST /v1/files`` (a batch input, ``purpose=batch``), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``.

An upload is validated line by line as it is stored (api/batch_lines.py: each line a request the batch's
endpoint accepts, ``custom_id`` unique; the first bad line is a 400 that names it, and nothing is kept), read
in chunks from the spooled upload and written to PostgreSQL a part at a time (why PostgreSQL:
inferq/batch_files.py). Batches add their output and error files (``purpose=batch_output``). A tenant sees
only its own files: another tenant's are 404.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api.auth import Principal, require_key
from api.batch_lines import check_line
from api.batch_schemas import FileDeleted, FileList, FileObject, file_object, page
from api.openai_route import OpenAIRoute, error_responses, not_found
from api.openai_schemas import OpenAIError
from inferq import batch_files
from inferq.db import StoredFile
from inferq.settings import Settings

router = APIRouter(prefix="/v1", tags=["files"], route_class=OpenAIRoute)

UPLOAD_OVERHEAD_BYTES = 64 * 1024  # multipart headers and the purpose field, beyond the file itself
_DOC = " OpenAI-compatible: the official client's `client.files` methods work against it. See docs/API.md."
_UPLOAD_BODY = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary", "description": "The JSONL file: one request per line, "
                 "`{\"custom_id\", \"method\": \"POST\", \"url\", \"body\"}`."},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}


class OctetStream(StreamingResponse):
    media_type = "application/octet-stream"


def upload_body_limit(settings: Settings) -> int:
    """The largest request body ``POST /v1/files`` reads (its file limit plus the multipart framing)."""
    return settings.batch_file_max_bytes + UPLOAD_OVERHEAD_BYTES


@router.post("/files", response_model=FileObject, summary="Upload a batch input file",
             description="Multipart: `file` (JSONL, one request per line) and `purpose` (`batch`). Each line "
                         "is checked as it is stored; the first bad line is a 400 naming it (`line N: ...`), "
                         "and nothing is stored. Limits: `INFERQ_BATCH_FILE_MAX_BYTES` (413 above) and "
                         "`INFERQ_BATCH_MAX_LINES` requests." + _DOC,
             responses=error_responses(400, 413), openapi_extra={"requestBody": _UPLOAD_BODY})
async def upload_file(request: Request, principal: Principal = Depends(require_key)) -> JSONResponse:
    state = request.app.state.inferq
    async with request.form(max_files=1, max_fields=8) as form:  # the file is spooled to disk as it arrives
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise OpenAIError(400, f"purpose must be \"batch\" (got {str(purpose)[:40]!r}): this service keeps "
                              "files for the Batch API only", param="purpose")
        if not isinstance(upload, UploadFile):
            raise OpenAIError(400, "file is required: the JSONL file, as the multipart part named `file`",
                              param="file")
        stored = await run_in_threadpool(_store, state, principal.tenant_id, upload)
    return JSONResponse(file_object(stored))


def _store(state: Any, tenant_id: str, upload: UploadFile) -> StoredFile:
    settings: Settings = state.settings
    filename = (upload.filename or "").replace("\x00", "")[:255] or "batch.jsonl"
    upload.file.seek(0)
    try:
        return batch_files.store_upload(
            state.session_factory, tenant_id, filename, "batch", upload.file, max_bytes=settings.batch_file_max_bytes,
            max_lines=settings.batch_max_lines, max_line_bytes=settings.max_request_bytes, check_line=check_line)
    except batch_files.LineError as exc:
        raise OpenAIError(400, str(exc), param=exc.param or "file", code="invalid_batch_line") from None
    except batch_files.UploadTooLarge as exc:
        raise OpenAIError(413, str(exc), param="file", code="file_too_large") from None


@router.get("/files", response_model=FileList, summary="List files",
            description="The tenant's files, newest first (`order=asc`: oldest first); page on with "
                        "`after=<last_id>` while `has_more`." + _DOC, responses=error_responses(400, 404))
async def list_files(
    request: Request, principal: Principal = Depends(require_key),
    purpose: Annotated[str | None, Query(max_length=32, description="Only files with this purpose.")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000, description="Page size.")] = 10_000,
    after: Annotated[str | None, Query(max_length=100, description="The last file id of the previous page.")] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="By creation time.")] = "desc",
) -> JSONResponse:
    def load() -> tuple[list[dict[str, Any]], bool]:
        with request.app.state.inferq.session_factory() as session:
            try:
                rows, has_more = batch_files.list_files(session, principal.tenant_id, purpose=purpose, after=after,
                                                        limit=limit, ascending=order == "asc")
            except batch_files.UnknownCursor as exc:
                raise OpenAIError(404, f"{exc} to page after", param="after", code="not_found") from None
            return [file_object(f) for f in rows], has_more

    objects, has_more = await run_in_threadpool(load)
    return JSONResponse(page(objects, has_more))


def _own_file(request: Request, principal: Principal, file_id: str) -> StoredFile:
    with request.app.state.inferq.session_factory() as session:
        row = batch_files.get_file(session, principal.tenant_id, file_id)
    if row is None:
        raise not_found("file", file_id, "file_id")
    return row


@router.get("/files/{file_id}", response_model=FileObject, summary="Get a file", description=_DOC.strip(),
            responses=error_responses(404))
async def retrieve_file(request: Request, file_id: str, principal: Principal = Depends(require_key)) -> JSONResponse:
    return JSONResponse(file_object(await run_in_threadpool(_own_file, request, principal, file_id)))


@router.get("/files/{file_id}/content", response_class=OctetStream, summary="Download a file's content",
            description="The file's bytes as uploaded (or, for a batch's output and error files, one JSON object "
                        "per line), streamed a part at a time." + _DOC,
            responses={200: {"description": "The file's bytes.", "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                       **error_responses(404)})
async def file_content(request: Request, file_id: str, principal: Principal = Depends(require_key)) -> OctetStream:
    row = await run_in_threadpool(_own_file, request, principal, file_id)
    parts = batch_files.iter_content(request.app.state.inferq.session_factory, row.id)
    return OctetStream(parts, headers={"Content-Length": str(row.bytes),
                                       "Content-Disposition": f"attachment; filename=\"{row.id}.jsonl\""})


@router.delete("/files/{file_id}", response_model=FileDeleted, summary="Delete a file",
               description="Deletes the file and its content. The input of a batch that has not finished cannot "
                           "be deleted (409)." + _DOC, responses=error_responses(404, 409))
async def delete_file(request: Request, file_id: str, principal: Principal = Depends(require_key)) -> JSONResponse:
    def delete() -> bool:
        try:
            return batch_files.delete_file(request.app.state.inferq.session_factory, principal.tenant_id, file_id)
        except batch_files.FileInUse as exc:
            raise OpenAIError(409, str(exc), param="file_id", code="file_in_use") from None

    if not await run_in_threadpool(delete):
        raise not_found("file", file_id, "file_id")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
