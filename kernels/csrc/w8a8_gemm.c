/* y (+)= x W^T + b with W int8 (per-output-channel symmetric, kernels/quant.py) and x quantised here, on the fly,
   to int8 in blocks of 32 inputs along K, each block with its own float32 scale (llama.cpp's Q8_0 activations):
   an outlier channel only coarsens its own block of 32, not the whole token as per-token scales do.

     x block b of row r:  d = amax / 127, q = round(x * (1 / d)) in [-127, 127] (all-zero block: d = 0, q = 0)
     y[r, n] = wscale[n] * sum_b d_rb * sum_{k in b} q_rk w_nk          (the inner sum exact in int32)

   Weight panels, packed once at load (kernels/w8a8_panels.py): codes [ceil(N/16), K/4, 16, 4] int8: for each group
   of 4 inputs, the 16 columns' 4 codes adjacent, so one 64-byte row of the panel is two ymm registers (columns
   0-7, 8-15), each 32-bit lane one column's 4 codes, and a row's 4 activation codes broadcast to every lane make
   the matching operand. Per-channel scales [Npad] float32, applied once at the end of a tile.

   Integer dot products (AVX2): _mm256_maddubs_epi16 multiplies unsigned by signed bytes, so the sign trick:
   |q| (unsigned) times sign(q) * w (_mm256_sign_epi8); both in [-127, 127], so a pair sum is at most 2 * 127 * 127
   = 32,258 and never saturates int16; _mm256_madd_epi16 with ones sums the pairs into int32 (4 products per
   column lane). Per 32-block the int32 sums are converted once and fused-multiply-added with the row's block
   scale. With AVX-VNNI, vpdpbusd does the multiply and both sums in one instruction (still after the sign
   trick). |q| is stored beside q by the quantisation pass, so both operands of a row are one broadcast load each.

   AVX512-VNNI (512-bit): a panel row of 64 bytes is one zmm, and the sign trick goes: the weight codes are
   offset to unsigned, w + 128 (one xor per loaded register, shared by every row of the tile), and multiplied
   by the signed activation codes, so sum (w + 128) q = sum w q + 128 sum q; the quantisation pass stores each
   block's sum q beside the codes (where the narrow path keeps |q|) and the tile subtracts 128 sum q once per
   block: still exact in int32, one vpdpbusd per row per 64 codes (int16 panels: vpdpwssd). The ISA macros come
   from the compiler under -march=native; INFERQ_NO_AVX512 builds the AVX-VNNI path on such a CPU and
   INFERQ_NO_VNNI the AVX2 one (tests force each).

   Tiles of up to MR_MAX rows x 16 columns: each loaded weight register is used by every row of the tile (prefill
   is compute-bound; that reuse and 4x as many multiply-adds per instruction as float32 FMA are the gain). Rows in
   row blocks whose codes stay in L2, panels shared out over OpenMP threads (static), the quantisation of x done
   first by the same team (rows shared out, one barrier). The scalar fallback (INFERQ_NO_AVX2, or a CPU without
   AVX2) runs the same arithmetic in the same order: its results equal the vector paths' bit for bit.

   K must be a multiple of 32 (w8a8_gemm returns 1 otherwise: the caller pads K with zero columns or keeps
   another form). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PANEL 16
#define QB 32
#define X_BLOCK_BYTES (128 * 1024) /* activation codes (q and |q|) per row block: L2 resident */

#if INFERQ_HAVE_AVX512 && !defined(INFERQ_NO_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W8A8_ISA 3 /* AVX512-VNNI on 512-bit vectors, the +128 offset */
#elif INFERQ_HAVE_AVX2 && !defined(INFERQ_NO_VNNI) && defined(__AVXVNNI__)
#define W8A8_ISA 2 /* AVX-VNNI on 256-bit vectors, the sign trick */
#elif INFERQ_HAVE_AVX2
#define W8A8_ISA 1 /* AVX2 sign trick */
#else
#define W8A8_ISA 0 /* scalar */
#endif

/* rows per tile: a 512-bit tile keeps 2 registers per row (int32 sums, float sums) of 32 */
#ifndef MR_MAX
#if W8A8_ISA == 3
#define MR_MAX 8
#else
#define MR_MAX 6
#endif
#endif

/* Which path this build runs: 0 scalar, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI. */
int w8a8_isa(void) { return W8A8_ISA; }

/* ---- quantisation of x: one pass per row ---- */

/* The block's scale and its reciprocal, as the torch reference computes them (float32, 1 / d, not 127 / amax). */
static inline void block_scale(float amax, float* d, float* id) {
    *d = amax / 127.f;
    *id = *d > 0.f ? 1.f / *d : 0.f;
}

/* Row r of the activation scratch is 2K bytes: narrow (int8 panels): its K codes, then their K magnitudes;
   wide (int16 panels): its K codes as int16. q is written to `row`; the caller passes the row's block scales. */
#if W8A8_ISA
static void quant_row(const float* x, int K, int wide, char* row, float* d) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lo16 = _mm256_set1_epi16(-127), perm16 = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int b = 0; b < K / QB; b++) {
        const float* xb = x + b * QB;
        if (!wide) {
            const __m256i p = quant_block32(xb, d + b);
            _mm256_storeu_si256((__m256i*)(row + b * QB), p);
#if W8A8_ISA == 3
            /* the block's sum of codes (for the +128 offset), as int32 where |q| would go */
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), p);
            const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
            const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
            const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xb1)));
            memcpy(row + K + b * 4, &sum, 4);
#else
            _mm256_storeu_si256((__m256i*)(row + K + b * QB), _mm256_abs_epi8(p));
#endif
            continue;
        }
        const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                       _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
        float dd, id;
        block_scale(_mm256_cvtss_f32(hmax8(m)), &dd, &id);
        d[b] = dd;
        const __m256 s = _mm256_set1_ps(id);
        /* cvtps rounds to nearest even (the default MXCSR mode), as torch.round and nearbyintf do */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, s));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, s));
        const __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        int16_t* q = (int16_t*)row + b * QB;
        _mm256_storeu_si256((__m256i*)q, _mm256_max_epi16(_mm256_permutevar8x32_epi32(p01, perm16), lo16));
        _mm256_storeu_si256((__m256i*)(q + 16), _mm256_max_epi16(_mm256_permutevar8x32_epi32(p23, perm16), lo16));
    }
}
#else
static void quant_row(const float* x, int K, int wide, char* row, float* d) {
    for (int b = 0; b < K / QB; b++) {
        float amax = 0.f;
        for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(x[b * QB + i]));
        float dd, id;
        block_scale(amax, &dd, &id);
        d[b] = dd;
        for (int i = 0; i < QB; i++) {
            float v = nearbyintf(x[b * QB + i] * id);
            v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
            if (wide) {
                ((int16_t*)row)[b * QB + i] = (int16_t)v;
            } else {
                row[b * QB + i] = (char)(int8_t)v;
                row[K + b * QB + i] = (char)(uint8_t)(v < 0 ? -v : v);
            }
        }
    }
}
#endif

/* ---- the tiles ---- */

#if W8A8_ISA
/* narrow: acc + the 4-product sums of |q| (unsigned, broadcast) and sign(q) w (signed), per int32 lane */
ALWAYS_INLINE __m256i dot4(__m256i acc, __m256i xa, __m256i sw) {
#if W8A8_ISA == 2
    return _mm256_dpbusd_avx_epi32(acc, xa, sw);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, sw), _mm256_set1_epi16(1)));
#endif
}

ALWAYS_INLINE int32_t load_i32(const void* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* One MR x 16 tile over nb blocks. xc: the MR rows' activation scratch (row stride xs bytes, see quant_row), xd
   their block scales (row stride nb), w the panel (narrow: int8 [K/4, 16, 4]; wide: int16 [K/2, 16, 2]), ws its
   16 channel scales. prefetch: the next panel, one line per 64 bytes of codes. */
ALWAYS_INLINE void tile(const int MR, const int WIDE, const char* xc, int64_t xs, const float* xd, int nb, int K,
                        const char* w, const float* ws, float* y, int64_t ys, const float* b, int nc, int accumulate,
                        const char* prefetch) {
    __m256 f[MR_MAX][2];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    const int64_t block_bytes = (int64_t)QB * PANEL * (WIDE ? 2 : 1);
    for (int kb = 0; kb < nb; kb++) {
        __m256i s[MR_MAX][2];
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        const char* wb = w + kb * block_bytes;
        if (WIDE) {
            /* 16 steps of 2 inputs: per column lane, vpmaddwd's pair sum of int16 codes (exact, no sign trick) */
            _Pragma("GCC unroll 16") for (int g = 0; g < QB / 2; g++) {
                if (prefetch) _mm_prefetch(prefetch + kb * block_bytes + g * 64, _MM_HINT_T0);
                const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wb + g * 64));
                const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wb + g * 64 + 32));
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {
                    const __m256i vq = _mm256_set1_epi32(load_i32(xc + r * xs + ((int64_t)kb * QB + g * 2) * 2));
                    s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(w0, vq));
                    s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(w1, vq));
                }
            }
        } else {
            _Pragma("GCC unroll 8") for (int g = 0; g < QB / 4; g++) {
                if (prefetch) _mm_prefetch(prefetch + kb * block_bytes + g * 64, _MM_HINT_T0);
                const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wb + g * 64));
                const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wb + g * 64 + 32));
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {
                    const int64_t o = r * xs + (int64_t)kb * QB + g * 4;
                    const __m256i vq = _mm256_set1_epi32(load_i32(xc + o));
                    const __m256i va = _mm256_set1_epi32(load_i32(xc + K + o));
                    s[r][0] = dot4(s[r][0], va, _mm256_sign_epi8(w0, vq));
                    s[r][1] = dot4(s[r][1], va, _mm256_sign_epi8(w1, vq));
                }
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {
            const __m256 dv = _mm256_broadcast_ss(xd + r * nb + kb);
            f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), dv, f[r][0]);
            f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), dv, f[r][1]);
        }
    }
    const __m256 s0 = _mm256_loadu_ps(ws), s1 = _mm256_loadu_ps(ws + 8);
    float bb[PANEL] = {0};
    if (b)
        for (int j = 0; j < nc; j++) bb[j] = b[j];
    const __m256 b0 = _mm256_loadu_ps(bb), b1 = _mm256_loadu_ps(bb + 8);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) {
        /* fma(sum, wscale, bias), then + y: the scalar path's order (explicit fmas: no contraction differences) */
        __m256 c0 = _mm256_fmadd_ps(f[r][0], s0, b0), c1 = _mm256_fmadd_ps(f[r][1], s1, b1);
        float* yr = y + r * ys;
        if (nc == PANEL) {
            if (accumulate) {
                c0 = _mm256_add_ps(_mm256_loadu_ps(yr), c0);
                c1 = _mm256_add_ps(_mm256_loadu_ps(yr + 8), c1);
            }
            _mm256_storeu_ps(yr, c0);
            _mm256_storeu_ps(yr + 8, c1);
        } else {
            float t[PANEL];
            _mm256_storeu_ps(t, c0);
            _mm256_storeu_ps(t + 8, c1);
            for (int j = 0; j < nc; j++) yr[j] = accumulate ? yr[j] + t[j] : t[j];
        }
    }
}

#if W8A8_ISA == 3
/* One MR x 16 tile on 512-bit vectors (arguments as tile's): per block, narrow: sum (w + 128) q by vpdpbusd, less
   128 sum q (the quantisation pass's block sums, 4 bytes each after the row's codes); wide: vpdpwssd on int16
   codes. Then the same float steps in the same order as tile. */
ALWAYS_INLINE void tile512(const int MR, const int WIDE, const char* xc, int64_t xs, const float* xd, int nb, int K,
                           const char* w, const float* ws, float* y, int64_t ys, const float* b, int nc,
                           int accumulate, const char* prefetch) {
    __m512 f[MR_MAX];
    _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) f[r] = _mm512_setzero_ps();
    const int64_t block_bytes = (int64_t)QB * PANEL * (WIDE ? 2 : 1);
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int kb = 0; kb < nb; kb++) {
        __m512i s[MR_MAX];
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) s[r] = _mm512_setzero_si512();
        const char* wb = w + kb * block_bytes;
        if (WIDE) {
            _Pragma("GCC unroll 16") for (int g = 0; g < QB / 2; g++) {
                if (prefetch) _mm_prefetch(prefetch + kb * block_bytes + g * 64, _MM_HINT_T0);
                const __m512i w0 = _mm512_loadu_si512((const void*)(wb + g * 64));
                _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) {
                    const __m512i vq = _mm512_set1_epi32(load_i32(xc + r * xs + ((int64_t)kb * QB + g * 2) * 2));
                    s[r] = _mm512_dpwssd_epi32(s[r], w0, vq);
                }
            }
        } else {
            _Pragma("GCC unroll 8") for (int g = 0; g < QB / 4; g++) {
                if (prefetch) _mm_prefetch(prefetch + kb * block_bytes + g * 64, _MM_HINT_T0);
                const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512((const void*)(wb + g * 64)), offset);
                _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) {
                    const __m512i vq = _mm512_set1_epi32(load_i32(xc + r * xs + (int64_t)kb * QB + g * 4));
                    s[r] = _mm512_dpbusd_epi32(s[r], wu, vq);
                }
            }
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++)
                s[r] = _mm512_sub_epi32(s[r], _mm512_set1_epi32(load_i32(xc + r * xs + K + kb * 4) * 128));
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++)
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_set1_ps(xd[r * nb + kb]), f[r]);
    }
    const __mmask16 m = (__mmask16)((1u << nc) - 1u);
    const __m512 sc = _mm512_loadu_ps(ws);
    const __m512 bb = b ? _mm512_maskz_loadu_ps(m, b) : _mm512_setzero_ps();
    _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) {
        __m512 c = _mm512_fmadd_ps(f[r], sc, bb);
        float* yr = y + r * ys;
        if (accumulate) c = _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr), c);
        _mm512_mask_storeu_ps(yr, m, c);
    }
}

#define TILE tile512
#else
#define TILE tile
#endif

#define TILE_CASE(R)                                                                       \
    case R:                                                                                \
        if (wide) TILE(R, 1, xc, xs, xd, nb, K, w, ws, y, ys, b, nc, acc, pf);              \
        else TILE(R, 0, xc, xs, xd, nb, K, w, ws, y, ys, b, nc, acc, pf);                   \
        break;

/* the row count and layout compile-time constants inside each tile (always_inline): one case per count */
static void tile_rows(int mr, int wide, const char* xc, int64_t xs, const float* xd, int nb, int K, const char* w,
                      const float* ws, float* y, int64_t ys, const float* b, int nc, int acc, const char* pf) {
    switch (mr) {
        TILE_CASE(1)
#if MR_MAX >= 2
        TILE_CASE(2)
#endif
#if MR_MAX >= 3
        TILE_CASE(3)
#endif
#if MR_MAX >= 4
        TILE_CASE(4)
#endif
#if MR_MAX >= 5
        TILE_CASE(5)
#endif
#if MR_MAX >= 6
        TILE_CASE(6)
#endif
#if MR_MAX >= 7
        TILE_CASE(7)
#endif
#if MR_MAX >= 8
        TILE_CASE(8)
#endif
        default: break;
    }
}
#else
/* scalar: per column, per block the exact int32 sum, then fmaf with the block scale (the vector paths' order) */
static void tile_rows(int mr, int wide, const char* xc, int64_t xs, const float* xd, int nb, int K, const char* w,
                      const float* ws, float* y, int64_t ys, const float* b, int nc, int acc, const char* pf) {
    (void)pf;
    (void)K;
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) {
            float f = 0.f;
            for (int kb = 0; kb < nb; kb++) {
                int32_t s = 0;
                for (int k = kb * QB; k < (kb + 1) * QB; k++) {
                    if (wide)
                        s += (int32_t)((const int16_t*)(xc + r * xs))[k] *
                             (int32_t)((const int16_t*)w)[((int64_t)(k / 2) * PANEL + c) * 2 + k % 2];
                    else
                        s += (int32_t)(int8_t)xc[r * xs + k] *
                             (int32_t)(int8_t)w[((int64_t)(k / 4) * PANEL + c) * 4 + k % 4];
                }
                f = fmaf((float)s, xd[r * nb + kb], f);
            }
            const float v = fmaf(f, ws[c], b ? b[c] : 0.f);
            y[r * ys + c] = acc ? y[r * ys + c] + v : v;
        }
}
#endif

/* Rows per row block: their scratch rows (2 K bytes each) stay in L2 while the thread's panels pass over them. */
static int row_block(int M, int K) {
    int mb = (int)(X_BLOCK_BYTES / ((int64_t)K * 2)) / 24 * 24; /* whole tiles of 6 or 8 rows */
    if (mb < 24) mb = 24;
    return M <= 2 * mb ? M : mb;
}

/* The thread's static share of the panels for rows [0, M): near-equal tiles of at most MR_MAX rows; the first
   tile of a panel prefetches the next panel. */
static void share(int wide, const char* xc, const float* xd, const char* wp, const float* ws, const float* b,
                  float* y, int64_t ys, int M, int N, int K, int accumulate) {
    const int np = (N + PANEL - 1) / PANEL, nb = K / QB, mb = row_block(M, K);
    const int64_t pb = (int64_t)K * PANEL * (wide ? 2 : 1), xs = 2 * (int64_t)K;
    for (int r0 = 0; r0 < M; r0 += mb) {
        const int rows = M - r0 < mb ? M - r0 : mb, tiles = (rows + MR_MAX - 1) / MR_MAX;
        #pragma omp for schedule(static) nowait
        for (int p = 0; p < np; p++) {
            const char* w = wp + (int64_t)p * pb;
            const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
            int m0 = r0;
            for (int t = 0; t < tiles; t++) {
                const int mr = (r0 + rows - m0) / (tiles - t) + (((r0 + rows - m0) % (tiles - t)) ? 1 : 0);
                const char* next = (t == 0 && p + 1 < np) ? w + pb : 0;
                tile_rows(mr, wide, xc + m0 * xs, xs, xd + (int64_t)m0 * nb, nb, K, w, ws + n0, y + m0 * ys + n0, ys,
                          b ? b + n0 : 0, nc, accumulate, next);
                m0 += mr;
            }
        }
    }
}

/* Quantise x [M, K] (row stride xs floats) into the scratch rows xc [M, 2K bytes] and block scales xd [M, K/32]:
   the first half of w8a8_gemm, exported for tests. */
void w8a8_quantize(const float* x, int64_t xs, int M, int K, int wide, char* xc, float* xd) {
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < M; r++) quant_row(x + r * xs, K, wide, xc + (int64_t)r * 2 * K, xd + (int64_t)r * (K / QB));
}

/* y (+)= x W^T + b: x float32 [M, K] (row stride xs), codes the panels (wide 0: int8 [Np, K/4, 16, 4]; 1: int16
   [Np, K/2, 16, 2]), ws [Npad] the channel scales, b [N] or NULL, y [M, N] (row stride ys). Returns 1 (nothing
   done) when K is not a multiple of 32 or the scratch for the activation codes cannot be allocated. */
int w8a8_gemm(const float* x, int64_t xs, const void* codes, int wide, const float* ws, const float* b, float* y,
              int64_t ys, int M, int N, int K, int accumulate) {
    if (K <= 0 || K % QB) return 1;
    if (M <= 0 || N <= 0) return 0;
    const int64_t nq = (int64_t)M * K * 2;
    char* mem = (char*)malloc(nq + (int64_t)M * (K / QB) * 4 + 64);
    if (!mem) return 1;
    char* xc = mem;
    float* xd = (float*)(mem + ((nq + 63) & ~(int64_t)63));
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int r = 0; r < M; r++)
            quant_row(x + r * xs, K, wide, xc + (int64_t)r * 2 * K, xd + (int64_t)r * (K / QB));
        /* the implicit barrier: every row quantised before any panel reads it */
        share(wide, xc, xd, (const char*)codes, ws, b, y, ys, M, N, K, accumulate);
    }
    free(mem);
    return 0;
}
