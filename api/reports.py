"""Usage and cost reports from the ledger (``usage_ledger``). One query function serves
``GET /v1/usage``, ``GET /v1/admin/usage`` and ``inferq report``, so they always agree."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from api.views import dollars
from inferq.db import Tenant, UsageEntry

GROUP_COLUMNS = ("day", "model", "tier", "tenant")
SUM_COLUMNS = ("jobs", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "total_tokens",
               "compute_seconds", "spec_proposed_tokens", "spec_accepted_tokens", "cost_micros", "cost_dollars")
_TOKEN_SUMS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "spec_proposed_tokens",
               "spec_accepted_tokens")


class ReportError(ValueError):
    """Bad report parameters (names the parameter)."""


def parse_group_by(value: str | list[str] | None, *, allow_tenant: bool) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, list) else value.split(",")
    out: list[str] = []
    allowed = GROUP_COLUMNS if allow_tenant else GROUP_COLUMNS[:3]
    for raw in items:
        for part in raw.split(","):
            name = part.strip().lower()
            if not name:
                continue
            if name not in allowed:
                raise ReportError(f"group_by: unknown column {name!r} (choose from {', '.join(allowed)})")
            if name not in out:
                out.append(name)
    return out


def parse_when(value: str | dt.date | dt.datetime | None, name: str) -> dt.datetime | None:
    """A date (YYYY-MM-DD, midnight UTC) or an ISO 8601 datetime (naive means UTC)."""
    if value is None or value == "":
        return None
    if isinstance(value, dt.datetime):
        t = value
    elif isinstance(value, dt.date):
        t = dt.datetime(value.year, value.month, value.day)
    else:
        s = value.strip()
        try:
            t = dt.datetime.fromisoformat(s[:-1] + "+00:00" if s.endswith(("Z", "z")) else s)
        except ValueError as exc:
            raise ReportError(f"{name}: not a date or ISO 8601 datetime: {value!r}") from exc
    return to_utc(t)


_MIN = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
_MAX = dt.datetime.max.replace(tzinfo=dt.timezone.utc)


def to_utc(t: dt.datetime) -> dt.datetime:
    """Aware UTC (naive means UTC), clamped to the representable range instead of overflowing."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    try:
        return t.astimezone(dt.timezone.utc)
    except OverflowError:
        return _MIN if t.year < 2 else _MAX


def shift(t: dt.datetime, delta: dt.timedelta) -> dt.datetime:
    try:
        return t + delta
    except OverflowError:
        return _MIN if delta < dt.timedelta(0) else _MAX


def _day_expr(session: Session) -> ColumnElement[Any]:
    if session.get_bind().dialect.name == "postgresql":
        return func.to_char(func.timezone("UTC", UsageEntry.created_at), "YYYY-MM-DD")
    return func.strftime("%Y-%m-%d", UsageEntry.created_at)


def usage_report(session: Session, *, since: dt.datetime, until: dt.datetime, group_by: list[str],
                 tenant_id: str | None = None) -> list[dict[str, Any]]:
    """Sums over ledger rows with ``since <= created_at < until`` (an empty window gives no rows) (optionally one tenant), grouped by the
    given columns (subset of day, model, tier, tenant), ordered by them."""
    cols: dict[str, Any] = {
        "day": _day_expr(session), "model": UsageEntry.model, "tier": UsageEntry.tier, "tenant": Tenant.name,
    }
    group_cols = [cols[g].label(g) for g in group_by]
    stmt = select(
        *group_cols,
        func.count(UsageEntry.id).label("jobs"),
        *[func.coalesce(func.sum(getattr(UsageEntry, name)), 0).label(name) for name in _TOKEN_SUMS],
        func.coalesce(func.sum(UsageEntry.compute_seconds), 0.0).label("compute_seconds"),
        func.coalesce(func.sum(UsageEntry.cost_micros), 0).label("cost_micros"),
    ).where(UsageEntry.created_at >= since, UsageEntry.created_at < until)
    if "tenant" in group_by:
        stmt = stmt.join(Tenant, Tenant.id == UsageEntry.tenant_id)
    if tenant_id is not None:
        stmt = stmt.where(UsageEntry.tenant_id == tenant_id)
    if group_cols:
        stmt = stmt.group_by(*[cols[g] for g in group_by]).order_by(*[cols[g] for g in group_by])
    rows = []
    for r in session.execute(stmt).mappings():
        if not group_cols and r["jobs"] == 0:
            continue
        rows.append(_row({g: r[g] for g in group_by}, r))
    return rows


def _row(keys: dict[str, Any], r: Any) -> dict[str, Any]:
    out: dict[str, Any] = {g: keys.get(g) for g in GROUP_COLUMNS}
    out["jobs"] = int(r["jobs"])
    out.update({name: int(r[name]) for name in _TOKEN_SUMS})
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    out["compute_seconds"] = round(float(r["compute_seconds"]), 6)
    out["cost_micros"] = int(r["cost_micros"])
    out["cost_dollars"] = dollars(out["cost_micros"])
    return out


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    acc: dict[str, Any] = {k: 0 for k in ("jobs", *_TOKEN_SUMS, "cost_micros")}
    secs = 0.0
    for r in rows:
        for k in acc:
            acc[k] += r[k]
        secs += r["compute_seconds"]
    acc["compute_seconds"] = secs
    return _row({}, acc)


def build_report(session: Session, *, since: dt.datetime, until: dt.datetime, group_by: list[str],
                 tenant_id: str | None = None, tenant_name: str | None = None) -> dict[str, Any]:
    rows = [] if until <= since else usage_report(session, since=since, until=until, group_by=group_by, tenant_id=tenant_id)
    return {"object": "usage_report", "from": since.isoformat(), "to": until.isoformat(), "group_by": group_by,
            "tenant": tenant_name, "rows": rows, "totals": totals(rows)}


def to_csv(report: dict[str, Any]) -> str:
    cols = [*report["group_by"], *SUM_COLUMNS]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in report["rows"]:
        w.writerow([r[c] for c in cols])
    return buf.getvalue()


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)


def to_table(report: dict[str, Any]) -> str:
    cols = [*report["group_by"], *[c for c in SUM_COLUMNS if c != "cost_micros"]]
    rows = [[str(r[c]) for c in cols] for r in report["rows"]]
    if report["group_by"]:
        total = report["totals"]
        rows.append(["TOTAL" if i == 0 else "" if i < len(report["group_by"]) else str(total[c])
                     for i, c in enumerate(cols)])
    if not rows:
        rows.append(["" for _ in cols])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(v.rjust(w) if v[:1].isdigit() else v.ljust(w) for v, w in zip(r, widths, strict=True)))
    return "\n".join(lines)
