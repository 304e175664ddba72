/* wxemu_verbs.c - EMULATION of libibverbs for the wxfer test suite: devices, ports, GIDs,
 * protection domains, memory regions, completion queues and the queue-pair state machine.
 * The data path (the emulated HCA) is in wxemu_verbs_hca.c. See wxemu_verbs.h and
 * docs/verbs.md. Never shipped; never a backend. */
#define _GNU_SOURCE
#include "wxemu_verbs.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <dirent.h>
#include <time.h>
#include <sys/uio.h>
#include <unistd.h>

/* verbs.h turns these names into macros/inlines; this file defines the real symbols. */
#undef ibv_query_port
#undef ibv_get_device_list

emu_cfg_t emu_cfg;
static pthread_once_t emu_once = PTHREAD_ONCE_INIT;
static struct ibv_device emu_devs[EMU_MAX_DEV];
static struct ibv_device *emu_list[EMU_MAX_DEV + 1];
pthread_mutex_t emu_glock = PTHREAD_MUTEX_INITIALIZER;
uint64_t emu_stat_reg, emu_stat_dereg;
uint32_t emu_keygen;

static uint64_t emu_env_u64(const char *name, uint64_t dflt)
{
    const char *s = getenv(name);
    return s && *s ? strtoull(s, NULL, 0) : dflt;
}

static void emu_init(void)
{
    const char *link = getenv("WXEMU_VERBS_LINK");
    emu_cfg.ndev = (int)emu_env_u64("WXEMU_VERBS_DEVICES", 1);
    if (emu_cfg.ndev < 0)
        emu_cfg.ndev = 0;
    if (emu_cfg.ndev > EMU_MAX_DEV)
        emu_cfg.ndev = EMU_MAX_DEV;
    emu_cfg.eth = link && strcmp(link, "eth") == 0;
    emu_cfg.max_msg = (uint32_t)emu_env_u64("WXEMU_VERBS_MAX_MSG", 1u << 30);
    emu_cfg.active_mtu = emu_cfg.eth ? IBV_MTU_1024 : IBV_MTU_4096;
    emu_cfg.retry_cap_ms = (uint32_t)emu_env_u64("WXEMU_VERBS_RETRY_CAP_MS", 2000);
    emu_cfg.sysfs = getenv("WXEMU_VERBS_SYSFS");
    emu_cfg.dmabuf = (int)emu_env_u64("WXEMU_VERBS_DMABUF", 1);
    emu_cfg.peermem = (int)emu_env_u64("WXEMU_VERBS_PEERMEM", 0);
    {
        const char *ml = getenv("WXEMU_VERBS_MEMLOCK");
        emu_cfg.memlock = ml && strcmp(ml, "nocap") == 0 ? 2 : ml && *ml ? atoi(ml) != 0 : 0;
    }
    for (int i = 0; i < emu_cfg.ndev; i++) {
        struct ibv_device *d = &emu_devs[i];
        d->node_type = IBV_NODE_CA;
        d->transport_type = IBV_TRANSPORT_IB;
        snprintf(d->name, sizeof d->name, "wxemu%d", i);
        snprintf(d->dev_name, sizeof d->dev_name, "uverbs-wxemu%d", i);
        snprintf(d->dev_path, sizeof d->dev_path, "/nonexistent/wxemu-verbs-emulation");
        snprintf(d->ibdev_path, sizeof d->ibdev_path, "%s/class/infiniband/wxemu%d",
                 emu_cfg.sysfs ? emu_cfg.sysfs : "/nonexistent/wxemu", i);
        emu_list[i] = d;
    }
    emu_list[emu_cfg.ndev] = NULL;
}

void emu_init_once(void) { pthread_once(&emu_once, emu_init); }

/* ---- identification for tests ---------------------------------------------------------- */

int wxemu_verbs_is_emulation(void) { return 1; }

/* 1 when the emulated host "has nvidia-peermem loaded" (WXEMU_VERBS_PEERMEM=1): ibv_reg_mr
 * then accepts device pointers. The verbs backend asks this instead of /sys/module when it
 * runs on the emulation. */
int wxemu_verbs_peermem(void)
{
    pthread_once(&emu_once, emu_init);
    return emu_cfg.peermem;
}

void wxemu_verbs_stats(uint64_t out[2])
{
    pthread_mutex_lock(&emu_glock);
    out[0] = emu_stat_reg;
    out[1] = emu_stat_dereg;
    pthread_mutex_unlock(&emu_glock);
}

/* ---- devices ----------------------------------------------------------------------------- */

struct ibv_device **ibv_get_device_list(int *num)
{
    struct ibv_device **l;
    pthread_once(&emu_once, emu_init);
    l = calloc((size_t)emu_cfg.ndev + 1, sizeof *l);
    if (!l) {
        errno = ENOMEM;
        return NULL;
    }
    memcpy(l, emu_list, ((size_t)emu_cfg.ndev + 1) * sizeof *l);
    if (num)
        *num = emu_cfg.ndev;
    return l;
}

void ibv_free_device_list(struct ibv_device **list) { free(list); }

const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }

uint64_t emu_proc_starttime(pid_t pid)
{
    char path[64], buf[1024], *p;
    unsigned long long st = 0;
    FILE *f;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    f = fopen(path, "r");
    if (!f)
        return 0;
    if (!fgets(buf, sizeof buf, f)) {
        fclose(f);
        return 0;
    }
    fclose(f);
    p = strrchr(buf, ')');
    if (!p)
        return 0;
    /* fields after ")": state(3) ... starttime(22) */
    if (sscanf(p + 2,
               "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d "
               "%*d %llu",
               &st) != 1)
        return 0;
    return st;
}

static void emu_shm_path(uint32_t lid, char *buf, size_t len)
{
    snprintf(buf, len, "/dev/shm/wxemu_verbs.%u.lid%u", (unsigned)getuid(), lid);
}

emu_shm_t *emu_shm_open_lid(uint32_t lid)
{
    char path[128];
    emu_shm_t *s;
    int fd;
    emu_shm_path(lid, path, sizeof path);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    s = mmap(NULL, sizeof *s, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (s == MAP_FAILED)
        return NULL;
    if (s->magic != EMU_MAGIC || s->version != EMU_VERSION) {
        munmap(s, sizeof *s);
        return NULL;
    }
    return s;
}

/* 1 if the HCA file at path belongs to a live process, or is too new to judge (its creator
 * may not have written the header yet). */
static int emu_owner_alive(const char *path)
{
    emu_shm_t hdr;
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC), alive = 0;
    if (fd < 0)
        return 0;
    if (read(fd, &hdr, offsetof(emu_shm_t, mr)) == (ssize_t)offsetof(emu_shm_t, mr) &&
        hdr.magic == EMU_MAGIC)
        alive = (kill(hdr.pid, 0) == 0 || errno == EPERM) &&
                emu_proc_starttime(hdr.pid) == hdr.starttime;
    else
        alive = fstat(fd, &st) == 0 && time(NULL) - st.st_mtime < 5;
    close(fd);
    return alive;
}

/* Remove HCA files left by emulated HCAs whose process died without closing the device. */
static void emu_sweep(void)
{
    char prefix[64], path[400];
    struct dirent *e;
    DIR *d = opendir("/dev/shm");
    if (!d)
        return;
    snprintf(prefix, sizeof prefix, "wxemu_verbs.%u.lid", (unsigned)getuid());
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, strlen(prefix)) != 0)
            continue;
        snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
        if (!emu_owner_alive(path))
            unlink(path);
    }
    closedir(d);
}

/* Claim a LID: the HCA file is created with O_EXCL; files of dead processes are reclaimed. */
static int emu_claim_lid(emu_ctx_t *ec)
{
    uint32_t lid = (uint32_t)(getpid() * 7u + (uint32_t)ec->devidx * 131u) % 0xbff0u + 1;
    emu_sweep();
    for (int tries = 0; tries < 0xbff0; tries++, lid = lid % 0xbff0u + 1) {
        char path[128];
        int fd;
        emu_shm_path(lid, path, sizeof path);
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST && !emu_owner_alive(path)) {
            unlink(path);
            fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        }
        if (fd < 0) {
            if (errno == EEXIST)
                continue;
            return -errno;
        }
        if (ftruncate(fd, sizeof(emu_shm_t)) != 0) {
            int e = errno;
            close(fd);
            unlink(path);
            return -e;
        }
        ec->shm = mmap(NULL, sizeof(emu_shm_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (ec->shm == MAP_FAILED) {
            ec->shm = NULL;
            unlink(path);
            return -ENOMEM;
        }
        ec->shm->pid = getpid();
        ec->shm->lid = lid;
        ec->shm->starttime = emu_proc_starttime(getpid());
        ec->shm->version = EMU_VERSION;
        __atomic_store_n(&ec->shm->magic, EMU_MAGIC, __ATOMIC_RELEASE);
        ec->lid = lid;
        snprintf(ec->shm_path, sizeof ec->shm_path, "%s", path);
        return 0;
    }
    return -EADDRINUSE;
}

static int emu_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    (void)cq;
    (void)solicited_only;
    return EOPNOTSUPP; /* completion channels are not emulated */
}

static int emu_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    (void)qp;
    *bad = wr;
    return EOPNOTSUPP; /* receives are not emulated: the backend only uses RDMA WRITE */
}

struct ibv_context *ibv_open_device(struct ibv_device *dev)
{
    emu_ctx_t *ec;
    int rc;
    pthread_once(&emu_once, emu_init);
    if (!dev || dev < emu_devs || dev >= emu_devs + emu_cfg.ndev) {
        errno = ENODEV;
        return NULL;
    }
    ec = calloc(1, sizeof *ec);
    if (!ec) {
        errno = ENOMEM;
        return NULL;
    }
    ec->devidx = (int)(dev - emu_devs);
    ec->ctx.device = dev;
    ec->ctx.cmd_fd = -1;
    ec->ctx.async_fd = -1;
    ec->ctx.num_comp_vectors = 1;
    ec->ctx.abi_compat = NULL; /* not an extended context: verbs.h inlines use the exports */
    /* The inline ibv_post_send / ibv_poll_cq / ibv_req_notify_cq of verbs.h call these. */
    ec->ctx.ops.post_send = emu_post_send;
    ec->ctx.ops.post_recv = emu_post_recv;
    ec->ctx.ops.poll_cq = emu_poll_cq;
    ec->ctx.ops.req_notify_cq = emu_req_notify_cq;
    pthread_mutex_init(&ec->ctx.mutex, NULL);
    pthread_mutex_init(&ec->lock, NULL);
    pthread_cond_init(&ec->cond, NULL);
    ec->next_pd = 1;
    for (int i = 0; i < EMU_MAX_MR; i++)
        ec->mr_fd[i] = -1;
    rc = emu_claim_lid(ec);
    if (rc == 0)
        rc = emu_hca_start(ec);
    if (rc) {
        if (ec->shm) {
            munmap(ec->shm, sizeof *ec->shm);
            unlink(ec->shm_path);
        }
        free(ec);
        errno = -rc;
        return NULL;
    }
    /* Let the writer's emulated HCA (another process) reach our memory with
     * process_vm_writev even under Yama ptrace_scope=1. */
#ifdef PR_SET_PTRACER
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
    return &ec->ctx;
}

int ibv_close_device(struct ibv_context *ctx)
{
    emu_ctx_t *ec = (emu_ctx_t *)ctx;
    if (ec->nres > 0)
        fprintf(stderr,
                "wxemu_verbs (emulation): ibv_close_device with %d objects still "
                "allocated (a real driver leaks them)\n",
                ec->nres);
    emu_hca_stop(ec);
    __atomic_store_n(&ec->shm->magic, 0, __ATOMIC_RELEASE);
    munmap(ec->shm, sizeof *ec->shm);
    unlink(ec->shm_path);
    free(ec);
    return 0;
}

int ibv_query_device(struct ibv_context *ctx, struct ibv_device_attr *a)
{
    (void)ctx;
    memset(a, 0, sizeof *a);
    snprintf(a->fw_ver, sizeof a->fw_ver, "wxemu-emulation");
    a->max_mr_size = ~0ull;
    a->page_size_cap = 0xfffff000;
    a->max_qp = EMU_MAX_QP;
    a->max_qp_wr = EMU_MAX_QP_WR;
    a->max_sge = EMU_MAX_SGE;
    a->max_cq = 1024;
    a->max_cqe = EMU_MAX_CQE;
    a->max_mr = EMU_MAX_MR;
    a->max_pd = 1024;
    a->max_qp_rd_atom = 16;
    a->max_qp_init_rd_atom = 16;
    a->phys_port_cnt = 1;
    return 0;
}

/* The exported compat symbol; verbs.h's inline ___ibv_query_port calls it for contexts that
 * are not extended (ours), passing a full, zeroed struct ibv_port_attr. */
int ibv_query_port(struct ibv_context *ctx, uint8_t port, struct _compat_ibv_port_attr *pa)
{
    emu_ctx_t *ec = (emu_ctx_t *)ctx;
    struct ibv_port_attr *a = (struct ibv_port_attr *)pa;
    if (port != 1)
        return EINVAL;
    memset(a, 0, sizeof *a);
    a->state = IBV_PORT_ACTIVE;
    a->max_mtu = IBV_MTU_4096;
    a->active_mtu = (enum ibv_mtu)emu_cfg.active_mtu;
    a->gid_tbl_len = emu_cfg.eth ? 2 : 1;
    a->max_msg_sz = emu_cfg.max_msg;
    a->pkey_tbl_len = 1;
    a->lid = emu_cfg.eth ? 0 : (uint16_t)ec->lid;
    a->link_layer = emu_cfg.eth ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
    a->phys_state = 5; /* LinkUp */
    a->active_width = 2;
    a->active_speed = 32;
    return 0;
}

void emu_gid_of(uint32_t lid, int index, union ibv_gid *gid)
{
    memset(gid, 0, sizeof *gid);
    if (index == 0) {
        gid->raw[0] = 0xfe;
        gid->raw[1] = 0x80;
    } else {
        gid->raw[10] = 0xff;
        gid->raw[11] = 0xff;
        gid->raw[12] = 10;
        gid->raw[13] = 77;
    }
    gid->raw[14] = (uint8_t)(lid >> 8);
    gid->raw[15] = (uint8_t)lid;
}

uint32_t emu_lid_of_gid(const union ibv_gid *g)
{
    int ll = g->raw[0] == 0xfe && g->raw[1] == 0x80;
    int v4 = g->raw[10] == 0xff && g->raw[11] == 0xff && g->raw[12] == 10 && g->raw[13] == 77;
    if (!ll && !v4)
        return 0;
    return ((uint32_t)g->raw[14] << 8) | g->raw[15];
}

int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid)
{
    emu_ctx_t *ec = (emu_ctx_t *)ctx;
    if (port != 1 || index < 0 || index >= (emu_cfg.eth ? 2 : 1))
        return EINVAL;
    emu_gid_of(ec->lid, index, gid);
    return 0;
}

int _ibv_query_gid_ex(struct ibv_context *ctx, uint32_t port, uint32_t index,
                      struct ibv_gid_entry *e, uint32_t flags, size_t size)
{
    emu_ctx_t *ec = (emu_ctx_t *)ctx;
    if (flags || size < sizeof *e || port != 1 || index >= (uint32_t)(emu_cfg.eth ? 2 : 1))
        return EINVAL;
    memset(e, 0, sizeof *e);
    emu_gid_of(ec->lid, (int)index, &e->gid);
    e->gid_index = index;
    e->port_num = port;
    e->gid_type =
        !emu_cfg.eth ? IBV_GID_TYPE_IB : (index == 0 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2);
    return 0;
}

/* ---- protection domains and memory regions ---------------------------------------------- */

struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx)
{
    emu_ctx_t *ec = (emu_ctx_t *)ctx;
    emu_pd_t *p = calloc(1, sizeof *p);
    if (!p) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&ec->lock);
    p->id = ec->next_pd++;
    ec->nres++;
    pthread_mutex_unlock(&ec->lock);
    p->pd.context = ctx;
    p->pd.handle = p->id;
    return &p->pd;
}

/* One resource of ec released, unless *users (read under ec's lock) still use it: 0, or EBUSY as
 * the kernel says. */
static int emu_release(emu_ctx_t *ec, const int *users)
{
    int rc = 0;
    pthread_mutex_lock(&ec->lock);
    if (*users > 0)
        rc = EBUSY;
    else
        ec->nres--;
    pthread_mutex_unlock(&ec->lock);
    return rc;
}

int ibv_dealloc_pd(struct ibv_pd *pd)
{
    emu_pd_t *p = (emu_pd_t *)pd;
    int rc = emu_release((emu_ctx_t *)pd->context, &p->nobj); /* MRs or QPs still use it */
    if (!rc)
        free(p);
    return rc;
}

/* ---- completion queues ------------------------------------------------------------------ */

struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector)
{
    emu_ctx_t *ec = (emu_ctx_t *)ctx;
    emu_cq_t *c;
    if (cqe < 1 || cqe > EMU_MAX_CQE || comp_vector < 0 || comp_vector >= 1) {
        errno = EINVAL;
        return NULL;
    }
    if (channel) {
        errno = EOPNOTSUPP; /* completion channels are not emulated */
        return NULL;
    }
    c = calloc(1, sizeof *c);
    if (c)
        c->ring = calloc((size_t)cqe, sizeof *c->ring);
    if (!c || !c->ring) {
        free(c);
        errno = ENOMEM;
        return NULL;
    }
    c->cap = (uint32_t)cqe;
    c->cq.context = ctx;
    c->cq.cq_context = cq_context;
    c->cq.cqe = cqe;
    pthread_mutex_init(&c->cq.mutex, NULL);
    pthread_cond_init(&c->cq.cond, NULL);
    pthread_mutex_lock(&ec->lock);
    ec->nres++;
    pthread_mutex_unlock(&ec->lock);
    return &c->cq;
}

int ibv_destroy_cq(struct ibv_cq *cq)
{
    emu_cq_t *c = (emu_cq_t *)cq;
    int rc = emu_release((emu_ctx_t *)cq->context, &c->nqp); /* QPs still use it */
    if (!rc) {
        free(c->ring);
        free(c);
    }
    return rc;
}

/* ---- queue pairs ------------------------------------------------------------------------ */

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *ia)
{
    emu_ctx_t *ec = (emu_ctx_t *)pd->context;
    emu_pd_t *p = (emu_pd_t *)pd;
    emu_qp_t *q;
    int slot = -1;
    if (ia->qp_type != IBV_QPT_RC) {
        errno = EOPNOTSUPP; /* the emulation knows RC only */
        return NULL;
    }
    if (!ia->send_cq || !ia->recv_cq || ia->send_cq->context != pd->context ||
        ia->recv_cq->context != pd->context || ia->cap.max_send_wr < 1 ||
        ia->cap.max_send_wr > EMU_MAX_QP_WR || ia->cap.max_recv_wr > EMU_MAX_QP_WR ||
        ia->cap.max_send_sge > EMU_MAX_SGE || ia->cap.max_recv_sge > EMU_MAX_SGE ||
        ia->cap.max_inline_data > 0 || ia->srq) {
        errno = EINVAL;
        return NULL;
    }
    q = calloc(1, sizeof *q);
    if (q)
        q->sq = calloc(ia->cap.max_send_wr, sizeof *q->sq);
    if (!q || !q->sq) {
        free(q);
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&ec->lock);
    for (int i = 0; i < EMU_MAX_QP; i++)
        if (!ec->qps[i] && ec->shm->qp[i].qpn == 0) {
            slot = i;
            break;
        }
    if (slot < 0) {
        pthread_mutex_unlock(&ec->lock);
        free(q->sq);
        free(q);
        errno = ENOMEM;
        return NULL;
    }
    q->ec = ec;
    q->epd = p;
    q->scq = (emu_cq_t *)ia->send_cq;
    q->rcq = (emu_cq_t *)ia->recv_cq;
    q->cap = ia->cap;
    q->sig_all = ia->sq_sig_all;
    q->slot = &ec->shm->qp[slot];
    q->qp.context = pd->context;
    q->qp.qp_context = ia->qp_context;
    q->qp.pd = pd;
    q->qp.send_cq = ia->send_cq;
    q->qp.recv_cq = ia->recv_cq;
    q->qp.qp_num = EMU_QPN_BASE + (uint32_t)slot;
    q->qp.handle = (uint32_t)slot;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_type = IBV_QPT_RC;
    pthread_mutex_init(&q->qp.mutex, NULL);
    pthread_cond_init(&q->qp.cond, NULL);
    memset(q->slot, 0, sizeof *q->slot);
    q->slot->pd = p->id;
    q->slot->state = IBV_QPS_RESET;
    __atomic_store_n(&q->slot->qpn, q->qp.qp_num, __ATOMIC_RELEASE);
    ec->qps[slot] = q;
    q->scq->nqp++;
    if (q->rcq != q->scq)
        q->rcq->nqp++;
    p->nobj++;
    ec->nres++;
    pthread_mutex_unlock(&ec->lock);
    return &q->qp;
}

/* Required and optional attribute masks per transition of an RC QP (IB spec 11.2.5 /
 * the kernel's ib_modify_qp_is_ok table). */
static int emu_masks(int cur, int next, int *req, int *opt)
{
    *req = IBV_QP_STATE;
    *opt = 0;
    if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
        *opt = IBV_QP_CUR_STATE;
        return 0;
    }
    if (cur == IBV_QPS_RESET && next == IBV_QPS_INIT) {
        *req |= IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        return 0;
    }
    if (cur == IBV_QPS_INIT && next == IBV_QPS_INIT) {
        *opt = IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        return 0;
    }
    if (cur == IBV_QPS_INIT && next == IBV_QPS_RTR) {
        *req |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        *opt = IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
        return 0;
    }
    if (cur == IBV_QPS_RTR && next == IBV_QPS_RTS) {
        *req |= IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                IBV_QP_MAX_QP_RD_ATOMIC;
        *opt = IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | IBV_QP_ALT_PATH |
               IBV_QP_PATH_MIG_STATE;
        return 0;
    }
    if (cur == IBV_QPS_RTS && next == IBV_QPS_RTS) {
        *opt = IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | IBV_QP_ALT_PATH |
               IBV_QP_PATH_MIG_STATE;
        return 0;
    }
    return -1;
}

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask)
{
    emu_qp_t *q = (emu_qp_t *)qp;
    emu_ctx_t *ec = q->ec;
    int cur, next, req, opt, eth = emu_cfg.eth;
    pthread_mutex_lock(&ec->lock);
    cur = (int)q->slot->state;
    next = (mask & IBV_QP_STATE) ? (int)a->qp_state : cur;
    if (emu_masks(cur, next, &req, &opt) || (mask & req) != req || (mask & ~(req | opt)))
        goto inval;
    if ((mask & IBV_QP_CUR_STATE) && (int)a->cur_qp_state != cur)
        goto inval;
    if ((mask & IBV_QP_PORT) && a->port_num != 1)
        goto inval;
    if ((mask & IBV_QP_PKEY_INDEX) && a->pkey_index != 0)
        goto inval;
    if ((mask & IBV_QP_ACCESS_FLAGS) &&
        (a->qp_access_flags & ~(unsigned)(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                          IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)))
        goto inval;
    if ((mask & IBV_QP_PATH_MTU) &&
        (a->path_mtu < IBV_MTU_256 || (int)a->path_mtu > emu_cfg.active_mtu))
        goto inval;
    if ((mask & IBV_QP_DEST_QPN) && a->dest_qp_num > 0xffffff)
        goto inval;
    if (mask & IBV_QP_AV) {
        if (a->ah_attr.port_num != 1)
            goto inval;
        if (eth && (!a->ah_attr.is_global || a->ah_attr.grh.sgid_index >= 2))
            goto inval; /* RoCE needs a GRH */
        if (!eth && a->ah_attr.dlid == 0)
            goto inval;
        if (a->ah_attr.is_global && a->ah_attr.grh.sgid_index >= (eth ? 2 : 1))
            goto inval;
    }
    if ((mask & IBV_QP_TIMEOUT) && a->timeout > 31)
        goto inval;
    if ((mask & IBV_QP_RETRY_CNT) && a->retry_cnt > 7)
        goto inval;
    if ((mask & IBV_QP_RNR_RETRY) && a->rnr_retry > 7)
        goto inval;
    if (mask & IBV_QP_PORT)
        q->port = a->port_num;
    if (mask & IBV_QP_ACCESS_FLAGS) {
        q->access = a->qp_access_flags;
        q->slot->access = a->qp_access_flags;
    }
    if (mask & IBV_QP_PATH_MTU) {
        q->path_mtu = (uint8_t)a->path_mtu;
        q->slot->path_mtu = (uint8_t)a->path_mtu;
    }
    if (mask & IBV_QP_AV) {
        q->ah = a->ah_attr;
        q->slot->dlid = (uint16_t)(a->ah_attr.is_global ? emu_lid_of_gid(&a->ah_attr.grh.dgid)
                                                        : a->ah_attr.dlid);
    }
    if (mask & IBV_QP_DEST_QPN) {
        q->dest_qpn = a->dest_qp_num;
        q->slot->dest_qpn = a->dest_qp_num;
    }
    if (mask & IBV_QP_RQ_PSN) {
        q->rq_psn = a->rq_psn & 0xffffff;
        q->slot->rq_psn = q->rq_psn;
    }
    if (mask & IBV_QP_SQ_PSN)
        q->sq_psn = a->sq_psn & 0xffffff;
    if (mask & IBV_QP_TIMEOUT)
        q->timeout = a->timeout;
    if (mask & IBV_QP_RETRY_CNT)
        q->retry_cnt = a->retry_cnt;
    if (mask & IBV_QP_RNR_RETRY)
        q->rnr_retry = a->rnr_retry;
    if (next == IBV_QPS_RESET) {
        q->posted = q->executed = q->retired = 0;
        q->psn_checked = 0;
    }
    if (next == IBV_QPS_ERR)
        emu_qp_to_error(q);
    q->qp.state = (enum ibv_qp_state)next;
    __atomic_store_n(&q->slot->state, (uint32_t)next, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&ec->cond);
    pthread_mutex_unlock(&ec->lock);
    return 0;
inval:
    pthread_mutex_unlock(&ec->lock);
    return EINVAL;
}

int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask, struct ibv_qp_init_attr *ia)
{
    emu_qp_t *q = (emu_qp_t *)qp;
    (void)mask;
    pthread_mutex_lock(&q->ec->lock);
    memset(a, 0, sizeof *a);
    a->qp_state = a->cur_qp_state = (enum ibv_qp_state)q->slot->state;
    a->path_mtu = (enum ibv_mtu)q->path_mtu;
    a->qp_access_flags = q->access;
    a->dest_qp_num = q->dest_qpn;
    a->sq_psn = q->sq_psn;
    a->rq_psn = q->rq_psn;
    a->cap = q->cap;
    a->ah_attr = q->ah;
    a->port_num = q->port;
    a->timeout = q->timeout;
    a->retry_cnt = q->retry_cnt;
    a->rnr_retry = q->rnr_retry;
    if (ia) {
        memset(ia, 0, sizeof *ia);
        ia->send_cq = &q->scq->cq;
        ia->recv_cq = &q->rcq->cq;
        ia->cap = q->cap;
        ia->qp_type = IBV_QPT_RC;
        ia->sq_sig_all = q->sig_all;
    }
    pthread_mutex_unlock(&q->ec->lock);
    return 0;
}

int ibv_destroy_qp(struct ibv_qp *qp)
{
    emu_qp_t *q = (emu_qp_t *)qp;
    emu_ctx_t *ec = q->ec;
    pthread_mutex_lock(&ec->lock);
    q->destroyed = 1;
    while (q->busy)
        pthread_cond_wait(&ec->cond, &ec->lock);
    ec->qps[qp->handle] = NULL;
    __atomic_store_n(&q->slot->state, IBV_QPS_RESET, __ATOMIC_RELEASE);
    __atomic_store_n(&q->slot->qpn, 0, __ATOMIC_RELEASE);
    q->scq->nqp--;
    if (q->rcq != q->scq)
        q->rcq->nqp--;
    q->epd->nobj--;
    ec->nres--;
    pthread_mutex_unlock(&ec->lock);
    if (q->remote)
        munmap(q->remote, sizeof *q->remote);
    free(q->sq);
    free(q);
    return 0;
}

const char *ibv_wc_status_str(enum ibv_wc_status st)
{
    static const char *const names[] = {
        [IBV_WC_SUCCESS] = "success",
        [IBV_WC_LOC_LEN_ERR] = "local length error",
        [IBV_WC_LOC_QP_OP_ERR] = "local QP operation error",
        [IBV_WC_LOC_EEC_OP_ERR] = "local EE context operation error",
        [IBV_WC_LOC_PROT_ERR] = "local protection error",
        [IBV_WC_WR_FLUSH_ERR] = "Work Request Flushed Error",
        [IBV_WC_MW_BIND_ERR] = "memory management operation error",
        [IBV_WC_BAD_RESP_ERR] = "bad response error",
        [IBV_WC_LOC_ACCESS_ERR] = "local access error",
        [IBV_WC_REM_INV_REQ_ERR] = "remote invalid request error",
        [IBV_WC_REM_ACCESS_ERR] = "remote access error",
        [IBV_WC_REM_OP_ERR] = "remote operation error",
        [IBV_WC_RETRY_EXC_ERR] = "transport retry counter exceeded",
        [IBV_WC_RNR_RETRY_EXC_ERR] = "RNR retry counter exceeded",
        [IBV_WC_LOC_RDD_VIOL_ERR] = "local RDD violation error",
        [IBV_WC_REM_INV_RD_REQ_ERR] = "remote invalid RD request",
        [IBV_WC_REM_ABORT_ERR] = "aborted error",
        [IBV_WC_INV_EECN_ERR] = "invalid EE context number",
        [IBV_WC_INV_EEC_STATE_ERR] = "invalid EE context state",
        [IBV_WC_FATAL_ERR] = "fatal error",
        [IBV_WC_RESP_TIMEOUT_ERR] = "response timeout error",
        [IBV_WC_GENERAL_ERR] = "general error",
    };
    if ((unsigned)st < sizeof names / sizeof names[0] && names[st])
        return names[st];
    return "unknown";
}
