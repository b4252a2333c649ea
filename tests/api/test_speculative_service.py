"""Speculative decoding through the service (issue 14, accounting): a worker with the n-gram proposer runs a
job whose prompt repeats, and the job's proposed and accepted tokens reach its usage (GET /v1/jobs), its
single ledger row and the cost report, while billing stays per completion token. Live uvicorn, worker
subprocess (tiny random model), Redis and PostgreSQL."""

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
def ngram_worker(model_settings, tmp_path):  # noqa: F811
    s = model_settings
    env = dict(database_url=s.database_url, redis_url=s.redis_url, stream_prefix=s.stream_prefix, model=s.model,
               device="cpu", dtype="float32", kv_cache_memory="16MiB", torch_threads=1, max_num_seqs=4,
               heartbeat_seconds=0.5, log_json="true", speculative_method="ngram", num_speculative_tokens=4)
    w = WorkerProcess(env, tmp_path / "worker.log", f"w-{uuid.uuid4().hex[:6]}")
    yield w
    w.stop()


def test_speculative_tokens_reach_usage_ledger_and_report(serve, model_settings, ngram_worker, make_tenant, db):  # noqa: F811
    t = make_tenant()
    body = {"prompt_ids": [11, 12, 13, 14] * 8, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=serve(model_settings), timeout=60, headers=t.headers) as c:
        job_id = c.post("/v1/jobs", json=body).json()["id"]

        def done() -> dict | None:
            view = c.get(f"/v1/jobs/{job_id}").json()
            return view if view["status"] in ("succeeded", "failed") else None

        view = wait_for(done, 200, interval=0.3, what="the job to finish")
        report = c.get("/v1/usage").json()
    assert view["status"] == "succeeded", (view, ngram_worker.log_text()[-2000:])
    usage = view["usage"]
    assert usage["completion_tokens"] == 48
    assert usage["spec_proposed_tokens"] > 0, usage  # the repeating prompt gives the lookup matches at once
    assert 0 <= usage["spec_accepted_tokens"] <= usage["spec_proposed_tokens"]
    assert view["cost"]["micros"] == _cost(model_settings, view)  # billed per token received, not proposed
    with db() as s:
        (row,) = s.scalars(select(UsageEntry).where(UsageEntry.job_id == job_id)).all()
    assert (row.spec_proposed_tokens, row.spec_accepted_tokens) == (usage["spec_proposed_tokens"],
                                                                    usage["spec_accepted_tokens"])
    assert report["totals"]["spec_proposed_tokens"] == usage["spec_proposed_tokens"]  # the tenant's only job
    assert report["totals"]["spec_accepted_tokens"] == usage["spec_accepted_tokens"]
