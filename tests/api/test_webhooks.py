"""Webhooks against a real HTTP receiver (pytest-httpserver on 127.0.0.1, allow-listed): signature,
body = GET-job JSON, retries with backoff after the receiver answers 500, every attempt recorded,
redelivery across a dispatcher restart, giving up after webhook_max_attempts, and the dispatcher
running inside the API process."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import time

import httpx
import pytest
from werkzeug import Request, Response

from api.webhooks import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    UnsafeURL,
    WebhookDispatcher,
    backoff_seconds,
    check_webhook_url,
    deliveries_for,
    sign,
    verify,
)
from inferq import jobs
from inferq.db import utcnow

BODY = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}


def test_sign_and_verify():
    body = b'{"id":"x"}'
    sig = sign("secret", 1700000000, body)
    assert verify("secret", "1700000000", body, sig, now=1700000010)
    assert not verify("secret", "1700000000", body + b" ", sig, now=1700000010)
    assert not verify("other", "1700000000", body, sig, now=1700000010)
    assert not verify("secret", "1700000000", body, sig, now=1700009999)  # stale: replay refused
    assert sig == hmac.new(b"secret", b"1700000000." + body, hashlib.sha256).hexdigest()


def test_backoff_grows_with_jitter():
    for attempt in range(1, 8):
        full = 2.0 * 2 ** (attempt - 1)
        values = [backoff_seconds(attempt, 2.0) for _ in range(50)]
        assert all(full / 2 <= v <= full for v in values)
        assert len(set(values)) > 1
    assert backoff_seconds(50, 2.0) <= 3600


def test_url_checks():
    for url in ("http://127.0.0.1/x", "http://10.0.0.1/x", "http://169.254.169.254/", "gopher://x", "http://[::1]/"):
        with pytest.raises(UnsafeURL):
            check_webhook_url(url, [])
    check_webhook_url("http://127.0.0.1:8080/x", ["127.0.0.1"])
    check_webhook_url("http://10.1.2.3/x", ["10.0.0.0/8"])
    check_webhook_url("https://8.8.8.8/hook", [])
    with pytest.raises(UnsafeURL):
        check_webhook_url("http://10.1.2.3/x", ["192.168.0.0/16"])


@pytest.fixture
def fast_settings(settings):
    return settings.model_copy(update={"webhook_backoff_base_seconds": 0.05, "webhook_max_attempts": 3,
                                       "webhook_timeout_seconds": 5.0})


def _finish(db, job_id: str) -> None:
    with db() as s:
        assert jobs.transition(s, job_id, "queued", "running", attempts=1, started_at=utcnow())
        assert jobs.finish(s, job_id, jobs.Outcome(status="succeeded", text="Paris.", finish_reason="stop",
                                                   prompt_tokens=4, completion_tokens=2))
        s.commit()


def _pump(dispatcher: WebhookDispatcher, db, job_id: str, until: set[str], timeout: float = 20,
          interval: float = 0.05) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dispatcher.run_once()
        rows = deliveries_for(db, job_id)
        if rows and rows[0]["status"] in until:
            return rows
        time.sleep(interval)
    raise AssertionError(f"delivery not {until}: {deliveries_for(db, job_id)}")


@pytest.mark.integration
def test_webhook_retried_then_delivered_across_restart(client, tenant, db, fast_settings, httpserver):
    received: list[tuple[dict, bytes]] = []
    answers = [500, 200]

    def handler(request: Request) -> Response:
        received.append((dict(request.headers), request.get_data()))
        return Response("ok", status=answers[min(len(received), len(answers)) - 1])

    httpserver.expect_request("/hook", method="POST").respond_with_handler(handler)
    url = httpserver.url_for("/hook")
    r = client.post("/v1/jobs", json={**BODY, "webhook_url": url}, headers=tenant.headers)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    _finish(db, job_id)

    first = WebhookDispatcher(fast_settings, db)
    rows = _pump(first, db, job_id, {"pending", "delivered"})
    while rows[0]["attempts"] < 1:
        rows = _pump(first, db, job_id, {"pending", "delivered"})
    first.stop()  # "restart": the retry state is in PostgreSQL only
    assert rows[0]["status"] == "pending" and rows[0]["last_status_code"] == 500

    second = WebhookDispatcher(fast_settings, db)
    rows = _pump(second, db, job_id, {"delivered"})
    second.stop()
    d = rows[0]
    assert d["attempts"] == 2 and d["url"] == url
    assert [h["status_code"] for h in d["history"]] == [500, 200]
    assert d["history"][0]["error"] == "receiver answered HTTP 500" and d["history"][1]["error"] is None
    assert len(received) == 2

    job = client.get(f"/v1/jobs/{job_id}", headers=tenant.headers).json()
    for headers, body in received:
        assert verify(tenant.webhook_secret, headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
        assert headers["Content-Type"] == "application/json"
        assert json.loads(body) == job  # the GET-job JSON
    assert job["status"] == "succeeded" and job["text"] == "Paris."


@pytest.mark.integration
def test_webhook_gives_up_after_max_attempts(client, tenant, db, fast_settings, httpserver):
    """Five failed attempts, then ``failed``; the gaps between attempts grow as the back-off policy says."""
    settings = fast_settings.model_copy(update={"webhook_max_attempts": 5, "webhook_backoff_base_seconds": 0.1})
    httpserver.expect_request("/down", method="POST").respond_with_data("nope", status=503)
    r = client.post("/v1/jobs", json={**BODY, "webhook_url": httpserver.url_for("/down")}, headers=tenant.headers)
    job_id = r.json()["id"]
    _finish(db, job_id)
    dispatcher = WebhookDispatcher(settings, db)
    rows = _pump(dispatcher, db, job_id, {"failed"}, timeout=60, interval=0.01)
    dispatcher.stop()
    assert rows[0]["attempts"] == settings.webhook_max_attempts == 5
    assert [h["status_code"] for h in rows[0]["history"]] == [503] * 5
    _assert_backoff_gaps([dt.datetime.fromisoformat(h["at"]) for h in rows[0]["history"]],
                         settings.webhook_backoff_base_seconds)


def _assert_backoff_gaps(times: list[dt.datetime], base: float) -> None:
    """Retry n waits ``backoff_seconds(n, base)``: between half and all of ``base * 2**(n-1)`` (equal jitter),
    so its floor doubles with each retry, and a gap between two recorded attempts (the wait plus the next
    attempt's own time) is never below it. A slow machine only lengthens gaps, so no upper bound is checked;
    and as neighbouring jitter ranges touch, consecutive gaps are compared through their floors."""
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)]
    floors = [base * 2 ** (n - 1) / 2 for n in range(1, len(times))]
    assert all(gap >= floor for gap, floor in zip(gaps, floors, strict=True)), (gaps, floors)
    assert floors == sorted(floors) and floors[-1] == 8 * floors[0]  # what the gaps above had to clear


@pytest.mark.integration
def test_webhook_from_api_process(serve, fast_settings, tenant, db, httpserver, redis_client):
    got: list[bytes] = []

    def handler(request: Request) -> Response:
        got.append(request.get_data())
        return Response("", status=204)

    httpserver.expect_request("/bg", method="POST").respond_with_handler(handler)
    url = serve(fast_settings, webhooks=True)
    with httpx.Client(base_url=url) as c:
        job_id = c.post("/v1/jobs", json={**BODY, "webhook_url": httpserver.url_for("/bg")},
                        headers=tenant.headers).json()["id"]
        # cancelling a queued job is a terminal state too
        assert c.post(f"/v1/jobs/{job_id}/cancel", headers=tenant.headers).json()["status"] == "cancelled"
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.1)
    assert got and json.loads(got[0])["status"] == "cancelled"
    deadline = time.monotonic() + 5
    while deadline > time.monotonic() and deliveries_for(db, job_id)[0]["status"] != "delivered":
        time.sleep(0.1)
    assert deliveries_for(db, job_id)[0]["status"] == "delivered"


@pytest.mark.integration
def test_webhook_refused_at_delivery_if_no_longer_allowed(client, tenant, db, settings, httpserver):
    """DNS or the allow-list may change after submission: the dispatcher checks again and gives up."""
    httpserver.expect_request("/x", method="POST").respond_with_data("ok")
    job_id = client.post("/v1/jobs", json={**BODY, "webhook_url": httpserver.url_for("/x")},
                         headers=tenant.headers).json()["id"]
    _finish(db, job_id)
    strict = settings.model_copy(update={"webhook_allowlist": ""})
    dispatcher = WebhookDispatcher(strict, db)
    rows = _pump(dispatcher, db, job_id, {"failed"})
    dispatcher.stop()
    assert rows[0]["attempts"] == 1 and "refused" in rows[0]["last_error"]
    assert len(httpserver.log) == 0
