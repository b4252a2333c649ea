"""The worker process: Redis streams in, one ``LLMEngine`` per process, results and the ledger in SQL.

One loop, one thread (see docs/SERVICE.md):

1. heartbeat (every ``heartbeat_seconds``): ``XCLAIM ... JUSTID`` resets the idle time of this worker's
   pending messages (so a live worker is never robbed), ``jobs.heartbeat_at`` is refreshed (the answer also
   says which jobs were cancelled, or taken over by another worker), stats and queue metrics are updated;
2. cancellations from the ``cancel_channel`` pub/sub → ``engine.abort`` (reported by the next step);
3. database work that waits (starts, finalizations) is retried with exponential backoff;
4. admission: ``XAUTOCLAIM`` messages idle longer than ``claim_idle_ms`` (their worker is dead), then
   ``XREADGROUP`` interactive before batch, only as many as ``engine.capacity()`` admits; each message is
   decoded (bad ones go to the dead-letter stream), the job is claimed with a conditional UPDATE
   (``queued -> running``, or ``running -> running`` when the previous worker's heartbeat is stale) and
   becomes an engine ``Request``;
5. ``engine.step()``: text deltas go to the per-job event streams (one pipeline per step), first-token
   times to PostgreSQL (one UPDATE per step); finished requests are finalized: result row + ledger row +
   fenced status update in one transaction, then the final event, then XACK (+XDEL).

SIGTERM stops admission, lets in-flight jobs finish for ``shutdown_grace_seconds`` and hands the rest back
(``running -> queued`` + a fresh message); exit status 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis as redis_lib
import structlog
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from inferq import jobs
from inferq.contract import (
    MessageError,
    cancel_channel,
    dead_letter_key,
    decode_message,
    model_id,
    stream_key,
)
from inferq.db import make_engine, make_sessionmaker, utcnow
from inferq.log import configure_logging, get_logger
from inferq.settings import Settings, load_settings
from scheduler.request import FinishReason, Request, SamplingParams, Tier
from worker.metrics import WorkerMetrics
from worker.outputs import RequestOutput, Usage

log = get_logger("inferq.worker")

MAX_START_BATCH = 64  # messages claimed per loop iteration (keeps step latency bounded)
DB_BACKOFF_FIRST = 0.1
DB_BACKOFF_CAP = 5.0
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
class Message:
    stream: str
    msg_id: str
    raw: bytes | None
    msg: dict[str, Any] | None = None
    reclaimed: bool = False
    deleted: bool = False  # XAUTOCLAIM on Redis < 7 returns deleted entries without fields


@dataclass
class InFlight:
    job_id: str
    rid: str  # engine request id: job_id#attempt (a retried job never collides with a stale one)
    attempt: int
    message: Message
    tenant_id: str
    tier: str
    enqueued_at: float  # unix
    started_wall: float  # unix
    deadline_unix: float | None
    first_token_wall: float | None = None
    first_token_mono: float | None = None
    started_mono: float = field(default_factory=time.monotonic)
    ended: str | None = None  # why we aborted it: cancel | deadline | lost | abandon | handback
    log: Any = None


@dataclass
class Final:
    inf: InFlight
    outcome: jobs.Outcome
    finished_mono: float


class Worker:
    def __init__(self, settings: Settings, engine: Any = None, metrics_port: int | None = None) -> None:
        self.settings = settings
        self.name = settings.worker_name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.prefix = settings.stream_prefix
        self.group = settings.consumer_group
        self.model = model_id(settings.model)
        self.streams = [stream_key(self.prefix, self.model, "interactive"), stream_key(self.prefix, self.model, "batch")]
        self.stale_seconds = jobs.stale_after_seconds(settings)
        # a message is reclaimed after claim_idle_ms without a heartbeat; the job's database heartbeat was
        # written right after that last message heartbeat, so it is judged with a little slack
        self.claim_stale_seconds = max(0.1, min(self.stale_seconds, settings.claim_idle_ms / 1000) - min(
            0.5 * settings.heartbeat_seconds, 0.1 * settings.claim_idle_ms / 1000))
        self.redis = redis_lib.Redis.from_url(settings.redis_url, socket_timeout=30, socket_connect_timeout=5,
                                              health_check_interval=30)
        connect_args = {"connect_timeout": 5} if settings.database_url.startswith("postgresql") else None
        self.db_engine = (make_engine(settings.database_url, connect_args=connect_args) if connect_args
                          else make_engine(settings.database_url))
        self.sf = make_sessionmaker(self.db_engine)
        self.metrics = WorkerMetrics()
        self.metrics_port = metrics_port
        if engine is None:
            from worker.engine import LLMEngine  # torch is imported here, not at module import

            engine = LLMEngine(settings)
        self.engine = engine

        self.inflight: dict[str, InFlight] = {}  # by engine request id
        self.by_job: dict[str, str] = {}  # job_id -> rid
        self.start_q: list[Message] = []  # decoded messages waiting for their claim (database down)
        self.final_q: list[Final] = []  # finished requests waiting for their transaction
        self.pending_first: list[InFlight] = []  # first-token times not yet written
        self.stopping = False
        self.stop_deadline = 0.0
        self.finalized = 0
        self.db_down_since: float | None = None
        self.db_retry_at = 0.0
        self.db_backoff = 0.0
        self.next_heartbeat = 0.0
        self.next_autoclaim = 0.0
        self.next_reconcile = time.monotonic() + min(2.0, settings.reconcile_interval_seconds)
        self.pubsub: Any = None
        self.step_seconds = 0.0  # our own measurement, if the engine has no stats.busy_seconds
        self.log = log.bind(worker=self.name)

    # ------------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------------

    def _ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis_lib.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _subscribe(self) -> None:
        try:
            if self.pubsub is not None:
                self.pubsub.close()
            self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self.pubsub.subscribe(cancel_channel(self.prefix))
        except redis_lib.RedisError as exc:
            self.pubsub = None
            self.log.warning("cannot subscribe to cancellations (the heartbeat still polls them)", error=str(exc))

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            self.stop_deadline = time.monotonic() + self.settings.shutdown_grace_seconds
            self.log.info("stopping: no new jobs; finishing in-flight ones", signal=signum,
                          in_flight=len(self.inflight), grace_seconds=self.settings.shutdown_grace_seconds)

    # ------------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------------

    def run(self) -> int:
        structlog.contextvars.bind_contextvars(worker=self.name)
        if self.metrics_port:
            self.metrics.serve(self.metrics_port)
        if self.settings.heartbeat_seconds * 1000 >= self.settings.claim_idle_ms:
            self.log.warning("heartbeat_seconds should be well below claim_idle_ms, or live workers get robbed")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._ensure_groups()
        self._subscribe()
        self.log.info("worker started", model=self.model, streams=self.streams, group=self.group)
        redis_backoff = 0.0
        while True:
            now = time.monotonic()
            if self.stopping:
                if not self.inflight and not self.final_q and not self.start_q:
                    break
                if now >= self.stop_deadline:
                    self._hand_back()
                    break
            try:
                self._iteration(now)
                redis_backoff = 0.0
            except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:
                redis_backoff = min(max(redis_backoff * 2, 0.1), 5.0)
                self.log.error("redis unavailable; retrying", error=str(exc), retry_in=redis_backoff)
                time.sleep(redis_backoff)
        self._write_stats()
        self.log.info("worker stopped", finalized=self.finalized)
        return 0

    def _iteration(self, now: float) -> None:
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + self.settings.heartbeat_seconds
            self._heartbeat()
        self._poll_cancels()
        if (self.start_q or self.final_q or self.pending_first or self.db_down_since is not None) \
                and now >= self.db_retry_at:
            self._flush_db()
        admitted = 0
        if not self.stopping and self.db_down_since is None:
            idle = not self.engine.has_unfinished() and not self.final_q and not self.start_q
            admitted = self._admit(block=idle)
        if self.engine.has_unfinished():
            self._step()
        elif not admitted and (self.db_down_since is not None or self.stopping or self.final_q or self.start_q):
            time.sleep(0.05)
        if not self.stopping and now >= self.next_reconcile:
            self.next_reconcile = now + self.settings.reconcile_interval_seconds
            self._reconcile()

    # ------------------------------------------------------------------------------------------------
    # database access with outage handling
    # ------------------------------------------------------------------------------------------------

    def _db(self, fn: Any, *args: Any) -> Any:
        try:
            result = fn(*args)
        except Exception as exc:
            if not is_db_outage(exc):
                raise
            self._db_failed(exc)
            raise DBUnavailable(str(exc)) from exc
        if self.db_down_since is not None:
            self.log.info("database reachable again", down_seconds=round(time.monotonic() - self.db_down_since, 2))
            self.db_down_since = None
            self.db_backoff = 0.0
        return result

    def _db_failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self.metrics.db_errors.inc()
        if self.db_down_since is None:
            self.db_down_since = now
            self.log.error("database unavailable; holding work and retrying", error=str(exc).splitlines()[0])
        self.db_backoff = min(max(self.db_backoff * 2, DB_BACKOFF_FIRST), DB_BACKOFF_CAP)
        self.db_retry_at = now + self.db_backoff
        if now - self.db_down_since > self.settings.db_retry_max_seconds and (self.inflight or self.final_q or self.start_q):
            self._abandon_all()

    def _ping(self) -> None:
        with self.db_engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def _abandon_all(self) -> None:
        """Past ``db_retry_max_seconds`` of outage: drop local work without acknowledging it. The messages
        stay pending (no longer heartbeated) and are reclaimed once the database is back; the jobs' stale
        heartbeats let the reclaiming worker take them over. Nothing is lost; nothing stays running."""
        self.log.error("database down too long; abandoning in-flight jobs to reclaim",
                       in_flight=len(self.inflight), finalizing=len(self.final_q), starting=len(self.start_q))
        for inf in list(self.inflight.values()):
            inf.ended = "abandon"
            self.engine.abort(inf.rid)
            self._forget(inf)
        self.final_q.clear()
        self.start_q.clear()
        self.pending_first.clear()

    def _flush_db(self) -> None:
        try:
            if self.db_down_since is not None:
                self._db(self._ping)
                self._heartbeat_db()  # prove we still own our jobs before writing results
            if self.start_q:
                self._claim_and_add()
            if self.pending_first:
                self._write_first_tokens()
            if self.final_q:
                self._finalize()
        except DBUnavailable:
            pass

    # ------------------------------------------------------------------------------------------------
    # heartbeat, cancellation, stats
    # ------------------------------------------------------------------------------------------------

    def _held_messages(self) -> list[Message]:
        return ([inf.message for inf in self.inflight.values()] + [f.inf.message for f in self.final_q]
                + list(self.start_q))

    def _heartbeat(self) -> None:
        by_stream: dict[str, list[str]] = {}
        for m in self._held_messages():
            by_stream.setdefault(m.stream, []).append(m.msg_id)
        for stream, ids in by_stream.items():
            try:  # reset the idle time: XAUTOCLAIM elsewhere must not take these
                self.redis.xclaim(stream, self.group, self.name, 0, ids, justid=True)
            except redis_lib.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    self._ensure_groups()
        if self.db_down_since is None:
            try:
                self._heartbeat_db()
            except DBUnavailable:
                pass
        self._write_stats()
        self._queue_metrics()

    def _heartbeat_db(self) -> None:
        ids = [inf.job_id for inf in self.inflight.values()] + [f.inf.job_id for f in self.final_q]
        if not ids:
            return

        def beat() -> dict[str, tuple[int, bool]]:
            with self.sf() as s:
                owned = jobs.heartbeat(s, self.name, ids)
                s.commit()
                return owned

        owned = self._db(beat)
        for inf in list(self.inflight.values()):
            got = owned.get(inf.job_id)
            if got is None or got[0] != inf.attempt:
                if inf.ended != "lost":
                    inf.log.warning("job taken over by another worker or finished elsewhere; dropping it")
                    inf.ended = "lost"
                    self.engine.abort(inf.rid)
            elif got[1] and inf.ended is None:
                inf.log.info("cancel requested (flag)")
                inf.ended = "cancel"
                self.engine.abort(inf.rid, FinishReason.ABORT)

    def _poll_cancels(self) -> None:
        if self.pubsub is None:
            return
        try:
            while True:
                msg = self.pubsub.get_message(timeout=0)
                if msg is None:
                    break
                if msg.get("type") != "message":
                    continue
                data = msg["data"]
                job_id = data.decode() if isinstance(data, bytes) else str(data)
                rid = self.by_job.get(job_id)
                inf = self.inflight.get(rid) if rid else None
                if inf is not None and inf.ended is None:
                    inf.log.info("cancel requested")
                    inf.ended = "cancel"
                    self.engine.abort(inf.rid, FinishReason.ABORT)
        except redis_lib.RedisError as exc:
            self.log.warning("cancel subscription lost; resubscribing", error=str(exc))
            self._subscribe()

    def busy_seconds(self) -> float:
        stats = getattr(self.engine, "stats", None)
        value = getattr(stats, "busy_seconds", None)
        return float(value) if isinstance(value, (int, float)) else self.step_seconds

    def _stats_mapping(self) -> dict[str, Any]:
        return {"busy_seconds": repr(self.busy_seconds()), "in_flight": len(self.inflight) + len(self.final_q),
                "finalized": self.finalized, "pid": os.getpid(), "model": self.model,
                "updated_at": repr(time.time())}

    def _write_stats(self, pipe: Any = None) -> None:
        """The worker's live numbers in ``jobs.worker_key`` (a Redis hash, kept a day)."""
        key = jobs.worker_key(self.prefix, self.name)
        try:
            p = pipe if pipe is not None else self.redis.pipeline(transaction=False)
            p.hset(key, mapping=self._stats_mapping())
            p.expire(key, 86400)
            if pipe is None:
                p.execute()
        except redis_lib.RedisError as exc:
            self.log.warning("cannot write worker stats", error=str(exc))
        self.metrics.engine_stats(self.engine)
        self.metrics.inflight.set(len(self.inflight) + len(self.final_q))

    def _queue_metrics(self) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for stream in self.streams:
                pipe.xlen(stream)
                pipe.xrange(stream, count=1)
                pipe.xpending(stream, self.group)
            res = pipe.execute(raise_on_error=False)
        except redis_lib.RedisError:
            return
        now_ms = time.time() * 1000
        for i, stream in enumerate(self.streams):
            depth, first, pending = res[3 * i: 3 * i + 3]
            if isinstance(depth, int):
                self.metrics.queue_depth.labels(stream).set(depth)
            if isinstance(first, list):
                age = 0.0
                if first:
                    mid = first[0][0].decode() if isinstance(first[0][0], bytes) else first[0][0]
                    age = max(0.0, (now_ms - int(mid.split("-")[0])) / 1000)
                self.metrics.queue_oldest_age.labels(stream).set(age)
            if isinstance(pending, dict):
                self.metrics.queue_pending.labels(stream).set(pending.get("pending", 0))

    # ------------------------------------------------------------------------------------------------
    # admission
    # ------------------------------------------------------------------------------------------------

    def _admit(self, block: bool) -> int:
        cap = self.engine.capacity()
        n = min(cap.requests if cap.tokens > 0 else 0, MAX_START_BATCH) - len(self.start_q)
        if n <= 0:
            return 0
        got: list[Message] = []
        try:
            now = time.monotonic()
            if now >= self.next_autoclaim:
                self.next_autoclaim = now + max(0.2, min(self.settings.heartbeat_seconds, self.settings.claim_idle_ms / 2000))
                got += self._autoclaim(n)
            for stream in self.streams:  # interactive first
                want = n - len(got)
                if want <= 0:
                    break
                got += self._read({stream: ">"}, want, None)
            if not got and block:
                block_ms = int(max(50, min(500, self.settings.heartbeat_seconds * 500)))
                got += self._read({s: ">" for s in self.streams}, 1, block_ms)
        except redis_lib.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.log.warning("consumer group missing (Redis flushed?); recreating it")
            self._ensure_groups()
        if got:
            self._accept(got)
        return len(got)

    def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[Message]:
        resp = self.redis.xreadgroup(self.group, self.name, streams, count=count, block=block)
        out = []
        for stream, entries in resp or []:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            for mid, fields in entries:
                out.append(Message(stream, mid.decode() if isinstance(mid, bytes) else mid,
                                   (fields or {}).get(b"m")))
        return out

    def _autoclaim(self, n: int) -> list[Message]:
        held = {(m.stream, m.msg_id) for m in self._held_messages()}
        out: list[Message] = []
        for stream in self.streams:
            if len(out) >= n:
                break
            resp = self.redis.xautoclaim(stream, self.group, self.name, self.settings.claim_idle_ms,
                                         start_id="0-0", count=n - len(out))
            for mid, fields in resp[1]:
                mid = mid.decode() if isinstance(mid, bytes) else mid
                if (stream, mid) in held:
                    continue
                out.append(Message(stream, mid, (fields or {}).get(b"m"), reclaimed=True, deleted=fields is None))
        if out:
            self.metrics.reclaimed.inc(len(out))
            self.log.info("reclaimed idle messages", count=len(out))
        return out

    def _ack(self, pipe: Any, m: Message, job_id: str | None) -> None:
        pipe.xack(m.stream, self.group, m.msg_id)
        pipe.xdel(m.stream, m.msg_id)
        if job_id:
            pipe.srem(jobs.enqueued_key(self.prefix), job_id)

    def _accept(self, msgs: list[Message]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        bad = 0
        for m in msgs:
            if m.deleted:
                bad += 1
                self._ack(pipe, m, None)
                continue
            try:
                if m.raw is None:
                    raise MessageError("no 'm' field")
                m.msg = decode_message(m.raw)
            except MessageError as exc:
                bad += 1
                self.metrics.dead_letters.inc()
                self.log.error("malformed message dead-lettered", stream=m.stream, msg_id=m.msg_id, error=str(exc))
                pipe.xadd(dead_letter_key(self.prefix), {"stream": m.stream, "msg_id": m.msg_id, "error": str(exc),
                                                          "worker": self.name, "m": m.raw or b""})
                self._ack(pipe, m, None)
                continue
            self.start_q.append(m)
        if bad:
            pipe.execute()
        if self.start_q:
            try:
                self._claim_and_add()
            except DBUnavailable:
                pass

    def _claim_and_add(self) -> None:
        """Claim the queued messages' jobs in one transaction, then hand them to the engine."""
        batch = list(self.start_q)
        now_unix = time.time()

        def claim_all() -> tuple[list[tuple[Message, int, bool]], list[tuple[Message, jobs.Outcome]], list[Message], list[Message]]:
            started, expired, gone, busy = [], [], [], []
            with self.sf() as s:
                for m in batch:
                    job_id = m.msg["job_id"]
                    deadline = m.msg.get("deadline")
                    if deadline is not None and deadline <= now_unix:
                        outcome = jobs.Outcome(status="expired", finish_reason="deadline",
                                               error="deadline passed while queued")
                        if jobs.finish(s, job_id, outcome, from_statuses=("queued",)):
                            expired.append((m, outcome))
                            continue
                    got = jobs.claim(s, job_id, self.name, self.claim_stale_seconds)
                    if got is not None:
                        started.append((m, got[0], got[1]))
                    elif jobs.status_of(s, job_id) in ("running", "queued"):
                        busy.append(m)
                    else:
                        gone.append(m)
                s.commit()
            return started, expired, gone, busy

        started, expired, gone, busy = self._db(claim_all)
        for m in busy:  # alive on another worker: leave the message pending (un-heartbeated) for later
            self.log.info("job is running on a live worker; message left pending", job_id=m.msg["job_id"],
                          msg_id=m.msg_id)
        self.start_q = [m for m in self.start_q if m not in batch]
        pipe = self.redis.pipeline(transaction=False)
        for m, outcome in expired:
            self.log.info("job expired in the queue", job_id=m.msg["job_id"])
            jobs.publish_events(pipe, self.settings, m.msg["job_id"], jobs.done_event(outcome))
            self.metrics.job_finished(m.msg["tier"], "expired", prompt=0, cached=0, completion=0, queue=None,
                                      ttft=None, tpot=None, e2e=now_unix - (m.msg.get("enqueued_at") or now_unix))
            self._ack(pipe, m, m.msg["job_id"])
        for m in gone:  # cancelled, finished or expired already, or alive on another worker
            self.log.info("message for a job not claimable; acknowledged", job_id=m.msg["job_id"], msg_id=m.msg_id)
            self._ack(pipe, m, m.msg["job_id"])
        if expired or gone:
            pipe.execute()
        for m, attempt, cancel_requested in started:
            self._add_to_engine(m, attempt, cancel_requested)

    def _add_to_engine(self, m: Message, attempt: int, cancel_requested: bool) -> None:
        msg = m.msg
        job_id = msg["job_id"]
        now_unix, now_mono = time.time(), time.monotonic()
        inf = InFlight(job_id=job_id, rid=f"{job_id}#{attempt}", attempt=attempt, message=m,
                       tenant_id=msg["tenant_id"], tier=msg["tier"],
                       enqueued_at=float(msg.get("enqueued_at") or now_unix), started_wall=now_unix,
                       deadline_unix=msg.get("deadline"),
                       log=self.log.bind(job_id=job_id, tenant=msg["tenant_id"], attempt=attempt))
        self.metrics.queue_time.labels(inf.tier).observe(max(0.0, now_unix - inf.enqueued_at))
        if attempt > 1:
            inf.log.info("job restarted", reclaimed=m.reclaimed)
        p = msg["request"]
        try:
            prompt_kw = {k: p[k] for k in ("prompt", "messages", "prompt_ids") if p.get(k) is not None}
            ids = self.engine.encode(**prompt_kw)
            sampling = SamplingParams(
                max_tokens=int(p.get("max_tokens", 256)), temperature=float(p.get("temperature", 1.0)),
                top_p=float(p.get("top_p", 1.0)), top_k=int(p.get("top_k", 0)), seed=p.get("seed"),
                stop=list(p.get("stop") or []), stop_token_ids=list(p.get("stop_token_ids") or []),
                ignore_eos=bool(p.get("ignore_eos", False)))
            deadline = None
            if inf.deadline_unix is not None:
                deadline = now_mono + (inf.deadline_unix - now_unix)
            req = Request(request_id=inf.rid, prompt_token_ids=list(ids), sampling=sampling, tier=Tier(inf.tier),
                          priority=int(msg.get("priority", 0)), arrival_time=now_mono - max(0.0, now_unix - inf.enqueued_at),
                          deadline=deadline, cache_namespace=str(msg.get("ns", "")))
            self.engine.add_request(req)
        except Exception as exc:  # cannot run: tokenization failed, too long for the model, bad parameters...
            inf.log.warning("job rejected by the engine", error=str(exc))
            self.final_q.append(Final(inf, jobs.Outcome(status="failed", finish_reason="error", error=str(exc)),
                                      time.monotonic()))
            return
        self.inflight[inf.rid] = inf
        self.by_job[job_id] = inf.rid
        inf.log.info("job started", tier=inf.tier, prompt_tokens=len(ids))
        if cancel_requested:
            inf.ended = "cancel"
            self.engine.abort(inf.rid, FinishReason.ABORT)

    # ------------------------------------------------------------------------------------------------
    # stepping and finishing
    # ------------------------------------------------------------------------------------------------

    def _step(self) -> None:
        t0 = time.monotonic()
        outputs: list[RequestOutput] = self.engine.step()
        now_mono = time.monotonic()
        self.step_seconds += now_mono - t0
        now_unix = time.time()
        pipe = self.redis.pipeline(transaction=False)
        publish = False
        for out in outputs:
            inf = self.inflight.get(out.request_id)
            if inf is None:
                continue
            if inf.first_token_wall is None and out.new_token_ids:
                inf.first_token_wall, inf.first_token_mono = now_unix, now_mono
                self.pending_first.append(inf)
                self.metrics.ttft.labels(inf.tier).observe(max(0.0, now_unix - inf.enqueued_at))
            if out.text_delta and inf.ended not in ("lost", "abandon"):
                jobs.publish_events(pipe, self.settings, inf.job_id, jobs.delta_event(out.text_delta, out.new_token_ids))
                publish = True
            if out.finished:
                self._on_finished(inf, out, now_mono)
        if publish:
            try:
                pipe.execute()
            except redis_lib.RedisError as exc:
                self.log.warning("could not publish text deltas", error=str(exc))
        if self.db_down_since is None and (self.pending_first or self.final_q):
            self._flush_db()

    def _forget(self, inf: InFlight) -> None:
        self.inflight.pop(inf.rid, None)
        if self.by_job.get(inf.job_id) == inf.rid:
            del self.by_job[inf.job_id]

    def _on_finished(self, inf: InFlight, out: RequestOutput, now_mono: float) -> None:
        self._forget(inf)
        if inf.ended in ("lost", "abandon", "handback"):
            return  # another worker owns the job now (or will): no result, no ack
        reason = out.finish_reason.value if out.finish_reason is not None else "stop"
        status = jobs.STATUS_FOR_FINISH.get(reason, "failed")
        error = out.error
        if reason == "abort" and inf.ended == "deadline":
            status, reason = "expired", "deadline"
        if status == "cancelled":
            error = error or "cancelled"
        elif status == "expired":
            error = error or "deadline passed"
        usage = out.usage or Usage()
        if status != "succeeded" and usage.compute_seconds == 0 and not usage.completion_tokens:
            usage = Usage()  # ended before anything was computed: nothing to pay
        first = (dt.datetime.fromtimestamp(inf.first_token_wall, dt.timezone.utc)
                 if inf.first_token_wall is not None else None)
        outcome = jobs.Outcome(
            status=status, text=out.text or "", finish_reason=reason, token_ids=list(out.token_ids or []),
            prompt_tokens=usage.prompt_tokens, cached_prompt_tokens=usage.cached_prompt_tokens,
            completion_tokens=usage.completion_tokens, compute_seconds=float(usage.compute_seconds),
            error=error, first_token_at=first)
        self.final_q.append(Final(inf, outcome, now_mono))

    def _write_first_tokens(self) -> None:
        batch = [inf for inf in self.pending_first if inf.rid in self.inflight]

        def write() -> None:
            if not batch:
                return
            ts = {inf.job_id: dt.datetime.fromtimestamp(inf.first_token_wall, dt.timezone.utc) for inf in batch}
            with self.sf() as s:
                jobs.record_first_tokens(s, ts)
                s.commit()

        self._db(write)
        self.pending_first.clear()  # finished ones carry first_token_at in their final update

    def _finalize(self) -> None:
        """For each finished request: result row + ledger row + fenced status update in ONE transaction;
        then (after all commits) the final events and the XACKs in one pipeline."""
        done: list[tuple[Final, bool]] = []
        try:
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
                        ok = self._db(one)
                    except DBUnavailable:
                        try:
                            s.rollback()
                        except Exception:
                            pass
                        raise
                    self.final_q.remove(f)
                    done.append((f, ok))
        finally:
            if done:
                self._after_finalize(done)

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
        on its rows): record the job as failed with the reason, an empty result and its ledger row, so its message is acknowledged and the worker goes on with the others. If even
        that is refused, the status alone. Fenced like any finish; an outage propagates (retried later)."""
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
                                 compute_seconds=o.compute_seconds, first_token_at=o.first_token_at)
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

    def _after_finalize(self, done: list[tuple[Final, bool]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        now_unix = time.time()
        for f, ok in done:
            inf, o = f.inf, f.outcome
            if not ok:
                inf.log.warning("job no longer ours (taken over, or finished elsewhere); result discarded")
                continue
            self.finalized += 1
            jobs.publish_events(pipe, self.settings, inf.job_id, jobs.done_event(o))
            self._ack(pipe, inf.message, inf.job_id)
            tpot = None
            if inf.first_token_mono is not None and o.completion_tokens > 1:
                tpot = (f.finished_mono - inf.first_token_mono) / (o.completion_tokens - 1)
            self.metrics.job_finished(inf.tier, o.status, prompt=o.prompt_tokens, cached=o.cached_prompt_tokens,
                                      completion=o.completion_tokens, queue=None,
                                      ttft=None, tpot=tpot, e2e=now_unix - inf.enqueued_at)
            inf.log.info("job finished", status=o.status, finish_reason=o.finish_reason,
                         prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens,
                         compute_seconds=round(o.compute_seconds, 6))
        self._write_stats(pipe)
        try:
            pipe.execute()
        except redis_lib.RedisError as exc:  # committed already; the message is re-read and acknowledged later
            self.log.warning("could not publish final events / acknowledge", error=str(exc))

    # ------------------------------------------------------------------------------------------------
    # deadlines are the engine's (Request.deadline); reconcile; shutdown
    # ------------------------------------------------------------------------------------------------

    def _reconcile(self) -> None:
        if self.db_down_since is not None:
            return
        try:
            lock = jobs.reconcile_lock_key(self.prefix)
            ttl_ms = max(100, int(self.settings.reconcile_interval_seconds * 900))
            if not self.redis.set(lock, self.name, nx=True, px=ttl_ms):
                return  # another worker reconciles this interval
            jobs.reconcile(self.sf, self.redis, self.settings, stale_seconds=self.stale_seconds)
        except Exception as exc:
            if is_db_outage(exc):
                self._db_failed(exc)
            self.log.warning("reconcile failed", error=str(exc).splitlines()[0] if str(exc) else repr(exc))

    def _hand_back(self) -> None:
        """Grace period over: give the unfinished jobs back to the queue (running -> queued + a new message)."""
        infs = list(self.inflight.values())
        for inf in infs:
            inf.ended = "handback"
            self.engine.abort(inf.rid)
            self._forget(inf)
        if self.final_q and self.db_down_since is None:
            try:
                self._finalize()  # results that are ready still land
            except DBUnavailable:
                pass
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
            self._db(give_back)
        except DBUnavailable:
            returned.clear()  # leave the messages pending: they are reclaimed once their heartbeat is stale
        pipe = self.redis.pipeline(transaction=True)
        for inf in returned:
            pipe.xadd(inf.message.stream, {"m": inf.message.raw})
            pipe.sadd(jobs.enqueued_key(self.prefix), inf.job_id)
            self._ack(pipe, inf.message, None)
        for m in self.start_q:  # never claimed: still queued in the database, just put the message back
            pipe.xadd(m.stream, {"m": m.raw})
            self._ack(pipe, m, None)
        self.start_q.clear()
        try:
            pipe.execute()
        except redis_lib.RedisError as exc:
            self.log.warning("hand-back to Redis failed; the reconciler will re-add the jobs", error=str(exc))
        self.metrics.handed_back.inc(len(returned))
        self.log.info("handed jobs back to the queue", returned=len(returned), left_pending=len(infs) - len(returned))


def run_worker(settings: Settings, metrics_port: int | None = None, engine: Any = None) -> int:
    """Run one worker process until SIGTERM/SIGINT; returns the exit status."""
    configure_logging(settings.log_level, settings.log_json)
    return Worker(settings, engine=engine, metrics_port=metrics_port).run()


def exit_now(code: int) -> None:
    """Leave without the interpreter teardown of torch/transformers (seconds under load): everything
    that matters (database commits, Redis acknowledgements) is done; flush the logs and go."""
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.service", description="inferq worker (settings from INFERQ_*)")
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--name", default=None, help="worker name (default: host-pid-random)")
    args = parser.parse_args(argv)
    overrides = {"worker_name": args.name} if args.name else {}
    return run_worker(load_settings(**overrides), metrics_port=args.metrics_port)


if __name__ == "__main__":
    exit_now(main())
