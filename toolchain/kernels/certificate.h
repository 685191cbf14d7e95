/* The certified lm_head's check in one call (passes/certified_lm_head.py, `certificate: op`): what
 * the pass otherwise builds from TopK, Gathers, MatMuls, reductions and an If.
 *
 * For one row x [C] with first-pass logits approx [V] (Q8_0 codes on rounded activations):
 *   the S + 1 best approximations, ranked by value and then by lower index (ONNX TopK's order);
 *   exact_c = x . table[c] for the K best (the float table's rows);
 *   amax_b  = max |x_b| over each block of C / nb activations;
 *   rival   = max(max over ranks K..S-1 of approx_j + sum_b token_bound[j, b] amax_b,
 *                 approx at rank S + sum_b worst_bound[b] amax_b) + pad;
 *   certified iff rival < max exact_c: then y = approx with exact_c written at the K candidates.
 * A row that is not certified (or holds a NaN) is left for mobc_certificate_float_logits. */
#ifndef MOBC_CERTIFICATE_H
#define MOBC_CERTIFICATE_H
#include <stdint.h>

typedef struct {
    const float *table;        /* [V, C] the float head's rows */
    const float *token_bound;  /* [V, nb] per token and block, pre-scaled */
    const float *worst_bound;  /* [nb] the largest token_bound of each block */
    int64_t V, C, nb, K, S;
    float pad;
} MobcCertificate;

/* scratch bytes one row's check needs: (S + 1) ranked entries and K exact values, rounded up to 8 so
 * rows laid out one after another (and int64 data after them) stay aligned */
#define MOBC_CERTIFICATE_SCRATCH(S, K) ((size_t)((S) + 1) * 8 + ((size_t)(K) * 4 + 7) / 8 * 8)

/* y = approx, certified: returns 1 with the candidates' exact logits in y, 0 when the row needs its
 * float logits (y then holds approx) */
int mobc_certify_row(const MobcCertificate *c, const float *x, const float *approx, float *y, void *scratch);
/* the same in plain C (what a CPU without AVX2 runs; tests compare the two) */
int mobc_certify_row_portable(const MobcCertificate *c, const float *x, const float *approx, float *y, void *scratch);

/* y[r, n] = x[r] . table[n] for n in [n0, n1) and each of the n_rows rows r listed: the failed rows'
 * float logits, the table's rows read once for all of them (x [.., C] and y [.., V] row-major) */
void mobc_certificate_float_logits(const MobcCertificate *c, const float *x, float *y, const int64_t *rows,
                                   int64_t n_rows, int64_t n0, int64_t n1);

#endif
