/* The op registry: the descriptors listed in src/ops/ops.c, checked once at first use. An op
 * whose descriptor is malformed is left out (one warning): its keys are unknown to the tunables
 * and its entry points refuse calls. */
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { OG_MAX_OPS = 32 };

static pthread_once_t once = PTHREAD_ONCE_INIT;
static const og_op *valid[OG_MAX_OPS + 1];
static int nvalid;
static const char *names[OG_MAX_OPS + 1];

static int bad(char *err, size_t len, const char *fmt, const char *a, const char *b) {
  snprintf(err, len, fmt, a ? a : "(null)", b ? b : "");
  return -1;
}

static int is_name(const char *s) {
  if (!s || !*s || !islower((unsigned char)*s)) return 0;
  for (; *s; ++s)
    if (!islower((unsigned char)*s) && !isdigit((unsigned char)*s) && *s != '_') return 0;
  return 1;
}

static const og_tunable *op_tunable(const og_op *op, const char *key) {
  for (int i = 0; i < op->ntunables; ++i)
    if (op->tunables[i].key && strcmp(op->tunables[i].key, key) == 0) return &op->tunables[i];
  return NULL;
}

int opgraft__op_check(const og_op *op, const og_op *const *earlier, int nearlier, char *err, size_t len) {
  if (!op) return bad(err, len, "a NULL descriptor%s%s", "", "");
  if (!is_name(op->name)) return bad(err, len, "op name \"%s\" is not a lower-case identifier%s", op->name, "");
  for (int i = 0; i < nearlier; ++i)
    if (strcmp(earlier[i]->name, op->name) == 0) return bad(err, len, "op %s is registered twice%s", op->name, "");
  if (op->kernel_dir) {
    const size_t dl = strlen(op->kernel_dir);
    int found = 0;
    for (int i = 0; i < opgraft__num_sources && !found; ++i)
      found = strncmp(opgraft__sources[i].path, op->kernel_dir, dl) == 0 && opgraft__sources[i].path[dl] == '/';
    if (!found) return bad(err, len, "op %s: no embedded kernel source under kernels/%s/", op->name, op->kernel_dir);
  }
  if (op->ntunables < 0 || (op->ntunables > 0 && !op->tunables) || op->nrows < 0 || (op->nrows > 0 && !op->rows))
    return bad(err, len, "op %s: bad tunable or row table%s", op->name, "");
  const size_t nl = strlen(op->name);
  for (int i = 0; i < op->ntunables; ++i) {
    const og_tunable *t = &op->tunables[i];
    if (!t->key || strncmp(t->key, op->name, nl) != 0 || t->key[nl] != '.' || !t->key[nl + 1])
      return bad(err, len, "op %s: tunable key \"%s\" does not start with the op's name and a dot", op->name, t->key);
    if (t->lo > t->hi || t->fallback < t->lo || t->fallback > t->hi)
      return bad(err, len, "op %s: tunable %s has a fallback outside its range", op->name, t->key);
    for (int j = 0; j < i; ++j)
      if (strcmp(op->tunables[j].key, t->key) == 0) return bad(err, len, "op %s: tunable %s is listed twice", op->name, t->key);
    for (const char *c = t->space; c && *c;) { /* the tuner's candidates: integers in the range */
      char *end = NULL;
      const long long v = strtoll(c, &end, 10);
      if (end == c || v < t->lo || v > t->hi || (*end && *end != ' '))
        return bad(err, len, "op %s: tunable %s has a tuning candidate outside its range", op->name, t->key);
      for (c = end; *c == ' '; ++c) {
      }
    }
  }
  for (int i = 0; i < op->nrows; ++i) {
    const og_tune_entry *r = &op->rows[i];
    const og_tunable *t = r->key ? op_tunable(op, r->key) : NULL;
    if (!t) return bad(err, len, "op %s: a baked row names the unknown key \"%s\"", op->name, r->key);
    if (r->value < t->lo || r->value > t->hi)
      return bad(err, len, "op %s: a baked row of %s is outside the key's range", op->name, r->key);
    if ((r->tokens_lo || r->tokens_hi) && (r->tokens_lo < 1 || r->tokens_hi < r->tokens_lo))
      return bad(err, len, "op %s: a baked row of %s has a bad token range", op->name, r->key);
    if (!r->why || !*r->why) return bad(err, len, "op %s: a baked row of %s does not say why it holds", op->name, r->key);
  }
  return 0;
}

static void build(void) {
  for (int i = 0; opgraft__op_list[i]; ++i) {
    const og_op *op = opgraft__op_list[i];
    char err[256];
    if (nvalid >= OG_MAX_OPS) {
      opgraft__warn_once("more than %d ops registered; the rest are left out", OG_MAX_OPS);
      break;
    }
    if (opgraft__op_check(op, valid, nvalid, err, sizeof err) != 0) {
      opgraft__warn_once("op descriptor refused: %s", err);
      continue;
    }
    /* A key another op already owns would make lookups ambiguous. */
    const char *dup = NULL;
    for (int t = 0; t < op->ntunables && !dup; ++t)
      for (int j = 0; j < nvalid && !dup; ++j)
        if (op_tunable(valid[j], op->tunables[t].key)) dup = op->tunables[t].key;
    if (dup) {
      opgraft__warn_once("op descriptor refused: op %s: tunable %s belongs to another op", op->name, dup);
      continue;
    }
    names[nvalid] = op->name;
    valid[nvalid++] = op;
  }
  valid[nvalid] = NULL;
  names[nvalid] = NULL;
}

const og_op *const *opgraft__ops(int *n) {
  pthread_once(&once, build);
  if (n) *n = nvalid;
  return valid;
}

int opgraft__op_ok(const og_op *op) {
  int n = 0;
  const og_op *const *ops = opgraft__ops(&n);
  for (int i = 0; i < n; ++i)
    if (ops[i] == op) return 1;
  return 0;
}

const og_tunable *opgraft__find_tunable(const char *key, const og_op **op_out) {
  int n = 0;
  const og_op *const *ops = opgraft__ops(&n);
  for (int i = 0; i < n; ++i) {
    const og_tunable *t = op_tunable(ops[i], key);
    if (t) {
      if (op_out) *op_out = ops[i];
      return t;
    }
  }
  return NULL;
}

const char *const *opgraft_op_names(void) {
  opgraft__ops(NULL);
  return names;
}
