"""Roofline: how close the engine gets to this CPU's matmul throughput, and where step time goes.

1. Measured matmul FLOP/s of this CPU in the dtype (``F.linear`` and inferq's planned kernel at the model's own
   GEMM shapes with a decode-sized and a prefill-sized token count, and a square 1024 GEMM), best of a few
   repeats; the peak is the best of either.
2. The model's FLOPs per token: 2 x the parameters of its matmuls (attention projections, MLP, LM head), plus
   attention's 4 x layers x heads x head_dim x context.
3. Achieved FLOP/s of the engine at saturation (the mixed workload, all requests at t=0): FLOPs of every
   token it processed / engine busy time, and MFU = achieved / measured matmul peak.
4. Step time split (wall clock, cheap wrappers on the engine's parts): scheduler, input preparation, the
   model's forward (of which attention: KV writes + attention kernels), sampling, and what remains of the
   step (engine Python: postprocess, detokenize, bookkeeping). Inside the forward, matmuls are timed by
   wrappers around every projection call (inferq's C kernels are invisible to torch.profiler); the rest is
   the other ops (norms, RoPE, activations), whose largest aten ops torch.profiler lists over a few steps.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from bench import common
from bench.workloads import mixed


def matmul_flops(dtype: str, shapes: list[tuple[int, int, int]], repeats: int = 5, min_time: float = 0.2,
                 impl: str = "torch") -> dict:
    """Best measured FLOP/s of (M x K) @ (K x N)^T for each (M, K, N): ``impl`` "torch" is ``F.linear`` (the
    BLAS), "inferq" the layout and kernel the engine's GEMM planner picks for that weight on this CPU."""
    import torch

    from kernels import cpu_gemm

    dt = getattr(torch, dtype)
    out = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dt)
        b = torch.randn(n, k, dtype=dt)  # weights stored [out, in] as in F.linear
        fn = cpu_gemm.plan(b) if impl == "inferq" else (lambda x, w=b: torch.nn.functional.linear(x, w))
        fn(a)
        best = 0.0
        for _ in range(repeats):
            iters, t0 = 0, time.perf_counter()
            while True:
                fn(a)
                iters += 1
                el = time.perf_counter() - t0
                if el >= min_time / repeats:
                    break
            best = max(best, 2.0 * m * k * n * iters / el)
        out[f"{m}x{k}x{n}"] = best
    return out


def model_flops(model_dir: Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    layers = cfg["num_hidden_layers"]
    vocab = cfg["vocab_size"]
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter
    linear_params = layers * per_layer + vocab * h
    return {"hidden": h, "heads": heads, "kv_heads": kv, "head_dim": d, "intermediate": inter, "layers": layers,
            "vocab": vocab, "matmul_params": linear_params, "flops_per_token_matmul": 2 * linear_params,
            "lm_head_flops_per_token": 2 * vocab * h,
            "attention_flops_per_token_per_context_token": 4 * layers * heads * d}


def run(model: str | None = None, *, dtypes: tuple[str, ...] = ("float32", "bfloat16"), requests: int = 64,
        seed: int = 0, prompt_len: tuple[int, int] = (32, 512), output_len: tuple[int, int] = (16, 256),
        kv_cache_memory: str = "2GiB", max_num_seqs: int = 64, max_batched_tokens: int = 2048,
        profile_steps: int = 12, threads: int | None = None, quick: bool = False,
        out: str | Path | None = None, tag: str = "roofline", log=print) -> dict:
    from bench.engines import InferqOffline

    if quick:
        requests, prompt_len, output_len, profile_steps = min(requests, 6), (8, 32), (4, 8), 3
    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(list(dtypes))
    log(common.machine_line(info))
    mf = model_flops(model_dir)
    t_start = time.perf_counter()
    per_dtype = {}
    for dtype in dtypes:
        h, inter, vocab = mf["hidden"], mf["intermediate"], mf["vocab"]
        qkv = (mf["heads"] + 2 * mf["kv_heads"]) * mf["head_dim"]
        shapes = [(64, h, 2 * inter), (64, h, qkv), (64, h, vocab), (1024, h, 2 * inter), (1024, 1024, 1024)]
        if quick:
            shapes = [(16, h, 2 * inter), (128, 128, 128)]
        log(f"[{dtype}] measuring matmul FLOP/s ...")
        mm_torch = matmul_flops(dtype, shapes, repeats=2 if quick else 5, min_time=0.05 if quick else 1.0)
        mm_inferq = matmul_flops(dtype, shapes, repeats=2 if quick else 5, min_time=0.05 if quick else 1.0,
                                 impl="inferq")
        mm = {s: max(mm_torch[s], mm_inferq[s]) for s in mm_torch}
        peak = max(mm.values())  # the best this CPU did on the model's shapes, whichever code did it
        eng = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                            max_batched_tokens=max_batched_tokens, threads=threads)
        wl = mixed(requests, seed, vocab_size=eng.info.vocab_size, prompt_len=prompt_len, output_len=output_len)
        timers = _instrument(eng)
        log(f"[{dtype}] running the mixed workload ({len(wl)} requests) with step timers ...")
        with _timed_linears(timers):
            r = eng.run(wl)
        stats = r["stats"]
        busy = stats["busy_seconds"]
        steps = stats["steps"]
        # FLOPs of the work done: every prompt and output token through the matmuls (each output token but the
        # last is fed back) and attention over its context.
        total_tokens = sum(it.prompt_len + it.max_tokens - 1 for it in wl.items)
        lm_tokens = sum(it.max_tokens for it in wl.items)  # the LM head runs only on sampled rows
        f_linear = (mf["flops_per_token_matmul"] - mf["lm_head_flops_per_token"]) * total_tokens \
            + mf["lm_head_flops_per_token"] * lm_tokens
        f_attn = mf["attention_flops_per_token_per_context_token"] * sum(
            (it.prompt_len + it.max_tokens - 1) * (it.prompt_len + it.max_tokens) / 2 for it in wl.items)
        achieved = (f_linear + f_attn) / busy if busy else 0.0
        split = {k: v / steps * 1000 for k, v in timers.totals().items()} if steps else {}
        step_ms = split.get("step", 0.0)
        model_ms = split.get("model_forward", 0.0)
        attn_ms = split.get("attention", 0.0)
        sample_ms = split.get("sampling", 0.0)
        sched_ms = split.get("schedule", 0.0) + split.get("postprocess", 0.0)
        prep_ms = split.get("prepare_inputs", 0.0)
        log(f"[{dtype}] profiling {profile_steps} steps with torch.profiler ...")
        prof_top = _profile_forward(eng, wl, profile_steps)
        # the projections run in inferq's own kernels (ctypes calls torch.profiler does not see): timed with
        # wall-clock wrappers around every Linear call, like the other parts
        matmul_ms = split.get("matmul", 0.0)
        non_attn_ms = max(0.0, model_ms - attn_ms)
        mm_share = matmul_ms / non_attn_ms if non_attn_ms else 0.0
        other_model_ms = max(0.0, non_attn_ms - matmul_ms)
        engine_py_ms = max(0.0, step_ms - model_ms - sample_ms - sched_ms - prep_ms)
        per_dtype[dtype] = {
            "matmul_flops": mm, "matmul_flops_torch": mm_torch, "matmul_flops_inferq": mm_inferq,
            "peak_matmul_flops": peak,
            "achieved_flops": achieved, "mfu": achieved / peak if peak else None,
            "matmul_mfu_in_linear_time": (f_linear / (busy * matmul_ms / step_ms) / peak) if step_ms and matmul_ms and busy else None,
            "workload": wl.summary(), "wall_s": r["wall_s"], "busy_s": busy, "steps": steps,
            "output_tok_s": r["output_tokens"] / r["wall_s"],
            "flops_linear": f_linear, "flops_attention": f_attn,
            "step_ms": step_ms,
            "split_ms": {"matmuls": matmul_ms, "attention (kv write + kernels)": attn_ms,
                         "other model ops (norm, rope, act, embed)": other_model_ms, "sampling": sample_ms,
                         "scheduler (schedule + postprocess)": sched_ms, "input preparation": prep_ms,
                         "engine python (detokenize, outputs, stats)": engine_py_ms},
            "overhead_outside_model_ms": step_ms - model_ms,
            "matmul_share_of_non_attention_forward": mm_share, "profile_top_ops": prof_top,
        }
        del eng
        log(_dtype_report(dtype, per_dtype[dtype]))
    result = {"benchmark": "roofline", "machine": info, "model": str(model_dir), "model_flops": mf,
              "dtypes": per_dtype, "elapsed_s": time.perf_counter() - t_start}
    out_dir = common.results_dir(out)
    common.write_json(out_dir, tag, result)
    _plot(result, out_dir, tag)
    log(report(result))
    return result


class _Timers:
    def __init__(self) -> None:
        self.t = defaultdict(float)

    def wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)
        t = self.t

        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                t[key] += time.perf_counter() - t0

        setattr(obj, attr, wrapped)

    def totals(self) -> dict:
        return dict(self.t)


@contextmanager
def _timed_linears(timers: _Timers):
    """Every projection call (``Linear.__call__`` / ``add_to``, class-wide) adds its wall time to "matmul"."""
    from kernels.cpu_gemm import Linear

    saved = {name: getattr(Linear, name) for name in ("__call__", "add_to")}
    depth = [0]  # add_to may call __call__: count the outer call only
    for name, fn in saved.items():
        def wrapped(*a, _fn=fn, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    timers.t["matmul"] += time.perf_counter() - t0
        setattr(Linear, name, wrapped)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(Linear, name, fn)


def _instrument(eng) -> _Timers:
    """Wrap the parts of each new engine the adapter creates (timers survive across engines)."""
    timers = _Timers()
    runner = eng.runner
    timers.wrap(runner, "_prepare", "prepare_inputs")
    timers.wrap(runner.model, "forward", "model_forward")
    timers.wrap(runner.backend, "forward", "attention")
    timers.wrap(runner.backend, "write_kv_cache", "attention")
    timers.wrap(runner.sampler, "sample", "sampling")
    orig_new = eng.new_engine

    def new_engine(**kw):
        engine = orig_new(**kw)
        timers.wrap(engine, "step", "step")
        timers.wrap(engine.scheduler, "schedule", "schedule")
        timers.wrap(engine.scheduler, "postprocess", "postprocess")
        return engine

    eng.new_engine = new_engine
    return timers


def _profile_forward(eng, wl, n_steps: int) -> list:
    """The aten ops with the most self time outside attention, from torch.profiler over a few steps in the
    middle of a run (a mix of prefill chunks and decodes): what the non-matmul model time is made of."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from scheduler.request import Request, SamplingParams

    engine = eng.new_engine()
    for k, it in enumerate(wl.items):
        engine.add_request(Request(f"p{k}", list(it.prompt_ids),
                                   SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True)))
    for _ in range(max(1, n_steps // 2)):  # past the first prefill-only steps
        if engine.has_unfinished():
            engine.step()
    backend = eng.runner.backend
    orig_fwd, orig_write = backend.forward, backend.write_kv_cache

    def fwd(*a, **kw):
        with record_function("inferq::attention"):
            return orig_fwd(*a, **kw)

    def write(*a, **kw):
        with record_function("inferq::attention"):
            return orig_write(*a, **kw)

    backend.forward, backend.write_kv_cache = fwd, write
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n_steps):
                if not engine.has_unfinished():
                    break
                engine.step()
    finally:
        backend.forward, backend.write_kv_cache = orig_fwd, orig_write
    for k in range(len(wl.items)):  # not needed any more: free the engine
        engine.abort(f"p{k}")
    while engine.has_unfinished():
        engine.step()
    del torch
    events = prof.events()
    by_name: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.name.startswith("inferq::") or ev.name.startswith("ProfilerStep"):
            continue
        # self time of aten ops outside attention
        anc, in_attn = ev.cpu_parent, False
        while anc is not None:
            if anc.name == "inferq::attention":
                in_attn = True
                break
            anc = anc.cpu_parent
        if in_attn or not ev.name.startswith("aten::"):
            continue
        st = ev.self_cpu_time_total
        by_name[ev.name] += st
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return [(k, v / 1000.0) for k, v in top]


def _dtype_report(dtype: str, d: dict) -> str:
    rows = [{"part": k, "ms": v, "share": 100 * v / d["step_ms"] if d["step_ms"] else None}
            for k, v in d["split_ms"].items()]
    torch_mm, inferq_mm = d.get("matmul_flops_torch", d["matmul_flops"]), d.get("matmul_flops_inferq", {})
    shapes = ", ".join(f"{k}: {torch_mm[k] / 1e9:.1f} / {inferq_mm.get(k, float('nan')) / 1e9:.1f}"
                       for k in d["matmul_flops"])
    return "\n".join([
        f"### {dtype}",
        f"matmul peak (measured, best of F.linear and inferq's kernel) {d['peak_matmul_flops'] / 1e9:.1f} GFLOP/s "
        f"(F.linear / inferq: {shapes})",
        f"engine achieved {d['achieved_flops'] / 1e9:.2f} GFLOP/s over busy time -> MFU {100 * (d['mfu'] or 0):.1f}% "
        f"({d['output_tok_s']:.1f} output tok/s, {d['steps']} steps, mean step {d['step_ms']:.1f} ms)",
        common.table(rows, [("part", "step part"), ("ms", "ms / step"), ("share", "% of step")]),
        f"overhead outside the model forward: {d['overhead_outside_model_ms']:.2f} ms / step",
    ])


def report(result: dict) -> str:
    mf = result["model_flops"]
    lines = [common.machine_line(result["machine"]),
             f"model: {mf['matmul_params'] / 1e6:.1f}M matmul params -> {mf['flops_per_token_matmul'] / 1e6:.0f} MFLOP/token "
             f"(+ {mf['attention_flops_per_token_per_context_token']} FLOP per context token for attention)"]
    for dtype, d in result["dtypes"].items():
        lines.append(_dtype_report(dtype, d))
    return "\n".join(lines)


def _plot(result: dict, out_dir: Path, tag: str) -> None:
    plt = common.pyplot()
    dts = list(result["dtypes"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    parts = list(next(iter(result["dtypes"].values()))["split_ms"]) if dts else []
    bottoms = [0.0] * len(dts)
    for p in parts:
        vals = [result["dtypes"][d]["split_ms"][p] for d in dts]
        ax.bar(dts, vals, bottom=bottoms, label=p)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=False)]
    ax.set_ylabel("ms per engine step (mean)")
    ax.set_title("Where a step's time goes", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    peak = [result["dtypes"][d]["peak_matmul_flops"] / 1e9 for d in dts]
    ach = [result["dtypes"][d]["achieved_flops"] / 1e9 for d in dts]
    xs = range(len(dts))
    ax.bar([x - 0.2 for x in xs], peak, 0.4, label="matmul peak (measured)")
    ax.bar([x + 0.2 for x in xs], ach, 0.4, label="engine achieved")
    for x, a, p in zip(xs, ach, peak, strict=False):
        ax.text(x + 0.2, a, f"MFU {100 * a / p:.0f}%" if p else "", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(dts)
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=8)
    fig.suptitle(f"Roofline - {result['machine']['cpu']}, {result['machine']['cores']} cores, torch "
                 f"{result['machine']['torch']}", fontsize=9)
    common.save_figure(fig, out_dir, tag)
