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
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgpack
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.json_schema import WithJsonSchema

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
SURROGATE_REASON = "must not contain lone surrogates (unpaired \\ud800-\\udfff escapes are not text)"
INT64_MAX = 2**63 - 1  # the stream message is msgpack (and the engine's ids are int64): nothing larger fits
_SURROGATE = re.compile("[\ud800-\udfff]")


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored (PostgreSQL holds no NUL; UTF-8, hence PostgreSQL and msgpack, holds no
    lone surrogate, which JSON's ``\\ud800`` escapes can still smuggle in), or None."""
    if "\x00" in value:
        return NUL_REASON
    if not value.isascii() and _SURROGATE.search(value):
        return SURROGATE_REASON
    return None


def _storable(value: Any) -> Any:
    """Checked before pydantic's own string checks, so the reason given is ours, not a decoding error."""
    if isinstance(value, str):
        reason = text_problem(value)
        if reason is not None:
            raise ValueError(reason)
    return value


def json_problem(value: Any, path: str) -> str | None:
    """The first thing inside free-form JSON that cannot be stored, as ``"<reason> (at <path>)"``, else None:
    text (values and keys) that ``text_problem`` refuses, and non-finite numbers (JSON has none; Python's
    parser turns ``1e400`` into infinity, which PostgreSQL refuses)."""
    if isinstance(value, str):
        reason = text_problem(value)
        return f"{reason} (at {path})" if reason else None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"must not contain non-finite numbers (at {path})"
    if isinstance(value, dict):
        for k, v in value.items():
            key = str(k)
            reason = text_problem(key)
            if reason is not None:
                return f"{reason} (at {path}[{key!r}], the key)"
            found = json_problem(v, f"{path}[{key!r}]")
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = json_problem(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _ipv6_pattern() -> str:
    """RFC 3986's ``IPv6address`` (what ``urllib.parse`` accepts between brackets)."""
    h16, dec = "[0-9A-Fa-f]{1,4}", "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    ls32 = f"({h16}:{h16}|{dec}(\\.{dec}){{3}})"

    def head(n: int) -> str:  # [ *n( h16 ":" ) h16 ]
        return f"(({h16}:){{0,{n}}}{h16})?" if n else f"({h16})?"

    forms = [f"({h16}:){{6}}{ls32}", f"::({h16}:){{5}}{ls32}"]
    forms += [f"{head(i)}::({h16}:){{{4 - i}}}{ls32}" for i in range(4)]
    forms += [f"{head(4)}::{ls32}", f"{head(5)}::{h16}", f"{head(6)}::"]
    return "(" + "|".join(forms) + ")"


# what a webhook URL must look like (http or https, a host, an optional port, printable ASCII): checked here
# and published as the field's pattern, so the OpenAPI document says exactly what is accepted; whether the
# host resolves to public addresses is the API's check (api/webhooks.py), at submission
WEBHOOK_URL_PATTERN = (r"^[Hh][Tt][Tt][Pp][Ss]?://([A-Za-z0-9._~!$&'()*+,;=%:-]*@)?"
                       rf"(\[{_ipv6_pattern()}\]|[A-Za-z0-9._~!$&'()*+,;=%-]+)"
                       r"(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4}))?"
                       r"([/?#][\x21-\x7e]*)?$")
_WEBHOOK_URL = re.compile(WEBHOOK_URL_PATTERN)


def _webhook_url(value: str) -> str:
    if not _WEBHOOK_URL.fullmatch(value):
        raise ValueError("must be an http or https URL naming a host (printable ASCII, port at most 65535)")
    return value


def _integral(value: Any) -> Any:
    """A number without a fraction is an integer, as JSON Schema (hence the OpenAPI document) counts: ``8.0`` is
    8, and a JavaScript client cannot even tell them apart. Anything else goes to the strict check as sent."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


StorableStr = Annotated[str, BeforeValidator(_storable)]
Integer = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[Integer, Field(ge=0, le=INT64_MAX)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"] = Field(description="Who speaks.")
    content: StorableStr = Field(description="What they say.")


class JobCreate(BaseModel):
    """A generation job. Give exactly one of ``prompt``, ``messages`` (chat, rendered with the model's
    chat template) or ``prompt_ids`` (token ids)."""

    # strict: a value is taken only as the type the schema names (``false`` is not the integer 0, ``"3"`` not 3;
    # ``3.0`` is 3, as JSON Schema counts)
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32,
                 "temperature": 0, "tier": "interactive"},
                {"prompt": "Once upon a time", "max_tokens": 64, "tier": "batch", "seed": 7},
            ]
        },
    )

    model: StorableStr | None = Field(None, description="Model name; the service's default model when omitted.", examples=["smollm2-135m-instruct"])
    prompt: Annotated[str, BeforeValidator(_storable), Field(min_length=1, max_length=1_000_000)] | None = Field(
        None, description="Plain-text prompt.")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="Chat messages.")
    prompt_ids: list[TokenId] | None = Field(None, min_length=1, description="Prompt token ids.")
    max_tokens: Integer = Field(DEFAULT_MAX_TOKENS, ge=1, le=1_000_000, description="Most tokens to generate.")
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=100.0, description="0 is greedy.")
    top_p: float = Field(DEFAULT_TOP_P, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: Integer = Field(DEFAULT_TOP_K, ge=0, le=INT64_MAX, description="Keep the k most likely tokens; 0 disables.")
    seed: Integer | None = Field(None, ge=0, le=INT64_MAX, description="Per-job seed: the same seed gives the same output.")
    stop: list[Annotated[str, BeforeValidator(_storable), Field(min_length=1)]] = Field(default_factory=list, max_length=16, description="Stop strings (not included in the output).")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64, description="Stop token ids.")
    ignore_eos: bool = Field(DEFAULT_IGNORE_EOS, description="Keep generating past end-of-sequence.")
    tier: Literal["interactive", "batch"] = Field("interactive", description="interactive: latency tier; batch: cheaper throughput tier.")
    priority: Integer = Field(0, ge=-1000, le=1000, description="Higher runs first among this tenant's jobs in a tier (tenants share a tier fairly: docs/ENGINE.md).")
    webhook_url: Annotated[str, BeforeValidator(_storable), Field(max_length=2000), AfterValidator(_webhook_url),
                           WithJsonSchema({"type": "string", "maxLength": 2000, "pattern": WEBHOOK_URL_PATTERN})] | None = Field(
        None, description="POSTed the finished job (signed) when it ends; its host must resolve to public addresses.")
    deadline_seconds: float | None = Field(None, gt=0, le=7 * 86400, description="Expire the job if not finished this many seconds after acceptance.")
    metadata: dict[str, Any] | None = Field(None, description="Free-form JSON kept with the job.")

    @field_validator("metadata")
    @classmethod
    def _metadata_storable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            problem = json_problem(value, "metadata")
            if problem is not None:
                raise ValueError(problem)
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
DEFAULT_WEIGHT = 1.0  # a tenant's fair-share weight unless its settings say otherwise (tenants.fair_share_weight)
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
    (Unix seconds, or None), and ``weight`` (the tenant's fair-share weight, ``tenants.fair_share_weight``):
    optional, left off the wire when it is the default 1.0, so older workers and older messages agree."""

    job_id: str
    tenant_id: str
    cache_namespace: str
    model: str
    tier: str
    priority: int
    request: dict[str, Any]
    deadline: float | None = None
    enqueued_at: float | None = None
    weight: float = DEFAULT_WEIGHT

    def to_wire(self) -> dict[str, Any]:
        """The map that goes on the stream (the schema version included)."""
        wire = {"v": SCHEMA_VERSION, "job_id": self.job_id, "tenant_id": self.tenant_id, "ns": self.cache_namespace,
                "model": self.model, "tier": self.tier, "priority": self.priority, "request": self.request,
                "deadline": self.deadline, "enqueued_at": self.enqueued_at}
        if self.weight != DEFAULT_WEIGHT:
            wire["weight"] = self.weight
        return wire

    def encode(self) -> bytes:
        return msgpack.packb(self.to_wire())

    @classmethod
    def decode(cls, data: bytes) -> JobMessage:
        """Parse and validate a stream message; ``MessageError`` when it is malformed or of another schema."""
        m = _checked_map(data)
        return cls(job_id=m["job_id"], tenant_id=m["tenant_id"], cache_namespace=m["ns"], model=m["model"],
                   tier=m["tier"], priority=m["priority"], request=m["request"], deadline=m.get("deadline"),
                   enqueued_at=m.get("enqueued_at"), weight=float(m.get("weight", DEFAULT_WEIGHT)))

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
    weight = msg.get("weight", DEFAULT_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise MessageError("field 'weight' is not a positive number")
    return msg


def encode_message(job_id: str, tenant_id: str, cache_namespace: str, model: str, tier: str, priority: int,
                   request: dict[str, Any], deadline: float | None, enqueued_at: float,
                   weight: float = DEFAULT_WEIGHT) -> bytes:
    """The stream message (``JobMessage(...).encode()``). ``deadline`` and ``enqueued_at`` are Unix times."""
    return JobMessage(job_id, tenant_id, cache_namespace, model, tier, priority, request, deadline,
                      enqueued_at, weight).encode()


def decode_message(data: bytes) -> dict[str, Any]:
    """The validated wire map of a message (``JobMessage.decode`` gives it typed); raises ``MessageError``."""
    return _checked_map(data)


def model_id(name_or_path: str) -> str:
    """The name a model is queued under: the name itself, or a local directory's base name."""
    return Path(name_or_path).name if ("/" in name_or_path or name_or_path.startswith(".")) else name_or_path


def stream_key(prefix: str, model: str, tier: str, tenant: str | None = None) -> str:
    """A tier's job stream; with ``tenant``, that tenant's lane of it (fair share: one stream per tenant,
    read round-robin, so one tenant's backlog does not queue the others behind it)."""
    base = f"{prefix}:jobs:{model}:{tier}"
    return base if tenant is None else f"{base}:tenant:{tenant}"


def lanes_key(prefix: str, model: str, tier: str) -> str:
    """Redis set of the tenant lanes (stream keys) of a model's tier that have ever had a job."""
    return f"{prefix}:lanes:{model}:{tier}"


def events_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:events:{job_id}"


def dead_letter_key(prefix: str) -> str:
    return f"{prefix}:deadletter"


def cancel_channel(prefix: str) -> str:
    return f"{prefix}:cancel"


def new_jobs_channel(prefix: str, model: str) -> str:
    """Pub/sub channel told (the stream's name) of every message added to one of ``model``'s job streams: a
    busy worker reads its streams when told, and on a timer, instead of asking Redis for their lag before every
    step; a lane it does not know yet is looked up at once."""
    return f"{prefix}:new-jobs:{model}"
