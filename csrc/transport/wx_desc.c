/* wx_desc.c - encode/decode descriptors and export blobs (see wx_desc.h). */
#include "wx_desc.h"

#include <stdlib.h>
#include <string.h>

typedef struct wx__wbuf {
    uint8_t *p;
    size_t cap, off;
} wx__wbuf_t;

typedef struct wx__rbuf {
    const uint8_t *p;
    size_t len, off;
} wx__rbuf_t;

static void wx__put(wx__wbuf_t *w, const void *src, size_t n)
{
    if (w->off + n <= w->cap)
        memcpy(w->p + w->off, src, n);
    w->off += n;
}

/* v as n little-endian bytes (n <= 8). */
static void wx__put_le(wx__wbuf_t *w, uint64_t v, size_t n)
{
    uint8_t b[8];
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    wx__put(w, b, n);
}

static void wx__put_u32(wx__wbuf_t *w, uint32_t v) { wx__put_le(w, v, 4); }

static void wx__put_u64(wx__wbuf_t *w, uint64_t v) { wx__put_le(w, v, 8); }

static int wx__get(wx__rbuf_t *r, void *dst, size_t n)
{
    if (n > r->len - r->off)
        return -EBADMSG;
    memcpy(dst, r->p + r->off, n);
    r->off += n;
    return 0;
}

/* n little-endian bytes (n <= 8) into *v. */
static int wx__get_le(wx__rbuf_t *r, size_t n, uint64_t *v)
{
    uint8_t b[8];
    int rc = wx__get(r, b, n);
    if (rc)
        return rc;
    *v = 0;
    for (size_t i = 0; i < n; i++)
        *v |= (uint64_t)b[i] << (8 * i);
    return 0;
}

static int wx__get_u32(wx__rbuf_t *r, uint32_t *v)
{
    uint64_t x;
    int rc = wx__get_le(r, 4, &x);
    if (!rc)
        *v = (uint32_t)x;
    return rc;
}

static int wx__get_u64(wx__rbuf_t *r, uint64_t *v) { return wx__get_le(r, 8, v); }

static void wx__put_header(wx__wbuf_t *w, char tag, uint8_t version, uint32_t kind,
                           const uint8_t *addr, uint32_t addr_len)
{
    uint8_t h[8] = {'W', 'X', (uint8_t)tag, version, (uint8_t)kind, 0, 0, 0};
    wx__put(w, h, sizeof h);
    wx__put_u32(w, addr_len);
    wx__put(w, addr, addr_len);
}

static int wx__get_header(wx__rbuf_t *r, char tag, uint8_t version, const char *what,
                          uint32_t *kind, uint8_t *addr, uint32_t *addr_len)
{
    uint8_t h[8];
    if (wx__get(r, h, sizeof h))
        return wx_errf(-EBADMSG, "%s truncated: %zu bytes, header needs 8", what, r->len);
    if (h[0] != 'W' || h[1] != 'X' || h[2] != (uint8_t)tag)
        return wx_errf(-EPROTO, "not a wxfer %s (bad magic)", what);
    if (h[3] != version)
        return wx_errf(-EPROTO, "%s version %u, this build reads version %u", what, h[3], version);
    if (!wx_kind_name(h[4]))
        return wx_errf(-EPROTO, "%s names unknown transport kind %u", what, h[4]);
    if (h[5] | h[6] | h[7])
        return wx_errf(-EBADMSG, "%s header bytes 5-7 must be zero (reserved)", what);
    *kind = h[4];
    if (wx__get_u32(r, addr_len))
        return wx_errf(-EBADMSG, "%s truncated in address length", what);
    if (*addr_len > WX_ADDR_MAX)
        return wx_errf(-EBADMSG, "%s address length %u exceeds %u", what, *addr_len, WX_ADDR_MAX);
    if (wx__get(r, addr, *addr_len))
        return wx_errf(-EBADMSG, "%s truncated in address", what);
    return 0;
}

static void wx__put_rinfo(wx__wbuf_t *w, const wx_rinfo_t *ri)
{
    wx__put_u64(w, ri->key);
    wx__put_u64(w, ri->rbase);
    wx__put_u64(w, ri->len);
    wx__put_u32(w, ri->mem);
    wx__put_u32(w, (uint32_t)ri->device);
    wx__put_u32(w, ri->blob_len);
    wx__put(w, ri->blob, ri->blob_len);
}

static int wx__get_rinfo(wx__rbuf_t *r, wx_rinfo_t *ri, const char *what)
{
    uint32_t dev;
    memset(ri, 0, sizeof *ri);
    if (wx__get_u64(r, &ri->key) || wx__get_u64(r, &ri->rbase) || wx__get_u64(r, &ri->len) ||
        wx__get_u32(r, &ri->mem) || wx__get_u32(r, &dev) || wx__get_u32(r, &ri->blob_len))
        return wx_errf(-EBADMSG, "%s truncated in region record", what);
    ri->device = (int32_t)dev;
    if (ri->mem != WX_MEM_HOST && ri->mem != WX_MEM_CUDA)
        return wx_errf(-EBADMSG, "%s has unknown memory kind %u", what, ri->mem);
    if (ri->blob_len > WX_BLOB_MAX)
        return wx_errf(-EBADMSG, "%s region blob length %u exceeds %u", what, ri->blob_len,
                       WX_BLOB_MAX);
    if (ri->rbase + ri->len < ri->rbase)
        return wx_errf(-EBADMSG, "%s region [0x%llx, +%llu) wraps around", what,
                       (unsigned long long)ri->rbase, (unsigned long long)ri->len);
    if (wx__get(r, ri->blob, ri->blob_len))
        return wx_errf(-EBADMSG, "%s truncated in region blob", what);
    return 0;
}

size_t wx_desc_size(const wx_desc_t *d)
{
    wx__wbuf_t w = {NULL, 0, 0};
    wx__put_header(&w, 'D', WX_DESC_VERSION, d->kind, d->addr, d->addr_len);
    wx__put_rinfo(&w, &d->ri);
    return w.off;
}

int wx_desc_encode(const wx_desc_t *d, uint8_t *buf, size_t cap, size_t *len)
{
    wx__wbuf_t w = {buf, cap, 0};
    if (d->addr_len > WX_ADDR_MAX || d->ri.blob_len > WX_BLOB_MAX)
        return wx_errf(-EINVAL, "descriptor fields too long");
    wx__put_header(&w, 'D', WX_DESC_VERSION, d->kind, d->addr, d->addr_len);
    wx__put_rinfo(&w, &d->ri);
    *len = w.off;
    if (w.off > cap)
        return wx_errf(-ENOSPC, "descriptor needs %zu bytes, buffer has %zu", w.off, cap);
    return 0;
}

int wx_desc_decode(const uint8_t *buf, size_t len, wx_desc_t *d)
{
    wx__rbuf_t r = {buf, len, 0};
    int rc;
    memset(d, 0, sizeof *d);
    rc = wx__get_header(&r, 'D', WX_DESC_VERSION, "descriptor", &d->kind, d->addr, &d->addr_len);
    if (rc)
        return rc;
    rc = wx__get_rinfo(&r, &d->ri, "descriptor");
    if (rc)
        return rc;
    if (r.off != len)
        return wx_errf(-EBADMSG, "descriptor has %zu trailing bytes", len - r.off);
    return 0;
}

size_t wx_export_size(uint32_t addr_len, uint32_t n, const wx_rinfo_t *regions)
{
    wx__wbuf_t w = {NULL, 0, 0};
    static const uint8_t zero[WX_ADDR_MAX];
    wx__put_header(&w, 'E', WX_EXPORT_VERSION, WX_KIND_FABRIC, zero, addr_len);
    wx__put_u32(&w, n);
    for (uint32_t i = 0; i < n; i++)
        wx__put_rinfo(&w, &regions[i]);
    return w.off;
}

int wx_export_encode(uint32_t kind, const uint8_t *addr, uint32_t addr_len, uint32_t n,
                     const wx_rinfo_t *regions, uint8_t *buf, size_t cap, size_t *len)
{
    wx__wbuf_t w = {buf, cap, 0};
    if (addr_len > WX_ADDR_MAX || n > WX_EXPORT_MAX_REGIONS)
        return wx_errf(-EINVAL, "export: address or region count too large");
    wx__put_header(&w, 'E', WX_EXPORT_VERSION, kind, addr, addr_len);
    wx__put_u32(&w, n);
    for (uint32_t i = 0; i < n; i++)
        wx__put_rinfo(&w, &regions[i]);
    *len = w.off;
    if (w.off > cap)
        return wx_errf(-ENOSPC, "export blob needs %zu bytes, buffer has %zu", w.off, cap);
    return 0;
}

int wx_export_decode(const uint8_t *buf, size_t len, uint32_t *kind, uint8_t *addr,
                     uint32_t *addr_len, uint32_t *n, wx_rinfo_t **regions)
{
    wx__rbuf_t r = {buf, len, 0};
    wx_rinfo_t *v = NULL;
    int rc;
    *regions = NULL;
    rc = wx__get_header(&r, 'E', WX_EXPORT_VERSION, "export blob", kind, addr, addr_len);
    if (rc)
        return rc;
    if (wx__get_u32(&r, n))
        return wx_errf(-EBADMSG, "export blob truncated in region count");
    if (*n > WX_EXPORT_MAX_REGIONS)
        return wx_errf(-EBADMSG, "export blob claims %u regions (max %u)", *n,
                       WX_EXPORT_MAX_REGIONS);
    /* each record is at least 36 bytes: refuse counts the buffer cannot hold before
     * allocating */
    if ((uint64_t)*n * 36 > len - r.off)
        return wx_errf(-EBADMSG, "export blob truncated: %u regions need more than %zu bytes", *n,
                       len - r.off);
    v = calloc(*n ? *n : 1, sizeof *v);
    if (!v)
        return wx_errf(-ENOMEM, "export blob: out of memory for %u regions", *n);
    for (uint32_t i = 0; i < *n; i++) {
        rc = wx__get_rinfo(&r, &v[i], "export blob");
        if (rc) {
            free(v);
            return rc;
        }
    }
    if (r.off != len) {
        free(v);
        return wx_errf(-EBADMSG, "export blob has %zu trailing bytes", len - r.off);
    }
    *regions = v;
    return 0;
}
