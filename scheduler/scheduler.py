"""Continuous batching over the paged KV cache: which requests run this step, and how many tokens each.

One token budget per step (``max_batched_tokens``) is shared by decodes and prefill chunks, so a long
prompt is simply computed over several steps (chunked prefill). See docs/ENGINE.md for the rules.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from inferq.log import get_logger
from scheduler.block_manager import BlockManager, cdiv
from scheduler.fairness import FairQueue
from scheduler.request import FinishReason, Request, RequestStatus, Tier

log = get_logger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    policy: Literal["continuous", "static"] = "continuous"
    batch_min_share: float = 0.1  # of the token budget, guaranteed to the batch tier when it has work
    # Batch-tier tokens per step while interactive traffic is about (an interactive request ran or waited
    # within `interactive_window_s`): an interactive request arriving mid-step waits behind at most this much
    # batch work. None: no cap (offline runs, batch-only workers never see interactive work anyway).
    batch_step_tokens: int | None = None
    interactive_window_s: float = 30.0
    max_model_len: int | None = None  # default for requests that carry none
    fair_share: bool = True  # admit each tier's waiting requests round-robin over tenants (scheduler/fairness.py)
    # Tokens per tenant turn, times its weight. Small, so a turn admits about one request and a newcomer waits
    # behind at most about one request of each busy tenant; a dearer request saves up over several turns.
    fair_share_quantum: int = 64


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler: abort, deadline, error

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        # Per tier; admitted round-robin over tenants by tokens (fair share), each tenant's requests by
        # priority (higher first), FIFO within a priority; preempted requests go to the front of their
        # priority group.
        self.waiting: dict[Tier, FairQueue] = {tier: self._new_queue() for tier in Tier}
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # live (waiting or running) requests by id
        self.num_preemptions = 0
        self._finished: list[Request] = []  # ended between steps, reported by the next schedule()
        self._cohort: set[str] = set()  # static policy: the batch being run to completion
        self._num_deadlines = 0
        self._seat_victims: set[int] = set()  # ids of requests preempted this step for a fair share of seats
        self._interactive_seen = float("-inf")  # time.monotonic() an interactive request last ran or waited

    def _new_queue(self) -> FairQueue:
        # The static policy's cohort is simply the first requests in order: fair share applies to continuous.
        fair = self.config.fair_share and self.config.policy == "continuous"
        return FairQueue(self.config.fair_share_quantum, fair=fair)

    def set_fair_share(self, on: bool) -> None:
        """Turn fair sharing on or off (benchmarks compare both in one process); the waiting requests are
        queued again in scheduling order (tier, priority, arrival), so do it while few wait."""
        self.config.fair_share = on
        for tier, old in list(self.waiting.items()):
            self.waiting[tier] = self._new_queue()
            for req in sorted(old, key=lambda r: r.sort_key):
                self.waiting[tier].add(req)

    # --- admission ---------------------------------------------------------------------------------
    def rejection_reason(self, req: Request) -> str | None:
        """Why ``req`` can never run (None if it can): it must fit the context and, alone, the KV pool."""
        max_len = req.max_model_len or self.config.max_model_len
        if max_len and req.num_prompt_tokens > max_len:
            return f"prompt has {req.num_prompt_tokens} tokens, more than the model's context of {max_len}"
        # Every prompt token needs KV; of the outputs, all but the last sampled one.
        need = cdiv(max(req.num_prompt_tokens, req.max_total_tokens - 1), self.bm.block_size)
        if need > self.bm.num_blocks:
            return (f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.sampling.max_tokens}) needs "
                    f"{need} KV blocks but the whole cache has {self.bm.num_blocks} blocks of "
                    f"{self.bm.block_size} tokens; lower max_tokens or raise kv_cache_memory")
        return None

    def add_request(self, req: Request) -> bool:
        """Queue a request; False if it can never run (it is then finished with ERROR and reported)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.max_model_len is None:
            req.max_model_len = self.config.max_model_len
        if (reason := self.rejection_reason(req)) is not None:
            req.error = reason
            req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ERROR
            self._finished.append(req)
            return False
        self.requests[req.request_id] = req
        self._num_deadlines += req.deadline is not None
        self._enqueue(req)
        return True

    def capacity(self) -> tuple[int, int]:
        """(requests, tokens) the caller may add now without building a backlog: requests up to
        ``max_num_seqs`` beyond what is queued, tokens up to the free KV slots not promised to waiters."""
        waiting = [r for q in self.waiting.values() for r in q]
        if self.config.policy == "static":  # the cohort waiting for blocks is not a backlog
            queued = sum(r.request_id not in self._cohort for r in waiting)
        else:
            queued = len(self.running) + len(waiting)
        tokens = self.bm.num_free * self.bm.block_size - sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        return (max(0, self.config.max_num_seqs - queued) if tokens > 0 else 0), max(0, tokens)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._finished)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    # --- ending requests -----------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a live request now and free its blocks (a stop string, abort, deadline...)."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting[req.tier].remove(req)
        self.bm.free(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        del self.requests[req.request_id]
        self._cohort.discard(req.request_id)
        self._num_deadlines -= req.deadline is not None

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Cancel a request at any point; its blocks are free at once and it is reported next step."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, reason)
            self._finished.append(req)
        return req

    # --- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished)
        self._finished = []
        if self._num_deadlines:
            now = time.monotonic()
            for req in [r for r in self.requests.values() if r.deadline is not None and r.deadline < now]:
                self.finish(req, FinishReason.DEADLINE)
                out.finished.append(req)
        if self.config.policy == "static" and not self._cohort:
            order = [*self.waiting[Tier.INTERACTIVE], *self.waiting[Tier.BATCH]]
            self._cohort = {r.request_id for r in order[: self.config.max_num_seqs]}

        self.running.sort(key=lambda r: r.sort_key)
        run_i = [r for r in self.running if r.tier is Tier.INTERACTIVE]
        run_b = [r for r in self.running if r.tier is Tier.BATCH]
        wait_i, wait_b = self.waiting[Tier.INTERACTIVE], self.waiting[Tier.BATCH]
        batch_cap = self._batch_step_cap(interactive_now=bool(run_i) or len(wait_i) > 0)
        # Batch never starves: while it has work, it keeps `reserve` tokens of every step, its head
        # request is never preempted by interactive work, and interactive admissions leave free the
        # blocks (and, if the head waits, the seat) the head needs for its next `reserve` tokens.
        budget = self.config.max_batched_tokens
        next_b = wait_b.peek()
        head = run_b[0] if run_b else (next_b if next_b is not None and self._admissible(next_b) else None)
        reserve = head_blocks = seats = 0
        if head is not None and self.config.batch_min_share > 0:
            share = max(1, int(self.config.batch_min_share * budget))
            n = min(head.num_tokens - head.num_computed_tokens, share)
            head_blocks = self.bm.blocks_needed(head, n) if head.block_table else cdiv(n, self.bm.block_size)
            seats = int(not head.block_table and self.config.max_num_seqs > 1)
            # Tokens are held back only if the head can run now, and never all of them (interactive
            # work always gets at least one token per step).
            if head.block_table or len(self.running) < self.config.max_num_seqs:
                reserve = min(share, budget - 1)
        done: set[int] = set()  # ids of requests scheduled or preempted this step
        self._seat_victims = set()
        claims_i = self._seat_claims(Tier.INTERACTIVE, out, done, protect=head)
        claims_b = self._seat_claims(Tier.BATCH, out, done, protect=head)

        used = self._run(run_i, budget - reserve, out, done, protect=head)
        used += self._admit(wait_i, budget - reserve - used, out, done, protect=head, reserve=head_blocks, seats=seats,
                            claims=claims_i)
        batch_budget = min(budget - used, batch_cap)
        batch_used = self._run([r for r in run_b if r.status is RequestStatus.RUNNING], batch_budget, out, done)
        batch_used += self._admit(wait_b, batch_budget - batch_used, out, done, claims=claims_b)
        used += batch_used
        self._grant_proposals(out, budget - used)
        return out

    def _batch_step_cap(self, interactive_now: bool) -> int:
        """Tokens the batch tier may use this step: ``batch_step_tokens`` while interactive traffic is about,
        so the step an interactive request arrives during (and its own first step) stays short; otherwise the
        whole budget, for the batch tier's throughput."""
        cap = self.config.batch_step_tokens
        if cap is None:
            return self.config.max_batched_tokens
        now = time.monotonic()
        if interactive_now:
            self._interactive_seen = now
        elif now - self._interactive_seen > self.config.interactive_window_s:
            return self.config.max_batched_tokens
        return max(1, cap)

    def _run(self, reqs: list[Request], budget: int, out: SchedulerOutput, done: set[int],
             protect: Request | None = None) -> int:
        """Give running requests their next tokens, preempting less important ones when blocks run out."""
        used = 0
        for req in reqs:
            if budget - used <= 0:
                break
            if id(req) in done:  # preempted earlier this step
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget - used)
            while not self.bm.append_slots(req, n):
                victim = self._victim(req, done, protect)
                self._preempt(victim or req, out, done)
                if victim is None:
                    break
            else:
                out.scheduled.append((req, n))
                done.add(id(req))
                used += n
        return used

    def _grant_proposals(self, out: SchedulerOutput, budget: int) -> None:
        """Speculative proposals (``spec_token_ids``) are verified only with what is left of the token
        budget and the free blocks once every ordinary token is scheduled, most important request first:
        a guess never displaces a prefill chunk or a decode, nor preempts anyone."""
        for i, (req, n) in enumerate(out.scheduled):
            k = min(len(req.spec_token_ids), budget) if n == 1 and req.is_decoding else 0
            if k and not self.bm.append_slots(req, n + k):
                k = 0
            req.spec_token_ids = req.spec_token_ids[:k]
            if k:
                out.scheduled[i] = (req, n + k)
                budget -= k

    def _seat_claims(self, tier: Tier, out: SchedulerOutput, done: set[int], protect: Request | None) -> list[Request]:
        """Fair share of the running seats within a tier: the head requests of tenants holding fewer seats
        (per unit of weight) than another tenant of the tier holds, most deprived first, to be admitted before
        the DRR order. When no seat is free, each claim preempts the latest request of the tenant holding the
        most seats per weight. Why: DRR decides who is admitted next, but with every seat taken by a heavy
        tenant's long decodes a newcomer would still wait for one of them to end (many steps); a claim makes
        that one step. It never reverses itself: a claim is made only while the victim's tenant would keep
        at least as many seats per weight as the claimant gets, so the preempted tenant cannot claim back.
        Preemption recomputes little: the victim's full blocks stay in the prefix cache."""
        queue = self.waiting[tier]
        if not (queue.fair and len(queue)):
            return []
        mine = [r for r in self.running if r.tier is tier]
        seats = Counter(r.tenant for r in mine)
        weight = {r.tenant: r.weight for r in mine} | {t: queue.weight(t) for t in queue.tenants()}
        free = self.config.max_num_seqs - len(self.running)
        if tier is Tier.INTERACTIVE:  # interactive admissions take batch seats first (see _admit)
            free += sum(r.tier is Tier.BATCH and r is not protect for r in self.running)
        claims = []
        for tenant in sorted(queue.tenants(), key=lambda t: (seats[t] + 1) / weight[t]):
            richest = max(seats, key=lambda t: seats[t] / weight[t], default=None)
            if richest is None or seats[richest] / weight[richest] <= (seats[tenant] + 1) / weight[tenant]:
                break  # nobody holds more than this tenant would with one seat more
            if free <= 0:
                victims = [r for r in mine if r.tenant == richest and r is not protect and id(r) not in done]
                if not victims:
                    break
                victim = max(victims, key=lambda r: r.sort_key)
                self._preempt(victim, out, done)
                self._seat_victims.add(id(victim))
                mine.remove(victim)
                seats[richest] -= 1
                free += 1
            free -= 1
            seats[tenant] += 1
            claims.append(queue.head(tenant))
        return claims

    def _admission_order(self, queue: FairQueue, claims: list[Request]) -> Iterator[Request]:
        """The waiting requests in the order they may be admitted: seat claims, then the fair (DRR) order, one
        at a time (the caller admits or stops before asking for the next); static policy: the current
        cohort, in order."""
        if self.config.policy == "static":
            yield from [r for r in queue if self._admissible(r)]
            return
        yield from claims
        while (req := queue.peek()) is not None:
            yield req

    def _admit(self, queue: FairQueue, budget: int, out: SchedulerOutput, done: set[int],
               protect: Request | None = None, reserve: int = 0, seats: int = 0,
               claims: list[Request] | None = None) -> int:
        """Admit waiting requests in admission order (no overtaking: one that does not fit blocks its
        queue), leaving ``reserve`` blocks and ``seats`` running slots free. An interactive request finding
        every seat taken preempts a batch one for its seat, as it would for blocks."""
        used = 0
        for req in self._admission_order(queue, claims or []):
            # A request preempted this step for blocks running work needs stops its tier's admissions
            # (one preempted for a fair seat does not: it went back to wait behind the claim).
            if budget - used <= 0 or any(r.tier is req.tier and id(r) not in self._seat_victims
                                         for r in out.preempted):
                break
            if len(self.running) >= self.config.max_num_seqs - seats:
                victim = self._victim(req, done, protect, batch_only=True) if req.tier is Tier.INTERACTIVE else None
                if victim is None:
                    break
                self._preempt(victim, out, done)
            hit = self.bm.lookup(req)
            n = min(req.num_tokens - hit.num_tokens, budget - used)
            # Only interactive admissions may preempt (batch ones), never the protected batch head.
            while not self.bm.can_allocate(req, n, hit, reserve=reserve):
                victim = self._victim(req, done, protect, batch_only=True) if req.tier is Tier.INTERACTIVE else None
                if victim is None:
                    return used
                self._preempt(victim, out, done)
            self.bm.allocate(req, n, hit)
            queue.pop(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            done.add(id(req))
            used += n
        return used

    def _admissible(self, req: Request) -> bool:
        return self.config.policy != "static" or req.request_id in self._cohort

    def _victim(self, req: Request, done: set[int], protect: Request | None, batch_only: bool = False) -> Request | None:
        """Least important running request not yet scheduled this step: lowest tier, lowest priority,
        latest arrival. Batch requests only ever preempt batch requests."""
        only_batch = batch_only or req.tier is Tier.BATCH
        cands = [r for r in self.running if r is not req and r is not protect and id(r) not in done
                 and (r.tier is Tier.BATCH or not only_batch)]
        return max(cands, key=lambda r: r.sort_key, default=None)

    def _preempt(self, req: Request, out: SchedulerOutput, done: set[int]) -> None:
        """Preempt by recompute: drop its KV, keep its outputs (recomputed later as part of its tokens)."""
        self.running.remove(req)
        self.bm.free(req)
        req.spec_token_ids = []
        req.decode_ahead = False
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self._enqueue(req, front=True)
        out.preempted.append(req)
        done.add(id(req))
        log.debug("preempted", request_id=req.request_id, tier=req.tier.value, tokens=req.num_tokens)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        self.waiting[req.tier].add(req, front=front)

    # --- after the model ran ---------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: list[int | list[int] | None]) -> list[Request]:
        """Advance each scheduled request by its computed tokens, append its sampled token (or, for a
        request that verified proposals, the accepted ones and the token after them), cache its newly full
        blocks and apply token-level stops. Returns the requests finished here."""
        finished = []
        for (req, n), token in zip(out.scheduled, sampled, strict=True):
            if req.is_finished:  # aborted while the step ran
                continue
            tokens = token if isinstance(token, list) else [] if token is None else [token]
            if req.spec_token_ids:
                n -= self._settle_proposals(req, len(tokens) - 1)
            req.output_token_ids.extend(tokens)  # before caching: full blocks are hashed from these ids
            req.num_computed_tokens += n
            self.bm.trim(req)
            self.bm.cache_blocks(req)
            for i, tok in enumerate(tokens):
                reason = self._stop_reason(req, tok, len(tokens) - 1 - i)
                if reason is not None:
                    del req.output_token_ids[len(req.output_token_ids) - (len(tokens) - 1 - i):]
                    self.finish(req, reason)
                    finished.append(req)
                    break
        return finished

    @staticmethod
    def _settle_proposals(req: Request, accepted: int) -> int:
        """Count a verified step's proposals; returns how many computed positions held rejected ones (their
        KV is dropped: the slots are reused, the blocks past the cache's end returned by ``trim``)."""
        k = len(req.spec_token_ids)
        if not req.decode_ahead:
            req.num_spec_proposed += k
            req.num_spec_accepted += accepted
            req.num_spec_drafts += 1 if k else 0
        req.spec_token_ids = []
        req.decode_ahead = False
        return k - accepted

    @staticmethod
    def _stop_reason(req: Request, token: int, later: int = 0) -> FinishReason | None:
        """Why the request ends at ``token``, which ``later`` more appended tokens follow (None: go on)."""
        sp = req.sampling
        if (not sp.ignore_eos and token in req.eos_token_ids) or token in sp.stop_token_ids:
            return FinishReason.STOP
        outputs, total = req.num_output_tokens - later, req.num_tokens - later
        if outputs >= sp.max_tokens or (req.max_model_len and total >= req.max_model_len):
            return FinishReason.LENGTH
        return None
