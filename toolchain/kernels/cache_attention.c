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

#include "vexp.h"

/* x[i] = exp(x[i] - mx) for any n, eight at a time through exp8 (a tail padded), so a slot's weight is
 * the same function of its score in every call, whatever the call's slot count */
__attribute__((target("avx2,fma"))) static inline void exp_minus_max8(float *x, int64_t n, float mx) {
    const __m256 m = _mm256_set1_ps(mx);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    if (i < n) {
        float tail[8];
        for (int j = 0; j < 8; j++) tail[j] = i + j < n ? x[i + j] : -INFINITY;
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), m)));
        for (int64_t j = 0; i + j < n; j++) x[i + j] = tail[j];
    }
}

#define QB_MAX 8
#define TILE 8 /* registers of sums per pass */

/* scores of QB rows over NC (compile-time) runs of 8 slots: keys[d * stride + 8 j + lane] for head dim
 * d, each sum fused-multiply-added over the dims in order from 0, then scaled and masked;
 * sc[i * L + 8 j + lane] = sum * scale + mask[i * L + 8 j + lane] */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void score_tile(
    const int QB, const int NC, const float *restrict q, int64_t D, const float *restrict keys, int64_t stride,
    const float *restrict mask, float *restrict sc, int64_t L, float scale) {
    __m256 acc[QB_MAX][TILE];
    for (int i = 0; i < QB; i++)
        for (int j = 0; j < NC; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const float *krow = keys + d * stride;
        for (int i = 0; i < QB; i++) {
            __m256 qd = _mm256_set1_ps(q[i * D + d]);
            for (int j = 0; j < NC; j++) acc[i][j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(krow + j * CHUNK), acc[i][j]);
        }
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int i = 0; i < QB; i++)
        for (int j = 0; j < NC; j++)
            _mm256_storeu_ps(sc + i * L + j * CHUNK, _mm256_add_ps(_mm256_mul_ps(acc[i][j], vscale),
                                                                 _mm256_loadu_ps(mask + i * L + j * CHUNK)));
}

/* QB (a compile-time 1..8) query rows of one KV group at once: every key chunk and value row is
 * loaded once for all of them, and the register tile is QB rows x (8 / QB) chunks of slots (scores)
 * or of head dims (values), so even one row keeps eight independent sums in flight. A row's
 * arithmetic is the same whatever rows share its call (scores fused-multiply-added over the head
 * dims in order from 0; weights through exp8; values fused-multiply-added in slot order), so a
 * verify row's attention equals the decode step's bit for bit. A chunk is scored when any row of the
 * block admits a slot in it: a slot another row admits gets this row's MASK_MIN, weight exactly 0, and
 * a zero weight adds nothing (its value row is not read into that row's sum: it may hold anything). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void rows_block(
    const int QB, const float *restrict q, const float *restrict mask, const float *restrict past_key,
    const float *restrict new_key, const float *restrict past_value, const float *restrict new_value, int64_t D,
    int64_t P, int64_t Nn, float scale, float *restrict out, float *restrict sc, int32_t *restrict list,
    int32_t *restrict weighed) {
    const int CB = TILE / QB > 0 ? TILE / QB : 1; /* chunks (scores) or 8-dim slices (values) per pass */
    const int64_t L = P + Nn, full = P / CHUNK * CHUNK;
    /* the chunks any row admits: list[i] = first slot of a scored chunk (only those and the new slots
     * are read below, so the others' scores are never written) */
    int64_t chunks = 0;
    for (int64_t c = 0; c < P; c += CHUNK) {
        int64_t e = c + CHUNK < P ? c + CHUNK : P;
        int any = 0;
        for (int i = 0; i < QB; i++)
            for (int64_t s = c; s < e; s++) any |= mask[i * L + s] > MOBC_MASKED;
        if (any) list[chunks++] = (int32_t)c;
    }
    /* scores: CB consecutive full chunks x QB rows per pass over the head dims */
    for (int64_t k = 0; k < chunks;) {
        int64_t c = list[k];
        int run = 1;
        while (run < CB && k + run < chunks && list[k + run] == c + run * CHUNK && c + (run + 1) * CHUNK <= full) run++;
        if (c + CHUNK > full) { /* the last, partial chunk */
            for (int i = 0; i < QB; i++)
                for (int64_t s = c; s < P; s++) {
                    float a = 0.0f;
                    for (int64_t d = 0; d < D; d++) a = fmaf(q[i * D + d], past_key[d * P + s], a);
                    sc[i * L + s] = a * scale + mask[i * L + s];
                }
        } else if (run == CB) {
            score_tile(QB, CB, q, D, past_key + c, P, mask + c, sc + c, L, scale);
        } else { /* fewer consecutive chunks than a pass takes: one at a time */
            for (int r = 0; r < run; r++)
                score_tile(QB, 1, q, D, past_key + c + r * CHUNK, P, mask + c + r * CHUNK, sc + c + r * CHUNK, L, scale);
        }
        k += run;
    }
    /* the new slots' scores: eight at a time (lane j's fma chain is the scalar one's), then the rest */
    int64_t j0 = 0;
    for (; j0 + 8 <= Nn; j0 += 8)
        score_tile(QB, 1, q, D, new_key + j0, Nn, mask + P + j0, sc + P + j0, L, scale);
    for (int i = 0; i < QB; i++)
        for (int64_t j = j0; j < Nn; j++) {
            float a = 0.0f;
            for (int64_t d = 0; d < D; d++) a = fmaf(q[i * D + d], new_key[d * Nn + j], a); /* as a past slot's fma */
            sc[i * L + P + j] = a * scale + mask[i * L + P + j];
        }
    /* each row's weights over the scored chunks and the new slots: the maximum (any order gives the
     * same), exp8, the sum in slot order (the rows' sums interleaved, each in its own order), 1/sum */
    float sums[QB_MAX], mxs[QB_MAX];
    for (int i = 0; i < QB; i++) {
        const float *r = sc + i * L;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        float mx = -INFINITY;
        for (int64_t k = 0; k < chunks; k++) {
            int64_t c = list[k];
            if (c + CHUNK <= P) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(r + c));
            else
                for (int64_t s = c; s < P; s++) mx = r[s] > mx ? r[s] : mx;
        }
        for (int64_t s = P; s < L; s++) mx = r[s] > mx ? r[s] : mx;
        float lanes[8];
        _mm256_storeu_ps(lanes, m8);
        for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
        mxs[i] = mx, sums[i] = 0.0f;
    }
    for (int64_t k = 0; k < chunks; k++) {
        int64_t c = list[k], e = c + CHUNK < P ? c + CHUNK : P;
        for (int i = 0; i < QB; i++) exp_minus_max8(sc + i * L + c, e - c, mxs[i]);
        for (int64_t s = c; s < e; s++)
            for (int i = 0; i < QB; i++) sums[i] += sc[i * L + s];
    }
    for (int i = 0; i < QB; i++) exp_minus_max8(sc + i * L + P, Nn, mxs[i]);
    for (int64_t s = P; s < L; s++)
        for (int i = 0; i < QB; i++) sums[i] += sc[i * L + s];
    for (int i = 0; i < QB; i++) {
        float *r = sc + i * L;
        const float inv = 1.0f / sums[i];
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t k = 0; k < chunks; k++) {
            int64_t c = list[k];
            if (c + CHUNK <= P) _mm256_storeu_ps(r + c, _mm256_mul_ps(_mm256_loadu_ps(r + c), vinv));
            else
                for (int64_t s = c; s < P; s++) r[s] *= inv;
        }
        for (int64_t s = P; s < L; s++) r[s] *= inv;
    }
    /* the slots some row weighs: slot << 1 | 1 when every row of the block does */
    int64_t slots = 0;
    for (int64_t k = 0; k <= chunks; k++) { /* k == chunks: the new slots */
        int64_t c = k < chunks ? list[k] : P, e = k < chunks ? (c + CHUNK < P ? c + CHUNK : P) : L;
        for (int64_t s = c; s < e; s++) {
            int nonzero = 0;
            for (int i = 0; i < QB; i++) nonzero += sc[i * L + s] != 0.0f;
            if (nonzero) weighed[slots++] = (int32_t)(s << 1 | (nonzero == QB));
        }
    }
    /* values: QB rows x CB slices of 8 head dims per pass over the weighed slots */
    for (int64_t d0 = 0; d0 < D;) {
        int width = (D - d0) / 8 >= CB ? CB : 1;
        __m256 acc[QB_MAX][TILE];
        for (int i = 0; i < QB; i++)
            for (int j = 0; j < width; j++) acc[i][j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < slots; k++) {
            int64_t s = weighed[k] >> 1;
            const float *v = (s < P ? past_value + s * D : new_value + (s - P) * D) + d0;
            if (weighed[k] & 1) { /* every row weighs it (a past slot, all rows' common prefix) */
                if (width == CB) {
                    __m256 vj[TILE];
                    for (int j = 0; j < CB; j++) vj[j] = _mm256_loadu_ps(v + 8 * j);
                    for (int i = 0; i < QB; i++) {
                        __m256 p = _mm256_set1_ps(sc[i * L + s]);
                        for (int j = 0; j < CB; j++) acc[i][j] = _mm256_fmadd_ps(p, vj[j], acc[i][j]);
                    }
                } else {
                    __m256 v0 = _mm256_loadu_ps(v);
                    for (int i = 0; i < QB; i++) acc[i][0] = _mm256_fmadd_ps(_mm256_set1_ps(sc[i * L + s]), v0, acc[i][0]);
                }
                continue;
            }
            for (int i = 0; i < QB; i++) {
                float w = sc[i * L + s];
                if (w == 0.0f) continue;
                __m256 p = _mm256_set1_ps(w);
                for (int j = 0; j < width; j++) acc[i][j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), acc[i][j]);
            }
        }
        for (int i = 0; i < QB; i++)
            for (int j = 0; j < width; j++) _mm256_storeu_ps(out + i * D + d0 + 8 * j, acc[i][j]);
        d0 += 8 * width;
    }
}

__attribute__((target("avx2,fma"))) static void rows_avx2(
    int64_t Q, const float *q, const float *mask, const float *past_key, const float *new_key,
    const float *past_value, const float *new_value, int64_t D, int64_t P, int64_t Nn, float scale, float *out,
    float *scratch) {
    int64_t L = P + Nn;
    /* scratch (MOBC_ATTENTION_SCRATCH): the block's scores, then two slot lists */
    int32_t *list = (int32_t *)(scratch + (Q < QB_MAX ? Q : QB_MAX) * L), *weighed = list + L;
    for (int64_t i0 = 0; i0 < Q; i0 += QB_MAX) {
        const float *qb = q + i0 * D, *mb = mask + i0 * L;
        float *ob = out + i0 * D;
        switch (Q - i0 < QB_MAX ? Q - i0 : QB_MAX) {
#define BLOCK(n) case n: rows_block(n, qb, mb, past_key, new_key, past_value, new_value, D, P, Nn, scale, ob, scratch, list, weighed); break;
        BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7)
        default: rows_block(8, qb, mb, past_key, new_key, past_value, new_value, D, P, Nn, scale, ob, scratch, list, weighed); break;
#undef BLOCK
        }
    }
}
#endif

int mobc_q4_vectorized(void);

void mobc_cache_attention_rows(int64_t Q, const float *q, const float *mask, const float *past_key,
                               const float *new_key, const float *past_value, const float *new_value, int64_t D,
                               int64_t P, int64_t Nn, float scale, float *out, float *scratch) {
#if defined(__x86_64__) || defined(_M_X64)
    if (mobc_q4_vectorized() && D % 8 == 0) {
        rows_avx2(Q, q, mask, past_key, new_key, past_value, new_value, D, P, Nn, scale, out, scratch);
        return;
    }
#endif
    for (int64_t i = 0; i < Q; i++)
        row_portable(q + i * D, past_key, new_key, past_value, new_value, mask + i * (P + Nn), D, P, Nn, scale,
                     out + i * D, scratch);
}

void mobc_cache_attention_row(const float *q, const float *past_key, const float *new_key,
                              const float *past_value, const float *new_value, const float *mask,
                              int64_t D, int64_t P, int64_t Nn, float scale, float *out, float *scratch) {
    mobc_cache_attention_rows(1, q, mask, past_key, new_key, past_value, new_value, D, P, Nn, scale, out, scratch);
}
