"""Response models of the REST API (the request body is ``inferq.contract.JobCreate``). Every field is
described so the OpenAPI document doubles as the reference."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]

_JOB_EXAMPLE: dict[str, Any] = {
    "id": "2f1c9a52-7d0e-4a57-9b1e-3f5b8f0f3a11",
    "object": "job",
    "status": "succeeded",
    "model": "smollm2-135m-instruct",
    "tier": "interactive",
    "priority": 0,
    "text": "The capital of France is Paris.",
    "finish_reason": "stop",
    "error": None,
    "usage": {"prompt_tokens": 35, "cached_prompt_tokens": 0, "completion_tokens": 8, "total_tokens": 43,
              "compute_seconds": 0.081, "spec_proposed_tokens": 0, "spec_accepted_tokens": 0},
    "cost": {"micros": 7, "dollars": "0.000007"},
    "timings": {"created_at": "2026-01-05T10:00:00.000000+00:00", "queued_at": "2026-01-05T10:00:00.002000+00:00",
                "started_at": "2026-01-05T10:00:00.010000+00:00",
                "first_token_at": "2026-01-05T10:00:00.050000+00:00",
                "finished_at": "2026-01-05T10:00:00.120000+00:00", "deadline_at": None},
    "attempts": 1,
    "cancel_requested": False,
    "idempotency_key": "order-1234",
    "webhook_url": None,
    "metadata": {"order": 1234},
    "links": {"self": "/v1/jobs/2f1c9a52-7d0e-4a57-9b1e-3f5b8f0f3a11",
              "events": "/v1/jobs/2f1c9a52-7d0e-4a57-9b1e-3f5b8f0f3a11/events",
              "cancel": "/v1/jobs/2f1c9a52-7d0e-4a57-9b1e-3f5b8f0f3a11/cancel"},
}


class ErrorField(BaseModel):
    field: str = Field(description="Where the problem is: a body field path such as `max_tokens` or "
                                   "`messages.0.role`, or `query.limit`, `header.idempotency-key`.")
    reason: str = Field(description="What is wrong with it.")


class ErrorDetail(BaseModel):
    type: str = Field(description="Machine-readable kind: validation_error, unauthorized, not_found, conflict, "
                                  "quota_exceeded, unavailable, ...", examples=["not_found"])
    message: str = Field(description="Human-readable explanation.", examples=["no job 2f1c9a52-..."])
    fields: list[ErrorField] = Field(default_factory=list, description="For 422: each invalid field and why.")


class ErrorResponse(BaseModel):
    """Every non-2xx answer has this shape."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"error": {"type": "validation_error", "message": "max_tokens: Input should be greater than or equal to 1",
                   "fields": [{"field": "max_tokens", "reason": "Input should be greater than or equal to 1"}]}}]})
    error: ErrorDetail = Field(description="What went wrong.")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Prompt tokens (cached ones included).")
    cached_prompt_tokens: int = Field(description="Prompt tokens served from the prefix cache (billed cheaper).")
    completion_tokens: int = Field(description="Generated tokens.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    compute_seconds: float = Field(description="This job's share of engine compute time.")
    spec_proposed_tokens: int = Field(0, description="Speculative decoding: tokens proposed and verified (0 when "
                                      "off). Not billed: billing is per completion token.")
    spec_accepted_tokens: int = Field(0, description="Of those, accepted: each saved one model step.")


class Cost(BaseModel):
    micros: int = Field(description="Cost in integer micro-dollars (1e-6 USD), as recorded in the usage ledger.")
    dollars: str = Field(description="The same cost in US dollars, as an exact decimal string.", examples=["0.000007"])


class Timings(BaseModel):
    created_at: dt.datetime = Field(description="When the API accepted the job.")
    queued_at: dt.datetime | None = Field(None, description="When it was put on the Redis stream.")
    started_at: dt.datetime | None = Field(None, description="When a worker started it (latest attempt).")
    first_token_at: dt.datetime | None = Field(None, description="When its first token was generated.")
    finished_at: dt.datetime | None = Field(None, description="When it reached a terminal status.")
    deadline_at: dt.datetime | None = Field(None, description="When it expires if not finished (deadline_seconds).")


class JobLinks(BaseModel):
    self: str = Field(description="This job.")
    events: str = Field(description="Server-sent events: text deltas, then the final event.")
    cancel: str = Field(description="POST here to cancel.")


class JobResponse(BaseModel):
    """A job: its status and, once finished, its text, usage and cost."""

    model_config = ConfigDict(json_schema_extra={"examples": [_JOB_EXAMPLE]})

    id: str = Field(description="Job id (UUID).")
    object: Literal["job"] = Field("job", description="Always `job`.")
    status: JobStatus = Field(description="queued → running → succeeded | failed | cancelled | expired.")
    model: str = Field(description="Model that runs (ran) the job.")
    tier: Literal["interactive", "batch"] = Field(description="Service tier.")
    priority: int = Field(description="Priority within the tier.")
    text: str | None = Field(None, description="Generated text: while the job runs, the text so far (from its "
                             "event stream); null while queued.")
    finish_reason: str | None = Field(None, description="stop | length | abort | deadline | error (null while unfinished).")
    error: str | None = Field(None, description="Why the job failed, if it did.")
    usage: Usage | None = Field(None, description="Token usage from the ledger (null until the job is terminal).")
    cost: Cost | None = Field(None, description="Cost from the ledger (null until the job is terminal).")
    timings: Timings = Field(description="Lifecycle timestamps (UTC, ISO 8601).")
    attempts: int = Field(description="How many times a worker started the job.")
    cancel_requested: bool = Field(description="Whether a cancel was requested.")
    idempotency_key: str | None = Field(None, description="The Idempotency-Key it was submitted with.")
    webhook_url: str | None = Field(None, description="Where the finished job is POSTed.")
    metadata: dict[str, Any] | None = Field(None, description="The free-form metadata given at submission.")
    links: JobLinks = Field(description="Related URLs.")


class JobList(BaseModel):
    """One page of jobs, newest first."""

    object: Literal["list"] = Field("list", description="Always `list`.")
    data: list[JobResponse] = Field(description="The jobs on this page, newest first.")
    has_more: bool = Field(description="Whether another page follows.")
    next_cursor: str | None = Field(None, description="Pass as `cursor` to get the next page; null on the last page.")


class UsageRow(BaseModel):
    day: str | None = Field(None, description="UTC day (YYYY-MM-DD), when grouped by day.")
    model: str | None = Field(None, description="Model, when grouped by model.")
    tier: str | None = Field(None, description="Tier, when grouped by tier.")
    tenant: str | None = Field(None, description="Tenant name, when grouped by tenant (admin only).")
    jobs: int = Field(description="Ledger rows (terminal jobs) in the group.")
    prompt_tokens: int = Field(description="Sum of prompt tokens.")
    cached_prompt_tokens: int = Field(description="Sum of cached prompt tokens.")
    completion_tokens: int = Field(description="Sum of completion tokens.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    compute_seconds: float = Field(description="Sum of compute seconds.")
    spec_proposed_tokens: int = Field(description="Sum of speculative tokens proposed and verified.")
    spec_accepted_tokens: int = Field(description="Sum of speculative tokens accepted (model steps saved).")
    cost_micros: int = Field(description="Sum of cost in micro-dollars.")
    cost_dollars: str = Field(description="The same sum in dollars (exact decimal string).")


class UsageReport(BaseModel):
    """Usage and cost from the ledger, for ledger rows created in [from, to)."""

    model_config = ConfigDict(populate_by_name=True, json_schema_extra={"examples": [{
        "object": "usage_report", "from": "2026-01-01T00:00:00+00:00", "to": "2026-02-01T00:00:00+00:00",
        "group_by": ["day", "model"], "tenant": "acme",
        "rows": [{"day": "2026-01-05", "model": "smollm2-135m-instruct", "tier": None, "tenant": None, "jobs": 2,
                  "prompt_tokens": 70, "cached_prompt_tokens": 0, "completion_tokens": 16, "total_tokens": 86,
                  "compute_seconds": 0.16, "spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "cost_micros": 14,
                  "cost_dollars": "0.000014"}],
        "totals": {"day": None, "model": None, "tier": None, "tenant": None, "jobs": 2, "prompt_tokens": 70,
                   "cached_prompt_tokens": 0, "completion_tokens": 16, "total_tokens": 86, "compute_seconds": 0.16,
                   "spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "cost_micros": 14,
                   "cost_dollars": "0.000014"}}]})

    object: Literal["usage_report"] = Field("usage_report", description="Always `usage_report`.")
    from_: dt.datetime = Field(alias="from", description="Start of the window (inclusive).")
    to: dt.datetime = Field(description="End of the window (exclusive).")
    group_by: list[str] = Field(description="Grouping columns, in order.")
    tenant: str | None = Field(None, description="Tenant the report is restricted to (null: all tenants).")
    rows: list[UsageRow] = Field(description="One row per group, ordered by the grouping columns.")
    totals: UsageRow = Field(description="Sums over all rows.")


class Health(BaseModel):
    status: Literal["ok"] = Field(description="The process is up.")


class Readiness(BaseModel):
    status: Literal["ready", "unavailable"] = Field(
        description="ready when the database and Redis answer and at least one worker serves a model.")
    checks: dict[str, str] = Field(description="Per dependency (database, redis, workers): `ok` or the reason.",
                                   examples=[{"database": "ok", "redis": "ok", "workers": "ok"}])
    models: dict[str, list[str]] = Field(
        default_factory=dict, description="Every known model and the workers serving it now (from their "
        "heartbeats); a model whose workers all stopped is still known (jobs for it wait in its queue).",
        examples=[{"smollm2-135m-instruct": ["host-1234-ab12"]}])
    queues: dict[str, dict[str, dict[str, float]]] = Field(
        default_factory=dict, description="The autoscaling signal, per model and tier: `backlog` (jobs not yet "
        "delivered to a worker), `pending` (delivered, not yet finished), `oldest_waiting_seconds` (the oldest "
        "undelivered job's wait), `busy_seats` and `seats` (engine seats of the live workers: running this "
        "tier's requests / all).",
        examples=[{"smollm2-135m-instruct": {"interactive": {"backlog": 3, "pending": 8,
                                                             "oldest_waiting_seconds": 1.2, "busy_seats": 8,
                                                             "seats": 64}}}])
