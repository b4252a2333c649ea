"""The job service's SQL and Redis side, shared by the API, the Celery tasks and the worker (no torch here).

``from inferq import jobs``, then ``jobs.submit``, ``jobs.claim``, ``jobs.finish``, ... : the public names of
the modules below, one concern each.

* ``submission``: ``submit`` / ``submit_many`` (row committed first, then enqueued); on PostgreSQL through
  ``pg_admission`` (one job) and ``pg_group`` (a tenant's group), on psycopg connections from ``connections``.
* ``quotas``: the token estimates, limits, exact checks and per-process bounds; ``prices``: the price version.
* ``lifecycle``: transitions, claim, heartbeat, finish, cancel (guarded conditional UPDATEs); ``pg_claim``: a
  worker's claim of a batch on PostgreSQL in one round trip.
* ``events``: a job's event stream; ``enqueue``: stream messages; ``reconcile``: queue repair.
* ``errors``: ``Conflict`` (409) and ``QuotaExceeded`` (429).
"""

from inferq.jobs.enqueue import (
    Unenqueueable,
    enqueue,
    enqueue_many,
    enqueued_key,
    queue_counts,
    queued_entries,
    tier_streams,
)
from inferq.jobs.errors import Conflict, JobError, QuotaExceeded
from inferq.jobs.events import (
    EVENT_DELTA,
    EVENT_DONE,
    EVENT_RESET,
    AttemptFilter,
    delta_event,
    done_event,
    final_text,
    publish_events,
    publish_reset,
    reset_event,
)
from inferq.jobs.lifecycle import (
    STATUS_FOR_FINISH,
    Outcome,
    cancel,
    claim,
    finish,
    heartbeat,
    owned_by,
    owner_of,
    record_first_tokens,
    stale_after_seconds,
    status_of,
    transition,
    worker_key,
)
from inferq.jobs.pg_claim import claim_many_postgres
from inferq.jobs.prices import current_price
from inferq.jobs.quotas import LEDGER_LAG_SECONDS, QUOTA_RECOUNT_SECONDS, estimate_tokens
from inferq.jobs.reconcile import ReconcileReport, reconcile, reconcile_lock_key
from inferq.jobs.submission import submit, submit_many

__all__ = [
    "EVENT_DELTA", "EVENT_DONE", "EVENT_RESET", "LEDGER_LAG_SECONDS", "QUOTA_RECOUNT_SECONDS", "STATUS_FOR_FINISH",
    "AttemptFilter", "Conflict", "JobError", "Outcome", "QuotaExceeded", "ReconcileReport", "Unenqueueable",
    "cancel", "claim", "claim_many_postgres", "current_price", "delta_event", "done_event", "enqueue", "enqueue_many", "enqueued_key",
    "queue_counts", "queued_entries", "tier_streams",
    "estimate_tokens", "final_text", "finish", "heartbeat", "owned_by", "owner_of", "publish_events", "publish_reset", "reconcile",
    "reconcile_lock_key", "record_first_tokens", "reset_event", "stale_after_seconds", "status_of", "submit", "submit_many",
    "transition", "worker_key",
]
