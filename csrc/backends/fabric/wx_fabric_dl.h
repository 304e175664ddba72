/* wx_fabric_dl.h - libfabric, loaded from libfabric.so.1 at run time.
 *
 * Always compiled: the types and inlines come from wx_fi_abi.h (no rdma/fabric.h needed at
 * build time); whether libfabric is there and new enough is decided at load. Only the
 * symbols libfabric really exports are looked up here: fi_getinfo, fi_freeinfo,
 * fi_dupinfo, fi_fabric, fi_strerror, fi_version, fi_tostr. Everything else the backend
 * calls (fi_domain, fi_endpoint, fi_mr_reg, fi_writemsg, fi_cq_read, ...) is a static
 * inline wrapper (rdma/fi_*.h; ours are in wx_fi_abi.h) that jumps through the ops tables of the objects these
 * return, so it needs no symbol. Never call fi_allocinfo() (an inline over the exported
 * fi_dupinfo): use wx_fi()->fi_dupinfo(NULL).
 *
 * $WXFER_LIBFABRIC overrides the library path.
 */
#ifndef WX_FABRIC_DL_H
#define WX_FABRIC_DL_H

#include <stddef.h>
#include <stdint.h>

#include "wx_fi_abi.h"

typedef struct wx_fi_api {
    int (*fi_getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *,
                      struct fi_info **);
    void (*fi_freeinfo)(struct fi_info *);
    struct fi_info *(*fi_dupinfo)(const struct fi_info *);
    int (*fi_fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
    const char *(*fi_strerror)(int);
    uint32_t (*fi_version)(void);
    char *(*fi_tostr)(const void *, enum fi_type); /* optional */
} wx_fi_api_t;

/* Load libfabric.so.1 (or $WXFER_LIBFABRIC) once. Returns the table, or NULL with the
 * reason in why. Thread-safe. */
const wx_fi_api_t *wx_fi(char *why, size_t why_len);
/* fi_strerror(-rc) when the library is loaded, else a generic text. rc may be negative. */
const char *wx_fi_strerror(int rc);
/* The installed libfabric's version and its providers for one-sided writes, each with
 * whether it offers FI_HMEM, as one JSON object in buf (wx_fabric_probe.c). 0 or -errno. */
int wx_fabric_probe_json(char *buf, size_t len);

#endif
