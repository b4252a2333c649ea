/* The index of each float32 row's largest value, as torch.argmax gives it: the first of equal maxima, and the
   first NaN where a row has one (torch counts NaN as the largest value).

   Why C: greedy decoding takes the argmax of a vocabulary-wide logits row every step, and the exponential race of
   worker/sampler.py ends in one too. torch's CPU argmax is a scalar reduction behind a dispatch and an OpenMP
   fork: about 90 us for SmolLM2's 49,152 logits, 2% of a quantised one-sequence step, where one vector pass
   takes a few microseconds.

   Vector paths keep, per lane, the largest value so far and its first index (a strict compare, so a later equal
   value never replaces it); at the end the lanes holding the row's maximum give their smallest index, which is
   the first occurrence. The tail after the last full vector is compared strictly against that. A NaN fails every
   ordered compare, so the lanes also OR an unordered compare; a row that has a NaN is rescanned for the first
   one. Rows are shared out over OpenMP threads where there are several. */
#include <math.h>
#include <stdint.h>

#include "simd.h"

static int64_t first_nan(const float* x, int V) {
    for (int i = 0; i < V; i++)
        if (isnan(x[i])) return i;
    return -1;
}

static int64_t argmax_scalar(const float* x, int V, int from, float best, int64_t at) {
    for (int i = from; i < V; i++) {
        if (isnan(x[i])) return first_nan(x, V);
        if (x[i] > best) {
            best = x[i];
            at = i;
        }
    }
    return at;
}

static int64_t argmax_row(const float* x, int V) {
#if INFERQ_HAVE_AVX512
    if (V >= 16) {
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i idx = at;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        int i = 0;
        for (; i + 16 <= V; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best = _mm512_mask_mov_ps(best, gt, v);
            at = _mm512_mask_mov_epi32(at, gt, idx);
            idx = _mm512_add_epi32(idx, step);
        }
        if (nan) return first_nan(x, V);
        const float m = _mm512_reduce_max_ps(best);
        const __mmask16 is_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
        const int first = _mm512_mask_reduce_min_epi32(is_max, at);
        return argmax_scalar(x, V, i, m, first);
    }
#elif INFERQ_HAVE_AVX2
    if (V >= 8) {
        __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = at;
        const __m256i step = _mm256_set1_epi32(8);
        int i = 0;
        for (; i + 8 <= V; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best = _mm256_blendv_ps(best, v, gt);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
            idx = _mm256_add_epi32(idx, step);
        }
        if (_mm256_movemask_ps(nan)) return first_nan(x, V);
        float b[8];
        int32_t a[8];
        _mm256_storeu_ps(b, best);
        _mm256_storeu_si256((__m256i*)a, at);
        float m = b[0];
        int64_t first = a[0];
        for (int l = 1; l < 8; l++)
            if (b[l] > m || (b[l] == m && a[l] < first)) {
                m = b[l];
                first = a[l];
            }
        return argmax_scalar(x, V, i, m, first);
    }
#endif
    return argmax_scalar(x, V, 0, -INFINITY, 0); /* all -inf (or V = 0): index 0, as torch */
}

/* out[r] = argmax of row r (R rows of V floats, row stride rs). */
void argmax_rows_f32(const float* x, int64_t rs, int R, int V, int64_t* out) {
#pragma omp parallel for schedule(static) if (R > 1)
    for (int r = 0; r < R; r++) out[r] = argmax_row(x + (int64_t)r * rs, V);
}
