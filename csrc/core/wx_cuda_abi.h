/* wx_cuda_abi.h - the part of the CUDA driver API (libcuda.so.1) that wxfer uses, declared
 * here so that the extension builds without cuda.h.
 *
 * Written from the driver API's public ABI: handles are opaque pointers, CUdevice an int,
 * CUdeviceptr a 64-bit integer (the _v2 ABI every driver since CUDA 3.2 exports), CUresult
 * and the attribute enums plain ints with the values below. Entry points are looked up by
 * their versioned names (cuMemAlloc_v2, ...) in wx_dl_cuda.c. Checked against cuda.h of
 * CUDA 13.0 (CUDA_VERSION 13000) by `make abi-check` (csrc/abi/abi_check.py, the list in
 * csrc/abi/wx_abi_list.h) where cuda.h is found ($CUDA_HOME/include). The names are the
 * driver API's own; a translation unit includes this header or cuda.h, never both.
 */
#ifndef WX_CUDA_ABI_H
#define WX_CUDA_ABI_H

#if defined(__cuda_cuda_h__)
#error "wx_cuda_abi.h and cuda.h declare the same names: include one"
#endif

#include <stddef.h>

#define WX_CUDA_ABI_CHECKED "CUDA 13.0 driver API (cuda.h CUDA_VERSION 13000)"

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

#define CU_IPC_HANDLE_SIZE 64
typedef struct CUipcMemHandle_st {
    char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;

typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef enum CUdevice_attribute_enum {
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
} CUdevice_attribute;

typedef enum CUpointer_attribute_enum {
    CU_POINTER_ATTRIBUTE_CONTEXT = 1,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
} CUpointer_attribute;

/* cuStreamWaitValue32's condition (flags): GEQ is the cyclic (int32_t)(*addr - value) >= 0 */
typedef enum CUstreamWaitValue_flags_enum {
    CU_STREAM_WAIT_VALUE_GEQ = 0x0,
    CU_STREAM_WAIT_VALUE_EQ = 0x1
} CUstreamWaitValue_flags;

typedef enum CUfunction_attribute_enum {
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
} CUfunction_attribute;

typedef enum CUmemRangeHandleType_enum {
    CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
} CUmemRangeHandleType;

/* cuMemcpyBatchAsync (CUDA 12.8+): one attribute set for the copies from attrsIdxs[i] on. */
typedef enum CUmemLocationType_enum {
    CU_MEM_LOCATION_TYPE_INVALID = 0,
    CU_MEM_LOCATION_TYPE_DEVICE = 1
} CUmemLocationType;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id; /* the device ordinal for CU_MEM_LOCATION_TYPE_DEVICE */
} CUmemLocation;

typedef enum CUmemcpySrcAccessOrder_enum {
    CU_MEMCPY_SRC_ACCESS_ORDER_INVALID = 0,
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1,
    CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL = 2,
    CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3
} CUmemcpySrcAccessOrder;

typedef struct CUmemcpyAttributes_st {
    CUmemcpySrcAccessOrder srcAccessOrder;
    CUmemLocation srcLocHint; /* hints: ignored for memory cudaMalloc'ed (not managed) */
    CUmemLocation dstLocHint;
    unsigned int flags; /* CU_MEMCPY_FLAG_* */
} CUmemcpyAttributes;

enum { CU_MEMCPY_FLAG_DEFAULT = 0, CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1 };

/* cuda.h's CU_STREAM_PER_THREAD: the per-thread default stream's handle (0x2). cuMemcpyBatchAsync
 * refuses the legacy NULL stream (CUDA_ERROR_INVALID_VALUE); the per-thread one is ordered with
 * the legacy stream both ways (the legacy stream synchronizes with every blocking stream). */
#define WX_CU_STREAM_PER_THREAD ((CUstream)(uintptr_t)0x2)

enum { CU_SHAREDMEM_CARVEOUT_MAX_SHARED = 100 };
enum { CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1 };
enum { CU_STREAM_NON_BLOCKING = 1 };
enum { CU_EVENT_DISABLE_TIMING = 2 };

#endif
