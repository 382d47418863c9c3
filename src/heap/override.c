/* The drop-in malloc: glibc's allocation names over keel's heap, built only
 * into libkeel-malloc.so (KEEL_MALLOC_OVERRIDE).
 *
 * Start-up: nothing here runs before the first malloc call, and that call
 * needs nothing but zero-initialised globals and initial-exec TLS (both
 * ready before any code of the process runs): no dlsym, no constructor that
 * allocates, no stdio on the malloc path. Options are parsed in place from
 * the environment on first use.
 *
 * Edge cases follow glibc: malloc(0) returns a unique pointer (an 8-byte
 * block); realloc(NULL, n) allocates; realloc(p, 0) frees and returns NULL;
 * free(NULL) does nothing; overflowing calloc/reallocarray and impossible
 * sizes return NULL with ENOMEM; posix_memalign returns EINVAL for an
 * alignment that is not a power of two multiple of sizeof(void *),
 * aligned_alloc sets EINVAL for one that is not a power of two, and memalign
 * rounds such an alignment up to one.
 *
 * The glibc-only introspection calls (malloc_trim, mallinfo2, malloc_info,
 * malloc_stats) are answered from keel's own state, so they never fall
 * through to glibc's empty arena.
 */
#ifdef KEEL_MALLOC_OVERRIDE
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/os.h"
#include "base/die.h"
#include "heap/alloc.h"

#include <keel/heap.h>

#define KEEL_EXPORT __attribute__((visibility("default")))

KEEL_EXPORT void *malloc(size_t size) {
  return _keel_malloc_fast(size);
}

KEEL_EXPORT void free(void *p) {
  _keel_free_fast(p, "free");
}

KEEL_EXPORT void cfree(void *p) {
  _keel_free_fast(p, "free");
}

KEEL_EXPORT void free_sized(void *p, size_t size) {
  (void)size;
  _keel_free_fast(p, "free");
}

KEEL_EXPORT void free_aligned_sized(void *p, size_t align, size_t size) {
  (void)align, (void)size;
  _keel_free_fast(p, "free");
}

KEEL_EXPORT void *calloc(size_t n, size_t size) {
  return _keel_calloc(n, size);
}

KEEL_EXPORT void *realloc(void *p, size_t size) {
  return _keel_realloc(p, size);
}

KEEL_EXPORT void *reallocarray(void *p, size_t n, size_t size) {
  size_t total;
  if (__builtin_mul_overflow(n, size, &total)) {
    _keel_reject("reallocarray", "%zu x %zu bytes overflows", n, size);
    errno = ENOMEM;
    return NULL;
  }
  return _keel_realloc(p, total);
}

KEEL_EXPORT int posix_memalign(void **out, size_t align, size_t size) {
  if (!KEEL_IS_POW2(align) || align % sizeof(void *) != 0) {
    _keel_reject("posix_memalign", "alignment %zu is not a power of two multiple of %zu", align,
                 sizeof(void *));
    return EINVAL;
  }
  int saved = errno;
  void *p = _keel_aligned_alloc(align, size);
  if (p == NULL) {
    int e = errno;
    errno = saved;
    return e == 0 ? ENOMEM : e;
  }
  *out = p;
  return 0;
}

KEEL_EXPORT void *aligned_alloc(size_t align, size_t size) {
  if (!KEEL_IS_POW2(align)) {
    _keel_reject("aligned_alloc", "alignment %zu is not a power of two", align);
    errno = EINVAL;
    return NULL;
  }
  return _keel_aligned_alloc(align, size);
}

KEEL_EXPORT void *memalign(size_t align, size_t size) {
  /* glibc rounds an alignment that is not a power of two up to one, and
   * refuses (EINVAL) only one above the largest power of two; 2^63 itself
   * then fails for want of memory (ENOMEM), as there. 0 is glibc's malloc,
   * like any alignment below 16 (below). */
  if (align != 0 && !KEEL_IS_POW2(align)) {
    if (align > ((size_t)1 << 63)) {
      _keel_reject("memalign", "alignment %zu is above 2^63", align);
      errno = EINVAL;
      return NULL;
    }
    align = (size_t)1 << (64 - __builtin_clzl(align)); /* the next power of two */
  }
  /* Below 16 it is glibc's malloc there, which is 16-aligned; keel's malloc
   * aligns a block only to the largest power of two dividing its class size
   * (8 for the 104-byte class), so ask for 16 outright. */
  if (align < 16) align = 16;
  return _keel_aligned_alloc(align, size);
}

KEEL_EXPORT void *valloc(size_t size) {
  return _keel_aligned_alloc(_keel_os_page_size(), size);
}

KEEL_EXPORT void *pvalloc(size_t size) {
  size_t ps = _keel_os_page_size();
  if (size > SIZE_MAX - ps) {
    _keel_reject("pvalloc", "%zu bytes overflows when rounded to a page", size);
    errno = ENOMEM;
    return NULL;
  }
  return _keel_aligned_alloc(ps, KEEL_ALIGN_UP(size == 0 ? 1 : size, ps));
}

KEEL_EXPORT size_t malloc_usable_size(void *p) {
  return _keel_usable_size(p, "malloc_usable_size");
}

KEEL_EXPORT int malloc_trim(size_t pad) {
  (void)pad;
  keel_heap_stats_t st;
  keel_heap_stats(&st);
  size_t before = st.purged_bytes;
  _keel_collect(true);
  keel_heap_stats(&st);
  return st.purged_bytes != before;
}

KEEL_EXPORT struct mallinfo2 mallinfo2(void) {
  keel_heap_stats_t st;
  keel_heap_stats(&st);
  struct mallinfo2 mi;
  memset(&mi, 0, sizeof(mi));
  mi.arena = st.mapped_bytes - st.large_bytes; /* heap segments */
  mi.hblks = st.large_live;
  mi.hblkhd = st.large_bytes;
  mi.uordblks = st.live_bytes; /* usable bytes, large blocks' included */
  /* Free: committed and in no live block. A live large mapping is in use
   * whole, its header page and alignment gap too, so it is taken out at
   * its mapped size, not at the usable size uordblks counts. */
  size_t in_use = st.large_bytes;
  for (size_t c = 0; c < st.n_classes; c++) in_use += st.classes[c].usable_bytes;
  mi.fordblks = st.committed_bytes > in_use ? st.committed_bytes - in_use : 0;
  mi.keepcost = 0;
  return mi;
}

KEEL_EXPORT struct mallinfo mallinfo(void) {
  struct mallinfo2 m2 = mallinfo2();
  struct mallinfo mi;
  memset(&mi, 0, sizeof(mi));
  mi.arena = (int)m2.arena;
  mi.hblks = (int)m2.hblks;
  mi.hblkhd = (int)m2.hblkhd;
  mi.uordblks = (int)m2.uordblks;
  mi.fordblks = (int)m2.fordblks;
  return mi;
}

KEEL_EXPORT void malloc_stats(void) {
  _keel_heap_print_stats_fd(STDERR_FILENO);
}

KEEL_EXPORT int malloc_info(int options, FILE *fp) {
  if (options != 0) {
    _keel_reject("malloc_info", "options must be 0, not %d", options);
    errno = EINVAL;
    return -1;
  }
  keel_heap_stats_t st;
  keel_heap_stats(&st);
  fprintf(fp, "<malloc version=\"keel-1\">\n");
  for (size_t c = 0; c < st.n_classes; c++) {
    const keel_heap_class_stats_t *cs = &st.classes[c];
    if (cs->live == 0 && cs->pages == 0) continue;
    fprintf(fp, "<size from=\"%zu\" to=\"%zu\" total=\"%zu\" count=\"%zu\" pages=\"%zu\"/>\n",
            c == 0 ? (size_t)0 : st.classes[c - 1].size + 1, cs->size, cs->usable_bytes, cs->live,
            cs->pages);
  }
  fprintf(fp,
          "<total type=\"mmap\" count=\"%zu\" size=\"%zu\"/>\n"
          "<system type=\"current\" size=\"%zu\"/>\n<system type=\"max\" size=\"%zu\"/>\n"
          "<aspace type=\"total\" size=\"%zu\"/>\n</malloc>\n",
          st.large_live, st.large_bytes, st.committed_bytes, st.committed_bytes, st.mapped_bytes);
  return 0;
}

KEEL_EXPORT int mallopt(int param, int value) {
  (void)param, (void)value;
  return 1;
}

/* glibc's internal names, which a few programs and libraries call directly:
 * a block from glibc's arena reaching keel's free would abort as invalid. */
KEEL_EXPORT void *__libc_malloc(size_t size) {
  return _keel_malloc_fast(size);
}
KEEL_EXPORT void __libc_free(void *p) {
  _keel_free_fast(p, "free");
}
KEEL_EXPORT void *__libc_calloc(size_t n, size_t size) {
  return _keel_calloc(n, size);
}
KEEL_EXPORT void *__libc_realloc(void *p, size_t size) {
  return _keel_realloc(p, size);
}
KEEL_EXPORT void *__libc_memalign(size_t align, size_t size) {
  return memalign(align, size);
}
KEEL_EXPORT void *__libc_valloc(size_t size) {
  return valloc(size);
}
KEEL_EXPORT void *__libc_pvalloc(size_t size) {
  return pvalloc(size);
}

#endif /* KEEL_MALLOC_OVERRIDE */
