/* The CPU engine's C kernels, built by rollout/engines/hf/native.py and called by
 * fast_kernels.py.
 *
 * Attention, float32: decode (one query per row) over the engine's slot KV cache, and a
 * prefill of fresh prompts packed end to end (causal, each prompt to itself).
 *
 * For each query and KV head h, the G query heads that share h (repeat_kv's layout: query
 * head h*G + g) attend to K/V columns [0, T) of that row, with eager attention's math:
 * scores = (q . k) * scale + mask, softmax in float32, out = probs @ v. Columns whose
 * additive mask is at or below `skip_below` (padding and holes) are never read: in a batch
 * of mixed lengths most of a short row's columns are padding, which a batched matmul reads
 * and multiplies anyway. Each K and V column is read once for all G heads.
 *
 * Decode layouts (strides in elements): q and out [B, Hkv * G, D] contiguous; k and v with
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

/* The transposed sum of four vectors: lane i of the result is the sum of the lanes of
 * a_i, for i < 4 (each level adds neighbouring pairs; 6 shuffles + 4 adds for 4 sums where
 * four scalar reductions take 28 adds). */
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v8i __attribute__((vector_size(32)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif
static inline v8f sum4(v8f a0, v8f a1, v8f a2, v8f a3) {
    v8f u = SHUF(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
    v8f w = SHUF(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
    v8f z = SHUF(u, w, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(u, w, 2, 3, 10, 11, 6, 7, 14, 15);
    return z + SHUF(z, z, 4, 5, 6, 7, 0, 1, 2, 3);  /* lanes 0-3 */
}

/* Softmax's numerator in place, s[i] = exp(s[i] - max(s)); returns its sum (the
 * normalization is applied to the output, once). */
static inline float exp_shifted(float *s, int64_t n) {
    float m = -FLT_MAX, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

/* One row's KV head for a head dim DV * 8 known at compile time (inlined per size), so the
 * query chunks and output accumulators live in registers:
 * scores: four columns at a time, each K column read from memory once per query head and
 * the four dot products summed together (sum4); softmax; probs @ V with the output in
 * registers and the 1 / sum applied once at the end. */
static inline __attribute__((always_inline)) void attend_fixed(
        const float *qh, const float *kb, const float *vb, const float *mrow,
        const int32_t *cols, int64_t n, int64_t G, int64_t skt, int64_t svt, float scale,
        float *scores, float *oh, const int DV) {
    for (int64_t g = 0; g < G; g++) {
        const v8f *qg = (const v8f *)(qh + g * DV * 8);
        float *sg = scores + g * n;
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            const v8f *k0 = (const v8f *)(kb + cols[j] * skt), *k1 = (const v8f *)(kb + cols[j + 1] * skt);
            const v8f *k2 = (const v8f *)(kb + cols[j + 2] * skt), *k3 = (const v8f *)(kb + cols[j + 3] * skt);
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
#pragma GCC unroll 16
            for (int c = 0; c < DV; c++) {
                const v8f qc = qg[c];
                a0 += qc * k0[c]; a1 += qc * k1[c]; a2 += qc * k2[c]; a3 += qc * k3[c];
            }
            const v8f r = sum4(a0, a1, a2, a3);
            for (int i = 0; i < 4; i++) sg[j + i] = r[i] * scale + mrow[cols[j + i]];
        }
        for (; j < n; j++) sg[j] = dot(qh + g * DV * 8, kb + cols[j] * skt, DV * 8) * scale + mrow[cols[j]];
        const float sum = exp_shifted(sg, n);
        v8f acc[16];  /* DV <= 16 */
        for (int c = 0; c < DV; c++) acc[c] = (v8f){0};
        for (int64_t i = 0; i < n; i++) {
            const v8f *vt = (const v8f *)(vb + cols[i] * svt);
            const float p = sg[i];
#pragma GCC unroll 16
            for (int c = 0; c < DV; c++) acc[c] += p * vt[c];
        }
        const float inv = 1.0f / sum;
        v8f *o = (v8f *)(oh + g * DV * 8);
        for (int c = 0; c < DV; c++) o[c] = acc[c] * inv;
    }
}

/* Any head dim: the same math, one column and head at a time. */
static void attend_any(const float *qh, const float *kb, const float *vb, const float *mrow,
                       const int32_t *cols, int64_t n, int64_t G, int64_t D, int64_t skt,
                       int64_t svt, float scale, float *scores, float *oh) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * n;
        for (int64_t j = 0; j < n; j++)
            sg[j] = dot(qh + g * D, kb + cols[j] * skt, D) * scale + mrow[cols[j]];
        const float sum = exp_shifted(sg, n);
        float *o = oh + g * D;
        memset(o, 0, sizeof(float) * (size_t)D);
        for (int64_t j = 0; j < n; j++) {
            const float *vt = vb + (int64_t)cols[j] * svt, p = sg[j];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * vt[d];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

/* One query row's G heads that share a KV head over the columns `cols`. */
static inline void attend(const float *qh, const float *kb, const float *vb, const float *mrow,
                          const int32_t *cols, int64_t n, int64_t G, int64_t D, int64_t skt,
                          int64_t svt, float scale, float *scores, float *oh) {
    if (D == 32)
        attend_fixed(qh, kb, vb, mrow, cols, n, G, skt, svt, scale, scores, oh, 4);
    else if (D == 64)
        attend_fixed(qh, kb, vb, mrow, cols, n, G, skt, svt, scale, scores, oh, 8);
    else if (D == 128)
        attend_fixed(qh, kb, vb, mrow, cols, n, G, skt, svt, scale, scores, oh, 16);
    else
        attend_any(qh, kb, vb, mrow, cols, n, G, D, skt, svt, scale, scores, oh);
}

int homegym_decode_attention(const float *q, const float *k, const float *v, const float *mask,
                             float *out, int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D,
                             int64_t skb, int64_t skh, int64_t skt, int64_t svb, int64_t svh,
                             int64_t svt, int64_t smb, float scale, float skip_below) {
    float *scores = malloc(sizeof(float) * (size_t)(G * T));
    int32_t *cols = malloc(sizeof(int32_t) * (size_t)T);
    if (!scores || !cols) {
        free(scores); free(cols);
        return 1;
    }
    for (int64_t b = 0; b < B; b++) {
        const float *mrow = mask + b * smb;
        int64_t n = 0;  /* the row's attended columns */
        for (int64_t t = 0; t < T; t++)
            if (mrow[t] > skip_below) cols[n++] = (int32_t)t;
        for (int64_t h = 0; h < Hkv; h++)
            attend(q + (b * Hkv + h) * G * D, k + b * skb + h * skh, v + b * svb + h * svh,
                   mrow, cols, n, G, D, skt, svt, scale, scores, out + (b * Hkv + h) * G * D);
    }
    free(scores); free(cols);
    return 0;
}

/* Causal attention of packed sequences with no past (a prefill of fresh prompts): R
 * sequences laid end to end, sequence r at tokens [bounds[r], bounds[r + 1]); token i
 * attends to tokens [bounds[r], i] of its own sequence. q and out [N, Hkv * G, D], k and v
 * [N, Hkv, D], all contiguous. One call for the whole prefill where SDPA takes one per
 * sequence, each paying its setup for a few dozen tokens. */
int homegym_varlen_causal_attention(const float *q, const float *k, const float *v,
                                    float *out, const int64_t *bounds, int64_t R, int64_t Hkv,
                                    int64_t G, int64_t D, float scale) {
    const int64_t N = bounds[R];
    float *scores = malloc(sizeof(float) * (size_t)(G * (N > 0 ? N : 1)));
    float *zeros = calloc((size_t)(N > 0 ? N : 1), sizeof(float));  /* no additive mask */
    int32_t *cols = malloc(sizeof(int32_t) * (size_t)(N > 0 ? N : 1));
    if (!scores || !zeros || !cols) {
        free(scores); free(zeros); free(cols);
        return 1;
    }
    for (int64_t i = 0; i < N; i++) cols[i] = (int32_t)i;
    for (int64_t r = 0; r < R; r++) {
        const int64_t start = bounds[r];
        for (int64_t i = start; i < bounds[r + 1]; i++) {
            for (int64_t h = 0; h < Hkv; h++) {
                const int64_t at = (i * Hkv + h) * G * D;
                attend(q + at, k + h * D, v + h * D, zeros, cols + start, i - start + 1, G, D,
                       Hkv * D, Hkv * D, scale, scores, out + at);
            }
        }
    }
    free(scores); free(zeros); free(cols);
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

/* RMSNorm over the last dim of x [M, D], float32, as the Llama family computes it:
 * out = w * (x * (1 / sqrt(mean(x^2) + eps))). out may be x (in place). One pass per row
 * where torch's CPU composite runs five ops (pow, mean, add, rsqrt, two muls), each with
 * its own dispatch and temporary: that overhead is most of a small model's norm. */
void homegym_rms_norm(const float *x, const float *w, float *out, int64_t M, int64_t D,
                      float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *o = out + m * D, ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < D; i++) ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
#pragma omp simd
        for (int64_t i = 0; i < D; i++) o[i] = w[i] * (xr[i] * r);
    }
}

/* exp(x) for x in [-87, 88] (callers clamp): 2^n * e^r with n = round(x / ln 2) and
 * Cephes' degree-7 polynomial for e^r on [-ln2/2, ln2/2], within ~2 ulp. Plain arithmetic,
 * so loops calling it vectorize with whatever the CPU has (glibc's vector expf measured
 * slower than torch's here). */
static inline float exp_clamped(float x) {
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* The gated MLP's activation in place, gate = silu(gate) * up over n floats (silu(x) =
 * x / (1 + exp(-x))): one vectorized pass where torch runs silu (its expf ~1 ns a float
 * on AVX2) and then the product, each over the whole [tokens, intermediate] tensor. */
void homegym_silu_mul(float *gate, const float *up, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float x = gate[i], m = x < -88.0f ? 88.0f : (x > 87.0f ? -87.0f : -x);
        gate[i] = x / (1.0f + exp_clamped(m)) * up[i];
    }
}
