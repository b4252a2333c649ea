"""Cache-aware routing across workers (issue 17, item 2): two workers, a shared-prefix workload, routing on
vs off in one invocation.

The stack: a fresh PostgreSQL database, a fresh stream prefix on the configured Redis, two worker
subprocesses (``python -m worker.service``, one torch thread each) serving the same model; jobs are submitted
in-process (``jobs.submit``, as the API does) at a fixed rate, with ``cache_routing`` set on the submitting
side only: the same two workers serve both modes (routing is decided at enqueue time), so the comparison is
not confounded by two different worker start-ups. Each mode draws its own prefixes (nothing is cached from
the other mode's run); modes alternate over ``repeats``.

Workload: ``groups`` shared prefixes of ``prefix_len`` random token ids (a tenant's system prompts), each job
one of them (uniformly at random) plus a distinct question of 16-32 tokens, ``output_len`` tokens out, greedy.
Reported per mode: prefix hit rate (prompt tokens served from the prefix cache / prompt tokens, from the
ledger), TTFT p50/p95 (job accepted -> first token, from the job rows), wall time, and the share of jobs that
ran on the worker owning their key (routing on).
"""

from __future__ import annotations

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


class TwoWorkerStack(ThrowawayStack):
    """A fresh database and stream prefix with ``workers`` worker subprocesses of ``model``."""

    def __init__(self, model: str, *, workers: int = 2, dtype: str = "float32", kv_cache_memory: str = "512MiB",
                 max_num_seqs: int = 8, log=print) -> None:
        super().__init__(log)
        self.model, self.workers = model, workers
        self.worker_env = {"INFERQ_DTYPE": dtype, "INFERQ_KV_CACHE_MEMORY": kv_cache_memory,
                           "INFERQ_MAX_NUM_SEQS": str(max_num_seqs), "INFERQ_TORCH_THREADS": "1",
                           "INFERQ_HEARTBEAT_SECONDS": "1", "INFERQ_LOG_JSON": "true",
                           "INFERQ_SHUTDOWN_GRACE_SECONDS": "5"}
        self.log_dir = Path(tempfile.mkdtemp(prefix="inferq-bench-routing-"))
        self.names: list[str] = []

    def start(self) -> None:
        import redis

        from inferq.contract import model_id
        from inferq.jobs.routes import read_live_workers

        self.db = self.create_database()
        self.redis = redis.Redis.from_url(self.base.redis_url)
        env = dict(os.environ, PYTHONUNBUFFERED="1", INFERQ_DATABASE_URL=self.db_url,
                   INFERQ_REDIS_URL=self.base.redis_url, INFERQ_STREAM_PREFIX=self.prefix,
                   INFERQ_MODEL=self.model, **self.worker_env)
        env.pop("INFERQ_CONFIG", None)
        for i in range(self.workers):
            name = f"bench-w{i + 1}-{self.tag[:4]}"
            log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
            self.procs.append((name, subprocess.Popen([sys.executable, "-m", "worker.service"], cwd=ROOT,
                                                      env=dict(env, INFERQ_WORKER_NAME=name), stdout=log,
                                                      stderr=subprocess.STDOUT)))
            self.names.append(name)
        self.log(f"started {self.workers} workers (logs {self.log_dir})")
        deadline = time.monotonic() + 300
        while set(read_live_workers(self.redis, self.prefix, model_id(self.model))) != set(self.names):
            for name, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited: {(self.log_dir / f'{name}.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not register")
            time.sleep(0.2)

    def settings(self, routing: bool):
        from inferq.settings import Settings

        return Settings(database_url=self.db_url, redis_url=self.base.redis_url, stream_prefix=self.prefix,
                        model=self.model, cache_routing=routing)

    def stop(self) -> None:
        if getattr(self, "redis", None) is not None:
            self.redis.close()
        super().stop(wait_s=30)


def workload(rng: random.Random, vocab: int, *, requests: int, groups: int, prefix_len: int,
             question_len: tuple[int, int]) -> list[list[int]]:
    """``requests`` prompts, each one of ``groups`` shared prefixes plus its own question."""
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(groups)]
    return [prefixes[rng.randrange(groups)] + [rng.randrange(3, vocab) for _ in range(rng.randint(*question_len))]
            for _ in range(requests)]


def run_mode(stack: TwoWorkerStack, prompts: list[list[int]], *, routing: bool, rate: float, output_len: int,
             timeout: float = 600) -> dict:
    """Submit ``prompts`` at ``rate`` per second with routing on or off; wait for all; measure."""
    from sqlalchemy import select

    from inferq import jobs
    from inferq import routing as rt
    from inferq.contract import JobCreate, model_id
    from inferq.db import Job, UsageEntry
    from inferq.jobs.routes import config_of, read_live_workers

    settings = stack.settings(routing)
    model = model_id(stack.model)
    live = read_live_workers(stack.redis, stack.prefix, model)
    ids, owners = [], {}
    t0 = time.monotonic()
    for k, prompt in enumerate(prompts):
        time.sleep(max(0.0, t0 + k / rate - time.monotonic()))
        job, _ = jobs.submit(stack.db, stack.redis, settings, stack.tenant,
                             JobCreate(model=model, prompt_ids=prompt, max_tokens=output_len, temperature=0,
                                       ignore_eos=True, tier="interactive"))
        ids.append(job.id)
        owners[job.id] = rt.owner(rt.routing_key({"prompt_ids": prompt}, stack.tenant.cache_namespace,
                                                 config_of(settings)), live)
    deadline = time.monotonic() + timeout
    while True:
        with stack.db() as s:
            rows = s.execute(select(Job.id, Job.status, Job.worker, Job.created_at, Job.first_token_at)
                             .where(Job.id.in_(ids))).all()
        if all(r.status in ("succeeded", "failed", "cancelled", "expired") for r in rows):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("jobs did not finish")
        time.sleep(0.2)
    wall = time.monotonic() - t0
    with stack.db() as s:
        usage = s.execute(select(UsageEntry.prompt_tokens, UsageEntry.cached_prompt_tokens)
                          .where(UsageEntry.job_id.in_(ids))).all()
    prompt_tokens = sum(u.prompt_tokens for u in usage)
    cached = sum(u.cached_prompt_tokens for u in usage)
    ttft = [(r.first_token_at - r.created_at).total_seconds() for r in rows if r.first_token_at is not None]
    per_worker: dict[str, int] = {}
    for r in rows:
        per_worker[r.worker or "-"] = per_worker.get(r.worker or "-", 0) + 1
    return {"routing": routing, "requests": len(ids), "succeeded": sum(r.status == "succeeded" for r in rows),
            "hit_rate": cached / prompt_tokens if prompt_tokens else None, "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": cached, "ttft_p50_ms": 1000 * (common.percentile(ttft, 50) or 0),
            "ttft_p95_ms": 1000 * (common.percentile(ttft, 95) or 0), "wall_s": wall,
            "on_owner_share": sum(owners[r.id] == r.worker for r in rows) / len(rows), "per_worker": per_worker}


def run(model: str | None = None, *, dtype: str = "float32", requests: int = 32, groups: int = 8,
        prefix_len: int = 256, question_len: tuple[int, int] = (16, 32), output_len: int = 8, rate: float = 1.0,
        repeats: int = 1, seed: int = 0, kv_cache_memory: str = "512MiB", out: str | Path | None = None,
        tag: str = "routing", log=print) -> dict:
    from inferq.log import configure_logging

    configure_logging("WARNING")  # not a line per submitted job
    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start, load_start = time.perf_counter(), os.getloadavg()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    rows: list[dict] = []
    with TwoWorkerStack(str(model_dir), dtype=dtype, kv_cache_memory=kv_cache_memory, log=log) as stack:
        # warm-up: one job per worker (first steps pay one-time costs), outside the measurement
        run_mode(stack, workload(rng, vocab, requests=4, groups=4, prefix_len=16, question_len=(4, 8)),
                 routing=False, rate=100.0, output_len=2)
        for rep in range(repeats):
            for routing in ((True, False) if rep % 2 == 0 else (False, True)):
                prompts = workload(rng, vocab, requests=requests, groups=groups, prefix_len=prefix_len,
                                   question_len=question_len)
                log(f"[rep {rep}] routing {'on' if routing else 'off'}: {requests} jobs at {rate}/s ...")
                row = run_mode(stack, prompts, routing=routing, rate=rate, output_len=output_len) | {"repeat": rep}
                log(f"  hit rate {row['hit_rate']:.3f}, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                    f"p95 {row['ttft_p95_ms']:.0f} ms, on owner {row['on_owner_share']:.2f}, {row['per_worker']}")
                rows.append(row)
    summary = {("on" if flag else "off"): {k: common.mean(r[k] for r in rows if r["routing"] == flag)
                                           for k in ("hit_rate", "ttft_p50_ms", "ttft_p95_ms", "wall_s",
                                                     "on_owner_share")} for flag in (True, False)}
    result = {"benchmark": "routing", "machine": info, "model": str(model_dir),
              "workload": {"requests": requests, "groups": groups, "prefix_len": prefix_len,
                           "question_len": question_len, "output_len": output_len, "rate": rate, "workers": 2},
              "rows": rows, "summary": summary, "elapsed_s": time.perf_counter() - t_start,
              "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    common.write_json(common.results_dir(out), tag, result)
    log(report(result))
    return result


def report(result: dict) -> str:
    s = result["summary"]
    rows = [{"case": f"routing {k}", **v} for k, v in s.items()]
    return "\n".join([
        common.machine_line(result["machine"]), f"workload: {result['workload']}",
        common.table(rows, [("case", "mode"), ("hit_rate", "prefix hit rate"), ("ttft_p50_ms", "TTFT p50 ms"),
                            ("ttft_p95_ms", "TTFT p95 ms"), ("on_owner_share", "ran on owner"),
                            ("wall_s", "wall s")]),
        f"elapsed {result['elapsed_s']:.0f} s"])
