/* wx_transport.h - the one-sided write transport interface.
 *
 * A transport moves bytes from a local buffer into memory that another process registered,
 * without that process's code taking part (one-sided). Each backend (fabric, verbs,
 * cuda_ipc) fills a wx_transport_ops_t; the generic layer in wx_transport.c owns
 * everything the backends share:
 *
 *   - the table of local registrations (wx_mr_t) and the export blob that lists them;
 *   - the table of connected peers (wx_peer_t), each with the regions that peer exported;
 *   - validation of every write BEFORE the backend sees it: the remote key must be one the
 *     peer exported, the range must lie inside that region, the local range inside the
 *     local buffer. Backends never post an unchecked write (some providers, e.g. libfabric
 *     shm, do not check keys themselves).
 *
 * Connection setup is a three-step handshake carried by the caller's control plane
 * (TCPStore, a pipe, ...):
 *     writer:  wx_connect_request(t, export_blob)  -> peer, request bytes
 *     target:  wx_accept(t, request)                -> reply bytes
 *     writer:  wx_connect_finish(t, peer, reply)
 * A backend that needs no handshake returns an empty request; the caller may then skip
 * the round trip and call wx_connect_finish with an empty reply.
 *
 * Completions: a backend invokes op->done() exactly once for every write it accepted,
 * from a native thread it owns (its progress thread) or from inside a call made by the
 * caller. done() must be short and must not call back into the transport with its locks
 * held. close() completes every outstanding op with -ECANCELED before returning.
 *
 * All functions return 0 (or a count) or a negative errno, with the reason in
 * wx_last_error().
 */
#ifndef WX_TRANSPORT_H
#define WX_TRANSPORT_H

#include <pthread.h>

#include "wx_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* WX_KIND_FABRIC, WX_KIND_VERBS, WX_KIND_CUDA_IPC: one per line of wx_backends.def */
enum wx_kind {
#define WX_BACKEND(name, NAME, kind, needs) WX_KIND_##NAME = kind,
#include "wx_backends.def"
#undef WX_BACKEND
    WX_KIND__END
};

/* The name of a transport kind ("fabric", ...), NULL for a kind this build does not know. */
static inline const char *wx_kind_name(uint32_t kind)
{
    switch (kind) {
#define WX_BACKEND(name, NAME, k, needs)                                                           \
    case k:                                                                                        \
        return #name;
#include "wx_backends.def"
#undef WX_BACKEND
    default:
        return NULL;
    }
}
enum wx_mem { WX_MEM_HOST = 1, WX_MEM_CUDA = 2 };

#define WX_ADDR_MAX 256  /* transport address of a process (fabric ep name, ...) */
#define WX_BLOB_MAX 192  /* backend-specific remote info of a region (IPC handle, ...) */
#define WX_CONN_MAX 4096 /* connection request / reply */

/* What a remote writer needs to know about one registered region. */
typedef struct wx_rinfo {
    uint64_t key;   /* remote key */
    uint64_t rbase; /* remote address of byte 0: a virtual address, or 0 where the
                     * backend addresses regions by offset */
    uint64_t len;
    uint32_t mem;   /* enum wx_mem */
    int32_t device; /* CUDA ordinal, -1 for host */
    uint32_t blob_len;
    uint8_t blob[WX_BLOB_MAX];
} wx_rinfo_t;

/* A local registration. The generic layer fills addr/len/mem/device/id before calling
 * ops->reg; the backend fills key, rbase, blob, and keeps its own state in priv/ldesc. */
typedef struct wx_mr {
    void *addr;
    uint64_t len;
    uint32_t mem;
    int32_t device;
    uint32_t id;    /* unique in this transport */
    uint64_t key;   /* set by backend (or left 0 to let the generic layer assign one) */
    uint64_t rbase; /* set by backend */
    uint32_t blob_len;
    uint8_t blob[WX_BLOB_MAX];
    void *priv;   /* backend state */
    void *ldesc;  /* backend descriptor for local use as a write source (may be NULL) */
    int exported; /* listed in export blobs (regions registered as write targets) */
    struct wx_mr *next;
} wx_mr_t;

typedef struct wx_peer {
    uint32_t id;
    uint32_t addr_len;
    uint8_t addr[WX_ADDR_MAX];
    uint32_t nregions;
    wx_rinfo_t *regions; /* what the peer exported (validation table); read and replaced
                          * under t->lock only */
    void *priv;          /* backend per-peer state */
    int connected;
    char name[WX_NAME_MAX]; /* for messages: "peer 3 (fabric addr 127.0.0.1:4044)" */
} wx_peer_t;

/* One validated write: [local->addr + loff, +len) -> remote region at roff. */
typedef struct wx_wr {
    wx_mr_t *local;
    uint64_t loff;
    const wx_rinfo_t *remote;
    uint64_t roff;
    uint64_t len;
} wx_wr_t;

typedef struct wx_op wx_op_t;
struct wx_op {
    /* status: 0, or a negative errno; msg: NULL or a reason ("remote access error ..."). */
    void (*done)(wx_op_t *op, int status, const char *msg);
    uint64_t wr_id;
    void *user;
};

typedef struct wx_transport wx_transport_t;

/* What a backend can do (wx_transport_ops_t.caps), for callers that choose a backend or
 * its options (wxfer._wxfer.capabilities()). */
enum wx_cap {
    WX_CAP_HOST_MEM = 1 << 0,  /* registers and writes host memory */
    WX_CAP_CUDA_MEM = 1 << 1,  /* registers and writes CUDA memory */
    WX_CAP_SAME_HOST = 1 << 2, /* joins processes of one host only */
    WX_CAP_DEAD_PEER = 1 << 3, /* a write to a peer whose process is gone fails by itself (else
                                * only its deadline tells) */
};

typedef struct wx_transport_ops {
    const char *name;
    int kind; /* enum wx_kind */
    /* What it offers, reported as is by capabilities(): */
    uint32_t caps; /* enum wx_cap */
    /* Its place in "auto"'s choice for host / CUDA memory (1 first), 0: never chosen. */
    uint8_t auto_host, auto_cuda;
    /* The option names open() accepts (NULL-terminated; its own check uses the same list). */
    const char *const *options;
    /* Of those, the ones that name resources of the opening process's host (a NIC, a GPU):
     * a writer does not take them from the receivers' published options. */
    const char *const *host_options;
    /* Of those, the ones both ends must open with the same value: a receiver publishes its
     * own (its default when not given), and its writers open with that. */
    const char *const *shared_options;
    /* Option/value pairs (NULL-terminated) that make open() check that it can register CUDA
     * memory of a device, so that a machine where it cannot fails at setup; "{gpu}" stands
     * for the device's ordinal. NULL: nothing to check (or no CUDA memory). */
    const char *const *gpu_check;
    /* The value open() uses for `option` when it is not given (the environment read here),
     * NULL where it has none; NULL: no defaults to report. */
    const char *(*default_of)(const char *option);
    /* 0 if usable on this machine; otherwise a negative errno with the reason in `why`. */
    int (*probe)(const wx_opts_t *opts, char *why, size_t why_len);
    /* Allocate a backend struct whose first member is wx_transport_t; the generic layer
     * initialises that member after open returns. */
    int (*open)(const wx_opts_t *opts, wx_transport_t **out);
    void (*close)(wx_transport_t *t);
    int (*address)(wx_transport_t *t, uint8_t *buf, size_t *len);
    int (*reg)(wx_transport_t *t, wx_mr_t *mr);
    void (*dereg)(wx_transport_t *t, wx_mr_t *mr);
    int (*conn_request)(wx_transport_t *t, wx_peer_t *p, uint8_t *req, size_t *req_len);
    int (*conn_accept)(wx_transport_t *t, const uint8_t *req, size_t req_len, uint8_t *rep,
                       size_t *rep_len);
    int (*conn_finish)(wx_transport_t *t, wx_peer_t *p, const uint8_t *rep, size_t rep_len);
    void (*disconnect)(wx_transport_t *t, wx_peer_t *p);
    /* Post one validated write of at most t->max_write bytes. Returns 0 when posted (done()
     * will follow), -EAGAIN when the send queue is full (retry after a completion), or
     * another negative errno (done() will not be called). */
    int (*write)(wx_transport_t *t, wx_peer_t *p, const wx_wr_t *wr, wx_op_t *op);
    /* Optional: a one-line description of the backend's state (provider, device, ...). */
    int (*info)(wx_transport_t *t, char *buf, size_t len);
    /* Optional: the address in THIS process where bytes [roff, roff+len) of the validated
     * remote region `ri` of peer p are mapped, for kernels of this process to write
     * directly (cuda_ipc: the peer's opened IPC allocation); *device: the CUDA ordinal of
     * the memory, which is the writer's own GPU (other GPUs are refused). NULL: the
     * backend cannot map peers' memory (wx_map_remote says so). */
    int (*map)(wx_transport_t *t, wx_peer_t *p, const wx_rinfo_t *ri, uint64_t roff, uint64_t len,
               uint64_t *addr, int32_t *device);
    /* Optional: fence peer p, whose writes are being given up: make sure that none of the
     * writes accepted for it so far changes its memory after this returns, waiting at most
     * timeout_ns (done() of those writes may run meanwhile). 0: fenced; a negative errno:
     * not guaranteed. Either way `how` says what was done and what may still land. The
     * caller posts no more writes to p afterwards (verbs refuses them). Called without any
     * lock of the caller held. */
    int (*fence)(wx_transport_t *t, wx_peer_t *p, uint64_t timeout_ns, char *how, size_t len);
} wx_transport_ops_t;

/* The operations every backend has (info and fence included; conn_accept apart), named
 * wx__<prefix>_<operation>: a backend's wx_transport_ops_t lists its name, capabilities and
 * options, then WX_TRANSPORT_OPS(<prefix>), its conn_accept and its optional ones (map,
 * default_of). */
#define WX_TRANSPORT_OPS(p)                                                                        \
    .probe = wx__##p##_probe, .open = wx__##p##_open, .close = wx__##p##_close,                    \
    .address = wx__##p##_address, .reg = wx__##p##_reg, .dereg = wx__##p##_dereg,                  \
    .conn_request = wx__##p##_conn_request, .conn_finish = wx__##p##_conn_finish,                  \
    .disconnect = wx__##p##_disconnect, .write = wx__##p##_write, .info = wx__##p##_info,          \
    .fence = wx__##p##_fence

/* The conn_accept of a backend with no handshake (its conn_request sends nothing; wx_accept
 * answers an empty request itself): a request is refused, -EPROTO naming its size. */
int wx_no_handshake(wx_transport_t *t, const uint8_t *req, size_t req_len, uint8_t *rep,
                    size_t *rep_len);

struct wx_transport {
    const wx_transport_ops_t *ops;
    pthread_mutex_t lock; /* guards mrs and peers (not the backend's data path) */
    wx_mr_t *mrs;
    uint32_t next_mr_id;
    uint64_t next_key;
    wx_peer_t **peers;
    uint32_t npeers, cap_peers;
    /* Backend limits, set by open(): */
    uint64_t max_write;    /* largest single write the backend posts */
    uint32_t max_inflight; /* writes the backend can have outstanding */
    int needs_local_reg;   /* write sources must be registered (verbs, efa) */
    int key_is_backend;    /* backend chooses keys (otherwise the generic layer does) */
};

/* The backend called `name`, or NULL when it is not part of this build. */
const wx_transport_ops_t *wx_transport_find(const char *name);
/* The i-th backend of wx_backends.def (0-based) in *name; its ops, or NULL when this build
 * compiled it out. Returns -ENOENT past the last one. */
int wx_transport_backend(int i, const char **name, const wx_transport_ops_t **ops);

int wx_transport_open(const char *name, const wx_opts_t *opts, wx_transport_t **out);
void wx_transport_close(wx_transport_t *t);

/* Register [addr, addr+len). `exported` regions are listed by wx_export and may be written
 * by peers; others are write sources only. */
int wx_reg(wx_transport_t *t, void *addr, uint64_t len, uint32_t mem, int32_t device, int exported,
           wx_mr_t **out);
int wx_dereg(wx_transport_t *t, wx_mr_t *mr);
/* Remote info for one registration (what a descriptor carries). */
void wx_mr_rinfo(const wx_mr_t *mr, wx_rinfo_t *ri);

/* Export blob: this process's transport address and every exported region. Versioned. */
int wx_export(wx_transport_t *t, uint8_t *buf, size_t cap, size_t *len);

int wx_connect_request(wx_transport_t *t, const uint8_t *export_blob, size_t blob_len,
                       wx_peer_t **peer, uint8_t *req, size_t *req_len);
int wx_accept(wx_transport_t *t, const uint8_t *req, size_t req_len, uint8_t *rep, size_t *rep_len);
int wx_connect_finish(wx_transport_t *t, wx_peer_t *p, const uint8_t *rep, size_t rep_len);
wx_peer_t *wx_peer_by_addr(wx_transport_t *t, const uint8_t *addr, uint32_t addr_len);
wx_peer_t *wx_peer_by_id(wx_transport_t *t, uint32_t id);

/* Check a write against the peer's exported table and the local buffer (it does not post:
 * wx_post_write does). `rkey`, `rbase` and `rlen` come from the writer's descriptor. On
 * success *ri is a copy of the peer's table entry, taken under t->lock: a later refresh
 * of the table (wx_connect_request with a newer export blob) frees the table, never the
 * copy a queued write holds. */
int wx_validate(wx_transport_t *t, wx_peer_t *p, uint64_t rkey, uint64_t rbase, uint64_t rlen,
                uint64_t roff, uint64_t len, const wx_mr_t *local, uint64_t loff, wx_rinfo_t *ri);
int wx_post_write(wx_transport_t *t, wx_peer_t *p, const wx_wr_t *wr, wx_op_t *op);
/* ops->fence, or -ENOTSUP with the reason in `how` for a backend that cannot fence. */
int wx_fence(wx_transport_t *t, wx_peer_t *p, uint64_t timeout_ns, char *how, size_t len);

/* Where [roff, roff+len) of a connected peer's region (rkey/rbase/rlen from the writer's
 * descriptor) is mapped in this process: validated exactly as a write is (wx_validate: the
 * key one the peer exported, the range inside the region), then asked of the backend's
 * map(). -EOPNOTSUPP for a backend that cannot map peers' memory. The mapping stays valid
 * until the transport closes; writes through it bypass the transport (no completion, no
 * ordering with its writes): the caller orders them itself. */
int wx_map_remote(wx_transport_t *t, wx_peer_t *p, uint64_t rkey, uint64_t rbase, uint64_t rlen,
                  uint64_t roff, uint64_t len, uint64_t *addr, int32_t *device);

#ifdef __cplusplus
}
#endif
#endif
