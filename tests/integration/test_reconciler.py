"""The reconciler (inferq/jobs/reconcile.py) on the real PostgreSQL and a private real Redis: a running job
whose worker stopped heartbeating is finished as it was asked to be (``cancelled`` when its cancel was
requested, ``expired`` when its deadline passed) instead of being queued and run again; a job whose worker
is alive is left alone. (Requeueing a plain stale job and re-adding lost messages: tests/integration/
test_jobs.py; the duplicate message that re-adding can make: test_service_behaviours.py.)"""

from __future__ import annotations

import datetime as dt
import json

import pytest
from sqlalchemy import update

from inferq import jobs
from inferq.contract import JobCreate, decode_message, events_key
from inferq.db import Job, Result, UsageEntry, utcnow
from tests.conftest import fresh_database
from tests.service_fixtures import make_tenant, private_redis  # noqa: F401

pytestmark = pytest.mark.integration

STALE = 10.0  # seconds without a heartbeat after which a running job's worker counts as dead


@pytest.fixture(scope="module")
def pg_url():
    """A database of this module's own: the reconciler acts on every job in it, and the counts asserted here
    must not include other tests' stale jobs."""
    with fresh_database() as url:
        yield url


@pytest.fixture
def r(private_redis):  # noqa: F811
    return private_redis.client


@pytest.fixture
def cfg(settings, private_redis):  # noqa: F811
    return settings.model_copy(update={"redis_url": private_redis.url, "model": "tiny"})


def _running(db, r, cfg, *, heartbeat_age: float, cancel_requested: bool = False,
             deadline_in: float | None = None) -> str:
    """A job claimed by worker ``dead`` whose last heartbeat is ``heartbeat_age`` seconds old; its stream
    message is dropped so that any message found afterwards was written by the reconciler."""
    job, _ = jobs.submit(db, r, cfg, make_tenant(db), JobCreate(prompt="hello", max_tokens=4))
    beat = utcnow() - dt.timedelta(seconds=heartbeat_age)
    values = {"cancel_requested": cancel_requested}
    if deadline_in is not None:
        values["deadline_at"] = utcnow() + dt.timedelta(seconds=deadline_in)
    with db() as s:
        assert jobs.transition(s, job.id, "queued", "running", worker="dead", attempts=1, started_at=beat,
                               heartbeat_at=beat)
        s.execute(update(Job).where(Job.id == job.id).values(**values))
        s.commit()
    r.delete(*jobs.tier_streams(r, cfg.stream_prefix, "tiny", "interactive"))
    r.srem(jobs.enqueued_key(cfg.stream_prefix), job.id)
    return job.id


def _state(db, job_id: str) -> tuple[Job, list[Result], list[UsageEntry]]:
    with db() as s:
        return (s.get(Job, job_id), s.query(Result).filter_by(job_id=job_id).all(),
                s.query(UsageEntry).filter_by(job_id=job_id).all())


def _messages(r, cfg, job_id: str) -> int:
    """This job's messages on its stream (the shared test database holds other tests' queued jobs, which
    the reconciler rightly re-adds)."""
    entries = jobs.queued_entries(r, cfg.stream_prefix, "tiny", "interactive")
    return sum(decode_message(fields[b"m"])["job_id"] == job_id for _, fields in entries)


def _done_event(r, cfg, job_id: str) -> dict:
    (_, fields), = r.xrange(events_key(cfg.stream_prefix, job_id))
    assert fields[b"event"] == b"done"
    return json.loads(fields[b"data"])


def test_stale_running_job_with_cancel_requested_is_cancelled(db, r, cfg):
    job_id = _running(db, r, cfg, heartbeat_age=60, cancel_requested=True)
    report = jobs.reconcile(db, r, cfg, grace_seconds=0, stale_seconds=STALE)
    assert (report.cancelled, report.requeued, report.expired) == (1, 0, 0)
    job, results, ledger = _state(db, job_id)
    assert job.status == "cancelled" and job.error == "cancelled" and job.attempts == 1
    assert [x.finish_reason for x in results] == ["abort"]
    assert len(ledger) == 1 and ledger[0].status == "cancelled" and ledger[0].cost_micros == 0
    assert _messages(r, cfg, job_id) == 0  # never queued again: it would only be claimed to be cancelled
    assert _done_event(r, cfg, job_id)["status"] == "cancelled"  # SSE readers and generate tasks are told


def test_stale_running_job_past_its_deadline_is_expired(db, r, cfg):
    job_id = _running(db, r, cfg, heartbeat_age=60, deadline_in=-5)
    report = jobs.reconcile(db, r, cfg, grace_seconds=0, stale_seconds=STALE)
    assert (report.expired, report.requeued, report.cancelled) == (1, 0, 0)
    job, results, ledger = _state(db, job_id)
    assert job.status == "expired" and job.error == "deadline passed"
    assert [x.finish_reason for x in results] == ["deadline"]
    assert len(ledger) == 1 and ledger[0].status == "expired"
    assert _messages(r, cfg, job_id) == 0
    assert _done_event(r, cfg, job_id)["status"] == "expired"


def test_cancel_requested_before_the_deadline_wins(db, r, cfg):
    """Both apply: the user asked first, so the job is ``cancelled``, once."""
    job_id = _running(db, r, cfg, heartbeat_age=60, cancel_requested=True, deadline_in=-5)
    report = jobs.reconcile(db, r, cfg, grace_seconds=0, stale_seconds=STALE)
    assert (report.cancelled, report.expired) == (1, 0)
    assert _state(db, job_id)[0].status == "cancelled"
    assert jobs.reconcile(db, r, cfg, grace_seconds=0, stale_seconds=STALE).cancelled == 0  # done once


@pytest.mark.parametrize("flag", ["cancel_requested", "past_deadline"])
def test_live_workers_jobs_are_left_to_their_worker(db, r, cfg, flag):
    """A fresh heartbeat means the worker is alive: it sees the flag or the deadline itself and pays for
    what it computed; the reconciler must not finish the job under it."""
    kw = {"cancel_requested": True} if flag == "cancel_requested" else {"deadline_in": -5}
    job_id = _running(db, r, cfg, heartbeat_age=1, **kw)
    report = jobs.reconcile(db, r, cfg, grace_seconds=0, stale_seconds=STALE)
    assert (report.cancelled, report.expired, report.requeued) == (0, 0, 0)
    job, results, ledger = _state(db, job_id)
    assert job.status == "running" and job.worker == "dead" and (results, ledger) == ([], [])
