/* The op registry: descriptors are checked before an op is registered, and a bad one is refused
 * with a reason; the registered ops, their keys and the ABI layout as the core reports them. */
#include "og_test.h"

static const og_tunable good_keys[] = {{"toy.warps", 1, 16, 4, "1 2 4"}, {"toy.max_tokens", 0, 64, 1, NULL}};
static const og_tune_entry good_rows[] = {{90, NULL, "toy:E1", 1, 4, "toy.warps", 8, "measured: 2.0 -> 1.0 us"}};

static og_op toy(void) {
  og_op op = {.name = "toy",
              .kernel_dir = "common",
              .tunables = good_keys,
              .ntunables = 2,
              .rows = good_rows,
              .nrows = 1};
  return op;
}

/* The descriptor is refused, and the reason contains needle. */
static void refused(const og_op *op, const og_op *const *earlier, int n, const char *needle) {
  char err[256] = "";
  if (opgraft__op_check(op, earlier, n, err, sizeof err) == 0) fail_msg("accepted; expected a refusal about \"%s\"", needle);
  if (!strstr(err, needle)) fail_msg("refused with \"%s\"; expected it to say \"%s\"", err, needle);
}

static void test_good_descriptor(void **state) {
  const og_op op = toy();
  char err[256] = "";
  assert_int_equal(opgraft__op_check(&op, NULL, 0, err, sizeof err), 0);
  /* No kernels at all is allowed too. */
  og_op none = toy();
  none.kernel_dir = NULL;
  assert_int_equal(opgraft__op_check(&none, NULL, 0, err, sizeof err), 0);
}

static void test_bad_descriptors(void **state) {
  refused(NULL, NULL, 0, "NULL descriptor");
  og_op op = toy();
  op.name = "Toy";
  refused(&op, NULL, 0, "lower-case");
  op.name = "";
  refused(&op, NULL, 0, "lower-case");
  op.name = NULL;
  refused(&op, NULL, 0, "lower-case");
  op = toy();
  op.kernel_dir = "no_such_dir";
  refused(&op, NULL, 0, "no embedded kernel source under kernels/no_such_dir/");
  op = toy();
  op.kernel_dir = "comm"; /* a prefix of a folder is not that folder */
  refused(&op, NULL, 0, "kernels/comm/");

  static const og_tunable foreign[] = {{"moe.warps", 1, 16, 4, NULL}};
  op = toy();
  op.tunables = foreign, op.ntunables = 1, op.nrows = 0;
  refused(&op, NULL, 0, "does not start with the op's name");
  static const og_tunable bare[] = {{"toy.", 1, 16, 4, NULL}};
  op.tunables = bare;
  refused(&op, NULL, 0, "does not start with the op's name");
  static const og_tunable fallback_out[] = {{"toy.warps", 1, 16, 32, NULL}};
  op.tunables = fallback_out;
  refused(&op, NULL, 0, "fallback outside its range");
  static const og_tunable reversed[] = {{"toy.warps", 16, 1, 4, NULL}};
  op.tunables = reversed;
  refused(&op, NULL, 0, "fallback outside its range");
  static const og_tunable twice[] = {{"toy.warps", 1, 16, 4, NULL}, {"toy.warps", 1, 8, 4, NULL}};
  op.tunables = twice, op.ntunables = 2;
  refused(&op, NULL, 0, "listed twice");
  static const og_tunable bad_space[] = {{"toy.warps", 1, 16, 4, "1 2 32"}};
  op.tunables = bad_space, op.ntunables = 1;
  refused(&op, NULL, 0, "tuning candidate outside its range");
  static const og_tunable junk_space[] = {{"toy.warps", 1, 16, 4, "1 two"}};
  op.tunables = junk_space;
  refused(&op, NULL, 0, "tuning candidate outside its range");
  op = toy();
  op.tunables = NULL;
  refused(&op, NULL, 0, "bad tunable or row table");

  static const og_tune_entry unknown[] = {{90, NULL, NULL, 0, 0, "toy.bogus", 1, "why"}};
  op = toy();
  op.rows = unknown;
  refused(&op, NULL, 0, "unknown key \"toy.bogus\"");
  static const og_tune_entry out_of_range[] = {{90, NULL, NULL, 0, 0, "toy.warps", 17, "why"}};
  op.rows = out_of_range;
  refused(&op, NULL, 0, "outside the key's range");
  static const og_tune_entry bad_tokens[] = {{90, NULL, NULL, 4, 1, "toy.warps", 2, "why"}};
  op.rows = bad_tokens;
  refused(&op, NULL, 0, "bad token range");
  static const og_tune_entry no_why[] = {{90, NULL, NULL, 0, 0, "toy.warps", 2, ""}};
  op.rows = no_why;
  refused(&op, NULL, 0, "does not say why");

  /* The same name twice. */
  const og_op first = toy();
  const og_op *earlier[] = {&first};
  op = toy();
  refused(&op, earlier, 1, "registered twice");
}

static void test_registered_ops(void **state) {
  /* What the library registered: every op of src/ops/ops.c, each valid, with its keys listed. */
  const char *const *names = opgraft_op_names();
  assert_non_null(names);
  int n = 0;
  const og_op *const *ops = opgraft__ops(&n);
  assert_true(n >= 1);
  for (int i = 0; i < n; ++i) {
    assert_string_equal(names[i], ops[i]->name);
    assert_true(opgraft__op_ok(ops[i]));
    char err[256];
    assert_int_equal(opgraft__op_check(ops[i], ops, i, err, sizeof err), 0);
    for (int k = 0; k < ops[i]->ntunables; ++k) {
      const og_op *owner = NULL;
      assert_ptr_equal(opgraft__find_tunable(ops[i]->tunables[k].key, &owner), &ops[i]->tunables[k]);
      assert_ptr_equal(owner, ops[i]);
    }
  }
  assert_null(names[n]);
  /* Every registered list entry was valid: nothing was refused at load. */
  int listed = 0;
  while (opgraft__op_list[listed]) ++listed;
  assert_int_equal(listed, n);
  const og_op stray = toy();
  assert_false(opgraft__op_ok(&stray));
  assert_null(opgraft__find_tunable("toy.warps", NULL));
}

static void test_abi_layout(void **state) {
  /* The layout is valid JSON with the ABI version, the structs and every status code. */
  const char *text = opgraft_abi_layout();
  char err[256];
  og_json *j = opgraft__json_parse(text, strlen(text), err, sizeof err);
  if (!j) fail_msg("opgraft_abi_layout() is not JSON: %s\n%s", err, text);
  const og_json *abi = opgraft__json_get(j, "abi");
  assert_non_null(abi);
  assert_int_equal((int)abi->number, OPGRAFT_ABI_VERSION);
  const og_json *structs = opgraft__json_get(j, "structs");
  assert_non_null(structs);
  const og_json *ki = opgraft__json_get(structs, "opgraft_kernel_info");
  assert_non_null(ki);
  assert_int_equal((size_t)opgraft__json_get(ki, "size")->number, sizeof(opgraft_kernel_info));
  const og_json *reg = opgraft__json_get(opgraft__json_get(ki, "fields"), "registers");
  assert_non_null(reg);
  assert_int_equal((size_t)reg->child->number, offsetof(opgraft_kernel_info, registers));
  const og_json *status = opgraft__json_get(j, "status");
  assert_int_equal((int)opgraft__json_get(status, "OPGRAFT_ESTALE")->number, OPGRAFT_ESTALE);
  opgraft__json_free(j);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_good_descriptor),
      cmocka_unit_test(test_bad_descriptors),
      cmocka_unit_test(test_registered_ops),
      cmocka_unit_test(test_abi_layout),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
