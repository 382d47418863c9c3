/* sched internals: the one pool, its workers, clients and job states.
 *
 * Where a job is, by its _state:
 *   IDLE    owned by the caller (never submitted, or fn/on_cancel called);
 *   QUEUED  in an incoming wfcqueue shard or a staging queue;
 *   LOCAL   on its client's FIFO for its level (dispatch mutex);
 *   TIMER   in a worker's timer heap (that worker's timer mutex);
 *   TAKEN   in a worker's batch, about to run (it will: a cancelling
 *           shutdown takes jobs itself, and workers take none meanwhile);
 *   CANCELLING  off every queue, its notice about to be delivered.
 * Transitions: IDLE->QUEUED (submit, CAS), IDLE->TIMER (after, CAS),
 * TIMER->QUEUED (fire) under the timer mutex, QUEUED->LOCAL (sorted),
 * QUEUED->TAKEN (fast lane) and LOCAL->TAKEN under the dispatch mutex,
 * TAKEN->IDLE by the worker right before it calls fn; LOCAL or TIMER ->
 * CANCELLING (under the lock that held it), or QUEUED/LOCAL -> CANCELLING
 * by a cancelling shutdown's collect (under sched.lock: the TAKEN that its
 * dispatch passes through is never seen) -> IDLE right before on_cancel, in
 * _keel_sched_notify_cancel. keel reads nothing of a job after its release
 * store of IDLE.
 *
 * Locks, outer to inner: life_lock (init/shutdown), lock (dispatch: staging,
 * levels, clients, worker list), a worker's tlock (its timer heap), then
 * either idle_lock (the parked-worker stack) or gate.c's prod_lock (the
 * producer registry). Two tlocks are held together only by a retiring
 * worker handing its timers on (its own, then its heir's), under
 * sched.lock. A submit takes none of them unless it must wake a parked
 * worker (idle_lock) or is its thread's first (prod_lock). fork.c's prepare
 * takes all but life_lock: lock, every tlock, prod_lock, then idle_lock
 * (prod_lock first: shutdown's gate_close holds it while it waits for a
 * producer, whose kick may need idle_lock).
 */
#ifndef KEEL_SCHED_INT_H
#define KEEL_SCHED_INT_H

#define _LGPL_SOURCE /* wfcqueue's inline fast paths, not the library calls */
#include <pthread.h>
#include <urcu/list.h>
#include <urcu/wfcqueue.h>

#include <keel/sched.h>

#include "base/atomic.h"
#include "base/common.h"
#include "base/futex.h"
#include "base/tls.h"

enum { JOB_IDLE, JOB_QUEUED, JOB_LOCAL, JOB_TIMER, JOB_TAKEN, JOB_CANCELLING };
enum { PRIO_HIGH, PRIO_NORMAL, PRIO_LOW, PRIO_COUNT };
/* Pool states (lifecycle.c). STARTING: an init is creating its threads and
 * accepts nothing yet (submits wait for it on life_lock), so one that fails
 * has nothing to cancel and goes straight back to the state it found. */
enum { SCHED_UNINIT, SCHED_STARTING, SCHED_RUNNING, SCHED_STOPPING, SCHED_SHUTDOWN };

/* A fairness domain. Invariant (dispatch mutex): in_ring[p] iff on level
 * p's ring; on it iff it has jobs of level p waiting (q[p] non-empty), except
 * that the default client at normal level (q[p] plus the staging queues) may
 * stay on with nothing waiting until a take finds it empty;
 * n[p] == length of q[p]; used[p] < KEEL_SCHED_QUANTUM. */
struct keel_sched_client {
  struct cds_list_head q[PRIO_COUNT];    /* its LOCAL jobs, FIFO */
  struct cds_list_head ring[PRIO_COUNT]; /* link in levels[p].ring */
  uint32_t n[PRIO_COUNT];
  uint32_t used[PRIO_COUNT]; /* dispatches in the current turn */
  bool in_ring[PRIO_COUNT];
  /* Its jobs armed by keel_sched_after and not yet on q[]: in a timer heap,
   * or fired and on their way through the incoming queue (no list of the
   * client holds them), so destroy counts them here. Incremented when armed,
   * decremented when cancelled or when place() puts the fired job on q[]
   * and counts it in n[]: each such job is in exactly one of the two counts,
   * and every change is made under sched.lock, where destroy reads both. */
  keel_atomic(uint32_t) ntimers;
};

/* One priority level: the clients with queued jobs, served round-robin. */
typedef struct sched_level {
  struct cds_list_head ring;
  uint64_t n; /* LOCAL jobs of this level, all clients */
} sched_level_t;

/* A worker thread. Fields marked (own) are written only by the worker;
 * (lock), (tlock), (idle) name the mutex that guards them. */
typedef struct sched_worker {
  struct cds_list_head link;              /* sched.workers or sched.zombies (lock) */
  struct cds_list_head idle_link;         /* sched.idle while parked (idle) */
  bool parked;                            /* on sched.idle (idle) */
  bool wake_pending;                      /* woken by wake_one, not yet back (idle) */
  pthread_t thread;                       /* valid once `started` */
  bool started;                           /* (lock) pthread_create returned: joinable */
  keel_atomic(uint32_t) word;             /* futex: 0 parked, 1 woken, 2 kicked */
  keel_atomic(uint64_t) seq;              /* (own) odd while inside fn; +2 per job */
  uint64_t mon_seq, mon_since;            /* monitor's last sight of seq, and when */
  uint64_t mon_seen;                      /* monitor only: seq at its last tick, to tell activity */
  keel_atomic(int) blocking;              /* (own) running a KEEL_JOB_BLOCKING job */
  keel_atomic(unsigned) cur_prio;         /* (own) priority of the job inside fn */
  keel_atomic(keel_job_t *) current;      /* (own) the job inside fn, for cancel */
  keel_atomic(uint64_t) nrun[PRIO_COUNT]; /* (own) fn calls returned */
  uint64_t busy_ns;                       /* (own) when it last ran a job */
  unsigned fast_max;                      /* (own) next batch size, 1..KEEL_SCHED_BATCH */
  uint64_t behind_ns; /* (own) since when its takes have left work behind; 0: not now */
  uint64_t job_ns;    /* (own) recent ns per job (EWMA over back-to-back batches) */
  bool streak;        /* (own) its last batch ended just before this take: busy_ns is when */
  unsigned shard;     /* where its heap's timers are enqueued when they fire, by it or by the
                   * monitor: one shard per heap keeps their deadline order */
  /* Timers: a binary min-heap on job->_t; job->_l[1] is the slot. */
  pthread_mutex_t tlock;
  keel_job_t **heap; /* (tlock) */
  uint32_t nheap, capheap;
  uint32_t ntimer[PRIO_COUNT];         /* (tlock) heap entries by priority; sum == nheap */
  keel_atomic(uint64_t) next_deadline; /* heap[0]->_t, UINT64_MAX if empty */
  keel_job_t *batch[KEEL_SCHED_BATCH]; /* (own) taken jobs */
} sched_worker_t;

/* One shard of the fast incoming queue. A producer preempted between its
 * xchg and its link store hides every node behind its own from consumers
 * until it runs again; with 64 producers on 2 cores that can be a whole
 * round of the run queue. Sharding by producer thread limits that to the
 * producers of one shard and divides the contention on each tail line
 * (keel-bench sched latency, 256 paced producers on 2 cores: p99 6.8-10 ms
 * with 8 shards, 0.6-1.6 ms with 32). Per-thread FIFO order holds (a thread
 * always uses one shard); across threads there was none to keep. */
#define SCHED_SHARDS   32 /* <= 64: the staging masks are 64-bit */
/* How long a worker leaves work behind before it wakes a sibling (worker.c). */
#define SCHED_CHAIN_NS 25000u
typedef struct sched_shard {
  struct __cds_wfcq_head head KEEL_CACHE_ALIGNED;  /* fast lane, consumers' end */
  struct cds_wfcq_tail tail KEEL_CACHE_ALIGNED;    /* fast lane, producers' end */
  struct __cds_wfcq_head head2 KEEL_CACHE_ALIGNED; /* every other job */
  struct cds_wfcq_tail tail2 KEEL_CACHE_ALIGNED;
} sched_shard_t;

/* A spliced-off queue, private to the dispatcher (sched.lock). */
typedef struct sched_q {
  struct __cds_wfcq_head head;
  struct cds_wfcq_tail tail;
} sched_q_t;

/* A submitting thread's record (gate.c), in its TLS. */
typedef struct sched_producer {
  keel_atomic(uint32_t) active; /* (own) 1 between the gate check and the count */
  bool registered;              /* (own) on the registry */
  unsigned shard;               /* (own) its shard of the fast queue */
  /* (own) accepted submits and timers, by priority: the fast lane adds to
   * [PRIO_NORMAL] only, so per-priority counts cost a submit nothing more. */
  keel_atomic(int64_t) submitted[PRIO_COUNT];
  struct cds_list_head link; /* registry (prod_lock) */
  keel_thread_hook_t hook;   /* unregisters at thread exit */
} sched_producer_t;

typedef struct sched {
  /* Read by every submit, written only by init and shutdown: alone on its
   * line, apart from nidle, which every park and wake-up writes. */
  keel_atomic(int) state KEEL_CACHE_ALIGNED;
  keel_atomic(int) how; /* shutdown mode while STOPPING */
  /* Read by the submit that turns a queue non-empty; written per park. */
  keel_atomic(int) nidle KEEL_CACHE_ALIGNED; /* parked workers */
  keel_atomic(uint32_t) mon_mode;            /* futex word, MON_* */
  /* When the monitor looks next: UINT64_MAX from before a look until it
   * has chosen its nap, and while it sleeps without deadline; a timer due
   * earlier must poke it (_keel_sched_renap). */
  keel_atomic(uint64_t) mon_wake_ns;
  keel_atomic(int) nspinning; /* workers polling before they park */
  /* Incoming queues, one pair per shard: producers xchg a tail, the
   * dispatcher splices. The fast lane takes normal jobs of the default
   * client (the common case, which then never touches a list); the other
   * queue takes every other job. */
  sched_shard_t in[SCHED_SHARDS];
  /* Dispatch state, under `lock`. */
  pthread_mutex_t lock KEEL_CACHE_ALIGNED;
  /* Spliced from each shard's fast lane: the newer part of the default
   * client's normal FIFO (its list q[PRIO_NORMAL] holds the older part,
   * filled only by cancel and shutdown, which need O(1) removal). Kept per
   * shard so that a node a preempted producer has not linked yet holds back
   * only its own shard, never the jobs spliced after it from other shards. */
  sched_q_t stage[SCHED_SHARDS];
  uint64_t stage_mask;              /* bit i: stage[i] is not empty */
  unsigned stage_next;              /* shard the default client takes from next */
  sched_q_t stage2[SCHED_SHARDS];   /* spliced from the other queues, being sorted */
  uint64_t stage2_mask;             /* bit i: stage2[i] still holds unsorted jobs */
  sched_level_t levels[PRIO_COUNT]; /* a level waits iff its ring is non-empty */
  uint32_t since_low, since_normal; /* dispatches since that level last ran */
  keel_atomic(uint64_t) nlocal;     /* sum of levels[].n (read without lock) */
  keel_atomic(int) staged;          /* staging left non-empty by the last dispatch */
  struct cds_list_head workers;     /* live workers; head = next timer owner */
  struct cds_list_head zombies;     /* retired, not yet joined */
  keel_atomic(int) nthreads;        /* workers counted, started or starting */
  uint64_t spawned, retired;
  uint64_t run_retired[PRIO_COUNT];           /* nrun of joined workers */
  keel_atomic(int64_t) cancelled[PRIO_COUNT]; /* notices, by priority */
  keel_sched_config_t cfg;
  bool cfg_inherited; /* a fork child's: its lazy init uses cfg, not the defaults */
  unsigned fork_gen;  /* forks this process is the child of (fork.c; read by notify_all
                       * and the monitor) */
  int ncpu;
  /* Parked workers, LIFO so the coldest ones time out and retire. */
  pthread_mutex_t idle_lock KEEL_CACHE_ALIGNED;
  struct cds_list_head idle;
  uint64_t wakeups; /* (idle_lock) */
  /* Workers woken by wake_one that have not yet returned from their wait.
   * The monitor's backstop wake waits for this to reach 0: on a loaded
   * machine a woken worker can wait milliseconds for a CPU, and waking a
   * second one for the same work would only add a runnable thread. */
  keel_atomic(int) waking;
  /* Workers that found a half-linked enqueue and yield until its producer
   * runs again: awake and about to take that work, so the monitor must not
   * wake another for it (one more thread polling the same stuck shard). */
  keel_atomic(int) nyielding;
  /* The monitor thread (scale.c). */
  pthread_t monitor;
  bool monitor_started;
  uint64_t last_spawn_ns;
  bool mon_saw_work;    /* the last tick saw work waiting with a worker parked */
  bool mon_full;        /* monitor only: the last tick napped for jobs waiting (MON_FULL) */
  uint64_t mon_busy_ns; /* monitor only: last tick that saw work, a job start or end, or a
                         * worker waking or spinning */
  pthread_mutex_t life_lock;
  keel_atomic(int) gate_closed; /* shutdown saw every producer leave the gate */
} sched_t;

extern sched_t _keel_sched KEEL_HIDDEN;
extern __thread sched_worker_t *_keel_sched_self KEEL_HIDDEN;
/* Set on the monitor thread: the on_cancels it runs (timers of a worker it
 * could not create) must not start or stop the pool it is part of. */
extern __thread bool _keel_sched_on_monitor KEEL_HIDDEN;
extern struct keel_sched_client _keel_sched_default_client KEEL_HIDDEN;

/* Monitor modes: sleeping with no deadline, poked awake, ticking (next
 * look within MON_TICK_NS), napping (its next look block_ms/2 away) while
 * only timers of a worker inside a job need it (MON_NAP: a worker that
 * leaves work behind with one parked ends it) or while jobs wait on a pool
 * that cannot grow (MON_FULL: such a worker wakes a parked sibling itself),
 * told to exit. */
enum { MON_INF, MON_POKED, MON_TICK, MON_NAP, MON_FULL, MON_EXIT };

KEEL_INLINE unsigned _keel_job_prio(const keel_job_t *job) {
  return (job->flags & KEEL_JOB_HIGH) ? PRIO_HIGH
                                      : ((job->flags & KEEL_JOB_LOW) ? PRIO_LOW : PRIO_NORMAL);
}

KEEL_INLINE unsigned _keel_job_state(keel_job_t *job) {
  return __atomic_load_n(&job->_state, __ATOMIC_ACQUIRE);
}
KEEL_INLINE void _keel_job_set_state(keel_job_t *job, unsigned s) {
  __atomic_store_n(&job->_state, s, __ATOMIC_RELEASE);
}
/* job->_l[1] of a client's timer job from its firing until place() counts
 * it off the client's ntimers (timers_fire sets it before the release store
 * of QUEUED; place() reads it under sched.lock before _l becomes the list
 * link). No heap slot (an index) or list link can equal it. */
extern const char _keel_sched_fired_mark KEEL_HIDDEN;
#define SCHED_FIRED ((void *)&_keel_sched_fired_mark)

KEEL_INLINE struct cds_wfcq_node *_keel_job_node(keel_job_t *job) {
  return (struct cds_wfcq_node *)(void *)&job->_q;
}
KEEL_INLINE keel_job_t *_keel_node_job(struct cds_wfcq_node *n) {
  return (keel_job_t *)(void *)((char *)n - offsetof(keel_job_t, _q));
}
KEEL_INLINE struct cds_list_head *_keel_job_link(keel_job_t *job) {
  return (struct cds_list_head *)(void *)job->_l;
}
KEEL_INLINE keel_job_t *_keel_link_job(struct cds_list_head *l) {
  return (keel_job_t *)(void *)((char *)l - offsetof(keel_job_t, _l));
}

/* <urcu/list.h> 0.13 has cds_list_move (to the head) but no move to the tail. */
KEEL_INLINE void _keel_list_move_tail(struct cds_list_head *elem, struct cds_list_head *head) {
  cds_list_del(elem);
  cds_list_add_tail(elem, head);
}

/* Lifecycle (lifecycle.c). */
int _keel_sched_lazy_init(void) KEEL_HIDDEN;
void _keel_sched_reset_queues(void) KEEL_HIDDEN;
bool _keel_sched_in_life(void) KEEL_HIDDEN; /* this thread holds life_lock */
int64_t _keel_sched_pending(void) KEEL_HIDDEN;
void _keel_sched_notify_cancel(keel_job_t *job) KEEL_HIDDEN;
void _keel_sched_notify_all(struct cds_list_head *list) KEEL_HIDDEN;

/* Producer side (submit.c). */
void _keel_sched_enqueue(keel_job_t *job, bool fast, unsigned shard) KEEL_HIDDEN;

/* Normal jobs of the default client go to the fast lane, the rest to the
 * other queue of the producer's shard. */
KEEL_INLINE bool _keel_sched_fast_lane(const keel_job_t *job) {
  return job->client == NULL && !(job->flags & (KEEL_JOB_HIGH | KEEL_JOB_LOW));
}
void _keel_sched_kick(void) KEEL_HIDDEN;

/* The producer gate (gate.c). */
extern __thread sched_producer_t _keel_sched_me KEEL_HIDDEN;
extern int _keel_sched_fence_needed KEEL_HIDDEN;
int _keel_sched_register(void) KEEL_HIDDEN;
void _keel_sched_gate_init(void) KEEL_HIDDEN;
void _keel_sched_gate_close(void) KEEL_HIDDEN;
int64_t _keel_sched_submitted(int64_t by_prio[PRIO_COUNT]) KEEL_HIDDEN;
/* fork (fork.c): prod_lock taken, released, or reset to the calling
 * thread's record alone with every count at 0. */
void _keel_sched_gate_atfork_prepare(void) KEEL_HIDDEN;
void _keel_sched_gate_atfork_parent(void) KEEL_HIDDEN;
void _keel_sched_gate_atfork_child(void) KEEL_HIDDEN;
void _keel_sched_atfork_once(void) KEEL_HIDDEN; /* registers fork.c's handlers */
/* Ends a fork child in the thread that was the parent's worker or monitor
 * (fork.c). */
KEEL_NORETURN void _keel_sched_forked_exit(void) KEEL_HIDDEN;

/* Opens the gate for one submit: 0, or KEEL_EAGAIN (no exit hook). */
KEEL_INLINE int _keel_sched_gate_enter(sched_producer_t *me) {
  if (keel_unlikely(!me->registered)) {
    int rc = _keel_sched_register();
    if (rc != 0) return rc;
  }
  /* Orders the store of `active` before the caller's load of state. With
   * membarrier, shutdown makes the ordering, so a compiler barrier is all it
   * takes here; without, a seq_cst exchange (both sides seq_cst: the store
   * buffering outcome is excluded by the C11 model itself). */
  if (keel_likely(!__atomic_load_n(&_keel_sched_fence_needed, __ATOMIC_RELAXED))) {
    keel_store_relaxed(&me->active, 1);
    atomic_signal_fence(memory_order_seq_cst);
  } else {
    atomic_exchange(&me->active, 1);
  }
  return 0;
}

/* Counts one accepted submit of priority p (owner-only: no lock prefix). */
KEEL_INLINE void _keel_sched_count_submit(sched_producer_t *me, unsigned p) {
  keel_store_relaxed(&me->submitted[p], keel_load_relaxed(&me->submitted[p]) + 1);
}

/* Release: the count and the enqueue are visible to whoever sees 0. */
KEEL_INLINE void _keel_sched_gate_leave(sched_producer_t *me) {
  keel_store_release(&me->active, 0);
}

/* Dispatch (dispatch.c); `__` means the caller holds sched.lock. */
bool __keel_sched_flatten(void) KEEL_HIDDEN;
unsigned __keel_sched_dispatch(keel_job_t **out, unsigned max, bool *stuck) KEEL_HIDDEN;

/* Work a worker could take: incoming, staged or sorted. Lock-free hint; the
 * seq_cst loads pair with nidle's increment in park.c. */
KEEL_INLINE bool _keel_sched_work_visible(void) {
  sched_t *s = &_keel_sched;
  for (int i = 0; i < SCHED_SHARDS; i++)
    if (!cds_wfcq_empty(&s->in[i].head, &s->in[i].tail)) return true;
  for (int i = 0; i < SCHED_SHARDS; i++)
    if (!cds_wfcq_empty(&s->in[i].head2, &s->in[i].tail2)) return true;
  return atomic_load(&s->nlocal) > 0 || atomic_load(&s->staged);
}
void __keel_sched_unlink(keel_job_t *job) KEEL_HIDDEN;

/* Parking (park.c). */
void _keel_sched_wake_one(void) KEEL_HIDDEN;
void _keel_sched_wake_all(void) KEEL_HIDDEN;
void _keel_sched_kick_worker(sched_worker_t *w) KEEL_HIDDEN;
bool _keel_sched_park(sched_worker_t *w) KEEL_HIDDEN;

/* Workers (worker.c). */
int _keel_sched_spawn(void) KEEL_HIDDEN;
/* Creates one of sched's threads (a worker or the monitor): 0 or
 * pthread_create's error. Tests set _keel_sched_create_hook to make a
 * creation fail: when set, it runs first and its nonzero return is taken
 * as that error (NULL outside tests: one load per thread created). */
int _keel_sched_thread_create(pthread_t *t, void *(*fn)(void *), void *arg) KEEL_HIDDEN;
extern int (*_keel_sched_create_hook)(void) KEEL_HIDDEN;
void _keel_sched_join_zombies(void) KEEL_HIDDEN;
void _keel_sched_join_workers(void) KEEL_HIDDEN;
void _keel_sched_worker_free(sched_worker_t *w) KEEL_HIDDEN;

/* Timers (timer.c). */
void _keel_sched_timers_fire(sched_worker_t *w, uint64_t now) KEEL_HIDDEN;
unsigned _keel_sched_timers_cancel_all(sched_worker_t *w, struct cds_list_head *out) KEEL_HIDDEN;
int _keel_sched_timer_cancel(keel_job_t *job) KEEL_HIDDEN;
int __keel_sched_timers_hand_over(sched_worker_t *w, sched_worker_t *heir) KEEL_HIDDEN;

/* Monitor (scale.c). */
int _keel_sched_monitor_start(void) KEEL_HIDDEN;
void _keel_sched_monitor_stop(void) KEEL_HIDDEN;
void _keel_sched_poke(void) KEEL_HIDDEN;
void _keel_sched_unnap(void) KEEL_HIDDEN;
void _keel_sched_renap(uint64_t deadline) KEEL_HIDDEN; /* a timer due at deadline was armed */
/* Tests set it to hold the monitor between its last look and its MON_INF
 * store (go_inf); NULL outside tests: one load each time the monitor goes
 * to sleep without deadline. */
extern void (*_keel_sched_sleep_hook)(void) KEEL_HIDDEN;
/* Tests set it to hold the monitor between a look (`wait`: what it asked)
 * and its sleep; NULL outside tests: one load per look. */
extern void (*_keel_sched_tick_hook)(uint64_t wait) KEEL_HIDDEN;

#endif /* KEEL_SCHED_INT_H */
