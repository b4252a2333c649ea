"""kernels/cpu_gemm.py and kernels/packed_gemm.py: every layout and form computes the same product as
F.linear; the planner keeps one weight copy, and a tied head's rows are the embedding table's."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm, decode_step, packed_gemm
from kernels.cpu_gemm import Linear

needs_packed = pytest.mark.skipif(not packed_gemm.available(), reason="no AVX2+FMA CPU or no C compiler")


@pytest.mark.parametrize("layout,form,bias,m", list(itertools.product(("oi", "io"), ("xw", "wx"), (False, True),
                                                                       (1, 5, 40, 300, 600))))
def test_every_form_matches_f_linear(layout, form, bias, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(24, 16, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    x = torch.randn(m, 16, generator=g)
    lin = Linear(w if layout == "oi" else w.t().contiguous(), b, layout, (form,) * 4)
    expected = F.linear(x, w, b)
    got = lin(x)
    assert got.is_contiguous() and got.shape == (m, 24)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(lin(x, contiguous=False), expected)
    out = torch.randn(m, 24, generator=g)
    want = out + expected
    assert lin.add_to(out, x) is out
    torch.testing.assert_close(out, want)
    assert lin.out_features == 24


@needs_packed
@pytest.mark.parametrize("dtype,winner", [(torch.float32, "oi"), (torch.bfloat16, "oi"), (torch.bfloat16, "pd")])
@pytest.mark.parametrize("pk_at_decode", [1.1, 3.0])
def test_another_layout_keeps_panels_for_the_decode_bucket_when_they_are_near_the_best(monkeypatch, dtype, winner,
                                                                                        pk_at_decode):
    """The fused decode step needs every projection in panels: where a BLAS layout (or, bfloat16, the pair-packed
    "pd") wins the larger buckets and the packed kernel is within FUSED_STEP_MARGIN (bfloat16: _BF16) of the best
    at decode sizes, the decode bucket is served by a second, packed copy; further off, the winning layout serves
    every bucket."""
    if winner == "pd" and not packed_gemm.has_bf16_dot():
        pytest.skip("no AVX512-BF16: no pair-packed layout")

    def fake_time(lin, x, scratch):  # the packed kernel slower at prefill sizes, near (or far) at decode sizes
        if lin.layout == "pk":
            return pk_at_decode if x.shape[0] <= cpu_gemm.BUCKET_LIMITS[0] else 2.0
        if lin.layout == "pd":
            return 1.0 if winner == "pd" else 2.0
        return 1.0 if lin.forms[0] == "xw" else 1.5

    monkeypatch.setattr(cpu_gemm, "_time", fake_time)
    n = 40 + (pk_at_decode > 1.5) + 2 * (winner == "pd")  # a shape of its own per case: plans are cached per shape
    w = torch.randn(n, 32, generator=torch.Generator().manual_seed(n)).to(dtype)
    lin = cpu_gemm.plan(w)
    rest = ("pd",) * 3 if winner == "pd" else ("xw",) * 3
    assert lin.layout in (("pd",) if winner == "pd" else ("oi", "io")) and lin.forms[1:] == rest
    near = pk_at_decode <= (cpu_gemm.FUSED_STEP_MARGIN if dtype == torch.float32 else cpu_gemm.FUSED_STEP_MARGIN_BF16)
    assert lin.forms[0] == ("pk" if near else rest[0]) and (lin.panels is not None) == near
    assert (decode_step._panels(lin) is not None) == near
    assert not near or lin.panels.dtype == dtype  # bfloat16 panels: widened by the kernel, computed in float32
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for m in (3, 50):  # the decode bucket from the panels, the others from the winning layout: the same product
        x = torch.randn(m, 32).to(dtype)
        want = F.linear(x.float(), w.float())
        got = lin(x)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **tol)
        out = torch.ones(m, n, dtype=dtype)
        torch.testing.assert_close(lin.add_to(out, x).float(), want + 1.0, **tol)


@needs_packed
def test_panels_that_miss_the_margin_on_the_first_samples_are_timed_again(monkeypatch):
    """The decode bucket's panels decide whether the fused step runs at all: where they miss the margin in the
    first round of samples (a noisy moment), every candidate is timed again at that size before they are
    dropped, so a spike does not cost the fused step; panels that stay slow are still dropped (the test above)."""
    calls = {"pk": 0}

    def fake_time(lin, x, scratch):  # the panels' first samples at decode sizes hit a busy machine
        if lin.layout == "pk":
            if x.shape[0] > cpu_gemm.BUCKET_LIMITS[0]:
                return 2.0
            calls["pk"] += 1
            return 3.0 if calls["pk"] <= 9 else 1.1  # the first round's 8 samples and one more, then calm
        return 1.0 if lin.forms[0] == "xw" else 1.5

    monkeypatch.setattr(cpu_gemm, "_time", fake_time)
    w = torch.randn(47, 32, generator=torch.Generator().manual_seed(47))
    lin = cpu_gemm.plan(w)
    assert lin.layout in ("oi", "io") and lin.forms == ("pk", "xw", "xw", "xw") and lin.panels is not None
    assert calls["pk"] > 9


def test_bucket_bounds():
    assert [cpu_gemm._bucket(m) for m in (1, 16, 17, 128, 129, 512, 513, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_plan_keeps_one_copy_and_tied_rows():
    w = torch.randn(64, 32)
    tied = cpu_gemm.plan(w, embedding=True)
    assert tied.layout in ("oi", "pk")  # layouts whose rows gather cheaply
    ids = torch.tensor([0, 5, 63, 17, 5])
    torch.testing.assert_close(tied.rows(ids), w[ids], rtol=0, atol=0)
    free = cpu_gemm.plan(w)
    assert free.layout in ("oi", "io", "pk") and len(free.forms) == len(cpu_gemm.PROBE_M)
    assert set(free.forms[1:]) <= ({"pk"} if free.layout == "pk" else {"xw", "wx"})
    assert (free.panels is not None) == ("pk" in free.forms)  # a BLAS layout may keep panels for decode sizes
    x = torch.randn(20, 32)
    torch.testing.assert_close(free(x), F.linear(x, w))
    torch.testing.assert_close(free.rows(ids), w[ids], rtol=0, atol=0)
    assert "64x32 float32" in cpu_gemm.plans()
    plain = cpu_gemm.plan(w, autotune=False)
    assert plain.layout == "oi" and plain.forms == ("xw",) * 4
    half = cpu_gemm.plan(w.bfloat16())
    xh = x.bfloat16()
    torch.testing.assert_close(half(xh), F.linear(xh, w.bfloat16()), rtol=2e-2, atol=2e-2)
    narrow = cpu_gemm.plan(w.bfloat16(), packed_only=True) if packed_gemm.available() else None
    if narrow is not None:  # bfloat16 panels under float32 rows: the float32 product of the rounded weight
        assert narrow.layout == "pk" and narrow.weight.dtype == torch.bfloat16
        torch.testing.assert_close(narrow(x), F.linear(x, w.bfloat16().float()), rtol=1e-5, atol=1e-4)


@needs_packed
@pytest.mark.parametrize("m,n,k", [(1, 16, 8), (1, 40, 37), (2, 20, 9), (3, 31, 16), (4, 64, 5), (5, 33, 64),
                                   (6, 48, 1), (7, 960, 576), (8, 17, 3), (9, 47, 33), (10, 16, 70), (12, 81, 24),
                                   (13, 100, 29), (24, 33, 40), (64, 576, 96), (131, 50, 70)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernel_matches_f_linear(m, n, k, bias, dtype):
    """Every row-tile size (1-6 with AVX2, 1-12 with AVX-512), N not a multiple of the 16-column panel, odd K, bias, and accumulation; with
    float32 panels, and with bfloat16 panels (float32 arithmetic on the stored values: the reference is the
    float32 product of the bfloat16 weight)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    packed = packed_gemm.pack(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.dtype == dtype
    lin = Linear(packed, b, "pk", ("pk",) * 4, n)
    expected = F.linear(x, w.float(), b)
    got = lin(x)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    out = torch.randn(m, n, generator=g)
    want = out + expected
    assert lin.add_to(out, x) is out
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lin.w_oi, w, rtol=0, atol=0)
    assert lin.out_features == n


@pytest.mark.skipif(not packed_gemm.has_bf16_dot(), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("m,n,k", [(1, 16, 8), (1, 40, 14), (2, 20, 10), (3, 20, 6), (5, 33, 64), (8, 17, 4), (12, 81, 24), (13, 100, 30),
                                   (64, 576, 96), (131, 50, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_pair_packed_bfloat16_kernel_matches_f_linear(m, n, k, bias):
    """The AVX512-BF16 kernel: bfloat16 rows x pair-packed bfloat16 panels, float32 sums rounded once to
    bfloat16; every row-tile size 1-12, N not a multiple of 16, bias, accumulation, and the tied-head rows."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = packed_gemm.pack_pairs(w)
    assert packed.shape == (-(-n // 16), k // 2, 16, 2)
    lin = Linear(packed, b, "pd", ("pd",) * 4, n)
    expected = F.linear(x.float(), w.float(), b)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=2e-2)
    out = torch.randn(m, n, generator=g).bfloat16()
    want = out.float() + expected
    assert lin.add_to(out, x) is out
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=3e-2)
    torch.testing.assert_close(lin.w_oi, w, rtol=0, atol=0)
    ids = torch.tensor([0, n - 1, n // 2, 0])
    torch.testing.assert_close(lin.rows(ids), w[ids], rtol=0, atol=0)


@needs_packed
def test_packed_kernel_takes_strided_rows_and_a_strided_output():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 16, generator=g)
    wide = torch.randn(9, 40, generator=g)
    x = wide[:, 4:20]  # rows 40 apart, dense inside: what the SwiGLU's half of gate_up looks like
    out_wide = torch.zeros(9, 30)
    out = out_wide[:, 3:27]
    packed_gemm.matmul(x, packed_gemm.pack(w), 24, out=out)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert out_wide[:, :3].abs().sum() == 0 and out_wide[:, 27:].abs().sum() == 0
    col_major = torch.randn(16, 5, generator=g).t()  # stride(-1) != 1: copied first
    torch.testing.assert_close(packed_gemm.matmul(col_major, packed_gemm.pack(w), 24), F.linear(col_major, w),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not packed_gemm.available() or not packed_gemm._load().gemm_has_avx512(),
                    reason="only an AVX-512 build has a second path to compare")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_build_of_the_source_matches_f_linear(dtype):
    """On an AVX-512 machine the AVX2 tiles (1-6 rows) are otherwise untested: build the library without its
    AVX-512 code (the INFERQ_NO_AVX512 build option: what an AVX2-only CPU gets) and check it too."""
    lib = packed_gemm.build({"INFERQ_NO_AVX512": 1})
    assert lib is not None and not lib.gemm_has_avx512() and not lib.has_bf16_dot()
    fn = lib.gemm if dtype == torch.float32 else lib.gemm_bf16
    g = torch.Generator().manual_seed(11)
    for m, n, k in [(1, 16, 8), (1, 40, 37), (2, 20, 9), (5, 33, 64), (6, 48, 1), (13, 100, 29), (131, 50, 70)]:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(m, k, generator=g)
        b = torch.randn(n, generator=g)
        y, packed = torch.empty(m, n), packed_gemm.pack(w)  # (held: the kernel reads it through a pointer)
        fn(x.data_ptr(), k, packed.data_ptr(), b.data_ptr(), y.data_ptr(), n, m, n, k, 0)
        torch.testing.assert_close(y, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-4)


@needs_packed
def test_build_without_split_k_matches_f_linear():
    """The INFERQ_NO_SPLIT_K build option (one accumulator set per tile: the side-by-side baseline of bench/gemv.py)
    computes the same products, for the decode-sized tiles it changes."""
    lib = packed_gemm.build({"INFERQ_NO_SPLIT_K": 1})
    assert lib is not None
    g = torch.Generator().manual_seed(12)
    for m, n, k in [(1, 40, 37), (2, 20, 9), (3, 31, 16)]:
        w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        y, packed = torch.empty(m, n), packed_gemm.pack(w)
        lib.gemm(x.data_ptr(), k, packed.data_ptr(), b.data_ptr(), y.data_ptr(), n, m, n, k, 0)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_packed
def test_kept_packed_weights_share_the_huge_page_arena(monkeypatch):
    """The planner's kept packs of at least ARENA_MIN_BYTES are carved one after another from the arena (so
    many weights share 2 MiB pages) and multiply exactly as ordinary ones; the probes' copies are not."""
    from kernels.hugepages import Arena

    monkeypatch.setattr(packed_gemm, "_arena", Arena())  # a fresh one: earlier models may have filled a chunk
    g = torch.Generator().manual_seed(13)
    w1 = torch.randn(512, 576, generator=g)  # 1.2 MB of float32 panels
    w2 = torch.randn(520, 576, generator=g)
    a = cpu_gemm._stored(w1, "pk", kept=True)
    b = cpu_gemm._stored(w2, "pk", kept=True)
    probe = cpu_gemm._stored(w1, "pk")
    assert b.data_ptr() == a.data_ptr() + a.nbytes  # adjacent: the same mapping (a.nbytes is 64-aligned)
    assert probe.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    x = torch.randn(3, 576, generator=g)
    torch.testing.assert_close(packed_gemm.matmul(x, a, 512), F.linear(x, w1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed_gemm.matmul(x, b, 520), F.linear(x, w2), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(a, probe, rtol=0, atol=0)


@needs_packed
def test_the_default_models_smallest_kept_pack_is_in_the_arena(monkeypatch):
    """SmolLM2's o projection in bfloat16 (576 x 576, 663 KB of panels, under the 1 MB the arena once required)
    is carved from the arena when kept: in 4 KiB pages it streamed at 0.6x the other projections."""
    from kernels.hugepages import Arena

    arena = Arena()
    monkeypatch.setattr(packed_gemm, "_arena", arena)
    w = torch.randn(576, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    kept = cpu_gemm._stored(w, "pk", kept=True)
    assert kept.untyped_storage().data_ptr() == arena._chunk.untyped_storage().data_ptr()
    assert kept.nbytes >= packed_gemm.ARENA_MIN_BYTES


def test_arena_carves_aligned_tensors_and_rolls_over():
    from kernels.hugepages import Arena

    arena = Arena(chunk_bytes=4 << 20, align=64)
    t1 = arena.empty((100,), torch.float32)  # 400 bytes
    t2 = arena.empty((10, 7), torch.bfloat16)
    assert t2.data_ptr() == t1.data_ptr() + 448 and t2.data_ptr() % 64 == 0  # next 64-byte boundary
    big = arena.empty((2 << 20,), torch.float32)  # 8 MiB: more than a chunk, a mapping of its own
    after = arena.empty((4,), torch.float32)
    assert big.numel() == 2 << 20 and after.data_ptr() != t2.data_ptr() + t2.nbytes
    t1.fill_(1.0)
    t2.fill_(2.0)
    big.fill_(3.0)
    assert t1.sum() == 100 and float(t2.float().sum()) == 140 and float(big[-1]) == 3.0  # no overlap
