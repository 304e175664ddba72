/* wx_engine.h - the native transfer engine.
 *
 * A task is one source buffer written to one or more destinations. Tasks flow through
 * per-stage FIFO queues served by native threads (never calling Python):
 *
 *   admit (caller, watermark) -> [ready queue] ready thread: wait for the CUDA event that
 *   marks the buffer produced -> [post queue] post thread: split each destination into
 *   chunks of at most `chunk` bytes and post them, up to `depth` in flight -> completions
 *   (transport's thread) -> [done list] -> reap (caller's thread: release the buffer's
 *   owner, e.g. the DLPack deleter).
 *
 * A write task with no CUDA event submitted while the ready stage is idle (its queue empty,
 * its thread holding no task) goes straight onto the post queue in the submit call: the
 * version stamps need no wake-up of the ready thread, and the tasks' order is the same.
 *
 * An external task (spec.external) names destinations whose bytes the caller writes itself
 * (an in-place kernel into memory mapped from the peer): nothing is posted. Its ready stage
 * waits for its completion signal -- its CUDA event (polled, never blocking) or
 * wx_engine_external_done -- bounded by the deadline; in the post stage it waits, as a write
 * task would, for the fence before it, then finishes. So fences, failed-peer skipping,
 * deadlines, wx_engine_wait(_fence) and the trace cover it like any task. The engine orders
 * its *finish*, not the caller's write: the caller starts that write only once the fences it
 * must follow have finished (wx_engine_wait_fence).
 *
 * Watermark: a task is admitted only while the bytes held by admitted, not yet completed
 * tasks plus its own stay under the watermark (a task larger than the watermark is
 * admitted alone). Every wait is bounded: admission and wait take a time slice and return
 * -EAGAIN when it passes, so a caller can check for signals and loop; every posted task
 * has a deadline (`timeout_ns`), after which the engine fails with -ETIMEDOUT naming the
 * task and peer. The first error sticks: later submits and waits return it. With
 * `isolate`, a failed or late peer fails alone (wx_engine_failed_peers) and the other
 * peers' writes complete.
 */
#ifndef WX_ENGINE_H
#define WX_ENGINE_H

#include "wx_transport.h"

typedef struct wx_engine wx_engine_t;

typedef struct wx_engine_opts {
    uint64_t watermark;  /* bytes; 0 = unlimited */
    uint64_t chunk;      /* largest write posted; 0 = transport's max_write */
    uint32_t depth;      /* writes in flight; 0 = transport's max_inflight */
    uint64_t timeout_ns; /* per-task deadline from its first post; 0 = 30 s */
    uint32_t isolate;    /* 1: a peer whose write fails or is late fails alone: its writes
                          * in flight are abandoned, its later writes skipped, the other
                          * peers' writes go on; see wx_engine_failed_peers */
} wx_engine_opts_t;

typedef struct wx_dest {
    wx_peer_t *peer;
    wx_rinfo_t ri; /* copy of the validated entry of the peer's table (the table
                           * itself may be replaced while the task is queued) */
    uint64_t roff; /* offset in the remote region */
    uint64_t loff; /* offset in the source buffer */
    uint64_t len;
} wx_dest_t;

typedef struct wx_task_spec {
    wx_mr_t *src;        /* registered source, or an unregistered wx_mr_t describing it */
    uint64_t held_bytes; /* bytes counted against the watermark */
    void *cuda_event;    /* CUevent to wait for before posting, or NULL */
    int cuda_device;
    const wx_dest_t *dests; /* copied by submit */
    uint32_t ndests;
    uint64_t tag; /* caller's id, reported in errors and the trace */
    void *owner;  /* handed back by wx_engine_reap once the task is finished */
    int fence;    /* 1: its writes are posted once every earlier write has completed, and
                   * later tasks' writes once its own have (a barrier on both sides: the
                   * version stamps before and after a step's data) */
    int external; /* 1: an external task: src unused (may be NULL), dests' bytes written by the
                   * caller; finishes at its signal (cuda_event if set, else
                   * wx_engine_external_done), after the fence before it */
} wx_task_spec_t;

#define WX_ENGINE_TRACE_MAX 65536 /* trace records kept (a ring: the oldest go first) */

enum { WX_TASK_WRITE, WX_TASK_EXTERNAL }; /* wx_trace_rec_t.kind */

typedef struct wx_trace_rec {
    uint64_t id, tag, bytes, held;
    uint32_t ndests, nwrites; /* external: nwrites = destinations signalled (not skipped) */
    uint32_t kind;            /* WX_TASK_* */
    int status;
    uint64_t t_submit, t_admit, t_ready, t_post_first, t_post_last, t_done;
} wx_trace_rec_t;

/* One failure, as data, filled where it happens; wx_engine_fail_msg makes the one-line
 * message users read from it. */
typedef struct wx_engine_fail {
    int err;           /* negative errno */
    uint64_t task;     /* the task's id (what wx_engine_submit returned); 0: none */
    uint64_t tag;      /* its caller's tag */
    int64_t peer;      /* the peer's id (wx_peer_t.id); -1: none */
    const char *stage; /* static: "ready" (its CUDA event), "post", "write" (a completion),
                        * "deadline" */
    char reason[WX_ERRMSG_MAX];
} wx_engine_fail_t;

/* "task 3 (tag 7), peer 1, write: <reason>" into buf. */
void wx_engine_fail_msg(const wx_engine_fail_t *f, char *buf, size_t len);

typedef struct wx_engine_stats {
    uint64_t submitted, completed, bytes_written, held, held_peak, inflight;
    uint64_t trace_dropped;  /* trace records overwritten since the last clear */
    uint64_t bytes_external; /* bytes of external tasks' destinations signalled done */
} wx_engine_stats_t;

int wx_engine_create(wx_transport_t *t, const wx_engine_opts_t *o, wx_engine_t **out);
/* Stop the threads; queued tasks finish as cancelled (reap their owners afterwards).
 * Idempotent. */
void wx_engine_stop(wx_engine_t *e);
/* Stop, then release. Tasks still in flight keep the engine's memory alive until the
 * transport completes or cancels their writes; their owners are then never reaped, so
 * call wx_engine_wait (or close the transport) and reap first. */
void wx_engine_destroy(wx_engine_t *e);

/* Block up to slice_ns for room under the watermark. 0: admitted (counted as held);
 * -EAGAIN: slice passed; other: the engine's error. */
int wx_engine_admit(wx_engine_t *e, uint64_t held_bytes, uint64_t slice_ns, uint64_t *t_admit);
/* Queue an admitted task. Destinations must have been validated. t_submit: when the caller
 * first asked (before admission); t_admit: from wx_engine_admit. */
int wx_engine_submit(wx_engine_t *e, const wx_task_spec_t *spec, uint64_t t_submit,
                     uint64_t t_admit, uint64_t *id);
/* Undo a wx_engine_admit whose task will not be submitted. */
void wx_engine_unadmit(wx_engine_t *e, uint64_t held_bytes);
/* The host's completion signal of external task `id` (one without a CUDA event): status 0,
 * or a negative errno with its reason (may be NULL) for the failure of its writes (isolate:
 * its peers fail; else the engine's sticky error). 0: taken; -ENOENT: `id` is not an
 * external task waiting for its signal (finished already: skipped, late, cancelled; or not
 * external); -EALREADY: signalled before; -EINVAL: it waits for a CUDA event, or status > 0. */
int wx_engine_external_done(wx_engine_t *e, uint64_t id, int status, const char *reason);
/* Wait up to slice_ns for every submitted task to finish. 0: all done; -EAGAIN: slice
 * passed; other: the engine's error (its message in wx_last_error(), its fields from
 * wx_engine_error). */
int wx_engine_wait(wx_engine_t *e, uint64_t slice_ns);
/* Wait up to slice_ns for the fence task `id` (a wx_engine_submit id of a spec with fence
 * set) to finish; the tasks after a fence are posted once it has. Fences with writes finish in
 * submission order; one without writes (every destination skipped) finishes at its submission,
 * so waiting for an earlier fence after submitting such a one may return early. Unlike
 * wx_engine_wait it does not wait for failed peers to be fenced (their writes are skipped).
 * Returns as wx_engine_wait; an id never submitted returns 0. */
int wx_engine_wait_fence(wx_engine_t *e, uint64_t slice_ns, uint64_t id);

/* Wait up to slice_ns until task `id` is done posting: its writes handed to the transport
 * (their device work enqueued, on cuda_ipc) or skipped, or it finished (or was never
 * submitted). 0, -EAGAIN when the slice passed, or the sticky error. What a CUDA stream's
 * device wait for a fence needs first: the fence's copy is then enqueued ahead of the wait,
 * so no hardware queue the two streams share holds the copy behind the wait. */
int wx_engine_wait_posted(wx_engine_t *e, uint64_t slice_ns, uint64_t id);

/* Mirror the fences' progress into `word` (pinned host memory the caller keeps alive until
 * no stream can wait on it any more; NULL: stop): the low 32 bits of the id of the last fence
 * task finished, stored (release) as each fence finishes, and once at this call. A fence whose
 * write to a peer did not land (isolate) holds the word until that peer is fenced or, its fence
 * failed, until the writes abandoned to it have all completed; a fence finished with the
 * engine's error holds it until the engine stops (wx_engine_word.c says why). A CUDA stream waits for
 * fence `id` on the device with cuStreamWaitValue32(word, (uint32_t)id, GEQ) (cyclic: right
 * while fewer than 2^31 tasks separate the two). Once the engine stops, and when a word is
 * replaced or dropped, it is set past every task submitted, so no stream waits forever. */
void wx_engine_set_fence_word(wx_engine_t *e, uint32_t *word);
/* Whether the fence word is held now: 0 no; 1 for a failed peer (its id in *peer_id, its name
 * in peer, of len bytes, and since when in *since_ns, wx_now_ns's clock) until it is fenced or its abandoned
 * writes have completed; 2 for the engine's error (until the engine stops). A caller about to
 * queue a device wait for a later fence waits on the host instead while it is held. */
int wx_engine_word_state(wx_engine_t *e, uint64_t *since_ns, int64_t *peer_id, char *peer,
                         size_t len);
/* Hand the owners of finished tasks to cb (on the caller's thread). Returns the count. */
int wx_engine_reap(wx_engine_t *e, void (*cb)(void *owner, void *arg), void *arg);
/* isolate: the peers that failed (each one's first failure), at most max of them; returns
 * how many failed. wx_engine_wait does not report them. */
uint32_t wx_engine_failed_peers(wx_engine_t *e, wx_engine_fail_t *out, uint32_t max);
/* Writes posted and not yet completed by the transport (abandoned ones included). */
uint64_t wx_engine_writes_out(wx_engine_t *e);
/* The sticky error (0 if none); its fields in *f when f is not NULL. */
int wx_engine_error(wx_engine_t *e, wx_engine_fail_t *f);
/* Clear a sticky error after the caller handled it (tasks in flight keep running). */
void wx_engine_clear_error(wx_engine_t *e);
void wx_engine_stats(wx_engine_t *e, wx_engine_stats_t *s);
/* Copy out the trace records of the last WX_ENGINE_TRACE_MAX finished tasks, oldest first;
 * *out is malloc'ed; *dropped (may be NULL): records overwritten since the last clear. */
int wx_engine_trace(wx_engine_t *e, wx_trace_rec_t **out, size_t *n, uint64_t *dropped);
void wx_engine_trace_clear(wx_engine_t *e);

#endif
