/* Worker threads: take a batch, run it, fire due timers, spin briefly, park.
 *
 * A worker takes at most KEEL_SCHED_BATCH jobs per dispatch; its batch size
 * adapts (doubling while work is left behind, halving when it emptied the
 * queue), and a KEEL_JOB_BLOCKING job always ends a batch, so no job waits in
 * one worker's batch behind a declared sleeper. One that sleeps undeclared
 * holds the rest of its batch (at most KEEL_SCHED_BATCH - 1 jobs) until it
 * returns: handing them to another worker would let them start after later
 * jobs of their submitter (sched.h's start order). If work is left after its take
 * it wakes one parked sibling (the chain that spreads a burst one wake-up at
 * a time) or, with none parked, pokes the monitor, which may add a worker.
 *
 * Per job the worker writes only its own cache line (seq, current, nrun) and
 * the job's state: no clock read, no atomic RMW. The monitor tells a long
 * job from a stream of short ones by seeing the same odd seq twice.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>

#include "base/clock.h"
#include "base/options.h"
#include "sched/sched_int.h"

__thread sched_worker_t *_keel_sched_self;

static void count_run(sched_worker_t *w, unsigned p) {
  /* Only this thread writes nrun: a relaxed load+store, no locked add.
   * Readers (stats, pending) tolerate a value one behind. */
  keel_store_relaxed(&w->nrun[p], keel_load_relaxed(&w->nrun[p]) + 1);
}

static void run_one(sched_worker_t *w, keel_job_t *job) {
  keel_job_fn fn = job->fn;
  unsigned p = _keel_job_prio(job);
  if (keel_unlikely(job->flags & KEEL_JOB_BLOCKING)) {
    keel_store_relaxed(&w->blocking, 1);
    /* It may sleep with work waiting: let the monitor see it now. */
    if (_keel_sched_work_visible()) _keel_sched_poke();
  }
  keel_store_relaxed(&w->current, job);
  keel_store_relaxed(&w->cur_prio, p); /* for stats: published by the seq store */
  keel_store_release(&w->seq, keel_load_relaxed(&w->seq) + 1); /* odd: inside fn */
  /* Release: the worker's reads of the job happen before a resubmitter's
   * writes (its CAS from IDLE acquires this). From here the job is the
   * caller's; keel never touches it again. */
  _keel_job_set_state(job, JOB_IDLE);
  fn(job);
  keel_store_release(&w->seq, keel_load_relaxed(&w->seq) + 1);
  keel_store_relaxed(&w->current, NULL);
  keel_store_relaxed(&w->blocking, 0);
  count_run(w, p);
}

/* Runs every job taken, a shutdown begun since included: a job is TAKEN only
 * if it will run (what keel_sched_cancel's KEEL_EBUSY tells its caller).
 * False if a job forked and this is the child (fork.c cleared
 * _keel_sched_self): the rest of the batch is the parent's to run, and this
 * thread, no worker of the child's pool, ends the child (one TLS load per
 * job). */
static bool run_batch(sched_worker_t *w, unsigned n) {
  for (unsigned i = 0; i < n; i++) {
    run_one(w, w->batch[i]);
    if (keel_unlikely(_keel_sched_self != w)) return false;
  }
  /* Per-job time, from the end of the batch before when this one followed
   * it at once (no spin or park between): the take's chain-wake estimate.
   * No clock read beyond the one this always made. */
  uint64_t now = keel_clock_ns();
  if (w->streak) w->job_ns = (3 * w->job_ns + (now - w->busy_ns) / n) / 4;
  w->busy_ns = now;
  w->streak = true;
  return true;
}

/* Under sched.lock: a cancelling shutdown has begun (`how` is stored before
 * the state, under this lock). */
static bool __cancelling(void) {
  sched_t *s = &_keel_sched;
  return atomic_load(&s->state) == SCHED_STOPPING &&
         keel_load_relaxed(&s->how) == KEEL_SCHED_CANCEL;
}

/* One dispatch. Returns the jobs taken; *stuck if a half-linked enqueue
 * kept part of the queue out of reach (then yield rather than park). Once a
 * cancelling shutdown has begun it takes nothing: that shutdown collects
 * every queued job in its own thread (lifecycle.c). */
static unsigned take(sched_worker_t *w, bool *stuck) {
  sched_t *s = &_keel_sched;
  pthread_mutex_lock(&s->lock);
  if (keel_unlikely(__cancelling())) {
    pthread_mutex_unlock(&s->lock);
    *stuck = false;
    return 0;
  }
  unsigned max = w->fast_max;
  unsigned n = __keel_sched_dispatch(w->batch, max, stuck);
  bool more = keel_load_relaxed(&s->nlocal) > 0 || keel_load_relaxed(&s->staged);
  pthread_mutex_unlock(&s->lock);
  /* Batch size: doubles while work is left behind, halves when the worker
   * emptied the queue. A flood reaches KEEL_SCHED_BATCH in 5 dispatches; a
   * trickle of long jobs is taken one at a time, so a job rarely waits in
   * one worker's batch behind a long one while a sibling could run it (a
   * long job in a flood of short ones still holds the rest of its batch:
   * see the file comment). */
  if (more)
    w->fast_max = w->fast_max * 2 > KEEL_SCHED_BATCH ? KEEL_SCHED_BATCH : w->fast_max * 2;
  else if (w->fast_max > 1)
    w->fast_max /= 2;
  /* Chain wake: a worker that leaves work behind wakes a parked sibling
   * when that work would otherwise wait about a wake-up's cost (20-30 us in
   * a VM) or more: when the batch it took will run that long by its recent
   * per-job time, when its takes have left work behind for SCHED_CHAIN_NS,
   * or when it filled a batch of 8 or more (15 jobs taken and more left: a
   * flood). After a wake-up that was not a batch of 8+, it waits as long
   * again before the next. Short jobs are not worth a wake-up: waking at
   * every full batch from 2 on, as before, a burst of 8 empty jobs woke 3
   * workers (the first one took them in batches of 1, 2 and 4 and was done
   * in microseconds), the herd the producer side avoids by waking one per
   * burst; while bursts of 4 jobs of 500 us finished a third later without
   * the estimate (the sibling woke only after the first batch had run).
   * Waking only at full batches of 16 cost 10% at 256 producers. A take
   * that found nothing (a half-linked enqueue: the worker yields) wakes no
   * one: the sibling would get stuck too (the monitor also waits while
   * workers yield). A trickle
   * that one worker keeps up with costs no futex syscall on the path of the
   * jobs behind it (p99 at 8 paced producers: 127 us with a wake after
   * every take, vs the mutex pool's 77 us), since the monitor, ticking each
   * millisecond, wakes a parked worker for work left waiting. When it naps
   * (its next look up to block_ms/2 away) with a worker parked, the work
   * left behind would wait that long should this worker's job run long:
   * - MON_FULL (jobs were waiting on a pool that cannot grow): wake a
   *   parked sibling, the one the monitor would wake a tick later;
   * - MON_NAP (only timers of a worker inside a job keep it up): end the
   *   nap; the monitor then ticks through the busy period (scale.c), so
   *   this is once per quiet-to-busy change. Waking a sibling there cost one
   *   wake-up per such take for as long as the nap lasted: 3.1-3.2 per
   *   burst of 4, not 2.0 (review repro f_nap_wakes). */
  if (!more) {
    w->behind_ns = 0;
    return n;
  }
  uint32_t mode = keel_load_relaxed(&s->mon_mode);
  bool idle = atomic_load(&s->nidle) > 0, behind = (n >= 8 && n == max) || mode == MON_FULL;
  uint64_t now = 0;
  if (idle && !behind && n > 0) { /* a clock read only where it can decide a wake-up */
    now = keel_clock_ns();
    if (w->behind_ns == 0) w->behind_ns = now;
    behind = now - w->behind_ns >= SCHED_CHAIN_NS || w->job_ns * n >= SCHED_CHAIN_NS;
  }
  if (idle && behind) {
    _keel_sched_wake_one();
    w->behind_ns = now; /* 0 after a batch of 8+: the next partial take starts the wait */
  } else if (mode == MON_INF) {
    _keel_sched_poke();
  } else if (mode == MON_NAP && idle) {
    _keel_sched_unnap();
  }
  return n;
}

static bool spin_poll(uint64_t us) {
  uint64_t end = keel_clock_ns() + us * 1000u;
  do {
    for (int i = 0; i < 64; i++) {
      if (_keel_sched_work_visible()) return true;
      keel_cpu_relax();
    }
  } while (keel_clock_ns() < end);
  return false;
}

/* Polls for work for up to sched_spin_us (default 5) before parking: work
 * that comes back within that window costs the producer no futex wake-up.
 * Kept short: with more runnable threads than CPUs a spinning worker spends
 * its CFS share and is then preempted while jobs wait, where a parked one is
 * woken ahead of the producers (on the shared 2-core machine, 20 us of spin
 * gave p99 222/237/2637 us at 8/64/256 paced producers against 42/182/979
 * us without; no spin at all cost throughput at 1-2 producers, every
 * empty-to-non-empty submit paying a FUTEX_WAKE). At most one worker per two
 * CPUs spins at a time (Go's rule). */
static bool spin(void) {
  sched_t *s = &_keel_sched;
  int64_t us = _keel_option(KEEL_OPT_sched_spin_us);
  if (us <= 0 || atomic_load(&s->state) != SCHED_RUNNING) return false;
  int most = s->ncpu / 2 > 0 ? s->ncpu / 2 : 1;
  /* Relaxed: the count only limits spinning, it orders nothing. */
  if (keel_fetch_add_relaxed(&s->nspinning, 1) >= most) {
    keel_fetch_sub_relaxed(&s->nspinning, 1);
    return false;
  }
  bool found = spin_poll((uint64_t)us);
  keel_fetch_sub_relaxed(&s->nspinning, 1);
  return found;
}

static void *worker_main(void *arg) {
  sched_worker_t *w = arg;
  _keel_sched_self = w;
  w->busy_ns = keel_clock_ns();
  sched_t *s = &_keel_sched;
  bool yielding = false; /* counted in sched.nyielding */
  for (;;) {
    uint64_t due = atomic_load(&w->next_deadline);
    if (due != UINT64_MAX && due <= keel_clock_ns()) _keel_sched_timers_fire(w, keel_clock_ns());
    bool stuck;
    unsigned n = take(w, &stuck);
    if (yielding != (n == 0 && stuck)) {
      yielding = !yielding;
      keel_fetch_add_relaxed(&s->nyielding, yielding ? 1 : -1);
    }
    if (n > 0) {
      /* A worker that owns timers is going into jobs: should one run long,
       * the monitor fires them, so it must not be asleep for good. One load
       * per batch; the poke only from MON_INF (the monitor lingers
       * MON_LINGER_NS after activity, so a busy pool rarely pays it). Read
       * after take's sched.lock: a monitor that found this worker parked
       * under that lock (go_inf) had stored MON_INF before. */
      if (keel_unlikely(keel_load_relaxed(&w->next_deadline) != UINT64_MAX) &&
          keel_load_relaxed(&s->mon_mode) == MON_INF)
        _keel_sched_poke();
      if (keel_unlikely(!run_batch(w, n))) {
        _keel_sched_worker_free(w); /* the parent's, kept for the job (fork.c) */
        _keel_sched_forked_exit();
      }
      continue;
    }
    w->streak = false; /* whatever comes next, the next batch does not follow at once */
    if (stuck) {
      sched_yield(); /* let the preempted producer finish its enqueue */
      continue;
    }
    if (spin()) continue;
    if (!_keel_sched_park(w)) break;
  }
  _keel_sched_self = NULL;
  return NULL;
}

static sched_worker_t *worker_new(void) {
  sched_worker_t *w = calloc(1, sizeof(*w));
  if (w == NULL) return NULL;
  pthread_mutex_init(&w->tlock, NULL);
  atomic_init(&w->next_deadline, UINT64_MAX);
  w->fast_max = 1;
  return w;
}

void _keel_sched_worker_free(sched_worker_t *w) {
  pthread_mutex_destroy(&w->tlock);
  free(w->heap);
  free(w);
}

/* Whether a new worker may start; caller holds sched.lock. While starting
 * (init's spawns; the monitor, created last, grows only a RUNNING pool) and
 * running; while draining, only until nothing is pending: after the gate
 * closed, pending never grows again, and workers exit only once they see it
 * at 0 (under sched.lock), so a worker added here is on sched.workers before
 * shutdown's join loop can find that list empty, and none is added after. */
static bool __may_spawn(void) {
  sched_t *s = &_keel_sched;
  if (keel_load_relaxed(&s->nthreads) >= (int)s->cfg.max_threads) return false;
  int st = atomic_load(&s->state);
  if (st == SCHED_RUNNING || st == SCHED_STARTING) return true;
  if (st != SCHED_STOPPING || keel_load_relaxed(&s->how) != KEEL_SCHED_DRAIN) return false;
  return !atomic_load(&s->gate_closed) || _keel_sched_pending() > 0;
}

/* A worker whose thread could not be created, already off sched.workers,
 * may own timers (keel_sched_after picks owners from that list): they go to
 * a started worker, or, with none (or no memory), onto `out` to be cancelled
 * with notice once the caller releases sched.lock, which it holds. While
 * RUNNING a started worker always exists (STARTING arms no timer), so only
 * a failed hand-over (ENOMEM) gets here on the monitor's spawns. */
static void __orphan_timers(sched_worker_t *w, struct cds_list_head *out) {
  if (atomic_load(&w->next_deadline) == UINT64_MAX) return;
  sched_worker_t *h;
  cds_list_for_each_entry(h, &_keel_sched.workers, link) {
    if (h->started && __keel_sched_timers_hand_over(w, h) == 0) {
      _keel_sched_kick_worker(h);
      return;
    }
  }
  _keel_sched_timers_cancel_all(w, out);
}

int (*_keel_sched_create_hook)(void);

int _keel_sched_thread_create(pthread_t *t, void *(*fn)(void *), void *arg) {
  int (*hook)(void) = __atomic_load_n(&_keel_sched_create_hook, __ATOMIC_ACQUIRE);
  if (keel_unlikely(hook != NULL)) {
    int rc = hook();
    if (rc != 0) return rc;
  }
  return pthread_create(t, NULL, fn, arg);
}

/* Adds one worker unless the pool is at max, cancelling or drained. Called by
 * init and the monitor only (never by producers: thread creation is a slow
 * syscall). */
int _keel_sched_spawn(void) {
  sched_t *s = &_keel_sched;
  sched_worker_t *w = worker_new();
  if (w == NULL) return KEEL_ENOMEM;
  pthread_mutex_lock(&s->lock);
  if (!__may_spawn()) {
    pthread_mutex_unlock(&s->lock);
    _keel_sched_worker_free(w);
    return KEEL_EAGAIN;
  }
  keel_fetch_add_relaxed(&s->nthreads, 1);
  w->shard = (unsigned)(s->spawned++ % SCHED_SHARDS);
  cds_list_add_tail(&w->link, &s->workers);
  pthread_mutex_unlock(&s->lock);
  int rc = _keel_sched_thread_create(&w->thread, worker_main, w);
  CDS_LIST_HEAD(orphans);
  pthread_mutex_lock(&s->lock);
  if (rc == 0) {
    w->started = true; /* w->thread is set: a reaper may join it now */
  } else {
    cds_list_del(&w->link);
    keel_fetch_sub_relaxed(&s->nthreads, 1);
    s->spawned--;
    __orphan_timers(w, &orphans);
  }
  pthread_mutex_unlock(&s->lock);
  if (rc != 0) {
    /* An on_cancel may fork: in the child the rest are the parent's timers,
     * never notified there (review repro b_fork_orphans: the child ran the
     * parent's callbacks, then failed stop()'s pending == 0 assertion). */
    _keel_sched_notify_all(&orphans);
    _keel_sched_worker_free(w); /* in a child, its copy: on no list there */
  }
  return -rc;
}

/* Joins a worker that is on `list` and has exited or is exiting, folds its
 * counts into run_retired and frees it. The monitor reaps zombies and
 * shutdown live workers, each its own list, so no worker is joined twice
 * (shutdown reaps zombies only after it has stopped the monitor). */
static void reap(sched_worker_t *w, bool live) {
  sched_t *s = &_keel_sched;
  pthread_join(w->thread, NULL);
  pthread_mutex_lock(&s->lock);
  cds_list_del(&w->link);
  if (live) { /* a shutdown exit: zombies were counted when they retired */
    keel_fetch_sub_relaxed(&s->nthreads, 1);
    s->retired++;
  }
  for (int p = 0; p < PRIO_COUNT; p++) s->run_retired[p] += keel_load_relaxed(&w->nrun[p]);
  pthread_mutex_unlock(&s->lock);
  _keel_sched_worker_free(w);
}

/* The first worker on `list` that can be joined (its spawner has returned
 * from pthread_create: during a drain the monitor may still be spawning
 * while shutdown joins); *unstarted if the list holds others. */
static sched_worker_t *__first_started(struct cds_list_head *list, bool *unstarted) {
  sched_worker_t *w;
  *unstarted = false;
  cds_list_for_each_entry(w, list, link) {
    if (w->started) return w;
    *unstarted = true;
  }
  return NULL;
}

/* Reaps every worker on `list`; with `wait`, also those still being
 * started (they are about to be, or to be taken off on failure). */
static void reap_list(struct cds_list_head *list, bool live, bool wait) {
  sched_t *s = &_keel_sched;
  for (;;) {
    bool unstarted;
    pthread_mutex_lock(&s->lock);
    sched_worker_t *w = __first_started(list, &unstarted);
    pthread_mutex_unlock(&s->lock);
    if (w != NULL) {
      reap(w, live);
    } else if (unstarted && wait) {
      sched_yield(); /* the spawner is between its list add and the flag */
    } else {
      return;
    }
  }
}

void _keel_sched_join_zombies(void) {
  /* Its callers are the monitor, the only spawner after init, and shutdown
   * once the monitor has exited: no spawn is in flight, all are started. */
  reap_list(&_keel_sched.zombies, false, false);
}

/* Shutdown: every live worker exits once nothing is pending; join them (the
 * monitor may still add one meanwhile during a drain: the loop finds it). */
void _keel_sched_join_workers(void) {
  reap_list(&_keel_sched.workers, true, true);
}
