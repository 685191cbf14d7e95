/* The small per-layer steps fused into one call each (see layer_ops.h). */
#include "layer_ops.h"

#include <math.h>
#include <string.h>

static void rope(const float *x, const float *c, const float *s, int64_t half, float *y) {
    for (int64_t i = 0; i < half; i++) {
        float lo = x[i], hi = x[i + half];
        y[i] = lo * c[i] - hi * s[i];
        y[i + half] = hi * c[i] + lo * s[i];
    }
}

void mobc_qkv_prologue(const float *qkv, int64_t N, int64_t Hq, int64_t G, int64_t D, const float *cos,
                       const float *sin, float *q, float *new_key, float *new_value) {
    const int64_t half = D / 2, C = (Hq + 2 * G) * D;
    float k[MOBC_MAX_HEAD_DIM];
    for (int64_t n = 0; n < N; n++) {
        const float *row = qkv + n * C, *c = cos + n * half, *s = sin + n * half;
        for (int64_t h = 0; h < Hq; h++) rope(row + h * D, c, s, half, q + (h * N + n) * D);
        for (int64_t g = 0; g < G; g++) {
            rope(row + (Hq + g) * D, c, s, half, k);
            for (int64_t d = 0; d < D; d++) new_key[(g * D + d) * N + n] = k[d];
            memcpy(new_value + (g * N + n) * D, row + (Hq + G + g) * D, sizeof(float) * (size_t)D);
        }
    }
}

int mobc_q4_vectorized(void);

#if defined(__x86_64__) || defined(_M_X64)
#include "vexp.h"

/* 8 values: silu(a) * b, sigmoid through e = exp(-|a|) <= 1: 1 / (1 + e) for a >= 0, e / (1 + e) below */
__attribute__((target("avx2,fma"))) static inline __m256 silu_mul8(__m256 a, __m256 b) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 e = exp8(_mm256_or_ps(a, _mm256_set1_ps(-0.0f)));
    __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
    __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_mul_ps(_mm256_mul_ps(a, sig), b);
}

/* a tail shorter than 8 goes through the same arithmetic, padded, so every element gets one function */
__attribute__((target("avx2,fma"))) static void silu_mul_avx2(const float *a, const float *b, int64_t F, float *y) {
    int64_t j = 0;
    for (; j + 8 <= F; j += 8) _mm256_storeu_ps(y + j, silu_mul8(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j)));
    if (j < F) {
        float ta[8] = {0}, tb[8] = {0}, ty[8];
        memcpy(ta, a + j, sizeof(float) * (size_t)(F - j));
        memcpy(tb, b + j, sizeof(float) * (size_t)(F - j));
        _mm256_storeu_ps(ty, silu_mul8(_mm256_loadu_ps(ta), _mm256_loadu_ps(tb)));
        memcpy(y + j, ty, sizeof(float) * (size_t)(F - j));
    }
}
#endif

void mobc_silu_mul(const float *x, int64_t rows, int64_t F, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * 2 * F, *b = a + F;
        float *out = y + r * F;
#if defined(__x86_64__) || defined(_M_X64)
        if (mobc_q4_vectorized()) {
            silu_mul_avx2(a, b, F, out);
            continue;
        }
#endif
        for (int64_t j = 0; j < F; j++) out[j] = a[j] / (1.0f + expf(-a[j])) * b[j];
    }
}
