"""Online benchmark through the whole service: REST API -> Redis -> worker -> PostgreSQL.

Starts ``inferq api`` and ``inferq worker`` subprocesses against the local Redis and PostgreSQL, with a
throw-away database (created, migrated, dropped) and a fresh tenant + API key, then (the load generator is
this process, separate from the API and the worker):

1. admission latency at idle: jobs submitted one at a time; p50 of ``started_at - queued_at`` from the
   jobs' own timestamps (acceptance -> the worker's admission into its engine);
2. service throughput vs the offline engine: the mixed workload submitted at once through the API, and the
   same token ids through an in-process ``LLMEngine`` with the same settings (alternating);
3. Poisson arrivals at several rates (default: fractions of the capacity measured in 2, up to and past
   saturation), 20% interactive / 80% batch: TTFT, TPOT, ITL and e2e p50/p95/p99 per tier with vLLM
   ``bench serve`` definitions (TTFT and ITL from the SSE events endpoint, as the client receives them),
   goodput under the SLOs; then the same arrivals with priorities disabled (everything submitted as batch;
   the rows still group requests by the tier they would have had).

Definitions (as vLLM's ``benchmark_serving``): TTFT = first SSE delta - submission; e2e = last delta -
submission; TPOT = (last delta - first delta) / (output tokens - 1); ITL = gaps between successive deltas.
The time of a delta is its SSE ``id`` (the Redis stream entry id: when the worker published it), so a
load generator that reads late on these 2 shared cores does not inflate the latencies; client receive
times are kept in the JSON too (``e2e_client_s``).
Goodput = requests per second that finished and met their tier's SLO (interactive: TTFT <= 1 s; batch:
finished within the run).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.stack_base import ROOT, ThrowawayStack
from bench.workloads import WorkItem, Workload, mixed, poisson_arrivals

SLO_INTERACTIVE_TTFT_S = 1.0


# ------------------------------------------------------------------------------------------------------
# the service under test
# ------------------------------------------------------------------------------------------------------


class Stack(ThrowawayStack):
    """A throw-away database + Redis prefix, a tenant and key, ``inferq api`` and ``inferq worker``."""

    def __init__(self, *, model: str, dtype: str, kv_cache_memory: str, extra: dict | None = None, log=print,
                 log_dir: Path | None = None, worker: bool = True, api_workers: int = 1) -> None:
        super().__init__(log)
        self.model, self.dtype, self.kv_cache_memory = model, dtype, kv_cache_memory
        self.extra = extra or {}
        self.with_worker = worker
        self.api_workers = api_workers
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="inferq-bench-"))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key: str | None = None

    def start(self) -> None:
        from api.tenants import create_key

        self.key = create_key(self.create_database(), "bench").key
        env = dict(os.environ)
        env.update({"INFERQ_DATABASE_URL": self.db_url, "INFERQ_REDIS_URL": self.base.redis_url,
                    "INFERQ_STREAM_PREFIX": self.prefix, "INFERQ_MODEL": self.model, "INFERQ_DTYPE": self.dtype,
                    "INFERQ_KV_CACHE_MEMORY": self.kv_cache_memory, "INFERQ_LOG_JSON": "true",
                    "INFERQ_DEFAULT_TOKENS_PER_MINUTE": "1000000000", "INFERQ_DEFAULT_MAX_QUEUED_JOBS": "1000000",
                    "INFERQ_SHUTDOWN_GRACE_SECONDS": "5", "PYTHONUNBUFFERED": "1"})
        env.update({f"INFERQ_{k.upper()}": str(v) for k, v in self.extra.items()})
        env.pop("INFERQ_CONFIG", None)
        api_cmd = [sys.executable, "-m", "deploy.cli", "api", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.api_workers > 1:
            api_cmd += ["--workers", str(self.api_workers)]
        self._spawn("api", api_cmd, env)
        if self.with_worker:
            self._spawn("worker", _worker_cmd(), dict(env, INFERQ_WORKER_NAME=f"bench-{self.tag}"))
        self._wait_ready()

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        f = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        self.procs.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)))
        self.log(f"started {name}: {' '.join(cmd[1:])} (log {self.log_dir / f'{name}.log'})")

    def _check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {p.returncode}: {tail}")

    def _wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        if not self.with_worker:
            self._announce_model()
        # without a worker the API is up but never ready (/readyz wants a worker serving a model): /healthz then
        probe = "/readyz" if self.with_worker else "/healthz"
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while True:
                self._check_alive()
                try:
                    if c.get(probe).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the API did not become ready")
                time.sleep(0.3)
            if not self.with_worker:
                return
            # one job end to end: the worker is up and its model is loaded (and warm)
            r = c.post("/v1/jobs", json={"prompt_ids": [100, 101, 102, 103], "max_tokens": 4, "temperature": 0,
                                         "ignore_eos": True, "tier": "interactive"}, headers=self.headers)
            r.raise_for_status()
            job = r.json()["id"]
            while True:
                self._check_alive()
                st = c.get(f"/v1/jobs/{job}", headers=self.headers).json()
                if st.get("status") in ("succeeded", "failed", "cancelled", "expired"):
                    if st["status"] != "succeeded":
                        raise RuntimeError(f"warm-up job {st['status']}: {st.get('error')}")
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker did not finish a warm-up job")
                time.sleep(0.2)

    def _announce_model(self) -> None:
        """Make the model known with no worker (as ``inferq up`` does), so that jobs for it are accepted."""
        import redis

        from inferq.contract import model_id
        from inferq.models_registry import announce

        client = redis.Redis.from_url(self.base.redis_url)
        try:
            announce(client, self.prefix, model_id(self.model))
        finally:
            client.close()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def job_timestamps(self, job_ids: list[str]) -> list[dict]:
        from sqlalchemy import select

        from inferq.db import Job, make_engine, make_sessionmaker

        engine = make_engine(self.db_url)
        try:
            with make_sessionmaker(engine)() as s:
                rows = s.execute(select(Job.id, Job.created_at, Job.queued_at, Job.started_at, Job.first_token_at,
                                        Job.finished_at).where(Job.id.in_(job_ids))).all()
            return [dict(r._mapping) for r in rows]
        finally:
            engine.dispose()


def _worker_cmd() -> list[str]:
    import importlib.util

    if importlib.util.find_spec("worker.service_cli") is not None:
        return [sys.executable, "-m", "deploy.cli", "worker"]
    return [sys.executable, "-m", "worker.service"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------------
# the load generator (asyncio, one SSE connection per job)
# ------------------------------------------------------------------------------------------------------


async def _one(client, headers: dict, item: WorkItem, tier: str, t0: float, rec: dict) -> None:
    try:
        await _one_inner(client, headers, item, tier, t0, rec)
    except Exception as exc:  # noqa: BLE001 - recorded per request, never stops the run
        rec.setdefault("error", f"{type(exc).__name__}: {exc}")


async def _one_inner(client, headers: dict, item: WorkItem, tier: str, t0: float, rec: dict) -> None:
    import httpx

    delay = t0 + item.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.update(intended_tier=item.tier, tier=tier, prompt_tokens=item.prompt_len, max_tokens=item.max_tokens)
    body = {"prompt_ids": item.prompt_ids, "max_tokens": item.max_tokens, "temperature": 0, "ignore_eos": True,
            "tier": tier}
    t_send, t_wall = time.perf_counter(), time.time()
    rec["sent"] = t_send - t0
    try:
        r = await client.post("/v1/jobs", json=body, headers=headers)
    except httpx.HTTPError as exc:
        rec["error"] = f"submit: {exc}"
        return
    rec["accept_s"] = time.perf_counter() - t_send
    if r.status_code not in (200, 202):
        rec["error"] = f"submit {r.status_code}: {r.text[:200]}"
        return
    job_id = r.json()["id"]
    rec["job_id"] = job_id
    deltas: list[float] = []  # client receive times, relative to the submission
    server: list[float] = []  # the entries' Redis stream ids (publish time, ms), relative to the submission
    event, eid = None, None
    try:
        async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as s:
            async for line in s.aiter_lines():
                if line.startswith("id:"):
                    eid = line[3:].strip()
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event:
                    now = time.perf_counter()
                    data = json.loads(line[5:])
                    if event == "delta":
                        if data.get("text"):
                            deltas.append(now - t_send)
                            if eid and "-" in eid:
                                server.append(int(eid.split("-")[0]) / 1000.0 - t_wall)
                    elif event == "final":
                        rec["e2e_client_s"] = now - t_send
                        rec["status"] = data.get("status")
                        usage = data.get("usage") or {}
                        rec["output_tokens"] = usage.get("completion_tokens")
                        break
                    event, eid = None, None
    except httpx.HTTPError as exc:
        rec["error"] = f"events: {exc}"
    # Server-side publish times when every delta has one (a CPU-starved client reading late does not inflate
    # them); the client's receive times otherwise.
    times = server if server and len(server) == len(deltas) else deltas
    rec["timestamps"] = "server" if times is server else "client"
    if times:
        rec["ttft_s"] = times[0]
        rec["itl_s"] = [b - a for a, b in zip(times, times[1:], strict=False)]
        n = rec.get("output_tokens") or 0
        if n > 1:
            rec["tpot_s"] = (times[-1] - times[0]) / (n - 1)
    if "e2e_client_s" in rec:
        rec["e2e_s"] = max(times[-1], 0.0) if times else rec["e2e_client_s"]
        if rec["timestamps"] == "client":
            rec["e2e_s"] = rec["e2e_client_s"]


async def _drive(url: str, headers: dict, workload: Workload, one_tier: str | None, timeout: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    recs: list[dict] = [{} for _ in workload.items]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter() + 0.2
        tasks = [asyncio.create_task(_one(client, headers, it, one_tier or it.tier, t0, rec))
                 for it, rec in zip(workload.items, recs, strict=False)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        for rec in recs:
            if "e2e_s" not in rec and "error" not in rec:
                rec["error"] = "not finished before the run's time limit"
    return recs


def drive(stack: Stack, workload: Workload, *, one_tier: str | None = None, timeout: float = 300) -> list[dict]:
    return asyncio.run(_drive(stack.url, stack.headers, workload, one_tier, timeout))


# ------------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------------


def _pcts(values, scale: float = 1000.0) -> dict:
    v = [x for x in values if x is not None]
    return {f"p{q}": (common.percentile(v, q) * scale if v else None) for q in (50, 95, 99)} | \
        {"mean": (common.mean(v) * scale if v else None), "n": len(v)}


def summarise(recs: list[dict], rate: float, duration: float) -> dict:
    out = {"rate": rate, "requests": len(recs), "duration_s": duration,
           "errors": sum(1 for r in recs if "error" in r)}
    kinds: dict[str, int] = {}
    for r in recs:
        if "error" in r:
            kinds[r["error"][:120]] = kinds.get(r["error"][:120], 0) + 1
    out["error_kinds"] = kinds
    finished = [r for r in recs if r.get("status") == "succeeded"]
    span = max((r["sent"] + r["e2e_s"] for r in finished), default=0.0)
    out["wall_s"] = span
    out["output_tok_s"] = sum(r.get("output_tokens") or 0 for r in finished) / span if span else None
    out["request_throughput"] = len(finished) / span if span else None
    good = 0
    for tier in ("interactive", "batch"):
        rs = [r for r in recs if r.get("intended_tier") == tier]
        fin = [r for r in rs if r.get("status") == "succeeded"]
        ok = [r for r in fin if tier == "batch" or (r.get("ttft_s") is not None and r["ttft_s"] <= SLO_INTERACTIVE_TTFT_S)]
        good += len(ok)
        out[tier] = {"requests": len(rs), "finished": len(fin), "slo_met": len(ok),
                     "slo_attainment": len(ok) / len(rs) if rs else None,
                     "ttft_ms": _pcts(r.get("ttft_s") for r in fin),
                     "tpot_ms": _pcts(r.get("tpot_s") for r in fin),
                     "itl_ms": _pcts(x for r in fin for x in r.get("itl_s", [])),
                     "e2e_ms": _pcts(r.get("e2e_s") for r in fin)}
    out["goodput_req_s"] = good / span if span else None
    return out


# ------------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------------


def run(model: str | None = None, *, dtype: str = "float32", seed: int = 0, rates: tuple[float, ...] | None = None,
        rate_fractions: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0), duration: float = 20.0,
        requests: int = 32, prompt_len: tuple[int, int] = (32, 256), output_len: tuple[int, int] = (16, 128),
        throughput_requests: int = 32, idle_jobs: int = 20, interactive_share: float = 0.2,
        kv_cache_memory: str = "1GiB", quick: bool = False, out: str | Path | None = None, tag: str = "tiers",
        log=print) -> dict:
    from bench.engines import InferqOffline

    if quick:
        duration, prompt_len, output_len, throughput_requests, idle_jobs = 3.0, (8, 32), (4, 8), 4, 3
        rate_fractions = (1.0,)
    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    result: dict = {"benchmark": "tiers", "machine": info, "model": str(model_dir),
                    "slo": {"interactive_ttft_s": SLO_INTERACTIVE_TTFT_S, "batch": "finished within the run"},
                    "settings": {"kv_cache_memory": kv_cache_memory, "duration_per_rate_s": duration,
                                 "interactive_share": interactive_share}}
    with Stack(model=str(model_dir), dtype=dtype, kv_cache_memory=kv_cache_memory, log=log) as stack:
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        # 1. admission latency at idle
        log(f"admission latency at idle ({idle_jobs} jobs one at a time) ...")
        rng = random.Random(seed)
        ids = []
        for _ in range(idle_jobs):
            wl1 = Workload("idle", [WorkItem([rng.randint(100, vocab - 1) for _ in range(16)], 2, tier="interactive")])
            rec = drive(stack, wl1)[0]
            if rec.get("job_id"):
                ids.append(rec["job_id"])
            time.sleep(0.05)
        ts = stack.job_timestamps(ids)
        adm = [(t["started_at"] - t["queued_at"]).total_seconds() for t in ts if t["started_at"] and t["queued_at"]]
        acc = [(t["queued_at"] - t["created_at"]).total_seconds() for t in ts if t["queued_at"] and t["created_at"]]
        result["admission_idle"] = {"jobs": len(adm), "p50_ms": 1000 * (common.percentile(adm, 50) or 0),
                                    "p95_ms": 1000 * (common.percentile(adm, 95) or 0),
                                    "max_ms": 1000 * max(adm, default=0),
                                    "created_to_queued_p50_ms": 1000 * (common.percentile(acc, 50) or 0)}
        log(f"  acceptance -> admission p50 {result['admission_idle']['p50_ms']:.1f} ms")

        # 2. service throughput vs the offline engine (same token ids, same settings)
        tw = mixed(throughput_requests, seed, vocab_size=vocab, prompt_len=(32, 512) if not quick else prompt_len,
                   output_len=(16, 256) if not quick else output_len)
        log(f"service vs offline engine on the mixed workload ({len(tw)} requests) ...")
        recs = drive(stack, tw, one_tier="batch", timeout=900)
        fin = [r for r in recs if r.get("status") == "succeeded"]
        svc_wall = max((r["sent"] + r["e2e_s"] for r in fin), default=float("nan"))
        svc_tokens = sum(r.get("output_tokens") or 0 for r in fin)
        offline = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory)
        off = offline.run(tw)
        del offline
        svc_tps = svc_tokens / svc_wall if fin else None
        off_tps = off["output_tokens"] / off["wall_s"]
        result["service_vs_offline"] = {
            "requests": len(tw), "service_finished": len(fin), "service_wall_s": svc_wall,
            "service_output_tok_s": svc_tps, "offline_wall_s": off["wall_s"], "offline_output_tok_s": off_tps,
            "ratio": (svc_tps / off_tps) if svc_tps else None, "workload": tw.summary()}
        log(f"  service {common.fmt(svc_tps)} tok/s vs offline {off_tps:.1f} tok/s -> "
            f"{common.fmt(result['service_vs_offline']['ratio'])}")
        capacity_req_s = (len(fin) / svc_wall) if fin else 1.0
        # the tiers workload is smaller than the mixed one: scale capacity by the token ratio
        base = mixed(max(requests, 8), seed + 1, vocab_size=vocab, prompt_len=prompt_len, output_len=output_len)
        scale = (tw.output_tokens / len(tw)) / (base.output_tokens / len(base))
        est = capacity_req_s * scale
        rate_list = list(rates) if rates else [round(f * est, 3) for f in rate_fractions]
        result["capacity_estimate_req_s"] = est
        log(f"estimated capacity on the tiers workload {est:.2f} req/s; rates {rate_list}")

        # 3. Poisson arrivals, priorities on / off (alternating per rate)
        runs = []
        for i, rate in enumerate(rate_list):
            n = max(8, int(round(rate * duration)))
            wl = mixed(n, seed + 100 + i, vocab_size=vocab, prompt_len=prompt_len, output_len=output_len)
            wl = poisson_arrivals(wl, rate, seed + i, interactive_share=interactive_share)
            # The second mode gets the same lengths, tiers and arrival times but other token ids, so it cannot
            # hit the prefix cache the first one filled.
            twin = _shifted(wl, vocab)
            modes = ("priorities", "one-tier") if i % 2 == 0 else ("one-tier", "priorities")
            for j, mode in enumerate(modes):
                log(f"rate {rate} req/s, {n} requests, {mode} ...")
                recs = drive(stack, wl if j == 0 else twin, one_tier="batch" if mode == "one-tier" else None,
                             timeout=duration * 6 + 180)
                s = summarise(recs, rate, duration)
                s["mode"] = mode
                runs.append(s)
                it, bt = s["interactive"], s["batch"]
                log(f"  interactive TTFT p50 {common.fmt(it['ttft_ms']['p50'], 0)} ms p99 "
                    f"{common.fmt(it['ttft_ms']['p99'], 0)} ms (SLO met {it['slo_met']}/{it['requests']}); "
                    f"batch TTFT p50 {common.fmt(bt['ttft_ms']['p50'], 0)} ms; goodput "
                    f"{common.fmt(s['goodput_req_s'])} req/s; errors {s['errors']}")
                time.sleep(1.0)
        result["runs"] = runs
    a = result["admission_idle"]["p50_ms"]
    ratio = result["service_vs_offline"]["ratio"]
    result["targets"] = [
        {"target": "acceptance -> worker admission p50 at idle < 10 ms", "measured": a, "met": a < 10.0},
        {"target": "service throughput >= 90% of the offline engine", "measured": ratio,
         "met": None if ratio is None else ratio >= 0.9},
    ]
    return common.finish_run(result, t_start=t_start, load_start=load_start, out=out, tag=tag, plot=_plot,
                             report=report, log=log)


def _shifted(wl: Workload, vocab: int) -> Workload:
    from bench.workloads import _token_range

    lo, hi = _token_range(vocab)
    span = hi - lo + 1
    items = [WorkItem([lo + (t - lo + 7919) % span if t >= lo else t for t in it.prompt_ids], it.max_tokens,
                      it.arrival, it.tier, it.shared_prefix_len) for it in wl.items]
    return Workload(wl.name, items, dict(wl.params, token_shift=7919))


def report(result: dict) -> str:
    lines = [common.machine_line(result["machine"])]
    a = result["admission_idle"]
    lines.append(f"acceptance -> admission at idle: p50 {a['p50_ms']:.1f} ms, p95 {a['p95_ms']:.1f} ms "
                 f"({a['jobs']} jobs); created -> queued p50 {a['created_to_queued_p50_ms']:.1f} ms")
    s = result["service_vs_offline"]
    lines.append(f"service vs offline ({s['requests']} mixed requests): {common.fmt(s['service_output_tok_s'])} vs "
                 f"{common.fmt(s['offline_output_tok_s'])} output tok/s = {common.fmt(s['ratio'])}")
    rows = []
    for r in result.get("runs", []):
        for tier in ("interactive", "batch"):
            t = r[tier]
            rows.append({"rate": f"{r['rate']:.2f}", "mode": r["mode"], "tier": tier, "n": t["requests"],
                         "ttft50": t["ttft_ms"]["p50"], "ttft95": t["ttft_ms"]["p95"], "ttft99": t["ttft_ms"]["p99"],
                         "tpot50": t["tpot_ms"]["p50"], "tpot99": t["tpot_ms"]["p99"],
                         "itl50": t["itl_ms"]["p50"], "itl99": t["itl_ms"]["p99"],
                         "e2e50": t["e2e_ms"]["p50"], "e2e99": t["e2e_ms"]["p99"],
                         "slo": f"{100 * t['slo_attainment']:.0f}%" if t["slo_attainment"] is not None else None,
                         "goodput": f"{r['goodput_req_s']:.2f}" if r["goodput_req_s"] is not None else None,
                         "tok_s": r["output_tok_s"]})
    lines.append(common.table(rows, [("rate", "rate req/s"), ("mode", "mode"), ("tier", "tier"), ("n", "n"),
                                     ("ttft50", "TTFT p50"), ("ttft95", "p95"), ("ttft99", "p99"),
                                     ("tpot50", "TPOT p50"), ("tpot99", "p99"), ("itl50", "ITL p50"),
                                     ("itl99", "p99"), ("e2e50", "e2e p50"), ("e2e99", "p99"),
                                     ("slo", "SLO met"), ("goodput", "goodput req/s"),
                                     ("tok_s", "output tok/s")], digits=0))
    lines.append("(latencies in ms; SLO: interactive TTFT <= 1 s, batch: finished)")
    lines += common.target_lines(result["targets"])
    lines.append(f"elapsed {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _plot(result: dict, out_dir: Path, tag: str) -> None:
    plt = common.pyplot()
    runs = result.get("runs", [])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode, ls in (("priorities", "-"), ("one-tier", "--")):
        rs = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["rate"])
        xs = [r["rate"] for r in rs]
        for tier, color in (("interactive", "tab:red"), ("batch", "tab:blue")):
            axes[0].plot(xs, [(r[tier]["ttft_ms"]["p50"] or float("nan")) for r in rs], ls, color=color, marker="o",
                         label=f"{tier} p50 ({mode})")
            axes[1].plot(xs, [(r[tier]["ttft_ms"]["p99"] or float("nan")) for r in rs], ls, color=color,
                         marker="o", label=f"{tier} p99 ({mode})")
        axes[2].plot(xs, [r["goodput_req_s"] or 0 for r in rs], ls, marker="o", label=f"goodput ({mode})")
        axes[2].plot(xs, [r["request_throughput"] or 0 for r in rs], ls, marker="x", alpha=0.5,
                     label=f"throughput ({mode})")
    axes[0].axhline(1000 * SLO_INTERACTIVE_TTFT_S, color="gray", lw=0.8)
    axes[1].axhline(1000 * SLO_INTERACTIVE_TTFT_S, color="gray", lw=0.8)
    for ax, title in zip(axes, ("TTFT p50 (ms)", "TTFT p99 (ms)", "req/s"), strict=False):
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle(f"Full stack (API -> Redis -> worker -> PostgreSQL), 20% interactive - {result['machine']['cpu']}, "
                 f"{result['machine']['dtype']}", fontsize=9)
    common.save_figure(fig, out_dir, tag)
