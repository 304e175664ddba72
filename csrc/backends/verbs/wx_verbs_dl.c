/* wx_verbs_dl.c - the libibverbs table (see wx_verbs_dl.h). */
#include "wx_verbs_dl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wx_common.h"
#include "wx_dl.h"

static wx_verbs_api_t wx__ibv;
static pthread_once_t wx__ibv_once = PTHREAD_ONCE_INIT;
static char wx__ibv_why[320];
static int wx__ibv_ok;

#define WX__SYM(field, sym) WX_DL_SYM(wx__ibv.path, wx__ibv, field, sym, wx__ibv_why)
#define WX__OPT(field, sym) WX_DL_OPT(wx__ibv.path, wx__ibv, field, sym)

static void wx__ibv_load(void)
{
    void *lib;
    int (*is_emu)(void) = NULL;
    snprintf(wx__ibv.path, sizeof wx__ibv.path, "%s", wx_param_str(WX_P_LIBIBVERBS));
    lib = wx_dl_open(WX_P_LIBIBVERBS, wx__ibv_why, sizeof wx__ibv_why);
    if (!lib)
        return;
    WX__SYM(get_device_list, "ibv_get_device_list");
    WX__SYM(free_device_list, "ibv_free_device_list");
    WX__SYM(get_device_name, "ibv_get_device_name");
    WX__SYM(open_device, "ibv_open_device");
    WX__SYM(close_device, "ibv_close_device");
    WX__SYM(query_device, "ibv_query_device");
    WX__SYM(query_port, "ibv_query_port");
    WX__SYM(query_gid, "ibv_query_gid");
    WX__SYM(alloc_pd, "ibv_alloc_pd");
    WX__SYM(dealloc_pd, "ibv_dealloc_pd");
    WX__SYM(reg_mr, "ibv_reg_mr");
    WX__SYM(dereg_mr, "ibv_dereg_mr");
    WX__SYM(create_cq, "ibv_create_cq");
    WX__SYM(destroy_cq, "ibv_destroy_cq");
    WX__SYM(create_qp, "ibv_create_qp");
    WX__SYM(modify_qp, "ibv_modify_qp");
    WX__SYM(query_qp, "ibv_query_qp");
    WX__SYM(destroy_qp, "ibv_destroy_qp");
    WX__SYM(wc_status_str, "ibv_wc_status_str");
    WX__OPT(reg_mr_iova2, "ibv_reg_mr_iova2");
    WX__OPT(reg_dmabuf_mr, "ibv_reg_dmabuf_mr");
    WX__OPT(query_gid_ex, "_ibv_query_gid_ex");
    {
        char ignore[64];
        wx_dl_sym(lib, wx__ibv.path, "wxemu_verbs_is_emulation", (void **)&is_emu, ignore,
                  sizeof ignore);
    }
    wx__ibv.emulated = is_emu ? is_emu() : 0;
    if (wx__ibv.emulated)
        WX__OPT(emu_peermem, "wxemu_verbs_peermem");
    wx__ibv_ok = 1;
}

const wx_verbs_api_t *wx_verbs_api(char *why, size_t why_len)
{
    return wx_dl_once(&wx__ibv_once, wx__ibv_load, &wx__ibv_ok, wx__ibv_why, &wx__ibv, why,
                      why_len);
}

int wx_ibv_query_port(const wx_verbs_api_t *v, struct ibv_context *ctx, uint8_t port,
                      struct ibv_port_attr *attr)
{
    /* Same logic as ___ibv_query_port in verbs.h: extended contexts answer through their
     * query_port op, others through the exported compat symbol. */
    struct verbs_context *vctx = verbs_get_ctx_op(ctx, query_port);
    memset(attr, 0, sizeof *attr);
    if (!vctx)
        return v->query_port(ctx, port, attr);
    return vctx->query_port(ctx, port, attr, sizeof *attr);
}

int wx_ibv_query_gid_typed(const wx_verbs_api_t *v, struct ibv_context *ctx, uint8_t port,
                           int index, union ibv_gid *gid, int *type)
{
    char path[512], buf[64];
    FILE *f;
    int rc;
    if (v->query_gid_ex) {
        struct ibv_gid_entry e;
        memset(&e, 0, sizeof e);
        rc = v->query_gid_ex(ctx, port, (uint32_t)index, &e, 0, sizeof e);
        if (rc == 0) {
            *gid = e.gid;
            *type = (int)e.gid_type;
            return 0;
        }
    }
    rc = v->query_gid(ctx, port, index, gid);
    if (rc)
        return rc;
    *type = IBV_GID_TYPE_IB;
    snprintf(path, sizeof path, "%s/ports/%u/gid_attrs/types/%d", ctx->device->ibdev_path, port,
             index);
    f = fopen(path, "r");
    if (f) {
        if (fgets(buf, sizeof buf, f)) {
            if (strstr(buf, "v2"))
                *type = IBV_GID_TYPE_ROCE_V2;
            else if (strstr(buf, "RoCE") || strstr(buf, "IB/RoCE"))
                *type = IBV_GID_TYPE_ROCE_V1;
        }
        fclose(f);
    }
    return 0;
}
