"""Webhook delivery guarantees of docs/API.md against a real HTTP receiver (pytest-httpserver on 127.0.0.1,
allow-listed) and the real PostgreSQL: the ``X-Inferq-Delivery`` id is the same on every retry (receivers
deduplicate on it), redirects are not followed (a 3xx is a failed attempt), and a dispatcher killed with
SIGKILL in the middle of a delivery loses nothing: its lease holds the delivery away from other
dispatchers, then it is made again, under the same delivery id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from sqlalchemy import update
from werkzeug import Request, Response

from api.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, WebhookDispatcher, deliveries_for, verify
from inferq import jobs
from inferq.db import WebhookDelivery, utcnow
from tests.service_fixtures import ROOT, wait_for

pytestmark = pytest.mark.integration

BODY = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}
DELIVERY_HEADER = "X-Inferq-Delivery"
ATTEMPT_HEADER = "X-Inferq-Attempt"


@pytest.fixture
def fast_settings(settings):
    return settings.model_copy(update={"webhook_backoff_base_seconds": 0.05, "webhook_max_attempts": 3,
                                       "webhook_timeout_seconds": 5.0})


def _finished_job(client, tenant, db, url: str) -> str:
    """A job with ``url`` as its webhook, finished the way a worker finishes one."""
    r = client.post("/v1/jobs", json={**BODY, "webhook_url": url}, headers=tenant.headers)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    with db() as s:
        assert jobs.transition(s, job_id, "queued", "running", attempts=1, started_at=utcnow())
        assert jobs.finish(s, job_id, jobs.Outcome(status="succeeded", text="Paris.", finish_reason="stop",
                                                   prompt_tokens=4, completion_tokens=2))
        s.commit()
    return job_id


def _pump(dispatcher: WebhookDispatcher, db, job_id: str, until: set[str], timeout: float = 30) -> dict:
    def settled():
        dispatcher.run_once()
        rows = deliveries_for(db, job_id)
        return rows and rows[0]["status"] in until and rows[0]

    return wait_for(settled, timeout, interval=0.05, what=f"the delivery of {job_id} to be {until}")


def test_delivery_id_is_the_same_on_every_retry(client, tenant, db, fast_settings, httpserver):
    seen: list[dict] = []
    answers = iter([500, 503, 200])

    def handler(request: Request) -> Response:
        seen.append(dict(request.headers))
        return Response("", status=next(answers))

    httpserver.expect_request("/retry", method="POST").respond_with_handler(handler)
    job_id = _finished_job(client, tenant, db, httpserver.url_for("/retry"))
    dispatcher = WebhookDispatcher(fast_settings, db)
    try:
        row = _pump(dispatcher, db, job_id, {"delivered", "failed"})
    finally:
        dispatcher.stop()
    assert row["status"] == "delivered" and [h["status_code"] for h in row["history"]] == [500, 503, 200]
    assert [h[DELIVERY_HEADER] for h in seen] == [str(row["id"])] * 3
    assert [h[ATTEMPT_HEADER] for h in seen] == ["1", "2", "3"]
    assert {h["X-Inferq-Job"] for h in seen} == {job_id}


def test_redirects_are_not_followed(client, tenant, db, fast_settings, httpserver):
    """A 3xx answer is a failed attempt like any non-2xx: the redirect target (even an allow-listed one)
    is never called, so a receiver cannot bounce signed job data to another address."""
    followed: list[str] = []
    httpserver.expect_request("/moved", method="POST").respond_with_response(
        Response("", status=307, headers={"Location": httpserver.url_for("/elsewhere")}))
    httpserver.expect_request("/elsewhere").respond_with_handler(
        lambda request: followed.append(request.path) or Response("", status=200))
    job_id = _finished_job(client, tenant, db, httpserver.url_for("/moved"))
    dispatcher = WebhookDispatcher(fast_settings.model_copy(update={"webhook_max_attempts": 2}), db)
    try:
        row = _pump(dispatcher, db, job_id, {"delivered", "failed"})
    finally:
        dispatcher.stop()
    assert row["status"] == "failed" and row["attempts"] == 2
    assert [h["status_code"] for h in row["history"]] == [307, 307]
    assert row["last_error"] == "receiver answered HTTP 307"
    assert followed == []


def _dispatcher_process(settings, log_path) -> subprocess.Popen:
    """``inferq webhooks`` in its own process, configured through INFERQ_* like in production."""
    env = {**os.environ, "INFERQ_DATABASE_URL": settings.database_url, "INFERQ_REDIS_URL": settings.redis_url,
           "INFERQ_STREAM_PREFIX": settings.stream_prefix, "INFERQ_WEBHOOK_ALLOWLIST": settings.webhook_allowlist,
           "INFERQ_WEBHOOK_TIMEOUT_SECONDS": str(settings.webhook_timeout_seconds), "INFERQ_LOG_JSON": "true",
           "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-c", "from deploy.cli import main; main()", "webhooks",
                                 "--poll-interval", "0.1"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_dispatcher_killed_mid_delivery_delivers_after_the_lease(client, tenant, db, fast_settings, httpserver,
                                                                 tmp_path):
    seen: list[tuple[dict, bytes]] = []
    release = threading.Event()

    def handler(request: Request) -> Response:
        seen.append((dict(request.headers), request.get_data()))
        if len(seen) == 1:
            release.wait(60)  # the first dispatcher dies while it waits for this answer
        return Response("", status=204)

    httpserver.expect_request("/slow", method="POST").respond_with_handler(handler)
    job_id = _finished_job(client, tenant, db, httpserver.url_for("/slow"))
    proc = _dispatcher_process(fast_settings, tmp_path / "webhooks.log")
    try:
        wait_for(lambda: seen or proc.poll() is not None, 60, what="the dispatcher's first attempt")
        assert seen, (tmp_path / "webhooks.log").read_text()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        release.set()
    row = deliveries_for(db, job_id)[0]
    assert row["status"] == "pending" and row["attempts"] == 0  # the attempt died unrecorded

    restarted = WebhookDispatcher(fast_settings, db)
    try:
        restarted.run_once()  # synchronous: any attempt it makes is over when it returns
        assert len(seen) == 1 and deliveries_for(db, job_id)[0]["attempts"] == 0  # leased: not made twice at once
        with db() as s:  # the lease (2 x timeout + 30 s) runs out
            s.execute(update(WebhookDelivery).where(WebhookDelivery.job_id == job_id)
                      .values(next_attempt_at=utcnow()))
            s.commit()
        row = _pump(restarted, db, job_id, {"delivered", "failed"})
    finally:
        restarted.stop()
    assert row["status"] == "delivered" and row["attempts"] == 1
    assert len(seen) == 2
    (h1, b1), (h2, b2) = seen
    assert h1[DELIVERY_HEADER] == h2[DELIVERY_HEADER] == str(row["id"])  # the receiver can deduplicate
    assert b1 == b2
    assert verify(tenant.webhook_secret, h2[TIMESTAMP_HEADER], b2, h2[SIGNATURE_HEADER])
