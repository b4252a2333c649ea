"""Admission on PostgreSQL, several submissions of one tenant in one statement (``submit_many``'s fast path).

The API groups the submissions that arrive while earlier ones are in flight (api/routes_jobs.SubmitBatcher).
A tenant's jobs without an idempotency key are then admitted by one statement under the tenant lock: the
checks of the single admission applied to each job in order, as if they were submitted one after another
(job k also counts jobs 1..k-1 of the group), and only a prefix of the group is admitted. Whatever is not
admitted goes through ``submit`` one by one, which recounts exactly when in doubt: a 429 still only comes
from an exact count. One plan, one commit and one Redis MULTI per group instead of per job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inferq.contract import JobCreate, model_id
from inferq.db import Job, Tenant, new_id
from inferq.jobs import quotas
from inferq.jobs.connections import AdmissionConnections
from inferq.jobs.pg_admission import (
    PG_LOCK,
    PG_SINCE_BOUND,
    admission_for,
    as_sqlalchemy_error,
    queued_job,
    rollback_quietly,
)
from inferq.jobs.quotas import Admission, TenantBound
from inferq.settings import Settings

_PG_ADMIT_MANY = f"""
WITH {PG_SINCE_BOUND}, now AS (
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
    """One submission of a group: what ``submit`` computes before touching the database."""

    body: JobCreate
    model: str
    fingerprint: str
    request: dict[str, Any]
    request_json: str
    job_id: str
    need: float = 0.0  # quotas.estimate_tokens
    add: float = 0.0  # quotas.bound_charge: what it adds to the tenant's bound once admitted
    tier_before: int = 0  # its tier's count before it (its reservation)


def has_fresh_bound(engine: Any, tenant_id: str) -> bool:
    """Whether this process holds a quota bound of the tenant that is not due for a recount."""
    return admission_for(engine)[0].fresh_bound(tenant_id) is not None


def admit_many_postgres(engine: Any, settings: Settings, tenant: Tenant,
                        bodies: list[tuple[JobCreate, int | None]]) -> list[Job]:
    """Admit a prefix of ``bodies`` (one tenant, no idempotency keys; each with its exact prompt token count or
    None) in one statement; returns the admitted jobs in order (possibly none). Needs a current quota bound:
    without one nothing is admitted here."""
    adm, connections = admission_for(engine)
    bound = adm.fresh_bound(tenant.id)
    if bound is None:
        return []
    pending = [_pending(settings, body, prompt_tokens) for body, prompt_tokens in bodies]
    if not _reserve_tiers(adm, pending):
        return []
    rows = _run(connections, adm, _params(settings, tenant, bound, pending), pending)
    seen, seen_tokens = int(rows[0][0]), float(rows[0][1])
    inserted = {r[2]: r for r in rows if r[2] is not None}
    admitted: list[Job] = []
    for p in pending:
        row = inserted.get(p.job_id)
        if row is None:
            break  # only a prefix is admitted
        admitted.append(queued_job(job_id=p.job_id, tenant_id=tenant.id, model=p.model, body=p.body,
                                   request=p.request, idempotency_key=None, fingerprint=p.fingerprint,
                                   price_id=row[5], created_at=row[3], deadline_at=row[4]))
    mark = inserted[admitted[0].id][3] if admitted else None
    _update_bounds(adm, tenant, bound, pending, len(admitted), seen, seen_tokens, mark)
    return admitted


def _pending(settings: Settings, body: JobCreate, prompt_tokens: int | None) -> _Pending:
    request = body.request_params()
    request_json = json.dumps(request)
    need = float(quotas.estimate_tokens(request, prompt_tokens))
    return _Pending(body, model_id(body.model or settings.model), body.fingerprint(), request, request_json,
                    new_id(), need=need, add=quotas.bound_charge(request_json, body.max_tokens, need))


def _reserve_tiers(adm: Admission, pending: list[_Pending]) -> bool:
    """Count each job in its tier before trying (see ``Admission.reserve_tier``); False (and nothing
    reserved) when a tier needs a recount."""
    for i, p in enumerate(pending):
        before = adm.reserve_tier(p.body.tier)
        if before is None:
            adm.release_tiers([q.body.tier for q in pending[:i]])
            return False
        p.tier_before = before
    return True


def _params(settings: Settings, tenant: Tenant, bound: TenantBound, pending: list[_Pending]) -> dict[str, Any]:
    max_queued, limit = quotas.limits(settings, tenant)
    return {
        "lock": quotas.tenant_lock_key(tenant.id), "tenant": tenant.id, "mark": bound.mark, "queued": bound.queued,
        "tokens": bound.tokens, "ledger_from": bound.ledger_from, "max_queued": max_queued,
        "tier_cap": settings.tier_queue_cap, "limit": limit,
        # one JSON document, not twelve arrays: bound client-side in C (json.dumps), where arrays of strings
        # cost a regex substitution per quote; "request" is embedded exactly as json.dumps(request) writes it
        "batch": json.dumps([
            {"k": k, "id": p.job_id, "model": p.model, "tier": p.body.tier, "priority": p.body.priority,
             "request": p.request, "hash": p.fingerprint, "webhook": p.body.webhook_url, "meta": p.body.metadata,
             "deadline": float(p.body.deadline_seconds) if p.body.deadline_seconds else None, "need": p.need,
             "add": p.add, "tier_before": p.tier_before}
            for k, p in enumerate(pending, 1)]),
    }


def _run(connections: AdmissionConnections, adm: Admission, params: dict[str, Any],
         pending: list[_Pending]) -> list[Any]:
    """The lock and the group's insert, committed; on any failure the tier reservations are given back."""
    import psycopg

    tiers = [p.body.tier for p in pending]
    try:
        pooled = connections.get()
    except BaseException:
        adm.release_tiers(tiers)
        raise
    conn: Any = pooled.driver_connection
    try:
        # One simple-protocol message, lock then insert: PostgreSQL runs it as one implicit transaction and
        # commits it before answering (the lock is held to the commit). Cheaper for the client than the same
        # round trip in pipeline mode; the parameters are bound client-side (ClientCursor).
        conn.autocommit = True
        cur = psycopg.ClientCursor(conn)
        cur.execute(PG_LOCK + ";\n" + _PG_ADMIT_MANY, params)
        cur.nextset()
        return cur.fetchall()
    except BaseException as exc:
        adm.release_tiers(tiers)
        rollback_quietly(conn)
        if isinstance(exc, psycopg.Error):
            raise as_sqlalchemy_error(exc) from exc
        raise
    finally:
        try:
            conn.autocommit = False
        except Exception:  # noqa: BLE001 - a broken connection: put() discards it
            pass
        connections.put(pooled)


def _update_bounds(adm: Admission, tenant: Tenant, bound: TenantBound, pending: list[_Pending], n: int, seen: int,
                   seen_tokens: float, mark: Any) -> None:
    """Count the first ``n`` jobs (admitted) and the rows of other processes the statement saw."""
    adm.release_tiers([p.body.tier for p in pending[n:]])  # not admitted: give the reservations back
    if seen:
        for tier in {p.body.tier for p in pending}:  # rows of other processes: counted in each tier (errs high)
            adm.adjust_tier(tier, seen)
    if n:
        adm.put(tenant.id, TenantBound(mark=mark, queued=bound.queued + seen + n,
                                       tokens=bound.tokens + seen_tokens + sum(p.add for p in pending[:n]),
                                       ledger_from=bound.ledger_from,
                                       expires=bound.expires if n == len(pending) else 0.0))
    else:  # the bound did not prove the first job fits: the next submission recounts exactly
        adm.put(tenant.id, bound.expired())
