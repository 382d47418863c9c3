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
#define KEEL_LS_PROBING 0x6c737062u /* a release looks for locks: a request vetoes it, goes on */
#define KEEL_LS_VETOED  0x6c737076u /* ...and one did: that release will say KEEL_EBUSY */

/* One armed resource in the timer's heap. */
typedef struct keel_timer_ent {
  uint64_t deadline_ns; /* the earliest deadline of res's timed asynchronous requests */
  keel_res_t *res;      /* holds a table reference and one count in res->nlkb */
  size_t slot;          /* where the index records this entry's heap position */
} keel_timer_ent_t;

/* Timeouts of asynchronous requests (blocking ones time their own waits).
 *
 * At most one entry per resource: a resource is armed while it may have a
 * timed asynchronous request pending, for the earliest deadline among them.
 * Entries sit in a binary min-heap by deadline, and an index (open addressing
 * by resource address, linear probing, at most half full) maps a resource to
 * its heap position, so that an entry can be taken out before it is due. Both
 * are under mu; lock order: res->mu, then mu.
 *
 * Invariants:
 *  - an armed resource holds a table reference of its own and counts one in
 *    res->nlkb (as if it were an lkb), from the moment it is pushed until the
 *    pass that takes it out or a disarm; an entry popped by the thread
 *    ("in flight") keeps both until that thread's pass ends;
 *  - nlkb counts only lkbs and timer entries, and every attached lkb is on a
 *    queue whenever res->mu is free, or released and waiting for the BASTs
 *    it is owed (lock.c), so "nlkb == 1 with every queue empty" means that
 *    the one count left is a timer entry's or such an lkb's: the disarm
 *    finds the entry in the heap, or leaves the count alone
 *    (see __keel_dir_detach). Then the entry is taken out
 *    of the heap at once and its reference dropped, so an unused resource is
 *    never pinned by a timeout that can no longer fire;
 *  - while the resource has locks the entry may outlive the request that armed
 *    it (granted or cancelled: nothing tells the timer); the pass at its
 *    deadline finds nothing to expire and re-arms for the next timed request
 *    pending, if any. That costs one entry per resource with locks held, never
 *    one per request, so the heap is bounded by the live resources;
 *  - a forced release stops the timer first: timer_stop drops each entry
 *    left, its count and its reference, before the locks are cancelled.
 * A pass (timer_fire) cancels the resource's requests past their deadline
 * with KEEL_ETIMEDOUT under res->mu, hence within the clock's and the
 * thread's wake-up resolution. The lkbs are never pointed to: they may be
 * granted and freed at any time. */
typedef struct keel_ls_timer {
  pthread_mutex_t mu;
  pthread_cond_t cv;      /* CLOCK_MONOTONIC */
  keel_timer_ent_t *heap; /* n entries used of cap */
  size_t n, cap;
  size_t *index;    /* heap position + 1 by resource address, 0: free slot */
  size_t index_cap; /* power of two >= 2 n, or 0 */
  bool started, stop, joined;
  pthread_t thread;
} keel_ls_timer_t;

struct keel_lockspace {
  uint32_t magic;         /* KEEL_LS_MAGIC while live */
  uint32_t sleepers;      /* atomic: threads in a blocking wait (release waits for them) */
  uint32_t shrinkers;     /* atomic: keel_lockspace_shrink calls under way (release waits) */
  keel_table_t *table;    /* NULL once released */
  keel_ls_timer_t *timer; /* allocated on first timed asynchronous request */
  keel_cbq_t *cbq;        /* KEEL_LOCKSPACE_SCHED: callbacks go here; NULL: inline */
  pthread_mutex_t timer_once;
};

/* Whether calls may go on: the lockspace is live, or a non-forced release
 * is only looking for locks (keel_lockspace_release). */
KEEL_INLINE bool _keel_ls_open(uint32_t magic) {
  return magic == KEEL_LS_MAGIC || magic == KEEL_LS_PROBING || magic == KEEL_LS_VETOED;
}

/* 0, or KEEL_EINVAL (NULL) / KEEL_ESHUTDOWN (released or being released). */
KEEL_INLINE int _keel_ls_check(const keel_lockspace_t *ls) {
  if (keel_unlikely(ls == NULL)) return KEEL_EINVAL;
  uint32_t m = __atomic_load_n(&ls->magic, __ATOMIC_RELAXED);
  if (keel_unlikely(m != KEEL_LS_MAGIC) && !_keel_ls_open(m)) return KEEL_ESHUTDOWN;
  return 0;
}

/* A request that found the lockspace not live after attaching to its
 * resource (res->mu held): 0 if it may go on, having vetoed a probing
 * release; else (the release went ahead) KEEL_ESHUTDOWN. */
int _keel_ls_veto(keel_lockspace_t *ls) KEEL_HIDDEN;

/* Resource references. The resources' table counts references with an atomic
 * per entry; bumping it for every lock would make two extra atomic operations
 * on a shared line per lock and unlock by name. Instead a resource counts its
 * lkbs (and its armed timer entry, see keel_ls_timer) in res->nlkb under
 * res->mu (which those paths take anyway) and holds a single table reference
 * while nlkb > 0: taken on 0 -> 1, dropped (outside the mutex) after 1 -> 0.
 * A lookup that finds nlkb == 0 takes the reference with keel_table_ref,
 * which fails only if the table dropped the resource meanwhile; the lookup
 * then retries and creates a new one. The lookup, the mutex acquisition and
 * that check run in one RCU read-side section, so the memory stays valid
 * throughout (no grace period is ever awaited under res->mu, so blocking on
 * it there cannot stall a grace period's waiter). */

/* Finds or creates the resource named name and attaches one lkb to it:
 * returns it with res->mu held and nlkb counting the caller. NULL if out of
 * memory. Lock-free lookup; allocates on first use. */
keel_res_t *_keel_dir_attach(keel_lockspace_t *ls, const void *name, size_t namelen) KEEL_HIDDEN;

/* Takes res's timer entry out of the heap if it is there (not in flight on
 * the timer thread), dropping its reference and its count, the last one in
 * nlkb: true if it did. res->mu held, nlkb == 1 and every queue empty. */
bool __keel_ls_timer_disarm(keel_res_t *res) KEEL_HIDDEN;

/* Detaches one lkb (res->mu held). True if it was the last: the caller calls
 * _keel_dir_put(res) once it has unlocked res->mu. One count left with every
 * queue empty is an armed timer entry's (see keel_ls_timer): it goes too, so
 * that the resource is released now rather than at the deadline. Without
 * timers that test is one compare that fails or a queue head that is set. */
KEEL_INLINE bool __keel_dir_detach(keel_res_t *res) {
  KEEL_ASSERT(res->nlkb > 0);
  uint32_t n = --res->nlkb;
  if (n == 1 && keel_unlikely(__keel_res_unused(res))) return __keel_ls_timer_disarm(res);
  return n == 0;
}

/* Drops a table reference: the one the last detach leaves, or a timer
 * entry's (taken with keel_table_ref). */
void _keel_dir_put(keel_res_t *res) KEEL_HIDDEN;

/* Arms lkb's resource for lkb's deadline, unless it is armed for an earlier
 * one (res->mu held; lkb waits, has an AST and KEEL_LOCK_TIMEOUT). Starts the
 * timer thread on first use. Aborts if out of memory: a timeout that silently
 * never fires is worse. */
void _keel_ls_timer_add(keel_lockspace_t *ls, keel_lkb_t *lkb) KEEL_HIDDEN;

/* Frees an lkb that is on no queue and was detached from its resource. */
void _keel_lkb_free(keel_lkb_t *lkb) KEEL_HIDDEN;

/* The end of every path that detached an lkb (res->mu released): frees it
 * when `free_it`, then, when its detach was res's `last`, drops the table
 * reference that kept res, so res outlives every lkb that points at it. */
KEEL_INLINE void _keel_lkb_retire(keel_res_t *res, keel_lkb_t *lkb, bool free_it, bool last) {
  if (free_it) _keel_lkb_free(lkb);
  if (last) _keel_dir_put(res);
}

/* Drops one of lkb's counts in basts (res->mu held): true if lkb is now to
 * be freed (released, nothing owed any more), with *last telling whether
 * that detaches res's last lock. The last BAST delivery, a keel_unlock that
 * waited, and a forced release's hold all end this way. */
KEEL_INLINE bool __keel_lkb_unowe(keel_res_t *res, keel_lkb_t *lkb, bool *last) {
  if (--lkb->basts != 0 || !lkb->released) return false;
  *last = __keel_dir_detach(res);
  return true;
}

/* keel_lock_convert with the option of replacing ast, bast and arg once the
 * conversion is accepted (keel_lock with KEEL_LOCK_CONVERT; cb NULL: keep). */
int _keel_lock_convert(keel_lksb_t *lksb, int mode, unsigned flags,
                       const keel_lock_cbs_t *cb) KEEL_HIDDEN;

#endif /* KEEL_LOCK_LOCKSPACE_H */
