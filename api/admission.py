"""What a submission must satisfy about its model before anything is written (docs/API.md, "Models and
context length"): the name is a model name, the model is served (404 ``model_not_found`` listing the known
ones), the prompt fits the model's context (422 ``prompt_too_long``) and so do prompt + ``max_tokens`` (422
``context_length_exceeded``, as vLLM answers 400); an omitted ``max_tokens`` is lowered to what the context
leaves (as vLLM does). The exact prompt count then charges the tokens-per-minute quota. While no worker has
published the model's tokenizer, the count is left to the quota's estimate and only ``prompt_ids`` are
checked (against a published context)."""

from __future__ import annotations

from dataclasses import dataclass

from api.errors import ApiError, invalid
from api.tokens import PromptCounter, TemplateError
from inferq.contract import JobCreate, model_id
from inferq.models_registry import ModelCatalog, name_problem

MAX_LISTED_MODELS = 20  # a 404 names at most this many known models


@dataclass(frozen=True)
class Admitted:
    """The body to submit (``max_tokens`` possibly lowered) and its exact prompt token count (None: unknown)."""

    body: JobCreate
    prompt_tokens: int | None


class ModelAdmission:
    """One per API process: the registry view and the prompt counter (both cached)."""

    def __init__(self, catalog: ModelCatalog, default_model: str) -> None:
        self.catalog = catalog
        self.counter = PromptCounter(catalog)
        self.default_model = default_model

    def admit(self, body: JobCreate) -> Admitted:
        """Check ``body`` against its model; raises ``ApiError`` (404/422) with the reason. Reads Redis."""
        if body.model is not None and (problem := name_problem(body.model)) is not None:
            raise invalid("model", problem)
        name = model_id(body.model or self.default_model)
        entry = self.catalog.get(name)
        if entry is None:
            raise self._not_found(name)
        try:
            prompt_tokens = self.counter.count(entry, body)
        except TemplateError as exc:
            raise invalid("messages", str(exc)) from None
        if prompt_tokens is None or entry.max_model_len is None:
            return Admitted(body, prompt_tokens)
        return Admitted(_fit(body, prompt_tokens, entry.max_model_len), prompt_tokens)

    def _not_found(self, name: str) -> ApiError:
        known = self.catalog.names()
        listed = ", ".join(known[:MAX_LISTED_MODELS]) + (", ..." if len(known) > MAX_LISTED_MODELS else "")
        reason = f"model {name!r} is not served here; " + (f"models: {listed}" if known else "no model is served yet")
        return ApiError(404, "model_not_found", reason, fields=[{"field": "model", "reason": reason}])


def _prompt_field(body: JobCreate) -> str:
    return "prompt" if body.prompt is not None else "messages" if body.messages is not None else "prompt_ids"


def _fit(body: JobCreate, prompt_tokens: int, context: int) -> JobCreate:
    """``body`` if prompt + max_tokens fit ``context``; an omitted max_tokens lowered to fit; else 422."""
    left = context - prompt_tokens
    if left < 1:
        reason = (f"the prompt has {prompt_tokens} tokens but the model's context is {context} tokens, which "
                  f"leaves no room for output: at most {context - 1} prompt tokens")
        raise ApiError(422, "prompt_too_long", reason, fields=[{"field": _prompt_field(body), "reason": reason}])
    if body.max_tokens <= left:
        return body
    if "max_tokens" not in body.model_fields_set:
        return body.model_copy(update={"max_tokens": left})
    reason = (f"the prompt ({prompt_tokens} tokens) plus max_tokens ({body.max_tokens}) exceed the model's "
              f"context of {context} tokens: max_tokens may be at most {left}")
    raise ApiError(422, "context_length_exceeded", reason, fields=[{"field": "max_tokens", "reason": reason}])
