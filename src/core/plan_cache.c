/* The plans behind the ops' argument-struct entry points (opgraft_<op>_run): a fixed ring per op,
 * oldest out first. A lookup copies the plan out under the lock, as the ring may free it after. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int opgraft__plan_cache_find(og_plan_cache *c, og_CUcontext ctx, int (*match)(const void *plan, const void *key),
                             const void *key, void *out, size_t size) {
  const uint32_t gen = opgraft__tune_generation();
  int found = 0;
  pthread_mutex_lock(&c->lock);
  for (int i = 0; i < c->n && !found; ++i) {
    const og_plan_head *h = c->slots[i];
    if (h->ctx == ctx && h->tune_gen == gen && match(h, key)) memcpy(out, h, size), found = 1;
  }
  pthread_mutex_unlock(&c->lock);
  return found;
}

void opgraft__plan_cache_put(og_plan_cache *c, void *plan) {
  pthread_mutex_lock(&c->lock);
  if (c->n < c->cap) {
    c->slots[c->n++] = plan;
  } else {
    free(c->slots[c->next]);
    c->slots[c->next] = plan;
    c->next = (c->next + 1) % c->cap;
  }
  pthread_mutex_unlock(&c->lock);
}
