"""Speculative decoding (n-gram proposals verified inside the continuous batcher) on real tiny models.

Exactness is the point: greedy output must be token-identical to plain decoding and to Hugging Face, in every
scheduling regime (chunked prefill, preemption mid-speculation, prefix hits, tiers); a seeded sampled request
must give the same tokens as without speculation; unseeded sampling must keep its distribution (a two-sample
chi-square test over the first three tokens). Tiny random models fall into repeating loops under greedy
decoding, which is exactly what prompt lookup catches, so proposals are both accepted and rejected here.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from inferq.settings import Settings
from scheduler.request import FinishReason, Request, SamplingParams, Tier
from tests.integration.test_engine import hf_greedy, kv_bytes, run_all
from worker.engine import LLMEngine

pytestmark = pytest.mark.integration

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, speculative_ngram_min=1)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request, tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_hidden_layers=2)


def engine(model_dir, **opts) -> LLMEngine:
    # plain decoding is one token per step (no decode-ahead windows: tests/integration/test_decode_ahead.py)
    base = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=4, kv_cache_memory="256KiB",
                torch_threads=1, decode_ahead_ms=0.0)
    return LLMEngine(Settings(**{**base, **opts}))


def workload(n=16, seed=3):
    """Prompts with repeats (so the n-gram index has matches from the start) and a shared system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(12)]
    prompts = []
    for i in range(n):
        motif = [rng.randrange(3, 300) for _ in range(rng.choice([2, 3, 5]))]
        tail = motif * rng.choice([2, 4, 7]) + [rng.randrange(3, 300) for _ in range(rng.choice([1, 6]))]
        prompts.append(system + tail if i % 3 == 0 else tail)
    return prompts, [8 + (i * 7) % 29 for i in range(n)]


SCENARIOS = {
    "batched": dict(),
    "alone": dict(max_num_seqs=1),
    "tiny_budget": dict(max_batched_tokens=6),  # chunked prefill; proposals squeezed by the token budget
    "tiny_pool": dict(kv_cache_memory=kv_bytes(26), max_batched_tokens=128),  # preemption mid-speculation
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_identical_to_plain_decoding_and_hf(tiny_model, scenario):
    prompts, max_tokens = workload()
    expected = hf_greedy(tiny_model, prompts, max_tokens)

    def run(check_blocks=False, **opts):
        eng = engine(tiny_model, **SCENARIOS[scenario], **opts)
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            eng.add_request(Request(f"s{i}", p, SamplingParams(max_tokens=m, temperature=0.0),
                                    tier=Tier.INTERACTIVE if i % 4 == 0 else Tier.BATCH))
        outs = {}
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
            if check_blocks:  # rejected proposals' blocks go back at once: a table covers the cache, no more
                bs = eng.block_manager.block_size
                assert all(len(r.block_table) == -(-r.num_computed_tokens // bs) for r in eng.scheduler.running)
        return eng, outs

    plain_engine, plain = run()
    spec_engine, spec = run(**SPEC, check_blocks=True)
    for i in range(len(prompts)):
        assert plain[f"s{i}"].token_ids == expected[i], f"plain {i}"
        assert spec[f"s{i}"].token_ids == expected[i], f"speculative {i} differs from HF greedy"
        assert spec[f"s{i}"].finish_reason is plain[f"s{i}"].finish_reason
    st = spec_engine.stats
    assert 0 < st.spec_accepted_tokens < st.spec_proposed_tokens  # both outcomes were exercised
    assert sum(o.usage.spec_accepted_tokens for o in spec.values()) == st.spec_accepted_tokens
    assert st.completion_tokens == plain_engine.stats.completion_tokens
    assert st.steps < plain_engine.stats.steps  # accepted proposals saved steps
    if scenario == "tiny_pool":
        assert st.preemptions > 0
    if scenario == "batched":  # the same prompts again: prefix-cache hits (blocks written under speculation)
        again = run_all(spec_engine, [Request(f"again{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i],
                                                                                    temperature=0.0))
                                      for i in range(6)])
        assert all(again[f"again{i}"].token_ids == expected[i] for i in range(6))
        assert sum(o.usage.cached_prompt_tokens for o in again.values()) > 0
    # Every block is back: rejected proposals' blocks were returned, none leaked.
    assert spec_engine.block_manager.num_free == spec_engine.block_manager.num_blocks


def test_seeded_sampling_identical_to_plain_decoding(tiny_model):
    prompts, max_tokens = workload(n=10, seed=5)

    def run(**opts):
        eng = engine(tiny_model, **opts)
        reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.7, top_k=3, seed=100 + i,
                                                   ignore_eos=True))
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
        return eng, run_all(eng, reqs)

    _, plain = run()
    spec_engine, spec = run(**SPEC)
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    assert spec_engine.stats.spec_accepted_tokens > 0


def test_unseeded_sampling_keeps_its_distribution(tiny_model):
    """Two-sample chi-square over the triple of the first three sampled tokens (top_k=2: 8 cells), plain vs
    speculative, 1500 requests each; the engines' sampler seeds are fixed, so the test is deterministic."""
    # Most of the vocabulary once, so whatever the first token is, it occurred before and is followed by a guess.
    prompt = random.Random(0).sample(range(3, 384), 340)
    n = 1500

    def run(**opts):
        eng = engine(tiny_model, max_num_seqs=256, max_batched_tokens=4096, kv_cache_memory="8MiB", **opts)
        eng.runner.sampler.generator.manual_seed(1234)
        reqs = [Request(f"u{i}", prompt, SamplingParams(max_tokens=3, temperature=1.5, top_k=2, ignore_eos=True))
                for i in range(n)]
        outs = run_all(eng, reqs)
        return eng, Counter(tuple(o.token_ids) for o in outs.values())

    _, plain = run()
    spec_engine, spec = run(**{**SPEC, "speculative_max_step_tokens": 4096})
    assert spec_engine.stats.spec_proposed_tokens > 0
    cells = sorted(set(plain) | set(spec))
    assert 2 < len(cells) <= 8
    # Pearson's two-sample statistic (equal sample sizes) against the chi-square critical value at p = 0.001.
    stat = sum((plain[c] - spec[c]) ** 2 / (plain[c] + spec[c]) for c in cells)
    critical = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[len(cells) - 1]
    assert stat < critical, f"distributions differ: chi2={stat:.1f} >= {critical}, {plain} vs {spec}"


def test_stop_string_and_max_tokens_inside_accepted_proposals(tiny_model):
    """A stop token or max_tokens reached in the middle of a step's accepted proposals ends the request
    exactly there, as plain decoding does; nothing past it is returned or billed."""
    prompts, _ = workload(n=6, seed=9)
    plain_out = run_all(engine(tiny_model), [Request(f"p{i}", p, SamplingParams(max_tokens=40, temperature=0.0,
                                                                               ignore_eos=True))
                                             for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        ref = plain_out[f"p{i}"].token_ids
        stop_id = ref[len(ref) // 2]  # some token in the middle of the answer
        cut = ref.index(stop_id) + 1
        for params, want, reason in [
            (SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]), ref[:cut],
             FinishReason.STOP),
            (SamplingParams(max_tokens=cut, temperature=0.0, ignore_eos=True), ref[:cut], FinishReason.LENGTH),
        ]:
            eng = engine(tiny_model, **SPEC)
            out = run_all(eng, [Request("x", p, params)])["x"]
            assert out.token_ids == want and out.finish_reason is reason
            assert out.usage.completion_tokens == len(want)


def test_abort_and_deadline_between_speculative_steps(tiny_model):
    """Requests that have been verifying proposals are aborted, or reach their deadline, between two steps: they
    end with their own reason, the others' output is untouched (greedy as Hugging Face's), and every block,
    proposals' included, comes back."""
    import time

    prompts, max_tokens = workload(n=8, seed=5)
    max_tokens = [m + 24 for m in max_tokens]  # long enough to be cut short
    expected = hf_greedy(tiny_model, prompts, max_tokens)
    eng = engine(tiny_model, **SPEC)
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        eng.add_request(Request(f"s{i}", p, SamplingParams(max_tokens=m, temperature=0.0),
                                tier=Tier.INTERACTIVE if i % 2 else Tier.BATCH, deadline=time.monotonic() + 600))
    outs: dict = {}
    cut = {"s1": FinishReason.ABORT, "s2": FinishReason.DEADLINE}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        live = eng.scheduler.requests
        ready = [rid for rid in cut if rid in live and live[rid].num_spec_proposed > 0 and rid not in outs]
        for rid in ready:  # it has been speculating: cut it now
            if cut[rid] is FinishReason.ABORT:
                assert eng.abort(rid)
            else:
                live[rid].deadline = time.monotonic() - 1.0
            cut[rid] = (cut[rid], "done")  # type: ignore[assignment]
    assert all(isinstance(v, tuple) for v in cut.values()), "a cut request never speculated"
    assert outs["s1"].finish_reason is FinishReason.ABORT and outs["s2"].finish_reason is FinishReason.DEADLINE
    for rid in ("s1", "s2"):  # what it got before the cut is the greedy prefix
        assert outs[rid].token_ids == expected[int(rid[1:])][:len(outs[rid].token_ids)]
        assert len(outs[rid].token_ids) < max_tokens[int(rid[1:])]
    for i in (0, 3, 4, 5, 6, 7):
        assert outs[f"s{i}"].token_ids == expected[i]
    assert eng.stats.spec_accepted_tokens > 0
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
