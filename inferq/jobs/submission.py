"""Submission: ``submit`` (one job) and ``submit_many`` (the API's groups of submissions).

Idempotency and quotas first, then the job row (status ``queued``, the price version in force, the deadline)
is committed FIRST; only then is its message enqueued. An enqueue that fails after the commit is logged and
left to ``reconcile``: the job stays accepted. On PostgreSQL the database part is the raw-psycopg fast path
(``pg_admission``, ``pg_group``); on any other database (SQLite, ``inferq up``) the ORM path below, with
exact counts on every submission.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from inferq.contract import DEFAULT_WEIGHT, JobCreate, model_id
from inferq.db import Job, Tenant, utcnow
from inferq.jobs import quotas
from inferq.jobs.enqueue import enqueue, enqueue_many
from inferq.jobs.errors import idempotent_retry
from inferq.jobs.pg_admission import submit_postgres
from inferq.jobs.pg_group import admit_many_postgres, has_fresh_bound
from inferq.jobs.prices import current_price
from inferq.log import get_logger
from inferq.settings import Settings

log = get_logger("inferq.jobs")

_Answer = tuple[Job, bool] | Exception


def tenant_weight(tenant: Tenant) -> float:
    """The tenant's fair-share weight for its jobs' messages (1.0 for a row loaded before the column existed)."""
    weight = getattr(tenant, "fair_share_weight", None)
    return float(weight) if weight else DEFAULT_WEIGHT


def submit(session_factory: sessionmaker, redis: Any, settings: Settings, tenant: Tenant, body: JobCreate,
           idempotency_key: str | None = None, prompt_tokens: int | None = None) -> tuple[Job, bool]:
    """Accept a job: write the row (committed first), then enqueue it. Returns ``(job, created)``;
    ``created`` is False for an idempotent retry (same key and body). Raises ``Conflict`` (same key,
    other body) or ``QuotaExceeded``. ``prompt_tokens``: the prompt's exact count when the caller counted it
    with the model's tokenizer (the API does), charged to the token quota instead of the estimate."""
    model = model_id(body.model or settings.model)
    fingerprint = body.fingerprint()
    request = body.request_params()
    engine = session_factory.kw.get("bind")
    if engine is not None and engine.dialect.name == "postgresql":
        job, created = submit_postgres(engine, session_factory, settings, tenant, body, idempotency_key, model,
                                       fingerprint, request, prompt_tokens)
    else:
        job, created = _submit_orm(session_factory, settings, tenant, body, idempotency_key, model, fingerprint,
                                   request, prompt_tokens)
    if not created:
        return job, False
    try:
        enqueue(redis, settings, job, tenant.cache_namespace, tenant_weight(tenant))
    except Exception as exc:  # the row is committed: the reconciler will enqueue it
        log.warning("enqueue failed after commit; left for the reconciler", job_id=job.id, error=str(exc))
    log.info("job accepted", job_id=job.id, tenant=tenant.id, model=model, tier=body.tier)
    return job, True


def _submit_orm(session_factory: sessionmaker, settings: Settings, tenant: Tenant, body: JobCreate,
                idempotency_key: str | None, model: str, fingerprint: str, request: dict[str, Any],
                prompt_tokens: int | None) -> tuple[Job, bool]:
    """Any dialect (SQLite for ``inferq up``): exact counts on every submission, through the ORM."""
    with session_factory() as session:
        if idempotency_key:
            existing = session.scalar(select(Job).where(Job.tenant_id == tenant.id,
                                                        Job.idempotency_key == idempotency_key))
            if existing is not None:
                return idempotent_retry(existing, fingerprint)
        quotas.lock_tenant(session, tenant.id)
        quotas.check_quotas(session, settings, tenant, body.tier, request, prompt_tokens)
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
            return idempotent_retry(existing, fingerprint)
    return job, True


def submit_many(session_factory: sessionmaker, redis: Any, settings: Settings,
                items: Sequence[tuple[Tenant, JobCreate, str | None]],
                prompt_tokens: Sequence[int | None] | None = None) -> list[tuple[Job, bool] | Exception]:
    """``submit`` for several submissions at once, with the same outcome for each as submitting them one after
    another (a result, or the exception ``submit`` would raise). On PostgreSQL each tenant's jobs without an
    idempotency key are admitted together (``pg_group``) and enqueued in one MULTI; everything else (and
    every other database) goes through ``submit``. ``prompt_tokens``: each item's exact count, or None."""
    counts = list(prompt_tokens) if prompt_tokens is not None else [None] * len(items)
    results: list[_Answer | None] = [None] * len(items)
    engine = session_factory.kw.get("bind")
    if len(items) > 1 and engine is not None and engine.dialect.name == "postgresql":
        _submit_groups(engine, session_factory, redis, settings, items, counts, results)
    for i, (tenant, body, key) in enumerate(items):
        if results[i] is None:
            results[i] = _answer(session_factory, redis, settings, tenant, body, key, counts[i])
    return results  # type: ignore[return-value]


def _answer(session_factory: sessionmaker, redis: Any, settings: Settings, tenant: Tenant, body: JobCreate,
            key: str | None, prompt_tokens: int | None) -> _Answer:
    try:
        return submit(session_factory, redis, settings, tenant, body, key, prompt_tokens)
    except Exception as exc:  # noqa: BLE001 - handed back as this submission's answer
        return exc


def _submit_groups(engine: Any, session_factory: sessionmaker, redis: Any, settings: Settings,
                   items: Sequence[tuple[Tenant, JobCreate, str | None]], counts: list[int | None],
                   results: list[_Answer | None]) -> None:
    """Admit each tenant's submissions without an idempotency key together, answering them in ``results``;
    those left unanswered go through ``submit`` one by one."""
    groups: dict[str, list[int]] = {}
    for i, (tenant, _, key) in enumerate(items):
        if not key:
            groups.setdefault(tenant.id, []).append(i)
    created: list[tuple[Job, str, float]] = []
    for idx in groups.values():
        tenant = items[idx[0]][0]
        if len(idx) > 2 and not has_fresh_bound(engine, tenant.id):
            # the first job recounts exactly (and leaves a fresh bound); the rest can then go together
            results[idx[0]] = _answer(session_factory, redis, settings, tenant, items[idx[0]][1], None, counts[idx[0]])
            idx = idx[1:]
        if len(idx) >= 2:
            created += _admit_group(engine, settings, tenant, [(items[i][1], counts[i]) for i in idx], idx, results)
    if created:
        try:
            enqueue_many(redis, settings, created)
        except Exception as exc:  # the rows are committed: the reconciler will enqueue them
            log.warning("enqueue failed after commit; left for the reconciler", jobs=len(created), error=str(exc))
        # one line per group, not per job (a log line costs a noticeable share of a submission's CPU)
        log.info("jobs accepted", job_ids=[job.id for job, *_ in created], count=len(created))


def _admit_group(engine: Any, settings: Settings, tenant: Tenant, bodies: list[tuple[JobCreate, int | None]],
                 idx: list[int], results: list[_Answer | None]) -> list[tuple[Job, str, float]]:
    """One tenant's group in one statement; answers the admitted jobs (and all of them on an error that must
    not be retried) and returns ``(job, cache namespace, fair-share weight)`` of the admitted ones."""
    try:
        admitted = admit_many_postgres(engine, settings, tenant, bodies)
    except sa_exc.OperationalError as exc:
        # unreachable, or the commit's outcome unknown: each job gets the error (as ``submit`` would
        # answer it), never a second try that could store it twice
        for i in idx:
            results[i] = exc
        return []
    except sa_exc.DBAPIError as exc:  # the statement failed and was rolled back: each job on its own
        log.warning("batch admission failed; submitting one by one", tenant=tenant.id, error=str(exc))
        return []
    except Exception as exc:  # noqa: BLE001 - not known to be rolled back: never tried twice
        for i in idx:
            results[i] = exc
        return []
    for i, job in zip(idx, admitted, strict=False):
        results[i] = (job, True)
    return [(job, tenant.cache_namespace, tenant_weight(tenant)) for job in admitted]
