/* What each op's compile check (test_<op>_compile.c) shares: a job is one kernel configuration
 * (its source, NVRTC options and arch, and the entry points its cubin must have); jobs with the
 * same compile share one; the distinct compiles run on several threads through the kernel cache
 * ($OPGRAFT_TEST_KERNEL_CACHE keeps the cubins and their resource reports across runs; without it,
 * a fresh directory; $OPGRAFT_TEST_JOBS overrides the thread count). An op's test adds its jobs
 * with og_job_add and keeps what else it needs in arrays of its own, indexed as og_jobs. */
#ifndef OG_COMPILE_JOBS_H
#define OG_COMPILE_JOBS_H

#include <time.h>

#include "og_test.h"

enum { OG_JOB_MAX_FN = 3, OG_JOB_MAX = 4096 };

typedef struct og_job {
  char what[200];
  const char *source;
  og_opts opts; /* filled in place: its pointers point into itself */
  int32_t arch;
  int nfn;
  char fn[OG_JOB_MAX_FN][64];
  int32_t status;
  opgraft_kernel_info info[OG_JOB_MAX_FN]; /* in fn's order */
  char error[512];
  int dup_of; /* -1, or the earlier job with the same source, options, arch and entry points */
} og_job;

static og_job og_jobs[OG_JOB_MAX];
static int og_njobs, og_nunique;
static int og_have_nvrtc;
static char og_nvrtc_error[256];
static char og_cache_tmp[512];

/* Points the kernel cache at $OPGRAFT_TEST_KERNEL_CACHE or a fresh directory, lets the shipped
 * tunables decide (OPGRAFT_TUNE_* and OPGRAFT_TRACE unset), and finds out whether NVRTC loads.
 * Returns whether it does. */
static inline int og_jobs_setup(void) {
  const char *keep = getenv("OPGRAFT_TEST_KERNEL_CACHE");
  og_cache_tmp[0] = 0;
  if (keep && *keep) {
    setenv("OPGRAFT_CACHE_DIR", keep, 1);
  } else {
    og_tmpdir(og_cache_tmp, sizeof og_cache_tmp);
    setenv("OPGRAFT_CACHE_DIR", og_cache_tmp, 1);
  }
  og_unsetenv_prefix("OPGRAFT_TUNE_");
  unsetenv("OPGRAFT_TRACE");
  opgraft_tune_reload();
  opgraft_runtime_info info;
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  og_have_nvrtc = info.nvrtc_version > 0;
  opgraft__copy(og_nvrtc_error, sizeof og_nvrtc_error, info.nvrtc_error);
  og_njobs = og_nunique = 0;
  return og_have_nvrtc;
}

static inline int og_jobs_teardown(void **state) {
  (void)state;
  if (og_cache_tmp[0]) og_rm_rf(og_cache_tmp);
  unsetenv("OPGRAFT_CACHE_DIR");
  return 0;
}

/* The compile tests fail without NVRTC, unless OPGRAFT_TEST_ALLOW_NO_NVRTC=1 lets them skip. */
static inline void og_need_nvrtc(void) {
  if (og_have_nvrtc) return;
  if (og_allow_no_nvrtc()) {
    print_message("skipping: NVRTC cannot be loaded (%s) and OPGRAFT_TEST_ALLOW_NO_NVRTC=1\n", og_nvrtc_error);
    skip();
  }
  fail_msg("NVRTC cannot be loaded: %s (set OPGRAFT_TEST_ALLOW_NO_NVRTC=1 to skip the compile tests)", og_nvrtc_error);
}

/* Sets a setting's variables (env: name, value, ..., NULL; NULL: none) and reloads the tunables;
 * writes "NAME=VALUE ..." to text. */
static inline void og_setting_apply(const char *const *env, char *text, size_t len) {
  text[0] = 0;
  for (int e = 0; env && env[e]; e += 2) {
    setenv(env[e], env[e + 1], 1);
    snprintf(text + strlen(text), len - strlen(text), "%s%s=%s", e ? " " : "", env[e], env[e + 1]);
  }
  opgraft_tune_reload();
}

static inline void og_setting_clear(const char *const *env) {
  for (int e = 0; env && env[e]; e += 2) unsetenv(env[e]);
  opgraft_tune_reload();
}

/* A new job, zeroed, named what (printf-style); the caller fills source, opts, arch and its entry
 * points, then calls og_job_done. */
static inline og_job *og_job_new(const char *fmt, ...) {
  if (og_njobs >= OG_JOB_MAX) fail_msg("more than %d compile jobs", OG_JOB_MAX);
  og_job *j = &og_jobs[og_njobs];
  memset(j, 0, sizeof *j);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(j->what, sizeof j->what, fmt, ap);
  va_end(ap);
  j->dup_of = -1;
  return j;
}

/* Adds the job og_job_new returned, sharing the compile of an earlier identical one. */
static inline void og_job_done(og_job *j) {
  if (j->nfn < 1 || j->nfn > OG_JOB_MAX_FN) fail_msg("%s: %d entry points", j->what, j->nfn);
  for (int i = 0; i < og_njobs && j->dup_of < 0; ++i) {
    const og_job *o = &og_jobs[i];
    if (o->dup_of >= 0 || o->arch != j->arch || strcmp(o->source, j->source) != 0 || o->opts.n != j->opts.n ||
        o->nfn != j->nfn)
      continue;
    int same = 1;
    for (int k = 0; k < o->opts.n && same; ++k) same = strcmp(o->opts.ptr[k], j->opts.ptr[k]) == 0;
    for (int k = 0; k < o->nfn && same; ++k) same = strcmp(o->fn[k], j->fn[k]) == 0;
    if (same) j->dup_of = i;
  }
  og_nunique += j->dup_of < 0;
  ++og_njobs;
}

/* The job whose compile holds job i's results. */
static inline const og_job *og_job_result(int i) {
  return og_jobs[i].dup_of >= 0 ? &og_jobs[og_jobs[i].dup_of] : &og_jobs[i];
}

static inline void og_job_run(og_job *j) {
  og_cubin c;
  j->status = opgraft__cubin_cached(j->source, j->opts.ptr, j->opts.n, j->arch, &c);
  if (j->status) {
    opgraft__copy(j->error, sizeof j->error, opgraft_last_error());
    return;
  }
  for (int f = 0; f < j->nfn && !j->status; ++f) j->status = opgraft__parse_resources(c.log, j->fn[f], &j->info[f]);
  if (j->status) opgraft__copy(j->error, sizeof j->error, opgraft_last_error());
  opgraft__cubin_free(&c);
}

static _Atomic int og_next_job, og_jobs_done;
static pthread_mutex_t og_progress_lock = PTHREAD_MUTEX_INITIALIZER;
static struct timespec og_jobs_start, og_jobs_last;
static const char *og_jobs_op;

static inline double og_seconds_since(const struct timespec *t) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)(now.tv_sec - t->tv_sec) + (double)(now.tv_nsec - t->tv_nsec) * 1e-9;
}

/* Progress for a cold cache (minutes): a line at most every 10 s, none when the cache is warm. */
static inline void og_jobs_progress(void) {
  const int done = ++og_jobs_done;
  pthread_mutex_lock(&og_progress_lock);
  if (og_seconds_since(&og_jobs_last) >= 10.0) {
    clock_gettime(CLOCK_MONOTONIC, &og_jobs_last);
    print_message("compiled %d of %d distinct %s variants (%.0f s)\n", done, og_nunique, og_jobs_op,
                  og_seconds_since(&og_jobs_start));
    fflush(stdout);
  }
  pthread_mutex_unlock(&og_progress_lock);
}

static inline void *og_jobs_worker(void *arg) {
  for (int i; (i = og_next_job++) < og_njobs;)
    if (og_jobs[i].dup_of < 0) {
      og_job_run(&og_jobs[i]);
      og_jobs_progress();
    }
  return arg;
}

/* Compiles every distinct job (op names them in the progress lines). */
static inline void og_jobs_compile(const char *op) {
  long threads = sysconf(_SC_NPROCESSORS_ONLN);
  const char *env = getenv("OPGRAFT_TEST_JOBS");
  if (env && atoi(env) > 0) threads = atoi(env);
  if (threads < 1) threads = 1;
  if (threads > 16) threads = 16;
  pthread_t th[16];
  og_jobs_op = op;
  og_next_job = og_jobs_done = 0;
  clock_gettime(CLOCK_MONOTONIC, &og_jobs_start);
  og_jobs_last = og_jobs_start;
  print_message("%d %s configurations, %d distinct compiles on %ld threads (kernel cache %s)\n", og_njobs, op,
                og_nunique, threads, getenv("OPGRAFT_CACHE_DIR"));
  fflush(stdout);
  for (long i = 0; i < threads; ++i) assert_int_equal(pthread_create(&th[i], NULL, og_jobs_worker, NULL), 0);
  for (long i = 0; i < threads; ++i) assert_int_equal(pthread_join(th[i], NULL), 0);
  print_message("%d distinct %s variants compiled or read from the cache in %.1f s\n", og_nunique, op,
                og_seconds_since(&og_jobs_start));
}

/* Every job compiled, and its cubin has each entry point with some registers. */
static inline void og_jobs_check_compiled(void) {
  og_need_nvrtc();
  int bad = 0;
  for (int i = 0; i < og_njobs; ++i) {
    const og_job *r = og_job_result(i);
    if (r->status != OPGRAFT_OK) {
      print_error("%s: %s: %.400s\n", og_jobs[i].what, opgraft_status_name(r->status), r->error);
      ++bad;
      continue;
    }
    for (int f = 0; f < r->nfn; ++f)
      if (strcmp(r->info[f].name, og_jobs[i].fn[f]) != 0 || r->info[f].registers <= 0) {
        print_error("%s: kernel %d is \"%s\" with %d registers, expected %s with some\n", og_jobs[i].what, f,
                    r->info[f].name, r->info[f].registers, og_jobs[i].fn[f]);
        ++bad;
      }
  }
  if (bad) fail_msg("%d problems over %d kernel variants", bad, og_njobs);
}

/* No entry point of any job spills registers or uses a stack frame. */
static inline void og_jobs_check_no_spills(void) {
  og_need_nvrtc();
  int bad = 0;
  for (int i = 0; i < og_njobs; ++i) {
    const og_job *r = og_job_result(i);
    if (r->status != OPGRAFT_OK) continue; /* reported by og_jobs_check_compiled */
    for (int f = 0; f < r->nfn; ++f) {
      const opgraft_kernel_info *ki = &r->info[f];
      if (ki->spill_store_bytes > 0 || ki->spill_load_bytes > 0 || ki->stack_bytes > 0) {
        print_error("%s, %s: spills: %d bytes stored, %d loaded, %d registers, %d bytes stack\n", og_jobs[i].what,
                    ki->name, ki->spill_store_bytes, ki->spill_load_bytes, ki->registers, ki->stack_bytes);
        ++bad;
      }
    }
  }
  if (bad) fail_msg("%d kernels spill registers", bad);
}

#endif
