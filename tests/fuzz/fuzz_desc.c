/* fuzz_desc.c - libFuzzer target over the C decoders of csrc/transport/wx_desc.c.
 *
 * The first input byte picks the decoder (even: descriptor, odd: export blob), the rest is
 * its input. Whatever decodes must re-encode to exactly the bytes it was decoded from
 * (the formats have one encoding per value, but for the header's three pad bytes, which
 * the decoders ignore) and decode again to the same value. Built and
 * run by `make fuzz` (clang -fsanitize=fuzzer,address,undefined) for a bounded time;
 * tests/fuzz/seeds.py writes its seed corpus.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wx_desc.h"

static void wx__fz_check(int ok)
{
    if (!ok)
        abort();
}

/* p and the re-encoded out are the same bytes, but for the header's pad (bytes 5..7). */
static int wx__fz_same(const uint8_t *p, const uint8_t *out, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if (p[i] != out[i] && (i < 5 || i > 7))
            return 0;
    return 1;
}

static void wx__fz_desc(const uint8_t *p, size_t n)
{
    wx_desc_t d, d2;
    uint8_t out[sizeof(wx_desc_t) + 64];
    size_t len = 0;
    if (wx_desc_decode(p, n, &d))
        return;
    wx__fz_check(wx_desc_size(&d) <= sizeof out);
    wx__fz_check(wx_desc_encode(&d, out, sizeof out, &len) == 0);
    wx__fz_check(len == n && wx__fz_same(p, out, len));
    wx__fz_check(wx_desc_decode(out, len, &d2) == 0);
    wx__fz_check(d2.kind == d.kind && d2.addr_len == d.addr_len &&
                 memcmp(d2.addr, d.addr, d.addr_len) == 0 && d2.ri.key == d.ri.key &&
                 d2.ri.rbase == d.ri.rbase && d2.ri.len == d.ri.len &&
                 d2.ri.blob_len == d.ri.blob_len);
}

static void wx__fz_export(const uint8_t *p, size_t n)
{
    uint8_t addr[WX_ADDR_MAX], addr2[WX_ADDR_MAX];
    uint32_t kind, kind2, alen, alen2, nreg, nreg2;
    wx_rinfo_t *regs, *regs2;
    uint8_t *out;
    size_t cap, len = 0;
    if (wx_export_decode(p, n, &kind, addr, &alen, &nreg, &regs))
        return;
    cap = wx_export_size(alen, nreg, regs);
    wx__fz_check(cap <= n);
    out = malloc(cap ? cap : 1);
    wx__fz_check(out != NULL);
    wx__fz_check(wx_export_encode(kind, addr, alen, nreg, regs, out, cap, &len) == 0);
    wx__fz_check(len == cap && wx__fz_same(p, out, len));
    wx__fz_check(wx_export_decode(out, len, &kind2, addr2, &alen2, &nreg2, &regs2) == 0);
    wx__fz_check(kind2 == kind && alen2 == alen && nreg2 == nreg && memcmp(addr2, addr, alen) == 0);
    for (uint32_t i = 0; i < nreg; i++)
        wx__fz_check(regs2[i].key == regs[i].key && regs2[i].len == regs[i].len &&
                     regs2[i].blob_len == regs[i].blob_len &&
                     memcmp(regs2[i].blob, regs[i].blob, regs[i].blob_len) == 0);
    free(regs2);
    free(regs);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    if (data[0] & 1)
        wx__fz_export(data + 1, size - 1);
    else
        wx__fz_desc(data + 1, size - 1);
    return 0;
}
