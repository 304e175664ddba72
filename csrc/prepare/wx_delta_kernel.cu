/* wx_delta_kernel.cu - delta pushes (issue 36): block-FP8 quantization fused with the compare
 * against the shadow (what the trainer last wrote) and the shadow's update, in one pass.
 *
 * Compiled with NVRTC at first use by wx_delta.c, like the FP8 kernel, from whose source it is
 * made: it includes wx_fp8_kernel.cu (and so wx_fp8_pipe.cu) and wx_dev.cuh (wx_delta.c hands
 * them to NVRTC as in-memory headers) and reuses its tile code (loads, amax, scale, division,
 * e4m3 conversion) and its persistent loop's ring of tile buffers, so the bytes are the FP8 kernel's, bit for
 * bit. Only the stores differ: `out` is the shadow, holding the bytes of the last push; each
 * thread reads the old bytes of its chunk (before the tile's amax reduction, so that the load
 * overlaps it; 16, 8 or 4 bytes at a time as the piece's rows are aligned), writes the chunk
 * (the words holding a changed byte, where only 4-aligned) only where a byte differs, and sets
 * bit i of the bitmask `bits` (u32 words, little-endian bit order, zeroed by the caller) for
 * every byte i of out that changed, fp8 bytes and scales alike. The records are made from the
 * bitmask and the updated shadow by wx_delta_ops_kernel.cu.
 *
 * Per element of a BF16 source this kernel reads 2 bytes (the source) and 1 (the old shadow
 * byte) and writes only the 16-byte chunks holding a changed byte (DRAM writes whole 32-byte
 * sectors) plus the bitmask's words of those chunks; the dense quantizer reads 2 and writes 1
 * (docs/delta.md works out the bound). Switches (wx_delta.c passes the product's, 0 and 0 as
 * the #ifndef defaults below; a WXFER_KERNEL_SWEEP build compiles the others from this same
 * file, wx_sweep.c, for benchmarks/bench_fused_variants.py):
 *   WX_DPF   how the old bytes of a tile are fetched ahead, when the tile is put in the ring
 *            (WX_STAGES - 1 tiles ahead: wx_fp8_pipe.cu's WX_RING_HOOK): 0 not at all (loaded
 *            from global memory when the tile is quantized, before its amax reduction); 1 its
 *            shadow rows and scale prefetched into L2 (the loads then hit L2); 2 its shadow
 *            rows copied by cp.async into a second ring of WX_STAGES 16 KiB buffers after the
 *            tiles' (the launch's shared memory is WX_STAGES x 48 KiB), read from there, for
 *            16-bit sources whose shadow rows are 16-byte aligned (else as 0); 3 as 1, but
 *            one tile ahead only (the next tile's, when the current one starts: less time for
 *            the lines to leave L2 than WX_STAGES - 1 tiles ahead); 4 as 2, but one tile ahead
 *            into one 16 KiB buffer (the launch's shared memory is WX_STAGES x 32 KiB + 16 KiB,
 *            2 CTAs x 112 KiB a H100 SM, so the ring keeps its 3 tiles; too much for sm_89's
 *            100 KiB): each thread copies exactly the 4 chunks it compares (its own slots, no
 *            barrier), its own group committed after the barrier of the current tile and before
 *            the ring's next copies, so the ring's wait (WX_STAGES 3) covers it; the current
 *            tile's old bytes go from the slots to registers just before the next tile's copies
 *            overwrite them (t.ahead in wx_fp8_pipe.cu's loop);
 *   WX_DPAIR 1: the two threads of 32 adjacent bytes of a tile row merge their 16-bit masks
 *            (one shuffle) into one 32-bit OR: half the bitmask atomics (one per word where the
 *            shadow's rows are 32-aligned).
 *   WX_DBITS 16-bit sources whose rows start 32-aligned in the shadow ((offset | pitch) % 32
 *            == 0: every bitmask word of a tile row's bytes is that row's alone): the 8 threads
 *            of a tile row gather its 128 bits by shuffles (wx_dbits_row) and write the words
 *            with plain stores, no atomics: one 16-byte store by the row's first thread where
 *            the row is 128 bytes at a 128-aligned offset, else a 4-byte store per word by
 *            every second thread (an atomic OR for a word the row only partly holds, at a
 *            right edge). 1: only the words holding a changed byte are written; 2: every word
 *            the tile row owns, zeros too (full 32-byte sectors of the bitmask, no read of
 *            its old sectors, two tiles' rows a sector; a word left zero by the caller's
 *            clearing gets the same value either way). Other tiles (unaligned rows, float32
 *            sources, the scales) take WX_DPAIR's path.
 * WX_MINB (CTAs per SM) and WX_STAGES (ring buffers per CTA) come from the launch shape.
 */
#ifndef WX_DPF
#define WX_DPF 0
#endif
#ifndef WX_DPAIR
#define WX_DPAIR 0
#endif
#ifndef WX_DBITS
#define WX_DBITS 0
#endif
#define WX_SCH (128 * 128 / 16) /* 16-byte chunks of a tile's shadow bytes (WX_DPF 2, 4) */
#if WX_DPF == 4 && WX_STAGES != 3
#error "WX_DPF 4 counts on the ring's wait of WX_STAGES 3 (cp.async.wait_group 1)"
#endif

struct wx_job;
__device__ __forceinline__ void wx_dring_hook(const wx_job &j, int s, uint4 *ring);
#define WX_RING_HOOK(j, s, ring) wx_dring_hook(j, s, ring)
#include "wx_fp8_kernel.cu"
#include "wx_dev.cuh" /* wx_set_bits */

/* Are tile j's old bytes copied into shared memory (WX_DPF 2, 4)? */
__device__ __forceinline__ bool wx_dsmem(const wx_job &j)
{
    return (WX_DPF == 2 || WX_DPF == 4) && j.dst && j.salign == 0 && j.dt != 2;
}

/* Stage s's shadow buffer (WX_DPF 2; WX_DPF 4: s 0, the one buffer), after the WX_STAGES tile
 * buffers. */
__device__ __forceinline__ uint4 *wx_dbuf(uint4 *ring, int s)
{
    return ring + WX_STAGES * WX_TCH + s * WX_SCH;
}

/* Tile j's shadow rows (nr rows of nc bytes at dst, pitch apart, any alignment) and scale into
 * L2: thread t takes row t % 128 at byte offsets 0 and 64 (t < 128) or 32, 96 and nc - 1
 * (t >= 128), every 32-byte sector the row touches. */
__device__ __forceinline__ void wx_dprefetch(const wx_job &j)
{
    const int row = threadIdx.x & 127, half = threadIdx.x >> 7;
    if (j.dst && row < j.nr) {
        const unsigned char *r = j.dst + (wx_i64)row * j.pitch;
        for (int o = 32 * half; o < j.nc; o += 64)
            asm volatile("prefetch.L2 [%0];" ::"l"(r + o));
        if (half)
            asm volatile("prefetch.L2 [%0];" ::"l"(r + j.nc - 1));
    }
    if (threadIdx.x == 0 && j.sp)
        asm volatile("prefetch.L2 [%0];" ::"l"(j.sp));
}

/* Tile j's old bytes into the shadow buffer buf by cp.async (wx_dsmem(j)): chunk q = p*256 + t
 * (row q / 8, chunk q % 8 of the row: the chunk thread t compares, wx_dtile16) at buf[q],
 * zero-filled outside [nr, nc). */
__device__ __forceinline__ void wx_dfill(const wx_job &j, uint4 *buf)
{
    const int c = threadIdx.x % 8, row0 = threadIdx.x / 8;
    const int nb = 16 * c < j.nc ? min(16, j.nc - 16 * c) : 0;
    wx_u32 d = wx_saddr(buf + threadIdx.x);
#pragma unroll
    for (int p = 0; p < WX_SCH / WX_THREADS; p++) {
        const int row = p * (WX_THREADS / 8) + row0;
        const bool in = row < j.nr && nb;
        const unsigned char *g = j.dst + (wx_i64)(in ? row : 0) * j.pitch + 16 * c;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d),
                     "l"(in ? g : j.dst), "r"(in ? nb : 0)
                     : "memory");
        d += WX_THREADS * 16;
    }
}

/* The tile's old bytes fetched ahead when it is put in the ring (WX_DPF). 1: into L2
 * (wx_dprefetch). 2: into stage s's shadow buffer (wx_dfill), in the commit group of the tile's
 * own copies. */
__device__ __forceinline__ void wx_dring_hook(const wx_job &j, int s, uint4 *ring)
{
    if (WX_DPF == 1)
        wx_dprefetch(j);
    else if (WX_DPF == 2 && wx_dsmem(j))
        wx_dfill(j, wx_dbuf(ring, s));
}

/* Bit k set when byte k of x and y differ (nb <= 8 bytes looked at). */
__device__ __forceinline__ wx_u32 wx_ne8(wx_u64 x, wx_u64 y, int nb)
{
    wx_u64 d = x ^ y;
    wx_u32 m = 0;
#pragma unroll
    for (int k = 0; k < 8; k++)
        if (k < nb && ((d >> (8 * k)) & 0xffu))
            m |= 1u << k;
    return m;
}

/* The widest access p's alignment allows: al is 16, 8, 4 or 1 (p al-byte aligned). */
__device__ __forceinline__ int wx_align_of(int salign)
{
    return salign == 0 ? 16 : (salign & 7) == 0 ? 8 : (salign & 3) == 0 ? 4 : 1;
}

/* The nb (<= 16) bytes at p as two little-endian u64 (zero above nb), read 16, 8 or 4 bytes at
 * a time where p is al-byte aligned (al from wx_align_of; with al >= 4, nb is a multiple of 4:
 * the rows' length is). Plain loads: this thread writes them afterwards. */
__device__ __forceinline__ void wx_old16(const unsigned char *p, int nb, int al, wx_u64 &lo,
                                         wx_u64 &hi)
{
    if (al == 16 && nb == 16) {
        uint4 o = *(const uint4 *)p;
        lo = (wx_u64)o.x | ((wx_u64)o.y << 32);
        hi = (wx_u64)o.z | ((wx_u64)o.w << 32);
        return;
    }
    if (al >= 8 && nb == 16) {
        lo = ((const wx_u64 *)p)[0];
        hi = ((const wx_u64 *)p)[1];
        return;
    }
    lo = hi = 0;
    if (al >= 4) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (4 * k < nb) {
                const wx_u64 w = ((const wx_u32 *)p)[k];
                if (k < 2)
                    lo |= w << (32 * k);
                else
                    hi |= w << (32 * (k - 2));
            }
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < 16; k++) {
        if (k < nb) {
            wx_u64 b = p[k];
            if (k < 8)
                lo |= b << (8 * k);
            else
                hi |= b << (8 * (k - 8));
        }
    }
}

/* Write the bytes of lo:hi that m marks (bit k: byte k, only below nb <= 16) at p: the whole
 * chunk where it is 16 bytes at a 16- or 8-aligned p (al), the 4-byte words holding a marked
 * byte where al >= 4, else the marked bytes. */
__device__ __forceinline__ void wx_put16(unsigned char *p, int nb, int al, wx_u32 m, wx_u64 lo,
                                         wx_u64 hi)
{
    if (al == 16 && nb == 16) {
        *(uint4 *)p = make_uint4((wx_u32)lo, (wx_u32)(lo >> 32), (wx_u32)hi, (wx_u32)(hi >> 32));
        return;
    }
    if (al >= 8 && nb == 16) {
        ((wx_u64 *)p)[0] = lo;
        ((wx_u64 *)p)[1] = hi;
        return;
    }
    if (al >= 4) {
#pragma unroll
        for (int k = 0; k < 4; k++)
            if ((m >> (4 * k)) & 0xfu)
                ((wx_u32 *)p)[k] = (wx_u32)((k < 2 ? lo : hi) >> (32 * (k & 1)));
        return;
    }
#pragma unroll
    for (int k = 0; k < 16; k++)
        if (m & (1u << k))
            p[k] = (unsigned char)((k < 8 ? lo >> (8 * k) : hi >> (8 * (k - 8))) & 0xffu);
}

/* The tile's scale: before it is written, thread 0 reads the old one (old_s); after, marks
 * its changed bytes. */
__device__ __forceinline__ wx_u32 wx_old_scale(const wx_job &j)
{
    wx_u32 b = 0;
    if (threadIdx.x == 0 && j.sp)
        for (int k = 0; k < 4; k++)
            b |= (wx_u32)j.sp[k] << (8 * k);
    return b;
}

__device__ __forceinline__ void wx_mark_scale(const wx_job &j, float s, wx_u32 old,
                                              const unsigned char *out, wx_u32 *bits)
{
    if (threadIdx.x == 0 && j.sp)
        wx_set_bits(bits, (wx_u64)(j.sp - out), wx_ne8(__float_as_uint(s), old, 4));
}

/* WX_DBITS: the bitmask words of the tile row whose 16-byte chunk `col` (bytes [pos, pos + 16)
 * of the shadow, d its changed bytes) this thread holds; lanes 8r .. 8r+7 of the warp hold the
 * row's chunks 0 .. 7 (all 32 lanes call it, d 0 outside the tile). own: the tile's rows start
 * 32-aligned in the shadow; in: the row is inside the tile; nc: the row's bytes. */
__device__ __forceinline__ void wx_dbits_row(wx_u32 *bits, wx_u64 pos, wx_u32 d, int col, int nc,
                                             bool own, bool in)
{
    const wx_u32 w = d | (__shfl_down_sync(0xffffffffu, d, 1) << 16); /* even lanes: 32 bytes */
    const wx_u32 w1 = __shfl_down_sync(0xffffffffu, w, 2), w2 = __shfl_down_sync(0xffffffffu, w, 4);
    const wx_u32 w3 = __shfl_down_sync(0xffffffffu, w, 6);
    if (!own) { /* as WX_DPAIR 1 */
        if (!(threadIdx.x & 1))
            wx_set_bits(bits, pos, w);
        return;
    }
    if (!in || (threadIdx.x & 1))
        return;
    if (nc == WX_TILE && (((pos - col) | ((wx_u64)bits << 3)) & 127) == 0) { /* 16 bytes */
        if (col == 0 && (WX_DBITS == 2 || (w | w1 | w2 | w3)))
            *(uint4 *)(bits + (pos >> 5)) = make_uint4(w, w1, w2, w3);
    } else if (col + 32 <= nc) { /* a whole word of the row */
        if (WX_DBITS == 2 || w)
            bits[pos >> 5] = w;
    } else if (w) { /* the row's last bytes: the word's others are the next row's */
        atomicOr(bits + (pos >> 5), w);
    }
}

/* wx_tile16's work into the shadow: quantize, compare, write the changed chunks, mark them. */
template <int DT>
__device__ __forceinline__ void wx_dtile16(const wx_job &j, const uint4 *v, wx_u32 *red,
                                           const unsigned char *out, wx_u32 *bits, const uint4 *osh,
                                           const uint4 *old4)
{
    const int tid = threadIdx.x, col = (tid % wx_g16::TPR) * wx_g16::SPAN;
    const int row0 = tid / wx_g16::TPR;
    const int al = wx_align_of(j.salign);
    wx_u64 olo[wx_g16::NP], ohi[wx_g16::NP];
    const wx_u32 old_s = wx_old_scale(j);
    const int nb = min(16, j.nc - col);
#pragma unroll
    for (int p = 0; p < wx_g16::NP; p++) { /* the old bytes, loaded before the reduction */
        const int row = p * wx_g16::RPP + row0;
        olo[p] = ohi[p] = 0;
        if (wx_dsmem(j) && row < j.nr && nb > 0) { /* zero-filled above nb, as wx_old16 */
            const uint4 o = WX_DPF == 4 ? old4[p] : osh[row * (WX_TILE / 16) + tid % wx_g16::TPR];
            olo[p] = (wx_u64)o.x | ((wx_u64)o.y << 32);
            ohi[p] = (wx_u64)o.z | ((wx_u64)o.w << 32);
        } else if (j.dst && row < j.nr && nb > 0) {
            wx_old16(j.dst + (wx_i64)row * j.pitch + col, nb, al, olo[p], ohi[p]);
        }
    }
    wx_u32 m = 0;
#pragma unroll
    for (int c = 0; c < WX_NCH; c++)
        m = wx_amax_bits<2>(m, v[c]);
    m = max(m & 0xffffu, m >> 16);
    const float s = wx_block_scale<DT>(m, j, red);
    wx_mark_scale(j, s, old_s, out, bits);
    const wx_divisor dv = wx_divisor_of<2>(s);
    if (!j.dst)
        return;
    const bool own = ((wx_u64)(j.dst - out) & 31) == 0 && (j.pitch & 31) == 0; /* WX_DBITS */
#pragma unroll
    for (int p = 0; p < wx_g16::NP; p++) {
        const int row = p * wx_g16::RPP + row0;
        unsigned char *q = j.dst + (wx_i64)row * j.pitch + col;
        wx_u32 d = 0;
        if (row < j.nr && nb > 0) {
            const wx_u64 a = wx_quant<2, DT>(v[2 * p], dv), b = wx_quant<2, DT>(v[2 * p + 1], dv);
            if (a != olo[p] || (nb > 8 && b != ohi[p]))
                d = wx_ne8(a, olo[p], min(nb, 8)) | (wx_ne8(b, ohi[p], nb - 8) << 8);
            if (d)
                wx_put16(q, nb, al, d, a, b);
        }
        if (WX_DBITS) {
            wx_dbits_row(bits, (wx_u64)(q - out), d, col, j.nc, own, row < j.nr);
        } else if (WX_DPAIR) { /* lanes 2i, 2i+1: bytes [0, 16) and [16, 32) from q of lane 2i */
            const wx_u32 o = __shfl_down_sync(0xffffffffu, d, 1);
            if (!(tid & 1))
                wx_set_bits(bits, (wx_u64)(q - out), d | (o << 16));
        } else {
            wx_set_bits(bits, (wx_u64)(q - out), d);
        }
    }
}

/* wx_tile32's work into the shadow (float32 sources, read twice). */
__device__ __forceinline__ void wx_dtile32(const wx_job &j, wx_u32 *red, const unsigned char *out,
                                           wx_u32 *bits)
{
    typedef wx_geom<4> G;
    const int tid = threadIdx.x, col = (tid % G::CPR) * G::VEC, row0 = tid / G::CPR;
    const wx_u32 old_s = wx_old_scale(j);
    wx_u32 m = 0;
#pragma unroll
    for (int p = 0; p < G::NP; p++)
        m = wx_amax_bits<4>(m,
                            wx_load<4>(j.src, j.ldb, p * G::RPP + row0, col, j.nr, j.nc, j.lvec));
    const float s = wx_block_scale<2>(m, j, red);
    wx_mark_scale(j, s, old_s, out, bits);
    const wx_divisor dv = wx_divisor_of<4>(s);
    if (!j.dst)
        return;
    const int nb = min(4, j.nc - col);
#pragma unroll 4
    for (int p = 0; p < G::NP; p++) {
        const int row = p * G::RPP + row0;
        if (row >= j.nr || nb <= 0)
            continue;
        uint4 c = wx_load<4>(j.src, j.ldb, row, col, j.nr, j.nc, j.lvec);
        const wx_u64 q = wx_quant<4, 2>(c, dv) & 0xffffffffull;
        unsigned char *pp = j.dst + (wx_i64)row * j.pitch + col;
        wx_u64 olo, ohi;
        wx_old16(pp, nb, wx_align_of(j.salign) >= 4 ? 4 : 1, olo, ohi);
        const wx_u32 d = wx_ne8(q, olo, nb);
        if (!d)
            continue;
        wx_put16(pp, nb, wx_align_of(j.salign) >= 4 ? 4 : 1, d, q, 0);
        wx_set_bits(bits, (wx_u64)(pp - out), d);
    }
}

/* The delta kernel's tile code for wx_ring_loop: out is the shadow, bits the bitmask. */
struct wx_delta_tiles {
    const unsigned char *out;
    wx_u32 *bits;
    mutable uint4 old4[wx_g16::NP]; /* WX_DPF 4: the current tile's old bytes, from the slots */
    /* WX_DPF 4: the CTA's first tile's old bytes into the slots, before the ring's copies */
    __device__ __forceinline__ void first(const wx_fp8_piece *pieces, const wx_fp8_inline &inl,
                                          int n, unsigned char *shadow, wx_i64 t0,
                                          uint4 *ring) const
    {
        if (WX_DPF == 4) {
            wx_job j0;
            wx_job_of(pieces, inl, n, t0, shadow, j0);
            if (wx_dsmem(j0))
                wx_dfill(j0, wx_dbuf(ring, 0));
            wx_ring_commit();
        }
    }
    /* WX_DPF 4: the current tile's old bytes (this thread's slots, its own copies waited for)
     * into registers, then the next tile's into the same slots (more: there is one) */
    __device__ __forceinline__ void ahead(const wx_job *cur, const wx_job *nxt, bool more,
                                          uint4 *ring) const
    {
        if (WX_DPF == 4) {
            const uint4 *b = wx_dbuf(ring, 0) + threadIdx.x;
            if (wx_dsmem(*cur)) {
#pragma unroll
                for (int p = 0; p < wx_g16::NP; p++)
                    old4[p] = b[p * WX_THREADS];
            }
            if (more && wx_dsmem(*nxt))
                wx_dfill(*nxt, wx_dbuf(ring, 0));
            wx_ring_commit();
        }
    }
    /* WX_DPF 3: the CTA's next tile's old bytes into L2 when the current one starts */
    __device__ __forceinline__ void next(const wx_fp8_piece *pieces, const wx_fp8_inline &inl,
                                         int n, unsigned char *shadow, int ntiles, wx_i64 t) const
    {
        if (WX_DPF == 3 && t < ntiles) {
            wx_job nj;
            wx_job_of(pieces, inl, n, t, shadow, nj);
            wx_dprefetch(nj);
        }
    }
    __device__ __forceinline__ void tile32(const wx_job &j, wx_u32 *red) const
    {
        wx_dtile32(j, red, out, bits);
    }
    template <int DT>
    __device__ __forceinline__ void tile16(const wx_job &j, const uint4 *v, wx_u32 *red,
                                           uint4 *ring, int s) const
    {
        wx_dtile16<DT>(j, v, red, out, bits, wx_dbuf(ring, s), old4);
    }
};

/* wx_fp8_quant's persistent loop (wx_fp8_pipe.cu) over the delta tiles; bits: the bitmask. */
extern "C" __global__ void __launch_bounds__(WX_THREADS, WX_MINB)
    wx_delta_quant(const wx_fp8_piece *pieces, int n, unsigned char *out, int ntiles,
                   const __grid_constant__ wx_fp8_inline inl, wx_u32 *bits)
{
    const wx_delta_tiles t = {out, bits, {}};
    WX_RING_SHARED;
    wx_ring_loop(pieces, n, out, ntiles, inl, t, ring, jobs, red);
}
