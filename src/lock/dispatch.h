/* Callback delivery for the lock manager.
 *
 * State changes happen under a resource's mutex; callbacks must not (an AST
 * may call back into the lock manager, and a user callback of unknown length
 * must not stall every other user of the resource). So a state change appends
 * a delivery to a keel_dispatch_t on the caller's stack, and the caller runs
 * _keel_dispatch() after unlocking. An AST delivery copies the function and
 * argument, so it stays valid if the lkb is freed in between (e.g. its owner
 * unlocks it from another thread as soon as it sees lksb->status). A BAST is
 * unsolicited, so its owner cannot know when it has been delivered: it keeps
 * the lkb alive instead (lkb->basts), and is dropped if the lock is unlocked
 * before it runs; keel_unlock waits for one running on another thread. After
 * keel_unlock returns no callback of that lock runs but its own ASTs (which
 * the owner waits for anyway), so the owner may free arg.
 *
 * Where callbacks run. By default inline: _keel_dispatch_run calls them on the
 * calling thread, in the order they were queued (grant order). A lockspace
 * created with KEEL_LOCKSPACE_SCHED has a callback queue (keel_cbq_t): the
 * ASTs and BASTs of each call are posted to it as one batch, and one keel
 * sched job at a time drains it, so a lockspace's callbacks run on sched
 * workers, one at a time, batches in posting order. Wakes of blocked callers
 * are never posted: they are a system call, not user code.
 */
#ifndef KEEL_LOCK_DISPATCH_H
#define KEEL_LOCK_DISPATCH_H

#include <keel/lock.h>

#include "base/common.h"

enum keel_delivery_kind { KEEL_DELIVER_AST, KEEL_DELIVER_BAST, KEEL_DELIVER_WAKE };

typedef struct keel_delivery {
  uint8_t kind; /* enum keel_delivery_kind */
  int8_t mode;  /* BAST: the blocked request's mode */
  union {
    keel_lock_ast_t ast;
    keel_lkb_t *bast; /* BAST: the lock; counted in its basts until delivered */
    uint32_t *wake; /* WAKE: futex word of a blocked caller; may be freed by now (see dispatch.c) */
  } fn;
  void *arg; /* AST only */
} keel_delivery_t;

/* Deliveries fitting in the inline array cost no allocation; a grant pass that
 * wakes more (a writer releasing before many readers) spills to the heap. */
#define KEEL_DISPATCH_INLINE 8

/* A lockspace's callback queue on keel's sched (dispatch.c); NULL: inline. */
typedef struct keel_cbq keel_cbq_t;

typedef struct keel_dispatch {
  uint32_t n, cap;
  keel_cbq_t *q;      /* where ASTs and BASTs go; NULL: run inline */
  keel_delivery_t *v; /* == inl until it spills */
  keel_delivery_t inl[KEEL_DISPATCH_INLINE];
} keel_dispatch_t;

KEEL_INLINE void keel_dispatch_init(keel_dispatch_t *d, keel_cbq_t *q) {
  d->n = 0;
  d->cap = KEEL_DISPATCH_INLINE;
  d->q = q;
  d->v = d->inl;
}

/* Appends a delivery (under the resource mutex). Aborts only if the heap is
 * exhausted while spilling: a lost grant notification would hang its waiter. */
void _keel_dispatch_push(keel_dispatch_t *d, const keel_delivery_t *e) KEEL_HIDDEN;

/* Runs (or posts) and clears the deliveries, in order; call with no resource
 * locked. */
void _keel_dispatch_run(keel_dispatch_t *d) KEEL_HIDDEN;

/* A callback queue for a lockspace (NULL, errno ENOMEM); allocates. */
keel_cbq_t *_keel_cbq_create(void) KEEL_HIDDEN;

/* Waits until every batch posted to q has run, then frees q. Blocks; must not
 * run on a callback of q (it would wait for itself). */
void _keel_cbq_destroy(keel_cbq_t *q) KEEL_HIDDEN;

KEEL_INLINE void keel_dispatch(keel_dispatch_t *d) {
  if (keel_unlikely(d->n != 0)) _keel_dispatch_run(d);
}

#endif /* KEEL_LOCK_DISPATCH_H */
