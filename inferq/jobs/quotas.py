"""Quotas: the token estimates, a tenant's limits, the exact checks (any dialect, through the ORM) and the
per-process upper bounds from which the PostgreSQL fast path (``pg_admission``) proves the limits hold.

The token estimates are defined here and nowhere else:

* ``estimate_tokens(request, prompt_tokens)``: what a new submission needs: its prompt (the exact count when
  the API counted it with the model's tokenizer, else roughly) plus ``max_tokens``;
* the row estimate: what an accepted job not yet in the ledger counts, ``length(request JSON) / 4 +
  max_tokens``, in three forms that must agree: ``ROW_ESTIMATE_SQL`` (raw PostgreSQL statements),
  ``row_estimate_expr()`` (the ORM path, any dialect) and ``row_estimate()`` (Python, for the bounds).
  tests/integration/test_jobs.py checks that they agree. A job counts it for the minute after its
  submission while its status is one of ``ESTIMATED_STATUSES``: queued, running, and failed, so that the work
  a job causes before it fails (a worker refusing it) is charged to its tenant, not free.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, cast, func, select, text
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from inferq.db import Job, Tenant, UsageEntry, as_aware, utcnow
from inferq.jobs.errors import QuotaExceeded
from inferq.settings import Settings

# ---- token estimates ----------------------------------------------------------------------------------------

CHARS_PER_TOKEN = 4  # the row estimate counts one token per four characters of the stored request JSON

ROW_ESTIMATE_SQL = (f"length(CAST(request AS TEXT)) / {CHARS_PER_TOKEN}.0 "
                    "+ coalesce(CAST(request ->> 'max_tokens' AS INTEGER), 0)")
# the statuses in which a job of the last minute counts its row estimate (see above)
ESTIMATED_STATUSES = ("queued", "running", "failed")
ESTIMATED_STATUSES_SQL = "(" + ", ".join(f"'{s}'" for s in ESTIMATED_STATUSES) + ")"


def estimate_tokens(request: dict[str, Any], prompt_tokens: int | None = None) -> int:
    """What a job needs of the rate limit: its prompt + max_tokens. ``prompt_tokens`` is the prompt's exact
    count when known (the API counts it with the model's tokenizer); otherwise a cheap upper-ish estimate."""
    if prompt_tokens is not None:
        prompt = prompt_tokens
    elif request.get("prompt_ids") is not None:
        prompt = len(request["prompt_ids"])
    elif request.get("prompt") is not None:
        prompt = len(request["prompt"]) // 4 + 1
    else:
        prompt = sum(len(m.get("content", "")) // 4 + 4 for m in request.get("messages") or [])
    return prompt + int(request.get("max_tokens", 0))


def row_estimate(request_json: str, max_tokens: int) -> float:
    """``ROW_ESTIMATE_SQL`` of a row whose request column holds ``request_json`` (as ``json.dumps`` wrote it)."""
    return len(request_json) / float(CHARS_PER_TOKEN) + max_tokens


def row_estimate_expr() -> ColumnElement[Any]:
    """``ROW_ESTIMATE_SQL`` as a SQLAlchemy expression over ``Job`` (portable: SQLite has no ``->>`` before 3.38)."""
    return func.length(cast(Job.request, Text)) / CHARS_PER_TOKEN + func.coalesce(Job.request["max_tokens"].as_integer(), 0)


def bound_charge(request_json: str, max_tokens: int, need: float) -> float:
    """What an admitted job adds to its tenant's token bound: at least its row estimate (what the SQL counts
    for it from then on) and at least its ``need`` (what the checks charged it), so the bound only errs high."""
    return max(row_estimate(request_json, max_tokens), need)


# ---- limits and the exact checks --------------------------------------------------------------------------------


def tenant_lock_key(tenant_id: str) -> str:
    """The name of the PostgreSQL advisory lock that serializes one tenant's submissions."""
    return "inferq:tenant:" + tenant_id


def lock_tenant(session: Session, tenant_id: str) -> None:
    """Serialize one tenant's submissions so quota counts are exact (PostgreSQL only)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": tenant_lock_key(tenant_id)})


def limits(settings: Settings, tenant: Tenant) -> tuple[int, int]:
    """``(max_queued_jobs, tokens_per_minute)`` of a tenant: its own, else the settings' defaults."""
    max_queued = tenant.max_queued_jobs if tenant.max_queued_jobs is not None else settings.default_max_queued_jobs
    limit = tenant.tokens_per_minute if tenant.tokens_per_minute is not None else settings.default_tokens_per_minute
    return max_queued, limit


def queued_limit_error(queued: int, max_queued: int) -> QuotaExceeded:
    return QuotaExceeded(f"tenant has {queued} queued jobs (limit {max_queued})", retry_after=5, limit="queued_jobs")


def tier_limit_error(tier: str, tier_queued: int) -> QuotaExceeded:
    return QuotaExceeded(f"the {tier} queue is full ({tier_queued} jobs)", retry_after=10, limit="tier_queue")


def token_limit_error(used: int, need: int, limit: int, oldest: dt.datetime | None, now: dt.datetime) -> QuotaExceeded:
    oldest = min(t for t in (as_aware(oldest), now) if t is not None)
    retry = 60.0 - (now - oldest).total_seconds()
    return QuotaExceeded(f"token rate limit: {used} tokens in the last minute, this job needs about {need} "
                         f"(limit {limit}/min)", retry_after=max(1.0, retry), limit="tokens_per_minute")


def check_quotas(session: Session, settings: Settings, tenant: Tenant, tier: str, request: dict[str, Any],
                 prompt_tokens: int | None = None) -> None:
    """The exact quota checks in SQL (any dialect; the PostgreSQL fast path recounts in ``pg_admission``)."""
    now = utcnow()
    max_queued, limit = limits(settings, tenant)
    # 1. the tenant's queued jobs
    queued = session.scalar(select(func.count()).select_from(Job)
                            .where(Job.tenant_id == tenant.id, Job.status == "queued")) or 0
    if queued >= max_queued:
        raise queued_limit_error(queued, max_queued)
    # 2. the tier's queue
    tier_queued = session.scalar(select(func.count()).select_from(Job)
                                 .where(Job.status == "queued", Job.tier == tier)) or 0
    if tier_queued >= settings.tier_queue_cap:
        raise tier_limit_error(tier, tier_queued)
    # 3. tokens per minute: the ledger of the last minute (actual tokens) plus an estimate for this
    #    tenant's jobs accepted in the last minute that have not reached the ledger yet, or failed
    window_start = now - dt.timedelta(seconds=60)
    used_ledger, oldest_ledger = session.execute(
        select(func.coalesce(func.sum(UsageEntry.prompt_tokens + UsageEntry.completion_tokens), 0),
               func.min(UsageEntry.created_at))
        .where(UsageEntry.tenant_id == tenant.id, UsageEntry.created_at > window_start)).one()
    used_open, oldest_open = session.execute(
        select(func.coalesce(func.sum(row_estimate_expr()), 0), func.min(Job.created_at))
        .where(Job.tenant_id == tenant.id, Job.created_at > window_start, Job.status.in_(ESTIMATED_STATUSES))).one()
    used = int(used_ledger) + int(used_open)
    need = estimate_tokens(request, prompt_tokens)
    if used > 0 and used + need > limit:
        oldest = min(t for t in (as_aware(oldest_ledger), as_aware(oldest_open), now) if t is not None)
        raise token_limit_error(used, need, limit, oldest, now)


# ---- per-process upper bounds (the PostgreSQL fast path) -----------------------------------------------------
#
# Counting a tenant's queued jobs, its tier's queue and its tokens of the last minute costs time proportional
# to the queue (and to the minute's traffic). Instead each process keeps, per tenant, an UPPER BOUND of those
# numbers as of a PostgreSQL timestamp ``mark``, and a submission only adds what happened since:
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
#   the exact numbers, so a 429 is only ever answered from an exact count.
# * The tier cap counts every tenant's jobs, which the tenant lock does not serialize: between recounts a
#   process adds its own admissions (and the rows it sees) to the tier count of its last recount, so other
#   processes' admissions of other tenants are seen within ``QUOTA_RECOUNT_SECONDS``.

QUOTA_RECOUNT_SECONDS = 5.0
LEDGER_LAG_SECONDS = 2.0


@dataclass(frozen=True)
class TenantBound:
    """Upper bounds of a tenant's usage (see above); replaced, never mutated, so threads read a consistent one."""

    mark: dt.datetime  # PostgreSQL time: every job of the tenant created at or before it is counted here
    queued: int  # >= the tenant's queued jobs created at or before mark
    tokens: float  # >= ledger tokens up to ledger_from + estimates of its jobs created up to mark, last minute
    ledger_from: dt.datetime  # ledger rows after this are summed at each submission
    expires: float  # time.monotonic() of the next exact recount

    def fresh(self) -> bool:
        return self.expires > time.monotonic()

    def expired(self) -> TenantBound:
        """The same bound, due for an exact recount at the next submission."""
        return TenantBound(self.mark, self.queued, self.tokens, self.ledger_from, 0.0)


class TierBound:
    def __init__(self, queued: int, expires: float) -> None:
        self.queued = queued  # the last exact count + admissions since (own, and those seen in tenant scans)
        self.expires = expires


class Admission:
    """Per-process, per-engine quota bounds."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantBound] = {}
        self.tiers: dict[str, TierBound] = {}
        self.lock = threading.Lock()

    def put(self, tenant_id: str, bound: TenantBound) -> None:
        if len(self.tenants) >= 100_000:
            self.tenants.clear()
        self.tenants[tenant_id] = bound

    def fresh_bound(self, tenant_id: str) -> TenantBound | None:
        """The tenant's bound if it is not due for a recount, else None."""
        bound = self.tenants.get(tenant_id)
        return bound if bound is not None and bound.fresh() else None

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

    def release_tiers(self, tiers: Sequence[str]) -> None:
        """Give back reservations (one per entry) that were not admitted."""
        for tier in tiers:
            self.adjust_tier(tier, -1)

    def set_tier(self, tier: str, queued: int, expires: float) -> None:
        with self.lock:
            self.tiers[tier] = TierBound(queued, expires)
