"""The C RMSNorm, RoPE, SwiGLU and row argmax of the CPU forward (kernels/cpu_norm.py; float32 and bfloat16) against torch references,
in every build this CPU can run: its own (AVX-512 or AVX2), the AVX2 one (``INFERQ_NO_AVX512``) and the portable
loops (``INFERQ_NO_AVX2``); odd sizes reach the scalar tails, strided rows the row strides, many rows the
OpenMP split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_norm, native

pytestmark = pytest.mark.skipif(cpu_norm.load() is None, reason="no C compiler: the model keeps torch's ops")

FLAGS = native.cpu_flags().split()
BUILDS = [pytest.param((None, "avx512" if "avx512f" in FLAGS else "avx2" if "avx2" in FLAGS else "scalar"), id="native"),
          pytest.param(({"INFERQ_NO_AVX512": 1}, "avx2" if "avx2" in FLAGS else "scalar"), id="avx2"),
          pytest.param(({"INFERQ_NO_AVX2": 1}, "scalar"), id="scalar")]


@pytest.fixture(params=BUILDS)
def lib(request):
    defines, expected = request.param
    built = cpu_norm.build(defines)
    assert built is not None and cpu_norm.path(built) == expected
    return built


@pytest.mark.parametrize("t, h", [(1, 576), (3, 577), (40, 64), (2, 7)])
def test_rms_norm_matches_the_hf_formula(lib, t, h):
    g = torch.Generator().manual_seed(t * 1000 + h)
    x = torch.randn(t, h + 5, generator=g)[:, 2:h + 2] * 3  # rows with a stride larger than h
    w = torch.randn(h, generator=g)
    expected = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * w
    got = cpu_norm.rms_norm(x, w, 1e-5, lib)
    assert got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t, heads, half", [(1, 12, 32), (5, 3, 7), (2, 1, 1)])
def test_rope_is_the_complex_rotation(lib, t, heads, half):
    g = torch.Generator().manual_seed(heads * 100 + half)
    qkv = torch.randn(t, heads * 2 * half + 9, generator=g)  # more columns than the rotated heads (v)
    angle = torch.rand(t, half, generator=g) * 6.3
    rot = torch.polar(torch.ones_like(angle), angle)
    expected = qkv.clone()
    head_view = expected[:, : heads * 2 * half].reshape(t, heads, half, 2)
    rotated = torch.view_as_real(torch.view_as_complex(head_view.contiguous()) * rot[:, None, :])
    expected[:, : heads * 2 * half] = rotated.reshape(t, -1)
    cpu_norm.rope_interleaved_(qkv, heads, torch.view_as_real(rot), lib)
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t, inter", [(1, 1536), (3, 13), (4, 8)])
def test_silu_mul_in_place(lib, t, inter):
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(t, 2 * inter, generator=g) * 8  # large |x| too: both sides of the sigmoid's branch
    gu[0, 0], gu[-1, 1] = 0.0, -100.0
    expected = F.silu(gu[:, :inter]) * gu[:, inter:]
    got = cpu_norm.silu_mul_(gu, lib)
    assert got.data_ptr() == gu.data_ptr()  # in place: the first half of each row
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _bf16_close(got: torch.Tensor, exact: torch.Tensor) -> None:
    """bfloat16 results of float32 arithmetic rounded once: within half a bfloat16 step of the exact value
    (plus a hair for the order of the float32 sums)."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8 + 1e-5, atol=1e-6)


@pytest.mark.parametrize("t, h", [(1, 576), (3, 577), (40, 64)])
def test_rms_norm_bfloat16(lib, t, h):
    g = torch.Generator().manual_seed(t * 7 + h)
    x = (torch.randn(t, h + 5, generator=g)[:, 2:h + 2] * 3).bfloat16()
    w = torch.randn(h, generator=g).bfloat16()
    xf = x.float()
    exact = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)) * w.float()
    _bf16_close(cpu_norm.rms_norm(x, w, 1e-5, lib), exact)


@pytest.mark.parametrize("t, heads, half", [(1, 12, 32), (5, 3, 7)])
def test_rope_half_bfloat16(lib, t, heads, half):
    """The rotate-half form (the checkpoint's q/k order, what the bfloat16 forward keeps) in place; the
    columns past the rotated heads (v) untouched."""
    g = torch.Generator().manual_seed(heads * 10 + half)
    qkv = torch.randn(t, heads * 2 * half + 9, generator=g).bfloat16()
    angle = torch.rand(t, half, generator=g) * 6.3
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    qk = qkv[:, : heads * 2 * half].float().view(t, heads, 2 * half)
    x1, x2 = qk[..., :half], qk[..., half:]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(t, -1)
    v_before = qkv[:, heads * 2 * half:].clone()
    cpu_norm.rope_half_(qkv, heads, cos, sin, lib)
    _bf16_close(qkv[:, : heads * 2 * half], exact)
    assert torch.equal(qkv[:, heads * 2 * half:], v_before)


@pytest.mark.parametrize("t, inter", [(1, 1536), (3, 13)])
def test_silu_mul_bfloat16(lib, t, inter):
    g = torch.Generator().manual_seed(inter + 1)
    gu = (torch.randn(t, 2 * inter, generator=g) * 8).bfloat16()
    exact = F.silu(gu[:, :inter].float()) * gu[:, inter:].float()
    got = cpu_norm.silu_mul_(gu, lib)
    assert got.data_ptr() == gu.data_ptr()
    _bf16_close(got, exact)


@pytest.mark.parametrize("r, v", [(1, 49152), (3, 1000), (5, 17), (2, 7), (1, 1), (40, 96)])
def test_argmax_rows_is_torch_argmax(lib, r, v):
    """Random rows, then the cases a vector argmax gets wrong first: ties (the first index wins, across lanes and
    in the tail), the maximum in the tail or at index 0, all -inf, +inf, NaN (torch: the first NaN), strided rows."""
    g = torch.Generator().manual_seed(r * 100_000 + v)
    x = torch.randn(r, v + 3, generator=g)[:, 1:v + 1]  # a row stride larger than v
    assert torch.equal(cpu_norm.argmax_rows(x, lib), x.argmax(-1))
    rows = []
    base = torch.randn(v, generator=g)
    for hot in ([0], [v - 1], [v // 2, v - 1], [3, v // 3], list(range(0, v, 5)), [v - 2, v - 1]):
        row = base.clone()
        for i in hot:
            if 0 <= i < v:
                row[i] = 9.0  # equal maxima: the first must win
        rows.append(row)
    rows.append(torch.full((v,), float("-inf")))
    inf = base.clone()
    inf[v // 2] = float("inf")
    rows.append(inf)
    for nan_at in (0, v // 2, v - 1):
        row = base.clone()
        row[min(v - 1, nan_at + 1)] = 50.0
        row[nan_at] = float("nan")
        rows.append(row)
    cases = torch.stack(rows)
    assert torch.equal(cpu_norm.argmax_rows(cases, lib), cases.argmax(-1))
    for row in cases:  # one row at a time too (no OpenMP split)
        assert int(cpu_norm.argmax_rows(row[None], lib)[0]) == int(row.argmax())
