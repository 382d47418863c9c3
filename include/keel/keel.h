/* keel: a C11 runtime library for heavily multi-threaded C servers.
 *
 * This header holds what every module shares: the version, the error codes,
 * the export macro and the runtime options (KEEL_OPTIONS). Each module has its
 * own header beside this one (heap.h, pool.h, sched.h, table.h, lock.h,
 * prof.h, pheap.h); together they are the whole public API.
 *
 * Error convention: functions returning int return 0 or a negative KEEL_E*
 * code (each is a negated errno value, so strerror(-rc) also works); functions
 * returning a pointer return NULL and set errno. Misuse that would corrupt
 * memory (invalid or double free, use after destroy) does not return: it
 * prints "keel: CALL: REASON at ADDRESS" on stderr and aborts.
 */
#ifndef KEEL_KEEL_H
#define KEEL_KEEL_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KEEL_VERSION_MAJOR  0
#define KEEL_VERSION_MINOR  1
#define KEEL_VERSION_PATCH  0
#define KEEL_VERSION_STRING "0.1.0"

/* Marks a symbol as part of the public ABI; everything else is hidden. */
#if defined(__GNUC__)
#define KEEL_API __attribute__((visibility("default")))
#else
#define KEEL_API
#endif

/* Error codes: negated errno values. */
#define KEEL_OK        0
#define KEEL_EINVAL    (-EINVAL)    /* an argument is out of its domain */
#define KEEL_ENOMEM    (-ENOMEM)    /* out of memory or address space */
#define KEEL_EBUSY     (-EBUSY)     /* in use: live objects, running job, held locks */
#define KEEL_EEXIST    (-EEXIST)    /* the key is already present */
#define KEEL_ENOENT    (-ENOENT)    /* no such key, object or file */
#define KEEL_EAGAIN    (-EAGAIN)    /* would block and the caller asked not to */
#define KEEL_EDEADLK   (-EDEADLK)   /* the request would deadlock */
#define KEEL_ETIMEDOUT (-ETIMEDOUT) /* a timeout expired first */
#define KEEL_ECANCELED (-ECANCELED) /* cancelled before it ran */
#define KEEL_ESHUTDOWN (-ESHUTDOWN) /* the facility is shut down */
#define KEEL_ENOSPC    (-ENOSPC)    /* a persistent heap is full and cannot grow */
#define KEEL_EPERM     (-EPERM)     /* not allowed in this state */
#define KEEL_ECORRUPT  (-EUCLEAN)   /* on-disk or in-memory structure failed a check */
#define KEEL_EVERSION  (-EPROTO)    /* a file of another format version */
#define KEEL_ELOCKED   (-ENOLCK)    /* a file is locked by another process */

/* The message for a KEEL_E* code (or any negated errno); never NULL. */
KEEL_API const char *keel_strerror(int err);

/* The library's version string, e.g. "0.1.0". */
KEEL_API const char *keel_version(void);

/* Runtime options.
 *
 * Options are read once, lazily, from the environment variable KEEL_OPTIONS,
 * a comma-separated list of name=value pairs ("pool_sweep_s=2,stats=1"); a
 * bare name sets a boolean to true. Sizes take k/m/g suffixes. An unknown
 * name or a bad value prints one line on stderr and keeps the default. The
 * table of every option, its type, default and help is printed by
 * `keel stats --options`. With verbose=1, every call keel refuses with an
 * error code (a bad argument, an overflowing size) also prints one line,
 * "keel: CALL: what was wrong", naming the value.
 */

/* Value of the named option as an integer (booleans are 0/1, durations in
 * their declared unit, sizes in bytes); KEEL_ENOENT if no such option exists.
 * Thread-safe; does not allocate. */
KEEL_API int keel_option_get(const char *name, int64_t *value);

/* Parses "name=value,..." and applies it on top of KEEL_OPTIONS; returns 0, or
 * KEEL_EINVAL if any pair was rejected (those are reported on stderr and the
 * rest still applied). Meant for start-up, before other threads use keel. */
KEEL_API int keel_options_set(const char *spec);

/* Prints the options table (name, type, current value, default, help). */
KEEL_API void keel_options_print(FILE *out);

#ifdef __cplusplus
}
#endif
#endif /* KEEL_KEEL_H */
