"""Prefix caching: 64 requests sharing a 512-token system prompt, each with a short distinct question.

Two ways of arriving, each run with the prefix cache on and off (alternating, same invocation):
- burst: all requests at t=0 (an offline batch); TTFT is measured from submission, so it includes queueing
  behind other requests' prefill, which is exactly what the cache removes;
- sequential: one request at a time on an idle engine (max_tokens=1 for a subset): TTFT is the prefill
  latency of one request.
Reported: TTFT p50/p95, output throughput, prefix hit rate and prompt tokens served from the cache.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench import common
from bench.workloads import WorkItem, Workload, shared_prefix


def run(model: str | None = None, *, dtype: str = "float32", requests: int = 64, seed: int = 0,
        prefix_len: int = 512, question_len: tuple[int, int] = (16, 48), output_len: int = 32,
        sequential_requests: int = 16, repeats: int = 1, kv_cache_memory: str = "2GiB",
        max_num_seqs: int = 64, max_batched_tokens: int = 2048, threads: int | None = None,
        out: str | Path | None = None, tag: str = "prefix", log=print) -> dict:
    from bench.engines import InferqOffline

    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    eng = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                        max_batched_tokens=max_batched_tokens, threads=threads)
    wl = shared_prefix(requests, seed, vocab_size=eng.info.vocab_size, prefix_len=prefix_len,
                       question_len=question_len, output_len=output_len)
    log(f"workload: {wl.summary()}")
    seq_wl = Workload("shared_prefix_sequential",
                      [WorkItem(it.prompt_ids, 1, shared_prefix_len=it.shared_prefix_len)
                       for it in wl.items[:sequential_requests]], wl.params)
    rows: list[dict] = []
    for rep in range(repeats):
        order = (True, False) if rep % 2 == 0 else (False, True)
        for mode in ("burst", "sequential"):
            for cache in order:
                log(f"[rep {rep}] {mode}, prefix cache {'on' if cache else 'off'} ...")
                if mode == "burst":
                    r = eng.run(wl, enable_prefix_cache=cache)
                    ttft = [t for t in r["ttft_s"] if t is not None]
                    wall, out_tokens, cached = r["wall_s"], r["output_tokens"], r["cached_prompt_tokens"]
                    hit = r["stats"].get("prefix_hit_rate")
                else:
                    ttft, wall, out_tokens, cached, hit = _sequential(eng, seq_wl, cache)
                prompt_tokens = (wl if mode == "burst" else seq_wl).prompt_tokens
                row = {"mode": mode, "prefix_cache": cache, "repeat": rep, "requests": len(ttft),
                       "ttft_p50_ms": 1000 * common.percentile(ttft, 50),
                       "ttft_p95_ms": 1000 * common.percentile(ttft, 95),
                       "ttft_mean_ms": 1000 * common.mean(ttft), "wall_s": wall,
                       "output_tok_s": out_tokens / wall, "prompt_tokens": prompt_tokens,
                       "cached_prompt_tokens": cached, "prefill_tokens_computed": prompt_tokens - cached,
                       "prefill_saved_pct": 100.0 * cached / prompt_tokens if prompt_tokens else 0.0,
                       "hit_rate": hit}
                rows.append(row)
                log(f"  TTFT p50 {row['ttft_p50_ms']:.0f} ms, p95 {row['ttft_p95_ms']:.0f} ms, "
                    f"{row['output_tok_s']:.1f} out tok/s, saved {row['prefill_saved_pct']:.1f}% of prefill")
    summary = {}
    for mode in ("burst", "sequential"):
        for cache in (True, False):
            rs = [r for r in rows if r["mode"] == mode and r["prefix_cache"] == cache]
            summary[f"{mode}-{'on' if cache else 'off'}"] = {
                k: common.mean(r[k] for r in rs) for k in ("ttft_p50_ms", "ttft_p95_ms", "output_tok_s", "wall_s",
                                                           "cached_prompt_tokens", "prefill_saved_pct")
            } | {"hit_rate": common.mean(r["hit_rate"] for r in rs if r["hit_rate"] is not None)}
    targets = []
    for mode in ("burst", "sequential"):
        on, off = summary[f"{mode}-on"], summary[f"{mode}-off"]
        drop = 100.0 * (1 - on["ttft_p50_ms"] / off["ttft_p50_ms"]) if off["ttft_p50_ms"] else None
        summary[f"{mode}-ttft_p50_reduction_pct"] = drop
        summary[f"{mode}-throughput_ratio_on_over_off"] = (on["output_tok_s"] / off["output_tok_s"]
                                                           if off["output_tok_s"] else None)
        targets.append({"target": f"{mode}: TTFT p50 down >= 70% with the prefix cache", "measured": drop,
                        "met": None if drop is None else drop >= 70.0})
    result = {"benchmark": "prefix", "machine": info, "model": str(model_dir), "workload": wl.summary(),
              "settings": {"kv_cache_memory": kv_cache_memory, "max_num_seqs": max_num_seqs,
                           "max_batched_tokens": max_batched_tokens, "sequential_requests": sequential_requests},
              "rows": rows, "summary": summary, "targets": targets, "elapsed_s": time.perf_counter() - t_start,
              "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    out_dir = common.results_dir(out)
    common.write_json(out_dir, tag, result)
    _plot(result, out_dir, tag)
    log(report(result))
    return result


def _sequential(eng, wl: Workload, cache: bool):
    """One request at a time on one engine (the cache persists between them, as in a server)."""
    from scheduler.request import Request, SamplingParams

    engine = eng.new_engine(enable_prefix_cache=cache)
    ttft, cached, out_tokens = [], 0, 0
    t_all = time.perf_counter()
    for k, it in enumerate(wl.items):
        t0 = time.perf_counter()
        engine.add_request(Request(f"s{k}", list(it.prompt_ids),
                                   SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True)))
        first = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.new_token_ids and first is None:
                    first = time.perf_counter() - t0
                if o.finished:
                    out_tokens += len(o.token_ids or [])
                    cached += o.usage.cached_prompt_tokens if o.usage else 0
        ttft.append(first)
    wall = time.perf_counter() - t_all
    return ttft, wall, out_tokens, cached, engine.stats.to_dict().get("prefix_hit_rate")


def report(result: dict) -> str:
    s = result["summary"]
    rows = [{"case": k, **v} for k, v in s.items() if isinstance(v, dict)]
    lines = [common.machine_line(result["machine"]), f"workload: {result['workload']}",
             common.table(rows, [("case", "mode / cache"), ("ttft_p50_ms", "TTFT p50 ms"),
                                 ("ttft_p95_ms", "TTFT p95 ms"), ("output_tok_s", "output tok/s"),
                                 ("hit_rate", "hit rate"), ("cached_prompt_tokens", "prompt tokens from cache"),
                                 ("prefill_saved_pct", "prefill saved %")])]
    for mode in ("burst", "sequential"):
        lines.append(f"{mode}: TTFT p50 reduction {common.fmt(s.get(f'{mode}-ttft_p50_reduction_pct'), 1)}%, "
                     f"throughput on/off {common.fmt(s.get(f'{mode}-throughput_ratio_on_over_off'))}x")
    for t in result["targets"]:
        lines.append(common.target_line(t["target"], ">= 70%", t["measured"], t["met"]))
    lines.append(f"elapsed {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _plot(result: dict, out_dir: Path, tag: str) -> None:
    plt = common.pyplot()
    s = result["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, ("burst", "sequential"), strict=False):
        cases = ["on", "off"]
        p50 = [s[f"{mode}-{c}"]["ttft_p50_ms"] or 0 for c in cases]
        p95 = [s[f"{mode}-{c}"]["ttft_p95_ms"] or 0 for c in cases]
        xs = range(len(cases))
        ax.bar([x - 0.2 for x in xs], p50, 0.4, label="TTFT p50")
        ax.bar([x + 0.2 for x in xs], p95, 0.4, label="TTFT p95")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"prefix cache {c}" for c in cases])
        ax.set_ylabel("ms")
        red = s.get(f"{mode}-ttft_p50_reduction_pct")
        ax.set_title(f"{mode}: p50 {'-' if red is None else f'{red:.0f}% lower'} with cache", fontsize=9)
        ax.legend(fontsize=8)
    w = result["workload"]
    fig.suptitle(f"Shared {w['prefix_len']}-token prefix, {w['requests']} requests - {result['machine']['cpu']}, "
                 f"{result['machine']['dtype']}", fontsize=9)
    common.save_figure(fig, out_dir, tag)
