/* wx_fp8_kernel.cu - block-FP8 (e4m3) quantization of many 2-D pieces in one launch.
 *
 * This file is not compiled by setup.py: setup.py embeds it as a string into the extension
 * and wx_fp8.c compiles it with NVRTC at first use, for the architecture of the device
 * (docs/prepare.md says why). It includes no header, so that it compiles with any NVRTC;
 * `nvcc -arch=sm_90 --ptx csrc/prepare/wx_fp8_kernel.cu` checks it by hand.
 *
 * The bytes are those of wxfer.mapping.reference.quantize_fp8_block, bit for bit: per
 * 128x128 tile of a piece (the tile grid starts at the piece's first row and column),
 * amax = max |w| in float32 (NaN propagates), scale = max(amax, 1e-12f) / 448 (IEEE
 * division), q = clamp(w / scale, -448, 448) rounded to float8_e4m3fn, nearest-even.
 *
 * One CTA of 256 threads per tile. A thread owns 64 elements: NP chunks of 16 bytes
 * (8 bf16/fp16 or 4 float32), chunk c of pass p at row p*RPP + tid/CPR, column
 * (tid%CPR)*VEC of the tile, so that a warp reads 512 contiguous bytes per pass. The amax
 * is taken on the raw bits (|x| of IEEE formats orders like an unsigned integer, NaN above
 * inf), reduced by warp and through shared memory. 16-bit sources stay in registers for the
 * second pass; float32 sources are read again (from L1/L2) to keep registers low.
 */

typedef unsigned int wx_u32;
typedef unsigned short wx_u16;
typedef long long wx_i64;
typedef unsigned long long wx_u64;

/* Must match wx_fp8_piece_t in wx_fp8.h (8 x 64-bit). */
struct wx_fp8_piece {
    wx_u64 src;   /* device address of element [0, 0] */
    wx_i64 dtype; /* 0 bfloat16, 1 float16, 2 float32 */
    wx_i64 ld;    /* elements between rows */
    wx_i64 rows, cols;
    wx_i64 q_off; /* byte offset of the rows*cols fp8 bytes in out, or -1 */
    wx_i64 s_off; /* byte offset of the float32 scales [ceil(rows/128), ceil(cols/128)], or -1 */
    wx_i64 tile0; /* index of the piece's first tile in the launch (increasing) */
};

#define WX_TILE 128
#define WX_THREADS 256
#ifndef WX_MINB
#define WX_MINB 4 /* CTAs per SM the register budget allows (wx_fp8.c may set it) */
#endif
#define WX_WARPS (WX_THREADS / 32)

__device__ __forceinline__ float wx_f16_to_f32(wx_u32 h)
{
    float f;
    wx_u16 s = (wx_u16)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

/* float32 of the 16- or 32-bit element held in the low bits of `bits`. */
template <int DT> __device__ __forceinline__ float wx_to_f32(wx_u32 bits)
{
    if (DT == 0)
        return __uint_as_float(bits << 16);
    if (DT == 1)
        return wx_f16_to_f32(bits);
    return __uint_as_float(bits);
}

/* IEEE round-to-nearest division, whatever the compile flags. */
__device__ __forceinline__ float wx_div_rn(float a, float b)
{
    float q;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
    return q;
}

/* Two e4m3 bytes: lo goes to the low byte. satfinite clamps to +-448 exactly as the
 * reference's clamp does (and keeps NaN a NaN). */
__device__ __forceinline__ wx_u32 wx_e4m3x2(float lo, float hi)
{
    wx_u16 d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

template <int ES> struct wx_geom {
    static const int VEC = 16 / ES;             /* elements per 16-byte chunk */
    static const int CPR = WX_TILE / VEC;       /* chunks per tile row */
    static const int RPP = WX_THREADS / CPR;    /* rows per pass */
    static const int NP = WX_TILE / RPP;        /* passes (chunks per thread) */
};

/* The chunk at (row, col) of the tile starting at `base` (row pitch ldb bytes), zeros
 * outside [nr, nc). vec: the source rows are 16-byte aligned. */
template <int ES>
__device__ __forceinline__ uint4 wx_load(const char *base, wx_i64 ldb, int row, int col, int nr,
                                         int nc, bool vec)
{
    const int VEC = wx_geom<ES>::VEC;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row >= nr || col >= nc)
        return v;
    const char *p = base + (wx_i64)row * ldb + (wx_i64)col * ES;
    if (vec && col + VEC <= nc)
        return __ldg((const uint4 *)p);
    wx_u32 w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        if (col + j < nc) {
            if (ES == 2)
                w[j >> 1] |= (wx_u32)__ldg((const wx_u16 *)p + j) << ((j & 1) * 16);
            else
                w[j] = __ldg((const wx_u32 *)p + j);
        }
    }
    v.x = w[0];
    v.y = w[1];
    v.z = w[2];
    v.w = w[3];
    return v;
}

/* max |x| so far of the chunk's elements, as raw magnitude bits. */
template <int ES> __device__ __forceinline__ wx_u32 wx_amax_bits(wx_u32 m, uint4 v)
{
    if (ES == 2) {
        m = __vmaxu2(m, v.x & 0x7fff7fffu);
        m = __vmaxu2(m, v.y & 0x7fff7fffu);
        m = __vmaxu2(m, v.z & 0x7fff7fffu);
        m = __vmaxu2(m, v.w & 0x7fff7fffu);
    } else {
        m = max(m, v.x & 0x7fffffffu);
        m = max(m, v.y & 0x7fffffffu);
        m = max(m, v.z & 0x7fffffffu);
        m = max(m, v.w & 0x7fffffffu);
    }
    return m;
}

/* The chunk's fp8 bytes (VEC of them, little-endian in element order). */
template <int ES, int DT> __device__ __forceinline__ wx_u64 wx_quant(uint4 v, float s)
{
    wx_u32 w[4] = {v.x, v.y, v.z, v.w};
    wx_u64 out = 0;
    if (ES == 2) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float a = wx_div_rn(wx_to_f32<DT>(w[k] & 0xffffu), s);
            float b = wx_div_rn(wx_to_f32<DT>(w[k] >> 16), s);
            out |= (wx_u64)wx_e4m3x2(a, b) << (16 * k);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 2; k++) {
            float a = wx_div_rn(__uint_as_float(w[2 * k]), s);
            float b = wx_div_rn(__uint_as_float(w[2 * k + 1]), s);
            out |= (wx_u64)wx_e4m3x2(a, b) << (16 * k);
        }
    }
    return out;
}

/* Store the chunk's fp8 bytes at (row, col) of the tile's fp8 rows (pitch `pitch`), only
 * inside [nr, nc). vec: every row start is VEC-byte aligned. */
template <int ES>
__device__ __forceinline__ void wx_store(unsigned char *base, wx_i64 pitch, int row, int col,
                                         int nr, int nc, bool vec, wx_u64 q)
{
    const int VEC = wx_geom<ES>::VEC;
    if (row >= nr || col >= nc)
        return;
    unsigned char *p = base + (wx_i64)row * pitch + col;
    if (vec && col + VEC <= nc) {
        if (ES == 2)
            *(uint2 *)p = make_uint2((wx_u32)q, (wx_u32)(q >> 32));
        else
            *(wx_u32 *)p = (wx_u32)q;
        return;
    }
#pragma unroll
    for (int j = 0; j < VEC; j++)
        if (col + j < nc)
            p[j] = (unsigned char)(q >> (8 * j));
}

__device__ __forceinline__ wx_u32 wx_warp_max(wx_u32 m)
{
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffffu, m);
#else
    for (int o = 16; o > 0; o >>= 1)
        m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
#endif
}

template <int ES, int DT>
__device__ __forceinline__ void wx_tile(const wx_fp8_piece &pc, wx_i64 tr, wx_i64 tc, wx_i64 cb,
                                        unsigned char *out, wx_u32 *red)
{
    typedef wx_geom<ES> G;
    const bool hold = ES == 2; /* keep the chunks in registers for the second pass */
    const int tid = threadIdx.x;
    const int col = (tid % G::CPR) * G::VEC, row0 = tid / G::CPR;
    const int nr = (int)min((wx_i64)WX_TILE, pc.rows - tr * WX_TILE);
    const int nc = (int)min((wx_i64)WX_TILE, pc.cols - tc * WX_TILE);
    const wx_i64 ldb = pc.ld * ES;
    const char *src = (const char *)pc.src + tr * WX_TILE * ldb + tc * WX_TILE * ES;
    const bool lvec = (((wx_u64)src | (wx_u64)ldb) & 15) == 0;
    uint4 v[hold ? G::NP : 1];
    wx_u32 m = 0;
#pragma unroll
    for (int p = 0; p < G::NP; p++) {
        uint4 c = wx_load<ES>(src, ldb, p * G::RPP + row0, col, nr, nc, lvec);
        m = wx_amax_bits<ES>(m, c);
        if (hold)
            v[hold ? p : 0] = c;
    }
    if (ES == 2)
        m = max(m & 0xffffu, m >> 16);
    m = wx_warp_max(m);
    if ((tid & 31) == 0)
        red[tid >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int i = 1; i < WX_WARPS; i++)
        m = max(m, red[i]);
    float amax = wx_to_f32<DT>(m);
    /* torch.clamp(amax, min=1e-12): 1e-12f is the float32 nearest 1e-12, as torch casts the
     * bound; a NaN amax stays NaN. */
    float s = wx_div_rn(amax < 1e-12f ? 1e-12f : amax, 448.0f);
    if (tid == 0 && pc.s_off >= 0) {
        unsigned char *sp = out + pc.s_off + (tr * cb + tc) * 4;
        if (((wx_u64)sp & 3) == 0) {
            *(float *)sp = s;
        } else {
            wx_u32 b = __float_as_uint(s);
            for (int j = 0; j < 4; j++)
                sp[j] = (unsigned char)(b >> (8 * j));
        }
    }
    if (pc.q_off < 0)
        return;
    unsigned char *dst = out + pc.q_off + tr * WX_TILE * pc.cols + tc * WX_TILE;
    const bool svec = (((wx_u64)(out + pc.q_off) | (wx_u64)pc.cols) & (G::VEC - 1)) == 0;
#pragma unroll
    for (int p = 0; p < G::NP; p++) {
        uint4 c = hold ? v[hold ? p : 0]
                       : wx_load<ES>(src, ldb, p * G::RPP + row0, col, nr, nc, lvec);
        wx_store<ES>(dst, pc.cols, p * G::RPP + row0, col, nr, nc, svec, wx_quant<ES, DT>(c, s));
    }
}

/* The piece holding tile t: the last i with pieces[i].tile0 <= t (pieces[0].tile0 == 0),
 * found by the warp 32 candidates at a time. */
__device__ __forceinline__ int wx_find_piece(const wx_fp8_piece *pieces, int n, wx_i64 t)
{
    const int lane = threadIdx.x & 31;
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        int step = (hi - lo + 31) / 32;
        int idx = lo + lane * step;
        bool ok = idx < hi && __ldg(&pieces[idx].tile0) <= t;
        wx_u32 b = __ballot_sync(0xffffffffu, ok);
        lo += (31 - __clz(b)) * step;
        hi = min(lo + step, hi);
    }
    return lo;
}

extern "C" __global__ void __launch_bounds__(WX_THREADS, WX_MINB)
    wx_fp8_quant(const wx_fp8_piece *pieces, int n, unsigned char *out)
{
    __shared__ wx_u32 red[WX_WARPS];
    const wx_i64 t = blockIdx.x;
    const wx_fp8_piece *pp = &pieces[wx_find_piece(pieces, n, t)];
    wx_fp8_piece pc;
    pc.src = __ldg(&pp->src);
    pc.dtype = __ldg(&pp->dtype);
    pc.ld = __ldg(&pp->ld);
    pc.rows = __ldg(&pp->rows);
    pc.cols = __ldg(&pp->cols);
    pc.q_off = __ldg(&pp->q_off);
    pc.s_off = __ldg(&pp->s_off);
    pc.tile0 = __ldg(&pp->tile0);
    const wx_i64 cb = (pc.cols + WX_TILE - 1) / WX_TILE;
    const wx_i64 lt = t - pc.tile0, tr = lt / cb, tc = lt - tr * cb;
    if (pc.dtype == 0)
        wx_tile<2, 0>(pc, tr, tc, cb, out, red);
    else if (pc.dtype == 1)
        wx_tile<2, 1>(pc, tr, tc, cb, out, red);
    else
        wx_tile<4, 2>(pc, tr, tc, cb, out, red);
}
