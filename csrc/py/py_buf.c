/* py_buf.c - taking memory from Python objects: DLPack producers (versioned 1.x capsules
 * where offered, legacy capsules otherwise) and the buffer protocol. */
#include "wx_py.h"

#include "wx_dlpack.h"

static int wx__contiguous(const wx_dl_tensor_t *t, uint64_t *nbytes, const char *what)
{
    uint64_t n = 1, expect = 1;
    uint64_t elem_bits = (uint64_t)t->dtype.bits * t->dtype.lanes;
    if (elem_bits % 8) {
        PyErr_Format(PyExc_ValueError, "%s: sub-byte dtype (%u bits) is not supported", what,
                     (unsigned)elem_bits);
        return -1;
    }
    for (int i = 0; i < t->ndim; i++)
        n *= (uint64_t)t->shape[i];
    if (t->strides && n > 0) {
        for (int i = t->ndim - 1; i >= 0; i--) {
            if (t->shape[i] != 1 && (uint64_t)t->strides[i] != expect) {
                PyErr_Format(PyExc_ValueError,
                             "%s: tensor is not contiguous (dimension %d has stride %lld, "
                             "expected %llu); pass .contiguous()",
                             what, i, (long long)t->strides[i], (unsigned long long)expect);
                return -1;
            }
            expect *= (uint64_t)t->shape[i];
        }
    }
    *nbytes = n * (elem_bits / 8);
    return 0;
}

static int wx__from_tensor(wx_py_buf_t *b, const wx_dl_tensor_t *t, const char *what)
{
    if (wx__contiguous(t, &b->nbytes, what) < 0)
        return -1;
    b->addr = (char *)t->data + t->byte_offset;
    switch (t->device.device_type) {
    case WX_DL_CPU:
    case WX_DL_CUDA_HOST:
        b->mem = WX_MEM_HOST;
        b->device = -1;
        return 0;
    case WX_DL_CUDA:
        b->mem = WX_MEM_CUDA;
        b->device = t->device.device_id;
        return 0;
    default:
        PyErr_Format(PyExc_ValueError, "%s: DLPack device type %d is not supported (CPU or CUDA)",
                     what, t->device.device_type);
        return -1;
    }
}

static PyObject *wx__call_dlpack(PyObject *obj, int cuda)
{
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__"), *args, *kw, *cap;
    if (!meth)
        return NULL;
    args = PyTuple_New(0);
    kw = cuda ? Py_BuildValue("{s:i,s:(ii)}", "stream", -1, "max_version", 1, 0)
              : Py_BuildValue("{s:(ii)}", "max_version", 1, 0);
    if (!args || !kw) {
        Py_XDECREF(args);
        Py_XDECREF(kw);
        Py_DECREF(meth);
        return NULL;
    }
    cap = PyObject_Call(meth, args, kw);
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* a producer that predates max_version */
        PyErr_Clear();
        Py_DECREF(kw);
        kw = cuda ? Py_BuildValue("{s:i}", "stream", -1) : PyDict_New();
        if (kw)
            cap = PyObject_Call(meth, args, kw);
    }
    Py_DECREF(args);
    Py_XDECREF(kw);
    Py_DECREF(meth);
    return cap;
}

static int wx__dlpack_device(PyObject *obj, int *dev_type)
{
    PyObject *r = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    int id;
    if (!r) {
        PyErr_Clear();
        *dev_type = WX_DL_CPU;
        return 0;
    }
    if (!PyArg_ParseTuple(r, "ii", dev_type, &id)) {
        Py_DECREF(r);
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

int wx_py_buf_get(PyObject *obj, int need_writable, const char *what, wx_py_buf_t *b)
{
    memset(b, 0, sizeof *b);
    b->device = -1;
    if (PyObject_HasAttrString(obj, "__dlpack__")) {
        int dev_type;
        PyObject *cap;
        if (wx__dlpack_device(obj, &dev_type) < 0)
            return -1;
        cap = wx__call_dlpack(obj, dev_type == WX_DL_CUDA);
        if (!cap)
            return -1;
        if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
            wx_dl_managed_v1_t *mt = PyCapsule_GetPointer(cap, "dltensor_versioned");
            if (mt->version.major != 1) {
                PyErr_Format(PyExc_ValueError, "%s: DLPack major version %u is not supported", what,
                             mt->version.major);
                Py_DECREF(cap);
                return -1;
            }
            /* we own it from here: mark the capsule used so its destructor leaves it */
            PyCapsule_SetName(cap, "used_dltensor_versioned");
            b->managed = mt;
            b->versioned = 1;
            b->readonly = (mt->flags & WX_DL_FLAG_READ_ONLY) != 0;
            Py_DECREF(cap);
            if (wx__from_tensor(b, &mt->dl_tensor, what) < 0) {
                wx_py_buf_release(b);
                return -1;
            }
        } else if (PyCapsule_IsValid(cap, "dltensor")) {
            wx_dl_managed_t *mt = PyCapsule_GetPointer(cap, "dltensor");
            PyCapsule_SetName(cap, "used_dltensor");
            b->managed = mt;
            b->versioned = 0;
            Py_DECREF(cap);
            if (wx__from_tensor(b, &mt->dl_tensor, what) < 0) {
                wx_py_buf_release(b);
                return -1;
            }
        } else {
            PyErr_Format(PyExc_TypeError, "%s: __dlpack__ returned %R, not a DLPack capsule", what,
                         cap);
            Py_DECREF(cap);
            return -1;
        }
    } else {
        int flags = PyBUF_C_CONTIGUOUS | (need_writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: expected a DLPack producer (e.g. a torch tensor) or a contiguous%s "
                         "buffer, got %.100s",
                         what, need_writable ? " writable" : "", Py_TYPE(obj)->tp_name);
            return -1;
        }
        b->has_view = 1;
        b->addr = b->view.buf;
        b->nbytes = (uint64_t)b->view.len;
        b->mem = WX_MEM_HOST;
        b->readonly = b->view.readonly;
    }
    if (need_writable && b->readonly) {
        PyErr_Format(PyExc_ValueError, "%s: the buffer is read-only", what);
        wx_py_buf_release(b);
        return -1;
    }
    if (b->nbytes == 0) {
        PyErr_Format(PyExc_ValueError, "%s: the buffer is empty", what);
        wx_py_buf_release(b);
        return -1;
    }
    return 0;
}

void wx_py_buf_release(wx_py_buf_t *b)
{
    if (b->managed) {
        if (b->versioned) {
            wx_dl_managed_v1_t *mt = b->managed;
            if (mt->deleter)
                mt->deleter(mt);
        } else {
            wx_dl_managed_t *mt = b->managed;
            if (mt->deleter)
                mt->deleter(mt);
        }
        b->managed = NULL;
    }
    if (b->has_view) {
        PyBuffer_Release(&b->view);
        b->has_view = 0;
    }
}
