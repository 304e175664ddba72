/* wxemu_verbs_hca.c - EMULATION of an HCA's send-queue processing for the wxfer test suite.
 *
 * One native thread per opened emulated device context executes posted work requests in
 * order, exactly as the rules of an RC queue pair demand, and performs each RDMA WRITE with
 * process_vm_writev() into the target process after checking the target's HCA file
 * (/dev/shm/wxemu_verbs.<uid>.lid<LID>): the target QP must exist, be in RTR or RTS and be
 * connected back to us; the rkey must be live, belong to the target QP's PD, allow
 * REMOTE_WRITE, and cover the range. Failures produce the completion status a real HCA
 * reports. A WR whose packets get no answer (peer gone, link down) is retried for the
 * QP's retry time while the other QPs go on; a QP moved to the error state meanwhile
 * flushes it, and from then on no WR of that QP reaches the responder (the real rule a
 * fence relies on). Never shipped; never a backend. */
#define _GNU_SOURCE
#include "wxemu_verbs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* vendor_err values of the emulation, for messages only */
enum {
    EMU_VE_NONE = 0,
    EMU_VE_KEY = 0x51,
    EMU_VE_BOUNDS = 0x52,
    EMU_VE_ACCESS = 0x53,
    EMU_VE_PD = 0x54,
    EMU_VE_NOPEER = 0x81,
    EMU_VE_NOQP = 0x82,
    EMU_VE_PSN = 0x83,
    EMU_VE_MTU = 0x84,
    EMU_VE_LINK = 0x85,
    EMU_VE_FAULT = 0x91,
    EMU_VE_PTRACE = 0x92
};

/* Called with ec->lock held. */
void emu_cq_push(emu_cq_t *cq, emu_qp_t *q, uint64_t wr_id, enum ibv_wc_status st,
                 uint32_t vendor_err)
{
    struct ibv_wc *wc;
    if (cq->overrun)
        return;
    if (cq->count == cq->cap) {
        /* CQ overrun: a real HCA raises IBV_EVENT_CQ_ERR and the QPs on it stop working. */
        emu_ctx_t *ec = q->ec;
        cq->overrun = 1;
        fprintf(stderr,
                "wxemu_verbs (emulation): CQ overrun (%u entries): QPs on it go to "
                "the error state\n",
                cq->cap);
        for (int i = 0; i < EMU_MAX_QP; i++)
            if (ec->qps[i] && (ec->qps[i]->scq == cq || ec->qps[i]->rcq == cq)) {
                ec->qps[i]->qp.state = IBV_QPS_ERR;
                __atomic_store_n(&ec->qps[i]->slot->state, IBV_QPS_ERR, __ATOMIC_RELEASE);
            }
        return;
    }
    wc = &cq->ring[(cq->head + cq->count) % cq->cap];
    memset(wc, 0, sizeof *wc);
    wc->wr_id = wr_id;
    wc->status = st;
    wc->opcode = IBV_WC_RDMA_WRITE;
    wc->vendor_err = vendor_err;
    wc->qp_num = q->qp.qp_num;
    cq->count++;
}

void emu_qp_to_error(emu_qp_t *q)
{
    q->qp.state = IBV_QPS_ERR;
    __atomic_store_n(&q->slot->state, IBV_QPS_ERR, __ATOMIC_RELEASE);
}

int emu_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    emu_qp_t *q = (emu_qp_t *)qp;
    emu_ctx_t *ec = q->ec;
    int rc = 0;
    pthread_mutex_lock(&ec->lock);
    for (; wr; wr = wr->next) {
        uint32_t st = q->slot->state;
        emu_wqe_t *w;
        if (st == IBV_QPS_RESET || st == IBV_QPS_INIT || st == IBV_QPS_RTR) {
            rc = EINVAL; /* the send queue is not ready before RTS */
            break;
        }
        if (wr->opcode != IBV_WR_RDMA_WRITE || wr->num_sge < 0 ||
            (uint32_t)wr->num_sge > q->cap.max_send_sge || (wr->send_flags & IBV_SEND_INLINE)) {
            rc = EINVAL;
            break;
        }
        if (q->posted - q->retired >= q->cap.max_send_wr) {
            rc = ENOMEM; /* send queue full: max_send_wr WRs not yet retired by a polled CQE */
            break;
        }
        w = &q->sq[q->posted % q->cap.max_send_wr];
        memset(w, 0, sizeof *w);
        w->wr_id = wr->wr_id;
        w->flags = (uint32_t)wr->send_flags;
        w->nsge = (uint32_t)wr->num_sge;
        if (wr->num_sge)
            memcpy(w->sge, wr->sg_list, (size_t)wr->num_sge * sizeof *w->sge);
        w->raddr = wr->wr.rdma.remote_addr;
        w->rkey = wr->wr.rdma.rkey;
        q->posted++;
    }
    if (rc)
        *bad = wr;
    pthread_cond_broadcast(&ec->cond);
    pthread_mutex_unlock(&ec->lock);
    return rc;
}

int emu_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    emu_cq_t *c = (emu_cq_t *)cq;
    emu_ctx_t *ec = (emu_ctx_t *)cq->context;
    int got = 0;
    pthread_mutex_lock(&ec->lock);
    if (c->overrun) {
        pthread_mutex_unlock(&ec->lock);
        errno = EOVERFLOW;
        return -EOVERFLOW;
    }
    while (got < n && c->count > 0) {
        struct ibv_wc *e = &c->ring[c->head];
        uint32_t slot = e->qp_num - EMU_QPN_BASE;
        wc[got++] = *e;
        c->head = (c->head + 1) % c->cap;
        c->count--;
        /* A polled CQE retires its WQE and every earlier one of that send queue. */
        if (slot < EMU_MAX_QP && ec->qps[slot] && ec->qps[slot]->qp.qp_num == e->qp_num) {
            emu_qp_t *q = ec->qps[slot];
            uint64_t r = q->retired;
            while (r < q->executed && q->sq[r % q->cap.max_send_wr].wr_id != e->wr_id)
                r++;
            if (r < q->executed)
                q->retired = r + 1;
        }
    }
    pthread_mutex_unlock(&ec->lock);
    return got;
}

static int emu_peer_alive(const emu_shm_t *r)
{
    if (__atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) != EMU_MAGIC)
        return 0;
    if (kill(r->pid, 0) != 0 && errno != EPERM)
        return 0;
    return emu_proc_starttime(r->pid) == r->starttime;
}

/* Execute one RDMA WRITE (ec->lock NOT held; q cannot go away while q->busy). */
static enum ibv_wc_status emu_exec(emu_qp_t *q, const emu_wqe_t *w, uint32_t *ve)
{
    emu_ctx_t *ec = q->ec;
    struct iovec liov[EMU_MAX_SGE], riov;
    emu_qp_slot_t rs;
    emu_mr_slot_t m;
    uint64_t total = 0, done = 0;
    const emu_shm_t *R;
    uint32_t idx;
    int lcuda[EMU_MAX_SGE], any_cuda = 0;
    *ve = EMU_VE_NONE;
    for (uint32_t i = 0; i < w->nsge; i++) {
        const struct ibv_sge *s = &w->sge[i];
        emu_mr_slot_t lm;
        total += s->length;
        liov[i].iov_base = (void *)(uintptr_t)s->addr;
        liov[i].iov_len = s->length;
        lcuda[i] = 0;
        if (s->length == 0)
            continue;
        idx = (s->lkey >> 8) - 1;
        if (idx >= EMU_MAX_MR) {
            *ve = EMU_VE_KEY;
            return IBV_WC_LOC_PROT_ERR;
        }
        lm = ec->shm->mr[idx];
        if (lm.key != s->lkey || lm.pd != q->epd->id) {
            *ve = lm.key != s->lkey ? EMU_VE_KEY : EMU_VE_PD;
            return IBV_WC_LOC_PROT_ERR;
        }
        if (s->addr < lm.addr || s->length > lm.len || s->addr - lm.addr > lm.len - s->length) {
            *ve = EMU_VE_BOUNDS;
            return IBV_WC_LOC_PROT_ERR;
        }
        lcuda[i] = lm.kind != EMU_MR_HOST;
        any_cuda |= lcuda[i];
    }
    if (total > emu_cfg.max_msg)
        return IBV_WC_LOC_LEN_ERR;
    /* The responder: the HCA named by our path (LID / GID), its QP dest_qpn. */
    if (!q->remote) {
        uint32_t lid = q->slot->dlid;
        q->remote = emu_shm_open_lid(lid);
        q->remote_lid = lid;
    }
    R = q->remote;
    if (!R || !emu_peer_alive(R)) {
        *ve = EMU_VE_NOPEER;
        return IBV_WC_RETRY_EXC_ERR; /* no ACK ever comes back */
    }
    if (__atomic_load_n(&R->link_down, __ATOMIC_ACQUIRE)) {
        *ve = EMU_VE_LINK; /* the packets are lost: retried while the link stays down */
        return IBV_WC_RETRY_EXC_ERR;
    }
    idx = q->dest_qpn - EMU_QPN_BASE;
    if (idx >= EMU_MAX_QP) {
        *ve = EMU_VE_NOQP;
        return IBV_WC_RETRY_EXC_ERR;
    }
    rs = R->qp[idx];
    if (rs.qpn != q->dest_qpn || (rs.state != IBV_QPS_RTR && rs.state != IBV_QPS_RTS) ||
        rs.dest_qpn != q->qp.qp_num || rs.dlid != ec->lid) {
        *ve = EMU_VE_NOQP; /* packets to a QP that is not ready (or not ours) are dropped */
        return IBV_WC_RETRY_EXC_ERR;
    }
    if (q->path_mtu > rs.path_mtu) {
        *ve = EMU_VE_MTU; /* packets larger than the responder's MTU are dropped */
        return IBV_WC_RETRY_EXC_ERR;
    }
    if (!q->psn_checked) {
        if (q->sq_psn != rs.rq_psn) {
            *ve = EMU_VE_PSN; /* every packet is out of sequence: NAKs until retries run out */
            return IBV_WC_RETRY_EXC_ERR;
        }
        q->psn_checked = 1;
    }
    if (total == 0)
        return IBV_WC_SUCCESS; /* zero-length writes check no key */
    if (!(rs.access & IBV_ACCESS_REMOTE_WRITE)) {
        *ve = EMU_VE_ACCESS;
        return IBV_WC_REM_ACCESS_ERR;
    }
    idx = (w->rkey >> 8) - 1;
    if (idx >= EMU_MAX_MR) {
        *ve = EMU_VE_KEY;
        return IBV_WC_REM_ACCESS_ERR;
    }
    m = R->mr[idx];
    if (m.key != w->rkey) {
        *ve = EMU_VE_KEY;
        return IBV_WC_REM_ACCESS_ERR;
    }
    if (m.pd != rs.pd) {
        *ve = EMU_VE_PD;
        return IBV_WC_REM_ACCESS_ERR;
    }
    if (!(m.access & IBV_ACCESS_REMOTE_WRITE)) {
        *ve = EMU_VE_ACCESS;
        return IBV_WC_REM_ACCESS_ERR;
    }
    if (w->raddr < m.addr || total > m.len || w->raddr - m.addr > m.len - total) {
        *ve = EMU_VE_BOUNDS;
        return IBV_WC_REM_ACCESS_ERR;
    }
    /* GPU memory on either side: moved with CUDA copies (wxemu_verbs_cuda.c). */
    if (any_cuda || m.kind != EMU_MR_HOST)
        return emu_cuda_write(liov, lcuda, (int)w->nsge, R, &m, w->raddr, ve);
    /* The write itself, possibly in several partial steps. */
    while (done < total) {
        struct iovec lv[EMU_MAX_SGE];
        uint64_t skip = done;
        int n = 0;
        ssize_t wrote;
        for (uint32_t i = 0; i < w->nsge; i++) {
            if (skip >= liov[i].iov_len) {
                skip -= liov[i].iov_len;
                continue;
            }
            lv[n].iov_base = (char *)liov[i].iov_base + skip;
            lv[n].iov_len = liov[i].iov_len - skip;
            skip = 0;
            n++;
        }
        riov.iov_base = (void *)(uintptr_t)(w->raddr + done);
        riov.iov_len = total - done;
        wrote = process_vm_writev(R->pid, lv, (unsigned long)n, &riov, 1, 0);
        if (wrote <= 0) {
            int e = wrote < 0 ? errno : EFAULT;
            if (e == ESRCH) {
                *ve = EMU_VE_NOPEER;
                return IBV_WC_RETRY_EXC_ERR;
            }
            if (e == EPERM) {
                *ve = EMU_VE_PTRACE;
                fprintf(stderr,
                        "wxemu_verbs (emulation): process_vm_writev into pid %d: %s "
                        "(ptrace permission; see docs/verbs.md)\n",
                        R->pid, strerror(e));
                return IBV_WC_GENERAL_ERR;
            }
            *ve = EMU_VE_FAULT; /* the registered range is no longer mapped */
            return IBV_WC_REM_ACCESS_ERR;
        }
        done += (uint64_t)wrote;
    }
    return IBV_WC_SUCCESS;
}

/* How long a real requester keeps retrying before IBV_WC_RETRY_EXC_ERR:
 * 4.096 us * 2^timeout per try, retry_cnt + 1 tries; capped for tests. */
static uint64_t emu_retry_ms(const emu_qp_t *q)
{
    uint64_t us = (uint64_t)(4.096 * (double)(1ull << (q->timeout ? q->timeout : 14)));
    uint64_t ms = us * (q->retry_cnt + 1u) / 1000u;
    if (ms < 1)
        ms = 1;
    return ms < emu_cfg.retry_cap_ms ? ms : emu_cfg.retry_cap_ms;
}

/* TEST CONTROL of the emulation (exported): take the link of every emulated HCA that
 * process `pid` opened down (up = 0) or back up; returns how many. Packets to a down link
 * are lost, as on a pulled cable: the writers' HCAs retry them. */
__attribute__((visibility("default"))) int wxemu_verbs_link(int pid, int up)
{
    char prefix[64], path[400];
    struct dirent *e;
    int n = 0;
    DIR *d = opendir("/dev/shm");
    if (!d)
        return -errno;
    snprintf(prefix, sizeof prefix, "wxemu_verbs.%u.lid", (unsigned)getuid());
    while ((e = readdir(d)) != NULL) {
        emu_shm_t *s;
        int fd;
        if (strncmp(e->d_name, prefix, strlen(prefix)) != 0)
            continue;
        snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
        fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0)
            continue;
        s = mmap(NULL, sizeof *s, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (s == MAP_FAILED)
            continue;
        if (s->magic == EMU_MAGIC && s->version == EMU_VERSION && s->pid == pid) {
            __atomic_store_n(&s->link_down, up ? 0u : 1u, __ATOMIC_RELEASE);
            n++;
        }
        munmap(s, sizeof *s);
    }
    closedir(d);
    return n;
}

static uint64_t emu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The next QP with a WR to execute (or to flush), round robin; NULL if none. A QP whose
 * head WR waits for its next retry is skipped until then. ec->lock held. */
static emu_qp_t *emu_next_qp(emu_ctx_t *ec, uint32_t *rr, uint64_t now, int *waiting)
{
    *waiting = 0;
    for (uint32_t k = 0; k < EMU_MAX_QP; k++) {
        emu_qp_t *c = ec->qps[(*rr + k) % EMU_MAX_QP];
        if (!c || c->destroyed || c->executed >= c->posted)
            continue;
        if (c->next_try_ns > now && c->slot->state != IBV_QPS_ERR) {
            *waiting = 1;
            continue;
        }
        *rr = (*rr + k + 1) % EMU_MAX_QP;
        return c;
    }
    return NULL;
}

/* The head WR of q got no answer: retry it in 50 ms while the QP's retry time lasts (other
 * QPs go on meanwhile). 1: it waits for that retry; 0: retries exhausted. ec->lock held. */
static int emu_retry_later(emu_qp_t *q, uint64_t now)
{
    if (!q->retry_end_ns)
        q->retry_end_ns = now + emu_retry_ms(q) * 1000000ull;
    if (now >= q->retry_end_ns)
        return 0;
    q->next_try_ns = now + 50 * 1000000ull;
    return 1;
}

/* The HCA: executes each QP's send queue in order. A WR whose packets get no answer is
 * retried for the QP's retry time; a QP moved to the error state meanwhile flushes it and
 * every later WR: none of them reaches the responder any more. */
static void *emu_hca_main(void *arg)
{
    emu_ctx_t *ec = arg;
    uint32_t rr = 0;
    pthread_mutex_lock(&ec->lock);
    while (!ec->stop) {
        emu_qp_t *q;
        emu_wqe_t w;
        enum ibv_wc_status st;
        uint32_t ve = 0;
        int waiting;
        q = emu_next_qp(ec, &rr, emu_now_ns(), &waiting);
        if (!q) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += (waiting ? 10 : 50) * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&ec->cond, &ec->lock, &ts);
            continue;
        }
        w = q->sq[q->executed % q->cap.max_send_wr];
        if (q->slot->state == IBV_QPS_ERR) {
            /* After an error every outstanding WR completes, signaled or not, as flushed. */
            emu_cq_push(q->scq, q, w.wr_id, IBV_WC_WR_FLUSH_ERR, 0);
            q->executed++;
            q->retry_end_ns = q->next_try_ns = 0;
            continue;
        }
        q->busy = 1;
        pthread_mutex_unlock(&ec->lock);
        st = emu_exec(q, &w, &ve);
        pthread_mutex_lock(&ec->lock);
        q->busy = 0;
        pthread_cond_broadcast(&ec->cond);
        if (q->destroyed)
            continue;
        if (st == IBV_WC_RETRY_EXC_ERR && emu_retry_later(q, emu_now_ns()))
            continue; /* (moved to the error state meanwhile: flushed at its next turn) */
        q->retry_end_ns = q->next_try_ns = 0;
        if (st == IBV_WC_SUCCESS) {
            if ((w.flags & IBV_SEND_SIGNALED) || q->sig_all)
                emu_cq_push(q->scq, q, w.wr_id, st, 0);
        } else {
            emu_cq_push(q->scq, q, w.wr_id, st, ve);
            emu_qp_to_error(q);
        }
        q->executed++;
    }
    pthread_mutex_unlock(&ec->lock);
    return NULL;
}

int emu_hca_start(emu_ctx_t *ec)
{
    int rc = pthread_create(&ec->hca, NULL, emu_hca_main, ec);
    if (rc)
        return -rc;
    ec->hca_started = 1;
    return 0;
}

void emu_hca_stop(emu_ctx_t *ec)
{
    if (!ec->hca_started)
        return;
    pthread_mutex_lock(&ec->lock);
    __atomic_store_n(&ec->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&ec->cond);
    pthread_mutex_unlock(&ec->lock);
    pthread_join(ec->hca, NULL);
    ec->hca_started = 0;
}
