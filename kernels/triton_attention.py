"""Triton kernels for paged attention over a block-paged KV cache: the entry points in one place.

* ``write_kv_cache`` (``kernels.triton_common``, with the shared conventions and launch helpers);
* ``paged_decode_attention``, ``default_num_splits`` (``kernels.triton_decode``): one query token per
  sequence, split-K over long contexts;
* ``paged_prefill_attention`` (``kernels.triton_prefill``): chunked prefill with context, any mix of chunks;
* ``paged_attention``: the same signature as ``kernels.reference.paged_attention``, dispatching to either.
"""

from __future__ import annotations

import torch

from kernels.triton_common import write_kv_cache
from kernels.triton_decode import default_num_splits, paged_decode_attention
from kernels.triton_prefill import paged_prefill_attention

__all__ = [
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_attention",
    "default_num_splits",
]


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
