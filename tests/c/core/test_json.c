/* The strict JSON reader behind tune files: accepted documents and rejected ones. */
#include "og_test.h"

static og_json *parse_ok(const char *text) {
  char err[256] = "";
  og_json *j = opgraft__json_parse(text, strlen(text), err, sizeof err);
  if (!j) fail_msg("parsing %s failed: %s", text, err);
  return j;
}

/* Parses text expecting an error with a position; returns the message in err. */
static void parse_bad_len(const char *text, size_t len, char *err, size_t err_len) {
  err[0] = 0;
  og_json *j = opgraft__json_parse(text, len, err, err_len);
  if (j) {
    opgraft__json_free(j);
    fail_msg("\"%s\" was accepted but is not valid JSON", text);
  }
  if (!strstr(err, "line ") || !strstr(err, "column "))
    fail_msg("the error for \"%s\" gives no line and column: \"%s\"", text, err);
}

static void parse_bad(const char *text) {
  char err[256];
  parse_bad_len(text, strlen(text), err, sizeof err);
}

static const og_json *nth(const og_json *container, int n) {
  const og_json *c = container->child;
  while (c && n--) c = c->next;
  assert_non_null(c);
  return c;
}

static int count_children(const og_json *container) {
  int n = 0;
  for (const og_json *c = container->child; c; c = c->next) ++n;
  return n;
}

static void test_nested(void **state) {
  og_json *j = parse_ok(" {\"a\": {\"b\": [1, [2, {\"c\": []}], {}]},\n \"d\": \"x\"} \n");
  assert_int_equal(j->type, OG_JSON_OBJECT);
  assert_int_equal(count_children(j), 2);
  const og_json *a = opgraft__json_get(j, "a");
  assert_non_null(a);
  assert_int_equal(a->type, OG_JSON_OBJECT);
  const og_json *b = opgraft__json_get(a, "b");
  assert_non_null(b);
  assert_int_equal(b->type, OG_JSON_ARRAY);
  assert_int_equal(count_children(b), 3);
  assert_int_equal(nth(b, 0)->type, OG_JSON_NUMBER);
  assert_true(nth(b, 0)->number == 1.0);
  const og_json *inner = nth(b, 1);
  assert_int_equal(inner->type, OG_JSON_ARRAY);
  assert_true(nth(inner, 0)->number == 2.0);
  const og_json *c = opgraft__json_get(nth(inner, 1), "c");
  assert_non_null(c);
  assert_int_equal(c->type, OG_JSON_ARRAY);
  assert_null(c->child);
  assert_int_equal(nth(b, 2)->type, OG_JSON_OBJECT);
  assert_null(nth(b, 2)->child);
  const og_json *d = opgraft__json_get(j, "d");
  assert_non_null(d);
  assert_int_equal(d->type, OG_JSON_STRING);
  assert_string_equal(d->string, "x");
  assert_null(opgraft__json_get(j, "missing"));
  assert_null(opgraft__json_get(b, "a")); /* not an object */
  opgraft__json_free(j);
}

static void test_numbers(void **state) {
  og_json *j = parse_ok("[0, -0, 12, -7, 3.25, -0.5, 1e3, 1E+2, 2.5e-3, -1.5E-2, 123456789012, 7e0]");
  const double expect[] = {0, -0.0, 12, -7, 3.25, -0.5, 1000, 100, 2.5e-3, -1.5e-2, 123456789012.0, 7};
  const int n = (int)(sizeof expect / sizeof *expect);
  assert_int_equal(count_children(j), n);
  for (int i = 0; i < n; ++i) {
    const og_json *v = nth(j, i);
    assert_int_equal(v->type, OG_JSON_NUMBER);
    if (v->number != expect[i]) fail_msg("number %d: %.17g != %.17g", i, v->number, expect[i]);
  }
  opgraft__json_free(j);

  og_json *top = parse_ok("-42");
  assert_int_equal(top->type, OG_JSON_NUMBER);
  assert_true(top->number == -42.0);
  opgraft__json_free(top);
}

static void test_strings(void **state) {
  og_json *j = parse_ok("[\"a\\nb\", \"q\\\"q\", \"back\\\\slash\", \"caf\\u00e9\", \"\\/\\b\\f\\r\\t\", "
                        "\"\\u0041\\u20AC\", \"raw caf\xc3\xa9\", \"\"]");
  const char *expect[] = {"a\nb",      "q\"q",         "back\\slash", "caf\xc3\xa9",
                          "/\b\f\r\t", "A\xe2\x82\xac", "raw caf\xc3\xa9", ""};
  const int n = (int)(sizeof expect / sizeof *expect);
  assert_int_equal(count_children(j), n);
  for (int i = 0; i < n; ++i) {
    assert_int_equal(nth(j, i)->type, OG_JSON_STRING);
    assert_string_equal(nth(j, i)->string, expect[i]);
  }
  opgraft__json_free(j);
}

static void test_literals(void **state) {
  og_json *j = parse_ok("[true, false, null]");
  assert_int_equal(nth(j, 0)->type, OG_JSON_BOOL);
  assert_int_equal(nth(j, 0)->boolean, 1);
  assert_int_equal(nth(j, 1)->type, OG_JSON_BOOL);
  assert_int_equal(nth(j, 1)->boolean, 0);
  assert_int_equal(nth(j, 2)->type, OG_JSON_NULL);
  opgraft__json_free(j);
}

static void test_duplicate_keys_last_wins(void **state) {
  og_json *j = parse_ok("{\"k\": 1, \"other\": 0, \"k\": 2}");
  const og_json *k = opgraft__json_get(j, "k");
  assert_non_null(k);
  assert_true(k->number == 2.0);
  opgraft__json_free(j);
}

static void test_length_is_respected(void **state) {
  /* Only the first len bytes are read: what follows them does not matter. */
  char err[256] = "";
  og_json *j = opgraft__json_parse("[1]xyz", 3, err, sizeof err);
  assert_non_null(j);
  opgraft__json_free(j);
  parse_bad_len("[1]", 2, err, sizeof err);
}

static void test_invalid_documents(void **state) {
  const char *bad[] = {
      /* trailing commas */
      "[1, 2,]", "{\"a\": 1,}", "[,]",
      /* missing colon or separators */
      "{\"a\" 1}", "{\"a\": 1 \"b\": 2}", "[1 2]", "{1: 2}",
      /* unterminated */
      "\"abc", "[\"abc", "{\"a\": \"b", "[1, 2", "{\"a\": 1",
      /* control characters in strings */
      "\"a\tb\"", "\"a\nb\"", "\"\x01\"", "\"\x1f\"",
      /* bad escapes */
      "\"\\x\"", "\"\\u12G4\"", "\"\\u12\"",
      /* a NUL would cut the C string: a key "moe.max_tokens\u0000junk" must not read as moe.max_tokens */
      "\"a\\u0000b\"", "{\"moe.max_tokens\\u0000junk\": 3}",
      /* leading zeros and bad numbers */
      "01", "[00]", "-01", "1.", ".5", "1e", "1e+", "+1", "-", "0x10",
      /* bare words */
      "tru", "nul", "True", "undefined", "[fals]", "nan", "Infinity", "abc",
      /* trailing garbage */
      "{} x", "[1] ]", "1 2", "truex", "{}}",
      /* empty input */
      "", "   \n\t",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; ++i) parse_bad(bad[i]);
}

static void test_error_position(void **state) {
  char err[256];
  const char *t1 = "{\n  \"a\": tru\n}";
  parse_bad_len(t1, strlen(t1), err, sizeof err);
  assert_non_null(strstr(err, "line 2, column 8"));
  const char *t2 = "[1,\n 2,\n ]";
  parse_bad_len(t2, strlen(t2), err, sizeof err);
  assert_non_null(strstr(err, "line 3, column 2"));
  parse_bad_len("", 0, err, sizeof err);
  assert_non_null(strstr(err, "line 1, column 1"));
}

static void test_unterminated_string_ending_in_backslash(void **state) {
  /* A string cut off right after a backslash is unterminated like any other. */
  parse_bad("\"abc\\");
  parse_bad("\"\\");
}

/* n nested arrays around the number 1. */
static char *nested(int n) {
  char *s = malloc((size_t)n * 2 + 2);
  assert_non_null(s);
  memset(s, '[', (size_t)n);
  s[n] = '1';
  memset(s + n + 1, ']', (size_t)n);
  s[2 * n + 1] = 0;
  return s;
}

static void test_depth_limit(void **state) {
  char *ok = nested(32);
  og_json *j = parse_ok(ok);
  opgraft__json_free(j);
  free(ok);
  const int too_deep[] = {33, 100, 100000};
  for (size_t i = 0; i < sizeof too_deep / sizeof *too_deep; ++i) {
    char *s = nested(too_deep[i]);
    char err[256];
    parse_bad_len(s, strlen(s), err, sizeof err);
    assert_non_null(strstr(err, "nested too deeply"));
    free(s);
  }
}

static void test_null_input(void **state) {
  char err[256] = "";
  assert_null(opgraft__json_parse(NULL, 0, err, sizeof err));
  assert_true(err[0] != 0);
  /* No error buffer is fine too. */
  assert_null(opgraft__json_parse("[", 1, NULL, 0));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nested),
      cmocka_unit_test(test_numbers),
      cmocka_unit_test(test_strings),
      cmocka_unit_test(test_literals),
      cmocka_unit_test(test_duplicate_keys_last_wins),
      cmocka_unit_test(test_length_is_respected),
      cmocka_unit_test(test_invalid_documents),
      cmocka_unit_test(test_error_position),
      cmocka_unit_test(test_unterminated_string_ending_in_backslash),
      cmocka_unit_test(test_depth_limit),
      cmocka_unit_test(test_null_input),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
