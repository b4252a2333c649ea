"""LLMEngine: schedule -> run the model -> postprocess, one step at a time, with per-request usage.

The engine is single-threaded: the caller (the worker service, ``LLM.generate``, the CLI) adds requests,
calls ``step()`` in a loop and gets text deltas, finish reasons and usage back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from inferq.log import get_logger
from inferq.settings import Settings
from scheduler.block_manager import BlockManager
from scheduler.request import FinishReason, Request
from scheduler.scheduler import Scheduler, SchedulerConfig
from worker.detokenizer import IncrementalDetokenizer
from worker.outputs import Capacity, RequestOutput, Usage
from worker.step_pacer import StepPacer

log = get_logger(__name__)

MAX_AHEAD = 16  # most tokens of a decode-ahead window (_plan_ahead)


@dataclass
class EngineStats:
    """Counters over the engine's life. ``busy_seconds`` is the wall time of steps that ran the model;
    the requests' ``compute_seconds`` add up to it."""

    requests: int = 0  # finished requests (any reason)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_proposed_tokens: int = 0  # speculative proposals verified (finished requests)
    spec_accepted_tokens: int = 0  # of which accepted
    spec_drafts: int = 0  # verified (request, step) pairs holding proposals (finished requests)
    steps: int = 0
    busy_seconds: float = 0.0
    kv_usage_peak: float = 0.0
    kv_usage_sum: float = 0.0
    kv_waste_sum: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    preemptions: int = 0
    prefix_hit_rate: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def wall_seconds(self) -> float:
        return time.perf_counter() - self.started

    @property
    def kv_usage_mean(self) -> float:
        return self.kv_usage_sum / self.steps if self.steps else 0.0

    @property
    def kv_waste(self) -> float:
        """Mean over steps of allocated-but-unfilled KV slots / allocated slots."""
        return self.kv_waste_sum / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("kv_usage_sum", "kv_waste_sum", "started"):
            d.pop(k)
        wall = self.wall_seconds
        d.update(wall_seconds=wall, kv_usage_mean=self.kv_usage_mean, kv_waste=self.kv_waste,
                 completion_tokens_per_second=self.completion_tokens / wall if wall else 0.0)
        return d


@dataclass(eq=False, slots=True)
class _Track:
    """Engine-side state of one live request."""

    request: Request
    detok: IncrementalDetokenizer | None
    usage: Usage
    first_scheduled: float | None = None
    first_token: float | None = None
    computed: int = 0  # most tokens ever in the cache (an aborted request pays only for these)


class LLMEngine:
    """``LLMEngine(settings)`` or ``LLMEngine(model=..., max_num_seqs=..., ...)`` (Settings fields).

    ``runner`` and ``tokenizer`` may be injected (tests); otherwise they are built from the model."""

    def __init__(self, settings: Settings | None = None, *, runner: Any = None, tokenizer: Any = None,
                 **options: Any) -> None:
        if settings is None:
            from inferq.settings import load_settings

            settings = load_settings(**options)
        elif options:
            settings = Settings(**{**settings.model_dump(), **options})
        self.settings = settings
        if runner is None:
            from kernels import plan_cache
            from worker.loader import resolve_model
            from worker.model_runner import ModelRunner

            plan_cache.use(settings.kernel_plan_dir if settings.kernel_plan_cache else None)
            model_dir = resolve_model(settings.model, settings)
            runner = ModelRunner(
                model_dir, dtype=settings.dtype, device=settings.device, kv_cache_bytes=_target_kv_bytes(settings, model_dir),
                kv_cache_dtype=settings.kv_cache_dtype, kv_cache_prefault=settings.kv_cache_prefault,
                block_size=settings.block_size, max_num_seqs=settings.max_num_seqs,
                max_batched_tokens=settings.max_batched_tokens, torch_threads=settings.torch_threads,
                max_model_len=settings.max_model_len, attention_backend=settings.attention_backend,
                tensor_parallel_size=settings.tensor_parallel_size,
                tensor_parallel_timeout=settings.tensor_parallel_timeout_seconds,
                quantization=settings.quantization, quantization_group_size=settings.quantization_group_size,
                cuda_graph_max_batch=settings.cuda_graph_max_batch,
            )
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.runner = runner
        self.tokenizer = tokenizer
        self.info = runner.info
        self.max_model_len = min(self.info.max_model_len, settings.max_model_len or self.info.max_model_len)
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, settings.enable_prefix_cache)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=settings.max_num_seqs, max_batched_tokens=settings.max_batched_tokens,
                            policy=settings.policy, batch_min_share=settings.batch_min_share,
                            max_model_len=self.max_model_len, fair_share=settings.fair_share,
                            interactive_window_s=settings.interactive_window_seconds),
            self.block_manager,
        )
        self.pacer = (StepPacer(settings.interactive_step_ms / 1000, ceiling=settings.max_batched_tokens,
                                floor=min(settings.max_num_seqs, settings.max_batched_tokens))
                      if settings.interactive_step_ms > 0 else None)
        self.speculation = _make_speculation(settings, runner)
        self._lone_token_s: float | None = None  # the last lone decode step's seconds per token (_plan_ahead)
        # where set (the worker: its pub/sub connection), a descriptor that turns readable when something new
        # arrives: a window then ends after its current token, so it may run decode_ahead_wake_ms (_plan_ahead)
        self.wake_fd: Callable[[], int] | None = None
        self.stats = EngineStats()
        self._tracks: dict[str, _Track] = {}
        self._done: dict[str, _Track] = {}  # tracks finished during the current step (still charged)
        log.info("engine ready", num_blocks=runner.num_blocks, block_size=runner.block_size,
                 policy=settings.policy, max_num_seqs=settings.max_num_seqs,
                 max_batched_tokens=settings.max_batched_tokens, prefix_cache=settings.enable_prefix_cache)

    # --- requests ---------------------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               prompt_ids: list[int] | None = None) -> list[int]:
        """Token ids of exactly one of: a text prompt, chat messages (chat template with the generation
        prompt appended) or ready token ids."""
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_ids")
        if prompt_ids is not None:
            return list(prompt_ids)
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt_ids")
        if messages is not None:
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise ValueError("the model's tokenizer has no chat template: pass prompt instead of messages")
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(prompt))

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError (with the reason) for one that can never run."""
        if not request.eos_token_ids:
            request.eos_token_ids = tuple(self.info.eos_token_ids)
        request.max_model_len = min(request.max_model_len or self.max_model_len, self.max_model_len)
        vocab = self.info.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if (reason := self.scheduler.rejection_reason(request)) is not None:
            raise ValueError(reason)
        if request.sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        detok = (IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling.stop)
                 if self.tokenizer is not None else None)
        self.scheduler.add_request(request)
        self._tracks[request.request_id] = _Track(request, detok, Usage(prompt_tokens=request.num_prompt_tokens))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Cancel a request; its blocks are freed now, its final output comes with the next step."""
        return self.scheduler.abort(request_id, reason) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def capacity(self) -> Capacity:
        requests, tokens = self.scheduler.capacity()
        return Capacity(requests=requests, tokens=tokens)

    # --- the loop ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0, start = time.perf_counter(), time.monotonic()
        self._done.clear()
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        ahead = self._plan_ahead()
        sched = self.scheduler.schedule()
        outputs = [self._final(r, time.monotonic()) for r in sched.finished if r.request_id in self._tracks]
        if not sched.scheduled:
            return outputs
        if self.speculation is not None:
            self.speculation.fill(sched.scheduled)
        usage = self.block_manager.usage
        before = [req.num_output_tokens for req, _ in sched.scheduled]
        lone = len(sched.scheduled) == 1 and sched.scheduled[0][0].is_decoding  # its time sizes _plan_ahead's window
        sampled = self.runner.execute(sched.scheduled)
        self.scheduler.postprocess(sched, sampled)
        now = time.monotonic()
        for (req, _), token, n_before in zip(sched.scheduled, sampled, before, strict=True):
            tr = self._tracks[req.request_id]
            tr.computed = max(tr.computed, req.num_computed_tokens)
            if tr.first_scheduled is None:
                tr.first_scheduled = start
                tr.usage.queue_seconds = max(0.0, start - req.arrival_time)
            if token is None:
                continue
            if tr.first_token is None:
                tr.first_token = now
                tr.usage.time_to_first_token = max(0.0, now - req.arrival_time)
            # What postprocess appended: one token, or accepted proposals + one, cut at a stop.
            outputs.append(self._token_output(tr, req.output_token_ids[n_before:], now))
        # Charge the step's wall time to the requests in it, by tokens (sums to busy_seconds).
        dt = time.perf_counter() - t0
        if ahead is not None:
            ahead.decode_ahead = False  # (postprocess clears it where the window ran, not where no slot was granted)
        if lone:
            self._lone_token_s = dt / (len(sampled[0]) if isinstance(sampled[0], list) and sampled[0] else 1)
        total = sched.num_batched_tokens
        for req, n in sched.scheduled:
            track = self._tracks.get(req.request_id) or self._done[req.request_id]
            track.usage.compute_seconds += dt * n / total
        if self.pacer is not None:
            self.scheduler.config.batch_step_tokens = self.pacer.observe(total, dt)
        st = self.stats
        st.busy_seconds += dt
        st.steps += 1
        st.kv_usage_sum += usage
        st.kv_usage_peak = max(st.kv_usage_peak, usage)
        running = self.scheduler.running
        allocated = sum(len(r.block_table) for r in running) * self.block_manager.block_size
        if allocated:
            st.kv_waste_sum += 1.0 - sum(r.num_computed_tokens for r in running) / allocated
        st.preemptions = self.scheduler.num_preemptions
        st.prefix_hit_rate = self.block_manager.hit_rate
        return outputs

    def _plan_ahead(self) -> Request | None:
        """Decode ahead: a request decoding alone (nothing else running or waiting) gets placeholders for the
        tokens after its next one, as many as fit in ``decode_ahead_ms`` at the last lone step's time per
        token; the scheduler grants them slots as it grants proposals, and the runner makes them one forward
        each (ModelRunner.execute). Why: at one sequence the Python around a step (scheduling, postprocessing,
        detokenising, streaming) is a tenth of a quantised model's step, and this pays it once per window.
        Where ``wake_fd`` gives a descriptor, the window ends after any token once it is readable (a job or a
        cancellation announced), so a newcomer waits one token, not the window, and the budget is
        ``decode_ahead_wake_ms``: the worker's own work around a step (admission, publishing) is paid per window
        too, 4-7% of a quantised step's time at 20 ms windows. Returns the request, or None when no window."""
        fd = self.wake_fd() if self.wake_fd is not None else -1
        if hasattr(self.runner, "wake_fd"):
            self.runner.wake_fd = fd
        budget = (self.settings.decode_ahead_wake_ms if fd >= 0 else self.settings.decode_ahead_ms) / 1000
        if (budget <= 0 or self.speculation is not None or not getattr(self.runner, "supports_decode_ahead", False)
                or len(self.scheduler.running) != 1 or self.scheduler.num_waiting):
            return None
        req = self.scheduler.running[0]
        if not req.is_decoding or self._lone_token_s is None:
            return None
        k = min(int(budget / max(self._lone_token_s, 1e-4)), MAX_AHEAD) - 1
        k = min(k, req.max_total_tokens - req.num_tokens - 1)
        if k <= 0:
            return None
        req.spec_token_ids, req.decode_ahead = [0] * k, True
        return req

    def _token_output(self, tr: _Track, tokens: list[int], now: float) -> RequestOutput:
        """The text delta of a step's new tokens; a stop string ends the request at the token completing it
        (later tokens of the same step, from accepted proposals, are dropped)."""
        req = tr.request
        delta = ""
        # The token that ended the request by id (EOS / stop_token_ids) is not part of the text.
        text_tokens = tokens[:-1] if req.finish_reason is FinishReason.STOP else tokens
        for i, token in enumerate(text_tokens if tr.detok is not None else ()):
            delta += tr.detok.step([token])
            if tr.detok.stopped is not None:
                tokens = self._cut_at_stop_string(req, tokens, i)
                break
        if req.is_finished:
            return self._final(req, now, delta, tokens)
        return RequestOutput(req.request_id, text_delta=delta, new_token_ids=tokens)

    def _cut_at_stop_string(self, req: Request, tokens: list[int], i: int) -> list[int]:
        """End ``req`` with STOP at ``tokens[i]``, which completed a stop string; returns the tokens kept."""
        if extra := len(tokens) - 1 - i:
            del req.output_token_ids[-extra:]
        if req.is_finished:  # the same token also hit max_tokens (or a stop id): the stop string explains it
            req.finish_reason = FinishReason.STOP
        else:
            self.scheduler.finish(req, FinishReason.STOP)
        return tokens[: i + 1]

    def _final(self, req: Request, now: float, delta: str = "", new_ids: list[int] | None = None) -> RequestOutput:
        tr = self._tracks.pop(req.request_id)
        if self.speculation is not None:
            self.speculation.forget(req.request_id)
        self._done[req.request_id] = tr
        if tr.detok is not None and tr.detok.stopped is None:
            delta += tr.detok.flush()
        u = tr.usage
        u.prompt_tokens = min(req.num_prompt_tokens, max(tr.computed, req.num_computed_tokens))
        u.cached_prompt_tokens = min(req.num_cached_tokens, u.prompt_tokens)
        u.completion_tokens = req.num_output_tokens
        u.spec_proposed_tokens, u.spec_accepted_tokens = req.num_spec_proposed, req.num_spec_accepted
        if tr.first_scheduled is not None:
            first = tr.first_token if tr.first_token is not None else now
            u.prefill_seconds = max(0.0, first - tr.first_scheduled)
            u.decode_seconds = max(0.0, now - tr.first_token) if tr.first_token is not None else 0.0
        else:
            u.queue_seconds = max(0.0, now - req.arrival_time)
        st = self.stats
        st.requests += 1
        st.prompt_tokens += u.prompt_tokens
        st.cached_prompt_tokens += u.cached_prompt_tokens
        st.completion_tokens += u.completion_tokens
        st.spec_proposed_tokens += u.spec_proposed_tokens
        st.spec_accepted_tokens += u.spec_accepted_tokens
        st.spec_drafts += req.num_spec_drafts
        reason = req.finish_reason.value if req.finish_reason else "unknown"
        st.finish_reasons[reason] = st.finish_reasons.get(reason, 0) + 1
        return RequestOutput(
            req.request_id, text_delta=delta, new_token_ids=new_ids, finished=True,
            finish_reason=req.finish_reason, text=tr.detok.text if tr.detok is not None else None,
            token_ids=list(req.output_token_ids), usage=u, error=req.error,
        )

    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request has finished; the final outputs in finishing order."""
        done = []
        while self.has_unfinished():
            done += [o for o in self.step() if o.finished]
        return done


def _make_speculation(settings: Settings, runner: Any):
    """The speculation policy the settings ask for, or None (``speculative_method=off``)."""
    if settings.speculative_method == "off":
        return None
    from worker.speculation import Speculation

    return Speculation.from_settings(settings, runner)


def _target_kv_bytes(settings: Settings, model_dir: Any) -> int:
    """The KV memory setting, less a draft model's pool (same block count as the target's) when there is one."""
    if settings.speculative_method != "draft" or not settings.speculative_draft_model:
        return settings.kv_cache_bytes
    from worker.draft import split_kv_bytes
    from worker.loader import resolve_model

    return split_kv_bytes(settings.kv_cache_bytes, model_dir, resolve_model(settings.speculative_draft_model, settings))
