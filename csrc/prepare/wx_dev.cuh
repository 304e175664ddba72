/* wx_dev.cuh - device helpers shared by the prepare kernels: the batched copy
 * (wx_copy_kernel.cu) and the delta kernels (wx_delta_kernel.cu, wx_delta_ops_kernel.cu).
 *
 * No system header. Their launchers (wx_copy.c, wx_delta.c, wx_sweep.c) hand it to NVRTC as an
 * in-memory header under this name; setup.py embeds it with the kernels (build/gen/wx_dev_src.h).
 */
#ifndef WX_DEV_CUH
#define WX_DEV_CUH

typedef unsigned int wx_u32;
typedef unsigned long long wx_u64;
typedef long long wx_i64;

/* The last i with r[i].*K <= key, for r[0].*K == 0 and the K increasing (a persistent grid's
 * work item `key` in the table of ranges that holds it). */
template <typename T, wx_u64 T::*K>
__device__ __forceinline__ int wx_last_le(const T *r, int n, wx_u64 key)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (r[mid].*K <= key)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* OR the 32-bit mask m into the bitmask at bit pos (two words at most). */
__device__ __forceinline__ void wx_set_bits(wx_u32 *bits, wx_u64 pos, wx_u32 m)
{
    if (!m)
        return;
    wx_u64 x = (wx_u64)m << (pos & 31);
    wx_u32 *w = bits + (pos >> 5);
    if ((wx_u32)x)
        atomicOr(w, (wx_u32)x);
    if ((wx_u32)(x >> 32))
        atomicOr(w + 1, (wx_u32)(x >> 32));
}

#endif
