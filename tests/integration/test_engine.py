"""LLMEngine end to end.

* With a fake runner (fast, no torch model): the fake "model" reads its context back through the paged
  KV cache, so block tables, chunked prefill, preemption and prefix hits must all be right for outputs
  to match the reference.
* With the real ModelRunner on tiny random Llama / Qwen2 checkpoints (GQA): greedy outputs must be
  token-identical to Hugging Face ``generate`` in every scheduling regime (marked ``integration``).
"""

from __future__ import annotations

import random
import time

import pytest

from inferq.settings import Settings
from scheduler.request import FinishReason, Request, SamplingParams, Tier
from tests.engine_fixtures import (
    FakeRunner,
    greedy_requests,
    greedy_workload,
    mismatches,
    reference,
    run_all,
    seeded_requests,
)
from worker.engine import LLMEngine


def fake_engine(num_blocks=64, block_size=4, tokenizer=None, vocab=97, **opts) -> LLMEngine:
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size)
    runner.info.vocab_size = vocab
    opts.setdefault("block_size", block_size)
    return LLMEngine(Settings(**opts), runner=runner, tokenizer=tokenizer)


def mixed_prompts(n=24, seed=0, vocab=97, shared=12):
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(shared)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 5, 9, 17, 30]))]
        prompts.append(system + tail if i % 2 else tail)
    return prompts


SCENARIOS = {
    "default": dict(),
    "alone": dict(max_num_seqs=1),
    "tiny_budget": dict(max_batched_tokens=5),
    "tiny_pool": dict(num_blocks=20, max_batched_tokens=64),
    "no_prefix_cache": dict(enable_prefix_cache=False),
    "static": dict(policy="static", max_num_seqs=5),
    "static_tiny_pool": dict(policy="static", num_blocks=20, max_num_seqs=8),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fake_engine_matches_reference(name):
    engine = fake_engine(**SCENARIOS[name])
    prompts = mixed_prompts()
    reqs = [Request(f"q{i}", p, SamplingParams(max_tokens=3 + i % 7), tier=Tier.BATCH if i % 3 else Tier.INTERACTIVE)
            for i, p in enumerate(prompts)]
    outs = run_all(engine, reqs)
    for i, p in enumerate(prompts):
        assert outs[f"q{i}"].token_ids == reference(p, 3 + i % 7), f"request {i}"
        assert outs[f"q{i}"].finish_reason is FinishReason.LENGTH
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    st = engine.stats
    assert st.requests == len(prompts) and st.completion_tokens == sum(3 + i % 7 for i in range(len(prompts)))
    if name == "tiny_pool":
        assert st.preemptions > 0
    if name in ("default", "tiny_budget"):
        assert st.cached_prompt_tokens > 0 and st.prefix_hit_rate > 0
    if name == "no_prefix_cache":
        assert st.cached_prompt_tokens == 0
    if name == "tiny_budget":
        assert max(sum(n for _, n in call) for call in engine.runner.calls) <= 5


def test_compute_seconds_add_up_to_busy_time():
    engine = fake_engine(max_batched_tokens=16, num_blocks=24)
    reqs = [Request(f"q{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(mixed_prompts())]
    engine.add_request(reqs[0])
    engine.step()
    engine.abort("q0")  # aborted requests keep what they were charged
    outs = run_all(engine, reqs[1:])
    assert outs["q0"].finish_reason is FinishReason.ABORT
    total = sum(o.usage.compute_seconds for o in outs.values())
    assert engine.stats.busy_seconds > 0
    assert total == pytest.approx(engine.stats.busy_seconds, rel=0.01)
    u = outs["q5"].usage
    assert u.prompt_tokens == len(reqs[5].prompt_token_ids) and u.completion_tokens == 6
    assert u.time_to_first_token is not None and u.time_to_first_token >= u.queue_seconds >= 0
    assert u.prefill_seconds >= 0 and u.decode_seconds >= 0
    st = engine.stats.to_dict()
    assert 0 < st["kv_usage_peak"] <= 1 and 0 <= st["kv_usage_mean"] <= st["kv_usage_peak"]
    assert 0 <= st["kv_waste"] < 1 and st["requests"] == len(reqs)


def test_abort_and_deadline_through_engine():
    engine = fake_engine()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=50))
    b.deadline = time.monotonic() + 0.05
    engine.add_request(a)
    engine.add_request(b)
    engine.step()
    assert engine.abort("a") and not engine.abort("nope")
    assert engine.block_manager.num_free < engine.block_manager.num_blocks  # b still holds blocks
    time.sleep(0.06)
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert outs["a"].finish_reason is FinishReason.ABORT and len(outs["a"].token_ids) == 1
    assert outs["b"].finish_reason is FinishReason.DEADLINE
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_rejections_raise_clear_errors():
    engine = fake_engine(num_blocks=4)  # 16 KV slots
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(Request("x", [1] * 10, SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        engine.add_request(Request("y", [1, 500], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="context"):
        fake_engine(max_model_len=8).add_request(Request("z", [1] * 9, SamplingParams(max_tokens=1)))
    assert not engine.has_unfinished()


def test_capacity_reports_room():
    engine = fake_engine(num_blocks=8, max_num_seqs=3)
    assert (engine.capacity().requests, engine.capacity().tokens) == (3, 32)
    engine.add_request(Request("a", [1] * 9, SamplingParams(max_tokens=2)))
    assert engine.capacity().requests == 2


def test_stop_strings_and_eos_with_tokenizer():
    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer()
    vocab = len(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.encode("Once upon a time", add_special_tokens=False)
    ref = [t for t in reference(prompt, 40, vocab) if t != eos][:40]
    ref_text = tok.decode(reference(prompt, 40, vocab), skip_special_tokens=True)
    assert len(ref_text) > 10
    stop = ref_text[5:8]
    engine = fake_engine(tokenizer=tok, vocab=vocab, num_blocks=64)
    engine.runner.info.eos_token_ids = ()
    out = run_all(engine, [Request("s", prompt, SamplingParams(max_tokens=40, stop=[stop]))])["s"]
    expected = ref_text[: ref_text.find(stop)]
    assert out.finish_reason is FinishReason.STOP and out.text == expected
    assert ref  # sanity
    # Streamed deltas equal the final text and never show the stop string.
    engine2 = fake_engine(tokenizer=tok, vocab=vocab)
    engine2.add_request(Request("s", prompt, SamplingParams(max_tokens=40, stop=[stop])))
    deltas = []
    while engine2.has_unfinished():
        deltas += [o.text_delta for o in engine2.step()]
    assert "".join(deltas) == expected
    # EOS ends a request with STOP; the EOS token is in token_ids but not in the text.
    first = reference(prompt, 1, vocab)[0]
    engine3 = fake_engine(tokenizer=tok, vocab=vocab)
    engine3.runner.info.eos_token_ids = (first,)
    out = run_all(engine3, [Request("e", prompt, SamplingParams(max_tokens=5))])["e"]
    assert out.finish_reason is FinishReason.STOP and out.token_ids == [first] and out.text == ""


def test_encode_variants():
    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer()
    engine = fake_engine(tokenizer=tok, vocab=len(tok))
    assert engine.encode(prompt_ids=[1, 2]) == [1, 2]
    assert engine.encode(prompt="Hello world") == tok.encode("Hello world")
    chat = engine.encode(messages=[{"role": "user", "content": "Hi"}])
    assert tok.decode(chat) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError):
        engine.encode(prompt="a", prompt_ids=[1])


# --- the real model runner vs Hugging Face transformers ----------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request, tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_hidden_layers=2)


def hf_greedy(model_dir, prompts, max_tokens):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p, n in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=model.config.pad_token_id)
            outs.append(gen[0, len(p):].tolist())
    return outs


def real_engine(model_dir, **opts) -> LLMEngine:
    base = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=4, kv_cache_memory="256KiB",
                torch_threads=1)
    return LLMEngine(Settings(**{**base, **opts}))


def kv_bytes(blocks: int) -> str:
    return str(blocks * 2 * 2 * 4 * 2 * 16 * 4)  # layers x K/V x block_size x kv_heads x head_dim x fp32


REAL_SCENARIOS = {
    "batched": dict(),
    "alone": dict(max_num_seqs=1),
    "tiny_budget": dict(max_batched_tokens=7),
    "tiny_pool": dict(kv_cache_memory=kv_bytes(30), max_batched_tokens=128),
    "static": dict(policy="static", max_num_seqs=6),
}


@pytest.mark.integration
@pytest.mark.parametrize("attention", ["cpu", "torch"])  # the C kernels, and the portable torch path
@pytest.mark.parametrize("scenario", list(REAL_SCENARIOS))
def test_greedy_matches_hf_generate(tiny_model, scenario, attention):
    prompts, max_tokens = greedy_workload()
    expected = hf_greedy(tiny_model, prompts, max_tokens)

    engine = real_engine(tiny_model, attention_backend=attention, **REAL_SCENARIOS[scenario])
    assert engine.runner.backend.name == attention
    outs = run_all(engine, greedy_requests(prompts, max_tokens))
    differ = mismatches(outs, expected)
    assert not differ, f"{scenario}: requests {differ} differ from HF generate"
    st = engine.stats
    if scenario == "tiny_pool":
        assert st.preemptions > 0
    if scenario in ("batched", "tiny_budget"):
        assert st.cached_prompt_tokens > 0  # the shared system prompt was served from the cache
    assert sum(o.usage.compute_seconds for o in outs.values()) == pytest.approx(st.busy_seconds, rel=0.01)


@pytest.mark.integration
def test_seeded_sampling_reproducible_across_batches(tiny_model):
    def sample(**opts):
        engine = real_engine(tiny_model, **opts)
        return {k: o.token_ids for k, o in run_all(engine, seeded_requests()).items()}, engine.stats

    together, _ = sample()
    alone, _ = sample(max_num_seqs=1)
    squeezed, squeezed_stats = sample(max_batched_tokens=5, kv_cache_memory=kv_bytes(14))
    assert squeezed_stats.preemptions > 0  # the squeeze really preempted, so the draws survived a recompute
    assert together == alone == squeezed
    assert len({tuple(v) for v in together.values()}) > 1


@pytest.mark.integration
def test_real_engine_text_prompts_and_chat(tiny_model):
    engine = real_engine(tiny_model)
    ids = engine.encode(messages=[{"role": "user", "content": "Hello world!"}])
    r1 = Request("c", ids, SamplingParams(max_tokens=6, temperature=0))
    r2 = Request("t", engine.encode(prompt="The quick brown fox"), SamplingParams(max_tokens=6, temperature=0))
    outs = run_all(engine, [r1, r2])
    for o in outs.values():
        assert o.text == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)
