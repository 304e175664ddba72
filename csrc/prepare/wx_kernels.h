/* wx_kernels.h - the one NVRTC kernel loader of the native prepare code (the FP8 quantizer,
 * the batched copy).
 *
 * A kernel is a CUDA C source (with the in-memory headers it includes), its NVRTC options and
 * its entry point. At first use on a device the loader compiles it for the device's
 * architecture (one cubin per architecture, kept for the life of the process), loads the
 * module into the device's primary context (retained once per device, shared by every
 * kernel) and looks the function up; the answer, or the failure and its reason, is kept. The
 * kernels' files: wx_fp8.c and wx_copy.c; docs/prepare.md.
 */
#ifndef WX_KERNELS_H
#define WX_KERNELS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "wx_cuda_abi.h"

#define WX_KERNEL_MAX_ARCH 8 /* GPU architectures one process may compile a kernel for */
#define WX_KERNEL_MAX_DEV 64 /* CUDA ordinals */
#define WX_KERNEL_MAX_OPT 8
#define WX_KERNEL_MAX_HDR 3

/* What to compile. Fixed for the life of the process (the first use compiles it). */
typedef struct wx_kernel_src {
    const char *what; /* "the FP8 kernel", in messages */
    const char *file; /* the source's file name for NVRTC */
    const char *src;
    int nhdr; /* in-memory headers the source includes */
    const char *hdr_name[WX_KERNEL_MAX_HDR], *hdr_src[WX_KERNEL_MAX_HDR];
    int nopt; /* NVRTC options beyond --gpu-architecture=sm_XY */
    const char *opt[WX_KERNEL_MAX_OPT];
    const char *fn; /* the extern "C" entry point */
    unsigned smem;  /* dynamic shared memory per CTA; above 48 KiB the function's limit is raised */
    int min_cc;     /* 0, or the lowest compute capability (10 * major + minor) it runs on */
    const char *min_why; /* what needs min_cc, for the refusal */
} wx_kernel_src_t;

/* A kernel's source as setup.py embeds it: the file csrc/prepare/<name>.cu, its text
 * <name>_src (build/gen/<name>_src.h), `what_` in messages. */
#define WX_KERNEL_FILE(what_, name) .what = what_, .file = #name ".cu", .src = name##_src
/* The in-memory header of a kernel that includes wx_dev.cuh only (wx_dev_src.h). */
#define WX_KERNEL_DEV_HDR .nhdr = 1, .hdr_name = {"wx_dev.cuh"}, .hdr_src = {wx_dev_src}

/* A kernel and its launch shape: the product's (wx_fp8.c, wx_copy.c) or, in a build with
 * WXFER_KERNEL_SWEEP=1, a benchmark's variant (wx_sweep.c). */
typedef struct wx_kernel_cfg {
    wx_kernel_src_t src;
    unsigned threads; /* per CTA */
    int ctas_per_sm;  /* a persistent grid of SMs x this many CTAs; 0: one CTA per work item */
    int unroll;       /* the copy kernel's loads in flight per thread (reported, compiled in) */
} wx_kernel_cfg_t;

/* A kernel's state: one static wx_kernel_t per kernel, {.mu = PTHREAD_MUTEX_INITIALIZER}. */
typedef struct wx_kernel {
    pthread_mutex_t mu;
    const wx_kernel_cfg_t *cfg; /* wx_kernel_cfg's answer, once given */
    int nbins;
    struct {
        int cc;
        char *cubin; /* NULL when compiling for cc failed (why says) */
        char why[512];
    } bins[WX_KERNEL_MAX_ARCH];
    struct {
        CUfunction fn;
        int state; /* 0 not tried, 1 ready, -1 failed (why says) */
        char why[512];
    } devs[WX_KERNEL_MAX_DEV];
} wx_kernel_t;
/* A device as a launch needs it. */
typedef struct wx_kernel_dev {
    CUcontext ctx; /* the device's primary context (retained for the life of the process) */
    CUfunction fn; /* NULL from wx_kernel_device */
    int sms;       /* multiprocessors */
    int cc;        /* 10 * major + minor */
} wx_kernel_dev_t;

/* The configuration kernel k runs with for the life of the process, fixed at the first call:
 * `product`, or the variant a WXFER_KERNEL_SWEEP build was given for `name` (wx_sweep.h). */
const wx_kernel_cfg_t *wx_kernel_cfg(wx_kernel_t *k, const char *name,
                                     const wx_kernel_cfg_t *product);

/* The device's primary context, multiprocessors and compute capability (retained at first
 * use; loads libcuda). Returns 0, or a negative errno with the reason in why. */
int wx_kernel_device(int device, wx_kernel_dev_t *out, char *why, size_t why_len);

/* The kernel `src` on `device`, compiled and loaded at first use (dirs: extra directories to
 * look for libnvrtc in, see wx_nvrtc). Returns 0, or a negative errno with the reason in why
 * (the same reason on every later call for that device). */
int wx_kernel_get(wx_kernel_t *k, const wx_kernel_src_t *src, int device, const char *const *dirs,
                  int ndirs, wx_kernel_dev_t *out, char *why, size_t why_len);

/* Make ctx current on this thread; *prev gets the one to give back to wx_kernel_leave. */
void wx_kernel_enter(CUcontext ctx, CUcontext *prev);
void wx_kernel_leave(CUcontext ctx, CUcontext prev);

/* One launch of d->fn (grid x threads, smem bytes of dynamic shared memory) on `stream` with
 * the kernel's parameters `args`, in d's context. Returns 0 or -EIO (wx_last_error names
 * `what`). */
int wx_kernel_launch(const wx_kernel_dev_t *d, const char *what, uint64_t grid, unsigned threads,
                     unsigned smem, uint64_t stream, void **args);

/* Kernel k (src) on `device` (wx_kernel_get, no extra libnvrtc directories), launched once on
 * `stream` over `work` items: a persistent grid of at most ctas_per_sm CTAs per multiprocessor
 * (0: one CTA per item) of `threads` threads, src->smem bytes of dynamic shared memory, the
 * kernel's parameters args. Returns 0, or a negative errno (wx_last_error: "<src->what>
 * unavailable: <why>", or the launch's failure). */
int wx_kernel_run(wx_kernel_t *k, const wx_kernel_src_t *src, int device, uint64_t work,
                  int ctas_per_sm, unsigned threads, uint64_t stream, void **args);

#endif
