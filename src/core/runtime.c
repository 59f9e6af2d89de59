/* libcuda and libnvrtc, found with dlopen at first use. No CUDA header is needed to build this:
 * the few driver and NVRTC entry points we call are declared in internal.h with their documented
 * C signatures. */
#define _GNU_SOURCE /* dlinfo and RTLD_DI_LINKMAP: which file a handle loaded */
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* What a loaded library is, for a message about one that is not the library we wanted: its file
 * and its SONAME (from its dynamic section), e.g. "/lib/x86_64-linux-gnu/libm.so.6 (libm.so.6)". */
static void describe_lib(void *h, const char *where, char *out, size_t len) {
  struct link_map *lm = NULL;
  const char *soname = NULL;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_ld) {
    ElfW(Addr) strtab = 0;
    ElfW(Xword) name = 0;
    int have_name = 0;
    for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; ++d) {
      if (d->d_tag == DT_STRTAB) strtab = d->d_un.d_ptr;
      if (d->d_tag == DT_SONAME) name = d->d_un.d_val, have_name = 1;
    }
    /* Most targets relocate the dynamic section's addresses at load; the others keep offsets. */
    if (strtab && strtab < lm->l_addr) strtab += lm->l_addr;
    if (strtab && have_name) soname = (const char *)(strtab + name);
  }
  if (soname && *soname)
    snprintf(out, len, "%.300s (%.100s)", where, soname);
  else
    snprintf(out, len, "%.400s", where);
}

static const char *const cuda_names[] = {
    "cuInit",          "cuDriverGetVersion",  "cuCtxGetCurrent", "cuCtxGetDevice",
    "cuDeviceGetAttribute", "cuDeviceGetName", "cuModuleLoadData", "cuModuleGetFunction",
    "cuLaunchKernel",  "cuGetErrorString", "cuLaunchKernelEx", "cuMemsetD32Async",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor", "cuFuncSetAttribute", "cuOccupancyMaxActiveClusters",
};

/* A library that loads but has no cuInit is not a CUDA driver at all, whatever it is called. */
static void *open_libcuda(const char *path, const char *setting) {
  void *h = open_lib(path, cuda_path, sizeof cuda_path);
  if (!h) {
    if (setting) opgraft__warn_once("%s=%s could not be loaded: %s; using the system's libcuda.so.1", setting, path, dlerror());
    return NULL;
  }
  if (dlsym(h, "cuInit") && dlsym(h, "cuDriverGetVersion")) return h;
  char is[512];
  describe_lib(h, cuda_path, is, sizeof is);
  if (setting)
    opgraft__warn_once("%s=%s is %s, not the CUDA driver library (it has no cuInit); using the system's "
                       "libcuda.so.1", setting, path, is);
  else
    snprintf(cuda_err, sizeof cuda_err, "%.200s is not the CUDA driver library (it has no cuInit)", is);
  dlclose(h);
  cuda_path[0] = 0;
  return NULL;
}

static void load_cuda_locked(void) {
  if (cuda_tried) return;
  cuda_tried = 1;
  const char *env = getenv("OPGRAFT_LIBCUDA");
  void *h = env && *env ? open_libcuda(env, "OPGRAFT_LIBCUDA") : NULL;
  const char *system[] = {"libcuda.so.1", "libcuda.so"};
  for (size_t i = 0; i < sizeof system / sizeof *system && !h; ++i) h = open_libcuda(system[i], NULL);
  if (!h) {
    if (!cuda_err[0])
      snprintf(cuda_err, sizeof cuda_err, "libcuda not found (%s%s): is the NVIDIA driver installed?",
               env && *env ? "$OPGRAFT_LIBCUDA is not usable, tried " : "", "libcuda.so.1");
    return;
  }
  _Static_assert(sizeof cuda_api == sizeof cuda_names / sizeof *cuda_names * sizeof(void *),
                 "cuda_names must list every slot of og_cuda_api");
  /* A CUDA driver without one of the newer entry points is older than the kernels need. */
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

/* Opens path as libnvrtc and binds its API: 1, or 0 with the handle closed. A file that loads
 * but is not libnvrtc is named with what it is: in a warning when a setting named it, else in
 * the error kept for the case that nothing else is found. */
static int try_nvrtc(const char *path, const char *setting) {
  void *h = open_lib(path, nvrtc_path, sizeof nvrtc_path);
  if (!h) {
    if (setting) opgraft__warn_once("%s=%s could not be loaded: %s; searching elsewhere", setting, path, dlerror());
    return 0;
  }
  const char *missing = bind(h, (void **)&nvrtc_api, nvrtc_names, sizeof nvrtc_names / sizeof *nvrtc_names);
  if (!missing) return 1;
  char is[512];
  describe_lib(h, nvrtc_path, is, sizeof is);
  if (setting)
    opgraft__warn_once("%s=%s is %s, not libnvrtc (it has no %s); searching elsewhere", setting, path, is, missing);
  else
    snprintf(nvrtc_err, sizeof nvrtc_err, "%.200s is not libnvrtc (it has no %s)", is, missing);
  memset(&nvrtc_api, 0, sizeof nvrtc_api);
  dlclose(h);
  nvrtc_path[0] = 0;
  return 0;
}

static int try_dir(const char *dir) {
  char path[1024];
  for (size_t i = 0; i < sizeof nvrtc_files / sizeof *nvrtc_files; ++i) {
    snprintf(path, sizeof path, "%s/%s", dir, nvrtc_files[i]);
    if (access(path, F_OK) == 0 && try_nvrtc(path, NULL)) return 1;
  }
  return 0;
}

static void load_nvrtc_locked(void) {
  if (nvrtc_tried) return;
  nvrtc_tried = 1;
  nvrtc_err[0] = 0;
  const char *env = getenv("OPGRAFT_NVRTC");
  int ok = env && *env && try_nvrtc(env, "OPGRAFT_NVRTC");
  for (int i = 0; i < nextra && !ok; ++i) ok = try_dir(extra_dirs[i]);
  const char *homes[] = {"CUDA_HOME", "CUDA_PATH"};
  for (size_t i = 0; i < 2 && !ok; ++i) {
    const char *v = getenv(homes[i]);
    if (v && *v) {
      char dir[900];
      snprintf(dir, sizeof dir, "%s/lib64", v);
      ok = try_dir(dir);
    }
  }
  if (!ok) ok = try_dir("/usr/local/cuda/lib64");
  for (size_t i = 0; i < sizeof nvrtc_files / sizeof *nvrtc_files && !ok; ++i) ok = try_nvrtc(nvrtc_files[i], NULL);
  if (!ok) {
    if (!nvrtc_err[0])
      snprintf(nvrtc_err, sizeof nvrtc_err,
               "libnvrtc not found: install the CUDA toolkit or pip's nvidia-cuda-nvrtc, or set "
               "OPGRAFT_NVRTC to the library file");
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

int32_t opgraft__current_ctx(const og_cuda_api **cu, og_CUcontext *ctx) {
  if (!(*cu = opgraft__cuda())) return OPGRAFT_ENOLIB;
  int32_t st = opgraft__cu_check((*cu)->cuCtxGetCurrent(ctx), "cuCtxGetCurrent");
  if (st) return st;
  if (!*ctx)
    return opgraft__fail(OPGRAFT_ENODEV, "no CUDA context is current on this thread (initialise "
                                         "the device first, e.g. torch.cuda.init())");
  return OPGRAFT_OK;
}

int32_t opgraft__plan_check(og_CUcontext ctx, const og_plan_head *plan, const char *what) {
  if (ctx == plan->ctx && plan->tune_gen == opgraft__tune_generation()) return OPGRAFT_OK;
  return opgraft__fail(OPGRAFT_ESTALE, "%s made under %s: make a new one", what,
                       ctx != plan->ctx ? "another CUDA context" : "other tunables");
}

/* Device attributes from the CUDA driver API documentation. */
enum { OG_ATTR_CC_MAJOR = 75, OG_ATTR_CC_MINOR = 76 };

int32_t opgraft__current_device(og_CUcontext *ctx, int32_t *arch, char *name, size_t name_len) {
  const og_cuda_api *cu;
  og_CUcontext c = NULL;
  int32_t st = opgraft__current_ctx(&cu, &c);
  if (st) return st;
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
