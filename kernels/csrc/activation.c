/* SwiGLU of float32 rows in place: for each row of [gate | up] (2 * inter values), gate <- silu(gate) * up,
   silu(g) = g * sigmoid(g). Why C: at decode sizes the torch form (two slices, silu_, mul_) is four small ops
   per layer; this is one pass. The vector path takes e = exp(-|g|) (simd.h's exp256 wants x <= 0) and
   sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below. */
#include <math.h>
#include <stdint.h>

#include "simd.h"

static inline float silu1(float g) { return g / (1.0f + expf(-g)); }

/* gate (the first inter values of each row of gu, row stride rs) -> out (row stride os): silu(gate) * up. out may
   be gu itself (in place) or another buffer (the fused decode step's per-thread rows), with the same results. */
void silu_mul_to_f32(const float* gu, int64_t rs, float* out, int64_t os, int T, int inter) {
    for (int t = 0; t < T; t++) {
        const float* g = gu + (int64_t)t * rs;
        const float* u = g + inter;
        float* o = out + (int64_t)t * os;
        int i = 0;
#if INFERQ_HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp256(_mm256_or_ps(x, sign)); /* exp(-|x|) */
            const __m256 d = _mm256_add_ps(one, e);
            const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
            const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), d);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = silu1(g[i]) * u[i];
    }
}

void silu_mul_f32(float* gu, int64_t rs, int T, int inter) { silu_mul_to_f32(gu, rs, gu, rs, T, inter); }

/* The same on bfloat16 rows: float32 arithmetic, one rounding of each result. */
void silu_mul_bf16(uint16_t* gu, int64_t rs, int T, int inter) {
    for (int t = 0; t < T; t++) {
        uint16_t* g = gu + (int64_t)t * rs;
        const uint16_t* u = g + inter;
        for (int i = 0; i < inter; i++) g[i] = to_bf16(silu1(load1(g, i, 1)) * load1(u, i, 1));
    }
}
