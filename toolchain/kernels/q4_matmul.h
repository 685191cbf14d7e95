/* y[M, N] = x[M, K] @ W[K, N], W stored as 4-bit codes on blocks of 32 along K, columns in groups
 * of four:
 *   W[32*b + i, 4*g + c] = d[g, b, c] * (q - 8) + o[g, b, c],  q in 0..15
 * (GGUF's Q4_0: o = 0; Q4_1: o is the block's minimum plus 8d). codes[g, b, c] is 16 bytes, four
 * little-endian 32-bit words; element e = 8k + j (k 0..3, j 0..7) sits in word j % 4 at nibble
 * 2k + (j >= 4), the order the AVX2 path widens without shuffles. A block of four columns is one
 * 64-byte line, so each group reads three sequential streams (codes, scales, offsets): on one row
 * this ran SmolLM2's down_proj 1.7x faster than a column-major layout with separate scale arrays,
 * whose strided reads the prefetchers did not follow. d and o are float32 or IEEE float16 (GGUF's
 * scales are float16, so its exact values take half the bytes). */
#ifndef MOBC_Q4_MATMUL_H
#define MOBC_Q4_MATMUL_H
#include <stdint.h>

#define MOBC_Q4_BLOCK 32
#define MOBC_Q4_GROUP 4      /* columns per group */
#define MOBC_Q4_MAX_K 32768  /* longest row the op takes (Llama-3.1-8B's down_proj: 14336) */

typedef struct {
    const uint8_t *codes;          /* [N/4, K/32, 4, 16] */
    const void *scales, *offsets;  /* [N/4, K/32, 4]: float, or uint16 IEEE halves when half */
    int half;
    int64_t K, N;                  /* N a multiple of 4, K of 32 */
} MobcQ4Weights;

/* code of element e (0..31) of one packed block */
static inline unsigned mobc_q4_code(const uint8_t *block, int e) {
    int k = e / 8, j = e % 8, nibble = 2 * k + (j >= 4);
    return (block[4 * (j % 4) + nibble / 2] >> (4 * (nibble % 2))) & 0x0F;
}

float mobc_half_to_float(uint16_t h);

/* xsum[r, b] = sum(x[r, 32b .. 32b + 31]): the offsets' share, computed once per call */
void mobc_q4_block_sums(const float *x, int64_t M, int64_t K, float *xsum);

/* float32 activations (MatMulQ4): the float model's arithmetic. Columns of groups [g0, g1) of y;
 * x row-major [M, K], y row-major [M, N] */
void mobc_q4_matmul(const float *x, const float *xsum, int64_t M, const MobcQ4Weights *w, float *y,
                    int64_t g0, int64_t g1);
void mobc_q4_matmul_portable(const float *x, const float *xsum, int64_t M, const MobcQ4Weights *w, float *y,
                             int64_t g0, int64_t g1);

/* The same product with activations as 16-bit integers (MatMulQ4I16): each row's 32-element block
 * x_b is rounded to s_b * p, p int16, s_b = max|x_b| / 32767 (an error of at most max|x_b| / 65534
 * per element), and q_b . p is an exact integer dot product (pmaddwd). xq holds M * K int16 in the
 * kernel's lane order (mobc_q4_quantize_i16), xscale and xsum M * K/32 floats (s_b and the exact
 * float sum(x_b) for the offsets). */
void mobc_q4_quantize_i16(const float *x, int64_t M, int64_t K, int16_t *xq, float *xscale, float *xsum);
/* one block of 32 floats rounded so (plain C): q in the kernel's lane order, or in x's own order when
 * `natural` (MatMulQ8I16, q8_matmul.h); *scale = s_b (NaN for a block holding a NaN or an infinity,
 * whose q are then 0), *sum = the block's float sum */
void mobc_round_block_i16(const float *x, int natural, int16_t *q, float *scale, float *sum);
void mobc_q4_quantize_i16_portable(const float *x, int64_t M, int64_t K, int16_t *xq, float *xscale, float *xsum);
void mobc_q4i16_matmul(const int16_t *xq, const float *xscale, const float *xsum, int64_t M,
                       const MobcQ4Weights *w, float *y, int64_t g0, int64_t g1);
void mobc_q4i16_matmul_portable(const int16_t *xq, const float *xscale, const float *xsum, int64_t M,
                                const MobcQ4Weights *w, float *y, int64_t g0, int64_t g1);

/* 1 when the vectorized (AVX2 + FMA + F16C) paths run on this CPU, 0 for the portable ones */
int mobc_q4_vectorized(void);

#endif
