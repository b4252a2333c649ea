"""Quantised weights: the formats' round-trip bounds, every product form against a float reference (random and
adversarial inputs, odd shapes, each ATen CPU capability this machine runs), and GGUF's blocks read as ours
against the gguf package's own de-quantiser."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernels import quant, quant_gemm, w8a8_panels
from kernels.quant import QuantizedWeight


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g)


def _adversarial(n: int, k: int) -> torch.Tensor:
    """All-zero rows and groups, a constant group, huge outliers, tiny values."""
    w = _weights(n, k, 1)
    w[0] = 0.0
    w[1, :32] = 0.0
    w[2, 32:64] = 0.25
    w[3, 5] = 300.0
    w[4] *= 1e-6
    return w


@pytest.mark.parametrize("make", [_weights, _adversarial])
def test_int8_round_trip_is_within_half_a_step(make):
    w = make(40, 96)
    q = quant.quantize(w, "int8")
    assert q.codes.dtype == torch.int8 and q.codes.abs().max() <= 127
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale[:, None] / 2 + 1e-6).all()
    if make is _adversarial:  # an all-zero row stays exactly zero
        assert (q.dequantize()[0] == 0).all()


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("make", [_weights, _adversarial])
def test_int4_round_trip_is_within_half_a_step(make, group):
    w = make(40, 128)
    q = quant.quantize(w, "int4", group)
    assert q.codes.max() <= 15 and q.scale.shape == (40, 128 // group)
    step = q.scale.repeat_interleave(group, dim=1)
    err = (q.dequantize() - w).abs()
    assert (err <= step / 2 + 1e-5 * (1 + w.abs())).all()
    # the 16 levels span each group's range: its extremes come back within half a step, the scale is at most a
    # float16 rounding above (max - min) / 15, and both are float16 values (the panels' compact form)
    g = w.view(40, -1, group)
    back = q.dequantize().view(40, -1, group)
    half_step = q.scale / 2 + 1e-5 * (1 + g.abs().amax(-1))
    assert ((back.amin(-1) - g.amin(-1)).abs() <= half_step).all()
    assert ((back.amax(-1) - g.amax(-1)).abs() <= half_step).all()
    spread = (g.amax(-1) - g.amin(-1)) / 15
    assert (q.scale >= spread).all() and (q.scale <= spread * (1 + 2**-9) + 1e-6 * (1 + g.abs().amax(-1)) + 1e-30)[spread > 0].all()
    if make is _weights:  # (the adversarial rows hold scales under float16's normal range: float32 stays)
        assert torch.equal(q.scale.half().float(), q.scale)


def test_bad_int4_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of the int4 group size"):
        quant.quantize(_weights(16, 96), "int4", 64)
    with pytest.raises(ValueError, match="group size must be one of"):
        quant.quantize(_weights(16, 96), "int4", 48)
    with pytest.raises(ValueError, match="unknown quantisation format"):
        quant.quantize(_weights(16, 96), "int3")


def _check_forms(n: int, k: int, m: int, make=_weights) -> dict[str, float]:
    """Relative error of every form against ``x @ dequantize(W)^T`` (the float reference), per form."""
    errs = {}
    w = make(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(n)
    for fmt, forms in quant_gemm.FORMS.items():
        q = quant.quantize(w, fmt)
        ref = x @ q.dequantize().t() + bias
        for form in forms:
            lin = quant_gemm.QuantLinear(q, bias, (form,) * 4, keep_rows=True)
            y = lin(x)
            assert y.shape == (m, n) and y.dtype == torch.float32
            errs[f"{form}-{fmt}" if form == "panels" else form] = float((y - ref).norm() / ref.norm())
            out = torch.ones(m, n)
            lin.add_to(out, x)
            torch.testing.assert_close(out, y + 1.0)
    return errs


# bfloat16 activations inside the kernels: ~0.4% per element, far less over a dot product; per-token int8
# activations (w8a8 where our block-32 kernel does not serve it; w8a8w is the same block-32 product) ~1% on
# Gaussian inputs; our panels (kernels/quant_panels.py) keep float32 activations, but for int4's at decode sizes
# on AVX512-VNNI builds: two int8 pieces a block of 32, each within 2^-15 of its block's largest (quant_gemm.c)
BOUNDS = {"w8a16": 0.01, "w8dq": 0.01, "w8a8": 0.03, "w8a8w": 0.03, "w4": 0.01, "w4dq": 0.01, "panels-int8": 1e-5,
          "panels-int4": 1e-4}


@pytest.mark.parametrize(("n", "k", "m"), [(64, 64, 1), (37, 96, 3), (48, 128, 17), (200, 256, 70)])
def test_every_form_matches_the_float_reference(n, k, m):
    errs = _check_forms(n, k, m)
    assert all(errs[f] < BOUNDS[f] for f in errs), errs


def test_forms_on_adversarial_weights():
    errs = _check_forms(48, 128, 5, _adversarial)
    assert all(errs[f] < BOUNDS[f] * 3 for f in errs), errs


_ISA_SCRIPT = """
import json, torch
from tests.unit.test_quant import _check_forms
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "errs": _check_forms(80, 192, 5)}))
"""


def _capabilities() -> list[str]:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    caps = ["default"]
    if " avx2" in flags:
        caps.append("avx2")
    if " avx512f" in flags and " avx512bw" in flags and " avx512vl" in flags:
        caps.append("avx512")
    return caps


@pytest.mark.parametrize("capability", _capabilities())
def test_every_form_on_every_cpu_capability(capability):
    """torch picks its kernels by the CPU's capability; ATEN_CPU_CAPABILITY forces each one this machine has."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, "-c", _ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["capability"].lower() == capability.lower() or capability == "default" and res["capability"] == "DEFAULT"
    assert all(res["errs"][f] < BOUNDS[f] for f in res["errs"]), res


def test_plan_measures_and_records_a_form_per_bucket():
    q = quant.quantize(_weights(64, 128), "int4")
    lin = quant_gemm.plan(q)
    assert len(lin.forms) == len(quant_gemm.BUCKET_LIMITS) + 1
    assert set(lin.forms) <= set(quant_gemm.FORMS["int4"])
    assert any(k.startswith("64x128 int4/g32") for k in quant_gemm.plans())
    weight_only = quant_gemm.plan(quant.quantize(_weights(64, 128), "int8"), activations="float")
    assert set(weight_only.forms) <= {"w8a16", "w8dq", "panels"}
    # our block-32 int8 activations are timed by default where the kernel builds (never torch's per-token form),
    # and kept out of the decode bucket where the panels are a candidate (the fused step multiplies those)
    blocks = quant_gemm.candidates("int8", "blocks", 128)
    assert ("w8a8" in blocks) == w8a8_panels.available() and "w8a8" not in quant_gemm.candidates("int8", "blocks", 48)
    int8 = quant_gemm.plan(quant.quantize(_weights(64, 128), "int8"))
    assert set(int8.forms) <= set(blocks) and int8.forms[0] not in ("w8a8", "w8a8w")
    assert ("w8a8" in int8.forms) == (int8.a8 is not None)
    w8a8 = quant_gemm.plan(quant.quantize(_weights(64, 128), "int8"), activations="any")
    assert set(w8a8.forms) <= {"w8a16", "w8dq", "w8a8", "w8a8w", "panels"}


def test_rows_read_the_dequantised_table():
    w = _weights(50, 64)
    ids = torch.tensor([0, 7, 49, 7])
    for fmt in quant.FORMATS:
        q = quant.quantize(w, fmt)
        lin = quant_gemm.plan(q, embedding=True, autotune=False)
        torch.testing.assert_close(lin.rows(ids), q.dequantize()[ids])


def test_row_operations_apply_to_codes_and_scales():
    w = _weights(32, 64)
    q = quant.quantize(w, "int4")
    perm = torch.randperm(32)
    torch.testing.assert_close(q.rows(perm).dequantize(), q.dequantize()[perm])
    both = quant.cat([q, quant.quantize(w[:8], "int4")])
    torch.testing.assert_close(both.dequantize(), torch.cat([q.dequantize(), q.dequantize()[:8]]))
    with pytest.raises(ValueError):
        quant.cat([q, quant.quantize(w, "int8")])


# --- GGUF blocks ------------------------------------------------------------------------------------


def _gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random valid GGUF blocks of ``kind`` for a ``[rows, cols]`` weight (raw bytes, as GGUFReader gives)."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    d = rng.uniform(0.001, 0.05, size=(rows, nb, 1)).astype(np.float16).view(np.uint8)
    if kind == "Q8_0":
        qs = rng.integers(-127, 128, size=(rows, nb, 32), dtype=np.int8).view(np.uint8)
        return np.concatenate([d, qs], axis=-1).reshape(rows, -1)
    qs = rng.integers(0, 256, size=(rows, nb, 16), dtype=np.uint8)
    if kind == "Q4_1":
        m = rng.uniform(-0.4, 0.0, size=(rows, nb, 1)).astype(np.float16).view(np.uint8)
        return np.concatenate([d, m, qs], axis=-1).reshape(rows, -1)
    return np.concatenate([d, qs], axis=-1).reshape(rows, -1)


class _FakeTensor:
    """What GGUFReader hands the loader for one tensor: its type, GGUF shape (input width first), raw data."""

    def __init__(self, kind: str, rows: int, cols: int) -> None:
        from gguf import GGMLQuantizationType as T

        self.tensor_type = T[kind]
        self.shape = np.array([cols, rows])
        self.data = _gguf_blocks(kind, rows, cols)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_read_as_ours_match_the_gguf_dequantiser(kind):
    from gguf.quants import dequantize

    from worker import gguf_weights

    t = _FakeTensor(kind, 24, 96)
    ref = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(24, 96)
    got = gguf_weights._tensor(t, "blk.0.ffn_up.weight")
    assert isinstance(got, QuantizedWeight)
    assert got.fmt == ("int8" if kind == "Q8_0" else "int4")
    if kind == "Q8_0":  # re-quantised per output channel: within half a step of the per-channel scale
        assert ((got.dequantize() - ref).abs() <= got.scale[:, None] / 2 + 1e-6).all()
    else:  # the 4-bit blocks map exactly
        torch.testing.assert_close(got.dequantize(), ref, atol=1e-6, rtol=1e-6)


def test_gguf_names_and_qk_order_match_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from worker import gguf_weights

    assert gguf_weights.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_weights.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_weights.hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_weights.hf_name("rope_freqs.weight") is None
    w = _weights(4 * 2 * 8, 32)  # 4 heads of dim 16
    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 4})
    ref = torch.from_numpy(proc.process(w.numpy(), "blk.0.attn_q.weight").weights.copy())
    torch.testing.assert_close(gguf_weights._reverse_permute(w, 4), ref)
    q = quant.quantize(w, "int4")
    torch.testing.assert_close(gguf_weights._reverse_permute(q, 4).dequantize(),
                               gguf_weights._reverse_permute(q.dequantize(), 4))


# --- the int8 KV cache rows -------------------------------------------------------------------------


def test_kv_rows_round_trip_within_half_a_step_and_keep_their_scale():
    from kernels import kv_quant

    x = torch.randn(7, 3, 64) * torch.logspace(-3, 2, 7)[:, None, None]  # rows of very different ranges
    x[0, 0] = 0.0  # an all-zero row
    x[1, 1, 5] = 1e4  # an outlier
    rows = kv_quant.pack(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, kv_quant.row_width(64))
    back = kv_quant.unpack(rows)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-30).all()
    assert (back[0, 0] == 0).all()
    # rows moved as a whole (what block gathers and slot scatters do) keep their own scales
    perm = torch.randperm(7)
    torch.testing.assert_close(kv_quant.unpack(rows[perm]), back[perm])
    assert kv_quant.widen(rows, torch.bfloat16).dtype == torch.bfloat16


def test_decode_bucket_keeps_float_activation_forms_for_the_fused_step():
    """At decode sizes the int8-activation forms are not chosen where the panels are a candidate (the fused
    step multiplies float-activation panels only); from the next bucket on they are."""
    from kernels.quant_gemm import _bucket_forms

    forms = ("w8a16", "w8dq", "w8a8", "w8a8w", "panels")
    assert _bucket_forms(forms, 0) == ("w8a16", "w8dq", "panels")
    assert _bucket_forms(forms, 1) == forms
    assert _bucket_forms(("w8a16", "w8a8"), 0) == ("w8a16", "w8a8")  # no panels: nothing to keep the step for
