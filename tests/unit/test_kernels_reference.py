"""Reference kernels and the CPU backend against a naive per-token implementation written here."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from kernels import cpu_attention, reference
from kernels.attention_api import AttentionMetadata
from kernels.backend import CPUBackend, get_backend


def naive_write(key, value, k_cache, v_cache, slot_mapping):
    bs = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // bs, slot % bs] = key[t]
        v_cache[slot // bs, slot % bs] = value[t]


def naive_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Token by token, head by head, straight from the definition (float64)."""
    t_total, hq, d = query.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(t_total, hq, d, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for s, kv_len in enumerate(seq_lens.tolist()):
        q_len = qsl[s + 1] - qsl[s]
        for j in range(q_len):
            pos = kv_len - q_len + j
            for h in range(hq):
                kh = h // group
                q = query[qsl[s] + j, h].double()
                ks, vs = [], []
                for p in range(pos + 1):
                    blk = int(block_tables[s, p // bs])
                    ks.append(k_cache[blk, p % bs, kh].double())
                    vs.append(v_cache[blk, p % bs, kh].double())
                k = torch.stack(ks)
                v = torch.stack(vs)
                w = torch.softmax((k @ q) * scale, dim=0)
                out[qsl[s] + j, h] = w @ v
    return out


def make_case(seq_specs, hq, hkv, d=8, bs=4, seed=0, dtype=torch.float32):
    """seq_specs: list of (context_before, q_len). Returns a filled cache and metadata arrays, with block
    tables drawn from a shuffled pool (non-contiguous) and padded with junk entries."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [math.ceil((c + q) / bs) for c, q in seq_specs]
    num_blocks = sum(need) + 5
    perm = rng.permutation(num_blocks)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g, dtype=dtype)
    max_blocks = max(need) + 2
    block_tables = np.full((len(seq_specs), max_blocks), 0, dtype=np.int32)
    off = 0
    for i, n in enumerate(need):
        block_tables[i, :n] = perm[off : off + n]
        block_tables[i, n:] = rng.integers(0, num_blocks, max_blocks - n)  # padding junk
        off += n
    seq_lens = np.array([c + q for c, q in seq_specs], dtype=np.int32)
    q_lens = np.array([q for _, q in seq_specs])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = torch.randn(int(qsl[-1]), hq, d, generator=g, dtype=dtype)
    return query, k_cache, v_cache, block_tables, seq_lens, qsl


def _fresh_kv(kc, vc, bt, lens, qsl):
    """This step's key/value ``[T, Hkv, D]``: the cached values at each chunk's positions (the backends' fast
    paths read fresh K/V for context-free prefills)."""
    bs, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    slots = []
    for s in range(len(lens)):
        q_len = int(qsl[s + 1] - qsl[s])
        for p in range(int(lens[s]) - q_len, int(lens[s])):
            slots.append(int(bt[s, p // bs]) * bs + p % bs)
    return kc.view(-1, hkv, d)[slots], vc.view(-1, hkv, d)[slots]


CASES = {
    "decode-ragged": [(0, 1), (4, 1), (7, 1), (15, 1), (16, 1), (1, 1)],
    "prefill-ragged": [(0, 1), (0, 4), (0, 5), (0, 13)],
    "chunked-with-context": [(4, 4), (3, 6), (8, 1), (0, 7), (13, 3)],
    "mixed-decodes-first": [(5, 1), (9, 1), (0, 9), (6, 5)],
    "mixed-decodes-interleaved": [(0, 3), (5, 1), (6, 5), (9, 1)],
    "single-token-seq": [(0, 1)],
}


# The naive oracle is slow (Python loops): computed once per problem, shared by the backends' parametrizations.
_NAIVE: dict[tuple, torch.Tensor] = {}

# Both CPU backends by their public names: "cpu" (the C kernels wherever they apply, which on x86 is every
# shape below) and "torch" (CPUBackend(native=False): the portable gather + SDPA path, otherwise never run on
# a machine with the C kernels).
BACKENDS = ["cpu", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])  # GQA ratios 1, 3, 4
def test_paged_attention_matches_naive(case, hq, hkv, backend):
    query, kc, vc, bt, lens, qsl = make_case(CASES[case], hq, hkv, seed=zlib.crc32(case.encode()) % 1000)  # stable across processes, unlike hash()
    scale = 0.37
    bt_t, lens_t, qsl_t = torch.from_numpy(bt), torch.from_numpy(lens), torch.from_numpy(qsl)
    key_ = (case, hq, hkv)
    if key_ not in _NAIVE:
        _NAIVE[key_] = naive_attention(query, kc, vc, bt_t, lens_t, qsl_t, scale)
    expected = _NAIVE[key_]
    got = reference.paged_attention(query, kc, vc, bt_t, lens_t, qsl_t, scale)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)

    # The backend's fast paths (decode batch, fresh-prefill SDPA, context gather) on the same input.
    # Fast paths read fresh K/V for context-free prefills, so pass the cached values for those tokens.
    meta = AttentionMetadata.build(
        slot_mapping=np.zeros(int(qsl[-1]), np.int64),
        block_tables=bt,
        seq_lens=lens,
        query_start_loc=qsl,
        block_size=kc.shape[1],
        device="cpu",
        scale=scale,
    )
    key, value = _fresh_kv(kc, vc, bt, lens, qsl)
    be = get_backend("cpu", backend)
    assert be.name == backend
    fast = be.forward(query, key, value, kc, vc, meta)
    torch.testing.assert_close(fast.double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_fast_path_is_used_for_leading_decodes():
    query, kc, vc, bt, lens, qsl = make_case(CASES["mixed-decodes-first"], 6, 2)
    meta = AttentionMetadata.build(
        slot_mapping=np.zeros(int(qsl[-1]), np.int64),
        block_tables=bt,
        seq_lens=lens,
        query_start_loc=qsl,
        block_size=4,
        device="cpu",
    )
    assert meta.num_decodes == 2 and meta.max_query_len == 9 and meta.max_seq_len == 11
    interleaved = AttentionMetadata.build(
        slot_mapping=np.zeros(10, np.int64),
        block_tables=bt,
        seq_lens=np.array([3, 6, 11, 10]),
        query_start_loc=np.array([0, 3, 4, 9, 10]),
        block_size=4,
        device="cpu",
    )
    assert interleaved.num_decodes == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_bfloat16_close(backend):
    """A bfloat16 query and cache (decodes, chunks with context, a context-free prefill): the reference and
    each backend's bfloat16 path against the float64 oracle."""
    query, kc, vc, bt, lens, qsl = make_case(CASES["mixed-decodes-first"] + CASES["chunked-with-context"], 6, 2,
                                             dtype=torch.bfloat16)
    args = (torch.from_numpy(bt), torch.from_numpy(lens), torch.from_numpy(qsl))
    expected = naive_attention(query, kc, vc, *args, 0.3)
    got = reference.paged_attention(query, kc, vc, *args, 0.3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=3e-2)
    meta = AttentionMetadata.build(slot_mapping=np.zeros(int(qsl[-1]), np.int64), block_tables=bt, seq_lens=lens,
                                   query_start_loc=qsl, block_size=kc.shape[1], device="cpu", scale=0.3)
    key, value = _fresh_kv(kc, vc, bt, lens, qsl)
    fast = get_backend("cpu", backend).forward(query, key, value, kc, vc, meta)
    assert fast.dtype == torch.bfloat16 and fast.shape == query.shape
    torch.testing.assert_close(fast.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("with_negative", [False, True])
def test_write_kv_cache_matches_naive(with_negative):
    g = torch.Generator().manual_seed(1)
    num_blocks, bs, hkv, d = 7, 4, 3, 8
    poison = float("nan")
    k_cache = torch.full((num_blocks, bs, hkv, d), poison)
    v_cache = torch.full((num_blocks, bs, hkv, d), poison)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * bs, generator=g)[:13]
    if with_negative:
        slots[[2, 7]] = -1
    key = torch.randn(13, hkv, d, generator=g)
    value = torch.randn(13, hkv, d, generator=g)
    reference.write_kv_cache(key, value, k_cache, v_cache, slots)
    naive_write(key, value, k_exp, v_exp, slots)
    torch.testing.assert_close(k_cache, k_exp, equal_nan=True)
    torch.testing.assert_close(v_cache, v_exp, equal_nan=True)
    written = int((slots >= 0).sum())
    assert int((~torch.isnan(k_cache[..., 0, 0])).sum()) == written  # untouched slots stay poisoned


def test_write_kv_cache_casts_to_cache_dtype():
    k_cache = torch.zeros(2, 4, 1, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 1, 4)
    reference.write_kv_cache(key, key, k_cache, v_cache, torch.tensor([5, 0, 7]))
    torch.testing.assert_close(k_cache.view(-1, 1, 4)[[5, 0, 7]].float(), key, atol=1e-2, rtol=1e-2)


def test_get_backend_cpu_and_errors():
    assert get_backend("cpu").name == "cpu" and get_backend("cpu").native
    assert get_backend("cpu", "cpu").name == "cpu"
    torch_only = get_backend("cpu", "torch")
    assert isinstance(torch_only, CPUBackend) and torch_only.name == "torch" and not torch_only.native
    with pytest.raises(ValueError, match="CUDA"):
        get_backend("cpu", "triton")
    with pytest.raises(ValueError, match="unknown"):
        get_backend("cpu", "nope")


def test_torch_only_backend_avoids_the_c_kernels(monkeypatch):
    """CPUBackend(native=False) runs the portable torch path (batched decode gather + SDPA, per-sequence prefill)
    even where the C kernels are available: they are never called, and the result matches the reference."""
    query, kc, vc, bt, lens, qsl = make_case(CASES["mixed-decodes-first"], 6, 2)
    meta = AttentionMetadata.build(slot_mapping=np.zeros(int(qsl[-1]), np.int64), block_tables=bt, seq_lens=lens,
                                   query_start_loc=qsl, block_size=4, device="cpu", scale=0.37)
    args = (torch.from_numpy(bt), torch.from_numpy(lens), torch.from_numpy(qsl), 0.37)
    expected = reference.paged_attention(query, kc, vc, *args)
    key, value = _fresh_kv(kc, vc, bt, lens, qsl)

    def forbidden(*_a, **_k):
        raise AssertionError("the C kernels were called")

    monkeypatch.setattr(cpu_attention, "decode_attention", forbidden)
    monkeypatch.setattr(cpu_attention, "prefill_attention", forbidden)
    got = CPUBackend(native=False).forward(query, key, value, kc, vc, meta)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if cpu_attention.supports(query, kc):  # the default backend does use them here
        with pytest.raises(AssertionError, match="C kernels"):
            CPUBackend().forward(query, key, value, kc, vc, meta)


@pytest.mark.skipif(not cpu_attention.has_simd(), reason="no C compiler or no AVX2+FMA: the C kernels are not built")
def test_cpu_backend_reads_the_cache_in_place(monkeypatch):
    """The "cpu" backend hands the C kernels the paged cache tensors themselves (same storage, no gather or
    copy of the cache, which would cost O(cache) memory and time per layer): one decode call for the leading
    decodes and one prefill call for all the chunks, and its result matches the reference."""
    query, kc, vc, bt, lens, qsl = make_case(CASES["mixed-decodes-first"], 8, 2, d=16, bs=4)
    meta = AttentionMetadata.build(slot_mapping=np.zeros(int(qsl[-1]), np.int64), block_tables=bt, seq_lens=lens,
                                   query_start_loc=qsl, block_size=4, device="cpu", scale=0.25)
    key, value = _fresh_kv(kc, vc, bt, lens, qsl)
    seen = []

    def spy(real, kind):
        def call(q, k_cache, v_cache, *rest):
            seen.append((kind, k_cache, v_cache))
            return real(q, k_cache, v_cache, *rest)
        return call

    monkeypatch.setattr(cpu_attention, "decode_attention", spy(cpu_attention.decode_attention, "decode"))
    monkeypatch.setattr(cpu_attention, "prefill_attention", spy(cpu_attention.prefill_attention, "prefill"))
    got = get_backend("cpu", "cpu").forward(query, key, value, kc, vc, meta)
    assert [kind for kind, _, _ in seen] == ["decode", "prefill"]
    for _, k_arg, v_arg in seen:
        assert k_arg is kc and v_arg is vc
        assert k_arg.data_ptr() == kc.data_ptr() and v_arg.data_ptr() == vc.data_ptr()
    expected = reference.paged_attention(query, kc, vc, torch.from_numpy(bt), torch.from_numpy(lens),
                                         torch.from_numpy(qsl), 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_helpers_rms_norm_and_silu():
    x = torch.randn(5, 16)
    w = torch.randn(16)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6), expected)
    gu = torch.randn(3, 10)
    torch.testing.assert_close(reference.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :5]) * gu[:, 5:])
