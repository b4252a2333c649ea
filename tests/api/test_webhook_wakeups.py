"""The webhook dispatcher sleeps between rounds and is woken by PostgreSQL (api/webhook_wakeups.py, migration
0006): a job with a webhook that finishes, or a retry that falls due, gets its attempt at once although the
dispatcher's backstop poll is a minute away; ``stop`` wakes it; a lost ``LISTEN`` connection is replaced."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text
from werkzeug import Response

from api.webhook_wakeups import CHANNEL
from api.webhooks import WebhookDispatcher, deliveries_for
from inferq import jobs
from inferq.db import utcnow
from tests.api.test_webhook_delivery import _finished_job
from tests.service_fixtures import wait_for

pytestmark = pytest.mark.integration

BACKSTOP = 60.0  # far longer than any wait below: only a wake-up can explain a prompt attempt


@pytest.fixture
def fast_settings(settings):
    return settings.model_copy(update={"webhook_backoff_base_seconds": 0.05, "webhook_max_attempts": 3,
                                       "webhook_timeout_seconds": 5.0})


def _started(settings, db, poll_interval: float = BACKSTOP) -> WebhookDispatcher:
    """A dispatcher running in its thread, asleep on its ``LISTEN`` connection."""
    dispatcher = WebhookDispatcher(settings, db, poll_interval=poll_interval, idle_seconds=BACKSTOP)
    dispatcher.start()
    wait_for(lambda: dispatcher.wakeups._conn is not None, 30, interval=0.02, what="the dispatcher to LISTEN")
    wait_for(lambda: _listening(db), 30, interval=0.02, what="the LISTEN to reach the server")
    return dispatcher


def _listening(db) -> bool:
    with db() as s:
        return bool(s.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE query = :q"),
                             {"q": f"LISTEN {CHANNEL}"}))


def _delivered(db, job_id: str, timeout: float = 20) -> dict:
    return wait_for(lambda: (rows := deliveries_for(db, job_id)) and rows[0]["status"] == "delivered" and rows[0],
                    timeout, interval=0.05, what=f"the delivery of {job_id}")


def _finished_while_asleep(client, tenant, db, settings, url: str) -> dict:
    """A job with webhook ``url`` finished while a started dispatcher sleeps: its delivery row once delivered."""
    dispatcher = _started(settings, db)
    try:
        return _delivered(db, _finished_job(client, tenant, db, url))
    finally:
        dispatcher.stop()


def test_a_finished_job_wakes_the_dispatcher(client, tenant, db, fast_settings, httpserver):
    httpserver.expect_request("/hook", method="POST").respond_with_data("", status=204)
    row = _finished_while_asleep(client, tenant, db, fast_settings, httpserver.url_for("/hook"))
    assert row["attempts"] == 1


def test_a_retry_falling_due_wakes_the_dispatcher(client, tenant, db, fast_settings, httpserver):
    answers = iter([503, 200])
    httpserver.expect_request("/flaky", method="POST").respond_with_handler(
        lambda request: Response("", status=next(answers)))
    row = _finished_while_asleep(client, tenant, db, fast_settings, httpserver.url_for("/flaky"))
    assert [h["status_code"] for h in row["history"]] == [503, 200]


def test_stop_wakes_a_sleeping_dispatcher(db, fast_settings):
    dispatcher = _started(fast_settings, db)
    thread = dispatcher._thread
    dispatcher.stop(timeout=10)
    assert thread is not None and not thread.is_alive()
    assert dispatcher.wakeups._conn is None  # its LISTEN connection closed on the way out


def test_a_lost_listen_connection_is_replaced(client, tenant, db, fast_settings, httpserver):
    seen = threading.Event()
    httpserver.expect_request("/after", method="POST").respond_with_handler(
        lambda request: seen.set() or Response("", status=204))
    dispatcher = _started(fast_settings, db, poll_interval=0.2)
    try:
        with db() as s:  # as a server restart or a network cut would
            s.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = :q"),
                      {"q": f"LISTEN {CHANNEL}"})
            s.commit()
        wait_for(lambda: _listening(db), 30, interval=0.05, what="a new LISTEN connection")
        job_id = _finished_job(client, tenant, db, httpserver.url_for("/after"))
        _delivered(db, job_id)
    finally:
        dispatcher.stop()
    assert seen.is_set()


def test_only_webhook_jobs_becoming_terminal_notify(client, tenant, db, httpserver):
    """The trigger's conditions: a job without a webhook finishing, or a webhook job starting, sends nothing;
    a webhook job finishing sends one notification (after its commit)."""
    fairy = db.kw["bind"].raw_connection()
    listener = fairy.driver_connection
    listener.autocommit = True
    listener.execute(f"LISTEN {CHANNEL}")

    def received(timeout: float) -> list[str]:
        return [n.payload for n in listener.notifies(timeout=timeout, stop_after=1)]

    url = httpserver.url_for("/h")
    try:
        _finished_job(client, tenant, db, None)
        assert received(0.5) == []
        r = client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 4, "webhook_url": url}, headers=tenant.headers)
        assert r.status_code == 202, r.text
        with db() as s:
            assert jobs.transition(s, r.json()["id"], "queued", "running", attempts=1, started_at=utcnow())
            s.commit()
        assert received(0.5) == []
        _finished_job(client, tenant, db, url)
        assert received(5) == [""]
    finally:
        listener.execute(f"UNLISTEN {CHANNEL}")
        fairy.close()
