/* The int4 block-grid matmul with float32 activations (see q4_matmul.h).
 *
 * Why not onnxruntime's MatMulNBits: at accuracy_level 0 (float activations, exact) its CPU kernel
 * runs one row at ~4.4 GMAC/s on an AVX2 machine without VNNI, and level 4 rounds activations to
 * int8. Here each block's 32 codes are widened to floats once and reused for every row, the
 * per-block scale applied once per block and the per-block minimum through the block's activation
 * sum: y = sum_b d_b * (q_b . x_b) + m_b * sum(x_b), float32 throughout. */
#include "q4_matmul.h"

#include <math.h>


#define ROW_TILE 4

/* block sums of x: xs[r, b] = sum(x[r, 32b .. 32b + 31]) */
static void block_sums(const float *x, int64_t M, int64_t K, float *xs) {
    int64_t nb = K / MOBC_Q4_BLOCK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + r * K + b * MOBC_Q4_BLOCK;
            float s = 0.0f;
            for (int i = 0; i < MOBC_Q4_BLOCK; i++) s += p[i];
            xs[r * nb + b] = s;
        }
}

static void cols_portable(const float *x, int64_t M, int64_t K, const uint8_t *packed, const float *d,
                          const float *m, int64_t N, float *y, int64_t n0, int64_t n1, const float *xs) {
    int64_t nb = K / MOBC_Q4_BLOCK;
    float w[MOBC_Q4_BLOCK];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < M; r++) y[r * N + n] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = packed + (n * nb + b) * (MOBC_Q4_BLOCK / 2);
            for (int e = 0; e < MOBC_Q4_BLOCK; e++) w[e] = (float)mobc_q4_code(q, e);
            float db = d[n * nb + b], mb = m[b * N + n];
            for (int64_t r = 0; r < M; r++) {
                const float *xb = x + r * K + b * MOBC_Q4_BLOCK;
                float t = 0.0f;
                for (int i = 0; i < MOBC_Q4_BLOCK; i++) t += w[i] * xb[i];
                y[r * N + n] += db * t + mb * xs[r * nb + b];
            }
        }
    }
}

/* ---- 16-bit integer activations (MatMulQ4I16) ---- */

/* where lane i of a block's int16 activations sits in x: the first 16 lanes meet the low nibbles of
 * the block's 16 bytes, the last 16 their high nibbles (byte i is word i / 4's byte i % 4) */
static inline int i16_element(int lane) {
    int i = lane % 16;
    return 8 * (i % 4) + i / 4 + (lane >= 16 ? 4 : 0);
}

void mobc_q4_quantize_i16_portable(const float *x, int64_t M, int64_t K, int16_t *xq, float *xscale, float *xsum) {
    int64_t nb = K / MOBC_Q4_BLOCK;
    for (int64_t rb = 0; rb < M * nb; rb++) {
        const float *p = x + rb * MOBC_Q4_BLOCK;
        float big = 0.0f, sum = 0.0f;
        for (int i = 0; i < MOBC_Q4_BLOCK; i++) {
            big = fabsf(p[i]) > big ? fabsf(p[i]) : big;
            sum += p[i];
        }
        /* a NaN or infinite block keeps its poison: scale NaN makes every output it touches NaN */
        float inv = big > 0.0f && isfinite(big) ? 32767.0f / big : 0.0f;
        xscale[rb] = isfinite(big) ? big / 32767.0f : NAN;
        xsum[rb] = sum;
        for (int lane = 0; lane < MOBC_Q4_BLOCK; lane++) {
            float v = p[i16_element(lane)] * inv;
            v = v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v);  /* rounding of inv */
            xq[rb * MOBC_Q4_BLOCK + lane] = (int16_t)lrintf(v);
        }
    }
}

void mobc_q4i16_matmul_cols_portable(const int16_t *xq, const float *xscale, const float *xsum, int64_t M,
                                     int64_t K, const uint8_t *packed, const float *d, const float *m,
                                     int64_t N, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / MOBC_Q4_BLOCK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t n = n0; n < n1; n++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *q = packed + (n * nb + b) * (MOBC_Q4_BLOCK / 2);
                const int16_t *p = xq + (r * nb + b) * MOBC_Q4_BLOCK;
                int32_t t = 0;
                for (int i = 0; i < 16; i++) t += (q[i] & 0x0F) * p[i] + (q[i] >> 4) * p[16 + i];
                acc += (float)t * (d[n * nb + b] * xscale[r * nb + b]) + m[b * N + n] * xsum[r * nb + b];
            }
            y[r * N + n] = acc;
        }
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one block's 32 codes as four vectors of 8 floats (elements 0-7, 8-15, 16-23, 24-31). The block's
 * 16 bytes are four 32-bit words; lane j of vector k reads nibble 2k + (j >= 4) of word j % 4, so
 * a broadcast load, a per-lane shift, a mask and a conversion widen them, with no shuffles. */
AVX2 static inline void widen(const uint8_t *q, __m256 w[4]) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    __m256i mask = _mm256_set1_epi32(0x0F);
    for (int k = 0; k < 4; k++) {
        __m256i shift = _mm256_setr_epi32(8 * k, 8 * k, 8 * k, 8 * k, 8 * k + 4, 8 * k + 4, 8 * k + 4, 8 * k + 4);
        w[k] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, shift), mask));
    }
}

/* adds the minimum's share to columns [n0, n1) of every row: y[r, n] += sum_b m[b, n] * xs[r, b]
 * (m block-major, so each block's minimums are a contiguous run of columns) */
AVX2 static void add_offsets(int64_t rows, const float *m, const float *xs, int64_t nb, int64_t N,
                             float *y, int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * N;
        for (int64_t b = 0; b < nb; b++) {
            const float *mb = m + b * N;
            __m256 s = _mm256_set1_ps(xs[r * nb + b]);
            int64_t n = n0;
            for (; n + 8 <= n1; n += 8)
                _mm256_storeu_ps(yr + n, _mm256_fmadd_ps(_mm256_loadu_ps(mb + n), s, _mm256_loadu_ps(yr + n)));
            for (; n < n1; n++) yr[n] += mb[n] * xs[r * nb + b];
        }
    }
}

/* four horizontal sums at once: lane c of the result is the sum of v[c] */
AVX2 static inline __m128 hsum4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    __m256 a = _mm256_hadd_ps(v0, v1), b = _mm256_hadd_ps(v2, v3);
    __m256 c = _mm256_hadd_ps(a, b);  /* per 128-bit half: v0 v1 v2 v3 partial sums */
    return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

/* one row, four columns at a time: each block's activations loaded once for four columns, whose
 * independent accumulations hide each other's latency */
AVX2 static void cols_avx2_one_row(const float *x, int64_t K, const uint8_t *packed, const float *d,
                                   float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / MOBC_Q4_BLOCK, stride = nb * (MOBC_Q4_BLOCK / 2);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + b * MOBC_Q4_BLOCK;
            __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            for (int c = 0; c < 4; c++) {
                __m256 w[4];
                widen(packed + (n + c) * stride + b * (MOBC_Q4_BLOCK / 2), w);
                __m256 t0 = _mm256_fmadd_ps(w[2], x2, _mm256_mul_ps(w[0], x0));
                __m256 t1 = _mm256_fmadd_ps(w[3], x3, _mm256_mul_ps(w[1], x1));
                acc[c] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), _mm256_set1_ps(d[(n + c) * nb + b]), acc[c]);
            }
        }
        _mm_storeu_ps(y + n, hsum4(acc[0], acc[1], acc[2], acc[3]));
    }
    for (; n < n1; n++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + b * MOBC_Q4_BLOCK;
            __m256 w[4];
            widen(packed + n * stride + b * (MOBC_Q4_BLOCK / 2), w);
            __m256 t0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), _mm256_mul_ps(w[0], _mm256_loadu_ps(xb)));
            __m256 t1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(w[1], _mm256_loadu_ps(xb + 8)));
            acc = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), _mm256_set1_ps(d[n * nb + b]), acc);
        }
        y[n] = hsum(acc);
    }
}

/* one block's share for ROWS rows: 32 codes widened once, four independent products per row */
#define BLOCK_PRODUCT(ROWS, W, DB, B, ACC)                                                        \
    for (int r = 0; r < (ROWS); r++) {                                                           \
        const float *xb = x + r * K + (B) * MOBC_Q4_BLOCK;                                       \
        __m256 t0 = _mm256_mul_ps((W)[0], _mm256_loadu_ps(xb));                                  \
        __m256 t1 = _mm256_mul_ps((W)[1], _mm256_loadu_ps(xb + 8));                              \
        t0 = _mm256_fmadd_ps((W)[2], _mm256_loadu_ps(xb + 16), t0);                              \
        t1 = _mm256_fmadd_ps((W)[3], _mm256_loadu_ps(xb + 24), t1);                              \
        (ACC)[r] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), (DB), (ACC)[r]);                       \
    }

/* ROWS (a compile-time 1..ROW_TILE) rows; blocks in pairs on two accumulator sets, so consecutive
 * blocks do not wait on each other's accumulation */
AVX2 static inline __attribute__((always_inline)) void cols_avx2(
    const int ROWS, const float *x, int64_t K, const uint8_t *packed, const float *d,
    int64_t N, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / MOBC_Q4_BLOCK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *q = packed + n * nb * (MOBC_Q4_BLOCK / 2);
        const float *dn = d + n * nb;
        __m256 even[ROW_TILE], odd[ROW_TILE];
        for (int r = 0; r < ROWS; r++) even[r] = odd[r] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            __m256 w0[4], w1[4];
            widen(q + b * (MOBC_Q4_BLOCK / 2), w0);
            widen(q + (b + 1) * (MOBC_Q4_BLOCK / 2), w1);
            __m256 d0 = _mm256_set1_ps(dn[b]), d1 = _mm256_set1_ps(dn[b + 1]);
            BLOCK_PRODUCT(ROWS, w0, d0, b, even)
            BLOCK_PRODUCT(ROWS, w1, d1, b + 1, odd)
        }
        if (b < nb) {
            __m256 w0[4];
            widen(q + b * (MOBC_Q4_BLOCK / 2), w0);
            __m256 d0 = _mm256_set1_ps(dn[b]);
            BLOCK_PRODUCT(ROWS, w0, d0, b, even)
        }
        for (int r = 0; r < ROWS; r++) y[r * N + n] = hsum(_mm256_add_ps(even[r], odd[r]));
    }
}

AVX2 static void cols_avx2_rows(int64_t rows, const float *x, int64_t K, const uint8_t *packed,
                                const float *d, const float *m, int64_t N, float *y, int64_t n0,
                                int64_t n1, const float *xs) {
    switch (rows) {
    case 1: cols_avx2_one_row(x, K, packed, d, y, n0, n1); break;
    case 2: cols_avx2(2, x, K, packed, d, N, y, n0, n1); break;
    case 3: cols_avx2(3, x, K, packed, d, N, y, n0, n1); break;
    default: cols_avx2(4, x, K, packed, d, N, y, n0, n1); break;
    }
    add_offsets(rows, m, xs, K / MOBC_Q4_BLOCK, N, y, n0, n1);
}

/* one block's integer dot product q_b . p_b as 8 int32 lanes: the 16 bytes widened to 16-bit lanes,
 * their low and high nibbles split by a mask and a shift, each multiplied with its 16 activations
 * and summed in pairs (pmaddwd; at most 2 * 15 * 32767 per lane, far from overflow) */
AVX2 static inline __m256i i16_block_dot(const uint8_t *q, __m256i lo_x, __m256i hi_x) {
    __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    __m256i lo = _mm256_and_si256(c, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(c, 4);
    return _mm256_add_epi32(_mm256_madd_epi16(lo, lo_x), _mm256_madd_epi16(hi, hi_x));
}

/* one row, four columns at a time (each block's activations loaded once for four columns) */
AVX2 static void i16_cols_one_row(const int16_t *xq, const float *xscale, int64_t K, const uint8_t *packed,
                                  const float *d, float *y, int64_t n0, int64_t n1) {
    int64_t nb = K / MOBC_Q4_BLOCK, stride = nb * (MOBC_Q4_BLOCK / 2);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++) {
            __m256i lo_x = _mm256_loadu_si256((const __m256i *)(xq + b * MOBC_Q4_BLOCK));
            __m256i hi_x = _mm256_loadu_si256((const __m256i *)(xq + b * MOBC_Q4_BLOCK + 16));
            float s = xscale[b];
            for (int c = 0; c < 4; c++) {
                __m256i t = i16_block_dot(packed + (n + c) * stride + b * (MOBC_Q4_BLOCK / 2), lo_x, hi_x);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d[(n + c) * nb + b] * s), acc[c]);
            }
        }
        _mm_storeu_ps(y + n, hsum4(acc[0], acc[1], acc[2], acc[3]));
    }
    for (; n < n1; n++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m256i lo_x = _mm256_loadu_si256((const __m256i *)(xq + b * MOBC_Q4_BLOCK));
            __m256i hi_x = _mm256_loadu_si256((const __m256i *)(xq + b * MOBC_Q4_BLOCK + 16));
            __m256i t = i16_block_dot(packed + n * stride + b * (MOBC_Q4_BLOCK / 2), lo_x, hi_x);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d[n * nb + b] * xscale[b]), acc);
        }
        y[n] = hsum(acc);
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
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cached;
}
#else
static int has_avx2(void) { return 0; }
#endif

int mobc_q4_vectorized(void) { return has_avx2(); }

void mobc_q4_matmul_cols_portable(const float *x, int64_t M, int64_t K, const uint8_t *packed, const float *d,
                                  const float *m, int64_t N, float *y, int64_t n0, int64_t n1) {
    float xs[MOBC_Q4_MAX_K / MOBC_Q4_BLOCK];
    for (int64_t r = 0; r < M; r++) {
        block_sums(x + r * K, 1, K, xs);
        cols_portable(x + r * K, 1, K, packed, d, m, N, y + r * N, n0, n1, xs);
    }
}

void mobc_q4_matmul_cols(const float *x, int64_t M, int64_t K, const uint8_t *packed, const float *d,
                         const float *m, int64_t N, float *y, int64_t n0, int64_t n1) {
#if defined(__x86_64__) || defined(_M_X64)
    if (has_avx2()) {
        /* K is at most MOBC_Q4_MAX_K: the op refuses longer rows */
        float xs[ROW_TILE * (MOBC_Q4_MAX_K / MOBC_Q4_BLOCK)];
        for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
            int64_t rows = M - r0 < ROW_TILE ? M - r0 : ROW_TILE;
            /* block sums: 1/32 of the work, recomputed per column range so callers stay stateless */
            block_sums(x + r0 * K, rows, K, xs);
            cols_avx2_rows(rows, x + r0 * K, K, packed, d, m, N, y + r0 * N, n0, n1, xs);
        }
        return;
    }
#endif
    mobc_q4_matmul_cols_portable(x, M, K, packed, d, m, N, y, n0, n1);
}

void mobc_q4i16_matmul_cols(const int16_t *xq, const float *xscale, const float *xsum, int64_t M, int64_t K,
                            const uint8_t *packed, const float *d, const float *m, int64_t N, float *y,
                            int64_t n0, int64_t n1) {
#if defined(__x86_64__) || defined(_M_X64)
    if (has_avx2()) {
        int64_t nb = K / MOBC_Q4_BLOCK;
        /* row by row over the same columns: a task's codes stay in L1 after the first row */
        for (int64_t r = 0; r < M; r++)
            i16_cols_one_row(xq + r * K, xscale + r * nb, K, packed, d, y + r * N, n0, n1);
        add_offsets(M, m, xsum, nb, N, y, n0, n1);
        return;
    }
#endif
    mobc_q4i16_matmul_cols_portable(xq, xscale, xsum, M, K, packed, d, m, N, y, n0, n1);
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
