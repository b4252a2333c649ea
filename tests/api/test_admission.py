"""Admission against the model registry over real HTTP, Redis and PostgreSQL (issue 18 items 1 and 3, issue 19
item 1): unknown models are 404 and bad names 422 before anything is written, ``/readyz`` reports the
workers per model, prompts are counted with the model's tokenizer exactly as the worker counts them, a
prompt or ``max_tokens`` that does not fit the context is refused, the token quota charges the exact count,
and failed jobs stay charged."""

from __future__ import annotations

import re
from types import SimpleNamespace

import httpx
import pytest
from sqlalchemy import func, select

from api.tokens import PromptCounter, TemplateError
from inferq import jobs
from inferq.contract import JobCreate, model_id
from inferq.db import Job
from inferq.models_registry import ModelCatalog, WorkerRegistration, describe_engine
from tests.api.test_e2e import inferq_worker, model_settings  # noqa: F401 - fixtures
from tests.registry_helpers import register_worker
from tests.service_fixtures import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CONTEXT = 64  # the live worker's tiny model's context
PROMPT = "Once upon a time there was a small language model."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world! <|im_end|> ok"}]


def _jobs_of(db, tenant_id: str) -> int:
    with db() as s:
        return s.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id)) or 0


def _keys(redis_client, prefix: str) -> set[str]:
    return {k.decode() for k in redis_client.scan_iter(match=f"{prefix}:*", count=1000)}


# ---- without a worker ---------------------------------------------------------------------------------------


def test_unknown_model_is_404_and_bad_names_422_before_anything_is_written(client, tenant, settings, db,
                                                                             redis_client):
    before = _keys(redis_client, settings.stream_prefix)
    r = client.post("/v1/jobs", json={"model": "gpt-17", "prompt": "hi"}, headers=tenant.headers)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "model_not_found" and err["fields"][0]["field"] == "model"
    assert "'gpt-17'" in err["message"] and model_id(settings.model) in err["message"]  # lists what is served
    for bad in ("gpt 17", "x" * 129, "../etc", "-x", "caf\u00e9", "a;b"):
        r = client.post("/v1/jobs", json={"model": bad, "prompt": "hi"}, headers=tenant.headers)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["fields"][0]["field"] == "model"
    r = client.post("/v1/chat/completions", json={"model": "gpt-17", "messages": CHAT}, headers=tenant.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert _jobs_of(db, tenant.tenant_id) == 0
    assert _keys(redis_client, settings.stream_prefix) == before  # no stream (or any key) named after them


def test_readyz_reports_the_workers_serving_each_model(client, settings):
    name = model_id(settings.model)
    r = client.get("/readyz")
    assert r.status_code == 503, r.text  # the model is known (announced) but nobody serves it
    assert r.json()["checks"]["workers"].startswith("no worker serves") and r.json()["models"] == {name: []}
    a, b = register_worker(settings, "w-a"), register_worker(settings, "w-b")
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["models"] == {name: ["w-a", "w-b"]}, r.text
    a.withdraw()
    assert client.get("/readyz").json()["models"] == {name: ["w-b"]}
    b.withdraw()
    assert client.get("/readyz").status_code == 503


def test_failed_jobs_keep_charging_the_token_quota(client, make_tenant, db):
    """A job the worker refuses (failed, nothing computed, a zero ledger row) still counts for the minute."""
    t = make_tenant(tokens_per_minute=1000)
    body = {"prompt_ids": [5, 6, 7, 8], "max_tokens": 300}
    r = client.post("/v1/jobs", json=body, headers=t.headers)
    assert r.status_code == 202, r.text
    with db() as s:  # what the worker writes for a job it cannot run
        assert jobs.finish(s, r.json()["id"], jobs.Outcome(status="failed", error="refused"), from_statuses="queued")
        s.commit()
    r = client.post("/v1/jobs", json={**body, "max_tokens": 800}, headers=t.headers)
    assert r.status_code == 429, r.text
    assert "this job needs about 804" in r.json()["error"]["message"]


# ---- counting: the API's count is the worker's -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tests.tiny_models import make_tokenizer

    return make_tokenizer()


# whitespace control, trim_blocks/lstrip_blocks, a special-token variable, loop controls, transformers'
# {% generation %} tag and raise_exception: what real templates use
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' and not loop.first %}
        {{- raise_exception('the system message must come first') }}
    {%- endif %}
    {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] | trim }}{% endgeneration %}<|im_end|>
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
    {%- if loop.index > 50 %}{% break %}{% endif %}
{%- endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def templated_tokenizer():
    """The tiny tokenizer with a BOS post-processor (so special tokens count) and the template above."""
    from tokenizers import processors

    from tests.tiny_models import BOS_TOKEN, make_tokenizer

    tok = make_tokenizer()
    bos = tok.convert_tokens_to_ids(BOS_TOKEN)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos)])
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The default model's tokenizer: the converted copy if this machine has one, else read from its GGUF."""
    from transformers import AutoTokenizer

    from worker.loader import DEFAULT_MODEL, KNOWN_MODELS, _cache_dir, _gguf_source, _is_converted

    converted = _cache_dir(None) / DEFAULT_MODEL
    if _is_converted(converted):
        return AutoTokenizer.from_pretrained(converted)
    gguf = _gguf_source(KNOWN_MODELS[DEFAULT_MODEL])
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _published(redis_client, settings, tokenizer, name: str, context: int = 100_000) -> PromptCounter:
    """``tokenizer`` published as a worker publishes its engine's, and the API's counter over it."""
    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=context)
    WorkerRegistration(redis_client, settings.stream_prefix, name, "w-count", describe_engine(engine), 5.0).publish()
    return PromptCounter(ModelCatalog(redis_client, settings.stream_prefix))


PROMPTS = [PROMPT, " leading space", "tabs\tand\nnewlines\n\n", "unicode: caf\u00e9 \u6f22\u5b57 \U0001f600",
           "<|im_start|>special<|im_end|> tokens in text", "x" * 5000 + " long enough for encode_batch " * 200]
CHATS = [CHAT, [{"role": "user", "content": "Hi"}], [{"role": "user", "content": "a"},
         {"role": "assistant", "content": "b"}, {"role": "user", "content": "\u00e9\n c "}],
         [{"role": "user", "content": ""}]]


@pytest.mark.parametrize("which", ["tiny_tokenizer", "templated_tokenizer", "smollm2_tokenizer"])
def test_counts_agree_with_the_workers_own_tokenisation(request, which, redis_client, settings):
    from worker.engine import LLMEngine

    tokenizer = request.getfixturevalue(which)
    counter = _published(redis_client, settings, tokenizer, f"m-{which}")
    entry = counter.catalog.get(f"m-{which}")
    worker = SimpleNamespace(tokenizer=tokenizer)  # LLMEngine.encode needs only its tokenizer
    for prompt in PROMPTS:
        assert counter.count(entry, JobCreate(prompt=prompt)) == len(LLMEngine.encode(worker, prompt=prompt)), prompt
    for chat in CHATS:
        assert counter.count(entry, JobCreate(messages=chat)) == len(LLMEngine.encode(worker, messages=chat)), chat
    if which == "templated_tokenizer":  # messages the template refuses would fail on the worker: refused here
        with pytest.raises(TemplateError, match="the system message must come first"):
            counter.count(entry, JobCreate(messages=list(reversed(CHAT))))


def test_the_quota_charges_the_exact_prompt_count(client, make_tenant, redis_client, settings, tiny_tokenizer):
    _published(redis_client, settings, tiny_tokenizer, model_id(settings.model), context=512)
    exact = len(tiny_tokenizer.encode(PROMPT))
    assert exact != len(PROMPT) // 4 + 1  # the old estimate would say otherwise
    t = make_tenant(tokens_per_minute=200)
    assert client.post("/v1/jobs", json={"prompt_ids": [1, 2], "max_tokens": 1}, headers=t.headers).status_code == 202
    r = client.post("/v1/jobs", json={"prompt": PROMPT, "max_tokens": 190}, headers=t.headers)
    assert r.status_code == 429, r.text
    assert f"this job needs about {exact + 190} " in r.json()["error"]["message"]


# ---- a live worker: its context, its counts, its load progress -------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models"), arch="llama", max_position_embeddings=CONTEXT)


@pytest.fixture
def live(serve, model_settings, inferq_worker, make_tenant):  # noqa: F811
    """The API and a registered worker (``/readyz`` is 200 only once it has published its model)."""
    url = serve(model_settings)
    with httpx.Client(base_url=url, timeout=60) as c:
        wait_for(lambda: c.get("/readyz").status_code == 200 or not inferq_worker.alive(), 150,
                 what="the worker to register")
        assert inferq_worker.alive(), inferq_worker.log_text()[-3000:]
        tenant = make_tenant()
        c.headers.update(tenant.headers)
        yield c, tenant.tenant_id


def _prompt_tokens_in(message: str) -> int:
    """N of "the prompt has N tokens ..." (prompt_too_long) or "the prompt (N tokens) ..." (context_length_exceeded)."""
    return int(re.search(r"the prompt \(?(?:has )?(\d+) tokens", message).group(1))


def _finished(c: httpx.Client, job_id: str) -> dict:
    def done() -> dict | None:
        view = c.get(f"/v1/jobs/{job_id}").json()
        return view if view["status"] in ("succeeded", "failed", "cancelled", "expired") else None

    return wait_for(done, 120, what=f"job {job_id} to finish")


@pytest.mark.parametrize("prompt", [{"prompt": PROMPT}, {"messages": CHAT}])
def test_context_is_checked_with_the_count_the_worker_bills(live, prompt):
    live, _ = live
    r = live.post("/v1/jobs", json={**prompt, "max_tokens": CONTEXT, "temperature": 0})
    assert r.status_code == 422 and r.json()["error"]["type"] == "context_length_exceeded", r.text
    assert r.json()["error"]["fields"][0]["field"] == "max_tokens"
    n = _prompt_tokens_in(r.json()["error"]["message"])
    assert f"max_tokens may be at most {CONTEXT - n}" in r.json()["error"]["message"]
    r = live.post("/v1/jobs", json={**prompt, "max_tokens": CONTEXT - n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 202, r.text
    view = _finished(live, r.json()["id"])
    assert view["status"] == "succeeded", view
    assert view["usage"]["prompt_tokens"] == n and view["usage"]["completion_tokens"] == CONTEXT - n


def test_too_long_prompts_are_refused_and_an_omitted_max_tokens_fits(live, db, inferq_worker):  # noqa: F811
    live, tenant_id = live
    r = live.post("/v1/jobs", json={"prompt": "word " * 2000, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 422 and err["type"] == "prompt_too_long" and err["fields"][0]["field"] == "prompt", r.text
    assert f"the model's context is {CONTEXT} tokens" in err["message"] and f"at most {CONTEXT - 1}" in err["message"]
    r = live.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10 * CONTEXT})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = live.post("/v1/jobs", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True})  # default 256 > context
    assert r.status_code == 202, r.text
    view = _finished(live, r.json()["id"])
    assert view["status"] == "succeeded" and view["finish_reason"] == "length", view
    assert view["usage"]["prompt_tokens"] + view["usage"]["completion_tokens"] == CONTEXT
    assert _jobs_of(db, tenant_id) == 1  # only that one was stored, with max_tokens lowered to fit
    with db() as s:
        assert s.get(Job, view["id"]).request["max_tokens"] == CONTEXT - view["usage"]["prompt_tokens"]
    log = inferq_worker.log_text()
    for step in ("loading model", "loading weights", "weights loaded", "sizing the KV pool", "model loaded"):
        assert f'"event": "{step}"' in log, (step, log[-3000:])
