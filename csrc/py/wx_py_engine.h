/* wx_py_engine.h - what the Engine type (py_engine.c) shares with its prepared tasks
 * (py_prepared.c). */
#ifndef WX_PY_ENGINE_H
#define WX_PY_ENGINE_H

#include "wx_py.h"

/* What keeps a task's source alive until its writes completed; released on a Python
 * thread by reap (never from a native thread). */
typedef struct wx_py_owner {
    PyObject *region; /* a Region source, or NULL */
    wx_py_buf_t buf;  /* an imported tensor source */
    wx_mr_t *mr;      /* per-task registration (transports that need one), or NULL */
    wx_mr_t bare;     /* an unregistered description of the source */
    wx_transport_t *t;
    PyObject *keep; /* kept alive with the task (an external task's CUDA event), or NULL */
    /* on its engine's list of submitted tasks (for the GC's traverse), else pprev NULL */
    struct wx_py_owner *next, **pprev;
} wx_py_owner_t;

/* The Engine type. It is a GC type: tp_traverse visits the transport and the Python objects
 * of every submitted task not yet reaped (Region, CUDA event, buffer exporter); tp_clear
 * closes the engine, which releases them. A DLPack source is held through its capsule's
 * deleter, which the GC cannot see: a cycle through a tensor's own attributes back to the
 * engine stays until close() or the engine's reap. The owner list is touched with the GIL
 * held only (submit, reap, close). */
typedef struct {
    PyObject_HEAD PyObject *transport; /* wx_py_transport_t */
    wx_engine_t *e;
    double timeout_s;
    wx_py_owner_t *owners; /* submitted, not yet reaped */
    PyObject *fence_keep;  /* what holds fence_word()'s word (kept while the engine may write it) */
} wx_py_engine_t;

/* Release a task's owner (a wx_engine_reap callback; Python thread only). */
void wx_py_owner_free(void *owner, void *arg);
/* Put a task's owner on self's list, before wx_engine_submit (the GIL may be released there
 * and a reap on another thread free it once the task finished); a refused one comes off in
 * wx_py_owner_free. */
void wx_py_owner_link(wx_py_engine_t *self, wx_py_owner_t *o);
/* 1 when the engine is open, else 0 with ValueError set. */
int wx_py_engine_live(wx_py_engine_t *self);
/* Raise for rc from e: the engine's sticky error with its fields when rc is that error,
 * else wx_py_raise. Returns NULL. */
PyObject *wx_py_raise_engine(wx_py_state_t *st, wx_engine_t *e, int rc, const char *context);
/* submit's destinations, every one validated against src before anything is admitted or
 * posted. *out is PyMem-allocated; 0 or -1 with an exception set. */
int wx_py_submit_dests(wx_py_state_t *st, wx_py_transport_t *tr, PyObject *dests,
                       unsigned long long tag, const wx_mr_t *src, wx_dest_t **out,
                       uint32_t *ndests);

/* Engine.prepare and Engine.submit_prepared (py_prepared.c; in Engine's method table). */
PyObject *wx_py_engine_prepare(PyObject *op, PyObject *args, PyObject *kw);
PyObject *wx_py_engine_submit_prepared(PyObject *op, PyObject *args, PyObject *kw);
/* Engine.prepare_external (py_prepared.c): an external task's destinations validated once. */
PyObject *wx_py_engine_prepare_external(PyObject *op, PyObject *args, PyObject *kw);
/* submit_external's dests when obj is a Prepared of prepare_external for self's transport:
 * its destinations (owned by obj) and tag, 1; 0 when obj is not a Prepared; -1 with an
 * exception set for a Prepared that cannot be submitted there. */
int wx_py_prepared_external(wx_py_engine_t *self, wx_py_state_t *st, PyObject *obj,
                            const wx_dest_t **dv, uint32_t *ndests, uint64_t *tag);
/* Engine.submit_external and Engine.complete_external (py_external.c). */
PyObject *wx_py_engine_submit_external(PyObject *op, PyObject *args, PyObject *kw);
PyObject *wx_py_engine_complete_external(PyObject *op, PyObject *args, PyObject *kw);
/* Create the Prepared type into st->Prepared and add it to m; 0 or -1. */
int wx_py_prepared_init_type(PyObject *m, wx_py_state_t *st);

#endif
