/* wx_sweep.h - the kernel variants a benchmark compares, in builds made for it only.
 *
 * `WXFER_KERNEL_SWEEP=1 python setup.py build_ext --inplace` compiles wx_sweep.c with
 * WX_KERNEL_SWEEP and embeds the .cu files of benchmarks/kernels (the FP8 kernel's nine measured
 * variants); `_wxfer.kernel_sweep(...)` then picks, before a kernel's first use, the variant
 * and launch shape that benchmarks/bench_quant.py --variants, bench_copies.py --variants and
 * bench_fused_variants.py (the fused delta kernel's switches, compiled from its own source)
 * measure. Every other build (a wheel, `make build`) has the product kernels only:
 * wx_sweep_cfg is NULL there.
 */
#ifndef WX_SWEEP_H
#define WX_SWEEP_H

#include <stddef.h>

#include "wx_kernels.h"

#ifdef WX_KERNEL_SWEEP
/* Choose kernel "fp8" (variant 0-8; ctas_per_sm 0: the variant's own, else 1-32), "delta"
 * (variant 0-29: WX_DPF = variant % 4, WX_DPAIR = variant / 4 % 2, WX_DBITS = variant / 8 of
 * wx_delta_kernel.cu below 24; WX_DPF 4, WX_DPAIR = (variant - 24) % 2, WX_DBITS =
 * (variant - 24) / 2 from 24;
 * ctas_per_sm 0: the product's 2, else 1-2) or "copy" (unroll 1-16 loads in flight per thread,
 * ctas_per_sm 1-32) for this process. Returns 0, or
 * -EINVAL / -EBUSY (the kernel was used already) with the reason in why. */
int wx_sweep_set(const char *kernel, int variant, int ctas_per_sm, int unroll, char *why,
                 size_t why_len);
/* The chosen configuration of `kernel`, or NULL (the product's); fixed from the first call. */
const wx_kernel_cfg_t *wx_sweep_cfg(const char *kernel);
#else
static inline const wx_kernel_cfg_t *wx_sweep_cfg(const char *kernel)
{
    (void)kernel;
    return NULL;
}
#endif

#endif
