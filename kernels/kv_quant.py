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
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_width(head_dim: int) -> int:
    """int8 elements per (token, head) row: the codes and the scale."""
    return head_dim + SCALE_BYTES


def pack(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` float -> ``[..., D + 4]`` int8 rows (codes, then the float32 scale's bytes)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30) / 127.0
    codes = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def unpack(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., D + 4]`` int8 rows -> ``[..., D]`` values in ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].to(torch.float32) * scale).to(dtype)


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows in the attention's ``dtype``: unpacked if int8, converted if narrower."""
    if t.dtype == torch.int8:
        return unpack(t, dtype)
    return t if t.dtype == dtype else t.to(dtype)
