"""inferq's offline engine as a benchmark subject: one model load, a fresh scheduler and block manager per run
(so a repeated run never hits the previous run's prefix cache), any ``policy`` on the same weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.workloads import Workload


class InferqOffline:
    """``LLMEngine`` driven directly with token-id requests (greedy, ignore_eos, per-request max_tokens)."""

    def __init__(self, model_dir: str | Path, dtype: str, *, kv_cache_memory: str = "2GiB",
                 max_num_seqs: int = 64, max_batched_tokens: int = 2048, threads: int | None = None,
                 block_size: int = 16, tokenizer: bool = True, **settings: Any) -> None:
        # started warm, as vLLM starts (it zeroes its KV cache and runs warm-up steps before serving): the KV
        # pool's page faults are paid at start-up (kv_cache_prefault, on by default), not inside a timed run
        from inferq.settings import Settings
        from worker.engine import LLMEngine

        self.settings = Settings(model=str(model_dir), dtype=dtype, device="cpu", kv_cache_memory=kv_cache_memory,
                                 max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                                 torch_threads=threads, block_size=block_size, **settings)
        first = LLMEngine(self.settings)
        self.runner = first.runner
        self.tokenizer = first.tokenizer if tokenizer else None
        self.info = first.info
        self.engine: Any = first

    def new_engine(self, **overrides: Any):
        from inferq.settings import Settings
        from worker.engine import LLMEngine

        settings = Settings(**{**self.settings.model_dump(), **overrides})
        self.engine = LLMEngine(settings, runner=self.runner, tokenizer=self.tokenizer)
        return self.engine

    def run(self, workload: Workload, *, policy: str = "continuous", enable_prefix_cache: bool = True,
            trace: bool = False, step_hook=None, **overrides: Any) -> dict:
        """Submit every item at t=0 and step to the end. Returns wall time, useful tokens, TTFTs, stats."""
        from scheduler.request import Request, SamplingParams, Tier

        engine = self.new_engine(policy=policy, enable_prefix_cache=enable_prefix_cache, **overrides)
        n = len(workload.items)
        ttft: list[float | None] = [None] * n
        e2e: list[float | None] = [None] * n
        outputs: list[list[int]] = [[] for _ in range(n)]
        cached = [0] * n
        steps: list[tuple[float, int, int]] = []  # (t, running, batched tokens)
        t0 = time.perf_counter()
        for k, it in enumerate(workload.items):
            engine.add_request(Request(str(k), list(it.prompt_ids),
                                       SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True),
                                       tier=Tier(it.tier)))
        while engine.has_unfinished():
            if trace:
                running = len(engine.scheduler.running)
            outs = engine.step()
            now = time.perf_counter() - t0
            if trace:
                steps.append((now, running, 0))
            if step_hook is not None:
                step_hook(engine)
            for o in outs:
                k = int(o.request_id)
                if o.new_token_ids and ttft[k] is None:
                    ttft[k] = now
                if o.finished:
                    e2e[k] = now
                    outputs[k] = list(o.token_ids or [])
                    if o.usage is not None:
                        cached[k] = o.usage.cached_prompt_tokens
                    if o.error:
                        raise RuntimeError(f"inferq rejected request {k}: {o.error}")
        wall = time.perf_counter() - t0
        useful = sum(min(len(o), it.max_tokens) for o, it in zip(outputs, workload.items, strict=False))
        return {"wall_s": wall, "output_tokens": useful, "prompt_tokens": workload.prompt_tokens,
                "outputs": outputs, "ttft_s": ttft, "e2e_s": e2e, "cached_prompt_tokens": sum(cached),
                "stats": engine.stats.to_dict(), "steps": steps}
