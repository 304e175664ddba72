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

#include <stddef.h>

/* dlopen `env` or else `dflt`; on failure fill why and return NULL. */
void *wx_dl_open(const char *env, const char *dflt, char *why, size_t why_len);
/* dlsym `name` into *slot; on failure fill why (naming the symbol) and return -ENOENT. */
int wx_dl_sym(void *lib, const char *libname, const char *name, void **slot, char *why,
              size_t why_len);

#endif
