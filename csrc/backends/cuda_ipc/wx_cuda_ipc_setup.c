/* wx_cuda_ipc_setup.c - the cuda_ipc backend: setup, registration, connection, and the table of
 * opened IPC handles. The data path is in wx_cuda_ipc_data.c; wx_cuda_ipc.h says how the
 * whole works. */
#include "wx_cuda_ipc.h"
#include "wx_param.h"

#include <ctype.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(wx__ci_addr_t) == 48, "cuda_ipc address layout");
_Static_assert(sizeof(wx__ci_blob_t) == 160, "cuda_ipc blob layout");
_Static_assert(sizeof(wx__ci_blob_t) <= WX_BLOB_MAX, "cuda_ipc blob too large");
_Static_assert(sizeof(CUipcMemHandle) == 64, "CUipcMemHandle size");

/* ---- this process ---------------------------------------------------------------------- */

static pthread_mutex_t wx__ci_proc_mu = PTHREAD_MUTEX_INITIALIZER;
static wx__ci_proc_t wx__ci_me;

static int wx__hexval(int ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    ch = tolower(ch);
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    return -1;
}

static void wx__ci_read_boot_id(uint8_t out[16])
{
    char buf[80];
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    int nib = 0;
    if (fd >= 0)
        close(fd);
    memset(out, 0, 16);
    for (ssize_t i = 0; i < n && nib < 32; i++) {
        int v = wx__hexval((unsigned char)buf[i]);
        if (v < 0)
            continue;
        out[nib / 2] |= (uint8_t)(nib % 2 ? v : v << 4);
        nib++;
    }
    if (nib == 32)
        return;
    /* No boot id: fall back to a hash of the host name (weaker, still rejects other hosts). */
    {
        char host[256] = "";
        uint64_t h1 = 1469598103934665603ull, h2 = 1099511628211ull;
        gethostname(host, sizeof host - 1);
        for (const char *s = host; *s; s++) {
            h1 = (h1 ^ (uint8_t)*s) * 1099511628211ull;
            h2 = (h2 ^ (uint8_t)*s) * 1469598103934665603ull;
        }
        memcpy(out, &h1, 8);
        memcpy(out + 8, &h2, 8);
    }
}

const wx__ci_proc_t *wx__ci_proc(void)
{
    pthread_mutex_lock(&wx__ci_proc_mu);
    if (wx__ci_me.pid != (uint32_t)getpid()) { /* first call, or a forked child */
        uint64_t nonce = 0;
        if (getrandom(&nonce, sizeof nonce, GRND_NONBLOCK) != (ssize_t)sizeof nonce)
            nonce = wx_now_ns() * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
        wx__ci_me.pid = (uint32_t)getpid();
        wx__ci_me.nonce = nonce | 1;
        wx__ci_read_boot_id(wx__ci_me.boot_id);
    }
    pthread_mutex_unlock(&wx__ci_proc_mu);
    return &wx__ci_me;
}

/* ---- contexts -------------------------------------------------------------------------- */

const char *wx__ci_errname(const wx__ci_t *c, CUresult r)
{
    const char *name = NULL;
    c->cu->cuGetErrorName(r, &name);
    return name ? name : "CUDA_ERROR_UNKNOWN";
}

int wx__ci_retain(wx__ci_t *c, int dev, CUcontext *out)
{
    CUdevice d;
    CUresult r;
    if (dev < 0 || dev >= WX_CI_DEV_MAX)
        return wx_errf(-EINVAL, "cuda_ipc: CUDA device ordinal %d out of range", dev);
    if (!c->pctx[dev]) {
        r = c->cu->cuDeviceGet(&d, dev);
        if (r != CUDA_SUCCESS)
            return wx_errf(-ENODEV, "cuda_ipc: cuDeviceGet(%d) failed: %s", dev,
                           wx__ci_errname(c, r));
        r = c->cu->cuDevicePrimaryCtxRetain(&c->pctx[dev], d);
        if (r != CUDA_SUCCESS) {
            c->pctx[dev] = NULL;
            return wx_errf(-EIO, "cuda_ipc: cuDevicePrimaryCtxRetain(cuda:%d) failed: %s", dev,
                           wx__ci_errname(c, r));
        }
    }
    *out = c->pctx[dev];
    return 0;
}

int wx__ci_push(wx__ci_t *c, CUcontext ctx, CUcontext *saved)
{
    CUresult r;
    *saved = NULL;
    c->cu->cuCtxGetCurrent(saved);
    if (*saved == ctx)
        return 0;
    r = c->cu->cuCtxSetCurrent(ctx);
    if (r != CUDA_SUCCESS)
        return wx_errf(-EIO, "cuda_ipc: cuCtxSetCurrent failed: %s", wx__ci_errname(c, r));
    return 0;
}

void wx__ci_pop(wx__ci_t *c, CUcontext saved)
{
    CUcontext cur = NULL;
    c->cu->cuCtxGetCurrent(&cur);
    if (cur != saved)
        c->cu->cuCtxSetCurrent(saved);
}

void wx__ci_dev_ids(wx__ci_t *c, int dev, uint8_t uuid[16], char pci[16])
{
    CUdevice d;
    memset(uuid, 0, 16);
    memset(pci, 0, 16);
    if (c->cu->cuDeviceGet(&d, dev) != CUDA_SUCCESS)
        return;
    if (c->cu->cuDeviceGetUuid) {
        CUuuid u;
        if (c->cu->cuDeviceGetUuid(&u, d) == CUDA_SUCCESS)
            memcpy(uuid, u.bytes, 16);
    }
    c->cu->cuDeviceGetPCIBusId(pci, 16, d);
    pci[15] = '\0';
}

/* Ordinal in this process of the GPU with this UUID / PCI bus id, or -1. */
int wx__ci_find_dev(wx__ci_t *c, const uint8_t uuid[16], const char *pci)
{
    static const uint8_t zero[16];
    int n = 0;
    c->cu->cuDeviceGetCount(&n);
    for (int i = 0; i < n && i < WX_CI_DEV_MAX; i++) {
        uint8_t u[16];
        char b[16];
        wx__ci_dev_ids(c, i, u, b);
        if (memcmp(uuid, zero, 16) != 0 && memcmp(u, zero, 16) != 0) {
            if (memcmp(u, uuid, 16) == 0)
                return i;
        } else if (pci[0] && strncasecmp(b, pci, 16) == 0) {
            return i;
        }
    }
    return -1;
}

/* ---- probe / open / close -------------------------------------------------------------- */

static int wx__ci_probe(const wx_opts_t *opts, char *why, size_t why_len)
{
    const wx_cuda_api_t *cu = wx_cuda(why, why_len);
    int n = 0;
    CUresult r;
    WX_UNUSED(opts);
    if (!cu)
        return -ENODEV;
    r = cu->cuDeviceGetCount(&n);
    if (r != CUDA_SUCCESS || n == 0) {
        const char *vis = wx_param_str(WX_P_CUDA_VISIBLE_DEVICES);
        snprintf(why, why_len,
                 "no CUDA device visible (cuDeviceGetCount: %d devices, status %d, "
                 "CUDA_VISIBLE_DEVICES=%s)",
                 n, (int)r, vis ? vis : "<unset>");
        return -ENODEV;
    }
    return 0;
}

static const char *const wx__ci_known[] = {"device",
                                           "streams",
                                           "max_write",
                                           "max_inflight",
                                           "split",
                                           "map",
                                           "peer_access",
                                           "ipc_lazy",
                                           "poll_us",
                                           "pick",
#ifdef WX_TESTING /* fault injection: test builds only (WXFER_TESTING=1) */
                                           "_test_refuse_peer",
                                           "_test_late_peer",
                                           "_test_late_ms",
#endif
                                           NULL};

static int wx__ci_opt_bool(const wx_opts_t *o, const char *key, int dflt, int *out)
{
    const char *s = wx_opt_str(o, key, NULL);
    if (!s) {
        *out = dflt;
        return 0;
    }
    if (!strcmp(s, "1") || !strcasecmp(s, "true") || !strcasecmp(s, "on")) {
        *out = 1;
        return 0;
    }
    if (!strcmp(s, "0") || !strcasecmp(s, "false") || !strcasecmp(s, "off")) {
        *out = 0;
        return 0;
    }
    return wx_errf(-EINVAL, "transport cuda_ipc: option %s=%s: expected 0 or 1", key, s);
}

/* The options open() reads into c (each range or choice checked, the option named). */
static int wx__ci_parse(wx__ci_t *c, const wx_opts_t *opts)
{
    const char *s;
    uint64_t v;
    int rc;
    c->opt_device = -1;
    s = wx_opt_str(opts, "device", NULL);
    if (s && strcmp(s, "auto") != 0) {
        char *end;
        long d = strtol(s, &end, 10);
        if (!strncmp(s, "cuda:", 5))
            d = strtol(s + 5, &end, 10);
        if (*end || d < 0 || d >= WX_CI_DEV_MAX)
            return wx_errf(-EINVAL,
                           "transport cuda_ipc: option device=%s: expected an ordinal "
                           "like 0 or cuda:1",
                           s);
        c->opt_device = (int)d;
    }
    if ((rc = wx_opt_u64(opts, "streams", 4, &v)) != 0)
        return rc;
    if (v < 1 || v > WX_CI_STREAMS_MAX) {
        rc = wx_errf(-EINVAL, "transport cuda_ipc: streams=%llu: expected 1..%d",
                     (unsigned long long)v, WX_CI_STREAMS_MAX);
        return rc;
    }
    c->nstreams = (uint32_t)v;
    if ((rc = wx_opt_u64(opts, "max_write", 1ull << 30, &c->base.max_write)) != 0)
        return rc;
    if (c->base.max_write < 4096) {
        rc = wx_errf(-EINVAL, "transport cuda_ipc: max_write must be at least 4096");
        return rc;
    }
    if ((rc = wx_opt_u64(opts, "max_inflight", WX_CI_INFLIGHT, &v)) != 0)
        return rc;
    if (v < 1 || v > 4096) {
        rc = wx_errf(-EINVAL, "transport cuda_ipc: max_inflight=%llu: expected 1..4096",
                     (unsigned long long)v);
        return rc;
    }
    c->base.max_inflight = (uint32_t)v;
    if ((rc = wx_opt_u64(opts, "split", 0, &c->split)) != 0)
        return rc;
    s = wx_opt_str(opts, "map", "writer");
    if (strcmp(s, "writer") && strcmp(s, "owner")) {
        rc = wx_errf(-EINVAL, "transport cuda_ipc: map=%s: expected writer or owner", s);
        return rc;
    }
    c->map_owner = !strcmp(s, "owner");
    /* Off by default: measured no faster (the IPC lazy flag maps the memory for our GPU
     * already), and it would create a context on the target's GPU in this process. */
    if ((rc = wx__ci_opt_bool(opts, "peer_access", 0, &c->peer_access)) != 0)
        return rc;
    if ((rc = wx__ci_opt_bool(opts, "ipc_lazy", 1, &c->ipc_lazy)) != 0)
        return rc;
    if ((rc = wx_opt_u64(opts, "poll_us", WX_CI_POLL_US, &v)) != 0)
        return rc;
    if (v > 10000) {
        rc = wx_errf(-EINVAL, "transport cuda_ipc: poll_us=%llu: expected 0..10000",
                     (unsigned long long)v);
        return rc;
    }
    c->poll_us = (uint32_t)v;
    s = wx_opt_str(opts, "pick", "least");
    if (strcmp(s, "rr") && strcmp(s, "least")) {
        rc = wx_errf(-EINVAL, "transport cuda_ipc: pick=%s: expected rr or least", s);
        return rc;
    }
    c->pick_least = !strcmp(s, "least");
    c->test_refuse_peer = c->test_late_peer = UINT64_MAX;
#ifdef WX_TESTING
    if ((rc = wx_opt_u64(opts, "_test_refuse_peer", UINT64_MAX, &c->test_refuse_peer)) != 0 ||
        (rc = wx_opt_u64(opts, "_test_late_peer", UINT64_MAX, &c->test_late_peer)) != 0 ||
        (rc = wx_opt_u64(opts, "_test_late_ms", 0, &v)) != 0)
        return rc;
    c->test_late_ns = v * 1000000ull;
#endif
    return 0;
}

static int wx__ci_open(const wx_opts_t *opts, wx_transport_t **out)
{
    wx__ci_t *c;
    int rc;
    pthread_condattr_t ca;

    c = calloc(1, sizeof *c);
    if (!c)
        return wx_errf(-ENOMEM, "cuda_ipc: out of memory");
    c->cu = wx_cuda(NULL, 0);
    if ((rc = wx__ci_parse(c, opts)) != 0)
        goto fail;
    c->base.needs_local_reg = 0;
    c->base.key_is_backend = 0;
    if (getrandom(&c->t_nonce, sizeof c->t_nonce, GRND_NONBLOCK) != (ssize_t)sizeof c->t_nonce)
        c->t_nonce = wx_now_ns() ^ ((uint64_t)(uintptr_t)c << 16);
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    c->dev = -1;
    c->free_head = -1;
    wx__ci_proc();
    *out = &c->base;
    return 0;
fail:
    free(c);
    return rc;
}

static void wx__ci_close(wx_transport_t *t)
{
    wx__ci_t *c = (wx__ci_t *)t;
    wx__ci_io_stop(c);
    pthread_mutex_lock(&c->mu);
    wx__ci_maps_close(c);
    for (int i = 0; i < WX_CI_DEV_MAX; i++)
        if (c->pctx[i]) {
            CUdevice d;
            if (c->cu->cuDeviceGet(&d, i) == CUDA_SUCCESS)
                c->cu->cuDevicePrimaryCtxRelease(d);
            c->pctx[i] = NULL;
        }
    pthread_mutex_unlock(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* Writer side: pick the GPU, retain its primary context, start streams and the thread. */
int wx__ci_start(wx__ci_t *c)
{
    int dev = c->opt_device, rc;
    CUcontext cur = NULL;
    if (c->started)
        return 0;
    if (c->closing)
        return wx_errf(-ESHUTDOWN, "cuda_ipc: transport is closing");
    if (dev < 0) {
        CUdevice d;
        dev = 0;
        if (c->cu->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur &&
            c->cu->cuCtxGetDevice(&d) == CUDA_SUCCESS)
            dev = (int)d;
    }
    rc = wx__ci_retain(c, dev, &c->ctx);
    if (rc)
        return rc;
    c->dev = dev;
    {
        CUdevice d;
        uint8_t uuid[16];
        c->cu->cuDeviceGet(&d, dev);
        c->cu->cuDeviceGetName(c->devname, sizeof c->devname, d);
        wx__ci_dev_ids(c, dev, uuid, c->pci);
    }
    rc = wx__ci_io_start(c);
    if (rc)
        return rc;
    c->started = 1;
    wx_debugf("cuda_ipc: writer started on cuda:%d (%s, %s), %u streams", dev, c->devname, c->pci,
              c->nstreams);
    return 0;
}

/* ---- address / registration ------------------------------------------------------------ */

static int wx__ci_address(wx_transport_t *t, uint8_t *buf, size_t *len)
{
    wx__ci_t *c = (wx__ci_t *)t;
    const wx__ci_proc_t *me = wx__ci_proc();
    wx__ci_addr_t a;
    if (*len < sizeof a)
        return wx_errf(-ENOSPC, "cuda_ipc: address buffer too small");
    memset(&a, 0, sizeof a);
    memcpy(a.magic, WX_CI_ADDR_MAGIC, 4);
    a.version = WX_CI_VERSION;
    a.pid = me->pid;
    memcpy(a.boot_id, me->boot_id, 16);
    a.proc_nonce = me->nonce;
    a.t_nonce = c->t_nonce;
    memcpy(buf, &a, sizeof a);
    *len = sizeof a;
    return 0;
}

static int wx__ci_vmm_refusal(wx__ci_t *c, const wx_mr_t *mr, CUresult r)
{
    CUmemGenericAllocationHandle h;
    if (c->cu->cuMemRetainAllocationHandle &&
        c->cu->cuMemRetainAllocationHandle(&h, mr->addr) == CUDA_SUCCESS) {
        if (c->cu->cuMemRelease)
            c->cu->cuMemRelease(h);
        return wx_errf(-ENOTSUP,
                       "cuda_ipc: cannot export %p (%llu bytes on cuda:%d): it was allocated "
                       "with the CUDA virtual memory API (cuMemCreate/cuMemMap), as PyTorch "
                       "does with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and "
                       "cuIpcGetMemHandle refuses such memory (%s). Start the receiving "
                       "process without expandable_segments in PYTORCH_CUDA_ALLOC_CONF (or "
                       "allocate the weights with cudaMalloc)",
                       mr->addr, (unsigned long long)mr->len, mr->device, wx__ci_errname(c, r));
    }
    return wx_errf(-EIO, "cuda_ipc: cuIpcGetMemHandle(%p on cuda:%d) failed: %s", mr->addr,
                   mr->device, wx__ci_errname(c, r));
}

static int wx__ci_reg(wx_transport_t *t, wx_mr_t *mr)
{
    wx__ci_t *c = (wx__ci_t *)t;
    const wx__ci_proc_t *me = wx__ci_proc();
    CUcontext ctx, saved;
    CUdeviceptr base = 0;
    size_t size = 0;
    CUipcMemHandle h;
    wx__ci_blob_t b;
    CUresult r;
    int rc;

    mr->rbase = (uint64_t)(uintptr_t)mr->addr;
    mr->blob_len = 0;
    if (mr->mem != WX_MEM_CUDA) {
        if (mr->exported)
            return wx_errf(-ENOTSUP,
                           "cuda_ipc exports only CUDA device memory; %p (%llu bytes) "
                           "is host memory (use the fabric transport for host buffers)",
                           mr->addr, (unsigned long long)mr->len);
        return 0; /* a host source of H2D writes: nothing to prepare */
    }
    if (!mr->exported)
        return 0; /* a CUDA source: copies read it directly */
    pthread_mutex_lock(&c->mu);
    rc = wx__ci_retain(c, mr->device, &ctx);
    if (!rc)
        rc = wx__ci_push(c, ctx, &saved);
    if (rc) {
        pthread_mutex_unlock(&c->mu);
        return rc;
    }
    r = c->cu->cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)mr->addr);
    if (r != CUDA_SUCCESS) {
        rc = wx_errf(-EINVAL,
                     "cuda_ipc: cuMemGetAddressRange(%p) failed: %s (is it memory of "
                     "cuda:%d?)",
                     mr->addr, wx__ci_errname(c, r), mr->device);
        goto out;
    }
    if ((uint64_t)(uintptr_t)mr->addr + mr->len > (uint64_t)base + size) {
        rc = wx_errf(-EINVAL,
                     "cuda_ipc: region %p +%llu spans more than one CUDA allocation "
                     "(the allocation at 0x%llx holds %zu bytes); register it in pieces",
                     mr->addr, (unsigned long long)mr->len, (unsigned long long)base, size);
        goto out;
    }
    r = c->cu->cuIpcGetMemHandle(&h, base);
    if (r != CUDA_SUCCESS) {
        rc = wx__ci_vmm_refusal(c, mr, r);
        goto out;
    }
    memset(&b, 0, sizeof b);
    memcpy(b.magic, WX_CI_BLOB_MAGIC, 4);
    b.version = WX_CI_VERSION;
    memcpy(b.handle, h.reserved, 64);
    b.alloc_base = (uint64_t)base;
    b.alloc_size = (uint64_t)size;
    b.offset = (uint64_t)(uintptr_t)mr->addr - (uint64_t)base;
    b.proc_nonce = me->nonce;
    memcpy(b.boot_id, me->boot_id, 16);
    wx__ci_dev_ids(c, mr->device, b.uuid, b.pci);
    b.pid = me->pid;
    b.device = mr->device;
    memcpy(mr->blob, &b, sizeof b);
    mr->blob_len = sizeof b;
    wx_debugf("cuda_ipc: exported %p +%llu (allocation 0x%llx +%zu, offset %llu) on cuda:%d",
              mr->addr, (unsigned long long)mr->len, (unsigned long long)base, size,
              (unsigned long long)b.offset, mr->device);
out:
    wx__ci_pop(c, saved);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void wx__ci_dereg(wx_transport_t *t, wx_mr_t *mr)
{
    /* An IPC handle needs no release on the exporting side; writers that opened it keep
     * the allocation mapped until they close (the memory itself is the caller's). */
    WX_UNUSED(t);
    mr->priv = NULL;
}

/* ---- connection ------------------------------------------------------------------------ */

static int wx__ci_peer_addr(const wx_peer_t *p, wx__ci_addr_t *a)
{
    if (p->addr_len != sizeof *a)
        return wx_errf(-EPROTO, "cuda_ipc: %s has a %u-byte address, not a cuda_ipc address",
                       p->name, p->addr_len);
    memcpy(a, p->addr, sizeof *a);
    if (memcmp(a->magic, WX_CI_ADDR_MAGIC, 4) != 0 || a->version != WX_CI_VERSION)
        return wx_errf(-EPROTO, "cuda_ipc: %s: address is not a cuda_ipc v%d address", p->name,
                       WX_CI_VERSION);
    return 0;
}

static int wx__ci_conn_request(wx_transport_t *t, wx_peer_t *p, uint8_t *req, size_t *req_len)
{
    const wx__ci_proc_t *me = wx__ci_proc();
    wx__ci_addr_t a;
    int rc = wx__ci_peer_addr(p, &a);
    WX_UNUSED(t);
    WX_UNUSED(req);
    if (rc)
        return rc;
    snprintf(p->name, sizeof p->name, "peer %u (cuda_ipc pid %u)", p->id, a.pid);
    if (memcmp(a.boot_id, me->boot_id, 16) != 0)
        return wx_errf(-EXDEV,
                       "cuda_ipc: %s runs on another machine or boot (its boot id "
                       "differs from this one's): CUDA IPC only connects processes of one "
                       "node; use the verbs or fabric transport",
                       p->name);
    *req_len = 0; /* no handshake: the export blob holds everything */
    return 0;
}

/* Open every allocation the peer exported now, so that writes never open handles. */
static int wx__ci_conn_finish(wx_transport_t *t, wx_peer_t *p, const uint8_t *rep, size_t rep_len)
{
    wx__ci_t *c = (wx__ci_t *)t;
    int rc;
    WX_UNUSED(rep);
    if (rep_len)
        return wx_errf(-EPROTO, "cuda_ipc: %s sent a %zu-byte reply; cuda_ipc expects none",
                       p->name, rep_len);
    pthread_mutex_lock(&c->mu);
    rc = wx__ci_start(c);
    for (uint32_t i = 0; !rc && i < p->nregions; i++) {
        wx__ci_map_t *m;
        uint64_t off;
        rc = wx__ci_map_get(c, p, &p->regions[i], &m, &off);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void wx__ci_disconnect(wx_transport_t *t, wx_peer_t *p)
{
    /* Mappings are shared by every peer of the same owner process and kept until close. */
    WX_UNUSED(t);
    WX_UNUSED(p);
}

static int wx__ci_info(wx_transport_t *t, char *buf, size_t len)
{
    wx__ci_t *c = (wx__ci_t *)t;
    int n;
    pthread_mutex_lock(&c->mu);
    if (!c->started)
        n = snprintf(buf, len,
                     "cuda_ipc: writer not started (device=%s), streams=%u, "
                     "max_write=%llu, max_inflight=%u",
                     c->opt_device < 0 ? "auto" : "fixed", c->nstreams,
                     (unsigned long long)c->base.max_write, c->base.max_inflight);
    else
        n = snprintf(buf, len,
                     "cuda_ipc: writer on cuda:%d (%s, %s), streams=%u, split=%llu, "
                     "map=%s, peer_access=%d, ipc_lazy=%d, poll_us=%u, pick=%s, maps=%u, "
                     "writes=%llu, bytes=%llu, errors=%llu, inflight=%u",
                     c->dev, c->devname, c->pci, c->nstreams, (unsigned long long)c->split,
                     c->map_owner ? "owner" : "writer", c->peer_access, c->ipc_lazy, c->poll_us,
                     c->pick_least ? "least" : "rr", c->nmaps, (unsigned long long)c->nwrites,
                     (unsigned long long)c->nbytes, (unsigned long long)c->nerrors, c->ninflight);
    pthread_mutex_unlock(&c->mu);
    return n < 0 ? -EIO : 0;
}

const wx_transport_ops_t wx_cuda_ipc_ops = {
    .name = "cuda_ipc",
    .kind = WX_KIND_CUDA_IPC,
    /* a write into a peer's mapped memory succeeds whether or not its process is there */
    .caps = WX_CAP_CUDA_MEM | WX_CAP_SAME_HOST,
    .auto_host = 0,
    .auto_cuda = 1,
    .options = wx__ci_known,
    WX_TRANSPORT_OPS(ci),
    .conn_accept = wx_no_handshake,
    .map = wx__ci_map,
};
