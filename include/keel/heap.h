/* keel heap: the size-class allocator every keel module stands on.
 *
 * The same allocator is the drop-in malloc in libkeel-malloc.so (LD_PRELOAD
 * it, or link it), where malloc/free/... are these functions under glibc's
 * names. All functions are thread-safe and may be called from any thread,
 * including freeing a block another thread allocated. None of them blocks on
 * another thread in the common case: the fast paths take no lock.
 *
 * Misuse aborts with one line on stderr: keel_free of a pointer keel never
 * returned ("keel: free: invalid pointer 0x..."), or of one already free
 * ("keel: free: double free of 0x...").
 */
#ifndef KEEL_HEAP_H
#define KEEL_HEAP_H

#include <keel/keel.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Allocates size bytes (a unique pointer for size 0); NULL and errno ENOMEM
 * on failure or overflow. Aligned to 16, except that the classes of 24, 40,
 * 56, 72, 88, 104 and 120 bytes are 8-aligned (mimalloc's choice; glibc,
 * jemalloc and tcmalloc give 16): the 12.5% waste bound needs 8-byte steps
 * from 64 up. C requires 16 for such a block too (it may hold a long double
 * or _Float128 member, which gcc may access with aligned SSE moves): use
 * keel_aligned_alloc(16, n) for those. Up to 8 KiB, no lock and no atomic
 * operation unless the thread's page runs out (a thread's first call, a new
 * page: locks); classes above 8 KiB take one of 4 shared heaps' mutexes;
 * large blocks (above 256 KiB) the large-block lock and a system call. */
KEEL_API void *keel_malloc(size_t size);

/* Frees a block from keel_malloc & co; NULL is a no-op. Any thread may free
 * any block. Up to 8 KiB: its own with no atomic operation, another
 * thread's with an atomic push onto the block's page (a few more, and
 * perhaps the purge thread's start, when the page was full; a thread's first
 * call registers it under a lock). Classes above 8 KiB: the block's shared
 * heap's mutex, as for their allocation (heap.c, "the shared heap"). Large
 * blocks: the large-block lock, and munmap unless the block is cached. */
KEEL_API void keel_free(void *p);

/* keel_free when the caller knows the size it asked for (a hint; checked in
 * debug builds). */
KEEL_API void keel_free_sized(void *p, size_t size);

/* n * size zeroed bytes; NULL and ENOMEM if the product overflows. */
KEEL_API void *keel_calloc(size_t n, size_t size);

/* Resizes keeping the contents up to the smaller size; glibc's semantics:
 * keel_realloc(NULL, n) allocates, keel_realloc(p, 0) frees p and returns
 * NULL. On failure p is untouched and NULL is returned with ENOMEM. Large
 * blocks grow in place where the address space allows. */
KEEL_API void *keel_realloc(void *p, size_t size);

/* size bytes aligned to align (a power of two); NULL and EINVAL for a bad
 * alignment, ENOMEM when out of memory. */
KEEL_API void *keel_aligned_alloc(size_t align, size_t size);

/* The usable size of a block: at least what was asked for; 0 for NULL. */
KEEL_API size_t keel_usable_size(const void *p);

/* Returns free memory to the OS: with force, everything free now (including
 * other threads' cached pages and delayed purges); without it, only what has
 * been free longer than the purge delay (option heap_purge_ms). */
KEEL_API void keel_heap_collect(bool force);

/* Size classes. */
#define KEEL_HEAP_MAX_CLASSES 128

typedef struct keel_heap_class_stats {
  size_t size;            /* block size of this class (usable bytes) */
  size_t requested_bytes; /* sizes asked for by live blocks: live x the class's
                             mean request since start (free is not told sizes) */
  size_t usable_bytes;    /* live blocks * size */
  size_t live;            /* live blocks */
  size_t pages;           /* pages (spans) currently holding this class */
  size_t allocs, frees;   /* totals since start */
} keel_heap_class_stats_t;

typedef struct keel_heap_stats {
  size_t mapped_bytes;    /* address space mapped from the OS and not released */
  size_t committed_bytes; /* of that, committed (not purged or decommitted) */
  size_t live_bytes;      /* usable bytes of live blocks, all sizes (keel_usable_size) */
  size_t requested_bytes; /* bytes asked for by live blocks */
  size_t large_live;      /* live blocks above the large threshold (mapped directly) */
  size_t large_bytes;     /* their mapped bytes: header page and alignment gap included */
  size_t purged_bytes;    /* total returned to the OS since start */
  size_t threads;         /* thread heaps alive */
  size_t abandoned_pages; /* pages of exited threads not yet adopted or freed */
  size_t n_classes;
  keel_heap_class_stats_t classes[KEEL_HEAP_MAX_CLASSES];
} keel_heap_stats_t;

/* Fills *st with process-wide totals and per-class figures. The figures are
 * summed from per-page and per-thread counters without stopping threads:
 * exact for a quiescent heap, approximate while others allocate. Takes
 * internal locks briefly; does not allocate. */
KEEL_API void keel_heap_stats(keel_heap_stats_t *st);

/* Prints the stats as a table: one row per size class in use, then totals. */
KEEL_API void keel_heap_print_stats(FILE *out);

/* Describes the size classes (for `keel classes`): returns the number of
 * classes and, if out is not NULL, fills up to max entries. */
typedef struct keel_heap_class_info {
  size_t size;        /* block size */
  size_t min_req;     /* smallest request served by this class */
  size_t max_req;     /* largest request served (== size) */
  size_t page_size;   /* bytes of the page (span) that holds this class */
  size_t per_page;    /* blocks per page */
  double worst_waste; /* (size - min_req) / size, before page remainder */
  double avg_waste;   /* averaged over requests min_req..max_req, page remainder included */
} keel_heap_class_info_t;

KEEL_API size_t keel_heap_classes(keel_heap_class_info_t *out, size_t max);

/* The class index serving a request of `size` bytes, or -1 for a request
 * mapped directly (above the large threshold). */
KEEL_API int keel_heap_class_of(size_t size);

#ifdef __cplusplus
}
#endif
#endif /* KEEL_HEAP_H */
