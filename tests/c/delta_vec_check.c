/* delta_vec_check.c - the fused delta kernel's shadow accesses (wx_align_of, wx_old16 and
 * wx_put16 of csrc/prepare/wx_delta_kernel.cu: 16, 8 or 4 bytes at a time as the rows are
 * aligned, else bytes) against plain byte copies, on the CPU. C++ (the helpers take references):
 * tests/test_delta_vec_access.py copies the helpers' text out of the kernel source into
 * delta_vec_helpers.h and builds this with `cc -x c++ -I<that dir>`. For random alignments,
 * lengths (multiples of 4 where the alignment is 4 or more: a row's length is) and change masks:
 * wx_old16 gives exactly the nb bytes (zero above), and wx_put16 leaves exactly the new bytes in
 * [0, nb) and nothing else touched. Prints "ok <cases>" and exits 0, or the first mismatch. */
#include <stdio.h>
#include <stdlib.h>

#define __device__
#define __forceinline__ inline
typedef unsigned int wx_u32;
typedef unsigned long long wx_u64;
struct uint4 {
    unsigned x, y, z, w;
};
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

#include "delta_vec_helpers.h"

int main(void)
{
    alignas(16) unsigned char buf[64], ref[64], nw[16];
    long n = 0;
    srand(1);
    for (int it = 0; it < 200000; it++) {
        const int salign = rand() % 16, al = wx_align_of(salign);
        const int off = al == 16 ? 16 : al == 8 ? 24 : al == 4 ? 20 : 17 + 2 * (rand() % 2);
        int nb = al >= 4 ? 4 * (1 + rand() % 4) : 1 + rand() % 16;
        wx_u64 lo, hi, l2 = 0, h2 = 0;
        wx_u32 m = 0;
        if (((salign & 15) == 0) != (al == 16) || (al == 8 && (salign & 7)) ||
            (al == 4 && (salign & 3))) {
            printf("wx_align_of(%d) = %d\n", salign, al);
            return 1;
        }
        for (int i = 0; i < 64; i++)
            buf[i] = ref[i] = (unsigned char)rand();
        wx_old16(buf + off, nb, al, lo, hi);
        for (int k = 0; k < 16; k++) {
            const unsigned char b = (unsigned char)(k < 8 ? lo >> (8 * k) : hi >> (8 * (k - 8)));
            if (b != (k < nb ? buf[off + k] : 0)) {
                printf("wx_old16: al %d nb %d byte %d\n", al, nb, k);
                return 1;
            }
        }
        for (int k = 0; k < 16; k++) {
            nw[k] = k < nb ? buf[off + k] : 0;
            if (k < nb && rand() % 4 == 0) {
                nw[k] ^= (unsigned char)(1 + rand() % 255);
                m |= 1u << k;
            }
            if (k < 8)
                l2 |= (wx_u64)nw[k] << (8 * k);
            else
                h2 |= (wx_u64)nw[k] << (8 * (k - 8));
        }
        wx_put16(buf + off, nb, al, m, l2, h2);
        for (int i = 0; i < 64; i++) {
            const int k = i - off;
            if (buf[i] != (k >= 0 && k < nb ? nw[k] : ref[i])) {
                printf("wx_put16: al %d nb %d byte %d\n", al, nb, i);
                return 1;
            }
        }
        n++;
    }
    printf("ok %ld\n", n);
    return 0;
}
