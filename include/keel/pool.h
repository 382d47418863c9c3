/* keel pool: typed object pools with per-thread hot and cold lists.
 *
 * A pool hands out objects of one size and alignment (one pool per object
 * type: dictionaries, call stubs, frames). Each thread that uses a pool gets
 * a private sub-pool holding two lists of cached objects: hot and cold.
 * keel_pool_alloc takes from the calling thread's hot list, then its cold
 * list, then keel's heap; keel_pool_free puts the object on the *freeing*
 * thread's hot list (LIFO, so the next allocation gets a cache-warm object),
 * whichever thread allocated it. One sweeper thread for the process wakes
 * every pool_sweep_s (KEEL_OPTIONS, default 10 s) and, for every sub-pool,
 * frees the cold list to the heap and turns the hot list cold. A busy pool
 * thus tends to no heap calls at all and an idle one holds no memory after
 * two periods. A thread's sub-pools are emptied into the heap when it exits.
 *
 * Concurrency: alloc, zalloc and free may run on any threads at once, on the
 * same or different pools; their fast paths take no lock, make no system
 * call and execute no atomic read-modify-write. create, sweep, stats,
 * print_stats and reclaim may run concurrently with everything; destroy must
 * not run concurrently with any other use of the same pool.
 *
 * Memory: what a sweep frees has been unused for a whole period, so the
 * sweeper then asks the heap to return free memory to the OS at once
 * (keel_heap_collect) rather than after heap_purge_ms. Objects come from
 * the heap's shared heaps, not the allocating thread's, so the pages a sweep
 * empties go back even while the threads that used them stay blocked
 * (option pool_shared_heap=0: thread heaps, cheaper heap calls, but an idle
 * thread keeps its pages until it runs again). After fork() the
 * child restarts the sweeper on its first heap call; sub-pools of threads
 * that were inside a pool call at the fork are never swept in the child.
 *
 * Misuse aborts with one line on stderr: freeing into the wrong pool
 * ("keel: keel_pool_free: 0x... does not belong to pool 'dict'"), a double
 * free ("keel: keel_pool_free: double free of 0x... in pool 'dict'"), any
 * use of a destroyed pool, or a NULL pool ("keel: keel_pool_alloc: NULL
 * pool"). Each object carries a 16-byte header for these checks (more for
 * alignments above 16).
 */
#ifndef KEEL_POOL_H
#define KEEL_POOL_H

#include <keel/keel.h>

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct keel_pool keel_pool_t;

/* Largest object and alignment a pool accepts; larger requests are EINVAL. */
#define KEEL_POOL_MAX_OBJ   ((size_t)16 << 20)
#define KEEL_POOL_MAX_ALIGN ((size_t)4096)
/* Longest pool name kept (longer names are cut). */
#define KEEL_POOL_NAME_MAX  31

/* Optional hooks. init runs on every object keel_pool_alloc/zalloc is about
 * to return (after zeroing, for zalloc); fini runs on every object passed to
 * keel_pool_free before it is cached. They run in the calling thread, outside
 * any pool lock, and may use other pools. */
typedef struct keel_pool_ops {
  void (*init)(void *obj, void *arg);
  void (*fini)(void *obj, void *arg);
  void *arg;
} keel_pool_ops_t;

/* Per-pool counters, summed over every thread (exact when the pool is
 * quiescent, approximate while threads use it). Invariants:
 *   hot_hits + cold_hits + heap_allocs = allocs
 *   live = allocs - frees
 *   cached_objects = heap_allocs - heap_frees - live */
typedef struct keel_pool_stats {
  const char *name;      /* the pool's name (valid while the pool lives) */
  size_t obj_size;       /* bytes asked for at create */
  size_t block_bytes;    /* heap bytes each object occupies, header included */
  uint64_t allocs;       /* keel_pool_alloc + keel_pool_zalloc calls */
  uint64_t frees;        /* keel_pool_free calls */
  uint64_t hot_hits;     /* allocations served from a hot list */
  uint64_t cold_hits;    /* allocations served from a cold list */
  uint64_t heap_allocs;  /* allocations that called the heap */
  uint64_t heap_frees;   /* cached objects given back to the heap */
  uint64_t live;         /* objects allocated and not yet freed */
  uint64_t cached;       /* objects on hot and cold lists */
  uint64_t cached_bytes; /* cached * block_bytes */
  uint64_t sweeps;       /* sweep passes over this pool (sweeper or keel_pool_sweep) */
  uint64_t threads;      /* sub-pools alive (threads that used the pool and live) */
} keel_pool_stats_t;

/* Creates a pool of obj_size-byte objects aligned to align (0: 16, like
 * malloc). Returns NULL with errno EINVAL for obj_size 0 or above
 * KEEL_POOL_MAX_OBJ, an align that is not 0 or a power of two up to
 * KEEL_POOL_MAX_ALIGN, or a NULL name; ENOMEM when out of memory. Allocates;
 * starts the sweeper thread on first use. ops is copied. */
KEEL_API keel_pool_t *keel_pool_create(const char *name, size_t obj_size, size_t align,
                                       const keel_pool_ops_t *ops_or_NULL);

/* An object of the pool (contents undefined; in debug builds a pattern);
 * NULL with ENOMEM when the heap is exhausted. Never blocks on other users of
 * the pool in the common case: lock-free and RMW-free from a hot list. */
KEEL_API void *keel_pool_alloc(keel_pool_t *pool);

/* keel_pool_alloc, with the object zeroed (before the init hook runs). */
KEEL_API void *keel_pool_zalloc(keel_pool_t *pool);

/* Returns obj to the calling thread's hot list; a NULL obj is a no-op with
 * any pool, as free(NULL) is. Aborts if obj is not from this pool or already
 * free, or pool is NULL. Calls the heap only when the thread has no sub-pool
 * (out of memory) or finds a sweep request to serve. */
KEEL_API void keel_pool_free(keel_pool_t *pool, void *obj);

/* Destroys an empty pool: every cached object goes back to the heap and the
 * handle becomes invalid (a later use aborts naming the pool, until a later
 * keel_pool_create recycles the descriptor). Returns KEEL_EBUSY, leaving the
 * pool intact and usable, while objects are live. Blocks on the sweeper. */
KEEL_API int keel_pool_destroy(keel_pool_t *pool);

/* Runs one sweep of this pool now (cold lists to the heap, hot lists turn
 * cold), as the sweeper would; a sub-pool whose thread is inside a pool call
 * at that moment is swept by that thread on its next call. Returns 0. */
KEEL_API int keel_pool_sweep(keel_pool_t *pool);

/* Fills *st with the pool's counters; does not allocate or block users. */
KEEL_API void keel_pool_stats(const keel_pool_t *pool, keel_pool_stats_t *st);

/* Prints one line per pool in the process (name, sizes, counters, cached
 * bytes) and a total. Takes the registry lock; may run at any time. */
KEEL_API void keel_pool_print_stats(FILE *out);

/* Frees cached objects of every pool to the heap now, cold lists before hot
 * ones, until at least `bytes` are freed or nothing idle is cached (SIZE_MAX:
 * everything), and hands the heap's free pages to the OS when that was 256
 * KiB or more. Returns the bytes freed. For memory-pressure handlers. */
KEEL_API size_t keel_pool_reclaim(size_t bytes);

/* ---- Inline fast paths (opt-in) ------------------------------------------
 *
 * A program that defines KEEL_POOL_INLINE before including this header gets
 * keel_pool_alloc and keel_pool_free as inline functions: the hot-list pop
 * and push (about a dozen instructions each, no call) run in the caller, and
 * everything else (first use of a pool by a thread, an empty hot list, a
 * pending sweep, hooks, debug and sanitizer builds, misuse) calls the
 * library's functions, which behave exactly as without the option. Like
 * liburcu's _LGPL_SOURCE, this compiles the layouts below into the program:
 * they are versioned by the name of the TLS array the program links against
 * (keel_pool_slots_v2), so a program built against other layouts fails to
 * load rather than misread them. Measured in `keel-bench pool` (2 cores):
 * 2.1 against 3.0 ns per alloc+free pair, and 7-15% more operations per CPU
 * second in the gluster case. The names (&keel_pool_alloc included) still
 * refer to the library's functions. Needs C11 atomics; C++ and older C get
 * the calls.
 *
 * What follows is not API: the structures are the first members of keel's
 * own pool, sub-pool and object header, and the helpers are the owner's side
 * of the sweeper hand-off, which the library's functions use too (one
 * implementation; see src/pool/pool_impl.h). */
#if !defined(__cplusplus) && defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L &&           \
    !defined(__STDC_NO_ATOMICS__)
#include <stdatomic.h>
#include <stdbool.h>

/* The header before each object: the owning pool's tag (bit 0 set while
 * cached) and the link of the hot or cold list it sits on. */
struct keel_pool_objhdr {
  uintptr_t tag;
  struct keel_pool_objhdr *next;
};

/* The part of a thread's sub-pool that the fast paths use. */
struct keel_pool_sub_fast {
  _Atomic uint32_t busy; /* 1 while the owner is inside a fast path */
  _Atomic uint32_t req;  /* pending sweep work (0: none) */
  struct keel_pool_objhdr *hot, *cold;
  _Atomic uint64_t hot_hits, cold_hits, heap_allocs, frees; /* owner-written */
};

/* The first fields of a pool: its id (slot index), flags (any bit sends
 * every call to the library's slower paths) and the tag its live objects
 * carry (its address XOR a random key drawn at create, bit 0 clear). */
struct keel_pool_fast {
  uint32_t id;
  uint32_t flags;
  uintptr_t tag;
};

/* The calling thread's sub-pools of the pools with ids below
 * KEEL_POOL_FAST_SLOTS. The suffix is the layout version above. */
#define KEEL_POOL_FAST_SLOTS 32
extern KEEL_API _Thread_local struct keel_pool_sub_fast *keel_pool_slots_v2[KEEL_POOL_FAST_SLOTS];

/* Enters the owner's side of the sweeper hand-off: busy = 1, then the
 * compiler may not move the req load above it (the sweeper's membarrier
 * supplies the CPU's half); `heavy` (pools made where membarrier is missing)
 * uses a full-barrier exchange instead. */
static inline void keel_pool_inline_enter(struct keel_pool_sub_fast *sp, bool heavy) {
  if (heavy)
    atomic_exchange_explicit(&sp->busy, 1, memory_order_seq_cst);
  else
    atomic_store_explicit(&sp->busy, 1, memory_order_relaxed);
  atomic_signal_fence(memory_order_seq_cst);
}

/* seq_cst (a plain load on x86): with heavy, a symmetric Dekker. */
static inline uint32_t keel_pool_inline_req(struct keel_pool_sub_fast *sp) {
  return atomic_load_explicit(&sp->req, memory_order_seq_cst);
}

/* Release: a sweeper that reads busy == 0 sees the list writes before it. */
static inline void keel_pool_inline_leave(struct keel_pool_sub_fast *sp) {
  atomic_store_explicit(&sp->busy, 0, memory_order_release);
}

/* Owner-written counter: a load and a store, no locked add. */
static inline void keel_pool_inline_count(_Atomic uint64_t *c) {
  atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + 1, memory_order_relaxed);
}

/* Pops the head of sp's hot list, or NULL (empty, or a sweep request
 * pending: the caller then takes the locked path). hot is read only after
 * req: while req is set the sweeper may be taking the lists. */
static inline struct keel_pool_objhdr *keel_pool_inline_pop(struct keel_pool_sub_fast *sp,
                                                            bool heavy) {
  struct keel_pool_objhdr *h = NULL;
  keel_pool_inline_enter(sp, heavy);
  if (__builtin_expect(keel_pool_inline_req(sp) == 0, 1)) {
    h = sp->hot;
    if (__builtin_expect(h != NULL, 1)) {
      sp->hot = h->next;
      keel_pool_inline_count(&sp->hot_hits);
    }
  }
  keel_pool_inline_leave(sp);
  return h;
}

/* Pushes h on sp's hot list; false if a sweep request is pending. */
static inline bool keel_pool_inline_push(struct keel_pool_sub_fast *sp, struct keel_pool_objhdr *h,
                                         bool heavy) {
  keel_pool_inline_enter(sp, heavy);
  if (__builtin_expect(keel_pool_inline_req(sp) != 0, 0)) {
    keel_pool_inline_leave(sp);
    return false;
  }
  h->next = sp->hot;
  sp->hot = h;
  keel_pool_inline_count(&sp->frees);
  keel_pool_inline_leave(sp);
  return true;
}

#ifdef KEEL_POOL_INLINE
/* A NULL pool goes to the library's function before anything is read
 * through it: that one aborts naming the call, not with a SIGSEGV. */
static inline void *keel_pool_inline_alloc(keel_pool_t *pool) {
  const struct keel_pool_fast *pf = (const struct keel_pool_fast *)(const void *)pool;
  if (__builtin_expect(pool != NULL && pf->flags == 0 && pf->id < KEEL_POOL_FAST_SLOTS, 1)) {
    struct keel_pool_sub_fast *sp = keel_pool_slots_v2[pf->id];
    if (__builtin_expect(sp != NULL, 1)) {
      struct keel_pool_objhdr *h = keel_pool_inline_pop(sp, false);
      if (__builtin_expect(h != NULL, 1)) {
        h->tag = pf->tag;
        return h + 1;
      }
    }
  }
  return (keel_pool_alloc)(pool);
}

static inline void keel_pool_inline_free(keel_pool_t *pool, void *obj) {
  const struct keel_pool_fast *pf = (const struct keel_pool_fast *)(const void *)pool;
  if (__builtin_expect(
          obj != NULL && pool != NULL && pf->flags == 0 && pf->id < KEEL_POOL_FAST_SLOTS, 1)) {
    struct keel_pool_objhdr *h = (struct keel_pool_objhdr *)obj - 1;
    struct keel_pool_sub_fast *sp = keel_pool_slots_v2[pf->id];
    /* The tag check (wrong pool, double free) before anything is written;
     * the library's path names the error. An object at a page start is
     * left to it too: its header may sit on an unmapped page if obj is
     * not a pool object at all. */
    if (__builtin_expect(sp != NULL && ((uintptr_t)obj & 4095) != 0 && h->tag == pf->tag, 1)) {
      h->tag = pf->tag | 1u;
      if (__builtin_expect(keel_pool_inline_push(sp, h, false), 1)) return;
      h->tag = pf->tag; /* live again for the library's path */
    }
  }
  (keel_pool_free)(pool, obj);
}

#define keel_pool_alloc(pool)     keel_pool_inline_alloc(pool)
#define keel_pool_free(pool, obj) keel_pool_inline_free(pool, obj)
#endif /* KEEL_POOL_INLINE */
#elif defined(KEEL_POOL_INLINE)
#error "KEEL_POOL_INLINE needs C11 with atomics (C++ and older C: leave it undefined)"
#endif /* C11 atomics */

#ifdef __cplusplus
}
#endif
#endif /* KEEL_POOL_H */
