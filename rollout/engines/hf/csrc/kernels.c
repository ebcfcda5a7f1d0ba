/* The CPU engine's C kernels, built by rollout/engines/hf/native.py and called by
 * fast_kernels.py.
 *
 * Decode attention (one query per row) over the engine's slot KV cache, float32.
 *
 * For each row b and KV head h, the G query heads that share h (repeat_kv's layout: query
 * head h*G + g) attend to K/V columns [0, T) of that row, with eager attention's math:
 * scores = (q . k) * scale + mask, softmax in float32, out = probs @ v. Columns whose
 * additive mask is at or below `skip_below` (padding and holes) are never read: in a batch
 * of mixed lengths most of a short row's columns are padding, which a batched matmul reads
 * and multiplies anyway. Each K and V column is read once for all G heads.
 *
 * Layouts (strides in elements): q and out [B, Hkv * G, D] contiguous; k and v with
 * strides (row, head, column) and a contiguous head dim; mask [B, T] with row stride.
 * Built by rollout/engines/hf/native.py with -ffast-math (vectorized expf; sums
 * reassociated) and -fopenmp-simd (the simd pragmas, no OpenMP runtime). Masked columns may
 * hold -inf in the mask: they are only compared, never computed with.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC/Clang vector extensions: SIMD on any target, no intrinsics. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

static inline float dot(const float *a, const float *b, int64_t n) {
    if ((n & 7) == 0) {
        v8f acc0 = {0}, acc1 = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            acc0 += *(const v8f *)(a + i) * *(const v8f *)(b + i);
            acc1 += *(const v8f *)(a + i + 8) * *(const v8f *)(b + i + 8);
        }
        if (i < n) acc0 += *(const v8f *)(a + i) * *(const v8f *)(b + i);
        acc0 += acc1;
        return ((acc0[0] + acc0[4]) + (acc0[1] + acc0[5])) + ((acc0[2] + acc0[6]) + (acc0[3] + acc0[7]));
    }
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

int homegym_decode_attention(const float *q, const float *k, const float *v, const float *mask,
                             float *out, int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D,
                             int64_t skb, int64_t skh, int64_t skt, int64_t svb, int64_t svh,
                             int64_t svt, int64_t smb, float scale, float skip_below) {
    float *scores = malloc(sizeof(float) * (size_t)(G * T));
    int32_t *cols = malloc(sizeof(int32_t) * (size_t)T);
    float *maxs = malloc(sizeof(float) * (size_t)G);
    float *sums = malloc(sizeof(float) * (size_t)G);
    if (!scores || !cols || !maxs || !sums) {
        free(scores); free(cols); free(maxs); free(sums);
        return 1;
    }
    for (int64_t b = 0; b < B; b++) {
        const float *mrow = mask + b * smb;
        int64_t n = 0;  /* the row's attended columns */
        for (int64_t t = 0; t < T; t++)
            if (mrow[t] > skip_below) cols[n++] = (int32_t)t;
        for (int64_t h = 0; h < Hkv; h++) {
            const float *kb = k + b * skb + h * skh, *vb = v + b * svb + h * svh;
            const float *qh = q + (b * Hkv + h) * G * D;
            float *oh = out + (b * Hkv + h) * G * D;
            for (int64_t g = 0; g < G; g++) maxs[g] = -FLT_MAX;
            for (int64_t j = 0; j < n; j++) {
                const int64_t t = cols[j];
                const float *kt = kb + t * skt;
                for (int64_t g = 0; g < G; g++) {
                    float s = dot(qh + g * D, kt, D) * scale + mrow[t];
                    scores[g * T + j] = s;
                    if (s > maxs[g]) maxs[g] = s;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *sg = scores + g * T, m = maxs[g], sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < n; j++) {
                    sg[j] = expf(sg[j] - m);
                    sum += sg[j];
                }
                sums[g] = sum;
            }
            for (int64_t g = 0; g < G; g++) {
                float *sg = scores + g * T, inv = 1.0f / sums[g];
#pragma omp simd
                for (int64_t j = 0; j < n; j++) sg[j] *= inv;
            }
            memset(oh, 0, sizeof(float) * (size_t)(G * D));
            for (int64_t j = 0; j < n; j++) {
                const float *vt = vb + (int64_t)cols[j] * svt;
                for (int64_t g = 0; g < G; g++) {
                    const float p = scores[g * T + j];
                    float *o = oh + g * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] += p * vt[d];
                }
            }
        }
    }
    free(scores); free(cols); free(maxs); free(sums);
    return 0;
}

/* Rotary position embedding in place, transformers' rotate-half form:
 * out[i] = x[i] * cos[i] - x[i + D/2] * sin[i] and out[i + D/2] = x[i + D/2] * cos[i + D/2]
 * + x[i] * sin[i + D/2], for x [M, H, D] and cos/sin [M, D], all contiguous. Without FMA
 * contraction it rounds exactly as q * cos + rotate_half(q) * sin does in torch: one pass
 * over q and k instead of torch's five temporaries (q * cos, two halves, -x2, their cat,
 * the product with sin, the sum). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void homegym_rope(float *x, const float *cos, const float *sin, int64_t M, int64_t H,
                  int64_t D) {
    const int64_t half = D / 2;
    for (int64_t m = 0; m < M; m++) {
        const float *c = cos + m * D, *s = sin + m * D;
        for (int64_t h = 0; h < H; h++) {
            float *a = x + (m * H + h) * D, *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}
#pragma GCC pop_options
