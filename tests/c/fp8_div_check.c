/* fp8_div_check.c - exhaustive check of the FP8 kernel's fast division (WX_FASTDIV in
 * csrc/prepare/wx_fp8_kernel.cu) against IEEE float32 division, on the CPU.
 *
 * The kernel divides every element a of a tile by the tile's scale s with
 *     r = RN(1/s); q0 = RN(a*r); t = RN(q0*s - a) (fma); q = RN(q0 - t*r) (fma)
 * and needs q == RN(a/s) bit for bit. Every step is exact up to a power of two in the
 * exponents as long as nothing leaves the normal range (the kernel's comment shows where
 * that holds for the quotients that matter), so q == RN(a/s) for all a, s iff it holds for
 * all significands of a and s, each in [1, 2). This program checks every pair:
 *   a: every significand of the source format (bfloat16: 8 bits, float16: 11 bits);
 *   s: every float32 significand (2^23 of them) with --all, else the scales the kernel can
 *      produce from that format (RN(amax / 448) for every significand of amax, and the
 *      1e-12 floor: RN(RN32(1e-12) / 448)).
 * It also checks signed zeros and subnormal a against every scale exponent.
 * Build: cc -O2 -ffp-contract=off -I csrc/prepare -o fp8_div_check fp8_div_check.c -lm
 * Prints "ok <pairs>" and exits 0, or prints the first mismatches and exits 1. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "wx_fp8_host.h" /* wx_f32_bits, wx_f32_of: the bit casts of the product */

static float fast_div(float a, float s, float r)
{
    float q0 = a * r;
    volatile float t = fmaf(q0, s, -a); /* volatile: no folding of -fma(x) into fma(-x) */
    return fmaf(-t, r, q0);             /* (compilers do it; it flips the sign of zeros) */
}

static long bad;

static void check(float a, float s)
{
    volatile float vs = s;
    float r = 1.0f / vs; /* SSE division: IEEE round to nearest, like rcp.rn.f32 */
    float q = fast_div(a, s, r), want = a / vs;
    if (wx_f32_bits(q) != wx_f32_bits(want) && bad++ < 10)
        printf("mismatch: a %a s %a: fast %a, a/s %a\n", a, s, q, want);
}

/* Every significand in [1, 2) with `bits` explicit fraction bits (as float32). */
static float sig(uint32_t i, int bits) { return wx_f32_of(0x3f800000u | (i << (23 - bits))); }

int main(int argc, char **argv)
{
    int all = argc > 1 && strcmp(argv[1], "--all") == 0;
    const int fmts[2] = {7, 10}; /* fraction bits: bfloat16, float16 */
    long pairs = 0;
    float floor_s = (float)1e-12f / 448.0f;
    for (int f = 0; f < 2; f++) {
        int fb = fmts[f];
        uint32_t na = 1u << fb;
        for (uint32_t i = 0; i < na; i++) {
            float a = sig(i, fb);
            if (all) {
                for (uint32_t j = 0; j < (1u << 23); j++)
                    check(a, wx_f32_of(0x3f800000u | j));
                pairs += 1l << 23;
            } else {
                for (uint32_t j = 0; j < na; j++) {
                    float s = sig(j, fb) / 448.0f;
                    check(a, s);
                    check(-a, s);
                    check(a, s * 256.0f); /* other exponents: same significands */
                }
                pairs += 3l * na;
            }
            check(a, floor_s);
            check(a * 0x1p-40f, floor_s);
            pairs += 2;
        }
    }
    /* signed zeros and subnormal a (quotients far below e4m3's smallest subnormal: what
     * matters is the sign and |q| < 2^-10) against scales from the floor to FLT_MAX/448 */
    for (int e = -48; e <= 119; e++) {
        float s = ldexpf(1.3f, e), r = 1.0f / s;
        volatile float zs[2] = {0.0f, -0.0f};
        for (int z = 0; z < 2; z++) {
            float q = fast_div(zs[z], s, r);
            if (wx_f32_bits(q) != wx_f32_bits(zs[z]) && bad++ < 10)
                printf("signed zero: a %a s %a: fast %a\n", zs[z], s, q);
        }
        for (uint32_t m = 1; m < (1u << 23); m = m * 3 + 1) {
            float a = wx_f32_of(m), q = fast_div(a, s, r), qn = fast_div(-a, s, r);
            if ((fabsf(q) >= 0x1p-10f || signbit(q) || !signbit(qn) || fabsf(qn) >= 0x1p-10f) &&
                bad++ < 10)
                printf("subnormal a %a s %a: fast %a, %a\n", a, s, q, qn);
            pairs += 2;
        }
    }
    if (bad) {
        printf("%ld mismatches\n", bad);
        return 1;
    }
    printf("ok %ld pairs\n", pairs);
    return 0;
}
