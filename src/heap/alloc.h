/* The malloc and free fast paths, inlined into keel_malloc/keel_free and,
 * in libkeel-malloc.so, into malloc/free themselves.
 *
 * Cost (x86-64, gcc 12 -O2, libkeel-malloc.so; counted in the disassembly
 * and checked with `valgrind --tool=callgrind` on a loop of malloc(8..1024,
 * 256 random sizes)/free pairs: 25 instructions per malloc call including
 * the amortised refills and slow paths, 51 per free call, 3 of them the
 * keep-the-current-page test that every free of such a loop reaches):
 *   malloc: 23 instructions: TLS load (2), size test (2), class table (4),
 *           current page and emptiness test (4), pop + decode (3), the
 *           link's check (it stays in the segment: overwritten links, 3),
 *           prefetch of the next block (1), clear the handed-out block's link (1),
 *           used++ (1), allocs counter (one unlocked add, 1), return (1).
 *           An empty `free` with blocks on `local_free` (left there by
 *           slow-path frees) takes those in 6 more.
 *   free:   48 instructions: segment mask + segment-map bit test (foreign
 *           pointers, 13), page lookup (6), TLS load, owner and flags tests
 *           (8), carved-block test (offset, then one multiply giving the
 *           block index and the boundary test, the index bounded by
 *           capacity: interior pointers, the never-carved tail, 9),
 *           double-free test on the block's link (6), push + encode (3),
 *           used-- test (2), return. What is left above 25 is the checking
 *           the issue asks for: the segment map (invalid pointers), the
 *           carved-block test (interior and never-carved pointers) and the
 *           link test (double free).
 * In libkeel.so the TLS load is a TLS-descriptor call (about 4 more).
 *
 * Where the time goes when blocks are cold (a server freeing objects it
 * allocated long ago; the bench's `churn`, profiled with perf at 1 thread):
 * not in instructions but in two cache misses per malloc/free. The free's
 * read of the block's link (the double-free test) misses and holds up
 * retirement: taking it out measured 13% less CPU per operation, which is
 * the price of the double-free check (a store alone would not stall).
 * The malloc's pop reads the next free block of the page, which a random
 * free pattern leaves cold: the pop prefetches the block after it, so the
 * next malloc of the class (dozens of operations later) finds it in cache
 * (2.7% less CPU per churn operation, median of 15 paired runs; no change
 * on hot pairs).
 * A per-thread cache of freed blocks in front of the pages (tcmalloc's
 * per-class lists, up to 32 blocks) was built and taken out again
 * (690dc11..ff36b33). Without the free's read it gained 30% on churn at 1
 * thread, but then a block freed twice could sit on a page's list and on
 * the cache at once, and reviews found five ways from there to a block
 * handed out twice or a page retired under a live one. With the read back
 * it gained 5-8% at 1 thread and lost 4-16% at 8 to 256 threads and
 * 0.4-0.7 ns on pairs (the trims' walks over cold blocks), so the read
 * stays and the cache went.
 * Neither path takes a lock, does an atomic read-modify-write or a system
 * call; every deviation (empty list, foreign page, full page, large block,
 * suspicious link) goes to a separate non-inlined slow path.
 */
#ifndef KEEL_HEAP_ALLOC_H
#define KEEL_HEAP_ALLOC_H

#include "heap/internal.h"
#include "heap/track.h"

KEEL_INLINE void _keel_counter_add(keel_atomic(size_t) * c, size_t n) {
  /* Owner-written: a relaxed load and store, not an atomic add. */
  keel_store_relaxed(c, keel_load_relaxed(c) + n);
}

/* _keel_counter_add(c, 1) as one unlocked `add` to memory: gcc will not
 * fuse a relaxed load and store. An aligned 8-byte store is single-copy
 * atomic on x86-64, so readers see the old or the new count, as with the
 * relaxed pair. TSan cannot see inside asm: there the pair stays. */
KEEL_INLINE void _keel_counter_inc(keel_atomic(size_t) * c) {
#if defined(__x86_64__) && !defined(KEEL_TSAN)
  __asm__("addq $1, %0" : "+m"(*(size_t *)c) : : "cc");
#else
  _keel_counter_add(c, 1);
#endif
}

/* Pops a block from the page's free list: the caller checked it non-empty. */
KEEL_INLINE void *_keel_page_pop(keel_page_t *page) {
  keel_block_t *b = page->free;
  keel_block_t *next = _keel_decode(page, b->next);
  /* Every correct link stays in the block's segment (the list end is its
   * base). One that does not was overwritten while b was free: a write
   * after free, or an overflow out of the block before it. */
  if (keel_unlikely(!_keel_same_segment(next, b)))
    return _keel_page_bad_link(b); /* a tail call: no stack frame on the fast path */
  page->free = next;
  /* A prefetch never faults; at the list end it touches the segment header. */
  __builtin_prefetch(next);
  b->next = 0; /* a stale link would look like a free block to the double-free check */
  KEEL_TRACK_ALLOC(b, page->bsize);
  _keel_used_inc(page);
  _keel_counter_inc(&page->allocs);
  return b;
}

KEEL_INLINE void *_keel_malloc_fast(size_t size) {
  keel_heap_t *heap = _keel_heap_tls;
  if (keel_likely(size <= KEEL_SMALL_MAX)) {
    unsigned cls = _keel_class_small[(size + 7) >> 3];
    keel_page_t *page = heap->direct[cls];
    if (keel_likely(!_keel_list_empty(page->free))) return _keel_page_pop(page);
    /* free ran dry but the owner's own frees wait on local_free: take them
     * here, not in the slow path. A malloc/free ping-pong otherwise took the
     * slow path once per refill, i.e. every 4 pairs for 1 KiB blocks (their
     * first carve is 4 KiB). thread_free and the queue still wait for the
     * slow path, which runs when both lists are empty. (_keel_empty_page's
     * lists are NULL: empty.) */
    keel_block_t *local = page->local_free;
    if (keel_likely(!_keel_list_empty(local))) {
      page->free = local;
      page->local_free = _keel_list_end(page);
      return _keel_page_pop(page);
    }
  }
  return _keel_malloc_generic(heap, size);
}

KEEL_INLINE void _keel_push_local(keel_page_t *page, keel_block_t *b) {
  KEEL_TRACK_FREE(b, page->bsize);
  b->next = _keel_encode(page, page->free);
  page->free = b;
}

KEEL_INLINE void _keel_free_fast(void *p, const char *call) {
  keel_segment_t *seg = _keel_segment_of(p);
  if (keel_likely(_keel_segmap_has(seg))) { /* NULL: segment 0 is never mapped */
    keel_page_t *page = _keel_page_of(seg, p);
    keel_heap_t *heap = _keel_heap_tls;
    keel_heap_t *owner = keel_load_relaxed(&page->heap);
    keel_block_t *b = p;
    size_t off = (size_t)((uint8_t *)p - page->start);
    if (keel_likely(owner == heap &&
                    keel_load_acquire(&page->flags) == 0 && /* pairs with a collector's unfull */
                    _keel_page_is_carved(page, off))) {
      /* Double free: a block on any list of its page (free, local_free,
       * thread_free) has a link that decodes into its own segment; the slow
       * path confirms by walking the lists. The first word is read and then
       * written anyway: reading it adds a load, not a cache line. */
      if (keel_likely(!_keel_block_maybe_free(page, b))) {
        _keel_push_local(page, b);
        /* The current page stays when it empties (an alloc/free loop would
         * otherwise return and retake it every time); others are retired. */
        if (keel_unlikely(_keel_used_dec(page)) && page != heap->direct[page->cls]) {
          _keel_heap_page_emptied(heap, page);
        }
        return;
      }
    } else if (owner != heap) {
      _keel_free_other(page, p, call); /* another thread's block (heap.h says what it costs) */
      return;
    }
  }
  _keel_free_generic(p, call);
}

#endif /* KEEL_HEAP_ALLOC_H */
