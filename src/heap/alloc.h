/* The malloc and free fast paths, inlined into keel_malloc/keel_free and,
 * in libkeel-malloc.so, into malloc/free themselves.
 *
 * Blocks up to 1 KiB go through the thread cache (heap.c: a short list per
 * class of blocks this thread freed, in front of the pages); larger ones,
 * and a malloc whose list is empty, use the page's free list directly.
 *
 * Cost (x86-64, gcc 12 -O2, libkeel-malloc.so; counted in the disassembly
 * and checked with `valgrind --tool=callgrind` on a loop of malloc(8..1024,
 * 256 random sizes)/free pairs: 29 instructions per malloc call and 57 per
 * free call; 21 and 50 before the thread cache, whose pair is now 3% faster
 * all the same, 4.28 against 4.43 ns):
 *   malloc: 29 instructions on a cache hit: TLS load, size test, class
 *           table, list head and emptiness test, decode and check of the
 *           next link, head update, the cleared link, the hand-out count
 *           (one unlocked add), frame and return. From a page instead: its
 *           free list, pop, decode and link check, prefetch of the next
 *           block, used++ and an allocs counter.
 *   free:   58 instructions to the cache: segment mask + segment-map bit
 *           test (foreign pointers, 13), page lookup and the slice's class
 *           (8), TLS load, owner and flags tests (8), carved-block test
 *           (offset, then one multiply giving the block index and the
 *           boundary test, the index bounded by capacity: interior
 *           pointers, the never-carved tail, 9), cache address, room on
 *           the list and not the block freed last (12), link encode and
 *           push (6), return. What is left above 25 is the checking the
 *           issue asks for: the segment map (invalid pointers), the
 *           carved-block test (interior and never-carved pointers) and the
 *           double-free tests.
 * In libkeel.so the TLS load is a TLS-descriptor call (about 4 more).
 *
 * Where the time goes when blocks are cold (a server freeing objects it
 * allocated long ago; the bench's `churn`, profiled with perf at 1 thread):
 * not in instructions but in cache misses. Before the thread cache, the
 * free read the block's link (the page lists' double-free test): that load
 * missed and held up retirement, and malloc handed out blocks freed long
 * ago. Now free only stores to the block, and malloc pops the block freed
 * last. The class comes from the segment header's slice_cls, loaded beside
 * slice_head: taken from the page descriptor (a dependent load later), it
 * made each free's stores resolve late, and the next malloc's loads waited
 * on them (0.9 ns per pair). A page pop still prefetches the block after
 * the one it hands out, which a random free pattern leaves cold (2.7% less
 * CPU per churn operation, measured before the cache).
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

/* _keel_counter_add(c, n) for a constant n, as one unlocked `add`. */
KEEL_INLINE void _keel_counter_add_imm(keel_atomic(uint64_t) * c, uint64_t n) {
#if defined(__x86_64__) && !defined(KEEL_TSAN)
  __asm__("addq %1, %0" : "+m"(*(uint64_t *)c) : "i"(n) : "cc");
#else
  keel_store_relaxed(c, keel_load_relaxed(c) + n);
#endif
}

/* Pops a block from the page's free list: the caller checked it non-empty. */
KEEL_INLINE void *_keel_page_pop(keel_page_t *page) {
  keel_block_t *b = page->free;
  keel_block_t *next = _keel_decode(page, b->next);
  /* Every correct link stays in the block's segment (the list end is its
   * base). One that does not was overwritten: by a free of b while it was
   * on this list (the thread cache's tag), or by a write after free. */
  if (keel_unlikely((((uintptr_t)next ^ (uintptr_t)b) >> KEEL_SEGMENT_SHIFT) != 0))
    _keel_die_bad_link(page, b);
  page->free = next;
  /* A prefetch never faults: at the list end it touches the segment header,
   * and a link an overflow corrupted still faults at the next pop. */
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
    keel_heap_cache_t *cache = &heap->cache[cls];
    keel_block_t *b = cache->head;
    if (keel_likely(b != NULL)) { /* the thread cache: the block freed last */
      uintptr_t next = *_keel_cache_link(b) ^ heap->cache_secret;
      /* A link a write after free or a double free changed: heap.c. */
      if (keel_unlikely(!_keel_cache_link_ok(next))) _keel_cache_bad_link(b);
      cache->head = (keel_block_t *)next;
      *_keel_cache_link(b) = 0; /* no cache link left in a live block */
      b->next = 0;
      KEEL_TRACK_ALLOC(b, _keel_class_size[cls]);
      _keel_counter_add_imm(&cache->ctr, 255); /* one more hand-out, one block fewer */
      return b;
    }
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
    unsigned cls = seg->slice_cls[((uintptr_t)p - (uintptr_t)seg) >> KEEL_SLICE_SHIFT];
    keel_heap_t *heap = _keel_heap_tls;
    keel_heap_t *owner = keel_load_relaxed(&page->heap);
    keel_block_t *b = p;
    size_t off = (size_t)((uint8_t *)p - page->start);
    if (keel_likely(owner == heap &&
                    keel_load_acquire(&page->flags) == 0 && /* pairs with a collector's unfull */
                    _keel_page_is_carved(page, off))) {
      if (keel_likely(cls - 1u < KEEL_CACHE_CLASSES - 1u)) {
        /* Onto the thread cache, without reading the block (heap.c): if
         * the list has room and b is not its head (free(p); free(p)). */
        keel_heap_cache_t *cache = &heap->cache[cls];
        keel_block_t *head = cache->head;
        uint64_t ctr = keel_load_relaxed(&cache->ctr);
        if (keel_likely(KEEL_CACHE_CTR_N(ctr) < KEEL_CACHE_N && head != b)) {
          KEEL_TRACK_FREE(b, page->bsize);
          *_keel_cache_link(b) = _keel_cache_encode(heap->cache_secret, head);
          cache->head = b;
          keel_store_relaxed(&cache->ctr, ctr + 1);
          return;
        }
        _keel_cache_free_slow(heap, page, b, call);
        return;
      }
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
      _keel_free_other(page, p, call); /* another thread's block: one CAS */
      return;
    }
  }
  _keel_free_generic(p, call);
}

#endif /* KEEL_HEAP_ALLOC_H */
