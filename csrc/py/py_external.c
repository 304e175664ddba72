/* py_external.c - the Engine methods of external tasks (csrc/engine/wx_engine_ext.c):
 * Engine.submit_external, whose bytes the caller writes itself (an in-place kernel), and
 * Engine.complete_external, the host's completion signal of one. */
#include "wx_py_engine.h"

#include <string.h>

/* submit_external's event: None (NULL handle, 0), an int handle, or an object with an int
 * attribute cuda_event (torch.cuda.Event), kept in *keep. 0 or -1 with an exception set. */
static int wx__external_event(PyObject *event, void **handle, PyObject **keep)
{
    PyObject *h;
    *handle = NULL;
    *keep = NULL;
    if (event == Py_None)
        return 0;
    if (PyLong_Check(event)) {
        h = Py_NewRef(event);
    } else {
        h = PyObject_GetAttrString(event, "cuda_event");
        if (!h) {
            PyErr_Format(PyExc_TypeError,
                         "submit_external: event must be a CUDA event (an object with "
                         "cuda_event, e.g. torch.cuda.Event) or its int handle, got %s",
                         Py_TYPE(event)->tp_name);
            return -1;
        }
        *keep = Py_NewRef(event);
    }
    *handle = PyLong_AsVoidPtr(h);
    Py_DECREF(h);
    if (!PyErr_Occurred() && !*handle)
        PyErr_SetString(PyExc_ValueError,
                        "submit_external: the event's handle is 0 (record it on the stream of "
                        "the in-place write first)");
    if (PyErr_Occurred()) {
        Py_CLEAR(*keep);
        return -1;
    }
    return 0;
}

PyObject *wx_py_engine_submit_external(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dests", "event", "device", "tag", "fence", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    wx_py_state_t *st = wx_py_state_of(op);
    wx_py_transport_t *tr;
    PyObject *dests, *event = Py_None;
    int device = -1, fence = 0, rc;
    unsigned long long tag = 0;
    wx_py_owner_t *own;
    wx_task_spec_t spec;
    const wx_dest_t *pdv = NULL;
    uint32_t pn = 0;
    uint64_t t0 = wx_now_ns(), ta, id, ptag = 0;
    int prepared;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OiKp:submit_external", kwlist, &dests, &event,
                                     &device, &tag, &fence))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    /* dests: a Prepared of prepare_external (validated once, its own tag), or a sequence */
    if ((prepared = wx_py_prepared_external(self, st, dests, &pdv, &pn, &ptag)) < 0)
        return NULL;
    if (prepared && tag && tag != ptag) {
        PyErr_Format(PyExc_ValueError,
                     "submit_external: tag %llu, but dests is a Prepared of tag %llu (it has "
                     "its own: leave tag out)",
                     tag, (unsigned long long)ptag);
        return NULL;
    }
    tr = (wx_py_transport_t *)self->transport;
    if (!tr->t) {
        PyErr_SetString(PyExc_ValueError, "submit_external: transport is closed");
        return NULL;
    }
    own = PyMem_Calloc(1, sizeof *own);
    if (!own)
        return PyErr_NoMemory();
    own->t = tr->t;
    memset(&spec, 0, sizeof spec);
    if (wx__external_event(event, &spec.cuda_event, &own->keep) < 0 ||
        (!prepared && wx_py_submit_dests(st, tr, dests, tag, NULL, (wx_dest_t **)&spec.dests,
                                         &spec.ndests) < 0)) {
        wx_py_owner_free(own, NULL);
        return NULL;
    }
    if (prepared) { /* (wx_engine_submit copies them) */
        spec.dests = pdv;
        spec.ndests = pn;
        tag = ptag;
    }
    spec.cuda_device = device >= 0 ? device : 0;
    spec.external = 1;
    spec.tag = tag;
    spec.fence = fence;
    spec.owner = own;
    wx_engine_reap(self->e, wx_py_owner_free, NULL);
    wx_py_owner_link(self, own);
    rc = wx_engine_admit(self->e, 0, 0, &ta); /* held 0: never waits (fails on a sticky error) */
    if (!rc)
        rc = wx_engine_submit(self->e, &spec, t0, ta, &id);
    if (!prepared)
        PyMem_Free((void *)spec.dests);
    if (rc) {
        wx_py_raise_engine(st, self->e, rc, "submit_external");
        wx_py_owner_free(own, NULL);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(id);
}

PyObject *wx_py_engine_complete_external(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"task", "status", "reason", NULL};
    wx_py_engine_t *self = (wx_py_engine_t *)op;
    unsigned long long id;
    int status = 0, rc;
    const char *reason = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|iz:complete_external", kwlist, &id, &status,
                                     &reason))
        return NULL;
    if (!wx_py_engine_live(self))
        return NULL;
    rc = wx_engine_external_done(self->e, id, status > 0 ? -status : status, reason);
    if (rc == -ENOENT)
        Py_RETURN_FALSE;
    if (rc) {
        PyErr_Format(PyExc_ValueError, "complete_external: %s", wx_last_error());
        return NULL;
    }
    Py_RETURN_TRUE;
}
