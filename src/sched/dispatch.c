/* Dispatch: from the incoming queue to the order in which jobs run.
 *
 * Under sched.lock the dispatcher splices the whole incoming wfcqueue into a
 * private staging queue (one xchg, however many jobs), then sorts staged jobs
 * onto their client's FIFO for their level. Both steps use wfcqueue's
 * non-blocking variants: a producer preempted between its xchg and its link
 * store (common with 64 producers on 2 cores) would make the blocking ones
 * poll(2) for 10 ms with the mutex held; here the unlinked tail simply stays
 * in staging and the caller yields instead of parking.
 *
 * Taking a job: pick the level (low is due once every KEEL_SCHED_LOW_EVERY
 * dispatches while it waits, normal once every KEEL_SCHED_NORMAL_EVERY,
 * otherwise the highest non-empty level), then the client at the head of that
 * level's ring, which keeps its turn for KEEL_SCHED_QUANTUM jobs or until it
 * runs dry. Cost per job: a few list operations on lines the worker is about
 * to touch anyway to run the job.
 */
#include "sched/sched_int.h"

struct keel_sched_client _keel_sched_default_client;

static void place(keel_job_t *job) {
  sched_t *s = &_keel_sched;
  /* The acquire load pairs with the producer's release CAS to QUEUED: the
   * job's fields written before submit are visible below. */
  unsigned st = _keel_job_state(job);
  KEEL_ASSERT(st == JOB_QUEUED);
  (void)st;
  unsigned p = _keel_job_prio(job);
  struct keel_sched_client *c = job->client ? job->client : &_keel_sched_default_client;
  cds_list_add_tail(_keel_job_link(job), &c->q[p]);
  if (c->n[p]++ == 0) cds_list_add_tail(&c->ring[p], &s->levels[p].ring);
  s->levels[p].n++;
  __atomic_store_n(&job->_state, JOB_LOCAL, __ATOMIC_RELAXED); /* lock orders it */
}

/* Moves everything visible in the incoming queue onto the client FIFOs.
 * Returns true if a half-linked node stopped it (try again after a yield). */
bool __keel_sched_sort(void) {
  sched_t *s = &_keel_sched;
  enum cds_wfcq_ret r =
      __cds_wfcq_splice_nonblocking(&s->stage_head, &s->stage_tail, &s->in_head, &s->in_tail);
  bool stuck = r == CDS_WFCQ_RET_WOULDBLOCK;
  uint64_t placed = 0;
  for (;;) {
    struct cds_wfcq_node *n = __cds_wfcq_dequeue_nonblocking(&s->stage_head, &s->stage_tail);
    if (n == NULL) break;
    if (n == CDS_WFCQ_WOULDBLOCK) {
      stuck = true;
      break;
    }
    place(_keel_node_job(n));
    placed++;
  }
  /* Relaxed: nlocal is a hint for batch sizing and parking; the seq_cst
   * re-check in park.c is what closes the lost-wake-up window. */
  if (placed) atomic_fetch_add(&s->nlocal, placed);
  return stuck;
}

static int pick_level(void) {
  sched_t *s = &_keel_sched;
  bool hw = s->levels[PRIO_HIGH].n, nw = s->levels[PRIO_NORMAL].n, lw = s->levels[PRIO_LOW].n;
  int p;
  if (lw && (s->since_low >= KEEL_SCHED_LOW_EVERY - 1 || (!hw && !nw)))
    p = PRIO_LOW;
  else if (nw && (s->since_normal >= KEEL_SCHED_NORMAL_EVERY - 1 || !hw))
    p = PRIO_NORMAL;
  else if (hw)
    p = PRIO_HIGH;
  else
    return -1;
  /* Count only while the level waits, so the bound is "one in every N
   * dispatches while waiting" and no credit builds up while it is empty. */
  s->since_low = p == PRIO_LOW ? 0 : (lw ? s->since_low + 1 : 0);
  s->since_normal = p != PRIO_HIGH ? 0 : (nw ? s->since_normal + 1 : 0);
  return p;
}

static keel_job_t *take_one(int p) {
  sched_level_t *L = &_keel_sched.levels[p];
  struct keel_sched_client *c = cds_list_first_entry(&L->ring, struct keel_sched_client, ring[p]);
  keel_job_t *job = _keel_link_job(c->q[p].next);
  cds_list_del(_keel_job_link(job));
  L->n--;
  if (--c->n[p] == 0) {
    cds_list_del(&c->ring[p]);
    c->used[p] = 0;
  } else if (++c->used[p] >= KEEL_SCHED_QUANTUM) {
    c->used[p] = 0;
    _keel_list_move_tail(&c->ring[p], &L->ring);
  }
  __atomic_store_n(&job->_state, JOB_TAKEN, __ATOMIC_RELAXED); /* lock orders it */
  return job;
}

/* Takes up to `max` jobs in dispatch order; the caller sorted first. */
unsigned __keel_sched_take(keel_job_t **out, unsigned max) {
  unsigned n = 0;
  int p;
  while (n < max && (p = pick_level()) >= 0) out[n++] = take_one(p);
  if (n) keel_fetch_sub_relaxed(&_keel_sched.nlocal, n);
  return n;
}

static bool levels_empty(void) {
  sched_level_t *L = _keel_sched.levels;
  return (L[PRIO_HIGH].n | L[PRIO_NORMAL].n | L[PRIO_LOW].n) == 0;
}

/* The common case: nothing sorted is waiting and the staged jobs are normal
 * jobs of the default client. The policy would take those in FIFO order
 * anyway, so take them straight from staging and skip the client lists
 * (about 10 ns a job less under the mutex). Stops at the first other job,
 * which is sorted, and leaves the rest to the policy. */
static unsigned take_fast(keel_job_t **out, unsigned max, bool *stuck) {
  sched_t *s = &_keel_sched;
  unsigned n = 0;
  while (n < max) {
    struct cds_wfcq_node *node = __cds_wfcq_dequeue_nonblocking(&s->stage_head, &s->stage_tail);
    if (node == NULL) break;
    if (node == CDS_WFCQ_WOULDBLOCK) {
      *stuck = true;
      break;
    }
    keel_job_t *job = _keel_node_job(node);
    /* Acquire: pairs with the producer's release CAS, as in place(). */
    unsigned st = _keel_job_state(job);
    KEEL_ASSERT(st == JOB_QUEUED);
    (void)st;
    if (job->client != NULL || _keel_job_prio(job) != PRIO_NORMAL) {
      place(job);
      atomic_fetch_add(&s->nlocal, 1);
      break;
    }
    __atomic_store_n(&job->_state, JOB_TAKEN, __ATOMIC_RELAXED); /* lock orders it */
    out[n++] = job;
  }
  return n;
}

/* One worker's dispatch: up to `max` jobs, and of the sorted ones at most
 * its share (sorted jobs / workers). Sets *stuck as __keel_sched_sort does. */
unsigned __keel_sched_dispatch(keel_job_t **out, unsigned max, int workers, bool *stuck) {
  sched_t *s = &_keel_sched;
  enum cds_wfcq_ret r =
      __cds_wfcq_splice_nonblocking(&s->stage_head, &s->stage_tail, &s->in_head, &s->in_tail);
  *stuck = r == CDS_WFCQ_RET_WOULDBLOCK;
  unsigned n = 0;
  if (levels_empty()) n = take_fast(out, max, stuck);
  if (n < max && !levels_empty()) {
    *stuck |= __keel_sched_sort();
    uint64_t share = keel_load_relaxed(&s->nlocal) / (uint64_t)(workers > 0 ? workers : 1);
    unsigned want = share < 1 ? 1 : (share > max - n ? max - n : (unsigned)share);
    n += __keel_sched_take(out + n, want);
  }
  /* seq_cst: the chain-wake argument of park.c covers staged as nlocal. */
  atomic_store(&s->staged, !cds_wfcq_empty(&s->stage_head, &s->stage_tail));
  return n;
}

/* Removes a LOCAL job (cancel). */
void __keel_sched_unlink(keel_job_t *job) {
  sched_t *s = &_keel_sched;
  unsigned p = _keel_job_prio(job);
  struct keel_sched_client *c = job->client ? job->client : &_keel_sched_default_client;
  cds_list_del(_keel_job_link(job));
  s->levels[p].n--;
  if (--c->n[p] == 0) {
    cds_list_del(&c->ring[p]);
    c->used[p] = 0;
  }
  keel_fetch_sub_relaxed(&s->nlocal, 1);
}
