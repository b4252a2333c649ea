"""How many batch-tier tokens an engine step may hold while interactive traffic is about, from a time target.

Why: an interactive request that arrives mid-step waits for that step, then shares its own first step with
whatever batch work the scheduler adds; with a full token budget of batch prefills (2048 tokens, about a second
on two cores) its TTFT is seconds. A fixed token cap would be right for one CPU only, so the pacer measures this
machine's seconds per token on steps large enough to be compute-bound and sizes the scheduler's
``batch_step_tokens`` so that a step's batch work lasts about ``target_s``. Smaller steps cost the batch tier
little: at a few hundred tokens a step is still compute-bound (docs/BENCHMARKS.md, roofline).
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps with fewer tokens are bound by reading the weights, not by their tokens: their time per token would
# overstate the cost of a prefill token several times over.
MIN_SAMPLE_TOKENS = 256
SMOOTHING = 0.2  # weight of the newest step in the running estimate


@dataclass
class StepPacer:
    target_s: float
    ceiling: int  # the step's whole token budget
    floor: int = 64  # never fewer (the engine passes max_num_seqs: a full batch's decodes always fit)
    seconds_per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> int | None:
        """Learn from one step; the batch-tier cap to use from now on (None: nothing measured yet)."""
        if tokens >= MIN_SAMPLE_TOKENS and seconds > 0:
            x = seconds / tokens
            old = self.seconds_per_token
            self.seconds_per_token = x if old is None else (1 - SMOOTHING) * old + SMOOTHING * x
        return self.cap()

    def cap(self) -> int | None:
        if self.seconds_per_token is None:
            return None
        return max(self.floor, min(self.ceiling, int(self.target_s / self.seconds_per_token)))
