/* wx_fp8.h - block-FP8 quantization on the GPU: many pieces, one launch.
 *
 * A piece is a 2-D row-major view (row pitch `ld` elements, unit column stride) of
 * bfloat16, float16 or float32 in device memory: a row/column slice of a full tensor or one
 * expert of a 3-D one. Its e4m3 bytes (rows*cols, row-major) and its float32 scales
 * ([ceil(rows/128), ceil(cols/128)], row-major) are written at byte offsets of one uint8
 * buffer `out`, any alignment; the bytes equal wxfer.mapping.reference.quantize_fp8_block's.
 * The kernel (wx_fp8_kernel.cu) is compiled with NVRTC at first use and cached per device
 * architecture (the binary) and per CUDA context (the loaded module); docs/prepare.md.
 */
#ifndef WX_FP8_H
#define WX_FP8_H

#include <stddef.h>
#include <stdint.h>

enum { WX_FP8_BF16 = 0, WX_FP8_F16 = 1, WX_FP8_F32 = 2 };
#define WX_FP8_TILE 128
#define WX_FP8_MAX_PIECES (1 << 20)
#define WX_FP8_INLINE 8 /* up to this many pieces may travel in the launch's parameters */

/* One piece; the layout is the kernel's struct wx_fp8_piece (8 x 64 bits). */
typedef struct wx_fp8_piece {
    uint64_t src;  /* device address of element [0, 0] */
    int64_t dtype; /* WX_FP8_* */
    int64_t ld;    /* elements between rows */
    int64_t rows, cols;
    int64_t q_off; /* byte offset in out of the fp8 bytes, or -1 for none */
    int64_t s_off; /* byte offset in out of the scales, or -1 for none */
    int64_t tile0; /* sum of the tile counts of the pieces before it */
} wx_fp8_piece_t;

/* Validate n pieces against an output of out_nbytes bytes: dtypes, sizes, element-aligned
 * sources, outputs inside out, tile0 the running tile count. Sets *ntiles (the grid).
 * Returns 0, or -EINVAL naming the piece and the field. Needs no GPU. */
int wx_fp8_check(const wx_fp8_piece_t *p, int n, uint64_t out_nbytes, uint64_t *ntiles);

/* The piece table as a launch's parameters carry it (the kernel's struct wx_fp8_inline). */
typedef struct wx_fp8_inline {
    wx_fp8_piece_t p[WX_FP8_INLINE];
} wx_fp8_inline_t;

/* A launch's piece table, of n pieces wx_fp8_check accepted: *inl zeroed, or holding host's
 * pieces when dev_pieces is 0 (at most WX_FP8_INLINE of them). `what` names the call in
 * messages. Returns 0 or -EINVAL. Shared by wx_fp8_launch and the fused delta kernel's
 * (wx_delta.c). */
int wx_fp8_table(const char *what, const wx_fp8_piece_t *host, uint64_t dev_pieces, int n,
                 wx_fp8_inline_t *inl);

/* Can the kernel run on CUDA device `device`? Loads libcuda and libnvrtc (dirs: extra
 * directories to look in, see wx_nvrtc), checks the architecture (FP8 conversion needs
 * compute capability 8.9), compiles and loads the kernel into the device's primary context
 * (once). Returns 0, or a negative errno with the reason in why. */
int wx_fp8_probe(int device, const char *const *dirs, int ndirs, char *why, size_t why_len);

/* Launch the kernel over the n pieces on `stream` (a CUstream; 0 is the legacy default
 * stream) of `device`. `host` is the validated table (wx_fp8_check) and `dev_pieces` the
 * device address of the same bytes, which must stay valid until the kernel ran (stream
 * order); dev_pieces 0 with n <= WX_FP8_INLINE: the table is copied into the launch's
 * parameters (no device copy). Returns 0 or a negative errno (wx_last_error says why). */
int wx_fp8_launch(int device, uint64_t stream, uint64_t out, uint64_t out_nbytes,
                  const wx_fp8_piece_t *host, uint64_t dev_pieces, int n);

#endif
