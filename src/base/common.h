/* Internal definitions shared by every keel module: visibility, branch hints,
 * cache-line alignment and the assertion levels. Never installed.
 *
 * Assertion levels (KEEL_DEBUG, set by the build):
 *   0  release: no assertions;
 *   1  debug and sanitizer builds: cheap checks (KEEL_ASSERT);
 *   2  debug-full (cmake -DKEEL_DEBUG_FULL=ON): expensive validators that walk
 *      whole lists (KEEL_ASSERT_FULL), meant for one CI job, never benchmarks.
 */
#ifndef KEEL_BASE_COMMON_H
#define KEEL_BASE_COMMON_H

#include <keel/keel.h>

#include <stddef.h>
#include <stdint.h>

/* Symbols shared between keel's files but not exported: the `_keel_` names. */
#define KEEL_HIDDEN __attribute__((visibility("hidden")))

#define keel_likely(x)   __builtin_expect(!!(x), 1)
#define keel_unlikely(x) __builtin_expect(!!(x), 0)

#define KEEL_NOINLINE     __attribute__((noinline))
#define KEEL_INLINE       static inline __attribute__((always_inline))
#define KEEL_NORETURN     __attribute__((noreturn))
#define KEEL_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define KEEL_UNUSED       __attribute__((unused))

/* 64 bytes on every x86-64 and most arm64 parts; false sharing between two
 * hot fields costs a cache-line transfer per write, so hot per-thread or
 * per-queue state is padded to this. */
#define KEEL_CACHE_LINE       64
#define KEEL_CACHE_ALIGNED    __attribute__((aligned(KEEL_CACHE_LINE)))
#define KEEL_ARRAY_SIZE(a)    (sizeof(a) / sizeof((a)[0]))
#define KEEL_ALIGN_UP(x, a)   (((x) + ((a)-1)) & ~((__typeof__(x))(a)-1))
#define KEEL_ALIGN_DOWN(x, a) ((x) & ~((__typeof__(x))(a)-1))
#define KEEL_IS_POW2(x)       ((x) != 0 && ((x) & ((x)-1)) == 0)

#ifndef KEEL_DEBUG
#define KEEL_DEBUG 0
#endif

/* Sanitizer detection, for code and tests that must behave differently when
 * ASan or TSan owns malloc (gcc defines the first form, clang the second). */
#if defined(__SANITIZE_ADDRESS__)
#define KEEL_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KEEL_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define KEEL_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KEEL_TSAN 1
#endif
#endif

KEEL_NORETURN void _keel_assert_fail(const char *expr, const char *file, int line,
                                     const char *func) KEEL_HIDDEN;

#if KEEL_DEBUG >= 1
#define KEEL_ASSERT(e)                                                                             \
  (keel_likely(e) ? (void)0 : _keel_assert_fail(#e, __FILE__, __LINE__, __func__))
#else
#define KEEL_ASSERT(e) ((void)0)
#endif
#if KEEL_DEBUG >= 2
#define KEEL_ASSERT_FULL(e) KEEL_ASSERT(e)
#else
#define KEEL_ASSERT_FULL(e) ((void)0)
#endif

/* splitmix64: the next of a sequence of well-mixed 64-bit values (keys and
 * cookies, not cryptography). */
KEEL_INLINE uint64_t keel_splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

#endif /* KEEL_BASE_COMMON_H */
