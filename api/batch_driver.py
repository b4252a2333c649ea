"""Drives this API process's batches: submits their lines a chunk at a time, stops what is left of a cancelled
or expired batch, and finalizes a batch once every line has ended.

One asyncio task per batch, each step a short call on the submit pool: a 50,000-line batch never blocks the
event loop, and interactive submissions on the same pool interleave with its chunks. Each step first takes
(or renews) the batch's lease in PostgreSQL, so with several API processes exactly one drives a batch; when
that process dies its lease lapses, and another adopts the batch: on the next ``GET`` of it, or through its
sweep of batches nobody drives (every ``SWEEP_SECONDS``, started with the first batch request it serves).
A ``GET`` also finalizes a finished batch at once (``refresh``), guarded like every finalization.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from api.batch_lines import renderer, to_job
from inferq import batch_output, batches
from inferq.batch_feed import FEED_CHUNK, feed, relink_orphans
from inferq.contract import JobCreate
from inferq.db import Batch
from inferq.log import get_logger

log = get_logger("inferq.api.batches")

POLL_SECONDS = 1.0
WATCH_MAX_SECONDS = 10.0  # a submitted batch is counted every total/WATCH_LINES_PER_SECOND s (1 to 10 s)
WATCH_LINES_PER_SECOND = 5000
SWEEP_SECONDS = 10.0
ERROR_BACKOFF_SECONDS = 5.0


@dataclass
class Step:
    delay: float | None  # seconds until the next step; None: this process is done with the batch
    chunk: int = FEED_CHUNK  # most lines the next step submits (shrinks while quotas refuse, then grows)
    hold: float = 0.0  # submit nothing more for this long (a quota's Retry-After); the steps go on meanwhile


def driver_for(request: Request) -> BatchDriver:
    """This API process's driver (made on first use, with its sweep)."""
    state = request.app.state
    driver = getattr(state, "inferq_batches", None)
    if driver is None:
        driver = state.inferq_batches = BatchDriver(state.inferq)
    driver.start_sweep()
    return driver


class BatchDriver:
    """One per API process (``driver_for``): its batch tasks, its sweep, and the steps they run."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.owner = f"{socket.gethostname()[:60]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.sweeper: asyncio.Task[None] | None = None
        self.stopped: set[str] = set()  # batches whose remaining jobs this process has stopped

    # --- on the event loop ----------------------------------------------------------------------------

    def ensure(self, batch_id: str) -> None:
        """Drive the batch from this process unless a task here already does (its first step finds out
        whether another process holds it)."""
        task = self.tasks.get(batch_id)
        if task is None or task.done():
            self.tasks[batch_id] = asyncio.get_running_loop().create_task(self._drive(batch_id))

    def start_sweep(self) -> None:
        if self.sweeper is None or self.sweeper.done():
            self.sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _drive(self, batch_id: str) -> None:
        loop = asyncio.get_running_loop()
        chunk, feed_from = FEED_CHUNK, 0.0
        try:
            while True:
                may_feed = loop.time() >= feed_from
                try:
                    step = await loop.run_in_executor(self.state.submit_executor, self.step, batch_id, chunk,
                                                      may_feed)
                except RuntimeError:  # the pool is shut down: the app is stopping (the lease lapses)
                    return
                except Exception as exc:  # noqa: BLE001 - e.g. the database is down: try again later
                    log.warning("batch step failed", batch_id=batch_id, error=str(exc)[:300])
                    step = Step(ERROR_BACKOFF_SECONDS, chunk)
                if step.delay is None:
                    return
                chunk = step.chunk
                if step.hold:
                    feed_from = loop.time() + step.hold
                await asyncio.sleep(step.delay)
        finally:
            if self.tasks.get(batch_id) is asyncio.current_task():
                del self.tasks[batch_id]
                self.stopped.discard(batch_id)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            try:
                ids = await loop.run_in_executor(self.state.submit_executor, batches.unleased,
                                                 self.state.session_factory)
            except RuntimeError:
                return
            except Exception as exc:  # noqa: BLE001 - try again at the next sweep
                log.warning("batch sweep failed", error=str(exc)[:300])
                continue
            for batch_id in ids:
                self.ensure(batch_id)

    # --- on the submit pool -----------------------------------------------------------------------------

    def step(self, batch_id: str, chunk: int, may_feed: bool = True) -> Step:
        """One step of a batch, under its lease: finalize it, stop what is left of it, or (``may_feed``)
        submit a chunk of its lines."""
        sf = self.state.session_factory
        taken = batches.take_lease(sf, batch_id, self.owner)
        if taken is None:
            return Step(None)
        batch, taken_over = taken
        if taken_over:
            relink_orphans(sf, self.state.redis, self.state.settings, batch_id)
        stopping = batch.cancelling_at is not None or batch.expired_at is not None
        with sf() as session:
            fed = batches.fed_all(session, batch)
            # a batch still submitting (and not stopping) cannot have ended: no counting then
            counts = batches.counts(session, batch) if fed or stopping or batch.status == "finalizing" else None
        if counts is not None and batches.finished(batch, counts):
            self.finalize(batch)
            return Step(None)
        if stopping or batches.expire_if_due(sf, batch):
            # one pass over its lines per process, again only if a job was queued meanwhile (see batch_feed)
            if batch_id not in self.stopped or (counts is not None and counts.queued):
                batches.stop_jobs(sf, self.state.redis, self.state.settings, batch)
                self.stopped.add(batch_id)
            return Step(POLL_SECONDS, chunk)
        if fed:  # every line is a job: watch them end (a GET finalizes at once anyway)
            return Step(min(WATCH_MAX_SECONDS, max(POLL_SECONDS, batch.total / WATCH_LINES_PER_SECOND)), chunk)
        if not may_feed:
            return Step(POLL_SECONDS, chunk)
        result = feed(sf, self.state.redis, self.state.settings, batch_id, self.owner, self.to_job, chunk)
        if result.done:
            return Step(POLL_SECONDS, chunk)
        if result.throttled:  # a quota refused some: smaller chunks, after its Retry-After, until they pass
            return Step(POLL_SECONDS, max(1, result.submitted), hold=result.retry_after or POLL_SECONDS)
        if result.retry_after is not None:  # its share of the queue is full
            return Step(min(result.retry_after, POLL_SECONDS), chunk)
        return Step(0.0, min(FEED_CHUNK, chunk * 2))

    def to_job(self, line: dict[str, Any]) -> JobCreate:
        """A request line's job, checked against its model as the live routes check a request
        (api/admission.py, where this API has it: served, fits the context)."""
        job = to_job(line)
        admission = getattr(self.state, "admission", None)
        return admission.admit(job).body if admission is not None else job

    def finalize(self, batch: Batch) -> str | None:
        return batch_output.finalize(self.state.session_factory, batch.id, self.owner, renderer(batch.endpoint))

    def refresh(self, tenant_id: str, batch_id: str) -> tuple[Batch, batches.Counts] | None:
        """The tenant's batch and its counts, finalizing it first when every line has ended (lazily, on GET)."""
        sf = self.state.session_factory
        with sf() as session:
            batch = batches.get_batch(session, tenant_id, batch_id)
            if batch is None:
                return None
            counts = batches.counts(session, batch)
        if batches.finished(batch, counts) and self.finalize(batch) is not None:
            with sf() as session:
                batch = batches.get_batch(session, tenant_id, batch_id)
                assert batch is not None
                counts = batches.counts(session, batch)
        return batch, counts
