/* keel lock: a DLM-style lock manager and an adaptive mutex.
 *
 * A lockspace holds resources named by byte strings (up to
 * KEEL_LOCK_NAME_MAX bytes). A lock on a resource has a granted mode and, while
 * a request is pending, a requested mode, in the six VMS/DLM modes:
 *
 *        NL  CR  CW  PR  PW  EX      (1 = the two modes may be held at once)
 *   NL    1   1   1   1   1   1
 *   CR    1   1   1   1   1   0
 *   CW    1   1   1   0   0   0
 *   PR    1   1   0   1   0   0
 *   PW    1   1   0   0   0   0
 *   EX    1   0   0   0   0   0
 *
 * Each resource has a grant queue, a convert queue and a wait queue. Rules
 * (those of the Linux DLM):
 *  - a new request is granted at once only if it is compatible with every
 *    granted mode and both the convert and wait queues are empty: nothing
 *    barges past a waiting request;
 *  - a conversion is granted at once if it is compatible with the granted
 *    modes of every other lock (with KEEL_LOCK_QUECVT: and the convert queue
 *    is empty); otherwise it waits at the tail of the convert queue, keeping
 *    its granted mode;
 *  - after every release, conversion or cancel, the head of the convert queue
 *    is granted while it is compatible, then (convert queue empty) the head
 *    of the wait queue, and so on: strict FIFO within each queue;
 *  - a conversion that would wait behind a converting lock whose requested
 *    mode its own granted mode blocks closes a wait-for cycle: it fails with
 *    KEEL_EDEADLK and keeps its granted mode. Only the request that closes
 *    the cycle fails.
 *
 * Callbacks. A request made with an AST is asynchronous: keel_lock returns 0
 * once the request is granted or queued, and ast(arg) runs when it completes,
 * with lksb->status set (0, KEEL_ETIMEDOUT, KEEL_ECANCELED). Without an AST
 * the call blocks until it completes and returns that status. A BAST,
 * bast(arg, mode), tells a lock's holder that a request for `mode` is blocked
 * by its granted mode: sent when the request is queued and when a grant pass
 * leaves it at a queue's head; a holder hears of a mode only if it is
 * above every mode it was told of since its last grant (the DLM's rule).
 * Callbacks run inline by default: on the thread whose call caused them (the
 * one that released, converted, requested or cancelled), after it has
 * dropped the resource's lock, in the order the grants were made. A
 * lockspace created with KEEL_LOCKSPACE_SCHED runs them on keel's sched
 * instead (see that flag). Asynchronous timeouts are expired by one timer
 * thread per lockspace, started on the first such request. A callback may
 * call keel_lock/convert/unlock (no lock is held while it runs) but not
 * keel_lockspace_release of its own lockspace, and should be short.
 * Inline callbacks caused by calls on different threads are not ordered with
 * each other.
 *
 * Memory: a resource is 168 bytes plus its name (and the table's share); a
 * lock 96 bytes (x86-64). A by-name keel_lock allocates the lock, and the resource on
 * first use; by-handle conversions and unlocks allocate nothing.
 *
 * Concurrency: every call may run concurrently with every other call, except
 * that calls on one lksb are serialised by the caller (one lksb is one lock),
 * and keel_lockspace_release runs alone on its lockspace (but for keel's
 * callbacks, calls on a lockspace that holds a lock throughout, and
 * keel_lockspace_shrink: see each).
 *
 * Errors: 0 or a negative KEEL_E* (keel.h). A NULL lksb, a bad mode or flag,
 * and a lockspace used after release return errors; a handle that was never a
 * lock (a corrupted lksb) aborts with "keel: keel_unlock: ..." rather than
 * writing through it.
 */
#ifndef KEEL_LOCK_H
#define KEEL_LOCK_H

#include <keel/keel.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ----------------------------------------------------------------------------
 * keel_mutex: a three-state futex mutex with a brief adaptive spin.
 *
 * State 0 = free, 1 = held, 2 = held and someone may sleep on it. lock() is
 * one CAS when free; otherwise it polls at most 32 times (PAUSE between,
 * ~2 us) while the state is 1 and sleeps in FUTEX_WAIT as soon as anyone sleeps
 * (state 2) or the spin runs out, so hundreds of threads on a few cores sleep
 * rather than burn the CPU the holder needs (the pthread_spinlock failure).
 * unlock() is one atomic exchange, plus FUTEX_WAKE only if state was 2.
 * Not recursive, no owner tracking; 4 bytes; zero-initialised is unlocked.
 */
typedef struct keel_mutex {
  uint32_t state; /* accessed only through atomic builtins */
} keel_mutex_t;

#define KEEL_MUTEX_INIT                                                                            \
  { 0 }

/* Initialises a mutex (the same as KEEL_MUTEX_INIT or zeroing it). */
KEEL_API void keel_mutex_init(keel_mutex_t *m);
/* Takes the mutex; may spin briefly, then sleeps. No allocation. */
KEEL_API void keel_mutex_lock(keel_mutex_t *m);
/* Takes the mutex if it is free: true on success. Never blocks. */
KEEL_API bool keel_mutex_trylock(keel_mutex_t *m);
/* Releases a mutex held by the caller; wakes one sleeper if there is one. */
KEEL_API void keel_mutex_unlock(keel_mutex_t *m);

/* ----------------------------------------------------------------------------
 * The lock manager.
 */
typedef enum keel_lock_mode {
  KEEL_LOCK_NL = 0, /* null: holds the resource (and its value block) cached */
  KEEL_LOCK_CR = 1, /* concurrent read */
  KEEL_LOCK_CW = 2, /* concurrent write */
  KEEL_LOCK_PR = 3, /* protected read */
  KEEL_LOCK_PW = 4, /* protected write */
  KEEL_LOCK_EX = 5, /* exclusive */
} keel_lock_mode_t;

#define KEEL_LOCK_MODES 6

/* keel_lock / keel_lock_convert flags. */
#define KEEL_LOCK_NOQUEUE 0x01u /* fail with KEEL_EAGAIN instead of waiting */
#define KEEL_LOCK_CONVERT 0x02u /* keel_lock converts lksb's lock (name ignored) */
/* An up-conversion queues behind pending ones (a down-conversion with it:
 * KEEL_EINVAL, as in the DLM). */
#define KEEL_LOCK_QUECVT  0x04u
/* Read the value block on grant; write it on release, and on a PW or EX
 * lock's conversion down or to its own mode (the DLM's rules). */
#define KEEL_LOCK_VALBLK  0x08u
#define KEEL_LOCK_TIMEOUT 0x10u /* give up after lksb->timeout_ms: KEEL_ETIMEDOUT */
/* keel_unlock flag: cancel the pending request instead (KEEL_ECANCELED). */
#define KEEL_LOCK_CANCEL  0x20u

#define KEEL_LOCK_NAME_MAX 64 /* bytes in a resource name (the DLM's limit) */
#define KEEL_LOCK_LVB_LEN  32 /* bytes in a lock value block (the DLM's default) */

typedef struct keel_lockspace keel_lockspace_t;
typedef struct keel_lkb keel_lkb_t; /* keel's lock object; opaque */

/* The lock status block: the caller's handle on one lock. The caller owns the
 * memory and keeps it alive and unmoved while the lock exists; keel writes
 * status, lock and (with VALBLK on grant) valblk. A new keel_lock overwrites
 * lock without reading it, so an lksb that holds a lock is converted or
 * unlocked, never passed to a new keel_lock (its lock could no longer be
 * released). */
typedef struct keel_lksb {
  int status;                        /* out: result of the last request (valid once it completed) */
  uint32_t timeout_ms;               /* in: with KEEL_LOCK_TIMEOUT, how long a request may wait */
  keel_lkb_t *lock;                  /* out: the lock, set by keel_lock; NULL once unlocked */
  uint8_t valblk[KEEL_LOCK_LVB_LEN]; /* in/out: value block with KEEL_LOCK_VALBLK */
} keel_lksb_t;

/* Completion callback: the request on lksb finished; read lksb->status. */
typedef void (*keel_lock_ast_t)(void *arg);
/* Blocking callback: a request for `mode` waits for this lock's mode. Never
 * called once keel_unlock of the lock has returned. */
typedef void (*keel_lock_bast_t)(void *arg, int mode);

/* keel_lockspace_config_t flags. KEEL_LOCKSPACE_SCHED: run this lockspace's
 * ASTs and BASTs on keel's sched (keel/sched.h) instead of inline: one at a
 * time per lockspace, each call's callbacks in grant order, calls' batches in
 * the order they were posted. A callback then must not wait for another
 * callback of its lockspace (they run one at a time). */
#define KEEL_LOCKSPACE_SCHED 0x1u

typedef struct keel_lockspace_config {
  /* Unused resources (no locks) stay cached for fast re-locking; at most this
   * many (0: the lock_cache_max option, default 1M); the oldest are dropped
   * beyond it, and under pressure by
   * keel_lockspace_shrink. A dropped resource loses its value block.
   * Resources with locks do not count, except that one locked again after
   * it was cached counts until the next drop passes it (a lazy LRU: see
   * max_unused in keel/table.h), so a drop may come while fewer are unused. */
  size_t cache_max;
  size_t size_hint; /* expected number of live resources (0: small) */
  unsigned flags;   /* KEEL_LOCKSPACE_SCHED or 0 */
} keel_lockspace_config_t;

/* Creates a lockspace (config may be NULL for defaults). Allocates; NULL with
 * errno = ENOMEM or EINVAL on failure. */
KEEL_API keel_lockspace_t *keel_lockspace_create(const keel_lockspace_config_t *config);

/* keel_lockspace_release flag: cancel every lock (AST with KEEL_ECANCELED). */
#define KEEL_LOCKSPACE_FORCE 0x1u

/* Releases a lockspace: KEEL_EBUSY (and nothing changes) while it holds locks
 * or a request races it (below), unless KEEL_LOCKSPACE_FORCE, which cancels
 * every lock and request first, calling each AST with lksb->status =
 * KEEL_ECANCELED and lksb->lock = NULL; blocking calls waiting in it return
 * KEEL_ECANCELED (release waits for them to leave). Callbacks still queued
 * (KEEL_LOCKSPACE_SCHED) may run during the release: they find their locks
 * cancelled (lksb->lock NULL, and KEEL_ENOENT from a handle read before),
 * and lksb->status may change under them (read it atomically there). New
 * requests and conversions made during a forced release (by an AST it
 * causes, say) get KEEL_ESHUTDOWN; it returns once every callback has run.
 * Without FORCE nothing is refused unless the release goes ahead, and
 * nothing waits for it: a request that races its search for locks goes on
 * and makes it return KEEL_EBUSY (so does a lock it finds, whoever holds
 * it). A grant AST already under way when the release starts (on the
 * timeout thread, or queued on sched) may run after that lock's
 * KEEL_ECANCELED notice, seeing status KEEL_ECANCELED: free callback
 * arguments once the release has returned, not in the notice. The only
 * calls that may run concurrently with it are keel's own callbacks (timer
 * and sched), keel_lockspace_shrink (the release waits for it) and, on
 * other threads, calls on a lockspace that holds a lock for the whole time
 * (the release then cannot go ahead); anything else may find the
 * lockspace freed.
 * Calls on the released handle return KEEL_ESHUTDOWN (checked for the last
 * 1,024 released lockspaces; their headers, about 80 bytes, are kept until
 * exit for this). */
KEEL_API int keel_lockspace_release(keel_lockspace_t *ls, unsigned flags);

/* Drops up to n cached unused resources (a memory-pressure callback calls
 * this); returns how many were dropped. May run concurrently with anything,
 * keel_lockspace_release of the same lockspace included (it then returns 0
 * or makes the release wait for it), as long as the handle is one of the
 * last 1,024 released if it is released. */
KEEL_API size_t keel_lockspace_shrink(keel_lockspace_t *ls, size_t n);

/* Requests a new lock on the resource `name` in `mode` (or, with
 * KEEL_LOCK_CONVERT, converts lksb->lock and ignores name). Finds or creates
 * the resource (one lock-free table lookup; allocates on first use).
 * With ast: returns 0 once the request is granted or queued, and ast(arg) runs
 * when it completes (already granted and delivered inline: before keel_lock returns). Without ast:
 * blocks until it completes and returns lksb->status. Either way, failures
 * known at once are returned with no AST: KEEL_EINVAL (bad argument;
 * KEEL_LOCK_QUECVT without KEEL_LOCK_CONVERT),
 * KEEL_EAGAIN (NOQUEUE and not grantable), KEEL_EDEADLK (conversion
 * deadlock), KEEL_ENOMEM, KEEL_ESHUTDOWN (lockspace released).
 * With KEEL_LOCK_CONVERT, ast, bast and arg become the lock's when the
 * conversion is granted or queued, and stay (a queued one's cancel or timeout
 * completes through the new ast); one that fails at once changes nothing. */
KEEL_API int keel_lock(keel_lockspace_t *ls, const void *name, size_t namelen, int mode,
                       unsigned flags, keel_lksb_t *lksb, keel_lock_ast_t ast,
                       keel_lock_bast_t bast, void *arg);

/* Converts the lock held in lksb to `mode` by its handle: no table lookup. The
 * lock's AST and BAST from keel_lock are kept; otherwise as keel_lock.
 * KEEL_ENOENT if lksb holds no lock, KEEL_EBUSY if a request is pending. */
KEEL_API int keel_lock_convert(keel_lksb_t *lksb, int mode, unsigned flags);

/* Note on KEEL_LOCK_CANCEL: it may come from another thread than the request's
 * (the only way to cancel a blocked keel_lock without AST: that call then
 * returns KEEL_ECANCELED). A new request that can also fail by itself (one
 * with KEEL_LOCK_TIMEOUT) frees its lkb when it fails; cancelling it from
 * another thread at that moment would race with the free, so cancel requests
 * without a timeout, or let the timeout do the cancelling. One that fails at
 * once (KEEL_EAGAIN under KEEL_LOCK_NOQUEUE) never appears in lksb->lock: a
 * cancel racing with it gets KEEL_ENOENT. */

/* Releases the lock held in lksb (with VALBLK and a PW/EX lock: storing
 * lksb->valblk as the resource's value block) and sets lksb->lock = NULL. No
 * table lookup; never blocks on other lock holders. KEEL_ENOENT if lksb holds
 * no lock; KEEL_EBUSY if a request is pending, unless KEEL_LOCK_CANCEL, which
 * cancels it (its AST sees KEEL_ECANCELED; a cancelled new request is gone, a
 * cancelled conversion keeps its granted mode) and returns 0. Once it has
 * released a lock, no BAST of it runs any more: one due is dropped, one
 * running on another thread is waited for (unless the caller is that BAST),
 * so the caller may free arg; a BAST must therefore not wait for a thread
 * that is unlocking its own lock. */
KEEL_API int keel_unlock(keel_lksb_t *lksb, unsigned flags);

/* The mode name ("NL" ... "EX"), or "??". */
KEEL_API const char *keel_lock_mode_name(int mode);

/* True if locks in modes a and b may be granted at once (the table above). */
KEEL_API bool keel_lock_compatible(int a, int b);

#ifdef __cplusplus
}
#endif
#endif /* KEEL_LOCK_H */
