/* Callback delivery, inline or on keel's sched: see dispatch.h for why and
 * where.
 *
 * The sched path is a serial executor. A batch (the callbacks one call
 * caused, in grant order) is appended to the lockspace's FIFO; if no drainer
 * is scheduled, the poster submits the queue's one job. The job pops and runs
 * batches until the FIFO is empty, then clears `scheduled` under the mutex
 * and returns; a later post submits it again (sched allows resubmitting a job
 * whose fn has been called). So at most one drainer runs per lockspace: its
 * callbacks never run concurrently with each other, and batches run in the
 * order they were posted. If sched refuses the job (shut down) or a batch
 * cannot be allocated, the poster runs the callbacks inline instead: late is
 * acceptable, lost is not. The job is BLOCKING so that a callback that waits
 * (e.g. a blocking keel_lock) lets the pool grow rather than starve it.
 */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include <keel/sched.h>
#include <urcu/list.h>

#include "base/die.h"
#include "dispatch.h"
#include "lock_internal.h"
#include "mutex.h"

typedef struct cb_batch {
  struct cds_list_head link;
  uint32_t n;
  keel_delivery_t v[]; /* ASTs and BASTs only */
} cb_batch_t;

struct keel_cbq {
  keel_job_t job;               /* the drainer; first, so the job finds the queue */
  pthread_mutex_t mu;           /* guards the two fields below */
  struct cds_list_head batches; /* FIFO of cb_batch_t */
  bool scheduled;               /* a drainer is submitted or running */
};

void _keel_dispatch_push(keel_dispatch_t *d, const keel_delivery_t *e) {
  if (keel_unlikely(d->n == d->cap)) {
    uint32_t cap = d->cap * 2;
    keel_delivery_t *v = malloc(cap * sizeof(*v));
    if (v == NULL) keel_die("keel_lock", "out of memory queueing %u lock callbacks", cap);
    memcpy(v, d->v, d->n * sizeof(*v));
    if (d->v != d->inl) free(d->v);
    d->v = v;
    d->cap = cap;
  }
  d->v[d->n++] = *e;
}

static void deliver(const keel_delivery_t *v, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    const keel_delivery_t *e = &v[i];
    switch (e->kind) {
      case KEEL_DELIVER_AST:
        e->fn.ast(e->arg);
        break;
      case KEEL_DELIVER_BAST:
        _keel_lkb_bast(e->fn.bast, e->mode);
        break;
      case KEEL_DELIVER_WAKE:
        /* The word was set to 1 under the resource mutex; its waiter may have
         * seen that, returned and freed the lkb holding it already. FUTEX_WAKE
         * on such an address is harmless: the kernel touches no memory for it
         * and at worst wakes an unrelated waiter on reused memory spuriously,
         * which every futex waiter tolerates (glibc's semaphores rely on the
         * same). Doing the system call here keeps it out of the critical
         * section. */
        keel_futex_wake(e->fn.wake, 1);
        break;
    }
  }
}

static void cbq_drain(keel_job_t *job) {
  keel_cbq_t *q = (keel_cbq_t *)job;
  for (;;) {
    pthread_mutex_lock(&q->mu);
    if (cds_list_empty(&q->batches)) {
      q->scheduled = false; /* last touch of q by this drainer but the unlock */
      pthread_mutex_unlock(&q->mu);
      return;
    }
    cb_batch_t *b = cds_list_first_entry(&q->batches, cb_batch_t, link);
    cds_list_del(&b->link);
    pthread_mutex_unlock(&q->mu);
    deliver(b->v, b->n);
    free(b);
  }
}

/* Posts the ASTs and BASTs of d to q; runs wakes (and, failing a post, the
 * rest) inline. */
static void cbq_post(keel_cbq_t *q, keel_dispatch_t *d) {
  cb_batch_t *b = malloc(sizeof(*b) + d->n * sizeof(keel_delivery_t));
  if (b == NULL) {
    deliver(d->v, d->n);
    return;
  }
  b->n = 0;
  for (uint32_t i = 0; i < d->n; i++) {
    if (d->v[i].kind == KEEL_DELIVER_WAKE)
      deliver(&d->v[i], 1);
    else
      b->v[b->n++] = d->v[i];
  }
  if (b->n == 0) {
    free(b);
    return;
  }
  pthread_mutex_lock(&q->mu);
  cds_list_add_tail(&b->link, &q->batches);
  bool submit = !q->scheduled;
  q->scheduled = true;
  pthread_mutex_unlock(&q->mu);
  if (submit && keel_sched_submit(&q->job) != 0) cbq_drain(&q->job); /* sched is shut down */
}

void _keel_dispatch_run(keel_dispatch_t *d) {
  if (d->q != NULL)
    cbq_post(d->q, d);
  else
    deliver(d->v, d->n);
  if (d->v != d->inl) free(d->v);
  keel_dispatch_init(d, d->q);
}

keel_cbq_t *_keel_cbq_create(void) {
  keel_cbq_t *q = calloc(1, sizeof(*q));
  if (q == NULL) return NULL;
  keel_job_init(&q->job, cbq_drain, KEEL_JOB_NORMAL | KEEL_JOB_BLOCKING);
  q->job.on_cancel = cbq_drain; /* sched shutting down: run them in its thread */
  pthread_mutex_init(&q->mu, NULL);
  CDS_INIT_LIST_HEAD(&q->batches);
  return q;
}

void _keel_cbq_destroy(keel_cbq_t *q) {
  for (;;) {
    pthread_mutex_lock(&q->mu);
    bool busy = q->scheduled;
    pthread_mutex_unlock(&q->mu);
    if (!busy) break;
    sched_yield();
  }
  pthread_mutex_destroy(&q->mu);
  free(q);
}
