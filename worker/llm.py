"""Offline generation: ``LLM(model=...).generate(lines)`` runs a list of JSONL-schema requests to the end.

Every line is validated on its own; a bad line becomes ``{"id": ..., "error": "..."}`` in its place and
never stops the others. Outputs come back in input order. A field a line leaves out takes the same default
as a REST job (``inferq.contract.DEFAULT_*``, e.g. ``max_tokens`` 256).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from inferq.contract import (
    DEFAULT_IGNORE_EOS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
)
from inferq.log import get_logger
from scheduler.request import Request, SamplingParams, Tier

log = get_logger(__name__)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str


class GenerateRequest(BaseModel):
    """One input line. Exactly one of ``prompt``, ``messages``, ``prompt_ids``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | int | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_ids: list[int] | None = None
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0)
    top_p: float = Field(DEFAULT_TOP_P, gt=0.0, le=1.0)
    top_k: int = Field(DEFAULT_TOP_K, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = DEFAULT_IGNORE_EOS
    tier: Literal["interactive", "batch"] = "batch"
    priority: int = 0

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("prompt is empty")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        given = [k for k in ("prompt", "messages", "prompt_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, prompt_ids (got {given or 'none'})")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids is empty")
        return self

    def sampling(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)


def describe_validation(exc: ValidationError) -> str:
    """One line: ``field: message; ...``."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


class LLM:
    """An engine plus the input schema. ``options`` are Settings fields (or ``runner=``/``tokenizer=``)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        from worker.engine import LLMEngine

        if model is not None:
            options["model"] = model
        settings = options.pop("settings", None)
        self.engine = LLMEngine(settings, **options)

    def generate(self, requests: list[dict[str, Any]],
                 on_result: Callable[[int, dict[str, Any]], None] | None = None,
                 on_tokens: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
        """Run all ``requests`` (dicts in the JSONL input schema); one output dict per input, in order.
        ``on_result(i, row)`` is called as each line finishes (refused lines at once), so a caller can save
        results before the whole batch is done; ``on_tokens(n)`` after each step with the tokens it made."""
        results: list[dict[str, Any] | None] = [None] * len(requests)

        def finish(i: int, row: dict[str, Any]) -> None:
            results[i] = row
            if on_result:
                on_result(i, row)

        for i, raw in enumerate(requests):
            error = self._add(i, raw)
            if error is not None:
                finish(i, {"id": raw.get("id") if isinstance(raw, dict) else None, "error": error})
        engine = self.engine
        while engine.has_unfinished():
            outputs = engine.step()
            if on_tokens:
                on_tokens(sum(len(o.new_token_ids or ()) for o in outputs))
            for o in outputs:
                if o.finished:
                    finish(int(o.request_id), _row(requests[int(o.request_id)].get("id"), o))
        return results  # type: ignore[return-value]

    def _add(self, i: int, raw: Any) -> str | None:
        """Validate line ``i`` and add it to the engine; the reason it cannot run, or None."""
        engine = self.engine
        try:
            if not isinstance(raw, dict):
                raise ValueError("a request must be a JSON object")
            line = GenerateRequest.model_validate(raw)
            ids = engine.encode(prompt=line.prompt, prompt_ids=line.prompt_ids,
                                messages=[m.model_dump() for m in line.messages] if line.messages else None)
            engine.add_request(Request(str(i), ids, line.sampling(), tier=Tier(line.tier), priority=line.priority))
        except ValidationError as exc:
            return describe_validation(exc)
        except ValueError as exc:
            return str(exc)
        return None


def _row(rid: Any, o: Any) -> dict[str, Any]:
    """The output line of a finished request."""
    if o.error:
        return {"id": rid, "error": o.error}
    return {"id": rid, "text": o.text, "token_ids": o.token_ids,
            "finish_reason": o.finish_reason.value if o.finish_reason else None,
            "usage": o.usage.to_dict() if o.usage else None}
