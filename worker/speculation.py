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

from dataclasses import dataclass

from inferq.settings import Settings
from scheduler.request import Request
from worker.ngram import NgramProposer

# A request's acceptance rate is trusted after this many verified proposals; below ``_POOR`` it gets one.
_WARMUP, _POOR = 8, 0.2


@dataclass
class Speculation:
    proposer: NgramProposer
    num_tokens: int  # most proposals per request and step
    max_step_tokens: int  # decode tokens + proposals per step beyond which nothing is proposed

    @classmethod
    def from_settings(cls, settings: Settings) -> Speculation:
        return cls(NgramProposer(settings.speculative_ngram_min, settings.speculative_ngram_max),
                   settings.num_speculative_tokens, settings.speculative_max_step_tokens)

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` on the decoding requests (most important first) while the step stays small."""
        decoding = [r for r in running if r.is_decoding]
        room = self.max_step_tokens - len(decoding)
        for req in sorted(decoding, key=lambda r: r.sort_key):
            k = min(self._wanted(req), room, req.max_total_tokens - req.num_tokens - 1)
            req.spec_token_ids = self.proposer.propose(req, k) if k > 0 else []
            room -= len(req.spec_token_ids)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)

    def _wanted(self, req: Request) -> int:
        """``num_tokens``, or 1 for a request whose proposals have mostly been rejected so far."""
        if req.num_spec_proposed >= _WARMUP and req.num_spec_accepted < _POOR * req.num_spec_proposed:
            return 1
        return self.num_tokens
