/* The producer gate: how shutdown knows that no submit is half done, with no
 * fence or locked instruction on the submit path.
 *
 * Each thread that submits has a record in its TLS, registered once (the
 * first submit takes a mutex and arms a thread-exit hook; no allocation).
 * A submit raises `active`, reads the pool state, does its enqueue, counts
 * it in `submitted` and lowers `active`. Between the store of `active` and
 * the load of `state` there is only a compiler barrier: shutdown pays for the
 * ordering instead, with membarrier(2) (MEMBARRIER_CMD_PRIVATE_EXPEDITED),
 * which runs a full barrier on every CPU running a thread of this process.
 * After shutdown's store of STOPPING and the membarrier, every producer
 * either has its `active` store visible to shutdown (which then waits for it
 * to finish) or reads STOPPING and gives up. This is the argument of
 * liburcu's memb flavour; keel does not use liburcu's registry itself because
 * the application (or keel's other modules) may register the same threads.
 * Where membarrier is missing (and under TSan, which cannot see it),
 * producers raise `active` with a seq_cst exchange instead.
 *
 * `submitted` (per priority) is written only by its owner (load+store, no lock prefix);
 * readers sum the registry under prod_lock; a record folds its count into
 * `exited` when its thread ends.
 */
#define _GNU_SOURCE
#include <linux/membarrier.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/tls.h"
#include "sched/sched_int.h"

__thread sched_producer_t _keel_sched_me;

static pthread_mutex_t prod_lock = PTHREAD_MUTEX_INITIALIZER;
static CDS_LIST_HEAD(producers);
static int64_t exited[PRIO_COUNT]; /* submits counted by threads that have ended (prod_lock) */
int _keel_sched_fence_needed = 1;

static void producer_exit(void *arg) {
  sched_producer_t *me = arg;
  pthread_mutex_lock(&prod_lock);
  for (int p = 0; p < PRIO_COUNT; p++) exited[p] += keel_load_relaxed(&me->submitted[p]);
  cds_list_del(&me->link);
  me->registered = false;
  pthread_mutex_unlock(&prod_lock);
}

/* First submit of this thread. KEEL_EAGAIN if no thread-exit hook can be
 * armed (the process ran out of pthread keys): the record would dangle. */
KEEL_NOINLINE int _keel_sched_register(void) {
  sched_producer_t *me = &_keel_sched_me;
  me->hook.fn = producer_exit;
  me->hook.arg = me;
  int rc = _keel_thread_hook_arm(&me->hook);
  if (rc != 0) return rc;
  _keel_sched_atfork_once();
  pthread_mutex_lock(&prod_lock);
  static unsigned next_shard; /* (prod_lock) */
  me->shard = next_shard++ % SCHED_SHARDS;
  cds_list_add(&me->link, &producers);
  me->registered = true;
  pthread_mutex_unlock(&prod_lock);
  return 0;
}

/* Once per init: membarrier needs a registration before its expedited use. */
void _keel_sched_gate_init(void) {
  long q = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  bool ok = q > 0 && (q & MEMBARRIER_CMD_PRIVATE_EXPEDITED) &&
            syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
#if defined(KEEL_TSAN)
  ok = false; /* TSan models the seq_cst exchange, not an IPI barrier */
#endif
  __atomic_store_n(&_keel_sched_fence_needed, ok ? 0 : 1, __ATOMIC_RELAXED);
}

/* After state = STOPPING: returns once no submit is between its gate and
 * its count. The acquire loads of `active` make every counted submit
 * visible to the caller (and, through its later release, to the workers). */
void _keel_sched_gate_close(void) {
  if (!__atomic_load_n(&_keel_sched_fence_needed, __ATOMIC_RELAXED))
    syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0);
  pthread_mutex_lock(&prod_lock);
  sched_producer_t *p;
  cds_list_for_each_entry(p, &producers, link) {
    while (atomic_load(&p->active)) sched_yield(); /* seq_cst: see gate_enter */
  }
  pthread_mutex_unlock(&prod_lock);
}

void _keel_sched_gate_atfork_prepare(void) {
  pthread_mutex_lock(&prod_lock);
}

void _keel_sched_gate_atfork_parent(void) {
  pthread_mutex_unlock(&prod_lock);
}

/* The child has one thread, the forking one: every other record on the
 * registry belongs to a thread that is gone (its TLS is a dead copy whose
 * exit hook never runs), so the registry keeps this thread's alone, and
 * its counts start at 0 with the child's pool (no submit is half done:
 * the forking thread is in fork, not in a submit). */
void _keel_sched_gate_atfork_child(void) {
  sched_producer_t *me = &_keel_sched_me;
  CDS_INIT_LIST_HEAD(&producers);
  for (int p = 0; p < PRIO_COUNT; p++) {
    exited[p] = 0;
    keel_store_relaxed(&me->submitted[p], 0);
  }
  if (me->registered) cds_list_add(&me->link, &producers);
  pthread_mutex_unlock(&prod_lock);
}

/* The total; by_prio (may be NULL) gets the counts per priority. */
int64_t _keel_sched_submitted(int64_t by_prio[PRIO_COUNT]) {
  int64_t n[PRIO_COUNT];
  pthread_mutex_lock(&prod_lock);
  for (int i = 0; i < PRIO_COUNT; i++) n[i] = exited[i];
  sched_producer_t *p;
  cds_list_for_each_entry(p, &producers, link) for (int i = 0; i < PRIO_COUNT; i++) n[i] +=
      keel_load_relaxed(&p->submitted[i]);
  pthread_mutex_unlock(&prod_lock);
  int64_t total = 0;
  for (int i = 0; i < PRIO_COUNT; i++) {
    total += n[i];
    if (by_prio != NULL) by_prio[i] = n[i];
  }
  return total;
}
