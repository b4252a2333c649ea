"""Requests as the engine sees them: token ids, sampling parameters, tier, and progress through the cache.

Pure Python (no torch): the scheduler, the block manager and their tests import this without a model.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field


class Tier(str, enum.Enum):
    """Priority class. Interactive (latency) is scheduled first and may preempt batch (throughput)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """Lower rank is more important."""
        return 0 if self is Tier.INTERACTIVE else 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet scheduled, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    DEADLINE = "deadline"  # per-request deadline passed
    ERROR = "error"  # rejected (e.g. can never fit in the KV cache)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy.

    These field defaults are the ONE definition of the request defaults: the public API's (``max_tokens``
    256, docs/API.md), the job message's and the offline ``inferq generate`` schema's. ``inferq.contract``
    exports them as ``DEFAULT_*`` (written here because the scheduler may not import the contract).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and its progress.

    ``num_computed_tokens`` counts tokens whose keys/values are in the cache (cached prefix hits
    included); the tokens still to compute are ``all_token_ids[num_computed_tokens:]``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tier: Tier = Tier.BATCH
    priority: int = 0  # higher runs first within a tier
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() value after which the request expires
    cache_namespace: str = ""  # prefix-cache salt: tenants never share cached blocks across namespaces
    tenant: str = ""  # fair-share key: waiting requests are admitted round-robin over tenants (fairness.py)
    weight: float = 1.0  # the tenant's fair-share weight (its share of admitted tokens, relative to others)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))  # FIFO tie-break
    error: str | None = None  # why the request was rejected (finish_reason ERROR)
    # Prefix-cache keys of the leading full blocks of all_token_ids (memoised by the block manager).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Speculative decoding: tokens proposed for the positions after the last known one, verified by the
    # next step (set by the engine's proposer, consumed or dropped by the scheduler); running totals.
    spec_token_ids: list[int] = field(default_factory=list)
    # Decode ahead (worker/engine.py): this step's spec_token_ids are placeholders for tokens the runner makes
    # one forward at a time, not guesses to verify (not counted as speculation).
    decode_ahead: bool = False
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    num_spec_drafts: int = 0  # verified steps that held at least one proposal

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if not isinstance(self.tier, Tier):
            self.tier = Tier(self.tier)
        if not self.weight > 0:  # also refuses NaN
            raise ValueError("weight must be > 0")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def sort_key(self) -> tuple[int, int, float, int]:
        """Scheduling order: tier, then priority (higher first), then arrival. Smallest runs first."""
        return (self.tier.rank, -self.priority, self.arrival_time, self.arrival_seq)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Running with every known token but the last in the cache: the next step samples one token (or
        verifies proposals)."""
        return self.status is RequestStatus.RUNNING and self.num_tokens - self.num_computed_tokens == 1

    @property
    def max_total_tokens(self) -> int:
        """Upper bound on this request's length (prompt + max_tokens, capped by the model's context)."""
        total = self.num_prompt_tokens + self.sampling.max_tokens
        return min(total, self.max_model_len) if self.max_model_len else total
