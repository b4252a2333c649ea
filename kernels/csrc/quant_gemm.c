/* y (+)= x W^T + b for float32 x and y with W quantised (kernels/quant.py) and packed once at load into panels of
   16 output columns, the layout of packed_gemm.c with smaller elements, so that one pass streams the weight:

     int8  codes [ceil(N/16), K, 16] int8 (k's 16 codes adjacent) + scale [Npad] float32 (w = q * scale[col]).
     int4  codes [ceil(N/16), K/2, 16] bytes: the byte of column c for k pair j holds k = 2j in its low nibble and
           k = 2j + 1 in its high one; + sz [ceil(N/16), K/G, 2, 16] float32 (or float16, FMT_HALF, where every
           value converts exactly: GGUF's Q4_0/Q4_1 blocks and our quantiser's): for each group g of G inputs, the
           16 columns' scales s, then their offsets o = zero - 8 s, so w = q * s + o and one group's scales (or
           offsets) are two vector loads next to the codes' stream.

   Decode sizes (M up to widen_rows): the codes are widened in registers as they are loaded and multiplied like
   packed_gemm's block (an mr x 16 output block, each panel row loaded once per tile and FMA'd with the mr
   broadcast inputs, split-k accumulator sets for 1-3 rows (int4: 1-2) so FMA latency does not pace the stream, the next
   panel prefetched). A byte load sign- or zero-extended to 8 lanes (vpmovsxbd / vpmovzxbd fold the load) and
   one conversion are all the widening an int8 row needs; an int4 pair row is one such load per 8 columns, then
   an and (low nibble) and a shift (high one) before the conversions. int8's per-column scale is applied once at
   the end of the tile. int4 never forms w: per group, the tile sums x_k q_k (the codes as floats), then
     sum_k x_k w_k = sum_g [ s_g (sum_{k in g} x_k q_k) + o_g (sum_{k in g} x_k) ],
   two FMAs per row and group; the group sums of x are computed once per call (per thread, since qgemm_team may
   not synchronise), not per panel.

   int4 panels can also be multiplied with int8 activations (FMT_I4A8, block4a8: x quantised in blocks of 32 as
   llama.cpp's Q8_0, integer dot products), by the same direct tiles at every M. Builds with that format's
   AVX512-VNNI tile run int4 times float activations at decode sizes on it too, over two int8 pieces of each
   activation block (FMT_I4P, quant_pieces: x within 2^-15 of its block's largest value, at integer speed;
   int4_pieces says why).

   Larger M (prefill), int4: a K-block of each panel is widened once into a float32 scratch tile (KBLOCK x 16,
   L1 resident, as q * s + o) and every row tile of the row block reuses it with the float micro-kernel (6 x 16,
   packed_gemm's), so one layout serves every M and the unpacking is amortised over the rows. int8 stays on the
   direct tiles at every M (widen_rows says why; the scratch path is kept for it, selectable for timings). At
   M = 256 on a 2-core Zen 3 VM (AVX2, no VNNI or AVX512-BF16) both ran the SmolLM2 shapes about 2x faster than
   torch's best form there (w8a16 / w4; its de-quantise-to-bfloat16-then-GEMM forms were slower still), int8
   1.0-1.3x and int4 0.9-1.0x the float32 packed GEMM (docs/ENGINE.md has the numbers).
   Both paths work in row blocks whose x rows stay in L2 (packed_gemm.c).

   Panels are shared out over OpenMP threads: share_direct / share_widened are the body, an orphaned `omp for
   nowait`, so qgemm_team can be called by every thread of an enclosing parallel region (decode_step.c's
   pattern, no barrier at the end), and qgemm runs it in a parallel region of its own. Needs AVX2 + FMA; AVX-512
   builds run the decode tiles on 512-bit registers (block_i8_512, block4_512, and with AVX512-VNNI + VBMI
   block4a8_512), with results equal bit for bit (FMT_I4P aside: the AVX2 build keeps the float tile there). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if !INFERQ_HAVE_AVX2
#error "quant_gemm.c needs AVX2 + FMA (built with -march=native on such a CPU, without INFERQ_NO_AVX2)"
#else

#define PANEL 16
#define FMT_I8 0
#define FMT_I4 1
#define FMT_I4A8 2 /* int4 panels times int8 activations (block4a8) */
#define FMT_HALF 4 /* or'd into an int4 format: the panel's scales and offsets are float16 (load_sz) */
#define FMT_I4P 3 /* internal: int4 with float activations as int8 pieces (block4a8_512, quant_pieces) */
#define QB 32      /* inputs per int8 activation block */
#define KIND_F32 0 /* the widened scratch tile */
#define KIND_I8 1
/* k per widened scratch tile: 16 KiB of float32, half of L1d, a multiple of every int4 group size */
#define KBLOCK 256
#define X_BLOCK_BYTES (192 * 1024) /* x rows per row block of the widened path: L2 resident (packed_gemm.c) */
#define XSUM_STACK 4096            /* floats of group sums held on the stack; more: malloc */
#define A8_STACK 65536             /* bytes of quantised activations held on the stack; more: malloc */
#ifdef INFERQ_NO_SPLIT_K
#define SPLIT_K(MR) 1
#else
#define SPLIT_K(MR) ((MR) == 1 ? 4 : (MR) <= 3 ? 2 : 1)
#endif

/* Rows up to which the codes are widened in registers by every row tile; above, a K-block at a time into scratch.
   int8: never, by default. Measured (one Zen 3 core, 1024 x 576 and 576 x 1536, M = 4..128) the direct tiles
   were 5-50% faster at every M: a 6-row tile is bound by its 12 FMAs per panel row, and the sign-extending
   loads and conversions run beside them on the other ports, so the scratch tile only adds its stores and
   loads. int4: direct up to 12 rows (its tiles are at most 4 rows, the nibble unpacking costs more per code,
   and at 12 rows the two paths tied; 16: scratch 1.1x, 32: 1.2x). qgemm_set_widen_rows changes them (tests,
   timings). */
static int widen_rows[2] = {1 << 30, 12};
void qgemm_set_widen_rows(int fmt, int rows) { widen_rows[fmt ? 1 : 0] = rows; }
int qgemm_widen_rows(int fmt) { return widen_rows[fmt ? 1 : 0]; }

/* y[0:MR, 0:nc] (+)= acc * scale + b: the end of every tile (acc in registers, two ymm per row). */
ALWAYS_INLINE void store_tile(const int MR, __m256 (*c)[2], const float* scale, float* y, int64_t ys,
                              const float* b, int nc, int accumulate) {
    if (scale) {
        const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            c[r][0] = _mm256_mul_ps(c[r][0], s0);
            c[r][1] = _mm256_mul_ps(c[r][1], s1);
        }
    }
    if (b) {
        float bb[PANEL] = {0};
        for (int j = 0; j < nc; j++) bb[j] = b[j];
        const __m256 b0 = _mm256_loadu_ps(bb), b1 = _mm256_loadu_ps(bb + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            c[r][0] = _mm256_add_ps(c[r][0], b0);
            c[r][1] = _mm256_add_ps(c[r][1], b1);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
        float* yr = y + r * ys;
        if (nc == PANEL) {
            if (accumulate) {
                c[r][0] = _mm256_add_ps(c[r][0], _mm256_loadu_ps(yr));
                c[r][1] = _mm256_add_ps(c[r][1], _mm256_loadu_ps(yr + 8));
            }
            _mm256_storeu_ps(yr, c[r][0]);
            _mm256_storeu_ps(yr + 8, c[r][1]);
        } else { /* the last panel of an N that is not a multiple of 16 */
            float t[PANEL];
            _mm256_storeu_ps(t, c[r][0]);
            _mm256_storeu_ps(t + 8, c[r][1]);
            for (int j = 0; j < nc; j++) yr[j] = accumulate ? yr[j] + t[j] : t[j];
        }
    }
}

/* 16 weights of panel row k: float32 (the scratch tile) or int8 codes widened exactly */
ALWAYS_INLINE void load_row(const int KIND, const void* w, int64_t k, __m256* w0, __m256* w1) {
    if (KIND == KIND_F32) {
        *w0 = _mm256_loadu_ps((const float*)w + k * PANEL);
        *w1 = _mm256_loadu_ps((const float*)w + k * PANEL + 8);
    } else {
        const int8_t* p = (const int8_t*)w + k * PANEL;
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
    }
}

/* One MR x 16 tile over K panel rows of float32 (scratch) or int8 codes (then times scale): packed_gemm.c's
   block, at most two accumulator sets (16 ymm registers). prefetch: the next panel's codes, one line per 4 rows
   of int8 (64 bytes) or per row of float32. */
ALWAYS_INLINE void block(const int MR, const int KIND, const float* x, int64_t xs, const void* w, int K,
                         const float* scale, float* y, int64_t ys, const float* b, int nc, int accumulate,
                         const char* prefetch) {
    /* four sets for one row of int8 codes: 11 ymm registers, and the widening's extra work per row would
       otherwise leave the 4 chains of two sets pacing the loop; at most two elsewhere (16 ymm registers) */
    const int S = KIND == KIND_I8 && MR == 1 ? SPLIT_K(MR) : SPLIT_K(MR) > 2 ? 2 : SPLIT_K(MR);
    const int row_bytes = KIND == KIND_F32 ? 4 * PANEL : PANEL;
    __m256 c[4][6][2];
    _Pragma("GCC unroll 4") for (int s = 0; s < S; s++)
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) c[s][r][0] = c[s][r][1] = _mm256_setzero_ps();
    int k = 0;
    for (; k + S <= K; k += S) {
        _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) {
            const int kk = k + s;
            if (prefetch && (KIND == KIND_F32 || !(kk & 3))) _mm_prefetch(prefetch + (int64_t)kk * row_bytes, _MM_HINT_T0);
            __m256 w0, w1;
            load_row(KIND, w, kk, &w0, &w1);
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
                const __m256 xb = _mm256_broadcast_ss(x + r * xs + kk);
                c[s][r][0] = _mm256_fmadd_ps(xb, w0, c[s][r][0]);
                c[s][r][1] = _mm256_fmadd_ps(xb, w1, c[s][r][1]);
            }
        }
    }
    for (; k < K; k++) {
        __m256 w0, w1;
        load_row(KIND, w, k, &w0, &w1);
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
            c[0][r][0] = _mm256_fmadd_ps(xb, w0, c[0][r][0]);
            c[0][r][1] = _mm256_fmadd_ps(xb, w1, c[0][r][1]);
        }
    }
    _Pragma("GCC unroll 4") for (int s = 1; s < S; s++)
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            c[0][r][0] = _mm256_add_ps(c[0][r][0], c[s][r][0]);
            c[0][r][1] = _mm256_add_ps(c[0][r][1], c[s][r][1]);
        }
    store_tile(MR, c[0], KIND == KIND_I8 ? scale : 0, y, ys, b, nc, accumulate);
}

/* Pair row j of an int4 panel as floats: lo = codes of k = 2j (columns 0-7, 8-15), hi = codes of k = 2j + 1. */
ALWAYS_INLINE void load_pair(const uint8_t* w, int64_t j, __m256* lo0, __m256* lo1, __m256* hi0, __m256* hi1) {
    const __m256i m = _mm256_set1_epi32(15);
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + j * PANEL)));
    const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + j * PANEL + 8)));
    *lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, m));
    *lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, m));
    *hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)); /* a zero-extended byte: the shift leaves 4 bits */
    *hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
}

/* 8 of a panel's scales or offsets from element i of its sz: float32, or (H) float16 widened exactly by F16C.
   float16 halves what the scales add to the codes' stream (a third of an int4 g32 panel's bytes in float32);
   kernels/quant_panels.py packs it only where every value converts exactly. */
ALWAYS_INLINE __m256 load_sz(const int H, const void* sz, int64_t i) {
    return H ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)sz + i)))
             : _mm256_loadu_ps((const float*)sz + i);
}

/* The next panel's scales and offsets of group g (a panel has ng groups): two lines (float16: one). */
ALWAYS_INLINE void prefetch_group(const int H, const void* sz, int ng, int g) {
    const char* p = (const char*)sz + (int64_t)(ng + g) * 2 * PANEL * (H ? 2 : 4);
    _mm_prefetch(p, _MM_HINT_T0);
    if (!H) _mm_prefetch(p + 64, _MM_HINT_T0);
}

/* One MR x 16 tile (MR <= 4) of an int4 panel: per group, sum x_k q_k in NS accumulator sets (4 for one row,
   two pairs per step; 2 for two rows: low and high nibbles; 1 above, 16 ymm registers), then fold the group
   into the totals with its scales and offsets and the group sums of x (xg: row stride ng). */
ALWAYS_INLINE void block4(const int MR, const int H, const float* x, int64_t xs, const uint8_t* w, const void* sz, int G, int K,
                          const float* xg, int ng, float* y, int64_t ys, const float* b, int nc, int accumulate,
                          const uint8_t* prefetch) {
    const int NS = MR == 1 ? 4 : MR == 2 ? 2 : 1, P = NS == 4 ? 2 : 1; /* sets, pairs per step */
    const int GP = G / 2;
    __m256 t[4][2], c[4][4][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) t[r][0] = t[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        _Pragma("GCC unroll 4") for (int s = 0; s < NS; s++)
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) c[s][r][0] = c[s][r][1] = _mm256_setzero_ps();
        if (prefetch) prefetch_group(H, sz, ng, g);
        for (int j0 = g * GP; j0 < (g + 1) * GP; j0 += P) {
            _Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {
                const int j = j0 + p;
                if (prefetch && !(j & 3)) _mm_prefetch((const char*)(prefetch + (int64_t)j * PANEL), _MM_HINT_T0);
                __m256 lo0, lo1, hi0, hi1;
                load_pair(w, j, &lo0, &lo1, &hi0, &hi1);
                const int sa = NS == 4 ? 2 * p : 0, sb = NS == 1 ? 0 : sa + 1;
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
                    const __m256 xa = _mm256_broadcast_ss(x + r * xs + 2 * j);
                    const __m256 xb = _mm256_broadcast_ss(x + r * xs + 2 * j + 1);
                    c[sa][r][0] = _mm256_fmadd_ps(xa, lo0, c[sa][r][0]);
                    c[sa][r][1] = _mm256_fmadd_ps(xa, lo1, c[sa][r][1]);
                    c[sb][r][0] = _mm256_fmadd_ps(xb, hi0, c[sb][r][0]);
                    c[sb][r][1] = _mm256_fmadd_ps(xb, hi1, c[sb][r][1]);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int s = 1; s < NS; s++)
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
                c[0][r][0] = _mm256_add_ps(c[0][r][0], c[s][r][0]);
                c[0][r][1] = _mm256_add_ps(c[0][r][1], c[s][r][1]);
            }
        const int64_t gs = (int64_t)g * 2 * PANEL;
        const __m256 s0 = load_sz(H, sz, gs), s1 = load_sz(H, sz, gs + 8);
        const __m256 o0 = load_sz(H, sz, gs + 16), o1 = load_sz(H, sz, gs + 24);
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
            const __m256 xs_g = _mm256_broadcast_ss(xg + r * ng + g);
            t[r][0] = _mm256_fmadd_ps(o0, xs_g, _mm256_fmadd_ps(s0, c[0][r][0], t[r][0]));
            t[r][1] = _mm256_fmadd_ps(o1, xs_g, _mm256_fmadd_ps(s1, c[0][r][1], t[r][1]));
        }
    }
    store_tile(MR, t, 0, y, ys, b, nc, accumulate);
}

/* int4 panels times int8 activations (FMT_I4A8: the "w4a8" quantisation; llama.cpp's Q4 x Q8_0 arithmetic on
   our panels): x quantised per row in blocks of 32 inputs (quant_block32), the products summed exactly in integers.
   Why: block4's one-row tile is bound by its instructions (per 32 multiply-adds: two widening loads, two ands, two
   shifts, four conversions, four FMAs), not by memory, on every CPU measured; here 64 multiply-adds cost a load,
   three ops to split the nibbles, two unpacks and, per row, a broadcast, a shuffle, two vpmaddubsw and two adds.

   Two pair rows j, j + 1 (32 bytes, k = 2j .. 2j + 3) split into their low nibbles (k = 2j, 2j + 2 in the two
   128-bit lanes) and high ones (2j + 1, 2j + 3); unpacking bytes interleaves them into [column c: k, k + 1] pairs,
   columns 0-7 (P) and 8-15 (Q), lane 0 holding pair row j and lane 1 pair row j + 1. The row's four codes
   broadcast and shuffled to (x_2j, x_2j+1) in lane 0 and (x_2j+2, x_2j+3) in lane 1 make vpmaddubsw's signed
   operand (the codes 0..15 its unsigned one: no sign trick), and each int16 lane gets one column's two products.
   Those are added in int16 over a fold of F = min(G, 32) inputs (at most 8 steps of 2 * 15 * 127: 30,480 fits),
   then the two lanes widened to int32 and added (the column's sum over the fold), converted once, and
   fused-multiply-added into the float totals with the group's scales times the block's activation scale. The
   offsets' term is o_g times the group's sum of the de-quantised activations (xh), once per group:
     y = sum_g [ s_g sum_{b in g} d_b sum_{k in b} q_k c_k + o_g sum_{k in g} d_b(k) q_k ].
   AVX512-VNNI builds run block4a8_512 instead, with equal results bit for bit. */
ALWAYS_INLINE void block4a8(const int MR, const int H, const int8_t* xq, int64_t xqs, const float* xd, int64_t xds,
                            const float* xh, int ng, const uint8_t* w, const void* sz, int G, int K, float* y,
                            int64_t ys, const float* b, int nc, int accumulate, const uint8_t* prefetch) {
    const int F = G < QB ? G : QB;
    const __m256i nib = _mm256_set1_epi8(15);
    const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    __m256 t[4][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) t[r][0] = t[r][1] = _mm256_setzero_ps();
    for (int k0 = 0; k0 < K; k0 += F) {
        const int g = k0 / G;
        if (prefetch && k0 % G == 0) prefetch_group(H, sz, ng, g);
        __m256i a[4][2];
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
        for (int k = k0; k < k0 + F; k += 4) {
            const int j = k / 2;
            if (prefetch && !(j & 3)) _mm_prefetch((const char*)(prefetch + (int64_t)j * PANEL), _MM_HINT_T0);
            const __m256i v = _mm256_loadu_si256((const __m256i*)(w + (int64_t)j * PANEL));
            const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            const __m256i P = _mm256_unpacklo_epi8(lo, hi), Q = _mm256_unpackhi_epi8(lo, hi);
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
                int32_t quad;
                memcpy(&quad, xq + r * xqs + k, 4);
                const __m256i xa = _mm256_shuffle_epi8(_mm256_set1_epi32(quad), pairs);
                a[r][0] = _mm256_add_epi16(a[r][0], _mm256_maddubs_epi16(P, xa));
                a[r][1] = _mm256_add_epi16(a[r][1], _mm256_maddubs_epi16(Q, xa));
            }
        }
        const int64_t gs = (int64_t)g * 2 * PANEL;
        const __m256 s0 = load_sz(H, sz, gs), s1 = load_sz(H, sz, gs + 8);
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
            const __m256 d = _mm256_broadcast_ss(xd + r * xds + k0 / QB);
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
                const __m256i sum = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a[r][h])),
                                                     _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a[r][h], 1)));
                t[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(h ? s1 : s0, d), _mm256_cvtepi32_ps(sum), t[r][h]);
            }
        }
        if ((k0 + F) % G == 0) {
            const __m256 o0 = load_sz(H, sz, gs + 16), o1 = load_sz(H, sz, gs + 24);
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
                const __m256 xs_g = _mm256_broadcast_ss(xh + r * ng + g);
                t[r][0] = _mm256_fmadd_ps(o0, xs_g, t[r][0]);
                t[r][1] = _mm256_fmadd_ps(o1, xs_g, t[r][1]);
            }
        }
    }
    store_tile(MR, t, 0, y, ys, b, nc, accumulate);
}

#if INFERQ_HAVE_AVX512
/* The decode tiles on 512-bit registers (AVX-512 builds): one zmm holds a panel row's 16 columns, so a row costs
   half the instructions of the two-ymm tiles above. At one row the int4 tile is bound by its instructions, not by
   memory (measured: 8.7 GB/s per core with the weight in L2 on the two-ymm tile, an Emerald Rapids Xeon), so
   this is the difference between streaming the weight and not. Every lane does the same operations in the same
   order as the AVX2 tiles (the same sets, the same folds, store_tile for the end), so both builds give equal
   results bit for bit (tests/unit/test_quant_panels.py checks it). */

/* A zmm tile row as store_tile's two ymm halves (columns 0-7, 8-15). */
ALWAYS_INLINE void halves(const int MR, const __m512* t, __m256 (*c)[2]) {
    _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
        c[r][0] = _mm512_castps512_ps256(t[r]);
        c[r][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t[r]), 1));
    }
}

/* block()'s int8 tile: MR x 16 over K code rows, the same split-k sets, then times scale in store_tile. */
ALWAYS_INLINE void block_i8_512(const int MR, const float* x, int64_t xs, const int8_t* w, int K,
                                const float* scale, float* y, int64_t ys, const float* b, int nc, int accumulate,
                                const char* prefetch) {
    const int S = MR == 1 ? SPLIT_K(MR) : SPLIT_K(MR) > 2 ? 2 : SPLIT_K(MR);
    __m512 c[4][6];
    __m256 h[6][2];
    _Pragma("GCC unroll 4") for (int s = 0; s < S; s++)
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) c[s][r] = _mm512_setzero_ps();
    int k = 0;
    for (; k + S <= K; k += S) {
        _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) {
            const int kk = k + s;
            if (prefetch && !(kk & 3)) _mm_prefetch(prefetch + (int64_t)kk * PANEL, _MM_HINT_T0);
            const __m512 wr = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + (int64_t)kk * PANEL))));
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++)
                c[s][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + kk]), wr, c[s][r]);
        }
    }
    for (; k < K; k++) {
        const __m512 wr = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + (int64_t)k * PANEL))));
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++)
            c[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), wr, c[0][r]);
    }
    _Pragma("GCC unroll 4") for (int s = 1; s < S; s++)
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) c[0][r] = _mm512_add_ps(c[0][r], c[s][r]);
    halves(MR, c[0], h);
    store_tile(MR, h, scale, y, ys, b, nc, accumulate);
}

/* block4()'s int4 tile. A pair row's 16 bytes zero-extended to 16 lanes; the low nibble as a float is one
   permute (vpermps reads the low 4 bits of each index lane: a table of 0..15 gives the code exactly, with no
   mask or conversion), the high one a shift and a conversion, so the two ports of 512-bit work share them. */
ALWAYS_INLINE void block4_512(const int MR, const int H, const float* x, int64_t xs, const uint8_t* w, const void* sz, int G,
                              int K, const float* xg, int ng, float* y, int64_t ys, const float* b, int nc,
                              int accumulate, const uint8_t* prefetch) {
    const int NS = MR == 1 ? 4 : MR == 2 ? 2 : 1, P = NS == 4 ? 2 : 1;
    const int GP = G / 2;
    const __m512 codes = _mm512_set_ps(15.f, 14.f, 13.f, 12.f, 11.f, 10.f, 9.f, 8.f, 7.f, 6.f, 5.f, 4.f, 3.f, 2.f,
                                       1.f, 0.f);
    __m512 t[4], c[4][4];
    __m256 h[4][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) t[r] = _mm512_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        _Pragma("GCC unroll 4") for (int s = 0; s < NS; s++)
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) c[s][r] = _mm512_setzero_ps();
        if (prefetch) prefetch_group(H, sz, ng, g);
        for (int j0 = g * GP; j0 < (g + 1) * GP; j0 += P) {
            _Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {
                const int j = j0 + p;
                if (prefetch && !(j & 3)) _mm_prefetch((const char*)(prefetch + (int64_t)j * PANEL), _MM_HINT_T0);
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w + (int64_t)j * PANEL)));
                const __m512 lo = _mm512_permutexvar_ps(v, codes);
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                const int sa = NS == 4 ? 2 * p : 0, sb = NS == 1 ? 0 : sa + 1;
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
                    c[sa][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + 2 * j]), lo, c[sa][r]);
                    c[sb][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + 2 * j + 1]), hi, c[sb][r]);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int s = 1; s < NS; s++)
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) c[0][r] = _mm512_add_ps(c[0][r], c[s][r]);
        const int64_t gs = (int64_t)g * 2 * PANEL;
        const __m512 sc = H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sz + gs)))
                            : _mm512_loadu_ps((const float*)sz + gs);
        const __m512 of = H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sz + gs + 16)))
                            : _mm512_loadu_ps((const float*)sz + gs + 16);
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)
            t[r] = _mm512_fmadd_ps(of, _mm512_set1_ps(xg[r * ng + g]), _mm512_fmadd_ps(sc, c[0][r], t[r]));
    }
    halves(MR, t, h);
    store_tile(MR, h, 0, y, ys, b, nc, accumulate);
}
#define BLOCK_I8(MR, ...) block_i8_512(MR, __VA_ARGS__)
#define BLOCK_I4 block4_512

#if !defined(INFERQ_NO_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define A8_ISA 3
/* block4a8()'s tile with AVX512-VNNI: vpdpbusd multiplies 4 unsigned codes by 4 signed activations and adds the
   four products into an int32 lane, so one zmm lane per column takes 4 inputs per instruction, with no int16
   stage and no widening. Four pair rows (64 bytes, k .. k + 7) are split into their nibbles (a shift and two
   ands) and two byte permutes (vpermt2b, AVX512-VBMI) put each column's four codes of k .. k + 3 (then
   k + 4 .. k + 7) side by side: [lo j, hi j, lo j+1, hi j+1] for column c. The activations' quad is one
   broadcast, the same in every lane. Per 8 inputs of 16 columns: a load, 5 ops, then per row 2 broadcasts and
   2 vpdpbusd (block4a8: 10 ops per 4 inputs, then 6 per row). Integer sums are exact, so splitting a fold over
   NS accumulator sets (latency) changes nothing: each fold's column sum is block4a8's, converted and FMA'd in
   the same order, and both builds give equal results bit for bit.
   PC = 2 or 3 (FMT_I4P): each row's activations are int8 pieces (quant_pieces), each with its own sums; a
   fold's (at most 32 inputs, codes <= 15) are at most 60,960 for q1 and 30,720 for q2 and q3, so q1's sum and
   q2's (PC = 2) or 128 q2's + q3's (PC = 3, under 2^22) convert to float exactly, the first scaled by 128 or
   16384 (a power of two). */
ALWAYS_INLINE void block4a8_512(const int MR, const int PC, const int H, const int8_t* xq, int64_t xqs,
                                const float* xd, int64_t xds, const float* xh, int ng, const uint8_t* w, const void* sz,
                                int G, int K, float* y, int64_t ys, const float* b, int nc, int accumulate,
                                const uint8_t* prefetch) {
    /* two sets at one row, not block4_512's four: the sets alternate by step, (2 step) % NS, an index known only
       at run time (F depends on G) for NS = 4, which put the accumulators on the stack (measured on a Zen 4: the
       one-row tile 10% slower than the AVX2 tile with four sets, 15-20% faster with two) */
    const int F = G < QB ? G : QB, NS = MR <= 2 ? 2 : 1;
    const __m512i nib = _mm512_set1_epi8(15);
    /* byte 4c + i of operand A (pair rows j, j + 1) and B (j + 2, j + 3) from the 128 bytes [lo (64) | hi (64)] */
    static const int8_t order[2][64] = {
        {0, 64, 16, 80, 1, 65, 17, 81, 2, 66, 18, 82, 3, 67, 19, 83, 4, 68, 20, 84, 5, 69, 21, 85,
         6, 70, 22, 86, 7, 71, 23, 87, 8, 72, 24, 88, 9, 73, 25, 89, 10, 74, 26, 90, 11, 75, 27, 91,
         12, 76, 28, 92, 13, 77, 29, 93, 14, 78, 30, 94, 15, 79, 31, 95},
        {32, 96, 48, 112, 33, 97, 49, 113, 34, 98, 50, 114, 35, 99, 51, 115, 36, 100, 52, 116, 37, 101, 53, 117,
         38, 102, 54, 118, 39, 103, 55, 119, 40, 104, 56, 120, 41, 105, 57, 121, 42, 106, 58, 122, 43, 107, 59, 123,
         44, 108, 60, 124, 45, 109, 61, 125, 46, 110, 62, 126, 47, 111, 63, 127}};
    const __m512i oa = _mm512_loadu_si512(order[0]), ob = _mm512_loadu_si512(order[1]);
    __m512 t[4];
    __m256 h2[4][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) t[r] = _mm512_setzero_ps();
    for (int k0 = 0; k0 < K; k0 += F) {
        const int g = k0 / G;
        if (prefetch && k0 % G == 0) prefetch_group(H, sz, ng, g);
        __m512i a[3][2][4]; /* piece, set, row */
        _Pragma("GCC unroll 3") for (int c = 0; c < PC; c++)
            _Pragma("GCC unroll 2") for (int s = 0; s < NS; s++)
                _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) a[c][s][r] = _mm512_setzero_si512();
        for (int k = k0, step = 0; k < k0 + F; k += 8, step++) {
            const int j = k / 2, sa = (2 * step) % NS, sb = (2 * step + 1) % NS;
            if (prefetch) _mm_prefetch((const char*)(prefetch + (int64_t)j * PANEL), _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512((const void*)(w + (int64_t)j * PANEL));
            const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            const __m512i A = _mm512_permutex2var_epi8(lo, oa, hi), B = _mm512_permutex2var_epi8(lo, ob, hi);
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)
                _Pragma("GCC unroll 3") for (int c = 0; c < PC; c++) {
                    int32_t qa, qb;
                    memcpy(&qa, xq + r * xqs + c * K + k, 4);
                    memcpy(&qb, xq + r * xqs + c * K + k + 4, 4);
                    a[c][sa][r] = _mm512_dpbusd_epi32(a[c][sa][r], A, _mm512_set1_epi32(qa));
                    a[c][sb][r] = _mm512_dpbusd_epi32(a[c][sb][r], B, _mm512_set1_epi32(qb));
                }
        }
        _Pragma("GCC unroll 3") for (int c = 0; c < PC; c++)
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
                if (NS == 2) a[c][0][r] = _mm512_add_epi32(a[c][0][r], a[c][1][r]);
                if (c == 2) /* three pieces: the codes times q2 / 128 + q3 / 16384, in units of 1 / 16384 */
                    a[1][0][r] = _mm512_add_epi32(_mm512_slli_epi32(a[1][0][r], 7), a[2][0][r]);
            }
        const int64_t gs = (int64_t)g * 2 * PANEL;
        const __m512 sc = H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sz + gs)))
                            : _mm512_loadu_ps((const float*)sz + gs);
        _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++) {
            const __m512 sd = _mm512_mul_ps(sc, _mm512_set1_ps(xd[r * xds + k0 / QB]));
            if (PC == 1) {
                t[r] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(a[0][0][r]), t[r]);
            } else {
                const __m512 sd1 = _mm512_mul_ps(sd, _mm512_set1_ps(PC == 3 ? 16384.f : 128.f));
                t[r] = _mm512_fmadd_ps(sd1, _mm512_cvtepi32_ps(a[0][0][r]), t[r]);
                t[r] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(a[1][0][r]), t[r]);
            }
        }
        if ((k0 + F) % G == 0) {
            const __m512 of = H ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sz + gs + 16)))
                                : _mm512_loadu_ps((const float*)sz + gs + 16);
            _Pragma("GCC unroll 4") for (int r = 0; r < MR; r++)
                t[r] = _mm512_fmadd_ps(of, _mm512_set1_ps(xh[r * ng + g]), t[r]);
        }
    }
    halves(MR, t, h2);
    store_tile(MR, h2, 0, y, ys, b, nc, accumulate);
}
#define BLOCK_I4A8(MR, H, ...) block4a8_512(MR, 1, H, __VA_ARGS__)
#define BLOCK_I4P2(MR, H, ...) block4a8_512(MR, 2, H, __VA_ARGS__)
#define BLOCK_I4P3(MR, H, ...) block4a8_512(MR, 3, H, __VA_ARGS__)
#endif
#else
#define BLOCK_I8(MR, ...) block(MR, KIND_I8, __VA_ARGS__)
#define BLOCK_I4 block4
#endif /* INFERQ_HAVE_AVX512 */
#ifndef BLOCK_I4A8
#define A8_ISA 1
#define BLOCK_I4A8 block4a8
#endif

/* Which tile multiplies int4 panels by int8 activations in this build: 1 block4a8 (AVX2), 3 block4a8_512
   (AVX512-VNNI + VBMI; INFERQ_NO_VNNI or INFERQ_NO_AVX512 leave it out, for tests and timings). */
int qgemm_a8_isa(void) { return A8_ISA; }

/* How many int8 pieces of x int4 panels times float activations run as, on the integer tile (FMT_I4P; 0: the
   float tile): in builds with block4a8_512, at the direct tiles' row counts, where the activation blocks fit the
   groups (the rule bad_args applies to FMT_I4A8). Why: block4_512 widens each code to a float lane and
   multiplies it alone (2 shuffles, a shift, a conversion and an FMA per 16 codes), which holds its one-row tile
   well below the read bandwidth on Zen 4; the pieces cost block4a8_512's 5 ops per 128 codes and 2 vpdpbusd per
   piece and row. Measured on a Zen 4 (SmolLM2's shapes, the float tile's time over three pieces', alternated):
   1.09-1.30 at one row; 0.96-1.19 at 2-12 rows, the larger shapes gaining most (gate_up 1.11-1.19, o
   0.96-1.12). Two pieces, not three (quant_pieces says what each count keeps of x): the fused int4 step 1.025x
   and 1.050x (Zen 4, the two builds swapped every 2 steps in one engine), and a teacher-forced decode of the
   license texts (768 positions, one token a step) as far from float32 with either count or the float tile (KL
   1.5388e-3, 1.5363e-3, 1.5373e-3): int4's own rounding of the weights (2^-4) is far coarser. The count
   built in is INFERQ_INT4_PIECES (2 or 3); qgemm_set_int4_pieces changes it (0 turns the pieces off: tests,
   timings). */
#ifndef INFERQ_INT4_PIECES
#define INFERQ_INT4_PIECES 2
#endif
#if INFERQ_INT4_PIECES != 2 && INFERQ_INT4_PIECES != 3
#error "INFERQ_INT4_PIECES is 2 or 3"
#endif
static int int4_pieces = INFERQ_INT4_PIECES;
void qgemm_set_int4_pieces(int n) { int4_pieces = n == 2 || n == 3 ? n : n ? INFERQ_INT4_PIECES : 0; }
int qgemm_int4_pieces(void) {
#ifdef BLOCK_I4P3
    return int4_pieces;
#else
    return 0;
#endif
}
static int use_pieces(int M, int K, int G) {
    return qgemm_int4_pieces() && M <= widen_rows[FMT_I4] && K % QB == 0 && (G % QB == 0 || QB % G == 0);
}

/* the row count is a compile-time constant inside each block (always_inline), hence one case per count */
static void tile_f32(int mr, const float* x, int64_t xs, const float* w, int K, float* y, int64_t ys,
                     const float* b, int nc, int acc) {
    switch (mr) {
        case 1: block(1, KIND_F32, x, xs, w, K, 0, y, ys, b, nc, acc, 0); break;
        case 2: block(2, KIND_F32, x, xs, w, K, 0, y, ys, b, nc, acc, 0); break;
        case 3: block(3, KIND_F32, x, xs, w, K, 0, y, ys, b, nc, acc, 0); break;
        case 4: block(4, KIND_F32, x, xs, w, K, 0, y, ys, b, nc, acc, 0); break;
        case 5: block(5, KIND_F32, x, xs, w, K, 0, y, ys, b, nc, acc, 0); break;
        default: block(6, KIND_F32, x, xs, w, K, 0, y, ys, b, nc, acc, 0); break;
    }
}

static void tile_i8(int mr, const float* x, int64_t xs, const int8_t* w, int K, const float* scale, float* y,
                    int64_t ys, const float* b, int nc, int acc, const char* pf) {
    switch (mr) {
        case 1: BLOCK_I8(1, x, xs, w, K, scale, y, ys, b, nc, acc, pf); break;
        case 2: BLOCK_I8(2, x, xs, w, K, scale, y, ys, b, nc, acc, pf); break;
        case 3: BLOCK_I8(3, x, xs, w, K, scale, y, ys, b, nc, acc, pf); break;
        case 4: BLOCK_I8(4, x, xs, w, K, scale, y, ys, b, nc, acc, pf); break;
        case 5: BLOCK_I8(5, x, xs, w, K, scale, y, ys, b, nc, acc, pf); break;
        default: BLOCK_I8(6, x, xs, w, K, scale, y, ys, b, nc, acc, pf); break;
    }
}

/* int4 tiles: one case per row count and scale width (H: float16), each a specialised instance */
#define I4_ROWS(BLOCK, H, ...)                              \
    switch (mr) {                                          \
        case 1: BLOCK(1, H, __VA_ARGS__); break;           \
        case 2: BLOCK(2, H, __VA_ARGS__); break;           \
        case 3: BLOCK(3, H, __VA_ARGS__); break;           \
        default: BLOCK(4, H, __VA_ARGS__); break;          \
    }

static void tile_i4(int mr, int half, const float* x, int64_t xs, const uint8_t* w, const void* sz, int G, int K,
                    const float* xg, int ng, float* y, int64_t ys, const float* b, int nc, int acc,
                    const uint8_t* pf) {
    if (half)
        I4_ROWS(BLOCK_I4, 1, x, xs, w, sz, G, K, xg, ng, y, ys, b, nc, acc, pf)
    else
        I4_ROWS(BLOCK_I4, 0, x, xs, w, sz, G, K, xg, ng, y, ys, b, nc, acc, pf)
}

static void tile_i4a8(int pc, int mr, int half, const int8_t* xq, int64_t xqs, const float* xd, int64_t xds,
                      const float* xh, int ng, const uint8_t* w, const void* sz, int G, int K, float* y, int64_t ys,
                      const float* b, int nc, int acc, const uint8_t* pf) {
#define I4A8_TILE(BLOCK)                                                              \
    if (half)                                                                         \
        I4_ROWS(BLOCK, 1, xq, xqs, xd, xds, xh, ng, w, sz, G, K, y, ys, b, nc, acc, pf) \
    else                                                                              \
        I4_ROWS(BLOCK, 0, xq, xqs, xd, xds, xh, ng, w, sz, G, K, y, ys, b, nc, acc, pf)
#ifdef BLOCK_I4P3
    if (pc == 3) {
        I4A8_TILE(BLOCK_I4P3)
        return;
    }
    if (pc == 2) {
        I4A8_TILE(BLOCK_I4P2)
        return;
    }
#endif
    (void)pc;
    I4A8_TILE(BLOCK_I4A8)
#undef I4A8_TILE
}

/* Panel p's rows k0 .. k0 + kn widened to float32 weights in dst [kn, 16]; the same rows of the next panel
   (pf, its codes) prefetched. */
static void widen(int fmt, int half, const void* codes, const void* sv, int G, int K, int k0, int kn, float* dst,
                  const char* pf) {
    if (fmt == FMT_I8) {
        const int8_t* w = (const int8_t*)codes;
        const float* s = (const float*)sv;
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        for (int k = 0; k < kn; k++) {
            if (pf && !(k & 3)) _mm_prefetch(pf + (int64_t)(k0 + k) * PANEL, _MM_HINT_T0);
            __m256 w0, w1;
            load_row(KIND_I8, w, k0 + k, &w0, &w1);
            _mm256_storeu_ps(dst + k * PANEL, _mm256_mul_ps(w0, s0));
            _mm256_storeu_ps(dst + k * PANEL + 8, _mm256_mul_ps(w1, s1));
        }
        return;
    }
    (void)K;
    const uint8_t* w = (const uint8_t*)codes;
    for (int j = k0 / 2; j < (k0 + kn) / 2; j++) {
        if (pf && !(j & 3)) _mm_prefetch(pf + (int64_t)j * PANEL, _MM_HINT_T0);
        const int64_t gs = (int64_t)(2 * j / G) * 2 * PANEL;
        const __m256 s0 = half ? load_sz(1, sv, gs) : load_sz(0, sv, gs);
        const __m256 s1 = half ? load_sz(1, sv, gs + 8) : load_sz(0, sv, gs + 8);
        const __m256 o0 = half ? load_sz(1, sv, gs + 16) : load_sz(0, sv, gs + 16);
        const __m256 o1 = half ? load_sz(1, sv, gs + 24) : load_sz(0, sv, gs + 24);
        __m256 lo0, lo1, hi0, hi1;
        load_pair(w, j, &lo0, &lo1, &hi0, &hi1);
        float* d = dst + (int64_t)(2 * j - k0) * PANEL;
        _mm256_storeu_ps(d, _mm256_fmadd_ps(lo0, s0, o0));
        _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(lo1, s1, o1));
        _mm256_storeu_ps(d + 16, _mm256_fmadd_ps(hi0, s0, o0));
        _mm256_storeu_ps(d + 24, _mm256_fmadd_ps(hi1, s1, o1));
    }
}

/* Bytes of one panel's codes, and elements of its scales (int8: 16; int4: its K/G groups' scales and offsets,
   float32 or float16). */
static int64_t panel_code_bytes(int fmt, int K) { return fmt == FMT_I8 ? (int64_t)K * PANEL : (int64_t)K / 2 * PANEL; }
static int64_t panel_scale_elems(int fmt, int K, int G) { return fmt == FMT_I8 ? PANEL : (int64_t)K / G * 2 * PANEL; }

/* Rows per row block: their x rows (about X_BLOCK_BYTES of k_len inputs each) stay in L2 while every panel of the
   thread's share passes over them; without blocks each panel re-read all M rows of x from L3 (packed_gemm.c). */
static int row_block(int M, int k_len) {
    int mb = (int)(X_BLOCK_BYTES / ((int64_t)k_len * 4)) / 12 * 12;
    if (mb < 24) mb = 24;
    return M <= 2 * mb ? M : mb;
}

/* x's rows quantised for FMT_I4A8 (quant_rows) or FMT_I4P (quant_pieces): codes [M, pieces, K], block scales
   [M, K/32], and per group the sum of the de-quantised activations [M, K/G] (the offsets' term). */
typedef struct {
    const int8_t* q;
    const float* d;
    const float* h;
    int pieces; /* of each row: 1 (FMT_I4A8), or 2 or 3 (FMT_I4P) */
} act8;

/* Codes widened in registers by every row tile: near-equal tiles of at most 6 (int8) or 4 (int4) rows; the
   first tile of a panel prefetches the next. xg: the rows' group sums of x (int4); xa: the rows quantised
   (int4 times int8 activations). */
static void share_direct(int fmt, int half, const float* x, int64_t xs, const void* wp, const void* s, int G,
                         const float* xg, const act8* xa, const float* b, float* y, int64_t ys, int M, int N, int K,
                         int accumulate) {
    const int np = (N + PANEL - 1) / PANEL, ng = fmt == FMT_I8 ? 0 : K / G, mb = row_block(M, K);
    const int64_t pb = panel_code_bytes(fmt, K), ps = panel_scale_elems(fmt, K, G) * (half ? 2 : 4);
    const int tile_rows = fmt == FMT_I8 ? 6 : 4, pc = xa ? xa->pieces : 1; /* int8 pieces of a row */
    for (int r0 = 0; r0 < M; r0 += mb) {
        const int rows = M - r0 < mb ? M - r0 : mb, tiles = (rows + tile_rows - 1) / tile_rows;
        /* blocks need no barrier: each writes its own rows of y */
        PANEL_SHARE
        for (int p = 0; p < np; p++) {
            const char* w = (const char*)wp + (int64_t)p * pb;
            const void* sp = (const char*)s + (int64_t)p * ps;
            const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
            int m0 = r0;
            for (int t = 0; t < tiles; t++) {
                const int mr = (r0 + rows - m0) / (tiles - t) + (((r0 + rows - m0) % (tiles - t)) ? 1 : 0);
                const char* next = (t == 0 && p + 1 < np) ? w + pb : 0;
                if (fmt == FMT_I8)
                    tile_i8(mr, x + m0 * xs, xs, (const int8_t*)w, K, (const float*)sp, y + m0 * ys + n0, ys, b ? b + n0 : 0, nc,
                            accumulate, next);
                else if (fmt == FMT_I4A8 || fmt == FMT_I4P)
                    tile_i4a8(pc, mr, half, xa->q + (int64_t)m0 * K * pc, K * pc, xa->d + (int64_t)m0 * (K / QB),
                              K / QB, xa->h + (int64_t)m0 * ng, ng, (const uint8_t*)w, sp, G, K, y + m0 * ys + n0,
                              ys, b ? b + n0 : 0, nc, accumulate, (const uint8_t*)next);
                else
                    tile_i4(mr, half, x + m0 * xs, xs, (const uint8_t*)w, sp, G, K, xg + (int64_t)m0 * ng, ng,
                            y + m0 * ys + n0, ys, b ? b + n0 : 0, nc, accumulate, (const uint8_t*)next);
                m0 += mr;
            }
        }
    }
}

/* Prefill sizes: per row block (its x rows L2 resident, as in packed_gemm.c), each panel is widened K-block by
   K-block into scratch and every row tile runs the float micro-kernel over it, accumulating over the K-blocks
   (the bias added by the first). */
static void share_widened(int fmt, int half, const float* x, int64_t xs, const void* wp, const void* s, int G,
                          const float* b, float* y, int64_t ys, int M, int N, int K, int accumulate) {
    float scratch[KBLOCK * PANEL] __attribute__((aligned(64)));
    const int np = (N + PANEL - 1) / PANEL;
    const int64_t pb = panel_code_bytes(fmt, K), ps = panel_scale_elems(fmt, K, G) * (half ? 2 : 4);
    const int mb = row_block(M, K < KBLOCK ? K : KBLOCK);
    for (int r0 = 0; r0 < M; r0 += mb) {
        const int rows = M - r0 < mb ? M - r0 : mb, tiles = (rows + 5) / 6;
        PANEL_SHARE
        for (int p = 0; p < np; p++) {
            const char* w = (const char*)wp + (int64_t)p * pb;
            const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
            for (int k0 = 0; k0 < K; k0 += KBLOCK) {
                const int kn = K - k0 < KBLOCK ? K - k0 : KBLOCK;
                widen(fmt, half, w, (const char*)s + (int64_t)p * ps, G, K, k0, kn, scratch, p + 1 < np ? w + pb : 0);
                int m0 = r0;
                for (int t = 0; t < tiles; t++) {
                    const int mr = (r0 + rows - m0) / (tiles - t) + (((r0 + rows - m0) % (tiles - t)) ? 1 : 0);
                    tile_f32(mr, x + m0 * xs + k0, xs, scratch, kn, y + m0 * ys + n0, ys,
                             (b && k0 == 0) ? b + n0 : 0, nc, accumulate || k0 > 0);
                    m0 += mr;
                }
            }
        }
    }
}

/* The group sums of x's rows (int4's second term), computed by the calling thread into xg [M, K/G]. */
static void group_sums(const float* x, int64_t xs, int M, int K, int G, float* xg) {
    const int ng = K / G;
    for (int r = 0; r < M; r++)
        for (int g = 0; g < ng; g++) {
            __m256 a = _mm256_setzero_ps();
            const float* xr = x + r * xs + (int64_t)g * G;
            for (int k = 0; k < G; k += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(xr + k));
            xg[(int64_t)r * ng + g] = hsum8(a);
        }
}

/* x's M rows quantised for FMT_I4A8 into xa's arrays (act8). The group sums of the de-quantised rows are summed
   per fold of min(G, 32) inputs (a block's codes summed exactly in int32 lanes of 4, then times its scale), in
   the order the tiles fold. */
static void quant_rows(const float* x, int64_t xs, int M, int K, int G, int8_t* q, float* d, float* h) {
    const int nb = K / QB, ng = K / G, F = G < QB ? G : QB;
    for (int r = 0; r < M; r++) {
        float* hr = h + (int64_t)r * ng;
        for (int g = 0; g < ng; g++) hr[g] = 0.f;
        for (int bk = 0; bk < nb; bk++) {
            float* db = d + (int64_t)r * nb + bk;
            const __m256i p = quant_block32(x + r * xs + bk * QB, db);
            _mm256_storeu_si256((__m256i*)(q + (int64_t)r * K + bk * QB), p);
            int32_t quads[8]; /* sums of 4 codes each */
            _mm256_storeu_si256((__m256i*)quads, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p),
                                                                   _mm256_set1_epi16(1)));
            for (int f = 0; f < QB; f += F) {
                int32_t sum = 0;
                for (int i = f / 4; i < (f + F) / 4; i++) sum += quads[i];
                hr[(bk * QB + f) / G] += *db * (float)sum;
            }
        }
    }
}

/* x's M rows as P = 2 or 3 int8 pieces per block of 32 (FMT_I4P): with d = max |x| / 127 and t = x / d,
   q1 = rint(t), q2 = rint(128 (t - q1)), q3 = rint(128 (128 (t - q1) - q2)). Each difference and scaling is
   exact in float32, so x' = d (q1 + q2 / 128) is x within d / 256 (2^-15 of the block's largest |x|, where
   int4's own rounding of the weight is 2^-4 of its group's range) and x' = d (q1 + q2 / 128 + q3 / 16384)
   within d / 32768 (2^-22: below float32's rounding of the sums the tile forms); |q1| <= 127, |q2|, |q3| <= 64
   (block4a8_512 says what that bounds). Row r's piece c at q + P K r + K c; d holds d / 128^(P - 1), the unit of
   the pieces' combined sum; h the group sums of x' (not of x: the offsets' term must see the activations the
   codes' term sees, or a group whose scales and offsets nearly cancel, as an outlier weight's does, loses that
   cancellation), per fold as quant_rows sums them. */
static void quant_pieces(const float* x, int64_t xs, int M, int K, int G, int P, int8_t* q, float* d, float* h) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), up = _mm256_set1_ps(128.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* the packs interleave 128-bit lanes */
    const int ng = K / G, F = G < QB ? G : QB;
    const float unit = P == 3 ? 16384.f : 128.f;
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < ng; g++) h[(int64_t)r * ng + g] = 0.f;
        for (int bk = 0; bk < K / QB; bk++) {
            const float* xb = x + r * xs + bk * QB;
            int8_t* qb = q + (int64_t)r * P * K + bk * QB;
            __m256 t[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                t[i] = _mm256_loadu_ps(xb + 8 * i);
                m = _mm256_max_ps(m, _mm256_and_ps(t[i], absmask));
            }
            const float dd = _mm256_cvtss_f32(hmax8(m)) / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
            d[(int64_t)r * (K / QB) + bk] = dd / unit;
            __m256i u[4]; /* x' / (d / unit), exact: |u| < 2^21 */
            for (int c = 0; c < P; c++) {
                __m256i n[4];
                for (int i = 0; i < 4; i++) {
                    if (!c) t[i] = _mm256_mul_ps(t[i], _mm256_set1_ps(id));
                    const __m256 f = _mm256_round_ps(t[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    n[i] = _mm256_cvtps_epi32(f);
                    u[i] = c ? _mm256_add_epi32(_mm256_slli_epi32(u[i], 7), n[i]) : n[i];
                    t[i] = _mm256_mul_ps(_mm256_sub_ps(t[i], f), up);
                }
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
                _mm256_storeu_si256((__m256i*)(qb + (int64_t)c * K), _mm256_permutevar8x32_epi32(p, order));
            }
            for (int f = 0; f < QB; f += F) { /* F is 8, 16 or 32: whole vectors */
                __m256i sum = u[f / 8];
                for (int i = f / 8 + 1; i < (f + F) / 8; i++) sum = _mm256_add_epi32(sum, u[i]);
                int32_t lanes[8], total = 0;
                _mm256_storeu_si256((__m256i*)lanes, sum);
                for (int e = 0; e < 8; e++) total += lanes[e];
                h[(int64_t)r * ng + (bk * QB + f) / G] += dd / unit * (float)total;
            }
        }
    }
}

/* Whether the arguments describe a product these kernels run: int8, or int4 with an even group size (every
   int4 group size of kernels/quant.py is one) that divides K, and a K-block a multiple of it; int4 times int8
   activations also K a multiple of 32, and groups a multiple or a divisor of 32 (then each fold is in one
   activation block). */
static int bad_args(int fmt, int K, int G) {
    if (fmt & FMT_HALF) fmt &= ~FMT_HALF;
    else if (fmt == FMT_I8) return 0;
    if (fmt == FMT_I4A8 && (K % QB || (G > 0 && G % QB && QB % G))) return 1;
    return (fmt != FMT_I4 && fmt != FMT_I4A8) || G <= 0 || G % 8 || K % G || KBLOCK % G;
}

/* int4 panels times activations in int8 blocks (FMT_I4A8: one piece; FMT_I4P: float activations as two or
   three pieces), by the integer tiles: a row's result does not depend on its batch. */
static int act8_product(int fmt, int half, const float* x, int64_t xs, const void* wp, const void* s, int G,
                        const float* b, float* y, int64_t ys, int M, int N, int K, int accumulate) {
    const int pc = fmt == FMT_I4P ? int4_pieces : 1;
    const int64_t qbytes = (int64_t)M * K * pc, nf = (int64_t)M * (K / QB + K / G);
    const int64_t bytes = qbytes + nf * (int64_t)sizeof(float);
    _Alignas(64) char stack[A8_STACK];
    char* heap = bytes <= A8_STACK ? 0 : (char*)malloc(bytes);
    if (bytes > A8_STACK && !heap) return 1;
    char* buf = heap ? heap : stack;
    int8_t* q = (int8_t*)(buf + nf * (int64_t)sizeof(float));
    float* d = (float*)buf;
    float* h = d + (int64_t)M * (K / QB);
    if (pc == 1) {
        quant_rows(x, xs, M, K, G, q, d, h);
    } else {
        quant_pieces(x, xs, M, K, G, pc, q, d, h);
    }
    const act8 xa = {q, d, h, pc};
    share_direct(fmt, half, x, xs, wp, s, G, 0, &xa, b, y, ys, M, N, K, accumulate);
    free(heap);
    return 0;
}

/* The product for the thread team of an enclosing parallel region (decode_step.c's pattern): each thread takes
   its share of the panels (PANEL_SHARE) and returns without a barrier (the caller places one before y is read);
   int4's group sums of x are computed by each thread for itself, as nothing here may synchronise. Called outside a
   parallel region, one thread does it all. fmt 0: int8 (s = scale [Npad]); 1: int4 (s = sz, G its group size);
   2: int4 times int8 activations; either int4 format or'd with FMT_HALF: sz in float16.
   Returns 1 (nothing done) for arguments no kernel here takes. */
int qgemm_team(int fmt, const float* x, int64_t xs, const void* wp, const void* s, int G, const float* b,
               float* y, int64_t ys, int M, int N, int K, int accumulate) {
    if (bad_args(fmt, K, G)) return 1;
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    const int half = fmt & FMT_HALF ? 1 : 0;
    fmt &= ~FMT_HALF;
    if (fmt == FMT_I4A8 || (fmt == FMT_I4 && use_pieces(M, K, G)))
        return act8_product(fmt == FMT_I4 ? FMT_I4P : fmt, half, x, xs, wp, s, G, b, y, ys, M, N, K, accumulate);
    if (M > widen_rows[fmt]) {
        share_widened(fmt, half, x, xs, wp, s, G, b, y, ys, M, N, K, accumulate);
        return 0;
    }
    if (fmt == FMT_I8) {
        share_direct(fmt, 0, x, xs, wp, s, G, 0, 0, b, y, ys, M, N, K, accumulate);
        return 0;
    }
    const int64_t n = (int64_t)M * (K / G);
    float stack[XSUM_STACK];
    float* heap = n <= XSUM_STACK ? 0 : (float*)malloc(n * sizeof(float));
    if (n > XSUM_STACK && !heap) return 1;
    float* xg = heap ? heap : stack;
    group_sums(x, xs, M, K, G, xg);
    share_direct(fmt, half, x, xs, wp, s, G, xg, 0, b, y, ys, M, N, K, accumulate);
    free(heap);
    return 0;
}

/* The same product in a parallel region of its own (torch's OpenMP threads). */
int qgemm(int fmt, const float* x, int64_t xs, const void* wp, const void* s, int G, const float* b, float* y,
          int64_t ys, int M, int N, int K, int accumulate) {
    if (bad_args(fmt, K, G)) return 1;
    int err = 0;
    #pragma omp parallel reduction(| : err)
    err |= qgemm_team(fmt, x, xs, wp, s, G, b, y, ys, M, N, K, accumulate);
    return err;
}

#endif /* INFERQ_HAVE_AVX2 */
