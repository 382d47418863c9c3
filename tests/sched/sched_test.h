/* Helpers shared by the sched test files that count runs and notices per
 * job (test_sched.c keeps its own, richer tjob). */
#ifndef KEEL_TESTS_SCHED_TEST_H
#define KEEL_TESTS_SCHED_TEST_H

#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

#include <keel/sched.h>

#include "harness.h"

#define container_of(p, T, m) ((T *)(void *)((char *)(p)-offsetof(T, m)))

static inline bool flag_set(void *a) {
  return atomic_load((atomic_int *)a) != 0;
}

/* A job that counts its runs and its cancel notices. */
typedef struct tjob {
  keel_job_t job;
  atomic_int runs, cancels;
} tjob_t;

static inline void tjob_fn(keel_job_t *j) {
  atomic_fetch_add(&container_of(j, tjob_t, job)->runs, 1);
}

static inline void tjob_cancel(keel_job_t *j) {
  atomic_fetch_add(&container_of(j, tjob_t, job)->cancels, 1);
}

static inline void tjob_init(tjob_t *t, unsigned flags) {
  memset(t, 0, sizeof(*t));
  keel_job_init(&t->job, tjob_fn, flags);
  t->job.on_cancel = tjob_cancel;
}

/* Restarts the pool with this configuration. */
static inline void start(unsigned min, unsigned max, unsigned idle_ms, unsigned block_ms) {
  keel_sched_shutdown(KEEL_SCHED_DRAIN);
  keel_sched_config_t cfg = {min, max, idle_ms, block_ms};
  KT_EQ(keel_sched_init(&cfg), 0);
}

#endif /* KEEL_TESTS_SCHED_TEST_H */
