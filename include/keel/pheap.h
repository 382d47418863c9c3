/* keel pheap: a crash-consistent persistent heap over a mapped file.
 *
 * A pool is one file (on a DAX/pmem file system or an ordinary one) mapped
 * into the process. Objects inside it are named by offsets (keel_poff_t) from
 * the pool's base, which stay valid across runs; keel_pheap_ptr() turns one
 * into a pointer for this mapping. Every change the heap makes is failure
 * atomic: after a crash (process or power) the next open replays or rolls back
 * whatever was in flight, so an allocation either happened with its
 * destination set or not at all, and a transaction is all-or-nothing.
 *
 * Concurrency: every function may run concurrently with every other on the
 * same pool except keel_pheap_close (nothing may run during or after it).
 * A transaction belongs to the thread that began it. Objects themselves are
 * not locked: two threads changing the same bytes must synchronise.
 * After fork() the parent's pools stay the parent's. In the child, reads
 * work (keel_pheap_ptr/off/usable_size/type/foreach, and keel_pheap_root
 * once the root exists) over the pool as it was mapped at fork: space the
 * parent adds later is not mapped there. keel_pheap_close frees the child's
 * copy and leaves the file alone; every other call on such a pool aborts
 * naming it, as do the calls of a transaction the parent had open (a
 * keel_tx_begin on a pool of the child's own replaces that one). To change
 * the file, the child closes its copy and opens it once the parent has
 * closed it (until then the file's lock is the parent's).
 *
 * Durability costs (persist barriers = fence or sync call, see KEEL_OPTIONS
 * pheap_flush): atomic alloc/free/publish 1, plus a 2-barrier checkpoint
 * shared by every lane about once per 100 operations of a lane, and 3 or
 * more when an allocation starts a new run of blocks (a checkpoint, then
 * the run's header and its chunk word); zalloc 1 more; transaction
 * commit 2, plus 1 when the bytes it snapshot and its new objects (headers
 * included) total more than 1 KiB (the log can no longer vouch for them by
 * checksum, so a barrier orders them first), but 1 when it snapshot
 * nothing and its new objects total at most 256 B, 2 past that; abort 2;
 * plus 1 per keel_tx_add_range that snapshots new bytes. So a transaction
 * with one tx_alloc costs 1 or 2; one that also snapshots the destination,
 * 3 while the object (with its 16-byte header) and the snapshot stay within
 * 1 KiB and 4 past it.
 *
 * Sizes: one atomic publish or one transaction may change at most about
 * 1000 allocation words (a reservation or tx allocation takes 1-3). A
 * transaction's snapshots past 48 KiB go to 256 KiB undo blocks taken from
 * the pool (up to 3 barriers each; KEEL_ENOSPC and rolled back when the pool has
 * no room for one). Calls use up to 32 KiB of the caller's stack.
 *
 * Errors: int functions return 0 or a negative KEEL_E*; functions returning a
 * pointer return NULL and set errno; offset-returning ones return 0 and set
 * errno. Open and create failures leave a message naming the file and what
 * is wrong in keel_pheap_errmsg(). Misuse that would corrupt the heap (free of
 * a pointer that is not a live object) aborts with a message.
 */
#ifndef KEEL_PHEAP_H
#define KEEL_PHEAP_H

#include <keel/keel.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An object's offset from the pool base; 0 is the null object. */
typedef uint64_t keel_poff_t;

typedef struct keel_pheap keel_pheap_t;

/* The smallest pool keel_pheap_create accepts (the 64 log lanes take 4 MiB). */
#define KEEL_PHEAP_MIN_SIZE   ((size_t)8 << 20)
/* Longest layout name, without its NUL. */
#define KEEL_PHEAP_LAYOUT_MAX 63
/* Type number that matches every type in keel_pheap_foreach. */
#define KEEL_PHEAP_ANY_TYPE   UINT64_MAX
/* Largest single object (a request above this fails with KEEL_EINVAL). Any
 * size up to it is one extent; allocating writes only its 16-byte header
 * (zalloc zeroes the body, and a transaction's commit flushes the whole body
 * of each object it allocated). */
#define KEEL_PHEAP_MAX_ALLOC  ((size_t)1 << 34)

/* keel_pheap_create flags. */
#define KEEL_PHEAP_FIXED  1u /* never grow the file: allocation fails with KEEL_ENOSPC when full */
/* Leave the file sparse (no block reservation): for pools far larger than
 * the device holds, at the risk of SIGBUS on a full file system. */
#define KEEL_PHEAP_SPARSE 2u

/* Creates a new pool file of `size` bytes (at least KEEL_PHEAP_MIN_SIZE) with
 * the given layout name; fails with EEXIST if the file exists. The pool grows
 * on demand unless KEEL_PHEAP_FIXED: within one open, to 4x its size at open
 * or 64 GiB, whichever is more, and always by room for one more object of
 * KEEL_PHEAP_MAX_ALLOC (past that, KEEL_ENOSPC until it is reopened). The
 * file's blocks are reserved (posix_fallocate) at create and at each growth,
 * so a full file system fails the call with KEEL_ENOSPC instead of raising
 * SIGBUS when a page is first touched (unless KEEL_PHEAP_SPARSE; both flags
 * are kept in the pool and apply at every open). The file is locked until close. Blocks on I/O; allocates. NULL + errno (negated
 * KEEL_E*) on failure. */
KEEL_API keel_pheap_t *keel_pheap_create(const char *path, const char *layout, size_t size,
                                         unsigned flags);

/* Opens an existing pool, checking its header and layout name, locking it,
 * and running recovery for anything a crash left in flight. Blocks on I/O;
 * allocates. Walks no heap metadata (the free-block state is rebuilt per run
 * on first use), so its cost does not grow with the pool; a heap corrupted
 * past the header is found on use (keel_pheap_check finds it offline). NULL +
 * errno on failure, with keel_pheap_errmsg() saying why. */
KEEL_API keel_pheap_t *keel_pheap_open(const char *path, const char *layout);

/* Unmaps and unlocks the pool. Nothing may use `ph` concurrently or after.
 * Waits for deferred work the pool handed out (keel_pheap_set_deferrer).
 * KEEL_EBUSY, the pool left open, while a transaction on it is open. */
KEEL_API int keel_pheap_close(keel_pheap_t *ph);

/* Background work: the pool hands `fn(work_arg)` to `defer(arg, fn,
 * work_arg)`, which must run it exactly once later on some thread (a
 * keel_sched_run job with KEEL_JOB_RUN_IF_CANCELLED, say: pheap itself needs
 * no thread and no link to sched; a deferrer that drops the work would leave
 * keel_pheap_close waiting for it) and return 0, or return nonzero to
 * refuse (the pool then does the work inline when it must).
 * Used for checkpoints: a lane past half its log ring or dirty list asks for
 * one, so the lanes rarely stop for a checkpoint of their own. At most one
 * request is outstanding per pool. NULL turns it off. Set it while no other
 * thread uses the pool; fn may block briefly (flushes, two barriers).
 * defer is called from inside pool operations: it may run fn itself, but
 * must not call the pool (that dies with a message naming the file), nor
 * wait for another thread's pool operation (the caller holds a log lane). */
typedef void (*keel_pheap_work_fn)(void *work_arg);
typedef int (*keel_pheap_defer_fn)(void *arg, keel_pheap_work_fn fn, void *work_arg);
KEEL_API void keel_pheap_set_deferrer(keel_pheap_t *ph, keel_pheap_defer_fn defer, void *arg);

/* The last open/create/check failure of this thread: "PATH: what is wrong". */
KEEL_API const char *keel_pheap_errmsg(void);

/* The root object of at least `size` bytes, allocated zeroed on first call
 * (crash-atomically). KEEL_EINVAL in errno if a smaller root exists. */
KEEL_API void *keel_pheap_root(keel_pheap_t *ph, size_t size);

/* Pool mapping base and current mapped size (the public part of the handle). */
struct keel_pheap_view_ {
  char *base;
};

/* Pointer for an offset (NULL for 0). Never blocks; no check. */
static inline void *keel_pheap_ptr(const keel_pheap_t *ph, keel_poff_t off) {
  return off ? ((const struct keel_pheap_view_ *)(const void *)ph)->base + off : NULL;
}

/* Offset for a pointer into the pool (0 for NULL). Never blocks; no check. */
static inline keel_poff_t keel_pheap_off(const keel_pheap_t *ph, const void *p) {
  return p ? (keel_poff_t)((const char *)p -
                           ((const struct keel_pheap_view_ *)(const void *)ph)->base)
           : 0;
}

/* Allocates `size` bytes tagged with `type` and stores its offset in *dest in
 * the same failure-atomic step (dest may be inside the pool or not; only one
 * inside is crash-atomic; 8-byte aligned either way). 0, KEEL_ENOSPC (pool
 * full and cannot grow), KEEL_EINVAL. 1 persist barrier; may block on
 * growth or a checkpoint. */
KEEL_API int keel_pheap_alloc(keel_pheap_t *ph, keel_poff_t *dest, size_t size, uint64_t type);

/* As keel_pheap_alloc, with the object's bytes zeroed and persisted. */
KEEL_API int keel_pheap_zalloc(keel_pheap_t *ph, keel_poff_t *dest, size_t size, uint64_t type);

/* Frees *dest (if non-zero) and sets *dest to 0 in one failure-atomic step.
 * Never fails for lack of space. Aborts if *dest is not a live object, or
 * if dest is a word this thread's transaction snapshotted (keel_tx_free). */
KEEL_API int keel_pheap_free(keel_pheap_t *ph, keel_poff_t *dest);

/* Usable bytes of a live object (at least the size asked for), or of one
 * this thread's open transaction allocated or will publish. In such an
 * object, bytes past the size asked for are made durable by the commit only
 * if keel_tx_add_range names them. */
KEEL_API size_t keel_pheap_usable_size(keel_pheap_t *ph, keel_poff_t off);

/* The type number an object was allocated with. */
KEEL_API uint64_t keel_pheap_type(keel_pheap_t *ph, keel_poff_t off);

/* Reserve/publish. A reservation takes a block in volatile memory only (no
 * persist barrier); publishing a batch makes all of them, and the value
 * stores and frees queued with them, durable in one failure-atomic step.
 * Reservations never published vanish at a crash or close. */
typedef struct keel_pheap_act {
  uint32_t kind;   /* internal: reserve, set-value or free */
  uint32_t cls;    /* internal */
  keel_poff_t off; /* the reserved (or freed) object */
  uint64_t *dest;  /* set-value: where */
  uint64_t value;  /* set-value: what */
} keel_pheap_act_t;

/* Reserves an object of `size` bytes and `type`; act->off is its offset and
 * may be written at once. 0, KEEL_ENOSPC, KEEL_EINVAL. No persist barrier. */
KEEL_API int keel_pheap_reserve(keel_pheap_t *ph, keel_pheap_act_t *act, size_t size,
                                uint64_t type);

/* Queues "*dest = value" (dest inside the pool) for a publish. */
KEEL_API void keel_pheap_set_value(keel_pheap_t *ph, keel_pheap_act_t *act, uint64_t *dest,
                                   uint64_t value);

/* Queues the free of a live object for a publish. */
KEEL_API void keel_pheap_defer_free(keel_pheap_t *ph, keel_pheap_act_t *act, keel_poff_t off);

/* Makes n actions durable atomically (1 barrier). A reservation takes 3 log
 * entries, a value or free 1, of about 1000 per call (KEEL_ENOSPC beyond;
 * nothing is published then; KEEL_EINVAL for a value whose destination this
 * thread's transaction snapshotted: keel_tx_publish). The contents written
 * into a reservation are the caller's to persist (keel_pheap_persist)
 * before publishing. */
KEEL_API int keel_pheap_publish(keel_pheap_t *ph, keel_pheap_act_t *acts, size_t n);

/* Drops n unpublished actions (reservations go back to the heap). */
KEEL_API void keel_pheap_cancel(keel_pheap_t *ph, keel_pheap_act_t *acts, size_t n);

/* Calls fn(ph, off, arg) for each live object of `type` (KEEL_PHEAP_ANY_TYPE:
 * all), root included, until fn returns non-zero (that value is returned).
 * Objects allocated or freed concurrently may or may not be seen. */
KEEL_API int keel_pheap_foreach(keel_pheap_t *ph, uint64_t type,
                                int (*fn)(keel_pheap_t *ph, keel_poff_t off, void *arg), void *arg);

typedef struct keel_pheap_stats {
  uint64_t pool_bytes;   /* file size in use */
  uint64_t heap_bytes;   /* bytes of chunks (objects' space) */
  uint64_t live_objects; /* allocated objects (walk) */
  uint64_t live_bytes;   /* requested bytes of live objects */
  uint64_t usable_bytes; /* usable bytes of live objects */
  uint64_t run_bytes;    /* bytes of chunks holding small-object runs */
  uint64_t huge_bytes;   /* bytes of chunks holding large objects */
  uint64_t free_bytes;   /* bytes of free chunks */
  uint64_t flushes;      /* cache-line or msync flush calls since open */
  uint64_t barriers;     /* persist barriers (fence / msync batch) since open */
  uint64_t grows;        /* times the file was extended since open */
  uint64_t tx_commits, tx_aborts;
  uint64_t recovered_logs;       /* logs replayed or rolled back by the last open */
  uint64_t deferred_checkpoints; /* run by the deferrer's jobs since open */
} keel_pheap_stats_t;

/* Fills *st. Walks the heap (O(objects)); may run concurrently with use. */
KEEL_API int keel_pheap_stats(keel_pheap_t *ph, keel_pheap_stats_t *st);

/* Prints header, layout, sizes, classes in use and stats (keel pheap info). */
KEEL_API int keel_pheap_print_info(keel_pheap_t *ph, FILE *out);

/* Offline consistency check of a closed pool file, which it never writes:
 * header and logs as open checks them, then, on a private copy recovered as
 * open would (if a crash left logs), extents, runs, object headers, root. 0,
 * or KEEL_ECORRUPT / another open error with keel_pheap_errmsg() naming the
 * first problem. */
KEEL_API int keel_pheap_check(const char *path);

/* Makes [p, p+len) durable (flush + barrier), for plain stores outside tx;
 * also checkpoints pending logs, so a plain store to a word an earlier
 * alloc/free/publish or small transaction set is never undone by that log's
 * replay. */
KEEL_API void keel_pheap_persist(keel_pheap_t *ph, const void *p, size_t len);

/* Transactions (per thread, flat nesting: an inner begin/commit only counts
 * depth; an abort anywhere aborts the outermost). Usage:
 *   keel_tx_begin(ph); ...; keel_tx_add_range(p, n); p->x = 1; ...;
 *   keel_tx_commit(); rc = keel_tx_end();
 * After any failure inside (KEEL_ENOSPC, ...) the transaction is already
 * rolled back; later calls return KEEL_ECANCELED and keel_tx_end returns the
 * first error. An atomic operation (alloc, free, publish) inside the
 * transaction whose destination the transaction has snapshotted returns
 * KEEL_EINVAL: its abort would undo the store, a crash's recovery replay
 * it (use keel_tx_alloc/tx_free/tx_publish). Holds one of the pool's log
 * lanes from begin to end (62 of
 * the 64; the other two are kept for atomic operations, so that one made
 * inside a transaction on another pool never waits on a transaction); a
 * thread that exits inside a transaction has it rolled back, with a
 * warning. */

/* Begins (or nests) a transaction on ph. KEEL_EINVAL if a transaction on
 * another pool is open in this thread (that one goes on). Whatever it
 * returns, pair it with keel_tx_end, as in PMDK: a failed nested begin
 * still counts a level; after a failed outermost one, keel_tx_end returns
 * KEEL_EPERM. May block for a free lane. */
KEEL_API int keel_tx_begin(keel_pheap_t *ph);

/* Snapshots [ptr, ptr+size) so it is restored on abort or crash; must precede
 * the stores. Repeated or overlapping ranges are snapshot once (range cache).
 * 1 persist barrier when new bytes are snapshot, 0 otherwise. */
KEEL_API int keel_tx_add_range(void *ptr, size_t size);

/* Allocates inside the transaction: durable only if it commits. 0 + errno on
 * failure (the transaction is then aborted). No barrier until commit. */
KEEL_API keel_poff_t keel_tx_alloc(size_t size, uint64_t type);

/* As keel_tx_alloc, zeroed. */
KEEL_API keel_poff_t keel_tx_zalloc(size_t size, uint64_t type);

/* Frees a live object when the transaction commits. */
KEEL_API int keel_tx_free(keel_poff_t off);

/* Publishes reservations and queued actions with the transaction. */
KEEL_API int keel_tx_publish(keel_pheap_act_t *acts, size_t n);

/* Commits the outermost transaction (inner: no-op). 2 persist barriers (1
 * with no snapshot and small new objects; 0 if it changed nothing). A value
 * queued into a new object's header: KEEL_EINVAL, and it rolls back. */
KEEL_API int keel_tx_commit(void);

/* Aborts and rolls back the whole transaction; err (<0) is what keel_tx_end
 * returns (KEEL_ECANCELED if 0). */
KEEL_API void keel_tx_abort(int err);

/* Ends one nesting level; at the outermost, an uncommitted transaction is
 * aborted. Returns 0 if the transaction committed, else its error. */
KEEL_API int keel_tx_end(void);

/* Nesting depth of this thread's transaction (0: none). */
KEEL_API int keel_tx_depth(void);

#ifdef __cplusplus
}
#endif
#endif /* KEEL_PHEAP_H */
