/* placeholder replaced by the bindings in the next commit */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef wx_module = {PyModuleDef_HEAD_INIT, "_wxfer", NULL, 0, NULL};
PyMODINIT_FUNC PyInit__wxfer(void) { return PyModuleDef_Init(&wx_module); }
