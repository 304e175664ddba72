/* wx_abi_dump.c - print the sizes, offsets and constants listed in wx_abi_list.h, one
 * "name value" line each. csrc/abi/abi_check.py builds it twice per library, once over the
 * system header (-DWX_ABI_SYSTEM) and once over ours, and fails on any line that differs.
 * Sections: -DWX_ABI_VERBS, -DWX_ABI_FABRIC, -DWX_ABI_CUDA, -DWX_ABI_NVRTC (one per build). */
#include <stddef.h>
#include <stdio.h>

#ifdef WX_ABI_SYSTEM
#ifdef WX_ABI_VERBS
#include <infiniband/verbs.h>
#endif
#ifdef WX_ABI_FABRIC
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#endif
#ifdef WX_ABI_CUDA
#include <cuda.h>
#endif
#ifdef WX_ABI_NVRTC
#include <nvrtc.h>
#endif
#define WX__CUSYM_NAME(f, s) WX__STR(f) /* cuda.h maps f to its versioned symbol */
#else
#ifdef WX_ABI_VERBS
#include "wx_ibv_abi.h"
#endif
#ifdef WX_ABI_FABRIC
#include "wx_fi_abi.h"
#endif
#ifdef WX_ABI_CUDA
#include "wx_cuda_abi.h"
#endif
#ifdef WX_ABI_NVRTC
#include "wx_nvrtc_abi.h"
#endif
#define WX__CUSYM_NAME(f, s) s /* the name wx_dl_cuda.c looks up */
#endif

#define WX__STR2(x) #x
#define WX__STR(x) WX__STR2(x)

typedef struct {
    const char *name;
    const char *text; /* for symbol names */
    long long value;
} wx_abi_item_t;

#define WX_ABI_SIZE(T) {"sizeof(" #T ")", NULL, (long long)sizeof(T)},
#define WX_ABI_OFF(T, f) {"offsetof(" #T ", " #f ")", NULL, (long long)offsetof(T, f)},
#define WX_ABI_CONST(c) {#c, NULL, (long long)(c)},
#define WX_ABI_CUSYM(f, s) {"symbol " #f, WX__CUSYM_NAME(f, s), 0},

static const wx_abi_item_t wx_abi_items[] = {
#include "wx_abi_list.h"
    {NULL, NULL, 0}};

int main(void)
{
    for (const wx_abi_item_t *i = wx_abi_items; i->name; i++) {
        if (i->text)
            printf("%s %s\n", i->name, i->text);
        else
            printf("%s %lld\n", i->name, i->value);
    }
    return 0;
}
