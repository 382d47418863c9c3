/* Segments: 4 MiB of address space carved into pages, and the segment map.
 *
 * Choice: segments are process-wide (not owned by a thread, as in mimalloc),
 * behind one mutex. Pages are what threads own; a segment only hands out and
 * takes back spans of slices, which happens once per 64 KiB-1 MiB page, not
 * per block, so the lock is taken about once per 100-8000 allocations. That
 * buys simple abandonment (a page is self-contained; its segment does not
 * care which thread owns it) and lets any thread, or the purge thread,
 * return a free span to the OS.
 *
 * Spans are 1, 4, 8 or 16 slices, aligned to their length (slice 0 is the
 * header), so a span search is a few mask tests on a 64-bit word.
 *
 * Purge: a freed span stays resident ("dirty") for heap_purge_ms, then is
 * returned with madvise(MADV_DONTNEED). The delay keeps a free/alloc cycle
 * that crosses a page boundary from paying a fault and a zeroing per page
 * (the purge-and-refault churn jemalloc and mimalloc show on some loads).
 * The madvise calls run with the lock dropped: the span is marked in use
 * while it is purged, so no one allocates it meanwhile.
 *
 * Retained segments: a segment with no pages left is, after the same delay,
 * not unmapped but retired (fresh read-only zero pages mapped over it, under
 * the lock: no memory, no commit charge) and kept, to be made read-write
 * and reused before any new mapping (jemalloc's opt.retain keeps address
 * space the same way). So every address keel handed out from a small
 * segment stays readable: a module that reads a header word before the
 * block it frees (the pool's double-free check, a load on a 2 ns path)
 * gets zeros, not a fault, for a block freed twice after its memory went
 * back to the OS. Checking the segment map first did the same at a cycle
 * per free (4% of keel-bench pool's gluster CPU). A stale write into a
 * retired segment faults, and the segment is out of the segment map, so
 * keel_free calls a stale pointer into it invalid. Where retiring fails
 * (the mapping-count limit) the segment is purged instead and stays
 * read-write; where that fails too (mlock) it keeps its contents. The cost
 * is address space at the peak of small-block memory, so the promise has
 * exceptions, where segments are unmapped for good: those released while
 * the process limits its address space (RLIMIT_AS finite: nothing is
 * retained then), those retained before a limit was set (the next
 * collection unmaps them, and so does a large mapping the OS refuses
 * before it tries again), those past RETAIN_SLOTS retained (256 GiB), and,
 * before Linux 6.12, one whose retire failed at the mapping-count limit
 * and left a hole.
 *
 * Segment map: one bit per 4 MiB of the 47-bit user address space (4 MiB of
 * zero-fill BSS, of which only the words covering keel's segments are ever
 * touched). Bits change only under the lock; readers use relaxed loads.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>

#include "base/clock.h"
#include "base/die.h"
#include "base/options.h"
#include "base/os.h"
#include "heap/internal.h"
#include "heap/track.h"

keel_atomic(uint64_t) _keel_segmap[KEEL_SEGMAP_WORDS];

#define HEADER_MASK (((uint64_t)1 << KEEL_HEADER_SLICES) - 1)
_Static_assert(sizeof(keel_segment_t) <= KEEL_HEADER_SLICES * KEEL_SLICE_SIZE, "header fits");

/* Adaptive (a bounded spin before the futex wait): holds are a few list
 * operations, and with short-lived threads on 16 cores the lock is taken
 * by every thread start and exit; sleeping on it cost more sys time than
 * the threads' own creation. */
static pthread_mutex_t seg_lock = PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP;
static keel_segment_t *segments; /* every small segment, most recently created first */
static size_t n_segments;
/* Abandoned pages: a queue per class, the queues of classes c with
 * c % ABANDONED_STRIPES == i behind stripe i's lock, so that thread starts
 * adopting pages (one per class they use) spread over 16 locks instead of
 * all queueing on seg_lock, which was most of what short-lived threads on
 * 16 cores waited for. 16, not one per class: fork holds them all, and
 * TSan's deadlock detector tracks at most 64 held locks. Order: seg_lock,
 * then a stripe's lock. A page on a queue is owned by that lock: its
 * owner-side state changes only under it (the collector) or after it is
 * unlinked (the adopter). */
#define ABANDONED_STRIPES 16
typedef struct abandoned_queue {
  keel_page_queue_t q;
  keel_atomic(size_t) n; /* pages on q: written under lock, a hint to adopters */
} KEEL_CACHE_ALIGNED abandoned_queue_t;
typedef struct abandoned_stripe {
  pthread_mutex_t lock;
} KEEL_CACHE_ALIGNED abandoned_stripe_t;
static abandoned_stripe_t stripes[ABANDONED_STRIPES] = {
    [0 ... ABANDONED_STRIPES - 1] = {PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP}};
static abandoned_queue_t abandoned[KEEL_CLASS_COUNT_MAX];

static keel_atomic(size_t) n_abandoned;

static pthread_mutex_t *queue_lock(const abandoned_queue_t *a) {
  return &stripes[(size_t)(a - abandoned) % ABANDONED_STRIPES].lock;
}
static size_t class_pages[KEEL_CLASS_COUNT_MAX]; /* pages per class, under the lock */
/* Counters of freed pages, per class, under the lock (see keel_page_t). */
static size_t retired_samples[KEEL_CLASS_COUNT_MAX];
static size_t retired_allocs[KEEL_CLASS_COUNT_MAX], retired_requested[KEEL_CLASS_COUNT_MAX],
    retired_frees[KEEL_CLASS_COUNT_MAX];
static size_t dirty_slices, used_slices;
keel_atomic(size_t) _keel_purged_bytes;

void _keel_segments_lock(void) {
  pthread_mutex_lock(&seg_lock);
  for (unsigned i = 0; i < ABANDONED_STRIPES; i++) pthread_mutex_lock(&stripes[i].lock);
}
void _keel_segments_unlock(void) {
  for (unsigned i = ABANDONED_STRIPES; i-- > 0;) pthread_mutex_unlock(&stripes[i].lock);
  pthread_mutex_unlock(&seg_lock);
}

/* Ordering: a bit is set only once its range is mapped and cleared only
 * while it is still mapped (before munmap, before mremap moves it away).
 * Between the two the 4 MiB unit can be no one else's, so a set or clear
 * never touches the bit of another thread's mapping at the same base. */
void _keel_segmap_set(void *seg, bool on) {
  uintptr_t u = (uintptr_t)seg >> KEEL_SEGMENT_SHIFT;
  uint64_t bit = (uint64_t)1 << (u & 63);
  if (on) {
    keel_fetch_or_acq_rel(&_keel_segmap[u >> 6], bit);
  } else {
    keel_fetch_and_acq_rel(&_keel_segmap[u >> 6], ~bit);
  }
}

static uint64_t span_mask(unsigned first, unsigned n) {
  return (n == 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1)) << first;
}

/* First span of n slices (aligned to n) free in seg, preferring one whose
 * memory is still resident (no fault to reuse it); -1 if none. */
static int span_find(const keel_segment_t *seg, unsigned n) {
  int any = -1;
  for (unsigned i = n < KEEL_HEADER_SLICES ? KEEL_HEADER_SLICES : n; i + n <= KEEL_SLICES; i += n) {
    uint64_t m = span_mask(i, n);
    if ((seg->used_mask & m) != 0) continue;
    if ((seg->dirty_mask & m) == m) return (int)i;
    if (any < 0) any = (int)i;
  }
  return any;
}

/* Retained segments (see the file comment), under the lock: a stack of
 * addresses, bit 0 set where the segment's memory is not zero (it could be
 * neither retired nor purged, or neither unmapped nor purged: it stays
 * read-write and resident). A static array: pushing can never fail for
 * want of memory; its pages are touched only as it fills (8 bytes per
 * 4 MiB retained). */
#define RETAIN_SLOTS ((size_t)1 << 16)
#define RETAIN_DIRTY ((uintptr_t)1)
static uintptr_t retained[RETAIN_SLOTS];
static size_t n_retained;

/* seg is off the segment list and out of the map; caller holds the lock.
 * Retained unless the stack is full or the process limits its address
 * space (RLIMIT_AS: retained space would make its own mappings fail). */
static void segment_retire(keel_segment_t *seg) {
  KEEL_TRACK_RESET(seg, KEEL_SEGMENT_SIZE);
  uintptr_t e = (uintptr_t)seg;
  bool unmap = n_retained == RETAIN_SLOTS || _keel_os_as_limited();
  if (unmap && _keel_os_release(seg, KEEL_SEGMENT_SIZE) == 0) return;
  /* Unmapping (a limit) or retiring fails at the process's mapping limit:
   * either splits a mapping. Then purge, which needs no split: that fails
   * on mlock'ed memory (EINVAL: still mapped, read-write, resident) or,
   * where a failed retire left a hole (before Linux 6.12), with ENOMEM:
   * nothing is ours there any more (another thread could map into the hole
   * before the purge and have it zeroed: a window of a syscall, on old
   * kernels at their mapping limit). A full stack leaks the segment. */
  if (unmap || _keel_os_retire(seg, KEEL_SEGMENT_SIZE) != 0) {
    int rc = _keel_os_purge(seg, KEEL_SEGMENT_SIZE, false);
    if (rc == -ENOMEM || n_retained == RETAIN_SLOTS) return;
    if (rc != 0) e |= RETAIN_DIRTY;
  }
  KEEL_TRACK_RETIRE(seg, KEEL_SEGMENT_SIZE);
  retained[n_retained++] = e;
}

/* The most recently retained segment, read-write and with a zero header,
 * or NULL (none, or the OS refused it: its commit charge, or the mapping
 * limit for the mprotect's split; it stays retained). An entry whose range
 * is no longer mapped (see segment_retire) is dropped. */
static keel_segment_t *segment_reuse(void) {
  while (n_retained != 0) {
    uintptr_t e = retained[n_retained - 1];
    keel_segment_t *seg = (keel_segment_t *)(e & ~RETAIN_DIRTY);
    if (_keel_os_commit(seg, KEEL_SEGMENT_SIZE) != 0) {
      if (_keel_os_mapped(seg)) return NULL;
      KEEL_TRACK_RESET(seg, KEEL_SEGMENT_SIZE);
      n_retained--;
      continue;
    }
    n_retained--;
    KEEL_TRACK_RESET(seg, KEEL_SEGMENT_SIZE);
    if (e & RETAIN_DIRTY) memset(seg, 0, sizeof(*seg)); /* blocks need no zeroing: calloc clears */
    return seg;
  }
  return NULL;
}

/* Only under a limit: anywhere else (an absurd request, the commit limit:
 * retired segments hold no commit charge, and the few that could only be
 * purged hold little) they would go for nothing. getrlimit is asked only
 * while something is retained. */
bool _keel_segments_unretain_for_space(void) {
  bool any = false;
  pthread_mutex_lock(&seg_lock);
  while (n_retained != 0 && (any || _keel_os_as_limited())) {
    keel_segment_t *seg = (keel_segment_t *)(retained[n_retained - 1] & ~RETAIN_DIRTY);
    KEEL_TRACK_RESET(seg, KEEL_SEGMENT_SIZE);
    /* Unmapping one of several adjacent retired segments splits their
     * mapping, which fails at the mapping-count limit: it stays retained,
     * and so do those below it (the next collection tries again). */
    if (_keel_os_release(seg, KEEL_SEGMENT_SIZE) != 0) {
      KEEL_TRACK_RETIRE(seg, KEEL_SEGMENT_SIZE);
      break;
    }
    n_retained--;
    any = true;
  }
  pthread_mutex_unlock(&seg_lock);
  return any;
}

static keel_segment_t *segment_new(void) {
  keel_segment_t *seg = segment_reuse();
  if (seg == NULL) seg = _keel_os_alloc(KEEL_SEGMENT_SIZE, KEEL_SEGMENT_SIZE);
  if (seg == NULL) return NULL;
  if (!_keel_segmap_covers(seg)) {
    _keel_os_release(seg, KEEL_SEGMENT_SIZE);
    errno = ENOMEM;
    return NULL;
  }
  seg->kind = KEEL_SEG_SMALL;
  seg->used_mask = HEADER_MASK;
  seg->next = segments;
  seg->prev = NULL;
  if (segments != NULL) segments->prev = seg;
  segments = seg;
  n_segments++;
  _keel_segmap_set(seg, true);
  return seg;
}

static void segment_release(keel_segment_t *seg) {
  if (seg->prev != NULL)
    seg->prev->next = seg->next;
  else
    segments = seg->next;
  if (seg->next != NULL) seg->next->prev = seg->prev;
  n_segments--;
  _keel_segmap_set(seg, false);
  segment_retire(seg);
}

keel_page_t *_keel_page_alloc(unsigned cls, keel_heap_t *heap) {
  unsigned n = _keel_class_slices(cls);
  pthread_mutex_lock(&seg_lock);
  keel_segment_t *seg;
  int first = -1;
  for (seg = segments; seg != NULL; seg = seg->next) {
    if (~seg->used_mask == 0) continue;
    if ((first = span_find(seg, n)) >= 0) break;
  }
  if (seg == NULL) {
    seg = segment_new();
    if (seg == NULL) {
      pthread_mutex_unlock(&seg_lock);
      return NULL;
    }
    first = span_find(seg, n);
  }
  uint64_t m = span_mask((unsigned)first, n);
  dirty_slices -= (size_t)__builtin_popcountll(seg->dirty_mask & m);
  used_slices += n;
  seg->used_mask |= m;
  seg->dirty_mask &= ~m;
  for (unsigned i = 0; i < n; i++) seg->slice_head[first + (int)i] = (uint8_t)first;
  class_pages[cls]++;
  keel_page_t *page = &seg->pages[first];
  page->slices = (uint8_t)n;
  page->cls = (uint8_t)cls;
  page->bsize = _keel_class_size[cls];
  pthread_mutex_unlock(&seg_lock);
  _keel_page_init(page, cls, heap);
  return page;
}

static size_t purge_delay_ms(void) {
  return (size_t)_keel_option(KEEL_OPT_heap_purge_ms);
}

/* Caller holds seg_lock. */
static void __page_free(keel_page_t *page) {
  keel_segment_t *seg = _keel_segment_of(page);
  unsigned first = (unsigned)(page - seg->pages), n = page->slices;
  uint64_t m = span_mask(first, n);
  class_pages[page->cls]--;
  retired_frees[page->cls] += __keel_page_frees(page); /* before allocs is reset */
  retired_allocs[page->cls] += keel_load_relaxed(&page->allocs);
  retired_requested[page->cls] += keel_load_relaxed(&page->requested);
  keel_store_relaxed(&page->allocs, 0);
  keel_store_relaxed(&page->requested, 0);
  retired_samples[page->cls] += keel_load_relaxed(&page->samples);
  keel_store_relaxed(&page->samples, 0);
  page->bsize = 0;
  page->div_magic = 0;
  keel_store_relaxed(&page->heap, NULL);
  seg->used_mask &= ~m;
  seg->dirty_mask |= m;
  used_slices -= n;
  dirty_slices += n;
  seg->purge_at = keel_clock_coarse_ms() + purge_delay_ms();
}

static size_t __segment_purge(keel_segment_t *seg);

void _keel_page_free(keel_page_t *page) {
  keel_segment_t *seg = _keel_segment_of(page);
  pthread_mutex_lock(&seg_lock);
  __page_free(page);
  size_t bytes = 0;
  if (purge_delay_ms() == 0) { /* heap_purge_ms=0: this span at once */
    uint64_t purging = seg->dirty_mask;
    bytes = __segment_purge(seg);
    seg->used_mask &= ~purging;
  }
  pthread_mutex_unlock(&seg_lock);
  if (bytes != 0) keel_fetch_add_relaxed(&_keel_purged_bytes, bytes);
  _keel_purge_note_work();
}

void _keel_page_abandon(keel_page_t *page) {
  abandoned_queue_t *a = &abandoned[page->cls];
  pthread_mutex_lock(queue_lock(a));
  KEEL_ASSERT(!page->abandoned); /* queued twice would corrupt the queue */
  page->abandoned = 1;
  __keel_page_queue_push_back(&a->q, page);
  keel_store_relaxed(&a->n, keel_load_relaxed(&a->n) + 1);
  keel_fetch_add_relaxed(&n_abandoned, 1);
  pthread_mutex_unlock(queue_lock(a));
  _keel_purge_note_work();
}

void _keel_pages_free(keel_page_t *list) {
  if (list == NULL) return;
  if (purge_delay_ms() == 0) { /* each freed span is purged at once: one by one */
    for (keel_page_t *p = list, *next; p != NULL; p = next) {
      next = p->next;
      _keel_page_free(p);
    }
    return;
  }
  pthread_mutex_lock(&seg_lock);
  for (keel_page_t *p = list, *next; p != NULL; p = next) {
    next = p->next;
    __page_free(p);
  }
  pthread_mutex_unlock(&seg_lock);
  _keel_purge_note_work();
}

/* Caller holds the queue's lock. */
static void __abandoned_unlink(abandoned_queue_t *a, keel_page_t *page) {
  KEEL_ASSERT(page->abandoned);
  __keel_page_queue_remove(&a->q, page);
  page->abandoned = 0;
  keel_store_relaxed(&a->n, keel_load_relaxed(&a->n) - 1);
  keel_fetch_sub_relaxed(&n_abandoned, 1);
}

/* Moves an abandoned page's thread_free state back to NORMAL for its new
 * owner. The page is off every list, so only remote freers race with us. */
static void page_tf_set_normal(keel_page_t *page) {
  uintptr_t w = keel_load_relaxed(&page->thread_free);
  while (!keel_cas_weak_acq_rel(&page->thread_free, &w, (w & ~(uintptr_t)3) | KEEL_TF_NORMAL)) {}
}

keel_page_t *_keel_page_adopt(unsigned cls, keel_heap_t *heap) {
  abandoned_queue_t *a = &abandoned[cls];
  if (keel_load_relaxed(&a->n) == 0) return NULL;
  pthread_mutex_lock(queue_lock(a));
  keel_page_t *page = a->q.first;
  if (page != NULL) __abandoned_unlink(a, page);
  pthread_mutex_unlock(queue_lock(a));
  if (page == NULL) return NULL;
  page_tf_set_normal(page);
  /* Release: the new owner's view of the page's lists (taken under the lock)
   * is published before any free sees heap == owner. Only the owner itself
   * acts on that equality, so this is belt and braces. */
  keel_store_release(&page->heap, heap);
  __keel_page_collect_thread_free(page);
  return page;
}

/* Caller holds seg_lock: frees abandoned pages whose blocks all came back. */
static size_t __abandoned_collect(bool force) {
  size_t bytes = 0;
  for (unsigned c = 0; c < _keel_class_count; c++) {
    abandoned_queue_t *a = &abandoned[c];
    if (keel_load_relaxed(&a->n) == 0) continue;
    pthread_mutex_lock(queue_lock(a));
    keel_page_t *next;
    for (keel_page_t *p = a->q.first; p != NULL; p = next) {
      next = p->next;
      __keel_page_collect_thread_free(p);
      if (_keel_used(p) == 0) {
        __abandoned_unlink(a, p);
        __page_free(p);
      } else if (force) {
        bytes += __keel_page_purge_free(p);
      }
    }
    pthread_mutex_unlock(queue_lock(a));
  }
  return bytes;
}

void (*_keel_segment_purge_pause)(void);

/* Purges the dirty runs of one segment, dropping the lock around madvise.
 * Caller holds seg_lock; returns with it held, and clears the slices from
 * used_mask itself. While the lock is dropped they are in purging_mask too,
 * so that a fork child, which does not have the purging thread, can give
 * them back (_keel_segments_fork_child). */
static size_t __segment_purge(keel_segment_t *seg) {
  uint64_t dirty = seg->dirty_mask, held = dirty;
  seg->dirty_mask = 0;
  seg->used_mask |= dirty; /* nobody allocates a span while it is purged */
  seg->purging_mask |= held;
  dirty_slices -= (size_t)__builtin_popcountll(dirty);
  pthread_mutex_unlock(&seg_lock);
  if (keel_unlikely(_keel_segment_purge_pause != NULL)) _keel_segment_purge_pause();
  size_t bytes = 0;
  while (dirty != 0) {
    unsigned first = (unsigned)__builtin_ctzll(dirty);
    uint64_t rest = dirty >> first;
    unsigned n = ~rest == 0 ? 64 - first : (unsigned)__builtin_ctzll(~rest);
    _keel_os_purge((uint8_t *)seg + ((size_t)first << KEEL_SLICE_SHIFT),
                   (size_t)n << KEEL_SLICE_SHIFT, false);
    bytes += (size_t)n << KEEL_SLICE_SHIFT;
    dirty &= ~span_mask(first, n);
  }
  pthread_mutex_lock(&seg_lock);
  seg->purging_mask &= ~held;
  return bytes;
}

/* Whether the parent's purger had madvised them or not, the slices are free:
 * dirty is right either way (a second purge of purged memory is harmless). */
void _keel_segments_fork_child(void) {
  pthread_mutex_lock(&seg_lock);
  for (keel_segment_t *seg = segments; seg != NULL; seg = seg->next) {
    uint64_t m = seg->purging_mask;
    if (m == 0) continue;
    seg->purging_mask = 0;
    seg->used_mask &= ~m;
    seg->dirty_mask |= m;
    dirty_slices += (size_t)__builtin_popcountll(m);
    seg->purge_at = keel_clock_coarse_ms();
  }
  pthread_mutex_unlock(&seg_lock);
}

size_t _keel_segments_collect(bool force) {
  uint64_t now = keel_clock_coarse_ms();
  size_t bytes = 0;
  pthread_mutex_lock(&seg_lock);
  bytes += __abandoned_collect(force);
  keel_segment_t *next;
  for (keel_segment_t *seg = segments; seg != NULL; seg = next) {
    next = seg->next;
    if (!force && now < seg->purge_at) continue;
    if (seg->used_mask == HEADER_MASK) {
      bytes += (size_t)__builtin_popcountll(seg->dirty_mask) << KEEL_SLICE_SHIFT;
      dirty_slices -= (size_t)__builtin_popcountll(seg->dirty_mask);
      segment_release(seg);
      continue;
    }
    if (seg->dirty_mask == 0) continue;
    uint64_t purging = seg->dirty_mask;
    bytes += __segment_purge(seg);
    seg->used_mask &= ~purging;
    next = seg->next; /* the list may have changed while the lock was dropped */
  }
  pthread_mutex_unlock(&seg_lock);
  /* A limit set since they were retained: the program's own mappings need
   * the space (the purge thread comes here every tick). */
  (void)_keel_segments_unretain_for_space();
  keel_fetch_add_relaxed(&_keel_purged_bytes, bytes);
  return bytes;
}

void _keel_segments_totals(keel_seg_totals_t *t) {
  pthread_mutex_lock(&seg_lock);
  t->mapped = (n_segments + n_retained) * KEEL_SEGMENT_SIZE;
  t->committed = (used_slices + dirty_slices) << KEEL_SLICE_SHIFT;
  t->abandoned_pages = keel_load_relaxed(&n_abandoned);
  memcpy(t->pages, class_pages, sizeof(t->pages));
  memcpy(t->allocs, retired_allocs, sizeof(t->allocs));
  memcpy(t->requested, retired_requested, sizeof(t->requested));
  memcpy(t->frees, retired_frees, sizeof(t->frees));
  memcpy(t->samples, retired_samples, sizeof(t->samples));
  for (keel_segment_t *seg = segments; seg != NULL; seg = seg->next) {
    for (unsigned i = KEEL_HEADER_SLICES; i < KEEL_SLICES; i++) {
      const keel_page_t *p = &seg->pages[i];
      /* Span heads of pages in use (bsize and cls are set under the lock). */
      if (!((seg->used_mask >> i) & 1) || seg->slice_head[i] != i || p->bsize == 0) continue;
      t->allocs[p->cls] += keel_load_relaxed(&p->allocs);
      t->requested[p->cls] += keel_load_relaxed(&p->requested);
      t->samples[p->cls] += keel_load_relaxed(&p->samples);
      t->frees[p->cls] += __keel_page_frees(p);
    }
  }
  pthread_mutex_unlock(&seg_lock);
  t->purged = keel_load_relaxed(&_keel_purged_bytes);
}
