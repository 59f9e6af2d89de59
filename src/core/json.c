/* A strict JSON reader (RFC 8259) for tune files: objects, arrays, strings, numbers, true, false,
 * null. Small on purpose: the library must build with only a C compiler, and a tune file is a few
 * kilobytes we write ourselves. Containers nest at most OG_JSON_MAX_DEPTH deep; any error gives
 * a position and reason instead of a partial tree. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define OG_JSON_MAX_DEPTH 32

typedef struct {
  const char *s, *end, *start;
  char *err;
  size_t err_len;
  int failed;
} og_parser;

static void *fail_at(og_parser *p, const char *what) {
  if (!p->failed) {
    int line = 1, col = 1;
    for (const char *q = p->start; q < p->s && q < p->end; ++q) {
      if (*q == '\n') line++, col = 1;
      else col++;
    }
    snprintf(p->err, p->err_len, "line %d, column %d: %s", line, col, what);
    p->failed = 1;
  }
  return NULL;
}

static void skip_ws(og_parser *p) {
  while (p->s < p->end && (*p->s == ' ' || *p->s == '\t' || *p->s == '\n' || *p->s == '\r')) p->s++;
}

static og_json *new_node(og_parser *p, og_json_type t) {
  og_json *j = calloc(1, sizeof *j);
  if (!j) return fail_at(p, "out of memory");
  j->type = t;
  return j;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static char *parse_string(og_parser *p) {
  if (p->s >= p->end || *p->s != '"') return fail_at(p, "expected a string");
  p->s++;
  size_t cap = 16, n = 0;
  char *out = malloc(cap);
  if (!out) return fail_at(p, "out of memory");
  for (;;) {
    if (p->s >= p->end) {
      free(out);
      return fail_at(p, "unterminated string");
    }
    unsigned char ch = (unsigned char)*p->s++;
    unsigned cp = ch;
    if (ch == '"') break;
    if (ch < 0x20) {
      free(out);
      return fail_at(p, "control character in string");
    }
    if (ch == '\\') {
      if (p->s >= p->end) {
        free(out);
        return fail_at(p, "unterminated string");
      }
      const char e = *p->s++;
      switch (e) {
      case '"': cp = '"'; break;
      case '\\': cp = '\\'; break;
      case '/': cp = '/'; break;
      case 'b': cp = '\b'; break;
      case 'f': cp = '\f'; break;
      case 'n': cp = '\n'; break;
      case 'r': cp = '\r'; break;
      case 't': cp = '\t'; break;
      case 'u': {
        cp = 0;
        for (int i = 0; i < 4; ++i) {
          const int v = p->s < p->end ? hexval(*p->s) : -1;
          if (v < 0) {
            free(out);
            return fail_at(p, "bad \\u escape");
          }
          cp = cp * 16 + (unsigned)v;
          p->s++;
        }
        if (cp == 0) { /* a C string would end there: "a\u0000b" must not read as "a" */
          free(out);
          return fail_at(p, "\\u0000 in string");
        }
        if (cp >= 0xd800 && cp <= 0xdfff) cp = '?'; /* surrogates are not needed in tune files */
        break;
      }
      default:
        free(out);
        return fail_at(p, "bad escape in string");
      }
    }
    char buf[4];
    size_t k = 0;
    if (ch != '\\' || cp < 0x80) {
      buf[k++] = (char)cp;
    } else if (cp < 0x800) {
      buf[k++] = (char)(0xc0 | (cp >> 6));
      buf[k++] = (char)(0x80 | (cp & 0x3f));
    } else {
      buf[k++] = (char)(0xe0 | (cp >> 12));
      buf[k++] = (char)(0x80 | ((cp >> 6) & 0x3f));
      buf[k++] = (char)(0x80 | (cp & 0x3f));
    }
    if (n + k + 1 > cap) {
      cap *= 2;
      char *o2 = realloc(out, cap);
      if (!o2) {
        free(out);
        return fail_at(p, "out of memory");
      }
      out = o2;
    }
    memcpy(out + n, buf, k);
    n += k;
  }
  out[n] = 0;
  return out;
}

static og_json *parse_value(og_parser *p, int depth);

static og_json *parse_number(og_parser *p) {
  const char *b = p->s;
  if (p->s < p->end && *p->s == '-') p->s++;
  if (p->s >= p->end) return fail_at(p, "bad number");
  if (*p->s == '0') {
    p->s++;
  } else if (*p->s >= '1' && *p->s <= '9') {
    while (p->s < p->end && *p->s >= '0' && *p->s <= '9') p->s++;
  } else {
    return fail_at(p, "unexpected character");
  }
  if (p->s < p->end && *p->s == '.') {
    p->s++;
    if (p->s >= p->end || *p->s < '0' || *p->s > '9') return fail_at(p, "bad number");
    while (p->s < p->end && *p->s >= '0' && *p->s <= '9') p->s++;
  }
  if (p->s < p->end && (*p->s == 'e' || *p->s == 'E')) {
    p->s++;
    if (p->s < p->end && (*p->s == '+' || *p->s == '-')) p->s++;
    if (p->s >= p->end || *p->s < '0' || *p->s > '9') return fail_at(p, "bad number");
    while (p->s < p->end && *p->s >= '0' && *p->s <= '9') p->s++;
  }
  char buf[64];
  const size_t len = (size_t)(p->s - b);
  if (len >= sizeof buf) return fail_at(p, "number too long");
  memcpy(buf, b, len);
  buf[len] = 0;
  og_json *j = new_node(p, OG_JSON_NUMBER);
  if (j) j->number = strtod(buf, NULL);
  return j;
}

static og_json *parse_container(og_parser *p, int depth, int is_obj) {
  const char close = is_obj ? '}' : ']';
  if (depth >= OG_JSON_MAX_DEPTH) return fail_at(p, "nested too deeply");
  og_json *j = new_node(p, is_obj ? OG_JSON_OBJECT : OG_JSON_ARRAY);
  if (!j) return NULL;
  p->s++;
  skip_ws(p);
  if (p->s < p->end && *p->s == close) {
    p->s++;
    return j;
  }
  og_json **tail = &j->child;
  for (;;) {
    char *key = NULL;
    skip_ws(p);
    if (is_obj) {
      if (!(key = parse_string(p))) break;
      skip_ws(p);
      if (p->s >= p->end || *p->s != ':') {
        free(key);
        fail_at(p, "expected ':'");
        break;
      }
      p->s++;
    }
    og_json *v = parse_value(p, depth + 1);
    if (!v) {
      free(key);
      break;
    }
    v->key = key;
    *tail = v;
    tail = &v->next;
    skip_ws(p);
    if (p->s < p->end && *p->s == ',') {
      p->s++;
      continue;
    }
    if (p->s < p->end && *p->s == close) {
      p->s++;
      return j;
    }
    fail_at(p, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
    break;
  }
  opgraft__json_free(j);
  return NULL;
}

static og_json *parse_value(og_parser *p, int depth) {
  skip_ws(p);
  if (p->s >= p->end) return fail_at(p, "unexpected end of input");
  const char c = *p->s;
  if (c == '{' || c == '[') return parse_container(p, depth, c == '{');
  if (c == '"') {
    char *s = parse_string(p);
    if (!s) return NULL;
    og_json *j = new_node(p, OG_JSON_STRING);
    if (!j) {
      free(s);
      return NULL;
    }
    j->string = s;
    return j;
  }
  static const struct {
    const char *word;
    og_json_type type;
    int b;
  } words[] = {{"true", OG_JSON_BOOL, 1}, {"false", OG_JSON_BOOL, 0}, {"null", OG_JSON_NULL, 0}};
  for (size_t i = 0; i < 3; ++i) {
    const size_t n = strlen(words[i].word);
    if ((size_t)(p->end - p->s) >= n && memcmp(p->s, words[i].word, n) == 0) {
      p->s += n;
      og_json *j = new_node(p, words[i].type);
      if (j) j->boolean = words[i].b;
      return j;
    }
  }
  return parse_number(p);
}

og_json *opgraft__json_parse(const char *text, size_t len, char *err, size_t err_len) {
  char dummy[8];
  og_parser p = {text, text, text, err ? err : dummy, err ? err_len : sizeof dummy, 0};
  if (!text) return fail_at(&p, "no input");
  p.end = text + len;
  og_json *j = parse_value(&p, 0);
  if (!j) return NULL;
  skip_ws(&p);
  if (p.s != p.end) {
    opgraft__json_free(j);
    return fail_at(&p, "trailing characters after the value");
  }
  return j;
}

void opgraft__json_free(og_json *j) {
  while (j) {
    og_json *next = j->next;
    opgraft__json_free(j->child);
    free(j->string);
    free(j->key);
    free(j);
    j = next;
  }
}

const og_json *opgraft__json_get(const og_json *obj, const char *key) {
  if (!obj || obj->type != OG_JSON_OBJECT) return NULL;
  const og_json *found = NULL;
  for (const og_json *c = obj->child; c; c = c->next)
    if (c->key && strcmp(c->key, key) == 0) found = c; /* the last duplicate wins */
  return found;
}
