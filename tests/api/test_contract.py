"""Contract: ``schemathesis run --checks all`` against the live app (uvicorn, real PostgreSQL and Redis) finds
no 5xx and nothing that disagrees with the OpenAPI document (bounded and deterministic). Plus the
no-torch guarantee of the API process, and the typed stream message (``JobMessage``) with the one set of
request defaults shared by the API, the message, the engine and the offline schema."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from inferq.contract import (
    DEFAULT_MAX_TOKENS,
    SCHEMA_VERSION,
    JobCreate,
    JobMessage,
    MessageError,
    decode_message,
    encode_message,
)
from scheduler.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions")
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")  # webhook hosts, /readyz: see there
# no worker runs here, so a job's event stream stays open (as documented) until the client hangs up: one
# second of it is enough to check the events sent
# an upload that fits the multipart schema is still refused (400) when its lines are not batch requests,
# which a schema cannot say of a file's contents
CONFIG = """
[[operations]]
include-path = "/v1/jobs/{job_id}/events"
request-timeout = 1

[[operations]]
include-name = "POST /v1/files"
checks.positive_data_acceptance.expected-statuses = ["2XX", "400", "401", "404", "413"]
"""


@pytest.mark.integration
def test_schemathesis_all_checks(serve, settings, redis_client, make_tenant, tmp_path):
    """``schemathesis run --checks all`` (every phase: examples, coverage, fuzzing, stateful) against the
    live app: no 5xx, every response as documented (status, headers, body, event-stream events), schema-valid
    requests accepted and invalid ones refused, ``Allow`` on 405 exact. Bounded and deterministic (the same
    requests every run). The OpenAI-compatible routes wait for a worker's answer: tests/api/test_openai.py
    drives them."""
    url = serve(settings)
    key = make_tenant(admin=True).key
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config), "run",
           f"{url}/openapi.json", "--checks", "all", "--max-examples", "5", "--generation-deterministic",
           "--request-timeout", "20", "--max-response-time", "20",  # a contract test: a hang fails, slowness not
           "--workers", "1", "--no-color",
           "-H", f"Authorization: Bearer {key}", *[arg for path in OPENAI_ROUTES for arg in ("--exclude-path", path)]]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-12000:]
    tested = re.search(r"Tested:\s+(\d+)", report)
    assert tested and int(tested.group(1)) >= 10, report[-3000:]  # every operation ran


def test_api_never_imports_torch():
    code = (
        "import sys\n"
        "from api.app import create_app\n"
        "import api.cli, api.tasks, api.celery_app, api.webhooks, api.reports, api.events\n"
        "from inferq.settings import Settings\n"
        "app = create_app(Settings(), webhooks=False)\n"
        "app.openapi()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --- the stream message and the request defaults (no services needed) --------------------------------------

def _message(**request) -> JobMessage:
    return JobMessage(job_id="j1", tenant_id="t1", cache_namespace="ns1", model="tiny", tier="batch", priority=3,
                      request=request, deadline=1_700_000_100.5, enqueued_at=1_700_000_000.0)


def test_job_message_round_trip_and_wire_format():
    body = JobCreate(prompt="hello", max_tokens=7, temperature=0, stop=["\n"], seed=5, tier="batch")
    msg = _message(**body.request_params())
    data = msg.encode()
    assert JobMessage.decode(data) == msg
    # the wire map is schema v1 as before: encode_message / decode_message are thin wrappers over JobMessage
    wire = {"v": SCHEMA_VERSION, "job_id": "j1", "tenant_id": "t1", "ns": "ns1", "model": "tiny", "tier": "batch",
            "priority": 3, "request": body.request_params(), "deadline": 1_700_000_100.5,
            "enqueued_at": 1_700_000_000.0}
    assert msgpack.unpackb(data) == wire and decode_message(data) == wire
    assert encode_message("j1", "t1", "ns1", "tiny", "batch", 3, body.request_params(), 1_700_000_100.5,
                          1_700_000_000.0) == data
    assert msg.prompt_input() == {"prompt": "hello"}
    assert msg.to_sampling_params() == SamplingParams(max_tokens=7, temperature=0.0, seed=5, stop=["\n"])


@pytest.mark.parametrize(("raw", "reason"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1, 2]), "not a map"),
    (msgpack.packb({**_message().to_wire(), "v": 2}), "schema version"),
    (msgpack.packb({k: v for k, v in _message().to_wire().items() if k != "ns"}), "'ns'"),
    (msgpack.packb({**_message().to_wire(), "priority": "high"}), "'priority'"),
    (msgpack.packb({**_message().to_wire(), "tier": "gold"}), "tier"),
    (msgpack.packb({**_message().to_wire(), "deadline": "soon"}), "'deadline'"),
])
def test_job_message_rejects_bad_input(raw, reason):
    with pytest.raises(MessageError, match=reason):
        JobMessage.decode(raw)
    with pytest.raises(MessageError, match=reason):
        decode_message(raw)


def test_request_defaults_live_in_one_place():
    """A REST/Celery body without sampling fields, its message, the engine's SamplingParams and an offline
    ``inferq generate`` line all get the same documented defaults (max_tokens 256, docs/API.md)."""
    from worker.llm import GenerateRequest

    assert DEFAULT_MAX_TOKENS == 256
    want = SamplingParams()
    assert want.max_tokens == DEFAULT_MAX_TOKENS
    body = JobCreate(prompt="hi")
    assert body.max_tokens == DEFAULT_MAX_TOKENS
    via_message = JobMessage.decode(_message(**body.request_params()).encode()).to_sampling_params()
    assert via_message == want
    assert _message(prompt="hi").to_sampling_params() == want  # a request that leaves everything out
    assert GenerateRequest(prompt="hi").sampling() == want
    schema = JobCreate.model_json_schema()["properties"]
    assert {k: schema[k]["default"] for k in ("max_tokens", "temperature", "top_p", "top_k", "ignore_eos")} == {
        "max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "ignore_eos": False}


def test_contract_imports_no_torch():
    code = "import sys, inferq.contract; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_integral_numbers_are_integers_and_nothing_else_is():
    """The OpenAPI document says ``integer``, which JSON Schema (hence schemathesis) fills with ``8.0`` too: such
    a number is taken as 8 (it was a 422 that schemathesis reported as "schema-valid request rejected").
    Strings, booleans and fractions stay refused."""
    from pydantic import ValidationError

    body = JobCreate(prompt_ids=[1.0, 2], max_tokens=8.0, seed=3.0, top_k=0.0, priority=-1.0, stop_token_ids=[7.0])
    assert body.request_params() == {"prompt_ids": [1, 2], "max_tokens": 8, "seed": 3, "top_k": 0,
                                     "stop_token_ids": [7], "temperature": 1.0, "top_p": 1.0, "stop": [],
                                     "ignore_eos": False}
    assert all(type(v) is int for v in (body.max_tokens, body.seed, body.priority, *body.prompt_ids))
    for bad in ({"max_tokens": 8.5}, {"max_tokens": "8"}, {"max_tokens": True}, {"seed": float("inf")},
                {"seed": 2.0**63}, {"stop_token_ids": [1.5]}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            JobCreate(**{"prompt": "hi", **bad})
    with pytest.raises(ValidationError, match="prompt_ids"):
        JobCreate(prompt_ids=[1.5])
