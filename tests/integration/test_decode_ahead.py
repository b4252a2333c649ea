"""Decode ahead (worker/engine.py ``_plan_ahead``, ModelRunner ``_decode_ahead``): a request decoding alone gets
several tokens per engine step, one forward each, at slots granted as speculative proposals' are.

Exactness is the point, as for speculation: greedy output token-identical to plain one-token steps and to
Hugging Face, across block boundaries (block size 4) and with a small pool; a seeded sampled request the same
tokens; an end token, max_tokens or a stop string inside a window ends the request exactly there; a request
arriving mid-stream is served as without windows (none is planned while two run); abort between windows; no
block leaks; nothing counted as speculation. And the windows really happen (fewer steps than tokens).
"""

from __future__ import annotations

import pytest

from inferq.settings import Settings
from scheduler.request import FinishReason, Request, SamplingParams
from tests.integration.test_engine import hf_greedy, kv_bytes, run_all
from worker.engine import LLMEngine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request, tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_hidden_layers=2)


def engine(model_dir, ahead: bool = True, **opts) -> LLMEngine:
    # a budget far above a tiny model's step, so windows reach MAX_AHEAD tokens and cross blocks of 4
    base = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=4, kv_cache_memory="256KiB",
                torch_threads=1, decode_ahead_ms=1000.0 if ahead else 0.0)
    return LLMEngine(Settings(**{**base, **opts}))


PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12, 12, 8], list(range(40, 70))]
MAX_TOKENS = [45, 30, 23]


def one_at_a_time(eng: LLMEngine, params: list[SamplingParams], check_blocks: bool = False) -> dict:
    """Each prompt alone on the engine; finished outputs by id; the engine's block tables checked per step."""
    outs = {}
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        eng.add_request(Request(f"r{i}", p, sp))
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
            if check_blocks:  # a window's unused slots go back at once: a table covers the cache, no more
                bs = eng.block_manager.block_size
                assert all(len(r.block_table) == -(-r.num_computed_tokens // bs) for r in eng.scheduler.running)
    return outs


@pytest.mark.parametrize("pool", ["roomy", "small"])
def test_greedy_identical_to_one_token_steps_and_hf(tiny_model, pool):
    opts = {"kv_cache_memory": kv_bytes(24)} if pool == "small" else {}
    expected = hf_greedy(tiny_model, PROMPTS, MAX_TOKENS)
    greedy = [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS]
    plain_engine = engine(tiny_model, ahead=False, **opts)
    plain = one_at_a_time(plain_engine, greedy)
    eng = engine(tiny_model, **opts)
    ahead = one_at_a_time(eng, greedy, check_blocks=True)
    tokens = 0
    for i in range(len(PROMPTS)):
        assert ahead[f"r{i}"].token_ids == plain[f"r{i}"].token_ids == expected[i], i
        assert ahead[f"r{i}"].text == plain[f"r{i}"].text
        assert ahead[f"r{i}"].usage.completion_tokens == len(expected[i])
        assert ahead[f"r{i}"].finish_reason is plain[f"r{i}"].finish_reason
        tokens += len(expected[i])
    assert eng.stats.steps < plain_engine.stats.steps - tokens // 2  # windows of several tokens ran
    assert eng.stats.spec_proposed_tokens == eng.stats.spec_accepted_tokens == eng.stats.spec_drafts == 0
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_seeded_sampling_identical(tiny_model):
    params = [SamplingParams(max_tokens=m, temperature=0.8, top_k=5, seed=7 + m, ignore_eos=True)
              for m in MAX_TOKENS]
    plain = one_at_a_time(engine(tiny_model, ahead=False), params)
    eng = engine(tiny_model)
    ahead = one_at_a_time(eng, params)
    assert {k: o.token_ids for k, o in ahead.items()} == {k: o.token_ids for k, o in plain.items()}
    assert eng.stats.steps < sum(MAX_TOKENS)


def test_stops_inside_a_window(tiny_model):
    """A stop token, max_tokens or a stop string reached inside a window ends the request exactly there, as a
    one-token step does; nothing past it is returned or billed."""
    ref_eng = engine(tiny_model, ahead=False)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        ref = run_all(ref_eng, [Request(f"p{i}", p, long)])[f"p{i}"]
        stop_id = ref.token_ids[len(ref.token_ids) // 2 + 3]
        cut = ref.token_ids.index(stop_id) + 1
        text = ref.text
        stop_str = text[len(text) // 2: len(text) // 2 + 3]
        cases = [
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
            SamplingParams(max_tokens=cut, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop_str]),
        ]
        for params in cases:
            want = run_all(engine(tiny_model, ahead=False), [Request("x", p, params)])["x"]
            eng = engine(tiny_model)
            got = {}
            eng.add_request(Request("x", p, params))
            deltas = []
            while eng.has_unfinished():
                for o in eng.step():
                    deltas.append(o.text_delta)
                    if o.finished:
                        got = o
            assert got.token_ids == want.token_ids and got.text == want.text == "".join(deltas)
            assert got.finish_reason is want.finish_reason
            assert got.usage.completion_tokens == want.usage.completion_tokens
            assert eng.block_manager.num_free == eng.block_manager.num_blocks
        assert want.finish_reason is FinishReason.STOP and stop_str not in want.text


def test_a_request_arriving_mid_stream_and_an_abort(tiny_model):
    """A second request added while the first runs ahead: no window while both run, both outputs greedy as
    Hugging Face's; then a lone request aborted between windows ends with ABORT holding a greedy prefix, and
    every block comes back."""
    expected = hf_greedy(tiny_model, PROMPTS, MAX_TOKENS)
    eng = engine(tiny_model)
    eng.add_request(Request("r0", PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS[0], temperature=0.0)))
    outs, steps = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        if steps == 3:
            eng.add_request(Request("r1", PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS[1], temperature=0.0)))
        if len(eng.scheduler.running) > 1:
            assert not any(r.decode_ahead or r.spec_token_ids for r in eng.scheduler.running)
    assert outs["r0"].token_ids == expected[0] and outs["r1"].token_ids == expected[1]
    eng.add_request(Request("r2", PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS[2] + 20, temperature=0.0)))
    got = []
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids or []
            if o.finished:
                outs[o.request_id] = o
        if 4 < len(got) and "r2" not in outs:
            assert eng.abort("r2")
    assert outs["r2"].finish_reason is FinishReason.ABORT
    assert 4 < len(outs["r2"].token_ids) < MAX_TOKENS[2] + 20
    assert outs["r2"].token_ids == hf_greedy(tiny_model, PROMPTS[2:], [MAX_TOKENS[2] + 20])[0][:len(outs["r2"].token_ids)]
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


@pytest.mark.parametrize("sampling", ["greedy", "seeded top-k"])
def test_a_readable_wake_descriptor_ends_each_window_after_one_token(tiny_model, sampling):
    """With ``wake_fd`` set (the worker's pub/sub socket), windows take the decode_ahead_wake_ms budget; while
    the descriptor is readable (something announced) each window ends after its current token, so a newcomer
    waits one token. Either way the tokens are plain decoding's and every block comes back. (The runner's own
    loop here; tests/unit/test_decode_step.py has the fused step's.)"""
    import os

    params = [SamplingParams(max_tokens=m, temperature=0.8, top_k=5, seed=3 + m, ignore_eos=True)
              if sampling != "greedy" else SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS]
    plain = one_at_a_time(engine(tiny_model, ahead=False), params)
    read_end, write_end = os.pipe()
    try:
        steps = {}
        for readable in (False, True):
            if readable:
                os.write(write_end, b"x")  # stays unread: readable for the whole run
            eng = engine(tiny_model, ahead=False, decode_ahead_wake_ms=1000.0)
            eng.wake_fd = lambda: read_end
            outs = one_at_a_time(eng, params, check_blocks=True)
            assert {k: o.token_ids for k, o in outs.items()} == {k: o.token_ids for k, o in plain.items()}
            assert eng.block_manager.num_free == eng.block_manager.num_blocks
            steps[readable] = eng.stats.steps
        tokens = sum(len(o.token_ids) for o in plain.values())
        assert steps[False] < tokens // 2  # decode_ahead_ms is 0: the wake budget alone made these windows
        assert steps[True] >= tokens  # one token a step (and the prefills)
    finally:
        os.close(read_end)
        os.close(write_end)
