"""Triton paged prefill attention: prefill, chunked prefill and mixed batches.

Variable-length query chunks attend causally to themselves and to everything earlier in the block table,
with K/V read straight from the paged cache (callers write the chunk's K/V into the cache first). Rows of the
query tile pack ``BLOCK_Q`` tokens x the query heads of one kv-head group, so K/V are loaded once per group.
Conventions: see ``kernels.triton_common``.
"""

from __future__ import annotations

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
)


# Long by necessity: a @triton.jit body can only call other JIT functions, not Python helpers.
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


def _check_prefill_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    _check_cache(k_cache, v_cache)
    _check_heads(query, k_cache)
    S = seq_lens.shape[0]
    if query_start_loc.shape[0] != S + 1 or block_tables.shape[0] != S:
        raise ValueError(
            f"query_start_loc needs S+1={S + 1} entries (got {query_start_loc.shape[0]}), block_tables "
            f"S={S} rows (got {block_tables.shape[0]})"
        )


def _prefill_tiles(group: int, head_dim: int, max_query_len: int, block_m: int | None,
                   block_n: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_G, BLOCK_Q, BLOCK_D, BLOCK_N): a query tile of BLOCK_Q tokens x BLOCK_G grouped heads (at least
    16 rows), shrunk for short chunks, and the K/V tile length."""
    BLOCK_G = _next_pow2(group)
    BLOCK_D = max(16, _next_pow2(head_dim))
    if block_m is None:
        block_m = 64
    if block_n is None:
        block_n = 64 if BLOCK_D <= 128 else 32
    BLOCK_M = max(16, _next_pow2(block_m), BLOCK_G)
    BLOCK_Q = max(1, BLOCK_M // BLOCK_G)
    # Don't make tiles of mostly-padding tokens for short (e.g. decode) chunks.
    while BLOCK_Q > 1 and BLOCK_Q // 2 >= max_query_len and (BLOCK_Q // 2) * BLOCK_G >= 16:
        BLOCK_Q //= 2
    return BLOCK_G, BLOCK_Q, BLOCK_D, max(16, _next_pow2(block_n))


def _launch_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
                    out, tiles: tuple[int, int, int, int]) -> None:
    """The kernel: grid (query tile, sequence, kv head)."""
    _, Hq, D = query.shape
    _, block_size, Hkv, _ = k_cache.shape
    BLOCK_G, BLOCK_Q, BLOCK_D, BLOCK_N = tiles
    grid = (_cdiv(max_query_len, BLOCK_Q), seq_lens.shape[0], Hkv)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        float(scale) * _LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        D, block_size,
        GROUP=Hq // Hkv, BLOCK_G=BLOCK_G, BLOCK_Q=BLOCK_Q, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        DOT_PRECISION=_dot_precision(query.dtype), DOT_F32=_dot_f32(query.dtype), EVEN_D=BLOCK_D == D,
        num_warps=4, num_stages=2,
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
    _check_prefill_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0 or max_query_len <= 0:
        return out
    query = _last_dim_contiguous(query)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    group = query.shape[1] // k_cache.shape[2]
    tiles = _prefill_tiles(group, query.shape[2], max_query_len, block_m, block_n)
    _launch_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
                    out, tiles)
    return out
