/* Causal prefill attention from the paged cache: every prefill chunk of a step in one call. Sequence s's chunk
   of queries (positions ctx[s] onwards, their keys and values already written to the cache) attends to its keys
   0 .. its last position, read where they lie, so a chunk with earlier context needs no gather.

   A work item is one kv head x QB query rows (QB * G query vectors): keys are walked in chunks of 8 up to the
   item's last position, scores by 8 FMA chains per query vector, an online softmax (running max and sum, the
   accumulator rescaled when the max grows), and the weighted V sum register-blocked 3 query vectors x 4
   vectors of D at a time, so each V load feeds 3 FMAs. The vector path only (AVX2 + FMA; its q.k and V sums
   zmm-wide where AVX-512 is built and the head dim is a multiple of 16); elsewhere prefill_* return 1 and the
   caller falls back.

   Cache element kinds as in decode_attention.c: float32, bfloat16, and int8 / float8 rows (prefill_i8, _f8). The narrow ones
   are widened a key chunk at a time into float32 tiles that stay in L1 (see pitem); int8 codes are widened as
   they are, a chunk's 8 K row scales multiply its scores and its 8 V row scales its weights (after they are
   added to the softmax sum), one multiply per row. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define QB 8 /* query rows per work item */
#define MAX_NQ (QB * MAX_GROUP)

/* The arguments of prefill_f32 / prefill_bf16 / prefill_i8 (strides in elements: bytes for int8). */
typedef struct {
    const float* q;
    int64_t q_ts, q_hs;
    paged_cache c;
    const int32_t* bt;
    int64_t bt_ss;
    const int32_t* qs;  /* sequence s's queries are rows qs[s] .. qs[s + 1] */
    const int32_t* ctx; /* ... at positions ctx[s] onwards */
    float* out;
    int64_t o_ts, o_hs;
    int S, Hq, Hkv, D;
    float scale;
} prefill_args;

int has_prefill(void) { return INFERQ_HAVE_AVX2; }

#if INFERQ_HAVE_AVX2
/* a[j * D + 8 c] += the weights w[j * 8 + t] times the 8 V rows at v0 + roff[t]: NJ query vectors, CW ymm wide */
ALWAYS_INLINE void pv_avx2(const int KIND, const int NJ, const int CW, const void* v0, const int64_t* roff,
                           const float* w, float* a, int D) {
    __m256 r[3][4];
#pragma GCC unroll 3
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
        for (int c = 0; c < CW; c++) r[j][c] = _mm256_loadu_ps(a + (int64_t)j * D + 8 * c);
    for (int t = 0; t < 8; t++) {
        __m256 wt[3];
#pragma GCC unroll 3
        for (int j = 0; j < NJ; j++) wt[j] = _mm256_set1_ps(w[j * 8 + t]);
#pragma GCC unroll 4
        for (int c = 0; c < CW; c++) {
            const __m256 x = load8(v0, roff[t] + 8 * c, KIND);
#pragma GCC unroll 3
            for (int j = 0; j < NJ; j++) r[j][c] = _mm256_fmadd_ps(wt[j], x, r[j][c]);
        }
    }
#pragma GCC unroll 3
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
        for (int c = 0; c < CW; c++) _mm256_storeu_ps(a + (int64_t)j * D + 8 * c, r[j][c]);
}

/* the V sums of all nq query vectors of an item, ymm-wide (any head dim that is a multiple of 8) */
ALWAYS_INLINE void pvall_avx2(const int KIND, int nq, int ND, const void* v0, const int64_t* roff, const float* w,
                              float* acc, int D) {
    for (int j0 = 0; j0 < nq; j0 += 3)
        for (int c0 = 0; c0 < ND; c0 += 4) {
            const void* v = elem_at(v0, 8 * c0, KIND);
            const float* wj = w + j0 * 8;
            float* a = acc + (int64_t)j0 * D + 8 * c0;
            switch ((nq - j0 < 3 ? nq - j0 : 3) * 4 + (ND - c0 < 4 ? ND - c0 : 4)) {
                case 5: pv_avx2(KIND, 1, 1, v, roff, wj, a, D); break;
                case 6: pv_avx2(KIND, 1, 2, v, roff, wj, a, D); break;
                case 7: pv_avx2(KIND, 1, 3, v, roff, wj, a, D); break;
                case 8: pv_avx2(KIND, 1, 4, v, roff, wj, a, D); break;
                case 9: pv_avx2(KIND, 2, 1, v, roff, wj, a, D); break;
                case 10: pv_avx2(KIND, 2, 2, v, roff, wj, a, D); break;
                case 11: pv_avx2(KIND, 2, 3, v, roff, wj, a, D); break;
                case 12: pv_avx2(KIND, 2, 4, v, roff, wj, a, D); break;
                case 13: pv_avx2(KIND, 3, 1, v, roff, wj, a, D); break;
                case 14: pv_avx2(KIND, 3, 2, v, roff, wj, a, D); break;
                case 15: pv_avx2(KIND, 3, 3, v, roff, wj, a, D); break;
                default: pv_avx2(KIND, 3, 4, v, roff, wj, a, D); break;
            }
        }
}

#if INFERQ_HAVE_AVX512
/* q . k for the 8 key rows at k0 + roff[t]: zmm-wide (half the instructions) where the head dim is a multiple of
   16 */
ALWAYS_INLINE __m256 qk(const int KIND, const float* q, const void* k0, const int64_t* roff, int ND) {
    if (ND & 1) return dot8(q, k0, roff, ND, KIND);
    __m512 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm512_setzero_ps();
    for (int c = 0; c < ND / 2; c++) {
        const __m512 qc = _mm512_loadu_ps(q + 16 * c);
        for (int t = 0; t < 8; t++) a[t] = _mm512_fmadd_ps(qc, load16(k0, roff[t] + 16 * c, KIND), a[t]);
    }
    __m256 f[8];
    for (int t = 0; t < 8; t++) f[t] = fold512(a[t]);
    return transpose_sum8(f);
}

/* pv_avx2 with CW zmm of 16 values */
ALWAYS_INLINE void pv512(const int KIND, const int NJ, const int CW, const void* v0, const int64_t* roff,
                         const float* w, float* a, int D) {
    __m512 r[3][4];
#pragma GCC unroll 3
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
        for (int c = 0; c < CW; c++) r[j][c] = _mm512_loadu_ps(a + (int64_t)j * D + 16 * c);
    for (int t = 0; t < 8; t++) {
        __m512 wt[3];
#pragma GCC unroll 3
        for (int j = 0; j < NJ; j++) wt[j] = _mm512_set1_ps(w[j * 8 + t]);
#pragma GCC unroll 4
        for (int c = 0; c < CW; c++) {
            const __m512 x = load16(v0, roff[t] + 16 * c, KIND);
#pragma GCC unroll 3
            for (int j = 0; j < NJ; j++) r[j][c] = _mm512_fmadd_ps(wt[j], x, r[j][c]);
        }
    }
#pragma GCC unroll 3
    for (int j = 0; j < NJ; j++)
#pragma GCC unroll 4
        for (int c = 0; c < CW; c++) _mm512_storeu_ps(a + (int64_t)j * D + 16 * c, r[j][c]);
}

/* pvall_avx2, zmm-wide where the head dim is a multiple of 16 */
ALWAYS_INLINE void pvall(const int KIND, int nq, int ND, const void* v0, const int64_t* roff, const float* w,
                         float* acc, int D) {
    if (ND & 1) {
        pvall_avx2(KIND, nq, ND, v0, roff, w, acc, D);
        return;
    }
    const int N16 = ND / 2;
    for (int j0 = 0; j0 < nq; j0 += 3)
        for (int c0 = 0; c0 < N16; c0 += 4) {
            const void* v = elem_at(v0, 16 * c0, KIND);
            const float* wj = w + j0 * 8;
            float* a = acc + (int64_t)j0 * D + 16 * c0;
            switch ((nq - j0 < 3 ? nq - j0 : 3) * 4 + (N16 - c0 < 4 ? N16 - c0 : 4)) {
                case 5: pv512(KIND, 1, 1, v, roff, wj, a, D); break;
                case 6: pv512(KIND, 1, 2, v, roff, wj, a, D); break;
                case 7: pv512(KIND, 1, 3, v, roff, wj, a, D); break;
                case 8: pv512(KIND, 1, 4, v, roff, wj, a, D); break;
                case 9: pv512(KIND, 2, 1, v, roff, wj, a, D); break;
                case 10: pv512(KIND, 2, 2, v, roff, wj, a, D); break;
                case 11: pv512(KIND, 2, 3, v, roff, wj, a, D); break;
                case 12: pv512(KIND, 2, 4, v, roff, wj, a, D); break;
                case 13: pv512(KIND, 3, 1, v, roff, wj, a, D); break;
                case 14: pv512(KIND, 3, 2, v, roff, wj, a, D); break;
                case 15: pv512(KIND, 3, 3, v, roff, wj, a, D); break;
                default: pv512(KIND, 3, 4, v, roff, wj, a, D); break;
            }
        }
}
#else
ALWAYS_INLINE __m256 qk(const int KIND, const float* q, const void* k0, const int64_t* roff, int ND) {
    return dot8(q, k0, roff, ND, KIND);
}
ALWAYS_INLINE void pvall(const int KIND, int nq, int ND, const void* v0, const int64_t* roff, const float* w,
                         float* acc, int D) {
    pvall_avx2(KIND, nq, ND, v0, roff, w, acc, D);
}
#endif /* INFERQ_HAVE_AVX512 */

/* pvall out of line (float32 rows: the cache's own, or a widened tile), as the item's own registers are better
   left to its softmax step */
static __attribute__((noinline)) void pvall_f32(int nq, int ND, const void* v0, const int64_t* roff, const float* w,
                                                float* acc, int D) {
    pvall(ELEM_F32, nq, ND, v0, roff, w, acc, D);
}

/* The 8 rows at p + roff[t] (8 * ND values each; int8: the codes) widened to float32, row t at tile + t * 8 ND */
ALWAYS_INLINE void widen_rows(const int KIND, const void* p, const int64_t* roff, int ND, float* tile) {
    for (int t = 0; t < 8; t++)
        for (int c = 0; c < ND; c++) _mm256_storeu_ps(tile + (t * ND + c) * 8, load8(p, roff[t] + 8 * c, KIND));
}

/* One item's online-softmax step for the key chunk at kb (float32 rows k0 + roff[t]): w[j * 8 + t] = the weight
   of key kb + t for query vector j (0 where masked), m / l the running max / sum, acc rescaled where m grows.
   ks: the score scale of each key (int8: times its K row's scale); vs (SCALED, int8 rows): the V rows' scales,
   which multiply the weights stored in w but not the sum l. */
ALWAYS_INLINE void chunk_weights(const int SCALED, const prefill_args* a, const float* q, const void* k0,
                                 const int64_t* roff, int kb, int first_pos, int nr, int h, __m256 ks, __m256 vs,
                                 float* m, float* l, float* acc, float* w) {
    const int G = a->Hq / a->Hkv, ND = a->D / 8, D = a->D;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i kpos = _mm256_add_epi32(_mm256_set1_epi32(kb), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < nr; r++) {
        const int pos = first_pos + r;
        /* lanes with key position <= pos are visible */
        const __m256 vis = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(pos + 1), kpos));
        for (int g = 0; g < G; g++) {
            const int j = r * G + g;
            float* wj = w + j * 8;
            if (kb > pos) { _mm256_storeu_ps(wj, _mm256_setzero_ps()); continue; }
            const float* qj = q + (int64_t)r * a->q_ts + (int64_t)(h * G + g) * a->q_hs;
            const __m256 sv = _mm256_blendv_ps(ninf, _mm256_mul_ps(qk(ELEM_F32, qj, k0, roff, ND), ks), vis);
            const float cm = _mm256_cvtss_f32(hmax8(sv));
            if (cm > m[j]) { /* a new running max: rescale what is accumulated so far */
                const float alpha = m[j] == -INFINITY ? 0.f : expf(m[j] - cm);
                const __m256 va = _mm256_set1_ps(alpha);
                float* aj = acc + (int64_t)j * D;
                for (int c = 0; c < ND; c++) _mm256_storeu_ps(aj + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(aj + 8 * c), va));
                l[j] *= alpha;
                m[j] = cm;
            }
            const __m256 e = exp256(_mm256_sub_ps(sv, _mm256_set1_ps(m[j])));
            l[j] += hsum8(e);
            _mm256_storeu_ps(wj, SCALED ? _mm256_mul_ps(e, vs) : e);
        }
    }
}

/* Work item: kv head h, query rows r0 .. r0 + nr of sequence s. Rows of a bfloat16 or int8 cache are widened
   once per key chunk into float32 tiles (L1) that the item's nq query vectors then read: widened at each load
   instead, every K row would be converted nq times (24 at 3 query heads per kv head) and every V row nq / 3
   times, which made those caches slower to attend than float32 despite half or a quarter of the bytes. */
ALWAYS_INLINE void pitem(const int KIND, const prefill_args* a, int s, int r0, int nr, int h, float* acc,
                         float* w) {
    const paged_cache* c = &a->c;
    const int G = a->Hq / a->Hkv, nq = nr * G, ND = a->D / 8, D = a->D;
    const int first_pos = a->ctx[s] + r0, last = first_pos + nr - 1; /* the item's last query position */
    const int32_t* bt = a->bt + s * a->bt_ss;
    const float* q = a->q + (int64_t)(a->qs[s] + r0) * a->q_ts;
    const void* k0 = elem_at(c->k, (int64_t)h * c->c_hs, KIND);
    const void* v0 = elem_at(c->v, (int64_t)h * c->c_hs, KIND);
    float m[MAX_NQ], l[MAX_NQ];
    for (int j = 0; j < nq; j++) { m[j] = -INFINITY; l[j] = 0.f; }
    memset(acc, 0, sizeof(float) * (size_t)nq * (size_t)D);
    const __m256 vscale = _mm256_set1_ps(a->scale);
    float ktile[8 * 8 * MAX_ND], vtile[8 * 8 * MAX_ND];
    int64_t roff[8], toff[8]; /* the rows in the cache; in the tiles */
    for (int t = 0; t < 8; t++) toff[t] = (int64_t)t * D;
    const void* kr = KIND == ELEM_F32 ? k0 : (const void*)ktile;
    const void* vr = KIND == ELEM_F32 ? v0 : (const void*)vtile;
    const int64_t* ro = KIND == ELEM_F32 ? roff : toff;
    for (int kb = 0; kb <= last; kb += 8) {
        for (int t = 0; t < 8; t++) /* keys past the last position re-read row 0: masked */
            roff[t] = row_offset(c, bt, kb + t <= last ? kb + t : 0);
        if (KIND != ELEM_F32) {
            widen_rows(KIND, k0, roff, ND, ktile);
            widen_rows(KIND, v0, roff, ND, vtile);
        }
        const __m256 ks = scaled_rows(KIND) ? _mm256_mul_ps(row_scales8(k0, roff, D, KIND), vscale) : vscale;
        chunk_weights(scaled_rows(KIND), a, q, kr, ro, kb, first_pos, nr, h, ks, row_scales8(v0, roff, D, KIND), m, l,
                      acc, w);
        pvall_f32(nq, ND, vr, ro, w, acc, D);
    }
    float* out = a->out + (int64_t)(a->qs[s] + r0) * a->o_ts;
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < G; g++) {
            const int j = r * G + g;
            const __m256 sinv = _mm256_set1_ps(1.0f / l[j]);
            float* o = out + (int64_t)r * a->o_ts + (int64_t)(h * G + g) * a->o_hs;
            for (int k = 0; k < ND; k++)
                _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)j * D + 8 * k), sinv));
        }
}

static void pitem_f32(const prefill_args* a, int s, int r0, int nr, int h, float* acc, float* w) {
    const prefill_args l = *a; /* a local copy: vector stores cannot alias it */
    pitem(ELEM_F32, &l, s, r0, nr, h, acc, w);
}
static void pitem_bf16(const prefill_args* a, int s, int r0, int nr, int h, float* acc, float* w) {
    const prefill_args l = *a; /* a local copy: vector stores cannot alias it */
    pitem(ELEM_BF16, &l, s, r0, nr, h, acc, w);
}
static void pitem_i8(const prefill_args* a, int s, int r0, int nr, int h, float* acc, float* w) {
    const prefill_args l = *a; /* a local copy: vector stores cannot alias it */
    pitem(ELEM_I8, &l, s, r0, nr, h, acc, w);
}
static void pitem_f8(const prefill_args* a, int s, int r0, int nr, int h, float* acc, float* w) {
    const prefill_args l = *a; /* a local copy: vector stores cannot alias it */
    pitem(ELEM_F8, &l, s, r0, nr, h, acc, w);
}

/* Shares the items out, last first (the long causal items, late rows of long sequences, balance better first). */
static int prefill_shape(const prefill_args* a) {
    const int G = a->Hq / a->Hkv;
    return G * a->Hkv == a->Hq && G <= MAX_GROUP && vector_shape(a->D, a->c.bs);
}

/* first[s]: the first work item of sequence s (items: Hkv per block of QB query rows); first[S]: their count */
static void first_items(const prefill_args* a, int64_t* first) {
    first[0] = 0;
    for (int s = 0; s < a->S; s++)
        first[s + 1] = first[s] + (int64_t)a->Hkv * ((a->qs[s + 1] - a->qs[s] + QB - 1) / QB);
}

/* The items of one call shared over the team of the enclosing parallel region (an orphaned omp for, ending in
   its barrier; every member calls it). Returns 0, or 2 where this thread's scratch could not be allocated. */
static int prefill_share(int kind, const prefill_args* a, const int64_t* first) {
    const int Hkv = a->Hkv;
    const int64_t items = first[a->S];
    int err = 0;
    const unsigned int csr = flush_denormals();
    float* acc = (float*)malloc(sizeof(float) * (size_t)MAX_NQ * (size_t)a->D);
    float* w = (float*)malloc(sizeof(float) * (size_t)MAX_NQ * 8);
    if (!acc || !w) err = 2;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = items - 1; i >= 0; i--) {
        if (!acc || !w) continue;
        int s = 0;
        while (first[s + 1] <= i) s++;
        const int64_t local = i - first[s];
        const int h = (int)(local % Hkv), r0 = (int)(local / Hkv) * QB, lq = a->qs[s + 1] - a->qs[s];
        const int nr = lq - r0 < QB ? lq - r0 : QB;
        if (kind == ELEM_I8) pitem_i8(a, s, r0, nr, h, acc, w);
        else if (kind == ELEM_F8) pitem_f8(a, s, r0, nr, h, acc, w);
        else if (kind == ELEM_BF16) pitem_bf16(a, s, r0, nr, h, acc, w);
        else pitem_f32(a, s, r0, nr, h, acc, w);
    }
    free(acc);
    free(w);
    _mm_setcsr(csr);
    return err;
}

/* One call with a parallel region of its own. */
static int prefill(int kind, const prefill_args* a) {
    if (!prefill_shape(a)) return 1;
    int64_t* first = (int64_t*)malloc(sizeof(int64_t) * (size_t)(a->S + 1));
    if (!first) return 2;
    first_items(a, first);
    int err = 0;
#pragma omp parallel
    {
        const int e = prefill_share(kind, a, first);
        if (e) {
#pragma omp atomic write
            err = e;
        }
    }
    free(first);
    return err;
}

/* prefill_f32 / _bf16 / _i8 (kind ELEM_F32, ELEM_BF16, ELEM_I8) run by the team of an enclosing parallel region
   (kernels/csrc/decode_step.c): every member calls it; first: S + 1 int64 of scratch shared by the team. Ends
   with the team's barrier. Returns as prefill does, the same for every member but a failed allocation. */
int prefill_team(int kind, const float* q, int64_t q_ts, int64_t q_hs, const void* kc, const void* vc, int64_t c_bs,
                 int64_t c_ts, int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* qs, const int32_t* ctx,
                 float* out, int64_t o_ts, int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale,
                 int64_t* first) {
    const prefill_args a = {q, q_ts, q_hs, make_cache(kc, vc, c_bs, c_ts, c_hs, bs), bt, bt_ss, qs, ctx, out, o_ts,
                            o_hs, S, Hq, Hkv, D, scale};
    if (!prefill_shape(&a)) return 1;
#pragma omp single
    first_items(&a, first);
    return prefill_share(kind, &a, first);
}
#else
static int prefill(int kind, const prefill_args* a) {
    (void)kind;
    (void)a;
    return 1;
}
#endif /* INFERQ_HAVE_AVX2 */

/* Queries q [T, Hq, D] (row and head strides q_ts, q_hs), caches [blocks, bs, Hkv, D] (strides c_bs, c_ts,
   c_hs), block tables bt (row stride bt_ss), S sequences as in prefill_args, out like q. Returns 0, 1 where the
   shape is not handled (the caller falls back), 2 where memory ran out. prefill_i8 / prefill_f8: caches of int8 /
   float8 e4m3 rows [blocks, bs, Hkv, D + 4] (D codes, then the float32 scale), strides in bytes, D the head dim. */
/* One entry point per cache element type T (kind KIND), the same arguments otherwise. */
#define PREFILL_ENTRY(NAME, T, KIND)                                                                                \
    int NAME(const float* q, int64_t q_ts, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,      \
             int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* qs, const int32_t* ctx, float* out,     \
             int64_t o_ts, int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale) {                      \
        const prefill_args a = {q, q_ts, q_hs, make_cache(kc, vc, c_bs, c_ts, c_hs, bs), bt, bt_ss, qs, ctx, out,    \
                                o_ts, o_hs, S, Hq, Hkv, D, scale};                                                  \
        return prefill(KIND, &a);                                                                                   \
    }

PREFILL_ENTRY(prefill_f32, float, ELEM_F32)
PREFILL_ENTRY(prefill_bf16, uint16_t, ELEM_BF16)
PREFILL_ENTRY(prefill_i8, int8_t, ELEM_I8)
PREFILL_ENTRY(prefill_f8, uint8_t, ELEM_F8)
