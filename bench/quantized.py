"""``python -m bench quant``: quantised weights against float, and against llama.cpp at the same quantisation.

Each variant runs the same two things, alternated between variants in one invocation (the machine's speed
drifts): single-stream decode (three real-text chats one at a time, greedy, EOS honoured, as ``bench latency``)
and offline throughput on the mixed workload (as ``bench throughput``). Pairs compared side by side:

    inferq float32   <-> llama.cpp f32          inferq int8 <-> llama.cpp Q8_0
    inferq int4      <-> llama.cpp Q4_0         inferq auto (the GGUF's own Q4_1 blocks) <-> llama.cpp on that file
    inferq w4a8      <-> llama.cpp Q4_0 (both: 4-bit weights times int8 activation blocks)

Targets (issue 15): int8 >= 1.5x float32 throughput; int4 single-stream decode >= 2.5x float32; each at or
above llama.cpp on the same quantisation.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench import common
from bench.latency import inferq_stream, llama_stream, prompts
from bench.workloads import mixed

# variant -> InferqOffline options (inferq) or LlamaServer type (llama.cpp)
INFERQ = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"},
          "w8a16": {"quantization": "w8a16"}, "w8a8": {"quantization": "w8a8"}, "int4": {"quantization": "int4"},
          "w4a8": {"quantization": "w4a8"},
          "auto": {"quantization": "auto"}, "kv-int8": {"kv_cache_dtype": "int8"},
          "kv-fp8": {"kv_cache_dtype": "fp8_e4m3"}}
LLAMA = {"llama-f32": "float32", "llama-q8_0": "q8_0", "llama-q4_0": "q4_0", "llama-gguf-shipped": "gguf-shipped"}
PAIRS = {"float32": "llama-f32", "int8": "llama-q8_0", "int4": "llama-q4_0", "w4a8": "llama-q4_0",
         "auto": "llama-gguf-shipped"}
DEFAULT = ("float32", "bfloat16", "int8", "w8a16", "w8a8", "int4", "w4a8", "auto", "kv-int8", "kv-fp8", *LLAMA)


def _subjects(model_dir: Path, variants, *, threads: int, log):
    """name -> (single-stream fn, throughput fn), and the closers of servers started."""
    from bench.engines import InferqOffline
    from bench.peers import llama_cpp

    subjects, closers, skipped = {}, [], {}
    for name in variants:
        if name in INFERQ:
            opts = {"dtype": "float32", **INFERQ[name]}
            eng = InferqOffline(model_dir, opts.pop("dtype"), kv_cache_memory="1GiB", threads=threads, **opts)
            subjects[name] = (lambda chats, n, e=eng: inferq_stream(e, chats, n), lambda wl, e=eng: e.run(wl))
            continue
        reason = llama_cpp.unavailable_reason()
        if reason:
            skipped[name] = reason
            continue
        try:
            # the throughput server (16 slots) stays up; single-stream passes start their own one-slot server
            srv = llama_cpp.LlamaServer(model_dir, LLAMA[name], parallel=16, threads=threads, ctx_per_slot=1024,
                                        log=log)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is skipped with the reason
            skipped[name] = f"cannot run: {str(exc)[-400:]}"
            continue
        closers.append(srv.close)
        if srv.note:
            skipped[f"{name} note"] = srv.note
        subjects[name] = (lambda chats, n, k=LLAMA[name]: _llama_single(model_dir, k, chats, n, log),
                          lambda wl, s=srv: s.generate(wl))
    return subjects, closers, skipped


def _llama_single(model_dir: Path, kind: str, chats, max_tokens: int, log) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def encode(chat):
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    return llama_stream(model_dir, kind, chats, max_tokens, encode, log)


def run(model: str | None = None, *, variants: tuple[str, ...] = DEFAULT, requests: int = 64,
        max_tokens: int = 128, repeats: int = 2, seed: int = 0, out=None, tag: str = "quant", quick: bool = False,
        log=print) -> dict:
    t_start, load_start = time.perf_counter(), os.getloadavg()
    model_dir = common.resolve_model_dir(model)
    threads = os.cpu_count() or 2
    info = common.machine_info("float32")
    log(common.machine_line(info))
    if quick:
        requests, max_tokens, repeats = 4, 8, 1
    chats = prompts(200)[:1] if quick else prompts()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    wl = mixed(requests, seed, vocab_size=vocab, prompt_len=(32, 64 if quick else 512),
               output_len=(4, 8) if quick else (16, 256))
    subjects, closers, skipped = _subjects(model_dir, variants, threads=threads, log=log)
    runs: dict[str, list[dict]] = {n: [] for n in subjects}
    try:
        for rep in range(repeats):
            order = list(subjects) if rep % 2 == 0 else list(reversed(subjects))
            for name in order:
                single, through = subjects[name]
                s = single(chats, max_tokens)
                t = through(wl)
                runs[name].append({"decode_tok_s": s["decode_tok_s"], "tpot_p50_ms": s["tpot_p50_ms"],
                                   "throughput_tok_s": t["output_tokens"] / t["wall_s"]})
                log(f"[rep {rep}] {name}: single stream {s['decode_tok_s']:.1f} tok/s, "
                    f"throughput {runs[name][-1]['throughput_tok_s']:.1f} tok/s")
    finally:
        for close in closers:
            close()
    rows = [_pooled(name, rs) for name, rs in runs.items() if rs]
    result = {"benchmark": "quant", "machine": info, "model": str(model_dir), "workload": wl.summary(),
              "single_stream": {"chats": len(chats), "max_tokens": max_tokens}, "repeats": repeats, "rows": rows,
              "skipped": skipped, "targets": _targets({r["variant"]: r for r in rows})}
    return common.finish_run(result, t_start=t_start, load_start=load_start, out=out, tag=tag, plot=_plot,
                             report=report, log=log)


def _pooled(name: str, rs: list[dict]) -> dict:
    """Mean over repeats (each repeat ran every variant back to back)."""
    n = len(rs)
    return {"variant": name, **{k: sum(r[k] for r in rs) / n for k in rs[0]}}


def _targets(by: dict[str, dict]) -> list[dict]:
    out = []
    f32 = by.get("float32")
    if f32 and "int8" in by:
        ratio = by["int8"]["throughput_tok_s"] / f32["throughput_tok_s"]
        out.append({"target": "int8 throughput >= 1.5x float32", "measured": ratio, "met": ratio >= 1.5})
    if f32 and "int4" in by:
        ratio = by["int4"]["decode_tok_s"] / f32["decode_tok_s"]
        out.append({"target": "int4 single-stream decode >= 2.5x float32", "measured": ratio, "met": ratio >= 2.5})
    for ours, theirs in PAIRS.items():
        if ours in by and theirs in by:
            for key, what in (("decode_tok_s", "single-stream"), ("throughput_tok_s", "throughput")):
                ratio = by[ours][key] / by[theirs][key]
                out.append({"target": f"{ours} {what} >= 1.0x {theirs}", "measured": ratio, "met": ratio >= 1.0})
    return out


def report(result: dict) -> str:
    cols = [("variant", "variant"), ("decode_tok_s", "single-stream tok/s"), ("tpot_p50_ms", "TPOT p50 ms"),
            ("throughput_tok_s", "throughput tok/s")]
    skipped = [f"skipped {k}: {v}" for k, v in result["skipped"].items()]
    return "\n".join([common.table(result["rows"], cols, digits=1), *skipped,
                      *common.target_lines(result["targets"])])


def _plot(result: dict, out_dir: Path, stem: str) -> None:
    plt = common.pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
    names = [r["variant"] for r in rows]
    ax[0].bar(names, [r["decode_tok_s"] for r in rows])
    ax[0].set_ylabel("single-stream decode tok/s")
    ax[1].bar(names, [r["throughput_tok_s"] for r in rows])
    ax[1].set_ylabel("mixed-workload output tok/s")
    for a in ax:
        a.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    common.save_figure(fig, out_dir, stem)
