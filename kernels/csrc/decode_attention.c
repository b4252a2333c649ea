/* Batched decode attention straight from the paged KV cache: one query token per sequence against its first
   lens[s] cached positions, K and V read once, block by block, where they lie (no gather into a padded copy),
   softmax and sums in float32 whatever the cache element type (float32: decode_f32, bfloat16: decode_bf16,
   int8 or float8 e4m3 rows of codes and a scale: decode_i8, decode_f8). Work items are shared out over torch's OpenMP threads.

   int8 rows (kernels/kv_quant.py) are read as they lie, never unpacked to memory: the codes are widened in
   registers, a score is the dot product with the codes times the K row's scale (one multiply per row, not per
   element), and each V row's scale is folded into its softmax weight before the weighted sum. The softmax sum
   is of the weights themselves, so the results are those of the unpacked rows up to float summation order.

   Three paths: portable loops (any head dim and block size), AVX2 + FMA (head dims that are multiples of 8 up
   to 128, power-of-two blocks), and, where built, AVX-512 work items for head dims that are multiples of 16.
   set_generic / set_avx512 force a path at run time (tests, side-by-side timings). The paths share the argument
   block, the passes and the output step, hence one file of ~650 lines; the element kind (ELEM_F32 / ELEM_BF16 /
   ELEM_I8 / ELEM_F8 of simd.h) is a compile-time constant of every inlined helper, one copy of each path per kind. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "simd.h"
#include "team.h"

#define MAX_HEADS 64 /* query heads per work item of the vector paths */

/* The arguments of decode_f32 / decode_bf16 / decode_i8 (strides in elements: bytes for int8). */
typedef struct {
    const float* q;
    int64_t q_ss, q_hs;
    paged_cache c;
    const int32_t* bt;
    int64_t bt_ss;
    const int32_t* lens; /* context length of each sequence, its query token included */
    float* out;
    int64_t o_ss, o_hs;
    int S, Hq, Hkv, D, max_len;
    float scale;
} decode_args;

static int use_avx512 = 1;    /* the AVX-512 items where built; set_avx512(0) keeps the AVX2 ones */
static int force_generic = 0; /* set_generic(1) routes every call to the portable loops */
static int use_split = 1;     /* set_split(0): few sequences one kv head per item, never split (context_parts) */
static int use_groups = 1;    /* set_head_groups(0): the AVX2 passes take one query head at a time (head_group) */

void set_avx512(int on) { use_avx512 = on; }
void set_generic(int on) { force_generic = on; }
void set_split(int on) { use_split = on; }
void set_head_groups(int on) { use_groups = on; }
int has_avx512(void) { return INFERQ_HAVE_AVX512; }
/* 1 if the vector path is built in */
int has_simd(void) { return vector_shape(16, 16); }

/* ---- portable loops: one (sequence, kv head) item, its G query heads against all `len` positions ---- */

/* pass 1: the scaled scores sc[g * len + p] and each query head's max m[g] */
ALWAYS_INLINE void generic_scores(const int KIND, const decode_args* a, const float* q, const void* kc,
                                  const int32_t* bt, int len, int G, float* sc, float* m) {
    const int D = a->D, bs = a->c.bs, nblk = (len + bs - 1) / bs;
    const int64_t c_bs = a->c.c_bs, c_ts = a->c.c_ts, q_hs = a->q_hs;
    const float scale = a->scale;
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    for (int b = 0; b < nblk; b++) {
        const int64_t base = (int64_t)bt[b] * c_bs;
        const int n = (b == nblk - 1) ? len - b * bs : bs;
        for (int t = 0; t < n; t++) {
            const void* k = elem_at(kc, base + (int64_t)t * c_ts, KIND);
            const float ks = row_scale(k, D, KIND) * scale; /* an int8 row's scale, once per dot product */
            const int p = b * bs + t;
            for (int g = 0; g < G; g++) {
                const float* qg = q + (int64_t)g * q_hs;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qg[d] * load1(k, d, KIND);
                s *= ks;
                sc[(int64_t)g * len + p] = s;
                if (s > m[g]) m[g] = s;
            }
        }
    }
}

/* pass 3: acc[g * D + d] = the sum over positions of weight sc[g * len + p] times V */
ALWAYS_INLINE void generic_vsum(const int KIND, const decode_args* a, const void* vc, const int32_t* bt, int len,
                                int G, const float* sc, float* acc) {
    const int D = a->D, bs = a->c.bs, nblk = (len + bs - 1) / bs;
    const int64_t c_bs = a->c.c_bs, c_ts = a->c.c_ts;
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
    for (int b = 0; b < nblk; b++) {
        const int64_t base = (int64_t)bt[b] * c_bs;
        const int n = (b == nblk - 1) ? len - b * bs : bs;
        for (int t = 0; t < n; t++) {
            const void* v = elem_at(vc, base + (int64_t)t * c_ts, KIND);
            const float vs = row_scale(v, D, KIND); /* folded into the weight: the codes are summed as they are */
            const int p = b * bs + t;
            for (int g = 0; g < G; g++) {
                const float w = sc[(int64_t)g * len + p] * vs;
                float* ag = acc + (int64_t)g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ag[d] += w * load1(v, d, KIND);
            }
        }
    }
}

ALWAYS_INLINE void generic_item(const int KIND, const decode_args* a, int s, int h, float* sc, float* acc) {
    const int G = a->Hq / a->Hkv, D = a->D, len = a->lens[s];
    const float* q = a->q + s * a->q_ss + (int64_t)h * G * a->q_hs;
    const int32_t* bt = a->bt + s * a->bt_ss;
    float m[MAX_GROUP], sum[MAX_GROUP];
    generic_scores(KIND, a, q, elem_at(a->c.k, h * a->c.c_hs, KIND), bt, len, G, sc, m);
    for (int g = 0; g < G; g++) { /* pass 2: scores -> unnormalised softmax weights */
        float* row = sc + (int64_t)g * len;
        float z = 0.f;
        const float mg = m[g];
        for (int p = 0; p < len; p++) { const float e = expf(row[p] - mg); row[p] = e; z += e; }
        sum[g] = z;
    }
    generic_vsum(KIND, a, elem_at(a->c.v, h * a->c.c_hs, KIND), bt, len, G, sc, acc);
    for (int g = 0; g < G; g++) {
        const float inv = 1.f / sum[g];
        float* o = a->out + s * a->o_ss + (int64_t)(h * G + g) * a->o_hs;
        const float* ag = acc + (int64_t)g * D;
        for (int d = 0; d < D; d++) o[d] = ag[d] * inv;
    }
}

static void generic_item_f32(const decode_args* a, int s, int h, float* sc, float* acc) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    generic_item(ELEM_F32, &l, s, h, sc, acc);
}
static void generic_item_bf16(const decode_args* a, int s, int h, float* sc, float* acc) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    generic_item(ELEM_BF16, &l, s, h, sc, acc);
}
static void generic_item_i8(const decode_args* a, int s, int h, float* sc, float* acc) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    generic_item(ELEM_I8, &l, s, h, sc, acc);
}
static void generic_item_f8(const decode_args* a, int s, int h, float* sc, float* acc) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    generic_item(ELEM_F8, &l, s, h, sc, acc);
}

/* The portable items, shared over the team of the enclosing parallel region (an orphaned omp for, ending in
   its barrier); *err gets 2 where this thread's scratch could not be allocated. */
static void generic_share(int kind, const decode_args* a, int* err) {
    const int G = a->Hq / a->Hkv, S = a->S, Hkv = a->Hkv;
    float* sc = (float*)malloc(sizeof(float) * (size_t)G * (size_t)(a->max_len > 0 ? a->max_len : 1));
    float* acc = (float*)malloc(sizeof(float) * (size_t)G * (size_t)a->D);
    if (!sc || !acc) {
#pragma omp atomic write
        *err = 2;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < (int64_t)S * Hkv; i++) {
        if (!sc || !acc) continue;
        const int s = (int)(i / Hkv), h = (int)(i % Hkv);
        if (a->lens[s] <= 0) continue;
        if (kind == ELEM_I8) generic_item_i8(a, s, h, sc, acc);
        else if (kind == ELEM_F8) generic_item_f8(a, s, h, sc, acc);
        else if (kind == ELEM_BF16) generic_item_bf16(a, s, h, sc, acc);
        else generic_item_f32(a, s, h, sc, acc);
    }
    free(sc);
    free(acc);
}

static int generic_shape(const decode_args* a) {
    const int G = a->Hq / a->Hkv;
    return G <= MAX_GROUP && G * a->Hkv == a->Hq;
}

#if INFERQ_HAVE_AVX2
/* ---- vector paths: one item is kv heads [h0, h1) of one sequence ----
   A cache row holds every kv head of one position, so walking positions in chunks of 8, heads inside, streams
   each block once front to back (per-head items read rows at a stride the hardware prefetcher serves poorly).
   The AVX2 item makes three passes: the scores (scaled, -inf past len), then unnormalised softmax weights, then
   the weighted V rows accumulated chunk by chunk into acc (L1-resident); the output is acc / sum. Both row passes
   take a kv head's query heads in groups of up to 3 (head_group), each K or V chunk loaded and widened once for
   the group rather than once a head: in the fused step on a Zen 3 (library swapped every 2 steps), a lone w4a8
   sequence 1.025x at 300 positions and 1.046x at 1,000, three of them 1.03x and 1.066x, bfloat16 1.014-1.025x;
   the kernel alone at 1,000 positions 1.17x (bfloat16 cache). The AVX-512 item makes one pass, with an online
   softmax (item512 says why). */

/* Software prefetch of chunks this far ahead: the blocks are scattered, so the hardware prefetcher cannot run
   ahead across them. */
#define PF_CHUNKS 4
/* into L2, not L1: a prefetch into L1 holds one of its few miss buffers until the line comes, so fewer lines are
   in flight. Measured in the fused step at one sequence (Zen 4 VM, A/B in one process): attention 0.84x on the
   AVX-512 path and 0.80x on the AVX2 one against the same prefetches into L1. */
#define PF_HINT _MM_HINT_T1

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

/* A context part's softmax partials, where asked (split_share): per query head j its max and its sum. */
static void item_stats(float* stats, int nh, const __m256* mx, const float* inv) {
    if (!stats) return;
    for (int j = 0; j < nh; j++) {
        stats[2 * j] = _mm256_cvtss_f32(hmax8(mx[j]));
        stats[2 * j + 1] = 1.0f / inv[j];
    }
}

/* out row of query head h * G + g = acc row j / its softmax sum, for the item's nh query heads */
static void store_output(const decode_args* a, int s, int h0, int nh, const float* acc, const float* inv) {
    const int ND = a->D / 8;
    float* out = a->out + s * a->o_ss + (int64_t)h0 * (a->Hq / a->Hkv) * a->o_hs;
    for (int j = 0; j < nh; j++) {
        const __m256 sv = _mm256_set1_ps(inv[j]);
        float* o = out + (int64_t)j * a->o_hs;
        for (int c = 0; c < ND; c++)
            _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)j * a->D + 8 * c), sv));
    }
}

/* Prefetch the rows (all kv heads) of positions p0..p0+7 below len. Always inlined: to GCC a function that only
   prefetches has no side effects, and a call to it out of line is deleted. Rows that are not a whole number of
   lines (int8: Hkv * (D + 4) bytes) also get their last byte's line, which a row starting mid-line spills into. */
ALWAYS_INLINE void prefetch_rows(const void* base, const paged_cache* c, const int32_t* bt, int p0, int len,
                                   int row_bytes, int es) {
    for (int t = 0; t < 8 && p0 + t < len; t++) {
        const char* r = (const char*)base + row_offset(c, bt, p0 + t) * es;
        for (int l = 0; l < row_bytes; l += 64) _mm_prefetch(r + l, PF_HINT);
        if (row_bytes & 63) _mm_prefetch(r + row_bytes - 1, PF_HINT);
    }
}

/* An item's V rows up to this many bytes are prefetched into L2 during its K pass: a quarter of L2 (sysconf;
   256 KiB where it does not say), so they are still there a pass later. */
static int64_t early_v_bytes(void) {
    static int64_t limit = 0; /* read once per process; threads racing to set it write the same value */
    int64_t l;
#pragma omp atomic read
    l = limit;
    if (!l) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l = l2 > 0 ? l2 / 4 : 256 * 1024;
#pragma omp atomic write
        limit = l;
    }
    return l;
}

/* Before an item's K pass: the K rows of its first PF_CHUNKS chunks, which the passes' own prefetches (PF_CHUNKS
   chunks ahead) never cover. Returns whether its V rows are small enough to prefetch during the K pass. Why:
   attention over a cold cache waited on memory (a single sequence's 400 positions read at 7-11 GB/s against the
   weights' 30), most of it at the start of each pass of each item. */
ALWAYS_INLINE int item_prefetch(const paged_cache* c, const int32_t* bt, int len, int es) {
    const int row_bytes = (int)(c->c_ts * es);
    for (int b = 0; b < PF_CHUNKS; b++) prefetch_rows(c->k, c, bt, b * 8, len, row_bytes, es);
    return (int64_t)len * row_bytes <= early_v_bytes();
}

/* The row offsets of chunk b's 8 positions; past len (the last chunk) row 0 again, masked or skipped later. */
static inline void chunk_offsets(const paged_cache* c, const int32_t* bt, int b, int n, int64_t* roff) {
    for (int t = 0; t < 8; t++) roff[t] = row_offset(c, bt, b * 8 + (t < n ? t : 0));
}

/* Query heads of one kv head taken together by the AVX2 passes: 3 (2 where 4 are left, so no group is of one);
   a group of one is dot8 / vrow_avx2's. */
static inline int head_group(int left) { return !use_groups ? 1 : left == 4 ? 2 : left < 3 ? left : 3; }

/* dot8 for the NG query heads q, q + q_hs, ... of one kv head: each K chunk loaded (and widened) once for all of
   them, not once a head, 4 rows at a time (12 accumulators). Each dot product is dot8's FMA chain in its order,
   and rows 0-3 and 4-7 are summed across lanes as transpose_sum8 sums them: equal results, bit for bit. */
ALWAYS_INLINE void dot8_heads(const int NG, const float* q, int64_t q_hs, const void* k, const int64_t* roff, int ND,
                              const int kind, __m256* out) {
    __m256 u[2][3];
    for (int half = 0; half < 2; half++) {
        __m256 a[3][4];
        _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) a[g][t] = _mm256_setzero_ps();
        for (int c = 0; c < ND; c++)
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                const __m256 kc = load8(k, roff[4 * half + t] + 8 * c, kind);
                _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)
                    a[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * q_hs + 8 * c), kc, a[g][t]);
            }
        _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)
            u[half][g] = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
    }
    _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)
        out[g] = _mm256_add_ps(_mm256_permute2f128_ps(u[0][g], u[1][g], 0x20),
                               _mm256_permute2f128_ps(u[0][g], u[1][g], 0x31));
}

/* vrow_avx2 for NG query heads at once (weights w[g] of each): each V chunk loaded once for all of them, NC
   chunks at a time (NG * NC accumulators). Each accumulator adds the rows in vrow_avx2's order: equal results. */
ALWAYS_INLINE void vrow_heads(const int KIND, const int NG, const int NC, const void* v0, const int64_t* roff, int n,
                              const float* const* w, float* const* a, int c0) {
    __m256 r[3][4];
    _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)
        _Pragma("GCC unroll 4") for (int k = 0; k < NC; k++) r[g][k] = _mm256_loadu_ps(a[g] + 8 * (c0 + k));
    for (int t = 0; t < n; t++) {
        const void* v = elem_at(v0, roff[t], KIND);
        _Pragma("GCC unroll 4") for (int k = 0; k < NC; k++) {
            const __m256 vk = load8(v, 8 * (c0 + k), KIND);
            _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)
                r[g][k] = _mm256_fmadd_ps(_mm256_set1_ps(w[g][t]), vk, r[g][k]);
        }
    }
    _Pragma("GCC unroll 3") for (int g = 0; g < NG; g++)
        _Pragma("GCC unroll 4") for (int k = 0; k < NC; k++) _mm256_storeu_ps(a[g] + 8 * (c0 + k), r[g][k]);
}

/* vrow_heads over a whole row (ND chunks), its head count made a compile-time constant */
ALWAYS_INLINE void vrows_heads(const int KIND, int ng, int ND, const void* v0, const int64_t* roff, int n,
                               const float* const* w, float* const* a) {
    for (int c0 = 0; c0 < ND; c0 += 4) {
        const int nc = ND - c0 < 4 ? ND - c0 : 4;
#define VROWS(NG, NC) vrow_heads(KIND, NG, NC, v0, roff, n, w, a, c0)
        if (ng == 3) {
            if (nc == 4) VROWS(3, 4); else if (nc == 3) VROWS(3, 3); else if (nc == 2) VROWS(3, 2); else VROWS(3, 1);
        } else {
            if (nc == 4) VROWS(2, 4); else if (nc == 3) VROWS(2, 3); else if (nc == 2) VROWS(2, 2); else VROWS(2, 1);
        }
#undef VROWS
    }
}

/* AVX2 pass 1: sc[j * lpad + p] and the running max lanes mx[j] of each query head j of the item */
ALWAYS_INLINE void scores_avx2(const int KIND, const decode_args* a, const float* q, const int32_t* bt, int len,
                               int h0, int h1, float* sc, __m256* mx) {
    const paged_cache* c = &a->c;
    const int G = a->Hq / a->Hkv, ND = a->D / 8, nch = (len + 7) / 8, lpad = nch * 8, es = elem_size(KIND);
    const __m256 vscale = _mm256_set1_ps(a->scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t roff[8];
    const int early_v = item_prefetch(c, bt, len, es);
    for (int b = 0; b < nch; b++) {
        const int n = (b == nch - 1) ? len - b * 8 : 8;
        chunk_offsets(c, bt, b, n, roff);
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
        prefetch_rows(c->k, c, bt, (b + PF_CHUNKS) * 8, len, (int)(c->c_ts * es), es);
        if (early_v) prefetch_rows(c->v, c, bt, b * 8, len, (int)(c->c_ts * es), es);
        for (int h = h0; h < h1; h++) {
            const void* k0 = elem_at(c->k, (int64_t)h * c->c_hs, KIND);
            /* int8: the 8 rows' scales times the softmax scale, lane t for row t */
            const __m256 ks = scaled_rows(KIND) ? _mm256_mul_ps(row_scales8(k0, roff, a->D, KIND), vscale) : vscale;
            for (int g0 = 0, ng; g0 < G; g0 += ng) {
                /* float32 rows: no widening to share, and dot8 holds each q chunk in a register for 8 rows (one
                   load per FMA, against 4 per 3 here): measured 1.01x slower taken together */
                ng = KIND == ELEM_F32 ? 1 : head_group(G - g0);
                const float* qg = q + (int64_t)(h * G + g0) * a->q_hs;
                __m256 dots[3];
                if (ng == 3) dot8_heads(3, qg, a->q_hs, k0, roff, ND, KIND, dots);
                else if (ng == 2) dot8_heads(2, qg, a->q_hs, k0, roff, ND, KIND, dots);
                else dots[0] = dot8(qg, k0, roff, ND, KIND);
                for (int i = 0; i < ng; i++) {
                    const int j = (h - h0) * G + g0 + i;
                    const __m256 r = _mm256_blendv_ps(ninf, _mm256_mul_ps(dots[i], ks), valid);
                    _mm256_storeu_ps(sc + (int64_t)j * lpad + b * 8, r);
                    mx[j] = _mm256_max_ps(mx[j], r);
                }
            }
        }
    }
}

/* a[0 .. 8 NC) += the weights w[t] times the n rows at v0 + roff[t], NC accumulators held in registers */
ALWAYS_INLINE void vrow_avx2(const int KIND, const int NC, const void* v0, const int64_t* roff, int n,
                             const float* w, float* a) {
    __m256 r[8];
#pragma GCC unroll 8
    for (int k = 0; k < NC; k++) r[k] = _mm256_loadu_ps(a + 8 * k);
    for (int t = 0; t < n; t++) {
        const __m256 wt = _mm256_set1_ps(w[t]);
        const void* v = elem_at(v0, roff[t], KIND);
#pragma GCC unroll 8
        for (int k = 0; k < NC; k++) r[k] = _mm256_fmadd_ps(wt, load8(v, 8 * k, KIND), r[k]);
    }
#pragma GCC unroll 8
    for (int k = 0; k < NC; k++) _mm256_storeu_ps(a + 8 * k, r[k]);
}

/* vrow_avx2 with its width made a compile-time constant */
ALWAYS_INLINE void vrow_avx2n(const int KIND, int nc, const void* v0, const int64_t* roff, int n, const float* w,
                              float* a) {
    switch (nc) {
        case 1: vrow_avx2(KIND, 1, v0, roff, n, w, a); break;
        case 2: vrow_avx2(KIND, 2, v0, roff, n, w, a); break;
        case 3: vrow_avx2(KIND, 3, v0, roff, n, w, a); break;
        case 4: vrow_avx2(KIND, 4, v0, roff, n, w, a); break;
        case 5: vrow_avx2(KIND, 5, v0, roff, n, w, a); break;
        case 6: vrow_avx2(KIND, 6, v0, roff, n, w, a); break;
        case 7: vrow_avx2(KIND, 7, v0, roff, n, w, a); break;
        default: vrow_avx2(KIND, 8, v0, roff, n, w, a); break;
    }
}

/* AVX2 pass 3: acc[j * D ..] = the weighted sum of V for each query head j (acc zeroed first) */
ALWAYS_INLINE void vsum_avx2(const int KIND, const decode_args* a, const int32_t* bt, int len, int h0, int h1,
                             const float* sc, float* acc) {
    const paged_cache* c = &a->c;
    const int G = a->Hq / a->Hkv, ND = a->D / 8, D = a->D, nch = (len + 7) / 8, lpad = nch * 8, es = elem_size(KIND);
    int64_t roff[8];
    float vs[8], ws[3][8]; /* int8: the rows' scales, and the chunk's weights times them */
    for (int b = 0; b < nch; b++) {
        const int n = (b == nch - 1) ? len - b * 8 : 8;
        for (int t = 0; t < n; t++) roff[t] = row_offset(c, bt, b * 8 + t);
        prefetch_rows(c->v, c, bt, (b + PF_CHUNKS) * 8, len, (int)(c->c_ts * es), es);
        for (int h = h0; h < h1; h++) {
            const void* v0 = elem_at(c->v, (int64_t)h * c->c_hs, KIND);
            if (scaled_rows(KIND))
                for (int t = 0; t < n; t++) vs[t] = row_scale(elem_at(v0, roff[t], KIND), D, KIND);
            for (int g0 = 0, ng; g0 < G; g0 += ng) {
                ng = head_group(G - g0);
                const float* w[3];
                float* aj[3];
                for (int i = 0; i < ng; i++) {
                    const int j = (h - h0) * G + g0 + i;
                    w[i] = sc + (int64_t)j * lpad + b * 8;
                    if (scaled_rows(KIND)) {
                        for (int t = 0; t < n; t++) ws[i][t] = w[i][t] * vs[t];
                        w[i] = ws[i];
                    }
                    aj[i] = acc + (int64_t)j * D;
                }
                if (ng > 1) {
                    vrows_heads(KIND, ng, ND, v0, roff, n, w, aj);
                    continue;
                }
                for (int c0 = 0; c0 < ND; c0 += 8) /* up to 8 accumulators in registers */
                    vrow_avx2n(KIND, ND - c0 < 8 ? ND - c0 : 8, elem_at(v0, 8 * c0, KIND), roff, n, w[0],
                               aj[0] + 8 * c0);
            }
        }
    }
}

ALWAYS_INLINE void item_avx2(const int KIND, const decode_args* a, int s, int h0, int h1, float* sc, float* acc,
                           float* stats) {
    const int len = a->lens[s], nh = (h1 - h0) * (a->Hq / a->Hkv), lpad = (len + 7) / 8 * 8;
    const int32_t* bt = a->bt + s * a->bt_ss;
    __m256 mx[MAX_HEADS];
    for (int j = 0; j < nh; j++) mx[j] = _mm256_set1_ps(-INFINITY);
    scores_avx2(KIND, a, a->q + s * a->q_ss, bt, len, h0, h1, sc, mx);
    float inv[MAX_HEADS];
    softmax_rows(sc, nh, lpad, mx, inv);
    item_stats(stats, nh, mx, inv);
    memset(acc, 0, sizeof(float) * (size_t)nh * (size_t)a->D);
    vsum_avx2(KIND, a, bt, len, h0, h1, sc, acc);
    store_output(a, s, h0, nh, acc, inv);
}

static void item_avx2_f32(const decode_args* a, int s, int h0, int h1, float* sc, float* acc, float* stats) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    item_avx2(ELEM_F32, &l, s, h0, h1, sc, acc, stats);
}
static void item_avx2_bf16(const decode_args* a, int s, int h0, int h1, float* sc, float* acc, float* stats) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    item_avx2(ELEM_BF16, &l, s, h0, h1, sc, acc, stats);
}
static void item_avx2_i8(const decode_args* a, int s, int h0, int h1, float* sc, float* acc, float* stats) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    item_avx2(ELEM_I8, &l, s, h0, h1, sc, acc, stats);
}
static void item_avx2_f8(const decode_args* a, int s, int h0, int h1, float* sc, float* acc, float* stats) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    item_avx2(ELEM_F8, &l, s, h0, h1, sc, acc, stats);
}

#if INFERQ_HAVE_AVX512
/* AVX-512 items, for head dims that are multiples of 16 (one zmm per 16 values). Scores: the K row of each
   position is loaded once per kv head and feeds up to 3 of its query heads (24 accumulators: 8 positions x 3
   heads), folded to 8 lanes and summed across by transpose_sum8. The V sum: 3 query heads x 4 zmm of D per
   chunk. The prefetches of the rows PF_CHUNKS chunks ahead go one line per load, spread through the work instead
   of in a burst. One pass instead of the AVX2 item's three (item512): results equal up to rounding. */

/* chunk_offsets, and, where chunk b + PF_CHUNKS exists, its row offsets for prefetching (clamped to len);
   returns whether it exists */
static inline int chunk_rows(const paged_cache* c, const int32_t* bt, int len, int nch, int b, int64_t* roff,
                             int64_t* pfoff) {
    const int n = (b == nch - 1) ? len - b * 8 : 8, pb = b + PF_CHUNKS;
    chunk_offsets(c, bt, b, n, roff);
    if (pb < nch)
        for (int t = 0; t < 8; t++) pfoff[t] = row_offset(c, bt, pb * 8 + t < len ? pb * 8 + t : len - 1);
    return pb < nch;
}

/* the scores of NG query heads (q_hs apart) against the 8 rows at k0 + roff[t]; prefetches pf0 + pfoff[t] */
ALWAYS_INLINE void kdot512(const int KIND, const int NG, const float* q, int64_t q_hs, const void* k0,
                           const int64_t* roff, const void* pf0, const int64_t* pfoff, int ND16, __m256* out) {
    __m512 a[3][8];
#pragma GCC unroll 3
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) a[g][t] = _mm512_setzero_ps();
    for (int c = 0; c < ND16; c++) {
        __m512 qv[3];
#pragma GCC unroll 3
        for (int g = 0; g < NG; g++) qv[g] = _mm512_loadu_ps(q + g * q_hs + 16 * c);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m512 kv = load16(k0, roff[t] + 16 * c, KIND);
            if (pf0) _mm_prefetch((const char*)elem_at(pf0, pfoff[t] + 16 * c, KIND), PF_HINT);
#pragma GCC unroll 3
            for (int g = 0; g < NG; g++) a[g][t] = _mm512_fmadd_ps(qv[g], kv, a[g][t]);
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < NG; g++) {
        __m256 f[8];
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) f[t] = fold512(a[g][t]);
        out[g] = transpose_sum8(f);
    }
}

/* acc rows of NG query heads (D apart), NC zmm wide, += the weights w[g * wstride + t] times the n rows at
   v0 + roff[t]; prefetches pf0 + pfoff[t] */
ALWAYS_INLINE void vsum512(const int KIND, const int NG, const int NC, const void* v0, const int64_t* roff, int n,
                           const float* w, int64_t wstride, float* acc, int D, const void* pf0,
                           const int64_t* pfoff) {
    __m512 r[3][4];
#pragma GCC unroll 3
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) r[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
    for (int t = 0; t < n; t++) {
        __m512 wt[3];
#pragma GCC unroll 3
        for (int g = 0; g < NG; g++) wt[g] = _mm512_set1_ps(w[g * wstride + t]);
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) {
            const __m512 x = load16(v0, roff[t] + 16 * c, KIND);
            if (pf0) _mm_prefetch((const char*)elem_at(pf0, pfoff[t] + 16 * c, KIND), PF_HINT);
#pragma GCC unroll 3
            for (int g = 0; g < NG; g++) r[g][c] = _mm512_fmadd_ps(wt[g], x, r[g][c]);
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + g * D + 16 * c, r[g][c]);
}

/* int8 rows: prefetch the line of the last byte (the scale) of the 8 rows at p0 + pfoff[t], which the loads'
   one-line-per-16-codes prefetches can stop short of */
ALWAYS_INLINE void prefetch_tails(const int KIND, const void* p0, const int64_t* pfoff, int D) {
    if (!scaled_rows(KIND)) return;
    for (int t = 0; t < 8; t++) _mm_prefetch((const char*)p0 + pfoff[t] + D + 3, PF_HINT);
}

/* kdot512 / vsum512 with their head and width counts made compile-time constants */
ALWAYS_INLINE void kdot512n(const int KIND, int ng, const float* q, int64_t q_hs, const void* k0,
                            const int64_t* roff, const void* pf0, const int64_t* pfoff, int ND16, __m256* out) {
    if (ng == 3) kdot512(KIND, 3, q, q_hs, k0, roff, pf0, pfoff, ND16, out);
    else if (ng == 2) kdot512(KIND, 2, q, q_hs, k0, roff, pf0, pfoff, ND16, out);
    else kdot512(KIND, 1, q, q_hs, k0, roff, pf0, pfoff, ND16, out);
}

ALWAYS_INLINE void vsum512n(const int KIND, int ng, int nc, const void* v0, const int64_t* roff, int n,
                            const float* w, int64_t wstride, float* acc, int D, const void* pf0,
                            const int64_t* pfoff) {
    switch (ng * 4 + nc) {
        case 5: vsum512(KIND, 1, 1, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
        case 6: vsum512(KIND, 1, 2, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
        case 8: vsum512(KIND, 1, 4, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
        case 9: vsum512(KIND, 2, 1, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
        case 10: vsum512(KIND, 2, 2, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
        case 12: vsum512(KIND, 2, 4, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
        case 13: vsum512(KIND, 3, 1, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
        case 14: vsum512(KIND, 3, 2, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
        default: vsum512(KIND, 3, 4, v0, roff, n, w, wstride, acc, D, pf0, pfoff); break;
    }
}

/* A chunk's scores for the item's query heads, scaled and -inf past len: sv[j] for query head j of kv heads
   [h0, h1); prefetches the K rows of chunk b + PF_CHUNKS (pfoff) where pf */
ALWAYS_INLINE void chunk_scores512(const int KIND, const decode_args* a, const float* q, const int64_t* roff,
                                   const int64_t* pfoff, int pf, int n, int h0, int h1, __m256* sv) {
    const paged_cache* c = &a->c;
    const int G = a->Hq / a->Hkv, ND16 = a->D / 16;
    const __m256 vscale = _mm256_set1_ps(a->scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 valid = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    for (int h = h0; h < h1; h++) {
        const void* k0 = elem_at(c->k, (int64_t)h * c->c_hs, KIND);
        const __m256 ks = scaled_rows(KIND) ? _mm256_mul_ps(row_scales8(k0, roff, a->D, KIND), vscale) : vscale;
        if (pf) prefetch_tails(KIND, k0, pfoff, a->D);
        for (int g0 = 0; g0 < G; g0 += 3) {
            const int ng = G - g0 < 3 ? G - g0 : 3, j = (h - h0) * G + g0;
            kdot512n(KIND, ng, q + (int64_t)(h * G + g0) * a->q_hs, a->q_hs, k0, roff, (pf && g0 == 0) ? k0 : 0,
                     pfoff, ND16, sv + j);
            for (int g = 0; g < ng; g++) sv[j + g] = _mm256_blendv_ps(ninf, _mm256_mul_ps(sv[j + g], ks), valid);
        }
    }
}

/* Online softmax over one chunk: query head j's running max m[j] rises to its chunk's where that is larger (its
   running sums, lane sums lv[j] and acc row j, scaled down by e^(old - new)), and w[8 j + t] = e^(s_t - m[j]). */
ALWAYS_INLINE void chunk_weights512(int nh, int D, const __m256* sv, float* m, __m256* lv, float* acc, float* w) {
    for (int j = 0; j < nh; j++) {
        const float top = _mm256_cvtss_f32(hmax8(sv[j]));
        if (top > m[j]) {
            if (m[j] != -INFINITY) {
                const float f = expf(m[j] - top);
                const __m512 f16 = _mm512_set1_ps(f);
                lv[j] = _mm256_mul_ps(lv[j], _mm256_set1_ps(f));
                float* row = acc + (int64_t)j * D;
                for (int c = 0; c < D; c += 16) _mm512_storeu_ps(row + c, _mm512_mul_ps(f16, _mm512_loadu_ps(row + c)));
            }
            m[j] = top;
        }
        const __m256 e = exp256(_mm256_sub_ps(sv[j], _mm256_set1_ps(m[j])));
        lv[j] = _mm256_add_ps(lv[j], e);
        _mm256_storeu_ps(w + 8 * j, e);
    }
}

/* A chunk's V rows into acc, weighted by w (8 a query head, int8 / float8 rows: times each row's scale);
   prefetches the V rows of chunk b + PF_CHUNKS (pfoff) where pf */
ALWAYS_INLINE void chunk_values512(const int KIND, const decode_args* a, const int64_t* roff, const int64_t* pfoff,
                                   int pf, int n, int h0, int h1, const float* w, float* acc) {
    const paged_cache* c = &a->c;
    const int G = a->Hq / a->Hkv, D = a->D, ND16 = D / 16, nc = ND16 % 4 == 0 ? 4 : (ND16 % 2 == 0 ? 2 : 1);
    float vs[8], ws[3 * 8];
    for (int h = h0; h < h1; h++) {
        const void* v0 = elem_at(c->v, (int64_t)h * c->c_hs, KIND);
        if (scaled_rows(KIND))
            for (int t = 0; t < n; t++) vs[t] = row_scale(elem_at(v0, roff[t], KIND), D, KIND);
        if (pf) prefetch_tails(KIND, v0, pfoff, D);
        for (int g0 = 0; g0 < G; g0 += 3) {
            const int ng = G - g0 < 3 ? G - g0 : 3, j = (h - h0) * G + g0;
            const float* wj = w + 8 * j;
            if (scaled_rows(KIND)) {
                for (int g = 0; g < ng; g++)
                    for (int t = 0; t < n; t++) ws[g * 8 + t] = wj[g * 8 + t] * vs[t];
                wj = ws;
            }
            for (int c0 = 0; c0 < ND16; c0 += nc) {
                const void* vc0 = elem_at(v0, 16 * c0, KIND);
                vsum512n(KIND, ng, nc, vc0, roff, n, wj, 8, acc + (int64_t)j * D + 16 * c0, D,
                         (pf && g0 == 0) ? vc0 : 0, pfoff);
            }
        }
    }
}

/* The AVX-512 item in one pass over its positions (the AVX2 item takes three): each chunk's K rows, its softmax
   weights against the running max, then its V rows. Why: no score rows written and read back and one walk of the
   block table, so fewer instructions per position, which is what bounds this item even on a cold cache (one
   thread over warm rows 1.13x the three passes; the one-sequence step on a Zen 5 1.01-1.04x, more at longer
   contexts). Results differ from the AVX2 item's by rounding only. */
ALWAYS_INLINE void item512(const int KIND, const decode_args* a, int s, int h0, int h1, float* sc, float* acc,
                           float* stats) {
    (void)sc;
    const paged_cache* c = &a->c;
    const int len = a->lens[s], nh = (h1 - h0) * (a->Hq / a->Hkv), nch = (len + 7) / 8, es = elem_size(KIND);
    const int32_t* bt = a->bt + s * a->bt_ss;
    const float* q = a->q + s * a->q_ss;
    float m[MAX_HEADS], w[MAX_HEADS * 8], inv[MAX_HEADS];
    __m256 lv[MAX_HEADS], sv[MAX_HEADS];
    for (int j = 0; j < nh; j++) m[j] = -INFINITY, lv[j] = _mm256_setzero_ps();
    memset(acc, 0, sizeof(float) * (size_t)nh * (size_t)a->D);
    int64_t roff[8], pfoff[8] = {0}; /* pfoff: read only where chunk_rows filled it */
    const int row_bytes = (int)(c->c_ts * es);
    for (int b = 0; b < PF_CHUNKS; b++) {
        prefetch_rows(c->k, c, bt, b * 8, len, row_bytes, es);
        prefetch_rows(c->v, c, bt, b * 8, len, row_bytes, es);
    }
    for (int b = 0; b < nch; b++) {
        const int n = (b == nch - 1) ? len - b * 8 : 8;
        const int pf = chunk_rows(c, bt, len, nch, b, roff, pfoff);
        chunk_scores512(KIND, a, q, roff, pfoff, pf, n, h0, h1, sv);
        chunk_weights512(nh, a->D, sv, m, lv, acc, w);
        chunk_values512(KIND, a, roff, pfoff, pf, n, h0, h1, w, acc);
    }
    for (int j = 0; j < nh; j++) {
        const float sum = hsum8(lv[j]);
        inv[j] = 1.0f / sum;
        if (stats) stats[2 * j] = m[j], stats[2 * j + 1] = sum;
    }
    store_output(a, s, h0, nh, acc, inv);
}

static void item512_f32(const decode_args* a, int s, int h0, int h1, float* sc, float* acc, float* stats) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    item512(ELEM_F32, &l, s, h0, h1, sc, acc, stats);
}
static void item512_bf16(const decode_args* a, int s, int h0, int h1, float* sc, float* acc, float* stats) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    item512(ELEM_BF16, &l, s, h0, h1, sc, acc, stats);
}
static void item512_i8(const decode_args* a, int s, int h0, int h1, float* sc, float* acc, float* stats) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    item512(ELEM_I8, &l, s, h0, h1, sc, acc, stats);
}
static void item512_f8(const decode_args* a, int s, int h0, int h1, float* sc, float* acc, float* stats) {
    const decode_args l = *a; /* a local copy: vector stores cannot alias it */
    item512(ELEM_F8, &l, s, h0, h1, sc, acc, stats);
}
#endif /* INFERQ_HAVE_AVX512 */

/* Whether the vector items of head dim D are the AVX-512 ones (built, enabled, D a multiple of 16) */
static inline int wide_items(int D) { return INFERQ_HAVE_AVX512 && use_avx512 && (D / 8) % 2 == 0; }

/* one vector work item: the AVX-512 form where `wide` (built, enabled, head dim a multiple of 16), else AVX2 */
static inline void vector_item(int kind, int wide, const decode_args* a, int s, int h0, int h1, float* sc,
                               float* acc, float* stats) {
#if INFERQ_HAVE_AVX512
    if (wide) {
        if (kind == ELEM_I8) item512_i8(a, s, h0, h1, sc, acc, stats);
        else if (kind == ELEM_F8) item512_f8(a, s, h0, h1, sc, acc, stats);
        else if (kind == ELEM_BF16) item512_bf16(a, s, h0, h1, sc, acc, stats);
        else item512_f32(a, s, h0, h1, sc, acc, stats);
        return;
    }
#else
    (void)wide;
#endif
    if (kind == ELEM_I8) item_avx2_i8(a, s, h0, h1, sc, acc, stats);
    else if (kind == ELEM_F8) item_avx2_f8(a, s, h0, h1, sc, acc, stats);
    else if (kind == ELEM_BF16) item_avx2_bf16(a, s, h0, h1, sc, acc, stats);
    else item_avx2_f32(a, s, h0, h1, sc, acc, stats);
}

/* the vector path: whole sequences per item when there are enough to share out, else one kv head per item */
/* Query heads per vector work item for `threads` threads: whole sequences when there are enough to share out, else
   one kv head per item (a single long sequence still uses every thread); 0 where the shape is not handled. */
static int vector_heads_per_item(const decode_args* a, int threads) {
    const int G = a->Hq / a->Hkv, Hkv = a->Hkv;
    if (G * Hkv != a->Hq || !vector_shape(a->D, a->c.bs)) return 0;
    int per = (a->S >= 4 * threads) ? Hkv : 1;
    while (per > 1 && (per * G > MAX_HEADS || Hkv % per)) per--;
    return per * G > MAX_HEADS ? 0 : per;
}

/* The vector items, shared over the team of the enclosing parallel region like generic_share. */
static void vector_share(int kind, const decode_args* a, int per, int* err) {
    const int G = a->Hq / a->Hkv, S = a->S;
    const int parts = a->Hkv / per, wide = wide_items(a->D);
    const unsigned int csr = flush_denormals(); /* results differ from IEEE by < 1e-38 */
    const int lp = ((a->max_len > 0 ? a->max_len : 1) + 7) / 8 * 8;
    float* sc = (float*)malloc(sizeof(float) * (size_t)(per * G) * (size_t)lp);
    float* acc = (float*)malloc(sizeof(float) * (size_t)(per * G) * (size_t)a->D);
    if (!sc || !acc) {
#pragma omp atomic write
        *err = 2;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < (int64_t)S * parts; i++) {
        if (!sc || !acc) continue;
        const int s = (int)(i / parts), h0 = (int)(i % parts) * per;
        if (a->lens[s] <= 0) continue;
        vector_item(kind, wide, a, s, h0, h0 + per, sc, acc, NULL);
    }
    free(sc);
    free(acc);
    _mm_setcsr(csr);
}

/* Context parts per sequence (1: no split). With few sequences the items above are one kv head each, and a thread
   then reads every row's slice of its head, strided: 1.7x slower per byte than whole rows (python -m
   bench.cpu_kernels decode-long). Split instead, each item reads whole rows of one stretch of a sequence: two
   stretches a sequence, or more where that leaves a thread without one (one item per thread), each at least
   the shortest stretch (below); the parts' softmax partials are merged. Few items, not several a thread for
   balance: every item starts its prefetch stream cold, and in the fused step (two threads, alternated in one engine,
   docs/BENCHMARKS.md) a lone sequence's step ran 1.02-1.08x faster at 1,000-4,000 positions with two stretches
   than with six to eight, and two or three sequences 1.02x with two stretches each than with four or three.
   The shortest stretch depends on the items' path, as measured in the fused step (docs/BENCHMARKS.md, sessions
   31 and 32): the AVX2 items' strided head reads cost more, so short contexts split from 32 positions a
   stretch (Zen 3, 64-250 positions: one or two sequences 1.01-1.05x at every dtype against 128), while the
   AVX-512 items gained nothing below 128 (Zen 4: 0.98-1.005x at 32 or 64). */
#define SPLIT_MIN_512 128
#define SPLIT_MIN_AVX2 32
#define MAX_PARTS 64
static int context_parts(const decode_args* a, int threads) {
    if (!use_split || a->S >= 4 * threads || a->Hq > MAX_HEADS) return 1;
    const int shortest = wide_items(a->D) ? SPLIT_MIN_512 : SPLIT_MIN_AVX2;
    int parts = (threads + a->S - 1) / a->S;
    if (parts < 2) parts = 2;
    if (parts > a->max_len / shortest) parts = a->max_len / shortest;
    if (parts > MAX_PARTS) parts = MAX_PARTS;
    if (parts * a->S > threads) parts -= (parts * a->S) % threads / a->S; /* whole rounds of items where it can */
    return parts < 2 ? 1 : parts;
}

/* Positions per part of a sequence of len positions: a whole number of blocks, so that a part's block table is
   the sequence's from a block on. */
static int part_size(int len, int parts, int bs) {
    const int size = (len + parts - 1) / parts;
    return (size + bs - 1) / bs * bs;
}

/* Query head h of sequence s from its parts' outputs (each normalised by its own sum) and softmax partials:
   weights e^(max_p - max) sum_p. Empty parts (sum 0) weigh nothing; a sequence with none is left as it is. */
static void merge_parts(const decode_args* a, int parts, const float* part_out, const float* stats, int s, int h) {
    const int Hq = a->Hq, D = a->D;
    float top = -INFINITY;
    for (int p = 0; p < parts; p++) {
        const float* st = stats + (((int64_t)s * parts + p) * Hq + h) * 2;
        if (st[1] > 0.0f && st[0] > top) top = st[0];
    }
    if (top == -INFINITY) return;
    float w[MAX_PARTS], total = 0.0f;
    for (int p = 0; p < parts; p++) {
        const float* st = stats + (((int64_t)s * parts + p) * Hq + h) * 2;
        w[p] = st[1] > 0.0f ? expf(st[0] - top) * st[1] : 0.0f;
        total += w[p];
    }
    float* out = a->out + s * a->o_ss + (int64_t)h * a->o_hs;
    for (int c = 0; c < D; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int p = 0; p < parts; p++)
            if (w[p] > 0.0f)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(w[p]),
                                      _mm256_loadu_ps(part_out + (((int64_t)s * parts + p) * Hq + h) * D + c), acc);
        _mm256_storeu_ps(out + c, _mm256_div_ps(acc, _mm256_set1_ps(total)));
    }
}

/* The split items over the team, then the merge, each thread taking every members-th item (the parts are whole
   rounds where they can be). No libgomp construct: the team's own barrier (team.h) and scratch kept across calls
   (`ts`). With libgomp's single-copyprivate, dynamic loop and merge loop and three mallocs a call, the attention
   phase of a lone w4a8 sequence at 300 positions took 1.2x as long and the step 1.01-1.02x (Zen 4 VM,
   alternated in one engine). */
static void split_share(int kind, const decode_args* a, int parts, team_scratch* ts, int* err) {
    const int S = a->S, Hq = a->Hq, D = a->D, bs = a->c.bs, me = omp_get_thread_num(), members = omp_get_num_threads();
    const int wide = wide_items(D);
    const int lp = (part_size(a->max_len, parts, bs) + 7) / 8 * 8;
    if (me == 0) /* [S, parts, Hq, D] part outputs, then [S, parts, Hq, 2] their (max, sum) */
        ts->failed = !team_scratch_grow(&ts->shared, &ts->shared_cap, (size_t)S * parts * Hq * (D + 2));
    float* own = me < ts->members ? team_scratch_grow(ts->own + me, ts->own_cap + me, (size_t)Hq * (lp + D)) : NULL;
    team_barrier_wait(ts->bar, members); /* shared grown; every reader of the last call is past its last barrier */
    if (ts->failed || !own) {
#pragma omp atomic write
        *err = 2;
    }
    if (ts->failed) { /* every member sees it: all return here, past the same barriers */
        team_barrier_wait(ts->bar, members);
        return;
    }
    float* part_out = ts->shared;
    float* stats = ts->shared + (size_t)S * parts * Hq * D;
    const unsigned int csr = flush_denormals();
    for (int64_t i = me; i < (int64_t)S * parts; i += members) {
        const int s = (int)(i / parts), p = (int)(i % parts), len = a->lens[s];
        const int size = part_size(len > 0 ? len : 1, parts, bs), t0 = p * size;
        int n = len - t0 < size ? len - t0 : size;
        float* st = stats + i * Hq * 2;
        if (n <= 0 || !own) {
            for (int j = 0; j < Hq; j++) st[2 * j] = -INFINITY, st[2 * j + 1] = 0.0f;
            continue;
        }
        decode_args l = *a; /* the part as a sequence of its own: its block table from block t0 / bs on */
        l.q = a->q + s * a->q_ss;
        l.bt = a->bt + s * a->bt_ss + t0 / bs;
        l.lens = &n;
        l.out = part_out + i * Hq * D;
        l.o_ss = 0;
        l.o_hs = D;
        l.S = 1;
        l.max_len = size;
        vector_item(kind, wide, &l, 0, 0, a->Hkv, own, own + (size_t)Hq * lp, st);
    }
    team_barrier_wait(ts->bar, members);
    for (int64_t i = me; i < (int64_t)S * Hq; i += members)
        merge_parts(a, parts, part_out, stats, (int)(i / Hq), (int)(i % Hq));
    _mm_setcsr(csr);
    team_barrier_wait(ts->bar, members); /* the caller reads the outputs */
}
#endif /* INFERQ_HAVE_AVX2 */

/* The items of one call shared over `threads` threads of the team that runs this (every member calls it, all
   reach the work-sharing loop's barrier): the vector path where it handles the shape, else the portable one.
   Returns 0, 1 where the shape is not handled (before any barrier, the same for every member), 2 where this
   thread's scratch could not be allocated. */
static int decode_share(int kind, const decode_args* a, int threads, team_scratch* ts) {
    int err = 0;
#if INFERQ_HAVE_AVX2
    if (vector_shape(a->D, a->c.bs) && !force_generic) {
        const int parts = context_parts(a, threads);
        if (parts > 1) {
            split_share(kind, a, parts, ts, &err);
            return err;
        }
        const int per = vector_heads_per_item(a, threads);
        if (!per) return 1;
        vector_share(kind, a, per, &err);
        return err;
    }
#else
    (void)threads;
    (void)ts;
#endif
    if (!generic_shape(a)) return 1;
    generic_share(kind, a, &err);
    return err;
}

/* One call with a parallel region of its own. */
static int decode(int kind, const decode_args* a) {
    const int threads = omp_get_max_threads();
    int err = 0;
    team_barrier bar;
    team_scratch ts;
    team_barrier_init(&bar);
    if (team_scratch_init(&ts, &bar, threads)) {
        team_scratch_free(&ts);
        return 2;
    }
#pragma omp parallel
    {
        const int e = decode_share(kind, a, threads, &ts);
        if (e) {
#pragma omp atomic write
            err = e;
        }
    }
    team_scratch_free(&ts);
    return err;
}

/* Attention of one query token per sequence: q [S, Hq, D] (sequence and head strides q_ss, q_hs), caches of
   [blocks, bs, Hkv, D] (strides c_bs, c_ts, c_hs), block tables bt (row stride bt_ss), lens[S], out like q.
   Returns 0, 1 where the shape is not handled, 2 where memory ran out. decode_i8 / decode_f8: caches of int8 /
   float8 e4m3 rows [blocks, bs, Hkv, D + 4] (D codes, then the float32 scale), strides in bytes, D the head dim. */
/* One entry point per cache element type T (kind KIND), the same arguments otherwise. */
#define DECODE_ENTRY(NAME, T, KIND)                                                                                 \
    int NAME(const float* q, int64_t q_ss, int64_t q_hs, const T* kc, const T* vc, int64_t c_bs, int64_t c_ts,      \
             int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* lens, float* out, int64_t o_ss,         \
             int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale, int max_len) {                       \
        const decode_args a = {q, q_ss, q_hs, make_cache(kc, vc, c_bs, c_ts, c_hs, bs), bt, bt_ss, lens, out,       \
                               o_ss, o_hs, S, Hq, Hkv, D, max_len, scale};                                          \
        return decode(KIND, &a);                                                                                    \
    }

DECODE_ENTRY(decode_f32, float, ELEM_F32)
DECODE_ENTRY(decode_bf16, uint16_t, ELEM_BF16)
DECODE_ENTRY(decode_i8, int8_t, ELEM_I8)
DECODE_ENTRY(decode_f8, uint8_t, ELEM_F8)

/* decode_f32 / decode_bf16 / decode_i8 (kind ELEM_F32, ELEM_BF16, ELEM_I8) run by the team of an enclosing parallel
   region (kernels/csrc/decode_step.c): every member calls it with the team's scratch (team.h, its barrier the
   team's); it ends with the team's barrier. */
int decode_team(int kind, const float* q, int64_t q_ss, int64_t q_hs, const void* kc, const void* vc, int64_t c_bs,
                int64_t c_ts, int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* lens, float* out,
                int64_t o_ss, int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale, int max_len,
                team_scratch* ts) {
    const decode_args a = {q, q_ss, q_hs, make_cache(kc, vc, c_bs, c_ts, c_hs, bs), bt, bt_ss, lens, out, o_ss,
                           o_hs, S, Hq, Hkv, D, max_len, scale};
    return decode_share(kind, &a, omp_get_num_threads(), ts);
}
