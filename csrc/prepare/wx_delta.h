/* wx_delta.h - delta pushes on the GPU (issue 36, docs/delta.md): the FP8 quantizer fused with
 * the compare against the shadow, the compare of raw bytes, and the records made from the
 * bitmask of changed bytes, bit-identical to wxfer.runtime.delta.encode's.
 *
 * The shadow is a uint8 device buffer holding what the trainer last wrote; every launch here
 * updates it in place to the fresh bytes and ORs bit i of the bitmask (u32 words, little-endian
 * bit order, zeroed by the caller, at least WX_DELTA_WORDS(nbits) words) for each byte i that
 * changed. The kernels (wx_delta_kernel.cu, which includes the FP8 kernel's source, and
 * wx_delta_ops_kernel.cu) are compiled with NVRTC at first use, like the FP8 kernel. Tables
 * (ranges, records) live in device memory until the kernel ran (stream order).
 */
#ifndef WX_DELTA_H
#define WX_DELTA_H

#include <stddef.h>
#include <stdint.h>

#include "wx_fp8.h"

#define WX_DELTA_SEG 8192u /* bytes of a range per segment (the ops kernel's WX_DSEG) */
#define WX_DELTA_MAX (1 << 20)
#define WX_DELTA_WORDS(nbits) (((uint64_t)(nbits) + 31u) / 32u + 1u) /* one word past the end */
enum { WX_DELTA_PAIRS = 0, WX_DELTA_MASK = 1 };

/* Compare: the nbytes at src (fresh) with those at dst (in the shadow), at bit0 of the bitmask;
 * seg0 the running count of segments (ceil(nbytes / WX_DELTA_SEG)) before it. */
typedef struct wx_delta_cmp {
    uint64_t dst, src, nbytes, seg0, bit0;
} wx_delta_cmp_t;

/* Count: a range of nbytes bits at bit0 of the bitmask; seg0 as above. */
typedef struct wx_delta_range {
    uint64_t bit0, nbytes, seg0;
} wx_delta_range_t;

/* Emit: one record (the kernel's struct wx_delta_rec): at out_off of the output (8-aligned),
 * of the range at bit0 (its shadow offset = its first bit) of nbytes bytes, count of them
 * changed; seg0 the running count of segments of the records before it, rseg0 the range's first
 * segment in the count launch (its index in segx); head0 = region | encoding << 32; doff the
 * destination offset. */
typedef struct wx_delta_rec {
    uint64_t out_off, bit0, nbytes, seg0, rseg0, count, head0, doff;
} wx_delta_rec_t;

/* Scatter: the changed bytes of a shadow range of nbytes at bit0 (its offset in the shadow = its
 * first bit) stored at dst (the receiver's memory, mapped in the writer's context); seg0 as
 * above. The launcher is given addresses only, not how many bytes are mapped at dst: the caller
 * (wxfer/runtime/delta_scatter.py, Scatter.write) refuses a range whose nbytes is not the length
 * it mapped for that destination (Transport.map of the destination's own range) before it
 * builds the table; wx_delta_scatter_check checks dst non-null and the shadow/bitmask bounds. */
typedef struct wx_delta_scat {
    uint64_t dst, bit0, nbytes, seg0;
} wx_delta_scat_t;

/* Apply (the receiver's side, wx_delta_apply): a slot's nrec records at rec (device memory,
 * 8-aligned, rec_nbytes bytes: the payload after the slot's header, wxfer/runtime/delta.py's
 * format) written into the regions (a device table of {base address, nbytes} u64 pairs, one per
 * region index). Scratch the caller allocates on the device: work, nrec x 64 bytes (the walk's
 * table); state, 8 u64 (the phases' answer: [0] error bits WX_DELTA_AP_*, [1] the first bad
 * record, [2] segments, [3] the head offset where the walk stopped, [4] changed bytes, [5] 1
 * when the walk itself failed; zeroed by the caller); counts,
 * cap u32 and segx, cap + 1 int64 (segx[0] = 0), cap >= WX_DELTA_AP_CAP(rec_nbytes, nrec). */
typedef struct wx_delta_recs {
    uint64_t rec, rec_nbytes, nrec, regions, nregions, work, state, counts, segx, cap;
} wx_delta_recs_t;
#define WX_DELTA_AP_HEAD 1 /* a head's region, encoding or range outside the registered memory */
#define WX_DELTA_AP_OVER 2 /* a head or payload past the records' end */
#define WX_DELTA_AP_BAD 4  /* a malformed payload (changed > length, an offset, the mask's count) */
#define WX_DELTA_AP_SEGS 8 /* more segments than cap (not with a cap of WX_DELTA_AP_CAP) */
#define WX_DELTA_AP_WORK 64 /* bytes of the walk's entry per record */
/* Segments of a slot at most: a MASK record's bitmask holds 1 byte per 8 of its range (8 KiB a
 * segment), a PAIRS record 4 bytes a pair (8192 pairs a segment); one more per record. */
#define WX_DELTA_AP_CAP(rec_nbytes, nrec) ((uint64_t)(rec_nbytes) / 1024u + (uint64_t)(nrec) + 1u)

/* Can the kernels run on CUDA device `device`? Compiles and loads both modules (once). The fused
 * quantizer needs compute capability 8.9 (e4m3 conversion); the others run on any. Returns 0, or
 * a negative errno with the reason in why. */
int wx_delta_probe(int device, const char *const *dirs, int ndirs, char *why, size_t why_len);

/* Can the apply kernel (wx_delta_apply) run on `device` (any compute capability)? */
int wx_delta_apply_probe(int device, const char *const *dirs, int ndirs, char *why, size_t why_len);

/* Validation (no GPU): 0 with *nsegs (the grid's work), or -EINVAL naming the entry. */
int wx_delta_cmp_check(const wx_delta_cmp_t *r, int n, uint64_t bits_nbytes, uint64_t *nsegs);
int wx_delta_count_check(const wx_delta_range_t *r, int n, uint64_t bits_nbytes, uint64_t *nsegs);
int wx_delta_emit_check(const wx_delta_rec_t *r, int n, uint64_t bits_nbytes,
                        uint64_t shadow_nbytes, uint64_t out_nbytes, uint64_t nsegx,
                        uint64_t *nsegs);
int wx_delta_scatter_check(const wx_delta_scat_t *r, int n, uint64_t bits_nbytes,
                           uint64_t shadow_nbytes, uint64_t *nsegs);
/* The addresses and sizes of an apply (what the records hold is the walk's to check). */
int wx_delta_apply_check(const wx_delta_recs_t *a);

/* The FP8 kernel's pieces (wx_fp8_check) quantized into the shadow `out` (the fp8 bytes and
 * scales compared, the changed ones written and marked in `bits`). As wx_fp8_launch otherwise. */
int wx_delta_quant_launch(int device, uint64_t stream, uint64_t out, uint64_t out_nbytes,
                          const wx_fp8_piece_t *host, uint64_t dev_pieces, int n, uint64_t bits,
                          uint64_t bits_nbytes);
int wx_delta_cmp_launch(int device, uint64_t stream, const wx_delta_cmp_t *host, uint64_t dev,
                        int n, uint64_t bits, uint64_t bits_nbytes);
/* counts: one u32 per segment of the ranges (counts_n of them). */
int wx_delta_count_launch(int device, uint64_t stream, const wx_delta_range_t *host, uint64_t dev,
                          int n, uint64_t bits, uint64_t bits_nbytes, uint64_t counts,
                          uint64_t counts_n);
/* segx: nsegx int64, the exclusive prefix sum of the count launch's counts (segx[0] == 0). */
int wx_delta_emit_launch(int device, uint64_t stream, const wx_delta_rec_t *host, uint64_t dev,
                         int n, uint64_t bits, uint64_t bits_nbytes, uint64_t shadow,
                         uint64_t shadow_nbytes, uint64_t segx, uint64_t nsegx, uint64_t out,
                         uint64_t out_nbytes);
/* For each set bit b of each range, dst[b] = shadow[bit0 + b] (wx_delta_scatter). */
int wx_delta_scatter_launch(int device, uint64_t stream, const wx_delta_scat_t *host, uint64_t dev,
                            int n, uint64_t bits, uint64_t bits_nbytes, uint64_t shadow,
                            uint64_t shadow_nbytes);
/* Phase 0 (the walk, then the count) or 1 (the check of the masks' counts, then the apply) of
 * the records; between them the caller writes segx[1..cap] = the inclusive prefix sum of counts
 * on the same stream. Reading state after phase 1 (once the stream ran it) says whether every
 * record was applied (state[0] == 0) or none, and why. */
int wx_delta_apply_launch(int device, uint64_t stream, const wx_delta_recs_t *a, int phase);

#endif
