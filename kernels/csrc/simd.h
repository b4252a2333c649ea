/* Helpers shared by the CPU kernels (decode_attention.c, prefill_attention.c, packed_gemm.c): which instruction
   sets a build uses, bfloat16 and int8 widening, and the AVX2 / AVX-512 exp, horizontal sums and dot products.

   Build options (-D, passed by kernels/native.py's build(..., defines=...)); the instruction sets themselves
   come from the compiler's own macros (-march=native):
     INFERQ_NO_AVX512  leave the AVX-512 code out even where the compiler targets it (the AVX2 build, as on an
                       AVX2-only CPU; tests and side-by-side timings)
     INFERQ_NO_AVX2    leave every vector path out: portable loops only (the packed GEMM then does not build)
     INFERQ_STATIC_PANELS  share a product's panels in equal static halves, not guided (PANEL_SHARE below) */
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

/* How a product's panels are shared over the thread team (an orphaned `omp for ... nowait`): guided, large
   chunks first and smaller ones as the panels run out, so a thread slowed by its neighbour on the memory bus,
   or by work of its own before the product, hands its tail to the others instead of keeping them at the
   barrier after it (with static halves a float32 decode step ran 1.014x slower, twice, on a 2-core Zen 1 VM;
   int4 even). A panel is computed by one thread either way, so results do not depend on the schedule.
   INFERQ_STATIC_PANELS: equal static shares (side-by-side timings). */
#ifdef INFERQ_STATIC_PANELS
#define PANEL_SHARE _Pragma("omp for schedule(static) nowait")
#else
#define PANEL_SHARE _Pragma("omp for schedule(guided) nowait")
#endif

/* Helpers taking a compile-time constant (row count, bfloat16 or not) are always inlined, so each call site
   gets code specialised for its constants: the C form of a template. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The element kinds of the arrays the helpers read (a compile-time constant at every call site):
     ELEM_F32  float32
     ELEM_BF16 bfloat16
     ELEM_I8   int8 KV cache rows (kernels/kv_quant.py): D codes, then the row's float32 scale in 4 more bytes.
               The helpers widen the codes only; the scale (row_scale) is applied by the caller, once per row
               product, not once per element.
     ELEM_F8   float8 e4m3 KV cache rows, laid out as ELEM_I8's. A code widens exactly through float16: its
               7 magnitude bits shifted into a half's exponent and mantissa give the code's value times 2^-8
               (subnormals included; F16C's conversion is exact and ignores DAZ), and row_scale folds the 2^8
               back in, so 8 or 16 codes widen with a sign extension, a shift, an and and one vcvtph2ps. */
#define ELEM_F32 0
#define ELEM_BF16 1
#define ELEM_I8 2
#define ELEM_F8 3

ALWAYS_INLINE int elem_size(const int kind) { return kind == ELEM_F32 ? 4 : (kind == ELEM_BF16 ? 2 : 1); }

/* Whether rows of this kind carry their own scale (codes, then a float32 scale). */
ALWAYS_INLINE int scaled_rows(const int kind) { return kind == ELEM_I8 || kind == ELEM_F8; }

/* A float8 e4m3 code's value times 2^-8 (see ELEM_F8), exactly: the portable form of the float16 widening. */
static inline float f8_scaled(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e ? (float)(8 + m) * (float)(1 << e) : (float)m * 2.f; /* in units of 2^-18 */
    return (b & 0x80 ? -v : v) * 3.814697265625e-06f;                       /* 2^-18 */
}

/* Element i of p, an array of `kind` elements. */
ALWAYS_INLINE const void* elem_at(const void* p, int64_t i, const int kind) {
    return (const char*)p + i * elem_size(kind);
}

/* bfloat16 -> float32 is a 16-bit shift into the high half; an int8 code converts exactly. */
ALWAYS_INLINE float load1(const void* p, int64_t i, const int kind) {
    if (kind == ELEM_F32) return ((const float*)p)[i];
    if (kind == ELEM_I8) return (float)((const int8_t*)p)[i];
    if (kind == ELEM_F8) return f8_scaled(((const uint8_t*)p)[i]);
    const uint32_t u = ((uint32_t)((const uint16_t*)p)[i]) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The scale of the int8 or float8 row at `row` (its D codes, then the float32 scale, unaligned where the rows
   are; a float8 row's times 2^8, see ELEM_F8); 1 for the float kinds, whose rows are their values. */
ALWAYS_INLINE float row_scale(const void* row, int D, const int kind) {
    if (!scaled_rows(kind)) return 1.f;
    float s;
    memcpy(&s, (const char*)row + D, 4);
    return kind == ELEM_F8 ? s * 256.f : s;
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

/* 8 float8 e4m3 codes -> their 8 float16 bit patterns (value times 2^-8, see ELEM_F8): sign-extended to 16
   bits and shifted left by 7, a code lands its magnitude in bits 7-13 and its sign in bits 14 and 15 (the
   extension's ones); clearing bit 14 leaves the half. */
static inline __m128i f8_to_half8(__m128i b8) {
    return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b8), 7), _mm_set1_epi16((short)0xbfff));
}

/* 8 values from element i of p (float32, or bfloat16 / int8 / float8 codes widened) */
ALWAYS_INLINE __m256 load8(const void* p, int64_t i, const int kind) {
    if (kind == ELEM_F32) return _mm256_loadu_ps((const float*)p + i);
    if (kind == ELEM_I8) /* one 8-byte load sign-extended (vpmovsxbd folds the load), then converted exactly */
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)p + i))));
    if (kind == ELEM_F8)
        return _mm256_cvtph_ps(f8_to_half8(_mm_loadl_epi64((const __m128i*)((const uint8_t*)p + i))));
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

/* 32 floats quantised to int8 codes in [-127, 127] with one scale (llama.cpp's Q8_0 activations): d = amax / 127
   (float32, as the torch reference computes it), q = round(x * (1 / d)) to nearest even (cvtps under the default
   MXCSR mode, as torch.round), an all-zero block d = 0 and q = 0. Returns the codes in order; *d the scale.
   Shared by w8a8_gemm.c and quant_gemm.c's int8-activation tiles, so both quantise alike. */
static inline __m256i quant_block32(const float* x, float* d) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                   _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
    const float dd = _mm256_cvtss_f32(hmax8(m)) / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
    *d = dd;
    const __m256 s = _mm256_set1_ps(id);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, s));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, s));
    /* the packs interleave 128-bit lanes; the permute puts the 8 dwords of codes back in order */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_max_epi8(_mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                           _mm256_set1_epi8(-127));
}

/* q . k for the 8 rows at k + roff[0..7] (D = 8 * ND values each): 8 independent FMA chains, one per row,
   summed across lanes into one vector of 8 dot products (of the codes, for int8 rows: times row_scales8). */
ALWAYS_INLINE __m256 dot8(const float* q, const void* k, const int64_t* roff, int ND, const int kind) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
    for (int c = 0; c < ND; c++) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qc, load8(k, roff[t] + 8 * c, kind), a[t]);
    }
    return transpose_sum8(a);
}

/* the scales of the 8 int8 / float8 rows at k + roff[t] (all 8 offsets valid), lane t for row t; ones for float
   rows */
ALWAYS_INLINE __m256 row_scales8(const void* k, const int64_t* roff, int D, const int kind) {
    if (!scaled_rows(kind)) return _mm256_set1_ps(1.f);
    const char* p = (const char*)k;
    return _mm256_setr_ps(row_scale(p + roff[0], D, kind), row_scale(p + roff[1], D, kind),
                          row_scale(p + roff[2], D, kind), row_scale(p + roff[3], D, kind),
                          row_scale(p + roff[4], D, kind), row_scale(p + roff[5], D, kind),
                          row_scale(p + roff[6], D, kind), row_scale(p + roff[7], D, kind));
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
/* 16 values from element i of p (float32, or bfloat16 / int8 / float8 codes widened) */
ALWAYS_INLINE __m512 load16(const void* p, int64_t i, const int kind) {
    if (kind == ELEM_F32) return _mm512_loadu_ps((const float*)p + i);
    if (kind == ELEM_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)p + i))));
    if (kind == ELEM_F8) {
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)((const uint8_t*)p + i)));
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xbfff)));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the sum of the two 256-bit halves */
static inline __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif /* INFERQ_HAVE_AVX512 */

/* The paged KV cache of one layer as the attention kernels read it. Strides are in elements (bytes in an int8
   cache, whose rows are D + 4 wide: codes and scale); in the vector paths (power-of-two block sizes) position p
   of a sequence is row p & msk of block bt[p >> sh]. */
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
