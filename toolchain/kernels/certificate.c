/* The certified lm_head's check in one call (see certificate.h).
 *
 * Why: as graph nodes the check cost SmolLM2's int16 decode step a TopK over the 49152 logits
 * (~0.13 ms at one thread, onnxruntime sorts its k = 257 results out of a full pass) and ~30 small
 * nodes and an If around it. Here one pass keeps the S + 1 best in a heap (a value enters only when
 * it beats the heap's worst, a few hundred times per row), and the rest touches S + 1 entries. */
#include "certificate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float value;
    int32_t index;
} Ranked;

/* a ranks below b: a lower value, or the same value at a higher index (ONNX TopK puts the lower
 * index first among equals) */
static inline int below(Ranked a, Ranked b) { return a.value < b.value || (a.value == b.value && a.index > b.index); }

/* restore the min-heap (its lowest-ranked entry on top) from slot i down */
static void sift_down(Ranked *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && below(h[l], h[m])) m = l;
        if (r < n && below(h[r], h[m])) m = r;
        if (m == i) return;
        Ranked t = h[i];
        h[i] = h[m], h[m] = t;
        i = m;
    }
}

static void sift_up(Ranked *h, int64_t i) {
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!below(h[i], h[p])) return;
        Ranked t = h[i];
        h[i] = h[p], h[p] = t;
        i = p;
    }
}

static int best_first(const void *pa, const void *pb) {
    Ranked a = *(const Ranked *)pa, b = *(const Ranked *)pb;
    return below(b, a) ? -1 : below(a, b) ? 1 : 0;
}

/* the n best of v[0..V) in rank order into out[0..n); 0 when v holds a NaN (no order exists) */
static int rank_best(const float *v, int64_t V, int64_t n, Ranked *out) {
    int64_t size = 0;
    for (int64_t j = 0; j < V; j++) {
        float x = v[j];
        if (x != x) return 0;
        if (size < n) {
            out[size] = (Ranked){x, (int32_t)j};
            sift_up(out, size++);
        } else if (x > out[0].value) { /* an equal value has a higher index than every entry: it ranks below */
            out[0] = (Ranked){x, (int32_t)j};
            sift_down(out, n, 0);
        }
    }
    qsort(out, (size_t)n, sizeof(Ranked), best_first);
    return 1;
}

/* x . row over C floats: eight partial sums (independent chains), added pairwise at the end */
static inline float dot(const float *x, const float *row, int64_t C) {
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= C; i += 8)
        for (int k = 0; k < 8; k++) s[k] += x[i + k] * row[i + k];
    for (int k = 0; i < C; i++, k++) s[k] += x[i] * row[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

int mobc_certify_row(const MobcCertificate *c, const float *x, const float *approx, float *y, void *scratch) {
    const int64_t V = c->V, C = c->C, nb = c->nb, K = c->K, S = c->S, block = C / nb;
    Ranked *ranked = (Ranked *)scratch;
    float *exact = (float *)(ranked + S + 1);
    memcpy(y, approx, sizeof(float) * (size_t)V);
    if (!rank_best(approx, V, S + 1, ranked)) return 0;
    float best = -INFINITY;
    for (int64_t k = 0; k < K; k++) {
        exact[k] = dot(x, c->table + (int64_t)ranked[k].index * C, C);
        best = exact[k] > best ? exact[k] : best;
    }
    float amax[nb > 0 ? nb : 1];
    for (int64_t b = 0; b < nb; b++) {
        float m = 0.0f;
        for (int64_t i = 0; i < block; i++) {
            float a = fabsf(x[b * block + i]);
            m = a > m ? a : m;
        }
        amax[b] = m;
    }
    float rival = -INFINITY;
    for (int64_t k = K; k < S; k++) { /* the screened tokens, each with its own bound */
        const float *w = c->token_bound + (int64_t)ranked[k].index * nb;
        float bound = 0.0f;
        for (int64_t b = 0; b < nb; b++) bound += w[b] * amax[b];
        float upper = ranked[k].value + bound;
        rival = upper > rival ? upper : rival;
    }
    float row_bound = 0.0f; /* every token outside the S best: at most the S-th value plus the widest bound */
    for (int64_t b = 0; b < nb; b++) row_bound += c->worst_bound[b] * amax[b];
    float rest = ranked[S].value + row_bound;
    rival = (rest > rival ? rest : rival) + c->pad;
    if (!(rival < best)) return 0; /* also false when anything above was NaN */
    for (int64_t k = 0; k < K; k++) y[ranked[k].index] = exact[k];
    return 1;
}

void mobc_certificate_float_logits(const MobcCertificate *c, const float *x, float *y, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) y[n] = dot(x, c->table + n * c->C, c->C);
}
