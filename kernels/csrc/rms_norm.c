/* RMSNorm of float32 rows, the Llama family's: y = (x * 1/sqrt(mean(x^2) + eps)) * w, in that order (as
   Hugging Face computes it), one pass summing the squares and one scaling.

   Why C: at decode sizes (a few rows of ~1k values) torch's rms_norm runs as a chain of small ops, ~30 us a
   call, and a decode step of a 30-layer model calls it 61 times: about 7% of a one-sequence step. Rows are
   shared over OpenMP threads only when there are many (a parallel region costs more than a short row). */
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define PARALLEL_MIN_ROWS 32

static float sum_squares(const float* x, int H) {
    int i = 0;
    float s = 0.0f;
#if INFERQ_HAVE_AVX512
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; i + 32 <= H; i += 32) {
        const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; i + 16 <= H; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        a0 = _mm512_fmadd_ps(v, v, a0);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif INFERQ_HAVE_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= H; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; i + 8 <= H; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    s = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; i < H; i++) s += x[i] * x[i];
    return s;
}

static void scale_row(const float* x, const float* w, float* y, int H, float r) {
    int i = 0;
#if INFERQ_HAVE_AVX512
    const __m512 rv = _mm512_set1_ps(r);
    for (; i + 16 <= H; i += 16)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), rv), _mm512_loadu_ps(w + i)));
#elif INFERQ_HAVE_AVX2
    const __m256 rv = _mm256_set1_ps(r);
    for (; i + 8 <= H; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
#endif
    for (; i < H; i++) y[i] = (x[i] * r) * w[i];
}

static void norm_row(const float* x, const float* w, float* y, int H, float eps) {
    scale_row(x, w, y, H, 1.0f / sqrtf(sum_squares(x, H) / (float)H + eps));
}

/* Rows x[t * xs : t * xs + H] -> y[t * ys : ...], t < T; x and y may be the same rows. */
void rms_norm_f32(const float* x, int64_t xs, const float* w, float* y, int64_t ys, int T, int H, float eps) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_MIN_ROWS)
    for (int t = 0; t < T; t++) norm_row(x + (int64_t)t * xs, w, y + (int64_t)t * ys, H, eps);
}

/* The same on the calling thread alone: decode_step.c's team members, each norming the rows it reads. Called
   there, rms_norm_f32's parallel-for starts a nested team of one for every norm, even when its `if` is false. */
void rms_norm_rows_f32(const float* x, int64_t xs, const float* w, float* y, int64_t ys, int T, int H, float eps) {
    for (int t = 0; t < T; t++) norm_row(x + (int64_t)t * xs, w, y + (int64_t)t * ys, H, eps);
}

/* bfloat16 rows and weight (the bfloat16 forward on CPUs with native bfloat16 matmuls): float32 sums and
   scaling, one rounding of each output. Plain loops: at these sizes the cost saved is torch's dispatch. */
void rms_norm_bf16(const uint16_t* x, int64_t xs, const uint16_t* w, uint16_t* y, int64_t ys, int T, int H,
                   float eps) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_MIN_ROWS)
    for (int t = 0; t < T; t++) {
        const uint16_t* xr = x + (int64_t)t * xs;
        uint16_t* yr = y + (int64_t)t * ys;
        float s = 0.0f;
        for (int i = 0; i < H; i++) {
            const float v = load1(xr, i, 1);
            s += v * v;
        }
        const float r = 1.0f / sqrtf(s / (float)H + eps);
        for (int i = 0; i < H; i++) yr[i] = to_bf16((load1(xr, i, 1) * r) * load1(w, i, 1));
    }
}

/* 2: AVX-512, 1: AVX2, 0: portable loops (what this build compiled in) */
int vector_width_level(void) { return INFERQ_HAVE_AVX512 ? 2 : INFERQ_HAVE_AVX2 ? 1 : 0; }
