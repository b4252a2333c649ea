"""``y = x W^T + b`` on CPU with W packed once at load time into panels ``[ceil(N/16), K, 16]``: AVX2 + FMA or,
where built, AVX-512 tiles; float32 or bfloat16 panels with float32 arithmetic, and bfloat16 pair panels for
the CPU's bfloat16 dot product (AVX512-BF16).

Why: at decode sizes (a few rows) the BLAS repacks the whole weight on every call, which costs as much as the
product; stored once in the panel layout, a product streams the weight front to back exactly once. Source:
``csrc/packed_gemm.c``, built by :mod:`kernels.native`. Which of this and the BLAS forms is faster for a given
shape and M is measured at load by :mod:`kernels.cpu_gemm`, not assumed.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import hugepages, native

PANEL = 16

SOURCES = ("packed_gemm.c",)


def build(defines: dict[str, object] | None = None) -> ctypes.CDLL | None:
    """Build (once per machine) and :func:`bind` the library; ``defines`` picks a variant (see
    :mod:`kernels.native`, e.g. ``{"INFERQ_NO_AVX512": 1}`` for the AVX2 tiles). None where it cannot be built."""
    lib = native.build("packed_gemm", SOURCES, defines)
    return bind(lib) if lib is not None else None


@functools.cache
def _load() -> ctypes.CDLL | None:
    return build() if native.has_avx2_fma() else None


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's C signatures."""
    lib.gemm_has_avx512.restype = ctypes.c_int
    lib.has_bf16_dot.restype = ctypes.c_int
    for fn in (lib.gemm, lib.gemm_bf16, lib.gemm_bf16_dot):  # (x, xs, w, b, y, ys, M, N, K, accumulate)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    from kernels import stream_prefetch  # its measurement runs this library's products

    stream_prefetch.register(lib)
    return lib


def available() -> bool:
    """Whether the kernel runs here (x86 CPU with AVX2 + FMA and a C compiler)."""
    return _load() is not None


DTYPES = (torch.float32, torch.bfloat16)
# Kept packs of at least this many bytes go to the arena: every projection of a 135M model (a threshold of 1 MB
# had left its 663 KB bfloat16 o projection in 4 KiB pages, streaming at 0.6x the others; the step 1.01-1.04x).
# Smaller ones (tests' tiny models) are ordinary tensors.
ARENA_MIN_BYTES = 64 << 10
_arena = hugepages.Arena()  # the model's packed weights, in huge pages (kernels/hugepages.py says why)


def _panels(shape: tuple[int, ...], dtype: torch.dtype, huge: bool) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return _arena.empty(shape, dtype) if huge and nbytes >= ARENA_MIN_BYTES else torch.empty(shape, dtype=dtype)


def pack(weight_oi: torch.Tensor, huge: bool = False) -> torch.Tensor:
    """``[out, in]`` float32 or bfloat16 weight -> panels ``[ceil(out/16), in, 16]`` of the same dtype
    (zero-padded past ``out``). ``huge``: in the huge-page arena (a weight kept for the model's life; never
    for a throw-away copy, whose arena space would not come back)."""
    n, k = weight_oi.shape
    assert weight_oi.dtype in DTYPES, weight_oi.dtype
    np_ = -(-n // PANEL)
    padded = torch.zeros(np_ * PANEL, k, dtype=weight_oi.dtype)
    padded[:n] = weight_oi
    return _panels((np_, k, PANEL), weight_oi.dtype, huge).copy_(padded.view(np_, PANEL, k).transpose(1, 2))


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` as a new ``[M, n]`` tensor, or ``out += x W^T + b`` in place when ``out`` is given
    (``out`` rows dense). ``x`` float32 ``[M, in]`` with dense rows (any row stride); the panels float32 or
    bfloat16 (then widened as they are read: bfloat16 storage, float32 arithmetic and result)."""
    lib = _load()
    assert lib is not None, "packed GEMM kernel not available"
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    assert packed.shape[1] == k and x.dtype == torch.float32
    accumulate = out is not None
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32)
    assert out.stride(-1) == 1 and out.shape == (m, n)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    fn = lib.gemm if packed.dtype == torch.float32 else lib.gemm_bf16
    fn(x.data_ptr(), x.stride(0), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
       out.data_ptr(), out.stride(0), m, n, k, 1 if accumulate else 0)
    return out


def has_bf16_dot() -> bool:
    """Whether the bfloat16 dot-product kernel runs here (AVX512-BF16)."""
    lib = _load()
    return lib is not None and bool(lib.has_bf16_dot())


def pack_pairs(weight_oi: torch.Tensor, huge: bool = False) -> torch.Tensor:
    """``[out, in]`` weight (``in`` even) -> bfloat16 panels in k pairs ``[ceil(out/16), in/2, 16, 2]`` for
    :func:`matmul_pairs` (zero-padded past ``out``); ``huge`` as for :func:`pack`."""
    n, k = weight_oi.shape
    assert k % 2 == 0, "the pair layout needs an even input size"
    np_ = -(-n // PANEL)
    padded = torch.zeros(np_ * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight_oi
    return _panels((np_, k // 2, PANEL, 2), torch.bfloat16, huge).copy_(padded.view(np_, PANEL, k // 2, 2).permute(0, 2, 1, 3))


def unpack_pairs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[n, in]`` weight back from :func:`pack_pairs` panels."""
    np_, k2 = packed.shape[0], packed.shape[1]
    return packed.permute(0, 2, 1, 3).reshape(np_ * PANEL, 2 * k2)[:n]


def matmul_pairs(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16 ``x W^T + b`` (float32 sums, rounded once) as a new ``[M, n]`` bfloat16 tensor, or
    ``out += x W^T + b`` in place into bfloat16 ``out``; W as :func:`pack_pairs` panels."""
    lib = _load()
    assert lib is not None and lib.has_bf16_dot(), "bfloat16 dot-product kernel not available"
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    assert packed.shape[1] * 2 == k and packed.dtype == torch.bfloat16
    accumulate = out is not None
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16)
    assert out.stride(-1) == 1 and out.shape == (m, n) and out.dtype == torch.bfloat16
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    err = lib.gemm_bf16_dot(x.data_ptr(), x.stride(0), packed.data_ptr(),
                            bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0), m, n, k,
                            1 if accumulate else 0)
    assert err == 0
    return out
