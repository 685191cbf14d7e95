/* The slice of onnxruntime's C ABI (onnxruntime_c_api.h) these kernels use, declared here so the
 * library builds without onnxruntime's headers, which its Python wheel does not ship. The API is a
 * table of function pointers that only ever grows at its end, so a slot's index is stable across
 * releases; the indices below are from the header's declaration order. */
#ifndef MOBC_ORT_ABI_H
#define MOBC_ORT_ABI_H
#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtApi OrtApi;  /* opaque: reached through mobc_ort_fn below */

enum { ORT_ELEMENT_UNDEFINED = 0, ORT_ELEMENT_FLOAT = 1, ORT_ELEMENT_UINT8 = 2, ORT_ELEMENT_FLOAT16 = 10 };  /* ONNXTensorElementDataType */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };        /* OrtErrorCode */
enum { ORT_IO_REQUIRED = 0 };                           /* OrtCustomOpInputOutputCharacteristic */
enum { ORT_MEM_DEFAULT = 0 };                           /* OrtMemType */

/* API version asked for: KernelContext_ParallelFor arrived in 17 */
#define MOBC_ORT_API_VERSION 17

/* slot indices in the OrtApi table */
enum {
    ORT_SLOT_CreateStatus = 0,
    ORT_SLOT_CreateCustomOpDomain = 26,
    ORT_SLOT_CustomOpDomain_Add = 27,
    ORT_SLOT_AddCustomOpDomain = 28,
    ORT_SLOT_GetTensorMutableData = 51,
    ORT_SLOT_GetTensorElementType = 60,
    ORT_SLOT_GetDimensionsCount = 61,
    ORT_SLOT_GetDimensions = 62,
    ORT_SLOT_GetTensorTypeAndShape = 65,
    ORT_SLOT_KernelContext_GetInputCount = 88,
    ORT_SLOT_KernelContext_GetInput = 90,
    ORT_SLOT_KernelContext_GetOutput = 91,
    ORT_SLOT_ReleaseTensorTypeAndShapeInfo = 99,
    ORT_SLOT_KernelContext_ParallelFor = 274,
};

static inline void *mobc_ort_fn(const OrtApi *api, int slot) { return ((void *const *)api)[slot]; }

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* a custom op as onnxruntime reads it; `version` says how many of these fields it may read */
typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const OrtCustomOp *op);
    int (*GetInputType)(const OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const OrtCustomOp *op);
    int (*GetOutputType)(const OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const OrtCustomOp *op, size_t index);
    int (*GetOutputCharacteristic)(const OrtCustomOp *op, size_t index);
    int (*GetInputMemoryType)(const OrtCustomOp *op, size_t index);
    int (*GetVariadicInputMinArity)(const OrtCustomOp *op);
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp *op);
    OrtStatus *(*CreateKernelV2)(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
    /* later fields (shape inference, opset range, in-place and alias maps), left NULL: onnxruntime
     * reads the first three only from version 17 on, and the last four only when set */
    void *InferOutputShapeFn, *GetStartVersion, *GetEndVersion;
    void *GetMayInplace, *ReleaseMayInplace, *GetAliasMap, *ReleaseAliasMap;
};
/* custom-op version 16: everything through KernelComputeV2 (which returns errors as a status) */
#define MOBC_CUSTOM_OP_VERSION 16

#endif
