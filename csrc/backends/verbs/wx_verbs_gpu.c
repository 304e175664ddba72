/* wx_verbs_gpu.c - verbs backend: can GPU memory be registered with the NIC here, and how.
 *
 * Decided once, when a transport is opened with gpu_memory=yes (the Receiver and Sender do
 * that for CUDA memory), so that a machine where it cannot work fails at setup, naming the
 * cause and its fix, before anything is registered or written:
 *   dma-buf  the CUDA driver exports GPU memory as a dma-buf fd (cuMemGetHandleForAddressRange,
 *            CUDA >= 11.7; CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: the open kernel module on
 *            Linux >= 5.12) and libibverbs has ibv_reg_dmabuf_mr (rdma-core >= 34);
 *   peermem  ibv_reg_mr on the device pointer, which needs nvidia-peermem loaded.
 * The registration itself (wx_verbs_reg.c) tries them in that order (option reg= picks one)
 * and reports which worked. A test build (WXFER_TESTING=1) can override each fact with
 * $WXFER_TEST_GPUREG ("cuda=0,dmabuf=0,ibv_dmabuf=0,peermem=0,memlock=65536"), so that the
 * CPU tests force every cause. */
#include "wx_verbs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "wx_dl_cuda.h"
#include "wx_param.h"

typedef struct wx__vgpu_facts {
    int cuda; /* libcuda loaded and the device there */
    char cuda_why[300];
    int get_handle;    /* cuMemGetHandleForAddressRange exported */
    int dmabuf_attr;   /* CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED */
    int ibv_dmabuf;    /* ibv_reg_dmabuf_mr exported */
    int peermem;       /* nvidia-peermem loaded */
    long long memlock; /* RLIMIT_MEMLOCK in bytes, -1 unlimited */
} wx__vgpu_facts_t;

int wx__verbs_peermem_loaded(const wx_verbs_t *t)
{
    struct stat st;
    if (t->v->emulated)
        return t->v->emu_peermem ? t->v->emu_peermem() : 0;
    return stat("/sys/module/nvidia_peermem", &st) == 0 ||
           stat("/sys/kernel/mm/memory_peers/nv_mem/version", &st) == 0;
}

static long long wx__memlock(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return -1;
    return (long long)rl.rlim_cur;
}

const char *wx__verbs_memlock_hint(int e, char *buf, size_t len)
{
    long long ml = wx__memlock();
    buf[0] = '\0';
    if (e == ENOMEM && ml >= 0)
        snprintf(buf, len,
                 "; registered memory is pinned against RLIMIT_MEMLOCK, which is %lld KiB here "
                 "(ulimit -l): raise it (ulimit -l unlimited; docker run --ulimit memlock=-1; "
                 "LimitMEMLOCK=infinity in a systemd unit; '* - memlock unlimited' in "
                 "/etc/security/limits.conf)",
                 ml / 1024);
    return buf;
}

static void wx__gpu_facts(wx_verbs_t *t, int device, wx__vgpu_facts_t *f)
{
    const wx_cuda_api_t *cu;
    CUdevice dev;
    memset(f, 0, sizeof *f);
    f->ibv_dmabuf = t->v->reg_dmabuf_mr != NULL;
    f->peermem = wx__verbs_peermem_loaded(t);
    f->memlock = wx__memlock();
    cu = wx_cuda(f->cuda_why, sizeof f->cuda_why);
    if (cu && cu->cuDeviceGet(&dev, device) != CUDA_SUCCESS) {
        snprintf(f->cuda_why, sizeof f->cuda_why, "CUDA device %d not found", device);
        cu = NULL;
    }
    if (cu) {
        int attr = 0;
        f->cuda = 1;
        f->get_handle = cu->cuMemGetHandleForAddressRange != NULL;
        f->dmabuf_attr = cu->cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                                                  dev) == CUDA_SUCCESS &&
                         attr;
    }
#ifdef WX_TESTING
    {
        /* TEST ONLY: force facts, "name=value,..." */
        const char *e = wx_param_str(WX_P_TEST_GPUREG);
        char buf[256], *save = NULL, *tok;
        snprintf(buf, sizeof buf, "%s", e ? e : "");
        for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            char *eq = strchr(tok, '=');
            long long v;
            if (!eq)
                continue;
            *eq = '\0';
            v = strtoll(eq + 1, NULL, 0);
            if (strcmp(tok, "cuda") == 0) {
                f->cuda = (int)v;
                if (!v)
                    snprintf(f->cuda_why, sizeof f->cuda_why, "forced off (WXFER_TEST_GPUREG)");
                else
                    f->get_handle = f->dmabuf_attr = 1;
            } else if (strcmp(tok, "dmabuf") == 0) {
                f->dmabuf_attr = (int)v;
            } else if (strcmp(tok, "get_handle") == 0) {
                f->get_handle = (int)v;
            } else if (strcmp(tok, "ibv_dmabuf") == 0) {
                f->ibv_dmabuf = (int)v;
            } else if (strcmp(tok, "peermem") == 0) {
                f->peermem = (int)v;
            } else if (strcmp(tok, "memlock") == 0) {
                f->memlock = v;
            }
        }
    }
#endif
}

/* Why dma-buf cannot work ("" when it can). */
static const char *wx__dmabuf_why(const wx_verbs_t *t, const wx__vgpu_facts_t *f, char *buf,
                                  size_t len)
{
    buf[0] = '\0';
    if (!f->get_handle)
        snprintf(buf, len, "the CUDA driver lacks cuMemGetHandleForAddressRange (CUDA < 11.7)");
    else if (!f->dmabuf_attr)
        snprintf(buf, len,
                 "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 on GPU %d (the proprietary "
                 "kernel module, or Linux < 5.12)",
                 t->gpu < 0 ? 0 : t->gpu);
    else if (!f->ibv_dmabuf)
        snprintf(buf, len, "%s lacks ibv_reg_dmabuf_mr (rdma-core < 34)", t->v->path);
    return buf;
}

int wx__verbs_gpu_check(wx_verbs_t *t)
{
    int dev = t->gpu < 0 ? 0 : t->gpu;
    int want_dmabuf = strcmp(t->reg_mode, "peermem") != 0;
    int want_peermem = strcmp(t->reg_mode, "dmabuf") != 0;
    char dwhy[300], ml[64] = "";
    wx__vgpu_facts_t f;
    wx__gpu_facts(t, dev, &f);
    if (!f.cuda)
        return wx_errf(-ENODEV,
                       "verbs: GPU %d memory cannot be registered with the NIC: the CUDA driver "
                       "is not usable: %s (fix: run where the NVIDIA driver and the GPU are)",
                       dev, f.cuda_why);
    wx__dmabuf_why(t, &f, dwhy, sizeof dwhy);
    if (f.memlock >= 0)
        snprintf(ml, sizeof ml, "; RLIMIT_MEMLOCK %lld KiB", f.memlock / 1024);
    if (want_dmabuf && !dwhy[0]) {
        snprintf(t->gpu_route, sizeof t->gpu_route, "dmabuf");
        snprintf(t->gpu_why, sizeof t->gpu_why,
                 "GPU %d exports dma-bufs and %s has ibv_reg_dmabuf_mr%s%s", dev, t->v->path,
                 f.peermem ? "; nvidia-peermem loaded too (the fallback)" : "", ml);
        return 0;
    }
    if (want_peermem && f.peermem) {
        snprintf(t->gpu_route, sizeof t->gpu_route, "peermem");
        snprintf(t->gpu_why, sizeof t->gpu_why, "nvidia-peermem loaded; dma-buf: %s%s",
                 want_dmabuf ? dwhy : "not tried (reg=peermem)", ml);
        return 0;
    }
    if (!want_peermem)
        return wx_errf(-ENOTSUP,
                       "verbs: GPU %d memory cannot be registered with the NIC by dma-buf "
                       "(reg=dmabuf): %s (fix: %s; or reg=auto to allow nvidia-peermem)",
                       dev, dwhy, WX_VERBS_FIX_DMABUF);
    if (!want_dmabuf)
        return wx_errf(-ENOTSUP,
                       "verbs: GPU %d memory cannot be registered with the NIC by nvidia-peermem "
                       "(reg=peermem): nvidia-peermem is not loaded (fix: %s; or reg=auto to "
                       "allow dma-buf)",
                       dev, WX_VERBS_FIX_PEERMEM);
    return wx_errf(-ENOTSUP,
                   "verbs: GPU %d memory cannot be registered with the NIC on this machine: "
                   "dma-buf: %s (fix: %s); nvidia-peermem: not loaded (fix: %s)",
                   dev, dwhy, WX_VERBS_FIX_DMABUF, WX_VERBS_FIX_PEERMEM);
}
