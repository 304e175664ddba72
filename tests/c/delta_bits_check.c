/* delta_bits_check.c - the fused delta kernel's bitmask writes of WX_DBITS (wx_dbits_row of
 * csrc/prepare/wx_delta_kernel.cu: a tile row's 8 threads gather its bits by shuffles and write
 * the words the row owns with plain stores) against the bitmask contract (bit i set for every
 * changed byte i, ORed into what was there), on the CPU. C++: tests/test_delta_vec_access.py
 * copies the helper's text out of the kernel source into delta_bits_helper.h and builds this with
 * `cc -x c++ -DWX_DBITS=1 (or 2) -I<that dir> -I csrc/prepare` (wx_dev.cuh: wx_set_bits).
 *
 * One warp (4 tile rows of 8 threads) is run lane by lane; __shfl_down_sync is emulated by
 * replay: pass k knows every lane's input of the warp's first k shuffles, and only the last pass
 * writes the bitmask. For random row offsets (32- or 128-aligned where the tile owns its rows'
 * words, any otherwise), row lengths nc 1..128 (the changed bytes only below nc), rows outside the
 * tile, a 16-byte aligned bitmask or not: the words after the call equal the words before (random,
 * the tile rows' own bits cleared as the caller's clearing leaves them; rows past the tile keep
 * theirs) ORed with the changed bytes'
 * bits, and no other word changed. Prints "ok <cases>" and exits 0, or the first mismatch. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define __device__
#define __forceinline__ inline
#define WX_TILE 128
typedef unsigned int wx_u32;
typedef unsigned long long wx_u64;
struct uint4 {
    unsigned x, y, z, w;
};
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

static struct {
    unsigned x;
} threadIdx;
static unsigned atomicOr(unsigned *p, unsigned v)
{
    unsigned o = *p;
    *p = o | v;
    return o;
}

/* The replay: g_in[k][lane] is lane's input to the warp's k-th shuffle (known for k < g_pass). */
#define NSHFL 8
static unsigned g_in[NSHFL][32];
static int g_pass, g_k;
static unsigned __shfl_down_sync(unsigned, unsigned v, int delta)
{
    const int lane = (int)(threadIdx.x & 31), k = g_k++;
    if (k >= NSHFL)
        abort();
    g_in[k][lane] = v;
    if (k >= g_pass)
        return 0; /* not known yet: this pass's writes are thrown away */
    return lane + delta < 32 ? g_in[k][lane + delta] : v;
}

#include "wx_dev.cuh"

#include "delta_bits_helper.h"

#define NW 256 /* words of the test's bitmask: 8192 bytes of shadow */

int main(void)
{
    alignas(16) static wx_u32 words[NW + 4], scratch[NW + 4], ref[NW + 4];
    long cases = 0;
    srand(7);
    for (int it = 0; it < 20000; it++) {
        const int own = rand() % 3 != 0, nc = rand() % 3 ? 128 : 1 + rand() % 128;
        const int boff = rand() % 2; /* the bitmask's base: 16-aligned, or 4 past */
        int pitch = nc + rand() % 300, base = rand() % 512;
        if (own) {
            pitch = (pitch + 31) / 32 * 32;
            base = rand() % 2 ? base / 128 * 128 : base / 32 * 32;
            if (rand() % 2)
                pitch = (pitch + 127) / 128 * 128;
        }
        const int nr = rand() % 5; /* rows of the warp's 4 inside the tile */
        wx_u32 d[32];
        wx_u32 *bits = words + boff;
        for (int i = 0; i < NW; i++)
            words[i] = (wx_u32)rand() ^ ((wx_u32)rand() << 16);
        for (int r = 0; r < nr; r++) /* the clearing of the tile's rows (others: not its own) */
            for (int b = 0; b < nc; b++) {
                const wx_u64 pos = (wx_u64)base + (wx_u64)r * pitch + b;
                bits[pos >> 5] &= ~(1u << (pos & 31));
            }
        memcpy(ref, words, sizeof words);
        for (int lane = 0; lane < 32; lane++) {
            const int r = lane / 8, col = (lane % 8) * 16, nb = nc - col < 16 ? nc - col : 16;
            d[lane] = 0;
            if (r < nr && nb > 0) {
                d[lane] = (wx_u32)rand() & ((1u << nb) - 1);
                if (rand() % 4 == 0)
                    d[lane] = 0;
                for (int b = 0; b < 16; b++)
                    if (d[lane] >> b & 1) {
                        const wx_u64 pos = (wx_u64)base + (wx_u64)r * pitch + col + b;
                        (ref + boff)[pos >> 5] |= 1u << (pos & 31);
                    }
            }
        }
        for (g_pass = 0; g_pass <= NSHFL; g_pass++) {
            const int last = g_pass == NSHFL;
            if (!last)
                memcpy(scratch, words, sizeof words);
            for (int lane = 0; lane < 32; lane++) {
                const int r = lane / 8, col = (lane % 8) * 16;
                threadIdx.x = (unsigned)lane;
                g_k = 0;
                wx_dbits_row((last ? words : scratch) + boff,
                             (wx_u64)base + (wx_u64)r * pitch + col, d[lane], col, nc, own, r < nr);
            }
        }
        cases++;
        for (int i = 0; i < NW + 4; i++)
            if (words[i] != ref[i]) {
                printf("case %d (own %d, nc %d, pitch %d, base %d, nr %d, bitmask +%d): word %d is "
                       "%08x, expected %08x\n",
                       it, own, nc, pitch, base, nr, 4 * boff, i - boff, words[i], ref[i]);
                return 1;
            }
    }
    printf("ok %ld\n", cases);
    return 0;
}
