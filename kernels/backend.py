"""Attention backends: the metadata one engine step shares across layers, and the torch implementation.

The model calls, per layer, ``backend.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)`` then
``backend.forward(query, key, value, k_cache, v_cache, meta)`` (key/value are this step's fresh ``[T, Hkv, D]``
tensors, already in the cache). ``get_backend`` picks Triton on CUDA when it imports, else torch.

CPU fast path (TorchBackend): the runner orders each batch as decodes (q_len 1) first, then prefill
chunks. Once per step (not per layer) we build the decodes' block index ``[S_dec * nblk]`` and an additive
length mask; each layer then gathers all decode K/V with one block-granular ``index_select`` (whole
``block_size*Hkv*D`` rows, cheaper than per-slot gathers) and runs one batched SDPA in which the g query heads
of a kv head are folded into the query-length axis (``q [S, Hkv, g, D]``), so GQA needs no expanded kv heads.
Prefill chunks with no earlier context attend over the fresh K/V with SDPA(is_causal) (no gather); chunks with
context gather their context from the cache and use a causal-offset mask (one SDPA per sequence).

Decode micro-benchmark, ``python -m kernels.backend float32 1`` (SmolLM2 shapes Hq=9, Hkv=3, D=64, block 16,
ragged lengths in [L/2, L], float32, 1 thread, best of 15, ms per layer call). Measured on the shared 2-core
box under heavy load from other jobs (load average ~10), so absolute numbers are inflated; the ranking was
the same in every run:
                                        S=32,L=256  S=32,L=1024  S=8,L=1024  S=64,L=128  S=1,L=512
  per-request gather + SDPA loop (reference)  10.4       37.0        3.02       16.4       0.17
  block gather alone                           1.43      20.3        1.18        1.34      0.03
  gather + SDPA(mask, enable_gqa=True)         5.80      39.3        2.82        3.57      0.10
  gather + SDPA(mask, repeat_interleave kv)   32.0      279          25.0       14.8       0.33
  gather + grouped matmul + softmax           13.7       75.2        7.22       14.0       0.11
  gather + SDPA, heads folded (chosen)         3.21      30.4        2.14        3.01      0.08
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_attention, reference


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flattened batch (shared by all layers).

    Device tensors follow docs/INTERFACES.md; the ``*_host`` fields are the same numbers as Python/numpy
    values so backends can plan without device syncs. ``num_decodes`` counts the leading sequences with
    q_len 1 (the runner puts decodes first); ``cache`` holds per-step state a backend derives lazily
    (e.g. the CPU decode gather index), built on the first layer and reused by the others.
    """

    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S+1]
    max_query_len: int
    max_seq_len: int
    block_size: int
    scale: float | None = None  # softmax scale; None means head_dim ** -0.5
    num_decodes: int = 0  # leading sequences with q_len == 1
    num_decode_tokens: int = 0
    seq_lens_host: np.ndarray | None = None
    query_lens_host: np.ndarray | None = None
    query_start_loc_host: np.ndarray | None = None
    block_tables_host: np.ndarray | None = None
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        *,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        block_size: int,
        device: torch.device | str,
        scale: float | None = None,
    ) -> AttentionMetadata:
        """Metadata from host arrays (one host→device copy per array)."""
        seq_lens = np.asarray(seq_lens, dtype=np.int32)
        qsl = np.asarray(query_start_loc, dtype=np.int32)
        qlens = np.diff(qsl)
        not_decode = np.flatnonzero(qlens != 1)
        num_decodes = int(not_decode[0]) if not_decode.size else int(qlens.shape[0])
        dev = torch.device(device)
        return cls(
            slot_mapping=torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            max_query_len=int(qlens.max()) if qlens.size else 0,
            max_seq_len=int(seq_lens.max()) if seq_lens.size else 0,
            block_size=block_size,
            scale=scale,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            seq_lens_host=seq_lens,
            query_lens_host=qlens,
            query_start_loc_host=qsl,
            block_tables_host=np.asarray(block_tables),
        )


@runtime_checkable
class AttentionBackend(Protocol):
    name: str

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


def _decode_plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Block ids ``[S_dec * nblk]`` to gather (whole blocks: one contiguous block_size*Hkv*D copy each,
    much cheaper than per-slot gathers) and the additive mask ``[S_dec, 1, 1, nblk*block_size]`` hiding
    positions past each length (None if there are none), computed once per step and shared by all layers."""
    plan = meta.cache.get("decode_plan")
    if plan is not None:
        return plan
    nd = meta.num_decodes
    bs = meta.block_size
    lens = meta.seq_lens_host[:nd].astype(np.int64)
    nblk = int((lens.max() + bs - 1) // bs)
    lpad = nblk * bs
    blocks = meta.block_tables[:nd, :nblk].to(torch.long).reshape(-1)
    mask = None
    if int(lens.min()) != lpad:
        pos = torch.arange(lpad, device=blocks.device)
        lens_t = meta.seq_lens[:nd].to(torch.long)
        mask = torch.zeros((nd, lpad), dtype=torch.float32, device=blocks.device)
        mask.masked_fill_(pos[None, :] >= lens_t[:, None], float("-inf"))
        mask = mask[:, None, None, :]
    plan = (blocks, mask, nblk)
    meta.cache["decode_plan"] = plan
    return plan


def torch_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Batched attention for the leading ``num_decodes`` single-token sequences. query ``[S, Hq, D]``.

    One block-granular gather of every sequence's K/V into ``[S, nblk*block_size, Hkv, D]``, then one SDPA
    call where the g query heads sharing a kv head are folded into the query-length dimension
    (``[S, Hkv, g, D]``), so GQA needs neither ``enable_gqa`` nor expanded kv heads (fastest on CPU, see the
    module docstring)."""
    nd, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    blocks, mask, nblk = _decode_plan(meta)
    lpad = nblk * bs
    k = k_cache.index_select(0, blocks).view(nd, lpad, hkv, d)
    v = v_cache.index_select(0, blocks).view(nd, lpad, hkv, d)
    if k.dtype != query.dtype:
        k, v = k.to(query.dtype), v.to(query.dtype)
    if mask is not None and mask.dtype != query.dtype:
        key = ("decode_mask", query.dtype)
        m = meta.cache.get(key)
        if m is None:
            m = meta.cache[key] = mask.to(query.dtype)
        mask = m
    q = query.view(nd, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(nd, hq, d)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the leading ``num_decodes`` single-token sequences: the C kernel reading the paged cache in
    place where it is available (CPU), else the gather + SDPA torch path."""
    nd = query.shape[0]
    key = ("cpu_decode", nd, query.dtype, k_cache.dtype)
    plan = meta.cache.get(key)
    if plan is None:  # once per step, shared by the layers
        use = cpu_attention.supports(query, k_cache)
        plan = meta.cache[key] = (use, meta.block_tables[:nd].contiguous(), meta.seq_lens[:nd].contiguous(),
                                  int(meta.seq_lens_host[:nd].max()) if nd else 0)
    use, tables, lens, max_len = plan
    if use:
        return cpu_attention.decode_attention(query, k_cache, v_cache, tables, lens, max_len, scale)
    return torch_decode_attention(query, k_cache, v_cache, meta, scale)


class TorchBackend:
    """Torch attention (CPU fast path, also correct on CUDA)."""

    name = "torch"

    def __init__(self) -> None:
        self._slots: torch.Tensor | None = None  # the last slot mapping seen, checked for padding once per step

    def write_kv_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if slot_mapping is not self._slots:  # a new step: one check for negative (padding) slots
            self._slots = slot_mapping if not bool((slot_mapping < 0).any()) else None
        if self._slots is None or slot_mapping.dtype != torch.long or key.device != k_cache.device:
            reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
            return
        if key.dtype != k_cache.dtype:  # a narrower cache than the model (kv_cache_dtype): round on the way in
            key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
        num_blocks, block_size, hkv, d = k_cache.shape
        k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, key)
        v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, value)

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
        if scale is None:
            scale = meta.scale if meta.scale is not None else query.shape[-1] ** -0.5
        if meta.seq_lens_host is None:  # metadata built by hand: the generic path
            return reference.paged_attention(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
            )
        nd = meta.num_decodes
        num_seqs = meta.num_seqs
        if nd == num_seqs:
            return decode_attention(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = decode_attention(query[:nd], k_cache, v_cache, meta, scale)
        num_blocks, bs, hkv, d = k_cache.shape
        qsl = meta.query_start_loc_host
        lens = meta.seq_lens_host
        plan_key = ("cpu_prefill", query.dtype, k_cache.dtype)
        plan = meta.cache.get(plan_key)
        if plan is None:  # once per step, shared by the layers
            plan = meta.cache[plan_key] = False if not cpu_attention.supports_prefill(query, k_cache) else (
                int(qsl[nd]), torch.from_numpy(qsl[nd:].astype(np.int32) - int(qsl[nd])),
                torch.from_numpy((lens[nd:num_seqs] - np.diff(qsl[nd:])).astype(np.int32)),
                meta.block_tables[nd:num_seqs].contiguous())
        if plan:  # every prefill chunk in one call, keys and values read from the cache
            p0, starts, ctx, tables = plan
            out[p0:] = cpu_attention.prefill_attention(query[p0:], k_cache, v_cache, tables, starts, ctx, scale)
            return out
        k_flat = v_flat = None
        for s in range(nd, num_seqs):
            q0, q1 = int(qsl[s]), int(qsl[s + 1])
            if q1 == q0:
                continue
            kv_len = int(lens[s])
            if kv_len == q1 - q0:  # no earlier context: the fresh keys/values are the whole sequence
                k, v = key[q0:q1], value[q0:q1]
            else:
                if k_flat is None:
                    k_flat = k_cache.view(num_blocks * bs, hkv, d)
                    v_flat = v_cache.view(num_blocks * bs, hkv, d)
                slots = reference.block_slots(meta.block_tables[s], kv_len, bs)
                k = k_flat.index_select(0, slots).to(query.dtype)
                v = v_flat.index_select(0, slots).to(query.dtype)
            out[q0:q1] = reference.attend_one(query[q0:q1], k, v, scale)
        return out


def get_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """The attention backend for ``device``: ``name`` "torch" or "triton", or None to pick (Triton on CUDA if
    it imports, else torch)."""
    dev = torch.device(device)
    if name in (None, "auto"):
        if dev.type == "cuda":
            try:
                from kernels.triton_backend import TritonBackend

                return TritonBackend()
            except Exception:  # noqa: BLE001 - Triton missing or broken: fall back to torch
                return TorchBackend()
        return TorchBackend()
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        if dev.type != "cuda":
            raise ValueError("the triton attention backend needs a CUDA device")
        from kernels.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r} (expected 'torch', 'triton' or None)")
