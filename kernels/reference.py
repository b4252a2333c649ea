"""Torch reference ops: the paged KV cache write, paged attention, and small layer helpers.

These are the oracle for the Triton kernels and the generic CPU path. Conventions (docs/INTERFACES.md):

* KV cache per layer: ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
* ``slot_mapping`` int64 ``[T]``: slot = block * block_size + offset; negative slots are skipped.
* ``paged_attention``: ``query`` ``[T, Hq, D]`` flattened over sequences, ``query_start_loc`` int32 ``[S+1]``,
  ``seq_lens`` int32 ``[S]`` (context length *including* this step's tokens), ``block_tables`` int32
  ``[S, max_blocks]``. Query token j of sequence s (a chunk of q_len tokens) sits at position
  ``seq_lens[s] - q_len + j`` and attends to positions ``0..`` that one. Query head h uses kv head
  ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import kv_quant


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (negative slots skipped)."""
    if key.shape[0] == 0:
        return
    num_blocks, block_size, hkv, d = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, hkv, d)
    v_flat = v_cache.view(num_blocks * block_size, hkv, d)
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    # The common case (no padding slots) needs no mask; checking costs one reduction.
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, to_cache(key, k_cache.dtype))
    v_flat.index_copy_(0, slots, to_cache(value, v_cache.dtype))


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fresh keys or values in the cache's element type: int8 or float8 rows with their scales
    (kernels/kv_quant.py), or rounded to a narrower float."""
    if kv_quant.is_quantized(dtype):
        return kv_quant.pack(x, dtype)
    return x if x.dtype == dtype else x.to(dtype)


def block_slots(block_table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions ``0..length-1`` of one sequence (int64 ``[length]``)."""
    nblk = (length + block_size - 1) // block_size
    blocks = block_table_row[:nblk].to(torch.long)
    offs = torch.arange(block_size, device=blocks.device, dtype=torch.long)
    return (blocks[:, None] * block_size + offs[None, :]).reshape(-1)[:length]


def causal_offset_mask(q_len: int, kv_len: int, device: torch.device | str) -> torch.Tensor:
    """Boolean ``[q_len, kv_len]`` mask (True = attend) for queries at the last ``q_len`` positions."""
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    return kpos[None, :] <= qpos[:, None]


def attend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool = True
) -> torch.Tensor:
    """Attention of one sequence: q ``[Lq, Hq, D]`` against k/v ``[Lk, Hkv, D]`` (queries at the last Lq
    positions). Returns ``[Lq, Hq, D]``."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
    kt = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
    vt = v.transpose(0, 1).unsqueeze(0)
    gqa = hq != hkv
    if not causal or lq == 1:
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=gqa)
    elif lq == lk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = causal_offset_mask(lq, lk, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, D]`` over each sequence's cached keys/values.

    Correct for any mix of decodes, whole prefills and prefill chunks with earlier context; one Python
    iteration per sequence (the keys/values of a sequence are gathered with one indexing op)."""
    num_blocks, block_size, hkv, d = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, hkv, d)
    v_flat = v_cache.view(num_blocks * block_size, hkv, d)
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, kv_len in enumerate(lens):
        q0, q1 = qsl[s], qsl[s + 1]
        if q1 == q0:
            continue
        slots = block_slots(block_tables[s], kv_len, block_size)
        k = kv_quant.widen(k_flat.index_select(0, slots), query.dtype)
        v = kv_quant.widen(v_flat.index_select(0, slots), query.dtype)
        out[q0:q1] = attend_one(query[q0:q1], k, v, scale)
    return out


# --- layer helpers ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (as HF Llama does), returned in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate_up projection ``[..., 2*I]`` → ``[..., I]``."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
