/* wx_delta_host.h - the CPU side of delta pushes (issue 36; the format: wxfer/runtime/delta.py).
 *
 * A trainer compares a range's fresh destination bytes with its shadow (what it last wrote),
 * encodes the changed ones as one record and brings the shadow up to date, each in one pass
 * over host memory, without temporaries:
 *
 *   wx_delta_scan    counts the bytes that differ and keeps their offsets (up to `cap`);
 *   wx_delta_encode  writes the range's record: a 32-byte head (u32 region, u32 encoding,
 *                    u64 offset, u64 length, u64 changed) then, for PAIRS, the u32 offsets and
 *                    the bytes, each zero-padded to 8; for MASK, the bitmask of the range
 *                    (little-endian bit order, zero-padded to 8) and the bytes (padded to 8);
 *                    the smaller of the two (PAIRS on a tie), byte for byte as delta.encode;
 *   wx_delta_sync    copies the changed bytes into the shadow;
 *   wx_delta_apply   the receiver's side: one record's bytes written into its range.
 *
 * Plain C on host memory: no Python, no GPU. Each returns 0 or -errno (wx_errf says why). */
#ifndef WX_DELTA_HOST_H
#define WX_DELTA_HOST_H

#include <stdint.h>

#include "wx_delta.h" /* the encodings, WX_DELTA_PAIRS / WX_DELTA_MASK: one format for both sides */

#define WX_DELTA_REC 32 /* bytes of a record's head */

/* Bytes of the record of a range of n bytes with c changed (0 when c is 0), and its encoding. */
uint64_t wx_delta_record_size(uint64_t n, uint64_t c, int *encoding);

/* *changed = the bytes of cur[0, n) that differ from shadow[0, n); their offsets, ascending,
 * in idx[0, min(changed, cap)) (idx may be NULL when cap is 0). */
int wx_delta_scan(const uint8_t *cur, const uint8_t *shadow, uint64_t n, uint32_t *idx,
                  uint64_t cap, uint64_t *changed);

/* The record of cur[0, n) against shadow[0, n) (c changed bytes, from wx_delta_scan; idx its
 * offsets, or NULL to scan again), to be applied at byte doff of region index `region`, into
 * out[0, out_len): out_len must be wx_delta_record_size(n, c). -EINVAL for a wrong size, a
 * PAIRS range of more than 2^32 bytes or c 0; -ESTALE when the bytes no longer match c. */
int wx_delta_encode(const uint8_t *cur, const uint8_t *shadow, uint64_t n, uint64_t c,
                    const uint32_t *idx, uint32_t region, uint64_t doff, uint8_t *out,
                    uint64_t out_len);

/* shadow[0, n) = cur[0, n): the c bytes at idx when given, else the whole range. */
int wx_delta_sync(const uint8_t *cur, uint8_t *shadow, uint64_t n, uint64_t c, const uint32_t *idx);

/* Apply one record's payload (what follows its head: payload_len bytes) of encoding `enc`
 * for a range of n bytes with c changed, to dst[0, n). -EINVAL (nothing written) when the
 * payload is short, an offset is outside the range or the mask does not hold c bits. */
int wx_delta_apply(const uint8_t *payload, uint64_t payload_len, int enc, uint64_t n, uint64_t c,
                   uint8_t *dst);

#endif
