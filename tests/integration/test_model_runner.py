"""ModelRunner (our forward pass + paged KV cache + sampler) against Hugging Face transformers on tiny random
Llama/Qwen2/Mistral checkpoints with grouped-query attention."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernels import cpu_gemm, packed_gemm
from scheduler.request import Request, SamplingParams
from tests.tiny_models import make_tiny_model
from worker.model_runner import ModelRunner
from worker.sampler import Sampler

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_model(root, "llama", num_hidden_layers=3),
        "qwen2": make_tiny_model(
            root, "qwen2", num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, hidden_size=96
        ),
        "mistral": make_tiny_model(root, "mistral", num_attention_heads=4, num_key_value_heads=1),
        "llama-tied-llama3rope-bias": make_tiny_model(
            root,
            "llama",
            name="tiny-llama-variant",
            tie_word_embeddings=True,
            attention_bias=True,
            rope_theta=500000.0,
            max_position_embeddings=256,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "llama-linear-rope": make_tiny_model(
            root, "llama", name="tiny-llama-linear", rope_scaling={"rope_type": "linear", "factor": 2.0}
        ),
    }


_hf_cache: dict = {}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    if path not in _hf_cache:
        _hf_cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf_cache[path]


@torch.no_grad()
def hf_last_logits(path, token_ids):
    return hf_model(path)(torch.tensor([token_ids])).logits[0, -1].float()


def make_runner(path, **kw):
    kw.setdefault("kv_cache_bytes", 1 << 20)
    return ModelRunner(path, block_size=BLOCK, device="cpu", **kw)


class BlockPool:
    """A stand-in block manager: shuffled block ids so tables are non-contiguous."""

    def __init__(self, num_blocks, seed=0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def give(self, req, total_tokens):
        need = math.ceil(total_tokens / BLOCK)
        while len(req.block_table) < need:
            req.block_table.append(self.free.pop())


def advance(req, n, token):
    req.num_computed_tokens += n
    if token is not None:
        req.output_token_ids.append(token)


def prompts_for(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# Both CPU attention paths: "cpu" (the C kernels, on x86 every shape here) and "torch" (the portable path a
# machine without a C compiler runs, otherwise never exercised on x86; there the model's C norms, RoPE and
# SwiGLU are turned off too).
ATTENTION = ["cpu", "torch"]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "mistral", "llama-tied-llama3rope-bias", "llama-linear-rope"]
)
def test_prefill_and_decode_logits_match_hf(tiny_dirs, arch, attention):
    path = tiny_dirs[arch]
    runner = make_runner(path, attention_backend=attention)
    assert runner.backend.name == attention
    runner.model.use_c_ops(attention != "torch")  # the portable run: the model's norms, RoPE, SwiGLU in torch too
    pool = BlockPool(runner.num_blocks, seed=1)
    lengths = [1, 4, 7, 13]  # includes a one-token prompt and block-boundary lengths
    reqs = [
        Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6))
        for i, p in enumerate(prompts_for(runner.info.vocab_size, lengths))
    ]
    steps = 6
    for r in reqs:
        pool.give(r, r.num_prompt_tokens + steps)
    for step in range(steps):
        batch = [(r, r.num_tokens - r.num_computed_tokens) for r in reqs]
        logits = runner.compute_logits(batch)
        for (r, n), lg in zip(batch, logits, strict=True):
            ref = hf_last_logits(path, r.all_token_ids)
            torch.testing.assert_close(
                lg, ref, atol=1e-4, rtol=1e-4, msg=f"{arch} step {step} {r.request_id}"
            )
            tok = int(lg.argmax())
            assert tok == int(ref.argmax())
            advance(r, n, tok)


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_with_chunked_prefill_and_mixed_batches(tiny_dirs, arch, attention):
    path = tiny_dirs[arch]
    vocab = 384
    prompts = prompts_for(vocab, [9, 17, 3, 1], seed=7)
    new_tokens = 8

    # Oracle: HF greedy by full recomputation (no cache involved).
    expected = []
    for p in prompts:
        ids = list(p)
        for _ in range(new_tokens):
            ids.append(int(hf_last_logits(path, ids).argmax()))
        expected.append(ids[len(p) :])

    runner = make_runner(path, attention_backend=attention)
    pool = BlockPool(runner.num_blocks, seed=3)
    reqs = [
        Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=new_tokens))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        pool.give(r, r.num_prompt_tokens + new_tokens)
    # Requests join at different steps; prefills are chunked to at most 5 tokens per step, so batches mix
    # decodes, first chunks and chunks with earlier context.
    start_step = [0, 1, 2, 4]
    step = 0
    while any(r.num_output_tokens < new_tokens for r in reqs):
        batch = []
        for r, s0 in zip(reqs, start_step, strict=True):
            if step < s0 or r.num_output_tokens >= new_tokens:
                continue
            batch.append((r, min(5, r.num_tokens - r.num_computed_tokens)))
        random.Random(step).shuffle(batch)
        out = runner.execute(batch)
        assert len(out) == len(batch)
        for (r, n), tok in zip(batch, out, strict=True):
            if r.num_computed_tokens + n < r.num_tokens:
                assert tok is None  # a prefill chunk that does not reach the end samples nothing
            else:
                assert tok is not None
            advance(r, n, tok)
        step += 1
        assert step < 100
    for r, exp in zip(reqs, expected, strict=True):
        assert r.output_token_ids == exp, r.request_id


def test_runner_does_not_mutate_requests_and_reports_info(tiny_dirs):
    runner = make_runner(tiny_dirs["qwen2"], kv_cache_bytes=200_000)
    info = runner.info
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.vocab_size) == (2, 2, 16, 384)
    assert info.max_model_len == 512 and info.dtype == "float32" and info.eos_token_ids
    per_block = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, layers, tokens, kv heads, head dim, fp32
    assert runner.num_blocks == 200_000 // per_block
    assert runner.kv_caches[0][0].shape == (runner.num_blocks, BLOCK, 2, 16)
    r = Request("x", [5, 6, 7, 8, 9], SamplingParams(temperature=0))
    r.block_table = [3, 1]
    before = (list(r.prompt_token_ids), list(r.output_token_ids), r.num_computed_tokens, list(r.block_table))
    assert runner.execute([(r, 3)]) == [None]
    assert (
        list(r.prompt_token_ids),
        list(r.output_token_ids),
        r.num_computed_tokens,
        list(r.block_table),
    ) == before
    assert runner.execute([]) == []


def test_runner_rejects_bad_batches(tiny_dirs):
    runner = make_runner(tiny_dirs["llama"])
    r = Request("x", list(range(3, 12)), SamplingParams(temperature=0))
    r.block_table = [0]  # 9 tokens need 3 blocks of 4
    with pytest.raises(ValueError, match="block table"):
        runner.execute([(r, 9)])
    r.block_table = [0, 1, 2]
    with pytest.raises(ValueError, match="exceeds"):
        runner.execute([(r, 10)])
    with pytest.raises(ValueError, match="smaller than one block"):
        make_runner(tiny_dirs["llama"], kv_cache_bytes=10)


def test_bfloat16_runner_close_to_float32(tiny_dirs):
    path = tiny_dirs["llama"]
    prompt = prompts_for(384, [11], seed=5)[0]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(path, dtype=dtype)
        r = Request("x", prompt, SamplingParams(temperature=0))
        r.block_table = [4, 2, 0]
        logits[dtype] = runner.compute_logits([(r, len(prompt))])[0]
    assert logits["bfloat16"].dtype == torch.float32
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], atol=0.15, rtol=0.05)


def test_bfloat16_c_ops_match_the_torch_ops(tiny_dirs):
    """A bfloat16 model (where it computes in bfloat16) runs its norms, RoPE and SwiGLU as C calls; the logits
    stay within bfloat16 rounding of the torch ops' (each C result is rounded once, torch's after each op)."""
    runner = make_runner(tiny_dirs["llama"], dtype="bfloat16")
    model = runner.model
    if model.dtype != torch.bfloat16 or model._c_ops is None:
        pytest.skip("this CPU computes bfloat16 models in float32 (no native bfloat16 matmul), or no C compiler")
    prompt = prompts_for(200, [11], seed=6)[0]
    logits = {}
    for c_ops in (True, False):
        model.use_c_ops(c_ops)
        r = Request("x", prompt, SamplingParams(temperature=0))
        r.block_table = [4, 2, 0]
        logits[c_ops] = runner.compute_logits([(r, len(prompt))])[0]
    model.use_c_ops(True)
    assert not torch.equal(logits[True], logits[False])  # the C path really ran (a different rounding)
    torch.testing.assert_close(logits[True], logits[False], atol=0.1, rtol=0.05)


def _greedy_logits(runner, prompt, chunks, pool_seed):
    """Run one greedy request through ``chunks`` (tokens per step); the logits of every step that samples."""
    r = Request("x", prompt, SamplingParams(temperature=0))
    BlockPool(runner.num_blocks, seed=pool_seed).give(r, len(prompt) + len(chunks))
    out = []
    for n in chunks:
        lg = runner.compute_logits([(r, n)])[0]
        if lg is not None:
            out.append(lg)
        advance(r, n, int(lg.argmax()) if lg is not None else None)
    return out


@pytest.mark.skipif(not packed_gemm.available(), reason="no AVX2+FMA CPU or no C compiler")
def test_bfloat16_without_native_matmul_stores_bfloat16_and_computes_float32(tiny_dirs, monkeypatch):
    """On a CPU without native bfloat16 matmul (simulated here where it has one), --dtype bfloat16 keeps every
    projection (the tied head too) as bfloat16 panels of the packed kernel and the KV cache in bfloat16, and
    computes in float32: the logits equal a float32 model whose weights were rounded to bfloat16 with a
    bfloat16 cache."""
    from worker import model as model_module

    monkeypatch.setattr(model_module, "cpu_half_gemm_is_native", lambda: False)
    path = tiny_dirs["qwen2"]  # attention biases: they stay float32
    half = make_runner(path, dtype="bfloat16")
    m = half.model
    assert m.dtype == torch.float32 and m.weight_dtype == torch.bfloat16
    linears = [m.lm_head] + [lin for layer in m.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(lin.layout == "pk" and lin.weight.dtype == torch.bfloat16 for lin in linears)
    assert half.kv_caches[0][0].dtype == torch.bfloat16
    rounded = make_runner(path, dtype="float32", kv_cache_dtype="bfloat16")
    for lin_r, lin_h in zip([rounded.model.lm_head] + [x for layer in rounded.model.layers
                                                       for x in (layer.qkv, layer.o, layer.gate_up, layer.down)],
                            linears, strict=True):
        w = lin_r.w_oi.bfloat16().float()
        lin_r.weight = cpu_gemm.plan(w, lin_r.bias, packed_only=True).weight
        lin_r.layout, lin_r.forms = "pk", ("pk",) * len(lin_r.forms)
        torch.testing.assert_close(lin_h.w_oi.float(), w, rtol=0, atol=0)
    prompt = prompts_for(half.info.vocab_size, [21], seed=3)[0]
    got = {name: _greedy_logits(runner, prompt, (12, 9, 1, 1, 1), pool_seed=4)  # 2 prefill chunks, 3 decodes
           for name, runner in (("half", half), ("rounded", rounded))}
    assert len(got["half"]) == 4
    for a, b in zip(got["half"], got["rounded"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bfloat16_kv_cache_with_float32_model(tiny_dirs):
    """kv_cache_dtype=bfloat16 under a float32 model: twice the blocks for the same budget, bfloat16 pools, and
    logits within bfloat16 rounding of the float32 cache's, through a chunked prefill (earlier context read
    back from the cache) and decode steps (the CPU decode kernel's bfloat16 path)."""
    path = tiny_dirs["qwen2"]
    full = make_runner(path)
    half = make_runner(path, kv_cache_dtype="bfloat16")
    assert half.num_blocks == 2 * full.num_blocks
    assert half.kv_caches[0][0].dtype == torch.bfloat16 and full.kv_caches[0][0].dtype == torch.float32
    assert half.model.dtype == torch.float32
    prompt = prompts_for(half.info.vocab_size, [13], seed=7)[0]
    # a prefill in two chunks (the first samples nothing), then decodes
    got = {name: _greedy_logits(runner, prompt, (8, 5, 1, 1, 1, 1), pool_seed=2)
           for name, runner in (("full", full), ("half", half))}
    assert len(got["full"]) == 5
    for step, (a, b) in enumerate(zip(got["full"], got["half"], strict=True)):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, atol=0.05, rtol=0.05, msg=f"step {step}")
    assert not torch.equal(got["full"][-1], got["half"][-1])  # the cache really rounds


def test_kv_cache_dtype_other_than_the_model_is_cpu_only(tiny_dirs, monkeypatch):
    from worker import model_runner

    monkeypatch.setattr(model_runner, "resolve_device", lambda device: torch.device("meta"))
    with pytest.raises(ValueError, match="CPU only"):
        make_runner(tiny_dirs["llama"], kv_cache_dtype="bfloat16", dtype="float32")


def _sample_run(runner, pool_seed, companions, params, steps=6):
    """Generate ``steps`` tokens for a seeded request, sharing each step with ``companions`` other requests."""
    pool = BlockPool(runner.num_blocks, seed=pool_seed)
    target = Request("t", [5, 9, 11, 40, 41, 42], params)
    others = [
        Request(f"o{i}", prompts_for(384, [3 + i], seed=i)[0], SamplingParams(temperature=1.0))
        for i in range(companions)
    ]
    for r in [target, *others]:
        pool.give(r, r.num_prompt_tokens + steps)
    for _ in range(steps):
        batch = [(r, r.num_tokens - r.num_computed_tokens) for r in [*others, target]]
        for (r, n), tok in zip(batch, runner.execute(batch), strict=True):
            advance(r, n, tok)
    return target.output_token_ids


def test_seeded_sampling_reproducible_across_batches_and_preemption(tiny_dirs):
    runner = make_runner(tiny_dirs["llama"], kv_cache_bytes=4 << 20)
    params = SamplingParams(temperature=1.5, top_p=0.95, top_k=50, seed=1234, max_tokens=6)
    alone = _sample_run(runner, 0, 0, params)
    crowded = _sample_run(runner, 1, 5, params)
    assert alone == crowded
    other_seed = _sample_run(runner, 0, 0, SamplingParams(temperature=1.5, top_p=0.95, top_k=50, seed=99))
    assert other_seed != alone  # a different seed gives a different (high-temperature) sample

    # Preemption: recompute the request from scratch (prompt + outputs so far as one prefill) and
    # continue — the remaining tokens are the same.
    pool = BlockPool(runner.num_blocks, seed=5)
    r = Request("t", [5, 9, 11, 40, 41, 42], params)
    r.output_token_ids = list(alone[:3])
    pool.give(r, r.num_tokens + 3)
    for _ in range(3):
        n = r.num_tokens - r.num_computed_tokens
        advance(r, n, runner.execute([(r, n)])[0])
    assert r.output_token_ids == alone


def test_sampler_greedy_topk_topp_and_distribution():
    s = Sampler("cpu", seed=0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert s.sample(logits, [greedy, greedy], [0, 0]) == [1, 0]
    # top_k=1 is greedy whatever the temperature; a tiny top_p keeps only the most likely token.
    for i in range(20):
        assert s.sample(
            logits, [SamplingParams(temperature=2.0, top_k=1), SamplingParams(top_p=0.01)], [i, i]
        ) == [1, 0]
    # top_k=2 never picks outside the two best tokens.
    picks = {s.sample(logits[:1], [SamplingParams(temperature=5.0, top_k=2)], [0])[0] for _ in range(200)}
    assert picks == {1, 3}
    # Sampled frequencies follow softmax(logits / T) (seeded rows, varying index).
    row = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    p = SamplingParams(temperature=1.0, seed=7)
    counts = torch.zeros(4)
    n = 4000
    for i in range(n):
        counts[s.sample(row, [p], [i])[0]] += 1
    torch.testing.assert_close(counts / n, torch.softmax(row[0], 0), atol=0.03, rtol=0)
    counts = torch.zeros(4)  # unseeded rows too (the sampler's own generator)
    for i in range(n):
        counts[s.sample(row, [SamplingParams(temperature=1.0)], [i])[0]] += 1
    torch.testing.assert_close(counts / n, torch.softmax(row[0], 0), atol=0.03, rtol=0)
    # Greedy rows in a mixed batch stay argmax; seeded rows do not depend on their neighbours.
    a = s.sample(torch.cat([logits, row]), [greedy, SamplingParams(seed=3), p], [0, 0, 5])
    b = s.sample(row, [p], [5])
    assert a[0] == 1 and a[2] == b[0]


def test_the_race_drawn_before_the_step_gives_the_samplers_tokens():
    """``Sampler.race`` draws the noise ``sample`` would (seeded rows: the same tokens), and each row's token is
    the argmax of logits + its offsets (what a screened head reads, kernels/head_screen.py), a top-k row's
    screen asks for its k largest; rows with a top-p cut, a top-k above 1024 or a top-k at a tiny temperature
    get no race."""
    s = Sampler("cpu", seed=0)
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=1.3, seed=9)]
    for i in range(200):
        logits = torch.randn(3, 50, generator=gen) * 3
        race = s.race(params, [i, i, i + 1], 50)
        assert race is not None and race.log_q.shape == (2, 50) and not race.screen.offsets[0].any()
        assert race.screen.top_k is None
        tokens = s.sample(logits, params, [i, i, i + 1], race)
        assert tokens == s.sample(logits, params, [i, i, i + 1])
        assert tokens == (logits + race.screen.offsets).argmax(dim=1).tolist()
    topk = s.race([params[1], SamplingParams(top_k=5)], [0, 0], 50)  # a top-k row: its k (its offsets unread)
    assert topk is not None and topk.screen.top_k.tolist() == [0, 5]
    for cut in (SamplingParams(top_k=2000), SamplingParams(top_p=0.9), SamplingParams(temperature=0.01, top_k=5)):
        assert s.race([params[1], cut], [0, 0], 3000) is None
    assert s.race([SamplingParams(temperature=0.01)], [0], 50) is not None  # no cut: never divides by T
    assert s.race([params[0]], [0], 50) is None  # greedy alone: nothing to draw
