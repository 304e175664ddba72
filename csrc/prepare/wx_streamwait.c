/* wx_streamwait.c - the begin stamps' device wait: cuStreamWaitValue32 on a pinned host word
 * (wx_streamwait.h). */
#include "wx_streamwait.h"

#include <errno.h>
#include <stdio.h>

#include "wx_common.h"
#include "wx_dl_cuda.h"
#include "wx_kernels.h"

int wx_stream_wait_addr(int device, uint64_t host, uint64_t *dev_addr, char *why, size_t why_len)
{
    const wx_cuda_api_t *cu = wx_cuda(why, why_len);
    wx_kernel_dev_t d;
    CUcontext prev;
    CUdeviceptr p = 0;
    CUresult r;
    const char *name = "?";
    int rc, v = 0;
    if (!cu)
        return -ENODEV;
    if (!cu->cuStreamWaitValue32) {
        cu->cuDriverGetVersion(&v);
        snprintf(
            why, why_len,
            "the CUDA driver (%d.%d) has no cuStreamWaitValue32_v2 (CUDA 11.7 or newer has it)",
            v / 1000, v % 1000 / 10);
        return -ENOTSUP;
    }
    if (!host || host % 4) {
        snprintf(why, why_len, "the word's host address 0x%llx is null or not 4-byte aligned",
                 (unsigned long long)host);
        return -EINVAL;
    }
    if ((rc = wx_kernel_device(device, &d, why, why_len)) != 0)
        return rc;
    wx_kernel_enter(d.ctx, &prev);
    r = cu->cuPointerGetAttribute(&p, CU_POINTER_ATTRIBUTE_DEVICE_POINTER, (CUdeviceptr)host);
    wx_kernel_leave(d.ctx, prev);
    if (r != CUDA_SUCCESS || !p) {
        cu->cuGetErrorName(r, &name);
        snprintf(why, why_len,
                 "the word at 0x%llx has no device address on CUDA device %d (%s: is it pinned "
                 "host memory?)",
                 (unsigned long long)host, device, r != CUDA_SUCCESS ? name : "null");
        return -EINVAL;
    }
    *dev_addr = (uint64_t)p;
    return 0;
}

int wx_stream_wait_u32(int device, uint64_t stream, uint64_t dev_addr, uint32_t value)
{
    char why[WX_ERRMSG_MAX];
    const wx_cuda_api_t *cu = wx_cuda(why, sizeof why);
    wx_kernel_dev_t d;
    CUcontext prev;
    CUstream hs;
    CUresult r;
    int rc;
    if (!cu)
        return wx_errf(-ENODEV, "stream_wait: %s", why);
    if (!cu->cuStreamWaitValue32)
        return wx_errf(-ENOTSUP, "stream_wait: the CUDA driver has no cuStreamWaitValue32_v2");
    if (!dev_addr || dev_addr % 4)
        return wx_errf(-EINVAL, "stream_wait: device address 0x%llx null or not 4-byte aligned",
                       (unsigned long long)dev_addr);
    if ((rc = wx_kernel_device(device, &d, why, sizeof why)) != 0)
        return wx_errf(rc, "stream_wait: %s", why);
    /* the legacy NULL stream (0) is refused by some driver calls; the per-thread default
     * stream keeps the same order against it (as wx_copy_batch) */
    hs = stream ? (CUstream)(uintptr_t)stream : WX_CU_STREAM_PER_THREAD;
    wx_kernel_enter(d.ctx, &prev);
    r = cu->cuStreamWaitValue32(hs, (CUdeviceptr)dev_addr, value, CU_STREAM_WAIT_VALUE_GEQ);
    wx_kernel_leave(d.ctx, prev);
    return r == CUDA_SUCCESS ? 0 : wx_cuda_err(r, "cuStreamWaitValue32");
}
