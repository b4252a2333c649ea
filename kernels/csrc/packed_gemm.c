/* y = x W^T + b with W packed once into panels [ceil(N/16), K, 16] (16 output columns per panel, each k's 16
   weights adjacent), so a product streams the weight front to back exactly once: float32 panels, bfloat16 ones
   widened as loaded (float32 arithmetic), and, with AVX512-BF16, bfloat16 pair panels for vdpbf16ps.

   The micro-kernel holds an mr x 16 block of the output in registers (AVX2: mr <= 6, 12 ymm accumulators, the
   BLIS-style 6x16 shape; AVX-512: mr <= 12, one zmm per row); for each k it loads the panel's 16 weights once
   and broadcasts each of the mr inputs. Rows are split into near-equal tiles (M = 8 runs as 4 + 4 with AVX2,
   not 6 + 2); the panel, K x 64 bytes, stays in L1/L2 while its tiles run, and the first tile prefetches ahead
   (the next panel, or at decode sizes a few KB of its own stream), so the DRAM read overlaps the FMAs. Panels
   are shared out over torch's OpenMP threads. Tiles of one to three rows (decode) may split k over two or four
   sets of accumulators, so FMA latency does not pace the weight stream; how many is measured per machine
   (k_sets below; build option INFERQ_NO_SPLIT_K: always one set, for side-by-side timing).
   Needs AVX2 + FMA (without them the caller keeps torch's GEMM). */
#include <stdint.h>
#include <string.h>

#include "simd.h"

#if !INFERQ_HAVE_AVX2
#error "packed_gemm.c needs AVX2 + FMA (built with -march=native on such a CPU, without INFERQ_NO_AVX2)"
#else

#define PANEL 16
/* The most accumulator sets over k a tile of MR rows may use: with one to three rows a single set is one FMA
   dependency chain per register, whose latency (4 cycles; longer behind a bfloat16 widening load) may bound how
   fast the weight streams rather than the memory. */
#ifdef INFERQ_NO_SPLIT_K
#define SPLIT_K(MR) 1
#else
#define SPLIT_K(MR) ((MR) == 1 ? 4 : (MR) <= 3 ? 2 : 1)
#endif
/* How many of those sets a tile of 1-3 rows uses, per panel element (float32, bfloat16) and row count: 1, 2 or
   4 (at most SPLIT_K; AVX2's 16 ymm registers hold at most 2). Whether one set's FMA latency paces the stream is
   a fact about the machine, not the code: the sets were added on a Zen 5 VM, where they streamed both elements
   faster, while on a Xeon with AMX (session 34) one set made the fused float32 step 1.17x faster and bfloat16
   still wanted four. So kernels/stream_prefetch.py measures float32's once per machine (bfloat16 keeps MAX_SETS:
   it says why) and sets them here before a model's products run. Unlike a prefetch distance the count changes the sums' rounding,
   so it is set once per process, the same in every library, and never changed while serving. */
#define MAX_SETS(MR) (INFERQ_HAVE_AVX512 || SPLIT_K(MR) < 2 ? SPLIT_K(MR) : 2)
static int k_sets[2][4] = {{1, MAX_SETS(1), MAX_SETS(2), MAX_SETS(3)}, {1, MAX_SETS(1), MAX_SETS(2), MAX_SETS(3)}};

void set_k_sets(int bf16, int rows, int sets) {
    if (rows >= 1 && rows <= 3 && (sets == 1 || sets == 2 || sets == 4) && sets <= MAX_SETS(rows))
        k_sets[bf16 != 0][rows] = sets;
}

int get_k_sets(int bf16, int rows) { return rows >= 1 && rows <= 3 ? k_sets[bf16 != 0][rows] : 1; }

/* the most sets a tile of `rows` rows can take in this build (what set_k_sets accepts) */
int max_k_sets(int rows) { return rows >= 1 && rows <= 3 ? MAX_SETS(rows) : 1; }
#define X_BLOCK_BYTES (192 * 1024) /* see gemm_share */
/* How far ahead of its loads a decode-sized tile (one tile of `rows` rows a panel) prefetches in the weight's
   own stream, in bytes, per panel element (float32, bfloat16) and row count: by Little's law the lines in
   flight that cover the memory latency at the rate one core consumes the weight, and both are facts about the
   machine (and a VM's neighbours): 4 KB suited the machine it was first tuned on (~200 ns at ~20 GB/s a core),
   while on a Zen 4 VM one bfloat16 row read its stream 1.2-1.3x faster with no software prefetch at all and
   four or eight rows 1.35-1.6x slower without it. So kernels/stream_prefetch.py measures the distances once
   per machine and sets them here; 4 KB until then. 0: no software prefetch. Prefetching the whole next panel instead (36-98 KB ahead on SmolLM2's shapes) made a
   decode step up to 6% slower at batch 1 and 13% at batch 4-8 (docs/BENCHMARKS.md, session 15). */
#define AHEAD_ROWS 12
static int64_t prefetch_ahead[2][AHEAD_ROWS + 1] = {{[0 ... AHEAD_ROWS] = 4096}, {[0 ... AHEAD_ROWS] = 4096}};

void set_prefetch_ahead(int bf16, int rows, int64_t bytes) {
    if (rows >= 0 && rows <= AHEAD_ROWS && bytes >= 0) prefetch_ahead[bf16 != 0][rows] = bytes;
}

int64_t get_prefetch_ahead(int bf16, int rows) {
    return rows >= 0 && rows <= AHEAD_ROWS ? prefetch_ahead[bf16 != 0][rows] : -1;
}

/* y[0:mr, 0:nc] (+)= x[0:mr, :] . panel^T (+ b): one register block. MR is a compile-time constant at each
   call site (always_inline), so the row loops unroll and the accumulators live in registers. */
ALWAYS_INLINE void block_sets(const int MR, const int S, const int BF16, const float* x, int64_t xs, const void* wv,
                              int K, float* y, int64_t ys, const float* b, int nc, int accumulate,
                              const char* prefetch) {
    __m256 c0[2][6], c1[2][6];
    _Pragma("GCC unroll 2") for (int s = 0; s < S; s++)
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) { c0[s][r] = _mm256_setzero_ps(); c1[s][r] = _mm256_setzero_ps(); }
    const int row_bytes = BF16 ? 2 * PANEL : 4 * PANEL;
    int k = 0;
    for (; k + S <= K; k += S) {
        _Pragma("GCC unroll 2") for (int s = 0; s < S; s++) {
            const int kk = k + s;
            if (prefetch && (!BF16 || !(kk & 1))) _mm_prefetch(prefetch + (int64_t)kk * row_bytes, _MM_HINT_T0);
            const __m256 w0 = load8(wv, (int64_t)kk * PANEL, BF16), w1 = load8(wv, (int64_t)kk * PANEL + 8, BF16);
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
                const __m256 xb = _mm256_broadcast_ss(x + r * xs + kk);
                c0[s][r] = _mm256_fmadd_ps(xb, w0, c0[s][r]);
                c1[s][r] = _mm256_fmadd_ps(xb, w1, c1[s][r]);
            }
        }
    }
    for (; k < K; k++) {
        if (prefetch && (!BF16 || !(k & 1))) _mm_prefetch(prefetch + (int64_t)k * row_bytes, _MM_HINT_T0);
        const __m256 w0 = load8(wv, (int64_t)k * PANEL, BF16), w1 = load8(wv, (int64_t)k * PANEL + 8, BF16);
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
            c0[0][r] = _mm256_fmadd_ps(xb, w0, c0[0][r]);
            c1[0][r] = _mm256_fmadd_ps(xb, w1, c1[0][r]);
        }
    }
    _Pragma("GCC unroll 2") for (int s = 1; s < S; s++)
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            c0[0][r] = _mm256_add_ps(c0[0][r], c0[s][r]);
            c1[0][r] = _mm256_add_ps(c1[0][r], c1[s][r]);
        }
    if (b) {
        float bb[PANEL] = {0};
        for (int j = 0; j < nc; j++) bb[j] = b[j];
        const __m256 b0 = _mm256_loadu_ps(bb), b1 = _mm256_loadu_ps(bb + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) { c0[0][r] = _mm256_add_ps(c0[0][r], b0); c1[0][r] = _mm256_add_ps(c1[0][r], b1); }
    }
    if (nc == PANEL) {
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            float* yr = y + r * ys;
            if (accumulate) {
                c0[0][r] = _mm256_add_ps(c0[0][r], _mm256_loadu_ps(yr));
                c1[0][r] = _mm256_add_ps(c1[0][r], _mm256_loadu_ps(yr + 8));
            }
            _mm256_storeu_ps(yr, c0[0][r]);
            _mm256_storeu_ps(yr + 8, c1[0][r]);
        }
    } else { /* the last panel of an N that is not a multiple of 16 */
        _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {
            float t[PANEL];
            _mm256_storeu_ps(t, c0[0][r]);
            _mm256_storeu_ps(t + 8, c1[0][r]);
            float* yr = y + r * ys;
            for (int j = 0; j < nc; j++) yr[j] = accumulate ? yr[j] + t[j] : t[j];
        }
    }
}

/* block_sets with this machine's sets for MR rows (k_sets; 16 ymm registers: at most 2) */
ALWAYS_INLINE void block(const int MR, const int BF16, const float* x, int64_t xs, const void* wv, int K, float* y,
                         int64_t ys, const float* b, int nc, int accumulate, const char* prefetch) {
    if (SPLIT_K(MR) > 1 && k_sets[BF16][MR] >= 2)
        block_sets(MR, 2, BF16, x, xs, wv, K, y, ys, b, nc, accumulate, prefetch);
    else
        block_sets(MR, 1, BF16, x, xs, wv, K, y, ys, b, nc, accumulate, prefetch);
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

#if INFERQ_HAVE_AVX512
/* The AVX-512 form of block(): one 16-column panel row is one zmm register, so a tile holds up to 12 rows in
   12 accumulators (each k: one weight load, 12 broadcast-FMAs), and a partial last panel is a masked store. */
#define TILE_ROWS 12
ALWAYS_INLINE void block512_sets(const int MR, const int S, const int BF16, const float* x, int64_t xs,
                                 const void* wv, int K, float* y, int64_t ys, const float* b, int nc,
                                 int accumulate, const char* prefetch) {
    __m512 c[4][TILE_ROWS];
    _Pragma("GCC unroll 4") for (int s = 0; s < S; s++)
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) c[s][r] = _mm512_setzero_ps();
    const int row_bytes = BF16 ? 2 * PANEL : 4 * PANEL;
    int k = 0;
    for (; k + S <= K; k += S) {
        _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) {
            const int kk = k + s;
            if (prefetch && (!BF16 || !(kk & 1))) _mm_prefetch(prefetch + (int64_t)kk * row_bytes, _MM_HINT_T0);
            const __m512 w = load16(wv, (int64_t)kk * PANEL, BF16);
            _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)
                c[s][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + kk]), w, c[s][r]);
        }
    }
    for (; k < K; k++) {
        if (prefetch && (!BF16 || !(k & 1))) _mm_prefetch(prefetch + (int64_t)k * row_bytes, _MM_HINT_T0);
        const __m512 w = load16(wv, (int64_t)k * PANEL, BF16);
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) c[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), w, c[0][r]);
    }
    _Pragma("GCC unroll 4") for (int s = 1; s < S; s++)
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) c[0][r] = _mm512_add_ps(c[0][r], c[s][r]);
    const __mmask16 m = nc == PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1);
    const __m512 bb = b ? _mm512_maskz_loadu_ps(m, b) : _mm512_setzero_ps();
    _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {
        __m512 v = _mm512_add_ps(c[0][r], bb);
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, y + r * ys));
        _mm512_mask_storeu_ps(y + r * ys, m, v);
    }
}
/* block512_sets with this machine's sets for MR rows (k_sets) */
ALWAYS_INLINE void block512(const int MR, const int BF16, const float* x, int64_t xs, const void* wv, int K,
                            float* y, int64_t ys, const float* b, int nc, int accumulate, const char* prefetch) {
    const int sets = SPLIT_K(MR) > 1 ? k_sets[BF16][MR] : 1;
    if (SPLIT_K(MR) >= 4 && sets >= 4)
        block512_sets(MR, 4, BF16, x, xs, wv, K, y, ys, b, nc, accumulate, prefetch);
    else if (sets >= 2)
        block512_sets(MR, 2, BF16, x, xs, wv, K, y, ys, b, nc, accumulate, prefetch);
    else
        block512_sets(MR, 1, BF16, x, xs, wv, K, y, ys, b, nc, accumulate, prefetch);
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

int gemm_has_avx512(void) { return TILE_ROWS == 12; }

/* y[M, N] (row stride ys) = or += x[M, K] (row stride xs) . W^T + b, W packed as [ceil(N/16), K, 16] panels of
   w_bytes per element, one tile of at most tile_rows rows at a time. Large M runs in row blocks whose x rows
   (about X_BLOCK_BYTES) stay in L2 while every panel of the thread's share passes over them; without blocks,
   each panel re-read all M rows of x from L3 (for a 2048 x 576 prefill chunk, 4.7 MB per 16 output columns).
   Where a panel has several tiles, the first prefetches the next panel while the others reuse this one from
   cache; a panel of one tile (decode sizes) prefetches prefetch_ahead bytes ahead of its own loads, which near
   its end runs into the next panel (panels are contiguous; a prefetch past the weight's end does not fault). */
static int row_block(int tile_rows, int x_bytes, int M, int K) {
    int mb = (int)(X_BLOCK_BYTES / ((int64_t)K * x_bytes)) / tile_rows * tile_rows;
    if (mb < 4 * tile_rows) mb = 4 * tile_rows;
    return M <= 2 * mb ? M : mb;
}

/* rows r0 .. r0 + rows of x against the panel at w (output columns n0 .. n0 + nc): near-equal tiles of at most
   tile_rows rows (8 -> 4 + 4 with AVX2's 6), the first prefetching from next (or nothing) */
static void panel_tiles(tile_fn tile, int tile_rows, int x_bytes, int y_bytes, const void* x, int64_t xs,
                        const char* w, const char* next, int K, const float* b, void* y, int64_t ys, int r0,
                        int rows, int n0, int nc, int accumulate) {
    const int tiles = (rows + tile_rows - 1) / tile_rows;
    int m0 = r0;
    for (int t = 0; t < tiles; t++) {
        const int mr = (r0 + rows - m0) / (tiles - t) + (((r0 + rows - m0) % (tiles - t)) ? 1 : 0);
        tile(mr, (const char*)x + (int64_t)m0 * xs * x_bytes, xs, w, K,
             (char*)y + ((int64_t)m0 * ys + n0) * y_bytes, ys, b ? b + n0 : 0, nc, accumulate, t > 0 ? 0 : next);
        m0 += mr;
    }
}

static void gemm_share(tile_fn tile, int tile_rows, int x_bytes, int y_bytes, int w_bytes, const void* x,
                       int64_t xs, const void* wp, const float* b, void* y, int64_t ys, int M, int N, int K,
                       int accumulate) {
    if (M <= 0 || N <= 0 || K <= 0) return;
    const int np = (N + PANEL - 1) / PANEL, mb = row_block(tile_rows, x_bytes, M, K);
    const int64_t panel_bytes = (int64_t)K * PANEL * w_bytes;
    for (int r0 = 0; r0 < M; r0 += mb) {
        const int rows = M - r0 < mb ? M - r0 : mb, one_tile = rows <= tile_rows;
        const int64_t ahead = one_tile ? prefetch_ahead[w_bytes == 2][rows <= AHEAD_ROWS ? rows : AHEAD_ROWS] : 0;
        /* blocks need no barrier: each writes its own rows of y */
        PANEL_SHARE
        for (int p = 0; p < np; p++) {
            const char* w = (const char*)wp + (int64_t)p * panel_bytes;
            const int n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
            const char* next = one_tile ? (ahead ? w + ahead : 0) : p + 1 < np ? w + panel_bytes : 0;
            panel_tiles(tile, tile_rows, x_bytes, y_bytes, x, xs, w, next, K, b, y, ys, r0, rows, n0, nc, accumulate);
        }
    }
}

/* Panel p's columns of y[M, N] = x[M, K] . W^T (float32 or bfloat16 panels, no bias), computed as gemm_team
   computes them (the same row blocks and tiles, so the same values bit for bit), by the calling thread alone:
   kernels/csrc/decode_step.c's screened LM head recomputes the panels of its candidate columns with it. */
void gemm_panel(int bf16, const float* x, int64_t xs, const void* wp, int p, float* y, int64_t ys, int M, int N,
                int K) {
    const int mb = row_block(TILE_ROWS, 4, M, K), n0 = p * PANEL, nc = N - n0 < PANEL ? N - n0 : PANEL;
    const char* w = (const char*)wp + (int64_t)p * K * PANEL * (bf16 ? 2 : 4);
    for (int r0 = 0; r0 < M; r0 += mb)
        panel_tiles(bf16 ? TILE_BF16 : TILE_F32, TILE_ROWS, 4, 4, x, xs, w, 0, K, 0, y, ys, r0,
                    M - r0 < mb ? M - r0 : mb, n0, nc, 0);
}

/* gemm_share's panels shared out over a parallel region of its own */
static void gemm_any(tile_fn tile, int tile_rows, int x_bytes, int y_bytes, int w_bytes, const void* x, int64_t xs,
                     const void* wp, const float* b, void* y, int64_t ys, int M, int N, int K, int accumulate) {
    #pragma omp parallel
    gemm_share(tile, tile_rows, x_bytes, y_bytes, w_bytes, x, xs, wp, b, y, ys, M, N, K, accumulate);
}

/* The same product run by the team of an enclosing parallel region (kernels/csrc/decode_step.c): each thread
   takes its share of the panels (PANEL_SHARE) and returns without a barrier (the caller places one before y is
   read). Called outside a parallel region, one thread does it all. bf16: bfloat16 panels, widened. */
void gemm_team(int bf16, const float* x, int64_t xs, const void* wp, const float* b, float* y, int64_t ys, int M,
               int N, int K, int accumulate) {
    gemm_share(bf16 ? TILE_BF16 : TILE_F32, TILE_ROWS, 4, 4, bf16 ? 2 : 4, x, xs, wp, b, y, ys, M, N, K,
               accumulate);
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

#if INFERQ_HAVE_AVX512BF16
/* bfloat16 x bfloat16 -> float32 sums with vdpbf16ps (AVX512-BF16): twice the multiply-adds per instruction of a
   float32 FMA. The weight is packed in k pairs, [ceil(N/16), K/2, 16, 2] (one zmm per pair row: column i's
   W[i][2kp], W[i][2kp+1] adjacent), x is bfloat16 with rows of even length K, and each (x[2kp], x[2kp+1]) pair
   is broadcast as one 32-bit lane. y is bfloat16 (rounded to nearest even), written or accumulated. */
ALWAYS_INLINE void blockdp(const int MR, const int BF16, const uint16_t* x, int64_t xs, const void* wv, int K,
                           uint16_t* y, int64_t ys, const float* b, int nc, int accumulate, const char* prefetch) {
    (void)BF16;
    const uint16_t* w = (const uint16_t*)wv;
    const int K2 = K / 2;
    const int S = SPLIT_K(MR);
    __m512 c[4][12];
    _Pragma("GCC unroll 4") for (int s = 0; s < S; s++)
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) c[s][r] = _mm512_setzero_ps();
    int kp = 0;
    for (; kp + S <= K2; kp += S) {
        _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) {
            const int kk = kp + s;
            if (prefetch) _mm_prefetch(prefetch + (int64_t)kk * 64, _MM_HINT_T0);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(w + (int64_t)kk * 32));
            _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {
                int32_t pair;
                memcpy(&pair, x + r * xs + 2 * kk, 4);
                c[s][r] = _mm512_dpbf16_ps(c[s][r], (__m512bh)_mm512_set1_epi32(pair), wv);
            }
        }
    }
    for (; kp < K2; kp++) {
        if (prefetch) _mm_prefetch(prefetch + (int64_t)kp * 64, _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(w + (int64_t)kp * 32));
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + r * xs + 2 * kp, 4);
            c[0][r] = _mm512_dpbf16_ps(c[0][r], (__m512bh)_mm512_set1_epi32(pair), wv);
        }
    }
    _Pragma("GCC unroll 4") for (int s = 1; s < S; s++)
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) c[0][r] = _mm512_add_ps(c[0][r], c[s][r]);
    const __mmask16 m = nc == PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1);
    const __m512 bb = b ? _mm512_maskz_loadu_ps(m, b) : _mm512_setzero_ps();
    _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {
        __m512 v = _mm512_add_ps(c[0][r], bb);
        uint16_t* yr = y + r * ys;
        if (accumulate)
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, yr)), 16)));
        _mm256_mask_storeu_epi16(yr, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
}
DEFINE_TILE(tile_dp, TILE_SWITCH12, blockdp, 0, uint16_t)
#define TILE_DP tile_dp
#else
#define TILE_DP ((tile_fn)0)
#endif

int has_bf16_dot(void) { return INFERQ_HAVE_AVX512BF16; }

/* bfloat16 x, y and pair-packed panels [ceil(N/16), K/2, 16, 2]; K must be even. Returns 1 where not built. */
int gemm_bf16_dot(const uint16_t* x, int64_t xs, const uint16_t* wp, const float* b, uint16_t* y, int64_t ys,
                  int M, int N, int K, int accumulate) {
    if (!INFERQ_HAVE_AVX512BF16 || (K & 1)) return 1;
    gemm_any(TILE_DP, 12, 2, 2, 2, x, xs, wp, b, y, ys, M, N, K, accumulate);
    return 0;
}

#endif /* INFERQ_HAVE_AVX2 */
