/* What the pool tells ASan and Valgrind about its objects: the one place
 * that does.
 *
 * A cached object (on a hot or cold list) is, to the tools, freed memory:
 * ASan poisons it, memcheck sees a free (VALGRIND_FREELIKE_BLOCK); handing it
 * out again is an allocation of obj_size bytes. So a use after keel_pool_free
 * is reported like one after free(), and heaptrack-style tools that follow
 * client requests see individual objects, not heap blocks. The 16-byte header
 * belongs to the pool and is never tracked; the pool reads it while the
 * object is cached.
 *
 * Cost: under ASan a poison call per free and an unpoison per alloc (every
 * pool is flagged, so the fast paths are not used). Valgrind's requests are
 * issued only by pools created while running under it (POOL_F_TRACK), which
 * also leave the fast paths; elsewhere the requests are never reached. The
 * header is optional: without <valgrind/memcheck.h> the Valgrind part is
 * empty.
 */
#ifndef KEEL_POOL_TRACK_H
#define KEEL_POOL_TRACK_H

#include "base/common.h"

#if defined(KEEL_ASAN)
#include <sanitizer/asan_interface.h>
#define POOL_ASAN_POISON(p, n)   ASAN_POISON_MEMORY_REGION((p), (n))
#define POOL_ASAN_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
/* A function whose reads ASan must not check (memory the heap has freed). */
#define POOL_ASAN_UNCHECKED      __attribute__((no_sanitize("address")))
#else
#define POOL_ASAN_UNCHECKED
#define POOL_ASAN_POISON(p, n)   ((void)(p), (void)(n))
#define POOL_ASAN_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#if !defined(KEEL_ASAN) && !defined(KEEL_TSAN) && defined(__has_include)
#if __has_include(<valgrind/memcheck.h>)
#include <valgrind/memcheck.h>
#define POOL_HAVE_VALGRIND 1
#endif
#endif

#if defined(POOL_HAVE_VALGRIND)
#define POOL_ON_VALGRIND()      (RUNNING_ON_VALGRIND != 0)
#define POOL_VG_ALLOC(p, n)     VALGRIND_MALLOCLIKE_BLOCK((p), (n), 0, 0)
#define POOL_VG_FREE(p)         VALGRIND_FREELIKE_BLOCK((p), 0)
#define POOL_VG_DEFINED(p, n)   VALGRIND_MAKE_MEM_DEFINED((p), (n))
#define POOL_VG_UNDEFINED(p, n) VALGRIND_MAKE_MEM_UNDEFINED((p), (n))
#else
#define POOL_ON_VALGRIND()      0
#define POOL_VG_ALLOC(p, n)     ((void)(p), (void)(n))
#define POOL_VG_FREE(p)         ((void)(p))
#define POOL_VG_DEFINED(p, n)   ((void)(p), (void)(n))
#define POOL_VG_UNDEFINED(p, n) ((void)(p), (void)(n))
#endif

#endif /* KEEL_POOL_TRACK_H */
