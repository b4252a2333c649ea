"""Quantised weights in the model (issue 15): float checkpoints quantised at load (tiny random Llama/Qwen2),
the default model's own 4-bit GGUF blocks served as they are, judged against float32 on the same weights."""

from __future__ import annotations

import pytest
import torch

from inferq.settings import Settings
from scheduler.request import Request, SamplingParams
from tests.integration.test_smollm2_vs_hf import smollm_dir  # noqa: F401 - fixture
from worker.engine import LLMEngine
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request, tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)


def _last_logits(model_dir, prompt: list[int], **opts) -> torch.Tensor:
    runner = ModelRunner(model_dir, device="cpu", dtype="float32", kv_cache_bytes=4 << 20, block_size=4, **opts)
    req = Request("r", prompt, SamplingParams(max_tokens=1))
    runner_blocks = -(-len(prompt) // 4)
    req.block_table = list(range(runner_blocks))
    return runner.compute_logits([(req, len(prompt))])[0]


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((p.exp() * (p - q)).sum())


@pytest.mark.parametrize(("quantization", "max_kl"), [("int8", 1e-3), ("w8a16", 1e-3), ("w8a8", 2e-2),
                                                      ("int4", 5e-2), ("w4a8", 5e-2)])
def test_quantised_logits_stay_close_to_float32(tiny_model, quantization, max_kl):
    prompt = [(7 * i + 3) % 300 + 3 for i in range(21)]
    ref = _last_logits(tiny_model, prompt)
    got = _last_logits(tiny_model, prompt, quantization=quantization)
    kl = _kl(ref, got)
    assert 0.0 < kl < max_kl, kl  # not identical (the weights really are quantised), and close


def test_w8a16_keeps_float_activations_and_int8_may_take_blocks(tiny_model):
    """w8a16 plans weight-only forms only; int8 may also plan our block-32 int8 activations (never torch's
    per-token form, which only w8a8 allows), never at decode sizes, and never for the LM head."""
    for quantization, allowed in (("w8a16", {"w8a16", "w8dq", "panels"}),
                                  ("int8", {"w8a16", "w8dq", "panels", "w8a8", "w8a8w"})):
        model = ModelRunner(tiny_model, device="cpu", dtype="float32", kv_cache_bytes=1 << 20,
                            quantization=quantization).model
        for layer in model.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                lin = getattr(layer, name)
                assert set(lin.forms) <= allowed and lin.forms[0] not in ("w8a8", "w8a8w"), (quantization, lin.forms)
                assert (lin.a8 is not None) == ("w8a8" in lin.forms)  # our block panels, never torch's form
        assert not {"w8a8", "w8a8w"} & set(model.lm_head.forms)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w4a8"])
def test_quantised_engine_runs_prefill_chunks_and_decode(tiny_model, quantization):
    eng = LLMEngine(Settings(model=str(tiny_model), device="cpu", dtype="float32", block_size=4,
                             kv_cache_memory="256KiB", max_batched_tokens=8, torch_threads=1,
                             quantization=quantization))
    assert eng.runner.model.quantization == quantization
    for i in range(3):
        eng.add_request(Request(f"q{i}", [5 + i] * (11 + i), SamplingParams(max_tokens=6, temperature=0.0)))
    outs = eng.run_until_done()
    assert sorted(o.request_id for o in outs) == ["q0", "q1", "q2"]
    assert all(len(o.token_ids) == 6 for o in outs)
    assert eng.runner.weight_bytes < ModelRunner(tiny_model, device="cpu", dtype="float32",
                                                 kv_cache_bytes=1 << 20).weight_bytes


def test_w4a8_quantises_the_layers_activations_but_not_the_heads(tiny_model):
    """w4a8: every layer product int4 times int8 activation blocks (in our panels where they build, else torch's
    forms on the de-quantised blocks), the LM head int8 with float activations; the logits differ from int4's
    (the activations really are quantised) but stay as close to float32."""
    runner = ModelRunner(tiny_model, device="cpu", dtype="float32", kv_cache_bytes=1 << 20, quantization="w4a8")
    for layer in runner.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            assert lin.weight.fmt == "int4" and lin.act8
            assert lin.panels is None or lin.panels.act8
    head = runner.model.lm_head
    assert head.weight.fmt == "int8" and not head.act8
    prompt = [(5 * i + 2) % 300 + 3 for i in range(19)]
    a8, i4 = (_last_logits(tiny_model, prompt, quantization=qz) for qz in ("w4a8", "int4"))
    assert not torch.equal(a8, i4)
    ref = _last_logits(tiny_model, prompt)
    assert _kl(ref, a8) < 2 * _kl(ref, i4) + 1e-3


def test_a_width_that_is_no_whole_number_of_groups_is_a_clear_error(tmp_path):
    from tests.tiny_models import make_tiny_model
    from worker.model import ModelError

    model = make_tiny_model(tmp_path, hidden_size=96, intermediate_size=192)  # 96 inputs: no group of 64
    with pytest.raises(ModelError, match="cannot quantise to int4.*multiple of the int4 group size 64"):
        ModelRunner(model, device="cpu", dtype="float32", kv_cache_bytes=1 << 20, quantization="int4",
                    quantization_group_size=64)


def test_auto_on_a_plain_checkpoint_stays_float(tiny_model):
    runner = ModelRunner(tiny_model, device="cpu", dtype="float32", kv_cache_bytes=1 << 20, quantization="auto")
    assert runner.model.quantization == "none"
    assert runner.kv_dtype == torch.float32  # float weights: the cache stays exact


@pytest.mark.parametrize("quantization", ["int8", "int4", "w4a8"])
def test_quantised_weights_take_a_bfloat16_cache_unless_told(tiny_model, quantization):
    """kv_cache_dtype=auto under quantised float32 weights is bfloat16 (model_runner._kv_dtype says why): twice
    the blocks of a float32 cache for the same budget; an explicit float32 keeps the float32 pools."""
    runners = {kv: ModelRunner(tiny_model, device="cpu", dtype="float32", kv_cache_bytes=1 << 20,
                               quantization=quantization, kv_cache_dtype=kv) for kv in ("auto", "float32")}
    assert runners["auto"].kv_dtype == torch.bfloat16 and runners["float32"].kv_dtype == torch.float32
    assert runners["auto"].kv_caches[0][0].dtype == torch.bfloat16
    assert runners["auto"].num_blocks == 2 * runners["float32"].num_blocks
    prompt = [(3 * i + 5) % 300 + 3 for i in range(23)]
    narrow, wide = (_last_logits(tiny_model, prompt, quantization=quantization, kv_cache_dtype=kv)
                    for kv in ("auto", "float32"))
    ref = _last_logits(tiny_model, prompt)
    assert not torch.equal(narrow, wide)  # the keys and values really are rounded
    assert _kl(ref, narrow) < 1.5 * _kl(ref, wide) + 1e-4  # and cost little beside the weights' own rounding


# --- the default model's GGUF, 4-bit as shipped ---------------------------------------------------------------


def test_the_default_gguf_is_served_at_4_bits_with_a_sensible_answer(smollm_dir):  # noqa: F811
    from transformers import AutoTokenizer

    from kernels.quant_gemm import QuantLinear

    eng = LLMEngine(Settings(model=str(smollm_dir), device="cpu", dtype="float32", kv_cache_memory="64MiB",
                             quantization="auto"))
    model = eng.runner.model
    assert model.quantization == "int4"
    assert eng.runner.kv_dtype == torch.bfloat16  # the service's default cache under 4-bit weights
    layer = model.layers[0]
    assert all(isinstance(p, QuantLinear) and p.weight.fmt == "int4" for p in (layer.qkv, layer.o, layer.gate_up,
                                                                               layer.down))
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.weight.fmt == "int8"  # Q8_0 in the file
    # float32: ~540 MB; the 4-bit weights ~110 MB, up to twice that where the planner keeps torch's 4-bit copy
    # beside our panels for prefill sizes (kernels/quant_gemm.py, KEEP_ONE_MARGIN; seen on an AMX Xeon)
    assert eng.runner.weight_bytes < 250e6
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    answers = {}
    for i, (question, expected) in enumerate([("What is 2 + 2? Answer with the number only.", "4"),
                                              ("What is the opposite of hot?", "cold"),
                                              ("What is the largest ocean on Earth?", "pacific")]):
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=False)
        eng.add_request(Request(f"a{i}", tok.encode(ids, add_special_tokens=False),
                                SamplingParams(max_tokens=16, temperature=0.0)))
        answers[f"a{i}"] = expected
    for out in eng.run_until_done():
        assert answers[out.request_id] in out.text.lower(), out.text


def test_the_gguf_blocks_equal_the_converted_float_weights(smollm_dir):  # noqa: F811
    """The 4-bit blocks read as ours de-quantise to exactly the float weights transformers converted (the
    float32 reference of ``bench quality`` is these same weights)."""
    from safetensors.torch import load_file

    from kernels.quant import QuantizedWeight
    from worker.gguf_weights import read_gguf
    from worker.model import gguf_source, load_config

    ours = read_gguf(gguf_source(smollm_dir), load_config(smollm_dir))
    ref = load_file(str(smollm_dir / "model.safetensors"))
    assert set(ours) == set(ref)
    for name, w in ours.items():
        if isinstance(w, QuantizedWeight) and w.fmt == "int4":
            torch.testing.assert_close(w.dequantize(), ref[name].float(), atol=0, rtol=0)
        elif not isinstance(w, QuantizedWeight):
            torch.testing.assert_close(w, ref[name].float(), atol=0, rtol=0)


# --- the int8 and float8 e4m3 KV caches ----------------------------------------------------------------------------------------


def _chunked_last_logits(model_dir, prompt: list[int], **opts) -> torch.Tensor:
    """Prefill in two chunks (the second reads the first's keys and values from the cache), last row's logits."""
    runner = ModelRunner(model_dir, device="cpu", dtype="float32", kv_cache_bytes=4 << 20, block_size=4, **opts)
    req = Request("r", prompt, SamplingParams(max_tokens=1))
    req.block_table = list(range(-(-len(prompt) // 4)))
    half = len(prompt) // 2
    runner.execute([(req, half)])
    req.num_computed_tokens = half
    return runner.compute_logits([(req, len(prompt) - half)])[0]


@pytest.mark.parametrize("attention", ["cpu", "torch"])
@pytest.mark.parametrize(("kv", "max_kl"), [("int8", 1e-3), ("fp8_e4m3", 1e-2)])
def test_int8_kv_cache_logits_stay_close_to_float32(tiny_model, attention, kv, max_kl):
    """int8 and float8 rows through the C kernels and through the torch path (which unpacks them): close to the
    float32 cache's logits, and not equal to them (the rows really were rounded). float8's 3 mantissa bits cost
    more than int8's uniform 8 on these random weights; ``bench quality`` measures both on the real model."""
    prompt = [(5 * i + 2) % 300 + 3 for i in range(26)]
    ref = _chunked_last_logits(tiny_model, prompt, attention_backend=attention)
    got = _chunked_last_logits(tiny_model, prompt, attention_backend=attention, kv_cache_dtype=kv)
    kl = _kl(ref, got)
    assert 0.0 < kl < max_kl, kl


def test_int8_kv_cache_rows_are_codes_plus_one_scale(tiny_model):
    """bfloat16 takes 2 D bytes a (token, head) row, int8 D + 4: 1.6x the tokens at this tiny model's D = 16,
    1.9x at SmolLM2's D = 64."""
    sizes = {}
    dtypes = {"bfloat16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.uint8}  # float8 rows as bytes
    for kv, dtype in dtypes.items():
        runner = ModelRunner(tiny_model, device="cpu", dtype="float32", kv_cache_bytes=1 << 20, kv_cache_dtype=kv)
        sizes[kv] = runner.kv_bytes_per_token
        assert runner.kv_caches[0][0].dtype == dtype
    d = 16
    assert sizes["bfloat16"] / sizes["int8"] == pytest.approx(2 * d / (d + 4))
    assert sizes["fp8_e4m3"] == sizes["int8"]


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_int8_kv_cache_through_chunking_preemption_and_prefix_hits(tiny_model, kv):
    """The engine with an int8 cache under every regime that moves KV rows (chunked prefill, a pool small
    enough to preempt, shared prefixes): every request finishes with all its tokens, and greedy tokens mostly
    agree with the float32 cache's. Only loosely: one flipped token changes the rest of its sequence, and
    int8 rows round small components coarsely (measured here: 63 of 80 tokens, bfloat16 80 of 80); the
    precise check is the KL test above, and ``bench quality`` measures the cost on the real model."""
    from tests.integration.test_engine import kv_bytes

    prompts = [[3 + (i % 4)] * 12 + [50 + i, 60 + i] for i in range(8)]

    def run(cache: str) -> dict[str, list[int]]:
        # 20 blocks either way: layers x K/V x block_size x kv_heads x row bytes (float32 D, or int8/fp8 D + 4)
        memory = kv_bytes(20) if cache == "float32" else str(20 * 2 * 2 * 4 * 2 * (16 + 4))
        eng = LLMEngine(Settings(model=str(tiny_model), device="cpu", dtype="float32", block_size=4,
                                 kv_cache_memory=memory, max_batched_tokens=10, torch_threads=1,
                                 kv_cache_dtype=cache))
        assert eng.runner.num_blocks == 20
        for i, p in enumerate(prompts):
            eng.add_request(Request(f"k{i}", p, SamplingParams(max_tokens=10, temperature=0.0)))
        outs = {o.request_id: o.token_ids for o in eng.run_until_done()}
        assert eng.stats.preemptions > 0 and eng.stats.prefix_hit_rate > 0
        return outs

    ref, got = run("float32"), run(kv)
    assert sorted(got) == sorted(ref) and all(len(t) == 10 for t in got.values())
    same = sum(a == b for k in ref for a, b in zip(ref[k], got[k], strict=True))
    assert same >= 0.6 * 10 * len(prompts), same


def test_quantised_weights_with_tensor_parallelism_are_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="tensor parallelism with quantised weights"):
        ModelRunner(tiny_model, device="cpu", dtype="float32", kv_cache_bytes=1 << 20, quantization="int4",
                    tensor_parallel_size=2)
