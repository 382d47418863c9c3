/* Lockspaces: the resource directory (a keel table of keel_res), the timer
 * that expires asynchronous requests with KEEL_LOCK_TIMEOUT, and the checks
 * that turn use after release into KEEL_ESHUTDOWN. Never installed. */
#ifndef KEEL_LOCK_LOCKSPACE_H
#define KEEL_LOCK_LOCKSPACE_H

#include <pthread.h>

#include "lock_internal.h"

#define KEEL_LS_MAGIC   0x6c73706bu /* "lspk": live lockspace */
#define KEEL_LS_DEAD    0x6c736464u /* released (header kept, see lockspace.c) */
#define KEEL_LS_CLOSING 0x6c73636cu /* being released: new requests get KEEL_ESHUTDOWN */

typedef struct keel_timer_ent {
  uint64_t deadline_ns;
  keel_res_t *res; /* referenced while queued */
} keel_timer_ent_t;

/* Timeouts of asynchronous requests (blocking ones time their own waits). A
 * binary min-heap of (deadline, resource) under tmu; the thread is started on
 * first use. An entry holds a reference on its resource, never a pointer to
 * the lkb, which may be granted and freed meanwhile: on expiry the thread
 * scans that resource's queues for requests past their deadline. */
typedef struct keel_ls_timer {
  pthread_mutex_t mu;
  pthread_cond_t cv; /* CLOCK_MONOTONIC */
  keel_timer_ent_t *heap;
  size_t n, cap;
  bool started, stop;
  pthread_t thread;
} keel_ls_timer_t;

struct keel_lockspace {
  uint32_t magic;         /* KEEL_LS_MAGIC while live */
  uint32_t sleepers;      /* atomic: threads in a blocking wait (release waits for them) */
  keel_table_t *table;    /* NULL once released */
  keel_ls_timer_t *timer; /* allocated on first timed asynchronous request */
  keel_cbq_t *cbq;        /* KEEL_LOCKSPACE_SCHED: callbacks go here; NULL: inline */
  pthread_mutex_t timer_once;
};

/* 0, or KEEL_EINVAL (NULL) / KEEL_ESHUTDOWN (released). */
KEEL_INLINE int _keel_ls_check(const keel_lockspace_t *ls) {
  if (keel_unlikely(ls == NULL)) return KEEL_EINVAL;
  if (keel_unlikely(__atomic_load_n(&ls->magic, __ATOMIC_RELAXED) != KEEL_LS_MAGIC))
    return KEEL_ESHUTDOWN;
  return 0;
}

/* Resource references. The resources' table counts references with an atomic
 * per entry; bumping it for every lock would make two extra atomic operations
 * on a shared line per lock and unlock by name. Instead a resource counts its
 * lkbs in res->nlkb under res->mu (which those paths take anyway) and holds a
 * single table reference while nlkb > 0: taken on 0 -> 1, dropped (outside
 * the mutex) after 1 -> 0. A lookup that finds nlkb == 0 takes the reference
 * with keel_table_ref, which fails only if the table dropped the resource
 * meanwhile; the lookup then retries and creates a new one. The lookup, the
 * mutex acquisition and that check run in one RCU read-side section, so the
 * memory stays valid throughout (no grace period is ever awaited under
 * res->mu, so blocking on it there cannot stall a grace period's waiter). */

/* Finds or creates the resource named name and attaches one lkb to it:
 * returns it with res->mu held and nlkb counting the caller. NULL if out of
 * memory. Lock-free lookup; allocates on first use. */
keel_res_t *_keel_dir_attach(keel_lockspace_t *ls, const void *name, size_t namelen) KEEL_HIDDEN;

/* Detaches one lkb (res->mu held). True if it was the last: the caller calls
 * _keel_dir_put(res) once it has unlocked res->mu. */
KEEL_INLINE bool __keel_dir_detach(keel_res_t *res) {
  KEEL_ASSERT(res->nlkb > 0);
  return --res->nlkb == 0;
}

/* Drops a table reference: the one the last detach leaves, or one taken with
 * keel_table_ref (the timer's). */
void _keel_dir_put(keel_res_t *res) KEEL_HIDDEN;

/* Queues an expiry check of lkb's deadline (res->mu held; lkb has an AST).
 * Aborts if out of memory: a timeout that silently never fires is worse. */
void _keel_ls_timer_add(keel_lockspace_t *ls, keel_lkb_t *lkb) KEEL_HIDDEN;

/* Frees an lkb that is on no queue and was detached from its resource. */
void _keel_lkb_free(keel_lkb_t *lkb) KEEL_HIDDEN;

/* keel_lock_convert with the option of replacing ast, bast and arg once the
 * conversion is accepted (keel_lock with KEEL_LOCK_CONVERT; cb NULL: keep). */
int _keel_lock_convert(keel_lksb_t *lksb, int mode, unsigned flags,
                       const keel_lock_cbs_t *cb) KEEL_HIDDEN;

#endif /* KEEL_LOCK_LOCKSPACE_H */
