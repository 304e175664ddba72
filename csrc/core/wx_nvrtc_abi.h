/* wx_nvrtc_abi.h - the part of NVRTC's C ABI (libnvrtc.so.12 / .13) wxfer uses, declared here
 * so that the extension builds without nvrtc.h: nvrtcResult is an int enum (0 = success),
 * nvrtcProgram an opaque pointer; the entry points are in wx_dl_nvrtc.h's table. Checked
 * against nvrtc.h by `make abi-check` where one is found ($CUDA_HOME/include, or the include/
 * folder of the nvidia pip wheels); the names are NVRTC's own, so a translation unit
 * includes this header or nvrtc.h, never both. */
#ifndef WX_NVRTC_ABI_H
#define WX_NVRTC_ABI_H

#define WX_NVRTC_ABI_CHECKED "NVRTC 12 / 13 C API (nvrtc.h)"

typedef enum {
    NVRTC_SUCCESS = 0,
    NVRTC_ERROR_OUT_OF_MEMORY = 1,
    NVRTC_ERROR_PROGRAM_CREATION_FAILURE = 2,
    NVRTC_ERROR_INVALID_INPUT = 3,
    NVRTC_ERROR_INVALID_PROGRAM = 4,
    NVRTC_ERROR_INVALID_OPTION = 5,
    NVRTC_ERROR_COMPILATION = 6
} nvrtcResult;

typedef struct _nvrtcProgram *nvrtcProgram;

#endif
