"""``ModelRunner._prepare_decodes`` (worker/model_runner.py), the Python-int path for steps of plain decodes,
gives exactly the general numpy path's inputs, and leaves every other step to it: random batches of decodes
at every position within a block (prompt and output tokens alike), plus the steps it must refuse."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from scheduler.request import Request
from worker import model_runner
from worker.model_runner import ModelRunner

BLOCK_SIZE, NUM_BLOCKS = 16, 4096


def _runner() -> SimpleNamespace:
    """What _prepare reads of a runner: its block size and pool size, and its own methods."""
    runner = SimpleNamespace(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    for name in ("_prepare", "_prepare_decodes", "_block_tables"):
        setattr(runner, name, getattr(ModelRunner, name).__get__(runner))
    return runner


def _decode(rng: random.Random, name: str) -> Request:
    prompt = [rng.randrange(3, 50_000) for _ in range(rng.randrange(1, 90))]
    req = Request(name, prompt)
    # no output yet: the step computes the prompt's last token (the end of a prefill, one token long)
    req.output_token_ids = [rng.randrange(3, 50_000) for _ in range(rng.randrange(0, 60))]
    req.num_computed_tokens = req.num_tokens - 1
    need = (req.num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    req.block_table = rng.sample(range(NUM_BLOCKS), need + rng.randrange(0, 3))  # spare blocks beyond need
    return req


def _general(runner, batch):
    saved = model_runner.MAX_FAST_DECODES
    model_runner.MAX_FAST_DECODES = 0
    try:
        return runner._prepare(batch)
    finally:
        model_runner.MAX_FAST_DECODES = saved


def _same(a, b) -> None:
    assert a.input_ids == b.input_ids
    assert [r.request_id for r in a.requests] == [r.request_id for r in b.requests]
    for name in ("order", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                 "sample_rows", "num_logits", "logits_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("seed", range(40))
def test_the_decode_path_gives_the_general_paths_inputs(seed) -> None:
    rng = random.Random(seed)
    runner = _runner()
    batch = [(_decode(rng, f"r{i}"), 1) for i in range(rng.randrange(1, 12))]
    fast = runner._prepare_decodes(batch)
    assert fast is not None
    _same(fast, _general(runner, batch))
    assert runner._prepare(batch).slot_mapping.tolist() == fast.slot_mapping.tolist()


def test_other_steps_are_left_to_the_general_path() -> None:
    rng = random.Random(7)
    runner = _runner()
    chunk = _decode(rng, "chunk")
    chunk.num_computed_tokens -= 3  # a chunk of 4 tokens
    assert runner._prepare_decodes([(chunk, 4)]) is None
    middle = _decode(rng, "middle")
    middle.num_computed_tokens -= 2  # one token, not the last: a 1-token prefill chunk that samples nothing
    assert runner._prepare_decodes([(middle, 1)]) is None
    _same(runner._prepare([(middle, 1)]), _general(runner, [(middle, 1)]))
    spec = _decode(rng, "spec")
    spec.spec_token_ids = [5, 6]
    assert runner._prepare_decodes([(spec, 1)]) is None
    assert runner._prepare_decodes([]) is None
    many = [(_decode(rng, f"m{i}"), 1) for i in range(model_runner.MAX_FAST_DECODES + 1)]
    assert runner._prepare_decodes(many) is None


def test_a_bad_block_table_still_raises_the_general_paths_error() -> None:
    rng = random.Random(3)
    runner = _runner()
    short = _decode(rng, "short")
    short.block_table = short.block_table[: (short.num_tokens - 1) // BLOCK_SIZE]  # one block missing
    with pytest.raises(ValueError, match="block table has"):
        runner._prepare([(short, 1)])
    wild = _decode(rng, "wild")
    wild.block_table[(wild.num_tokens - 1) // BLOCK_SIZE] = NUM_BLOCKS  # the block the new token goes to
    with pytest.raises(ValueError, match="out of range"):
        runner._prepare([(wild, 1)])
