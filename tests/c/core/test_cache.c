/* The kernel cache: its directory, the file format's checks, concurrent writers, and the NVRTC
 * compile behind opgraft__cubin_cached. */
#include <dirent.h>
#include <fcntl.h>

#include "og_test.h"

static char root[512];

/* The cache file layout (jit.c): 16 bytes of magic, then key length, payload size, log length and
 * a checksum (FNV-1a of the payload XOR 31 x FNV-1a of the log) as four uint64, then the key, the
 * payload and the compiler log. */
#define HEADER_BYTES (16 + 4 * 8)

static int setup(void **state) {
  og_tmpdir(root, sizeof root);
  og_log_start();
  return 0;
}

static int teardown(void **state) {
  og_log_stop();
  og_rm_rf(root);
  return 0;
}

/* Points OPGRAFT_CACHE_DIR at root/sub (not created). */
static const char *use_cache_dir(const char *sub) {
  static char dir[1024];
  snprintf(dir, sizeof dir, "%s/%s", root, sub);
  setenv("OPGRAFT_CACHE_DIR", dir, 1);
  return dir;
}

/* Deterministic bytes, zeros included. */
static void make_payload(char *buf, size_t n, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    buf[i] = (i % 7 == 3) ? 0 : (char)(s >> 24);
  }
}

/* Stores bytes as a cubin without a log. */
static int32_t store_bytes(const char *key, const char *data, size_t n) {
  og_cubin c = {(char *)data, n, NULL};
  return opgraft__cache_store(key, &c);
}

static void store_ok(const char *key, const char *data, size_t n) {
  const int32_t st = store_bytes(key, data, n);
  if (st != OPGRAFT_OK) fail_msg("storing %s: %s: %s", key, opgraft_status_name(st), opgraft_last_error());
}

static void load_matches(const char *key, const char *data, size_t n) {
  og_cubin c = {NULL, 0, NULL};
  const int32_t st = opgraft__cache_load(key, &c);
  if (st != OPGRAFT_OK) fail_msg("loading %s: %s: %s", key, opgraft_status_name(st), opgraft_last_error());
  assert_int_equal(c.size, n);
  assert_memory_equal(c.data, data, n);
  assert_non_null(c.log);
  assert_string_equal(c.log, "");
  opgraft__cubin_free(&c);
}

static void path_of(const char *key, char *path, size_t len) {
  assert_int_equal(opgraft__cache_path(key, path, len), OPGRAFT_OK);
}

static off_t file_size(const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0) fail_msg("stat %s: %s", path, strerror(errno));
  return sb.st_size;
}

/* Counts the entries of dir whose name contains needle. */
static int count_entries(const char *dir, const char *needle) {
  DIR *d = opendir(dir);
  if (!d) fail_msg("opendir %s: %s", dir, strerror(errno));
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strstr(e->d_name, needle)) ++n;
  closedir(d);
  return n;
}

/* ---- the cache directory ---- */

static char *saved_env[3];
static const char *const env_names[3] = {"OPGRAFT_CACHE_DIR", "XDG_CACHE_HOME", "HOME"};

static int save_env(void **state) {
  for (int i = 0; i < 3; ++i) {
    const char *v = getenv(env_names[i]);
    saved_env[i] = v ? strdup(v) : NULL;
  }
  return 0;
}

static int restore_env(void **state) {
  for (int i = 0; i < 3; ++i) {
    if (saved_env[i]) setenv(env_names[i], saved_env[i], 1);
    else unsetenv(env_names[i]);
    free(saved_env[i]);
    saved_env[i] = NULL;
  }
  return 0;
}

static void expect_dir(const char *want) {
  char buf[1024];
  memset(buf, 'z', sizeof buf);
  const int32_t st = opgraft_cache_dir(buf, sizeof buf);
  if (st != OPGRAFT_OK) fail_msg("opgraft_cache_dir: %s: %s", opgraft_status_name(st), opgraft_last_error());
  assert_string_equal(buf, want);
}

static void test_cache_dir_precedence(void **state) {
  setenv("OPGRAFT_CACHE_DIR", "/og/cache", 1);
  setenv("XDG_CACHE_HOME", "/og/xdg", 1);
  setenv("HOME", "/og/home", 1);
  expect_dir("/og/cache");
  setenv("OPGRAFT_CACHE_DIR", "", 1); /* empty counts as unset */
  expect_dir("/og/xdg/opgraft");
  unsetenv("OPGRAFT_CACHE_DIR");
  expect_dir("/og/xdg/opgraft");
  setenv("XDG_CACHE_HOME", "", 1);
  expect_dir("/og/home/.cache/opgraft");
  unsetenv("XDG_CACHE_HOME");
  expect_dir("/og/home/.cache/opgraft");

  char buf[256] = "";
  setenv("HOME", "", 1);
  assert_int_not_equal(opgraft_cache_dir(buf, sizeof buf), OPGRAFT_OK);
  unsetenv("HOME");
  assert_int_equal(opgraft_cache_dir(buf, sizeof buf), OPGRAFT_ENOTFOUND);
  assert_non_null(strstr(opgraft_last_error(), "OPGRAFT_CACHE_DIR"));
  /* With no directory at all, storing fails cleanly. */
  og_log_reset();
  assert_int_not_equal(store_bytes("no-dir", "x", 1), OPGRAFT_OK);
  assert_int_equal(og_log_warnings("kept in memory only"), 1); /* said, not silent */
  og_log_reset();

  /* A buffer too small for the path. */
  setenv("OPGRAFT_CACHE_DIR", "/og/cache", 1);
  char small[6];
  assert_int_equal(opgraft_cache_dir(small, sizeof small), OPGRAFT_ERANGE);
}

static void test_cache_path(void **state) {
  const char *dir = use_cache_dir("paths");
  char a[1024], a2[1024], b[1024];
  path_of("key one", a, sizeof a);
  path_of("key one", a2, sizeof a2);
  path_of("key two", b, sizeof b);
  assert_string_equal(a, a2);
  assert_string_not_equal(a, b);
  /* <dir>/<32 hex digits>.cubin */
  const size_t dl = strlen(dir);
  assert_int_equal(strncmp(a, dir, dl), 0);
  assert_int_equal(a[dl], '/');
  assert_int_equal(strlen(a), dl + 1 + 32 + strlen(".cubin"));
  for (size_t i = dl + 1; i < dl + 33; ++i) assert_non_null(strchr("0123456789abcdef", a[i]));
  assert_string_equal(a + dl + 33, ".cubin");
}

/* ---- store and load ---- */

static void test_round_trip(void **state) {
  use_cache_dir("round/trip/nested"); /* created on the first store */
  static char data[70000];
  make_payload(data, sizeof data, 1);
  store_ok("round trip", data, sizeof data);
  load_matches("round trip", data, sizeof data);
  store_ok("one byte", "\0", 1);
  load_matches("one byte", "\0", 1);
  /* Storing again replaces the payload. */
  make_payload(data, 1000, 2);
  store_ok("round trip", data, 1000);
  load_matches("round trip", data, 1000);
  assert_int_equal(og_log_warnings(NULL), 0);
}

static void test_unknown_key(void **state) {
  use_cache_dir("unknown");
  og_cubin c = {NULL, 0, NULL};
  assert_int_equal(opgraft__cache_load("never stored", &c), OPGRAFT_ENOTFOUND);
  assert_null(c.data);
  assert_true(opgraft_last_error()[0] != 0);
  store_ok("stored", "abc", 3);
  assert_int_equal(opgraft__cache_load("never stored", &c), OPGRAFT_ENOTFOUND);
}

/* Damage applied to the stored file of key (other: the path of a second key, for swaps). */
typedef void (*damage_fn)(const char *path, const char *other);

static void truncate_by_one(const char *path, const char *other) {
  assert_int_equal(truncate(path, file_size(path) - 1), 0);
}
static void truncate_to_header(const char *path, const char *other) {
  assert_int_equal(truncate(path, HEADER_BYTES - 5), 0);
}
static void make_empty(const char *path, const char *other) { assert_int_equal(truncate(path, 0), 0); }
static void flip_byte_at(const char *path, off_t at) {
  const int fd = open(path, O_RDWR);
  assert_true(fd >= 0);
  unsigned char b = 0;
  assert_int_equal(pread(fd, &b, 1, at), 1);
  b ^= 0x20;
  assert_int_equal(pwrite(fd, &b, 1, at), 1);
  close(fd);
}
static void flip_last_payload_byte(const char *path, const char *other) { flip_byte_at(path, file_size(path) - 1); }
static void flip_magic(const char *path, const char *other) { flip_byte_at(path, 0); }
static void flip_checksum(const char *path, const char *other) { flip_byte_at(path, 16 + 3 * 8); }
static void flip_stored_key(const char *path, const char *other) { flip_byte_at(path, HEADER_BYTES + 1); }
static void append_byte(const char *path, const char *other) {
  FILE *f = fopen(path, "ab");
  assert_non_null(f);
  fputc('x', f);
  fclose(f);
}
/* Replaces the file with a copy of the file of another key of the same length. */
static void copy_other_key_file(const char *path, const char *other) {
  FILE *in = fopen(other, "rb"), *out = fopen(path, "wb");
  assert_non_null(in);
  assert_non_null(out);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, in)) > 0) assert_int_equal(fwrite(buf, 1, n, out), n);
  fclose(in);
  assert_int_equal(fclose(out), 0);
}

static void check_detected(const char *key, damage_fn damage, const char *what) {
  static char data[5000], other_data[5000];
  make_payload(data, sizeof data, 3);
  make_payload(other_data, sizeof other_data, 4);
  char path[1024], other[1024], other_key[256];
  /* A second key of the same length, so only the stored key's bytes differ. */
  snprintf(other_key, sizeof other_key, "%s", key);
  other_key[0] = other_key[0] == 'X' ? 'Y' : 'X';
  store_ok(key, data, sizeof data);
  store_ok(other_key, other_data, sizeof other_data);
  path_of(key, path, sizeof path);
  path_of(other_key, other, sizeof other);
  damage(path, other);

  og_log_reset();
  og_cubin c = {NULL, 0, NULL};
  const int32_t st = opgraft__cache_load(key, &c);
  if (st != OPGRAFT_EPARSE) {
    opgraft__cubin_free(&c);
    fail_msg("%s: loading gave %s, expected OPGRAFT_EPARSE", what, opgraft_status_name(st));
  }
  assert_null(c.data);
  if (og_log_warnings("corrupt") != 1) {
    og_log_dump();
    fail_msg("%s: expected one warning about a corrupt file", what);
  }
  /* Storing again repairs it; the other key is untouched. */
  store_ok(key, data, sizeof data);
  load_matches(key, data, sizeof data);
  load_matches(other_key, other_data, sizeof other_data);
}

static void test_corrupt_files(void **state) {
  use_cache_dir("corrupt");
  check_detected("truncated by one byte", truncate_by_one, "a truncated file");
  check_detected("truncated in the header", truncate_to_header, "a file cut in its header");
  check_detected("zero length", make_empty, "a zero-length file");
  check_detected("flipped payload", flip_last_payload_byte, "a flipped payload byte");
  check_detected("flipped magic", flip_magic, "a flipped magic byte");
  check_detected("flipped checksum", flip_checksum, "a flipped checksum byte");
  check_detected("flipped key", flip_stored_key, "a flipped byte of the stored key");
  check_detected("one byte appended", append_byte, "a file with a byte appended");
  check_detected("key swapped", copy_other_key_file, "the file of another key");
}

/* ---- unwritable cache directories ---- */

static void check_store_fails(const char *needle) {
  og_log_reset();
  const int32_t st = store_bytes("unwritable", "data", 4);
  if (st != OPGRAFT_EIO) fail_msg("store gave %s, expected OPGRAFT_EIO", opgraft_status_name(st));
  assert_true(opgraft_last_error()[0] != 0);
  if (og_log_warnings(needle) != 1) {
    og_log_dump();
    fail_msg("expected one warning containing \"%s\"", needle);
  }
  og_cubin c = {NULL, 0, NULL};
  assert_int_not_equal(opgraft__cache_load("unwritable", &c), OPGRAFT_OK);
}

static void test_store_in_readonly_dir(void **state) {
  const char *dir = use_cache_dir("readonly");
  assert_int_equal(mkdir(dir, 0755), 0);
  assert_int_equal(chmod(dir, 0555), 0);
  if (access(dir, W_OK) == 0) {
    chmod(dir, 0755);
    print_message("skipping: %s stays writable after chmod 0555 (running as root); "
                  "test_store_under_regular_file covers the unwritable case instead\n", dir);
    skip();
  }
  check_store_fails("not writable");
  assert_int_equal(count_entries(dir, ""), 0);
  chmod(dir, 0755);
}

static void test_store_under_regular_file(void **state) {
  char file[1024], dir[1100];
  snprintf(file, sizeof file, "%s/plain-file", root);
  og_write_file(file, "not a directory");
  snprintf(dir, sizeof dir, "%s/sub", file);
  setenv("OPGRAFT_CACHE_DIR", dir, 1);
  check_store_fails("cannot be created");
}

/* ---- concurrent writers ---- */

#define CONC_KEY "concurrent key"
#define CONC_BYTES 8192
#define CONC_ITERS 200

/* Child role: stores and reloads CONC_KEY CONC_ITERS times; every call must succeed. */
static int role_store(void) {
  static char data[CONC_BYTES];
  make_payload(data, sizeof data, 5);
  for (int i = 0; i < CONC_ITERS; ++i) {
    OG_CHILD_CHECK(store_bytes(CONC_KEY, data, sizeof data) == OPGRAFT_OK);
    og_cubin c = {NULL, 0, NULL};
    OG_CHILD_CHECK(opgraft__cache_load(CONC_KEY, &c) == OPGRAFT_OK);
    OG_CHILD_CHECK(c.size == sizeof data && memcmp(c.data, data, sizeof data) == 0);
    opgraft__cubin_free(&c);
  }
  return 0;
}

static void test_concurrent_stores(void **state) {
  const char *dir = use_cache_dir("concurrent");
  static char data[CONC_BYTES];
  make_payload(data, sizeof data, 5);
  store_ok(CONC_KEY, data, sizeof data);
  const pid_t a = og_spawn_role("store"), b = og_spawn_role("store");
  const int ra = og_wait(a), rb = og_wait(b);
  if (ra != 0 || rb != 0) fail_msg("concurrent writers exited with %d and %d", ra, rb);
  load_matches(CONC_KEY, data, sizeof data);
  assert_int_equal(count_entries(dir, ".tmp."), 0);
  assert_int_equal(count_entries(dir, ""), 1);
}

/* ---- opgraft__cubin_cached with NVRTC ---- */

/* Child role: gets the stream_read cubin for sm_90 twice. Exit status: 0 loaded from the disk
 * cache, 10 compiled, 11 compiled after a warning about a corrupt file, 77 no NVRTC, else a
 * failure. */
static int role_cubin(void) {
  og_log_start();
  if (!opgraft__nvrtc()) {
    fprintf(stderr, "NVRTC cannot be loaded: %s\n", opgraft_last_error());
    return 77;
  }
  const char *dir = getenv("OPGRAFT_CACHE_DIR");
  DIR *d = dir ? opendir(dir) : NULL;
  int cached = 0;
  for (struct dirent *e; d && (e = readdir(d));) cached += strstr(e->d_name, ".cubin") != NULL;
  if (d) closedir(d);
  og_cubin c = {NULL, 0, NULL};
  OG_CHILD_CHECK(opgraft__cubin_cached("common/stream_read.cu", NULL, 0, 90, &c) == OPGRAFT_OK);
  OG_CHILD_CHECK(c.data && c.size > 64 && memcmp(c.data, "\x7f" "ELF", 4) == 0);
  /* The compiler's resource report comes with the cubin, from the compile or from the file. */
  OG_CHILD_CHECK(c.log && strstr(c.log, "stream_read_u128"));
  /* The second call in the same process is served from memory, byte for byte. */
  og_cubin again = {NULL, 0, NULL};
  OG_CHILD_CHECK(opgraft__cubin_cached("common/stream_read.cu", NULL, 0, 90, &again) == OPGRAFT_OK);
  OG_CHILD_CHECK(again.size == c.size && memcmp(again.data, c.data, c.size) == 0 && strcmp(again.log, c.log) == 0);
  opgraft__cubin_free(&c);
  opgraft__cubin_free(&again);
  const int warned = og_log_warnings("corrupt") > 0;
  const int compiled = cached == 0 || warned;
  if (!compiled) return warned ? 2 : 0;
  return warned ? 11 : 10;
}

static uint64_t fnv1a(const void *data, size_t n) {
  const unsigned char *p = data;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

/* Finds the one *.cubin file in dir and checks its layout: a payload that is an ELF file with the
 * stored checksum. */
static void the_cubin_file(const char *dir, char *path, size_t len, struct stat *sb) {
  assert_int_equal(count_entries(dir, ".cubin"), 1);
  assert_int_equal(count_entries(dir, ".tmp."), 0);
  DIR *d = opendir(dir);
  assert_non_null(d);
  path[0] = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (strstr(e->d_name, ".cubin")) snprintf(path, len, "%s/%s", dir, e->d_name);
  closedir(d);
  assert_int_equal(stat(path, sb), 0);
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  char *buf = malloc((size_t)sb->st_size);
  assert_non_null(buf);
  assert_int_equal(fread(buf, 1, (size_t)sb->st_size, f), (size_t)sb->st_size);
  fclose(f);
  uint64_t hdr[4];
  memcpy(hdr, buf + 16, sizeof hdr);
  assert_int_equal(HEADER_BYTES + hdr[0] + hdr[1] + hdr[2], (uint64_t)sb->st_size);
  const char *payload = buf + HEADER_BYTES + hdr[0];
  assert_memory_equal(payload, "\x7f" "ELF", 4);
  assert_true((fnv1a(payload, hdr[1]) ^ (fnv1a(payload + hdr[1], hdr[2]) * 31u)) == hdr[3]);
  assert_non_null(memmem(payload + hdr[1], hdr[2], "stream_read_u128", strlen("stream_read_u128")));
  assert_non_null(memmem(buf + HEADER_BYTES, hdr[0], "stream_read.cu", strlen("stream_read.cu")));
  free(buf);
}

static void test_cubin_cached(void **state) {
  const char *dir = use_cache_dir("cubins");
  int rc = og_run_role("cubin");
  if (rc == 77) {
    if (og_allow_no_nvrtc()) {
      print_message("skipping: NVRTC cannot be loaded and OPGRAFT_TEST_ALLOW_NO_NVRTC=1\n");
      skip();
    }
    fail_msg("NVRTC cannot be loaded (set OPGRAFT_TEST_ALLOW_NO_NVRTC=1 to skip this test)");
  }
  if (rc != 10) fail_msg("first process: status %d, expected 10 (compiled)", rc);
  char path[1024];
  struct stat first, sb;
  the_cubin_file(dir, path, sizeof path, &first);

  /* A fresh process loads the file and leaves it alone. */
  rc = og_run_role("cubin");
  if (rc != 0) fail_msg("second process: status %d, expected 0 (loaded from the cache)", rc);
  the_cubin_file(dir, path, sizeof path, &sb);
  assert_true(sb.st_ino == first.st_ino);
  assert_true(sb.st_mtim.tv_sec == first.st_mtim.tv_sec && sb.st_mtim.tv_nsec == first.st_mtim.tv_nsec);

  /* A corrupt file is rebuilt, with a warning, and replaced. */
  flip_last_payload_byte(path, NULL);
  rc = og_run_role("cubin");
  if (rc != 11) fail_msg("after corruption: status %d, expected 11 (rebuilt with a warning)", rc);
  the_cubin_file(dir, path, sizeof path, &sb);
  assert_true(sb.st_ino != first.st_ino);
  rc = og_run_role("cubin");
  if (rc != 0) fail_msg("after the rebuild: status %d, expected 0 (loaded from the cache)", rc);
}

/* A FIFO at a cache path must not block the reader; a huge file there is refused before it is
 * read (a planted file costs neither a hang nor its size in memory). */
static void test_fifo_and_huge_file(void **state) {
  use_cache_dir("planted");
  store_ok("planted-key", "payload", 7);
  char path[1024];
  path_of("planted-key", path, sizeof path);
  assert_int_equal(unlink(path), 0);
  assert_int_equal(mkfifo(path, 0644), 0);
  og_log_reset();
  og_cubin c = {NULL, 0, NULL};
  assert_int_equal(opgraft__cache_load("planted-key", &c), OPGRAFT_EPARSE);
  assert_int_equal(og_log_warnings("not a regular file"), 1);
  assert_int_equal(unlink(path), 0);
  /* 1 GiB of sparse file: refused by its size, nothing read. */
  const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  assert_true(fd >= 0);
  assert_int_equal(ftruncate(fd, (off_t)1 << 30), 0);
  close(fd);
  assert_int_equal(opgraft__cache_load("planted-key", &c), OPGRAFT_EPARSE);
  assert_null(c.data);
  /* And a store replaces the planted file with a good one. */
  store_ok("planted-key", "payload", 7);
  load_matches("planted-key", "payload", 7);
}

/* opgraft_cache_check says whether the directory can be used, as the library itself would. */
static void test_cache_check(void **state) {
  char dir[1024], sub[1100];
  const char *d = use_cache_dir("check");
  assert_int_equal(opgraft_cache_check(dir, sizeof dir), OPGRAFT_OK); /* created */
  assert_string_equal(dir, d);
  struct stat sb;
  assert_int_equal(stat(d, &sb), 0);
  assert_true(S_ISDIR(sb.st_mode));
  /* A regular file. */
  snprintf(sub, sizeof sub, "%s/a-file", d);
  og_write_file(sub, "x");
  setenv("OPGRAFT_CACHE_DIR", sub, 1);
  assert_int_equal(opgraft_cache_check(dir, sizeof dir), OPGRAFT_EIO);
  assert_non_null(strstr(opgraft_last_error(), "not a directory"));
  /* A path too long to hold the cache's files. */
  char longp[1000];
  memset(longp, 'a', sizeof longp - 1);
  longp[0] = '/';
  longp[sizeof longp - 1] = 0;
  setenv("OPGRAFT_CACHE_DIR", longp, 1);
  assert_int_equal(opgraft_cache_check(dir, sizeof dir), OPGRAFT_ERANGE);
  /* A directory that cannot be written (root can write anywhere: then only the create case). */
  snprintf(sub, sizeof sub, "%s/ro", d);
  assert_int_equal(mkdir(sub, 0555), 0);
  setenv("OPGRAFT_CACHE_DIR", sub, 1);
  if (geteuid() != 0) assert_int_equal(opgraft_cache_check(dir, sizeof dir), OPGRAFT_EIO);
  chmod(sub, 0755);
  /* No directory at all. */
  unsetenv("OPGRAFT_CACHE_DIR");
  const char *home = getenv("HOME"), *xdg = getenv("XDG_CACHE_HOME");
  char *h = home ? strdup(home) : NULL, *x = xdg ? strdup(xdg) : NULL;
  unsetenv("HOME");
  unsetenv("XDG_CACHE_HOME");
  assert_int_equal(opgraft_cache_check(dir, sizeof dir), OPGRAFT_ENOTFOUND);
  assert_string_equal(dir, "");
  if (h) setenv("HOME", h, 1);
  if (x) setenv("XDG_CACHE_HOME", x, 1);
  free(h), free(x);
}

int main(int argc, char **argv) {
  (void)argc;
  og_set_self(argv[0]);
  const char *role = getenv("OG_TEST_ROLE");
  if (role && strcmp(role, "store") == 0) return role_store();
  if (role && strcmp(role, "cubin") == 0) return role_cubin();
  if (role) return 126;

  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_cache_dir_precedence, save_env, restore_env),
      cmocka_unit_test(test_cache_path),
      cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_unknown_key),
      cmocka_unit_test(test_corrupt_files),
      cmocka_unit_test(test_store_in_readonly_dir),
      cmocka_unit_test(test_store_under_regular_file),
      cmocka_unit_test(test_concurrent_stores),
      cmocka_unit_test(test_cubin_cached),
      cmocka_unit_test(test_fifo_and_huge_file),
      cmocka_unit_test(test_cache_check),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
