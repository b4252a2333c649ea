"""A quantised model through the whole job service (issue 15): a worker serving int4 weights runs a job
submitted over REST, and its result, its single ledger row and its cost reconcile as for a float model (tokens
are tokens). Live uvicorn, worker subprocess (tiny random model), Redis and PostgreSQL."""

from __future__ import annotations

import uuid

import httpx
import pytest
from sqlalchemy import select

from inferq.db import UsageEntry
from tests.api.test_e2e import _cost, model_settings, tiny_model  # noqa: F401 - fixtures
from tests.service_fixtures import WorkerProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def int4_worker(model_settings, tmp_path):  # noqa: F811
    s = model_settings
    env = dict(database_url=s.database_url, redis_url=s.redis_url, stream_prefix=s.stream_prefix, model=s.model,
               device="cpu", dtype="float32", kv_cache_memory="16MiB", torch_threads=1, max_num_seqs=4,
               heartbeat_seconds=0.5, log_json="true", quantization="int4")
    w = WorkerProcess(env, tmp_path / "worker.log", f"w-{uuid.uuid4().hex[:6]}")
    yield w
    w.stop()


def test_an_int4_worker_runs_a_job_end_to_end(serve, model_settings, int4_worker, make_tenant, db):  # noqa: F811
    t = make_tenant()
    body = {"prompt_ids": [11, 12, 13, 14, 15, 16, 17], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=serve(model_settings), timeout=60, headers=t.headers) as c:
        job_id = c.post("/v1/jobs", json=body).json()["id"]

        def done() -> dict | None:
            view = c.get(f"/v1/jobs/{job_id}").json()
            return view if view["status"] in ("succeeded", "failed") else None

        view = wait_for(done, 200, interval=0.3, what="the job to finish")
        report = c.get("/v1/usage").json()
    log = int4_worker.log_text()
    assert view["status"] == "succeeded", (view, log[-2000:])
    assert '"quantization": "int4"' in log and "weights loaded" in log  # the worker really served int4
    assert view["usage"]["completion_tokens"] == 12 and view["usage"]["prompt_tokens"] == 7
    assert view["cost"]["micros"] == _cost(model_settings, view)
    with db() as s:
        (row,) = s.scalars(select(UsageEntry).where(UsageEntry.job_id == job_id)).all()
    assert (row.prompt_tokens, row.completion_tokens) == (7, 12)
    assert report["totals"]["completion_tokens"] == 12
