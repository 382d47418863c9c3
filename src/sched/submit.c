/* The producer side: keel_sched_submit and keel_sched_run.
 *
 * Fast path (no lock, no syscall, no allocation): two stores and a load for
 * the shutdown gate (gate.c), a CAS
 * on the job's state, wfcqueue's xchg on the shared tail and the link store.
 * Only the submit that turns an incoming queue from empty to non-empty looks
 * further: if a worker is parked it wakes exactly one (the rest of a burst
 * rides on that wake-up and on the chain wake in worker.c); if none is, it
 * pokes the monitor, which decides about growing the pool. Not yet solved:
 * a burst submitted one job at a time on few cores often finds the queue
 * empty again at each submit, so each of those submits wakes another worker
 * (keel-bench sched burst8: 4-8 wake-ups for 8 empty jobs onto 4 parked
 * workers on 2 cores, all from this kick). The futex wake costs the
 * producer 4-12 us here, long enough for the woken worker to take the job
 * on the other CPU, park again after its spin, and leave the next submit an
 * empty queue; or the kernel puts the woken worker on the producer's own
 * CPU (most wake-ups, while the other CPU is busy), where it preempts the
 * producer and does the same before the producer runs again. Tried and
 * dropped:
 *  - skipping the kick while a woken worker had not yet taken a job, a
 *    worker spun, or work was staged: p99 at 64 paced producers rose from
 *    50-58 to 84-86 us;
 *  - a woken worker yielding to a waker on its CPU (63f6806, reverted):
 *    1.00 wake-up per burst, but sched_yield hands the CPU over until the
 *    producer blocks, so a producer that submits one job and then computes
 *    held that job back for its whole time slice (p90 submit-to-start 4 ms
 *    against 3-13 us; review repro r1).
 *
 * Measured (perf, 64 producers on 2 cores): the job CAS and the link store
 * into the previous producer's job are a cache miss each and make up nearly
 * all of a submit's cost; a per-submit locked add on a counter stripe cost
 * as much again before the gate moved to membarrier.
 */
#include <stdlib.h>

#include "base/die.h"
#include "sched/sched_int.h"

/* Publishes a job whose state is already QUEUED into `shard` (the
 * submitting thread's, or a timer heap's owner's); `fast` comes from
 * _keel_sched_fast_lane(), read before that state store (whose release is
 * all that orders the caller's accesses to the job before a worker's: after
 * it, keel reads nothing of the job but the link). wfcqueue's xchg is a full
 * barrier (uatomic_xchg), which the nidle load of the kick relies on (see
 * park.c for the other half). */
void _keel_sched_enqueue(keel_job_t *job, bool fast, unsigned shard) {
  sched_t *s = &_keel_sched;
  struct cds_wfcq_node *node = _keel_job_node(job);
  cds_wfcq_node_init(node);
  bool was_empty;
  if (keel_likely(fast))
    was_empty = !cds_wfcq_enqueue(&s->in[shard].head, &s->in[shard].tail, node);
  else
    was_empty = !cds_wfcq_enqueue(&s->in[shard].head2, &s->in[shard].tail2, node);
  if (keel_unlikely(was_empty)) _keel_sched_kick();
}

/* The queue went from empty to non-empty: make sure someone will look. */
KEEL_NOINLINE void _keel_sched_kick(void) {
  if (atomic_load(&_keel_sched.nidle) > 0)
    _keel_sched_wake_one();
  else if (keel_load_relaxed(&_keel_sched.mon_mode) == MON_INF)
    _keel_sched_poke();
}

/* Not RUNNING: the lazy init starts the pool, or waits for the init in
 * progress (STARTING) and starts it itself if that one failed. */
static KEEL_NOINLINE int submit_slow(keel_job_t *job) {
  int st = atomic_load(&_keel_sched.state);
  if (st == SCHED_UNINIT || st == SCHED_STARTING) {
    int rc = _keel_sched_lazy_init();
    if (rc != 0 && rc != KEEL_EBUSY) return rc;
    return keel_sched_submit(job);
  }
  return KEEL_ESHUTDOWN;
}

int keel_sched_submit(keel_job_t *job) {
  if (keel_unlikely(job == NULL || job->fn == NULL))
    return KEEL_REJECT(KEEL_EINVAL, "keel_sched_submit", "%s is NULL", job ? "job->fn" : "job");
  sched_producer_t *me = &_keel_sched_me;
  int rc = _keel_sched_gate_enter(me);
  if (keel_unlikely(rc != 0)) return rc;
  /* seq_cst (a plain load on x86): pairs with shutdown's store, gate.c. */
  if (keel_unlikely(atomic_load(&_keel_sched.state) != SCHED_RUNNING)) {
    _keel_sched_gate_leave(me);
    return submit_slow(job);
  }
  bool fast = _keel_sched_fast_lane(job);
  unsigned prio = _keel_job_prio(job); /* read now: after the enqueue the job is a worker's */
  unsigned idle = JOB_IDLE;
  /* Acq_rel: acquire pairs with the worker's release of IDLE before it ran
   * fn (the job's last use by keel); release publishes the caller's fields. */
  if (keel_unlikely(!__atomic_compare_exchange_n(&job->_state, &idle, JOB_QUEUED, false,
                                                 __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))) {
    _keel_sched_gate_leave(me);
    return KEEL_EBUSY;
  }
  _keel_sched_enqueue(job, fast, me->shard);
  _keel_sched_count_submit(me, prio);
  _keel_sched_gate_leave(me);
  return 0;
}

/* keel_sched_run's job: malloc'd, freed by whichever callback runs. */
typedef struct run_job {
  keel_job_t job;
  void (*fn)(void *);
  void *arg;
} run_job_t;

static void run_job_fn(keel_job_t *job) {
  run_job_t *r = (run_job_t *)job;
  void (*fn)(void *) = r->fn;
  void *arg = r->arg;
  free(r); /* before fn: fn may take long, and the memory is no longer keel's */
  fn(arg);
}

static void run_job_cancel(keel_job_t *job) {
  if (job->flags & KEEL_JOB_RUN_IF_CANCELLED) {
    run_job_fn(job); /* in the cancelling thread: keel_sched_shutdown's */
    return;
  }
  free(job);
}

int keel_sched_run(void (*fn)(void *arg), void *arg, unsigned flags) {
  if (fn == NULL) return KEEL_REJECT(KEEL_EINVAL, "keel_sched_run", "fn is NULL");
  run_job_t *r = malloc(sizeof(*r));
  if (r == NULL) return KEEL_ENOMEM;
  keel_job_init(&r->job, run_job_fn, flags);
  r->job.on_cancel = run_job_cancel;
  r->fn = fn;
  r->arg = arg;
  int rc = keel_sched_submit(&r->job);
  if (rc != 0) free(r);
  return rc;
}
