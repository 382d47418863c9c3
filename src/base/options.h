/* Runtime options (KEEL_OPTIONS), declared once in options.def.
 *
 * Reading an option is an acquire load of the ready flag and a relaxed load
 * of the value: a few instructions, no lock, no allocation, so the heap may
 * read options from inside malloc. The first read parses KEEL_OPTIONS; the
 * parser works in place on the environment string and reports problems with
 * write(2), so it may run before libc's stdio or malloc are usable.
 */
#ifndef KEEL_BASE_OPTIONS_H
#define KEEL_BASE_OPTIONS_H

#include <stdint.h>

#include "atomic.h"
#include "common.h"

typedef enum keel_opt {
#define KEEL_OPTION(name, type, def, min, max, choices, help) KEEL_OPT_##name,
#include "options.def"
#undef KEEL_OPTION
  KEEL_OPT_COUNT
} keel_opt_t;

/* Values of pheap_flush, in the order of its choices. */
enum {
  KEEL_FLUSH_AUTO,
  KEEL_FLUSH_CLWB,
  KEEL_FLUSH_CLFLUSHOPT,
  KEEL_FLUSH_CLFLUSH,
  KEEL_FLUSH_MSYNC,
  KEEL_FLUSH_NONE
};

extern keel_atomic(int64_t) _keel_option_values[KEEL_OPT_COUNT] KEEL_HIDDEN;
extern keel_atomic(int) _keel_options_ready KEEL_HIDDEN;

/* Parses KEEL_OPTIONS once; safe to race (late callers wait for the first). */
void _keel_options_init(void) KEEL_HIDDEN;

KEEL_INLINE int64_t _keel_option(keel_opt_t id) {
  /* Acquire pairs with the release in _keel_options_init: a reader that sees
   * ready also sees every value the parse stored. */
  if (keel_unlikely(keel_load_acquire(&_keel_options_ready) != 2)) _keel_options_init();
  return keel_load_relaxed(&_keel_option_values[id]);
}

/* Parses a spec on top of the current values; `source` names it in messages
 * ("KEEL_OPTIONS"). Returns the number of rejected pairs. For tests and
 * keel_options_set. */
int _keel_options_parse(const char *spec, const char *source) KEEL_HIDDEN;

/* Puts every option back to its default (tests). */
void _keel_options_reset(void) KEEL_HIDDEN;

/* Overrides one option (tests, and modules' own init configs). */
void _keel_option_set(keel_opt_t id, int64_t value) KEEL_HIDDEN;

#endif /* KEEL_BASE_OPTIONS_H */
