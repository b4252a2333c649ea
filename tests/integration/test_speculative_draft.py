"""Model-based speculative proposers (worker/draft.py): ``early-exit`` (the target's first layers) and
``draft`` (a second, smaller checkpoint with its own mirrored KV pool), on tiny random Llama and Qwen2 models.

As for n-gram proposals, exactness is the point: greedy output token-identical to plain decoding and to
Hugging Face under batching, chunked prefill, preemption mid-speculation and prefix-cache hits; seeded
sampling identical; unseeded sampling with the same distribution. A draft that is the target itself must
have its proposals (almost) all accepted: that checks the draft's mirrored pool holds the right KV in every
regime, which identity of the outputs alone cannot (a wrong draft only costs speed).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from scheduler.request import FinishReason, Request, SamplingParams, Tier
from tests.integration.test_engine import hf_greedy, kv_bytes, run_all
from tests.integration.test_smollm2_vs_hf import smollm_dir  # noqa: F401 - fixture
from tests.integration.test_speculative import SCENARIOS, workload
from tests.integration.test_speculative import engine as plain_engine_of

pytestmark = pytest.mark.integration

TARGET_LAYERS = 2


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request, tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_hidden_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def default_model(smollm_dir):  # noqa: F811
    """The converted default model (tests/integration/test_smollm2_vs_hf.py's fixture finds or converts it)."""
    return smollm_dir


@pytest.fixture(scope="module")
def small_draft(tiny_model, tmp_path_factory):
    """A 1-layer checkpoint cut from the target (its first layer, norm, head and tokenizer): a separate draft
    whose guesses are sometimes right, as a distilled draft's would be."""
    return truncated_copy(tiny_model, tmp_path_factory.mktemp("draft") / tiny_model.name, layers=1)


def truncated_copy(src, dst, layers: int):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config))
    for f in dst.glob("*.safetensors"):
        keep = {k: v for k, v in load_file(f).items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
        save_file(keep, f, metadata={"format": "pt"})
    return dst


def engine(model_dir, **opts):
    """An engine whose draft keeps proposing to requests it is mostly wrong for (the policy would stop: see
    test_useless_draft_stops_proposing), so that the random tiny drafts' guesses are both kept and rejected."""
    eng = plain_engine_of(model_dir, **opts)
    if eng.speculation is not None:
        eng.speculation.proposer.costs_compute = False
    return eng


def proposer(name: str, target, small) -> tuple[dict, int]:
    """Settings of a proposer and its draft's layer count (0: no separate pool)."""
    base = dict(num_speculative_tokens=4)
    if name == "early-exit":
        return {**base, "speculative_method": "early-exit", "speculative_early_exit_layers": 1}, 0
    if name == "draft-self":
        return {**base, "speculative_method": "draft", "speculative_draft_model": str(target)}, TARGET_LAYERS
    return {**base, "speculative_method": "draft", "speculative_draft_model": str(small)}, 1


def scenario(name: str, draft_layers: int) -> dict:
    """The n-gram tests' scenarios; the tiny pool is grown by the draft's share, so the target keeps the same
    number of blocks (and still preempts)."""
    opts = dict(SCENARIOS[name])
    if name == "tiny_pool":
        opts["kv_cache_memory"] = str(int(kv_bytes(26)) * (TARGET_LAYERS + draft_layers) // TARGET_LAYERS)
    return opts


PROPOSERS = ["early-exit", "draft-small", "draft-self"]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """HF greedy outputs and the plain engine's results of the workload, per scenario (computed once)."""
    prompts, max_tokens = workload()
    return prompts, max_tokens, hf_greedy(tiny_model, prompts, max_tokens), {}


def _run(model_dir, prompts, max_tokens, check_blocks=False, **opts):
    eng = engine(model_dir, **opts)
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        eng.add_request(Request(f"s{i}", p, SamplingParams(max_tokens=m, temperature=0.0),
                                tier=Tier.INTERACTIVE if i % 4 == 0 else Tier.BATCH))
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        if check_blocks:
            bs = eng.block_manager.block_size
            assert all(len(r.block_table) == -(-r.num_computed_tokens // bs) for r in eng.scheduler.running)
    return eng, outs


@pytest.mark.parametrize("name", PROPOSERS)
@pytest.mark.parametrize("scen", list(SCENARIOS))
def test_greedy_identical_to_plain_decoding_and_hf(tiny_model, small_draft, reference, name, scen):
    prompts, max_tokens, expected, plain_cache = reference
    if scen not in plain_cache:
        plain_cache[scen] = _run(tiny_model, prompts, max_tokens, **SCENARIOS[scen])
    plain_engine, plain = plain_cache[scen]
    opts, draft_layers = proposer(name, tiny_model, small_draft)
    spec_engine, spec = _run(tiny_model, prompts, max_tokens, check_blocks=True, **scenario(scen, draft_layers), **opts)
    if scen == "tiny_pool":  # the memory setting was grown by exactly the draft's share
        assert spec_engine.block_manager.num_blocks == plain_engine.block_manager.num_blocks
    for i in range(len(prompts)):
        assert plain[f"s{i}"].token_ids == expected[i], f"plain {i}"
        assert spec[f"s{i}"].token_ids == expected[i], f"{name} {i} differs from HF greedy"
        assert spec[f"s{i}"].finish_reason is plain[f"s{i}"].finish_reason
    st = spec_engine.stats
    assert st.spec_proposed_tokens > 0 and st.spec_accepted_tokens > 0
    assert st.completion_tokens == plain_engine.stats.completion_tokens
    if name == "draft-self":  # the draft's pool is right in every regime: its guesses are the target's
        assert st.spec_accepted_tokens >= 0.97 * st.spec_proposed_tokens
        assert st.steps < plain_engine.stats.steps
    if scen == "tiny_pool":
        assert st.preemptions > 0
    if scen == "batched":  # prefix-cache hits on blocks written under speculation (both pools)
        again = run_all(spec_engine, [Request(f"again{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i],
                                                                                    temperature=0.0))
                                      for i in range(6)])
        assert all(again[f"again{i}"].token_ids == expected[i] for i in range(6))
        assert sum(o.usage.cached_prompt_tokens for o in again.values()) > 0
        if name == "draft-self":  # the revived blocks' draft KV (written by the mirror pass) is right too
            assert st.spec_accepted_tokens >= 0.97 * st.spec_proposed_tokens
    assert spec_engine.block_manager.num_free == spec_engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["early-exit", "draft-small"])
def test_seeded_sampling_identical_to_plain_decoding(tiny_model, small_draft, name):
    prompts, max_tokens = workload(n=10, seed=5)

    def run(**opts):
        eng = engine(tiny_model, **opts)
        reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.7, top_k=3, seed=100 + i,
                                                   ignore_eos=True))
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
        return eng, run_all(eng, reqs)

    _, plain = run()
    spec_engine, spec = run(**proposer(name, tiny_model, small_draft)[0])
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    assert spec_engine.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("name", ["early-exit", "draft-self"])
def test_unseeded_sampling_keeps_its_distribution(tiny_model, small_draft, name):
    """Two-sample chi-square over the triple of the first three sampled tokens (top_k=2: 8 cells), plain vs
    speculative, 1500 requests each, fixed sampler seeds (deterministic). The self-draft proposes the target's
    argmax, so many proposals are accepted and many rejected: both branches of the rule are exercised."""
    prompt = random.Random(0).sample(range(3, 384), 60)
    n = 1500
    opts, draft_layers = proposer(name, tiny_model, small_draft)

    def run(memory="8MiB", **o):
        eng = engine(tiny_model, max_num_seqs=256, max_batched_tokens=4096, kv_cache_memory=memory, **o)
        eng.runner.sampler.generator.manual_seed(1234)
        reqs = [Request(f"u{i}", prompt, SamplingParams(max_tokens=3, temperature=1.5, top_k=2, ignore_eos=True))
                for i in range(n)]
        return eng, Counter(tuple(o.token_ids) for o in run_all(eng, reqs).values())

    _, plain = run()
    spec_engine, spec = run(memory=f"{8 * (TARGET_LAYERS + draft_layers) // TARGET_LAYERS}MiB",
                            speculative_max_step_tokens=4096, **opts)
    st = spec_engine.stats
    assert 0 < st.spec_proposed_tokens
    if name == "draft-self":
        assert 0 < st.spec_accepted_tokens < st.spec_proposed_tokens
    cells = sorted(set(plain) | set(spec))
    assert 2 < len(cells) <= 8
    stat = sum((plain[c] - spec[c]) ** 2 / (plain[c] + spec[c]) for c in cells)
    critical = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[len(cells) - 1]
    assert stat < critical, f"distributions differ: chi2={stat:.1f} >= {critical}, {plain} vs {spec}"


def test_stop_token_and_max_tokens_inside_accepted_proposals(tiny_model):
    """With a self-draft nearly every proposal is accepted, so stops land inside accepted runs: the request
    ends exactly there (never overshoots max_tokens), as in plain decoding."""
    prompts, _ = workload(n=4, seed=9)
    opts = dict(speculative_method="draft", speculative_draft_model=str(tiny_model), num_speculative_tokens=4)
    plain = run_all(engine(tiny_model), [Request(f"p{i}", p, SamplingParams(max_tokens=40, temperature=0.0,
                                                                           ignore_eos=True))
                                         for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        ref = plain[f"p{i}"].token_ids
        stop_id = ref[len(ref) // 2]
        cut = ref.index(stop_id) + 1
        for params, reason in [
            (SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]), FinishReason.STOP),
            (SamplingParams(max_tokens=cut, temperature=0.0, ignore_eos=True), FinishReason.LENGTH),
        ]:
            out = run_all(engine(tiny_model, **opts), [Request("x", p, params)])["x"]
            assert out.token_ids == ref[:cut] and out.finish_reason is reason
            assert out.usage.completion_tokens == cut


@pytest.mark.parametrize("layers", [TARGET_LAYERS, TARGET_LAYERS + 3])
def test_early_exit_layers_out_of_range_is_a_clear_error(tiny_model, layers):
    with pytest.raises(ValueError, match="speculative_early_exit_layers must be in \\[1, 1\\]"):
        engine(tiny_model, speculative_method="early-exit", speculative_early_exit_layers=layers)


def test_early_exit_layers_zero_is_rejected_by_settings(tiny_model):
    with pytest.raises(ValueError, match="speculative_early_exit_layers"):
        engine(tiny_model, speculative_method="early-exit", speculative_early_exit_layers=0)


def test_draft_with_another_vocabulary_is_a_clear_error(tiny_model, tmp_path):
    from tests.tiny_models import make_tiny_model

    other = make_tiny_model(tmp_path, arch="llama", num_hidden_layers=1, vocab_size=400)
    with pytest.raises(ValueError, match="same tokenizer"):
        engine(tiny_model, speculative_method="draft", speculative_draft_model=str(other))


def test_draft_method_needs_a_draft_model(tiny_model):
    with pytest.raises(ValueError, match="speculative_draft_model"):
        engine(tiny_model, speculative_method="draft")


def test_every_proposer_on_the_default_model_is_greedy_identical(default_model, tmp_path):
    """SmolLM2-135M-Instruct, two chat prompts, greedy: plain decoding against each proposer: its default
    early-exit draft (10 of 30 layers), a separate draft checkpoint (a 6-layer copy cut from it, so the same
    tokenizer), and n-gram lookup."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    text = "Repeat exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in (text, "Why is the sky blue?")]
    ids = [list(tok.encode(p, add_special_tokens=False)) for p in prompts]

    def run(**opts):
        eng = engine(default_model, block_size=16, kv_cache_memory="64MiB", torch_threads=None, **opts)
        outs = run_all(eng, [Request(f"m{i}", p, SamplingParams(max_tokens=24, temperature=0.0))
                             for i, p in enumerate(ids)])
        return eng, {k: o.token_ids for k, o in outs.items()}

    _, plain = run()
    draft_dir = truncated_copy(default_model, tmp_path / "smollm-6-layers", layers=6)
    for method, opts in (("early-exit", {}), ("draft", {"speculative_draft_model": str(draft_dir)}), ("ngram", {})):
        spec_engine, spec = run(speculative_method=method, num_speculative_tokens=3, **opts)
        assert spec == plain, method
        assert spec_engine.stats.spec_proposed_tokens > 0, method


def test_useless_draft_stops_proposing(tiny_model):
    """A request whose draft guesses are almost never right gets no more of them from a model-based proposer
    (each costs a draft forward), but still one at a time from n-gram lookup (free)."""
    from worker.speculation import Speculation

    eng = plain_engine_of(tiny_model, speculative_method="early-exit", speculative_early_exit_layers=1)
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0))
    req.num_spec_proposed, req.num_spec_accepted = 20, 1
    assert eng.speculation._wanted(req) == 0
    ngram = Speculation.from_settings(eng.settings.model_copy(update={"speculative_method": "ngram"}))
    assert ngram._wanted(req) == 1
    req.num_spec_accepted = 3  # 15%: poor, not useless
    assert eng.speculation._wanted(req) == 1


def test_bench_spec_reports_every_method(tiny_model, tmp_path):
    """``python -m bench spec --methods ngram,early-exit,draft`` on a tiny model: a row per case with each
    method's acceptance and mean accepted length, greedy outputs identical to off."""
    from bench import spec

    result = spec.run(str(tiny_model), concurrencies=(1,), requests=2, max_tokens=8, kv_cache_memory="8MiB",
                      methods=("off", "ngram", "early-exit", "draft"), workloads=("mixed",), out=tmp_path,
                      log=lambda *_: None, speculative_draft_model=str(tiny_model))
    (row,) = result["rows"]
    for m in ("ngram", "early-exit", "draft"):
        assert row[f"{m}_identical"] and row[f"{m}_tok_s"] > 0
    assert row["draft_acceptance"] > 0.9 and row["draft_accepted_len"] > 0  # the model drafting for itself
    assert "early-exit acceptance" in spec.report(result)
