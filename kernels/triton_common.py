"""Shared pieces of the Triton paged-attention kernels: launch helpers, the KV-cache write, and the
online-softmax tile step both attention kernels loop over.

Conventions (see docs/INTERFACES.md, section "Kernels"):

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (last dim contiguous).
* ``query``: ``[T, Hq, D]`` flattened over sequences; ``query_start_loc`` int32 ``[S+1]``.
* ``seq_lens`` int32 ``[S]``: context length *including* this step's tokens.
* ``block_tables`` int32 ``[S, max_blocks]``; entries past a sequence's blocks are padding (never read).
* ``slot_mapping`` int64 ``[T]``: ``slot = block * block_size + offset``; negative slots are skipped.
* Causal: query token ``j`` of a chunk of ``q_len`` tokens of sequence ``s`` sits at position
  ``seq_lens[s] - q_len + j`` and attends to positions ``0..that``.
* GQA: query head ``h`` uses kv head ``h // (Hq // Hkv)``.

``write_kv_cache``: one program per token scatters all kv heads of that token into its slot.

All softmax statistics and accumulators are float32; inputs may be float16, bfloat16 or float32
(float32 dots use IEEE precision, not TF32). Any head dim works (tiles are padded to a power of two and
masked); any block size works (tiles gather token rows through the block table).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


def _next_pow2(x: int) -> int:
    x = int(x)
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _interpreting() -> bool:
    """Whether this module's kernels were decorated for the Triton interpreter (TRITON_INTERPRET=1 when
    triton was imported): decided once, at import, like the kernels themselves."""
    return _INTERPRETED


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return _sm_count(idx)
    return 8  # interpreter / CPU: any small number


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: full IEEE precision (TF32 would cost ~1e-3 relative error); ignored otherwise.
    return "ieee" if dtype == torch.float32 or _dot_f32(dtype) else "tf32"


def _dot_f32(dtype: torch.dtype) -> bool:
    # The Triton interpreter's tl.dot multiplies bfloat16 tiles as raw int16 bits: upcast there.
    return dtype == torch.bfloat16 and _interpreting()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache must be contiguous in the last (head_dim) dimension")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_heads(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The query's head dim matches the cache's and its heads split evenly over the kv heads."""
    D, Hq = query.shape[2], query.shape[1]
    Hkv, Dc = k_cache.shape[2], k_cache.shape[3]
    if Dc != D:
        raise ValueError(f"query head dim {D} != cache head dim {Dc}")
    if Hq % Hkv != 0:
        raise ValueError(f"num query heads {Hq} not a multiple of num kv heads {Hkv}")


# ---------------------------------------------------------------------------------------------------
# write_kv_cache
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(
        k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(
        v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


_INTERPRETED = not isinstance(_write_kv_cache_kernel, triton.runtime.jit.JITFunction)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the paged caches at ``slot_mapping`` (in place)."""
    _check_cache(k_cache, v_cache)
    T = key.shape[0]
    if T == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match cache heads/dim "
            f"({num_kv_heads}, {head_dim})"
        )
    if slot_mapping.numel() != T:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries for {T} tokens")
    key = _last_dim_contiguous(key)
    value = _last_dim_contiguous(value)
    slot_mapping = slot_mapping.contiguous()
    _write_kv_cache_kernel[(T,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        head_dim,
        block_size,
        BLOCK_H=_next_pow2(num_kv_heads),
        BLOCK_D=_next_pow2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )


# ---------------------------------------------------------------------------------------------------
# shared online-softmax tile step
# ---------------------------------------------------------------------------------------------------


# Long by necessity: a @triton.jit body can only call other JIT functions, not Python helpers.
@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    n0,
    n_end,
    row_pos,
    kvh,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    block_size,
    dmask,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BOUNDS: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """One K/V tile of BLOCK_N tokens starting at n0: gather rows through the block table, update the
    running max ``m_i``, sum ``l_i`` and output ``acc`` (log2 domain; scores scaled by qk_scale)."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    if BOUNDS:
        nmask = n < n_end
        blk = tl.load(bt_ptr + n // block_size, mask=nmask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_ptr + n // block_size).to(tl.int64)
    off = (n % block_size).to(tl.int64)
    k_ptrs = k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks + kvh * stride_kh + d[:, None]
    v_ptrs = v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :]
    if BOUNDS:
        if EVEN_D:
            k = tl.load(k_ptrs, mask=nmask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=nmask[None, :] & dmask[:, None], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=dmask[:, None], other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        qk = tl.where(n[None, :] <= row_pos[:, None], qk, float("-inf"))
    elif BOUNDS:
        qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if BOUNDS:
        if EVEN_D:
            v = tl.load(v_ptrs, mask=nmask[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)
    else:
        if EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dmask[None, :], other=0.0)
    if DOT_F32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
