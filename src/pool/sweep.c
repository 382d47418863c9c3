/* The sweeper: one thread for the process, started with the first pool and
 * stopped when the last one is destroyed (and at exit), which every
 * pool_sweep_s frees each sub-pool's cold list and turns its hot list cold.
 * An object freed at time t is thus back in the heap by t + 2 periods unless
 * reused, and a pool in steady use with a cycle shorter than the period
 * never calls the heap.
 *
 * A pass (sweep, reclaim) runs under the registry lock in three steps: post
 * the request on every sub-pool, one membarrier, then carry it out on every
 * sub-pool whose owner is not inside a fast path; a busy owner finds the
 * request on its next call and carries it out itself. The busy ones are
 * retried a few times after a yield, so an idle process empties completely
 * within the pass. Cost: two walks of the sub-pool lists, one system call,
 * and the frees; owners are never blocked except on a sub-pool lock the pass
 * holds for a few list-pointer moves.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "base/die.h"
#include "base/options.h"
#include "pool_impl.h"

/* Bytes a sweeper pass must free before it asks the heap to return free
 * memory to the OS at once (one purge walk per period at most). */
#define POOL_COLLECT_MIN ((size_t)256 << 10)

/* Passes over busy sub-pools before leaving the rest to their owners. */
#define POOL_BUSY_RETRIES 4

static pthread_mutex_t sweeper_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sweeper_cv;
static pthread_once_t sweeper_cv_once = PTHREAD_ONCE_INIT;
static keel_atomic(int) sweeper_running; /* read unlocked by the alloc slow path */
static pthread_t sweeper_tid;
static uint64_t sweeper_gen; /* bumped to stop the current thread */
static bool sweeper_kicked;
static keel_atomic(uint64_t) sweeper_passes;
static keel_atomic(int) sweeper_exiting; /* set by the exit destructor: no restart */
keel_atomic(int) _keel_pool_sweeper_manual;

static bool sweeper_cv_ready; /* sweeper_cv_once has run */

static void sweeper_cv_init(void) {
  sweeper_cv_ready = true;
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&sweeper_cv, &a);
  pthread_condattr_destroy(&a);
}

/* Posts req on every sub-pool of p. Caller holds the registry lock. */
static void __pool_post(keel_pool_t *p, uint32_t req) {
  pthread_mutex_lock(&p->lock);
  pool_sub_t *sp;
  pool_for_each_sub(sp, p) {
    pthread_mutex_lock(&sp->lock);
    uint32_t before = keel_load_relaxed(&sp->f.req);
    sp->req_before = before;
    /* A sweep still pending from the last period (its owner was mid-call
     * then and has not called since) and this one are two sweeps: the hot
     * list's objects have now sat a whole period too, so both lists go.
     * Merged into one, they stayed cached a third period. */
    uint32_t want = before == POOL_REQ_SWEEP && req == POOL_REQ_SWEEP ? POOL_REQ_DRAIN : req;
    /* seq_cst: the fallback mode's half of the Dekker (see keel_pool_inline_req). */
    if (before < want) atomic_store_explicit(&sp->f.req, want, memory_order_seq_cst);
    pthread_mutex_unlock(&sp->lock);
  }
  pthread_mutex_unlock(&p->lock);
}

/* Carries out the posted requests of p's idle sub-pools; counts the busy
 * ones in *busy. Once `goal` bytes are freed, withdraws the rest. */
static size_t __pool_reap(keel_pool_t *p, size_t goal, size_t done, size_t *busy) {
  pool_hdr_t *lists = NULL;
  size_t n = 0;
  pthread_mutex_lock(&p->lock);
  pool_sub_t *sp;
  pool_for_each_sub(sp, p) {
    pthread_mutex_lock(&sp->lock);
    uint32_t req = keel_load_relaxed(&sp->f.req);
    if (req == POOL_REQ_NONE) {
      /* the owner did it */
    } else if (done + n * p->block_size >= goal) {
      /* Enough: withdraw this pass's request, keeping one an earlier pass
       * left for a busy owner. Nothing moved: no order needed. */
      keel_store_relaxed(&sp->f.req, sp->req_before);
    } else if (atomic_load_explicit(&sp->f.busy, memory_order_seq_cst) == 0) {
      /* Reads the owner's release in keel_pool_inline_leave, so its last list writes
       * are visible. After the barrier, any later call of the owner sees
       * req != NONE and waits for sp->lock, which is held here. */
      size_t k;
      pool_hdr_t *l = __keel_pool_sub_service(sp, req, &k);
      while (l != NULL) {
        pool_hdr_t *next = l->next;
        l->next = lists;
        lists = l;
        l = next;
      }
      n += k;
    } else {
      (*busy)++;
    }
    pthread_mutex_unlock(&sp->lock);
  }
  pthread_mutex_unlock(&p->lock);
  if (lists != NULL) _keel_pool_release_list(p, lists, n, "keel_pool_sweep");
  return n * p->block_size;
}

size_t __keel_pool_sweep_pass(keel_pool_t *only, uint32_t req, size_t goal) {
  keel_pool_t *p;
  if (only != NULL) {
    __pool_post(only, req);
  } else {
    pool_for_each_live(p) __pool_post(p, req);
  }
  _keel_pool_handoff_barrier();
  size_t freed = 0;
  for (int attempt = 0; attempt <= POOL_BUSY_RETRIES; attempt++) {
    size_t busy = 0;
    if (only != NULL) {
      freed += __pool_reap(only, goal, freed, &busy);
    } else {
      pool_for_each_live(p) freed += __pool_reap(p, goal, freed, &busy);
    }
    if (busy == 0 || freed >= goal) break;
    sched_yield(); /* a busy owner is mid-call: a few instructions from done */
  }
  if (req == POOL_REQ_SWEEP) {
    if (only != NULL) {
      keel_fetch_add_relaxed(&only->sweeps, 1);
    } else {
      pool_for_each_live(p) keel_fetch_add_relaxed(&p->sweeps, 1);
    }
  }
  return freed;
}

int keel_pool_sweep(keel_pool_t *p) {
  _keel_pool_check_live(p, "keel_pool_sweep");
  _keel_pool_registry_lock();
  __keel_pool_sweep_pass(p, POOL_REQ_SWEEP, SIZE_MAX);
  _keel_pool_registry_unlock();
  return 0;
}

size_t keel_pool_reclaim(size_t bytes) {
  size_t freed = 0;
  _keel_pool_registry_lock();
  if (!cds_list_empty(&_keel_pool_live)) {
    freed = __keel_pool_sweep_pass(NULL, POOL_REQ_TRIM, bytes);
    if (freed < bytes) freed += __keel_pool_sweep_pass(NULL, POOL_REQ_DRAIN, bytes - freed);
  }
  _keel_pool_registry_unlock();
  /* A memory-pressure caller wants the memory out of the process, not in
   * the heap's free pages for heap_purge_ms: hand it to the OS now, as the
   * sweeper does after a pass. */
  if (freed >= POOL_COLLECT_MIN) keel_heap_collect(true);
  return freed;
}

static uint64_t sweeper_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* One pass over every pool, then the OS hand-back. */
static void sweeper_pass(void) {
  _keel_pool_registry_lock();
  size_t freed = __keel_pool_sweep_pass(NULL, POOL_REQ_SWEEP, SIZE_MAX);
  _keel_pool_registry_unlock();
  /* What a pass frees has already sat unused for a whole period, so it is
   * handed to the OS now instead of aging again for heap_purge_ms: that is
   * what makes "idle: back to zero after two periods" hold for RSS, not
   * only for cached bytes. At most once a period, and only after a pass
   * that freed something worth the walk. */
  if (freed >= POOL_COLLECT_MIN) keel_heap_collect(true);
  keel_fetch_add_relaxed(&sweeper_passes, 1);
}

/* Passes run at a fixed rate (deadline += period), not a period after the
 * previous pass ended, so pass durations do not accumulate: an object
 * cached at time t is back in the heap by t + 2 periods + one pass. */
static void *sweeper_main(void *arg) {
  uint64_t my_gen = (uint64_t)(uintptr_t)arg;
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals are for the application's threads */
  pthread_mutex_lock(&sweeper_mu);
  uint64_t next = sweeper_now_ms() + (uint64_t)_keel_option(KEEL_OPT_pool_sweep_s);
  while (sweeper_gen == my_gen) {
    struct timespec ts = {(time_t)(next / 1000), (long)(next % 1000) * 1000000L};
    int rc = 0;
    while (sweeper_gen == my_gen && !sweeper_kicked && rc != ETIMEDOUT)
      rc = pthread_cond_timedwait(&sweeper_cv, &sweeper_mu, &ts);
    if (sweeper_gen != my_gen) break;
    uint64_t period = (uint64_t)_keel_option(KEEL_OPT_pool_sweep_s);
    if (sweeper_kicked) { /* a kick restarts the period with its new length */
      sweeper_kicked = false;
      next = sweeper_now_ms() + period;
      continue;
    }
    pthread_mutex_unlock(&sweeper_mu);
    sweeper_pass();
    uint64_t now = sweeper_now_ms();
    next += period;
    if (next <= now) next = now + period; /* a pass longer than a period: skip, do not bunch */
    pthread_mutex_lock(&sweeper_mu);
  }
  pthread_mutex_unlock(&sweeper_mu);
  return NULL;
}

void _keel_pool_sweeper_ensure(void) {
  /* Relaxed: the flags are re-read under sweeper_mu before acting. */
  if (keel_likely(keel_load_relaxed(&sweeper_running)) || keel_load_relaxed(&sweeper_exiting) ||
      keel_load_relaxed(&_keel_pool_sweeper_manual))
    return;
  pthread_once(&sweeper_cv_once, sweeper_cv_init);
  pthread_mutex_lock(&sweeper_mu);
  if (!keel_load_relaxed(&sweeper_running) && !keel_load_relaxed(&sweeper_exiting)) {
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 64 << 10); /* a loop and a few frames */
    uint64_t gen = ++sweeper_gen;
    if (pthread_create(&sweeper_tid, &a, sweeper_main, (void *)(uintptr_t)gen) == 0) {
      pthread_setname_np(sweeper_tid, "keel-pool-sweep");
      keel_store_relaxed(&sweeper_running, 1);
    } else {
      _keel_warn("keel_pool: cannot start the sweeper thread; pools are swept only on demand");
    }
    pthread_attr_destroy(&a);
  }
  pthread_mutex_unlock(&sweeper_mu);
}

bool _keel_pool_sweeper_stop_begin(pthread_t *tid) {
  pthread_mutex_lock(&sweeper_mu);
  bool was = keel_load_relaxed(&sweeper_running);
  if (was) {
    *tid = sweeper_tid;
    sweeper_gen++;
    keel_store_relaxed(&sweeper_running, 0);
    pthread_cond_broadcast(&sweeper_cv);
  }
  pthread_mutex_unlock(&sweeper_mu);
  return was;
}

void _keel_pool_sweeper_kick(void) {
  pthread_mutex_lock(&sweeper_mu);
  sweeper_kicked = true;
  pthread_cond_broadcast(&sweeper_cv);
  pthread_mutex_unlock(&sweeper_mu);
}

uint64_t _keel_pool_sweeper_passes(void) {
  return keel_load_relaxed(&sweeper_passes);
}

void _keel_pool_sweeper_atfork_prepare(void) {
  pthread_mutex_lock(&sweeper_mu);
}

void _keel_pool_sweeper_atfork_parent(void) {
  pthread_mutex_unlock(&sweeper_mu);
}

void _keel_pool_sweeper_atfork_child(void) {
  /* The sweeper thread did not come along; the next heap call restarts it.
   * Its wait on sweeper_cv did not either, but the copy still counts it
   * as a waiter: glibc's broadcast (each stop of a sweeper is one) then
   * waits for it for ever, so a child that destroyed its last pool and
   * made another, or one that just exited after a restart, hung. A fresh
   * condition variable has no waiters. */
  if (sweeper_cv_ready) {
    memset(&sweeper_cv, 0, sizeof(sweeper_cv));
    sweeper_cv_init();
  }
  sweeper_gen++;
  sweeper_kicked = false;
  keel_store_relaxed(&sweeper_running, 0);
  pthread_mutex_unlock(&sweeper_mu);
}

/* At exit: no thread of keel's outlives the program's own teardown. */
__attribute__((destructor)) static void pool_sweeper_fini(void) {
  pthread_t tid;
  pthread_mutex_lock(&sweeper_mu);
  keel_store_relaxed(&sweeper_exiting, 1);
  pthread_mutex_unlock(&sweeper_mu);
  if (_keel_pool_sweeper_stop_begin(&tid)) pthread_join(tid, NULL);
}
