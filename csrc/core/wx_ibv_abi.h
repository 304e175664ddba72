/* wx_ibv_abi.h - the part of libibverbs' ABI the verbs backend uses, declared here so that
 * the extension builds without libibverbs-dev (infiniband/verbs.h).
 *
 * Written from the public ABI of libibverbs.so.1 (symbol versions IBVERBS_1.0 .. 1.14) and
 * checked against the headers of rdma-core 44.0 (Debian 12's libibverbs-dev) by
 * `make abi-check` (csrc/abi/abi_check.py: every size, offset and constant listed in
 * csrc/abi/wx_abi_list.h compared with the system header's). The names are the library's
 * own, so code reads as it would against verbs.h; a translation unit includes this header
 * or verbs.h, never both.
 *
 * Only structs the backend allocates (attrs, work requests, completions) are declared in
 * full; objects the library allocates (device, context, pd, cq, qp, mr) only up to the last
 * field the backend reads, which is enough because their layout only grows at the end.
 * The verbs.h static inlines that dispatch through ctx->ops (ibv_post_send, ibv_poll_cq,
 * ibv_req_notify_cq) are reproduced below: they need the full struct ibv_context_ops
 * layout, and struct verbs_context from query_port on (the extended context lives before
 * struct ibv_context in memory and ends with it).
 */
#ifndef WX_IBV_ABI_H
#define WX_IBV_ABI_H

#if defined(INFINIBAND_VERBS_H)
#error "wx_ibv_abi.h and infiniband/verbs.h declare the same names: include one"
#endif

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* the rdma-core release the layouts below were checked against */
#define WX_IBV_ABI_CHECKED "rdma-core 44.0 (libibverbs.so.1, IBVERBS_1.14)"

struct ibv_pd;
struct ibv_cq;
struct ibv_qp;
struct ibv_srq;
struct ibv_comp_channel;
struct ibv_send_wr;

union ibv_gid {
    uint8_t raw[16];
    struct {
        uint64_t subnet_prefix; /* big endian */
        uint64_t interface_id;  /* big endian */
    } global;
};

enum ibv_gid_type { IBV_GID_TYPE_IB = 0, IBV_GID_TYPE_ROCE_V1 = 1, IBV_GID_TYPE_ROCE_V2 = 2 };

struct ibv_gid_entry {
    union ibv_gid gid;
    uint32_t gid_index;
    uint32_t port_num;
    uint32_t gid_type; /* enum ibv_gid_type */
    uint32_t ndev_ifindex;
};

enum ibv_node_type { IBV_NODE_UNKNOWN = -1, IBV_NODE_CA = 1 };
enum ibv_transport_type { IBV_TRANSPORT_UNKNOWN = -1, IBV_TRANSPORT_IB = 0 };
enum ibv_atomic_cap { IBV_ATOMIC_NONE = 0, IBV_ATOMIC_HCA = 1, IBV_ATOMIC_GLOB = 2 };

struct ibv_device_attr {
    char fw_ver[64];
    uint64_t node_guid;
    uint64_t sys_image_guid;
    uint64_t max_mr_size;
    uint64_t page_size_cap;
    uint32_t vendor_id;
    uint32_t vendor_part_id;
    uint32_t hw_ver;
    int max_qp;
    int max_qp_wr;
    unsigned int device_cap_flags;
    int max_sge;
    int max_sge_rd;
    int max_cq;
    int max_cqe;
    int max_mr;
    int max_pd;
    int max_qp_rd_atom;
    int max_ee_rd_atom;
    int max_res_rd_atom;
    int max_qp_init_rd_atom;
    int max_ee_init_rd_atom;
    enum ibv_atomic_cap atomic_cap;
    int max_ee;
    int max_rdd;
    int max_mw;
    int max_raw_ipv6_qp;
    int max_raw_ethy_qp;
    int max_mcast_grp;
    int max_mcast_qp_attach;
    int max_total_mcast_qp_attach;
    int max_ah;
    int max_fmr;
    int max_map_per_fmr;
    int max_srq;
    int max_srq_wr;
    int max_srq_sge;
    uint16_t max_pkeys;
    uint8_t local_ca_ack_delay;
    uint8_t phys_port_cnt;
};

enum ibv_mtu {
    IBV_MTU_256 = 1,
    IBV_MTU_512 = 2,
    IBV_MTU_1024 = 3,
    IBV_MTU_2048 = 4,
    IBV_MTU_4096 = 5
};

enum ibv_port_state {
    IBV_PORT_NOP = 0,
    IBV_PORT_DOWN = 1,
    IBV_PORT_INIT = 2,
    IBV_PORT_ARMED = 3,
    IBV_PORT_ACTIVE = 4,
    IBV_PORT_ACTIVE_DEFER = 5
};

enum {
    IBV_LINK_LAYER_UNSPECIFIED = 0,
    IBV_LINK_LAYER_INFINIBAND = 1,
    IBV_LINK_LAYER_ETHERNET = 2,
};

struct ibv_port_attr {
    enum ibv_port_state state;
    enum ibv_mtu max_mtu;
    enum ibv_mtu active_mtu;
    int gid_tbl_len;
    uint32_t port_cap_flags;
    uint32_t max_msg_sz;
    uint32_t bad_pkey_cntr;
    uint32_t qkey_viol_cntr;
    uint16_t pkey_tbl_len;
    uint16_t lid;
    uint16_t sm_lid;
    uint8_t lmc;
    uint8_t max_vl_num;
    uint8_t sm_sl;
    uint8_t subnet_timeout;
    uint8_t init_type_reply;
    uint8_t active_width;
    uint8_t active_speed;
    uint8_t phys_state;
    uint8_t link_layer;
    uint8_t flags;
    uint16_t port_cap_flags2;
};

enum ibv_wc_status {
    IBV_WC_SUCCESS = 0,
    IBV_WC_LOC_LEN_ERR = 1,
    IBV_WC_LOC_QP_OP_ERR = 2,
    IBV_WC_LOC_EEC_OP_ERR = 3,
    IBV_WC_LOC_PROT_ERR = 4,
    IBV_WC_WR_FLUSH_ERR = 5,
    IBV_WC_MW_BIND_ERR = 6,
    IBV_WC_BAD_RESP_ERR = 7,
    IBV_WC_LOC_ACCESS_ERR = 8,
    IBV_WC_REM_INV_REQ_ERR = 9,
    IBV_WC_REM_ACCESS_ERR = 10,
    IBV_WC_REM_OP_ERR = 11,
    IBV_WC_RETRY_EXC_ERR = 12,
    IBV_WC_RNR_RETRY_EXC_ERR = 13,
    IBV_WC_LOC_RDD_VIOL_ERR = 14,
    IBV_WC_REM_INV_RD_REQ_ERR = 15,
    IBV_WC_REM_ABORT_ERR = 16,
    IBV_WC_INV_EECN_ERR = 17,
    IBV_WC_INV_EEC_STATE_ERR = 18,
    IBV_WC_FATAL_ERR = 19,
    IBV_WC_RESP_TIMEOUT_ERR = 20,
    IBV_WC_GENERAL_ERR = 21,
};

enum ibv_wc_opcode { IBV_WC_SEND = 0, IBV_WC_RDMA_WRITE = 1, IBV_WC_RDMA_READ = 2 };

struct ibv_wc {
    uint64_t wr_id;
    enum ibv_wc_status status;
    enum ibv_wc_opcode opcode;
    uint32_t vendor_err;
    uint32_t byte_len;
    union {
        uint32_t imm_data; /* big endian */
        uint32_t invalidated_rkey;
    };
    uint32_t qp_num;
    uint32_t src_qp;
    unsigned int wc_flags;
    uint16_t pkey_index;
    uint16_t slid;
    uint8_t sl;
    uint8_t dlid_path_bits;
};

enum ibv_access_flags {
    IBV_ACCESS_LOCAL_WRITE = 1,
    IBV_ACCESS_REMOTE_WRITE = 1 << 1,
    IBV_ACCESS_REMOTE_READ = 1 << 2,
    IBV_ACCESS_RELAXED_ORDERING = 1 << 20, /* IB_UVERBS_ACCESS_OPTIONAL_FIRST */
};

struct ibv_device {
    void *_ops[2]; /* struct _ibv_device_ops: two function pointers */
    enum ibv_node_type node_type;
    enum ibv_transport_type transport_type;
    char name[64];        /* kernel device, e.g. "mlx5_0" */
    char dev_name[64];    /* uverbs device, e.g. "uverbs0" */
    char dev_path[256];   /* sysfs infiniband_verbs class device */
    char ibdev_path[256]; /* sysfs infiniband class device */
};

/* The dispatch table inside struct ibv_context. The slots named _compat_* are the ABI's
 * placeholders for calls that are exported functions today; the order and count is what
 * matters. */
struct ibv_context_ops {
    void *_compat_query_device;
    void *_compat_query_port;
    void *_compat_alloc_pd;
    void *_compat_dealloc_pd;
    void *_compat_reg_mr;
    void *_compat_rereg_mr;
    void *_compat_dereg_mr;
    void *alloc_mw;
    void *bind_mw;
    void *dealloc_mw;
    void *_compat_create_cq;
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
    void *_compat_cq_event;
    void *_compat_resize_cq;
    void *_compat_destroy_cq;
    void *_compat_create_srq;
    void *_compat_modify_srq;
    void *_compat_query_srq;
    void *_compat_destroy_srq;
    void *post_srq_recv;
    void *_compat_create_qp;
    void *_compat_query_qp;
    void *_compat_modify_qp;
    void *_compat_destroy_qp;
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
    void *post_recv;
    void *_compat_create_ah;
    void *_compat_destroy_ah;
    void *_compat_attach_mcast;
    void *_compat_detach_mcast;
    void *_compat_async_event;
};

struct ibv_context {
    struct ibv_device *device;
    struct ibv_context_ops ops;
    int cmd_fd;
    int async_fd;
    int num_comp_vectors;
    pthread_mutex_t mutex;
    void *abi_compat; /* (void *)UINTPTR_MAX: this is the tail of a struct verbs_context */
};

/* struct verbs_context from its first member (query_port) to its end; the members before
 * query_port are grown downwards by newer libraries and are not used here. Only the
 * distances to the end matter (verbs_get_ctx_op below). */
struct verbs_context {
    int (*query_port)(struct ibv_context *context, uint8_t port_num,
                      struct ibv_port_attr *port_attr, size_t port_attr_len);
    void *_slots[37]; /* advise_mr .. close_xrcd */
    uint64_t _ABI_placeholder3;
    size_t sz; /* the library's sizeof(struct verbs_context): newer ones are larger */
    struct ibv_context context;
};

struct ibv_pd {
    struct ibv_context *context;
    uint32_t handle;
};

struct ibv_mr {
    struct ibv_context *context;
    struct ibv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle;
    uint32_t lkey;
    uint32_t rkey;
};

struct ibv_cq {
    struct ibv_context *context;
    struct ibv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
};

struct ibv_global_route {
    union ibv_gid dgid;
    uint32_t flow_label;
    uint8_t sgid_index;
    uint8_t hop_limit;
    uint8_t traffic_class;
};

struct ibv_ah_attr {
    struct ibv_global_route grh;
    uint16_t dlid;
    uint8_t sl;
    uint8_t src_path_bits;
    uint8_t static_rate;
    uint8_t is_global;
    uint8_t port_num;
};

enum ibv_qp_type { IBV_QPT_RC = 2, IBV_QPT_UC = 3, IBV_QPT_UD = 4 };

struct ibv_qp_cap {
    uint32_t max_send_wr;
    uint32_t max_recv_wr;
    uint32_t max_send_sge;
    uint32_t max_recv_sge;
    uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
    void *qp_context;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    struct ibv_qp_cap cap;
    enum ibv_qp_type qp_type;
    int sq_sig_all;
};

enum ibv_qp_attr_mask {
    IBV_QP_STATE = 1 << 0,
    IBV_QP_CUR_STATE = 1 << 1,
    IBV_QP_ACCESS_FLAGS = 1 << 3,
    IBV_QP_PKEY_INDEX = 1 << 4,
    IBV_QP_PORT = 1 << 5,
    IBV_QP_QKEY = 1 << 6,
    IBV_QP_AV = 1 << 7,
    IBV_QP_PATH_MTU = 1 << 8,
    IBV_QP_TIMEOUT = 1 << 9,
    IBV_QP_RETRY_CNT = 1 << 10,
    IBV_QP_RNR_RETRY = 1 << 11,
    IBV_QP_RQ_PSN = 1 << 12,
    IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
    IBV_QP_MIN_RNR_TIMER = 1 << 15,
    IBV_QP_SQ_PSN = 1 << 16,
    IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
    IBV_QP_CAP = 1 << 19,
    IBV_QP_DEST_QPN = 1 << 20,
};

enum ibv_qp_state {
    IBV_QPS_RESET = 0,
    IBV_QPS_INIT = 1,
    IBV_QPS_RTR = 2,
    IBV_QPS_RTS = 3,
    IBV_QPS_SQD = 4,
    IBV_QPS_SQE = 5,
    IBV_QPS_ERR = 6,
    IBV_QPS_UNKNOWN = 7
};

enum ibv_mig_state { IBV_MIG_MIGRATED = 0, IBV_MIG_REARM = 1, IBV_MIG_ARMED = 2 };

struct ibv_qp_attr {
    enum ibv_qp_state qp_state;
    enum ibv_qp_state cur_qp_state;
    enum ibv_mtu path_mtu;
    enum ibv_mig_state path_mig_state;
    uint32_t qkey;
    uint32_t rq_psn;
    uint32_t sq_psn;
    uint32_t dest_qp_num;
    unsigned int qp_access_flags;
    struct ibv_qp_cap cap;
    struct ibv_ah_attr ah_attr;
    struct ibv_ah_attr alt_ah_attr;
    uint16_t pkey_index;
    uint16_t alt_pkey_index;
    uint8_t en_sqd_async_notify;
    uint8_t sq_draining;
    uint8_t max_rd_atomic;
    uint8_t max_dest_rd_atomic;
    uint8_t min_rnr_timer;
    uint8_t port_num;
    uint8_t timeout;
    uint8_t retry_cnt;
    uint8_t rnr_retry;
    uint8_t alt_port_num;
    uint8_t alt_timeout;
    uint32_t rate_limit;
};

struct ibv_qp {
    struct ibv_context *context;
    void *qp_context;
    struct ibv_pd *pd;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    uint32_t handle;
    uint32_t qp_num;
    enum ibv_qp_state state;
    enum ibv_qp_type qp_type;
};

enum ibv_wr_opcode { IBV_WR_RDMA_WRITE = 0, IBV_WR_RDMA_WRITE_WITH_IMM = 1, IBV_WR_SEND = 2 };

enum ibv_send_flags {
    IBV_SEND_FENCE = 1 << 0,
    IBV_SEND_SIGNALED = 1 << 1,
    IBV_SEND_SOLICITED = 1 << 2,
    IBV_SEND_INLINE = 1 << 3,
};

struct ibv_sge {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};

struct ibv_send_wr {
    uint64_t wr_id;
    struct ibv_send_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
    enum ibv_wr_opcode opcode;
    unsigned int send_flags;
    union {
        uint32_t imm_data; /* big endian */
        uint32_t invalidate_rkey;
    };
    union {
        struct {
            uint64_t remote_addr;
            uint32_t rkey;
        } rdma;
        struct {
            uint64_t remote_addr;
            uint64_t compare_add;
            uint64_t swap;
            uint32_t rkey;
        } atomic;
        struct {
            void *ah;
            uint32_t remote_qpn;
            uint32_t remote_qkey;
        } ud;
    } wr;
    union {
        struct {
            uint32_t remote_srqn;
        } xrc;
    } qp_type;
    union {
        struct {
            void *mw;
            uint32_t rkey;
            struct {
                struct ibv_mr *mr;
                uint64_t addr;
                uint64_t length;
                unsigned int mw_access_flags;
            } bind_info;
        } bind_mw;
        struct {
            void *hdr;
            uint16_t hdr_sz;
            uint16_t mss;
        } tso;
    };
};

/* What verbs.h's static inlines do: dispatch through the context's ops. */
static inline int ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr,
                                struct ibv_send_wr **bad_wr)
{
    return qp->context->ops.post_send(qp, wr, bad_wr);
}

static inline int ibv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
    return cq->context->ops.poll_cq(cq, num_entries, wc);
}

static inline int ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    return cq->context->ops.req_notify_cq(cq, solicited_only);
}

/* The extended context around ctx, or NULL for a plain one. */
static inline struct verbs_context *wx_verbs_get_ctx(struct ibv_context *ctx)
{
    if (ctx->abi_compat != (void *)UINTPTR_MAX)
        return NULL;
    return (struct verbs_context *)(void *)((uint8_t *)ctx -
                                            offsetof(struct verbs_context, context));
}

/* verbs_get_ctx_op: the extended context when it is new enough to have `op` set. */
#define verbs_get_ctx_op(ctx, op)                                                                  \
    ({                                                                                             \
        struct verbs_context *wx__vctx = wx_verbs_get_ctx(ctx);                                    \
        (!wx__vctx || wx__vctx->sz < sizeof(*wx__vctx) - offsetof(struct verbs_context, op) ||     \
         !wx__vctx->op)                                                                            \
            ? NULL                                                                                 \
            : wx__vctx;                                                                            \
    })

#endif
