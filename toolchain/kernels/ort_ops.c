/* onnxruntime custom-op glue for mobc's CPU kernels (domain "mobc.cpu").
 *
 * MatMulQ4(x float[..., K], codes uint8[N/4, K/32, 4, 16], scales T[N/4, K/32, 4], offsets T[N/4, K/32, 4])
 *   -> y float[..., N], T float or float16: x @ W with W[32b + i, 4g + c] = scales[g, b, c] * (q - 8)
 *   + offsets[g, b, c] (q4_matmul.h).
 * MatMulQ4I16: the same inputs and product, each row's 32-blocks of x rounded to int16 first.
 * MatMulQ8I16(x float[..., K], codes uint8[N, K/32, 32], scales float16[N, K/32]) -> y float[..., N]:
 *   x @ W^T with W[n, 32b + i] = scales[n, b] * (codes[n, b, i] - 128) (a Q8_0 lm_head), x's
 *   32-blocks rounded to int16 (q8_matmul.h).
 * CacheAttention(q float[G, H, N, D], past_key[G, 1, D, P], new_key[G, 1, D, Nn],
 *                past_value[G, 1, P, D], new_value[G, 1, Nn, D], mask[1, 1, N, P + Nn], scale[1])
 *   -> out float[G, H, N, D]: softmax(q k * scale + mask) v over the slots the mask admits
 *   (cache_attention.h).
 * QKVCacheAttention(qkv float[..., N, (Hq + 2G) D], cos[N, D/2], sin[N, D/2], past_key[G, 1, D, P],
 *                   past_value[G, 1, P, D], mask[1, 1, N, P + N], scale[1])
 *   -> out float[..., N, Hq D], new_key[G, 1, D, N], new_value[G, 1, N, D]: a fused projection's rows
 *   split into heads, queries and keys rotated (RoPE, halves layout), and CacheAttention over the
 *   past and the call's own keys (layer_ops.h).
 * SiluMul(x float[..., 2F]) -> y float[..., F]: silu(x[..., :F]) * x[..., F:] (layer_ops.h).
 * CertifyArgmax(approx float[..., V], x float[..., C], table[V, C], token_bound[V, nb], worst_bound[nb],
 *               settings[3] = (K, S, pad)) -> logits float[..., V]: the certified lm_head's check, each
 *   row certified (approx with its K candidates' exact logits) or its float logits x . table^T
 *   (certificate.h).
 * Work is shared out over onnxruntime's own intra-op thread pool. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache_attention.h"
#include "certificate.h"
#include "layer_ops.h"
#include "ort_abi.h"
#include "q4_matmul.h"
#include "q8_matmul.h"

typedef OrtStatus *(*CreateStatusFn)(int code, const char *msg);
typedef OrtStatus *(*CreateCustomOpDomainFn)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*CustomOpDomainAddFn)(OrtCustomOpDomain *domain, const OrtCustomOp *op);
typedef OrtStatus *(*AddCustomOpDomainFn)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
typedef OrtStatus *(*GetTensorMutableDataFn)(OrtValue *value, void **out);
typedef OrtStatus *(*GetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo *info, int *out);
typedef OrtStatus *(*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
typedef OrtStatus *(*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims, size_t n);
typedef OrtStatus *(*GetTensorTypeAndShapeFn)(const OrtValue *value, OrtTensorTypeAndShapeInfo **out);
typedef OrtStatus *(*GetInputCountFn)(const OrtKernelContext *context, size_t *out);
typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *context, size_t index, const OrtValue **out);
typedef OrtStatus *(*GetOutputFn)(OrtKernelContext *context, size_t index, const int64_t *dims, size_t n,
                                  OrtValue **out);
typedef void (*ReleaseShapeInfoFn)(OrtTensorTypeAndShapeInfo *info);
typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *context, void (*fn)(void *, size_t), size_t total,
                                    size_t num_batch, void *data);

#define API(slot, type) ((type)mobc_ort_fn(api, ORT_SLOT_##slot))
#define CHECK(call)                        \
    do {                                   \
        OrtStatus *status_ = (call);       \
        if (status_ != NULL) return status_; \
    } while (0)
#define MAX_DIMS 8

static const OrtApi *api;

static OrtStatus *fail(const char *fmt, int64_t a, int64_t b) {
    char msg[256];
    snprintf(msg, sizeof msg, fmt, (long long)a, (long long)b);
    return API(CreateStatus, CreateStatusFn)(ORT_INVALID_ARGUMENT, msg);
}

typedef struct {
    int elem;
    size_t rank;
    int64_t dims[MAX_DIMS];
    void *data;
} Tensor;

static OrtStatus *input(OrtKernelContext *ctx, size_t index, Tensor *t) {
    const OrtValue *value = NULL;
    OrtTensorTypeAndShapeInfo *info = NULL;
    CHECK(API(KernelContext_GetInput, GetInputFn)(ctx, index, &value));
    if (value == NULL) return fail("MatMulQ4: input %lld is missing%.0lld", (int64_t)index, 0);
    CHECK(API(GetTensorTypeAndShape, GetTensorTypeAndShapeFn)(value, &info));
    OrtStatus *st = API(GetTensorElementType, GetTensorElementTypeFn)(info, &t->elem);
    if (st == NULL) st = API(GetDimensionsCount, GetDimensionsCountFn)(info, &t->rank);
    if (st == NULL && t->rank > MAX_DIMS) st = fail("MatMulQ4: input of rank %lld (at most %lld)", (int64_t)t->rank, MAX_DIMS);
    if (st == NULL) st = API(GetDimensions, GetDimensionsFn)(info, t->dims, t->rank);
    API(ReleaseTensorTypeAndShapeInfo, ReleaseShapeInfoFn)(info);
    if (st != NULL) return st;
    return API(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue *)value, &t->data);
}

/* output `index` of the given shape */
static OrtStatus *output(OrtKernelContext *ctx, size_t index, const int64_t *dims, size_t rank, float **data) {
    OrtValue *out = NULL;
    CHECK(API(KernelContext_GetOutput, GetOutputFn)(ctx, index, dims, rank, &out));
    return API(GetTensorMutableData, GetTensorMutableDataFn)(out, (void **)data);
}

/* a matmul's output: x's shape with its last axis N; *rows = the product of x's other axes */
static OrtStatus *matmul_output(OrtKernelContext *ctx, const Tensor *x, int64_t N, int64_t *rows, float **y) {
    int64_t dims[MAX_DIMS];
    *rows = 1;
    for (size_t i = 0; i + 1 < x->rank; i++) {
        *rows *= x->dims[i];
        dims[i] = x->dims[i];
    }
    dims[x->rank - 1] = N;
    return output(ctx, 0, dims, x->rank, y);
}

/* inputs 0..n-1 of an op whose inputs are all float */
static OrtStatus *float_inputs(OrtKernelContext *ctx, Tensor *t, size_t n, const char *op) {
    for (size_t i = 0; i < n; i++) {
        CHECK(input(ctx, i, &t[i]));
        if (t[i].elem != ORT_ELEMENT_FLOAT) {
            char msg[128];
            snprintf(msg, sizeof msg, "%s: input %d is not float", op, (int)i);
            return API(CreateStatus, CreateStatusFn)(ORT_INVALID_ARGUMENT, msg);
        }
    }
    return NULL;
}

static int64_t elements(const Tensor *t) {
    int64_t n = 1;
    for (size_t i = 0; i < t->rank; i++) n *= t->dims[i];
    return n;
}

/* ---- MatMulQ4 ---- */

#define GROUPS_PER_TASK 8  /* a task's columns: 8 groups of 4 x K/32 blocks; SmolLM2's 576 columns make 18 tasks, even on two threads */

typedef struct {
    const float *x, *xsum;
    MobcQ4Weights w;
    int64_t rows;
    float *y;
    const int16_t *xq;  /* MatMulQ4I16: the rows as int16 blocks and their scales */
    const float *xscale;
} Q4Call;

static void q4_task(void *data, size_t task) {
    const Q4Call *c = (const Q4Call *)data;
    int64_t groups = c->w.N / MOBC_Q4_GROUP, g0 = (int64_t)task * GROUPS_PER_TASK;
    int64_t g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
    if (c->xq != NULL)
        mobc_q4i16_matmul(c->xq, c->xscale, c->xsum, c->rows, &c->w, c->y, g0, g1);
    else
        mobc_q4_matmul(c->x, c->xsum, c->rows, &c->w, c->y, g0, g1);
}

/* MatMulQ4 (float32 activations) and MatMulQ4I16 (activations as int16 blocks) share everything but
 * the inner product */
static OrtStatus *q4_run(OrtKernelContext *ctx, int int16_activations) {
    Tensor x, q, d, o;
    CHECK(input(ctx, 0, &x));
    CHECK(input(ctx, 1, &q));
    CHECK(input(ctx, 2, &d));
    CHECK(input(ctx, 3, &o));
    if (x.elem != ORT_ELEMENT_FLOAT || q.elem != ORT_ELEMENT_UINT8 || d.elem != o.elem ||
        (d.elem != ORT_ELEMENT_FLOAT && d.elem != ORT_ELEMENT_FLOAT16))
        return fail("MatMulQ4: inputs must be float x, uint8 codes, and scales and offsets both float or both "
                    "float16 (element types %lld, %lld)", d.elem, o.elem);
    if (x.rank < 1 || q.rank != 4 || d.rank != 3 || o.rank != 3 || q.dims[2] != MOBC_Q4_GROUP ||
        q.dims[3] != MOBC_Q4_BLOCK / 2)
        return fail("MatMulQ4: codes must be [N/4, K/32, 4, 16], scales and offsets [N/4, K/32, 4] (ranks "
                    "%lld, %lld); an artifact compiled before this layout needs recompiling", (int64_t)q.rank,
                    (int64_t)d.rank);
    int64_t K = x.dims[x.rank - 1], groups = q.dims[0], nb = q.dims[1], N = groups * MOBC_Q4_GROUP;
    if (K != nb * MOBC_Q4_BLOCK) return fail("MatMulQ4: x has K=%lld but the codes hold K=%lld", K, nb * MOBC_Q4_BLOCK);
    if (K > MOBC_Q4_MAX_K) return fail("MatMulQ4: K=%lld exceeds the kernel's %lld", K, MOBC_Q4_MAX_K);
    const Tensor *per_block[2] = {&d, &o};
    for (int i = 0; i < 2; i++)
        if (per_block[i]->dims[0] != groups || per_block[i]->dims[1] != nb || per_block[i]->dims[2] != MOBC_Q4_GROUP)
            return fail("MatMulQ4: scales and offsets must be [N/4, K/32, 4] = [%lld, %lld, 4]", groups, nb);
    int64_t rows = 0;
    float *y = NULL;
    CHECK(matmul_output(ctx, &x, N, &rows, &y));
    if (rows == 0 || N == 0) return NULL;
    /* each row's block sums (and, for MatMulQ4I16, its int16 blocks) computed once per call, before
     * the column tasks share them */
    int64_t row_blocks = rows * nb;
    size_t bytes = (size_t)row_blocks * (2 * sizeof(float) + (int16_activations ? MOBC_Q4_BLOCK * sizeof(int16_t) : 0));
    void *scratch = malloc(bytes);
    if (scratch == NULL) return fail("MatMulQ4: out of memory for %lld rows of K=%lld", rows, K);
    float *xsum = (float *)scratch, *xscale = xsum + row_blocks;
    int16_t *xq = int16_activations ? (int16_t *)(xscale + row_blocks) : NULL;
    if (int16_activations)
        mobc_q4_quantize_i16((const float *)x.data, rows, K, xq, xscale, xsum);
    else
        mobc_q4_block_sums((const float *)x.data, rows, K, xsum);
    MobcQ4Weights w = {q.data, d.data, o.data, d.elem == ORT_ELEMENT_FLOAT16, K, N};
    Q4Call call = {x.data, xsum, w, rows, y, xq, xscale};
    size_t tasks = (size_t)((groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK);
    OrtStatus *st = API(KernelContext_ParallelFor, ParallelForFn)(ctx, q4_task, tasks, 0, &call);
    free(scratch);
    return st;
}

static OrtStatus *q4_compute(void *kernel, OrtKernelContext *ctx) { (void)kernel; return q4_run(ctx, 0); }
static OrtStatus *q4i16_compute(void *kernel, OrtKernelContext *ctx) { (void)kernel; return q4_run(ctx, 1); }

/* ---- what every op here shares: stateless kernels on the CPU EP, required inputs, one float output ---- */

static void *stateless_create(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info) {
    (void)op, (void)a, (void)info;
    return (void *)&api;  /* any non-NULL handle */
}
static OrtStatus *stateless_create_v2(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info,
                                      void **kernel) {
    *kernel = stateless_create(op, a, info);
    return NULL;
}
static void stateless_destroy(void *kernel) { (void)kernel; }
static const char *cpu_provider(const OrtCustomOp *op) { (void)op; return NULL; }  /* NULL: the CPU EP */
static int float_output(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ORT_ELEMENT_FLOAT; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ORT_IO_REQUIRED; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ORT_MEM_DEFAULT; }
static int arity_one(const OrtCustomOp *op) { (void)op; return 1; }

/* an op table; onnxruntime calls COMPUTE (KernelComputeV2, errors as a status) from version 16 on,
 * the void KernelCompute only before */
#define CPU_OP_OUTPUTS(NAME_FN, INPUT_TYPE_FN, INPUT_COUNT_FN, OUTPUT_COUNT_FN, COMPUTE_V1, COMPUTE)  \
    {MOBC_CUSTOM_OP_VERSION, stateless_create, NAME_FN, cpu_provider, INPUT_TYPE_FN, INPUT_COUNT_FN, \
     float_output, OUTPUT_COUNT_FN, COMPUTE_V1, stateless_destroy, required, required, default_memory, \
     arity_one, arity_one, arity_one, arity_one, stateless_create_v2, COMPUTE,                      \
     NULL, NULL, NULL, NULL, NULL, NULL, NULL}
#define CPU_OP(NAME_FN, INPUT_TYPE_FN, INPUT_COUNT_FN, COMPUTE_V1, COMPUTE) \
    CPU_OP_OUTPUTS(NAME_FN, INPUT_TYPE_FN, INPUT_COUNT_FN, one, COMPUTE_V1, COMPUTE)

static void q4_compute_v1(void *kernel, OrtKernelContext *ctx) { (void)q4_compute(kernel, ctx); }
static const char *q4_name(const OrtCustomOp *op) { (void)op; return "MatMulQ4"; }
/* scales and offsets: float or float16 (UNDEFINED lets onnxruntime accept either; q4_run checks) */
static int q4_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ORT_ELEMENT_FLOAT : i == 1 ? ORT_ELEMENT_UINT8 : ORT_ELEMENT_UNDEFINED;
}
static size_t q4_input_count(const OrtCustomOp *op) { (void)op; return 4; }

static const OrtCustomOp q4_op = CPU_OP(q4_name, q4_input_type, q4_input_count, q4_compute_v1, q4_compute);

static void q4i16_compute_v1(void *kernel, OrtKernelContext *ctx) { (void)q4i16_compute(kernel, ctx); }
static const char *q4i16_name(const OrtCustomOp *op) { (void)op; return "MatMulQ4I16"; }
static const OrtCustomOp q4i16_op = CPU_OP(q4i16_name, q4_input_type, q4_input_count, q4i16_compute_v1, q4i16_compute);

/* ---- MatMulQ8I16 ---- */

#define ROWS_PER_TASK 1024  /* vocabulary rows per task: SmolLM2's 49152 make 48 */

typedef struct {
    const void *prepared;
    int64_t rows;
    MobcQ8Weights w;
    float *y;
} Q8Call;

static void q8_task(void *data, size_t task) {
    const Q8Call *c = (const Q8Call *)data;
    int64_t n0 = (int64_t)task * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < c->w.N ? n0 + ROWS_PER_TASK : c->w.N;
    mobc_q8_matmul(c->prepared, c->rows, &c->w, c->y, n0, n1);
}

static OrtStatus *q8i16_compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    Tensor x, q, d;
    CHECK(input(ctx, 0, &x));
    CHECK(input(ctx, 1, &q));
    CHECK(input(ctx, 2, &d));
    if (x.elem != ORT_ELEMENT_FLOAT || q.elem != ORT_ELEMENT_UINT8 || d.elem != ORT_ELEMENT_FLOAT16)
        return fail("MatMulQ8I16: inputs must be float x, uint8 codes and float16 scales (element types %lld, %lld)",
                    q.elem, d.elem);
    if (x.rank < 1 || q.rank != 3 || q.dims[2] != MOBC_Q8_BLOCK || d.rank != 2 || d.dims[0] != q.dims[0] ||
        d.dims[1] != q.dims[1])
        return fail("MatMulQ8I16: codes must be [N, K/32, 32] and scales [N, K/32] (ranks %lld, %lld)",
                    (int64_t)q.rank, (int64_t)d.rank);
    int64_t K = x.dims[x.rank - 1], N = q.dims[0];
    if (K != q.dims[1] * MOBC_Q8_BLOCK) return fail("MatMulQ8I16: x has K=%lld but the codes hold K=%lld", K, q.dims[1] * MOBC_Q8_BLOCK);
    if (K > MOBC_Q8_MAX_K) return fail("MatMulQ8I16: K=%lld exceeds the kernel's %lld", K, MOBC_Q8_MAX_K);
    int64_t rows = 0;
    float *y = NULL;
    CHECK(matmul_output(ctx, &x, N, &rows, &y));
    if (rows == 0 || N == 0) return NULL;
    size_t bytes = (size_t)rows * mobc_q8_row_bytes(K);
    void *prepared = aligned_alloc(64, bytes);  /* a multiple of 64 (mobc_q8_row_bytes) */
    if (prepared == NULL) return fail("MatMulQ8I16: out of memory for %lld rows of K=%lld", rows, K);
    mobc_q8_prepare((const float *)x.data, rows, K, prepared);  /* once per call, before the tasks share it */
    Q8Call call = {prepared, rows, {q.data, d.data, K, N}, y};
    OrtStatus *st = API(KernelContext_ParallelFor, ParallelForFn)(ctx, q8_task,
                                                                  (size_t)((N + ROWS_PER_TASK - 1) / ROWS_PER_TASK), 0, &call);
    free(prepared);
    return st;
}

static void q8i16_compute_v1(void *kernel, OrtKernelContext *ctx) { (void)q8i16_compute(kernel, ctx); }
static const char *q8i16_name(const OrtCustomOp *op) { (void)op; return "MatMulQ8I16"; }
static int q8_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ORT_ELEMENT_FLOAT : i == 1 ? ORT_ELEMENT_UINT8 : ORT_ELEMENT_FLOAT16;
}
static size_t q8_input_count(const OrtCustomOp *op) { (void)op; return 3; }
static const OrtCustomOp q8i16_op = CPU_OP(q8i16_name, q8_input_type, q8_input_count, q8i16_compute_v1, q8i16_compute);

/* ---- CacheAttention ---- */

typedef struct {
    const float *q, *pk, *nk, *pv, *nv, *mask;
    int64_t H, N, D, P, Nn;
    float scale;
    float *out;
} AttentionCall;

/* the rows of one (group, head) pair as laid out in `c` (its own q, out and group's cache) */
static void attention_rows(const AttentionCall *c) {
    int64_t need = MOBC_ATTENTION_SCRATCH(c->N, c->P + c->Nn);
    float stack[16384], *scratch = need <= 16384 ? stack : malloc(sizeof(float) * (size_t)need);  /* 64 KB: 8 rows of up to 1638 slots */
    if (scratch == NULL) return;  /* out of memory: the rows stay as written (zeros) */
    mobc_cache_attention_rows(c->N, c->q, c->mask, c->pk, c->nk, c->pv, c->nv, c->D, c->P, c->Nn, c->scale, c->out,
                              scratch);
    if (scratch != stack) free(scratch);
}

/* one task per (group, head): its N rows together, so each key chunk and value row is read once for
 * all of them (SmolLM2's shapes, 200 admitted slots, in C: 1.61x the row-at-a-time kernel on a
 * verify call's 8 rows, 2.27x on 32, 1.17x on one), and a row's result is the same in any call */
static void attention_task(void *data, size_t head) {  /* head = g * H + h, H query heads per group */
    AttentionCall a = *(const AttentionCall *)data;
    int64_t g = (int64_t)head / a.H;
    a.q += (int64_t)head * a.N * a.D;
    a.out += (int64_t)head * a.N * a.D;
    a.pk += g * a.D * a.P, a.nk += g * a.D * a.Nn, a.pv += g * a.P * a.D, a.nv += g * a.Nn * a.D;
    attention_rows(&a);
}

static OrtStatus *attention_compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    Tensor t[7];
    CHECK(float_inputs(ctx, t, 7, "CacheAttention"));
    Tensor *q = &t[0], *pk = &t[1], *nk = &t[2], *pv = &t[3], *nv = &t[4], *mask = &t[5], *scale = &t[6];
    for (size_t i = 0; i < 6; i++)
        if (t[i].rank != 4) return fail("CacheAttention: input %lld has rank %lld, expected 4", (int64_t)i, (int64_t)t[i].rank);
    int64_t G = q->dims[0], H = q->dims[1], N = q->dims[2], D = q->dims[3], P = pk->dims[3], Nn = nk->dims[3];
    if (pk->dims[0] != G || pk->dims[1] != 1 || pk->dims[2] != D || nk->dims[0] != G || nk->dims[2] != D ||
        pv->dims[0] != G || pv->dims[2] != P || pv->dims[3] != D || nv->dims[0] != G || nv->dims[2] != Nn ||
        nv->dims[3] != D)
        return fail("CacheAttention: cache shapes disagree with q (groups %lld, head dim %lld)", G, D);
    if (mask->dims[0] != 1 || mask->dims[1] != 1 || mask->dims[2] != N || mask->dims[3] != P + Nn)
        return fail("CacheAttention: mask must be [1, 1, %lld, %lld]", N, P + Nn);
    int64_t scale_n = elements(scale);
    if (scale_n != 1) return fail("CacheAttention: scale must hold one value, not %lld%.0lld", scale_n, 0);
    float *y = NULL;
    CHECK(output(ctx, 0, q->dims, 4, &y));
    if (G * H * N * D == 0) return NULL;
    memset(y, 0, sizeof(float) * (size_t)(G * H * N * D));
    AttentionCall call = {q->data, pk->data, nk->data, pv->data, nv->data, mask->data,
                          H, N, D, P, Nn, *(const float *)scale->data, y};
    return API(KernelContext_ParallelFor, ParallelForFn)(ctx, attention_task, (size_t)(G * H), 0, &call);
}

static void attention_compute_v1(void *kernel, OrtKernelContext *ctx) { (void)attention_compute(kernel, ctx); }
static const char *attention_name(const OrtCustomOp *op) { (void)op; return "CacheAttention"; }
static int float_input(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ORT_ELEMENT_FLOAT; }
static size_t attention_input_count(const OrtCustomOp *op) { (void)op; return 7; }

static const OrtCustomOp attention_op =
    CPU_OP(attention_name, float_input, attention_input_count, attention_compute_v1, attention_compute);

/* ---- QKVCacheAttention ---- */

static OrtStatus *qkv_attention_compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    Tensor t[7];
    CHECK(float_inputs(ctx, t, 7, "QKVCacheAttention"));
    Tensor *qkv = &t[0], *cs = &t[1], *sn = &t[2], *pk = &t[3], *pv = &t[4], *mask = &t[5], *scale = &t[6];
    if (qkv->rank < 2 || pk->rank != 4 || pv->rank != 4 || mask->rank != 4)
        return fail("QKVCacheAttention: qkv must be [..., N, C] and the caches and mask rank 4 (ranks %lld, %lld)",
                    (int64_t)qkv->rank, (int64_t)pk->rank);
    int64_t G = pk->dims[0], D = pk->dims[2], P = pk->dims[3], C = qkv->dims[qkv->rank - 1];
    int64_t N = elements(qkv) / (C ? C : 1), Hq = D ? C / D - 2 * G : 0;
    if (D < 2 || D % 2 || D > MOBC_MAX_HEAD_DIM || C % D || Hq < G || G < 1 || Hq % G)
        return fail("QKVCacheAttention: qkv's last axis %lld is not (Hq + 2G) x head dim %lld with Hq a multiple of "
                    "G (even head dims up to 1024)", C, D);
    if (pk->dims[1] != 1 || pv->dims[0] != G || pv->dims[1] != 1 || pv->dims[2] != P || pv->dims[3] != D)
        return fail("QKVCacheAttention: past keys [G, 1, D, P] and values [G, 1, P, D] disagree (P %lld, D %lld)", P, D);
    if (mask->dims[0] != 1 || mask->dims[1] != 1 || mask->dims[2] != N || mask->dims[3] != P + N)
        return fail("QKVCacheAttention: mask must be [1, 1, %lld, %lld]", N, P + N);
    if (elements(cs) != N * D / 2 || elements(sn) != N * D / 2)
        return fail("QKVCacheAttention: cos and sin must hold N x D/2 = %lld values (cos holds %lld)", N * D / 2, elements(cs));
    if (elements(scale) != 1) return fail("QKVCacheAttention: scale must hold one value, not %lld%.0lld", elements(scale), 0);
    int64_t out_dims[MAX_DIMS], key_dims[4] = {G, 1, D, N}, value_dims[4] = {G, 1, N, D};
    memcpy(out_dims, qkv->dims, sizeof(int64_t) * qkv->rank);
    out_dims[qkv->rank - 1] = Hq * D;
    float *out = NULL, *nk = NULL, *nv = NULL;
    CHECK(output(ctx, 0, out_dims, qkv->rank, &out));
    CHECK(output(ctx, 1, key_dims, 4, &nk));
    CHECK(output(ctx, 2, value_dims, 4, &nv));
    if (N == 0) return NULL;
    /* the rotated queries, then (more than one row) the heads' results before they are interleaved */
    size_t head_floats = (size_t)(Hq * N * D);
    float *scratch = malloc(sizeof(float) * head_floats * (N > 1 ? 2 : 1));
    if (scratch == NULL) return fail("QKVCacheAttention: out of memory for %lld rows of %lld heads", N, Hq);
    float *q = scratch, *heads = N > 1 ? scratch + head_floats : out;  /* one row: [Hq, 1, D] is out's layout */
    mobc_qkv_prologue((const float *)qkv->data, N, Hq, G, D, (const float *)cs->data, (const float *)sn->data, q, nk, nv);
    memset(heads, 0, sizeof(float) * head_floats);
    AttentionCall call = {q, pk->data, nk, pv->data, nv, mask->data, Hq / G, N, D, P, N, *(const float *)scale->data, heads};
    OrtStatus *st = API(KernelContext_ParallelFor, ParallelForFn)(ctx, attention_task, (size_t)Hq, 0, &call);
    if (st == NULL && N > 1)  /* [Hq, N, D] -> [N, Hq, D] */
        for (int64_t h = 0; h < Hq; h++)
            for (int64_t n = 0; n < N; n++)
                memcpy(out + (n * Hq + h) * D, heads + (h * N + n) * D, sizeof(float) * (size_t)D);
    free(scratch);
    return st;
}

static void qkv_attention_compute_v1(void *kernel, OrtKernelContext *ctx) { (void)qkv_attention_compute(kernel, ctx); }
static const char *qkv_attention_name(const OrtCustomOp *op) { (void)op; return "QKVCacheAttention"; }
static size_t three(const OrtCustomOp *op) { (void)op; return 3; }

static const OrtCustomOp qkv_attention_op = CPU_OP_OUTPUTS(qkv_attention_name, float_input, attention_input_count,
                                                           three, qkv_attention_compute_v1, qkv_attention_compute);

/* ---- SiluMul ---- */

typedef struct {
    const float *x;
    int64_t F;
    float *y;
} SiluCall;

static void silu_task(void *data, size_t row) {
    const SiluCall *c = (const SiluCall *)data;
    mobc_silu_mul(c->x + (int64_t)row * 2 * c->F, 1, c->F, c->y + (int64_t)row * c->F);
}

static OrtStatus *silu_compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    Tensor x;
    CHECK(input(ctx, 0, &x));
    if (x.elem != ORT_ELEMENT_FLOAT || x.rank < 1 || x.dims[x.rank - 1] % 2)
        return fail("SiluMul: x must be float with an even last axis (rank %lld, last axis %lld)", (int64_t)x.rank,
                    x.rank ? x.dims[x.rank - 1] : 0);
    int64_t F = x.dims[x.rank - 1] / 2, rows = 0;
    float *y = NULL;
    CHECK(matmul_output(ctx, &x, F, &rows, &y));
    if (rows == 0 || F == 0) return NULL;
    if (rows == 1) {  /* a decode step's one row: no task to hand out */
        mobc_silu_mul((const float *)x.data, 1, F, y);
        return NULL;
    }
    SiluCall call = {x.data, F, y};
    return API(KernelContext_ParallelFor, ParallelForFn)(ctx, silu_task, (size_t)rows, 0, &call);
}

static void silu_compute_v1(void *kernel, OrtKernelContext *ctx) { (void)silu_compute(kernel, ctx); }
static const char *silu_name(const OrtCustomOp *op) { (void)op; return "SiluMul"; }
static size_t silu_input_count(const OrtCustomOp *op) { (void)op; return 1; }
static const OrtCustomOp silu_op = CPU_OP(silu_name, float_input, silu_input_count, silu_compute_v1, silu_compute);

/* ---- CertifyArgmax ---- */

/* the failed rows' float logits: vocabulary rows per task, each read once for all of those rows (a
 * 128-row prompt window fails a few; SmolLM2: 256 rows of the float table are 576 KB, within L2) */
#define VOCAB_PER_TASK 256

typedef struct {
    MobcCertificate c;
    const float *approx, *x;
    float *y;
    unsigned char *scratch;
    int *certified;
    const int64_t *failed;  /* the rows to give float logits, for the fallback's tasks */
    int64_t n_failed;
} CertifyCall;

static void certify_task(void *data, size_t row) {
    const CertifyCall *k = (const CertifyCall *)data;
    int64_t r = (int64_t)row;
    k->certified[r] = mobc_certify_row(&k->c, k->x + r * k->c.C, k->approx + r * k->c.V, k->y + r * k->c.V,
                                       k->scratch + (size_t)r * MOBC_CERTIFICATE_SCRATCH(k->c.S, k->c.K));
}

static void float_logits_task(void *data, size_t task) {
    const CertifyCall *k = (const CertifyCall *)data;
    int64_t n0 = (int64_t)task * VOCAB_PER_TASK, n1 = n0 + VOCAB_PER_TASK < k->c.V ? n0 + VOCAB_PER_TASK : k->c.V;
    mobc_certificate_float_logits(&k->c, k->x, k->y, k->failed, k->n_failed, n0, n1);
}

static OrtStatus *certify_compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    Tensor t[6];
    CHECK(float_inputs(ctx, t, 6, "CertifyArgmax"));
    Tensor *approx = &t[0], *x = &t[1], *table = &t[2], *token = &t[3], *worst = &t[4], *settings = &t[5];
    if (approx->rank < 1 || x->rank < 1 || table->rank != 2 || token->rank != 2)
        return fail("CertifyArgmax: approx and x need a last axis, table and token_bound rank 2 (ranks %lld, %lld)",
                    (int64_t)approx->rank, (int64_t)table->rank);
    int64_t V = table->dims[0], C = table->dims[1], nb = token->dims[1];
    if (approx->dims[approx->rank - 1] != V || x->dims[x->rank - 1] != C || token->dims[0] != V)
        return fail("CertifyArgmax: approx [..., V], x [..., C] and token_bound [V, nb] must match table [V, C] = "
                    "[%lld, %lld]", V, C);
    if (nb < 1 || C % nb || elements(worst) != nb)
        return fail("CertifyArgmax: %lld blocks must divide C = %lld, one worst_bound per block", nb, C);
    int64_t rows = elements(approx) / (V ? V : 1);
    if (elements(x) != rows * C) return fail("CertifyArgmax: x holds %lld rows, approx %lld", elements(x) / (C ? C : 1), rows);
    const float *set = (const float *)settings->data;
    if (elements(settings) != 3 || set[0] != (float)(int64_t)set[0] || set[1] != (float)(int64_t)set[1] ||
        set[0] < 1 || set[1] <= set[0] || set[1] >= (float)V)
        return fail("CertifyArgmax: settings must be (K, S, pad) with 1 <= K < S < V = %lld (%lld values given)", V,
                    elements(settings));
    float *y = NULL;
    CHECK(output(ctx, 0, approx->dims, approx->rank, &y));
    if (rows == 0 || V == 0) return NULL;
    CertifyCall call = {{table->data, token->data, worst->data, V, C, nb, (int64_t)set[0], (int64_t)set[1], set[2]},
                        approx->data, x->data, y, NULL, NULL, NULL, 0};
    size_t per_row = MOBC_CERTIFICATE_SCRATCH(call.c.S, call.c.K);
    unsigned char *scratch = malloc((size_t)rows * (per_row + sizeof(int64_t) + sizeof(int)));
    if (scratch == NULL) return fail("CertifyArgmax: out of memory for %lld rows of S = %lld", rows, call.c.S);
    call.scratch = scratch;
    int64_t *failed = (int64_t *)(scratch + (size_t)rows * per_row);  /* per_row is a multiple of 8 */
    call.certified = (int *)(failed + rows);
    OrtStatus *st = NULL;
    if (rows == 1)  /* a decode step's one row: no task to hand out */
        certify_task(&call, 0);
    else
        st = API(KernelContext_ParallelFor, ParallelForFn)(ctx, certify_task, (size_t)rows, 0, &call);
    int64_t n_failed = 0;
    for (int64_t r = 0; st == NULL && r < rows; r++)
        if (!call.certified[r]) failed[n_failed++] = r;
    if (st == NULL && n_failed) {
        call.failed = failed, call.n_failed = n_failed;
        size_t chunks = (size_t)((V + VOCAB_PER_TASK - 1) / VOCAB_PER_TASK);
        st = API(KernelContext_ParallelFor, ParallelForFn)(ctx, float_logits_task, chunks, 0, &call);
    }
    free(scratch);
    return st;
}

static void certify_compute_v1(void *kernel, OrtKernelContext *ctx) { (void)certify_compute(kernel, ctx); }
static const char *certify_name(const OrtCustomOp *op) { (void)op; return "CertifyArgmax"; }
static size_t certify_input_count(const OrtCustomOp *op) { (void)op; return 6; }
static const OrtCustomOp certify_op =
    CPU_OP(certify_name, float_input, certify_input_count, certify_compute_v1, certify_compute);

/* ---- registration ---- */

/* onnxruntime calls this when a session's options register the library. The domain is made once
 * and shared by every session of the process (it must outlive them all). */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    static OrtCustomOpDomain *domain = NULL;
    if (api == NULL) {
        api = base->GetApi(MOBC_ORT_API_VERSION);
        if (api == NULL) return NULL;  /* an onnxruntime older than 1.17: nothing registered */
    }
    if (domain == NULL) {
        CHECK(API(CreateCustomOpDomain, CreateCustomOpDomainFn)("mobc.cpu", &domain));
        CHECK(API(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &q4_op));
        CHECK(API(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &q4i16_op));
        CHECK(API(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &q8i16_op));
        CHECK(API(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &attention_op));
        CHECK(API(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &qkv_attention_op));
        CHECK(API(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &silu_op));
        CHECK(API(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &certify_op));
    }
    return API(AddCustomOpDomain, AddCustomOpDomainFn)(options, domain);
}
