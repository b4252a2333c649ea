"""``y = x W^T + b`` for small batches on CPU, with W packed once at load time (AVX2 + FMA, float32).

Why: a decode step multiplies a few rows (M = number of running sequences) by every weight matrix once.
There the BLAS (MKL in the torch CPU wheel) is far from the memory bound: each call packs the weight into
its own panel layout first, a full extra read and write of the weight. Measured on an AVX2 AMD EPYC, the
tied LM head (49152 x 576) at M = 8 ran at 10-30 GFLOP/s, i.e. 113 MB read at 3-7 GB/s, against ~20 GB/s
the machine streams. Here the weight is stored once in that panel layout: ``[ceil(N/16), K, 16]`` (16 output
columns per panel, each k's 16 weights adjacent), so a product streams it front to back exactly once.

The micro-kernel holds an ``mr x 16`` block of the output in registers (mr <= 6: 12 accumulators), and for
each k loads the panel's 16 weights once and broadcasts each of the mr inputs (the BLIS-style 6x16 shape:
2 FMA ports kept busy on 8 loads per 12 FMAs). Rows are split into near-equal tiles of at most 6 (M = 8 runs
as 4 + 4, not 6 + 2); the panel, K x 64 bytes, stays in L1/L2 while its tiles run. The first tile of a panel
also prefetches the next panel, one 64-byte line per k, so the DRAM read of the weight overlaps the FMAs
instead of stalling the next panel's first tile: measured 1.4-1.45x at M = 8-16 and 1.15x at M = 64 (a 30-layer
set of this model's shapes, weights cold), nothing lost at M = 1 or 256. Panels are shared out
over torch's OpenMP threads. Which of this and the BLAS forms is faster for a given shape and M is measured
at load by :mod:`kernels.cpu_gemm`, not assumed.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import native

PANEL = 16

_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>
#include <omp.h>

#define PANEL 16

/* y[0:mr, 0:nc] (+)= x[0:mr, :] . panel^T (+ b): one register block. MR is a compile-time constant at each
   call site (always_inline), so the row loops unroll and the accumulators live in registers. */
static inline __attribute__((always_inline)) void block(const int MR, const float* x, int64_t xs, const float* w,
                                                        int K, float* y, int64_t ys, const float* b, int nc,
                                                        int accumulate, const float* prefetch) {
    __m256 c0[6], c1[6];
    _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
    for (int k = 0; k < K; k++) {
        if (prefetch) _mm_prefetch((const char*)(prefetch + (int64_t)k * PANEL), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(w + (int64_t)k * PANEL), w1 = _mm256_loadu_ps(w + (int64_t)k * PANEL + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
            c0[r] = _mm256_fmadd_ps(xb, w0, c0[r]);
            c1[r] = _mm256_fmadd_ps(xb, w1, c1[r]);
        }
    }
    if (b) {
        float bb[PANEL] = {0};
        for (int j = 0; j < nc; j++) bb[j] = b[j];
        const __m256 b0 = _mm256_loadu_ps(bb), b1 = _mm256_loadu_ps(bb + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) { c0[r] = _mm256_add_ps(c0[r], b0); c1[r] = _mm256_add_ps(c1[r], b1); }
    }
    if (nc == PANEL) {
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            float* yr = y + r * ys;
            if (accumulate) {
                c0[r] = _mm256_add_ps(c0[r], _mm256_loadu_ps(yr));
                c1[r] = _mm256_add_ps(c1[r], _mm256_loadu_ps(yr + 8));
            }
            _mm256_storeu_ps(yr, c0[r]);
            _mm256_storeu_ps(yr + 8, c1[r]);
        }
    } else { /* the last panel of an N that is not a multiple of 16 */
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            float t[PANEL];
            _mm256_storeu_ps(t, c0[r]);
            _mm256_storeu_ps(t + 8, c1[r]);
            float* yr = y + r * ys;
            for (int j = 0; j < nc; j++) yr[j] = accumulate ? yr[j] + t[j] : t[j];
        }
    }
}

static void rows(int mr, const float* x, int64_t xs, const float* w, int K, float* y, int64_t ys, const float* b,
                 int nc, int acc, const float* pf) {
    switch (mr) {
        case 1: block(1, x, xs, w, K, y, ys, b, nc, acc, pf); break;
        case 2: block(2, x, xs, w, K, y, ys, b, nc, acc, pf); break;
        case 3: block(3, x, xs, w, K, y, ys, b, nc, acc, pf); break;
        case 4: block(4, x, xs, w, K, y, ys, b, nc, acc, pf); break;
        case 5: block(5, x, xs, w, K, y, ys, b, nc, acc, pf); break;
        default: block(6, x, xs, w, K, y, ys, b, nc, acc, pf); break;
    }
}

/* y[M, N] (row stride ys) = or += x[M, K] (row stride xs) . W^T + b, W packed as [ceil(N/16), K, 16]. */
int gemm(const float* x, int64_t xs, const float* wp, const float* b, float* y, int64_t ys, int M, int N, int K,
         int accumulate) {
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    const int np = (N + PANEL - 1) / PANEL;
    const int tiles = (M + 5) / 6; /* near-equal tiles of at most 6 rows: 8 -> 4 + 4 */
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < np; p++) {
        const float* w = wp + (int64_t)p * K * PANEL;
        const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
        int m0 = 0;
        for (int t = 0; t < tiles; t++) {
            const int mr = (M - m0) / (tiles - t) + (((M - m0) % (tiles - t)) ? 1 : 0);
            const float* next = (t == 0 && p + 1 < np) ? w + (int64_t)K * PANEL : 0; /* one line per k */
            rows(mr, x + (int64_t)m0 * xs, xs, w, K, y + (int64_t)m0 * ys + n0, ys, b ? b + n0 : 0, nc, accumulate,
                 next);
            m0 += mr;
        }
    }
    return 0;
}
"""

@functools.cache
def _load() -> ctypes.CDLL | None:
    flags = native.cpu_flags().split()
    if "avx2" not in flags or "fma" not in flags:
        return None
    lib = native.build("packed_gemm", _SOURCE)
    if lib is not None:
        lib.gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.gemm.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel runs here (x86 CPU with AVX2 + FMA and a C compiler)."""
    return _load() is not None


def pack(weight_oi: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` float32 weight -> panels ``[ceil(out/16), in, 16]`` (zero-padded past ``out``)."""
    n, k = weight_oi.shape
    np_ = -(-n // PANEL)
    padded = torch.zeros(np_ * PANEL, k, dtype=torch.float32)
    padded[:n] = weight_oi
    return padded.view(np_, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` as a new ``[M, n]`` tensor, or ``out += x W^T + b`` in place when ``out`` is given
    (``out`` rows dense). ``x`` float32 ``[M, in]`` with dense rows (any row stride)."""
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
    lib.gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
             out.data_ptr(), out.stride(0), m, n, k, 1 if accumulate else 0)
    return out
