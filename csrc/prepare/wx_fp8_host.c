/* wx_fp8_host.c - block-FP8 quantization of host memory (wx_fp8_host.h). */
#include "wx_fp8_host.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

#include "wx_common.h"
#include "wx_fp8.h"

#define WX__T WX_FP8_TILE

uint8_t wx_fp8_e4m3(float x)
{
    uint32_t u = wx_f32_bits(x), sign = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    int32_t e = (int32_t)(a >> 23) - 127;
    uint32_t sig = (a & 0x7fffffu) | 0x800000u, k;
    if (a > 0x7f800000u) /* NaN */
        return (uint8_t)(sign | 0x7f);
    if ((a >> 23) == 0) /* zero, float32 subnormals: far below e4m3's 2^-9 */
        return (uint8_t)sign;
    if (e >= -6) { /* normal: 3 mantissa bits, to nearest even (a carry moves the exponent) */
        uint32_t rem = sig & 0xfffffu, half = 0x80000u;
        k = (uint32_t)(e + 7) << 3 | ((sig >> 20) & 7);
        if (rem > half || (rem == half && (k & 1)))
            k++;
        return (uint8_t)(sign | k);
    }
    /* subnormal: k units of 2^-9 (k = 8 is the smallest normal, 0x08) */
    int shift = 14 - e; /* sig is 1.m x 2^23 units of 2^(e-23) */
    if (shift > 25)
        return (uint8_t)sign;
    k = sig >> shift;
    uint32_t rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (k & 1)))
        k++;
    return (uint8_t)(sign | k);
}

/* Element (r, c) of the piece as float32 (exact for bf16 and f16). */
static float wx__at(const void *src, int dtype, int64_t ld, int64_t r, int64_t c)
{
    int64_t i = r * ld + c;
    if (dtype == WX_FP8_F32)
        return ((const float *)src)[i];
    uint16_t h = ((const uint16_t *)src)[i];
    if (dtype == WX_FP8_BF16)
        return wx_f32_of((uint32_t)h << 16);
    /* IEEE half */
    uint32_t s = (uint32_t)(h & 0x8000) << 16, ex = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (ex == 0x1f)
        return wx_f32_of(s | 0x7f800000u | (m << 13));
    if (ex)
        return wx_f32_of(s | ((ex + 112) << 23) | (m << 13));
    return (s ? -1.0f : 1.0f) * (float)m * 0x1p-24f; /* subnormal or zero: exact */
}

/* One block row [r0, r1) of the piece: amax and the scales, then the bytes, each block read
 * from a float32 copy of it (the source converted once). */
static void wx__block_row(const void *src, int dtype, int64_t ld, int64_t r0, int64_t r1,
                          int64_t cols, uint8_t *q, uint8_t *scales)
{
    float blk[WX__T * WX__T];
    int64_t cb = (cols + WX__T - 1) / WX__T;
    for (int64_t c0 = 0; c0 < cols; c0 += WX__T) {
        int64_t c1 = c0 + WX__T < cols ? c0 + WX__T : cols, w = c1 - c0, n = 0;
        float amax = 0.0f;
        int nan = 0;
        for (int64_t r = r0; r < r1; r++) {
            float *b = blk + n;
            if (dtype == WX_FP8_BF16) {
                const uint16_t *h = (const uint16_t *)src + r * ld + c0;
                for (int64_t c = 0; c < w; c++) {
                    uint32_t u = (uint32_t)h[c] << 16;
                    memcpy(&b[c], &u, 4);
                }
            } else {
                for (int64_t c = 0; c < w; c++)
                    b[c] = wx__at(src, dtype, ld, r, c0 + c);
            }
            for (int64_t c = 0; c < w; c++) {
                float a = b[c] < 0 ? -b[c] : b[c];
                nan |= b[c] != b[c];
                amax = a > amax ? a : amax;
            }
            n += w;
        }
        if (nan)
            amax = wx_f32_of(0x7fc00000u);
        float s = (amax < 1e-12f ? 1e-12f : amax) / 448.0f;
        if (scales)
            memcpy(scales + 4 * ((r0 / WX__T) * cb + c0 / WX__T), &s, 4);
        if (!q)
            continue;
        n = 0;
        for (int64_t r = r0; r < r1; r++, n += w) {
            uint8_t *o = q + r * cols + c0;
            for (int64_t c = 0; c < w; c++) {
                float x = blk[n + c] / s;
                x = x > 448.0f ? 448.0f : (x < -448.0f ? -448.0f : x);
                o[c] = wx_fp8_e4m3(x);
            }
        }
    }
}

struct wx__job {
    const void *src;
    int dtype, nthreads, id;
    int64_t ld, rows, cols;
    uint8_t *q, *scales;
};

static void *wx__worker(void *arg)
{
    struct wx__job *j = arg;
    int64_t nb = (j->rows + WX__T - 1) / WX__T;
    for (int64_t b = j->id; b < nb; b += j->nthreads) {
        int64_t r0 = b * WX__T, r1 = r0 + WX__T < j->rows ? r0 + WX__T : j->rows;
        wx__block_row(j->src, j->dtype, j->ld, r0, r1, j->cols, j->q, j->scales);
    }
    return NULL;
}

int wx_fp8_host(const void *src, int dtype, int64_t ld, int64_t rows, int64_t cols, uint8_t *q,
                uint8_t *scales, int nthreads)
{
    if (!src || rows < 0 || cols < 0 || ld < cols)
        return wx_errf(-EINVAL, "fp8 host: a %lldx%lld piece with row pitch %lld", (long long)rows,
                       (long long)cols, (long long)ld);
    if (dtype != WX_FP8_BF16 && dtype != WX_FP8_F16 && dtype != WX_FP8_F32)
        return wx_errf(-EINVAL, "fp8 host: dtype %d", dtype);
    int64_t nb = (rows + WX__T - 1) / WX__T;
    if (nthreads < 1 || nthreads > 64)
        return wx_errf(-EINVAL, "fp8 host: %d threads (expected 1 to 64)", nthreads);
    if (nthreads > nb)
        nthreads = (int)(nb > 0 ? nb : 1);
    struct wx__job jobs[64];
    pthread_t th[64];
    int started = 1;
    for (int i = 0; i < nthreads; i++)
        jobs[i] = (struct wx__job){src, dtype, nthreads, i, ld, rows, cols, q, scales};
    for (int i = 1; i < nthreads; i++, started++) /* block rows i, i + n, ...: the others' */
        if (pthread_create(&th[i], NULL, wx__worker, &jobs[i]))
            break;
    if (started < nthreads) /* a thread could not start: this one does its rows too */
        for (int i = started; i < nthreads; i++)
            wx__worker(&jobs[i]);
    wx__worker(&jobs[0]);
    for (int i = 1; i < started; i++)
        pthread_join(th[i], NULL);
    return 0;
}
