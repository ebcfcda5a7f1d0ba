/* The CPU engine's C kernels, built by rollout/engines/hf/native.py and called by
 * fast_kernels.py.
 *
 * Attention, float32: decode (one query per row) over the engine's slot KV cache, and a
 * prefill of fresh prompts packed end to end (causal, each prompt to itself). At the end,
 * a whole decode step's decoder layers in one call (homegym_decode_layers).
 *
 * For each query and KV head h, the G query heads that share h (repeat_kv's layout: query
 * head h*G + g) attend to K/V columns [0, T) of that row, with eager attention's math:
 * scores = (q . k) * scale + mask, softmax in float32, out = probs @ v. Columns whose
 * additive mask is at or below `skip_below` (padding and holes) are never read: in a batch
 * of mixed lengths most of a short row's columns are padding, which a batched matmul reads
 * and multiplies anyway. Each K and V column is loaded once for two of the G heads.
 * Decode scores a column as a dot product (four columns' sums reduced together); a packed
 * prefill transposes each prompt's K once and scores a vector of columns per step, for
 * two tokens and two heads at a time (no horizontal sums). Vectors are the widest the
 * target has: 16 floats with AVX-512, else 8.
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

/* The widest float vector the target has (-march=native): 16 lanes with AVX-512, else 8. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));

/* n rounded up to whole vectors: the room every score buffer has per row. */
static inline int64_t padded(int64_t n) { return (n + VW - 1) / VW * VW; }

/* Softmax's numerator in place, s[i] = exp(s[i] - max(s)) over [0, n); returns its sum
 * (the normalization is applied to the output, once). s has room for padded(n): the
 * scores past n are set to max - 80, whose exp (1.8e-35) leaves the sum unchanged, so the
 * exp loop runs whole vectors only. A scalar remainder would call libm's expf a float at a
 * time (~0.5 of a row's exp time at 40-100 columns). */
static inline float exp_shifted(float *s, int64_t n) {
    const int64_t np = padded(n);
    float m = -FLT_MAX, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    for (int64_t i = n; i < np; i++) s[i] = m - 80.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < np; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

/* Lanes 0-7 plus lanes 8-15 (nothing to add at 8 lanes). */
static inline v8f fold8(vf a) {
#if VW == 16
    v8f lo, hi;
    memcpy(&lo, &a, sizeof lo);
    memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
    return lo + hi;
#else
    return a;
#endif
}

/* A pair of query heads sharing a KV head (GG = 2; GG = 1: one head), head dim DV * VW
 * known at compile time (inlined per size, so the query chunks and sums live in
 * registers): scores against the columns `cols` into s0 (and s1), four columns at a time,
 * each K column loaded once for both heads and the four dot products summed together
 * (sum4): score = (q . k) * scale + mask. */
static inline __attribute__((always_inline)) void scores_group(
        const float *qh, const float *kb, const float *mrow, const int32_t *cols, int64_t n,
        int64_t skt, float scale, float *s0, float *s1, const int GG, const int DV) {
    const vf *q0 = (const vf *)qh, *q1 = (const vf *)(qh + (GG > 1 ? DV * VW : 0));
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const vf *k0 = (const vf *)(kb + cols[j] * skt), *k1 = (const vf *)(kb + cols[j + 1] * skt);
        const vf *k2 = (const vf *)(kb + cols[j + 2] * skt), *k3 = (const vf *)(kb + cols[j + 3] * skt);
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
#pragma GCC unroll 16
        for (int c = 0; c < DV; c++) {
            const vf x0 = k0[c], x1 = k1[c], x2 = k2[c], x3 = k3[c], qa = q0[c];
            a0 += qa * x0; a1 += qa * x1; a2 += qa * x2; a3 += qa * x3;
            if (GG > 1) {
                const vf qb = q1[c];
                b0 += qb * x0; b1 += qb * x1; b2 += qb * x2; b3 += qb * x3;
            }
        }
        const v8f r = sum4(fold8(a0), fold8(a1), fold8(a2), fold8(a3));
        for (int i = 0; i < 4; i++) s0[j + i] = r[i] * scale + mrow[cols[j + i]];
        if (GG > 1) {
            const v8f t = sum4(fold8(b0), fold8(b1), fold8(b2), fold8(b3));
            for (int i = 0; i < 4; i++) s1[j + i] = t[i] * scale + mrow[cols[j + i]];
        }
    }
    for (; j < n; j++) {
        const float *kc = kb + cols[j] * skt;
        s0[j] = dot(qh, kc, DV * VW) * scale + mrow[cols[j]];
        if (GG > 1) s1[j] = dot(qh + DV * VW, kc, DV * VW) * scale + mrow[cols[j]];
    }
}

/* out = (p @ V) * inv for one head (GG = 1) or a pair sharing V (p0/p1, inv0/inv1, out
 * rows o and o + DV * VW): each V column loaded once for both; small heads take two
 * columns a step into two sets of sums, so more FMA chains are in flight. */
static inline __attribute__((always_inline)) void weighted_sum_group(
        const float *p0, const float *p1, float inv0, float inv1, const float *vb,
        const int32_t *cols, int64_t n, int64_t svt, float *oh, const int GG, const int DV) {
    const int two = GG * DV <= 8;  /* the second set of sums fits in the registers */
    vf u[16], w[16], x[16], y[16];  /* DV <= 16; u, w: head 0; x, y: head 1 */
    for (int c = 0; c < DV; c++) u[c] = w[c] = x[c] = y[c] = (vf){0};
    int64_t i = 0;
    if (two)
        for (; i + 2 <= n; i += 2) {
            const vf *v0 = (const vf *)(vb + cols[i] * svt), *v1 = (const vf *)(vb + cols[i + 1] * svt);
            const float a0 = p0[i], a1 = p0[i + 1];
            const float b0 = GG > 1 ? p1[i] : 0.0f, b1 = GG > 1 ? p1[i + 1] : 0.0f;
#pragma GCC unroll 16
            for (int c = 0; c < DV; c++) {
                u[c] += a0 * v0[c]; w[c] += a1 * v1[c];
                if (GG > 1) { x[c] += b0 * v0[c]; y[c] += b1 * v1[c]; }
            }
        }
    for (; i < n; i++) {
        const vf *v0 = (const vf *)(vb + cols[i] * svt);
        const float a0 = p0[i], b0 = GG > 1 ? p1[i] : 0.0f;
#pragma GCC unroll 16
        for (int c = 0; c < DV; c++) {
            u[c] += a0 * v0[c];
            if (GG > 1) x[c] += b0 * v0[c];
        }
    }
    vf *o0 = (vf *)oh, *o1 = (vf *)(oh + DV * VW);
    for (int c = 0; c < DV; c++) {
        o0[c] = (two ? u[c] + w[c] : u[c]) * inv0;
        if (GG > 1) o1[c] = (two ? x[c] + y[c] : x[c]) * inv1;
    }
}

/* One query row's G heads that share a KV head, two at a time: scores, softmax's
 * numerator, probs @ V with 1 / sum applied once at the end. */
static inline __attribute__((always_inline)) void attend_fixed(
        const float *qh, const float *kb, const float *vb, const float *mrow,
        const int32_t *cols, int64_t n, int64_t G, int64_t skt, int64_t svt, float scale,
        float *scores, float *oh, const int DV) {
    float *s0 = scores, *s1 = scores + padded(n);
    int64_t g = 0;
    for (; g + 2 <= G && DV <= 8; g += 2) {
        const float *qg = qh + g * DV * VW;
        scores_group(qg, kb, mrow, cols, n, skt, scale, s0, s1, 2, DV);
        const float inv0 = 1.0f / exp_shifted(s0, n), inv1 = 1.0f / exp_shifted(s1, n);
        weighted_sum_group(s0, s1, inv0, inv1, vb, cols, n, svt, oh + g * DV * VW, 2, DV);
    }
    for (; g < G; g++) {
        const float *qg = qh + g * DV * VW;
        scores_group(qg, kb, mrow, cols, n, skt, scale, s0, s0, 1, DV);
        const float inv = 1.0f / exp_shifted(s0, n);
        weighted_sum_group(s0, s0, inv, inv, vb, cols, n, svt, oh + g * DV * VW, 1, DV);
    }
}

/* Any head dim: the same math, one column and head at a time. */
static void attend_any(const float *qh, const float *kb, const float *vb, const float *mrow,
                       const int32_t *cols, int64_t n, int64_t G, int64_t D, int64_t skt,
                       int64_t svt, float scale, float *scores, float *oh) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * padded(n);
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
    if (D == 2 * VW)
        attend_fixed(qh, kb, vb, mrow, cols, n, G, skt, svt, scale, scores, oh, 2);
    else if (D == 4 * VW)
        attend_fixed(qh, kb, vb, mrow, cols, n, G, skt, svt, scale, scores, oh, 4);
    else if (D == 8 * VW)
        attend_fixed(qh, kb, vb, mrow, cols, n, G, skt, svt, scale, scores, oh, 8);
    else if (D == 16 * VW)
        attend_fixed(qh, kb, vb, mrow, cols, n, G, skt, svt, scale, scores, oh, 16);
    else
        attend_any(qh, kb, vb, mrow, cols, n, G, D, skt, svt, scale, scores, oh);
}

int homegym_decode_attention(const float *q, const float *k, const float *v, const float *mask,
                             float *out, int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D,
                             int64_t skb, int64_t skh, int64_t skt, int64_t svb, int64_t svh,
                             int64_t svt, int64_t smb, float scale, float skip_below) {
    float *scores = malloc(sizeof(float) * (size_t)(G * padded(T)));
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

/* Scores of R query rows (R <= 4) against CB * VW columns of a sequence's K transposed,
 * kt [D][lp], from column c0: s = (q . k) * scale. Each step multiplies a row of K^T by one
 * broadcast query element per query row, so no dot product needs a horizontal sum (which a
 * head dim of 32-128, a few vectors a column, would pay on every score), and each K^T row
 * loaded serves all R rows. With few sums in flight (R * CB <= 4), even and odd d go to
 * separate sums, so more FMA chains run at once. */
static inline __attribute__((always_inline)) void scores_kt(
        const float *const *qs, float *const *ss, const float *kt, int64_t lp, int64_t D,
        int64_t c0, float scale, const int R, const int CB) {
    const int split = R * CB <= 4;
    vf a[4][4], e[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < CB; c++) a[r][c] = e[r][c] = (vf){0};
    for (int64_t d = 0; d < D; d += 2) {  /* D is a multiple of VW: even */
        const vf *k0 = (const vf *)(kt + d * lp + c0), *k1 = (const vf *)(kt + (d + 1) * lp + c0);
        for (int r = 0; r < R; r++) {
            const float x0 = qs[r][d], x1 = qs[r][d + 1];
            for (int c = 0; c < CB; c++) {
                a[r][c] += x0 * k0[c];
                if (split) e[r][c] += x1 * k1[c];
                else a[r][c] += x1 * k1[c];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < CB; c++)
            *(vf *)(ss[r] + c0 + c * VW) = (split ? a[r][c] + e[r][c] : a[r][c]) * scale;
}

/* All R rows' scores over n columns (VW-column chunks: CW at a time, then one). */
static inline __attribute__((always_inline)) void scores_kt_all(
        const float *const *qs, float *const *ss, const float *kt, int64_t lp, int64_t D,
        int64_t n, float scale, const int R) {
    const int CW = VW == 16 || R <= 2 ? 4 : 2;  /* R * CW sums fit in the registers */
    const int64_t chunks = (n + VW - 1) / VW;
    int64_t c = 0;
    for (; c + CW <= chunks; c += CW) scores_kt(qs, ss, kt, lp, D, c * VW, scale, R, CW);
    for (; c < chunks; c++) scores_kt(qs, ss, kt, lp, D, c * VW, scale, R, 1);
}

/* One sequence of L tokens from token `start`, KV head h, head dim DV * VW: its K
 * transposed once into kt (zero past L, so whole vectors of columns can be read), then its
 * tokens two at a time, with their query heads in pairs where registers allow (token i's
 * row reads the scores of columns [0, i] only; the column after is scored for its
 * neighbour and ignored); softmax's numerator and probs @ V per token. */
static inline __attribute__((always_inline)) void causal_sequence(
        const float *q, const float *k, const float *v, float *out, const int32_t *cols,
        int64_t start, int64_t L, int64_t Hkv, int64_t G, int64_t h, float scale, float *kt,
        float *scores, const int DV) {
    const int64_t D = DV * VW, lp = padded(L + 1), stride = Hkv * D;
    const int64_t GP = DV <= 8 ? 2 : 1;  /* heads per weighted sum */
    for (int64_t j = 0; j < L; j++) {
        const float *kj = k + (start + j) * stride + h * D;
        for (int64_t d = 0; d < D; d++) kt[d * lp + j] = kj[d];
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = L; j < lp; j++) kt[d * lp + j] = 0.0f;
    const float *vb = v + h * D;
    for (int64_t i = 0; i < L; i += 2) {
        const int64_t T = i + 1 < L ? 2 : 1;
        for (int64_t g = 0; g < G; g += GP) {
            const int64_t P = g + 1 < G ? GP : 1;  /* heads g .. g + P - 1 */
            const float *qs[4];
            float *ss[4];
            int R = 0;
            for (int64_t t = 0; t < T; t++)
                for (int64_t p = 0; p < P; p++, R++) {
                    qs[R] = q + ((start + i + t) * Hkv + h) * G * D + (g + p) * D;
                    ss[R] = scores + R * lp;
                }
            const int64_t n = i + T;  /* columns the last token attends to */
            if (R == 4)
                scores_kt_all(qs, ss, kt, lp, D, n, scale, 4);
            else if (R == 2)
                scores_kt_all(qs, ss, kt, lp, D, n, scale, 2);
            else
                scores_kt_all(qs, ss, kt, lp, D, n, scale, 1);
            for (int64_t t = 0; t < T; t++) {
                float *s0 = ss[t * P], *s1 = ss[t * P + P - 1];
                float *o = out + ((start + i + t) * Hkv + h) * G * D + g * D;
                const float inv0 = 1.0f / exp_shifted(s0, i + t + 1);
                if (P == 2) {
                    const float inv1 = 1.0f / exp_shifted(s1, i + t + 1);
                    weighted_sum_group(s0, s1, inv0, inv1, vb, cols + start, i + t + 1, stride,
                                       o, 2, DV);
                } else {
                    weighted_sum_group(s0, s0, inv0, inv0, vb, cols + start, i + t + 1, stride,
                                       o, 1, DV);
                }
            }
        }
    }
}

static void causal_sequences(const float *q, const float *k, const float *v, float *out,
                             const int32_t *cols, const int64_t *bounds, int64_t R,
                             int64_t Hkv, int64_t G, float scale, float *kt, float *scores,
                             const int DV) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < Hkv; h++)
            causal_sequence(q, k, v, out, cols, bounds[r], bounds[r + 1] - bounds[r], Hkv, G, h,
                            scale, kt, scores, DV);
}

/* Causal attention of packed sequences with no past (a prefill of fresh prompts): R
 * sequences laid end to end, sequence r at tokens [bounds[r], bounds[r + 1]); token i
 * attends to tokens [bounds[r], i] of its own sequence. q and out [N, Hkv * G, D], k and v
 * [N, Hkv, D], all contiguous. One call for the whole prefill where SDPA takes one per
 * sequence, each paying its setup for a few dozen tokens. Head dims of 2-16 vectors take
 * the K^T path above; others score a column at a time (attend_any). */
int homegym_varlen_causal_attention(const float *q, const float *k, const float *v,
                                    float *out, const int64_t *bounds, int64_t R, int64_t Hkv,
                                    int64_t G, int64_t D, float scale) {
    const int64_t N = bounds[R] > 0 ? bounds[R] : 1;
    int64_t longest = 1;
    for (int64_t r = 0; r < R; r++)
        if (bounds[r + 1] - bounds[r] > longest) longest = bounds[r + 1] - bounds[r];
    const int64_t lp = padded(longest + 1);  /* as causal_sequence's */
    const int DV = D % VW ? 0 : (int)(D / VW);
    const int fixed = DV == 2 || DV == 4 || DV == 8 || DV == 16;
    float *scores = malloc(sizeof(float) * (size_t)((fixed ? 4 : G) * lp));
    float *kt = fixed ? malloc(sizeof(float) * (size_t)(D * lp)) : NULL;
    float *zeros = fixed ? NULL : calloc((size_t)N, sizeof(float));  /* no additive mask */
    int32_t *cols = malloc(sizeof(int32_t) * (size_t)N);
    if (!scores || !cols || (fixed ? !kt : !zeros)) {
        free(scores); free(kt); free(zeros); free(cols);
        return 1;
    }
    for (int64_t i = 0; i < bounds[R]; i++) cols[i] = (int32_t)i;
    if (DV == 2)
        causal_sequences(q, k, v, out, cols, bounds, R, Hkv, G, scale, kt, scores, 2);
    else if (DV == 4)
        causal_sequences(q, k, v, out, cols, bounds, R, Hkv, G, scale, kt, scores, 4);
    else if (DV == 8)
        causal_sequences(q, k, v, out, cols, bounds, R, Hkv, G, scale, kt, scores, 8);
    else if (DV == 16)
        causal_sequences(q, k, v, out, cols, bounds, R, Hkv, G, scale, kt, scores, 16);
    else
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = bounds[r]; i < bounds[r + 1]; i++)
                for (int64_t h = 0; h < Hkv; h++) {
                    const int64_t at = (i * Hkv + h) * G * D;
                    attend_any(q + at, k + h * D, v + h * D, zeros, cols + bounds[r],
                               i - bounds[r] + 1, G, D, Hkv * D, Hkv * D, scale, scores,
                               out + at);
                }
    free(scores); free(kt); free(zeros); free(cols);
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

/* MKL's sgemm (Fortran interface, 32-bit integers), as torch's CPU library exports it: the
 * routine F.linear reaches for float32 on x86. */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *,
                         const float *, const float *, const int *, const float *, const int *,
                         const float *, float *, const int *);

/* out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) as torch's addmm makes it: the bias
 * copied into out first, then the column-major product out^T = w^T' x^T with beta 1. */
static void linear(sgemm_fn gemm, const float *x, const float *w, const float *bias,
                   float *out, int M, int N, int K) {
    const float one = 1.0f, zero = 0.0f;
    if (bias)
        for (int m = 0; m < M; m++) memcpy(out + (int64_t)m * N, bias, sizeof(float) * (size_t)N);
    gemm("T", "N", &N, &M, &K, &one, w, &K, x, &K, bias ? &one : &zero, out, &N);
}

/* What homegym_decode_layers reads of each layer, in this order (params[l * P_COUNT + i]);
 * biases and the Qwen3 q/k norms may be NULL. */
enum { P_IN_NORM, P_Q, P_QB, P_K, P_KB, P_V, P_VB, P_Q_NORM, P_K_NORM, P_O, P_OB,
       P_POST_NORM, P_GATE, P_GATEB, P_UP, P_UPB, P_DOWN, P_DOWNB, P_KBUF, P_VBUF, P_COUNT };

/* One decode step through the decoder layers of a Llama-family model (Llama, Qwen2, Qwen3),
 * float32, one new token per row, in the lean forward's order of operations
 * (rollout/engines/hf/lean.py): per layer RMSNorm, the q/k/v projections, Qwen3's q/k
 * norms, RoPE, the new K/V written into column `col` of the slot buffers, attention over
 * the columns [0, col] the row's mask keeps, the output projection added to the residual,
 * RMSNorm, the gated MLP added to it. x [B, hidden] is the residual stream, updated in
 * place; cos/sin [B, D] this step's rotary tables; mask [B, col + 1] (row stride smb) the
 * batch's 0/1 attention mask; K/V buffers with strides (row, head, column) and a
 * contiguous head dim, the same for every layer. eps: four per layer (input norm, post
 * norm, q norm, k norm). One call where the Python forward makes ~15 per layer, each with
 * its dispatch: a small model's decode step is mostly that overhead. Returns 1 when out of
 * memory for its scratch buffers. */
int homegym_decode_layers(void *gemm_ptr, void *const *params, const float *eps, int64_t L,
                          float *x, int64_t B, int64_t hidden, int64_t Hkv, int64_t G,
                          int64_t D, int64_t inter, const float *cos, const float *sin,
                          const int64_t *mask, int64_t smb, int64_t col, int64_t skb,
                          int64_t skh, int64_t skt, float scale) {
    const sgemm_fn gemm = (sgemm_fn)gemm_ptr;
    const int64_t H = Hkv * G, T = col + 1;
    const int M = (int)B, HID = (int)hidden, QD = (int)(H * D), KD = (int)(Hkv * D),
              I = (int)inter;
    float *h = malloc(sizeof(float) * (size_t)(B * hidden));
    float *q = malloc(sizeof(float) * (size_t)(B * H * D));
    float *k = malloc(sizeof(float) * (size_t)(B * Hkv * D));
    float *v = malloc(sizeof(float) * (size_t)(B * Hkv * D));
    float *att = malloc(sizeof(float) * (size_t)(B * H * D));
    float *tmp = malloc(sizeof(float) * (size_t)(B * hidden));
    float *gate = malloc(sizeof(float) * (size_t)(B * inter));
    float *up = malloc(sizeof(float) * (size_t)(B * inter));
    float *scores = malloc(sizeof(float) * (size_t)(G * padded(T)));
    float *zeros = calloc((size_t)T, sizeof(float));
    int32_t *cols = malloc(sizeof(int32_t) * (size_t)(B * T));
    int64_t *ncols = malloc(sizeof(int64_t) * (size_t)B);
    int rc = 0;
    if (!h || !q || !k || !v || !att || !tmp || !gate || !up || !scores || !zeros || !cols
            || !ncols) {
        rc = 1;
        goto done;
    }
    for (int64_t b = 0; b < B; b++) {  /* the same columns in every layer */
        int64_t n = 0;
        for (int64_t t = 0; t < T; t++)
            if (mask[b * smb + t]) cols[b * T + n++] = (int32_t)t;
        ncols[b] = n;
    }
    for (int64_t l = 0; l < L; l++) {
        void *const *p = params + l * P_COUNT;
        const float *e = eps + 4 * l;
        float *kbuf = p[P_KBUF], *vbuf = p[P_VBUF];
        homegym_rms_norm(x, p[P_IN_NORM], h, B, hidden, e[0]);
        linear(gemm, h, p[P_Q], p[P_QB], q, M, QD, HID);
        linear(gemm, h, p[P_K], p[P_KB], k, M, KD, HID);
        linear(gemm, h, p[P_V], p[P_VB], v, M, KD, HID);
        if (p[P_Q_NORM]) homegym_rms_norm(q, p[P_Q_NORM], q, B * H, D, e[2]);
        if (p[P_K_NORM]) homegym_rms_norm(k, p[P_K_NORM], k, B * Hkv, D, e[3]);
        homegym_rope(q, cos, sin, B, H, D);
        homegym_rope(k, cos, sin, B, Hkv, D);
        for (int64_t b = 0; b < B; b++)
            for (int64_t hh = 0; hh < Hkv; hh++) {
                const int64_t at = b * skb + hh * skh + col * skt;
                memcpy(kbuf + at, k + (b * Hkv + hh) * D, sizeof(float) * (size_t)D);
                memcpy(vbuf + at, v + (b * Hkv + hh) * D, sizeof(float) * (size_t)D);
            }
        for (int64_t b = 0; b < B; b++)
            for (int64_t hh = 0; hh < Hkv; hh++)
                attend(q + (b * Hkv + hh) * G * D, kbuf + b * skb + hh * skh,
                       vbuf + b * skb + hh * skh, zeros, cols + b * T, ncols[b], G, D, skt,
                       skt, scale, scores, att + (b * Hkv + hh) * G * D);
        linear(gemm, att, p[P_O], p[P_OB], tmp, M, HID, QD);
        for (int64_t i = 0; i < B * hidden; i++) x[i] += tmp[i];
        homegym_rms_norm(x, p[P_POST_NORM], h, B, hidden, e[1]);
        linear(gemm, h, p[P_GATE], p[P_GATEB], gate, M, I, HID);
        linear(gemm, h, p[P_UP], p[P_UPB], up, M, I, HID);
        homegym_silu_mul(gate, up, B * inter);
        linear(gemm, gate, p[P_DOWN], p[P_DOWNB], tmp, M, HID, I);
        for (int64_t i = 0; i < B * hidden; i++) x[i] += tmp[i];
    }
done:
    free(h); free(q); free(k); free(v); free(att); free(tmp); free(gate); free(up);
    free(scores); free(zeros); free(cols); free(ncols);
    return rc;
}
