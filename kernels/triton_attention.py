"""Triton kernels for paged attention over a block-paged KV cache.

Conventions (see docs/INTERFACES.md, section "Kernels"):

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (last dim contiguous).
* ``query``: ``[T, Hq, D]`` flattened over sequences; ``query_start_loc`` int32 ``[S+1]``.
* ``seq_lens`` int32 ``[S]``: context length *including* this step's tokens.
* ``block_tables`` int32 ``[S, max_blocks]``; entries past a sequence's blocks are padding (never read).
* ``slot_mapping`` int64 ``[T]``: ``slot = block * block_size + offset``; negative slots are skipped.
* Causal: query token ``j`` of a chunk of ``q_len`` tokens of sequence ``s`` sits at position
  ``seq_lens[s] - q_len + j`` and attends to positions ``0..that``.
* GQA: query head ``h`` uses kv head ``h // (Hq // Hkv)``.

Kernels:

* ``write_kv_cache``: one program per token scatters all kv heads of that token into its slot.
* ``paged_decode_attention``: one query token per sequence. One program handles *all* query heads of a
  kv-head group (the group is padded to a >=16-row tile so ``tl.dot`` applies), so each K/V tile is loaded
  once per group. Long contexts are split into partitions (split-K): each partition writes its running
  max, sum of exponentials and unnormalised partial output, and a second kernel combines them, so a
  single long request still occupies many SMs.
* ``paged_prefill_attention``: variable-length query chunks attending causally to themselves and to
  everything earlier in the block table, with K/V read straight from the paged cache (callers write the
  chunk's K/V into the cache first). Rows of the query tile pack ``BLOCK_Q`` tokens x the query heads of
  one kv-head group, so K/V are again loaded once per group.

All softmax statistics and accumulators are float32; inputs may be float16, bfloat16 or float32
(float32 dots use IEEE precision, not TF32). Any head dim works (tiles are padded to a power of two and
masked); any block size works (tiles gather token rows through the block table).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = [
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_attention",
    "default_num_splits",
]

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


# ---------------------------------------------------------------------------------------------------
# decode (one query token per sequence), split-K
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pms,
    stride_pmh,
    head_dim,
    block_size,
    partition_size,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    start = part * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < head_dim
    qh = kvh * GROUP + g
    q = tl.load(
        q_ptr + s * stride_qt + qh[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_ptr = block_tables_ptr + s * stride_bt
    # Full tiles need no token-bounds masking; the (at most one) ragged tail tile does.
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_ptr, n0, end, m_i, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size, dmask,
            BLOCK_N, BLOCK_D, False, False, DOT_PRECISION, DOT_F32, EVEN_D,
        )
    for n0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_ptr, n0, end, m_i, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size, dmask,
            BLOCK_N, BLOCK_D, True, False, DOT_PRECISION, DOT_F32, EVEN_D,
        )

    omask = gmask[:, None] & dmask[None, :]
    if USE_SPLITS:
        tl.store(
            part_out_ptr + s * stride_pos + qh[:, None] * stride_poh + part * stride_pop + d[None, :],
            acc,
            mask=omask,
        )
        tl.store(part_m_ptr + s * stride_pms + qh * stride_pmh + part, m_i, mask=gmask)
        tl.store(part_l_ptr + s * stride_pms + qh * stride_pmh + part, l_i, mask=gmask)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + s * stride_ot + qh[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=omask,
        )


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    seq_lens_ptr,
    stride_ot,
    stride_oh,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pms,
    stride_pmh,
    head_dim,
    partition_size,
    num_splits,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + s)
    n_parts = tl.minimum(tl.cdiv(seq_len, partition_size), num_splits)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    pmask = p < n_parts
    dmask = d < head_dim
    m = tl.load(part_m_ptr + s * stride_pms + h * stride_pmh + p, mask=pmask, other=float("-inf"))
    l_p = tl.load(part_l_ptr + s * stride_pms + h * stride_pmh + p, mask=pmask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.where(pmask, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l_p, 0)
    denom = tl.where(denom > 0, denom, 1.0)
    o = tl.load(
        part_out_ptr + s * stride_pos + h * stride_poh + p[:, None] * stride_pop + d[None, :],
        mask=pmask[:, None] & dmask[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + s * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


# Split-K heuristic (tune with `python -m bench.kernels --sweep` on the target GPU): aim for this many
# decode programs (CTAs of 4 warps) per SM so that enough loads are in flight to approach peak memory
# bandwidth, without making a partition shorter than _MIN_PARTITION tokens.
_SPLIT_CTAS_PER_SM = 4
_MIN_PARTITION = 256
_MAX_SPLITS = 256


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device, min_partition: int = _MIN_PARTITION
) -> int:
    """Number of context partitions for a decode batch: enough that ``num_seqs * num_kv_heads * splits``
    programs give every SM ~``_SPLIT_CTAS_PER_SM`` of them, but partitions no shorter than
    ``min_partition`` tokens (a big batch or a short context gets 1: no split, no reduce kernel)."""
    programs = max(1, num_seqs * num_kv_heads)
    target = _SPLIT_CTAS_PER_SM * _num_sms(device)
    splits = _cdiv(target, programs)
    return int(max(1, min(splits, _cdiv(max(1, max_context), min_partition), _MAX_SPLITS)))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence (``query`` ``[S, Hq, D]``) over its paged context.

    ``num_splits``: number of context partitions (split-K); ``None`` picks one from the batch size and
    the SM count. ``max_seq_len`` (host int, optional) bounds the context length; without it the bound
    is ``block_tables.shape[1] * block_size`` (no device sync either way). ``block_n`` overrides the
    K/V tile length (tests use it to exercise many tiles on tiny inputs).
    """
    _check_cache(k_cache, v_cache)
    S, Hq, D = query.shape
    _, block_size, Hkv, Dc = k_cache.shape
    if Dc != D:
        raise ValueError(f"query head dim {D} != cache head dim {Dc}")
    if Hq % Hkv != 0:
        raise ValueError(f"num query heads {Hq} not a multiple of num kv heads {Hkv}")
    if block_tables.shape[0] != S or seq_lens.shape[0] != S:
        raise ValueError(
            f"decode expects one query token per sequence: query has {S} tokens, block_tables "
            f"{block_tables.shape[0]} rows, seq_lens {seq_lens.shape[0]} entries"
        )
    if out is None:
        out = torch.empty_like(query)
    if S == 0:
        return out
    query = _last_dim_contiguous(query)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()

    group = Hq // Hkv
    BLOCK_G = max(16, _next_pow2(group))
    BLOCK_D = max(16, _next_pow2(D))
    if block_n is None:
        block_n = 64 if BLOCK_D <= 128 else 32
    BLOCK_N = max(16, _next_pow2(block_n))

    max_ctx = int(max_seq_len) if max_seq_len is not None else block_tables.shape[1] * block_size
    max_ctx = max(1, min(max_ctx, block_tables.shape[1] * block_size))
    if num_splits is None:
        num_splits = default_num_splits(S, Hkv, max_ctx, query.device)
    num_splits = max(1, int(num_splits))
    partition_size = _cdiv(_cdiv(max_ctx, num_splits), BLOCK_N) * BLOCK_N
    num_splits = _cdiv(max_ctx, partition_size)
    use_splits = num_splits > 1
    if not use_splits:  # one partition: let it span the whole block table, whatever max_seq_len said
        partition_size = max(partition_size, block_tables.shape[1] * block_size)

    qk_scale = float(scale) * _LOG2E
    if use_splits:
        part_out = torch.empty((S, Hq, num_splits, D), dtype=torch.float32, device=query.device)
        part_m = torch.empty((S, Hq, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty((S, Hq, num_splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_m = part_l = out  # unused dummies
    _decode_kernel[(S, Hkv, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_m,
        part_l,
        qk_scale,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0) if use_splits else 0,
        part_out.stride(1) if use_splits else 0,
        part_out.stride(2) if use_splits else 0,
        part_m.stride(0) if use_splits else 0,
        part_m.stride(1) if use_splits else 0,
        D,
        block_size,
        partition_size,
        GROUP=group,
        BLOCK_G=BLOCK_G,
        BLOCK_D=BLOCK_D,
        BLOCK_N=BLOCK_N,
        USE_SPLITS=use_splits,
        DOT_PRECISION=_dot_precision(query.dtype),
        DOT_F32=_dot_f32(query.dtype),
        EVEN_D=BLOCK_D == D,
        num_warps=4,
        num_stages=2,
    )
    if use_splits:
        _decode_reduce_kernel[(S, Hq)](
            out,
            part_out,
            part_m,
            part_l,
            seq_lens,
            out.stride(0),
            out.stride(1),
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_m.stride(0),
            part_m.stride(1),
            D,
            partition_size,
            num_splits,
            BLOCK_P=_next_pow2(num_splits),
            BLOCK_D=BLOCK_D,
            num_warps=1 if BLOCK_D * _next_pow2(num_splits) <= 2048 else 4,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# prefill / chunked prefill / mixed batches
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    qb = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + s)
    q_len = tl.load(query_start_loc_ptr + s + 1) - q_begin
    tile_start = qb * BLOCK_Q
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx_len = seq_len - q_len

    # Row r of the tile = (token tile_start + r // BLOCK_G, query head kvh * GROUP + r % BLOCK_G).
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    r = tl.arange(0, BLOCK_M)
    tok = tile_start + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    rmask = (tok < q_len) & (g < GROUP)
    qh = kvh * GROUP + g
    row_t = (q_begin + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row_t[:, None] * stride_qt + qh[:, None] * stride_qh + d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    # Padded rows take the last valid token's position, so no row is ever fully masked.
    row_pos = ctx_len + tl.minimum(tok, q_len - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_ptr = block_tables_ptr + s * stride_bt

    # Keys before the tile's first query position are visible to every row: no mask.
    first_pos = ctx_len + tile_start
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_ptr, n0, seq_len, row_pos, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size, dmask,
            BLOCK_N, BLOCK_D, False, False, DOT_PRECISION, DOT_F32, EVEN_D,
        )
    # The diagonal region: causal mask (which also bounds keys by seq_len).
    hi = tl.minimum(seq_len, ctx_len + tile_start + BLOCK_Q)
    for n0 in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_ptr, n0, hi, row_pos, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size, dmask,
            BLOCK_N, BLOCK_D, True, True, DOT_PRECISION, DOT_F32, EVEN_D,
        )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + row_t[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & dmask[None, :],
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of variable-length query chunks over their paged context (prefix + the chunk,
    whose K/V must already be in the cache). Works for any mix of chunk lengths, decode tokens included.

    ``max_query_len`` (host int) sizes the grid; ``block_m`` (rows = tokens x grouped heads) and
    ``block_n`` (K/V tile length) are tuning overrides.
    """
    _check_cache(k_cache, v_cache)
    T, Hq, D = query.shape
    _, block_size, Hkv, Dc = k_cache.shape
    if Dc != D:
        raise ValueError(f"query head dim {D} != cache head dim {Dc}")
    if Hq % Hkv != 0:
        raise ValueError(f"num query heads {Hq} not a multiple of num kv heads {Hkv}")
    S = seq_lens.shape[0]
    if query_start_loc.shape[0] != S + 1 or block_tables.shape[0] != S:
        raise ValueError(
            f"query_start_loc needs S+1={S + 1} entries (got {query_start_loc.shape[0]}), block_tables "
            f"S={S} rows (got {block_tables.shape[0]})"
        )
    if out is None:
        out = torch.empty_like(query)
    if T == 0 or S == 0 or max_query_len <= 0:
        return out
    query = _last_dim_contiguous(query)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()

    group = Hq // Hkv
    BLOCK_G = _next_pow2(group)
    BLOCK_D = max(16, _next_pow2(D))
    if block_m is None:
        block_m = 64
    if block_n is None:
        block_n = 64 if BLOCK_D <= 128 else 32
    BLOCK_M = max(16, _next_pow2(block_m), BLOCK_G)
    BLOCK_Q = max(1, BLOCK_M // BLOCK_G)
    # Don't make tiles of mostly-padding tokens for short (e.g. decode) chunks.
    while BLOCK_Q > 1 and BLOCK_Q // 2 >= max_query_len and (BLOCK_Q // 2) * BLOCK_G >= 16:
        BLOCK_Q //= 2
    BLOCK_N = max(16, _next_pow2(block_n))

    grid = (_cdiv(max_query_len, BLOCK_Q), S, Hkv)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        float(scale) * _LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        D,
        block_size,
        GROUP=group,
        BLOCK_G=BLOCK_G,
        BLOCK_Q=BLOCK_Q,
        BLOCK_D=BLOCK_D,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=_dot_precision(query.dtype),
        DOT_F32=_dot_f32(query.dtype),
        EVEN_D=BLOCK_D == D,
        num_warps=4,
        num_stages=2,
    )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same signature as ``kernels.reference.paged_attention``: decode kernel when every sequence has one
    query token (``T == S``), else the prefill kernel. Pass ``max_query_len`` to avoid a device sync."""
    T = query.shape[0]
    S = seq_lens.shape[0]
    if max_query_len is None:
        if T == S:
            max_query_len = 1 if S > 0 else 0
        else:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if S else 0
    if T == S and max_query_len == 1:
        return paged_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len, out=out
        )
    return paged_prefill_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out=out
    )

