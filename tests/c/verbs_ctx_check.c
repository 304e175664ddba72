/* verbs_ctx_check.c - the contexts a real libibverbs provider hands out, built with the
 * system's infiniband/verbs.h, driven through wxfer's own declarations (verbs_ctx_ours.c):
 * an extended context (struct verbs_context around struct ibv_context, as mlx5 and every
 * rdma-core provider make) answers query_port through its op, for this rdma-core's size and
 * for a newer, larger one; a plain or too-old context falls back to the exported symbol; and
 * post_send / poll_cq / req_notify_cq reach the context's ops with the work request's fields
 * where verbs.h puts them. The libibverbs emulation only makes plain contexts, so this is
 * what covers the extended path. Usage: verbs_ctx_check (exit 0 = ok). */
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

int ours_query_port(void *ctx, int *state, int *fallback);
int ours_post_poll(void *qp, void *cq, uint64_t raddr, uint32_t rkey, uint64_t *wr_id_out);

static int ext_calls;
static int ext_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a, size_t len)
{
    ext_calls++;
    CHECK(port == 1 && len == sizeof(struct ibv_port_attr), "query_port(port %u, len %zu)", port,
          len);
    a->state = IBV_PORT_ACTIVE;
    return 0;
}

static struct ibv_send_wr seen_wr;
static struct ibv_sge seen_sge;
static int post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    seen_wr = *wr;
    seen_sge = wr->sg_list[0];
    return 0;
}
static int poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    memset(wc, 0, sizeof *wc);
    wc->wr_id = seen_wr.wr_id;
    wc->status = IBV_WC_SUCCESS;
    wc->opcode = IBV_WC_RDMA_WRITE;
    return 1;
}
static int notified;
static int req_notify(struct ibv_cq *cq, int solicited)
{
    notified++;
    return 0;
}

int main(void)
{
    /* room in front for a "newer" library's larger verbs_context (members grow downwards) */
    size_t extra = 64;
    unsigned char *mem = calloc(1, extra + sizeof(struct verbs_context));
    struct verbs_context *vc = (struct verbs_context *)(void *)(mem + extra);
    int state = -1, fb = -1;

    vc->sz = sizeof *vc;
    vc->query_port = ext_query_port;
    vc->context.abi_compat = (void *)UINTPTR_MAX;
    CHECK(ours_query_port(&vc->context, &state, &fb) == 0 && !fb && state == IBV_PORT_ACTIVE &&
              ext_calls == 1,
          "extended context: state %d fallback %d calls %d", state, fb, ext_calls);

    vc->sz = sizeof *vc + extra; /* a newer rdma-core */
    CHECK(ours_query_port(&vc->context, &state, &fb) == 0 && !fb && ext_calls == 2,
          "newer context: fallback %d", fb);

    vc->sz = sizeof *vc - offsetof(struct verbs_context, query_port) - 8; /* older: no query_port */
    CHECK(ours_query_port(&vc->context, &state, &fb) == 0 && fb && state == IBV_PORT_DOWN &&
              ext_calls == 2,
          "older context: fallback %d state %d", fb, state);

    vc->sz = sizeof *vc;
    vc->context.abi_compat = NULL; /* plain context (as the emulation makes) */
    CHECK(ours_query_port(&vc->context, &state, &fb) == 0 && fb, "plain context: fallback %d", fb);

    {
        struct ibv_qp qp;
        struct ibv_cq cq;
        uint64_t id = 0;
        memset(&qp, 0, sizeof qp);
        memset(&cq, 0, sizeof cq);
        vc->context.ops.post_send = post_send;
        vc->context.ops.poll_cq = poll_cq;
        vc->context.ops.req_notify_cq = req_notify;
        qp.context = &vc->context;
        cq.context = &vc->context;
        CHECK(ours_post_poll(&qp, &cq, 0xabcdef0012345678ull, 0x5a5a, &id) == 0 && id == 42 &&
                  notified == 1,
              "post/poll: id %llu notified %d", (unsigned long long)id, notified);
        CHECK(seen_wr.opcode == IBV_WR_RDMA_WRITE && seen_wr.send_flags == IBV_SEND_SIGNALED &&
                  seen_wr.num_sge == 1 && seen_wr.wr.rdma.remote_addr == 0xabcdef0012345678ull &&
                  seen_wr.wr.rdma.rkey == 0x5a5a && seen_sge.addr == 0x1000 &&
                  seen_sge.length == 64 && seen_sge.lkey == 7,
              "the work request as verbs.h sees it: opcode %d flags %u raddr %llx rkey %x",
              (int)seen_wr.opcode, seen_wr.send_flags,
              (unsigned long long)seen_wr.wr.rdma.remote_addr, seen_wr.wr.rdma.rkey);
    }
    free(mem);
    printf("verbs_ctx_check: ok\n");
    return 0;
}
