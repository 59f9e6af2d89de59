/* Status codes, per-thread error messages, the version and the log callback. */
#include "og_test.h"

typedef struct status_row {
  int32_t value;
  const char *name;
  const char *message;
} status_row;

static const status_row status_rows[] = {
#define OPGRAFT_XX(name, value, msg) {value, "OPGRAFT_" #name, msg},
    OPGRAFT_STATUS_MAP(OPGRAFT_XX)
#undef OPGRAFT_XX
};
#define N_STATUS ((int)(sizeof status_rows / sizeof *status_rows))

static void test_every_status_code(void **state) {
  assert_int_equal(N_STATUS, 13);
  for (int i = 0; i < N_STATUS; ++i) {
    const status_row *r = &status_rows[i];
    assert_string_equal(opgraft_strerror(r->value), r->message);
    assert_string_equal(opgraft_status_name(r->value), r->name);
    assert_true(r->message[0] != 0);
    /* Codes are unique, and only OK is non-negative. */
    assert_true(r->value == OPGRAFT_OK || r->value < 0);
    for (int j = 0; j < i; ++j) assert_int_not_equal(status_rows[j].value, r->value);
  }
  assert_int_equal(OPGRAFT_OK, 0);
  assert_string_equal(opgraft_status_name(OPGRAFT_EUNSUPPORTED), "OPGRAFT_EUNSUPPORTED");
}

static void test_unknown_status_code(void **state) {
  const int32_t unknown[] = {1, -13, 12345, -100000, INT32_MIN, INT32_MAX};
  for (size_t i = 0; i < sizeof unknown / sizeof *unknown; ++i) {
    assert_string_equal(opgraft_strerror(unknown[i]), "unknown status");
    assert_string_equal(opgraft_status_name(unknown[i]), "OPGRAFT_UNKNOWN");
  }
}

typedef struct thread_seen {
  char before[1024];
  char after[1024];
  int32_t status;
} thread_seen;

static void *set_error_in_thread(void *arg) {
  thread_seen *seen = arg;
  opgraft__copy(seen->before, sizeof seen->before, opgraft_last_error());
  seen->status = opgraft__fail(OPGRAFT_EIO, "set in the worker thread");
  opgraft__copy(seen->after, sizeof seen->after, opgraft_last_error());
  return NULL;
}

static void test_last_error_is_per_thread(void **state) {
  assert_int_equal(opgraft__fail(OPGRAFT_EINVAL, "set in the main thread %d", 7), OPGRAFT_EINVAL);
  assert_string_equal(opgraft_last_error(), "set in the main thread 7");

  thread_seen seen;
  memset(&seen, 0x55, sizeof seen);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, set_error_in_thread, &seen), 0);
  assert_int_equal(pthread_join(th, NULL), 0);

  /* A new thread starts with no message and never sees the main thread's. */
  assert_string_equal(seen.before, "");
  assert_int_equal(seen.status, OPGRAFT_EIO);
  assert_string_equal(seen.after, "set in the worker thread");
  assert_string_equal(opgraft_last_error(), "set in the main thread 7");
}

static void test_last_error_from_public_call(void **state) {
  opgraft__fail(OPGRAFT_OK, "%s", "");
  assert_int_equal(opgraft_tune_get(NULL, NULL, NULL, 0), OPGRAFT_EINVAL);
  assert_true(strlen(opgraft_last_error()) > 0);
}

static void test_long_error_is_truncated(void **state) {
  char big[3000];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = 0;
  opgraft__fail(OPGRAFT_EINVAL, "%s", big);
  const size_t n = strlen(opgraft_last_error());
  assert_true(n > 0 && n < sizeof big - 1);
  assert_int_equal(opgraft_last_error()[0], 'x');
}

static void test_version(void **state) {
  assert_int_equal(opgraft_version(), OPGRAFT_VERSION_HEX);
  assert_int_equal(opgraft_version(), ((uint32_t)OPGRAFT_VERSION_MAJOR << 16) |
                                          ((uint32_t)OPGRAFT_VERSION_MINOR << 8) |
                                          (uint32_t)OPGRAFT_VERSION_PATCH);
  char expect[64];
  snprintf(expect, sizeof expect, "%d.%d.%d", OPGRAFT_VERSION_MAJOR, OPGRAFT_VERSION_MINOR,
           OPGRAFT_VERSION_PATCH);
  assert_string_equal(opgraft_version_string(), expect);
}

typedef struct counting_sink {
  int calls;
  int32_t level;
  char message[256];
} counting_sink;

static void counting_cb(int32_t level, const char *message, void *user_data) {
  counting_sink *s = user_data;
  s->calls++;
  s->level = level;
  snprintf(s->message, sizeof s->message, "%s", message);
}

static void test_log_callback(void **state) {
  counting_sink sink = {0, 0, ""};
  opgraft_set_log_callback(counting_cb, &sink);
  opgraft__log(OPGRAFT_LOG_WARNING, "disk %s is %d%% full", "x", 93);
  assert_int_equal(sink.calls, 1);
  assert_int_equal(sink.level, OPGRAFT_LOG_WARNING);
  assert_string_equal(sink.message, "disk x is 93% full");

  /* The callback receives every level, not only warnings. */
  opgraft__log(OPGRAFT_LOG_DEBUG, "a debug line");
  assert_int_equal(sink.calls, 2);
  assert_int_equal(sink.level, OPGRAFT_LOG_DEBUG);

  /* NULL restores the default sink, so the callback is no longer called. A debug message is used
   * because the default prints it nowhere without OPGRAFT_DEBUG. */
  unsetenv("OPGRAFT_DEBUG");
  opgraft_set_log_callback(NULL, NULL);
  opgraft__log(OPGRAFT_LOG_DEBUG, "not for the callback");
  assert_int_equal(sink.calls, 2);
}

static void test_warn_once(void **state) {
  og_log_start();
  for (int i = 0; i < 3; ++i) opgraft__warn_once("warn-once test %d", 1);
  assert_int_equal(og_log_warnings(NULL), 1);
  assert_int_equal(og_log_warnings("warn-once test 1"), 1);

  /* A different message is warned about once too. */
  opgraft__warn_once("warn-once test %d", 2);
  opgraft__warn_once("warn-once test %d", 2);
  assert_int_equal(og_log_warnings(NULL), 2);

  /* Identity is the formatted text, whatever the format string. */
  opgraft__warn_once("warn-once test %s", "1");
  assert_int_equal(og_log_warnings(NULL), 2);
  og_log_stop();
}

static void *warn_many(void *arg) {
  for (int i = 0; i < 200; ++i) opgraft__warn_once("warn-once from threads");
  return arg;
}

static void test_warn_once_across_threads(void **state) {
  og_log_start();
  pthread_t th[8];
  for (int i = 0; i < 8; ++i) assert_int_equal(pthread_create(&th[i], NULL, warn_many, NULL), 0);
  for (int i = 0; i < 8; ++i) assert_int_equal(pthread_join(th[i], NULL), 0);
  assert_int_equal(og_log_warnings("warn-once from threads"), 1);
  og_log_stop();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_status_code),
      cmocka_unit_test(test_unknown_status_code),
      cmocka_unit_test(test_last_error_is_per_thread),
      cmocka_unit_test(test_last_error_from_public_call),
      cmocka_unit_test(test_long_error_is_truncated),
      cmocka_unit_test(test_version),
      cmocka_unit_test(test_log_callback),
      cmocka_unit_test(test_warn_once),
      cmocka_unit_test(test_warn_once_across_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
