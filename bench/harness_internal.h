/* keel-bench internals shared by main.c and harness.c (never installed; suites
 * see only bench.h).
 *
 * The parent process never runs a case itself: it plans the runs, starts one
 * child per (case, threads, impl, repetition) and keeps only the numbers that
 * come back, so its own footprint (a few MiB) is all that the children's peak
 * RSS can inherit from it (Linux carries the pre-exec RSS into ru_maxrss). */
#ifndef KEEL_BENCH_HARNESS_INTERNAL_H
#define KEEL_BENCH_HARNESS_INTERNAL_H

#include <stdbool.h>
#include <stdio.h>

#include "bench.h"

/* The command line, parsed once by main.c. */
typedef struct kb_opts {
  const char *threads; /* comma list; NULL = the suite's default_threads */
  const char *size;    /* as given; "default" when absent */
  double scale;        /* what `size` means as a factor (kb_params_t.scale) */
  int reps;            /* repetitions per (case, threads, impl) */
  bool reps_given;     /* --reps was on the command line (overrides min_reps) */
  bool json;           /* JSON lines on stdout instead of tables */
  const char *cases;   /* comma list of case names to run; NULL = all */
  bool all_suites;     /* `keel-bench all`: a suite may lack a --case name */
  const char *impls;   /* comma list of impl names to run; NULL = all */
  FILE *out_fp;        /* --out FILE: JSON lines also go here; NULL = no */
  double timeout_s;    /* per child run; killed and reported past it */
} kb_opts_t;

/* Parses "small" | "default" | "large" | a positive number into a scale
 * factor; returns false on anything else. */
bool kb_parse_size(const char *s, double *scale);

/* The suite named `name` (including the hidden "selftest"), or NULL. */
const kb_suite_t *kb_suite_find(const char *name);
/* The first registered suite in name order; walk on with ->next. */
const kb_suite_t *kb_suite_first(void);

/* Prints suites and cases with their help (human) or one tab-separated line
 * per case: suite, case, threaded (0/1), metric, lower_is_better (0/1). */
void kb_list(bool machine);

/* Runs every selected case of the suite and reports it; returns 0 when every
 * run finished, 1 when some crashed, timed out or failed (the rest still ran
 * and were reported), 2 on a usage error. */
int kb_suite_run(const kb_suite_t *s, const kb_opts_t *o);

/* The hidden `--child` entry point: argv after "--child" is
 * FD SUITE CASE IMPL THREADS SIZE. Runs one measurement and writes the result
 * to FD; returns the process exit status. */
int kb_child_main(int argc, char **argv);

#endif /* KEEL_BENCH_HARNESS_INTERNAL_H */
