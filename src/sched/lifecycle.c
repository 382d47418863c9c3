/* The pool's life: init, shutdown, cancel, clients and statistics.
 *
 * States: UNINIT -> STARTING (init, explicit or lazy, creating its threads)
 * -> RUNNING -> STOPPING (shutdown started: submits fail) -> SHUTDOWN (every
 * worker joined) -> STARTING (a new init). STARTING accepts no job or timer:
 * a submit or keel_sched_after that sees it waits for the init on life_lock.
 * So an init that cannot create its threads has nothing to cancel, and goes
 * from STARTING straight back to the state it started from; a submit racing
 * it never sees STOPPING (KEEL_ESHUTDOWN, though nobody shut the pool down)
 * and then tries the lazy init itself. init and shutdown are serialised by
 * life_lock. Counters are never reset (a producer can be between its count
 * and its gate check at any time), so statistics count since the process
 * started.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/die.h"
#include "base/options.h"
#include "base/os.h"
#include "sched/sched_int.h"

/* The lists are valid (empty) before the first init too: fork.c's handlers
 * walk them from a thread's first submit on. */
sched_t _keel_sched = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .idle_lock = PTHREAD_MUTEX_INITIALIZER,
    .life_lock = PTHREAD_MUTEX_INITIALIZER,
    .workers = CDS_LIST_HEAD_INIT(_keel_sched.workers),
    .zombies = CDS_LIST_HEAD_INIT(_keel_sched.zombies),
    .idle = CDS_LIST_HEAD_INIT(_keel_sched.idle),
    .levels = {{.ring = CDS_LIST_HEAD_INIT(_keel_sched.levels[PRIO_HIGH].ring)},
               {.ring = CDS_LIST_HEAD_INIT(_keel_sched.levels[PRIO_NORMAL].ring)},
               {.ring = CDS_LIST_HEAD_INIT(_keel_sched.levels[PRIO_LOW].ring)}},
};

void keel_sched_config_default(keel_sched_config_t *cfg) {
  int64_t ncpu = _keel_os_ncpu();
  int64_t max = _keel_option(KEEL_OPT_sched_max_threads);
  if (max == 0) max = ncpu * 16 > 1024 ? 1024 : ncpu * 16;
  cfg->min_threads = (unsigned)_keel_option(KEEL_OPT_sched_min_threads);
  cfg->max_threads = (unsigned)max;
  if (cfg->max_threads < cfg->min_threads) cfg->max_threads = cfg->min_threads;
  cfg->idle_ms = (unsigned)_keel_option(KEEL_OPT_sched_idle_ms);
  cfg->block_ms = (unsigned)_keel_option(KEEL_OPT_sched_block_ms);
}

static void client_init(struct keel_sched_client *c) {
  for (int p = 0; p < PRIO_COUNT; p++) {
    CDS_INIT_LIST_HEAD(&c->q[p]);
    CDS_INIT_LIST_HEAD(&c->ring[p]);
    c->n[p] = c->used[p] = 0;
    c->in_ring[p] = false;
  }
  atomic_init(&c->ntimers, 0);
}

/* Resets the queues, levels, worker lists and the counts that go with
 * them; no worker exists and no job is queued (or, in a fork child, those
 * that were are the parent's). Caller holds sched.lock: keel_sched_stats,
 * keel_sched_cancel and keel_sched_client_destroy read this state under it
 * at any time, also while an init after a shutdown runs (review, helper-84:
 * TSan reported those races). No system call: fork.c's child handler uses
 * it too. */
void _keel_sched_reset_queues(void) {
  sched_t *s = &_keel_sched;
  for (int i = 0; i < SCHED_SHARDS; i++) __cds_wfcq_init(&s->in[i].head, &s->in[i].tail);
  for (int i = 0; i < SCHED_SHARDS; i++) {
    __cds_wfcq_init(&s->in[i].head2, &s->in[i].tail2);
    __cds_wfcq_init(&s->stage[i].head, &s->stage[i].tail);
    __cds_wfcq_init(&s->stage2[i].head, &s->stage2[i].tail);
  }
  s->stage_next = 0;
  s->stage_mask = s->stage2_mask = 0;
  for (int p = 0; p < PRIO_COUNT; p++) {
    CDS_INIT_LIST_HEAD(&s->levels[p].ring);
    s->levels[p].n = 0;
  }
  client_init(&_keel_sched_default_client);
  s->since_low = s->since_normal = 0;
  atomic_store(&s->nlocal, 0);
  atomic_store(&s->staged, 0);
  atomic_store(&s->gate_closed, 0);
  CDS_INIT_LIST_HEAD(&s->workers);
  CDS_INIT_LIST_HEAD(&s->zombies);
  CDS_INIT_LIST_HEAD(&s->idle);
  atomic_store(&s->nthreads, 0);
  atomic_store(&s->nidle, 0);
  atomic_store(&s->waking, 0);
  atomic_store(&s->nyielding, 0);
  s->mon_saw_work = false;
  s->mon_busy_ns = 0;
}

static void reset(const keel_sched_config_t *cfg) {
  sched_t *s = &_keel_sched;
  int ncpu = _keel_os_ncpu(); /* reads /proc and sysfs: not under the lock */
  pthread_mutex_lock(&s->lock);
  _keel_sched_reset_queues();
  s->cfg = *cfg;
  s->ncpu = ncpu;
  pthread_mutex_unlock(&s->lock);
}

/* Set while this thread holds life_lock (init, lazy or not, and shutdown):
 * an on_cancel callback that a shutdown runs, or a call from the init
 * thread while it creates threads (a test's creation hook), would otherwise
 * wait on life_lock, which its own thread holds. */
static __thread bool in_life;

/* Whether init or shutdown on this thread would wait for itself: a worker,
 * an init or shutdown in progress here, or the monitor (which stop()
 * joins), e.g. from the on_cancel of a timer it could not hand over
 * (review, helper-84: that shutdown hung for ever, the monitor's remaining
 * orphans never notified). */
static bool on_pool_thread(void) {
  return _keel_sched_self != NULL || in_life || _keel_sched_on_monitor;
}

/* Undoes a start whose threads could not all be created; caller holds
 * life_lock. The state goes back to what init found (UNINIT: the next
 * submit, after or stats tries the lazy init again; SHUTDOWN: submits keep
 * failing, as they did before this init) before the workers are told to
 * exit: a worker that sees either state while alive leaves (park.c). No
 * STOPPING is published, no gate closed and nothing cancelled: STARTING
 * accepted nothing. The monitor, created last, does not exist here. */
static void unstart(int st) {
  atomic_store(&_keel_sched.state, st);
  _keel_sched_wake_all(); /* after the store: see _keel_sched_park */
  _keel_sched_join_workers();
}

/* Starts the pool; caller holds life_lock. A failure leaves the state as it
 * found it (unstart): a thread that could not be created is no shutdown. */
static int init_locked(const keel_sched_config_t *user) {
  sched_t *s = &_keel_sched;
  int st = atomic_load(&s->state);
  if (st == SCHED_RUNNING || st == SCHED_STOPPING) return KEEL_EBUSY;
  keel_sched_config_t cfg;
  if (user == NULL)
    keel_sched_config_default(&cfg);
  else
    cfg = *user;
  /* The bound keeps thread counts within the int the pool counts them in. */
  if (cfg.max_threads == 0 || cfg.min_threads == 0 || cfg.min_threads > cfg.max_threads ||
      cfg.max_threads > KEEL_SCHED_THREADS_MAX || cfg.idle_ms == 0 || cfg.block_ms == 0)
    return KEEL_REJECT(KEEL_EINVAL, "keel_sched_init",
                       "min_threads %u, max_threads %u, idle_ms %u, block_ms %u: need 1 <= min <= "
                       "max <= %u and nonzero times",
                       cfg.min_threads, cfg.max_threads, cfg.idle_ms, cfg.block_ms,
                       KEEL_SCHED_THREADS_MAX);
  reset(&cfg);
  _keel_sched_gate_init();
  atomic_store(&s->state, SCHED_STARTING);
  int rc = 0;
  for (unsigned i = 0; i < cfg.min_threads && rc == 0; i++) rc = _keel_sched_spawn();
  if (rc == 0) rc = _keel_sched_monitor_start();
  if (rc != 0) {
    unstart(st);
    return rc;
  }
  /* Every worker is listed and started: RUNNING implies a timer owner for
   * keel_sched_after (retiring keeps min started). */
  atomic_store(&s->state, SCHED_RUNNING);
  return 0;
}

int keel_sched_init(const keel_sched_config_t *cfg) {
  _keel_sched_atfork_once(); /* before life_lock: see fork.c */
  if (on_pool_thread()) return KEEL_EDEADLK;
  pthread_mutex_lock(&_keel_sched.life_lock);
  in_life = true;
  int rc = init_locked(cfg);
  in_life = false;
  pthread_mutex_unlock(&_keel_sched.life_lock);
  return rc;
}

/* Starts the pool, or waits for an init in progress (STARTING), on first
 * use. Under life_lock the state is never STARTING or STOPPING: those last
 * only while another thread holds it. */
int _keel_sched_lazy_init(void) {
  sched_t *s = &_keel_sched;
  if (in_life) return KEEL_EDEADLK;
  _keel_sched_atfork_once(); /* done by every entry point; once more costs a load */
  pthread_mutex_lock(&s->life_lock);
  in_life = true;
  int st = atomic_load(&s->state);
  /* A fork child's pool starts with its parent's configuration. */
  const keel_sched_config_t *cfg = s->cfg_inherited ? &s->cfg : NULL;
  int rc = st == SCHED_UNINIT ? init_locked(cfg) : (st == SCHED_RUNNING ? 0 : KEEL_ESHUTDOWN);
  in_life = false;
  pthread_mutex_unlock(&s->life_lock);
  return rc;
}

bool _keel_sched_in_life(void) {
  return in_life;
}

/* submitted - run - cancelled. Exact once the gate is closed (submitted is
 * then final and `done` can only lag); the caller holds sched.lock. */
int64_t _keel_sched_pending(void) {
  sched_t *s = &_keel_sched;
  int64_t done = 0;
  for (int p = 0; p < PRIO_COUNT; p++)
    done += atomic_load(&s->cancelled[p]) + (int64_t)s->run_retired[p];
  sched_worker_t *w;
  cds_list_for_each_entry(w, &s->workers, link) for (int p = 0; p < PRIO_COUNT; p++) done +=
      (int64_t)atomic_load(&w->nrun[p]);
  cds_list_for_each_entry(w, &s->zombies, link) for (int p = 0; p < PRIO_COUNT; p++) done +=
      (int64_t)atomic_load(&w->nrun[p]);
  return _keel_sched_submitted(NULL) - done;
}

/* Hands a CANCELLING job back: counted, then IDLE (release: the last keel
 * access to it), then on_cancel. */
void _keel_sched_notify_cancel(keel_job_t *job) {
  keel_job_fn cb = job->on_cancel;
  atomic_fetch_add(&_keel_sched.cancelled[_keel_job_prio(job)], 1);
  _keel_job_set_state(job, JOB_IDLE);
  if (cb != NULL) cb(job);
}

/* Notifies every job on `list` (CANCELLING, linked through _l), in order.
 * Stops if this thread forks from an on_cancel: in the child, the rest of
 * `list` are the parent's jobs (fork.c). */
void _keel_sched_notify_all(struct cds_list_head *list) {
  unsigned gen = _keel_sched.fork_gen;
  while (!cds_list_empty(list) && _keel_sched.fork_gen == gen) {
    struct cds_list_head *l = list->next;
    cds_list_del(l);
    keel_job_t *job = _keel_link_job(l);
    _keel_sched_notify_cancel(job);
  }
}

/* Takes every queued job as CANCELLING onto `out`, for a cancelling
 * shutdown once its gate has closed. Only its thread does this (workers take
 * nothing while it cancels, see take()), so every on_cancel and each
 * KEEL_JOB_RUN_IF_CANCELLED fn runs there, as sched.h says. No enqueue is
 * half done by then (submits finish inside the gate; a timer fires under its
 * tlock, and collect_timers emptied every heap), so nothing can stay out of
 * reach; were a node still half-linked, this would wait for it, not drop it. */
static void collect_queued(struct cds_list_head *out) {
  sched_t *s = &_keel_sched;
  keel_job_t *batch[KEEL_SCHED_BATCH];
  pthread_mutex_lock(&s->lock);
  for (;;) {
    bool stuck;
    unsigned n = __keel_sched_dispatch(batch, KEEL_SCHED_BATCH, &stuck);
    for (unsigned i = 0; i < n; i++) {
      _keel_job_set_state(batch[i], JOB_CANCELLING); /* a cancel now says ENOENT, not EBUSY */
      cds_list_add_tail(_keel_job_link(batch[i]), out);
    }
    if (n > 0) continue;
    if (!stuck) break;
    pthread_mutex_unlock(&s->lock);
    sched_yield();
    pthread_mutex_lock(&s->lock);
  }
  pthread_mutex_unlock(&s->lock);
}

/* Under sched.lock: moves every timer onto `out` (CANCELLING). */
static void collect_timers(struct cds_list_head *out) {
  sched_worker_t *w;
  cds_list_for_each_entry(w, &_keel_sched.workers, link) _keel_sched_timers_cancel_all(w, out);
}

static void stop(int how) {
  sched_t *s = &_keel_sched;
  CDS_LIST_HEAD(notices);
  keel_store_relaxed(&s->how, how);
  pthread_mutex_lock(&s->lock);
  atomic_store(&s->state, SCHED_STOPPING);
  collect_timers(&notices);
  pthread_mutex_unlock(&s->lock);
  _keel_sched_gate_close();         /* no submit is half done after this */
  atomic_store(&s->gate_closed, 1); /* release: the counts are final */
  if (how == KEEL_SCHED_CANCEL) collect_queued(&notices);
  _keel_sched_notify_all(&notices); /* outside the lock: callbacks may call keel */
  /* A drain keeps the monitor, which grows the pool while queued jobs wait
   * behind blocked workers (it may sleep with work waiting: poke it). */
  if (how == KEEL_SCHED_CANCEL)
    _keel_sched_monitor_stop();
  else
    _keel_sched_poke();
  _keel_sched_wake_all();
  _keel_sched_join_workers(); /* each exits once nothing is pending */
  _keel_sched_monitor_stop();
  _keel_sched_join_zombies();
  pthread_mutex_lock(&s->lock);
  KEEL_ASSERT(_keel_sched_pending() == 0);
  pthread_mutex_unlock(&s->lock);
  atomic_store(&s->state, SCHED_SHUTDOWN);
}

int keel_sched_shutdown(int how) {
  if (how != KEEL_SCHED_DRAIN && how != KEEL_SCHED_CANCEL)
    return KEEL_REJECT(KEEL_EINVAL, "keel_sched_shutdown", "unknown how %d", how);
  if (on_pool_thread()) return KEEL_EDEADLK;
  _keel_sched_atfork_once();
  sched_t *s = &_keel_sched;
  pthread_mutex_lock(&s->life_lock);
  in_life = true;
  int st = atomic_load(&s->state);
  if (st == SCHED_UNINIT)
    atomic_store(&s->state, SCHED_SHUTDOWN);
  else if (st == SCHED_RUNNING)
    stop(how);
  in_life = false;
  pthread_mutex_unlock(&s->life_lock);
  return 0;
}

static bool is_running(keel_job_t *job) {
  sched_worker_t *w;
  cds_list_for_each_entry(w, &_keel_sched.workers,
                          link) if (keel_load_relaxed(&w->current) == job) return true;
  return false;
}

/* Under sched.lock. Returns 0 when the job is now IDLE (notify it), a
 * KEEL_E* code, or 1 to look again after a yield. */
static int cancel_locked(keel_job_t *job) {
  unsigned st = _keel_job_state(job);
  if (st == JOB_QUEUED) {
    __keel_sched_flatten(); /* it may still be behind a half-linked enqueue */
    st = _keel_job_state(job);
    if (st == JOB_QUEUED) return 1;
  }
  switch (st) {
    case JOB_LOCAL:
      __keel_sched_unlink(job);
      _keel_job_set_state(job, JOB_CANCELLING);
      return 0;
    case JOB_TIMER:
      return _keel_sched_timer_cancel(job) == 0 ? 0 : 1;
    case JOB_TAKEN: /* only workers take (it will run) */
      return KEEL_EBUSY;
    case JOB_CANCELLING: /* another cancel, or a shutdown, delivers its notice */
      return KEEL_ENOENT;
    default:
      return is_running(job) ? KEEL_EBUSY : KEEL_ENOENT;
  }
}

int keel_sched_cancel(keel_job_t *job) {
  if (job == NULL) return KEEL_REJECT(KEEL_EINVAL, "keel_sched_cancel", "job is NULL");
  _keel_sched_atfork_once(); /* before sched.lock, even on a pool never started */
  sched_t *s = &_keel_sched;
  for (;;) {
    pthread_mutex_lock(&s->lock);
    int rc = atomic_load(&s->state) == SCHED_UNINIT ? KEEL_ENOENT : cancel_locked(job);
    pthread_mutex_unlock(&s->lock);
    if (rc == 0) _keel_sched_notify_cancel(job);
    if (rc != 1) return rc;
    sched_yield();
  }
}

keel_sched_client_t *keel_sched_client_create(void) {
  struct keel_sched_client *c = malloc(sizeof(*c));
  if (c == NULL) {
    errno = ENOMEM;
    return NULL;
  }
  client_init(c);
  return c;
}

int keel_sched_client_destroy(keel_sched_client_t *c) {
  if (c == NULL) return KEEL_REJECT(KEEL_EINVAL, "keel_sched_client_destroy", "client is NULL");
  _keel_sched_atfork_once();
  sched_t *s = &_keel_sched;
  int busy = 0;
  pthread_mutex_lock(&s->lock);
  if (atomic_load(&s->state) != SCHED_UNINIT) {
    /* Its timers. One that fired stays counted here until a flatten or a
     * dispatch sorts it onto c's lists (place(), under this lock), so it
     * is counted in ntimers or in n[] below, never in neither. */
    busy = keel_load_relaxed(&c->ntimers) != 0;
    while (__keel_sched_flatten()) { /* its jobs may sit in staging */
      pthread_mutex_unlock(&s->lock);
      sched_yield();
      pthread_mutex_lock(&s->lock);
    }
    for (int p = 0; p < PRIO_COUNT; p++) busy |= c->n[p] != 0;
  }
  pthread_mutex_unlock(&s->lock);
  if (busy) return KEEL_EBUSY;
  free(c);
  return 0;
}

/* Adds list's workers to *st; running and timers also by priority. */
static void stats_workers(keel_sched_stats_t *st, struct cds_list_head *list,
                          uint64_t running[PRIO_COUNT], uint64_t timers[PRIO_COUNT]) {
  sched_worker_t *w;
  cds_list_for_each_entry(w, list, link) {
    for (int p = 0; p < PRIO_COUNT; p++) st->run_prio[p] += atomic_load(&w->nrun[p]);
    if (keel_load_acquire(&w->seq) & 1) {
      st->running++;
      running[keel_load_relaxed(&w->cur_prio)]++; /* may be the next job's: a snapshot */
    }
    pthread_mutex_lock(&w->tlock);
    st->timers += w->nheap;
    for (int p = 0; p < PRIO_COUNT; p++) timers[p] += w->ntimer[p];
    pthread_mutex_unlock(&w->tlock);
  }
}

/* queued_prio is derived like queued (submitted - run - cancelled - running
 * - timers, per priority), so it covers every place a job can wait, the fast
 * lane and the unsorted staging queues included, at no cost to submit. */
int keel_sched_stats(keel_sched_stats_t *st) {
  if (st == NULL) return KEEL_REJECT(KEEL_EINVAL, "keel_sched_stats", "stats is NULL");
  _keel_sched_atfork_once();
  sched_t *s = &_keel_sched;
  if (atomic_load(&s->state) == SCHED_UNINIT) {
    int rc = _keel_sched_lazy_init();
    if (rc != 0 && rc != KEEL_EBUSY) return rc;
  }
  *st = (keel_sched_stats_t){0};
  uint64_t running[PRIO_COUNT] = {0}, timers[PRIO_COUNT] = {0};
  int64_t sub[PRIO_COUNT], cancelled[PRIO_COUNT];
  pthread_mutex_lock(&s->lock);
  for (int p = 0; p < PRIO_COUNT; p++) st->run_prio[p] = s->run_retired[p];
  stats_workers(st, &s->workers, running, timers);
  stats_workers(st, &s->zombies, running, timers);
  /* After the runs: a job counted run here was counted submitted below. */
  for (int p = 0; p < PRIO_COUNT; p++) {
    cancelled[p] = atomic_load(&s->cancelled[p]);
    st->cancelled += (uint64_t)cancelled[p];
  }
  int64_t total = _keel_sched_submitted(sub);
  st->threads = (unsigned)keel_load_relaxed(&s->nthreads);
  st->spawned = s->spawned;
  st->retired = s->retired;
  pthread_mutex_unlock(&s->lock);
  st->idle = (unsigned)atomic_load(&s->nidle);
  pthread_mutex_lock(&s->idle_lock);
  st->wakeups = s->wakeups;
  pthread_mutex_unlock(&s->idle_lock);
  st->submitted = (uint64_t)total;
  st->run = st->run_prio[0] + st->run_prio[1] + st->run_prio[2];
  int64_t q = total - (int64_t)(st->run + st->cancelled + st->running + st->timers);
  st->queued = q > 0 ? (uint64_t)q : 0;
  for (int p = 0; p < PRIO_COUNT; p++) {
    q = sub[p] - cancelled[p] - (int64_t)(st->run_prio[p] + running[p] + timers[p]);
    st->queued_prio[p] = q > 0 ? (uint64_t)q : 0;
  }
  return 0;
}
