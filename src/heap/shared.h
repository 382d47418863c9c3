/* The heap's services to other modules: the shared heaps, and a check that
 * an address starts a block (at the end). Never installed.
 *
 * A thread heap's pages can be collected only by their owner (or, when full,
 * by a collector: heap.c), because the owner's malloc and free fast paths
 * touch them without any synchronisation; an owner that stays idle keeps
 * every page it was allocating from, with whatever other threads freed into
 * it. The shared heaps (heap.c: 4 shards behind mutexes) have no such owner:
 * whoever holds the shard's mutex may allocate, and any thread that
 * collects (keel_heap_collect, the purge thread) retires their empty pages,
 * current ones included. A module whose heap calls are rare next to its own
 * fast path (the pool: its hot lists serve more than 99% of allocations)
 * takes its blocks from here, so that memory it gives back reaches the OS
 * even when the threads that used it never run again.
 */
#ifndef KEEL_HEAP_SHARED_H
#define KEEL_HEAP_SHARED_H

#include <stdbool.h>
#include <stddef.h>

#include "base/common.h"

/* A block of at least size bytes aligned to max(align, 16) (align a power of
 * two) from the calling thread's shard of the shared heaps, or a large
 * mapping above the largest class; freed with keel_free from any thread.
 * NULL with errno ENOMEM. Takes the shard's mutex: for slow paths only. */
void *_keel_malloc_shared(size_t size, size_t align) KEEL_HIDDEN;

/* Whether p is where a block of the heap starts (carved, live or free, or a
 * large or huge block): only the heap's own metadata is read, so any
 * address may be asked about. */
bool _keel_heap_is_block(const void *p) KEEL_HIDDEN;

/* Whether a block of `size` bytes aligned to `align` is a mapping of its
 * own rather than carved from a page: once freed, it may be unmapped. A
 * block carved from a page is not: the heap keeps an emptied segment mapped
 * (retained, segment.c), so any address inside such a block stays
 * readable (zeros once its memory went back; its old contents where
 * mlock kept it), except where the heap unmapped the segment after all:
 * under a finite RLIMIT_AS (also one set after the segment was retained),
 * past 256 GiB retained, and in a corner of kernels before 6.12 (segment.c
 * lists them). The pool's fast paths read an object's header on that
 * promise. */
bool _keel_heap_mapped_alone(size_t size, size_t align) KEEL_HIDDEN;

#endif /* KEEL_HEAP_SHARED_H */
