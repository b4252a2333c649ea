"""/v1/usage (the caller's tenant) and /v1/admin/usage (all tenants, admin keys): sums from the ledger."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import select

from api.auth import Principal, require_admin, require_key
from api.errors import invalid, not_found
from api.reports import ReportError, build_report, parse_group_by, parse_when, shift, to_csv
from api.routes_jobs import AUTH_ERRORS, INVALID
from api.schemas import ErrorResponse, UsageReport
from api.validation import IsoDate
from inferq.db import Tenant, utcnow

router = APIRouter(prefix="/v1", tags=["usage"])

_CSV: dict[str, Any] = {"text/csv": {"schema": {"type": "string"}, "example":
                     "day,model,jobs,prompt_tokens,cached_prompt_tokens,completion_tokens,total_tokens,"
                     "compute_seconds,spec_proposed_tokens,spec_accepted_tokens,cost_micros,cost_dollars\n"
                     "2026-01-05,smollm2-135m-instruct,2,70,0,16,86,0.16,0,0,14,0.000014\n"}}
FROM_Q = Query(alias="from", description="Start (inclusive): a date (YYYY-MM-DD, UTC) or ISO 8601 datetime. "
                                         "Default: 30 days before `to`.", examples=["2026-01-01"])
TO_Q = Query(description="End (exclusive): a date or ISO 8601 datetime. Default: now.", examples=["2026-02-01"])
FORMAT_Q = Query(description="json (default) or csv.")


def _groups_pattern(*names: str) -> str:
    one = "(" + "|".join(names) + ")"
    return f"^{one}(,{one})*$"


def _window(from_: dt.datetime | dt.date | None, to: dt.datetime | dt.date | None) -> tuple[dt.datetime, dt.datetime]:
    try:
        until = parse_when(to, "query.to") or utcnow()
        since = parse_when(from_, "query.from") or shift(until, -dt.timedelta(days=30))
    except ReportError as exc:
        field, _, reason = str(exc).partition(": ")
        raise invalid(field, reason) from None
    return since, until


def _respond(request: Request, *, since: dt.datetime, until: dt.datetime, group_by: list[str], fmt: str,
             tenant_id: str | None, tenant_name: str | None) -> Response:
    with request.app.state.inferq.session_factory() as s:
        report = build_report(s, since=since, until=until, group_by=group_by, tenant_id=tenant_id,
                              tenant_name=tenant_name)
    if fmt == "csv":
        return Response(to_csv(report), media_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": 'attachment; filename="usage.csv"'})
    return JSONResponse(report)


def _group_by(value: str | None, *, admin: bool) -> list[str]:
    try:
        return parse_group_by(value, allow_tenant=admin)
    except ReportError as exc:
        raise invalid("query.group_by", str(exc).partition(": ")[2]) from None


@router.get("/usage", response_model=UsageReport, summary="Usage and cost of the caller's tenant",
            description="Sums over the token-cost ledger (one row per terminal job) for rows created in "
                        "[from, to), grouped by any of `day`, `model`, `tier` (comma-separated). The same "
                        "numbers as `inferq report`.",
            responses={200: {"content": _CSV, "description": "The report (JSON or CSV)."}, **AUTH_ERRORS, **INVALID})
def usage(
    request: Request,
    principal: Principal = Depends(require_key),
    from_: Annotated[IsoDate | None, FROM_Q] = None,
    to: Annotated[IsoDate | None, TO_Q] = None,
    group_by: Annotated[str | None, Query(description="Comma-separated: day, model, tier.",
                                          pattern=_groups_pattern("day", "model", "tier"),
                                          examples=["day,model"])] = None,
    format: Annotated[Literal["json", "csv"], FORMAT_Q] = "json",
) -> Response:
    since, until = _window(from_, to)
    return _respond(request, since=since, until=until, group_by=_group_by(group_by, admin=False), fmt=format,
                    tenant_id=principal.tenant_id, tenant_name=principal.tenant.name)


@router.get("/admin/usage", response_model=UsageReport, summary="Usage and cost across tenants (admin keys)",
            description="Like `/v1/usage` over all tenants (or one, with `tenant`); `group_by` may also "
                        "include `tenant`. Needs an admin key (others get 404).",
            responses={200: {"content": _CSV, "description": "The report (JSON or CSV)."},
                       404: {"model": ErrorResponse, "description": "Not an admin key, or unknown tenant."},
                       **AUTH_ERRORS, **INVALID})
def admin_usage(
    request: Request,
    principal: Principal = Depends(require_admin),
    from_: Annotated[IsoDate | None, FROM_Q] = None,
    to: Annotated[IsoDate | None, TO_Q] = None,
    group_by: Annotated[str | None, Query(description="Comma-separated: day, model, tier, tenant.",
                                          pattern=_groups_pattern("day", "model", "tier", "tenant"),
                                          examples=["tenant,day"])] = None,
    tenant: Annotated[str | None, Query(max_length=100, description="Only this tenant (by name).")] = None,
    format: Annotated[Literal["json", "csv"], FORMAT_Q] = "json",
) -> Response:
    since, until = _window(from_, to)
    groups = _group_by(group_by, admin=True)
    tenant_id = None
    if tenant is not None:
        with request.app.state.inferq.session_factory() as s:
            tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == tenant))
        if tenant_id is None:
            raise not_found(f"no tenant named {tenant!r}")
    return _respond(request, since=since, until=until, group_by=groups, fmt=format, tenant_id=tenant_id,
                    tenant_name=tenant)


