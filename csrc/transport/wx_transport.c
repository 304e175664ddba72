/* wx_transport.c - the generic layer every backend shares: registrations, peers, export
 * blobs, and the checks that every write passes before a backend sees it. */
#include "wx_transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "wx_desc.h"
#include "wx_dl.h"

/* Backends are referenced weakly: the extension links every one, but a C program that links
 * only some (tests/c: fabric_pair, test_verbs) leaves the others' ops undefined, and their
 * entries NULL. */
#define WX__WEAK __attribute__((weak))
#define WX_BACKEND(name, NAME, kind, needs)                                                        \
    extern const wx_transport_ops_t wx_##name##_ops WX__WEAK;
#include "wx_backends.def"
#undef WX_BACKEND

static const struct {
    const char *name;
    const wx_transport_ops_t *ops;
} wx__backends[] = {
#define WX_BACKEND(name, NAME, kind, needs) {#name, &wx_##name##_ops},
#include "wx_backends.def"
#undef WX_BACKEND
};

int wx_transport_backend(int i, const char **name, const wx_transport_ops_t **ops)
{
    if (i < 0 || (size_t)i >= sizeof wx__backends / sizeof wx__backends[0])
        return -ENOENT;
    *name = wx__backends[i].name;
    *ops = wx__backends[i].ops;
    return 0;
}

const wx_transport_ops_t *wx_transport_find(const char *name)
{
    const wx_transport_ops_t *o;
    const char *n;
    for (int i = 0; wx_transport_backend(i, &n, &o) == 0; i++)
        if (o && strcmp(n, name) == 0)
            return o;
    return NULL;
}

int wx_transport_open(const char *name, const wx_opts_t *opts, wx_transport_t **out)
{
    const wx_transport_ops_t *ops = wx_transport_find(name);
    wx_transport_t *t = NULL;
    char why[WX_ERRMSG_MAX];
    int rc;

    if (!ops)
        return wx_errf(-ENOSYS, "transport '%s' is not compiled into this build", name);
    /* the options the backend declares, checked here for every backend (also where it cannot
     * run: a misspelt option is named before "unavailable") */
    if (ops->options && (rc = wx_opt_check(opts, name, ops->options)))
        return rc;
    why[0] = '\0';
    rc = ops->probe(opts, why, sizeof why);
    if (rc)
        return wx_errf(rc, "transport %s unavailable: %s", name, why);
    /* the libraries' own setup (provider init, fi_getinfo, fi_fabric, device open) may
     * install signal handlers: the process keeps the ones it had */
    {
        wx_sigs_t *sigs = malloc(sizeof *sigs);
        if (sigs)
            wx_sigs_save(sigs);
        rc = ops->open(opts, &t);
        if (sigs)
            wx_sigs_restore(sigs);
        free(sigs);
    }
    if (rc)
        return rc;
    t->ops = ops;
    pthread_mutex_init(&t->lock, NULL);
    t->mrs = NULL;
    t->next_mr_id = 1;
    /* Keys the generic layer assigns: unique per process and per transport instance, so a
     * stale descriptor from an earlier incarnation of the process does not match. */
    t->next_key = ((uint64_t)(getpid() & 0xffff) << 32) | ((wx_now_ns() & 0xfff) << 20) | 1;
    t->peers = NULL;
    t->npeers = t->cap_peers = 0;
    if (!t->max_write)
        t->max_write = 4u << 20;
    if (!t->max_inflight)
        t->max_inflight = 64;
    *out = t;
    return 0;
}

void wx_transport_close(wx_transport_t *t)
{
    wx_mr_t *mr, *next;
    wx_peer_t **peers;
    uint32_t npeers;
    if (!t)
        return;
    for (uint32_t i = 0; i < t->npeers; i++) {
        wx_peer_t *p = t->peers[i];
        if (p->connected && t->ops->disconnect)
            t->ops->disconnect(t, p);
    }
    /* The backend completes outstanding ops (-ECANCELED) and frees its state; the
     * registrations are released first so that its close finds none. */
    for (mr = t->mrs; mr; mr = next) {
        next = mr->next;
        t->ops->dereg(t, mr);
        free(mr);
    }
    t->mrs = NULL;
    /* Peers outlive the backend's close: the done() callbacks it makes for cancelled ops
     * may still name them. */
    peers = t->peers;
    npeers = t->npeers;
    t->peers = NULL;
    t->npeers = 0;
    pthread_mutex_destroy(&t->lock);
    t->ops->close(t);
    for (uint32_t i = 0; i < npeers; i++) {
        free(peers[i]->regions);
        free(peers[i]);
    }
    free(peers);
}

int wx_reg(wx_transport_t *t, void *addr, uint64_t len, uint32_t mem, int32_t device, int exported,
           wx_mr_t **out)
{
    wx_mr_t *mr;
    int rc;
    if (!addr && len)
        return wx_errf(-EINVAL, "register: NULL address");
    if (len == 0)
        return wx_errf(-EINVAL, "register: zero-length buffer");
    mr = calloc(1, sizeof *mr);
    if (!mr)
        return wx_errf(-ENOMEM, "register: out of memory");
    mr->addr = addr;
    mr->len = len;
    mr->mem = mem;
    mr->device = device;
    mr->exported = exported;
    pthread_mutex_lock(&t->lock);
    mr->id = t->next_mr_id++;
    if (!t->key_is_backend)
        mr->key = t->next_key++;
    pthread_mutex_unlock(&t->lock);
    rc = t->ops->reg(t, mr);
    if (rc) {
        free(mr);
        return rc;
    }
    pthread_mutex_lock(&t->lock);
    mr->next = t->mrs;
    t->mrs = mr;
    pthread_mutex_unlock(&t->lock);
    *out = mr;
    return 0;
}

int wx_dereg(wx_transport_t *t, wx_mr_t *mr)
{
    wx_mr_t **pp;
    pthread_mutex_lock(&t->lock);
    for (pp = &t->mrs; *pp && *pp != mr; pp = &(*pp)->next)
        ;
    if (!*pp) {
        pthread_mutex_unlock(&t->lock);
        return wx_errf(-ENOENT, "deregister: region %u is not registered", mr->id);
    }
    *pp = mr->next;
    pthread_mutex_unlock(&t->lock);
    t->ops->dereg(t, mr);
    free(mr);
    return 0;
}

void wx_mr_rinfo(const wx_mr_t *mr, wx_rinfo_t *ri)
{
    memset(ri, 0, sizeof *ri);
    ri->key = mr->key;
    ri->rbase = mr->rbase;
    ri->len = mr->len;
    ri->mem = mr->mem;
    ri->device = mr->device;
    ri->blob_len = mr->blob_len;
    memcpy(ri->blob, mr->blob, mr->blob_len);
}

int wx_export(wx_transport_t *t, uint8_t *buf, size_t cap, size_t *len)
{
    uint8_t addr[WX_ADDR_MAX];
    size_t alen = sizeof addr;
    uint32_t n = 0, i = 0;
    wx_rinfo_t *v;
    wx_mr_t *mr;
    int rc = t->ops->address(t, addr, &alen);
    if (rc)
        return rc;
    pthread_mutex_lock(&t->lock);
    for (mr = t->mrs; mr; mr = mr->next)
        n += mr->exported ? 1 : 0;
    v = calloc(n ? n : 1, sizeof *v);
    if (!v) {
        pthread_mutex_unlock(&t->lock);
        return wx_errf(-ENOMEM, "export: out of memory");
    }
    for (mr = t->mrs; mr; mr = mr->next)
        if (mr->exported)
            wx_mr_rinfo(mr, &v[i++]);
    pthread_mutex_unlock(&t->lock);
    rc = wx_export_encode((uint32_t)t->ops->kind, addr, (uint32_t)alen, n, v, buf, cap, len);
    free(v);
    return rc;
}

wx_peer_t *wx_peer_by_addr(wx_transport_t *t, const uint8_t *addr, uint32_t addr_len)
{
    wx_peer_t *found = NULL;
    pthread_mutex_lock(&t->lock);
    for (uint32_t i = 0; i < t->npeers; i++) {
        wx_peer_t *p = t->peers[i];
        if (p->addr_len == addr_len && memcmp(p->addr, addr, addr_len) == 0) {
            found = p;
            break;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}

wx_peer_t *wx_peer_by_id(wx_transport_t *t, uint32_t id)
{
    wx_peer_t *found = NULL;
    pthread_mutex_lock(&t->lock);
    if (id < t->npeers)
        found = t->peers[id];
    pthread_mutex_unlock(&t->lock);
    return found;
}

static int wx__decode_for(wx_transport_t *t, const uint8_t *blob, size_t blob_len, uint8_t *addr,
                          uint32_t *addr_len, uint32_t *n, wx_rinfo_t **regions)
{
    uint32_t kind;
    int rc = wx_export_decode(blob, blob_len, &kind, addr, addr_len, n, regions);
    if (rc)
        return rc;
    if (kind != (uint32_t)t->ops->kind) {
        free(*regions);
        *regions = NULL;
        return wx_errf(-EPROTO, "export blob is for transport kind %u, this transport is %s", kind,
                       t->ops->name);
    }
    return 0;
}

int wx_connect_request(wx_transport_t *t, const uint8_t *export_blob, size_t blob_len,
                       wx_peer_t **peer, uint8_t *req, size_t *req_len)
{
    uint8_t addr[WX_ADDR_MAX];
    uint32_t addr_len, n;
    wx_rinfo_t *regions;
    wx_peer_t *p;
    size_t cap = *req_len;
    int rc = wx__decode_for(t, export_blob, blob_len, addr, &addr_len, &n, &regions);
    if (rc)
        return rc;
    p = wx_peer_by_addr(t, addr, addr_len);
    if (p && p->connected) {
        /* Connected already: refresh its table, no new handshake. Writes validated against
         * the old table hold copies of their entries (wx_validate), so freeing it is safe. */
        pthread_mutex_lock(&t->lock);
        free(p->regions);
        p->regions = regions;
        p->nregions = n;
        pthread_mutex_unlock(&t->lock);
        *peer = p;
        *req_len = 0;
        return 0;
    }
    if (!p) {
        p = calloc(1, sizeof *p);
        if (!p) {
            free(regions);
            return wx_errf(-ENOMEM, "connect: out of memory");
        }
        memcpy(p->addr, addr, addr_len);
        p->addr_len = addr_len;
        pthread_mutex_lock(&t->lock);
        if (t->npeers == t->cap_peers) {
            uint32_t cap_peers = t->cap_peers ? 2 * t->cap_peers : 8;
            wx_peer_t **np = realloc(t->peers, cap_peers * sizeof *np);
            if (!np) {
                pthread_mutex_unlock(&t->lock);
                free(regions);
                free(p);
                return wx_errf(-ENOMEM, "connect: out of memory");
            }
            t->peers = np;
            t->cap_peers = cap_peers;
        }
        p->id = t->npeers;
        t->peers[t->npeers++] = p;
        snprintf(p->name, sizeof p->name, "peer %u", p->id);
        pthread_mutex_unlock(&t->lock);
    }
    pthread_mutex_lock(&t->lock);
    free(p->regions); /* a retried handshake's table; queued writes hold copies */
    p->regions = regions;
    p->nregions = n;
    pthread_mutex_unlock(&t->lock);
    *req_len = cap;
    rc = t->ops->conn_request(t, p, req, req_len);
    if (rc)
        return rc;
    *peer = p;
    return 0;
}

int wx_no_handshake(wx_transport_t *t, const uint8_t *req, size_t req_len, uint8_t *rep,
                    size_t *rep_len)
{
    (void)req;
    (void)rep;
    (void)rep_len;
    return wx_errf(-EPROTO,
                   "%s: unexpected %zu-byte connection request (%s needs no handshake; is the "
                   "writer another transport?)",
                   t->ops->name, req_len, t->ops->name);
}

int wx_accept(wx_transport_t *t, const uint8_t *req, size_t req_len, uint8_t *rep, size_t *rep_len)
{
    if (req_len == 0) {
        *rep_len = 0;
        return 0;
    }
    return t->ops->conn_accept(t, req, req_len, rep, rep_len);
}

int wx_connect_finish(wx_transport_t *t, wx_peer_t *p, const uint8_t *rep, size_t rep_len)
{
    int rc;
    if (p->connected)
        return 0;
    rc = t->ops->conn_finish(t, p, rep, rep_len);
    if (rc)
        return rc;
    p->connected = 1;
    return 0;
}

/* The entry of p's table for rkey, checked against the descriptor. t->lock held. */
static int wx__check_remote(const wx_peer_t *p, uint64_t rkey, uint64_t rbase, uint64_t rlen,
                            uint64_t roff, uint64_t len, wx_rinfo_t *ri)
{
    const wx_rinfo_t *hit = NULL;
    for (uint32_t i = 0; i < p->nregions; i++)
        if (p->regions[i].key == rkey) {
            hit = &p->regions[i];
            break;
        }
    if (!hit)
        return wx_errf(-EACCES,
                       "write refused: key 0x%llx is not a region %s exported (it exported %u)",
                       (unsigned long long)rkey, p->name, p->nregions);
    if (hit->rbase != rbase || hit->len != rlen)
        return wx_errf(-EACCES,
                       "write refused: descriptor for key 0x%llx says [0x%llx, +%llu) but %s "
                       "exported [0x%llx, +%llu)",
                       (unsigned long long)rkey, (unsigned long long)rbase,
                       (unsigned long long)rlen, p->name, (unsigned long long)hit->rbase,
                       (unsigned long long)hit->len);
    if (roff > hit->len || len > hit->len - roff)
        return wx_errf(-ERANGE,
                       "write refused: remote range [%llu, %llu) is outside the %llu-byte "
                       "region (key 0x%llx, %s)",
                       (unsigned long long)roff, (unsigned long long)(roff + len),
                       (unsigned long long)hit->len, (unsigned long long)rkey, p->name);
    *ri = *hit;
    return 0;
}

int wx_validate(wx_transport_t *t, wx_peer_t *p, uint64_t rkey, uint64_t rbase, uint64_t rlen,
                uint64_t roff, uint64_t len, const wx_mr_t *local, uint64_t loff, wx_rinfo_t *ri)
{
    int rc;
    if (!p->connected)
        return wx_errf(-ENOTCONN, "%s is not connected", p->name);
    pthread_mutex_lock(&t->lock);
    rc = wx__check_remote(p, rkey, rbase, rlen, roff, len, ri);
    pthread_mutex_unlock(&t->lock);
    if (rc)
        return rc;
    if (local && (loff > local->len || len > local->len - loff))
        return wx_errf(-ERANGE,
                       "write refused: local range [%llu, %llu) is outside the %llu-byte "
                       "source buffer",
                       (unsigned long long)loff, (unsigned long long)(loff + len),
                       (unsigned long long)local->len);
    return 0;
}

int wx_post_write(wx_transport_t *t, wx_peer_t *p, const wx_wr_t *wr, wx_op_t *op)
{
    if (wr->len > t->max_write)
        return wx_errf(-EMSGSIZE, "write of %llu bytes exceeds %s's limit of %llu per write",
                       (unsigned long long)wr->len, t->ops->name, (unsigned long long)t->max_write);
    return t->ops->write(t, p, wr, op);
}

int wx_map_remote(wx_transport_t *t, wx_peer_t *p, uint64_t rkey, uint64_t rbase, uint64_t rlen,
                  uint64_t roff, uint64_t len, uint64_t *addr, int32_t *device)
{
    wx_rinfo_t ri;
    int rc = wx_validate(t, p, rkey, rbase, rlen, roff, len, NULL, 0, &ri);
    if (rc)
        return rc;
    if (!t->ops->map)
        return wx_errf(-EOPNOTSUPP,
                       "%s: region key 0x%llx of %s cannot be mapped into this process: only "
                       "cuda_ipc maps peers' memory (this transport writes through its backend)",
                       t->ops->name, (unsigned long long)rkey, p->name);
    return t->ops->map(t, p, &ri, roff, len, addr, device);
}

int wx_fence(wx_transport_t *t, wx_peer_t *p, uint64_t timeout_ns, char *how, size_t len)
{
    if (!t->ops->fence) {
        snprintf(how, len, "the %s transport cannot fence a peer", t->ops->name);
        return -ENOTSUP;
    }
    return t->ops->fence(t, p, timeout_ns, how, len);
}
