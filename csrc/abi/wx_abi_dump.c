/* wx_abi_dump.c - print the sizes, offsets and constants listed in wx_abi_list.h, one
 * "name value" line each. csrc/abi/abi_check.py builds it twice per library, once over the
 * system headers (-DWX_ABI_SYSTEM) and once over ours, and fails on any line that differs.
 * Sections: -DWX_ABI_VERBS, -DWX_ABI_FABRIC, -DWX_ABI_CUDA, -DWX_ABI_NVRTC (one per build). */
#include <stddef.h>
#include <stdio.h>

/* The library's declarations come first, by -include: the system headers (-DWX_ABI_SYSTEM) or
 * ours (csrc/core/wx_*_abi.h), as abi_check.py's LIBS lists them. */
#ifdef WX_ABI_SYSTEM
#define WX__CUSYM_NAME(f, s) WX__STR(f) /* cuda.h maps f to its versioned symbol */
#else
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
