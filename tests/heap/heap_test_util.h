/* Helpers shared by the heap tests: a deterministic PRNG, per-block byte
 * patterns that any overlap or stray write breaks, and a pointer launderer
 * that keeps the compiler from proving (and warning about) deliberate misuse.
 */
#ifndef KEEL_TESTS_HEAP_UTIL_H
#define KEEL_TESTS_HEAP_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* splitmix64: a full-period generator; tests are deterministic per seed. */
static inline uint64_t ht_rand(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static inline size_t ht_range(uint64_t *state, size_t lo, size_t hi) {
  return lo + (size_t)(ht_rand(state) % (uint64_t)(hi - lo + 1));
}

/* Byte i of the pattern with `seed`: adjacent bytes differ, and two blocks
 * with different seeds differ at almost every byte, so a block that overlaps
 * another or is written after free shows at once. */
static inline uint8_t ht_pat(size_t i, uint32_t seed) {
  uint32_t x = (uint32_t)i * 0x9E3779B1u + seed * 0x85EBCA77u;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  return (uint8_t)(x ^ (x >> 13));
}

static inline void ht_fill(void *p, size_t from, size_t to, uint32_t seed) {
  uint8_t *b = (uint8_t *)p;
  for (size_t i = from; i < to; i++) b[i] = ht_pat(i, seed);
}

/* The index of the first byte in [from, to) that differs from the pattern, or
 * SIZE_MAX when all match. */
static inline size_t ht_check(const void *p, size_t from, size_t to, uint32_t seed) {
  const uint8_t *b = (const uint8_t *)p;
  for (size_t i = from; i < to; i++)
    if (b[i] != ht_pat(i, seed)) return i;
  return SIZE_MAX;
}

/* Hides where a pointer came from, so deliberate bad frees compile cleanly
 * under -Werror (-Wfree-nonheap-object, -Wuse-after-free). */
static inline void *ht_launder(void *p) {
  __asm__ volatile("" : "+r"(p));
  return p;
}

/* The same for sizes: keeps -Walloc-size-larger-than from rejecting the
 * deliberately impossible requests that must fail with ENOMEM. */
static inline size_t ht_hide(size_t n) {
  __asm__ volatile("" : "+r"(n));
  return n;
}

#endif /* KEEL_TESTS_HEAP_UTIL_H */
