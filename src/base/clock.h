/* Monotonic clocks. keel_clock_ns() is CLOCK_MONOTONIC through the vDSO
 * (about 20 ns); keel_clock_coarse_ms() is CLOCK_MONOTONIC_COARSE (a few ns,
 * tick resolution, 1-4 ms) for decay timers that need no precision. */
#ifndef KEEL_BASE_CLOCK_H
#define KEEL_BASE_CLOCK_H

#include <stdint.h>
#include <time.h>

#include "common.h"

KEEL_INLINE uint64_t keel_clock_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

KEEL_INLINE uint64_t keel_clock_coarse_ms(void) {
  struct timespec ts;
#ifdef CLOCK_MONOTONIC_COARSE
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
#else
  clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

#endif /* KEEL_BASE_CLOCK_H */
