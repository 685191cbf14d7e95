/* onnxruntime custom-op glue for mobc's CPU kernels (domain "mobc.cpu").
 *
 * MatMulQ4(x float[..., K], codes uint8[N, K/32, 16], scales float[N, K/32], mins float[K/32, N])
 *   -> y float[..., N]: x @ W with W[32b + i, n] = scales[n, b] * q + mins[b, n] (q4_matmul.h).
 * Columns are shared out over onnxruntime's own intra-op thread pool. */
#include <stdio.h>
#include <string.h>

#include "ort_abi.h"
#include "q4_matmul.h"

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

/* ---- MatMulQ4 ---- */

#define COLS_PER_TASK 64  /* a task's columns: 64 x K/32 blocks, small enough to balance two threads */

typedef struct {
    const float *x, *d, *m;
    const uint8_t *codes;
    int64_t rows, K, N;
    float *y;
} Q4Call;

static void q4_task(void *data, size_t task) {
    const Q4Call *c = (const Q4Call *)data;
    int64_t n0 = (int64_t)task * COLS_PER_TASK;
    int64_t n1 = n0 + COLS_PER_TASK < c->N ? n0 + COLS_PER_TASK : c->N;
    mobc_q4_matmul_cols(c->x, c->rows, c->K, c->codes, c->d, c->m, c->N, c->y, n0, n1);
}

static OrtStatus *q4_compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    Tensor x, q, d, m;
    CHECK(input(ctx, 0, &x));
    CHECK(input(ctx, 1, &q));
    CHECK(input(ctx, 2, &d));
    CHECK(input(ctx, 3, &m));
    if (x.elem != ORT_ELEMENT_FLOAT || q.elem != ORT_ELEMENT_UINT8 || d.elem != ORT_ELEMENT_FLOAT ||
        m.elem != ORT_ELEMENT_FLOAT)
        return fail("MatMulQ4: inputs must be float x, uint8 codes, float scales, float mins%.0lld%.0lld", 0, 0);
    if (x.rank < 1 || q.rank != 3 || d.rank != 2 || m.rank != 2 || q.dims[2] != MOBC_Q4_BLOCK / 2)
        return fail("MatMulQ4: codes must be [N, K/32, 16], scales [N, K/32] (ranks %lld, %lld)",
                    (int64_t)q.rank, (int64_t)d.rank);
    int64_t K = x.dims[x.rank - 1], N = q.dims[0], nb = q.dims[1];
    if (K != nb * MOBC_Q4_BLOCK) return fail("MatMulQ4: x has K=%lld but the codes hold K=%lld", K, nb * MOBC_Q4_BLOCK);
    if (K > MOBC_Q4_MAX_K) return fail("MatMulQ4: K=%lld exceeds the kernel's %lld", K, MOBC_Q4_MAX_K);
    if (d.dims[0] != N || d.dims[1] != nb || m.dims[0] != nb || m.dims[1] != N)
        return fail("MatMulQ4: scales [N, K/32] and mins [K/32, N] disagree with the codes (N=%lld, K/32=%lld)", N, nb);
    int64_t rows = 1, dims[MAX_DIMS];
    for (size_t i = 0; i + 1 < x.rank; i++) {
        rows *= x.dims[i];
        dims[i] = x.dims[i];
    }
    dims[x.rank - 1] = N;
    OrtValue *out = NULL;
    CHECK(API(KernelContext_GetOutput, GetOutputFn)(ctx, 0, dims, x.rank, &out));
    void *y = NULL;
    CHECK(API(GetTensorMutableData, GetTensorMutableDataFn)(out, &y));
    if (rows == 0 || N == 0) return NULL;
    Q4Call call = {x.data, d.data, m.data, q.data, rows, K, N, y};
    size_t tasks = (size_t)((N + COLS_PER_TASK - 1) / COLS_PER_TASK);
    return API(KernelContext_ParallelFor, ParallelForFn)(ctx, q4_task, tasks, 0, &call);
}

static void *q4_create(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info) {
    (void)op, (void)a, (void)info;
    return (void *)&api;  /* stateless: any non-NULL handle */
}
static OrtStatus *q4_create_v2(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info, void **kernel) {
    *kernel = q4_create(op, a, info);
    return NULL;
}
static void q4_compute_v1(void *kernel, OrtKernelContext *ctx) { (void)q4_compute(kernel, ctx); }
static void q4_destroy(void *kernel) { (void)kernel; }
static const char *q4_name(const OrtCustomOp *op) { (void)op; return "MatMulQ4"; }
static const char *cpu_provider(const OrtCustomOp *op) { (void)op; return NULL; }  /* NULL: the CPU EP */
static int q4_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 ? ORT_ELEMENT_UINT8 : ORT_ELEMENT_FLOAT; }
static size_t q4_input_count(const OrtCustomOp *op) { (void)op; return 4; }
static int float_output(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ORT_ELEMENT_FLOAT; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ORT_IO_REQUIRED; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ORT_MEM_DEFAULT; }
static int arity_one(const OrtCustomOp *op) { (void)op; return 1; }

static const OrtCustomOp q4_op = {
    MOBC_CUSTOM_OP_VERSION, q4_create, q4_name, cpu_provider, q4_input_type, q4_input_count,
    float_output, one, q4_compute_v1, q4_destroy, required, required, default_memory,
    arity_one, arity_one, arity_one, arity_one, q4_create_v2, q4_compute,
    NULL, NULL, NULL, NULL, NULL, NULL, NULL,
};

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
    }
    return API(AddCustomOpDomain, AddCustomOpDomainFn)(options, domain);
}
