/* Timers: a binary min-heap per worker, keyed on the deadline in ns.
 *
 * keel_sched_after puts the job in the calling worker's heap, or (from any
 * other thread) in the heap of the worker at the head of sched.workers, which
 * then moves to the tail: round-robin without a cursor. The owner checks its
 * earliest deadline (one relaxed load) before each dispatch and parks no
 * longer than it, so a timer fires within the futex wake-up latency of its
 * deadline (well under the millisecond resolution promised), never before.
 * While the owner is inside a job, the monitor wakes at its earliest
 * deadline and fires its due timers for it (a job may run for seconds). A
 * worker that retires (idle past idle_ms, above min) first hands its whole
 * heap to the next worker in line
 * (__keel_sched_timers_hand_over), so owning timers never keeps an idle
 * thread alive (retiring needs more than min_threads >= 1 alive, so such a
 * worker exists; if it is still starting, w waits for its next idle look).
 *
 * The heap slot lives in job->_l[1] so cancel removes in O(log n); the heap
 * array grows by doubling (the only allocation in sched besides threads,
 * clients and keel_sched_run).
 */
#include <stdlib.h>

#include "base/die.h"
#include "base/clock.h"
#include "sched/sched_int.h"

static void heap_set(sched_worker_t *w, uint32_t i, keel_job_t *job) {
  w->heap[i] = job;
  job->_l[1] = (void *)(uintptr_t)i;
}

static uint32_t slot_of(keel_job_t *job) {
  return (uint32_t)(uintptr_t)job->_l[1];
}

static void sift_up(sched_worker_t *w, uint32_t i) {
  keel_job_t *job = w->heap[i];
  while (i > 0) {
    uint32_t parent = (i - 1) / 2;
    if (w->heap[parent]->_t <= job->_t) break;
    heap_set(w, i, w->heap[parent]);
    i = parent;
  }
  heap_set(w, i, job);
}

static void sift_down(sched_worker_t *w, uint32_t i) {
  keel_job_t *job = w->heap[i];
  for (;;) {
    uint32_t c = 2 * i + 1;
    if (c >= w->nheap) break;
    if (c + 1 < w->nheap && w->heap[c + 1]->_t < w->heap[c]->_t) c++;
    if (job->_t <= w->heap[c]->_t) break;
    heap_set(w, i, w->heap[c]);
    i = c;
  }
  heap_set(w, i, job);
}

static void heap_remove(sched_worker_t *w, uint32_t i) {
  KEEL_ASSERT(i < w->nheap);
  w->ntimer[_keel_job_prio(w->heap[i])]--;
  keel_job_t *last = w->heap[--w->nheap];
  if (i == w->nheap) return;
  heap_set(w, i, last);
  sift_up(w, i);
  sift_down(w, slot_of(last));
}

/* Makes room for `more` entries: 0 or KEEL_ENOMEM (the heap unchanged). */
static int heap_reserve(sched_worker_t *w, uint32_t more) {
  if (w->capheap - w->nheap >= more) return 0;
  uint32_t cap = w->capheap ? w->capheap : 16;
  while (cap - w->nheap < more) cap *= 2;
  keel_job_t **h = realloc(w->heap, cap * sizeof(*h));
  if (h == NULL) return KEEL_ENOMEM;
  w->heap = h;
  w->capheap = cap;
  return 0;
}

static int heap_push(sched_worker_t *w, keel_job_t *job) {
  int rc = heap_reserve(w, 1);
  if (rc != 0) return rc;
  w->ntimer[_keel_job_prio(job)]++;
  heap_set(w, w->nheap++, job);
  sift_up(w, w->nheap - 1);
  return 0;
}

/* seq_cst store: pairs with the parking worker's load after it cleared its
 * futex word (see _keel_sched_kick_worker). */
static void publish_min(sched_worker_t *w) {
  atomic_store(&w->next_deadline, w->nheap ? w->heap[0]->_t : UINT64_MAX);
}

/* A timer of client c left its heap without being enqueued (cancelled).
 * Relaxed: every caller holds sched.lock, as client_destroy does. */
static void client_untimed(struct keel_sched_client *c) {
  if (c != NULL) keel_fetch_sub_relaxed(&c->ntimers, 1);
}

const char _keel_sched_fired_mark;

/* Submits every job of w's heap whose deadline has passed, earliest first.
 * A client's job stays counted in its ntimers until place() sorts it onto
 * the client's list: counted off here, after the enqueue (whose kick wakes
 * a worker), the job could already run, and its fn find its client busy. */
void _keel_sched_timers_fire(sched_worker_t *w, uint64_t now) {
  pthread_mutex_lock(&w->tlock);
  while (w->nheap > 0 && w->heap[0]->_t <= now) {
    keel_job_t *job = w->heap[0];
    heap_remove(w, 0);
    bool fast = _keel_sched_fast_lane(job);
    if (job->client != NULL) job->_l[1] = SCHED_FIRED;
    _keel_job_set_state(job, JOB_QUEUED);     /* counted as submitted when armed */
    _keel_sched_enqueue(job, fast, w->shard); /* not the caller's: see sched_worker_t */
  }
  publish_min(w);
  pthread_mutex_unlock(&w->tlock);
}

/* Empties w's heap onto `out` (linked through job->_l) for shutdown. */
unsigned _keel_sched_timers_cancel_all(sched_worker_t *w, struct cds_list_head *out) {
  pthread_mutex_lock(&w->tlock);
  unsigned n = w->nheap;
  for (uint32_t i = 0; i < w->nheap; i++) {
    client_untimed(w->heap[i]->client);
    _keel_job_set_state(w->heap[i], JOB_CANCELLING); /* before _l is reused */
    cds_list_add_tail(_keel_job_link(w->heap[i]), out);
  }
  w->nheap = 0;
  for (int p = 0; p < PRIO_COUNT; p++) w->ntimer[p] = 0;
  publish_min(w);
  pthread_mutex_unlock(&w->tlock);
  return n;
}

/* A retiring worker's heap goes to `heir`: each entry keeps its deadline and
 * is re-pushed, so the heir fires them with its own in one deadline order
 * (the entries of one heap never split: timers armed together stay in
 * order), and stays counted in its client's ntimers. Caller holds
 * sched.lock, which keel_sched_after and cancel also hold while they pick or
 * follow an owner (job->_l[0]), so neither sees a timer between heaps. Only
 * this path holds two tlocks; sched.lock serialises it, so their order (w's
 * first) cannot deadlock. 0, or KEEL_ENOMEM with both heaps unchanged (w
 * then stays). */
int __keel_sched_timers_hand_over(sched_worker_t *w, sched_worker_t *heir) {
  KEEL_ASSERT(w != heir);
  pthread_mutex_lock(&w->tlock);
  pthread_mutex_lock(&heir->tlock);
  int rc = heap_reserve(heir, w->nheap);
  if (rc == 0) {
    for (uint32_t i = 0; i < w->nheap; i++) {
      w->heap[i]->_l[0] = heir;
      heap_push(heir, w->heap[i]); /* cannot fail: reserved */
    }
    w->nheap = 0;
    for (int p = 0; p < PRIO_COUNT; p++) w->ntimer[p] = 0;
    publish_min(w);
    publish_min(heir);
  }
  pthread_mutex_unlock(&heir->tlock);
  pthread_mutex_unlock(&w->tlock);
  return rc;
}

/* Removes a TIMER job; caller holds sched.lock (so its owner cannot be
 * freed). KEEL_EAGAIN if it fired meanwhile (the caller looks again). */
int _keel_sched_timer_cancel(keel_job_t *job) {
  sched_worker_t *w = job->_l[0];
  pthread_mutex_lock(&w->tlock);
  int rc = KEEL_EAGAIN;
  if (_keel_job_state(job) == JOB_TIMER && job->_l[0] == w) {
    heap_remove(w, slot_of(job));
    publish_min(w);
    client_untimed(job->client);
    _keel_job_set_state(job, JOB_CANCELLING);
    rc = 0;
  }
  pthread_mutex_unlock(&w->tlock);
  return rc;
}

/* The worker whose heap takes a new timer, or NULL if sched.workers is
 * empty, which it never is while RUNNING: init publishes RUNNING only once
 * its min >= 1 workers are listed and started (they spawn in STARTING, when
 * keel_sched_after waits for the init instead of arming), and a worker
 * retires only while more than min have started. */
static sched_worker_t *timer_owner(void) {
  sched_t *s = &_keel_sched;
  if (_keel_sched_self != NULL) return _keel_sched_self;
  if (cds_list_empty(&s->workers)) return NULL;
  sched_worker_t *w = cds_list_first_entry(&s->workers, sched_worker_t, link);
  _keel_list_move_tail(&w->link, &s->workers);
  return w;
}

/* Arms under sched.lock: the state check is serialised with shutdown, and
 * the owner is on sched.workers so it cannot retire meanwhile. */
static int arm(keel_job_t *job, uint64_t deadline, sched_worker_t **owner, bool *earliest) {
  sched_t *s = &_keel_sched;
  if (atomic_load(&s->state) != SCHED_RUNNING) return KEEL_ESHUTDOWN;
  unsigned idle = JOB_IDLE;
  if (!__atomic_compare_exchange_n(&job->_state, &idle, JOB_TIMER, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE))
    return KEEL_EBUSY;
  sched_worker_t *w = timer_owner();
  KEEL_ASSERT(w != NULL);
  if (keel_unlikely(w == NULL)) {
    _keel_job_set_state(job, JOB_IDLE); /* not armed: still the caller's */
    return KEEL_EAGAIN;
  }
  pthread_mutex_lock(&w->tlock);
  job->_t = deadline;
  job->_l[0] = w;
  int rc = heap_push(w, job);
  if (rc == 0) {
    *earliest = w->heap[0] == job;
    publish_min(w);
    /* Under sched.lock, as client_destroy's look. */
    if (job->client != NULL) keel_fetch_add_relaxed(&job->client->ntimers, 1);
    /* Counted under sched.lock, which orders it before shutdown's look. */
    _keel_sched_count_submit(&_keel_sched_me, _keel_job_prio(job));
  } else {
    _keel_job_set_state(job, JOB_IDLE);
  }
  pthread_mutex_unlock(&w->tlock);
  *owner = w;
  return rc;
}

int keel_sched_after(keel_job_t *job, uint64_t ms) {
  if (job == NULL || job->fn == NULL)
    return KEEL_REJECT(KEEL_EINVAL, "keel_sched_after", "%s is NULL", job ? "job->fn" : "job");
  if (ms == 0) return keel_sched_submit(job);
  _keel_sched_atfork_once(); /* before life_lock (a lazy init) and sched.lock */
  int st = atomic_load(&_keel_sched.state);
  if (st == SCHED_UNINIT || st == SCHED_STARTING) { /* start it, or wait for its init */
    int rc = _keel_sched_lazy_init();
    if (rc != 0 && rc != KEEL_EBUSY) return rc;
  }
  if (!_keel_sched_me.registered) {
    int rc = _keel_sched_register();
    if (rc != 0) return rc;
  }
  if (ms > UINT64_MAX / 2000000u) ms = UINT64_MAX / 2000000u; /* "never", without overflow */
  uint64_t deadline = keel_clock_ns() + ms * 1000000u;
  sched_worker_t *w = NULL;
  bool earliest = false;
  pthread_mutex_lock(&_keel_sched.lock);
  int rc = arm(job, deadline, &w, &earliest);
  /* Under the lock: once it is released, w may retire (handing the timer
   * on) and be freed. */
  if (rc == 0 && earliest && w != _keel_sched_self) _keel_sched_kick_worker(w);
  pthread_mutex_unlock(&_keel_sched.lock);
  if (rc != 0) return rc;
  /* Should the owner's job run long, the monitor is the one who fires this
   * timer on time, so it must not sleep without deadline while the owner
   * is awake. The owner is inside a job (the caller's), or another thread's
   * pick, which may be about to enter one: it reads next_deadline before a
   * batch and only then publishes its odd seq, so a seq read here and that
   * deadline read can miss each other (a 10 ms timer fired after a 601 ms
   * job). Hence a poke from MON_INF whoever the owner (one load otherwise).
   * A monitor on its way there re-checks for an owner not parked after its
   * MON_INF store, under sched.lock, which the arm held (go_inf, scale.c):
   * it sees the timer, or this load sees MON_INF. Either way the monitor
   * lingers, then sees the owner in a job with timers (and naps) or parked.
   * A new earliest may also be due before the nap the monitor is in or
   * about to take: that one is poked from any mode (_keel_sched_renap). */
  if (earliest)
    _keel_sched_renap(deadline);
  else if (keel_load_relaxed(&_keel_sched.mon_mode) == MON_INF)
    _keel_sched_poke();
  return 0;
}
