/* wx_verbs_dl.h - libibverbs, loaded from libibverbs.so.1 at run time.
 *
 * Always compiled: the types and inlines come from wx_ibv_abi.h (no infiniband/verbs.h
 * needed at build time); whether libibverbs is there is decided when it is first loaded.
 * $WXFER_LIBIBVERBS may name another file; the test suite points it at the EMULATION
 * library csrc/testing/libwxemu_verbs.so (never shipped, see docs/verbs.md).
 *
 * Calls that verbs.h (rdma-core 44) defines as static inline functions (reproduced in
 * wx_ibv_abi.h) need no entry here
 * because they only dispatch through the context's ops table and reference no symbol:
 * ibv_post_send, ibv_poll_cq and ibv_req_notify_cq go through qp->context->ops /
 * cq->context->ops, which whatever library opened the device filled in (the emulation fills
 * them in the ibv_context it returns). Several other verbs.h names are macros or inlines that
 * DO reference library symbols (ibv_query_port, ibv_reg_mr, ibv_query_gid_ex); the backend
 * must not use those names directly (the extension would then carry undefined ibv_* symbols)
 * and calls the helpers below, which do what the inline would do through this table.
 */
#ifndef WX_VERBS_DL_H
#define WX_VERBS_DL_H

#include "wx_ibv_abi.h"

typedef struct wx_verbs_api {
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
    /* exported ibv_query_port (IBVERBS_1.1): the inline ___ibv_query_port falls back to it
     * for contexts that are not extended; takes a full struct ibv_port_attr in practice. */
    int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*query_qp)(struct ibv_qp *, struct ibv_qp_attr *, int, struct ibv_qp_init_attr *);
    int (*destroy_qp)(struct ibv_qp *);
    const char *(*wc_status_str)(enum ibv_wc_status);
    /* optional (NULL when the library is older) */
    struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int);
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int);
    int (*query_gid_ex)(struct ibv_context *, uint32_t, uint32_t, struct ibv_gid_entry *, uint32_t,
                        size_t); /* _ibv_query_gid_ex */
    char path[256];              /* the file that was loaded */
    int emulated; /* the library says it is the wxfer emulation (wxemu_verbs_is_emulation) */
    /* the emulation only: 1 when its host "has nvidia-peermem loaded" (wxemu_verbs_peermem) */
    int (*emu_peermem)(void);
} wx_verbs_api_t;

/* Load libibverbs.so.1 (or $WXFER_LIBIBVERBS) once. Returns the table, or NULL with the
 * reason in why. Thread-safe. */
const wx_verbs_api_t *wx_verbs_api(char *why, size_t why_len);

/* What the verbs.h inlines do, through the table. */
int wx_ibv_query_port(const wx_verbs_api_t *v, struct ibv_context *ctx, uint8_t port,
                      struct ibv_port_attr *attr);
/* GID of (port, index) and its type (IBV_GID_TYPE_IB / _ROCE_V1 / _ROCE_V2); type from
 * _ibv_query_gid_ex when present, else from sysfs gid_attrs/types. */
int wx_ibv_query_gid_typed(const wx_verbs_api_t *v, struct ibv_context *ctx, uint8_t port,
                           int index, union ibv_gid *gid, int *type);

#endif
