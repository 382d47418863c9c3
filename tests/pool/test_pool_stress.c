/* Stress tests of src/pool: threads allocating from three pools, handing a
 * third of the objects to a neighbour to free (the reply path), while the
 * sweeper runs every few milliseconds and the main thread reclaims and
 * sweeps on its own; and 1,000 threads created and joined, each leaving
 * objects cached at exit.
 *
 * The invariant checked: an object belongs to one thread at a time. Each
 * owner fills its object with a byte derived from a stamp in the first word
 * and checks the fill before giving it away; two owners of one object would
 * overwrite each other's fill. Counts: KEEL_TEST_THREADS, KEEL_TEST_ITERS
 * (scaled down under sanitizers).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <keel/heap.h>
#include <keel/pool.h>

#include "base/options.h"
#include "harness.h"
#include "pool/pool_impl.h"

enum { N_POOLS = 3, INBOX_CAP = 64 };
static const size_t sizes[N_POOLS] = {128, 512, 256}; /* dict, call stub, frame */
static keel_pool_t *pools[N_POOLS];

typedef struct inbox {
  pthread_mutex_t mu;
  int n;
  void *obj[INBOX_CAP];
} inbox_t;

static inbox_t *inboxes;
static int n_threads;
static long n_iters;
static atomic_int workers_left;

static void stamp(void *o, size_t size, uint64_t s) {
  memcpy(o, &s, sizeof(s));
  memset((char *)o + 8, (int)(s * 0x9e3779b97f4a7c15u >> 56), size - 8);
}

static void check_stamp(const void *o, size_t size) {
  uint64_t s;
  memcpy(&s, o, sizeof(s));
  unsigned char b = (unsigned char)(s * 0x9e3779b97f4a7c15u >> 56);
  const unsigned char *c = (const unsigned char *)o + 8;
  for (size_t i = 0; i < size - 8; i++) {
    if (c[i] != b) {
      kt_fail(__FILE__, __LINE__, "object %p (stamp %llx) overwritten at byte %zu", o,
              (unsigned long long)s, i + 8);
      return;
    }
  }
}

/* Frees what others sent us; pool index lives in the stamp's top bits. */
static void drain(inbox_t *ib) {
  void *got[INBOX_CAP];
  pthread_mutex_lock(&ib->mu);
  int n = ib->n;
  memcpy(got, ib->obj, (size_t)n * sizeof(void *));
  ib->n = 0;
  pthread_mutex_unlock(&ib->mu);
  for (int i = 0; i < n; i++) {
    uint64_t s;
    memcpy(&s, got[i], sizeof(s));
    int k = (int)(s >> 62);
    check_stamp(got[i], sizes[k]);
    keel_pool_free(pools[k], got[i]);
  }
}

static bool send(inbox_t *ib, void *o) {
  pthread_mutex_lock(&ib->mu);
  bool ok = ib->n < INBOX_CAP;
  if (ok) ib->obj[ib->n++] = o;
  pthread_mutex_unlock(&ib->mu);
  return ok;
}

static void *worker(void *arg) {
  int me = (int)(intptr_t)arg;
  inbox_t *next = &inboxes[(me + 1) % n_threads];
  uint64_t seq = 0;
  for (long it = 0; it < n_iters; it++) {
    void *o[N_POOLS];
    for (int k = 0; k < N_POOLS; k++) {
      o[k] = (it & 7) == 3 ? keel_pool_zalloc(pools[k]) : keel_pool_alloc(pools[k]);
      if (o[k] == NULL) {
        kt_fail(__FILE__, __LINE__, "alloc failed");
        return NULL;
      }
      stamp(o[k], sizes[k], (uint64_t)k << 62 | (uint64_t)me << 40 | seq++);
    }
    if ((it & 63) == 0) sched_yield(); /* let a neighbour run while we own them */
    for (int k = 0; k < N_POOLS; k++) check_stamp(o[k], sizes[k]);
    keel_pool_free(pools[0], o[0]);
    keel_pool_free(pools[2], o[2]);
    if (!send(next, o[1])) keel_pool_free(pools[1], o[1]); /* the reply path */
    if ((it & 15) == 0) drain(&inboxes[me]);
  }
  drain(&inboxes[me]);
  atomic_fetch_sub(&workers_left, 1);
  return NULL;
}

static void cross_thread_with_sweeps(void) {
  n_threads = (int)kt_env_int("KEEL_TEST_THREADS", 16);
  n_iters = kt_scale(kt_env_int("KEEL_TEST_ITERS", 100000));
  _keel_option_set(KEEL_OPT_pool_sweep_s, 5);
  for (int k = 0; k < N_POOLS; k++)
    KT_REQUIRE((pools[k] = keel_pool_create("stress", sizes[k], 0, NULL)));
  _keel_pool_sweeper_kick();
  inboxes = calloc((size_t)n_threads, sizeof(*inboxes));
  for (int i = 0; i < n_threads; i++) pthread_mutex_init(&inboxes[i].mu, NULL);
  atomic_store(&workers_left, n_threads);
  pthread_t *t = calloc((size_t)n_threads, sizeof(*t));
  uint64_t passes0 = _keel_pool_sweeper_passes();
  for (int i = 0; i < n_threads; i++) pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
  /* The main thread competes with the sweeper for the same sub-pools. */
  size_t reclaimed = 0;
  int sweeps = 0;
  while (atomic_load(&workers_left) > 0) {
    reclaimed += keel_pool_reclaim(64 << 10);
    keel_pool_sweep(pools[sweeps++ % N_POOLS]);
    usleep(2000);
  }
  for (int i = 0; i < n_threads; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < n_threads; i++) drain(&inboxes[i]);
  printf("  %d threads x %ld iterations: %llu sweeper passes, %d explicit sweeps, %zu KiB "
         "reclaimed\n",
         n_threads, n_iters, (unsigned long long)(_keel_pool_sweeper_passes() - passes0), sweeps,
         reclaimed >> 10);
  for (int k = 0; k < N_POOLS; k++) {
    keel_pool_stats_t st;
    keel_pool_stats(pools[k], &st);
    KT_EQ(st.live, 0);
    KT_EQ(st.allocs, (uint64_t)n_threads * (uint64_t)n_iters);
    KT_EQ(st.frees, st.allocs);
    KT_EQ(st.allocs, st.hot_hits + st.cold_hits + st.heap_allocs);
    KT_CHECK(st.threads <= 1); /* the workers are gone; main may have drained an inbox */
    KT_CHECK(st.hot_hits > st.heap_allocs);
    KT_EQ(keel_pool_destroy(pools[k]), 0);
  }
  for (int i = 0; i < n_threads; i++) pthread_mutex_destroy(&inboxes[i].mu);
  free(inboxes);
  free(t);
  _keel_option_set(KEEL_OPT_pool_sweep_s, 10000);
}

/* The same with the fallback hand-off (no membarrier: owners exchange busy,
 * all four hand-off accesses seq_cst), as on kernels or sandboxes without
 * membarrier. Switched while no pool exists, so no fast path is running. */
static void cross_thread_fallback_fence(void) {
  KT_REQUIRE(_keel_pool_fence_heavy == 0); /* this kernel has membarrier */
  _keel_pool_fence_heavy = 1;
  cross_thread_with_sweeps();
  _keel_pool_fence_heavy = 0;
}

/* 1,000 threads, 50 at a time: each leaves objects cached at exit and hands
 * a few live ones back to main. */
enum { KEEP = 4 };
static void *short_lived(void *arg) {
  void **keep = arg;
  for (int k = 0; k < 2; k++) {
    void *o[10];
    for (int i = 0; i < 10; i++) o[i] = keel_pool_alloc(pools[k]);
    for (int i = 0; i < 10 - KEEP / 2; i++) keel_pool_free(pools[k], o[i]);
    for (int i = 0; i < KEEP / 2; i++) keep[k * (KEEP / 2) + i] = o[10 - KEEP / 2 + i];
  }
  return NULL;
}

/* LeakSanitizer cannot see keel's heap, which the pools draw from: the
 * heap's own count of live bytes is the leak check. */
static void thousand_threads(void) {
  enum { TOTAL = 1000, BATCH = 50 };
  _keel_option_set(KEEL_OPT_pool_sweep_s, 5);
  pools[0] = keel_pool_create("dict", 128, 0, NULL);
  pools[1] = keel_pool_create("frame", 256, 64, NULL);
  _keel_pool_sweeper_kick();
  /* main's own sub-pools, which the frees below make, counted in first */
  for (int k = 0; k < 2; k++) keel_pool_free(pools[k], keel_pool_alloc(pools[k]));
  keel_pool_reclaim(SIZE_MAX);
  size_t live0 = kt_heap_live_bytes();
  static void *kept[TOTAL][KEEP];
  for (int b = 0; b < TOTAL; b += BATCH) {
    pthread_t t[BATCH];
    for (int i = 0; i < BATCH; i++)
      KT_REQUIRE(pthread_create(&t[i], NULL, short_lived, kept[b + i]) == 0);
    for (int i = 0; i < BATCH; i++) pthread_join(t[i], NULL);
  }
  for (int k = 0; k < 2; k++) {
    keel_pool_stats_t st;
    keel_pool_stats(pools[k], &st);
    KT_EQ(st.threads, 1); /* main's */
    KT_EQ(st.live, TOTAL * KEEP / 2);
    KT_EQ(st.cached, 0); /* every exiting thread emptied its lists */
  }
  for (int i = 0; i < TOTAL; i++)
    for (int j = 0; j < KEEP; j++) keel_pool_free(pools[j / (KEEP / 2)], kept[i][j]);
  keel_pool_reclaim(SIZE_MAX); /* main's own cached objects */
  /* Every sub-pool and object of the 1,000 threads went back to the heap. */
  KT_EQ(kt_heap_live_bytes(), live0);
  for (int k = 0; k < 2; k++) {
    keel_pool_stats_t st;
    keel_pool_stats(pools[k], &st);
    KT_EQ(st.live, 0);
    KT_EQ(st.allocs, TOTAL * 10 + 1);
    KT_EQ(keel_pool_destroy(pools[k]), 0);
  }
  _keel_option_set(KEEL_OPT_pool_sweep_s, 10000);
}

#ifdef KEEL_POOL_INLINE
/* Debug and sanitizer builds pattern-fill every pool, which sends every call
 * to the library: clear that here so that TSan runs the inline fast paths of
 * keel/pool.h against the sweeper. */
__attribute__((constructor)) static void inline_paths_in_debug_builds(void) {
  _keel_pool_debug = 0;
}
#endif

KT_MAIN(KT_CASE(cross_thread_with_sweeps), KT_CASE(cross_thread_fallback_fence),
        KT_CASE(thousand_threads))
