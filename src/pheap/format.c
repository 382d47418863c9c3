/* pheap format helpers: checksums, the checked size word, header validation
 * and the per-thread error message.
 *
 * The checksum is a word-at-a-time multiply-rotate hash (not cryptographic):
 * it only has to catch torn and stale log bytes and random corruption, and
 * it runs on every redo log write (a few dozen bytes), undo snapshot and
 * commit (the snapshot's size), so it runs four lanes at once past 64 bytes.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/die.h"
#include "pheap/pheap_int.h"

static __thread char ph_errbuf[512];

const char *keel_pheap_errmsg(void) {
  return ph_errbuf;
}

int _keel_ph_err(int err, const char *path, const char *fmt, ...) {
  va_list ap;
  int n = snprintf(ph_errbuf, sizeof ph_errbuf, "%s: ", path ? path : "(pool)");
  va_start(ap, fmt);
  if (n > 0 && (size_t)n < sizeof ph_errbuf)
    vsnprintf(ph_errbuf + n, sizeof ph_errbuf - n, fmt, ap);
  va_end(ap);
  _keel_reject("pheap", "%s", ph_errbuf); /* with verbose=1; keel_pheap_errmsg() always */
  return err;
}

static inline uint64_t rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

uint64_t _keel_ph_csum(const void *p, size_t len, uint64_t seed) {
  const unsigned char *b = p;
  uint64_t h = seed ^ 0x9e3779b97f4a7c15ull ^ (len * 0xff51afd7ed558ccdull);
  size_t i = 0;
  if (len >= 64) {
    /* Four independent lanes: the multiply chains overlap, about 1 cycle
     * per 8 bytes instead of 4 (undo snapshots and commit data of KiBs). */
    uint64_t l[4] = {h, h ^ 0x632be59bd9b4e019ull, h ^ 0x8cb92ba72f3d8dd7ull,
                     h ^ 0x52dce729da3ed2b5ull};
    for (; i + 32 <= len; i += 32)
      for (int k = 0; k < 4; k++) {
        uint64_t w;
        memcpy(&w, b + i + 8 * k, 8);
        l[k] = rotl(l[k] ^ (w * 0x87c37b91114253d5ull), 31) * 0x4cf5ad432745937full;
      }
    h = l[0] ^ rotl(l[1], 17) ^ rotl(l[2], 29) ^ rotl(l[3], 43);
  }
  for (; i + 8 <= len; i += 8) {
    uint64_t w;
    memcpy(&w, b + i, 8);
    h = rotl(h ^ (w * 0x87c37b91114253d5ull), 31) * 0x4cf5ad432745937full;
  }
  if (i < len) {
    uint64_t w = 0;
    memcpy(&w, b + i, len - i);
    h = rotl(h ^ (w * 0x87c37b91114253d5ull), 31) * 0x4cf5ad432745937full;
  }
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 29;
  return h | 1; /* never 0, so an all-zero log never validates */
}

/* 40 bits of 4 KiB pages (4 PiB) and a 24-bit check of them: one 8-byte
 * store, so growth updates it failure-atomically. */
uint64_t _keel_ph_size_word(uint64_t size) {
  uint64_t pages = size >> 12;
  uint64_t chk = (_keel_ph_csum(&pages, 8, 0x5a) >> 40) & 0xffffff;
  return pages | (chk << 40);
}

uint64_t _keel_ph_size_from_word(uint64_t w) {
  uint64_t pages = w & ((1ull << 40) - 1);
  if (pages == 0 || _keel_ph_size_word(pages << 12) != w) return 0;
  return pages << 12;
}

int _keel_ph_header_check(const ph_header_t *h, const char *path, uint64_t file_size,
                          const char *layout) {
  if (memcmp(h->magic, PH_MAGIC, sizeof PH_MAGIC) != 0)
    return _keel_ph_err(KEEL_ECORRUPT, path, "not a keel pheap pool (bad magic)");
  if (h->version != PH_VERSION)
    return _keel_ph_err(KEEL_EVERSION, path,
                        "pool format version %u, this library reads version %u", h->version,
                        PH_VERSION);
  if (h->csum != _keel_ph_csum(h, offsetof(ph_header_t, csum), 0))
    return _keel_ph_err(KEEL_ECORRUPT, path, "header checksum mismatch (corrupted header)");
  if (h->hdr_bytes != PH_HDR_BYTES || h->chunk_bytes != PH_CHUNK ||
      h->zone_chunks != PH_ZONE_CHUNKS || h->nlanes != PH_NLANES ||
      h->lane_bytes != PH_LANE_BYTES || h->lanes_off != PH_HDR_BYTES ||
      h->heap_off != PH_HDR_BYTES + PH_NLANES * PH_LANE_BYTES ||
      memchr(h->layout, 0, sizeof h->layout) == NULL)
    return _keel_ph_err(KEEL_ECORRUPT, path, "header geometry is not one this library writes");
  if (layout != NULL && strcmp(h->layout, layout) != 0)
    return _keel_ph_err(KEEL_EINVAL, path, "layout is \"%s\", expected \"%s\"", h->layout, layout);
  uint64_t size = _keel_ph_size_from_word(h->size_word);
  if (size == 0) return _keel_ph_err(KEEL_ECORRUPT, path, "pool size word fails its check");
  if (size < KEEL_PHEAP_MIN_SIZE)
    return _keel_ph_err(KEEL_ECORRUPT, path, "pool size %llu is below the minimum %zu",
                        (unsigned long long)size, KEEL_PHEAP_MIN_SIZE);
  if (file_size < size)
    return _keel_ph_err(KEEL_ECORRUPT, path, "truncated: file has %llu bytes, pool has %llu",
                        (unsigned long long)file_size, (unsigned long long)size);
  /* Opening bumps the epoch; past the limit the seqs of new logs would wrap
   * below the watermark and recovery would ignore them. */
  if (h->epoch >= PH_EPOCH_LIMIT)
    return _keel_ph_err(KEEL_ECORRUPT, path,
                        "epoch %llu has reached the limit of %llu opens (or is corrupted)",
                        (unsigned long long)h->epoch, (unsigned long long)PH_EPOCH_LIMIT);
  /* Every seq the pool ever drew is below (epoch + 1) << 40 (open persists
   * the bump before the session's first log), so a watermark above that is
   * corrupt; trusted, it would hide the logs the next sessions write. */
  if ((h->ckpt_seq >> 40) > h->epoch)
    return _keel_ph_err(KEEL_ECORRUPT, path,
                        "checkpoint watermark %#llx is beyond the pool's epoch %llu (corrupted)",
                        (unsigned long long)h->ckpt_seq, (unsigned long long)h->epoch);
  return 0;
}

uint32_t _keel_ph_chunks_for(uint64_t heap_off, uint64_t size) {
  if (size <= heap_off) return 0;
  uint64_t rest = size - heap_off;
  uint64_t zones = rest / PH_ZONE_BYTES, tail = rest % PH_ZONE_BYTES;
  uint64_t n = zones * PH_ZONE_CHUNKS;
  if (tail > PH_ZONE_META) n += (tail - PH_ZONE_META) / PH_CHUNK;
  return (uint32_t)n;
}

uint32_t _keel_ph_chunk_at(const keel_pheap_t *ph, uint64_t off) {
  uint64_t heap = ph->hdr->heap_off;
  if (off < heap) return UINT32_MAX;
  uint64_t z = (off - heap) / PH_ZONE_BYTES, in = (off - heap) % PH_ZONE_BYTES;
  if (in < PH_ZONE_META) return UINT32_MAX;
  uint64_t c = z * PH_ZONE_CHUNKS + (in - PH_ZONE_META) / PH_CHUNK;
  return c < keel_load_acquire(&((keel_pheap_t *)ph)->nchunks) ? (uint32_t)c : UINT32_MAX;
}
