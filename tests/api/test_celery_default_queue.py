"""Celery's default queue: a client that knows nothing of inferq calls ``send_task("inferq.submit", ...)``
without ``queue=`` (Celery's own default, ``celery``) and is served by a real ``inferq celery-worker``
instead of waiting until its timeout; the failures a client causes are logged as one line each, not as
"raised unexpected" with a traceback. The broker is a Redis database of its own, so that no other test's
Celery worker (they consume ``celery`` too) can take these tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from api.celery_app import consumed_queues
from inferq.db import Job
from inferq.settings import Settings
from tests.conftest import TEST_REDIS_URL
from tests.registry_helpers import announce_default_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
BROKER_URL = TEST_REDIS_URL.rsplit("/", 1)[0] + "/13"

CLIENT = r"""
import json, sys
from celery import Celery
broker, calls = sys.argv[1], json.loads(sys.argv[2])
app = Celery(broker=broker, backend=broker)
pending = [app.send_task(name, kwargs=kwargs) for name, kwargs in calls]  # no queue=: Celery's default
out = []
for r in pending:
    try:
        out.append({"ok": r.get(timeout=60)})
    except Exception as exc:
        out.append({"error": type(exc).__name__, "message": str(exc)})
print(json.dumps(out))
"""


@pytest.fixture
def broker():
    client = redis.Redis.from_url(BROKER_URL)
    yield client
    for pattern in ("celery", "celery-task-meta-*", "_kombu.binding.*", "unacked*", "inferq-test-*"):
        for key in client.scan_iter(match=pattern, count=1000):
            client.delete(key)
    client.close()


@pytest.fixture
def celery_worker(settings, tmp_path, broker):
    announce_default_model(settings)  # the tasks check the model as POST /v1/jobs does
    log_path = tmp_path / "celery.log"
    env = {**os.environ, "INFERQ_DATABASE_URL": settings.database_url, "INFERQ_REDIS_URL": settings.redis_url,
           "INFERQ_STREAM_PREFIX": settings.stream_prefix, "INFERQ_CELERY_BROKER_URL": BROKER_URL,
           "INFERQ_CELERY_RESULT_BACKEND": BROKER_URL, "INFERQ_LOG_JSON": "true", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from deploy.cli import main; main()", "celery-worker", "--concurrency", "2",
             "--hostname", f"{settings.stream_prefix}@test", "--loglevel", "INFO"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    yield log_path
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_send_task_without_queue_is_served_and_client_errors_are_one_line(celery_worker, make_tenant, db):
    t = make_tenant()
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, BROKER_URL, json.dumps([
            ["inferq.submit", {"api_key": t.key, "prompt": "Hello", "max_tokens": 4}],
            ["inferq.submit", {"api_key": "iq_bad_key", "prompt": "Hello"}],
            ["inferq.submit", {"api_key": t.key, "prompt": "Hello", "max_tokens": 0}],
        ])], capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONPATH": ""}, cwd="/")
    assert out.returncode == 0, out.stderr
    ok, unauthorized, invalid = json.loads(out.stdout.strip().splitlines()[-1])
    assert "ok" in ok, (ok, celery_worker.read_text()[-3000:])
    with db() as s:
        assert s.get(Job, ok["ok"]).tenant_id == t.tenant_id
    assert unauthorized["error"] == "Unauthorized" and invalid["error"] == "InvalidRequest"

    log = celery_worker.read_text()
    expected = [line for line in log.splitlines() if "raised expected" in line]
    assert len(expected) == 2, log[-3000:]
    assert any("Unauthorized" in line for line in expected) and any("InvalidRequest" in line for line in expected)
    assert "raised unexpected" not in log and "Traceback" not in log, log[-3000:]


def test_the_default_queue_can_be_left_to_others():
    assert consumed_queues(Settings(stream_prefix="iq")) == ["iq", "celery"]
    assert consumed_queues(Settings(stream_prefix="iq", celery_consume_default_queue=False)) == ["iq"]
