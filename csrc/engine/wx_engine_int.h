/* wx_engine_int.h - the engine's private state, shared by wx_engine.c (the stages),
 * wx_engine_ext.c (external tasks), wx_engine_peers.c (isolate: failing a peer),
 * wx_engine_event.c (CUDA events) and wx_engine_info.c (errors, failed peers, stats, trace).
 * Not part of the interface. */
#ifndef WX_ENGINE_INT_H
#define WX_ENGINE_INT_H

#include "wx_engine.h"
#include "wx_peer_state.h"
#include "wx_post_step.h"

typedef struct wx__task wx__task_t;

typedef struct wx__eop {
    wx_op_t op;
    wx__task_t *task;
    uint64_t len;
    uint32_t dest;     /* index in task->dests */
    uint8_t done;      /* its completion arrived */
    uint8_t abandoned; /* its peer failed (isolate): no longer waited for */
    uint8_t failed;    /* its completion reported an error */
} wx__eop_t;

#define WX__MAX_FAILED 64 /* failed peers remembered with their reason (isolate) */

typedef struct wx__failed {
    wx_peer_t *peer;
    wx_engine_fail_t f;
    int state;       /* wx_peer_state_t (wx_peer_state.c's table): FAILING until the post thread
                     * has fenced the peer (wx_fence), then DEAD; the engine reports all done
                     * once none is FAILING */
    uint8_t fencing; /* FAILING: its fence is running (mu released around it) */
    uint8_t fenced;  /* DEAD: its fence succeeded (wx_fence returned 0) */
    uint8_t drained; /* DEAD, NOT fenced: every write abandoned to it has completed since */
    uint32_t out;    /* its abandoned writes not completed yet */
} wx__failed_t;

struct wx__task {
    uint64_t id;
    wx_task_spec_t spec;
    wx_dest_t *dests;
    uint32_t nchunks, posted, completed;
    uint32_t skipped;  /* chunks not posted because their peer failed (isolate) */
    uint32_t live;     /* posted, not completed, not abandoned */
    int queued_done;   /* on the done queue */
    uint32_t cur_dest; /* posting cursor */
    uint64_t cur_off;
    int status;
    int finished;
    int in_post;   /* still queued for posting: only the post thread may finish it */
    int refused;   /* the last post of the write at the cursor returned -EAGAIN */
    int pstate;    /* wx_tpost_state_t: where it is in the post stage (wx_post_step.c) */
    int on_active; /* linked into the engine's active list */
    uint64_t deadline;
    int ext_signal;    /* external: wx_engine_external_done was called */
    int ext_status;    /* ... with this status, */
    char ext_why[160]; /* ... and this reason */
    wx__eop_t *ops;
    wx_trace_rec_t rec;
    wx__task_t *next;                /* ready/post/done queue link */
    wx__task_t *act_prev, *act_next; /* active list (posted, unfinished) */
};

typedef struct wx__queue {
    wx__task_t *head, *tail;
} wx__queue_t;

struct wx_engine {
    wx_transport_t *t;
    wx_engine_opts_t o;
    pthread_mutex_t mu;
    pthread_cond_t cv_admit, cv_ready, cv_post, cv_done;
    wx__queue_t ready, post, done;
    wx__task_t *active;
    uint64_t held, held_peak, inflight, submitted, completed, bytes_written, next_id;
    uint64_t bytes_external;
    wx__task_t *ready_cur;   /* the task the ready thread is waiting for (popped from ready) */
    uint64_t fence_done;     /* the id of the last fence task finished (they finish in order) */
    uint32_t *fence_word;    /* wx_engine_set_fence_word's mirror of fence_done, or NULL */
    uint64_t posted_done;    /* the id of the last task done posting (its writes handed to the
                            * transport or skipped; tasks post in order) */
    uint32_t posted_waiters; /* callers in wx_engine_wait_posted (woken at each retire) */
    int err;
    int fence_pending;     /* a fence task was posted: the next waits for inflight == 0 */
    int ready_dev;         /* the ready thread's current CUDA device (-1: none yet) */
    int ready_busy;        /* the ready thread holds a task popped from ready (not yet on post) */
    wx_engine_fail_t fail; /* the sticky error's fields */
    int stop, stopped, destroyed;
    wx__failed_t failed[WX__MAX_FAILED];
    uint32_t nfailed;
    uint32_t fencing_peers; /* failed peers whose fence (wx_fence) has not finished */
    uint64_t refs;          /* 1 for the owner + one per outstanding write */
    pthread_t th_ready, th_post;
    int started;
    wx_trace_rec_t *trace;                /* ring of WX_ENGINE_TRACE_MAX, allocated as it fills */
    size_t ntrace, cap_trace, trace_head; /* trace_head: the oldest record once full */
    uint64_t trace_dropped;
    /* what the fence word holds (stored into a word set later); while held (wx_engine_word.c),
     * the peers whose fence write did not land, until each is fenced or its abandoned writes
     * have all completed, since when (hold_since, ns), and whether it is held until stop for
     * the engine's error (a fence finished with it, or more failed peers than it names) */
    uint32_t word_val, nhold;
    wx_peer_t *hold[WX__MAX_FAILED];
    uint64_t hold_since;
    uint64_t word_released; /* when a held word last went on (wx_now_ns; 0: never held) */
    int hold_err;
};

/* e->stop is written under mu (atomically), read under mu by the stage loops and without
 * it by wx__wait_event's poll. */
static inline void wx__set_stop(wx_engine_t *e) { __atomic_store_n(&e->stop, 1, __ATOMIC_RELEASE); }
static inline int wx__stopping(wx_engine_t *e)
{
    return __atomic_load_n(&e->stop, __ATOMIC_ACQUIRE);
}

/* The ready stage: wait (bounded by the engine's timeout) for task t's CUDA event; 0, or a
 * negative errno with the failure in *f (wx_engine_event.c). */
int wx__wait_event(wx_engine_t *e, wx__task_t *t, wx_engine_fail_t *f);
/* One non-blocking look at task t's CUDA event (ready thread only; its device's context made
 * current first): 1 done, 0 not yet, or a negative errno with the failure in *f. */
int wx__query_event(wx_engine_t *e, wx__task_t *t, wx_engine_fail_t *f);

/* External tasks (wx_engine_ext.c). The ready stage of external task t: wait for its signal,
 * its peers all failed, the engine's error or stop; failures recorded. mu held (released
 * while waiting). */
void wx__ext_ready(wx_engine_t *e, wx__task_t *t);
/* The post stage of external task t at the head of the post queue: 0 while it waits for the
 * fence before it (the caller waits and comes back), 1 once it has finished. mu held. */
int wx__ext_post(wx_engine_t *e, wx__task_t *t);

/* Shared by the stages (wx_engine.c), mu held: the first error sticks; a task finishes;
 * isolate: peer p fails alone; whether p failed; the post queue's head off it. */
void wx__set_error(wx_engine_t *e, const wx_engine_fail_t *f);
void wx__finish(wx_engine_t *e, wx__task_t *t, int status);
void wx__fail_peer(wx_engine_t *e, wx_peer_t *p, const wx_engine_fail_t *f);
int wx__peer_failed(const wx_engine_t *e, const wx_peer_t *p);
/* isolate: fence the failed peers not fenced yet (post thread; mu released around each
 * wx_fence); wx_engine_peers.c, with wx__fail_peer and wx__peer_failed. */
void wx__fence_failed_peers(wx_engine_t *e);
wx__task_t *wx__q_pop(wx__queue_t *q);
/* The fence word (wx_engine_word.c), mu held: fence task t finished (fence_done moved to
 * it): store it, or hold the word while a peer whose write of t did not land is not fenced;
 * a failed peer's fence finished: release a held word if it may go; store a value. */
void wx__word_fence_done(wx_engine_t *e, const wx__task_t *t);
void wx__word_release(wx_engine_t *e);
void wx__word_store(wx_engine_t *e, uint32_t v);
/* an abandoned write eo (its peer failed) completed, or its post failed: its peer's count of
 * writes out goes down, and a held word may go on once it reaches 0 */
void wx__word_abandoned_done(wx_engine_t *e, const wx__eop_t *eo);
/* The ready stage's deadline of a task (mu held): pushed out while the fence word is held
 * for a peer, and to a timeout after its release (work queued behind a device wait on the
 * word cannot complete before: a late peer must not fail the other peers' tasks) */
uint64_t wx__word_ready_deadline(wx_engine_t *e, uint64_t deadline);
/* failed peer fl's fence finished (fenced or not): a held word may go on */
void wx__word_fence_failed(wx_engine_t *e, wx__failed_t *fl);
/* the failed entry of peer p, or NULL (alive); wx_engine_peers.c */
wx__failed_t *wx__failed_entry(wx_engine_t *e, const wx_peer_t *p);

/* The fields of a failure of task t (NULL: none) at peer p (NULL: none); the reason is
 * printf-formatted. */
void wx__fail_fill(wx_engine_fail_t *f, int err, const wx__task_t *t, const wx_peer_t *p,
                   const char *stage, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* Keep a finished task's record in the trace ring. mu held. */
void wx__trace_add(wx_engine_t *e, const wx_trace_rec_t *rec);

#endif
