/* The monitor: the one thread that grows the pool (and reaps retired workers).
 *
 * Growth rule, checked at most once per SPAWN_INTERVAL_NS while jobs wait
 * and no worker is parked: add one worker if below max_threads and the
 * workers not blocked number fewer than max(CPUs, min_threads). A worker is
 * blocked while it runs a KEEL_JOB_BLOCKING job or one that has run longer
 * than block_ms (seen as the same odd seq on two looks block_ms apart), so
 * sleeping jobs let the pool pass the CPU count, up to max.
 *
 * The rule holds during a drain too (shutdown keeps the monitor until every
 * worker has been joined; _keel_sched_spawn refuses once nothing is pending).
 *
 * It also wakes a parked worker when work has waited a tick while one was
 * parked (workers chain-wake a sibling only when they fill a batch, or
 * when the monitor naps and would not look for up to block_ms/2: one that
 * leaves work behind then wakes a parked sibling if jobs were waiting on a
 * full pool, MON_FULL, and ends a nap kept only for timers, MON_NAP, so
 * that the monitor ticks through the burst: _keel_sched_unnap).
 *
 * While jobs wait the monitor ticks: every millisecond when it could grow,
 * else every block_ms/2 to spot long jobs, and at the next deadline of a
 * timer whose owner is inside a job, to fire it on time (so too once the
 * pool has been quiet MON_LINGER_NS). Once nothing waits it
 * lingers, ticking each millisecond (MON_TICK_NS), until MON_LINGER_NS have
 * passed since the last tick that saw work waiting, a job start or end, or
 * a worker waking or spinning (a long job alone does not keep it up: its
 * worker's seq stays put); then it sleeps on its futex with no deadline
 * (MON_INF). From there the producer that makes the queue non-empty with no
 * worker parked, a worker that leaves work behind, and a timer armed on a
 * worker inside a job poke it (one CAS and FUTEX_WAKE, only from MON_INF).
 * No signals: GlusterFS's pool woke its leader with SIGALRM, which every
 * thread in the process could receive.
 *
 * Why it lingers: A worker that takes a batch of one and leaves work behind
 * pokes the monitor before it runs its job, a FUTEX_WAKE on the job's path;
 * under a paced load (a burst every millisecond, keel-bench sched latency
 * at 1 producer) that happened once per burst and put the median
 * submit-to-start at 22 us against 15 us with the monitor ticking through
 * the gaps (medians of 7 alternated runs; throughput unchanged within the
 * noise). The price is MON_LINGER_NS / MON_TICK_NS (20) wake-ups of one
 * thread after the pool goes quiet.
 */
#include "base/clock.h"
#include "sched/sched_int.h"

#define SPAWN_INTERVAL_NS 1000000u  /* 1 ms: 1000 threads/s at most */
#define MON_TICK_NS       1000000u  /* 1 ms: the linger's period */
#define MON_LINGER_NS     20000000u /* 20 ms */

void _keel_sched_poke(void) {
  sched_t *s = &_keel_sched;
  uint32_t inf = MON_INF;
  if (atomic_compare_exchange_strong(&s->mon_mode, &inf, MON_POKED))
    keel_futex_wake(&s->mon_mode, 1);
}

/* Ends a nap kept for timers (MON_NAP -> MON_POKED), for work left behind
 * with a worker parked. The tick it causes sees that activity, so the
 * monitor ticks each millisecond until the pool has been quiet
 * MON_LINGER_NS, and takes this poke once per quiet-to-busy change. The nap
 * of a pool where jobs wait and it cannot grow (MON_FULL) is not ended
 * here: there the worker wakes a parked sibling itself, at once, rather
 * than have the monitor do it a tick or two later. A worker that read
 * MON_NAP and finds MON_INF here is covered by go_inf's re-check of the
 * backlog, as a producer is. */
void _keel_sched_unnap(void) {
  sched_t *s = &_keel_sched;
  uint32_t nap = MON_NAP;
  if (atomic_compare_exchange_strong(&s->mon_mode, &nap, MON_POKED))
    keel_futex_wake(&s->mon_mode, 1);
}

/* A timer due at `deadline` became its worker's earliest: keel_sched_after
 * armed it, or a retiring worker handed its timers to an heir. The owner may
 * be inside a job, where only the monitor fires on time, and a nap chosen
 * before the arm ran to its old deadline (review repro: a 2000 ms timer,
 * then a 10 ms one, fired 1.9 s late). If the monitor's next look
 * (mon_wake_ns) is later than the deadline, any mode but MON_EXIT becomes
 * MON_POKED, so the monitor looks again: at once from a sleep (woken),
 * after its tick from MON_TICK, or before it naps, if it had looked but not
 * yet published the nap (its CAS from MON_TICK fails). A monitor looking
 * now reads UINT64_MAX here: it stored that before taking sched.lock for
 * the look, and the arm held that lock before this load, so the load sees
 * it or the nap chosen after it. Without the comparison every arm of a
 * per-request timeout (armed, then cancelled: the heap empty at each arm)
 * poked a ticking monitor into looking again: 30% fewer jobs/s and ten
 * times the context switches (review). */
void _keel_sched_renap(uint64_t deadline) {
  sched_t *s = &_keel_sched;
  if (deadline >= atomic_load(&s->mon_wake_ns)) return;
  uint32_t m = atomic_load(&s->mon_mode);
  while (m == MON_TICK || m == MON_NAP || m == MON_FULL || m == MON_INF) {
    if (atomic_compare_exchange_weak(&s->mon_mode, &m, MON_POKED)) {
      if (m != MON_TICK) keel_futex_wake(&s->mon_mode, 1);
      return;
    }
  }
}

static bool backlog(void) {
  sched_t *s = &_keel_sched;
  return _keel_sched_work_visible() || (s->stage_mask | s->stage2_mask) != 0;
}

/* Growth is allowed while running and while draining (jobs queued before a
 * drain must not wait behind blocked workers), never while cancelling.
 * Caller holds sched.lock. */
static bool __may_grow(void) {
  sched_t *s = &_keel_sched;
  int st = atomic_load(&s->state); /* seq_cst: `how` was stored before it */
  return st == SCHED_RUNNING ||
         (st == SCHED_STOPPING && keel_load_relaxed(&s->how) == KEEL_SCHED_DRAIN);
}

/* Looks at one worker; true if it counts as blocked. Fires its due timers if
 * it is inside a job, however short so far: the owner fires its own only
 * between jobs, and waiting for "stuck" (block_ms) made a 10 ms timer fire
 * up to block_ms and a nap late. Firing under the heap's tlock races with
 * nothing; the owner finds the heap emptied. *due is lowered to the next
 * deadline of such an owner, *moved set if it started or ended a job since
 * the last tick. */
static bool look(sched_worker_t *w, uint64_t now, uint64_t block_ns, uint64_t *due,
                 uint64_t *due_any, bool *moved) {
  uint64_t seq = keel_load_acquire(&w->seq);
  *moved |= seq != w->mon_seen;
  w->mon_seen = seq;
  if (!(seq & 1)) {
    uint64_t next = atomic_load(&w->next_deadline);
    if (next < *due_any) *due_any = next;
    return false;
  }
  if (seq != w->mon_seq) {
    w->mon_seq = seq;
    w->mon_since = now;
  }
  bool stuck = now - w->mon_since >= block_ns;
  uint64_t next = atomic_load(&w->next_deadline);
  if (next <= now) {
    _keel_sched_timers_fire(w, now);
    next = atomic_load(&w->next_deadline);
  }
  if (next < *due) *due = next;
  if (next < *due_any) *due_any = next;
  return stuck || keel_load_relaxed(&w->blocking);
}

/* One look at the pool. Returns the ns to sleep (UINT64_MAX: until poked). */
static uint64_t tick(uint64_t now) {
  sched_t *s = &_keel_sched;
  uint64_t block_ns = (uint64_t)s->cfg.block_ms * 1000000u;
  uint64_t due = UINT64_MAX;     /* next timer of an owner inside a job */
  uint64_t due_any = UINT64_MAX; /* next timer of any worker */
  int blocked = 0;
  pthread_mutex_lock(&s->lock);
  sched_worker_t *w;
  bool moved = false;
  cds_list_for_each_entry(w, &s->workers, link) {
    blocked += look(w, now, block_ns, &due, &due_any, &moved);
  }
  int n = keel_load_relaxed(&s->nthreads);
  int cap = s->ncpu > (int)s->cfg.min_threads ? s->ncpu : (int)s->cfg.min_threads;
  bool work = backlog();
  bool waiting = work && atomic_load(&s->nidle) == 0;
  /* Activity, not occupancy: one long job alone lets the monitor sleep. */
  if (work || moved || keel_load_relaxed(&s->waking) > 0 || keel_load_relaxed(&s->nspinning) > 0)
    s->mon_busy_ns = now;
  bool grow = waiting && n < (int)s->cfg.max_threads && n - blocked < cap && __may_grow();
  pthread_mutex_unlock(&s->lock);
  if (work && !waiting) {
    /* Work waits while a worker is parked: the worker that left it chose not
     * to chain-wake (a batch of one) and may now be in a long job. Only on
     * the second tick in a row with no worker on its way to that work (woken
     * and not yet back, spinning, or yielding to a preempted producer), so
     * that work an awake worker is about to take costs no second wake-up
     * however long the scheduler keeps that worker or the producer off a
     * CPU. */
    bool in_flight = keel_load_relaxed(&s->waking) > 0 || keel_load_relaxed(&s->nyielding) > 0 ||
                     keel_load_relaxed(&s->nspinning) > 0;
    if (s->mon_saw_work && !in_flight) _keel_sched_wake_one();
    s->mon_saw_work = !in_flight;
    return SPAWN_INTERVAL_NS;
  }
  s->mon_saw_work = false;
  if (grow && now - s->last_spawn_ns >= SPAWN_INTERVAL_NS) {
    s->last_spawn_ns = now;
    _keel_sched_spawn();
  }
  if (grow) return SPAWN_INTERVAL_NS;
  uint64_t nap = block_ns / 2 > SPAWN_INTERVAL_NS ? block_ns / 2 : SPAWN_INTERVAL_NS;
  bool timers = due != UINT64_MAX;
  if (timers) { /* wake for the next one: never later than its deadline */
    uint64_t left = due > now ? due - now : 0;
    if (left < nap) nap = left;
  }
  /* A nap ends by any worker's next deadline too: one between jobs now may
   * be inside a long one by then, and no one pokes a napping monitor for
   * that (review repro: a 100 ms timer of a worker that took a 1 s job
   * after this look fired 950 ms late). Not before MON_TICK_NS: the timer
   * of a worker between jobs is that worker's to fire, and a past-due one
   * would otherwise spin the monitor until it does. */
  if (due_any != UINT64_MAX) {
    uint64_t left = due_any > now + MON_TICK_NS ? due_any - now : MON_TICK_NS;
    if (left < nap) nap = left;
  }
  s->mon_full = waiting;
  if (waiting) return nap;
  /* Timers alone (an owner inside a job) keep the monitor from sleeping,
   * never from lingering: a busy pool's monitor ticks as with no timers,
   * and naps once the pool has been quiet MON_LINGER_NS. Napping through
   * busy periods made every take that left work behind wake a parked
   * sibling (worker.c): 3.1-3.2 wake-ups per burst of 4 instead of 2.0
   * (review repro f_nap_wakes: 6 workers, a burst of 4 each millisecond,
   * one timer owner in a long job). */
  if (timers) return now - s->mon_busy_ns < MON_LINGER_NS ? MON_TICK_NS : nap;
  return UINT64_MAX;
}

void (*_keel_sched_sleep_hook)(void);
void (*_keel_sched_tick_hook)(uint64_t wait);

/* Whether a worker that owns timers is not parked; caller holds sched.lock.
 * keel_sched_after arms and a retiring worker hands timers on under that
 * lock, and only the owner itself (firing its last one) empties a heap
 * without it, so a deadline read here as none cannot hide a new timer. An
 * owner seen parked takes sched.lock for its next batch (take) after the
 * caller releases it, so it then reads the caller's MON_INF and pokes.
 * `parked` is idle_lock's: one take of it per owner, none in a pool
 * without timers. */
static bool __awake_timer_owner(void) {
  sched_t *s = &_keel_sched;
  sched_worker_t *w;
  cds_list_for_each_entry(w, &s->workers, link) {
    if (atomic_load(&w->next_deadline) == UINT64_MAX) continue;
    pthread_mutex_lock(&s->idle_lock);
    bool parked = w->parked;
    pthread_mutex_unlock(&s->idle_lock);
    if (!parked) return true;
  }
  return false;
}

/* Goes to MON_INF unless exiting; false if the monitor must look again.
 *
 * Invariant while in MON_INF: no backlog, no zombie, and every worker that
 * owns timers is parked (it sleeps until its own deadline) or will read
 * MON_INF before its next batch and poke (worker_main). The tick looked
 * before the CAS below, so a producer, a worker leaving work behind or
 * keel_sched_after may have read MON_TICK since and skipped its poke. Each
 * read the mode after its step: a producer after its append (a full
 * barrier, against this seq_cst CAS), a worker after its take (leaving
 * work behind, or going into jobs with timers) and keel_sched_after after
 * its arm, both under sched.lock. The re-check takes that lock after the
 * CAS, so it sees the step, or the step's later mode load sees MON_INF and
 * pokes. A timer owner found awake (a timer armed on a worker inside a
 * job, or an owner woken for work since the look: review repro
 * d2_after_lost_poke, a 10 ms timer fired when its owner's 1500 ms job
 * ended) counts as activity, as a poke would: the monitor lingers anew,
 * and sees the owner in its job (then naps, to fire its timers) or parked. */
static bool go_inf(void) {
  sched_t *s = &_keel_sched;
  void (*hook)(void) = __atomic_load_n(&_keel_sched_sleep_hook, __ATOMIC_ACQUIRE);
  if (keel_unlikely(hook != NULL)) hook();
  uint32_t m = atomic_load(&s->mon_mode);
  if (m == MON_EXIT || !atomic_compare_exchange_strong(&s->mon_mode, &m, MON_INF)) return false;
  pthread_mutex_lock(&s->lock);
  /* Any backlog, parked workers or not: a worker that left work behind a
   * batch of one skipped its poke if it read MON_TICK, and may be in a long
   * job now; the tick's second look wakes a parked one for it. */
  bool again = backlog() || !cds_list_empty(&s->zombies);
  bool owner = !again && __awake_timer_owner();
  pthread_mutex_unlock(&s->lock);
  if (owner) s->mon_busy_ns = keel_clock_ns();
  if (again || owner) {
    uint32_t inf = MON_INF;
    atomic_compare_exchange_strong(&s->mon_mode, &inf, MON_TICK);
    return false;
  }
  return true;
}

/* After publishing a nap (MON_NAP or MON_FULL), whether to look again
 * instead: work waits and a worker is parked. The tick looked before the
 * nap was stored, so a worker that left work behind since then read the
 * mode before this store (MON_TICK: it left the parked sibling to the
 * monitor's next tick, which the nap puts up to block_ms/2 away). Its take
 * holds sched.lock and it reads the mode after: either this look under the
 * same lock sees its work, or it reads the nap and acts on it (take). */
static bool __nap_again(void) {
  sched_t *s = &_keel_sched;
  pthread_mutex_lock(&s->lock);
  bool again = backlog() && atomic_load(&s->nidle) > 0;
  pthread_mutex_unlock(&s->lock);
  return again;
}

__thread bool _keel_sched_on_monitor;

static void *monitor_main(void *arg) {
  (void)arg;
  sched_t *s = &_keel_sched;
  _keel_sched_on_monitor = true;
  unsigned gen = s->fork_gen; /* written only in a fork child, before it has threads */
  for (;;) {
    if (atomic_load(&s->mon_mode) == MON_EXIT) break;
    /* A poke or an unnap before this look is taken by it: clear it, so that
     * one arriving after the look is still there below (review of this
     * stop: the nap's CAS swallowed an unnap made between the look and it,
     * and the work left behind waited a whole nap with a worker parked). */
    uint32_t poked = MON_POKED;
    atomic_compare_exchange_strong(&s->mon_mode, &poked, MON_TICK);
    atomic_store(&s->mon_wake_ns, UINT64_MAX); /* before the look: see _keel_sched_renap */
    _keel_sched_join_zombies();
    uint64_t now = keel_clock_ns();
    uint64_t wait = tick(now);
    /* An on_cancel that tick's spawn ran (timers of a worker that could not
     * be created) forked, and this is the child: this thread is no monitor
     * of the child's pool (that one, if the child starts a pool, is a new
     * thread), so it ends the child, as a worker whose job forked does. */
    if (keel_unlikely(s->fork_gen != gen)) _keel_sched_forked_exit();
    void (*hook)(uint64_t) = __atomic_load_n(&_keel_sched_tick_hook, __ATOMIC_ACQUIRE);
    if (keel_unlikely(hook != NULL)) hook(wait);
    if (wait == UINT64_MAX && now - s->mon_busy_ns < MON_LINGER_NS) wait = MON_TICK_NS;
    if (wait == UINT64_MAX) {
      if (go_inf()) keel_futex_wait_until(&s->mon_mode, MON_INF, UINT64_MAX);
      continue;
    }
    /* Outside MON_INF only the monitor, stop(), _keel_sched_unnap
     * (MON_NAP -> MON_POKED) and _keel_sched_renap (-> MON_POKED) write the
     * mode. MON_POKED here came after this look (cleared above): look
     * again. The CAS fails on MON_EXIT, or on a poke since the load (look
     * again too). */
    uint32_t mode = wait <= MON_TICK_NS ? MON_TICK : s->mon_full ? MON_FULL : MON_NAP;
    atomic_store(&s->mon_wake_ns, now + wait);
    uint32_t m = atomic_load(&s->mon_mode);
    if (m == MON_EXIT || m == MON_POKED || !atomic_compare_exchange_strong(&s->mon_mode, &m, mode))
      continue;
    if (mode != MON_TICK && __nap_again()) {
      uint32_t nap = mode;
      atomic_compare_exchange_strong(&s->mon_mode, &nap, MON_TICK);
      continue;
    }
    keel_futex_wait_until(&s->mon_mode, mode, now + wait);
  }
  return NULL;
}

int _keel_sched_monitor_start(void) {
  sched_t *s = &_keel_sched;
  atomic_store(&s->mon_mode, MON_TICK);
  atomic_store(&s->mon_wake_ns, UINT64_MAX);
  int rc = _keel_sched_thread_create(&s->monitor, monitor_main, NULL);
  s->monitor_started = rc == 0;
  return -rc;
}

void _keel_sched_monitor_stop(void) {
  sched_t *s = &_keel_sched;
  if (!s->monitor_started) return;
  atomic_store(&s->mon_mode, MON_EXIT);
  keel_futex_wake(&s->mon_mode, 1);
  pthread_join(s->monitor, NULL);
  s->monitor_started = false;
}
