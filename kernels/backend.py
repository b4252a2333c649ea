"""The CPU attention backend and ``get_backend``, which picks a backend for a device.

``CPUBackend`` runs the C kernels of ``kernels.cpu_attention`` (decode and prefill attention reading the
paged cache in place: float32, bfloat16, or int8 rows with their scales, ``kernels.kv_quant``) where they are
available, and a portable torch path (gather + SDPA, an int8 cache widened as gathered) elsewhere: non-CPU
tensors, unsupported shapes or dtypes, no C compiler, or ``CPUBackend(native=False)`` (the ``"torch"``
backend), which never calls the C kernels; for an int8 cache that path is also the kernels' reference. The interface (``AttentionMetadata``,
``AttentionBackend``) is in ``kernels.attention_api``; ``get_backend`` picks Triton on CUDA when it imports.

Torch path: the runner orders each batch as decodes (q_len 1) first, then prefill chunks. Once per step (not
per layer) we build the decodes' block index ``[S_dec * nblk]`` and an additive length mask; each layer then
gathers all decode K/V with one block-granular ``index_select`` (whole ``block_size*Hkv*D`` rows, cheaper
than per-slot gathers) and runs one batched SDPA in which the g query heads of a kv head are folded into the
query-length axis (``q [S, Hkv, g, D]``), so GQA needs no expanded kv heads. Prefill chunks with no earlier
context attend over the fresh K/V with SDPA(is_causal) (no gather); chunks with context gather their context
from the cache and use a causal-offset mask (one SDPA per sequence).

Why these variants: the decode micro-benchmark (``bench/attention_cpu.py``) is recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_attention, kv_quant, reference
from kernels.attention_api import AttentionBackend, AttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKEND_NAMES",
    "CPUBackend",
    "decode_attention",
    "get_backend",
    "torch_decode_attention",
    "torch_prefill_attention",
]

BACKEND_NAMES = ("cpu", "torch", "triton")


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
    _, bs, hkv, row = k_cache.shape  # row: d, or d + 4 in an int8 cache (codes and scale)
    blocks, mask, nblk = _decode_plan(meta)
    lpad = nblk * bs
    k = k_cache.index_select(0, blocks).view(nd, lpad, hkv, row)
    v = v_cache.index_select(0, blocks).view(nd, lpad, hkv, row)
    if k.dtype != query.dtype:
        k, v = kv_quant.widen(k, query.dtype), kv_quant.widen(v, query.dtype)
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
    place where it is available (CPU; an int8 cache too, its rows never unpacked to memory), else the gather +
    SDPA torch path."""
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


def _native_prefill_plan(query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata):
    """The C prefill kernel's per-step arguments for the prefill chunks after the decodes (first token, chunk
    starts, context lengths, block tables), or False where the kernel does not handle these tensors; built
    once per step and shared by the layers."""
    plan_key = ("cpu_prefill", query.dtype, k_cache.dtype)
    plan = meta.cache.get(plan_key)
    if plan is None:
        nd, num_seqs = meta.num_decodes, meta.num_seqs
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        plan = meta.cache[plan_key] = False if not cpu_attention.supports_prefill(query, k_cache) else (
            int(qsl[nd]), torch.from_numpy(qsl[nd:].astype(np.int32) - int(qsl[nd])),
            torch.from_numpy((lens[nd:num_seqs] - np.diff(qsl[nd:])).astype(np.int32)),
            meta.block_tables[nd:num_seqs].contiguous())
    return plan


def torch_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The prefill chunks after the leading decodes, one SDPA per sequence, into ``out``: a chunk with no
    earlier context attends over the fresh key/value, one with context gathers it from the cache."""
    num_blocks, bs, hkv, d = k_cache.shape
    qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
    k_flat = v_flat = None
    for s in range(meta.num_decodes, meta.num_seqs):
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
            k = kv_quant.widen(k_flat.index_select(0, slots), query.dtype)
            v = kv_quant.widen(v_flat.index_select(0, slots), query.dtype)
        out[q0:q1] = reference.attend_one(query[q0:q1], k, v, scale)
    return out


class CPUBackend:
    """Paged attention on CPU: the C kernels where available, the torch path otherwise (also correct on CUDA).

    ``native=False`` never calls the C kernels, so the portable torch path (batched gather + SDPA decode,
    per-sequence SDPA prefill) runs even where they are available; its ``name`` is then ``"torch"`` (what
    ``get_backend(device, "torch")`` returns), else ``"cpu"``."""

    def __init__(self, native: bool = True) -> None:
        self.native = bool(native)
        self.name = "cpu" if self.native else "torch"
        self._slots: torch.Tensor | None = None  # the last slot mapping seen, checked for padding once per step

    def __repr__(self) -> str:
        return f"CPUBackend(native={self.native})"

    def write_kv_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if slot_mapping is not self._slots:  # a new step: one check for negative (padding) slots
            self._slots = slot_mapping if not bool((slot_mapping < 0).any()) else None
        if self._slots is None or slot_mapping.dtype != torch.long or key.device != k_cache.device:
            reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
            return
        if key.dtype != k_cache.dtype:  # a narrower cache than the model (kv_cache_dtype): round on the way in
            key, value = reference.to_cache(key, k_cache.dtype), reference.to_cache(value, v_cache.dtype)
        num_blocks, block_size, hkv, d = k_cache.shape
        k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, key)
        v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, value)

    def _decode(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.native:
            return decode_attention(query, k_cache, v_cache, meta, scale)
        return torch_decode_attention(query, k_cache, v_cache, meta, scale)

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
        if nd == meta.num_seqs:
            return self._decode(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta, scale)
        plan = _native_prefill_plan(query, k_cache, meta) if self.native else False
        if plan:  # every prefill chunk in one call, keys and values read from the cache
            p0, starts, ctx, tables = plan
            out[p0:] = cpu_attention.prefill_attention(query[p0:], k_cache, v_cache, tables, starts, ctx, scale)
            return out
        return torch_prefill_attention(query, key, value, k_cache, v_cache, meta, scale, out)


def _triton_backend() -> AttentionBackend:
    from kernels.triton_backend import TritonBackend

    return TritonBackend()


def get_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """The attention backend for ``device``. ``name``: ``"cpu"`` (the C kernels where available, else torch),
    ``"torch"`` (the portable torch path only: ``CPUBackend(native=False)``), ``"triton"`` (CUDA), or None /
    ``"auto"`` to pick (Triton on CUDA if it imports, else ``"cpu"``)."""
    dev = torch.device(device)
    if name in (None, "auto"):
        if dev.type == "cuda":
            try:
                return _triton_backend()
            except Exception:  # noqa: BLE001 - Triton missing or broken: fall back to torch
                return CPUBackend()
        return CPUBackend()
    if name in ("cpu", "torch"):
        return CPUBackend(native=name == "cpu")
    if name == "triton":
        if dev.type != "cuda":
            raise ValueError("the triton attention backend needs a CUDA device")
        return _triton_backend()
    raise ValueError(f"unknown attention backend {name!r} (expected one of {', '.join(BACKEND_NAMES)} or None)")
