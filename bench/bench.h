/* keel-bench: the benchmark harness's contract with its suites.
 *
 *   keel-bench SUITE|all [--threads LIST] [--size S] [--reps N] [--json] [--case NAME]
 *              [--impl LIST] [--out FILE] [--timeout S]
 *   keel-bench --list | --list-tsv
 *
 * (--case and --impl take comma lists; --out writes the JSON lines to FILE
 * while the tables still go to stdout; --timeout, default 300 s, kills a run
 * that takes longer. Exit status 0, or 1 when some run crashed or timed out:
 * the others still ran and were reported. `keel-bench --help` has the rest.)
 *
 * A suite (one file, bench/suite_<name>.c) registers itself with
 * KB_SUITE(...). It has cases; a case has implementations ("impls": keel and
 * its peers) and a function that runs one measurement. The harness runs every
 * (case, threads, impl) in a child process of its own (so peak RSS, user and
 * sys time belong to that impl alone), interleaving impls within each
 * repetition, and reports the median of the repetitions (--reps, 3 by
 * default; a case may ask for more with min_reps when --reps is not given).
 *
 * An impl that names a `preload` runs its child with LD_PRELOAD set to that
 * allocator ("jemalloc", "mimalloc", "tcmalloc", "keel" = build/lib/
 * libkeel-malloc.so; "glibc" = no preload). A peer whose library is missing
 * is skipped with a printed note. Impls with preload NULL run in a plain
 * child (the case function picks the implementation by name).
 *
 * Output: with --json one JSON object per line:
 *   {"suite","case","impl","threads","ops_per_s","ns_per_op","user_s","sys_s",
 *    "peak_rss_kb","extra":{...}}
 * Without it, a table per case: rows are thread counts, columns impls, each
 * peer shown with its ratio against the first impl (keel).
 */
#ifndef KEEL_BENCH_H
#define KEEL_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What one child measurement is asked to do. */
typedef struct kb_params {
  const char *suite;
  const char *case_name;
  const char *impl; /* the impl's name, e.g. "keel", "mutex-pool" */
  int threads;      /* 1 for cases that are not threaded */
  const char *size; /* the --size argument as given: "default", "small", "large" or a number */
  double scale;     /* "small" 0.1, "default" 1, "large" 10, or the number given */
} kb_params_t;

/* What one child measurement reports. ops and seconds are required; the
 * harness derives ops_per_s and ns_per_op. Extras are numeric key/values. */
#define KB_EXTRA_MAX 16
typedef struct kb_result {
  double ops;     /* operations done in the timed region */
  double seconds; /* wall seconds of the timed region */
  int n_extra;
  struct {
    char key[32];
    double value;
  } extra[KB_EXTRA_MAX];
} kb_result_t;

/* Adds or replaces an extra value (e.g. "rss_after_trim_kb"). */
void kb_extra(kb_result_t *r, const char *key, double value);

/* Runs one measurement; returns 0, or non-zero (with a message on stderr)
 * when the impl cannot run here, which the harness prints and skips. */
typedef int (*kb_case_fn)(const kb_params_t *p, kb_result_t *r);

typedef struct kb_impl {
  const char *name;    /* shown in tables and JSON */
  const char *preload; /* allocator to LD_PRELOAD (see above) or NULL */
} kb_impl_t;

/* The allocator peers, in table order: keel first. */
#define KB_MALLOC_IMPLS                                                                            \
  {"keel", "keel"}, {"glibc", "glibc"}, {"jemalloc", "jemalloc"}, {"mimalloc", "mimalloc"}, {      \
    "tcmalloc", "tcmalloc"                                                                         \
  }

typedef struct kb_case {
  const char *name;
  const char *help;
  kb_case_fn run;
  const kb_impl_t *impls; /* terminated by {NULL, NULL}; impls[0] is the reference */
  bool threaded;          /* runs at each --threads value; otherwise once, threads = 1 */
  /* The metric in the table: NULL = ops_per_s (higher is better), or
   * "peak_rss_kb", "sys_s", "ns_per_op" or an extra's key. */
  const char *metric;
  bool lower_is_better;
  /* Repetitions at least, unless --reps is given (0: the default). For cases
   * whose timed window is a few tens of milliseconds, where one scheduler
   * hiccup on a shared machine moves a single run by 1.5x. */
  int min_reps;
  /* A threaded case's thread counts when --threads is not given (NULL: the
   * suite's default_threads), e.g. "1,2" for cases the issue asks at 1 and
   * 2 threads only. */
  const char *threads;
} kb_case_t;

typedef struct kb_suite {
  const char *name;
  const char *help;
  const kb_case_t *cases;      /* terminated by {NULL} */
  const char *default_threads; /* e.g. "1,2,8,64,256" */
  struct kb_suite *next;       /* harness-owned */
} kb_suite_t;

void kb_suite_register(kb_suite_t *s);

#define KB_SUITE(id, ...)                                                                          \
  static kb_suite_t kb_suite_##id = __VA_ARGS__;                                                   \
  __attribute__((constructor)) static void kb_suite_register_##id(void) {                          \
    kb_suite_register(&kb_suite_##id);                                                             \
  }

/* Helpers for case functions. */
double kb_now(void); /* monotonic seconds */
/* CPU time of the calling thread in ns: on a machine shared with other work
 * the wall clock measures how much CPU a run was given as much as the code
 * under test; a thread's CPU time per operation does not. */
uint64_t kb_thread_cpu_ns(void);
size_t kb_rss_kb(void);        /* current RSS of this process in KiB */
uint64_t kb_rand(uint64_t *s); /* xorshift64*: deterministic per seed */

/* Runs fn(i, arg) on `threads` threads started together behind a barrier;
 * returns the wall seconds from the barrier's release to the last join. */
double kb_run_threads(int threads, void (*fn)(int i, void *arg), void *arg);

/* kb_run_threads with hooks around the timed span: begin(ctx) runs once
 * every thread exists and waits at the start; end(ctx) runs once every
 * thread has returned from fn but before any exits. The seconds returned
 * run from the start to end's return. A case that reads CPU time in the
 * hooks measures the work, not the creation and exit of its threads
 * (clone, stack mmap and munmap: at 256 threads, more sys time than the
 * work of a million scheduler jobs). */
typedef struct kb_span {
  void (*begin)(void *ctx);
  void (*end)(void *ctx);
  void *ctx;
} kb_span_t;
double kb_run_threads_span(int threads, void (*fn)(int i, void *arg), void *arg,
                           const kb_span_t *span);

/* Keeps the compiler from optimising a value away. */
#define kb_escape(p) __asm__ __volatile__("" : : "g"(p) : "memory")

#endif /* KEEL_BENCH_H */
