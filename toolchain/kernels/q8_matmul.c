/* The Q8_0 matmul on int16 activation blocks (see q8_matmul.h): a tied lm_head's logits.
 *
 * Why not onnxruntime's 8-bit MatMulNBits: it rounds activations to int8 (a 258x looser bound on
 * each logit), keeps its scales as float32 (3.5 MB more per SmolLM2 token than float16) and copies
 * the weights into a prepacked buffer of its own. Here the codes and float16 scales are read where
 * the session keeps them, one vocabulary row after another: on one row it streams them at about the
 * rate a plain read of the same bytes reaches. An AVX-512 VNNI path (vpdpbusd on the int16 values
 * split into bytes) measured no faster on one row and slower on three (Zen 4), so there is none. */
#include "q8_matmul.h"

#include "q4_matmul.h" /* mobc_half_to_float, mobc_round_block_i16, mobc_q4_vectorized */

#define ALIGN64(n) (((n) + 63) / 64 * 64)

/* a prepared row: the int16 values p, then the block scales s_b */
typedef struct {
    const int16_t *p;
    const float *scale;
} Row;

size_t mobc_q8_row_bytes(int64_t K) { return ALIGN64((size_t)(2 * K + 4 * (K / MOBC_Q8_BLOCK))); }

static Row row_at(const void *prepared, int64_t K, int64_t r) {
    const uint8_t *base = (const uint8_t *)prepared + r * mobc_q8_row_bytes(K);
    Row row = {(const int16_t *)base, (const float *)(base + 2 * K)};
    return row;
}

void mobc_q8_prepare(const float *x, int64_t M, int64_t K, void *prepared) {
    for (int64_t r = 0; r < M; r++) {
        Row row = row_at(prepared, K, r);
        for (int64_t b = 0; b < K / MOBC_Q8_BLOCK; b++) {
            float sum; /* the offsets' share of MatMulQ4; a Q8_0 grid has none */
            mobc_round_block_i16(x + r * K + b * MOBC_Q8_BLOCK, 1, (int16_t *)row.p + b * MOBC_Q8_BLOCK,
                                 (float *)row.scale + b, &sum);
        }
    }
}

/* one row's logit for vocabulary row n, block by block in order */
static float dot_portable(const Row *row, const MobcQ8Weights *w, int64_t n) {
    int64_t K = w->K, nb = K / MOBC_Q8_BLOCK;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = w->codes + n * K + b * MOBC_Q8_BLOCK;
        const int16_t *p = row->p + b * MOBC_Q8_BLOCK;
        int32_t t = 0;
        for (int i = 0; i < MOBC_Q8_BLOCK; i++) t += ((int32_t)q[i] - 128) * p[i];
        acc += (float)t * (mobc_half_to_float(w->scales[n * nb + b]) * row->scale[b]);
    }
    return acc;
}

void mobc_q8_matmul_portable(const void *prepared, int64_t M, const MobcQ8Weights *w, float *y, int64_t n0,
                             int64_t n1) {
    for (int64_t r = 0; r < M; r++) {
        Row row = row_at(prepared, w->K, r);
        for (int64_t n = n0; n < n1; n++) y[r * w->N + n] = dot_portable(&row, w, n);
    }
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define Q8_TILE 4 /* activation rows sharing each vocabulary row's codes */
/* codes are read this far ahead: a vocabulary row is 576 bytes on SmolLM2 (2 KB: the decode step
 * 1.4-2.3% faster than 1 KB at 1 and 2 threads; 4 KB no better) */
#define Q8_PREFETCH 2048

/* AVX2: per block, the codes widened to int16 (minus 128) and pmaddwd against p: eight lanes of four
 * products each, converted (exactly) and fused-multiply-added with d * s_b */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline)) void tile_avx2(const int R, const Row *rows, const MobcQ8Weights *w,
                                                              float *y, int64_t n0, int64_t n1) {
    int64_t K = w->K, nb = K / MOBC_Q8_BLOCK;
    const __m256i bias = _mm256_set1_epi16(128);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *q = w->codes + n * K;
        _mm_prefetch((const char *)(q + Q8_PREFETCH), _MM_HINT_T0);
        __m256 acc[Q8_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m256i c0 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 * b))), bias);
            __m256i c1 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 * b + 16))), bias);
            float d = _cvtsh_ss(w->scales[n * nb + b]);
            for (int r = 0; r < R; r++) {
                const int16_t *p = rows[r].p + 32 * b;
                __m256i t = _mm256_add_epi32(_mm256_madd_epi16(c0, _mm256_loadu_si256((const __m256i *)p)),
                                             _mm256_madd_epi16(c1, _mm256_loadu_si256((const __m256i *)(p + 16))));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * rows[r].scale[b]), acc[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            y[r * w->N + n] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        }
    }
}

/* each tile height its own unrolled loop */
__attribute__((target("avx2,fma,f16c"))) static void q8_rows_avx2(int R, const Row *rows, const MobcQ8Weights *w, float *y,
                                                              int64_t n0, int64_t n1) {
    switch (R) {
    case 1: tile_avx2(1, rows, w, y, n0, n1); break;
    case 2: tile_avx2(2, rows, w, y, n0, n1); break;
    case 3: tile_avx2(3, rows, w, y, n0, n1); break;
    default: tile_avx2(4, rows, w, y, n0, n1); break;
    }
}

#endif

void mobc_q8_matmul(const void *prepared, int64_t M, const MobcQ8Weights *w, float *y, int64_t n0, int64_t n1) {
#if defined(__x86_64__) || defined(_M_X64)
    if (mobc_q4_vectorized()) {
        for (int64_t r0 = 0; r0 < M; r0 += Q8_TILE) {
            int R = (int)(M - r0 < Q8_TILE ? M - r0 : Q8_TILE);
            Row rows[Q8_TILE];
            for (int r = 0; r < R; r++) rows[r] = row_at(prepared, w->K, r0 + r);
            q8_rows_avx2(R, rows, w, y + r0 * w->N, n0, n1);
        }
        return;
    }
#endif
    mobc_q8_matmul_portable(prepared, M, w, y, n0, n1);
}
