/* Finding libnvrtc and libcuda at run time, and the argument checks of the GPU entry points. */
#include "og_test.h"

static char tmp[512];

static int setup(void **state) {
  og_tmpdir(tmp, sizeof tmp);
  setenv("OPGRAFT_CACHE_DIR", tmp, 1); /* nothing should be cached, but never in $HOME */
  unsetenv("OPGRAFT_NVRTC");
  return 0;
}

static int teardown(void **state) {
  unsetenv("OPGRAFT_CACHE_DIR");
  og_rm_rf(tmp);
  return 0;
}

/* Skips or fails (per OPGRAFT_TEST_ALLOW_NO_NVRTC) when NVRTC was not found. */
static void need_nvrtc(const opgraft_runtime_info *info) {
  if (info->nvrtc_path[0]) return;
  if (og_allow_no_nvrtc()) {
    print_message("skipping: NVRTC cannot be loaded (%s) and OPGRAFT_TEST_ALLOW_NO_NVRTC=1\n", info->nvrtc_error);
    skip();
  }
  fail_msg("NVRTC cannot be loaded: %s (set OPGRAFT_TEST_ALLOW_NO_NVRTC=1 to skip)", info->nvrtc_error);
}

static void test_query_finds_nvrtc(void **state) {
  opgraft_runtime_info info;
  memset(&info, 0x5a, sizeof info);
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  need_nvrtc(&info);
  assert_true(strlen(info.nvrtc_path) < sizeof info.nvrtc_path);
  assert_int_equal(access(info.nvrtc_path, R_OK), 0);
  assert_non_null(strstr(info.nvrtc_path, "nvrtc"));
  assert_true(info.nvrtc_version >= 12000);
  assert_int_equal(info.nvrtc_version % 10, 0);
  assert_string_equal(info.nvrtc_error, "");
  /* The lookup is cached: a second query reports the same. */
  opgraft_runtime_info again;
  assert_int_equal(opgraft_runtime_query(&again), OPGRAFT_OK);
  assert_string_equal(again.nvrtc_path, info.nvrtc_path);
  assert_int_equal(again.nvrtc_version, info.nvrtc_version);
}

static void test_query_null(void **state) {
  assert_int_equal(opgraft_runtime_query(NULL), OPGRAFT_EINVAL);
  assert_true(opgraft_last_error()[0] != 0);
}

static void test_libcuda_missing(void **state) {
  opgraft_runtime_info info;
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  if (info.libcuda_path[0]) {
    print_message("skipping: libcuda is present here (%s)\n", info.libcuda_path);
    skip();
  }
  assert_true(info.libcuda_error[0] != 0);
  assert_int_equal(info.driver_version, 0);
}

/* Child role: with $OPGRAFT_NVRTC naming a missing file, NVRTC is still found elsewhere and one
 * warning names the variable. Exit status 0, 77 without NVRTC, else a failure. */
static int role_bad_nvrtc_env(void) {
  og_log_start();
  const char *bogus = getenv("OPGRAFT_NVRTC");
  OG_CHILD_CHECK(bogus && bogus[0]);
  opgraft_runtime_info info;
  OG_CHILD_CHECK(opgraft_runtime_query(&info) == OPGRAFT_OK);
  OG_CHILD_CHECK(og_log_warnings("OPGRAFT_NVRTC") == 1);
  if (!info.nvrtc_path[0]) return 77;
  OG_CHILD_CHECK(strcmp(info.nvrtc_path, bogus) != 0);
  OG_CHILD_CHECK(access(info.nvrtc_path, R_OK) == 0);
  OG_CHILD_CHECK(info.nvrtc_version >= 12000);
  return 0;
}

static void test_bad_nvrtc_env_falls_back(void **state) {
  char bogus[1024];
  snprintf(bogus, sizeof bogus, "%s/no-such-libnvrtc.so.99", tmp);
  setenv("OPGRAFT_NVRTC", bogus, 1);
  const int rc = og_run_role("bad_nvrtc_env");
  unsetenv("OPGRAFT_NVRTC");
  if (rc == 77) {
    opgraft_runtime_info info;
    opgraft_runtime_query(&info);
    need_nvrtc(&info);
  }
  if (rc != 0) fail_msg("the child process with OPGRAFT_NVRTC=%s exited with %d", bogus, rc);
}

/* Child role: $OPGRAFT_NVRTC names a link to the real library, which is loaded under that name
 * without a warning. */
static int role_good_nvrtc_env(void) {
  og_log_start();
  const char *link = getenv("OPGRAFT_NVRTC");
  OG_CHILD_CHECK(link && link[0]);
  opgraft_runtime_info info;
  OG_CHILD_CHECK(opgraft_runtime_query(&info) == OPGRAFT_OK);
  OG_CHILD_CHECK(strcmp(info.nvrtc_path, link) == 0);
  OG_CHILD_CHECK(info.nvrtc_version >= 12000);
  OG_CHILD_CHECK(og_log_warnings(NULL) == 0);
  return 0;
}

static void test_nvrtc_env_is_used(void **state) {
  opgraft_runtime_info info;
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  need_nvrtc(&info);
  char link[1024];
  snprintf(link, sizeof link, "%s/libnvrtc-link.so", tmp);
  assert_int_equal(symlink(info.nvrtc_path, link), 0);
  setenv("OPGRAFT_NVRTC", link, 1);
  const int rc = og_run_role("good_nvrtc_env");
  unsetenv("OPGRAFT_NVRTC");
  unlink(link);
  if (rc != 0) fail_msg("the child process with OPGRAFT_NVRTC=%s exited with %d", link, rc);
}

/* A real library that is not the one asked for: libm is on every system this runs on. */
static const char wrong_lib[] = "libm.so.6";

/* Child role: $OPGRAFT_NVRTC names a library that loads but is not libnvrtc. One warning names
 * the variable and says what the file is; NVRTC is found by the search as for a missing file. */
static int role_wrong_nvrtc_env(void) {
  og_log_start();
  opgraft_runtime_info info;
  OG_CHILD_CHECK(opgraft_runtime_query(&info) == OPGRAFT_OK);
  OG_CHILD_CHECK(og_log_warnings("OPGRAFT_NVRTC=libm.so.6 is ") == 1);
  OG_CHILD_CHECK(og_log_warnings("(libm.so.6), not libnvrtc (it has no nvrtcVersion); searching elsewhere") == 1);
  if (!info.nvrtc_path[0]) return 77;
  OG_CHILD_CHECK(strstr(info.nvrtc_path, "libm") == NULL);
  OG_CHILD_CHECK(info.nvrtc_version >= 12000);
  return 0;
}

static void test_wrong_nvrtc_env_falls_back(void **state) {
  setenv("OPGRAFT_NVRTC", wrong_lib, 1);
  const int rc = og_run_role("wrong_nvrtc_env");
  unsetenv("OPGRAFT_NVRTC");
  if (rc == 77) {
    opgraft_runtime_info info;
    opgraft_runtime_query(&info);
    need_nvrtc(&info);
  }
  if (rc != 0) fail_msg("the child process with OPGRAFT_NVRTC=%s exited with %d", wrong_lib, rc);
}

/* Child role: $OPGRAFT_LIBCUDA names a library that is not the CUDA driver: one warning says
 * what it is (not "driver too old"), and the system's libcuda is used if there is one. */
static int role_wrong_libcuda_env(void) {
  og_log_start();
  opgraft_runtime_info info;
  OG_CHILD_CHECK(opgraft_runtime_query(&info) == OPGRAFT_OK);
  OG_CHILD_CHECK(og_log_warnings("OPGRAFT_LIBCUDA=libm.so.6 is ") == 1);
  OG_CHILD_CHECK(og_log_warnings("(libm.so.6), not the CUDA driver library (it has no cuInit)") == 1);
  OG_CHILD_CHECK(strstr(info.libcuda_error, "too old") == NULL);
  if (info.libcuda_path[0])
    OG_CHILD_CHECK(strstr(info.libcuda_path, "libm") == NULL && info.driver_version > 0);
  else
    OG_CHILD_CHECK(strstr(info.libcuda_error, "libcuda not found") != NULL);
  return 0;
}

static void test_wrong_libcuda_env_falls_back(void **state) {
  setenv("OPGRAFT_LIBCUDA", wrong_lib, 1);
  const int rc = og_run_role("wrong_libcuda_env");
  unsetenv("OPGRAFT_LIBCUDA");
  if (rc != 0) fail_msg("the child process with OPGRAFT_LIBCUDA=%s exited with %d", wrong_lib, rc);
}

static void test_add_library_dir(void **state) {
  opgraft__fail(OPGRAFT_OK, "%s", "");
  assert_int_equal(opgraft_add_library_dir(NULL), OPGRAFT_EINVAL);
  assert_true(opgraft_last_error()[0] != 0);
  assert_int_equal(opgraft_add_library_dir(""), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_add_library_dir(tmp), OPGRAFT_OK);
  assert_int_equal(opgraft_add_library_dir(tmp), OPGRAFT_OK); /* a duplicate is fine */
}

static void test_stream_read_bad_arguments(void **state) {
  const void *data = (const void *)0x10000;
  void *sink = (void *)0x20000;
  const struct {
    const void *data;
    size_t bytes;
    void *sink;
    int32_t grid;
    const char *what;
  } bad[] = {
      {NULL, 1024, sink, 0, "NULL data"},
      {data, 1024, NULL, 0, "NULL sink"},
      {data, 0, sink, 0, "zero bytes"},
      {data, 8, sink, 0, "8 bytes"},
      {data, 1000, sink, 0, "bytes not a multiple of 16"},
      {(const void *)0x10008, 1024, sink, 0, "data not 16-byte aligned"},
      {data, 1024, sink, -1, "a negative grid"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; ++i) {
    opgraft__fail(OPGRAFT_OK, "%s", "");
    const int32_t st = opgraft_stream_read(bad[i].data, bad[i].bytes, bad[i].sink, bad[i].grid, NULL);
    if (st != OPGRAFT_EINVAL) fail_msg("%s: %s, expected OPGRAFT_EINVAL", bad[i].what, opgraft_status_name(st));
    if (!opgraft_last_error()[0]) fail_msg("%s: no error message", bad[i].what);
  }
  /* Good arguments get as far as the missing driver or context, without touching the data. */
  const int32_t st = opgraft_stream_read(data, 1024, sink, 0, NULL);
  assert_int_not_equal(st, OPGRAFT_OK);
  assert_int_not_equal(st, OPGRAFT_EINVAL);
}

int main(int argc, char **argv) {
  (void)argc;
  og_set_self(argv[0]);
  const char *role = getenv("OG_TEST_ROLE");
  if (role && strcmp(role, "bad_nvrtc_env") == 0) return role_bad_nvrtc_env();
  if (role && strcmp(role, "good_nvrtc_env") == 0) return role_good_nvrtc_env();
  if (role && strcmp(role, "wrong_nvrtc_env") == 0) return role_wrong_nvrtc_env();
  if (role && strcmp(role, "wrong_libcuda_env") == 0) return role_wrong_libcuda_env();
  if (role) return 126;

  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_query_finds_nvrtc),
      cmocka_unit_test(test_query_null),
      cmocka_unit_test(test_libcuda_missing),
      cmocka_unit_test(test_bad_nvrtc_env_falls_back),
      cmocka_unit_test(test_nvrtc_env_is_used),
      cmocka_unit_test(test_wrong_nvrtc_env_falls_back),
      cmocka_unit_test(test_wrong_libcuda_env_falls_back),
      cmocka_unit_test(test_add_library_dir),
      cmocka_unit_test(test_stream_read_bad_arguments),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
