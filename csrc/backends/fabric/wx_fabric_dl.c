/* wx_fabric_dl.c - the libfabric table (see wx_fabric_dl.h). */
#include "wx_fabric_dl.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "wx_common.h"
#include "wx_dl.h"

static wx_fi_api_t wx__fi;
static pthread_once_t wx__fi_once = PTHREAD_ONCE_INIT;
static char wx__fi_why[256];
static int wx__fi_ok;

#define WX__SYM(field) WX_DL_SYM("libfabric.so.1", wx__fi, field, #field, wx__fi_why)
/* the calls whose structs changed across libfabric releases, at the version of wx_fi_abi.h */
#define WX__VSYM(field, ver)                                                                       \
    do {                                                                                           \
        if (wx_dl_vsym(lib, "libfabric.so.1", #field, ver, (void **)&wx__fi.field, wx__fi_why,     \
                       sizeof wx__fi_why))                                                         \
            return;                                                                                \
    } while (0)

static void wx__fi_load(void)
{
    void *lib = wx_dl_open(WX_P_LIBFABRIC, wx__fi_why, sizeof wx__fi_why);
    char ignore[128];
    uint32_t v;
    if (!lib)
        return;
    WX__VSYM(fi_getinfo, WX_FI_SYMVER_INFO);
    WX__VSYM(fi_freeinfo, WX_FI_SYMVER_INFO);
    WX__VSYM(fi_dupinfo, WX_FI_SYMVER_INFO);
    WX__VSYM(fi_fabric, WX_FI_SYMVER_FABRIC);
    WX__SYM(fi_strerror);
    WX__SYM(fi_version);
    wx_dl_sym(lib, "libfabric.so.1", "fi_tostr", (void **)&wx__fi.fi_tostr, ignore, sizeof ignore);
    v = wx__fi.fi_version();
    if (FI_MAJOR(v) != 1 || FI_MINOR(v) < 9) {
        snprintf(wx__fi_why, sizeof wx__fi_why,
                 "libfabric %u.%u is too old (wxfer needs 1.9 or newer)", FI_MAJOR(v), FI_MINOR(v));
        return;
    }
    wx__fi_ok = 1;
}

const wx_fi_api_t *wx_fi(char *why, size_t why_len)
{
    return wx_dl_once(&wx__fi_once, wx__fi_load, &wx__fi_ok, wx__fi_why, &wx__fi, why, why_len);
}

const char *wx_fi_strerror(int rc)
{
    if (rc < 0)
        rc = -rc;
    if (wx__fi_ok)
        return wx__fi.fi_strerror(rc);
    return strerror(rc);
}
