/* wx_cuda_syms.h - the CUDA driver entry points wxfer uses, once: X(field, symbol) for those
 * it needs, O(field, symbol) for those it can do without (left NULL where the driver lacks
 * them). `field` is the member of wx_cuda_api_t (wx_dl_cuda.h), `symbol` the versioned name
 * wx_dl_cuda.c looks up. csrc/abi/wx_abi_list.h compares every symbol with the one cuda.h maps
 * the field's name to. Plain macros: no includes (it is read beside the system's cuda.h too). */
#ifndef WX_CUDA_SYMS_H
#define WX_CUDA_SYMS_H

#define WX_CUDA_SYMS(X, O)                                                                         \
    X(cuInit, "cuInit")                                                                            \
    X(cuDriverGetVersion, "cuDriverGetVersion")                                                    \
    X(cuGetErrorString, "cuGetErrorString")                                                        \
    X(cuGetErrorName, "cuGetErrorName")                                                            \
    X(cuDeviceGet, "cuDeviceGet")                                                                  \
    X(cuDeviceGetCount, "cuDeviceGetCount")                                                        \
    X(cuDeviceGetAttribute, "cuDeviceGetAttribute")                                                \
    X(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId")                                                  \
    X(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer")                                              \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")                                        \
    X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2")                                   \
    X(cuCtxSetCurrent, "cuCtxSetCurrent")                                                          \
    X(cuCtxGetCurrent, "cuCtxGetCurrent")                                                          \
    X(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess")                                              \
    X(cuCtxSynchronize, "cuCtxSynchronize")                                                        \
    X(cuPointerGetAttribute, "cuPointerGetAttribute")                                              \
    X(cuMemGetAddressRange, "cuMemGetAddressRange_v2")                                             \
    X(cuMemAlloc, "cuMemAlloc_v2")                                                                 \
    X(cuMemFree, "cuMemFree_v2")                                                                   \
    X(cuMemcpyDtoH, "cuMemcpyDtoH_v2")                                                             \
    X(cuMemcpyHtoD, "cuMemcpyHtoD_v2")                                                             \
    X(cuMemcpyAsync, "cuMemcpyAsync")                                                              \
    X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2")                                                   \
    X(cuMemcpyPeerAsync, "cuMemcpyPeerAsync")                                                      \
    X(cuIpcGetMemHandle, "cuIpcGetMemHandle")                                                      \
    X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2")                                                 \
    X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle")                                                  \
    X(cuStreamCreate, "cuStreamCreate")                                                            \
    X(cuStreamDestroy, "cuStreamDestroy_v2")                                                       \
    X(cuStreamSynchronize, "cuStreamSynchronize")                                                  \
    X(cuStreamWaitEvent, "cuStreamWaitEvent")                                                      \
    X(cuEventCreate, "cuEventCreate")                                                              \
    X(cuEventDestroy, "cuEventDestroy_v2")                                                         \
    X(cuEventRecord, "cuEventRecord")                                                              \
    X(cuEventQuery, "cuEventQuery")                                                                \
    X(cuEventSynchronize, "cuEventSynchronize")                                                    \
    X(cuEventElapsedTime, "cuEventElapsedTime")                                                    \
    X(cuCtxGetDevice, "cuCtxGetDevice")                                                            \
    X(cuDeviceGetName, "cuDeviceGetName")                                                          \
    X(cuModuleLoadData, "cuModuleLoadData")                                                        \
    X(cuModuleUnload, "cuModuleUnload")                                                            \
    X(cuModuleGetFunction, "cuModuleGetFunction")                                                  \
    X(cuFuncSetAttribute, "cuFuncSetAttribute")                                                    \
    X(cuLaunchKernel, "cuLaunchKernel")                                                            \
    O(cuMemGetHandleForAddressRange, "cuMemGetHandleForAddressRange")                              \
    O(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle")                                  \
    O(cuMemRelease, "cuMemRelease")                                                                \
    O(cuDeviceGetUuid, "cuDeviceGetUuid_v2")                                                       \
    O(cuMemcpyBatchAsync, "cuMemcpyBatchAsync_v2")                                                 \
    O(cuMemcpyBatchAsync_v1, "cuMemcpyBatchAsync")                                                 \
    O(cuStreamWaitValue32, "cuStreamWaitValue32_v2")

#endif
