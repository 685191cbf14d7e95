/* The small steps between a narrow step graph's big kernels, each one call instead of a chain of
 * onnxruntime nodes (a node costs ~0.5-1.5 us of dispatch whatever it computes; SmolLM2's one-row
 * decode step had ~400 such nodes around its 150 kernels).
 *
 * - mobc_qkv_prologue: a fused q/k/v projection's rows -> rotated queries, rotated keys in the
 *   cache's transposed layout, values (what Split, five Reshapes/Transposes and two
 *   RotaryEmbeddings did per layer);
 * - mobc_silu_mul: the gated MLP's silu(gate) * up (Split, Sigmoid, Mul, Mul). */
#ifndef MOBC_LAYER_OPS_H
#define MOBC_LAYER_OPS_H
#include <stdint.h>

/* the longest head dimension mobc_qkv_prologue takes */
#define MOBC_MAX_HEAD_DIM 1024

/* RoPE in the halves layout (onnxruntime's RotaryEmbedding, interleaved=0, the whole head rotated):
 * for i < D/2, y[i] = x[i] cos[i] - x[i + D/2] sin[i] and y[i + D/2] = x[i + D/2] cos[i] + x[i] sin[i].
 *
 * qkv[N, (Hq + 2G) D]: per token row Hq query heads, then G key heads, then G value heads (D each);
 * cos, sin[N, D/2]: each row's own angles. Writes
 *   q[Hq, N, D]          the rotated queries, head-major (CacheAttention's [G, Hq/G, N, D]),
 *   new_key[G, D, N]     the rotated keys, transposed as the cache keeps keys,
 *   new_value[G, N, D]   the values as they are. */
void mobc_qkv_prologue(const float *qkv, int64_t N, int64_t Hq, int64_t G, int64_t D, const float *cos,
                       const float *sin, float *q, float *new_key, float *new_value);

/* x[rows, 2F] -> y[rows, F]: y[r, j] = silu(x[r, j]) * x[r, F + j], silu(a) = a * sigmoid(a)
 * (sigmoid through a vectorized exp of -|a|, ~1 ulp) */
void mobc_silu_mul(const float *x, int64_t rows, int64_t F, float *y);

#endif
