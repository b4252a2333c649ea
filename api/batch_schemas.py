"""The Files and Batch API's objects, shaped as OpenAI's (``file``, ``batch``, their lists), and the batch
creation body. The routes build the dicts (``file_object``, ``batch_object``); the models document them in
the OpenAPI document, where schemathesis checks every answer against them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from api.validation import NO_NUL_PATTERN
from inferq.batches import Counts
from inferq.db import Batch, StoredFile, unix_time

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
_MetaKey = Annotated[str, StringConstraints(max_length=64, pattern=NO_NUL_PATTERN)]
_MetaValue = Annotated[str, StringConstraints(max_length=512, pattern=NO_NUL_PATTERN)]


class FileObject(BaseModel):
    id: str = Field(examples=["file-4f0c8a..."], description="The file's id, private to its tenant.")
    object: Literal["file"] = Field("file", description="Always `file`.")
    bytes: int = Field(description="Size in bytes.")
    created_at: int = Field(description="Unix seconds.")
    filename: str = Field(description="The name given at upload (or chosen for an output file).")
    purpose: Literal["batch", "batch_output"] = Field(description="batch: an uploaded batch input; batch_output: "
                                                      "a batch's output or error file.")
    status: Literal["processed"] = Field("processed", description="Always `processed`: an upload is checked "
                                         "line by line before it is answered.")
    expires_at: int | None = Field(None, description="Always null: files are kept until deleted.")
    status_details: str | None = Field(None, description="Always null (kept for OpenAI's shape).")


class FileList(BaseModel):
    object: Literal["list"] = Field("list", description="Always `list`.")
    data: list[FileObject] = Field(description="This page's files, in the order asked (newest first by default).")
    has_more: bool = Field(description="More pages follow: ask again with `after=last_id`.")
    first_id: str | None = Field(description="The first file's id on this page.")
    last_id: str | None = Field(description="The last file's id on this page.")


class FileDeleted(BaseModel):
    id: str = Field(description="The deleted file's id.")
    object: Literal["file"] = Field("file", description="Always `file`.")
    deleted: bool = Field(description="Always true.")


class BatchCreate(BaseModel):
    """``POST /v1/batches``: unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")
    input_file_id: str = Field(min_length=1, max_length=100, description="A file uploaded with purpose `batch`.")
    endpoint: Endpoint = Field(description="Every line's `url` must be this endpoint.")
    completion_window: Literal["24h"] = Field(description="Lines not done within it expire.")
    metadata: dict[_MetaKey, _MetaValue] | None = Field(None, max_length=16, description="Up to 16 pairs, kept "
                                                        "with the batch.")


class RequestCounts(BaseModel):
    total: int = Field(description="Lines in the input file.")
    completed: int = Field(description="Lines that finished with a completion.")
    failed: int = Field(description="Lines that failed, expired or were cancelled.")


class BatchObject(BaseModel):
    id: str = Field(examples=["batch_9b2e..."], description="The batch's id, private to its tenant.")
    object: Literal["batch"] = Field("batch", description="Always `batch`.")
    endpoint: str = Field(description="The endpoint every line calls.")
    errors: dict[str, Any] | None = Field(None, description="Why the batch failed validation (OpenAI's list "
                                          "of `{code, message, line}`), else null.")
    input_file_id: str = Field(description="The uploaded input file.")
    completion_window: str = Field(description="`24h`.")
    status: BatchStatus = Field(description="validating, in_progress, finalizing, completed; or failed, "
                                "expired, cancelling, cancelled.")
    output_file_id: str | None = Field(None, description="Completed lines, one JSON object each, once finalized.")
    error_file_id: str | None = Field(None, description="Failed lines, once finalized (null when none failed).")
    created_at: int = Field(description="Unix seconds.")
    in_progress_at: int | None = Field(None, description="Unix seconds, when its lines were queued.")
    expires_at: int | None = Field(None, description="Unix seconds: lines not done by then expire.")
    finalizing_at: int | None = Field(None, description="Unix seconds, when the output files were started.")
    completed_at: int | None = Field(None, description="Unix seconds.")
    failed_at: int | None = Field(None, description="Unix seconds.")
    expired_at: int | None = Field(None, description="Unix seconds.")
    cancelling_at: int | None = Field(None, description="Unix seconds.")
    cancelled_at: int | None = Field(None, description="Unix seconds.")
    request_counts: RequestCounts = Field(description="Lines in total, completed and failed.")
    metadata: dict[str, str] | None = Field(None, description="The pairs given at creation.")


class BatchList(BaseModel):
    object: Literal["list"] = Field("list", description="Always `list`.")
    data: list[BatchObject] = Field(description="This page's batches, newest first.")
    has_more: bool = Field(description="More pages follow: ask again with `after=last_id`.")
    first_id: str | None = Field(description="The first batch's id on this page.")
    last_id: str | None = Field(description="The last batch's id on this page.")


def _seconds(t: Any) -> int | None:
    value = unix_time(t)
    return int(value) if value is not None else None


def file_object(f: StoredFile) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": int(f.bytes), "created_at": _seconds(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(b: Batch, counts: Counts) -> dict[str, Any]:
    times = {f"{name}_at": _seconds(getattr(b, f"{name}_at")) for name in (
        "created", "in_progress", "expires", "finalizing", "completed", "failed", "expired", "cancelling",
        "cancelled")}
    return {"id": b.id, "object": "batch", "endpoint": b.endpoint,
            "errors": {"object": "list", "data": b.errors} if b.errors else None,
            "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
            "output_file_id": b.output_file_id, "error_file_id": b.error_file_id, **times,
            "request_counts": counts.as_openai(), "metadata": b.meta}


def page(objects: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list object: the client pages on with ``after=last_id`` while ``has_more``."""
    return {"object": "list", "data": objects, "has_more": has_more,
            "first_id": objects[0]["id"] if objects else None, "last_id": objects[-1]["id"] if objects else None}
