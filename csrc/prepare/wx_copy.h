/* wx_copy.h - many device-to-device copies in one kernel launch.
 *
 * The batched copies of small zero-copy tasks straight into the receivers' mapped memory
 * (wxfer/runtime/direct.py): one launch over a table of ranges instead of one driver call
 * per copy. A range is (dst, src, nbytes, chunk0): device addresses of one device, any
 * alignment (16-byte aligned pairs are copied 16 bytes at a time), chunk0 the running count
 * of WX_COPY_CHUNK-byte chunks of the ranges before it. The kernel (wx_copy_kernel.cu) is
 * compiled with NVRTC at first use and cached per architecture and per device by the kernel
 * loader (wx_kernels.c), as the FP8 kernel is (docs/prepare.md). wx_copy_batch does the same
 * copies with the driver's cuMemcpyBatchAsync, to be measured beside it
 * (benchmarks/bench_copies.py; wxfer.runtime.copies.COPIER picks).
 */
#ifndef WX_COPY_H
#define WX_COPY_H

#include <stddef.h>
#include <stdint.h>

#define WX_COPY_CHUNK (64u * 1024u) /* = the kernel's WX_CHUNK */
#define WX_COPY_MAX_RANGES (1 << 20)

/* One range; the layout is the kernel's struct wx_copy_range (4 x 64 bits). */
typedef struct wx_copy_range {
    uint64_t dst, src, nbytes;
    uint64_t chunk0; /* sum of the chunk counts of the ranges before it */
} wx_copy_range_t;

/* Validate n ranges: non-null addresses, nbytes >= 1, chunk0 the running chunk count, no
 * range whose bytes wrap the address space. Sets *nchunks. Returns 0, or -EINVAL naming the
 * range and the field. Needs no GPU. */
int wx_copy_check(const wx_copy_range_t *r, int n, uint64_t *nchunks);

/* Can the kernel run on CUDA device `device`? Loads libcuda and libnvrtc (dirs: extra
 * directories to look in), compiles and loads the kernel into the device's primary context
 * (once, wx_kernels.c). Returns 0, or a negative errno with the reason in why. */
int wx_copy_probe(int device, const char *const *dirs, int ndirs, char *why, size_t why_len);

/* Copy on `stream` (a CUstream) of `device` the n validated ranges `host` with one launch of
 * the kernel (`dev_ranges`: the device address of the same bytes, valid until the kernel ran,
 * stream order). ctas_per_sm: the persistent grid's CTAs per SM (0: the product's 16; a few
 * leave room on every SM for a kernel running beside it, wxfer/runtime/overlap.py). Returns 0
 * or a negative errno (wx_last_error says why). */
int wx_copy_launch(int device, uint64_t stream, const wx_copy_range_t *host, uint64_t dev_ranges,
                   int n, int ctas_per_sm);

/* The kernel's settings: 16-byte loads in flight per thread (compiled in) and CTAs per SM of
 * its grid (the product's 4 and 16; another pair only in a WXFER_KERNEL_SWEEP build). */
void wx_copy_settings(int *unroll, int *ctas);

/* Can the driver's own batched copy (cuMemcpyBatchAsync, CUDA 12.8+ drivers) run on
 * `device`? Returns 0, or -ENOTSUP (a driver without it: the path is unavailable, no error
 * elsewhere) / -ENODEV with the reason in why. */
int wx_copy_batch_probe(int device, char *why, size_t why_len);

/* The same copies by one cuMemcpyBatchAsync on `stream` of `device`: n (dst, src, nbytes)
 * uint64 triples, device addresses of `device`, the sources read in stream order;
 * beside_compute: the driver's hint CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE (run them on the
 * copy engines, beside the kernels on the SMs; wxfer/runtime/overlap.py). Returns 0 or a
 * negative errno (wx_last_error names the call and, where the driver says, the copy). */
int wx_copy_batch(int device, uint64_t stream, const uint64_t *triples, int n, int beside_compute);

#endif
