"""GPTQ- and AWQ-packed safetensors checkpoints read as they are: 4-bit weights kept quantised, not widened.

A pre-quantised Hugging Face checkpoint (``quantization_config`` in ``config.json``) stores each quantised
projection as packed int32 words plus fp16 scales instead of a ``.weight``. Both layouts are group-wise
asymmetric 4-bit over the input dimension, which is :mod:`kernels.quant`'s int4 format in another packing, so
each projection maps onto a ``QuantizedWeight("int4")`` with the checkpoint's own group size, exactly (as
``worker.gguf_weights`` does for GGUF's Q4 blocks) rather than being de-quantised and re-quantised:

- GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` "gptq"): ``qweight`` int32 ``[in/8, out]`` (input ``8r+i``
  at bits ``4i`` of row ``r``), ``qzeros`` int32 ``[in/g, out/8]`` (packed along out the same way), ``scales``
  fp16 ``[in/g, out]``, ``g_idx`` ``[in]``; ``w = s (q - (z + 1))``: v1 files store the zero minus one (a zero of
  0 wraps to 15, read back as 16, as the GPTQ kernels read it). "gptq_v2" stores ``z`` itself.
- AWQ (AutoAWQ "gemm"): ``qweight`` int32 ``[in, out/8]`` packed along out in AutoAWQ's interleaved order
  (output column ``8j + order[i]`` at bits ``4i``, ``order = 0 2 4 6 1 3 5 7``), ``qzeros`` alike, ``scales``
  fp16 ``[in/g, out]``; ``w = s (q - z)``.

Either is ``scale = s``, ``zero = s (8 - z)`` in ``w = (q - 8) scale + zero``; with fp16 scales both products
are exact in float32, so ``dequantize()`` gives the checkpoint's float weights bit for bit. A GPTQ projection
quantised with act-order (``g_idx`` not ``arange(in) // g``) has its groups scattered over the inputs, which no
product here can read: it is de-quantised to float, with a logged notice. Anything else (other bit widths,
group sizes, AWQ versions, GPTQ formats, quantisation methods) is refused with a :class:`PackedWeightError`
naming what is supported, before any weight is read. Names and rows stay Hugging Face's, so the loader treats
these weights like any other HF checkpoint's (no q/k permutation beyond what it does for float weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inferq.log import get_logger
from kernels.quant import INT4_GROUP_SIZES, QuantizedWeight
from worker.model_config import ModelError

log = get_logger(__name__)

METHODS = ("gptq", "awq")
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4i of a word hold output column 8j + _AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


class PackedWeightError(ModelError, ValueError):
    """A GPTQ/AWQ checkpoint this loader cannot serve (the message says what it supports)."""


def packed_config(model_dir: Path) -> dict | None:
    """The checkpoint's GPTQ/AWQ settings (``method``, ``group_size``, and ``v1`` for GPTQ's stored-zero-minus-one
    format), or None for a checkpoint without ``quantization_config``. Checked here, from the config alone, so
    an unsupported file fails at once and clearly rather than as missing ``.weight`` tensors later."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # (load_config reports an unreadable config)
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise PackedWeightError(f"{model_dir}: pre-quantised checkpoints are supported as GPTQ or AWQ 4-bit, "
                                f"not quant_method {qc.get('quant_method')!r}")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise PackedWeightError(f"{model_dir}: {method.upper()} with {bits} bits: only 4-bit is supported")
    if group not in INT4_GROUP_SIZES:
        raise PackedWeightError(f"{model_dir}: {method.upper()} group size {group}: supported group sizes are "
                                f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in GPTQ_FORMATS:
            raise PackedWeightError(f"{model_dir}: GPTQ checkpoint_format {fmt!r}: supported are "
                                    f"{', '.join(GPTQ_FORMATS)}")
        return {"method": method, "group_size": group, "v1": fmt == "gptq"}
    version = str(qc.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS or qc.get("zero_point", True) is False:
        raise PackedWeightError(f"{model_dir}: AWQ version {version!r} (zero_point {qc.get('zero_point', True)}):"
                                f" only AutoAWQ's 'gemm' packing with zero points is supported")
    return {"method": method, "group_size": group}


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[r, c]`` packing 8 values along the rows (value ``i`` of row ``j`` is row ``8j + i``) ->
    ``[8r, c]`` codes 0..15 (int32)."""
    r, c = words.shape
    return ((words[:, None, :] >> _SHIFTS[None, :, None]) & 0xF).reshape(8 * r, c)


def _unpack_cols(words: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[r, c]`` packing 8 values along the columns -> ``[r, 8c]`` codes 0..15 (int32). ``order``:
    bits ``4i`` of word ``j`` hold column ``8j + order[i]`` (AWQ); None: column ``8j + i`` (GPTQ)."""
    r, c = words.shape
    vals = (words[:, :, None] >> _SHIFTS) & 0xF  # [r, c, 8], by bit position
    if order is not None:
        inverse = torch.tensor(sorted(range(8), key=lambda i: order[i]))  # column k sits at bit slot inverse[k]
        vals = vals[:, :, inverse]
    return vals.reshape(r, 8 * c)


def _int4(codes_io: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group: int) -> QuantizedWeight:
    """``w[o, i] = s[i/g, o] (q[i, o] - z[i/g, o])`` as our int4 (``scale = s``, ``zero = s (8 - z)``: exact in
    float32 for fp16 ``s`` and integer ``z`` in 0..16, as is ``(q - 8) s + zero``)."""
    s = scales.float().t().contiguous()
    zero = s * (8.0 - z.float().t())
    return QuantizedWeight("int4", codes_io.t().to(torch.uint8).contiguous(), s, zero.contiguous(), group)


def _check_shapes(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  n_in: int, n_out: int, group: int) -> None:
    """A packed projection whose parts disagree with each other or with the group size is refused, not read
    into a silently wrong weight."""
    expect = {"scales": (n_in // group, n_out), "qzeros": (n_in // group, n_out // 8)}
    got = {"scales": tuple(scales.shape), "qzeros": tuple(qzeros.shape)}
    if n_in % group or got != expect or qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise PackedWeightError(f"{name}: packed tensors do not fit a 4-bit layout with group size {group} "
                                f"(qweight {tuple(qweight.shape)} {qweight.dtype}, {got}, expected {expect})")


def _gptq(name: str, p: dict[str, torch.Tensor], cfg: dict) -> QuantizedWeight | torch.Tensor:
    """One GPTQ projection: int4 as stored, or float when act-order scatters its groups (see the module)."""
    group = cfg["group_size"]
    qweight, qzeros, scales = p["qweight"], p["qzeros"], p["scales"]
    n_in, n_out = 8 * qweight.shape[0], qweight.shape[1]
    _check_shapes(name, qweight, qzeros, scales, n_in, n_out, group)
    codes = _unpack_rows(qweight)  # [in, out]
    z = _unpack_cols(qzeros) + (1 if cfg["v1"] else 0)  # [in/g, out]
    g_idx = p.get("g_idx")
    trivial = torch.arange(n_in, dtype=torch.int64) // group
    if g_idx is None or torch.equal(g_idx.to(torch.int64), trivial):
        return _int4(codes, z, scales, group)
    g = g_idx.to(torch.int64)
    if g.shape != (n_in,) or int(g.min()) < 0 or int(g.max()) >= n_in // group:
        raise PackedWeightError(f"{name}: g_idx does not index the {n_in // group} groups")
    return (scales.float()[g] * (codes - z[g]).float()).t().contiguous()  # [out, in]


def _awq(name: str, p: dict[str, torch.Tensor], cfg: dict) -> QuantizedWeight:
    """One AWQ (gemm) projection as int4."""
    group = cfg["group_size"]
    qweight, qzeros, scales = p["qweight"], p["qzeros"], p["scales"]
    n_in, n_out = qweight.shape[0], 8 * qweight.shape[1]
    _check_shapes(name, qweight, qzeros, scales, n_in, n_out, group)
    return _int4(_unpack_cols(qweight, _AWQ_ORDER), _unpack_cols(qzeros, _AWQ_ORDER), scales, group)


def unpack(tensors: dict[str, torch.Tensor], cfg: dict, *, keep: bool,
           where: str = "checkpoint") -> dict[str, torch.Tensor | QuantizedWeight]:
    """The checkpoint's tensors by Hugging Face name with every packed projection ``<p>.qweight`` (and its
    ``qzeros``/``scales``/``g_idx``) replaced by ``<p>.weight``: int4 when ``keep``, else de-quantised to
    float32 (what a float model, a draft model or a tensor-parallel shard reads). Other tensors pass as they
    are."""
    prefixes = [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]
    packed = {f"{p}.{k}" for p in prefixes for k in _PARTS}
    out: dict[str, torch.Tensor | QuantizedWeight] = {n: t for n, t in tensors.items() if n not in packed}
    read = _gptq if cfg["method"] == "gptq" else _awq
    floats = 0
    for prefix in prefixes:
        parts = {k: tensors[f"{prefix}.{k}"] for k in _PARTS if f"{prefix}.{k}" in tensors}
        missing = [k for k in ("qzeros", "scales") if k not in parts]
        if missing:
            raise PackedWeightError(f"{where}: {prefix}.qweight without {', '.join(missing)}")
        w = read(prefix, parts, cfg)
        if isinstance(w, QuantizedWeight) and not keep:
            w = w.dequantize()
        floats += not isinstance(w, QuantizedWeight)
        out[f"{prefix}.weight"] = w
    if keep and floats:
        log.info("GPTQ act-order projections (g_idx not in group order) de-quantised to float", where=where,
                 projections=floats, of=len(prefixes))
    elif not keep and prefixes:
        log.info(f"{cfg['method'].upper()} checkpoint de-quantised to float (--quantization auto or int4 keeps "
                 "its 4-bit weights)", where=where, projections=len(prefixes))
    return out
