/* keel-bench harness: the helpers of bench.h, the suite registry, and the
 * parent/child protocol that makes every measurement belong to one allocator.
 *
 * Protocol. For each (case, threads) the parent runs `reps` repetitions, and
 * within each repetition every impl once, in impl order, so a slow minute on
 * the (shared, noisy) machine hurts all impls alike. Each run is a fork+exec
 * of keel-bench itself:
 *
 *   keel-bench --child FD SUITE CASE IMPL THREADS SIZE      (LD_PRELOAD=lib)
 *
 * The child checks that malloc really resolves to the preloaded library (a
 * preload that silently fails would otherwise report glibc's numbers under a
 * peer's name), runs the case once and writes a kb_wire_t to FD. The parent
 * reads it under a deadline, reaps the child with wait4() and takes user and
 * sys time and peak RSS from that rusage, so they are the child's alone. A
 * child that dies, exits without a result or outlives the timeout is killed
 * (with its process group), reported on stderr and left out of the medians;
 * the run goes on. Medians are taken field by field over the repetitions that
 * finished.
 *
 * Peers are found by soname through `ldconfig -p`, then in the usual library
 * directories; KB_PRELOAD_<IMPL> (e.g. KB_PRELOAD_JEMALLOC=/opt/lib/x.so)
 * overrides. "keel" is <dir of keel-bench>/../lib/libkeel-malloc.so. A peer
 * that cannot be found is skipped with a note, never silently. */
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness_internal.h"

extern char **environ;

#define KB_WIRE_MAGIC  0x6b62656e63680001ull /* "kbench" v1 */
#define KB_EXIT_USAGE  2
#define KB_EXIT_SKIP   3 /* the case said it cannot run here */
#define KB_EXIT_NOLIB  4 /* malloc is not the preloaded library's */
#define KB_MAX_THREADS 4096
#define KB_MAX_REPS    101
#define KB_MAX_IMPLS   16

/* What a child writes to its result pipe: once, at the end. */
typedef struct kb_wire {
  uint64_t magic;
  kb_result_t r;
} kb_wire_t;

/* ---------------------------------------------------------------------------
 * Helpers for case functions
 * ------------------------------------------------------------------------- */

void kb_extra(kb_result_t *r, const char *key, double value) {
  int i;
  for (i = 0; i < r->n_extra; i++)
    if (strcmp(r->extra[i].key, key) == 0) break;
  if (i == KB_EXTRA_MAX) {
    fprintf(stderr, "keel-bench: kb_extra: more than %d extras; '%s' dropped\n", KB_EXTRA_MAX, key);
    return;
  }
  snprintf(r->extra[i].key, sizeof(r->extra[i].key), "%s", key);
  r->extra[i].value = value;
  if (i == r->n_extra) r->n_extra++;
}

double kb_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t kb_thread_cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* /proc/self/statm with read(2): no stdio buffer, so measuring RSS does not
 * itself allocate through the allocator under test. */
size_t kb_rss_kb(void) {
  char buf[128];
  int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  unsigned long size = 0, resident = 0;
  if (sscanf(buf, "%lu %lu", &size, &resident) != 2) return 0;
  return resident * ((size_t)sysconf(_SC_PAGESIZE) / 1024);
}

uint64_t kb_rand(uint64_t *s) {
  uint64_t x = *s ? *s : 0x9e3779b97f4a7c15ull; /* xorshift's state must not be 0 */
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545f4914f6cdd1dull;
}

/* The gates of kb_run_threads_span. Start: the caller waits until every
 * thread has arrived, calls span->begin, stamps the start, then opens the
 * gate with one broadcast. End (only with span->end): each thread, back from
 * fn, reports and parks; once all have, the caller calls span->end and then
 * lets them exit. Threads block on condition variables rather than spin, so
 * 256 threads on 2 cores arrive without starving the ones still being
 * created. */
typedef struct kb_gate {
  pthread_mutex_t mu;
  pthread_cond_t arrived; /* signalled when ready == n, and when done == n */
  pthread_cond_t open;    /* broadcast when go becomes true */
  pthread_cond_t leave;   /* broadcast when released becomes true */
  int ready, done, n;
  bool go, released, hold; /* hold: threads park after fn until released */
  void (*fn)(int i, void *arg);
  void *arg;
} kb_gate_t;

typedef struct kb_thread {
  pthread_t tid;
  kb_gate_t *gate;
  int i;
} kb_thread_t;

static void *kb_thread_main(void *p) {
  kb_thread_t *t = p;
  kb_gate_t *g = t->gate;
  pthread_mutex_lock(&g->mu);
  if (++g->ready == g->n) pthread_cond_signal(&g->arrived);
  while (!g->go) pthread_cond_wait(&g->open, &g->mu);
  pthread_mutex_unlock(&g->mu);
  g->fn(t->i, g->arg);
  if (g->hold) {
    pthread_mutex_lock(&g->mu);
    if (++g->done == g->n) pthread_cond_signal(&g->arrived);
    while (!g->released) pthread_cond_wait(&g->leave, &g->mu);
    pthread_mutex_unlock(&g->mu);
  }
  return NULL;
}

double kb_run_threads_span(int threads, void (*fn)(int i, void *arg), void *arg,
                           const kb_span_t *span) {
  kb_gate_t g = {.mu = PTHREAD_MUTEX_INITIALIZER,
                 .arrived = PTHREAD_COND_INITIALIZER,
                 .open = PTHREAD_COND_INITIALIZER,
                 .leave = PTHREAD_COND_INITIALIZER,
                 .n = threads,
                 .hold = span != NULL && span->end != NULL,
                 .fn = fn,
                 .arg = arg};
  kb_thread_t *ts = calloc((size_t)threads, sizeof(*ts));
  if (ts == NULL) {
    fprintf(stderr, "keel-bench: kb_run_threads: out of memory for %d threads\n", threads);
    abort();
  }
  for (int i = 0; i < threads; i++) {
    ts[i].gate = &g;
    ts[i].i = i;
    int rc = pthread_create(&ts[i].tid, NULL, kb_thread_main, &ts[i]);
    if (rc != 0) {
      fprintf(stderr, "keel-bench: pthread_create (thread %d of %d): %s\n", i, threads,
              strerror(rc));
      abort();
    }
  }
  pthread_mutex_lock(&g.mu);
  while (g.ready < threads) pthread_cond_wait(&g.arrived, &g.mu);
  if (span != NULL && span->begin != NULL) span->begin(span->ctx);
  double t0 = kb_now(), t1 = 0;
  g.go = true;
  pthread_cond_broadcast(&g.open);
  if (g.hold) {
    while (g.done < threads) pthread_cond_wait(&g.arrived, &g.mu);
    pthread_mutex_unlock(&g.mu);
    span->end(span->ctx);
    t1 = kb_now();
    pthread_mutex_lock(&g.mu);
    g.released = true;
    pthread_cond_broadcast(&g.leave);
  }
  pthread_mutex_unlock(&g.mu);
  for (int i = 0; i < threads; i++) pthread_join(ts[i].tid, NULL);
  if (!g.hold) t1 = kb_now();
  free(ts);
  return t1 - t0;
}

double kb_run_threads(int threads, void (*fn)(int i, void *arg), void *arg) {
  return kb_run_threads_span(threads, fn, arg, NULL);
}

/* ---------------------------------------------------------------------------
 * Registry
 * ------------------------------------------------------------------------- */

static kb_suite_t *kb_suites;

/* Kept sorted by name so --list and `all` do not depend on link order. */
void kb_suite_register(kb_suite_t *s) {
  kb_suite_t **p = &kb_suites;
  while (*p && strcmp((*p)->name, s->name) < 0) p = &(*p)->next;
  s->next = *p;
  *p = s;
}

const kb_suite_t *kb_suite_first(void) {
  return kb_suites;
}

/* The hidden "selftest" suite checks the harness itself (tests/bench): a case
 * that finishes, one that crashes, one that hangs and one that cannot run.
 * It is not registered, so --list, `all` and `make bench` never see it. */
static int kb_self_ok(const kb_params_t *p, kb_result_t *r) {
  double t0 = kb_now();
  volatile uint64_t s = 1;
  uint64_t n = (uint64_t)(100000 * p->scale) + 1;
  for (uint64_t i = 0; i < n; i++) s = s * 6364136223846793005ull + 1;
  r->ops = (double)n;
  r->seconds = kb_now() - t0;
  kb_extra(r, "threads_seen", p->threads);
  return 0;
}

static int kb_self_crash(const kb_params_t *p, kb_result_t *r) {
  (void)p, (void)r;
  raise(SIGSEGV);
  return 0;
}

static int kb_self_hang(const kb_params_t *p, kb_result_t *r) {
  (void)p, (void)r;
  for (;;) pause();
  return 0;
}

static int kb_self_skip(const kb_params_t *p, kb_result_t *r) {
  (void)p, (void)r;
  fprintf(stderr, "selftest: this case cannot run here\n");
  return 1;
}

/* Every one of p->threads workers must run exactly once, also 256 on 2
 * cores; a miss is a crash, which the test sees. */
static void kb_self_worker(int i, void *arg) {
  atomic_fetch_add((_Atomic int *)arg + i, 1);
}

static int kb_self_threads(const kb_params_t *p, kb_result_t *r) {
  _Atomic int *ran = calloc((size_t)p->threads, sizeof(*ran));
  if (ran == NULL) abort();
  r->seconds = kb_run_threads(p->threads, kb_self_worker, ran);
  for (int i = 0; i < p->threads; i++)
    if (atomic_load(&ran[i]) != 1) {
      fprintf(stderr, "selftest: worker %d ran %d times\n", i, atomic_load(&ran[i]));
      abort();
    }
  r->ops = p->threads;
  free(ran);
  return 0;
}

static const kb_impl_t kb_self_impls[] = {{"a", NULL}, {"b", NULL}, {NULL, NULL}};
static const kb_case_t kb_self_cases[] = {
    {"ok", "finishes", kb_self_ok, kb_self_impls, true, NULL, false},
    {"threads", "kb_run_threads runs each worker once", kb_self_threads, kb_self_impls, true, NULL,
     false},
    {"crash", "dies of SIGSEGV", kb_self_crash, kb_self_impls, false, NULL, false},
    {"hang", "never returns", kb_self_hang, kb_self_impls, false, NULL, false},
    {"skip", "cannot run here", kb_self_skip, kb_self_impls, false, NULL, false},
    {NULL}};
static kb_suite_t kb_self_suite = {"selftest", "the harness's own checks (hidden)", kb_self_cases,
                                   "1,2", NULL};

const kb_suite_t *kb_suite_find(const char *name) {
  if (strcmp(name, kb_self_suite.name) == 0) return &kb_self_suite;
  for (const kb_suite_t *s = kb_suites; s; s = s->next)
    if (strcmp(s->name, name) == 0) return s;
  return NULL;
}

static const kb_case_t *kb_case_find(const kb_suite_t *s, const char *name) {
  for (const kb_case_t *c = s->cases; c->name; c++)
    if (strcmp(c->name, name) == 0) return c;
  return NULL;
}

static const char *kb_metric_name(const kb_case_t *c) {
  return c->metric ? c->metric : "ops_per_s";
}

static bool kb_lower_is_better(const kb_case_t *c) {
  return c->metric ? c->lower_is_better : false;
}

void kb_list(bool machine) {
  for (const kb_suite_t *s = kb_suites; s; s = s->next) {
    if (!machine) printf("%s: %s (threads %s)\n", s->name, s->help, s->default_threads);
    for (const kb_case_t *c = s->cases; c->name; c++) {
      if (machine) {
        printf("%s\t%s\t%d\t%s\t%d\n", s->name, c->name, c->threaded, kb_metric_name(c),
               kb_lower_is_better(c));
        continue;
      }
      char what[64], thr[32];
      snprintf(thr, sizeof(thr), "threaded%s%s", c->threads ? " " : "",
               c->threads ? c->threads : "");
      snprintf(what, sizeof(what), "%s, %s %s", c->threaded ? thr : "once", kb_metric_name(c),
               kb_lower_is_better(c) ? "lower" : "higher");
      printf("  %-14s %-34s %s\n", c->name, what, c->help);
      printf("  %-14s %-34s impls:", "", "");
      for (const kb_impl_t *m = c->impls; m->name; m++) printf(" %s", m->name);
      printf("\n");
    }
  }
}

bool kb_parse_size(const char *s, double *scale) {
  if (strcmp(s, "small") == 0) return *scale = 0.1, true;
  if (strcmp(s, "default") == 0) return *scale = 1.0, true;
  if (strcmp(s, "large") == 0) return *scale = 10.0, true;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !(v > 0) || !isfinite(v)) return false;
  *scale = v;
  return true;
}

/* ---------------------------------------------------------------------------
 * Finding the allocator libraries
 * ------------------------------------------------------------------------- */

typedef struct kb_peer_lib {
  const char *name;
  const char *sonames[3]; /* in order of preference */
} kb_peer_lib_t;

static const kb_peer_lib_t kb_peer_libs[] = {
    {"jemalloc", {"libjemalloc.so.2", "libjemalloc.so", NULL}},
    {"mimalloc", {"libmimalloc.so.2", "libmimalloc.so", NULL}},
    {"tcmalloc", {"libtcmalloc_minimal.so.4", "libtcmalloc.so.4", NULL}},
};

#if defined(__x86_64__)
#define KB_LDCONFIG_ARCH "x86-64"
#elif defined(__aarch64__)
#define KB_LDCONFIG_ARCH "AArch64"
#else
#define KB_LDCONFIG_ARCH NULL
#endif

/* `ldconfig -p` lines read "\tSONAME (libc6,x86-64) => PATH"; takes the
 * first whose soname matches and whose architecture is ours. */
static bool kb_ldconfig_find(const char *soname, char *path, size_t len) {
  FILE *f = popen("{ /sbin/ldconfig -p || ldconfig -p; } 2>/dev/null", "r");
  if (f == NULL) return false;
  char line[1024];
  bool found = false;
  size_t n = strlen(soname);
  while (!found && fgets(line, sizeof(line), f)) {
    char *p = line;
    while (isspace((unsigned char)*p)) p++;
    if (strncmp(p, soname, n) != 0 || p[n] != ' ') continue;
    char *arrow = strstr(p, "=> ");
    if (arrow == NULL) continue;
    if (KB_LDCONFIG_ARCH && strstr(p, KB_LDCONFIG_ARCH) == NULL) continue;
    char *q = arrow + 3;
    q[strcspn(q, "\n")] = '\0';
    if (access(q, R_OK) == 0) found = snprintf(path, len, "%s", q) < (int)len;
  }
  pclose(f);
  return found;
}

static bool kb_dir_find(const char *soname, char *path, size_t len) {
  static const char *dirs[] = {"/usr/lib/x86_64-linux-gnu",
                               "/lib/x86_64-linux-gnu",
                               "/usr/lib/aarch64-linux-gnu",
                               "/usr/lib64",
                               "/usr/lib",
                               "/usr/local/lib"};
  for (size_t i = 0; i < sizeof(dirs) / sizeof(dirs[0]); i++) {
    snprintf(path, len, "%s/%s", dirs[i], soname);
    if (access(path, R_OK) == 0) return true;
  }
  return false;
}

/* The absolute path of the running keel-bench. */
static const char *kb_exe_path(void) {
  static char exe[PATH_MAX];
  if (exe[0] == '\0') {
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) {
      perror("keel-bench: readlink /proc/self/exe");
      exit(1);
    }
    exe[n] = '\0';
  }
  return exe;
}

/* Resolves an impl's preload to a library path. Returns true with path[0]
 * == '\0' for "glibc" (no preload); false with a note in `why` when the
 * library is not here. */
static bool kb_preload_lookup(const char *preload, char *path, size_t len, char *why, size_t wlen) {
  path[0] = '\0';
  if (strcmp(preload, "glibc") == 0) return true;
  char env[64];
  snprintf(env, sizeof(env), "KB_PRELOAD_%s", preload);
  for (char *p = env; *p; p++) *p = (char)toupper((unsigned char)*p);
  const char *override = getenv(env);
  if (override && *override) {
    if (access(override, R_OK) == 0) return snprintf(path, len, "%s", override) < (int)len;
    snprintf(why, wlen, "%s (from %s)", override, env);
    return false;
  }
  if (strcmp(preload, "keel") == 0) {
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", kb_exe_path());
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    snprintf(why, wlen, "%s/../lib/libkeel-malloc.so", dir);
    if (realpath(why, path) && access(path, R_OK) == 0) return true;
    path[0] = '\0';
    return false;
  }
  if (strchr(preload, '/')) {
    snprintf(why, wlen, "%s", preload);
    return access(preload, R_OK) == 0 && snprintf(path, len, "%s", preload) < (int)len;
  }
  for (size_t i = 0; i < sizeof(kb_peer_libs) / sizeof(kb_peer_libs[0]); i++) {
    const kb_peer_lib_t *l = &kb_peer_libs[i];
    if (strcmp(l->name, preload) != 0) continue;
    for (int j = 0; l->sonames[j]; j++)
      if (kb_ldconfig_find(l->sonames[j], path, len) || kb_dir_find(l->sonames[j], path, len))
        return true;
    snprintf(why, wlen, "%s", l->sonames[0]);
    path[0] = '\0';
    return false;
  }
  snprintf(why, wlen, "unknown preload '%s'", preload);
  return false;
}

/* kb_preload_lookup, once per preload name per process (every case asks). */
static bool kb_preload_resolve(const char *preload, char *path, size_t len, char *why,
                               size_t wlen) {
  static struct {
    char name[32], path[PATH_MAX], why[PATH_MAX + 64];
    bool ok;
  } cache[KB_MAX_IMPLS];
  static int n;
  int i = 0;
  while (i < n && strcmp(cache[i].name, preload) != 0) i++;
  if (i == n) {
    if (n == KB_MAX_IMPLS) return kb_preload_lookup(preload, path, len, why, wlen);
    snprintf(cache[i].name, sizeof(cache[i].name), "%s", preload);
    cache[i].ok = kb_preload_lookup(preload, cache[i].path, sizeof(cache[i].path), cache[i].why,
                                    sizeof(cache[i].why));
    n++;
  }
  snprintf(path, len, "%s", cache[i].path);
  snprintf(why, wlen, "%s", cache[i].why);
  return cache[i].ok;
}

/* ---------------------------------------------------------------------------
 * The child
 * ------------------------------------------------------------------------- */

/* True when malloc resolves into the library we meant to preload. A preload
 * the loader refused (wrong ELF class, a missing dependency) only warns, and
 * would otherwise be measured as glibc under the peer's name. With nothing
 * preloaded ("glibc") there is nothing to check: malloc is libc's, or a
 * sanitizer's interceptor in a sanitizer build. */
static bool kb_child_check_malloc(const kb_impl_t *m) {
  const char *want = getenv("LD_PRELOAD");
  if (m->preload == NULL || want == NULL || *want == '\0') return true;
  want = strrchr(want, '/') ? strrchr(want, '/') + 1 : want;
  Dl_info di;
  void *sym = dlsym(RTLD_DEFAULT, "malloc");
  if (sym == NULL || dladdr(sym, &di) == 0 || di.dli_fname == NULL) {
    fprintf(stderr, "keel-bench: %s: cannot tell where malloc comes from\n", m->name);
    return false;
  }
  const char *got = strrchr(di.dli_fname, '/') ? strrchr(di.dli_fname, '/') + 1 : di.dli_fname;
  if (strcmp(got, want) == 0) return true;
  fprintf(stderr, "keel-bench: %s: malloc comes from %s, not %s\n", m->name, di.dli_fname, want);
  return false;
}

int kb_child_main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "keel-bench: --child FD SUITE CASE IMPL THREADS SIZE\n");
    return KB_EXIT_USAGE;
  }
  int fd = atoi(argv[0]);
  const kb_suite_t *s = kb_suite_find(argv[1]);
  const kb_case_t *c = s ? kb_case_find(s, argv[2]) : NULL;
  const kb_impl_t *m = NULL;
  for (const kb_impl_t *i = c ? c->impls : NULL; i && i->name; i++)
    if (strcmp(i->name, argv[3]) == 0) m = i;
  kb_params_t p = {.suite = argv[1],
                   .case_name = argv[2],
                   .impl = argv[3],
                   .threads = atoi(argv[4]),
                   .size = argv[5]};
  if (m == NULL || p.threads < 1 || !kb_parse_size(p.size, &p.scale)) {
    fprintf(stderr, "keel-bench: --child: no %s/%s impl %s\n", argv[1], argv[2], argv[3]);
    return KB_EXIT_USAGE;
  }
  if (!kb_child_check_malloc(m)) return KB_EXIT_NOLIB;
  kb_wire_t w = {.magic = KB_WIRE_MAGIC};
  if (c->run(&p, &w.r) != 0) return KB_EXIT_SKIP;
  if (write(fd, &w, sizeof(w)) != (ssize_t)sizeof(w)) {
    perror("keel-bench: --child: writing the result");
    return 1;
  }
  close(fd);
  return 0;
}

/* ---------------------------------------------------------------------------
 * The parent: one child per run
 * ------------------------------------------------------------------------- */

typedef enum kb_status {
  KB_OK,
  KB_SKIP,    /* the case cannot run with this impl here; not an error */
  KB_NOIMPL,  /* the preload does not provide malloc: skip the impl everywhere */
  KB_FAIL,    /* crashed, exited without a result or non-zero */
  KB_TIMEOUT, /* killed at the deadline */
} kb_status_t;

/* One finished run. */
typedef struct kb_sample {
  kb_result_t r;
  double user_s, sys_s, peak_rss_kb;
} kb_sample_t;

/* The child being waited for, so SIGINT/SIGTERM can take it (and its
 * process group, which the parent's terminal signals do not reach) along. */
static volatile sig_atomic_t kb_current_child;

static void kb_on_signal(int sig) {
  pid_t pid = kb_current_child;
  if (pid > 0) {
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

static void kb_install_signals(void) {
  static bool done;
  if (done) return;
  done = true;
  struct sigaction sa = {.sa_handler = kb_on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
}

/* environ without LD_PRELOAD, plus LD_PRELOAD=path when path is set. */
static char **kb_child_env(const char *path) {
  size_t n = 0;
  while (environ[n]) n++;
  char **env = calloc(n + 2, sizeof(*env));
  if (env == NULL) abort();
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "LD_PRELOAD=", 11) != 0) env[k++] = environ[i];
  if (path && *path) {
    size_t len = strlen(path) + 12;
    env[k] = malloc(len);
    if (env[k] == NULL) abort();
    snprintf(env[k++], len, "LD_PRELOAD=%s", path);
  }
  env[k] = NULL;
  return env;
}

/* Reads what the child wrote into buf; false at end of file or error. */
static bool kb_drain(int fd, char *buf, size_t cap, size_t *got) {
  for (;;) {
    char tmp[512];
    ssize_t n = read(fd, tmp, sizeof(tmp));
    if (n > 0) {
      size_t take = (size_t)n < cap - *got ? (size_t)n : cap - *got;
      memcpy(buf + *got, tmp, take);
      *got += take;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && errno == EAGAIN; /* still open, nothing more now */
  }
}

/* Waits for the child until `deadline`; on expiry kills its group. */
static kb_status_t kb_collect(pid_t pid, int fd, double deadline, kb_wire_t *w, int *status,
                              struct rusage *ru) {
  size_t got = 0;
  bool open = true;
  for (;;) {
    double left = deadline - kb_now();
    if (left <= 0) {
      kill(-pid, SIGKILL);
      kill(pid, SIGKILL);
      while (wait4(pid, status, 0, ru) < 0 && errno == EINTR) {}
      return KB_TIMEOUT;
    }
    if (open) {
      struct pollfd pfd = {.fd = fd, .events = POLLIN};
      int ms = left > 0.05 ? 50 : (int)(left * 1000) + 1;
      if (poll(&pfd, 1, ms) > 0) open = kb_drain(fd, (char *)w, sizeof(*w), &got);
    } else {
      usleep(1000); /* the pipe closed; the exit follows within microseconds */
    }
    pid_t r = wait4(pid, status, WNOHANG, ru);
    if (r == pid) {
      kb_drain(fd, (char *)w, sizeof(*w), &got);
      return got == sizeof(*w) && w->magic == KB_WIRE_MAGIC ? KB_OK : KB_FAIL;
    }
  }
}

/* Runs one child; fills `out` on KB_OK, `why` otherwise. */
static kb_status_t kb_spawn(char **argv, char **env, double timeout_s, kb_sample_t *out, char *why,
                            size_t wlen) {
  int pfd[2];
  if (pipe2(pfd, O_CLOEXEC) != 0) {
    snprintf(why, wlen, "pipe: %s", strerror(errno));
    return KB_FAIL;
  }
  char fdarg[16];
  snprintf(fdarg, sizeof(fdarg), "%d", pfd[1]);
  argv[2] = fdarg;
  const char *exe = kb_exe_path(); /* resolved here: the child may only exec */
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    snprintf(why, wlen, "fork: %s", strerror(errno));
    close(pfd[0]);
    close(pfd[1]);
    return KB_FAIL;
  }
  if (pid == 0) {
    /* Only async-signal-safe calls between fork and exec. The child's stdout
     * goes to stderr so that only the parent writes JSON to stdout. */
    setpgid(0, 0);
    fcntl(pfd[1], F_SETFD, 0);
    dup2(STDERR_FILENO, STDOUT_FILENO);
    execve(exe, argv, env);
    _exit(127);
  }
  setpgid(pid, pid); /* also here: whichever runs first, the group exists */
  kb_current_child = pid;
  close(pfd[1]);
  fcntl(pfd[0], F_SETFL, O_NONBLOCK);
  kb_wire_t w;
  int status = 0;
  struct rusage ru = {0};
  kb_status_t st = kb_collect(pid, pfd[0], kb_now() + timeout_s, &w, &status, &ru);
  kb_current_child = 0;
  close(pfd[0]);
  if (st == KB_TIMEOUT) {
    snprintf(why, wlen, "timed out after %.0f s; killed", timeout_s);
    return st;
  }
  if (WIFSIGNALED(status)) {
    snprintf(why, wlen, "killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    return KB_FAIL;
  }
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == KB_EXIT_SKIP) {
    snprintf(why, wlen, "cannot run here");
    return KB_SKIP;
  }
  if (code == KB_EXIT_NOLIB) {
    snprintf(why, wlen, "its library does not provide malloc");
    return KB_NOIMPL;
  }
  if (code != 0 || st != KB_OK) {
    snprintf(why, wlen, code == 127 ? "exec failed" : "exited with status %d and no result", code);
    return KB_FAIL;
  }
  out->r = w.r;
  out->user_s = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6;
  out->sys_s = (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
  out->peak_rss_kb = (double)ru.ru_maxrss; /* KiB on Linux */
  return KB_OK;
}

/* ---------------------------------------------------------------------------
 * Medians and reports
 * ------------------------------------------------------------------------- */

/* The medians of one (case, threads, impl) over its finished repetitions. */
typedef struct kb_cell {
  int n;             /* repetitions that finished; 0 = nothing to report */
  kb_status_t worst; /* KB_SKIP / KB_FAIL / KB_TIMEOUT explain n == 0 */
  double ops_per_s, ns_per_op, user_s, sys_s, peak_rss_kb;
  kb_result_t extra; /* only n_extra and extra[] are used */
} kb_cell_t;

static int kb_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double kb_median(double *v, int n) {
  if (n == 0) return 0;
  qsort(v, (size_t)n, sizeof(*v), kb_cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double kb_finite(double x) {
  return isfinite(x) ? x : 0;
}

static double kb_sample_field(const kb_sample_t *s, int field) {
  switch (field) {
    case 0:
      return s->r.seconds > 0 ? s->r.ops / s->r.seconds : 0;
    case 1:
      return s->r.ops > 0 ? s->r.seconds * 1e9 / s->r.ops : 0;
    case 2:
      return s->user_s;
    case 3:
      return s->sys_s;
    default:
      return s->peak_rss_kb;
  }
}

static void kb_cell_fill(kb_cell_t *c, const kb_sample_t *s, int n) {
  double v[KB_MAX_REPS];
  double *fields[] = {&c->ops_per_s, &c->ns_per_op, &c->user_s, &c->sys_s, &c->peak_rss_kb};
  c->n = n;
  for (int f = 0; f < 5; f++) {
    for (int i = 0; i < n; i++) v[i] = kb_sample_field(&s[i], f);
    *fields[f] = kb_finite(kb_median(v, n));
  }
  c->extra.n_extra = 0;
  for (int e = 0; n > 0 && e < s[0].r.n_extra; e++) {
    const char *key = s[0].r.extra[e].key;
    int k = 0;
    for (int i = 0; i < n; i++)
      for (int j = 0; j < s[i].r.n_extra; j++)
        if (strcmp(s[i].r.extra[j].key, key) == 0) v[k++] = s[i].r.extra[j].value;
    kb_extra(&c->extra, key, kb_finite(kb_median(v, k)));
  }
}

static double kb_cell_metric(const kb_cell_t *c, const char *metric) {
  if (strcmp(metric, "ops_per_s") == 0) return c->ops_per_s;
  if (strcmp(metric, "ns_per_op") == 0) return c->ns_per_op;
  if (strcmp(metric, "user_s") == 0) return c->user_s;
  if (strcmp(metric, "sys_s") == 0) return c->sys_s;
  if (strcmp(metric, "peak_rss_kb") == 0) return c->peak_rss_kb;
  for (int i = 0; i < c->extra.n_extra; i++)
    if (strcmp(c->extra.extra[i].key, metric) == 0) return c->extra.extra[i].value;
  return NAN;
}

static void kb_json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') fputc('\\', f);
    if ((unsigned char)*s < 0x20)
      fprintf(f, "\\u%04x", *s);
    else
      fputc(*s, f);
  }
  fputc('"', f);
}

static void kb_json_line(FILE *f, const char *suite, const char *cname, const char *impl,
                         int threads, const kb_cell_t *c) {
  fprintf(f, "{\"suite\":");
  kb_json_string(f, suite);
  fprintf(f, ",\"case\":");
  kb_json_string(f, cname);
  fprintf(f, ",\"impl\":");
  kb_json_string(f, impl);
  fprintf(f,
          ",\"threads\":%d,\"ops_per_s\":%.6g,\"ns_per_op\":%.6g,\"user_s\":%.6g,\"sys_s\":%.6g,"
          "\"peak_rss_kb\":%.0f,\"extra\":{",
          threads, c->ops_per_s, c->ns_per_op, c->user_s, c->sys_s, c->peak_rss_kb);
  for (int i = 0; i < c->extra.n_extra; i++) {
    if (i) fputc(',', f);
    kb_json_string(f, c->extra.extra[i].key);
    fprintf(f, ":%.6g", c->extra.extra[i].value);
  }
  fprintf(f, "}}\n");
  fflush(f);
}

/* A value in the unit its metric name implies: *_kb in MiB, *_s in seconds,
 * *ns_per_op in ns, rates with an SI suffix. */
static void kb_format(char *buf, size_t len, const char *metric, double v) {
  size_t m = strlen(metric);
  if (!isfinite(v)) {
    snprintf(buf, len, "-");
  } else if (m >= 9 && strcmp(metric + m - 9, "ns_per_op") == 0) {
    snprintf(buf, len, "%.*f ns", v < 100 ? 2 : 0, v);
  } else if (m > 3 && strcmp(metric + m - 3, "_kb") == 0) {
    snprintf(buf, len, "%.1f MiB", v / 1024);
  } else if (m > 2 && strcmp(metric + m - 2, "_s") == 0 && strcmp(metric, "ops_per_s") != 0) {
    snprintf(buf, len, "%.3f s", v);
  } else if (strcmp(metric, "ops_per_s") == 0 || v >= 1e4) {
    const char *sfx = v >= 1e9 ? "G" : v >= 1e6 ? "M" : v >= 1e3 ? "k" : "";
    double d = v >= 1e9 ? 1e9 : v >= 1e6 ? 1e6 : v >= 1e3 ? 1e3 : 1;
    snprintf(buf, len, "%.3g%s", v / d, sfx);
  } else {
    snprintf(buf, len, "%.4g", v);
  }
}

static const char *kb_status_word(kb_status_t s) {
  switch (s) {
    case KB_SKIP:
    case KB_NOIMPL:
      return "skipped";
    case KB_TIMEOUT:
      return "timeout";
    case KB_FAIL:
      return "failed";
    default:
      return "-";
  }
}

#define KB_CELL_LEN 40

/* The reference column: impls[0] (keel), or when it has no value at all
 * (skipped, crashed) the first impl that has one. */
static int kb_ref_column(const kb_cell_t *cells, int n_impl, int n_threads) {
  for (int j = 0; j < n_impl; j++)
    for (int t = 0; t < n_threads; t++)
      if (cells[t * n_impl + j].n) return j;
  return 0;
}

/* The best value among the columns other than rc in one row, in `best`;
 * returns its column or -1. */
static int kb_best_peer(const kb_cell_t *row, int n_impl, int rc, const char *metric, bool lower,
                        double *best) {
  int bj = -1;
  for (int j = 0; j < n_impl; j++) {
    double x = row[j].n ? kb_cell_metric(&row[j], metric) : NAN;
    if (j == rc || !isfinite(x)) continue;
    if (bj < 0 || (lower ? x < *best : x > *best)) bj = j, *best = x;
  }
  return bj;
}

/* One row's cells: each value but the reference column's followed by its
 * ratio against the reference, then (when there are 2 or more peers) the
 * best peer and its ratio, which is what keel's targets are stated
 * against. */
static void kb_table_row(char (*txt)[KB_CELL_LEN], const kb_impl_t *impls, int n_impl,
                         const kb_cell_t *row, int rc, const char *metric, bool lower,
                         int threads) {
  snprintf(txt[0], KB_CELL_LEN, "%d", threads);
  double ref = row[rc].n ? kb_cell_metric(&row[rc], metric) : NAN;
  for (int j = 0; j < n_impl; j++) {
    char v[KB_CELL_LEN / 2];
    if (row[j].n == 0) {
      snprintf(txt[j + 1], KB_CELL_LEN, "%s", kb_status_word(row[j].worst));
      continue;
    }
    double x = kb_cell_metric(&row[j], metric);
    kb_format(v, sizeof(v), metric, x);
    if (j == rc || !(ref > 0) || !isfinite(x))
      snprintf(txt[j + 1], KB_CELL_LEN, "%s", v);
    else
      snprintf(txt[j + 1], KB_CELL_LEN, "%s (%.2fx)", v, x / ref);
  }
  double best = NAN;
  int bj = kb_best_peer(row, n_impl, rc, metric, lower, &best);
  if (bj >= 0 && ref > 0)
    snprintf(txt[n_impl + 1], KB_CELL_LEN, "%s %.2fx", impls[bj].name, best / ref);
  else
    snprintf(txt[n_impl + 1], KB_CELL_LEN, "-");
}

/* Prints one table: rows = thread counts, columns = impls (plus the best
 * peer when there are two or more peers). */
static void kb_table(const char *title, const char *metric, bool lower, const kb_impl_t *impls,
                     int n_impl, const int *threads, int n_threads, kb_cell_t *cells) {
  int cols = n_impl + 2, shown = n_impl >= 3 ? cols : cols - 1;
  char(*txt)[KB_CELL_LEN] = calloc((size_t)(n_threads + 1) * (size_t)cols, KB_CELL_LEN);
  int *width = calloc((size_t)cols, sizeof(int));
  if (txt == NULL || width == NULL) abort();
  int rc = kb_ref_column(cells, n_impl, n_threads);
  snprintf(txt[0], KB_CELL_LEN, "threads");
  for (int j = 0; j < n_impl; j++) snprintf(txt[j + 1], KB_CELL_LEN, "%s", impls[j].name);
  snprintf(txt[n_impl + 1], KB_CELL_LEN, "best peer");
  for (int t = 0; t < n_threads; t++)
    kb_table_row(&txt[(t + 1) * cols], impls, n_impl, &cells[t * n_impl], rc, metric, lower,
                 threads[t]);
  for (int r = 0; r <= n_threads; r++)
    for (int j = 0; j < cols; j++) {
      int w = (int)strlen(txt[r * cols + j]);
      if (w > width[j]) width[j] = w;
    }
  printf("%s (%s, %s is better; (x) = value / %s's)\n", title, metric, lower ? "lower" : "higher",
         impls[rc].name);
  for (int r = 0; r <= n_threads; r++) {
    for (int j = 0; j < shown; j++) printf("  %*s", width[j], txt[r * cols + j]);
    printf("\n");
  }
  free(width);
  free(txt);
}

/* The extras of each cell, one line per (threads, impl). */
static void kb_extras_print(const kb_impl_t *impls, int n_impl, const int *threads, int n_threads,
                            const kb_cell_t *cells) {
  bool header = false;
  for (int t = 0; t < n_threads; t++)
    for (int j = 0; j < n_impl; j++) {
      const kb_cell_t *c = &cells[t * n_impl + j];
      if (c->n == 0 || c->extra.n_extra == 0) continue;
      if (!header) printf("  extras (medians):\n");
      header = true;
      printf("    %-9s t=%-4d", impls[j].name, threads[t]);
      for (int e = 0; e < c->extra.n_extra; e++) {
        char v[KB_CELL_LEN];
        kb_format(v, sizeof(v), c->extra.extra[e].key, c->extra.extra[e].value);
        printf(" %s=%s", c->extra.extra[e].key, v);
      }
      printf("\n");
    }
}

/* ---------------------------------------------------------------------------
 * Running a suite
 * ------------------------------------------------------------------------- */

/* Impls whose library turned out not to provide malloc (e.g. a
 * libkeel-malloc.so built before the heap exists): skipped from then on. */
static char kb_broken[KB_MAX_IMPLS][32];
static int kb_n_broken;

static bool kb_is_broken(const char *name) {
  for (int i = 0; i < kb_n_broken; i++)
    if (strcmp(kb_broken[i], name) == 0) return true;
  return false;
}

/* An impl of the case being run, with its library resolved once. */
typedef struct kb_impl_state {
  const kb_impl_t *impl;
  bool available;
  char **env;
} kb_impl_state_t;

static bool kb_in_list(const char *list, const char *name) {
  if (list == NULL) return true;
  size_t n = strlen(name);
  for (const char *p = list; *p;) {
    size_t len = strcspn(p, ",");
    if (len == n && strncmp(p, name, n) == 0) return true;
    p += len + (p[len] == ',');
  }
  return false;
}

static int kb_parse_threads(const char *list, int *out, int max) {
  int n = 0;
  for (const char *p = list; *p;) {
    char *end;
    errno = 0;
    long v = strtol(p, &end, 10);
    if (errno || end == p || v < 1 || v > KB_MAX_THREADS || (*end && *end != ',') || n == max)
      return -1;
    out[n++] = (int)v;
    p = *end ? end + 1 : end;
  }
  return n;
}

/* Notes about missing libraries are printed once per process. */
static bool kb_note_once(const char *name) {
  static char seen[KB_MAX_IMPLS * 4][32];
  static int n;
  for (int i = 0; i < n; i++)
    if (strcmp(seen[i], name) == 0) return false;
  if (n < KB_MAX_IMPLS * 4) snprintf(seen[n++], sizeof(seen[0]), "%s", name);
  return true;
}

static int kb_impls_prepare(const kb_case_t *c, const kb_opts_t *o, kb_impl_state_t *st) {
  int n = 0;
  for (const kb_impl_t *m = c->impls; m->name && n < KB_MAX_IMPLS; m++) {
    if (!kb_in_list(o->impls, m->name)) continue;
    kb_impl_state_t *s = &st[n++];
    char path[PATH_MAX], why[PATH_MAX + 64];
    s->impl = m;
    s->available = true;
    s->env = NULL;
    if (kb_is_broken(m->name)) {
      s->available = false;
    } else if (m->preload == NULL) {
      s->env = kb_child_env(NULL);
    } else if (kb_preload_resolve(m->preload, path, sizeof(path), why, sizeof(why))) {
      s->env = kb_child_env(path);
    } else {
      s->available = false;
      if (kb_note_once(m->name))
        fprintf(stderr, "note: %s not found (%s); skipped\n", m->name, why);
    }
  }
  return n;
}

static void kb_progress(const kb_opts_t *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void kb_progress(const kb_opts_t *o, const char *fmt, ...) {
  static int tty = -1;
  (void)o;
  if (tty < 0) tty = isatty(STDERR_FILENO);
  if (!tty) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "\r\033[K");
  vfprintf(stderr, fmt, ap);
  va_end(ap);
}

/* One case being measured: its impls and, per impl, the repetitions of the
 * thread count in progress. */
typedef struct kb_case_ctx {
  const kb_suite_t *s;
  const kb_case_t *c;
  const kb_opts_t *o;
  int n_impl;
  kb_impl_state_t st[KB_MAX_IMPLS];
  kb_sample_t *samples;            /* [impl][rep] */
  int got[KB_MAX_IMPLS];           /* finished repetitions per impl */
  bool stop[KB_MAX_IMPLS];         /* no more repetitions at this thread count */
  kb_status_t worst[KB_MAX_IMPLS]; /* why an impl has fewer repetitions */
  bool ok;                         /* nothing crashed or timed out */
  int reps;                        /* repetitions for this case (kb_case_reps) */
} kb_case_ctx_t;

/* Runs impl j once at `threads`; records the sample or notes why not. */
static void kb_run_once(kb_case_ctx_t *x, int j, int threads, int rep) {
  kb_impl_state_t *m = &x->st[j];
  const kb_opts_t *o = x->o;
  char targ[16], why[256];
  snprintf(targ, sizeof(targ), "%d", threads);
  char *argv[] = {(char *)"keel-bench",
                  (char *)"--child",
                  NULL,
                  (char *)x->s->name,
                  (char *)x->c->name,
                  (char *)m->impl->name,
                  targ,
                  (char *)o->size,
                  NULL};
  kb_progress(o, "  %s/%s threads=%d rep %d/%d %s", x->s->name, x->c->name, threads, rep + 1,
              x->reps, m->impl->name);
  kb_status_t r =
      kb_spawn(argv, m->env, o->timeout_s, &x->samples[j * x->reps + x->got[j]], why, sizeof(why));
  kb_progress(o, "%s", "");
  if (r == KB_OK) {
    x->got[j]++;
  } else if (r == KB_NOIMPL) {
    fprintf(stderr, "note: %s: %s; skipped\n", m->impl->name, why);
    if (kb_n_broken < KB_MAX_IMPLS)
      snprintf(kb_broken[kb_n_broken++], sizeof(kb_broken[0]), "%s", m->impl->name);
    m->available = false;
    x->worst[j] = KB_SKIP;
  } else {
    if (r > x->worst[j]) x->worst[j] = r;
    /* A skip or a timeout would repeat: the remaining reps are left out. */
    x->stop[j] = r == KB_SKIP || r == KB_TIMEOUT;
    x->ok = x->ok && r == KB_SKIP;
    fprintf(stderr, "note: %s/%s %s threads=%d rep %d: %s%s\n", x->s->name, x->c->name,
            m->impl->name, threads, rep + 1, why,
            x->stop[j] && rep + 1 < x->reps ? " (remaining repetitions skipped)" : "");
  }
}

/* All repetitions at one thread count, impls interleaved within each; fills
 * one row of cells and writes its JSON lines. */
static void kb_measure(kb_case_ctx_t *x, int threads, kb_cell_t *row) {
  const kb_opts_t *o = x->o;
  for (int j = 0; j < x->n_impl; j++) {
    x->got[j] = 0;
    x->stop[j] = false;
    x->worst[j] = x->st[j].available ? KB_OK : KB_SKIP;
  }
  for (int rep = 0; rep < x->reps; rep++)
    for (int j = 0; j < x->n_impl; j++)
      if (x->st[j].available && !x->stop[j]) kb_run_once(x, j, threads, rep);
  for (int j = 0; j < x->n_impl; j++) {
    kb_cell_fill(&row[j], &x->samples[j * x->reps], x->got[j]);
    row[j].worst = x->worst[j];
    if (x->got[j] == 0) continue;
    const char *impl = x->st[j].impl->name;
    if (o->json) kb_json_line(stdout, x->s->name, x->c->name, impl, threads, &row[j]);
    if (o->out_fp) kb_json_line(o->out_fp, x->s->name, x->c->name, impl, threads, &row[j]);
  }
}

static void kb_report(const kb_case_ctx_t *x, const int *threads, int n_threads, kb_cell_t *cells) {
  const kb_case_t *c = x->c;
  kb_impl_t shown[KB_MAX_IMPLS];
  for (int j = 0; j < x->n_impl; j++) shown[j] = *x->st[j].impl;
  char title[256];
  snprintf(title, sizeof(title), "\n%s/%s: %s\n ", x->s->name, c->name, c->help);
  kb_table(title, kb_metric_name(c), kb_lower_is_better(c), shown, x->n_impl, threads, n_threads,
           cells);
  if (strcmp(kb_metric_name(c), "peak_rss_kb") != 0)
    kb_table("  peak RSS of the child", "peak_rss_kb", true, shown, x->n_impl, threads, n_threads,
             cells);
  /* A threaded case's extras would be a line per (threads, impl): JSON only. */
  if (!c->threaded) kb_extras_print(shown, x->n_impl, threads, n_threads, cells);
  fflush(stdout);
}

static void kb_impls_release(kb_case_ctx_t *x) {
  for (int j = 0; j < x->n_impl; j++) {
    char **e = x->st[j].env;
    for (size_t k = 0; e && e[k]; k++)
      if (strncmp(e[k], "LD_PRELOAD=", 11) == 0) free(e[k]);
    free(e);
  }
}

/* Runs one case at every thread count; returns true when nothing failed. */
static bool kb_case_run(const kb_suite_t *s, const kb_case_t *c, const kb_opts_t *o,
                        const int *threads, int n_threads) {
  kb_case_ctx_t x = {.s = s, .c = c, .o = o, .ok = true, .reps = o->reps};
  if (!o->reps_given && c->min_reps > x.reps)
    x.reps = c->min_reps < KB_MAX_REPS ? c->min_reps : KB_MAX_REPS;
  x.n_impl = kb_impls_prepare(c, o, x.st);
  if (x.n_impl == 0) return true;
  int one = 1, own[64];
  if (!c->threaded) {
    threads = &one, n_threads = 1;
  } else if (c->threads != NULL && o->threads == NULL) {
    n_threads = kb_parse_threads(c->threads, own, 64);
    if (n_threads <= 0) abort(); /* a suite's own constant */
    threads = own;
  }
  kb_cell_t *cells = calloc((size_t)n_threads * (size_t)x.n_impl, sizeof(*cells));
  x.samples = calloc((size_t)x.n_impl * (size_t)x.reps, sizeof(*x.samples));
  if (cells == NULL || x.samples == NULL) abort();
  for (int t = 0; t < n_threads; t++) kb_measure(&x, threads[t], &cells[t * x.n_impl]);
  if (!o->json) kb_report(&x, threads, n_threads, cells);
  kb_impls_release(&x);
  free(x.samples);
  free(cells);
  return x.ok;
}

int kb_suite_run(const kb_suite_t *s, const kb_opts_t *o) {
  int threads[64];
  const char *list = o->threads ? o->threads : s->default_threads;
  int n_threads = kb_parse_threads(list ? list : "1", threads, 64);
  if (n_threads <= 0) {
    fprintf(stderr, "keel-bench: bad --threads '%s' (expected e.g. 1,2,8,64,256; at most %d)\n",
            list, KB_MAX_THREADS);
    return 2;
  }
  if (o->reps < 1 || o->reps > KB_MAX_REPS) {
    fprintf(stderr, "keel-bench: --reps must be 1..%d\n", KB_MAX_REPS);
    return 2;
  }
  if (o->cases && !o->all_suites)
    for (const char *p = o->cases; *p;) {
      size_t len = strcspn(p, ",");
      char name[64];
      snprintf(name, sizeof(name), "%.*s", (int)len, p);
      if (kb_case_find(s, name) == NULL) {
        fprintf(stderr, "keel-bench: suite %s has no case '%s' (see --list)\n", s->name, name);
        return 2;
      }
      p += len + (p[len] == ',');
    }
  kb_install_signals();
  bool ok = true;
  for (const kb_case_t *c = s->cases; c->name; c++)
    if (kb_in_list(o->cases, c->name)) ok = kb_case_run(s, c, o, threads, n_threads) && ok;
  return ok ? 0 : 1;
}
