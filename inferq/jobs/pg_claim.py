"""A worker's claim of a batch of jobs on PostgreSQL in one round trip: the fast path of ``lifecycle.claim``.

The claim sits between a job's message arriving and its prefill starting, so its time is part of every job's
time to first token. Through the ORM session it was a pinged checkout, an ``UPDATE ... RETURNING`` per job and
a commit: three round trips or more, and the ORM's per-statement work. Here one statement claims the whole
batch and reports, for each job it did not take, the status that says why (alive elsewhere, or finished), on
the admission path's pooled psycopg connections (``connections``: no ping on checkout while the connection is
quiet), the statement and its commit sent together. The rules are ``lifecycle.claim``'s, unchanged: a queued
job, or a running one whose heartbeat is older than ``stale_seconds``, becomes this worker's next attempt.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from inferq.db import utcnow
from inferq.jobs.pg_admission import pooled_connection

# The CTE's UPDATE and the outer SELECT read the same snapshot: the SELECT sees the status a job had before
# this claim, which is what a job left unclaimed still has.
_PG_CLAIM = """
WITH claimed AS (
    UPDATE jobs SET status = 'running', attempts = attempts + 1, worker = %(worker)s,
                    started_at = %(now)s, heartbeat_at = %(now)s
    WHERE id = ANY(%(ids)s)
      AND (status = 'queued'
           OR (status = 'running' AND (heartbeat_at IS NULL OR heartbeat_at < %(cutoff)s)))
    RETURNING id, attempts, cancel_requested
)
SELECT j.id, j.status, c.attempts, c.cancel_requested
FROM jobs j LEFT JOIN claimed c ON c.id = j.id
WHERE j.id = ANY(%(ids)s)
"""


def claim_many_postgres(engine: Any, job_ids: Sequence[str], worker: str,
                        stale_seconds: float) -> tuple[dict[str, tuple[int, bool]], dict[str, str]]:
    """Claim ``job_ids`` for ``worker``, committed: ``({job_id: (attempt, cancel_requested)} of the jobs taken,
    {job_id: status} of the others that exist)``. A job in neither is not there. Database errors come out as
    SQLAlchemy's (an unreachable server as ``OperationalError``)."""
    now = utcnow()
    params = {"ids": list(dict.fromkeys(job_ids)), "worker": worker, "now": now,
              "cutoff": now - dt.timedelta(seconds=stale_seconds)}
    with pooled_connection(engine) as conn:
        with conn.pipeline():  # the statement and its commit in one round trip
            cur = conn.execute(_PG_CLAIM, params)
            conn.commit()
        rows = cur.fetchall()
    taken = {job_id: (int(attempt), bool(cancel)) for job_id, _, attempt, cancel in rows if attempt is not None}
    others = {job_id: status for job_id, status, attempt, _ in rows if attempt is None}
    return taken, others
