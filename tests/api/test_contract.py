"""Contract: schemathesis against the live app (uvicorn, real PostgreSQL and Redis) finds no 5xx and no
response that violates the OpenAPI document (bounded: a few examples per operation). Plus the
no-torch guarantee of the API process, and the typed stream message (``JobMessage``) with the one set of
request defaults shared by the API, the message, the engine and the offline schema."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings

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


@pytest.mark.integration
def test_no_server_errors_and_schema_conformance(serve, settings, redis_client, make_tenant):
    """Every operation, eight generated requests each (derandomized: the same ones every run).
    (Driven by hand rather than with ``schemathesis.pytest.from_fixture``, which does not work with
    pytest 9.)"""
    url = serve(settings)
    headers = make_tenant(admin=True).headers
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    labels = []
    for result in schema.get_all_operations():
        op = result.ok()
        labels.append(op.label)

        @hsettings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                   database=None)
        @given(case=op.as_strategy())
        def run(case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("webhook_url"), str):
                # whether a URL is acceptable depends on DNS and the allow-list, which a schema cannot say
                case.body["webhook_url"] = "http://127.0.0.1:9/hook"
            if isinstance(case.query, dict) and "cursor" in case.query:
                case.query.pop("cursor")  # opaque: only cursors the API returned are valid
            case.call_and_validate(headers=headers, timeout=20)

        try:
            run()
        except Exception as exc:  # collect every operation's failure, then report them together
            failures.append(f"{op.label}: {exc}")
    assert len(labels) == 10, labels
    assert not failures, "\n\n".join(failures)


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
