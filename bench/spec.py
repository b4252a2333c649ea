"""Speculative decoding: n-gram proposals against plain decoding, side by side in one invocation.

Two workloads with the default instruct model, EOS honoured, greedy:
- copy-heavy: asked to repeat, or correct the typos of, paragraphs of the license texts the system ships
  (/usr/share/common-licenses), so answers quote long spans of their prompts: what prompt lookup is for;
- mixed: the synthetic mixed workload (random token prompts), where proposals are rarely right.
Each at client concurrency 1, 4, 16, 64 (that many requests in flight; the next is added when one ends),
``off`` and ``ngram`` alternating on one loaded model. Reported: output tok/s, TPOT p50/p95, acceptance rate
and mean accepted length, and whether greedy outputs were identical.
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

from bench import common

LICENSES = Path("/usr/share/common-licenses")
ASKS = ("Repeat the following text exactly, word for word:\n\n{text}",
        "Correct the spelling mistakes in the following text and write it out in full:\n\n{text}")


def _paragraphs(min_words: int = 40, max_words: int = 110) -> list[str]:
    paras: list[str] = []
    for name in ("Apache-2.0", "GPL-3", "MPL-2.0", "LGPL-3", "Artistic", "BSD"):
        path = LICENSES / name
        if not path.exists():
            continue
        for block in re.split(r"\n\s*\n", path.read_text(errors="replace")):
            words = block.split()
            if min_words <= len(words) <= max_words:
                paras.append(" ".join(words))
    if not paras:
        raise SystemExit(f"no license texts under {LICENSES}: the copy-heavy workload needs real text")
    return paras


def _typos(text: str, rng: random.Random) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), max(1, len(words) // 12)):
        w = words[i]
        if len(w) > 3:
            j = rng.randrange(1, len(w) - 1)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def copy_heavy(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    paras = _paragraphs()
    prompts = []
    for i in range(n):
        text = paras[rng.randrange(len(paras))]
        ask = ASKS[i % 2].format(text=_typos(text, rng) if i % 2 else text)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(list(tokenizer.encode(chat, add_special_tokens=False)))
    return prompts


def mixed(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(32, 512))] for _ in range(n)]


def _drive(engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """``concurrency`` requests in flight; per request the output ids and its token times."""
    from scheduler.request import Request, SamplingParams

    pending = list(enumerate(prompts))
    times: dict[str, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    in_flight = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, p = pending.pop(0)
            engine.add_request(Request(f"q{i}", list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0)))
            times[f"q{i}"] = []
            in_flight += 1
        for o in engine.step():
            now = time.perf_counter()
            times[o.request_id].extend([now] * len(o.new_token_ids or []))
            if o.finished:
                outputs[o.request_id] = list(o.token_ids or [])
                in_flight -= 1
    wall = time.perf_counter() - t0
    # TPOT of a request: (last token - first token) / (tokens - 1); tokens of one step share a time stamp.
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    st = engine.stats
    return {"wall_s": wall, "output_tokens": st.completion_tokens, "output_tok_s": st.completion_tokens / wall,
            "tpot_p50_ms": 1000 * (common.percentile(tpot, 50) or 0), "tpot_p95_ms": 1000 * (common.percentile(tpot, 95) or 0),
            "proposed": st.spec_proposed_tokens, "accepted": st.spec_accepted_tokens, "steps": st.steps,
            "outputs": outputs}


def run(model: str | None = None, *, dtype: str = "float32", concurrencies: tuple[int, ...] = (1, 4, 16, 64),
        requests: int | None = None, max_tokens: int = 192, num_speculative_tokens: int = 4, seed: int = 0,
        kv_cache_memory: str = "2GiB", out: str | Path | None = None, tag: str = "spec", log=print) -> dict:
    from bench.engines import InferqOffline

    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start, load_start = time.perf_counter(), os.getloadavg()
    base = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=64)
    rows = []
    for workload in ("copy-heavy", "mixed"):
        for c in concurrencies:
            n = requests or max(4, 2 * c)
            prompts = (copy_heavy(base.tokenizer, n, seed) if workload == "copy-heavy"
                       else mixed(base.info.vocab_size, n, seed))
            results = {}
            for method in ("off", "ngram"):
                engine = base.new_engine(speculative_method=method, num_speculative_tokens=num_speculative_tokens,
                                         max_num_seqs=max(c, 1))
                results[method] = _drive(engine, prompts, c, max_tokens)
            off, on = results["off"], results["ngram"]
            row = {"workload": workload, "concurrency": c, "requests": n,
                   "off_tok_s": off["output_tok_s"], "ngram_tok_s": on["output_tok_s"],
                   "speedup": on["output_tok_s"] / off["output_tok_s"],
                   "off_tpot_p50_ms": off["tpot_p50_ms"], "ngram_tpot_p50_ms": on["tpot_p50_ms"],
                   "off_tpot_p95_ms": off["tpot_p95_ms"], "ngram_tpot_p95_ms": on["tpot_p95_ms"],
                   "tpot_gain": off["tpot_p50_ms"] / on["tpot_p50_ms"] if on["tpot_p50_ms"] else None,
                   "acceptance": on["accepted"] / on["proposed"] if on["proposed"] else None,
                   "mean_accepted_per_step": on["output_tokens"] / on["steps"] if on["steps"] else None,
                   "identical": off["outputs"] == on["outputs"]}
            rows.append(row)
            log(f"{workload} c={c}: off {row['off_tok_s']:.1f} tok/s, ngram {row['ngram_tok_s']:.1f} tok/s "
                f"({row['speedup']:.2f}x), TPOT p50 {row['off_tpot_p50_ms']:.1f} -> {row['ngram_tpot_p50_ms']:.1f} ms, "
                f"acceptance {common.fmt(row['acceptance'])}, identical {row['identical']}")
    targets = []
    one = next((r for r in rows if r["workload"] == "copy-heavy" and r["concurrency"] == 1), None)
    if one:
        targets.append({"target": "copy-heavy, concurrency 1: TPOT >= 2x better than off", "measured": one["tpot_gain"],
                        "met": one["tpot_gain"] is not None and one["tpot_gain"] >= 2.0})
    for r in rows:
        if r["concurrency"] == max(concurrencies):
            targets.append({"target": f"{r['workload']}, concurrency {r['concurrency']}: throughput >= 0.97x off",
                            "measured": r["speedup"], "met": r["speedup"] >= 0.97})
    targets.append({"target": "greedy outputs identical everywhere", "measured": float(all(r["identical"] for r in rows)),
                    "met": all(r["identical"] for r in rows)})
    result = {"benchmark": "spec", "machine": info, "model": str(model_dir), "rows": rows, "targets": targets,
              "settings": {"max_tokens": max_tokens, "num_speculative_tokens": num_speculative_tokens},
              "elapsed_s": time.perf_counter() - t_start, "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    out_dir = common.results_dir(out)
    common.write_json(out_dir, tag, result)
    log(report(result))
    return result


def report(result: dict) -> str:
    lines = [common.machine_line(result["machine"]),
             common.table(result["rows"], [("workload", "workload"), ("concurrency", "clients"),
                                           ("off_tok_s", "off tok/s"), ("ngram_tok_s", "ngram tok/s"),
                                           ("speedup", "ngram/off"), ("off_tpot_p50_ms", "off TPOT p50 ms"),
                                           ("ngram_tpot_p50_ms", "ngram TPOT p50 ms"),
                                           ("ngram_tpot_p95_ms", "ngram TPOT p95 ms"), ("tpot_gain", "TPOT gain"),
                                           ("acceptance", "acceptance"),
                                           ("mean_accepted_per_step", "tokens/step"), ("identical", "identical")])]
    for t in result["targets"]:
        lines.append(common.target_line(t["target"], "", t["measured"], t["met"]))
    lines.append(f"elapsed {result['elapsed_s']:.0f} s")
    return "\n".join(lines)
