/* Size classes.
 *
 * Choice: exact 8-byte steps up to 64 (8 .. 56), then 8 classes per doubling
 * from 64 B to 256 KiB (64, 72, ... 120, 128, 144, ...), so every request of
 * 64 bytes or more wastes less than 1/8 of its block: a request just above a
 * class c_{j-1} lands in c_j = c_{j-1} + 2^k/8 and loses at most
 * (2^k/8 - 1) / c_j < 12.5%. jemalloc and tcmalloc use the same 4-8 classes
 * per doubling; mimalloc uses 4 (up to 25% waste).
 *
 * The doubling 4 KiB .. 8 KiB gets 16 classes (256-byte steps) instead of 8,
 * and one more: a page plus a header (KEEL_CLASS_PAGE_HDR, 4096 + 16 bytes).
 * Requests of a page plus a small header (Squid's 4096 + 12, a 4 KiB buffer
 * plus its struct) are common; with 8 steps 4108 B would go to 4608 (12.2%
 * waste), with 16 to 4352 (5.9%), and any class from 4097 to 4369 fits 15
 * times in a 64 KiB page, so the page remainder alone kept such a block at
 * 4369 bytes (1.064x of 4108; glibc, whose chunks carry an 8-byte header,
 * pays 1.007x). The 4112-byte class lives in 512 KiB pages instead, 127
 * blocks with 2,064 bytes left: 4108 B costs 1.005x. Its pages are carved
 * lazily like every other, so a thread that takes one such block holds a
 * few KiB of it resident, not the whole page. The price is the usual one
 * of a bigger page: it goes back to the OS only when all its blocks are
 * free, so scattered survivors pin more. 1 MiB pages (255 blocks, 1.001x)
 * pinned twice as much for 0.4% less (review: 102,000 blocks, every 255th
 * kept, stayed at 403 MiB where 64 KiB pages fell to 28 MiB).
 *
 * Alignment: blocks are laid out from a 64 KiB-aligned page start at
 * multiples of their size, so a block is aligned to the largest power of two
 * dividing its class size: 8 for 24, 40, 56, 72 ..., 16 or more for the rest.
 * That is less than C asks (16 for any block that could hold a 16-aligned
 * object: a 24-byte block may hold a long double) and than glibc, jemalloc
 * and tcmalloc give; mimalloc does the same as keel. From 64 up the 12.5%
 * waste bound needs the 8-byte steps (65 bytes in an 80-byte block wastes
 * 18.75%); below it 16-byte steps would cost a 24-byte request a third
 * more. keel_aligned_alloc picks a class that is a multiple of the
 * alignment.
 *
 * Pages: a class of up to 8 KiB lives in 64 KiB pages (at least 8 blocks),
 * but for the page-plus-header class (512 KiB), up to 32 KiB in 256 KiB pages,
 * above in 1 MiB pages (at least 4 blocks).
 * Blocks are carved lazily, so an untouched page tail costs no RSS.
 *
 * Lookup: requests up to 1 KiB (most of a typical server's) index a 129-byte
 * table with (size + 7) / 8; larger ones compute the class from the position
 * of the highest bit, in a few instructions, off the fast path.
 */
#include <errno.h>

#include "heap/internal.h"

#include <keel/heap.h>

uint8_t _keel_class_small[KEEL_SMALL_MAX / 8 + 1];
uint32_t _keel_class_size[KEEL_CLASS_COUNT_MAX];
unsigned _keel_class_count;

/* class index of 2^k, for k = 6 .. 18 */
static uint8_t class_pow2[19];
static keel_atomic(int) classes_ready;

/* Classes per doubling starting at 2^k. */
static unsigned steps_of(unsigned k) {
  return k == 12 ? 16 : 8;
}

static void classes_build(void) {
  unsigned n = 0;
  for (uint32_t s = 8; s < 64; s += 8) _keel_class_size[n++] = s;
  for (unsigned k = 6; k < 18; k++) {
    class_pow2[k] = (uint8_t)n;
    uint32_t base = (uint32_t)1 << k, step = base / steps_of(k);
    for (unsigned j = 0; j < steps_of(k); j++) {
      _keel_class_size[n++] = base + j * step;
      if (base + j * step == 4096) _keel_class_size[n++] = KEEL_CLASS_PAGE_HDR;
    }
  }
  class_pow2[18] = (uint8_t)n;
  _keel_class_size[n++] = (uint32_t)KEEL_LARGE_MAX;
  _keel_class_count = n;
  unsigned c = 0;
  for (size_t i = 0; i <= KEEL_SMALL_MAX / 8; i++) {
    while (_keel_class_size[c] < i * 8) c++;
    _keel_class_small[i] = (uint8_t)c;
  }
}

void _keel_classes_init(void) {
  /* Runs first from a constructor, before any thread exists; the slow path
   * calls it too for a malloc that comes before constructors (the preloaded
   * malloc is called by ld.so). Building twice writes the same values. */
  if (keel_load_acquire(&classes_ready)) return;
  classes_build();
  keel_store_release(&classes_ready, 1);
}

__attribute__((constructor(101))) static void classes_ctor(void) {
  _keel_classes_init();
}

unsigned _keel_class_of(size_t size) {
  /* Every slow-path class lookup comes here, so the table is built first
   * here: a preloaded malloc is called by other libraries' constructors
   * (libselinux's, in ls, cp, id, sed, tar, find) before ours has run, and
   * an unbuilt table maps every size to class 0. The malloc fast path reads
   * the table directly; it needs no such test, as it only runs on a real
   * heap, and making a thread heap builds the table. */
  _keel_classes_init();
  if (size <= KEEL_SMALL_MAX) return _keel_class_small[(size + 7) >> 3];
  /* 2^k < size <= 2^(k+1): class 2^k + j * step with j = ceil((size - 2^k) / step). */
  unsigned k = 63u - (unsigned)__builtin_clzl(size - 1);
  unsigned shift = k - (k == 12 ? 4 : 3);
  size_t j = (size - ((size_t)1 << k) + ((size_t)1 << shift) - 1) >> shift;
  /* Above 4096 every class is one further on, past KEEL_CLASS_PAGE_HDR,
   * which takes the requests up to its size. */
  if (k == 12) j = size <= KEEL_CLASS_PAGE_HDR ? 1 : j + 1;
  return class_pow2[k] + (unsigned)j;
}

unsigned _keel_class_slices(unsigned cls) {
  uint32_t b = _keel_class_size[cls];
  if (b == KEEL_CLASS_PAGE_HDR) return 8;
  return b <= 8192 ? 1 : b <= 32768 ? 4 : 16;
}

int _keel_class_aligned(size_t size, size_t align) {
  if (size > KEEL_LARGE_MAX || align > KEEL_LARGE_MAX) return -1;
  for (unsigned c = _keel_class_of(size < align ? align : size); c < _keel_class_count; c++) {
    if ((_keel_class_size[c] & (align - 1)) == 0) return (int)c;
  }
  return -1;
}

KEEL_API int keel_heap_class_of(size_t size) {
  return size > KEEL_LARGE_MAX ? -1 : (int)_keel_class_of(size);
}

KEEL_API size_t keel_heap_classes(keel_heap_class_info_t *out, size_t max) {
  _keel_classes_init();
  for (unsigned c = 0; out != NULL && c < _keel_class_count && c < max; c++) {
    keel_heap_class_info_t *ci = &out[c];
    ci->size = _keel_class_size[c];
    ci->min_req = c == 0 ? 0 : (size_t)_keel_class_size[c - 1] + 1;
    ci->max_req = ci->size;
    ci->page_size = (size_t)_keel_class_slices(c) << KEEL_SLICE_SHIFT;
    ci->per_page = ci->page_size / ci->size;
    size_t lo = ci->min_req == 0 ? 1 : ci->min_req;
    ci->worst_waste = (double)(ci->size - lo) / (double)ci->size;
    /* What a block costs with its share of the page remainder. */
    double cost = (double)ci->page_size / (double)ci->per_page;
    ci->avg_waste = 1.0 - ((double)(lo + ci->max_req) / 2.0) / cost;
  }
  return _keel_class_count;
}
