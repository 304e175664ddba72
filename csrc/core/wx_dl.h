/* wx_dl.h - loading foreign libraries at run time.
 *
 * Every foreign library (libcuda.so.1, libibverbs.so.1, libfabric.so.1) is reached through
 * one table of function pointers filled by dlopen/dlsym the first time it is needed, so
 * the extension imports on machines that lack the library and can say why a backend is
 * unavailable. The environment variable named by each loader may point at another file
 * (for example WXFER_LIBIBVERBS at the test emulation of libibverbs).
 */
#ifndef WX_DL_H
#define WX_DL_H

#include <pthread.h>
#include <signal.h>
#include <stddef.h>

#include "wx_param.h"

/* Every signal disposition of the process, saved so that a foreign library that installs
 * its own handlers (Debian's libfabric pulls in libinfinipath, which takes SIGINT, SIGTERM,
 * SIGSEGV, SIGABRT, SIGBUS and SIGILL) leaves the process as it found it. */
typedef struct {
    struct sigaction sa[NSIG];
    unsigned char saved[NSIG];
} wx_sigs_t;

/* Save every disposition into *s. */
void wx_sigs_save(wx_sigs_t *s);
/* Put back every disposition saved in *s that has changed since (a library's handler goes;
 * a handler installed meanwhile by someone else is overwritten too: the window is a load). */
void wx_sigs_restore(const wx_sigs_t *s);
/* The environment variables the libraries wxfer loads honour to leave signals alone
 * (IPATH_NO_BACKTRACE, HFI_NO_BACKTRACE); set to 1 unless the user set them. */
void wx_sigs_quiet_env(void);

/* dlopen the library the path parameter `lib` names (wx_param.h: WX_P_LIBCUDA and the like, else its
 * default); on failure fill why and return NULL.  The signal dispositions are saved before and
 * restored after (wx_sigs_t). */
void *wx_dl_open(wx_param_id_t lib, char *why, size_t why_len);
/* dlsym `name` into *slot; on failure fill why (naming the symbol) and return -ENOENT. */
int wx_dl_sym(void *lib, const char *libname, const char *name, void **slot, char *why,
              size_t why_len);
/* dlvsym `name` at symbol version `version` (the ABI our declarations describe, so a newer
 * library answers with that ABI's layouts), else plain dlsym; failure as wx_dl_sym. */
int wx_dl_vsym(void *lib, const char *libname, const char *name, const char *version, void **slot,
               char *why, size_t why_len);

/* In a loader (a void function with the library open as `lib`): api.field = the symbol `sym` of
 * the library, `libname` in messages. WX_DL_SYM returns from the loader with the reason in the
 * array `why` when the symbol is missing; WX_DL_OPT leaves a missing optional one NULL. */
#define WX_DL_SYM(libname, api, field, sym, why)                                                   \
    do {                                                                                           \
        if (wx_dl_sym(lib, libname, sym, (void **)&(api).field, why, sizeof why))                  \
            return;                                                                                \
    } while (0)
#define WX_DL_OPT(libname, api, field, sym)                                                        \
    do {                                                                                           \
        char ignore_[64];                                                                          \
        wx_dl_sym(lib, libname, sym, (void **)&(api).field, ignore_, sizeof ignore_);              \
    } while (0)

/* A loader's table: `load` runs once (through `once`) and sets *ok when the library and every
 * symbol it needs were found; then `api`, else NULL with the loader's `reason` copied into why
 * (which may be NULL). */
const void *wx_dl_once(pthread_once_t *once, void (*load)(void), const int *ok, const char *reason,
                       const void *api, char *why, size_t why_len);

#endif
