"""The worker's database side: claims, heartbeats, first-token times, fenced finalization, hand-back, the
reconciler's turn, and waiting out database outages. All SQL goes through ``inferq.jobs``.

Work that needs the database waits here while it is down: ``start_q`` (decoded messages whose job is not
claimed yet), ``final_q`` (finished jobs whose result is not written yet) and ``pending_first`` (first-token
times). ``call`` runs one database operation; a connection-level failure (``is_db_outage``) becomes
``DBUnavailable`` for the caller, which keeps its work, and the next try is scheduled with exponential back-off
(0.1 s doubling, at most 5 s). Past ``db_retry_max_seconds`` of outage ``on_give_up`` is called: the worker
drops the work it has not done without acknowledging it (the messages are reclaimed once the database is
back), but keeps the results it has computed (``abandon``: at most ``MAX_HELD_RESULTS``, their messages still
heartbeated) and writes them when the database returns instead of having them computed again. Those writes
are fenced like any other: a job another worker took over meanwhile refuses its late result.

Finishing a job is ONE transaction: fenced status update (``attempts``/``worker``: a worker whose job was
taken over cannot write) + result row + ledger row. A result PostgreSQL refuses for that one job (SQLSTATE
classes 22/23) fails only that job (``could not store the result: ...``); the worker goes on.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from inferq import jobs
from inferq.db import make_engine, make_sessionmaker, utcnow
from inferq.settings import Settings
from worker.driver import Final, InFlight
from worker.metrics import WorkerMetrics
from worker.streams import Message

DB_BACKOFF_FIRST = 0.1
DB_BACKOFF_CAP = 5.0
# finished results held through an outage longer than db_retry_max_seconds (memory: each holds its text and
# token ids); beyond it the newest are dropped, their messages reclaimed and the jobs computed again
MAX_HELD_RESULTS = 1000
# errors about one job's rows (SQLSTATE classes 22 and 23): that job fails, the worker goes on
ROW_ERRORS = (DataError, IntegrityError)


class DBUnavailable(Exception):
    """The database did not answer; the caller keeps its work and retries later."""


def is_db_outage(exc: BaseException) -> bool:
    """Connection-level database failures (as opposed to bugs or constraint violations)."""
    if isinstance(exc, PoolTimeout):
        return True
    if isinstance(exc, IntegrityError):
        return False
    if isinstance(exc, DBAPIError):
        name = type(exc).__name__
        return exc.connection_invalidated or name in ("OperationalError", "InterfaceError")
    return isinstance(exc, (ConnectionError, OSError))


@dataclass
class Claims:
    """What claiming a batch of messages found, per message."""

    started: list[tuple[Message, int, bool]] = field(default_factory=list)  # (message, attempt, cancel_requested)
    expired: list[tuple[Message, jobs.Outcome]] = field(default_factory=list)  # deadline passed in the queue
    gone: list[Message] = field(default_factory=list)  # cancelled, finished or expired already
    busy: list[Message] = field(default_factory=list)  # running on a live worker


class JobStore:
    """This worker's (``name``) job rows, with the outage state and the work waiting for the database."""

    def __init__(self, settings: Settings, name: str, metrics: WorkerMetrics, log: Any,
                 on_give_up: Callable[[], None]) -> None:
        self.settings = settings
        self.name = name
        self.metrics = metrics
        self.log = log
        self.on_give_up = on_give_up
        self.stale_seconds = jobs.stale_after_seconds(settings)
        # a message is reclaimed after claim_idle_ms without a heartbeat; the job's database heartbeat was
        # written right after that last message heartbeat, so it is judged with a little slack
        self.claim_stale_seconds = max(0.1, min(self.stale_seconds, settings.claim_idle_ms / 1000) - min(
            0.5 * settings.heartbeat_seconds, 0.1 * settings.claim_idle_ms / 1000))
        connect_args = {"connect_timeout": 5} if settings.database_url.startswith("postgresql") else None
        self.db_engine = (make_engine(settings.database_url, connect_args=connect_args) if connect_args
                          else make_engine(settings.database_url))
        self.sf = make_sessionmaker(self.db_engine)
        self.start_q: list[Message] = []  # decoded messages waiting for their claim (database down)
        self.final_q: list[Final] = []  # finished requests waiting for their transaction
        self.pending_first: list[InFlight] = []  # first-token times not yet written
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.backoff = 0.0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    # --- outage handling -------------------------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; an outage raises ``DBUnavailable`` (and schedules the retry), other errors propagate."""
        try:
            result = fn(*args)
        except Exception as exc:
            if not is_db_outage(exc):
                raise
            self.failed(exc)
            raise DBUnavailable(str(exc)) from exc
        if self.down_since is not None:
            self.log.info("database reachable again", down_seconds=round(time.monotonic() - self.down_since, 2))
            self.down_since = None
            self.backoff = 0.0
        return result

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self.metrics.db_errors.inc()
        if self.down_since is None:
            self.down_since = now
            self.log.error("database unavailable; holding work and retrying", error=str(exc).splitlines()[0])
        self.backoff = min(max(self.backoff * 2, DB_BACKOFF_FIRST), DB_BACKOFF_CAP)
        self.retry_at = now + self.backoff
        if now - self.down_since > self.settings.db_retry_max_seconds:
            self.on_give_up()

    def ping(self) -> None:
        """Raises while the database is unreachable: checking a connection out pings it (``make_engine`` sets
        ``pool_pre_ping``) or opens a new one."""
        with self.db_engine.connect():
            pass

    # --- claims, heartbeats, first tokens ----------------------------------------------------------------

    def claim(self, batch: list[Message], now_unix: float) -> Claims:
        """Claim the jobs of ``batch`` in one transaction (messages past their deadline expire instead). On
        PostgreSQL a batch with none past its deadline is one round trip (``jobs.claim_many_postgres``)."""
        expiring = any(m.job is not None and m.job.deadline is not None and m.job.deadline <= now_unix
                       for m in batch)
        if self.db_engine.dialect.name == "postgresql" and not expiring:
            return self.call(self._claim_postgres, batch)

        def claim_all() -> Claims:
            found = Claims()
            with self.sf() as s:
                for m in batch:
                    job = m.job
                    assert job is not None
                    if job.deadline is not None and job.deadline <= now_unix:
                        outcome = jobs.Outcome(status="expired", finish_reason="deadline",
                                               error="deadline passed while queued")
                        if jobs.finish(s, job.job_id, outcome, from_statuses=("queued",)):
                            found.expired.append((m, outcome))
                            continue
                    got = jobs.claim(s, job.job_id, self.name, self.claim_stale_seconds)
                    if got is not None:
                        found.started.append((m, got[0], got[1]))
                    elif jobs.status_of(s, job.job_id) in ("running", "queued"):
                        found.busy.append(m)
                    else:
                        found.gone.append(m)
                s.commit()
            return found

        return self.call(claim_all)

    def _claim_postgres(self, batch: list[Message]) -> Claims:
        taken, others = jobs.claim_many_postgres(self.db_engine, [m.job.job_id for m in batch], self.name,
                                                 self.claim_stale_seconds)
        found = Claims()
        for m in batch:
            job_id = m.job.job_id
            if job_id in taken:  # a job twice in one batch: its second message finds it running, as busy
                found.started.append((m, *taken.pop(job_id)))
                others[job_id] = "running"
            elif others.get(job_id) in ("running", "queued"):
                found.busy.append(m)
            else:
                found.gone.append(m)
        return found

    def heartbeat(self, job_ids: list[str]) -> dict[str, tuple[int, bool]]:
        """Refresh the jobs' heartbeats; {job_id: (attempt, cancel_requested)} of those this worker still owns."""
        if not job_ids:
            return {}

        def beat() -> dict[str, tuple[int, bool]]:
            with self.sf() as s:
                owned = jobs.heartbeat(s, self.name, job_ids)
                s.commit()
                return owned

        return self.call(beat)

    def write_first_tokens(self, running: Container[str]) -> None:
        """One UPDATE for the pending first-token times of the jobs still ``running`` (engine request ids);
        finished ones carry first_token_at in their final update."""
        batch = [inf for inf in self.pending_first if inf.rid in running]

        def write() -> None:
            if not batch:
                return
            ts = {inf.job_id: dt.datetime.fromtimestamp(inf.first_token_wall, dt.timezone.utc) for inf in batch}
            with self.sf() as s:
                jobs.record_first_tokens(s, ts)
                s.commit()

        self.call(write)
        self.pending_first.clear()

    # --- finishing -------------------------------------------------------------------------------------------

    def finalize(self, done: list[tuple[Final, bool]]) -> None:
        """Write each job of ``final_q``, one transaction each, appending ``(final, written)`` to ``done`` as it
        goes (``written`` False: the job is no longer ours, the result is discarded). On an outage the rest stay
        queued and ``DBUnavailable`` propagates; what is in ``done`` is committed either way."""
        with self.sf() as s:
            for f in list(self.final_q):
                def one(f: Final = f) -> bool:
                    try:
                        if jobs.finish(s, f.inf.job_id, f.outcome, from_statuses=("running",),
                                       attempt=f.inf.attempt, worker=self.name):
                            s.commit()
                            return True
                    except ROW_ERRORS as exc:  # this job's row cannot be stored (outages are not these)
                        s.rollback()
                        return self._fail_unstorable(s, f, exc)
                    s.rollback()
                    return self._written_already(s, f)

                try:
                    ok = self.call(one)
                except DBUnavailable:
                    try:
                        s.rollback()
                    except Exception:
                        pass
                    raise
                self.final_q.remove(f)
                done.append((f, ok))

    def _job_row(self, s: Any, f: Final) -> tuple[str, str | None, int] | None:
        row = jobs.owner_of(s, f.inf.job_id)
        s.rollback()
        return row

    def _written_already(self, s: Any, f: Final) -> bool:
        """A commit whose acknowledgement was lost in an outage: the row already says what we meant."""
        row = self._job_row(s, f)
        return row == (f.outcome.status, self.name, f.inf.attempt)

    def _fail_unstorable(self, s: Any, f: Final, exc: BaseException) -> bool:
        """The result of this one job cannot be written (a value PostgreSQL refuses, a constraint or trigger
        on its rows): record the job as failed with the reason, an empty result and its ledger row, so its
        message is acknowledged and the worker goes on with the others. If even that is refused, the status
        alone. Fenced like any finish; an outage propagates (retried later)."""
        if self._written_already(s, f):
            return True
        row = self._job_row(s, f)
        if row != ("running", self.name, f.inf.attempt):
            return False  # not ours any more: discarded like any fenced-out result
        orig = getattr(exc, "orig", None) or exc
        detail = (str(orig).strip().splitlines() or [""])[0]
        reason = f"could not store the result: {type(orig).__name__}: {detail}"[:1000].replace("\x00", "\ufffd")
        f.inf.log.error("job result could not be stored; marking the job failed", error=reason)
        self.metrics.result_write_errors.inc()
        o = f.outcome  # billed like any failed job: for what was computed
        f.outcome = jobs.Outcome(status="failed", finish_reason="error", error=reason, prompt_tokens=o.prompt_tokens,
                                 cached_prompt_tokens=o.cached_prompt_tokens, completion_tokens=o.completion_tokens,
                                 compute_seconds=o.compute_seconds, first_token_at=o.first_token_at,
                                 spec_proposed_tokens=o.spec_proposed_tokens,
                                 spec_accepted_tokens=o.spec_accepted_tokens)
        fence = jobs.owned_by(f.inf.attempt, self.name)
        try:
            ok = jobs.finish(s, f.inf.job_id, f.outcome, from_statuses=("running",),
                             attempt=f.inf.attempt, worker=self.name)
            if ok:
                s.commit()
                return True
        except ROW_ERRORS as again:
            s.rollback()
            f.inf.log.error("could not store the failed job's result row either; status only", error=str(again)[:300])
            ok = jobs.transition(s, f.inf.job_id, "running", "failed", where=fence, error=reason)
            if ok:
                s.commit()
                return True
        s.rollback()
        return self._written_already(s, f)

    # --- long outages, shutdown and repair --------------------------------------------------------------------

    def abandon(self) -> None:
        """The database has been down past ``db_retry_max_seconds``: forget the claims not made and the
        first-token times (their messages are reclaimed later), keep the finished results (bounded)."""
        self.start_q.clear()
        self.pending_first.clear()
        if len(self.final_q) > MAX_HELD_RESULTS:
            dropped = self.final_q[MAX_HELD_RESULTS:]
            del self.final_q[MAX_HELD_RESULTS:]
            self.log.warning("too many results held through the outage; the newest will be computed again",
                             held=len(self.final_q), dropped=len(dropped))


    def give_back(self, infs: list[InFlight]) -> list[InFlight]:
        """``running -> queued`` (fenced on our attempt) for ``infs``; returns those given back, none while the
        database is down (their messages stay pending and are reclaimed once their heartbeat is stale)."""
        returned: list[InFlight] = []

        def give_back() -> None:
            with self.sf() as s:
                for inf in infs:
                    if jobs.transition(s, inf.job_id, ("running",), "queued",
                                       where=jobs.owned_by(inf.attempt, self.name),
                                       worker=None, queued_at=utcnow()):
                        returned.append(inf)
                s.commit()

        try:
            self.call(give_back)
        except DBUnavailable:
            returned.clear()
        return returned

    def reconcile(self, redis: Any) -> None:
        """``jobs.reconcile``, by one worker per interval (a Redis lock); failures are logged, outages noted."""
        if self.down:
            return
        try:
            lock = jobs.reconcile_lock_key(self.settings.stream_prefix)
            ttl_ms = max(100, int(self.settings.reconcile_interval_seconds * 900))
            if not redis.set(lock, self.name, nx=True, px=ttl_ms):
                return  # another worker reconciles this interval
            jobs.reconcile(self.sf, redis, self.settings, stale_seconds=self.stale_seconds)
        except Exception as exc:
            if is_db_outage(exc):
                self.failed(exc)
            self.log.warning("reconcile failed", error=str(exc).splitlines()[0] if str(exc) else repr(exc))
