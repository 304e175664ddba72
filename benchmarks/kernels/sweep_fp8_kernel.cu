/* wx_fp8_kernel.cu - block-FP8 (e4m3) quantization of many 2-D pieces in one launch.
 *
 * This file is not compiled by setup.py: setup.py embeds it as a string into the extension
 * and wx_fp8.c compiles it with NVRTC at first use, for the architecture of the device
 * (docs/prepare.md says why). It includes no system header, so that it compiles with any
 * NVRTC; variants 6 and 7 include wx_fp8_pipe.cu, which wx_fp8.c passes to NVRTC as an
 * in-memory header. `nvcc -arch=sm_90 --ptx csrc/prepare/wx_fp8_kernel.cu` checks it by hand.
 *
 * The bytes are those of wxfer.mapping.reference.quantize_fp8_block, bit for bit: per
 * 128x128 tile of a piece (the tile grid starts at the piece's first row and column),
 * amax = max |w| in float32 (NaN propagates), scale = max(amax, 1e-12f) / 448 (IEEE
 * division), q = clamp(w / scale, -448, 448) rounded to float8_e4m3fn, nearest-even.
 *
 * Variant 0 (the others are listed below): one CTA of 256 threads per tile. A thread owns
 * 64 elements: NP chunks of 16 bytes (8 bf16/fp16 or 4 float32), chunk c of pass p at row
 * p*RPP + tid/CPR, column
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

/* Variants (wx_fp8.c passes -DWX_VARIANT=<n> from WXFER_FP8_VARIANT=v<n>; default 0), each
 * giving the same bytes:
 *   0  one CTA per tile: load, block reduce, divide (div.rn), store;
 *   1  0 with the fast exact division of 16-bit sources (wx_div_fast);
 *   2  1 on a persistent grid (SMs x WX_MINB CTAs, each looping over tiles), the next tile's
 *      16-bit chunks loaded before the current tile is reduced, quantized and stored;
 *   3  2 with 16 contiguous elements per thread and row: one 16-byte fp8 store each;
 *   4  3 with the loop unrolled twice over two alternating buffers (no register copies, the
 *      loads of the tile after next issued before the next tile's chunks are used); one CTA
 *      per SM by default (180 registers; with 2 it spills);
 *   5  1 with 128 threads per tile, each holding 128 elements (16 chunks) of a 16-bit tile;
 *   6  3's persistent grid and tile code fed through shared memory: the CTA's next
 *      WX_STAGES-1 16-bit tiles are copied by cp.async (zero-filled outside the piece) into a
 *      ring of WX_STAGES 32 KiB buffers while the current one is quantized (wx_fp8_pipe.cu);
 *   7  6 with the copies of whole aligned tiles made by the TMA engine (cp.async.bulk, one
 *      256-byte row each, completing on an mbarrier per stage);
 *   8  6 taking 4 adjacent tiles at a time, each such unit prefetched into L2 row by row
 *      (cp.async.bulk.prefetch.L2) before its first tile is copied. */
#ifndef WX_VARIANT
#define WX_VARIANT 0
#endif
#define WX_FASTDIV (WX_VARIANT >= 1)
#define WX_PERSIST (WX_VARIANT >= 2 && WX_VARIANT <= 4)
#define WX_PIPE (WX_VARIANT >= 6) /* persistent, through shared memory (wx_fp8_pipe.cu) */
#define WX_K (WX_VARIANT >= 3 ? 2 : 1) /* adjacent 16-byte source chunks per thread and row */
#define WX_ALT (WX_VARIANT == 4) /* the persistent loop alternates two buffers (no copies) */

#define WX_TILE 128
#define WX_THREADS (WX_VARIANT == 5 ? 128 : 256) /* wx_fp8.c launches as many */
#ifndef WX_MINB
#if WX_ALT
#define WX_MINB 1 /* two tiles of 16-bit chunks and two jobs in registers: 186 registers */
#elif WX_PERSIST || WX_PIPE
#define WX_MINB 2 /* v2/v3: two tiles of 16-bit chunks in registers per thread */
#else
#define WX_MINB 4 /* CTAs per SM the register budget allows (wx_fp8.c may set it) */
#endif
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

/* a / s correctly rounded (== div.rn.f32) for the kernel's 16-bit sources, given r =
 * rcp.rn(s), s the tile's finite scale and |a| <= the tile's amax:
 *     q0 = RN(a*r); t = RN(q0*s - a) (fma); q = RN(q0 - t*r) (fma).
 * Every step is exact up to a power of two while the quotient q is normal, so q == RN(a/s)
 * iff it holds for the significands of a and s; tests/c/fp8_div_check.c checks every pair
 * (all 2^8 bf16 / 2^11 fp16 significands of a, every float32 significand of s). The
 * residual's grain is >= 2^(E_a - 47) and s >= RN(1e-12/448) > 2^-49, so where the quotient
 * is >= 2^-11 (below that e4m3 gives a signed zero) |a| >= 2^-60 and nothing underflows.
 * Smaller quotients stay below 2^-10 with a's sign (subnormal a: t is 0; a = -0: q0 = -0,
 * t = +0, q = -0*r + -0 = -0), which fp8_div_check also checks. The negation sits inside the
 * asm, applied to t's operand only: -(fma(x,y,z)) folded into fma(-x,y,-z) would turn some
 * zeros' signs. Not for float32 sources (2^46 significand pairs: not checked). */
__device__ __forceinline__ float wx_div_fast(float a, float s, float r)
{
    float q0, t, q;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(q0) : "f"(a), "f"(r));
    asm("{ .reg .f32 na; neg.f32 na, %1; fma.rn.f32 %0, %2, %3, na; }"
        : "=f"(t) : "f"(a), "f"(q0), "f"(s));
    asm("{ .reg .f32 nt; neg.f32 nt, %1; fma.rn.f32 %0, nt, %2, %3; }"
        : "=f"(q) : "f"(t), "f"(r), "f"(q0));
    return q;
}

/* IEEE round-to-nearest reciprocal. */
__device__ __forceinline__ float wx_rcp_rn(float s)
{
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(s));
    return r;
}

/* The tile's divisor: fast (wx_div_fast with r) when the source is 16-bit and s is finite
 * (an inf or NaN amax takes div.rn, as variant 0). */
struct wx_divisor {
    float s, r;
    bool fast;
};

template <int ES> __device__ __forceinline__ wx_divisor wx_divisor_of(float s)
{
    wx_divisor d;
    d.s = s;
    d.fast = WX_FASTDIV && ES == 2 && s <= 3.40282347e38f;
    d.r = d.fast ? wx_rcp_rn(s) : 0.0f;
    return d;
}

__device__ __forceinline__ float wx_div(float a, const wx_divisor &d)
{
    return (WX_FASTDIV && d.fast) ? wx_div_fast(a, d.s, d.r) : wx_div_rn(a, d.s);
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
template <int ES, int DT> __device__ __forceinline__ wx_u64 wx_quant(uint4 v, const wx_divisor &d)
{
    wx_u32 w[4] = {v.x, v.y, v.z, v.w};
    wx_u64 out = 0;
    if (ES == 2) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float a = wx_div(wx_to_f32<DT>(w[k] & 0xffffu), d);
            float b = wx_div(wx_to_f32<DT>(w[k] >> 16), d);
            out |= (wx_u64)wx_e4m3x2(a, b) << (16 * k);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 2; k++) {
            float a = wx_div(__uint_as_float(w[2 * k]), d);
            float b = wx_div(__uint_as_float(w[2 * k + 1]), d);
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
    const wx_divisor dv = wx_divisor_of<ES>(s);
#pragma unroll
    for (int p = 0; p < G::NP; p++) {
        uint4 c = hold ? v[hold ? p : 0]
                       : wx_load<ES>(src, ldb, p * G::RPP + row0, col, nr, nc, lvec);
        wx_store<ES>(dst, pc.cols, p * G::RPP + row0, col, nr, nc, svec, wx_quant<ES, DT>(c, dv));
    }
}

/* Up to WX_INLINE pieces travel in the launch's parameters instead of a device table (no
 * host-to-device copy for small launches: wx_fp8.c fills it when no table is given). */
#define WX_INLINE 8
struct wx_fp8_inline {
    wx_fp8_piece p[WX_INLINE];
};

/* Read-only loads: through the non-coherent cache from global memory (G), plain ones from
 * the __grid_constant__ parameter (generic addressing). */
template <bool G, typename T> __device__ __forceinline__ T wx_ld(const T *p)
{
    return G ? __ldg(p) : *p;
}

/* The piece holding tile t: the last i with pieces[i].tile0 <= t (pieces[0].tile0 == 0),
 * found by the warp 32 candidates at a time. */
template <bool G>
__device__ __forceinline__ int wx_find_piece(const wx_fp8_piece *pieces, int n, wx_i64 t)
{
    const int lane = threadIdx.x & 31;
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        int step = (hi - lo + 31) / 32;
        int idx = lo + lane * step;
        bool ok = idx < hi && wx_ld<G>(&pieces[idx].tile0) <= t;
        wx_u32 b = __ballot_sync(0xffffffffu, ok);
        lo += (31 - __clz(b)) * step;
        hi = min(lo + step, hi);
    }
    return lo;
}

template <bool G>
__device__ __forceinline__ void wx_piece_read(const wx_fp8_piece *pieces, int n, wx_i64 t,
                                              wx_fp8_piece &pc)
{
    const wx_fp8_piece *pp = &pieces[wx_find_piece<G>(pieces, n, t)];
    pc.src = wx_ld<G>(&pp->src);
    pc.dtype = wx_ld<G>(&pp->dtype);
    pc.ld = wx_ld<G>(&pp->ld);
    pc.rows = wx_ld<G>(&pp->rows);
    pc.cols = wx_ld<G>(&pp->cols);
    pc.q_off = wx_ld<G>(&pp->q_off);
    pc.s_off = wx_ld<G>(&pp->s_off);
    pc.tile0 = wx_ld<G>(&pp->tile0);
}

/* The piece of tile t, from the device table, or from the launch's parameters when the
 * table pointer is null. */
__device__ __forceinline__ void wx_piece_of(const wx_fp8_piece *pieces, const wx_fp8_inline &inl,
                                            int n, wx_i64 t, wx_fp8_piece &pc)
{
    if (pieces)
        wx_piece_read<true>(pieces, n, t, pc);
    else
        wx_piece_read<false>(inl.p, n, t, pc);
}

#if !WX_PERSIST && !WX_PIPE
extern "C" __global__ void __launch_bounds__(WX_THREADS, WX_MINB)
    wx_fp8_quant(const wx_fp8_piece *pieces, int n, unsigned char *out, int ntiles,
                 const __grid_constant__ wx_fp8_inline inl)
{
    __shared__ wx_u32 red[WX_WARPS];
    const wx_i64 t = blockIdx.x;
    wx_fp8_piece pc;
    wx_piece_of(pieces, inl, n, t, pc);
    const wx_i64 cb = (pc.cols + WX_TILE - 1) / WX_TILE;
    const wx_i64 lt = t - pc.tile0, tr = lt / cb, tc = lt - tr * cb;
    if (pc.dtype == 0)
        wx_tile<2, 0>(pc, tr, tc, cb, out, red);
    else if (pc.dtype == 1)
        wx_tile<2, 1>(pc, tr, tc, cb, out, red);
    else
        wx_tile<4, 2>(pc, tr, tc, cb, out, red);
}
#else
/* One tile, as the persistent loop carries it: addresses and bounds only. */
struct wx_job {
    const char *src;    /* the tile's element [0, 0] */
    unsigned char *dst; /* the tile's first fp8 byte, or null */
    unsigned char *sp;  /* the tile's scale, or null */
    wx_i64 ldb;         /* source row pitch in bytes */
    wx_i64 pitch;       /* fp8 row pitch (the piece's cols) */
    int nr, nc, dt;
    bool lvec;     /* source rows 16-byte aligned */
    int salign;    /* (dst | pitch) & 15: fp8 row starts aligned to 16 when 0 */
};

__device__ __forceinline__ void wx_job_of(const wx_fp8_piece *pieces, const wx_fp8_inline &inl,
                                          int n, wx_i64 t, unsigned char *out, wx_job &j)
{
    wx_fp8_piece pc;
    wx_piece_of(pieces, inl, n, t, pc);
    const wx_i64 cb = (pc.cols + WX_TILE - 1) / WX_TILE;
    const wx_i64 lt = t - pc.tile0, tr = lt / cb, tc = lt - tr * cb;
    const wx_i64 es = pc.dtype == 2 ? 4 : 2;
    j.ldb = pc.ld * es;
    j.src = (const char *)pc.src + tr * WX_TILE * j.ldb + tc * WX_TILE * es;
    j.lvec = (((wx_u64)j.src | (wx_u64)j.ldb) & 15) == 0;
    j.pitch = pc.cols;
    j.dst = pc.q_off < 0 ? 0 : out + pc.q_off + tr * WX_TILE * pc.cols + tc * WX_TILE;
    j.salign = (int)(((wx_u64)(out + pc.q_off) | (wx_u64)pc.cols) & 15);
    j.sp = pc.s_off < 0 ? 0 : out + pc.s_off + (tr * cb + tc) * 4;
    j.nr = (int)min((wx_i64)WX_TILE, pc.rows - tr * WX_TILE);
    j.nc = (int)min((wx_i64)WX_TILE, pc.cols - tc * WX_TILE);
    j.dt = (int)pc.dtype;
}

/* Thread layout of 16-bit tiles: WX_K adjacent 16-byte chunks (8*WX_K elements) per row. */
struct wx_g16 {
    static const int SPAN = 8 * WX_K;          /* elements per thread and row */
    static const int TPR = WX_TILE / SPAN;     /* threads per row */
    static const int RPP = WX_THREADS / TPR;   /* rows per pass */
    static const int NP = WX_TILE / RPP;       /* passes; NP * WX_K == 8 chunks per thread */
};
#define WX_NCH 8

__device__ __forceinline__ void wx_load16(const wx_job &j, uint4 *v)
{
    const int tid = threadIdx.x, col = (tid % wx_g16::TPR) * wx_g16::SPAN;
    const int row0 = tid / wx_g16::TPR;
#pragma unroll
    for (int p = 0; p < wx_g16::NP; p++)
#pragma unroll
        for (int k = 0; k < WX_K; k++)
            v[p * WX_K + k] = wx_load<2>(j.src, j.ldb, p * wx_g16::RPP + row0, col + 8 * k, j.nr,
                                         j.nc, j.lvec);
}

/* The tile's scale from each thread's amax bits m: block max, clamp, divide by 448; thread 0
 * writes it. One __syncthreads; red must not be read by the previous tile (double buffer). */
template <int DT>
__device__ __forceinline__ float wx_block_scale(wx_u32 m, const wx_job &j, wx_u32 *red)
{
    m = wx_warp_max(m);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int i = 1; i < WX_WARPS; i++)
        m = max(m, red[i]);
    float amax = wx_to_f32<DT>(m);
    float s = wx_div_rn(amax < 1e-12f ? 1e-12f : amax, 448.0f);
    if (threadIdx.x == 0 && j.sp) {
        if (((wx_u64)j.sp & 3) == 0) {
            *(float *)j.sp = s;
        } else {
            wx_u32 b = __float_as_uint(s);
            for (int k = 0; k < 4; k++)
                j.sp[k] = (unsigned char)(b >> (8 * k));
        }
    }
    return s;
}

/* A 16-bit tile whose chunks are in v. */
template <int DT>
__device__ __forceinline__ void wx_tile16(const wx_job &j, const uint4 *v, wx_u32 *red)
{
    wx_u32 m = 0;
#pragma unroll
    for (int c = 0; c < WX_NCH; c++)
        m = wx_amax_bits<2>(m, v[c]);
    m = max(m & 0xffffu, m >> 16);
    const wx_divisor dv = wx_divisor_of<2>(wx_block_scale<DT>(m, j, red));
    if (!j.dst)
        return;
    const int tid = threadIdx.x, col = (tid % wx_g16::TPR) * wx_g16::SPAN;
    const int row0 = tid / wx_g16::TPR;
    const bool v8 = (j.salign & 7) == 0, v16 = j.salign == 0;
#pragma unroll
    for (int p = 0; p < wx_g16::NP; p++) {
        const int row = p * wx_g16::RPP + row0;
        if (WX_K == 2) {
            wx_u64 a = wx_quant<2, DT>(v[2 * p], dv), b = wx_quant<2, DT>(v[2 * p + 1], dv);
            if (v16 && row < j.nr && col + 16 <= j.nc) {
                *(uint4 *)(j.dst + (wx_i64)row * j.pitch + col) =
                    make_uint4((wx_u32)a, (wx_u32)(a >> 32), (wx_u32)b, (wx_u32)(b >> 32));
            } else {
                wx_store<2>(j.dst, j.pitch, row, col, j.nr, j.nc, v8, a);
                wx_store<2>(j.dst, j.pitch, row, col + 8, j.nr, j.nc, v8, b);
            }
        } else {
            wx_store<2>(j.dst, j.pitch, row, col, j.nr, j.nc, v8,
                        wx_quant<2, DT>(v[p], dv));
        }
    }
}

/* A float32 tile: read twice (amax, then quantize), as variant 0 does. */
__device__ __forceinline__ void wx_tile32(const wx_job &j, wx_u32 *red)
{
    typedef wx_geom<4> G;
    const int tid = threadIdx.x, col = (tid % G::CPR) * G::VEC, row0 = tid / G::CPR;
    wx_u32 m = 0;
#pragma unroll
    for (int p = 0; p < G::NP; p++)
        m = wx_amax_bits<4>(m, wx_load<4>(j.src, j.ldb, p * G::RPP + row0, col, j.nr, j.nc, j.lvec));
    const wx_divisor dv = wx_divisor_of<4>(wx_block_scale<2>(m, j, red));
    if (!j.dst)
        return;
    const bool v4 = (j.salign & 3) == 0;
#pragma unroll
    for (int p = 0; p < G::NP; p++) {
        uint4 c = wx_load<4>(j.src, j.ldb, p * G::RPP + row0, col, j.nr, j.nc, j.lvec);
        wx_store<4>(j.dst, j.pitch, p * G::RPP + row0, col, j.nr, j.nc, v4, wx_quant<4, 2>(c, dv));
    }
}

__device__ __forceinline__ void wx_run(const wx_job &j, const uint4 *v, wx_u32 *red)
{
    if (j.dt == 0)
        wx_tile16<0>(j, v, red);
    else if (j.dt == 1)
        wx_tile16<1>(j, v, red);
    else
        wx_tile32(j, red);
}

#if WX_PIPE
#include "sweep_fp8_pipe.cu"
#elif !WX_ALT
/* Persistent grid: CTA b takes tiles b, b + G, b + 2G, ... (G = gridDim.x). The chunks of
 * the next 16-bit tile are loaded before the current one is reduced and stored, and the tile
 * after it is looked up once those loads are in flight. */
extern "C" __global__ void __launch_bounds__(WX_THREADS, WX_MINB)
    wx_fp8_quant(const wx_fp8_piece *pieces, int n, unsigned char *out, int ntiles,
                 const __grid_constant__ wx_fp8_inline inl)
{
    __shared__ wx_u32 red[2][WX_WARPS];
    const wx_i64 g = gridDim.x;
    wx_i64 t = blockIdx.x;
    if (t >= ntiles)
        return;
    wx_job cur, nxt;
    uint4 vc[WX_NCH], vn[WX_NCH];
    wx_job_of(pieces, inl, n, t, out, cur);
    if (cur.dt != 2)
        wx_load16(cur, vc);
    if (t + g < ntiles)
        wx_job_of(pieces, inl, n, t + g, out, nxt);
    for (int it = 0;; it++, t += g) {
        const bool more = t + g < ntiles;
        if (more && nxt.dt != 2)
            wx_load16(nxt, vn);
        wx_run(cur, vc, red[it & 1]);
        if (!more)
            break;
        cur = nxt;
#pragma unroll
        for (int c = 0; c < WX_NCH; c++)
            vc[c] = vn[c];
        if (t + 2 * g < ntiles)
            wx_job_of(pieces, inl, n, t + 2 * g, out, nxt);
    }
}
#else
/* One step of the persistent loop at tile t (job cur, chunks vc), the next tile t + g being
 * job nxt: load nxt's chunks into vn, quantize cur, then make cur the job of tile t + 2g.
 * The loop alternates the two buffers (no register copies), so the loads of the tile after
 * next are issued before the next tile's chunks are first used. False: t was the last. */
__device__ __forceinline__ bool wx_step(const wx_fp8_piece *pieces, const wx_fp8_inline &inl,
                                        int n, unsigned char *out, wx_i64 ntiles, wx_i64 g,
                                        wx_i64 &t, int it, wx_job &cur, uint4 *vc, wx_job &nxt,
                                        uint4 *vn, wx_u32 (*red)[WX_WARPS])
{
    const bool more = t + g < ntiles;
    if (more && nxt.dt != 2)
        wx_load16(nxt, vn);
    wx_run(cur, vc, red[it & 1]);
    if (!more)
        return false;
    if (t + 2 * g < ntiles)
        wx_job_of(pieces, inl, n, t + 2 * g, out, cur);
    t += g;
    return true;
}

/* Persistent grid, two buffers alternating (variant 4). */
extern "C" __global__ void __launch_bounds__(WX_THREADS, WX_MINB)
    wx_fp8_quant(const wx_fp8_piece *pieces, int n, unsigned char *out, int ntiles,
                 const __grid_constant__ wx_fp8_inline inl)
{
    __shared__ wx_u32 red[2][WX_WARPS];
    const wx_i64 g = gridDim.x;
    wx_i64 t = blockIdx.x;
    if (t >= ntiles)
        return;
    wx_job a, b;
    uint4 va[WX_NCH], vb[WX_NCH];
    wx_job_of(pieces, inl, n, t, out, a);
    if (a.dt != 2)
        wx_load16(a, va);
    if (t + g < ntiles)
        wx_job_of(pieces, inl, n, t + g, out, b);
    for (int it = 0;; it += 2) {
        if (!wx_step(pieces, inl, n, out, ntiles, g, t, it, a, va, b, vb, red))
            break;
        if (!wx_step(pieces, inl, n, out, ntiles, g, t, it + 1, b, vb, a, va, red))
            break;
    }
}
#endif
#endif
