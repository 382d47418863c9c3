/* keel's test harness: small, in-tree, no framework.
 *
 * One executable per module lists its cases with KT_MAIN(KT_CASE(a), ...).
 * Each case runs in turn; KT_CHECK records a failure and goes on, KT_REQUIRE
 * records one and ends the case (main thread only). The run ends with the
 * line "N passed, N failed" that CTest and CI read; the exit status is 0 only
 * if nothing failed. `./test_x NAME` runs the cases whose name contains NAME.
 *
 * Stress tests size themselves with kt_env_int() (KEEL_TEST_THREADS,
 * KEEL_TEST_ITERS, ...) and kt_scale(), which divides work under sanitizers.
 */
#ifndef KEEL_TESTS_HARNESS_H
#define KEEL_TESTS_HARNESS_H

#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct kt_case {
  const char *name;
  void (*fn)(void);
} kt_case_t;

#define KT_CASE(f)                                                                                 \
  { #f, f }

int kt_main(int argc, char **argv, const kt_case_t *cases, size_t n);

#define KT_MAIN(...)                                                                               \
  int main(int argc, char **argv) {                                                                \
    static const kt_case_t kt_cases_[] = {__VA_ARGS__};                                            \
    return kt_main(argc, argv, kt_cases_, sizeof(kt_cases_) / sizeof(kt_cases_[0]));               \
  }

/* Records a failure of the running case; thread-safe. */
void kt_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Ends the running case (main thread only). */
__attribute__((noreturn)) void kt_abort_case(void);

#define KT_CHECK(e) ((e) ? (void)0 : kt_fail(__FILE__, __LINE__, "check failed: %s", #e))
#define KT_REQUIRE(e)                                                                              \
  do {                                                                                             \
    if (!(e)) {                                                                                    \
      kt_fail(__FILE__, __LINE__, "requirement failed: %s", #e);                                   \
      kt_abort_case();                                                                             \
    }                                                                                              \
  } while (0)
#define KT_EQ(a, b)                                                                                \
  do {                                                                                             \
    long long kt_a_ = (long long)(a), kt_b_ = (long long)(b);                                      \
    if (kt_a_ != kt_b_)                                                                            \
      kt_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, kt_a_, kt_b_);                 \
  } while (0)
#define KT_STREQ(a, b)                                                                             \
  do {                                                                                             \
    const char *kt_a_ = (a), *kt_b_ = (b);                                                         \
    if (kt_a_ == NULL || kt_b_ == NULL || strcmp(kt_a_, kt_b_) != 0)                               \
      kt_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, #b, kt_a_ ? kt_a_ : "(null)",  \
              kt_b_ ? kt_b_ : "(null)");                                                           \
  } while (0)
#define KT_CONTAINS(hay, needle)                                                                   \
  do {                                                                                             \
    const char *kt_h_ = (hay), *kt_n_ = (needle);                                                  \
    if (kt_h_ == NULL || strstr(kt_h_, kt_n_) == NULL)                                             \
      kt_fail(__FILE__, __LINE__, "%s contains \"%s\": got \"%s\"", #hay, kt_n_,                   \
              kt_h_ ? kt_h_ : "(null)");                                                           \
  } while (0)

/* True when built with ASan or TSan (work is scaled down there). */
bool kt_sanitized(void);
/* An integer from the environment, or `def`. */
long kt_env_int(const char *name, long def);
/* `n` divided by the sanitizer slow-down (8 under sanitizers), at least 1. */
long kt_scale(long n);

/* Runs fn(arg) in a forked child with stderr captured. Returns true if the
 * child died of SIGABRT and its stderr contains `expect`; otherwise records a
 * failure showing what happened. `out`, if given, receives the stderr text. */
bool kt_expect_abort(const char *file, int line, void (*fn)(void *), void *arg, const char *expect,
                     char *out, size_t out_len);
#define KT_EXPECT_ABORT(fn, arg, expect)                                                           \
  kt_expect_abort(__FILE__, __LINE__, (fn), (arg), (expect), NULL, 0)

/* Redirects stderr to a temporary file until kt_stderr_end, which copies what
 * was written into buf (NUL-terminated) and restores stderr. */
void kt_stderr_begin(void);
void kt_stderr_end(char *buf, size_t len);

/* Wall-clock seconds, monotonic. */
double kt_now(void);

/* Sleeps ms milliseconds (fractions too). */
void kt_sleep_ms(double ms);

/* Polls cond(arg) every 0.2 ms until it holds or `sec` seconds have passed;
 * returns cond(arg). */
bool kt_wait_for(bool (*cond)(void *), void *arg, double sec);

/* Resident set size of this process in KiB. */
size_t kt_rss_kb(void);

/* Bytes keel's heap counts live (keel_heap_stats): exact while no other
 * thread allocates (the call syncs the caller's own pages). Inline, so the
 * harness library itself needs no heap. */
#include <keel/heap.h>
static inline size_t kt_heap_live_bytes(void) {
  keel_heap_stats_t st;
  keel_heap_stats(&st);
  return st.live_bytes;
}

#endif /* KEEL_TESTS_HARNESS_H */
