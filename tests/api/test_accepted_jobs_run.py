"""Issue 18's property, over the live stack (uvicorn, PostgreSQL, Redis and a worker subprocess on a tiny
random model): every JSON body ``POST /v1/jobs`` answers 2xx to is run by the worker to a terminal state, and
every body it refuses gets a 4xx with a reason, never a 5xx.

Hypothesis draws bodies whose fields are each either a plausible value or junk of any JSON type (huge
integers, lone surrogates, nested objects, wrong types, empty lists), the inputs that once were committed
and then stuck or broke a page. Deterministic (``derandomize``), so a failure replays."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from inferq.contract import model_id
from inferq.db import TERMINAL_STATUSES, Job
from tests.api.test_e2e import inferq_worker, model_settings, tiny_model  # noqa: F401 - fixtures
from tests.service_fixtures import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EXAMPLES = 300

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
ODD_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)  # lone surrogates, "", NUL
SMALL_IDS = st.lists(st.integers(0, 200), min_size=1, max_size=6)
ODD_IDS = st.lists(st.integers(-3, 3) | st.integers(2**63 - 2, 2**64 + 1), max_size=3)


def _bodies(model: str) -> st.SearchStrategy:
    """Half the bodies wholly valid, half with exactly one field replaced by an edge value of its type or by
    junk of any type, so that each odd value is tried alone (several at once mostly hide each other)."""
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT})
    odd_message = st.fixed_dictionaries({"role": st.sampled_from(["tool", "", "user"]), "content": ODD_TEXT})
    fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {  # name: (valid, edge)
        "model": (st.just(model), st.sampled_from(["gpt-17", "", "a" * 300, "../x"])),
        "max_tokens": (st.integers(1, 24), st.sampled_from([-1, 0, 10**7, 2**64])),
        "temperature": (st.floats(0, 2), st.sampled_from([-0.5, 101.0])),
        "top_p": (st.floats(0.05, 1), st.sampled_from([0.0, 1.5])),
        "top_k": (st.integers(0, 50), st.sampled_from([-1, 2**63 - 1, 2**64])),
        "seed": (st.integers(0, 2**63 - 1), st.sampled_from([-1, 2**64])),
        "stop": (st.lists(TEXT, max_size=3), st.lists(ODD_TEXT, min_size=1, max_size=2)),
        "stop_token_ids": (st.lists(st.integers(0, 200), max_size=3), ODD_IDS),
        "ignore_eos": (st.booleans(), st.just("yes")),
        "tier": (st.sampled_from(["interactive", "batch"]), st.just("bulk")),
        "priority": (st.integers(-1000, 1000), st.sampled_from([-1001, 2000])),
        "deadline_seconds": (st.floats(0.5, 60), st.sampled_from([0.0, 0.001, 10**9])),
        "metadata": (st.dictionaries(TEXT, JUNK, max_size=3), st.dictionaries(ODD_TEXT, ODD_TEXT, max_size=2)),
        "webhook_url": (st.just("http://127.0.0.1:9/hook"), st.sampled_from(["http://10.0.0.1/x", "ftp://a"])),
        "prompt": (TEXT, ODD_TEXT),
        "messages": (st.lists(message, min_size=1, max_size=3), st.lists(odd_message, max_size=2)),
        "prompt_ids": (SMALL_IDS, ODD_IDS),
    }
    optional = [name for name in fields if name not in ("prompt", "messages", "prompt_ids")]

    @st.composite
    def body(draw: st.DrawFn) -> dict:
        names = [n for n in optional if draw(st.integers(0, 2)) == 0]
        names += draw(st.sampled_from([["prompt"], ["messages"], ["prompt_ids"], ["prompt"], ["messages"]]))
        out = {name: draw(fields[name][0]) for name in names}
        if draw(st.booleans()):
            odd = draw(st.sampled_from([*sorted(fields), "no prompt", "two prompts"]))
            if odd == "no prompt":
                for name in ("prompt", "messages", "prompt_ids"):
                    out.pop(name, None)
            elif odd == "two prompts":
                out.update(prompt=draw(TEXT), messages=draw(fields["messages"][0]))
            else:
                out[odd] = draw(JUNK if draw(st.booleans()) else fields[odd][1])
        return out

    return body()


def test_every_accepted_body_runs_to_an_end_and_every_refusal_says_why(serve, model_settings, inferq_worker,  # noqa: F811
                                                                        make_tenant, db):
    tenant = make_tenant(max_queued_jobs=10_000, tokens_per_minute=10**9)
    accepted: list[str] = []
    refusals: dict[int, int] = {}
    with httpx.Client(base_url=serve(model_settings), timeout=60, headers=tenant.headers) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200, 150, interval=0.5, what="a worker to serve")

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_bodies(model_id(model_settings.model)))
        @example({"prompt": "hi", "model": "gpt-17"})  # the reproductions of issue 18, each tried for sure
        @example({"prompt": "word " * 20_000, "max_tokens": 1})
        @example({"prompt": "hi", "max_tokens": 1_000_000})
        @example({"prompt": "hi", "metadata": {"k": "\ud800"}})
        @example({"messages": [{"role": "user", "content": "\ud800"}]})
        @example({"prompt": "hi", "model": "\ud800"})
        @example({"prompt_ids": [2**64]})
        @example({"prompt": "hi", "top_k": 2**64})
        @example({"prompt": "hi", "stop_token_ids": [2**64]})
        def submit(body: dict) -> None:
            raw = json.dumps(body, ensure_ascii=True)  # lone surrogates go out as \\ud800 escapes
            r = client.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json",
                                                              "Idempotency-Key": uuid.uuid4().hex})
            assert r.status_code < 500, (r.status_code, r.text, raw)
            if r.status_code in (200, 202):
                accepted.append(r.json()["id"])
                return
            assert 400 <= r.status_code < 500, (r.status_code, r.text, raw)
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"].strip(), (r.text, raw)
            refusals[r.status_code] = refusals.get(r.status_code, 0) + 1

        submit()

    assert len(accepted) >= EXAMPLES // 10 and refusals, (len(accepted), refusals)  # both sides were exercised

    def ended() -> bool:
        with db() as s:
            statuses = s.scalars(select(Job.status).where(Job.id.in_(accepted))).all()
        return len(statuses) == len(accepted) and all(x in TERMINAL_STATUSES for x in statuses)

    wait_for(ended, 300, interval=1.0, what="every accepted job to end")
