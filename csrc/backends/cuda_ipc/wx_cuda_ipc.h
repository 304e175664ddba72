/* wx_cuda_ipc.h - private to the cuda_ipc backend (wx_cuda_ipc_setup.c: setup, registration,
 * connection and the table of opened handles; wx_cuda_ipc_data.c: the data path).
 *
 * How it works (docs/cuda_ipc.md has the measurements behind the choices):
 *   - The target registers CUDA memory; reg() finds the whole allocation around it
 *     (cuMemGetAddressRange), takes its IPC handle (cuIpcGetMemHandle) and puts handle,
 *     offset of the region in the allocation, allocation base and size, owner pid,
 *     process nonce, boot id and GPU UUID / PCI bus id in mr->blob.
 *   - The writer opens every allocation of a peer's export table ONCE, at connect time
 *     (or at the first write to a region the peer exported later), in the writer GPU's
 *     primary context with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, so the copy engines of the
 *     writer's GPU push straight over NVLink into the target's memory. Mappings are keyed
 *     by (owner process, allocation base, handle), so regions of one allocation share one
 *     open, and kept for the life of the transport.
 *   - write() posts cuMemcpyAsync on the backend's own non-blocking streams (round robin)
 *     and records an event; a native progress thread polls the events and calls done().
 *   - The target process runs nothing per write.
 */
#ifndef WX_CUDA_IPC_H
#define WX_CUDA_IPC_H

#include <pthread.h>

#include "wx_dl_cuda.h"
#include "wx_transport.h"

#define WX_CI_STREAMS_MAX 16
#define WX_CI_SPLIT_MAX 8
/* Defaults of max_inflight, poll_us and pick=least: a Qwen3-8B plan's 399 zero-copy writes
 * (16.4 GB) on one H200 took 8.25 ms with them against 10.10 ms with 64 / 0 / rr, against
 * 7.68 ms for one copy of the bytes (benchmarks/bench_ipc_tasks.py, 2026-12-01): with 64
 * slots completed in posting order, small writes queued behind 1.2 GB ones held every slot. */
#define WX_CI_INFLIGHT 256
#define WX_CI_POLL_US 20
/* The version stamps' path (issue 37): a write of at most WX_CI_SPIN_BYTES is polled with
 * sched_yield (up to 200 times) before the poll_us sleeps, since it lands within microseconds;
 * and once no write is in flight the progress thread keeps looking for a new one for
 * WX_CI_LINGER_NS before it sleeps on its condition variable, so that the write posted right
 * after the last one completed (the end stamps after the step's last data write, the data
 * after the begin stamps) needs no wake-up of a sleeping thread (46-85 us each on one H100
 * host, runs/h100-2026-12-07-e's engine traces). */
#define WX_CI_SPIN_BYTES (64u << 10)
#define WX_CI_LINGER_NS (200 * 1000ull)
#define WX_CI_DEV_MAX 64
#define WX_CI_BUCKETS 1024

#define WX_CI_ADDR_MAGIC "WXCA"
#define WX_CI_BLOB_MAGIC "WXCB"
#define WX_CI_VERSION 1

/* This process, as other processes see it (the transport address, minus its nonce). */
typedef struct wx__ci_proc {
    uint32_t pid;
    uint8_t boot_id[16]; /* /proc/sys/kernel/random/boot_id: one per booted kernel */
    uint64_t nonce;      /* random, drawn once per process (pid namespaces reuse pids) */
} wx__ci_proc_t;

/* Transport address (48 bytes). */
typedef struct wx__ci_addr {
    char magic[4];
    uint32_t version;
    uint32_t pid;
    uint32_t pad;
    uint8_t boot_id[16];
    uint64_t proc_nonce;
    uint64_t t_nonce; /* one per transport instance */
} wx__ci_addr_t;

/* mr->blob of an exported region (160 bytes; native byte order: one node only). */
typedef struct wx__ci_blob {
    char magic[4];
    uint32_t version;
    uint8_t handle[64];  /* CUipcMemHandle of the whole allocation */
    uint64_t alloc_base; /* allocation's address in the owner */
    uint64_t alloc_size;
    uint64_t offset; /* region start - alloc_base */
    uint64_t proc_nonce;
    uint8_t boot_id[16];
    uint8_t uuid[16]; /* owner's GPU */
    char pci[16];     /* owner's GPU, "0000:18:00.0" */
    uint32_t pid;
    int32_t device; /* owner's ordinal, in its own numbering */
} wx__ci_blob_t;

/* One opened allocation of a remote process. */
typedef struct wx__ci_map {
    uint32_t pid;
    uint64_t proc_nonce;
    uint64_t alloc_base;
    uint8_t handle[64];
    uint64_t size;
    CUdeviceptr dptr; /* allocation base in this process */
    CUcontext ctx;    /* primary context it was opened in (NULL for self), retained by it */
    int ctx_dev;      /* that context's ordinal */
    int fallback;     /* opened in the owner GPU's context because the writer's failed */
    int self;         /* the owner is this process: dptr = alloc_base, nothing opened */
    int local_dev;    /* owner GPU's ordinal here, -1 if not visible */
    uint32_t refs;    /* transports holding it (the table is process-wide) */
    struct wx__ci_map *next;
} wx__ci_map_t;

/* A transport's reference to a mapping (per-transport hash, so lookups take no global lock
 * once a transport has used a mapping). */
typedef struct wx__ci_ref {
    wx__ci_map_t *m;
    struct wx__ci_ref *next;
} wx__ci_ref_t;

/* One write in flight: up to WX_CI_SPLIT_MAX pieces, each with its event. */
typedef struct wx__ci_slot {
    CUevent ev[WX_CI_SPLIT_MAX];
    uint8_t sidx[WX_CI_SPLIT_MAX];  /* each piece's stream */
    uint64_t plen[WX_CI_SPLIT_MAX]; /* each piece's bytes */
    uint32_t nev;                   /* pieces posted */
    uint32_t nmade;                 /* events created */
    wx_op_t *op;
    uint64_t len;
    int busy;
    int next_free;
    int fail; /* a piece failed to post: complete with this status */
    char fail_msg[WX_ERRMSG_MAX / 2];
    char peer[WX_NAME_MAX]; /* for messages */
    const wx_peer_t *to;    /* the peer written (a fence waits for its slots) */
    uint64_t t_post;        /* when it was posted (TEST ONLY: _test_late_peer) */
} wx__ci_slot_t;

typedef struct wx__ci_comp {
    wx_op_t *op;
    int status;
    char msg[WX_ERRMSG_MAX / 2];
} wx__ci_comp_t;

typedef struct wx__ci {
    wx_transport_t base; /* first */
    const wx_cuda_api_t *cu;
    /* options */
    int opt_device; /* -1: current context's device, else 0 */
    uint32_t nstreams;
    uint64_t split;   /* split writes larger than this over streams (0: never) */
    int map_owner;    /* open handles in the owner GPU's context (diagnostic) */
    int peer_access;  /* enable peer access explicitly where possible */
    int ipc_lazy;     /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS when opening */
    uint32_t poll_us; /* progress thread: sleep between polls of a running write (0: spin
                       * with sched_yield first, then 4 us sleeps) */
    int pick_least;   /* a write goes to the stream with the fewest bytes queued (else
                       * round robin) */
    uint64_t t_nonce;
    uint64_t test_refuse_peer; /* TEST ONLY (_test_refuse_peer, WXFER_TESTING builds): writes to
                                * this peer id get -EAGAIN forever (a peer that never answers) */
    uint64_t test_late_peer;   /* TEST ONLY (_test_late_peer, _test_late_ms): the writes to this
                                * peer id land, but their completion is reported no earlier than */
    uint64_t test_late_ns;     /* this long after their post (a late copy, and its fence's wait) */

    pthread_mutex_t mu; /* everything below */
    pthread_cond_t cv;
    /* primary contexts retained, per ordinal */
    CUcontext pctx[WX_CI_DEV_MAX];
    uint8_t peer_on[WX_CI_DEV_MAX];
    /* writer side, started at the first connect or write */
    int started, closing, stop;
    int dev;
    CUcontext ctx;
    CUstream streams[WX_CI_STREAMS_MAX];
    uint64_t squeued[WX_CI_STREAMS_MAX]; /* bytes posted and not completed, per stream */
    uint32_t rr;
    wx__ci_slot_t *slots;
    uint32_t nslots;
    int free_head;
    uint32_t ninflight;
    uint32_t *fifo; /* busy slots in posting order (ring of nslots) */
    uint32_t fhead, fcount;
    pthread_t thr;
    int thr_started;
    /* opened handles */
    wx__ci_ref_t *buckets[WX_CI_BUCKETS];
    uint32_t nmaps;
    /* counters */
    uint64_t nwrites, nbytes, nerrors;
    char devname[64];
    char pci[16];
} wx__ci_t;

/* wx_cuda_ipc_setup.c */
const wx__ci_proc_t *wx__ci_proc(void);
const char *wx__ci_errname(const wx__ci_t *c, CUresult r);
void wx__ci_dev_ids(wx__ci_t *c, int dev, uint8_t uuid[16], char pci[16]);
int wx__ci_find_dev(wx__ci_t *c, const uint8_t uuid[16], const char *pci);
int wx__ci_retain(wx__ci_t *c, int dev, CUcontext *out);
/* Save the calling thread's context and make `ctx` current; wx__ci_pop restores it. */
int wx__ci_push(wx__ci_t *c, CUcontext ctx, CUcontext *saved);
void wx__ci_pop(wx__ci_t *c, CUcontext saved);
/* Start the writer side (context, streams, progress thread). Caller holds c->mu. */
int wx__ci_start(wx__ci_t *c);

/* wx_cuda_ipc_map.c: the mapping of a peer's region, opening its allocation if needed;
 * *offset: the region's offset in the allocation. Caller holds c->mu. */
int wx__ci_map_get(wx__ci_t *c, const wx_peer_t *p, const wx_rinfo_t *ri, wx__ci_map_t **out,
                   uint64_t *offset);
/* ops->map: the address here of [roff, +len) of a peer's region, on the writer's GPU only. */
int wx__ci_map(wx_transport_t *t, wx_peer_t *p, const wx_rinfo_t *ri, uint64_t roff, uint64_t len,
               uint64_t *addr, int32_t *device);
/* Drop this transport's references (the last one closes the handle). Caller holds c->mu. */
void wx__ci_maps_close(wx__ci_t *c);

/* wx_cuda_ipc_data.c */
int wx__ci_io_start(wx__ci_t *c);
void wx__ci_io_stop(wx__ci_t *c);
int wx__ci_write(wx_transport_t *t, wx_peer_t *p, const wx_wr_t *wr, wx_op_t *op);
int wx__ci_fence(wx_transport_t *t, wx_peer_t *p, uint64_t timeout_ns, char *how, size_t len);

#endif
