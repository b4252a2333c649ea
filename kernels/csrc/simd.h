/* Helpers shared by the CPU kernels (decode_attention.c, prefill_attention.c, packed_gemm.c): which instruction
   sets a build uses, bfloat16 widening, and the AVX2 / AVX-512 exp, horizontal sums and dot products.

   Build options (-D, passed by kernels/native.py's build(..., defines=...)); the instruction sets themselves
   come from the compiler's own macros (-march=native):
     INFERQ_NO_AVX512  leave the AVX-512 code out even where the compiler targets it (the AVX2 build, as on an
                       AVX2-only CPU; tests and side-by-side timings)
     INFERQ_NO_AVX2    leave every vector path out: portable loops only (the packed GEMM then does not build) */
#ifndef INFERQ_SIMD_H
#define INFERQ_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(INFERQ_NO_AVX2)
#define INFERQ_HAVE_AVX2 1
#else
#define INFERQ_HAVE_AVX2 0
#endif
#if INFERQ_HAVE_AVX2 && defined(__AVX512F__) && !defined(INFERQ_NO_AVX512)
#define INFERQ_HAVE_AVX512 1
#else
#define INFERQ_HAVE_AVX512 0
#endif
#if INFERQ_HAVE_AVX512 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define INFERQ_HAVE_AVX512BF16 1
#else
#define INFERQ_HAVE_AVX512BF16 0
#endif

/* Helpers taking a compile-time constant (row count, bfloat16 or not) are always inlined, so each call site
   gets code specialised for its constants: the C form of a template. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Element i of p, an array of float32 (bf16 == 0) or of bfloat16 (bf16 == 1). */
ALWAYS_INLINE const void* elem_at(const void* p, int64_t i, const int bf16) {
    return (const char*)p + i * (bf16 ? 2 : 4);
}

/* bfloat16 -> float32 is a 16-bit shift into the high half. */
ALWAYS_INLINE float load1(const void* p, int64_t i, const int bf16) {
    if (!bf16) return ((const float*)p)[i];
    const uint32_t u = ((uint32_t)((const uint16_t*)p)[i]) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16, rounded to nearest even (as torch rounds); a NaN stays a (quiet) NaN. */
ALWAYS_INLINE uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if INFERQ_HAVE_AVX2
#include <immintrin.h>

/* 8 values from element i of p (float32, or bfloat16 widened) */
ALWAYS_INLINE __m256 load8(const void* p, int64_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float*)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

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

/* q . k for the 8 rows at k + roff[0..7] (D = 8 * ND values each): 8 independent FMA chains, one per row,
   summed across lanes into one vector of 8 dot products. */
ALWAYS_INLINE __m256 dot8(const float* q, const void* k, const int64_t* roff, int ND, const int bf16) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
    for (int c = 0; c < ND; c++) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qc, load8(k, roff[t] + 8 * c, bf16), a[t]);
    }
    return transpose_sum8(a);
}

/* Flush denormals to zero (MXCSR FTZ + DAZ) while a kernel runs; returns the caller's setting to restore. Tiny
   softmax weights times V can produce subnormal products, each a slow microcode assist on some CPUs. */
static inline unsigned int flush_denormals(void) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    return csr;
}
#endif /* INFERQ_HAVE_AVX2 */

#if INFERQ_HAVE_AVX512
/* 16 values from element i of p (float32, or bfloat16 widened) */
ALWAYS_INLINE __m512 load16(const void* p, int64_t i, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float*)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the sum of the two 256-bit halves */
static inline __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif /* INFERQ_HAVE_AVX512 */

/* The paged KV cache of one layer as the attention kernels read it. Strides are in elements; in the vector
   paths (power-of-two block sizes) position p of a sequence is row p & msk of block bt[p >> sh]. */
typedef struct {
    const void* k;
    const void* v;
    int64_t c_bs, c_ts, c_hs; /* block, row (position) and kv-head strides */
    int bs, sh, msk;          /* block size, its log2 and bs - 1 (sh, msk: power-of-two sizes only) */
} paged_cache;

#define MAX_GROUP 16 /* query heads per kv head */
#define MAX_ND 16    /* head dim / 8 of the vector paths */

/* Whether the vector attention paths take this head dim and block size (multiples of 8 up to 128,
   power-of-two blocks); never in a build without them. */
static inline int vector_shape(int D, int bs) {
    return INFERQ_HAVE_AVX2 && D % 8 == 0 && D / 8 <= MAX_ND && bs > 0 && (bs & (bs - 1)) == 0;
}

static inline paged_cache make_cache(const void* kc, const void* vc, int64_t c_bs, int64_t c_ts, int64_t c_hs,
                                     int bs) {
    const int pow2 = bs > 0 && (bs & (bs - 1)) == 0;
    const paged_cache c = {kc, vc, c_bs, c_ts, c_hs, bs, pow2 ? __builtin_ctz((unsigned)bs) : 0, bs - 1};
    return c;
}

/* element offset of position p's row (every kv head) in a vector-path cache */
static inline int64_t row_offset(const paged_cache* c, const int32_t* bt, int p) {
    return (int64_t)bt[p >> c->sh] * c->c_bs + (int64_t)(p & c->msk) * c->c_ts;
}

#endif /* INFERQ_SIMD_H */
