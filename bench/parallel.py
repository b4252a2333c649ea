"""Tensor parallelism: TP=1 against TP=N on one model, side by side in one invocation.

Per size: single-stream decode tok/s (one greedy request, time from its first token to its last) and batch
throughput (``batch`` requests submitted at once, output tokens / wall time), plus whether greedy outputs
are identical to TP=1's. The default sizes are 1 and the smallest N > 1 that splits the model (SmolLM2-135M
has 9 heads and 3 KV heads: 3, not 2).

What a small CPU machine can show: every rank gets ``cores / N`` torch threads (at least one; N above the
core count oversubscribes), and each layer adds two all-reduces over gloo (TCP on loopback) plus the step
broadcast and the logits gather. The arithmetic per rank shrinks by N but the cores do not grow, so TP > 1
cannot be faster here: the numbers measure the communication overhead, not a speed-up. Tensor parallelism
pays when each rank has its own device (or its own cores and memory bandwidth) and the model does not fit one.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from bench import common


def _engine(model_dir: Path, tp: int, threads: int, dtype: str, kv_cache_memory: str, max_num_seqs: int):
    from inferq.settings import Settings
    from worker.engine import LLMEngine

    return LLMEngine(Settings(model=str(model_dir), dtype=dtype, device="cpu", kv_cache_memory=kv_cache_memory,
                              max_num_seqs=max_num_seqs, tensor_parallel_size=tp, torch_threads=threads,
                              enable_prefix_cache=False))


def _run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All ``prompts`` at once, greedy, to the end: wall time, output tokens, per-request token times."""
    from scheduler.request import Request, SamplingParams

    times: dict[str, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(Request(str(i), list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True)))
        times[str(i)] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            times[o.request_id].extend([time.perf_counter()] * len(o.new_token_ids or []))
            if o.finished:
                outputs[o.request_id] = list(o.token_ids or [])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(len(v) for v in outputs.values()), "times": times, "outputs": outputs}


def _measure(model_dir: Path, tp: int, threads: int, prompts: dict, *, dtype: str, decode_tokens: int,
             batch_tokens: int, kv_cache_memory: str) -> dict:
    """One TP size with ``threads`` torch threads in all (``threads / tp`` per rank): load, warm up,
    single-stream decode, then the batch."""
    t0 = time.perf_counter()
    engine = _engine(model_dir, tp, threads, dtype, kv_cache_memory, max(len(prompts["batch"]), 1))
    load_s = time.perf_counter() - t0
    try:
        _run(engine, prompts["single"], 4)  # warm-up: first-step allocations, C kernels' first calls
        single = _run(engine, prompts["single"], decode_tokens)
        batch = _run(engine, prompts["batch"], batch_tokens)
    finally:
        close = getattr(engine.runner.model, "close", None)
        if close is not None:
            close()
    ts = single["times"]["0"]
    return {"tp": tp, "load_s": load_s, "threads_per_rank": max(1, threads // tp),
            "decode_tok_s": (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 else None,
            "batch_requests": len(prompts["batch"]), "batch_tok_s": batch["tokens"] / batch["wall_s"],
            "outputs": {"single": single["outputs"], "batch": batch["outputs"]}}


def default_sizes(model_dir: Path) -> tuple[int, ...]:
    """1 and the smallest size above 1 that splits this model evenly."""
    from worker.model_config import load_config
    from worker.tensor_parallel import valid_sizes

    larger = [n for n in valid_sizes(load_config(model_dir)) if n > 1]
    return (1, larger[0]) if larger else (1,)


def run(model: str | None = None, *, sizes: tuple[int, ...] | None = None, dtype: str = "float32",
        decode_tokens: int = 32, batch: int = 8, batch_tokens: int = 16, prompt_len: int = 32, seed: int = 0,
        kv_cache_memory: str = "256MiB", out: str | Path | None = None, tag: str = "parallel", log=print) -> dict:
    model_dir = common.resolve_model_dir(model)
    sizes = sizes or default_sizes(model_dir)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    rng = random.Random(seed)
    from worker.model_config import load_config

    vocab = load_config(model_dir).vocab_size
    prompts = {"single": [[rng.randrange(3, vocab) for _ in range(prompt_len)]],
               "batch": [[rng.randrange(3, vocab) for _ in range(rng.randrange(prompt_len // 2, prompt_len))]
                         for _ in range(batch)]}
    t_start, load_start = time.perf_counter(), os.getloadavg()
    cores = os.cpu_count() or 1
    # the last run is a control: TP=1 on one thread, what each rank gets at TP >= cores (it tells the cost of
    # the collectives apart from that of fewer threads per process; on a busy machine a multi-threaded run
    # also loses whole time slices at every barrier of its thread pool)
    runs = [(tp, cores) for tp in sizes] + ([(1, 1)] if cores > 1 else [])
    rows = [_measure(model_dir, tp, threads, prompts, dtype=dtype, decode_tokens=decode_tokens,
                     batch_tokens=batch_tokens, kv_cache_memory=kv_cache_memory) for tp, threads in runs]
    base, first_outputs = rows[0], rows[0]["outputs"]
    for r in rows:
        r["identical_to_first"] = r.pop("outputs") == first_outputs
        r["decode_vs_first"] = r["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else None
        r["batch_vs_first"] = r["batch_tok_s"] / base["batch_tok_s"]
        log(f"TP={r['tp']} ({r['threads_per_rank']} threads/rank): decode {r['decode_tok_s']:.1f} tok/s "
            f"({r['decode_vs_first']:.2f}x the first row), batch of {r['batch_requests']} {r['batch_tok_s']:.1f} "
            f"tok/s ({r['batch_vs_first']:.2f}x), load {r['load_s']:.1f}s, greedy identical: {r['identical_to_first']}")
    result = {"benchmark": "parallel", "machine": info, "model": str(model_dir), "rows": rows,
              "settings": {"sizes": list(sizes), "dtype": dtype, "decode_tokens": decode_tokens, "batch": batch,
                           "batch_tokens": batch_tokens, "prompt_len": prompt_len, "seed": seed},
              "note": "ranks share this machine's cores (cores / N threads each): TP > 1 measures the all-reduce "
                      "overhead here, not a speed-up"}
    return common.finish_run(result, t_start=t_start, load_start=load_start, out=out, tag=tag, plot=plot,
                             report=report, log=log)


def report(result: dict) -> str:
    cols = [("tp", "TP"), ("threads_per_rank", "threads/rank"), ("decode_tok_s", "decode tok/s"),
            ("decode_vs_first", "decode ratio"), ("batch_tok_s", "batch tok/s"), ("batch_vs_first", "batch ratio"),
            ("load_s", "load s"), ("identical_to_first", "identical")]
    lines = [common.table(result["rows"], cols)]
    control = next((r for r in result["rows"][1:] if r["tp"] == 1), None)
    for r in result["rows"]:
        if control is not None and r["tp"] > 1 and r["threads_per_rank"] == control["threads_per_rank"]:
            lines.append(f"TP={r['tp']} vs TP=1 at {control['threads_per_rank']} thread(s) per process: decode "
                         f"{r['decode_tok_s'] / control['decode_tok_s']:.2f}x, batch "
                         f"{r['batch_tok_s'] / control['batch_tok_s']:.2f}x")
    return "\n".join([*lines, result["note"]])


def plot(result: dict, out_dir: Path, tag: str) -> None:
    plt = common.pyplot()
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, title in ((axes[0], "decode_tok_s", "single-stream decode"), (axes[1], "batch_tok_s", "batch")):
        ax.bar([f"TP={r['tp']}\n{r['threads_per_rank']} thr/rank" for r in rows], [r[key] or 0 for r in rows], color="#4c72b0")
        ax.set_title(title)
        ax.set_ylabel("output tok/s")
    common.save_figure(fig, out_dir, tag)
