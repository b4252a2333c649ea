"""GPTQ- and AWQ-packed checkpoints served at 4 bits (worker/gptq_weights.py): a tiny random HF Llama/Qwen2
quantised and packed here (tests/unit/test_gptq_awq_layout.py's packer, from the published layouts), loaded with
``quantization="auto"``, and judged against Hugging Face transformers run on the de-quantised float weights
(the test's own de-quantiser, not ours)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from kernels.quant_gemm import QuantLinear
from scheduler.request import Request, SamplingParams
from tests.integration.test_engine import hf_greedy, real_engine, run_all
from tests.unit.test_gptq_awq_layout import pack, quantise, reference_dequant
from worker.gptq_weights import PackedWeightError
from worker.model import CausalLM
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.integration

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_packed(root, arch: str, method: str, group: int, *, v2: bool = False, act_order: bool = False,
                extra: dict | None = None):
    """(packed dir, reference dir): the same tiny model as a GPTQ/AWQ checkpoint and as the float weights
    its packed tensors stand for (embeddings, norms, biases and the head as they were)."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import make_tiny_model

    src = make_tiny_model(root / "src", arch=arch)
    packed_dir, ref_dir = root / "packed", root / "ref"
    shutil.copytree(src, packed_dir)
    shutil.copytree(src, ref_dir)
    tensors = load_file(str(src / "model.safetensors"))
    packed, ref = {}, dict(tensors)
    gen = torch.Generator().manual_seed(7)
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rpartition(".")[2] in LINEARS):
            packed[name] = w
            continue
        g_idx = torch.argsort(torch.randperm(w.shape[1], generator=gen)) // group if act_order else None
        parts = pack(method, *quantise(w, group, g_idx, zero_groups=int(name.endswith("o_proj.weight"))), v2)
        packed.update({f"{prefix}.{k}": v for k, v in parts.items()})
        ref[name] = reference_dequant(method, parts, group, v2)
    (packed_dir / "model.safetensors").unlink()
    save_file(packed, str(packed_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((packed_dir / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc.update({"desc_act": act_order, "checkpoint_format": "gptq_v2" if v2 else "gptq"} if method == "gptq"
              else {"zero_point": True, "version": "gemm"})
    config["quantization_config"] = {**qc, **(extra or {})}
    (packed_dir / "config.json").write_text(json.dumps(config, indent=2))
    return packed_dir, ref_dir


def _prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 6, 17, 30)]


def _our_greedy(model_dir, prompts, max_tokens, **opts):
    engine = real_engine(model_dir, **opts)
    reqs = [Request(f"g{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            for i, p in enumerate(prompts)]
    outs = run_all(engine, reqs)
    return engine, [outs[f"g{i}"].token_ids for i in range(len(prompts))]


# torch's int4 product rounds activations, scales and zero points to bfloat16: next-token logits move by up to
# 0.043 here (measured over these prompts), so a greedy choice between two logits closer than TIE may flip.
TIE = 0.06
CLOSE = 0.1


def _hf_paths(ref_dir, prompts, n):
    """HF's greedy tokens and raw next-token logits at each step, on the de-quantised float weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    paths = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                               output_logits=True, return_dict_in_generate=True,
                               pad_token_id=model.config.pad_token_id)
            paths.append((g.sequences[0, len(p):].tolist(), [lg[0] for lg in g.logits]))
    return paths


def _margin(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _teacher_forced(runner, prompt, tokens):
    """Our next-token logits after ``prompt + tokens[:k]``, for every k (each prefix computed afresh)."""
    out = []
    for k in range(len(tokens)):
        seq = prompt + tokens[:k]
        req = Request("t", seq, SamplingParams(max_tokens=1))
        req.block_table = list(range(-(-len(seq) // 4)))
        out.append(runner.compute_logits([(req, len(seq))])[0])
    return out


@pytest.mark.parametrize(("arch", "method", "group", "v2"), [
    ("llama", "gptq", 32, False),
    ("llama", "awq", 64, False),
    ("qwen2", "gptq", 64, True),
    ("qwen2", "awq", 32, False),
])
def test_packed_checkpoint_is_served_at_4_bits_and_matches_hf(tmp_path, arch, method, group, v2):
    """Greedy tokens equal HF's on the de-quantised weights up to the first near-tie (HF's top two logits
    closer than TIE); along HF's whole path every next-token distribution is within CLOSE of HF's and every
    clear choice is the same. A mis-read layout moves logits by whole units, not hundredths."""
    packed_dir, ref_dir = make_packed(tmp_path, arch, method, group, v2=v2)
    prompts, n = _prompts(), 10
    paths = _hf_paths(ref_dir, prompts, n)
    engine, got = _our_greedy(packed_dir, prompts, n, quantization="auto")
    model = engine.runner.model
    assert model.quantization == "int4"
    for layer in model.layers:
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(p, QuantLinear) and p.weight.fmt == "int4" and p.weight.group_size == group
    assert not isinstance(model.lm_head, QuantLinear)  # the checkpoint's float head, as it is under "auto"
    clear = 0
    for prompt, ours, (tokens, logits) in zip(prompts, got, paths, strict=True):
        margins = [_margin(lg) for lg in logits]
        cut = next((k for k, m in enumerate(margins) if m < TIE), len(tokens))
        assert ours[:cut] == tokens[:cut], (prompt, ours, tokens, margins)
        for k, mine in enumerate(_teacher_forced(engine.runner, prompt, tokens)):
            assert float((mine - logits[k]).abs().max()) < CLOSE, (prompt, k)
            if margins[k] >= TIE:
                clear += 1
                assert int(mine.argmax()) == tokens[k], (prompt, k, margins[k])
    assert clear >= 0.6 * sum(len(t) for t, _ in paths)  # (most steps are clear calls: the check has teeth)


def test_packed_checkpoint_under_none_is_its_dequantised_float_model(tmp_path):
    """Without "auto" the packed weights are widened to float: the same model as the float reference's (up to
    float32 rounding: each load times its GEMM forms and may pick another summation order)."""
    packed_dir, ref_dir = make_packed(tmp_path, "llama", "gptq", 32)
    ids = torch.tensor([5, 17, 99, 230, 41, 8])
    logits = []
    for d in (packed_dir, ref_dir):
        runner = ModelRunner(d, device="cpu", dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
        assert runner.model.quantization == "none"
        req = Request("r", ids.tolist(), SamplingParams(max_tokens=1))
        req.block_table = list(range(2))
        logits.append(runner.compute_logits([(req, len(ids))])[0])
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=0)


def test_int4_on_a_packed_checkpoint_keeps_its_groups(tmp_path):
    packed_dir, _ = make_packed(tmp_path, "llama", "awq", 64)
    model = CausalLM.from_pretrained(packed_dir, device="cpu", dtype="float32", quantization="int4",
                                     group_size=32)
    assert model.quantization == "int4" and model.layers[0].qkv.weight.group_size == 64  # as packed, not 32
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.weight.fmt == "int8"  # "int4"'s head


def test_act_order_gptq_is_served_in_float_and_matches_hf(tmp_path):
    packed_dir, ref_dir = make_packed(tmp_path, "llama", "gptq", 32, act_order=True)
    prompts, n = _prompts(), 8
    expected = hf_greedy(ref_dir, prompts, [n] * len(prompts))
    engine, got = _our_greedy(packed_dir, prompts, n, quantization="auto")
    assert engine.runner.model.quantization == "none"  # every projection had act-order: all float
    assert got == expected


@pytest.mark.parametrize(("extra", "match"), [
    ({"bits": 3}, "3 bits: only 4-bit"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "version": "gemv"}, "only AutoAWQ's 'gemm'"),
])
def test_unsupported_packed_checkpoints_are_clear_errors(tmp_path, extra, match):
    packed_dir, _ = make_packed(tmp_path, "llama", "gptq", 32, extra=extra)
    with pytest.raises(PackedWeightError, match=match):
        ModelRunner(packed_dir, device="cpu", dtype="float32", kv_cache_bytes=1 << 20, quantization="auto")
    with pytest.raises(PackedWeightError, match=match):
        CausalLM.from_pretrained(packed_dir, device="cpu", dtype="float32")  # even to de-quantise it


def test_packed_checkpoint_with_tensor_parallelism_is_a_clear_error(tmp_path):
    packed_dir, _ = make_packed(tmp_path, "llama", "awq", 32)
    with pytest.raises(ValueError, match="tensor parallelism with quantised weights"):
        ModelRunner(packed_dir, device="cpu", dtype="float32", kv_cache_bytes=1 << 20, quantization="auto",
                    tensor_parallel_size=2)
