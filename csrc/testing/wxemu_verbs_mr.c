/* wxemu_verbs_mr.c - EMULATION of libibverbs memory regions for the wxfer test suite: host
 * memory (ibv_reg_mr / ibv_reg_mr_iova2, RLIMIT_MEMLOCK accounting on request), GPU memory
 * through nvidia-peermem (ibv_reg_mr on a device pointer, WXEMU_VERBS_PEERMEM=1) or a dma-buf
 * (ibv_reg_dmabuf_mr), and ibv_dereg_mr. GPU memory is described and reached through
 * wxemu_verbs_cuda.c. See wxemu_verbs.h and docs/verbs.md. Never shipped; never a backend. */
#define _GNU_SOURCE
#include "wxemu_verbs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>

/* verbs.h turns ibv_reg_mr into a macro; this file defines the real symbol. */
#undef ibv_reg_mr

#define EMU_ACCESS_KNOWN                                                                           \
    (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |                   \
     IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND | IBV_ACCESS_RELAXED_ORDERING)

static int emu_mapped(void *addr, size_t len)
{
    char b;
    struct iovec l = {&b, 1}, r1 = {addr, 1}, r2 = {(char *)addr + len - 1, 1};
    if (process_vm_readv(getpid(), &l, 1, &r1, 1, 0) != 1)
        return 0;
    if (process_vm_readv(getpid(), &l, 1, &r2, 1, 0) != 1)
        return 0;
    return 1;
}

/* The kernel's rule for pinned host pages (ib_umem_get): the process's pinned total may not
 * pass RLIMIT_MEMLOCK unless it has CAP_IPC_LOCK. With WXEMU_VERBS_MEMLOCK set the emulation
 * counts what its host MRs pin (off by default, so that the suite runs under any ulimit -l);
 * dma-buf MRs pin no user pages and are not counted (ib_umem_dmabuf_get), nor, here, peermem
 * ones (the peer-memory client pins GPU pages, not the process's). */
static uint64_t emu_pinned; /* bytes, under emu_glock */

static int emu_has_ipc_lock(void)
{
    char line[256];
    unsigned long long eff = 0;
    FILE *f;
    if (emu_cfg.memlock == 2)
        return 0;
    f = fopen("/proc/self/status", "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "CapEff: %llx", &eff) == 1)
            break;
    fclose(f);
    return (eff >> 14) & 1; /* CAP_IPC_LOCK */
}

static int emu_pin(uint64_t addr, uint64_t len, uint64_t *pinned)
{
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t bytes = ((addr + len + pg - 1) & ~(pg - 1)) - (addr & ~(pg - 1));
    struct rlimit rl;
    int rc = 0;
    pthread_mutex_lock(&emu_glock);
    if (emu_cfg.memlock && getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        emu_pinned + bytes > (uint64_t)rl.rlim_cur && !emu_has_ipc_lock())
        rc = ENOMEM;
    else
        emu_pinned += bytes;
    pthread_mutex_unlock(&emu_glock);
    *pinned = rc ? 0 : bytes;
    return rc;
}

static void emu_unpin(uint64_t bytes)
{
    pthread_mutex_lock(&emu_glock);
    emu_pinned -= bytes;
    pthread_mutex_unlock(&emu_glock);
}

static int emu_access_ok(unsigned access)
{
    return !(access & ~(unsigned)EMU_ACCESS_KNOWN) &&
           !((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
             !(access & IBV_ACCESS_LOCAL_WRITE));
}

/* A new MR in a free slot of ec's table, from *proto (everything but the key). */
static struct ibv_mr *emu_mr_new(emu_pd_t *p, const emu_mr_slot_t *proto, int fd, uint64_t pinned)
{
    emu_ctx_t *ec = (emu_ctx_t *)p->pd.context;
    struct ibv_mr *mr = calloc(1, sizeof *mr);
    int slot = -1;
    if (!mr) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&ec->lock);
    for (int i = 0; i < EMU_MAX_MR; i++)
        if (ec->shm->mr[i].key == 0) {
            slot = i;
            break;
        }
    if (slot < 0) {
        pthread_mutex_unlock(&ec->lock);
        free(mr);
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&emu_glock);
    emu_keygen = (emu_keygen + 0x35) & 0xff;
    if (emu_keygen == 0)
        emu_keygen = 0x11;
    emu_stat_reg++;
    mr->lkey = ((uint32_t)(slot + 1) << 8) | emu_keygen;
    pthread_mutex_unlock(&emu_glock);
    mr->rkey = mr->lkey;
    mr->context = p->pd.context;
    mr->pd = &p->pd;
    mr->addr = (void *)(uintptr_t)proto->addr;
    mr->length = proto->len;
    mr->handle = (uint32_t)slot;
    ec->shm->mr[slot] = *proto;
    ec->shm->mr[slot].key = 0;
    ec->shm->mr[slot].pd = p->id;
    ec->mr_fd[slot] = fd;
    ec->mr_pinned[slot] = pinned;
    __atomic_store_n(&ec->shm->mr[slot].key, mr->lkey, __ATOMIC_RELEASE);
    p->nobj++;
    ec->nres++;
    pthread_mutex_unlock(&ec->lock);
    return mr;
}

struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova,
                                unsigned int access)
{
    emu_mr_slot_t proto;
    uint64_t pinned = 0;
    struct ibv_mr *mr;
    char why[400];
    int rc;
    if (!pd) {
        errno = EINVAL;
        return NULL;
    }
    access &= ~(unsigned)IBV_ACCESS_OPTIONAL_RANGE | IBV_ACCESS_RELAXED_ORDERING;
    if (len == 0 || !emu_access_ok(access)) {
        errno = EINVAL;
        return NULL;
    }
    if (iova != (uint64_t)(uintptr_t)addr) {
        errno = EOPNOTSUPP; /* the emulation addresses MRs by virtual address only */
        return NULL;
    }
    memset(&proto, 0, sizeof proto);
    proto.access = access;
    proto.addr = (uint64_t)(uintptr_t)addr;
    proto.len = len;
    proto.cuda_dev = -1;
    if (emu_cfg.peermem && emu_cuda_describe(proto.addr, len, &proto, why, sizeof why) == 0) {
        proto.kind = EMU_MR_PEERMEM; /* a device pointer, pinned by "nvidia-peermem" */
    } else if (emu_mapped(addr, len)) {
        proto.kind = EMU_MR_HOST;
        proto.cuda_dev = -1;
        if ((rc = emu_pin(proto.addr, len, &pinned))) {
            errno = rc; /* what ib_umem_get says past RLIMIT_MEMLOCK */
            return NULL;
        }
    } else {
        errno = EFAULT; /* what ibv_reg_mr says for memory it cannot pin */
        return NULL;
    }
    mr = emu_mr_new((emu_pd_t *)pd, &proto, -1, pinned);
    if (!mr && pinned)
        emu_unpin(pinned);
    return mr;
}

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
    return ibv_reg_mr_iova2(pd, addr, len, (uint64_t)(uintptr_t)addr, (unsigned)access);
}

/* Is fd a dma-buf? Its /proc link reads "/dmabuf:<name>" (Linux >= 5.3, dma-buf's own
 * pseudo file system) or "anon_inode:dmabuf" (older kernels). */
static int emu_is_dmabuf(int fd)
{
    char path[64], link[256];
    ssize_t n;
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    n = readlink(path, link, sizeof link - 1);
    if (n < 0)
        return 0;
    link[n] = '\0';
    return strncmp(link, "/dmabuf:", 8) == 0 || strncmp(link, "anon_inode:dmabuf", 17) == 0;
}

/* What the kernel checks (ib_uverbs reg_dmabuf_mr, ib_umem_dmabuf_get): the access flags,
 * the same offset within a page for offset and iova, a real dma-buf fd, offset + length
 * inside the dma-buf. Then the emulation's own requirement: iova is the virtual address of
 * the registered range in this process, GPU memory of one CUDA allocation (the emulated HCA
 * reaches it through CUDA IPC; a real NIC through the dma-buf's pages). */
struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t off, size_t len, uint64_t iova, int fd,
                                 int access)
{
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    emu_mr_slot_t proto;
    struct ibv_mr *mr;
    unsigned acc = (unsigned)access;
    char why[400];
    off_t size;
    int rc, dfd;
    emu_init_once();
    if (!pd) {
        errno = EINVAL;
        return NULL;
    }
    if (!emu_cfg.dmabuf) {
        errno = EOPNOTSUPP; /* WXEMU_VERBS_DMABUF=0: a device/kernel without dma-buf MRs */
        return NULL;
    }
    acc &= ~(unsigned)IBV_ACCESS_OPTIONAL_RANGE | IBV_ACCESS_RELAXED_ORDERING;
    if (len == 0 || !emu_access_ok(acc) || off + len < off ||
        (off & (pg - 1)) != (iova & (pg - 1))) {
        errno = EINVAL;
        return NULL;
    }
    if (fd < 0 || fcntl(fd, F_GETFD) < 0) {
        errno = EBADF;
        return NULL;
    }
    if (!emu_is_dmabuf(fd)) {
        errno = EINVAL; /* dma_buf_get() on a file that is not a dma-buf */
        return NULL;
    }
    size = lseek(fd, 0, SEEK_END); /* a dma-buf's size */
    lseek(fd, 0, SEEK_SET);
    if (size < 0 || off + len > (uint64_t)size) {
        errno = EINVAL;
        return NULL;
    }
    memset(&proto, 0, sizeof proto);
    proto.kind = EMU_MR_DMABUF;
    proto.access = acc;
    proto.addr = iova;
    proto.len = len;
    rc = emu_cuda_describe(iova - off, (uint64_t)size, &proto, why, sizeof why);
    if (rc) {
        fprintf(stderr,
                "wxemu_verbs (emulation): ibv_reg_dmabuf_mr(offset %llu, %zu bytes, iova "
                "0x%llx): the emulation needs iova - offset to be the address the dma-buf "
                "was exported from: %s\n",
                (unsigned long long)off, len, (unsigned long long)iova, why);
        errno = rc;
        return NULL;
    }
    /* The MR holds its own reference to the dma-buf: the caller may close fd. */
    dfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dfd < 0)
        return NULL;
    mr = emu_mr_new((emu_pd_t *)pd, &proto, dfd, 0);
    if (!mr)
        close(dfd);
    return mr;
}

int ibv_dereg_mr(struct ibv_mr *mr)
{
    emu_ctx_t *ec = (emu_ctx_t *)mr->context;
    emu_pd_t *p = (emu_pd_t *)mr->pd;
    emu_mr_slot_t *s = &ec->shm->mr[mr->handle];
    uint64_t pinned;
    int fd;
    pthread_mutex_lock(&ec->lock);
    if (s->key != mr->lkey) {
        pthread_mutex_unlock(&ec->lock);
        return EINVAL;
    }
    __atomic_store_n(&s->key, 0, __ATOMIC_RELEASE);
    fd = ec->mr_fd[mr->handle];
    pinned = ec->mr_pinned[mr->handle];
    ec->mr_fd[mr->handle] = -1;
    ec->mr_pinned[mr->handle] = 0;
    p->nobj--;
    ec->nres--;
    pthread_mutex_unlock(&ec->lock);
    if (fd >= 0)
        close(fd);
    if (pinned)
        emu_unpin(pinned);
    pthread_mutex_lock(&emu_glock);
    emu_stat_dereg++;
    pthread_mutex_unlock(&emu_glock);
    free(mr);
    return 0;
}
