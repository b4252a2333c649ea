"""kernels/w8a8_panels.py (csrc/w8a8_gemm.c): int8 weights times int8 activations quantised in blocks of 32.

The activation codes and block scales equal a torch reference of the same quantisation exactly; the product
matches that reference's float64 sum tightly (float32 rounding of the per-block sums only) and plain float matmul
loosely (the quantisation error), on random and adversarial inputs (all-zero blocks and rows, a huge outlier
channel, odd N, M = 1, 3, 17, 200), with bias and accumulation, for the native build and every forced one the
CPU can run: AVX-VNNI without AVX-512, AVX2 without VNNI, scalar (which all agree bit for bit: the same integer
sums, the same fmas in the same order), each with the int8 panels (+128 offset / sign trick) and the int16 ones
(vpdpwssd / vpmaddwd), which agree bit for bit too; K not a multiple of 32 is refused; the planner's "w8a8" and
"w8a8w" forms run the kernel."""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import quant, quant_gemm, w8a8_panels

pytestmark = pytest.mark.skipif(not w8a8_panels.available(), reason="no C compiler")

ROWS = (1, 3, 17, 200)
SHAPES = [(37, 96), (100, 576), (16, 32), (200, 1536)]  # (N, K): N not a multiple of 16 but one


# the build for each path: on a CPU without an instruction set, its build falls back to the next one down
BUILDS = {"native": None, "no-avx512": {"INFERQ_NO_AVX512": 1}, "no-vnni": {"INFERQ_NO_VNNI": 1},
          "scalar": {"INFERQ_NO_AVX2": 1}}


@functools.cache
def _lib(variant: str):
    return w8a8_panels.build(BUILDS[variant])


def _weight(n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row
    w[min(3, n - 1), 5] = 40.0  # a weight outlier
    return w


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 7] *= 300.0  # an outlier channel in every row (SmolLM2's hidden states carry a few)
    x[:, 32:64] = 0.0  # an all-zero block in every row (where K > 32)
    if m > 2:
        x[2] = 0.0  # an all-zero row
    x[0, -1] = -1e4  # a huge single value
    return x


def _reference(x: torch.Tensor, q: quant.QuantizedWeight) -> torch.Tensor:
    """The same block quantisation in torch, the product in float64."""
    xq, d = w8a8_panels.reference_quantize(x)
    m, k = x.shape
    xd = (xq.double().view(m, k // 32, 32) * d.double()[..., None]).view(m, k)
    return xd @ q.dequantize().double().t()


def _check_tight(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, q: quant.QuantizedWeight, added=0.0) -> None:
    """float32 rounding only: each element within 1e-5 of its magnitude scale sum |x||w| + |added| + |ref|
    (`added`: what bias and accumulation put in, which can cancel the product)."""
    added = torch.as_tensor(added, dtype=torch.float64).abs()
    scale = x.double().abs() @ q.dequantize().double().abs().t() + added + ref.abs() + 1e-30
    err = (got.double() - ref).abs()
    assert (err <= 1e-5 * scale).all(), float((err / scale).max())


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("variant", list(BUILDS))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_product_matches_the_block_quantised_reference(variant, wide, n, k):
    lib = _lib(variant)
    assert lib is not None
    assert (w8a8_panels.isa(lib) == "scalar") == (variant == "scalar")
    q = quant.quantize(_weight(n, k), "int8")
    p = w8a8_panels.pack(q, wide=wide)
    assert p.wide == wide
    assert p.codes.shape == (((n + 15) // 16, k // 2, 16, 2) if wide else ((n + 15) // 16, k // 4, 16, 4))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for m in ROWS:
        x = _x(m, k, m * 7 + k)
        xq, d = w8a8_panels.quantize(x, lib=lib, wide=wide)
        rq, rd = w8a8_panels.reference_quantize(x)
        assert torch.equal(xq, rq) and torch.equal(d, rd)
        assert int(xq.abs().max()) <= 127
        ref = _reference(x, q)
        y = w8a8_panels.matmul(x, p, lib=lib)
        _check_tight(y, ref, x, q)
        if m > 2:
            assert not y[2].any()  # an all-zero row gives exact zeros
        assert not y[:, 0].any()  # so does an all-zero weight row
        _check_tight(w8a8_panels.matmul(x, p, bias, lib=lib), ref + bias.double(), x, q, bias)
        out = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
        want, added = ref + bias.double() + out.double(), bias.double().abs() + out.double().abs()
        assert w8a8_panels.matmul(x, p, bias, out=out, lib=lib) is out
        _check_tight(out, want, x, q, added)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_builds_and_layouts_agree_bit_for_bit(n, k):
    q = quant.quantize(_weight(n, k), "int8")
    narrow, wide = w8a8_panels.pack(q, wide=False), w8a8_panels.pack(q, wide=True)
    for m in ROWS:
        x = _x(m, k, m + 3)
        a = w8a8_panels.matmul(x, narrow, lib=_lib("native"))
        for p in (narrow, wide):
            for variant in BUILDS:
                b = w8a8_panels.matmul(x, p, lib=_lib(variant))
                assert torch.equal(a, b), (p.wide, variant, float((a - b).abs().max()))


def test_close_to_the_float_product_and_far_better_than_per_token():
    """Loose bound against plain float matmul; with an outlier channel, block scales keep most of the accuracy
    that one scale per token loses."""
    n, k = 192, 576
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05  # no weight outlier: its rows'
    q = quant.quantize(w, "int8")  # own quantisation error would dominate the comparison with float
    p = w8a8_panels.pack(q)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        x[:, 7] *= 100.0
        exact = x.double() @ w.double().t()
        wonly = x.double() @ q.dequantize().double().t()
        rel = float((w8a8_panels.matmul(x, p).double() - exact).norm() / exact.norm())
        assert rel < 0.02, rel
        amax = x.abs().amax(dim=1, keepdim=True)
        per_token = torch.round(x * (127.0 / amax)) * (amax / 127.0)
        rel_tok = float((per_token.double() @ q.dequantize().double().t() - wonly).norm() / wonly.norm())
        rel_blk = float((w8a8_panels.matmul(x, p).double() - wonly).norm() / wonly.norm())
        assert rel_blk < rel_tok / 3, (rel_blk, rel_tok)


def test_strided_rows():
    q = quant.quantize(_weight(45, 256), "int8")
    p = w8a8_panels.pack(q)
    big = torch.randn(17, 300)
    x = big[:, 20:276]
    assert x.stride(0) == 300
    assert torch.equal(w8a8_panels.matmul(x, p), w8a8_panels.matmul(x.contiguous(), p))


def test_k_not_a_multiple_of_32_is_refused():
    q = quant.quantize(_weight(20, 48), "int8")
    assert not w8a8_panels.supports(48)
    with pytest.raises(ValueError, match="multiple of 32"):
        w8a8_panels.pack(q)
    lib = _lib("native")
    x, y = torch.zeros(1, 48), torch.zeros(1, 16)
    codes, scales = torch.zeros(1, 12, 16, 4, dtype=torch.int8), torch.zeros(16)
    for wide in (0, 1):
        assert lib.w8a8_gemm(x.data_ptr(), 48, codes.data_ptr(), wide, scales.data_ptr(), None, y.data_ptr(), 16, 1,
                             16, 48, 0) == 1
    # the planner's w8a8 form falls back to torch's per-token product for such a K
    lin = quant_gemm.QuantLinear(q, None, ("w8a8", "w8a8", "w8a8w", "w8a8w"))
    assert lin.a8 is None and lin.a8w is None
    assert lin(torch.randn(3, 48)).shape == (3, 20)
    assert lin(torch.randn(200, 48)).shape == (200, 20)


@pytest.mark.parametrize("form", ["w8a8", "w8a8w"])
def test_quant_linear_w8a8_forms_run_the_kernel(form):
    n, k = 70, 128
    q = quant.quantize(_weight(n, k), "int8")
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    lin = quant_gemm.QuantLinear(q, bias, (form,) * 4)
    a8 = lin.a8 if form == "w8a8" else lin.a8w
    assert a8 is not None and a8.wide == (form == "w8a8w")
    assert not lin.weight.codes.numel() and lin.nbytes == a8.nbytes  # our panels are the only copy
    x = _x(5, k, 0)
    ref = _reference(x, q) + bias.double()
    _check_tight(lin(x), ref, x, q, bias)
    out = torch.ones(5, n)
    assert lin.add_to(out, x) is out
    _check_tight(out, ref + 1.0, x, q, bias.abs() + 1.0)
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    planned = quant_gemm.plan(q, activations="any")
    assert set(planned.forms) <= set(quant_gemm.FORMS["int8"])
    assert (planned.a8 is not None) == ("w8a8" in planned.forms)
    assert (planned.a8w is not None) == ("w8a8w" in planned.forms)
    assert ("w8a8w" in quant_gemm.candidates("int8", "any")) == w8a8_panels.default_wide()
    assert "w8a8w" not in quant_gemm.candidates("int8")
