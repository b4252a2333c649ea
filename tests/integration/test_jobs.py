"""The job lifecycle in SQL (inferq/jobs/) against the real PostgreSQL and a private real Redis."""

from __future__ import annotations

import datetime as dt
import json
import threading

import pytest
import redis as redis_lib
from sqlalchemy import func, select, text, update

from inferq import jobs
from inferq.contract import JobCreate, decode_message, stream_key
from inferq.db import Job, Price, Result, UsageEntry, utcnow
from inferq.jobs import connections, pg_admission, quotas
from tests.service_fixtures import free_port, make_tenant, private_redis  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.fixture
def r(private_redis):  # noqa: F811
    return private_redis.client


@pytest.fixture
def cfg(settings, private_redis):  # noqa: F811
    return settings.model_copy(update={"redis_url": private_redis.url, "model": "tiny"})


def body(**kw) -> JobCreate:
    kw.setdefault("prompt", "hello world")
    kw.setdefault("max_tokens", 8)
    return JobCreate(**kw)


def stream_ids(r, cfg, tier="interactive") -> list[str]:
    return [decode_message(f[b"m"])["job_id"] for _, f in jobs.queued_entries(r, cfg.stream_prefix, "tiny", tier)]


def test_submit_writes_row_then_message(db, r, cfg):
    tenant = make_tenant(db)
    job, created = jobs.submit(db, r, cfg, tenant, body(deadline_seconds=30, priority=3, metadata={"a": 1}))
    assert created
    with db() as s:
        row = s.get(Job, job.id)
        assert row.status == "queued" and row.attempts == 0 and row.model == "tiny" and row.priority == 3
        assert row.deadline_at is not None and 29 < (row.deadline_at - row.created_at).total_seconds() <= 30
        price = s.get(Price, row.price_id)
        assert (price.version, price.prompt_per_mtok) == (1, cfg.price_prompt_per_mtok)
    (msg_id, fields), = r.xrange(stream_key(cfg.stream_prefix, "tiny", "interactive", tenant.id))  # its lane
    msg = decode_message(fields[b"m"])
    assert msg["job_id"] == job.id and msg["ns"] == tenant.cache_namespace and msg["priority"] == 3
    assert msg["request"]["prompt"] == "hello world" and msg["deadline"] == pytest.approx(row.deadline_at.timestamp())
    assert r.sismember(jobs.enqueued_key(cfg.stream_prefix), job.id)


def test_batch_price_is_discounted_and_versions_apply(db, r, cfg):
    tenant = make_tenant(db)
    job, _ = jobs.submit(db, r, cfg, tenant, body(tier="batch"))
    with db() as s:
        p1 = s.get(Price, s.get(Job, job.id).price_id)
        assert p1.tier == "batch" and p1.completion_per_mtok == int(cfg.price_completion_per_mtok * cfg.batch_discount)
        s.add(Price(model="tiny", tier="batch", version=2, prompt_per_mtok=1, cached_prompt_per_mtok=1,
                    completion_per_mtok=1))
        s.commit()
    job2, _ = jobs.submit(db, r, cfg, tenant, body(tier="batch"))
    with db() as s:
        assert s.get(Price, s.get(Job, job2.id).price_id).version == 2
        assert s.get(Job, job.id).price_id == p1.id  # the old job keeps its version


def test_idempotency(db, r, cfg):
    tenant = make_tenant(db)
    job, created = jobs.submit(db, r, cfg, tenant, body(), idempotency_key="k1")
    again, created2 = jobs.submit(db, r, cfg, tenant, body(), idempotency_key="k1")
    assert created and not created2 and again.id == job.id
    with pytest.raises(jobs.Conflict):
        jobs.submit(db, r, cfg, tenant, body(max_tokens=9), idempotency_key="k1")
    assert stream_ids(r, cfg) == [job.id]  # one message
    other = make_tenant(db)  # keys are per tenant
    job3, created3 = jobs.submit(db, r, cfg, other, body(), idempotency_key="k1")
    assert created3 and job3.id != job.id


def test_idempotency_race_gives_one_job(db, r, cfg):
    tenant = make_tenant(db)
    results, errors = [], []

    def go():
        try:
            results.append(jobs.submit(db, r, cfg, tenant, body(), idempotency_key="race"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({j.id for j, _ in results}) == 1 and sum(c for _, c in results) == 1


def test_quota_queued_jobs(db, r, cfg):
    tenant = make_tenant(db, max_queued_jobs=2)
    jobs.submit(db, r, cfg, tenant, body())
    jobs.submit(db, r, cfg, tenant, body())
    with pytest.raises(jobs.QuotaExceeded) as e:
        jobs.submit(db, r, cfg, tenant, body())
    assert e.value.retry_after >= 1 and e.value.limit == "queued_jobs"


def test_quota_tier_cap(db, r, cfg):
    tenant = make_tenant(db)

    def count(tier):
        with db() as s:
            return s.scalar(select(func.count()).select_from(Job).where(Job.status == "queued", Job.tier == tier))

    capped = cfg.model_copy(update={"tier_queue_cap": max(count("batch"), count("interactive")) + 1})
    while count("batch") < capped.tier_queue_cap:
        jobs.submit(db, r, capped, tenant, body(tier="batch"))
    with pytest.raises(jobs.QuotaExceeded) as e:
        jobs.submit(db, r, capped, tenant, body(tier="batch"))
    assert e.value.limit == "tier_queue"
    jobs.submit(db, r, capped, tenant, body(tier="interactive"))  # the other tier is not full


def test_quota_tokens_per_minute(db, r, cfg):
    tenant = make_tenant(db, tokens_per_minute=100)
    jobs.submit(db, r, cfg, tenant, body(max_tokens=60))  # nothing used yet: accepted
    with pytest.raises(jobs.QuotaExceeded) as e:
        jobs.submit(db, r, cfg, tenant, body(max_tokens=60))
    assert e.value.limit == "tokens_per_minute" and 1 <= e.value.retry_after <= 60
    # tokens already in the ledger count too
    t2 = make_tenant(db, tokens_per_minute=100)
    j, _ = jobs.submit(db, r, cfg, t2, body(max_tokens=5))
    with db() as s:
        assert jobs.finish(s, j.id, jobs.Outcome(status="cancelled", prompt_tokens=50, completion_tokens=45),
                           from_statuses=("queued",))
        s.commit()
    with pytest.raises(jobs.QuotaExceeded):
        jobs.submit(db, r, cfg, t2, body(max_tokens=10))


def test_transitions_are_conditional(db, r, cfg):
    tenant = make_tenant(db)
    job, _ = jobs.submit(db, r, cfg, tenant, body())
    with pytest.raises(ValueError):
        with db() as s:
            jobs.transition(s, job.id, ("succeeded",), "running")
    # two workers race for queued -> running: exactly one wins
    s1, s2 = db(), db()
    won1 = jobs.transition(s1, job.id, ("queued",), "running", worker="w1", attempts=Job.attempts + 1)
    s1.commit()
    won2 = jobs.transition(s2, job.id, ("queued",), "running", worker="w2", attempts=Job.attempts + 1)
    s2.commit()
    s1.close()
    s2.close()
    assert (won1, won2) == (True, False)
    # finishing is fenced on the attempt and happens once, with one result and one ledger row
    out = jobs.Outcome(status="succeeded", text="hi", finish_reason="stop", prompt_tokens=3, completion_tokens=2,
                       compute_seconds=0.5)
    with db() as s:
        assert not jobs.finish(s, job.id, out, attempt=2)
        s.rollback()
        assert jobs.finish(s, job.id, out, attempt=1, worker="w1")
        s.commit()
        assert not jobs.finish(s, job.id, out, attempt=1)
        s.rollback()
        row = s.get(Job, job.id)
        assert row.status == "succeeded" and row.finished_at is not None
        assert s.get(Result, job.id).text == "hi"
        ledger = s.scalars(select(UsageEntry).where(UsageEntry.job_id == job.id)).all()
        assert len(ledger) == 1 and ledger[0].compute_seconds == 0.5
        price = s.get(Price, row.price_id)
        assert ledger[0].cost_micros == (3 * price.prompt_per_mtok + 2 * price.completion_per_mtok + 500_000) // 1_000_000


def test_cancel_queued_and_running(db, r, cfg):
    tenant = make_tenant(db)
    queued, _ = jobs.submit(db, r, cfg, tenant, body())
    job = jobs.cancel(db, r, cfg, queued.id)
    assert job.status == "cancelled"
    with db() as s:
        assert s.scalar(select(UsageEntry.cost_micros).where(UsageEntry.job_id == queued.id)) == 0
    events = r.xrange(f"{cfg.stream_prefix}:events:{queued.id}")
    assert events[-1][1][b"event"] == b"done"

    running, _ = jobs.submit(db, r, cfg, tenant, body())
    with db() as s:
        assert jobs.transition(s, running.id, "queued", "running", worker="w", attempts=1)
        s.commit()
    ps = r.pubsub()
    ps.subscribe(f"{cfg.stream_prefix}:cancel")
    ps.get_message(timeout=1)
    job = jobs.cancel(db, r, cfg, running.id)
    assert job.status == "running" and job.cancel_requested
    msg = ps.get_message(timeout=2)
    assert msg and msg["data"] == running.id.encode()
    ps.close()
    assert jobs.cancel(db, r, cfg, running.id, tenant_id="someone-else") is None


def test_reconcile_after_flushall(db, r, cfg):
    tenant = make_tenant(db)
    ids = [jobs.submit(db, r, cfg, tenant, body())[0].id for _ in range(3)]
    r.flushall()
    rep = jobs.reconcile(db, r, cfg, grace_seconds=0)
    assert rep.readded >= 3
    assert set(ids) <= set(stream_ids(r, cfg))
    # cheap and idempotent: nothing to do the second time
    assert jobs.reconcile(db, r, cfg, grace_seconds=0).readded == 0


def test_reconcile_requeues_stale_running_and_expires(db, r, cfg):
    tenant = make_tenant(db)
    stale, _ = jobs.submit(db, r, cfg, tenant, body())
    fresh, _ = jobs.submit(db, r, cfg, tenant, body())
    late, _ = jobs.submit(db, r, cfg, tenant, body(deadline_seconds=1))
    old = utcnow() - dt.timedelta(seconds=600)
    with db() as s:
        for jid, hb in ((stale.id, old), (fresh.id, utcnow())):
            assert jobs.transition(s, jid, "queued", "running", worker="dead", attempts=1, heartbeat_at=hb, started_at=hb)
        s.execute(update(Job).where(Job.id == late.id).values(deadline_at=utcnow() - dt.timedelta(seconds=1)))
        s.commit()
    r.delete(*jobs.tier_streams(r, cfg.stream_prefix, "tiny", "interactive"))
    rep = jobs.reconcile(db, r, cfg, grace_seconds=0)
    # (>= 1: the database is the whole session's, and a job an earlier module left running goes stale too;
    # what this test's own three jobs became is checked one by one below)
    assert rep.requeued >= 1 and rep.expired >= 1
    with db() as s:
        assert s.get(Job, stale.id).status == "queued" and s.get(Job, stale.id).attempts == 1
        assert s.get(Job, fresh.id).status == "running"
        assert s.get(Job, late.id).status == "expired"
        assert s.scalar(select(func.count()).select_from(UsageEntry).where(UsageEntry.job_id == late.id)) == 1
    assert stream_ids(r, cfg).count(stale.id) == 1


def test_xadd_failure_after_commit_is_reconciled(db, r, cfg):
    tenant = make_tenant(db)
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis_lib.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    job, created = jobs.submit(db, dead, cfg, tenant, body())
    assert created
    with db() as s:
        assert s.get(Job, job.id).status == "queued"
    assert jobs.reconcile(db, r, cfg, grace_seconds=0).readded >= 1
    assert job.id in stream_ids(r, cfg)


def test_lifecycle_on_sqlite(tmp_path, r, cfg):
    """`inferq up` runs the same code on SQLite."""
    from inferq.db import Base, make_engine, make_sessionmaker

    engine = make_engine(f"sqlite:///{tmp_path / 'jobs.sqlite'}")
    Base.metadata.create_all(engine)
    sq = make_sessionmaker(engine)
    tenant = make_tenant(sq, tokens_per_minute=1000)
    job, _ = jobs.submit(sq, r, cfg, tenant, body(deadline_seconds=60), idempotency_key="a")
    assert jobs.submit(sq, r, cfg, tenant, body(deadline_seconds=60), idempotency_key="a")[0].id == job.id
    with sq() as s:
        assert jobs.claim(s, job.id, "w", 10) == (1, False)
        assert jobs.claim(s, job.id, "w2", 10) is None  # fresh heartbeat: not takeable
        assert jobs.heartbeat(s, "w", [job.id]) == {job.id: (1, False)}
        assert jobs.finish(s, job.id, jobs.Outcome(status="succeeded", text="x", completion_tokens=3), attempt=1)
        s.commit()
    other, _ = jobs.submit(sq, r, cfg, tenant, body())
    assert jobs.cancel(sq, r, cfg, other.id).status == "cancelled"
    r.flushall()
    third, _ = jobs.submit(sq, r, cfg, tenant, body())
    r.flushall()
    assert jobs.reconcile(sq, r, cfg, grace_seconds=0).readded == 1
    assert stream_ids(r, cfg) == [third.id]
    engine.dispose()


ESTIMATE_BODIES = [
    {"prompt": "hello world", "max_tokens": 8},
    {"prompt": "naïve café ☕ " * 7, "max_tokens": 3, "stop": ["\n"], "temperature": 0.5},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 301}],
     "max_tokens": 1000},
    {"prompt_ids": list(range(50)), "max_tokens": 1, "seed": 7},
]


def test_row_estimate_forms_agree_on_postgresql(db, r, cfg):
    """The row estimate's three forms (quotas: SQL text, SQLAlchemy expression, Python) give the same tokens
    for rows stored by the PostgreSQL fast path."""
    tenant = make_tenant(db)
    for kw in ESTIMATE_BODIES:
        b = JobCreate(**kw)
        job, _ = jobs.submit(db, r, cfg, tenant, b)
        request = b.request_params()
        expected = quotas.row_estimate(json.dumps(request), request["max_tokens"])
        with db() as s:
            raw = s.execute(text(f"SELECT {quotas.ROW_ESTIMATE_SQL} FROM jobs WHERE id = :id"), {"id": job.id}).scalar()
            orm = s.scalar(select(quotas.row_estimate_expr()).where(Job.id == job.id))
        assert float(raw) == pytest.approx(expected) and float(orm) == pytest.approx(expected), kw
        assert quotas.bound_charge(json.dumps(request), b.max_tokens, quotas.estimate_tokens(request)) >= expected


def test_row_estimate_forms_agree_on_sqlite(tmp_path, r, cfg):
    from inferq.db import Base, make_engine, make_sessionmaker

    engine = make_engine(f"sqlite:///{tmp_path / 'estimate.sqlite'}")
    Base.metadata.create_all(engine)
    sq = make_sessionmaker(engine)
    tenant = make_tenant(sq)
    for kw in ESTIMATE_BODIES:
        b = JobCreate(**kw)
        job, _ = jobs.submit(sq, r, cfg, tenant, b)
        request = b.request_params()
        with sq() as s:
            orm = s.scalar(select(quotas.row_estimate_expr()).where(Job.id == job.id))
        assert float(orm) == pytest.approx(quotas.row_estimate(json.dumps(request), request["max_tokens"])), kw
    engine.dispose()


def test_admission_replaces_a_dead_pooled_connection(db, r, cfg, monkeypatch):
    """A pooled admission connection that died while idle is pinged, dropped and replaced: the submission
    succeeds on a new connection."""
    tenant = make_tenant(db)
    jobs.submit(db, r, cfg, tenant, body())
    engine = db.kw["bind"]
    _, pool = pg_admission.admission_for(engine)
    pooled = pool.get()
    pid = pooled.driver_connection.info.backend_pid
    pool.put(pooled)
    with engine.connect() as c:
        assert c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    monkeypatch.setattr(connections, "PING_AFTER_SECONDS", 0.0)
    job, created = jobs.submit(db, r, cfg, tenant, body())
    assert created and job.id in stream_ids(r, cfg)
    pooled = pool.get()
    try:
        assert pooled.driver_connection.info.backend_pid != pid
        # every admission connection plans with the parameters it is given
        assert pooled.driver_connection.execute("SHOW plan_cache_mode").fetchone()[0] == "force_custom_plan"
    finally:
        pool.put(pooled)
