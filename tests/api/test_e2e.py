"""End to end with a real inferq worker (``python -m worker.service``) on a tiny random model: REST
submission, SSE deltas then the final event, GET, the signed webhook, and Celery ``inferq.generate``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer
from werkzeug import Request, Response

from api.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
from tests.api.test_celery import ROOT, _env, run_client
from tests.api.test_events_api import read_sse
from tests.registry_helpers import announce_default_model
from tests.service_fixtures import WorkerProcess, expected_cost_micros

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama")


@pytest.fixture
def model_settings(settings, tiny_model):
    return settings.model_copy(update={"model": str(tiny_model), "webhook_backoff_base_seconds": 0.1})


@pytest.fixture
def inferq_worker(model_settings, tmp_path, redis_client):
    s = model_settings
    env = dict(database_url=s.database_url, redis_url=s.redis_url, stream_prefix=s.stream_prefix, model=s.model,
               device="cpu", dtype="float32", kv_cache_memory="16MiB", torch_threads=1, max_num_seqs=4,
               heartbeat_seconds=0.5, reconcile_interval_seconds=1.0, log_json="true")
    w = WorkerProcess(env, tmp_path / "worker.log", f"w-{uuid.uuid4().hex[:6]}")
    yield w
    try:
        w.terminate(20)
    except Exception:
        w.stop()


def _cost(settings, view: dict) -> int:
    """The cost a job view must show: its token counts at the prices of its tier."""
    usage = view["usage"]
    return expected_cost_micros(settings, view["tier"], prompt=usage["prompt_tokens"],
                                cached=usage["cached_prompt_tokens"], completion=usage["completion_tokens"])


def test_rest_sse_webhook_end_to_end(serve, model_settings, inferq_worker, make_tenant, httpserver):
    hooks: list[tuple[dict, bytes]] = []

    def handler(request: Request) -> Response:
        hooks.append((dict(request.headers), request.get_data()))
        return Response("", status=204)

    httpserver.expect_request("/done", method="POST").respond_with_handler(handler)
    t = make_tenant()
    url = serve(model_settings, webhooks=True)
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/jobs", json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                                     "ignore_eos": True, "webhook_url": httpserver.url_for("/done")},
                   headers=t.headers)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        with c.stream("GET", f"/v1/jobs/{job_id}/events", headers=t.headers) as resp:
            events = read_sse(resp)
        assert inferq_worker.alive(), inferq_worker.log_text()[-3000:]
        kinds = [e[0] for e in events]
        assert kinds[-1] == "final" and set(kinds[:-1]) <= {"delta"} and len(kinds) >= 2, events
        final = events[-1][2]
        streamed = "".join(e[2]["text"] for e in events[:-1])
        assert final["status"] == "succeeded" and final["finish_reason"] == "length"
        assert streamed == final["text"]
        assert final["usage"]["completion_tokens"] == 12
        assert final["usage"]["prompt_tokens"] == len(AutoTokenizer.from_pretrained(model_settings.model)
                                                      .encode("Once upon a time"))
        assert final["cost"]["micros"] == _cost(model_settings, final)
        job = c.get(f"/v1/jobs/{job_id}", headers=t.headers).json()
        assert job == final
        timings = job["timings"]
        assert timings["created_at"] <= timings["started_at"] <= timings["first_token_at"] <= timings["finished_at"]
        deadline = time.monotonic() + 30
        while not hooks and time.monotonic() < deadline:
            time.sleep(0.1)
    assert hooks, "webhook not delivered"
    headers, body = hooks[0]
    assert verify(t.webhook_secret, headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
    assert json.loads(body) == job


def test_celery_generate_end_to_end(model_settings, inferq_worker, make_tenant, tmp_path):
    t = make_tenant()
    announce_default_model(model_settings)  # known before the worker has loaded it, as `inferq up` does
    log = open(tmp_path / "celery.log", "wb")  # noqa: SIM115
    celery = subprocess.Popen(
        [sys.executable, "-c", "from deploy.cli import main; main()", "celery-worker", "--concurrency", "2",
         "--hostname", f"{model_settings.stream_prefix}@e2e"],
        cwd=ROOT, env=_env(model_settings, model=model_settings.model), stdout=log, stderr=subprocess.STDOUT)
    try:
        results = run_client(model_settings, [
            ("inferq.generate", {"api_key": t.key, "prompt": "Hello", "max_tokens": 6, "temperature": 0,
                                 "ignore_eos": True}),
            ("inferq.generate", {"api_key": t.key, "prompt": "Hello", "max_tokens": 6, "temperature": 0,
                                 "ignore_eos": True, "tier": "batch"}),
        ])
    finally:
        celery.terminate()
        celery.wait(20)
        log.close()
    assert all("ok" in r for r in results), (results, inferq_worker.log_text()[-3000:])
    a, b = results[0]["ok"], results[1]["ok"]
    assert a["status"] == b["status"] == "succeeded"
    assert a["usage"]["completion_tokens"] == 6 and a["text"] == b["text"]  # greedy: same text on both tiers
    assert (a["tier"], b["tier"]) == ("interactive", "batch")
    assert a["cost"]["micros"] == _cost(model_settings, a) and b["cost"]["micros"] == _cost(model_settings, b)
