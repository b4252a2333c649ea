"""``y = x W^T + b`` on CPU with W quantised (:mod:`kernels.quant`) and packed once at load into 16-column panels:
our own kernel (``csrc/quant_gemm.c``), AVX2 + FMA, float32 activations and arithmetic.

Why: torch's quantised CPU products are far from reading the weight at memory bandwidth at one sequence
(bfloat16 activations, per-call setup); in panels, like :mod:`kernels.packed_gemm`'s float ones, a decode step
streams the codes front to back once and widens them in registers. Layouts (the C file says why):

- int8: codes ``[ceil(N/16), K, 16]`` int8 and the per-channel scales ``[Npad]`` float32;
- int4: codes ``[ceil(N/16), K/2, 16]`` uint8 (the byte of column c for k pair j: k = 2j in the low nibble,
  2j + 1 in the high one) and ``sz [ceil(N/16), K/G, 2, 16]`` float32: per group its 16 scales, then its 16
  offsets ``zero - 8 scale`` (so ``w = q * scale + offset``); float16 where every value converts exactly
  (the same weight in 5/6 of the bytes at group 32).

Which of this and torch's forms is faster per shape and M is measured at load by :mod:`kernels.quant_gemm`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass

import torch

from kernels import hugepages, native
from kernels.quant import QuantizedWeight

PANEL = 16
SOURCES = ("quant_gemm.c",)
FMT = {"int8": 0, "int4": 1}
# Kept packs of at least this many bytes go to the arena: every projection of a 135M model, whose int4 codes are
# 166-885 KB (a threshold of 1 MB had left all of them, and their scales, in 4 KiB pages: single-stream decode
# w4a8 1.08-1.13x, int4 1.11-1.16x, int8 1.08x, two engines alternated). Smaller ones (tests' tiny models) are
# ordinary tensors.
ARENA_MIN_BYTES = 64 << 10
_arena = hugepages.Arena()  # panels kept for the model's life, in huge pages (kernels/hugepages.py says why)


def build(defines: dict[str, object] | None = None) -> ctypes.CDLL | None:
    """Build (once per machine) and :func:`bind` the library; ``defines`` picks a variant (:mod:`kernels.native`,
    e.g. ``{"INFERQ_NO_AVX512": 1}``). None where it cannot be built."""
    lib = native.build("quant_gemm", SOURCES, defines)
    return bind(lib) if lib is not None else None


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's C signatures: ``(fmt, x, xs, codes, s, G, b, y, ys, M, N, K, accumulate)``."""
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for fn in (lib.qgemm, lib.qgemm_team):
        fn.argtypes = [i, p, i64, p, p, i, p, p, i64, i, i, i, i]
        fn.restype = i
    lib.qgemm_set_widen_rows.argtypes = [i, i]
    lib.qgemm_set_widen_rows.restype = None
    lib.qgemm_widen_rows.argtypes = [i]
    lib.qgemm_widen_rows.restype = i
    lib.qgemm_a8_isa.argtypes = []
    lib.qgemm_a8_isa.restype = i
    lib.qgemm_set_int4_pieces.argtypes = [i]
    lib.qgemm_set_int4_pieces.restype = None
    lib.qgemm_int4_pieces.argtypes = []
    lib.qgemm_int4_pieces.restype = i
    return lib


A8_ISA = {1: "avx2", 3: "avx512-vnni"}


def act8_isa(lib: ctypes.CDLL | None = None) -> str | None:
    """Which tile multiplies int4 panels by int8 activations in this build ("avx2", "avx512-vnni"); None
    where the kernel does not run."""
    lib = lib or _load()
    return A8_ISA[lib.qgemm_a8_isa()] if lib is not None else None


def int4_pieces(lib: ctypes.CDLL | None = None) -> int:
    """Over how many int8 pieces of each activation block (2 or 3) int4 panels times float activations run as
    the integer tile at decode row counts; 0 where they run the float tile (builds without AVX512-VNNI + VBMI;
    csrc/quant_gemm.c says why and what each count keeps of x)."""
    lib = lib or _load()
    return lib.qgemm_int4_pieces() if lib is not None else 0


@functools.cache
def _load() -> ctypes.CDLL | None:
    return build() if native.has_avx2_fma() else None


def available() -> bool:
    """Whether the kernel runs here (x86 CPU with AVX2 + FMA and a C compiler)."""
    return _load() is not None


@dataclass(frozen=True)
class Panels:
    """A quantised ``[n, k]`` weight in panels. ``codes``: int8 ``[np, k, 16]`` or uint8 ``[np, k/2, 16]``;
    ``scales``: float32 ``[np * 16]`` (int8) or ``[np, k/group, 2, 16]`` (int4: scales, then offsets; float16
    where every one converts exactly, see :func:`pack`)."""

    fmt: str
    n: int
    k: int
    group_size: int
    codes: torch.Tensor
    scales: torch.Tensor
    act8: bool = False  # int4 only: activations quantised to int8 in blocks of 32 in every product (w4a8)

    @property
    def code(self) -> int:
        """The kernel's format number: 0 int8, 1 int4, 2 int4 times int8 activations; an int4 one plus 4 where
        its scales are float16."""
        return (2 if self.act8 else FMT[self.fmt]) + (4 if self.scales.dtype == torch.float16 else 0)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the de-quantised int8 weight (float32), bit for bit ``QuantizedWeight``'s."""
        assert self.fmt == "int8", "int4 rows are read from the codes (QuantLinear keeps them when asked)"
        if ids.numel() == 1:  # a decode step's token: a view, not the gather's five ops (the same products)
            i = int(ids.reshape(()))
            return (self.codes[i // PANEL, :, i % PANEL].float() * self.scales[i]).unsqueeze(0)
        return self.codes[ids // PANEL, :, ids % PANEL].float() * self.scales[ids][:, None]


def _kept(t: torch.Tensor, arena: bool) -> torch.Tensor:
    """``t``, copied into the arena where ``arena``."""
    return _arena.empty(tuple(t.shape), t.dtype).copy_(t) if arena else t.contiguous()


def _panel_major(t: torch.Tensor, np_: int) -> torch.Tensor:
    """``[n, c]`` -> ``[np, c, 16]`` (rows past n zero): column c of output row 16 p + i at ``[p, c, i]``."""
    padded = torch.zeros((np_ * PANEL, t.shape[1]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded.view(np_, PANEL, -1).transpose(1, 2)


def pack(q: QuantizedWeight, huge: bool = False) -> Panels:
    """``q`` in panels (padded output rows are zero weights). ``huge``: codes in the huge-page arena (a weight
    kept for the model's life; never for a throw-away copy, whose arena space would not come back)."""
    n, k = q.shape
    np_ = -(-n // PANEL)
    if q.fmt == "int8":
        codes = _panel_major(q.codes, np_)
        scales = torch.zeros(np_ * PANEL)
        scales[:n] = q.scale
        return Panels("int8", n, k, 0, _kept(codes, huge and codes.numel() >= ARENA_MIN_BYTES), scales)
    assert q.fmt == "int4" and q.zero is not None and k % 2 == 0
    c = _panel_major(q.codes, np_).reshape(np_, k // 2, 2, PANEL)
    packed = c[:, :, 0] | (c[:, :, 1] << 4)
    # the offset zero - 8 scale in float64, rounded once
    offset64 = q.zero.double() - 8.0 * q.scale.double()
    sz = torch.stack((_panel_major(q.scale, np_), _panel_major(offset64.float(), np_)), dim=2).contiguous()
    if _fits_half(q.scale, offset64, q.zero):
        sz = sz.half()
    arena = huge and packed.numel() >= ARENA_MIN_BYTES  # the scales too: read beside the codes, a quarter of their bytes
    return Panels("int4", n, k, q.group_size, _kept(packed, arena), _kept(sz, arena))


def _fits_half(scale: torch.Tensor, offset: torch.Tensor, zero: torch.Tensor) -> bool:
    """Whether an int4 weight's scales and offsets go to float16 without changing the weight beyond float32's
    own rounding: every scale exactly, every offset within two float32 ulps of the terms it is computed from
    (``zero = offset + 8 scale`` rounds once in float32). True for GGUF's Q4_0 / Q4_1 blocks (float16 ``d`` and
    ``m``) and kernels/quant.py's quantiser; not for GPTQ's ``zero * scale`` offsets, which keep float32. Why:
    a third of an int4 g32 panel's bytes are float32 scales and offsets, and a memory-bound decode step reads
    every one."""
    if not torch.equal(scale.half().float(), scale):
        return False
    err = (offset.half().double() - offset).abs()
    return bool((err <= 2.0**-22 * (zero.double().abs() + 8.0 * scale.double().abs())).all())


def with_int8_activations(panels: Panels) -> Panels:
    """The same int4 panels (no copy), multiplied with activations quantised to int8 in blocks of 32 inputs and
    integer dot products (``csrc/quant_gemm.c``'s ``block4a8``: llama.cpp's Q4 x Q8_0 arithmetic). Needs k a
    multiple of 32 (:func:`supports_act8`)."""
    assert panels.fmt == "int4" and supports_act8(panels.k, panels.group_size), (panels.k, panels.group_size)
    return dataclasses.replace(panels, act8=True)


def supports_act8(k: int, group_size: int) -> bool:
    """Whether int4 panels of this width and group size multiply int8 activations: k in whole blocks of 32, and
    each group a multiple or a divisor of 32."""
    return k % 32 == 0 and (group_size % 32 == 0 or 32 % group_size == 0)


def operands(x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None, out: torch.Tensor | None):
    """A panel product's C operands: ``x`` float32 ``[M, k]`` with dense rows, ``out`` (a new float32 ``[M, n]``
    unless given, then accumulated into), ``bias`` float32 and dense or None, and whether it accumulates."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert x.shape[1] == k, (x.shape[1], k)
    accumulate = out is not None
    if out is None:
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
    assert out.dtype == torch.float32 and out.stride(-1) == 1 and out.shape == (x.shape[0], n)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    return x, out, bias, accumulate


def matmul(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           lib: ctypes.CDLL | None = None, team: bool = False) -> torch.Tensor:
    """``x W^T + b`` as a new float32 ``[M, n]`` tensor, or ``out += x W^T + b`` in place when ``out`` is given
    (float32, dense rows). ``x`` float32 ``[M, k]`` with dense rows (any row stride). ``lib``: a variant from
    :func:`build` (tests); ``team``: call ``qgemm_team`` (outside a parallel region: one thread) instead."""
    lib = lib or _load()
    assert lib is not None, "quantised panel GEMM kernel not available"
    x, out, bias, accumulate = operands(x, panels.k, panels.n, bias, out)
    m, k = x.shape
    fn = lib.qgemm_team if team else lib.qgemm
    err = fn(panels.code, x.data_ptr(), x.stride(0), panels.codes.data_ptr(), panels.scales.data_ptr(),
             panels.group_size, bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0), m,
             panels.n, k, 1 if accumulate else 0)
    assert err == 0, f"quantised panel GEMM refused {panels.fmt}{' a8' if panels.act8 else ''} k={k} group={panels.group_size}"
    return out
