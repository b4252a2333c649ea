"""Admission on PostgreSQL, one submission at a time: the fast path of ``submit``.

One round trip and one commit per job on a pooled psycopg connection (no ORM): the tenant's advisory lock,
then one conditional ``INSERT ... SELECT ... WHERE <limits hold>`` that also looks up the price version in
force, decided from this process's quota bounds (``quotas``). When the bound cannot prove the limits hold,
and every ``QUOTA_RECOUNT_SECONDS``, it recounts exactly under the lock first, so every 429 comes from an
exact count. Also the per-engine registry of bounds and connections, and what ``pg_group`` shares.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import select
from sqlalchemy.orm import configure_mappers, instrumentation, sessionmaker

from inferq.contract import JobCreate
from inferq.db import Job, Tenant, new_id, to_utc
from inferq.jobs import quotas
from inferq.jobs.connections import AdmissionConnections
from inferq.jobs.errors import Conflict, QuotaExceeded, idempotent_retry
from inferq.jobs.prices import current_price
from inferq.jobs.quotas import (
    ESTIMATED_STATUSES_SQL,
    LEDGER_LAG_SECONDS,
    QUOTA_RECOUNT_SECONDS,
    ROW_ESTIMATE_SQL,
    Admission,
    TenantBound,
)
from inferq.settings import Settings

PG_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%(lock)s, 0))"

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
    SELECT coalesce(sum({ROW_ESTIMATE_SQL}), 0) AS tokens, min(created_at) AS oldest
    FROM jobs WHERE tenant_id = %(tenant)s AND created_at > now.t - interval '60 seconds'
                AND status IN {ESTIMATED_STATUSES_SQL}) ow
LEFT JOIN LATERAL (
    SELECT id, request_hash FROM jobs WHERE tenant_id = %(tenant)s AND idempotency_key = %(key)s) e ON true
"""

# what changed since the tenant's cached bound was taken: its jobs created since (d), its ledger tokens since (l)
PG_SINCE_BOUND = f"""d AS (
    SELECT count(*) AS n, coalesce(sum({ROW_ESTIMATE_SQL}), 0) AS tokens
    FROM jobs WHERE tenant_id = %(tenant)s AND created_at > %(mark)s
), l AS (
    SELECT coalesce(sum(prompt_tokens + completion_tokens), 0) AS tokens
    FROM usage_ledger WHERE tenant_id = %(tenant)s AND created_at > %(ledger_from)s
)"""

# the conditional insert: accepted only when the bounds prove the limits hold
_PG_ADMIT = f"""
WITH {PG_SINCE_BOUND}, p AS (
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

# ---- shared with pg_group ------------------------------------------------------------------------------------

_REGISTRY: weakref.WeakKeyDictionary[Any, tuple[Admission, AdmissionConnections]] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def admission_for(engine: Any) -> tuple[Admission, AdmissionConnections]:
    """This process's quota bounds and admission connections for ``engine`` (made on first use)."""
    found = _REGISTRY.get(engine)
    if found is None:
        with _REGISTRY_LOCK:
            found = _REGISTRY.get(engine)
            if found is None:
                found = _REGISTRY[engine] = (Admission(), AdmissionConnections(engine))
    return found


def as_sqlalchemy_error(exc: Exception) -> sa_exc.StatementError:
    """A psycopg error as SQLAlchemy would raise it (so the API answers it like any database error)."""
    import psycopg

    return sa_exc.DBAPIError.instance(None, None, exc, psycopg.Error)


@contextlib.contextmanager
def pooled_connection(engine: Any) -> Iterator[Any]:
    """One of ``engine``'s admission connections (a psycopg connection, no transaction open), given back after.
    On an error inside, its transaction is rolled back, and a psycopg error comes out as SQLAlchemy's."""
    import psycopg

    _, connections = admission_for(engine)
    pooled = connections.get()
    conn: Any = pooled.driver_connection
    try:
        yield conn
    except psycopg.Error as exc:
        rollback_quietly(conn)
        raise as_sqlalchemy_error(exc) from exc
    except BaseException:
        rollback_quietly(conn)
        raise
    finally:
        connections.put(pooled)


def rollback_quietly(conn: Any) -> None:
    try:
        conn.rollback()
    except Exception:  # noqa: BLE001 - the connection is being discarded or reset by the pool anyway
        pass


def detached_instance(cls: type, **values: Any) -> Any:
    """A detached ``cls`` (an ORM model) holding exactly ``values``, as read from its row (no attribute events:
    far cheaper than the constructor). The mappers are configured first: a process that has not run an ORM
    query yet (a Celery worker's first task) has no attribute implementations until then."""
    configure_mappers()  # a flag check once done
    obj = instrumentation.manager_of_class(cls).new_instance()
    obj.__dict__.update(values)
    return obj


def detached_job(**values: Any) -> Job:
    """A detached ``Job`` holding exactly the row just committed."""
    return detached_instance(Job, **values)


def queued_job(*, job_id: str, tenant_id: str, model: str, body: JobCreate, request: dict[str, Any],
               idempotency_key: str | None, fingerprint: str, price_id: int | None, created_at: dt.datetime,
               deadline_at: dt.datetime | None) -> Job:
    """The ``Job`` an admission statement just inserted (timestamps as PostgreSQL returned them)."""
    created = to_utc(created_at)
    return detached_job(id=job_id, tenant_id=tenant_id, model=model, tier=body.tier, priority=body.priority,
                        request=request, status="queued", idempotency_key=idempotency_key,
                        request_hash=fingerprint, webhook_url=body.webhook_url, meta=body.metadata, attempts=0,
                        worker=None, cancel_requested=False, price_id=price_id, created_at=created,
                        queued_at=created, started_at=None, first_token_at=None, finished_at=None,
                        deadline_at=to_utc(deadline_at), heartbeat_at=None, error=None)


# ---- one submission ------------------------------------------------------------------------------------------


@dataclass
class _Submission:
    """What one submission computes before touching the database; ``params`` are the statements' parameters."""

    tenant: Tenant
    body: JobCreate
    key: str | None
    model: str
    fingerprint: str
    request: dict[str, Any]
    request_json: str  # what PostgreSQL stores (and what the row estimate measures)
    need: int
    params: dict[str, Any]


@dataclass
class _Existing:
    """The job that already holds the submission's idempotency key."""

    id: str
    request_hash: str | None


def _prepare(settings: Settings, tenant: Tenant, body: JobCreate, idempotency_key: str | None, model: str,
             fingerprint: str, request: dict[str, Any], prompt_tokens: int | None) -> _Submission:
    max_queued, limit = quotas.limits(settings, tenant)
    need = quotas.estimate_tokens(request, prompt_tokens)
    request_json = json.dumps(request)
    params: dict[str, Any] = {
        "lock": quotas.tenant_lock_key(tenant.id), "tenant": tenant.id, "model": model, "tier": body.tier,
        "key": idempotency_key, "id": new_id(), "priority": body.priority, "request": request_json,
        "hash": fingerprint, "webhook": body.webhook_url,
        "meta": json.dumps(body.metadata) if body.metadata is not None else None,
        "deadline": float(body.deadline_seconds) if body.deadline_seconds else None,
        "max_queued": max_queued, "tier_cap": settings.tier_queue_cap, "need": need, "limit": limit,
        "lag": LEDGER_LAG_SECONDS,
    }
    return _Submission(tenant, body, idempotency_key, model, fingerprint, request, request_json, need, params)


def submit_postgres(engine: Any, session_factory: sessionmaker, settings: Settings, tenant: Tenant,
                    body: JobCreate, idempotency_key: str | None, model: str, fingerprint: str,
                    request: dict[str, Any], prompt_tokens: int | None = None) -> tuple[Job, bool]:
    """``submit``'s database part on PostgreSQL: ``(job, created)``; raises ``Conflict`` or ``QuotaExceeded``."""
    import psycopg

    adm, _ = admission_for(engine)
    sub = _prepare(settings, tenant, body, idempotency_key, model, fingerprint, request, prompt_tokens)
    with pooled_connection(engine) as conn:
        try:
            admitted = _admit(conn, adm, session_factory, settings, sub)
        except psycopg.errors.UniqueViolation as exc:
            # the same idempotency key won a race (only possible without the lock); report the winner's job
            rollback_quietly(conn)
            return _race_winner(session_factory, sub, exc)
    if isinstance(admitted, Job):
        return admitted, True
    with session_factory() as session:
        job = session.get(Job, admitted.id)
    if job is None:  # pragma: no cover - jobs are never deleted
        raise Conflict("idempotency key refers to a job that no longer exists")
    return idempotent_retry(job, fingerprint)


def _admit(conn: Any, adm: Admission, session_factory: sessionmaker, settings: Settings,
           sub: _Submission) -> Job | _Existing:
    """Up to four tries: the admitted job, or the job that already holds the idempotency key."""
    tenant_id, tier = sub.tenant.id, sub.body.tier
    for _attempt in range(4):
        bound = adm.tenants.get(tenant_id)
        tier_before = adm.reserve_tier(tier) if bound is not None else None
        recounted = bound is None or tier_before is None or bound.expires <= time.monotonic()
        if recounted:
            if tier_before is not None:
                adm.adjust_tier(tier, -1)
            step = _recount_and_admit(conn, adm, sub)
            if isinstance(step, _Existing):
                return step
            bound, result = step
        else:
            assert bound is not None and tier_before is not None
            result = _admit_on_bound(conn, sub, bound, tier_before)
        assert result is not None
        _seen, _seen_tokens, created_at, _deadline_at, e_id, e_hash, price_id = result
        if created_at is not None:
            return _admitted(adm, sub, bound, result)
        adm.adjust_tier(tier, -1)  # not admitted: give the reservation back
        if e_id is not None:
            return _Existing(e_id, e_hash)
        if price_id is None:  # first job for (model, tier): create price version 1, then try again
            with session_factory() as session:
                current_price(session, settings, sub.model, tier)
                session.commit()
            continue
        if recounted:  # the exact check passed but the insert did not: the bound moved; count again
            adm.tenants.pop(tenant_id, None)
            continue
        # the bound was not enough to prove the limits hold: recount exactly
        adm.put(tenant_id, bound.expired())
    raise QuotaExceeded("could not admit the job; try again", retry_after=1, limit="contention")


def _admit_on_bound(conn: Any, sub: _Submission, bound: TenantBound, tier_before: int) -> Any:
    """The conditional insert on this process's bound: one round trip (lock, insert, commit)."""
    sub.params.update(mark=bound.mark, queued=bound.queued, tokens=bound.tokens, ledger_from=bound.ledger_from,
                      tier_queued=tier_before)
    with conn.pipeline():
        conn.execute(PG_LOCK, sub.params)
        cur = conn.execute(_PG_ADMIT, sub.params)
        conn.commit()
    return cur.fetchone()


def _recount_and_admit(conn: Any, adm: Admission, sub: _Submission) -> _Existing | tuple[TenantBound, Any]:
    """Exact recount under the lock and a decision on it (a 429 only ever comes from here); when the job fits,
    the conditional insert in the same transaction. Returns the new bound and the insert's row."""
    with conn.pipeline():
        conn.execute(PG_LOCK, sub.params)
        row = conn.execute(_PG_RECOUNT, sub.params).fetchone()
    assert row is not None
    (now, queued, tier_queued, ledger_tokens, ledger_head, ledger_oldest, open_tokens, open_oldest, e_id,
     e_hash) = row
    expires = time.monotonic() + QUOTA_RECOUNT_SECONDS
    # whole tokens, as the exact check counts them, so the admission below agrees with it
    bound = TenantBound(mark=now, queued=int(queued), tokens=float(int(ledger_head) + int(open_tokens)),
                        ledger_from=now - dt.timedelta(seconds=LEDGER_LAG_SECONDS), expires=expires)
    adm.put(sub.tenant.id, bound)
    adm.set_tier(sub.body.tier, int(tier_queued), expires)
    if e_id is not None:
        conn.commit()
        return _Existing(e_id, e_hash)
    max_queued, limit = sub.params["max_queued"], sub.params["limit"]
    refusal = None
    used = int(ledger_tokens) + int(open_tokens)
    if queued >= max_queued:
        refusal = quotas.queued_limit_error(queued, max_queued)
    elif tier_queued >= sub.params["tier_cap"]:
        refusal = quotas.tier_limit_error(sub.body.tier, tier_queued)
    elif used > 0 and used + sub.need > limit:
        oldest = min((t for t in (ledger_oldest, open_oldest) if t is not None), default=None)
        refusal = quotas.token_limit_error(used, sub.need, limit, oldest, now)
    if refusal is not None:
        conn.commit()
        raise refusal
    # admit on the exact numbers (the insert repeats the same checks, so it agrees)
    adm.adjust_tier(sub.body.tier, 1)  # counted like a reservation: given back if not admitted
    sub.params.update(mark=bound.mark, queued=bound.queued, tokens=bound.tokens, ledger_from=bound.ledger_from,
                      tier_queued=int(tier_queued))
    with conn.pipeline():  # the insert and its commit in one round trip
        cur = conn.execute(_PG_ADMIT, sub.params)
        conn.commit()
    return bound, cur.fetchone()


def _admitted(adm: Admission, sub: _Submission, bound: TenantBound, result: Any) -> Job:
    """Count the admitted job (and the rows of other processes the statement saw) in the bounds."""
    seen, seen_tokens, created_at, deadline_at, _, _, price_id = result
    charge = quotas.bound_charge(sub.request_json, sub.body.max_tokens, sub.need)
    adm.put(sub.tenant.id, TenantBound(mark=created_at, queued=bound.queued + int(seen) + 1,
                                       tokens=bound.tokens + float(seen_tokens) + charge,
                                       ledger_from=bound.ledger_from, expires=bound.expires))
    if seen:
        adm.adjust_tier(sub.body.tier, int(seen))
    return queued_job(job_id=sub.params["id"], tenant_id=sub.tenant.id, model=sub.model, body=sub.body,
                      request=sub.request, idempotency_key=sub.key, fingerprint=sub.fingerprint, price_id=price_id,
                      created_at=created_at, deadline_at=deadline_at)


def _race_winner(session_factory: sessionmaker, sub: _Submission, exc: Exception) -> tuple[Job, bool]:
    job = None
    if sub.key:
        with session_factory() as session:
            job = session.scalar(select(Job).where(Job.tenant_id == sub.tenant.id, Job.idempotency_key == sub.key))
    if job is None:
        raise as_sqlalchemy_error(exc) from exc
    return idempotent_retry(job, sub.fingerprint)
