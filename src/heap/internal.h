/* keel heap internals: segments, pages, thread heaps. Never installed.
 *
 * Layout (why each choice is made is in the file that owns it):
 *   segment  4 MiB, 4 MiB-aligned, from mmap (segment.c). Slice 0 (the first
 *            64 KiB) holds the segment header and the descriptors of every
 *            page: metadata lives out of line, so an overflow out of a user
 *            block can reach other blocks' free-list links but never a page
 *            descriptor, a list head or a counter. Slices 1..63 hold pages.
 *   page     a span of 1, 4, 8 or 16 slices (64 KiB to 1 MiB) carved
 *            into blocks of one size class (page.c). A page belongs to one
 *            thread heap (its owner), or to nobody while abandoned.
 *   heap     per-thread: the current page of every class plus the owner's
 *            queues (heap.c). Fast paths (alloc.h) touch only the calling
 *            thread's heap and that heap's pages.
 *   large    requests above KEEL_LARGE_MAX are mapped directly (large.c),
 *            also 4 MiB-aligned, with the same header at their base, so that
 *            `p & ~(segment size - 1)` finds the header of every keel block.
 *   segmap   a bitmap over the address space (segment.c): bit set iff the
 *            4 MiB unit is the base of a live keel segment or large mapping,
 *            so free() of a pointer keel never returned is detected before
 *            anything is read through it.
 *
 * Free lists are singly linked through the first word of each free block.
 * That word holds `next ^ page->key` (encode/decode below): the key is random
 * per page with bit 63 set, so an overflow that writes ordinary data (text,
 * small integers, pointers: bit 63 clear) over a link decodes to a
 * non-canonical address; the pop that meets it dies naming the block
 * ("free-list link of 0x... overwritten") instead of handing out a wild
 * pointer. Lists end with the encoded segment base, never NULL: every
 * correctly decoded link then lies in the same segment as its block, which
 * is what that check and the double-free check key on.
 */
#ifndef KEEL_HEAP_INTERNAL_H
#define KEEL_HEAP_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "base/common.h"
#include "base/tls.h"

#define KEEL_SEGMENT_SHIFT 22 /* 4 MiB: 64 slices; one header slice is 1.6% of address space */
#define KEEL_SEGMENT_SIZE  ((size_t)1 << KEEL_SEGMENT_SHIFT)
#define KEEL_SEGMENT_MASK  (KEEL_SEGMENT_SIZE - 1)
#define KEEL_SLICE_SHIFT   16 /* 64 KiB: the small page */
#define KEEL_SLICE_SIZE    ((size_t)1 << KEEL_SLICE_SHIFT)
#define KEEL_SLICES        (KEEL_SEGMENT_SIZE / KEEL_SLICE_SIZE)
#define KEEL_HEADER_SLICES 1 /* the segment header: about 8.3 KiB */

/* Size classes (classes.c). */
#define KEEL_SMALL_MAX       1024 /* served by the one-table lookup in the fast path */
#define KEEL_LARGE_MAX       ((size_t)256 << 10) /* largest class; above: mapped directly */
#define KEEL_SHARED_MIN      ((size_t)8 << 10)   /* classes above: shared heaps (heap.c) */
#define KEEL_CLASS_COUNT_MAX 120
/* The one class off the regular spacing: a 4 KiB page plus a 16-byte
 * header, in 512 KiB pages (classes.c). */
#define KEEL_CLASS_PAGE_HDR  4112u

/* Blocks are aligned to at least 8; classes that are multiples of 16 to 16. */
#define KEEL_MIN_ALIGN 8

/* Pages: owner-side state is touched only by the owning thread, or by a
 * thread holding the owner's heap lock while the page is IN_FULL (the owner's
 * fast paths never touch a full page: flags != 0 sends them to the slow path),
 * or under its class's stripe lock (segment.c) while the page is abandoned.
 *
 * Invariant (owner view): blocks on `free` + blocks on `local_free` + used
 *   == capacity, where `used` still counts blocks other threads have pushed
 *   on `thread_free` but the owner has not collected; capacity <= reserved.
 */
typedef struct keel_block {
  uintptr_t next; /* encoded: see the file comment */
} keel_block_t;

/* thread_free: [count:16][pointer:46, 8-aligned][state:2]. The count is the
 * number of blocks on the list, so collecting is one exchange and one
 * subtraction, not a walk. */
enum {
  KEEL_TF_NORMAL = 0,   /* remote frees push on the page */
  KEEL_TF_USE_DELAYED,  /* page is full: the next remote free goes to the owner heap's list */
  KEEL_TF_DELAYING,     /* a remote freer is pushing to the owner heap's list right now */
  KEEL_TF_NEVER_DELAYED /* abandoned, or being abandoned: always push on the page */
};
#define KEEL_TF_STATE(w) ((unsigned)((w)&3u))
#define KEEL_TF_PTR(w)   ((keel_block_t *)((w) & (((uintptr_t)1 << 48) - 8)))
#define KEEL_TF_COUNT(w) ((uint32_t)((w) >> 48))
#define KEEL_TF_MAKE(ptr, count, state)                                                            \
  ((uintptr_t)(ptr) | ((uintptr_t)(count) << 48) | (uintptr_t)(state))

/* flags: any bit set sends the owner's free to the slow path. */
#define KEEL_PAGE_IN_FULL 1u

struct keel_heap;

typedef struct keel_page {
  /* First cache line: everything the malloc and free fast paths touch
   * (descriptors are 64-byte aligned), so each touches one line of it. */
  keel_block_t *free;       /* owner: blocks to hand out; empty when (ptr & SEGMENT_MASK) == 0 */
  keel_block_t *local_free; /* owner: blocks its slow-path frees left since the last collect */
  uintptr_t key;            /* encodes this page's links; random, bit 63 set */
  uint64_t div_magic;       /* ceil(2^64 / bsize): off % bsize == 0 iff off * magic < magic */
  uint8_t *start;           /* first block */
  keel_atomic(struct keel_heap *) heap; /* owner; NULL while abandoned or unused */
  keel_atomic(size_t) allocs;           /* blocks handed out (statistics: see below) */
  keel_atomic(uint32_t) used; /* owner: blocks handed out and not back on free/local_free */
  keel_atomic(uint8_t) flags; /* KEEL_PAGE_IN_FULL: written by the owner under its heap lock */
  uint8_t cls;                /* size class */
  /* Blocks carved so far (lazily, a few KiB at a time): the free paths'
   * bound on a pointer (_keel_page_is_carved), so it sits in this line.
   * Written by the owner (or lock holder) only; other threads read it
   * racily, which is safe because it only grows while the page lives: a
   * block a freer got from the program was carved before it was handed
   * out, so any value read covers it. 16 bits: a page holds at most 8192
   * blocks (64 KiB of 8-byte ones), and thread_free counts them in 16. */
  keel_atomic(uint16_t) capacity;
  /* Second line: slow paths and remote frees. */
  keel_atomic(uintptr_t) thread_free; /* blocks freed by other threads (see above) */
  struct keel_page *next, *prev;      /* in the owner's queue / full list, or abandoned */
  uint32_t reserved;                  /* blocks that fit in the page */
  uint32_t bsize;                     /* block size; 0 while the span is not a page */
  uint8_t slices;                     /* span length in slices */
  uint8_t abandoned;                  /* on an abandoned queue (its lock; debug checks) */
  keel_atomic(uint32_t) samples;      /* requests sampled into `requested` (slow paths) */
  /* Statistics (`allocs` above, and these), written by the owner with
   * relaxed load+store (no atomic add), read by keel_heap_stats under the
   * segment lock; folded into the class totals when the page is freed. Kept
   * in the page, not the heap, so the fast paths reach them without
   * indexing by class. The owner's frees are not counted but derived:
   * allocs - used - remote_in (__keel_page_frees), all three read by any
   * thread. A count of its own cost the free fast path a store to this
   * page's second line (5-8% of heap/churn); a count kept only at the
   * page's slow-path points, as before, lagged without bound: a thread whose
   * current page never ran dry showed another thread's keel_heap_stats
   * every block it had ever allocated there as live (5.9 million for
   * 32,768). */
  keel_atomic(size_t) requested;   /* bytes asked for by the sampled allocations */
  keel_atomic(uint64_t) remote_in; /* owner: blocks other threads freed that reached its lists */
} KEEL_CACHE_ALIGNED keel_page_t;

_Static_assert(sizeof(keel_page_t) == 128, "page descriptor is indexed by shift");
_Static_assert(__builtin_offsetof(keel_page_t, capacity) < 64, "fast-path fields share a line");

enum { KEEL_SEG_SMALL = 0x5e6a11, KEEL_SEG_LARGE = 0x5e61a6e, KEEL_SEG_LARGE_CACHED = 0x5e6ca4e };

/* The header at the base of every segment and large mapping. For a large
 * mapping only the first fields and pages[0] (all zero: bsize 0, heap NULL)
 * are meaningful; pages[0] makes the small-free fast path fall through to the
 * slow path for large blocks without a kind test. */
typedef struct keel_segment {
  uint32_t kind;
  uint8_t slice_head[KEEL_SLICES]; /* slice -> first slice of its span */
  /* small segments, under the segment lock: */
  uint64_t used_mask;               /* slices in use (bit 0: this header) */
  uint64_t dirty_mask;              /* free slices whose memory is still resident */
  uint64_t purge_at;                /* coarse ms after which dirty slices may be purged */
  uint64_t purging_mask;            /* dirty slices a purger holds (as used) without the lock */
  struct keel_segment *next, *prev; /* all small segments */
  /* large mappings: */
  size_t mapped;   /* bytes mapped from base */
  size_t user_off; /* user pointer - base */
  size_t req;      /* bytes asked for */
  keel_page_t pages[KEEL_SLICES];
} keel_segment_t;

/* Bytes before a large block's user data: the header and pages[0]. */
#define KEEL_LARGE_HDR 4096
_Static_assert(__builtin_offsetof(keel_segment_t, pages) + sizeof(keel_page_t) <= KEEL_LARGE_HDR,
               "large header covers pages[0]");

typedef struct keel_page_queue {
  keel_page_t *first, *last;
} keel_page_queue_t;

/* Page queue links (next/prev). The caller holds the lock of the queue's
 * owner: the heap lock for a heap's queues, the class's stripe lock for
 * an abandoned queue (segment.c). */
KEEL_INLINE void __keel_page_queue_remove(keel_page_queue_t *q, keel_page_t *page) {
  if (page->prev != NULL)
    page->prev->next = page->next;
  else
    q->first = page->next;
  if (page->next != NULL)
    page->next->prev = page->prev;
  else
    q->last = page->prev;
  page->next = page->prev = NULL;
}

KEEL_INLINE void __keel_page_queue_push_back(keel_page_queue_t *q, keel_page_t *page) {
  page->next = NULL;
  page->prev = q->last;
  if (q->last != NULL)
    q->last->next = page;
  else
    q->first = page;
  q->last = page;
}

KEEL_INLINE void __keel_page_queue_push_front(keel_page_queue_t *q, keel_page_t *page) {
  page->prev = NULL;
  page->next = q->first;
  if (q->first != NULL)
    q->first->prev = page;
  else
    q->last = page;
  q->first = page;
}

/* A thread heap. `direct` is the fast path's; queues, the full list and
 * full pages are changed by the owner in its slow paths or by a collector
 * working on the owner's full pages, never both at once (heap.c: the
 * owner/collector exclusion). Nothing but the registry (under its lock) and
 * remote freers in the DELAYING state (which abandonment waits out) reach a
 * heap from another thread, so an exited thread's heap may be unmapped. */
typedef struct keel_heap {
  keel_page_t *direct[KEEL_CLASS_COUNT_MAX]; /* current page per class, or &_keel_empty_page */
  /* Blocks of other threads' pages this thread freed, per class: written by
   * this thread only (relaxed load+store), summed by keel_heap_stats. */
  keel_atomic(size_t) remote_frees[KEEL_CLASS_COUNT_MAX];
  keel_atomic(int) lock;       /* collectors, and owners without membarrier (heap.c) */
  keel_atomic(int) owner_busy; /* owner is in a slow path (asymmetric handshake) */
  keel_atomic(int) collector;  /* a collector holds the heap (asymmetric handshake) */
  keel_page_queue_t queue[KEEL_CLASS_COUNT_MAX]; /* pages with free blocks; current first */
  keel_page_queue_t full;                        /* IN_FULL pages */
  keel_atomic(keel_block_t *) delayed;           /* remote frees into full pages (raw next links) */
  uint64_t rng;                                  /* page keys */
  keel_thread_hook_t exit_hook;
  struct keel_heap *next_all, *prev_all; /* every mapped heap (registry) */
  struct keel_heap *next_free;
  bool active;
} keel_heap_t;

/* --- globals --- */
extern keel_page_t _keel_empty_page KEEL_HIDDEN;
extern keel_heap_t _keel_empty_heap KEEL_HIDDEN;
extern KEEL_TLS keel_heap_t *_keel_heap_tls KEEL_HIDDEN;

/* --- size classes (classes.c) --- */
extern uint8_t _keel_class_small[KEEL_SMALL_MAX / 8 + 1] KEEL_HIDDEN; /* (size+7)/8 -> class */
extern uint32_t _keel_class_size[KEEL_CLASS_COUNT_MAX] KEEL_HIDDEN;
extern unsigned _keel_class_count KEEL_HIDDEN;
void _keel_classes_init(void) KEEL_HIDDEN;
unsigned _keel_class_of(size_t size) KEEL_HIDDEN; /* size <= KEEL_LARGE_MAX */
unsigned _keel_class_slices(unsigned cls) KEEL_HIDDEN;
/* Smallest class >= size whose block size is a multiple of align, or -1. */
int _keel_class_aligned(size_t size, size_t align) KEEL_HIDDEN;

/* --- segments (segment.c) --- */
extern keel_atomic(uint64_t) _keel_segmap[] KEEL_HIDDEN;
#define KEEL_SEGMAP_WORDS ((size_t)1 << (47 - KEEL_SEGMENT_SHIFT - 6))
/* Whether the map has a bit for p: not above the 47-bit space (5-level
 * paging hands such addresses out only on request, so a mapping is refused
 * there rather than expected). */
static inline bool _keel_segmap_covers(const void *p) {
  return ((uintptr_t)p >> KEEL_SEGMENT_SHIFT >> 6) < KEEL_SEGMAP_WORDS;
}
void _keel_segmap_set(void *seg, bool on) KEEL_HIDDEN;
keel_page_t *_keel_page_alloc(unsigned cls, keel_heap_t *heap) KEEL_HIDDEN;
void _keel_page_free(keel_page_t *page) KEEL_HIDDEN;
void _keel_page_abandon(keel_page_t *page) KEEL_HIDDEN;
/* Thread exit's batch: frees the pages on `list` (chained through `next`,
 * no block out) under one hold of the segment lock. */
void _keel_pages_free(keel_page_t *list) KEEL_HIDDEN;
keel_page_t *_keel_page_adopt(unsigned cls, keel_heap_t *heap) KEEL_HIDDEN;
/* Purges what has been free longer than the delay (all of it with force);
 * frees abandoned pages whose blocks all came back. Returns bytes purged. */
size_t _keel_segments_collect(bool force) KEEL_HIDDEN;
/* Where the process limits its address space (RLIMIT_AS), unmaps the
 * retained segments (segment.c), from the most recent, until one fails to
 * unmap (the mapping-count limit); true if any went. */
bool _keel_segments_unretain_for_space(void) KEEL_HIDDEN;
void _keel_segments_lock(void) KEEL_HIDDEN;
void _keel_segments_unlock(void) KEEL_HIDDEN;
/* Fork: the statistics locks, taken first in the prepare handler (stats.c). */
void _keel_stats_fork_lock(void) KEEL_HIDDEN;
void _keel_stats_fork_unlock(void) KEEL_HIDDEN;
/* fork child: slices whose purge a thread of the parent had under way go
 * back to the dirty set (that thread does not exist here to free them). */
void _keel_segments_fork_child(void) KEEL_HIDDEN;
/* Tests: called by a purger while it holds slices without the segment lock. */
extern void (*_keel_segment_purge_pause)(void) KEEL_HIDDEN;

typedef struct keel_seg_totals {
  size_t mapped, committed, purged, abandoned_pages;
  size_t pages[KEEL_CLASS_COUNT_MAX];
  size_t allocs[KEEL_CLASS_COUNT_MAX], requested[KEEL_CLASS_COUNT_MAX], frees[KEEL_CLASS_COUNT_MAX];
  size_t samples[KEEL_CLASS_COUNT_MAX];
} keel_seg_totals_t;
void _keel_segments_totals(keel_seg_totals_t *t) KEEL_HIDDEN;

/* --- pages (page.c) --- */
void _keel_page_init(keel_page_t *page, unsigned cls, keel_heap_t *heap) KEEL_HIDDEN;
/* Collects local_free and thread_free so that `free` is non-empty if the
 * page has a free block (some may stay on local_free, which the malloc fast
 * path takes next); carves more if free is still empty. */
void __keel_page_collect(keel_page_t *page) KEEL_HIDDEN;
/* The two halves: collect only, and carve only (if free is empty). */
void __keel_page_collect_lists(keel_page_t *page) KEEL_HIDDEN;
void __keel_page_extend(keel_page_t *page) KEEL_HIDDEN;
/* Collects local_free and thread_free, then returns to the OS the
 * whole OS pages inside free blocks (all but the page holding each block's
 * link): what malloc_trim can give back from pages that still hold live
 * blocks. Only blocks larger than an OS page have such interiors. Owner, or
 * its class's stripe lock for an abandoned page. Returns the bytes purged. */
size_t __keel_page_purge_free(keel_page_t *page) KEEL_HIDDEN;
/* Subtracts a collected thread_free list from used and gives it to free,
 * or to local_free when free is not empty (appended only if neither is). */
void __keel_page_collect_thread_free(keel_page_t *page) KEEL_HIDDEN;
KEEL_NORETURN void _keel_die_double_free(const char *call, void *p) KEEL_HIDDEN;
KEEL_NORETURN void _keel_die_invalid(const char *call, const void *p) KEEL_HIDDEN;
/* A page list's link leads out of its block b's segment: dies naming b.
 * Declared to return (it never does) so the pop reaches it by a tail jump. */
void *_keel_page_bad_link(const void *b) KEEL_HIDDEN;
bool _keel_page_has_free_block(keel_page_t *page, keel_block_t *b) KEEL_HIDDEN;
/* The same walk made by a thread that does not own the page, for a block
 * whose link already says it is free (a cross-thread double free). The
 * owner may change the lists meanwhile: a correct program's block is on no
 * list at any moment, so the walk cannot find it there; a block freed
 * twice is found while it stays on a list of its page. */
bool _keel_page_has_free_block_remote(keel_page_t *page, keel_block_t *b) KEEL_HIDDEN;
/* Full check of a page (owner, or lock holder): lists well formed and
 * free + local_free + used == capacity. For tests and KEEL_ASSERT_FULL. */
bool _keel_page_validate(const keel_page_t *page) KEEL_HIDDEN;

/* --- heaps (heap.c) --- */
keel_heap_t *_keel_heap_init_thread(void) KEEL_HIDDEN;
void *_keel_malloc_generic(keel_heap_t *heap, size_t size) KEEL_HIDDEN;
void *_keel_malloc_in_class(unsigned cls, size_t size) KEEL_HIDDEN;
size_t _keel_heaps_active(void) KEEL_HIDDEN;
void _keel_free_generic(void *p, const char *call) KEEL_HIDDEN;
/* Dies with "double free" if p, a block of page, is on one of the page's
 * free lists (checked when the calling thread owns the page). */
void _keel_check_not_free(keel_page_t *page, void *p, const char *call) KEEL_HIDDEN;
/* free of a block whose page another heap owns (or nobody): the segment map
 * was checked; validates the offset and pushes on the page's thread_free. */
void _keel_free_other(keel_page_t *page, void *p, const char *call) KEEL_HIDDEN;
void _keel_heap_page_emptied(keel_heap_t *heap, keel_page_t *page) KEEL_HIDDEN;
void _keel_heaps_collect(bool force) KEEL_HIDDEN;
typedef void (*keel_heap_visit_fn)(keel_heap_t *heap, void *arg);
void _keel_heaps_visit(keel_heap_visit_fn fn, void *arg) KEEL_HIDDEN;
void _keel_heap_fork_prepare(void) KEEL_HIDDEN;
void _keel_heap_fork_parent(void) KEEL_HIDDEN;
void _keel_heap_fork_child(void) KEEL_HIDDEN;
/* Frees of other threads' blocks by threads without a heap (never allocated,
 * or exited). */
extern keel_atomic(size_t) _keel_orphan_frees[KEEL_CLASS_COUNT_MAX] KEEL_HIDDEN;

/* --- large blocks (large.c) --- */
void *_keel_large_alloc(size_t size, size_t align, bool zero) KEEL_HIDDEN;
void _keel_large_free(keel_segment_t *seg) KEEL_HIDDEN;
void *_keel_large_realloc(keel_segment_t *seg, size_t size) KEEL_HIDDEN;
void _keel_large_release_lock(void) KEEL_HIDDEN;
void _keel_large_release_unlock(void) KEEL_HIDDEN;
/* Fork: held for writing from prepare to parent/child, so no large block is
 * between two addresses when the child is made (large.c, remap). */
void _keel_large_move_lock(void) KEEL_HIDDEN;
void _keel_large_move_unlock(void) KEEL_HIDDEN;
void _keel_large_move_child_reset(void) KEEL_HIDDEN;
/* Test hook: called by the collector between taking mappings out of the
 * cache and unmapping them. */
extern void (*_keel_large_collect_pause)(void) KEEL_HIDDEN;
/* Test hook: called by a realloc that moved a large block, just after
 * mremap unmapped the old range (where another thread may map now) and
 * before the new one's bit is set. */
extern void (*_keel_large_remap_moved)(void *old, void *to) KEEL_HIDDEN;
size_t _keel_large_collect(bool force) KEEL_HIDDEN;
bool _keel_large_pending(void) KEEL_HIDDEN;
/* Blocks aligned to more than 2 MiB (not in the segment map): frees p and
 * returns true if it is one; its usable size, or 0 if it is not one. */
bool _keel_huge_free(void *p) KEEL_HIDDEN;
size_t _keel_huge_usable(const void *p) KEEL_HIDDEN;
/* Whether p was one of the last large or huge blocks unmapped (large.c). */
bool _keel_large_gone(const void *p) KEEL_HIDDEN;
void _keel_large_totals(size_t *live, size_t *bytes, size_t *cached, size_t *requested) KEEL_HIDDEN;
/* The usable bytes of live large blocks: their mapped bytes (`bytes` above)
 * less header pages and alignment gaps. */
size_t _keel_large_usable(void) KEEL_HIDDEN;
void _keel_large_lock(void) KEEL_HIDDEN;
void _keel_large_unlock(void) KEEL_HIDDEN;

/* --- background purge (purge.c) --- */
/* Called after memory was freed for a delayed purge; starts the purge thread
 * on first use. Must be called with no heap lock held (it may create a thread,
 * and pthread_create allocates). */
void _keel_purge_schedule(void) KEEL_HIDDEN;
/* Records that something waits for a delayed purge (a freed span, a cached
 * large mapping, an abandoned page, a delayed list): only then does
 * _keel_purge_schedule start the thread, so a process that never frees
 * memory back never gets one. With heap_purge_ms=0 too: abandoned pages and
 * idle owners' delayed lists have no one else to return them. Any lock may
 * be held. */
void _keel_purge_note_work(void) KEEL_HIDDEN;
void _keel_purge_fork_child(void) KEEL_HIDDEN;
/* A thread's first allocation: a forked child is no longer single-threaded
 * once a thread other than the forking one allocates (purge.c). */
void _keel_purge_note_thread(void) KEEL_HIDDEN;
extern keel_atomic(size_t) _keel_purged_bytes KEEL_HIDDEN;

/* --- the allocation API behind keel_* and the glibc names (alloc.c) --- */
void *_keel_calloc(size_t n, size_t size) KEEL_HIDDEN;
void *_keel_realloc(void *p, size_t size) KEEL_HIDDEN;
void *_keel_aligned_alloc(size_t align, size_t size) KEEL_HIDDEN; /* align: power of two */
size_t _keel_usable_size(const void *p, const char *call) KEEL_HIDDEN;
void _keel_collect(bool force) KEEL_HIDDEN;
void _keel_heap_print_stats_fd(int fd) KEEL_HIDDEN;

/* --- inline helpers --- */
/* Whether a and b lie in the same segment (a decoded link and its block). */
KEEL_INLINE bool _keel_same_segment(const void *a, const void *b) {
  return (((uintptr_t)a ^ (uintptr_t)b) >> KEEL_SEGMENT_SHIFT) == 0;
}

KEEL_INLINE keel_segment_t *_keel_segment_of(const void *p) {
  return (keel_segment_t *)((uintptr_t)p & ~(uintptr_t)KEEL_SEGMENT_MASK);
}

KEEL_INLINE bool _keel_segmap_has(const void *seg) {
  if (keel_unlikely(!_keel_segmap_covers(seg))) return false; /* not user space */
  uintptr_t u = (uintptr_t)seg >> KEEL_SEGMENT_SHIFT;
  /* Relaxed: a block reaches its freer through the program's own
   * synchronisation, which orders the bit's setting before it. */
  return (keel_load_relaxed(&_keel_segmap[u >> 6]) >> (u & 63)) & 1;
}

KEEL_INLINE keel_page_t *_keel_page_of(keel_segment_t *seg, const void *p) {
  size_t slice = ((uintptr_t)p - (uintptr_t)seg) >> KEEL_SLICE_SHIFT;
  /* One address computation (gcc otherwise recomputes it per field). */
  uintptr_t head = seg->slice_head[slice];
  return (keel_page_t *)((uintptr_t)seg + __builtin_offsetof(keel_segment_t, pages) + (head << 7));
}

KEEL_INLINE uintptr_t _keel_encode(const keel_page_t *page, const void *next) {
  return (uintptr_t)next ^ page->key;
}
KEEL_INLINE keel_block_t *_keel_decode(const keel_page_t *page, uintptr_t w) {
  return (keel_block_t *)(w ^ page->key);
}
KEEL_INLINE bool _keel_list_empty(const keel_block_t *b) {
  return ((uintptr_t)b & KEEL_SEGMENT_MASK) == 0;
}
/* The terminator of every list of this page: its segment base. */
KEEL_INLINE keel_block_t *_keel_list_end(const keel_page_t *page) {
  return (keel_block_t *)_keel_segment_of(page);
}

/* Block index of byte offset off in the page; false if off is not on a
 * block boundary. One 64x64->128 multiply gives both: the high half is the
 * quotient, the low half below the magic means no remainder (Lemire, Kaser
 * and Kurz 2019, valid for off and bsize below 2^32). */
KEEL_INLINE bool _keel_page_block_index(const keel_page_t *page, size_t off, size_t *idx) {
  unsigned __int128 m = (unsigned __int128)off * page->div_magic;
  *idx = (size_t)(m >> 64);
  return (uint64_t)m < page->div_magic;
}

/* Owner (or lock holder): adds one request to the page's sample. The
 * requested-bytes statistic is live x the class's mean request; the mean is
 * taken over the allocations that went through a slow path (at least one
 * per page refill), which keeps a counter off the malloc fast path. Halved
 * before the count would overflow (the mean stays). */
KEEL_INLINE void __keel_page_sample_request(keel_page_t *page, size_t size) {
  uint32_t n = keel_load_relaxed(&page->samples);
  size_t req = keel_load_relaxed(&page->requested);
  if (keel_unlikely(n >= ((uint32_t)1 << 31))) {
    n /= 2;
    req /= 2;
  }
  keel_store_relaxed(&page->samples, n + 1);
  keel_store_relaxed(&page->requested, req + size);
}

/* The page's `used`: the owner (or a lock holder) changes it with plain
 * arithmetic; keel_heap_stats reads it from other threads, so the accesses
 * are relaxed atomics. On x86-64 the fast paths' change is the one add or
 * sub to memory that plain code compiled to (TSan cannot see inside asm:
 * there the load and store stay). */
KEEL_INLINE uint32_t _keel_used(const keel_page_t *page) {
  return keel_load_relaxed(&page->used);
}
KEEL_INLINE void _keel_used_set(keel_page_t *page, uint32_t v) {
  keel_store_relaxed(&page->used, v);
}
KEEL_INLINE void _keel_used_inc(keel_page_t *page) {
#if defined(__x86_64__) && !defined(KEEL_TSAN)
  __asm__("addl $1, %0" : "+m"(*(uint32_t *)&page->used) : : "cc");
#else
  _keel_used_set(page, _keel_used(page) + 1);
#endif
}
/* used - 1; true if that is zero. */
KEEL_INLINE bool _keel_used_dec(keel_page_t *page) {
#if defined(__x86_64__) && !defined(KEEL_TSAN)
  bool zero;
  __asm__("subl $1, %0" : "+m"(*(uint32_t *)&page->used), "=@ccz"(zero) : : "cc");
  return zero;
#else
  uint32_t v = _keel_used(page) - 1;
  _keel_used_set(page, v);
  return v == 0;
#endif
}

/* Blocks the owner freed (see keel_page_t); any thread, under seg_lock or
 * as the owner. Read one by one while the owner runs, the three counters
 * may disagree for a moment: never below zero. */
KEEL_INLINE size_t __keel_page_frees(const keel_page_t *page) {
  size_t allocs = keel_load_relaxed(&page->allocs);
  size_t out = (size_t)_keel_used(page) + (size_t)keel_load_relaxed(&page->remote_in);
  return allocs > out ? allocs - out : 0;
}

/* A freed block's first word decodes to a link into its own segment; a live
 * block's first word does that with probability about 2^-42 (key bit 63 is
 * set, so user pointers and small values decode outside user space; malloc
 * clears the word of the block it hands out). */
KEEL_INLINE bool _keel_block_maybe_free(const keel_page_t *page, const keel_block_t *b) {
  return _keel_same_segment(_keel_decode(page, b->next), b);
}

/* Whether offset `off` from page->start is a block the page has carved:
 * on a block boundary, with an index below capacity. Both come from one
 * multiply (_keel_page_block_index), and both fields are in the first line.
 * The index bound rejects what the boundary test alone let through: the
 * never-carved tail of the page (freed there, a block went on a list and
 * was handed out twice), a stale pointer past the page's end (the slice map
 * sends every slice of a retired large span to the page now at its first
 * slice), and a pointer below start: its offset wraps above 2^64 - 4 MiB,
 * beyond the 2^32 the boundary test is exact for, but its index is at least
 * off / bsize > 2^45. A span that is not a page has div_magic 0: nothing
 * passes. Reads capacity: the owner's, or racily (see keel_page_t). */
KEEL_INLINE bool _keel_page_is_carved(const keel_page_t *page, size_t off) {
  size_t idx;
  bool boundary = _keel_page_block_index(page, off, &idx);
  /* `&`, not `&&`: gcc 12 then lays the free fast path out straight; with
   * `&&` it put the slow-path jump inside it (a taken branch per free). */
  return (idx < keel_load_relaxed(&page->capacity)) & boundary;
}

/* _keel_page_is_carved for a pointer, on a page in use (bsize 0 marks a
 * free span or a large block's header). */
KEEL_INLINE bool _keel_page_has_block(const keel_page_t *page, const void *p) {
  return page->bsize != 0 && _keel_page_is_carved(page, (size_t)((const uint8_t *)p - page->start));
}

#endif /* KEEL_HEAP_INTERNAL_H */
