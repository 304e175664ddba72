/* wx_streamwait.h - a CUDA stream that waits on the device for a word in pinned host memory.
 *
 * The begin stamps' wait before a push's first in-place write (wxfer/runtime/tasks.py): the
 * engine stores the id of each fence task it finished into a pinned host word
 * (wx_engine_set_fence_word); the side stream waits for it with cuStreamWaitValue32 (the v2
 * stream memory operations, cyclic >=), so the host goes on launching instead of waiting.
 */
#ifndef WX_STREAMWAIT_H
#define WX_STREAMWAIT_H

#include <stddef.h>
#include <stdint.h>

/* The device address of pinned host memory at `host` (cuPointerGetAttribute's
 * DEVICE_POINTER) for `device`, when the driver has cuStreamWaitValue32_v2. 0, or a negative
 * errno with the reason in why (no driver, no such function, the memory not pinned). */
int wx_stream_wait_addr(int device, uint64_t host, uint64_t *dev_addr, char *why, size_t why_len);

/* Enqueue on `stream` (0: the per-thread default stream) a wait until the 32-bit word at
 * `dev_addr` (from wx_stream_wait_addr) is >= value, cyclically ((int32_t)(*w - value) >= 0).
 * 0 or a negative errno (recorded with wx_errf). */
int wx_stream_wait_u32(int device, uint64_t stream, uint64_t dev_addr, uint32_t value);

#endif
