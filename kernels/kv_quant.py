"""The int8 KV cache (``kv_cache_dtype=int8``): each (token, KV head) row of ``D`` values stored as ``D`` int8
codes followed by its float32 scale in 4 more bytes, in one int8 tensor ``[blocks, block_size, Hkv, D + 4]``.

Why one tensor: every path that moves KV (the block-granular gathers of decode, the slot scatter of the cache
write, prefix-cache block sharing, preemption) moves rows of this tensor unchanged, so a row's scale can
never be separated from its codes. Why a scale per (token, head) rather than per block: a block fills over
many steps, and a block-wide scale fixed by its first token would clip the later ones; a per-row scale costs
4 bytes per ``D`` (``D`` = 64: 68 bytes a row against bfloat16's 128, 1.9x the tokens per memory budget).

Rows are symmetric (``code = round(x / scale)``, ``scale = max|x| / 127``), written by :func:`pack` in the
cache write. The C attention kernels (:mod:`kernels.cpu_attention`) read them in place, codes widened in
registers and each row's scale applied once per row; the torch path widens them with :func:`unpack` where it
gathers them (the kernels' reference, and the fallback). Quality against float32: ``python -m bench quality``
(variant ``kv-int8``).

``kv_cache_dtype=fp8_e4m3`` keeps the same rows with float8 e4m3 codes (``scale = max|x| / 448``, the codes
rounded to nearest even by torch's conversion), in a uint8 tensor (the dtype that tells the two kinds apart:
torch's own float8 dtype has no CPU indexing ops, and the cache is only ever moved as bytes). Its 3 mantissa bits
keep small components relatively better than int8's uniform grid and large ones worse; the kernels widen a
code with one float16 conversion (``csrc/simd.h``, ``ELEM_F8``).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
FP8_ROWS = torch.uint8  # the storage dtype of float8 e4m3 rows
FP8_MAX = 448.0  # the largest finite e4m3 value
QUANTIZED = (torch.int8, FP8_ROWS)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds rows of codes and a scale (int8 or float8 e4m3)."""
    return dtype in QUANTIZED


def row_width(head_dim: int) -> int:
    """int8 elements per (token, head) row: the codes and the scale."""
    return head_dim + SCALE_BYTES


def pack(x: torch.Tensor, rows: torch.dtype = torch.int8) -> torch.Tensor:
    """``[..., D]`` float -> ``[..., D + 4]`` rows of ``rows`` (int8, or float8 e4m3 codes as uint8): the codes,
    then the float32 scale's bytes."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)
    if rows == FP8_ROWS:
        scale = amax / FP8_MAX
        codes = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat((codes, scale.view(torch.uint8)), dim=-1)
    scale = amax / 127.0
    codes = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def unpack(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., D + 4]`` int8 or float8 rows -> ``[..., D]`` values in ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    codes = rows[..., :d]
    if rows.dtype == FP8_ROWS:
        codes = codes.contiguous().view(torch.float8_e4m3fn)
    return (codes.to(torch.float32) * scale).to(dtype)


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows in the attention's ``dtype``: unpacked if int8 or float8, converted if narrower."""
    if is_quantized(t.dtype):
        return unpack(t, dtype)
    return t if t.dtype == dtype else t.to(dtype)
