/* fork(2) and the pool: the child starts a fresh one.
 *
 * fork copies the memory but only the forking thread: in the child no
 * worker, monitor or other producer exists, while the copied state still
 * lists them, holds their jobs and may hold their locks (joining those
 * threads crashed the child; a lock one of them held hung it). The prepare
 * handler takes sched's locks in their order (sched.lock, every worker's
 * tlock, prod_lock, idle_lock: see sched_int.h), so that no thread that
 * will be gone holds one at the fork; the parent releases them; the child
 * resets the pool (sched.h says what the child gets):
 *  - RUNNING becomes UNINIT (the child's first call starts its own pool,
 *    with the parent's configuration), and so does STARTING (an init in
 *    another thread was creating threads, with that configuration, and had
 *    accepted nothing); STOPPING becomes SHUTDOWN (submits were already
 *    failing), UNINIT and SHUTDOWN stay;
 *  - queues, levels, worker lists, the producer registry and the
 *    statistics start empty; the parent's worker structs are freed, but for
 *    the forking thread's own if it is a worker (the job that forked is on
 *    its stack; the child ends when that job returns: _keel_sched_forked_exit);
 *  - clients that held the parent's jobs (on a level's ring, owning a timer,
 *    or with a fired timer on its way) are emptied, so the child can use and
 *    destroy them; a client job behind a half-linked enqueue stays counted;
 *  - the parent's jobs stay the parent's: their copies in the child are
 *    neither run nor cancelled, and keep the state they had.
 * life_lock is not taken in prepare: a shutdown holds it while it waits for
 * jobs to end, and a job may fork. The child initialises it afresh, unless
 * the forking thread holds it (a fork from an on_cancel that shutdown
 * runs; init runs none, nor any other code of the caller's): that call
 * then finishes on the child's empty pool, its remaining notices being the
 * parent's (fork_gen stops them), and releases it as usual.
 */
#include <stdlib.h>

#include "sched/sched_int.h"

#define DEFAULT_CLIENT (&_keel_sched_default_client)

static void fork_prepare(void) {
  sched_t *s = &_keel_sched;
  pthread_mutex_lock(&s->lock);
  sched_worker_t *w;
  cds_list_for_each_entry(w, &s->workers, link) pthread_mutex_lock(&w->tlock);
  cds_list_for_each_entry(w, &s->zombies, link) pthread_mutex_lock(&w->tlock);
  _keel_sched_gate_atfork_prepare();
  pthread_mutex_lock(&s->idle_lock);
}

static void fork_parent(void) {
  sched_t *s = &_keel_sched;
  pthread_mutex_unlock(&s->idle_lock);
  _keel_sched_gate_atfork_parent();
  sched_worker_t *w;
  cds_list_for_each_entry(w, &s->zombies, link) pthread_mutex_unlock(&w->tlock);
  cds_list_for_each_entry(w, &s->workers, link) pthread_mutex_unlock(&w->tlock);
  pthread_mutex_unlock(&s->lock);
}

/* Level p's part of each client on its ring (other levels have their own
 * rings, walked in turn; resetting a whole client here would cut them). */
static void empty_ring(unsigned p) {
  struct keel_sched_client *c, *next;
  cds_list_for_each_entry_safe(c, next, &_keel_sched.levels[p].ring, ring[p]) {
    CDS_INIT_LIST_HEAD(&c->q[p]);
    CDS_INIT_LIST_HEAD(&c->ring[p]);
    c->n[p] = c->used[p] = 0;
    c->in_ring[p] = false;
  }
}

static void untime(keel_job_t *job) {
  if (job->client != NULL) atomic_store(&job->client->ntimers, 0);
}

/* Fired client timers not yet placed (SCHED_FIRED), as far as the links
 * go: a node a gone producer had not linked yet ends the walk. */
static void untime_queue(struct __cds_wfcq_head *h) {
  for (struct cds_wfcq_node *n = h->node.next; n != NULL; n = n->next) {
    keel_job_t *job = _keel_node_job(n);
    if (job->_l[1] == SCHED_FIRED) untime(job);
  }
}

/* Frees the parent's workers on `list` (their threads are gone), but for
 * the forking thread's own, which is left with an empty heap. */
static void drop_workers(struct cds_list_head *list, sched_worker_t *self) {
  sched_worker_t *w, *next;
  cds_list_for_each_entry_safe(w, next, list, link) {
    for (uint32_t i = 0; i < w->nheap; i++) untime(w->heap[i]);
    pthread_mutex_unlock(&w->tlock);
    if (w != self) {
      _keel_sched_worker_free(w);
      continue;
    }
    w->nheap = 0;
    for (int p = 0; p < PRIO_COUNT; p++) w->ntimer[p] = 0;
    atomic_store(&w->next_deadline, UINT64_MAX);
  }
}

static void fork_child(void) {
  sched_t *s = &_keel_sched;
  pthread_mutex_unlock(&s->idle_lock);
  _keel_sched_gate_atfork_child();
  for (unsigned p = 0; p < PRIO_COUNT; p++) empty_ring(p);
  for (unsigned i = 0; i < SCHED_SHARDS; i++) {
    untime_queue(&s->in[i].head2);
    untime_queue(&s->stage2[i].head);
  }
  drop_workers(&s->workers, _keel_sched_self);
  drop_workers(&s->zombies, _keel_sched_self);
  _keel_sched_reset_queues();
  s->spawned = s->retired = s->wakeups = 0;
  for (int p = 0; p < PRIO_COUNT; p++) {
    s->run_retired[p] = 0;
    atomic_store(&s->cancelled[p], 0);
  }
  s->monitor_started = false;
  atomic_store(&s->mon_mode, MON_INF);
  atomic_store(&s->mon_wake_ns, UINT64_MAX);
  atomic_store(&s->nspinning, 0);
  s->last_spawn_ns = 0;
  int st = atomic_load(&s->state);
  if (st == SCHED_RUNNING || st == SCHED_STARTING) {
    s->cfg_inherited = true;
    atomic_store(&s->state, SCHED_UNINIT);
  } else if (st == SCHED_STOPPING) {
    atomic_store(&s->state, SCHED_SHUTDOWN);
  }
  s->fork_gen++;
  _keel_sched_self = NULL;        /* a job that forked may use the child's pool */
  _keel_sched_on_monitor = false; /* so may an on_cancel the monitor ran */
  pthread_mutex_unlock(&s->lock);
  if (!_keel_sched_in_life()) pthread_mutex_init(&s->life_lock, NULL);
}

/* The child's end, in its copy of a worker whose job forked (once that job
 * has returned) or of the monitor whose on_cancel did. That thread's start
 * routine is a copy of the parent's loop with nothing of the child's left
 * to do; returning from it ended the child only if it was the child's last
 * thread, and a pool the child had started kept it alive for good (review
 * repro g_child_lingers). So the child's own pool, if any, drains and is
 * joined (this thread is none of its workers and holds no life_lock: no
 * KEEL_EDEADLK), then exit(0), which glibc also calls when a process's last
 * thread returns: atexit handlers run, as sched.h says. */
void _keel_sched_forked_exit(void) {
  keel_sched_shutdown(KEEL_SCHED_DRAIN);
  exit(0);
}

static void fork_handlers(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* Called by every public entry point that takes a lock (and by a thread's
 * first submit, _keel_sched_register) before it takes any: a fork by
 * another thread while the first call of the process held life_lock or
 * sched.lock with no handler registered left the child that lock held and
 * its queues the parent's (its first submit hung). Registered here, the
 * child reinitialises life_lock, and prepare keeps the others from being
 * held at the fork. After the first call, pthread_once is a load and a
 * branch. A constructor would not do: nothing else in this file is
 * referenced, so a static link would leave it out. */
void _keel_sched_atfork_once(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, fork_handlers);
}
