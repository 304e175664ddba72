/* wx_py.h - shared declarations of the Python binding (the only code that includes
 * Python.h). */
#ifndef WX_PY_H
#define WX_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "wx_engine.h"
#include "wx_transport.h"

typedef struct {
    PyObject *Error;       /* wxfer._wxfer.Error (OSError subclass) */
    PyObject *DecodeError; /* wxfer._wxfer.DecodeError (Error and ValueError) */
    PyTypeObject *Transport;
    PyTypeObject *Region;
    PyTypeObject *Engine;
    PyTypeObject *Prepared; /* Engine.prepare's tasks */
} wx_py_state_t;
/* A type of the module: wxfer._wxfer.<pyname> (a string literal), instances of ctype, immutable
 * with `flags` besides, its slots. */
#define WX_PY_TYPE_SPEC(pyname, ctype, flags_, slots_)                                             \
    {                                                                                              \
        .name = "wxfer._wxfer." pyname, .basicsize = sizeof(ctype),                                \
        .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | (flags_), .slots = (slots_),      \
    }
/* Every object of the state, X(field) each: the module's traverse and clear go through it. */
#define WX_PY_STATE_OBJECTS(X) X(Error) X(DecodeError) X(Transport) X(Region) X(Engine) X(Prepared)

/* A buffer taken from a DLPack producer or the buffer protocol, kept alive until
 * wx_py_buf_release. */
typedef struct {
    void *addr;
    uint64_t nbytes;
    uint32_t mem;   /* WX_MEM_HOST / WX_MEM_CUDA */
    int32_t device; /* CUDA ordinal or -1 */
    int readonly;
    void *managed; /* wx_dl_managed_t or wx_dl_managed_v1_t */
    int versioned;
    Py_buffer view;
    int has_view;
} wx_py_buf_t;

typedef struct {
    PyObject_HEAD wx_transport_t *t;
    char name[32];
    int engines; /* open Engines using t: close() is refused while any is open */
    /* Engines closed while writes were still out (to a peer that died or stopped
     * answering): kept here until the transport closes, which cancels those writes; then
     * their tasks' sources are released (wx_py_engine_release_parked). */
    wx_engine_t **parked;
    int nparked;
} wx_py_transport_t;

/* Release the sources of a parked engine's tasks, once its transport closed (so without
 * deregistering), and free it. */
void wx_py_engine_release_parked(wx_engine_t *e);

typedef struct {
    PyObject_HEAD PyObject *transport; /* wx_py_transport_t, kept alive */
    wx_mr_t *mr;
    wx_py_buf_t buf;
    PyObject *descriptor; /* bytes, built lazily */
} wx_py_region_t;

wx_py_state_t *wx_py_state_of(PyObject *obj);

/* An optional argument's value: None leaves *out as it is (the caller's default); else *out
 * is `o` read as a float (seconds), an address or a count. 0, or -1 with an exception set. */
static inline int wx_py_opt_double(PyObject *o, double *out)
{
    if (o != Py_None && (*out = PyFloat_AsDouble(o)) == -1.0 && PyErr_Occurred())
        return -1;
    return 0;
}
static inline int wx_py_opt_ptr(PyObject *o, void **out)
{
    if (o != Py_None && !(*out = PyLong_AsVoidPtr(o)) && PyErr_Occurred())
        return -1;
    return 0;
}
static inline int wx_py_opt_u64(PyObject *o, uint64_t *out)
{
    if (o != Py_None && (*out = PyLong_AsUnsignedLongLong(o)) == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* Append `item` (a new reference, or NULL where making it failed) to `list`, taking the
 * reference; -1 with an exception set when it was NULL or could not be appended. */
int wx_py_append(PyObject *list, PyObject *item);

/* Raise wxfer._wxfer.Error(-rc, "<context>: <wx_last_error()>"). Returns NULL. */
PyObject *wx_py_raise(wx_py_state_t *st, int rc, const char *context);
/* A call's result when it returns nothing: None for rc 0, else wx_py_raise's NULL. */
PyObject *wx_py_none(wx_py_state_t *st, int rc, const char *context);
PyObject *wx_py_raise_input(wx_py_state_t *st, int rc, const char *context);
/* An engine failure as a wxfer._wxfer.Error: args (errno, "<context>: <message>"), and
 * the fields task, tag, peer, stage, reason from f (None where f has none). New
 * reference, not raised; NULL with an exception set. */
PyObject *wx_py_fail_error(wx_py_state_t *st, const wx_engine_fail_t *f, const char *context);
/* Raise wx_py_fail_error(st, f, context). Returns NULL. */
PyObject *wx_py_raise_fail(wx_py_state_t *st, const wx_engine_fail_t *f, const char *context);

/* Import obj (DLPack producer or buffer). CUDA tensors are asked for with stream=-1 (the
 * producer does not synchronise: the caller orders work with an event). need_writable:
 * refuse a read-only buffer; what: names the call in errors. Returns 0 or -1 with an
 * exception set. */
int wx_py_buf_get(PyObject *obj, int need_writable, const char *what, wx_py_buf_t *b);
void wx_py_buf_release(wx_py_buf_t *b);

/* Decode a descriptor, find its connected peer and validate a write against it. */
int wx_py_dest(wx_py_state_t *st, wx_py_transport_t *tr, PyObject *desc, uint64_t roff,
               uint64_t loff, uint64_t nbytes, const wx_mr_t *src, wx_dest_t *out);

/* Create the heap type of `spec` for module m into *out and add it to m under its name.
 * Returns 0 or -1 with an exception set. */
int wx_py_add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **out);
int wx_py_transport_init_types(PyObject *m, wx_py_state_t *st);
int wx_py_engine_init_types(PyObject *m, wx_py_state_t *st);
/* Add the prepare functions (fp8_check, fp8_probe, fp8_launch: py_prepare.c) to m. */
int wx_py_prepare_init(PyObject *m);
int wx_py_doctor_init(PyObject *m);

/* Wait on fn(arg, slice) with the GIL released, in slices, checking signals between
 * slices; gives up after timeout_s (< 0: never) with -ETIMEDOUT. Returns fn's result
 * (0 or negative errno), or -EINTR with a Python exception set after a signal. */
int wx_py_wait(int (*fn)(void *arg, uint64_t slice_ns), void *arg, double timeout_s);

#endif
