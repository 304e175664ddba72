/* wx_kernels.c - the NVRTC kernel loader (see wx_kernels.h): the per-architecture cubin cache,
 * the per-device primary context, the per-device module and function of each kernel. */
#include "wx_kernels.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "wx_common.h"
#include "wx_dl_cuda.h"
#include "wx_dl_nvrtc.h"
#include "wx_sweep.h"

const wx_kernel_cfg_t *wx_kernel_cfg(wx_kernel_t *k, const char *name,
                                     const wx_kernel_cfg_t *product)
{
    const wx_kernel_cfg_t *c;
    pthread_mutex_lock(&k->mu);
    if (!k->cfg) {
        c = wx_sweep_cfg(name);
        k->cfg = c ? c : product;
    }
    c = k->cfg;
    pthread_mutex_unlock(&k->mu);
    return c;
}

static pthread_mutex_t wx__dev_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    wx_kernel_dev_t d;
    int state; /* 0 not tried, 1 ready, -1 failed */
    char why[512];
} wx__devs[WX_KERNEL_MAX_DEV];

static int wx__cuda_fail(CUresult r, const char *call, int device, char *why, size_t why_len)
{
    wx_cuda_err(r, call);
    snprintf(why, why_len, "cuda:%d: %s", device, wx_last_error());
    return -EIO;
}

/* Fill slot `device` of wx__devs (wx__dev_mu held). */
static int wx__device_setup(const wx_cuda_api_t *cu, int device, wx_kernel_dev_t *d, char *why,
                            size_t why_len)
{
    CUdevice dev;
    CUresult r;
    int maj = 0, min = 0;
    if ((r = cu->cuDeviceGet(&dev, device)) != CUDA_SUCCESS)
        return wx__cuda_fail(r, "cuDeviceGet", device, why, why_len);
    cu->cuDeviceGetAttribute(&maj, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
    cu->cuDeviceGetAttribute(&min, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
    d->cc = maj * 10 + min;
    if (cu->cuDeviceGetAttribute(&d->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) !=
            CUDA_SUCCESS ||
        d->sms < 1)
        d->sms = 1;
    if ((r = cu->cuDevicePrimaryCtxRetain(&d->ctx, dev)) != CUDA_SUCCESS)
        return wx__cuda_fail(r, "cuDevicePrimaryCtxRetain", device, why, why_len);
    return 0; /* the context stays retained for the life of the process */
}

int wx_kernel_device(int device, wx_kernel_dev_t *out, char *why, size_t why_len)
{
    const wx_cuda_api_t *cu = wx_cuda(why, why_len);
    int rc = 0;
    if (!cu)
        return -ENODEV;
    if (device < 0 || device >= WX_KERNEL_MAX_DEV) {
        snprintf(why, why_len, "CUDA device %d out of range [0, %d)", device, WX_KERNEL_MAX_DEV);
        return -EINVAL;
    }
    pthread_mutex_lock(&wx__dev_mu);
    if (wx__devs[device].state == 0) {
        char buf[sizeof wx__devs[0].why] = "";
        rc = wx__device_setup(cu, device, &wx__devs[device].d, buf, sizeof buf);
        memcpy(wx__devs[device].why, buf, sizeof buf);
        wx__devs[device].state = rc ? -1 : 1;
    }
    if (wx__devs[device].state == 1) {
        *out = wx__devs[device].d;
        out->fn = NULL;
        rc = 0;
    } else {
        snprintf(why, why_len, "%s", wx__devs[device].why);
        rc = rc ? rc : -EIO;
    }
    pthread_mutex_unlock(&wx__dev_mu);
    return rc;
}

/* The cubin of src for cc, compiled at first use (the answer or the failure is kept); k->mu
 * held. */
static int wx__cubin(wx_kernel_t *k, const wx_kernel_src_t *src, int cc, const char *const *dirs,
                     int ndirs, const char **bin, char *why, size_t why_len)
{
    const wx_nvrtc_api_t *nv;
    const char *opts[WX_KERNEL_MAX_OPT + 1];
    char arch[48], what[96];
    size_t size = 0;
    char *out = NULL;
    int rc;
    for (int i = 0; i < k->nbins; i++) {
        if (k->bins[i].cc != cc)
            continue;
        if (!k->bins[i].cubin) {
            snprintf(why, why_len, "%s", k->bins[i].why);
            return -EIO;
        }
        *bin = k->bins[i].cubin;
        return 0;
    }
    if (k->nbins == WX_KERNEL_MAX_ARCH) {
        snprintf(why, why_len, "more than %d GPU architectures in one process", WX_KERNEL_MAX_ARCH);
        return -ENOSPC;
    }
    if (!(nv = wx_nvrtc(dirs, ndirs, why, why_len)))
        return -ENOENT;
    snprintf(arch, sizeof arch, "--gpu-architecture=sm_%d", cc);
    opts[0] = arch;
    for (int i = 0; i < src->nopt && i < WX_KERNEL_MAX_OPT; i++)
        opts[i + 1] = src->opt[i];
    snprintf(what, sizeof what, "%s for sm_%d", src->what, cc);
    rc = wx_nvrtc_cubin(nv, what, src->src, src->file, src->nhdr, src->hdr_src, src->hdr_name,
                        src->nopt + 1, opts, &out, &size, why, why_len);
    k->bins[k->nbins].cc = cc;
    k->bins[k->nbins].cubin = rc ? NULL : out;
    if (rc)
        snprintf(k->bins[k->nbins].why, sizeof k->bins[0].why, "%s", why);
    k->nbins++;
    *bin = out;
    return rc;
}

/* The module of bin in d's context and its function src->fn, with its shared memory limit. */
static int wx__load(const wx_cuda_api_t *cu, const wx_kernel_src_t *src, const char *bin,
                    int device, const wx_kernel_dev_t *d, CUfunction *fn, char *why, size_t why_len)
{
    CUcontext prev = NULL;
    CUmodule mod;
    CUresult r;
    const char *call = "cuModuleLoadData";
    wx_kernel_enter(d->ctx, &prev);
    r = cu->cuModuleLoadData(&mod, bin);
    if (r == CUDA_SUCCESS) {
        call = "cuModuleGetFunction";
        r = cu->cuModuleGetFunction(fn, mod, src->fn);
        if (r == CUDA_SUCCESS && src->smem > 48u * 1024u) {
            call = "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)";
            r = cu->cuFuncSetAttribute(*fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       (int)src->smem);
            /* all of the SM's shared memory, so that the CTAs per SM fit (L1 keeps the rest) */
            if (r == CUDA_SUCCESS)
                r = cu->cuFuncSetAttribute(*fn, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                           CU_SHAREDMEM_CARVEOUT_MAX_SHARED);
        }
        if (r != CUDA_SUCCESS)
            cu->cuModuleUnload(mod);
    }
    wx_kernel_leave(d->ctx, prev);
    if (r != CUDA_SUCCESS) {
        char c[96];
        snprintf(c, sizeof c, "%s (%s)", call, src->fn);
        return wx__cuda_fail(r, c, device, why, why_len);
    }
    return 0; /* the module stays loaded for the life of the process */
}

/* Compile (once per architecture) and load (once per device); k->mu held. */
static int wx__setup(wx_kernel_t *k, const wx_kernel_src_t *src, int device,
                     const char *const *dirs, int ndirs, const wx_kernel_dev_t *d, char *why,
                     size_t why_len)
{
    const char *bin = NULL;
    int rc;
    if (src->min_cc && d->cc < src->min_cc) {
        snprintf(why, why_len, "cuda:%d has compute capability %d.%d; %s needs %d.%d or newer",
                 device, d->cc / 10, d->cc % 10, src->min_why ? src->min_why : src->what,
                 src->min_cc / 10, src->min_cc % 10);
        return -ENOTSUP;
    }
    if ((rc = wx__cubin(k, src, d->cc, dirs, ndirs, &bin, why, why_len)) != 0)
        return rc;
    return wx__load(wx_cuda(NULL, 0), src, bin, device, d, &k->devs[device].fn, why, why_len);
}

int wx_kernel_get(wx_kernel_t *k, const wx_kernel_src_t *src, int device, const char *const *dirs,
                  int ndirs, wx_kernel_dev_t *out, char *why, size_t why_len)
{
    int rc = wx_kernel_device(device, out, why, why_len);
    if (rc)
        return rc;
    pthread_mutex_lock(&k->mu);
    if (k->devs[device].state == 0) {
        char buf[sizeof k->devs[0].why] = "";
        rc = wx__setup(k, src, device, dirs, ndirs, out, buf, sizeof buf);
        memcpy(k->devs[device].why, buf, sizeof buf);
        k->devs[device].state = rc ? -1 : 1;
    }
    if (k->devs[device].state == 1) {
        out->fn = k->devs[device].fn;
        rc = 0;
    } else {
        snprintf(why, why_len, "%s", k->devs[device].why);
        rc = rc ? rc : -EIO;
    }
    pthread_mutex_unlock(&k->mu);
    return rc;
}

void wx_kernel_enter(CUcontext ctx, CUcontext *prev)
{
    const wx_cuda_api_t *cu = wx_cuda(NULL, 0);
    *prev = NULL;
    cu->cuCtxGetCurrent(prev);
    if (*prev != ctx)
        cu->cuCtxSetCurrent(ctx);
}

void wx_kernel_leave(CUcontext ctx, CUcontext prev)
{
    if (prev != ctx)
        wx_cuda(NULL, 0)->cuCtxSetCurrent(prev);
}

int wx_kernel_launch(const wx_kernel_dev_t *d, const char *what, uint64_t grid, unsigned threads,
                     unsigned smem, uint64_t stream, void **args)
{
    const wx_cuda_api_t *cu = wx_cuda(NULL, 0);
    CUcontext prev;
    CUresult r;
    char call[96];
    if (grid < 1 || grid > 0x7fffffffull)
        return wx_errf(-EINVAL, "%s: a grid of %llu CTAs", what, (unsigned long long)grid);
    wx_kernel_enter(d->ctx, &prev);
    r = cu->cuLaunchKernel(d->fn, (unsigned)grid, 1, 1, threads, 1, 1, smem,
                           (CUstream)(uintptr_t)stream, args, NULL);
    wx_kernel_leave(d->ctx, prev);
    if (r == CUDA_SUCCESS)
        return 0;
    snprintf(call, sizeof call, "cuLaunchKernel(%s)", what);
    return wx_cuda_err(r, call);
}

int wx_kernel_run(wx_kernel_t *k, const wx_kernel_src_t *src, int device, uint64_t work,
                  int ctas_per_sm, unsigned threads, uint64_t stream, void **args)
{
    char why[WX_ERRMSG_MAX];
    wx_kernel_dev_t d;
    uint64_t grid = work;
    int rc = wx_kernel_get(k, src, device, NULL, 0, &d, why, sizeof why);
    if (rc)
        return wx_errf(rc, "%s unavailable: %s", src->what, why);
    if (ctas_per_sm > 0 && grid > (uint64_t)d.sms * (uint64_t)ctas_per_sm)
        grid = (uint64_t)d.sms * (uint64_t)ctas_per_sm;
    return wx_kernel_launch(&d, src->fn, grid, threads, src->smem, stream, args);
}
