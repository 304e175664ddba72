/* wx_param.c - the table of wx_param.h and its readers: the one place csrc/ reads the
 * environment (outside the verbs emulation). */
#include "wx_param.h"

#include <stdlib.h>
#include <string.h>

const wx_param_t wx_params[WX_P_COUNT] = {
#define WX__PARAM_ROW(id, name, type, value, shown, when, doc)                                     \
    [WX_P_##id] = {name, type, value, shown, when, doc},
    WX_PARAMS(WX__PARAM_ROW)
#undef WX__PARAM_ROW
};

const char *wx_param_env(wx_param_id_t id) { return getenv(wx_params[id].name); }

const char *wx_param_str(wx_param_id_t id)
{
    const char *e = wx_param_env(id);
    return e && *e ? e : wx_params[id].value;
}

int wx_param_flag(wx_param_id_t id)
{
    const char *e = wx_param_str(id);
    return e && strcmp(e, "0") != 0;
}
