"""Small CPU ops of the model's forward in one C call each: RMSNorm (``csrc/rms_norm.c``), RoPE
(``csrc/rope.c``: interleaved pairs in float32, rotate-half in bfloat16) and SwiGLU (``csrc/activation.c``),
on float32 or bfloat16 rows (float32 arithmetic, one rounding per bfloat16 result), and the sampler's row-wise
argmax of float32 logits (``csrc/argmax.c``) and its race noise (``csrc/race_noise.c``), one library built by
:mod:`kernels.native`.

Why: at decode sizes each of these is a chain of small torch ops (RMSNorm ~10-30 us a call, 61 calls in a step
of a 30-layer model; RoPE and SwiGLU four or five ops a layer): together about 1.5 ms of a ~22 ms
one-sequence step of SmolLM2-135M, where one C call takes a few microseconds. Where the library cannot be
built, :func:`load` returns None and the model keeps its torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import native

SOURCES = ("rms_norm.c", "rope.c", "activation.c", "argmax.c", "race_noise.c")
LEVELS = {2: "avx512", 1: "avx2", 0: "scalar"}
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def build(defines: dict[str, object] | None = None) -> ctypes.CDLL | None:
    """Build (once per machine) and bind the library; ``defines`` picks a variant (:mod:`kernels.native`:
    ``{"INFERQ_NO_AVX512": 1}`` the AVX2 build, ``{"INFERQ_NO_AVX2": 1}`` the portable one)."""
    lib = native.build("cpu_norm", SOURCES, defines)
    if lib is None:
        return None
    for name in ("rms_norm_f32", "rms_norm_bf16"):
        getattr(lib, name).argtypes = [_P, _I64, _P, _P, _I64, _I, _I, ctypes.c_float]
    lib.rope_interleaved_f32.argtypes = [_P, _I64, _P, _I64, _I, _I, _I]
    lib.rope_half_bf16.argtypes = [_P, _I64, _P, _P, _I64, _I, _I, _I]
    for name in ("silu_mul_f32", "silu_mul_bf16"):
        getattr(lib, name).argtypes = [_P, _I64, _I, _I]
    for name in ("rms_norm_f32", "rms_norm_bf16", "rope_interleaved_f32", "rope_half_bf16", "silu_mul_f32",
                 "silu_mul_bf16"):
        getattr(lib, name).restype = None
    lib.argmax_rows_f32.argtypes = [_P, _I64, _I, _I, _P]
    lib.argmax_rows_f32.restype = None
    lib.race_log_noise.argtypes = [_P, _I, _I, _P, _I64]
    lib.race_log_noise.restype = None
    lib.vector_width_level.restype = ctypes.c_int
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    return build()


def path(lib: ctypes.CDLL | None = None) -> str | None:
    """Which vector path a library runs ("avx512", "avx2", "scalar"); None without one."""
    lib = lib or load()
    return None if lib is None else LEVELS[lib.vector_width_level()]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` as a new contiguous tensor: x float32 or bfloat16 ``[T, H]``
    with unit stride along H, weight a dense ``[H]`` of the same dtype."""
    lib = lib or load()
    t, h = x.shape
    y = torch.empty((t, h), dtype=x.dtype)
    fn = lib.rms_norm_f32 if x.dtype == torch.float32 else lib.rms_norm_bf16
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), h, t, h, eps)
    return y


def rope_interleaved_(x: torch.Tensor, heads: int, rot: torch.Tensor, lib: ctypes.CDLL | None = None) -> None:
    """Rotate the first ``heads`` heads of each float32 row of ``x`` (``[T, >= heads * D]``, unit stride along
    the row) in place; pairs are interleaved, ``rot`` is float32 ``[T, D/2, 2]`` (cos, sin), dense rows."""
    lib = lib or load()
    t, half = rot.shape[0], rot.shape[1]
    lib.rope_interleaved_f32(x.data_ptr(), x.stride(0), rot.data_ptr(), rot.stride(0), t, heads, half)


def rope_half_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor,
               lib: ctypes.CDLL | None = None) -> None:
    """Rotate-half RoPE in place on the first ``heads`` heads of each bfloat16 row of ``x`` (``[T, >= heads *
    D]``, unit stride along the row); ``cos`` and ``sin`` bfloat16 ``[T, D/2]`` with the same dense rows."""
    lib = lib or load()
    t, half = cos.shape
    assert sin.stride() == cos.stride() and cos.stride(-1) == 1
    lib.rope_half_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), t, heads, half)


def silu_mul_(gate_up: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """SwiGLU in place on float32 or bfloat16 rows ``[T, 2 * inter]`` (unit stride along the row): the first
    half of each row becomes ``silu(gate) * up``; returns that half (a strided view)."""
    lib = lib or load()
    t, two_inter = gate_up.shape
    fn = lib.silu_mul_f32 if gate_up.dtype == torch.float32 else lib.silu_mul_bf16
    fn(gate_up.data_ptr(), gate_up.stride(0), t, two_inter // 2)
    return gate_up[:, : two_inter // 2]


def argmax_rows(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """int64 ``[R]``: each row's ``torch.argmax`` (the first of equal maxima; a row's first NaN where it has one)
    of float32 ``x`` ``[R, V]`` (V >= 1, unit stride along the row)."""
    lib = lib or load()
    r, v = x.shape
    out = torch.empty(r, dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), x.stride(0), r, v, out.data_ptr())
    return out


def race_log_noise(keys: list[int], vocab: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """float32 ``[len(keys), vocab]``: row r holds log E for E ~ Exp(1), column i a function of (keys[r], i) only
    (64-bit keys; csrc/race_noise.c says how), the same bits on every vector path."""
    lib = lib or load()
    out = torch.empty((len(keys), vocab), dtype=torch.float32)
    if keys:
        ks = (ctypes.c_uint64 * len(keys))(*keys)
        lib.race_log_noise(ctypes.cast(ks, _P), len(keys), vocab, out.data_ptr(), out.stride(0))
    return out


def race_log_noise_reference(keys: list[int], vocab: int) -> torch.Tensor:
    """:func:`race_log_noise` in numpy, from the same 32 bits per column with float64 logs (within an ulp or
    two of the C values): where the library cannot be built, and the tests' reference."""
    import numpy as np

    m32, m64 = (1 << 32) - 1, (1 << 64) - 1

    def mix32(x):
        x = x ^ (x >> 16)
        x = (x * 0x21F0AAAD) & m32
        x = x ^ (x >> 15)
        x = (x * 0x735A2D97) & m32
        return x ^ (x >> 15)

    out = np.empty((len(keys), vocab), dtype=np.float32)
    cols = np.arange(vocab, dtype=np.uint64)
    for r, key in enumerate(keys):
        z = (key + 0x9E3779B97F4A7C15) & m64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        z ^= z >> 31
        x = mix32(mix32((cols + np.uint64(z & m32)) & np.uint64(m32)) ^ np.uint64(z >> 32))
        u = (x.astype(np.float64) + 0.5) / 2.0**32
        out[r] = np.log(-np.log(u))
    return torch.from_numpy(out)
