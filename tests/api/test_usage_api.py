"""Usage reports: /v1/usage, /v1/admin/usage and `inferq report` give the same numbers as the ledger
(rows seeded directly), per tenant, grouped by day/model/tier, JSON and CSV."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import subprocess
import sys
import uuid

import pytest

from inferq.db import Job, UsageEntry

pytestmark = pytest.mark.integration

UTC = dt.timezone.utc


def _seed(db, tenant_id: str, rows: list[tuple[dt.datetime, str, str, int, int, int, float, int]]) -> None:
    """rows: (created_at, model, tier, prompt, cached, completion, compute_seconds, cost_micros)."""
    with db() as s:
        for created, model, tier, p, c, n, secs, cost in rows:
            job = Job(id=str(uuid.uuid4()), tenant_id=tenant_id, model=model, tier=tier, priority=0,
                      request={"prompt": "x"}, status="succeeded", attempts=1, cancel_requested=False,
                      created_at=created, finished_at=created)
            s.add(job)
            s.flush()
            s.add(UsageEntry(job_id=job.id, tenant_id=tenant_id, model=model, tier=tier, status="succeeded",
                             prompt_tokens=p, cached_prompt_tokens=c, completion_tokens=n, compute_seconds=secs,
                             cost_micros=cost, created_at=created))
        s.commit()


def t(day: int, hour: int = 12, month: int = 1) -> dt.datetime:
    return dt.datetime(2031, month, day, hour, tzinfo=UTC)


@pytest.fixture
def seeded(db, make_tenant):
    a, b = make_tenant(), make_tenant(admin=False)
    _seed(db, a.tenant_id, [
        (t(5, 1), "m1", "interactive", 10, 2, 5, 0.5, 11),
        (t(5, 23), "m1", "interactive", 20, 0, 7, 0.25, 13),
        (t(5, 9), "m2", "batch", 100, 50, 30, 1.0, 7),
        (t(6, 0), "m1", "interactive", 1, 0, 1, 0.125, 1),
        (dt.datetime(2031, 1, 31, 23, 59, 59, tzinfo=UTC), "m2", "interactive", 3, 0, 3, 0.0, 2),
        (t(1, 0, month=2), "m1", "interactive", 999, 0, 999, 9.0, 999),  # outside the window
        (dt.datetime(2030, 12, 31, 23, 59, 59, tzinfo=UTC), "m1", "interactive", 999, 0, 9, 9.0, 999),  # before
    ])
    _seed(db, b.tenant_id, [(t(5, 12), "m1", "interactive", 7, 0, 7, 0.5, 5)])
    return a, b


WINDOW = {"from": "2031-01-01", "to": "2031-02-01"}


def _row(day=None, model=None, tier=None, tenant=None, *, jobs, p, c, n, secs, cost):
    return {"day": day, "model": model, "tier": tier, "tenant": tenant, "jobs": jobs, "prompt_tokens": p,
            "cached_prompt_tokens": c, "completion_tokens": n, "total_tokens": p + n, "compute_seconds": secs,
            "spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "cost_micros": cost, "cost_dollars": f"0.{cost:06d}"}


def test_usage_grouped(client, seeded):
    a, _ = seeded
    r = client.get("/v1/usage", params={**WINDOW, "group_by": "day,model,tier"}, headers=a.headers)
    assert r.status_code == 200, r.text
    rep = r.json()
    assert rep["group_by"] == ["day", "model", "tier"] and rep["tenant"] == a.name
    assert rep["rows"] == [
        _row("2031-01-05", "m1", "interactive", jobs=2, p=30, c=2, n=12, secs=0.75, cost=24),
        _row("2031-01-05", "m2", "batch", jobs=1, p=100, c=50, n=30, secs=1.0, cost=7),
        _row("2031-01-06", "m1", "interactive", jobs=1, p=1, c=0, n=1, secs=0.125, cost=1),
        _row("2031-01-31", "m2", "interactive", jobs=1, p=3, c=0, n=3, secs=0.0, cost=2),
    ]
    assert rep["totals"] == _row(jobs=5, p=134, c=52, n=46, secs=1.875, cost=34)

    by_model = client.get("/v1/usage", params={**WINDOW, "group_by": "model"}, headers=a.headers).json()
    assert [(x["model"], x["jobs"], x["cost_micros"]) for x in by_model["rows"]] == [("m1", 3, 25), ("m2", 2, 9)]
    ungrouped = client.get("/v1/usage", params=WINDOW, headers=a.headers).json()
    assert ungrouped["rows"] == [_row(jobs=5, p=134, c=52, n=46, secs=1.875, cost=34)]


def test_usage_csv_matches_json(client, seeded):
    a, _ = seeded
    params = {**WINDOW, "group_by": "day,tier"}
    js = client.get("/v1/usage", params=params, headers=a.headers).json()
    r = client.get("/v1/usage", params={**params, "format": "csv"}, headers=a.headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert [(x["day"], x["tier"], int(x["jobs"]), int(x["cost_micros"]), x["cost_dollars"]) for x in rows] == \
           [(x["day"], x["tier"], x["jobs"], x["cost_micros"], x["cost_dollars"]) for x in js["rows"]]


def test_usage_is_per_tenant(client, seeded):
    _, b = seeded
    rep = client.get("/v1/usage", params={**WINDOW, "group_by": "model"}, headers=b.headers).json()
    assert rep["rows"] == [_row(model="m1", jobs=1, p=7, c=0, n=7, secs=0.5, cost=5)]


def test_admin_usage(client, seeded, make_tenant):
    a, b = seeded
    admin = make_tenant(admin=True)
    assert client.get("/v1/admin/usage", params=WINDOW, headers=a.headers).status_code == 404
    r = client.get("/v1/admin/usage", params={**WINDOW, "group_by": "tenant"}, headers=admin.headers)
    assert r.status_code == 200, r.text
    by_tenant = {x["tenant"]: (x["jobs"], x["cost_micros"]) for x in r.json()["rows"]}
    assert by_tenant[a.name] == (5, 34) and by_tenant[b.name] == (1, 5)
    one = client.get("/v1/admin/usage", params={**WINDOW, "tenant": b.name}, headers=admin.headers).json()
    assert one["totals"]["cost_micros"] == 5 and one["tenant"] == b.name
    assert client.get("/v1/admin/usage", params={**WINDOW, "tenant": "nobody-" + uuid.uuid4().hex},
                      headers=admin.headers).status_code == 404
    # tenant is not a grouping for ordinary keys
    r = client.get("/v1/usage", params={**WINDOW, "group_by": "tenant"}, headers=a.headers)
    assert r.status_code == 422


@pytest.mark.parametrize("params", [
    {"group_by": "day,color"}, {"from": "last tuesday"}, {"to": "2031-13-01"}, {"format": "xml"},
])
def test_usage_422(client, tenant, params):
    r = client.get("/v1/usage", params=params, headers=tenant.headers)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["fields"][0]["field"].startswith("query.")


def test_usage_empty_window(client, seeded):
    a, _ = seeded
    rep = client.get("/v1/usage", params={"from": "2031-02-01", "to": "2031-01-01"}, headers=a.headers).json()
    assert rep["rows"] == [] and rep["totals"]["jobs"] == 0


def test_usage_401(client):
    assert client.get("/v1/usage", params=WINDOW).status_code == 401


def _cli(settings, *args: str) -> str:
    env = {**os.environ, "INFERQ_DATABASE_URL": settings.database_url, "INFERQ_REDIS_URL": settings.redis_url,
           "INFERQ_LOG_JSON": "true"}
    out = subprocess.run([sys.executable, "-c", "from deploy.cli import main; main()", *args], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_cli_report_equals_api(client, seeded, settings):
    a, _ = seeded
    api = client.get("/v1/usage", params={**WINDOW, "group_by": "day,model,tier"}, headers=a.headers).json()
    out = _cli(settings, "report", "--tenant", a.name, "--since", "2031-01-01", "--until", "2031-02-01",
               "--group-by", "day,model,tier", "--format", "json")
    rep = json.loads(out)
    assert rep["rows"] == api["rows"] and rep["totals"] == api["totals"]
    csv_out = _cli(settings, "report", "--tenant", a.name, "--since", "2031-01-01", "--until", "2031-02-01",
                   "--group-by", "day,model,tier", "--format", "csv")
    api_csv = client.get("/v1/usage", params={**WINDOW, "group_by": "day,model,tier", "format": "csv"},
                         headers=a.headers).text
    assert csv_out.strip() == api_csv.strip()
    table = _cli(settings, "report", "--tenant", a.name, "--since", "2031-01-01", "--until", "2031-02-01",
                 "--group-by", "model")
    assert "m1" in table and "m2" in table and "TOTAL" in table and "0.000034" in table
