/* wx_engine_event.c - the ready stage's wait for a task's CUDA event (libcuda through the
 * dlopen table): polled with a bounded sleep, until the task's deadline (pushed out while the
 * fence word is held for a peer: wx__word_ready_deadline) or the engine stops;
 * or looked at once (an external task's wait, wx_engine_ext.c, which also waits for the host). */
#include "wx_engine_int.h"

#include <time.h>

#include "wx_dl_cuda.h"

/* The CUDA API with task t's device's primary context current on the ready thread (made
 * current once per device, not per task: the caller's process keeps it retained); NULL with
 * the failure in *f. */
static const wx_cuda_api_t *wx__event_api(wx_engine_t *e, wx__task_t *t, wx_engine_fail_t *f)
{
    char why[256];
    const wx_cuda_api_t *cu = wx_cuda(why, sizeof why);
    CUdevice dev;
    CUcontext ctx;
    if (!cu) {
        wx__fail_fill(f, -ENODEV, t, NULL, "ready", "cannot wait for its CUDA event: %s", why);
        return NULL;
    }
    if (t->spec.cuda_device != e->ready_dev &&
        cu->cuDeviceGet(&dev, t->spec.cuda_device) == CUDA_SUCCESS &&
        cu->cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS) {
        if (cu->cuCtxSetCurrent(ctx) == CUDA_SUCCESS)
            e->ready_dev = t->spec.cuda_device;
        cu->cuDevicePrimaryCtxRelease(dev);
    }
    return cu;
}

int wx__query_event(wx_engine_t *e, wx__task_t *t, wx_engine_fail_t *f)
{
    const wx_cuda_api_t *cu = wx__event_api(e, t, f);
    CUresult r;
    if (!cu)
        return -ENODEV;
    r = cu->cuEventQuery((CUevent)t->spec.cuda_event);
    if (r == CUDA_SUCCESS)
        return 1;
    if (r == CUDA_ERROR_NOT_READY)
        return 0;
    wx_cuda_err(r, "cuEventQuery");
    wx__fail_fill(f, -EIO, t, NULL, "ready", "%s", wx_last_error());
    return -EIO;
}

int wx__wait_event(wx_engine_t *e, wx__task_t *t, wx_engine_fail_t *f)
{
    uint64_t deadline = wx_now_ns() + e->o.timeout_ns;
    for (;;) {
        int rc = wx__query_event(e, t, f);
        if (rc)
            return rc < 0 ? rc : 0;
        if (wx_now_ns() > deadline && !wx__stopping(e)) { /* behind a held fence word? */
            pthread_mutex_lock(&e->mu);
            deadline = wx__word_ready_deadline(e, deadline);
            pthread_mutex_unlock(&e->mu);
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
