"""kernels/cpu_gemm.py: every layout and form computes the same product as F.linear; the planner keeps one
weight copy and honours keep_layout."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm
from kernels.cpu_gemm import Linear


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


def test_bucket_bounds():
    assert [cpu_gemm._bucket(m) for m in (1, 16, 17, 128, 129, 512, 513, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_plan_keeps_one_copy_and_the_shared_layout():
    w = torch.randn(64, 32)
    tied = cpu_gemm.plan(w, keep_layout=True)
    assert tied.layout == "oi" and tied.weight.data_ptr() == w.data_ptr()  # the embedding table itself
    free = cpu_gemm.plan(w)
    assert free.layout in ("oi", "io") and len(free.forms) == len(cpu_gemm.PROBE_M)
    assert set(free.forms) <= {"xw", "wx"}
    x = torch.randn(20, 32)
    torch.testing.assert_close(free(x), F.linear(x, w))
    assert "64x32 float32" in cpu_gemm.plans()
    plain = cpu_gemm.plan(w, autotune=False)
    assert plain.layout == "oi" and plain.forms == ("xw",) * 4
