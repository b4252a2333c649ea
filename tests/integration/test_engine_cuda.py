"""LLMEngine on a CUDA GPU: the Triton attention kernels (and the torch path) inside the real engine, greedy
output token-identical to Hugging Face ``generate`` run on the same GPU in float32, through batching, chunked
prefill, prefix hits and preemption; seeded sampling drawn on the GPU is the same however the requests are
batched. Skipped where there is no CUDA device (CI has none); run on a lent GPU with
``pytest --noconftest tests/integration/test_engine_cuda.py``, which needs no database.
"""

from __future__ import annotations

import pytest
import torch

from inferq.settings import Settings
from tests.engine_fixtures import greedy_requests, greedy_workload, mismatches, run_all, seeded_requests
from worker.engine import LLMEngine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request, tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_hidden_layers=2)


@pytest.fixture(autouse=True)
def _exact_float32():
    """TF32 would round float32 products to a 10-bit mantissa in both engines, differently; turn it off."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def hf_greedy_cuda(model_dir, prompts, max_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    outs = []
    with torch.no_grad():
        for p, n in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=model.config.pad_token_id)
            outs.append(gen[0, len(p):].tolist())
    return outs


def cuda_engine(model_dir, **opts) -> LLMEngine:
    base = dict(model=str(model_dir), device="cuda", dtype="float32", block_size=4, kv_cache_memory="256KiB")
    return LLMEngine(Settings(**{**base, **opts}))


SCENARIOS = {
    "batched": dict(),
    "tiny_budget": dict(max_batched_tokens=7),
    "tiny_pool": dict(kv_cache_memory=str(30 * 2 * 2 * 4 * 2 * 16 * 4), max_batched_tokens=128),
}


@pytest.mark.parametrize("attention", ["triton", "torch"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_on_cuda_matches_hf_generate(tiny_model, scenario, attention):
    prompts, max_tokens = greedy_workload()
    expected = hf_greedy_cuda(tiny_model, prompts, max_tokens)

    engine = cuda_engine(tiny_model, attention_backend=attention, **SCENARIOS[scenario])
    assert engine.runner.device.type == "cuda"
    assert engine.runner.backend.name == attention
    differ = mismatches(run_all(engine, greedy_requests(prompts, max_tokens)), expected)
    assert not differ, f"{scenario}/{attention}: requests {differ} differ from HF generate on the GPU"
    if attention == "triton":  # decode steps replayed CUDA graphs (worker/cuda_graphs.py)
        assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    else:
        assert engine.runner.graphs is None
    if scenario == "tiny_pool":
        assert engine.stats.preemptions > 0
    else:
        assert engine.stats.cached_prompt_tokens > 0  # the shared system prompt was served from the cache


def test_seeded_sampling_on_cuda_is_batch_invariant(tiny_model):
    def sample(**opts):
        return {k: o.token_ids for k, o in run_all(cuda_engine(tiny_model, **opts), seeded_requests()).items()}

    together, alone = sample(), sample(max_num_seqs=1)
    assert together == alone
    assert len({tuple(v) for v in together.values()}) > 1


@pytest.mark.parametrize("attention", ["triton", "torch"])
def test_decode_ahead_on_cuda_matches_hf_generate(tiny_model, attention):
    """Decode ahead on the GPU takes the runner's generic window (one forward per token, no fused CPU step):
    each request alone, greedy output identical to HF on the GPU and to one-token steps, seeded sampling the
    same tokens, and the windows really ran (fewer engine steps than tokens)."""
    prompts, max_tokens = greedy_workload(n=6)
    max_tokens = [m + 20 for m in max_tokens]  # long enough for windows that cross blocks of 4
    expected = hf_greedy_cuda(tiny_model, prompts, max_tokens)

    def alone(decode_ahead_ms, reqs):
        eng = cuda_engine(tiny_model, attention_backend=attention, decode_ahead_ms=decode_ahead_ms)
        outs = {}
        for r in reqs:
            outs.update(run_all(eng, [r]))
        assert eng.block_manager.num_free == eng.block_manager.num_blocks
        return eng, outs

    plain_eng, plain = alone(0.0, greedy_requests(prompts, max_tokens))
    eng, ahead = alone(1000.0, greedy_requests(prompts, max_tokens))
    assert not mismatches(ahead, expected) and not mismatches(plain, expected)
    assert eng.stats.steps < plain_eng.stats.steps - sum(max_tokens) // 2
    assert eng.stats.spec_proposed_tokens == 0
    seeded = {k: o.token_ids for k, o in alone(1000.0, seeded_requests())[1].items()}
    assert seeded == {k: o.token_ids for k, o in alone(0.0, seeded_requests())[1].items()}


def test_seeded_sampling_same_with_and_without_cuda_graphs(tiny_model):
    """Graph replays (worker/cuda_graphs.py: padded buckets, one staged copy) sample what eager steps sample."""
    def sample(**opts):
        eng = cuda_engine(tiny_model, attention_backend="triton", **opts)
        outs = {k: o.token_ids for k, o in run_all(eng, seeded_requests()).items()}
        return outs, eng.runner.graphs

    (replayed, graphs), (eager, none) = sample(), sample(cuda_graph_max_batch=0)
    assert replayed == eager and graphs.replays > 0 and none is None
