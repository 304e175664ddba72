/* wx_fabric.h - private state of the libfabric backend (wx_fabric_*.c).
 *
 * One transport = one fabric, domain, address vector, completion queue and FI_EP_RDM
 * endpoint, plus a native progress thread that reads the CQ. The thread is needed on both
 * sides: over tcp;ofi_rxm and shm the target's provider only accepts connections and lands
 * incoming writes while somebody reads its CQ, and on the writer it turns completions into
 * op->done() calls.
 *
 * Files: wx_fabric_setup.c (probe/open/close, address, peers), wx_fabric_reg.c
 * (registration), wx_fabric_data.c (write, progress thread, completions).
 *
 * Options: provider (tcp = "tcp;ofi_rxm", shm, efa, or an exact provider string), iface
 * (domain name; default $WXFER_IFACE, else $WXFER_FABRIC_IFACE, else "lo" for tcp), chunk (largest single
 * write, default 4 MiB, capped at max_msg_size), depth (writes in flight, default 64,
 * capped at tx_attr->size), timeout (seconds a posted write may stay incomplete before it
 * fails with -ETIMEDOUT and fails its peer; default 30, 0 = off), hmem (auto|on|off: ask
 * for FI_HMEM), progress (auto|wait|poll: block in fi_cq_sread or poll the CQ).
 *
 * Behaviour measured on libfabric 1.17 (Debian 12) that this backend handles:
 *   - tcp;ofi_rxm answers -FI_EAGAIN while connecting to a new peer, and for a peer that
 *     died either an error completion (ENOTCONN/EPIPE) or -FI_EAGAIN for ever; an unbroken
 *     -FI_EAGAIN run longer than `timeout` fails the peer.
 *   - shm: fi_cq_sread does not drive incoming writes (poll instead); a write to a process
 *     that died never completes, so the writer checks the pid in the peer's shm address
 *     ("fi_shm://PID:N:N") and fails such writes with -EPIPE within ~100 ms; a write
 *     with a key the target never registered neither lands nor completes (ends by
 *     `timeout`) - the generic layer refuses such writes before they reach the provider.
 *   - shm: each endpoint is a file /dev/shm/PID:N:N, removed by fi_close (our close()).
 *     A process killed before closing leaves it behind (16 MiB each here); nothing
 *     reuses it, and it can be removed once that PID is gone: rm /dev/shm/PID:*.
 */
#ifndef WX_FABRIC_H
#define WX_FABRIC_H

#include <pthread.h>
#include <stdatomic.h>


#include "wx_fabric_dl.h"
#include "wx_transport.h"

enum { WX_FAB_FREE = 0, WX_FAB_POSTED = 1, WX_FAB_ABANDONED = 2 };

/* Per-peer state. Lives until the transport closes (slots of writes in flight point to it
 * after the generic layer has freed the wx_peer_t). */
typedef struct wx_fab_peer {
    struct wx_fab_peer *next;
    char name[WX_NAME_MAX]; /* copy of wx_peer_t.name for messages */
    fi_addr_t fa;
    int in_av;
    uint64_t eagain_since; /* start of an unbroken run of -FI_EAGAIN answers, else 0 */
    uint64_t eagain_check; /* next liveness check during such a run (shm) */
    long pid;              /* shm: the peer's process id (from its address), else 0 */
    int gone;              /* shm: that process no longer exists */
    atomic_uint inflight;
    int failed;              /* a write to it failed for good: refuse further writes */
    char why[WX_ERRMSG_MAX]; /* ... and why */
} wx_fab_peer_t;

/* One outstanding write. ctx must stay first: the provider hands its address back. */
typedef struct wx_fab_slot {
    struct fi_context2 ctx;
    wx_op_t *op;
    wx_fab_peer_t *fp;
    uint64_t len;
    uint64_t posted_ns;
    int state;
    struct wx_fab_slot *next_free;
} wx_fab_slot_t;

typedef struct wx_fab {
    wx_transport_t base; /* first */
    const wx_fi_api_t *api;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    struct fid_cntr *rcntr; /* poll mode: counts writes that landed here (FI_RMA_EVENT) */
    uint64_t mr_mode;
    int hmem;      /* provider offers FI_HMEM */
    int want_wait; /* option progress: try a CQ wait object */
    int cq_wait;   /* CQ has a wait object: the thread blocks in fi_cq_sread */
    int serialize; /* provider is not FI_THREAD_SAFE: dlock around every data call */
    uint64_t write_flags;
    uint64_t chunk;
    uint32_t depth;
    uint64_t op_timeout_ns;
#ifdef WX_TESTING
    uint64_t test_refuse_peer; /* TEST ONLY (_test_refuse_peer): writes to this peer id get
                                * -EAGAIN forever, as from a provider reconnecting to a dead
                                * peer; UINT64_MAX = off */
#endif

    pthread_mutex_t dlock;     /* data-path calls, only when serialize */
    pthread_mutex_t slot_lock; /* slots, free list, counters */
    wx_fab_slot_t *slots;
    wx_fab_slot_t *free_slots;
    uint32_t posted;    /* slots in state POSTED */
    uint32_t abandoned; /* slots in state ABANDONED */

    wx_fab_peer_t *fpeers; /* every wx_fab_peer_t, freed at close (under slot_lock) */

    pthread_t thread;
    int thread_started;
    atomic_int stop;

    uint8_t addr[WX_ADDR_MAX];
    size_t addr_len;
    char addr_str[128];
    char prov[64];
    char dom[64];

    atomic_ullong n_writes, n_bytes, n_errors, n_timeouts;
    atomic_ullong n_reg_host, n_reg_cuda; /* fi_mr_regattr calls that succeeded, by memory */
} wx_fab_t;

#define WX_FAB(t) ((wx_fab_t *)(t))

/* wx_fabric_probe.c: "prov/domain, ..." of the providers that offer FI_HMEM ("" none) */
void wx__fab_hmem_providers(char *out, size_t len);

/* wx_fabric_reg.c */
int wx__fab_reg(wx_transport_t *t, wx_mr_t *mr);
void wx__fab_dereg(wx_transport_t *t, wx_mr_t *mr);

/* wx_fabric_data.c */
int wx__fab_write(wx_transport_t *t, wx_peer_t *p, const wx_wr_t *wr, wx_op_t *op);
int wx__fab_slots_init(wx_fab_t *f);
int wx__fab_thread_start(wx_fab_t *f);
void wx__fab_thread_stop(wx_fab_t *f);
/* done(-ECANCELED) now for every write to fp still in flight; the provider keeps their
 * slots (ABANDONED) until it lets go. Used when the peer is disconnected: the generic layer
 * frees its wx_peer_t right after, and callers' done() may look at it. */
void wx__fab_cancel_peer(wx_fab_t *f, wx_fab_peer_t *fp, const char *why);
/* After the endpoint is closed: done(-ECANCELED) for every POSTED slot, free the slots. */
void wx__fab_cancel_all(wx_fab_t *f);

/* Record "call failed: fi_strerror (-rc)" with context; returns a negative errno. */
int wx__fab_err(int rc, const char *fmt, ...) WX_PRINTF(2, 3);

#endif
