/* Baselines for the sched suite (bench/suite_sched.c): the classic
 * mutex+condvar thread pool, and the pre-patch GlusterFS layout built from
 * several of them. Intrusive jobs, like keel's, so no peer pays for an
 * allocation the others do not make. */
#ifndef KEEL_BENCH_BASELINE_MUTEX_POOL_H
#define KEEL_BENCH_BASELINE_MUTEX_POOL_H

#include <stdint.h>

typedef struct mp_job {
  struct mp_job *next;
  void (*fn)(struct mp_job *job);
} mp_job_t;

typedef struct mpool mpool_t;

/* Starts `threads` workers. NULL on failure. */
mpool_t *mpool_create(int threads);
/* Appends under the pool mutex; signals the condvar if a worker waits. */
void mpool_submit(mpool_t *p, mp_job_t *job);
/* Waits until the queue is empty and every worker idle, then joins them and
 * frees the pool. Returns the jobs run. */
uint64_t mpool_drain_destroy(mpool_t *p);
/* Workers alive now. */
int mpool_threads(mpool_t *p);

/* The pre-patch GlusterFS layout: one pool per brick/translator, each with
 * its own threads; a producer always submits to "its" pool (index mod). */
typedef struct gpools gpools_t;
gpools_t *gpools_create(int pools, int threads_per_pool);
void gpools_submit(gpools_t *g, int producer, mp_job_t *job);
uint64_t gpools_drain_destroy(gpools_t *g);
int gpools_threads(gpools_t *g);

#endif
