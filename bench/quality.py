"""``python -m bench quality``: what quantisation costs in quality, measured against float32 on the same weights.

For each variant (float32 is the reference; bfloat16, int8, int4 at group sizes 32 and 64, w4a8, the default model's
own GGUF blocks via ``auto``, and the KV-cache dtypes where they differ) on a fixed real English text:

- perplexity over non-overlapping windows of the license texts under /usr/share/common-licenses (every Debian
  machine has them; the file list and token count are recorded with the results);
- mean KL divergence ``KL(p_float32 || p_variant)`` of the next-token distributions at every position;
- the share of greedy continuations identical to float32's for their first 32 tokens, over a fixed prompt set
  (chat prompts through the whole engine, EOS honoured).

Targets (issue 15): int8 weights perplexity within +1% of float32; int4 within +6%; int8 KV within +1%.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import finish_run, machine_info, resolve_model_dir, table, target_lines
from inferq.log import get_logger

log = get_logger(__name__)

LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSE_FILES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "Artistic", "BSD")
# variant name -> (ModelRunner options); float32 first: the reference
VARIANTS: dict[str, dict] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "w8a16": {"dtype": "float32", "quantization": "w8a16"},
    "w8a8": {"dtype": "float32", "quantization": "w8a8"},
    "int4-g32": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 32},
    "int4-g64": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 64},
    "w4a8": {"dtype": "float32", "quantization": "w4a8"},
    "gguf-auto": {"dtype": "float32", "quantization": "auto"},
    "kv-bfloat16": {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
    "kv-int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
    "kv-fp8": {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"},
    "w4a8-kv-float32": {"dtype": "float32", "quantization": "w4a8", "kv_cache_dtype": "float32"},
    "w4a8-kv-bfloat16": {"dtype": "float32", "quantization": "w4a8", "kv_cache_dtype": "bfloat16"},
    "gguf-auto-kv-float32": {"dtype": "float32", "quantization": "auto", "kv_cache_dtype": "float32"},
    "gguf-auto-kv-bfloat16": {"dtype": "float32", "quantization": "auto", "kv_cache_dtype": "bfloat16"},
}
TARGETS = {"int8": 0.01, "int4-g32": 0.06, "int4-g64": 0.06, "w4a8": 0.06, "kv-int8": 0.01}  # relative perplexity increase allowed
PROMPTS = (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
    "Give me three tips for learning a new language.", "What is 12 times 7?", "Summarise the plot of Hamlet.",
    "How do vaccines work?", "Name the planets of the solar system.", "Write a short poem about autumn.",
    "What does a CPU cache do?", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "List three uses of a paperclip.", "What is the boiling point of water?", "Describe a cat to a child.",
    "What is machine learning?",
)
GREEDY_TOKENS = 32
CHUNK = 128  # prefill chunk of the perplexity windows (see window_logits)


def license_tokens(tokenizer, files: tuple[str, ...] = LICENSE_FILES, limit: int | None = None) -> tuple[list[int], list[str]]:
    """The license texts' tokens (files that exist, in order) and the files used."""
    used = [f for f in files if (LICENSE_DIR / f).is_file()]
    if not used:
        raise RuntimeError(f"no license texts under {LICENSE_DIR} (Debian's base-files package has them)")
    ids: list[int] = []
    for f in used:
        ids += tokenizer.encode((LICENSE_DIR / f).read_text(errors="replace"))
    return (ids[:limit] if limit else ids), used


def _runner(model_dir: Path, window: int, **opts):
    from worker.model_runner import ModelRunner

    block = 16
    runner = ModelRunner(model_dir, device="cpu", kv_cache_bytes=1 << 20, block_size=block, **opts)
    per_block = runner.model.kv_bytes_per_block(block, runner.kv_dtype)
    need = -(-window // block) + 1
    if runner.num_blocks < need:  # the pool holds one window (cheap to re-create: weights are kept)
        runner.num_blocks = need
        runner.kv_caches = runner.model.allocate_kv_cache(need, block, runner.kv_dtype)
    log.info("quality runner", kv_block_bytes=per_block, blocks=runner.num_blocks)
    return runner


@torch.inference_mode()
def window_logits(runner, ids: list[int], chunk: int = CHUNK) -> torch.Tensor:
    """float32 logits at every position of ``ids``: one sequence in blocks 0..n-1, prefilled in chunks of
    ``chunk`` tokens so that every chunk after the first reads its context from the KV cache (what the cache's
    element type changes; a chunk with no context attends over its fresh keys)."""
    from kernels.attention_api import AttentionMetadata

    t, bs = len(ids), runner.block_size
    table = np.arange(-(-t // bs), dtype=np.int32)[None, :]
    out = []
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        meta = AttentionMetadata.build(
            slot_mapping=np.arange(c0, c1, dtype=np.int64), block_tables=table,
            seq_lens=np.array([c1], dtype=np.int64), query_start_loc=np.array([0, c1 - c0], dtype=np.int64),
            block_size=bs, device=runner.device, scale=runner.model.scale)
        out.append(runner.model.forward(torch.tensor(ids[c0:c1]), torch.arange(c0, c1), runner.kv_caches, meta,
                                        runner.backend, logits_indices=None, max_position=c1 - 1))
    return torch.cat(out)


def score(runner, windows: list[list[int]], reference: list[torch.Tensor] | None, chunk: int = CHUNK):
    """(mean NLL per predicted token, mean KL against ``reference`` or None, this variant's log-probs)."""
    nll, kl, n = 0.0, 0.0, 0
    logps = []
    for i, ids in enumerate(windows):
        logp = torch.log_softmax(window_logits(runner, ids, chunk)[:-1], dim=-1)
        target = torch.tensor(ids[1:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        n += len(ids) - 1
        if reference is not None:
            ref = reference[i]
            kl += float((ref.exp() * (ref - logp)).sum())
        logps.append(logp if reference is None else None)  # float32: rounding them would bias the KL
    return nll / n, (kl / n if reference is not None else None), logps


def greedy(model_dir: Path, opts: dict, prompts: tuple[str, ...]) -> list[list[int]]:
    from worker.llm import LLM

    llm = LLM(model=str(model_dir), device="cpu", kv_cache_memory="128MiB", **opts)
    rows = llm.generate([{"messages": [{"role": "user", "content": p}], "max_tokens": GREEDY_TOKENS,
                          "temperature": 0} for p in prompts])
    return [r["token_ids"] for r in rows]


def run(model: str | None = None, *, variants: tuple[str, ...] = tuple(VARIANTS), window: int = 512,
        tokens: int = 8192, prompts: tuple[str, ...] = PROMPTS, out=None, tag: str = "quality",
        quick: bool = False) -> dict:
    t_start, load_start = time.perf_counter(), __import__("os").getloadavg()
    model_dir = resolve_model_dir(model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if quick:
        window, tokens, prompts = 64, 256, prompts[:2]
    chunk = min(CHUNK, window // 2)
    ids, files = license_tokens(tokenizer, limit=tokens)
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]
    variants = ("float32", *[v for v in variants if v != "float32"])
    rows, reference, greedy_ref = [], None, None
    for name in variants:
        opts = {k: v for k, v in VARIANTS[name].items()}
        t0 = time.perf_counter()
        runner = _runner(model_dir, window, **opts)
        nll, kl, logps = score(runner, windows, reference, chunk)
        if reference is None:
            reference = logps
        weight_bytes = runner.model.weight_bytes
        del runner
        toks = greedy(model_dir, opts, prompts)
        if greedy_ref is None:
            greedy_ref = toks
        same = sum(a[:GREEDY_TOKENS] == b[:GREEDY_TOKENS] for a, b in zip(toks, greedy_ref, strict=True))
        rows.append({"variant": name, "perplexity": math.exp(nll), "kl": kl, "greedy_same": same / len(prompts),
                     "weight_mb": weight_bytes / 1e6, "seconds": time.perf_counter() - t0})
        log.info("quality variant done", **{k: v for k, v in rows[-1].items() if v is not None})
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl_vs_float32"] = r["perplexity"] / base - 1.0
    targets = [{"target": f"{r['variant']} perplexity within +{TARGETS[r['variant']]:.0%} of float32",
                "measured": r["ppl_vs_float32"], "met": r["ppl_vs_float32"] <= TARGETS[r["variant"]]}
               for r in rows if r["variant"] in TARGETS]
    result = {"benchmark": "quality", "machine": machine_info("float32"), "model": str(model_dir),
              "text": {"files": [str(LICENSE_DIR / f) for f in files], "tokens": len(ids), "window": window,
                       "chunk": chunk,
                       "windows": len(windows)},
              "prompts": len(prompts), "greedy_tokens": GREEDY_TOKENS, "rows": rows, "targets": targets}
    return finish_run(result, t_start=t_start, load_start=load_start, out=out, tag=tag, plot=_plot,
                      report=report, log=lambda text: log.info("quality report\n" + text))


def report(result: dict) -> str:
    text = result["text"]
    head = (f"quality vs float32: {text['tokens']} tokens of {', '.join(Path(f).name for f in text['files'])} "
            f"in windows of {text['window']}; greedy: {result['prompts']} prompts x {result['greedy_tokens']} tokens")
    cols = [("variant", "variant"), ("perplexity", "ppl"), ("ppl_vs_float32", "ppl +"), ("kl", "mean KL"),
            ("greedy_same", "greedy same"), ("weight_mb", "weights MB")]
    return "\n".join([head, table(result["rows"], cols, digits=4), *target_lines(result["targets"])])


def _plot(result: dict, out_dir: Path, stem: str) -> None:
    from bench.common import pyplot, save_figure

    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r["variant"] for r in rows]
    ax[0].bar(names, [r["ppl_vs_float32"] * 100 for r in rows])
    ax[0].set_ylabel("perplexity vs float32 (%)")
    ax[1].bar(names, [r["kl"] or 0.0 for r in rows])
    ax[1].set_ylabel("mean KL (nats)")
    for a in ax:
        a.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    save_figure(fig, out_dir, stem)
