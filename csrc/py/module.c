/* module.c - wxfer._wxfer: module state, the error type, and module-level functions.
 * Multi-phase init with heap types (PEP 489 / PEP 630). */
#include "wx_py.h"

#include <string.h>

#include "wx_desc.h"
#include "wx_fabric_dl.h"
#include "wx_peer_state.h"

static struct PyModuleDef wx_module;

wx_py_state_t *wx_py_state_of(PyObject *obj)
{
    return (wx_py_state_t *)PyType_GetModuleState(Py_TYPE(obj));
}

/* Raise cls(errno, "<context>: <wx_last_error()>"). Returns NULL. */
static PyObject *wx__raise_as(PyObject *cls, int rc, const char *context)
{
    const char *why = wx_last_error();
    PyObject *args;
    char msg[WX_ERRMSG_MAX + 128];
    int err = rc < 0 ? -rc : rc;
    if (why && *why)
        snprintf(msg, sizeof msg, "%s: %s", context, why);
    else
        snprintf(msg, sizeof msg, "%s: %s", context, strerror(err));
    args = Py_BuildValue("(is)", err, msg);
    if (args) {
        PyErr_SetObject(cls, args);
        Py_DECREF(args);
    }
    return NULL;
}

PyObject *wx_py_raise(wx_py_state_t *st, int rc, const char *context)
{
    return wx__raise_as(st->Error, rc, context);
}

PyObject *wx_py_none(wx_py_state_t *st, int rc, const char *context)
{
    if (rc)
        return wx_py_raise(st, rc, context);
    Py_RETURN_NONE;
}

/* A failure on input from another process (an export blob, a handshake message): a
 * malformed one (-EBADMSG, -EPROTO; -EINVAL: the library refused an address it carried)
 * raises DecodeError, an Error that is also a ValueError; anything else Error. */
PyObject *wx_py_raise_input(wx_py_state_t *st, int rc, const char *context)
{
    int bad = rc == -EBADMSG || rc == -EPROTO || rc == -EINVAL;
    return wx__raise_as(bad ? st->DecodeError : st->Error, rc, context);
}

static int wx__set_field(PyObject *obj, const char *name, PyObject *v)
{
    int rc;
    if (!v)
        return -1;
    rc = PyObject_SetAttrString(obj, name, v);
    Py_DECREF(v);
    return rc;
}

PyObject *wx_py_fail_error(wx_py_state_t *st, const wx_engine_fail_t *f, const char *context)
{
    char what[WX_ERRMSG_MAX + 256], msg[WX_ERRMSG_MAX + 512];
    int err = f->err < 0 ? -f->err : f->err;
    PyObject *exc;
    wx_engine_fail_msg(f, what, sizeof what);
    snprintf(msg, sizeof msg, "%s: %s", context, what);
    exc = PyObject_CallFunction(st->Error, "is", err, msg);
    if (!exc)
        return NULL;
    if (wx__set_field(exc, "task",
                      f->task ? PyLong_FromUnsignedLongLong(f->task) : Py_NewRef(Py_None)) ||
        wx__set_field(exc, "tag",
                      f->task ? PyLong_FromUnsignedLongLong(f->tag) : Py_NewRef(Py_None)) ||
        wx__set_field(exc, "peer",
                      f->peer >= 0 ? PyLong_FromLongLong(f->peer) : Py_NewRef(Py_None)) ||
        wx__set_field(exc, "stage",
                      f->stage ? PyUnicode_FromString(f->stage) : Py_NewRef(Py_None)) ||
        wx__set_field(exc, "reason", PyUnicode_FromString(f->reason))) {
        Py_DECREF(exc);
        return NULL;
    }
    return exc;
}

PyObject *wx_py_raise_fail(wx_py_state_t *st, const wx_engine_fail_t *f, const char *context)
{
    PyObject *exc = wx_py_fail_error(st, f, context);
    if (exc) {
        PyErr_SetObject(st->Error, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

int wx_py_add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **out)
{
    *out = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
    return *out && PyModule_AddType(m, *out) == 0 ? 0 : -1;
}

int wx_py_wait(int (*fn)(void *arg, uint64_t slice_ns), void *arg, double timeout_s)
{
    uint64_t start = wx_now_ns();
    const uint64_t slice = 100ull * 1000 * 1000;
    for (;;) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
            rc = fn(arg, slice);
        Py_END_ALLOW_THREADS
        if (rc != -EAGAIN)
            return rc;
        if (PyErr_CheckSignals() < 0)
            return -EINTR;
        if (timeout_s >= 0 && (double)(wx_now_ns() - start) / 1e9 > timeout_s)
            return -ETIMEDOUT;
    }
}


static PyObject *wx_backends(PyObject *m, PyObject *noargs)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    const wx_transport_ops_t *ops;
    const char *n;
    for (int i = 0; wx_transport_backend(i, &n, &ops) == 0; i++) {
        PyObject *v;
        if (!ops) {
            v = Py_BuildValue("(Os)", Py_False, "not part of this build");
        } else {
            char why[WX_ERRMSG_MAX] = "";
            int rc;
            Py_BEGIN_ALLOW_THREADS
                rc = ops->probe(NULL, why, sizeof why);
            Py_END_ALLOW_THREADS
            v = Py_BuildValue("(Os)", rc == 0 ? Py_True : Py_False, rc == 0 ? "" : why);
        }
        if (!v || PyDict_SetItemString(d, n, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

/* [names] of a NULL-terminated list ([] for NULL). */
int wx_py_append(PyObject *list, PyObject *item)
{
    int rc = item ? PyList_Append(list, item) : -1;
    Py_XDECREF(item);
    return rc < 0 ? -1 : 0;
}

static PyObject *wx__names(const char *const *v)
{
    PyObject *l = PyList_New(0);
    for (; l && v && *v; v++)
        if (wx_py_append(l, PyUnicode_FromString(*v)) < 0)
            Py_CLEAR(l);
    return l;
}

/* {key: value} of a NULL-terminated list of pairs ({} for NULL); with ops->default_of, of
 * every accepted option that has a default. */
static PyObject *wx__pairs(const char *const *v, const wx_transport_ops_t *ops)
{
    PyObject *d = PyDict_New();
    for (; d && v && v[0] && v[1]; v += 2) {
        PyObject *s = PyUnicode_FromString(v[1]);
        if (!s || PyDict_SetItemString(d, v[0], s) < 0)
            Py_CLEAR(d);
        Py_XDECREF(s);
    }
    for (const char *const *o = ops ? ops->options : NULL; d && o && *o && ops->default_of; o++) {
        const char *dflt = ops->default_of(*o);
        PyObject *s = dflt ? PyUnicode_FromString(dflt) : NULL;
        if (dflt && (!s || PyDict_SetItemString(d, *o, s) < 0))
            Py_CLEAR(d);
        Py_XDECREF(s);
    }
    return d;
}

static PyObject *wx__auto_place(uint8_t place)
{
    return place ? PyLong_FromLong(place) : Py_NewRef(Py_None);
}

/* One backend's capabilities (wx_transport_ops_t's fields, as capabilities() documents). */
static PyObject *wx__caps_of(const wx_transport_ops_t *ops)
{
    PyObject *v[7] = {
        wx__names(ops->options),         wx__names(ops->host_options),
        wx__names(ops->shared_options),  wx__pairs(NULL, ops),
        wx__pairs(ops->gpu_check, NULL), wx__auto_place(ops->auto_host),
        wx__auto_place(ops->auto_cuda),
    };
    PyObject *d = NULL;
    for (int i = 0; i < 7; i++)
        if (!v[i])
            goto out;
    d = Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:{s:O,s:O}}", "options", v[0],
                      "host_options", v[1], "shared_options", v[2], "defaults", v[3], "gpu_check",
                      v[4], "host_memory", (ops->caps & WX_CAP_HOST_MEM) ? Py_True : Py_False,
                      "cuda_memory", (ops->caps & WX_CAP_CUDA_MEM) ? Py_True : Py_False,
                      "same_host", (ops->caps & WX_CAP_SAME_HOST) ? Py_True : Py_False, "dead_peer",
                      (ops->caps & WX_CAP_DEAD_PEER) ? Py_True : Py_False, "maps_peers",
                      ops->map ? Py_True : Py_False, "auto", "host", v[5], "cuda", v[6]);
out:
    for (int i = 0; i < 7; i++)
        Py_XDECREF(v[i]);
    return d;
}

static PyObject *wx_capabilities(PyObject *m, PyObject *noargs)
{
    PyObject *d = PyDict_New();
    const wx_transport_ops_t *ops;
    const char *n;
    for (int i = 0; d && wx_transport_backend(i, &n, &ops) == 0; i++) {
        PyObject *v = ops ? wx__caps_of(ops) : Py_NewRef(Py_None);
        if (!v || PyDict_SetItemString(d, n, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *wx__rinfo_dict(const wx_rinfo_t *ri)
{
    return Py_BuildValue("{s:K,s:K,s:K,s:s,s:i,s:y#}", "key", (unsigned long long)ri->key, "base",
                         (unsigned long long)ri->rbase, "nbytes", (unsigned long long)ri->len,
                         "mem", ri->mem == WX_MEM_CUDA ? "cuda" : "host", "device", (int)ri->device,
                         "blob", (const char *)ri->blob, (Py_ssize_t)ri->blob_len);
}

static const char *wx__kind_name(uint32_t kind)
{
    const char *n = wx_kind_name(kind);
    return n ? n : "unknown";
}

/* A decoder's failure: wxfer._wxfer.DecodeError, an Error that is also a ValueError (bad
 * input, not a failed operation). */
static PyObject *wx__decode_fail(PyObject *m, int rc, const char *context)
{
    return wx__raise_as(((wx_py_state_t *)PyModule_GetState(m))->DecodeError, rc, context);
}

static PyObject *wx_decode_descriptor(PyObject *m, PyObject *arg)
{
    Py_buffer view;
    wx_desc_t d;
    int rc;
    PyObject *ri, *out;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    rc = wx_desc_decode(view.buf, (size_t)view.len, &d);
    PyBuffer_Release(&view);
    if (rc)
        return wx__decode_fail(m, rc, "decode_descriptor");
    ri = wx__rinfo_dict(&d.ri);
    if (!ri)
        return NULL;
    out = Py_BuildValue("{s:s,s:y#,s:N}", "transport", wx__kind_name(d.kind), "address",
                        (const char *)d.addr, (Py_ssize_t)d.addr_len, "region", ri);
    return out;
}

static PyObject *wx_decode_export(PyObject *m, PyObject *arg)
{
    Py_buffer view;
    uint8_t addr[WX_ADDR_MAX];
    uint32_t kind, addr_len, n;
    wx_rinfo_t *regions;
    PyObject *lst, *out;
    int rc;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    rc = wx_export_decode(view.buf, (size_t)view.len, &kind, addr, &addr_len, &n, &regions);
    PyBuffer_Release(&view);
    if (rc)
        return wx__decode_fail(m, rc, "decode_export");
    lst = PyList_New(n);
    if (!lst) {
        free(regions);
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        PyObject *r = wx__rinfo_dict(&regions[i]);
        if (!r) {
            free(regions);
            Py_DECREF(lst);
            return NULL;
        }
        PyList_SET_ITEM(lst, i, r);
    }
    free(regions);
    out = Py_BuildValue("{s:s,s:y#,s:N}", "transport", wx__kind_name(kind), "address",
                        (const char *)addr, (Py_ssize_t)addr_len, "regions", lst);
    return out;
}

static PyObject *wx_fabric_probe_py(PyObject *m, PyObject *noargs)
{
    char *buf = malloc(32768);
    PyObject *out;
    int rc;
    if (!buf)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
        rc = wx_fabric_probe_json(buf, 32768);
    Py_END_ALLOW_THREADS
    if (rc) {
        free(buf);
        return wx_py_raise(PyModule_GetState(m), rc, "fabric_probe");
    }
    out = PyUnicode_FromString(buf);
    free(buf);
    return out;
}

static PyObject *wx_parse_size_py(PyObject *m, PyObject *arg)
{
    const char *s = PyUnicode_AsUTF8(arg);
    uint64_t v;
    if (!s)
        return NULL;
    if (wx_parse_size(s, &v)) {
        PyErr_Format(PyExc_ValueError, "not a size: %R (expected e.g. 4096, 64MiB, 2GiB)", arg);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *wx_peer_next_py(PyObject *m, PyObject *args)
{
    int state, event, next = 0;
    (void)m;
    if (!PyArg_ParseTuple(args, "ii:peer_next", &state, &event))
        return NULL;
    if (wx_peer_next(state, event, &next)) {
        const char *sn = wx_peer_state_name(state), *en = wx_peer_event_name(event);
        PyErr_Format(PyExc_ValueError,
                     "peer_next: no transition from state %s (%d) on event %s (%d)", sn ? sn : "?",
                     state, en ? en : "?", event);
        return NULL;
    }
    return PyLong_FromLong(next);
}

/* PEER_STATES / PEER_EVENTS: the names of wx_peer_state.h's enums, in their order. */
static int wx__add_peer_names(PyObject *m)
{
    PyObject *st = PyTuple_New(WX_PEER_NSTATES), *ev = PyTuple_New(WX_PEV_NEVENTS);
    int rc = -1;
    if (!st || !ev)
        goto out;
    for (int i = 0; i < WX_PEER_NSTATES; i++) {
        PyObject *n = PyUnicode_FromString(wx_peer_state_name(i));
        if (!n)
            goto out;
        PyTuple_SET_ITEM(st, i, n);
    }
    for (int i = 0; i < WX_PEV_NEVENTS; i++) {
        PyObject *n = PyUnicode_FromString(wx_peer_event_name(i));
        if (!n)
            goto out;
        PyTuple_SET_ITEM(ev, i, n);
    }
    rc = PyModule_AddObjectRef(m, "PEER_STATES", st) < 0 ||
                 PyModule_AddObjectRef(m, "PEER_EVENTS", ev) < 0
             ? -1
             : 0;
out:
    Py_XDECREF(st);
    Py_XDECREF(ev);
    return rc;
}

static PyMethodDef wx_methods[] = {
    {"backends", wx_backends, METH_NOARGS,
     "backends() -> {name: (usable, why_not)} for every transport wxfer knows."},
    {"capabilities", wx_capabilities, METH_NOARGS,
     "capabilities() -> {name: {options, host_options, shared_options, defaults, gpu_check, "
     "host_memory, cuda_memory, same_host, dead_peer, maps_peers, auto: {host, cuda}}} for every "
     "transport of this build (None for one compiled out), as each backend declares it; no "
     "probe runs."},
    {"decode_descriptor", wx_decode_descriptor, METH_O,
     "decode_descriptor(blob) -> dict; raises Error on truncated/garbage/wrong-version input."},
    {"decode_export", wx_decode_export, METH_O,
     "decode_export(blob) -> dict with the owner's address and its exported regions."},
    {"parse_size", wx_parse_size_py, METH_O,
     "parse_size(text) -> bytes: parse_size('64MiB') -> 67108864"},
    {"peer_next", wx_peer_next_py, METH_VARARGS,
     "peer_next(state, event) -> the next state of a peer's failure state machine, as the "
     "engine moves its failed peers (csrc/core/wx_peer_state.c; the numbers of "
     "wxfer.runtime.peerstate); ValueError naming the pair where it is illegal."},
    {"fabric_probe", wx_fabric_probe_py, METH_NOARGS,
     "fabric_probe() -> JSON text: the installed libfabric's version and its providers for "
     "one-sided writes, each with whether it offers FI_HMEM (device memory)."},
    {NULL, NULL, 0, NULL},
};

static int wx_exec(PyObject *m)
{
    wx_py_state_t *st = PyModule_GetState(m);
    st->Error = PyErr_NewExceptionWithDoc(
        "wxfer._wxfer.Error",
        "A wxfer operation failed. args: (errno, message); the message names the call, the "
        "peer and the reason. A failure of the engine's tasks also has it as data: task (the "
        "id submit returned), tag (the caller's), peer (the peer id), stage ('ready', 'post', "
        "'write' or 'deadline') and reason; each is None where it does not apply.",
        PyExc_OSError, NULL);
    if (!st->Error || PyModule_AddObjectRef(m, "Error", st->Error) < 0)
        return -1;
    for (const char **f = (const char *[]){"task", "tag", "peer", "stage", "reason", NULL}; *f; f++)
        if (PyObject_SetAttrString(st->Error, *f, Py_None) < 0)
            return -1;
    {
        PyObject *bases = PyTuple_Pack(2, st->Error, PyExc_ValueError);
        st->DecodeError = bases ? PyErr_NewExceptionWithDoc(
                                      "wxfer._wxfer.DecodeError",
                                      "A descriptor or export blob is truncated, garbage or of "
                                      "another version: an Error that is also a ValueError.",
                                      bases, NULL)
                                : NULL;
        Py_XDECREF(bases);
        if (!st->DecodeError || PyModule_AddObjectRef(m, "DecodeError", st->DecodeError) < 0)
            return -1;
    }
    if (wx_py_transport_init_types(m, st) < 0 || wx_py_engine_init_types(m, st) < 0 ||
        wx_py_prepare_init(m) < 0 || wx_py_doctor_init(m) < 0)
        return -1;
#ifdef WX_TESTING
    if (PyModule_AddIntConstant(m, "TESTING", 1) < 0)
#else
    if (PyModule_AddIntConstant(m, "TESTING", 0) < 0)
#endif
        return -1;
    if (wx__add_peer_names(m) < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "MEM_HOST", WX_MEM_HOST) < 0 ||
        PyModule_AddIntConstant(m, "MEM_CUDA", WX_MEM_CUDA) < 0)
        return -1;
    return 0;
}

#define WX__VISIT(f) Py_VISIT(st->f);
#define WX__CLEAR(f) Py_CLEAR(st->f);

static int wx_traverse(PyObject *m, visitproc visit, void *arg)
{
    wx_py_state_t *st = PyModule_GetState(m);
    WX_PY_STATE_OBJECTS(WX__VISIT)
    return 0;
}

static int wx_clear(PyObject *m)
{
    wx_py_state_t *st = PyModule_GetState(m);
    WX_PY_STATE_OBJECTS(WX__CLEAR)
    return 0;
}

static void wx_free(void *m) { wx_clear((PyObject *)m); }

/* Free-threaded CPython (3.13t+): the module says it needs the GIL, so importing it there turns
 * the GIL back on (with a RuntimeWarning). What relies on it: the Python-side state of
 * Transport, Engine, Region and Prepared (an engine's owner list, a transport's engine count
 * and parked engines, lazily built descriptors) is changed by their methods with no lock of
 * its own. What does not: the native engine, transports and their threads lock their own
 * state and never call the Python API (DESIGN.md section 4). */
static PyModuleDef_Slot wx_slots[] = {
    {Py_mod_exec, wx_exec},
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef wx_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "wxfer._wxfer",
    .m_doc = "wxfer native core: transports, registrations, the transfer engine.",
    .m_size = sizeof(wx_py_state_t),
    .m_methods = wx_methods,
    .m_slots = wx_slots,
    .m_traverse = wx_traverse,
    .m_clear = wx_clear,
    .m_free = wx_free,
};

PyMODINIT_FUNC PyInit__wxfer(void) { return PyModuleDef_Init(&wx_module); }
