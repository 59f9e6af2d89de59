/* libcuda and libnvrtc, found with dlopen at first use. No CUDA header is needed to build this:
 * the few driver and NVRTC entry points we call are declared in internal.h with their documented
 * C signatures. */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define OG_MAX_DIRS 16

static pthread_mutex_t rt_lock = PTHREAD_MUTEX_INITIALIZER;
static char *extra_dirs[OG_MAX_DIRS];
static int nextra;

static int cuda_tried, nvrtc_tried;
static og_cuda_api cuda_api;
static og_nvrtc_api nvrtc_api;
static int cuda_ok, nvrtc_ok;
static char cuda_path[512], nvrtc_path[512];
static char cuda_err[256], nvrtc_err[256];
static int32_t nvrtc_ver;

int32_t opgraft_add_library_dir(const char *dir) {
  if (!dir || !*dir) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_add_library_dir: empty path");
  pthread_mutex_lock(&rt_lock);
  int32_t st = OPGRAFT_OK;
  int dup = 0;
  for (int i = 0; i < nextra; ++i) dup |= strcmp(extra_dirs[i], dir) == 0;
  if (!dup) {
    if (nextra == OG_MAX_DIRS) {
      st = opgraft__fail(OPGRAFT_ERANGE, "at most %d library directories", OG_MAX_DIRS);
    } else if (!(extra_dirs[nextra] = strdup(dir))) {
      st = opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
    } else {
      ++nextra;
      nvrtc_tried = nvrtc_ok ? nvrtc_tried : 0; /* a new place to look: try again if not found */
    }
  }
  pthread_mutex_unlock(&rt_lock);
  return st;
}

/* Resolves every symbol of a table; returns the first missing name or NULL. */
static const char *bind(void *lib, void **slots, const char *const *names, int n) {
  for (int i = 0; i < n; ++i) {
    slots[i] = dlsym(lib, names[i]);
    if (!slots[i]) return names[i];
  }
  return NULL;
}

static void *open_lib(const char *path, char *where, size_t where_len) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h) {
    /* Report the file that was actually loaded. */
    struct link_map *lm = NULL;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0])
      opgraft__copy(where, where_len, lm->l_name);
    else
      opgraft__copy(where, where_len, path);
  }
  return h;
}

static const char *const cuda_names[] = {
    "cuInit",          "cuDriverGetVersion",  "cuCtxGetCurrent", "cuCtxGetDevice",
    "cuDeviceGetAttribute", "cuDeviceGetName", "cuModuleLoadData", "cuModuleGetFunction",
    "cuLaunchKernel",  "cuGetErrorString", "cuLaunchKernelEx", "cuMemsetD32Async",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor", "cuFuncSetAttribute",
};

static void load_cuda_locked(void) {
  if (cuda_tried) return;
  cuda_tried = 1;
  const char *env = getenv("OPGRAFT_LIBCUDA");
  const char *cands[] = {env && *env ? env : NULL, "libcuda.so.1", "libcuda.so"};
  void *h = NULL;
  for (size_t i = 0; i < sizeof cands / sizeof *cands && !h; ++i)
    if (cands[i]) h = open_lib(cands[i], cuda_path, sizeof cuda_path);
  if (!h) {
    snprintf(cuda_err, sizeof cuda_err, "libcuda not found (%s%s): is the NVIDIA driver installed?",
             env && *env ? "tried $OPGRAFT_LIBCUDA, " : "", "libcuda.so.1");
    return;
  }
  _Static_assert(sizeof cuda_api == sizeof cuda_names / sizeof *cuda_names * sizeof(void *),
                 "cuda_names must list every slot of og_cuda_api");
  const char *missing = bind(h, (void **)&cuda_api, cuda_names, sizeof cuda_names / sizeof *cuda_names);
  if (missing) {
    snprintf(cuda_err, sizeof cuda_err, "%.160s lacks %s: driver too old", cuda_path, missing);
    cuda_path[0] = 0;
    return;
  }
  og_CUresult r = cuda_api.cuInit(0);
  if (r != 0) {
    snprintf(cuda_err, sizeof cuda_err, "cuInit failed with CUDA error %d (no usable GPU?)", r);
    return;
  }
  cuda_ok = 1;
}

static const char *const nvrtc_names[] = {
    "nvrtcVersion",       "nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog", "nvrtcGetCUBINSize",  "nvrtcGetCUBIN",       "nvrtcDestroyProgram",
    "nvrtcGetErrorString",
};

/* Library file names to try inside a directory, newest major first. */
static const char *const nvrtc_files[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};

static void *try_dir(const char *dir) {
  char path[1024];
  for (size_t i = 0; i < sizeof nvrtc_files / sizeof *nvrtc_files; ++i) {
    snprintf(path, sizeof path, "%s/%s", dir, nvrtc_files[i]);
    void *h = open_lib(path, nvrtc_path, sizeof nvrtc_path);
    if (h) return h;
  }
  return NULL;
}

static void load_nvrtc_locked(void) {
  if (nvrtc_tried) return;
  nvrtc_tried = 1;
  void *h = NULL;
  const char *env = getenv("OPGRAFT_NVRTC");
  if (env && *env) {
    h = open_lib(env, nvrtc_path, sizeof nvrtc_path);
    if (!h) opgraft__warn_once("OPGRAFT_NVRTC=%s could not be loaded: %s; searching elsewhere", env, dlerror());
  }
  for (int i = 0; i < nextra && !h; ++i) h = try_dir(extra_dirs[i]);
  const char *homes[] = {"CUDA_HOME", "CUDA_PATH"};
  for (size_t i = 0; i < 2 && !h; ++i) {
    const char *v = getenv(homes[i]);
    if (v && *v) {
      char dir[900];
      snprintf(dir, sizeof dir, "%s/lib64", v);
      h = try_dir(dir);
    }
  }
  if (!h) h = try_dir("/usr/local/cuda/lib64");
  for (size_t i = 0; i < sizeof nvrtc_files / sizeof *nvrtc_files && !h; ++i)
    h = open_lib(nvrtc_files[i], nvrtc_path, sizeof nvrtc_path);
  if (!h) {
    snprintf(nvrtc_err, sizeof nvrtc_err,
             "libnvrtc not found: install the CUDA toolkit or pip's nvidia-cuda-nvrtc, or set "
             "OPGRAFT_NVRTC to the library file");
    nvrtc_path[0] = 0;
    return;
  }
  const char *missing = bind(h, (void **)&nvrtc_api, nvrtc_names, sizeof nvrtc_names / sizeof *nvrtc_names);
  if (missing) {
    snprintf(nvrtc_err, sizeof nvrtc_err, "%.200s lacks %s", nvrtc_path, missing);
    nvrtc_path[0] = 0;
    return;
  }
  int major = 0, minor = 0;
  nvrtc_api.nvrtcVersion(&major, &minor);
  nvrtc_ver = major * 1000 + minor * 10;
  nvrtc_ok = 1;
}

const og_cuda_api *opgraft__cuda(void) {
  pthread_mutex_lock(&rt_lock);
  load_cuda_locked();
  const int ok = cuda_ok;
  pthread_mutex_unlock(&rt_lock);
  if (!ok) {
    opgraft__fail(OPGRAFT_ENOLIB, "%s", cuda_err);
    return NULL;
  }
  return &cuda_api;
}

const og_nvrtc_api *opgraft__nvrtc(void) {
  pthread_mutex_lock(&rt_lock);
  load_nvrtc_locked();
  const int ok = nvrtc_ok;
  pthread_mutex_unlock(&rt_lock);
  if (!ok) {
    opgraft__fail(OPGRAFT_ENOLIB, "%s", nvrtc_err);
    return NULL;
  }
  return &nvrtc_api;
}

int32_t opgraft__nvrtc_version(void) { return opgraft__nvrtc() ? nvrtc_ver : 0; }

int32_t opgraft_runtime_query(opgraft_runtime_info *info) {
  if (!info) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_runtime_query: info is NULL");
  memset(info, 0, sizeof *info);
  const og_cuda_api *cu = opgraft__cuda();
  const og_nvrtc_api *nv = opgraft__nvrtc();
  pthread_mutex_lock(&rt_lock);
  if (nv) {
    opgraft__copy(info->nvrtc_path, sizeof info->nvrtc_path, nvrtc_path);
    info->nvrtc_version = nvrtc_ver;
  } else {
    opgraft__copy(info->nvrtc_error, sizeof info->nvrtc_error, nvrtc_err);
  }
  if (cu) {
    opgraft__copy(info->libcuda_path, sizeof info->libcuda_path, cuda_path);
    int v = 0;
    cu->cuDriverGetVersion(&v);
    info->driver_version = v;
  } else {
    opgraft__copy(info->libcuda_error, sizeof info->libcuda_error, cuda_err);
  }
  pthread_mutex_unlock(&rt_lock);
  return OPGRAFT_OK;
}

int32_t opgraft__cu_check(og_CUresult r, const char *what) {
  if (r == 0) return OPGRAFT_OK;
  const char *s = NULL;
  if (cuda_ok) cuda_api.cuGetErrorString(r, &s);
  return opgraft__fail(OPGRAFT_ECUDA, "%s: CUDA error %d (%s)", what, r, s ? s : "unknown");
}

/* Device attributes from the CUDA driver API documentation. */
enum { OG_ATTR_CC_MAJOR = 75, OG_ATTR_CC_MINOR = 76 };

int32_t opgraft__current_device(og_CUcontext *ctx, int32_t *arch, char *name, size_t name_len) {
  const og_cuda_api *cu = opgraft__cuda();
  if (!cu) return OPGRAFT_ENOLIB;
  og_CUcontext c = NULL;
  int32_t st = opgraft__cu_check(cu->cuCtxGetCurrent(&c), "cuCtxGetCurrent");
  if (st) return st;
  if (!c)
    return opgraft__fail(OPGRAFT_ENODEV, "no CUDA context is current on this thread (initialise "
                                         "the device first, e.g. torch.cuda.init())");
  og_CUdevice dev = 0;
  if ((st = opgraft__cu_check(cu->cuCtxGetDevice(&dev), "cuCtxGetDevice"))) return st;
  int major = 0, minor = 0;
  if ((st = opgraft__cu_check(cu->cuDeviceGetAttribute(&major, OG_ATTR_CC_MAJOR, dev), "cuDeviceGetAttribute")))
    return st;
  if ((st = opgraft__cu_check(cu->cuDeviceGetAttribute(&minor, OG_ATTR_CC_MINOR, dev), "cuDeviceGetAttribute")))
    return st;
  if (ctx) *ctx = c;
  if (arch) *arch = major * 10 + minor;
  if (name && name_len) {
    char buf[256] = {0};
    if ((st = opgraft__cu_check(cu->cuDeviceGetName(buf, (int)sizeof buf - 1, dev), "cuDeviceGetName")))
      return st;
    opgraft__copy(name, name_len, buf);
  }
  return OPGRAFT_OK;
}
