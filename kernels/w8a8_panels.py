"""``y = x W^T + b`` on CPU with W int8 (per-channel, :mod:`kernels.quant`) and x quantised on the fly to int8 in
blocks of 32 inputs along K, each block with its own float32 scale (llama.cpp's Q8_0 activations): our own kernel
(``csrc/w8a8_gemm.c``), integer dot products (AVX2 sign trick + ``vpmaddubsw``/``vpmaddwd``; AVX-VNNI ``vpdpbusd``
after the sign trick; AVX512-VNNI ``vpdpbusd`` on 512-bit vectors with the weights offset to unsigned; a scalar
fallback with the same results).

Why blocks: per-token int8 activations (torch's ``_int_mm`` form, :mod:`kernels.quant_gemm`) give every input of
a token the scale of its largest one, and SmolLM2's hidden states carry a few outlier channels, so most inputs
keep only a few bits; a block of 32 confines an outlier's cost to its own block. Why integer products: prefill is
compute-bound, and one ``vpmaddubsw`` does 32 multiply-adds where a float32 FMA does 8.

Layout (packed once at load): codes ``[ceil(N/16), K/4, 16, 4]`` int8 (per group of 4 inputs, each column's 4
codes adjacent, 64 bytes a group), scales ``[Npad]`` float32. K must be a multiple of 32: :func:`supports` says
so and :func:`pack` refuses other shapes (the planner keeps the other forms for them).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kernels import native, quant_panels
from kernels.quant import QuantizedWeight

PANEL = 16
BLOCK = 32
SOURCES = ("w8a8_gemm.c",)
ISA = {0: "scalar", 1: "avx2", 2: "avx-vnni", 3: "avx512-vnni"}


def build(defines: dict[str, object] | None = None) -> ctypes.CDLL | None:
    """Build (once per machine) and :func:`bind` the library; ``defines`` picks a variant (``INFERQ_NO_AVX2``:
    the scalar path; ``INFERQ_NO_VNNI``: the AVX2 path on a VNNI CPU; ``INFERQ_NO_AVX512``: AVX-VNNI (256-bit) where the CPU has
    it, else AVX2; ``MR_MAX``: rows per tile, 1-8)."""
    lib = native.build("w8a8_gemm", SOURCES, defines)
    return bind(lib) if lib is not None else None


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.w8a8_gemm.argtypes = [p, i64, p, i, p, p, p, i64, i, i, i, i]
    lib.w8a8_gemm.restype = i
    lib.w8a8_quantize.argtypes = [p, i64, i, i, i, p, p]
    lib.w8a8_quantize.restype = None
    lib.w8a8_isa.argtypes = []
    lib.w8a8_isa.restype = i
    return lib


@functools.cache
def _load() -> ctypes.CDLL | None:
    return build()


def available() -> bool:
    """Whether the kernel builds here (any x86 or other CPU with a C compiler: the scalar path is portable, but
    only the vector paths are worth planning; :func:`isa` says which one this build runs)."""
    return _load() is not None


def isa(lib: ctypes.CDLL | None = None) -> str:
    lib = lib or _load()
    return ISA[lib.w8a8_isa()] if lib is not None else "none"


def supports(k: int) -> bool:
    return k > 0 and k % BLOCK == 0


@dataclass(frozen=True)
class Panels:
    """An int8 ``[n, k]`` weight: ``codes`` int8 ``[np, k/4, 16, 4]`` (narrow) or the same codes as int16
    ``[np, k/2, 16, 2]`` (wide), ``scales`` float32 ``[np * 16]``."""

    n: int
    k: int
    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def wide(self) -> bool:
        return self.codes.dtype == torch.int16

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


def default_wide(lib: ctypes.CDLL | None = None) -> bool:
    """Whether :func:`pack` makes int16 panels by default: on AVX2 without VNNI. Measured on Zen 3 (2 cores):
    ``vpsignb``, ``vpmaddubsw`` and ``vpmaddwd`` share the same two vector pipes, so the sign trick's three per
    32 multiply-adds run at most 1.33x float32 FMA, while ``vpmaddwd`` on int16 codes (16 multiply-adds, one
    instruction on those pipes) can reach 2x, at twice the weight's bytes. With VNNI, ``vpdpbusd`` does 32 in
    one: narrow. Results are the same bit for bit either way (exact integer sums)."""
    return isa(lib) == "avx2"


def pack(q: QuantizedWeight, wide: bool | None = None) -> Panels:
    """``q`` (int8) in panels (``wide``: int16 codes; None: :func:`default_wide`); padded output rows are zero
    weights with zero scales."""
    assert q.fmt == "int8", q.fmt
    n, k = q.shape
    if not supports(k):
        raise ValueError(f"w8a8 panels need K a multiple of {BLOCK}, got {k}")
    if wide is None:
        wide = default_wide()
    np_ = -(-n // PANEL)
    g = 2 if wide else 4
    padded = torch.zeros((np_ * PANEL, k), dtype=torch.int16 if wide else torch.int8)
    padded[:n] = q.codes
    codes = padded.view(np_, PANEL, k // g, g).permute(0, 2, 1, 3).contiguous()
    scales = torch.zeros(np_ * PANEL)
    scales[:n] = q.scale
    return Panels(n, k, codes, scales)


def quantize(x: torch.Tensor, lib: ctypes.CDLL | None = None, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own activation codes ``[M, K]`` int8 and block scales ``[M, K/32]`` float32 (tests; ``wide``:
    as the int16 panels read them). The magnitudes the narrow path stores beside the codes are checked too."""
    lib = lib or _load()
    assert lib is not None
    x = x.float().contiguous()
    m, k = x.shape
    assert supports(k)
    scratch = torch.empty((m, 2 * k), dtype=torch.int8)
    d = torch.empty((m, k // BLOCK))
    lib.w8a8_quantize(x.data_ptr(), k, m, k, 1 if wide else 0, scratch.data_ptr(), d.data_ptr())
    if wide:
        return scratch.view(torch.int16).to(torch.int8), d
    q = scratch[:, :k].contiguous()
    if isa(lib) == "avx512-vnni":  # each block's sum of codes (the +128 offset's correction), int32
        sums = scratch[:, k : k + k // BLOCK * 4].contiguous().view(torch.int32)
        assert torch.equal(sums, q.view(m, k // BLOCK, BLOCK).sum(dim=2, dtype=torch.int32))
    else:
        assert torch.equal(scratch[:, k:].view(torch.uint8), q.abs().view(torch.uint8))
    return q, d


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block quantisation in torch, as the kernel does it: ``d = amax / 127`` (float32), ``q = round(x / d)``
    computed as ``x * (1 / d)`` (an all-zero block: d = 0, q = 0)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(dim=2) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(m, k), d


def matmul(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x W^T + b`` as a new float32 ``[M, n]`` tensor, or ``out += x W^T + b`` in place when ``out`` is given
    (float32, dense rows). ``x`` ``[M, k]`` with dense rows (any row stride). ``lib``: a variant (tests)."""
    lib = lib or _load()
    assert lib is not None, "w8a8 GEMM kernel not available"
    x, out, bias, accumulate = quant_panels.operands(x, panels.k, panels.n, bias, out)
    m, k = x.shape
    err = lib.w8a8_gemm(x.data_ptr(), x.stride(0), panels.codes.data_ptr(), 1 if panels.wide else 0,
                        panels.scales.data_ptr(),
                        bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0), m, panels.n,
                        k, 1 if accumulate else 0)
    assert err == 0, f"w8a8 GEMM refused k={k}"
    return out
