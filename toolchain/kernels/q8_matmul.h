/* y[M, N] = x[M, K] @ W^T with W[N, K] on GGUF's Q8_0 grid (a tied lm_head's own codes):
 *   W[n, 32b + i] = d[n, b] * (q[n, b, i] - 128),  q uint8 (the signed code plus 128, as
 *   onnxruntime's 8-bit MatMulNBits stores it), d IEEE float16 (GGUF's own scale, so exact).
 * Activations as MatMulQ4I16 rounds them: each row's 32-element block x_b to s_b * p, p int16,
 * s_b = max|x_b| / 32767 (an element moves by at most max|x_b| / 65534); every product of four
 * codes and four p is an exact integer, converted to float32 exactly (|sum| < 2^24), and the
 * float32 sums are the only rounding after that. A row's result does not depend on the other rows
 * of its call or on the column range a thread takes. */
#ifndef MOBC_Q8_MATMUL_H
#define MOBC_Q8_MATMUL_H
#include <stddef.h>
#include <stdint.h>

#define MOBC_Q8_BLOCK 32
#define MOBC_Q8_MAX_K 32768

typedef struct {
    const uint8_t *codes;    /* [N, K] (= [N, K/32, 32]) */
    const uint16_t *scales;  /* [N, K/32] float16 */
    int64_t K, N;            /* K a multiple of 32 */
} MobcQ8Weights;

/* bytes of one prepared activation row of K elements */
size_t mobc_q8_row_bytes(int64_t K);

/* rounds M rows of x [M, K] into `prepared` (M * mobc_q8_row_bytes(K) bytes, 64-byte aligned). A
 * block holding a NaN or an infinity gets scale NaN, so every output it touches is NaN */
void mobc_q8_prepare(const float *x, int64_t M, int64_t K, void *prepared);

/* columns [n0, n1) of y [M, N] from M prepared rows: AVX2 when this CPU has it, else plain C */
void mobc_q8_matmul(const void *prepared, int64_t M, const MobcQ8Weights *w, float *y, int64_t n0, int64_t n1);
/* the plain-C path (per block: the integer dot, then d * s_b * dot added in block order) */
void mobc_q8_matmul_portable(const void *prepared, int64_t M, const MobcQ8Weights *w, float *y, int64_t n0,
                             int64_t n1);

#endif
