/* The producer side: keel_sched_submit and keel_sched_run.
 *
 * Fast path (no lock, no syscall, no allocation): one locked add on this
 * thread's counter stripe, a CAS on the job's state, wfcqueue's xchg on the
 * shared tail, and a load of the parked-worker count. Only the submit that
 * turns the incoming queue from empty to non-empty looks further: if a worker
 * is parked it wakes exactly one (the rest of a burst rides on that wake-up
 * and on the chain wake in dispatch); if none is, it pokes the monitor, which
 * decides about growing the pool.
 *
 * Shutdown gate: the stripe add (seq_cst) comes before the load of `state`
 * (seq_cst), and shutdown stores STOPPING before it sums the stripes; so
 * either shutdown counts this submit as pending and waits for it, or this
 * submit sees STOPPING, takes its count back and returns KEEL_ESHUTDOWN.
 */
#include <stdlib.h>

#include "sched/sched_int.h"

static keel_atomic(unsigned) stripe_next;
static __thread sched_stripe_t *my_stripe;

sched_stripe_t *_keel_sched_stripe(void) {
  if (keel_unlikely(my_stripe == NULL)) {
    /* Relaxed: only spreads threads over stripes, orders nothing. */
    unsigned i = keel_fetch_add_relaxed(&stripe_next, 1) % SCHED_STRIPES;
    my_stripe = &_keel_sched.stripes[i];
  }
  return my_stripe;
}

/* Publishes a job whose state is already QUEUED. The release half of the
 * state CAS/store orders the caller's writes to the job before the node
 * becomes reachable; wfcqueue's xchg is a full barrier (uatomic_xchg), which
 * the nidle load below relies on (see park.c for the other half). */
void _keel_sched_enqueue(keel_job_t *job) {
  sched_t *s = &_keel_sched;
  struct cds_wfcq_node *node = _keel_job_node(job);
  cds_wfcq_node_init(node);
  bool was_empty;
  if (keel_likely(job->client == NULL && !(job->flags & (KEEL_JOB_HIGH | KEEL_JOB_LOW))))
    was_empty = !cds_wfcq_enqueue(&s->in_head, &s->in_tail, node);
  else
    was_empty = !cds_wfcq_enqueue(&s->in2_head, &s->in2_tail, node);
  if (keel_unlikely(was_empty)) _keel_sched_kick();
}

/* The queue went from empty to non-empty: make sure someone will look. */
KEEL_NOINLINE void _keel_sched_kick(void) {
  if (atomic_load(&_keel_sched.nidle) > 0)
    _keel_sched_wake_one();
  else if (keel_load_relaxed(&_keel_sched.mon_mode) == MON_INF)
    _keel_sched_poke();
}

static KEEL_NOINLINE int submit_slow(keel_job_t *job) {
  int st = atomic_load(&_keel_sched.state);
  if (st == SCHED_UNINIT) {
    int rc = _keel_sched_lazy_init();
    if (rc != 0 && rc != KEEL_EBUSY) return rc;
    return keel_sched_submit(job);
  }
  return KEEL_ESHUTDOWN;
}

int keel_sched_submit(keel_job_t *job) {
  if (keel_unlikely(job == NULL || job->fn == NULL)) return KEEL_EINVAL;
  sched_stripe_t *s = _keel_sched_stripe();
  atomic_fetch_add(&s->submitted, 1); /* seq_cst: the gate's first half */
  if (keel_unlikely(atomic_load(&_keel_sched.state) != SCHED_RUNNING)) {
    keel_fetch_sub_relaxed(&s->submitted, 1);
    return submit_slow(job);
  }
  unsigned idle = JOB_IDLE;
  /* Acq_rel: acquire pairs with the worker's release of IDLE before it ran
   * fn (the job's last use by keel); release publishes the caller's fields. */
  if (keel_unlikely(!__atomic_compare_exchange_n(&job->_state, &idle, JOB_QUEUED, false,
                                                 __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))) {
    keel_fetch_sub_relaxed(&s->submitted, 1);
    return KEEL_EBUSY;
  }
  _keel_sched_enqueue(job);
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
  free(job);
}

int keel_sched_run(void (*fn)(void *arg), void *arg, unsigned flags) {
  if (fn == NULL) return KEEL_EINVAL;
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
