/* verbs_ctx_ours.c - the half of tests/c/verbs_ctx_check.c compiled with wxfer's own
 * declarations (wx_ibv_abi.h, through wx_verbs_dl.h): queries a port and posts/polls through
 * contexts that the other half built with the system's infiniband/verbs.h. */
#include <string.h>

#include "wx_verbs_dl.h"

static int wx__fallback_calls;

static int wx__fallback_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *a)
{
    wx__fallback_calls++;
    a->state = IBV_PORT_DOWN;
    return 0;
}

/* wx_ibv_query_port on ctx: the state it returned, and 1 if the exported-symbol fallback was
 * used (the library's table entry), 0 if the extended context's op was. */
int ours_query_port(void *ctx, int *state, int *fallback)
{
    wx_verbs_api_t v;
    struct ibv_port_attr a;
    int before = wx__fallback_calls, rc;
    memset(&v, 0, sizeof v);
    v.query_port = wx__fallback_query_port;
    rc = wx_ibv_query_port(&v, ctx, 1, &a);
    *state = (int)a.state;
    *fallback = wx__fallback_calls != before;
    return rc;
}

/* ibv_post_send / ibv_poll_cq / ibv_req_notify_cq as the backend calls them (our inlines). */
int ours_post_poll(void *qp, void *cq, uint64_t raddr, uint32_t rkey, uint64_t *wr_id_out)
{
    struct ibv_sge sge = {.addr = 0x1000, .length = 64, .lkey = 7};
    struct ibv_send_wr wr, *bad = NULL;
    struct ibv_wc wc;
    int rc;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = 42;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    if ((rc = ibv_post_send(qp, &wr, &bad)) != 0)
        return rc;
    if (ibv_req_notify_cq(cq, 0) != 0)
        return -1;
    memset(&wc, 0, sizeof wc);
    if (ibv_poll_cq(cq, 1, &wc) != 1 || wc.status != IBV_WC_SUCCESS)
        return -2;
    *wr_id_out = wc.wr_id;
    return 0;
}
