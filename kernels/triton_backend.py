"""Triton attention backend (CUDA): the paged-cache kernels of ``kernels.triton_attention`` behind the
``AttentionBackend`` protocol of ``kernels.attention_api``.

Dispatch per layer call:

* every sequence has one query token (a decode-only step): the split-K decode kernel;
* otherwise the leading ``meta.num_decodes`` single-token sequences (the runner orders decodes first)
  go to the decode kernel and the remaining prefill chunks to the chunked-prefill kernel, both writing
  into slices of one output tensor. With no decode prefix (or hand-built metadata) the prefill kernel
  handles the whole batch (it is correct for any mix, decodes included).

Only host numbers from the metadata (``max_query_len``, ``max_seq_len``, ``num_decodes``) plan the
launches, so a forward makes no device-to-host sync.
"""

from __future__ import annotations

import torch

from kernels import triton_attention as ta
from kernels.attention_api import AttentionMetadata


class TritonBackend:
    """Paged attention with Triton kernels (needs CUDA, or ``TRITON_INTERPRET=1`` for testing)."""

    name = "triton"

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        ta.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float | None = None,
    ) -> torch.Tensor:
        # key/value are already in the cache (write_kv_cache ran first); the kernels read the cache.
        if scale is None:
            scale = meta.scale if meta.scale is not None else query.shape[-1] ** -0.5
        num_seqs = meta.num_seqs
        num_tokens = query.shape[0]
        out = torch.empty_like(query)
        if num_seqs == 0 or num_tokens == 0:
            return out
        max_seq_len = int(meta.max_seq_len) if meta.max_seq_len else None

        if num_tokens == num_seqs and meta.max_query_len <= 1:
            return ta.paged_decode_attention(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=max_seq_len, out=out,
            )

        nd = int(meta.num_decodes or 0)
        nd_tok = int(meta.num_decode_tokens or nd)
        if nd > 0 and nd_tok == nd and nd < num_seqs:
            ta.paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                max_seq_len=max_seq_len, out=out[:nd],
            )
            qsl = meta.cache.get("triton_prefill_qsl")
            if qsl is None:  # rebased query_start_loc of the prefill part, once per step
                qsl = meta.query_start_loc[nd:] - nd
                meta.cache["triton_prefill_qsl"] = qsl
            ta.paged_prefill_attention(
                query[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens[nd:], qsl, scale,
                int(meta.max_query_len), out=out[nd:],
            )
            return out

        return ta.paged_prefill_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            int(meta.max_query_len), out=out,
        )
