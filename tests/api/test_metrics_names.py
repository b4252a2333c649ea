"""``/metrics`` of a live API and a live worker follow Prometheus' and vLLM's conventions: whatever only
goes up is a counter named ``_total``; every worker series carries ``model``; the token kinds are disjoint
(they add up to the job's tokens, none counted twice); the docs routes are counted under their own names,
not as ``route="unmatched"``."""

from __future__ import annotations

import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferq.contract import model_id
from tests.service_fixtures import WorkerProcess, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MONOTONIC = {"inferq_preemptions", "inferq_engine_busy_seconds", "inferq_tokens", "inferq_jobs_finished",
             "inferq_dead_letters", "inferq_messages_reclaimed", "inferq_jobs_handed_back", "inferq_db_errors",
             "inferq_result_write_errors", "inferq_api_requests", "inferq_api_jobs_submitted",
             "inferq_spec_proposed_tokens", "inferq_spec_accepted_tokens", "inferq_spec_drafts",
             "inferq_engine_steps"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama")


@pytest.fixture
def worker(settings, tiny_model, tmp_path, redis_client):
    port = free_port()
    env = dict(database_url=settings.database_url, redis_url=settings.redis_url, stream_prefix=settings.stream_prefix,
               model=str(tiny_model), device="cpu", dtype="float32", kv_cache_memory="16MiB", torch_threads=1,
               heartbeat_seconds=0.5, log_json="true")
    w = WorkerProcess(env, tmp_path / "worker.log", f"w-{uuid.uuid4().hex[:6]}", args=["--metrics-port", str(port)])
    w.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield w
    try:
        w.terminate(20)
    except Exception:
        w.stop()


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("inferq_")}


def _check_conventions(families: dict) -> None:
    for name, family in families.items():
        if name.endswith("_created"):
            continue  # prometheus_client's creation-time companions of counters and histograms
        assert not (family.type == "gauge" and name.endswith("_total")), f"gauge {name} named like a counter"
        if family.type == "counter":  # exposed as NAME_total
            assert all(s.name in (f"{name}_total", f"{name}_created") for s in family.samples), name
    for name in MONOTONIC & set(families):
        assert families[name].type == "counter", f"{name} only goes up but is a {families[name].type}"


def test_metrics_of_a_live_api_and_worker(serve, settings, tiny_model, worker, make_tenant):
    base = serve(settings.model_copy(update={"model": str(tiny_model)}))
    t = make_tenant()
    with httpx.Client(base_url=base, timeout=30) as api:
        job = api.post("/v1/jobs", headers=t.headers, json={"prompt": "Hello world!", "max_tokens": 5,
                                                             "temperature": 0}).json()
        view = wait_for(lambda: (v := api.get(f"/v1/jobs/{job['id']}", headers=t.headers).json())["status"]
                        in ("succeeded", "failed") and v, 120, what=f"the job (worker log: {worker.log_path})")
        assert view["status"] == "succeeded", view
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert api.get(path).status_code == 200
        api_families = _families(api.get("/metrics").text)

    routes = {s.labels["route"] for s in api_families["inferq_api_requests"].samples if s.labels["status"] < "400"}
    assert {"/docs", "/openapi.json", "/redoc", "/v1/jobs", "/v1/jobs/{job_id}"} <= routes
    assert "unmatched" not in routes
    _check_conventions(api_families)

    def scrape() -> dict | None:
        fams = _families(httpx.get(worker.metrics_url, timeout=10).text)
        done = [s for s in fams["inferq_jobs_finished"].samples if s.name.endswith("_total") and s.value >= 1]
        return fams if done else None

    families = wait_for(scrape, 60, what="the worker's metrics to count the job")
    _check_conventions(families)
    model = model_id(str(tiny_model))
    for family in families.values():
        for sample in family.samples:
            assert sample.labels.get("model") == model, (sample.name, sample.labels)
    for name in ("inferq_preemptions", "inferq_engine_busy_seconds", "inferq_requests_running",
                 "inferq_kv_cache_usage_ratio", "inferq_time_to_first_token_seconds"):
        assert name in families, name
    busy = [s.value for s in families["inferq_engine_busy_seconds"].samples if s.name.endswith("_total")]
    assert busy and busy[0] > 0

    tokens = {s.labels["kind"]: s.value for s in families["inferq_tokens"].samples
              if s.name == "inferq_tokens_total" and s.labels["tier"] == view["tier"]}
    assert set(tokens) == {"prompt_cached", "prompt_uncached", "completion"}
    usage = view["usage"]  # disjoint kinds: each token counted once
    assert tokens["prompt_cached"] + tokens["prompt_uncached"] == usage["prompt_tokens"]
    assert tokens["prompt_cached"] == usage["cached_prompt_tokens"]
    assert tokens["completion"] == usage["completion_tokens"]
    assert sum(tokens.values()) == usage["total_tokens"]
