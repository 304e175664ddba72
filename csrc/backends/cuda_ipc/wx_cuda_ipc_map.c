/* wx_cuda_ipc_map.c - opening the IPC handles that peers exported, once per allocation.
 *
 * The table of opened allocations is process-wide: CUDA refuses to open one handle twice in
 * one context, and two transports of one process (or two regions of one allocation) must
 * share the mapping. Each transport keeps its own hash of references to the entries it
 * uses, so the write path takes the global lock only the first time it meets an allocation.
 * An entry is closed (cuIpcCloseMemHandle) when the last transport that used it closes.
 */
#include "wx_cuda_ipc.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t wx__ci_gmu = PTHREAD_MUTEX_INITIALIZER;
static wx__ci_map_t *wx__ci_gmaps[WX_CI_BUCKETS];

static uint32_t wx__ci_hash(uint32_t pid, uint64_t nonce, uint64_t base)
{
    uint64_t h = (uint64_t)pid * 0x9e3779b97f4a7c15ull ^ nonce ^ (base >> 21) ^ (base >> 12);
    h ^= h >> 29;
    return (uint32_t)(h % WX_CI_BUCKETS);
}

static int wx__ci_same(const wx__ci_map_t *m, const wx__ci_blob_t *b)
{
    return m->pid == b->pid && m->proc_nonce == b->proc_nonce && m->alloc_base == b->alloc_base &&
           memcmp(m->handle, b->handle, 64) == 0;
}

/* Enable peer access from the writer's context to GPU `od` (explicit; best effort). */
static void wx__ci_enable_peer(wx__ci_t *c, int od)
{
    CUdevice me, other;
    CUcontext octx, saved;
    CUresult r;
    int can = 0;
    if (od < 0 || od >= WX_CI_DEV_MAX || c->peer_on[od])
        return;
    c->peer_on[od] = 2; /* tried */
    if (c->cu->cuDeviceGet(&me, c->dev) != CUDA_SUCCESS ||
        c->cu->cuDeviceGet(&other, od) != CUDA_SUCCESS)
        return;
    r = c->cu->cuDeviceCanAccessPeer(&can, me, other);
    if (r != CUDA_SUCCESS || !can) {
        wx_debugf("cuda_ipc: cuda:%d cannot access cuda:%d as a peer (%s); copies go through "
                  "whatever path the driver picks",
                  c->dev, od,
                  r == CUDA_SUCCESS ? "cuDeviceCanAccessPeer says no" : wx__ci_errname(c, r));
        return;
    }
    if (wx__ci_retain(c, od, &octx) || wx__ci_push(c, c->ctx, &saved))
        return;
    r = c->cu->cuCtxEnablePeerAccess(octx, 0);
    wx__ci_pop(c, saved);
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
        c->peer_on[od] = 1;
    else
        wx_debugf("cuda_ipc: cuCtxEnablePeerAccess(cuda:%d -> cuda:%d) failed: %s", c->dev, od,
                  wx__ci_errname(c, r));
}

static CUresult wx__ci_open_in(wx__ci_t *c, CUcontext ctx, const wx__ci_blob_t *b, CUdeviceptr *d)
{
    CUipcMemHandle h;
    CUcontext saved;
    CUresult r;
    memcpy(h.reserved, b->handle, 64);
    if (wx__ci_push(c, ctx, &saved))
        return CUDA_ERROR_INVALID_CONTEXT;
    r = c->cu->cuIpcOpenMemHandle(d, h, c->ipc_lazy ? CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS : 0);
    wx__ci_pop(c, saved);
    return r;
}

/* Open the allocation described by `b` (global lock held). */
/* The error of a failed cuIpcOpenMemHandle of b (r in the writer's context; r2, when not
 * CUDA_SUCCESS, in the owner GPU's, cuda:local_dev), naming the region, the allocation, its
 * owner and the likely cause. */
static int wx__ci_open_failed(const wx__ci_t *c, const wx_peer_t *p, const wx_rinfo_t *ri,
                              const wx__ci_blob_t *b, CUresult r, CUresult r2, int local_dev)
{
    int gone = kill((pid_t)b->pid, 0) != 0 && errno == ESRCH;
    char also[128] = "";
    if (r2 != CUDA_SUCCESS)
        snprintf(also, sizeof also, " in cuda:%d's context, %s in the owner GPU's (cuda:%d)",
                 c->dev, wx__ci_errname(c, r2), local_dev);
    int rc = wx_errf(gone ? -ESTALE : -EIO,
                     "cuda_ipc: %s: cannot open the CUDA IPC handle of region key 0x%llx "
                     "(allocation 0x%llx, %llu bytes on GPU %s, cuda:%d of pid %u): "
                     "cuIpcOpenMemHandle failed: %s%s%s",
                     p->name, (unsigned long long)ri->key, (unsigned long long)b->alloc_base,
                     (unsigned long long)b->alloc_size, b->pci, b->device, b->pid,
                     wx__ci_errname(c, r), also,
                     gone ? "; the owner process no longer exists, so the handle is stale "
                            "(get a fresh export from the running receiver)"
                     : !c->ipc_lazy ? "; option ipc_lazy=0 is set, and on the machines "
                                      "measured the open fails without the lazy flag"
                                    : "; the owner may have freed the memory or exited");
    return rc;
}

static int wx__ci_open_map(wx__ci_t *c, const wx_peer_t *p, const wx_rinfo_t *ri,
                           const wx__ci_blob_t *b, wx__ci_map_t **out)
{
    const wx__ci_proc_t *me = wx__ci_proc();
    wx__ci_map_t *m = calloc(1, sizeof *m);
    CUcontext ctx = c->ctx, octx, keep;
    CUresult r = CUDA_SUCCESS, r2;
    CUdevice cd;
    int ctx_dev = c->dev;
    if (!m)
        return wx_errf(-ENOMEM, "cuda_ipc: out of memory");
    m->pid = b->pid;
    m->proc_nonce = b->proc_nonce;
    m->alloc_base = b->alloc_base;
    memcpy(m->handle, b->handle, 64);
    m->size = b->alloc_size;
    m->local_dev = wx__ci_find_dev(c, b->uuid, b->pci);
    if (b->pid == me->pid && b->proc_nonce == me->nonce) {
        /* The owner is this process: its pointer is valid here (loopback). */
        m->self = 1;
        m->dptr = (CUdeviceptr)b->alloc_base;
        if (c->peer_access && m->local_dev >= 0 && m->local_dev != c->dev)
            wx__ci_enable_peer(c, m->local_dev);
        *out = m;
        return 0;
    }
    if (c->peer_access && m->local_dev >= 0 && m->local_dev != c->dev)
        wx__ci_enable_peer(c, m->local_dev);
    if (c->map_owner && m->local_dev >= 0 && m->local_dev != c->dev) {
        int rc = wx__ci_retain(c, m->local_dev, &ctx);
        if (rc) {
            free(m);
            return rc;
        }
        ctx_dev = m->local_dev;
    }
    r = wx__ci_open_in(c, ctx, b, &m->dptr);
    r2 = CUDA_SUCCESS;
    if (r != CUDA_SUCCESS && ctx == c->ctx && m->local_dev >= 0 && m->local_dev != c->dev &&
        wx__ci_retain(c, m->local_dev, &octx) == 0) {
        /* The writer's GPU cannot map it (no peer path): map it in the owner GPU's context
         * here; copies then go through cuMemcpyPeerAsync, staged by the driver. */
        r2 = wx__ci_open_in(c, octx, b, &m->dptr);
        if (r2 == CUDA_SUCCESS) {
            wx_debugf("cuda_ipc: %s: cuIpcOpenMemHandle in cuda:%d failed (%s); opened in "
                      "cuda:%d's context instead (slower path)",
                      p->name, c->dev, wx__ci_errname(c, r), m->local_dev);
            ctx = octx;
            ctx_dev = m->local_dev;
            m->fallback = 1;
            r = CUDA_SUCCESS;
        }
    }
    if (r != CUDA_SUCCESS) {
        int rc = wx__ci_open_failed(c, p, ri, b, r, r2, m->local_dev);
        free(m);
        return rc;
    }
    /* The mapping holds its own reference on the context, since the transport that opened
     * it may close before another one that shares it. */
    if (c->cu->cuDeviceGet(&cd, ctx_dev) == CUDA_SUCCESS &&
        c->cu->cuDevicePrimaryCtxRetain(&keep, cd) == CUDA_SUCCESS)
        m->ctx_dev = ctx_dev;
    else
        m->ctx_dev = -1;
    m->ctx = ctx;
    wx_debugf("cuda_ipc: %s: opened allocation 0x%llx +%llu of pid %u at 0x%llx (cuda:%d ctx)",
              p->name, (unsigned long long)b->alloc_base, (unsigned long long)b->alloc_size, b->pid,
              (unsigned long long)m->dptr, ctx == c->ctx ? c->dev : m->local_dev);
    *out = m;
    return 0;
}

int wx__ci_map_get(wx__ci_t *c, const wx_peer_t *p, const wx_rinfo_t *ri, wx__ci_map_t **out,
                   uint64_t *offset)
{
    const wx__ci_proc_t *me = wx__ci_proc();
    wx__ci_blob_t b;
    wx__ci_ref_t *ref;
    wx__ci_map_t *m;
    uint32_t h;
    int rc;

    if (ri->mem != WX_MEM_CUDA || ri->blob_len != sizeof b)
        return wx_errf(-EPROTO,
                       "cuda_ipc: %s: region key 0x%llx carries no CUDA IPC handle "
                       "(mem %u, %u-byte blob)",
                       p->name, (unsigned long long)ri->key, ri->mem, ri->blob_len);
    memcpy(&b, ri->blob, sizeof b);
    if (memcmp(b.magic, WX_CI_BLOB_MAGIC, 4) != 0 || b.version != WX_CI_VERSION)
        return wx_errf(-EPROTO,
                       "cuda_ipc: %s: region key 0x%llx: blob is not a cuda_ipc v%d "
                       "handle",
                       p->name, (unsigned long long)ri->key, WX_CI_VERSION);
    if (memcmp(b.boot_id, me->boot_id, 16) != 0)
        return wx_errf(-EXDEV,
                       "cuda_ipc: %s: region key 0x%llx was exported on another "
                       "machine or boot (boot id differs): a foreign CUDA IPC handle cannot be "
                       "opened here",
                       p->name, (unsigned long long)ri->key);
    if (b.offset > b.alloc_size || ri->len > b.alloc_size - b.offset)
        return wx_errf(-EPROTO,
                       "cuda_ipc: %s: region key 0x%llx: offset %llu + %llu bytes lies "
                       "outside its %llu-byte allocation",
                       p->name, (unsigned long long)ri->key, (unsigned long long)b.offset,
                       (unsigned long long)ri->len, (unsigned long long)b.alloc_size);
    h = wx__ci_hash(b.pid, b.proc_nonce, b.alloc_base);
    for (ref = c->buckets[h]; ref; ref = ref->next)
        if (wx__ci_same(ref->m, &b)) {
            *out = ref->m;
            *offset = b.offset;
            return 0;
        }
    ref = calloc(1, sizeof *ref);
    if (!ref)
        return wx_errf(-ENOMEM, "cuda_ipc: out of memory");
    /* The same allocation may be open in another context of this process (a transport of
     * another GPU, or map=owner); share an entry only where this transport would open it,
     * or where that open had to fall back to the owner GPU's context. */
    pthread_mutex_lock(&wx__ci_gmu);
    for (m = wx__ci_gmaps[h]; m; m = m->next)
        if (wx__ci_same(m, &b) &&
            (m->self || m->ctx == c->ctx ||
             (m->local_dev >= 0 && m->ctx_dev == m->local_dev && (c->map_owner || m->fallback))))
            break;
    if (!m) {
        rc = wx__ci_open_map(c, p, ri, &b, &m);
        if (rc) {
            pthread_mutex_unlock(&wx__ci_gmu);
            free(ref);
            return rc;
        }
        m->next = wx__ci_gmaps[h];
        wx__ci_gmaps[h] = m;
    }
    m->refs++;
    pthread_mutex_unlock(&wx__ci_gmu);
    ref->m = m;
    ref->next = c->buckets[h];
    c->buckets[h] = ref;
    c->nmaps++;
    *out = m;
    *offset = b.offset;
    return 0;
}

int wx__ci_map(wx_transport_t *t, wx_peer_t *p, const wx_rinfo_t *ri, uint64_t roff, uint64_t len,
               uint64_t *addr, int32_t *device)
{
    wx__ci_t *c = (wx__ci_t *)t;
    wx__ci_map_t *m;
    uint64_t off;
    int rc;
    pthread_mutex_lock(&c->mu);
    if (c->closing) {
        rc = wx_errf(-ESHUTDOWN, "cuda_ipc: mapping a region of %s after close", p->name);
        goto out;
    }
    if ((rc = wx__ci_start(c)) != 0 || (rc = wx__ci_map_get(c, p, ri, &m, &off)) != 0)
        goto out;
    if (off + roff + len > m->size) {
        rc = wx_errf(-ERANGE,
                     "cuda_ipc: %s: region key 0x%llx at %llu +%llu passes the end of its "
                     "%llu-byte allocation",
                     p->name, (unsigned long long)ri->key, (unsigned long long)(off + roff),
                     (unsigned long long)len, (unsigned long long)m->size);
        goto out;
    }
    if (m->local_dev != c->dev) {
        char where[32];
        if (m->local_dev >= 0)
            snprintf(where, sizeof where, "cuda:%d here", m->local_dev);
        else
            snprintf(where, sizeof where, "a GPU not visible here");
        rc = wx_errf(-EXDEV,
                     "cuda_ipc: %s: region key 0x%llx lies on %s (cuda:%d of pid %u), not on "
                     "this transport's writer GPU cuda:%d: only memory on the writer's own GPU "
                     "is mapped for direct writes (the others are written by copies)",
                     p->name, (unsigned long long)ri->key, where, ri->device, m->pid, c->dev);
        goto out;
    }
    if (!m->self && m->ctx != c->ctx) {
        rc = wx_errf(-EXDEV,
                     "cuda_ipc: %s: region key 0x%llx is open in another context than the "
                     "writer's (cuda:%d, %s): not mapped for direct writes",
                     p->name, (unsigned long long)ri->key, m->ctx_dev,
                     m->fallback ? "the fallback" : "map=owner");
        goto out;
    }
    *addr = (uint64_t)m->dptr + off + roff;
    *device = c->dev;
out:
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void wx__ci_maps_close(wx__ci_t *c)
{
    pthread_mutex_lock(&wx__ci_gmu);
    for (uint32_t i = 0; i < WX_CI_BUCKETS; i++) {
        wx__ci_ref_t *ref, *rnext;
        for (ref = c->buckets[i]; ref; ref = rnext) {
            wx__ci_map_t *m = ref->m, **pp;
            rnext = ref->next;
            free(ref);
            if (--m->refs)
                continue;
            for (pp = &wx__ci_gmaps[i]; *pp && *pp != m; pp = &(*pp)->next)
                ;
            if (*pp)
                *pp = m->next;
            if (!m->self) {
                CUcontext saved;
                if (wx__ci_push(c, m->ctx, &saved) == 0) {
                    CUresult r = c->cu->cuIpcCloseMemHandle(m->dptr);
                    if (r != CUDA_SUCCESS)
                        wx_debugf("cuda_ipc: cuIpcCloseMemHandle(0x%llx) failed: %s",
                                  (unsigned long long)m->dptr, wx__ci_errname(c, r));
                    wx__ci_pop(c, saved);
                }
                if (m->ctx_dev >= 0) {
                    CUdevice d;
                    if (c->cu->cuDeviceGet(&d, m->ctx_dev) == CUDA_SUCCESS)
                        c->cu->cuDevicePrimaryCtxRelease(d);
                }
            }
            free(m);
        }
        c->buckets[i] = NULL;
    }
    c->nmaps = 0;
    pthread_mutex_unlock(&wx__ci_gmu);
}
