/* Tunables: opgraft_tune_set() > environment variable > $OPGRAFT_TUNE_FILE (JSON) > the op's baked
 * per-arch rows > the op's rule (heuristics from the shape) > the key's fallback. The keys, rows
 * and rules belong to the ops (registry.c); this file names none of them.
 *
 * Tune file format (written by `opgraft tune --inject --out FILE`):
 *   {"version": 1,
 *    "entries": [{"arch": 90, "gpu": "NVIDIA H200", "shape": "<op>:bf16:<dims>",
 *                 "tokens": [1, 8], "values": {"<op>.<name>": 8}, "why": "measured ..."}]}
 * Every field of an entry but "values" is optional; a missing one matches anything. Among the
 * entries that match a lookup, the most specific wins (shape > gpu > tokens > arch), then the
 * later one. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* All keys of the valid ops, built once. */
static pthread_once_t keys_once = PTHREAD_ONCE_INIT;
static const char **all_keys;
static void build_keys(void) {
  int n = 0, total = 0;
  const og_op *const *ops = opgraft__ops(&n);
  for (int i = 0; i < n; ++i) total += ops[i]->ntunables;
  all_keys = calloc((size_t)total + 1, sizeof *all_keys);
  if (!all_keys) return;
  int k = 0;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < ops[i]->ntunables; ++j) all_keys[k++] = ops[i]->tunables[j].key;
}

const char *const *opgraft_tune_keys(void) {
  static const char *none[1] = {NULL};
  pthread_once(&keys_once, build_keys);
  return all_keys ? all_keys : none;
}

const char *opgraft_tune_space(const char *key) {
  const og_tunable *t = key ? opgraft__find_tunable(key, NULL) : NULL;
  return t && t->space ? t->space : "";
}

int32_t opgraft_tune_range(const char *key, int64_t *lo, int64_t *hi) {
  const og_tunable *t = key ? opgraft__find_tunable(key, NULL) : NULL;
  if (!t) return opgraft__fail(OPGRAFT_ENOTFOUND, "unknown tunable \"%s\"", key ? key : "(null)");
  if (lo) *lo = t->lo;
  if (hi) *hi = t->hi;
  return OPGRAFT_OK;
}

/* Strict integer parse: optional sign, digits, optional surrounding blanks; nothing else. */
static int parse_int(const char *s, int64_t *out) {
  while (isspace((unsigned char)*s)) ++s;
  if (!*s) return -1;
  errno = 0;
  char *end = NULL;
  const long long v = strtoll(s, &end, 10);
  if (errno || end == s) return -1;
  while (isspace((unsigned char)*end)) ++end;
  if (*end) return -1;
  *out = v;
  return 0;
}

/* ---- the tune file, parsed once per (path, size, mtime) ---- */
typedef struct og_file_table {
  char *path; /* a copy of $OPGRAFT_TUNE_FILE as last read (any length) */
  off_t size;
  struct timespec mtime;
  og_tune_entry *rows;
  int nrows;
  int valid;
} og_file_table;

static pthread_mutex_t tune_lock = PTHREAD_MUTEX_INITIALIZER;
static og_file_table file_table;

static void free_rows(og_tune_entry *rows, int n) {
  for (int i = 0; i < n; ++i) {
    free((char *)rows[i].gpu);
    free((char *)rows[i].shape);
    free((char *)rows[i].key);
    free((char *)rows[i].why);
  }
  free(rows);
}

/* Called with tune_lock held. */
static void reset_file_table(void) {
  free_rows(file_table.rows, file_table.nrows);
  free(file_table.path);
  memset(&file_table, 0, sizeof file_table);
}

static _Atomic uint32_t tune_gen;
uint32_t opgraft__tune_generation(void) { return tune_gen; }
uint32_t opgraft_tune_generation(void) { return tune_gen; }

void opgraft_tune_reload(void) {
  pthread_mutex_lock(&tune_lock);
  tune_gen++;
  reset_file_table();
  pthread_mutex_unlock(&tune_lock);
}

/* ---- values set through the API (opgraft_tune_set), above every other source ---- */
enum { OG_MAX_SET = 64 };
static struct {
  const char *key; /* the registered key's own string */
  int64_t value;
} set_values[OG_MAX_SET];
static int nset;

int32_t opgraft_tune_set(const char *key, int64_t value) {
  const og_tunable *t = key ? opgraft__find_tunable(key, NULL) : NULL;
  if (!t) return opgraft__fail(OPGRAFT_ENOTFOUND, "unknown tunable \"%s\"", key ? key : "(null)");
  if (value < t->lo || value > t->hi)
    return opgraft__fail(OPGRAFT_ERANGE, "%s takes values in [%lld, %lld], not %lld", t->key, (long long)t->lo,
                         (long long)t->hi, (long long)value);
  int32_t st = OPGRAFT_OK;
  pthread_mutex_lock(&tune_lock);
  int i = 0;
  while (i < nset && set_values[i].key != t->key) ++i;
  if (i == nset && nset == OG_MAX_SET)
    st = opgraft__fail(OPGRAFT_ERANGE, "more than %d tunables set at once", OG_MAX_SET);
  else {
    if (i == nset) set_values[nset++].key = t->key;
    set_values[i].value = value;
    tune_gen++;
  }
  pthread_mutex_unlock(&tune_lock);
  return st;
}

int32_t opgraft_tune_clear(const char *key) {
  const og_tunable *t = key ? opgraft__find_tunable(key, NULL) : NULL;
  if (key && !t) return opgraft__fail(OPGRAFT_ENOTFOUND, "unknown tunable \"%s\"", key);
  pthread_mutex_lock(&tune_lock);
  int k = 0;
  for (int i = 0; i < nset; ++i)
    if (t && set_values[i].key != t->key) set_values[k++] = set_values[i];
  nset = k;
  tune_gen++;
  pthread_mutex_unlock(&tune_lock);
  return OPGRAFT_OK;
}

static char *dup_or_null(const og_json *j) { return j && j->type == OG_JSON_STRING ? strdup(j->string) : NULL; }

/* Converts one parsed file into rows; returns an error string or NULL. Per-value problems are
 * warned about and skipped; structural problems reject the whole file. */
static const char *load_rows(const char *path, const og_json *root, og_tune_entry **rows_out, int *n_out) {
  if (!root || root->type != OG_JSON_OBJECT) return "the top level must be an object";
  const og_json *ver = opgraft__json_get(root, "version");
  if (!ver || ver->type != OG_JSON_NUMBER || ver->number != 1) return "\"version\" must be 1";
  const og_json *entries = opgraft__json_get(root, "entries");
  if (!entries || entries->type != OG_JSON_ARRAY) return "\"entries\" must be an array";
  int cap = 0;
  for (const og_json *e = entries->child; e; e = e->next) {
    const og_json *v = opgraft__json_get(e, "values");
    if (v && v->type == OG_JSON_OBJECT)
      for (const og_json *kv = v->child; kv; kv = kv->next) ++cap;
  }
  og_tune_entry *rows = calloc((size_t)cap + 1, sizeof *rows);
  if (!rows) return "out of memory";
  int n = 0, idx = 0;
  for (const og_json *e = entries->child; e; e = e->next, ++idx) {
    if (e->type != OG_JSON_OBJECT) {
      free_rows(rows, n);
      return "each entry must be an object";
    }
    const og_json *arch = opgraft__json_get(e, "arch"), *gpu = opgraft__json_get(e, "gpu");
    const og_json *shape = opgraft__json_get(e, "shape"), *tok = opgraft__json_get(e, "tokens");
    const og_json *vals = opgraft__json_get(e, "values"), *why = opgraft__json_get(e, "why");
    int32_t a = 0, lo = 0, hi = 0;
    const char *bad = NULL;
    if (arch && (arch->type != OG_JSON_NUMBER || arch->number < 10 || arch->number > 1000 ||
                 arch->number != (int32_t)arch->number))
      bad = "\"arch\" must be an integer like 90";
    else if (arch)
      a = (int32_t)arch->number;
    if (gpu && gpu->type != OG_JSON_STRING) bad = "\"gpu\" must be a string";
    if (shape && shape->type != OG_JSON_STRING) bad = "\"shape\" must be a string";
    if (tok) {
      const og_json *t0 = tok->type == OG_JSON_ARRAY ? tok->child : NULL;
      const og_json *t1 = t0 ? t0->next : NULL;
      if (!t1 || t1->next || t0->type != OG_JSON_NUMBER || t1->type != OG_JSON_NUMBER ||
          t0->number < 1 || t1->number < t0->number || t1->number > 1e9 ||
          t0->number != (double)(int32_t)t0->number || t1->number != (double)(int32_t)t1->number)
        bad = "\"tokens\" must be [lo, hi], integers with 1 <= lo <= hi";
      else
        lo = (int32_t)t0->number, hi = (int32_t)t1->number;
    }
    if (!vals || vals->type != OG_JSON_OBJECT) bad = "\"values\" must be an object";
    if (bad) {
      opgraft__warn_once("tune file %s, entry %d: %s; skipping the entry", path, idx, bad);
      continue;
    }
    for (const og_json *kv = vals->child; kv; kv = kv->next) {
      const og_tunable *t = opgraft__find_tunable(kv->key, NULL);
      if (!t) {
        opgraft__warn_once("tune file %s, entry %d: unknown key \"%s\"; skipping it", path, idx, kv->key);
        continue;
      }
      /* The range check comes first: casting an out-of-range double to an integer is undefined. */
      if (kv->type != OG_JSON_NUMBER || kv->number < (double)t->lo || kv->number > (double)t->hi ||
          kv->number != (double)(int64_t)kv->number) {
        opgraft__warn_once("tune file %s, entry %d: \"%s\" must be an integer in [%lld, %lld]; "
                           "skipping it", path, idx, kv->key, (long long)t->lo, (long long)t->hi);
        continue;
      }
      og_tune_entry *r = &rows[n++];
      r->arch = a;
      r->gpu = dup_or_null(gpu);
      r->shape = dup_or_null(shape);
      r->tokens_lo = lo;
      r->tokens_hi = hi;
      r->key = strdup(t->key);
      r->value = (int64_t)kv->number;
      r->why = dup_or_null(why);
    }
  }
  *rows_out = rows;
  *n_out = n;
  return NULL;
}

/* Makes file_table reflect $OPGRAFT_TUNE_FILE. Called with tune_lock held. */
static void refresh_file_locked(void) {
  const char *path = getenv("OPGRAFT_TUNE_FILE");
  if (!path || !*path) {
    if (file_table.path) reset_file_table();
    return;
  }
  struct stat sb;
  const int have = opgraft__stat(path, &sb) == 0, stat_errno = errno;
  if (have && file_table.path && strcmp(file_table.path, path) == 0 && file_table.size == sb.st_size &&
      file_table.mtime.tv_sec == sb.st_mtim.tv_sec && file_table.mtime.tv_nsec == sb.st_mtim.tv_nsec)
    return;
  reset_file_table();
  if (!(file_table.path = strdup(path))) return;
  if (!have) {
    opgraft__warn_once("OPGRAFT_TUNE_FILE=%s cannot be read (%s); using the built-in table", path,
                       strerror(stat_errno));
    return;
  }
  file_table.size = sb.st_size;
  file_table.mtime = sb.st_mtim;
  if (!S_ISREG(sb.st_mode)) {
    opgraft__warn_once("OPGRAFT_TUNE_FILE=%s is not a regular file; using the built-in table", path);
    return;
  }
  if (sb.st_size > (1 << 24)) {
    opgraft__warn_once("tune file %s is larger than 16 MiB; ignoring it", path);
    return;
  }
  /* O_NONBLOCK and the type checked again on the open file: a FIFO put there since the stat must
   * not wait for a writer while tune_lock holds every lookup. */
  const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  struct stat fsb;
  char *text = NULL;
  size_t got = 0;
  if (fd >= 0 && opgraft__fstat(fd, &fsb) == 0 && S_ISREG(fsb.st_mode) && fsb.st_size == sb.st_size &&
      (text = malloc((size_t)sb.st_size + 1)) != NULL) {
    while (got < (size_t)sb.st_size) {
      const ssize_t r = read(fd, text + got, (size_t)sb.st_size - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      got += (size_t)r;
    }
  }
  if (fd >= 0) close(fd);
  if (!text || got != (size_t)sb.st_size) {
    free(text);
    opgraft__warn_once("tune file %s cannot be read; using the built-in table", path);
    return;
  }
  char err[256];
  const size_t bom = got >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0 ? 3 : 0; /* a UTF-8 byte-order mark */
  og_json *root = opgraft__json_parse(text + bom, got - bom, err, sizeof err);
  free(text);
  if (!root) {
    opgraft__warn_once("tune file %s is not valid JSON (%s); ignoring it", path, err);
    return;
  }
  const char *bad = load_rows(path, root, &file_table.rows, &file_table.nrows);
  opgraft__json_free(root);
  if (bad) {
    opgraft__warn_once("tune file %s: %s; ignoring it", path, bad);
    return;
  }
  file_table.valid = 1;
}

/* Specificity of a matching row, or -1 if it does not match. */
static int match_score(const og_tune_entry *r, const opgraft_tune_query *q) {
  if (strcmp(r->key, q->key) != 0) return -1;
  int s = 0;
  if (r->arch) {
    if (r->arch != q->arch) return -1;
    s += 1;
  }
  if (r->tokens_lo) {
    if (q->tokens < r->tokens_lo || q->tokens > r->tokens_hi) return -1;
    s += 2;
  }
  if (r->gpu) {
    if (!q->gpu || strcmp(r->gpu, q->gpu) != 0) return -1;
    s += 4;
  }
  if (r->shape) {
    if (!q->shape || strcmp(r->shape, q->shape) != 0) return -1;
    s += 8;
  }
  return s;
}

int opgraft__best_row(const og_tune_entry *rows, int n, const opgraft_tune_query *q) {
  int best = -1, best_score = -1;
  for (int i = 0; i < n; ++i) {
    const int s = match_score(&rows[i], q);
    if (s >= 0 && s >= best_score) best = i, best_score = s;
  }
  return best;
}

int32_t opgraft_tune_get(const opgraft_tune_query *q, int64_t *value, char *source, size_t source_len) {
  if (!q || !q->key || !value) return opgraft__fail(OPGRAFT_EINVAL, "opgraft_tune_get: NULL argument");
  const og_op *op = NULL;
  const og_tunable *t = opgraft__find_tunable(q->key, &op);
  if (!t) return opgraft__fail(OPGRAFT_ENOTFOUND, "unknown tunable \"%s\"", q->key);

  int found = 0;
  pthread_mutex_lock(&tune_lock);
  for (int i = 0; i < nset && !found; ++i)
    if (set_values[i].key == t->key) *value = set_values[i].value, found = 1;
  pthread_mutex_unlock(&tune_lock);
  if (found) {
    if (source) snprintf(source, source_len, "set");
    return OPGRAFT_OK;
  }

  char env[128] = "OPGRAFT_TUNE_";
  size_t k = strlen(env);
  for (const char *c = q->key; *c && k + 1 < sizeof env; ++c)
    env[k++] = *c == '.' ? '_' : (char)toupper((unsigned char)*c);
  env[k] = 0;
  const char *ev = getenv(env);
  if (ev && *ev) { /* an empty variable counts as unset */
    int64_t v;
    if (parse_int(ev, &v) == 0 && v >= t->lo && v <= t->hi) {
      *value = v;
      if (source) snprintf(source, source_len, "env:%s", env);
      return OPGRAFT_OK;
    }
    opgraft__warn_once("%s=\"%s\" is not an integer in [%lld, %lld]; ignoring it", env, ev,
                       (long long)t->lo, (long long)t->hi);
  }

  pthread_mutex_lock(&tune_lock);
  refresh_file_locked();
  const int i = file_table.valid ? opgraft__best_row(file_table.rows, file_table.nrows, q) : -1;
  if (i >= 0) {
    *value = file_table.rows[i].value;
    if (source) snprintf(source, source_len, "file:%s", file_table.path);
  }
  pthread_mutex_unlock(&tune_lock);
  if (i >= 0) return OPGRAFT_OK;

  const int b = opgraft__best_row(op->rows, op->nrows, q);
  if (b >= 0) {
    *value = op->rows[b].value;
    if (source) {
      if (op->rows[b].arch)
        snprintf(source, source_len, "baked:sm_%d", op->rows[b].arch);
      else
        snprintf(source, source_len, "baked:any");
    }
    return OPGRAFT_OK;
  }
  int64_t v = 0;
  if (op->rule && op->rule(q, &v)) {
    /* A rule's value outside the key's range is the op's bug: clamp it rather than pass it on. */
    *value = v < t->lo ? t->lo : v > t->hi ? t->hi : v;
    if (source) snprintf(source, source_len, "rule");
    return OPGRAFT_OK;
  }
  *value = t->fallback;
  if (source) snprintf(source, source_len, "default");
  return OPGRAFT_OK;
}

int64_t opgraft__tune_value(const char *key, int32_t arch, const char *gpu, const char *shape,
                            int32_t tokens) {
  const opgraft_tune_query q = {key, arch, gpu, shape, tokens};
  int64_t v = 0;
  if (opgraft_tune_get(&q, &v, NULL, 0) != OPGRAFT_OK) return 0;
  return v;
}
