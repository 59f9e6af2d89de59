/* Content hashes for cache keys: two independent 64-bit FNV-1a streams. The cache file stores the
 * full key too, so a collision can only cost a recompile, never a wrong kernel. */
#include <stdio.h>

#include "internal.h"

/* FNV-1a parameters from the published FNV specification (offset basis, prime). */
#define OG_FNV_OFFSET 0xcbf29ce484222325ull
#define OG_FNV_PRIME 0x100000001b3ull

uint64_t opgraft__fnv1a64(const void *data, size_t len) {
  const unsigned char *p = data;
  uint64_t h = OG_FNV_OFFSET;
  for (size_t i = 0; i < len; ++i) h = (h ^ p[i]) * OG_FNV_PRIME;
  return h;
}

void opgraft__hash_init(og_hash *h) {
  h->a = OG_FNV_OFFSET;
  h->b = OG_FNV_OFFSET ^ 0x9e3779b97f4a7c15ull; /* a second basis: golden-ratio constant */
}

void opgraft__hash_update(og_hash *h, const void *data, size_t len) {
  const unsigned char *p = data;
  for (size_t i = 0; i < len; ++i) {
    h->a = (h->a ^ p[i]) * OG_FNV_PRIME;
    h->b = (h->b ^ (unsigned char)(p[i] + 0x5bu)) * OG_FNV_PRIME;
  }
}

void opgraft__hash_hex(const og_hash *h, char out[33]) {
  snprintf(out, 33, "%016llx%016llx", (unsigned long long)h->a, (unsigned long long)h->b);
}
