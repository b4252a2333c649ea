"""A half-precision model's per-layer elementwise ops on a GPU, one Triton kernel each (CUDA; ``TRITON_INTERPRET=1``
for testing): RMSNorm, and RoPE (rotate-half) of the q and k heads into dense q and k.

Why: ``worker/model.py`` computes these as Hugging Face does, in torch ops: a bfloat16 norm is eight kernels
(widen, square, mean, add, rsqrt, scale, round, weight), RoPE and the dense copies the attention kernels take
about nine. On a GPU, where a small model's decode step is a chain of launches (even replayed as a CUDA graph,
worker/cuda_graphs.py), they were over half the step's kernels. Each kernel rounds where the torch chain rounds.
Float32 models keep ``F.rms_norm`` and their complex RoPE.

RoPE is for bfloat16 (the GPU's default half type) and bit-identical to the torch chain, its roundings done by
integer ops. A float16 model keeps the torch chain: on an H100 the kernel's float16 casts gave other bits than
torch's in a test, not yet explained. The norm (both half types) is not bit-identical: its mean of squares is summed in another order, so a
row's scale can differ in its last bits and an element then round to the neighbouring value (the tests bound it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import _next_pow2

DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _round_bf16(v):
    """float32 ``v`` rounded to the nearest bfloat16 (ties to even), still float32: then the cast is exact.
    Why by hand: Triton's interpreter truncates a float32 -> bfloat16 cast, where a GPU rounds."""
    u = v.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, n, eps, BLOCK: tl.constexpr,
                     BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if BF16:
        out = _round_bf16(w * _round_bf16(y))
    else:  # HF: weight * hidden_states.to(input_dtype), two roundings
        out = w * y.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dim of ``x`` ``[T, N]`` (rows may be strided, the last
    dim contiguous), computed in float32; a new ``[T, N]`` tensor of ``x``'s dtype."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],) or x.dtype not in DTYPES:
        raise ValueError(f"rms_norm needs [T, N] half rows with a contiguous last dim and an [N] weight, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)}")
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        _rms_norm_kernel[(t,)](x, weight.contiguous(), out, x.stride(0), n, n, float(eps), BLOCK=_next_pow2(n),
                               BF16=x.dtype == torch.bfloat16)
    return out


@triton.jit
def _round_to(v, BF16: tl.constexpr, out_ty: tl.constexpr):
    """float32 ``v`` rounded to the model's half type, as float32 (each torch op on half tensors rounds)."""
    if BF16:
        return _round_bf16(v)
    return v.to(out_ty).to(tl.float32)


@triton.jit
def _rope_half_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, qkv_stride, cos_stride, sin_stride, HQ, HKV,
                      D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    src = qkv_ptr + t * qkv_stride + h * D
    x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * cos_stride + j, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sin_stride + j, mask=mask, other=0.0).to(tl.float32)
    ty = q_ptr.dtype.element_ty
    # x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product and each sum rounded, as torch computes them
    o1 = _round_to(_round_to(x1 * c, BF16, ty) - _round_to(x2 * s, BF16, ty), BF16, ty)
    o2 = _round_to(_round_to(x2 * c, BF16, ty) + _round_to(x1 * s, BF16, ty), BF16, ty)
    if h < HQ:
        dst = q_ptr + (t * HQ + h) * D
    else:
        dst = k_ptr + (t * HKV + h - HQ) * D
    tl.store(dst + j, o1.to(ty), mask=mask)
    tl.store(dst + HALF + j, o2.to(ty), mask=mask)


def rope_half(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half) of the q and k heads of bfloat16 ``qkv`` ``[T, (Hq + 2 Hkv) D]`` with bfloat16 ``cos``/``sin``
    rows ``[T, D/2]`` (each may have strided rows): dense q ``[T, Hq, D]`` and k ``[T, Hkv, D]``."""
    t = qkv.shape[0]
    if (qkv.dim() != 2 or qkv.stride(-1) != 1 or qkv.dtype != torch.bfloat16 or head_dim % 2
            or qkv.shape[1] < (num_q_heads + num_kv_heads) * head_dim or cos.shape != (t, head_dim // 2)
            or sin.shape != cos.shape or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype
            or cos.stride(-1) != 1 or sin.stride(-1) != 1):
        raise ValueError(f"rope_half needs [T, (Hq + 2 Hkv) D] bfloat16 rows and [T, D/2] bfloat16 cos/sin, got "
                         f"{tuple(qkv.shape)} {qkv.dtype}, {tuple(cos.shape)} {cos.dtype}")
    q = torch.empty((t, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t:
        half = head_dim // 2
        _rope_half_kernel[(t, num_q_heads + num_kv_heads)](
            qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), sin.stride(0), num_q_heads, num_kv_heads,
            D=head_dim, HALF=half, BLOCK=_next_pow2(half), BF16=qkv.dtype == torch.bfloat16)
    return q, k
