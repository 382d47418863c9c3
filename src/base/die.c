/* keel_die and warnings: format on the stack, write(2) to stderr. */
#include "die.h"

#include "options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* One line; longer messages are cut, never allocated for. */
#define KEEL_MSG_MAX 512

static void write_all(const char *buf, size_t len) {
  while (len > 0) {
    ssize_t n = write(STDERR_FILENO, buf, len);
    if (n <= 0) return;
    buf += n;
    len -= (size_t)n;
  }
}

/* "keel: CALL: message\n", or "keel: message\n" with no call. */
static void emit(const char *call, const char *fmt, va_list ap) {
  char buf[KEEL_MSG_MAX];
  int n = call != NULL ? snprintf(buf, sizeof(buf), "keel: %s: ", call)
                       : snprintf(buf, sizeof(buf), "keel: ");
  if (n < 0) n = 0;
  if ((size_t)n < sizeof(buf) - 1) {
    int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
    if (m > 0) n += m;
  }
  if ((size_t)n > sizeof(buf) - 2) n = (int)sizeof(buf) - 2;
  buf[n++] = '\n';
  write_all(buf, (size_t)n);
}

void _keel_vwarn(const char *fmt, va_list ap) {
  emit(NULL, fmt, ap);
}

void _keel_warn(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  emit(NULL, fmt, ap);
  va_end(ap);
}

void _keel_reject(const char *call, const char *fmt, ...) {
  if (!_keel_option(KEEL_OPT_verbose)) return;
  va_list ap;
  va_start(ap, fmt);
  emit(call, fmt, ap);
  va_end(ap);
}

void keel_die(const char *call, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  emit(call, fmt, ap);
  va_end(ap);
  abort();
}

void keel_die_at(const char *call, const char *reason, const void *addr) {
  keel_die(call, "%s at %p", reason, addr);
}

void _keel_assert_fail(const char *expr, const char *file, int line, const char *func) {
  keel_die(func, "assertion '%s' failed (%s:%d)", expr, file, line);
}
