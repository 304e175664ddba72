/* wx_fp8_pipe.cu - the persistent loop of the FP8 kernel, fed through shared memory.
 * Included by wx_fp8_kernel.cu after its tile code (wx_job, wx_tile16, wx_tile32); wx_fp8.c
 * hands it to NVRTC as a header, setup.py embeds it too.
 *
 * CTA b takes tiles b, b + G, b + 2G, ... (G = gridDim.x) and keeps a ring of WX_STAGES
 * 32 KiB tile buffers in shared memory: while tile k is reduced and quantized, the copies of
 * tiles k+1 .. k+WX_STAGES-1 are in flight, and none of them holds a register. Little's law:
 * ~4 TB/s at ~1 us of loaded DRAM latency needs ~4 MB in flight, ~30 KiB per SM; the ring
 * keeps (WX_STAGES-1) x 32 KiB x CTAs per SM (128 KiB at 2 x 3) in flight. Each thread
 * copies 8 chunks of 16 bytes with cp.async (zero-filled outside the piece: partial tiles
 * read as zeros), one commit group per tile, waited for with cp.async.wait_group. Float32
 * tiles and sources whose rows are not 16-byte aligned are read from global memory when they
 * are quantized; the tile's elements reach the same registers either way (wx_tile16), so the
 * bytes are the same. */

#if WX_K != 2 || WX_THREADS != 256
#error "wx_fp8_pipe.cu expects its layout (16 elements a thread and row, 256 threads)"
#endif
#ifndef WX_STAGES
#error "WX_STAGES (tile buffers per CTA) comes from wx_fp8.c, which sizes the shared memory"
#endif
#if WX_STAGES < 2
#error "WX_STAGES must be at least 2"
#endif
#define WX_TCH (WX_TILE * WX_TILE * 2 / 16) /* 16-byte chunks of a 16-bit tile (2048) */
#define WX_RCH (WX_TILE * 2 / 16)           /* chunks of a tile row (16) */

/* The CTA's k-th tile. */
__device__ __forceinline__ wx_i64 wx_tile_at(wx_i64 b, int k, wx_i64 g)
{
    return b + (wx_i64)k * g;
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
    return j.dt != 2 && j.lvec;
}

/* The thread's 8 chunks of the tile in buf, into the registers wx_load16 fills: v[2p + k] is chunk
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

/* cp.async of the tile's chunks into buf: chunk q = p*256 + tid (row q/16, chunk q%16 of
 * the row; a warp copies 512 contiguous bytes of two rows), zero-filled outside [nr, nc). */
__device__ __forceinline__ void wx_ring_fill(const wx_job &j, uint4 *buf)
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

__device__ __forceinline__ void wx_ring_commit(void)
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Wait for tile k (stage s) of this thread's copies; the caller's barrier makes every
 * thread's copies visible. */
__device__ __forceinline__ void wx_ring_wait(void)
{
    asm volatile("cp.async.wait_group %0;" ::"n"(WX_STAGES - 2) : "memory");
}

/* The ring's steps as the loop below takes them: these defaults, or a sweep variant's
 * (benchmarks/kernels/sweep_fp8_pipe.cu defines its own first: units of adjacent tiles, TMA
 * copies completing on an mbarrier per stage s). */
#ifndef WX_TILE_AT
#define WX_TILE_AT(b, k, g) wx_tile_at(b, k, g)
#endif
#ifndef WX_RINGED
#define WX_RINGED(j) wx_ringed(j)
#endif
#ifndef WX_RING_FILL
#define WX_RING_FILL(j, buf, s) wx_ring_fill(j, buf)
#define WX_RING_COMMIT(s) wx_ring_commit()
#define WX_RING_SKIP(s) wx_ring_commit() /* an empty group: the wait counts one per stage */
#define WX_RING_WAIT(s, k) wx_ring_wait()
#endif

/* Stage s gets tile t (when t < ntiles): its job for the quantizing threads, its copies. */
__device__ __forceinline__ void wx_ring_put(const wx_fp8_piece *pieces, const wx_fp8_inline &inl,
                                            int n, unsigned char *out, wx_i64 ntiles, wx_i64 t,
                                            int s, wx_job *jobs, uint4 *ring)
{
    if (t < ntiles) {
        wx_job j;
        wx_job_of(pieces, inl, n, t, out, j);
#ifdef WX_RING_HOOK
        WX_RING_HOOK(j, s, ring); /* wx_delta_kernel.cu: the tile's shadow bytes fetched ahead */
#endif
        if (threadIdx.x == 0)
            jobs[s] = j;
        if (WX_RINGED(j)) {
            WX_RING_FILL(j, ring + (wx_i64)s * WX_TCH, s);
            WX_RING_COMMIT(s);
            return;
        }
    }
    WX_RING_SKIP(s);
}

/* The shared memory of the persistent loop, declared by each kernel that runs it (so that the
 * arrays keep the kernel's name in the PTX): the ring of WX_STAGES x WX_TCH chunks (sized by
 * the launcher: wx_fp8.c, wx_delta.c), the stages' jobs, the reduction's two buffers. */
#define WX_RING_SHARED                                                                             \
    extern __shared__ __align__(128) uint4 ring[];                                                 \
    __shared__ wx_job jobs[WX_STAGES];                                                             \
    __shared__ wx_u32 red[2][WX_WARPS]

/* The persistent loop over this CTA's tiles, each handed to the tile code T once its bytes are
 * in: t.tile32(j, red) for a float32 source (read from global memory), else
 * t.tile16<DT>(j, v, red, ring, s) (DT 0 bfloat16, 1 float16) with the thread's chunks v and
 * the tile's stage s; before either, t.next(pieces, inl, n, out, ntiles, t1) with the CTA's
 * next tile t1 (ntiles or more: none). t.first(pieces, inl, n, out, t0, ring) comes before the
 * ring's first copies (t0: the CTA's first tile), t.ahead(jobs + s, jobs + s1, more, ring) after
 * each tile's barrier, before the next copies into the ring (s1: the next tile's stage, its job in
 * place when more; WX_STAGES >= 3). The FP8 kernel's T (below) writes the FP8 bytes; the fused delta
 * kernel's (wx_delta_kernel.cu) compares them with the shadow and marks the changes. */
template <typename T>
__device__ __forceinline__ void wx_ring_loop(const wx_fp8_piece *pieces, int n, unsigned char *out,
                                             int ntiles, const wx_fp8_inline &inl, const T &t,
                                             uint4 *ring, wx_job *jobs, wx_u32 (*red)[WX_WARPS])
{
    const wx_i64 g = gridDim.x, b = blockIdx.x;
    if (WX_TILE_AT(b, 0, g) >= ntiles)
        return;
    t.first(pieces, inl, n, out, WX_TILE_AT(b, 0, g), ring);
    for (int s = 0; s < WX_STAGES - 1; s++)
        wx_ring_put(pieces, inl, n, out, ntiles, WX_TILE_AT(b, s, g), s, jobs, ring);
    /* k: tiles done by this CTA (ntiles < 2^31); its tiles increase with k */
    for (int k = 0; WX_TILE_AT(b, k, g) < ntiles; k++) {
        const int s = k % WX_STAGES;
        WX_RING_WAIT(s, k);
        /* tile k's copies visible to all; every thread done with tile k-1's stage and job */
        __syncthreads();
        t.ahead(jobs + s, jobs + (s + 1) % WX_STAGES, WX_TILE_AT(b, k + 1, g) < ntiles, ring);
        wx_ring_put(pieces, inl, n, out, ntiles, WX_TILE_AT(b, k + WX_STAGES - 1, g),
                    (s + WX_STAGES - 1) % WX_STAGES, jobs, ring);
        const wx_job j = jobs[s];
        t.next(pieces, inl, n, out, ntiles, WX_TILE_AT(b, k + 1, g));
        if (j.dt == 2) {
            t.tile32(j, red[k & 1]);
            continue;
        }
        uint4 v[WX_NCH];
        if (WX_RINGED(j))
            wx_ring_read(ring + (wx_i64)s * WX_TCH, v);
        else
            wx_load16(j, v);
        if (j.dt == 0)
            t.template tile16<0>(j, v, red[k & 1], ring, s);
        else
            t.template tile16<1>(j, v, red[k & 1], ring, s);
    }
}

/* The FP8 kernel's tile code: quantize, write the bytes and the scale. */
struct wx_fp8_tiles {
    __device__ __forceinline__ void first(const wx_fp8_piece *, const wx_fp8_inline &, int,
                                          unsigned char *, wx_i64, uint4 *) const
    {
    }
    __device__ __forceinline__ void ahead(const wx_job *, const wx_job *, bool, uint4 *) const
    {
    }
    __device__ __forceinline__ void next(const wx_fp8_piece *, const wx_fp8_inline &, int,
                                         unsigned char *, int, wx_i64) const
    {
    }
    __device__ __forceinline__ void tile32(const wx_job &j, wx_u32 *red) const
    {
        wx_tile32(j, red);
    }
    template <int DT>
    __device__ __forceinline__ void tile16(const wx_job &j, const uint4 *v, wx_u32 *red, uint4 *,
                                           int) const
    {
        wx_tile16<DT>(j, v, red);
    }
};

extern "C" __global__ void __launch_bounds__(WX_THREADS, WX_MINB)
    wx_fp8_quant(const wx_fp8_piece *pieces, int n, unsigned char *out, int ntiles,
                 const __grid_constant__ wx_fp8_inline inl)
{
    WX_RING_SHARED;
#ifdef WX_RING_INIT
    WX_RING_INIT; /* a sweep variant's mbarriers (sweep_fp8_pipe.cu) */
#endif
    wx_ring_loop(pieces, n, out, ntiles, inl, wx_fp8_tiles(), ring, jobs, red);
}
