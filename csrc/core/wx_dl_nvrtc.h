/* wx_dl_nvrtc.h - NVRTC (the CUDA runtime compiler), loaded from libnvrtc.so.* at run time.
 *
 * Needs no NVRTC header at build time: the types come from wx_nvrtc_abi.h (nvrtcResult an
 * int enum, 0 = NVRTC_SUCCESS; nvrtcProgram an opaque pointer), the entries are below.
 */
#ifndef WX_DL_NVRTC_H
#define WX_DL_NVRTC_H

#include <stddef.h>

#include "wx_nvrtc_abi.h"

typedef nvrtcResult wx_nvrtc_result;
typedef nvrtcProgram wx_nvrtc_program;

typedef struct wx_nvrtc_api {
    const char *(*nvrtcGetErrorString)(wx_nvrtc_result);
    wx_nvrtc_result (*nvrtcVersion)(int *, int *);
    wx_nvrtc_result (*nvrtcCreateProgram)(wx_nvrtc_program *, const char *, const char *, int,
                                          const char *const *, const char *const *);
    wx_nvrtc_result (*nvrtcDestroyProgram)(wx_nvrtc_program *);
    wx_nvrtc_result (*nvrtcCompileProgram)(wx_nvrtc_program, int, const char *const *);
    wx_nvrtc_result (*nvrtcGetProgramLogSize)(wx_nvrtc_program, size_t *);
    wx_nvrtc_result (*nvrtcGetProgramLog)(wx_nvrtc_program, char *);
    wx_nvrtc_result (*nvrtcGetCUBINSize)(wx_nvrtc_program, size_t *);
    wx_nvrtc_result (*nvrtcGetCUBIN)(wx_nvrtc_program, char *);
    int major, minor; /* nvrtcVersion() */
    char path[512];   /* the file loaded */
} wx_nvrtc_api_t;

/* Load NVRTC once (thread-safe; the first call's answer is kept). Tried in order:
 * $WXFER_LIBNVRTC (a path; when set, only it), then libnvrtc.so.<major> for the CUDA 13
 * and 12 majors (the driver's own major first), each by the loader's search path, then in
 * the directory of the loaded libcuda, $CUDA_HOME/lib64, /usr/local/cuda/lib64 and each of
 * `dirs` (ndirs of them, e.g. the pip wheels' nvidia/cuda_nvrtc/lib).
 * Returns the table, or NULL with the reason (what was tried) in why. */
const wx_nvrtc_api_t *wx_nvrtc(const char *const *dirs, int ndirs, char *why, size_t why_len);

/* Compile CUDA C `src` (file name `name`, with nhdr headers it may #include) with the nopt
 * options; on success *bin is a malloc'ed cubin of *size bytes (the caller keeps or frees it).
 * Returns 0, or -EIO with NVRTC's error and the start of its log in why (`what` names the
 * kernel there). */
int wx_nvrtc_cubin(const wx_nvrtc_api_t *nv, const char *what, const char *src, const char *name,
                   int nhdr, const char *const *hdr_src, const char *const *hdr_name, int nopt,
                   const char *const *opts, char **bin, size_t *size, char *why, size_t why_len);

#endif
