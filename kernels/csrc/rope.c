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
