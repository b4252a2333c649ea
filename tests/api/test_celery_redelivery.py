"""Celery redelivery (docs/API.md: ``acks_late``, a task whose worker dies is redelivered): a real
``inferq celery-worker`` killed with SIGKILL in the middle of an ``inferq.generate`` task leaves the task's
message unacknowledged on the real Redis broker; the next worker runs it again and the client, which knows
nothing of inferq, still gets its job, and the redelivered task does not submit the job a second time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from inferq import jobs
from inferq.db import Job, utcnow
from tests.registry_helpers import announce_default_model
from tests.service_fixtures import ROOT, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CLIENT = r"""
import json, sys
from celery import Celery
broker, queue, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
app = Celery(broker=broker, backend=broker)
try:
    print(json.dumps({"ok": app.send_task("inferq.generate", kwargs=kwargs, queue=queue).get(timeout=150)}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


class CeleryWorkers:
    """``inferq celery-worker`` processes (the default threads pool) on this test's queue."""

    def __init__(self, settings, tmp: Path) -> None:
        self.settings = settings
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self) -> subprocess.Popen:
        n = len(self.procs) + 1
        env = {**os.environ, "INFERQ_DATABASE_URL": self.settings.database_url,
               "INFERQ_REDIS_URL": self.settings.redis_url, "INFERQ_STREAM_PREFIX": self.settings.stream_prefix,
               "INFERQ_LOG_JSON": "true", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path(n), "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from deploy.cli import main; main()", "celery-worker", "--concurrency", "2",
                 "--hostname", f"{self.settings.stream_prefix}-{n}@test", "--loglevel", "INFO"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def log_path(self, n: int) -> Path:
        return self.tmp / f"celery-{n}.log"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def celery_workers(settings, tmp_path, redis_client):
    announce_default_model(settings)  # the tasks check the model as POST /v1/jobs does
    workers = CeleryWorkers(settings, tmp_path)
    yield workers
    workers.stop()
    redis_client.delete(settings.stream_prefix)  # the Celery queue list


def _unacked_tags(redis_client, queue: str) -> list[bytes]:
    """Delivery tags of the messages of ``queue`` that kombu holds unacknowledged (its ``unacked`` hash:
    tag -> [message, exchange, routing key])."""
    return [tag for tag, raw in redis_client.hgetall("unacked").items() if json.loads(raw)[2] == queue]


def _tenant_jobs(db, tenant_id: str) -> list[Job]:
    with db() as s:
        return list(s.scalars(select(Job).where(Job.tenant_id == tenant_id)).all())


def _finish_queued(db, redis_client, settings, tenant_id: str, stop: threading.Event) -> None:
    """Stand in for an inference worker: finish every queued job of the tenant, as a worker does (result and
    ledger in PostgreSQL, then the ``done`` event the task wakes on)."""
    while not stop.is_set():
        for job in _tenant_jobs(db, tenant_id):
            if job.status != "queued":
                continue
            with db() as s:
                jobs.transition(s, job.id, "queued", "running", attempts=1, started_at=utcnow())
                outcome = jobs.Outcome(status="succeeded", text="Paris.", finish_reason="stop", prompt_tokens=5,
                                       completion_tokens=2, compute_seconds=0.01)
                if jobs.finish(s, job.id, outcome):
                    s.commit()
                    pipe = redis_client.pipeline()
                    jobs.publish_events(pipe, settings, job.id, jobs.done_event(outcome))
                    pipe.execute()
        stop.wait(0.1)


def test_generate_task_is_redelivered_when_its_worker_is_killed(celery_workers, settings, make_tenant, db,
                                                                redis_client):
    tenant = make_tenant()
    queue = settings.stream_prefix
    first = celery_workers.start()
    kwargs = {"api_key": tenant.key, "prompt": "Capital of France?", "max_tokens": 4, "timeout": 120}
    client = subprocess.Popen([sys.executable, "-c", CLIENT, settings.broker_url, queue, json.dumps(kwargs)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                              env={**os.environ, "PYTHONPATH": ""})
    try:
        # the task has submitted its job and waits for it: kill its worker outright
        wait_for(lambda: _tenant_jobs(db, tenant.tenant_id), 90, what="the task to submit its job")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        tags = _unacked_tags(redis_client, queue)
        assert len(tags) == 1, celery_workers.log_path(1).read_text()[-3000:]
        # kombu gives an unacknowledged message back once it is older than the visibility timeout (an hour):
        # age this one by that much instead of waiting
        redis_client.zadd("unacked_index", {tags[0]: time.time() - 3700})
        stop = threading.Event()
        finisher = threading.Thread(target=_finish_queued, args=(db, redis_client, settings, tenant.tenant_id, stop),
                                    daemon=True)
        finisher.start()
        celery_workers.start()
        out, err = client.communicate(timeout=180)
        stop.set()
        finisher.join(5)
    finally:
        if client.poll() is None:
            client.kill()
    result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": err[-2000:]}
    assert "ok" in result, (result, celery_workers.log_path(2).read_text()[-3000:])
    view = result["ok"]
    assert view["status"] == "succeeded" and view["text"] == "Paris."
    assert [j.id for j in _tenant_jobs(db, tenant.tenant_id)] == [view["id"]]  # submitted once, not per delivery
    wait_for(lambda: _unacked_tags(redis_client, queue) == [], 20, what="the second worker's acknowledgement")
