/* test_verbs.c - drives the verbs backend (csrc/core/wx_verbs*.c) through the generic layer
 * against the libibverbs EMULATION (csrc/testing/libwxemu_verbs.so, via WXFER_LIBIBVERBS).
 * Two real processes: the parent is the writer, a forked child the target; pipes carry the
 * control plane. Run by tests/test_verbs.py, one scenario per invocation:
 *     test_verbs <scenario>        exit 0 = pass; messages on stdout/stderr. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "wx_desc.h"
#include "wx_transport.h"
#include "wx_verbs.h"
#include "check.h"

#define BUF (4u << 20)

static int to_child[2], to_parent[2];

static void send_msg(int fd, const void *b, uint32_t n)
{
    CHECK(write(fd, &n, 4) == 4 && (n == 0 || write(fd, b, n) == (ssize_t)n), "pipe write");
}
static uint32_t recv_msg(int fd, void *b, uint32_t cap)
{
    uint32_t n, got = 0;
    CHECK(read(fd, &n, 4) == 4, "pipe read (peer gone?)");
    CHECK(n <= cap, "message too big");
    while (got < n) {
        ssize_t k = read(fd, (char *)b + got, n - got);
        CHECK(k > 0, "pipe read");
        got += (uint32_t)k;
    }
    return n;
}

typedef struct top {
    wx_op_t op;
    volatile int done;
    int status;
    char msg[512];
} top_t;

static void on_done(wx_op_t *op, int status, const char *msg)
{
    top_t *o = (top_t *)op;
    o->status = status;
    snprintf(o->msg, sizeof o->msg, "%s", msg ? msg : "");
    __atomic_store_n(&o->done, o->done + 1, __ATOMIC_RELEASE);
}

static void wait_op(top_t *o, double secs)
{
    uint64_t end = wx_now_ns() + (uint64_t)(secs * 1e9);
    while (!__atomic_load_n(&o->done, __ATOMIC_ACQUIRE)) {
        CHECK(wx_now_ns() < end, "op %llu did not complete in %.1fs (hang)",
              (unsigned long long)o->op.wr_id, secs);
        usleep(50);
    }
    CHECK(o->done == 1, "done() called %d times", o->done);
}

static wx_opts_t mkopts(const char **kv, int n)
{
    static const char *keys[16], *vals[16];
    wx_opts_t o = {n, keys, vals};
    for (int i = 0; i < n; i++) {
        keys[i] = kv[2 * i];
        vals[i] = kv[2 * i + 1];
    }
    return o;
}

/* ---- target (child) --------------------------------------------------------------------- */

static void target_main(const wx_opts_t *opts)
{
    static uint8_t blob[65536], req[WX_CONN_MAX], rep[WX_CONN_MAX];
    uint8_t *buf = aligned_alloc(4096, BUF), *expect = malloc(BUF);
    wx_transport_t *t;
    wx_mr_t *mr, *mr2 = NULL;
    size_t len = sizeof blob, rl;
    uint32_t n;
    int rc;
    memset(buf, 0, BUF);
    rc = wx_transport_open("verbs", opts, &t);
    CHECK(rc == 0, "target open: %s", wx_last_error());
    rc = wx_reg(t, buf, BUF, WX_MEM_HOST, -1, 1, &mr);
    CHECK(rc == 0, "target reg: %s", wx_last_error());
    CHECK(wx_export(t, blob, sizeof blob, &len) == 0, "export: %s", wx_last_error());
    send_msg(to_parent[1], blob, (uint32_t)len);
    for (;;) {
        char cmd;
        n = recv_msg(to_child[0], req, sizeof req);
        cmd = (char)req[0];
        if (cmd == 'C') { /* connection request */
            rl = sizeof rep;
            rc = wx_accept(t, req + 1, n - 1, rep, &rl);
            CHECK(rc == 0, "accept: %s", wx_last_error());
            send_msg(to_parent[1], rep, (uint32_t)rl);
        } else if (cmd == 'V') { /* verify against the writer's mirror */
            char res[128] = "OK";
            recv_msg(to_child[0], expect, BUF);
            for (uint32_t i = 0; i < BUF; i++)
                if (buf[i] != expect[i]) {
                    snprintf(res, sizeof res, "BAD at %u: have %u want %u", i, buf[i], expect[i]);
                    break;
                }
            send_msg(to_parent[1], res, (uint32_t)strlen(res) + 1);
        } else if (cmd == 'D') { /* deregister (the writer keeps a stale table) */
            CHECK(wx_dereg(t, mr) == 0, "dereg");
            send_msg(to_parent[1], "OK", 3);
        } else if (cmd == 'R') { /* register the first 4 KiB read-only for remote (source) */
            CHECK(wx_reg(t, buf, 4096, WX_MEM_HOST, -1, 0, &mr2) == 0, "reg2");
            len = sizeof blob;
            CHECK(wx_export(t, blob, sizeof blob, &len) == 0, "export");
            send_msg(to_parent[1], blob, (uint32_t)len);
        } else if (cmd == 'X') { /* vanish without cleanup */
            _exit(0);
        } else {
            break;
        }
    }
    wx_transport_close(t);
    free(expect);
    free(buf);
    _exit(0);
}

/* ---- writer (parent) -------------------------------------------------------------------- */

typedef struct wctx {
    wx_transport_t *t;
    wx_peer_t *p;
    wx_mr_t *src;
    uint8_t *sbuf, *mirror;
    wx_rinfo_t dst;
    pid_t child;
} wctx_t;

static void setup(wctx_t *w, const wx_opts_t *wopts, const wx_opts_t *topts)
{
    static uint8_t blob[65536], req[WX_CONN_MAX + 1], rep[WX_CONN_MAX];
    uint32_t n;
    size_t rl;
    int rc;
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0, "pipe");
    w->child = fork();
    CHECK(w->child >= 0, "fork");
    if (w->child == 0) {
        close(to_child[1]);
        close(to_parent[0]);
        target_main(topts);
    }
    close(to_child[0]);
    close(to_parent[1]);
    rc = wx_transport_open("verbs", wopts, &w->t);
    CHECK(rc == 0, "writer open: %s", wx_last_error());
    w->sbuf = aligned_alloc(4096, BUF);
    w->mirror = calloc(1, BUF);
    for (uint32_t i = 0; i < BUF; i++)
        w->sbuf[i] = (uint8_t)(i * 131u + 7u);
    rc = wx_reg(w->t, w->sbuf, BUF, WX_MEM_HOST, -1, 0, &w->src);
    CHECK(rc == 0, "writer reg: %s", wx_last_error());
    n = recv_msg(to_parent[0], blob, sizeof blob);
    rl = sizeof req - 1;
    req[0] = 'C';
    rc = wx_connect_request(w->t, blob, n, &w->p, req + 1, &rl);
    CHECK(rc == 0, "connect_request: %s", wx_last_error());
    CHECK(rl > 0, "verbs needs a handshake");
    send_msg(to_child[1], req, (uint32_t)rl + 1);
    n = recv_msg(to_parent[0], rep, sizeof rep);
    rc = wx_connect_finish(w->t, w->p, rep, n);
    CHECK(rc == 0, "connect_finish: %s", wx_last_error());
    CHECK(w->p->nregions == 1, "peer exported %u regions", w->p->nregions);
    w->dst = w->p->regions[0];
}

/* A validated write through the generic layer (retrying on -EAGAIN). */
static int gwrite(wctx_t *w, top_t *o, uint64_t loff, uint64_t roff, uint64_t len)
{
    wx_rinfo_t ri;
    wx_wr_t wr;
    int rc =
        wx_validate(w->t, w->p, w->dst.key, w->dst.rbase, w->dst.len, roff, len, w->src, loff, &ri);
    if (rc)
        return rc;
    memset(o, 0, sizeof *o);
    o->op.done = on_done;
    o->op.wr_id = (loff << 24) ^ roff;
    wr.local = w->src;
    wr.loff = loff;
    wr.remote = &ri;
    wr.roff = roff;
    wr.len = len;
    for (int spin = 0;; spin++) {
        rc = wx_post_write(w->t, w->p, &wr, &o->op);
        if (rc != -EAGAIN)
            break;
        CHECK(spin < 2000000, "EAGAIN forever");
        usleep(10);
    }
    if (rc == 0)
        memcpy(w->mirror + roff, w->sbuf + loff, len);
    return rc;
}

static void verify(wctx_t *w)
{
    char res[128];
    send_msg(to_child[1], "V", 1);
    send_msg(to_child[1], w->mirror, BUF);
    recv_msg(to_parent[0], res, sizeof res);
    CHECK(strcmp(res, "OK") == 0, "target memory: %s", res);
}

static void finish(wctx_t *w)
{
    int st;
    send_msg(to_child[1], "Q", 1);
    CHECK(waitpid(w->child, &st, 0) == w->child && WIFEXITED(st) && WEXITSTATUS(st) == 0,
          "target exited badly");
    wx_transport_close(w->t);
    free(w->sbuf);
    free(w->mirror);
}

static uint64_t lcg(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 17;
}

/* `count` writes of random length/offsets, posted without waiting. Writes in flight at the
 * same time go to disjoint destination slots: RDMA gives no order between QPs. */
static void many_writes(wctx_t *w, int count, uint64_t maxlen, uint64_t seed)
{
    uint64_t slot = maxlen < w->t->max_write ? maxlen : w->t->max_write;
    int per = (int)(BUF / slot);
    top_t *ops = calloc((size_t)per, sizeof *ops);
    for (int base = 0; base < count; base += per) {
        int n = count - base < per ? count - base : per;
        for (int i = 0; i < n; i++) {
            uint64_t len = 1 + lcg(&seed) % slot;
            uint64_t loff = lcg(&seed) % (BUF - len + 1);
            uint64_t roff = (uint64_t)i * slot + lcg(&seed) % (slot - len + 1);
            CHECK(gwrite(w, &ops[i], loff, roff, len) == 0, "write %d: %s", base + i,
                  wx_last_error());
        }
        for (int i = 0; i < n; i++) {
            wait_op(&ops[i], 20);
            CHECK(ops[i].status == 0, "op %d failed: %d %s", base + i, ops[i].status, ops[i].msg);
        }
    }
    free(ops);
}

static int sc_basic(const wx_opts_t *wo, const wx_opts_t *to)
{
    wctx_t w = {0};
    static const uint64_t sizes[] = {1, 2, 7, 63, 64, 4095, 4096, 4097, 65536, 65537, 1 << 20};
    static const uint64_t offs[] = {0, 1, 3, 4096, 12345, (1 << 20) + 17};
    char info[2048];
    top_t o;
    setup(&w, wo, to);
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        for (size_t j = 0; j < sizeof offs / sizeof *offs; j++) {
            uint64_t len = sizes[i] > w.t->max_write ? w.t->max_write : sizes[i];
            uint64_t roff = (offs[j] * 7 + i * 4099) % (BUF - len), loff = offs[j];
            CHECK(gwrite(&w, &o, loff, roff, len) == 0, "write: %s", wx_last_error());
            wait_op(&o, 10);
            CHECK(o.status == 0, "write %llu@%llu failed: %s", (unsigned long long)len,
                  (unsigned long long)roff, o.msg);
        }
    verify(&w);
    many_writes(&w, 3000, 70000, 42);
    verify(&w);
    /* the last byte and a whole-buffer write */
    CHECK(gwrite(&w, &o, BUF - 1, BUF - 1, 1) == 0, "last byte: %s", wx_last_error());
    wait_op(&o, 10);
    CHECK(o.status == 0, "last byte: %s", o.msg);
    verify(&w);
    w.t->ops->info(w.t, info, sizeof info);
    printf("info: %s\n", info);
    CHECK(strstr(info, "EMULATED"), "info must say the library is emulated");
    finish(&w);
    return 0;
}

static int sc_selective(const wx_opts_t *wo, const wx_opts_t *to)
{
    /* Tiny depth, many small writes: exercises selective signaling, the tail flush and the
     * emulation's max_send_wr (ENOMEM if the backend let the send queue overflow). */
    wctx_t w = {0};
    setup(&w, wo, to);
    many_writes(&w, 20000, 100, 7);
    verify(&w);
    for (int round = 0; round < 50; round++) { /* lone writes: only the tail flush completes them */
        top_t o;
        CHECK(gwrite(&w, &o, (uint64_t)round, (uint64_t)round * 3, 5) == 0, "%s", wx_last_error());
        wait_op(&o, 5);
        CHECK(o.status == 0, "%s", o.msg);
    }
    verify(&w);
    finish(&w);
    return 0;
}

/* Post straight to the backend with a forged remote entry (bypassing wx_validate) so that the
 * emulated HCA's own checks are exercised. */
static void forged_write(wctx_t *w, top_t *o, const wx_rinfo_t *ri, uint64_t roff, uint64_t len)
{
    wx_wr_t wr = {w->src, 0, ri, roff, len};
    int rc;
    memset(o, 0, sizeof *o);
    o->op.done = on_done;
    o->op.wr_id = 0xabc;
    rc = w->t->ops->write(w->t, w->p, &wr, &o->op);
    CHECK(rc == 0, "forged write not posted: %d %s", rc, wx_last_error());
}

static int sc_badkey(const wx_opts_t *wo, const wx_opts_t *to)
{
    wctx_t w = {0};
    wx_rinfo_t bad;
    top_t o, o2;
    uint32_t k;
    int rc;
    setup(&w, wo, to);
    /* generic pre-check still exists */
    rc = gwrite(&w, &o, 0, 0, 16);
    CHECK(rc == 0, "good write: %s", wx_last_error());
    wait_op(&o, 5);
    CHECK(o.status == 0, "%s", o.msg);
    {
        wx_rinfo_t ri;
        rc = wx_validate(w.t, w.p, w.dst.key ^ 0x100, w.dst.rbase, w.dst.len, 0, 16, w.src, 0, &ri);
        CHECK(rc == -EACCES, "pre-check must refuse an unknown key (rc %d)", rc);
        rc = wx_validate(w.t, w.p, w.dst.key, w.dst.rbase, w.dst.len, BUF - 8, 16, w.src, 0, &ri);
        CHECK(rc == -ERANGE, "pre-check must refuse out-of-range (rc %d)", rc);
    }
    bad = w.dst;
    memcpy(&k, bad.blob + 4, 4);
    k ^= 0x300; /* another MR slot: no such key at the HCA */
    memcpy(bad.blob + 4, &k, 4);
    forged_write(&w, &o, &bad, 0, 64);
    wait_op(&o, 5);
    printf("bad rkey: status %d: %s\n", o.status, o.msg);
    CHECK(o.status == -EACCES, "bad rkey: want -EACCES, got %d", o.status);
    CHECK(strstr(o.msg, "IBV_WC_REM_ACCESS_ERR") && strstr(o.msg, "remote access error") &&
              strstr(o.msg, "qp_num 0x") && strstr(o.msg, "wr_id 0x") &&
              strstr(o.msg, "op wr_id 0xabc"),
          "message lacks status/qp_num/wr_id: %s", o.msg);
    /* the QP is in the error state: the next write fails at once, with the reason */
    rc = gwrite(&w, &o2, 0, 0, 16);
    CHECK(rc == -EACCES && strstr(wx_last_error(), "remote access error"),
          "write after error: rc %d (%s)", rc, wx_last_error());
    finish(&w);
    return 0;
}

/* The write `o` (posted) fails with `status` and a message naming the work completion status
 * `wc`; printed as `what`; then the target is stopped: the scenario's exit status. */
static int refused(wctx_t *w, top_t *o, const char *what, int status, const char *wc)
{
    wait_op(o, 5);
    printf("%s: status %d: %s\n", what, o->status, o->msg);
    CHECK(o->status == status && strstr(o->msg, wc), "%s: %d %s", what, o->status, o->msg);
    finish(w);
    return 0;
}

static int sc_range(const wx_opts_t *wo, const wx_opts_t *to)
{
    wctx_t w = {0};
    wx_rinfo_t big;
    top_t o;
    setup(&w, wo, to);
    big = w.dst;
    big.len = 2ull * BUF; /* pretend the region is larger than the target registered */
    forged_write(&w, &o, &big, BUF - 32, 64);
    return refused(&w, &o, "out of range", -EACCES, "IBV_WC_REM_ACCESS_ERR");
}

static int sc_stale(const wx_opts_t *wo, const wx_opts_t *to)
{
    /* The target deregisters after exporting; the writer's table is stale, so the generic
     * pre-check passes and the HCA must refuse the key. */
    wctx_t w = {0};
    char res[8];
    top_t o;
    setup(&w, wo, to);
    send_msg(to_child[1], "D", 1);
    recv_msg(to_parent[0], res, sizeof res);
    CHECK(gwrite(&w, &o, 0, 0, 100) == 0, "%s", wx_last_error());
    return refused(&w, &o, "stale key", -EACCES, "IBV_WC_REM_ACCESS_ERR");
}

static int sc_lkey(const wx_opts_t *wo, const wx_opts_t *to)
{
    wctx_t w = {0};
    wx_mr_t fake;
    wx__vreg_t freg;
    struct ibv_mr fmr;
    wx_wr_t wr;
    top_t o;
    setup(&w, wo, to);
    fake = *w.src;
    freg = *(wx__vreg_t *)w.src->priv;
    fmr = *freg.mr[0];
    fmr.lkey ^= 0x500;
    freg.mr[0] = &fmr;
    fake.priv = &freg;
    memset(&o, 0, sizeof o);
    o.op.done = on_done;
    wr = (wx_wr_t){&fake, 0, &w.p->regions[0], 0, 64};
    CHECK(w.t->ops->write(w.t, w.p, &wr, &o.op) == 0, "post: %s", wx_last_error());
    return refused(&w, &o, "bad lkey", -EFAULT, "IBV_WC_LOC_PROT_ERR");
}

static int sc_gone(const wx_opts_t *wo, const wx_opts_t *to)
{
    wctx_t w = {0};
    top_t o[8];
    int st;
    uint64_t t0;
    setup(&w, wo, to);
    send_msg(to_child[1], "X", 1);
    CHECK(waitpid(w.child, &st, 0) == w.child, "wait");
    t0 = wx_now_ns();
    for (int i = 0; i < 8; i++)
        CHECK(gwrite(&w, &o[i], 0, (uint64_t)i * 100, 64) == 0, "%s", wx_last_error());
    for (int i = 0; i < 8; i++)
        wait_op(&o[i], 10);
    printf("vanished peer: %.2fs: status %d: %s\n", (wx_now_ns() - t0) / 1e9, o[0].status,
           o[0].msg);
    CHECK(o[0].status == -EHOSTUNREACH && strstr(o[0].msg, "IBV_WC_RETRY_EXC_ERR"), "gone: %d %s",
          o[0].status, o[0].msg);
    for (int i = 1; i < 8; i++)
        CHECK(o[i].status != 0, "op %d after the failure succeeded", i);
    wx_transport_close(w.t);
    free(w.sbuf);
    free(w.mirror);
    return 0;
}

static int sc_cache(const wx_opts_t *wo, const wx_opts_t *to)
{
    wx_transport_t *t;
    wx_mr_t *a, *b, *c, *d;
    uint8_t *buf = aligned_alloc(4096, 1 << 20);
    void (*stats)(uint64_t *) = NULL;
    uint64_t s0[2], s1[2];
    void *h = dlopen(getenv("WXFER_LIBIBVERBS"), RTLD_NOW | RTLD_NOLOAD);
    char info[2048];
    (void)to;
    CHECK(wx_transport_open("verbs", wo, &t) == 0, "open: %s", wx_last_error());
    h = dlopen(getenv("WXFER_LIBIBVERBS"), RTLD_NOW | RTLD_NOLOAD);
    CHECK(h, "emulation not loaded");
    stats = (void (*)(uint64_t *))dlsym(h, "wxemu_verbs_stats");
    CHECK(stats, "wxemu_verbs_stats");
    stats(s0);
    CHECK(wx_reg(t, buf, 1 << 20, WX_MEM_HOST, -1, 1, &a) == 0, "%s", wx_last_error());
    CHECK(wx_reg(t, buf, 1 << 20, WX_MEM_HOST, -1, 1, &b) == 0, "%s", wx_last_error());
    CHECK(wx_reg(t, buf + 4096, 8192, WX_MEM_HOST, -1, 1, &c) == 0, "%s", wx_last_error());
    CHECK(wx_reg(t, buf + 4096, 8192, WX_MEM_HOST, -1, 0, &d) == 0, "%s", wx_last_error());
    stats(s1);
    CHECK(s1[0] - s0[0] == 1, "4 registrations inside one range made %llu ibv_reg_mr calls",
          (unsigned long long)(s1[0] - s0[0]));
    CHECK(a->key != b->key && b->key != c->key, "region keys must be unique per region");
    CHECK((uint32_t)a->key == (uint32_t)c->key, "same MR (rkey) expected");
    t->ops->info(t, info, sizeof info);
    printf("info: %s\n", info);
    CHECK(strstr(info, "reg_calls=1 reg_cache_hits=3"), "info: %s", info);
    CHECK(strstr(info, "registration=host"), "info: %s", info);
    wx_dereg(t, a);
    wx_dereg(t, b);
    wx_dereg(t, c);
    stats(s1);
    CHECK(s1[1] - s0[1] == 0, "deregistered while still in use");
    wx_dereg(t, d);
    stats(s1);
    CHECK(s1[1] - s0[1] == 1, "last user must deregister (dereg calls %llu)",
          (unsigned long long)(s1[1] - s0[1]));
    wx_transport_close(t);
    free(buf);
    return 0;
}

static int sc_options(const wx_opts_t *wo, const wx_opts_t *to)
{
    wx_transport_t *t;
    const char *kv1[] = {"device", "nosuch0"};
    const char *kv2[] = {"bogus", "1"};
    const char *kv3[] = {"device", "wxemu*"};
    wx_opts_t o;
    (void)wo, (void)to;
    o = mkopts(kv1, 1);
    CHECK(wx_transport_open("verbs", &o, &t) == -ENODEV && strstr(wx_last_error(), "nosuch0") &&
              strstr(wx_last_error(), "wxemu0"),
          "unknown device: %s", wx_last_error());
    o = mkopts(kv2, 1);
    CHECK(wx_transport_open("verbs", &o, &t) == -EINVAL, "unknown option");
    o = mkopts(kv3, 1);
    CHECK(wx_transport_open("verbs", &o, &t) == -EINVAL && strstr(wx_last_error(), "plain"),
          "pattern: %s", wx_last_error());
    /* WXFER_IB_DEVICES exclusion of the only device */
    setenv("WXFER_IB_DEVICES", "^wxemu0", 1);
    CHECK(wx_transport_open("verbs", NULL, &t) == -ENETDOWN, "exclusion: %s", wx_last_error());
    setenv("WXFER_IB_DEVICES", "wxemu0:1", 1);
    CHECK(wx_transport_open("verbs", NULL, &t) == 0, "inclusion: %s", wx_last_error());
    wx_transport_close(t);
    setenv("WXFER_IB_DEVICES", "wxemu0:2", 1);
    CHECK(wx_transport_open("verbs", NULL, &t) == -ENETDOWN, "port 2: %s", wx_last_error());
    unsetenv("WXFER_IB_DEVICES");
    return 0;
}

/* two emulated devices: inclusion order, exclusion, striping over both by default */
static int sc_choice(void)
{
    wx_transport_t *t;
    char info[2048];
    setenv("WXFER_IB_DEVICES", "^wxemu0", 1);
    CHECK(wx_transport_open("verbs", NULL, &t) == 0, "%s", wx_last_error());
    t->ops->info(t, info, sizeof info);
    CHECK(strstr(info, "nics=wxemu1:1(") && !strstr(info, "wxemu0:"), "exclusion: %s", info);
    wx_transport_close(t);
    setenv("WXFER_IB_DEVICES", "wxemu1,wxemu0", 1);
    CHECK(wx_transport_open("verbs", NULL, &t) == 0, "%s", wx_last_error());
    t->ops->info(t, info, sizeof info);
    CHECK(strstr(info, "nics=wxemu1:1(") && strstr(info, "),wxemu0:1("), "order: %s", info);
    wx_transport_close(t);
    unsetenv("WXFER_IB_DEVICES");
    {
        const char *kv[] = {"device", "wxemu0"};
        wx_opts_t o = mkopts(kv, 1);
        setenv("WXFER_IB_DEVICES", "wxemu1", 1); /* the option wins over the environment */
        CHECK(wx_transport_open("verbs", &o, &t) == 0, "%s", wx_last_error());
        t->ops->info(t, info, sizeof info);
        CHECK(strstr(info, "nics=wxemu0:1(") && !strstr(info, "wxemu1"), "option: %s", info);
        wx_transport_close(t);
        unsetenv("WXFER_IB_DEVICES");
    }
    CHECK(wx_transport_open("verbs", NULL, &t) == 0, "%s", wx_last_error());
    t->ops->info(t, info, sizeof info);
    CHECK(strstr(info, "wxemu0:1(") && strstr(info, "wxemu1:1(") && strstr(info, "all active"),
          "default: %s", info);
    wx_transport_close(t);
    printf("nic choice: ok\n");
    return 0;
}

static int sc_parse(void)
{
    char names[8][64];
    int ports[8], ex, n;
    n = wx__verbs_parse_list("mlx5_0:1, mlx5_3 ,mlx5_2:2", names, ports, 8, &ex);
    CHECK(n == 3 && !ex && !strcmp(names[1], "mlx5_3") && ports[0] == 1 && ports[1] == 0 &&
              ports[2] == 2,
          "parse list");
    n = wx__verbs_parse_list("^mlx5_1,mlx5_4:1", names, ports, 8, &ex);
    CHECK(n == 2 && ex && !strcmp(names[0], "mlx5_1") && ports[1] == 1, "parse exclusion");
    CHECK(wx__verbs_parse_list("mlx5_.*", names, ports, 8, &ex) == -EINVAL, "regex refused");
    CHECK(wx__verbs_parse_list("mlx5_0:x", names, ports, 8, &ex) == -EINVAL, "bad port");
    CHECK(wx__verbs_pci_distance("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0",
                                 "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.1") == 2,
          "siblings");
    CHECK(wx__verbs_pci_distance("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0",
                                 "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0") == 6,
          "other root complex");
    return 0;
}

/* NIC choice by PCIe topology on a fake sysfs tree (WXEMU_VERBS_SYSFS) */
static int sc_topo(void)
{
    char dir[] = "/tmp/wxtopoXXXXXX", cmd[2048], path[512];
    int rc;
    CHECK(mkdtemp(dir), "mkdtemp");
    snprintf(
        cmd, sizeof cmd,
        "set -e; cd %s; "
        "mkdir -p devices/pci0000:00/0000:00:01.0/0000:01:00.0 "
        "devices/pci0000:00/0000:00:01.0/0000:01:00.1 "
        "devices/pci0000:80/0000:80:01.0/0000:81:00.0 class/infiniband/wxemu0 "
        "class/infiniband/wxemu1 bus/pci/devices; "
        "ln -s ../../../devices/pci0000:80/0000:80:01.0/0000:81:00.0 class/infiniband/wxemu0/device; "
        "ln -s ../../../devices/pci0000:00/0000:00:01.0/0000:01:00.1 class/infiniband/wxemu1/device; "
        "ln -s ../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0 bus/pci/devices/0000:01:00.0",
        dir);
    CHECK(system(cmd) == 0, "fake sysfs");
    rc = wx__verbs_gpu_pci_path(dir, "00000000:01:00.0", path, sizeof path);
    CHECK(rc == 0 && strstr(path, "0000:01:00.0"), "gpu path %d %s", rc, path);
    {
        char a[512], b[512];
        snprintf(cmd, sizeof cmd, "%s/class/infiniband/wxemu0/device", dir);
        CHECK(realpath(cmd, a), "realpath");
        snprintf(cmd, sizeof cmd, "%s/class/infiniband/wxemu1/device", dir);
        CHECK(realpath(cmd, b), "realpath");
        CHECK(wx__verbs_pci_distance(path, b) < wx__verbs_pci_distance(path, a),
              "wxemu1 (same switch) must be nearer than wxemu0 (other root)");
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "rm");
    return 0;
}


/* ---- the emulation's own rules, straight through the libibverbs table ------------------ */

static int poll1(struct ibv_cq *cq, struct ibv_wc *wc, double secs)
{
    uint64_t end = wx_now_ns() + (uint64_t)(secs * 1e9);
    for (;;) {
        int n = ibv_poll_cq(cq, 1, wc);
        if (n != 0 || wx_now_ns() > end)
            return n;
        usleep(100);
    }
}

typedef struct epair {
    struct ibv_qp *a, *b; /* a writes into b (same process: loopback through the HCA) */
} epair_t;

static struct ibv_qp *mkqp(const wx_verbs_api_t *v, struct ibv_pd *pd, struct ibv_cq *cq,
                           uint32_t wr)
{
    struct ibv_qp_init_attr ia;
    memset(&ia, 0, sizeof ia);
    ia.send_cq = ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = wr;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    return v->create_qp(pd, &ia);
}

static int to_init(const wx_verbs_api_t *v, struct ibv_qp *q, int access, int mask_extra)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = (unsigned)access;
    return v->modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | mask_extra);
}

static int to_rtr(const wx_verbs_api_t *v, struct ibv_qp *q, uint32_t dqpn, uint16_t dlid,
                  uint32_t rq_psn, int drop)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = dqpn;
    a.rq_psn = rq_psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = 1;
    a.ah_attr.dlid = dlid;
    return v->modify_qp(q, &a,
                        (IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) &
                            ~drop);
}

static int to_rts(const wx_verbs_api_t *v, struct ibv_qp *q, uint32_t sq_psn)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = sq_psn;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    return v->modify_qp(q, &a,
                        IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                            IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

static void connect_pair(const wx_verbs_api_t *v, epair_t *p, uint16_t lid, uint32_t psn_a,
                         uint32_t psn_b_expect)
{
    CHECK(to_init(v, p->a, 0, IBV_QP_ACCESS_FLAGS) == 0, "a init");
    CHECK(to_init(v, p->b, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, IBV_QP_ACCESS_FLAGS) ==
              0,
          "b init");
    CHECK(to_rtr(v, p->b, p->a->qp_num, lid, psn_b_expect, 0) == 0, "b rtr");
    CHECK(to_rtr(v, p->a, p->b->qp_num, lid, 0, 0) == 0, "a rtr");
    CHECK(to_rts(v, p->a, psn_a) == 0, "a rts");
}

static int post_write(struct ibv_qp *q, uint64_t id, void *src, uint32_t len, uint32_t lkey,
                      void *dst, uint32_t rkey, int sig)
{
    struct ibv_sge sge = {(uint64_t)(uintptr_t)src, len, lkey};
    struct ibv_send_wr wr, *bad;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = id;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = sig ? IBV_SEND_SIGNALED : 0;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = (uint64_t)(uintptr_t)dst;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send(q, &wr, &bad);
}

static int sc_emu_rules(void)
{
    char why[512];
    const wx_verbs_api_t *v = wx_verbs_api(why, sizeof why);
    struct ibv_device **list;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq, *small;
    struct ibv_port_attr pa;
    struct ibv_mr *src, *dst, *ro;
    struct ibv_wc wc;
    static char sbuf[8192], dbuf[8192];
    epair_t p;
    uint16_t lid;
    int n;
    CHECK(v && v->emulated, "emulation not loaded: %s", why);
    list = v->get_device_list(&n);
    CHECK(list && n >= 1, "devices");
    ctx = v->open_device(list[0]);
    CHECK(ctx, "open");
    CHECK(wx_ibv_query_port(v, ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE &&
              pa.max_msg_sz > 0,
          "port");
    CHECK(wx_ibv_query_port(v, ctx, 2, &pa) == EINVAL, "port 2 must not exist");
    CHECK(wx_ibv_query_port(v, ctx, 1, &pa) == 0, "port");
    lid = pa.lid;
    pd = v->alloc_pd(ctx);
    cq = v->create_cq(ctx, 64, NULL, NULL, 0);
    CHECK(pd && cq, "pd/cq");
    /* access flag rules at registration */
    CHECK(!v->reg_mr(pd, dbuf, sizeof dbuf, IBV_ACCESS_REMOTE_WRITE) && errno == EINVAL,
          "REMOTE_WRITE without LOCAL_WRITE must be EINVAL");
    src = v->reg_mr(pd, sbuf, sizeof sbuf, IBV_ACCESS_LOCAL_WRITE);
    dst = v->reg_mr(pd, dbuf, sizeof dbuf, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    ro = v->reg_mr(pd, dbuf, 4096, IBV_ACCESS_LOCAL_WRITE); /* no remote write */
    CHECK(src && dst && ro, "reg");
    CHECK(!v->reg_mr(pd, (void *)16, 4096, IBV_ACCESS_LOCAL_WRITE) && errno == EFAULT,
          "unmapped memory must be EFAULT");
    /* state machine and masks */
    p.a = mkqp(v, pd, cq, 4);
    p.b = mkqp(v, pd, cq, 4);
    CHECK(p.a && p.b, "qp");
    CHECK(to_init(v, p.a, 0, 0) == EINVAL, "RESET->INIT without ACCESS_FLAGS must be EINVAL");
    CHECK(to_rtr(v, p.a, p.b->qp_num, lid, 0, 0) == EINVAL, "RESET->RTR must be EINVAL");
    CHECK(to_init(v, p.a, 0, IBV_QP_ACCESS_FLAGS) == 0, "init");
    CHECK(post_write(p.a, 1, sbuf, 8, src->lkey, dbuf, dst->rkey, 1) == EINVAL,
          "post_send before RTS must be EINVAL");
    CHECK(to_rts(v, p.a, 0) == EINVAL, "INIT->RTS must be EINVAL");
    CHECK(to_rtr(v, p.a, p.b->qp_num, lid, 0, IBV_QP_DEST_QPN) == EINVAL,
          "INIT->RTR without DEST_QPN must be EINVAL");
    CHECK(to_rtr(v, p.a, p.b->qp_num, 0, 0, 0) == EINVAL, "IB path without a LID must be EINVAL");
    CHECK(v->modify_qp(p.a, &(struct ibv_qp_attr){.qp_state = IBV_QPS_RESET}, IBV_QP_STATE) == 0,
          "to RESET");
    connect_pair(v, &p, lid, 100, 100);
    /* a good write lands */
    memset(sbuf, 0x5a, 64);
    CHECK(post_write(p.a, 2, sbuf, 64, src->lkey, dbuf + 100, dst->rkey, 1) == 0, "post");
    CHECK(poll1(cq, &wc, 5) == 1 && wc.status == IBV_WC_SUCCESS && wc.wr_id == 2 &&
              wc.qp_num == p.a->qp_num,
          "good write: status %d", wc.status);
    CHECK(dbuf[100] == 0x5a && dbuf[163] == 0x5a && dbuf[164] == 0, "bytes landed");
    /* an MR without REMOTE_WRITE: remote access error; then unsignaled WRs flush */
    CHECK(post_write(p.a, 3, sbuf, 8, src->lkey, dbuf, ro->rkey, 0) == 0, "post");
    CHECK(post_write(p.a, 4, sbuf, 8, src->lkey, dbuf, dst->rkey, 0) == 0, "post");
    CHECK(poll1(cq, &wc, 5) == 1 && wc.status == IBV_WC_REM_ACCESS_ERR && wc.wr_id == 3,
          "no REMOTE_WRITE: status %d (%s)", wc.status, v->wc_status_str(wc.status));
    CHECK(poll1(cq, &wc, 5) == 1 && wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id == 4,
          "flush after error: status %d", wc.status);
    CHECK(!strcmp(v->wc_status_str(IBV_WC_RETRY_EXC_ERR), "transport retry counter exceeded"),
          "status strings");
    v->destroy_qp(p.a);
    v->destroy_qp(p.b);
    /* max_send_wr: unsignaled WRs keep their slots until a later CQE is polled */
    p.a = mkqp(v, pd, cq, 4);
    p.b = mkqp(v, pd, cq, 4);
    connect_pair(v, &p, lid, 7, 7);
    for (int i = 0; i < 4; i++)
        CHECK(post_write(p.a, 10 + i, sbuf, 8, src->lkey, dbuf, dst->rkey, 0) == 0, "post %d", i);
    CHECK(post_write(p.a, 14, sbuf, 8, src->lkey, dbuf, dst->rkey, 1) == ENOMEM,
          "posting beyond max_send_wr must be ENOMEM");
    v->destroy_qp(p.a);
    v->destroy_qp(p.b);
    /* CQ overrun */
    small = v->create_cq(ctx, 2, NULL, NULL, 0);
    {
        struct ibv_qp_init_attr ia;
        memset(&ia, 0, sizeof ia);
        ia.send_cq = ia.recv_cq = small;
        ia.qp_type = IBV_QPT_RC;
        ia.cap.max_send_wr = 8;
        ia.cap.max_send_sge = 1;
        p.a = v->create_qp(pd, &ia);
    }
    p.b = mkqp(v, pd, cq, 4);
    connect_pair(v, &p, lid, 9, 9);
    for (int i = 0; i < 4; i++)
        CHECK(post_write(p.a, 20 + i, sbuf, 8, src->lkey, dbuf, dst->rkey, 1) == 0, "post");
    usleep(200000);
    CHECK(ibv_poll_cq(small, 1, &wc) == -EOVERFLOW, "CQ overrun must be reported");
    CHECK(v->destroy_cq(small) == EBUSY, "destroying a CQ that QPs use must be EBUSY");
    v->destroy_qp(p.a);
    v->destroy_qp(p.b);
    CHECK(v->destroy_cq(small) == 0, "destroy cq");
    /* PSN mismatch and a target that is not ready: no ACK, retries run out */
    p.a = mkqp(v, pd, cq, 4);
    p.b = mkqp(v, pd, cq, 4);
    connect_pair(v, &p, lid, 5, 6);
    CHECK(post_write(p.a, 30, sbuf, 8, src->lkey, dbuf, dst->rkey, 1) == 0, "post");
    CHECK(poll1(cq, &wc, 10) == 1 && wc.status == IBV_WC_RETRY_EXC_ERR, "PSN mismatch: %d",
          wc.status);
    v->destroy_qp(p.a);
    v->destroy_qp(p.b);
    p.a = mkqp(v, pd, cq, 4);
    p.b = mkqp(v, pd, cq, 4);
    connect_pair(v, &p, lid, 5, 5);
    CHECK(v->modify_qp(p.b, &(struct ibv_qp_attr){.qp_state = IBV_QPS_RESET}, IBV_QP_STATE) == 0,
          "b reset");
    CHECK(post_write(p.a, 31, sbuf, 8, src->lkey, dbuf, dst->rkey, 1) == 0, "post");
    CHECK(poll1(cq, &wc, 10) == 1 && wc.status == IBV_WC_RETRY_EXC_ERR, "target not ready: %d",
          wc.status);
    CHECK(v->dealloc_pd(pd) == EBUSY, "dealloc_pd with objects must be EBUSY");
    v->destroy_qp(p.a);
    v->destroy_qp(p.b);
    v->dereg_mr(ro);
    v->dereg_mr(dst);
    v->dereg_mr(src);
    CHECK(v->destroy_cq(cq) == 0 && v->dealloc_pd(pd) == 0, "unwind");
    v->close_device(ctx);
    v->free_device_list(list);
    printf("emulation rules: ok\n");
    return 0;
}

/* The scenarios: test_verbs <name> [key=value ...]; the paired ones get the writer's options
 * (the key=value arguments) and the target's. */
static const struct {
    const char *name;
    int (*run)(void);
} plain[] = {
    {"emu_rules", sc_emu_rules}, {"choice", sc_choice}, {"parse", sc_parse}, {"topo", sc_topo}};
static const struct {
    const char *name;
    int (*run)(const wx_opts_t *wo, const wx_opts_t *to);
} paired[] = {{"options", sc_options}, {"basic", sc_basic}, {"selective", sc_selective},
              {"badkey", sc_badkey},   {"range", sc_range}, {"stale", sc_stale},
              {"lkey", sc_lkey},       {"gone", sc_gone},   {"cache", sc_cache}};

int main(int argc, char **argv)
{
    const char *sc = argc > 1 ? argv[1] : "basic";
    const char *kv[16];
    int n = 0;
    wx_opts_t wo, to;
    setvbuf(stdout, NULL, _IONBF, 0);
    /* extra writer options: test_verbs <scenario> key=value ... */
    for (int i = 2; i < argc && n < 8; i++) {
        char *eq = strchr(argv[i], '=');
        if (!eq)
            continue;
        *eq = '\0';
        kv[2 * n] = argv[i];
        kv[2 * n + 1] = eq + 1;
        n++;
    }
    wo = mkopts(kv, n);
    to = (wx_opts_t){0, NULL, NULL};
    for (size_t i = 0; i < sizeof(plain) / sizeof(plain[0]); i++)
        if (!strcmp(sc, plain[i].name))
            return plain[i].run();
    for (size_t i = 0; i < sizeof(paired) / sizeof(paired[0]); i++)
        if (!strcmp(sc, paired[i].name))
            return paired[i].run(&wo, &to);
    fprintf(stderr, "unknown scenario %s\n", sc);
    return 2;
}
