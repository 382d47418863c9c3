/* pheap allocation classes.
 *
 * Block sizes (object header included) step by 16 bytes from 32 to 512, then
 * by 1/16 of the power of two below them up to 512 KiB: a request lands in a
 * block at most 6.25% larger than it needs, 3% on average, which with the
 * 16-byte header keeps the average internal fragmentation over 100 B..132 KiB
 * under 5% (bench/suite_pheap.c measures it, run tail waste included).
 * Blocks above 512 KiB take whole 256 KiB chunks ("huge").
 *
 * A run spans 1..16 chunks: the smallest count whose tail (bytes no block
 * fits in) is under 1.5% of the run, else the count with the least waste.
 * The table is computed, not stored: a run's header records its own block
 * size, so a future table never misreads an old pool.
 */
#include "pheap/pheap_int.h"

ph_class_t _keel_ph_classes[256];
unsigned _keel_ph_nclasses;
#define PH_MAX_BLOCK (512u << 10)

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
    for (uint32_t j = 1; j <= 16; j++) _keel_ph_classes[n++] = class_make(p + j * (p / 16));
  _keel_ph_nclasses = n;
}

int _keel_ph_class_of(uint64_t block) {
  if (block <= 512) return block <= 32 ? 0 : (int)((block - 32 + 15) / 16);
  if (block > PH_MAX_BLOCK) return -1;
  /* p = the power of two below block; index within its 16 steps. */
  unsigned lg = 63 - (unsigned)__builtin_clzll(block - 1);
  uint64_t p = 1ull << lg, step = p / 16;
  unsigned j = (unsigned)((block - p + step - 1) / step);
  return (int)(31 + (lg - 9) * 16 + j - 1);
}
