"""The step pacer: the batch tier's token cap per step while interactive traffic is about, from measured steps."""

from __future__ import annotations

from worker.step_pacer import MIN_SAMPLE_TOKENS, StepPacer


def test_step_pacer_sizes_the_cap_from_measured_prefill_steps():
    pacer = StepPacer(target_s=0.25, ceiling=2048)
    assert pacer.observe(64, 0.2) is None  # a decode-sized step says nothing about a prefill token's cost
    assert pacer.observe(1000, 1.0) == 250  # 1 ms a token: 250 tokens in 250 ms
    for _ in range(50):
        cap = pacer.observe(MIN_SAMPLE_TOKENS * 4, MIN_SAMPLE_TOKENS * 4 * 0.0001)  # the machine got 10x faster
    assert cap == 2048  # clamped to the whole budget
    slow = StepPacer(target_s=0.25, ceiling=2048)
    assert slow.observe(500, 50.0) == slow.floor  # never below a full batch of decodes
