/* wx_dl_cuda.c - the libcuda table (see wx_dl_cuda.h). */
#include "wx_dl_cuda.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "wx_common.h"
#include "wx_cuda_syms.h"
#include "wx_dl.h"

static wx_cuda_api_t wx__cuda;
static pthread_once_t wx__cuda_once = PTHREAD_ONCE_INIT;
static char wx__cuda_why[256];
static int wx__cuda_ok;

#define WX__SYM(field, sym) WX_DL_SYM("libcuda.so.1", wx__cuda, field, sym, wx__cuda_why);
#define WX__OPT(field, sym) WX_DL_OPT("libcuda.so.1", wx__cuda, field, sym);

static void wx__cuda_load(void)
{
    void *lib = wx_dl_open(WX_P_LIBCUDA, wx__cuda_why, sizeof wx__cuda_why);
    CUresult r;
    if (!lib)
        return;
    WX_CUDA_SYMS(WX__SYM, WX__OPT)
    r = wx__cuda.cuInit(0);
    if (r != CUDA_SUCCESS) {
        const char *name = "?";
        wx__cuda.cuGetErrorName(r, &name);
        snprintf(wx__cuda_why, sizeof wx__cuda_why, "cuInit failed: %s (is there a GPU?)", name);
        return;
    }
    wx__cuda_ok = 1;
}

const wx_cuda_api_t *wx_cuda(char *why, size_t why_len)
{
    return wx_dl_once(&wx__cuda_once, wx__cuda_load, &wx__cuda_ok, wx__cuda_why, &wx__cuda, why,
                      why_len);
}

int wx_cuda_err(CUresult r, const char *call)
{
    const char *name = "CUDA_ERROR_UNKNOWN", *text = "";
    if (wx__cuda_ok) {
        wx__cuda.cuGetErrorName(r, &name);
        wx__cuda.cuGetErrorString(r, &text);
    }
    return wx_errf(-EIO, "%s failed: %s (%s)", call, name ? name : "?", text ? text : "");
}
