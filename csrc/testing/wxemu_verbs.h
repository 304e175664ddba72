/* wxemu_verbs.h - private header of the libibverbs EMULATION used by the wxfer test suite.
 *
 * THIS IS AN EMULATION, NOT A BACKEND. It is built into csrc/testing/libwxemu_verbs.so by
 * csrc/testing/build.sh, loaded by the verbs backend only when WXFER_LIBIBVERBS names it, and
 * never shipped in a wheel. It implements the libibverbs entry points the backend uses and
 * enforces their rules (see docs/verbs.md, "The emulation"), so that the real backend code
 * runs in CI on machines without an RDMA device.
 *
 * Model: every opened emulated device context is one "HCA" with a LID. Its memory-region and
 * queue-pair tables live in a shared-memory file /dev/shm/wxemu_verbs.<uid>.lid<LID> so that
 * another process's emulated HCA can check keys, bounds, access flags and QP state before it
 * writes. The writer's HCA is a native thread of the writer process that executes posted
 * work requests in order and performs the RDMA WRITE with process_vm_writev() into the
 * target process; the target process runs no code for it.
 */
#ifndef WXEMU_VERBS_H
#define WXEMU_VERBS_H

#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define EMU_MAGIC 0x57584555u /* "WXEU" */
#define EMU_VERSION 3
#define EMU_MAX_MR 4096
#define EMU_MAX_QP 1024
#define EMU_MAX_SGE 16
#define EMU_MAX_QP_WR 16384
#define EMU_MAX_CQE 262144
#define EMU_QPN_BASE 0x200
#define EMU_MAX_DEV 8

/* Shared with other processes (the remote HCA reads these). */
/* What an MR's pages are (emu_mr_slot_t.kind). */
enum { EMU_MR_HOST = 0, EMU_MR_DMABUF = 1, EMU_MR_PEERMEM = 2 };

typedef struct emu_mr_slot {
    uint32_t key; /* lkey == rkey; 0 = free */
    uint32_t pd;
    uint32_t access;
    uint32_t kind; /* EMU_MR_*: host pages, or GPU memory through a dma-buf / peermem */
    uint64_t addr; /* iova (== the owner's virtual address) */
    uint64_t len;
    /* GPU memory (kind != HOST): the CUDA allocation holding it, in the owner process, and
     * a CUDA IPC handle of that allocation, through which the writer's emulated HCA reaches
     * it (a real NIC reaches it over PCIe). */
    uint64_t cuda_base;
    int32_t cuda_dev;
    uint32_t pad;
    uint8_t ipc[64];
} emu_mr_slot_t;

typedef struct emu_qp_slot {
    uint32_t qpn; /* 0 = free */
    uint32_t state;
    uint32_t pd;
    uint32_t access;
    uint32_t dest_qpn;
    uint32_t rq_psn;
    uint16_t dlid;
    uint8_t path_mtu;
    uint8_t pad[5];
} emu_qp_slot_t;

typedef struct emu_shm {
    uint32_t magic, version;
    int32_t pid;
    uint32_t lid;
    uint64_t starttime; /* /proc/pid/stat field 22, guards against pid reuse */
    emu_mr_slot_t mr[EMU_MAX_MR];
    emu_qp_slot_t qp[EMU_MAX_QP];
    uint32_t link_down; /* 1: this HCA's link is down (wxemu_verbs_link): packets to it are lost */
} emu_shm_t;

struct emu_ctx;

typedef struct emu_pd {
    struct ibv_pd pd;
    uint32_t id;
    int nobj; /* MRs + QPs using it */
} emu_pd_t;

typedef struct emu_cq {
    struct ibv_cq cq;
    struct ibv_wc *ring;
    uint32_t cap, head, count;
    int overrun;
    int nqp;
} emu_cq_t;

typedef struct emu_wqe {
    uint64_t wr_id;
    uint32_t flags; /* IBV_SEND_SIGNALED */
    uint32_t nsge;
    struct ibv_sge sge[EMU_MAX_SGE];
    uint64_t raddr;
    uint32_t rkey;
    int done; /* executed by the HCA */
} emu_wqe_t;

typedef struct emu_qp {
    struct ibv_qp qp;
    struct emu_ctx *ec;
    emu_pd_t *epd;
    emu_cq_t *scq, *rcq;
    emu_qp_slot_t *slot;
    struct ibv_qp_cap cap;
    int sig_all;
    /* attributes */
    uint8_t port, timeout, retry_cnt, rnr_retry, path_mtu;
    uint32_t access, sq_psn, rq_psn, dest_qpn;
    struct ibv_ah_attr ah;
    /* send queue: [retired, posted) occupy slots; [executed, posted) wait for the HCA */
    emu_wqe_t *sq;
    uint64_t posted, executed, retired;
    /* the remote HCA, resolved at the first write */
    emu_shm_t *remote;
    uint32_t remote_lid;
    int psn_checked;
    int busy;                           /* the HCA thread is executing one of its WRs */
    uint64_t retry_end_ns, next_try_ns; /* its head WR got no answer: retried until then */
    int destroyed;
} emu_qp_t;

typedef struct emu_ctx {
    struct ibv_context ctx;
    int devidx;
    uint32_t lid;
    emu_shm_t *shm;
    char shm_path[128];
    pthread_mutex_t lock; /* everything of this context */
    pthread_cond_t cond;
    pthread_t hca;
    int hca_started, stop;
    uint32_t next_pd;
    emu_qp_t *qps[EMU_MAX_QP];
    int nres;
    int mr_fd[EMU_MAX_MR];          /* dma-buf MRs: our reference to the dma-buf (dup), else -1 */
    uint64_t mr_pinned[EMU_MAX_MR]; /* bytes counted against RLIMIT_MEMLOCK */
} emu_ctx_t;

/* settings of the emulated devices (from WXEMU_VERBS_* environment variables) */
typedef struct emu_cfg {
    int ndev;
    int eth;          /* link layer Ethernet (RoCE) instead of InfiniBand */
    uint32_t max_msg; /* port max_msg_sz */
    int active_mtu;   /* enum ibv_mtu */
    uint32_t retry_cap_ms;
    const char *sysfs;
    int dmabuf;  /* WXEMU_VERBS_DMABUF (default 1): ibv_reg_dmabuf_mr supported */
    int peermem; /* WXEMU_VERBS_PEERMEM (default 0): "nvidia-peermem is loaded" */
    int memlock; /* WXEMU_VERBS_MEMLOCK: 0 (default) host MRs are not counted against
                      * RLIMIT_MEMLOCK; 1 counted as the kernel does (CAP_IPC_LOCK exempts);
                      * 2 ("nocap") counted as for a process without CAP_IPC_LOCK */
} emu_cfg_t;

/* Internal to the emulation: not exported from libwxemu_verbs.so. */
#pragma GCC visibility push(hidden)
extern emu_cfg_t emu_cfg;

/* wxemu_verbs_hca.c */
int emu_hca_start(emu_ctx_t *ec);
void emu_hca_stop(emu_ctx_t *ec);
int emu_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
int emu_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc);
void emu_cq_push(emu_cq_t *cq, emu_qp_t *q, uint64_t wr_id, enum ibv_wc_status st,
                 uint32_t vendor_err);
void emu_qp_to_error(emu_qp_t *q);
uint64_t emu_proc_starttime(pid_t pid);
emu_shm_t *emu_shm_open_lid(uint32_t lid);
void emu_gid_of(uint32_t lid, int index, union ibv_gid *gid);
uint32_t emu_lid_of_gid(const union ibv_gid *gid);

/* wxemu_verbs.c: state shared with wxemu_verbs_mr.c */
extern pthread_mutex_t emu_glock; /* the counters below */
extern uint64_t emu_stat_reg, emu_stat_dereg;
extern uint32_t emu_keygen;
void emu_init_once(void); /* emu_cfg from the environment, once */

/* wxemu_verbs_cuda.c: GPU memory (libcuda dlopened by the emulation itself) */
/* [va, va + len) inside one CUDA allocation of this process: fill s's cuda_* and ipc fields.
 * 0, or an errno with the reason in why. */
int emu_cuda_describe(uint64_t va, uint64_t len, emu_mr_slot_t *s, char *why, size_t why_len);
/* The RDMA WRITE of n local pieces (lcuda[i]: that piece is GPU memory of this process) to
 * raddr of the remote MR m (process R), with CUDA copies where either side is GPU memory.
 * Returns the completion status; *ve the vendor error. */
enum ibv_wc_status emu_cuda_write(const struct iovec *liov, const int *lcuda, int n,
                                  const emu_shm_t *R, const emu_mr_slot_t *m, uint64_t raddr,
                                  uint32_t *ve);
#pragma GCC visibility pop

#endif
