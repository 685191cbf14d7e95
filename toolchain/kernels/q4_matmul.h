/* y[M, N] = x[M, K] @ W[K, N], W stored as 4-bit codes on blocks of 32 along K:
 *   W[32*b + i, n] = d[n, b] * q + m[b, n],  q in 0..15 (d column-major, m block-major)
 * packed[n, b] is 16 bytes, four little-endian 32-bit words; element e = 8k + j (k 0..3, j 0..7)
 * sits in word j % 4 at nibble 2k + (j >= 4), the order the AVX2 path widens without shuffles.
 * Activations stay float32: the float model's arithmetic. */
#ifndef MOBC_Q4_MATMUL_H
#define MOBC_Q4_MATMUL_H
#include <stdint.h>

#define MOBC_Q4_BLOCK 32
#define MOBC_Q4_MAX_K 32768 /* longest row the op takes (Llama-3.1-8B's down_proj: 14336) */

/* code of element e (0..31) of one packed block */
static inline unsigned mobc_q4_code(const uint8_t *block, int e) {
    int k = e / 8, j = e % 8, nibble = 2 * k + (j >= 4);
    return (block[4 * (j % 4) + nibble / 2] >> (4 * (nibble % 2))) & 0x0F;
}

/* columns [n0, n1) of y; x row-major [M, K], y row-major [M, N]; K a multiple of 32 */
void mobc_q4_matmul_cols(const float *x, int64_t M, int64_t K, const uint8_t *packed, const float *d,
                         const float *m, int64_t N, float *y, int64_t n0, int64_t n1);

/* the same without vectorization (CPUs without AVX2; the tests compare the two) */
void mobc_q4_matmul_cols_portable(const float *x, int64_t M, int64_t K, const uint8_t *packed, const float *d,
                                  const float *m, int64_t N, float *y, int64_t n0, int64_t n1);

/* The same product with activations as 16-bit integers (MatMulQ4I16): each row's 32-element block
 * x_b is rounded to s_b * p, p int16, s_b = max|x_b| / 32767 (an error of at most max|x_b| / 65534
 * per element), and q_b . p is an exact integer dot product (pmaddwd), ~1.5x the float path's
 * speed on one row. xq holds M * K int16 in the kernel's lane order (mobc_q4_quantize_i16),
 * xscale and xsum M * K/32 floats (s_b and the exact float sum(x_b) for the minimum). */
void mobc_q4_quantize_i16(const float *x, int64_t M, int64_t K, int16_t *xq, float *xscale, float *xsum);
void mobc_q4_quantize_i16_portable(const float *x, int64_t M, int64_t K, int16_t *xq, float *xscale, float *xsum);
void mobc_q4i16_matmul_cols(const int16_t *xq, const float *xscale, const float *xsum, int64_t M, int64_t K,
                            const uint8_t *packed, const float *d, const float *m, int64_t N, float *y,
                            int64_t n0, int64_t n1);
void mobc_q4i16_matmul_cols_portable(const int16_t *xq, const float *xscale, const float *xsum, int64_t M,
                                     int64_t K, const uint8_t *packed, const float *d, const float *m,
                                     int64_t N, float *y, int64_t n0, int64_t n1);

/* 1 when the vectorized (AVX2 + FMA) path runs on this CPU, 0 for the portable one */
int mobc_q4_vectorized(void);

#endif
