"""The worker's one-round-trip claim on the real PostgreSQL (``jobs.claim_many_postgres``, used by
``JobStore.claim``) against the per-job ORM claim (``jobs.claim``): the same jobs are taken with the same attempts
and cancel flags, and every other message is sorted the same way (alive on another worker: busy; finished,
cancelled or unknown: gone)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlalchemy import update

from inferq import jobs
from inferq.contract import JobCreate, JobMessage
from inferq.db import Job, utcnow
from tests.service_fixtures import make_tenant, private_redis  # noqa: F401
from worker.jobstore import JobStore
from worker.metrics import WorkerMetrics
from worker.streams import Message

pytestmark = pytest.mark.integration

STALE = 10.0


@pytest.fixture
def cfg(settings, private_redis):  # noqa: F811
    return settings.model_copy(update={"redis_url": private_redis.url, "model": "tiny"})


def _scenario(db, redis, cfg) -> dict[str, str]:
    """One job in each state a claim can meet: {label: job_id}."""
    tenant = make_tenant(db)
    ids = {label: jobs.submit(db, redis, cfg, tenant, JobCreate(prompt="hi", max_tokens=4))[0].id
           for label in ("queued", "flagged", "alive", "stale", "never_beat", "done", "cancelled")}
    now = utcnow()
    with db() as s:
        def set_(label: str, **values) -> None:
            s.execute(update(Job).where(Job.id == ids[label]).values(**values))

        set_("flagged", cancel_requested=True)
        set_("alive", status="running", worker="other", attempts=1, heartbeat_at=now)
        set_("stale", status="running", worker="dead", attempts=2, heartbeat_at=now - dt.timedelta(seconds=60))
        set_("never_beat", status="running", worker="dead", attempts=1, heartbeat_at=None)
        set_("done", status="succeeded", attempts=1, finished_at=now)
        set_("cancelled", status="cancelled", finished_at=now)
        s.commit()
    ids["unknown"] = str(uuid.uuid4())
    return ids


def _orm_claims(db, ids: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    with db() as s:
        for label, job_id in ids.items():
            got = jobs.claim(s, job_id, "me", STALE)
            out[label] = got if got is not None else jobs.status_of(s, job_id)
        s.commit()
    return out


def test_one_round_trip_claim_agrees_with_the_orm_claim(db, private_redis, cfg):  # noqa: F811
    engine = db.kw["bind"]
    a, b = _scenario(db, private_redis.client, cfg), _scenario(db, private_redis.client, cfg)
    expected = _orm_claims(db, a)
    taken, others = jobs.claim_many_postgres(engine, list(b.values()), "me", STALE)
    got = {label: taken.get(job_id, others.get(job_id)) for label, job_id in b.items()}
    assert got == expected
    assert got == {"queued": (1, False), "flagged": (1, True), "alive": "running", "stale": (3, False),
                   "never_beat": (2, False), "done": "succeeded", "cancelled": "cancelled", "unknown": None}
    with db() as s:  # committed: the rows are this worker's
        for label in ("queued", "stale", "never_beat"):
            job = s.get(Job, b[label])
            assert (job.status, job.worker, job.started_at is not None) == ("running", "me", True)
        assert s.get(Job, b["alive"]).worker == "other"


def _message(job_id: str, n: int) -> Message:
    job = JobMessage(job_id=job_id, tenant_id="t", cache_namespace="t", model="tiny", tier="interactive",
                     priority=0, request={"prompt": "hi"})
    return Message(stream="s", msg_id=f"{n}-0", raw=None, job=job)


def test_job_store_sorts_a_batch_on_the_fast_path(db, private_redis, cfg, monkeypatch):  # noqa: F811
    ids = _scenario(db, private_redis.client, cfg)

    def orm_claim(*_):
        raise AssertionError("the batch went through the per-job ORM claim")

    monkeypatch.setattr(jobs, "claim", orm_claim)
    store = JobStore(cfg, "me", WorkerMetrics(), log=None, on_give_up=lambda: None)
    try:
        # the queued job's message twice (a redelivery in the same read): claimed once, the other busy
        batch = [_message(job_id, n) for n, job_id in enumerate(ids.values())] + [_message(ids["queued"], 99)]
        claims = store.claim(batch, now_unix=utcnow().timestamp())
    finally:
        store.db_engine.dispose()
    started = {m.job.job_id: (attempt, cancel) for m, attempt, cancel in claims.started}
    label = {job_id: name for name, job_id in ids.items()}
    assert {label[j]: v for j, v in started.items()} == {"queued": (1, False), "flagged": (1, True),
                                                          "stale": (3, False), "never_beat": (2, False)}
    assert sorted(label[m.job.job_id] for m in claims.busy) == ["alive", "queued"]
    assert sorted(label[m.job.job_id] for m in claims.gone) == ["cancelled", "done", "unknown"]
    assert [m.msg_id for m in claims.busy if m.job.job_id == ids["queued"]] == ["99-0"]
    assert not claims.expired
