"""Celery: a real Celery worker subprocess (`inferq celery-worker`) on the real Redis, and clients in
separate processes that know nothing of inferq (`Celery(broker=...).send_task(...)`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from api.views import get_job_view
from inferq import jobs
from inferq.db import Job, utcnow
from tests.registry_helpers import announce_default_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]

CLIENT = r"""
import json, sys
from celery import Celery
broker, queue, calls = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
app = Celery(broker=broker, backend=broker)
pending = [app.send_task(name, kwargs=kwargs, queue=queue) for name, kwargs in calls]
out = []
for r in pending:
    try:
        out.append({"ok": r.get(timeout=120)})
    except Exception as exc:
        out.append({"error": type(exc).__name__, "message": str(exc)})
print(json.dumps(out))
"""


def _env(settings, **extra) -> dict[str, str]:
    env = {**os.environ, "INFERQ_DATABASE_URL": settings.database_url, "INFERQ_REDIS_URL": settings.redis_url,
           "INFERQ_STREAM_PREFIX": settings.stream_prefix, "INFERQ_WEBHOOK_ALLOWLIST": settings.webhook_allowlist,
           "INFERQ_LOG_JSON": "true", "PYTHONUNBUFFERED": "1"}
    env.update({f"INFERQ_{k.upper()}": str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def celery_worker(settings, tmp_path, redis_client):
    announce_default_model(settings)  # the tasks check the model as POST /v1/jobs does
    log = open(tmp_path / "celery.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-c", "from deploy.cli import main; main()", "celery-worker", "--concurrency", "4",
         "--hostname", f"{settings.stream_prefix}@test", "--loglevel", "INFO"],
        cwd=ROOT, env=_env(settings), stdout=log, stderr=subprocess.STDOUT)
    yield proc
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    redis_client.delete(settings.stream_prefix)  # the Celery queue list


def run_client(settings, calls: list[tuple[str, dict]]) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", CLIENT, settings.broker_url, settings.stream_prefix, json.dumps(calls)],
                         capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONPATH": ""}, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_submit_task(celery_worker, settings, make_tenant, db):
    t = make_tenant()
    full = make_tenant(max_queued_jobs=0)
    results = run_client(settings, [
        ("inferq.submit", {"api_key": t.key, "prompt": "Hello", "max_tokens": 4, "tier": "batch"}),
        ("inferq.submit", {"api_key": t.key, "prompt": "Hello", "max_tokens": 0}),
        ("inferq.submit", {"api_key": "iq_bad_key", "prompt": "Hello"}),
        ("inferq.submit", {"api_key": t.key, "prompt": "x", "webhook_url": "http://10.0.0.1/hook"}),
        ("inferq.submit", {"api_key": full.key, "prompt": "Hello"}),
        ("inferq.submit", {"api_key": t.key, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}),
        ("inferq.submit", {"api_key": t.key, "prompt": "Hi", "model": "no-such-model"}),
    ])
    ok = results[0]
    assert "ok" in ok, results
    with db() as s:
        job = s.get(Job, ok["ok"])
        assert job.tenant_id == t.tenant_id and job.tier == "batch" and job.status == "queued"
    assert results[1]["error"] == "InvalidRequest" and "max_tokens" in results[1]["message"]
    assert results[2]["error"] == "Unauthorized" and "api_key" in results[2]["message"]
    assert results[3]["error"] == "InvalidRequest" and "webhook_url" in results[3]["message"]
    assert results[4]["error"] == "QuotaExceededError" and "retry after" in results[4]["message"]
    assert results[5]["error"] == "InvalidRequest" and "exactly one of" in results[5]["message"]
    # the same model check as POST /v1/jobs: a model no worker serves is refused, not queued forever
    assert results[6]["error"] == "InvalidRequest" and "model_not_found" in results[6]["message"], results[6]
    with db() as s:
        assert s.scalar(select(Job).where(Job.tenant_id == t.tenant_id, Job.model == "no-such-model")) is None


def test_generate_task_waits_for_the_job(celery_worker, settings, make_tenant, db, redis_client):
    """inferq.generate returns the GET-job dict once the job is terminal (finished here the way the worker
    finishes jobs: result + ledger in PostgreSQL, then the `done` event), and fails for a cancelled job."""
    t = make_tenant()

    def finisher() -> None:
        finished: set[str] = set()
        deadline = time.monotonic() + 120
        while len(finished) < 2 and time.monotonic() < deadline:
            with db() as s:
                queued = s.scalars(select(Job).where(Job.tenant_id == t.tenant_id, Job.status == "queued")).all()
            for job in queued:
                if job.id in finished:
                    continue
                with db() as s:
                    if job.request.get("prompt") == "cancel me":
                        jobs.cancel(db, redis_client, settings, job.id)
                    else:
                        jobs.transition(s, job.id, "queued", "running", attempts=1, started_at=utcnow())
                        outcome = jobs.Outcome(status="succeeded", text="Paris.", finish_reason="stop",
                                               prompt_tokens=5, completion_tokens=2, compute_seconds=0.01)
                        jobs.finish(s, job.id, outcome)
                        s.commit()
                        pipe = redis_client.pipeline()
                        jobs.publish_events(pipe, settings, job.id, jobs.done_event(outcome))
                        pipe.execute()
                finished.add(job.id)
            time.sleep(0.1)

    th = threading.Thread(target=finisher, daemon=True)
    th.start()
    results = run_client(settings, [
        ("inferq.generate", {"api_key": t.key, "prompt": "Capital of France?", "max_tokens": 4}),
        ("inferq.generate", {"api_key": t.key, "prompt": "cancel me", "max_tokens": 4}),
    ])
    th.join(5)
    view = results[0]["ok"]
    with db() as s:
        assert view == get_job_view(s, view["id"])
    assert view["status"] == "succeeded" and view["text"] == "Paris." and view["usage"]["total_tokens"] == 7
    assert results[1]["error"] == "JobFailed" and "cancelled" in results[1]["message"]
