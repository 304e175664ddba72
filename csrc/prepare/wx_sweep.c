/* wx_sweep.c - the benchmark builds' kernel variants (see wx_sweep.h); empty otherwise. */
#include "wx_sweep.h"

#ifdef WX_KERNEL_SWEEP
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "sweep_fp8_kernel_src.h" /* benchmarks/kernels/sweep_fp8_kernel.cu, by setup.py */
#include "sweep_fp8_pipe_src.h"
#include "wx_copy_kernel_src.h"
#include "wx_delta_kernel_src.h" /* the fused delta kernel: its variants are its own switches */
#include "wx_dev_src.h"          /* wx_dev.cuh, which the copy and the delta kernels include */
#include "wx_fp8_kernel_src.h"   /* the product kernel, whose tile code the sweep's includes */
#include "wx_fp8_pipe_src.h"

static pthread_mutex_t wx__mu = PTHREAD_MUTEX_INITIALIZER;
static wx_kernel_cfg_t wx__fp8, wx__copy, wx__delta;
static int wx__fp8_set, wx__copy_set, wx__fp8_used, wx__copy_used, wx__delta_set, wx__delta_used;
static char wx__opt[9][48];

/* c cleared, then its source: the kernel's text, file name, entry point, name in messages. */
static wx_kernel_src_t *wx__src(wx_kernel_cfg_t *c, const char *what, const char *file,
                                const char *src, const char *fn)
{
    memset(c, 0, sizeof *c);
    c->src.what = what;
    c->src.file = file;
    c->src.src = src;
    c->src.fn = fn;
    return &c->src;
}

/* One more in-memory header of s: the name the kernel includes, its text. */
static void wx__hdr(wx_kernel_src_t *s, const char *name, const char *src)
{
    s->hdr_name[s->nhdr] = name;
    s->hdr_src[s->nhdr++] = src;
}

/* The FP8 variant's shape, as the sweep's kernel expects it (its WX_* macros). */
static void wx__fp8_cfg(int v, int minb)
{
    int persistent = (v >= 2 && v <= 4) || v >= 6;
    int c = minb > 0 ? minb : v == 4 ? 1 : 2;
    int stages = c == 1 ? 6 : c == 2 ? 3 : 2, n = 0;
    wx_kernel_src_t *s = wx__src(&wx__fp8, "the FP8 sweep kernel", "sweep_fp8_kernel.cu",
                                 sweep_fp8_kernel_src, "wx_fp8_quant");
    wx__hdr(s, "sweep_fp8_pipe.cu", sweep_fp8_pipe_src);
    wx__hdr(s, "wx_fp8_kernel.cu", wx_fp8_kernel_src);
    wx__hdr(s, "wx_fp8_pipe.cu", wx_fp8_pipe_src); /* the loop sweep_fp8_pipe.cu includes */
    s->opt[n++] = "--fmad=false";
    snprintf(wx__opt[0], sizeof wx__opt[0], "-DWX_VARIANT=%d", v);
    s->opt[n++] = wx__opt[0];
    if (minb > 0) {
        snprintf(wx__opt[1], sizeof wx__opt[1], "-DWX_MINB=%d", minb);
        s->opt[n++] = wx__opt[1];
    }
    if (v >= 6) {
        snprintf(wx__opt[2], sizeof wx__opt[2], "-DWX_STAGES=%d", stages);
        s->opt[n++] = wx__opt[2];
        s->smem = (unsigned)stages * 128u * 128u * 2u;
    }
    s->nopt = n;
    s->min_cc = 89;
    s->min_why = "the kernel's FP8 conversion (cvt.rn.satfinite.e4m3x2)";
    wx__fp8.threads = v == 5 ? 128 : 256;
    wx__fp8.ctas_per_sm = persistent ? c : 0;
}

static void wx__copy_cfg(int unroll, int ctas)
{
    wx_kernel_src_t *s = wx__src(&wx__copy, "the copy sweep kernel", "wx_copy_kernel.cu",
                                 wx_copy_kernel_src, "wx_copy_ranges");
    wx__hdr(s, "wx_dev.cuh", wx_dev_src);
    snprintf(wx__opt[3], sizeof wx__opt[3], "-DWX_UNROLL=%d", unroll);
    s->opt[0] = wx__opt[3];
    s->nopt = 1;
    wx__copy.threads = 256;
    wx__copy.ctas_per_sm = ctas;
    wx__copy.unroll = unroll;
}

/* The fused delta kernel (csrc/prepare/wx_delta_kernel.cu) with WX_DPF = v % 4, WX_DPAIR =
 * v / 4 % 2, WX_DBITS = v / 8 (v < 24) or WX_DPF = 4, WX_DPAIR = (v - 24) % 2, WX_DBITS =
 * (v - 24) / 2 (v 24-29) at c CTAs per SM (0: the product's 2), its ring as deep as the shared
 * memory allows (tile buffers of 32 KiB, plus 16 KiB each for the shadow ring of WX_DPF 2; 3
 * buffers and one 16 KiB shadow buffer for WX_DPF 4, whose wait counts on 3). */
static void wx__delta_cfg(int v, int c)
{
    const int dpf = v >= 24 ? 4 : v % 4, pair = v >= 24 ? (v - 24) % 2 : v / 4 % 2;
    const int dbits = v >= 24 ? (v - 24) / 2 : v / 8;
    int stages, n = 0;
    wx_kernel_src_t *s = wx__src(&wx__delta, "the fused delta sweep kernel", "wx_delta_kernel.cu",
                                 wx_delta_kernel_src, "wx_delta_quant");
    if (c == 0)
        c = 2;
    stages = dpf == 2 ? (c == 1 ? 4 : 2) : dpf == 4 ? 3 : (c == 1 ? 6 : c == 2 ? 3 : 2);
    wx__hdr(s, "wx_fp8_kernel.cu", wx_fp8_kernel_src); /* as wx_delta.c's */
    wx__hdr(s, "wx_fp8_pipe.cu", wx_fp8_pipe_src);
    wx__hdr(s, "wx_dev.cuh", wx_dev_src);
    s->opt[n++] = "--fmad=false";
    snprintf(wx__opt[4], sizeof wx__opt[4], "-DWX_STAGES=%d", stages);
    snprintf(wx__opt[5], sizeof wx__opt[5], "-DWX_MINB=%d", c);
    snprintf(wx__opt[6], sizeof wx__opt[6], "-DWX_DPF=%d", dpf);
    snprintf(wx__opt[7], sizeof wx__opt[7], "-DWX_DPAIR=%d", pair);
    snprintf(wx__opt[8], sizeof wx__opt[8], "-DWX_DBITS=%d", dbits);
    for (int i = 4; i < 9; i++)
        s->opt[n++] = wx__opt[i];
    s->nopt = n;
    s->smem = (unsigned)stages * 128u * 128u * (dpf == 2 ? 3u : 2u) + (dpf == 4 ? 128u * 128u : 0u);
    s->min_cc = 89;
    s->min_why = "the kernel's FP8 conversion (cvt.rn.satfinite.e4m3x2)";
    wx__delta.threads = 256;
    wx__delta.ctas_per_sm = c;
}

int wx_sweep_set(const char *kernel, int variant, int ctas_per_sm, int unroll, char *why,
                 size_t why_len)
{
    int fp8 = strcmp(kernel, "fp8") == 0, delta = strcmp(kernel, "delta") == 0, rc = 0;
    if (!fp8 && !delta && strcmp(kernel, "copy") != 0) {
        snprintf(why, why_len, "kernel %.40s (expected fp8, delta or copy)", kernel);
        return -EINVAL;
    }
    if (fp8     ? (variant < 0 || variant > 8 || ctas_per_sm < 0 || ctas_per_sm > 32)
        : delta ? (variant < 0 || variant > 29 || ctas_per_sm < 0 || ctas_per_sm > 2)
                : (unroll < 1 || unroll > 16 || ctas_per_sm < 1 || ctas_per_sm > 32)) {
        snprintf(why, why_len,
                 fp8     ? "fp8: variant %d, ctas_per_sm %d (expected 0-8, 0-32)"
                 : delta ? "delta: variant %d, ctas_per_sm %d (expected 0-29, 0-2: at 3 it spills)"
                         : "copy: unroll %d, ctas_per_sm %d (expected 1-16, 1-32)",
                 fp8 || delta ? variant : unroll, ctas_per_sm);
        return -EINVAL;
    }
    pthread_mutex_lock(&wx__mu);
    if (fp8 ? wx__fp8_used : delta ? wx__delta_used : wx__copy_used) {
        snprintf(why, why_len, "%s: the kernel was used already in this process", kernel);
        rc = -EBUSY;
    } else if (fp8) {
        wx__fp8_cfg(variant, ctas_per_sm);
        wx__fp8_set = 1;
    } else if (delta) {
        wx__delta_cfg(variant, ctas_per_sm);
        wx__delta_set = 1;
    } else {
        wx__copy_cfg(unroll, ctas_per_sm);
        wx__copy_set = 1;
    }
    pthread_mutex_unlock(&wx__mu);
    return rc;
}

const wx_kernel_cfg_t *wx_sweep_cfg(const char *kernel)
{
    const wx_kernel_cfg_t *c;
    int fp8 = strcmp(kernel, "fp8") == 0, delta = strcmp(kernel, "delta") == 0;
    pthread_mutex_lock(&wx__mu);
    if (fp8) {
        wx__fp8_used = 1;
        c = wx__fp8_set ? &wx__fp8 : NULL;
    } else if (delta) {
        wx__delta_used = 1;
        c = wx__delta_set ? &wx__delta : NULL;
    } else {
        wx__copy_used = 1;
        c = wx__copy_set ? &wx__copy : NULL;
    }
    pthread_mutex_unlock(&wx__mu);
    return c;
}
#else
typedef int wx__sweep_none; /* a translation unit must declare something */
#endif
