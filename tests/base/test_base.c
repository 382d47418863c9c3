/* Tests of src/base: options parsing, OS memory, keel_die, thread hooks. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <keel/heap.h>
#include <keel/keel.h>
#include <keel/lock.h>
#include <keel/pheap.h>
#include <keel/pool.h>
#include <keel/sched.h>
#include <keel/table.h>

#include "base/die.h"
#include "base/options.h"
#include "base/os.h"
#include "base/tls.h"
#include "harness.h"

static int64_t opt(const char *name) {
  int64_t v = -12345;
  KT_EQ(keel_option_get(name, &v), 0);
  return v;
}

/* Parses spec with stderr captured; returns rejected count, message in msg. */
static int parse_captured(const char *spec, char *msg, size_t len) {
  kt_stderr_begin();
  int rejected = _keel_options_parse(spec, "KEEL_OPTIONS");
  kt_stderr_end(msg, len);
  return rejected;
}

static void options_defaults(void) {
  _keel_options_reset();
  KT_EQ(opt("pool_sweep_s"), 10000); /* durations read back in milliseconds */
  KT_EQ(opt("stats"), 0);
  KT_EQ(opt("heap_purge_ms"), 1000);
  int64_t v;
  KT_EQ(keel_option_get("no_such_option", &v), KEEL_ENOENT);
  KT_EQ(keel_option_get(NULL, &v), KEEL_EINVAL);
}

static void options_good_values(void) {
  char msg[1024];
  _keel_options_reset();
  KT_EQ(parse_captured("stats=1,pool_sweep_s=2.5,heap_purge_ms=0,sched_max_threads=64", msg,
                       sizeof(msg)),
        0);
  KT_STREQ(msg, "");
  KT_EQ(opt("stats"), 1);
  KT_EQ(opt("pool_sweep_s"), 2500);
  KT_EQ(opt("heap_purge_ms"), 0);
  KT_EQ(opt("sched_max_threads"), 64);
  /* Bare booleans, suffixes, spaces, case-insensitive words, empty pairs. */
  KT_EQ(parse_captured(" verbose , ,stats=off,pool_sweep_s=250ms,,pheap_flush=MSYNC", msg,
                       sizeof(msg)),
        0);
  KT_STREQ(msg, "");
  KT_EQ(opt("verbose"), 1);
  KT_EQ(opt("stats"), 0);
  KT_EQ(opt("pool_sweep_s"), 250);
  KT_EQ(opt("pheap_flush"), KEEL_FLUSH_MSYNC);
  _keel_options_reset();
}

static void options_unknown_name(void) {
  char msg[1024];
  _keel_options_reset();
  KT_EQ(parse_captured("xyz=3,stats=1", msg, sizeof(msg)), 1);
  KT_STREQ(msg, "keel: KEEL_OPTIONS: unknown option 'xyz'\n");
  KT_EQ(opt("stats"), 1); /* the good pair still applies */
  _keel_options_reset();
}

static void options_bad_values(void) {
  char msg[1024];
  _keel_options_reset();
  KT_EQ(parse_captured("pool_sweep_s=abc", msg, sizeof(msg)), 1);
  KT_STREQ(msg, "keel: KEEL_OPTIONS: bad value 'abc' for 'pool_sweep_s' (expected seconds)\n");
  KT_EQ(opt("pool_sweep_s"), 10000); /* default kept */
  KT_EQ(parse_captured("stats=maybe", msg, sizeof(msg)), 1);
  KT_CONTAINS(msg, "bad value 'maybe' for 'stats'");
  KT_EQ(parse_captured("sched_max_threads=99999", msg, sizeof(msg)), 1);
  KT_CONTAINS(msg, "expected an integer from 0 to 4096");
  KT_EQ(parse_captured("sched_min_threads=", msg, sizeof(msg)), 1);
  KT_EQ(parse_captured("pool_sweep_s=-1", msg, sizeof(msg)), 1);
  KT_EQ(parse_captured("pool_sweep_s=1e400", msg, sizeof(msg)), 1);
  KT_EQ(parse_captured("pheap_flush=fast", msg, sizeof(msg)), 1);
  KT_CONTAINS(msg, "expected one of: auto, clwb, clflushopt, clflush, msync, none");
  KT_EQ(parse_captured("heap_purge_ms=12x", msg, sizeof(msg)), 1);
  KT_EQ(opt("heap_purge_ms"), 1000);
  KT_EQ(opt("sched_max_threads"), 0);
  _keel_options_reset();
}

static void options_empty_and_long(void) {
  char msg[4096];
  _keel_options_reset();
  KT_EQ(parse_captured("", msg, sizeof(msg)), 0);
  KT_EQ(parse_captured(",,,", msg, sizeof(msg)), 0);
  KT_STREQ(msg, "");
  /* A 100 KB spec: one unknown name (quoted cut to one line), one long value. */
  size_t n = 100000;
  char *spec = malloc(n + 64);
  KT_REQUIRE(spec != NULL);
  memset(spec, 'a', n);
  strcpy(spec + n, "=1,stats=1");
  KT_EQ(parse_captured(spec, msg, sizeof(msg)), 1);
  KT_CONTAINS(msg, "unknown option 'aaaa");
  KT_CONTAINS(msg, "...'");
  KT_CHECK(strlen(msg) < 200);
  KT_EQ(opt("stats"), 1);
  strcpy(spec, "heap_purge_ms=");
  memset(spec + 14, '9', n);
  spec[14 + n] = 0;
  KT_EQ(parse_captured(spec, msg, sizeof(msg)), 1);
  KT_CONTAINS(msg, "bad value '9999");
  KT_EQ(opt("heap_purge_ms"), 1000);
  free(spec);
  _keel_options_reset();
}

static void options_from_environment(void) {
  char msg[1024];
  setenv("KEEL_OPTIONS", "pool_sweep_s=0.05,bogus,stats", 1);
  keel_store_relaxed(&_keel_options_ready, 0); /* forget the first parse */
  kt_stderr_begin();
  int64_t sweep = opt("pool_sweep_s");
  int64_t stats = opt("stats");
  kt_stderr_end(msg, sizeof(msg));
  KT_EQ(sweep, 50);
  KT_EQ(stats, 1);
  KT_STREQ(msg, "keel: KEEL_OPTIONS: unknown option 'bogus'\n");
  unsetenv("KEEL_OPTIONS");
  _keel_options_reset();
  /* keel_options_set reports with its own name and returns KEEL_EINVAL. */
  kt_stderr_begin();
  int rc = keel_options_set("stats=2");
  kt_stderr_end(msg, sizeof(msg));
  KT_EQ(rc, KEEL_EINVAL);
  KT_CONTAINS(msg, "keel: keel_options_set: bad value '2' for 'stats'");
  KT_EQ(keel_options_set("stats=1"), 0);
  KT_EQ(opt("stats"), 1);
  _keel_options_reset();
}

static void options_print_table(void) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  keel_options_print(f);
  fclose(f);
  KT_CONTAINS(buf, "pool_sweep_s");
  KT_CONTAINS(buf, "seconds");
  KT_CONTAINS(buf, "period of the pool sweeper");
  KT_CONTAINS(buf, "auto|clwb|clflushopt|clflush|msync|none");
  free(buf);
}

static void os_reserve_commit_decommit(void) {
  size_t ps = _keel_os_page_size();
  KT_CHECK(KEEL_IS_POW2(ps));
  KT_CHECK(_keel_os_huge_page_size() >= ps);
  size_t size = 64u << 20, align = 4u << 20;
  char *p = _keel_os_reserve(size, align);
  KT_REQUIRE(p != NULL);
  KT_EQ((uintptr_t)p % align, 0);
  size_t rss0 = _keel_os_rss_kb();
  KT_EQ(_keel_os_commit(p, size), 0);
  memset(p, 0x5a, size);
  size_t rss1 = _keel_os_rss_kb();
  KT_CHECK(rss1 >= rss0 + 60 * 1024); /* 64 MiB touched */
  KT_EQ(_keel_os_purge(p, size / 2, false), 0);
  KT_EQ(p[0], 0); /* purged pages read back as zero */
  KT_EQ(p[size / 2], 0x5a);
  size_t rss2 = _keel_os_rss_kb();
  KT_CHECK(rss2 + 30 * 1024 <= rss1);
  KT_EQ(_keel_os_decommit(p, size), 0);
  size_t rss3 = _keel_os_rss_kb();
  KT_CHECK(rss3 + 30 * 1024 <= rss2);
  KT_EQ(_keel_os_commit(p, ps), 0); /* recommitting works after a decommit */
  p[0] = 1;
  KT_EQ(_keel_os_release(p, size), 0);
  KT_CHECK(_keel_os_alloc(SIZE_MAX - 4096, 4096) == NULL);
  KT_CHECK(_keel_os_reserve(4096, 3 << 20) == NULL); /* not a power of two */
}

/* The CPU count follows the calling thread's affinity mask: a server in a
 * cpuset or under taskset sizes its pools to the CPUs it may use. */
static void *ncpu_pinned(void *arg) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(*(int *)arg, &one);
  KT_EQ(pthread_setaffinity_np(pthread_self(), sizeof one, &one), 0);
  KT_EQ(_keel_os_ncpu(), 1);
  return NULL;
}

static void os_ncpu_follows_affinity(void) {
  /* No cgroup quota here, whatever host the test runs on (see below). */
  const char *of = _keel_os_cgroup_file;
  _keel_os_cgroup_file = "/nonexistent/keel-test-cgroup";
  cpu_set_t set;
  KT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  KT_EQ(_keel_os_ncpu(), CPU_COUNT(&set));
  int first = 0;
  while (!CPU_ISSET(first, &set)) first++;
  pthread_t t;
  KT_EQ(pthread_create(&t, NULL, ncpu_pinned, &first), 0);
  pthread_join(t, NULL);
  _keel_os_cgroup_file = of;
}

/* The CPU count follows the cgroup's CPU quota, v2 (every ancestor's
 * cpu.max binds) and v1 (cfs quota / period), rounded up; no quota, an
 * unreadable tree or garbage leave the affinity count. A fake tree under a
 * temporary directory stands in for /proc/self/cgroup and /sys/fs/cgroup. */
static void put_file(const char *dir, const char *rel, const char *text) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, rel);
  for (char *p = path + strlen(dir) + 1; (p = strchr(p, '/')) != NULL; p++) {
    *p = '\0';
    mkdir(path, 0700);
    *p = '/';
  }
  FILE *f = fopen(path, "w");
  KT_REQUIRE(f != NULL);
  fputs(text, f);
  fclose(f);
}

static int ncpu_with(const char *dir) {
  char file[512], root[512];
  snprintf(file, sizeof file, "%s/proc_cgroup", dir);
  snprintf(root, sizeof root, "%s/fs", dir);
  const char *of = _keel_os_cgroup_file, *orr = _keel_os_cgroup_root;
  _keel_os_cgroup_file = file;
  _keel_os_cgroup_root = root;
  int n = _keel_os_ncpu();
  _keel_os_cgroup_file = of;
  _keel_os_cgroup_root = orr;
  return n;
}

static void os_ncpu_follows_cgroup_quota(void) {
  cpu_set_t set;
  KT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  int aff = CPU_COUNT(&set);
  char dir[] = "/tmp/keel-cgroup-XXXXXX";
  KT_REQUIRE(mkdtemp(dir) != NULL);
  /* v2: the cgroup allows 1.5 CPUs, its parent 0.5: the parent binds. */
  put_file(dir, "proc_cgroup", "0::/a/b\n");
  put_file(dir, "fs/a/b/cpu.max", "150000 100000\n");
  put_file(dir, "fs/a/cpu.max", "50000 100000\n");
  KT_EQ(ncpu_with(dir), 1);
  /* The parent unlimited: 1.5 rounds up to 2 (or the affinity count). */
  put_file(dir, "fs/a/cpu.max", "max 100000\n");
  KT_EQ(ncpu_with(dir), aff < 2 ? aff : 2);
  /* Neither limited, or unreadable: the affinity count. */
  put_file(dir, "fs/a/b/cpu.max", "max 100000\n");
  KT_EQ(ncpu_with(dir), aff);
  put_file(dir, "fs/a/b/cpu.max", "garbage\n");
  KT_EQ(ncpu_with(dir), aff);
  put_file(dir, "proc_cgroup", "0::/no/such/group\n");
  KT_EQ(ncpu_with(dir), aff);
  /* v1 (a hybrid host lists both): the cpu controller's cfs pair, 1 CPU. */
  put_file(dir, "proc_cgroup", "4:memory:/m\n3:cpu,cpuacct:/x\n0::/\n");
  put_file(dir, "fs/cpu,cpuacct/x/cpu.cfs_quota_us", "100000\n");
  put_file(dir, "fs/cpu,cpuacct/x/cpu.cfs_period_us", "100000\n");
  KT_EQ(ncpu_with(dir), 1);
  put_file(dir, "fs/cpu,cpuacct/x/cpu.cfs_quota_us", "-1\n");
  KT_EQ(ncpu_with(dir), aff);
  /* A quota a hair over one CPU rounds up; a tiny one is still 1 CPU. */
  put_file(dir, "fs/cpu,cpuacct/x/cpu.cfs_quota_us", "100001\n");
  KT_EQ(ncpu_with(dir), aff < 2 ? aff : 2);
  put_file(dir, "fs/cpu,cpuacct/x/cpu.cfs_quota_us", "5\n");
  KT_EQ(ncpu_with(dir), 1);
  /* v1 ancestors bind too; a co-mount is found by its controller list. */
  put_file(dir, "fs/cpu,cpuacct/x/cpu.cfs_quota_us", "-1\n");
  put_file(dir, "fs/cpu,cpuacct/cpu.cfs_quota_us", "100000\n");
  put_file(dir, "fs/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  KT_EQ(ncpu_with(dir), 1);
  put_file(dir, "proc_cgroup", "3:cpuset,cpu,cpuacct:/y\n");
  put_file(dir, "fs/cpuset,cpu,cpuacct/y/cpu.cfs_quota_us", "50000\n");
  put_file(dir, "fs/cpuset,cpu,cpuacct/y/cpu.cfs_period_us", "100000\n");
  KT_EQ(ncpu_with(dir), 1);
  /* The v2 namespace root ("/"), and a path outside it ignored. */
  put_file(dir, "proc_cgroup", "0::/\n");
  put_file(dir, "fs/cpu.max", "50000 100000\n");
  KT_EQ(ncpu_with(dir), 1);
  put_file(dir, "proc_cgroup", "0::/../outside\n");
  KT_EQ(ncpu_with(dir), aff);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  KT_EQ(system(cmd), 0);
}

static void os_alloc_aligned(void) {
  for (size_t align = 4096; align <= (64u << 20); align <<= 1) {
    void *p = _keel_os_alloc(12345, align);
    KT_REQUIRE(p != NULL);
    KT_EQ((uintptr_t)p % align, 0);
    memset(p, 1, 12345);
    KT_EQ(_keel_os_release(p, 12345), 0);
  }
}

static void die_free(void *arg) {
  keel_die("free", "invalid pointer %p", arg);
}

static void die_at_pool(void *arg) {
  keel_die_at("keel_pool_destroy", "use after destroy of pool 'dict'", arg);
}

static void die_format(void) {
  char out[512];
  kt_expect_abort(__FILE__, __LINE__, die_free, (void *)0x1234,
                  "keel: free: invalid pointer 0x1234\n", out, sizeof(out));
  KT_STREQ(out, "keel: free: invalid pointer 0x1234\n");
  kt_expect_abort(__FILE__, __LINE__, die_at_pool, (void *)0xdead0, "", out, sizeof(out));
  KT_STREQ(out, "keel: keel_pool_destroy: use after destroy of pool 'dict' at 0xdead0\n");
}

/* verbose=1: a call refused with an error code says so on stderr, naming
 * the call and the value; verbose=0: nothing. The codes are the same. */
static void rejections_named_when_verbose(void) {
  char msg[4096];
  for (int v = 0; v <= 1; v++) {
    _keel_options_reset();
    KT_EQ(keel_options_set(v ? "verbose=1" : "verbose=0"), 0);
    kt_stderr_begin();
    errno = 0;
    KT_CHECK(keel_pool_create("dict", 0, 0, NULL) == NULL && errno == EINVAL);
    KT_EQ(keel_sched_submit(NULL), KEEL_EINVAL);
    errno = 0;
    KT_CHECK(keel_aligned_alloc(24, 64) == NULL && errno == EINVAL);
    KT_CHECK(keel_table_create(NULL) == NULL);
    KT_EQ(keel_unlock(NULL, 0), KEEL_EINVAL);
    KT_CHECK(keel_pheap_root(NULL, 0) == NULL);
    kt_stderr_end(msg, sizeof msg);
    if (v == 0) {
      KT_STREQ(msg, "");
      continue;
    }
    KT_CONTAINS(msg, "keel: keel_pool_create: 'dict': obj_size 0 (1 to ");
    KT_CONTAINS(msg, "keel: keel_sched_submit: job is NULL\n");
    KT_CONTAINS(msg, "keel: keel_aligned_alloc: alignment 24 is not a power of two\n");
    KT_CONTAINS(msg, "keel: keel_table_create: config is NULL\n");
    KT_CONTAINS(msg, "keel: keel_unlock: lksb (nil), flags 0x0\n");
    KT_CONTAINS(msg, "keel: keel_pheap_root: pool (nil), size 0\n");
  }
  _keel_options_reset();
}

static void errors_have_messages(void) {
  KT_STREQ(keel_strerror(0), "success");
  KT_STREQ(keel_strerror(KEEL_EBUSY), "busy (in use)");
  KT_STREQ(keel_strerror(KEEL_ECORRUPT), "corrupt structure");
  KT_CHECK(keel_strerror(-9999) != NULL);
  KT_STREQ(keel_version(), KEEL_VERSION_STRING);
  KT_CHECK(KEEL_EINVAL < 0 && KEEL_ESHUTDOWN < 0 && KEEL_EDEADLK < 0);
}

static _Atomic int hook_runs;
static void hook_fn(void *arg) {
  atomic_fetch_add(&hook_runs, *(int *)arg);
}

static void *hook_thread(void *arg) {
  (void)arg;
  static int one = 1, hundred = 100;
  keel_thread_hook_t a = {hook_fn, &one, NULL}, b = {hook_fn, &hundred, NULL},
                     c = {hook_fn, &one, NULL};
  /* Hooks live on this thread's stack: they run before it is unwound. Heap
   * hooks would be the usual case; the stack shows arming never allocates. */
  static __thread keel_thread_hook_t ta, tb, tc;
  ta = a, tb = b, tc = c;
  KT_EQ(_keel_thread_hook_arm(&ta), 0);
  KT_EQ(_keel_thread_hook_arm(&tb), 0);
  KT_EQ(_keel_thread_hook_arm(&tb), 0); /* re-arming is a no-op */
  KT_EQ(_keel_thread_hook_arm(&tc), 0);
  _keel_thread_hook_disarm(&tc);
  _keel_thread_hook_disarm(&tc); /* disarming twice is safe */
  return NULL;
}

static void thread_hooks_run_at_exit(void) {
  atomic_store(&hook_runs, 0);
  enum { N = 16 };
  pthread_t t[N];
  for (int i = 0; i < N; i++) KT_REQUIRE(pthread_create(&t[i], NULL, hook_thread, NULL) == 0);
  for (int i = 0; i < N; i++) pthread_join(t[i], NULL);
  KT_EQ(atomic_load(&hook_runs), N * 101); /* a and b ran, c did not */
}

KT_MAIN(KT_CASE(options_defaults), KT_CASE(options_good_values), KT_CASE(options_unknown_name),
        KT_CASE(options_bad_values), KT_CASE(options_empty_and_long),
        KT_CASE(options_from_environment), KT_CASE(options_print_table),
        KT_CASE(os_reserve_commit_decommit), KT_CASE(os_alloc_aligned),
        KT_CASE(os_ncpu_follows_affinity), KT_CASE(os_ncpu_follows_cgroup_quota),
        KT_CASE(die_format), KT_CASE(errors_have_messages), KT_CASE(rejections_named_when_verbose),
        KT_CASE(thread_hooks_run_at_exit))
