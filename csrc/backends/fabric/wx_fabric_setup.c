/* wx_fabric_setup.c - the libfabric backend: options, provider selection, opening and
 * closing the fabric objects, addresses and peers.
 *
 * Provider facts this code relies on (libfabric 1.17, Debian 12; see issue 2):
 *   - tcp;ofi_rxm lists eth0 before lo, so the domain (interface) is chosen by name;
 *   - tcp;ofi_rxm returns mr_mode 0: offsets into the region, application keys (the
 *     generic layer assigns unique ones); shm returns FI_MR_VIRT_ADDR; efa asks for
 *     FI_MR_LOCAL|FI_MR_VIRT_ADDR|FI_MR_ALLOCATED|FI_MR_PROV_KEY. All of them are
 *     requested in the hints and whatever the returned info says is honoured;
 *   - over tcp;ofi_rxm a plain write completion can precede the data landing: writes
 *     are posted with FI_DELIVERY_COMPLETE;
 *   - the target must progress (read its CQ) for connections and data: every transport
 *     runs a progress thread (wx_fabric_data.c).
 */
#include "wx_fabric.h"
#include "wx_param.h"

#include <dirent.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WX_FAB_API_MIN FI_VERSION(1, 9)
#define WX_FAB_DEFAULT_CHUNK (4ull << 20)
#define WX_FAB_DEFAULT_DEPTH 64
#define WX_FAB_DEFAULT_TIMEOUT_S 30

static const char *const wx__fab_known[] = {"provider",
                                            "iface",
                                            "chunk",
                                            "depth",
                                            "hmem",
                                            "timeout",
                                            "progress",
#ifdef WX_TESTING /* fault injection: test builds only (WXFER_TESTING=1) */
                                            "_test_refuse_peer",
#endif
                                            NULL};

static int wx__fab_errno(int rc)
{
    if (rc < 0)
        rc = -rc;
    if (rc < FI_ERRNO_OFFSET)
        return -rc;
    switch (rc) {
    case FI_ENOKEY:
        return -ENOKEY;
    case FI_ETRUNC:
        return -EMSGSIZE;
    case FI_ETOOSMALL:
        return -ENOSPC;
    case FI_EOPBADSTATE:
        return -EBADFD;
    case FI_EBADFLAGS:
        return -EINVAL;
    default:
        return -EIO;
    }
}

int wx__fab_err(int rc, const char *fmt, ...)
{
    char what[WX_ERRMSG_MAX / 2];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return wx_errf(wx__fab_errno(rc), "%s failed: %s (%d)", what, wx_fi_strerror(rc), rc);
}

/* "tcp" -> "tcp;ofi_rxm"; anything else is taken as the exact provider string. */
static const char *wx__fab_prov_name(const char *p)
{
    if (strcmp(p, "tcp") == 0)
        return "tcp;ofi_rxm";
    return p;
}

static int wx__fab_is_tcp(const char *prov) { return strcmp(prov, "tcp;ofi_rxm") == 0; }

/* The provider when none is given: $WXFER_FABRIC_PROVIDER, else tcp. */
static const char *wx__fab_default_provider(void) { return wx_param_str(WX_P_FABRIC_PROVIDER); }

/* The domain when no iface is given: $WXFER_IFACE (the job's NIC for fabric), else
 * $WXFER_FABRIC_IFACE (its older name), else "lo" for tcp. */
static const char *wx__fab_default_iface(const char *prov)
{
    const char *e = wx_param_str(WX_P_IFACE);
    if (!e)
        e = wx_param_str(WX_P_FABRIC_IFACE);
    if (e)
        return e;
    return wx__fab_is_tcp(prov) ? "lo" : NULL;
}

static const char *wx__fab_default_of(const char *option)
{
    if (strcmp(option, "provider") == 0)
        return wx__fab_default_provider();
    if (strcmp(option, "iface") == 0)
        return wx__fab_default_iface(wx__fab_prov_name(wx__fab_default_provider()));
    return NULL;
}

static struct fi_info *wx__fab_hints(const wx_fi_api_t *api, const char *prov, int hmem,
                                     int thread_safe, int rma_event)
{
    struct fi_info *h = api->fi_dupinfo(NULL);
    if (!h)
        return NULL;
    h->caps =
        FI_RMA | FI_WRITE | FI_REMOTE_WRITE | (hmem ? FI_HMEM : 0) | (rma_event ? FI_RMA_EVENT : 0);
    h->mode = FI_CONTEXT | FI_CONTEXT2;
    h->ep_attr->type = FI_EP_RDM;
    h->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | (hmem ? FI_MR_HMEM : 0);
    h->domain_attr->threading = thread_safe ? FI_THREAD_SAFE : FI_THREAD_DOMAIN;
    h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    h->fabric_attr->prov_name = strdup(prov);
    if (!h->fabric_attr->prov_name) {
        api->fi_freeinfo(h);
        return NULL;
    }
    return h;
}

/* Run fi_getinfo for one combination of (hmem, thread_safe); on success *out is the list. */
static int wx__fab_getinfo(const wx_fi_api_t *api, const char *prov, int hmem, int thread_safe,
                           int rma_event, struct fi_info **out)
{
    struct fi_info *h = wx__fab_hints(api, prov, hmem, thread_safe, rma_event);
    uint32_t ver = api->fi_version();
    int rc;
    if (!h)
        return wx_errf(-ENOMEM, "fabric: out of memory building fi_getinfo hints");
    if (ver > FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION))
        ver = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    rc = api->fi_getinfo(ver, NULL, NULL, 0, h, out);
    api->fi_freeinfo(h);
    return rc;
}

/* Pick the entry for `iface` (domain name) or the first one. */
static struct fi_info *wx__fab_pick(struct fi_info *list, const char *iface, char *seen,
                                    size_t seen_len)
{
    seen[0] = '\0';
    for (struct fi_info *i = list; i; i = i->next) {
        const char *d = i->domain_attr && i->domain_attr->name ? i->domain_attr->name : "?";
        if (!iface || strcmp(d, iface) == 0)
            return i;
        if (!strstr(seen, d)) {
            size_t n = strlen(seen);
            snprintf(seen + n, seen_len - n, "%s%s", n ? ", " : "", d);
        }
    }
    return NULL;
}

/* Try (hmem, thread-safe, rma-event) from most to least wanted. FI_RMA_EVENT is only
 * asked for in poll mode: a remote-write counter tells an idle target that writes are
 * arriving, so it can nap longer while none do (tcp;ofi_rxm does not offer it). */
static int wx__fab_select(wx_fab_t *f, const char *prov, const char *iface, const char *hmem_opt)
{
    const wx_fi_api_t *api = f->api;
    int hmem_first = strcmp(hmem_opt, "off") != 0, hmem_last = strcmp(hmem_opt, "on") != 0;
    int last_rc = -FI_ENODATA;
    char seen[256] = "";
    for (int hmem = hmem_first; hmem >= (hmem_last ? 0 : 1); hmem--) {
        for (int safe = 1; safe >= 0; safe--) {
            for (int ev = !f->want_wait; ev >= 0; ev--) {
                struct fi_info *list = NULL, *pick;
                int rc = wx__fab_getinfo(api, prov, hmem, safe, ev, &list);
                if (rc) {
                    last_rc = rc;
                    continue;
                }
                pick = wx__fab_pick(list, iface, seen, sizeof seen);
                if (pick) {
                    f->info = api->fi_dupinfo(pick);
                    api->fi_freeinfo(list);
                    if (!f->info)
                        return wx_errf(-ENOMEM, "fabric: out of memory copying fi_info");
                    f->serialize = !safe;
                    return 0;
                }
                api->fi_freeinfo(list);
                last_rc = -FI_ENODATA;
            }
        }
    }
    if (strcmp(hmem_opt, "on") == 0 && last_rc == -FI_ENODATA && !seen[0]) {
        char have[512];
        uint32_t v = api->fi_version();
        wx__fab_hmem_providers(have, sizeof have);
        return wx_errf(-ENOTSUP,
                       "fabric: provider %s does not offer FI_HMEM (device memory) in libfabric "
                       "%u.%u, so it cannot register GPU memory (hmem=on; the Receiver and "
                       "Sender ask for it with CUDA memory); providers here that do: %s (fix: "
                       "provider=<one of them>, a libfabric built with CUDA for %s, or "
                       "host memory with hmem=auto)",
                       prov, FI_MAJOR(v), FI_MINOR(v), have[0] ? have : "none", prov);
    }
    if (seen[0])
        return wx_errf(-ENODEV,
                       "fabric: provider %s has no domain (interface) '%s'; it offers: %s "
                       "(set option iface= or WXFER_IFACE)",
                       prov, iface, seen);
    return wx__fab_err(last_rc,
                       "fabric: fi_getinfo(provider=%s, FI_EP_RDM, FI_RMA|FI_WRITE|"
                       "FI_REMOTE_WRITE%s)",
                       prov, strcmp(hmem_opt, "on") == 0 ? "|FI_HMEM" : "");
}

static int wx__fab_probe(const wx_opts_t *opts, char *why, size_t why_len)
{
    WX_UNUSED(opts);
    return wx_fi(why, why_len) ? 0 : -ENOENT;
}

static void wx__fab_teardown(wx_fab_t *f)
{
    /* Reverse order of wx__fab_open. The thread is gone before the endpoint closes so
     * that nothing reads the CQ concurrently; ops still posted are then cancelled. */
    wx__fab_thread_stop(f);
    if (f->ep)
        fi_close(&f->ep->fid);
    f->ep = NULL;
    wx__fab_cancel_all(f);
    while (f->fpeers) {
        wx_fab_peer_t *next = f->fpeers->next;
        free(f->fpeers);
        f->fpeers = next;
    }
    if (f->rcntr)
        fi_close(&f->rcntr->fid);
    if (f->cq)
        fi_close(&f->cq->fid);
    if (f->av)
        fi_close(&f->av->fid);
    if (f->domain)
        fi_close(&f->domain->fid);
    if (f->fabric)
        fi_close(&f->fabric->fid);
    if (f->info)
        f->api->fi_freeinfo(f->info);
    pthread_mutex_destroy(&f->slot_lock);
    pthread_mutex_destroy(&f->dlock);
    free(f);
}

static int wx__fab_open_cq(wx_fab_t *f)
{
    struct fi_cq_attr attr;
    int rc;
    memset(&attr, 0, sizeof attr);
    attr.format = FI_CQ_FORMAT_CONTEXT;
    attr.size = f->depth * 2 > 128 ? f->depth * 2 : 128;
    if (!f->serialize && f->want_wait) {
        attr.wait_obj = FI_WAIT_UNSPEC;
        rc = fi_cq_open(f->domain, &attr, &f->cq, NULL);
        if (rc == 0) {
            f->cq_wait = 1;
            return 0;
        }
        wx_debugf("fabric: CQ with a wait object refused (%s); polling", wx_fi_strerror(rc));
    }
    attr.wait_obj = FI_WAIT_NONE;
    rc = fi_cq_open(f->domain, &attr, &f->cq, NULL);
    if (rc)
        return wx__fab_err(rc, "fabric: fi_cq_open(provider %s)", f->prov);
    return 0;
}

/* shm names its shared-memory file /dev/shm/PID:N:N and refuses (EBUSY) to enable an
 * endpoint whose name exists. A process killed before closing leaves its file behind, and
 * a later process that gets the same pid could not open shm at all. Files named after our
 * own pid that exist before this process opened any shm endpoint can only be such leftovers:
 * the first shm open of the process removes them (under a lock, so that a second transport
 * opening at the same time waits until they are gone). */
static void wx__fab_shm_unlink_stale(void)
{
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static long done_pid; /* per process, also in a forked child */
    char prefix[32], path[300];
    DIR *d;
    struct dirent *de;
    size_t n;
    pthread_mutex_lock(&mu);
    if (done_pid != (long)getpid()) {
        done_pid = (long)getpid();
        n = (size_t)snprintf(prefix, sizeof prefix, "%ld:", (long)getpid());
        d = opendir("/dev/shm");
        while (d && (de = readdir(d))) {
            if (strncmp(de->d_name, prefix, n) == 0) {
                snprintf(path, sizeof path, "/dev/shm/%s", de->d_name);
                if (unlink(path) == 0)
                    wx_debugf("fabric: removed %s, left by an earlier process with pid %ld", path,
                              (long)getpid());
            }
        }
        if (d)
            closedir(d);
    }
    pthread_mutex_unlock(&mu);
}

/* The options of Transport("fabric", ...), checked. */
typedef struct wx__fab_cfg {
    const char *prov, *iface, *hmem, *progress;
    uint64_t chunk, depth, timeout_s;
    uint64_t refuse; /* _test_refuse_peer (test builds) */
} wx__fab_cfg_t;

static int wx__fab_parse(const wx_opts_t *opts, wx__fab_cfg_t *c)
{
    int rc;
    c->prov = wx__fab_prov_name(wx_opt_str(opts, "provider", wx__fab_default_provider()));
    c->iface = wx_opt_str(opts, "iface", wx__fab_default_iface(c->prov));
    c->hmem = wx_opt_str(opts, "hmem", "auto");
    if (strcmp(c->hmem, "auto") && strcmp(c->hmem, "on") && strcmp(c->hmem, "off"))
        return wx_errf(-EINVAL, "transport fabric: option hmem=%s: expected auto, on or off",
                       c->hmem);
    c->progress = wx_opt_str(opts, "progress", "auto");
    if (strcmp(c->progress, "auto") && strcmp(c->progress, "wait") && strcmp(c->progress, "poll"))
        return wx_errf(-EINVAL, "transport fabric: option progress=%s: expected auto, wait or poll",
                       c->progress);
    if ((rc = wx_opt_u64(opts, "chunk", WX_FAB_DEFAULT_CHUNK, &c->chunk)) ||
        (rc = wx_opt_u64(opts, "depth", WX_FAB_DEFAULT_DEPTH, &c->depth)) ||
        (rc = wx_opt_u64(opts, "timeout", WX_FAB_DEFAULT_TIMEOUT_S, &c->timeout_s)))
        return rc;
    c->refuse = UINT64_MAX;
#ifdef WX_TESTING
    if ((rc = wx_opt_u64(opts, "_test_refuse_peer", UINT64_MAX, &c->refuse)))
        return rc;
#endif
    if (c->chunk == 0 || c->depth == 0 || c->depth > 65536)
        return wx_errf(-EINVAL,
                       "transport fabric: chunk must be > 0 and depth in 1..65536 "
                       "(got chunk=%llu depth=%llu)",
                       (unsigned long long)c->chunk, (unsigned long long)c->depth);
    return 0;
}

/* The remote-write counter, where the provider has one (a target then tells busy from
 * idle); without it the target polls at a fixed rate. */
static void wx__fab_open_rcntr(wx_fab_t *f)
{
    struct fi_cntr_attr ca;
    int rc;
    memset(&ca, 0, sizeof ca);
    ca.events = FI_CNTR_EVENTS_COMP;
    ca.wait_obj = FI_WAIT_NONE;
    rc = fi_cntr_open(f->domain, &ca, &f->rcntr, NULL);
    if (!rc)
        rc = fi_ep_bind(f->ep, &f->rcntr->fid, FI_REMOTE_WRITE);
    if (rc) {
        wx_debugf("fabric: no remote-write counter (%s); the target polls at a fixed rate",
                  wx_fi_strerror(rc));
        if (f->rcntr)
            fi_close(&f->rcntr->fid);
        f->rcntr = NULL;
    }
}

/* fi_fabric, fi_domain, the AV, the CQ, the endpoint bound to them, enabled, and its
 * address. f->info is the chosen provider's. */
static int wx__fab_open_ep(wx_fab_t *f)
{
    const wx_fi_api_t *api = f->api;
    const char *prov = f->prov;
    struct fi_av_attr av_attr;
    size_t sl = sizeof f->addr_str;
    int rc = api->fi_fabric(f->info->fabric_attr, &f->fabric, NULL);
    if (rc)
        return wx__fab_err(rc, "fabric: fi_fabric(provider %s)", prov);
    rc = fi_domain(f->fabric, f->info, &f->domain, NULL);
    if (rc)
        return wx__fab_err(rc, "fabric: fi_domain(provider %s, domain %s)", prov, f->dom);
    memset(&av_attr, 0, sizeof av_attr);
    av_attr.type =
        f->info->domain_attr->av_type != FI_AV_UNSPEC ? f->info->domain_attr->av_type : FI_AV_TABLE;
    rc = fi_av_open(f->domain, &av_attr, &f->av, NULL);
    if (rc)
        return wx__fab_err(rc, "fabric: fi_av_open(provider %s)", prov);
    rc = wx__fab_open_cq(f);
    if (rc)
        return rc;
    rc = fi_endpoint(f->domain, f->info, &f->ep, NULL);
    if (rc)
        return wx__fab_err(rc, "fabric: fi_endpoint(provider %s, domain %s)", prov, f->dom);
    if ((rc = fi_ep_bind(f->ep, &f->av->fid, 0)) ||
        (rc = fi_ep_bind(f->ep, &f->cq->fid, FI_TRANSMIT | FI_RECV)))
        return wx__fab_err(rc, "fabric: fi_ep_bind(provider %s)", prov);
    if (f->info->caps & FI_RMA_EVENT)
        wx__fab_open_rcntr(f);
    if (strcmp(prov, "shm") == 0)
        wx__fab_shm_unlink_stale();
    rc = fi_enable(f->ep);
    if (rc)
        return wx__fab_err(rc, "fabric: fi_enable(provider %s, domain %s)", prov, f->dom);
    f->addr_len = sizeof f->addr;
    rc = fi_getname(&f->ep->fid, f->addr, &f->addr_len);
    if (rc)
        return wx__fab_err(rc, "fabric: fi_getname(provider %s)", prov);
    if (!fi_av_straddr(f->av, f->addr, f->addr_str, &sl))
        snprintf(f->addr_str, sizeof f->addr_str, "?");
    return 0;
}

static int wx__fab_open(const wx_opts_t *opts, wx_transport_t **out)
{
    char why[256];
    const wx_fi_api_t *api = wx_fi(why, sizeof why);
    wx__fab_cfg_t c;
    uint64_t max_msg, depth;
    wx_fab_t *f;
    int rc;

    if (!api)
        return wx_errf(-ENOENT, "transport fabric unavailable: %s", why);
    rc = wx__fab_parse(opts, &c);
    if (rc)
        return rc;
    f = calloc(1, sizeof *f);
    if (!f)
        return wx_errf(-ENOMEM, "transport fabric: out of memory");
    f->api = api;
    pthread_mutex_init(&f->slot_lock, NULL);
    pthread_mutex_init(&f->dlock, NULL);
    snprintf(f->prov, sizeof f->prov, "%s", c.prov);
    f->op_timeout_ns = c.timeout_s * 1000000000ull;
#ifdef WX_TESTING
    f->test_refuse_peer = c.refuse;
#endif

    /* auto: block in fi_cq_sread where that drives the provider (tcp;ofi_rxm), poll
     * otherwise (shm's sread sleeps through incoming writes). */
    f->want_wait = strcmp(c.progress, "wait") == 0 ||
                   (strcmp(c.progress, "auto") == 0 && wx__fab_is_tcp(c.prov));
    rc = wx__fab_select(f, c.prov, c.iface, c.hmem);
    if (rc)
        goto fail;
    snprintf(f->dom, sizeof f->dom, "%s", f->info->domain_attr->name);
    f->mr_mode = (uint64_t)f->info->domain_attr->mr_mode;
    f->hmem = (f->info->caps & FI_HMEM) != 0;
    f->write_flags = FI_COMPLETION | FI_DELIVERY_COMPLETE;
    max_msg = f->info->ep_attr->max_msg_size;
    f->chunk = c.chunk < max_msg ? c.chunk : max_msg;
    depth = c.depth;
    if (f->info->tx_attr->size && depth > f->info->tx_attr->size)
        depth = f->info->tx_attr->size;
    f->depth = (uint32_t)depth;

    if ((rc = wx__fab_open_ep(f)) || (rc = wx__fab_slots_init(f)) || (rc = wx__fab_thread_start(f)))
        goto fail;

    f->base.max_write = f->chunk;
    f->base.max_inflight = f->depth;
    f->base.needs_local_reg = (f->mr_mode & FI_MR_LOCAL) != 0;
    f->base.key_is_backend = (f->mr_mode & FI_MR_PROV_KEY) != 0;
    wx_debugf("fabric: open provider=%s domain=%s addr=%s mr_mode=0x%llx hmem=%d wait=%d "
              "serialize=%d chunk=%llu depth=%u",
              f->prov, f->dom, f->addr_str, (unsigned long long)f->mr_mode, f->hmem, f->cq_wait,
              f->serialize, (unsigned long long)f->chunk, f->depth);
    *out = &f->base;
    return 0;
fail:
    wx__fab_teardown(f);
    return rc;
}

static void wx__fab_close(wx_transport_t *t) { wx__fab_teardown(WX_FAB(t)); }

static int wx__fab_address(wx_transport_t *t, uint8_t *buf, size_t *len)
{
    wx_fab_t *f = WX_FAB(t);
    if (*len < f->addr_len)
        return wx_errf(-ENOSPC, "fabric: address of %zu bytes does not fit in %zu", f->addr_len,
                       *len);
    memcpy(buf, f->addr, f->addr_len);
    *len = f->addr_len;
    return 0;
}

/* shm names its endpoints "[fi_shm://]PID:N:N" (libfabric 1.17): the writer uses the pid
 * to notice a target that exited (shm itself would leave such writes pending forever). */
static long wx__fab_shm_pid(const uint8_t *addr, uint32_t len)
{
    char s[WX_ADDR_MAX + 1], *p, *end;
    long pid;
    memcpy(s, addr, len);
    s[len] = '\0';
    p = strstr(s, "://") ? strstr(s, "://") + 3 : s;
    pid = strtol(p, &end, 10);
    return end != p && *end == ':' && pid > 0 ? pid : 0;
}

/* A peer address the provider's AV may be given: where the provider takes socket addresses
 * (tcp), one of a known family and size.  libfabric 1.17's IP AV fails an address of an
 * unknown family (-EINVAL, "invalid address") and then every later insert into that AV, good
 * ones included ("Address too large for AV"): one bad export blob would cut a trainer off
 * from every worker that connects after it.  Refused here, naming the peer, before the AV
 * sees it. */
static int wx__fab_addr_check(const wx_fab_t *f, const wx_peer_t *p)
{
    uint32_t fmt = f->info ? f->info->addr_format : 0;
    unsigned short fam;
    size_t need;
    if (fmt < FI_SOCKADDR || fmt > FI_SOCKADDR_IB)
        return 0;
    if (p->addr_len < sizeof fam)
        return wx_errf(-EINVAL, "fabric: %s: a %u-byte address is no socket address", p->name,
                       p->addr_len);
    memcpy(&fam, p->addr, sizeof fam); /* sa_family, first in every struct sockaddr_* */
    need = fam == AF_INET          ? sizeof(struct sockaddr_in)
           : fam == AF_INET6       ? sizeof(struct sockaddr_in6)
           : fam == 27 /* AF_IB */ ? 48 /* sizeof(struct sockaddr_ib) */
                                   : 0;
    if (!need || p->addr_len < need)
        return wx_errf(-EINVAL,
                       "fabric: %s: its %u-byte address is no socket address provider %s takes "
                       "(family %u%s): refused before fi_av_insert (libfabric's AV would then "
                       "refuse every later address too)",
                       p->name, p->addr_len, f->prov, fam, need ? ", too short" : " unknown");
    return 0;
}

/* No handshake: the peer's address is in its export blob; insert it into the AV. */
static int wx__fab_conn_request(wx_transport_t *t, wx_peer_t *p, uint8_t *req, size_t *req_len)
{
    wx_fab_t *f = WX_FAB(t);
    wx_fab_peer_t *fp = p->priv;
    char str[WX_NAME_MAX - 32];
    size_t sl = sizeof str;
    int rc;
    WX_UNUSED(req);
    if (!fp) {
        fp = calloc(1, sizeof *fp);
        if (!fp)
            return wx_errf(-ENOMEM, "fabric: out of memory");
        pthread_mutex_lock(&f->slot_lock);
        fp->next = f->fpeers;
        f->fpeers = fp;
        pthread_mutex_unlock(&f->slot_lock);
        p->priv = fp;
    }
    if (!fp->in_av) {
        rc = wx__fab_addr_check(f, p);
        if (rc)
            return rc;
        if (f->serialize)
            pthread_mutex_lock(&f->dlock);
        rc = fi_av_insert(f->av, p->addr, 1, &fp->fa, 0, NULL);
        if (f->serialize)
            pthread_mutex_unlock(&f->dlock);
        if (rc != 1)
            return wx__fab_err(rc < 0 ? rc : -FI_EINVAL,
                               "fabric: fi_av_insert(%s, %u-byte address)", p->name, p->addr_len);
        fp->in_av = 1;
    }
    fp->failed = 0;
    fp->pid = strcmp(f->prov, "shm") == 0 ? wx__fab_shm_pid(p->addr, p->addr_len) : 0;
    if (fi_av_straddr(f->av, p->addr, str, &sl))
        snprintf(p->name, sizeof p->name, "peer %u (%s)", p->id, str);
    snprintf(fp->name, sizeof fp->name, "%s", p->name);
    *req_len = 0;
    return 0;
}

static int wx__fab_conn_finish(wx_transport_t *t, wx_peer_t *p, const uint8_t *rep, size_t rep_len)
{
    WX_UNUSED(t);
    WX_UNUSED(rep);
    if (!p->priv)
        return wx_errf(-ENOTCONN, "fabric: %s: connect_finish without connect_request", p->name);
    if (rep_len)
        return wx_errf(-EPROTO, "fabric: %s: unexpected %zu-byte connection reply", p->name,
                       rep_len);
    return 0;
}

/* libfabric cannot recall an RMA write it accepted (fi_cancel covers receives only):
 * over tcp the bytes it sent are in the kernel's socket buffers, and the target's provider
 * applies what reached it when that process next progresses (a stopped one: when it
 * resumes); shm queues a write for the target's progress, or has copied it already.
 * Closing the endpoint or removing the peer's address does not take either back. So no
 * fence: the writes still out to p may land later. */
static int wx__fab_fence(wx_transport_t *t, wx_peer_t *p, uint64_t timeout_ns, char *how,
                         size_t len)
{
    wx_fab_t *f = WX_FAB(t);
    wx_fab_peer_t *fp = p->priv;
    WX_UNUSED(timeout_ns);
    snprintf(how, len,
             "fabric %s cannot recall the %u writes to %s it accepted: they may still land "
             "(%s)",
             f->prov, fp ? (unsigned)atomic_load(&fp->inflight) : 0u, p->name,
             strncmp(f->prov, "shm", 3) == 0
                 ? "queued for the target process's own progress"
                 : "sent into the socket, applied by the target's provider when it progresses");
    return -ENOTSUP;
}

static void wx__fab_disconnect(wx_transport_t *t, wx_peer_t *p)
{
    wx_fab_t *f = WX_FAB(t);
    wx_fab_peer_t *fp = p->priv;
    if (!fp)
        return;
    p->priv = NULL;
    wx__fab_cancel_peer(f, fp, "fabric: transport closed (peer disconnected)");
    /* Writes still in flight keep the AV entry until the endpoint closes; fp itself is
     * freed at close. */
    if (!fp->in_av || atomic_load(&fp->inflight))
        return;
    if (f->serialize)
        pthread_mutex_lock(&f->dlock);
    fi_av_remove(f->av, &fp->fa, 1, 0);
    if (f->serialize)
        pthread_mutex_unlock(&f->dlock);
    fp->in_av = 0;
}

static int wx__fab_info(wx_transport_t *t, char *buf, size_t len)
{
    wx_fab_t *f = WX_FAB(t);
    int n;
    pthread_mutex_lock(&f->slot_lock);
    n = snprintf(buf, len,
                 "fabric provider=%s domain=%s addr=%s mr_mode=0x%llx hmem=%s progress=%s%s%s "
                 "chunk=%llu depth=%u inflight=%u abandoned=%u writes=%llu bytes=%llu "
                 "errors=%llu timeouts=%llu reg_host=%llu reg_cuda=%llu",
                 f->prov, f->dom, f->addr_str, (unsigned long long)f->mr_mode,
                 f->hmem ? "yes" : "no", f->cq_wait ? "sread" : "poll", f->serialize ? "+lock" : "",
                 f->rcntr ? "+cntr" : "", (unsigned long long)f->chunk, f->depth, f->posted,
                 f->abandoned, (unsigned long long)atomic_load(&f->n_writes),
                 (unsigned long long)atomic_load(&f->n_bytes),
                 (unsigned long long)atomic_load(&f->n_errors),
                 (unsigned long long)atomic_load(&f->n_timeouts),
                 (unsigned long long)atomic_load(&f->n_reg_host),
                 (unsigned long long)atomic_load(&f->n_reg_cuda));
    pthread_mutex_unlock(&f->slot_lock);
    return n < 0 ? -EIO : 0;
}

static const char *const wx__fab_host_opts[] = {"iface", NULL};
static const char *const wx__fab_shared_opts[] = {"provider", NULL};
static const char *const wx__fab_gpu_check[] = {"hmem", "on", NULL};

const wx_transport_ops_t wx_fabric_ops = {
    .name = "fabric",
    .kind = WX_KIND_FABRIC,
    /* a peer that is gone: tcp resets the connection, shm sees the process exit */
    .caps = WX_CAP_HOST_MEM | WX_CAP_CUDA_MEM | WX_CAP_DEAD_PEER,
    .auto_host = 1,
    .auto_cuda = 3,
    .options = wx__fab_known,
    .host_options = wx__fab_host_opts,
    .shared_options = wx__fab_shared_opts,
    .gpu_check = wx__fab_gpu_check,
    .default_of = wx__fab_default_of,
    WX_TRANSPORT_OPS(fab),
    .conn_accept = wx_no_handshake,
};
