"""The job contract shared by the API, the Celery tasks and the worker: the submission body (one
pydantic model, so REST, Celery and batch files validate identically), the typed msgpack stream message
(``JobMessage``, with its schema version) and the Redis key names.

Request defaults (``max_tokens`` and the sampling knobs) are written once, as the field defaults of
``scheduler.request.SamplingParams`` (the scheduler may not import this module); ``JobCreate``, the offline
input schema (``worker/llm.py``) and ``JobMessage.to_sampling_params`` all take them from there through the
``DEFAULT_*`` names below. No torch here (``scheduler.request`` is pure Python).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgpack
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler.request import SamplingParams

SCHEMA_VERSION = 1
TIERS = ("interactive", "batch")

# The public request defaults (docs/API.md), read from the one place they are written.
_SAMPLING_DEFAULTS = SamplingParams()
DEFAULT_MAX_TOKENS = _SAMPLING_DEFAULTS.max_tokens
DEFAULT_TEMPERATURE = _SAMPLING_DEFAULTS.temperature
DEFAULT_TOP_P = _SAMPLING_DEFAULTS.top_p
DEFAULT_TOP_K = _SAMPLING_DEFAULTS.top_k
DEFAULT_IGNORE_EOS = _SAMPLING_DEFAULTS.ignore_eos

NUL_REASON = "must not contain NUL (\\u0000) characters"


def _no_nul(value: str) -> str:
    """Text is stored in PostgreSQL, which cannot hold NUL characters: refuse them at validation time."""
    if "\x00" in value:
        raise ValueError(NUL_REASON)
    return value


def _nul_path(value: Any, path: str) -> str | None:
    """The path of the first string (or mapping key) containing NUL inside free-form JSON, else None."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for k, v in value.items():
            key = str(k)
            if "\x00" in key:
                return f"{path}[{key!r}] (the key)"
            found = _nul_path(v, f"{path}[{key!r}]")
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _nul_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


NoNulStr = Annotated[str, AfterValidator(_no_nul)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"] = Field(description="Who speaks.")
    content: NoNulStr = Field(description="What they say.")


class JobCreate(BaseModel):
    """A generation job. Give exactly one of ``prompt``, ``messages`` (chat, rendered with the model's
    chat template) or ``prompt_ids`` (token ids)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32,
                 "temperature": 0, "tier": "interactive"},
                {"prompt": "Once upon a time", "max_tokens": 64, "tier": "batch", "seed": 7},
            ]
        },
    )

    model: NoNulStr | None = Field(None, description="Model name; the service's default model when omitted.", examples=["smollm2-135m-instruct"])
    prompt: Annotated[str, Field(min_length=1, max_length=1_000_000), AfterValidator(_no_nul)] | None = Field(
        None, description="Plain-text prompt.")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="Chat messages.")
    prompt_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1, description="Prompt token ids.")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, le=1_000_000, description="Most tokens to generate.")
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=100.0, description="0 is greedy.")
    top_p: float = Field(DEFAULT_TOP_P, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(DEFAULT_TOP_K, ge=0, description="Keep the k most likely tokens; 0 disables.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Per-job seed: the same seed gives the same output.")
    stop: list[Annotated[str, Field(min_length=1), AfterValidator(_no_nul)]] = Field(default_factory=list, max_length=16, description="Stop strings (not included in the output).")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64, description="Stop token ids.")
    ignore_eos: bool = Field(DEFAULT_IGNORE_EOS, description="Keep generating past end-of-sequence.")
    tier: Literal["interactive", "batch"] = Field("interactive", description="interactive: latency tier; batch: cheaper throughput tier.")
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first within a tier.")
    webhook_url: Annotated[str, Field(max_length=2000), AfterValidator(_no_nul)] | None = Field(None, description="POSTed the finished job (signed) when it ends.")
    deadline_seconds: float | None = Field(None, gt=0, le=7 * 86400, description="Expire the job if not finished this many seconds after acceptance.")
    metadata: dict[str, Any] | None = Field(None, description="Free-form JSON kept with the job.")

    @field_validator("metadata")
    @classmethod
    def _metadata_without_nul(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            where = _nul_path(value, "metadata")
            if where is not None:
                raise ValueError(f"{NUL_REASON} (at {where})")
        return value

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> JobCreate:
        given = [n for n in ("prompt", "messages", "prompt_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_ids" + (f" (got {', '.join(given)})" if given else ""))
        return self

    def request_params(self) -> dict[str, Any]:
        """What the worker needs to run it (stored in jobs.request and carried in the message)."""
        return self.model_dump(
            mode="json",
            include={"prompt", "messages", "prompt_ids", "max_tokens", "temperature", "top_p", "top_k",
                     "seed", "stop", "stop_token_ids", "ignore_eos"},
            exclude_none=True,
        )

    def fingerprint(self) -> str:
        """Hash of the body, to tell an idempotent retry (same body) from a conflict (another body)."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


class MessageError(ValueError):
    """A stream message that cannot be decoded (malformed, or an unknown schema version)."""


PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
_REQUIRED = {"job_id": str, "tenant_id": str, "ns": str, "model": str, "tier": str, "priority": int, "request": dict}
_TIMES = ("deadline", "enqueued_at")  # optional Unix seconds
# request field -> conversion into SamplingParams (a field that is missing or None keeps the default)
_SAMPLING_FIELDS: dict[str, Any] = {
    "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": lambda v: v,
    "stop": list, "stop_token_ids": list, "ignore_eos": bool,
}


@dataclass(frozen=True)
class JobMessage:
    """What the API puts on a job stream and the worker reads: one msgpack map, schema ``v: 1``.

    On the wire: ``v``, ``job_id``, ``tenant_id``, ``ns`` (the tenant's prefix-cache namespace:
    ``cache_namespace`` here), ``model``, ``tier``, ``priority``, ``request`` (``JobCreate.request_params()``:
    the prompt and the sampling parameters, as stored in ``jobs.request``), ``deadline`` and ``enqueued_at``
    (Unix seconds, or None)."""

    job_id: str
    tenant_id: str
    cache_namespace: str
    model: str
    tier: str
    priority: int
    request: dict[str, Any]
    deadline: float | None = None
    enqueued_at: float | None = None

    def to_wire(self) -> dict[str, Any]:
        """The map that goes on the stream (the schema version included)."""
        return {"v": SCHEMA_VERSION, "job_id": self.job_id, "tenant_id": self.tenant_id, "ns": self.cache_namespace,
                "model": self.model, "tier": self.tier, "priority": self.priority, "request": self.request,
                "deadline": self.deadline, "enqueued_at": self.enqueued_at}

    def encode(self) -> bytes:
        return msgpack.packb(self.to_wire())

    @classmethod
    def decode(cls, data: bytes) -> JobMessage:
        """Parse and validate a stream message; ``MessageError`` when it is malformed or of another schema."""
        m = _checked_map(data)
        return cls(job_id=m["job_id"], tenant_id=m["tenant_id"], cache_namespace=m["ns"], model=m["model"],
                   tier=m["tier"], priority=m["priority"], request=m["request"], deadline=m.get("deadline"),
                   enqueued_at=m.get("enqueued_at"))

    def prompt_input(self) -> dict[str, Any]:
        """The prompt as ``LLMEngine.encode`` keywords (``prompt``, ``messages`` or ``prompt_ids``)."""
        return {k: self.request[k] for k in PROMPT_FIELDS if self.request.get(k) is not None}

    def to_sampling_params(self) -> SamplingParams:
        """The engine's sampling parameters; a field the request leaves out takes the shared default.
        Raises ValueError/TypeError for values the engine cannot use (the worker then fails the job)."""
        p = self.request
        return SamplingParams(**{k: conv(p[k]) for k, conv in _SAMPLING_FIELDS.items() if p.get(k) is not None})


def _checked_map(data: bytes) -> dict[str, Any]:
    """The validated wire map of a message (extra keys are kept: newer writers may add fields)."""
    try:
        msg = msgpack.unpackb(data)
    except Exception as exc:
        raise MessageError(f"not msgpack: {exc}") from exc
    if not isinstance(msg, dict):
        raise MessageError("message is not a map")
    if msg.get("v") != SCHEMA_VERSION:
        raise MessageError(f"unknown schema version {msg.get('v')!r} (this worker reads {SCHEMA_VERSION})")
    for key, typ in _REQUIRED.items():
        if not isinstance(msg.get(key), typ):
            raise MessageError(f"field {key!r} missing or not {typ.__name__}")
    if msg["tier"] not in TIERS:
        raise MessageError(f"unknown tier {msg['tier']!r}")
    for key in _TIMES:
        value = msg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise MessageError(f"field {key!r} is not a number of Unix seconds")
    return msg


def encode_message(job_id: str, tenant_id: str, cache_namespace: str, model: str, tier: str, priority: int,
                   request: dict[str, Any], deadline: float | None, enqueued_at: float) -> bytes:
    """The stream message (``JobMessage(...).encode()``). ``deadline`` and ``enqueued_at`` are Unix times."""
    return JobMessage(job_id, tenant_id, cache_namespace, model, tier, priority, request, deadline,
                      enqueued_at).encode()


def decode_message(data: bytes) -> dict[str, Any]:
    """The validated wire map of a message (``JobMessage.decode`` gives it typed); raises ``MessageError``."""
    return _checked_map(data)


def model_id(name_or_path: str) -> str:
    """The name a model is queued under: the name itself, or a local directory's base name."""
    return Path(name_or_path).name if ("/" in name_or_path or name_or_path.startswith(".")) else name_or_path


def stream_key(prefix: str, model: str, tier: str) -> str:
    return f"{prefix}:jobs:{model}:{tier}"


def events_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:events:{job_id}"


def dead_letter_key(prefix: str) -> str:
    return f"{prefix}:deadletter"


def cancel_channel(prefix: str) -> str:
    return f"{prefix}:cancel"
