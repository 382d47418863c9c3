/* Out-of-memory helpers for the tests of the heap and of what sits on it.
 *
 * The OS fault injection (src/base/os.h) makes every new mapping fail, but
 * the heap still serves requests from memory it already holds: free blocks
 * in this thread's pages, abandoned pages it can adopt, free slices of its
 * segments, cached large mappings (not retained segments: making one
 * read-write again is a commit, which the injection fails too).
 * kt_oom_begin turns the injection on and
 * then takes all of that into a hoard (one block at a time, linked through
 * the blocks), so the next request of any size up to the largest class that
 * this thread serves must ask the OS, and fails. kt_oom_end turns the
 * injection off and frees the hoard: memory comes back.
 *
 * Limits: the shared heaps (classes above 8 KiB, and pool objects) are
 * sharded by thread; the hoard drains only the calling thread's shard. Pages freed by other threads
 * meanwhile (the purge thread freeing an empty page) would hand memory back,
 * so the caller collects first and keeps other threads quiet.
 */
#ifndef KEEL_TESTS_OOM_H
#define KEEL_TESTS_OOM_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>

#include <keel/heap.h>

#include "base/os.h"
#include "heap/shared.h"

typedef struct kt_hoard {
  void *head; /* blocks linked through their first word */
  size_t n;
} kt_hoard_t;

/* Allocates `size`-byte blocks into h until the heap fails (at most max),
 * from this thread's heap or (shared) its shard of the shared heaps;
 * returns how many it got. */
static inline size_t kt_hoard_fill(kt_hoard_t *h, size_t size, size_t max, bool shared) {
  size_t k = 0;
  for (; k < max; k++) {
    void **b = (void **)(shared ? _keel_malloc_shared(size, 16) : keel_malloc(size));
    if (b == NULL) break;
    *b = h->head;
    h->head = b;
    h->n++;
  }
  return k;
}

static inline void kt_hoard_free(kt_hoard_t *h) {
  while (h->head != NULL) {
    void *next = *(void **)h->head;
    keel_free(h->head);
    h->head = next;
  }
  h->n = 0;
}

/* Turns the injection on and exhausts the heap for this thread. The bound
 * (4 Mi blocks per size) only stops a broken injection from eating the
 * machine; a working one stops each fill at the first failure. */
static inline void kt_oom_begin(kt_hoard_t *h) {
  keel_heap_collect(true);
  _keel_os_fault_set(0);
  const size_t max = (size_t)4 << 20;
  /* 1 KiB blocks first: one-slice pages take every free slice of every
   * segment, so each class below only has its partly used pages left. */
  kt_hoard_fill(h, 1024, max, false);
  keel_heap_class_info_t info[KEEL_HEAP_MAX_CLASSES];
  size_t n = keel_heap_classes(info, KEEL_HEAP_MAX_CLASSES);
  for (size_t i = 0; i < n; i++) {
    kt_hoard_fill(h, info[i].size, max, false);
    kt_hoard_fill(h, info[i].size, max, true);
  }
  kt_hoard_fill(h, (size_t)1 << 20, max, false); /* cached large mappings */
}

static inline void kt_oom_end(kt_hoard_t *h) {
  _keel_os_fault_set(-1);
  kt_hoard_free(h);
}

#endif /* KEEL_TESTS_OOM_H */
