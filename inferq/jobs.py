"""The job lifecycle in SQL, shared by the API, the Celery tasks and the worker.

* ``submit``: quota checks, then the job row (status ``queued``, the price version in force, the deadline)
  is committed FIRST; only then is the msgpack message XADDed to ``stream_key(prefix, model, tier)``
  (together with an SADD of the job id to ``enqueued_key(prefix)``). An XADD that fails after the commit is
  logged and left to ``reconcile``: the job stays accepted.
* ``transition``/``finish``: conditional UPDATEs (``... WHERE status IN (...)``, optionally fenced on the
  attempt number) so two workers can never both finish a job; ``finish`` writes the result row and the one
  ledger row in the same transaction as the status change.
* ``cancel``: queued jobs are cancelled at once; running jobs get ``cancel_requested`` and a pub/sub nudge.
* ``reconcile``: expires queued jobs past their deadline, requeues ``running`` jobs whose worker heartbeat
  is stale, and re-adds ``queued`` jobs that have no message in Redis (e.g. after FLUSHALL).

Nothing here imports torch.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, case, cast, func, select, text, update
from sqlalchemy import event as sa_event
from sqlalchemy import exc as sa_exc
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, instrumentation, sessionmaker

from inferq.contract import JobCreate, cancel_channel, encode_message, events_key, model_id, stream_key
from inferq.db import (
    TERMINAL_STATUSES,
    TRANSITIONS,
    Job,
    Price,
    Result,
    Tenant,
    UsageEntry,
    cost_micros,
    new_id,
    utcnow,
)
from inferq.log import get_logger
from inferq.settings import Settings

log = get_logger("inferq.jobs")

# finish reason (engine) -> terminal job status
STATUS_FOR_FINISH = {"stop": "succeeded", "length": "succeeded", "abort": "cancelled", "deadline": "expired",
                     "error": "failed"}

EVENT_DELTA = "delta"
EVENT_DONE = "done"


# --------------------------------------------------------------------------------------------------------
# errors and key names
# --------------------------------------------------------------------------------------------------------


class JobError(Exception):
    """Base class of the submission errors the API turns into HTTP answers."""


class Conflict(JobError):
    """The idempotency key was used before with a different body (HTTP 409)."""

    def __init__(self, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class QuotaExceeded(JobError):
    """A quota or rate limit is exhausted (HTTP 429); ``retry_after`` is in seconds."""

    def __init__(self, message: str, retry_after: float, limit: str = "") -> None:
        super().__init__(message)
        self.retry_after = max(1, int(math.ceil(retry_after)))
        self.limit = limit


def enqueued_key(prefix: str) -> str:
    """Redis set of job ids that have a message in a job stream (the reconciler's cheap index)."""
    return f"{prefix}:enqueued"


def worker_key(prefix: str, worker: str) -> str:
    """Redis hash with a worker's live statistics (busy_seconds, steps, in-flight jobs, ...)."""
    return f"{prefix}:worker:{worker}"


def reconcile_lock_key(prefix: str) -> str:
    return f"{prefix}:reconcile:lock"


def stale_after_seconds(settings: Settings) -> float:
    """A running job whose heartbeat is older than this belongs to a dead (or partitioned) worker."""
    return max(settings.claim_idle_ms / 1000.0, 3.0 * settings.heartbeat_seconds)


def _as_aware(t: dt.datetime | None) -> dt.datetime | None:
    if t is not None and t.tzinfo is None:  # SQLite hands back naive UTC
        return t.replace(tzinfo=dt.timezone.utc)
    return t


def _unix(t: dt.datetime | None) -> float | None:
    t = _as_aware(t)
    return t.timestamp() if t is not None else None


# --------------------------------------------------------------------------------------------------------
# prices
# --------------------------------------------------------------------------------------------------------


def current_price(session: Session, settings: Settings, model: str, tier: str) -> Price:
    """The price version in force for (model, tier); version 1 is created from the settings on first use
    (the batch tier gets ``batch_discount``). Does not commit; safe against concurrent first use."""
    now = utcnow()
    stmt = (select(Price).where(Price.model == model, Price.tier == tier, Price.effective_from <= now)
            .order_by(Price.version.desc()).limit(1))
    price = session.scalar(stmt)
    if price is not None:
        return price
    mult = settings.batch_discount if tier == "batch" else 1.0
    fresh = Price(model=model, tier=tier, version=1, effective_from=now,
                  prompt_per_mtok=int(round(settings.price_prompt_per_mtok * mult)),
                  cached_prompt_per_mtok=int(round(settings.price_cached_prompt_per_mtok * mult)),
                  completion_per_mtok=int(round(settings.price_completion_per_mtok * mult)))
    try:
        with session.begin_nested():
            session.add(fresh)
        return fresh
    except IntegrityError:  # another process created version 1 first
        price = session.scalar(select(Price).where(Price.model == model, Price.tier == tier)
                               .order_by(Price.version.desc()).limit(1))
        assert price is not None
        return price


# --------------------------------------------------------------------------------------------------------
# submission
# --------------------------------------------------------------------------------------------------------


def estimate_tokens(request: dict[str, Any]) -> int:
    """A cheap upper-ish estimate of a job's tokens (prompt + max_tokens) for the rate limit."""
    if request.get("prompt_ids") is not None:
        prompt = len(request["prompt_ids"])
    elif request.get("prompt") is not None:
        prompt = len(request["prompt"]) // 4 + 1
    else:
        prompt = sum(len(m.get("content", "")) // 4 + 4 for m in request.get("messages") or [])
    return prompt + int(request.get("max_tokens", 0))


def _tenant_lock_key(tenant_id: str) -> str:
    return "inferq:tenant:" + tenant_id


def _lock_tenant(session: Session, tenant_id: str) -> None:
    """Serialize one tenant's submissions so quota counts are exact (PostgreSQL only)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": _tenant_lock_key(tenant_id)})


def _limits(settings: Settings, tenant: Tenant) -> tuple[int, int]:
    max_queued = tenant.max_queued_jobs if tenant.max_queued_jobs is not None else settings.default_max_queued_jobs
    limit = tenant.tokens_per_minute if tenant.tokens_per_minute is not None else settings.default_tokens_per_minute
    return max_queued, limit


def _token_limit_error(used: int, need: int, limit: int, oldest: dt.datetime | None, now: dt.datetime) -> QuotaExceeded:
    oldest = min(t for t in (_as_aware(oldest), now) if t is not None)
    retry = 60.0 - (now - oldest).total_seconds()
    return QuotaExceeded(f"token rate limit: {used} tokens in the last minute, this job needs about {need} "
                         f"(limit {limit}/min)", retry_after=max(1.0, retry), limit="tokens_per_minute")


def _check_quotas(session: Session, settings: Settings, tenant: Tenant, tier: str, request: dict[str, Any]) -> None:
    """The exact quota checks in SQL (any dialect; the PostgreSQL fast path uses ``_PG_RECOUNT`` instead)."""
    now = utcnow()
    max_queued, limit = _limits(settings, tenant)
    # 1. the tenant's queued jobs
    queued = session.scalar(select(func.count()).select_from(Job)
                            .where(Job.tenant_id == tenant.id, Job.status == "queued")) or 0
    if queued >= max_queued:
        raise QuotaExceeded(f"tenant has {queued} queued jobs (limit {max_queued})", retry_after=5, limit="queued_jobs")
    # 2. the tier's queue
    tier_queued = session.scalar(select(func.count()).select_from(Job)
                                 .where(Job.status == "queued", Job.tier == tier)) or 0
    if tier_queued >= settings.tier_queue_cap:
        raise QuotaExceeded(f"the {tier} queue is full ({tier_queued} jobs)", retry_after=10, limit="tier_queue")
    # 3. tokens per minute: the ledger of the last minute (actual tokens) plus an estimate for this
    #    tenant's jobs accepted in the last minute that have not reached the ledger yet
    window_start = now - dt.timedelta(seconds=60)
    used_ledger, oldest_ledger = session.execute(
        select(func.coalesce(func.sum(UsageEntry.prompt_tokens + UsageEntry.completion_tokens), 0),
               func.min(UsageEntry.created_at))
        .where(UsageEntry.tenant_id == tenant.id, UsageEntry.created_at > window_start)).one()
    estimate = func.length(cast(Job.request, Text)) / 4 + func.coalesce(Job.request["max_tokens"].as_integer(), 0)
    used_open, oldest_open = session.execute(
        select(func.coalesce(func.sum(estimate), 0), func.min(Job.created_at))
        .where(Job.tenant_id == tenant.id, Job.created_at > window_start, Job.status.in_(("queued", "running")))).one()
    used = int(used_ledger) + int(used_open)
    need = estimate_tokens(request)
    if used > 0 and used + need > limit:
        oldest = min(t for t in (_as_aware(oldest_ledger), _as_aware(oldest_open), now) if t is not None)
        raise _token_limit_error(used, need, limit, oldest, now)


def _idempotent(job: Job, fingerprint: str) -> tuple[Job, bool]:
    if job.request_hash != fingerprint:
        raise Conflict("idempotency key already used with a different request body", job_id=job.id)
    return job, False


def submit(session_factory: sessionmaker, redis: Any, settings: Settings, tenant: Tenant, body: JobCreate,
           idempotency_key: str | None = None) -> tuple[Job, bool]:
    """Accept a job: write the row (committed first), then enqueue it. Returns ``(job, created)``;
    ``created`` is False for an idempotent retry (same key and body). Raises ``Conflict`` (same key,
    other body) or ``QuotaExceeded``."""
    model = model_id(body.model or settings.model)
    fingerprint = body.fingerprint()
    request = body.request_params()
    engine = session_factory.kw.get("bind")
    if engine is not None and engine.dialect.name == "postgresql":
        job, created = _submit_postgres(engine, session_factory, settings, tenant, body, idempotency_key, model,
                                        fingerprint, request)
    else:
        job, created = _submit_orm(session_factory, settings, tenant, body, idempotency_key, model, fingerprint,
                                   request)
    if not created:
        return job, False
    try:
        enqueue(redis, settings, job, tenant.cache_namespace)
    except Exception as exc:  # the row is committed: the reconciler will enqueue it
        log.warning("enqueue failed after commit; left for the reconciler", job_id=job.id, error=str(exc))
    log.info("job accepted", job_id=job.id, tenant=tenant.id, model=model, tier=body.tier)
    return job, True


def _submit_orm(session_factory: sessionmaker, settings: Settings, tenant: Tenant, body: JobCreate,
                idempotency_key: str | None, model: str, fingerprint: str, request: dict[str, Any]) -> tuple[Job, bool]:
    """Any dialect (SQLite for ``inferq up``): exact counts on every submission, through the ORM."""
    with session_factory() as session:
        if idempotency_key:
            existing = session.scalar(select(Job).where(Job.tenant_id == tenant.id,
                                                        Job.idempotency_key == idempotency_key))
            if existing is not None:
                return _idempotent(existing, fingerprint)
        _lock_tenant(session, tenant.id)
        _check_quotas(session, settings, tenant, body.tier, request)
        price = current_price(session, settings, model, body.tier)
        now = utcnow()
        job = Job(tenant_id=tenant.id, model=model, tier=body.tier, priority=body.priority, request=request,
                  status="queued", idempotency_key=idempotency_key, request_hash=fingerprint,
                  webhook_url=body.webhook_url, meta=body.metadata, attempts=0, cancel_requested=False,
                  price_id=price.id, created_at=now, queued_at=now,
                  deadline_at=now + dt.timedelta(seconds=body.deadline_seconds) if body.deadline_seconds else None)
        session.add(job)
        try:
            session.commit()
        except IntegrityError:
            session.rollback()
            if not idempotency_key:
                raise
            existing = session.scalar(select(Job).where(Job.tenant_id == tenant.id,
                                                        Job.idempotency_key == idempotency_key))
            if existing is None:
                raise
            return _idempotent(existing, fingerprint)
    return job, True


# ---- PostgreSQL: one round trip per submission ------------------------------------------------------------
#
# Counting a tenant's queued jobs, its tier's queue and its tokens of the last minute costs time proportional
# to the queue (and to the minute's traffic), which is what made a submission slow. Instead each process
# keeps, per tenant, an UPPER BOUND of those numbers as of a PostgreSQL timestamp ``mark``, and a submission
# only adds what happened since:
#
# * All of a tenant's submissions (every process) hold the tenant's advisory lock from before they read to
#   their commit, and stamp ``created_at`` with ``clock_timestamp()`` after taking it. So, under the lock,
#   the tenant's jobs created after ``mark`` are exactly the rows ``created_at > mark`` (index
#   ``ix_jobs_tenant_created``): the bound + those rows bounds the true count from above. Jobs that leave
#   the queue (claimed, cancelled) are not subtracted: the bound only errs high.
# * Ledger rows (written by workers at finish, not under the lock) are summed live from ``ledger_from``
#   (the last recount minus ``LEDGER_LAG_SECONDS``) at every submission.
# * A submission is accepted in one statement when the bound proves every limit holds; otherwise (and at
#   least every ``QUOTA_RECOUNT_SECONDS``) the process recounts exactly, under the lock, and decides on
#   the exact numbers, so a 429 is only ever answered from an exact count, as before.
# * The tier cap counts every tenant's jobs, which the tenant lock does not serialize: between recounts a
#   process adds its own admissions (and the rows it sees) to the tier count of its last recount, so other
#   processes' admissions of other tenants are seen within ``QUOTA_RECOUNT_SECONDS``.

QUOTA_RECOUNT_SECONDS = 5.0
LEDGER_LAG_SECONDS = 2.0

_PG_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%(lock)s, 0))"

_PG_ESTIMATE = "length(CAST(request AS TEXT)) / 4.0 + coalesce(CAST(request ->> 'max_tokens' AS INTEGER), 0)"

# exact usage, under the tenant lock
_PG_RECOUNT = f"""
WITH now AS (SELECT clock_timestamp() AS t)
SELECT now.t,
       (SELECT count(*) FROM jobs WHERE tenant_id = %(tenant)s AND status = 'queued'),
       (SELECT count(*) FROM jobs WHERE status = 'queued' AND tier = %(tier)s),
       lw.tokens, lw.head, lw.oldest, ow.tokens, ow.oldest, e.id, e.request_hash
FROM now
CROSS JOIN LATERAL (
    SELECT coalesce(sum(prompt_tokens + completion_tokens), 0) AS tokens,
           coalesce(sum(prompt_tokens + completion_tokens)
                    FILTER (WHERE created_at <= now.t - make_interval(secs => %(lag)s)), 0) AS head,
           min(created_at) AS oldest
    FROM usage_ledger WHERE tenant_id = %(tenant)s AND created_at > now.t - interval '60 seconds') lw
CROSS JOIN LATERAL (
    SELECT coalesce(sum({_PG_ESTIMATE}), 0) AS tokens, min(created_at) AS oldest
    FROM jobs WHERE tenant_id = %(tenant)s AND created_at > now.t - interval '60 seconds'
                AND status IN ('queued', 'running')) ow
LEFT JOIN LATERAL (
    SELECT id, request_hash FROM jobs WHERE tenant_id = %(tenant)s AND idempotency_key = %(key)s) e ON true
"""

# what changed since the tenant's cached bound was taken: its jobs created since (d), its ledger tokens since (l)
_PG_SINCE_BOUND = f"""d AS (
    SELECT count(*) AS n, coalesce(sum({_PG_ESTIMATE}), 0) AS tokens
    FROM jobs WHERE tenant_id = %(tenant)s AND created_at > %(mark)s
), l AS (
    SELECT coalesce(sum(prompt_tokens + completion_tokens), 0) AS tokens
    FROM usage_ledger WHERE tenant_id = %(tenant)s AND created_at > %(ledger_from)s
)"""

# the conditional insert: accepted only when the bounds prove the limits hold
_PG_ADMIT = f"""
WITH {_PG_SINCE_BOUND}, p AS (
    SELECT id FROM prices WHERE model = %(model)s AND tier = %(tier)s AND effective_from <= clock_timestamp()
    ORDER BY version DESC LIMIT 1
), e AS (
    SELECT id, request_hash FROM jobs WHERE tenant_id = %(tenant)s AND idempotency_key = %(key)s
), now AS (
    SELECT clock_timestamp() AS t
), ins AS (
    INSERT INTO jobs (id, tenant_id, model, tier, priority, request, status, idempotency_key, request_hash,
                      webhook_url, metadata, attempts, cancel_requested, price_id, created_at, queued_at, deadline_at)
    SELECT %(id)s, %(tenant)s, %(model)s, %(tier)s, %(priority)s, CAST(%(request)s AS JSON), 'queued', %(key)s,
           %(hash)s, %(webhook)s, CAST(%(meta)s AS JSON), 0, false, p.id, now.t, now.t,
           now.t + make_interval(secs => %(deadline)s)
    FROM p, d, l, now
    WHERE NOT EXISTS (SELECT 1 FROM e)
      AND %(queued)s + d.n + 1 <= %(max_queued)s
      AND %(tier_queued)s + d.n + 1 <= %(tier_cap)s
      AND (CAST(%(tokens)s AS double precision) + CAST(d.tokens AS double precision) + l.tokens <= 0
           OR CAST(%(tokens)s AS double precision) + CAST(d.tokens AS double precision) + l.tokens + %(need)s
              <= %(limit)s)
    RETURNING created_at, deadline_at
)
SELECT d.n, CAST(d.tokens AS double precision), (SELECT created_at FROM ins), (SELECT deadline_at FROM ins),
       (SELECT id FROM e), (SELECT request_hash FROM e), (SELECT id FROM p)
FROM d
"""


@dataclass(frozen=True)
class _TenantBound:
    """Upper bounds of a tenant's usage (see above); replaced, never mutated, so threads read a consistent one."""

    mark: dt.datetime  # PostgreSQL time: every job of the tenant created at or before it is counted here
    queued: int  # >= the tenant's queued jobs created at or before mark
    tokens: float  # >= ledger tokens up to ledger_from + estimates of its jobs created up to mark, last minute
    ledger_from: dt.datetime  # ledger rows after this are summed at each submission
    expires: float  # time.monotonic() of the next exact recount


class _TierBound:
    def __init__(self, queued: int, expires: float) -> None:
        self.queued = queued  # the last exact count + admissions since (own, and those seen in tenant scans)
        self.expires = expires


class _Admission:
    """Per-process, per-engine quota bounds."""

    def __init__(self) -> None:
        self.tenants: dict[str, _TenantBound] = {}
        self.tiers: dict[str, _TierBound] = {}
        self.lock = threading.Lock()

    def put(self, tenant_id: str, bound: _TenantBound) -> None:
        if len(self.tenants) >= 100_000:
            self.tenants.clear()
        self.tenants[tenant_id] = bound

    def reserve_tier(self, tier: str) -> int | None:
        """Count this admission in the tier before trying it (so concurrent threads see each other);
        returns the count before it, or None when the tier needs a recount."""
        with self.lock:
            tb = self.tiers.get(tier)
            if tb is None or tb.expires <= time.monotonic():
                return None
            tb.queued += 1
            return tb.queued - 1

    def adjust_tier(self, tier: str, delta: int) -> None:
        with self.lock:
            tb = self.tiers.get(tier)
            if tb is not None:
                tb.queued = max(0, tb.queued + delta)

    def set_tier(self, tier: str, queued: int, expires: float) -> None:
        with self.lock:
            self.tiers[tier] = _TierBound(queued, expires)


class _Connections:
    """The psycopg connections submissions use, kept apart from the engine's pool: that pool pings every
    connection it hands out (a round trip, as costly as the submission's own), while these are pinged only
    after ``PING_AFTER_SECONDS`` idle. Taken from the engine (its URL and connect arguments), closed with it."""

    PING_AFTER_SECONDS = 2.0

    def __init__(self, engine: Any, keep: int = 16) -> None:
        self.engine = weakref.ref(engine)  # weak: the engine keys the registry this lives in
        self.keep = keep
        self.idle: list[tuple[Any, float]] = []
        self.lock = threading.Lock()
        sa_event.listen(engine, "engine_disposed", lambda *_: self.close())

    def get(self) -> Any:
        while True:
            with self.lock:
                conn, last = self.idle.pop() if self.idle else (None, 0.0)
            if conn is None:
                engine = self.engine()
                if engine is None:  # pragma: no cover - callers hold the engine
                    raise RuntimeError("the engine is gone")
                fairy = engine.raw_connection()  # connect errors come out as SQLAlchemy's (-> 503)
                conn = fairy.driver_connection
                fairy.detach()  # ours from now on
                # Plan the admission with its real parameters each time: the generic plan PostgreSQL switches
                # to after five executions costs time that grows with the jobs table (measured: 0.6 ms of
                # server CPU per submission at 2k jobs, 2.1 ms at 8k), a custom plan stays at ~1 ms.
                conn.execute("SET plan_cache_mode = force_custom_plan")
                conn.commit()
                return conn
            if conn.closed or conn.broken:
                continue
            if time.monotonic() - last > self.PING_AFTER_SECONDS:
                try:
                    conn.execute("SELECT 1").fetchone()
                    conn.rollback()
                except Exception:  # noqa: BLE001 - a dead connection: drop it, take another
                    _close_quietly(conn)
                    continue
            return conn

    def put(self, conn: Any) -> None:
        if conn.closed or conn.broken or conn.info.transaction_status != 0:  # 0: idle, no transaction open
            _close_quietly(conn)
            return
        with self.lock:
            if len(self.idle) < self.keep:
                self.idle.append((conn, time.monotonic()))
                return
        _close_quietly(conn)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for conn, _ in idle:
            _close_quietly(conn)


def _close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001
        pass


_ADMISSION: weakref.WeakKeyDictionary[Any, tuple[_Admission, _Connections]] = weakref.WeakKeyDictionary()
_ADMISSION_LOCK = threading.Lock()


def _admission_for(engine: Any) -> tuple[_Admission, _Connections]:
    found = _ADMISSION.get(engine)
    if found is None:
        with _ADMISSION_LOCK:
            found = _ADMISSION.get(engine)
            if found is None:
                found = _ADMISSION[engine] = (_Admission(), _Connections(engine))
    return found


def reset_quota_bounds() -> None:
    """Forget every process-local quota bound (the next submission of each tenant recounts exactly)."""
    with _ADMISSION_LOCK:
        for adm, _ in list(_ADMISSION.values()):
            adm.tenants.clear()
            adm.tiers.clear()


def _utc(t: dt.datetime | None) -> dt.datetime | None:
    return t.astimezone(dt.timezone.utc) if t is not None else None


def _submit_postgres(engine: Any, session_factory: sessionmaker, settings: Settings, tenant: Tenant,
                     body: JobCreate, idempotency_key: str | None, model: str, fingerprint: str,
                     request: dict[str, Any]) -> tuple[Job, bool]:
    import psycopg

    adm, connections = _admission_for(engine)
    max_queued, limit = _limits(settings, tenant)
    need = estimate_tokens(request)
    request_json = json.dumps(request)  # what PostgreSQL stores (and what the rate-limit estimate measures)
    own_tokens = len(request_json) / 4.0 + body.max_tokens
    job_id = new_id()
    params: dict[str, Any] = {
        "lock": _tenant_lock_key(tenant.id), "tenant": tenant.id, "model": model, "tier": body.tier,
        "key": idempotency_key, "id": job_id, "priority": body.priority, "request": request_json,
        "hash": fingerprint, "webhook": body.webhook_url,
        "meta": json.dumps(body.metadata) if body.metadata is not None else None,
        "deadline": float(body.deadline_seconds) if body.deadline_seconds else None,
        "max_queued": max_queued, "tier_cap": settings.tier_queue_cap, "need": need, "limit": limit,
        "lag": LEDGER_LAG_SECONDS,
    }
    existing: tuple[str, str | None] | None = None
    conn = connections.get()
    try:
        for _attempt in range(4):
            bound = adm.tenants.get(tenant.id)
            tier_before = adm.reserve_tier(body.tier) if bound is not None else None
            if bound is None or tier_before is None or bound.expires <= time.monotonic():
                if tier_before is not None:
                    adm.adjust_tier(body.tier, -1)
                # exact recount under the lock; decide on it (a 429 only ever comes from here)
                with conn.pipeline():
                    conn.execute(_PG_LOCK, params)
                    row = conn.execute(_PG_RECOUNT, params).fetchone()
                assert row is not None
                (now, queued, tier_queued, ledger_tokens, ledger_head, ledger_oldest, open_tokens, open_oldest,
                 e_id, e_hash) = row
                expires = time.monotonic() + QUOTA_RECOUNT_SECONDS
                # whole tokens, as the exact check counts them, so the admission below agrees with it
                bound = _TenantBound(mark=now, queued=int(queued), tokens=float(int(ledger_head) + int(open_tokens)),
                                     ledger_from=now - dt.timedelta(seconds=LEDGER_LAG_SECONDS), expires=expires)
                adm.put(tenant.id, bound)
                adm.set_tier(body.tier, int(tier_queued), expires)
                if e_id is not None:
                    conn.commit()
                    existing = (e_id, e_hash)
                    break
                if queued >= max_queued:
                    conn.commit()
                    raise QuotaExceeded(f"tenant has {queued} queued jobs (limit {max_queued})", retry_after=5,
                                        limit="queued_jobs")
                if tier_queued >= settings.tier_queue_cap:
                    conn.commit()
                    raise QuotaExceeded(f"the {body.tier} queue is full ({tier_queued} jobs)", retry_after=10,
                                        limit="tier_queue")
                used = int(ledger_tokens) + int(open_tokens)
                if used > 0 and used + need > limit:
                    conn.commit()
                    oldest = min((t for t in (ledger_oldest, open_oldest) if t is not None), default=None)
                    raise _token_limit_error(used, need, limit, oldest, now)
                # admit on the exact numbers (the insert repeats the same checks, so it agrees)
                adm.adjust_tier(body.tier, 1)  # counted like a reservation: given back below if not admitted
                params.update(mark=bound.mark, queued=bound.queued, tokens=bound.tokens,
                              ledger_from=bound.ledger_from, tier_queued=int(tier_queued))
                cur = conn.execute(_PG_ADMIT, params)
                result = cur.fetchone()
                conn.commit()
                recounted = True
            else:
                params.update(mark=bound.mark, queued=bound.queued, tokens=bound.tokens,
                              ledger_from=bound.ledger_from, tier_queued=tier_before)
                with conn.pipeline():  # one round trip: lock, conditional insert, commit
                    conn.execute(_PG_LOCK, params)
                    cur = conn.execute(_PG_ADMIT, params)
                    conn.commit()
                result = cur.fetchone()
                recounted = False
            assert result is not None
            seen, seen_tokens, created_at, deadline_at, e_id, e_hash, price_id = result
            if created_at is not None:
                adm.put(tenant.id, _TenantBound(mark=created_at, queued=bound.queued + int(seen) + 1,
                                                tokens=bound.tokens + float(seen_tokens) + max(own_tokens, need),
                                                ledger_from=bound.ledger_from, expires=bound.expires))
                if seen:
                    adm.adjust_tier(body.tier, int(seen))
                created = _utc(created_at)
                return _job(id=job_id, tenant_id=tenant.id, model=model, tier=body.tier, priority=body.priority,
                            request=request, status="queued", idempotency_key=idempotency_key,
                            request_hash=fingerprint, webhook_url=body.webhook_url, meta=body.metadata, attempts=0,
                            worker=None, cancel_requested=False, price_id=price_id, created_at=created,
                            queued_at=created, started_at=None, first_token_at=None, finished_at=None,
                            deadline_at=_utc(deadline_at), heartbeat_at=None, error=None), True
            adm.adjust_tier(body.tier, -1)  # not admitted: give the reservation back
            if e_id is not None:
                existing = (e_id, e_hash)
                break
            if price_id is None:  # first job for (model, tier): create price version 1, then try again
                with session_factory() as session:
                    current_price(session, settings, model, body.tier)
                    session.commit()
                continue
            if recounted:  # the exact check passed but the insert did not: the bound moved; count again
                adm.tenants.pop(tenant.id, None)
                continue
            # the bound was not enough to prove the limits hold: recount exactly
            adm.put(tenant.id, _TenantBound(bound.mark, bound.queued, bound.tokens, bound.ledger_from, 0.0))
        else:
            raise QuotaExceeded("could not admit the job; try again", retry_after=1, limit="contention")
    except psycopg.errors.UniqueViolation as exc:
        # the same idempotency key won a race (only possible without the lock); report the winner's job
        _rollback_quietly(conn)
        job = None
        if idempotency_key:
            with session_factory() as session:
                job = session.scalar(select(Job).where(Job.tenant_id == tenant.id,
                                                       Job.idempotency_key == idempotency_key))
        if job is None:
            raise sa_exc.DBAPIError.instance(None, None, exc, psycopg.Error) from exc
        return _idempotent(job, fingerprint)
    except psycopg.Error as exc:
        _rollback_quietly(conn)
        raise sa_exc.DBAPIError.instance(None, None, exc, psycopg.Error) from exc
    except BaseException:
        _rollback_quietly(conn)
        raise
    finally:
        connections.put(conn)
    with session_factory() as session:
        job = session.get(Job, existing[0])
    if job is None:  # pragma: no cover - jobs are never deleted
        raise Conflict("idempotency key refers to a job that no longer exists")
    return _idempotent(job, fingerprint)


# ---- PostgreSQL: several submissions of one tenant in one statement -----------------------------------------
#
# The API groups the submissions that arrive while earlier ones are in flight (api/routes_jobs.SubmitBatcher).
# A tenant's jobs without an idempotency key are then admitted by one statement under the tenant lock: the
# checks of ``_PG_ADMIT`` applied to each job in order, as if they were submitted one after another (job k
# also counts jobs 1..k-1 of the batch), and only a prefix of the batch is admitted. Whatever is not admitted
# (or has an idempotency key, or finds no quota bound) goes through ``submit`` one by one, which recounts
# exactly when in doubt: a 429 still only comes from an exact count. One plan, one commit and one Redis MULTI
# per batch instead of per job is what makes it cheaper, for the API process and for PostgreSQL.

_PG_ADMIT_MANY = f"""
WITH {_PG_SINCE_BOUND}, now AS (
    SELECT clock_timestamp() AS t
), b AS (  -- the jobs, in order (k = 1, 2, ...): one JSON document, json columns keep their exact text
    SELECT * FROM json_to_recordset(CAST(%(batch)s AS json))
        AS b(k integer, id text, model text, tier text, priority integer, request json, hash text, webhook text,
             meta json, deadline double precision, need double precision, add double precision, tier_before integer)
), c AS (
    SELECT b.*,
           (SELECT p.id FROM prices p WHERE p.model = b.model AND p.tier = b.tier
                                        AND p.effective_from <= clock_timestamp()
            ORDER BY p.version DESC LIMIT 1) AS price_id,
           coalesce(sum(b.add) OVER (ORDER BY b.k ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
    FROM b
), o AS (
    SELECT c.*, bool_and(
               c.price_id IS NOT NULL
               AND %(queued)s + d.n + c.k <= %(max_queued)s
               AND c.tier_before + d.n + 1 <= %(tier_cap)s
               AND (CAST(%(tokens)s AS double precision) + CAST(d.tokens AS double precision) + l.tokens
                    + c.before <= 0
                    OR CAST(%(tokens)s AS double precision) + CAST(d.tokens AS double precision) + l.tokens
                       + c.before + c.need <= %(limit)s)) OVER (ORDER BY c.k) AS ok
    FROM c, d, l
), ins AS (
    INSERT INTO jobs (id, tenant_id, model, tier, priority, request, status, idempotency_key, request_hash,
                      webhook_url, metadata, attempts, cancel_requested, price_id, created_at, queued_at, deadline_at)
    SELECT o.id, %(tenant)s, o.model, o.tier, o.priority, o.request, 'queued', NULL, o.hash,
           o.webhook, o.meta, 0, false, o.price_id, now.t, now.t,
           now.t + make_interval(secs => o.deadline)
    FROM o, now WHERE o.ok
    RETURNING id, created_at, deadline_at, price_id
)
SELECT d.n, CAST(d.tokens AS double precision), ins.id, ins.created_at, ins.deadline_at, ins.price_id
FROM d LEFT JOIN ins ON true
"""


@dataclass
class _Pending:
    """One submission of a batch: what ``submit`` computes before touching the database."""

    body: JobCreate
    model: str
    fingerprint: str
    request: dict[str, Any]
    request_json: str
    job_id: str


def submit_many(session_factory: sessionmaker, redis: Any, settings: Settings,
                items: Sequence[tuple[Tenant, JobCreate, str | None]]) -> list[tuple[Job, bool] | Exception]:
    """``submit`` for several submissions at once, with the same outcome for each as submitting them one after
    another (a result, or the exception ``submit`` would raise). On PostgreSQL each tenant's jobs without an
    idempotency key are admitted together (``_PG_ADMIT_MANY``) and enqueued in one MULTI; everything else (and
    every other database) goes through ``submit``."""
    results: list[tuple[Job, bool] | Exception | None] = [None] * len(items)
    engine = session_factory.kw.get("bind")
    if len(items) > 1 and engine is not None and engine.dialect.name == "postgresql":
        groups: dict[str, list[int]] = {}
        for i, (tenant, _, key) in enumerate(items):
            if not key:
                groups.setdefault(tenant.id, []).append(i)
        created: list[tuple[Job, str]] = []
        for idx in groups.values():
            tenant = items[idx[0]][0]
            if len(idx) > 2 and not _has_bound(engine, tenant.id):
                # the first job recounts exactly (and leaves a fresh bound); the rest can then go together
                try:
                    results[idx[0]] = submit(session_factory, redis, settings, tenant, items[idx[0]][1], None)
                except Exception as exc:  # noqa: BLE001 - handed back as this submission's answer
                    results[idx[0]] = exc
                idx = idx[1:]
            if len(idx) < 2:
                continue
            try:
                admitted = _admit_many_postgres(engine, settings, tenant, [items[i][1] for i in idx])
            except sa_exc.OperationalError as exc:
                # unreachable, or the commit's outcome unknown: each job gets the error (as ``submit`` would
                # answer it), never a second try that could store it twice
                for i in idx:
                    results[i] = exc
                continue
            except sa_exc.DBAPIError as exc:  # the statement failed and was rolled back: each job on its own below
                log.warning("batch admission failed; submitting one by one", tenant=tenant.id, error=str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - not known to be rolled back: never tried twice
                for i in idx:
                    results[i] = exc
                continue
            for i, job in zip(idx, admitted, strict=False):
                results[i] = (job, True)
                created.append((job, tenant.cache_namespace))
        if created:
            try:
                enqueue_many(redis, settings, created)
            except Exception as exc:  # the rows are committed: the reconciler will enqueue them
                log.warning("enqueue failed after commit; left for the reconciler", jobs=len(created), error=str(exc))
            # one line per group (a line per job cost ~30 us of the submission's CPU)
            log.info("jobs accepted", job_ids=[job.id for job, _ in created], count=len(created))
    for i, (tenant, body, key) in enumerate(items):
        if results[i] is None:
            try:
                results[i] = submit(session_factory, redis, settings, tenant, body, key)
            except Exception as exc:  # noqa: BLE001 - handed back as this submission's answer
                results[i] = exc
    return results  # type: ignore[return-value]


def _has_bound(engine: Any, tenant_id: str) -> bool:
    bound = _admission_for(engine)[0].tenants.get(tenant_id)
    return bound is not None and bound.expires > time.monotonic()


def _admit_many_postgres(engine: Any, settings: Settings, tenant: Tenant, bodies: list[JobCreate]) -> list[Job]:
    """Admit a prefix of ``bodies`` (one tenant, no idempotency keys) in one statement; returns the admitted
    jobs in order (possibly none). Needs a current quota bound: without one nothing is admitted here."""
    adm, connections = _admission_for(engine)
    bound = adm.tenants.get(tenant.id)
    if bound is None or bound.expires <= time.monotonic():
        return []
    max_queued, limit = _limits(settings, tenant)
    pending = []
    for body in bodies:
        request = body.request_params()
        pending.append(_Pending(body, model_id(body.model or settings.model), body.fingerprint(), request,
                                json.dumps(request), new_id()))
    reserved: list[tuple[str, int]] = []
    for p in pending:
        before = adm.reserve_tier(p.body.tier)
        if before is None:
            for tier, _ in reserved:
                adm.adjust_tier(tier, -1)
            return []
        reserved.append((p.body.tier, before))
    needs = [float(estimate_tokens(p.request)) for p in pending]
    adds = [max(len(p.request_json) / 4.0 + p.body.max_tokens, need) for p, need in zip(pending, needs, strict=True)]
    params: dict[str, Any] = {
        "lock": _tenant_lock_key(tenant.id), "tenant": tenant.id, "mark": bound.mark, "queued": bound.queued,
        "tokens": bound.tokens, "ledger_from": bound.ledger_from, "max_queued": max_queued,
        "tier_cap": settings.tier_queue_cap, "limit": limit,
        # one JSON document, not twelve arrays: bound client-side in C (json.dumps), where arrays of strings
        # cost a regex substitution per quote; "request" is embedded exactly as json.dumps(request) writes it
        "batch": json.dumps([
            {"k": k, "id": p.job_id, "model": p.model, "tier": p.body.tier, "priority": p.body.priority,
             "request": p.request, "hash": p.fingerprint, "webhook": p.body.webhook_url, "meta": p.body.metadata,
             "deadline": float(p.body.deadline_seconds) if p.body.deadline_seconds else None, "need": need,
             "add": add, "tier_before": before}
            for k, (p, need, add, (_, before)) in enumerate(zip(pending, needs, adds, reserved, strict=True), 1)]),
    }
    import psycopg

    try:
        conn = connections.get()
    except BaseException:
        for tier, _ in reserved:
            adm.adjust_tier(tier, -1)
        raise
    try:
        # One simple-protocol message, lock then insert: PostgreSQL runs it as one implicit transaction and
        # commits it before answering (the lock is held to the commit). Measured ~2.5x less client CPU than
        # the same round trip in pipeline mode; the parameters are bound client-side (ClientCursor).
        conn.autocommit = True
        cur = psycopg.ClientCursor(conn)
        cur.execute(_PG_LOCK + ";\n" + _PG_ADMIT_MANY, params)
        cur.nextset()
        rows = cur.fetchall()
    except BaseException as exc:
        for tier, _ in reserved:
            adm.adjust_tier(tier, -1)
        _rollback_quietly(conn)
        if isinstance(exc, psycopg.Error):
            raise sa_exc.DBAPIError.instance(None, None, exc, psycopg.Error) from exc
        raise
    finally:
        try:
            conn.autocommit = False
        except Exception:  # noqa: BLE001 - a broken connection: put() discards it
            pass
        connections.put(conn)
    seen, seen_tokens = int(rows[0][0]), float(rows[0][1])
    inserted = {r[2]: r for r in rows if r[2] is not None}
    jobs_out: list[Job] = []
    for p in pending:
        row = inserted.get(p.job_id)
        if row is None:
            break  # only a prefix is admitted
        created = _utc(row[3])
        jobs_out.append(_job(id=p.job_id, tenant_id=tenant.id, model=p.model, tier=p.body.tier,
                             priority=p.body.priority, request=p.request, status="queued", idempotency_key=None,
                             request_hash=p.fingerprint, webhook_url=p.body.webhook_url, meta=p.body.metadata,
                             attempts=0, worker=None, cancel_requested=False, price_id=row[5], created_at=created,
                             queued_at=created, started_at=None, first_token_at=None, finished_at=None,
                             deadline_at=_utc(row[4]), heartbeat_at=None, error=None))
    n = len(jobs_out)
    for tier, _ in reserved[n:]:  # not admitted: give the reservations back
        adm.adjust_tier(tier, -1)
    if seen:
        for tier in {tier for tier, _ in reserved}:  # rows of other processes: counted in each tier (errs high)
            adm.adjust_tier(tier, seen)
    if n:
        adm.put(tenant.id, _TenantBound(mark=inserted[jobs_out[0].id][3], queued=bound.queued + seen + n,
                                        tokens=bound.tokens + seen_tokens + sum(adds[:n]),
                                        ledger_from=bound.ledger_from,
                                        expires=bound.expires if n == len(pending) else 0.0))
    else:  # the bound did not prove the first job fits: the next submission recounts exactly
        adm.put(tenant.id, _TenantBound(bound.mark, bound.queued, bound.tokens, bound.ledger_from, 0.0))
    return jobs_out


def _job(**values: Any) -> Job:
    """A detached ``Job`` holding exactly the row just committed (no attribute events: ~3 µs, not ~40)."""
    job = _JOB_MANAGER.new_instance()
    job.__dict__.update(values)
    return job


_JOB_MANAGER = instrumentation.manager_of_class(Job)


def _rollback_quietly(conn: Any) -> None:
    try:
        conn.rollback()
    except Exception:  # noqa: BLE001 - the connection is being discarded or reset by the pool anyway
        pass


def enqueue(redis: Any, settings: Settings, job: Job, cache_namespace: str) -> str:
    """XADD the job's message to its stream and remember it in the enqueued set (one MULTI)."""
    deadline = _unix(job.deadline_at)
    payload = encode_message(job.id, job.tenant_id, cache_namespace, job.model, job.tier, job.priority or 0,
                             job.request, deadline, _unix(job.queued_at) or time.time())
    pipe = redis.pipeline(transaction=True)
    pipe.xadd(stream_key(settings.stream_prefix, job.model, job.tier), {"m": payload})
    pipe.sadd(enqueued_key(settings.stream_prefix), job.id)
    msg_id, _ = pipe.execute()
    return msg_id.decode() if isinstance(msg_id, bytes) else msg_id


def enqueue_many(redis: Any, settings: Settings, jobs_ns: Sequence[tuple[Job, str]]) -> None:
    """``enqueue`` for several jobs in one MULTI (one round trip)."""
    pipe = redis.pipeline(transaction=True)
    enq = enqueued_key(settings.stream_prefix)
    for job, ns in jobs_ns:
        payload = encode_message(job.id, job.tenant_id, ns, job.model, job.tier, job.priority or 0, job.request,
                                 _unix(job.deadline_at), _unix(job.queued_at) or time.time())
        pipe.xadd(stream_key(settings.stream_prefix, job.model, job.tier), {"m": payload})
    pipe.sadd(enq, *[job.id for job, _ in jobs_ns])
    pipe.execute()

# --------------------------------------------------------------------------------------------------------
# transitions
# --------------------------------------------------------------------------------------------------------


def _check_transition(from_statuses: Iterable[str], to_status: str) -> list[str]:
    froms = [from_statuses] if isinstance(from_statuses, str) else list(from_statuses)
    for f in froms:
        if to_status not in TRANSITIONS.get(f, frozenset()) and not (f == to_status == "running"):
            raise ValueError(f"illegal job transition {f} -> {to_status}")
    return froms


def transition(session: Session, job_id: str, from_statuses: Iterable[str] | str, to_status: str, *,
               where: Sequence[Any] = (), **values: Any) -> bool:
    """``UPDATE jobs SET status=to_status, **values WHERE id=job_id AND status IN from_statuses [AND where]``.
    True when this call made the change (exactly one caller wins a race). Does not commit.
    ``running -> running`` is the takeover of a job whose worker is gone (pass a staleness condition)."""
    froms = _check_transition(from_statuses, to_status)
    if to_status in TERMINAL_STATUSES:
        values.setdefault("finished_at", utcnow())
    stmt = (update(Job).where(Job.id == job_id, Job.status.in_(froms), *where)
            .values(status=to_status, **values).execution_options(synchronize_session=False))
    return session.execute(stmt).rowcount == 1


def claim(session: Session, job_id: str, worker: str, stale_seconds: float) -> tuple[int, bool] | None:
    """A worker takes a job: ``queued -> running``, or ``running -> running`` when the previous worker's
    heartbeat is older than ``stale_seconds`` (it died; its message was reclaimed). Bumps ``attempts``,
    which fences the previous attempt's ``finish``. Returns ``(attempt, cancel_requested)``, or None when
    the job is not there to take (finished, cancelled, expired, or alive on another worker). Does not
    commit."""
    now = utcnow()
    cutoff = now - dt.timedelta(seconds=stale_seconds)
    takeable = (Job.status == "queued") | (
        (Job.status == "running") & (Job.heartbeat_at.is_(None) | (Job.heartbeat_at < cutoff)))
    row = session.execute(
        update(Job).where(Job.id == job_id, takeable)
        .values(status="running", attempts=Job.attempts + 1, worker=worker, started_at=now, heartbeat_at=now)
        .returning(Job.attempts, Job.cancel_requested)
        .execution_options(synchronize_session=False)).first()
    return (int(row[0]), bool(row[1])) if row is not None else None


def heartbeat(session: Session, worker: str, job_ids: Sequence[str]) -> dict[str, tuple[int, bool]]:
    """Refresh ``heartbeat_at`` of this worker's running jobs; returns {job_id: (attempt, cancel_requested)}
    for the jobs it still owns (a missing id was taken over or finished elsewhere). Does not commit."""
    if not job_ids:
        return {}
    rows = session.execute(
        update(Job).where(Job.id.in_(list(job_ids)), Job.status == "running", Job.worker == worker)
        .values(heartbeat_at=utcnow())
        .returning(Job.id, Job.attempts, Job.cancel_requested)
        .execution_options(synchronize_session=False)).all()
    return {r[0]: (int(r[1]), bool(r[2])) for r in rows}


def owned_by(attempt: int, worker: str) -> tuple[Any, Any]:
    """The fence of a worker's own attempt, for ``transition(where=...)``: the update applies only while
    no other worker has taken the job over."""
    return (Job.attempts == attempt, Job.worker == worker)


def status_of(session: Session, job_id: str) -> str | None:
    """The job's status, or None when there is no such job."""
    return session.scalar(select(Job.status).where(Job.id == job_id))


def owner_of(session: Session, job_id: str) -> tuple[str, str | None, int] | None:
    """``(status, worker, attempts)`` of a job, or None: tells a worker whether a result it could not
    confirm was written by it (a lost commit acknowledgement) or the job is no longer its own."""
    row = session.execute(select(Job.status, Job.worker, Job.attempts).where(Job.id == job_id)).first()
    return None if row is None else (row[0], row[1], int(row[2]))


def record_first_tokens(session: Session, first_token_at: dict[str, dt.datetime]) -> None:
    """Set ``first_token_at`` of many jobs in one statement, where it is not set yet. Does not commit."""
    if not first_token_at:
        return
    session.execute(update(Job).where(Job.id.in_(list(first_token_at)), Job.first_token_at.is_(None))
                    .values(first_token_at=case(first_token_at, value=Job.id))
                    .execution_options(synchronize_session=False))


@dataclass
class Outcome:
    """What ``finish`` records for a job reaching a terminal status."""

    status: str
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    compute_seconds: float = 0.0
    error: str | None = None
    first_token_at: dt.datetime | None = None


def finish(session: Session, job_id: str, outcome: Outcome, *, from_statuses: Iterable[str] | str = ("running",),
           attempt: int | None = None, worker: str | None = None, where: Sequence[Any] = (),
           **values: Any) -> bool:
    """Move a job to a terminal status and write its result row and its single ledger row, all in the
    caller's transaction (commit afterwards; roll back when False). Fenced: with ``attempt`` the update
    only applies if the job is still on that attempt (a newer worker took it over otherwise)."""
    froms = _check_transition(from_statuses, outcome.status)
    if outcome.status not in TERMINAL_STATUSES:
        raise ValueError(f"{outcome.status} is not a terminal status")
    now = utcnow()
    conds: list[Any] = [Job.id == job_id, Job.status.in_(froms), *where]
    if attempt is not None:
        conds.append(Job.attempts == attempt)
    if worker is not None:
        conds.append(Job.worker == worker)
    vals: dict[str, Any] = {"status": outcome.status, "finished_at": now, **values}
    if outcome.error is not None:
        vals["error"] = outcome.error
    if outcome.first_token_at is not None:
        vals["first_token_at"] = func.coalesce(Job.first_token_at, outcome.first_token_at)
    row = session.execute(update(Job).where(*conds).values(**vals)
                          .returning(Job.tenant_id, Job.model, Job.tier, Job.price_id)
                          .execution_options(synchronize_session=False)).first()
    if row is None:
        return False
    tenant_id, model, tier, price_id = row
    price = session.get(Price, price_id) if price_id is not None else None
    session.add(Result(job_id=job_id, text=(outcome.text or "").replace("\x00", "\ufffd"), finish_reason=outcome.finish_reason,
                       token_ids=outcome.token_ids, created_at=now))
    session.add(UsageEntry(
        job_id=job_id, tenant_id=tenant_id, model=model, tier=tier, status=outcome.status,
        prompt_tokens=outcome.prompt_tokens, cached_prompt_tokens=outcome.cached_prompt_tokens,
        completion_tokens=outcome.completion_tokens, compute_seconds=float(outcome.compute_seconds),
        cost_micros=cost_micros(outcome.prompt_tokens, outcome.cached_prompt_tokens, outcome.completion_tokens, price),
        price_id=price_id, created_at=now))
    session.flush()
    return True


def done_event(outcome: Outcome) -> dict[str, str]:
    """The final event of a job's event stream (fields ``event`` and ``data``, data is JSON)."""
    return {"event": EVENT_DONE, "data": json.dumps({
        "status": outcome.status, "finish_reason": outcome.finish_reason, "error": outcome.error,
        "usage": {"prompt_tokens": outcome.prompt_tokens, "cached_prompt_tokens": outcome.cached_prompt_tokens,
                  "completion_tokens": outcome.completion_tokens,
                  "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                  "compute_seconds": outcome.compute_seconds}})}


def delta_event(text_delta: str, token_ids: list[int] | None) -> dict[str, str]:
    return {"event": EVENT_DELTA, "data": json.dumps({"text": text_delta, "token_ids": token_ids or []})}


def publish_events(pipe: Any, settings: Settings, job_id: str, *events: dict[str, str]) -> None:
    """Queue XADDs of events to the job's capped event stream (plus its TTL) on a Redis pipeline."""
    key = events_key(settings.stream_prefix, job_id)
    for ev in events:
        pipe.xadd(key, ev, maxlen=settings.event_stream_maxlen, approximate=True)
    pipe.expire(key, settings.event_stream_ttl_seconds)


def _publish_done(redis: Any, settings: Settings, job_id: str, outcome: Outcome) -> None:
    try:
        pipe = redis.pipeline(transaction=False)
        publish_events(pipe, settings, job_id, done_event(outcome))
        pipe.execute()
    except Exception as exc:
        log.warning("could not publish the final event", job_id=job_id, error=str(exc))


# --------------------------------------------------------------------------------------------------------
# cancellation
# --------------------------------------------------------------------------------------------------------


def cancel(session_factory: sessionmaker, redis: Any, settings: Settings, job_id: str,
           tenant_id: str | None = None) -> Job | None:
    """Cancel a job. Queued: cancelled at once (result + zero ledger row). Running: ``cancel_requested`` is
    set and the worker is nudged on ``cancel_channel``; it aborts the request within one engine step and
    the job ends ``cancelled`` (paying for what was computed). Terminal: unchanged. Returns the job (None
    when unknown or owned by another tenant)."""
    for _ in range(5):
        with session_factory() as session:
            job = session.get(Job, job_id)
            if job is None or (tenant_id is not None and job.tenant_id != tenant_id):
                return None
            if job.status in TERMINAL_STATUSES:
                return job
            if job.status == "queued":
                outcome = Outcome(status="cancelled", finish_reason="abort", error="cancelled")
                if finish(session, job_id, outcome, from_statuses=("queued",), cancel_requested=True):
                    session.commit()
                    _publish_done(redis, settings, job_id, outcome)
                    log.info("queued job cancelled", job_id=job_id)
                    session.refresh(job)
                    return job
            elif job.status == "running":
                changed = session.execute(
                    update(Job).where(Job.id == job_id, Job.status == "running").values(cancel_requested=True)
                    .execution_options(synchronize_session=False)).rowcount
                if changed:
                    session.commit()
                    try:
                        redis.publish(cancel_channel(settings.stream_prefix), job_id)
                    except Exception as exc:  # the worker also polls the flag at each heartbeat
                        log.warning("cancel publish failed", job_id=job_id, error=str(exc))
                    log.info("cancel requested", job_id=job_id)
                    session.refresh(job)
                    return job
            session.rollback()
    with session_factory() as session:
        return session.get(Job, job_id)


# --------------------------------------------------------------------------------------------------------
# reconciliation
# --------------------------------------------------------------------------------------------------------


@dataclass
class ReconcileReport:
    readded: int = 0  # queued jobs with no message in Redis, enqueued again
    requeued: int = 0  # running jobs with a stale heartbeat, moved back to queued and enqueued
    expired: int = 0  # queued (or orphaned running) jobs past their deadline
    cancelled: int = 0  # orphaned running jobs whose cancel had been requested


def reconcile(session_factory: sessionmaker, redis: Any, settings: Settings, *, grace_seconds: float = 2.0,
              batch_size: int = 500, stale_seconds: float | None = None) -> ReconcileReport:
    """Repair the queue from PostgreSQL (the source of truth). Cheap: one indexed query per 500 queued
    jobs plus one SMISMEMBER against the enqueued set. Re-adding a job that still has a message only
    makes a duplicate message; the worker's conditional ``queued -> running`` update runs it once."""
    report = ReconcileReport()
    now = utcnow()
    stale = stale_seconds if stale_seconds is not None else stale_after_seconds(settings)
    to_enqueue: list[tuple[Job, str]] = []

    with session_factory() as session:
        # 1. queued jobs past their deadline
        ids = session.scalars(select(Job.id).where(Job.status == "queued", Job.deadline_at.is_not(None),
                                                   Job.deadline_at < now).limit(1000)).all()
        for job_id in ids:
            outcome = Outcome(status="expired", finish_reason="deadline", error="deadline passed while queued")
            if finish(session, job_id, outcome, from_statuses=("queued",)):
                session.commit()
                report.expired += 1
                _publish_done(redis, settings, job_id, outcome)
            else:
                session.rollback()

        # 2. running jobs whose worker stopped heartbeating
        cutoff = now - dt.timedelta(seconds=stale)
        stale_cond = ((Job.heartbeat_at < cutoff) | (Job.heartbeat_at.is_(None) & (Job.started_at < cutoff)))
        rows = session.execute(select(Job.id, Job.attempts, Job.cancel_requested, Job.deadline_at)
                               .where(Job.status == "running", stale_cond).limit(1000)).all()
        for job_id, attempts, cancel_requested, deadline_at in rows:
            fence = [Job.attempts == attempts, stale_cond]
            deadline_at = _as_aware(deadline_at)
            if cancel_requested or (deadline_at is not None and deadline_at < now):
                outcome = (Outcome(status="cancelled", finish_reason="abort", error="cancelled")
                           if cancel_requested else
                           Outcome(status="expired", finish_reason="deadline", error="deadline passed"))
                if finish(session, job_id, outcome, attempt=attempts, where=[stale_cond]):
                    session.commit()
                    report.cancelled += outcome.status == "cancelled"
                    report.expired += outcome.status == "expired"
                    _publish_done(redis, settings, job_id, outcome)
                else:
                    session.rollback()
                continue
            if transition(session, job_id, ("running",), "queued", where=fence, worker=None, queued_at=now):
                session.commit()
                job = session.get(Job, job_id)
                tenant = session.get(Tenant, job.tenant_id) if job is not None else None
                if job is not None and tenant is not None:
                    to_enqueue.append((job, tenant.cache_namespace))
                    report.requeued += 1
                log.warning("requeued a running job with a stale heartbeat", job_id=job_id, attempts=attempts)
            else:
                session.rollback()

        # 3. queued jobs without a message in Redis
        requeued_ids = {job.id for job, _ in to_enqueue}
        enq = enqueued_key(settings.stream_prefix)
        horizon = now - dt.timedelta(seconds=grace_seconds)
        last_id = ""
        while True:
            rows = session.execute(
                select(Job, Tenant.cache_namespace).join(Tenant, Tenant.id == Job.tenant_id)
                .where(Job.status == "queued", Job.queued_at < horizon, Job.id > last_id)
                .order_by(Job.id).limit(batch_size)).all()
            if not rows:
                break
            last_id = rows[-1][0].id
            present = redis.smismember(enq, [job.id for job, _ in rows])
            for (job, ns), here in zip(rows, present, strict=True):
                if not here and job.id not in requeued_ids:
                    to_enqueue.append((job, ns))
                    report.readded += 1
            if len(rows) < batch_size:
                break
            session.expunge_all()

    for job, ns in to_enqueue:
        try:
            enqueue(redis, settings, job, ns)
        except Exception as exc:
            log.warning("reconcile could not enqueue", job_id=job.id, error=str(exc))
    if report.readded or report.requeued or report.expired or report.cancelled:
        log.info("reconciled", readded=report.readded, requeued=report.requeued, expired=report.expired,
                 cancelled=report.cancelled)
    return report
