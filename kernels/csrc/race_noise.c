/* The exponential race's noise (worker/sampler.py): log E for E ~ Exp(1), one vocabulary-wide row per key, each
   value a function of (key, column) alone.

   Why C: a sampled token needs a fresh draw for every column of the vocabulary (49,152 for SmolLM2), and
   numpy's ziggurat took 0.14 ms for them and torch another 0.02 ms for their log: about 7% of a quantised
   one-sequence step. Here a counter-based hash gives each column its 32 random bits, so the columns are
   independent work (vectorised, and shared over the threads for several rows), and the two logs are one
   polynomial each.

   Column i of a row keyed k takes x = mix32(mix32(i + k0) ^ k1), two rounds of a bijective 32-bit finaliser,
   (k0, k1) the halves of splitmix64(k). E = -log(U), U = (x + 1/2) / 2^32, is computed where it is precise at
   both ends: for U < 1/2 as -log(U); for U >= 1/2 (small E, where the race is decided, so its relative
   precision matters) as -log1p(-V) from V = (~x + 1/2) / 2^32 = 1 - U (in float to 24 bits however small),
   through log1p(-V) = log(W) - ((W - 1) + V) / W with W = 1 - V rounded. The smallest E is about 2^-33, the
   largest 22.9.

   Every path (AVX-512, AVX2, portable) makes the same float operations in the same order, FMAs written out, so
   the values are equal bit for bit whichever this CPU runs: a seeded request samples the same tokens on every
   machine. tests/unit/test_race_noise.py checks them against numpy's float64 of the same bits and the
   distribution against Exp(1). */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* Cephes' logf polynomial: log(1 + f) = f - f^2 / 2 + f^3 P(f) for f in [sqrt(1/2) - 1, sqrt(2) - 1) */
#define LOG_P0 7.0376836292E-2f
#define LOG_P1 -1.1514610310E-1f
#define LOG_P2 1.1676998740E-1f
#define LOG_P3 -1.2420140846E-1f
#define LOG_P4 1.4249322787E-1f
#define LOG_P5 -1.6668057665E-1f
#define LOG_P6 2.0000714765E-1f
#define LOG_P7 -2.4999993993E-1f
#define LOG_P8 3.3333331174E-1f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define TWO_M32 2.3283064365386963e-10f /* 2^-32 */

/* p = P(f), Horner's rule with FMAs, at any width: FMA(a, b, c) = a b + c, SET(x) x in every lane (the same
   operations in the same order in every path) */
#define LOG_HORNER(FMA, SET, f, p)           \
    do {                                     \
        p = FMA(SET(LOG_P0), f, SET(LOG_P1)); \
        p = FMA(p, f, SET(LOG_P2));          \
        p = FMA(p, f, SET(LOG_P3));          \
        p = FMA(p, f, SET(LOG_P4));          \
        p = FMA(p, f, SET(LOG_P5));          \
        p = FMA(p, f, SET(LOG_P6));          \
        p = FMA(p, f, SET(LOG_P7));          \
        p = FMA(p, f, SET(LOG_P8));          \
    } while (0)
#define SCALAR(x) (x)

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21f0aaadu;
    x ^= x >> 15;
    x *= 0x735a2d97u;
    return x ^ (x >> 15);
}

/* log(a) for a positive normal float (the vector forms below make the same operations) */
static inline float log_scalar(float a) {
    uint32_t bits;
    memcpy(&bits, &a, 4);
    int e = (int)(bits >> 23) - 127;
    const uint32_t mb = (bits & 0x007fffffu) | 0x3f800000u;
    float m;
    memcpy(&m, &mb, 4);
    if (m > 1.41421356f) m *= 0.5f, e += 1;
    const float f = m - 1.0f, z = f * f, ef = (float)e;
    float p;
    LOG_HORNER(fmaf, SCALAR, f, p);
    float y = (f * z) * p;
    y = fmaf(ef, LN2_LO, y);
    y = fmaf(z, -0.5f, y);
    return fmaf(ef, LN2_HI, f + y);
}

/* log E of column i of the row keyed (k0, k1) */
static inline float log_noise_scalar(uint32_t k0, uint32_t k1, uint32_t i) {
    const uint32_t x = mix32(mix32(i + k0) ^ k1);
    const int small_e = x >= 0x80000000u; /* U >= 1/2 */
    const float v = ((float)x + 0.5f) * TWO_M32, u = ((float)~x + 0.5f) * TWO_M32;
    const float w = 1.0f - u;
    const float l = log_scalar(small_e ? w : v);
    const float e = small_e ? ((w - 1.0f) + u) / w - l : -l;
    return log_scalar(e);
}

#if INFERQ_HAVE_AVX512
static inline __m512 log512(__m512 a) {
    const __m512i bits = _mm512_castps_si512(a);
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127));
    __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x007fffff)),
                                                   _mm512_set1_epi32(0x3f800000)));
    const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_epi32(e, big, e, _mm512_set1_epi32(1));
    const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f)), z = _mm512_mul_ps(f, f), ef = _mm512_cvtepi32_ps(e);
    __m512 p;
    LOG_HORNER(_mm512_fmadd_ps, _mm512_set1_ps, f, p);
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(f, z), p);
    y = _mm512_fmadd_ps(ef, _mm512_set1_ps(LN2_LO), y);
    y = _mm512_fmadd_ps(z, _mm512_set1_ps(-0.5f), y);
    return _mm512_fmadd_ps(ef, _mm512_set1_ps(LN2_HI), _mm512_add_ps(f, y));
}

static inline __m512i mix512(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x21f0aaadu));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x735a2d97u));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
}

/* columns i0 .. i0 + 15 */
static inline __m512 log_noise512(uint32_t k0, uint32_t k1, uint32_t i0) {
    const __m512i i = _mm512_add_epi32(_mm512_set1_epi32((int)(i0 + k0)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i x = mix512(_mm512_xor_si512(mix512(i), _mm512_set1_epi32((int)k1)));
    const __mmask16 small_e = _mm512_cmplt_epi32_mask(x, _mm512_setzero_si512()); /* top bit set */
    const __m512 half = _mm512_set1_ps(0.5f), scale = _mm512_set1_ps(TWO_M32), one = _mm512_set1_ps(1.0f);
    const __m512 v = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepu32_ps(x), half), scale);
    const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepu32_ps(_mm512_xor_si512(x, _mm512_set1_epi32(-1))),
                                                 half), scale);
    const __m512 w = _mm512_sub_ps(one, u);
    const __m512 l = log512(_mm512_mask_blend_ps(small_e, v, w));
    const __m512 low = _mm512_sub_ps(_mm512_div_ps(_mm512_add_ps(_mm512_sub_ps(w, one), u), w), l);
    return log512(_mm512_mask_blend_ps(small_e, _mm512_sub_ps(_mm512_setzero_ps(), l), low));
}
#elif INFERQ_HAVE_AVX2
static inline __m256 log256(__m256 a) {
    const __m256i bits = _mm256_castps_si256(a);
    __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)),
                                                   _mm256_set1_epi32(0x3f800000)));
    const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e = _mm256_sub_epi32(e, _mm256_castps_si256(big)); /* big lanes are -1 */
    const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f)), z = _mm256_mul_ps(f, f), ef = _mm256_cvtepi32_ps(e);
    __m256 p;
    LOG_HORNER(_mm256_fmadd_ps, _mm256_set1_ps, f, p);
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(f, z), p);
    y = _mm256_fmadd_ps(ef, _mm256_set1_ps(LN2_LO), y);
    y = _mm256_fmadd_ps(z, _mm256_set1_ps(-0.5f), y);
    return _mm256_fmadd_ps(ef, _mm256_set1_ps(LN2_HI), _mm256_add_ps(f, y));
}

static inline __m256i mix256(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x21f0aaadu));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x735a2d97u));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

/* unsigned 32-bit lanes to float, rounded once as the scalar conversion rounds: the high half times 2^16 is
   exact, so the sum with the low half is the one rounding */
static inline __m256 cvt_u32(__m256i x) {
    const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 16)), _mm256_set1_ps(65536.0f));
    return _mm256_add_ps(hi, _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xffff))));
}

/* columns i0 .. i0 + 7 */
static inline __m256 log_noise256(uint32_t k0, uint32_t k1, uint32_t i0) {
    const __m256i i = _mm256_add_epi32(_mm256_set1_epi32((int)(i0 + k0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i x = mix256(_mm256_xor_si256(mix256(i), _mm256_set1_epi32((int)k1)));
    const __m256 small_e = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_setzero_si256(), x)); /* top bit set */
    const __m256 half = _mm256_set1_ps(0.5f), scale = _mm256_set1_ps(TWO_M32), one = _mm256_set1_ps(1.0f);
    const __m256 v = _mm256_mul_ps(_mm256_add_ps(cvt_u32(x), half), scale);
    const __m256 u = _mm256_mul_ps(_mm256_add_ps(cvt_u32(_mm256_xor_si256(x, _mm256_set1_epi32(-1))), half), scale);
    const __m256 w = _mm256_sub_ps(one, u);
    const __m256 l = log256(_mm256_blendv_ps(v, w, small_e));
    const __m256 low = _mm256_sub_ps(_mm256_div_ps(_mm256_add_ps(_mm256_sub_ps(w, one), u), w), l);
    return log256(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), l), low, small_e));
}
#endif

/* splitmix64's finaliser: keys that differ in a few bits (consecutive seeds) get unrelated (k0, k1), where
   rows whose k1 agreed would hold the same stream shifted by the difference of their k0 */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* columns [c0, c1) of the row keyed key into out */
static void noise_span(uint64_t key, int c0, int c1, float* out) {
    key = mix64(key + 0x9e3779b97f4a7c15ull);
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    int i = c0;
#if INFERQ_HAVE_AVX512
    for (; i + 16 <= c1; i += 16) _mm512_storeu_ps(out + i, log_noise512(k0, k1, (uint32_t)i));
#elif INFERQ_HAVE_AVX2
    for (; i + 8 <= c1; i += 8) _mm256_storeu_ps(out + i, log_noise256(k0, k1, (uint32_t)i));
#endif
    for (; i < c1; i++) out[i] = log_noise_scalar(k0, k1, (uint32_t)i);
}

#define NOISE_SPAN 8192 /* columns per work item: a few microseconds, well above a thread hand-out */

/* out[r * os + i] = log E for column i < V of row r < R, keyed keys[r]; several spans go over the threads */
void race_log_noise(const uint64_t* keys, int R, int V, float* out, int64_t os) {
    const int spans = (V + NOISE_SPAN - 1) / NOISE_SPAN;
    const int64_t items = (int64_t)R * spans;
#pragma omp parallel for schedule(static) if (items > 2)
    for (int64_t it = 0; it < items; it++) {
        const int r = (int)(it / spans), c0 = (int)(it % spans) * NOISE_SPAN;
        noise_span(keys[r], c0, c0 + NOISE_SPAN < V ? c0 + NOISE_SPAN : V, out + r * os);
    }
}
