/* NVRTC compilation of the embedded kernel sources, a disk cache of the cubins, and per-context
 * module loading.
 *
 * Cache files are written to a temporary name and renamed into place, so a reader sees either no
 * file or a whole one, and two processes compiling the same kernel at once both succeed (the last
 * rename wins with identical content). Each file carries its full key and a checksum of the
 * payload; a file that fails either check is rebuilt. A file is opened without blocking and read
 * only if it is a regular file of a plausible size, so a FIFO or a huge file planted at a cache
 * path costs nothing. A cache directory that cannot be created or written leaves the cubins
 * cached in this process's memory only. */
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "internal.h"

static const char cache_magic[16] = "OPGRAFT-CUBIN-2";
/* No cubin of ours comes near this; a larger file at a cache path is not one of ours. */
#define OG_CACHE_MAX_BYTES (64u << 20)

const og_source *opgraft__find_source(const char *path) {
  for (int i = 0; i < opgraft__num_sources; ++i)
    if (strcmp(opgraft__sources[i].path, path) == 0) return &opgraft__sources[i];
  return NULL;
}

void opgraft__opt(og_opts *o, const char *fmt, ...) {
  if (o->n >= OG_MAX_OPTS) {
    o->overflow = 1;
    return;
  }
  va_list ap;
  va_start(ap, fmt);
  const int w = vsnprintf(o->buf[o->n], OG_OPT_LEN, fmt, ap);
  va_end(ap);
  if (w < 0 || w >= OG_OPT_LEN) o->overflow = 1;
  o->ptr[o->n] = o->buf[o->n];
  o->n++;
}

int32_t opgraft__opts_check(const og_opts *o, const char *what) {
  if (o->overflow)
    return opgraft__fail(OPGRAFT_EINVAL, "%s: the kernel configuration does not fit in %d compile options of %d bytes",
                         what, OG_MAX_OPTS, OG_OPT_LEN);
  return OPGRAFT_OK;
}

int32_t opgraft__opts_join(const og_opts *o, char *buf, size_t len) {
  if (!buf || !len) return opgraft__fail(OPGRAFT_EINVAL, "no buffer");
  size_t k = 0;
  buf[0] = 0;
  for (int i = 0; i < o->n; ++i) {
    const int w = snprintf(buf + k, len - k, "%s%s", i ? " " : "", o->ptr[i]);
    if (w < 0 || (size_t)w >= len - k) return opgraft__fail(OPGRAFT_ERANGE, "buffer too small for the configuration");
    k += (size_t)w;
  }
  return OPGRAFT_OK;
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
  if (n < 0 || (size_t)n >= buf_len)
    return opgraft__fail(OPGRAFT_ERANGE, "the cache path is too long (%d bytes, at most %zu)", n,
                         buf_len ? buf_len - 1 : 0);
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
  if (st) {
    opgraft__warn_once("kernel cache unusable (%s): compiled kernels are kept in memory only", opgraft_last_error());
    return st;
  }
  og_hash h;
  opgraft__hash_init(&h);
  opgraft__hash_update(&h, key, strlen(key));
  char hex[33];
  opgraft__hash_hex(&h, hex);
  if (snprintf(path, len, "%s/%s.cubin", dir, hex) >= (int)len) {
    opgraft__warn_once("kernel cache directory %.200s: path too long; compiled kernels are kept in memory only", dir);
    return opgraft__fail(OPGRAFT_ERANGE, "cache path too long");
  }
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

int32_t opgraft_cache_check(char *dir_out, size_t dir_len) {
  char dir[1024];
  int32_t st = opgraft_cache_dir(dir, sizeof dir);
  if (dir_out && dir_len) opgraft__copy(dir_out, dir_len, st ? "" : dir);
  if (st) return st;
  if (strlen(dir) >= 900) return opgraft__fail(OPGRAFT_ERANGE, "the cache path is too long (%zu bytes, at most 899)", strlen(dir));
  struct stat sb;
  if (opgraft__stat(dir, &sb) == 0 && !S_ISDIR(sb.st_mode)) return opgraft__fail(OPGRAFT_EIO, "%s is not a directory", dir);
  if (mkdir_p(dir) != 0) return opgraft__fail(OPGRAFT_EIO, "cannot create %s: %s", dir, strerror(errno));
  char probe[1100];
  snprintf(probe, sizeof probe, "%s/.probe.%ld", dir, (long)getpid());
  const int fd = open(probe, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return opgraft__fail(OPGRAFT_EIO, "cannot write in %s: %s", dir, strerror(errno));
  const int bad = write_all(fd, "x", 1);
  close(fd);
  unlink(probe);
  if (bad) return opgraft__fail(OPGRAFT_EIO, "cannot write in %s: %s", dir, strerror(errno));
  return OPGRAFT_OK;
}

int32_t opgraft__cache_store(const char *key, const og_cubin *c) {
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
  const size_t loglen = c->log ? strlen(c->log) : 0;
  uint64_t sum = opgraft__fnv1a64(c->data, c->size) ^ (opgraft__fnv1a64(c->log ? c->log : "", loglen) * 31u);
  const uint64_t hdr[4] = {strlen(key), c->size, loglen, sum};
  int bad = write_all(fd, cache_magic, sizeof cache_magic) || write_all(fd, hdr, sizeof hdr) ||
            write_all(fd, key, hdr[0]) || write_all(fd, c->data, c->size) || write_all(fd, c->log ? c->log : "", loglen);
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

static int read_all(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n) {
    const ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

int32_t opgraft__cache_load(const char *key, og_cubin *out) {
  char path[1024];
  int32_t st = opgraft__cache_path(key, path, sizeof path);
  if (st) return st;
  /* O_NONBLOCK: opening a FIFO must not wait for a writer; the type is checked before any read. */
  const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return opgraft__fail(OPGRAFT_ENOTFOUND, "%s: not cached", path);
  char magic[sizeof cache_magic];
  uint64_t hdr[4];
  struct stat sb;
  const size_t klen = strlen(key);
  char *kbuf = NULL, *data = NULL, *log = NULL;
  st = OPGRAFT_EPARSE;
  if (opgraft__fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < (off_t)(sizeof magic + sizeof hdr) ||
      (uint64_t)sb.st_size > OG_CACHE_MAX_BYTES)
    goto done;
  if (read_all(fd, magic, sizeof magic) || memcmp(magic, cache_magic, sizeof magic) != 0 ||
      read_all(fd, hdr, sizeof hdr))
    goto done;
  if (hdr[0] != klen || hdr[1] == 0 || hdr[1] > OG_CACHE_MAX_BYTES || hdr[2] > OG_CACHE_MAX_BYTES ||
      sizeof magic + sizeof hdr + hdr[0] + hdr[1] + hdr[2] != (uint64_t)sb.st_size)
    goto done;
  if (!(kbuf = malloc(klen + 1)) || !(data = malloc(hdr[1])) || !(log = malloc(hdr[2] + 1))) {
    st = OPGRAFT_ENOMEM;
    goto done;
  }
  if (read_all(fd, kbuf, klen) || memcmp(kbuf, key, klen) != 0) goto done;
  if (read_all(fd, data, hdr[1]) || (hdr[2] && read_all(fd, log, hdr[2]))) goto done;
  log[hdr[2]] = 0;
  if ((opgraft__fnv1a64(data, hdr[1]) ^ (opgraft__fnv1a64(log, hdr[2]) * 31u)) != hdr[3]) goto done;
  out->data = data;
  out->size = hdr[1];
  out->log = log;
  data = log = NULL;
  st = OPGRAFT_OK;
done:
  close(fd);
  free(kbuf);
  free(data);
  free(log);
  if (st == OPGRAFT_EPARSE) {
    opgraft__warn_once("kernel cache file %s is corrupt, not a regular file or from another build: rebuilding it",
                       path);
    return opgraft__fail(st, "%s: corrupt cache file", path);
  }
  return st;
}

int32_t opgraft__compile(const char *path, const char *const *opts, int nopts, int32_t arch,
                         og_cubin *out) {
  memset(out, 0, sizeof *out);
  const og_source *src = opgraft__find_source(path);
  if (!src) return opgraft__fail(OPGRAFT_ENOTFOUND, "no embedded kernel source %s", path);
  const char *name = src->path;
  if (arch < 50 || arch > 1000) return opgraft__fail(OPGRAFT_EINVAL, "bad arch %d", arch);
  const og_nvrtc_api *nv = opgraft__nvrtc();
  if (!nv) return OPGRAFT_ENOLIB;

  /* Every other embedded file is offered as an in-memory header. */
  const char *hdr_text[64], *hdr_name[64];
  int nh = 0;
  for (int i = 0; i < opgraft__num_sources && nh < 64; ++i) {
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
  og_nvrtcResult r = nv->nvrtcCreateProgram(&prog, src->text, src->path, nh, hdr_text, hdr_name);
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
    /* The log leads with warnings and ptxas lines: quote it from the line of its first error. */
    const char *from = log ? strstr(log, ": error") : NULL;
    if (!from) from = log ? log : "";
    while (log && from > log && from[-1] != '\n') --from;
    st = opgraft__fail(OPGRAFT_ENVRTC, "NVRTC could not compile %s for sm_%d: %s\n%.700s", name, arch,
                       nv->nvrtcGetErrorString(cr), from);
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

/* Does the cubin of the source at path depend on the source s? The common headers and the
 * files of the source's own folder (its op's kernels) are all it can include. */
static int depends_on(const char *path, const og_source *s) {
  const char *slash = strrchr(path, '/');
  const size_t dl = slash ? (size_t)(slash - path) : 0;
  if (strncmp(s->path, "common/", 7) == 0) return 1;
  return dl && strncmp(s->path, path, dl) == 0 && s->path[dl] == '/';
}

void opgraft__hash_sources(const char *name, char hex[33]) {
  og_hash h;
  opgraft__hash_init(&h);
  for (int i = 0; i < opgraft__num_sources; ++i) {
    if (!depends_on(name, &opgraft__sources[i])) continue;
    opgraft__hash_update(&h, opgraft__sources[i].path, strlen(opgraft__sources[i].path) + 1);
    opgraft__hash_update(&h, opgraft__sources[i].text, strlen(opgraft__sources[i].text) + 1);
  }
  opgraft__hash_hex(&h, hex);
}

/* opgraft__hash_sources once per embedded source: the sources never change in a process, and
 * hashing an op's ~65 KB byte by byte cost ~125 us on an H100 host's CPU, on every call of an entry
 * point that looks its function up each time (bench/NOTES.md v48). */
enum { OG_HASHED_MAX = 64 };
static pthread_mutex_t src_hash_lock = PTHREAD_MUTEX_INITIALIZER;
static char src_hash[OG_HASHED_MAX][33];
static unsigned char src_hashed[OG_HASHED_MAX];

void opgraft__source_hash(const char *name, char hex[33]) {
  const og_source *s = opgraft__find_source(name);
  const long i = s ? (long)(s - opgraft__sources) : -1;
  if (i < 0 || i >= OG_HASHED_MAX) {
    opgraft__hash_sources(name, hex);
    return;
  }
  pthread_mutex_lock(&src_hash_lock);
  const int have = src_hashed[i];
  if (have) memcpy(hex, src_hash[i], 33);
  pthread_mutex_unlock(&src_hash_lock);
  if (have) return;
  opgraft__hash_sources(name, hex);
  pthread_mutex_lock(&src_hash_lock);
  memcpy(src_hash[i], hex, 33);
  src_hashed[i] = 1;
  pthread_mutex_unlock(&src_hash_lock);
}

/* The cache key names everything the cubin depends on. */
static char *make_key(const char *name, const char *const *opts, int nopts, int32_t arch) {
  char src_hex[33];
  opgraft__source_hash(name, src_hex);
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
  if (!(dst->data = malloc(src->size)) || (src->log && !(dst->log = strdup(src->log)))) {
    opgraft__cubin_free(dst);
    return opgraft__fail(OPGRAFT_ENOMEM, "out of memory");
  }
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
      if (st == OPGRAFT_OK) opgraft__cache_store(key, out); /* best effort */
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
