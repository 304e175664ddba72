/* wx_dl_nvrtc.c - the libnvrtc table (see wx_dl_nvrtc.h). */
#define _GNU_SOURCE
#include "wx_dl_nvrtc.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wx_dl.h"
#include "wx_dl_cuda.h"
#include "wx_param.h"

static wx_nvrtc_api_t wx__nvrtc;
static pthread_mutex_t wx__nvrtc_mu = PTHREAD_MUTEX_INITIALIZER;
static int wx__nvrtc_state; /* 0 not tried, 1 loaded, -1 failed */
static char wx__nvrtc_why[1024];
static char wx__last_dlerror[256];

/* Driver major (12, 13, ...) and the directory of the loaded libcuda, when there is one. */
static int wx__cuda_hint(char *dir, size_t dir_len)
{
    int major = 0;
    dir[0] = 0;
    char why[256];
    const wx_cuda_api_t *cu = wx_cuda(why, sizeof why);
    Dl_info info;
    int v = 0;
    if (cu && cu->cuDriverGetVersion(&v) == CUDA_SUCCESS)
        major = v / 1000;
    if (cu && dladdr((void *)cu->cuInit, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash && (size_t)(slash - info.dli_fname) < dir_len) {
            memcpy(dir, info.dli_fname, (size_t)(slash - info.dli_fname));
            dir[slash - info.dli_fname] = 0;
        }
    }
    return major;
}

static int wx__nvrtc_syms(void *lib, const char *path)
{
    static const struct {
        const char *name;
        size_t off;
    } syms[] = {
#define WX__E(f) {#f, offsetof(wx_nvrtc_api_t, f)}
        WX__E(nvrtcGetErrorString), WX__E(nvrtcVersion),        WX__E(nvrtcCreateProgram),
        WX__E(nvrtcDestroyProgram), WX__E(nvrtcCompileProgram), WX__E(nvrtcGetProgramLogSize),
        WX__E(nvrtcGetProgramLog),  WX__E(nvrtcGetCUBINSize),   WX__E(nvrtcGetCUBIN),
#undef WX__E
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++)
        if (wx_dl_sym(lib, path, syms[i].name, (void **)((char *)&wx__nvrtc + syms[i].off),
                      wx__nvrtc_why, sizeof wx__nvrtc_why))
            return -1;
    if (wx__nvrtc.nvrtcVersion(&wx__nvrtc.major, &wx__nvrtc.minor) != 0) {
        snprintf(wx__nvrtc_why, sizeof wx__nvrtc_why, "%s: nvrtcVersion failed", path);
        return -1;
    }
    snprintf(wx__nvrtc.path, sizeof wx__nvrtc.path, "%s", path);
    return 0;
}

/* dlopen `path`; on success fill the table. Appends `path` to the list of tried names. */
static int wx__try(const char *path, char *tried, size_t tried_len)
{
    void *lib;
    size_t n = strlen(tried);
    if (n < tried_len)
        snprintf(tried + n, tried_len - n, "%s%s", n ? ", " : "", path);
    dlerror();
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(wx__last_dlerror, sizeof wx__last_dlerror, "%s", e ? e : "not found");
        return -1;
    }
    if (wx__nvrtc_syms(lib, path) == 0)
        return 0;
    dlclose(lib);
    return -1;
}

static void wx__nvrtc_load(const char *const *dirs, int ndirs)
{
    char tried[768] = "", hint[512], path[1024];
    const char *env = wx_param_str(WX_P_LIBNVRTC), *home = wx_param_str(WX_P_CUDA_HOME);
    int major = wx__cuda_hint(hint, sizeof hint);
    int majors[2] = {13, 12};
    if (env && *env) {
        if (wx__try(env, tried, sizeof tried) == 0)
            return;
        if (!wx__nvrtc_why[0])
            snprintf(wx__nvrtc_why, sizeof wx__nvrtc_why, "cannot load WXFER_LIBNVRTC=%s: %s", env,
                     wx__last_dlerror);
        wx__nvrtc_state = -1;
        return;
    }
    if (major == 12) {
        majors[0] = 12;
        majors[1] = 13;
    }
    for (int m = 0; m < 2; m++) {
        snprintf(path, sizeof path, "libnvrtc.so.%d", majors[m]);
        if (wx__try(path, tried, sizeof tried) == 0)
            return;
        for (int d = -3; d < ndirs; d++) {
            const char *dir = d == -3   ? hint
                              : d == -2 ? (home && *home ? home : NULL)
                              : d == -1 ? "/usr/local/cuda"
                                        : dirs[d];
            const char *sub = (d == -2 || d == -1) ? "/lib64" : "";
            if (!dir || !*dir)
                continue;
            snprintf(path, sizeof path, "%s%s/libnvrtc.so.%d", dir, sub, majors[m]);
            if (wx__try(path, tried, sizeof tried) == 0)
                return;
        }
    }
    if (!wx__nvrtc_why[0])
        snprintf(wx__nvrtc_why, sizeof wx__nvrtc_why,
                 "libnvrtc not found (tried %s; set WXFER_LIBNVRTC to its path)", tried);
    wx__nvrtc_state = -1;
}

const wx_nvrtc_api_t *wx_nvrtc(const char *const *dirs, int ndirs, char *why, size_t why_len)
{
    pthread_mutex_lock(&wx__nvrtc_mu);
    if (wx__nvrtc_state == 0) {
        wx__nvrtc_why[0] = 0;
        wx__nvrtc_state = -1;
        wx__nvrtc_load(dirs, ndirs);
        if (wx__nvrtc.path[0])
            wx__nvrtc_state = 1;
    }
    pthread_mutex_unlock(&wx__nvrtc_mu);
    if (wx__nvrtc_state != 1) {
        if (why)
            snprintf(why, why_len, "%s", wx__nvrtc_why);
        return NULL;
    }
    return &wx__nvrtc;
}

int wx_nvrtc_cubin(const wx_nvrtc_api_t *nv, const char *what, const char *src, const char *name,
                   int nhdr, const char *const *hdr_src, const char *const *hdr_name, int nopt,
                   const char *const *opts, char **bin, size_t *size, char *why, size_t why_len)
{
    wx_nvrtc_program prog = NULL;
    size_t n = 0;
    char *out = NULL;
    int r = nv->nvrtcCreateProgram(&prog, src, name, nhdr, hdr_src, hdr_name);
    if (r) {
        snprintf(why, why_len, "nvrtcCreateProgram: %s", nv->nvrtcGetErrorString(r));
        return -EIO;
    }
    r = nv->nvrtcCompileProgram(prog, nopt, opts);
    if (r) {
        char log[384] = "";
        if (nv->nvrtcGetProgramLogSize(prog, &n) == 0 && n > 0) {
            char *full = malloc(n + 1);
            if (full && nv->nvrtcGetProgramLog(prog, full) == 0)
                snprintf(log, sizeof log, "%s", full);
            free(full);
        }
        snprintf(why, why_len, "NVRTC %d.%d (%.160s) could not compile %s: %.40s: %.200s",
                 nv->major, nv->minor, nv->path, what, nv->nvrtcGetErrorString(r), log);
        nv->nvrtcDestroyProgram(&prog);
        return -EIO;
    }
    n = 0;
    r = nv->nvrtcGetCUBINSize(prog, &n);
    if (!r && n && (out = malloc(n)) != NULL)
        r = nv->nvrtcGetCUBIN(prog, out);
    nv->nvrtcDestroyProgram(&prog);
    if (r || !out) {
        free(out);
        snprintf(why, why_len, "nvrtcGetCUBIN (%s): %s", what,
                 r ? nv->nvrtcGetErrorString(r) : "out of memory");
        return -EIO;
    }
    *bin = out;
    *size = n;
    return 0;
}
