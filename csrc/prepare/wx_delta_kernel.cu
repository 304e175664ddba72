/* wx_delta_kernel.cu - delta pushes (issue 36): block-FP8 quantization fused with the compare
 * against the shadow (what the trainer last wrote) and the shadow's update, in one pass.
 *
 * Compiled with NVRTC at first use by wx_delta.c, like the FP8 kernel, from whose source it is
 * made: it includes wx_fp8_kernel.cu (and so wx_fp8_pipe.cu) and wx_dev.cuh (wx_delta.c hands
 * them to NVRTC as in-memory headers) and reuses its tile code (loads, amax, scale, division, e4m3 conversion)
 * and its persistent loop's ring of tile buffers, so the bytes are the FP8 kernel's, bit for
 * bit. Only the stores differ: `out` is the shadow, holding the bytes of the last push; each
 * thread reads the old bytes of its chunk (before the tile's amax reduction, so that the load
 * overlaps it), writes the chunk only where a byte differs, and sets bit i of the bitmask
 * `bits` (u32 words, little-endian bit order, zeroed by the caller) for every byte i of out
 * that changed, fp8 bytes and scales alike. The records are made from the bitmask and the
 * updated shadow by wx_delta_ops_kernel.cu.
 */
#include "wx_fp8_kernel.cu"
#include "wx_dev.cuh" /* wx_set_bits */

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

/* The nb (<= 16) bytes at p as two little-endian u64 (zero above nb); v16: p 16-aligned. */
__device__ __forceinline__ void wx_old16(const unsigned char *p, int nb, bool v16, wx_u64 &lo,
                                         wx_u64 &hi)
{
    if (v16 && nb == 16) {
        uint4 o = *(const uint4 *)p; /* plain load: written below by this thread */
        lo = (wx_u64)o.x | ((wx_u64)o.y << 32);
        hi = (wx_u64)o.z | ((wx_u64)o.w << 32);
        return;
    }
    lo = hi = 0;
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

/* Write the bytes of lo:hi that m marks (bit k: byte k) at p, nb <= 16 valid; v16: p aligned. */
__device__ __forceinline__ void wx_put16(unsigned char *p, int nb, bool v16, wx_u32 m, wx_u64 lo,
                                         wx_u64 hi)
{
    if (v16 && nb == 16) {
        *(uint4 *)p = make_uint4((wx_u32)lo, (wx_u32)(lo >> 32), (wx_u32)hi, (wx_u32)(hi >> 32));
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

/* wx_tile16's work into the shadow: quantize, compare, write the changed chunks, mark them. */
template <int DT>
__device__ __forceinline__ void wx_dtile16(const wx_job &j, const uint4 *v, wx_u32 *red,
                                           const unsigned char *out, wx_u32 *bits)
{
    const int tid = threadIdx.x, col = (tid % wx_g16::TPR) * wx_g16::SPAN;
    const int row0 = tid / wx_g16::TPR;
    const bool v16 = j.salign == 0;
    wx_u64 olo[wx_g16::NP], ohi[wx_g16::NP];
    const wx_u32 old_s = wx_old_scale(j);
    const int nb = min(16, j.nc - col);
#pragma unroll
    for (int p = 0; p < wx_g16::NP; p++) { /* the old bytes, loaded before the reduction */
        const int row = p * wx_g16::RPP + row0;
        olo[p] = ohi[p] = 0;
        if (j.dst && row < j.nr && nb > 0)
            wx_old16(j.dst + (wx_i64)row * j.pitch + col, nb, v16, olo[p], ohi[p]);
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
#pragma unroll
    for (int p = 0; p < wx_g16::NP; p++) {
        const int row = p * wx_g16::RPP + row0;
        if (row >= j.nr || nb <= 0)
            continue;
        const wx_u64 a = wx_quant<2, DT>(v[2 * p], dv), b = wx_quant<2, DT>(v[2 * p + 1], dv);
        if (a == olo[p] && (nb <= 8 || b == ohi[p]))
            continue;
        const wx_u32 d = wx_ne8(a, olo[p], min(nb, 8)) | (wx_ne8(b, ohi[p], nb - 8) << 8);
        if (!d)
            continue;
        unsigned char *q = j.dst + (wx_i64)row * j.pitch + col;
        wx_put16(q, nb, v16, d, a, b);
        wx_set_bits(bits, (wx_u64)(q - out), d);
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
        wx_old16(pp, nb, false, olo, ohi);
        const wx_u32 d = wx_ne8(q, olo, nb);
        if (!d)
            continue;
        wx_put16(pp, nb, false, d, q, 0);
        wx_set_bits(bits, (wx_u64)(pp - out), d);
    }
}

/* The delta kernel's tile code for wx_ring_loop: out is the shadow, bits the bitmask. */
struct wx_delta_tiles {
    const unsigned char *out;
    wx_u32 *bits;
    __device__ __forceinline__ void tile32(const wx_job &j, wx_u32 *red) const
    {
        wx_dtile32(j, red, out, bits);
    }
    template <int DT>
    __device__ __forceinline__ void tile16(const wx_job &j, const uint4 *v, wx_u32 *red) const
    {
        wx_dtile16<DT>(j, v, red, out, bits);
    }
};

/* wx_fp8_quant's persistent loop (wx_fp8_pipe.cu) over the delta tiles; bits: the bitmask. */
extern "C" __global__ void __launch_bounds__(WX_THREADS, WX_MINB)
    wx_delta_quant(const wx_fp8_piece *pieces, int n, unsigned char *out, int ntiles,
                   const __grid_constant__ wx_fp8_inline inl, wx_u32 *bits)
{
    const wx_delta_tiles t = {out, bits};
    WX_RING_SHARED;
    wx_ring_loop(pieces, n, out, ntiles, inl, t, ring, jobs, red);
}
