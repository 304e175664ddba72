/* wx_delta_ops_kernel.cu - delta pushes (issue 36): the compare of raw bytes with the shadow
 * (BF16 and any bytes that are not quantized here) and the records made from the bitmask.
 *
 * Compiled with NVRTC at first use by wx_delta.c (no system header; wx_dev.cuh in memory). Three entry points:
 *
 *   wx_delta_cmp    per range (dst: in the shadow, src: the fresh bytes, nbytes, bit0): each
 *                   thread compares 32 bytes, writes them into the shadow where one differs and
 *                   ORs their bits into the bitmask at bit0 + offset (u32 words, little-endian
 *                   bit order, zeroed by the caller);
 *   wx_delta_count  per range of the bitmask (bit0, nbytes, seg0): the changed bytes of each
 *                   segment of WX_DSEG bytes (256 threads x one 32-bit word);
 *   wx_delta_emit   per record (wx_delta_rec): its 32-byte head and payload, exactly as
 *                   wxfer.runtime.delta.encode writes it: PAIRS, the u32 offsets of the changed
 *                   bytes then the bytes; MASK, the range's bitmask then the bytes. The values
 *                   come from the updated shadow; segment s of the range writes from
 *                   segx[rseg0 + s] - segx[rseg0] on (segx: the exclusive prefix sum of the
 *                   counts), its threads in order (a block scan), so the records are in
 *                   increasing byte order, bit-identical to the CPU encoder's. The output is
 *                   zeroed by the caller (the pads).
 *   wx_delta_scatter per destination range (wx_delta_scat: dst, bit0, nbytes, seg0): the
 *                   emit kernel's walk over the bitmask without the record: for each set bit b
 *                   of the range, dst[b] = shadow[bit0 + b] (a byte store straight into the
 *                   receiver's memory, mapped here by cuda_ipc; a word whose 32 bits are all set
 *                   and whose addresses are 16-aligned is two 16-byte stores).
 *   wx_delta_apply  the receiver's side (wx_delta_recs: a slot's records in device memory, as
 *                   wxfer.runtime.delta.apply_records reads them), one entry point launched in
 *                   four phases on one stream: 0 the walk (one thread: each 32-byte head checked
 *                   against the regions, its payload against the records, its table entry
 *                   written); 1 the count (per segment: the mask bits of a MASK record, as
 *                   wx_delta_count counts a range, and every offset of a PAIRS record checked
 *                   inside its range); the launcher's exclusive prefix sum of the counts; 2 the
 *                   check that each MASK record holds its count of bits; 3 the apply (a MASK
 *                   segment as wx_delta_emit walks one, a block scan giving each thread's first
 *                   value; a PAIRS segment 8192 pairs, coalesced). A phase does nothing once an
 *                   earlier one set an error in state[0]: nothing is written unless every record
 *                   of the slot is well formed.
 */
#include "wx_dev.cuh" /* wx_u32, wx_u64, wx_i64, wx_last_le, wx_set_bits */

#define WX_DTHREADS 256
#define WX_DSEG (WX_DTHREADS * 32) /* bytes of a range per segment (= WX_DELTA_SEG) */
#define WX_DWARPS (WX_DTHREADS / 32)

struct wx_delta_cmp_range { /* = wx_delta_cmp_t */
    wx_u64 dst, src, nbytes, seg0, bit0;
};

struct wx_delta_range { /* = wx_delta_range_t */
    wx_u64 bit0, nbytes, seg0;
};

struct wx_delta_scat { /* = wx_delta_scat_t */
    wx_u64 dst, bit0, nbytes, seg0;
};

struct wx_delta_rec { /* = wx_delta_rec_t */
    wx_u64 out_off;   /* the record's first byte in out (8-aligned) */
    wx_u64 bit0;      /* the range's first byte in the shadow (= its first bit) */
    wx_u64 nbytes;    /* the range's length */
    wx_u64 seg0;      /* the record's first segment in this launch */
    wx_u64 rseg0;     /* the range's first segment in segx */
    wx_u64 count;     /* its changed bytes */
    wx_u64 head0;     /* region | encoding << 32 */
    wx_u64 doff;      /* destination offset */
};

/* The last i with r[i].seg0 <= s (r[0].seg0 == 0). */
template <typename T> __device__ __forceinline__ int wx_dfind(const T *r, int n, wx_u64 s)
{
    return wx_last_le<T, &T::seg0>(r, n, s);
}

/* Bit k set when byte k of the words a and b differ. */
__device__ __forceinline__ wx_u32 wx_dne4(wx_u32 a, wx_u32 b)
{
    wx_u32 d = a ^ b, m = 0;
#pragma unroll
    for (int k = 0; k < 4; k++)
        if ((d >> (8 * k)) & 0xffu)
            m |= 1u << k;
    return m;
}

extern "C" __global__ void __launch_bounds__(WX_DTHREADS)
    wx_delta_cmp(const wx_delta_cmp_range *r, int n, wx_u64 nsegs, wx_u32 *bits)
{
    for (wx_u64 sg = blockIdx.x; sg < nsegs; sg += gridDim.x) {
        const int i = wx_dfind(r, n, sg);
        const wx_u64 off = (sg - r[i].seg0) * WX_DSEG + (wx_u64)threadIdx.x * 32;
        const wx_u64 len = r[i].nbytes;
        if (off >= len)
            continue;
        const int nb = len - off < 32 ? (int)(len - off) : 32;
        unsigned char *d = (unsigned char *)r[i].dst + off;
        const unsigned char *s = (const unsigned char *)r[i].src + off;
        wx_u32 m = 0;
        if (nb == 32 && (((wx_u64)d | (wx_u64)s) & 15) == 0) {
            const uint4 *s4 = (const uint4 *)s;
            uint4 *d4 = (uint4 *)d;
            const uint4 a = __ldg(s4), b = __ldg(s4 + 1), c = d4[0], e = d4[1];
            m = wx_dne4(a.x, c.x) | wx_dne4(a.y, c.y) << 4 | wx_dne4(a.z, c.z) << 8 |
                wx_dne4(a.w, c.w) << 12 | wx_dne4(b.x, e.x) << 16 | wx_dne4(b.y, e.y) << 20 |
                wx_dne4(b.z, e.z) << 24 | wx_dne4(b.w, e.w) << 28;
            if (m) {
                d4[0] = a;
                d4[1] = b;
            }
        } else {
            for (int k = 0; k < nb; k++) {
                const unsigned char x = s[k];
                if (x != d[k]) {
                    d[k] = x;
                    m |= 1u << k;
                }
            }
        }
        wx_set_bits(bits, r[i].bit0 + off, m);
    }
}

/* Word k (bits [32k, 32k + 32)) of the range of nbytes bits at bit0 of the bitmask, zero above
 * nbytes (the bitmask has a word past its last one). */
__device__ __forceinline__ wx_u32 wx_dword(const wx_u32 *bits, wx_u64 bit0, wx_u64 k, wx_u64 nbytes)
{
    if (32 * k >= nbytes)
        return 0;
    const wx_u64 b = bit0 + 32 * k;
    const int sh = (int)(b & 31);
    const wx_u32 lo = bits[b >> 5];
    wx_u32 w = sh ? __funnelshift_r(lo, bits[(b >> 5) + 1], sh) : lo;
    const wx_u64 rem = nbytes - 32 * k;
    if (rem < 32)
        w &= (1u << rem) - 1u;
    return w;
}

/* Exclusive prefix sum of x over the CTA (every thread calls it); *total gets the sum. */
__device__ __forceinline__ wx_u32 wx_dscan(wx_u32 x, wx_u32 *sm, wx_u32 *total)
{
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    wx_u32 v = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        wx_u32 y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o)
            v += y;
    }
    if (lane == 31)
        sm[wp] = v;
    __syncthreads();
    wx_u32 before = 0, all = 0;
#pragma unroll
    for (int k = 0; k < WX_DWARPS; k++) {
        const wx_u32 t = sm[k];
        before += k < wp ? t : 0;
        all += t;
    }
    __syncthreads(); /* sm free for the next call */
    *total = all;
    return before + v - x;
}

extern "C" __global__ void __launch_bounds__(WX_DTHREADS)
    wx_delta_count(const wx_delta_range *r, int n, wx_u64 nsegs, const wx_u32 *bits, wx_u32 *counts)
{
    __shared__ wx_u32 sm[WX_DWARPS];
    for (wx_u64 sg = blockIdx.x; sg < nsegs; sg += gridDim.x) {
        const int i = wx_dfind(r, n, sg);
        const wx_u64 k = (sg - r[i].seg0) * WX_DTHREADS + threadIdx.x;
        wx_u32 total;
        wx_dscan(__popc(wx_dword(bits, r[i].bit0, k, r[i].nbytes)), sm, &total);
        if (threadIdx.x == 0)
            counts[sg] = total;
    }
}

__device__ __forceinline__ wx_u64 wx_dpad8(wx_u64 x) { return (x + 7) & ~(wx_u64)7; }

extern "C" __global__ void __launch_bounds__(WX_DTHREADS)
    wx_delta_emit(const wx_delta_rec *r, int n, wx_u64 nsegs, const wx_u32 *bits,
                  const unsigned char *shadow, const wx_i64 *segx, unsigned char *out)
{
    __shared__ wx_u32 sm[WX_DWARPS];
    for (wx_u64 sg = blockIdx.x; sg < nsegs; sg += gridDim.x) {
        const int i = wx_dfind(r, n, sg);
        const wx_delta_rec rc = r[i];
        const wx_u64 s = sg - rc.seg0, k = s * WX_DTHREADS + threadIdx.x;
        unsigned char *rec = out + rc.out_off;
        if (s == 0 && threadIdx.x < 4) {
            const wx_u64 h[4] = {rc.head0, rc.doff, rc.nbytes, rc.count};
            ((wx_u64 *)rec)[threadIdx.x] = h[threadIdx.x];
        }
        wx_u32 w = wx_dword(bits, rc.bit0, k, rc.nbytes), total;
        const wx_u32 pre = wx_dscan(__popc(w), sm, &total);
        const wx_u64 pos = (wx_u64)(segx[rc.rseg0 + s] - segx[rc.rseg0]) + pre;
        unsigned char *pay = rec + 32;
        const bool mask = (rc.head0 >> 32) == 1;
        unsigned char *vals;
        wx_u32 *offs = 0;
        if (mask) {
            if (32 * k < rc.nbytes)
                ((wx_u32 *)pay)[k] = w;
            vals = pay + wx_dpad8((rc.nbytes + 7) / 8);
        } else {
            offs = (wx_u32 *)pay;
            vals = pay + wx_dpad8(4 * rc.count);
        }
        const unsigned char *src = shadow + rc.bit0 + 32 * k;
        for (wx_u64 q = pos; w; q++) {
            const int b = __ffs(w) - 1;
            w &= w - 1;
            vals[q] = src[b];
            if (offs)
                offs[q] = (wx_u32)(32 * k + b);
        }
    }
}

extern "C" __global__ void __launch_bounds__(WX_DTHREADS)
    wx_delta_scatter(const wx_delta_scat *r, int n, wx_u64 nsegs, const wx_u32 *bits,
                     const unsigned char *shadow)
{
    for (wx_u64 sg = blockIdx.x; sg < nsegs; sg += gridDim.x) {
        const int i = wx_dfind(r, n, sg);
        const wx_delta_scat rc = r[i];
        const wx_u64 k = (sg - rc.seg0) * WX_DTHREADS + threadIdx.x;
        wx_u32 w = wx_dword(bits, rc.bit0, k, rc.nbytes);
        if (!w)
            continue;
        const unsigned char *src = shadow + rc.bit0 + 32 * k;
        unsigned char *dst = (unsigned char *)rc.dst + 32 * k;
        if (w == 0xffffffffu && (((wx_u64)src | (wx_u64)dst) & 15) == 0) {
            const uint4 *s4 = (const uint4 *)src;
            uint4 *d4 = (uint4 *)dst;
            d4[0] = s4[0];
            d4[1] = s4[1];
            continue;
        }
        while (w) {
            const int b = __ffs(w) - 1;
            w &= w - 1;
            dst[b] = src[b];
        }
    }
}

/* ------------------------------------------------------------------ the receiver's apply */

#define WX_DAP_HEAD 1ull /* a head's region, encoding or range outside the registered memory */
#define WX_DAP_OVER 2ull /* a head or payload past the records' end */
#define WX_DAP_BAD 4ull  /* a malformed payload: changed > length, an offset, the mask's count */
#define WX_DAP_CAP 8ull  /* more segments than the launcher's counts hold */

struct wx_delta_recs {            /* = wx_delta_recs_t */
    wx_u64 rec, rec_nbytes, nrec; /* the records (8-aligned), their bytes, how many */
    wx_u64 regions, nregions;     /* {base address, nbytes} per region index */
    wx_u64 work;                  /* nrec wx_delta_ap, written by the walk */
    wx_u64 state;                 /* 8 u64 (zeroed): error bits, first bad record, segments,
                                     the walk's last head offset, changed bytes, 1 when the
                                     walk failed */
    wx_u64 counts, segx, cap;     /* u32[cap], i64[cap + 1]: the prefix sum of counts */
};

struct wx_delta_ap { /* the walk's entry of one record */
    wx_u64 seg0;     /* its first segment (wx_dfind) */
    wx_u64 pay;      /* its payload's first byte in the records */
    wx_u64 dst;      /* the address of its range */
    wx_u64 n, c, enc, head, nseg;
};

__device__ __forceinline__ void wx_dap_flag(wx_u64 *st, wx_u64 i, wx_u64 err)
{
    atomicOr(&st[0], err);
    atomicMin(&st[1], i);
}

/* Phase 0, one thread: the chain of heads (each record's size follows from its head). */
__device__ void wx_dap_walk(const wx_delta_recs &a, wx_u64 *st)
{
    const wx_u64 *reg = (const wx_u64 *)a.regions;
    wx_delta_ap *w = (wx_delta_ap *)a.work;
    const unsigned char *rec = (const unsigned char *)a.rec;
    wx_u64 p = 0, segs = 0, changed = 0, err = 0, i;
    for (i = 0; i < a.nrec; i++) {
        if (a.rec_nbytes < 32 || p > a.rec_nbytes - 32) {
            err = WX_DAP_OVER;
            break;
        }
        const wx_u64 *h = (const wx_u64 *)(rec + p);
        const wx_u64 h0 = h[0], doff = h[1], n = h[2], c = h[3];
        const wx_u64 region = h0 & 0xffffffffull, enc = h0 >> 32;
        if (region >= a.nregions || enc > 1 || n > reg[2 * region + 1] ||
            doff > reg[2 * region + 1] - n) {
            err = WX_DAP_HEAD;
            break;
        }
        if (c > n || (enc == 0 && n > (1ull << 32))) {
            err = WX_DAP_BAD;
            break;
        }
        const wx_u64 size = (enc == 0 ? wx_dpad8(4 * c) : wx_dpad8((n + 7) / 8)) + wx_dpad8(c);
        if (size > a.rec_nbytes - 32 - p) {
            err = WX_DAP_OVER;
            break;
        }
        wx_delta_ap e;
        e.seg0 = segs;
        e.pay = p + 32;
        e.dst = reg[2 * region] + doff;
        e.n = n;
        e.c = c;
        e.enc = enc;
        e.head = p;
        e.nseg = ((enc == 0 ? c : n) + WX_DSEG - 1) / WX_DSEG;
        w[i] = e;
        segs += e.nseg;
        changed += c;
        p += 32 + size;
    }
    if (!err && segs > a.cap)
        err = WX_DAP_CAP;
    st[1] = err ? i : ~0ull;
    st[2] = err ? 0 : segs;
    st[3] = p;
    st[4] = changed;
    st[5] = err ? 1 : 0; /* the walk's error: st[3] is the head it stopped at */
    st[0] = err;
}

/* Word k of a MASK record's bitmask, zero above its n bits (the bitmask is padded to 8). */
__device__ __forceinline__ wx_u32 wx_dap_word(const unsigned char *bits, wx_u64 k, wx_u64 n)
{
    if (32 * k >= n)
        return 0;
    wx_u32 w = ((const wx_u32 *)bits)[k];
    const wx_u64 rem = n - 32 * k;
    if (rem < 32)
        w &= (1u << rem) - 1u;
    return w;
}

/* A PAIRS segment: WX_DSEG pairs, strided over the threads (coalesced); phase 1 checks every
 * offset inside the range, phase 3 stores the values. */
__device__ __forceinline__ void wx_dap_pairs(const unsigned char *rec, const wx_delta_ap &r,
                                             wx_u64 s, int i, int phase, wx_u64 *st)
{
    const wx_u32 *offs = (const wx_u32 *)(rec + r.pay);
    const unsigned char *vals = rec + r.pay + wx_dpad8(4 * r.c);
    const wx_u64 end = r.c < (s + 1) * WX_DSEG ? r.c : (s + 1) * WX_DSEG;
    if (phase == 1) {
        int bad = 0;
        for (wx_u64 j = s * WX_DSEG + threadIdx.x; j < end; j += WX_DTHREADS)
            bad |= offs[j] >= r.n;
        if (bad)
            wx_dap_flag(st, (wx_u64)i, WX_DAP_BAD);
        return;
    }
    /* four pairs a thread loaded before their stores (a byte store may alias the loads
     * otherwise; the records are read-only here: not the regions' memory) */
    unsigned char *dst = (unsigned char *)r.dst;
    for (wx_u64 j = s * WX_DSEG + threadIdx.x; j < end; j += 4 * WX_DTHREADS) {
        wx_u32 o[4];
        unsigned char v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const wx_u64 jj = j + (wx_u64)u * WX_DTHREADS;
            o[u] = jj < end ? __ldg(offs + jj) : 0;
            v[u] = jj < end ? __ldg(vals + jj) : 0;
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (j + (wx_u64)u * WX_DTHREADS < end)
                dst[o[u]] = v[u];
    }
}

extern "C" __global__ void __launch_bounds__(WX_DTHREADS)
    wx_delta_apply(const wx_delta_recs a, int phase)
{
    __shared__ wx_u32 sm[WX_DWARPS];
    __shared__ wx_u64 err;
    wx_u64 *st = (wx_u64 *)a.state;
    if (phase == 0) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            wx_dap_walk(a, st);
        return;
    }
    if (threadIdx.x == 0) /* one answer for the whole CTA: the scans below sync its threads */
        err = *(volatile wx_u64 *)st;
    __syncthreads();
    if (err)
        return;
    const wx_delta_ap *w = (const wx_delta_ap *)a.work;
    const unsigned char *rec = (const unsigned char *)a.rec;
    const wx_i64 *segx = (const wx_i64 *)a.segx;
    if (phase == 2) { /* each MASK record holds its count of bits */
        for (wx_u64 i = (wx_u64)blockIdx.x * WX_DTHREADS + threadIdx.x; i < a.nrec;
             i += (wx_u64)gridDim.x * WX_DTHREADS)
            if (w[i].enc == 1 && (wx_u64)(segx[w[i].seg0 + w[i].nseg] - segx[w[i].seg0]) != w[i].c)
                wx_dap_flag(st, i, WX_DAP_BAD);
        return;
    }
    const wx_u64 nsegs = st[2];
    for (wx_u64 sg = blockIdx.x; sg < nsegs; sg += gridDim.x) {
        const int i = wx_dfind(w, (int)a.nrec, sg);
        const wx_delta_ap r = w[i];
        const wx_u64 s = sg - r.seg0;
        if (r.enc == 1) { /* MASK: one bitmask word a thread, its values after the scan */
            const wx_u64 k = s * WX_DTHREADS + threadIdx.x;
            wx_u32 m = wx_dap_word(rec + r.pay, k, r.n), total;
            const wx_u32 pre = wx_dscan(__popc(m), sm, &total);
            if (phase == 1) {
                if (threadIdx.x == 0)
                    ((wx_u32 *)a.counts)[sg] = total;
                continue;
            }
            const unsigned char *vals = rec + r.pay + wx_dpad8((r.n + 7) / 8);
            unsigned char *dst = (unsigned char *)r.dst + 32 * k;
            for (wx_u64 q = (wx_u64)(segx[sg] - segx[r.seg0]) + pre; m; q++) {
                const int b = __ffs(m) - 1;
                m &= m - 1;
                dst[b] = __ldg(vals + q);
            }
            continue;
        }
        wx_dap_pairs(rec, r, s, i, phase, st);
        if (phase == 1 && threadIdx.x == 0)
            ((wx_u32 *)a.counts)[sg] = 0;
    }
}
