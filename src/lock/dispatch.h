/* Callback delivery for the lock manager.
 *
 * State changes happen under a resource's mutex; callbacks must not (an AST
 * may call back into the lock manager, and a user callback of unknown length
 * must not stall every other user of the resource). So a state change appends
 * a delivery to a keel_dispatch_t on the caller's stack, and the caller runs
 * _keel_dispatch() after unlocking. A delivery copies the function and
 * argument, so it stays valid if the lkb is freed in between (e.g. its owner
 * unlocks it from another thread as soon as it sees lksb->status).
 *
 * Where callbacks run: keel's scheduler (branch sched) is not in this build,
 * so _keel_dispatch runs them inline on the calling thread, in the order they
 * were queued (grant order). This is the one function to change to post them
 * to the scheduler instead.
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
    keel_lock_bast_t bast;
    uint32_t *wake; /* WAKE: futex word of a blocked caller; may be freed by now (see dispatch.c) */
  } fn;
  void *arg;
} keel_delivery_t;

/* Deliveries fitting in the inline array cost no allocation; a grant pass that
 * wakes more (a writer releasing before many readers) spills to the heap. */
#define KEEL_DISPATCH_INLINE 8

typedef struct keel_dispatch {
  uint32_t n, cap;
  keel_delivery_t *v; /* == inl until it spills */
  keel_delivery_t inl[KEEL_DISPATCH_INLINE];
} keel_dispatch_t;

KEEL_INLINE void keel_dispatch_init(keel_dispatch_t *d) {
  d->n = 0;
  d->cap = KEEL_DISPATCH_INLINE;
  d->v = d->inl;
}

/* Appends a delivery (under the resource mutex). Aborts only if the heap is
 * exhausted while spilling: a lost grant notification would hang its waiter. */
void _keel_dispatch_push(keel_dispatch_t *d, const keel_delivery_t *e) KEEL_HIDDEN;

/* Runs and clears the deliveries, in order; call with no resource locked. */
void _keel_dispatch_run(keel_dispatch_t *d) KEEL_HIDDEN;

KEEL_INLINE void keel_dispatch(keel_dispatch_t *d) {
  if (keel_unlikely(d->n != 0)) _keel_dispatch_run(d);
}

#endif /* KEEL_LOCK_DISPATCH_H */
