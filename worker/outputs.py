"""What the engine hands back each step: text deltas, finish reasons and per-request usage.

Pure Python so the job service and the API can share it without importing torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scheduler.request import FinishReason


@dataclass
class Usage:
    """Per-request accounting. ``compute_seconds`` is this request's share of each step's wall time,
    split by the number of tokens it had in that step; over a run they add up to the engine's busy time."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0
    time_to_first_token: float | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    compute_seconds: float = 0.0
    spec_proposed_tokens: int = 0  # speculative decoding: proposals verified for this request
    spec_accepted_tokens: int = 0  # of which accepted (each saved one step; billing stays per output token)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestOutput:
    """Progress of one request in one engine step."""

    request_id: str
    text_delta: str = ""
    new_token_ids: list[int] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    text: str | None = None  # the whole output text, set when finished
    token_ids: list[int] | None = None  # all output token ids, set when finished
    usage: Usage | None = None  # set when finished
    error: str | None = None  # set when the request was rejected (finish_reason ERROR)


@dataclass
class Capacity:
    """How much more work the engine can take now (admission control for the worker)."""

    requests: int
    tokens: int
