"""The OpenAI-compatible layer and the Batch API through the whole service (issue 16): ``python -m bench api``
(``--modes openai,batch``), against a Stack (``inferq api`` + ``inferq worker`` on a throw-away database).

1. **Compatibility layer overhead**: the same chat requests, non-streaming, through ``POST /v1/chat/completions``
   and through ``POST /v1/jobs`` + the job's event stream up to its final event (what a client of inferq's own
   API does to wait for the answer); closed loop, ``concurrency`` requests in flight, the two routes alternated
   (order reversed on odd repeats). Every prompt is distinct (its own number, the same length for both routes)
   so neither route is served from the prefix cache the other filled. Overhead = 1 - chat rate / jobs rate.
2. **Batch API vs one by one**: ``batch_lines`` chat requests (``max_tokens`` 1 by default: 10,000 real
   generations of hundreds of tokens would take hours on 2 cores, so the run measures the service's per-request
   path and the prompts' prefill, not decoding; the lines share one instruction, as a batch's lines share
   theirs: with SmolLM2's chat template the first 96 tokens of every prompt are the same, six blocks the prefix
   cache holds, and 13 are the line's own) uploaded as a JSONL file, a batch created, polled every
   ``POLL_SECONDS`` as a client does, and its output file downloaded (every ``custom_id`` checked present
   exactly once); then the same
   requests (other prompt numbers: no prefix-cache help) submitted one by one through ``POST /v1/jobs`` (batch
   tier, ``concurrency`` in flight, each waited for on its event stream). Both times are from the client's first
   byte sent to its last answer received.
3. **Interactive TTFT under the batch**: while each of the two runs above (and once at idle, for reference) a
   light stream of interactive ``/v1/jobs`` requests, one every ``light_interval`` s, measures TTFT from the
   worker's own publish times (``bench.tiers.drive``).

The load generator is this process (httpx, asyncio); its CPU is shared with the API and the worker on a
2-core machine, which the one-by-one path pays more of (two HTTP requests per answer, against one upload).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from pathlib import Path

from bench import common

TARGET_OVERHEAD = 0.10
POLL_SECONDS = 0.5
# one shared instruction (as a batch's lines share theirs: the prefix cache holds it) and a short distinct item;
# "Be brief." makes the shared part of SmolLM2's prompt exactly six 16-token blocks
SYSTEM = ("You label catalogue items for a paint shop. For every item you are given, answer with exactly one "
          "word: the name of a colour that suits it. Use common colour names such as red, blue, green, yellow, "
          "orange, purple, brown, black, white or grey. Do not explain, do not repeat the item, do not add "
          "punctuation, quotes or any other text before or after the colour. Be brief.")
ROUTES = ("chat", "jobs")


def chat_messages(code: int, i: int) -> list[dict]:
    """A distinct chat prompt per (code, i), every one the same number of tokens (digits tokenize one by one)."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Item {code}{i:06d}"}]


def chat_body(code: int, i: int, max_tokens: int) -> dict:
    return {"messages": chat_messages(code, i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


# ------------------------------------------------------------------------------------------------------
# one request each way
# ------------------------------------------------------------------------------------------------------


async def _chat_call(client, headers: dict, body: dict) -> int:
    """``POST /v1/chat/completions`` (non-streaming): the completion tokens of the answer."""
    r = await client.post("/v1/chat/completions", json=body, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"chat {r.status_code}: {r.text[:200]}")
    out = r.json()
    if out["choices"][0]["finish_reason"] not in ("stop", "length"):
        raise RuntimeError(f"chat finished {out['choices'][0]['finish_reason']}")
    return int(out["usage"]["completion_tokens"])


async def _jobs_call(client, headers: dict, body: dict) -> int:
    """``POST /v1/jobs``, then the job's event stream until its final event: the completion tokens."""
    r = await client.post("/v1/jobs", json=body, headers=headers)
    if r.status_code != 202:
        raise RuntimeError(f"submit {r.status_code}: {r.text[:200]}")
    job_id, event = r.json()["id"], None
    async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as s:
        async for line in s.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "final":
                final = json.loads(line[5:])
                if final.get("status") != "succeeded":
                    raise RuntimeError(f"job {final.get('status')}: {final.get('error')}")
                return int(final["usage"]["completion_tokens"])
    raise RuntimeError("the event stream ended without a final event")


async def _closed_loop(url: str, headers: dict, call, bodies: list[dict], concurrency: int) -> dict:
    """``bodies`` through ``call``, ``concurrency`` in flight: answers/s, latency percentiles, errors."""
    import httpx

    lat: list[float] = []
    tokens: list[int] = []
    errors: dict[str, int] = {}
    todo = iter(bodies)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=2 * concurrency + 8)

    async def loop(client) -> None:
        for body in todo:
            t0 = time.perf_counter()
            try:
                tokens.append(await call(client, headers, body))
                lat.append(time.perf_counter() - t0)
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
                kind = f"{type(exc).__name__}: {str(exc)[:100]}"
                errors[kind] = errors.get(kind, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as client:
        t_start = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t_start
    return {"requests": len(bodies), "answered": len(lat), "errors": errors, "wall_s": wall,
            "rate": len(lat) / wall if wall else None, "completion_tokens": sum(tokens),
            "p50_ms": 1000 * (common.percentile(lat, 50) or 0), "p95_ms": 1000 * (common.percentile(lat, 95) or 0)}


def closed_loop(stack, call, bodies: list[dict], concurrency: int) -> dict:
    return asyncio.run(_closed_loop(stack.url, stack.headers, call, bodies, concurrency))


# ------------------------------------------------------------------------------------------------------
# 1. the compatibility layer's overhead
# ------------------------------------------------------------------------------------------------------


def route_comparison(stack, *, requests: int, concurrency: int, repeats: int, max_tokens: int, log=print) -> dict:
    for call in (_chat_call, _jobs_call):  # warm-up, not recorded: chat template, connections, first steps
        closed_loop(stack, call, [chat_body(9, i, max_tokens) for i in range(concurrency)], concurrency)
    rows = []
    for rep in range(repeats):
        order = ROUTES if rep % 2 == 0 else ROUTES[::-1]
        for route in order:
            code = 10 + 2 * rep + ROUTES.index(route)  # distinct prompts for every (repeat, route)
            bodies = [chat_body(code, i, max_tokens) for i in range(requests)]
            call = _chat_call if route == "chat" else _jobs_call
            row = closed_loop(stack, call, bodies, concurrency) | {"route": route, "repeat": rep}
            rows.append(row)
            log(f"  repeat {rep} {route:>4}: {common.fmt(row['rate'])} answers/s, p50 {row['p50_ms']:.0f} ms, "
                f"p95 {row['p95_ms']:.0f} ms, errors {row['errors']}")
            time.sleep(0.5)
    means = {route: common.mean(r["rate"] for r in rows if r["route"] == route and r["rate"]) for route in ROUTES}
    ratio = means["chat"] / means["jobs"] if means["chat"] and means["jobs"] else None
    return {"requests": requests, "concurrency": concurrency, "repeats": repeats, "max_tokens": max_tokens,
            "rows": rows, "chat_rate": means["chat"], "jobs_rate": means["jobs"], "chat_over_jobs": ratio,
            "overhead": None if ratio is None else 1.0 - ratio}


# ------------------------------------------------------------------------------------------------------
# 2. the Batch API against the same requests one by one, 3. interactive TTFT meanwhile
# ------------------------------------------------------------------------------------------------------


class LightStream:
    """Interactive ``/v1/jobs`` requests, one every ``interval`` s, in a thread, each measured by
    ``bench.tiers.drive`` (TTFT from the worker's publish times)."""

    def __init__(self, stack, vocab: int, interval: float, max_tokens: int = 8, seed: int = 0) -> None:
        self.stack, self.vocab, self.interval, self.max_tokens = stack, vocab, interval, max_tokens
        self.rng = random.Random(seed)
        self.recs: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LightStream:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(180)

    def _run(self) -> None:
        from bench.tiers import drive
        from bench.workloads import WorkItem, Workload

        while not self._stop.is_set():
            t0 = time.perf_counter()
            ids = [self.rng.randint(min(100, self.vocab - 1), self.vocab - 1) for _ in range(24)]
            item = WorkItem(ids, self.max_tokens, tier="interactive")
            self.recs.extend(drive(self.stack, Workload("light", [item]), timeout=120))
            self._stop.wait(max(0.0, self.interval - (time.perf_counter() - t0)))

    def summary(self) -> dict:
        ok = [r for r in self.recs if r.get("status") == "succeeded" and r.get("ttft_s") is not None]
        ttft = [r["ttft_s"] for r in ok]
        return {"requests": len(self.recs), "finished": len(ok), "errors": sum(1 for r in self.recs if "error" in r),
                "ttft_p50_ms": 1000 * common.percentile(ttft, 50) if ttft else None,
                "ttft_p95_ms": 1000 * common.percentile(ttft, 95) if ttft else None}


def batch_input(lines: int, code: int, max_tokens: int) -> bytes:
    """The JSONL input file: one chat request per line, ``custom_id`` ``req-<i>``."""
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": chat_body(code, i, max_tokens)}) + "\n" for i in range(lines)).encode()


def run_batch(stack, data: bytes, lines: int, timeout: float) -> dict:
    """Upload, create, poll until it ends, download the output file; every ``custom_id`` checked."""
    import httpx

    phases: dict[str, float] = {}
    with httpx.Client(base_url=stack.url, headers=stack.headers, timeout=600) as c:
        t0 = time.perf_counter()
        r = c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("batch.jsonl", data, "application/jsonl")})
        r.raise_for_status()
        phases["upload_s"] = time.perf_counter() - t0
        batch = c.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"}).json()
        phases["created_s"] = time.perf_counter() - t0
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"batch not done after {timeout:.0f} s: {batch['request_counts']}")
            time.sleep(POLL_SECONDS)
            batch = c.get(f"/v1/batches/{batch['id']}").json()
        phases["ended_s"] = time.perf_counter() - t0
        output = c.get(f"/v1/files/{batch['output_file_id']}/content").content if batch["output_file_id"] else b""
        phases["total_s"] = time.perf_counter() - t0
    answers = [json.loads(line) for line in output.splitlines() if line.strip()]
    ids = [a["custom_id"] for a in answers]
    usage = [a["response"]["body"]["usage"] for a in answers
             if a.get("response") and a["response"].get("status_code") == 200]
    return {"lines": lines, "input_bytes": len(data), "status": batch["status"],
            "request_counts": batch["request_counts"], "output_lines": len(answers),
            "custom_ids_once": sorted(ids) == sorted(f"req-{i}" for i in range(lines)),
            "error_file_id": batch["error_file_id"], "completion_tokens": sum(u["completion_tokens"] for u in usage),
            "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
            "cached_prompt_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage), **phases,
            "rate": lines / phases["total_s"]}


def batch_comparison(stack, *, lines: int, concurrency: int, max_tokens: int, light_interval: float, vocab: int,
                     timeout: float, log=print) -> dict:
    log(f"interactive light stream at idle ({5 * light_interval:.1f} s) ...")
    with LightStream(stack, vocab, light_interval, seed=1) as idle:
        time.sleep(5 * light_interval)
    log(f"Batch API: {lines} lines, max_tokens {max_tokens} each ...")
    data = batch_input(lines, 1, max_tokens)
    with LightStream(stack, vocab, light_interval, seed=2) as during_batch:
        batch = run_batch(stack, data, lines, timeout)
    log(f"  {batch['status']} in {batch['total_s']:.1f} s (upload {batch['upload_s']:.2f} s), {batch['rate']:.1f} "
        f"requests/s; output lines {batch['output_lines']}, every custom_id once: {batch['custom_ids_once']}")
    log(f"the same {lines} requests one by one through POST /v1/jobs ({concurrency} in flight) ...")
    bodies = [chat_body(2, i, max_tokens) | {"tier": "batch"} for i in range(lines)]
    with LightStream(stack, vocab, light_interval, seed=3) as during_jobs:
        single = closed_loop(stack, _jobs_call, bodies, concurrency)
    log(f"  {single['answered']}/{lines} in {single['wall_s']:.1f} s, {common.fmt(single['rate'])} requests/s, "
        f"errors {single['errors']}")
    light = {"idle": idle.summary(), "during_batch_api": during_batch.summary(),
             "during_one_by_one": during_jobs.summary()}
    for name, s in light.items():
        log(f"  interactive TTFT {name}: p50 {common.fmt(s['ttft_p50_ms'], 0)} ms, p95 "
            f"{common.fmt(s['ttft_p95_ms'], 0)} ms ({s['finished']}/{s['requests']} requests)")
    speedup = single["wall_s"] / batch["total_s"] if batch["total_s"] else None
    return {"lines": lines, "max_tokens": max_tokens, "concurrency": concurrency, "light_interval_s": light_interval,
            "batch_api": batch, "one_by_one": single, "one_by_one_over_batch_time": speedup, "interactive": light}


# ------------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------------


def run(model: str | None = None, *, dtype: str = "float32", modes: tuple[str, ...] = ("openai", "batch"),
        requests: int = 128, concurrency: int = 16, repeats: int = 3, max_tokens: int = 8, batch_lines: int = 10_000,
        batch_max_tokens: int = 1, batch_concurrency: int = 64, light_interval: float = 1.0,
        kv_cache_memory: str = "512MiB", quick: bool = False, out: str | Path | None = None,
        tag: str = "api-openai", log=print) -> dict:
    from bench.tiers import Stack

    if quick:
        requests, concurrency, repeats, max_tokens = min(requests, 8), 4, 2, 4
        batch_lines, batch_concurrency, light_interval = min(batch_lines, 40), 8, 0.3
    model_dir = common.resolve_model_dir(model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start, load_start = time.perf_counter(), os.getloadavg()
    result: dict = {"benchmark": "api-openai", "machine": info, "model": str(model_dir), "modes": list(modes)}
    with Stack(model=str(model_dir), dtype=dtype, kv_cache_memory=kv_cache_memory, log=log) as stack:
        if "openai" in modes:
            log(f"chat completions: POST /v1/chat/completions vs POST /v1/jobs + events, {requests} requests, "
                f"{concurrency} in flight, max_tokens {max_tokens}, {repeats} alternations ...")
            result["routes"] = route_comparison(stack, requests=requests, concurrency=concurrency, repeats=repeats,
                                                max_tokens=max_tokens, log=log)
        if "batch" in modes:
            result["batch"] = batch_comparison(stack, lines=batch_lines, concurrency=batch_concurrency,
                                               max_tokens=batch_max_tokens, light_interval=light_interval,
                                               vocab=vocab, timeout=1800, log=log)
    result["targets"] = _targets(result)
    return common.finish_run(result, t_start=t_start, load_start=load_start, out=out, tag=tag, plot=_plot,
                             report=report, log=log)


def _targets(result: dict) -> list[dict]:
    targets = []
    if "routes" in result:
        overhead = result["routes"]["overhead"]
        targets.append({"target": f"OpenAI route overhead vs /v1/jobs <= {100 * TARGET_OVERHEAD:.0f}%",
                        "measured": overhead, "met": None if overhead is None else overhead <= TARGET_OVERHEAD})
    if "batch" in result:
        b = result["batch"]["batch_api"]
        ok = b["status"] == "completed" and b["custom_ids_once"] and b["request_counts"]["completed"] == b["lines"]
        targets.append({"target": "every batch line answered exactly once", "measured": b["output_lines"], "met": ok})
    return targets


def report(result: dict) -> str:
    lines = [common.machine_line(result["machine"])]
    if "routes" in result:
        r = result["routes"]
        rows = [{"route": "POST /v1/chat/completions" if x["route"] == "chat" else "POST /v1/jobs + events",
                 "repeat": x["repeat"], "rate": x["rate"], "p50": x["p50_ms"], "p95": x["p95_ms"],
                 "errors": sum(x["errors"].values())} for x in r["rows"]]
        lines.append(f"chat completions, {r['requests']} requests x {r['repeats']} alternations, "
                     f"{r['concurrency']} in flight, max_tokens {r['max_tokens']}:")
        lines.append(common.table(rows, [("route", "route"), ("repeat", "repeat"), ("rate", "answers/s"),
                                         ("p50", "latency p50 ms"), ("p95", "p95 ms"), ("errors", "errors")]))
        lines.append(f"mean answers/s: chat {common.fmt(r['chat_rate'])}, jobs {common.fmt(r['jobs_rate'])}; "
                     f"chat / jobs = {common.fmt(r['chat_over_jobs'], 3)} (overhead "
                     f"{common.fmt(None if r['overhead'] is None else 100 * r['overhead'], 1)}%)")
    if "batch" in result:
        b = result["batch"]
        ba, one, light = b["batch_api"], b["one_by_one"], b["interactive"]
        lines.append(f"{b['lines']} chat requests, max_tokens {b['max_tokens']} each (short answers: the service's "
                     "per-request path is measured, not decoding):")
        rows = [{"how": "Batch API: upload -> batch -> poll -> output file", "wall": ba["total_s"], "rate": ba["rate"],
                 "done": ba["request_counts"]["completed"], "p50": light["during_batch_api"]["ttft_p50_ms"],
                 "p95": light["during_batch_api"]["ttft_p95_ms"]},
                {"how": f"one by one: POST /v1/jobs + events, {b['concurrency']} in flight", "wall": one["wall_s"],
                 "rate": one["rate"], "done": one["answered"], "p50": light["during_one_by_one"]["ttft_p50_ms"],
                 "p95": light["during_one_by_one"]["ttft_p95_ms"]},
                {"how": "(idle, no load)", "wall": None, "rate": None, "done": None,
                 "p50": light["idle"]["ttft_p50_ms"], "p95": light["idle"]["ttft_p95_ms"]}]
        lines.append(common.table(rows, [("how", "how"), ("wall", "wall s"), ("rate", "requests/s"),
                                         ("done", "answered"), ("p50", "interactive TTFT p50 ms"),
                                         ("p95", "p95 ms")], digits=1))
        lines.append(f"Batch API prompt tokens {ba['prompt_tokens']:,}, of which served from the prefix cache "
                     f"{ba['cached_prompt_tokens']:,}")
        lines.append(f"Batch API phases: upload {ba['upload_s']:.2f} s, created {ba['created_s']:.2f} s, ended "
                     f"{ba['ended_s']:.1f} s, output downloaded {ba['total_s']:.1f} s; one by one / Batch API time = "
                     f"{common.fmt(b['one_by_one_over_batch_time'])}; interactive light stream: one request every "
                     f"{b['light_interval_s']} s")
    lines += common.target_lines(result["targets"])
    lines.append(f"elapsed {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _plot(result: dict, out_dir: Path, tag: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if "routes" in result:
        rows = result["routes"]["rows"]
        axes[0].bar([f"{r['route']} {r['repeat']}" for r in rows], [r["rate"] or 0 for r in rows],
                    color=["tab:orange" if r["route"] == "chat" else "tab:blue" for r in rows])
        axes[0].set_ylabel("answers / s")
        axes[0].set_title("/v1/chat/completions (orange) vs /v1/jobs + events (blue)", fontsize=9)
    if "batch" in result:
        b = result["batch"]
        names = ("idle", "during_batch_api", "during_one_by_one")
        xs = range(len(names))
        axes[1].bar([x - 0.2 for x in xs], [b["interactive"][n]["ttft_p50_ms"] or 0 for n in names], 0.4, label="p50")
        axes[1].bar([x + 0.2 for x in xs], [b["interactive"][n]["ttft_p95_ms"] or 0 for n in names], 0.4, label="p95")
        axes[1].set_xticks(list(xs), [f"{n}\n" + (f"{b['batch_api']['total_s']:.0f} s" if n == "during_batch_api"
                                                   else f"{b['one_by_one']['wall_s']:.0f} s" if n != "idle" else "")
                                      for n in names], fontsize=8)
        axes[1].set_ylabel("interactive TTFT (ms)")
        axes[1].set_title(f"{b['lines']} batch requests: wall time and interactive TTFT", fontsize=9)
        axes[1].legend(fontsize=8)
    fig.suptitle(f"OpenAI layer and Batch API - {result['machine']['cpu']}, {result['machine']['cores']} cores",
                 fontsize=9)
    common.save_figure(fig, out_dir, tag)
