/* Parking idle workers on a futex each, and waking exactly one.
 *
 * A parked worker sits on sched.idle (LIFO: the most recently active worker
 * is woken first, so the one at the bottom stays idle long enough to retire)
 * and sleeps on its own futex word. A waker pops one worker, sets its word to
 * 1 and wakes that futex: one syscall wakes one thread, never a herd.
 *
 * No lost wake-up: the parking worker increments nidle (seq_cst) and then
 * re-reads the incoming queue, nlocal and staged; a producer appends (wfcqueue's
 * xchg, a full barrier) and then reads nidle. One of the two must see the
 * other's write, so either the producer wakes someone or the worker does not
 * sleep. The same argument covers dispatch's chain wake (nlocal, then nidle).
 */
#define _GNU_SOURCE
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "sched/sched_int.h"

/* Pops the most recently parked worker and wakes it. The futex call comes
 * after the unlock; if the worker has meanwhile returned on its own, the
 * wake is a harmless spurious one (every wait re-checks its condition). */
void _keel_sched_wake_one(void) {
  sched_t *s = &_keel_sched;
  pthread_mutex_lock(&s->idle_lock);
  if (cds_list_empty(&s->idle)) {
    pthread_mutex_unlock(&s->idle_lock);
    return;
  }
  sched_worker_t *w = cds_list_first_entry(&s->idle, sched_worker_t, idle_link);
  cds_list_del(&w->idle_link);
  w->parked = false;
  w->wake_pending = true;
  keel_fetch_add_relaxed(&s->waking, 1);
  s->wakeups++;
  keel_fetch_sub_relaxed(&s->nidle, 1); /* idle_lock orders it against parkers */
  atomic_store(&w->word, 1);
  pthread_mutex_unlock(&s->idle_lock);
  keel_futex_wake(&w->word, 1);
}

void _keel_sched_wake_all(void) {
  sched_t *s = &_keel_sched;
  pthread_mutex_lock(&s->idle_lock);
  while (!cds_list_empty(&s->idle)) {
    sched_worker_t *w = cds_list_first_entry(&s->idle, sched_worker_t, idle_link);
    cds_list_del(&w->idle_link);
    w->parked = false;
    keel_fetch_sub_relaxed(&s->nidle, 1);
    atomic_store(&w->word, 1);
    keel_futex_wake(&w->word, 1);
  }
  pthread_mutex_unlock(&s->idle_lock);
}

/* Makes a parked worker re-read its timer deadline (a timer was added). The
 * CAS only succeeds while it is parked; otherwise it reads next_deadline
 * (stored before this) on its way to parking. */
void _keel_sched_kick_worker(sched_worker_t *w) {
  uint32_t parked = 0;
  if (atomic_compare_exchange_strong(&w->word, &parked, 2)) keel_futex_wake(&w->word, 1);
}

static void park_push(sched_worker_t *w) {
  sched_t *s = &_keel_sched;
  pthread_mutex_lock(&s->idle_lock);
  atomic_store(&w->word, 0);
  w->parked = true;
  cds_list_add(&w->idle_link, &s->idle);
  atomic_fetch_add(&s->nidle, 1); /* seq_cst: before the re-check of the queue */
  pthread_mutex_unlock(&s->idle_lock);
}

/* Takes w off the idle stack if a waker has not; true if it was still on.
 * A worker a waker took off checks in here (sched.waking). */
static bool park_pop(sched_worker_t *w) {
  sched_t *s = &_keel_sched;
  pthread_mutex_lock(&s->idle_lock);
  bool was = w->parked;
  if (was) {
    cds_list_del(&w->idle_link);
    w->parked = false;
    keel_fetch_sub_relaxed(&s->nidle, 1);
  } else if (w->wake_pending) {
    w->wake_pending = false;
    keel_fetch_sub_relaxed(&s->waking, 1);
  }
  pthread_mutex_unlock(&s->idle_lock);
  return was;
}

/* The worker that inherits a retiring w's timers: the first in timer-owner
 * order (from the head of sched.workers, like keel_sched_after's pick) that
 * is not inside a job, else the first at all; it then moves to the tail. One
 * inside a long job fires late until the monitor sees it stuck, so an idle
 * one is worth the walk (retiring is rare). Never one whose thread is still
 * being created (that may fail). NULL if none; caller holds sched.lock. */
static sched_worker_t *__timer_heir(sched_worker_t *w) {
  sched_t *s = &_keel_sched;
  sched_worker_t *h, *heir = NULL;
  cds_list_for_each_entry(h, &s->workers, link) {
    if (h == w || !h->started) continue;
    if (heir == NULL) heir = h;
    if (!(keel_load_relaxed(&h->seq) & 1)) {
      heir = h;
      break;
    }
  }
  if (heir != NULL) _keel_list_move_tail(&heir->link, &s->workers);
  return heir;
}

/* Whether more than min workers have started; caller holds sched.lock.
 * nthreads also counts a worker whose pthread_create is in progress: a
 * worker that retired on that count left the pool below min, at 0 with
 * min 1, when the creation then failed (review repro c_retire_below_min).
 * Walks at most min + 1 entries, and only when a worker is due to retire. */
static bool __started_above_min(void) {
  sched_t *s = &_keel_sched;
  unsigned n = 0;
  sched_worker_t *w;
  cds_list_for_each_entry(w, &s->workers, link) {
    if (w->started && ++n > s->cfg.min_threads) return true;
  }
  return false;
}

/* Leaves the pool if it is above min and idle long enough, handing its
 * timers to another worker first (if they cannot move, for want of memory,
 * it stays). Under sched.lock, which keel_sched_after holds while it picks a
 * worker, so no timer can be armed on w meanwhile. */
static bool try_retire(sched_worker_t *w, uint64_t now) {
  sched_t *s = &_keel_sched;
  bool retire = false;
  sched_worker_t *heir = NULL;
  uint64_t heir_due = UINT64_MAX; /* read under the lock: the heir may be freed after it */
  pthread_mutex_lock(&s->lock);
  if (atomic_load(&s->state) == SCHED_RUNNING &&
      now - w->busy_ns >= (uint64_t)s->cfg.idle_ms * 1000000u) {
    /* None to spare while one counted in nthreads is still starting: look
     * again after another idle_ms, not at once (its deadline is past). */
    retire = __started_above_min();
    if (retire && atomic_load(&w->next_deadline) != UINT64_MAX) {
      /* more than min >= 1 started: another started worker exists */
      heir = __timer_heir(w);
      retire = heir != NULL && __keel_sched_timers_hand_over(w, heir) == 0;
    }
    if (!retire) w->busy_ns = now;
  }
  if (retire) {
    cds_list_del(&w->link);
    cds_list_add_tail(&w->link, &s->zombies);
    keel_fetch_sub_relaxed(&s->nthreads, 1);
    s->retired++;
    /* The heir may be parked with a later deadline than the timers it got
     * (its next_deadline was stored, seq_cst, before this). Under the lock:
     * once it is released the heir may retire in turn and be freed. */
    if (heir != NULL) {
      _keel_sched_kick_worker(heir);
      heir_due = atomic_load(&heir->next_deadline);
    }
  }
  pthread_mutex_unlock(&s->lock);
  /* The monitor joins w, and fires the heir's new timers if it is in a job. */
  if (retire && heir != NULL)
    _keel_sched_renap(heir_due);
  else if (retire)
    _keel_sched_poke();
  return retire;
}

static uint64_t park_deadline(sched_worker_t *w, bool stopping) {
  sched_t *s = &_keel_sched;
  uint64_t d = atomic_load(&w->next_deadline);
  if (stopping) return keel_clock_ns() + 1000000u; /* re-check pending each ms */
  /* Above min it wakes to retire too (timers or not: they would move). */
  if (keel_load_relaxed(&s->nthreads) > (int)s->cfg.min_threads) {
    uint64_t retire_at = w->busy_ns + (uint64_t)s->cfg.idle_ms * 1000000u;
    if (retire_at < d) d = retire_at;
  }
  return d;
}

/* Called with nothing to do. Returns false when the worker must exit. */
bool _keel_sched_park(sched_worker_t *w) {
  sched_t *s = &_keel_sched;
  int st = atomic_load(&s->state);
  /* Seen by a live worker only when an init that could not create all its
   * threads undoes its start, having accepted nothing (lifecycle.c). */
  if (st == SCHED_UNINIT || st == SCHED_SHUTDOWN) return false;
  bool stopping = st == SCHED_STOPPING;
  /* Work left for a cancelling shutdown to collect is not w's to take. */
  bool cancelling = stopping && keel_load_relaxed(&s->how) == KEEL_SCHED_CANCEL;
  if (stopping && atomic_load(&s->gate_closed)) {
    pthread_mutex_lock(&s->lock);
    int64_t pending = _keel_sched_pending();
    pthread_mutex_unlock(&s->lock);
    if (pending == 0) {
      _keel_sched_wake_all(); /* the others need not wait out their 1 ms */
      return false;
    }
  }
  park_push(w);
  uint64_t deadline = park_deadline(w, stopping);
  /* A shutdown (or a failed init's undo) that began after the load above
   * either found w on the idle stack (its wake_all takes idle_lock after
   * storing the state) or is seen here; without this re-check w could
   * sleep through it forever. STOPPING lasts while workers live. */
  bool changed = atomic_load(&s->state) != st;
  if (changed || (!cancelling && _keel_sched_work_visible())) {
    park_pop(w);
    return true;
  }
  /* A deadline already past is a timeout like any other: a worker woken for
   * work that another took comes back here at or after busy_ns + idle_ms
   * without having run a job, and must retire now; returning without the
   * retire check made it loop take/spin/park with no sleep until another
   * worker retired in its place. */
  if (deadline > keel_clock_ns()) keel_futex_wait_until(&w->word, 0, deadline);
  if (!park_pop(w)) return true; /* woken for work */
  uint64_t now = keel_clock_ns();
  if (!stopping && now >= deadline && try_retire(w, now)) return false;
  return true;
}
