"""The OpenAI-compatible routes, driven by the official ``openai`` client against a live API, a real worker
(tiny random model), Redis and PostgreSQL: the same jobs, ledger and tenants as ``/v1/jobs``."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import jsonschema
import openai
import pytest
from sqlalchemy import select

from api import openai_schemas as oa
from inferq.contract import model_id
from inferq.db import Job
from tests.api.test_e2e import _cost, inferq_worker, model_settings  # noqa: F401 - fixtures
from tests.api.test_events_api import read_sse
from tests.service_fixtures import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A long context (16k positions), so a job asked for thousands of tokens runs long enough to hang up on."""
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", max_position_embeddings=16384)


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def stack(serve, model_settings, inferq_worker, make_tenant):  # noqa: F811
    t = make_tenant()
    url = serve(model_settings)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=t.key, max_retries=0, timeout=120)
    return url, t, client


def _job(db, job_id: str) -> Job:
    with db() as s:
        return s.get(Job, job_id)


def _job_text(url: str, t, **body) -> dict:
    """The same request through inferq's own route, for comparison."""
    with httpx.Client(base_url=url, timeout=120) as c:
        job = c.post("/v1/jobs", json=body, headers=t.headers).json()
        with c.stream("GET", f"/v1/jobs/{job['id']}/events", headers=t.headers) as resp:
            return read_sse(resp)[-1][2]


def test_chat_completion_is_the_same_job_as_v1_jobs(stack, model_settings, db):  # noqa: F811
    url, t, client = stack
    out = client.chat.completions.create(model=openai.NOT_GIVEN, messages=CHAT, max_tokens=9,
                                         temperature=0, seed=3, user="u-1",
                                         extra_body={"ignored_field": 1, "ignore_eos": True})
    ref = _job_text(url, t, messages=CHAT, max_tokens=9, temperature=0, seed=3, ignore_eos=True)
    assert ref["usage"]["completion_tokens"] == 9
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref["text"]
    assert out.choices[0].finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
    assert out.usage.completion_tokens == ref["usage"]["completion_tokens"]
    assert out.usage.prompt_tokens == ref["usage"]["prompt_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # the second identical prompt is served from the prefix cache, and the field says so
    again = client.chat.completions.create(messages=CHAT, max_tokens=9, temperature=0, model=openai.NOT_GIVEN)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    job_id = out.id.removeprefix("chatcmpl-")
    job = _job(db, job_id)
    assert job.tenant_id == t.tenant_id and job.tier == "interactive" and job.meta == {"user": "u-1"}
    with httpx.Client(base_url=url, timeout=30) as c:
        view = c.get(f"/v1/jobs/{job_id}", headers=t.headers).json()
    assert view["cost"]["micros"] == _cost(model_settings, view)  # billed like any job


def test_streaming_chat_with_usage_and_text_completions(stack):
    url, t, client = stack
    chunks = list(client.chat.completions.create(messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, model=openai.NOT_GIVEN,
                                                 extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2  # streamed, not one lump
    plain = client.chat.completions.create(messages=CHAT, max_tokens=8, temperature=0, model=openai.NOT_GIVEN,
                                           extra_body={"ignore_eos": True})
    assert text == plain.choices[0].message.content

    comp = client.completions.create(model=openai.NOT_GIVEN, prompt="Once upon a time", max_tokens=6, temperature=0)
    ref = _job_text(url, t, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert ref["text"]
    assert comp.object == "text_completion" and comp.choices[0].text == ref["text"]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt="Once upon a time", max_tokens=6, temperature=0, stream=True, model=openai.NOT_GIVEN) if c.choices)
    assert streamed == ref["text"]
    # OpenAI's default max_tokens for completions is 16
    assert client.completions.create(prompt="Hi", temperature=0, model=openai.NOT_GIVEN,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens <= 16


@pytest.mark.parametrize("extra,param", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"temperature": 3}, "temperature"), ({"presence_penalty": 0.5}, "presence_penalty"),
])
def test_unsupported_or_invalid_fields_are_400_in_openai_shape(stack, extra, param):
    _, _, client = stack
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=CHAT, max_tokens=4, model=openai.NOT_GIVEN, extra_body=extra)
    body = err.value.body
    assert set(body) >= {"message", "type", "param", "code"} and body["param"] == param and body["message"]


def test_errors_auth_role_and_json(stack):
    url, t, client = stack
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(messages=CHAT, model=openai.NOT_GIVEN)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}],
                                       model=openai.NOT_GIVEN)
    assert err.value.body["param"] == "messages[0].role"
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers=t.headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_batch_tier_by_header_or_flex(stack, db):
    _, t, client = stack
    out = client.chat.completions.create(messages=CHAT, max_tokens=3, model=openai.NOT_GIVEN,
                                         extra_headers={"X-Inferq-Tier": "batch"})
    flex = client.chat.completions.create(messages=CHAT, max_tokens=3, model=openai.NOT_GIVEN, service_tier="flex")
    for o in (out, flex):
        assert _job(db, o.id.removeprefix("chatcmpl-")).tier == "batch"


def test_client_disconnect_cancels_the_job(stack, db):
    """A streaming client that goes away mid-answer: its job is cancelled, not run to max_tokens."""
    url, t, _ = stack
    marker = uuid.uuid4().hex
    with httpx.Client(base_url=url, timeout=60) as c, c.stream(
            "POST", "/v1/chat/completions", headers=t.headers,
            json={"messages": CHAT, "max_tokens": 15000, "ignore_eos": True, "stream": True, "user": marker}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # one real token arrived: the job runs; now hang up
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with db() as s:
            job = s.scalar(select(Job).where(Job.tenant_id == t.tenant_id).order_by(Job.created_at.desc()))
        if job.status in ("cancelled", "succeeded", "failed"):
            break
        time.sleep(0.2)
    assert job.meta == {"user": marker} and job.status == "cancelled"


def test_models_list_and_retrieve(stack, model_settings, make_tenant):  # noqa: F811
    """``GET /v1/models``: the model jobs may name, with its context once the worker has published it and
    the workers serving it; retrieve by id; an unknown id is 404 and no key is 401, in OpenAI's shape."""
    url, _, client = stack
    name = model_id(model_settings.model)

    def served() -> object | None:
        models = {m.id: m for m in client.models.list().data}
        m = models.get(name)
        # the API caches a model's entry for two seconds: the context may show a moment after the worker
        return m if m is not None and m.model_extra.get("workers", 0) >= 1 and m.model_extra["max_model_len"] else None

    m = wait_for(served, 120, what="the worker to publish its model")
    assert m.object == "model" and m.owned_by == "inferq" and m.created > 0
    assert m.model_extra["max_model_len"] == 16384  # the tiny model's context, as the worker published it
    one = client.models.retrieve(name)
    assert one.id == name and one.model_extra["max_model_len"] == 16384
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-17")
    assert e.value.body["code"] == "not_found"
    anonymous = openai.OpenAI(base_url=f"{url}/v1", api_key="iq_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


# --- what is refused before any job exists (no worker needed) -------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000  # 200 KB, within the body limit; past the JSON parser's recursion limit


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_or_mistyped_bodies_are_400_not_500(serve, settings, redis_client, make_tenant, db, path):
    """Regression (found by the schemathesis run's neighbourhood): JSON nested past the parser's recursion
    limit raised ``RecursionError``, answered 500. Mistyped fields are 400 too: the fields are strict, as
    OpenAI's are (``"8"`` is not 8, ``"yes"`` not true). Nothing reaches the job table."""
    url = serve(settings)
    t = make_tenant()
    prompt = {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "Hi"}
    bodies = [(DEEP, None), (b'{"messages": ' + DEEP + b', "prompt": ' + DEEP + b"}", None),
              (json.dumps({**prompt, "max_tokens": "8"}).encode(), "max_tokens"),
              (json.dumps({**prompt, "stream": "yes"}).encode(), "stream"),
              (json.dumps({**prompt, "seed": 1.5}).encode(), "seed")]
    with httpx.Client(base_url=url, timeout=30) as c:
        for body, param in bodies:
            r = c.post(path, content=body, headers={**t.headers, "Content-Type": "application/json"})
            assert r.status_code == 400, (body[:80], r.status_code, r.text[:300])
            assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
    with db() as s:
        assert s.scalar(select(Job).where(Job.tenant_id == t.tenant_id)) is None


@pytest.mark.parametrize(("kind", "body", "accepted"), [
    (oa.CompletionRequest, {"prompt": "Hi", "max_tokens": 8.0, "seed": 3.0, "logprobs": 0.0}, True),
    (oa.CompletionRequest, {"prompt": [1, 2.0, 3]}, True),
    (oa.CompletionRequest, {"prompt": ["one"], "echo": False, "suffix": "", "best_of": 1}, True),
    (oa.CompletionRequest, {"prompt": "Hi", "max_tokens": 8.5}, False),
    (oa.CompletionRequest, {"prompt": "Hi", "max_tokens": "8"}, False),
    (oa.CompletionRequest, {"prompt": ["a", "b"]}, False),
    (oa.CompletionRequest, {"prompt": [""]}, False),
    (oa.CompletionRequest, {"prompt": []}, False),
    (oa.CompletionRequest, {"prompt": "Hi", "stop": ""}, False),
    (oa.CompletionRequest, {"prompt": "Hi", "suffix": "x"}, False),
    (oa.CompletionRequest, {"prompt": "Hi\u0000"}, False),
    (oa.CompletionRequest, {"prompt": "Hi", "max_tokens": 2_000_000}, False),
    (oa.ChatCompletionRequest, {"messages": CHAT, "n": 1, "logprobs": False, "top_logprobs": 0,
                                "presence_penalty": 0.0, "response_format": {"type": "text"}, "user": "u"}, True),
    (oa.ChatCompletionRequest, {"messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]},
                                             {"role": "user", "content": None}]}, True),
    (oa.ChatCompletionRequest, {"messages": CHAT, "n": 2}, False),
    (oa.ChatCompletionRequest, {"messages": CHAT, "logprobs": True}, False),
    (oa.ChatCompletionRequest, {"messages": CHAT, "top_logprobs": 2}, False),
    (oa.ChatCompletionRequest, {"messages": CHAT, "frequency_penalty": 0.1}, False),
    (oa.ChatCompletionRequest, {"messages": CHAT, "response_format": {"type": "json_object"}}, False),
    (oa.ChatCompletionRequest, {"messages": [{"role": "tool", "content": "x"}]}, False),
    (oa.ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
    (oa.ChatCompletionRequest, {"messages": CHAT, "user": "\u0000"}, False),
    (oa.ChatCompletionRequest, {"messages": []}, False),
])
def test_the_published_request_body_says_what_the_route_accepts(kind, body, accepted):
    """The OpenAPI request body (``oa.request_body``, what schemathesis generates from) and the route's own
    checks agree: a body is valid by the document exactly when the route makes a job of it. (The model name is
    checked later, on submission: the document's pattern is the same rule, and an unserved model is a 404.)"""
    schema = oa.request_body(kind)["content"]["application/json"]["schema"]
    valid = jsonschema.Draft202012Validator(schema).is_valid(body)
    try:
        oa.parse(kind, body).to_job()
        made = True
    except oa.OpenAIError:
        made = False
    assert (valid, made) == (accepted, accepted)
