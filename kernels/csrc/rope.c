/* Rotary position embedding in place on float32 q/k rows whose pairs are interleaved (worker/weights.py
   reorders the checkpoint's q and k rows so): pair j of a head, (a, b), becomes (a c - b s, a s + b c) with
   (c, s) = rot[t, j] (cos and sin of the token's position times frequency j), the complex product the torch
   path computes. Why C: at decode sizes the torch form is five small ops per layer (views, complex multiply,
   views back); here it is one pass over the heads of a row. */
#include <stdint.h>

#include "simd.h"

/* x: T rows of `heads` heads of 2 * half floats (row stride xs floats); rot: T rows of half (cos, sin) pairs
   (row stride rs floats). */
void rope_interleaved_f32(float* x, int64_t xs, const float* rot, int64_t rs, int T, int heads, int half) {
    for (int t = 0; t < T; t++) {
        const float* r = rot + (int64_t)t * rs;
        for (int h = 0; h < heads; h++) {
            float* p = x + (int64_t)t * xs + (int64_t)h * 2 * half;
            for (int j = 0; j < half; j++) {
                const float a = p[2 * j], b = p[2 * j + 1], c = r[2 * j], s = r[2 * j + 1];
                p[2 * j] = a * c - b * s;
                p[2 * j + 1] = a * s + b * c;
            }
        }
    }
}

/* The rotate-half form on bfloat16 rows (the bfloat16 forward keeps the checkpoint's q/k order): in each head
   of 2 * half values, (x1, x2) = (first half, second half) become (x1 c - x2 s, x2 c + x1 s), with c and s the
   bfloat16 rows cos[t], sin[t] (row stride cs); float32 arithmetic, one rounding of each value. */
void rope_half_bf16(uint16_t* x, int64_t xs, const uint16_t* cos, const uint16_t* sin, int64_t cs, int T,
                    int heads, int half) {
    for (int t = 0; t < T; t++) {
        const uint16_t* c = cos + (int64_t)t * cs;
        const uint16_t* s = sin + (int64_t)t * cs;
        for (int h = 0; h < heads; h++) {
            uint16_t* p = x + (int64_t)t * xs + (int64_t)h * 2 * half;
            for (int j = 0; j < half; j++) {
                const float a = load1(p, j, 1), b = load1(p, j + half, 1);
                const float cj = load1(c, j, 1), sj = load1(s, j, 1);
                p[j] = to_bf16(a * cj - b * sj);
                p[j + half] = to_bf16(b * cj + a * sj);
            }
        }
    }
}
