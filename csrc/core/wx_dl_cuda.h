/* wx_dl_cuda.h - the CUDA driver API, loaded from libcuda.so.1 at run time.
 *
 * Always compiled: the types come from wx_cuda_abi.h (no cuda.h needed at build time).
 * Entries are named
 * after the driver functions; versioned symbols (_v2) are resolved by their real name.
 */
#ifndef WX_DL_CUDA_H
#define WX_DL_CUDA_H

#include "wx_cuda_abi.h"

typedef struct wx_cuda_api {
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDriverGetVersion)(int *);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*cuDeviceGetPCIBusId)(char *, int, CUdevice);
    CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned int);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuPointerGetAttribute)(void *, CUpointer_attribute, CUdeviceptr);
    CUresult (*cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree)(CUdeviceptr);
    CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
    CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
    CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
    CUresult (*cuStreamCreate)(CUstream *, unsigned int);
    CUresult (*cuStreamDestroy)(CUstream);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
    CUresult (*cuEventCreate)(CUevent *, unsigned int);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
    /* optional (NULL when the driver lacks them) */
    CUresult (*cuMemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, CUmemRangeHandleType,
                                              unsigned long long);
    CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
    CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
    CUresult (*cuDeviceGetUuid)(CUuuid *, CUdevice);
    /* cuda_ipc additions (required) */
    CUresult (*cuCtxGetDevice)(CUdevice *);
    CUresult (*cuDeviceGetName)(char *, int, CUdevice);
    /* prepare (the FP8 kernel) additions (required) */
    CUresult (*cuModuleLoadData)(CUmodule *, const void *);
    CUresult (*cuModuleUnload)(CUmodule);
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*cuFuncSetAttribute)(CUfunction, CUfunction_attribute, int);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                               unsigned int, unsigned int, unsigned int, CUstream, void **,
                               void **);
    /* the batched copy (optional: CUDA 12.8+ drivers). cuda.h of CUDA 13 maps the name to
     * cuMemcpyBatchAsync_v2; 12.8 and 12.9 drivers export only the first ABI, with failIdx */
    CUresult (*cuMemcpyBatchAsync)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                   CUmemcpyAttributes *, size_t *, size_t, CUstream);
    CUresult (*cuMemcpyBatchAsync_v1)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                      CUmemcpyAttributes *, size_t *, size_t, size_t *, CUstream);
    /* the begin stamps' device wait (optional: the v2 stream memory operations, CUDA 11.7+) */
    CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, unsigned int, unsigned int);
} wx_cuda_api_t;

/* Load libcuda.so.1 (or $WXFER_LIBCUDA) once and call cuInit(0). Returns the table, or
 * NULL with the reason in why. Thread-safe. */
const wx_cuda_api_t *wx_cuda(char *why, size_t why_len);
/* Turn a CUresult into "CUDA_ERROR_X (text)" and record it with wx_errf; returns -EIO. */
int wx_cuda_err(CUresult r, const char *call);

#endif
