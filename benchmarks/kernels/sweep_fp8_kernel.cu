/* sweep_fp8_kernel.cu - the nine measured variants of the block-FP8 kernel, for
 * benchmarks/bench_quant.py --variants (builds made with WXFER_KERNEL_SWEEP=1: wx_sweep.c
 * compiles this file with NVRTC, handing it the product's csrc/prepare/wx_fp8_kernel.cu and
 * sweep_fp8_pipe.cu as in-memory headers).
 *
 * The variants are built from the product's source: this file sets its WX_* switches for the
 * variant and WX_FP8_TILES_ONLY, includes it (the piece table, the loads, amax, division,
 * e4m3 conversion and stores, and the persistent loop's per-tile code: wx_job, wx_tile16,
 * wx_tile32), and adds what only the other variants have: variant 0's per-CTA tile (wx_tile),
 * the register loops of variants 2-4, and the shared-memory loops of 6-8 (sweep_fp8_pipe.cu).
 * Variant 6 is the product kernel. By hand:
 * `nvcc -arch=sm_90 --ptx --fmad=false -Icsrc/prepare -DWX_VARIANT=6 -DWX_STAGES=3
 * benchmarks/kernels/sweep_fp8_kernel.cu`.
 *
 * The bytes are those of wxfer.mapping.reference.quantize_fp8_block, bit for bit, in every
 * variant (wx_fp8_kernel.cu says how).
 *
 * Variant 0 (the others are listed below): one CTA of 256 threads per tile. A thread owns
 * 64 elements: NP chunks of 16 bytes (8 bf16/fp16 or 4 float32), chunk c of pass p at row
 * p*RPP + tid/CPR, column
 * (tid%CPR)*VEC of the tile, so that a warp reads 512 contiguous bytes per pass. The amax
 * is taken on the raw bits (|x| of IEEE formats orders like an unsigned integer, NaN above
 * inf), reduced by warp and through shared memory. 16-bit sources stay in registers for the
 * second pass; float32 sources are read again (from L1/L2) to keep registers low.
 */

/* Variants (wx_sweep.c passes -DWX_VARIANT=<n>, from _wxfer.kernel_sweep("fp8", variant=n);
 * default 0), each giving the same bytes:
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
#define WX_FP8_TILES_ONLY 1 /* the product's tile code, not its loop */
#include "wx_fp8_kernel.cu"

#if !WX_PERSIST && !WX_PIPE
/* Variants 0, 1 and 5: one CTA per tile. */
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
    /* the product's block reduction, clamp, division and scale store (wx_block_scale reads
     * only the job's scale address) */
    wx_job sj = {};
    sj.sp = pc.s_off >= 0 ? out + pc.s_off + (tr * cb + tc) * 4 : 0;
    const float s = wx_block_scale<DT>(m, sj, red);
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
