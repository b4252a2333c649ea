"""The fused decode step (kernels/decode_step.py, csrc/decode_step.c) against the op-by-op forward it replaces.

The fused step chains the same kernels in the same order, so with the same build its logits must equal the
op-by-op forward's bit for bit; a variant build (AVX2 tiles on an AVX-512 machine) or the portable attention
loops sum in another order and must agree to float32 rounding. Every case also checks the fused call really
ran (its step counter) and that steps it does not take (prefill chunks) still run op by op.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernels import cpu_gemm, decode_step, packed_gemm
from scheduler.request import Request, SamplingParams
from tests.tiny_models import make_tiny_model
from worker.model_runner import ModelRunner

# where the packed GEMM builds, so must the fused step (a failed build fails here, not skips)
pytestmark = pytest.mark.skipif(not packed_gemm.available(), reason="no AVX2+FMA CPU or no C compiler")


def test_the_library_builds():
    assert decode_step.load() is not None

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-fused")
    return {
        "llama": make_tiny_model(root, "llama", num_hidden_layers=3),
        # attention biases (the qkv product's bias) and 3 query heads per KV head
        "qwen2": make_tiny_model(root, "qwen2", num_hidden_layers=2, num_attention_heads=6,
                                 num_key_value_heads=2, hidden_size=96),
    }


def _pack(lin) -> None:
    if lin.layout != "pk":
        lin.weight = cpu_gemm.plan(lin.w_oi, lin.bias, packed_only=True).weight
        lin.layout, lin.forms = "pk", ("pk",) * len(lin.forms)


def packed_runner(path, head: bool = True, **kw) -> ModelRunner:
    """A runner whose every projection is in the packed layout (the planner may keep tiny shapes in a BLAS
    layout, which the fused step does not read); the LM head too unless ``head`` is False (the fused step then
    leaves the head to the caller)."""
    kw.setdefault("kv_cache_bytes", 1 << 20)
    runner = ModelRunner(path, block_size=BLOCK, device="cpu", **kw)
    for layer in runner.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            _pack(getattr(layer, name))
    lm_head = runner.model.lm_head
    if head:
        _pack(lm_head)
    else:  # a plain [out, in] weight through torch's matmul (no panels for the decode bucket either)
        lm_head.weight, lm_head.layout, lm_head.forms = lm_head.w_oi.contiguous(), "oi", ("xw",) * len(lm_head.forms)
        lm_head.decode_panels = None
    runner.model.use_decode_step(True)
    return runner


def _give_blocks(reqs, total, num_blocks, seed):
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # scattered, non-contiguous block tables
    for r in reqs:
        while len(r.block_table) < math.ceil(total / BLOCK):
            r.block_table.append(free.pop())


def decode_logits(runner, prompts, steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Prefill each prompt alone, then ``steps`` decode steps of all of them together; per step the logits of
    every request."""
    rng = random.Random(seed)
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    _give_blocks(reqs, max(map(len, prompts)) + steps + 1, runner.num_blocks, seed)
    for r in reqs:
        lg = runner.compute_logits([(r, len(r.prompt_token_ids))])[0]
        r.num_computed_tokens += len(r.prompt_token_ids)
        r.output_token_ids.append(int(lg.argmax()))
    out = []
    for _ in range(steps):
        logits = runner.compute_logits([(r, 1) for r in reqs])
        out.append(logits)
        for r, lg in zip(reqs, logits, strict=True):
            r.num_computed_tokens += 1
            r.output_token_ids.append(int(lg.argmax()) if rng.random() < 0.8 else rng.randrange(3, 200))
    return out


def fused_and_op_by_op(path, prompts, steps=5, **kw):
    runner = packed_runner(path, **kw)
    model = runner.model
    model.use_decode_step(False)
    plain = decode_logits(runner, prompts, steps)
    model.use_decode_step(True)
    fused = decode_logits(runner, prompts, steps)
    assert model._decode_step is not None and model._decode_step.steps >= steps
    assert model._decode_step.has_head == kw.get("head", True)
    return plain, fused


def prompts(n, vocab=200, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 19))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch,head", [(1, True), (3, True), (16, True), (1, False), (3, False)])
def test_fused_step_is_bit_identical_to_the_op_by_op_forward(tiny_dirs, arch, batch, head):
    """head: the final norm and the LM head inside the fused call (the head in panels), or after it."""
    plain, fused = fused_and_op_by_op(tiny_dirs[arch], prompts(batch, seed=batch), head=head)
    for step, (a, b) in enumerate(zip(plain, fused, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"step {step}: max diff {(x - y).abs().max()}"


def test_bfloat16_panels_and_cache(tiny_dirs, monkeypatch):
    """bfloat16 weights under float32 arithmetic (a CPU without native bfloat16 matmul) and a bfloat16 cache:
    the fused step widens the same panels and rounds the new keys and values as the op-by-op path does."""
    from worker import model as model_module

    monkeypatch.setattr(model_module, "cpu_half_gemm_is_native", lambda: False)
    plain, fused = fused_and_op_by_op(tiny_dirs["qwen2"], prompts(3), dtype="bfloat16")
    runner = packed_runner(tiny_dirs["qwen2"], dtype="bfloat16")
    assert runner.model.layers[0].qkv.weight.dtype == torch.bfloat16
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    for a, b in zip(plain, fused, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_steps_of_too_many_tokens_run_op_by_op(tiny_dirs):
    """More rows than MAX_ROWS (here: long prefills, then 17 decodes at once): the op-by-op forward (the step
    counter stays); a small step after them is fused again."""
    runner = packed_runner(tiny_dirs["llama"])
    long_prompts = [p * 2 for p in prompts(decode_step.MAX_ROWS + 1, seed=3) if len(p) * 2 > decode_step.MAX_ROWS]
    assert len(long_prompts) > decode_step.MAX_ROWS // 2
    long_prompts += [long_prompts[0]] * (decode_step.MAX_ROWS + 1 - len(long_prompts))
    decode_logits(runner, long_prompts, steps=2)
    assert runner.model._decode_step is not None and runner.model._decode_step.steps == 0
    decode_logits(runner, [long_prompts[0]], steps=1)
    assert runner.model._decode_step.steps == 1


def test_mixed_step_of_decodes_and_chunks_is_bit_identical(tiny_dirs):
    """One step holding a decode, a chunk of proposals (5 tokens after earlier context) and a short first
    prefill chunk: the decode kernel for the first, the prefill kernel for the others, as op by op."""
    runner = packed_runner(tiny_dirs["qwen2"])
    model = runner.model
    got = {}
    for fused in (False, True):
        model.use_decode_step(fused)
        a, b, c = (Request(n, p, SamplingParams(temperature=0)) for n, p in zip("abc", prompts(3, seed=9), strict=True))
        _give_blocks([a, b, c], 40, runner.num_blocks, seed=5)
        for r in (a, b):  # earlier context for both
            runner.compute_logits([(r, len(r.prompt_token_ids))])
            r.num_computed_tokens += len(r.prompt_token_ids)
            r.output_token_ids += [7, 8, 9, 10, 11]
        before = model._decode_step.steps if model._decode_step is not None else 0
        got[fused] = runner.compute_logits([(a, 1), (b, 5), (c, min(4, len(c.prompt_token_ids)))])
        if fused:  # this very step was the fused one
            assert model._decode_step.steps == before + 1
    for x, y in zip(got[False], got[True], strict=True):
        assert (x is None) == (y is None)
        assert x is None or torch.equal(x, y)


def test_a_float_blas_layout_keeps_the_op_by_op_forward(tiny_dirs):
    runner = packed_runner(tiny_dirs["llama"])
    lin = runner.model.layers[1].o
    lin.weight, lin.layout, lin.forms = lin.w_oi.contiguous(), "oi", ("xw",) * len(lin.forms)
    decode_logits(runner, prompts(2), steps=1)
    assert runner.model._decode_step is None


@pytest.mark.parametrize("variant", ["avx2", "generic-attention"])
def test_other_paths_agree(tiny_dirs, monkeypatch, variant):
    """The AVX2 build (on an AVX-512 machine a different tile) and the portable attention loops: the same
    logits up to float32 summation order."""
    lib = decode_step.build({"INFERQ_NO_AVX512": 1}) if variant == "avx2" else decode_step.build()
    assert lib is not None
    if variant == "generic-attention":
        lib.set_generic(1)
    monkeypatch.setattr(decode_step, "load", lambda: lib)
    try:
        plain, fused = fused_and_op_by_op(tiny_dirs["qwen2"], prompts(3))
    finally:
        lib.set_generic(0)
    for a, b in zip(plain, fused, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_packed_gemm_library_still_exports_its_own_entry_points():
    lib = packed_gemm._load()
    assert lib is not None and lib.gemm_has_avx512() in (0, 1)


def _panels_planned(monkeypatch) -> None:
    """The quantised planner picks the panels at every M (timed, it may pick torch's forms for tiny shapes on a
    busy machine, and drop the codes the panels would be made from)."""
    from kernels import quant_gemm

    monkeypatch.setattr(quant_gemm, "_plans", {})
    monkeypatch.setattr(quant_gemm, "_measure", lambda q, forms: ("panels",) * (len(cpu_gemm.BUCKET_LIMITS) + 1))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantised_panels_are_bit_identical(tiny_dirs, fmt, arch, monkeypatch):
    """int8 and int4 weights in their panels (kernels/quant_panels.py): the fused step runs the team form of
    the same kernel, for decodes and for a mixed step."""
    from kernels import quant_panels

    if not quant_panels.available():
        pytest.fail("the quantised panel kernel must build where the packed GEMM does")
    _panels_planned(monkeypatch)
    runner = ModelRunner(tiny_dirs[arch], block_size=BLOCK, device="cpu", kv_cache_bytes=1 << 20, quantization=fmt)
    assert all(getattr(layer, name).forms[0] == "panels" for layer in runner.model.layers
               for name in ("qkv", "o", "gate_up", "down"))
    model = runner.model
    got = {}
    for fused in (False, True):
        model.use_decode_step(fused)
        got[fused] = decode_logits(runner, prompts(3, seed=4), steps=4)
    assert model._decode_step is not None and model._decode_step.steps >= 4
    for a, b in zip(got[False], got[True], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"max diff {(x - y).abs().max()}"
