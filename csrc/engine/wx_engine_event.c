/* wx_engine_event.c - the ready stage's wait for a task's CUDA event (libcuda through the
 * dlopen table): polled with a bounded sleep, until the task's deadline or the engine stops. */
#include "wx_engine_int.h"

#include <time.h>

#include "wx_dl_cuda.h"

int wx__wait_event(wx_engine_t *e, wx__task_t *t, wx_engine_fail_t *f)
{
    char why[256];
    const wx_cuda_api_t *cu = wx_cuda(why, sizeof why);
    CUdevice dev;
    CUcontext ctx;
    CUresult r;
    uint64_t deadline = wx_now_ns() + e->o.timeout_ns;
    if (!cu) {
        wx__fail_fill(f, -ENODEV, t, NULL, "ready", "cannot wait for its CUDA event: %s", why);
        return -ENODEV;
    }
    /* only the ready thread calls this: make the device's primary context current once per
     * device, not per task (the caller's process keeps it retained) */
    if (t->spec.cuda_device != e->ready_dev &&
        cu->cuDeviceGet(&dev, t->spec.cuda_device) == CUDA_SUCCESS &&
        cu->cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS) {
        if (cu->cuCtxSetCurrent(ctx) == CUDA_SUCCESS)
            e->ready_dev = t->spec.cuda_device;
        cu->cuDevicePrimaryCtxRelease(dev);
    }
    for (;;) {
        r = cu->cuEventQuery((CUevent)t->spec.cuda_event);
        if (r == CUDA_SUCCESS)
            return 0;
        if (r != CUDA_ERROR_NOT_READY) {
            wx_cuda_err(r, "cuEventQuery");
            wx__fail_fill(f, -EIO, t, NULL, "ready", "%s", wx_last_error());
            return -EIO;
        }
        if (wx_now_ns() > deadline || wx__stopping(e)) {
            wx__fail_fill(f, -ETIMEDOUT, t, NULL, "ready",
                          "its CUDA event did not complete in %.1f s",
                          (double)e->o.timeout_ns / 1e9);
            return -ETIMEDOUT;
        }
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}
