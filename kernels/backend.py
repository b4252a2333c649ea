"""Attention backends: the metadata one engine step shares across layers, and the torch implementation.

The model calls, per layer, ``backend.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)`` then
``backend.forward(query, key, value, k_cache, v_cache, meta)`` (key/value are this step's fresh ``[T, Hkv, D]``
tensors, already in the cache). ``get_backend`` picks Triton on CUDA when it imports, else torch.

CPU fast path (TorchBackend): the runner orders each batch as decodes (q_len 1) first, then prefill
chunks. Per step (not per layer) we precompute, once, a padded slot index ``[S_dec, Lmax]`` and a length mask
for the decodes; each layer then gathers all decode K/V with one indexing op and runs one batched GQA
attention. Prefill chunks with no earlier context attend over the fresh K/V with SDPA(is_causal) (no gather);
chunks with context gather their context from the cache and use a causal-offset mask.

Micro-benchmark (2-core AVX512 Xeon, float32, SmolLM2 shapes Hq=9, Hkv=3, D=64, block 16, per layer call;
``bench`` in this module's ``__main__``):
                                     S=32,L=256  S=32,L=1024  S=8,L=1024  S=64,L=128  S=1,L=512
  per-request SDPA loop (reference)     1.93ms      4.65ms      1.19ms      3.70ms    0.08ms
  gather + SDPA(mask, enable_gqa)       1.49ms      5.70ms      1.46ms      1.68ms    0.11ms
  gather + SDPA(mask, expanded kv)      1.83ms      6.79ms      1.70ms      2.04ms    0.12ms
  gather + grouped matmul/softmax       1.06ms      3.83ms      0.96ms      1.12ms    0.07ms  <- chosen
(bfloat16: grouped matmul is also the fastest of the batched variants.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from kernels import reference


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
    """Padded slot index ``[S_dec, Lmax]`` and additive mask ``[S_dec, 1, 1, Lmax]`` (None if all lengths
    are equal) for the leading decode sequences, computed once per step."""
    plan = meta.cache.get("decode_plan")
    if plan is not None:
        return plan
    nd = meta.num_decodes
    bs = meta.block_size
    lens = meta.seq_lens_host[:nd].astype(np.int64)
    lmax = int(lens.max())
    nblk = (lmax + bs - 1) // bs
    bt = meta.block_tables[:nd, :nblk].to(torch.long)  # [S, nblk]
    offs = torch.arange(bs, device=bt.device, dtype=torch.long)
    slots = (bt[:, :, None] * bs + offs).reshape(nd, nblk * bs)[:, :lmax]
    lens_t = meta.seq_lens[:nd].to(torch.long)
    pos = torch.arange(lmax, device=bt.device)
    valid = pos[None, :] < lens_t[:, None]  # [S, Lmax]
    # Padding positions point at slot 0 of a block the sequence owns (harmless, masked below).
    slots = torch.where(valid, slots, slots[:, :1])
    mask = None
    if int(lens.min()) != lmax:
        mask = torch.zeros(valid.shape, dtype=torch.float32, device=bt.device)
        mask.masked_fill_(~valid, float("-inf"))
        mask = mask[:, None, None, :]
    plan = (slots.reshape(-1), mask, lmax)
    meta.cache["decode_plan"] = plan
    return plan


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Batched attention for the leading ``num_decodes`` single-token sequences. query ``[S, Hq, D]``.

    One gather of every sequence's K/V into ``[S, Lmax, Hkv, D]``, then one SDPA call where the g query
    heads sharing a kv head are folded into the query-length dimension (``[S, Hkv, g, D]``), so GQA needs
    neither ``enable_gqa`` nor expanded kv heads (fastest on CPU, see the module docstring)."""
    nd, hq, d = query.shape
    num_blocks, bs, hkv, _ = k_cache.shape
    slots, mask, lmax = _decode_plan(meta)
    k = k_cache.view(num_blocks * bs, hkv, d).index_select(0, slots).view(nd, lmax, hkv, d)
    v = v_cache.view(num_blocks * bs, hkv, d).index_select(0, slots).view(nd, lmax, hkv, d)
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


class TorchBackend:
    """Torch attention (CPU fast path, also correct on CUDA)."""

    name = "torch"

    def write_kv_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

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


def _bench() -> None:  # pragma: no cover - manual micro-benchmark: python -m kernels.backend
    import time

    torch.manual_seed(0)
    hq, hkv, d, bs = 9, 3, 64, 16
    dtype = torch.float32

    def timeit(fn, n=20):
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    for nseq, lmax in [(32, 256), (32, 1024), (8, 1024), (64, 128), (1, 512)]:
        lens = np.random.randint(lmax // 2, lmax + 1, size=nseq)
        lens[0] = lmax
        nblk = (lmax + bs - 1) // bs
        num_blocks = nseq * nblk + 1
        kc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
        vc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
        bt = np.random.permutation(num_blocks - 1)[: nseq * nblk].reshape(nseq, nblk).astype(np.int32)
        qsl = np.arange(nseq + 1, dtype=np.int32)
        meta = AttentionMetadata.build(slot_mapping=np.zeros(nseq, np.int64), block_tables=bt, seq_lens=lens,
                                       query_start_loc=qsl, block_size=bs, device="cpu")
        q = torch.randn(nseq, hq, d, dtype=dtype)
        scale = d**-0.5
        ref = lambda: reference.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens,  # noqa: E731
                                                meta.query_start_loc, scale)

        def sdpa(expand: bool):
            slots, mask, lm = _decode_plan(meta)
            k = kc.view(-1, hkv, d).index_select(0, slots).view(nseq, lm, hkv, d).transpose(1, 2)
            v = vc.view(-1, hkv, d).index_select(0, slots).view(nseq, lm, hkv, d).transpose(1, 2)
            if expand:
                k = k.repeat_interleave(hq // hkv, 1)
                v = v.repeat_interleave(hq // hkv, 1)
            m = None if mask is None else mask.to(dtype)
            return F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=m, scale=scale,
                                                  enable_gqa=not expand)

        grouped = lambda: decode_attention(q, kc, vc, meta, scale)  # noqa: E731
        a = ref()
        assert torch.allclose(a, grouped(), atol=1e-4)
        assert torch.allclose(a, sdpa(False).squeeze(2), atol=1e-4)
        print(f"S={nseq} L={lmax}: loop {timeit(ref):.2f}ms  sdpa-gqa {timeit(lambda: sdpa(False)):.2f}ms  "
              f"sdpa-expand {timeit(lambda: sdpa(True)):.2f}ms  grouped {timeit(grouped):.2f}ms")


if __name__ == "__main__":  # pragma: no cover
    _bench()
