"""Takeover fencing on the real PostgreSQL: a worker whose heartbeat went stale loses its job to another
worker (``running -> running`` in ``jobs.claim``), and from then on every write of the old attempt is
refused: its ``finish`` stores no result and no ledger row, its heartbeat no longer reports the job, and
its hand-back does not requeue it."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import func, select, update

from inferq import jobs
from inferq.contract import JobCreate
from inferq.db import Job, Result, UsageEntry, utcnow
from tests.service_fixtures import make_tenant, private_redis  # noqa: F401

pytestmark = pytest.mark.integration

STALE = 10.0  # seconds without a heartbeat after which a running job may be taken over


@pytest.fixture
def cfg(settings, private_redis):  # noqa: F811
    return settings.model_copy(update={"redis_url": private_redis.url, "model": "tiny"})


@pytest.fixture
def job_id(db, private_redis, cfg):  # noqa: F811
    job, _ = jobs.submit(db, private_redis.client, cfg, make_tenant(db), JobCreate(prompt="hi", max_tokens=4))
    return job.id


def _age_heartbeat(db, job_id: str, seconds: float) -> None:
    with db() as s:
        s.execute(update(Job).where(Job.id == job_id)
                  .values(heartbeat_at=utcnow() - dt.timedelta(seconds=seconds)))
        s.commit()


def _claim(db, job_id: str, worker: str):
    with db() as s:
        got = jobs.claim(s, job_id, worker, STALE)
        s.commit()
    return got


def _counts(db, job_id: str) -> tuple[int, int]:
    with db() as s:
        results = s.scalar(select(func.count()).select_from(Result).where(Result.job_id == job_id))
        ledger = s.scalar(select(func.count()).select_from(UsageEntry).where(UsageEntry.job_id == job_id))
    return results, ledger


def _finish(db, job_id: str, attempt: int, worker: str, text: str) -> bool:
    outcome = jobs.Outcome(status="succeeded", text=text, finish_reason="stop", prompt_tokens=3,
                           completion_tokens=2)
    with db() as s:
        ok = jobs.finish(s, job_id, outcome, attempt=attempt, worker=worker)
        s.commit() if ok else s.rollback()
    return ok


def test_live_heartbeat_is_not_taken_over(db, job_id):
    assert _claim(db, job_id, "w1") == (1, False)
    assert _claim(db, job_id, "w2") is None
    with db() as s:
        assert jobs.owner_of(s, job_id) == ("running", "w1", 1)


def test_stale_heartbeat_is_taken_over_with_a_new_attempt(db, job_id):
    assert _claim(db, job_id, "w1") == (1, False)
    _age_heartbeat(db, job_id, STALE + 5)
    assert _claim(db, job_id, "w2") == (2, False)
    with db() as s:
        assert jobs.owner_of(s, job_id) == ("running", "w2", 2)


def test_old_attempt_finish_writes_nothing_and_new_one_writes_once(db, job_id):
    _claim(db, job_id, "w1")
    _age_heartbeat(db, job_id, STALE + 5)
    _claim(db, job_id, "w2")
    assert not _finish(db, job_id, attempt=1, worker="w1", text="late")  # fenced out
    assert _counts(db, job_id) == (0, 0)
    with db() as s:
        assert jobs.status_of(s, job_id) == "running"
    assert _finish(db, job_id, attempt=2, worker="w2", text="winner")
    assert _counts(db, job_id) == (1, 1)
    assert not _finish(db, job_id, attempt=1, worker="w1", text="later still")  # after the winner, too
    assert _counts(db, job_id) == (1, 1)
    with db() as s:
        assert s.get(Result, job_id).text == "winner"


def test_same_attempt_number_from_another_worker_is_refused(db, job_id):
    """The worker fence matters on its own: attempt numbers alone do not identify the owner."""
    _claim(db, job_id, "w1")
    assert not _finish(db, job_id, attempt=1, worker="w2", text="not mine")
    assert _counts(db, job_id) == (0, 0)


def test_heartbeat_drops_jobs_the_worker_no_longer_owns(db, job_id):
    _claim(db, job_id, "w1")
    with db() as s:
        assert jobs.heartbeat(s, "w1", [job_id]) == {job_id: (1, False)}
        s.commit()
    _age_heartbeat(db, job_id, STALE + 5)
    _claim(db, job_id, "w2")
    with db() as s:
        assert jobs.heartbeat(s, "w1", [job_id]) == {}
        assert jobs.heartbeat(s, "w2", [job_id]) == {job_id: (2, False)}
        s.commit()


def test_old_attempt_cannot_hand_the_job_back(db, job_id):
    _claim(db, job_id, "w1")
    _age_heartbeat(db, job_id, STALE + 5)
    _claim(db, job_id, "w2")
    with db() as s:
        assert not jobs.transition(s, job_id, "running", "queued", where=jobs.owned_by(1, "w1"), worker=None)
        assert jobs.transition(s, job_id, "running", "queued", where=jobs.owned_by(2, "w2"), worker=None)
        s.commit()
        assert jobs.status_of(s, job_id) == "queued"
