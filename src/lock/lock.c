/* keel_lock, keel_lock_convert, keel_unlock: argument checks, the lkb's life
 * cycle, and blocking waits. The queue logic is in res.c, the resource
 * directory and the timer in lockspace.c.
 *
 * Cost of the by-handle paths (convert, unlock): no lookup, no allocation; one
 * mutex CAS and exchange, an O(1) compatibility test, a few list operations
 * (measured: about 32 ns for a convert up and back down, bench case `handle`).
 * By name, keel_lock adds the table lookup (RCU, no lock) and a malloc of the
 * lkb, keel_unlock the free; the resource's table reference is taken and
 * dropped only when its first lock comes and its last goes (about 54 ns for a
 * lock and unlock pair, bench case `byname`).
 */
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/die.h"
#include "base/futex.h"
#include "base/tls.h"
#include "lockspace.h"

#define LOCK_FLAGS                                                                                 \
  (KEEL_LOCK_NOQUEUE | KEEL_LOCK_CONVERT | KEEL_LOCK_QUECVT | KEEL_LOCK_VALBLK | KEEL_LOCK_TIMEOUT)

/* The lkb in lksb, checked: NULL if lksb holds no lock; aborts if lksb->lock
 * is not a live lkb of this lksb (a copied or corrupted lksb: acting on it
 * would write through a stale pointer). */
static keel_lkb_t *lksb_lock(keel_lksb_t *lksb, const char *call) {
  keel_lkb_t *lkb = __atomic_load_n(&lksb->lock, __ATOMIC_ACQUIRE);
  if (lkb == NULL) return NULL;
  /* Relaxed atomic: a stale lksb may be read while its lock is released. */
  uint32_t magic = __atomic_load_n(&lkb->magic, __ATOMIC_RELAXED);
  if (keel_unlikely(magic != KEEL_LKB_MAGIC))
    keel_die(call, "lksb %p holds %p, which is not a live lock (%s)", (void *)lksb, (void *)lkb,
             magic == KEEL_LKB_DEAD ? "already released: a stale copy of an lksb?"
                                    : "corrupted lksb?");
  if (keel_unlikely(lkb->lksb != lksb))
    keel_die(call, "lock %p belongs to lksb %p, not %p (an lksb moved or copied?)", (void *)lkb,
             (void *)lkb->lksb, (void *)lksb);
  return lkb;
}

void _keel_lkb_free(keel_lkb_t *lkb) {
  __atomic_store_n(&lkb->magic, KEEL_LKB_DEAD, __ATOMIC_RELAXED);
  free(lkb);
}

/* The BASTs this thread is running, innermost first (a BAST may call into
 * the lock manager and so run others inline): keel_unlock waits for the
 * BASTs of its lock that run elsewhere, never for its own frames. */
typedef struct bast_frame {
  const keel_lkb_t *lkb;
  struct bast_frame *next;
} bast_frame_t;
static KEEL_TLS bast_frame_t *bast_frames;

static unsigned own_bast_frames(const keel_lkb_t *lkb) {
  unsigned n = 0;
  for (const bast_frame_t *f = bast_frames; f != NULL; f = f->next) n += f->lkb == lkb;
  return n;
}

void _keel_lkb_bast(keel_lkb_t *lkb, int mode) {
  keel_res_t *res = lkb->res; /* attached while basts > 0 */
  __keel_mutex_lock(&res->mu);
  /* The current callbacks: a conversion may have replaced them since. A
   * BAST whose mode the lock's granted mode no longer blocks (it converted
   * down since it was queued) is stale and skipped, as the DLM's
   * dlm_may_skip_callback does: lock.h promises that a BAST reports a
   * blocked request (review, helper-86: PR reported to a lock at NL). */
  keel_lock_bast_t fn = lkb->released ? NULL : lkb->bast;
  if (fn != NULL && lkb->gr >= 0 && (_keel_lock_compat_mask[mode] & (1u << lkb->gr))) fn = NULL;
  void *arg = lkb->arg;
  if (fn != NULL) lkb->bast_running++;
  __keel_mutex_unlock(&res->mu);
  if (fn != NULL) {
    bast_frame_t f = {lkb, bast_frames};
    bast_frames = &f;
    fn(arg, mode);
    bast_frames = f.next;
  }
  bool wake = false, last = false;
  __keel_mutex_lock(&res->mu);
  if (fn != NULL) {
    lkb->bast_running--;
    if (lkb->bast_waiters != 0) {
      __atomic_store_n(&lkb->bast_seq, lkb->bast_seq + 1, __ATOMIC_RELAXED);
      wake = true;
    }
  }
  bool free_it = __keel_lkb_unowe(res, lkb, &last);
  __keel_mutex_unlock(&res->mu);
  /* A waiter holds a count of its own, so wake and free_it never both hold.
   * It may see the change, free lkb and return before this wake: a
   * FUTEX_WAKE on freed memory is harmless (dispatch.c says why). */
  if (wake) keel_futex_wake(&lkb->bast_seq, INT32_MAX);
  if (free_it) _keel_lkb_retire(res, lkb, true, last);
}

static void set_deadline(keel_lkb_t *lkb, unsigned flags) {
  if (flags & KEEL_LOCK_TIMEOUT)
    lkb->deadline_ns = keel_clock_ns() + (uint64_t)lkb->lksb->timeout_ms * 1000000u;
}

/* A blocking request's deadline passed: cancels it unless it was granted
 * meanwhile (the granter set wake to 1 under the mutex). */
static void cancel_timed_out(keel_lkb_t *lkb) {
  keel_res_t *res = lkb->res;
  keel_dispatch_t d;
  keel_dispatch_init(&d, res->ls->cbq);
  bool last = false;
  __keel_mutex_lock(&res->mu);
  if (__atomic_load_n(&lkb->wake, __ATOMIC_RELAXED) != 1) {
    __keel_res_cancel(res, lkb, KEEL_ETIMEDOUT, &d);
    if (lkb->queue == KEEL_Q_NONE) last = __keel_dir_detach(res);
  }
  __keel_mutex_unlock(&res->mu);
  keel_dispatch(&d);
  _keel_lkb_retire(res, lkb, false, last); /* the sleeper frees lkb (wait_blocking) */
}

/* Counts a blocking caller in, under its resource's mutex, before that is
 * released: a forced release (which takes every resource's mutex) then waits
 * for it to leave before it frees the lkb or the resource, however soon the
 * request is granted or cancelled. seq_cst pairs with release's wake
 * exchange and sleepers load. */
static void sleeper_enter(keel_lockspace_t *ls) {
  __atomic_fetch_add(&ls->sleepers, 1, __ATOMIC_SEQ_CST);
}

/* Blocks until lkb's pending request completes or its deadline passes (then
 * cancels it with KEEL_ETIMEDOUT). Returns the request's status. A new request
 * that did not succeed is freed and lksb->lock cleared. The caller counted
 * itself in (sleeper_enter); this counts it out. */
static KEEL_NOINLINE int wait_blocking(keel_lockspace_t *ls, keel_lkb_t *lkb) {
  bool timed = lkb->flags & KEEL_LOCK_TIMEOUT;
  for (;;) {
    /* Acquire (seq_cst for the pairing above) pairs with notify()'s release
     * exchange: status is visible. */
    uint32_t w = __atomic_load_n(&lkb->wake, __ATOMIC_SEQ_CST);
    if (w == 1) break;
    /* Announce the sleep (2) so the granter issues FUTEX_WAKE. */
    if (w == 0 &&
        !__atomic_compare_exchange_n(&lkb->wake, &w, 2, false, __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE))
      continue;
    if (timed && (int64_t)(lkb->deadline_ns - keel_clock_ns()) <= 0) {
      cancel_timed_out(lkb);
      break;
    }
    keel_futex_wait_until(&lkb->wake, 2, timed ? lkb->deadline_ns : UINT64_MAX);
  }
  /* Read while still counted in: a forced release frees a lock it found
   * granted (the grant may have woken us just before) only once every
   * sleeper has left. gr is final here: set before the wake (grant, or a
   * cancel's -1); status may still be overwritten by a forced release. */
  keel_lksb_t *lksb = lkb->lksb;
  int status = __atomic_load_n(&lksb->status, __ATOMIC_RELAXED);
  /* A conversion a forced release cancelled while BASTs were still owed to
   * it is `released`: its last BAST frees it. */
  bool failed = lkb->gr < 0 && !lkb->released;
  __atomic_fetch_sub(&ls->sleepers, 1, __ATOMIC_RELEASE); /* lkb and res untouched from here */
  if (failed) { /* timed out or cancelled (by keel_unlock or a forced release): ours to free */
    _keel_lksb_set_lock(lksb, NULL);
    _keel_lkb_free(lkb);
  }
  return status;
}

int keel_lock(keel_lockspace_t *ls, const void *name, size_t namelen, int mode, unsigned flags,
              keel_lksb_t *lksb, keel_lock_ast_t ast, keel_lock_bast_t bast, void *arg) {
  if (keel_unlikely(lksb == NULL || !keel_mode_valid(mode) || (flags & ~LOCK_FLAGS)))
    return KEEL_REJECT(KEEL_EINVAL, "keel_lock", "lksb %p, mode %d, flags 0x%x", (void *)lksb, mode,
                       flags);
  if (flags & KEEL_LOCK_CONVERT) {
    keel_lock_cbs_t cb = {.ast = ast, .bast = bast, .arg = arg};
    return _keel_lock_convert(lksb, mode, flags, &cb);
  }
  int rc = _keel_ls_check(ls);
  if (keel_unlikely(rc != 0)) return rc;
  /* QUECVT orders a conversion behind others: a new request has no place
   * there (the DLM refuses it too). */
  if (keel_unlikely(namelen == 0 || namelen > KEEL_LOCK_NAME_MAX || name == NULL ||
                    (flags & KEEL_LOCK_QUECVT)))
    return KEEL_REJECT(KEEL_EINVAL, "keel_lock", "name %p of %zu bytes (1 to %d), flags 0x%x", name,
                       namelen, KEEL_LOCK_NAME_MAX, flags);
  keel_lkb_t *lkb = malloc(sizeof(*lkb));
  if (keel_unlikely(lkb == NULL)) return KEEL_ENOMEM;
  *lkb = (keel_lkb_t){.magic = KEEL_LKB_MAGIC,
                      .gr = -1,
                      .rq = (int8_t)mode,
                      .bast_mode = -1,
                      .flags = flags,
                      .lksb = lksb,
                      .ast = ast,
                      .bast = bast,
                      .arg = arg};
  _keel_lksb_set_status(lksb, 0);
  set_deadline(lkb, flags);
  keel_res_t *res = _keel_dir_attach(ls, name, namelen); /* res->mu held from here */
  if (keel_unlikely(res == NULL)) {
    _keel_lksb_set_lock(lksb, NULL);
    free(lkb);
    return KEEL_ENOMEM;
  }
  /* A release may have begun since the check above. It stores PROBING or
   * CLOSING before its walk takes each resource's mutex, so a request that
   * still reads the lockspace live here is one the walk will find (res->mu
   * orders them; for a resource just created, see dir_create). One that
   * meets a non-forced release vetoes it and goes on (see
   * keel_lockspace_release). */
  if (keel_unlikely(__atomic_load_n(&ls->magic, __ATOMIC_SEQ_CST) != KEEL_LS_MAGIC) &&
      _keel_ls_veto(ls) != 0) {
    bool last = __keel_dir_detach(res);
    __keel_mutex_unlock(&res->mu);
    if (last) _keel_dir_put(res);
    _keel_lksb_set_lock(lksb, NULL);
    free(lkb);
    return KEEL_ESHUTDOWN;
  }
  lkb->res = res;
  keel_dispatch_t d;
  keel_dispatch_init(&d, res->ls->cbq);
  bool last = false;
  rc = __keel_res_request(res, lkb, &d);
  bool waiting = lkb->queue == KEEL_Q_WAIT;
  /* Published only once the request is granted or queued: still under
   * res->mu, so before any AST can run and look at it, and with res set. A
   * canceller on another thread may pick it up from here; it locks res->mu
   * after us and finds the request as it stands. Invariant: lksb->lock
   * leads to an lkb only from the moment it is on one of res's queues. A
   * request that fails (NOQUEUE: KEEL_EAGAIN) is never published, because
   * we free it below without the mutex: published, a cancel or convert on
   * another thread that read it from lksb would lock and read it after the
   * free (keel_die "not a live lock", or a use after free). */
  if (keel_likely(rc == 0))
    _keel_lksb_set_lock(lksb, lkb);
  else
    last = __keel_dir_detach(res);
  if (waiting && ast != NULL && (flags & KEEL_LOCK_TIMEOUT)) _keel_ls_timer_add(ls, lkb);
  if (rc == 0 && waiting && ast == NULL) sleeper_enter(ls);
  __keel_mutex_unlock(&res->mu);
  keel_dispatch(&d);
  if (keel_unlikely(rc != 0)) {
    _keel_lksb_set_lock(lksb, NULL);
    _keel_lkb_retire(res, lkb, true, last);
    return rc;
  }
  if (waiting && ast == NULL) return wait_blocking(ls, lkb);
  return 0;
}

int _keel_lock_convert(keel_lksb_t *lksb, int mode, unsigned flags, const keel_lock_cbs_t *cb) {
  keel_lkb_t *lkb = lksb_lock(lksb, "keel_lock_convert");
  if (keel_unlikely(lkb == NULL)) return KEEL_ENOENT;
  keel_res_t *res = lkb->res;
  keel_dispatch_t d;
  keel_dispatch_init(&d, res->ls->cbq);
  __keel_mutex_lock(&res->mu);
  if (keel_unlikely(lkb->queue != KEEL_Q_GRANT)) {
    /* NONE: a forced release cancelled it after lksb_lock read it (its
     * memory stays until the release has drained the callbacks). */
    int busy = lkb->queue == KEEL_Q_NONE ? KEEL_ENOENT : KEEL_EBUSY;
    __keel_mutex_unlock(&res->mu);
    return busy;
  }
  /* A release under way refuses conversions too: one would start BASTs or a
   * timer the release has already stopped waiting for. Not a non-forced
   * one: this granted lock makes it KEEL_EBUSY. */
  uint32_t m = __atomic_load_n(&res->ls->magic, __ATOMIC_SEQ_CST);
  if (keel_unlikely(m != KEEL_LS_MAGIC) && !_keel_ls_open(m)) {
    __keel_mutex_unlock(&res->mu);
    return KEEL_ESHUTDOWN;
  }
  lkb->wake = 0;
  set_deadline(lkb, flags);
  int rc = __keel_res_convert(res, lkb, mode, flags, cb, &d);
  bool waiting = lkb->queue == KEEL_Q_CONVERT;
  /* Read under the mutex: once it is dropped, a queued asynchronous
   * conversion may be granted, notified and unlocked by other threads. */
  bool blocking = lkb->ast == NULL;
  keel_lockspace_t *ls = res->ls;
  if (waiting && !blocking && (flags & KEEL_LOCK_TIMEOUT)) _keel_ls_timer_add(ls, lkb);
  if (rc == 0 && waiting && blocking) sleeper_enter(ls);
  __keel_mutex_unlock(&res->mu);
  keel_dispatch(&d);
  if (rc == 0 && waiting && blocking) return wait_blocking(ls, lkb);
  return rc;
}

int keel_lock_convert(keel_lksb_t *lksb, int mode, unsigned flags) {
  if (keel_unlikely(lksb == NULL || !keel_mode_valid(mode) ||
                    (flags & ~(LOCK_FLAGS & ~KEEL_LOCK_CONVERT))))
    return KEEL_REJECT(KEEL_EINVAL, "keel_lock_convert", "lksb %p, mode %d, flags 0x%x",
                       (void *)lksb, mode, flags);
  return _keel_lock_convert(lksb, mode, flags, NULL);
}

int keel_unlock(keel_lksb_t *lksb, unsigned flags) {
  if (keel_unlikely(lksb == NULL || (flags & ~(KEEL_LOCK_VALBLK | KEEL_LOCK_CANCEL))))
    return KEEL_REJECT(KEEL_EINVAL, "keel_unlock", "lksb %p, flags 0x%x", (void *)lksb, flags);
  keel_lkb_t *lkb = lksb_lock(lksb, "keel_unlock");
  if (keel_unlikely(lkb == NULL)) return KEEL_ENOENT;
  keel_res_t *res = lkb->res;
  keel_dispatch_t d;
  keel_dispatch_init(&d, res->ls->cbq);
  __keel_mutex_lock(&res->mu);
  if (keel_unlikely(lkb->queue == KEEL_Q_NONE)) { /* as in _keel_lock_convert */
    __keel_mutex_unlock(&res->mu);
    return KEEL_ENOENT;
  }
  if (keel_unlikely(lkb->queue != KEEL_Q_GRANT)) {
    if (!(flags & KEEL_LOCK_CANCEL)) {
      __keel_mutex_unlock(&res->mu);
      return KEEL_EBUSY;
    }
    /* A request with no AST has its caller blocked in wait_blocking (or on
     * its way there), which frees a cancelled new request itself: freeing it
     * here too would be a double free, and clearing lksb->lock would race
     * with it. Both read before the cancel: its wake-up lets the waiter
     * free lkb at once, even while we still hold the mutex. A cancelled new
     * request leaves every queue; a cancelled conversion keeps its grant. */
    bool waiter = lkb->ast == NULL, gone = lkb->queue == KEEL_Q_WAIT, last = false;
    __keel_res_cancel(res, lkb, KEEL_ECANCELED, &d);
    if (gone) {
      if (!waiter) _keel_lksb_set_lock(lksb, NULL); /* before the AST sees it */
      last = __keel_dir_detach(res);
    }
    __keel_mutex_unlock(&res->mu);
    keel_dispatch(&d);
    _keel_lkb_retire(res, lkb, gone && !waiter, last);
    return 0;
  }
  if (keel_unlikely(flags & KEEL_LOCK_CANCEL)) {
    __keel_mutex_unlock(&res->mu);
    return KEEL_ENOENT; /* granted: no request to cancel */
  }
  __keel_res_unlock(res, lkb, flags, &d);
  _keel_lksb_set_lock(lksb, NULL);
  /* BASTs still owed to lkb: the last delivery frees it, and calls nothing
   * once it sees `released`. Those running on other threads have arg in
   * hand: wait for them to return (holding a count, so lkb outlives the
   * wait), but not for this thread's own frames. */
  bool defer = lkb->basts != 0, wait = false, last = false;
  unsigned own = 0;
  if (defer) {
    lkb->released = true;
    /* A stale copy of lksb now aborts as released. */
    __atomic_store_n(&lkb->magic, KEEL_LKB_DEAD, __ATOMIC_RELAXED);
    own = own_bast_frames(lkb);
    if (lkb->bast_running > own) {
      lkb->basts++;
      lkb->bast_waiters++;
      wait = true;
    }
  } else {
    last = __keel_dir_detach(res);
  }
  __keel_mutex_unlock(&res->mu);
  keel_dispatch(&d);
  if (!defer) {
    _keel_lkb_retire(res, lkb, true, last);
  } else if (wait) {
    __keel_mutex_lock(&res->mu);
    while (lkb->bast_running > own) {
      uint32_t seq = lkb->bast_seq;
      __keel_mutex_unlock(&res->mu);
      keel_futex_wait_until(&lkb->bast_seq, seq, UINT64_MAX);
      __keel_mutex_lock(&res->mu);
    }
    lkb->bast_waiters--;
    bool free_it = __keel_lkb_unowe(res, lkb, &last);
    __keel_mutex_unlock(&res->mu);
    if (free_it) _keel_lkb_retire(res, lkb, true, last);
  }
  return 0;
}

const char *keel_lock_mode_name(int mode) {
  static const char names[KEEL_LOCK_MODES][3] = {"NL", "CR", "CW", "PR", "PW", "EX"};
  return keel_mode_valid(mode) ? names[mode] : "??";
}

bool keel_lock_compatible(int a, int b) {
  return keel_mode_valid(a) && keel_mode_valid(b) && (_keel_lock_compat_mask[a] & (1u << b));
}
