"""The model registry in Redis: which models the workers serve, and what the API needs to admit a job for one.

Workers publish, the API reads (docs/SERVICE.md, "Model registry"). Keys, under the stream prefix:

* ``{prefix}:model:{name}`` (hash): the model's entry: ``max_model_len`` (the longest prompt + output a
  worker can run), ``tokenizer`` (the sha256 of its ``tokenizer.json``), ``chat_template`` and
  ``template_vars`` (JSON: the special tokens a template may name), ``updated_at``. A model is *known*
  (jobs for it are accepted) while this hash exists: every heartbeat of a worker serving it extends it to
  ``KNOWN_SECONDS``, so jobs keep being accepted through a restart of all its workers.
* ``{prefix}:tokenizer:{sha}`` (string): the ``tokenizer.json`` the API counts prompt tokens with.
* ``{prefix}:model-workers:{name}`` (sorted set): worker name -> the Unix time until which it counts as
  serving (its last heartbeat plus a few heartbeat periods); ``/readyz`` reports these.
* ``{prefix}:models`` (sorted set): model name -> the latest such time, to list the models.

``announce`` makes a model known without a worker (``inferq up`` does it for its default model, which is
then accepted before the worker has loaded it). Model names are validated (``name_problem``) before
any key is read or written. No torch here: the engine is read duck-typed.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

KNOWN_SECONDS = 86_400  # a model stays known this long after its last worker's heartbeat
LIVE_HEARTBEATS = 3  # a worker counts as serving for this many heartbeat periods after each one
MIN_LIVE_SECONDS = 5.0  # ... and at least this long (a slow step must not make it flap)
MAX_NAME_LENGTH = 128
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/+-]*$"  # also in the OpenAPI document (api/app.py)
_NAME = re.compile(NAME_PATTERN)


def name_problem(name: str) -> str | None:
    """Why ``name`` is not an acceptable model name (a conservative charset and length), or None. (A name with
    a ``/`` is queued under its last part, as ``inferq.contract.model_id`` says.)"""
    if not name:
        return "must not be empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"must be at most {MAX_NAME_LENGTH} characters"
    if not _NAME.match(name):
        return "must be a model name: letters, digits and . _ : / + -, starting with a letter or digit"
    return None


def model_key(prefix: str, name: str) -> str:
    return f"{prefix}:model:{name}"


def workers_key(prefix: str, name: str) -> str:
    return f"{prefix}:model-workers:{name}"


def models_key(prefix: str) -> str:
    return f"{prefix}:models"


def tokenizer_key(prefix: str, sha: str) -> str:
    return f"{prefix}:tokenizer:{sha}"


@dataclass(frozen=True)
class ModelEntry:
    """A known model, as the API reads it. ``max_model_len`` and ``tokenizer`` are None until a worker has
    published them (an announced model)."""

    name: str
    max_model_len: int | None = None
    tokenizer: str | None = None  # sha256 of the tokenizer.json
    chat_template: str | None = None
    template_vars: dict[str, Any] = field(default_factory=dict)
    since: float | None = None  # unix time it was announced or a worker last published it


@dataclass(frozen=True)
class ServedModel:
    """What a worker publishes about its model (``describe_engine``)."""

    max_model_len: int | None
    tokenizer_json: str | None
    chat_template: str | None
    template_vars: dict[str, Any]

    @property
    def tokenizer_sha(self) -> str | None:
        return hashlib.sha256(self.tokenizer_json.encode()).hexdigest() if self.tokenizer_json else None


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_entry(name: str, raw: dict[Any, Any]) -> ModelEntry | None:
    """The entry of a ``model_key`` hash as ``HGETALL`` returns it (None when the hash does not exist)."""
    if not raw:
        return None
    h = {_decode(k): _decode(v) for k, v in raw.items()}
    length = h.get("max_model_len") or ""
    try:
        template_vars = json.loads(h.get("template_vars") or "{}")
    except ValueError:
        template_vars = {}
    return ModelEntry(name=name, max_model_len=int(length) if length.isdigit() else None,
                      tokenizer=h.get("tokenizer") or None, chat_template=h.get("chat_template") or None,
                      template_vars=template_vars if isinstance(template_vars, dict) else {},
                      since=_float(h.get("announced_at") or h.get("updated_at")))


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


# ---- writers: the worker, and the launcher's announcement ------------------------------------------------


def announce(redis: Any, prefix: str, name: str) -> None:
    """Make ``name`` known without a worker (its details arrive with the first worker's heartbeat)."""
    if (problem := name_problem(name)) is not None:
        raise ValueError(f"model name {name!r} {problem}")
    pipe = redis.pipeline(transaction=False)
    pipe.hsetnx(model_key(prefix, name), "announced_at", repr(time.time()))
    pipe.expire(model_key(prefix, name), KNOWN_SECONDS)
    pipe.zadd(models_key(prefix), {name: 0}, nx=True)
    pipe.expire(models_key(prefix), KNOWN_SECONDS)
    pipe.execute()


def describe_engine(engine: Any) -> ServedModel:
    """What a worker's engine serves: its context (capped by the KV pool, so that every admitted job fits),
    its Hugging Face tokenizer's ``tokenizer.json`` (the fast tokenizer's backend, exactly what it encodes
    with), its chat template and the special tokens the template is rendered with (as
    ``apply_chat_template`` passes them)."""
    length = getattr(engine, "max_model_len", None)
    runner = getattr(engine, "runner", None)
    blocks, block_size = getattr(runner, "num_blocks", None), getattr(runner, "block_size", None)
    if isinstance(blocks, int) and isinstance(block_size, int) and isinstance(length, int):
        length = min(length, blocks * block_size)
    tok = getattr(engine, "tokenizer", None)
    backend = getattr(tok, "backend_tokenizer", None)
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    specials = getattr(tok, "special_tokens_map", None) or {}
    template_vars = {k: (v if isinstance(v, (str, list)) else str(v)) for k, v in dict(specials).items()}
    return ServedModel(max_model_len=length if isinstance(length, int) else None,
                       tokenizer_json=backend.to_str() if backend is not None else None,
                       chat_template=template if isinstance(template, str) else None, template_vars=template_vars)


class WorkerRegistration:
    """One worker's entry in the registry: ``publish`` once loaded, ``beat`` with every heartbeat (it
    re-publishes the entry if Redis lost it), ``withdraw`` when it stops taking jobs."""

    def __init__(self, redis: Any, prefix: str, model: str, worker: str, served: ServedModel,
                 heartbeat_seconds: float) -> None:
        self.redis, self.prefix, self.model, self.worker, self.served = redis, prefix, model, worker, served
        self.live_seconds = max(LIVE_HEARTBEATS * heartbeat_seconds, MIN_LIVE_SECONDS)

    def publish(self) -> None:
        s, sha = self.served, self.served.tokenizer_sha
        pipe = self.redis.pipeline(transaction=False)
        if sha is not None:
            pipe.set(tokenizer_key(self.prefix, sha), s.tokenizer_json, ex=KNOWN_SECONDS)
        mapping = {"max_model_len": s.max_model_len or "", "tokenizer": sha or "",
                   "chat_template": s.chat_template or "", "template_vars": json.dumps(s.template_vars),
                   "updated_at": repr(time.time())}
        pipe.hset(model_key(self.prefix, self.model), mapping=mapping)
        pipe.execute()
        self.beat()

    def beat(self, serving: bool = True) -> None:
        """Refresh this worker's liveness (or remove it when not ``serving``) and the model's TTLs."""
        if not serving:
            self.withdraw()
            return
        until = time.time() + self.live_seconds
        sha = self.served.tokenizer_sha
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(model_key(self.prefix, self.model))
        pipe.zadd(workers_key(self.prefix, self.model), {self.worker: until})
        pipe.zremrangebyscore(workers_key(self.prefix, self.model), "-inf", time.time() - KNOWN_SECONDS)
        pipe.zadd(models_key(self.prefix), {self.model: until}, gt=True)
        for key in (model_key(self.prefix, self.model), workers_key(self.prefix, self.model),
                    models_key(self.prefix), *([tokenizer_key(self.prefix, sha)] if sha else [])):
            pipe.expire(key, KNOWN_SECONDS)
        if not pipe.execute()[0]:  # the entry is gone (Redis restarted or flushed): publish it again
            self.publish()

    def withdraw(self) -> None:
        self.redis.zrem(workers_key(self.prefix, self.model), self.worker)


# ---- the reader: the API -------------------------------------------------------------------------------


class ModelCatalog:
    """The API process's view of the registry. Entries are cached for ``CACHE_SECONDS``; a name missing from
    the cache is read from Redis at once (a worker may just have registered it)."""

    CACHE_SECONDS = 2.0

    def __init__(self, redis: Any, prefix: str) -> None:
        self.redis, self.prefix = redis, prefix
        self._entries: dict[str, tuple[float, ModelEntry]] = {}

    def get(self, name: str) -> ModelEntry | None:
        """The entry of a known model, or None. ``name`` must have passed ``name_problem``."""
        now = time.monotonic()
        cached = self._entries.get(name)
        if cached is not None and now - cached[0] < self.CACHE_SECONDS:
            return cached[1]
        entry = parse_entry(name, self.redis.hgetall(model_key(self.prefix, name)))
        if entry is None:
            self._entries.pop(name, None)
        else:
            if len(self._entries) > 1000:
                self._entries.clear()
            self._entries[name] = (now, entry)
        return entry

    def names(self) -> list[str]:
        """The known models, by name (those whose entry has not expired)."""
        names = sorted(_decode(n) for n in self.redis.zrange(models_key(self.prefix), 0, -1))
        pipe = self.redis.pipeline(transaction=False)
        for n in names:
            pipe.exists(model_key(self.prefix, n))
        return [n for n, there in zip(names, pipe.execute(), strict=True) if there]

    def serving(self) -> dict[str, list[str]]:
        """Every known model -> the workers serving it now (possibly none)."""
        names = self.names()
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        for n in names:
            pipe.zrangebyscore(workers_key(self.prefix, n), now, "+inf")
        return {n: sorted(_decode(w) for w in ws) for n, ws in zip(names, pipe.execute(), strict=True)}

    def tokenizer_json(self, sha: str) -> str | None:
        raw = self.redis.get(tokenizer_key(self.prefix, sha))
        return _decode(raw) if raw is not None else None
