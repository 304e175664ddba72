/* wx_dlpack.h - the DLPack ABI (data layout of the DLPack 0.x and 1.x exchange structs),
 * declared here from the specification so that no third-party header is needed. */
#ifndef WX_DLPACK_H
#define WX_DLPACK_H

#include <stdint.h>

enum { WX_DL_CPU = 1, WX_DL_CUDA = 2, WX_DL_CUDA_HOST = 3, WX_DL_CUDA_MANAGED = 13 };
enum {
    WX_DL_INT = 0,
    WX_DL_UINT = 1,
    WX_DL_FLOAT = 2,
    WX_DL_BFLOAT = 4,
    WX_DL_BOOL = 6,
    WX_DL_FLOAT8_E4M3FN = 10
};

#define WX_DL_FLAG_READ_ONLY (1ull << 0)

typedef struct {
    int32_t device_type;
    int32_t device_id;
} wx_dl_device_t;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} wx_dl_dtype_t;

typedef struct {
    void *data;
    wx_dl_device_t device;
    int32_t ndim;
    wx_dl_dtype_t dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} wx_dl_tensor_t;

typedef struct wx_dl_managed {
    wx_dl_tensor_t dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct wx_dl_managed *self);
} wx_dl_managed_t;

typedef struct {
    uint32_t major;
    uint32_t minor;
} wx_dl_version_t;

typedef struct wx_dl_managed_v1 {
    wx_dl_version_t version;
    void *manager_ctx;
    void (*deleter)(struct wx_dl_managed_v1 *self);
    uint64_t flags;
    wx_dl_tensor_t dl_tensor;
} wx_dl_managed_v1_t;

#endif
