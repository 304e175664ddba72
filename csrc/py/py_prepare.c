/* py_prepare.c - the Python binding of the native prepare code (csrc/prepare): the FP8
 * kernel's and the batched copy kernel's probe, validation and launch, the driver's batched
 * copy, the delta kernels (wx_delta.h), and (WXFER_KERNEL_SWEEP builds) the benchmarks' kernel
 * variants. wxfer/runtime/fp8.py, copies.py and delta_gpu.py are their only callers. */
#include "wx_py.h"

#include <stdlib.h>
#include <string.h>

#include "wx_copy.h"
#include "wx_delta.h"
#include "wx_delta_host.h"
#include "wx_fp8.h"
#include "wx_fp8_host.h"
#include "wx_streamwait.h"
#include "wx_sweep.h"

/* A table argument: `obj` (set by the caller's PyArg_ParseTuple) read by wx__table as `n`
 * entries at `p`, from its buffer `view` or, where that is not 8-byte aligned, from `copy`. */
typedef struct {
    PyObject *obj;
    Py_buffer view;
    const void *p;
    void *copy;
    int n;
} wx__tab_t;

/* The table of `what` (entries of `esize` bytes, at most `max`, `many` in its error) in t->obj,
 * a buffer-protocol object (e.g. array('Q')), 8-byte aligned; release it with wx__checked or
 * wx__launched. Returns 0, or -1 with an exception (nothing to release). */
static int wx__table(wx__tab_t *t, const char *what, const char *many, size_t esize, int max)
{
    Py_buffer *view = &t->view;
    t->copy = NULL;
    if (PyObject_GetBuffer(t->obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len <= 0 || view->len % (Py_ssize_t)esize || view->len / (Py_ssize_t)esize > max) {
        PyErr_Format(PyExc_ValueError, "%s table: %zd bytes (expected 1 to %d %s of %zu bytes)",
                     what, view->len, max, many, esize);
        PyBuffer_Release(view);
        return -1;
    }
    t->p = view->buf;
    if ((uintptr_t)view->buf % 8) {
        t->copy = malloc((size_t)view->len);
        if (!t->copy) {
            PyBuffer_Release(view);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(t->copy, view->buf, (size_t)view->len);
        t->p = t->copy;
    }
    t->n = (int)(view->len / (Py_ssize_t)esize);
    return 0;
}

static int wx__pieces(wx__tab_t *t)
{
    return wx__table(t, "fp8 piece", "pieces", sizeof(wx_fp8_piece_t), WX_FP8_MAX_PIECES);
}

static int wx__ranges(wx__tab_t *t)
{
    return wx__table(t, "copy range", "ranges", sizeof(wx_copy_range_t), WX_COPY_MAX_RANGES);
}

/* dirs (a sequence of str, or None) as a C array *d of *nd entries (free *d, DECREF *seq). */
static int wx__dirs(PyObject *dirs, PyObject **seq, const char ***d, int *nd)
{
    *seq = NULL;
    *d = NULL;
    *nd = 0;
    if (!dirs || dirs == Py_None)
        return 0;
    if (!(*seq = PySequence_Fast(dirs, "probe: dirs must be a sequence of str")))
        return -1;
    *nd = (int)PySequence_Fast_GET_SIZE(*seq);
    if (*nd && !(*d = calloc((size_t)*nd, sizeof **d))) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < *nd; i++)
        if (!((*d)[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(*seq, i))))
            return -1;
    return 0;
}

/* After a check of the table `t`: release it; raise for rc, else return the count the check
 * gave (tiles, chunks, segments). */
static PyObject *wx__checked(wx_py_state_t *st, int rc, wx__tab_t *t, const char *call,
                             uint64_t count)
{
    free(t->copy);
    PyBuffer_Release(&t->view);
    if (rc)
        return wx_py_raise(st, rc, call);
    return PyLong_FromUnsignedLongLong(count);
}

static PyObject *wx_fp8_check_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    wx__tab_t t;
    unsigned long long out_nbytes;
    uint64_t ntiles = 0;
    int rc;
    if (!PyArg_ParseTuple(args, "OK:fp8_check", &t.obj, &out_nbytes))
        return NULL;
    if (wx__pieces(&t) < 0)
        return NULL;
    rc = wx_fp8_check(t.p, t.n, out_nbytes, &ntiles);
    return wx__checked(st, rc, &t, "fp8_check", ntiles);
}

typedef int (*wx__probe_fn)(int, const char *const *, int, char *, size_t);

static PyObject *wx__probe(PyObject *args, const char *fmt, wx__probe_fn probe)
{
    int device, rc, nd = 0;
    PyObject *dirs = NULL, *seq = NULL, *res = NULL;
    const char **d = NULL;
    char why[WX_ERRMSG_MAX] = "";
    if (!PyArg_ParseTuple(args, fmt, &device, &dirs))
        return NULL;
    if (wx__dirs(dirs, &seq, &d, &nd) == 0) {
        Py_BEGIN_ALLOW_THREADS
            rc = probe(device, d, nd, why, sizeof why);
        Py_END_ALLOW_THREADS
        res = Py_BuildValue("(Os)", rc == 0 ? Py_True : Py_False, rc == 0 ? "" : why);
    }
    free(d);
    Py_XDECREF(seq);
    return res;
}

static PyObject *wx_fp8_probe_py(PyObject *m, PyObject *args)
{
    return wx__probe(args, "i|O:fp8_probe", wx_fp8_probe);
}

/* After a launch on the table `t` (pieces, ranges, copies, delta entries): release it; None, or
 * the error of `call` when rc is not 0. */
static PyObject *wx__launched(wx_py_state_t *st, int rc, wx__tab_t *t, const char *call)
{
    free(t->copy);
    PyBuffer_Release(&t->view);
    return wx_py_none(st, rc, call);
}

static PyObject *wx_fp8_launch_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    int device, rc;
    unsigned long long stream, out, out_nbytes, dev_pieces;
    wx__tab_t t;
    if (!PyArg_ParseTuple(args, "iKKKOK:fp8_launch", &device, &stream, &out, &out_nbytes, &t.obj,
                          &dev_pieces))
        return NULL;
    if (wx__pieces(&t) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_fp8_launch(device, stream, out, out_nbytes, t.p, dev_pieces, t.n);
    Py_END_ALLOW_THREADS
    return wx__launched(st, rc, &t, "fp8_launch");
}

static PyObject *wx_copy_check_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    wx__tab_t t;
    uint64_t nchunks = 0;
    int rc;
    if (!PyArg_ParseTuple(args, "O:copy_check", &t.obj))
        return NULL;
    if (wx__ranges(&t) < 0)
        return NULL;
    rc = wx_copy_check(t.p, t.n, &nchunks);
    return wx__checked(st, rc, &t, "copy_check", nchunks);
}

static PyObject *wx_copy_probe_py(PyObject *m, PyObject *args)
{
    return wx__probe(args, "i|O:copy_probe", wx_copy_probe);
}

static PyObject *wx_copy_launch_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    int device, rc, ctas = 0;
    unsigned long long stream, dev_ranges;
    wx__tab_t t;
    if (!PyArg_ParseTuple(args, "iKOK|i:copy_launch", &device, &stream, &t.obj, &dev_ranges, &ctas))
        return NULL;
    if (wx__ranges(&t) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_copy_launch(device, stream, t.p, dev_ranges, t.n, ctas);
    Py_END_ALLOW_THREADS
    return wx__launched(st, rc, &t, "copy_launch");
}

static PyObject *wx_copy_settings_py(PyObject *m, PyObject *args)
{
    int u = 0, c = 0;
    wx_copy_settings(&u, &c);
    return Py_BuildValue("{sisi}", "unroll", u, "ctas_per_sm", c);
}

static PyObject *wx_copy_batch_probe_py(PyObject *m, PyObject *args)
{
    char why[WX_ERRMSG_MAX] = "";
    int device, rc;
    if (!PyArg_ParseTuple(args, "i:copy_batch_probe", &device))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_copy_batch_probe(device, why, sizeof why);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Os)", rc == 0 ? Py_True : Py_False, rc == 0 ? "" : why);
}

static PyObject *wx_copy_batch_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    int device, rc, beside = 0;
    unsigned long long stream;
    wx__tab_t t;
    if (!PyArg_ParseTuple(args, "iKO|p:copy_batch", &device, &stream, &t.obj, &beside))
        return NULL;
    if (wx__table(&t, "copy_batch", "(dst, src, nbytes) triples", 3 * sizeof(uint64_t),
                  WX_COPY_MAX_RANGES) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_copy_batch(device, stream, t.p, t.n, beside);
    Py_END_ALLOW_THREADS
    return wx__launched(st, rc, &t, "copy_batch");
}

/* The delta tables: entries of 5 (compare), 3 (count), 8 (emit) or 4 (scatter) uint64. */
static const struct {
    const char *name;
    size_t esize;
} wx__dtables[] = {{"delta compare", sizeof(wx_delta_cmp_t)},
                   {"delta count", sizeof(wx_delta_range_t)},
                   {"delta record", sizeof(wx_delta_rec_t)},
                   {"delta scatter", sizeof(wx_delta_scat_t)}};

static int wx__dtable(int kind, wx__tab_t *t)
{
    if (kind < 0 || kind > 3) {
        PyErr_Format(PyExc_ValueError,
                     "delta table kind %d (0 compare, 1 count, 2 emit, 3 scatter)", kind);
        return -1;
    }
    return wx__table(t, wx__dtables[kind].name, "entries", wx__dtables[kind].esize, WX_DELTA_MAX);
}

static PyObject *wx_delta_probe_py(PyObject *m, PyObject *args)
{
    return wx__probe(args, "i|O:delta_probe", wx_delta_probe);
}

/* delta_check(kind, table, bits_nbytes, shadow_nbytes=0, out_nbytes=0, nsegx=0) -> segments
 * (scatter: shadow_nbytes only) */
static PyObject *wx_delta_check_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    int kind, rc;
    unsigned long long bits_nb, shadow_nb = 0, out_nb = 0, nsegx = 0;
    uint64_t nsegs = 0;
    wx__tab_t t;
    if (!PyArg_ParseTuple(args, "iOK|KKK:delta_check", &kind, &t.obj, &bits_nb, &shadow_nb, &out_nb,
                          &nsegx))
        return NULL;
    if (wx__dtable(kind, &t) < 0)
        return NULL;
    if (kind == 0)
        rc = wx_delta_cmp_check(t.p, t.n, bits_nb, &nsegs);
    else if (kind == 1)
        rc = wx_delta_count_check(t.p, t.n, bits_nb, &nsegs);
    else if (kind == 2)
        rc = wx_delta_emit_check(t.p, t.n, bits_nb, shadow_nb, out_nb, nsegx, &nsegs);
    else
        rc = wx_delta_scatter_check(t.p, t.n, bits_nb, shadow_nb, &nsegs);
    return wx__checked(st, rc, &t, "delta_check", nsegs);
}

static PyObject *wx_delta_quant_launch_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    int device, rc;
    unsigned long long stream, out, out_nbytes, dev_pieces, bits, bits_nbytes;
    wx__tab_t t;
    if (!PyArg_ParseTuple(args, "iKKKOKKK:delta_quant_launch", &device, &stream, &out, &out_nbytes,
                          &t.obj, &dev_pieces, &bits, &bits_nbytes))
        return NULL;
    if (wx__pieces(&t) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_delta_quant_launch(device, stream, out, out_nbytes, t.p, dev_pieces, t.n, bits,
                                   bits_nbytes);
    Py_END_ALLOW_THREADS
    return wx__launched(st, rc, &t, "delta_quant_launch");
}

/* delta_launch(kind, device, stream, table, dev_table, bits, bits_nbytes, a=0, a_n=0, b=0, b_n=0,
 * out=0, out_n=0): kind 0 compare, 1 count (a: counts), 2 emit (a: shadow, b: segx), 3 scatter
 * (a: shadow; the table's destinations mapped in the writer's context). */
static PyObject *wx_delta_launch_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    int kind, device, rc;
    unsigned long long stream, dev, bits, bits_nb, a = 0, an = 0, b = 0, bn = 0, o = 0, on = 0;
    wx__tab_t t;
    if (!PyArg_ParseTuple(args, "iiKOKKK|KKKKKK:delta_launch", &kind, &device, &stream, &t.obj,
                          &dev, &bits, &bits_nb, &a, &an, &b, &bn, &o, &on))
        return NULL;
    if (wx__dtable(kind, &t) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        if (kind == 0)
            rc = wx_delta_cmp_launch(device, stream, t.p, dev, t.n, bits, bits_nb);
        else if (kind == 1)
            rc = wx_delta_count_launch(device, stream, t.p, dev, t.n, bits, bits_nb, a, an);
        else if (kind == 2)
            rc = wx_delta_emit_launch(device, stream, t.p, dev, t.n, bits, bits_nb, a, an, b, bn, o,
                                      on);
        else
            rc = wx_delta_scatter_launch(device, stream, t.p, dev, t.n, bits, bits_nb, a, an);
    Py_END_ALLOW_THREADS
    return wx__launched(st, rc, &t, "delta_launch");
}

static PyObject *wx_delta_apply_probe_py(PyObject *m, PyObject *args)
{
    return wx__probe(args, "i|O:delta_apply_probe", wx_delta_apply_probe);
}

/* The apply's addresses and sizes: (rec, rec_nbytes, nrec, regions, nregions, work, state,
 * counts, segx, cap), after `head` leading arguments parsed by the caller's format. */
#define WX__RECS_FMT "KKKKKKKKKK"
#define WX__RECS_ARGS(a)                                                                           \
    (unsigned long long *)&(a).rec, (unsigned long long *)&(a).rec_nbytes,                         \
        (unsigned long long *)&(a).nrec, (unsigned long long *)&(a).regions,                       \
        (unsigned long long *)&(a).nregions, (unsigned long long *)&(a).work,                      \
        (unsigned long long *)&(a).state, (unsigned long long *)&(a).counts,                       \
        (unsigned long long *)&(a).segx, (unsigned long long *)&(a).cap

static PyObject *wx_delta_apply_check_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    wx_delta_recs_t a;
    int rc;
    if (!PyArg_ParseTuple(args, WX__RECS_FMT ":delta_apply_check", WX__RECS_ARGS(a)))
        return NULL;
    if ((rc = wx_delta_apply_check(&a)) != 0)
        return wx_py_raise(st, rc, "delta_apply_check");
    Py_RETURN_NONE;
}

static PyObject *wx_delta_apply_launch_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    wx_delta_recs_t a;
    unsigned long long stream;
    int device, phase, rc;
    if (!PyArg_ParseTuple(args, "iKi" WX__RECS_FMT ":delta_apply_launch", &device, &stream, &phase,
                          WX__RECS_ARGS(a)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_delta_apply_launch(device, stream, &a, phase);
    Py_END_ALLOW_THREADS
    if (rc)
        return wx_py_raise(st, rc, "delta_apply_launch");
    Py_RETURN_NONE;
}

/* stream_wait_addr(device, host_address) -> (device_address, why_not): 0 and the reason when
 * the device wait cannot be used (wx_streamwait.h). */
static PyObject *wx_stream_wait_addr_py(PyObject *m, PyObject *args)
{
    char why[WX_ERRMSG_MAX] = "";
    unsigned long long host;
    uint64_t dev = 0;
    int device, rc;
    if (!PyArg_ParseTuple(args, "iK:stream_wait_addr", &device, &host))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_stream_wait_addr(device, host, &dev, why, sizeof why);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Ks)", rc == 0 ? (unsigned long long)dev : 0ull, rc == 0 ? "" : why);
}

static PyObject *wx_stream_wait_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    unsigned long long stream, dev;
    unsigned int value;
    int device, rc;
    if (!PyArg_ParseTuple(args, "iKKI:stream_wait", &device, &stream, &dev, &value))
        return NULL;
    rc = wx_stream_wait_u32(device, stream, dev, value);
    return wx_py_none(st, rc, "stream_wait");
}

#ifdef WX_KERNEL_SWEEP
static PyObject *wx_kernel_sweep_py(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kws[] = {"kernel", "variant", "ctas_per_sm", "unroll", NULL};
    wx_py_state_t *st = PyModule_GetState(m);
    const char *kernel;
    char why[256] = "";
    int variant = 6, ctas = 0, unroll = 4, rc;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|$iii:kernel_sweep", kws, &kernel, &variant, &ctas,
                                     &unroll))
        return NULL;
    if ((rc = wx_sweep_set(kernel, variant, ctas, unroll, why, sizeof why)) != 0) {
        wx_errf(rc, "%s", why);
        return wx_py_raise(st, rc, "kernel_sweep");
    }
    Py_RETURN_NONE;
}
#endif

/* Delta pushes on the CPU (wx_delta_host.h): host addresses as ints, the GIL released. */
static PyObject *wx_delta_scan_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    unsigned long long cur, shadow, n, idx, cap;
    uint64_t c = 0;
    int rc;
    if (!PyArg_ParseTuple(args, "KKKKK:delta_scan", &cur, &shadow, &n, &idx, &cap))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_delta_scan((const uint8_t *)(uintptr_t)cur, (const uint8_t *)(uintptr_t)shadow, n,
                           (uint32_t *)(uintptr_t)idx, cap, &c);
    Py_END_ALLOW_THREADS
    if (rc)
        return wx_py_raise(st, rc, "delta_scan");
    return PyLong_FromUnsignedLongLong(c);
}

static PyObject *wx_delta_encode_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    unsigned long long cur, shadow, n, c, idx, doff, out, out_len;
    unsigned int region;
    int rc;
    if (!PyArg_ParseTuple(args, "KKKKKIKKK:delta_encode", &cur, &shadow, &n, &c, &idx, &region,
                          &doff, &out, &out_len))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_delta_encode((const uint8_t *)(uintptr_t)cur, (const uint8_t *)(uintptr_t)shadow, n,
                             c, (const uint32_t *)(uintptr_t)idx, region, doff,
                             (uint8_t *)(uintptr_t)out, out_len);
    Py_END_ALLOW_THREADS
    return wx_py_none(st, rc, "delta_encode");
}

static PyObject *wx_delta_sync_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    unsigned long long cur, shadow, n, c, idx;
    int rc;
    if (!PyArg_ParseTuple(args, "KKKKK:delta_sync", &cur, &shadow, &n, &c, &idx))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_delta_sync((const uint8_t *)(uintptr_t)cur, (uint8_t *)(uintptr_t)shadow, n, c,
                           (const uint32_t *)(uintptr_t)idx);
    Py_END_ALLOW_THREADS
    return wx_py_none(st, rc, "delta_sync");
}

static PyObject *wx_delta_apply_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    unsigned long long payload, len, n, c, dst;
    int enc, rc;
    if (!PyArg_ParseTuple(args, "KKiKKK:delta_apply", &payload, &len, &enc, &n, &c, &dst))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_delta_apply((const uint8_t *)(uintptr_t)payload, len, enc, n, c,
                            (uint8_t *)(uintptr_t)dst);
    Py_END_ALLOW_THREADS
    return wx_py_none(st, rc, "delta_apply");
}

static PyObject *wx_fp8_host_py(PyObject *m, PyObject *args)
{
    wx_py_state_t *st = PyModule_GetState(m);
    unsigned long long src, q, sc;
    long long ld, rows, cols;
    int dtype, rc, nthreads = 1;
    if (!PyArg_ParseTuple(args, "KiLLLKK|i:fp8_host", &src, &dtype, &ld, &rows, &cols, &q, &sc,
                          &nthreads))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
        rc = wx_fp8_host((const void *)(uintptr_t)src, dtype, ld, rows, cols,
                         (uint8_t *)(uintptr_t)q, (uint8_t *)(uintptr_t)sc, nthreads);
    Py_END_ALLOW_THREADS
    return wx_py_none(st, rc, "fp8_host");
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
    {"copy_check", wx_copy_check_py, METH_VARARGS,
     "copy_check(ranges) -> chunks; raises Error naming the first bad range. ranges: a buffer "
     "of 4 x uint64 per range (dst, src, nbytes, chunk0), chunk0 counting 64 KiB chunks."},
    {"copy_probe", wx_copy_probe_py, METH_VARARGS,
     "copy_probe(device, dirs=()) -> (usable, why_not): loads libnvrtc (also from dirs) and "
     "compiles the batched copy kernel for the device at first use."},
    {"copy_launch", wx_copy_launch_py, METH_VARARGS,
     "copy_launch(device, stream, ranges, device_ranges_ptr, ctas_per_sm=0): one launch of the "
     "batched copy kernel on the stream (ranges as for copy_check; device_ranges_ptr the same "
     "bytes in device memory, valid until the kernel ran; ctas_per_sm: the grid's CTAs per SM, "
     "0 the product's)."},
    {"copy_settings", wx_copy_settings_py, METH_NOARGS,
     "copy_settings() -> {unroll, ctas_per_sm}: the copy kernel's loads in flight per thread "
     "and CTAs per SM."},
    {"copy_batch_probe", wx_copy_batch_probe_py, METH_VARARGS,
     "copy_batch_probe(device) -> (usable, why_not): has the driver cuMemcpyBatchAsync "
     "(CUDA 12.8+)?"},
    {"stream_wait_addr", wx_stream_wait_addr_py, METH_VARARGS,
     "stream_wait_addr(device, host_address) -> (device_address, why_not): the device address "
     "of a pinned host word for stream_wait, or (0, the reason) when the driver lacks "
     "cuStreamWaitValue32_v2 or the memory is not pinned."},
    {"stream_wait", wx_stream_wait_py, METH_VARARGS,
     "stream_wait(device, stream, device_address, value): the stream waits on the device "
     "(cuStreamWaitValue32, GEQ: cyclic (int32)(*word - value) >= 0) before its later work; "
     "the host does not wait."},
    {"copy_batch", wx_copy_batch_py, METH_VARARGS,
     "copy_batch(device, stream, copies, beside_compute=False): the copies, a buffer of (dst, "
     "src, nbytes) uint64 triples, by one cuMemcpyBatchAsync on the stream (sources read in "
     "stream order); beside_compute: the driver is asked to run them beside the SMs' work "
     "(CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: the copy engines)."},
    {"delta_probe", wx_delta_probe_py, METH_VARARGS,
     "delta_probe(device, dirs=()) -> (usable, why_not): compiles the delta kernels (the fused "
     "FP8 one needs compute capability 8.9) for the device at first use."},
    {"delta_check", wx_delta_check_py, METH_VARARGS,
     "delta_check(kind, table, bits_nbytes, shadow_nbytes=0, out_nbytes=0, nsegx=0) -> "
     "segments; raises Error naming the first bad entry (kind 0 compare, 1 count, 2 emit, 3 "
     "scatter)."},
    {"delta_quant_launch", wx_delta_quant_launch_py, METH_VARARGS,
     "delta_quant_launch(device, stream, shadow_ptr, shadow_nbytes, pieces, device_pieces_ptr, "
     "bits_ptr, bits_nbytes): the FP8 kernel's pieces quantized into the shadow, the changed "
     "bytes written and marked in the bitmask."},
    {"delta_launch", wx_delta_launch_py, METH_VARARGS,
     "delta_launch(kind, device, stream, table, device_table_ptr, bits_ptr, bits_nbytes, a=0, "
     "a_n=0, b=0, b_n=0, out=0, out_n=0): kind 0 compare, 1 count (a: u32 counts), 2 emit (a: "
     "shadow, b: int64 prefix sum, out: the records), 3 scatter (a: shadow; each range's changed "
     "bytes stored at its destination address)."},
    {"delta_apply_probe", wx_delta_apply_probe_py, METH_VARARGS,
     "delta_apply_probe(device, dirs=()) -> (usable, why_not): compiles the receiver's apply "
     "kernel (wx_delta_apply, any compute capability) for the device at first use."},
    {"delta_apply_check", wx_delta_apply_check_py, METH_VARARGS,
     "delta_apply_check(rec, rec_nbytes, nrec, regions, nregions, work, state, counts, segx, "
     "cap): raises Error naming the bad address or size of a records apply (wx_delta.h)."},
    {"delta_apply_launch", wx_delta_apply_launch_py, METH_VARARGS,
     "delta_apply_launch(device, stream, phase, rec, rec_nbytes, nrec, regions, nregions, work, "
     "state, counts, segx, cap): phase 0 (walk + count) or 1 (check + apply) of a slot's "
     "records on the stream; segx[1:] = cumsum(counts) between them (wx_delta.h)."},
    {"delta_scan", wx_delta_scan_py, METH_VARARGS,
     "delta_scan(cur, shadow, n, idx, cap) -> changed: the bytes of host range cur[0, n) that "
     "differ from shadow[0, n); the first cap offsets (u32, ascending) written at idx (0: none)."},
    {"delta_encode", wx_delta_encode_py, METH_VARARGS,
     "delta_encode(cur, shadow, n, changed, idx, region, doff, out, out_len): the range's delta "
     "record (wxfer/runtime/delta.py's format) into host memory out; idx from delta_scan or 0."},
    {"delta_sync", wx_delta_sync_py, METH_VARARGS,
     "delta_sync(cur, shadow, n, changed, idx): the shadow's changed bytes (at idx; 0: the "
     "whole range) set from cur."},
    {"delta_apply", wx_delta_apply_py, METH_VARARGS,
     "delta_apply(payload, payload_len, encoding, n, changed, dst): one record's payload (after "
     "its head) applied to the n host bytes at dst; nothing written when it is malformed."},
    {"fp8_host", wx_fp8_host_py, METH_VARARGS,
     "fp8_host(src, dtype, ld, rows, cols, q, scales, nthreads=1): block-FP8 quantization of a "
     "host piece (addresses; q or scales 0: not written), the reference's bytes, its block rows "
     "shared among nthreads threads (csrc/prepare/wx_fp8_host.h)."},
#ifdef WX_KERNEL_SWEEP
    {"kernel_sweep", (PyCFunction)(void (*)(void))wx_kernel_sweep_py, METH_VARARGS | METH_KEYWORDS,
     "kernel_sweep(kernel, *, variant=6, ctas_per_sm=0, unroll=4): before the kernel's first "
     "use, compile the benchmark variant instead (kernel 'fp8': variant 0-8 of "
     "benchmarks/kernels/sweep_fp8_kernel.cu, ctas_per_sm 0 for the variant's own; 'delta': "
     "variant 0-29 of the fused delta kernel (WX_DPF = variant % 4, WX_DPAIR = variant / 4 % 2, "
     "WX_DBITS = variant / 8 below 24; WX_DPF 4, WX_DPAIR = (variant - 24) % 2, WX_DBITS = "
     "(variant - 24) / 2 from 24), "
     "ctas_per_sm 0-2; 'copy': unroll and ctas_per_sm). Only in builds made with "
     "WXFER_KERNEL_SWEEP=1."},
#endif
    {NULL, NULL, 0, NULL},
};

#ifdef WX_KERNEL_SWEEP
#define WX__SWEEP 1
#else
#define WX__SWEEP 0
#endif

int wx_py_prepare_init(PyObject *m)
{
    if (PyModule_AddIntConstant(m, "KERNEL_SWEEP", WX__SWEEP) < 0)
        return -1;
    return PyModule_AddFunctions(m, wx__prepare_methods);
}
