"""The worker process: Redis streams in, one ``LLMEngine`` per process, results and the ledger in SQL.

``Worker`` is the loop; its collaborators each own one side (docs/SERVICE.md):

* ``worker/streams.py`` (``StreamConsumer``): the consumer group: read only what the engine has room for,
  autoclaim, keep-alive, ack, dead letters, the cancel channel, queue metrics;
* ``worker/jobstore.py`` (``JobStore``): the job rows (all SQL through ``inferq.jobs``): claims, heartbeats,
  first-token times, the fenced finalize, hand-back, reconcile, and the database-outage back-off;
* ``worker/driver.py`` (``EngineDriver``): the engine: jobs in as requests, steps, deltas and finished jobs out.

One loop, one thread:

1. heartbeat (every ``heartbeat_seconds``): ``XCLAIM ... JUSTID`` resets the idle time of this worker's
   pending messages (so a live worker is never robbed), ``jobs.heartbeat_at`` is refreshed (the answer also
   says which jobs were cancelled, or taken over by another worker), stats and queue metrics are updated;
2. cancellations from the ``cancel_channel`` pub/sub → ``engine.abort`` (reported by the next step);
3. database work that waits (starts, finalizations) is retried with exponential backoff;
4. admission: ``XAUTOCLAIM`` messages idle longer than ``claim_idle_ms`` (their worker is dead), then
   ``XREADGROUP`` interactive before batch, round-robin over tenant lanes, as many as ``engine.capacity()``
   admits (plus a few of tenants the worker holds none of, under fair share); each message is
   decoded (bad ones go to the dead-letter stream), the job is claimed with a conditional UPDATE
   (``queued -> running``, or ``running -> running`` when the previous worker's heartbeat is stale) and
   becomes an engine ``Request``;
5. ``engine.step()``: text deltas go to the per-job event streams (one pipeline per step, its replies read
   at the next step rather than waited for: worker/publisher.py), first-token times to PostgreSQL
   (one UPDATE per step); finished requests are finalized: result row + ledger row + fenced status update in
   one transaction, then the final event (after the job's last delta), then XACK (+XDEL).

SIGTERM stops admission, lets in-flight jobs finish for ``shutdown_grace_seconds`` and hands the rest back
(``running -> queued`` + a fresh message); exit status 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
import uuid
from typing import Any

import redis as redis_lib
import structlog

from inferq import jobs, models_registry
from inferq.contract import model_id
from inferq.log import configure_logging, get_logger
from inferq.settings import Settings, load_settings
from worker.driver import EngineDriver, Final, InFlight
from worker.jobstore import DBUnavailable, JobStore, is_db_outage
from worker.metrics import WorkerMetrics
from worker.publisher import DeltaPublisher
from worker.streams import Message, StreamConsumer

__all__ = ["DBUnavailable", "Final", "InFlight", "Message", "Worker", "exit_now", "is_db_outage", "main",
           "run_worker"]

log = get_logger("inferq.worker")

MAX_START_BATCH = 64  # messages claimed per loop iteration (keeps step latency bounded)


class Worker:
    """One worker process's loop over its collaborators (see the module docstring)."""

    def __init__(self, settings: Settings, engine: Any = None, metrics_port: int | None = None) -> None:
        self.settings = settings
        self.name = settings.worker_name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.model = model_id(settings.model)
        self.log = log.bind(worker=self.name)
        self.metrics = WorkerMetrics(model=self.model)
        self.metrics_port = metrics_port
        self.redis = redis_lib.Redis.from_url(settings.redis_url, socket_timeout=30, socket_connect_timeout=5,
                                              health_check_interval=30)
        self.consumer = StreamConsumer(self.redis, settings, self.model, self.name, self.metrics, self.log)
        self.store = JobStore(settings, self.name, self.metrics, self.log, on_give_up=self._give_up)
        if engine is None:
            engine = _load_engine(settings, self.log)
        self.engine = engine
        if hasattr(engine, "wake_fd"):  # decode-ahead windows end early when something is announced
            engine.wake_fd = self.consumer.wake_fd
        # what this worker serves, for the API's model registry (published with every heartbeat)
        self.registration = models_registry.WorkerRegistration(
            self.redis, settings.stream_prefix, self.model, self.name, models_registry.describe_engine(engine),
            settings.heartbeat_seconds)
        self.driver = EngineDriver(engine, settings, self.metrics, self.log)
        self.publisher = DeltaPublisher(self.redis, self.log)
        self.stopping = False
        self.stop_deadline = 0.0
        self.finalized = 0
        self.next_heartbeat = 0.0
        self.next_reconcile = time.monotonic() + min(2.0, settings.reconcile_interval_seconds)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            self.stop_deadline = time.monotonic() + self.settings.shutdown_grace_seconds
            self.log.info("stopping: no new jobs; finishing in-flight ones", signal=signum,
                          in_flight=len(self.driver.inflight), grace_seconds=self.settings.shutdown_grace_seconds)

    # --- the loop ------------------------------------------------------------------------------------------

    def run(self) -> int:
        structlog.contextvars.bind_contextvars(worker=self.name)
        if self.metrics_port:
            self.metrics.serve(self.metrics_port)
        if self.settings.heartbeat_seconds * 1000 >= self.settings.claim_idle_ms:
            self.log.warning("heartbeat_seconds should be well below claim_idle_ms, or live workers get robbed")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.consumer.ensure_groups()
        self.consumer.subscribe()
        self.registration.publish()
        self.log.info("worker started", model=self.model, streams=self.consumer.streams, group=self.consumer.group)
        redis_backoff = 0.0
        while True:
            now = time.monotonic()
            if self.stopping:
                if not self.driver.inflight and not self.store.final_q and not self.store.start_q:
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
        self.publisher.close()
        self._write_stats()
        try:
            self.registration.withdraw()
        except redis_lib.RedisError as exc:  # its entry expires by itself
            self.log.warning("could not withdraw from the model registry", error=str(exc))
        self.log.info("worker stopped", finalized=self.finalized)
        return 0

    def _iteration(self, now: float) -> None:
        store = self.store
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + self.settings.heartbeat_seconds
            self._heartbeat()
        for job_id in self.consumer.cancelled_jobs():
            self.driver.cancel(job_id)
        if (store.start_q or store.final_q or store.pending_first or store.down) and now >= store.retry_at:
            self._flush_db()
        admitted = 0
        if not self.stopping and not store.down:
            idle = not self.driver.has_unfinished() and not store.final_q and not store.start_q
            admitted = self._admit(block=idle)
        if self.driver.has_unfinished():
            self._step()
        elif not admitted and (store.down or self.stopping or store.final_q or store.start_q):
            time.sleep(0.05)
        if not self.stopping and now >= self.next_reconcile:
            self.next_reconcile = now + self.settings.reconcile_interval_seconds
            self.store.reconcile(self.redis)

    def _flush_db(self) -> None:
        """Retry the database work that waits: prove we still own our jobs first after an outage."""
        try:
            if self.store.down:
                self.store.call(self.store.ping)
                self._heartbeat_db()  # prove we still own our jobs before writing results
            if self.store.start_q:
                self._claim_and_add()
            if self.store.pending_first:
                self.store.write_first_tokens(self.driver.inflight)
            if self.store.final_q:
                self._finalize()
        except DBUnavailable:
            pass

    # --- heartbeat and stats -------------------------------------------------------------------------------

    def _held_messages(self) -> list[Message]:
        return ([inf.message for inf in self.driver.inflight.values()] + [f.inf.message for f in self.store.final_q]
                + list(self.store.start_q))

    def _heartbeat(self) -> None:
        self.consumer.keep_alive(self._held_messages())
        self.registration.beat(serving=not self.stopping)
        if not self.store.down:
            try:
                self._heartbeat_db()
            except DBUnavailable:
                pass
        self._write_stats()
        self.consumer.queue_metrics()

    def _heartbeat_db(self) -> None:
        ids = [inf.job_id for inf in self.driver.inflight.values()] + [f.inf.job_id for f in self.store.final_q]
        if ids:
            self.driver.apply_heartbeat(self.store.heartbeat(ids))

    def busy_seconds(self) -> float:
        return self.driver.busy_seconds()

    def _in_flight(self) -> int:
        return len(self.driver.inflight) + len(self.store.final_q)

    def _write_stats(self, pipe: Any = None) -> None:
        """The worker's live numbers: the Redis stats hash (on ``pipe`` if given) and the gauges."""
        self.metrics.engine_stats(self.engine)
        seats = {f"busy_seats:{tier}": int(n) for tier, n in self.metrics.seats_by_tier().items()}
        self.consumer.write_stats({"busy_seconds": repr(self.busy_seconds()), "in_flight": self._in_flight(),
                                  "finalized": self.finalized, "pid": os.getpid(), "model": self.model,
                                  "seats": self.settings.max_num_seqs, **seats,
                                  "updated_at": repr(time.time())}, pipe)
        self.metrics.inflight.set(self._in_flight())

    # --- admission -----------------------------------------------------------------------------------------

    def _admit(self, block: bool) -> int:
        n = min(self.driver.room(), MAX_START_BATCH) - len(self.store.start_q)
        # Under fair share, a few jobs of tenants this worker holds none of are read even when the engine is
        # full: its scheduler then gives them a seat at once (preempting a tenant that holds more).
        newcomers = self.settings.fair_read_ahead - self.driver.num_waiting() if self.settings.fair_share else 0
        if n <= 0 and newcomers <= 0:
            return 0
        got = self.consumer.read(max(0, n), block, self._held_messages, newcomers=newcomers)
        if got:
            self.store.start_q += self.consumer.decode(got)
            if self.store.start_q:
                try:
                    self._claim_and_add()
                except DBUnavailable:
                    pass
        return len(got)

    def _claim_and_add(self) -> None:
        """Claim the waiting messages' jobs in one transaction, then hand them to the engine; expired and
        unclaimable ones are acknowledged."""
        batch = list(self.store.start_q)
        now_unix = time.time()
        claims = self.store.claim(batch, now_unix)
        for m in claims.busy:  # alive on another worker: leave the message pending (un-heartbeated) for later
            self.log.info("job is running on a live worker; message left pending", job_id=m.job.job_id,
                          msg_id=m.msg_id)
        self.store.start_q = [m for m in self.store.start_q if m not in batch]
        pipe = self.consumer.pipeline()
        for m, outcome in claims.expired:
            job = m.job
            self.log.info("job expired in the queue", job_id=job.job_id)
            jobs.publish_events(pipe, self.settings, job.job_id, jobs.done_event(outcome))
            self.metrics.job_finished(job.tier, "expired", prompt=0, cached=0, completion=0, queue=None,
                                      ttft=None, tpot=None, e2e=now_unix - (job.enqueued_at or now_unix))
            self.consumer.ack(pipe, m, job.job_id)
        for m in claims.gone:  # cancelled, finished or expired already
            self.log.info("message for a job not claimable; acknowledged", job_id=m.job.job_id, msg_id=m.msg_id)
            self.consumer.ack(pipe, m, m.job.job_id)
        if claims.expired or claims.gone:
            self.publisher.flush()
            pipe.execute()
        for m, attempt, cancel_requested in claims.started:
            rejected = self.driver.start(m, attempt, cancel_requested)
            if rejected is not None:
                self.store.final_q.append(rejected)

    # --- stepping and finishing ----------------------------------------------------------------------------

    def _step(self) -> None:
        pipe = self.consumer.pipeline()
        res = self.driver.step(pipe)
        self.store.pending_first += res.first_tokens
        self.store.final_q += res.finished
        if res.published:  # written now, its replies read at the next step (worker/publisher.py)
            self.publisher.submit(pipe)
        if not self.store.down and (self.store.pending_first or self.store.final_q):
            self._flush_db()

    def _finalize(self) -> None:
        """Each finished job's transaction (``JobStore.finalize``); then, after all commits, the final events
        and the XACKs in one pipeline: results are committed before their message is acknowledged."""
        done: list[tuple[Final, bool]] = []
        try:
            self.store.finalize(done)
        finally:
            if done:
                self._after_finalize(done)

    def _after_finalize(self, done: list[tuple[Final, bool]]) -> None:
        pipe = self.consumer.pipeline()
        now_unix = time.time()
        for f, ok in done:
            inf, o = f.inf, f.outcome
            if not ok:
                inf.log.warning("job no longer ours (taken over, or finished elsewhere); result discarded")
                continue
            self.finalized += 1
            jobs.publish_events(pipe, self.settings, inf.job_id, jobs.done_event(o))
            self.consumer.ack(pipe, inf.message, inf.job_id)
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
        self.publisher.flush()  # the jobs' last deltas before their final events
        try:
            pipe.execute()
        except redis_lib.RedisError as exc:  # committed already; the message is re-read and acknowledged later
            self.log.warning("could not publish final events / acknowledge", error=str(exc))

    # --- giving work up: long outages, shutdown ------------------------------------------------------------

    def _give_up(self) -> None:
        """Past ``db_retry_max_seconds`` of outage: drop unfinished work without acknowledging it. The messages
        stay pending (no longer heartbeated) and are reclaimed once the database is back; the jobs' stale
        heartbeats let the reclaiming worker take them over. Finished results are kept and written when the
        database returns (``JobStore.abandon``). Nothing is lost; nothing stays running."""
        store = self.store
        if self.driver.inflight or store.start_q:
            self.log.error("database down too long; abandoning in-flight jobs to reclaim",
                           in_flight=len(self.driver.inflight), starting=len(store.start_q),
                           results_held=len(store.final_q))
            self.driver.abort_all("abandon")
        store.abandon()

    def _hand_back(self) -> None:
        """Grace period over: give the unfinished jobs back to the queue (running -> queued + a new message)."""
        infs = self.driver.abort_all("handback")
        if self.store.final_q and not self.store.down:
            try:
                self._finalize()  # results that are ready still land
            except DBUnavailable:
                pass
        returned = self.store.give_back(infs)
        pipe = self.consumer.pipeline(transaction=True)
        for inf in returned:
            self.consumer.requeue(pipe, inf.message, inf.job_id)
        for m in self.store.start_q:  # never claimed: still queued in the database, just put the message back
            self.consumer.requeue(pipe, m, None)
        self.store.start_q.clear()
        self.publisher.flush()
        try:
            pipe.execute()
        except redis_lib.RedisError as exc:
            self.log.warning("hand-back to Redis failed; the reconciler will re-add the jobs", error=str(exc))
        self.metrics.handed_back.inc(len(returned))
        self.log.info("handed jobs back to the queue", returned=len(returned), left_pending=len(infs) - len(returned))


def _load_engine(settings: Settings, wlog: Any) -> Any:
    """The engine, with its loading logged as it goes (the steps log their own progress: conversion, weights,
    KV pool)."""
    from worker.engine import LLMEngine  # torch is imported here, not at module import

    started = time.monotonic()
    wlog.info("loading model", model=settings.model, device=settings.device, kv_cache_memory=settings.kv_cache_memory)
    engine = LLMEngine(settings)
    wlog.info("model loaded", model=settings.model, seconds=round(time.monotonic() - started, 2),
              max_model_len=engine.max_model_len, kv_blocks=engine.runner.num_blocks,
              block_size=engine.runner.block_size)
    return engine


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
