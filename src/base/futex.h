/* Futex wait and wake: the one sleeping primitive under keel's parking
 * (sched workers, lock waiters, keel_mutex, the heap's fork and collector
 * waits). Header-only, no allocation, so the heap can sleep inside malloc.
 * Every wait may return spuriously (a wake, a signal, a changed word or the
 * deadline): callers loop on their own condition.
 */
#ifndef KEEL_BASE_FUTEX_H
#define KEEL_BASE_FUTEX_H

#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

/* Sleeps while the 32-bit word at addr equals val, until the absolute
 * CLOCK_MONOTONIC deadline in ns (UINT64_MAX: none). 0 or -errno (EAGAIN:
 * the word had changed; ETIMEDOUT; EINTR). */
KEEL_INLINE int keel_futex_wait_until(void *addr, uint32_t val, uint64_t deadline_ns) {
  struct timespec ts, *tsp = NULL;
  if (deadline_ns != UINT64_MAX) {
    ts.tv_sec = (time_t)(deadline_ns / 1000000000u);
    ts.tv_nsec = (long)(deadline_ns % 1000000000u);
    tsp = &ts;
  }
  /* WAIT_BITSET takes an absolute deadline, so a loop that re-waits after a
   * spurious return does not stretch the timeout. */
  long rc = syscall(SYS_futex, addr, FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, val, tsp, NULL,
                    FUTEX_BITSET_MATCH_ANY);
  return rc == 0 ? 0 : -errno;
}

/* Sleeps while *addr == val, without a deadline. */
KEEL_INLINE int keel_futex_wait(void *addr, uint32_t val) {
  return keel_futex_wait_until(addr, val, UINT64_MAX);
}

/* Wakes up to n waiters on addr (INT32_MAX: all). */
KEEL_INLINE void keel_futex_wake(void *addr, int n) {
  syscall(SYS_futex, addr, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, n, NULL, NULL, 0);
}

#endif /* KEEL_BASE_FUTEX_H */
