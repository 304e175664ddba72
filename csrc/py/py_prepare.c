/* py_prepare.c - the Python binding of the native prepare code (csrc/prepare): the FP8
 * kernel's probe, validation and launch. wxfer/runtime/fp8.py is its only caller. */
#include "wx_py.h"

#include <stdlib.h>
#include <string.h>

#include "wx_fp8.h"

/* The piece table of a buffer-protocol object (e.g. array('q')), 8-byte aligned; *copy is
 * set when it had to be copied (free it). Returns the count, or -1 with an exception. */
static int wx__pieces(PyObject *obj, Py_buffer *view, const wx_fp8_piece_t **p, void **copy)
{
    *copy = NULL;
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len <= 0 || view->len % (Py_ssize_t)sizeof(wx_fp8_piece_t) ||
        view->len / (Py_ssize_t)sizeof(wx_fp8_piece_t) > WX_FP8_MAX_PIECES) {
        PyErr_Format(PyExc_ValueError,
                     "fp8 piece table: %zd bytes (expected 1 to %d pieces of "
                     "%zu bytes)",
                     view->len, WX_FP8_MAX_PIECES, sizeof(wx_fp8_piece_t));
        PyBuffer_Release(view);
        return -1;
    }
    *p = view->buf;
    if ((uintptr_t)view->buf % 8) {
        *copy = malloc((size_t)view->len);
        if (!*copy) {
            PyBuffer_Release(view);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(*copy, view->buf, (size_t)view->len);
        *p = *copy;
    }
    return (int)(view->len / (Py_ssize_t)sizeof(wx_fp8_piece_t));
}

static PyObject *wx_fp8_check_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    PyObject *obj;
    unsigned long long out_nbytes;
    Py_buffer view;
    const wx_fp8_piece_t *p;
    void *copy;
    uint64_t ntiles = 0;
    int n, rc;
    if (!PyArg_ParseTuple(args, "OK:fp8_check", &obj, &out_nbytes))
        return NULL;
    if ((n = wx__pieces(obj, &view, &p, &copy)) < 0)
        return NULL;
    rc = wx_fp8_check(p, n, out_nbytes, &ntiles);
    free(copy);
    PyBuffer_Release(&view);
    if (rc)
        return wx_py_raise(st, rc, "fp8_check");
    return PyLong_FromUnsignedLongLong(ntiles);
}

static PyObject *wx_fp8_probe_py(PyObject *m, PyObject *args)
{
    int device, rc, nd = 0;
    PyObject *dirs = NULL, *seq = NULL, *res = NULL;
    const char **d = NULL;
    char why[WX_ERRMSG_MAX] = "";
    if (!PyArg_ParseTuple(args, "i|O:fp8_probe", &device, &dirs))
        return NULL;
    if (dirs && dirs != Py_None) {
        if (!(seq = PySequence_Fast(dirs, "fp8_probe: dirs must be a sequence of str")))
            return NULL;
        nd = (int)PySequence_Fast_GET_SIZE(seq);
        if (nd && !(d = calloc((size_t)nd, sizeof *d))) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
        for (int i = 0; i < nd; i++)
            if (!(d[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i))))
                goto out;
    }
    Py_BEGIN_ALLOW_THREADS rc = wx_fp8_probe(device, d, nd, why, sizeof why);
    Py_END_ALLOW_THREADS res =
        Py_BuildValue("(Os)", rc == 0 ? Py_True : Py_False, rc == 0 ? "" : why);
out:
    free(d);
    Py_XDECREF(seq);
    return res;
}

static PyObject *wx_fp8_launch_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    int device, n, rc;
    unsigned long long stream, out, out_nbytes, dev_pieces;
    PyObject *obj;
    Py_buffer view;
    const wx_fp8_piece_t *p;
    void *copy;
    if (!PyArg_ParseTuple(args, "iKKKOK:fp8_launch", &device, &stream, &out, &out_nbytes, &obj,
                          &dev_pieces))
        return NULL;
    if ((n = wx__pieces(obj, &view, &p, &copy)) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS rc = wx_fp8_launch(device, stream, out, out_nbytes, p, dev_pieces, n);
    Py_END_ALLOW_THREADS free(copy);
    PyBuffer_Release(&view);
    if (rc)
        return wx_py_raise(st, rc, "fp8_launch");
    Py_RETURN_NONE;
}

static PyMethodDef wx__prepare_methods[] = {
    {"fp8_check", wx_fp8_check_py, METH_VARARGS,
     "fp8_check(pieces, out_nbytes) -> tiles; raises Error naming the first bad piece. pieces: "
     "a buffer of 8 x int64 per piece (src, dtype, ld, rows, cols, q_off, s_off, tile0)."},
    {"fp8_probe", wx_fp8_probe_py, METH_VARARGS,
     "fp8_probe(device, dirs=()) -> (usable, why_not): loads libnvrtc (also from dirs) and "
     "compiles the FP8 kernel for the device at first use."},
    {"fp8_launch", wx_fp8_launch_py, METH_VARARGS,
     "fp8_launch(device, stream, out_ptr, out_nbytes, pieces, device_pieces_ptr): one launch "
     "of the FP8 kernel on the stream; pieces as for fp8_check, device_pieces_ptr the same "
     "bytes in device memory, or 0 for at most 8 pieces (passed in the launch's parameters)."},
    {NULL, NULL, 0, NULL},
};

int wx_py_prepare_init(PyObject *m) { return PyModule_AddFunctions(m, wx__prepare_methods); }
