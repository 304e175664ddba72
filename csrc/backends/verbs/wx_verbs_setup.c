/* wx_verbs_setup.c - verbs backend: which NICs to use (PCIe topology, WXFER_IB_DEVICES),
 * their ports and GIDs, and the per-NIC protection domain and completion queue. */
#include "wx_verbs.h"

#include <ctype.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wx_dl_cuda.h"
#include "wx_param.h"

const char *wx__verbs_mtu_str(int mtu)
{
    switch (mtu) {
    case IBV_MTU_256:
        return "256";
    case IBV_MTU_512:
        return "512";
    case IBV_MTU_1024:
        return "1024";
    case IBV_MTU_2048:
        return "2048";
    case IBV_MTU_4096:
        return "4096";
    default:
        return "?";
    }
}

int wx__verbs_parse_list(const char *s, char names[][64], int *ports, int max, int *exclude)
{
    int n = 0;
    *exclude = 0;
    while (*s == ' ')
        s++;
    if (*s == '^') {
        *exclude = 1;
        s++;
    }
    while (*s) {
        const char *e = strchr(s, ','), *colon;
        size_t len = e ? (size_t)(e - s) : strlen(s);
        char item[64];
        while (len && *s == ' ')
            s++, len--;
        while (len && s[len - 1] == ' ')
            len--;
        if (len == 0) {
            if (!e)
                break;
            s = e + 1;
            continue;
        }
        if (len >= sizeof item || n >= max)
            return wx_errf(-EINVAL,
                           "WXFER_IB_DEVICES: entry '%.*s' too long or too many "
                           "entries (max %d)",
                           (int)len, s, max);
        memcpy(item, s, len);
        item[len] = '\0';
        for (size_t i = 0; i < len; i++)
            if (strchr("*?[]{}()|+\\$^", item[i]))
                return wx_errf(-EINVAL,
                               "WXFER_IB_DEVICES: '%s' is not a plain device[:port] "
                               "name (no patterns; use '^a,b' to exclude)",
                               item);
        colon = strchr(item, ':');
        ports[n] = 0;
        if (colon) {
            char *end;
            long p = strtol(colon + 1, &end, 10);
            if (*end || p < 1 || p > 255 || colon == item)
                return wx_errf(-EINVAL, "WXFER_IB_DEVICES: bad port in '%s'", item);
            ports[n] = (int)p;
            item[colon - item] = '\0';
        }
        memcpy(names[n], item, 64);
        names[n][63] = '\0';
        n++;
        if (!e)
            break;
        s = e + 1;
    }
    return n;
}

int wx__verbs_pci_distance(const char *a, const char *b)
{
    /* Components below the common ancestor on both sides (like NCCL's PIX/PXB/PHB/SYS). */
    int na = 0, nb = 0, common = 0, same = 1;
    const char *pa = a, *pb = b;
    while (*pa || *pb) {
        const char *ea = strchr(pa, '/'), *eb = strchr(pb, '/');
        size_t la = ea ? (size_t)(ea - pa) : strlen(pa), lb = eb ? (size_t)(eb - pb) : strlen(pb);
        if (*pa && la)
            na++;
        if (*pb && lb)
            nb++;
        if (same && la && la == lb && memcmp(pa, pb, la) == 0)
            common++;
        else if (la || lb)
            same = 0;
        pa = ea ? ea + 1 : pa + la;
        pb = eb ? eb + 1 : pb + lb;
    }
    return (na - common) + (nb - common);
}

/* The resolved form of sysfs link `path` into out[len]. */
static int wx__realpath_into(const char *path, char *out, size_t len)
{
    char real[PATH_MAX];
    if (!realpath(path, real))
        return -ENOENT;
    if (strlen(real) >= len)
        return -ENAMETOOLONG;
    memcpy(out, real, strlen(real) + 1);
    return 0;
}

int wx__verbs_gpu_pci_path(const char *sysfs, const char *busid, char *out, size_t len)
{
    char id[32], path[512];
    const char *c = strchr(busid, ':');
    size_t i;
    /* "00000000:17:00.0" (NVML) and "0000:17:00.0" (CUDA) both name domain 0000. */
    if (c && c - busid > 4)
        busid = c - 4;
    for (i = 0; busid[i] && i < sizeof id - 1; i++)
        id[i] = (char)tolower((unsigned char)busid[i]);
    id[i] = '\0';
    snprintf(path, sizeof path, "%s/bus/pci/devices/%s", sysfs ? sysfs : "/sys", id);
    return wx__realpath_into(path, out, len);
}

static int wx__nic_pci(const char *ibdev_path, char *out, size_t len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/device", ibdev_path);
    out[0] = '\0';
    return wx__realpath_into(path, out, len);
}

static int wx__gpu_path(int gpu, char *out, size_t len, char *why, size_t why_len)
{
    const wx_cuda_api_t *cu = wx_cuda(why, why_len);
    char bus[64];
    CUdevice d;
    if (!cu)
        return -ENODEV;
    if (cu->cuDeviceGet(&d, gpu) != CUDA_SUCCESS ||
        cu->cuDeviceGetPCIBusId(bus, sizeof bus, d) != CUDA_SUCCESS) {
        snprintf(why, why_len, "cuDeviceGetPCIBusId(%d) failed", gpu);
        return -ENODEV;
    }
    if (wx__verbs_gpu_pci_path("/sys", bus, out, len)) {
        snprintf(why, why_len, "no sysfs entry for GPU %d at %s", gpu, bus);
        return -ENOENT;
    }
    return 0;
}

/* Open `dev`, pick `port` (0: the first active one) and fill n. */
static int wx__nic_open(wx_verbs_t *t, struct ibv_device *dev, int port, int explicit_,
                        wx__vnic_t *n)
{
    const wx_verbs_api_t *v = t->v;
    memset(n, 0, sizeof *n);
    snprintf(n->name, sizeof n->name, "%s", v->get_device_name(dev));
    n->ctx = v->open_device(dev);
    if (!n->ctx)
        return wx_errf(-errno ? -errno : -EIO, "ibv_open_device(%s) failed: %s", n->name,
                       strerror(errno));
    if (v->query_device(n->ctx, &n->dattr)) {
        v->close_device(n->ctx);
        n->ctx = NULL;
        return wx_errf(-EIO, "ibv_query_device(%s) failed", n->name);
    }
    for (int p = port ? port : 1; p <= (port ? port : n->dattr.phys_port_cnt); p++) {
        int rc = wx_ibv_query_port(v, n->ctx, (uint8_t)p, &n->pattr);
        if (rc == 0 && n->pattr.state == IBV_PORT_ACTIVE) {
            n->port = (uint8_t)p;
            break;
        }
    }
    if (!n->port) {
        v->close_device(n->ctx);
        n->ctx = NULL;
        if (explicit_)
            return wx_errf(-ENETDOWN, "%s: port %d is not active", n->name, port ? port : 1);
        return -ENETDOWN;
    }
    wx__nic_pci(dev->ibdev_path, n->pci, sizeof n->pci);
    n->distance = -1;
    return 0;
}

static int wx__nic_gid(wx_verbs_t *t, wx__vnic_t *n)
{
    const wx_verbs_api_t *v = t->v;
    int best = -1, best_score = -1, type;
    union ibv_gid g;
    if (n->pattr.link_layer != IBV_LINK_LAYER_ETHERNET) {
        n->gid_index = -1;
        if (n->pattr.lid == 0)
            return wx_errf(-ENETDOWN, "%s port %u: LID 0 (is a subnet manager running?)", n->name,
                           n->port);
        if (t->gid_index_opt >= 0) {
            n->gid_index = t->gid_index_opt;
            if (v->query_gid(n->ctx, n->port, n->gid_index, &n->gid))
                return wx_errf(-EINVAL, "%s port %u: ibv_query_gid(%d) failed", n->name, n->port,
                               n->gid_index);
        }
        return 0;
    }
    if (t->gid_index_opt >= 0) {
        if (wx_ibv_query_gid_typed(v, n->ctx, n->port, t->gid_index_opt, &n->gid, &type))
            return wx_errf(-EINVAL, "%s port %u: GID index %d does not exist", n->name, n->port,
                           t->gid_index_opt);
        n->gid_index = t->gid_index_opt;
        n->gid_type = type;
        return 0;
    }
    /* RoCE: prefer a RoCE v2 GID holding an IPv4-mapped address, then any RoCE v2 GID,
     * then RoCE v1. */
    for (int i = 0; i < n->pattr.gid_tbl_len; i++) {
        static const uint8_t v4map[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        static const uint8_t zero[16];
        int score;
        if (wx_ibv_query_gid_typed(v, n->ctx, n->port, i, &g, &type) ||
            memcmp(g.raw, zero, 16) == 0)
            continue;
        score = type == IBV_GID_TYPE_ROCE_V2 ? 2 : 0;
        if (memcmp(g.raw, v4map, 12) == 0)
            score++;
        if (score > best_score) {
            best_score = score;
            best = i;
            n->gid = g;
            n->gid_type = type;
        }
    }
    if (best < 0)
        return wx_errf(-ENETDOWN,
                       "%s port %u: no usable RoCE GID (is an IP address set on "
                       "its netdev?)",
                       n->name, n->port);
    n->gid_index = best;
    return 0;
}

static int wx__nic_setup(wx_verbs_t *t, wx__vnic_t *n)
{
    const wx_verbs_api_t *v = t->v;
    int rc = wx__nic_gid(t, n);
    if (rc)
        return rc;
    n->pd = v->alloc_pd(n->ctx);
    if (!n->pd)
        return wx_errf(-ENOMEM, "ibv_alloc_pd(%s) failed: %s", n->name, strerror(errno));
    n->cq_cap = n->dattr.max_cqe < 65536 ? n->dattr.max_cqe : 65536;
    n->cq = v->create_cq(n->ctx, n->cq_cap, NULL, NULL, 0);
    if (!n->cq) {
        rc = wx_errf(-ENOMEM, "ibv_create_cq(%s, %d) failed: %s", n->name, n->cq_cap,
                     strerror(errno));
        v->dealloc_pd(n->pd);
        n->pd = NULL;
        return rc;
    }
    return 0;
}

/* What wx__verbs_open_nics picks from: the device list, the list the option device (or
 * WXFER_IB_DEVICES) names, and the NICs opened so far (closed again unless kept). */
typedef struct wx__nic_pick {
    struct ibv_device **list;
    int ndev;
    char names[32][64];
    int ports[32], nlist, exclude;
    const char *spec, *src;
    wx__vnic_t cand[WX_VERBS_MAX_NICS];
    int ncand;
} wx__nic_pick_t;

/* The NICs a list names, in its order; every one must exist. */
static int wx__nics_named(wx_verbs_t *t, wx__nic_pick_t *k)
{
    const wx_verbs_api_t *v = t->v;
    for (int i = 0; i < k->nlist && k->ncand < WX_VERBS_MAX_NICS; i++) {
        struct ibv_device *d = NULL;
        char have[256] = "";
        int rc;
        for (int j = 0; j < k->ndev; j++) {
            if (strcmp(v->get_device_name(k->list[j]), k->names[i]) == 0)
                d = k->list[j];
            if (strlen(have) + 70 < sizeof have)
                snprintf(have + strlen(have), sizeof have - strlen(have), "%s%s", j ? ", " : "",
                         v->get_device_name(k->list[j]));
        }
        if (!d)
            return wx_errf(-ENODEV,
                           "%s names RDMA device '%s', which does not exist "
                           "(devices: %s)",
                           k->src, k->names[i], have);
        rc = wx__nic_open(t, d, k->ports[i], 1, &k->cand[k->ncand]);
        if (rc)
            return rc;
        k->ncand++;
    }
    snprintf(t->choice, sizeof t->choice, "from %s=%s", k->src, k->spec);
    return 0;
}

/* Every device with an active port, but those (or the ports) the list excludes. */
static int wx__nics_active(wx_verbs_t *t, wx__nic_pick_t *k)
{
    const wx_verbs_api_t *v = t->v;
    for (int j = 0; j < k->ndev && k->ncand < WX_VERBS_MAX_NICS; j++) {
        const char *nm = v->get_device_name(k->list[j]);
        int port = 0, skip = 0;
        for (int i = 0; i < k->nlist; i++)
            if (strcmp(k->names[i], nm) == 0) {
                if (k->ports[i] == 0)
                    skip = 1;
                else
                    port = -k->ports[i]; /* excluded port */
            }
        if (skip)
            continue;
        if (port < 0) {
            /* excluded one port: take the first other active port */
            wx__vnic_t n;
            if (wx__nic_open(t, k->list[j], 0, 0, &n))
                continue;
            if (n.port == -port) {
                v->close_device(n.ctx);
                continue;
            }
            k->cand[k->ncand++] = n;
            continue;
        }
        if (wx__nic_open(t, k->list[j], 0, 0, &k->cand[k->ncand]) == 0)
            k->ncand++;
    }
    if (k->ncand == 0)
        return wx_errf(-ENETDOWN, "no RDMA device with an active port (%d devices%s%s)", k->ndev,
                       k->nlist ? ", after exclusions from " : "", k->nlist ? k->src : "");
    snprintf(t->choice, sizeof t->choice, "%s%s", k->nlist ? "all but excluded by " : "all active",
             k->nlist ? k->src : "");
    return 0;
}

/* Keep the candidates nearest to the GPU by PCIe topology (ties are striped). */
static void wx__nics_nearest(wx_verbs_t *t, wx__nic_pick_t *k)
{
    const wx_verbs_api_t *v = t->v;
    char gpath[PATH_MAX], why[256] = "";
    int mind = INT_MAX, keep = 0;
    if (wx__gpu_path(t->gpu, gpath, sizeof gpath, why, sizeof why) != 0) {
        snprintf(t->choice, sizeof t->choice, "all active (GPU %d topology unknown: %s)", t->gpu,
                 why);
        return;
    }
    for (int i = 0; i < k->ncand; i++) {
        k->cand[i].distance =
            k->cand[i].pci[0] ? wx__verbs_pci_distance(gpath, k->cand[i].pci) : -1;
        if (k->cand[i].distance >= 0 && k->cand[i].distance < mind)
            mind = k->cand[i].distance;
    }
    if (mind == INT_MAX) {
        snprintf(t->choice, sizeof t->choice, "all active (PCI path of the NICs unknown)");
        return;
    }
    for (int i = 0; i < k->ncand; i++) {
        if (k->cand[i].distance == mind)
            k->cand[keep++] = k->cand[i];
        else
            v->close_device(k->cand[i].ctx);
    }
    k->ncand = keep;
    snprintf(t->choice, sizeof t->choice, "nearest to GPU %d (%d PCI hops)", t->gpu, mind);
}

/* The candidates become t's NICs, each with its PD and CQ. */
static int wx__nics_setup(wx_verbs_t *t, wx__nic_pick_t *k)
{
    const wx_verbs_api_t *v = t->v;
    for (int i = 0; i < k->ncand; i++) {
        int rc;
        t->nic[i] = k->cand[i];
        t->nic[i].index = i;
        t->nnic = i + 1;
        rc = wx__nic_setup(t, &t->nic[i]);
        if (rc) {
            /* the failed NIC's context is still open; close it with the rest */
            t->nic[i].pd = NULL;
            t->nic[i].cq = NULL;
            for (int j = i + 1; j < k->ncand; j++)
                v->close_device(k->cand[j].ctx);
            k->ncand = 0;
            return rc;
        }
    }
    k->ncand = 0;
    return 0;
}

int wx__verbs_open_nics(wx_verbs_t *t, const char *device_opt)
{
    const wx_verbs_api_t *v = t->v;
    wx__nic_pick_t *k = calloc(1, sizeof *k);
    int rc = 0;
    if (!k)
        return wx_errf(-ENOMEM, "verbs: out of memory");
    k->spec = device_opt && *device_opt ? device_opt : wx_param_str(WX_P_IB_DEVICES);
    k->src = device_opt && *device_opt ? "option device" : "WXFER_IB_DEVICES";
    k->list = v->get_device_list(&k->ndev);
    if (!k->list || k->ndev <= 0) {
        if (k->list)
            v->free_device_list(k->list);
        free(k);
        return wx_errf(-ENODEV, "no RDMA devices: ibv_get_device_list (%s) found none", v->path);
    }
    if (k->spec && *k->spec) {
        k->nlist = wx__verbs_parse_list(k->spec, k->names, k->ports, 32, &k->exclude);
        if (k->nlist < 0)
            rc = k->nlist;
    }
    if (!rc && k->nlist > 0 && !k->exclude) {
        rc = wx__nics_named(t, k);
    } else if (!rc) {
        rc = wx__nics_active(t, k);
        if (!rc && t->gpu >= 0)
            wx__nics_nearest(t, k);
    }
    if (!rc)
        rc = wx__nics_setup(t, k);
    for (int i = 0; i < k->ncand; i++)
        v->close_device(k->cand[i].ctx);
    v->free_device_list(k->list);
    free(k);
    if (rc)
        wx__verbs_close_nics(t);
    return rc;
}

void wx__verbs_close_nics(wx_verbs_t *t)
{
    const wx_verbs_api_t *v = t->v;
    for (int i = t->nnic - 1; i >= 0; i--) {
        wx__vnic_t *n = &t->nic[i];
        if (n->cq && v->destroy_cq(n->cq))
            wx_debugf("verbs: ibv_destroy_cq(%s) failed\n", n->name);
        if (n->pd && v->dealloc_pd(n->pd))
            wx_debugf("verbs: ibv_dealloc_pd(%s) failed\n", n->name);
        if (n->ctx)
            v->close_device(n->ctx);
        memset(n, 0, sizeof *n);
    }
    t->nnic = 0;
}
