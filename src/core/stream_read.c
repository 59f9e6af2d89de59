/* The streaming-read kernel behind the measured read ceiling (kernels/common/stream_read.cu). */
#include <stdint.h>

#include "internal.h"

enum { OG_ATTR_SM_COUNT = 16 }; /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */

int32_t opgraft_stream_read(const void *data, size_t bytes, void *sink, int32_t grid, void *stream) {
  if (!data || !sink || bytes == 0 || bytes % 16 || ((uintptr_t)data & 15u))
    return opgraft__fail(OPGRAFT_EINVAL, "opgraft_stream_read: data must be 16-byte aligned and "
                                         "bytes a non-zero multiple of 16");
  if (grid < 0) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_stream_read: negative grid");
  const og_cuda_api *cu = opgraft__cuda();
  if (!cu) return OPGRAFT_ENOLIB;
  int32_t arch = 0;
  int32_t st = opgraft__current_device(NULL, &arch, NULL, 0);
  if (st) return st;
  if (grid == 0) {
    og_CUdevice dev = 0;
    int sms = 0;
    if ((st = opgraft__cu_check(cu->cuCtxGetDevice(&dev), "cuCtxGetDevice"))) return st;
    if ((st = opgraft__cu_check(cu->cuDeviceGetAttribute(&sms, OG_ATTR_SM_COUNT, dev), "cuDeviceGetAttribute")))
      return st;
    grid = 4 * sms;
  }
  og_CUfunction fn;
  const char *name = "stream_read_u128";
  if ((st = opgraft__get_functions("common/stream_read.cu", NULL, 0, arch, &name, 1, &fn))) return st;
  unsigned long long n = bytes / 16;
  void *params[] = {(void *)&data, &n, &sink};
  return opgraft__cu_check(cu->cuLaunchKernel(fn, (unsigned)grid, 1, 1, 512, 1, 1, 0, (og_CUstream)stream, params, NULL),
                           "launch stream_read_u128");
}
