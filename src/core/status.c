/* Status codes, per-thread error messages and logging. */
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

static _Thread_local char tl_error[1024];

uint32_t opgraft_version(void) { return OPGRAFT_VERSION_HEX; }

const char *opgraft_version_string(void) {
#define OG_STR2(x) #x
#define OG_STR(x) OG_STR2(x)
  return OG_STR(OPGRAFT_VERSION_MAJOR) "." OG_STR(OPGRAFT_VERSION_MINOR) "." OG_STR(
      OPGRAFT_VERSION_PATCH);
}

const char *opgraft_strerror(int32_t status) {
  switch (status) {
#define OPGRAFT_XX(name, value, msg)                                                               \
  case OPGRAFT_##name:                                                                             \
    return msg;
    OPGRAFT_STATUS_MAP(OPGRAFT_XX)
#undef OPGRAFT_XX
  }
  return "unknown status";
}

const char *opgraft_status_name(int32_t status) {
  switch (status) {
#define OPGRAFT_XX(name, value, msg)                                                               \
  case OPGRAFT_##name:                                                                             \
    return "OPGRAFT_" #name;
    OPGRAFT_STATUS_MAP(OPGRAFT_XX)
#undef OPGRAFT_XX
  }
  return "OPGRAFT_UNKNOWN";
}

const char *opgraft_last_error(void) { return tl_error; }

char *opgraft__copy(char *dst, size_t len, const char *src) {
  if (dst && len) snprintf(dst, len, "%s", src ? src : "");
  return dst;
}

int32_t opgraft__fail(int32_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tl_error, sizeof tl_error, fmt, ap);
  va_end(ap);
  return status;
}

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static opgraft_log_fn log_fn;
static void *log_ud;

void opgraft_set_log_callback(opgraft_log_fn fn, void *user_data) {
  pthread_mutex_lock(&log_lock);
  log_fn = fn;
  log_ud = user_data;
  pthread_mutex_unlock(&log_lock);
}

static void emit(int32_t level, const char *msg) {
  pthread_mutex_lock(&log_lock);
  opgraft_log_fn fn = log_fn;
  void *ud = log_ud;
  pthread_mutex_unlock(&log_lock);
  if (fn) {
    fn(level, msg, ud);
    return;
  }
  if (level < OPGRAFT_LOG_WARNING && opgraft__env_switch("OPGRAFT_DEBUG") != 1) return;
  fprintf(stderr, "opgraft: %s%s\n", level >= OPGRAFT_LOG_WARNING ? "warning: " : "", msg);
}

int opgraft__env_switch(const char *name) {
  static const char *const off[] = {"0", "false", "no", "off"};
  const char *v = getenv(name);
  if (!v) return -1;
  while (isspace((unsigned char)*v)) ++v;
  size_t n = strlen(v);
  while (n && isspace((unsigned char)v[n - 1])) --n;
  if (!n) return -1;
  for (size_t i = 0; i < sizeof off / sizeof *off; ++i)
    if (strlen(off[i]) == n && strncasecmp(v, off[i], n) == 0) return 0;
  return 1;
}

void opgraft__log(int32_t level, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  emit(level, buf);
}

/* A small set of message hashes already warned about; a full set just warns again. */
#define OG_WARNED_MAX 256
static uint64_t warned[OG_WARNED_MAX];
static int nwarned;

void opgraft__warn_once(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  const uint64_t h = opgraft__fnv1a64(buf, strlen(buf));
  pthread_mutex_lock(&log_lock);
  int seen = 0;
  for (int i = 0; i < nwarned; ++i) seen |= warned[i] == h;
  if (!seen && nwarned < OG_WARNED_MAX) warned[nwarned++] = h;
  pthread_mutex_unlock(&log_lock);
  if (!seen) emit(OPGRAFT_LOG_WARNING, buf);
}
