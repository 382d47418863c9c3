/* The lock manager's internal structures. Never installed.
 *
 * Objects and who owns them:
 *   keel_lockspace  - the handle; a table of resources (dir.c).
 *   keel_res        - one named resource: its queues, granted-mode counts and
 *                     value block, all under res->mu. Each lkb attached to it
 *                     holds one table reference; at zero references the table
 *                     keeps it on its LRU until it is dropped (cache limit or
 *                     keel_lockspace_shrink) and freed after an RCU grace period.
 *   keel_lkb        - one lock; lives from keel_lock until it is unlocked or its
 *                     new request fails or is cancelled. Pointed to by lksb->lock
 *                     once granted or queued: a request that fails at once is
 *                     never published (lock.c, keel_lock).
 *
 * Naming: __keel_res_x() runs with res->mu held by the caller.
 */
#ifndef KEEL_LOCK_INTERNAL_H
#define KEEL_LOCK_INTERNAL_H

#include <keel/lock.h>
#include <keel/table.h>
#include <urcu/list.h>

#include "base/common.h"
#include "dispatch.h"
#include "mutex.h"

/* Compatibility as bit masks: bit m of keel_lock_compat_mask[r] is set iff a
 * lock in mode m may be held while one in mode r is granted. */
extern const uint8_t _keel_lock_compat_mask[KEEL_LOCK_MODES] KEEL_HIDDEN;

KEEL_INLINE bool keel_mode_valid(int mode) {
  return (unsigned)mode < KEEL_LOCK_MODES;
}

/* <urcu/list.h> lacks a const empty test and move-to-tail. */
KEEL_INLINE bool keel_q_empty(const struct cds_list_head *h) {
  return h->next == h;
}
KEEL_INLINE void keel_q_move_tail(struct cds_list_head *e, struct cds_list_head *h) {
  cds_list_del(e);
  cds_list_add_tail(e, h);
}

enum keel_lkb_queue { KEEL_Q_NONE = 0, KEEL_Q_GRANT, KEEL_Q_CONVERT, KEEL_Q_WAIT };

#define KEEL_LKB_MAGIC 0x6c6b6231u /* "lkb1": live lock */
#define KEEL_LKB_DEAD  0xdeadb10cu /* stored when an lkb is freed */

typedef struct keel_res keel_res_t;

/* A lock. Invariants (under res->mu):
 *   basts counts the BAST deliveries pushed for it that have not finished;
 *   while basts > 0 it is not freed and stays attached to res (nlkb counts
 *   it), and once released a delivery calls nothing (lock.c, _keel_lkb_bast)
 *   queue == GRANT    <=> gr >= 0 && rq < 0       (granted, nothing pending)
 *   queue == CONVERT  <=> gr >= 0 && rq >= 0      (granted gr, waiting for rq)
 *   queue == WAIT     <=> gr < 0  && rq >= 0      (new request, holds nothing)
 * and every lkb with gr >= 0 is counted once in res->granted[gr]. */
struct keel_lkb {
  /* First, so that the magic lies past the 16 bytes that glibc's (and most
   * allocators') free lists overwrite: a stale handle then usually still
   * reads KEEL_LKB_DEAD and the abort can say "already released". */
  struct cds_list_head q; /* link in res's grant, convert or wait queue */
  uint32_t magic;         /* KEEL_LKB_MAGIC while the lkb exists */
  int8_t gr;              /* granted mode, -1 if none */
  int8_t rq;              /* requested mode while a request waits, else -1 */
  uint8_t queue;          /* enum keel_lkb_queue */
  int8_t bast_mode;       /* highest mode BASTed since the last grant, -1 none */
  unsigned flags;         /* flags of the request in progress */
  uint32_t wake;          /* blocking request's futex word: 0 pending, 2 asleep, 1 done */
  uint32_t basts;         /* BAST deliveries owed (and unlockers waiting): keep it alive */
  bool released;          /* unlocked while basts > 0: the last of them frees it */
  uint8_t bast_waiters;   /* keel_unlock calls waiting for running BASTs to return */
  uint16_t bast_running;  /* its BASTs running now, on any threads */
  uint32_t bast_seq;      /* futex word: bumped when a BAST returns while someone waits */
  keel_res_t *res;        /* the resource; the lkb holds a reference on it */
  keel_lksb_t *lksb;      /* the owner's status block */
  keel_lock_ast_t ast;    /* NULL: requests block the caller */
  keel_lock_bast_t bast;  /* may be NULL */
  void *arg;              /* for ast and bast */
  uint64_t deadline_ns;   /* keel_clock_ns() deadline with KEEL_LOCK_TIMEOUT */
};

/* A resource. Invariant: granted[m] = number of lkbs on the grant and convert
 * queues with gr == m; gmask bit m is set iff granted[m] > 0. The grant queue
 * is in grant order; the convert and wait queues in request order. */
struct keel_res {
  keel_table_node_t node; /* in ls's table; key = name */
  keel_lockspace_t *ls;   /* constant */
  keel_mutex_t mu;        /* guards everything below but name */
  uint8_t gmask;          /* modes with granted[m] > 0 */
  uint8_t namelen;        /* bytes in name */
  bool release_held;      /* a forced release counts itself in nlkb (lockspace.c) */
  uint32_t nlkb;          /* lkbs attached; > 0 => one table reference held */
  uint32_t granted[KEEL_LOCK_MODES];
  struct cds_list_head grantq;    /* granted, nothing pending */
  struct cds_list_head convertq;  /* granted, converting: FIFO */
  struct cds_list_head waitq;     /* new requests: FIFO */
  uint8_t lvb[KEEL_LOCK_LVB_LEN]; /* the value block (zero until written) */
  char name[];                    /* namelen bytes, not NUL-terminated */
};

/* Initialises a resource named name (namelen <= KEEL_LOCK_NAME_MAX) and its
 * table node (the key points at res->name). */
void _keel_res_init(keel_res_t *res, const void *name, size_t namelen) KEEL_HIDDEN;

/* True if no lock is attached to res (all queues empty). */
KEEL_INLINE bool __keel_res_unused(const keel_res_t *res) {
  return keel_q_empty(&res->grantq) && keel_q_empty(&res->convertq) && keel_q_empty(&res->waitq);
}

/* True if a lock in `mode` is compatible with every granted lock other than
 * one granted `self_gr` (-1: none): one mask test, O(1) in the lock count. */
KEEL_INLINE bool __keel_res_compat(const keel_res_t *res, int mode, int self_gr) {
  unsigned mask = res->gmask;
  if (self_gr >= 0 && res->granted[self_gr] == 1) mask &= ~(1u << self_gr);
  return (mask & ~(unsigned)_keel_lock_compat_mask[mode]) == 0;
}

/* The state machine (res.c). Each returns 0 or a KEEL_E* and queues the
 * callbacks it caused on d; the caller unlocks res->mu and then runs
 * _keel_dispatch(d). */

/* A new request by lkb (gr = -1, rq = mode, flags set): grants it, queues it,
 * or fails with KEEL_EAGAIN (NOQUEUE; lkb untouched, not on any queue). */
int __keel_res_request(keel_res_t *res, keel_lkb_t *lkb, keel_dispatch_t *d) KEEL_HIDDEN;

/* The callbacks a conversion by keel_lock (KEEL_LOCK_CONVERT) brings. */
typedef struct keel_lock_cbs {
  keel_lock_ast_t ast;
  keel_lock_bast_t bast;
  void *arg;
} keel_lock_cbs_t;

/* A conversion of the granted lkb to mode with flags: grants it or queues it
 * on the convert queue, and only then takes cb (NULL: keep lkb's callbacks)
 * as lkb's; or fails with KEEL_EINVAL (QUECVT down), KEEL_EDEADLK or
 * KEEL_EAGAIN with lkb unchanged, callbacks included. */
int __keel_res_convert(keel_res_t *res, keel_lkb_t *lkb, int mode, unsigned flags,
                       const keel_lock_cbs_t *cb, keel_dispatch_t *d) KEEL_HIDDEN;

/* Releases the granted lkb (not converting): takes it off its queue and
 * grants what that unblocks. With VALBLK and gr PW/EX, stores lksb->valblk. */
void __keel_res_unlock(keel_res_t *res, keel_lkb_t *lkb, unsigned flags,
                       keel_dispatch_t *d) KEEL_HIDDEN;

/* Ends lkb's pending request with status (KEEL_ECANCELED, KEEL_ETIMEDOUT):
 * a conversion goes back to the grant queue in its granted mode; a new request
 * leaves every queue (the caller frees it). Its AST or waiter is notified. */
void __keel_res_cancel(keel_res_t *res, keel_lkb_t *lkb, int status,
                       keel_dispatch_t *d) KEEL_HIDDEN;

/* Grants from the head of the convert queue, then the wait queue, while the
 * head is compatible. */
void __keel_res_grant_pending(keel_res_t *res, keel_dispatch_t *d) KEEL_HIDDEN;

/* lksb->lock and lksb->status are read by a thread cancelling a blocked
 * request (keel_unlock with KEEL_LOCK_CANCEL) while the caller's thread, or
 * a forced release, may write them: atomic accesses. Publishing a new lock
 * is a release, so a canceller that finds it also finds lkb->res set. */
KEEL_INLINE void _keel_lksb_set_lock(keel_lksb_t *lksb, keel_lkb_t *lkb) {
  __atomic_store_n(&lksb->lock, lkb, __ATOMIC_RELEASE);
}
KEEL_INLINE void _keel_lksb_set_status(keel_lksb_t *lksb, int status) {
  __atomic_store_n(&lksb->status, status, __ATOMIC_RELAXED);
}

/* Delivers a BAST pushed for lkb (dispatch.c; no resource locked): calls its
 * current bast unless it was unlocked since, and frees a released lkb with
 * its last delivery. */
void _keel_lkb_bast(keel_lkb_t *lkb, int mode) KEEL_HIDDEN;

/* Debug validator: checks the invariants above (counts, masks, queue states);
 * returns false and prints the first broken one. For tests and KEEL_ASSERT_FULL. */
bool __keel_res_validate(const keel_res_t *res) KEEL_HIDDEN;

#endif /* KEEL_LOCK_INTERNAL_H */
