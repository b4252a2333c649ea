"""The default model (SmolLM2-135M-Instruct, real weights converted from the packaged GGUF) through the whole
engine, against Hugging Face transformers greedy ``generate``, token for token over two dozen new tokens, in
the scheduling regimes where a bug hides from a one-batch comparison (tests/integration/test_loader.py):

* chunked prefill: a step budget of 16 tokens, so every prompt is prefilled in several chunks that attend to
  the keys/values of the chunks before them;
* preemption: a KV pool too small for the two requests to grow together, so one is evicted and recomputed
  (prefix cache on, as in production: evicted blocks may be revived or reused);
* prefix-cache hits: the two prompts share a long system prompt, and one runs again afterwards.

One engine, built once (the slow part), runs all three. The converted model is reused from an earlier
module of this run (test_loader.py converts it too) or from INFERQ_TEST_MODEL_CACHE when set."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from inferq.settings import Settings
from scheduler.request import Request, SamplingParams
from worker.engine import LLMEngine
from worker.loader import DEFAULT_MODEL, MARKER, model_info, resolve_model

pytestmark = pytest.mark.integration

NEW_TOKENS = 24
BLOCK = 16
STEP_BUDGET = 16
SYSTEM = ("You are a careful assistant for a public library. Answer in plain English, in complete sentences, "
          "and explain your reasoning step by step so that a curious twelve year old can follow it.")
QUESTIONS = ["Why is the sky blue?", "How do bees make honey?"]


@pytest.fixture(scope="module")
def smollm_dir(tmp_path_factory) -> Path:
    """The converted default model: INFERQ_TEST_MODEL_CACHE, else a copy this run converted already, else a
    fresh conversion (about half a minute)."""
    reuse = os.environ.get("INFERQ_TEST_MODEL_CACHE")
    if reuse:
        cache = Path(reuse)
    else:
        done = sorted(tmp_path_factory.getbasetemp().glob(f"*/{DEFAULT_MODEL}/{MARKER}"))
        cache = done[0].parent.parent if done else tmp_path_factory.mktemp("models")
    return resolve_model(DEFAULT_MODEL, Settings(model_cache_dir=cache))


@pytest.fixture(scope="module")
def prompts(smollm_dir) -> list[list[int]]:
    """Chat prompts of ~60 tokens that share the system prompt (several full KV blocks)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    out = []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF greedy continuations (they stop at EOS; the engine ignores EOS, so compare that prefix)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _pool_bytes(model_dir: Path, prompts: list[list[int]]) -> tuple[int, int]:
    """(blocks, bytes) of a KV pool that holds either request to its end, but not both together."""
    info = model_info(model_dir)
    per_block = info.num_layers * 2 * info.num_kv_heads * info.head_dim * BLOCK * 4  # K and V, float32
    need = [-(-(len(p) + NEW_TOKENS - 1) // BLOCK) for p in prompts]  # the last token's K/V is never written
    shared = 0
    while prompts[0][shared] == prompts[1][shared]:
        shared += 1
    blocks = max(need) + 1
    assert shared >= 2 * BLOCK and blocks < sum(need) - shared // BLOCK  # shared blocks counted once
    return blocks, blocks * per_block


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))


def test_chunked_prefill_preemption_and_prefix_hits_match_hf(smollm_dir, prompts):
    expected = hf_greedy(smollm_dir, prompts)
    assert min(len(e) for e in expected) >= 16, expected  # long answers: the comparison covers dozens of tokens
    assert min(len(p) for p in prompts) > 2 * STEP_BUDGET  # every prompt is prefilled in three chunks or more
    blocks, pool = _pool_bytes(smollm_dir, prompts)
    engine = LLMEngine(Settings(model=str(smollm_dir), device="cpu", dtype="float32", block_size=BLOCK,
                                kv_cache_memory=str(pool), max_batched_tokens=STEP_BUDGET))
    assert engine.runner.num_blocks == blocks

    for i, p in enumerate(prompts):  # together: chunked prefill under KV pressure, the system prompt shared
        engine.add_request(_request(f"together{i}", p))
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert engine.stats.preemptions > 0  # requests really were evicted and recomputed
    engine.add_request(_request("again1", prompts[1]))  # alone, after the others: served from the cache
    outs.update({o.request_id: o for o in engine.run_until_done()})
    assert outs["again1"].usage.cached_prompt_tokens >= 2 * BLOCK

    mismatches = {}
    for rid, i in [(f"together{i}", i) for i in range(len(prompts))] + [("again1", 1)]:
        got = outs[rid].token_ids
        if len(got) != NEW_TOKENS or got[: len(expected[i])] != expected[i]:
            mismatches[rid] = (got, expected[i])
    assert not mismatches, mismatches
