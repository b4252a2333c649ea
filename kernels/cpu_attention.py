"""Small C kernels for attention straight from the paged KV cache (CPU): batched decode, and causal prefill.

Prefill (AVX2 path, float32 queries): every prefill chunk of a step in one call, its keys and values read
from the cache (already written, so a chunk with earlier context needs no gather), work items of one kv head
x 8 query rows, an online softmax over key chunks of 8, and the weighted V sum register-blocked so each V
load feeds three query vectors. Against per-sequence SDPA on the mixed workload's shapes: 1.06-1.19x on
long chunks (300-512 rows), 2.3x on eight 64-row chunks; the workload's prefill steps 46.4 -> 42.8 s.

Why: on CPU, decode attention is memory bound. The torch path must first gather every decode sequence's
blocks into a padded ``[S, L, Hkv, D]`` copy (read + write of all the context, padded to the longest
sequence) and then run SDPA over the copy (a third pass). On the mixed benchmark workload that gather plus
SDPA was ~40% of the engine's time. This kernel reads each sequence's K and V once, block by block, where
they lie in the cache: per (sequence, kv head) it computes the scores of the ``Hq / Hkv`` query heads of
that kv head (one pass over K), a float32 softmax, and the weighted sum of V (one pass over V), in float32
whatever the cache dtype (float32 or bfloat16). Work items are spread over torch's own OpenMP thread pool
(the library links ``libgomp.so.1``, which resolves to the copy torch already loaded).

Two code paths: portable scalar loops (any head dim and block size; the compiler vectorises the inner
loops as it can), and, where the CPU has AVX2 + FMA (every x86 server CPU of the last decade, AVX-512 ones
included), a vector path for head dims that are multiples of 8 up to 128 and power-of-two block sizes:
scores for 8 positions at once (a transpose-add turns 8 dot-product vectors into one vector of scores), a
polynomial exp, and the weighted V sum kept in registers. On the mixed benchmark's decode steps the vector
path is ~2.7x faster than the scalar one (one layer, 64 sequences x ~400 positions: 9.9 -> 3.7 ms). AVX2 rather than AVX-512: it runs, and is
tested, on every machine this project meets (the AMD EPYC CI machines have no AVX-512).

The C source is compiled once per machine by :mod:`kernels.native` (``cc -O3 -march=native``, cached, loaded
with ctypes). If no compiler is available or the build fails, :func:`load` returns None and the torch
backend keeps its pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from kernels import native

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define MAX_GROUP 16
#define MAX_ND 16
#define MAX_HEADS 64 /* query heads per work item of the vector path */

static int use_avx512 = 1; /* the AVX-512 decode item where compiled in; set_avx512(0) for tests and A/B runs */
void set_avx512(int on) { use_avx512 = on; }
#if defined(__AVX512F__)
int has_avx512(void) { return 1; }
#else
int has_avx512(void) { return 0; }
#endif

static inline float bf16_load(const uint16_t* p, int64_t i) {
    uint32_t u = ((uint32_t)p[i]) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* One (sequence, kv head) work item: G query heads against the sequence's first `len` cached positions.
   T is the cache element type; LOAD(ptr, i) reads element i of a cache row as float. */
#define DEFINE_DECODE(NAME, T, LOAD)                                                                       \
static void NAME##_item(const float* q, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,  \
                        int64_t c_hs, const int32_t* bt, int len, int G, int D, int bs, float scale,         \
                        float* out, int64_t o_hs, float* sc, float* acc) {                                  \
    const int nblk = (len + bs - 1) / bs;                                                                   \
    float m[MAX_GROUP];                                                                                     \
    for (int g = 0; g < G; g++) m[g] = -INFINITY;                                                           \
    for (int b = 0; b < nblk; b++) {                                                                        \
        const int64_t base = (int64_t)bt[b] * c_bs;                                                         \
        const int n = (b == nblk - 1) ? len - b * bs : bs;                                                  \
        for (int t = 0; t < n; t++) {                                                                       \
            const T* k = kc + base + (int64_t)t * c_ts;                                                     \
            const int p = b * bs + t;                                                                       \
            for (int g = 0; g < G; g++) {                                                                   \
                const float* qg = q + (int64_t)g * q_hs;                                                    \
                float s = 0.f;                                                                              \
                _Pragma("omp simd reduction(+:s)")                                                          \
                for (int d = 0; d < D; d++) s += qg[d] * LOAD(k, d);                                        \
                s *= scale;                                                                                 \
                sc[(int64_t)g * len + p] = s;                                                               \
                if (s > m[g]) m[g] = s;                                                                     \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    float sum[MAX_GROUP];                                                                                   \
    for (int g = 0; g < G; g++) {                                                                           \
        float* row = sc + (int64_t)g * len;                                                                 \
        float z = 0.f;                                                                                      \
        const float mg = m[g];                                                                              \
        for (int p = 0; p < len; p++) { const float e = expf(row[p] - mg); row[p] = e; z += e; }            \
        sum[g] = z;                                                                                         \
    }                                                                                                       \
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);                                                  \
    for (int b = 0; b < nblk; b++) {                                                                        \
        const int64_t base = (int64_t)bt[b] * c_bs;                                                         \
        const int n = (b == nblk - 1) ? len - b * bs : bs;                                                  \
        for (int t = 0; t < n; t++) {                                                                       \
            const T* v = vc + base + (int64_t)t * c_ts;                                                     \
            const int p = b * bs + t;                                                                       \
            for (int g = 0; g < G; g++) {                                                                   \
                const float w = sc[(int64_t)g * len + p];                                                   \
                float* a = acc + (int64_t)g * D;                                                            \
                _Pragma("omp simd")                                                                         \
                for (int d = 0; d < D; d++) a[d] += w * LOAD(v, d);                                         \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    for (int g = 0; g < G; g++) {                                                                           \
        const float inv = 1.f / sum[g];                                                                     \
        float* o = out + (int64_t)g * o_hs;                                                                 \
        const float* a = acc + (int64_t)g * D;                                                              \
        for (int d = 0; d < D; d++) o[d] = a[d] * inv;                                                      \
    }                                                                                                       \
}                                                                                                           \
                                                                                                            \
int NAME(const float* q, int64_t q_ss, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,  \
         int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* lens, float* out, int64_t o_ss,      \
         int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale, int max_len) {                    \
    const int G = Hq / Hkv;                                                                                 \
    if (G > MAX_GROUP || G * Hkv != Hq) return 1;                                                           \
    int err = 0;                                                                                            \
    _Pragma("omp parallel")                                                                                 \
    {                                                                                                       \
        float* sc = (float*)malloc(sizeof(float) * (size_t)G * (size_t)(max_len > 0 ? max_len : 1));        \
        float* acc = (float*)malloc(sizeof(float) * (size_t)G * (size_t)D);                                 \
        if (!sc || !acc) {                                                                                  \
            _Pragma("omp atomic write")                                                                     \
            err = 2;                                                                                        \
        }                                                                                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                             \
        for (int64_t i = 0; i < (int64_t)S * Hkv; i++) {                                                    \
            if (!sc || !acc) continue;                                                                      \
            const int s = (int)(i / Hkv), h = (int)(i % Hkv);                                               \
            const int len = lens[s];                                                                        \
            if (len <= 0) continue;                                                                         \
            NAME##_item(q + s * q_ss + (int64_t)h * G * q_hs, q_hs, kc + h * c_hs, vc + h * c_hs, c_bs,     \
                        c_ts, c_hs, bt + s * bt_ss, len, G, D, bs, scale,                                   \
                        out + s * o_ss + (int64_t)h * G * o_hs, o_hs, sc, acc);                             \
        }                                                                                                   \
        free(sc);                                                                                           \
        free(acc);                                                                                          \
    }                                                                                                       \
    return err;                                                                                             \
}

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_load((p), (i))
DEFINE_DECODE(generic_f32, float, LOAD_F32)
DEFINE_DECODE(generic_bf16, uint16_t, LOAD_BF16)

#undef DEFINE_DECODE

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) for x <= 0 (scores minus their max), float32, ~2 ulp: x = n ln2 + r with |r| <= ln2/2, a degree-6
   polynomial for e^r, and 2^n built in the exponent bits (x is clamped at -87 so 2^n stays normal; the
   result there is ~1e-38, as good as 0 next to the max's weight of 1). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 vectors -> one vector whose lane t is the sum of the lanes of a[t]. */
static inline __m256 transpose_sum8(const __m256* a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline __m256 ld_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* the max of v's lanes, in every lane */
static inline __m256 hmax8(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 0x01));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
}
static inline float hsum8(__m256 v) {
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x01));
    v = _mm256_hadd_ps(v, v);
    return _mm256_cvtss_f32(_mm256_hadd_ps(v, v));
}

/* Scores -> unnormalised softmax weights, in place: nh rows of lpad scores (lpad apart), row j against the max of
   the lanes of mx[j]; inv[j] = 1 / the row's sum. */
static void softmax_rows(float* sc, int nh, int lpad, const __m256* mx, float* inv) {
    for (int j = 0; j < nh; j++) {
        const __m256 m = hmax8(mx[j]);
        float* row = sc + (int64_t)j * lpad;
        __m256 z = _mm256_setzero_ps();
        for (int i = 0; i < lpad; i += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + i), m));
            _mm256_storeu_ps(row + i, e);
            z = _mm256_add_ps(z, e);
        }
        inv[j] = 1.0f / hsum8(z);
    }
}

/* q . k for the 8 cache rows at roff[0..7] (one kv head's D = 8 * ND values each): 8 independent FMA chains,
   one per position, summed across lanes into one vector of 8 scores */
#define DEFINE_DOT8(T, LD)                                                                                    \
static inline __m256 LD##_dot8(const float* q, const T* k0, const int64_t* roff, int ND) {                    \
    __m256 a[8];                                                                                              \
    for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();                                                   \
    for (int c = 0; c < ND; c++) {                                                                            \
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);                                                         \
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qc, LD(k0 + roff[t] + 8 * c), a[t]);               \
    }                                                                                                         \
    return transpose_sum8(a);                                                                                 \
}
DEFINE_DOT8(float, ld_f32)
DEFINE_DOT8(uint16_t, ld_bf16)

/* Software prefetch of the 8 rows (all kv heads) of positions p0..p0+7: the blocks are scattered, so the
   hardware prefetcher cannot run ahead across them; PF_CHUNKS chunks ahead keeps enough loads in flight
   (measured: 5-10% faster on the mixed workload's decode batches). */
#define PF_CHUNKS 4
static inline void prefetch_rows(const void* base, int64_t c_bs, int64_t c_ts, const int32_t* bt, int p0, int len,
                                 int sh, int msk, int row_bytes) {
    const int es = row_bytes / (int)c_ts; /* element size */
    for (int t = 0; t < 8 && p0 + t < len; t++) {
        const int p = p0 + t;
        const char* r = (const char*)base + ((int64_t)bt[p >> sh] * c_bs + (int64_t)(p & msk) * c_ts) * es;
        for (int l = 0; l < row_bytes; l += 64) _mm_prefetch(r + l, _MM_HINT_T0);
    }
}

#if defined(__AVX512F__)
/* The AVX-512 form of a decode work item, for head dims that are multiples of 16 (one zmm per 16 values).
   Scores: the K row of each position is loaded once per kv head and feeds all of its query heads (up to 3 at a
   time: 24 accumulators, 8 positions x 3 heads), folded to 8 lanes and summed across by transpose_sum8. The
   V sum: 3 query heads x 4 zmm of D per pass. Prefetches for the rows PF_CHUNKS chunks ahead are issued one
   line per load, spread through the work instead of in a burst. Same passes and results as the AVX2 item. */
static inline __m512 ld_f32_512(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 ld_bf16_512(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m256 fold512(__m512 v) { /* the sum of the two 256-bit halves */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
/* The cache-row offsets of chunk b's 8 positions (past len, in the last chunk: row 0 again, masked or skipped by
   the caller), and, where chunk b + PF_CHUNKS exists, of its rows for prefetching (clamped to len); returns
   whether it exists. */
static inline int chunk_rows(const int32_t* bt, int64_t c_bs, int64_t c_ts, int sh, int msk, int len, int nch,
                             int b, int64_t* roff, int64_t* pfoff) {
    const int n = (b == nch - 1) ? len - b * 8 : 8, pb = b + PF_CHUNKS;
    for (int t = 0; t < 8; t++) {
        const int p = b * 8 + (t < n ? t : 0);
        roff[t] = (int64_t)bt[p >> sh] * c_bs + (int64_t)(p & msk) * c_ts;
        if (pb < nch) {
            const int pp = pb * 8 + t < len ? pb * 8 + t : len - 1;
            pfoff[t] = (int64_t)bt[pp >> sh] * c_bs + (int64_t)(pp & msk) * c_ts;
        }
    }
    return pb < nch;
}
#define DEFINE_ITEM512(NAME, T, LD)                                                                           \
static inline __attribute__((always_inline)) void NAME##_kdot(const int NG, const float* q, int64_t q_hs,      \
        const T* k0, const int64_t* roff, const T* pf0, const int64_t* pfoff, int ND16, __m256* out) {        \
    __m512 a[3][8];                                                                                           \
    _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)                                                      \
        _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) a[g][t] = _mm512_setzero_ps();                   \
    for (int c = 0; c < ND16; c++) {                                                                          \
        __m512 qv[3];                                                                                         \
        _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++) qv[g] = _mm512_loadu_ps(q + g * q_hs + 16 * c); \
        _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {                                                 \
            const __m512 kv = LD(k0 + roff[t] + 16 * c);                                                      \
            if (pf0) _mm_prefetch((const char*)(pf0 + pfoff[t] + 16 * c), _MM_HINT_T0);                       \
            _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++) a[g][t] = _mm512_fmadd_ps(qv[g], kv, a[g][t]);\
        }                                                                                                     \
    }                                                                                                         \
    _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++) {                                                    \
        __m256 f[8];                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) f[t] = fold512(a[g][t]);                          \
        out[g] = transpose_sum8(f);                                                                           \
    }                                                                                                         \
}                                                                                                             \
static inline __attribute__((always_inline)) void NAME##_vsum(const int NG, const int NC, const T* v0,         \
        const int64_t* roff, int n, const float* w, int64_t wstride, float* acc, int D, const T* pf0,         \
        const int64_t* pfoff) {                                                                               \
    __m512 r[3][4];                                                                                           \
    _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)                                                      \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) r[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c); \
    for (int t = 0; t < n; t++) {                                                                             \
        const T* v = v0 + roff[t];                                                                            \
        __m512 wt[3];                                                                                         \
        _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++) wt[g] = _mm512_set1_ps(w[g * wstride + t]);      \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) {                                                \
            const __m512 x = LD(v + 16 * c);                                                                  \
            if (pf0) _mm_prefetch((const char*)(pf0 + pfoff[t] + 16 * c), _MM_HINT_T0);                      \
            _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++) r[g][c] = _mm512_fmadd_ps(wt[g], x, r[g][c]);\
        }                                                                                                     \
    }                                                                                                         \
    _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)                                                      \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + g * D + 16 * c, r[g][c]); \
}                                                                                                             \
static void NAME##_kdotn(int ng, const float* q, int64_t q_hs, const T* k0, const int64_t* roff, const T* pf0, \
                         const int64_t* pfoff, int ND16, __m256* out) {                                       \
    if (ng == 3) NAME##_kdot(3, q, q_hs, k0, roff, pf0, pfoff, ND16, out);                                    \
    else if (ng == 2) NAME##_kdot(2, q, q_hs, k0, roff, pf0, pfoff, ND16, out);                               \
    else NAME##_kdot(1, q, q_hs, k0, roff, pf0, pfoff, ND16, out);                                            \
}                                                                                                             \
static void NAME##_vsumn(int ng, int nc, const T* v0, const int64_t* roff, int n, const float* w,              \
                         int64_t wstride, float* acc, int D, const T* pf0, const int64_t* pfoff) {             \
    switch (ng * 4 + nc) {                                                                                    \
        case 5: NAME##_vsum(1, 1, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                        \
        case 6: NAME##_vsum(1, 2, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                        \
        case 8: NAME##_vsum(1, 4, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                        \
        case 9: NAME##_vsum(2, 1, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                        \
        case 10: NAME##_vsum(2, 2, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                       \
        case 12: NAME##_vsum(2, 4, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                       \
        case 13: NAME##_vsum(3, 1, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                       \
        case 14: NAME##_vsum(3, 2, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                       \
        default: NAME##_vsum(3, 4, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;                       \
    }                                                                                                         \
}                                                                                                             \
static void NAME##_item512(const float* q, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts, \
                           int64_t c_hs, const int32_t* bt, int len, int h0, int h1, int G, int ND, int sh,    \
                           int msk, float scale, float* out, int64_t o_hs, float* sc, float* acc) {            \
    const int nch = (len + 7) / 8, lpad = nch * 8, nh = (h1 - h0) * G, ND16 = ND / 2, D = ND * 8;             \
    const int nc = ND16 % 4 == 0 ? 4 : (ND16 % 2 == 0 ? 2 : 1);                                               \
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);                            \
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                           \
    __m256 mx[MAX_HEADS];                                                                                     \
    for (int j = 0; j < nh; j++) mx[j] = ninf;                                                                \
    int64_t roff[8], pfoff[8];                                                                                \
    for (int b = 0; b < nch; b++) {                                                                           \
        const int n = (b == nch - 1) ? len - b * 8 : 8;                                                       \
        const int pf = chunk_rows(bt, c_bs, c_ts, sh, msk, len, nch, b, roff, pfoff);                         \
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));             \
        for (int h = h0; h < h1; h++) {                                                                       \
            const T* k0 = kc + (int64_t)h * c_hs;                                                             \
            for (int g0 = 0; g0 < G; g0 += 3) {                                                               \
                const int ng = G - g0 < 3 ? G - g0 : 3;                                                       \
                __m256 sv[3];                                                                                 \
                NAME##_kdotn(ng, q + (int64_t)(h * G + g0) * q_hs, q_hs, k0, roff,                            \
                             (pf && g0 == 0) ? k0 : 0, pfoff, ND16, sv);                                 \
                for (int g = 0; g < ng; g++) {                                                                \
                    const int j = (h - h0) * G + g0 + g;                                                      \
                    const __m256 r = _mm256_blendv_ps(ninf, _mm256_mul_ps(sv[g], vscale), valid);             \
                    _mm256_storeu_ps(sc + (int64_t)j * lpad + b * 8, r);                                      \
                    mx[j] = _mm256_max_ps(mx[j], r);                                                          \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    float inv[MAX_HEADS];                                                                                     \
    softmax_rows(sc, nh, lpad, mx, inv);                                                                      \
    memset(acc, 0, sizeof(float) * (size_t)nh * (size_t)D);                                                   \
    for (int b = 0; b < nch; b++) {                                                                           \
        const int n = (b == nch - 1) ? len - b * 8 : 8;                                                       \
        const int pf = chunk_rows(bt, c_bs, c_ts, sh, msk, len, nch, b, roff, pfoff);                         \
        for (int h = h0; h < h1; h++) {                                                                       \
            const T* v0 = vc + (int64_t)h * c_hs;                                                             \
            for (int g0 = 0; g0 < G; g0 += 3) {                                                               \
                const int ng = G - g0 < 3 ? G - g0 : 3;                                                       \
                const int j = (h - h0) * G + g0;                                                              \
                for (int c0 = 0; c0 < ND16; c0 += nc)                                                         \
                    NAME##_vsumn(ng, nc, v0 + 16 * c0, roff, n, sc + (int64_t)j * lpad + b * 8, lpad,         \
                                 acc + (int64_t)j * D + 16 * c0, D,                                           \
                                 (pf && g0 == 0) ? v0 + 16 * c0 : 0, pfoff);                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    for (int h = h0; h < h1; h++)                                                                             \
        for (int g = 0; g < G; g++) {                                                                         \
            const int j = (h - h0) * G + g;                                                                   \
            const __m512 s = _mm512_set1_ps(inv[j]);                                                          \
            float* o = out + (int64_t)(h * G + g) * o_hs;                                                     \
            for (int c = 0; c < ND16; c++)                                                                    \
                _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)j * D + 16 * c), s));\
        }                                                                                                     \
}
DEFINE_ITEM512(simd_f32, float, ld_f32_512)
DEFINE_ITEM512(simd_bf16, uint16_t, ld_bf16_512)
#endif

#if defined(__AVX512F__)
/* inside DEFINE_DECODE's work loop: the AVX-512 item where the head dim is a multiple of 16 */
#define DECODE_ITEM512(NAME)                                                                                  \
            if (ND % 2 == 0 && use_avx512) {                                                                  \
                NAME##_item512(q + s * q_ss, q_hs, kc, vc, c_bs, c_ts, c_hs, bt + s * bt_ss, len, h0, h0 + per,\
                               G, ND, sh, msk, scale, out + s * o_ss, o_hs, sc, acc);                          \
                continue;                                                                                     \
            }
#else
#define DECODE_ITEM512(NAME)
#endif
/* One work item: kv heads [h0, h1) of one sequence, vectorised. Position p is row p & msk of block
   bt[p >> sh]; a row holds every kv head (Hkv x D contiguous), so walking positions in chunks of 8 and
   heads inside streams each block once, front to back (per-head items would read 1/Hkv of each row at a
   stride, which the hardware prefetcher serves poorly: measured 1.5-2x slower). Pass 1 writes the scores
   (scaled, -inf past len), pass 2 turns them into unnormalised softmax weights, pass 3 accumulates the
   weighted V rows chunk by chunk into acc (L1-resident), and the output is acc / sum. */
#define DEFINE_DECODE(NAME, T, LD)                                                                            \
static void NAME##_item(const float* q, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,   \
                        int64_t c_hs, const int32_t* bt, int len, int h0, int h1, int G, int ND, int sh,       \
                        int msk, float scale, float* out, int64_t o_hs, float* sc, float* acc) {               \
    const int nch = (len + 7) / 8, lpad = nch * 8, nh = (h1 - h0) * G;                                        \
    const int row_bytes = (int)(c_ts * (int64_t)sizeof(T)); /* a whole row: every kv head of one position */ \
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);                            \
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                           \
    __m256 mx[MAX_HEADS];                                                                                     \
    for (int j = 0; j < nh; j++) mx[j] = ninf;                                                                \
    int64_t roff[8];                                                                                          \
    for (int b = 0; b < nch; b++) {                                                                           \
        const int n = (b == nch - 1) ? len - b * 8 : 8;                                                       \
        for (int t = 0; t < 8; t++) { /* past len (last chunk): re-read row 0, its scores are masked below */ \
            const int p = b * 8 + (t < n ? t : 0);                                                            \
            roff[t] = (int64_t)bt[p >> sh] * c_bs + (int64_t)(p & msk) * c_ts;                                \
        }                                                                                                     \
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));             \
        prefetch_rows(kc, c_bs, c_ts, bt, (b + PF_CHUNKS) * 8, len, sh, msk, row_bytes);                       \
        for (int h = h0; h < h1; h++) {                                                                       \
            const T* k0 = kc + (int64_t)h * c_hs;                                                             \
            for (int g = 0; g < G; g++) {                                                                     \
                const int j = (h - h0) * G + g;                                                               \
                const float* qg = q + (int64_t)(h * G + g) * q_hs;                                            \
                const __m256 r = _mm256_blendv_ps(ninf, _mm256_mul_ps(LD##_dot8(qg, k0, roff, ND), vscale), valid);\
                _mm256_storeu_ps(sc + (int64_t)j * lpad + b * 8, r);                                          \
                mx[j] = _mm256_max_ps(mx[j], r);                                                              \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    float inv[MAX_HEADS];                                                                                     \
    softmax_rows(sc, nh, lpad, mx, inv);                                                                      \
    const int D = ND * 8;                                                                                     \
    memset(acc, 0, sizeof(float) * (size_t)nh * (size_t)D);                                                   \
    for (int b = 0; b < nch; b++) {                                                                           \
        const int n = (b == nch - 1) ? len - b * 8 : 8;                                                       \
        for (int t = 0; t < n; t++) {                                                                         \
            const int p = b * 8 + t;                                                                          \
            roff[t] = (int64_t)bt[p >> sh] * c_bs + (int64_t)(p & msk) * c_ts;                                \
        }                                                                                                     \
        prefetch_rows(vc, c_bs, c_ts, bt, (b + PF_CHUNKS) * 8, len, sh, msk, row_bytes);                       \
        for (int h = h0; h < h1; h++) {                                                                       \
            const T* v0 = vc + (int64_t)h * c_hs;                                                             \
            for (int g = 0; g < G; g++) {                                                                     \
                const int j = (h - h0) * G + g;                                                               \
                const float* w = sc + (int64_t)j * lpad + b * 8;                                              \
                float* aj = acc + (int64_t)j * D;                                                             \
                for (int c0 = 0; c0 < ND; c0 += 8) { /* up to 8 accumulators in registers */                  \
                    const int nc = ND - c0 < 8 ? ND - c0 : 8;                                                 \
                    __m256 r[8];                                                                              \
                    for (int c = 0; c < nc; c++) r[c] = _mm256_loadu_ps(aj + 8 * (c0 + c));                   \
                    for (int t = 0; t < n; t++) {                                                             \
                        const __m256 wt = _mm256_set1_ps(w[t]);                                               \
                        const T* v = v0 + roff[t] + 8 * c0;                                                   \
                        for (int c = 0; c < nc; c++) r[c] = _mm256_fmadd_ps(wt, LD(v + 8 * c), r[c]);         \
                    }                                                                                         \
                    for (int c = 0; c < nc; c++) _mm256_storeu_ps(aj + 8 * (c0 + c), r[c]);                   \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    for (int h = h0; h < h1; h++)                                                                             \
        for (int g = 0; g < G; g++) {                                                                         \
            const int j = (h - h0) * G + g;                                                                   \
            const __m256 s = _mm256_set1_ps(inv[j]);                                                          \
            float* o = out + (int64_t)(h * G + g) * o_hs;                                                     \
            for (int c = 0; c < ND; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)j * D + 8 * c), s)); \
        }                                                                                                     \
}                                                                                                             \
int NAME(const float* q, int64_t q_ss, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,    \
         int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* lens, float* out, int64_t o_ss,        \
         int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale, int max_len) {                      \
    const int G = Hq / Hkv;                                                                                   \
    if (G * Hkv != Hq || !fast_path(D, bs)) return 1;                                                         \
    /* whole sequences per item when there are enough of them to share out, else one kv head per item (a     \
       single long sequence still uses every thread); at most MAX_HEADS query heads per item */               \
    int per = (S >= 4 * omp_get_max_threads()) ? Hkv : 1;                                                     \
    while (per > 1 && (per * G > MAX_HEADS || Hkv % per)) per--;                                              \
    if (per * G > MAX_HEADS) return 1;                                                                        \
    const int parts = Hkv / per, ND = D / 8, sh = __builtin_ctz((unsigned)bs), msk = bs - 1;                  \
    int err = 0;                                                                                              \
    _Pragma("omp parallel")                                                                                   \
    {                                                                                                         \
        /* flush denormals to zero while we run: tiny softmax weights times V can produce subnormal           \
           products, each a slow microcode assist on some CPUs (results differ from IEEE by < 1e-38) */        \
        const unsigned int csr = _mm_getcsr();                                                                \
        _mm_setcsr(csr | 0x8040);                                                                             \
        const int lp = ((max_len > 0 ? max_len : 1) + 7) / 8 * 8;                                             \
        float* sc = (float*)malloc(sizeof(float) * (size_t)(per * G) * (size_t)lp);                           \
        float* acc = (float*)malloc(sizeof(float) * (size_t)(per * G) * (size_t)D);                           \
        if (!sc || !acc) {                                                                                    \
            _Pragma("omp atomic write")                                                                       \
            err = 2;                                                                                          \
        }                                                                                                     \
        _Pragma("omp for schedule(dynamic, 1)")                                                               \
        for (int64_t i = 0; i < (int64_t)S * parts; i++) {                                                    \
            if (!sc || !acc) continue;                                                                        \
            const int s = (int)(i / parts), h0 = (int)(i % parts) * per;                                      \
            const int len = lens[s];                                                                          \
            if (len <= 0) continue;                                                                           \
            DECODE_ITEM512(NAME)                                                                              \
            NAME##_item(q + s * q_ss, q_hs, kc, vc, c_bs, c_ts, c_hs, bt + s * bt_ss, len, h0, h0 + per, G,   \
                        ND, sh, msk, scale, out + s * o_ss, o_hs, sc, acc);                                   \
        }                                                                                                     \
        free(sc);                                                                                             \
        free(acc);                                                                                            \
        _mm_setcsr(csr);                                                                                      \
    }                                                                                                         \
    return err;                                                                                               \
}

/* the vector path: head dim a multiple of 8 up to 128, power-of-two block size */
static int fast_path(int D, int bs) { return D % 8 == 0 && D / 8 <= MAX_ND && bs > 0 && (bs & (bs - 1)) == 0; }
DEFINE_DECODE(simd_f32, float, ld_f32)
DEFINE_DECODE(simd_bf16, uint16_t, ld_bf16)
/* Causal prefill attention from the paged cache: each sequence's chunk of Lq queries (positions ctx ..
   ctx+Lq-1, their keys/values already written to the cache) against its keys 0 .. ctx+Lq-1. A work item is
   one kv head x QB query rows (QB*G query vectors): keys are walked in chunks of 8 up to the block's last
   position, scores by 8 FMA chains per query vector, an online softmax (running max and sum, the
   accumulator rescaled when the max grows), and the weighted V sum register-blocked 3 query vectors x 4
   vectors of D at a time, so each V load feeds 3 FMAs. */
/* q.k for 8 key rows, and the V sums of up to 3 query vectors, for the prefill item: zmm-wide (16 values per
   register, half the instructions) where AVX-512 is built and the head dim is a multiple of 16, else the AVX2
   helpers. */
#if defined(__AVX512F__)
#define PREFILL_OPS(NAME, T, LD)                                                                              \
static inline __m256 NAME##_qk(const float* q, const T* k0, const int64_t* roff, int ND) {                    \
    if (ND & 1) return LD##_dot8(q, k0, roff, ND);                                                            \
    __m512 a[8];                                                                                              \
    for (int t = 0; t < 8; t++) a[t] = _mm512_setzero_ps();                                                   \
    for (int c = 0; c < ND / 2; c++) {                                                                        \
        const __m512 qc = _mm512_loadu_ps(q + 16 * c);                                                        \
        for (int t = 0; t < 8; t++) a[t] = _mm512_fmadd_ps(qc, LD##_512(k0 + roff[t] + 16 * c), a[t]);       \
    }                                                                                                         \
    __m256 f[8];                                                                                              \
    for (int t = 0; t < 8; t++) f[t] = fold512(a[t]);                                                         \
    return transpose_sum8(f);                                                                                 \
}                                                                                                             \
static inline __attribute__((always_inline)) void NAME##_pv512(const int NJ, const int CW, const T* v0,       \
        const int64_t* roff, const float* w, float* a, int D) {                                               \
    __m512 r[3][4];                                                                                           \
    _Pragma("GCC unroll 3") for (int j = 0; j < NJ; j++)                                                      \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) r[j][c] = _mm512_loadu_ps(a + (int64_t)j * D + 16 * c);\
    for (int t = 0; t < 8; t++) {                                                                             \
        const T* v = v0 + roff[t];                                                                            \
        __m512 wt[3];                                                                                         \
        _Pragma("GCC unroll 3") for (int j = 0; j < NJ; j++) wt[j] = _mm512_set1_ps(w[j * 8 + t]);            \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) {                                                \
            const __m512 x = LD##_512(v + 16 * c);                                                            \
            _Pragma("GCC unroll 3") for (int j = 0; j < NJ; j++) r[j][c] = _mm512_fmadd_ps(wt[j], x, r[j][c]);\
        }                                                                                                     \
    }                                                                                                         \
    _Pragma("GCC unroll 3") for (int j = 0; j < NJ; j++)                                                      \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) _mm512_storeu_ps(a + (int64_t)j * D + 16 * c, r[j][c]);\
}                                                                                                             \
static void NAME##_pvall(int nq, int ND, const T* v0, const int64_t* roff, const float* w, float* acc, int D) { \
    if (ND & 1) {                                                                                             \
        for (int j0 = 0; j0 < nq; j0 += 3)                                                                    \
            for (int c0 = 0; c0 < ND; c0 += 4)                                                                \
                NAME##_pvblock(nq - j0 < 3 ? nq - j0 : 3, ND - c0 < 4 ? ND - c0 : 4, v0 + 8 * c0, roff,       \
                               w + j0 * 8, acc + (int64_t)j0 * D + 8 * c0, D);                                \
        return;                                                                                               \
    }                                                                                                         \
    const int N16 = ND / 2;                                                                                   \
    for (int j0 = 0; j0 < nq; j0 += 3) {                                                                      \
        const int nj = nq - j0 < 3 ? nq - j0 : 3;                                                             \
        for (int c0 = 0; c0 < N16; c0 += 4) {                                                                 \
            const int cw = N16 - c0 < 4 ? N16 - c0 : 4;                                                       \
            const T* v = v0 + 16 * c0;                                                                        \
            const float* wj = w + j0 * 8;                                                                     \
            float* a = acc + (int64_t)j0 * D + 16 * c0;                                                       \
            switch (nj * 4 + cw) {                                                                            \
                case 5: NAME##_pv512(1, 1, v, roff, wj, a, D); break;                                         \
                case 6: NAME##_pv512(1, 2, v, roff, wj, a, D); break;                                         \
                case 7: NAME##_pv512(1, 3, v, roff, wj, a, D); break;                                         \
                case 8: NAME##_pv512(1, 4, v, roff, wj, a, D); break;                                         \
                case 9: NAME##_pv512(2, 1, v, roff, wj, a, D); break;                                         \
                case 10: NAME##_pv512(2, 2, v, roff, wj, a, D); break;                                        \
                case 11: NAME##_pv512(2, 3, v, roff, wj, a, D); break;                                        \
                case 12: NAME##_pv512(2, 4, v, roff, wj, a, D); break;                                        \
                case 13: NAME##_pv512(3, 1, v, roff, wj, a, D); break;                                        \
                case 14: NAME##_pv512(3, 2, v, roff, wj, a, D); break;                                        \
                case 15: NAME##_pv512(3, 3, v, roff, wj, a, D); break;                                        \
                default: NAME##_pv512(3, 4, v, roff, wj, a, D); break;                                        \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
}
#else
#define PREFILL_OPS(NAME, T, LD)                                                                              \
static inline __m256 NAME##_qk(const float* q, const T* k0, const int64_t* roff, int ND) {                    \
    return LD##_dot8(q, k0, roff, ND);                                                                        \
}                                                                                                             \
static void NAME##_pvall(int nq, int ND, const T* v0, const int64_t* roff, const float* w, float* acc, int D) { \
    for (int j0 = 0; j0 < nq; j0 += 3)                                                                        \
        for (int c0 = 0; c0 < ND; c0 += 4)                                                                    \
            NAME##_pvblock(nq - j0 < 3 ? nq - j0 : 3, ND - c0 < 4 ? ND - c0 : 4, v0 + 8 * c0, roff, w + j0 * 8, \
                           acc + (int64_t)j0 * D + 8 * c0, D);                                                \
}
#endif
#define QB 8
#define MAX_NQ (QB * MAX_GROUP)
#define DEFINE_PREFILL(NAME, T, LD)                                                                           \
static inline __attribute__((always_inline)) void NAME##_pv(const int NJ, const int CW, const T* v0,          \
        const int64_t* roff, const float* w, float* a, int D) {                                               \
    __m256 r[3][4];                                                                                           \
    _Pragma("GCC unroll 3") for (int j = 0; j < NJ; j++)                                                      \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) r[j][c] = _mm256_loadu_ps(a + (int64_t)j * D + 8 * c);\
    for (int t = 0; t < 8; t++) {                                                                             \
        const T* v = v0 + roff[t];                                                                            \
        __m256 wt[3];                                                                                         \
        _Pragma("GCC unroll 3") for (int j = 0; j < NJ; j++) wt[j] = _mm256_set1_ps(w[j * 8 + t]);            \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) {                                                \
            const __m256 x = LD(v + 8 * c);                                                                   \
            _Pragma("GCC unroll 3") for (int j = 0; j < NJ; j++) r[j][c] = _mm256_fmadd_ps(wt[j], x, r[j][c]);\
        }                                                                                                     \
    }                                                                                                         \
    _Pragma("GCC unroll 3") for (int j = 0; j < NJ; j++)                                                      \
        _Pragma("GCC unroll 4") for (int c = 0; c < CW; c++) _mm256_storeu_ps(a + (int64_t)j * D + 8 * c, r[j][c]);\
}                                                                                                             \
static void NAME##_pvblock(int nj, int cw, const T* v0, const int64_t* roff, const float* w, float* a, int D) {\
    switch (nj * 4 + cw) {                                                                                    \
        case 5: NAME##_pv(1, 1, v0, roff, w, a, D); break;                                                    \
        case 6: NAME##_pv(1, 2, v0, roff, w, a, D); break;                                                    \
        case 7: NAME##_pv(1, 3, v0, roff, w, a, D); break;                                                    \
        case 8: NAME##_pv(1, 4, v0, roff, w, a, D); break;                                                    \
        case 9: NAME##_pv(2, 1, v0, roff, w, a, D); break;                                                    \
        case 10: NAME##_pv(2, 2, v0, roff, w, a, D); break;                                                   \
        case 11: NAME##_pv(2, 3, v0, roff, w, a, D); break;                                                   \
        case 12: NAME##_pv(2, 4, v0, roff, w, a, D); break;                                                   \
        case 13: NAME##_pv(3, 1, v0, roff, w, a, D); break;                                                   \
        case 14: NAME##_pv(3, 2, v0, roff, w, a, D); break;                                                   \
        case 15: NAME##_pv(3, 3, v0, roff, w, a, D); break;                                                   \
        default: NAME##_pv(3, 4, v0, roff, w, a, D); break;                                                   \
    }                                                                                                         \
}                                                                                                             \
PREFILL_OPS(NAME, T, LD)                                                                                      \
static void NAME##_pitem(const float* q, int64_t q_ts, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs,  \
                         int64_t c_ts, int64_t c_hs, const int32_t* bt, int ctx, int r0, int nr, int h, int G, int ND, int sh,\
                         int msk, float scale, float* out, int64_t o_ts, int64_t o_hs, float* acc, float* w) {\
    const int nq = nr * G, D = ND * 8, last = ctx + r0 + nr - 1; /* the block's last query position */        \
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);                            \
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                           \
    float m[MAX_NQ], l[MAX_NQ];                                                                               \
    for (int j = 0; j < nq; j++) { m[j] = -INFINITY; l[j] = 0.f; }                                            \
    memset(acc, 0, sizeof(float) * (size_t)nq * (size_t)D);                                                   \
    const T* k0 = kc + (int64_t)h * c_hs;                                                                        \
    const T* v0 = vc + (int64_t)h * c_hs;                                                                        \
    int64_t roff[8];                                                                                          \
    for (int kb = 0; kb <= last; kb += 8) {                                                                   \
        for (int t = 0; t < 8; t++) { /* keys past the last position re-read row 0: masked below */           \
            const int p = kb + t <= last ? kb + t : 0;                                                        \
            roff[t] = (int64_t)bt[p >> sh] * c_bs + (int64_t)(p & msk) * c_ts;                                \
        }                                                                                                     \
        const __m256i kpos = _mm256_add_epi32(_mm256_set1_epi32(kb), lane);                                   \
        for (int r = 0; r < nr; r++) {                                                                        \
            const int pos = ctx + r0 + r;                                                                     \
            /* lanes with key position <= pos are visible */                                                  \
            const __m256 vis = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(pos + 1), kpos));     \
            for (int g = 0; g < G; g++) {                                                                     \
                const int j = r * G + g;                                                                      \
                float* wj = w + j * 8;                                                                        \
                if (kb > pos) { _mm256_storeu_ps(wj, _mm256_setzero_ps()); continue; }                        \
                const float* qj = q + (int64_t)(r0 + r) * q_ts + (int64_t)(h * G + g) * q_hs;                 \
                const __m256 sv = _mm256_blendv_ps(ninf, _mm256_mul_ps(NAME##_qk(qj, k0, roff, ND), vscale), vis);\
                const float cm = _mm256_cvtss_f32(hmax8(sv));                                                 \
                if (cm > m[j]) { /* a new running max: rescale what is accumulated so far */                  \
                    const float alpha = m[j] == -INFINITY ? 0.f : expf(m[j] - cm);                            \
                    const __m256 va = _mm256_set1_ps(alpha);                                                  \
                    float* aj = acc + (int64_t)j * D;                                                         \
                    for (int c = 0; c < ND; c++) _mm256_storeu_ps(aj + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(aj + 8 * c), va));\
                    l[j] *= alpha;                                                                            \
                    m[j] = cm;                                                                                \
                }                                                                                             \
                const __m256 e = exp256(_mm256_sub_ps(sv, _mm256_set1_ps(m[j])));                             \
                l[j] += hsum8(e);                                                                             \
                _mm256_storeu_ps(wj, e);                                                                      \
            }                                                                                                 \
        }                                                                                                     \
        NAME##_pvall(nq, ND, v0, roff, w, acc, D);                                                            \
    }                                                                                                         \
    for (int r = 0; r < nr; r++)                                                                              \
        for (int g = 0; g < G; g++) {                                                                         \
            const int j = r * G + g;                                                                          \
            const __m256 sinv = _mm256_set1_ps(1.0f / l[j]);                                                  \
            float* o = out + (int64_t)(r0 + r) * o_ts + (int64_t)(h * G + g) * o_hs;                          \
            for (int c = 0; c < ND; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)j * D + 8 * c), sinv));\
        }                                                                                                     \
}                                                                                                             \
/* S sequences: queries q[qs[s] .. qs[s+1]) (rows q_ts apart, heads q_hs apart), ctx[s] earlier positions,    \
   block table bt + s * bt_ss. Returns 0, or 1 where the shape is not handled (the caller falls back). */     \
int NAME(const float* q, int64_t q_ts, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,    \
         int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* qs, const int32_t* ctx, float* out, int64_t o_ts,   \
         int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale) {                                  \
    const int G = Hq / Hkv;                                                                                   \
    if (G * Hkv != Hq || G > MAX_GROUP || !fast_path(D, bs)) return 1;                                        \
    const int ND = D / 8, sh = __builtin_ctz((unsigned)bs), msk = bs - 1;                                     \
    int64_t* first = (int64_t*)malloc(sizeof(int64_t) * (size_t)(S + 1)); /* first item of each sequence */   \
    if (!first) return 2;                                                                                     \
    first[0] = 0;                                                                                             \
    for (int s = 0; s < S; s++) first[s + 1] = first[s] + (int64_t)Hkv * ((qs[s + 1] - qs[s] + QB - 1) / QB); \
    const int64_t items = first[S];                                                                           \
    int err = 0;                                                                                              \
    _Pragma("omp parallel")                                                                                   \
    {                                                                                                         \
        const unsigned int csr = _mm_getcsr();                                                                \
        _mm_setcsr(csr | 0x8040);                                                                             \
        float* acc = (float*)malloc(sizeof(float) * (size_t)MAX_NQ * (size_t)D);                              \
        float* w = (float*)malloc(sizeof(float) * (size_t)MAX_NQ * 8);                                        \
        if (!acc || !w) {                                                                                     \
            _Pragma("omp atomic write")                                                                       \
            err = 2;                                                                                          \
        }                                                                                                     \
        /* items in reverse: the long causal blocks (late rows of long sequences) first balance better */     \
        _Pragma("omp for schedule(dynamic, 1)")                                                               \
        for (int64_t i = items - 1; i >= 0; i--) {                                                            \
            if (!acc || !w) continue;                                                                         \
            int s = 0;                                                                                        \
            while (first[s + 1] <= i) s++;                                                                    \
            const int64_t local = i - first[s];                                                               \
            const int h = (int)(local % Hkv), qb = (int)(local / Hkv);                                        \
            const int lq = qs[s + 1] - qs[s], r0 = qb * QB, nr = lq - r0 < QB ? lq - r0 : QB;                 \
            NAME##_pitem(q + (int64_t)qs[s] * q_ts, q_ts, q_hs, kc, vc, c_bs, c_ts, c_hs, bt + s * bt_ss, ctx[s], r0, nr,\
                         h, G, ND, sh, msk, scale, out + (int64_t)qs[s] * o_ts, o_ts, o_hs, acc, w);          \
        }                                                                                                     \
        free(acc);                                                                                            \
        free(w);                                                                                              \
        _mm_setcsr(csr);                                                                                      \
    }                                                                                                         \
    free(first);                                                                                              \
    return err;                                                                                               \
}
DEFINE_PREFILL(prefill_f32, float, ld_f32)
DEFINE_PREFILL(prefill_bf16, uint16_t, ld_bf16)
int has_prefill(void) { return 1; }
#else
int has_prefill(void) { return 0; }
int prefill_f32(void) { return 1; }
int prefill_bf16(void) { return 1; }
static int fast_path(int D, int bs) { (void)D; (void)bs; return 0; }
#define simd_f32 generic_f32
#define simd_bf16 generic_bf16
#endif

#define DEFINE_DISPATCH(NAME, T)                                                                              \
int decode_##NAME(const float* q, int64_t q_ss, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs,          \
                  int64_t c_ts, int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* lens, float* out, \
                  int64_t o_ss, int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale, int max_len) { \
    if (fast_path(D, bs) && !force_generic)                                                                   \
        return simd_##NAME(q, q_ss, q_hs, kc, vc, c_bs, c_ts, c_hs, bt, bt_ss, lens, out, o_ss, o_hs, S, Hq,   \
                           Hkv, D, bs, scale, max_len);                                                       \
    return generic_##NAME(q, q_ss, q_hs, kc, vc, c_bs, c_ts, c_hs, bt, bt_ss, lens, out, o_ss, o_hs, S, Hq,    \
                          Hkv, D, bs, scale, max_len);                                                        \
}

static int force_generic = 0;
/* 1 if the vector path is compiled in; set_generic(1) routes every call to the portable loops (tests). */
int has_simd(void) { return fast_path(16, 16); }
void set_generic(int on) { force_generic = on; }
DEFINE_DISPATCH(f32, float)
DEFINE_DISPATCH(bf16, uint16_t)
"""

_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # q, strides
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # caches, strides
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # block tables, row stride, lens
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # out, strides
    + [ctypes.c_int] * 5  # S, Hq, Hkv, D, block_size
    + [ctypes.c_float, ctypes.c_int]  # scale, max_len
)

_PREFILL_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # q, row and head strides
    + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # caches, strides
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]  # block tables, row stride, qs, ctx
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # out, strides
    + [ctypes.c_int] * 5  # S, Hq, Hkv, D, block_size
    + [ctypes.c_float]  # scale
)



def _build() -> ctypes.CDLL | None:
    lib = native.build("cpu_attention", _SOURCE)
    if lib is None:
        return None
    lib.set_avx512.argtypes = [ctypes.c_int]
    lib.set_avx512.restype = None
    lib.has_avx512.restype = ctypes.c_int
    for name in ("decode_f32", "decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int
    for name in ("prefill_f32", "prefill_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = _PREFILL_ARGTYPES
        fn.restype = ctypes.c_int
    lib.has_prefill.restype = ctypes.c_int
    lib.has_simd.restype = ctypes.c_int
    lib.set_generic.argtypes = [ctypes.c_int]
    lib.set_generic.restype = None
    log.debug("CPU attention kernel loaded (AVX2 path: %s)", bool(lib.has_simd()))
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use), or None where it cannot be built. Two first calls
    racing may both build: harmless, ``native.build`` installs the library atomically."""
    return _build()


def available() -> bool:
    return load() is not None


def has_simd() -> bool:
    """Whether the AVX2+FMA path was compiled in (head dims that are multiples of 8, power-of-two blocks)."""
    lib = load()
    return lib is not None and bool(lib.has_simd())


def has_avx512() -> bool:
    """Whether the AVX-512 decode path was compiled in (head dims that are multiples of 16)."""
    lib = load()
    return lib is not None and bool(lib.has_avx512())


def use_avx512(on: bool) -> None:
    """Let the decode kernel take its AVX-512 path where compiled in (default), or keep it on AVX2: for tests
    and side-by-side timings."""
    lib = load()
    if lib is not None:
        lib.set_avx512(1 if on else 0)


def use_generic(on: bool) -> None:
    """Route every call to the portable scalar loops (``True``) or back to the vector path: for tests."""
    lib = load()
    if lib is not None:
        lib.set_generic(1 if on else 0)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` handles these tensors (CPU, float32/bfloat16 cache, dense rows)."""
    if query.device.type != "cpu" or k_cache.device.type != "cpu":
        return False
    if k_cache.dtype not in (torch.float32, torch.bfloat16):
        return False
    hq, hkv = query.shape[1], k_cache.shape[2]
    return hq % hkv == 0 and hq // hkv <= 16 and k_cache.stride(-1) == 1 and load() is not None


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence. query ``[S, Hq, D]``; k/v cache ``[num_blocks, block_size,
    Hkv, D]`` (same strides); block_tables int32 ``[S, >= ceil(max_len / block_size)]``; seq_lens int32
    ``[S]`` (context length including the query token). Returns ``[S, Hq, D]`` in the query's dtype."""
    lib = load()
    assert lib is not None, "CPU attention kernel not available"
    s, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    assert v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    q = query.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((s, hq, d), dtype=torch.float32)
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    lens = lens.contiguous()
    fn = lib.decode_f32 if k_cache.dtype == torch.float32 else lib.decode_bf16
    cs = k_cache.stride()
    err = fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), cs[0], cs[1], cs[2],
             bt.data_ptr(), bt.stride(0), lens.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
             s, hq, hkv, d, bs, float(scale), int(max_len))
    if err:
        raise RuntimeError(f"CPU decode attention kernel failed (code {err})")
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def supports_prefill(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`prefill_attention` handles these tensors (the AVX2 path: head dim a multiple of 8 up to
    128, power-of-two blocks, float32/bfloat16 cache; float32 queries, or bfloat16 ones widened first)."""
    if not supports(query, k_cache) or query.dtype not in (torch.float32, torch.bfloat16):
        return False
    lib = load()
    d, bs = k_cache.shape[-1], k_cache.shape[1]
    return bool(lib.has_prefill()) and d % 8 == 0 and d <= 128 and bs & (bs - 1) == 0


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of S prefill chunks read from the paged cache (their own keys/values already written).
    query ``[T, Hq, D]`` float32, chunk s being rows ``query_start[s] .. query_start[s+1]`` at positions
    ``context_lens[s]`` onwards; block_tables int32 ``[S, >= blocks]``. Returns ``[T, Hq, D]`` float32 (the
    caller's output tensor rounds it to the model's dtype)."""
    lib = load()
    assert lib is not None, "CPU attention kernel not available"
    t, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    assert v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    q = query.float() if query.dtype != torch.float32 else query  # the kernel's arithmetic is float32
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((t, hq, d), dtype=torch.float32)
    bt = block_tables.to(torch.int32).contiguous()
    qs = query_start.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    fn = lib.prefill_f32 if k_cache.dtype == torch.float32 else lib.prefill_bf16
    cs = k_cache.stride()
    err = fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), cs[0], cs[1], cs[2],
             bt.data_ptr(), bt.stride(0), qs.data_ptr(), ctx.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
             int(ctx.shape[0]), hq, hkv, d, bs, float(scale))
    if err:
        raise RuntimeError(f"CPU prefill attention kernel failed (code {err})")
    return out
