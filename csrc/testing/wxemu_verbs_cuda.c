/* wxemu_verbs_cuda.c - EMULATION: GPU memory registered with the emulated HCA, for the
 * wxfer test suite. Never shipped; never a backend.
 *
 * A real NIC reaches GPU memory over PCIe, through the pages of a dma-buf (ibv_reg_dmabuf_mr)
 * or of nvidia-peermem (ibv_reg_mr on a device pointer). The emulated HCA has no PCIe: it
 * reaches the same memory with CUDA copies, through a CUDA IPC handle of the allocation that
 * the registering process puts in its MR slot. libcuda.so.1 ($WXFER_LIBCUDA) is dlopened here,
 * by the emulation itself, the first time GPU memory is registered or written. What this
 * cannot check (IOMMU, PCIe peer-to-peer, the NIC's own limits) is listed in docs/verbs.md. */
#define _GNU_SOURCE
#include "wxemu_verbs.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "wx_cuda_abi.h"

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*PointerGetAttribute)(void *, CUpointer_attribute, CUdeviceptr);
    CUresult (*MemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*MemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*IpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*IpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned);
} emu_cu;
static pthread_once_t emu_cu_once = PTHREAD_ONCE_INIT;
static char emu_cu_why[256];
static int emu_cu_ok;

static void emu_cu_load(void)
{
    const char *path = getenv("WXFER_LIBCUDA");
    void *h = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    const char *miss = NULL;
    if (!h) {
        snprintf(emu_cu_why, sizeof emu_cu_why, "cannot load libcuda.so.1: %s", dlerror());
        return;
    }
#define EMU_CU(f, s)                                                                               \
    do {                                                                                           \
        *(void **)&emu_cu.f = dlsym(h, s);                                                         \
        if (!emu_cu.f && !miss)                                                                    \
            miss = s;                                                                              \
    } while (0)
    EMU_CU(Init, "cuInit");
    EMU_CU(GetErrorName, "cuGetErrorName");
    EMU_CU(DeviceGet, "cuDeviceGet");
    EMU_CU(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    EMU_CU(CtxSetCurrent, "cuCtxSetCurrent");
    EMU_CU(CtxGetCurrent, "cuCtxGetCurrent");
    EMU_CU(PointerGetAttribute, "cuPointerGetAttribute");
    EMU_CU(MemGetAddressRange, "cuMemGetAddressRange_v2");
    EMU_CU(MemcpyAsync, "cuMemcpyAsync");
    EMU_CU(StreamCreate, "cuStreamCreate");
    EMU_CU(StreamSynchronize, "cuStreamSynchronize");
    EMU_CU(IpcGetMemHandle, "cuIpcGetMemHandle");
    EMU_CU(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
#undef EMU_CU
    if (miss) {
        snprintf(emu_cu_why, sizeof emu_cu_why, "libcuda.so.1 lacks %s", miss);
        return;
    }
    if (emu_cu.Init(0) != CUDA_SUCCESS) {
        snprintf(emu_cu_why, sizeof emu_cu_why, "cuInit failed (no GPU?)");
        return;
    }
    emu_cu_ok = 1;
}

static const char *emu_cu_name(CUresult r)
{
    const char *n = "CUDA_ERROR_?";
    if (emu_cu.GetErrorName)
        emu_cu.GetErrorName(r, &n);
    return n;
}

/* The calling thread gets device dev's primary context when it has none current. */
static int emu_cu_ctx(int dev)
{
    CUcontext c = NULL;
    CUdevice d;
    if (emu_cu.CtxGetCurrent(&c) == CUDA_SUCCESS && c)
        return 0;
    if (emu_cu.DeviceGet(&d, dev) != CUDA_SUCCESS ||
        emu_cu.PrimaryCtxRetain(&c, d) != CUDA_SUCCESS || emu_cu.CtxSetCurrent(c) != CUDA_SUCCESS)
        return -1;
    return 0;
}

int emu_cuda_describe(uint64_t va, uint64_t len, emu_mr_slot_t *s, char *why, size_t why_len)
{
    CUdeviceptr base = 0;
    size_t size = 0;
    CUipcMemHandle h;
    int dev = 0;
    CUresult r;
    pthread_once(&emu_cu_once, emu_cu_load);
    if (!emu_cu_ok) {
        snprintf(why, why_len, "%s", emu_cu_why);
        return ENODEV;
    }
    /* A device pointer names its context: no context needs to be current for these two. */
    r = emu_cu.PointerGetAttribute(&dev, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)va);
    if (r != CUDA_SUCCESS) {
        snprintf(why, why_len, "0x%llx is not CUDA memory of this process (%s)",
                 (unsigned long long)va, emu_cu_name(r));
        return EFAULT;
    }
    if (emu_cu_ctx(dev) != 0) {
        snprintf(why, why_len, "no CUDA context for device %d", dev);
        return ENODEV;
    }
    r = emu_cu.MemGetAddressRange(&base, &size, (CUdeviceptr)va);
    if (r != CUDA_SUCCESS || va + len < va || va < base || va + len > base + size) {
        snprintf(why, why_len,
                 "[0x%llx, +%llu) is not inside one CUDA allocation (%s; allocation 0x%llx, "
                 "%zu bytes)",
                 (unsigned long long)va, (unsigned long long)len, emu_cu_name(r),
                 (unsigned long long)base, size);
        return EFAULT;
    }
    r = emu_cu.IpcGetMemHandle(&h, base);
    if (r != CUDA_SUCCESS) {
        snprintf(why, why_len,
                 "cuIpcGetMemHandle(0x%llx) failed: %s (the emulated HCA reaches GPU memory "
                 "through CUDA IPC: memory from cuMemCreate/expandable segments is not "
                 "supported by the emulation)",
                 (unsigned long long)base, emu_cu_name(r));
        return EOPNOTSUPP;
    }
    s->cuda_base = (uint64_t)base;
    s->cuda_dev = dev;
    memcpy(s->ipc, &h, sizeof s->ipc);
    return 0;
}

/* CUDA IPC mappings this process opened, by the owner's pid and the handle (a handle names
 * one allocation; a freed and reallocated one gets another). Kept until the process exits. */
#define EMU_IPC_CACHE 256
static struct {
    int32_t pid;
    uint64_t starttime;
    uint8_t ipc[64];
    CUdeviceptr ptr;
} emu_ipc[EMU_IPC_CACHE];
static int emu_nipc;
static pthread_mutex_t emu_ipc_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult emu_ipc_open(const emu_shm_t *R, const emu_mr_slot_t *m, CUdeviceptr *out)
{
    CUipcMemHandle h;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&emu_ipc_lock);
    for (int i = 0; i < emu_nipc; i++)
        if (emu_ipc[i].pid == R->pid && emu_ipc[i].starttime == R->starttime &&
            memcmp(emu_ipc[i].ipc, m->ipc, sizeof m->ipc) == 0) {
            *out = emu_ipc[i].ptr;
            pthread_mutex_unlock(&emu_ipc_lock);
            return CUDA_SUCCESS;
        }
    memcpy(&h, m->ipc, sizeof h);
    r = emu_cu.IpcOpenMemHandle(out, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (r == CUDA_SUCCESS && emu_nipc < EMU_IPC_CACHE) {
        emu_ipc[emu_nipc].pid = R->pid;
        emu_ipc[emu_nipc].starttime = R->starttime;
        memcpy(emu_ipc[emu_nipc].ipc, m->ipc, sizeof m->ipc);
        emu_ipc[emu_nipc].ptr = *out;
        emu_nipc++;
    }
    pthread_mutex_unlock(&emu_ipc_lock);
    return r;
}

/* One stream per HCA thread (the thread that executes the work requests). */
static __thread CUstream emu_stream;

enum ibv_wc_status emu_cuda_write(const struct iovec *liov, const int *lcuda, int n,
                                  const emu_shm_t *R, const emu_mr_slot_t *m, uint64_t raddr,
                                  uint32_t *ve)
{
    int remote_gpu = m->kind != EMU_MR_HOST, dev = -1;
    CUdeviceptr dst = 0;
    uint64_t off = 0;
    CUresult r;
    pthread_once(&emu_cu_once, emu_cu_load);
    if (!emu_cu_ok) {
        fprintf(stderr, "wxemu_verbs (emulation): a write from or to GPU memory needs CUDA: %s\n",
                emu_cu_why);
        *ve = 0x93;
        return IBV_WC_GENERAL_ERR;
    }
    /* The copies run in the context of the source's GPU (else the target's in a loopback,
     * else device 0; CUDA IPC mappings enable peer access lazily). */
    for (int i = 0; i < n && dev < 0; i++)
        if (lcuda[i] &&
            emu_cu.PointerGetAttribute(&dev, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                       (CUdeviceptr)(uintptr_t)liov[i].iov_base) != CUDA_SUCCESS)
            dev = -1;
    if (dev < 0)
        dev = remote_gpu && R->pid == getpid() ? m->cuda_dev : 0;
    if (emu_cu_ctx(dev) != 0 ||
        (!emu_stream && emu_cu.StreamCreate(&emu_stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)) {
        fprintf(stderr, "wxemu_verbs (emulation): no CUDA context/stream for device %d\n", dev);
        *ve = 0x93;
        return IBV_WC_GENERAL_ERR;
    }
    if (remote_gpu) {
        if (R->pid == getpid()) {
            dst = (CUdeviceptr)raddr; /* loopback: the memory is ours */
        } else {
            r = emu_ipc_open(R, m, &dst);
            if (r != CUDA_SUCCESS) {
                fprintf(stderr,
                        "wxemu_verbs (emulation): cuIpcOpenMemHandle of pid %d's GPU memory: "
                        "%s\n",
                        R->pid, emu_cu_name(r));
                *ve = 0x94;
                return IBV_WC_REM_ACCESS_ERR;
            }
            dst += (CUdeviceptr)(raddr - m->cuda_base);
        }
    }
    for (int i = 0; i < n; i++) {
        size_t len = liov[i].iov_len;
        CUdeviceptr src = (CUdeviceptr)(uintptr_t)liov[i].iov_base;
        if (!len)
            continue;
        if (remote_gpu) {
            r = emu_cu.MemcpyAsync(dst + off, src, len, emu_stream);
        } else {
            /* GPU -> remote host pages: through a bounce buffer, as no CPU can read the GPU
             * piece directly; then the same process_vm_writev as for host memory. */
            char *bounce = malloc(len);
            struct iovec lv = {bounce, len}, rv = {(void *)(uintptr_t)(raddr + off), len};
            ssize_t wrote;
            if (!bounce) {
                *ve = 0x93;
                return IBV_WC_GENERAL_ERR;
            }
            r = emu_cu.MemcpyAsync((CUdeviceptr)(uintptr_t)bounce, src, len, emu_stream);
            if (r == CUDA_SUCCESS)
                r = emu_cu.StreamSynchronize(emu_stream);
            wrote = r == CUDA_SUCCESS ? process_vm_writev(R->pid, &lv, 1, &rv, 1, 0) : -1;
            free(bounce);
            if (r == CUDA_SUCCESS && wrote != (ssize_t)len) {
                *ve = 0x91;
                return IBV_WC_REM_ACCESS_ERR;
            }
        }
        if (r != CUDA_SUCCESS) {
            fprintf(stderr, "wxemu_verbs (emulation): CUDA copy of %zu bytes failed: %s\n", len,
                    emu_cu_name(r));
            *ve = 0x95;
            return IBV_WC_LOC_PROT_ERR;
        }
        off += len;
    }
    /* The completion is reported only after the bytes are in place. */
    r = emu_cu.StreamSynchronize(emu_stream);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "wxemu_verbs (emulation): CUDA copy failed: %s\n", emu_cu_name(r));
        *ve = 0x95;
        return IBV_WC_GENERAL_ERR;
    }
    return IBV_WC_SUCCESS;
}
