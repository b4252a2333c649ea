"""Where an engine step's time goes, on a subset of the mixed workload.

``python -m bench.profile_engine [--requests 16] [--output-len 16 64] [--dtype float32] [--profile torch]``

Runs inferq (one model load, a warm-up run, then the timed run) on ``mixed(requests, seed)`` with shorter
outputs, and prints:

* output tokens/s (and total tokens/s) of the timed run, optionally side by side with HF ``generate`` on
  static batches (``--hf``) and inferq's static policy (``--static``), all in this one process;
* a per-step split of the wall time: scheduler, runner input preparation, the model forward, sampling,
  engine postprocessing (everything else of ``engine.step``), in ms per step;
* with ``--profile torch``: the forward's operators grouped as matmul / attention / KV write / norm+rope+act /
  gather+copy / other, in ms per step (torch.profiler, one extra run: profiling inflates small-op times);
* with ``--profile cprofile``: the top Python functions by cumulative time.

Always run it as ``flock /tmp/inferq-heavy.lock timeout 900 .venv/bin/python -m bench.profile_engine ...`` on
the shared box, and compare variants inside one run, never across runs.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from bench import common
from bench.workloads import Workload, mixed

# aten op name prefix -> category (first match wins)
_CATEGORIES = (
    ("matmul", ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm", "mkldnn", "aten::_mkl",
                "aten::baddbmm")),
    ("attention", ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "aten::_flash_attention",
                   "aten::softmax", "aten::_softmax")),
    ("kv write", ("aten::index_copy",)),
    ("gather/copy", ("aten::index_select", "aten::index", "aten::copy_", "aten::contiguous", "aten::clone",
                     "aten::to", "aten::_to_copy", "aten::cat", "aten::embedding", "aten::gather",
                     "aten::masked_fill", "aten::empty", "aten::zeros", "aten::fill_", "aten::repeat")),
    ("norm/rope/act", ("aten::rms_norm", "aten::_fused_rms_norm", "aten::mul", "aten::add", "aten::sub",
                       "aten::silu", "aten::rsqrt", "aten::pow", "aten::mean")),
    ("sampling", ("aten::argmax", "aten::topk", "aten::sort", "aten::exponential_")),
)


def _category(name: str) -> str:
    for cat, prefixes in _CATEGORIES:
        if any(name.startswith(p) for p in prefixes):
            return cat
    return "other"


class StepTimer:
    """Wraps the engine's scheduler and the runner's stages with wall-clock timers (ms per step)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.shapes: list[tuple[int, int, int, float]] = []
        self._patched: list[tuple[object, str, object]] = []

    def wrap(self, obj: object, attr: str, label: str) -> None:
        fn = getattr(obj, attr)
        t = self.t

        def timed(*a, **kw):
            s = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                t[label] += time.perf_counter() - s

        self._patched.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timed)

    def unwrap(self) -> None:
        for obj, attr, old in reversed(self._patched):
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
        self._patched.clear()

    def instrument(self, engine) -> None:
        runner = engine.runner
        self.wrap(engine, "step", "step")
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.scheduler, "postprocess", "sched.postprocess")
        self.wrap(runner, "execute", "execute")
        # per-step shape and time: (tokens, sequences, decodes, seconds)
        execute = runner.execute
        shapes = self.shapes

        def execute_logged(batch):
            s = time.perf_counter()
            try:
                return execute(batch)
            finally:
                shapes.append((sum(n for _, n in batch), len(batch), sum(n == 1 for _, n in batch),
                               time.perf_counter() - s))

        runner.execute = execute_logged
        self.wrap(runner, "_prepare", "prepare")
        self.wrap(runner.model, "forward", "forward")
        self.wrap(runner.sampler, "sample", "sample")

    def report(self, steps: int) -> str:
        t = self.t
        fwd = t["forward"]
        rows = [
            ("scheduler.schedule", t["schedule"]),
            ("runner: prepare inputs", t["prepare"]),
            ("runner: metadata + tensors", t["execute"] - t["prepare"] - fwd - t["sample"]),
            ("model forward", fwd),
            ("sampling", t["sample"]),
            ("scheduler.postprocess", t["sched.postprocess"]),
            ("engine bookkeeping (rest)", t["step"] - t["schedule"] - t["execute"] - t["sched.postprocess"]),
        ]
        lines = [f"per-step time split over {steps} steps (ms/step, % of step):"]
        total = t["step"]
        for name, v in rows:
            lines.append(f"  {name:30s} {1e3 * v / max(1, steps):8.3f}  {100 * v / max(total, 1e-12):5.1f}%")
        lines.append(f"  {'engine.step total':30s} {1e3 * total / max(1, steps):8.3f}")
        lines.append(f"  outside the model forward: {1e3 * (total - fwd) / max(1, steps):.3f} ms/step")
        lines.append("runner.execute by step kind (steps, seconds, mean ms/step, mean tokens, mean sequences):")
        kinds: dict[str, list] = defaultdict(list)
        for tokens, seqs, decodes, sec in self.shapes:
            if decodes == seqs:
                kind = f"decode-only S={16 * ((seqs - 1) // 16) + 1}-{16 * ((seqs - 1) // 16 + 1)}"
            else:
                kind = "with prefill tokens"
            kinds[kind].append((tokens, seqs, sec))
        for kind in sorted(kinds):
            rows_ = kinds[kind]
            sec = sum(r[2] for r in rows_)
            lines.append(f"  {kind:24s} {len(rows_):5d} {sec:8.2f} s {1e3 * sec / len(rows_):9.2f} "
                         f"{sum(r[0] for r in rows_) / len(rows_):8.1f} {sum(r[1] for r in rows_) / len(rows_):6.1f}")
        return "\n".join(lines)


def run_inferq(eng, wl: Workload, policy: str = "continuous", timer: StepTimer | None = None) -> dict:
    if timer is None:
        return eng.run(wl, policy=policy)
    # run() makes a fresh engine; instrument it through a step hook on the first step.
    state = {"done": False}

    orig_new_engine = eng.new_engine

    def new_engine(**kw):
        e = orig_new_engine(**kw)
        timer.instrument(e)
        state["engine"] = e
        return e

    eng.new_engine = new_engine
    try:
        return eng.run(wl, policy=policy)
    finally:
        eng.new_engine = orig_new_engine
        timer.unwrap()


def torch_profile(eng, wl: Workload, steps_hint: int, top: int = 25) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        r = eng.run(wl, policy="continuous")
    steps = r["stats"]["steps"] or steps_hint
    by_cat: dict[str, float] = defaultdict(float)
    rows = []
    for ev in prof.key_averages():
        # self time, so nested ops are not double counted
        self_us = ev.self_cpu_time_total
        if not ev.key.startswith("aten::") and not ev.key.startswith("mkldnn"):
            continue
        by_cat[_category(ev.key)] += self_us
        rows.append((self_us, ev.key, ev.count))
    total = sum(by_cat.values())
    lines = [f"torch.profiler, aten self time by category (ms/step over {steps} steps; profiled run "
             f"{r['wall_s']:.2f}s, threads {torch.get_num_threads()}):"]
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:16s} {us / 1e3 / steps:8.3f}  {100 * us / max(total, 1):5.1f}%")
    lines.append(f"  {'aten total':16s} {total / 1e3 / steps:8.3f}")
    lines.append(f"top {top} aten ops by self time (ms total, calls):")
    for us, key, count in sorted(rows, reverse=True)[:top]:
        lines.append(f"  {key:48s} {us / 1e3:9.1f} ms  {count:7d}")
    return "\n".join(lines)


def synthetic_batch(runner, kind: str, num_seqs: int, ctx: tuple[int, int], seed: int = 0, chunk: int = 0):
    """A ready-to-run ``execute`` batch without a scheduler: ``kind`` "decode" (num_seqs sequences, context
    lengths uniform in ``ctx``, one new token each) or "prefill" (num_seqs prompts of ``chunk`` tokens, no
    context). Blocks are drawn at random from the whole pool (the cache holds junk: timing only)."""
    import random

    from scheduler.request import Request, SamplingParams

    rng = random.Random(seed)
    bs = runner.block_size
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    batch = []
    for i in range(num_seqs):
        if kind == "decode":
            total = rng.randint(*ctx)
            prompt = [rng.randrange(100, runner.info.vocab_size) for _ in range(total - 1)]
            r = Request(f"s{i}", prompt, SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True))
            r.output_token_ids = [rng.randrange(100, runner.info.vocab_size)]
            r.num_computed_tokens = total - 1
            n = 1
        else:
            total = chunk
            r = Request(f"p{i}", [rng.randrange(100, runner.info.vocab_size) for _ in range(total)],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
            n = total
        need = -(-total // bs)
        r.block_table = [free.pop() for _ in range(need)]
        batch.append((r, n))
    return batch


def forward_bench(runner, variants: dict, cases: dict, repeats: int = 5, log=print) -> dict:
    """Time ``runner.execute`` on each synthetic case under each variant (a callable that configures the
    runner), variants interleaved round-robin, best of ``repeats``. Returns {case: {variant: ms}}."""
    import torch

    out: dict = {}
    for cname, batch in cases.items():
        best = {v: float("inf") for v in variants}
        with torch.inference_mode():
            for setup in variants.values():  # warm-up each variant once
                setup()
                runner.execute(batch)
            for rep in range(repeats):
                order = list(variants) if rep % 2 == 0 else list(reversed(variants))
                for v in order:
                    variants[v]()
                    t = time.perf_counter()
                    runner.execute(batch)
                    best[v] = min(best[v], time.perf_counter() - t)
        out[cname] = {v: 1e3 * s for v, s in best.items()}
        base = next(iter(variants))
        log(f"{cname:28s} " + "  ".join(f"{v} {1e3 * best[v]:8.2f} ms ({best[base] / best[v]:.2f}x)"
                                         for v in variants))
    return out


def default_cases(runner) -> dict:
    """Step shapes of the mixed workload: full decode batches at its context lengths, smaller ones, and a
    2048-token prefill step."""
    return {
        "decode S=64 ctx 40-760": synthetic_batch(runner, "decode", 64, (40, 760)),
        "decode S=32 ctx 300-760": synthetic_batch(runner, "decode", 32, (300, 760), seed=1),
        "decode S=8 ctx 300-760": synthetic_batch(runner, "decode", 8, (300, 760), seed=2),
        "prefill 4x512": synthetic_batch(runner, "prefill", 4, (0, 0), seed=3, chunk=512),
    }


def step_bench(runner, repeats: int = 5, log=print) -> dict:
    """ms per ``runner.execute`` on :func:`default_cases`, with attention and with attention replaced by a copy
    of the query (the difference is attention's share), interleaved, best of ``repeats``."""
    from kernels import backend

    real = backend.CPUBackend.forward

    def with_attention() -> None:
        backend.CPUBackend.forward = real

    def without_attention() -> None:
        backend.CPUBackend.forward = lambda self, query, *a, **k: query.clone()

    try:
        return forward_bench(runner, {"full step": with_attention, "no attention": without_attention},
                             default_cases(runner), repeats=repeats, log=log)
    finally:
        backend.CPUBackend.forward = real


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", choices=("none", "torch", "cprofile"), default="none")
    ap.add_argument("--static", action="store_true", help="also time inferq --policy static")
    ap.add_argument("--hf", action="store_true", help="also time HF generate, static batches of --hf-batch")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", action="store_true",
                    help="time single synthetic steps instead (decode with 64/32/8 sequences at the mixed "
                         "workload's context lengths, a 4 x 512-token prefill), with and without attention")
    args = ap.parse_args(argv)

    import os

    import torch

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    from bench.engines import InferqOffline

    model_dir = common.resolve_model_dir(args.model)
    eng = InferqOffline(model_dir, args.dtype, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                        threads=threads, tokenizer=False)
    if args.steps:
        print(common.machine_line(common.machine_info(args.dtype)), f"| torch threads {torch.get_num_threads()}")
        step_bench(eng.runner)
        return
    wl = mixed(args.requests, args.seed, vocab_size=int(eng.info.vocab_size), prompt_len=tuple(args.prompt_len),
               output_len=tuple(args.output_len))
    print(common.machine_line(common.machine_info(args.dtype)), f"| torch threads {torch.get_num_threads()}")
    print(f"workload: {wl.summary()}")
    print(f"settings: max_num_seqs {args.max_num_seqs}, max_batched_tokens {args.max_batched_tokens}")
    warm = mixed(4, args.seed + 1, vocab_size=int(eng.info.vocab_size), prompt_len=(32, 256), output_len=(4, 8))
    eng.run(warm)

    hf_model = None
    if args.hf:
        from bench.peers import hf

        hf_model = hf.load_hf_model(model_dir, args.dtype)
        hf.hf_static_generate(hf_model, warm, args.hf_batch)

    for rep in range(args.repeats):
        timer = StepTimer()
        r = run_inferq(eng, wl, "continuous", timer)
        steps = r["stats"]["steps"]
        base = r["output_tokens"] / r["wall_s"]
        print(f"[rep {rep}] inferq continuous: {base:8.1f} output tok/s, "
              f"{(r['output_tokens'] + r['prompt_tokens']) / r['wall_s']:8.1f} total tok/s, "
              f"{r['wall_s']:.2f}s, {steps} steps, {1e3 * r['wall_s'] / steps:.2f} ms/step")
        print(timer.report(steps))
        if args.static:
            s = eng.run(wl, policy="static")
            tps = s["output_tokens"] / s["wall_s"]
            print(f"[rep {rep}] inferq static:     {tps:8.1f} output tok/s, {s['wall_s']:.2f}s  "
                  f"-> continuous/static {base / tps:.2f}x")
        if hf_model is not None:
            from bench.peers import hf

            h = hf.hf_static_generate(hf_model, wl, args.hf_batch)
            tps = h["output_tokens"] / h["wall_s"]
            same = sum(a == b for a, b in zip(r["outputs"], h["outputs"], strict=True)) / len(wl.items)
            print(f"[rep {rep}] HF static x{args.hf_batch}:    {tps:8.1f} output tok/s, {h['wall_s']:.2f}s  "
                  f"-> inferq/HF {base / tps:.2f}x (same tokens {same:.0%})")

    if args.profile == "torch":
        print(torch_profile(eng, wl, steps))
    elif args.profile == "cprofile":
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        eng.run(wl)
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
