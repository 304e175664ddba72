/* wx_verbs_conn.c - verbs backend: RC queue pairs and the three-step handshake.
 *
 *   writer  conn_request: creates its QPs (RESET -> INIT), sends QPN/LID/GID/PSN/MTU
 *   target  conn_accept : creates its QPs, INIT -> RTR -> RTS, replies with its own
 *   writer  conn_finish : INIT -> RTR -> RTS
 *
 * Pairing: with L local and R remote NICs the writer opens max(L, R) * qps QPs, QP k using
 * local NIC (k / qps) % L and remote NIC (k / qps) % R, so rail-aligned NICs talk to each
 * other. Wire formats are little-endian, versioned, and checked on decode. */
#include "wx_verbs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define WX__ADDR_MAGIC "WXVA"
#define WX__REQ_MAGIC "WXVR"
#define WX__REP_MAGIC "WXVP"
#define WX__VER 1

/* address: magic[4] ver u8 nnic u8 pad u16 | nonce u64 | pid u32 | host[20] | nnic x nic */
typedef struct wx__anic {
    char name[14];
    uint8_t link_layer, mtu;
} wx__anic_t;
#define WX__AHDR 40

/* request / reply entry */
typedef struct wx__qpinfo {
    uint32_t qpn, psn;
    uint16_t lid;
    uint8_t mtu, link_layer;
    uint8_t gid[16];
    int8_t gid_index; /* -1: no GRH */
    uint8_t wnic, tnic, pad;
} wx__qpinfo_t;
#define WX__QHDR 24 /* magic[4] ver u8 n u8 pad u16 | writer nonce u64 | target nonce u64 */

int wx__verbs_address(wx_transport_t *tt, uint8_t *buf, size_t *len)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    size_t need = WX__AHDR + (size_t)t->nnic * sizeof(wx__anic_t);
    uint32_t pid = (uint32_t)getpid();
    char host[20] = "";
    if (*len < need)
        return wx_errf(-ENOSPC, "verbs address needs %zu bytes", need);
    memset(buf, 0, need);
    memcpy(buf, WX__ADDR_MAGIC, 4);
    buf[4] = WX__VER;
    buf[5] = (uint8_t)t->nnic;
    memcpy(buf + 8, &t->nonce, 8);
    memcpy(buf + 16, &pid, 4);
    gethostname(host, sizeof host - 1);
    memcpy(buf + 20, host, sizeof host);
    for (int i = 0; i < t->nnic; i++) {
        wx__anic_t a;
        memset(&a, 0, sizeof a);
        memcpy(a.name, t->nic[i].name, sizeof a.name - 1);
        a.link_layer = t->nic[i].pattr.link_layer;
        a.mtu = (uint8_t)t->nic[i].pattr.active_mtu;
        memcpy(buf + WX__AHDR + i * sizeof a, &a, sizeof a);
    }
    *len = need;
    return 0;
}

static int wx__addr_decode(const uint8_t *buf, size_t len, uint64_t *nonce, uint32_t *pid,
                           char host[20], wx__anic_t *nics, int *nnic)
{
    if (len < WX__AHDR || memcmp(buf, WX__ADDR_MAGIC, 4) || buf[4] != WX__VER)
        return wx_errf(-EPROTO, "verbs: peer address is not a verbs v%d address", WX__VER);
    *nnic = buf[5];
    if (*nnic < 1 || *nnic > WX_VERBS_MAX_NICS ||
        len < WX__AHDR + (size_t)*nnic * sizeof(wx__anic_t))
        return wx_errf(-EBADMSG, "verbs: peer address truncated or bad NIC count %d", *nnic);
    memcpy(nonce, buf + 8, 8);
    memcpy(pid, buf + 16, 4);
    memcpy(host, buf + 20, 20);
    host[19] = '\0';
    memcpy(nics, buf + WX__AHDR, (size_t)*nnic * sizeof(wx__anic_t));
    return 0;
}

static void wx__fill_info(wx_verbs_t *t, wx__vqp_t *q, wx__qpinfo_t *e, int wnic, int tnic)
{
    wx__vnic_t *n = q->nic;
    WX_UNUSED(t);
    memset(e, 0, sizeof *e);
    e->qpn = q->qp->qp_num;
    e->psn = q->psn;
    e->lid = n->pattr.lid;
    e->mtu = (uint8_t)n->pattr.active_mtu;
    e->link_layer = n->pattr.link_layer;
    memcpy(e->gid, n->gid.raw, 16);
    e->gid_index = (int8_t)n->gid_index;
    e->wnic = (uint8_t)wnic;
    e->tnic = (uint8_t)tnic;
}

void wx__verbs_destroy_qp(wx_verbs_t *t, wx__vqp_t *q)
{
    if (!q)
        return;
    pthread_mutex_lock(&t->qlock);
    if (q->idx < t->nqps && t->qps[q->idx] == q)
        t->qps[q->idx] = NULL;
    pthread_mutex_unlock(&t->qlock);
    if (q->qp) {
        int rc = t->v->destroy_qp(q->qp);
        if (rc)
            wx_debugf("verbs: ibv_destroy_qp(0x%x) failed: %s\n", q->qp->qp_num, strerror(rc));
    }
    q->nic->cq_used -= (int)q->depth;
    pthread_mutex_destroy(&q->lock);
    free(q->ring);
    free(q);
}

static int wx__qp_create(wx_verbs_t *t, wx__vnic_t *n, uint32_t depth, int access, wx_peer_t *peer,
                         int remote_nic, wx__vqp_t **out)
{
    const wx_verbs_api_t *v = t->v;
    struct ibv_qp_init_attr ia;
    struct ibv_qp_attr a;
    wx__vqp_t *q;
    int rc;
    if (n->cq_used + (int)depth > n->cq_cap)
        return wx_errf(-ENOSPC,
                       "verbs: the completion queue of %s (%d entries) cannot take "
                       "another QP of depth %u (lower depth or use fewer peers)",
                       n->name, n->cq_cap, depth);
    q = calloc(1, sizeof *q);
    if (!q)
        return wx_errf(-ENOMEM, "verbs: out of memory");
    q->ring = calloc(depth, sizeof *q->ring);
    if (!q->ring) {
        free(q);
        return wx_errf(-ENOMEM, "verbs: out of memory");
    }
    pthread_mutex_init(&q->lock, NULL);
    q->nic = n;
    q->depth = depth;
    q->remote_nic = remote_nic;
    q->peer = peer; /* set before the progress thread can see the QP */
    q->psn = (uint32_t)((wx_now_ns() ^ ((uint64_t)getpid() << 12) ^ (uintptr_t)q) & 0xffffff);
    memset(&ia, 0, sizeof ia);
    ia.send_cq = n->cq;
    ia.recv_cq = n->cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = depth;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.sq_sig_all = 0;
    q->qp = v->create_qp(n->pd, &ia);
    if (!q->qp) {
        rc = wx_errf(errno ? -errno : -EIO, "ibv_create_qp(%s, max_send_wr %u) failed: %s", n->name,
                     depth, strerror(errno));
        pthread_mutex_destroy(&q->lock);
        free(q->ring);
        free(q);
        return rc;
    }
    n->cq_used += (int)depth;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = n->port;
    a.qp_access_flags = (unsigned)access;
    rc = v->modify_qp(q->qp, &a,
                      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc) {
        rc = wx_errf(-rc, "ibv_modify_qp(qp 0x%x on %s, RESET->INIT) failed: %s", q->qp->qp_num,
                     n->name, strerror(rc));
        wx__verbs_destroy_qp(t, q);
        return rc;
    }
    rc = wx__verbs_add_qp(t, q);
    if (rc) {
        wx__verbs_destroy_qp(t, q);
        return rc;
    }
    *out = q;
    return 0;
}

/* INIT -> RTR -> RTS towards the remote QP described by r. */
static int wx__qp_connect(wx_verbs_t *t, wx__vqp_t *q, const wx__qpinfo_t *r, const char *who)
{
    const wx_verbs_api_t *v = t->v;
    wx__vnic_t *n = q->nic;
    struct ibv_qp_attr a;
    int rc, eth = n->pattr.link_layer == IBV_LINK_LAYER_ETHERNET;
    if (r->link_layer != n->pattr.link_layer)
        return wx_errf(-EPROTO, "verbs: %s's NIC uses link layer %s but %s uses %s", who,
                       r->link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand",
                       n->name, eth ? "Ethernet" : "InfiniBand");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)(r->mtu < n->pattr.active_mtu ? r->mtu : n->pattr.active_mtu);
    a.dest_qp_num = r->qpn;
    a.rq_psn = r->psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = n->port;
    a.ah_attr.dlid = r->lid;
    if (eth || n->gid_index >= 0 || r->gid_index >= 0) {
        if (n->gid_index < 0)
            return wx_errf(-EPROTO,
                           "verbs: %s wants a GRH but %s has no GID index chosen "
                           "(set gid_index)",
                           who, n->name);
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, r->gid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)n->gid_index;
        a.ah_attr.grh.hop_limit = 64;
    }
    rc = v->modify_qp(q->qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc)
        return wx_errf(-rc,
                       "ibv_modify_qp(qp 0x%x on %s, INIT->RTR to %s qp 0x%x, mtu %s) "
                       "failed: %s",
                       q->qp->qp_num, n->name, who, r->qpn, wx__verbs_mtu_str(a.path_mtu),
                       strerror(rc));
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = q->psn;
    a.timeout = t->timeout;
    a.retry_cnt = t->retry_cnt;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    rc = v->modify_qp(q->qp, &a,
                      IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                          IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc)
        return wx_errf(-rc, "ibv_modify_qp(qp 0x%x on %s, RTR->RTS) failed: %s", q->qp->qp_num,
                       n->name, strerror(rc));
    return 0;
}

static void wx__free_peer(wx_verbs_t *t, wx__vpeer_t *pv)
{
    wx__vpeer_t **pp;
    pthread_mutex_lock(&t->qlock);
    for (pp = &t->vpeers; *pp && *pp != pv; pp = &(*pp)->next)
        ;
    if (*pp)
        *pp = pv->next;
    pthread_mutex_unlock(&t->qlock);
    for (uint32_t i = 0; i < pv->nqp; i++)
        wx__verbs_destroy_qp(t, pv->qps[i]);
    free(pv);
}

int wx__verbs_conn_request(wx_transport_t *tt, wx_peer_t *p, uint8_t *req, size_t *req_len)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    wx__anic_t rn[WX_VERBS_MAX_NICS];
    uint64_t tnonce = 0;
    uint32_t pid = 0, n;
    char host[20];
    int rnn = 0, rc, L = t->nnic;
    wx__vpeer_t *pv;

    rc = wx__addr_decode(p->addr, p->addr_len, &tnonce, &pid, host, rn, &rnn);
    if (rc)
        return rc;
    if (p->priv) { /* an earlier, unfinished attempt */
        wx__free_peer(t, p->priv);
        p->priv = NULL;
    }
    n = (uint32_t)(L > rnn ? L : rnn) * t->qps_per_pair;
    if (n > sizeof pv->qps / sizeof pv->qps[0] || WX__QHDR + n * sizeof(wx__qpinfo_t) > *req_len)
        return wx_errf(-ENOSPC, "verbs: %u queue pairs do not fit the request", n);
    snprintf(p->name, sizeof p->name, "peer %u (verbs %s pid %u)", p->id, host, pid);
    pv = calloc(1, sizeof *pv);
    if (!pv)
        return wx_errf(-ENOMEM, "verbs: out of memory");
    pv->remote_nnic = (uint32_t)rnn;
    pthread_mutex_lock(&t->qlock);
    pv->next = t->vpeers;
    t->vpeers = pv;
    pthread_mutex_unlock(&t->qlock);
    memset(req, 0, WX__QHDR);
    memcpy(req, WX__REQ_MAGIC, 4);
    req[4] = WX__VER;
    req[5] = (uint8_t)n;
    memcpy(req + 8, &t->nonce, 8);
    memcpy(req + 16, &tnonce, 8);
    for (uint32_t k = 0; k < n; k++) {
        uint32_t pair = k / t->qps_per_pair;
        int ln = (int)(pair % (uint32_t)L), tn = (int)(pair % (uint32_t)rnn);
        wx__qpinfo_t e;
        wx__vqp_t *q;
        if (rn[tn].link_layer != t->nic[ln].pattr.link_layer) {
            rc = wx_errf(
                -EPROTO, "verbs: %s NIC %.14s is %s but local %s is %s", p->name, rn[tn].name,
                rn[tn].link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand",
                t->nic[ln].name,
                t->nic[ln].pattr.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand");
            wx__free_peer(t, pv);
            return rc;
        }
        rc = wx__qp_create(t, &t->nic[ln], t->depth, 0, p, tn, &q);
        if (rc) {
            wx__free_peer(t, pv);
            return rc;
        }
        pv->qps[pv->nqp++] = q;
        wx__fill_info(t, q, &e, ln, tn);
        memcpy(req + WX__QHDR + k * sizeof e, &e, sizeof e);
    }
    p->priv = pv;
    *req_len = WX__QHDR + n * sizeof(wx__qpinfo_t);
    return 0;
}

static int wx__q_decode(const uint8_t *buf, size_t len, const char *magic, uint64_t *wn,
                        uint64_t *tn, wx__qpinfo_t *e, uint32_t *n)
{
    if (len < WX__QHDR || memcmp(buf, magic, 4) || buf[4] != WX__VER)
        return wx_errf(-EPROTO, "verbs: connection message is not a verbs v%d %s", WX__VER, magic);
    *n = buf[5];
    if (*n == 0 || *n > 2 * WX_VERBS_MAX_NICS * 4 || len != WX__QHDR + *n * sizeof *e)
        return wx_errf(-EBADMSG, "verbs: connection message has a bad length (%zu for %u QPs)", len,
                       *n);
    memcpy(wn, buf + 8, 8);
    memcpy(tn, buf + 16, 8);
    memcpy(e, buf + WX__QHDR, *n * sizeof *e);
    return 0;
}

int wx__verbs_conn_accept(wx_transport_t *tt, const uint8_t *req, size_t req_len, uint8_t *rep,
                          size_t *rep_len)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    wx__qpinfo_t in[2 * WX_VERBS_MAX_NICS * 4], out;
    wx__vqp_t *made[2 * WX_VERBS_MAX_NICS * 4];
    uint64_t wn, tn;
    uint32_t n, k;
    char who[64];
    int rc = wx__q_decode(req, req_len, WX__REQ_MAGIC, &wn, &tn, in, &n);
    if (rc)
        return rc;
    if (tn != t->nonce)
        return wx_errf(-EPROTO, "verbs: connection request was meant for another transport "
                                "(stale export blob?)");
    if (*rep_len < WX__QHDR + n * sizeof out)
        return wx_errf(-ENOSPC, "verbs: reply buffer too small");
    snprintf(who, sizeof who, "writer %016llx", (unsigned long long)wn);
    memset(rep, 0, WX__QHDR);
    memcpy(rep, WX__REP_MAGIC, 4);
    rep[4] = WX__VER;
    rep[5] = (uint8_t)n;
    memcpy(rep + 8, &wn, 8);
    memcpy(rep + 16, &t->nonce, 8);
    for (k = 0; k < n; k++) {
        wx__vqp_t *q;
        if (in[k].tnic >= t->nnic) {
            rc = wx_errf(-EPROTO, "verbs: request names NIC %u, this process has %d", in[k].tnic,
                         t->nnic);
            break;
        }
        /* The target never posts: a send queue of one is enough. */
        rc = wx__qp_create(t, &t->nic[in[k].tnic], 1,
                           IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, NULL, -1, &q);
        if (rc)
            break;
        made[k] = q;
        rc = wx__qp_connect(t, q, &in[k], who);
        if (rc) {
            k++;
            break;
        }
        wx__fill_info(t, q, &out, in[k].wnic, in[k].tnic);
        memcpy(rep + WX__QHDR + k * sizeof out, &out, sizeof out);
    }
    if (rc) {
        while (k-- > 0)
            wx__verbs_destroy_qp(t, made[k]);
        return rc;
    }
    *rep_len = WX__QHDR + n * sizeof out;
    return 0;
}

int wx__verbs_conn_finish(wx_transport_t *tt, wx_peer_t *p, const uint8_t *rep, size_t rep_len)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    wx__vpeer_t *pv = p->priv;
    wx__qpinfo_t in[2 * WX_VERBS_MAX_NICS * 4];
    uint64_t wn, tn;
    uint32_t n;
    int rc;
    if (!pv)
        return wx_errf(-EPROTO, "verbs: %s: connect_finish without connect_request", p->name);
    rc = wx__q_decode(rep, rep_len, WX__REP_MAGIC, &wn, &tn, in, &n);
    if (rc)
        return rc;
    if (wn != t->nonce || n != pv->nqp)
        return wx_errf(-EPROTO,
                       "verbs: %s: reply does not answer this request (%u QPs, "
                       "expected %u)",
                       p->name, n, pv->nqp);
    for (uint32_t k = 0; k < n; k++) {
        rc = wx__qp_connect(t, pv->qps[k], &in[k], p->name);
        if (rc)
            return rc;
    }
    return 0;
}

void wx__verbs_disconnect(wx_transport_t *tt, wx_peer_t *p)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    wx__vpeer_t *pv = p->priv;
    if (!pv)
        return;
    for (uint32_t i = 0; i < pv->nqp; i++)
        wx__verbs_fail_qp(t, pv->qps[i], -ECANCELED, "transport closed");
    wx__free_peer(t, pv);
    p->priv = NULL;
}
/* WRs of p's QPs not completed yet. */
static uint64_t wx__verbs_outstanding(wx__vpeer_t *pv)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < pv->nqp; i++) {
        pthread_mutex_lock(&pv->qps[i]->lock);
        n += pv->qps[i]->head - pv->qps[i]->tail;
        pthread_mutex_unlock(&pv->qps[i]->lock);
    }
    return n;
}

/* Fence p: move each of its QPs to the error state (the HCA stops sending their WRs and
 * flushes them), then wait until every WR has completed, flushed or not (the progress
 * thread polls the flush CQEs). After that the HCA sends nothing more for p; what it had
 * sent before may still be in the fabric (delivered within the fabric's packet lifetime). */
int wx__verbs_fence(wx_transport_t *tt, wx_peer_t *p, uint64_t timeout_ns, char *how, size_t len)
{
    wx_verbs_t *t = (wx_verbs_t *)tt;
    wx__vpeer_t *pv = p->priv;
    uint64_t end = wx_now_ns() + timeout_ns, out0, out;
    int bad = 0;
    if (!pv) {
        snprintf(how, len, "verbs: %s has no queue pairs", p->name);
        return 0;
    }
    out0 = wx__verbs_outstanding(pv);
    for (uint32_t i = 0; i < pv->nqp; i++) {
        wx__vqp_t *q = pv->qps[i];
        struct ibv_qp_attr a;
        pthread_mutex_lock(&q->lock);
        if (!q->broken) { /* later posts are refused; flushed ops carry this reason */
            q->broken = 1;
            q->broken_errno = -ECANCELED;
            snprintf(q->err, sizeof q->err,
                     "verbs: writes to %s abandoned: its queue pairs were moved to the error "
                     "state (fenced)",
                     p->name);
        }
        pthread_mutex_unlock(&q->lock);
        memset(&a, 0, sizeof a);
        a.qp_state = IBV_QPS_ERR;
        if (t->v->modify_qp(q->qp, &a, IBV_QP_STATE))
            bad++;
    }
    while ((out = wx__verbs_outstanding(pv)) > 0 && wx_now_ns() < end) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (bad) {
        snprintf(how, len,
                 "verbs: ibv_modify_qp(IBV_QPS_ERR) failed on %d of the %u queue pairs to %s: "
                 "their writes may still land",
                 bad, pv->nqp, p->name);
        return -EIO;
    }
    if (out) {
        snprintf(how, len,
                 "verbs: the %u queue pairs to %s are in the error state, but %llu of their "
                 "writes were not flushed after %.1f s: those may still land",
                 pv->nqp, p->name, (unsigned long long)out, (double)timeout_ns / 1e9);
        return -ETIMEDOUT;
    }
    snprintf(how, len,
             "verbs: the %u queue pair(s) to %s were moved to the error state and all %llu "
             "writes still out completed or were flushed: the HCA sends nothing more to it",
             pv->nqp, p->name, (unsigned long long)out0);
    return 0;
}
