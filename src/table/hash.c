/* Hash of byte-string keys.
 *
 * A multiply-fold hash in the style of wyhash: each step multiplies two
 * 64-bit words into 128 bits and folds the halves, which mixes every input
 * bit into every output bit in two steps. 16 bytes per step, so a 32-byte
 * DLM resource name costs three multiplies. The table seeds it at random, so
 * bucket placement differs between runs; it is not a keyed MAC, and a caller
 * facing hostile keys should hash them itself into a U64 table. Written here
 * rather than taken from xxhash because it is twenty lines and keeps libkeel
 * free of one more dependency.
 */
#include "table_internal.h"

#define K0 0xa0761d6478bd642full /* odd constants with balanced bits (wyhash's primes) */
#define K1 0xe7037ed1a0b428dbull
#define K2 0x8ebc6af09c88c6e3ull
#define K3 0x589965cc75374cc3ull

static inline uint64_t fold_mul(uint64_t a, uint64_t b) {
  __uint128_t r = (__uint128_t)a * b;
  return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static inline uint64_t read64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* 0..8 bytes, zero-extended: one unaligned-safe read per case. */
static inline uint64_t read_tail(const unsigned char *p, size_t n) {
  uint64_t v = 0;
  if (n != 0) memcpy(&v, p, n); /* an empty key may be NULL */
  return v;
}

uint64_t _keel_hash_bytes(const void *key, size_t len, uint64_t seed) {
  const unsigned char *p = key;
  uint64_t h = seed ^ fold_mul(seed ^ K0, (uint64_t)len ^ K1);
  size_t n = len;
  for (; n > 16; n -= 16, p += 16) h = fold_mul(read64(p) ^ K1, read64(p + 8) ^ h);
  uint64_t a, b;
  if (n > 8) {
    a = read64(p);
    b = read_tail(p + 8, n - 8);
  } else {
    a = read_tail(p, n);
    b = 0;
  }
  h = fold_mul(a ^ K2, b ^ h ^ K3);
  return fold_mul(h ^ K0, (uint64_t)len ^ K3);
}
