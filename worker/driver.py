"""Driving the engine for the worker: claimed jobs in, text deltas and finished jobs out.

``start`` turns a claimed job's ``JobMessage`` into an engine ``Request`` (id ``job_id#attempt``, so a retried
job never collides with a stale one; sampling from ``JobMessage.to_sampling_params``; the deadline converted to
``time.monotonic()``; the tenant and its fair-share weight, for the scheduler's round robin over tenants).
``step`` runs one engine step and sorts its outputs: text deltas onto the caller's Redis pipeline (the per-job
event streams, each delta marked with its attempt; a job's deltas go out at most every ``stream_interval_ms``,
joined, its first text and its end at once; a restarted job's stream is first replaced by a ``reset`` entry,
so readers drop the earlier attempts' text: inferq/jobs/events.py), first-token times, and finished requests
as ``Final`` (the job's ``jobs.Outcome``, waiting for its transaction). Cancellations, takeovers, outages and
shutdown abort requests here, remembering why (``InFlight.ended``), which decides whether a result is written
at all.

No Redis or SQL calls of its own: the loop (worker/service.py) executes the pipeline and hands ``Final`` to
the job store.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from inferq import jobs
from inferq.settings import Settings
from scheduler.request import FinishReason, Request, Tier
from worker.metrics import WorkerMetrics
from worker.outputs import RequestOutput, Usage
from worker.streams import Message

# why a request was aborted by the worker, when it must write no result: the job is (or will be) another's
NO_RESULT = ("lost", "abandon", "handback")


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
    unsent_text: str = ""  # text deltas held back by stream_interval_ms, and their token ids
    unsent_ids: list[int] = field(default_factory=list)
    next_publish_mono: float = 0.0
    started_mono: float = field(default_factory=time.monotonic)
    ended: str | None = None  # why we aborted it: cancel | deadline | lost | abandon | handback
    log: Any = None


@dataclass
class Final:
    """A finished job waiting for its transaction (result row + ledger row + fenced status update)."""

    inf: InFlight
    outcome: jobs.Outcome
    finished_mono: float


@dataclass
class StepResult:
    first_tokens: list[InFlight]  # jobs that got their first token in this step
    finished: list[Final]  # jobs whose result is to be written
    published: bool  # text deltas were queued on the pipeline


class EngineDriver:
    """The jobs the engine runs (``inflight`` by engine request id, ``by_job`` by job id) and their requests."""

    def __init__(self, engine: Any, settings: Settings, metrics: WorkerMetrics, log: Any) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.log = log
        self.inflight: dict[str, InFlight] = {}
        self.by_job: dict[str, str] = {}  # job_id -> rid
        self.resets: list[InFlight] = []  # restarted jobs whose event stream is reset at the next step
        self.step_seconds = 0.0  # our own measurement, if the engine has no stats.busy_seconds

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def room(self) -> int:
        """How many more requests the engine admits now (none when it has no token budget left)."""
        cap = self.engine.capacity()
        return cap.requests if cap.tokens > 0 else 0

    def num_waiting(self) -> int:
        """Requests the engine holds that do not run yet (0 for an engine that does not say)."""
        scheduler = getattr(self.engine, "scheduler", None)
        return int(getattr(scheduler, "num_waiting", 0) or 0)

    def busy_seconds(self) -> float:
        stats = getattr(self.engine, "stats", None)
        value = getattr(stats, "busy_seconds", None)
        return float(value) if isinstance(value, (int, float)) else self.step_seconds

    # --- starting ------------------------------------------------------------------------------------------

    def start(self, m: Message, attempt: int, cancel_requested: bool) -> Final | None:
        """Add the claimed job of ``m`` to the engine. A job the engine refuses (tokenization failed, too long
        for the model, bad parameters...) comes back as a failed ``Final``."""
        job = m.job
        assert job is not None
        now_unix, now_mono = time.time(), time.monotonic()
        inf = InFlight(job_id=job.job_id, rid=f"{job.job_id}#{attempt}", attempt=attempt, message=m,
                       tenant_id=job.tenant_id, tier=job.tier, enqueued_at=float(job.enqueued_at or now_unix),
                       started_wall=now_unix, deadline_unix=job.deadline,
                       log=self.log.bind(job_id=job.job_id, tenant=job.tenant_id, attempt=attempt))
        self.metrics.queue_time.labels(inf.tier).observe(max(0.0, now_unix - inf.enqueued_at))
        if attempt > 1:
            inf.log.info("job restarted", reclaimed=m.reclaimed)
        if attempt > self.settings.max_job_attempts:  # every earlier attempt lost its worker: do not risk another
            reason = (f"not started again: each of its {attempt - 1} attempts ended without a result (the worker "
                      "running it crashed, was killed or stopped, or lost the database)")
            inf.log.error("job failed after too many lost attempts", attempts=attempt - 1)
            return Final(inf, jobs.Outcome(status="failed", finish_reason="error", error=reason), time.monotonic())
        try:
            ids = self.engine.encode(**job.prompt_input())
            deadline = None
            if inf.deadline_unix is not None:
                deadline = now_mono + (inf.deadline_unix - now_unix)
            req = Request(request_id=inf.rid, prompt_token_ids=list(ids), sampling=job.to_sampling_params(),
                          tier=Tier(inf.tier), priority=int(job.priority),
                          arrival_time=now_mono - max(0.0, now_unix - inf.enqueued_at),
                          deadline=deadline, cache_namespace=job.cache_namespace, tenant=job.tenant_id,
                          weight=job.weight)
            self.engine.add_request(req)
        except Exception as exc:  # cannot run: tokenization failed, too long for the model, bad parameters...
            inf.log.warning("job rejected by the engine", error=str(exc))
            return Final(inf, jobs.Outcome(status="failed", finish_reason="error", error=str(exc)), time.monotonic())
        self.inflight[inf.rid] = inf
        self.by_job[job.job_id] = inf.rid
        if attempt > 1:  # the earlier attempts' text is on the stream: readers must discard it
            self.resets.append(inf)
        inf.log.info("job started", tier=inf.tier, prompt_tokens=len(ids))
        if cancel_requested:
            self._cancel(inf)
        return None

    # --- stepping ------------------------------------------------------------------------------------------

    def step(self, pipe: Any) -> StepResult:
        """One engine step; text deltas are queued on ``pipe`` (one pipeline per step), after the resets of
        the jobs restarted since the last step."""
        result = StepResult([], [], bool(self.resets))
        for inf in self.resets:
            jobs.publish_reset(pipe, self.settings, inf.job_id, inf.attempt)
        self.resets.clear()
        t0 = time.monotonic()
        outputs: list[RequestOutput] = self.engine.step()
        now_mono = time.monotonic()
        self.step_seconds += now_mono - t0
        now_unix = time.time()
        for out in outputs:
            inf = self.inflight.get(out.request_id)
            if inf is None:
                continue
            if inf.first_token_wall is None and out.new_token_ids:
                inf.first_token_wall, inf.first_token_mono = now_unix, now_mono
                result.first_tokens.append(inf)
                self.metrics.ttft.labels(inf.tier).observe(max(0.0, now_unix - inf.enqueued_at))
            if (out.text_delta or out.new_token_ids or out.finished) and inf.ended not in ("lost", "abandon"):
                result.published |= self._publish(pipe, inf, out, now_mono)
            if out.finished:
                self.forget(inf)
                if inf.ended not in NO_RESULT:  # else another worker owns the job now (or will): no result, no ack
                    result.finished.append(Final(inf, self._outcome(inf, out), now_mono))
        return result

    def _publish(self, pipe: Any, inf: InFlight, out: RequestOutput, now_mono: float) -> bool:
        """Queue the step's text delta, or hold it back: deltas go out at most every ``stream_interval_ms``,
        joined; the first token and the job's end go out at once. Returns whether an event was queued."""
        inf.unsent_text += out.text_delta or ""
        inf.unsent_ids += out.new_token_ids or []
        if not inf.unsent_text or (not out.finished and now_mono < inf.next_publish_mono):
            return False
        jobs.publish_events(pipe, self.settings, inf.job_id,
                            jobs.delta_event(inf.unsent_text, inf.unsent_ids, inf.attempt))
        inf.unsent_text, inf.unsent_ids = "", []
        inf.next_publish_mono = now_mono + self.settings.stream_interval_ms / 1000
        return True

    def _outcome(self, inf: InFlight, out: RequestOutput) -> jobs.Outcome:
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
        return jobs.Outcome(
            status=status, text=out.text or "", finish_reason=reason, token_ids=list(out.token_ids or []),
            prompt_tokens=usage.prompt_tokens, cached_prompt_tokens=usage.cached_prompt_tokens,
            completion_tokens=usage.completion_tokens, compute_seconds=float(usage.compute_seconds),
            error=error, first_token_at=first, spec_proposed_tokens=usage.spec_proposed_tokens,
            spec_accepted_tokens=usage.spec_accepted_tokens)

    # --- aborting ------------------------------------------------------------------------------------------

    def forget(self, inf: InFlight) -> None:
        self.inflight.pop(inf.rid, None)
        if self.by_job.get(inf.job_id) == inf.rid:
            del self.by_job[inf.job_id]

    def cancel(self, job_id: str) -> None:
        """A cancel published for ``job_id``: abort its request (reported by the next step as ``abort``)
        unless it is not running here or already ending."""
        rid = self.by_job.get(job_id)
        inf = self.inflight.get(rid) if rid else None
        if inf is not None and inf.ended is None:
            inf.log.info("cancel requested")
            self._cancel(inf)

    def _cancel(self, inf: InFlight) -> None:
        inf.ended = "cancel"
        self.engine.abort(inf.rid, FinishReason.ABORT)

    def apply_heartbeat(self, owned: Mapping[str, tuple[int, bool]]) -> None:
        """``owned`` is ``jobs.heartbeat``'s answer: {job_id: (attempt, cancel_requested)} of the jobs this
        worker still owns. Jobs missing from it (taken over, finished elsewhere) are dropped without a result;
        flagged ones are cancelled (in case the pub/sub message was missed)."""
        for inf in list(self.inflight.values()):
            got = owned.get(inf.job_id)
            if got is None or got[0] != inf.attempt:
                if inf.ended != "lost":
                    inf.log.warning("job taken over by another worker or finished elsewhere; dropping it")
                    inf.ended = "lost"
                    self.engine.abort(inf.rid)
            elif got[1] and inf.ended is None:
                inf.log.info("cancel requested (flag)")
                self._cancel(inf)

    def abort_all(self, why: str) -> list[InFlight]:
        """Abort every request without a result (``why`` in ``NO_RESULT``); returns the jobs dropped."""
        dropped = list(self.inflight.values())
        for inf in dropped:
            inf.ended = why
            self.engine.abort(inf.rid)
            self.forget(inf)
        return dropped
