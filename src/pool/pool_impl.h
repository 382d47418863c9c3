/* Pool internals shared by the files of src/pool. Never installed.
 *
 * Objects. Each object is preceded by a 16-byte header (pool_hdr_t) holding
 * a tag (the owning pool's tag, with bit 0 set while the object is cached)
 * and the link of the hot or cold list it sits on. A pool's tag is its
 * address XOR a random key drawn at create (registry.c): an object whose
 * first word holds its pool's address (a back pointer, a common layout)
 * does not pass for a header, so a pointer 16 bytes into it is refused
 * (it was accepted, and handed out again, when the tag was the address),
 * and an object of a destroyed pool whose descriptor was reused does not
 * match the new pool. When a cached object goes back to the heap its
 * header's link becomes tag | POOL_TAG_RELEASED (the heap writes only a
 * block's first word), so a later free of it is still called a double
 * free, not a foreign object. The header area is
 * max(16, align) bytes so the object keeps its alignment; the header proper
 * is always the last 16 bytes of it, so `(pool_hdr_t *)obj - 1` finds it.
 * Cost: 16 bytes per object, one load and compare per free (the double-free
 * and wrong-pool check) and one store per alloc and per free (the state
 * bit), all on the line the list link already touches. The bytes cost more
 * than the instructions: the header moves 128/256/512-byte objects off
 * power-of-two strides, and in `keel-bench pool --case gluster` the same
 * pools with objects 16 bytes smaller did 5-8% more operations per CPU
 * second (3-5% ahead of tcmalloc instead of 3-6% behind it).
 *
 * Sub-pools and the hand-off. A sub-pool (pool_sub_t) belongs to one pool and
 * one thread, its owner; only the owner pushes and pops its lists in the fast
 * path. The sweeper (and keel_pool_sweep, keel_pool_reclaim) must also take
 * those lists, from threads that may be idle for hours. A per-sub-pool lock
 * taken by the owner on every call would be uncontended but still costs two
 * atomic RMWs (~40 cycles) per alloc+free, which breaks the 5 ns target, so
 * the owner and the sweeper use an asymmetric Dekker hand-off instead:
 *
 *   owner (fast path)              sweeper (rare, holds sp->lock)
 *   busy = 1                       req = kind         (every sub-pool)
 *   compiler barrier               membarrier()       (one for the pass)
 *   if (req) -> slow path, lock    if (!busy) take the lists, req = 0
 *   ... pop or push ...            else leave req set: the owner's next call
 *   busy = 0 (release)                  sees it, locks and does the work.
 *
 * membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) makes every running thread of
 * the process execute a full barrier, so either the owner's load of req sees
 * the sweeper's store, or the sweeper's load of busy sees the owner's store:
 * never both miss. The owner pays two plain stores and one plain load (on
 * x86 the release store and acquire load are ordinary MOVs); the sweeper
 * pays one system call per pass. Where membarrier is unavailable (old
 * kernel, seccomp), _keel_pool_fence_heavy is set and pools created from
 * then on carry POOL_F_FENCE: their owners set busy with a seq_cst exchange
 * instead (the classic symmetric Dekker, every access
 * seq_cst), about 20 cycles more per call. The same reasoning in happens-before terms, which is
 * what TSan checks: the sweeper touches lists only after an acquire load of
 * busy == 0 (which reads the owner's release store) or under sp->lock; the
 * owner touches them only after an acquire load of req == 0 (which reads the
 * sweeper's release store) or under sp->lock.
 *
 * Locks, in the order they are taken:
 *   registry lock (registry.c)  the pool table and list, every thread's slot
 *                               array as seen by other threads, sweeps (a
 *                               pass holds it throughout, so passes are
 *                               serialised: the hand-off argument needs that)
 *   pool->lock                  the pool's sub-pool list and its totals
 *   sp->lock                    sp's lists whenever req != 0
 *   sweeper mutex (sweep.c)
 */
#ifndef KEEL_POOL_IMPL_H
#define KEEL_POOL_IMPL_H

#include <keel/heap.h>
#include <keel/pool.h>

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <urcu/list.h>

#include "base/atomic.h"
#include "base/common.h"
#include "base/tls.h"

/* Header before each object; see above. Its layout is public (keel/pool.h,
 * the opt-in inline fast paths): tag = the pool's tag | POOL_TAG_FREE while
 * cached; next = the next object on a hot or cold list, stale while live. */
typedef struct keel_pool_objhdr pool_hdr_t;

#define POOL_HDR_MIN       ((size_t)sizeof(pool_hdr_t))
/* Dead descriptors kept before the oldest is reused (registry.c). */
#define POOL_RECYCLE_AFTER 16
#define POOL_TAG_FREE      ((uintptr_t)1)
#define POOL_TAG_RELEASED  ((uintptr_t)2) /* in the link: gone back to the heap */

/* Requests from a sweep to a sub-pool's owner (sp->f.req), in increasing
 * strength: a stronger one does everything a weaker one does. */
enum {
  POOL_REQ_NONE = 0,
  POOL_REQ_TRIM = 1,  /* free the cold list (keel_pool_reclaim, first pass) */
  POOL_REQ_SWEEP = 2, /* free the cold list, the hot list becomes cold */
  POOL_REQ_DRAIN = 3, /* free both lists (keel_pool_reclaim, second pass) */
};

/* pool->flags: any bit sends alloc and free to their slower hand-out. */
enum {
  POOL_F_INIT = 1u << 0,   /* ops.init set */
  POOL_F_FINI = 1u << 1,   /* ops.fini set */
  POOL_F_DEBUG = 1u << 2,  /* KEEL_DEBUG >= 1: pattern-fill freed objects, check on reuse */
  POOL_F_POISON = 1u << 3, /* ASan: cached objects are poisoned */
  POOL_F_FENCE = 1u << 4,  /* no membarrier: owners enter with a seq_cst exchange */
  POOL_F_TRACK = 1u << 5,  /* created under Valgrind: objects reported to memcheck */
  /* Blocks the heap maps one by one: one freed twice may be unmapped by
   * then, so its header is read only once the heap vouches for the block
   * (the fast paths, which read it first, are not taken). */
  POOL_F_MAPPED = 1u << 6,
};

/* Debug patterns: freed (checked on reuse) and fresh from the heap. */
#define POOL_FREE_BYTE 0xdb
#define POOL_NEW_BYTE  0xcd

/* One thread's part of one pool. Invariants: only the owner reads or writes
 * hot and cold while req == 0; anyone holding lock may while req != 0 and
 * busy == 0 (or when it is the owner). Every object on hot or cold has tag ==
 * pool | POOL_TAG_FREE. The owner's counters are written by the owner alone
 * (relaxed load + store, no RMW) and read by stats. */
typedef struct pool_sub {
  /* busy, req, hot, cold and the owner's counters: the part the fast paths
   * use, whose layout keel/pool.h publishes for the inline ones. First, so
   * that a slot's pointer to it is a pointer to the sub-pool. */
  struct keel_pool_sub_fast f;
  /* Cold fields, on their own line. */
  pthread_mutex_t lock KEEL_CACHE_ALIGNED;
  struct keel_pool *pool;
  struct pool_tls *owner;    /* the owner's slot array lives there */
  uint32_t req_before;       /* req before the current pass posted; under lock */
  struct cds_list_head link; /* on pool->subs, under pool->lock */
} KEEL_CACHE_ALIGNED pool_sub_t;

/* A pool descriptor. Descriptors are never freed while the process runs:
 * a destroyed one is marked dead and recycled, oldest first, by a later
 * create, so a stale handle is caught (and named) until then. */
struct keel_pool {
  /* Read by every call: id (index in the descriptor table and in every
   * slot array) and flags (POOL_F_*); first, layout public (keel/pool.h). */
  struct keel_pool_fast f;
  uint32_t hdr_size;  /* max(16, align): bytes before the object */
  uint32_t obj_bytes; /* obj_size, for pattern fills */
  keel_pool_ops_t ops;
  keel_atomic(int) live; /* 1 between create and destroy */
  size_t obj_size;
  size_t align;
  size_t block_size; /* hdr_size + obj_size rounded up to align: one heap block */
  char name[KEEL_POOL_NAME_MAX + 1];
  /* Slow path state. */
  pthread_mutex_t lock;
  struct cds_list_head subs; /* pool_sub_t.link; under lock */
  struct cds_list_head reg;  /* on the registry's live or recycle list */
  uint64_t gone_allocs;      /* counters of sub-pools whose threads exited; under lock */
  uint64_t gone_frees, gone_hot, gone_cold, gone_heap;
  keel_atomic(uint64_t) heap_frees; /* objects given back to the heap */
  keel_atomic(uint64_t) sweeps;
} KEEL_CACHE_ALIGNED;

/* Per-thread state: pool id -> this thread's sub-pool. Ids below
 * KEEL_POOL_FAST_SLOTS live in the exported TLS array keel_pool_slots_v2 (one
 * load from the thread pointer, in the library and in inline fast paths);
 * larger ones in `slots`, a heap array of n_slots entries indexed by id (its
 * first KEEL_POOL_FAST_SLOTS entries unused). `fast` is the thread's
 * keel_pool_slots_v2, for the threads that clear another's slots. Slots are
 * written by the owner, and cleared by keel_pool_destroy for other threads;
 * `slots` changes only under the registry lock. Each slot points to a
 * sub-pool's `f`, i.e. to the sub-pool. */
typedef struct pool_tls {
  struct keel_pool_sub_fast **fast;
  struct keel_pool_sub_fast **slots;
  uint32_t n_slots;
  bool hook_armed;
  keel_thread_hook_t hook;
} pool_tls_t;

extern KEEL_TLS pool_tls_t _keel_pool_tls KEEL_HIDDEN;

_Static_assert(offsetof(pool_sub_t, f) == 0, "a slot's pointer is the sub-pool's");
_Static_assert(offsetof(struct keel_pool, f) == 0, "keel/pool.h reads a pool as keel_pool_fast");
/* The layouts keel/pool.h publishes, version 2 (keel_pool_slots_v2). A
 * change here must rename that array to the next version, so that programs
 * built with KEEL_POOL_INLINE against the old layouts fail to load. */
_Static_assert(sizeof(struct keel_pool_objhdr) == 16 &&
                   offsetof(struct keel_pool_objhdr, next) == 8,
               "pool layout v2: object header");
_Static_assert(sizeof(struct keel_pool_fast) == 16 && offsetof(struct keel_pool_fast, flags) == 4 &&
                   offsetof(struct keel_pool_fast, tag) == 8,
               "pool layout v2: pool");
_Static_assert(sizeof(struct keel_pool_sub_fast) == 56 &&
                   offsetof(struct keel_pool_sub_fast, req) == 4 &&
                   offsetof(struct keel_pool_sub_fast, hot) == 8 &&
                   offsetof(struct keel_pool_sub_fast, cold) == 16 &&
                   offsetof(struct keel_pool_sub_fast, hot_hits) == 24 &&
                   offsetof(struct keel_pool_sub_fast, frees) == 48,
               "pool layout v2: sub-pool");
_Static_assert(KEEL_POOL_FAST_SLOTS == 32, "pool layout v2: slots");

/* Whether new pools get POOL_F_DEBUG (KEEL_DEBUG builds; tests may clear it). */
extern int _keel_pool_debug KEEL_HIDDEN;

/* True when membarrier is unavailable: new pools get POOL_F_FENCE. */
extern int _keel_pool_fence_heavy KEEL_HIDDEN;

/* List walks. urcu's cds_list_for_each_entry forms &pos->member from the
 * list head itself (a field of a keel_pool_t, or a global), which UBSan
 * reports as a misaligned member access; these walk the nodes and convert
 * only real entries. The next node is read first, so the body may unlink
 * the current one. */
#define pool_list_walk(pos, head, type, member)                                                    \
  for (struct cds_list_head *pos##_it = (head)->next, *pos##_nx = pos##_it->next;                  \
       pos##_it != (head) && ((pos) = cds_list_entry(pos##_it, type, member), 1);                  \
       pos##_it = pos##_nx, pos##_nx = pos##_it->next)
#define pool_for_each_sub(sp, p) pool_list_walk(sp, &(p)->subs, pool_sub_t, link)
#define pool_for_each_live(p)    pool_list_walk(p, &_keel_pool_live, keel_pool_t, reg)

/* ---- fast-path helpers ---- */

/* The sub-pool a slot points to (NULL stays NULL). */
KEEL_INLINE pool_sub_t *pool_sub_of(struct keel_pool_sub_fast *f) {
  return (pool_sub_t *)(void *)f;
}

KEEL_INLINE pool_sub_t *pool_sub_get(const keel_pool_t *p) {
  uint32_t id = p->f.id;
  if (keel_likely(id < KEEL_POOL_FAST_SLOTS)) return pool_sub_of(keel_pool_slots_v2[id]);
  pool_tls_t *t = &_keel_pool_tls;
  return id < t->n_slots ? pool_sub_of(t->slots[id]) : NULL;
}

/* The slot of pool `id` in t; for large ids the caller ensured n_slots,
 * for small ones t->fast is set (the thread has attached a sub-pool). */
KEEL_INLINE struct keel_pool_sub_fast **pool_slot(pool_tls_t *t, uint32_t id) {
  return id < KEEL_POOL_FAST_SLOTS ? &t->fast[id] : &t->slots[id];
}

KEEL_INLINE pool_hdr_t *pool_hdr(void *obj) {
  return (pool_hdr_t *)obj - 1;
}

/* The owner's side of the hand-off (busy, req, the counters) is
 * keel_pool_inline_enter/req/leave/count/pop/push in keel/pool.h, shared
 * with the inline fast paths. */

/* ---- handoff.c ---- */

/* Registers for expedited membarrier once; sets _keel_pool_fence_heavy if it
 * cannot. */
void _keel_pool_handoff_init(void) KEEL_HIDDEN;
/* The sweeper's barrier between storing req and loading busy. */
void _keel_pool_handoff_barrier(void) KEEL_HIDDEN;
/* Carries out request `req` on sp's lists; the caller holds sp->lock and
 * either is the owner or has seen busy == 0. Returns the detached objects
 * (a list linked through next) and their count in *n; clears sp->f.req. */
pool_hdr_t *__keel_pool_sub_service(pool_sub_t *sp, uint32_t req, size_t *n) KEEL_HIDDEN;
/* Gives a detached list back to the heap (checking debug patterns on the
 * way) and counts it in pool->heap_frees. Takes no lock. */
void _keel_pool_release_list(keel_pool_t *p, pool_hdr_t *list, size_t n,
                             const char *call) KEEL_HIDDEN;
/* Debug and tool bookkeeping (track.h) of an object entering a list, leaving
 * it for a caller, or arriving fresh from the heap. */
void _keel_pool_obj_cached(keel_pool_t *p, void *obj) KEEL_HIDDEN;
void _keel_pool_obj_reused(keel_pool_t *p, void *obj, const char *call) KEEL_HIDDEN;
void _keel_pool_obj_fresh(keel_pool_t *p, void *obj) KEEL_HIDDEN;

/* ---- registry.c ---- */

void _keel_pool_registry_lock(void) KEEL_HIDDEN;
void _keel_pool_registry_unlock(void) KEEL_HIDDEN;
/* The live pools (keel_pool_t.reg); under the registry lock. */
extern struct cds_list_head _keel_pool_live KEEL_HIDDEN;
/* Aborts naming the pool if it has been destroyed. */
void _keel_pool_check_live(const keel_pool_t *p, const char *call) KEEL_HIDDEN;

/* ---- thread.c ---- */

/* The calling thread's sub-pool of p, created on first use; NULL and ENOMEM
 * if it cannot be allocated. */
pool_sub_t *_keel_pool_sub_attach(keel_pool_t *p) KEEL_HIDDEN;
/* Unlinks sp from its pool and frees it, returning its cached objects in
 * *list (count in *n). Caller holds the registry lock and pool->lock. */
void __keel_pool_sub_retire(pool_sub_t *sp, pool_hdr_t **list, size_t *n) KEEL_HIDDEN;

/* ---- sweep.c ---- */

/* Starts the sweeper thread if it is not running. */
void _keel_pool_sweeper_ensure(void) KEEL_HIDDEN;
/* Tells the sweeper thread to stop; returns true and its id (for the
 * caller to join, holding no pool lock) if one was running. */
bool _keel_pool_sweeper_stop_begin(pthread_t *tid) KEEL_HIDDEN;
/* Tests: when set, no sweeper thread is started (forked children under
 * TSan, which cannot start threads after a multi-threaded fork). */
extern keel_atomic(int) _keel_pool_sweeper_manual KEEL_HIDDEN;
/* Wakes the sweeper now (tests: after changing pool_sweep_s). */
void _keel_pool_sweeper_kick(void) KEEL_HIDDEN;
/* Sweeps passes done by the sweeper thread since start (tests). */
uint64_t _keel_pool_sweeper_passes(void) KEEL_HIDDEN;
/* One pass of request `req` over pools (all live pools if p == NULL),
 * stopping once `goal` bytes are freed. Caller holds the registry lock.
 * Returns the bytes freed by this call (not those left to owners). */
size_t __keel_pool_sweep_pass(keel_pool_t *p, uint32_t req, size_t goal) KEEL_HIDDEN;
/* fork handlers' share: the sweeper mutex, and a reset in the child. */
void _keel_pool_sweeper_atfork_prepare(void) KEEL_HIDDEN;
void _keel_pool_sweeper_atfork_parent(void) KEEL_HIDDEN;
void _keel_pool_sweeper_atfork_child(void) KEEL_HIDDEN;

#endif /* KEEL_POOL_IMPL_H */
