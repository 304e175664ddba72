/* wx_fp8_pipe.cu - variants 6 to 8 of the FP8 kernel: the persistent grid of variant 3
 * fed through shared memory. Included by wx_fp8_kernel.cu after its tile code (wx_job,
 * wx_tile16, wx_tile32); wx_fp8.c hands it to NVRTC as a header, setup.py embeds it too.
 *
 * CTA b takes tiles b, b + G, b + 2G, ... (G = gridDim.x) as variant 3 does, but keeps a
 * ring of WX_STAGES 32 KiB tile buffers in shared memory: while tile k is reduced and
 * quantized, the copies of tiles k+1 .. k+WX_STAGES-1 are in flight, and none of them holds
 * a register. Little's law: ~4 TB/s at ~1 us of loaded DRAM latency needs ~4 MB in flight,
 * ~30 KiB per SM; the ring keeps (WX_STAGES-1) x 32 KiB x CTAs per SM (96-160 KiB) in
 * flight, against at most 2 x 32 KiB for variant 3 (its registers).
 *
 *   6  each thread copies 8 chunks of 16 bytes with cp.async (zero-filled outside the piece:
 *      partial tiles as variant 0 reads them), one commit group per tile, waited for with
 *      cp.async.wait_group;
 *   7  warp 0 copies each row of a whole (128x128) tile with cp.async.bulk (the TMA engine,
 *      256 bytes a copy) completing on the stage's mbarrier; other 16-bit tiles are read
 *      from global memory when quantized (variant 3's loads); the mbarrier still completes a
 *      phase for them (a plain arrive), so the parity of use u of a stage is u & 1;
 *   8  6 with the tiles taken WX_UNIT (4) adjacent ones at a time (CTA b: tiles 4b .. 4b+3,
 *      then 4(b+G) ..), and before the first of a unit is copied, warp 0 asks the TMA engine
 *      to prefetch the whole unit into L2 (cp.async.bulk.prefetch.L2), row by row across its
 *      4 tiles: DRAM sees 1 KiB contiguous per row of a bf16 unit instead of 256-byte pieces
 *      from different SMs at different times; the ring's copies then find the lines in L2
 *      (or already requested). A lead, not a measured cause: variants 0-5 all stay at
 *      ~0.55 of the on-device copy whatever their bytes in flight.
 * Float32 tiles and sources whose rows are not 16-byte aligned take variant 3's loads. The
 * tile's elements then reach the same registers as variant 3's (wx_tile16), so the bytes are
 * the same. */

#if WX_K != 2 || WX_THREADS != 256
#error "wx_fp8_pipe.cu expects variant 3's layout (16 elements a thread and row, 256 threads)"
#endif
#ifndef WX_STAGES
#define WX_STAGES (WX_MINB == 1 ? 6 : WX_MINB == 2 ? 3 : 2) /* = wx__stages() in wx_fp8.c */
#endif
#if WX_STAGES < 2
#error "WX_STAGES must be at least 2"
#endif
#define WX_TCH (WX_TILE * WX_TILE * 2 / 16) /* 16-byte chunks of a 16-bit tile (2048) */
#define WX_RCH (WX_TILE * 2 / 16)           /* chunks of a tile row (16) */
#define WX_BULK (WX_VARIANT == 7)
#define WX_UNIT (WX_VARIANT == 8 ? 4 : 1) /* adjacent tiles a CTA takes in a row */

/* The CTA's k-th tile: units of WX_UNIT consecutive tiles, unit m of CTA b being b + m*G. */
__device__ __forceinline__ wx_i64 wx_tile_at(wx_i64 b, int k, wx_i64 g)
{
    return WX_UNIT * (b + (wx_i64)(k / WX_UNIT) * g) + k % WX_UNIT;
}

__device__ __forceinline__ wx_u32 wx_saddr(const void *p)
{
    wx_u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

/* Is tile j read through the ring (else: from global memory when it is quantized)? */
__device__ __forceinline__ bool wx_ringed(const wx_job &j)
{
    if (j.dt == 2 || !j.lvec)
        return false;
    return !WX_BULK || (j.nr == WX_TILE && j.nc == WX_TILE);
}

/* The thread's 8 chunks of the tile in buf, into variant 3's registers: v[2p + k] is chunk
 * 2*cp + k of row p*RPP + row0. Threads 4..7 of each 8 read their odd chunk first, so that
 * each 8-thread phase of a 16-byte shared load touches 8 distinct 16-byte bank groups. */
__device__ __forceinline__ void wx_ring_read(const uint4 *buf, uint4 *v)
{
    const int tid = threadIdx.x, cp = tid % wx_g16::TPR, row0 = tid / wx_g16::TPR;
    const int sw = (cp >> 2) & 1;
#pragma unroll
    for (int p = 0; p < wx_g16::NP; p++) {
        const uint4 *r = buf + (p * wx_g16::RPP + row0) * WX_RCH + 2 * cp;
        uint4 a = r[sw], b = r[1 - sw];
        v[2 * p] = sw ? b : a;
        v[2 * p + 1] = sw ? a : b;
    }
}

#if !WX_BULK
/* cp.async of the tile's chunks into buf: chunk q = p*256 + tid (row q/16, chunk q%16 of
 * the row; a warp copies 512 contiguous bytes of two rows), zero-filled outside [nr, nc). */
__device__ __forceinline__ void wx_ring_fill(const wx_job &j, uint4 *buf, wx_u64 *)
{
    const int rstep = WX_THREADS / WX_RCH, row0 = threadIdx.x / WX_RCH;
    const int col = (threadIdx.x % WX_RCH) * 8;
    const int nb = col < j.nc ? 2 * min(8, j.nc - col) : 0;
    const char *g = j.src + (wx_i64)row0 * j.ldb + col * 2;
    wx_u32 d = wx_saddr(buf + threadIdx.x);
#pragma unroll
    for (int p = 0; p < WX_TCH / WX_THREADS; p++) {
        const bool in = p * rstep + row0 < j.nr && nb;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d),
                     "l"(in ? g : j.src), "r"(in ? nb : 0)
                     : "memory");
        g += rstep * j.ldb;
        d += WX_THREADS * 16;
    }
}

__device__ __forceinline__ void wx_ring_commit(wx_u64 *)
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Wait for tile k (stage s) of this thread's copies; the caller's barrier makes every
 * thread's copies visible. */
__device__ __forceinline__ void wx_ring_wait(wx_u64 *, int)
{
    asm volatile("cp.async.wait_group %0;" ::"n"(WX_STAGES - 2) : "memory");
}

__device__ __forceinline__ void wx_ring_init(wx_u64 *)
{
}
#else
/* The stage's mbarrier expects 32 KiB, then warp 0 copies the 128 rows (4 a lane). */
__device__ __forceinline__ void wx_ring_fill(const wx_job &j, uint4 *buf, wx_u64 *bar)
{
    if (threadIdx.x >= 32)
        return;
    const wx_u32 b = wx_saddr(bar);
    if (threadIdx.x == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b),
                     "r"(WX_TCH * 16)
                     : "memory");
    __syncwarp();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#pragma unroll
    for (int i = 0; i < WX_TILE / 32; i++) {
        const int row = i * 32 + threadIdx.x;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                     "[%0], [%1], %2, [%3];" ::"r"(wx_saddr(buf + row * WX_RCH)),
                     "l"(j.src + (wx_i64)row * j.ldb), "n"(WX_TILE * 2), "r"(b)
                     : "memory");
    }
}

/* A stage whose tile is not copied (or past the last) still completes its phase. */
__device__ __forceinline__ void wx_ring_skip(wx_u64 *bar)
{
    if (threadIdx.x == 0)
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(wx_saddr(bar)) : "memory");
}

__device__ __forceinline__ void wx_ring_commit(wx_u64 *)
{
}

/* Wait for use k / WX_STAGES of the stage's mbarrier (phase parity (k / WX_STAGES) & 1). */
__device__ __forceinline__ void wx_ring_wait(wx_u64 *bar, int k)
{
    const wx_u32 b = wx_saddr(bar), par = (wx_u32)((k / WX_STAGES) & 1);
    asm volatile("{\n\t.reg .pred p;\n"
                 "WX_WAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
                 "@!p bra WX_WAIT;\n}" ::"r"(b),
                 "r"(par)
                 : "memory");
}

__device__ __forceinline__ void wx_ring_init(wx_u64 *bar)
{
    if (threadIdx.x == 0) {
        for (int s = 0; s < WX_STAGES; s++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(wx_saddr(bar + s))
                         : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}
#endif

#if WX_UNIT > 1
/* Warp 0: an L2 prefetch of the rows of tiles t .. t+WX_UNIT-1 that the ring will copy, the
 * rows of all of them for row r before row r+1 (lane l: rows l, l+32, ...). */
__device__ __forceinline__ void wx_unit_prefetch(const wx_fp8_piece *pieces,
                                                 const wx_fp8_inline &inl, int n,
                                                 unsigned char *out, wx_i64 ntiles, wx_i64 t)
{
    if (threadIdx.x >= 32)
        return;
    const char *src[WX_UNIT];
    wx_i64 ldb[WX_UNIT];
    int nr[WX_UNIT], nb[WX_UNIT];
#pragma unroll
    for (int i = 0; i < WX_UNIT; i++) {
        src[i] = 0;
        ldb[i] = 0;
        nr[i] = nb[i] = 0;
        if (t + i < ntiles) {
            wx_job j;
            wx_job_of(pieces, inl, n, t + i, out, j);
            src[i] = j.src;
            ldb[i] = j.ldb;
            nr[i] = wx_ringed(j) ? j.nr : 0;
            nb[i] = (2 * j.nc) & ~15; /* whole 16-byte chunks inside the row */
        }
    }
#pragma unroll
    for (int r = 0; r < WX_TILE / 32; r++) {
        const int row = r * 32 + threadIdx.x;
#pragma unroll
        for (int i = 0; i < WX_UNIT; i++)
            if (row < nr[i] && nb[i] > 0)
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                                 src[i] + (wx_i64)row * ldb[i]),
                             "r"(nb[i])
                             : "memory");
    }
}
#endif

/* Stage s gets tile t (when t < ntiles): its job for the quantizing threads, its copies
 * (variant 8: after the prefetch of its unit when it is the unit's first). */
__device__ __forceinline__ void wx_ring_put(const wx_fp8_piece *pieces, const wx_fp8_inline &inl,
                                            int n, unsigned char *out, wx_i64 ntiles, wx_i64 t,
                                            int s, wx_job *jobs, uint4 *ring, wx_u64 *bars)
{
#if WX_UNIT > 1
    if (t < ntiles && t % WX_UNIT == 0)
        wx_unit_prefetch(pieces, inl, n, out, ntiles, t);
#endif
    if (t < ntiles) {
        wx_job j;
        wx_job_of(pieces, inl, n, t, out, j);
        if (threadIdx.x == 0)
            jobs[s] = j;
        if (wx_ringed(j)) {
            wx_ring_fill(j, ring + (wx_i64)s * WX_TCH, bars + s);
            wx_ring_commit(bars + s);
            return;
        }
    }
#if WX_BULK
    wx_ring_skip(bars + s);
#endif
    wx_ring_commit(bars + s);
}

extern "C" __global__ void __launch_bounds__(WX_THREADS, WX_MINB)
    wx_fp8_quant(const wx_fp8_piece *pieces, int n, unsigned char *out, int ntiles,
                 const __grid_constant__ wx_fp8_inline inl)
{
    extern __shared__ __align__(128) uint4 ring[]; /* WX_STAGES x WX_TCH chunks (wx_fp8.c) */
    __shared__ wx_job jobs[WX_STAGES];
    __shared__ __align__(8) wx_u64 bars[WX_STAGES]; /* variant 7's mbarriers */
    __shared__ wx_u32 red[2][WX_WARPS];
    const wx_i64 g = gridDim.x, b = blockIdx.x;
    if (wx_tile_at(b, 0, g) >= ntiles)
        return;
    wx_ring_init(bars);
    for (int s = 0; s < WX_STAGES - 1; s++)
        wx_ring_put(pieces, inl, n, out, ntiles, wx_tile_at(b, s, g), s, jobs, ring, bars);
    /* k: tiles done by this CTA (ntiles < 2^31); its tiles increase with k */
    for (int k = 0; wx_tile_at(b, k, g) < ntiles; k++) {
        const int s = k % WX_STAGES;
        wx_ring_wait(bars + s, k);
        /* tile k's copies visible to all; every thread done with tile k-1's stage and job */
        __syncthreads();
        wx_ring_put(pieces, inl, n, out, ntiles, wx_tile_at(b, k + WX_STAGES - 1, g),
                    (s + WX_STAGES - 1) % WX_STAGES, jobs, ring, bars);
        const wx_job j = jobs[s];
        if (j.dt == 2) {
            wx_tile32(j, red[k & 1]);
            continue;
        }
        uint4 v[WX_NCH];
        if (wx_ringed(j))
            wx_ring_read(ring + (wx_i64)s * WX_TCH, v);
        else
            wx_load16(j, v);
        if (j.dt == 0)
            wx_tile16<0>(j, v, red[k & 1]);
        else
            wx_tile16<1>(j, v, red[k & 1]);
    }
}
