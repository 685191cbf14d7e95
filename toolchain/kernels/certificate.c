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

/* a value beats the heap's lowest-ranked entry: it takes that entry's place */
static inline void offer(Ranked *h, int64_t n, float x, int64_t j) {
    if (x > h[0].value) { /* an equal value has a higher index than every entry: it ranks below */
        h[0] = (Ranked){x, (int32_t)j};
        sift_down(h, n, 0);
    }
}

int mobc_q4_vectorized(void);

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

/* v[j0..V) offered eight at a time: a vector compare against the heap's lowest value skips the
 * eight values that cannot enter (almost all of them once the heap holds good ones); 0 on a NaN */
__attribute__((target("avx2,fma"))) static int offer_avx2(const float *v, int64_t V, int64_t j0, Ranked *h, int64_t n) {
    __m256 nan = _mm256_setzero_ps();
    int64_t j = j0;
    for (; j + 8 <= V; j += 8) {
        __m256 x = _mm256_loadu_ps(v + j);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        int hits = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(h[0].value), _CMP_GT_OQ));
        while (hits) {
            int k = __builtin_ctz(hits);
            hits &= hits - 1;
            offer(h, n, v[j + k], j + k);
        }
    }
    if (_mm256_movemask_ps(nan)) return 0;
    for (; j < V; j++) {
        if (v[j] != v[j]) return 0;
        offer(h, n, v[j], j);
    }
    return 1;
}
#endif

/* the n best of v[0..V) as a min-heap (h[0] the n-th best); 0 when v holds a NaN (no order exists) */
static int rank_best(const float *v, int64_t V, int64_t n, Ranked *h, int vectorized) {
    int64_t j = 0;
    for (; j < n; j++) {
        if (v[j] != v[j]) return 0;
        h[j] = (Ranked){v[j], (int32_t)j};
        sift_up(h, j);
    }
#if defined(__x86_64__) || defined(_M_X64)
    if (vectorized) return offer_avx2(v, V, j, h, n);
#endif
    for (; j < V; j++) {
        if (v[j] != v[j]) return 0;
        offer(h, n, v[j], j);
    }
    return 1;
}

/* reorders e[0..n) so that its k best come first (in no particular order): quickselect */
static void best_first(Ranked *e, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        Ranked pivot = e[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) { /* Hoare partition: better than the pivot to the left */
            while (below(pivot, e[i])) i++;
            while (below(e[j], pivot)) j--;
            if (i <= j) {
                Ranked t = e[i];
                e[i++] = e[j], e[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

/* x . row over C floats: eight partial sums (independent chains), added pairwise at the end */
static float dot_portable(const float *x, const float *row, int64_t C) {
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= C; i += 8)
        for (int k = 0; k < 8; k++) s[k] += x[i + k] * row[i + k];
    for (int k = 0; i < C; i++, k++) s[k] += x[i] * row[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

#if defined(__x86_64__) || defined(_M_X64)
/* the same on AVX2: four 8-lane sums, the tail in plain C */
__attribute__((target("avx2,fma"))) static float dot_avx2(const float *x, const float *row, int64_t C) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= C; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(row + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(row + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(row + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(row + i + 24), a3);
    }
    for (; i + 8 <= C; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(row + i), a0);
    __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float t = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    for (; i < C; i++) t += x[i] * row[i];
    return t;
}
#endif

static inline float dot(const float *x, const float *row, int64_t C, int vectorized) {
#if defined(__x86_64__) || defined(_M_X64)
    if (vectorized) return dot_avx2(x, row, C);
#endif
    return dot_portable(x, row, C);
}

/* vectorized: the AVX2 scan and dots (only where the CPU has them), else plain C */
static int certify_row(const MobcCertificate *c, const float *x, const float *approx, float *y, void *scratch,
                       int vectorized) {
    const int64_t V = c->V, C = c->C, nb = c->nb, K = c->K, S = c->S, block = C / nb;
    Ranked *heap = (Ranked *)scratch;
    float *exact = (float *)(heap + S + 1);
    memcpy(y, approx, sizeof(float) * (size_t)V);
    if (!rank_best(approx, V, S + 1, heap, vectorized)) return 0;
    /* the heap's top is rank S; of the S entries above it the K best first: ranks 0..K-1 as a set
     * (only their best exact value counts), K..S-1 the screened ones */
    const Ranked last = heap[0], *ranked = heap + 1;
    best_first(heap + 1, S, K);
    float best = -INFINITY;
    for (int64_t k = 0; k < K; k++) {
        exact[k] = dot(x, c->table + (int64_t)ranked[k].index * C, C, vectorized);
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
    float rest = last.value + row_bound;
    rival = (rest > rival ? rest : rival) + c->pad;
    if (!(rival < best)) return 0; /* also false when anything above was NaN */
    for (int64_t k = 0; k < K; k++) y[ranked[k].index] = exact[k];
    return 1;
}

int mobc_certify_row(const MobcCertificate *c, const float *x, const float *approx, float *y, void *scratch) {
    return certify_row(c, x, approx, y, scratch, mobc_q4_vectorized());
}

int mobc_certify_row_portable(const MobcCertificate *c, const float *x, const float *approx, float *y, void *scratch) {
    return certify_row(c, x, approx, y, scratch, 0);
}

void mobc_certificate_float_logits(const MobcCertificate *c, const float *x, float *y, const int64_t *rows,
                                   int64_t n_rows, int64_t n0, int64_t n1) {
    int vectorized = mobc_q4_vectorized();
    for (int64_t n = n0; n < n1; n++) {
        const float *t = c->table + n * c->C;  /* read once from memory for every row that needs it */
        for (int64_t k = 0; k < n_rows; k++) y[rows[k] * c->V + n] = dot(x + rows[k] * c->C, t, c->C, vectorized);
    }
}
