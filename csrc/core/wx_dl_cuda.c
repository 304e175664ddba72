/* wx_dl_cuda.c - the libcuda table (see wx_dl_cuda.h). */
#include "wx_dl_cuda.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "wx_common.h"
#include "wx_dl.h"

static wx_cuda_api_t wx__cuda;
static pthread_once_t wx__cuda_once = PTHREAD_ONCE_INIT;
static char wx__cuda_why[256];
static int wx__cuda_ok;

#define WX__SYM(field, sym) WX_DL_SYM("libcuda.so.1", wx__cuda, field, sym, wx__cuda_why)
#define WX__OPT(field, sym) WX_DL_OPT("libcuda.so.1", wx__cuda, field, sym)

static void wx__cuda_load(void)
{
    void *lib = wx_dl_open(WX_P_LIBCUDA, wx__cuda_why, sizeof wx__cuda_why);
    CUresult r;
    if (!lib)
        return;
    WX__SYM(cuInit, "cuInit");
    WX__SYM(cuDriverGetVersion, "cuDriverGetVersion");
    WX__SYM(cuGetErrorString, "cuGetErrorString");
    WX__SYM(cuGetErrorName, "cuGetErrorName");
    WX__SYM(cuDeviceGet, "cuDeviceGet");
    WX__SYM(cuDeviceGetCount, "cuDeviceGetCount");
    WX__SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute");
    WX__SYM(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
    WX__SYM(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
    WX__SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    WX__SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    WX__SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
    WX__SYM(cuCtxGetCurrent, "cuCtxGetCurrent");
    WX__SYM(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess");
    WX__SYM(cuCtxSynchronize, "cuCtxSynchronize");
    WX__SYM(cuPointerGetAttribute, "cuPointerGetAttribute");
    WX__SYM(cuMemGetAddressRange, "cuMemGetAddressRange_v2");
    WX__SYM(cuMemAlloc, "cuMemAlloc_v2");
    WX__SYM(cuMemFree, "cuMemFree_v2");
    WX__SYM(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
    WX__SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
    WX__SYM(cuMemcpyAsync, "cuMemcpyAsync");
    WX__SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
    WX__SYM(cuMemcpyPeerAsync, "cuMemcpyPeerAsync");
    WX__SYM(cuIpcGetMemHandle, "cuIpcGetMemHandle");
    WX__SYM(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
    WX__SYM(cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
    WX__SYM(cuStreamCreate, "cuStreamCreate");
    WX__SYM(cuStreamDestroy, "cuStreamDestroy_v2");
    WX__SYM(cuStreamSynchronize, "cuStreamSynchronize");
    WX__SYM(cuStreamWaitEvent, "cuStreamWaitEvent");
    WX__SYM(cuEventCreate, "cuEventCreate");
    WX__SYM(cuEventDestroy, "cuEventDestroy_v2");
    WX__SYM(cuEventRecord, "cuEventRecord");
    WX__SYM(cuEventQuery, "cuEventQuery");
    WX__SYM(cuEventSynchronize, "cuEventSynchronize");
    WX__SYM(cuEventElapsedTime, "cuEventElapsedTime");
    WX__SYM(cuCtxGetDevice, "cuCtxGetDevice");
    WX__SYM(cuDeviceGetName, "cuDeviceGetName");
    WX__SYM(cuModuleLoadData, "cuModuleLoadData");
    WX__SYM(cuModuleUnload, "cuModuleUnload");
    WX__SYM(cuModuleGetFunction, "cuModuleGetFunction");
    WX__SYM(cuFuncSetAttribute, "cuFuncSetAttribute");
    WX__SYM(cuLaunchKernel, "cuLaunchKernel");
    WX__OPT(cuMemGetHandleForAddressRange, "cuMemGetHandleForAddressRange");
    WX__OPT(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle");
    WX__OPT(cuMemRelease, "cuMemRelease");
    WX__OPT(cuDeviceGetUuid, "cuDeviceGetUuid_v2");
    WX__OPT(cuMemcpyBatchAsync, "cuMemcpyBatchAsync_v2");
    WX__OPT(cuMemcpyBatchAsync_v1, "cuMemcpyBatchAsync");
    WX__OPT(cuStreamWaitValue32, "cuStreamWaitValue32_v2");
    r = wx__cuda.cuInit(0);
    if (r != CUDA_SUCCESS) {
        const char *name = "?";
        wx__cuda.cuGetErrorName(r, &name);
        snprintf(wx__cuda_why, sizeof wx__cuda_why, "cuInit failed: %s (is there a GPU?)", name);
        return;
    }
    wx__cuda_ok = 1;
}

const wx_cuda_api_t *wx_cuda(char *why, size_t why_len)
{
    return wx_dl_once(&wx__cuda_once, wx__cuda_load, &wx__cuda_ok, wx__cuda_why, &wx__cuda, why,
                      why_len);
}

int wx_cuda_err(CUresult r, const char *call)
{
    const char *name = "CUDA_ERROR_UNKNOWN", *text = "";
    if (wx__cuda_ok) {
        wx__cuda.cuGetErrorName(r, &name);
        wx__cuda.cuGetErrorString(r, &text);
    }
    return wx_errf(-EIO, "%s failed: %s (%s)", call, name ? name : "?", text ? text : "");
}
