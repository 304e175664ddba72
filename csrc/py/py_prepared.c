/* py_prepared.c - the Prepared type (a Region source and its destinations, validated once)
 * and the Engine methods that make and submit it: Engine.prepare, Engine.submit_prepared. */
#include "wx_py_engine.h"

#include <string.h>

typedef struct {
    PyObject_HEAD PyObject *region; /* wx_py_region_t of the engine's transport; NULL: external */
    PyObject *transport;            /* the transport whose peers dv names (prepare_external) */
    wx_dest_t *dv;                  /* validated destinations (their peers are the transport's) */
    uint32_t ndests;
    uint64_t tag, nbytes;
} wx_py_prepared_t;

static void wx_prepared_dealloc(PyObject *op)
{
    wx_py_prepared_t *self = (wx_py_prepared_t *)op;
    PyTypeObject *tp = Py_TYPE(op);
    PyMem_Free(self->dv);
    Py_CLEAR(self->region);
    Py_CLEAR(self->transport);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *wx_prepared_tag(PyObject *op, void *closure)
{
    return PyLong_FromUnsignedLongLong(((wx_py_prepared_t *)op)->tag);
}

static PyObject *wx_prepared_nbytes(PyObject *op, void *closure)
{
    return PyLong_FromUnsignedLongLong(((wx_py_prepared_t *)op)->nbytes);
}

static PyObject *wx_prepared_region(PyObject *op, void *closure)
{
    PyObject *r = ((wx_py_prepared_t *)op)->region;
    return Py_NewRef(r ? r : Py_None);
}

static PyGetSetDef wx_prepared_getset[] = {
    {"tag", wx_prepared_tag, NULL, "the engine tag of its tasks", NULL},
    {"nbytes", wx_prepared_nbytes, NULL, "bytes written per submission", NULL},
    {"region", wx_prepared_region, NULL, "the source Region (None: prepare_external's)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot wx_prepared_slots[] = {
    {Py_tp_dealloc, wx_prepared_dealloc},
    {Py_tp_getset, wx_prepared_getset},
    {Py_tp_doc, "A task made by Engine.prepare(region, dests, tag): submitted (again and again) by "
                "Engine.submit_prepared; or the destinations of an external task made by "
                "Engine.prepare_external(dests, tag), submitted by Engine.submit_external. "
                "Rebuild it when a destination's worker re-registered."},
    {0, NULL},
};

static PyType_Spec wx_prepared_spec = WX_PY_TYPE_SPEC(
    "Prepared", wx_py_prepared_t, Py_TPFLAGS_DISALLOW_INSTANTIATION, wx_prepared_slots);

/* A Prepared of `dests` (decoded and validated once): of Engine.prepare with `region` (its
 * Region source, `mr` its registration), or of prepare_external with region NULL (then it keeps
 * the engine's transport, which submit_external checks it against). */
static PyObject *wx__prepared_new(wx_py_state_t *st, wx_py_engine_t *self, PyObject *region,
                                  PyObject *dests, unsigned long long tag, const wx_mr_t *mr)
{
    wx_py_prepared_t *p = PyObject_New(wx_py_prepared_t, st->Prepared);
    if (!p)
        return NULL;
    p->region = region ? Py_NewRef(region) : NULL;
    p->transport = region ? NULL : Py_NewRef(self->transport);
    p->dv = NULL;
    p->ndests = 0;
    p->tag = tag;
    p->nbytes = 0;
    if (wx_py_submit_dests(st, (wx_py_transport_t *)self->transport, dests, tag, mr, &p->dv,
                           &p->ndests) < 0) {
        Py_DECREF(p);
        return NULL;
    }
    for (uint32_t i = 0; i < p->ndests; i++)
        p->nbytes += p->dv[i].len;
    return (PyObject *)p;
}

/* prepare(region, dests, tag=0) -> Prepared: the destinations decoded and validated against
 * the Region once (as submit does each call). */
PyObject *wx_py_engine_prepare(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"src", "dests", "tag", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_py_state_t *st = wx_py_state_of(op);
    PyObject *src, *dests;
    unsigned long long tag = 0;
    wx_py_region_t *r;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|K:prepare", kwlist, &src, &dests, &tag))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    if (!PyObject_TypeCheck(src, st->Region)) {
        PyErr_Format(PyExc_TypeError,
                     "prepare: src must be a Region of this engine's transport "
                     "(Transport.register(tensor, export=False)), got %s",
                     Py_TYPE(src)->tp_name);
        return NULL;
    }
    r = (wx_py_region_t *)src;
    if (r->transport != self->transport || !r->mr || !((wx_py_transport_t *)self->transport)->t) {
        PyErr_SetString(PyExc_ValueError,
                        "prepare: src Region is closed or belongs to another transport");
        return NULL;
    }
    return wx__prepared_new(st, self, src, dests, tag, r->mr);
}

/* prepare_external(dests, tag=0) -> Prepared: an external task's destinations decoded and
 * validated once (as submit_external does each call with a sequence). */
PyObject *wx_py_engine_prepare_external(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dests", "tag", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_py_state_t *st = wx_py_state_of(op);
    PyObject *dests;
    unsigned long long tag = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|K:prepare_external", kwlist, &dests, &tag))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    if (!((wx_py_transport_t *)self->transport)->t) {
        PyErr_SetString(PyExc_ValueError, "prepare_external: transport is closed");
        return NULL;
    }
    return wx__prepared_new(st, self, NULL, dests, tag, NULL);
}

int wx_py_prepared_external(wx_py_engine_t *self, wx_py_state_t *st, PyObject *obj,
                            const wx_dest_t **dv, uint32_t *ndests, uint64_t *tag)
{
    wx_py_prepared_t *p = (wx_py_prepared_t *)obj;
    if (!PyObject_TypeCheck(obj, st->Prepared))
        return 0;
    if (p->region) {
        PyErr_Format(PyExc_TypeError,
                     "submit_external: dests is a Prepared of Engine.prepare (tag %llu, a "
                     "Region source): submit it with submit_prepared",
                     (unsigned long long)p->tag);
        return -1;
    }
    if (p->transport != self->transport) {
        PyErr_Format(PyExc_ValueError,
                     "submit_external: dests is a Prepared (tag %llu) of another transport's "
                     "engine",
                     (unsigned long long)p->tag);
        return -1;
    }
    *dv = p->dv;
    *ndests = p->ndests;
    *tag = p->tag;
    return 1;
}

/* One prepared task submitted: held 0 (the Region's memory is not the engine's), admitted
 * at once; the owner keeps the Region (so its memory) alive until the writes completed. */
static int wx__submit_one_prepared(wx_py_engine_t *self, wx_py_state_t *st, PyObject *item,
                                   Py_ssize_t i, void *event, int device)
{
    wx_py_prepared_t *p = (wx_py_prepared_t *)item;
    wx_py_region_t *r;
    wx_py_owner_t *own;
    wx_task_spec_t spec;
    uint64_t t0 = wx_now_ns(), ta, id;
    int rc;
    if (!PyObject_TypeCheck(item, st->Prepared)) {
        PyErr_Format(PyExc_TypeError,
                     "submit_prepared: tasks[%zd] is a %s, not a Prepared "
                     "(Engine.prepare)",
                     i, Py_TYPE(item)->tp_name);
        return -1;
    }
    r = (wx_py_region_t *)p->region;
    if (!r) {
        PyErr_Format(PyExc_TypeError,
                     "submit_prepared: tasks[%zd] (tag %llu) is an external task's destinations "
                     "(Engine.prepare_external): submit it with submit_external",
                     i, (unsigned long long)p->tag);
        return -1;
    }
    if (r->transport != self->transport || !r->mr || !((wx_py_transport_t *)self->transport)->t) {
        PyErr_Format(PyExc_ValueError,
                     "submit_prepared: tasks[%zd] (tag %llu): its Region is "
                     "closed or belongs to another transport",
                     i, (unsigned long long)p->tag);
        return -1;
    }
    own = PyMem_Calloc(1, sizeof *own);
    if (!own) {
        PyErr_NoMemory();
        return -1;
    }
    own->t = ((wx_py_transport_t *)self->transport)->t;
    own->region = Py_NewRef(p->region);
    memset(&spec, 0, sizeof spec);
    spec.src = r->mr;
    spec.dests = p->dv;
    spec.ndests = p->ndests;
    spec.tag = p->tag;
    spec.owner = own;
    spec.held_bytes = 0;
    if (event) {
        spec.cuda_event = event;
        spec.cuda_device = device >= 0 ? device : (r->buf.device >= 0 ? r->buf.device : 0);
    }
    wx_py_owner_link(self, own);
    rc = wx_engine_admit(self->e, 0, 0, &ta); /* held 0: never waits (fails on a sticky error) */
    if (!rc)
        rc = wx_engine_submit(self->e, &spec, t0, ta, &id);
    if (rc) {
        char ctx[96];
        snprintf(ctx, sizeof ctx, "submit_prepared: tasks[%zd] (tag %llu)", i,
                 (unsigned long long)p->tag);
        wx_py_raise_engine(st, self->e, rc, ctx);
        wx_py_owner_free(own, NULL);
        return -1;
    }
    return 0;
}

/* submit_prepared(tasks, event=None, device=-1) -> count: every Prepared of the sequence
 * submitted in order, all waiting for one CUDA event; stops at the first refusal (the tasks
 * before it are submitted). */
PyObject *wx_py_engine_submit_prepared(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tasks", "event", "device", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_py_state_t *st = wx_py_state_of(op);
    PyObject *tasks, *event = Py_None, *seq;
    void *ev = NULL;
    int device = -1;
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Oi:submit_prepared", kwlist, &tasks, &event,
                                     &device))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    if (wx_py_opt_ptr(event, &ev) < 0)
        return NULL;
    seq = PySequence_Fast(tasks, "submit_prepared: tasks must be a sequence of Prepared");
    if (!seq)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    wx_engine_reap(self->e, wx_py_owner_free, NULL);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (wx__submit_one_prepared(self, st, PySequence_Fast_GET_ITEM(seq, i), i, ev, device) <
            0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
}

int wx_py_prepared_init_type(PyObject *m, wx_py_state_t *st)
{
    return wx_py_add_type(m, &wx_prepared_spec, &st->Prepared);
}
