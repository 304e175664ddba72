/* wx_desc.h - versioned wire formats: region descriptors and export blobs.
 *
 * Little-endian, fixed layout, every length checked on decode. Decoders never read past
 * the buffer they are given and return -EBADMSG (truncated/garbage) or -EPROTO (wrong
 * magic/version/kind) with a reason.
 *
 * descriptor (one region a peer may write):
 *   "WXD" u8 version(=1) | u8 kind | u8 pad[3] | u32 addr_len | addr
 *   | rinfo: u64 key, u64 rbase, u64 len, u32 mem, i32 device, u32 blob_len, blob
 * export blob (a process's address and all of its exported regions):
 *   "WXE" u8 version(=1) | u8 kind | u8 pad[3] | u32 addr_len | addr | u32 n | n x rinfo
 */
#ifndef WX_DESC_H
#define WX_DESC_H

#include "wx_transport.h"

#define WX_DESC_VERSION 1
#define WX_EXPORT_VERSION 1
#define WX_EXPORT_MAX_REGIONS (1u << 20)

typedef struct wx_desc {
    uint32_t kind;
    uint32_t addr_len;
    uint8_t addr[WX_ADDR_MAX];
    wx_rinfo_t ri;
} wx_desc_t;

/* Size of an encoded descriptor / export blob. */
size_t wx_desc_size(const wx_desc_t *d);
int wx_desc_encode(const wx_desc_t *d, uint8_t *buf, size_t cap, size_t *len);
int wx_desc_decode(const uint8_t *buf, size_t len, wx_desc_t *d);

/* Export blob: decode allocates *regions (free with free()). */
size_t wx_export_size(uint32_t addr_len, uint32_t n, const wx_rinfo_t *regions);
int wx_export_encode(uint32_t kind, const uint8_t *addr, uint32_t addr_len, uint32_t n,
                     const wx_rinfo_t *regions, uint8_t *buf, size_t cap, size_t *len);
int wx_export_decode(const uint8_t *buf, size_t len, uint32_t *kind, uint8_t *addr,
                     uint32_t *addr_len, uint32_t *n, wx_rinfo_t **regions);

#endif
