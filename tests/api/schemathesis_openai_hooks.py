"""schemathesis hooks for the run over the OpenAI-compatible routes in tests/api/test_contract_openai.py
(loaded through ``SCHEMATHESIS_HOOKS``; the test passes the served model in the environment).

Each adjustment replaces a value the OpenAPI document allows by one that the running service can honour,
for a reason no schema can state; a value that breaks the document is sent as generated, so the API must
still refuse it:

- a valid ``model`` name becomes the model the test's worker serves (any other name is a documented 404,
  and nothing would be generated);
- ``max_tokens`` / ``max_completion_tokens`` are capped, and set when left out (a chat request's default is
  what the context leaves): how many tokens fit depends on the prompt and the model's context, and the run
  must stay short;
- prompt token ids are taken modulo the model's vocabulary (which ids exist depends on the model).
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

from inferq.contract import INT64_MAX
from inferq.models_registry import name_problem

MODEL = os.environ.get("INFERQ_CONTRACT_MODEL", "")
VOCAB = int(os.environ.get("INFERQ_CONTRACT_VOCAB", "384"))
MAX_TOKENS = int(os.environ.get("INFERQ_CONTRACT_MAX_TOKENS", "4"))
_LIMITS = ("max_tokens", "max_completion_tokens")


def _is_count(value: Any) -> bool:
    """An integer as the document counts it (``8.0`` too), not a boolean."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if MODEL and isinstance(body.get("model"), str) and name_problem(body["model"]) is None:
        body["model"] = MODEL
    for name in _LIMITS:
        if _is_count(body.get(name)) and body[name] > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if all(body.get(name) is None for name in _LIMITS):
        body["max_tokens"] = MAX_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(_is_count(t) and 0 <= t <= INT64_MAX for t in prompt):
        body["prompt"] = [int(t) % VOCAB for t in prompt]
