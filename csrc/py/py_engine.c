/* py_engine.c - the Engine type: submit tasks, wait, reap owners, read the trace (its
 * prepared tasks, the Prepared type: py_prepared.c). */
#include "wx_py_engine.h"

#include <string.h>

void wx_py_owner_link(wx_py_engine_t *self, wx_py_owner_t *o)
{
    o->next = self->owners;
    if (o->next)
        o->next->pprev = &o->next;
    o->pprev = &self->owners;
    self->owners = o;
}

/* Take every owner off self's list (the engine closed: those left belong to a parked
 * engine, released after the Engine object is gone). */
static void wx__owners_detach(wx_py_engine_t *self)
{
    while (self->owners) {
        wx_py_owner_t *o = self->owners;
        self->owners = o->next;
        o->next = NULL;
        o->pprev = NULL;
    }
}

void wx_py_owner_free(void *owner, void *arg)
{
    wx_py_owner_t *o = owner;
    if (o->pprev) {
        *o->pprev = o->next;
        if (o->next)
            o->next->pprev = o->pprev;
    }
    if (o->mr && o->t)
        wx_dereg(o->t, o->mr);
    wx_py_buf_release(&o->buf);
    Py_XDECREF(o->region);
    Py_XDECREF(o->keep);
    PyMem_Free(o);
}

int wx_py_engine_live(wx_py_engine_t *self)
{
    if (!self->e) {
        PyErr_SetString(PyExc_ValueError, "engine is closed");
        return 0;
    }
    return 1;
}

static PyObject *wx_engine_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"transport", "watermark", "chunk", "depth",
                             "timeout",   "isolate",   NULL};
    wx_py_state_t *st = PyType_GetModuleState(type);
    PyObject *tr;
    unsigned long long watermark = 0, chunk = 0;
    unsigned int depth = 0;
    double timeout = 30.0;
    int isolate = 0;
    wx_engine_opts_t o;
    wx_py_engine_t *self;
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|KKIdp:Engine", kwlist, st->Transport, &tr,
                                     &watermark, &chunk, &depth, &timeout, &isolate))
        return NULL;
    if (!((wx_py_transport_t *)tr)->t) {
        PyErr_SetString(PyExc_ValueError, "Engine: transport is closed");
        return NULL;
    }
    if (timeout <= 0) {
        PyErr_SetString(PyExc_ValueError, "Engine: timeout must be > 0 seconds");
        return NULL;
    }
    o.watermark = watermark;
    o.chunk = chunk;
    o.depth = depth;
    o.timeout_ns = (uint64_t)(timeout * 1e9);
    o.isolate = (uint32_t)isolate;
    self = (wx_py_engine_t *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    rc = wx_engine_create(((wx_py_transport_t *)tr)->t, &o, &self->e);
    if (rc) {
        Py_DECREF(self);
        return wx_py_raise(st, rc, "Engine");
    }
    self->transport = Py_NewRef(tr);
    self->timeout_s = timeout;
    ((wx_py_transport_t *)tr)->engines++;
    return (PyObject *)self;
}

/* After the transport closed: its registrations are gone, so no dereg. */
static void wx__owner_free_closed(void *owner, void *arg)
{
    ((wx_py_owner_t *)owner)->t = NULL;
    wx_py_owner_free(owner, arg);
}

void wx_py_engine_release_parked(wx_engine_t *e)
{
    wx_engine_reap(e, wx__owner_free_closed, NULL);
    wx_engine_destroy(e);
}

static void wx__engine_close(wx_py_engine_t *self)
{
    if (self->e) {
        wx_engine_t *e = self->e;
        wx_py_transport_t *tr = (wx_py_transport_t *)self->transport;
        self->e = NULL;
        wx_engine_reap(e, wx_py_owner_free, NULL);
        Py_BEGIN_ALLOW_THREADS
            wx_engine_stop(e);
        Py_END_ALLOW_THREADS
        wx_engine_set_fence_word(e, NULL); /* stop() released it; a parked engine leaves it */
        Py_CLEAR(self->fence_keep);
        wx_engine_reap(e, wx_py_owner_free, NULL); /* the tasks stop() cancelled */
        wx__owners_detach(self);
        tr->engines--;
        if (wx_engine_writes_out(e) && tr->t) {
            /* writes still out (a dead or silent peer): their sources must stay alive until
             * the transport completes them, at the latest when it closes */
            wx_engine_t **np = PyMem_Realloc(tr->parked, (size_t)(tr->nparked + 1) * sizeof *np);
            if (np) {
                tr->parked = np;
                tr->parked[tr->nparked++] = e;
                return;
            }
        }
        wx_engine_destroy(e); /* (a failed park leaves in-flight sources unreleased) */
    }
}

static int wx_engine_traverse(PyObject *op, visitproc visit, void *arg)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->transport);
    Py_VISIT(self->fence_keep);
    for (wx_py_owner_t *o = self->owners; o; o = o->next) {
        Py_VISIT(o->region);
        Py_VISIT(o->keep);
        if (o->buf.has_view)
            Py_VISIT(o->buf.view.obj);
    }
    return 0;
}

/* Break a cycle: close the engine (its tasks' sources are released; writes still out park
 * it on the transport, as close() does), then drop the transport. */
static int wx_engine_clear(PyObject *op)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    if (self->transport)
        wx__engine_close(self);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->fence_keep);
    return 0;
}

static void wx_engine_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    wx_engine_clear(op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

typedef struct {
    wx_engine_t *e;
    uint64_t held, t_admit;
} wx__admit_t;

static int wx__admit_fn(void *arg, uint64_t slice)
{
    wx__admit_t *a = arg;
    return wx_engine_admit(a->e, a->held, slice, &a->t_admit);
}

static int wx__wait_fn(void *arg, uint64_t slice)
{
    return wx_engine_wait((wx_engine_t *)arg, slice);
}

typedef struct {
    wx_engine_t *e;
    uint64_t id;
} wx__fence_wait_t;

static int wx__wait_fence_fn(void *arg, uint64_t slice)
{
    wx__fence_wait_t *w = arg;
    return wx_engine_wait_fence(w->e, slice, w->id);
}

static int wx__wait_posted_fn(void *arg, uint64_t slice)
{
    wx__fence_wait_t *w = arg;
    return wx_engine_wait_posted(w->e, slice, w->id);
}

/* Raise for rc from e: the engine's sticky error with its fields when rc is that error,
 * else wx_py_raise. Returns NULL. */
PyObject *wx_py_raise_engine(wx_py_state_t *st, wx_engine_t *e, int rc, const char *context)
{
    wx_engine_fail_t f;
    if (wx_engine_error(e, &f) == rc && rc)
        return wx_py_raise_fail(st, &f, context);
    return wx_py_raise(st, rc, context);
}

/* submit's source: a Region of this engine's transport, or an imported buffer (registered
 * for this task where the transport needs that). Fills own and spec->src; 0 or -1 with an
 * exception set. */
static int wx__submit_src(wx_py_engine_t *self, wx_py_state_t *st, PyObject *src,
                          wx_py_owner_t *own, wx_task_spec_t *spec)
{
    wx_py_transport_t *tr = (wx_py_transport_t *)self->transport;
    int rc;
    if (PyObject_TypeCheck(src, st->Region)) {
        wx_py_region_t *r = (wx_py_region_t *)src;
        if (r->transport != self->transport || !r->mr) {
            PyErr_SetString(PyExc_ValueError,
                            "submit: src Region is closed or belongs to another transport");
            return -1;
        }
        own->region = Py_NewRef(src);
        spec->src = r->mr;
        return 0;
    }
    if (wx_py_buf_get(src, 0, "submit", &own->buf) < 0)
        return -1;
    if (tr->t->needs_local_reg) {
        rc = wx_reg(tr->t, own->buf.addr, own->buf.nbytes, own->buf.mem, own->buf.device, 0,
                    &own->mr);
        if (rc) {
            wx_py_raise(st, rc, "submit: registering the source");
            return -1;
        }
        spec->src = own->mr;
        return 0;
    }
    own->bare.addr = own->buf.addr;
    own->bare.len = own->buf.nbytes;
    own->bare.mem = own->buf.mem;
    own->bare.device = own->buf.device;
    spec->src = &own->bare;
    return 0;
}

/* submit's destinations, every one validated against src before anything is admitted or
 * posted. *out is PyMem-allocated; 0 or -1 with an exception set. */
int wx_py_submit_dests(wx_py_state_t *st, wx_py_transport_t *tr, PyObject *dests,
                       unsigned long long tag, const wx_mr_t *src, wx_dest_t **out,
                       uint32_t *ndests)
{
    PyObject *seq = PySequence_Fast(dests, "submit: dests must be a sequence of "
                                           "(descriptor, dst_offset, src_offset, nbytes)");
    Py_ssize_t n;
    wx_dest_t *dv;
    if (!seq)
        return -1;
    n = PySequence_Fast_GET_SIZE(seq);
    dv = PyMem_Calloc((size_t)(n ? n : 1), sizeof *dv);
    if (!dv) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PySequence_Fast_GET_ITEM(seq, i), *desc;
        unsigned long long roff, loff, nb;
        if (!PyArg_ParseTuple(d, "OKKK", &desc, &roff, &loff, &nb)) {
            PyErr_Format(PyExc_TypeError,
                         "submit: dests[%zd] must be (descriptor, dst_offset, src_offset, nbytes)",
                         i);
            goto fail;
        }
        if (wx_py_dest(st, tr, desc, roff, loff, nb, src, &dv[i]) < 0) {
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyErr_NormalizeException(&et, &ev, &tb);
            PyErr_Format(et, "submit: dests[%zd] (tag %llu): %S", i, tag, ev);
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            goto fail;
        }
    }
    Py_DECREF(seq);
    *out = dv;
    *ndests = (uint32_t)n;
    return 0;
fail:
    Py_DECREF(seq);
    PyMem_Free(dv);
    return -1;
}

/* submit's held= (default: the source's length) and event= / device= into spec; -1 with
 * the exception set. */
static int wx__submit_held_event(wx_task_spec_t *spec, const wx_py_owner_t *own, PyObject *held_obj,
                                 PyObject *event, int device)
{
    spec->held_bytes = spec->src->len;
    if (wx_py_opt_u64(held_obj, &spec->held_bytes) < 0 ||
        wx_py_opt_ptr(event, &spec->cuda_event) < 0)
        return -1;
    if (event != Py_None) {
        spec->cuda_device = device >= 0 ? device : (own->buf.device >= 0 ? own->buf.device : 0);
    }
    return 0;
}

/* The admission time of a task holding `held` bytes: reserve()'s (`resv`: admitted before
 * the source was made, no second admission), else now, once the watermark has room (a
 * bounded, interruptible wait); -1 with the exception set. */
static int wx__submit_admit(wx_py_engine_t *self, wx_py_state_t *st, PyObject *resv, uint64_t held,
                            uint64_t *t_admit)
{
    wx__admit_t adm;
    int rc;
    if (resv != Py_None) {
        *t_admit = PyLong_AsUnsignedLongLong(resv);
        return PyErr_Occurred() ? -1 : 0;
    }
    /* free finished owners first: it is what makes room under the watermark */
    wx_engine_reap(self->e, wx_py_owner_free, NULL);
    adm.e = self->e;
    adm.held = held;
    /* room now (the usual case): admitted without releasing the GIL, whose hand-back can wait
     * on another Python thread; else the bounded, interruptible wait */
    rc = wx__admit_fn(&adm, 0);
    if (rc == -EAGAIN)
        rc = wx_py_wait(wx__admit_fn, &adm, -1);
    if (rc) {
        if (rc != -EINTR)
            wx_py_raise_engine(st, self->e, rc, "submit");
        return -1;
    }
    *t_admit = adm.t_admit;
    return 0;
}

static PyObject *wx_engine_submit_py(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"src",  "dests",    "event", "device", "tag",
                             "held", "reserved", "fence", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_py_state_t *st = wx_py_state_of(op);
    wx_py_transport_t *tr;
    PyObject *src, *dests, *event = Py_None, *held_obj = Py_None, *resv = Py_None;
    int device = -1;
    unsigned long long tag = 0;
    wx_py_owner_t *own = NULL;
    wx_dest_t *dv = NULL;
    wx_task_spec_t spec;
    uint64_t t0 = wx_now_ns(), id, resv_held = 0, t_admit = 0;
    int rc, resv_live = 0, fence = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OiKOOp:submit", kwlist, &src, &dests, &event,
                                     &device, &tag, &held_obj, &resv, &fence))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    if (resv != Py_None) {
        /* reserved: the held bytes were admitted by reserve(); any failure gives them back */
        if (held_obj == Py_None) {
            PyErr_SetString(PyExc_ValueError, "submit: reserved= needs held= (the bytes reserved)");
            return NULL;
        }
        resv_held = PyLong_AsUnsignedLongLong(held_obj);
        if (PyErr_Occurred())
            return NULL;
        resv_live = 1;
    }
    tr = (wx_py_transport_t *)self->transport;
    if (!tr->t) {
        PyErr_SetString(PyExc_ValueError, "submit: transport is closed");
        goto fail_resv;
    }
    own = PyMem_Calloc(1, sizeof *own);
    if (!own) {
        PyErr_NoMemory();
        goto fail_resv;
    }
    own->t = tr->t;
    memset(&spec, 0, sizeof spec);
    if (wx__submit_src(self, st, src, own, &spec) < 0 ||
        wx_py_submit_dests(st, tr, dests, tag, spec.src, &dv, &spec.ndests) < 0)
        goto fail;
    spec.dests = dv;
    spec.tag = tag;
    spec.owner = own;
    spec.fence = fence;
    if (wx__submit_held_event(&spec, own, held_obj, event, device) < 0 ||
        wx__submit_admit(self, st, resv, spec.held_bytes, &t_admit) < 0)
        goto fail;
    wx_py_owner_link(self, own); /* before: a reap on another thread may free it after */
    rc = wx_engine_submit(self->e, &spec, t0, t_admit, &id);
    if (rc) {
        wx_engine_unadmit(self->e, spec.held_bytes);
        resv_live = 0;
        wx_py_raise_engine(st, self->e, rc, "submit");
        goto fail;
    }
    PyMem_Free(dv);
    return PyLong_FromUnsignedLongLong(id);
fail:
    PyMem_Free(dv);
    wx_py_owner_free(own, NULL);
fail_resv:
    if (resv_live)
        wx_engine_unadmit(self->e, resv_held);
    return NULL;
}

static PyObject *wx_engine_wait_py(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"timeout", "fence", "posted", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    PyObject *tmo = Py_None, *fence = Py_None;
    double timeout = -1;
    wx__fence_wait_t fw;
    int rc, posted = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OOp:wait", kwlist, &tmo, &fence, &posted))
        return NULL;
    if (posted && fence == Py_None) {
        PyErr_SetString(PyExc_ValueError, "Engine.wait: posted=True needs fence= (the task id)");
        return NULL;
    }
    if (!wx_py_engine_live(self))
        return NULL;
    if (wx_py_opt_double(tmo, &timeout) < 0 || wx_py_opt_u64(fence, &fw.id) < 0)
        return NULL;
    if (fence != Py_None) {
        fw.e = self->e;
        rc = wx_py_wait(posted ? wx__wait_posted_fn : wx__wait_fence_fn, &fw, timeout);
    } else {
        rc = wx_py_wait(wx__wait_fn, self->e, timeout);
    }
    wx_engine_reap(self->e, wx_py_owner_free, NULL);
    if (rc == -EINTR)
        return NULL;
    if (rc == -ETIMEDOUT && !wx_engine_error(self->e, NULL)) {
        wx_errf(-ETIMEDOUT, "tasks still in flight after %.1f s", timeout);
        return wx_py_raise(wx_py_state_of(op), rc, "Engine.wait");
    }
    if (rc)
        return wx_py_raise_engine(wx_py_state_of(op), self->e, rc, "Engine.wait");
    Py_RETURN_NONE;
}

/* fence_word(address, keep): mirror the fences' progress into the uint32 at `address` (pinned
 * host memory that `keep` holds; the engine keeps `keep` until close or the next call);
 * fence_word(0, None): stop. wx_engine_set_fence_word says what is stored when. */
static PyObject *wx_engine_fence_word_py(PyObject *op, PyObject *args)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    unsigned long long addr;
    PyObject *keep, *old;
    if (!PyArg_ParseTuple(args, "KO:fence_word", &addr, &keep))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    if (addr % 4 || (addr && keep == Py_None)) {
        PyErr_Format(PyExc_ValueError,
                     "fence_word: address 0x%llx must be 4-byte aligned and held by keep "
                     "(got keep=None)",
                     addr);
        return NULL;
    }
    old = self->fence_keep;
    wx_engine_set_fence_word(self->e, (uint32_t *)(uintptr_t)addr);
    self->fence_keep = addr ? Py_NewRef(keep) : NULL;
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* reserve(held, timeout=-1) -> admission time (ns): admit `held` bytes under the watermark
 * before the source exists (the caller then makes it and submits with reserved=<that time>,
 * or calls unreserve(held)); the sources of finished tasks are released before and after
 * waiting.  timeout (seconds, < 0: none): TimeoutError once the watermark has not let it in
 * for that long (the writes holding it neither finished nor failed). */
static PyObject *wx_engine_reserve_py(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"held", "timeout", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    unsigned long long held;
    double timeout_s = -1.0;
    wx__admit_t adm;
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|d:reserve", kwlist, &held, &timeout_s))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    adm.held = held;
    adm.e = self->e;
    wx_engine_reap(self->e, wx_py_owner_free, NULL);
    rc = wx__admit_fn(&adm, 0); /* room now: no GIL round trip (as submit) */
    if (rc == -EAGAIN)
        rc = wx_py_wait(wx__admit_fn, &adm, timeout_s);
    if (rc) {
        if (rc == -EINTR)
            return NULL;
        if (rc == -ETIMEDOUT) {
            char msg[200];
            snprintf(msg, sizeof msg,
                     "Engine.reserve: %llu bytes not admitted under the watermark within %.1f s "
                     "(the writes holding it neither finished nor failed)",
                     held, timeout_s);
            PyErr_SetString(PyExc_TimeoutError, msg);
            return NULL;
        }
        return wx_py_raise(wx_py_state_of(op), rc, "reserve");
    }
    wx_engine_reap(self->e, wx_py_owner_free, NULL);
    return PyLong_FromUnsignedLongLong(adm.t_admit);
}

static PyObject *wx_engine_unreserve_py(PyObject *op, PyObject *arg)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    unsigned long long held;
    if (!wx_py_engine_live(self))
        return NULL;
    held = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    wx_engine_unadmit(self->e, held);
    Py_RETURN_NONE;
}

static PyObject *wx_engine_reap_py(PyObject *op, PyObject *noargs)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    if (!wx_py_engine_live(self))
        return NULL;
    return PyLong_FromLong(wx_engine_reap(self->e, wx_py_owner_free, NULL));
}

static PyObject *wx_engine_error_py(PyObject *op, PyObject *noargs)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_engine_fail_t f;
    if (!wx_py_engine_live(self))
        return NULL;
    if (!wx_engine_error(self->e, &f))
        Py_RETURN_NONE;
    return wx_py_fail_error(wx_py_state_of(op), &f, "Engine");
}

static PyObject *wx_engine_failed_peers_py(PyObject *op, PyObject *noargs)
{
    enum { MAXN = 64 };
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_engine_fail_t *fs;
    uint32_t n;
    PyObject *out;
    WX_UNUSED(noargs);
    if (!wx_py_engine_live(self))
        return NULL;
    fs = PyMem_Malloc(MAXN * sizeof *fs);
    if (!fs)
        return PyErr_NoMemory();
    n = wx_engine_failed_peers(self->e, fs, MAXN);
    if (n > MAXN)
        n = MAXN;
    out = PyList_New(n);
    for (uint32_t i = 0; out && i < n; i++) {
        PyObject *it = wx_py_fail_error(wx_py_state_of(op), &fs[i], "Engine");
        if (!it) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, it);
    }
    PyMem_Free(fs);
    return out;
}

/* word_state() -> None, or (peer id, peer name, seconds held); (None, None, s): the error */
static PyObject *wx_engine_word_state_py(PyObject *op, PyObject *noargs)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    char peer[WX_NAME_MAX];
    uint64_t since = 0, now = wx_now_ns();
    int64_t id = -1;
    double s;
    int held;
    WX_UNUSED(noargs);
    if (!wx_py_engine_live(self))
        return NULL;
    held = wx_engine_word_state(self->e, &since, &id, peer, sizeof peer);
    if (!held)
        Py_RETURN_NONE;
    s = since && now > since ? (double)(now - since) / 1e9 : 0.0;
    if (held == 1 && id >= 0)
        return Py_BuildValue("(Lsd)", (long long)id, peer, s);
    return Py_BuildValue("(OOd)", Py_None, Py_None, s);
}

static PyObject *wx_engine_clear_error_py(PyObject *op, PyObject *noargs)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    if (!wx_py_engine_live(self))
        return NULL;
    wx_engine_clear_error(self->e);
    Py_RETURN_NONE;
}

static PyObject *wx_engine_stats_py(PyObject *op, PyObject *noargs)
{
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_engine_stats_t s;
    if (!wx_py_engine_live(self))
        return NULL;
    wx_engine_stats(self->e, &s);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "submitted", s.submitted, "completed",
                         s.completed, "bytes_written", s.bytes_written, "held", s.held, "held_peak",
                         s.held_peak, "inflight", s.inflight, "trace_dropped", s.trace_dropped,
                         "bytes_external", s.bytes_external);
}

static PyObject *wx_engine_trace_py(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"clear", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_trace_rec_t *recs;
    size_t n;
    int clear = 0, rc;
    PyObject *lst;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p:trace", kwlist, &clear))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    rc = wx_engine_trace(self->e, &recs, &n, NULL);
    if (rc)
        return wx_py_raise(wx_py_state_of(op), rc, "Engine.trace");
    if (clear)
        wx_engine_trace_clear(self->e);
    lst = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; lst && i < n; i++) {
        wx_trace_rec_t *r = &recs[i];
        PyObject *d = Py_BuildValue(
            "{s:K,s:K,s:K,s:K,s:I,s:I,s:i,s:K,s:K,s:K,s:K,s:K,s:K,s:s}", "id", r->id, "tag", r->tag,
            "bytes", r->bytes, "held", r->held, "ndests", r->ndests, "nwrites", r->nwrites,
            "status", r->status, "t_submit", r->t_submit, "t_admit", r->t_admit, "t_ready",
            r->t_ready, "t_post_first", r->t_post_first, "t_post_last", r->t_post_last, "t_done",
            r->t_done, "kind", r->kind == WX_TASK_EXTERNAL ? "external" : "write");
        if (!d) {
            Py_CLEAR(lst);
            break;
        }
        PyList_SET_ITEM(lst, (Py_ssize_t)i, d);
    }
    free(recs);
    return lst;
}

static PyObject *wx_engine_close_py(PyObject *op, PyObject *noargs)
{
    wx__engine_close((wx_py_engine_t *)op);
    Py_RETURN_NONE;
}

static PyMethodDef wx_engine_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))wx_engine_submit_py, METH_VARARGS | METH_KEYWORDS,
     "submit(src, dests, event=None, device=-1, tag=0, held=None, reserved=None, fence=False) "
     "-> task id.\n"
     "src: a Region of this transport, or a DLPack producer / buffer kept alive until its writes "
     "completed. dests: [(descriptor, dst_offset, src_offset, nbytes), ...], all validated "
     "before anything is queued. event: a CUDA event handle (int) to wait for before posting. "
     "Blocks (GIL released, Ctrl-C works) while the watermark is reached. reserved: the time "
     "reserve() returned; the task's held bytes were admitted then (no second admission). "
     "fence: its writes are posted once every earlier write has completed, and later tasks' "
     "writes once its own have (failed peers' writes are not waited for)."},
    {"prepare", (PyCFunction)(void (*)(void))wx_py_engine_prepare, METH_VARARGS | METH_KEYWORDS,
     "prepare(src, dests, tag=0) -> Prepared. src: a Region of this transport (e.g. "
     "Transport.register(tensor, export=False)); dests as submit's, decoded and validated once. "
     "Submit it (every step) with submit_prepared; make it again when src's memory or a "
     "destination (a restarted worker's new registration) changed."},
    {"submit_prepared", (PyCFunction)(void (*)(void))wx_py_engine_submit_prepared,
     METH_VARARGS | METH_KEYWORDS,
     "submit_prepared(tasks, event=None, device=-1) -> count: submit each Prepared of tasks, in "
     "order, with held=0 (never blocks on the watermark), all after the CUDA event; the Region "
     "is kept alive until its writes completed. Stops at the first refusal (raised; the tasks "
     "before it are submitted)."},
    {"prepare_external", (PyCFunction)(void (*)(void))wx_py_engine_prepare_external,
     METH_VARARGS | METH_KEYWORDS,
     "prepare_external(dests, tag=0) -> Prepared: submit_external's dests (and tag) decoded and "
     "validated once; pass it as dests (every step). Make it again as prepare's."},
    {"submit_external", (PyCFunction)(void (*)(void))wx_py_engine_submit_external,
     METH_VARARGS | METH_KEYWORDS,
     "submit_external(dests, event=None, device=-1, tag=0, fence=False) -> task id: an external "
     "task: the caller writes dests' bytes itself (an in-place kernel into memory Transport.map "
     "mapped); nothing is posted. dests as submit's (src_offset unused), validated the same "
     "way, or a Prepared of prepare_external (its tag). Its signal -- event: a CUDA event (a "
     "torch.cuda.Event, kept alive until the task is reaped, or its int handle) recorded after "
     "the write, polled by the engine (re-recorded before the task finished: it waits for the new record); None: "
     "complete_external(id). device: the event's CUDA ordinal (default 0). It finishes once "
     "its signal came and the fence before it finished; a fence after it waits for it; "
     "fence=True: it also waits for every earlier write, and wait(fence=id) waits for it. Its "
     "peers failed: skipped; no signal within the engine's timeout: the deadline error naming "
     "the task and peer. Held 0: never waits for the watermark. The engine orders its finish, "
     "not the write: start the write after the fences it must follow (wait(fence=...))."},
    {"complete_external", (PyCFunction)(void (*)(void))wx_py_engine_complete_external,
     METH_VARARGS | METH_KEYWORDS,
     "complete_external(task, status=0, reason=None) -> bool: the host's completion signal of "
     "external task `task` (one submitted without an event). status: 0, or the errno of its "
     "writes' failure (reason: why; isolate: its peers fail, else the engine's error). False: "
     "the task no longer waits (finished: its peers failed, late, cancelled). Raises ValueError "
     "when it was signalled already or waits for a CUDA event."},
    {"reserve", (PyCFunction)(void (*)(void))wx_engine_reserve_py, METH_VARARGS | METH_KEYWORDS,
     "reserve(held, timeout=-1) -> admission time (ns): admit held bytes under the watermark "
     "before the source is made; blocks like submit (timeout seconds, < 0: no bound; "
     "TimeoutError past it). Follow with submit(..., reserved=t) or unreserve(held)."},
    {"unreserve", wx_engine_unreserve_py, METH_O, "unreserve(held): give back a reserve()."},
    {"fence_word", wx_engine_fence_word_py, METH_VARARGS,
     "fence_word(address, keep): store the low 32 bits of the id of each fence task as it "
     "finishes (and now) into the uint32 at address (pinned host memory held by keep, kept "
     "by the engine until close() or the next call; 0, None: stop), so that a CUDA stream can "
     "wait for a fence on the device (stream_wait). A fence whose write to a peer did not land "
     "(isolate) holds the word until that peer is fenced or its abandoned writes completed "
     "(word_state() says which peer; a fence finished with the engine's error: until close). "
     "Once the engine stops, and when the word is replaced, it is set past every task "
     "submitted; the caller keeps its memory until no stream can still wait on it."},
    {"wait", (PyCFunction)(void (*)(void))wx_engine_wait_py, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None, fence=None, posted=False): until every submitted task finished (fence: "
     "the id of a fence task: until that one finished, and with it every task submitted before "
     "it; with posted=True: until that task is done posting -- its writes handed to the "
     "transport or skipped -- or finished); raises Error on a failure."},
    {"reap", wx_engine_reap_py, METH_NOARGS, "Release the sources of finished tasks; count."},
    {"error", wx_engine_error_py, METH_NOARGS,
     "The sticky error as an Error (not raised; its fields say task, tag, peer, stage), or None."},
    {"clear_error", wx_engine_clear_error_py, METH_NOARGS, "Forget the sticky error."},
    {"word_state", wx_engine_word_state_py, METH_NOARGS,
     "word_state() -> None while the fence word follows the fences, else (peer, name, seconds): "
     "held that long for that peer (a fence write to it did not land; until it is fenced or its "
     "abandoned writes complete), or for the engine's error (None, None, s: until close). A device "
     "wait for a later fence queued now would not pass before then: wait on the host."},
    {"failed_peers", wx_engine_failed_peers_py, METH_NOARGS,
     "With isolate=True: [Error] of the peers that failed (each one's first failure, not raised: "
     "fields peer, errno, task, tag, stage, reason); their writes are skipped, the other peers' "
     "go on."},
    {"stats", wx_engine_stats_py, METH_NOARGS, "Counters."},
    {"trace", (PyCFunction)(void (*)(void))wx_engine_trace_py, METH_VARARGS | METH_KEYWORDS,
     "trace(clear=False) -> per-task records with monotonic ns timestamps per stage, of the last "
     "65536 finished tasks (stats()['trace_dropped'] counts older ones dropped since the last "
     "clear)."},
    {"close", wx_engine_close_py, METH_NOARGS, "Stop the engine's threads."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot wx_engine_slots[] = {
    {Py_tp_new, wx_engine_new},
    {Py_tp_dealloc, wx_engine_dealloc},
    {Py_tp_traverse, wx_engine_traverse},
    {Py_tp_clear, wx_engine_clear},
    {Py_tp_methods, wx_engine_methods},
    {Py_tp_doc, "Engine(transport, watermark=0, chunk=0, depth=0, timeout=30.0, isolate=False): "
                "native per-stage queues that post one-sided writes."},
    {0, NULL},
};

static PyType_Spec wx_engine_spec =
    WX_PY_TYPE_SPEC("Engine", wx_py_engine_t, Py_TPFLAGS_HAVE_GC, wx_engine_slots);

int wx_py_engine_init_types(PyObject *m, wx_py_state_t *st)
{
    if (wx_py_add_type(m, &wx_engine_spec, &st->Engine) < 0)
        return -1;
    return wx_py_prepared_init_type(m, st);
}
