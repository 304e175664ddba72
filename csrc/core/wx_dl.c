/* wx_dl.c - dlopen/dlsym helpers shared by the per-library tables. */
#include "wx_dl.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

void *wx_dl_open(const char *env, const char *dflt, char *why, size_t why_len)
{
    const char *path = env ? getenv(env) : NULL;
    void *h;
    if (!path || !*path)
        path = dflt;
    dlerror();
    h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(why, why_len, "cannot load %s: %s", path, e ? e : "unknown error");
    }
    return h;
}

int wx_dl_sym(void *lib, const char *libname, const char *name, void **slot, char *why,
              size_t why_len)
{
    dlerror();
    *slot = dlsym(lib, name);
    if (!*slot) {
        snprintf(why, why_len, "%s lacks symbol %s", libname, name);
        return -ENOENT;
    }
    return 0;
}
