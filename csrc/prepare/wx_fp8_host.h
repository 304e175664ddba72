/* wx_fp8_host.h - block-FP8 quantization of host memory (the CPU's stage 2; issue 36).
 *
 * The same bytes as wxfer.mapping.reference.quantize_fp8_block (and the GPU kernel, wx_fp8.h):
 * per 128 x 128 block, amax of |x| in float32, scale = max(amax, 1e-12f) / 448 (IEEE float
 * division), each element x / scale (IEEE), clamped to +-448, rounded to e4m3fn to nearest
 * even; the scales float32, row-major [ceil(rows/128), ceil(cols/128)]. One pass per block
 * row, no temporaries (a 64 KiB float32 copy of the block on the stack). Plain C: returns 0 or -EINVAL (wx_errf says which argument). */
#ifndef WX_FP8_HOST_H
#define WX_FP8_HOST_H

#include <stdint.h>
#include <string.h>

/* The bits of float32 f, and the float32 of bits u (also tests/c/fp8_div_check.c's). */
static inline uint32_t wx_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float wx_f32_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The e4m3fn byte of float x, |x| <= 448 (NaN: 0x7f with x's sign), rounded to nearest even. */
uint8_t wx_fp8_e4m3(float x);

/* Quantize the rows x cols piece at src (dtype WX_FP8_BF16 / F16 / F32 of wx_fp8.h, `ld`
 * elements between rows, unit column stride): its e4m3 bytes row-major at q (NULL: none), its
 * float32 scales at scales (NULL: none); its 128-row block rows shared among `nthreads`
 * threads (1 to 64: this one and nthreads - 1 started here, joined before it returns). */
int wx_fp8_host(const void *src, int dtype, int64_t ld, int64_t rows, int64_t cols, uint8_t *q,
                uint8_t *scales, int nthreads);

#endif
