/* wx_fp8_kernel.cu - block-FP8 (e4m3) quantization of many 2-D pieces in one launch.
 *
 * This file is not compiled by setup.py: setup.py embeds it as a string into the extension
 * and wx_fp8.c compiles it with NVRTC at first use, for the architecture of the device
 * (docs/prepare.md says why). It includes no system header, so that it compiles with any
 * NVRTC; it includes wx_fp8_pipe.cu (its persistent loop), which wx_fp8.c passes to NVRTC as
 * an in-memory header. `nvcc -arch=sm_90 --ptx -DWX_STAGES=3 csrc/prepare/wx_fp8_kernel.cu`
 * checks it by hand.
 *
 * The bytes are those of wxfer.mapping.reference.quantize_fp8_block, bit for bit: per
 * 128x128 tile of a piece (the tile grid starts at the piece's first row and column),
 * amax = max |w| in float32 (NaN propagates), scale = max(amax, 1e-12f) / 448 (IEEE
 * division), q = clamp(w / scale, -448, 448) rounded to float8_e4m3fn, nearest-even.
 *
 * The grid is persistent (SMs x WX_MINB CTAs of 256 threads, each looping over tiles); each
 * CTA's next tiles are copied into shared memory while the current one is quantized
 * (wx_fp8_pipe.cu). A thread owns 16 contiguous elements of 8 rows of a 16-bit tile (two
 * 16-byte chunks a row, one 16-byte fp8 store), or 4-element chunks of a float32 tile, which is
 * read twice (amax, then quantize) to keep registers low. The amax is taken on the raw bits
 * (|x| of IEEE formats orders like an unsigned integer, NaN above inf), reduced by warp and
 * through shared memory; 16-bit sources are divided by the exact fast division (wx_div_fast).
 * This is variant v6 of the nine measured (docs/prepare.md). benchmarks/kernels/
 * sweep_fp8_kernel.cu builds all nine from this file for benchmarks/bench_quant.py --variants:
 * it sets the WX_* switches below (#ifndef here: the values that follow are the product's) and
 * WX_FP8_TILES_ONLY, which leaves out this file's loop (wx_fp8_pipe.cu) for the variant's own.
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
#ifndef WX_THREADS
#define WX_THREADS 256 /* = WX__THREADS in wx_fp8.c */
#endif
#ifndef WX_MINB
#define WX_MINB 2 /* resident CTAs per SM (= WX__CTAS_PER_SM in wx_fp8.c) */
#endif
#ifndef WX_K
#define WX_K 2 /* adjacent 16-byte source chunks per thread and row (the sweep: 1 or 2) */
#endif
#ifndef WX_FASTDIV
#define WX_FASTDIV 1 /* 16-bit sources divided by wx_div_fast (the sweep's v0: div.rn only) */
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
 * (an inf or NaN amax takes div.rn). */
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
        } else { /* the sweep's v2: one chunk a thread and row */
            wx_store<2>(j.dst, j.pitch, row, col, j.nr, j.nc, v8, wx_quant<2, DT>(v[p], dv));
        }
    }
}

/* A float32 tile: read twice (amax, then quantize). */
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

#ifndef WX_FP8_TILES_ONLY
#include "wx_fp8_pipe.cu"
#endif
