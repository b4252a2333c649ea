"""The compiled CPU attention kernels (kernels/cpu_attention.py: decode, and causal prefill on the AVX2 path)
against the torch reference.

Covers both of its code paths: the AVX2 one (head dim a multiple of 8, power-of-two block size) and the
portable one (other shapes), in float32, bfloat16 and int8 (codes + row scale, kernels/kv_quant.py) caches, GQA
ratios 1/3/4, ragged lengths around block and 8/16-position chunk boundaries, shuffled block tables and junk past
each table's end."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kernels import cpu_attention, kv_quant, reference

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler: the kernel is not built")
needs_simd = pytest.mark.skipif(not cpu_attention.has_simd(), reason="the prefill kernel is the AVX2 path only")


def test_vector_path_is_built_on_x86_64():
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the vector path is x86 (AVX2 + FMA)")
    assert cpu_attention.has_simd()

LENGTHS = [1, 2, 15, 16, 17, 31, 33, 64, 100, 257]


def _cache(shape, dtype, g):
    """A random cache in ``dtype``; int8 / float8 rows: packed as the cache write packs them, with some rows
    holding one outlier 40x the rest (its scale, and so every other code's step, 40x larger) and some all zero."""
    x = torch.randn(*shape, generator=g)
    if not kv_quant.is_quantized(dtype):
        return x.to(dtype)
    rows = x.view(-1, shape[-1])
    n = rows.shape[0]
    pick = torch.randint(0, n, (max(1, n // 16),), generator=g)
    rows[pick, torch.randint(0, shape[-1], pick.shape, generator=g)] *= 40.0
    rows[torch.randint(0, n, (max(1, n // 16),), generator=g)] = 0.0
    return kv_quant.pack(x, dtype)


def _widened(cache):
    """The float32 values a cache holds (int8 / float8 rows unpacked)."""
    return kv_quant.unpack(cache) if kv_quant.is_quantized(cache.dtype) else cache.float()


def _case(hq, hkv, d, bs, dtype, lens, seed):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(need) + 3
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(lens), max(need) + 1), dtype=np.int32)
    off = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[off:off + n]
        tables[i, n:] = rng.integers(0, num_blocks, tables.shape[1] - n)  # junk past the end: never read
        off += n
    k_cache = _cache((num_blocks, bs, hkv, d), dtype, g)
    v_cache = _cache((num_blocks, bs, hkv, d), dtype, g)
    query = torch.randn(len(lens), hq, d, generator=g)
    return query, k_cache, v_cache, torch.from_numpy(tables), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (14, 2)])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 16), (64, 32), (64, 8), (80, 16), (16, 16), (32, 8), (48, 16),
                                  (8, 4), (64, 12)])
@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_decode_matches_reference(dtype, hq, hkv, d, bs, path):
    """Each code path (AVX-512 where built: head dims 16-128 in steps of 16, 1-3 query heads per pass; AVX2;
    the portable loops) against the reference."""
    if path == "avx512" and not cpu_attention.has_avx512():
        pytest.skip("no AVX-512 path on this CPU")
    lens = LENGTHS if bs != 12 else [1, 11, 12, 13, 40]
    query, kc, vc, tables, seq_lens = _case(hq, hkv, d, bs, dtype, lens, seed=d * 31 + bs + hq)
    scale = d ** -0.5
    cpu_attention.use_generic(path == "scalar")
    cpu_attention.use_avx512(path == "avx512")
    try:
        got = cpu_attention.decode_attention(query, kc, vc, tables, seq_lens, max(lens), scale)
    finally:
        cpu_attention.use_generic(False)
        cpu_attention.use_avx512(True)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    expected = reference.paged_attention(query, kc.float(), vc.float(), tables, seq_lens, qsl, scale)
    assert got.shape == expected.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_batched_rows_match_each_row_alone():
    query, kc, vc, tables, seq_lens = _case(9, 3, 64, 16, torch.float32, [5, 300, 1], seed=3)
    first = cpu_attention.decode_attention(query, kc, vc, tables, seq_lens, 300, 0.125)
    # each row through the kernel alone gives the batched result (no cross-talk between work items)
    for i in range(3):
        alone = cpu_attention.decode_attention(query[i:i + 1], kc, vc, tables[i:i + 1], seq_lens[i:i + 1],
                                               int(seq_lens[i]), 0.125)
        torch.testing.assert_close(alone[0], first[i], atol=1e-6, rtol=1e-6)


def test_long_context_softmax_is_stable():
    # large scores: exp must not overflow (max subtraction) and tiny weights must not become NaN
    query, kc, vc, tables, seq_lens = _case(4, 4, 64, 16, torch.float32, [2000], seed=5)
    query *= 30.0
    got = cpu_attention.decode_attention(query, kc, vc, tables, seq_lens, 2000, 0.125)
    expected = reference.paged_attention(query, kc, vc, tables, seq_lens, torch.tensor([0, 1], dtype=torch.int32),
                                         0.125)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_huge_page_buffers_are_zeroed_aligned_and_outlive_their_views():
    import gc

    from kernels import hugepages

    t = hugepages.zeros((3, 1024, 1024), torch.float32)  # 12 MiB: mapped, 2 MiB aligned
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and not t.any()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t[1].fill_(2.0)
    view = t[1]
    del t
    gc.collect()
    assert float(view.sum()) == 2.0 * 1024 * 1024  # the mapping lives while a view does
    small = hugepages.zeros((4, 4), torch.bfloat16)  # below one huge page: an ordinary tensor
    assert small.dtype == torch.bfloat16 and not small.any()


def _prefill_case(hq, hkv, d, bs, dtype, chunks, seed):
    """chunks: (query rows, earlier context) per sequence; blocks scattered over a larger pool."""
    g = torch.Generator().manual_seed(seed)
    totals = [n + c for n, c in chunks]
    need = [-(-t // bs) for t in totals]
    num_blocks = sum(need) + 7
    kc = _cache((num_blocks, bs, hkv, d), dtype, g)
    vc = _cache((num_blocks, bs, hkv, d), dtype, g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(chunks), max(need), dtype=torch.int32)
    o = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[o:o + n]
        o += n
    starts = torch.tensor([0] + [n for n, _ in chunks], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), hq, d, generator=g)
    return query, kc, vc, tables, starts, torch.tensor([c for _, c in chunks], dtype=torch.int32), totals


@needs_simd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (14, 2)])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 16), (80, 4), (16, 32), (48, 16), (24, 8), (8, 8)])
def test_prefill_matches_reference(dtype, hq, hkv, d, bs):
    """Causal chunks with and without earlier context, lengths around the 8-row query blocks and 8-key chunks."""
    chunks = [(1, 0), (7, 0), (9, 3), (33, 40), (16, 0), (5, 100)]
    query, kc, vc, tables, starts, ctx, totals = _prefill_case(hq, hkv, d, bs, dtype, chunks, seed=d + hq)
    got = cpu_attention.prefill_attention(query, kc, vc, tables, starts, ctx, d ** -0.5)
    expected = reference.paged_attention(query, kc, vc, tables, torch.tensor(totals, dtype=torch.int32), starts,
                                         d ** -0.5)
    torch.testing.assert_close(got, expected.float(), atol=2e-5, rtol=2e-5)


@needs_simd
def test_prefill_takes_bfloat16_queries():
    """A bfloat16 model's queries are widened to float32 for the kernel: the same result as float32 queries
    holding the same values."""
    query, kc, vc, tables, starts, ctx, totals = _prefill_case(9, 3, 64, 16, torch.bfloat16, [(20, 0), (9, 30)],
                                                              seed=4)
    half = query.bfloat16()
    assert cpu_attention.supports_prefill(half, kc)
    got = cpu_attention.prefill_attention(half, kc, vc, tables, starts, ctx, 0.125)
    want = cpu_attention.prefill_attention(half.float(), kc, vc, tables, starts, ctx, 0.125)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@needs_simd
def test_prefill_long_context_is_stable():
    query, kc, vc, tables, starts, ctx, totals = _prefill_case(9, 3, 64, 16, torch.float32, [(40, 1500)], seed=9)
    query *= 30.0  # large scores: the running max must rescale, never overflow
    got = cpu_attention.prefill_attention(query, kc, vc, tables, starts, ctx, 0.125)
    expected = reference.paged_attention(query, kc, vc, tables, torch.tensor(totals, dtype=torch.int32), starts,
                                         0.125)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _check_decode_and_prefill(hq, hkv, d, bs, dtype, prefill=True):
    query, kc, vc, tables, seq_lens = _case(hq, hkv, d, bs, dtype, LENGTHS, seed=d + bs + hq)
    got = cpu_attention.decode_attention(query, kc, vc, tables, seq_lens, max(LENGTHS), d ** -0.5)
    qsl = torch.arange(len(LENGTHS) + 1, dtype=torch.int32)
    expected = reference.paged_attention(query, _widened(kc), _widened(vc), tables, seq_lens, qsl, d ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    if prefill:
        query, kc, vc, tables, starts, ctx, totals = _prefill_case(hq, hkv, d, bs, dtype, [(7, 0), (33, 40), (5, 100)],
                                                                  seed=d + hq)
        got = cpu_attention.prefill_attention(query, kc, vc, tables, starts, ctx, d ** -0.5)
        expected = reference.paged_attention(query, kc, vc, tables, torch.tensor(totals, dtype=torch.int32), starts,
                                             d ** -0.5)
        torch.testing.assert_close(got, expected.float(), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not cpu_attention.has_avx512(), reason="only an AVX-512 build has a second vector path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, kv_quant.FP8_ROWS])
def test_avx2_build_matches_reference(dtype, monkeypatch):
    """The library built with INFERQ_NO_AVX512 (what an AVX2-only CPU gets): on an AVX-512 machine its prefill
    (ymm q.k and V sums for head dims that are multiples of 16) is otherwise untested."""
    lib = cpu_attention.build({"INFERQ_NO_AVX512": 1})
    assert lib is not None and lib.has_simd() and lib.has_prefill() and not lib.has_avx512()
    monkeypatch.setattr(cpu_attention, "load", lambda: lib)
    for hq, hkv, d, bs in [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 48, 8), (14, 2, 80, 4)]:
        _check_decode_and_prefill(hq, hkv, d, bs, dtype)


def test_scalar_build_decodes_and_declines_prefill(monkeypatch):
    """The library built with INFERQ_NO_AVX2 (a CPU without AVX2 + FMA): the portable loops for every shape, and
    no prefill kernel (the backend keeps SDPA)."""
    lib = cpu_attention.build({"INFERQ_NO_AVX2": 1})
    assert lib is not None and not lib.has_simd() and not lib.has_prefill() and not lib.has_avx512()
    monkeypatch.setattr(cpu_attention, "load", lambda: lib)
    for dtype in (torch.float32, torch.bfloat16, torch.int8, kv_quant.FP8_ROWS):
        _check_decode_and_prefill(9, 3, 64, 16, dtype, prefill=False)
    assert not cpu_attention.supports_prefill(torch.zeros(1, 9, 64), torch.zeros(4, 16, 3, 64))


# ---- int8 and float8 e4m3 caches: rows of D codes and their float32 scale, read in place ----

# Unpacked int8 / float8 rows are exact float32 values, so kernel and reference differ only in summation order.
INT8_TOL = {"atol": 1e-5, "rtol": 1e-5}
QUANTIZED = pytest.mark.parametrize("qdtype", [torch.int8, kv_quant.FP8_ROWS], ids=["int8", "fp8"])


def _on_and_off(switch, path, *args):
    """The kernel's result on ``path`` with a cpu_attention switch (use_split, use_head_groups) on, its default,
    and off."""
    on = _decode_on(path, *args)
    switch(False)
    try:
        return on, _decode_on(path, *args)
    finally:
        switch(True)


def _decode_on(path, *args):
    """cpu_attention.decode_attention forced onto one path: "avx512", "avx2" or "scalar"."""
    cpu_attention.use_generic(path == "scalar")
    cpu_attention.use_avx512(path == "avx512")
    try:
        return cpu_attention.decode_attention(*args)
    finally:
        cpu_attention.use_generic(False)
        cpu_attention.use_avx512(True)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (14, 2)])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 16), (64, 32), (80, 16), (16, 16), (32, 8), (48, 16), (8, 4),
                                  (64, 12), (20, 16)])
@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
@QUANTIZED
def test_int8_decode_matches_widened_cache(hq, hkv, d, bs, path, qdtype):
    """The int8 kernel on each path (the vector ones for head dims that are multiples of 8 or 16 and power-of-two
    blocks, the portable loops for the rest) against the torch reference, which unpacks the rows first; rows with
    outliers and all-zero rows included."""
    if path == "avx512" and not cpu_attention.has_avx512():
        pytest.skip("no AVX-512 path on this CPU")
    lens = LENGTHS if bs != 12 else [1, 11, 12, 13, 40]
    query, kc, vc, tables, seq_lens = _case(hq, hkv, d, bs, qdtype, lens, seed=d * 7 + bs + hq)
    assert kc.dtype == qdtype and kc.shape[-1] == d + 4 and cpu_attention.supports(query, kc)
    got = _decode_on(path, query, kc, vc, tables, seq_lens, max(lens), d ** -0.5)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    expected = reference.paged_attention(query, kc, vc, tables, seq_lens, qsl, d ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **INT8_TOL)


@QUANTIZED
def test_int8_decode_equals_the_float_kernel_on_unpacked_rows(qdtype):
    """The int8 / float8 vector path and the float32 one on the same values (the rows unpacked): one summation
    order apart at most, and a long context with large scores stays finite."""
    query, kc, vc, tables, seq_lens = _case(9, 3, 64, 16, qdtype, [2000, 3, 700], seed=11)
    query *= 30.0
    got = cpu_attention.decode_attention(query, kc, vc, tables, seq_lens, 2000, 0.125)
    want = cpu_attention.decode_attention(query, _widened(kc), _widened(vc), tables, seq_lens, 2000, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@QUANTIZED
def test_int8_support_needs_the_scale_bytes(qdtype):
    """An int8 / float8 cache is taken only with rows of D codes + 4 scale bytes."""
    query = torch.zeros(2, 9, 64)
    assert cpu_attention.supports(query, torch.zeros(4, 16, 3, 68, dtype=qdtype))
    assert not cpu_attention.supports(query, torch.zeros(4, 16, 3, 64, dtype=qdtype))
    assert not cpu_attention.supports(query, torch.zeros(4, 16, 3, 68))
    assert cpu_attention.supports_prefill(query, torch.zeros(4, 16, 3, 68, dtype=qdtype)) == cpu_attention.has_simd()


@needs_simd
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (14, 2)])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 16), (80, 4), (16, 32), (48, 16), (24, 8), (8, 8)])
@QUANTIZED
def test_int8_prefill_matches_widened_cache(hq, hkv, d, bs, qdtype):
    """Causal chunks with and without earlier context read from an int8 / float8 cache, against the torch
    reference."""
    chunks = [(1, 0), (7, 0), (9, 3), (33, 40), (16, 0), (5, 100)]
    query, kc, vc, tables, starts, ctx, totals = _prefill_case(hq, hkv, d, bs, qdtype, chunks, seed=d + hq + 1)
    assert cpu_attention.supports_prefill(query, kc)
    got = cpu_attention.prefill_attention(query, kc, vc, tables, starts, ctx, d ** -0.5)
    expected = reference.paged_attention(query, kc, vc, tables, torch.tensor(totals, dtype=torch.int32), starts,
                                         d ** -0.5)
    torch.testing.assert_close(got, expected, **INT8_TOL)


@QUANTIZED
def test_backend_reads_an_int8_cache_with_the_kernels(monkeypatch, qdtype):
    """CPUBackend hands an int8 cache to the C kernels (decode; prefill on the vector path) and agrees with its
    torch path, which widens the gathered rows."""
    from kernels.attention_api import AttentionMetadata
    from kernels.backend import CPUBackend

    chunks = [(1, 40), (1, 7), (1, 130), (9, 20), (33, 64)]  # three decodes, then two chunks with context
    query, kc, vc, tables, starts, ctx, totals = _prefill_case(9, 3, 64, 16, qdtype, chunks, seed=21)
    meta = AttentionMetadata.build(slot_mapping=np.zeros(int(starts[-1]), np.int64), block_tables=tables.numpy(),
                                   seq_lens=np.array(totals), query_start_loc=starts.numpy(), block_size=16,
                                   device="cpu", scale=0.125)
    assert meta.num_decodes == 3
    fresh = torch.zeros(query.shape[0], 3, 64)  # unused: every chunk has earlier context, read from the cache
    calls = []
    for name in ("decode_attention", "prefill_attention"):
        real = getattr(cpu_attention, name)
        monkeypatch.setattr(cpu_attention, name,
                            lambda *a, _real=real, _name=name: calls.append((_name, a[1].dtype)) or _real(*a))
    got = CPUBackend().forward(query, fresh, fresh, kc, vc, meta)
    meta.cache.clear()
    want = CPUBackend(native=False).forward(query, fresh, fresh, kc, vc, meta)
    expect_calls = [("decode_attention", qdtype)]
    if cpu_attention.has_simd():
        expect_calls.append(("prefill_attention", qdtype))
    assert calls == expect_calls
    torch.testing.assert_close(got, want, **INT8_TOL)


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) 4 KiB-granular pages of ``t``'s own memory, from mincore(2): a property of this one
    mapping, unlike the process's RSS (which other allocations, threads and the allocator move)."""
    import ctypes
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    n = (length + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec), n


def test_prefaulted_buffers_are_resident_at_once():
    """``prefault=True`` backs every page of the pool at allocation (the page faults are paid at start-up),
    the default leaves the mapping unbacked until first written. Checked page by page on the buffer itself."""
    import sys

    from kernels import hugepages

    if not sys.platform.startswith("linux"):
        pytest.skip("mincore on anonymous memory is Linux")
    size = 64 << 20
    lazy = hugepages.zeros((size // 4,), torch.float32)
    resident, total = _resident_pages(lazy)
    assert total == size // os.sysconf("SC_PAGE_SIZE") and resident == 0  # mapped, not yet backed
    lazy[: 1 << 20].fill_(1.0)  # writing 4 MiB backs (at least) those pages, not the whole buffer
    resident, _ = _resident_pages(lazy)
    assert (4 << 20) // os.sysconf("SC_PAGE_SIZE") <= resident < total
    eager = hugepages.zeros((size // 4,), torch.float32, prefault=True)
    assert _resident_pages(eager) == (total, total) and not eager.any()
    del lazy, eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, kv_quant.FP8_ROWS],
                         ids=["f32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("lens", [[1500], [700, 1], [300, 1100, 2]], ids=["one", "two", "three"])
@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_few_long_sequences_split_over_the_threads(dtype, lens, path):
    """A few long sequences: each context is split into stretches of whole rows over the threads and the parts'
    softmax partials merged (decode_attention.c's split_share). Against the reference, on each vector path and
    cache type, ragged lengths (a one-position sequence beside a long one) included; and not the same floats as
    the unsplit kernel (one kv head per item), which shows the split path ran."""
    if path == "avx512" and not cpu_attention.has_avx512():
        pytest.skip("no AVX-512 path on this CPU")
    hq, hkv, d, bs = 9, 3, 64, 16
    query, kc, vc, tables, seq_lens = _case(hq, hkv, d, bs, dtype, lens, seed=len(lens) * 13 + max(lens))
    args = (query, kc, vc, tables, seq_lens, max(lens), d ** -0.5)
    split, whole = _on_and_off(cpu_attention.use_split, path, *args)
    expected = reference.paged_attention(query, _widened(kc), _widened(vc), tables, seq_lens,
                                         torch.arange(len(lens) + 1, dtype=torch.int32), d ** -0.5)
    assert torch.isfinite(split).all()
    torch.testing.assert_close(split, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(split, whole, atol=2e-5, rtol=1e-4)
    assert not torch.equal(split, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, kv_quant.FP8_ROWS],
                         ids=["f32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (14, 2), (10, 2), (4, 4)])
def test_avx2_head_groups_give_the_one_head_results(dtype, hq, hkv):
    """The AVX2 passes load each K and V chunk once for up to 3 query heads of its kv head (groups of 3, 2 where 4
    are left, one alone): every dot product and weighted sum is formed in the one-head order, so the results are
    equal bit for bit, on whole kv-head items and on split contexts, ragged lengths, head dims of 4-16 chunks."""
    for d, lens in ((64, [100]), (128, [1500]), (80, [5, 9, 300, 1])):
        query, kc, vc, tables, seq_lens = _case(hq, hkv, d, 16, dtype, lens, seed=hq * d + len(lens))
        args = (query, kc, vc, tables, seq_lens, max(lens), d ** -0.5)
        grouped, alone = _on_and_off(cpu_attention.use_head_groups, "avx2", *args)
        assert torch.isfinite(grouped).all()
        assert torch.equal(grouped, alone), (d, lens)


@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_short_contexts_split_on_the_avx2_items_only(path):
    """The shortest stretch depends on the items' path (decode_attention.c's context_parts): a lone sequence
    of 100 positions is split into two stretches on the AVX2 path (64 or more positions), where its
    strided kv-head items measured slower, and left whole on the AVX-512 one (256 or more); a 40-position one
    is whole on both. Split or not, the result is the reference's."""
    if path == "avx512" and not cpu_attention.has_avx512():
        pytest.skip("no AVX-512 path on this CPU")
    hq, hkv, d, bs = 9, 3, 64, 16
    for n, split_expected in ((100, path == "avx2"), (40, False)):
        query, kc, vc, tables, seq_lens = _case(hq, hkv, d, bs, torch.bfloat16, [n], seed=n)
        args = (query, kc, vc, tables, seq_lens, n, d ** -0.5)
        got, whole = _on_and_off(cpu_attention.use_split, path, *args)
        expected = reference.paged_attention(query, _widened(kc), _widened(vc), tables, seq_lens,
                                             torch.arange(2, dtype=torch.int32), d ** -0.5)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        assert torch.equal(got, whole) != split_expected, (n, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["f32", "bf16", "int8"])
@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_scores_that_rise_along_the_context(dtype, path):
    """The AVX-512 item's online softmax raises each query head's running max chunk by chunk and rescales what it
    summed before: every head's score climbs by about 0.4 a position (a new max in every chunk, each rescale near
    e^-3), and position 250 of the first sequence scores about 60 above its neighbours (all before it scaled to
    nothing). Against the reference, with the contexts split over the threads and not."""
    if path == "avx512" and not cpu_attention.has_avx512():
        pytest.skip("no AVX-512 path on this CPU")
    hq, hkv, d, bs, lens = 9, 3, 64, 16, [300, 41]
    g = torch.Generator().manual_seed(7)
    _, _, _, tables, seq_lens = _case(hq, hkv, d, bs, torch.float32, lens, seed=5)
    nb, scale = int(tables.max()) + 1, d ** -0.5
    unit = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    query = 0.1 * torch.randn(len(lens), hq, d, generator=g) + unit  # q . unit near 1 for every head
    k = 0.3 * torch.randn(nb, bs, hkv, d, generator=g)
    v = torch.randn(nb, bs, hkv, d, generator=g)
    for s, n in enumerate(lens):
        for p in range(n):
            k[int(tables[s, p // bs]), p % bs] += 0.4 * p / scale * unit
    k[int(tables[0, 250 // bs]), 250 % bs] += 60.0 / scale * unit
    kc = kv_quant.pack(k, dtype) if kv_quant.is_quantized(dtype) else k.to(dtype)
    vc = kv_quant.pack(v, dtype) if kv_quant.is_quantized(dtype) else v.to(dtype)
    expected = reference.paged_attention(query, _widened(kc), _widened(vc), tables, seq_lens,
                                         torch.arange(len(lens) + 1, dtype=torch.int32), scale)
    for split in (True, False):
        cpu_attention.use_split(split)
        try:
            got = _decode_on(path, query, kc, vc, tables, seq_lens, max(lens), scale)
        finally:
            cpu_attention.use_split(True)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
