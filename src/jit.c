/* NVRTC compilation of the embedded kernel sources, a disk cache of the cubins, and per-context
 * module loading.
 *
 * Cache files are written to a temporary name and renamed into place, so a reader sees either no
 * file or a whole one, and two processes compiling the same kernel at once both succeed (the last
 * rename wins with identical content). Each file carries its full key and a checksum of the
 * payload; a file that fails either check is rebuilt. A cache directory that cannot be created or
 * written leaves the cubins cached in this process's memory only. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "internal.h"

static const char cache_magic[16] = "OPGRAFT-CUBIN-1";

const og_source *opgraft__find_source(const char *name) {
  for (int i = 0; i < opgraft__num_sources; ++i)
    if (strcmp(opgraft__sources[i].name, name) == 0) return &opgraft__sources[i];
  return NULL;
}

void opgraft__cubin_free(og_cubin *c) {
  if (!c) return;
  free(c->data);
  free(c->log);
  c->data = c->log = NULL;
  c->size = 0;
}

int32_t opgraft_cache_dir(char *buf, size_t buf_len) {
  const char *env = getenv("OPGRAFT_CACHE_DIR");
  int n;
  if (env && *env) {
    n = snprintf(buf, buf_len, "%s", env);
  } else {
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    if (xdg && *xdg)
      n = snprintf(buf, buf_len, "%s/opgraft", xdg);
    else if (home && *home)
      n = snprintf(buf, buf_len, "%s/.cache/opgraft", home);
    else
      return opgraft__fail(OPGRAFT_ENOTFOUND, "no cache directory: set OPGRAFT_CACHE_DIR");
  }
  if (n < 0 || (size_t)n >= buf_len) return opgraft__fail(OPGRAFT_ERANGE, "cache path too long");
  return OPGRAFT_OK;
}

static int mkdir_p(const char *path) {
  char tmp[1024];
  if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp) return -1;
  for (char *p = tmp + 1; *p; ++p) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
    *p = '/';
  }
  if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
  return 0;
}

int32_t opgraft__cache_path(const char *key, char *path, size_t len) {
  char dir[900];
  int32_t st = opgraft_cache_dir(dir, sizeof dir);
  if (st) return st;
  og_hash h;
  opgraft__hash_init(&h);
  opgraft__hash_update(&h, key, strlen(key));
  char hex[33];
  opgraft__hash_hex(&h, hex);
  if (snprintf(path, len, "%s/%s.cubin", dir, hex) >= (int)len)
    return opgraft__fail(OPGRAFT_ERANGE, "cache path too long");
  return OPGRAFT_OK;
}

static int write_all(int fd, const void *data, size_t n) {
  const char *p = data;
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

int32_t opgraft__cache_store(const char *key, const char *data, size_t size) {
  char path[1024], dir[900], tmp[1100];
  int32_t st = opgraft__cache_path(key, path, sizeof path);
  if (st) return st;
  opgraft_cache_dir(dir, sizeof dir);
  if (mkdir_p(dir) != 0) {
    opgraft__warn_once("cache directory %s cannot be created (%s): compiled kernels are kept in "
                       "memory only; set OPGRAFT_CACHE_DIR to a writable directory",
                       dir, strerror(errno));
    return opgraft__fail(OPGRAFT_EIO, "cannot create %s: %s", dir, strerror(errno));
  }
  static _Atomic unsigned counter;
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%u", path, (long)getpid(), ++counter);
  const int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    opgraft__warn_once("cache directory %s is not writable (%s): compiled kernels are kept in "
                       "memory only", dir, strerror(errno));
    return opgraft__fail(OPGRAFT_EIO, "cannot write %s: %s", tmp, strerror(errno));
  }
  const uint64_t hdr[3] = {strlen(key), size, opgraft__fnv1a64(data, size)};
  int bad = write_all(fd, cache_magic, sizeof cache_magic) || write_all(fd, hdr, sizeof hdr) ||
            write_all(fd, key, hdr[0]) || write_all(fd, data, size);
  const int err = errno;
  if (close(fd) != 0 && !bad) bad = 1;
  if (bad || rename(tmp, path) != 0) {
    const int e = bad ? err : errno;
    unlink(tmp);
    opgraft__warn_once("cannot write the kernel cache in %s (%s): compiled kernels are kept in "
                       "memory only", dir, strerror(e));
    return opgraft__fail(OPGRAFT_EIO, "cannot write %s: %s", path, strerror(e));
  }
  return OPGRAFT_OK;
}

int32_t opgraft__cache_load(const char *key, og_cubin *out) {
  char path[1024];
  int32_t st = opgraft__cache_path(key, path, sizeof path);
  if (st) return st;
  FILE *f = fopen(path, "rb");
  if (!f) return opgraft__fail(OPGRAFT_ENOTFOUND, "%s: not cached", path);
  char magic[sizeof cache_magic];
  uint64_t hdr[3];
  struct stat sb;
  const size_t klen = strlen(key);
  char *kbuf = NULL, *data = NULL;
  st = OPGRAFT_EPARSE;
  if (fstat(fileno(f), &sb) != 0 || fread(magic, 1, sizeof magic, f) != sizeof magic ||
      memcmp(magic, cache_magic, sizeof magic) != 0 || fread(hdr, sizeof hdr, 1, f) != 1)
    goto done;
  const uint64_t expect = sizeof magic + sizeof hdr + hdr[0] + hdr[1];
  if (hdr[0] != klen || hdr[1] == 0 || expect != (uint64_t)sb.st_size) goto done;
  if (!(kbuf = malloc(klen + 1)) || !(data = malloc(hdr[1]))) {
    st = OPGRAFT_ENOMEM;
    goto done;
  }
  if (fread(kbuf, 1, klen, f) != klen || memcmp(kbuf, key, klen) != 0) goto done;
  if (fread(data, 1, hdr[1], f) != hdr[1] || opgraft__fnv1a64(data, hdr[1]) != hdr[2]) goto done;
  out->data = data;
  out->size = hdr[1];
  out->log = NULL;
  data = NULL;
  st = OPGRAFT_OK;
done:
  fclose(f);
  free(kbuf);
  free(data);
  if (st == OPGRAFT_EPARSE) {
    opgraft__warn_once("kernel cache file %s is corrupt or from another build: rebuilding it", path);
    return opgraft__fail(st, "%s: corrupt cache file", path);
  }
  return st;
}

int32_t opgraft__compile(const char *name, const char *const *opts, int nopts, int32_t arch,
                         og_cubin *out) {
  memset(out, 0, sizeof *out);
  const og_source *src = opgraft__find_source(name);
  if (!src) return opgraft__fail(OPGRAFT_ENOTFOUND, "no embedded kernel source %s", name);
  if (arch < 50 || arch > 1000) return opgraft__fail(OPGRAFT_EINVAL, "bad arch %d", arch);
  const og_nvrtc_api *nv = opgraft__nvrtc();
  if (!nv) return OPGRAFT_ENOLIB;

  /* Every other embedded file is offered as an in-memory header. */
  const char *hdr_text[16], *hdr_name[16];
  int nh = 0;
  for (int i = 0; i < opgraft__num_sources && nh < 16; ++i) {
    if (&opgraft__sources[i] == src) continue;
    hdr_text[nh] = opgraft__sources[i].text;
    hdr_name[nh++] = opgraft__sources[i].name;
  }
  const char *all[64];
  char archopt[64];
  if (nopts > 60) return opgraft__fail(OPGRAFT_EINVAL, "too many compile options");
  snprintf(archopt, sizeof archopt, "--gpu-architecture=sm_%d", arch);
  int n = 0;
  all[n++] = archopt;
  all[n++] = "-std=c++17";
  all[n++] = "--ptxas-options=--verbose";
  for (int i = 0; i < nopts; ++i) all[n++] = opts[i];

  og_nvrtcProgram prog = NULL;
  og_nvrtcResult r = nv->nvrtcCreateProgram(&prog, src->text, src->name, nh, hdr_text, hdr_name);
  if (r != 0)
    return opgraft__fail(OPGRAFT_ENVRTC, "nvrtcCreateProgram: %s", nv->nvrtcGetErrorString(r));
  const og_nvrtcResult cr = nv->nvrtcCompileProgram(prog, n, all);
  size_t log_size = 0;
  nv->nvrtcGetProgramLogSize(prog, &log_size);
  char *log = malloc(log_size + 1);
  if (log) {
    log[0] = 0;
    if (log_size) nv->nvrtcGetProgramLog(prog, log);
    log[log_size] = 0;
  }
  int32_t st = OPGRAFT_OK;
  if (cr != 0) {
    st = opgraft__fail(OPGRAFT_ENVRTC, "NVRTC could not compile %s for sm_%d: %s\n%.700s", name,
                       arch, nv->nvrtcGetErrorString(cr), log ? log : "");
  } else {
    size_t size = 0;
    nv->nvrtcGetCUBINSize(prog, &size);
    char *data = size ? malloc(size) : NULL;
    if (!data) {
      st = opgraft__fail(size ? OPGRAFT_ENOMEM : OPGRAFT_ENVRTC, "NVRTC produced no cubin for sm_%d", arch);
    } else {
      nv->nvrtcGetCUBIN(prog, data);
      out->data = data;
      out->size = size;
      out->log = log;
      log = NULL;
    }
  }
  free(log);
  nv->nvrtcDestroyProgram(&prog);
  return st;
}

/* The cache key names everything the cubin depends on. */
static char *make_key(const char *name, const char *const *opts, int nopts, int32_t arch) {
  og_hash h;
  opgraft__hash_init(&h);
  for (int i = 0; i < opgraft__num_sources; ++i) {
    opgraft__hash_update(&h, opgraft__sources[i].name, strlen(opgraft__sources[i].name) + 1);
    opgraft__hash_update(&h, opgraft__sources[i].text, strlen(opgraft__sources[i].text) + 1);
  }
  char src_hex[33];
  opgraft__hash_hex(&h, src_hex);
  size_t len = 256 + strlen(name);
  for (int i = 0; i < nopts; ++i) len += strlen(opts[i]) + 1;
  char *key = malloc(len);
  if (!key) return NULL;
  int k = snprintf(key, len, "opgraft=%s src=%s:%s nvrtc=%d arch=sm_%d opts=", opgraft_version_string(),
                   name, src_hex, opgraft__nvrtc_version(), arch);
  for (int i = 0; i < nopts; ++i) k += snprintf(key + k, len - (size_t)k, "%s ", opts[i]);
  return key;
}

/* Process-wide caches: cubins by key, and loaded modules by (context, key). */
typedef struct og_mem_cubin {
  char *key;
  og_cubin cubin;
  struct og_mem_cubin *next;
} og_mem_cubin;

typedef struct og_module {
  char *key;
  og_CUcontext ctx;
  og_CUmodule mod;
  struct og_module *next;
} og_module;

static pthread_mutex_t jit_lock = PTHREAD_MUTEX_INITIALIZER;
static og_mem_cubin *mem_cubins;
static og_module *modules;

static int32_t dup_cubin(const og_cubin *src, og_cubin *dst) {
  memset(dst, 0, sizeof *dst);
  if (!(dst->data = malloc(src->size))) return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  memcpy(dst->data, src->data, src->size);
  dst->size = src->size;
  return OPGRAFT_OK;
}

int32_t opgraft__cubin_cached(const char *name, const char *const *opts, int nopts, int32_t arch,
                              og_cubin *out) {
  if (!opgraft__nvrtc()) return OPGRAFT_ENOLIB;
  char *key = make_key(name, opts, nopts, arch);
  if (!key) return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  int32_t st = OPGRAFT_ENOTFOUND;
  pthread_mutex_lock(&jit_lock);
  for (og_mem_cubin *m = mem_cubins; m; m = m->next)
    if (strcmp(m->key, key) == 0) {
      st = dup_cubin(&m->cubin, out);
      break;
    }
  pthread_mutex_unlock(&jit_lock);
  if (st == OPGRAFT_ENOTFOUND) {
    st = opgraft__cache_load(key, out);
    if (st != OPGRAFT_OK && st != OPGRAFT_ENOMEM) {
      st = opgraft__compile(name, opts, nopts, arch, out);
      if (st == OPGRAFT_OK) opgraft__cache_store(key, out->data, out->size); /* best effort */
    }
    og_mem_cubin *m = st == OPGRAFT_OK ? calloc(1, sizeof *m) : NULL;
    if (m && dup_cubin(out, &m->cubin) == OPGRAFT_OK) {
      m->key = key;
      key = NULL;
      pthread_mutex_lock(&jit_lock);
      m->next = mem_cubins;
      mem_cubins = m;
      pthread_mutex_unlock(&jit_lock);
    } else {
      free(m);
    }
  }
  free(key);
  return st;
}

int32_t opgraft__get_functions(const char *name, const char *const *opts, int nopts, int32_t arch,
                               const char *const *fn_names, int nfn, og_CUfunction *fns) {
  const og_cuda_api *cu = opgraft__cuda();
  if (!cu) return OPGRAFT_ENOLIB;
  og_CUcontext ctx = NULL;
  int32_t st = opgraft__cu_check(cu->cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (st) return st;
  if (!ctx) return opgraft__fail(OPGRAFT_ENODEV, "no CUDA context is current on this thread");
  if (!opgraft__nvrtc()) return OPGRAFT_ENOLIB;
  char *key = make_key(name, opts, nopts, arch);
  if (!key) return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");

  og_CUmodule mod = NULL;
  pthread_mutex_lock(&jit_lock);
  for (og_module *m = modules; m; m = m->next)
    if (m->ctx == ctx && strcmp(m->key, key) == 0) mod = m->mod;
  pthread_mutex_unlock(&jit_lock);

  if (!mod) {
    og_cubin cub;
    st = opgraft__cubin_cached(name, opts, nopts, arch, &cub);
    if (st == OPGRAFT_OK) {
      st = opgraft__cu_check(cu->cuModuleLoadData(&mod, cub.data), "cuModuleLoadData");
      opgraft__cubin_free(&cub);
    }
    og_module *m = st == OPGRAFT_OK ? calloc(1, sizeof *m) : NULL;
    if (st == OPGRAFT_OK && !m) st = opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
    if (m) {
      m->key = key;
      key = NULL;
      m->ctx = ctx;
      m->mod = mod;
      pthread_mutex_lock(&jit_lock);
      m->next = modules;
      modules = m;
      pthread_mutex_unlock(&jit_lock);
    }
  }
  free(key);
  if (st) return st;
  for (int i = 0; i < nfn; ++i) {
    char what[128];
    snprintf(what, sizeof what, "cuModuleGetFunction(%s)", fn_names[i]);
    if ((st = opgraft__cu_check(cu->cuModuleGetFunction(&fns[i], mod, fn_names[i]), what))) return st;
  }
  return OPGRAFT_OK;
}

/* ptxas --verbose prints, per entry function:
 *   ptxas info    : Compiling entry function 'NAME' for 'sm_90'
 *   ptxas info    : Function properties for NAME
 *   ptxas         .     S bytes stack frame, SS bytes spill stores, SL bytes spill loads
 *   ptxas info    : Used R registers, ... B bytes smem, ... */
int32_t opgraft__parse_resources(const char *log, const char *fn_name, opgraft_kernel_info *info) {
  memset(info, 0, sizeof *info);
  opgraft__copy(info->name, sizeof info->name, fn_name);
  char pat[160];
  snprintf(pat, sizeof pat, "Compiling entry function '%s'", fn_name);
  const char *p = log ? strstr(log, pat) : NULL;
  if (!p) return opgraft__fail(OPGRAFT_ENOTFOUND, "no resource report for %s", fn_name);
  const char *next = strstr(p + 1, "Compiling entry function");
  const char *props = strstr(p, "bytes stack frame");
  const char *used = strstr(p, "Used ");
  if (!props || !used || (next && (props > next || used > next)))
    return opgraft__fail(OPGRAFT_EPARSE, "unreadable resource report for %s", fn_name);
  const char *line = props;
  while (line > p && line[-1] != '\n') --line;
  while (line < props && (*line < '0' || *line > '9')) ++line; /* skip the "ptxas ." prefix */
  if (sscanf(line, " %d bytes stack frame, %d bytes spill stores, %d bytes spill loads",
             &info->stack_bytes, &info->spill_store_bytes, &info->spill_load_bytes) != 3)
    return opgraft__fail(OPGRAFT_EPARSE, "unreadable stack/spill line for %s", fn_name);
  if (sscanf(used, "Used %d registers", &info->registers) != 1)
    return opgraft__fail(OPGRAFT_EPARSE, "unreadable register count for %s", fn_name);
  const char *eol = strchr(used, '\n');
  const char *smem = strstr(used, "bytes smem");
  if (smem && (!eol || smem < eol)) {
    const char *q = smem;
    while (q > used && q[-1] == ' ') --q;
    while (q > used && q[-1] >= '0' && q[-1] <= '9') --q;
    info->shared_bytes = atoi(q);
  }
  return OPGRAFT_OK;
}
