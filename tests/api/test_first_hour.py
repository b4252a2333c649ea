"""Small things a new user meets in the first hour (issue 19, item 7), each as the user meets it: the CLI in
a subprocess, the API served for real on the real PostgreSQL and Redis."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import uuid
from importlib.metadata import version
from pathlib import Path

import pytest

from api.auth import lookup_key
from api.webhooks import delivery_id
from inferq import jobs
from inferq.db import Job, UsageEntry, utcnow

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def inferq(settings, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "INFERQ_DATABASE_URL": settings.database_url, "INFERQ_REDIS_URL": settings.redis_url,
           "INFERQ_STREAM_PREFIX": settings.stream_prefix, "INFERQ_LOG_JSON": "true", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_version_and_help(settings):
    out = inferq(settings, "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"inferq {version('inferq')}"
    for args in (["--help"], ["up", "--help"], ["generate", "--help"], ["keys", "create", "--help"]):
        text = inferq(settings, *args).stdout
        assert "--help" in text and "<bool>" not in text, text  # a flag takes no value: no type after it
    assert re.search(r"--debug\s+Show tracebacks", inferq(settings, "--help").stdout)


def test_keys_create_takes_the_tenant_either_way(settings, make_tenant, db):
    t = make_tenant()
    for args in ([t.name], ["--tenant", t.name]):
        out = inferq(settings, "keys", "create", *args)
        assert out.returncode == 0, out.stderr
        principal = lookup_key(db, out.stdout.strip())
        assert principal is not None and principal.tenant_id == t.tenant_id
    for args, needle in (([], "give the tenant"), (["a", "--tenant", "b"], "two tenants")):
        out = inferq(settings, "keys", "create", *args)
        assert out.returncode != 0 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr


def _ledger_row(db, tenant_id: str, created: dt.datetime, prompt: int) -> None:
    with db() as s, s.begin():
        job = Job(tenant_id=tenant_id, model="m", tier="batch", status="succeeded", priority=0, request={},
                  created_at=created, queued_at=created, finished_at=created)
        s.add(job)
        s.flush()
        s.add(UsageEntry(job_id=job.id, tenant_id=tenant_id, model="m", tier="batch", status="succeeded",
                         prompt_tokens=prompt, cached_prompt_tokens=0, completion_tokens=1, compute_seconds=0.1,
                         cost_micros=1, created_at=created))


def test_report_defaults_to_the_last_30_days_like_the_api(settings, make_tenant, db, client):
    t = make_tenant()
    _ledger_row(db, t.tenant_id, utcnow() - dt.timedelta(days=3), prompt=7)
    _ledger_row(db, t.tenant_id, utcnow() - dt.timedelta(days=40), prompt=1000)  # outside both defaults
    out = inferq(settings, "report", "--tenant", t.name, "--group-by", "model", "--format", "json")
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)
    api = client.get("/v1/usage", params={"group_by": "model"}, headers=t.headers).json()
    assert [r["prompt_tokens"] for r in cli["rows"]] == [r["prompt_tokens"] for r in api["rows"]] == [7]


def test_clear_messages_for_a_non_json_body_and_a_bad_group_by(client, tenant):
    r = client.post("/v1/jobs", content=b'{"prompt": "Hi",', headers={**tenant.headers,
                                                                      "Content-Type": "application/json"})
    assert r.status_code == 422
    message = r.json()["error"]["message"]
    assert "not valid JSON" in message and "decode error" not in message and "body.0" not in message, message

    r = client.get("/v1/usage", params={"group_by": "day,colour"}, headers=tenant.headers)
    assert r.status_code == 422
    message = r.json()["error"]["message"]
    assert "day, model, tier" in message and "^(" not in message, message


def test_polling_a_running_job_shows_the_text_so_far(client, tenant, db, redis_client, settings):
    job_id = client.post("/v1/jobs", json={"prompt": "Count", "max_tokens": 50}, headers=tenant.headers).json()["id"]
    assert client.get(f"/v1/jobs/{job_id}", headers=tenant.headers).json()["text"] is None  # queued
    with db() as s:  # what a worker does: claim, then publish deltas as tokens come
        jobs.transition(s, job_id, "queued", "running", attempts=1, started_at=utcnow())
        s.commit()
    pipe = redis_client.pipeline()
    jobs.publish_events(pipe, settings, job_id, jobs.delta_event("One, ", [1]), jobs.delta_event("two, ", [2]))
    pipe.execute()
    view = client.get(f"/v1/jobs/{job_id}", headers=tenant.headers).json()
    assert view["status"] == "running" and view["text"] == "One, two, "
    # a second attempt (its first worker died) starts over: only its own text shows
    pipe = redis_client.pipeline()
    jobs.publish_reset(pipe, settings, job_id, 2)
    jobs.publish_events(pipe, settings, job_id, jobs.delta_event("One", [1], attempt=2),
                        jobs.delta_event(" more", [3], attempt=1))  # a late delta of the lost attempt
    pipe.execute()
    assert client.get(f"/v1/jobs/{job_id}", headers=tenant.headers).json()["text"] == "One"


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


def test_webhook_delivery_ids_are_unique_across_databases():
    """A fresh database numbers its delivery rows from 1 again; the id a receiver sees must still be new."""
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    assert delivery_id(a, 1) == delivery_id(a, 1)  # the same on every retry of one delivery
    assert delivery_id(a, 1) != delivery_id(b, 1)
    assert uuid.UUID(delivery_id(a, 1)).version == 5


def test_docs_use_relative_dates():
    """Example commands with fixed dates went stale (empty reports); they use the defaults or `date`."""
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for line in doc.read_text().splitlines():
            assert not re.search(r"(--since|--until|from=|to=)\s*20\d\d-", line), f"{doc.name}: {line}"
