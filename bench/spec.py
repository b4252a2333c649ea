"""Speculative decoding: each proposer (n-gram, early-exit, draft model) against plain decoding, side by side in
one invocation.

Two workloads with the default instruct model, EOS honoured, greedy:
- copy-heavy: asked to repeat, or correct the typos of, paragraphs of the license texts the system ships
  (/usr/share/common-licenses), so answers quote long spans of their prompts: what prompt lookup is for;
- mixed: the synthetic mixed workload (random token prompts), where proposals are rarely right.
Each at client concurrency 1, 4, 16, 64 (that many requests in flight; the next is added when one ends),
``off`` and each of ``methods`` (default ngram; also early-exit, draft) in turn on one loaded model. Reported
per method: output tok/s, TPOT p50/p95, acceptance rate, mean accepted length (accepted proposals per request
step) and whether greedy outputs were identical to ``off``. The early-exit depth and the draft model come from
the settings (INFERQ_SPECULATIVE_EARLY_EXIT_LAYERS, INFERQ_SPECULATIVE_DRAFT_MODEL) unless given.
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
    in_flight = emits = 0
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
            emits += bool(o.new_token_ids)
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
            "request_steps": emits, "outputs": outputs}


def run(model: str | None = None, *, dtype: str = "float32", concurrencies: tuple[int, ...] = (1, 4, 16, 64),
        requests: int | None = None, max_tokens: int = 192, num_speculative_tokens: int = 4, seed: int = 0,
        kv_cache_memory: str = "2GiB", methods: tuple[str, ...] = ("ngram",),
        workloads: tuple[str, ...] = ("copy-heavy", "mixed"), out: str | Path | None = None, tag: str = "spec",
        log=print, **settings) -> dict:
    """``settings``: more engine settings for the speculative runs (e.g. speculative_early_exit_layers)."""
    from bench.engines import InferqOffline

    methods = tuple(m for m in methods if m != "off")
    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start, load_start = time.perf_counter(), os.getloadavg()
    base = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=64)
    rows = []
    for workload in workloads:
        for c in concurrencies:
            n = requests or max(4, 2 * c)
            prompts = (copy_heavy(base.tokenizer, n, seed) if workload == "copy-heavy"
                       else mixed(base.info.vocab_size, n, seed))
            results = {}
            for method in ("off", *methods):
                extra = settings if method != "off" else {}
                engine = base.new_engine(speculative_method=method, num_speculative_tokens=num_speculative_tokens,
                                         max_num_seqs=max(c, 1), **extra)
                results[method] = _drive(engine, prompts, c, max_tokens)
            row = _row(workload, c, n, results)
            rows.append(row)
            log(f"{workload} c={c}: off {row['off_tok_s']:.1f} tok/s, TPOT p50 {row['off_tpot_p50_ms']:.1f} ms; "
                + "; ".join(f"{m} {row[f'{m}_tok_s']:.1f} tok/s ({row[f'{m}_speedup']:.2f}x), TPOT p50 "
                            f"{row[f'{m}_tpot_p50_ms']:.1f} ms, acceptance {common.fmt(row[f'{m}_acceptance'])}, "
                            f"mean accepted {common.fmt(row[f'{m}_accepted_len'])}, identical {row[f'{m}_identical']}"
                            for m in methods))
    targets = _targets(rows, methods, concurrencies)
    result = {"benchmark": "spec", "machine": info, "model": str(model_dir), "rows": rows, "targets": targets,
              "methods": list(methods),
              "settings": {"max_tokens": max_tokens, "num_speculative_tokens": num_speculative_tokens, **settings},
              "elapsed_s": time.perf_counter() - t_start, "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    out_dir = common.results_dir(out)
    common.write_json(out_dir, tag, result)
    log(report(result))
    return result


def _row(workload: str, c: int, n: int, results: dict) -> dict:
    """One case: ``off`` and, per method, its numbers and ratios against ``off``. ``ngram`` also fills the
    unprefixed keys (speedup, tpot_gain, acceptance, identical) earlier results used."""
    off = results["off"]
    row = {"workload": workload, "concurrency": c, "requests": n, "off_tok_s": off["output_tok_s"],
           "off_tpot_p50_ms": off["tpot_p50_ms"], "off_tpot_p95_ms": off["tpot_p95_ms"]}
    for m, on in results.items():
        if m == "off":
            continue
        row.update({f"{m}_tok_s": on["output_tok_s"], f"{m}_speedup": on["output_tok_s"] / off["output_tok_s"],
                    f"{m}_tpot_p50_ms": on["tpot_p50_ms"], f"{m}_tpot_p95_ms": on["tpot_p95_ms"],
                    f"{m}_tpot_gain": off["tpot_p50_ms"] / on["tpot_p50_ms"] if on["tpot_p50_ms"] else None,
                    f"{m}_acceptance": on["accepted"] / on["proposed"] if on["proposed"] else None,
                    f"{m}_accepted_len": on["accepted"] / on["request_steps"] if on["request_steps"] else None,
                    f"{m}_identical": off["outputs"] == on["outputs"]})
    if "ngram" in results:
        on = results["ngram"]
        row.update(speedup=row["ngram_speedup"], tpot_gain=row["ngram_tpot_gain"], acceptance=row["ngram_acceptance"],
                   mean_accepted_per_step=on["output_tokens"] / on["steps"] if on["steps"] else None,
                   identical=row["ngram_identical"])
    return row


def _targets(rows: list[dict], methods: tuple[str, ...], concurrencies: tuple[int, ...]) -> list[dict]:
    targets = []
    one = next((r for r in rows if r["workload"] == "copy-heavy" and r["concurrency"] == 1), None)
    for m in methods:
        if one:
            gain = one[f"{m}_tpot_gain"]
            targets.append({"target": f"{m}, copy-heavy, concurrency 1: TPOT >= 2x better than off", "measured": gain,
                            "met": gain is not None and gain >= 2.0})
        for r in rows:
            if r["concurrency"] == max(concurrencies):
                targets.append({"target": f"{m}, {r['workload']}, concurrency {r['concurrency']}: throughput >= "
                                          "0.97x off", "measured": r[f"{m}_speedup"], "met": r[f"{m}_speedup"] >= 0.97})
    same = all(r[f"{m}_identical"] for r in rows for m in methods)
    targets.append({"target": "greedy outputs identical everywhere", "measured": float(same), "met": same})
    return targets


def report(result: dict) -> str:
    methods = result.get("methods", ["ngram"])
    cols = [("workload", "workload"), ("concurrency", "clients"), ("off_tok_s", "off tok/s"),
            ("off_tpot_p50_ms", "off TPOT p50 ms")]
    for m in methods:
        cols += [(f"{m}_tok_s", f"{m} tok/s"), (f"{m}_speedup", f"{m}/off"), (f"{m}_tpot_p50_ms", f"{m} TPOT p50 ms"),
                 (f"{m}_tpot_p95_ms", f"{m} TPOT p95 ms"), (f"{m}_tpot_gain", f"{m} TPOT gain"),
                 (f"{m}_acceptance", f"{m} acceptance"), (f"{m}_accepted_len", f"{m} accepted/step"),
                 (f"{m}_identical", f"{m} identical")]
    lines = [common.machine_line(result["machine"]), common.table(result["rows"], cols)]
    for t in result["targets"]:
        lines.append(common.target_line(t["target"], "", t["measured"], t["met"]))
    lines.append(f"elapsed {result['elapsed_s']:.0f} s")
    return "\n".join(lines)
