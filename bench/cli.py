"""``inferq bench NAME`` / ``python -m bench NAME``: the benchmarks, each writing JSON + PNG to a results folder.

Imports nothing heavy at module level (the lead registers :func:`bench` on the inferq typer app).
"""

from __future__ import annotations

from typing import Annotated

import typer

NAMES = ("throughput", "prefix", "memory", "roofline", "tiers", "api", "spec", "fairness", "latency", "routing", "parallel",
         "quality", "quant")
API_MODES = ("submit", "openai", "batch")


def _csv(value: str | None) -> tuple[str, ...] | None:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else None


def bench(
    name: Annotated[str, typer.Argument(help=f"Which benchmark: {', '.join(NAMES)}.")],
    model: Annotated[str | None, typer.Option(help="Model name or local HF directory (default: the service's).")] = None,
    dtype: Annotated[str | None, typer.Option(help="Comma-separated dtypes, e.g. float32,bfloat16.")] = None,
    requests: Annotated[int | None, typer.Option(help="Number of requests (default per benchmark: 64).")] = None,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    repeats: Annotated[int, typer.Option(help="Alternating repeats of each comparison.")] = 1,
    engines: Annotated[str | None, typer.Option(help="throughput: comma-separated subset of inferq,inferq-kv-bf16,"
                                                     "inferq-static,inferq-static16,hf-static,hf-cb,vllm-cpu,"
                                                     "llama-cpp (latency: inferq,llama-cpp; spec: inferq,vllm-cpu; default: inferq,inferq-static16,hf-static, under "
                                                     "10 minutes; run each peer beside inferq, e.g. "
                                                     "inferq,vllm-cpu; a peer that cannot run is skipped).")] = None,
    policy: Annotated[str, typer.Option(help="throughput: also accepted as --policy static to run inferq's "
                                             "static policy only against continuous.")] = "",
    rates: Annotated[str | None, typer.Option(help="tiers: comma-separated arrival rates (req/s).")] = None,
    duration: Annotated[float | None, typer.Option(help="tiers/api: seconds of load per rate.")] = None,
    modes: Annotated[str | None, typer.Option(help="api: comma-separated subset of submit (POST /v1/jobs "
                                                   "submissions/s, no worker), openai (/v1/chat/completions vs "
                                                   "/v1/jobs), batch (Batch API vs one by one, interactive TTFT "
                                                   "meanwhile); default all three.")] = None,
    methods: Annotated[str | None, typer.Option(help="spec: comma-separated proposers compared with off "
                                                     "(ngram, early-exit, draft; default ngram); quality and "
                                                     "quant: the variants compared with float32 (default all)."
                                                     )] = None,
    concurrencies: Annotated[str | None, typer.Option(help="spec: comma-separated client concurrencies "
                                                           "(default 1,4,16,64).")] = None,
    workloads: Annotated[str | None, typer.Option(help="spec: copy-heavy and/or mixed (default both).")] = None,
    batch_lines: Annotated[int | None, typer.Option(help="api: lines of the Batch API run (default 10000).")] = None,
    kv_cache_memory: Annotated[str | None, typer.Option(help="KV-cache budget, e.g. 2GiB.")] = None,
    max_prompt: Annotated[int | None, typer.Option(help="Longest prompt (tokens).")] = None,
    max_output: Annotated[int | None, typer.Option(help="Longest output (tokens).")] = None,
    sharegpt: Annotated[str | None, typer.Option(help="throughput: a ShareGPT-format JSON file instead of the "
                                                      "synthetic mixed workload.")] = None,
    out: Annotated[str | None, typer.Option(help="Results folder (default bench/results).")] = None,
    tag: Annotated[str | None, typer.Option(help="File stem of the results (default: the benchmark's name).")] = None,
    tp: Annotated[str | None, typer.Option(help="parallel: comma-separated tensor-parallel sizes (default: 1 and "
                                                "the smallest larger size that splits the model).")] = None,
    quick: Annotated[bool, typer.Option(help="Tiny sizes (a smoke run, seconds).")] = False,
    ab: Annotated[bool, typer.Option(help="latency: only the dtypes' decode steps taken in turn in one process "
                                          "(median step time and ratio to the first dtype).")] = False,
    ahead: Annotated[str | None, typer.Option(help="latency: only decode-ahead budgets (ms, comma-separated, e.g. "
                                                   "0,20,40) taken in turn chat by chat, per dtype.")] = None,
    allow_slow_half: Annotated[bool, typer.Option(help="throughput: run bfloat16/float16 even on a CPU without a "
                                                       "native half-precision GEMM (hours, not minutes).")] = False,
) -> None:
    """Run one benchmark; prints a table and 'target vs measured' lines, writes NAME.json and NAME.png."""
    kw: dict = {}
    if out:
        kw["out"] = out
    if tag:
        kw["tag"] = tag
    dtypes = _csv(dtype)
    if name == "throughput":
        from bench import throughput

        if dtypes:
            kw["dtypes"] = dtypes
        if requests:
            kw["requests"] = requests
        eng = _csv(engines)
        if policy == "static" and not eng:
            eng = ("inferq", "inferq-static")
        if eng:
            unknown = set(eng) - set(throughput.ENGINES)
            if unknown:
                raise typer.BadParameter(f"unknown engines {sorted(unknown)}; known: {', '.join(throughput.ENGINES)}")
            kw["engines"] = eng
        if kv_cache_memory:
            kw["kv_cache_memory"] = kv_cache_memory
        if quick:
            kw.setdefault("requests", 8)
            kw.update(prompt_len=(8, max_prompt or 48), output_len=(4, max_output or 16))
        else:
            if max_prompt:
                kw["prompt_len"] = (min(32, max_prompt), max_prompt)
            if max_output:
                kw["output_len"] = (min(16, max_output), max_output)
        throughput.run(model, seed=seed, repeats=repeats, sharegpt=sharegpt, allow_slow_half=allow_slow_half or quick,
                       **kw)
    elif name == "prefix":
        from bench import prefix

        if dtypes:
            kw["dtype"] = dtypes[0]
        if requests:
            kw["requests"] = requests
        if kv_cache_memory:
            kw["kv_cache_memory"] = kv_cache_memory
        if quick:
            kw.setdefault("requests", 6)
            kw.update(prefix_len=64, question_len=(4, 8), output_len=4)
        prefix.run(model, seed=seed, repeats=repeats, **kw)
    elif name == "memory":
        from bench import memory

        if dtypes:
            kw["dtype"] = dtypes[0]
        if requests:
            kw["requests"] = requests
        if kv_cache_memory:
            kw["kv_cache_memory"] = kv_cache_memory
        if quick:
            kw.setdefault("requests", 8)
            kw.update(prompt_len=(8, max_prompt or 48), output_len=(4, max_output or 16), kv_cache_memory=kv_cache_memory or "2MiB")
        memory.run(model, seed=seed, **kw)
    elif name == "roofline":
        from bench import roofline

        if dtypes:
            kw["dtypes"] = dtypes
        if requests:
            kw["requests"] = requests
        if quick:
            kw.update(quick=True)
        roofline.run(model, seed=seed, **kw)
    elif name == "tiers":
        from bench import tiers

        if dtypes:
            kw["dtype"] = dtypes[0]
        if requests:
            kw["requests"] = requests
        if rates:
            kw["rates"] = tuple(float(r) for r in _csv(rates) or ())
        if duration:
            kw["duration"] = duration
        if quick:
            kw["quick"] = True
        tiers.run(model, seed=seed, **kw)
    elif name == "spec":
        from bench import spec

        if dtypes:
            kw["dtype"] = dtypes[0]
        if requests:
            kw["requests"] = requests
        if max_output:
            kw["max_tokens"] = max_output
        if quick:
            kw.update(concurrencies=(1, 4), requests=requests or 4, max_tokens=max_output or 24)
        if kv_cache_memory:
            kw["kv_cache_memory"] = kv_cache_memory
        if engines:
            try:
                kw["engines"] = spec.parse_engines(engines)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from exc
        if methods:
            kw["methods"] = _csv(methods)
        if concurrencies:
            kw["concurrencies"] = tuple(int(c) for c in _csv(concurrencies) or ())
        if workloads:
            kw["workloads"] = _csv(workloads)
        spec.run(model, seed=seed, **kw)
    elif name == "fairness":
        from bench import fairness

        if dtypes:
            kw["dtype"] = dtypes[0]
        if requests:
            kw["light_requests"] = requests  # the heavy tenant sends 10x as many
        if repeats > 1:
            kw["repeats"] = repeats
        if max_output:
            kw["max_tokens"] = max_output
        if kv_cache_memory:
            kw["kv_cache_memory"] = kv_cache_memory
        if quick:
            kw.update(light_requests=requests or 3, max_tokens=max_output or 8, max_num_seqs=4)
        fairness.run(model, seed=seed, **kw)
    elif name == "latency":
        from bench import latency

        if ahead:
            for d in dtypes or ("float32",):
                latency.ahead_ab(model, dtype=d, budgets=tuple(float(x) for x in _csv(ahead)),
                                 max_tokens=max_output or 128, quick=quick, **({"tag": f"latency-ahead-{d}"} | kw))
        elif ab:
            latency.ab_by_step(model, dtypes=dtypes or ("float32",), max_tokens=max_output or 128, quick=quick,
                               **({"tag": "latency-ab"} | kw))
        else:
            latency.run(model, dtypes=dtypes or ("float32",), engines=_csv(engines) or ("inferq",),
                        max_tokens=max_output or 128, quick=quick, **kw)
    elif name == "routing":
        from bench import routing

        if dtypes:
            kw["dtype"] = dtypes[0]
        if requests:
            kw["requests"] = requests
        if repeats > 1:
            kw["repeats"] = repeats
        if kv_cache_memory:
            kw["kv_cache_memory"] = kv_cache_memory
        if max_output:
            kw["output_len"] = max_output
        if rates:
            kw["rate"] = float((_csv(rates) or ("1",))[0])
        if quick:
            kw.update(requests=requests or 12, groups=4, prefix_len=64, question_len=(4, 8), output_len=2)
        routing.run(model, seed=seed, **kw)
    elif name == "parallel":
        _parallel(kw, model=model, dtype=dtypes, tp=tp, requests=requests, max_output=max_output, quick=quick)
    elif name == "quant":
        from bench import quantized

        if methods:  # the variants (bench/quantized.py DEFAULT)
            kw["variants"] = _csv(methods)
        if requests:
            kw["requests"] = requests
        quantized.run(model, quick=quick, repeats=max(repeats, 1 if quick else 2), **kw)
    elif name == "quality":
        from bench import quality

        if methods:  # the variants compared with float32 (bench/quality.py VARIANTS)
            kw["variants"] = _csv(methods)
        quality.run(model, quick=quick, **kw)
    elif name == "api":
        _api(kw, modes=_csv(modes) or API_MODES, model=model, dtype=dtypes, duration=duration, requests=requests,
             repeats=repeats, batch_lines=batch_lines, quick=quick)
    else:
        raise typer.BadParameter(f"unknown benchmark {name!r}; choose one of {', '.join(NAMES)}")


def _api(kw: dict, *, modes: tuple[str, ...], model: str | None, dtype: tuple[str, ...] | None,
         duration: float | None, requests: int | None, repeats: int, batch_lines: int | None, quick: bool) -> None:
    """``api``: the submission rate (bench/api_load.py, results ``api``) and the OpenAI layer and Batch API
    (bench/api_openai.py, results ``api-openai``), each part only if asked for in ``modes``."""
    from bench import api_load, api_openai

    unknown = set(modes) - set(API_MODES)
    if unknown:
        raise typer.BadParameter(f"unknown api modes {sorted(unknown)}; known: {', '.join(API_MODES)}")
    if "submit" in modes:
        api_load.run(**kw, **({"duration": duration} if duration else {}), quick=quick)
    rest = tuple(m for m in modes if m != "submit")
    if rest:
        opts: dict = {"out": kw.get("out"), "tag": f"{kw.get('tag', 'api')}-openai", "quick": quick, "modes": rest}
        if dtype:
            opts["dtype"] = dtype[0]
        if requests:
            opts["requests"] = requests
        if repeats > 1:
            opts["repeats"] = repeats
        if batch_lines:
            opts["batch_lines"] = batch_lines
        api_openai.run(model, **opts)


def _parallel(kw: dict, *, model: str | None, dtype: tuple[str, ...] | None, tp: str | None, requests: int | None,
              max_output: int | None, quick: bool) -> None:
    """``parallel``: TP=1 against TP=N (bench/parallel.py)."""
    from bench import parallel

    if dtype:
        kw["dtype"] = dtype[0]
    if tp:
        kw["sizes"] = tuple(int(n) for n in _csv(tp) or ())
    if requests:
        kw["batch"] = requests
    if max_output:
        kw["decode_tokens"] = kw["batch_tokens"] = max_output
    if quick:
        kw.update(decode_tokens=max_output or 8, batch=requests or 4, batch_tokens=max_output or 4, prompt_len=16)
    parallel.run(model, **kw)
