/* py_transport.c - the Transport and Region types. */
#include "wx_py.h"

#include <string.h>

#include "wx_desc.h"

/* ---- Region ------------------------------------------------------------------------ */

static void wx__region_release(wx_py_region_t *self)
{
    wx_py_transport_t *tr = (wx_py_transport_t *)self->transport;
    if (self->mr && tr && tr->t)
        wx_dereg(tr->t, self->mr);
    self->mr = NULL;
    wx_py_buf_release(&self->buf);
}

static void wx_region_dealloc(PyObject *op)
{
    wx_py_region_t *self = (wx_py_region_t *)op;
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    wx__region_release(self);
    Py_CLEAR(self->descriptor);
    Py_CLEAR(self->transport);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static int wx_region_traverse(PyObject *op, visitproc visit, void *arg)
{
    wx_py_region_t *self = (wx_py_region_t *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->transport);
    return 0;
}

static int wx__region_live(wx_py_region_t *self)
{
    if (!((wx_py_transport_t *)self->transport)->t)
        self->mr = NULL; /* the transport was closed and released every registration */
    if (!self->mr) {
        PyErr_SetString(PyExc_ValueError, "region is closed");
        return 0;
    }
    return 1;
}

static PyObject *wx_region_descriptor(PyObject *op, void *closure)
{
    wx_py_region_t *self = (wx_py_region_t *)op;
    wx_py_transport_t *tr = (wx_py_transport_t *)self->transport;
    wx_desc_t d;
    uint8_t buf[sizeof(wx_desc_t) + 64];
    size_t alen = WX_ADDR_MAX, len;
    int rc;
    if (!wx__region_live(self))
        return NULL;
    if (self->descriptor)
        return Py_NewRef(self->descriptor);
    memset(&d, 0, sizeof d);
    d.kind = (uint32_t)tr->t->ops->kind;
    rc = tr->t->ops->address(tr->t, d.addr, &alen);
    if (rc)
        return wx_py_raise(wx_py_state_of(op), rc, "Region.descriptor");
    d.addr_len = (uint32_t)alen;
    wx_mr_rinfo(self->mr, &d.ri);
    rc = wx_desc_encode(&d, buf, sizeof buf, &len);
    if (rc)
        return wx_py_raise(wx_py_state_of(op), rc, "Region.descriptor");
    self->descriptor = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)len);
    return Py_XNewRef(self->descriptor);
}

#define WX__REGION_U64(fname, expr)                                                                \
    static PyObject *fname(PyObject *op, void *closure)                                            \
    {                                                                                              \
        wx_py_region_t *self = (wx_py_region_t *)op;                                               \
        if (!wx__region_live(self))                                                                \
            return NULL;                                                                           \
        return PyLong_FromUnsignedLongLong((unsigned long long)(expr));                            \
    }
WX__REGION_U64(wx_region_nbytes, self->mr->len)
WX__REGION_U64(wx_region_addr, (uintptr_t)self->mr->addr)
WX__REGION_U64(wx_region_key, self->mr->key)

static PyObject *wx_region_device(PyObject *op, void *closure)
{
    wx_py_region_t *self = (wx_py_region_t *)op;
    if (!wx__region_live(self))
        return NULL;
    if (self->mr->mem == WX_MEM_CUDA)
        return PyUnicode_FromFormat("cuda:%d", (int)self->mr->device);
    return PyUnicode_FromString("cpu");
}

static PyObject *wx_region_close(PyObject *op, PyObject *noargs)
{
    wx__region_release((wx_py_region_t *)op);
    Py_RETURN_NONE;
}

static PyObject *wx_region_enter(PyObject *op, PyObject *noargs) { return Py_NewRef(op); }

static PyObject *wx_region_exit(PyObject *op, PyObject *args)
{
    wx__region_release((wx_py_region_t *)op);
    Py_RETURN_NONE;
}

static PyObject *wx_region_repr(PyObject *op)
{
    wx_py_region_t *self = (wx_py_region_t *)op;
    if (!self->mr || !((wx_py_transport_t *)self->transport)->t)
        return PyUnicode_FromString("<wxfer Region (closed)>");
    return PyUnicode_FromFormat(
        "<wxfer Region %llu bytes on %s key=0x%llx>", (unsigned long long)self->mr->len,
        self->mr->mem == WX_MEM_CUDA ? "cuda" : "cpu", (unsigned long long)self->mr->key);
}

static PyGetSetDef wx_region_getset[] = {
    {"descriptor", wx_region_descriptor, NULL,
     "bytes another process needs to write into this region (versioned)", NULL},
    {"nbytes", wx_region_nbytes, NULL, "size in bytes", NULL},
    {"addr", wx_region_addr, NULL, "local address of byte 0", NULL},
    {"key", wx_region_key, NULL, "remote key", NULL},
    {"device", wx_region_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef wx_region_methods[] = {
    {"close", wx_region_close, METH_NOARGS, "Deregister and release the memory."},
    {"__enter__", wx_region_enter, METH_NOARGS, NULL},
    {"__exit__", wx_region_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot wx_region_slots[] = {
    {Py_tp_dealloc, wx_region_dealloc},
    {Py_tp_traverse, wx_region_traverse},
    {Py_tp_getset, wx_region_getset},
    {Py_tp_methods, wx_region_methods},
    {Py_tp_repr, wx_region_repr},
    {Py_tp_doc, "A registered memory region (made by Transport.register)."},
    {0, NULL},
};

static PyType_Spec wx_region_spec =
    WX_PY_TYPE_SPEC("Region", wx_py_region_t,
                    Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION, wx_region_slots);

/* ---- Transport ---------------------------------------------------------------------- */

static int wx__transport_live(wx_py_transport_t *self)
{
    if (!self->t) {
        PyErr_SetString(PyExc_ValueError, "transport is closed");
        return 0;
    }
    return 1;
}

/* A live transport and the bytes of `arg` in *view (released by the caller); 0 with the
 * exception set otherwise. */
static int wx__transport_bytes(wx_py_transport_t *self, PyObject *arg, Py_buffer *view)
{
    return wx__transport_live(self) && PyObject_GetBuffer(arg, view, PyBUF_SIMPLE) == 0;
}

static PyObject *wx_transport_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name", "options", NULL};
    wx_py_state_t *st = PyType_GetModuleState(type);
    const char *name;
    PyObject *opts = NULL, *items = NULL, *keep = NULL;
    const char **keys = NULL, **vals = NULL;
    wx_opts_t o = {0, NULL, NULL};
    wx_py_transport_t *self;
    wx_transport_t *t = NULL;
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|O:Transport", kwlist, &name, &opts))
        return NULL;
    if (opts && opts != Py_None) {
        Py_ssize_t n;
        if (!PyDict_Check(opts)) {
            PyErr_SetString(PyExc_TypeError, "Transport options must be a dict of str -> str");
            return NULL;
        }
        items = PyDict_Items(opts);
        keep = PyList_New(0);
        if (!items || !keep)
            goto fail;
        n = PyList_GET_SIZE(items);
        keys = PyMem_Calloc((size_t)n + 1, sizeof *keys);
        vals = PyMem_Calloc((size_t)n + 1, sizeof *vals);
        if (!keys || !vals) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *kv = PyList_GET_ITEM(items, i);
            PyObject *k = PyTuple_GET_ITEM(kv, 0), *v = PyObject_Str(PyTuple_GET_ITEM(kv, 1));
            if (!v || PyList_Append(keep, v) < 0) {
                Py_XDECREF(v);
                goto fail;
            }
            Py_DECREF(v);
            if (!PyUnicode_Check(k)) {
                PyErr_Format(PyExc_TypeError, "Transport option names must be str, got %R", k);
                goto fail;
            }
            keys[i] = PyUnicode_AsUTF8(k);
            vals[i] = PyUnicode_AsUTF8(v);
            if (!keys[i] || !vals[i])
                goto fail;
        }
        o.n = (int)n;
        o.keys = keys;
        o.vals = vals;
    }
    Py_BEGIN_ALLOW_THREADS
        wx_clear_error();
        rc = wx_transport_open(name, &o, &t);
    Py_END_ALLOW_THREADS
    if (rc) {
        char ctx[96];
        snprintf(ctx, sizeof ctx, "Transport(%s)", name);
        wx_py_raise(st, rc, ctx);
        goto fail;
    }
    self = (wx_py_transport_t *)type->tp_alloc(type, 0);
    if (!self) {
        wx_transport_close(t);
        goto fail;
    }
    self->t = t;
    snprintf(self->name, sizeof self->name, "%s", name);
    PyMem_Free(keys);
    PyMem_Free(vals);
    Py_XDECREF(items);
    Py_XDECREF(keep);
    return (PyObject *)self;
fail:
    PyMem_Free(keys);
    PyMem_Free(vals);
    Py_XDECREF(items);
    Py_XDECREF(keep);
    return NULL;
}

static void wx__transport_close(wx_py_transport_t *self)
{
    if (self->t) {
        wx_transport_t *t = self->t;
        self->t = NULL;
        Py_BEGIN_ALLOW_THREADS
            wx_transport_close(t); /* completes every write still out, parked engines' too */
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < self->nparked; i++)
        wx_py_engine_release_parked(self->parked[i]);
    PyMem_Free(self->parked);
    self->parked = NULL;
    self->nparked = 0;
}

static void wx_transport_dealloc(PyObject *op)
{
    PyTypeObject *tp = Py_TYPE(op);
    wx__transport_close((wx_py_transport_t *)op);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *wx_transport_close_py(PyObject *op, PyObject *noargs)
{
    if (((wx_py_transport_t *)op)->engines) {
        PyErr_Format(PyExc_ValueError,
                     "Transport.close: %d Engine(s) still use this transport; "
                     "close them first",
                     ((wx_py_transport_t *)op)->engines);
        return NULL;
    }
    wx__transport_close((wx_py_transport_t *)op);
    Py_RETURN_NONE;
}

static PyObject *wx_transport_register(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"buffer", "export", NULL};
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    wx_py_state_t *st = wx_py_state_of(op);
    PyObject *obj;
    int exported = 1, rc;
    wx_py_region_t *r;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p:register", kwlist, &obj, &exported))
        return NULL;
    if (!wx__transport_live(self))
        return NULL;
    r = PyObject_GC_New(wx_py_region_t, st->Region);
    if (!r)
        return NULL;
    r->transport = Py_NewRef(op);
    r->mr = NULL;
    r->descriptor = NULL;
    memset(&r->buf, 0, sizeof r->buf);
    PyObject_GC_Track((PyObject *)r);
    if (wx_py_buf_get(obj, exported, "register", &r->buf) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
        rc = wx_reg(self->t, r->buf.addr, r->buf.nbytes, r->buf.mem, r->buf.device, exported,
                    &r->mr);
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_DECREF(r);
        return wx_py_raise(st, rc, "Transport.register");
    }
    return (PyObject *)r;
}

static PyObject *wx_transport_export(PyObject *op, PyObject *noargs)
{
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    size_t cap = 4096, len = 0;
    for (;;) {
        PyObject *b;
        int rc;
        if (!wx__transport_live(self))
            return NULL;
        b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
        if (!b)
            return NULL;
        rc = wx_export(self->t, (uint8_t *)PyBytes_AS_STRING(b), cap, &len);
        if (rc == 0) {
            if (_PyBytes_Resize(&b, (Py_ssize_t)len) < 0)
                return NULL;
            return b;
        }
        Py_DECREF(b);
        if (rc != -ENOSPC)
            return wx_py_raise(wx_py_state_of(op), rc, "Transport.export");
        cap = len + 1024; /* the region list grew: retry with room */
    }
}

static PyObject *wx_transport_connect_request(PyObject *op, PyObject *arg)
{
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    Py_buffer view;
    uint8_t req[WX_CONN_MAX];
    size_t req_len = sizeof req;
    wx_peer_t *p = NULL;
    int rc;
    if (!wx__transport_bytes(self, arg, &view))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_connect_request(self->t, view.buf, (size_t)view.len, &p, req, &req_len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc)
        return wx_py_raise_input(wx_py_state_of(op), rc, "Transport.connect_request");
    return Py_BuildValue("(Iy#)", p->id, (const char *)req, (Py_ssize_t)req_len);
}

static PyObject *wx_transport_accept(PyObject *op, PyObject *arg)
{
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    Py_buffer view;
    uint8_t rep[WX_CONN_MAX];
    size_t rep_len = sizeof rep;
    int rc;
    if (!wx__transport_bytes(self, arg, &view))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_accept(self->t, view.buf, (size_t)view.len, rep, &rep_len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc)
        return wx_py_raise_input(wx_py_state_of(op), rc, "Transport.accept");
    return PyBytes_FromStringAndSize((const char *)rep, (Py_ssize_t)rep_len);
}

static PyObject *wx_transport_connect_finish(PyObject *op, PyObject *args)
{
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    unsigned int id;
    Py_buffer view;
    wx_peer_t *p;
    int rc;
    if (!PyArg_ParseTuple(args, "Iy*:connect_finish", &id, &view))
        return NULL;
    if (!wx__transport_live(self)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    p = wx_peer_by_id(self->t, id);
    if (!p) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError,
                     "connect_finish: no peer %u (use the id from connect_request)", id);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
        rc = wx_connect_finish(self->t, p, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc)
        return wx_py_raise(wx_py_state_of(op), rc, "Transport.connect_finish");
    Py_RETURN_NONE;
}

static PyObject *wx_transport_peers(PyObject *op, PyObject *noargs)
{
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    PyObject *lst;
    if (!wx__transport_live(self))
        return NULL;
    lst = PyList_New(0);
    for (uint32_t i = 0; lst; i++) {
        wx_peer_t *p = wx_peer_by_id(self->t, i);
        PyObject *d;
        if (!p)
            break;
        d = Py_BuildValue("{s:I,s:y#,s:O,s:I}", "id", p->id, "address", (const char *)p->addr,
                          (Py_ssize_t)p->addr_len, "connected", p->connected ? Py_True : Py_False,
                          "regions", p->nregions);
        if (wx_py_append(lst, d) < 0)
            Py_CLEAR(lst);
    }
    return lst;
}

static PyObject *wx_transport_info(PyObject *op, PyObject *noargs)
{
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    char buf[1024] = "";
    if (!wx__transport_live(self))
        return NULL;
    if (self->t->ops->info)
        self->t->ops->info(self->t, buf, sizeof buf);
    return PyUnicode_FromString(buf);
}

static PyObject *wx_transport_address(PyObject *op, void *closure)
{
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    uint8_t addr[WX_ADDR_MAX];
    size_t len = sizeof addr;
    int rc;
    if (!wx__transport_live(self))
        return NULL;
    rc = self->t->ops->address(self->t, addr, &len);
    if (rc)
        return wx_py_raise(wx_py_state_of(op), rc, "Transport.address");
    return PyBytes_FromStringAndSize((const char *)addr, (Py_ssize_t)len);
}

static PyObject *wx_transport_getname(PyObject *op, void *closure)
{
    return PyUnicode_FromString(((wx_py_transport_t *)op)->name);
}

static PyObject *wx_transport_limits(PyObject *op, void *closure)
{
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    if (!wx__transport_live(self))
        return NULL;
    return Py_BuildValue("{s:K,s:I,s:O}", "max_write", (unsigned long long)self->t->max_write,
                         "max_inflight", self->t->max_inflight, "needs_local_reg",
                         self->t->needs_local_reg ? Py_True : Py_False);
}

int wx_py_dest(wx_py_state_t *st, wx_py_transport_t *tr, PyObject *desc, uint64_t roff,
               uint64_t loff, uint64_t nbytes, const wx_mr_t *src, wx_dest_t *out)
{
    Py_buffer view;
    wx_desc_t d;
    wx_peer_t *p;
    int rc;
    if (PyObject_GetBuffer(desc, &view, PyBUF_SIMPLE) < 0)
        return -1;
    rc = wx_desc_decode(view.buf, (size_t)view.len, &d);
    PyBuffer_Release(&view);
    if (rc) {
        wx_py_raise(st, rc, "destination descriptor");
        return -1;
    }
    if (d.kind != (uint32_t)tr->t->ops->kind) {
        PyErr_Format(PyExc_ValueError,
                     "destination descriptor is for another transport (kind %u), "
                     "this is %s",
                     d.kind, tr->name);
        return -1;
    }
    p = wx_peer_by_addr(tr->t, d.addr, d.addr_len);
    if (!p || !p->connected) {
        wx_errf(-ENOTCONN,
                "the descriptor's owner is not connected; connect to its export() first");
        wx_py_raise(st, -ENOTCONN, "write");
        return -1;
    }
    rc = wx_validate(tr->t, p, d.ri.key, d.ri.rbase, d.ri.len, roff, nbytes, src, loff, &out->ri);
    if (rc) {
        wx_py_raise(st, rc, "write");
        return -1;
    }
    out->peer = p;
    out->roff = roff;
    out->loff = loff;
    out->len = nbytes;
    return 0;
}

/* Transport.map(dst, dst_offset, nbytes) -> (address, device): where that range of a
 * connected peer's region is mapped in this process (wx_map_remote). */
static PyObject *wx_transport_map(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dst", "dst_offset", "nbytes", NULL};
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    wx_py_state_t *st = wx_py_state_of(op);
    unsigned long long roff, nbytes;
    uint64_t addr = 0;
    int32_t device = -1;
    Py_buffer view;
    wx_desc_t d;
    wx_peer_t *p;
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*KK:map", kwlist, &view, &roff, &nbytes))
        return NULL;
    if (!wx__transport_live(self)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    rc = wx_desc_decode(view.buf, (size_t)view.len, &d);
    PyBuffer_Release(&view);
    if (rc)
        return wx_py_raise(st, rc, "Transport.map: destination descriptor");
    if (d.kind != (uint32_t)self->t->ops->kind) {
        const char *k = wx_kind_name(d.kind);
        PyErr_Format(PyExc_ValueError,
                     "Transport.map: the descriptor (key 0x%llx) is for transport %s, this is %s",
                     (unsigned long long)d.ri.key, k ? k : "(unknown kind)", self->name);
        return NULL;
    }
    p = wx_peer_by_addr(self->t, d.addr, d.addr_len);
    if (!p || !p->connected) {
        wx_errf(-ENOTCONN,
                "the owner of region key 0x%llx is not connected; connect to its export() "
                "first",
                (unsigned long long)d.ri.key);
        return wx_py_raise(st, -ENOTCONN, "Transport.map");
    }
    Py_BEGIN_ALLOW_THREADS
        rc =
            wx_map_remote(self->t, p, d.ri.key, d.ri.rbase, d.ri.len, roff, nbytes, &addr, &device);
    Py_END_ALLOW_THREADS
    if (rc)
        return wx_py_raise(st, rc, "Transport.map");
    return Py_BuildValue("(Ki)", (unsigned long long)addr, (int)device);
}

/* Transport.write: one validated write through a private engine, waited for. */
typedef struct {
    wx_engine_t *e;
} wx__sync_t;

static int wx__sync_wait(void *arg, uint64_t slice)
{
    return wx_engine_wait(((wx__sync_t *)arg)->e, slice);
}

static void wx__drop_owner(void *owner, void *arg) { Py_DECREF((PyObject *)owner); }

static PyObject *wx_transport_write(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"src", "src_offset", "dst", "dst_offset", "nbytes", "timeout", NULL};
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    wx_py_state_t *st = wx_py_state_of(op);
    PyObject *src, *dst;
    unsigned long long loff, roff, nbytes;
    double timeout = 30.0;
    wx_py_region_t *r;
    wx_dest_t dest;
    wx_engine_opts_t eo = {0, 0, 0, 0};
    wx_task_spec_t spec;
    wx__sync_t s = {NULL};
    wx_engine_fail_t fail;
    uint64_t id, t0 = wx_now_ns(), ta;
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKOKK|d:write", kwlist, &src, &loff, &dst, &roff,
                                     &nbytes, &timeout))
        return NULL;
    if (!wx__transport_live(self))
        return NULL;
    if (!PyObject_TypeCheck(src, st->Region) || ((wx_py_region_t *)src)->transport != op) {
        PyErr_SetString(PyExc_TypeError,
                        "write: src must be a Region registered with this transport");
        return NULL;
    }
    r = (wx_py_region_t *)src;
    if (!wx__region_live(r))
        return NULL;
    if (timeout <= 0) {
        PyErr_SetString(PyExc_ValueError, "write: timeout must be > 0 seconds");
        return NULL;
    }
    if (wx_py_dest(st, self, dst, roff, loff, nbytes, r->mr, &dest) < 0)
        return NULL;
    eo.timeout_ns = (uint64_t)(timeout * 1e9);
    rc = wx_engine_create(self->t, &eo, &s.e);
    if (rc)
        return wx_py_raise(st, rc, "write");
    memset(&spec, 0, sizeof spec);
    spec.src = r->mr;
    spec.dests = &dest;
    spec.ndests = 1;
    spec.owner = Py_NewRef(src); /* kept until every write that reads it completed */
    wx_engine_admit(s.e, 0, 0, &ta);
    rc = wx_engine_submit(s.e, &spec, t0, ta, &id);
    if (rc) {
        Py_DECREF(src);
        wx_engine_destroy(s.e);
        return wx_py_raise(st, rc, "write");
    }
    rc = wx_py_wait(wx__sync_wait, &s, timeout + 5.0);
    wx_engine_reap(s.e, wx__drop_owner, NULL);
    fail.err = wx_engine_error(s.e, &fail);
    Py_BEGIN_ALLOW_THREADS
        wx_engine_destroy(s.e);
    Py_END_ALLOW_THREADS
    if (rc == -EINTR)
        return NULL;
    if (rc && rc == fail.err)
        return wx_py_raise_fail(st, &fail, "Transport.write");
    return wx_py_none(st, rc, "Transport.write");
}

static PyObject *wx_transport_fence(PyObject *op, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"peer", "timeout", NULL};
    wx_py_transport_t *self = (wx_py_transport_t *)op;
    char how[WX_ERRMSG_MAX / 2] = "";
    unsigned int id;
    double timeout = 5.0;
    wx_peer_t *p;
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "I|d:fence", kwlist, &id, &timeout))
        return NULL;
    if (!wx__transport_live(self))
        return NULL;
    if (timeout <= 0) {
        PyErr_SetString(PyExc_ValueError, "fence: timeout must be > 0 seconds");
        return NULL;
    }
    p = wx_peer_by_id(self->t, id);
    if (!p) {
        PyErr_Format(PyExc_KeyError, "fence: no peer %u", id);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
        rc = wx_fence(self->t, p, (uint64_t)(timeout * 1e9), how, sizeof how);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Os)", rc == 0 ? Py_True : Py_False, how);
}

static PyMethodDef wx_transport_methods[] = {
    {"register", (PyCFunction)(void (*)(void))wx_transport_register, METH_VARARGS | METH_KEYWORDS,
     "register(buffer, export=True) -> Region. buffer: a DLPack producer (torch tensor, CPU or "
     "CUDA) or a writable contiguous buffer. export=False registers a write source only."},
    {"export", wx_transport_export, METH_NOARGS,
     "export() -> bytes: this process's address and every exported region (for connect_request)."},
    {"connect_request", wx_transport_connect_request, METH_O,
     "connect_request(export_blob) -> (peer_id, request bytes); b'' means no handshake needed."},
    {"accept", wx_transport_accept, METH_O, "accept(request) -> reply bytes (target side)."},
    {"connect_finish", wx_transport_connect_finish, METH_VARARGS, "connect_finish(peer_id, reply)"},
    {"peers", wx_transport_peers, METH_NOARGS, "peers() -> list of dicts"},
    {"fence", (PyCFunction)(void (*)(void))wx_transport_fence, METH_VARARGS | METH_KEYWORDS,
     "fence(peer, timeout=5.0) -> (fenced, how): make sure none of the writes accepted for that "
     "peer lands after this returns (post no more writes to it). fenced False: the transport "
     "cannot guarantee it; `how` says what was done and what may still land."},
    {"write", (PyCFunction)(void (*)(void))wx_transport_write, METH_VARARGS | METH_KEYWORDS,
     "write(src, src_offset, dst, dst_offset, nbytes, timeout=30.0): one-sided write of nbytes "
     "from Region src into the region described by descriptor dst; returns once landed."},
    {"info", wx_transport_info, METH_NOARGS, "info() -> backend description"},
    {"map", (PyCFunction)(void (*)(void))wx_transport_map, METH_VARARGS | METH_KEYWORDS,
     "map(dst, dst_offset, nbytes) -> (address, cuda ordinal): where that range of a connected "
     "peer's region (dst: its descriptor) is mapped in this process, validated as a write is; "
     "cuda_ipc only, memory on the writer's own GPU only. Valid until the transport closes."},
    {"close", wx_transport_close_py, METH_NOARGS, "Close: outstanding writes are cancelled."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef wx_transport_getset[] = {
    {"name", wx_transport_getname, NULL, "backend name", NULL},
    {"address", wx_transport_address, NULL, "this process's transport address", NULL},
    {"limits", wx_transport_limits, NULL, "max_write, max_inflight, needs_local_reg", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot wx_transport_slots[] = {
    {Py_tp_new, wx_transport_new},
    {Py_tp_dealloc, wx_transport_dealloc},
    {Py_tp_methods, wx_transport_methods},
    {Py_tp_getset, wx_transport_getset},
    {Py_tp_doc, "Transport(name, options=None): a one-sided write transport "
                "('fabric', 'verbs', 'cuda_ipc'); options is a dict of str -> str."},
    {0, NULL},
};

static PyType_Spec wx_transport_spec =
    WX_PY_TYPE_SPEC("Transport", wx_py_transport_t, 0, wx_transport_slots);

int wx_py_transport_init_types(PyObject *m, wx_py_state_t *st)
{
    if (wx_py_add_type(m, &wx_region_spec, &st->Region) < 0)
        return -1;
    return wx_py_add_type(m, &wx_transport_spec, &st->Transport);
}
