/* The `keel` command (tools/keel), run as a child process: usage errors,
 * `classes`, `stats --options`, and `pheap check|info` on a good, a
 * corrupted, a locked and a missing pool file. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <keel/pheap.h>

#include "harness.h"

static char out[1 << 16];

/* Runs `keel ARGS` with stderr joined to stdout; returns its exit status
 * (-1 if it did not exit). The output is left in `out`. */
static int keel(const char *args) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", KEEL_TOOL, args);
  FILE *f = popen(cmd, "r");
  KT_REQUIRE(f != NULL);
  size_t n = fread(out, 1, sizeof out - 1, f);
  out[n] = '\0';
  int st = pclose(f);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void usage_errors(void) {
  KT_EQ(keel(""), 2);
  KT_CONTAINS(out, "usage: keel COMMAND");
  KT_CONTAINS(out, "pheap check|info FILE");
  KT_EQ(keel("nosuch"), 2);
  KT_CONTAINS(out, "unknown command 'nosuch'");
  KT_EQ(keel("pheap"), 2);
  KT_CONTAINS(out, "usage: keel pheap check|info FILE");
  KT_EQ(keel("pheap fix /dev/null"), 2);
  KT_EQ(keel("classes abc"), 2);
  KT_CONTAINS(out, "'abc' is not a size in bytes");
}

static void classes(void) {
  /* Squid's 4108-byte struct: one 4112-byte block, not two pages. */
  KT_EQ(keel("classes 4108"), 0);
  KT_CONTAINS(out, "4108 bytes -> class");
  KT_CONTAINS(out, "4112-byte blocks (serves 4097..4112)");
  KT_EQ(keel("classes"), 0);
  KT_CONTAINS(out, "4112");
}

static void stats_options(void) {
  KT_EQ(keel("stats --options"), 0);
  KT_CONTAINS(out, "heap_purge_ms");
  KT_CONTAINS(out, "pool_sweep_s");
}

static void pool_path(char *p, size_t len, const char *tag) {
  const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf(p, len, "%s/keel-tool-test-%d-%s", dir, (int)getpid(), tag);
  unlink(p);
}

static void make_pool(const char *p, int objects) {
  keel_pheap_t *ph = keel_pheap_create(p, "tooltest", KEEL_PHEAP_MIN_SIZE, 0);
  KT_REQUIRE(ph != NULL);
  keel_poff_t *r = keel_pheap_root(ph, 64 * sizeof *r);
  KT_REQUIRE(r != NULL);
  for (int i = 0; i < objects; i++) KT_EQ(keel_pheap_alloc(ph, &r[i], 100, 3), 0);
  KT_EQ(keel_pheap_close(ph), 0);
}

static void pheap_good(void) {
  char p[256], args[512];
  pool_path(p, sizeof p, "good");
  make_pool(p, 5);
  snprintf(args, sizeof args, "pheap check '%s'", p);
  KT_EQ(keel(args), 0);
  KT_CONTAINS(out, "ok: 6 live objects"); /* the root and 5 */
  snprintf(args, sizeof args, "pheap info '%s'", p);
  KT_EQ(keel(args), 0);
  KT_CONTAINS(out, "layout        tooltest");
  KT_CONTAINS(out, "live objects  6 (");
  KT_CONTAINS(out, "pending logs  0");
  unlink(p);
}

/* A byte of the header changed: check and info refuse the file, naming it,
 * and leave it as it was. */
static void pheap_corrupt(void) {
  char p[256], args[512];
  pool_path(p, sizeof p, "corrupt");
  make_pool(p, 1);
  FILE *f = fopen(p, "r+");
  KT_REQUIRE(f != NULL);
  KT_REQUIRE(fseek(f, 64, SEEK_SET) == 0 && fputc('X', f) != EOF);
  fclose(f);
  snprintf(args, sizeof args, "pheap check '%s'", p);
  KT_EQ(keel(args), 1);
  KT_CONTAINS(out, p);
  KT_CONTAINS(out, "corrupt");
  snprintf(args, sizeof args, "pheap info '%s'", p);
  KT_EQ(keel(args), 1);
  KT_CONTAINS(out, "corrupt");
  unlink(p);
}

static void pheap_missing_and_locked(void) {
  char p[256], args[512];
  pool_path(p, sizeof p, "missing");
  snprintf(args, sizeof args, "pheap check '%s'", p);
  KT_EQ(keel(args), 1);
  KT_CONTAINS(out, p);
  KT_CONTAINS(out, "cannot open");
  pool_path(p, sizeof p, "locked");
  make_pool(p, 1);
  keel_pheap_t *ph = keel_pheap_open(p, "tooltest"); /* held: the file is locked */
  KT_REQUIRE(ph != NULL);
  snprintf(args, sizeof args, "pheap check '%s'", p);
  KT_EQ(keel(args), 1);
  KT_CONTAINS(out, "locked by another process");
  KT_EQ(keel_pheap_close(ph), 0);
  KT_EQ(keel(args), 0);
  unlink(p);
}

KT_MAIN(KT_CASE(usage_errors), KT_CASE(classes), KT_CASE(stats_options), KT_CASE(pheap_good),
        KT_CASE(pheap_corrupt), KT_CASE(pheap_missing_and_locked))
