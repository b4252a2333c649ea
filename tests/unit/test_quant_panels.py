"""kernels/quant_panels.py (csrc/quant_gemm.c): int8 and int4 panels against the de-quantised weight in float64,
at decode and prefill row counts, odd output widths, several groups (all-zero ones and outliers among them),
bias and accumulation, for the AVX2 build and the default one; qgemm_team outside a parallel region equals
qgemm; and the planner's "panels" form inside QuantLinear. int4 panels times int8 activations (w4a8) against the
de-quantised weight times the de-quantised activation blocks (w8a8_panels.reference_quantize), and each row's
result independent of the rows beside it (integer sums, the same folds at every M)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from kernels import native, quant, quant_gemm, quant_panels, w8a8_panels

pytestmark = pytest.mark.skipif(not quant_panels.available(), reason="no AVX2+FMA CPU or no C compiler")

ROWS = (1, 2, 3, 5, 8, 13, 16, 64, 257)
# (fmt, group size, N, K): N never a multiple of 16; K several groups (and, for 1536, several K-blocks)
CASES = [("int8", 0, 37, 96), ("int8", 0, 100, 576), ("int4", 32, 37, 128), ("int4", 64, 50, 576),
         ("int4", 128, 21, 1536), ("int4", 256, 19, 512)]


BUILDS = {"avx2": {"INFERQ_NO_AVX512": 1}, "no-vnni": {"INFERQ_NO_VNNI": 1}, "default": None}


@functools.cache
def _lib(variant: str):
    return quant_panels.build(BUILDS[variant])


def _weight(n: int, k: int, group: int, tiny: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    span = group or 32
    w[0] = 0.0  # an all-zero row
    w[1, :span] = 0.0  # an all-zero group
    w[2, span : 2 * span] = 0.25  # a constant group
    w[3, 5] = 40.0  # outliers
    w[-1, -1] = -25.0
    if tiny:
        w[4] *= 1e-5  # tiny values: int4 scales below float16's normal range, so its panels keep float32 ones
    return w


def _quantized(fmt: str, group: int, n: int, k: int, tiny: bool = True) -> quant.QuantizedWeight:
    w = _weight(n, k, group, tiny)
    return quant.quantize(w, fmt, group) if fmt == "int4" else quant.quantize(w, fmt)


def _packed(fmt: str, group: int, n: int, k: int, half: bool) -> tuple[quant.QuantizedWeight, quant_panels.Panels]:
    """The weight and its panels; int4 with float16 scales (half) or float32 ones (tiny values in the weight)."""
    q = _quantized(fmt, group, n, k, tiny=not half)
    p = quant_panels.pack(q)
    if fmt == "int4":
        assert p.scales.dtype == (torch.float16 if half else torch.float32)
    return q, p


HALF = [pytest.param(False, id="f32-scales"), pytest.param(True, id="f16-scales")]


def _check(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, added=0.0) -> None:
    """float32 summation order only: each element within ~1e-5 of sum |x w| + |added| + |ref| (its rounding scale:
    `added` is what bias and accumulation put in, which can cancel the product), and the whole within 1e-5
    relative."""
    added = torch.as_tensor(added, dtype=torch.float64).abs()
    scale = x.double().abs() @ w.double().abs().t() + added + ref.abs() + 1e-30
    err = (got.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-30).all(), float((err / scale).max())
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("variant", ["avx2", "default"])
@pytest.mark.parametrize(("fmt", "group", "n", "k"), CASES)
def test_panels_match_the_dequantised_weight(variant, fmt, group, n, k, half):
    """To float32 rounding: int4 times float activations with three int8 pieces where the build has them (two,
    the default, are checked against their own bound below)."""
    lib = _lib(variant)
    assert lib is not None
    with _pieces(lib, 3):
        _check_panels(lib, fmt, group, n, k, half)


def _check_panels(lib, fmt, group, n, k, half):
    q, p = _packed(fmt, group, n, k, half)
    assert p.codes.shape == ((n + 15) // 16, k if fmt == "int8" else k // 2, 16)
    w = q.dequantize()
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        x[0, :7] *= 1e3  # an activation outlier
        ref = x.double() @ w.double().t()
        _check(quant_panels.matmul(x, p, lib=lib), ref, x, w)
        _check(quant_panels.matmul(x, p, bias, lib=lib), ref + bias.double(), x, w, bias)
        out = torch.randn(m, n, generator=gen)
        want, added = ref + bias.double() + out.double(), bias.double().abs() + out.double().abs()
        got = quant_panels.matmul(x, p, bias, out=out, lib=lib)
        assert got is out
        _check(out, want, x, w, added)


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_direct_and_widened_paths_agree_at_every_row_count(fmt, half):
    """Both paths for every M: the codes widened in registers per tile, and a K-block at a time into scratch."""
    lib = _lib("default")
    f = quant_panels.FMT[fmt]
    default = lib.qgemm_widen_rows(f)
    q, p = _packed(fmt, 64, 40, 640, half)  # K = 2.5 K-blocks
    w = q.dequantize()
    gen = torch.Generator().manual_seed(3)
    with _pieces(lib, 3), contextlib.ExitStack() as undo:
        undo.callback(lib.qgemm_set_widen_rows, f, default)
        for rows in (0, 1 << 30):
            lib.qgemm_set_widen_rows(f, rows)
            for m in (1, 3, 7, 16, 70):
                x = torch.randn(m, 640, generator=gen)
                _check(quant_panels.matmul(x, p, lib=lib), x.double() @ w.double().t(), x, w)


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize(("fmt", "group", "n", "k"), CASES)
def test_avx512_and_avx2_builds_agree_bit_for_bit(fmt, group, n, k, half):
    """The 512-bit float decode tiles do per lane what the two-ymm tiles do, in the same order: equal results, at
    every tile height, with bias and accumulation (on an AVX2-only CPU both builds are the AVX2 one). The default
    build's int4 pieces (tested below) are turned off here."""
    q, p = _packed(fmt, group, n, k, half)
    gen = torch.Generator().manual_seed(n + k)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 4, 5, 6, 7, 12):
        x = torch.randn(m, k, generator=gen)
        out = torch.randn(m, n, generator=gen)
        with _float_tiles(_lib("default")):
            got = {v: (quant_panels.matmul(x, p, lib=_lib(v)),
                       quant_panels.matmul(x, p, bias, out=out.clone(), lib=_lib(v))) for v in ("avx2", "default")}
        assert torch.equal(got["avx2"][0], got["default"][0]), m
        assert torch.equal(got["avx2"][1], got["default"][1]), m


@contextlib.contextmanager
def _pieces(lib, count: int):
    """int4 times float activations over ``count`` int8 pieces (0: by the float tiles) inside the block."""
    before = lib.qgemm_int4_pieces()
    lib.qgemm_set_int4_pieces(count)
    try:
        yield
    finally:
        lib.qgemm_set_int4_pieces(before)


def _float_tiles(lib):
    return _pieces(lib, 0)


def _pieces_reference(x: torch.Tensor, count: int) -> torch.Tensor:
    """x as quant_gemm.c's quant_pieces splits it, in float64: per block of 32, d = max |x| / 127 and t = x / d
    (float32), q1 = rint(t), q2 = rint(128 (t - q1)), q3 = rint(128 (128 (t - q1) - q2)), x' = d (q1 + q2 / 128 +
    q3 / 16384) over the first ``count`` pieces."""
    b = x.float().reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    t = b * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    pieces = []
    for _ in range(count):
        pieces.append(torch.round(t))
        t = (t - pieces[-1]) * 128.0
    for q, bound in zip(pieces, (127, 64, 64), strict=False):
        assert q.abs().max() <= bound
    return (d.double() * sum(q.double() / 128**c for c, q in enumerate(pieces))).reshape(x.shape)


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize(("fmt", "group", "n", "k"), [c for c in CASES if c[0] == "int4"])
def test_int4_float_activations_as_int8_pieces(fmt, group, n, k, count, half):
    """Where the build has the VNNI tile, int4 panels times float activations at decode row counts run it over
    two or three int8 pieces of each activation block: the result equals the de-quantised weight times the
    pieces' activations to float32 rounding (three pieces: so the float activations within the same bound,
    tests above), a row's result is the same bit for bit whichever rows share its call, and row counts above the
    direct tiles' are the float path's. Builds without it report so and never run it."""
    flags = set(native.cpu_flags().split())
    vnni = {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"} <= flags
    assert bool(quant_panels.int4_pieces(_lib("default"))) == vnni
    assert not quant_panels.int4_pieces(_lib("avx2")) and not quant_panels.int4_pieces(_lib("no-vnni"))
    if not vnni:
        pytest.skip("no AVX512-VNNI + VBMI: the pieces tile is not in this machine's builds")
    lib = _lib("default")
    with _pieces(lib, count):
        assert quant_panels.int4_pieces(lib) == count
        _check_pieces(lib, fmt, group, n, k, count, half)


def _check_pieces(lib, fmt, group, n, k, count, half):
    q, p = _packed(fmt, group, n, k, half)
    w = q.dequantize()
    gen = torch.Generator().manual_seed(n * k + 7)
    x = torch.randn(13, k, generator=gen)
    x[0, :7] *= 1e3  # an activation outlier: its block's pieces are coarser
    x[1, 32:64] = 0.0  # an all-zero block
    x[2, 40] = 1e-30  # below float32's normal range once scaled: its pieces are 0, and that is within the bound
    for m in (1, 2, 3, 4, 5, 8, 12):
        got = quant_panels.matmul(x[:m], p, lib=lib)
        _check(got, _pieces_reference(x[:m], count) @ w.double().t(), x[:m], w)
        if count == 2:  # each activation within d / 256 (d = its block's max |x| / 127) of x
            err = quant_panels.matmul(x[:m], p, lib=lib).double() - x[:m].double() @ w.double().t()
            step = x[:m].abs().reshape(m, -1, 32).amax(-1).repeat_interleave(32, dim=1).double() / (127 * 256)
            scale = x[:m].double().abs() @ w.double().abs().t()
            assert (err.abs() <= step @ w.double().abs().t() + 1e-5 * scale).all(), m
        for r in {0, m - 1}:
            assert torch.equal(quant_panels.matmul(x[r : r + 1], p, lib=lib)[0], got[r]), (m, r)
        with _float_tiles(lib):
            assert not torch.equal(got, quant_panels.matmul(x[:m], p, lib=lib))  # the pieces really ran
        with _pieces(lib, 5 - count):
            assert not torch.equal(got, quant_panels.matmul(x[:m], p, lib=lib))  # and as many as asked
    with _float_tiles(lib):
        widened = quant_panels.matmul(x, p, lib=lib)
    assert torch.equal(quant_panels.matmul(x, p, lib=lib), widened)  # 13 rows: above the direct tiles


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize(("fmt", "group", "n", "k"), [c for c in CASES if c[0] == "int4" and c[3] % 32 == 0])
def test_int8_activation_tiles_agree_bit_for_bit_in_every_build(fmt, group, n, k, half):
    """The AVX512-VNNI tile (vpdpbusd over permuted nibbles) and the AVX2 one (vpmaddubsw, int16 folds) sum the
    same integers and fold them in the same order: equal results at every tile height, with bias and
    accumulation. The default build runs the VNNI tile wherever the CPU has AVX512-VNNI and VBMI, so this
    machine checks every tile it can run."""
    flags = set(native.cpu_flags().split())
    vnni = {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"} <= flags
    assert quant_panels.act8_isa(_lib("default")) == ("avx512-vnni" if vnni else "avx2")
    assert quant_panels.act8_isa(_lib("avx2")) == quant_panels.act8_isa(_lib("no-vnni")) == "avx2"
    q, p = _packed(fmt, group, n, k, half)
    p = quant_panels.with_int8_activations(p)
    gen = torch.Generator().manual_seed(n * k + 3)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 4, 5, 6, 7, 12):
        x = torch.randn(m, k, generator=gen)
        x[0, :5] *= 300.0  # one coarse block
        out = torch.randn(m, n, generator=gen)
        got = {v: (quant_panels.matmul(x, p, lib=_lib(v)), quant_panels.matmul(x, p, bias, out=out.clone(), lib=_lib(v)))
               for v in BUILDS}
        for v in ("no-vnni", "default"):
            assert torch.equal(got["avx2"][0], got[v][0]), (m, v)
            assert torch.equal(got["avx2"][1], got[v][1]), (m, v)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_strided_rows_and_team_call_equal_qgemm(fmt):
    q = _quantized(fmt, 32, 45, 256)
    p = quant_panels.pack(q)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 4, 16, 40):
        big = torch.randn(m, 300, generator=gen)
        x = big[:, 20:276]  # a row stride that is not K
        assert x.stride(0) == 300
        whole = quant_panels.matmul(x, p)
        assert torch.equal(whole, quant_panels.matmul(x.contiguous(), p))
        # outside a parallel region, qgemm_team runs every panel on the calling thread: the same sums per element
        assert torch.equal(quant_panels.matmul(x, p, team=True), whole)


def test_bad_arguments_are_refused():
    lib = _lib("default")
    x, y = torch.zeros(1, 96), torch.zeros(1, 16)
    codes, scales = torch.zeros(1, 48, 16, dtype=torch.uint8), torch.zeros(1, 3, 2, 16)
    args = (x.data_ptr(), 96, codes.data_ptr(), scales.data_ptr())
    assert lib.qgemm(1, *args, 48, None, y.data_ptr(), 16, 1, 16, 96, 0) == 1  # 48 does not divide the K-block
    assert lib.qgemm(1, *args, 64, None, y.data_ptr(), 16, 1, 16, 96, 0) == 1  # 64 does not divide K
    assert lib.qgemm(3, *args, 32, None, y.data_ptr(), 16, 1, 16, 96, 0) == 1  # no such format
    x80 = torch.zeros(1, 80)  # int8 activations in blocks of 32: K = 80 is not whole blocks
    assert lib.qgemm(2, x80.data_ptr(), 80, codes.data_ptr(), scales.data_ptr(), 16, None, y.data_ptr(), 16, 1,
                     16, 80, 0) == 1
    assert lib.qgemm(2, *args, 32, None, y.data_ptr(), 16, 1, 16, 96, 0) == 0
    assert lib.qgemm(1, *args, 32, None, y.data_ptr(), 16, 1, 16, 96, 0) == 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quant_linear_panels_form(fmt):
    q = _quantized(fmt, 32, 70, 128)
    gen = torch.Generator().manual_seed(70)
    bias = torch.randn(70, generator=gen)
    lin = quant_gemm.QuantLinear(q, bias, ("panels",) * 4)
    assert lin.panels is not None and not lin.weight.codes.numel()  # the panels are the only copy
    assert lin.nbytes == lin.panels.nbytes  # the panels hold their own scales
    x = torch.randn(5, 128, generator=gen)
    ref = x.double() @ q.dequantize().double().t() + bias.double()
    w = q.dequantize()
    out = torch.ones(5, 70)
    with _pieces(quant_panels._load(), 3):  # float32 rounding only (two pieces: their bound, above)
        _check(lin(x), ref, x, w, bias)
        assert lin.add_to(out, x) is out
    _check(out, ref + 1.0, x, w, bias.abs() + 1.0)
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    if fmt == "int8":  # a tied table's rows come from the panels, bit for bit
        ids = torch.tensor([0, 69, 3, 3])
        assert torch.equal(lin.rows(ids), q.dequantize()[ids])
        for one in (torch.tensor([69]), torch.tensor([17])):  # a decode step's one token (its own path)
            assert lin.rows(one).shape == (1, 128) and torch.equal(lin.rows(one), q.dequantize()[one])
    assert quant_gemm.QuantLinear(q, None, ("w8a16" if fmt == "int8" else "w4",) * 4).panels is None


def test_planner_times_the_panels_and_keeps_one_copy_when_they_serve_every_bucket():
    q = _quantized("int4", 32, 64, 256)
    assert "panels" in quant_gemm.candidates("int4")
    lin = quant_gemm.plan(q)
    assert set(lin.forms) <= set(quant_gemm.FORMS["int4"])
    assert (lin.panels is not None) == ("panels" in lin.forms)
    if set(lin.forms) == {"panels"}:
        assert not lin.weight.codes.numel() and "packed" not in lin._state


def _fake_times(monkeypatch, panels_at_decode) -> dict:
    """Fake probe times: torch's w8a16 1.0 and w8dq 3.0 everywhere, the panels 2.0 above the decode bucket and
    ``panels_at_decode(sample number)`` in it; returns the panels' decode-bucket sample count."""
    calls = {"panels": 0}

    def fake_time(lin, x, scratch):
        form = lin.forms[0]
        if form != "panels":
            return {"w8a16": 1.0, "w8dq": 3.0}[form]
        if x.shape[0] > quant_gemm.BUCKET_LIMITS[0]:
            return 2.0
        calls["panels"] += 1
        return panels_at_decode(calls["panels"])

    monkeypatch.setattr(quant_gemm, "_time", fake_time)
    return calls


@pytest.mark.skipif(not quant_panels.available(), reason="the panels' kernel does not build here")
def test_decode_panels_within_the_fused_steps_margin_are_kept_and_a_noisy_first_round_is_timed_again(monkeypatch):
    """The decode bucket's panels decide whether the fused step runs: panels within FUSED_STEP_MARGIN of the
    fastest form keep that bucket; panels that miss it in the first samples (a busy moment) are timed again and
    kept when they come within it; panels that stay slow are dropped."""
    q = _quantized("int8", 0, 48, 64)
    forms = quant_gemm.WEIGHT_ONLY["int8"]
    near = _fake_times(monkeypatch, lambda n: 1.3)
    assert quant_gemm._measure(q, forms) == ("panels", "w8a16", "w8a16", "w8a16") and near["panels"] == 12
    noisy = _fake_times(monkeypatch, lambda n: 3.0 if n <= 13 else 1.2)
    assert quant_gemm._measure(q, forms) == ("panels", "w8a16", "w8a16", "w8a16")
    assert noisy["panels"] == 12 + quant_gemm.RETIME_REPS
    slow = _fake_times(monkeypatch, lambda n: 1.5)
    assert quant_gemm._measure(q, forms) == ("w8a16",) * 4 and slow["panels"] == 12 + quant_gemm.RETIME_REPS


def _act8_reference(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: each block of 32 quantised to int8 and back (float64)."""
    q, d = w8a8_panels.reference_quantize(x)
    m, k = x.shape
    return (q.double().view(m, k // 32, 32) * d.double().view(m, k // 32, 1)).view(m, k)


A8_CASES = [c for c in CASES if c[0] == "int4" and c[3] % 32 == 0]


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("variant", ["avx2", "default"])
@pytest.mark.parametrize(("fmt", "group", "n", "k"), A8_CASES)
def test_int4_panels_times_int8_activations(variant, fmt, group, n, k, half):
    """The integer tiles equal the de-quantised weight times the de-quantised activation blocks to float32
    rounding, with bias and accumulation, at every row count; a row's result is the same bit for bit whichever
    rows share its call (so a request's tokens do not depend on its batch); and the activations really are
    quantised (the float-activation panels differ)."""
    lib = _lib(variant)
    q, p = _packed(fmt, group, n, k, half)
    p = quant_panels.with_int8_activations(p)
    assert p.code == (6 if half else 2)
    w = q.dequantize()
    gen = torch.Generator().manual_seed(k + 1)
    bias = torch.randn(n, generator=gen)
    alone = {}
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        x[0, :7] *= 1e3  # an activation outlier: coarsens its own block only
        if m > 1:
            x[1, 32:64] = 0.0  # an all-zero block (scale 0)
        xh = _act8_reference(x)
        ref = xh @ w.double().t()
        got = quant_panels.matmul(x, p, lib=lib)
        _check(got, ref, xh, w)
        _check(quant_panels.matmul(x, p, bias, lib=lib), ref + bias.double(), xh, w, bias)
        out = torch.randn(m, n, generator=gen)
        want, added = ref + bias.double() + out.double(), bias.double().abs() + out.double().abs()
        assert quant_panels.matmul(x, p, bias, out=out, lib=lib) is out
        _check(out, want, xh, w, added)
        for r in {0, m - 1}:
            one = quant_panels.matmul(x[r : r + 1].contiguous(), p, lib=lib)
            assert torch.equal(one[0], got[r]), (m, r)
        alone[m] = (x, got)
        if m == 1:
            assert not torch.equal(got, quant_panels.matmul(x, quant_panels.pack(q), lib=lib))  # float activations
    # team call outside a parallel region, and a strided x, equal qgemm's
    x, got = alone[16]
    assert torch.equal(quant_panels.matmul(x, p, team=True, lib=lib), got)
    wide = torch.zeros(16, k + 40)
    wide[:, 8 : 8 + k] = x
    assert torch.equal(quant_panels.matmul(wide[:, 8 : 8 + k], p, lib=lib), got)


def test_int8_activations_need_whole_blocks_of_32():
    q = _quantized("int4", 32, 20, 96)
    assert quant_panels.supports_act8(96, 32) and not quant_panels.supports_act8(80, 16 * 5)
    with pytest.raises(AssertionError):
        quant_panels.with_int8_activations(quant_panels.pack(_quantized("int8", 0, 20, 96)))
    lin = quant_gemm.QuantLinear(q, None, ("panels",) * 4, act8=True)
    assert lin.panels is not None and lin.panels.act8
    x = torch.randn(3, 96)
    assert torch.equal(lin(x), quant_panels.matmul(x, lin.panels))
    # a torch form under act8 multiplies the de-quantised blocks: close to the panels' integer product
    torch_form = quant_gemm.QuantLinear(q, None, ("w4dq",) * 4, act8=True)
    ref = _act8_reference(x) @ q.dequantize().double().t()
    assert float((torch_form(x).double() - ref).norm() / ref.norm()) < 1e-2  # bfloat16 inside w4dq


def test_float16_scales_only_where_they_change_nothing():
    """The panels keep an int4 weight's scales and offsets in float16 where every scale converts exactly and every
    offset within float32's own rounding (GGUF's Q4_0 / Q4_1 blocks: float16 d and m; our quantiser, which rounds
    them so), and in float32 otherwise (GPTQ's offsets zero * scale; scales below float16's normal range)."""
    gen = torch.Generator().manual_seed(5)
    n, k, g = 32, 64, 32
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // g, generator=gen) * 0.01 + 1e-3).half().float()
    m = (torch.randn(n, k // g, generator=gen) * 0.05).half().float()
    q41 = quant.QuantizedWeight("int4", codes, d, m + 8.0 * d, g)  # Q4_1 as worker/gguf_weights.py maps it
    q40 = quant.QuantizedWeight("int4", codes, d, torch.zeros_like(d), g)  # Q4_0
    z = torch.randint(0, 16, (n, k // g), generator=gen).float()
    gptq = quant.QuantizedWeight("int4", codes, d, d * (8.0 - z) + d / 3.0, g)  # an offset no float16 holds
    for q, half in ((q41, True), (q40, True), (gptq, False)):
        p = quant_panels.pack(q)
        assert (p.scales.dtype == torch.float16) == half
        x = torch.randn(3, k, generator=gen)
        w = q.dequantize()
        with _pieces(quant_panels._load(), 3):
            _check(quant_panels.matmul(x, p), x.double() @ w.double().t(), x, w)
    assert quant_panels.pack(_quantized("int4", 32, 20, 64, tiny=False)).nbytes < quant_panels.pack(
        _quantized("int4", 32, 20, 64, tiny=True)).nbytes


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_kept_pack_of_the_default_models_smallest_projection_is_in_the_huge_page_arena(fmt, monkeypatch):
    """SmolLM2's o projection (576 x 576) packed to keep: its codes, and an int4 pack's scales (read beside them),
    are carved from the arena (huge pages; 4 KiB pages cost the quantised step 1.08-1.16x), one after another; a
    throw-away pack (huge=False) is not."""
    from kernels.hugepages import Arena

    arena = Arena()
    monkeypatch.setattr(quant_panels, "_arena", arena)  # a fresh one: earlier models may have filled a chunk
    q = quant.quantize(_weight(576, 576, 32), fmt, 0 if fmt == "int8" else 32)
    kept, loose = quant_panels.pack(q, huge=True), quant_panels.pack(q)
    chunk = arena._chunk.untyped_storage().data_ptr()
    assert kept.codes.untyped_storage().data_ptr() == chunk
    assert loose.codes.untyped_storage().data_ptr() != chunk
    if fmt == "int4":
        assert kept.scales.untyped_storage().data_ptr() == chunk
        torch.testing.assert_close(kept.scales, loose.scales, rtol=0, atol=0)
    torch.testing.assert_close(kept.codes, loose.codes, rtol=0, atol=0)

