/* The malloc and free fast paths, inlined into keel_malloc/keel_free and,
 * in libkeel-malloc.so, into malloc/free themselves.
 *
 * Cost (x86-64, gcc 12 -O2, libkeel-malloc.so, measured with
 * `valgrind --tool=callgrind` on a malloc(32)/free loop; see
 * tests/heap/test_heap_internal.c for the driver):
 *   malloc: 21 instructions: TLS load, size test, class table, current page,
 *           pop + decode, used++, two per-class counters (relaxed
 *           load/add/store each), return.
 *   free:   35 instructions: segment mask + segment-map bit test (foreign
 *           pointers), page lookup, owner and flags test, block-offset test
 *           (a multiply: interior pointers), double-free hint (one load and
 *           xor), push + encode, counter, used-- test.
 * In libkeel.so the TLS load is a TLS-descriptor call (about 4 more).
 * Neither path takes a lock, does an atomic read-modify-write or a system
 * call; every deviation (empty list, foreign page, full page, large block,
 * suspicious link) goes to a separate non-inlined slow path.
 */
#ifndef KEEL_HEAP_ALLOC_H
#define KEEL_HEAP_ALLOC_H

#include "heap/internal.h"

KEEL_INLINE void _keel_counter_add(keel_atomic(size_t) * c, size_t n) {
  /* Owner-written: a relaxed load and store, not an atomic add. */
  keel_store_relaxed(c, keel_load_relaxed(c) + n);
}

/* Pops a block from the page's free list: the caller checked it non-empty. */
KEEL_INLINE void *_keel_page_pop(keel_heap_t *heap, keel_page_t *page, unsigned cls, size_t size) {
  keel_block_t *b = page->free;
  page->free = _keel_decode(page, b->next);
  page->used++;
  _keel_counter_add(&heap->counters[cls].allocs, 1);
  _keel_counter_add(&heap->counters[cls].requested, size);
  return b;
}

KEEL_INLINE void *_keel_malloc_fast(size_t size) {
  keel_heap_t *heap = _keel_heap_tls;
  if (keel_likely(size <= KEEL_SMALL_MAX)) {
    unsigned cls = _keel_class_small[(size + 7) >> 3];
    keel_page_t *page = heap->direct[cls];
    if (keel_likely(!_keel_list_empty(page->free))) return _keel_page_pop(heap, page, cls, size);
  }
  return _keel_malloc_generic(heap, size);
}

/* A freed block's first word decodes to a link into its own segment; a live
 * block's first word does that with probability about 2^-42 (key bit 63 is
 * set, so user pointers and small values decode outside user space). */
KEEL_INLINE bool _keel_block_maybe_free(const keel_page_t *page, const keel_block_t *b) {
  return (((uintptr_t)_keel_decode(page, b->next) ^ (uintptr_t)b) >> KEEL_SEGMENT_SHIFT) == 0;
}

KEEL_INLINE void _keel_free_fast(void *p, const char *call) {
  keel_segment_t *seg = _keel_segment_of(p);
  if (keel_likely(_keel_segmap_has(seg))) { /* NULL: segment 0 is never mapped */
    keel_page_t *page = _keel_page_of(seg, p);
    keel_heap_t *heap = _keel_heap_tls;
    keel_block_t *b = p;
    if (keel_likely(keel_load_relaxed(&page->heap) == heap &&
                    keel_load_acquire(&page->flags) == 0 && /* pairs with a collector's unfull */
                    _keel_page_is_block_offset(page, (size_t)((uint8_t *)p - page->start)) &&
                    !_keel_block_maybe_free(page, b))) {
      b->next = _keel_encode(page, page->local_free);
      page->local_free = b;
      _keel_counter_add(&heap->counters[page->cls].frees, 1);
      if (keel_unlikely(--page->used == 0)) _keel_heap_page_emptied(heap, page);
      return;
    }
  }
  _keel_free_generic(p, call);
}

#endif /* KEEL_HEAP_ALLOC_H */
