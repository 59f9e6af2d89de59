/* opgraft_abi_layout(): the public structs as this compiler laid them out, for bindings to check
 * their mirrors against (the Python layer's test does). Each op adds its own structs (og_op.abi). */
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void opgraft__sbuf_put(og_sbuf *b, const char *fmt, ...) {
  char tmp[512];
  va_list ap;
  va_start(ap, fmt);
  const int w = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (w < 0 || b->failed) return;
  const size_t l = strlen(tmp);
  if (b->n + l + 1 > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 4096;
    while (cap < b->n + l + 1) cap *= 2;
    char *q = realloc(b->p, cap);
    if (!q) {
      b->failed = 1;
      return;
    }
    b->p = q, b->cap = cap;
  }
  memcpy(b->p + b->n, tmp, l + 1);
  b->n += l;
}

void opgraft__abi_struct(og_sbuf *b, const char *name, size_t size) {
  opgraft__sbuf_put(b, "%s\"%s\": {\"size\": %zu, \"fields\": {", b->items ? ", " : "", name, size);
  b->items = 1;
  b->fields = 0;
}

void opgraft__abi_field(og_sbuf *b, const char *name, size_t offset, size_t size) {
  opgraft__sbuf_put(b, "%s\"%s\": [%zu, %zu]", b->fields ? ", " : "", name, offset, size);
  b->fields = 1;
}

void opgraft__abi_end(og_sbuf *b) { opgraft__sbuf_put(b, "}}"); }

static char *text;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void build(void) {
  og_sbuf b = {0};
  opgraft__sbuf_put(&b, "{\"abi\": %d, \"structs\": {", OPGRAFT_ABI_VERSION);
  OG_ABI_STRUCT(&b, opgraft_runtime_info);
  OG_ABI_FIELD(&b, opgraft_runtime_info, nvrtc_path);
  OG_ABI_FIELD(&b, opgraft_runtime_info, libcuda_path);
  OG_ABI_FIELD(&b, opgraft_runtime_info, nvrtc_version);
  OG_ABI_FIELD(&b, opgraft_runtime_info, driver_version);
  OG_ABI_FIELD(&b, opgraft_runtime_info, nvrtc_error);
  OG_ABI_FIELD(&b, opgraft_runtime_info, libcuda_error);
  opgraft__abi_end(&b);
  OG_ABI_STRUCT(&b, opgraft_tune_query);
  OG_ABI_FIELD(&b, opgraft_tune_query, key);
  OG_ABI_FIELD(&b, opgraft_tune_query, arch);
  OG_ABI_FIELD(&b, opgraft_tune_query, gpu);
  OG_ABI_FIELD(&b, opgraft_tune_query, shape);
  OG_ABI_FIELD(&b, opgraft_tune_query, tokens);
  opgraft__abi_end(&b);
  OG_ABI_STRUCT(&b, opgraft_kernel_info);
  OG_ABI_FIELD(&b, opgraft_kernel_info, name);
  OG_ABI_FIELD(&b, opgraft_kernel_info, registers);
  OG_ABI_FIELD(&b, opgraft_kernel_info, spill_store_bytes);
  OG_ABI_FIELD(&b, opgraft_kernel_info, spill_load_bytes);
  OG_ABI_FIELD(&b, opgraft_kernel_info, stack_bytes);
  OG_ABI_FIELD(&b, opgraft_kernel_info, shared_bytes);
  opgraft__abi_end(&b);
  int n = 0;
  const og_op *const *ops = opgraft__ops(&n);
  for (int i = 0; i < n; ++i)
    if (ops[i]->abi) ops[i]->abi(&b);
  opgraft__sbuf_put(&b, "}, \"status\": {");
  int first = 1;
#define OPGRAFT_XX(name, value, msg)                                            \
  opgraft__sbuf_put(&b, "%s\"OPGRAFT_" #name "\": %d", first ? "" : ", ", value); \
  first = 0;
  OPGRAFT_STATUS_MAP(OPGRAFT_XX)
#undef OPGRAFT_XX
  opgraft__sbuf_put(&b, "}}");
  if (b.failed) {
    free(b.p);
    b.p = NULL;
  }
  text = b.p;
}

const char *opgraft_abi_layout(void) {
  pthread_once(&once, build);
  return text ? text : "{}";
}
