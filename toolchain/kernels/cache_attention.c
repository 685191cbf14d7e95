/* Attention over the admitted slots of a static KV cache (see cache_attention.h). */
#include "cache_attention.h"

#include <math.h>

#define CHUNK 8

/* [c, e): each past chunk of 8 slots that was scored (holds an admitted slot), then the new slots */
#define FOR_SCORED_CHUNKS(c, e, BODY)                                \
    for (int64_t c = 0, e; c < L; c = e) {                           \
        e = c < P ? (c + CHUNK < P ? c + CHUNK : P) : L;             \
        if (c < P && sc[c] == -INFINITY) continue;                   \
        BODY                                                         \
    }

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
    /* softmax weights: chunks no admitted slot is in stay -INFINITY (weight 0, never read) */      \
    float sum = 0.0f;                                                                               \
    FOR_SCORED_CHUNKS(c, e, {                                                                       \
        EXP_MINUS_MAX(sc + c, e - c, mx);                                                           \
        for (int64_t s = c; s < e; s++) sum += sc[s];                                               \
    })                                                                                              \
    const float inv = 1.0f / sum;                                                                   \
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;                                                  \
    FOR_SCORED_CHUNKS(c, e, {                                                                       \
        for (int64_t s = c; s < e; s++) {                                                           \
            if (sc[s] == 0.0f) continue; /* a zero weight adds exactly nothing */                  \
            const float p = sc[s] * inv;                                                            \
            const float *v = s < P ? past_value + s * D : new_value + (s - P) * D;                  \
            for (int64_t d = 0; d < D; d++) out[d] += p * v[d];                                     \
        }                                                                                           \
    })

/* x[i] = exp(x[i] - mx) for n values (a slot scored -INFINITY gets 0) */
static inline void exp_minus_max_portable(float *x, int64_t n, float mx) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] == -INFINITY ? 0.0f : expf(x[i] - mx);
}

#define EXP_MINUS_MAX exp_minus_max_portable
static void row_portable(const float *restrict q, const float *restrict past_key, const float *restrict new_key,
                         const float *restrict past_value, const float *restrict new_value,
                         const float *restrict mask, int64_t D, int64_t P, int64_t Nn, float scale,
                         float *restrict out, float *restrict scratch) {
    ATTENTION_BODY
}

#undef EXP_MINUS_MAX

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

/* exp of 8 floats, x <= 0 (scores minus their maximum): Cody-Waite reduction x = n ln2 + r and a
 * degree-6 polynomial for e^r (the Cephes single-precision coefficients, ~1 ulp), scaled by 2^n.
 * Below -87.3 the result is 0, as expf's underflow is to the weights that matter here (MASK_MIN
 * slots must weigh exactly 0; a -INFINITY score too). */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ); /* also true for -INFINITY */
    x = _mm256_max_ps(lo, x); /* a NaN score stays NaN (max returns its second operand then) */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

__attribute__((target("avx2,fma"))) static inline void exp_minus_max_avx2(float *x, int64_t n, float mx) {
    if (n != 8) {
        exp_minus_max_portable(x, n, mx);
        return;
    }
    _mm256_storeu_ps(x, exp8(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_set1_ps(mx))));
}

#define EXP_MINUS_MAX exp_minus_max_avx2
__attribute__((target("avx2,fma"))) static void row_avx2(
    const float *restrict q, const float *restrict past_key, const float *restrict new_key,
    const float *restrict past_value, const float *restrict new_value, const float *restrict mask, int64_t D,
    int64_t P, int64_t Nn, float scale, float *restrict out, float *restrict scratch) {
    ATTENTION_BODY
}
#undef EXP_MINUS_MAX
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
