/* The plan cache of the ops' argument-struct entry points: found by the op's match, copied out,
 * oldest freed first when full. */
#include <stdlib.h>

#include "og_test.h"

typedef struct fake_plan {
  og_plan_head head; /* no context, the current tunables */
  int id;
  int payload[4];
} fake_plan;

static int match_id(const void *plan, const void *key) { return ((const fake_plan *)plan)->id == *(const int *)key; }

static fake_plan *made(int id) {
  fake_plan *p = calloc(1, sizeof *p);
  assert_non_null(p);
  p->head.tune_gen = opgraft__tune_generation();
  p->id = id;
  p->payload[3] = 10 * id;
  return p;
}

OG_PLAN_CACHE(cache, 3);

static void test_find_put_and_evict_oldest(void **state) {
  fake_plan out = {0};
  int key = 1;
  assert_int_equal(opgraft__plan_cache_find(&cache, NULL, match_id, &key, &out, sizeof out), 0);
  for (int id = 1; id <= 3; ++id) opgraft__plan_cache_put(&cache, made(id));
  assert_int_equal(opgraft__plan_cache_find(&cache, NULL, match_id, &key, &out, sizeof out), 1);
  assert_int_equal(out.id, 1);
  assert_int_equal(out.payload[3], 10);
  opgraft__plan_cache_put(&cache, made(4)); /* full: plan 1 (the oldest) goes */
  assert_int_equal(opgraft__plan_cache_find(&cache, NULL, match_id, &key, &out, sizeof out), 0);
  for (key = 2; key <= 4; ++key) {
    assert_int_equal(opgraft__plan_cache_find(&cache, NULL, match_id, &key, &out, sizeof out), 1);
    assert_int_equal(out.payload[3], 10 * key);
  }
  opgraft__plan_cache_put(&cache, made(5)); /* then plan 2 */
  key = 2;
  assert_int_equal(opgraft__plan_cache_find(&cache, NULL, match_id, &key, &out, sizeof out), 0);
  key = 3;
  assert_int_equal(opgraft__plan_cache_find(&cache, NULL, match_id, &key, &out, sizeof out), 1);
  assert_int_equal(cache.n, 3);
}

OG_PLAN_CACHE(stale, 4);

/* Only plans of this context and of the current tunables are found. */
static void test_find_skips_other_contexts_and_tunables(void **state) {
  fake_plan out = {0}, *p = made(7);
  int key = 7;
  opgraft__plan_cache_put(&stale, p);
  assert_int_equal(opgraft__plan_cache_find(&stale, NULL, match_id, &key, &out, sizeof out), 1);
  assert_int_equal(opgraft__plan_cache_find(&stale, (og_CUcontext)0x10, match_id, &key, &out, sizeof out), 0);
  opgraft_tune_reload(); /* a new generation */
  assert_int_equal(opgraft__plan_cache_find(&stale, NULL, match_id, &key, &out, sizeof out), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_find_put_and_evict_oldest),
                                     cmocka_unit_test(test_find_skips_other_contexts_and_tunables)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
