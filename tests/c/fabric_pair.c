/* fabric_pair.c - two-process test of the fabric backend at the C level (no Python).
 *
 * The target process registers a buffer that lives in a MAP_SHARED mapping created before
 * fork, so the writer can look at the target's memory directly the moment a completion
 * arrives: that is how "completion means landed" is checked.
 *
 *   fabric_pair PROVIDER SCENARIO     (PROVIDER: tcp | shm | ...; SCENARIO below)
 *     basic     odd sizes, unaligned offsets, byte checks
 *     landed    300 x (write 1 MiB, check target memory at completion)
 *     small     4000 x 61-byte writes pipelined, then check
 *     refuse    bad key / out of range / forged descriptor refused; target memory untouched
 *     dead      target SIGKILLed after a first write: next writes fail in bounded time,
 *               close() does not hang
 *     closeout  close with writes in flight: each op completed exactly once
 *     engine    the engine's threads: 64 tasks of 4 writes each landed and checked, then
 *               64 more stopped while queued, every one reaped (what `make tsan-test`
 *               races against the transport's progress thread)
 *     external  external tasks (bytes written by this process into the target's memory, then
 *               signalled from another thread): ordered before a fence, counted by its wait
 *               and the trace; a failure signalled, a missed deadline, a stop while waiting
 *     bench     GB/s for 1..64 MiB (prints a table)
 * Exit status 0 when every check passed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <glob.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "wx_desc.h"
#include "wx_engine.h"
#include "wx_transport.h"
#include "check.h"

#define TBUF (72u << 20) /* target buffer */

typedef struct top {
    wx_op_t op;
    atomic_int done;
    atomic_int calls;
    int status;
    char msg[512];
    uint8_t *check; /* when set: compare at completion (landed check) */
    const uint8_t *want;
    uint64_t check_len;
    atomic_int *mismatch;
} top_t;

static void top_done(wx_op_t *op, int status, const char *msg)
{
    top_t *o = (top_t *)op;
    o->status = status;
    snprintf(o->msg, sizeof o->msg, "%s", msg ? msg : "");
    if (status == 0 && o->check && memcmp(o->check, o->want, o->check_len) != 0)
        atomic_fetch_add(o->mismatch, 1);
    atomic_fetch_add(&o->calls, 1);
    atomic_store(&o->done, 1);
}

static double now_s(void) { return (double)wx_now_ns() / 1e9; }

static int wait_op(top_t *o, double timeout)
{
    double end = now_s() + timeout;
    while (!atomic_load(&o->done)) {
        if (now_s() > end)
            return -ETIMEDOUT;
        usleep(50);
    }
    return o->status;
}

static void put_blob(int fd, const void *b, uint32_t n)
{
    CHECK(write(fd, &n, 4) == 4 && write(fd, b, n) == (ssize_t)n, "pipe write");
}
static uint32_t get_blob(int fd, void *b, uint32_t cap)
{
    uint32_t n;
    CHECK(read(fd, &n, 4) == 4 && n <= cap, "pipe read");
    for (uint32_t got = 0; got < n;) {
        ssize_t r = read(fd, (uint8_t *)b + got, n - got);
        CHECK(r > 0, "pipe read body");
        got += (uint32_t)r;
    }
    return n;
}

static wx_opts_t mkopts(const char **k, const char **v, int n)
{
    wx_opts_t o = {n, k, v};
    return o;
}

static const char *g_prov;
static wx_opts_t g_opts;
static const char *g_keys[4], *g_vals[4];

/* The target: register the shared buffer, send the export blob, wait for "q". */
static void target_main(uint8_t *tbuf, int to_writer, int from_writer)
{
    wx_transport_t *t;
    wx_mr_t *mr;
    uint8_t blob[8192];
    size_t blen;
    char c;
    int rc = wx_transport_open("fabric", &g_opts, &t);
    CHECK(rc == 0, "target open: %s", wx_last_error());
    rc = wx_reg(t, tbuf, TBUF, WX_MEM_HOST, -1, 1, &mr);
    CHECK(rc == 0, "target reg: %s", wx_last_error());
    rc = wx_export(t, blob, sizeof blob, &blen);
    CHECK(rc == 0, "export: %s", wx_last_error());
    put_blob(to_writer, blob, (uint32_t)blen);
    while (read(from_writer, &c, 1) == 1 && c != 'q')
        ;
    wx_transport_close(t);
    _exit(0);
}

typedef struct pair {
    pid_t child;
    int to_child, from_child;
    uint8_t *tbuf;
    wx_transport_t *t;
    wx_peer_t *peer;
    wx_mr_t *src;
    uint8_t *sbuf;
    wx_rinfo_t ri;
} pair_t;

static void pair_start(pair_t *P, uint64_t src_len)
{
    int a[2], b[2];
    uint8_t blob[8192], req[WX_CONN_MAX];
    size_t req_len = sizeof req;
    uint32_t n, kind, alen, nreg;
    uint8_t addr[WX_ADDR_MAX];
    wx_rinfo_t *regs;
    int rc;
    P->tbuf = mmap(NULL, TBUF, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(P->tbuf != MAP_FAILED, "mmap");
    CHECK(pipe(a) == 0 && pipe(b) == 0, "pipe");
    P->child = fork();
    CHECK(P->child >= 0, "fork");
    if (P->child == 0) {
        close(a[0]);
        close(b[1]);
        target_main(P->tbuf, a[1], b[0]);
    }
    close(a[1]);
    close(b[0]);
    P->from_child = a[0];
    P->to_child = b[1];
    rc = wx_transport_open("fabric", &g_opts, &P->t);
    CHECK(rc == 0, "writer open: %s", wx_last_error());
    P->sbuf = aligned_alloc(4096, (src_len + 4095) & ~4095ull);
    CHECK(P->sbuf, "alloc");
    rc = wx_reg(P->t, P->sbuf, src_len, WX_MEM_HOST, -1, 0, &P->src);
    CHECK(rc == 0, "writer reg: %s", wx_last_error());
    n = get_blob(P->from_child, blob, sizeof blob);
    rc = wx_export_decode(blob, n, &kind, addr, &alen, &nreg, &regs);
    CHECK(rc == 0 && nreg == 1, "decode: %s", wx_last_error());
    P->ri = regs[0];
    free(regs);
    rc = wx_connect_request(P->t, blob, n, &P->peer, req, &req_len);
    CHECK(rc == 0, "connect_request: %s", wx_last_error());
    CHECK(req_len == 0, "fabric needs no handshake, got %zu bytes", req_len);
    rc = wx_connect_finish(P->t, P->peer, NULL, 0);
    CHECK(rc == 0, "connect_finish: %s", wx_last_error());
}

static void pair_stop(pair_t *P)
{
    int st;
    double t0 = now_s();
    if (P->child > 0) {
        (void)!write(P->to_child, "q", 1);
        CHECK(waitpid(P->child, &st, 0) == P->child, "waitpid");
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "target exit status %d", st);
    }
    wx_transport_close(P->t);
    CHECK(now_s() - t0 < 10, "close took %.1f s", now_s() - t0);
    munmap(P->tbuf, TBUF);
    free(P->sbuf);
}

/* Validate and post, retrying -EAGAIN; returns the post's rc (0 = posted). */
static int post(pair_t *P, top_t *o, uint64_t loff, uint64_t roff, uint64_t len)
{
    wx_rinfo_t ri;
    wx_wr_t wr;
    double end = now_s() + 20;
    int rc =
        wx_validate(P->t, P->peer, P->ri.key, P->ri.rbase, P->ri.len, roff, len, P->src, loff, &ri);
    if (rc)
        return rc;
    wr.local = P->src;
    wr.loff = loff;
    wr.remote = &ri;
    wr.roff = roff;
    wr.len = len;
    memset(o, 0, offsetof(top_t, check));
    o->op.done = top_done;
    for (;;) {
        rc = wx_post_write(P->t, P->peer, &wr, &o->op);
        if (rc != -EAGAIN)
            return rc;
        CHECK(now_s() < end, "EAGAIN for 20 s");
        usleep(20);
    }
}

/* Write len bytes in chunks of at most max_write, all in flight at once; wait. */
static int write_all(pair_t *P, uint64_t loff, uint64_t roff, uint64_t len, double timeout,
                     char *why, size_t why_len)
{
    uint64_t mw = P->t->max_write, n = (len + mw - 1) / mw;
    top_t *ops = calloc(n ? n : 1, sizeof *ops);
    int rc = 0;
    uint64_t posted = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t off = i * mw, l = len - off < mw ? len - off : mw;
        ops[i].op.wr_id = i;
        rc = post(P, &ops[i], loff + off, roff + off, l);
        if (rc) {
            snprintf(why, why_len, "post: %s", wx_last_error());
            break;
        }
        posted++;
    }
    for (uint64_t i = 0; i < posted; i++) {
        int r = wait_op(&ops[i], timeout);
        if (r && !rc) {
            rc = r;
            snprintf(why, why_len, "%s", r == -ETIMEDOUT ? "test wait timed out" : ops[i].msg);
        }
    }
    free(ops);
    return rc;
}

static void fill(uint8_t *p, uint64_t n, unsigned seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (uint64_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        p[i] = (uint8_t)(x >> 24);
    }
}

static void sc_basic(void)
{
    pair_t P = {0};
    static const uint64_t sizes[] = {1, 7, 4097, (1u << 20) + 3, (16u << 20) + 13, 0};
    char why[512];
    pair_start(&P, 20u << 20);
    fill(P.sbuf, 20u << 20, 1);
    for (int i = 0; sizes[i]; i++) {
        uint64_t loff = 3 + i, roff = 4096 * i + 5 + i;
        int rc = write_all(&P, loff, roff, sizes[i], 10, why, sizeof why);
        CHECK(rc == 0, "write %llu: %s", (unsigned long long)sizes[i], why);
        CHECK(memcmp(P.tbuf + roff, P.sbuf + loff, sizes[i]) == 0, "bytes differ (size %llu)",
              (unsigned long long)sizes[i]);
        CHECK(roff == 0 || P.tbuf[roff - 1] == 0 || i > 0, "byte before the range changed");
    }
    CHECK(P.tbuf[TBUF - 1] == 0, "end of buffer touched");
    pair_stop(&P);
    printf("basic ok\n");
}

static void sc_landed(void)
{
    pair_t P = {0};
    const uint64_t len = 1u << 20;
    atomic_int mismatch = 0;
    pair_start(&P, len * 2);
    for (int i = 0; i < 300; i++) {
        top_t o;
        uint64_t loff = (uint64_t)(i & 1) * len;
        fill(P.sbuf + loff, len, 100 + i);
        /* done() compares the target's memory the moment the completion arrives */
        o.check = P.tbuf + 4096;
        o.want = P.sbuf + loff;
        o.check_len = len;
        o.mismatch = &mismatch;
        CHECK(post(&P, &o, loff, 4096, len) == 0, "post: %s", wx_last_error());
        CHECK(wait_op(&o, 10) == 0, "write %d: %s", i, o.msg);
        CHECK(memcmp(P.tbuf + 4096, P.sbuf + loff, len) == 0,
              "write %d completed but the bytes are not in the target", i);
    }
    CHECK(atomic_load(&mismatch) == 0, "%d completions before the data landed",
          atomic_load(&mismatch));
    pair_stop(&P);
    printf("landed ok (300 x 1 MiB, target memory checked at each completion)\n");
}

static void sc_small(void)
{
    pair_t P = {0};
    const int n = 4000;
    const uint64_t len = 61;
    top_t *ops = calloc(n, sizeof *ops);
    pair_start(&P, (uint64_t)n * len);
    fill(P.sbuf, (uint64_t)n * len, 7);
    double t0 = now_s();
    for (int i = 0; i < n; i++) {
        ops[i].op.wr_id = (uint64_t)i;
        CHECK(post(&P, &ops[i], (uint64_t)i * len, 1 + (uint64_t)i * len, len) == 0, "post %d: %s",
              i, wx_last_error());
    }
    for (int i = 0; i < n; i++)
        CHECK(wait_op(&ops[i], 10) == 0, "small write %d: %s", i, ops[i].msg);
    double dt = now_s() - t0;
    for (int i = 0; i < n; i++)
        CHECK(atomic_load(&ops[i].calls) == 1, "op %d done() called %d times", i,
              atomic_load(&ops[i].calls));
    CHECK(memcmp(P.tbuf + 1, P.sbuf, (uint64_t)n * len) == 0, "small writes: bytes differ");
    pair_stop(&P);
    free(ops);
    printf("small ok (%d x %llu B in %.3f s, %.0f writes/s)\n", n, (unsigned long long)len, dt,
           n / dt);
}

static void sc_refuse(void)
{
    pair_t P = {0};
    wx_rinfo_t ri;
    wx_wr_t wr;
    top_t o;
    int rc;
    pair_start(&P, 1u << 20);
    memset(P.sbuf, 0xab, 1u << 20);
    rc = wx_validate(P.t, P.peer, P.ri.key + 1, P.ri.rbase, P.ri.len, 0, 16, P.src, 0, &ri);
    CHECK(rc == -EACCES, "bad key: rc %d", rc);
    printf("  bad key refused: %s\n", wx_last_error());
    rc = wx_validate(P.t, P.peer, P.ri.key, P.ri.rbase, P.ri.len, TBUF - 8, 16, P.src, 0, &ri);
    CHECK(rc == -ERANGE, "out of range: rc %d", rc);
    printf("  out of range refused: %s\n", wx_last_error());
    rc = wx_validate(P.t, P.peer, P.ri.key, P.ri.rbase, P.ri.len * 2, TBUF, 16, P.src, 0, &ri);
    CHECK(rc == -EACCES, "forged length: rc %d", rc);
    printf("  forged descriptor refused: %s\n", wx_last_error());
    /* Still usable after the refusals. */
    {
        char why[512];
        CHECK(write_all(&P, 0, 100, 1000, 10, why, sizeof why) == 0, "write after refusals: %s",
              why);
        CHECK(P.tbuf[100] == 0xab && P.tbuf[99] == 0 && P.tbuf[1100] == 0, "bytes after refusals");
    }
    /* Below the generic layer (last: it may fail the peer): a forged key straight to the provider. tcp checks keys
     * (error completion); shm does not (issue 2) - which is why the generic layer must. */
    {
        wx_rinfo_t forged = P.ri;
        forged.key ^= 0x5a5a;
        wr.local = P.src;
        wr.loff = 0;
        wr.remote = &forged;
        wr.roff = 0;
        wr.len = 16;
        memset(&o, 0, sizeof o);
        o.op.done = top_done;
        rc = wx_post_write(P.t, P.peer, &wr, &o.op);
        if (rc == 0)
            rc = wait_op(&o, 10);
        printf("  provider %s, forged key below the checks: rc %d (%s), target byte 0 = 0x%02x\n",
               g_prov, rc, rc ? (o.msg[0] ? o.msg : wx_last_error()) : "accepted", P.tbuf[0]);
        /* tcp: error completion; shm (1.17): the write neither lands nor completes, so the
         * backend's op timeout (run with timeout=N) ends it. Either way nothing lands. */
        CHECK(rc != 0, "provider accepted a forged key");
        CHECK(P.tbuf[0] == 0 && P.tbuf[15] == 0, "a forged-key write changed target memory");
    }
    pair_stop(&P);
    printf("refuse ok\n");
}

static void sc_dead(void)
{
    pair_t P = {0};
    char why[512];
    int st, rc;
    double t0;
    pair_start(&P, 8u << 20);
    CHECK(write_all(&P, 0, 0, 1u << 20, 10, why, sizeof why) == 0, "first write: %s", why);
    kill(P.child, SIGKILL);
    CHECK(waitpid(P.child, &st, 0) == P.child, "waitpid");
    {
        /* shm: a process killed before closing its endpoint leaves /dev/shm/PID:N:N */
        char pat[64];
        glob_t g;
        snprintf(pat, sizeof pat, "/dev/shm/%d:*", (int)P.child);
        if (glob(pat, 0, NULL, &g) == 0) {
            for (size_t i = 0; i < g.gl_pathc; i++) {
                printf("  removing what the killed target left: %s\n", g.gl_pathv[i]);
                unlink(g.gl_pathv[i]);
            }
            globfree(&g);
        }
    }
    P.child = -1;
    t0 = now_s();
    rc = 0;
    for (int i = 0; i < 5 && rc == 0; i++)
        rc = write_all(&P, 0, 0, 8u << 20, 60, why, sizeof why);
    printf("  write to a dead peer: rc %d after %.2f s: %s\n", rc, now_s() - t0, why);
    CHECK(rc != 0, "writes to a dead peer all succeeded");
    CHECK(rc != -ETIMEDOUT || strstr(why, "test wait") == NULL, "no completion within 60 s");
    t0 = now_s();
    rc = write_all(&P, 0, 0, 4096, 60, why, sizeof why);
    printf("  next write: rc %d after %.2f s: %s\n", rc, now_s() - t0, why);
    CHECK(rc != 0, "later write to a dead peer succeeded");
    pair_stop(&P);
    printf("dead ok\n");
}

static void sc_closeout(void)
{
    pair_t P = {0};
    const int n = 64;
    top_t *ops = calloc(n, sizeof *ops);
    int ok = 0, cancelled = 0, posted = 0;
    pair_start(&P, 64u << 20);
    for (int i = 0; i < n; i++) {
        if (post(&P, &ops[i], 0, 0, 1u << 20) != 0)
            break;
        posted++;
    }
    (void)!write(P.to_child, "q", 1);
    waitpid(P.child, NULL, 0);
    P.child = -1;
    {
        double t0 = now_s();
        wx_transport_close(P.t);
        CHECK(now_s() - t0 < 10, "close took %.1f s", now_s() - t0);
        printf("  close with writes in flight: %.3f s\n", now_s() - t0);
    }
    for (int i = 0; i < posted; i++) {
        CHECK(atomic_load(&ops[i].calls) == 1, "op %d: done() called %d times", i,
              atomic_load(&ops[i].calls));
        ok += ops[i].status == 0;
        cancelled += ops[i].status == -ECANCELED;
    }
    printf("closeout ok (%d posted: %d completed, %d cancelled, %d other errors)\n", posted, ok,
           cancelled, posted - ok - cancelled);
    munmap(P.tbuf, TBUF);
    free(P.sbuf);
    free(ops);
}

static void sc_bench(void)
{
    pair_t P = {0};
    static const uint64_t mib[] = {1, 4, 16, 64, 0};
    char why[512];
    pair_start(&P, 64u << 20);
    fill(P.sbuf, 64u << 20, 3);
    CHECK(write_all(&P, 0, 0, 64u << 20, 30, why, sizeof why) == 0, "warmup: %s", why);
    for (int i = 0; mib[i]; i++) {
        uint64_t len = mib[i] << 20;
        int reps = mib[i] >= 16 ? 5 : 20;
        double best = 0, sum = 0;
        for (int r = 0; r < reps; r++) {
            double t0 = now_s();
            CHECK(write_all(&P, 0, 0, len, 30, why, sizeof why) == 0, "bench: %s", why);
            double g = (double)len / (now_s() - t0) / 1e9;
            sum += g;
            best = g > best ? g : best;
        }
        CHECK(memcmp(P.tbuf, P.sbuf, len) == 0, "bench bytes differ");
        printf("bench %s %3llu MiB: mean %.2f GB/s, best %.2f GB/s (%d reps, chunk %llu)\n", g_prov,
               (unsigned long long)mib[i], sum / reps, best, reps,
               (unsigned long long)P.t->max_write);
    }
    pair_stop(&P);
}

static uint64_t engine_submit_f(pair_t *P, wx_engine_t *e, uint32_t i, uint64_t len, int fence)
{
    wx_dest_t d = {0};
    wx_task_spec_t spec = {0};
    uint64_t t0 = wx_now_ns(), ta, id;
    int rc = wx_validate(P->t, P->peer, P->ri.key, P->ri.rbase, P->ri.len, i * len, len, P->src,
                         i * len, &d.ri);
    CHECK(rc == 0, "validate: %s", wx_last_error());
    d.peer = P->peer;
    d.roff = d.loff = i * len;
    d.len = len;
    spec.src = P->src;
    spec.held_bytes = len;
    spec.dests = &d;
    spec.ndests = 1;
    spec.tag = i;
    spec.fence = fence;
    while ((rc = wx_engine_admit(e, len, 100000000ull, &ta)) == -EAGAIN)
        ;
    CHECK(rc == 0, "admit: %s", wx_last_error());
    rc = wx_engine_submit(e, &spec, t0, ta, &id);
    CHECK(rc == 0, "submit: %s", wx_last_error());
    return id;
}

static void engine_submit(pair_t *P, wx_engine_t *e, uint32_t i, uint64_t len)
{
    engine_submit_f(P, e, i, len, 0);
}

static void sc_engine(void)
{
    enum { N = 64, LEN = 16384 };
    pair_t P = {0};
    wx_engine_opts_t o = {0};
    wx_engine_stats_t st;
    wx_engine_t *e;
    double end;
    int rc, n = 0;
    pair_start(&P, 2 * N * LEN);
    fill(P.sbuf, 2 * N * LEN, 7);
    o.chunk = LEN / 4;
    o.depth = 4;
    o.watermark = 8 * LEN;
    o.timeout_ns = 10000000000ull;
    rc = wx_engine_create(P.t, &o, &e);
    CHECK(rc == 0, "engine: %s", wx_last_error());
    for (uint32_t i = 0; i < N; i++) {
        engine_submit(&P, e, i, LEN);
        wx_engine_stats(e, &st);
    }
    end = now_s() + 20;
    while ((rc = wx_engine_wait(e, 100000000ull)) == -EAGAIN && now_s() < end)
        ;
    CHECK(rc == 0, "wait: %d %s", rc, wx_last_error());
    CHECK(memcmp(P.tbuf, P.sbuf, N * LEN) == 0, "engine: bytes differ");
    CHECK(wx_engine_reap(e, NULL, NULL) == N, "reap");
    for (uint32_t i = N; i < 2 * N; i++)
        engine_submit(&P, e, i, LEN);
    wx_engine_stop(e); /* tasks still queued finish as cancelled */
    end = now_s() + 20;
    while ((n += wx_engine_reap(e, NULL, NULL)) < N && now_s() < end)
        usleep(1000);
    CHECK(n == N, "reaped %d of %d after stop", n, N);
    wx_engine_destroy(e);
    pair_stop(&P);
    printf("engine ok\n");
}

/* An external task of one destination, [roff, roff+len) of the target's region, signalled by
 * the host (no CUDA event). */
static uint64_t ext_submit(pair_t *P, wx_engine_t *e, uint64_t roff, uint64_t len, uint64_t tag)
{
    wx_dest_t d = {0};
    wx_task_spec_t spec = {0};
    uint64_t t0 = wx_now_ns(), ta, id;
    int rc =
        wx_validate(P->t, P->peer, P->ri.key, P->ri.rbase, P->ri.len, roff, len, NULL, 0, &d.ri);
    CHECK(rc == 0, "validate: %s", wx_last_error());
    d.peer = P->peer;
    d.roff = roff;
    d.len = len;
    spec.dests = &d;
    spec.ndests = 1;
    spec.tag = tag;
    spec.external = 1;
    CHECK(wx_engine_admit(e, 0, 0, &ta) == 0, "admit: %s", wx_last_error());
    rc = wx_engine_submit(e, &spec, t0, ta, &id);
    CHECK(rc == 0, "submit external: %s", wx_last_error());
    return id;
}

typedef struct ext_writer {
    pair_t *P;
    wx_engine_t *e;
    uint64_t id, off, len;
    atomic_int signalled;
} ext_writer_t;

/* The "in-place write": this process copies the bytes into the target's memory itself (the
 * shared mapping), later, then signals the engine. */
static void *ext_writer_main(void *arg)
{
    ext_writer_t *w = arg;
    usleep(100 * 1000);
    memcpy(w->P->tbuf + w->off, w->P->sbuf + w->off, w->len);
    atomic_store(&w->signalled, 1);
    CHECK(wx_engine_external_done(w->e, w->id, 0, NULL) == 0, "signal: %s", wx_last_error());
    return NULL;
}

static wx_trace_rec_t ext_rec(wx_engine_t *e, uint64_t tag)
{
    wx_trace_rec_t *recs, r = {0};
    size_t n;
    CHECK(wx_engine_trace(e, &recs, &n, NULL) == 0, "trace");
    for (size_t i = 0; i < n; i++)
        if (recs[i].tag == tag)
            r = recs[i];
    free(recs);
    CHECK(r.id, "no trace record of tag %llu", (unsigned long long)tag);
    return r;
}

static int ext_wait(wx_engine_t *e, uint64_t fence, double timeout)
{
    double end = now_s() + timeout;
    int rc;
    do
        rc = fence ? wx_engine_wait_fence(e, 10000000ull, fence) : wx_engine_wait(e, 10000000ull);
    while (rc == -EAGAIN && now_s() < end);
    return rc;
}

/* A write, an external task signalled 100 ms later by another thread, a fence after it. */
static void ext_ordered(pair_t *P, wx_engine_t *e, uint64_t len)
{
    ext_writer_t w = {P, e, 0, len, len, 0};
    wx_engine_stats_t st;
    pthread_t th;
    uint64_t fence;
    uint32_t word = 7; /* the fence word (the begin stamps' device wait), read here meanwhile */
    wx_engine_set_fence_word(e, &word);
    CHECK(__atomic_load_n(&word, __ATOMIC_ACQUIRE) == 0, "fence word before any fence");
    engine_submit_f(P, e, 0, len, 0);
    w.id = ext_submit(P, e, len, len, 100);
    fence = engine_submit_f(P, e, 2, len, 1);
    CHECK(pthread_create(&th, NULL, ext_writer_main, &w) == 0, "thread");
    for (double end = now_s() + 20; now_s() < end;) /* the engine stores it as the fence ends */
        if (__atomic_load_n(&word, __ATOMIC_ACQUIRE) == (uint32_t)fence)
            break;
        else
            usleep(1000);
    CHECK(__atomic_load_n(&word, __ATOMIC_ACQUIRE) == (uint32_t)fence, "fence word %u", word);
    CHECK(ext_wait(e, fence, 20) == 0, "wait fence: %s", wx_last_error());
    CHECK(atomic_load(&w.signalled), "the fence finished before the external task's signal");
    wx_engine_set_fence_word(e, NULL); /* dropped: set past every task */
    CHECK(word == (uint32_t)fence + 1, "fence word dropped: %u", word);
    CHECK(ext_wait(e, 0, 20) == 0, "wait: %s", wx_last_error());
    pthread_join(th, NULL);
    CHECK(memcmp(P->tbuf, P->sbuf, 3 * len) == 0, "external: bytes differ");
    wx_trace_rec_t x = ext_rec(e, 100), f = ext_rec(e, 2);
    CHECK(x.kind == WX_TASK_EXTERNAL && f.kind == WX_TASK_WRITE, "kinds %u %u", x.kind, f.kind);
    CHECK(x.status == 0 && x.nwrites == 1 && x.bytes == len && x.held == 0, "external record");
    CHECK(f.t_post_first >= x.t_done && x.t_ready >= x.t_submit, "fence posted before it finished");
    wx_engine_stats(e, &st);
    CHECK(st.bytes_external == len && st.completed == 3, "stats %llu %llu",
          (unsigned long long)st.bytes_external, (unsigned long long)st.completed);
    CHECK(wx_engine_external_done(e, w.id, 0, NULL) == -ENOENT, "signal after finish");
    CHECK(wx_engine_external_done(e, fence, 0, NULL) == -ENOENT, "signal of a write task");
    CHECK(wx_engine_external_done(e, w.id, 5, NULL) == -EINVAL, "positive status");
    CHECK(wx_engine_reap(e, NULL, NULL) == 3, "reap");
}

/* One external task holds the ready stage; the one behind it is signalled twice (refused),
 * then the first is signalled failed: the engine fails naming its task and peer. */
static void ext_failed(pair_t *P, wx_engine_t *e, uint64_t len)
{
    wx_engine_fail_t f;
    uint64_t a = ext_submit(P, e, 0, len, 200), b = ext_submit(P, e, len, len, 201);
    usleep(20 * 1000);
    CHECK(wx_engine_external_done(e, b, 0, NULL) == 0, "signal b: %s", wx_last_error());
    CHECK(wx_engine_external_done(e, b, 0, NULL) == -EALREADY, "b signalled twice");
    CHECK(wx_engine_external_done(e, a, -EIO, "kernel failed") == 0, "signal a");
    CHECK(ext_wait(e, 0, 20) == -EIO, "wait after a failed signal: %s", wx_last_error());
    CHECK(wx_engine_error(e, &f) == -EIO && f.task == a && f.tag == 200, "error fields");
    CHECK(f.peer == (int64_t)P->peer->id && !strcmp(f.stage, "write"), "error peer/stage");
    CHECK(strstr(f.reason, "in-place writes to") && strstr(f.reason, "kernel failed"), "reason %s",
          f.reason);
    double end = now_s() + 20;
    int n = 0;
    while ((n += wx_engine_reap(e, NULL, NULL)) < 2 && now_s() < end)
        usleep(1000); /* (the failure is reported at once; b finishes after it) */
    CHECK(n == 2, "reaped %d of 2", n);
    CHECK(ext_rec(e, 201).status == -ECANCELED, "b not cancelled: %d", ext_rec(e, 201).status);
}

static void sc_external(void)
{
    enum { LEN = 65536 };
    pair_t P = {0};
    wx_engine_opts_t o = {0};
    wx_engine_fail_t f;
    wx_engine_t *e;
    double t0;
    int n = 0;
    pair_start(&P, 4 * LEN);
    fill(P.sbuf, 4 * LEN, 11);
    o.chunk = 4096;
    o.depth = 4;
    o.timeout_ns = 10000000000ull;
    CHECK(wx_engine_create(P.t, &o, &e) == 0, "engine: %s", wx_last_error());
    ext_ordered(&P, e, LEN);
    wx_engine_destroy(e);
    CHECK(wx_engine_create(P.t, &o, &e) == 0, "engine: %s", wx_last_error());
    ext_failed(&P, e, LEN);
    wx_engine_destroy(e);
    o.timeout_ns = 300000000ull; /* never signalled: the deadline */
    CHECK(wx_engine_create(P.t, &o, &e) == 0, "engine: %s", wx_last_error());
    uint64_t late = ext_submit(&P, e, 0, 8, 300);
    t0 = now_s();
    CHECK(ext_wait(e, 0, 20) == -ETIMEDOUT, "no deadline: %s", wx_last_error());
    CHECK(now_s() - t0 < 5, "deadline after %.1f s", now_s() - t0);
    CHECK(wx_engine_error(e, &f) == -ETIMEDOUT && f.task == late && !strcmp(f.stage, "deadline"),
          "deadline fields");
    CHECK(strstr(f.reason, "not signalled complete after 0.3 s"), "reason %s", f.reason);
    wx_engine_clear_error(e);
    ext_submit(&P, e, 0, 8, 301); /* waiting when the engine stops */
    ext_submit(&P, e, 8, 8, 302);
    usleep(20 * 1000);
    wx_engine_stop(e);
    t0 = now_s();
    while ((n += wx_engine_reap(e, NULL, NULL)) < 3 && now_s() - t0 < 20)
        usleep(1000);
    CHECK(n == 3, "reaped %d of 3 after stop", n);
    CHECK(ext_rec(e, 301).status == -ECANCELED && ext_rec(e, 302).status == -ECANCELED, "stop");
    wx_engine_destroy(e);
    pair_stop(&P);
    printf("external ok\n");
}

/* The scenarios, by the name main's second argument gives. */
static const struct {
    const char *name;
    void (*run)(void);
} scenarios[] = {{"basic", sc_basic},   {"landed", sc_landed},     {"small", sc_small},
                 {"refuse", sc_refuse}, {"dead", sc_dead},         {"closeout", sc_closeout},
                 {"engine", sc_engine}, {"external", sc_external}, {"bench", sc_bench}};

int main(int argc, char **argv)
{
    int n = 0;
    if (argc < 3) {
        fprintf(stderr,
                "usage: %s PROVIDER basic|landed|small|refuse|dead|closeout|engine|external|bench "
                "[key=value ...]\n",
                argv[0]);
        return 2;
    }
    g_prov = argv[1];
    g_keys[n] = "provider";
    g_vals[n++] = g_prov;
    for (int i = 3; i < argc && n < 4; i++) {
        char *eq = strchr(argv[i], '=');
        CHECK(eq, "option %s: expected key=value", argv[i]);
        *eq = '\0';
        g_keys[n] = argv[i];
        g_vals[n++] = eq + 1;
    }
    g_opts = mkopts(g_keys, g_vals, n);
    signal(SIGPIPE, SIG_IGN);
    for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]); i++)
        if (!strcmp(argv[2], scenarios[i].name)) {
            scenarios[i].run();
            return 0;
        }
    FAIL("unknown scenario %s", argv[2]);
    return 0;
}
