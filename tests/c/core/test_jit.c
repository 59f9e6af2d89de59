/* The JIT's compiler-log reader (ptxas --verbose resource reports) and a real NVRTC compile of the
 * core's own kernel; the ops' variants are compiled by their own tests (tests/c/<op>/). */
#include "og_test.h"

static int have_nvrtc;
static char nvrtc_error[256];

static int setup(void **state) {
  static char tmp[512];
  og_tmpdir(tmp, sizeof tmp);
  setenv("OPGRAFT_CACHE_DIR", tmp, 1);
  *state = tmp;
  opgraft_runtime_info info;
  assert_int_equal(opgraft_runtime_query(&info), OPGRAFT_OK);
  have_nvrtc = info.nvrtc_version > 0;
  opgraft__copy(nvrtc_error, sizeof nvrtc_error, info.nvrtc_error);
  return 0;
}

static int teardown(void **state) {
  og_rm_rf(*state);
  unsetenv("OPGRAFT_CACHE_DIR");
  return 0;
}

static void need_nvrtc(void) {
  if (have_nvrtc) return;
  if (og_allow_no_nvrtc()) {
    print_message("skipping: NVRTC cannot be loaded (%s) and OPGRAFT_TEST_ALLOW_NO_NVRTC=1\n", nvrtc_error);
    skip();
  }
  fail_msg("NVRTC cannot be loaded: %s (set OPGRAFT_TEST_ALLOW_NO_NVRTC=1 to skip the compile tests)", nvrtc_error);
}

static void test_source_names(void **state) {
  /* Every embedded file is reachable by its path, and its name (what #include says) is unique. */
  assert_true(opgraft__num_sources >= 2);
  for (int i = 0; i < opgraft__num_sources; ++i) {
    const og_source *s = &opgraft__sources[i];
    assert_ptr_equal(opgraft__find_source(s->path), s);
    assert_non_null(strchr(s->path, '/'));
    assert_string_equal(strrchr(s->path, '/') + 1, s->name);
    for (int j = 0; j < i; ++j) assert_string_not_equal(opgraft__sources[j].name, s->name);
  }
  assert_null(opgraft__find_source("no/such.cu"));
  assert_non_null(opgraft__find_source("common/og_common.cuh"));
}

static void test_source_hash_once_is_the_hash(void **state) {
  /* The per-source cached hash (the cubin key's) equals the hash of the files, first call and
   * later ones; an op's folder changes it, and a path that is no embedded source is hashed each
   * time rather than cached under another's slot. */
  (void)state;
  char want[33], got[33], again[33];
  for (int i = 0; i < opgraft__num_sources; ++i) {
    const char *path = opgraft__sources[i].path;
    opgraft__hash_sources(path, want);
    opgraft__source_hash(path, got);
    opgraft__source_hash(path, again);
    assert_string_equal(got, want);
    assert_string_equal(again, want);
  }
  char attn[33], lin[33];
  opgraft__source_hash("attention/attention.cu", attn);
  opgraft__source_hash("linear/linear.cu", lin);
  assert_string_not_equal(attn, lin);
  opgraft__hash_sources("no/such.cu", want);
  opgraft__source_hash("no/such.cu", got);
  assert_string_equal(got, want);
}

static void test_real_log_parses(void **state) {
  /* The resource report of an actual compile parses. */
  need_nvrtc();
  og_cubin c;
  const int32_t st = opgraft__compile("common/stream_read.cu", NULL, 0, 90, &c);
  if (st != OPGRAFT_OK) fail_msg("compiling common/stream_read.cu: %s", opgraft_last_error());
  assert_non_null(c.log);
  opgraft_kernel_info ki;
  assert_int_equal(opgraft__parse_resources(c.log, "stream_read_u128", &ki), OPGRAFT_OK);
  assert_string_equal(ki.name, "stream_read_u128");
  assert_true(ki.registers > 0 && ki.registers <= 255);
  assert_int_equal(ki.spill_store_bytes, 0);
  assert_int_equal(ki.spill_load_bytes, 0);
  opgraft__cubin_free(&c);
}

/* A verbose ptxas log in the shape NVRTC gives it: the first entry in the older report format,
 * the second in the newer one, with spills. */
static const char canned_log[] =
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function 'gemm_bf16' for 'sm_90'\n"
    "ptxas info    : Function properties for gemm_bf16\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 176 registers, 36920 bytes smem, 400 bytes cmem[0]\n"
    "ptxas info    : Compile time = 93.120 ms\n"
    "ptxas info    : Compiling entry function 'reduce_bf16' for 'sm_90'\n"
    "ptxas info    : Function properties for reduce_bf16\n"
    "ptxas         .     24 bytes stack frame, 40 bytes spill stores, 64 bytes spill loads\n"
    "ptxas info    : Used 128 registers, used 1 barriers, 24 bytes cumulative stack size, 12600 bytes smem\n"
    "ptxas info    : Compile time = 89.320 ms\n";

static void test_parse_canned_log(void **state) {
  opgraft_kernel_info ki;
  assert_int_equal(opgraft__parse_resources(canned_log, "gemm_bf16", &ki), OPGRAFT_OK);
  assert_string_equal(ki.name, "gemm_bf16");
  assert_int_equal(ki.registers, 176);
  assert_int_equal(ki.spill_store_bytes, 0);
  assert_int_equal(ki.spill_load_bytes, 0);
  assert_int_equal(ki.stack_bytes, 0);
  assert_int_equal(ki.shared_bytes, 36920);

  assert_int_equal(opgraft__parse_resources(canned_log, "reduce_bf16", &ki), OPGRAFT_OK);
  assert_string_equal(ki.name, "reduce_bf16");
  assert_int_equal(ki.registers, 128);
  assert_int_equal(ki.spill_store_bytes, 40);
  assert_int_equal(ki.spill_load_bytes, 64);
  assert_int_equal(ki.stack_bytes, 24);
  assert_int_equal(ki.shared_bytes, 12600);
}

static void test_parse_rejects_garbage(void **state) {
  opgraft_kernel_info ki;
  assert_int_not_equal(opgraft__parse_resources("garbage", "reduce_bf16", &ki), OPGRAFT_OK);
  assert_int_not_equal(opgraft__parse_resources("", "reduce_bf16", &ki), OPGRAFT_OK);
  assert_int_not_equal(opgraft__parse_resources(NULL, "reduce_bf16", &ki), OPGRAFT_OK);
  /* A name that is only a prefix of a reported one is not found. */
  assert_int_equal(opgraft__parse_resources(canned_log, "reduce", &ki), OPGRAFT_ENOTFOUND);
  /* The entry is there but its numbers are not. */
  const char *no_numbers =
      "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
      "ptxas         .     many bytes stack frame, some bytes spill stores, few bytes spill loads\n"
      "ptxas info    : Used lots of registers\n";
  assert_int_equal(opgraft__parse_resources(no_numbers, "k", &ki), OPGRAFT_EPARSE);
  const char *no_registers =
      "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used lots of registers\n";
  assert_int_equal(opgraft__parse_resources(no_registers, "k", &ki), OPGRAFT_EPARSE);
  /* The report lines belong to the next entry, not to this one. */
  const char *borrowed =
      "ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
      "ptxas info    : Compiling entry function 'b' for 'sm_90'\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 32 registers\n";
  assert_int_equal(opgraft__parse_resources(borrowed, "a", &ki), OPGRAFT_EPARSE);
  const char *no_spill_line =
      "ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
      "ptxas info    : Used 10 registers\n"
      "ptxas info    : Compiling entry function 'b' for 'sm_90'\n"
      "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
      "ptxas info    : Used 32 registers\n";
  assert_int_equal(opgraft__parse_resources(no_spill_line, "a", &ki), OPGRAFT_EPARSE);
  assert_int_equal(opgraft__parse_resources(borrowed, "b", &ki), OPGRAFT_OK);
  assert_int_equal(ki.registers, 32);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_source_names),
      cmocka_unit_test(test_source_hash_once_is_the_hash),
      cmocka_unit_test(test_parse_canned_log),
      cmocka_unit_test(test_parse_rejects_garbage),
      cmocka_unit_test(test_real_log_parses),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
