/* wx_verbs_reg.c - verbs backend: memory registration.
 *
 * One ibv MR per local NIC for a range, cached and shared by every registration inside it
 * (refcounted), so that the engine's repeated registrations of the same buffers cost a lookup.
 * CUDA memory: the whole allocation segment (cuMemGetAddressRange) is registered once, with
 * ibv_reg_dmabuf_mr on a dma-buf fd from cuMemGetHandleForAddressRange where the kernel,
 * driver and NIC support it, else with ibv_reg_mr on the device pointer (nvidia-peermem).
 * IBV_ACCESS_RELAXED_ORDERING is requested through ibv_reg_mr_iova2 (libibverbs masks it
 * where the kernel cannot pass it). */
#include "wx_verbs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "wx_dl_cuda.h"

static struct ibv_mr *wx__reg_va(wx_verbs_t *t, wx__vnic_t *n, void *addr, uint64_t len, int access)
{
    const wx_verbs_api_t *v = t->v;
    struct ibv_mr *m = NULL;
    if (v->reg_mr_iova2)
        m = v->reg_mr_iova2(n->pd, addr, len, (uint64_t)(uintptr_t)addr,
                            (unsigned)access | IBV_ACCESS_RELAXED_ORDERING);
    if (!m)
        m = v->reg_mr(n->pd, addr, len, access);
    return m;
}

static void wx__unreg(wx_verbs_t *t, wx__vreg_t *r)
{
    for (int i = t->nnic - 1; i >= 0; i--)
        if (r->mr[i] && t->v->dereg_mr(r->mr[i]))
            wx_debugf("verbs: ibv_dereg_mr on %s failed\n", t->nic[i].name);
}

/* ibv_reg_mr of r's range on every NIC; on a refusal the ones made are undone and the errno
 * (positive) returned, *nic naming the NIC that refused. */
static int wx__reg_va_all(wx_verbs_t *t, wx__vreg_t *r, int *nic)
{
    for (int i = 0; i < t->nnic; i++) {
        r->mr[i] = wx__reg_va(t, &t->nic[i], (void *)(uintptr_t)r->base, r->len, r->access);
        if (!r->mr[i]) {
            int e = errno ? errno : EIO;
            wx__unreg(t, r);
            *nic = i;
            return e;
        }
    }
    return 0;
}

static int wx__reg_host(wx_verbs_t *t, wx__vreg_t *r)
{
    char hint[400];
    int i = 0, e = wx__reg_va_all(t, r, &i);
    if (e)
        return wx_errf(-e, "ibv_reg_mr(%s, %p, %llu bytes) failed: %s%s", t->nic[i].name,
                       (void *)(uintptr_t)r->base, (unsigned long long)r->len, strerror(e),
                       wx__verbs_memlock_hint(e, hint, sizeof hint));
    r->how = "host";
    return 0;
}

static int wx__reg_dmabuf(wx_verbs_t *t, const wx_cuda_api_t *cu, wx__vreg_t *r, CUdevice dev,
                          char *why, size_t why_len)
{
    const wx_verbs_api_t *v = t->v;
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE), abase, aend;
    int attr = 0, fd = -1;
    CUresult cr;
    if (!cu->cuMemGetHandleForAddressRange) {
        snprintf(why, why_len, "the CUDA driver lacks cuMemGetHandleForAddressRange (< 11.7)");
        return -ENOSYS;
    }
    if (!v->reg_dmabuf_mr) {
        snprintf(why, why_len, "%s lacks ibv_reg_dmabuf_mr (rdma-core < 34)", v->path);
        return -ENOSYS;
    }
    if (cu->cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) !=
            CUDA_SUCCESS ||
        !attr) {
        snprintf(why, why_len,
                 "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 (needs Linux 5.12+ "
                 "and the open GPU kernel module)");
        return -ENOSYS;
    }
    abase = r->base & ~(pg - 1);
    aend = (r->base + r->len + pg - 1) & ~(pg - 1);
    cr = cu->cuMemGetHandleForAddressRange(&fd, (CUdeviceptr)abase, aend - abase,
                                           CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    if (cr != CUDA_SUCCESS) {
        const char *nm = "?";
        cu->cuGetErrorName(cr, &nm);
        snprintf(why, why_len, "cuMemGetHandleForAddressRange failed: %s", nm);
        return -EIO;
    }
    for (int i = 0; i < t->nnic; i++) {
        r->mr[i] = v->reg_dmabuf_mr(t->nic[i].pd, 0, aend - abase, abase, fd,
                                    r->access | IBV_ACCESS_RELAXED_ORDERING);
        if (!r->mr[i])
            r->mr[i] = v->reg_dmabuf_mr(t->nic[i].pd, 0, aend - abase, abase, fd, r->access);
        if (!r->mr[i]) {
            int e = errno ? errno : EIO;
            snprintf(why, why_len, "ibv_reg_dmabuf_mr(%s) failed: %s", t->nic[i].name, strerror(e));
            wx__unreg(t, r);
            memset(r->mr, 0, sizeof r->mr);
            close(fd);
            return -e;
        }
    }
    close(fd); /* the MRs hold their own reference to the dma-buf */
    r->how = "dmabuf";
    return 0;
}

static int wx__reg_cuda(wx_verbs_t *t, wx__vreg_t *r, char *note, size_t note_len)
{
    const wx_cuda_api_t *cu;
    char why[512] = "", dwhy[512] = "not tried";
    CUdeviceptr base;
    size_t size;
    CUdevice dev;
    CUcontext ctx, prev = NULL;
    int rc = -ENOSYS, peermem;
    cu = wx_cuda(why, sizeof why);
    if (!cu)
        return wx_errf(-ENODEV, "verbs: cannot register CUDA memory: %s", why);
    if (cu->cuDeviceGet(&dev, r->device) != CUDA_SUCCESS ||
        cu->cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS)
        return wx_errf(-ENODEV, "verbs: CUDA device %d unavailable", r->device);
    cu->cuCtxGetCurrent(&prev);
    cu->cuCtxSetCurrent(ctx);
    if (cu->cuMemGetAddressRange(&base, &size, (CUdeviceptr)r->base) != CUDA_SUCCESS) {
        cu->cuCtxSetCurrent(prev);
        cu->cuDevicePrimaryCtxRelease(dev);
        return wx_errf(-EINVAL, "verbs: %p is not CUDA memory of device %d",
                       (void *)(uintptr_t)r->base, r->device);
    }
    /* Register the whole allocator segment once; later tensors inside it hit the cache. */
    r->base = (uint64_t)base;
    r->len = (uint64_t)size;
    if (strcmp(t->reg_mode, "peermem") != 0)
        rc = wx__reg_dmabuf(t, cu, r, dev, dwhy, sizeof dwhy);
    else
        snprintf(dwhy, sizeof dwhy, "not tried (reg=peermem)");
    if (rc && strcmp(t->reg_mode, "dmabuf") != 0) {
        char hint[400];
        int i = 0, e;
        peermem = wx__verbs_peermem_loaded(t);
        e = wx__reg_va_all(t, r, &i);
        if (e) {
            cu->cuCtxSetCurrent(prev);
            cu->cuDevicePrimaryCtxRelease(dev);
            return wx_errf(-e,
                           "verbs: cannot register GPU %d memory (%llu bytes) on %s: "
                           "dma-buf: %s; ibv_reg_mr on the device pointer (nvidia-peermem "
                           "%s): %s%s (fix: %s, or %s)",
                           r->device, (unsigned long long)r->len, t->nic[i].name, dwhy,
                           peermem ? "loaded" : "not loaded", strerror(e),
                           wx__verbs_memlock_hint(e, hint, sizeof hint),
                           peermem ? "nvidia-peermem refused this memory: see dmesg"
                                   : WX_VERBS_FIX_PEERMEM,
                           WX_VERBS_FIX_DMABUF);
        }
        r->how = "peermem";
        snprintf(note, note_len, "dmabuf not used: %.200s", dwhy);
        rc = 0;
    } else if (rc) {
        cu->cuCtxSetCurrent(prev);
        cu->cuDevicePrimaryCtxRelease(dev);
        return wx_errf(rc,
                       "verbs: dma-buf registration of GPU %d memory failed: %s (reg=dmabuf; "
                       "fix: %s, or reg=auto to allow nvidia-peermem)",
                       r->device, dwhy, WX_VERBS_FIX_DMABUF);
    } else {
        snprintf(note, note_len, "peermem not needed: dma-buf worked");
    }
    cu->cuCtxSetCurrent(prev);
    cu->cuDevicePrimaryCtxRelease(dev);
    return rc;
}

int wx__verbs_reg(wx_transport_t *tt, wx_mr_t *mr)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    uint64_t a = (uint64_t)(uintptr_t)mr->addr;
    int access = IBV_ACCESS_LOCAL_WRITE | (mr->exported ? IBV_ACCESS_REMOTE_WRITE : 0);
    char note[300] = "";
    wx__vreg_t *r;
    int rc;

    pthread_mutex_lock(&t->rlock);
    for (r = t->regs; r; r = r->next)
        if (r->mem == mr->mem && r->device == mr->device && r->base <= a && a - r->base <= r->len &&
            mr->len <= r->len - (a - r->base) && (r->access & access) == access)
            break;
    if (r) {
        r->refs++;
        t->reg_hits++;
        pthread_mutex_unlock(&t->rlock);
    } else {
        pthread_mutex_unlock(&t->rlock);
        r = calloc(1, sizeof *r);
        if (!r)
            return wx_errf(-ENOMEM, "verbs: out of memory");
        r->base = a;
        r->len = mr->len;
        r->mem = mr->mem;
        r->device = mr->device;
        r->access = access;
        r->refs = 1;
        if (mr->mem == WX_MEM_CUDA) {
            rc = wx__reg_cuda(t, r, note, sizeof note);
        } else {
            rc = wx__reg_host(t, r);
            snprintf(note, sizeof note, "host memory");
        }
        if (rc) {
            free(r);
            return rc;
        }
        pthread_mutex_lock(&t->rlock);
        t->reg_calls++;
        snprintf(t->reg_last, sizeof t->reg_last, "%s", r->how);
        snprintf(t->reg_why, sizeof t->reg_why, "%s", note);
        r->next = t->regs;
        t->regs = r;
        pthread_mutex_unlock(&t->rlock);
    }
    mr->priv = r;
    mr->ldesc = r;
    mr->rbase = a; /* RDMA addresses are virtual addresses (iova == va) */
    mr->key = ((uint64_t)mr->id << 32) | r->mr[0]->rkey; /* unique per region; rkeys in blob */
    mr->blob_len = 4 + 4 * (uint32_t)t->nnic;
    mr->blob[0] = (uint8_t)t->nnic;
    mr->blob[1] = mr->blob[2] = mr->blob[3] = 0;
    for (int i = 0; i < t->nnic; i++) {
        uint32_t k = r->mr[i]->rkey;
        memcpy(mr->blob + 4 + 4 * i, &k, 4);
    }
    return 0;
}

void wx__verbs_dereg(wx_transport_t *tt, wx_mr_t *mr)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    wx__vreg_t *r = mr->priv, **pp;
    if (!r)
        return;
    pthread_mutex_lock(&t->rlock);
    if (--r->refs > 0) {
        pthread_mutex_unlock(&t->rlock);
        mr->priv = NULL;
        return;
    }
    for (pp = &t->regs; *pp && *pp != r; pp = &(*pp)->next)
        ;
    if (*pp)
        *pp = r->next;
    pthread_mutex_unlock(&t->rlock);
    /* Freed memory must not stay pinned under an old MR, so the last user deregisters. */
    wx__unreg(t, r);
    free(r);
    mr->priv = NULL;
}

uint32_t wx__verbs_lkey(const wx_mr_t *mr, int n)
{
    const wx__vreg_t *r = mr->priv;
    return r->mr[n]->lkey;
}
