/* keel-bench, run as a user would: --list, a tiny heap run whose JSON lines
 * are checked field by field, the hidden selftest suite (a child that
 * crashes, one that hangs past --timeout and one that cannot run are
 * reported and the others still report), and usage errors.
 * KB_BIN is the keel-bench under test (set by CTest). */
#define _GNU_SOURCE
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define OUT_MAX (256 * 1024)

static char out[OUT_MAX], err[OUT_MAX];

static void slurp(const char *path, char *buf) {
  FILE *f = fopen(path, "r");
  size_t n = f ? fread(buf, 1, OUT_MAX - 1, f) : 0;
  buf[n] = '\0';
  if (f) fclose(f);
}

/* Runs `keel-bench ARGS`; stdout and stderr land in out and err. Returns
 * the exit status, or -1 if it did not exit normally. */
static int bench(const char *args) {
  const char *bin = getenv("KB_BIN");
  KT_REQUIRE(bin != NULL);
  char o[] = "/tmp/kb_outXXXXXX", e[] = "/tmp/kb_errXXXXXX";
  int fo = mkstemp(o), fe = mkstemp(e);
  KT_REQUIRE(fo >= 0 && fe >= 0);
  close(fo);
  close(fe);
  char cmd[1024];
  snprintf(cmd, sizeof(cmd), "'%s' %s >%s 2>%s", bin, args, o, e);
  int st = system(cmd);
  slurp(o, out);
  slurp(e, err);
  unlink(o);
  unlink(e);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A JSON number at p (as keel-bench prints them); advances past it. */
static bool json_number(const char **p) {
  char *end;
  double v = strtod(*p, &end);
  if (end == *p || v != v) return false;
  *p = end;
  return true;
}

/* True when `line` has every field bench.h promises, with numeric values,
 * and an extra object of numeric values. */
static bool json_line_ok(const char *line, const char *suite, const char *cname) {
  static const char *strings[] = {"suite", "case", "impl"};
  static const char *numbers[] = {"threads", "ops_per_s", "ns_per_op",
                                  "user_s",  "sys_s",     "peak_rss_kb"};
  char key[64];
  for (size_t i = 0; i < 3; i++) {
    snprintf(key, sizeof(key), "\"%s\":\"", strings[i]);
    if (strstr(line, key) == NULL)
      return kt_fail(__FILE__, __LINE__, "no %s in %s", key, line), false;
  }
  for (size_t i = 0; i < 6; i++) {
    snprintf(key, sizeof(key), "\"%s\":", numbers[i]);
    const char *p = strstr(line, key);
    if (p == NULL) return kt_fail(__FILE__, __LINE__, "no %s in %s", key, line), false;
    p += strlen(key);
    if (!json_number(&p) || (*p != ',' && *p != '}'))
      return kt_fail(__FILE__, __LINE__, "%s not numeric in %s", key, line), false;
  }
  snprintf(key, sizeof(key), "\"suite\":\"%s\",\"case\":\"%s\"", suite, cname);
  if (strstr(line, key) == NULL) return kt_fail(__FILE__, __LINE__, "not %s: %s", key, line), false;
  const char *p = strstr(line, "\"extra\":{");
  if (p == NULL) return kt_fail(__FILE__, __LINE__, "no extra in %s", line), false;
  for (p += 9; *p != '}';) {
    if (*p++ != '"') return false;
    while (*p && *p != '"') p++;
    if (*p++ != '"' || *p++ != ':' || !json_number(&p)) return false;
    if (*p == ',') p++;
  }
  return strcmp(p, "}}") == 0;
}

/* Checks every line of out; returns how many there were. */
static int json_lines_check(const char *suite, const char *cname) {
  int n = 0;
  for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"), n++)
    KT_CHECK(json_line_ok(line, suite, cname));
  return n;
}

static void test_list(void) {
  KT_EQ(bench("--list"), 0);
  KT_CONTAINS(out, "heap:");
  KT_CONTAINS(out, "pairs");
  KT_CONTAINS(out, "impls: keel glibc jemalloc mimalloc tcmalloc");
  KT_CHECK(strstr(out, "selftest") == NULL); /* hidden */
  KT_EQ(bench("--list-tsv"), 0);
  KT_CONTAINS(out, "heap\tpairs\t1\tns_per_op\t1\n");
  KT_CONTAINS(out, "heap\tsquid\t0\tpeak_rss_kb\t1\n");
}

static void test_heap_json(void) {
  KT_EQ(bench("heap --case pairs --threads 2 --reps 1 --size small --json"), 0);
  KT_CHECK(strstr(out, "\"impl\":\"glibc\",\"threads\":2,") != NULL);
  /* Every impl either reported or was skipped with a note. */
  static const char *impls[] = {"keel", "glibc", "jemalloc", "mimalloc", "tcmalloc"};
  for (size_t i = 0; i < 5; i++) {
    char want[64], note[64];
    snprintf(want, sizeof(want), "\"impl\":\"%s\"", impls[i]);
    snprintf(note, sizeof(note), "note: %s", impls[i]);
    if (strstr(out, want) == NULL && strstr(err, note) == NULL)
      kt_fail(__FILE__, __LINE__, "%s neither reported nor noted; stderr: %s", impls[i], err);
  }
  KT_CHECK(json_lines_check("heap", "pairs") >= 1);
}

static void test_failures_reported(void) {
  /* crash, hang (1 s timeout) and skip each fail for both impls; ok still
   * reports 2 impls x 2 thread counts, and the exit status says 1. */
  KT_EQ(bench("selftest --json --reps 2 --timeout 1"), 1);
  KT_CONTAINS(err, "note: selftest/crash a threads=1 rep 1: killed by signal 11");
  KT_CONTAINS(err, "note: selftest/crash b threads=1 rep 2: killed by signal 11");
  KT_CONTAINS(err, "note: selftest/hang a threads=1 rep 1: timed out after 1 s; killed");
  KT_CONTAINS(err, "note: selftest/skip b threads=1 rep 1: cannot run here");
  KT_CHECK(strstr(err, "selftest/hang a threads=1 rep 2") == NULL); /* not retried */
  KT_EQ(json_lines_check("selftest", "ok"), 4);
  /* Without --json a table still shows what happened. */
  KT_EQ(bench("selftest --case ok,crash --reps 1"), 1);
  KT_CONTAINS(out, "selftest/crash");
  KT_CONTAINS(out, "failed");
  KT_CONTAINS(out, "x)");
}

static void test_usage_errors(void) {
  KT_EQ(bench("nosuch"), 2);
  KT_CONTAINS(err, "no suite 'nosuch'");
  KT_EQ(bench("heap --threads 0"), 2);
  KT_CONTAINS(err, "bad --threads");
  KT_EQ(bench("heap --size huge"), 2);
  KT_CONTAINS(err, "bad --size");
  KT_EQ(bench("heap --case nosuch"), 2);
  KT_CONTAINS(err, "no case 'nosuch'");
  KT_EQ(bench("heap --frobnicate"), 2);
  KT_EQ(bench("--child 1 heap nosuch keel 1 default"), 2);
}

KT_MAIN(KT_CASE(test_list), KT_CASE(test_heap_json), KT_CASE(test_failures_reported),
        KT_CASE(test_usage_errors))
