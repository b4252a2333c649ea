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

from kernels import cpu_gemm, decode_step, kv_quant, packed_gemm, stream_prefetch
from scheduler.request import Request, SamplingParams
from tests.tiny_models import make_tiny_model
from worker import model as model_module
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


def test_prefetch_trials_while_serving_change_no_logit(tiny_dirs, monkeypatch):
    """The fused step's prefetch tuner (kernels/stream_prefetch.py OnlineTuner) runs its trials inside real
    steps, at one and at three rows, and every step's logits stay those of the op-by-op forward."""
    monkeypatch.setattr(stream_prefetch.OnlineTuner, "EVERY", 3)
    adopted = []
    monkeypatch.setattr(stream_prefetch, "adopt", lambda *a: adopted.append(a))  # the machine's plan file untouched
    for batch in (1, 3):
        runner = packed_runner(tiny_dirs["llama"])
        model = runner.model
        model.use_decode_step(False)
        plain = decode_logits(runner, prompts(batch, seed=batch), 24)
        model.use_decode_step(True)
        fused = decode_logits(runner, prompts(batch, seed=batch), 24)
        tuner = model._decode_step.tuner
        assert tuner is not None and tuner.trials >= 24 // 3 - 2
        assert tuner._slots[batch].steps == 24 and not any(s.steps for i, s in enumerate(tuner._slots) if i != batch)
        for a, b in zip(plain, fused, strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch,head", [(1, True), (3, True), (16, True), (1, False), (3, False)])
def test_fused_step_is_bit_identical_to_the_op_by_op_forward(tiny_dirs, arch, batch, head):
    """head: the final norm and the LM head inside the fused call (the head in panels), or after it."""
    plain, fused = fused_and_op_by_op(tiny_dirs[arch], prompts(batch, seed=batch), head=head)
    for step, (a, b) in enumerate(zip(plain, fused, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"step {step}: max diff {(x - y).abs().max()}"


@pytest.mark.parametrize("batch", [1, 3])
def test_one_accumulator_set_keeps_the_fused_step_bit_identical(tiny_dirs, batch):
    """float32 tiles of 1-3 rows with one set, as kernels/stream_prefetch.py may choose: set in the packed GEMM's
    library and the fused step's alike, the two forwards still agree bit for bit."""
    libs = [packed_gemm._load(), decode_step.load()]
    saved = [{r: lib.get_k_sets(0, r) for r in stream_prefetch.SETS_ROWS} for lib in libs]
    try:
        for lib in libs:
            stream_prefetch._apply_sets(lib, False, {1: 1, 2: 1, 3: 1})
        plain, fused = fused_and_op_by_op(tiny_dirs["llama"], prompts(batch, seed=batch), head=True)
        assert libs[1].get_k_sets(0, 1) == 1  # (loading the model kept the choice)
        for step, (a, b) in enumerate(zip(plain, fused, strict=True)):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), f"step {step}: max diff {(x - y).abs().max()}"
    finally:
        for lib, sets in zip(libs, saved, strict=True):
            stream_prefetch._apply_sets(lib, False, sets)


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


def test_a_float32_step_reads_the_models_own_norms_and_interleaved_rope(tiny_dirs):
    """The float32 path as before the bfloat16 one: no float32 copies of the norms, the interleaved RoPE."""
    runner = packed_runner(tiny_dirs["llama"])
    decode_logits(runner, prompts(1), steps=1)
    model = runner.model
    step = model._decode_step
    assert step is not None and step.steps >= 1 and step.args.rope_half == 0
    assert step.args.final_norm == model.norm.data_ptr()
    for slot, layer in zip(step._layers, model.layers, strict=True):
        assert (slot.input_norm, slot.post_norm) == (layer.input_norm.data_ptr(), layer.post_norm.data_ptr())


def _decode_panels(lin) -> None:
    """What the planner keeps where a BLAS layout wins the larger buckets: the weight ``[out, in]`` for them,
    and a packed copy for the decode bucket."""
    w = lin.w_oi.contiguous()
    lin.weight, lin.layout, lin.decode_panels = w, "oi", cpu_gemm.plan(w, packed_only=True).weight
    lin.forms = ("pk",) + ("xw",) * (len(lin.forms) - 1)


def forced_logits(runner, prompts, steps: int, seed: int = 0) -> torch.Tensor:
    """Like :func:`decode_logits`, but every token fed is drawn at random (the same whatever the logits, so
    runners that round differently see the same sequences): ``[steps, len(prompts), vocab]``."""
    rng = random.Random(seed)
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    _give_blocks(reqs, max(map(len, prompts)) + steps + 1, runner.num_blocks, seed)
    for r in reqs:
        runner.compute_logits([(r, len(r.prompt_token_ids))])
        r.num_computed_tokens += len(r.prompt_token_ids)
        r.output_token_ids.append(rng.randrange(3, 200))
    out = []
    for _ in range(steps):
        out.append(torch.stack(runner.compute_logits([(r, 1) for r in reqs])))
        for r in reqs:
            r.num_computed_tokens += 1
            r.output_token_ids.append(rng.randrange(3, 200))
    return torch.stack(out)


def _bf16_rounded_float32_runner(path) -> ModelRunner:
    """A float32 model whose weights are the bfloat16 model's (rounded to bfloat16), with a bfloat16 cache."""
    runner = packed_runner(path, dtype="float32", kv_cache_dtype="bfloat16")
    m = runner.model
    lins = [getattr(layer, name) for layer in m.layers for name in ("qkv", "o", "gate_up", "down")] + [m.lm_head]
    tensors = [m.norm, m.embed, *(lin.weight for lin in lins), *(lin.bias for lin in lins if lin.bias is not None),
               *(t for layer in m.layers for t in (layer.input_norm, layer.post_norm))]
    for t in tensors:
        t.copy_(t.bfloat16().float())
    return runner


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.skipif(not model_module.cpu_half_gemm_is_native(),
                    reason="a bfloat16 model computes in bfloat16 only where the CPU multiplies it natively")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("head", [True, False])
def test_bfloat16_arithmetic_model_takes_the_float32_step(tiny_dirs, arch, head):
    """A bfloat16 model (native bfloat16 matmul) with panels kept for the decode bucket beside a BLAS layout:
    its small steps (here the prompts too, 16 tokens at most) run fused, in float32. Its logits agree with its
    op-by-op bfloat16 forward to bfloat16 rounding, and with float32 arithmetic on the same bfloat16 weights and
    cache far more closely than that forward does (the step is not computed in bfloat16)."""
    runner = ModelRunner(tiny_dirs[arch], block_size=BLOCK, device="cpu", kv_cache_bytes=1 << 20, dtype="bfloat16")
    model = runner.model
    assert model.dtype == torch.bfloat16 and runner.kv_caches[0][0].dtype == torch.bfloat16
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            _decode_panels(getattr(layer, name))
    if head:
        _decode_panels(model.lm_head)
    else:
        model.lm_head.decode_panels, model.lm_head.forms = None, ("xw",) * len(model.lm_head.forms)
    short = [p[:decode_step.MAX_ROWS] for p in prompts(3, seed=3)]
    model.use_decode_step(False)
    plain = forced_logits(runner, short, steps=6)
    assert model._decode_step is None
    model.use_decode_step(True)
    fused = forced_logits(runner, short, steps=6)
    assert model._decode_step is not None and model._decode_step.steps == len(short) + 6
    assert model._decode_step.has_head == head and model._decode_step.args.rope_half == 1
    assert fused.dtype == torch.float32
    reference = forced_logits(_bf16_rounded_float32_runner(tiny_dirs[arch]), short, steps=6)
    assert _rel(fused, plain) < 0.02 and (fused - plain).abs().max() <= 0.03 * plain.abs().max()
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.8
    assert _rel(fused, reference) < (0.01 if head else 0.5) * _rel(plain, reference)


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


def test_the_phase_timing_build_times_every_phase_and_changes_nothing(tiny_dirs, monkeypatch):
    """bench latency's build of the step (``INFERQ_STEP_PHASES``): the same logits bit for bit, and per thread
    the time of each phase of the steps it ran (every product, attention and the head nonzero), read once."""
    lib = decode_step.build({"INFERQ_STEP_PHASES": None})
    assert lib is not None and hasattr(lib, "step_phases") and not hasattr(decode_step.load(), "step_phases")
    threads = torch.get_num_threads()
    decode_step.phase_times(lib, threads)  # clear
    monkeypatch.setattr(decode_step, "load", lambda: lib)
    plain, fused = fused_and_op_by_op(tiny_dirs["llama"], prompts(2))
    for a, b in zip(plain, fused, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    per_thread = decode_step.phase_times(lib, threads)
    assert len(per_thread) == threads and all(set(t) == set(decode_step.PHASES) for t in per_thread)
    for name in ("qkv", "o", "gate_up", "down", "attention", "lm_head"):
        assert per_thread[0][name] > 0, name
    assert all(v >= 0 for t in per_thread for v in t.values())
    assert all(v == 0 for t in decode_step.phase_times(lib, threads) for v in t.values())  # read clears


def test_packed_gemm_library_still_exports_its_own_entry_points():
    lib = packed_gemm._load()
    assert lib is not None and lib.gemm_has_avx512() in (0, 1)


def _panels_planned(monkeypatch) -> None:
    """The quantised planner picks the panels at every M (timed, it may pick torch's forms for tiny shapes on a
    busy machine, and drop the codes the panels would be made from)."""
    from kernels import quant_gemm

    monkeypatch.setattr(quant_gemm, "_plans", {})
    monkeypatch.setattr(quant_gemm, "_measure",
                        lambda q, forms, act8=False: ("panels",) * (len(cpu_gemm.BUCKET_LIMITS) + 1))


@pytest.mark.parametrize("fmt", ["int8", "int4", "w4a8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantised_panels_are_bit_identical(tiny_dirs, fmt, arch, monkeypatch):
    """int8 and int4 weights in their panels (kernels/quant_panels.py), int4 also times int8 activations: the
    fused step runs the team form of the same kernel, for decodes and for a mixed step."""
    from kernels import quant_panels

    if not quant_panels.available():
        pytest.fail("the quantised panel kernel must build where the packed GEMM does")
    _panels_planned(monkeypatch)
    runner = ModelRunner(tiny_dirs[arch], block_size=BLOCK, device="cpu", kv_cache_bytes=1 << 20, quantization=fmt)
    assert all(getattr(layer, name).forms[0] == "panels" for layer in runner.model.layers
               for name in ("qkv", "o", "gate_up", "down"))
    assert all(getattr(layer, name).panels.act8 == (fmt == "w4a8") for layer in runner.model.layers
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantised_cache(tiny_dirs, arch, kv):
    """An int8 or float8 KV cache: the fused step packs the new keys and values as the cache write does
    (kernels/kv_quant.py, bit for bit) and its attention reads the rows in place as the op-by-op kernels do."""
    want = torch.int8 if kv == "int8" else kv_quant.FP8_ROWS
    assert packed_runner(tiny_dirs[arch], kv_cache_dtype=kv).kv_caches[0][0].dtype == want
    plain, fused = fused_and_op_by_op(tiny_dirs[arch], prompts(3), kv_cache_dtype=kv)
    for step, (a, b) in enumerate(zip(plain, fused, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"step {step}: max diff {(x - y).abs().max()}"


def test_float8_conversion_is_torchs():
    """The fused cache write's float32 -> e4m3 conversion against torch's, bit for bit: random magnitudes over the
    whole range the rows use, every e4m3 value and the midpoints between neighbours (the ties), subnormals."""
    lib = decode_step.load()
    g = torch.Generator().manual_seed(8)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite magnitude
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat((grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                   torch.exp(torch.empty(20000).uniform_(-25, 6.1, generator=g)).clamp_(max=448.0),
                   torch.tensor([0.0, 1e-30, 2.0**-10, 2.0**-9 * 1.5, 448.0])))
    x = torch.cat((x, -x))
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    got = torch.tensor([lib.f8_from_f32(float(v)) for v in x.tolist()], dtype=torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert not len(bad), [(float(x[i]), int(got[i]), int(want[i])) for i in bad[:5]]


def _engine_tokens(runner, ahead: bool, params: SamplingParams, prompt_list,
                   wake_fd: int | None = None) -> tuple[list[list[int]], int]:
    """Each prompt alone through an engine on ``runner`` (decode-ahead windows or one token per step): the
    tokens, and the engine steps taken. ``wake_fd``: the engine's wake descriptor, its windows then taking
    ``decode_ahead_wake_ms`` (1 s) whatever ``ahead`` says."""
    from inferq.settings import Settings
    from worker.engine import LLMEngine

    settings = Settings(model=str(runner.model_dir), device="cpu", block_size=BLOCK,
                        decode_ahead_ms=1000.0 if ahead else 0.0, decode_ahead_wake_ms=1000.0)
    engine = LLMEngine(settings, runner=runner, tokenizer=None)
    if wake_fd is not None:
        engine.wake_fd = lambda: wake_fd
    out = []
    for i, p in enumerate(prompt_list):
        engine.add_request(Request(f"w{i}", p, params))
        tokens = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids or []
        out.append(tokens)
    return out, engine.stats.steps


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_decode_ahead_windows_run_the_fused_step_with_unchanged_output(tiny_dirs, arch, head, sampling):
    """A decode-ahead window on the fused step (``CausalLM.decode_window``: no per-token metadata, the head's
    logits into one buffer) where the head is in panels; token by token through the forward where it is not.
    Either way the tokens equal one-token steps' on the same runner, across blocks of 4."""
    params = (SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True) if sampling == "greedy" else
              SamplingParams(max_tokens=37, temperature=0.9, top_k=8, seed=5, ignore_eos=True))
    runner = packed_runner(tiny_dirs[arch], head=head)
    plain, plain_steps = _engine_tokens(runner, False, params, prompts(3, seed=11))
    step = runner.model._decode_step
    assert step is not None and step.window_steps == 0
    ahead, ahead_steps = _engine_tokens(runner, True, params, prompts(3, seed=11))
    assert ahead == plain and all(len(t) == 37 for t in ahead)
    assert ahead_steps < plain_steps // 4
    step = runner.model._decode_step
    assert (step.window_steps > 3 * 30) == head and (step.window_steps == 0) == (not head)


@pytest.mark.parametrize("c_loop", [True, False])
def test_a_fused_window_ends_after_one_token_while_the_wake_descriptor_is_readable(tiny_dirs, c_loop):
    """``wake_fd`` (the worker's pub/sub socket, worker/engine.py): while it is readable each fused window ends
    after its current token, in one C call (a poll a token) or in the fused step's Python loop; the tokens are
    the one-token steps'."""
    import os

    params = SamplingParams(max_tokens=31, temperature=0.0, ignore_eos=True)
    runner = packed_runner(tiny_dirs["llama"])
    plain, _ = _engine_tokens(runner, False, params, prompts(2, seed=6))
    step = runner.model._decode_step
    if not c_loop:
        step.embed = None
    read_end, write_end = os.pipe()
    try:
        made = {}
        for readable in (False, True):
            if readable:
                os.write(write_end, b"x")
            windows = step.c_windows
            got, steps = _engine_tokens(runner, False, params, prompts(2, seed=6), wake_fd=read_end)
            assert got == plain
            made[readable] = (steps, step.c_windows - windows)
        assert made[False][0] < 2 * 31 // 4 and made[True][0] >= 2 * 31  # whole windows, then one token a step
        assert (made[False][1] > 0) == c_loop  # the windows ran in one C call each (or in Python)
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.skipif(not model_module.cpu_half_gemm_is_native(),
                    reason="a bfloat16 model computes in bfloat16 only where the CPU multiplies it natively")
def test_decode_ahead_window_of_a_bfloat16_model(tiny_dirs):
    """A bfloat16 model's window takes the fused step's float32 rows (rotate-half RoPE rows, widened embedding):
    the same tokens as its one-token fused steps, whether the window runs in one C call (bfloat16 table rows
    widened there) or in Python."""
    runner = ModelRunner(tiny_dirs["qwen2"], block_size=BLOCK, device="cpu", kv_cache_bytes=1 << 20, dtype="bfloat16")
    model = runner.model
    for lin in [getattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]:
        _decode_panels(lin)
    _decode_panels(model.lm_head)
    params = SamplingParams(max_tokens=29, temperature=0.0, ignore_eos=True)
    plain, _ = _engine_tokens(runner, False, params, prompts(2, seed=4))
    ahead, _ = _engine_tokens(runner, True, params, prompts(2, seed=4))
    step = model._decode_step
    assert ahead == plain and step.window_steps > 2 * 20 and step.c_windows >= 2  # in one C call each
    step.embed = None  # the windows' Python loop: the same tokens
    assert _engine_tokens(runner, True, params, prompts(2, seed=4))[0] == plain


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tied"), "llama", num_hidden_layers=2,
                           tie_word_embeddings=True)


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4", "w4a8"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_window_in_one_call_makes_the_python_loops_tokens(tiny_dirs, tied_dir, fmt, tied, temperature,
                                                             monkeypatch):
    """A window run whole in C (``DecodeStep.run_window``: the embedding looked up from the tied head's panels or
    the untied table, the argmax taken there; sampled with no cut: of the logits plus the race offsets the
    sampler drew for the whole window, seeded) against the same windows' Python loop (``embed`` cleared), and
    against one-token steps: the same tokens, including a stop token inside a window."""
    path = tied_dir if tied else tiny_dirs["llama"]
    if fmt == "float32":
        runner = packed_runner(path)
    else:
        _panels_planned(monkeypatch)
        runner = ModelRunner(path, block_size=BLOCK, device="cpu", kv_cache_bytes=1 << 20, quantization=fmt)
    seed = 9 if temperature else None
    long = SamplingParams(max_tokens=41, temperature=temperature, seed=seed, ignore_eos=True)
    plain, _ = _engine_tokens(runner, False, long, prompts(3, seed=2))
    stop = plain[1][17]
    stopping = SamplingParams(max_tokens=41, temperature=temperature, seed=seed, ignore_eos=True,
                              stop_token_ids=[stop])
    got, stopped_steps = {}, {}
    for c_loop in (True, False):
        runner.model.use_decode_step(True)
        _engine_tokens(runner, False, long, prompts(1))  # builds the step
        step = runner.model._decode_step
        assert step is not None and step.has_head and (step.embed is not None)
        if not c_loop:
            step.embed = None
        got[c_loop] = [_engine_tokens(runner, True, long, prompts(3, seed=2))[0]]
        assert (step.c_windows >= 3) == c_loop and step.window_steps > 3 * 30
        before = step.window_steps
        got[c_loop].append(_engine_tokens(runner, True, stopping, prompts(3, seed=2))[0])
        stopped_steps[c_loop] = step.window_steps - before  # a window ends at the stop, not at its last slot
    assert got[True] == got[False] and stopped_steps[True] == stopped_steps[False]
    assert got[True][0] == plain
    assert got[True][1][1] == plain[1][: plain[1].index(stop) + 1]
