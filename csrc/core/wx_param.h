/* wx_param.h - every environment variable the C code reads, in one table (name, type,
 * default, doc), NCCL_PARAM-style.
 *
 * No other file of csrc/ (but the verbs emulation, csrc/testing/) reads the environment:
 * tests/test_envs.py checks it, and that wxfer/envs.py, README's table and
 * `python -m wxfer doctor` print this table (wxfer._wxfer.params()).
 *
 * A value is read from the environment where it is used, as before the table: the library
 * paths once (each library is loaded once), WXFER_DEBUG at the first log line, the fabric
 * defaults and WXFER_IB_DEVICES at each Transport's open (a process may open transports with
 * different settings; the tests do). */
#ifndef WX_PARAM_H
#define WX_PARAM_H

#ifdef __cplusplus
extern "C" {
#endif

/* X(id, name, type, value when unset or empty (or NULL), the default as documented, when, doc)
 * type: as in wxfer/envs.py (flag, str, path, list); when: run, or test build (read only by
 * WXFER_TESTING=1 builds). Names that are not wxfer's (CUDA's) are read for messages and
 * search paths only; wxfer/envs.py lists the WXFER_ ones. */
#define WX_PARAMS(X)                                                                               \
    X(FABRIC_PROVIDER, "WXFER_FABRIC_PROVIDER", "str", "tcp", "tcp", "run",                        \
      "the fabric backend's provider when none is given (a Receiver publishes it; its Senders "    \
      "open with it)")                                                                             \
    X(IFACE, "WXFER_IFACE", "str", NULL, "lo for tcp", "run",                                      \
      "the fabric backend's iface (the job's NIC) when none is given; verbs and cuda_ipc have "    \
      "no such option")                                                                            \
    X(FABRIC_IFACE, "WXFER_FABRIC_IFACE", "str", NULL, "unset", "run",                             \
      "the older name of WXFER_IFACE, read when that is unset")                                    \
    X(IB_DEVICES, "WXFER_IB_DEVICES", "list", NULL, "automatic", "run",                            \
      "RDMA devices to use (mlx5_0,mlx5_1:1) or exclude (^mlx5_2)")                                \
    X(LIBCUDA, "WXFER_LIBCUDA", "path", "libcuda.so.1", "libcuda.so.1", "run",                     \
      "the CUDA driver library")                                                                   \
    X(LIBFABRIC, "WXFER_LIBFABRIC", "path", "libfabric.so.1", "libfabric.so.1", "run",             \
      "the libfabric library")                                                                     \
    X(LIBIBVERBS, "WXFER_LIBIBVERBS", "path", "libibverbs.so.1", "libibverbs.so.1", "run",         \
      "the libibverbs library (tests: the emulation)")                                             \
    X(LIBNVRTC, "WXFER_LIBNVRTC", "path", NULL, "searched", "run",                                 \
      "the NVRTC library (when set, only it)")                                                     \
    X(DEBUG, "WXFER_DEBUG", "flag", NULL, "off", "run",                                            \
      "run time: native debug log on stderr; build: -O0 -g")                                       \
    X(TEST_GPUREG, "WXFER_TEST_GPUREG", "str", NULL, "unset", "test build",                        \
      "override the verbs GPU-registration facts")                                                 \
    X(CUDA_HOME, "CUDA_HOME", "path", NULL, "unset", "run",                                        \
      "CUDA's: a directory NVRTC is searched in")                                                  \
    X(CUDA_VISIBLE_DEVICES, "CUDA_VISIBLE_DEVICES", "list", NULL, "unset", "run",                  \
      "CUDA's: quoted when cuda_ipc finds no device")

typedef enum {
#define WX__PARAM_ID(id, name, type, value, shown, when, doc) WX_P_##id,
    WX_PARAMS(WX__PARAM_ID)
#undef WX__PARAM_ID
        WX_P_COUNT
} wx_param_id_t;

typedef struct {
    const char *name;
    const char *type;  /* flag, str, path, list */
    const char *value; /* what wx_param_str returns when the variable is unset or empty */
    const char *shown; /* the default as documented */
    const char *when;  /* run, test build */
    const char *doc;
} wx_param_t;

extern const wx_param_t wx_params[WX_P_COUNT];

/* The variable as set in the environment, or NULL if unset. */
const char *wx_param_env(wx_param_id_t id);
/* The variable's value if set and not empty, else the table's value (may be NULL). */
const char *wx_param_str(wx_param_id_t id);
/* A flag: set, not empty and not "0". */
int wx_param_flag(wx_param_id_t id);

#ifdef __cplusplus
}
#endif
#endif
