/* wx_delta_host.c - compare, encode and shadow update of delta pushes on the CPU (wx_delta_host.h). */
#include "wx_delta_host.h"

#include <errno.h>
#include <string.h>

#include "wx_common.h"

static uint64_t wx__pad8(uint64_t n) { return (n + 7) & ~(uint64_t)7; }

uint64_t wx_delta_record_size(uint64_t n, uint64_t c, int *encoding)
{
    uint64_t pairs = WX_DELTA_REC + wx__pad8(4 * c) + wx__pad8(c);
    uint64_t mask = WX_DELTA_REC + wx__pad8((n + 7) / 8) + wx__pad8(c);
    int enc = pairs <= mask ? WX_DELTA_PAIRS : WX_DELTA_MASK;
    if (encoding)
        *encoding = enc;
    if (c == 0)
        return 0;
    return enc == WX_DELTA_PAIRS ? pairs : mask;
}

/* The 32 bytes at a and b differ? (four 64-bit words, any alignment) */
static int wx__differ32(const uint8_t *a, const uint8_t *b)
{
    uint64_t x[4], y[4];
    memcpy(x, a, 32);
    memcpy(y, b, 32);
    return ((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) != 0;
}

int wx_delta_scan(const uint8_t *cur, const uint8_t *shadow, uint64_t n, uint32_t *idx,
                  uint64_t cap, uint64_t *changed)
{
    uint64_t c = 0, i = 0;
    if ((!cur || !shadow) && n)
        return wx_errf(-EINVAL, "delta scan: null %s", cur ? "shadow" : "range");
    if (cap && !idx)
        return wx_errf(-EINVAL, "delta scan: cap %llu without an offset table",
                       (unsigned long long)cap);
    if (cap && n > (1ull << 32))
        return wx_errf(-EINVAL, "delta scan: offsets of a range of %llu bytes (more than 2^32)",
                       (unsigned long long)n);
    for (; i < n; i += 32) {
        uint64_t m = n - i < 32 ? n - i : 32;
        if (m == 32 && !wx__differ32(cur + i, shadow + i))
            continue;
        for (uint64_t j = i; j < i + m; j++) {
            if (cur[j] != shadow[j]) {
                if (c < cap)
                    idx[c] = (uint32_t)j;
                c++;
            }
        }
    }
    *changed = c;
    return 0;
}

/* The mask of cur[0, n) != shadow[0, n) at bits, the changed bytes at vals; returns their count. */
static uint64_t wx__mask(const uint8_t *cur, const uint8_t *shadow, uint64_t n, uint8_t *bits,
                         uint8_t *vals, uint64_t c)
{
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i += 32) {
        uint64_t m = n - i < 32 ? n - i : 32;
        if (m == 32 && !wx__differ32(cur + i, shadow + i))
            continue; /* its four mask bytes stay 0 */
        for (uint64_t j = i; j < i + m; j++) {
            if (cur[j] != shadow[j]) {
                bits[j >> 3] |= (uint8_t)(1u << (j & 7));
                if (k < c)
                    vals[k] = cur[j];
                k++;
            }
        }
    }
    return k;
}

int wx_delta_encode(const uint8_t *cur, const uint8_t *shadow, uint64_t n, uint64_t c,
                    const uint32_t *idx, uint32_t region, uint64_t doff, uint8_t *out,
                    uint64_t out_len)
{
    int enc;
    uint64_t size = wx_delta_record_size(n, c, &enc), k;
    uint32_t head32[2] = {region, (uint32_t)enc};
    uint64_t head64[3] = {doff, n, c};
    if (c == 0 || c > n)
        return wx_errf(-EINVAL, "delta encode: %llu changed bytes of %llu", (unsigned long long)c,
                       (unsigned long long)n);
    if (!cur || !shadow || !out || out_len != size)
        return wx_errf(-EINVAL, "delta encode: output of %llu bytes (the record is %llu)",
                       (unsigned long long)out_len, (unsigned long long)size);
    if (enc == WX_DELTA_PAIRS && n > (1ull << 32))
        return wx_errf(-EINVAL, "delta encode: u32 offsets of a range of %llu bytes",
                       (unsigned long long)n);
    memset(out, 0, size); /* the paddings */
    memcpy(out, head32, 8);
    memcpy(out + 8, head64, 24);
    uint8_t *p = out + WX_DELTA_REC;
    if (enc == WX_DELTA_PAIRS) {
        uint8_t *vals = p + wx__pad8(4 * c);
        if (idx) {
            memcpy(p, idx, 4 * c); /* little-endian hosts (x86-64, aarch64) */
            for (k = 0; k < c; k++) {
                if (idx[k] >= n || cur[idx[k]] == shadow[idx[k]])
                    return wx_errf(-ESTALE, "delta encode: offset %u no longer changed", idx[k]);
                vals[k] = cur[idx[k]];
            }
            return 0;
        }
        k = 0;
        for (uint64_t j = 0; j < n; j++) {
            if (cur[j] != shadow[j]) {
                if (k < c) {
                    uint32_t o = (uint32_t)j;
                    memcpy(p + 4 * k, &o, 4);
                    vals[k] = cur[j];
                }
                k++;
            }
        }
    } else {
        k = wx__mask(cur, shadow, n, p, p + wx__pad8((n + 7) / 8), c);
    }
    if (k != c)
        return wx_errf(-ESTALE, "delta encode: %llu bytes changed, the scan counted %llu",
                       (unsigned long long)k, (unsigned long long)c);
    return 0;
}

int wx_delta_sync(const uint8_t *cur, uint8_t *shadow, uint64_t n, uint64_t c, const uint32_t *idx)
{
    if ((!cur || !shadow) && n)
        return wx_errf(-EINVAL, "delta sync: null %s", cur ? "shadow" : "range");
    if (!idx) {
        if (n)
            memcpy(shadow, cur, n);
        return 0;
    }
    for (uint64_t k = 0; k < c; k++) {
        if (idx[k] >= n)
            return wx_errf(-EINVAL, "delta sync: offset %u outside the range of %llu bytes", idx[k],
                           (unsigned long long)n);
        shadow[idx[k]] = cur[idx[k]];
    }
    return 0;
}

int wx_delta_apply(const uint8_t *payload, uint64_t payload_len, int enc, uint64_t n, uint64_t c,
                   uint8_t *dst)
{
    uint64_t need, k = 0;
    if (enc != WX_DELTA_PAIRS && enc != WX_DELTA_MASK)
        return wx_errf(-EINVAL, "delta apply: encoding %d", enc);
    if (c > n || (enc == WX_DELTA_PAIRS && n > (1ull << 32)))
        return wx_errf(-EINVAL, "delta apply: %llu changed bytes of a range of %llu",
                       (unsigned long long)c, (unsigned long long)n);
    need = (enc == WX_DELTA_PAIRS ? wx__pad8(4 * c) : wx__pad8((n + 7) / 8)) + wx__pad8(c);
    if (!payload || !dst || payload_len < need)
        return wx_errf(-EINVAL, "delta apply: a payload of %llu bytes (the record needs %llu)",
                       (unsigned long long)payload_len, (unsigned long long)need);
    if (enc == WX_DELTA_PAIRS) {
        const uint8_t *vals = payload + wx__pad8(4 * c);
        for (k = 0; k < c; k++) { /* checked before anything is written */
            uint32_t o;
            memcpy(&o, payload + 4 * k, 4);
            if (o >= n)
                return wx_errf(-EINVAL, "delta apply: offset %u outside the range of %llu bytes", o,
                               (unsigned long long)n);
        }
        for (k = 0; k < c; k++) {
            uint32_t o;
            memcpy(&o, payload + 4 * k, 4);
            dst[o] = vals[k];
        }
        return 0;
    }
    const uint8_t *bits = payload, *vals = payload + wx__pad8((n + 7) / 8);
    for (uint64_t i = 0; i < (n + 7) / 8; i++) { /* the count first: nothing written when wrong */
        uint8_t b = bits[i];
        if (i == (n - 1) / 8 && (n & 7))
            b &= (uint8_t)((1u << (n & 7)) - 1);
        k += (uint64_t)__builtin_popcount(b);
    }
    if (k != c)
        return wx_errf(-EINVAL,
                       "delta apply: the mask holds %llu bits, the record says %llu changed",
                       (unsigned long long)k, (unsigned long long)c);
    k = 0;
    for (uint64_t i = 0; i < (n + 7) / 8; i++) {
        uint8_t b = bits[i];
        while (b) {
            uint64_t j = 8 * i + (uint64_t)__builtin_ctz(b);
            b &= (uint8_t)(b - 1);
            if (j < n)
                dst[j] = vals[k++];
        }
    }
    return 0;
}
