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
 * the same.
 *
 * The loop, the cp.async copies and the kernel are the product's (csrc/prepare/wx_fp8_pipe.cu,
 * included below): variant 6 is the product kernel as it is; 7 and 8 define the ring's steps
 * the product takes as macros (WX_TILE_AT, WX_RINGED, WX_RING_FILL/COMMIT/SKIP/WAIT,
 * WX_RING_HOOK, WX_RING_INIT) before including it. */

#ifndef WX_STAGES
#define WX_STAGES (WX_MINB == 1 ? 6 : WX_MINB == 2 ? 3 : 2) /* = wx__stages() in wx_fp8.c */
#endif
#define WX_BULK (WX_VARIANT == 7)
#define WX_UNIT (WX_VARIANT == 8 ? 4 : 1) /* adjacent tiles a CTA takes in a row */

#if WX_BULK
__shared__ __align__(8) wx_u64 wx_bars[WX_STAGES]; /* the stages' mbarriers */
__device__ __forceinline__ void wx_bulk_fill(const wx_job &j, uint4 *buf, wx_u64 *bar);
__device__ __forceinline__ void wx_bulk_skip(wx_u64 *bar);
__device__ __forceinline__ void wx_bulk_wait(wx_u64 *bar, int k);
__device__ __forceinline__ void wx_bulk_init(wx_u64 *bar);
/* only whole tiles are copied by the TMA engine; the others take variant 3's loads */
#define WX_RINGED(j) (wx_ringed(j) && (j).nr == WX_TILE && (j).nc == WX_TILE)
#define WX_RING_FILL(j, buf, s) wx_bulk_fill(j, buf, wx_bars + (s))
#define WX_RING_COMMIT(s)
#define WX_RING_SKIP(s) wx_bulk_skip(wx_bars + (s))
#define WX_RING_WAIT(s, k) wx_bulk_wait(wx_bars + (s), k)
#define WX_RING_INIT wx_bulk_init(wx_bars)
#endif

#if WX_UNIT > 1
/* The CTA's k-th tile: units of WX_UNIT consecutive tiles, unit m of CTA b being b + m*G. */
__device__ __forceinline__ wx_i64 wx_unit_tile_at(wx_i64 b, int k, wx_i64 g)
{
    return WX_UNIT * (b + (wx_i64)(k / WX_UNIT) * g) + k % WX_UNIT;
}
__device__ __forceinline__ void wx_unit_prefetch(const wx_fp8_piece *pieces,
                                                 const wx_fp8_inline &inl, int n,
                                                 unsigned char *out, wx_i64 ntiles, wx_i64 t);
#define WX_TILE_AT(b, k, g) wx_unit_tile_at(b, k, g)
/* in wx_ring_put, where pieces .. t are its parameters: a unit's first tile prefetches it */
#define WX_RING_HOOK(j, s, ring)                                                                   \
    do {                                                                                           \
        if (t % WX_UNIT == 0)                                                                      \
            wx_unit_prefetch(pieces, inl, n, out, ntiles, t);                                      \
    } while (0)
#endif

#include "wx_fp8_pipe.cu"

#if WX_BULK
/* The stage's mbarrier expects 32 KiB, then warp 0 copies the 128 rows (4 a lane). */
__device__ __forceinline__ void wx_bulk_fill(const wx_job &j, uint4 *buf, wx_u64 *bar)
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
__device__ __forceinline__ void wx_bulk_skip(wx_u64 *bar)
{
    if (threadIdx.x == 0)
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(wx_saddr(bar)) : "memory");
}

/* Wait for use k / WX_STAGES of the stage's mbarrier (phase parity (k / WX_STAGES) & 1). */
__device__ __forceinline__ void wx_bulk_wait(wx_u64 *bar, int k)
{
    const wx_u32 b = wx_saddr(bar), par = (wx_u32)((k / WX_STAGES) & 1);
    asm volatile("{\n\t.reg .pred p;\n"
                 "WX_WAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
                 "@!p bra WX_WAIT;\n}" ::"r"(b),
                 "r"(par)
                 : "memory");
}

__device__ __forceinline__ void wx_bulk_init(wx_u64 *bar)
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
