/* The runtime options table and its parser.
 *
 * The table is generated from options.def, so a new option is one line
 * there. Parsing never allocates: tokens are (pointer, length) slices of the
 * spec, numbers are converted from bounded stack copies, and messages go
 * through _keel_warn (write(2)). That lets the preloaded malloc read its
 * options during its own first call.
 */
#define _GNU_SOURCE
#include "options.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomic.h"
#include "die.h"

typedef enum { T_BOOL, T_INT, T_SIZE, T_MS, T_SECONDS, T_ENUM } opt_type_t;

typedef struct opt_desc {
  const char *name;
  opt_type_t type;
  int64_t def, min, max;
  const char *choices; /* ENUM only: "a|b|c" */
  const char *help;
} opt_desc_t;

static const opt_desc_t opt_table[KEEL_OPT_COUNT] = {
#define KEEL_OPTION(name, type, def, min, max, choices, help)                                      \
  {#name, T_##type, def, min, max, choices, help},
#include "options.def"
#undef KEEL_OPTION
};

keel_atomic(int64_t) _keel_option_values[KEEL_OPT_COUNT];
keel_atomic(int) _keel_options_ready; /* 0 unparsed, 1 parsing, 2 ready */

static const char *type_name(opt_type_t t) {
  static const char *const names[] = {"bool", "int", "size", "ms", "seconds", "enum"};
  return names[t];
}

/* Message text for a rejected value of this option; ENUM lists its choices. */
static void expected(const opt_desc_t *o, char *buf, size_t len) {
  switch (o->type) {
    case T_BOOL:
      snprintf(buf, len, "expected 0, 1, true, false, yes, no, on or off");
      break;
    case T_INT:
      snprintf(buf, len, "expected an integer from %lld to %lld", (long long)o->min,
               (long long)o->max);
      break;
    case T_SIZE:
      snprintf(buf, len, "expected a size in bytes, e.g. 4096, 64k, 2m");
      break;
    case T_MS:
      snprintf(buf, len, "expected milliseconds");
      break;
    case T_SECONDS:
      snprintf(buf, len, "expected seconds");
      break;
    case T_ENUM: {
      snprintf(buf, len, "expected one of: ");
      size_t n = strlen(buf);
      for (const char *c = o->choices; *c && n + 3 < len; c++) {
        if (*c == '|') {
          buf[n++] = ',';
          buf[n++] = ' ';
        } else {
          buf[n++] = *c;
        }
      }
      buf[n] = 0;
      break;
    }
  }
}

static bool slice_eq(const char *s, size_t n, const char *word) {
  return strlen(word) == n && strncasecmp(s, word, n) == 0;
}

/* A bounded NUL-terminated copy of a value, for strtoll/strtod. */
static bool copy_value(const char *s, size_t n, char *buf, size_t len) {
  if (n == 0 || n >= len) return false;
  memcpy(buf, s, n);
  buf[n] = 0;
  return true;
}

static bool parse_int(const char *s, size_t n, int64_t *out) {
  char buf[32], *end;
  if (!copy_value(s, n, buf, sizeof(buf))) return false;
  errno = 0;
  long long v = strtoll(buf, &end, 10);
  if (errno != 0 || *end != 0) return false;
  *out = v;
  return true;
}

static bool parse_size(const char *s, size_t n, int64_t *out) {
  char buf[32], *end;
  if (!copy_value(s, n, buf, sizeof(buf)) || buf[0] == '-') return false;
  errno = 0;
  unsigned long long v = strtoull(buf, &end, 10);
  if (errno != 0 || end == buf) return false;
  unsigned shift = 0;
  switch (*end | 0x20) {
    case 'k':
      shift = 10;
      break;
    case 'm':
      shift = 20;
      break;
    case 'g':
      shift = 30;
      break;
    case 't':
      shift = 40;
      break;
    default:
      break;
  }
  if (shift != 0) end++;
  if (slice_eq(end, strlen(end), "b") || slice_eq(end, strlen(end), "ib")) end += strlen(end);
  if (*end != 0 || v > ((unsigned long long)INT64_MAX >> shift)) return false;
  *out = (int64_t)(v << shift);
  return true;
}

/* Seconds with an optional fraction, or an explicit "ms"/"s" suffix; the
 * result is in milliseconds. */
static bool parse_duration(const char *s, size_t n, bool seconds, int64_t *out) {
  char buf[32], *end;
  if (!copy_value(s, n, buf, sizeof(buf))) return false;
  errno = 0;
  double v = strtod(buf, &end);
  if (errno != 0 || end == buf || !isfinite(v) || v < 0) return false;
  if (slice_eq(end, strlen(end), "ms")) {
    seconds = false;
  } else if (slice_eq(end, strlen(end), "s")) {
    seconds = true;
  } else if (*end != 0) {
    return false;
  }
  double ms = seconds ? v * 1000.0 : v;
  if (ms > 9.0e15) return false;
  *out = (int64_t)(ms + 0.5); /* no libm in the malloc */
  return true;
}

static bool parse_enum(const opt_desc_t *o, const char *s, size_t n, int64_t *out) {
  int64_t i = 0;
  for (const char *c = o->choices; *c; i++) {
    size_t len = strcspn(c, "|");
    if (len == n && strncasecmp(c, s, n) == 0) {
      *out = i;
      return true;
    }
    c += len;
    if (*c == '|') c++;
  }
  return false;
}

static bool parse_value(const opt_desc_t *o, const char *s, size_t n, int64_t *out) {
  bool ok = false;
  switch (o->type) {
    case T_BOOL:
      if (slice_eq(s, n, "1") || slice_eq(s, n, "true") || slice_eq(s, n, "yes") ||
          slice_eq(s, n, "on")) {
        *out = 1;
        return true;
      }
      if (slice_eq(s, n, "0") || slice_eq(s, n, "false") || slice_eq(s, n, "no") ||
          slice_eq(s, n, "off")) {
        *out = 0;
        return true;
      }
      return false;
    case T_INT:
      ok = parse_int(s, n, out);
      break;
    case T_SIZE:
      ok = parse_size(s, n, out);
      break;
    case T_MS:
      ok = parse_duration(s, n, false, out);
      break;
    case T_SECONDS:
      ok = parse_duration(s, n, true, out);
      break;
    case T_ENUM:
      return parse_enum(o, s, n, out);
  }
  return ok && *out >= o->min && *out <= o->max;
}

static const opt_desc_t *find(const char *s, size_t n) {
  for (size_t i = 0; i < KEEL_OPT_COUNT; i++) {
    if (strlen(opt_table[i].name) == n && memcmp(opt_table[i].name, s, n) == 0) {
      return &opt_table[i];
    }
  }
  return NULL;
}

static bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n';
}

/* Messages quote at most this much of a token, so a huge spec stays one line. */
#define QUOTE_MAX 64

static int parse_pair(const char *s, size_t n, const char *source) {
  while (n > 0 && is_space(*s)) s++, n--;
  while (n > 0 && is_space(s[n - 1])) n--;
  if (n == 0) return 0;
  const char *eq = memchr(s, '=', n);
  size_t name_len = eq != NULL ? (size_t)(eq - s) : n;
  while (name_len > 0 && is_space(s[name_len - 1])) name_len--;
  const char *val = eq != NULL ? eq + 1 : s + n;
  size_t val_len = (size_t)(s + n - val);
  while (val_len > 0 && is_space(*val)) val++, val_len--;
  const char *cut_name = name_len > QUOTE_MAX ? "..." : "";
  const opt_desc_t *o = find(s, name_len);
  if (o == NULL) {
    _keel_warn("%s: unknown option '%.*s%s'", source,
               (int)(name_len > QUOTE_MAX ? QUOTE_MAX : name_len), s, cut_name);
    return 1;
  }
  int64_t v = 1; /* a bare name sets a boolean */
  bool bare_bool = eq == NULL && o->type == T_BOOL;
  if (!bare_bool && !parse_value(o, val, val_len, &v)) {
    char exp[160];
    expected(o, exp, sizeof(exp));
    _keel_warn("%s: bad value '%.*s%s' for '%s' (%s)", source,
               (int)(val_len > QUOTE_MAX ? QUOTE_MAX : val_len), val,
               val_len > QUOTE_MAX ? "..." : "", o->name, exp);
    return 1;
  }
  keel_store_relaxed(&_keel_option_values[o - opt_table], v);
  return 0;
}

int _keel_options_parse(const char *spec, const char *source) {
  int rejected = 0;
  if (spec == NULL) return 0;
  while (*spec) {
    size_t n = strcspn(spec, ",");
    rejected += parse_pair(spec, n, source);
    spec += n;
    if (*spec == ',') spec++;
  }
  return rejected;
}

void _keel_options_reset(void) {
  for (size_t i = 0; i < KEEL_OPT_COUNT; i++) {
    keel_store_relaxed(&_keel_option_values[i], opt_table[i].def);
  }
}

void _keel_option_set(keel_opt_t id, int64_t value) {
  if (keel_load_acquire(&_keel_options_ready) != 2) _keel_options_init();
  keel_store_relaxed(&_keel_option_values[id], value);
}

void _keel_options_init(void) {
  int expected_state = 0;
  if (keel_cas_strong_acq_rel(&_keel_options_ready, &expected_state, 1)) {
    _keel_options_reset();
    _keel_options_parse(getenv("KEEL_OPTIONS"), "KEEL_OPTIONS");
    /* Release: publishes every value stored above to readers of ready. */
    keel_store_release(&_keel_options_ready, 2);
    return;
  }
  /* Another thread is parsing: the parse is short and never blocks. */
  while (keel_load_acquire(&_keel_options_ready) != 2) keel_cpu_relax();
}

KEEL_API int keel_option_get(const char *name, int64_t *value) {
  if (name == NULL || value == NULL) return KEEL_EINVAL;
  const opt_desc_t *o = find(name, strlen(name));
  if (o == NULL) return KEEL_ENOENT;
  *value = _keel_option((keel_opt_t)(o - opt_table));
  return 0;
}

KEEL_API int keel_options_set(const char *spec) {
  if (spec == NULL) return KEEL_EINVAL;
  if (keel_load_acquire(&_keel_options_ready) != 2) _keel_options_init();
  return _keel_options_parse(spec, "keel_options_set") == 0 ? 0 : KEEL_EINVAL;
}

static void format_value(const opt_desc_t *o, int64_t v, char *buf, size_t len) {
  switch (o->type) {
    case T_BOOL:
      snprintf(buf, len, "%s", v ? "true" : "false");
      break;
    case T_SECONDS:
      snprintf(buf, len, "%gs", (double)v / 1000.0);
      break;
    case T_MS:
      snprintf(buf, len, "%lldms", (long long)v);
      break;
    case T_ENUM: {
      const char *c = o->choices;
      for (int64_t i = 0; i < v && *c; i++) {
        c += strcspn(c, "|");
        if (*c == '|') c++;
      }
      snprintf(buf, len, "%.*s", (int)strcspn(c, "|"), c);
      break;
    }
    default:
      snprintf(buf, len, "%lld", (long long)v);
      break;
  }
}

KEEL_API void keel_options_print(FILE *out) {
  fprintf(out, "%-18s %-8s %-12s %-12s %s\n", "option", "type", "value", "default", "meaning");
  for (size_t i = 0; i < KEEL_OPT_COUNT; i++) {
    const opt_desc_t *o = &opt_table[i];
    char cur[48], def[48];
    format_value(o, _keel_option((keel_opt_t)i), cur, sizeof(cur));
    format_value(o, o->def, def, sizeof(def));
    fprintf(out, "%-18s %-8s %-12s %-12s %s", o->name, type_name(o->type), cur, def, o->help);
    if (o->type == T_ENUM) fprintf(out, " (%s)", o->choices);
    fputc('\n', out);
  }
}
