/* keel's allocation API: keel_malloc & co. The glibc names in override.c
 * call the same functions, so both builds share every line below.
 */
#include <errno.h>
#include <string.h>

#include "base/die.h"
#include "heap/alloc.h"
#include "heap/shared.h"

#include <keel/heap.h>

/* Validates a pointer and returns its usable size; dies naming `call` for a
 * pointer keel did not return. */
size_t _keel_usable_size(const void *p, const char *call) {
  if (p == NULL) return 0;
  keel_segment_t *seg = _keel_segment_of(p);
  if (!_keel_segmap_has(seg)) {
    size_t huge = _keel_huge_usable(p); /* aligned to more than 2 MiB */
    if (huge != 0) return huge;
    _keel_die_invalid(call, p);
  }
  if (seg->kind == KEEL_SEG_LARGE && (const uint8_t *)p == (uint8_t *)seg + seg->user_off) {
    return seg->mapped - seg->user_off;
  }
  if (seg->kind == KEEL_SEG_LARGE_CACHED && (const uint8_t *)p == (uint8_t *)seg + seg->user_off) {
    _keel_die_double_free(call, (void *)p); /* a large block freed and not reused yet */
  }
  if (seg->kind != KEEL_SEG_SMALL) _keel_die_invalid(call, p);
  /* A carved block: the page's never-carved tail holds block boundaries
   * too, and realloc returned such a pointer as a live block. */
  keel_page_t *page = _keel_page_of(seg, p);
  if (!_keel_page_has_block(page, p)) _keel_die_invalid(call, p);
  return page->bsize;
}

bool _keel_heap_mapped_alone(size_t size, size_t align) {
  return _keel_class_aligned(size, align < 16 ? 16 : align) < 0;
}

bool _keel_heap_is_block(const void *p) {
  keel_segment_t *seg = _keel_segment_of(p);
  if (!_keel_segmap_has(seg)) return _keel_huge_usable(p) != 0;
  if (seg->kind == KEEL_SEG_LARGE || seg->kind == KEEL_SEG_LARGE_CACHED)
    return (const uint8_t *)p == (uint8_t *)seg + seg->user_off;
  return seg->kind == KEEL_SEG_SMALL && _keel_page_has_block(_keel_page_of(seg, p), p);
}

void *_keel_calloc(size_t n, size_t size) {
  size_t total;
  if (__builtin_mul_overflow(n, size, &total)) {
    _keel_reject("calloc", "%zu x %zu bytes overflows", n, size);
    errno = ENOMEM;
    return NULL;
  }
  if (total > KEEL_LARGE_MAX) return _keel_large_alloc(total, 0, true);
  void *p = _keel_malloc_fast(total);
  if (p != NULL) memset(p, 0, total);
  return p;
}

void *_keel_realloc(void *p, size_t size) {
  if (p == NULL) return _keel_malloc_fast(size);
  if (size == 0) { /* glibc: frees and returns NULL */
    _keel_free_fast(p, "realloc");
    return NULL;
  }
  size_t usable = _keel_usable_size(p, "realloc");
  keel_segment_t *seg = _keel_segment_of(p);
  if (!_keel_segmap_has(seg)) { /* aligned to more than 2 MiB: move it */
    void *q = _keel_malloc_fast(size);
    if (q == NULL) return NULL;
    memcpy(q, p, size < usable ? size : usable);
    _keel_huge_free(p);
    return q;
  }
  /* A freed block must not come back to life in place, nor be copied from
   * before its free finds the double free. */
  if (seg->kind == KEEL_SEG_SMALL) _keel_check_not_free(_keel_page_of(seg, p), p, "realloc");
  if (seg->kind == KEEL_SEG_LARGE) {
    if (size > KEEL_LARGE_MAX) return _keel_large_realloc(seg, size);
  } else if (size <= usable && size >= usable / 2) {
    return p; /* same block: shrinking by less than half is not worth a copy */
  }
  void *q = _keel_malloc_fast(size);
  if (q == NULL) return NULL;
  memcpy(q, p, size < usable ? size : usable);
  _keel_free_fast(p, "realloc");
  return q;
}

void *_keel_aligned_alloc(size_t align, size_t size) {
  if (align <= KEEL_MIN_ALIGN) return _keel_malloc_fast(size);
  /* A class whose size is a multiple of align: its blocks, laid out from an
   * aligned page start, are all aligned; no interior pointers to track. */
  int cls = _keel_class_aligned(size, align);
  if (cls >= 0) return _keel_malloc_in_class((unsigned)cls, size);
  return _keel_large_alloc(size, align, false);
}

void _keel_collect(bool force) {
  _keel_heaps_collect(force);
  _keel_segments_collect(force);
  _keel_large_collect(force);
}

KEEL_API void *keel_malloc(size_t size) {
  return _keel_malloc_fast(size);
}

KEEL_API void keel_free(void *p) {
  _keel_free_fast(p, "free");
}

KEEL_API void keel_free_sized(void *p, size_t size) {
#if KEEL_DEBUG >= 1
  if (p != NULL && _keel_usable_size(p, "free_sized") < size) {
    keel_die("free_sized", "size %zu is larger than block %p", size, p);
  }
#else
  (void)size;
#endif
  _keel_free_fast(p, "free");
}

KEEL_API void *keel_calloc(size_t n, size_t size) {
  return _keel_calloc(n, size);
}

KEEL_API void *keel_realloc(void *p, size_t size) {
  return _keel_realloc(p, size);
}

KEEL_API void *keel_aligned_alloc(size_t align, size_t size) {
  if (!KEEL_IS_POW2(align)) {
    _keel_reject("keel_aligned_alloc", "alignment %zu is not a power of two", align);
    errno = EINVAL;
    return NULL;
  }
  return _keel_aligned_alloc(align, size);
}

KEEL_API size_t keel_usable_size(const void *p) {
  return _keel_usable_size(p, "usable_size");
}

KEEL_API void keel_heap_collect(bool force) {
  _keel_collect(force);
}
