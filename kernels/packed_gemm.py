"""``y = x W^T + b`` on CPU with W packed once at load time: AVX2 + FMA or, where built, AVX-512 tiles; float32
or bfloat16 panels with float32 arithmetic, and bfloat16 pair panels for the CPU's bfloat16 dot product.

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
#include <string.h>
#include <immintrin.h>
#include <omp.h>

#define PANEL 16
#define X_BLOCK_BYTES (192 * 1024) /* see gemm_any */

/* y[0:mr, 0:nc] (+)= x[0:mr, :] . panel^T (+ b): one register block. MR is a compile-time constant at each
   call site (always_inline), so the row loops unroll and the accumulators live in registers. */
static inline __attribute__((always_inline)) void block(const int MR, const int BF16, const float* x, int64_t xs,
                                                        const void* wv, int K, float* y, int64_t ys, const float* b,
                                                        int nc, int accumulate, const char* prefetch) {
    __m256 c0[6], c1[6];
    _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
    const int row_bytes = BF16 ? 2 * PANEL : 4 * PANEL;
    for (int k = 0; k < K; k++) {
        if (prefetch && (!BF16 || !(k & 1))) _mm_prefetch(prefetch + (int64_t)k * row_bytes, _MM_HINT_T0);
        __m256 w0, w1;
        if (BF16) { /* bfloat16 -> float32 is a 16-bit shift into the high half */
            const __m128i* wr = (const __m128i*)((const uint16_t*)wv + (int64_t)k * PANEL);
            w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(wr)), 16));
            w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(wr + 1)), 16));
        } else {
            const float* wr = (const float*)wv + (int64_t)k * PANEL;
            w0 = _mm256_loadu_ps(wr);
            w1 = _mm256_loadu_ps(wr + 8);
        }
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

/* One tile of rows against one panel, behind one signature for every kernel: x and y are float32, or bfloat16
   for the pair kernel; K is the reduction length. */
typedef void (*tile_fn)(int mr, const void* x, int64_t xs, const void* w, int K, void* y, int64_t ys,
                        const float* b, int nc, int acc, const char* pf);
/* the row count is a compile-time constant inside each block (always_inline), hence one case per count */
#define TILE_CASE(BLOCK, R, ...) case R: BLOCK(R, __VA_ARGS__); break;
#define TILE_SWITCH6(BLOCK, ...)                                                                              \
    switch (mr) {                                                                                             \
        TILE_CASE(BLOCK, 1, __VA_ARGS__) TILE_CASE(BLOCK, 2, __VA_ARGS__) TILE_CASE(BLOCK, 3, __VA_ARGS__)    \
        TILE_CASE(BLOCK, 4, __VA_ARGS__) TILE_CASE(BLOCK, 5, __VA_ARGS__)                                     \
        default: BLOCK(6, __VA_ARGS__); break;                                                                \
    }
#define TILE_SWITCH12(BLOCK, ...)                                                                             \
    switch (mr) {                                                                                             \
        TILE_CASE(BLOCK, 1, __VA_ARGS__) TILE_CASE(BLOCK, 2, __VA_ARGS__) TILE_CASE(BLOCK, 3, __VA_ARGS__)    \
        TILE_CASE(BLOCK, 4, __VA_ARGS__) TILE_CASE(BLOCK, 5, __VA_ARGS__) TILE_CASE(BLOCK, 6, __VA_ARGS__)    \
        TILE_CASE(BLOCK, 7, __VA_ARGS__) TILE_CASE(BLOCK, 8, __VA_ARGS__) TILE_CASE(BLOCK, 9, __VA_ARGS__)    \
        TILE_CASE(BLOCK, 10, __VA_ARGS__) TILE_CASE(BLOCK, 11, __VA_ARGS__)                                   \
        default: BLOCK(12, __VA_ARGS__); break;                                                               \
    }
#define DEFINE_TILE(NAME, SWITCH, BLOCK, BF16, T)                                                            \
static void NAME(int mr, const void* x, int64_t xs, const void* w, int K, void* y, int64_t ys, const float* b, \
                 int nc, int acc, const char* pf) {                                                           \
    SWITCH(BLOCK, BF16, (const T*)x, xs, w, K, (T*)y, ys, b, nc, acc, pf)                                     \
}

#if defined(__AVX512F__)
/* The AVX-512 form of block(): one 16-column panel row is one zmm register, so a tile holds up to 12 rows in
   12 accumulators (each k: one weight load, 12 broadcast-FMAs), and a partial last panel is a masked store. */
#define TILE_ROWS 12
static inline __attribute__((always_inline)) void block512(const int MR, const int BF16, const float* x, int64_t xs,
                                                           const void* wv, int K, float* y, int64_t ys,
                                                           const float* b, int nc, int accumulate,
                                                           const char* prefetch) {
    __m512 c[TILE_ROWS];
    _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) c[r] = _mm512_setzero_ps();
    const int row_bytes = BF16 ? 2 * PANEL : 4 * PANEL;
    for (int k = 0; k < K; k++) {
        if (prefetch && (!BF16 || !(k & 1))) _mm_prefetch(prefetch + (int64_t)k * row_bytes, _MM_HINT_T0);
        __m512 w;
        if (BF16)
            w = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)wv + (int64_t)k * PANEL))), 16));
        else
            w = _mm512_loadu_ps((const float*)wv + (int64_t)k * PANEL);
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), w, c[r]);
    }
    const __mmask16 m = nc == PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1);
    const __m512 bb = b ? _mm512_maskz_loadu_ps(m, b) : _mm512_setzero_ps();
    _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {
        __m512 v = _mm512_add_ps(c[r], bb);
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, y + r * ys));
        _mm512_mask_storeu_ps(y + r * ys, m, v);
    }
}
DEFINE_TILE(tile512_f32, TILE_SWITCH12, block512, 0, float)
DEFINE_TILE(tile512_bf16, TILE_SWITCH12, block512, 1, float)
#define TILE_F32 tile512_f32
#define TILE_BF16 tile512_bf16
#else
#define TILE_ROWS 6
DEFINE_TILE(tile_f32, TILE_SWITCH6, block, 0, float)
DEFINE_TILE(tile_bf16, TILE_SWITCH6, block, 1, float)
#define TILE_F32 tile_f32
#define TILE_BF16 tile_bf16
#endif

int has_avx512(void) { return TILE_ROWS == 12; }

/* y[M, N] (row stride ys) = or += x[M, K] (row stride xs) . W^T + b, W packed as [ceil(N/16), K, 16] panels of
   w_bytes per element, one tile of at most tile_rows rows at a time. Large M runs in row blocks whose x rows
   (about X_BLOCK_BYTES) stay in L2 while every panel of the thread's share passes over them; without blocks,
   each panel re-read all M rows of x from L3 (for a 2048 x 576 prefill chunk, 4.7 MB per 16 output columns).
   The first tile of each panel prefetches the next panel. */
static void gemm_any(tile_fn tile, int tile_rows, int x_bytes, int y_bytes, int w_bytes, const void* x, int64_t xs,
                     const void* wp, const float* b, void* y, int64_t ys, int M, int N, int K, int accumulate) {
    if (M <= 0 || N <= 0 || K <= 0) return;
    const int np = (N + PANEL - 1) / PANEL;
    const int64_t panel_bytes = (int64_t)K * PANEL * w_bytes;
    int mb = (int)(X_BLOCK_BYTES / ((int64_t)K * x_bytes)) / tile_rows * tile_rows;
    if (mb < 4 * tile_rows) mb = 4 * tile_rows;
    if (M <= 2 * mb) mb = M;
    #pragma omp parallel
    for (int r0 = 0; r0 < M; r0 += mb) {
        const int rows = M - r0 < mb ? M - r0 : mb;
        const int tiles = (rows + tile_rows - 1) / tile_rows; /* near-equal tiles: 8 -> 4 + 4 with AVX2's 6 */
        /* static and nowait: a thread keeps the same panels in every block, and blocks need no barrier */
        #pragma omp for schedule(static) nowait
        for (int p = 0; p < np; p++) {
            const char* w = (const char*)wp + (int64_t)p * panel_bytes;
            const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
            int m0 = r0;
            for (int t = 0; t < tiles; t++) {
                const int mr = (r0 + rows - m0) / (tiles - t) + (((r0 + rows - m0) % (tiles - t)) ? 1 : 0);
                const char* next = (t == 0 && p + 1 < np) ? w + panel_bytes : 0;
                tile(mr, (const char*)x + (int64_t)m0 * xs * x_bytes, xs, w, K,
                     (char*)y + ((int64_t)m0 * ys + n0) * y_bytes, ys, b ? b + n0 : 0, nc, accumulate, next);
                m0 += mr;
            }
        }
    }
}

/* float32 panels (gemm) or bfloat16 ones widened as they are loaded (gemm_bf16); x, y, b and the sums float32 */
int gemm(const float* x, int64_t xs, const float* wp, const float* b, float* y, int64_t ys, int M, int N, int K,
         int accumulate) {
    gemm_any(TILE_F32, TILE_ROWS, 4, 4, 4, x, xs, wp, b, y, ys, M, N, K, accumulate);
    return 0;
}

int gemm_bf16(const float* x, int64_t xs, const uint16_t* wp, const float* b, float* y, int64_t ys, int M, int N,
              int K, int accumulate) {
    gemm_any(TILE_BF16, TILE_ROWS, 4, 4, 2, x, xs, wp, b, y, ys, M, N, K, accumulate);
    return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bfloat16 x bfloat16 -> float32 sums with vdpbf16ps (AVX512-BF16): twice the multiply-adds per instruction of a
   float32 FMA. The weight is packed in k pairs, [ceil(N/16), K/2, 16, 2] (one zmm per pair row: column i's
   W[i][2kp], W[i][2kp+1] adjacent), x is bfloat16 with rows of even length K, and each (x[2kp], x[2kp+1]) pair
   is broadcast as one 32-bit lane. y is bfloat16 (rounded to nearest even), written or accumulated. */
static inline __attribute__((always_inline)) void blockdp(const int MR, const int BF16, const uint16_t* x,
                                                          int64_t xs, const void* wv, int K, uint16_t* y,
                                                          int64_t ys, const float* b, int nc, int accumulate,
                                                          const char* prefetch) {
    (void)BF16;
    const uint16_t* w = (const uint16_t*)wv;
    const int K2 = K / 2;
    __m512 c[12];
    _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) c[r] = _mm512_setzero_ps();
    for (int kp = 0; kp < K2; kp++) {
        if (prefetch) _mm_prefetch(prefetch + (int64_t)kp * 64, _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(w + (int64_t)kp * 32));
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + r * xs + 2 * kp, 4);
            c[r] = _mm512_dpbf16_ps(c[r], (__m512bh)_mm512_set1_epi32(pair), wv);
        }
    }
    const __mmask16 m = nc == PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1);
    const __m512 bb = b ? _mm512_maskz_loadu_ps(m, b) : _mm512_setzero_ps();
    _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {
        __m512 v = _mm512_add_ps(c[r], bb);
        uint16_t* yr = y + r * ys;
        if (accumulate)
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, yr)), 16)));
        _mm256_mask_storeu_epi16(yr, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
}
DEFINE_TILE(tile_dp, TILE_SWITCH12, blockdp, 0, uint16_t)
int has_bf16_dot(void) { return 1; }
/* bfloat16 x, y and pair-packed panels [ceil(N/16), K/2, 16, 2]; K must be even */
int gemm_bf16_dot(const uint16_t* x, int64_t xs, const uint16_t* wp, const float* b, uint16_t* y, int64_t ys,
                  int M, int N, int K, int accumulate) {
    if (K & 1) return 1;
    gemm_any(tile_dp, 12, 2, 2, 2, x, xs, wp, b, y, ys, M, N, K, accumulate);
    return 0;
}
#else
int has_bf16_dot(void) { return 0; }
int gemm_bf16_dot(void) { return 1; }
#endif

"""

@functools.cache
def _load() -> ctypes.CDLL | None:
    flags = native.cpu_flags().split()
    if "avx2" not in flags or "fma" not in flags:
        return None
    lib = native.build("packed_gemm", _SOURCE)
    return bind(lib) if lib is not None else None


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's C signatures (also for benchmark builds of variants of this source)."""
    lib.has_avx512.restype = ctypes.c_int
    lib.has_bf16_dot.restype = ctypes.c_int
    for fn in (lib.gemm, lib.gemm_bf16, lib.gemm_bf16_dot):  # (x, xs, w, b, y, ys, M, N, K, accumulate)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel runs here (x86 CPU with AVX2 + FMA and a C compiler)."""
    return _load() is not None


DTYPES = (torch.float32, torch.bfloat16)


def pack(weight_oi: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` float32 or bfloat16 weight -> panels ``[ceil(out/16), in, 16]`` of the same dtype
    (zero-padded past ``out``)."""
    n, k = weight_oi.shape
    assert weight_oi.dtype in DTYPES, weight_oi.dtype
    np_ = -(-n // PANEL)
    padded = torch.zeros(np_ * PANEL, k, dtype=weight_oi.dtype)
    padded[:n] = weight_oi
    return padded.view(np_, PANEL, k).transpose(1, 2).contiguous()


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


def pack_pairs(weight_oi: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` weight (``in`` even) -> bfloat16 panels in k pairs ``[ceil(out/16), in/2, 16, 2]`` for
    :func:`matmul_pairs` (zero-padded past ``out``)."""
    n, k = weight_oi.shape
    assert k % 2 == 0, "the pair layout needs an even input size"
    np_ = -(-n // PANEL)
    padded = torch.zeros(np_ * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight_oi
    return padded.view(np_, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


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
