"""The one typed settings object. No other module reads the environment.

Values come from, highest first: explicit keyword arguments, ``INFERQ_*`` environment variables, the TOML
file named by ``INFERQ_CONFIG`` (if any), then the defaults below.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "KI": 1024, "M": 1000**2, "MB": 1000**2,
          "MIB": 1024**2, "MI": 1024**2, "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "GI": 1024**3,
          "T": 1000**4, "TB": 1000**4, "TIB": 1024**4, "TI": 1024**4}


def parse_size(value: str | int | float) -> int:
    """Parse a memory size such as ``2GiB``, ``512MB`` or ``1048576`` into bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"not a memory size: {value!r} (examples: 2GiB, 512MiB, 1000000)")
    number, unit = m.groups()
    return int(float(number) * _UNITS[(unit or "").upper()])


def _user_dir(env: str, fallback: str) -> Path:
    return Path(os.environ.get(env) or Path.home() / fallback)


Tier = Literal["interactive", "batch"]


class Settings(BaseSettings):
    """Configuration for every inferq process (API, worker, Celery, CLI)."""

    model_config = SettingsConfigDict(env_prefix="INFERQ_", extra="forbid", validate_default=True)

    # --- services -------------------------------------------------------------------------------
    database_url: str = Field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/inferq",
        description="SQLAlchemy URL of the job database (PostgreSQL in production, SQLite for `inferq up`).",
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL used as the job transport.")
    celery_broker_url: str | None = Field(None, description="Celery broker; defaults to redis_url.")
    celery_result_backend: str | None = Field(None, description="Celery result backend; defaults to redis_url.")
    celery_consume_default_queue: bool = Field(
        True, description="The inferq Celery worker also consumes Celery's default queue (`celery`), where "
        "`send_task(...)` without `queue=` goes; off when another application's worker owns that queue.")

    # --- model and engine -------------------------------------------------------------------------
    model: str = Field("smollm2-135m-instruct", description="Model name (see `inferq models list`) or a local HF directory.")
    model_cache_dir: Path = Field(default_factory=lambda: _user_dir("XDG_CACHE_HOME", ".cache") / "inferq" / "models")
    data_dir: Path = Field(default_factory=lambda: _user_dir("XDG_DATA_HOME", ".local/share") / "inferq")
    kernel_plan_cache: bool = Field(
        True, description="Keep the CPU kernel plans (each weight shape's measured GEMM layout and form) on disk "
        "in `kernel_plan_dir`, keyed by this CPU, torch and the kernels' sources: later loads on this machine skip "
        "the measuring (seconds of a start) and every process runs the same forms. Off: each load measures.")
    kernel_plan_dir: Path = Field(
        default_factory=lambda: _user_dir("XDG_CACHE_HOME", ".cache") / "inferq" / "kernel-plans")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = Field(
        "auto", description="Paged-attention implementation: auto (Triton on CUDA, else cpu), cpu (the C kernels "
        "where they apply, torch otherwise), torch (the portable torch path only, as on a machine without a C "
        "compiler; for checking that path), triton (CUDA).")
    speculative_method: Literal["off", "ngram", "draft", "early-exit"] = Field(
        "off", description="Speculative decoding: off; ngram (prompt lookup: propose what followed the last "
        "few tokens earlier in the prompt or output); draft (a smaller model with the same tokenizer, "
        "speculative_draft_model); early-exit (the target's first speculative_early_exit_layers layers). "
        "Verified in the same step, greedy and seeded output unchanged. See docs/ENGINE.md.")
    speculative_draft_model: str | None = Field(
        None, description="Draft model (name or local HF directory, same tokenizer as the model) of the draft "
        "method; its KV pool takes its share of kv_cache_memory (both pools get the same number of blocks).")
    speculative_early_exit_layers: int | None = Field(
        None, ge=1, description="Layers of the early-exit draft (default: a third of the model's, at least 1; "
        "must be fewer than the model has).")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Most proposals per request and step.")
    speculative_ngram_min: int = Field(2, ge=1, le=8, description="Shortest n-gram matched (ngram method).")
    speculative_ngram_max: int = Field(4, ge=1, le=8, description="Longest n-gram matched, tried first.")
    speculative_max_step_tokens: int = Field(
        32, ge=1, description="Proposals are made only while a step's decode tokens plus proposals stay "
        "within this: a larger step is compute-bound and speculation would only cost.")
    decode_ahead_ms: float = Field(
        20.0, ge=0, description="A request decoding alone (nothing else running or waiting) gets several tokens "
        "per engine step, one forward each, for up to about this many milliseconds of steps (sized from the last "
        "steps' time): the scheduling, postprocessing and streaming around a step are paid once per window. A "
        "request arriving meanwhile waits for the window's end at most. Output is unchanged (the same forward "
        "and sampler per token). 0: one token per step.")
    decode_ahead_wake_ms: float = Field(
        50.0, ge=0, description="decode_ahead_ms for a worker, whose windows end after any token once a job or a "
        "cancellation is announced on its pub/sub connection: a newcomer waits one token, not the window, so the "
        "window may be longer (its text is published at its end, as stream_interval_ms paces it anyway).")
    cuda_graph_max_batch: int = Field(
        64, ge=0, description="On a CUDA device with Triton attention, decode steps of up to this many sequences "
        "replay CUDA graphs captured at start (one per batch-size bucket: 1, 2, 4, ...): one launch per step "
        "instead of some thirty per layer, which is what bounds a small model's step there. 0: every step eager.")
    quantization: Literal["none", "auto", "int8", "w8a16", "w8a8", "int4", "w4a8"] = Field(
        "none", description="Weight quantisation (CPU): none; int8 (per-channel weights; activations float, or int8 "
        "in blocks of 32 where measured faster); w8a16 (int8, float activations only); w8a8 (int8, and torch's per-token int8 activations where our "
        "block kernel does not apply); int4 (group-wise, `quantization_group_size`; the LM head int8); w4a8 (int4, with "
        "every product's activations but the head's int8 in blocks of 32: integer dot products, llama.cpp's Q4 x Q8_0 "
        "arithmetic); auto (a model converted "
        "from a GGUF, such as the default, serves the GGUF's own 4/8-bit blocks; any other model stays float). "
        "Quality against float32: `python -m bench quality`.")
    quantization_group_size: Literal[32, 64, 128, 256] = Field(
        32, description="Inputs per int4 scale/zero-point group.")
    kv_cache_memory: str = Field("1GiB", description="KV-cache pool size, e.g. 2GiB.")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3"] = Field(
        "auto", description="KV-cache element type; auto = the model's dtype, or bfloat16 where a float32 "
        "model's weights are quantised (CPU; their own error dwarfs the cache's). bfloat16 with a float32 model "
        "halves the cache (twice the tokens per budget, faster decode attention on CPU) at the cost of exact "
        "agreement with a float32 reference. int8 (CPU): each (token, head) row as int8 codes with its own "
        "scale, ~1.9x the tokens of bfloat16 per budget, read in place by the C attention kernels. fp8_e4m3 (CPU): "
        "the same rows with float8 e4m3 codes (finer near zero, coarser at the top; `python -m bench quality` "
        "measures the cost of each).")
    kv_cache_prefault: bool = Field(
        True, description="Touch every page of the KV-cache pool at start-up (CPU), so no step pays the page "
        "faults of first use. The pool is on 2 MiB pages, one pool per layer for K and for V, so a sequence "
        "whose blocks reach an untouched 2 MiB region faults in every pool in the same step: 0.35-0.45 s "
        "stalls in the middle of a stream were measured on a VM here without it; at start-up it costs about "
        "1-2 s per GiB there.")
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests running at once.")
    max_batched_tokens: int = Field(2048, ge=1, description="Token budget of one engine step.")
    max_model_len: int | None = Field(None, description="Cap on prompt+output length (default: the model's).")
    enable_prefix_cache: bool = True
    policy: Literal["continuous", "static"] = "continuous"
    batch_min_share: float = Field(
        0.1, ge=0.0, le=1.0, description="Share of each step's token budget guaranteed to the batch tier."
    )
    interactive_step_ms: float = Field(
        250.0, ge=0.0, description="While interactive requests are about (one ran or waited within "
        "interactive_window_seconds), each engine step holds at most the batch-tier tokens this machine computes "
        "in about this many milliseconds (measured on its own prefill steps), so an interactive request waits "
        "behind short steps instead of a full token budget of batch prefills. 0: no cap.")
    interactive_window_seconds: float = Field(
        30.0, ge=0.0, description="How long after the last interactive request the batch tier keeps the "
        "shorter steps of interactive_step_ms.")
    fair_share: bool = Field(
        True, description="Within each tier, admit waiting requests round-robin over tenants by tokens (deficit "
        "round robin, weighted by tenants.fair_share_weight) instead of in arrival order; jobs are queued in one "
        "Redis stream per tenant and tier, which workers read round-robin. See docs/ENGINE.md and docs/SERVICE.md.")
    fair_read_ahead: int = Field(
        4, ge=0, description="Jobs of tenants with none on a worker that it reads beyond its engine's room, so a "
        "fair share can seat them at once instead of after a running job ends (0: read only what fits).")
    torch_threads: int | None = Field(None, description="torch intra-op threads (default: all cores).")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks one worker splits the model across (Megatron-style: attention and KV heads, "
        "MLP columns and the vocabulary; torch.distributed, gloo on CPU, nccl on CUDA). The worker process is "
        "rank 0 and starts the others; the heads, KV heads and intermediate size must divide by it. See "
        "docs/ENGINE.md, \"Tensor parallelism\".")
    tensor_parallel_timeout_seconds: float = Field(
        60.0, gt=0, description="Longest wait for one collective between tensor-parallel ranks before the "
        "worker gives up on a rank (hung or dead) and exits.")

    # --- queue and worker ---------------------------------------------------------------------------
    stream_prefix: str = "inferq"
    consumer_group: str = "workers"
    worker_name: str | None = None
    claim_idle_ms: int = Field(30_000, description="A pending message idle this long is reclaimed from its worker.")
    max_job_attempts: int = Field(
        6, ge=1, description="A job claimed again after this many attempts, each of which ended without a result "
        "(its worker crashed, was killed or stopped, or lost the database), fails with that reason instead of "
        "starting: one input that takes the engine down must not take down worker after worker.")
    heartbeat_seconds: float = 5.0
    reconcile_interval_seconds: float = 15.0
    shutdown_grace_seconds: float = 30.0
    event_stream_maxlen: int = 10_000
    stream_interval_ms: float = Field(
        50.0, ge=0, description="A running job's text deltas are published at most this often (its first token "
        "and its end at once): each published delta wakes Redis, the API's event stream and the client, about "
        "1.5 ms of CPU per event on 2 cores, taken from the engine's steps. 0 publishes every step.")
    event_stream_ttl_seconds: int = 3600
    db_retry_max_seconds: float = 60.0
    cache_routing: bool = Field(
        True, description="Cache-aware routing across workers (inferq/routing.py, docs/SERVICE.md): with two or "
        "more live workers of a model, a job is queued for the worker that owns its prompt prefix (rendezvous "
        "hashing over the live workers), so a shared system prompt is reused from one worker's prefix cache; "
        "any worker takes it once the owner is gone or the job waited cache_routing_max_wait_ms.")
    cache_routing_max_wait_ms: float = Field(
        500.0, ge=0.0, description="How long a routed job waits for its (live but saturated or slow) owner "
        "before any other worker with room takes it.")
    cache_routing_prefix_chars: int = Field(
        128, ge=1, description="Characters of a text prompt (or of a chat's first message) that name its prefix "
        "for routing (about this / 4 tokens: two blocks; prompts sharing less share no full block worth a detour).")
    cache_routing_prefix_tokens: int = Field(
        32, ge=1, description="Token ids of a prompt_ids prompt that name its prefix for routing (two blocks).")

    # --- API, quotas and webhooks ---------------------------------------------------------------------
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_workers: int = Field(1, ge=1, description="Uvicorn worker processes for `inferq api` (one per core for the highest submission rate).")
    max_request_bytes: int = Field(
        4 << 20, ge=1024, description="Largest request body the API reads (413 above); the largest prompt the "
        "job schema accepts (1,000,000 characters) fits with room for JSON escapes.")
    default_max_queued_jobs: int = Field(1000, description="Per-tenant cap on queued jobs (429 above).")
    default_tokens_per_minute: int = Field(2_000_000, description="Per-tenant token rate limit (429 above).")
    tier_queue_cap: int = Field(100_000, description="Per-tier cap on queued jobs (429 above).")
    sse_max_streams: int = Field(
        1000, ge=1, description="Most server-sent event streams one API process serves at once (503 above); each "
        "holds at most one Redis connection, and the streams' Redis pool is sized to match.")
    batch_file_max_bytes: int = Field(
        200_000_000, ge=1024, description="Largest file `POST /v1/files` accepts (OpenAI's Batch API limit, 200 MB; "
        "413 above). Read in chunks and stored in PostgreSQL a part at a time, never held whole in memory.")
    batch_max_lines: int = Field(50_000, ge=1, description="Most requests in one batch input file (400 above).")
    batch_completion_window_seconds: float = Field(
        86_400.0, gt=0, le=7 * 86400, description="What a batch's `completion_window` of \"24h\" means: its jobs' "
        "deadline, after which the batch expires (shorter only for tests).")
    webhook_allowlist: str = Field("", description="Comma-separated hosts or CIDRs that webhooks may target even if private.")
    webhook_max_attempts: int = 8
    webhook_timeout_seconds: float = 10.0
    webhook_backoff_base_seconds: float = 1.0

    # --- prices (micro-dollars per 1M tokens; batch tier gets a discount) ------------------------------
    price_prompt_per_mtok: int = 100_000
    price_cached_prompt_per_mtok: int = 25_000
    price_completion_per_mtok: int = 400_000
    batch_discount: float = Field(0.5, ge=0.0, le=1.0, description="Batch-tier price multiplier.")

    # --- logging ----------------------------------------------------------------------------------------
    log_level: str = "INFO"
    log_json: bool | None = Field(None, description="JSON log lines; default: JSON unless stderr is a TTY.")
    debug: bool = False

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_size(cls, v: str) -> str:
        parse_size(v)
        return v

    @property
    def kv_cache_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)

    @property
    def broker_url(self) -> str:
        return self.celery_broker_url or self.redis_url

    @property
    def result_backend(self) -> str:
        return self.celery_result_backend or self.redis_url

    @property
    def allowlist(self) -> list[str]:
        return [h.strip() for h in self.webhook_allowlist.split(",") if h.strip()]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("INFERQ_CONFIG")
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
        return tuple(sources)


class SettingsError(Exception):
    """A settings problem, phrased for a one-line CLI message."""


def load_settings(**overrides: object) -> Settings:
    """Build settings, turning validation and TOML errors into one readable SettingsError."""
    config_file = os.environ.get("INFERQ_CONFIG")
    if config_file and not Path(config_file).is_file():
        raise SettingsError(f"settings file {config_file} (INFERQ_CONFIG) does not exist")
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except Exception as exc:  # pydantic ValidationError or tomllib.TOMLDecodeError
        errors = getattr(exc, "errors", None)
        if callable(errors):
            parts = [f"{'.'.join(str(p) for p in e['loc']) or '?'}: {e['msg']}" for e in errors()]
            raise SettingsError("invalid settings: " + "; ".join(parts)) from exc
        raise SettingsError(f"could not read settings file {config_file}: {exc}") from exc


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (cached). Tests build their own with ``Settings(...)``."""
    return load_settings()
