/* py_doctor.c - wxfer._wxfer.libraries(): what each foreign library says about itself, for
 * `python -m wxfer doctor` (wxfer/tools/doctor.py). Read-only: loads the libraries through
 * the same dlopen tables the backends use and asks for versions, providers and devices. */
#include "wx_py.h"

#include <stdio.h>
#include <string.h>

#include "wx_dl_cuda.h"
#include "wx_dl_nvrtc.h"
#include "wx_fabric_dl.h"
#include "wx_param.h"
#include "wx_verbs_dl.h"

#define WX__PROVS_MAX 512 /* fi_getinfo entries kept (one per provider, domain and variant) */

/* {"loaded", "why", "version", "api_version", "providers": [{"name", "version", "domain",
 * "rma", "hmem"}]} */
static PyObject *wx__fabric_info(void)
{
    char why[320] = "";
    const wx_fi_api_t *fi = wx_fi(why, sizeof why);
    struct fi_info *list = NULL;
    PyObject *provs = NULL;
    uint32_t v;
    int rc;
    if (!fi)
        return Py_BuildValue("{sOss}", "loaded", Py_False, "why", why);
    v = fi->fi_version();
    if (v > FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION))
        v = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); /* the API we speak, as the backend */
    Py_BEGIN_ALLOW_THREADS
        rc = fi->fi_getinfo(v, NULL, NULL, 0, NULL, &list);
    Py_END_ALLOW_THREADS
    provs = PyList_New(0);
    if (!provs)
        goto fail;
    for (struct fi_info *i = rc == 0 ? list : NULL; i && PyList_GET_SIZE(provs) < WX__PROVS_MAX;
         i = i->next) {
        const char *p =
            i->fabric_attr && i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "?";
        const char *d = i->domain_attr && i->domain_attr->name ? i->domain_attr->name : "?";
        uint32_t pv = i->fabric_attr ? i->fabric_attr->prov_version : 0;
        char pvs[32];
        PyObject *e;
        snprintf(pvs, sizeof pvs, "%u.%u", FI_MAJOR(pv), FI_MINOR(pv));
        e = Py_BuildValue("{sssssssOsOss}", "name", p, "domain", d, "version", pvs, "rma",
                          (i->caps & FI_RMA) ? Py_True : Py_False, "hmem",
                          (i->caps & FI_HMEM) ? Py_True : Py_False, "ep_type",
                          i->ep_attr && i->ep_attr->type == FI_EP_RDM ? "rdm" : "other");
        if (!e || PyList_Append(provs, e) < 0) {
            Py_XDECREF(e);
            goto fail;
        }
        Py_DECREF(e);
    }
    if (list)
        fi->fi_freeinfo(list);
    {
        char vs[32];
        uint32_t lv = fi->fi_version();
        snprintf(vs, sizeof vs, "%u.%u", FI_MAJOR(lv), FI_MINOR(lv));
        return Py_BuildValue("{sOsssssisN}", "loaded", Py_True, "version", vs, "why",
                             rc ? fi->fi_strerror(-rc) : "", "getinfo_rc", rc, "providers", provs);
    }
fail:
    Py_XDECREF(provs);
    if (list)
        fi->fi_freeinfo(list);
    return NULL;
}

/* {"loaded", "why", "path", "emulated", "devices": [names], "reg_dmabuf_mr"} */
static PyObject *wx__verbs_info(void)
{
    char why[320] = "";
    const wx_verbs_api_t *v = wx_verbs_api(why, sizeof why);
    struct ibv_device **devs;
    PyObject *names;
    int n = 0;
    if (!v)
        return Py_BuildValue("{sOss}", "loaded", Py_False, "why", why);
    names = PyList_New(0);
    if (!names)
        return NULL;
    devs = v->get_device_list(&n);
    for (int i = 0; devs && i < n; i++) {
        PyObject *s = PyUnicode_FromString(v->get_device_name(devs[i]));
        if (!s || PyList_Append(names, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(names);
            v->free_device_list(devs);
            return NULL;
        }
        Py_DECREF(s);
    }
    if (devs)
        v->free_device_list(devs);
    return Py_BuildValue("{sOsssssOsNsO}", "loaded", Py_True, "why", "", "path", v->path,
                         "emulated", v->emulated ? Py_True : Py_False, "devices", names,
                         "reg_dmabuf_mr", v->reg_dmabuf_mr ? Py_True : Py_False);
}

/* {"loaded", "why", "driver_version", "devices": [{"name", "pci", "dmabuf", "cc"}],
 *  "peer": [[bool]], "get_handle": cuMemGetHandleForAddressRange is there} */
static PyObject *wx__cuda_info(void)
{
    char why[320] = "";
    const wx_cuda_api_t *cu = wx_cuda(why, sizeof why);
    PyObject *devs, *peer;
    int drv = 0, n = 0;
    if (!cu)
        return Py_BuildValue("{sOss}", "loaded", Py_False, "why", why);
    cu->cuDriverGetVersion(&drv);
    if (cu->cuDeviceGetCount(&n) != CUDA_SUCCESS)
        n = 0;
    devs = PyList_New(0);
    peer = PyList_New(0);
    if (!devs || !peer)
        goto fail;
    for (int i = 0; i < n; i++) {
        char name[256] = "?", pci[64] = "";
        int dmabuf = 0, ccmaj = 0, ccmin = 0;
        CUdevice d;
        PyObject *e, *row;
        if (cu->cuDeviceGet(&d, i) != CUDA_SUCCESS)
            continue;
        cu->cuDeviceGetName(name, sizeof name, d);
        cu->cuDeviceGetPCIBusId(pci, sizeof pci, d);
        cu->cuDeviceGetAttribute(&dmabuf, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, d);
        cu->cuDeviceGetAttribute(&ccmaj, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d);
        cu->cuDeviceGetAttribute(&ccmin, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d);
        e = Py_BuildValue("{sisssssOs(ii)}", "index", i, "name", name, "pci", pci, "dmabuf",
                          dmabuf ? Py_True : Py_False, "cc", ccmaj, ccmin);
        if (!e || PyList_Append(devs, e) < 0) {
            Py_XDECREF(e);
            goto fail;
        }
        Py_DECREF(e);
        row = PyList_New(n);
        if (!row)
            goto fail;
        for (int j = 0; j < n; j++) {
            int ok = 0;
            CUdevice dj;
            if (j != i && cu->cuDeviceGet(&dj, j) == CUDA_SUCCESS)
                cu->cuDeviceCanAccessPeer(&ok, d, dj);
            PyList_SET_ITEM(row, j, PyBool_FromLong(j == i || ok));
        }
        if (PyList_Append(peer, row) < 0) {
            Py_DECREF(row);
            goto fail;
        }
        Py_DECREF(row);
    }
    return Py_BuildValue("{sOsssisNsNsO}", "loaded", Py_True, "why", "", "driver_version", drv,
                         "devices", devs, "peer", peer, "get_handle",
                         cu->cuMemGetHandleForAddressRange ? Py_True : Py_False);
fail:
    Py_XDECREF(devs);
    Py_XDECREF(peer);
    return NULL;
}

/* {"loaded", "why", "version", "path"}; dirs as for wx_nvrtc() */
static PyObject *wx__nvrtc_info(PyObject *dirs_seq)
{
    char why[1024] = "";
    const char *dirs[16];
    int nd = 0;
    const wx_nvrtc_api_t *nv;
    Py_ssize_t n = dirs_seq ? PySequence_Size(dirs_seq) : 0;
    for (Py_ssize_t i = 0; i < n && nd < 16; i++) {
        PyObject *o = PySequence_GetItem(dirs_seq, i);
        const char *s = o ? PyUnicode_AsUTF8(o) : NULL;
        Py_XDECREF(o); /* the list keeps the string alive */
        if (!s)
            return NULL;
        dirs[nd++] = s;
    }
    nv = wx_nvrtc(dirs, nd, why, sizeof why);
    if (!nv)
        return Py_BuildValue("{sOss}", "loaded", Py_False, "why", why);
    {
        char vs[32];
        snprintf(vs, sizeof vs, "%d.%d", nv->major, nv->minor);
        return Py_BuildValue("{sOssssss}", "loaded", Py_True, "why", "", "version", vs, "path",
                             nv->path);
    }
}

static PyObject *wx_libraries_py(PyObject *m, PyObject *args)
{
    PyObject *dirs = NULL, *fab, *verbs, *cuda, *nvrtc;
    if (!PyArg_ParseTuple(args, "|O", &dirs))
        return NULL;
    if (dirs && !PyList_Check(dirs)) {
        PyErr_SetString(PyExc_TypeError, "libraries(nvrtc_dirs): nvrtc_dirs must be a list of str");
        return NULL;
    }
    fab = wx__fabric_info();
    verbs = fab ? wx__verbs_info() : NULL;
    cuda = verbs ? wx__cuda_info() : NULL;
    nvrtc = cuda ? wx__nvrtc_info(dirs) : NULL;
    if (!nvrtc) {
        Py_XDECREF(fab);
        Py_XDECREF(verbs);
        Py_XDECREF(cuda);
        return NULL;
    }
    return Py_BuildValue("{sNsNsNsNssssss}", "libfabric", fab, "libibverbs", verbs, "libcuda", cuda,
                         "nvrtc", nvrtc, "abi_ibverbs", WX_IBV_ABI_CHECKED, "abi_libfabric",
                         WX_FI_ABI_CHECKED, "abi_cuda", WX_CUDA_ABI_CHECKED);
}

/* (({name, type, default, when, doc, value}), ...): the table of wx_param.h, each row with its
 * value in this process's environment now (None if unset). */
static PyObject *wx_params_py(PyObject *self, PyObject *noargs)
{
    PyObject *out = PyTuple_New(WX_P_COUNT);
    WX_UNUSED(self);
    WX_UNUSED(noargs);
    for (int i = 0; out && i < WX_P_COUNT; i++) {
        const wx_param_t *p = &wx_params[i];
        const char *v = wx_param_env((wx_param_id_t)i);
        PyObject *row = Py_BuildValue("{sssssssssssz}", "name", p->name, "type", p->type, "default",
                                      p->shown, "when", p->when, "doc", p->doc, "value", v);
        if (!row) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, row);
    }
    return out;
}

static PyMethodDef wx__doctor_methods[] = {
    {"params", wx_params_py, METH_NOARGS,
     "params() -> ({name, type, default, when, doc, value}, ...): the environment variables the "
     "C code reads (csrc/core/wx_param.h), each with its value here now (None if unset)."},
    {"libraries", wx_libraries_py, METH_VARARGS,
     "libraries(nvrtc_dirs=[]) -> {libfabric, libibverbs, libcuda, nvrtc: {loaded, why, ...}}: "
     "what each library wxfer dlopens says about itself (versions, fabric providers, RDMA "
     "devices, GPUs with dma-buf support and peer access), and the ABI versions wxfer's own "
     "declarations were checked against."},
    {NULL, NULL, 0, NULL},
};

int wx_py_doctor_init(PyObject *m) { return PyModule_AddFunctions(m, wx__doctor_methods); }
