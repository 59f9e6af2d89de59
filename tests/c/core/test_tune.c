/* Tunables: set > environment > $OPGRAFT_TUNE_FILE > the op's baked rows > its rule > default,
 * and malformed sources. The MoE op's keys serve as the examples; the baked-table checks cover the
 * keys of every registered op. */
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "og_test.h"
#include "moe/moe.h"

static char tmp[512];

/* The MoE op's keys and their fallbacks (src/ops/moe/table.c), used where neither a baked row nor
 * the op's rule gives a value. */
static const struct {
  const char *key;
  int64_t fallback;
} defaults[] = {
    {"moe.max_tokens", 1},         {"moe.gate_up.warps", 8},      {"moe.gate_up.unroll", 4},
    {"moe.gate_up.min_blocks", 0}, {"moe.gate_up.nt", 0},         {"moe.gate_up.one_token", 0},
    {"moe.gate_up.slot_routing", 0}, {"moe.down.warps", 8},       {"moe.down.unroll", 4},
    {"moe.down.min_blocks", 0},    {"moe.down.early", 0},         {"moe.down.one_token", 0},
    {"moe.down.warp_routing", 0},  {"moe.fused", 0},              {"moe.l2_fetch", 0},
    {"moe.expert_map", 1},         {"moe.pdl", 0},                {"moe.pdl_in", 0},
    {"moe.load", 4},               {"moe.down_load", 1},          {"moe.fp8", 0},
};
#define N_KEYS ((int)(sizeof defaults / sizeof *defaults))

static void clear_sources(void) {
  og_unsetenv_prefix("OPGRAFT_TUNE_");
  opgraft_tune_reload();
}

static int setup(void **state) {
  og_tmpdir(tmp, sizeof tmp);
  clear_sources();
  og_log_start();
  return 0;
}

static int teardown(void **state) {
  og_log_stop();
  clear_sources();
  og_rm_rf(tmp);
  return 0;
}

/* Before each test: no tunable variables, nothing captured. */
static int fresh(void **state) {
  clear_sources();
  og_log_reset();
  return 0;
}

/* Writes a tune file named name in the temporary directory, points $OPGRAFT_TUNE_FILE at it, and
 * forgets the previous file. */
static const char *use_file(const char *name, const char *text) {
  static char path[1024];
  snprintf(path, sizeof path, "%s/%s", tmp, name);
  og_write_file(path, text);
  setenv("OPGRAFT_TUNE_FILE", path, 1);
  opgraft_tune_reload();
  return path;
}

static int64_t lookup(const char *key, int32_t arch, const char *gpu, const char *shape, int32_t tokens,
                      char *source, size_t source_len) {
  const opgraft_tune_query q = {key, arch, gpu, shape, tokens};
  int64_t v = -12345;
  const int32_t st = opgraft_tune_get(&q, &v, source, source_len);
  if (st != OPGRAFT_OK) fail_msg("opgraft_tune_get(%s) failed: %s", key, opgraft_last_error());
  return v;
}

#define BAKED (opgraft__moe_op.rows)
#define NBAKED (opgraft__moe_op.nrows)

/* What the baked table of the key's op gives for a query, per the documented rule (the most
 * specific matching row, then the later one), else the op's rule, else the key's fallback; writes
 * the expected source. */
static int64_t baked_expect(const opgraft_tune_query *q, char *source, size_t len) {
  const og_op *op = NULL;
  const og_tunable *tun = opgraft__find_tunable(q->key, &op);
  if (!tun || !op) fail_msg("%s is not a registered key", q->key);
  int best = -1, best_score = -1;
  for (int i = 0; i < op->nrows; ++i) {
    const og_tune_entry *r = &op->rows[i];
    if (strcmp(r->key, q->key) != 0) continue;
    if (r->arch && r->arch != q->arch) continue;
    if (r->tokens_lo && (q->tokens < r->tokens_lo || q->tokens > r->tokens_hi)) continue;
    if (r->gpu && (!q->gpu || strcmp(r->gpu, q->gpu) != 0)) continue;
    if (r->shape && (!q->shape || strcmp(r->shape, q->shape) != 0)) continue;
    const int score = (r->shape ? 8 : 0) + (r->gpu ? 4 : 0) + (r->tokens_lo ? 2 : 0) + (r->arch ? 1 : 0);
    if (score >= best_score) best = i, best_score = score;
  }
  if (best >= 0) {
    const og_tune_entry *r = &op->rows[best];
    if (r->arch) snprintf(source, len, "baked:sm_%d", r->arch);
    else snprintf(source, len, "baked:any");
    return r->value;
  }
  int64_t v = 0;
  if (op->rule && op->rule(q, &v)) {
    snprintf(source, len, "rule");
    return v;
  }
  snprintf(source, len, "default");
  for (int i = 0; i < N_KEYS; ++i)
    if (strcmp(defaults[i].key, q->key) == 0) assert_int_equal(defaults[i].fallback, tun->fallback);
  return tun->fallback;
}

/* The keys of every registered op. */
static int registered_keys(void) {
  int n = 0, nops = 0;
  const og_op *const *ops = opgraft__ops(&nops);
  for (int i = 0; i < nops; ++i) n += ops[i]->ntunables;
  return n;
}

/* Asserts that a lookup resolves from the baked table (or the default), as baked_expect says. */
static void assert_baked(const char *key, int32_t arch, const char *gpu, const char *shape, int32_t tokens) {
  const opgraft_tune_query q = {key, arch, gpu, shape, tokens};
  char want_src[64], src[256];
  const int64_t want = baked_expect(&q, want_src, sizeof want_src);
  const int64_t got = lookup(key, arch, gpu, shape, tokens, src, sizeof src);
  if (got != want || strcmp(src, want_src) != 0)
    fail_msg("%s sm_%d gpu=%s shape=%s T=%d: got %lld from %s, expected %lld from %s", key, arch,
             gpu ? gpu : "-", shape ? shape : "-", tokens, (long long)got, src, (long long)want, want_src);
}

static void assert_from_file(const char *key, int32_t arch, const char *gpu, const char *shape, int32_t tokens,
                             int64_t want, const char *path) {
  char src[1200], want_src[1100];
  snprintf(want_src, sizeof want_src, "file:%s", path);
  const int64_t got = lookup(key, arch, gpu, shape, tokens, src, sizeof src);
  /* The source may add an entry index after the path ("#2"). */
  if (got != want || strncmp(src, want_src, strlen(want_src)) != 0)
    fail_msg("%s sm_%d gpu=%s shape=%s T=%d: got %lld from %s, expected %lld from %s", key, arch,
             gpu ? gpu : "-", shape ? shape : "-", tokens, (long long)got, src, (long long)want, want_src);
}

static void test_keys(void **state) {
  const char *const *keys = opgraft_tune_keys();
  assert_non_null(keys);
  int n = 0;
  while (keys[n]) {
    for (int j = 0; j < n; ++j) assert_string_not_equal(keys[j], keys[n]);
    ++n;
    assert_true(n <= 256);
  }
  assert_int_equal(n, registered_keys());
  for (int i = 0; i < N_KEYS; ++i) {
    int found = 0;
    for (int j = 0; j < n; ++j) found |= strcmp(keys[j], defaults[i].key) == 0;
    if (!found) fail_msg("opgraft_tune_keys() lacks %s", defaults[i].key);
  }
  /* Every key resolves, and every key of the baked table is listed. */
  for (int j = 0; j < n; ++j) lookup(keys[j], 90, NULL, NULL, 1, NULL, 0);
  for (int i = 0; i < NBAKED; ++i) {
    int found = 0;
    for (int j = 0; j < n; ++j) found |= strcmp(keys[j], BAKED[i].key) == 0;
    if (!found) fail_msg("baked row %d has key %s, which opgraft_tune_keys() lacks", i, BAKED[i].key);
  }
  /* Ranges: known keys only. */
  int64_t lo = -1, hi = -1;
  assert_int_equal(opgraft_tune_range("moe.max_tokens", &lo, &hi), OPGRAFT_OK);
  assert_int_equal(lo, 0);
  assert_int_equal(hi, 64);
  assert_int_equal(opgraft_tune_range("moe.bogus", &lo, &hi), OPGRAFT_ENOTFOUND);
}

static void test_bad_arguments(void **state) {
  int64_t v = 0;
  const opgraft_tune_query q = {"moe.max_tokens", 90, NULL, NULL, 1};
  const opgraft_tune_query no_key = {NULL, 90, NULL, NULL, 1};
  const opgraft_tune_query unknown = {"moe.no_such_key", 90, NULL, NULL, 1};
  assert_int_equal(opgraft_tune_get(NULL, &v, NULL, 0), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_tune_get(&q, NULL, NULL, 0), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_tune_get(&no_key, &v, NULL, 0), OPGRAFT_EINVAL);
  assert_int_equal(opgraft_tune_get(&unknown, &v, NULL, 0), OPGRAFT_ENOTFOUND);
  assert_non_null(strstr(opgraft_last_error(), "moe.no_such_key"));
  /* A NULL source is allowed, and a short one is truncated, terminated. */
  assert_int_equal(opgraft_tune_get(&q, &v, NULL, 0), OPGRAFT_OK);
  setenv("OPGRAFT_TUNE_MOE_MAX_TOKENS", "3", 1);
  char small[4];
  memset(small, 'z', sizeof small);
  assert_int_equal(opgraft_tune_get(&q, &v, small, sizeof small), OPGRAFT_OK);
  assert_int_equal(v, 3);
  assert_string_equal(small, "env");
}

static void test_baked_table(void **state) {
  /* With no environment and no file, every lookup follows the baked table, falling back to the
   * default. The queries cover each row's arch, shape and token bounds. */
  const int32_t archs[] = {75, 80, 86, 89, 90, 100};
  const int32_t tokens[] = {0, 1, 4, 5, 8, 64};
  const char *const *keys = opgraft_tune_keys();
  for (int k = 0; keys[k]; ++k)
    for (size_t a = 0; a < sizeof archs / sizeof *archs; ++a)
      for (size_t t = 0; t < sizeof tokens / sizeof *tokens; ++t) {
        assert_baked(keys[k], archs[a], NULL, NULL, tokens[t]);
        assert_baked(keys[k], archs[a], "NVIDIA H200", "moe:bf16:E1:H32:I32:k1", tokens[t]);
        assert_baked(keys[k], archs[a], "NVIDIA H200", "linear:bf16:N5120:K2048", tokens[t]);
        int nops = 0;
        const og_op *const *ops = opgraft__ops(&nops);
        for (int o = 0; o < nops; ++o)
          for (int i = 0; i < ops[o]->nrows; ++i) {
            const og_tune_entry *r = &ops[o]->rows[i];
            assert_baked(keys[k], archs[a], r->gpu, r->shape, tokens[t]);
            if (r->tokens_lo) {
              assert_baked(keys[k], archs[a], r->gpu, r->shape, r->tokens_lo);
              assert_baked(keys[k], archs[a], r->gpu, r->shape, r->tokens_hi);
              assert_baked(keys[k], archs[a], r->gpu, r->shape, r->tokens_hi + 1);
            }
          }
      }
  /* The convenience wrapper agrees. */
  char src[64];
  const opgraft_tune_query q = {"moe.down.warps", 90, NULL, "moe:bf16:E128:H2048:I768:k8", 1};
  assert_int_equal(opgraft__tune_value(q.key, q.arch, q.gpu, q.shape, q.tokens), baked_expect(&q, src, sizeof src));
  /* The programmatic dependent launch: on for the small Qwen shapes it was measured on, sm_90
   * only, off for Mixtral (measured slower) and for shapes nobody measured. */
  assert_int_equal(opgraft__tune_value("moe.pdl", 90, NULL, "moe:bf16:E128:H2048:I768:k8", 1), 1);
  assert_int_equal(opgraft__tune_value("moe.pdl", 90, NULL, "moe:bf16:E128:H2048:I768:k8", 8), 0);
  assert_int_equal(opgraft__tune_value("moe.pdl", 80, NULL, "moe:bf16:E128:H2048:I768:k8", 1), 0);
  assert_int_equal(opgraft__tune_value("moe.pdl", 90, NULL, "moe:bf16:E8:H4096:I14336:k2", 1), 0);
  assert_int_equal(opgraft__tune_value("moe.pdl", 90, NULL, "moe:bf16:E384:H7168:I2048:k8", 1), 0);
  /* gate_up after the previous kernel under PDL: the small Qwen shapes at T=1 (and 2), not Mixtral. */
  assert_int_equal(opgraft__tune_value("moe.pdl_in", 90, NULL, "moe:bf16:E128:H2048:I768:k8", 2), 1);
  assert_int_equal(opgraft__tune_value("moe.pdl_in", 90, NULL, "moe:bf16:E128:H2048:I768:k8", 4), 0);
  assert_int_equal(opgraft__tune_value("moe.pdl_in", 90, NULL, "moe:bf16:E8:H4096:I14336:k2", 1), 0);
  /* The one-token routing paths: every shape at T=1, nowhere else. */
  assert_int_equal(opgraft__tune_value("moe.gate_up.one_token", 80, NULL, "moe:bf16:E8:H4096:I14336:k2", 1), 1);
  assert_int_equal(opgraft__tune_value("moe.down.one_token", 90, NULL, "moe:bf16:E384:H7168:I2048:k8", 1), 1);
  assert_int_equal(opgraft__tune_value("moe.down.one_token", 90, NULL, "moe:bf16:E384:H7168:I2048:k8", 2), 0);
  /* Routing by slot / per warp: 2..4 tokens (up to 32 slots at k=8; Mixtral-8x7B lost at 8). */
  assert_int_equal(opgraft__tune_value("moe.gate_up.slot_routing", 90, NULL, "moe:bf16:E8:H4096:I14336:k2", 4), 1);
  assert_int_equal(opgraft__tune_value("moe.gate_up.slot_routing", 90, NULL, "moe:bf16:E8:H4096:I14336:k2", 8), 0);
  assert_int_equal(opgraft__tune_value("moe.down.warp_routing", 90, NULL, "moe:bf16:E128:H2048:I768:k8", 1), 0);
  assert_int_equal(opgraft__tune_value("moe.down.warp_routing", 90, NULL, "moe:bf16:E128:H2048:I768:k8", 2), 1);
}

static void test_precedence(void **state) {
  const char *key = "moe.max_tokens";
  char src[1200];
  assert_baked(key, 90, NULL, NULL, 1);

  const char *path = use_file("precedence.json",
                              "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 33}}]}");
  assert_from_file(key, 90, NULL, NULL, 1, 33, path);
  /* Keys the file does not set still come from the baked table. */
  assert_baked("moe.gate_up.unroll", 90, NULL, NULL, 1);

  setenv("OPGRAFT_TUNE_MOE_MAX_TOKENS", "17", 1);
  assert_int_equal(lookup(key, 90, NULL, NULL, 1, src, sizeof src), 17);
  assert_string_equal(src, "env:OPGRAFT_TUNE_MOE_MAX_TOKENS");

  unsetenv("OPGRAFT_TUNE_MOE_MAX_TOKENS");
  assert_from_file(key, 90, NULL, NULL, 1, 33, path);

  unsetenv("OPGRAFT_TUNE_FILE");
  assert_baked(key, 90, NULL, NULL, 1);
  assert_int_equal(og_log_warnings(NULL), 0);
}

static void test_env_values(void **state) {
  char src[256];
  const struct {
    const char *text;
    int64_t value;
  } good[] = {{"0", 0}, {"64", 64}, {"12", 12}, {" 12 ", 12}};
  for (size_t i = 0; i < sizeof good / sizeof *good; ++i) {
    setenv("OPGRAFT_TUNE_MOE_MAX_TOKENS", good[i].text, 1);
    assert_int_equal(lookup("moe.max_tokens", 90, NULL, NULL, 1, src, sizeof src), good[i].value);
    assert_string_equal(src, "env:OPGRAFT_TUNE_MOE_MAX_TOKENS");
  }
  /* Every key has its variable. */
  setenv("OPGRAFT_TUNE_MOE_GATE_UP_WARPS", "2", 1);
  assert_int_equal(lookup("moe.gate_up.warps", 90, NULL, NULL, 1, src, sizeof src), 2);
  assert_string_equal(src, "env:OPGRAFT_TUNE_MOE_GATE_UP_WARPS");
  assert_int_equal(og_log_warnings(NULL), 0);
}

static void test_malformed_env_values(void **state) {
  const char *bad[] = {"abc", "12x", "9999", "65", "-1", " ", "1.5", "0x10", "99999999999999999999"};
  const char *path = use_file("env-fallback.json",
                              "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 33}}]}");
  for (size_t i = 0; i < sizeof bad / sizeof *bad; ++i) {
    og_log_reset();
    setenv("OPGRAFT_TUNE_MOE_MAX_TOKENS", bad[i], 1);
    setenv("OPGRAFT_TUNE_FILE", path, 1);
    /* Ignored: the file's value is used. */
    assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 33, path);
    assert_from_file("moe.max_tokens", 90, NULL, NULL, 2, 33, path);
    /* Without the file, the baked table. */
    unsetenv("OPGRAFT_TUNE_FILE");
    assert_baked("moe.max_tokens", 90, NULL, NULL, 1);
    /* One warning over the three lookups, naming the variable. */
    if (og_log_warnings(NULL) != 1 || og_log_warnings("OPGRAFT_TUNE_MOE_MAX_TOKENS") != 1) {
      og_log_dump();
      fail_msg("OPGRAFT_TUNE_MOE_MAX_TOKENS=\"%s\": %d warnings, expected one", bad[i], og_log_warnings(NULL));
    }
  }
}

static void test_empty_env_is_unset(void **state) {
  setenv("OPGRAFT_TUNE_MOE_MAX_TOKENS", "", 1);
  assert_baked("moe.max_tokens", 90, NULL, NULL, 1);
  assert_int_equal(og_log_warnings(NULL), 0);
}

static void test_set_and_clear(void **state) {
  char src[256];
  const uint32_t gen = opgraft_tune_generation();
  setenv("OPGRAFT_TUNE_MOE_DOWN_WARPS", "2", 1);
  assert_int_equal(opgraft_tune_set("moe.down.warps", 16), OPGRAFT_OK);
  assert_true(opgraft_tune_generation() != gen);
  /* Above the environment. */
  assert_int_equal(lookup("moe.down.warps", 90, NULL, NULL, 1, src, sizeof src), 16);
  assert_string_equal(src, "set");
  assert_int_equal(opgraft_tune_set("moe.down.warps", 4), OPGRAFT_OK);
  assert_int_equal(lookup("moe.down.warps", 90, NULL, NULL, 1, NULL, 0), 4);
  /* Out of range or unknown: refused, nothing changes. */
  assert_int_equal(opgraft_tune_set("moe.down.warps", 17), OPGRAFT_ERANGE);
  assert_non_null(strstr(opgraft_last_error(), "moe.down.warps"));
  assert_int_equal(opgraft_tune_set("moe.bogus", 1), OPGRAFT_ENOTFOUND);
  assert_int_equal(opgraft_tune_set(NULL, 1), OPGRAFT_ENOTFOUND);
  assert_int_equal(lookup("moe.down.warps", 90, NULL, NULL, 1, NULL, 0), 4);
  /* Clearing one key, then all. */
  assert_int_equal(opgraft_tune_set("moe.gate_up.warps", 2), OPGRAFT_OK);
  assert_int_equal(opgraft_tune_clear("moe.down.warps"), OPGRAFT_OK);
  assert_int_equal(lookup("moe.down.warps", 90, NULL, NULL, 1, src, sizeof src), 2);
  assert_string_equal(src, "env:OPGRAFT_TUNE_MOE_DOWN_WARPS");
  assert_int_equal(lookup("moe.gate_up.warps", 90, NULL, NULL, 1, src, sizeof src), 2);
  assert_string_equal(src, "set");
  assert_int_equal(opgraft_tune_clear("moe.bogus"), OPGRAFT_ENOTFOUND);
  assert_int_equal(opgraft_tune_clear(NULL), OPGRAFT_OK);
  unsetenv("OPGRAFT_TUNE_MOE_DOWN_WARPS");
  assert_baked("moe.gate_up.warps", 90, NULL, NULL, 1);
  assert_baked("moe.down.warps", 90, NULL, NULL, 1);
}

static void test_rules(void **state) {
  /* The MoE op's heuristics where no row matches: 8 tokens on sm_90, 1 elsewhere; gate_up warps
   * by H, down warps by the call's H/16 blocks. */
  char src[64];
  const char *other = "moe:bf16:E60:H2048:I1408:k4";
  assert_int_equal(lookup("moe.max_tokens", 90, NULL, other, 1, src, sizeof src), 8);
  assert_string_equal(src, "rule");
  assert_int_equal(lookup("moe.max_tokens", 80, NULL, other, 1, NULL, 0), 1);
  assert_int_equal(lookup("moe.max_tokens", 90, NULL, "moe:bf16:E384:H7168:I2048:k8", 1, src, sizeof src), 12);
  assert_string_equal(src, "baked:sm_90");
  assert_int_equal(lookup("moe.gate_up.warps", 90, NULL, other, 1, NULL, 0), 4);
  assert_int_equal(lookup("moe.gate_up.warps", 90, NULL, "moe:bf16:E16:H4096:I6400:k2", 1, NULL, 0), 8);
  assert_int_equal(lookup("moe.down.warps", 90, NULL, other, 1, NULL, 0), 16);
  assert_int_equal(lookup("moe.down.warps", 90, NULL, "moe:bf16:E16:H4096:I6400:k2", 1, NULL, 0), 8);
  assert_int_equal(lookup("moe.down.warps", 90, NULL, "moe:bf16:E256:H7168:I2048:k8", 1, NULL, 0), 4);
  assert_int_equal(lookup("moe.down.warps", 90, NULL, "moe:bf16:E8:H64:I32:k2", 1, NULL, 0), 16);
  /* A shape the rule cannot read: the key's fallback. */
  assert_int_equal(lookup("moe.down.warps", 90, NULL, "garbage", 1, src, sizeof src), 8);
  assert_string_equal(src, "default");
}

static void test_file_specificity(void **state) {
  const char *S = "moe:bf16:E8:H64:I32:k2";
  const char *path = use_file(
      "specific.json",
      "{\"version\": 1, \"entries\": [\n"
      " {\"values\": {\"moe.down.warps\": 2}, \"why\": \"#0 any\"},\n"
      " {\"arch\": 90, \"values\": {\"moe.down.warps\": 3}},\n"
      " {\"arch\": 90, \"values\": {\"moe.down.warps\": 4}, \"why\": \"#2 ties #1 and comes later\"},\n"
      " {\"tokens\": [1, 4], \"values\": {\"moe.down.warps\": 5}},\n"
      " {\"arch\": 90, \"tokens\": [1, 4], \"values\": {\"moe.down.warps\": 6}},\n"
      " {\"gpu\": \"NVIDIA H200\", \"values\": {\"moe.down.warps\": 7}},\n"
      " {\"arch\": 90, \"gpu\": \"NVIDIA H200\", \"tokens\": [1, 4], \"values\": {\"moe.down.warps\": 9}},\n"
      " {\"shape\": \"moe:bf16:E8:H64:I32:k2\", \"values\": {\"moe.down.warps\": 10}},\n"
      " {\"shape\": \"moe:bf16:E8:H64:I32:k2\", \"values\": {\"moe.down.warps\": 11}},\n"
      " {\"arch\": 80, \"values\": {\"moe.down.warps\": 12}},\n"
      " {\"gpu\": \"NVIDIA A100\", \"values\": {\"moe.down.warps\": 13}},\n"
      " {\"tokens\": [5, 64], \"values\": {\"moe.down.warps\": 14}}\n"
      "]}\n");
  const char *k = "moe.down.warps";
  assert_from_file(k, 75, NULL, NULL, 0, 2, path);          /* only the catch-all */
  assert_from_file(k, 90, NULL, NULL, 0, 4, path);          /* equal arch rows: the later */
  assert_from_file(k, 80, NULL, NULL, 0, 12, path);         /* arch beats nothing */
  assert_from_file(k, 80, NULL, NULL, 3, 5, path);          /* tokens beat arch */
  assert_from_file(k, 90, NULL, NULL, 3, 6, path);          /* arch + tokens beat tokens */
  assert_from_file(k, 90, NULL, NULL, 5, 14, path);         /* the other token range */
  assert_from_file(k, 80, "NVIDIA H200", NULL, 3, 7, path); /* gpu beats tokens + arch */
  assert_from_file(k, 90, "NVIDIA H200", NULL, 3, 9, path); /* gpu + tokens + arch */
  assert_from_file(k, 90, "NVIDIA H200", S, 3, 11, path);   /* shape beats everything; later tie */
  assert_from_file(k, 75, NULL, S, 0, 11, path);
  assert_from_file(k, 90, "NVIDIA A100", NULL, 3, 13, path); /* a different gpu */
  assert_from_file(k, 90, NULL, "moe:bf16:E8:H64:I32:k4", 0, 4, path); /* a different shape */
  assert_from_file(k, 75, NULL, NULL, 1, 5, path);          /* token bounds are inclusive */
  assert_from_file(k, 75, NULL, NULL, 4, 5, path);
  assert_from_file(k, 75, NULL, NULL, 64, 14, path);
  assert_from_file(k, 75, NULL, NULL, 65, 2, path);
  /* Keys the file does not set come from the baked table. */
  assert_baked("moe.down.unroll", 90, "NVIDIA H200", S, 3);
  assert_int_equal(og_log_warnings(NULL), 0);
}

/* A tune file that is rejected as a whole: one warning containing needle, then the baked table. */
static void check_rejected_file(const char *name, const char *text, const char *needle) {
  og_log_reset();
  use_file(name, text);
  for (int i = 0; i < 3; ++i) {
    assert_baked("moe.max_tokens", 90, NULL, NULL, 1);
    assert_baked("moe.down.warps", 90, NULL, "moe:bf16:E8:H64:I32:k2", 1);
  }
  if (og_log_warnings(NULL) != 1 || og_log_warnings(needle) != 1) {
    og_log_dump();
    fail_msg("tune file %s: expected one warning containing \"%s\"", name, needle);
  }
}

static void test_rejected_files(void **state) {
  check_rejected_file("malformed.json", "{\"version\": 1, \"entries\": [}", "not valid JSON");
  check_rejected_file("truncated.json", "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 3", "line");
  check_rejected_file("empty.json", "", "not valid JSON");
  check_rejected_file("version2.json", "{\"version\": 2, \"entries\": [{\"values\": {\"moe.max_tokens\": 3}}]}",
                      "\"version\" must be 1");
  check_rejected_file("version-string.json", "{\"version\": \"1\", \"entries\": []}", "\"version\" must be 1");
  check_rejected_file("no-version.json", "{\"entries\": [{\"values\": {\"moe.max_tokens\": 3}}]}",
                      "\"version\" must be 1");
  check_rejected_file("entries-object.json", "{\"version\": 1, \"entries\": {\"values\": {\"moe.max_tokens\": 3}}}",
                      "\"entries\" must be an array");
  check_rejected_file("no-entries.json", "{\"version\": 1}", "\"entries\" must be an array");
  check_rejected_file("top-array.json", "[{\"version\": 1}]", "top level must be an object");
  check_rejected_file("entry-number.json", "{\"version\": 1, \"entries\": [{\"values\": {}}, 7]}",
                      "each entry must be an object");
}

/* A tune file with one bad entry or value: one warning containing needle per lookup series,
 * moe.max_tokens from the baked table, and moe.down.unroll = 2 from the file's good entry. */
static void check_skipped_part(const char *name, const char *bad_entry, const char *needle) {
  char text[2048];
  snprintf(text, sizeof text,
           "{\"version\": 1, \"entries\": [%s, {\"values\": {\"moe.down.unroll\": 2}}]}", bad_entry);
  og_log_reset();
  const char *path = use_file(name, text);
  for (int i = 0; i < 3; ++i) {
    assert_baked("moe.max_tokens", 90, NULL, NULL, 2);
    assert_from_file("moe.down.unroll", 90, NULL, NULL, 2, 2, path);
  }
  if (og_log_warnings(NULL) != 1 || og_log_warnings(needle) != 1) {
    og_log_dump();
    fail_msg("tune file with %s: expected one warning containing \"%s\"", bad_entry, needle);
  }
}

static void test_skipped_entries_and_values(void **state) {
  /* Bad "tokens": the whole entry is skipped. */
  check_skipped_part("tokens-reversed.json", "{\"tokens\": [4, 1], \"values\": {\"moe.max_tokens\": 20}}", "\"tokens\"");
  check_skipped_part("tokens-zero.json", "{\"tokens\": [0, 4], \"values\": {\"moe.max_tokens\": 20}}", "\"tokens\"");
  check_skipped_part("tokens-one.json", "{\"tokens\": [1], \"values\": {\"moe.max_tokens\": 20}}", "\"tokens\"");
  check_skipped_part("tokens-three.json", "{\"tokens\": [1, 2, 3], \"values\": {\"moe.max_tokens\": 20}}", "\"tokens\"");
  check_skipped_part("tokens-string.json", "{\"tokens\": \"1-4\", \"values\": {\"moe.max_tokens\": 20}}", "\"tokens\"");
  check_skipped_part("tokens-strings.json", "{\"tokens\": [\"1\", \"4\"], \"values\": {\"moe.max_tokens\": 20}}", "\"tokens\"");
  /* Other bad fields of an entry. */
  check_skipped_part("arch-string.json", "{\"arch\": \"sm_90\", \"values\": {\"moe.max_tokens\": 20}}", "\"arch\"");
  check_skipped_part("arch-fraction.json", "{\"arch\": 90.5, \"values\": {\"moe.max_tokens\": 20}}", "\"arch\"");
  check_skipped_part("gpu-number.json", "{\"gpu\": 100, \"values\": {\"moe.max_tokens\": 20}}", "\"gpu\"");
  check_skipped_part("values-array.json", "{\"values\": [[\"moe.max_tokens\", 20]]}", "\"values\"");
  check_skipped_part("values-missing.json", "{\"arch\": 90}", "\"values\"");
  /* Bad values: only that value is skipped. */
  check_skipped_part("unknown-key.json", "{\"values\": {\"moe.bogus\": 3}}", "unknown key \"moe.bogus\"");
  check_skipped_part("range-high.json", "{\"values\": {\"moe.max_tokens\": 65}}", "moe.max_tokens");
  check_skipped_part("range-low.json", "{\"values\": {\"moe.max_tokens\": -1}}", "moe.max_tokens");
  check_skipped_part("range-huge.json", "{\"values\": {\"moe.max_tokens\": 1e30}}", "moe.max_tokens");
  check_skipped_part("fraction.json", "{\"values\": {\"moe.max_tokens\": 2.5}}", "moe.max_tokens");
  check_skipped_part("string-value.json", "{\"values\": {\"moe.max_tokens\": \"8\"}}", "moe.max_tokens");
  check_skipped_part("bool-value.json", "{\"values\": {\"moe.max_tokens\": true}}", "moe.max_tokens");

  /* A good value next to a bad one in the same entry is kept. */
  og_log_reset();
  const char *path = use_file("mixed.json",
                              "{\"version\": 1, \"entries\": [{\"values\": {\"moe.bogus\": 1, \"moe.max_tokens\": 21}}]}");
  assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 21, path);
  assert_int_equal(og_log_warnings("moe.bogus"), 1);
}

static void test_missing_or_unreadable_file(void **state) {
  char path[1024];
  snprintf(path, sizeof path, "%s/no-such-tune-file.json", tmp);
  setenv("OPGRAFT_TUNE_FILE", path, 1);
  opgraft_tune_reload();
  for (int i = 0; i < 3; ++i) assert_baked("moe.max_tokens", 90, NULL, NULL, 1);
  if (og_log_warnings(NULL) != 1 || og_log_warnings("cannot be read") != 1) {
    og_log_dump();
    fail_msg("a missing tune file should give one warning");
  }
  /* A directory is not a tune file either. */
  og_log_reset();
  setenv("OPGRAFT_TUNE_FILE", tmp, 1);
  opgraft_tune_reload();
  for (int i = 0; i < 3; ++i) assert_baked("moe.max_tokens", 90, NULL, NULL, 1);
  assert_int_equal(og_log_warnings(NULL), 1);
  /* Nor is a FIFO, which must not wait for a writer (the alarm turns a hang into a failure). */
  og_log_reset();
  char fifo[1100];
  snprintf(fifo, sizeof fifo, "%s/fifo.json", tmp);
  assert_int_equal(mkfifo(fifo, 0600), 0);
  setenv("OPGRAFT_TUNE_FILE", fifo, 1);
  opgraft_tune_reload();
  alarm(20);
  for (int i = 0; i < 3; ++i) assert_baked("moe.max_tokens", 90, NULL, NULL, 1);
  alarm(0);
  assert_int_equal(og_log_warnings("not a regular file"), 1);
  unlink(fifo);
  /* The file appearing later is picked up. */
  og_write_file(path, "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 29}}]}");
  setenv("OPGRAFT_TUNE_FILE", path, 1);
  assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 29, path);
}

/* Sets a file's modification time, leaving its access time. */
static void set_mtime(const char *path, struct timespec mtime) {
  const struct timespec times[2] = {{0, UTIME_OMIT}, mtime};
  assert_int_equal(utimensat(AT_FDCWD, path, times, 0), 0);
}

static struct timespec mtime_of(const char *path) {
  struct stat sb;
  assert_int_equal(stat(path, &sb), 0);
  return sb.st_mtim;
}

static void test_file_changes(void **state) {
  const char *path = use_file("changing.json", "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 30}}]}");
  assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 30, path);
  /* Rewritten with a different size (and the old modification time): picked up without a reload. */
  struct timespec t = mtime_of(path);
  og_write_file(path, "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 31}, \"why\": \"longer\"}]}");
  set_mtime(path, t);
  assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 31, path);
  /* Rewritten with the same size and the same time: opgraft_tune_reload() makes it read again. */
  t = mtime_of(path);
  og_write_file(path, "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 32}, \"why\": \"longer\"}]}");
  set_mtime(path, t);
  const uint32_t gen = opgraft__tune_generation();
  opgraft_tune_reload();
  assert_int_equal(opgraft__tune_generation(), gen + 1);
  assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 32, path);
  /* Rewritten with the same size and a later modification time: picked up without a reload. */
  t = mtime_of(path);
  og_write_file(path, "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 33}, \"why\": \"longer\"}]}");
  t.tv_sec += 7;
  set_mtime(path, t);
  assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 33, path);
  /* Turning into garbage: one warning, then the baked table. */
  og_log_reset();
  og_write_file(path, "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 3");
  for (int i = 0; i < 2; ++i) assert_baked("moe.max_tokens", 90, NULL, NULL, 1);
  assert_int_equal(og_log_warnings(NULL), 1);
  /* And fixed again. */
  og_write_file(path, "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 34}}]}");
  assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 34, path);
  /* Unsetting the variable drops the file. */
  unsetenv("OPGRAFT_TUNE_FILE");
  assert_baked("moe.max_tokens", 90, NULL, NULL, 1);
}

/* A byte-order mark before the JSON is skipped; a path of any length is read once and kept. */
static void test_bom_and_long_path(void **state) {
  const char *path = use_file("bom.json", "\xEF\xBB\xBF{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 27}}]}");
  assert_from_file("moe.max_tokens", 90, NULL, NULL, 1, 27, path);
  char dir[2400];
  snprintf(dir, sizeof dir, "%s", tmp);
  for (int i = 0; i < 12; ++i) { /* a path past 1024 bytes, the old fixed copy's size */
    const size_t n = strlen(dir);
    snprintf(dir + n, sizeof dir - n, "/%0120d", i);
    assert_int_equal(mkdir(dir, 0700), 0);
  }
  char longp[2500];
  snprintf(longp, sizeof longp, "%s/t.json", dir);
  assert_true(strlen(longp) > 1100);
  og_write_file(longp, "{\"version\": 1, \"entries\": [{\"values\": {\"moe.max_tokens\": 26}}]}");
  setenv("OPGRAFT_TUNE_FILE", longp, 1);
  opgraft_tune_reload();
  og_log_reset();
  char src[2600], want[2600];
  snprintf(want, sizeof want, "file:%s", longp);
  for (int i = 0; i < 3; ++i) assert_int_equal(lookup("moe.max_tokens", 90, NULL, NULL, 1, src, sizeof src), 26);
  assert_int_equal(strncmp(src, want, strlen(want)), 0); /* the whole path: the copy kept is the file read */
  assert_int_equal(og_log_warnings(NULL), 0);
  unsetenv("OPGRAFT_TUNE_FILE");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_keys, fresh),
      cmocka_unit_test_setup(test_bad_arguments, fresh),
      cmocka_unit_test_setup(test_baked_table, fresh),
      cmocka_unit_test_setup(test_precedence, fresh),
      cmocka_unit_test_setup(test_env_values, fresh),
      cmocka_unit_test_setup(test_malformed_env_values, fresh),
      cmocka_unit_test_setup(test_empty_env_is_unset, fresh),
      cmocka_unit_test_setup(test_set_and_clear, fresh),
      cmocka_unit_test_setup(test_rules, fresh),
      cmocka_unit_test_setup(test_file_specificity, fresh),
      cmocka_unit_test_setup(test_rejected_files, fresh),
      cmocka_unit_test_setup(test_skipped_entries_and_values, fresh),
      cmocka_unit_test_setup(test_missing_or_unreadable_file, fresh),
      cmocka_unit_test_setup(test_file_changes, fresh),
      cmocka_unit_test_setup(test_bom_and_long_path, fresh),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
