"""Decode-attention micro-benchmark on CPU: the variants behind ``kernels.backend``'s decode fast path.

``python -m bench.attention_cpu [float32|bfloat16|int8] [threads]`` (run it under
``flock /tmp/inferq-heavy.lock timeout 600 ...`` on the shared box). SmolLM2 shapes (Hq=9, Hkv=3, D=64,
block 16), ragged lengths uniform in [L/8, L] (one sequence at L), blocks scattered over a larger cache;
best of n repeats, ms per layer call. Checks every variant against the per-sequence reference first.

Variants:
  loop          per-sequence gather + SDPA (``reference.paged_attention``)
  gather        the block-granular gather alone (the padded ``[S, L, Hkv, D]`` copies of K and V)
  sdpa-gqa      gather + SDPA(mask, enable_gqa=True)
  sdpa-expand   gather + SDPA(mask) on repeat_interleave'd kv heads
  grouped-mm    gather + matmul / softmax / matmul with the query heads grouped per kv head
  sdpa-fold     gather + SDPA with the g query heads of a kv head folded into the query axis (torch path)
  c-kernel      ``kernels.cpu_attention``: reads K/V in place from the paged cache (no gather)

``int8``: float32 queries against an int8 KV cache (``kernels/kv_quant.py`` rows: D codes + a float32 scale)
and the same values in other caches, the ratios against int8-c:
  int8-torch    the torch path: block gather, rows unpacked to float32 (``kv_quant.widen``), SDPA
  int8-c        the C kernel reading the int8 rows in place (codes widened in registers)
  fp8-c         the C kernel reading float8 e4m3 rows of the same keys and values in place (one float16
                conversion per 8 or 16 codes)
  bf16-c        the C kernel on a bfloat16 cache
  f32-c         the C kernel on a float32 cache
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_attention, kv_quant, reference
from kernels.attention_api import AttentionMetadata
from kernels.backend import _decode_plan, torch_decode_attention

CASES = [(16, 256), (32, 256), (32, 1024), (64, 768), (64, 128), (8, 1024), (1, 512)]
INT8_CASES = [(8, 512), (16, 256), (32, 1024), (64, 768), (1, 512)]


def timeit(fn, n: int = 15) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def problem(nseq: int, lmax: int, dtype: torch.dtype, rng: np.random.Generator):
    """(lens, k cache, v cache, metadata): SmolLM2 shapes, ragged lengths, scattered blocks; float caches."""
    hkv, d, bs = 3, 64, 16
    lens = rng.integers(max(1, lmax // 8), lmax + 1, size=nseq)
    lens[0] = lmax
    nblk = (lmax + bs - 1) // bs
    num_blocks = 2 * nseq * nblk + 1
    kc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
    bt = rng.permutation(num_blocks - 1)[: nseq * nblk].reshape(nseq, nblk).astype(np.int32)
    meta = AttentionMetadata.build(slot_mapping=np.zeros(nseq, np.int64), block_tables=bt, seq_lens=lens,
                                   query_start_loc=np.arange(nseq + 1), block_size=bs, device="cpu")
    return lens, kc, vc, meta


def case(nseq: int, lmax: int, dtype: torch.dtype, rng: np.random.Generator) -> dict[str, float]:
    hq, hkv, d, bs = 9, 3, 64, 16
    lens, kc, vc, meta = problem(nseq, lmax, dtype, rng)
    q = torch.randn(nseq, hq, d, dtype=dtype)
    scale = d**-0.5
    blocks, mask, nb = _decode_plan(meta)
    m = None if mask is None else mask.to(dtype)

    def gathered():
        k = kc.index_select(0, blocks).view(nseq, nb * bs, hkv, d).transpose(1, 2)
        v = vc.index_select(0, blocks).view(nseq, nb * bs, hkv, d).transpose(1, 2)
        return k, v

    def sdpa_gqa():
        k, v = gathered()
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=m, scale=scale, enable_gqa=True)

    def sdpa_expand():
        k, v = gathered()
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=m, scale=scale)

    def grouped_matmul():
        k, v = gathered()
        s = torch.matmul(q.view(nseq, hkv, hq // hkv, d), k.transpose(2, 3)).float() * scale
        if mask is not None:
            s = s + mask
        return torch.matmul(s.softmax(-1).to(dtype), v)

    def fold():
        return torch_decode_attention(q, kc, vc, meta, scale)

    def ckernel():
        return cpu_attention.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, int(lens.max()), scale)

    def loop():
        return reference.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    expected = loop()
    torch.testing.assert_close(fold(), expected, atol=tol, rtol=tol)
    variants = {"loop": (loop, 5), "gather": (gathered, 15), "sdpa-gqa": (sdpa_gqa, 15),
                "sdpa-expand": (sdpa_expand, 15), "grouped-mm": (grouped_matmul, 15), "sdpa-fold": (fold, 15)}
    if cpu_attention.available():
        torch.testing.assert_close(ckernel(), expected, atol=tol, rtol=tol)
        variants["c-kernel"] = (ckernel, 15)
    return {name: timeit(fn, n) for name, (fn, n) in variants.items()}


def int8_case(nseq: int, lmax: int, rng: np.random.Generator) -> dict[str, float]:
    """The int8 KV cache read by the torch path and by the C kernel, and the C kernel on float caches of the same
    values; each checked against the reference on the int8 cache first."""
    hq, d = 9, 64
    lens, kf, vf, meta = problem(nseq, lmax, torch.float32, rng)
    k8, v8 = kv_quant.pack(kf), kv_quant.pack(vf)
    k32, v32 = kv_quant.unpack(k8), kv_quant.unpack(v8)  # the int8 cache's own values, in float caches
    k16, v16 = k32.bfloat16(), v32.bfloat16()
    q = torch.randn(nseq, hq, d)
    scale, max_len = d**-0.5, int(lens.max())

    def kernel(kc, vc):
        return lambda: cpu_attention.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, max_len, scale)

    expected = reference.paged_attention(q, k8, v8, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    variants = {"int8-torch": lambda: torch_decode_attention(q, k8, v8, meta, scale)}
    if cpu_attention.available():
        variants |= {"int8-c": kernel(k8, v8), "bf16-c": kernel(k16, v16), "f32-c": kernel(k32, v32)}
    for name, fn in variants.items():
        tol = 3e-2 if name == "bf16-c" else 1e-4
        torch.testing.assert_close(fn(), expected, atol=tol, rtol=tol)
    if cpu_attention.available():  # float8 rows hold other values: checked against the reference on them
        kf8, vf8 = kv_quant.pack(kf, kv_quant.FP8_ROWS), kv_quant.pack(vf, kv_quant.FP8_ROWS)
        want8 = reference.paged_attention(q, kf8, vf8, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                          scale)
        variants["fp8-c"] = kernel(kf8, vf8)
        torch.testing.assert_close(variants["fp8-c"](), want8, atol=1e-4, rtol=1e-4)
    return {name: timeit(fn) for name, fn in variants.items()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    kind = argv[0] if argv else "float32"
    if len(argv) > 1:
        torch.set_num_threads(int(argv[1]))
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    print(f"decode attention, {kind}, {torch.get_num_threads()} threads, ms per layer call (best of n)")
    if kind == "int8":
        for nseq, lmax in INT8_CASES:
            res = int8_case(nseq, lmax, rng)
            base = res.get("int8-c")
            print(f"S={nseq:3d} L={lmax:5d}  " + "  ".join(
                f"{k} {v:7.3f}" + (f" ({v / base:4.2f}x)" if base else "") for k, v in res.items()), flush=True)
        return
    dtype = getattr(torch, kind)
    for nseq, lmax in CASES:
        res = case(nseq, lmax, dtype, rng)
        print(f"S={nseq:3d} L={lmax:5d}  " + "  ".join(f"{k} {v:7.2f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
