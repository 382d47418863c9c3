/* Fatal misuse and diagnostics.
 *
 * keel_die() is the one exit for misuse that would otherwise corrupt memory
 * (invalid or double free, use after destroy): it prints one line,
 * "keel: CALL: REASON", on stderr and aborts. It formats into a stack buffer
 * and writes with write(2): no allocation, no stdio lock, so the heap can die
 * from inside malloc and a forked child can die with locks held elsewhere.
 */
#ifndef KEEL_BASE_DIE_H
#define KEEL_BASE_DIE_H

#include <stdarg.h>

#include "common.h"

/* "keel: CALL: <formatted reason>\n", then abort(). */
KEEL_NORETURN void keel_die(const char *call, const char *fmt, ...) KEEL_PRINTF(2, 3) KEEL_HIDDEN;

/* "keel: CALL: REASON at ADDRESS\n", then abort(). */
KEEL_NORETURN void keel_die_at(const char *call, const char *reason, const void *addr) KEEL_HIDDEN;

/* "keel: <formatted message>\n" on stderr; for warnings that do not abort. */
void _keel_warn(const char *fmt, ...) KEEL_PRINTF(1, 2) KEEL_HIDDEN;

/* A call keel refuses with an error code (bad argument, overflowing size):
 * with KEEL_OPTIONS=verbose=1, "keel: CALL: <formatted reason>\n" on stderr,
 * else nothing (the caller returns the code either way). Like keel_die, no
 * allocation: the heap reports from inside malloc. */
void _keel_reject(const char *call, const char *fmt, ...) KEEL_PRINTF(2, 3) KEEL_HIDDEN;

/* `return KEEL_REJECT(KEEL_EINVAL, "keel_x", "why %d", v);` */
#define KEEL_REJECT(rc, call, ...) (_keel_reject((call), __VA_ARGS__), (rc))

/* The same, for callers that already hold a va_list. */
void _keel_vwarn(const char *fmt, va_list ap) KEEL_HIDDEN;

#endif /* KEEL_BASE_DIE_H */
