/* wx_copy_kernel.cu - many device-to-device copies in one launch (see wx_copy.h).
 *
 * Compiled with NVRTC at first use (wx_copy.c). The copies are cut into chunks of
 * WX_CHUNK bytes; range i holds chunks [chunk0, chunk0 + ceil(nbytes / WX_CHUNK)). The
 * grid is persistent: CTA b takes chunks b, b + gridDim.x, ..., finds each chunk's range by
 * a binary search over the ranges' chunk0, and copies it with 16-byte loads and stores when
 * source and destination are both 16-byte aligned there (else byte by byte). WX_UNROLL loads
 * in flight per thread before their stores, so each SM keeps enough bytes moving.
 */
#include "wx_dev.cuh" /* wx_last_le (handed to NVRTC in memory by wx_copy.c) */

#define WX_CHUNK (64u * 1024u)
#define WX_THREADS 256
#ifndef WX_UNROLL
#define WX_UNROLL 4 /* 16-byte loads in flight per thread (a benchmark build may set it) */
#endif

struct wx_copy_range {
    unsigned long long dst, src, nbytes, chunk0;
};

typedef unsigned long long u64;

/* The range holding chunk c: the last i with chunk0 <= c. */
static __device__ __forceinline__ int wx_find(const wx_copy_range *r, int n, u64 c)
{
    return wx_last_le<wx_copy_range, &wx_copy_range::chunk0>(r, n, c);
}

static __device__ __forceinline__ void wx_copy_vec(uint4 *d, const uint4 *s, u64 nv)
{
    for (u64 base = threadIdx.x; base < nv; base += (u64)WX_THREADS * WX_UNROLL) {
        uint4 v[WX_UNROLL];
#pragma unroll
        for (int j = 0; j < WX_UNROLL; j++) {
            u64 k = base + (u64)j * WX_THREADS;
            if (k < nv)
                v[j] = __ldg(s + k);
        }
#pragma unroll
        for (int j = 0; j < WX_UNROLL; j++) {
            u64 k = base + (u64)j * WX_THREADS;
            if (k < nv)
                d[k] = v[j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(WX_THREADS)
    wx_copy_ranges(const wx_copy_range *r, int n, u64 nchunks)
{
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        int i = wx_find(r, n, c);
        u64 off = (c - r[i].chunk0) * WX_CHUNK, len = r[i].nbytes - off;
        if (len > WX_CHUNK)
            len = WX_CHUNK;
        unsigned char *d = (unsigned char *)(r[i].dst + off);
        const unsigned char *s = (const unsigned char *)(r[i].src + off);
        u64 head = 0;
        if ((((u64)d | (u64)s) & 15u) == 0) {
            head = len & ~(u64)15;
            wx_copy_vec((uint4 *)d, (const uint4 *)s, head >> 4);
        }
        for (u64 k = head + threadIdx.x; k < len; k += WX_THREADS)
            d[k] = s[k];
    }
}
