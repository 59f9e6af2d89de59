/* Helpers shared by the C unit tests: temporary directories, captured log messages, environment
 * clean-up and child processes. */
#ifndef OG_TEST_H
#define OG_TEST_H

/* cmocka.h needs these first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"

extern char **environ;

/* ---- temporary directories ---- */

/* Creates a fresh directory under $TMPDIR (or /tmp) and writes its path to out. */
static inline void og_tmpdir(char *out, size_t len) {
  const char *base = getenv("TMPDIR");
  if (!base || !*base) base = "/tmp";
  snprintf(out, len, "%s/opgraft-test-XXXXXX", base);
  if (!mkdtemp(out)) fail_msg("mkdtemp(%s): %s", out, strerror(errno));
}

static inline int og_rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)ftw;
  return flag == FTW_DP ? rmdir(path) : unlink(path);
}

/* Removes a directory tree (the tests' own temporary directories only). */
static inline void og_rm_rf(const char *path) {
  if (path && path[0]) nftw(path, og_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Writes text to path, replacing the file. */
static inline void og_write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  if (!f) fail_msg("cannot write %s: %s", path, strerror(errno));
  const size_t n = strlen(text);
  const size_t w = fwrite(text, 1, n, f);
  if (fclose(f) != 0 || w != n) fail_msg("short write to %s", path);
}

/* ---- captured log messages ---- */

typedef struct og_log_entry {
  int32_t level;
  char message[1024];
} og_log_entry;

#define OG_LOG_MAX 512
static og_log_entry og_logs[OG_LOG_MAX];
static int og_nlogs;
static pthread_mutex_t og_log_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void og_log_cb(int32_t level, const char *message, void *user_data) {
  (void)user_data;
  pthread_mutex_lock(&og_log_lock);
  if (og_nlogs < OG_LOG_MAX) {
    og_logs[og_nlogs].level = level;
    snprintf(og_logs[og_nlogs].message, sizeof og_logs[og_nlogs].message, "%s", message);
    og_nlogs++;
  }
  pthread_mutex_unlock(&og_log_lock);
}

/* Forgets the messages captured so far. */
static inline void og_log_reset(void) {
  pthread_mutex_lock(&og_log_lock);
  og_nlogs = 0;
  pthread_mutex_unlock(&og_log_lock);
}

/* Routes the library's log to the capture buffer, emptied. */
static inline void og_log_start(void) {
  og_log_reset();
  opgraft_set_log_callback(og_log_cb, NULL);
}

/* Restores the library's default log (stderr). */
static inline void og_log_stop(void) { opgraft_set_log_callback(NULL, NULL); }

/* Number of captured warnings whose text contains needle (all warnings when needle is NULL). */
static inline int og_log_warnings(const char *needle) {
  int n = 0;
  pthread_mutex_lock(&og_log_lock);
  for (int i = 0; i < og_nlogs; ++i)
    if (og_logs[i].level >= OPGRAFT_LOG_WARNING && (!needle || strstr(og_logs[i].message, needle))) n++;
  pthread_mutex_unlock(&og_log_lock);
  return n;
}

/* Prints the captured messages, to explain a failure. */
static inline void og_log_dump(void) {
  pthread_mutex_lock(&og_log_lock);
  for (int i = 0; i < og_nlogs; ++i) print_message("  log[%d] level %d: %s\n", i, og_logs[i].level, og_logs[i].message);
  pthread_mutex_unlock(&og_log_lock);
}

/* ---- environment ---- */

/* Unsets every environment variable whose name starts with prefix. */
static inline void og_unsetenv_prefix(const char *prefix) {
  const size_t plen = strlen(prefix);
  for (;;) {
    char name[256] = "";
    for (char **e = environ; e && *e; ++e) {
      if (strncmp(*e, prefix, plen) != 0) continue;
      const char *eq = strchr(*e, '=');
      const size_t n = eq ? (size_t)(eq - *e) : strlen(*e);
      if (n < sizeof name) {
        memcpy(name, *e, n);
        name[n] = 0;
      }
      break;
    }
    if (!name[0]) return;
    unsetenv(name);
  }
}

/* True when the environment allows a missing NVRTC to skip the tests that need it. */
static inline int og_allow_no_nvrtc(void) {
  const char *v = getenv("OPGRAFT_TEST_ALLOW_NO_NVRTC");
  return v && strcmp(v, "1") == 0;
}

/* ---- child processes ---- */

/* The test program's own path, for running it again (set from argv[0] by og_set_self). */
static char og_self[4096] = "/proc/self/exe";

/* Remembers the program's path; /proc/self/exe would name valgrind when the test runs under it. */
static inline void og_set_self(const char *argv0) {
  char buf[4096];
  if (argv0 && strchr(argv0, '/') && realpath(argv0, buf)) snprintf(og_self, sizeof og_self, "%s", buf);
}

/* Runs this test program again in a fresh process (fork, then exec of og_self) with
 * $OG_TEST_ROLE set to role; the program's main() runs that role instead of the tests. The child
 * inherits the current environment. Returns the child's pid. */
static inline pid_t og_spawn_role(const char *role) {
  fflush(NULL);
  const pid_t pid = fork();
  if (pid < 0) fail_msg("fork: %s", strerror(errno));
  if (pid == 0) {
    setenv("OG_TEST_ROLE", role, 1);
    execl(og_self, og_self, (char *)NULL);
    fprintf(stderr, "exec of %s failed: %s\n", og_self, strerror(errno));
    _exit(127);
  }
  return pid;
}

/* Waits for a child; returns its exit status, or 128 + the signal that ended it. */
static inline int og_wait(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) fail_msg("waitpid: %s", strerror(errno));
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

static inline int og_run_role(const char *role) { return og_wait(og_spawn_role(role)); }

/* In a child role: reports a failed check on stderr and makes the role return 1. */
#define OG_CHILD_CHECK(cond)                                                                       \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      fprintf(stderr, "child check failed at %s:%d: %s (last error: %s)\n", __FILE__, __LINE__,   \
              #cond, opgraft_last_error());                                                        \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

#endif
