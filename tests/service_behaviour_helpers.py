"""A job-service namespace for the behaviour tests that run real worker subprocesses (tests/integration/
test_service_behaviours.py, tests/api/test_events_resume.py): settings for the workers' environment, a
tiny random model that can generate for a long time, and the test side's view of the jobs (statuses,
result and ledger rows, the worker's Redis stats hash). Real PostgreSQL and Redis only."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import select

from inferq import jobs
from inferq.contract import JobCreate, model_id
from inferq.db import Job, Result, Tenant, UsageEntry, make_engine, make_sessionmaker
from inferq.settings import Settings
from tests.service_fixtures import WorkerProcess, make_tenant, wait_for

TERMINAL = ("succeeded", "failed", "cancelled", "expired")
# far more tokens than any test waits for: such a job ends only when it is cancelled (or its worker dies)
ENDLESS = 15000


def make_long_context_model(tmp: Path) -> Path:
    """The tiny llama of tests/tiny_models.py with a 16k context, so that ENDLESS jobs never end by length
    while a test watches them."""
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp, arch="llama", max_position_embeddings=16384)


class Service:
    """One queue namespace (a fresh stream prefix) on the given PostgreSQL and Redis, with its tenant."""

    def __init__(self, pg_url: str, redis_url: str, model: Path, tmp: Path, **overrides: Any) -> None:
        self.prefix = f"sb-{uuid.uuid4().hex[:8]}"
        self.env: dict[str, Any] = dict(
            database_url=pg_url, redis_url=redis_url, stream_prefix=self.prefix, model=str(model), device="cpu",
            dtype="float32", kv_cache_memory="32MiB", torch_threads=1, max_num_seqs=4, heartbeat_seconds=0.3,
            claim_idle_ms=2000, reconcile_interval_seconds=1.0, shutdown_grace_seconds=0.5, log_json="true",
            log_level="INFO")
        self.env.update(overrides)
        self.settings = Settings(**{**self.env, "database_url": pg_url, "log_json": True})
        self.engine = make_engine(pg_url)
        self.db = make_sessionmaker(self.engine)
        import redis

        self.redis = redis.Redis.from_url(redis_url)
        self.tmp = tmp
        self.model = model_id(str(model))
        self.tenant = make_tenant(self.db)
        self.workers: list[WorkerProcess] = []

    def start_worker(self, **env: Any) -> WorkerProcess:
        """A worker subprocess, waited for until it has written its stats hash (it reads jobs then)."""
        name = f"w{len(self.workers) + 1}-{uuid.uuid4().hex[:4]}"
        w = WorkerProcess({**self.env, **env}, self.tmp / f"{name}.log", name)
        self.workers.append(w)
        wait_for(lambda: self.stats(w) or not w.alive(), 150, what="the worker to start")
        assert w.alive(), w.log_text()[-3000:]
        return w

    def submit(self, tenant: Tenant | None = None, **kw: Any) -> str:
        kw.setdefault("model", self.model)
        if not any(k in kw for k in ("prompt", "messages", "prompt_ids")):
            kw["prompt_ids"] = [5, 17, 33, 41, 7, 9]
        kw.setdefault("temperature", 0)
        job, created = jobs.submit(self.db, self.redis, self.settings, tenant or self.tenant, JobCreate(**kw))
        assert created
        return job.id

    def job(self, job_id: str) -> Job:
        with self.db() as s:
            return s.get(Job, job_id)

    def statuses(self, ids: list[str]) -> dict[str, str]:
        with self.db() as s:
            return dict(s.execute(select(Job.id, Job.status).where(Job.id.in_(list(ids)))).all())

    def wait_status(self, ids: list[str], statuses: tuple[str, ...] = TERMINAL, timeout: float = 60.0) -> dict[str, str]:
        """Poll until every job is in ``statuses``; the failure names the statuses last seen."""
        last: dict[str, str] = {}

        def reached() -> dict[str, str] | bool:
            last.update(self.statuses(ids))
            return bool(last) and all(v in statuses for v in last.values()) and dict(last)

        try:
            return wait_for(reached, timeout, what=f"jobs to reach {statuses}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen {last}\n{self.logs()}") from None

    def rows(self, job_id: str) -> tuple[list[Result], list[UsageEntry]]:
        with self.db() as s:
            return (list(s.scalars(select(Result).where(Result.job_id == job_id)).all()),
                    list(s.scalars(select(UsageEntry).where(UsageEntry.job_id == job_id)).all()))

    def one_result(self, job_id: str) -> tuple[Result, UsageEntry]:
        """The job's single result row and single ledger row (asserting there is exactly one of each)."""
        results, ledger = self.rows(job_id)
        assert len(results) == 1 and len(ledger) == 1, (job_id, results, ledger)
        return results[0], ledger[0]

    def stats(self, worker: WorkerProcess) -> dict[str, str]:
        raw = self.redis.hgetall(jobs.worker_key(self.prefix, worker.name))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {w.name}\n" + w.log_text()[-4000:] for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.redis.close()
        self.engine.dispose()
