/* wx_fi_abi.h - the part of libfabric's ABI the fabric backend uses, declared here so that
 * the extension builds without libfabric-dev (rdma/fabric.h and friends).
 *
 * Written from libfabric's public ABI (libfabric.so.1; fi_getinfo, fi_freeinfo and
 * fi_dupinfo at symbol version FABRIC_1.3, fi_fabric at FABRIC_1.1, which the loader asks
 * for by version, so a newer library hands back these layouts) and checked against the
 * headers of libfabric 1.17.0 (Debian 12's libfabric-dev) by `make abi-check`
 * (csrc/abi/abi_check.py, the list in csrc/abi/wx_abi_list.h). The names are the library's
 * own; a translation unit includes this header or rdma/fabric.h, never both.
 *
 * Everything past fi_getinfo/fi_fabric is reached through the ops tables in the objects
 * the library returns (struct fid_* and struct fi_ops_*): the static inline wrappers of
 * rdma/fi_*.h that the backend calls are reproduced at the end, and each ops table is
 * declared up to its last entry used here (tables only grow at the end; each starts with
 * its size).
 */
#ifndef WX_FI_ABI_H
#define WX_FI_ABI_H

#if defined(FABRIC_H) || defined(_FABRIC_H_)
#error "wx_fi_abi.h and rdma/fabric.h declare the same names: include one"
#endif

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

/* the API version requested from fi_getinfo (at most the library's own) and the release
 * the layouts below were checked against */
#define FI_MAJOR_VERSION 1
#define FI_MINOR_VERSION 17
#define WX_FI_ABI_CHECKED "libfabric 1.17.0 (libfabric.so.1, FABRIC_1.3 fi_info)"
#define WX_FI_SYMVER_INFO "FABRIC_1.3" /* fi_getinfo, fi_freeinfo, fi_dupinfo */
#define WX_FI_SYMVER_FABRIC "FABRIC_1.1"

#define FI_VERSION(major, minor) (((major) << 16) | (minor))
#define FI_MAJOR(version) ((version) >> 16)
#define FI_MINOR(version) ((version)&0xFFFF)

/* capabilities and operation flags (fi_info.caps, tx_attr.op_flags, access) */
#define FI_RMA (1ULL << 2)
#define FI_WRITE (1ULL << 9)
#define FI_RECV (1ULL << 10)
#define FI_SEND (1ULL << 11)
#define FI_TRANSMIT FI_SEND
#define FI_REMOTE_WRITE (1ULL << 13)
#define FI_COMPLETION (1ULL << 24)
#define FI_DELIVERY_COMPLETE (1ULL << 28)
#define FI_HMEM (1ULL << 47)
#define FI_RMA_EVENT (1ULL << 56)
/* mode bits */
#define FI_CONTEXT (1ULL << 59)
#define FI_CONTEXT2 (1ULL << 52)

#define FI_KEY_NOTAVAIL ((uint64_t)-1)
#define FI_ADDR_NOTAVAIL ((uint64_t)-1)

/* domain_attr.mr_mode bits */
#define FI_MR_LOCAL (1 << 2)
#define FI_MR_VIRT_ADDR (1 << 4)
#define FI_MR_ALLOCATED (1 << 5)
#define FI_MR_PROV_KEY (1 << 6)
#define FI_MR_ENDPOINT (1 << 9)
#define FI_MR_HMEM (1 << 10)

/* errors: the POSIX ones are errno values, the rest start at FI_ERRNO_OFFSET */
#define FI_EIO EIO
#define FI_EAGAIN EAGAIN
#define FI_EINVAL EINVAL
#define FI_ENODATA ENODATA
#define FI_ERRNO_OFFSET 256
#define FI_ETOOSMALL 257
#define FI_EOPBADSTATE 258
#define FI_EAVAIL 259
#define FI_EBADFLAGS 260
#define FI_ETRUNC 265
#define FI_ENOKEY 266

typedef uint64_t fi_addr_t;

enum fi_av_type { FI_AV_UNSPEC = 0, FI_AV_MAP = 1, FI_AV_TABLE = 2 };
enum fi_progress { FI_PROGRESS_UNSPEC = 0, FI_PROGRESS_AUTO = 1, FI_PROGRESS_MANUAL = 2 };
enum fi_threading {
    FI_THREAD_UNSPEC = 0,
    FI_THREAD_SAFE = 1,
    FI_THREAD_FID = 2,
    FI_THREAD_DOMAIN = 3,
    FI_THREAD_COMPLETION = 4,
    FI_THREAD_ENDPOINT = 5,
};
enum fi_resource_mgmt { FI_RM_UNSPEC = 0, FI_RM_DISABLED = 1, FI_RM_ENABLED = 2 };
enum fi_ep_type { FI_EP_UNSPEC = 0, FI_EP_MSG = 1, FI_EP_DGRAM = 2, FI_EP_RDM = 3 };
enum fi_type { FI_TYPE_INFO = 0 };
enum fi_hmem_iface { FI_HMEM_SYSTEM = 0, FI_HMEM_CUDA = 1 };
enum fi_wait_obj { FI_WAIT_NONE = 0, FI_WAIT_UNSPEC = 1, FI_WAIT_SET = 2, FI_WAIT_FD = 3 };
enum fi_cq_format { FI_CQ_FORMAT_UNSPEC = 0, FI_CQ_FORMAT_CONTEXT = 1 };
enum fi_cq_wait_cond { FI_CQ_COND_NONE = 0, FI_CQ_COND_THRESHOLD = 1 };
enum fi_cntr_events { FI_CNTR_EVENTS_COMP = 0 };
/* enum fi_addr_format's socket address formats (fi_info.addr_format) */
enum { FI_SOCKADDR = 1, FI_SOCKADDR_IN = 2, FI_SOCKADDR_IN6 = 3, FI_SOCKADDR_IB = 4 };
/* fi_control commands: FI_ENABLE is the seventh */
enum { FI_ENABLE = 6 };

struct fid;
struct fid_fabric;
struct fid_domain;
struct fid_av;
struct fid_cq;
struct fid_cntr;
struct fid_ep;
struct fid_mr;
struct fid_wait;
typedef struct fid *fid_t;

struct fi_tx_attr {
    uint64_t caps;
    uint64_t mode;
    uint64_t op_flags;
    uint64_t msg_order;
    uint64_t comp_order;
    size_t inject_size;
    size_t size;
    size_t iov_limit;
    size_t rma_iov_limit;
    uint32_t tclass;
};

struct fi_rx_attr {
    uint64_t caps;
    uint64_t mode;
    uint64_t op_flags;
    uint64_t msg_order;
    uint64_t comp_order;
    size_t total_buffered_recv;
    size_t size;
    size_t iov_limit;
};

struct fi_ep_attr {
    enum fi_ep_type type;
    uint32_t protocol;
    uint32_t protocol_version;
    size_t max_msg_size;
    size_t msg_prefix_size;
    size_t max_order_raw_size;
    size_t max_order_war_size;
    size_t max_order_waw_size;
    uint64_t mem_tag_format;
    size_t tx_ctx_cnt;
    size_t rx_ctx_cnt;
    size_t auth_key_size;
    uint8_t *auth_key;
};

struct fi_domain_attr {
    struct fid_domain *domain;
    char *name;
    enum fi_threading threading;
    enum fi_progress control_progress;
    enum fi_progress data_progress;
    enum fi_resource_mgmt resource_mgmt;
    enum fi_av_type av_type;
    int mr_mode;
    size_t mr_key_size;
    size_t cq_data_size;
    size_t cq_cnt;
    size_t ep_cnt;
    size_t tx_ctx_cnt;
    size_t rx_ctx_cnt;
    size_t max_ep_tx_ctx;
    size_t max_ep_rx_ctx;
    size_t max_ep_stx_ctx;
    size_t max_ep_srx_ctx;
    size_t cntr_cnt;
    size_t mr_iov_limit;
    uint64_t caps;
    uint64_t mode;
    uint8_t *auth_key;
    size_t auth_key_size;
    size_t max_err_data;
    size_t mr_cnt;
    uint32_t tclass;
};

struct fi_fabric_attr {
    struct fid_fabric *fabric;
    char *name;
    char *prov_name;
    uint32_t prov_version;
    uint32_t api_version;
};

struct fi_info {
    struct fi_info *next;
    uint64_t caps;
    uint64_t mode;
    uint32_t addr_format;
    size_t src_addrlen;
    size_t dest_addrlen;
    void *src_addr;
    void *dest_addr;
    fid_t handle;
    struct fi_tx_attr *tx_attr;
    struct fi_rx_attr *rx_attr;
    struct fi_ep_attr *ep_attr;
    struct fi_domain_attr *domain_attr;
    struct fi_fabric_attr *fabric_attr;
    void *nic; /* struct fid_nic * */
};

/* Every object starts with this. */
struct fi_ops {
    size_t size;
    int (*close)(struct fid *fid);
    int (*bind)(struct fid *fid, struct fid *bfid, uint64_t flags);
    int (*control)(struct fid *fid, int command, void *arg);
};

struct fid {
    size_t fclass;
    void *context;
    struct fi_ops *ops;
};

struct fi_context2 {
    void *internal[8];
};

struct fi_ops_fabric {
    size_t size;
    int (*domain)(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **dom,
                  void *context);
};

struct fid_fabric {
    struct fid fid;
    struct fi_ops_fabric *ops;
    uint32_t api_version;
};

struct fi_av_attr {
    enum fi_av_type type;
    int rx_ctx_bits;
    size_t count;
    size_t ep_per_node;
    const char *name;
    void *map_addr;
    uint64_t flags;
};

struct fi_ops_av {
    size_t size;
    int (*insert)(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
                  uint64_t flags, void *context);
    void *insertsvc;
    void *insertsym;
    int (*remove)(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);
    void *lookup;
    const char *(*straddr)(struct fid_av *av, const void *addr, char *buf, size_t *len);
};

struct fid_av {
    struct fid fid;
    struct fi_ops_av *ops;
};

struct fid_mr {
    struct fid fid;
    void *mem_desc;
    uint64_t key;
};

struct fi_mr_attr {
    const struct iovec *mr_iov;
    size_t iov_count;
    uint64_t access;
    uint64_t offset;
    uint64_t requested_key;
    void *context;
    size_t auth_key_size;
    uint8_t *auth_key;
    enum fi_hmem_iface iface;
    union {
        uint64_t reserved;
        int cuda;
        int ze;
        int neuron;
        int synapseai;
    } device;
};

struct fi_cq_attr {
    size_t size;
    uint64_t flags;
    enum fi_cq_format format;
    enum fi_wait_obj wait_obj;
    int signaling_vector;
    enum fi_cq_wait_cond wait_cond;
    struct fid_wait *wait_set;
};

struct fi_cq_entry {
    void *op_context;
};

struct fi_cq_err_entry {
    void *op_context;
    uint64_t flags;
    size_t len;
    void *buf;
    uint64_t data;
    uint64_t tag;
    size_t olen;
    int err;
    int prov_errno;
    void *err_data; /* valid until the CQ is read again */
    size_t err_data_size;
};

struct fi_ops_cq {
    size_t size;
    ssize_t (*read)(struct fid_cq *cq, void *buf, size_t count);
    void *readfrom;
    ssize_t (*readerr)(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
    ssize_t (*sread)(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout);
    void *sreadfrom;
    void *signal;
    const char *(*strerror)(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf,
                            size_t len);
};

struct fid_cq {
    struct fid fid;
    struct fi_ops_cq *ops;
};

struct fi_cntr_attr {
    enum fi_cntr_events events;
    enum fi_wait_obj wait_obj;
    struct fid_wait *wait_set;
    uint64_t flags;
};

struct fi_ops_cntr {
    size_t size;
    uint64_t (*read)(struct fid_cntr *cntr);
};

struct fid_cntr {
    struct fid fid;
    struct fi_ops_cntr *ops;
};

struct fi_ops_domain {
    size_t size;
    int (*av_open)(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
                   void *context);
    int (*cq_open)(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
                   void *context);
    int (*endpoint)(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
                    void *context);
    void *scalable_ep;
    int (*cntr_open)(struct fid_domain *domain, struct fi_cntr_attr *attr, struct fid_cntr **cntr,
                     void *context);
};

struct fi_ops_mr {
    size_t size;
    void *reg;
    void *regv;
    int (*regattr)(struct fid *fid, const struct fi_mr_attr *attr, uint64_t flags,
                   struct fid_mr **mr);
};

struct fid_domain {
    struct fid fid;
    struct fi_ops_domain *ops;
    struct fi_ops_mr *mr;
};

struct fi_rma_iov {
    uint64_t addr;
    size_t len;
    uint64_t key;
};

struct fi_msg_rma {
    const struct iovec *msg_iov;
    void **desc;
    size_t iov_count;
    fi_addr_t addr;
    const struct fi_rma_iov *rma_iov;
    size_t rma_iov_count;
    void *context;
    uint64_t data;
};

struct fi_ops_ep {
    size_t size;
    ssize_t (*cancel)(fid_t fid, void *context);
};

struct fi_ops_cm {
    size_t size;
    void *setname;
    int (*getname)(fid_t fid, void *addr, size_t *addrlen);
};

struct fi_ops_rma {
    size_t size;
    void *read;
    void *readv;
    void *readmsg;
    void *write;
    void *writev;
    ssize_t (*writemsg)(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
};

struct fid_ep {
    struct fid fid;
    struct fi_ops_ep *ops;
    struct fi_ops_cm *cm;
    void *msg;
    struct fi_ops_rma *rma;
    void *tagged;
    void *atomic;
    void *collective;
};

/* What rdma/fi_*.h's static inlines do: dispatch through the object's ops. */
static inline int fi_close(struct fid *fid) { return fid->ops->close(fid); }

/* The constructors: int fn(struct parent *p, attr, struct child **out, void *context), which is
 * p->ops->op(p, attr, out, context). */
#define WX__FI_OPEN(fn, parent, op, attr_t, child)                                                 \
    static inline int fn(struct parent *p, attr_t attr, struct child **out, void *context)         \
    {                                                                                              \
        return p->ops->op(p, attr, out, context);                                                  \
    }
WX__FI_OPEN(fi_domain, fid_fabric, domain, struct fi_info *, fid_domain)
WX__FI_OPEN(fi_av_open, fid_domain, av_open, struct fi_av_attr *, fid_av)
WX__FI_OPEN(fi_cq_open, fid_domain, cq_open, struct fi_cq_attr *, fid_cq)
WX__FI_OPEN(fi_cntr_open, fid_domain, cntr_open, struct fi_cntr_attr *, fid_cntr)
WX__FI_OPEN(fi_endpoint, fid_domain, endpoint, struct fi_info *, fid_ep)
#undef WX__FI_OPEN

static inline int fi_mr_regattr(struct fid_domain *domain, const struct fi_mr_attr *attr,
                                uint64_t flags, struct fid_mr **mr)
{
    return domain->mr->regattr(&domain->fid, attr, flags, mr);
}

static inline void *fi_mr_desc(struct fid_mr *mr) { return mr->mem_desc; }

static inline uint64_t fi_mr_key(struct fid_mr *mr) { return mr->key; }

static inline int fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags)
{
    return mr->fid.ops->bind(&mr->fid, bfid, flags);
}

static inline int fi_mr_enable(struct fid_mr *mr)
{
    return mr->fid.ops->control(&mr->fid, FI_ENABLE, NULL);
}

static inline int fi_av_insert(struct fid_av *av, const void *addr, size_t count,
                               fi_addr_t *fi_addr, uint64_t flags, void *context)
{
    return av->ops->insert(av, addr, count, fi_addr, flags, context);
}

static inline int fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags)
{
    return av->ops->remove(av, fi_addr, count, flags);
}

static inline const char *fi_av_straddr(struct fid_av *av, const void *addr, char *buf, size_t *len)
{
    return av->ops->straddr(av, addr, buf, len);
}

static inline ssize_t fi_cq_read(struct fid_cq *cq, void *buf, size_t count)
{
    return cq->ops->read(cq, buf, count);
}

static inline ssize_t fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags)
{
    return cq->ops->readerr(cq, buf, flags);
}

static inline ssize_t fi_cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond,
                                  int timeout)
{
    return cq->ops->sread(cq, buf, count, cond, timeout);
}

static inline const char *fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data,
                                         char *buf, size_t len)
{
    return cq->ops->strerror(cq, prov_errno, err_data, buf, len);
}

static inline uint64_t fi_cntr_read(struct fid_cntr *cntr) { return cntr->ops->read(cntr); }

static inline int fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags)
{
    return ep->fid.ops->bind(&ep->fid, bfid, flags);
}

static inline int fi_enable(struct fid_ep *ep)
{
    return ep->fid.ops->control(&ep->fid, FI_ENABLE, NULL);
}

/* fid is the endpoint's own (first member of struct fid_ep) */
static inline ssize_t fi_cancel(fid_t fid, void *context)
{
    struct fid_ep *ep = (struct fid_ep *)(void *)fid;
    return ep->ops->cancel(fid, context);
}

static inline int fi_getname(fid_t fid, void *addr, size_t *addrlen)
{
    struct fid_ep *ep = (struct fid_ep *)(void *)fid;
    return ep->cm->getname(fid, addr, addrlen);
}

static inline ssize_t fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)
{
    return ep->rma->writemsg(ep, msg, flags);
}

#endif
