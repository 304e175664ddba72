/* wx_verbs.h - private header of the verbs backend (ibverbs RC RDMA WRITE).
 *
 * Split like NCCL's net_ib: wx_verbs_setup.c (NIC choice, ports, GIDs), wx_verbs_reg.c
 * (memory registration and its cache), wx_verbs_conn.c (queue pairs and the handshake),
 * wx_verbs_data.c (ops table, data path, progress thread). See docs/verbs.md.
 */
#ifndef WX_VERBS_H
#define WX_VERBS_H

#include <pthread.h>

#include "wx_verbs_dl.h"
#include "wx_transport.h"

#define WX_VERBS_MAX_NICS 8
#define WX_VERBS_QP_BITS 16 /* wr_id = qp index << 48 | sequence */
#define WX_VERBS_SEQ_MASK ((1ull << 48) - 1)

typedef struct wx__vnic {
    char name[64];
    uint8_t port;
    int index; /* in this transport's NIC list */
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    int cq_cap, cq_used; /* entries, entries promised to QPs */
    struct ibv_port_attr pattr;
    struct ibv_device_attr dattr;
    int gid_index; /* -1: none used (InfiniBand LID routing) */
    int gid_type;
    union ibv_gid gid;
    char pci[256]; /* sysfs PCI path of the NIC ("" if unknown) */
    int distance;  /* PCI hops to the chosen GPU (-1 unknown) */
} wx__vnic_t;

typedef struct wx__vqp {
    struct ibv_qp *qp;
    wx__vnic_t *nic;
    uint32_t idx;    /* index in the transport's QP table (wr_id high bits) */
    int remote_nic;  /* the target NIC index this QP reaches */
    wx_peer_t *peer; /* writer side; NULL for target-side QPs */
    pthread_mutex_t lock;
    uint32_t depth; /* max_send_wr */
    struct wx__vslot {
        wx_op_t *op; /* NULL for a tail-flush WR */
        int sig;
    } * ring;                      /* depth entries, by sequence */
    uint64_t head;                 /* next sequence to post */
    uint64_t tail;                 /* oldest sequence not yet completed */
    uint64_t sig_posted, sig_done; /* count of signaled WRs posted / completed */
    uint32_t unsig_run;            /* unsignaled WRs posted since the last signaled one */
    uint64_t last_raddr;
    uint32_t last_rkey;
    uint32_t psn;
    int broken; /* an error completion arrived: the QP is in the error state */
    int broken_errno;
    char err[WX_ERRMSG_MAX / 2];
} wx__vqp_t;

typedef struct wx__vpeer {
    uint32_t nqp;
    wx__vqp_t *qps[2 * WX_VERBS_MAX_NICS * 4];
    uint32_t rr;
    uint32_t remote_nnic;
    struct wx__vpeer *next; /* all of this transport's, for close */
} wx__vpeer_t;

/* One ibv MR per local NIC for a registered range, shared by every wx_mr_t inside it. */
typedef struct wx__vreg {
    uint64_t base, len;
    uint32_t mem;
    int32_t device;
    int access;
    struct ibv_mr *mr[WX_VERBS_MAX_NICS];
    int refs;
    const char *how; /* "host", "peermem", "dmabuf" */
    struct wx__vreg *next;
} wx__vreg_t;

typedef struct wx_verbs {
    wx_transport_t base;
    const wx_verbs_api_t *v;
    wx__vnic_t nic[WX_VERBS_MAX_NICS];
    int nnic;
    /* options */
    int gpu;           /* CUDA ordinal for NIC choice, -1 none */
    int gid_index_opt; /* -1 auto */
    uint64_t chunk;
    uint32_t depth;
    uint32_t qps_per_pair;
    uint32_t sig_every;
    uint8_t timeout, retry_cnt;
    const char *reg_mode;    /* "auto", "dmabuf", "peermem" */
    int gpu_memory;          /* option gpu_memory=yes: GPU memory will be registered */
    char gpu_route[16];      /* "dmabuf" / "peermem" as decided at open ("" not checked) */
    char gpu_why[512];       /* ... and why */
#ifdef WX_TESTING            /* fault injection: test builds only (WXFER_TESTING=1) */
    uint32_t test_rkey_xor;  /* TEST ONLY: corrupt rkeys to exercise the HCA's own check */
    uint64_t test_raddr_add; /* TEST ONLY: shift remote addresses past the region */
#endif
    uint64_t nonce;
    /* queue pairs (writer and target side), indexed by wr_id */
    pthread_mutex_t qlock;
    wx__vqp_t **qps;
    uint32_t nqps, cap_qps;
    wx__vpeer_t *vpeers;
    /* registration cache */
    pthread_mutex_t rlock;
    wx__vreg_t *regs;
    uint64_t reg_calls, reg_hits;
    char reg_last[32];
    char reg_why[400];
    /* progress thread */
    pthread_t thr;
    int thr_started;
    int stop;
    pthread_mutex_t wlock;
    pthread_cond_t wcond;
    uint64_t inflight;
    char choice[400]; /* how the NICs were chosen */
} wx_verbs_t;

/* wx_verbs_setup.c */
int wx__verbs_open_nics(wx_verbs_t *t, const char *device_opt);
void wx__verbs_close_nics(wx_verbs_t *t);
/* Parse a plain `dev[:port],dev[:port]` list (a leading '^' makes it an exclusion list).
 * Returns the number of entries (<= max) or -EINVAL. Exposed for tests. */
int wx__verbs_parse_list(const char *s, char names[][64], int *ports, int max, int *exclude);
/* Number of PCI hops between two sysfs device paths. Exposed for tests. */
int wx__verbs_pci_distance(const char *a, const char *b);
/* sysfs PCI path of a GPU from its bus id ("0000:17:00.0"), using `sysfs` as /sys. */
int wx__verbs_gpu_pci_path(const char *sysfs, const char *busid, char *out, size_t len);
const char *wx__verbs_mtu_str(int mtu);

/* wx_verbs_reg.c */
int wx__verbs_reg(wx_transport_t *tt, wx_mr_t *mr);
void wx__verbs_dereg(wx_transport_t *tt, wx_mr_t *mr);
/* lkey of `mr` on NIC n */
uint32_t wx__verbs_lkey(const wx_mr_t *mr, int n);

/* wx_verbs_gpu.c */
/* Decide at open how GPU memory of t->gpu will be registered (t->gpu_route / gpu_why);
 * 0, or a negative errno with an error naming the cause and its fix. */
int wx__verbs_gpu_check(wx_verbs_t *t);
/* 1 when nvidia-peermem is loaded (the emulation: when it says so). */
int wx__verbs_peermem_loaded(const wx_verbs_t *t);
/* ", because ..." text for a registration that failed with errno e: names RLIMIT_MEMLOCK and
 * how to raise it when e is ENOMEM under a finite limit, else "". */
const char *wx__verbs_memlock_hint(int e, char *buf, size_t len);
/* The fix for a dma-buf or peermem failure, for error texts. */
#define WX_VERBS_FIX_DMABUF                                                                        \
    "dma-buf needs the NVIDIA open kernel module (driver >= 515) on Linux >= 5.12 and "            \
    "rdma-core >= 34"
#define WX_VERBS_FIX_PEERMEM "modprobe nvidia-peermem (it ships with the NVIDIA driver)"

/* wx_verbs_conn.c */
int wx__verbs_address(wx_transport_t *tt, uint8_t *buf, size_t *len);
int wx__verbs_conn_request(wx_transport_t *tt, wx_peer_t *p, uint8_t *req, size_t *req_len);
int wx__verbs_conn_accept(wx_transport_t *tt, const uint8_t *req, size_t req_len, uint8_t *rep,
                          size_t *rep_len);
int wx__verbs_conn_finish(wx_transport_t *tt, wx_peer_t *p, const uint8_t *rep, size_t rep_len);
void wx__verbs_disconnect(wx_transport_t *tt, wx_peer_t *p);
int wx__verbs_fence(wx_transport_t *tt, wx_peer_t *p, uint64_t timeout_ns, char *how, size_t len);
void wx__verbs_destroy_qp(wx_verbs_t *t, wx__vqp_t *q);

/* wx_verbs_data.c */
int wx__verbs_add_qp(wx_verbs_t *t, wx__vqp_t *q);
void wx__verbs_fail_qp(wx_verbs_t *t, wx__vqp_t *q, int err, const char *msg);

#endif
