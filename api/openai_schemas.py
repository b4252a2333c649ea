"""OpenAI-compatible request bodies and the objects sent back, mapped onto inferq's own job (``JobCreate``).

Why a mapping and not a second path: every chat or completion request becomes a job row like any other,
so quotas, tiers, the ledger, cost reports and tenant isolation apply unchanged. Unknown fields are ignored
(as OpenAI does); known fields inferq cannot honour (n > 1, logprobs, a JSON response format, penalties)
are a clear 400 naming the field rather than a silently different answer. Known fields are strict, as
OpenAI's are and as ``JobCreate`` is: ``"8"`` is not the integer 8, ``"yes"`` not ``true``.

``request_body`` publishes what these checks accept as the routes' OpenAPI request body (the routes read the
JSON themselves, to answer in OpenAI's shape), so generated clients and schemathesis know it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.validation import NO_NUL_PATTERN
from inferq.contract import INT64_MAX, Integer, JobCreate
from inferq.models_registry import MAX_NAME_LENGTH, NAME_PATTERN

DEFAULT_COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat has no fixed default)


class OpenAIError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[_Part] | None = None


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str = "text"


class _Common(BaseModel):
    """Fields shared by both endpoints; ``extra="ignore"``: unknown fields are dropped, as OpenAI does."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: Integer | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: Integer | None = Field(None, ge=0, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: Integer | None = Field(None, ge=1)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    user: str | None = None
    logprobs: bool | Integer | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    service_tier: str | None = None  # "flex" (OpenAI's cheaper, slower processing) runs in the batch tier
    # inferq extensions, as vLLM's OpenAI server accepts them (the client sends them with ``extra_body``)
    top_k: Integer | None = Field(None, ge=0)
    ignore_eos: bool | None = None

    def _check_supported(self) -> None:
        if self.n not in (None, 1):
            raise OpenAIError(400, "n > 1 is not supported: send one request per completion", param="n")
        if self.logprobs not in (None, False, 0):
            raise OpenAIError(400, "logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise OpenAIError(400, f"{name} is not supported (only 0)", param=name)

    def _job_fields(self, max_tokens: int | None) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields: dict[str, Any] = {"stop": stop, "tier": "batch" if self.service_tier == "flex" else "interactive"}
        if self.model is not None:
            fields["model"] = self.model
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "seed", "top_k", "ignore_eos"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.user:
            fields["metadata"] = {"user": self.user}
        return fields

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    top_logprobs: Integer | None = None
    response_format: _ResponseFormat | None = None

    def to_job(self, tier: str | None = None) -> JobCreate:
        self._check_supported()
        if self.top_logprobs:
            raise OpenAIError(400, "logprobs are not supported", param="top_logprobs")
        if self.response_format is not None and self.response_format.type != "text":
            raise OpenAIError(400, f"response_format {self.response_format.type!r} is not supported (only 'text')",
                              param="response_format")
        fields = self._job_fields(self.max_completion_tokens or self.max_tokens)
        fields["messages"] = [_chat_message(m, i) for i, m in enumerate(self.messages)]
        return _job(fields, tier)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Integer]
    echo: bool = False
    suffix: str | None = None
    best_of: Integer | None = None

    def to_job(self, tier: str | None = None) -> JobCreate:
        self._check_supported()
        for name, ok in (("echo", not self.echo), ("suffix", not self.suffix), ("best_of", self.best_of in (None, 1))):
            if not ok:
                raise OpenAIError(400, f"{name} is not supported", param=name)
        fields = self._job_fields(self.max_tokens or DEFAULT_COMPLETIONS_MAX_TOKENS)
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            fields["prompt_ids"] = prompt
        elif isinstance(prompt, list):
            if len(prompt) != 1:
                raise OpenAIError(400, "a list of prompts is not supported: send one prompt per request", param="prompt")
            fields["prompt"] = prompt[0]
        else:
            fields["prompt"] = prompt
        return _job(fields, tier)


def _chat_message(m: _Message, i: int) -> dict[str, str]:
    role = {"developer": "system"}.get(m.role, m.role)  # OpenAI's newer name for the system role
    if role not in ("system", "user", "assistant"):
        raise OpenAIError(400, f"messages[{i}].role {m.role!r} is not supported (system, developer, user, "
                          "assistant)", param=f"messages[{i}].role")
    if isinstance(m.content, list):
        if any(p.type != "text" for p in m.content):
            raise OpenAIError(400, "only text content parts are supported", param=f"messages[{i}].content")
        text = "".join(p.text or "" for p in m.content)
    else:
        text = m.content or ""
    return {"role": role, "content": text}


def _job(fields: dict[str, Any], tier: str | None) -> JobCreate:
    if tier is not None:
        fields["tier"] = tier
    try:
        return JobCreate(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise OpenAIError(400, f"{param}: {err.get('msg', 'invalid')}" if param else str(err.get("msg")),
                          param=param) from None


# --- the request bodies in the OpenAPI document --------------------------------------------------------------
# pydantic's schema says the types; what the converters above (and JobCreate behind them) also refuse is said
# here, field by field, so that a body valid by the document is one these routes accept


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _text(min_length: int = 0, max_length: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "pattern": NO_NUL_PATTERN}  # PostgreSQL stores no NUL
    if min_length:
        schema["minLength"] = min_length
    if max_length is not None:
        schema["maxLength"] = max_length
    return schema


_MAX_TOKENS = _nullable({"type": "integer", "minimum": 1, "maximum": 1_000_000})
_STOP = _text(min_length=1)
_COMMON_FIELDS: dict[str, dict[str, Any]] = {
    "model": _nullable({"type": "string", "pattern": NAME_PATTERN, "maxLength": MAX_NAME_LENGTH}),
    "max_tokens": _MAX_TOKENS,
    "seed": _nullable({"type": "integer", "minimum": 0, "maximum": INT64_MAX}),
    "top_k": _nullable({"type": "integer", "minimum": 0, "maximum": INT64_MAX}),
    "stop": {"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": 16}, {"type": "null"}]},
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": 1}),
    "logprobs": _nullable({"enum": [False, 0]}),
    "presence_penalty": _nullable({"type": "number", "minimum": 0, "maximum": 0}),
    "frequency_penalty": _nullable({"type": "number", "minimum": 0, "maximum": 0}),
    "user": _nullable(_text()),
}
_PART = {"type": "object", "required": ["type"],
         "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _nullable(_text())}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
    "content": {"anyOf": [_text(), {"type": "array", "items": _PART}, {"type": "null"}]}}}
_PROMPT_TEXT = _text(min_length=1, max_length=1_000_000)
_FIELDS: dict[str, dict[str, dict[str, Any]]] = {
    "ChatCompletionRequest": {
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": _MAX_TOKENS,
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 0}),
        "response_format": _nullable({"type": "object", "properties": {"type": {"type": "string",
                                                                                "enum": ["text"]}}}),
    },
    "CompletionRequest": {
        "prompt": {"anyOf": [
            _PROMPT_TEXT, {"type": "array", "items": _PROMPT_TEXT, "minItems": 1, "maxItems": 1},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}}]},
        "echo": {"type": "boolean", "enum": [False]},
        "suffix": _nullable({"type": "string", "maxLength": 0}),
        "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": 1}),
    },
}


def request_body(kind: type[_Common]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a route that parses ``kind`` itself: pydantic's schema of it, with each
    field narrowed to what the route accepts (``_COMMON_FIELDS``, ``_FIELDS``)."""
    schema = kind.model_json_schema()
    defs = schema.pop("$defs", {})
    props = schema["properties"]
    for name, narrowed in {**_COMMON_FIELDS, **_FIELDS[kind.__name__]}.items():
        props[name] = {**narrowed, **{k: v for k, v in props[name].items() if k in ("title", "default")}}
    schema = _inline(schema, defs)
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with pydantic's ``#/$defs/...`` references replaced by their schemas (the document has no
    ``$defs`` of its own)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def parse(model: type[_Common], body: Any) -> _Common:
    """The request body as ``model``, or an OpenAI-shaped 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        raise OpenAIError(400, f"{param}: {msg}" if param else msg, param=param) from None


FinishReason = Literal["stop", "length"]


def finish_reason(inferq_reason: str | None) -> str:
    """OpenAI knows stop, length, content_filter, tool_calls; inferq's abort/deadline/error are not answers."""
    return "length" if inferq_reason == "length" else "stop"


def usage(view: dict[str, Any]) -> dict[str, Any]:
    u = view.get("usage") or {}
    prompt, completion = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_prompt_tokens", 0))}}


def chat_completion(view: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"chatcmpl-{view['id']}", "object": "chat.completion", "created": _created(view),
            "model": view["model"], "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": view.get("text") or ""},
                         "logprobs": None, "finish_reason": finish_reason(view.get("finish_reason"))}],
            "usage": usage(view)}


def text_completion(view: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"cmpl-{view['id']}", "object": "text_completion", "created": _created(view),
            "model": view["model"], "system_fingerprint": None,
            "choices": [{"index": 0, "text": view.get("text") or "", "logprobs": None,
                         "finish_reason": finish_reason(view.get("finish_reason"))}],
            "usage": usage(view)}


def chat_chunk(job_id: str, model: str, created: int, *, delta: dict[str, Any] | None = None,
               finish: str | None = None, usage_: dict[str, Any] | None = None, choices: bool = True) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": f"chatcmpl-{job_id}", "object": "chat.completion.chunk", "created": created,
                             "model": model, "system_fingerprint": None,
                             "choices": [{"index": 0, "delta": delta or {}, "logprobs": None,
                                          "finish_reason": finish}] if choices else []}
    if usage_ is not None or not choices:
        chunk["usage"] = usage_
    return chunk


def text_chunk(job_id: str, model: str, created: int, *, text: str = "", finish: str | None = None,
               usage_: dict[str, Any] | None = None, choices: bool = True) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": f"cmpl-{job_id}", "object": "text_completion", "created": created, "model": model,
                             "system_fingerprint": None,
                             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
                             if choices else []}
    if usage_ is not None or not choices:
        chunk["usage"] = usage_
    return chunk


def _created(view: dict[str, Any]) -> int:
    import datetime as dt

    ts = (view.get("timings") or {}).get("created_at")
    return int(dt.datetime.fromisoformat(ts).timestamp()) if ts else int(time.time())
