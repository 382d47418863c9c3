/* pheap allocation classes.
 *
 * Block sizes (object header included) step by 16 bytes from 32 to 512, then
 * by 1/32 of the power of two below them up to 512 KiB: a request lands in a
 * block at most 3.1% larger than it needs, 1.6% on average. Over 100 B..132
 * KiB the average internal fragmentation is then 1.2% by block (header
 * included; libpmemobj 1.23% measured the same way) and 1.9% with the runs'
 * unused tails (bench/suite_pheap.c, case frag). With 1/16 steps, as before,
 * it was 2.3% and 3.0%; 1/64 gives 0.6% and 1.4% but doubles the per-class
 * part of every thread cache (136 bytes a class: 671 classes, 91 KiB).
 * 1/32 refines 1/16, so every block size an older pool's runs hold is still
 * a class, with the same run geometry.
 * Blocks above 512 KiB take whole 256 KiB chunks ("huge").
 *
 * A run spans 1..16 chunks: the smallest count whose tail (bytes no block
 * fits in) is under 1.5% of the run, else the count with the least waste.
 * The table is computed, not stored: a run's header records its own block
 * size, so a future table never misreads an old pool.
 */
#include "pheap/pheap_int.h"

#define PH_MAX_BLOCK   (512u << 10)
#define PH_STEPS       32                   /* classes per doubling above 512 B */
#define PH_CLASSES_MAX (31 + 10 * PH_STEPS) /* 32..512 by 16, then 10 doublings to 512 KiB */
ph_class_t _keel_ph_classes[PH_CLASSES_MAX];
unsigned _keel_ph_nclasses;

static ph_class_t class_make(uint32_t block) {
  ph_class_t best = {block, 0, 0, 0};
  double best_waste = 2.0;
  for (uint32_t k = 1; k <= PH_MAX_RUN_CHUNKS; k++) {
    uint64_t bytes = k * PH_CHUNK;
    /* Blocks and bitmap compete for the space: solve for n iteratively. */
    uint64_t n = (bytes - PH_RUN_HDR) / block, data_off;
    for (;;) {
      data_off = KEEL_ALIGN_UP(PH_RUN_HDR + (n + 63) / 64 * 8, (uint64_t)PH_LINE);
      if (data_off + n * block <= bytes) break;
      n--;
    }
    if (n == 0) continue;
    double waste = (double)(bytes - n * block) / (double)bytes;
    if (waste < best_waste) {
      best_waste = waste;
      best = (ph_class_t){block, k, (uint32_t)n, (uint32_t)data_off};
    }
    if (waste < 0.015) break;
  }
  return best;
}

void _keel_ph_classes_init(void) {
  if (_keel_ph_nclasses) return; /* idempotent; first open happens before threads use it */
  unsigned n = 0;
  for (uint32_t b = 32; b <= 512; b += 16) _keel_ph_classes[n++] = class_make(b);
  for (uint32_t p = 512; p < PH_MAX_BLOCK; p *= 2)
    for (uint32_t j = 1; j <= PH_STEPS; j++)
      _keel_ph_classes[n++] = class_make(p + j * (p / PH_STEPS));
  _keel_ph_nclasses = n;
}

int _keel_ph_class_of(uint64_t block) {
  if (block <= 512) return block <= 32 ? 0 : (int)((block - 32 + 15) / 16);
  if (block > PH_MAX_BLOCK) return -1;
  /* p = the power of two below block; index within its PH_STEPS steps. */
  unsigned lg = 63 - (unsigned)__builtin_clzll(block - 1);
  uint64_t p = 1ull << lg, step = p / PH_STEPS;
  unsigned j = (unsigned)((block - p + step - 1) / step);
  return (int)(31 + (lg - 9) * PH_STEPS + j - 1);
}
