/* What the heap tells ASan about its blocks: the one place that does.
 *
 * Under ASan (debug builds of keel and the tests) a freed small block is
 * poisoned except its first word, which holds the free-list link the heap
 * itself reads and writes; a block is unpoisoned when handed out. So a use
 * after free of a keel block is reported by ASan like one of a malloc block,
 * at the first access past the link word. A page's whole span is unpoisoned
 * when it is (re)initialised for a class. A segment the heap retains (keeps
 * mapped, read-only, after its last page went: segment.c) is poisoned whole,
 * so a stale access into it is reported, and unpoisoned when it is reused
 * or unmapped, so stale poison never outlives keel's use of the range. Large
 * blocks are mapped and unmapped directly and are not tracked.
 *
 * Valgrind needs nothing here: memcheck replaces malloc in every loaded
 * object, libkeel-malloc.so included, so it never sees keel's blocks.
 * In other builds every macro is empty.
 */
#ifndef KEEL_HEAP_TRACK_H
#define KEEL_HEAP_TRACK_H

#include "base/common.h"

#if defined(KEEL_ASAN)
#include <sanitizer/asan_interface.h>
#define KEEL_TRACK_ALLOC(p, bsize) ASAN_UNPOISON_MEMORY_REGION((p), (bsize))
#define KEEL_TRACK_FREE(p, bsize)                                                                  \
  ASAN_POISON_MEMORY_REGION((char *)(p) + sizeof(void *), (bsize) - sizeof(void *))
#define KEEL_TRACK_RESET(p, size)  ASAN_UNPOISON_MEMORY_REGION((p), (size))
#define KEEL_TRACK_RETIRE(p, size) ASAN_POISON_MEMORY_REGION((p), (size))
#else
#define KEEL_TRACK_ALLOC(p, bsize) ((void)0)
#define KEEL_TRACK_FREE(p, bsize)  ((void)0)
#define KEEL_TRACK_RESET(p, size)  ((void)0)
#define KEEL_TRACK_RETIRE(p, size) ((void)0)
#endif

#endif /* KEEL_HEAP_TRACK_H */
