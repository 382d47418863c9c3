/* The mutex+condvar thread pool every C server starts with (issue 6's
 * 33.1M jobs/s baseline): one mutex around a FIFO, one condvar, and a count
 * of waiting workers so that submit signals only when someone sleeps. One
 * job per lock acquisition, as in GlusterFS's io-threads and most hand-rolled
 * pools. Also the GlusterFS layout of many such pools (gpools_*). */
#include "baseline_mutex_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

struct mpool {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  mp_job_t *head, *tail;
  int waiting, running, nthreads;
  bool stop;
  _Atomic uint64_t done;
  pthread_t *threads;
};

static void *mpool_worker(void *arg) {
  mpool_t *p = arg;
  uint64_t done = 0;
  pthread_mutex_lock(&p->lock);
  for (;;) {
    while (p->head == NULL && !p->stop) {
      p->waiting++;
      pthread_cond_wait(&p->cond, &p->lock);
      p->waiting--;
    }
    if (p->head == NULL) break;
    mp_job_t *job = p->head;
    p->head = job->next;
    if (p->head == NULL) p->tail = NULL;
    pthread_mutex_unlock(&p->lock);
    job->fn(job);
    done++;
    pthread_mutex_lock(&p->lock);
  }
  pthread_mutex_unlock(&p->lock);
  atomic_fetch_add(&p->done, done);
  return NULL;
}

mpool_t *mpool_create(int threads) {
  mpool_t *p = calloc(1, sizeof(*p));
  if (p == NULL) return NULL;
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->cond, NULL);
  p->threads = calloc((size_t)threads, sizeof(pthread_t));
  p->nthreads = threads;
  for (int i = 0; i < threads; i++) pthread_create(&p->threads[i], NULL, mpool_worker, p);
  return p;
}

void mpool_submit(mpool_t *p, mp_job_t *job) {
  job->next = NULL;
  pthread_mutex_lock(&p->lock);
  if (p->tail)
    p->tail->next = job;
  else
    p->head = job;
  p->tail = job;
  if (p->waiting > 0) pthread_cond_signal(&p->cond);
  pthread_mutex_unlock(&p->lock);
}

uint64_t mpool_drain_destroy(mpool_t *p) {
  pthread_mutex_lock(&p->lock);
  p->stop = true; /* workers leave once the queue is empty */
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->lock);
  for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
  uint64_t done = atomic_load(&p->done);
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->cond);
  free(p->threads);
  free(p);
  return done;
}

int mpool_threads(mpool_t *p) {
  return p->nthreads;
}

struct gpools {
  int n;
  mpool_t **pools;
};

gpools_t *gpools_create(int pools, int threads_per_pool) {
  gpools_t *g = calloc(1, sizeof(*g));
  g->n = pools;
  g->pools = calloc((size_t)pools, sizeof(mpool_t *));
  for (int i = 0; i < pools; i++) g->pools[i] = mpool_create(threads_per_pool);
  return g;
}

void gpools_submit(gpools_t *g, int producer, mp_job_t *job) {
  mpool_submit(g->pools[producer % g->n], job);
}

uint64_t gpools_drain_destroy(gpools_t *g) {
  uint64_t done = 0;
  for (int i = 0; i < g->n; i++) done += mpool_drain_destroy(g->pools[i]);
  free(g->pools);
  free(g);
  return done;
}

int gpools_threads(gpools_t *g) {
  int t = 0;
  for (int i = 0; i < g->n; i++) t += mpool_threads(g->pools[i]);
  return t;
}
