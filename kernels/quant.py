"""Quantised weights: the formats, quantising float weights into them, and reading them back.

Two formats, both row-major over the weight's ``[out, in]`` layout so that every row operation the loader
does on float weights (stacking q/k/v, permuting q/k rows for RoPE, slicing a tied head's rows) applies to
the codes and the scales alike:

- ``int8``: symmetric, one scale per output channel: ``w = q * scale[row]``, ``q`` in [-127, 127].
- ``int4``: groups of ``group_size`` inputs along each row, each with a scale and a zero point (asymmetric,
  min/max; the grid in float16 values where it fits, so the panels keep it in half the bytes):
  ``w = (q - 8) * scale + zero`` with ``q`` in [0, 15]. That is torch's int4 CPU matmul convention,
  and GGUF's blocks map onto it exactly in form: Q4_1 (``d * q + m``) is ``scale = d, zero = m + 8 d``; Q4_0
  (``d * (q - 8)``) is ``scale = d, zero = 0``.

The products are in :mod:`kernels.quant_gemm`; quality is measured against float32 by ``python -m bench
quality`` (perplexity, KL, greedy agreement), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FORMATS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantised ``[out, in]`` weight. ``codes``: int8 ``[out, in]`` (int8) or uint8 ``[out, in]`` holding
    0..15 (int4, unpacked: the matmul packs it its own way); ``scale``: float32 ``[out]`` (int8) or
    ``[out, in / group_size]`` (int4); ``zero``: float32 like ``scale`` (int4) or None."""

    fmt: str
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    group_size: int = 0  # int4 only

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight's rows ``index`` (a permutation or a selection), codes and scales alike."""
        zero = None if self.zero is None else self.zero.index_select(0, index)
        return replace(self, codes=self.codes.index_select(0, index), scale=self.scale.index_select(0, index),
                       zero=zero)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self).to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the format needs (int4 codes count half a byte each, as packed), scales included."""
        code_bytes = self.codes.numel() // 2 if self.fmt == "int4" else self.codes.numel()
        extra = self.scale.numel() * 4 + (self.zero.numel() * 4 if self.zero is not None else 0)
        return code_bytes + extra


def quantize(w: torch.Tensor, fmt: str, group_size: int = 32) -> QuantizedWeight:
    """``w`` (``[out, in]`` float) in ``fmt`` ("int8" or "int4")."""
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "int4":
        return quantize_int4(w, group_size)
    raise ValueError(f"unknown quantisation format {fmt!r} (one of {', '.join(FORMATS)})")


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8: the largest magnitude of each row maps to 127 (an all-zero row
    gets scale 1 and codes 0)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", codes.contiguous(), scale.contiguous())


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric group-wise int4 (min/max per group of ``group_size`` inputs): 16 levels span each group's
    range (on a float16 grid where it fits, :func:`_half_grid`), so every weight, the extremes included, is
    within half a step of a level. An input width that is not a whole
    number of groups is an error (every Llama-family width is a multiple of 32)."""
    n, k = w.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {group_size}")
    if k % group_size:
        raise ValueError(f"input width {k} is not a multiple of the int4 group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale, codes 0
    scale, lo = _half_grid(lo, hi, scale)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    zero = lo + 8.0 * scale
    return QuantizedWeight("int4", codes.reshape(n, k).contiguous(), scale.contiguous(), zero.contiguous(),
                           group_size)


def _half_grid(lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups' grids (scale, minimum) in float16 values where every scale stays a normal float16, as GGUF's
    blocks store theirs: the panels then keep them in half the bytes (kernels/quant_panels.py). The minimum is
    rounded down and the scale up, so the 16 levels still span the group's range and every weight stays within
    half a step of one; otherwise (a scale under 2^-14) the float32 grid, unchanged."""
    down = torch.full_like(lo, float("-inf")).half()
    lo16 = lo.half()
    lo16 = torch.where(lo16.float() > lo, torch.nextafter(lo16, down), lo16).float()
    s16 = ((hi - lo16) / 15.0).half()
    s16 = torch.where(lo16 + 15.0 * s16.float() < hi, torch.nextafter(s16, -down), s16).float()
    s16 = torch.where(hi > lo, s16, torch.ones_like(s16))  # a constant group: any scale, codes 0
    if bool((s16 >= 2.0**-14).all() and torch.isfinite(s16).all() and torch.isfinite(lo16).all()):
        return s16, lo16
    return scale, lo


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """The float32 ``[out, in]`` weight ``q`` stands for."""
    if q.fmt == "int8":
        return q.codes.float() * q.scale[:, None]
    n, k = q.codes.shape
    g = q.codes.reshape(n, k // q.group_size, q.group_size).float()
    assert q.zero is not None
    return ((g - 8.0) * q.scale[..., None] + q.zero[..., None]).reshape(n, k)


def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output dimension (fused q/k/v or gate/up)."""
    first = parts[0]
    if any(p.fmt != first.fmt or p.group_size != first.group_size for p in parts):
        raise ValueError("cannot stack weights of different quantisation formats")
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])  # type: ignore[misc]
    return replace(first, codes=torch.cat([p.codes for p in parts]), scale=torch.cat([p.scale for p in parts]),
                   zero=zero)
