"""GPTQ and AWQ packed layouts onto our int4 (worker/gptq_weights.py), checked against a packer and a
de-quantiser written here straight from the published layouts (AutoGPTQ's v1/v2 ``qweight``/``qzeros``,
AutoAWQ's "gemm" interleaved packing), not from the module under test."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kernels.quant import INT4_GROUP_SIZES, QuantizedWeight
from worker.gptq_weights import PackedWeightError, packed_config, unpack

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: bits 4i of word j hold output column 8j + AWQ_ORDER[i]

# --- the reference: quantise, pack, de-quantise, from the formulas ---------------------------------------------


def quantise(w: torch.Tensor, group: int, g_idx: torch.Tensor | None = None, zero_groups: int = 0,
             positive_groups: int = 0):
    """``w`` ``[out, in]`` -> (q ``[in, out]``, z ``[in/g, out]``, s fp16 ``[in/g, out]``, g_idx ``[in]``):
    min/max (range including 0, as GPTQ does) per (group, output). The first ``zero_groups`` groups are
    all-zero weights (scale 0); the next ``positive_groups`` non-negative (zero point 0)."""
    n_out, n_in = w.shape
    ng = n_in // group
    g_idx = torch.arange(n_in) // group if g_idx is None else g_idx
    w = w.clone()
    for gi in range(ng):
        cols = g_idx == gi
        if gi < zero_groups:
            w[:, cols] = 0.0
        elif gi < zero_groups + positive_groups:
            w[:, cols] = w[:, cols].abs()
    q = torch.zeros(n_in, n_out, dtype=torch.int64)
    z = torch.zeros(ng, n_out, dtype=torch.int64)
    s = torch.zeros(ng, n_out, dtype=torch.float16)
    for gi in range(ng):
        cols = g_idx == gi
        x = w[:, cols]
        lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
        scale = ((hi - lo) / 15).half()
        safe = torch.where(scale > 0, scale.float(), torch.ones(n_out))
        zp = torch.where(scale > 0, torch.round(-lo / safe), torch.full((n_out,), 8.0)).clamp(0, 15)
        q[cols] = torch.round(x / safe[:, None] + zp[:, None]).clamp(0, 15).long().t()
        z[gi], s[gi] = zp.long(), scale
    return q, z, s, g_idx


def _words(acc: torch.Tensor) -> torch.Tensor:
    """uint32 values (held in int64) as the int32 words a checkpoint stores."""
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


def pack_along_rows(v: torch.Tensor) -> torch.Tensor:
    """``[8r, c]`` -> ``[r, c]``: rows 8j..8j+7 into word j, row 8j+i at bits 4i (GPTQ's qweight)."""
    r8, c = v.shape
    v = v.reshape(r8 // 8, 8, c)
    return _words(sum((v[:, i, :] & 0xF) << (4 * i) for i in range(8)))


def pack_along_cols(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """``[r, 8c]`` -> ``[r, c]``: column 8j + order[i] at bits 4i of word j."""
    r, c8 = v.shape
    v = v.reshape(r, c8 // 8, 8)
    return _words(sum((v[:, :, order[i]] & 0xF) << (4 * i) for i in range(8)))


def pack(method: str, q, z, s, g_idx, v2: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ (v1: zeros stored minus one, wrapping at 4 bits; v2: as they are) or AWQ gemm tensors."""
    if method == "gptq":
        return {"qweight": pack_along_rows(q), "qzeros": pack_along_cols(z if v2 else (z - 1) & 0xF),
                "scales": s, "g_idx": g_idx.to(torch.int32)}
    return {"qweight": pack_along_cols(q, AWQ_ORDER), "qzeros": pack_along_cols(z, AWQ_ORDER), "scales": s}


def _nibbles(words: torch.Tensor) -> np.ndarray:
    """int32 words -> ``[..., 8]`` 4-bit values by bit position (numpy, unsigned)."""
    u = words.numpy().view(np.uint32)
    return np.stack([(u >> np.uint32(4 * i)) & np.uint32(15) for i in range(8)], axis=-1).astype(np.int64)


def reference_dequant(method: str, t: dict[str, torch.Tensor], group: int, v2: bool = False) -> torch.Tensor:
    """The float32 ``[out, in]`` weight the packed tensors stand for, from the published formulas (float64
    arithmetic, exact for fp16 scales): GPTQ ``s[g_idx[i], o] (q - (z + 1))`` (v2: ``q - z``), AWQ ``s (q - z)``."""
    s = t["scales"].double().numpy()
    if method == "gptq":
        qw = _nibbles(t["qweight"])  # [in/8, out, 8]: input 8r + i at slot i
        q = qw.transpose(0, 2, 1).reshape(-1, qw.shape[1])  # [in, out]
        z = _nibbles(t["qzeros"]).reshape(t["qzeros"].shape[0], -1) + (0 if v2 else 1)  # [in/g, out]
        g = t["g_idx"].long().numpy()
    else:
        inv = np.argsort(AWQ_ORDER)  # column k sits at slot inv[k]
        q = _nibbles(t["qweight"])[..., inv].reshape(t["qweight"].shape[0], -1)
        z = _nibbles(t["qzeros"])[..., inv].reshape(t["qzeros"].shape[0], -1)
        g = np.arange(q.shape[0]) // group
    w = s[g] * (q - z[g])  # [in, out]
    return torch.from_numpy(w.T.astype(np.float32).copy())


# --- (a) the mapping is exact --------------------------------------------------------------------------------


CASES = [("gptq", False), ("gptq", True), ("awq", False)]


@pytest.mark.parametrize(("method", "v2"), CASES, ids=["gptq", "gptq_v2", "awq"])
@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
@pytest.mark.parametrize("n_out", [8, 24, 40])
def test_unpacked_weight_dequantises_bit_exactly(method, v2, group, n_out):
    torch.manual_seed(group + n_out)
    n_in = 3 * group
    w = torch.randn(n_out, n_in) * 0.05
    q, z, s, g_idx = quantise(w, group, zero_groups=1, positive_groups=1)
    packed = pack(method, q, z, s, g_idx, v2)
    cfg = {"method": method, "group_size": group, "v1": not v2}
    tensors = {f"layers.0.mlp.down_proj.{k}": v for k, v in packed.items()}
    tensors["layers.0.mlp.down_proj.bias"] = torch.ones(n_out)
    out = unpack(tensors, cfg, keep=True)
    assert set(out) == {"layers.0.mlp.down_proj.weight", "layers.0.mlp.down_proj.bias"}
    got = out["layers.0.mlp.down_proj.weight"]
    assert isinstance(got, QuantizedWeight) and got.fmt == "int4" and got.group_size == group
    assert got.codes.dtype == torch.uint8 and got.codes.shape == (n_out, n_in)
    assert got.scale.shape == (n_out, 3) and got.scale.dtype == torch.float32
    assert torch.equal(got.codes, q.t().to(torch.uint8))  # the codes themselves, not re-quantised
    ref = reference_dequant(method, packed, group, v2)
    assert torch.equal(got.dequantize(), ref)
    assert torch.equal(ref[:, :group], torch.zeros(n_out, group))  # the all-zero group
    floats = unpack(tensors, cfg, keep=False)["layers.0.mlp.down_proj.weight"]
    assert torch.equal(floats, ref)


def test_gptq_v1_zero_point_zero_wraps_as_the_gptq_kernels_read_it():
    """v1 stores ``z - 1`` in 4 bits: a zero point of 0 is stored as 15 and read back as 16 (the reason
    "gptq_v2" exists); the mapping must read it as the kernels do, not as the quantiser meant it."""
    q = torch.full((32, 8), 3)
    z, s = torch.zeros(1, 8, dtype=torch.int64), torch.full((1, 8), 0.5, dtype=torch.float16)
    packed = pack("gptq", q, z, s, torch.arange(32) // 32)
    got = unpack({f"p.{k}": v for k, v in packed.items()}, {"method": "gptq", "group_size": 32, "v1": True},
                 keep=True)["p.weight"]
    assert torch.equal(got.dequantize(), torch.full((8, 32), 0.5 * (3 - 16)))


def test_awq_interleaved_order_is_not_confused_with_plain_packing():
    """One output column distinct from the others: it must come back at its own column."""
    q = torch.zeros(32, 16, dtype=torch.int64)
    q[:, 1] = 9
    packed = pack("awq", q, torch.zeros(1, 16, dtype=torch.int64), torch.ones(1, 16, dtype=torch.float16), None)
    got = unpack({f"p.{k}": v for k, v in packed.items()}, {"method": "awq", "group_size": 32}, keep=True)
    w = got["p.weight"].dequantize()
    assert torch.equal(w[1], torch.full((32,), 9.0)) and not w[[0, 2, 3, 4]].any()


def test_gptq_act_order_is_dequantised_to_float_exactly():
    torch.manual_seed(3)
    n_out, n_in, group = 16, 128, 32
    perm = torch.randperm(n_in)
    g_idx = torch.argsort(perm) // group  # GPTQ desc_act: inputs taken in ``perm`` order into groups
    q, z, s, g_idx = quantise(torch.randn(n_out, n_in), group, g_idx=g_idx)
    packed = pack("gptq", q, z, s, g_idx)
    got = unpack({f"p.{k}": v for k, v in packed.items()}, {"method": "gptq", "group_size": group, "v1": True},
                 keep=True)["p.weight"]
    assert not isinstance(got, QuantizedWeight)
    assert torch.equal(got, reference_dequant("gptq", packed, group))


def test_parts_that_do_not_fit_the_group_size_are_refused():
    q, z, s, g_idx = quantise(torch.randn(8, 64), 32)
    packed = pack("gptq", q, z, s, g_idx)
    with pytest.raises(PackedWeightError, match="group size 64"):
        unpack({f"p.{k}": v for k, v in packed.items()}, {"method": "gptq", "group_size": 64, "v1": True},
               keep=True)
    del packed["scales"]
    with pytest.raises(PackedWeightError, match="without scales"):
        unpack({f"p.{k}": v for k, v in packed.items()}, {"method": "gptq", "group_size": 32, "v1": True},
               keep=True)


# --- (c) configurations ------------------------------------------------------------------------------------


def _config(tmp_path, qc):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "quantization_config": qc}))
    return tmp_path


@pytest.mark.parametrize(("qc", "want"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
     {"method": "gptq", "group_size": 128, "v1": True}),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"},
     {"method": "gptq", "group_size": 32, "v1": False}),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
     {"method": "awq", "group_size": 64}),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "GEMM"},
     {"method": "awq", "group_size": 128}),
])
def test_supported_configs(tmp_path, qc, want):
    assert packed_config(_config(tmp_path, qc)) == want


@pytest.mark.parametrize(("qc", "match"), [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits: only 4-bit"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8 bits: only 4-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group size -1: supported group sizes are 32, 64"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group size 16"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin': supported are gptq, gptq_v2"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'.*only AutoAWQ's 'gemm'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "only AutoAWQ's 'gemm'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point False"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "GPTQ or AWQ 4-bit, not quant_method 'bitsandbytes'"),
])
def test_unsupported_configs_are_clear_errors(tmp_path, qc, match):
    with pytest.raises(PackedWeightError, match=match) as exc:
        packed_config(_config(tmp_path, qc))
    assert isinstance(exc.value, ValueError)


def test_a_plain_checkpoint_has_no_packed_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert packed_config(tmp_path) is None
