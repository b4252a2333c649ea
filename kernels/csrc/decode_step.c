/* One small step of a Llama-family decoder (a few sequences decoding one token each, or a few tokens each:
   speculative proposals, short prefill chunks): every layer inside one OpenMP parallel region, the thread team
   meeting at a barrier between the phases of a layer.

   Why: at batch 1 a step is about ten operations per layer (two norms, four products, RoPE, the KV write,
   attention, SwiGLU), each of which, as a torch op or a ctypes call, pays its dispatch, a fork and join of the
   thread team, and the Python between it and the next: together more than the attention itself, for a step
   whose floor is reading the weights once. Here the team is forked once per step. The arithmetic is the same
   functions the separate calls run (the packed GEMM tiles, rms_norm_f32, rope_interleaved_f32, silu_mul_f32,
   the decode attention kernel), in the same order, so the result is bit-identical to the op-by-op forward
   (tests/unit/test_decode_step.py); a bfloat16 model's step is computed in float32 here (kernels/decode_step.py
   says why). Float32 activations; float32, bfloat16 (widened), int8 or int4 weight panels
   (kernels/csrc/quant_gemm.c); a float32, bfloat16, int8 or float8 KV cache. The final norm and the LM head run inside the
   same region where the head is in panels too. Built with those kernels' sources into one library
   (kernels/decode_step.py). */
#include <math.h>
#include <omp.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "team.h"

/* Built with INFERQ_STEP_PHASES (bench/latency.py's breakdown only): each thread adds the wall time of every
   phase of the step to phase_ns[thread][phase], read and cleared by step_phases(); otherwise PHASE() is nothing.
   A product's phase ends when its share is done; the wait at the barrier after it is a phase of its own. */
#ifdef INFERQ_STEP_PHASES
#include <time.h>
enum { PH_NORM, PH_QKV, PH_WAIT_QKV, PH_ROPE_KV, PH_ATTN, PH_O, PH_WAIT_O, PH_GATE_UP, PH_WAIT_GATE_UP, PH_SILU,
       PH_DOWN, PH_WAIT_DOWN, PH_HEAD, PH_COUNT };
#define PHASE_THREADS 64
static double phase_ns[PHASE_THREADS][PH_COUNT];
static inline double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}
#define PHASE_START() double ph_last = now_ns(); const int ph_tid = omp_get_thread_num() % PHASE_THREADS
#define PHASE(P)                                                                                             \
    do {                                                                                                     \
        const double ph_now = now_ns();                                                                      \
        phase_ns[ph_tid][P] += ph_now - ph_last;                                                             \
        ph_last = ph_now;                                                                                    \
    } while (0)
/* out[t * PH_COUNT + p]: thread t's nanoseconds in phase p since the last call, for min(threads, PHASE_THREADS)
   threads; returns the phase count */
int step_phases(double* out, int threads) {
    for (int t = 0; t < threads && t < PHASE_THREADS; t++)
        for (int p = 0; p < PH_COUNT; p++) {
            out[t * PH_COUNT + p] = phase_ns[t][p];
            phase_ns[t][p] = 0.0;
        }
    return PH_COUNT;
}
#else
#define PHASE_START() do { } while (0)
#define PHASE(P) do { } while (0)
#endif

/* the ops it chains, from their own sources in this library */
void gemm_team(int bf16, const float* x, int64_t xs, const void* wp, const float* b, float* y, int64_t ys, int M,
               int N, int K, int accumulate);
void gemm_panel(int bf16, const float* x, int64_t xs, const void* wp, int p, float* y, int64_t ys, int M, int N,
                int K);
int qgemm_team(int fmt, const float* x, int64_t xs, const void* wp, const void* s, int G, const float* b, float* y,
               int64_t ys, int M, int N, int K, int accumulate);
int decode_team(int kind, const float* q, int64_t q_ss, int64_t q_hs, const void* kc, const void* vc, int64_t c_bs,
                int64_t c_ts, int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* lens, float* out,
                int64_t o_ss, int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale, int max_len,
                team_scratch* ts);
int prefill_team(int kind, const float* q, int64_t q_ts, int64_t q_hs, const void* kc, const void* vc, int64_t c_bs,
                 int64_t c_ts, int64_t c_hs, const int32_t* bt, int64_t bt_ss, const int32_t* qs, const int32_t* ctx,
                 float* out, int64_t o_ts, int64_t o_hs, int S, int Hq, int Hkv, int D, int bs, float scale,
                 int64_t* first);
void rms_norm_f32(const float* x, int64_t xs, const float* w, float* y, int64_t ys, int T, int H, float eps);
void rms_norm_rows_f32(const float* x, int64_t xs, const float* w, float* y, int64_t ys, int T, int H, float eps);
void rope_interleaved_f32(float* x, int64_t xs, const float* rot, int64_t rs, int T, int heads, int half);
void silu_mul_to_f32(const float* gu, int64_t rs, float* out, int64_t os, int T, int inter);

/* One projection's weight in panels of 16 output columns: float32 or bfloat16 ([ceil(N/16), K, 16],
   kernels/packed_gemm.py), or int8 / int4 codes with their scales (kernels/quant_panels.py); int4's multiplied
   with float or with int8 activations (qgemm_team's format is the kind less W_I8). */
/* int4 kinds may have 4 added (float16 scales: quant_gemm.c's FMT_HALF) */
enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_I4 = 3, W_I4A8 = 4 /* int4 times int8 activations */ };
typedef struct {
    const void* w;
    const float* bias;   /* or NULL */
    const void* scales; /* int8: per column; int4: per group, scales then offsets (float32 or 16); else NULL */
    int kind;            /* W_F32 .. W_I4A8 */
    int group;           /* int4 group size */
} step_proj;

/* One layer: its four products, the norms' float32 weights, and its K and V pools [blocks, bs, Hkv, D]. */
typedef struct {
    step_proj qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    void *k_cache, *v_cache;
} step_layer;

/* The model's shape and buffers (set once) and the step's inputs (set per call); kernels/decode_step.py's
   ctypes Structure mirrors it field for field. */
typedef struct {
    const step_layer* layers;
    int L, H, Hq, Hkv, D, inter;
    int kv_kind; /* ELEM_F32 or ELEM_BF16 */
    int bs;
    int64_t c_bs, c_ts, c_hs; /* cache strides in elements */
    float eps, scale;
    float *qkv, *attn, *gu; /* scratch rows: [M, (Hq + 2 Hkv) D], [M, Hq D], [M, 2 inter] */
    float* x;                   /* [M, H]: the step's tokens embedded in, the last layer's residual stream out */
    int M;
    const float* rot;     /* [M, D/2, 2]: cos and sin of each token's position per frequency */
    int rope_half;        /* q/k pairs (j, j + D/2), the checkpoint's order (a bfloat16 model's); else interleaved */
    const int64_t* slots; /* [M]: each token's cache slot (block * bs + offset); < 0 writes nothing */
    /* the leading nd sequences decode one token each (rows 0..nd-1) */
    int nd;
    const int32_t* bt; /* their block tables [nd, bt_ss] */
    int64_t bt_ss;
    const int32_t* lens; /* their context lengths, the new token included */
    int max_len;
    /* then np chunks of several tokens (speculative proposals, short prefills), rows nd..M-1 */
    int np;
    const int32_t* p_bt; /* their block tables [np, p_bt_ss] */
    int64_t p_bt_ss;
    const int32_t* p_qs;  /* [np + 1]: each chunk's first row, counted from row nd */
    const int32_t* p_ctx; /* [np]: each chunk's earlier context (its first token's position) */
    int64_t* p_first;     /* np + 1 int64 of scratch */
    /* the head, where its weight is in panels too (else head.w is NULL and the caller runs it): the final norm
       of rows[0..R) of x (all M rows, in order, where rows is NULL), then logits [R, V] */
    const float* final_norm;
    step_proj head;
    int V, R;
    const int64_t* rows;
    float* logits;
    /* where screen.w is set (rows whose argmax alone is read: greedy), the head screened (screen_head) */
    step_proj screen;      /* the head's weight rounded to fewer bytes, in panels of its own kind */
    const float* screen_c; /* [V]: |screened - exact logit of column i| <= |row|_2 * screen_c[i] */
    int64_t* screen_panels; /* the panels recomputed are added here (bench/latency.py counts the bytes read) */
    const float* screen_add; /* [R, V] or NULL: each row's argmax is that of logits + these (the sampler's race) */
    const int32_t* screen_k; /* [R] or NULL: where > 0, the row's that many largest logits are read instead */
} step_args;

/* The rotate-half form of rope_interleaved_f32 (the pairs of a head are (j, j + half)), for a model that keeps
   the checkpoint's q/k order: the bfloat16 forward's, whose step is computed here in float32. */
static void rope_half_f32(float* x, int64_t xs, const float* rot, int64_t rs, int T, int heads, int half) {
    for (int t = 0; t < T; t++) {
        const float* r = rot + (int64_t)t * rs;
        for (int h = 0; h < heads; h++) {
            float* p = x + (int64_t)t * xs + (int64_t)h * 2 * half;
            for (int j = 0; j < half; j++) {
                const float a = p[j], b = p[j + half], c = r[2 * j], s = r[2 * j + 1];
                p[j] = a * c - b * s;
                p[j + half] = a * s + b * c;
            }
        }
    }
}

/* One int8 cache row as kernels/kv_quant.py's pack makes it, bit for bit: codes round(x / s) (to nearest even)
   with s = max(max |x|, 1e-30) / 127, then the 4 bytes of s. */
static void pack_i8_row(const float* x, int D, int8_t* row) {
    float amax = 0.f;
    for (int i = 0; i < D; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float s = fmaxf(amax, 1e-30f) / 127.f;
    for (int i = 0; i < D; i++) {
        const float q = nearbyintf(x[i] / s);
        row[i] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
    }
    memcpy(row + D, &s, 4);
}

/* float32 -> float8 e4m3 (fn) bits as torch converts (round to nearest even; |x| <= 448 here, the row's scale
   sees to that): below 2^-6 the subnormal step 2^-9 is rounded by adding 2^14 in float32, above by rounding the
   mantissa to 3 bits and re-biasing the exponent. */
uint8_t f8_from_f32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u >= (1087u << 20)) { /* 480 and above (none here): NaN, as torch */
        r = 0x7f;
    } else if (u < (121u << 23)) {
        float f, big;
        const uint32_t magic = 141u << 23; /* 2^14 */
        memcpy(&f, &u, 4);
        memcpy(&big, &magic, 4);
        f += big;
        memcpy(&u, &f, 4);
        r = (uint8_t)(u - magic);
    } else {
        const uint32_t odd = (u >> 20) & 1u;
        u += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        r = (uint8_t)(u >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

/* One float8 cache row as kernels/kv_quant.py's pack makes it, bit for bit: s = max(max |x|, 1e-30) / 448, codes
   the e4m3 of x / s clamped to [-448, 448], then the 4 bytes of s. */
static void pack_f8_row(const float* x, int D, uint8_t* row) {
    float amax = 0.f;
    for (int i = 0; i < D; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float s = fmaxf(amax, 1e-30f) / 448.f;
    for (int i = 0; i < D; i++) {
        const float v = x[i] / s;
        row[i] = f8_from_f32(v > 448.f ? 448.f : v < -448.f ? -448.f : v);
    }
    memcpy(row + D, &s, 4);
}

/* The new tokens' keys and values (after RoPE) into their slots, converted to the cache's element type. */
static void write_kv(const step_args* a, const step_layer* w) {
    const int D = a->D, nqkv = (a->Hq + 2 * a->Hkv) * D;
    for (int t = 0; t < a->M; t++) {
        const int64_t slot = a->slots[t];
        if (slot < 0) continue;
        const int64_t at = (slot / a->bs) * a->c_bs + (slot % a->bs) * a->c_ts;
        const float* k = a->qkv + (int64_t)t * nqkv + (int64_t)a->Hq * D;
        const float* v = k + (int64_t)a->Hkv * D;
        for (int h = 0; h < a->Hkv; h++) {
            const int64_t dst = at + (int64_t)h * a->c_hs;
            if (a->kv_kind == ELEM_F32) {
                memcpy((float*)w->k_cache + dst, k + (int64_t)h * D, sizeof(float) * (size_t)D);
                memcpy((float*)w->v_cache + dst, v + (int64_t)h * D, sizeof(float) * (size_t)D);
            } else if (a->kv_kind == ELEM_I8) {
                pack_i8_row(k + (int64_t)h * D, D, (int8_t*)w->k_cache + dst);
                pack_i8_row(v + (int64_t)h * D, D, (int8_t*)w->v_cache + dst);
            } else if (a->kv_kind == ELEM_F8) {
                pack_f8_row(k + (int64_t)h * D, D, (uint8_t*)w->k_cache + dst);
                pack_f8_row(v + (int64_t)h * D, D, (uint8_t*)w->v_cache + dst);
            } else {
                uint16_t *kc = (uint16_t*)w->k_cache + dst, *vc = (uint16_t*)w->v_cache + dst;
                for (int i = 0; i < D; i++) {
                    kc[i] = to_bf16(k[(int64_t)h * D + i]);
                    vc[i] = to_bf16(v[(int64_t)h * D + i]);
                }
            }
        }
    }
}

/* Attention of the step's tokens over their caches, by the whole team (the decode kernel for the leading decodes,
   the prefill kernel for the chunks after them, as the op-by-op backend splits them); the phase before is done. */
static int attend(const step_args* a, const step_layer* w, team_scratch* ts) {
    const int D = a->D, nqkv = (a->Hq + 2 * a->Hkv) * D, nq = a->Hq * D;
    int err = 0;
    if (a->nd > 0)
        err = decode_team(a->kv_kind, a->qkv, nqkv, D, w->k_cache, w->v_cache, a->c_bs, a->c_ts, a->c_hs, a->bt,
                          a->bt_ss, a->lens, a->attn, nq, D, a->nd, a->Hq, a->Hkv, D, a->bs, a->scale, a->max_len, ts);
    if (a->np > 0) {
        const int e = prefill_team(a->kv_kind, a->qkv + (int64_t)a->nd * nqkv, nqkv, D, w->k_cache, w->v_cache,
                                   a->c_bs, a->c_ts, a->c_hs, a->p_bt, a->p_bt_ss, a->p_qs, a->p_ctx,
                                   a->attn + (int64_t)a->nd * nq, nq, D, a->np, a->Hq, a->Hkv, D, a->bs, a->scale,
                                   a->p_first);
        err = err ? err : e;
    }
    return err;
}

/* y (+)= x W^T + b for p's panels, this thread's share (no barrier); the panel kinds were checked at load. */
static void product(const step_proj* p, const float* x, int64_t xs, float* y, int64_t ys, int M, int N, int K,
                    int accumulate) {
    if (p->kind <= W_BF16)
        gemm_team(p->kind == W_BF16, x, xs, p->w, p->bias, y, ys, M, N, K, accumulate);
    else
        qgemm_team(p->kind - W_I8, x, xs, p->w, p->scales, p->group, p->bias, y, ys, M, N, K, accumulate);
}

/* A min-heap of doubles in h[0, n): push x as element n; replace the root (the least) by x. */
static void heap_sift_down(double* h, int n, int i) {
    for (;;) {
        int m = i;
        const int l = 2 * i + 1, r = l + 1;
        if (l < n && h[l] < h[m]) m = l;
        if (r < n && h[r] < h[m]) m = r;
        if (m == i) return;
        const double t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static void heap_push(double* h, int n, double x) {
    int i = n;
    h[i] = x;
    while (i > 0 && h[(i - 1) / 2] > h[i]) {
        const double t = h[i];
        h[i] = h[(i - 1) / 2];
        h[(i - 1) / 2] = t;
        i = (i - 1) / 2;
    }
}

static void heap_replace_root(double* h, int n, double x) {
    h[0] = x;
    heap_sift_down(h, n, 0);
}

/* A greedy step's head from fewer bytes (kernels/head_screen.py says why and how the bounds are made): a->logits
   holds each row's logits from the screen (s); column i's exact logit is within b_i = |row|_2 c_i of s_i, so the
   row's exact maximum is at least T = max_i (s_i - b_i), and only a column with s_i + b_i >= T can reach it.
   The panels of those columns are recomputed from the head itself (every row, as the team's product computes
   them: gemm_panel), and every other column keeps an s_i below T. So the rows' argmax (argmax.c's, the
   sampler's) is the exact logits' argmax, the first of equal maxima included: equal maxima are all recomputed.
   A row whose norm is not finite has every panel recomputed. One thread, after the team's screened product: a
   few panels of 16 columns a row, against reading the whole head.
   With screen_add (a sampled row: n_i = -t log q_i, worker/sampler.py) the same for the argmax of z_i + n_i,
   the sampler's race keys fl(z_i + n_i): each bound widens by e_i = 2^-20 (|s_i| + b_i + |n_i|), far above
   that sum's float32 rounding (2^-24 of |z_i| + |n_i|).
   With screen_k[r] = k > 0 (the sampler's top-k cut) T is the k-th largest lower bound instead: at least k
   exact logits reach it, so every one of the k largest is a candidate, recomputed; every other column keeps
   an s_i more than e_i below the k-th largest exact logit, so the cut (fl(z / t) below the k-th largest) drops
   it, and the race after the cut reads exact values only. */
/* How far column i's key (s_i + n_i) may be from the exact one: its bound b_i, widened by e_i where the
   sampler's race or cut reads it (screen_head says why). */
static inline double reach(float s, double b, double n, int widen) {
    return b + (widen ? 0x1p-20 * (fabs((double)s) + b + fabs(n)) : 0.0);
}

/* A greedy row's T = max_i (s_i - b_i), then its candidates' panels marked: screen_head's loops without the
   sampler's terms, as simd reductions (one thread holds the team while they run: 85 us a step as scalar loops
   over SmolLM2's 49,152 columns, 22 us so, on a Xeon with AVX-512; 35 us in a build without AVX). A NaN lower
   bound may leave T NaN, and then every panel is marked: still exact, never fewer candidates. */
static void screen_greedy(const float* s, const float* c, int V, double hn, unsigned char* mark) {
    double T = -INFINITY;
#pragma omp simd reduction(max : T)
    for (int i = 0; i < V; i++) {
        const double lo = (double)s[i] - hn * c[i];
        T = lo > T ? lo : T;
    }
    for (int p = 0; p * 16 < V; p++) {
        const int n = V - 16 * p < 16 ? V - 16 * p : 16;
        const float *sp = s + 16 * p, *cp = c + 16 * p;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int j = 0; j < n; j++) hit |= !((double)sp[j] + hn * cp[j] < T); /* NaN compares false: a candidate */
        mark[p] |= (unsigned char)hit;
    }
}

static void screen_head(const step_args* a, const float* h) {
    const int V = a->V, H = a->H, np = (V + 15) / 16;
    unsigned char* mark = (unsigned char*)calloc((size_t)np, 1);
    for (int r = 0; r < a->R; r++) {
        const float *x = h + (int64_t)r * H, *s = a->logits + (int64_t)r * V;
        const int top_k = a->screen_k ? a->screen_k[r] : 0;
        const float* add = a->screen_add && top_k <= 0 ? a->screen_add + (int64_t)r * V : NULL;
        const int widen = a->screen_add != NULL || top_k > 0;
        double n2 = 0.0;
        for (int k = 0; k < H; k++) n2 += (double)x[k] * x[k];
        const double hn = sqrt(n2) * (1.0 + 1e-9); /* the double sum's own rounding, and then some */
        if (mark && isfinite(hn) && !add && top_k <= 0) {
            screen_greedy(s, a->screen_c, V, hn, mark);
            continue;
        }
        double T = -INFINITY;
        double* heap = top_k > 0 && top_k < V ? (double*)malloc(sizeof(double) * (size_t)top_k) : NULL;
        int held = 0; /* a min-heap of the top_k largest lower bounds: T is its root */
        if (mark && isfinite(hn) && (top_k <= 0 || heap))
            for (int i = 0; i < V; i++) {
                const double n = add ? add[i] : 0.0;
                const double lo = (double)s[i] + n - reach(s[i], hn * a->screen_c[i], n, widen);
                if (!heap) {
                    if (lo > T) T = lo;
                } else if (held < top_k) {
                    heap_push(heap, held++, lo);
                    if (held == top_k) T = heap[0];
                } else if (lo > heap[0]) {
                    heap_replace_root(heap, held, lo);
                    T = heap[0];
                }
            }
        free(heap);
        for (int i = 0; mark && i < V; i++) { /* NaN compares false: a candidate */
            const double n = add ? add[i] : 0.0;
            if (!((double)s[i] + n + reach(s[i], hn * a->screen_c[i], n, widen) < T)) mark[i / 16] = 1;
        }
    }
    for (int p = 0; p < np; p++)
        if (!mark || mark[p]) {
            gemm_panel(a->head.kind == W_BF16, h, H, a->head.w, p, a->logits, V, a->R, V, H);
            *a->screen_panels += 1;
        }
    free(mark);
}

/* Every layer of one step, the ops in the order of worker/model.py's forward. Each product's panels are shared
   over the team (no barrier of its own); a barrier follows before its output is read. The norms and SwiGLU, a
   few rows each, are computed by every thread into rows of its own (the same values: no barrier needed after
   them, three fewer per layer); RoPE and the cache write run on one thread, a barrier after them. The layer loop's
   barriers are team.h's, not omp barrier (team.h says why); the attention kernel's own work-sharing loops keep
   theirs.
   Returns 0, the attention kernel's error code, or 2 where a thread's rows could not be allocated. */
int decode_step(const step_args* a) {
    const int M = a->M, H = a->H, D = a->D, I = a->inter, nq = a->Hq * D, nqkv = (a->Hq + 2 * a->Hkv) * D;
    int err = 0;
    team_barrier bar; /* the layer loop's barriers (team.h says why not omp barrier) */
    team_scratch scratch; /* the attention kernel's, kept across the layers */
    team_barrier_init(&bar);
    if (team_scratch_init(&scratch, &bar, omp_get_max_threads())) {
        team_scratch_free(&scratch);
        return 2;
    }
#pragma omp parallel
    {
        const int members = omp_get_num_threads(), first = omp_get_thread_num() == 0;
        float* h = (float*)malloc(sizeof(float) * (size_t)M * (size_t)(H > I ? H : I)); /* norm or SwiGLU rows */
        int ok = h != NULL;
#pragma omp atomic update
        err |= ok ? 0 : 2;
#pragma omp barrier
        PHASE_START();
        for (int l = 0; l < a->L && !err; l++) { /* err is read by all after a barrier: the same in every thread */
            const step_layer* w = a->layers + l;
            rms_norm_rows_f32(a->x, H, w->input_norm, h, H, M, H, a->eps);
            PHASE(PH_NORM);
            product(&w->qkv, h, H, a->qkv, nqkv, M, nqkv, H, 0);
            PHASE(PH_QKV);
            team_barrier_wait(&bar, members);
            PHASE(PH_WAIT_QKV);
            if (first) {
                (a->rope_half ? rope_half_f32 : rope_interleaved_f32)(a->qkv, nqkv, a->rot, D, M, a->Hq + a->Hkv,
                                                                      D / 2);
                write_kv(a, w);
            }
            team_barrier_wait(&bar, members);
            PHASE(PH_ROPE_KV);
            const int e = attend(a, w, &scratch); /* ends with the team's barrier */
            if (e) {
#pragma omp atomic write
                err = e;
            }
            PHASE(PH_ATTN);
            product(&w->o, a->attn, nq, a->x, H, M, H, nq, 1);
            PHASE(PH_O);
            team_barrier_wait(&bar, members);
            PHASE(PH_WAIT_O);
            rms_norm_rows_f32(a->x, H, w->post_norm, h, H, M, H, a->eps);
            PHASE(PH_NORM);
            product(&w->gate_up, h, H, a->gu, 2 * I, M, 2 * I, H, 0);
            PHASE(PH_GATE_UP);
            team_barrier_wait(&bar, members);
            PHASE(PH_WAIT_GATE_UP);
            silu_mul_to_f32(a->gu, 2 * I, h, I, M, I);
            PHASE(PH_SILU);
            product(&w->down, h, I, a->x, H, M, H, I, 1);
            PHASE(PH_DOWN);
            team_barrier_wait(&bar, members);
            PHASE(PH_WAIT_DOWN);
        }
        if (a->head.w && !err) {
            for (int r = 0; r < a->R; r++) {
                const int64_t row = a->rows ? a->rows[r] : r;
                rms_norm_rows_f32(a->x + row * H, H, a->final_norm, h + (int64_t)r * H, H, 1, H, a->eps);
            }
            if (a->screen.w) {
                product(&a->screen, h, H, a->logits, a->V, a->R, a->V, H, 0);
#pragma omp barrier
#pragma omp single
                screen_head(a, h);
            } else {
                product(&a->head, h, H, a->logits, a->V, a->R, a->V, H, 0);
            }
            PHASE(PH_HEAD);
        }
        free(h);
    }
    team_scratch_free(&scratch);
    return err;
}

/* Where a greedy window's tokens are embedded from: a row-major table [rows, H] (an untied embedding), or the
   tied LM head's panels [ceil(V/16), H, 16] (int8 codes times the row's scale), read as the model's own lookup
   reads them, so the rows are the same bit for bit. */
enum { EMB_F32_ROWS = 0, EMB_BF16_ROWS = 1, EMB_F32_PANELS = 2, EMB_BF16_PANELS = 3, EMB_I8_PANELS = 4 };
typedef struct {
    const void* w;
    const float* scales; /* int8 panels: one per row; else NULL */
    int kind;            /* EMB_F32_ROWS .. EMB_I8_PANELS */
} step_embed;

static float widen_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void embed_row(const step_embed* e, int64_t id, int H, float* x) {
    const int64_t row = id * H, panel = (id / 16) * (int64_t)H * 16 + id % 16; /* column k: panel + 16 k */
    for (int k = 0; k < H; k++) {
        const int64_t p = panel + 16 * (int64_t)k;
        switch (e->kind) {
        case EMB_F32_ROWS: x[k] = ((const float*)e->w)[row + k]; break;
        case EMB_BF16_ROWS: x[k] = widen_bf16(((const uint16_t*)e->w)[row + k]); break;
        case EMB_F32_PANELS: x[k] = ((const float*)e->w)[p]; break;
        case EMB_BF16_PANELS: x[k] = widen_bf16(((const uint16_t*)e->w)[p]); break;
        default: x[k] = (float)((const int8_t*)e->w)[p] * e->scales[id]; break;
        }
    }
}

void argmax_rows_f32(const float* x, int64_t rs, int R, int V, int64_t* out);

/* A decode-ahead window of one sequence (worker/model.py's decode_window) where each token is the argmax of its
   logits (greedy) or of its logits plus its row of offsets (offsets + i os: a sampled row with no cut, the
   sampler's race keys, worker/sampler.py, drawn before the window; the head screened for that argmax), by
   argmax.c's argmax, the sampler's own: from `token` at position pos0, up to n tokens, each step fed the token
   the one before chose; stops after a token in stops[0..nstops). Per token: its embedding into a->x ([1, H]),
   its RoPE row rot + i rs, its slot slots[i], its length pos0 + i + 1 (into *len, which a->lens points at),
   then decode_step with the head inside (a->M = a->nd = a->R = 1, a->np = 0, a->rows NULL: the caller's set-up).
   Why here and not in Python: the loop around each C step there (the lookup, the sampler, the bookkeeping)
   cost about 0.3 ms a token greedy and more sampled, 6-8% of a quantised model's step at one sequence or more.
   wake_fd >= 0: the window also ends after a token once that descriptor is readable (the worker's pub/sub
   connection: a job or a cancellation was announced), so that a long window delays a newcomer by one token,
   not by the window (one poll a token, about a microsecond).
   Returns how many tokens were made (into out), or minus decode_step's error code. */
int decode_window(step_args* a, const step_embed* e, int64_t token, int n, int pos0, const float* rot, int64_t rs,
                  const int64_t* slots, int32_t* len, const int32_t* stops, int nstops, const float* offsets,
                  int64_t os, int64_t* out, int wake_fd) {
    for (int i = 0; i < n; i++) {
        embed_row(e, token, a->H, a->x);
        a->rot = rot + (int64_t)i * rs;
        a->slots = slots + i;
        *len = a->max_len = pos0 + i + 1;
        const float* add = offsets ? offsets + (int64_t)i * os : NULL;
        if (add && a->screen_add) a->screen_add = add; /* where the head is screened (the caller's set-up) */
        const int err = decode_step(a);
        if (err) return -err;
        if (add) /* the race keys, as the sampler forms them: logits + offsets in float32 */
            for (int v = 0; v < a->V; v++) a->logits[v] += add[v];
        argmax_rows_f32(a->logits, a->V, 1, a->V, &token);
        out[i] = token;
        for (int s = 0; s < nstops; s++)
            if (stops[s] == token) return i + 1;
        struct pollfd wake = {wake_fd, POLLIN, 0};
        if (wake_fd >= 0 && i + 1 < n && poll(&wake, 1, 0) > 0) return i + 1;
    }
    return n;
}
