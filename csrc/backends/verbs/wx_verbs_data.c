/* wx_verbs_data.c - the verbs backend (ibverbs RC RDMA WRITE): ops table, open/close, the data
 * path and the progress thread.
 *
 * Data path: one RDMA WRITE work request per validated write (<= base.max_write, which is
 * at most the port's max_msg_sz), striped round-robin over the peer's QPs. Only every
 * sig_every-th WR is signaled; on RC a completion implies that every earlier WR of that send
 * queue has completed, so one CQE completes a run of ops. When a QP's last signaled WR has
 * completed but unsignaled WRs remain, the progress thread posts a signaled zero-length
 * RDMA WRITE behind them so that they complete too. wr_id = QP index << 48 | sequence.
 * Completion status is checked first; the first error puts the QP in the error state: that
 * op fails with the status string, wr_id and qp_num, later ones are flushed with the same
 * reason, and further writes to that peer fail at once. */
#include "wx_verbs.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define WX__POLL_BATCH 32
#define WX__MAX_DONE 8192 /* > the largest depth */
#define WX__MAX_DEPTH 4096

typedef struct wx__done {
    wx_op_t *op;
    int status;
    const char *msg;
} wx__done_t;

static const char *const wx__verbs_known[] = {"device",
                                              "gid_index",
                                              "chunk",
                                              "depth",
                                              "gpu",
                                              "qps",
                                              "sig_every",
                                              "timeout",
                                              "retry_cnt",
                                              "reg",
                                              "gpu_memory",
#ifdef WX_TESTING /* fault injection: test builds only (WXFER_TESTING=1) */
                                              "_test_rkey_xor",
                                              "_test_raddr_add",
#endif
                                              NULL};

static int wx__status_errno(enum ibv_wc_status st)
{
    switch (st) {
    case IBV_WC_REM_ACCESS_ERR:
        return -EACCES;
    case IBV_WC_LOC_PROT_ERR:
        return -EFAULT;
    case IBV_WC_LOC_LEN_ERR:
        return -EMSGSIZE;
    case IBV_WC_RETRY_EXC_ERR:
        return -EHOSTUNREACH;
    case IBV_WC_RNR_RETRY_EXC_ERR:
        return -EHOSTUNREACH;
    case IBV_WC_WR_FLUSH_ERR:
        return -ECANCELED;
    default:
        return -EIO;
    }
}

static const char *wx__status_name(enum ibv_wc_status st)
{
    switch (st) {
    case IBV_WC_SUCCESS:
        return "IBV_WC_SUCCESS";
    case IBV_WC_LOC_LEN_ERR:
        return "IBV_WC_LOC_LEN_ERR";
    case IBV_WC_LOC_QP_OP_ERR:
        return "IBV_WC_LOC_QP_OP_ERR";
    case IBV_WC_LOC_PROT_ERR:
        return "IBV_WC_LOC_PROT_ERR";
    case IBV_WC_WR_FLUSH_ERR:
        return "IBV_WC_WR_FLUSH_ERR";
    case IBV_WC_REM_ACCESS_ERR:
        return "IBV_WC_REM_ACCESS_ERR";
    case IBV_WC_REM_INV_REQ_ERR:
        return "IBV_WC_REM_INV_REQ_ERR";
    case IBV_WC_REM_OP_ERR:
        return "IBV_WC_REM_OP_ERR";
    case IBV_WC_RETRY_EXC_ERR:
        return "IBV_WC_RETRY_EXC_ERR";
    case IBV_WC_RNR_RETRY_EXC_ERR:
        return "IBV_WC_RNR_RETRY_EXC_ERR";
    case IBV_WC_GENERAL_ERR:
        return "IBV_WC_GENERAL_ERR";
    default:
        return "IBV_WC_?";
    }
}

int wx__verbs_add_qp(wx_verbs_t *t, wx__vqp_t *q)
{
    pthread_mutex_lock(&t->qlock);
    if (t->nqps == t->cap_qps) {
        uint32_t cap = t->cap_qps ? 2 * t->cap_qps : 64;
        wx__vqp_t **nq;
        if (cap > (1u << WX_VERBS_QP_BITS)) {
            pthread_mutex_unlock(&t->qlock);
            return wx_errf(-ENOSPC, "verbs: too many queue pairs in one transport");
        }
        nq = realloc(t->qps, cap * sizeof *nq);
        if (!nq) {
            pthread_mutex_unlock(&t->qlock);
            return wx_errf(-ENOMEM, "verbs: out of memory");
        }
        t->qps = nq;
        t->cap_qps = cap;
    }
    /* Indices are never reused, so a stale CQE of a destroyed QP cannot hit a new one. */
    q->idx = t->nqps;
    t->qps[t->nqps++] = q;
    pthread_mutex_unlock(&t->qlock);
    return 0;
}

static void wx__deliver(wx_verbs_t *t, wx__done_t *d, int n)
{
    for (int i = 0; i < n; i++)
        if (d[i].op)
            d[i].op->done(d[i].op, d[i].status, d[i].msg);
    if (n) {
        pthread_mutex_lock(&t->wlock);
        for (int i = 0; i < n; i++)
            if (d[i].op)
                t->inflight--;
        pthread_mutex_unlock(&t->wlock);
    }
}

/* Complete every outstanding op of q with err (QP going away or CQ failure). */
void wx__verbs_fail_qp(wx_verbs_t *t, wx__vqp_t *q, int err, const char *msg)
{
    wx__done_t d[64];
    int nd;
    if (!q)
        return;
    do {
        nd = 0;
        pthread_mutex_lock(&q->lock);
        if (!q->broken && err != -ECANCELED) {
            q->broken = 1;
            q->broken_errno = err;
            snprintf(q->err, sizeof q->err, "%s", msg);
        }
        while (q->tail < q->head && nd < 64) {
            struct wx__vslot *s = &q->ring[q->tail % q->depth];
            d[nd].op = s->op;
            d[nd].status = err;
            d[nd].msg = q->broken && err != -ECANCELED ? q->err : msg;
            s->op = NULL;
            nd++;
            q->tail++;
        }
        pthread_mutex_unlock(&q->lock);
        wx__deliver(t, d, nd);
    } while (nd == 64);
}

/* Handle one CQE; appends completed ops to d. Called with t->qlock held. */
static int wx__on_cqe(wx_verbs_t *t, const struct ibv_wc *wc, wx__done_t *d, int nd)
{
    uint32_t idx = (uint32_t)(wc->wr_id >> 48);
    wx__vqp_t *q = idx < t->nqps ? t->qps[idx] : NULL;
    uint64_t seq;
    if (!q || !q->peer) {
        wx_debugf("verbs: completion for unknown wr_id 0x%llx (qp_num 0x%x)\n",
                  (unsigned long long)wc->wr_id, wc->qp_num);
        return nd;
    }
    pthread_mutex_lock(&q->lock);
    seq = q->tail + (((wc->wr_id & WX_VERBS_SEQ_MASK) - q->tail) & WX_VERBS_SEQ_MASK);
    if (seq >= q->head) {
        pthread_mutex_unlock(&q->lock);
        wx_debugf("verbs: stale completion wr_id 0x%llx\n", (unsigned long long)wc->wr_id);
        return nd;
    }
    if (wc->status != IBV_WC_SUCCESS && !q->broken) {
        struct wx__vslot *s = &q->ring[seq % q->depth];
        q->broken = 1;
        q->broken_errno = wx__status_errno(wc->status);
        snprintf(q->err, sizeof q->err,
                 "verbs: RDMA WRITE to %s failed: %s (%s, status %d, vendor_err 0x%x) on %s "
                 "port %u, qp_num 0x%x, wr_id 0x%llx (op wr_id 0x%llx)",
                 q->peer->name, t->v->wc_status_str(wc->status), wx__status_name(wc->status),
                 (int)wc->status, wc->vendor_err, q->nic->name, q->nic->port, wc->qp_num,
                 (unsigned long long)wc->wr_id, (unsigned long long)(s->op ? s->op->wr_id : 0));
    }
    /* Earlier unsignaled WRs completed successfully (RC completes in order; an error
     * would have produced its own CQE first). */
    while (q->tail <= seq) {
        struct wx__vslot *s = &q->ring[q->tail % q->depth];
        int last = q->tail == seq;
        d[nd].op = s->op;
        d[nd].status = (!last || wc->status == IBV_WC_SUCCESS) ? 0 : q->broken_errno;
        d[nd].msg = d[nd].status ? q->err : NULL;
        if (last && s->sig)
            q->sig_done++;
        s->op = NULL;
        q->tail++;
        nd++;
    }
    pthread_mutex_unlock(&q->lock);
    return nd;
}

/* Post a signaled zero-length write behind unsignaled tails that nothing else will complete. */
static void wx__flush_tails(wx_verbs_t *t)
{
    pthread_mutex_lock(&t->qlock);
    for (uint32_t i = 0; i < t->nqps; i++) {
        wx__vqp_t *q = t->qps[i];
        struct ibv_send_wr wr, *bad = NULL;
        if (!q || !q->peer)
            continue;
        pthread_mutex_lock(&q->lock);
        if (q->head > q->tail && q->sig_done == q->sig_posted && !q->broken &&
            q->head - q->tail < q->depth) {
            memset(&wr, 0, sizeof wr);
            wr.wr_id = ((uint64_t)q->idx << 48) | (q->head & WX_VERBS_SEQ_MASK);
            wr.opcode = IBV_WR_RDMA_WRITE;
            wr.send_flags = IBV_SEND_SIGNALED;
            wr.num_sge = 0;
            wr.wr.rdma.remote_addr = q->last_raddr;
            wr.wr.rdma.rkey = q->last_rkey;
            if (ibv_post_send(q->qp, &wr, &bad) == 0) {
                q->ring[q->head % q->depth].op = NULL;
                q->ring[q->head % q->depth].sig = 1;
                q->head++;
                q->sig_posted++;
                q->unsig_run = 0;
            }
        }
        pthread_mutex_unlock(&q->lock);
    }
    pthread_mutex_unlock(&t->qlock);
}

static void *wx__progress(void *arg)
{
    wx_verbs_t *t = arg;
    struct ibv_wc wc[WX__POLL_BATCH];
    wx__done_t *d = calloc(WX__MAX_DONE, sizeof *d);
    unsigned idle = 0;
    if (!d)
        return NULL;
    while (!__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) {
        int got = 0;
        for (int i = 0; i < t->nnic; i++) {
            int n, nd = 0;
            pthread_mutex_lock(&t->qlock);
            n = ibv_poll_cq(t->nic[i].cq, WX__POLL_BATCH, wc);
            if (n < 0) {
                char msg[WX_ERRMSG_MAX / 2];
                snprintf(msg, sizeof msg,
                         "verbs: ibv_poll_cq on %s failed (%d: %s); its queue "
                         "pairs cannot complete",
                         t->nic[i].name, n, strerror(n == -1 ? errno : -n));
                for (uint32_t k = 0; k < t->nqps; k++)
                    if (t->qps[k] && t->qps[k]->nic == &t->nic[i] && t->qps[k]->peer) {
                        wx__vqp_t *q = t->qps[k];
                        pthread_mutex_unlock(&t->qlock);
                        wx__verbs_fail_qp(t, q, -EIO, msg);
                        pthread_mutex_lock(&t->qlock);
                    }
                pthread_mutex_unlock(&t->qlock);
                continue;
            }
            for (int k = 0; k < n; k++) {
                if (nd + (int)t->depth + 1 > WX__MAX_DONE) {
                    pthread_mutex_unlock(&t->qlock);
                    wx__deliver(t, d, nd);
                    nd = 0;
                    pthread_mutex_lock(&t->qlock);
                }
                nd = wx__on_cqe(t, &wc[k], d, nd);
            }
            pthread_mutex_unlock(&t->qlock);
            wx__deliver(t, d, nd);
            got += n;
        }
        if (got) {
            idle = 0;
            continue;
        }
        wx__flush_tails(t);
        idle++;
        pthread_mutex_lock(&t->wlock);
        if (t->inflight == 0 && !t->stop) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 20 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&t->wcond, &t->wlock, &ts);
            pthread_mutex_unlock(&t->wlock);
        } else {
            pthread_mutex_unlock(&t->wlock);
            if (idle < 64) {
                sched_yield();
            } else {
                struct timespec ns = {0, 20000};
                nanosleep(&ns, NULL);
            }
        }
    }
    free(d);
    return NULL;
}

/* ---- ops --------------------------------------------------------------------------------- */

static int wx__verbs_probe(const wx_opts_t *opts, char *why, size_t why_len)
{
    const wx_verbs_api_t *v = wx_verbs_api(why, why_len);
    struct ibv_device **l;
    int n = 0;
    WX_UNUSED(opts);
    if (!v)
        return -ENOSYS;
    l = v->get_device_list(&n);
    if (l)
        v->free_device_list(l);
    if (!l || n <= 0) {
        snprintf(why, why_len,
                 "no RDMA devices (ibv_get_device_list in %s found none; "
                 "/sys/class/infiniband is empty)",
                 v->path);
        return -ENODEV;
    }
    return 0;
}

static int wx__opt_int(const wx_opts_t *o, const char *k, uint64_t dflt, uint64_t lo, uint64_t hi,
                       uint64_t *out)
{
    int rc = wx_opt_u64(o, k, dflt, out);
    if (rc)
        return rc;
    if (*out < lo || *out > hi)
        return wx_errf(-EINVAL, "verbs: option %s=%llu out of range [%llu, %llu]", k,
                       (unsigned long long)*out, (unsigned long long)lo, (unsigned long long)hi);
    return 0;
}

static void wx__verbs_close(wx_transport_t *tt);

/* The options open() reads into t (a range or a choice checked, the option named). */
/* The option `k` as an int in [0, hi] into *out, or -1 where it is unset or empty. */
static int wx__opt_int_or_unset(const wx_opts_t *o, const char *k, uint64_t hi, int *out)
{
    const char *s = wx_opt_str(o, k, NULL);
    uint64_t u;
    int rc;
    *out = -1;
    if (!s || !*s)
        return 0;
    if ((rc = wx__opt_int(o, k, 0, 0, hi, &u)))
        return rc;
    *out = (int)u;
    return 0;
}

static int wx__verbs_parse(wx_verbs_t *t, const wx_opts_t *opts)
{
    uint64_t u;
    const char *s;
    int rc;
    if ((rc = wx__opt_int_or_unset(opts, "gpu", 1023, &t->gpu)))
        return rc;
    if ((rc = wx__opt_int_or_unset(opts, "gid_index", 127, &t->gid_index_opt)))
        return rc;
    if ((rc = wx__opt_int(opts, "chunk", 1u << 20, 1, 1ull << 31, &t->chunk)))
        return rc;
    if ((rc = wx__opt_int(opts, "depth", 256, 4, WX__MAX_DEPTH, &u)))
        return rc;
    t->depth = (uint32_t)u;
    if ((rc = wx__opt_int(opts, "qps", 1, 1, 4, &u)))
        return rc;
    t->qps_per_pair = (uint32_t)u;
    if ((rc = wx__opt_int(opts, "sig_every", t->depth / 4, 1, t->depth - 1, &u)))
        return rc;
    t->sig_every = (uint32_t)u;
    if ((rc = wx__opt_int(opts, "timeout", 14, 1, 31, &u)))
        return rc;
    t->timeout = (uint8_t)u;
    if ((rc = wx__opt_int(opts, "retry_cnt", 7, 0, 7, &u)))
        return rc;
    t->retry_cnt = (uint8_t)u;
    t->reg_mode = wx_opt_str(opts, "reg", "auto");
    if (strcmp(t->reg_mode, "auto") && strcmp(t->reg_mode, "dmabuf") &&
        strcmp(t->reg_mode, "peermem")) {
        rc = wx_errf(-EINVAL, "verbs: option reg=%s (want auto, dmabuf or peermem)", t->reg_mode);
        return rc;
    }
    t->reg_mode = strcmp(t->reg_mode, "dmabuf") == 0    ? "dmabuf"
                  : strcmp(t->reg_mode, "peermem") == 0 ? "peermem"
                                                        : "auto";
#ifdef WX_TESTING
    if ((rc = wx__opt_int(opts, "_test_rkey_xor", 0, 0, 0xffffffffu, &u)))
        return rc;
    t->test_rkey_xor = (uint32_t)u;
    if ((rc = wx__opt_int(opts, "_test_raddr_add", 0, 0, ~0ull, &t->test_raddr_add)))
        return rc;
#endif
    s = wx_opt_str(opts, "gpu_memory", "no");
    if (strcmp(s, "yes") && strcmp(s, "no")) {
        rc = wx_errf(-EINVAL, "verbs: option gpu_memory=%s (want yes or no)", s);
        return rc;
    }
    t->gpu_memory = strcmp(s, "yes") == 0;
    return 0;
}

static int wx__verbs_open(const wx_opts_t *opts, wx_transport_t **out)
{
    wx_verbs_t *t;
    char why[WX_ERRMSG_MAX];
    int rc;
    t = calloc(1, sizeof *t);
    if (!t)
        return wx_errf(-ENOMEM, "verbs: out of memory");
    pthread_mutex_init(&t->qlock, NULL);
    pthread_mutex_init(&t->rlock, NULL);
    pthread_mutex_init(&t->wlock, NULL);
    pthread_cond_init(&t->wcond, NULL);
    t->v = wx_verbs_api(why, sizeof why);
    if (!t->v) {
        rc = wx_errf(-ENOSYS, "verbs: %s", why);
        goto fail;
    }
    if ((rc = wx__verbs_parse(t, opts)))
        goto fail;
    t->nonce = wx_now_ns() ^ ((uint64_t)getpid() << 40) ^ (uint64_t)(uintptr_t)t;
    rc = wx__verbs_open_nics(t, wx_opt_str(opts, "device", NULL));
    if (rc)
        goto fail;
    /* GPU memory will be registered: find out now, before anything is registered or
     * written, whether and how (dma-buf or nvidia-peermem); fail here if neither can work. */
    if (t->gpu_memory && (rc = wx__verbs_gpu_check(t)))
        goto fail;
    t->base.max_write = t->chunk;
    for (int i = 0; i < t->nnic; i++)
        if (t->nic[i].pattr.max_msg_sz && t->nic[i].pattr.max_msg_sz < t->base.max_write)
            t->base.max_write = t->nic[i].pattr.max_msg_sz;
    t->base.max_inflight = (t->depth - 1) * (uint32_t)t->nnic * t->qps_per_pair;
    t->base.needs_local_reg = 1;
    t->base.key_is_backend = 1;
    rc = pthread_create(&t->thr, NULL, wx__progress, t);
    if (rc) {
        rc = wx_errf(-rc, "verbs: cannot start the progress thread: %s", strerror(rc));
        goto fail;
    }
    t->thr_started = 1;
    *out = &t->base;
    return 0;
fail:
    wx__verbs_close(&t->base);
    return rc;
}

static void wx__verbs_close(wx_transport_t *tt)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    wx__vreg_t *r, *next;
    if (t->thr_started) {
        pthread_mutex_lock(&t->wlock);
        __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&t->wcond);
        pthread_mutex_unlock(&t->wlock);
        pthread_join(t->thr, NULL);
    }
    /* Writer QPs still open (peers the generic layer did not disconnect) and target QPs. */
    for (uint32_t i = 0; i < t->nqps; i++) {
        wx__vqp_t *q = t->qps[i];
        if (!q)
            continue;
        wx__verbs_fail_qp(t, q, -ECANCELED, "transport closed");
        wx__verbs_destroy_qp(t, q);
    }
    /* Peer states of handshakes that never finished (their QPs went above). */
    while (t->vpeers) {
        wx__vpeer_t *pv = t->vpeers;
        t->vpeers = pv->next;
        free(pv);
    }
    for (r = t->regs; r; r = next) {
        next = r->next;
        for (int i = t->nnic - 1; i >= 0; i--)
            if (r->mr[i])
                t->v->dereg_mr(r->mr[i]);
        free(r);
    }
    if (t->v)
        wx__verbs_close_nics(t);
    free(t->qps);
    pthread_cond_destroy(&t->wcond);
    pthread_mutex_destroy(&t->wlock);
    pthread_mutex_destroy(&t->rlock);
    pthread_mutex_destroy(&t->qlock);
    free(t);
}

/* The QP of peer pv the next write goes to, in turn, with room in its send queue: 0 and *q
 * locked; -EAGAIN when every queue is full; the error of the completion that broke a QP when
 * one is in the error state (the write fails at once). One QP lock at a time (writers may
 * run on several threads). */
static int wx__verbs_pick_qp(wx__vpeer_t *pv, wx__vqp_t **q)
{
    uint32_t start;
    int rc;
    for (uint32_t i = 0; i < pv->nqp; i++) {
        wx__vqp_t *c = pv->qps[i];
        pthread_mutex_lock(&c->lock);
        if (c->broken) {
            rc = wx_errf(c->broken_errno ? c->broken_errno : -EIO, "%s", c->err);
            pthread_mutex_unlock(&c->lock);
            return rc;
        }
        pthread_mutex_unlock(&c->lock);
    }
    start = __atomic_fetch_add(&pv->rr, 1, __ATOMIC_RELAXED);
    for (uint32_t i = 0; i < pv->nqp; i++) {
        wx__vqp_t *c = pv->qps[(start + i) % pv->nqp];
        pthread_mutex_lock(&c->lock);
        if (!c->broken && c->head - c->tail < c->depth - 1) {
            *q = c; /* keep its lock */
            return 0;
        }
        pthread_mutex_unlock(&c->lock);
    }
    return -EAGAIN;
}

static int wx__verbs_write(wx_transport_t *tt, wx_peer_t *p, const wx_wr_t *wr, wx_op_t *op)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    wx__vpeer_t *pv = p->priv;
    struct ibv_send_wr swr, *bad = NULL;
    struct ibv_sge sge;
    uint32_t rkey, rnn;
    wx__vqp_t *q = NULL;
    int rc, sig;
    if (!pv || pv->nqp == 0)
        return wx_errf(-ENOTCONN, "verbs: %s is not connected", p->name);
    if (!wr->local || !wr->local->priv)
        return wx_errf(-EINVAL, "verbs: the source of a write must be a registered region");
    if (wr->remote->blob_len < 8)
        return wx_errf(-EPROTO, "verbs: remote region (key 0x%llx) carries no rkeys",
                       (unsigned long long)wr->remote->key);
    rnn = wr->remote->blob[0];
    if ((rc = wx__verbs_pick_qp(pv, &q)))
        return rc;
    if ((uint32_t)q->remote_nic >= rnn ||
        4 + 4 * (uint32_t)q->remote_nic + 4 > wr->remote->blob_len) {
        pthread_mutex_unlock(&q->lock);
        return wx_errf(-EPROTO, "verbs: remote region has rkeys for %u NICs, QP uses NIC %d", rnn,
                       q->remote_nic);
    }
    memcpy(&rkey, wr->remote->blob + 4 + 4 * q->remote_nic, 4);
#ifdef WX_TESTING
    rkey ^= t->test_rkey_xor;
#endif
    sig = q->unsig_run + 1 >= t->sig_every || q->head - q->tail + 2 >= q->depth;
    sge.addr = (uint64_t)(uintptr_t)wr->local->addr + wr->loff;
    sge.length = (uint32_t)wr->len;
    sge.lkey = wx__verbs_lkey(wr->local, q->nic->index);
    memset(&swr, 0, sizeof swr);
    swr.wr_id = ((uint64_t)q->idx << 48) | (q->head & WX_VERBS_SEQ_MASK);
    swr.opcode = IBV_WR_RDMA_WRITE;
    swr.send_flags = sig ? IBV_SEND_SIGNALED : 0;
    swr.sg_list = &sge;
    swr.num_sge = wr->len ? 1 : 0;
    swr.wr.rdma.remote_addr = wr->remote->rbase + wr->roff;
#ifdef WX_TESTING
    swr.wr.rdma.remote_addr += t->test_raddr_add;
#endif
    swr.wr.rdma.rkey = rkey;
    pthread_mutex_lock(&t->wlock);
    t->inflight++;
    pthread_mutex_unlock(&t->wlock);
    rc = ibv_post_send(q->qp, &swr, &bad);
    if (rc) {
        pthread_mutex_unlock(&q->lock);
        pthread_mutex_lock(&t->wlock);
        t->inflight--;
        pthread_mutex_unlock(&t->wlock);
        if (rc == ENOMEM)
            return -EAGAIN;
        return wx_errf(-rc, "verbs: ibv_post_send(qp_num 0x%x on %s to %s) failed: %s",
                       q->qp->qp_num, q->nic->name, p->name, strerror(rc));
    }
    q->ring[q->head % q->depth].op = op;
    q->ring[q->head % q->depth].sig = sig;
    q->head++;
    q->last_raddr = swr.wr.rdma.remote_addr;
    q->last_rkey = rkey;
    if (sig) {
        q->sig_posted++;
        q->unsig_run = 0;
    } else {
        q->unsig_run++;
    }
    pthread_mutex_unlock(&q->lock);
    pthread_mutex_lock(&t->wlock);
    pthread_cond_signal(&t->wcond);
    pthread_mutex_unlock(&t->wlock);
    return 0;
}

static int wx__verbs_info(wx_transport_t *tt, char *buf, size_t len)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    size_t off = 0;
#define WX__ADD(...)                                                                               \
    do {                                                                                           \
        int k_ = snprintf(buf + off, off < len ? len - off : 0, __VA_ARGS__);                      \
        if (k_ > 0)                                                                                \
            off += (size_t)k_;                                                                     \
    } while (0)
    if (t->v->emulated)
        WX__ADD("verbs (EMULATED libibverbs: %s): nics=", t->v->path);
    else
        WX__ADD("verbs (%s): nics=", t->v->path);
    for (int i = 0; i < t->nnic; i++) {
        wx__vnic_t *n = &t->nic[i];
        WX__ADD("%s%s:%u(%s lid %u mtu %s gid_index %d)", i ? "," : "", n->name, n->port,
                n->pattr.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB", n->pattr.lid,
                wx__verbs_mtu_str(n->pattr.active_mtu), n->gid_index);
    }
    pthread_mutex_lock(&t->rlock);
    WX__ADD(" choice=%s max_write=%llu depth=%u sig_every=%u qps_per_pair=%u registration=%s "
            "(%s) reg_calls=%llu reg_cache_hits=%llu",
            t->choice, (unsigned long long)t->base.max_write, t->depth, t->sig_every,
            t->qps_per_pair, t->reg_last[0] ? t->reg_last : "none",
            t->reg_why[0] ? t->reg_why : "nothing registered yet", (unsigned long long)t->reg_calls,
            (unsigned long long)t->reg_hits);
    pthread_mutex_unlock(&t->rlock);
    if (t->gpu_route[0])
        WX__ADD(" gpu_route=%s (%s)", t->gpu_route, t->gpu_why);
#ifdef WX_TESTING
    if (t->test_rkey_xor || t->test_raddr_add)
        WX__ADD(" TEST-ONLY-CORRUPTION rkey_xor=0x%x raddr_add=%llu", t->test_rkey_xor,
                (unsigned long long)t->test_raddr_add);
#endif
#undef WX__ADD
    return 0;
}

static const char *const wx__verbs_host_opts[] = {"gpu", "gpu_memory", NULL};
static const char *const wx__verbs_gpu_opts[] = {"gpu", "{gpu}", "gpu_memory", "yes", NULL};

const wx_transport_ops_t wx_verbs_ops = {
    .name = "verbs",
    .kind = WX_KIND_VERBS,
    /* a peer that is gone: its QP does not answer, IBV_WC_RETRY_EXC_ERR */
    .caps = WX_CAP_HOST_MEM | WX_CAP_CUDA_MEM | WX_CAP_DEAD_PEER,
    .auto_host = 0,
    .auto_cuda = 2,
    .options = wx__verbs_known,
    .host_options = wx__verbs_host_opts,
    .gpu_check = wx__verbs_gpu_opts,
    WX_TRANSPORT_OPS(verbs),
    .conn_accept = wx__verbs_conn_accept,
};
