"""KV-cache memory: waste and concurrency of the paged cache against contiguous max-length reservation.

The mixed workload runs with a fixed, deliberately small KV budget (default: what 16 sequences of the
reference maximum length would reserve contiguously), so memory, not ``max_num_seqs``, bounds the batch.
Per engine step we record the running sequences and the allocated-but-unfilled slots. The contiguous
baseline reserves ``max_len`` tokens per sequence up front, so it holds ``budget // max_len`` sequences;
two references are given: the engine's max_model_len cap (what a server accepting any request must
reserve) and the longest request of this workload (the best case for contiguous reservation).
"""

from __future__ import annotations

import time
from pathlib import Path

from bench import common
from bench.workloads import mixed


def run(model: str | None = None, *, dtype: str = "float32", requests: int = 64, seed: int = 0,
        prompt_len: tuple[int, int] = (32, 512), output_len: tuple[int, int] = (16, 256),
        kv_cache_memory: str | None = None, reference_seqs: int = 16, max_model_len: int = 2048,
        max_num_seqs: int = 256, max_batched_tokens: int = 2048, threads: int | None = None,
        out: str | Path | None = None, tag: str = "memory", log=print) -> dict:
    from bench.engines import InferqOffline
    from inferq.settings import parse_size

    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start = time.perf_counter()
    workload_max = prompt_len[1] + output_len[1]
    per_token = _kv_bytes_per_token(model_dir, dtype)
    budget = parse_size(kv_cache_memory) if kv_cache_memory else reference_seqs * workload_max * per_token
    eng = InferqOffline(model_dir, dtype, kv_cache_memory=str(budget), max_num_seqs=max_num_seqs,
                        max_batched_tokens=max_batched_tokens, threads=threads, max_model_len=max_model_len)
    wl = mixed(requests, seed, vocab_size=eng.info.vocab_size, prompt_len=prompt_len, output_len=output_len)
    log(f"workload: {wl.summary()}")
    block_size = eng.runner.block_size
    budget_tokens = eng.runner.num_blocks * block_size
    engine_max_len = min(max_model_len, eng.info.max_model_len)
    trace: list[dict] = []

    def hook(engine) -> None:
        running = engine.scheduler.running
        allocated = sum(len(r.block_table) for r in running) * block_size
        filled = sum(r.num_computed_tokens for r in running)
        trace.append({"running": len(running), "allocated_slots": allocated, "filled_slots": filled,
                      "waste": (1 - filled / allocated) if allocated else 0.0,
                      "usage": engine.block_manager.usage})

    log(f"KV budget {budget / 2**20:.1f} MiB = {eng.runner.num_blocks} blocks x {block_size} = {budget_tokens} tokens")
    r = eng.run(wl, step_hook=hook)
    steps = [t for t in trace if t["allocated_slots"]]
    peak = max((t["running"] for t in trace), default=0)
    waste_mean = common.mean(t["waste"] for t in steps) or 0.0
    contiguous = {
        f"max_model_len ({engine_max_len})": budget_tokens // engine_max_len,
        f"workload max ({workload_max})": budget_tokens // workload_max,
    }
    # Contiguous reservation also wastes the unfilled tail of each reservation: mean over the same steps.
    contiguous_waste = {}
    for name, L in (("max_model_len", engine_max_len), ("workload_max", workload_max)):
        w = [1 - t["filled_slots"] / (t["running"] * L) for t in steps if t["running"]]
        contiguous_waste[name] = common.mean(w)
    ratios = {k: (peak / v if v else None) for k, v in contiguous.items()}
    mean_running = common.mean(t["running"] for t in trace)
    result = {
        "benchmark": "memory", "machine": info, "model": str(model_dir), "workload": wl.summary(),
        "kv_budget_bytes": budget, "kv_budget_tokens": budget_tokens, "block_size": block_size,
        "kv_bytes_per_token": per_token,
        "paged": {"kv_waste_mean_pct": 100 * waste_mean, "kv_waste_engine_stat_pct": 100 * r["stats"].get("kv_waste", 0),
                  "peak_concurrent_seqs": peak, "mean_concurrent_seqs": mean_running,
                  "kv_usage_peak": r["stats"].get("kv_usage_peak"), "preemptions": r["stats"].get("preemptions"),
                  "steps": len(trace), "wall_s": r["wall_s"], "output_tok_s": r["output_tokens"] / r["wall_s"]},
        "contiguous_max_concurrent_seqs": contiguous, "contiguous_waste_mean_pct":
            {k: (100 * v if v is not None else None) for k, v in contiguous_waste.items()},
        "concurrency_ratio": ratios,
        "max_batch_sustained": peak,
        "targets": [
            {"target": "paged KV waste (mean over steps) < 4%", "measured": 100 * waste_mean, "met": waste_mean < 0.04},
            *({"target": f">= 3x the concurrent sequences of contiguous reservation at {k}", "measured": v,
               "met": None if v is None else v >= 3.0} for k, v in ratios.items()),
        ],
        "trace": trace, "elapsed_s": time.perf_counter() - t_start,
    }
    out_dir = common.results_dir(out)
    common.write_json(out_dir, tag, result)
    _plot(result, out_dir, tag)
    log(report(result))
    return result


def _kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def report(result: dict) -> str:
    p = result["paged"]
    rows = [{"scheme": "paged (inferq)", "concurrent": p["peak_concurrent_seqs"], "waste": p["kv_waste_mean_pct"],
             "ratio": 1.0}]
    for k, v in result["contiguous_max_concurrent_seqs"].items():
        wkey = "max_model_len" if k.startswith("max_model_len") else "workload_max"
        rows.append({"scheme": f"contiguous, reserve {k}", "concurrent": v,
                     "waste": result["contiguous_waste_mean_pct"].get(wkey),
                     "ratio": result["concurrency_ratio"][k]})
    lines = [common.machine_line(result["machine"]),
             f"KV budget {result['kv_budget_bytes'] / 2**20:.1f} MiB = {result['kv_budget_tokens']} tokens "
             f"(block {result['block_size']}); workload {result['workload']}",
             common.table(rows, [("scheme", "scheme"), ("concurrent", "peak concurrent seqs"),
                                 ("waste", "KV waste % (mean over steps)"), ("ratio", "paged / this")]),
             f"mean concurrent {common.fmt(p['mean_concurrent_seqs'])}, preemptions {p['preemptions']}, "
             f"peak KV usage {common.fmt(p['kv_usage_peak'])}, {p['output_tok_s']:.1f} output tok/s"]
    lines += common.target_lines(result["targets"])
    return "\n".join(lines)


def _plot(result: dict, out_dir: Path, tag: str) -> None:
    plt = common.pyplot()
    tr = result["trace"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(tr))
    ax[0].plot(xs, [t["running"] for t in tr], label="paged: running sequences")
    for k, v in result["contiguous_max_concurrent_seqs"].items():
        ax[0].axhline(v, linestyle="--", color="gray" if "model" in k else "tab:red", label=f"contiguous @ {k}")
    ax[0].set_xlabel("engine step")
    ax[0].set_ylabel("concurrent sequences")
    ax[0].legend(fontsize=8)
    ax[1].plot(xs, [100 * t["waste"] for t in tr], label="paged waste %")
    ax[1].plot(xs, [100 * t["usage"] for t in tr], label="blocks in use %")
    ax[1].set_xlabel("engine step")
    ax[1].set_ylabel("%")
    ax[1].legend(fontsize=8)
    p = result["paged"]
    fig.suptitle(f"KV budget {result['kv_budget_tokens']} tokens: paged peak {p['peak_concurrent_seqs']} seqs, "
                 f"waste {p['kv_waste_mean_pct']:.2f}% - {result['machine']['cpu']}, {result['machine']['dtype']}",
                 fontsize=9)
    common.save_figure(fig, out_dir, tag)
