"""Which running requests get speculative proposals this step, and how many.

A decode step with few sequences reads every weight to make one token each: it is memory-bound, and
verifying ``k`` proposals per sequence costs little more than one token. A step with many sequences is
already compute-bound, where every rejected proposal is pure cost. So the policy turns itself down per step:
proposals are handed out only while the step's decode tokens plus proposals stay within
``speculative_max_step_tokens`` (the size below which a step costs about the same as one token per
sequence), and a request whose proposals are mostly rejected gets fewer of them. The scheduler still has the
last word: proposals never take budget or KV blocks an ordinary token needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferq.settings import Settings
from scheduler.request import Request
from worker.ngram import NgramProposer

# A request's acceptance rate is trusted after this many verified proposals; below ``_POOR`` it gets one, and
# below ``_USELESS`` none from a proposer that costs compute (a draft forward per guess).
_WARMUP, _POOR, _USELESS = 8, 0.2, 0.1


@dataclass
class Speculation:
    proposer: Any  # NgramProposer, or worker.draft.DraftProposer (whose guesses come in ``fill``)
    num_tokens: int  # most proposals per request and step
    max_step_tokens: int  # decode tokens + proposals per step beyond which nothing is proposed

    @classmethod
    def from_settings(cls, settings: Settings, runner: Any = None) -> Speculation:
        """The proposer of ``speculative_method``; the model-based ones need the engine's ``runner``."""
        method = settings.speculative_method
        if method == "ngram":
            proposer: Any = NgramProposer(settings.speculative_ngram_min, settings.speculative_ngram_max)
        elif method == "early-exit":
            from worker.draft import early_exit

            proposer = early_exit(runner, settings.speculative_early_exit_layers)
        elif method == "draft":
            from worker.draft import draft_model
            from worker.loader import resolve_model

            if not settings.speculative_draft_model:
                raise ValueError("speculative_method=draft needs speculative_draft_model (a local HF directory)")
            proposer = draft_model(runner, resolve_model(settings.speculative_draft_model, settings))
        else:
            raise ValueError(f"unknown speculative_method {method!r}")
        return cls(proposer, settings.num_speculative_tokens, settings.speculative_max_step_tokens)

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` on the decoding requests (most important first) while the step stays small."""
        decoding = [r for r in running if r.is_decoding]
        room = self.max_step_tokens - len(decoding)
        for req in sorted(decoding, key=lambda r: r.sort_key):
            k = min(self._wanted(req), room, req.max_total_tokens - req.num_tokens - 1)
            req.spec_token_ids = self.proposer.propose(req, k) if k > 0 else []
            room -= len(req.spec_token_ids)

    def fill(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        """After scheduling: a model-based proposer turns the granted placeholders into its guesses (and a
        draft model with its own pool follows the step's tokens); n-gram proposals are already final."""
        fill = getattr(self.proposer, "fill", None)
        if fill is not None:
            fill(scheduled)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)

    def _wanted(self, req: Request) -> int:
        """``num_tokens``, or 1 for a request whose proposals have mostly been rejected so far, or 0 when a
        model-based proposer's guesses are almost never right for it (each still costs a draft forward,
        while an n-gram miss costs nothing)."""
        if req.num_spec_proposed >= _WARMUP:
            rate = req.num_spec_accepted / req.num_spec_proposed
            if rate < _USELESS and getattr(self.proposer, "costs_compute", False):
                return 0
            if rate < _POOR:
                return 1
        return self.num_tokens
