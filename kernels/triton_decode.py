"""Triton paged decode attention: one query token per sequence, split-K over long contexts.

One program handles *all* query heads of a kv-head group (the group is padded to a >=16-row tile so
``tl.dot`` applies), so each K/V tile is loaded once per group. Long contexts are split into partitions
(split-K): each partition writes its running max, sum of exponentials and unnormalised partial output, and a
second kernel combines them, so a single long request still occupies many SMs. Conventions: see
``kernels.triton_common``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    _LOG2E,
    _attend_tile,
    _cdiv,
    _check_cache,
    _check_heads,
    _dot_f32,
    _dot_precision,
    _last_dim_contiguous,
    _next_pow2,
    _num_sms,
)


# Long by necessity: a @triton.jit body can only call other JIT functions, not Python helpers.
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


@dataclass(frozen=True)
class _DecodeLaunch:
    """Tile sizes and split-K partitioning of one decode launch."""

    group: int  # query heads per kv head
    block_g: int  # the group padded to a >=16-row tile
    block_d: int
    block_n: int  # K/V tile length
    num_splits: int  # context partitions (1: no split, no reduce kernel)
    partition_size: int  # tokens per partition, a multiple of block_n

    @property
    def use_splits(self) -> bool:
        return self.num_splits > 1


def _check_decode_args(query, k_cache, v_cache, block_tables, seq_lens) -> None:
    _check_cache(k_cache, v_cache)
    _check_heads(query, k_cache)
    S = query.shape[0]
    if block_tables.shape[0] != S or seq_lens.shape[0] != S:
        raise ValueError(
            f"decode expects one query token per sequence: query has {S} tokens, block_tables "
            f"{block_tables.shape[0]} rows, seq_lens {seq_lens.shape[0]} entries"
        )


def _decode_launch_config(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_splits: int | None,
    max_seq_len: int | None,
    block_n: int | None,
) -> _DecodeLaunch:
    """Tiles from the head shapes; partitions from the context bound (``max_seq_len`` if given, else the block
    table's capacity) and ``num_splits`` (None: ``default_num_splits``)."""
    S, Hq, D = query.shape
    _, block_size, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    BLOCK_D = max(16, _next_pow2(D))
    if block_n is None:
        block_n = 64 if BLOCK_D <= 128 else 32
    BLOCK_N = max(16, _next_pow2(block_n))
    table_ctx = block_tables.shape[1] * block_size
    max_ctx = int(max_seq_len) if max_seq_len is not None else table_ctx
    max_ctx = max(1, min(max_ctx, table_ctx))
    if num_splits is None:
        num_splits = default_num_splits(S, Hkv, max_ctx, query.device)
    num_splits = max(1, int(num_splits))
    partition_size = _cdiv(_cdiv(max_ctx, num_splits), BLOCK_N) * BLOCK_N
    num_splits = _cdiv(max_ctx, partition_size)
    if num_splits <= 1:  # one partition: let it span the whole block table, whatever max_seq_len said
        partition_size = max(partition_size, table_ctx)
    return _DecodeLaunch(group=group, block_g=max(16, _next_pow2(group)), block_d=BLOCK_D, block_n=BLOCK_N,
                         num_splits=num_splits, partition_size=partition_size)


def _split_buffers(cfg: _DecodeLaunch, query: torch.Tensor, out: torch.Tensor):
    """Per-partition float32 partial outputs, maxima and sums (``out`` stands in when there is no split)."""
    if not cfg.use_splits:
        return out, out, out  # unused dummies
    S, Hq, D = query.shape
    part_out = torch.empty((S, Hq, cfg.num_splits, D), dtype=torch.float32, device=query.device)
    part_m = torch.empty((S, Hq, cfg.num_splits), dtype=torch.float32, device=query.device)
    part_l = torch.empty((S, Hq, cfg.num_splits), dtype=torch.float32, device=query.device)
    return part_out, part_m, part_l


def _launch_decode(cfg: _DecodeLaunch, query, k_cache, v_cache, block_tables, seq_lens, scale, out, parts) -> None:
    """The attention kernel: grid (sequence, kv head, partition)."""
    S, _, D = query.shape
    _, block_size, Hkv, _ = k_cache.shape
    part_out, part_m, part_l = parts
    split = cfg.use_splits
    _decode_kernel[(S, Hkv, cfg.num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_m, part_l,
        float(scale) * _LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0) if split else 0, part_out.stride(1) if split else 0, part_out.stride(2) if split else 0,
        part_m.stride(0) if split else 0, part_m.stride(1) if split else 0,
        D, block_size, cfg.partition_size,
        GROUP=cfg.group, BLOCK_G=cfg.block_g, BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, USE_SPLITS=split,
        DOT_PRECISION=_dot_precision(query.dtype), DOT_F32=_dot_f32(query.dtype), EVEN_D=cfg.block_d == D,
        num_warps=4, num_stages=2,
    )


def _launch_split_reduce(cfg: _DecodeLaunch, seq_lens, out, parts) -> None:
    """The split-K reduce: combine each (sequence, query head)'s partitions into ``out``."""
    S, Hq, D = out.shape
    part_out, part_m, part_l = parts
    block_p = _next_pow2(cfg.num_splits)
    _decode_reduce_kernel[(S, Hq)](
        out, part_out, part_m, part_l, seq_lens,
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_m.stride(0), part_m.stride(1),
        D, cfg.partition_size, cfg.num_splits,
        BLOCK_P=block_p, BLOCK_D=cfg.block_d,
        num_warps=1 if cfg.block_d * block_p <= 2048 else 4,
    )


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
    _check_decode_args(query, k_cache, v_cache, block_tables, seq_lens)
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    query = _last_dim_contiguous(query)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    cfg = _decode_launch_config(query, k_cache, block_tables, num_splits, max_seq_len, block_n)
    parts = _split_buffers(cfg, query, out)
    _launch_decode(cfg, query, k_cache, v_cache, block_tables, seq_lens, scale, out, parts)
    if cfg.use_splits:
        _launch_split_reduce(cfg, seq_lens, out, parts)
    return out
