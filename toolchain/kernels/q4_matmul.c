/* The int4 block-grid matmul (see q4_matmul.h): float32 activations (MatMulQ4) or activations
 * rounded to int16 per block (MatMulQ4I16).
 *
 * Why not onnxruntime's MatMulNBits: at accuracy_level 0 (float activations, exact) its CPU kernel
 * runs one row at ~4.4 GMAC/s on an AVX2 machine without VNNI, and level 4 rounds activations to
 * int8. Here y = sum_b d_b * (q_b . x_b) + (o_b - 8 d_b) * sum(x_b) per column, each block's 32
 * codes widened once and the offsets applied through the block's activation sum. */
#include "q4_matmul.h"

#include <math.h>
#include <string.h>

#define ROW_TILE 4
#define BLOCK_BYTES (MOBC_Q4_BLOCK / 2)
#define GROUP_BYTES (MOBC_Q4_GROUP * BLOCK_BYTES) /* one block of a group's four columns: 64 bytes */

float mobc_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13); /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24, exact */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* scale and offset of column c of group g at block b, as floats */
static inline float scale_at(const MobcQ4Weights *w, int64_t i) {
    return w->half ? mobc_half_to_float(((const uint16_t *)w->scales)[i]) : ((const float *)w->scales)[i];
}
static inline float offset_at(const MobcQ4Weights *w, int64_t i) {
    return w->half ? mobc_half_to_float(((const uint16_t *)w->offsets)[i]) : ((const float *)w->offsets)[i];
}

void mobc_q4_block_sums(const float *x, int64_t M, int64_t K, float *xsum) {
    for (int64_t rb = 0; rb < M * (K / MOBC_Q4_BLOCK); rb++) {
        const float *p = x + rb * MOBC_Q4_BLOCK;
        float s = 0.0f;
        for (int i = 0; i < MOBC_Q4_BLOCK; i++) s += p[i];
        xsum[rb] = s;
    }
}

/* ---- 16-bit integer activations (MatMulQ4I16) ---- */

/* where lane i of a block's int16 activations sits in x: the first 16 lanes meet the low nibbles of
 * the block's 16 bytes, the last 16 their high nibbles (byte i is word i / 4's byte i % 4) */
static inline int i16_element(int lane) {
    int i = lane % 16;
    return 8 * (i % 4) + i / 4 + (lane >= 16 ? 4 : 0);
}

void mobc_round_block_i16(const float *x, int natural, int16_t *q, float *scale, float *sum) {
    float big = 0.0f, total = 0.0f;
    for (int i = 0; i < MOBC_Q4_BLOCK; i++) {
        big = fabsf(x[i]) > big ? fabsf(x[i]) : big;
        total += x[i];
    }
    /* a NaN or infinite block keeps its poison: scale NaN makes every output it touches NaN (a NaN
     * escapes the max, not the sum) */
    int finite = isfinite(total) && isfinite(big);
    float inv = finite && big > 0.0f ? 32767.0f / big : 0.0f;
    *scale = finite ? big / 32767.0f : NAN;
    *sum = total;
    for (int lane = 0; lane < MOBC_Q4_BLOCK; lane++) {
        float v = finite ? x[natural ? lane : i16_element(lane)] * inv : 0.0f;
        v = v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v);  /* rounding of inv */
        q[lane] = (int16_t)lrintf(v);
    }
}

void mobc_q4_quantize_i16_portable(const float *x, int64_t M, int64_t K, int16_t *xq, float *xscale, float *xsum) {
    for (int64_t rb = 0; rb < M * (K / MOBC_Q4_BLOCK); rb++)
        mobc_round_block_i16(x + rb * MOBC_Q4_BLOCK, 0, xq + rb * MOBC_Q4_BLOCK, xscale + rb, xsum + rb);
}

/* both products in plain C: float activations x, or (xq != NULL) int16 blocks xq with scales xscale */
static void matmul_portable(const float *x, const int16_t *xq, const float *xscale, const float *xsum, int64_t M,
                            const MobcQ4Weights *w, float *y, int64_t g0, int64_t g1) {
    int64_t K = w->K, N = w->N, nb = K / MOBC_Q4_BLOCK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = g0; g < g1; g++)
            for (int c = 0; c < MOBC_Q4_GROUP; c++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    int64_t i = (g * nb + b) * MOBC_Q4_GROUP + c;
                    const uint8_t *q = w->codes + i * BLOCK_BYTES;
                    float d = scale_at(w, i), s = xsum[r * nb + b];
                    if (xq != NULL) {
                        const int16_t *p = xq + (r * nb + b) * MOBC_Q4_BLOCK;
                        int32_t t = 0;
                        for (int k = 0; k < 16; k++) t += (q[k] & 0x0F) * p[k] + (q[k] >> 4) * p[16 + k];
                        acc += (float)t * (d * xscale[r * nb + b]);
                    } else {
                        const float *xb = x + r * K + b * MOBC_Q4_BLOCK;
                        float t = 0.0f;
                        for (int e = 0; e < MOBC_Q4_BLOCK; e++) t += (float)mobc_q4_code(q, e) * xb[e];
                        acc += d * t;
                    }
                    acc += offset_at(w, i) * s - 8.0f * d * s;
                }
                y[r * N + g * MOBC_Q4_GROUP + c] = acc;
            }
}

void mobc_q4_matmul_portable(const float *x, const float *xsum, int64_t M, const MobcQ4Weights *w, float *y,
                             int64_t g0, int64_t g1) {
    matmul_portable(x, NULL, NULL, xsum, M, w, y, g0, g1);
}

void mobc_q4i16_matmul_portable(const int16_t *xq, const float *xscale, const float *xsum, int64_t M,
                                const MobcQ4Weights *w, float *y, int64_t g0, int64_t g1) {
    matmul_portable(NULL, xq, xscale, xsum, M, w, y, g0, g1);
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* four horizontal sums at once: lane c of the result is the sum of v[c] */
AVX2 static inline __m128 hsum4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    __m256 a = _mm256_hadd_ps(v0, v1), b = _mm256_hadd_ps(v2, v3);
    __m256 c = _mm256_hadd_ps(a, b); /* per 128-bit half: v0 v1 v2 v3 partial sums */
    return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

/* the four columns' scales or offsets of one group block (index i of its first column) */
AVX2 static inline __m128 four(const void *base, int half, int64_t i) {
    if (half) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)base + i)));
    return _mm_loadu_ps((const float *)base + i);
}

/* lane c of v in all eight lanes */
AVX2 static inline __m256 lane(__m256 v2, int c) {
    switch (c) {
    case 0: return _mm256_permute_ps(v2, 0x00);
    case 1: return _mm256_permute_ps(v2, 0x55);
    case 2: return _mm256_permute_ps(v2, 0xAA);
    default: return _mm256_permute_ps(v2, 0xFF);
    }
}

/* the offsets' share of a group's four columns for one row: sum_b (o_b - 8 d_b) * sum(x_b) */
AVX2 static inline __m128 offset_share(const MobcQ4Weights *w, const float *xsum_row, int64_t g, int64_t nb) {
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        int64_t i = (g * nb + b) * MOBC_Q4_GROUP;
        __m128 s = _mm_set1_ps(xsum_row[b]);
        acc = _mm_fmadd_ps(four(w->offsets, w->half, i), s, acc);
        acc = _mm_fmadd_ps(four(w->scales, w->half, i), _mm_mul_ps(s, _mm_set1_ps(-8.0f)), acc);
    }
    return acc;
}

/* one block's 32 codes as four vectors of 8 floats (elements 0-7, 8-15, 16-23, 24-31): lane j of
 * vector k reads nibble 2k + (j >= 4) of word j % 4, so a broadcast load, a per-lane shift, a mask
 * and a conversion widen them, with no shuffles */
AVX2 static inline void widen(const uint8_t *q, __m256 w[4]) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    __m256i mask = _mm256_set1_epi32(0x0F);
    for (int k = 0; k < 4; k++) {
        __m256i shift = _mm256_setr_epi32(8 * k, 8 * k, 8 * k, 8 * k, 8 * k + 4, 8 * k + 4, 8 * k + 4, 8 * k + 4);
        w[k] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shift), mask));
    }
}

/* one row: each block's activations loaded once for a group's four columns, whose independent
 * accumulations hide each other's latency */
AVX2 static void float_one_row(const float *x, const float *xsum, const MobcQ4Weights *w, float *y,
                               int64_t g0, int64_t g1) {
    int64_t nb = w->K / MOBC_Q4_BLOCK;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *q = w->codes + g * nb * GROUP_BYTES;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++, q += GROUP_BYTES) {
            const float *xb = x + b * MOBC_Q4_BLOCK;
            __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            __m128 d = four(w->scales, w->half, (g * nb + b) * MOBC_Q4_GROUP);
            __m256 d2 = _mm256_set_m128(d, d);
            for (int c = 0; c < MOBC_Q4_GROUP; c++) {
                __m256 v[4];
                widen(q + c * BLOCK_BYTES, v);
                __m256 t0 = _mm256_fmadd_ps(v[2], x2, _mm256_mul_ps(v[0], x0));
                __m256 t1 = _mm256_fmadd_ps(v[3], x3, _mm256_mul_ps(v[1], x1));
                acc[c] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), lane(d2, c), acc[c]);
            }
        }
        __m128 out = _mm_add_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), offset_share(w, xsum, g, nb));
        _mm_storeu_ps(y + g * MOBC_Q4_GROUP, out);
    }
}

/* ROWS (a compile-time 2..ROW_TILE) rows: each block's codes widened once for every row; a group's
 * columns one after another (the group's lines stay in L1 for the next column) */
AVX2 static inline __attribute__((always_inline)) void float_rows(
    const int ROWS, const float *x, const float *xsum, const MobcQ4Weights *w, float *y, int64_t g0, int64_t g1) {
    int64_t K = w->K, N = w->N, nb = K / MOBC_Q4_BLOCK;
    for (int64_t g = g0; g < g1; g++) {
        float sums[ROW_TILE][MOBC_Q4_GROUP];
        for (int c = 0; c < MOBC_Q4_GROUP; c++) {
            const uint8_t *q = w->codes + g * nb * GROUP_BYTES + c * BLOCK_BYTES;
            __m256 acc[ROW_TILE];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++, q += GROUP_BYTES) {
                __m256 v[4];
                widen(q, v);
                int64_t i = (g * nb + b) * MOBC_Q4_GROUP + c;
                __m256 d = _mm256_set1_ps(w->half ? _cvtsh_ss(((const uint16_t *)w->scales)[i]) : ((const float *)w->scales)[i]);
                for (int r = 0; r < ROWS; r++) {
                    const float *xb = x + r * K + b * MOBC_Q4_BLOCK;
                    __m256 t0 = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
                    __m256 t1 = _mm256_mul_ps(v[1], _mm256_loadu_ps(xb + 8));
                    t0 = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t0);
                    t1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t1);
                    acc[r] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, acc[r]);
                }
            }
            for (int r = 0; r < ROWS; r++) sums[r][c] = hsum(acc[r]);
        }
        for (int r = 0; r < ROWS; r++) {
            __m128 out = _mm_add_ps(_mm_loadu_ps(sums[r]), offset_share(w, xsum + r * nb, g, nb));
            _mm_storeu_ps(y + r * N + g * MOBC_Q4_GROUP, out);
        }
    }
}

AVX2 static void float_tile(int64_t rows, const float *x, const float *xsum, const MobcQ4Weights *w, float *y,
                            int64_t g0, int64_t g1) {
    switch (rows) {
    case 1: float_one_row(x, xsum, w, y, g0, g1); break;
    case 2: float_rows(2, x, xsum, w, y, g0, g1); break;
    case 3: float_rows(3, x, xsum, w, y, g0, g1); break;
    default: float_rows(4, x, xsum, w, y, g0, g1); break;
    }
}

/* codes are read this far ahead of use: the hardware prefetcher alone left one row's loop ~10% short,
 * and 1 KB (~70 ns of the stream here, about one DRAM latency) left the decode step 2.5-3% slower than
 * 2 KB (SmolLM2's int16 decode graph, in-process A/B, 1 and 2 threads; 4 KB no better). A prefetch
 * never faults past the end */
#define PREFETCH_BYTES 2048

/* TILE rows share each block's codes: per group block, the four columns' 32 codes are widened once
 * into eight registers (low and high nibbles as int16) and every row of the tile takes its dot
 * products against them; on more rows than one the pmaddwd work, not memory, bounds the loop, and
 * widening per row cost it ~25% (SmolLM2's shapes, 8 rows). Each block adds d s_b (q . p_b) and the
 * offsets' share (o - 8 d) sum(x_b); the four columns' int32 dots stay in integers up to one 8-lane
 * conversion ([c0..c3 | c0..c3], halves added at the end: on one row 1.8x a per-column conversion and
 * fma, whose shuffles and conversions shared one port), and every row runs the same steps whatever
 * the tile, so a row's result does not depend on how many rows share its call (a verify row equals
 * the decode step's bit for bit) */
#define I16_TILE 8

AVX2 static inline __attribute__((always_inline)) void i16_tile(
    const int ROWS, const int16_t *xq, const float *xscale, const float *xsum, const MobcQ4Weights *w, float *y,
    int64_t g0, int64_t g1) {
    int64_t K = w->K, N = w->N, nb = K / MOBC_Q4_BLOCK;
    const __m128 minus8 = _mm_set1_ps(-8.0f);
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *q = w->codes + g * nb * GROUP_BYTES;
        __m256 acc[I16_TILE];
        __m128 share[I16_TILE];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps(), share[r] = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; b++, q += GROUP_BYTES) {
            _mm_prefetch((const char *)(q + PREFETCH_BYTES), _MM_HINT_T0);
            __m256i lo[MOBC_Q4_GROUP], hi[MOBC_Q4_GROUP];
            for (int c = 0; c < MOBC_Q4_GROUP; c++) {
                __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + c * BLOCK_BYTES)));
                lo[c] = _mm256_and_si256(v, nibble), hi[c] = _mm256_srli_epi16(v, 4);
            }
            int64_t i = (g * nb + b) * MOBC_Q4_GROUP;
            __m128 d = four(w->scales, w->half, i), o8 = _mm_fmadd_ps(d, minus8, four(w->offsets, w->half, i));
            __m256 d2 = _mm256_set_m128(d, d);
            for (int r = 0; r < ROWS; r++) {
                const int16_t *xb = xq + r * K + b * MOBC_Q4_BLOCK;
                __m256i lo_x = _mm256_loadu_si256((const __m256i *)xb);
                __m256i hi_x = _mm256_loadu_si256((const __m256i *)(xb + 16));
                __m256i t[MOBC_Q4_GROUP];
                for (int c = 0; c < MOBC_Q4_GROUP; c++)  /* at most 2 * 15 * 32767 per lane: no overflow */
                    t[c] = _mm256_add_epi32(_mm256_madd_epi16(lo[c], lo_x), _mm256_madd_epi16(hi[c], hi_x));
                __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(d2, _mm256_set1_ps(xscale[r * nb + b])), acc[r]);
                share[r] = _mm_fmadd_ps(o8, _mm_set1_ps(xsum[r * nb + b]), share[r]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            __m128 dots = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
            _mm_storeu_ps(y + r * N + g * MOBC_Q4_GROUP, _mm_add_ps(dots, share[r]));
        }
    }
}

/* M rows in tiles of up to I16_TILE (each tile size its own unrolled loop) */
AVX2 static void i16_rows(const int16_t *xq, const float *xscale, const float *xsum, int64_t M,
                          const MobcQ4Weights *w, float *y, int64_t g0, int64_t g1) {
    int64_t K = w->K, N = w->N, nb = K / MOBC_Q4_BLOCK;
    for (int64_t r0 = 0; r0 < M; r0 += I16_TILE) {
        const int16_t *x = xq + r0 * K;
        const float *s = xscale + r0 * nb, *xs = xsum + r0 * nb;
        float *yr = y + r0 * N;
        switch (M - r0 < I16_TILE ? M - r0 : I16_TILE) {
        case 1: i16_tile(1, x, s, xs, w, yr, g0, g1); break;
        case 2: i16_tile(2, x, s, xs, w, yr, g0, g1); break;
        case 3: i16_tile(3, x, s, xs, w, yr, g0, g1); break;
        case 4: i16_tile(4, x, s, xs, w, yr, g0, g1); break;
        case 5: i16_tile(5, x, s, xs, w, yr, g0, g1); break;
        case 6: i16_tile(6, x, s, xs, w, yr, g0, g1); break;
        case 7: i16_tile(7, x, s, xs, w, yr, g0, g1); break;
        default: i16_tile(8, x, s, xs, w, yr, g0, g1); break;
        }
    }
}

/* one block of 32 floats rounded to int16 in the kernel's lane order (as mobc_q4_quantize_i16_portable
 * does, with the same round-to-nearest-even): the block's four 8-float rows, rounded, transposed
 * 4 x 4 at a time with unpacks and narrowed with saturating packs. Returns 0 when the block holds a
 * NaN or an infinity, which the portable path keeps as NaN */
AVX2 static int quantize_i16_block(const float *p, int16_t *q, float *scale, float *sum) {
    __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8), v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
    __m256 s = _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
    __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float big = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    float total = hsum(s);
    if (!isfinite(total) || !isfinite(big)) return 0;
    *scale = big / 32767.0f, *sum = total;
    __m256 inv = _mm256_set1_ps(big > 0.0f ? 32767.0f / big : 0.0f);
    __m256 lim = _mm256_set1_ps(32767.0f);
    __m256i r[4];
    __m256 v[4] = {v0, v1, v2, v3};
    for (int k = 0; k < 4; k++)
        r[k] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(v[k], inv), lim), _mm256_sub_ps(_mm256_setzero_ps(), lim)));
    __m256i a01 = _mm256_unpacklo_epi32(r[0], r[1]), a23 = _mm256_unpacklo_epi32(r[2], r[3]);
    __m256i b01 = _mm256_unpackhi_epi32(r[0], r[1]), b23 = _mm256_unpackhi_epi32(r[2], r[3]);
    __m256i j04 = _mm256_unpacklo_epi64(a01, a23), j15 = _mm256_unpackhi_epi64(a01, a23);  /* [j0 | j4] ... */
    __m256i j26 = _mm256_unpacklo_epi64(b01, b23), j37 = _mm256_unpackhi_epi64(b01, b23);
    __m256i p1 = _mm256_packs_epi32(j04, j15), p2 = _mm256_packs_epi32(j26, j37);  /* [j0 j1 | j4 j5], [j2 j3 | j6 j7] */
    _mm256_storeu_si256((__m256i *)q, _mm256_permute2x128_si256(p1, p2, 0x20));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute2x128_si256(p1, p2, 0x31));
    return 1;
}

static int has_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cached;
}
#else
static int has_avx2(void) { return 0; }
#endif

int mobc_q4_vectorized(void) { return has_avx2(); }

void mobc_q4_matmul(const float *x, const float *xsum, int64_t M, const MobcQ4Weights *w, float *y,
                    int64_t g0, int64_t g1) {
#if defined(__x86_64__) || defined(_M_X64)
    if (has_avx2()) {
        int64_t K = w->K, N = w->N, nb = K / MOBC_Q4_BLOCK;
        for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
            int64_t rows = M - r0 < ROW_TILE ? M - r0 : ROW_TILE;
            float_tile(rows, x + r0 * K, xsum + r0 * nb, w, y + r0 * N, g0, g1);
        }
        return;
    }
#endif
    mobc_q4_matmul_portable(x, xsum, M, w, y, g0, g1);
}

void mobc_q4i16_matmul(const int16_t *xq, const float *xscale, const float *xsum, int64_t M,
                       const MobcQ4Weights *w, float *y, int64_t g0, int64_t g1) {
#if defined(__x86_64__) || defined(_M_X64)
    if (has_avx2()) {
        i16_rows(xq, xscale, xsum, M, w, y, g0, g1);
        return;
    }
#endif
    mobc_q4i16_matmul_portable(xq, xscale, xsum, M, w, y, g0, g1);
}

void mobc_q4_quantize_i16(const float *x, int64_t M, int64_t K, int16_t *xq, float *xscale, float *xsum) {
    int64_t blocks = M * (K / MOBC_Q4_BLOCK);
#if defined(__x86_64__) || defined(_M_X64)
    if (has_avx2()) {
        for (int64_t rb = 0; rb < blocks; rb++) {
            const float *p = x + rb * MOBC_Q4_BLOCK;
            if (!quantize_i16_block(p, xq + rb * MOBC_Q4_BLOCK, xscale + rb, xsum + rb))
                mobc_q4_quantize_i16_portable(p, 1, MOBC_Q4_BLOCK, xq + rb * MOBC_Q4_BLOCK, xscale + rb, xsum + rb);
        }
        return;
    }
#endif
    mobc_q4_quantize_i16_portable(x, 1, blocks * MOBC_Q4_BLOCK, xq, xscale, xsum);
}
