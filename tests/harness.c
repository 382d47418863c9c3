/* The test harness: see harness.h. */
#define _GNU_SOURCE
#include "harness.h"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static _Atomic int case_failures;
static jmp_buf case_jmp;
static const char *case_name = "";

void kt_fail(const char *file, int line, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  /* Failures are rare: one locked stdio call per message keeps lines whole. */
  fprintf(stdout, "  %s:%d: [%s] %s\n", file, line, case_name, msg);
  fflush(stdout);
  atomic_fetch_add(&case_failures, 1);
}

void kt_abort_case(void) {
  longjmp(case_jmp, 1);
}

bool kt_sanitized(void) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

long kt_env_int(const char *name, long def) {
  const char *v = getenv(name);
  if (v == NULL || *v == 0) return def;
  char *end;
  long n = strtol(v, &end, 0);
  return *end == 0 ? n : def;
}

long kt_scale(long n) {
  long d = kt_sanitized() ? 8 : 1;
  return n / d > 0 ? n / d : 1;
}

double kt_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void kt_sleep_ms(double ms) {
  struct timespec ts = {(time_t)(ms / 1000),
                        (long)((ms - (double)(time_t)(ms / 1000) * 1000) * 1e6)};
  nanosleep(&ts, NULL);
}

bool kt_wait_for(bool (*cond)(void *), void *arg, double sec) {
  double end = kt_now() + sec;
  while (!cond(arg)) {
    if (kt_now() > end) return false;
    kt_sleep_ms(0.2);
  }
  return true;
}

size_t kt_rss_kb(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  if (f == NULL) return 0;
  unsigned long size = 0, rss = 0;
  int n = fscanf(f, "%lu %lu", &size, &rss);
  fclose(f);
  return n == 2 ? rss * (size_t)(sysconf(_SC_PAGESIZE) / 1024) : 0;
}

static int saved_stderr = -1;
static FILE *captured;

void kt_stderr_begin(void) {
  fflush(stderr);
  captured = tmpfile();
  saved_stderr = dup(STDERR_FILENO);
  dup2(fileno(captured), STDERR_FILENO);
}

void kt_stderr_end(char *buf, size_t len) {
  fflush(stderr);
  dup2(saved_stderr, STDERR_FILENO);
  close(saved_stderr);
  rewind(captured);
  size_t n = fread(buf, 1, len - 1, captured);
  buf[n] = 0;
  fclose(captured);
}

bool kt_expect_abort(const char *file, int line, void (*fn)(void *), void *arg, const char *expect,
                     char *out, size_t out_len) {
  int pipefd[2];
  if (pipe(pipefd) != 0) {
    kt_fail(file, line, "pipe failed");
    return false;
  }
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    close(pipefd[0]);
    dup2(pipefd[1], STDERR_FILENO);
    /* No core files from deliberate aborts. */
    signal(SIGABRT, SIG_DFL);
    fn(arg);
    _exit(0);
  }
  close(pipefd[1]);
  char buf[4096];
  size_t n = 0;
  ssize_t r;
  while ((r = read(pipefd[0], buf + n, sizeof(buf) - 1 - n)) > 0) {
    n += (size_t)r;
    if (n == sizeof(buf) - 1) break;
  }
  buf[n] = 0;
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (out != NULL && out_len > 0) snprintf(out, out_len, "%s", buf);
  bool aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  bool matched = strstr(buf, expect) != NULL;
  if (!aborted || !matched) {
    kt_fail(file, line, "expected abort with \"%s\"; child %s %d, stderr: \"%s\"", expect,
            WIFSIGNALED(status) ? "died of signal" : "exited with",
            WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status), buf);
    return false;
  }
  return true;
}

int kt_main(int argc, char **argv, const kt_case_t *cases, size_t n) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *filter = argc > 1 ? argv[1] : NULL;
  /* volatile: live across the setjmp that a failed KT_REQUIRE returns to. */
  volatile int passed = 0, failed = 0;
  for (volatile size_t i = 0; i < n; i++) {
    if (filter != NULL && strstr(cases[i].name, filter) == NULL) continue;
    case_name = cases[i].name;
    atomic_store(&case_failures, 0);
    double t0 = kt_now();
    if (setjmp(case_jmp) == 0) cases[i].fn();
    double ms = (kt_now() - t0) * 1e3;
    if (atomic_load(&case_failures) == 0) {
      printf("ok   %-40s %9.1f ms\n", cases[i].name, ms);
      passed++;
    } else {
      printf("FAIL %-40s %9.1f ms\n", cases[i].name, ms);
      failed++;
    }
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 && passed > 0 ? 0 : 1;
}
