/* keel-bench: command line. The work is in harness.c; suites register
 * themselves from bench/suite_*.c (see bench.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness_internal.h"

static void usage(FILE *f) {
  fprintf(f, "usage: keel-bench SUITE|all [options]\n"
             "       keel-bench --list\n"
             "\n"
             "Runs every case of SUITE for each implementation in its own child process\n"
             "(allocator peers under LD_PRELOAD), interleaved across repetitions, and prints\n"
             "the medians as a table with ratios against the first implementation (keel).\n"
             "\n"
             "  --threads LIST   thread counts, e.g. 1,2,8,64,256 (default: the suite's)\n"
             "  --size S         small | default | large | a scale factor (default: default)\n"
             "  --reps N         repetitions per implementation (default 3, or more where a\n"
             "                   case asks: sched throughput, cpu and latency take 7)\n"
             "  --json           JSON lines on stdout instead of tables\n"
             "  --out FILE       also write the JSON lines to FILE (tables still printed)\n"
             "  --case LIST      only these cases (comma-separated)\n"
             "  --impl LIST      only these implementations (comma-separated)\n"
             "  --timeout S      kill a run after S seconds (default 300)\n"
             "  --list           list suites and cases (--list-tsv: one tab-separated line\n"
             "                   per case: suite, case, threaded, metric, lower_is_better)\n"
             "\n"
             "Peer libraries are found with ldconfig -p; KB_PRELOAD_<IMPL>=path overrides.\n"
             "Exit status: 0, 1 if some run crashed or timed out (the rest still ran), 2 usage.\n");
}

/* The value of option argv[*i] (which needs one), advancing *i. */
static const char *arg_value(int argc, char **argv, int *i) {
  if (*i + 1 >= argc) {
    fprintf(stderr, "keel-bench: %s needs a value\n", argv[*i]);
    exit(2);
  }
  return argv[++*i];
}

static int parse_options(int argc, char **argv, kb_opts_t *o) {
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--threads") == 0) {
      o->threads = arg_value(argc, argv, &i);
    } else if (strcmp(a, "--size") == 0) {
      o->size = arg_value(argc, argv, &i);
      if (!kb_parse_size(o->size, &o->scale)) {
        fprintf(stderr, "keel-bench: bad --size '%s' (small, default, large or a number)\n",
                o->size);
        return 2;
      }
    } else if (strcmp(a, "--reps") == 0) {
      o->reps = atoi(arg_value(argc, argv, &i));
      o->reps_given = true;
    } else if (strcmp(a, "--json") == 0) {
      o->json = true;
    } else if (strcmp(a, "--out") == 0) {
      const char *path = arg_value(argc, argv, &i);
      if ((o->out_fp = fopen(path, "w")) == NULL) {
        perror(path);
        return 2;
      }
    } else if (strcmp(a, "--case") == 0) {
      o->cases = arg_value(argc, argv, &i);
    } else if (strcmp(a, "--impl") == 0) {
      o->impls = arg_value(argc, argv, &i);
    } else if (strcmp(a, "--timeout") == 0) {
      o->timeout_s = atof(arg_value(argc, argv, &i));
      if (!(o->timeout_s > 0)) {
        fprintf(stderr, "keel-bench: bad --timeout\n");
        return 2;
      }
    } else {
      fprintf(stderr, "keel-bench: unknown option '%s'\n\n", a);
      usage(stderr);
      return 2;
    }
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "--child") == 0) return kb_child_main(argc - 2, argv + 2);
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (strcmp(argv[1], "--list") == 0 || strcmp(argv[1], "--list-tsv") == 0) {
    kb_list(strcmp(argv[1], "--list-tsv") == 0);
    return 0;
  }
  bool all = strcmp(argv[1], "all") == 0;
  const kb_suite_t *s = all ? kb_suite_first() : kb_suite_find(argv[1]);
  if (s == NULL) {
    fprintf(stderr, "keel-bench: no suite '%s' (see keel-bench --list)\n", argv[1]);
    return 2;
  }
  kb_opts_t o = {.size = "default", .scale = 1.0, .reps = 3, .timeout_s = 300, .all_suites = all};
  int rc = parse_options(argc, argv, &o);
  if (rc != 0) return rc;
  for (; s; s = all ? s->next : NULL) {
    int r = kb_suite_run(s, &o);
    if (r > rc) rc = r;
  }
  if (o.out_fp) fclose(o.out_fp);
  return rc;
}
