/* Attention over the admitted slots of a static KV cache (see cache_attention.h). */
#include "cache_attention.h"

#include <math.h>

#define CHUNK 8

/* the body is compiled twice: with AVX2 + FMA (auto-vectorized over slots and head dims) and plain */
#define ATTENTION_BODY                                                                              \
    int64_t L = P + Nn;                                                                             \
    float *sc = scratch;                                                                            \
    float mx = -INFINITY;                                                                           \
    /* scores of the past slots over runs of consecutive chunks that hold an admitted slot, row by  \
     * row of the transposed keys, so each key row is read contiguously across the run's slots */   \
    for (int64_t c = 0; c < P;) {                                                                   \
        int64_t first = c;                                                                          \
        for (; c < P; c += CHUNK) {                                                                 \
            int64_t e = c + CHUNK < P ? c + CHUNK : P;                                              \
            int any = 0;                                                                            \
            for (int64_t s = c; s < e; s++) any |= mask[s] > MOBC_MASKED;                           \
            if (!any) break;                                                                        \
        }                                                                                           \
        int64_t last = c < P ? c : P; /* the run is [first, last) */                                \
        for (int64_t s = first; s < last; s++) sc[s] = 0.0f;                                        \
        for (int64_t d = 0; d < D && last > first; d++) {                                           \
            const float qd = q[d], *k = past_key + d * P;                                           \
            for (int64_t s = first; s < last; s++) sc[s] += qd * k[s];                              \
        }                                                                                           \
        for (int64_t s = first; s < last; s++) {                                                    \
            sc[s] = sc[s] * scale + mask[s];                                                        \
            mx = sc[s] > mx ? sc[s] : mx;                                                           \
        }                                                                                           \
        if (c < P) { /* the chunk that ended the run holds no admitted slot */                      \
            int64_t e = c + CHUNK < P ? c + CHUNK : P;                                              \
            for (int64_t s = c; s < e; s++) sc[s] = -INFINITY;                                      \
            c = e;                                                                                  \
        }                                                                                           \
    }                                                                                               \
    for (int64_t j = 0; j < Nn; j++) {                                                              \
        float a = 0.0f;                                                                             \
        for (int64_t d = 0; d < D; d++) a += q[d] * new_key[d * Nn + j];                            \
        sc[P + j] = a * scale + mask[P + j];                                                        \
        mx = sc[P + j] > mx ? sc[P + j] : mx;                                                       \
    }                                                                                               \
    float sum = 0.0f;                                                                               \
    for (int64_t s = 0; s < L; s++) {                                                               \
        sc[s] = sc[s] == -INFINITY ? 0.0f : expf(sc[s] - mx);                                       \
        sum += sc[s];                                                                               \
    }                                                                                               \
    const float inv = 1.0f / sum;                                                                   \
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;                                                  \
    for (int64_t s = 0; s < L; s++) {                                                               \
        if (sc[s] == 0.0f) continue; /* a zero weight adds exactly nothing */                      \
        const float p = sc[s] * inv;                                                                \
        const float *v = s < P ? past_value + s * D : new_value + (s - P) * D;                      \
        for (int64_t d = 0; d < D; d++) out[d] += p * v[d];                                         \
    }

static void row_portable(const float *restrict q, const float *restrict past_key, const float *restrict new_key,
                         const float *restrict past_value, const float *restrict new_value,
                         const float *restrict mask, int64_t D, int64_t P, int64_t Nn, float scale,
                         float *restrict out, float *restrict scratch) {
    ATTENTION_BODY
}

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma"))) static void row_avx2(
    const float *restrict q, const float *restrict past_key, const float *restrict new_key,
    const float *restrict past_value, const float *restrict new_value, const float *restrict mask, int64_t D,
    int64_t P, int64_t Nn, float scale, float *restrict out, float *restrict scratch) {
    ATTENTION_BODY
}
#endif

int mobc_q4_vectorized(void);

void mobc_cache_attention_row(const float *q, const float *past_key, const float *new_key,
                              const float *past_value, const float *new_value, const float *mask,
                              int64_t D, int64_t P, int64_t Nn, float scale, float *out, float *scratch) {
#if defined(__x86_64__) || defined(_M_X64)
    if (mobc_q4_vectorized()) {
        row_avx2(q, past_key, new_key, past_value, new_value, mask, D, P, Nn, scale, out, scratch);
        return;
    }
#endif
    row_portable(q, past_key, new_key, past_value, new_value, mask, D, P, Nn, scale, out, scratch);
}
