/* wx_dl.c - dlopen/dlsym helpers shared by the per-library tables. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dlvsym */
#endif
#include "wx_dl.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void wx_sigs_save(wx_sigs_t *s)
{
    memset(s->saved, 0, sizeof s->saved);
    for (int i = 1; i < NSIG; i++)
        if (i != SIGKILL && i != SIGSTOP && sigaction(i, NULL, &s->sa[i]) == 0)
            s->saved[i] = 1;
}

void wx_sigs_restore(const wx_sigs_t *s)
{
    struct sigaction now;
    for (int i = 1; i < NSIG; i++) {
        if (!s->saved[i] || sigaction(i, NULL, &now) != 0)
            continue;
        if (now.sa_handler != s->sa[i].sa_handler || now.sa_flags != s->sa[i].sa_flags)
            sigaction(i, &s->sa[i], NULL);
    }
}

void wx_sigs_quiet_env(void)
{
    setenv("IPATH_NO_BACKTRACE", "1", 0); /* libinfinipath (psm) */
    setenv("HFI_NO_BACKTRACE", "1", 0);   /* libpsm2 */
}

void *wx_dl_open(wx_param_id_t lib, char *why, size_t why_len)
{
    const char *path = wx_param_str(lib);
    void *h;
    wx_sigs_t sigs;
    wx_sigs_quiet_env();
    wx_sigs_save(&sigs);
    dlerror();
    h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    wx_sigs_restore(&sigs);
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

int wx_dl_vsym(void *lib, const char *libname, const char *name, const char *version, void **slot,
               char *why, size_t why_len)
{
    dlerror();
    *slot = dlvsym(lib, name, version);
    if (*slot)
        return 0;
    /* a library built without symbol versions has only the plain name */
    return wx_dl_sym(lib, libname, name, slot, why, why_len);
}

const void *wx_dl_once(pthread_once_t *once, void (*load)(void), const int *ok, const char *reason,
                       const void *api, char *why, size_t why_len)
{
    pthread_once(once, load);
    if (!*ok) {
        if (why)
            snprintf(why, why_len, "%s", reason);
        return NULL;
    }
    return api;
}
