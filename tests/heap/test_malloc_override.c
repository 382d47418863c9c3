/* The drop-in malloc (issue 4, parts 3 and 4): this program links
 * libkeel-malloc.so and nothing else of keel, so every malloc-family call
 * below (and the harness's own stdio buffers) goes through keel's override.
 *
 * Checks that each glibc allocation entry point resolves into
 * libkeel-malloc.so and is seen by keel_heap_stats; glibc's edge semantics
 * (size 0, realloc to 0, EINVAL/ENOMEM cases); that the glibc-only calls
 * (mallinfo2, malloc_trim, malloc_stats, mallopt) answer for keel instead of
 * falling through to glibc's unused arena; the abort messages for bad frees
 * through plain free(); KEEL_OPTIONS=stats=1 printing the class table at exit
 * (linked, and preloaded into a Debian program); and that libkeel.so, unlike
 * the preloaded library, can be dlopen'ed (no static TLS).
 *
 * Built only in the plain build: sanitizers own malloc themselves.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <keel/heap.h>

#include "harness.h"
#include "heap_test_util.h"

#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)

/* glibc 2.36 declares neither; keel's override defines both (C23 names). */
void free_sized(void *p, size_t size);
void free_aligned_sized(void *p, size_t align, size_t size);

static bool aligned(const void *p, size_t a) {
  return ((uintptr_t)p & (a - 1)) == 0;
}

/* Live blocks in the class serving `size` (or large blocks). */
static size_t live_for(size_t size) {
  static keel_heap_stats_t st;
  keel_heap_stats(&st);
  int c = keel_heap_class_of(size);
  return c >= 0 ? st.classes[c].live : st.large_live;
}

static size_t class_size(size_t size) {
  static keel_heap_class_info_t info[KEEL_HEAP_MAX_CLASSES];
  size_t n = keel_heap_classes(info, KEEL_HEAP_MAX_CLASSES);
  int c = keel_heap_class_of(size);
  return c >= 0 && (size_t)c < n ? info[c].size : 0;
}

/* ---- every entry point is keel's ------------------------------------ */

static void symbols_resolve_to_keel(void) {
  static const char *names[] = {
      "malloc",
      "free",
      "calloc",
      "realloc",
      "reallocarray",
      "posix_memalign",
      "aligned_alloc",
      "memalign",
      "valloc",
      "pvalloc",
      "malloc_usable_size",
      "free_sized",
      "free_aligned_sized",
      "malloc_trim",
      "mallinfo2",
      "malloc_stats",
      "mallopt",
      "malloc_info",
      /* glibc's internal names, which some programs and libraries call */
      "__libc_malloc",
      "__libc_free",
      "__libc_calloc",
      "__libc_realloc",
      "__libc_memalign",
      "__libc_valloc",
      "__libc_pvalloc",
  };
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    void *sym = dlsym(RTLD_DEFAULT, names[i]);
    Dl_info info;
    if (sym == NULL || dladdr(sym, &info) == 0 || info.dli_fname == NULL) {
      kt_fail(__FILE__, __LINE__, "%s: not found", names[i]);
      continue;
    }
    if (strstr(info.dli_fname, "libkeel-malloc") == NULL)
      kt_fail(__FILE__, __LINE__, "%s resolves to %s, not libkeel-malloc.so", names[i],
              info.dli_fname);
  }
}

/* Live blocks of every class plus large ones. */
static size_t live_total(void) {
  static keel_heap_stats_t st;
  keel_heap_stats(&st);
  size_t n = st.large_live;
  for (size_t i = 0; i < st.n_classes; i++) n += st.classes[i].live;
  return n;
}

static void *alloc_with(int how, size_t size) {
  void *p = NULL;
  switch (how) {
    case 0:
      return malloc(size);
    case 1:
      return calloc(1, size);
    case 2:
      return realloc(NULL, size);
    case 3:
      return reallocarray(NULL, size / 4, 4);
    case 4:
      return posix_memalign(&p, 64, size) == 0 ? p : NULL;
    case 5:
      return aligned_alloc(128, size);
    case 6:
      return memalign(256, size);
    case 7:
      return valloc(size);
    default:
      return pvalloc(size);
  }
}

/* The first free that leaves memory for a delayed purge starts keel's purge
 * thread, and pthread_create allocates that thread's bookkeeping through
 * malloc, which is keel here: one block that stays live. Start it before a
 * case counts live blocks. */
static void start_purge_thread(void) {
  void *p[64];
  for (int i = 0; i < 64; i++) p[i] = malloc(4200); /* five 64 KiB pages */
  for (int i = 0; i < 64; i++) free(p[i]);
  free(malloc(8 * MiB));
}

static void stats_see_every_allocator(void) {
  start_purge_thread();
  static const char *names[] = {"malloc",       "calloc",         "realloc",
                                "reallocarray", "posix_memalign", "aligned_alloc",
                                "memalign",     "valloc",         "pvalloc"};
  const size_t sizes[] = {100, 4108, 9 * MiB};
  enum { N = 16 };
  for (int how = 0; how < 9; how++)
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
      void *p[N];
      size_t before = live_total();
      for (int i = 0; i < N; i++) p[i] = alloc_with(how, sizes[s]);
      size_t after = live_total();
      if (after - before != N)
        kt_fail(__FILE__, __LINE__, "%s(%zu) x %d: keel counts %zu new live blocks", names[how],
                sizes[s], N, after - before);
      for (int i = 0; i < N; i++) {
        if (p[i] == NULL) {
          kt_fail(__FILE__, __LINE__, "%s(%zu) failed", names[how], sizes[s]);
          continue;
        }
        KT_CHECK(malloc_usable_size(p[i]) == keel_usable_size(p[i]));
        KT_CHECK(malloc_usable_size(p[i]) >= sizes[s]);
        memset(p[i], 0x11, sizes[s]);
        free(p[i]);
      }
      size_t end = live_total();
      if (end != before)
        kt_fail(__FILE__, __LINE__, "%s(%zu): %zu live blocks before, %zu after freeing all",
                names[how], sizes[s], before, end);
    }
}

static void usable_size_matches_classes(void) {
  for (size_t size = 1; size <= 64 * KiB; size += size < 512 ? 1 : 61) {
    void *p = malloc(size);
    KT_REQUIRE(p != NULL);
    size_t u = malloc_usable_size(p), want = class_size(size);
    if (u != want)
      kt_fail(__FILE__, __LINE__, "malloc_usable_size(malloc(%zu)) = %zu, class %zu", size, u,
              want);
    free(p);
  }
  KT_EQ(malloc_usable_size(NULL), 0);
}

static void free_sized_frees(void) {
  size_t before = live_for(300);
  void *a = malloc(300);
  void *b = aligned_alloc(256, 300);
  KT_REQUIRE(a != NULL && b != NULL);
  KT_CHECK(aligned(b, 256));
  free_sized(a, 300);
  free_aligned_sized(b, 256, 300);
  KT_EQ(live_for(300), before);
  free_sized(NULL, 0);
  free_aligned_sized(NULL, 64, 0);
}

/* ---- glibc edge semantics ------------------------------------------- */

static void malloc_zero_and_free_null(void) {
  void *p[16];
  for (int i = 0; i < 16; i++) {
    p[i] = malloc(0);
    KT_REQUIRE(p[i] != NULL);
    for (int j = 0; j < i; j++) KT_CHECK(p[i] != p[j]);
  }
  for (int i = 0; i < 16; i++) free(p[i]);
  free(NULL);
  void *z = realloc(NULL, 0);
  KT_CHECK(z != NULL);
  free(z);
  void *c = calloc(0, 0);
  KT_CHECK(c != NULL);
  free(c);
}

static void realloc_zero_frees(void) {
  size_t before = live_for(1000);
  void *p = malloc(1000);
  KT_EQ(live_for(1000), before + 1);
  KT_CHECK(realloc(p, 0) == NULL);
  KT_EQ(live_for(1000), before);
  /* realloc keeps contents across classes. */
  uint8_t *q = malloc(10);
  ht_fill(q, 0, 10, 3);
  q = realloc(q, 100 * KiB);
  KT_REQUIRE(q != NULL);
  KT_EQ(ht_check(q, 0, 10, 3), SIZE_MAX);
  q = realloc(q, 5);
  KT_REQUIRE(q != NULL);
  KT_EQ(ht_check(q, 0, 5, 3), SIZE_MAX);
  free(q);
}

static void posix_memalign_rules(void) {
  const size_t bad[] = {0, 1, 2, 4, 3, 12, 24, 48, 4097, SIZE_MAX};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    void *p = (void *)0x1234;
    int rc = posix_memalign(&p, bad[i], 64);
    if (rc != EINVAL)
      kt_fail(__FILE__, __LINE__, "posix_memalign(%zu) = %d, want EINVAL", bad[i], rc);
    KT_CHECK(p == (void *)0x1234); /* untouched on failure, as glibc */
  }
  for (size_t a = sizeof(void *); a <= 2 * MiB; a *= 2) {
    void *p = NULL;
    KT_EQ(posix_memalign(&p, a, 100), 0);
    KT_CHECK(p != NULL && aligned(p, a));
    free(p);
  }
  void *p = (void *)0x1234;
  KT_EQ(posix_memalign(&p, 64, ht_hide(SIZE_MAX)), ENOMEM);
  KT_EQ(posix_memalign(&p, 64, 0), 0); /* size 0: a unique pointer */
  KT_CHECK(p != NULL && p != (void *)0x1234);
  free(p);
}

static void aligned_alloc_rules(void) {
  const size_t bad[] = {0, 3, 24, 100, 4097, SIZE_MAX};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    errno = 0;
    void *p = aligned_alloc(bad[i], 64);
    if (p != NULL) {
      kt_fail(__FILE__, __LINE__, "aligned_alloc(%zu, 64) = %p, want NULL", bad[i], p);
      free(p);
    }
    KT_EQ(errno, EINVAL);
  }
  for (size_t a = 1; a <= MiB; a *= 2) {
    void *p = aligned_alloc(a, 3 * a / 2 + 1);
    KT_CHECK(p != NULL && aligned(p, a));
    free(p);
  }
  errno = 0;
  KT_CHECK(aligned_alloc(64, ht_hide(SIZE_MAX)) == NULL);
  KT_EQ(errno, ENOMEM);
}

/* glibc's memalign (unlike aligned_alloc) takes any alignment: one that is
 * not a power of two is rounded up to the next, and 0 (or anything up to 16)
 * is plain malloc. Legacy callers pass such values and get a block. */
static void memalign_rounds_alignment_up_like_glibc(void) {
  const size_t cases[][2] = {{24, 32}, {48, 64}, {100, 128}, {3000, 4096},
                             {0, 16},  {1, 16},  {3, 16}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    errno = 0;
    void *p = memalign(ht_hide(cases[i][0]), 100);
    if (p == NULL || !aligned(p, cases[i][1]))
      kt_fail(__FILE__, __LINE__, "memalign(%zu, 100) = %p (errno %d), want %zu-aligned",
              cases[i][0], p, errno, cases[i][1]);
    free(p);
  }
}

static void memalign_valloc_pvalloc(void) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  void *p = memalign(4096, 10);
  KT_CHECK(p != NULL && aligned(p, 4096));
  free(p);
  p = valloc(100);
  KT_CHECK(p != NULL && aligned(p, page) && malloc_usable_size(p) >= 100);
  free(p);
  /* pvalloc rounds the size up to whole pages. */
  p = pvalloc(100);
  KT_CHECK(p != NULL && aligned(p, page) && malloc_usable_size(p) >= page);
  free(p);
  p = pvalloc(0);
  KT_CHECK(p != NULL && aligned(p, page));
  free(p);
  errno = 0;
  KT_CHECK(memalign(64, ht_hide(SIZE_MAX)) == NULL);
  KT_EQ(errno, ENOMEM);
}

static void overflow_is_enomem(void) {
  errno = 0;
  KT_CHECK(malloc(ht_hide(SIZE_MAX)) == NULL);
  KT_EQ(errno, ENOMEM);
  errno = 0;
  KT_CHECK(malloc(ht_hide((size_t)PTRDIFF_MAX + 1)) == NULL);
  KT_EQ(errno, ENOMEM);
  errno = 0;
  KT_CHECK(calloc(ht_hide(SIZE_MAX / 2 + 1), 2) == NULL);
  KT_EQ(errno, ENOMEM);
  errno = 0;
  KT_CHECK(calloc(ht_hide((size_t)1 << 33), (size_t)1 << 33) == NULL);
  KT_EQ(errno, ENOMEM);
  errno = 0;
  KT_CHECK(reallocarray(NULL, ht_hide(SIZE_MAX / 2), 3) == NULL);
  KT_EQ(errno, ENOMEM);
  uint8_t *p = malloc(64);
  ht_fill(p, 0, 64, 11);
  errno = 0;
  KT_CHECK(reallocarray(ht_launder(p), ht_hide((size_t)1 << 40), (size_t)1 << 40) == NULL);
  KT_EQ(errno, ENOMEM);
  errno = 0;
  KT_CHECK(realloc(ht_launder(p), ht_hide(SIZE_MAX)) == NULL);
  KT_EQ(errno, ENOMEM);
  KT_EQ(ht_check(p, 0, 64, 11), SIZE_MAX); /* p survives both */
  p = reallocarray(p, 100, 3);
  KT_REQUIRE(p != NULL);
  KT_EQ(ht_check(p, 0, 64, 11), SIZE_MAX);
  free(p);
}

/* ---- glibc-only calls answer for keel ------------------------------- */

static void mallinfo2_reports_keel(void) {
  enum { N = 4096 };
  struct mallinfo2 a = mallinfo2();
  void **p = malloc(N * sizeof(void *));
  for (int i = 0; i < N; i++) {
    p[i] = malloc(4000);
    memset(p[i], 1, 4000);
  }
  struct mallinfo2 b = mallinfo2();
  /* In use grows by about 16 MiB; glibc's own arena would report nothing. */
  size_t in_a = a.uordblks + a.hblkhd, in_b = b.uordblks + b.hblkhd;
  if (in_b < in_a + (size_t)N * 4000)
    kt_fail(__FILE__, __LINE__, "mallinfo2 in use %zu -> %zu for %d x 4000 bytes", in_a, in_b, N);
  KT_CHECK(b.arena + b.hblkhd >= in_b);
  for (int i = 0; i < N; i++) free(p[i]);
  free(p);
  struct mallinfo2 c = mallinfo2();
  KT_CHECK(c.uordblks + c.hblkhd + (size_t)N * 4000 <= in_b);
}

/* Regression (live_bytes, and so uordblks, counted large mappings whole):
 * a large block is in use by its usable size (malloc_usable_size), while
 * hblkhd keeps the mapped size and fordblks does not count the mapping's
 * header page or alignment gap as free. */
static void mallinfo2_large_block_usable(void) {
  struct mallinfo2 a = mallinfo2();
  void *p = NULL;
  KT_REQUIRE(posix_memalign(&p, (size_t)2 << 20, (size_t)300 << 10) == 0);
  struct mallinfo2 b = mallinfo2();
  KT_EQ(b.uordblks - a.uordblks, malloc_usable_size(p));
  KT_EQ(b.hblks - a.hblks, 1);
  KT_CHECK(b.hblkhd - a.hblkhd > ((size_t)2 << 20) + malloc_usable_size(p) - 1);
  KT_CHECK(b.fordblks <= a.fordblks); /* a fresh or a cached mapping: never more free */
  free(p);
  struct mallinfo2 c = mallinfo2();
  KT_EQ(c.uordblks, a.uordblks);
  KT_EQ(c.hblkhd, a.hblkhd);
}

static void malloc_trim_returns_memory(void) {
  enum { N = 16384 };
  void **p = malloc(N * sizeof(void *));
  malloc_trim(0);
  size_t rss0 = kt_rss_kb();
  for (int i = 0; i < N; i++) {
    p[i] = malloc(4000);
    memset(p[i], 1, 4000);
  }
  size_t rss1 = kt_rss_kb();
  for (int i = 0; i < N; i++) free(p[i]);
  int released = malloc_trim(0);
  size_t rss2 = kt_rss_kb();
  printf("  RSS %zu -> %zu -> %zu KiB after malloc_trim (returned %d)\n", rss0, rss1, rss2,
         released);
  KT_CHECK(rss1 > rss0 + N * 3);
  if (rss1 - (rss2 < rss1 ? rss2 : rss1) < (size_t)N * 3)
    kt_fail(__FILE__, __LINE__, "malloc_trim(0) left RSS at %zu KiB (was %zu, %zu before)", rss2,
            rss1, rss0);
  KT_EQ(released, 1);
  free(p);
}

/* malloc_info describes keel's classes, not glibc's empty arena. */
static void malloc_info_reports_keel(void) {
  enum { N = 500 };
  void *p[N];
  for (int i = 0; i < N; i++) p[i] = malloc(3000);
  FILE *f = tmpfile();
  KT_REQUIRE(f != NULL);
  KT_EQ(malloc_info(0, f), 0);
  long len = ftell(f);
  char *text = calloc(1, (size_t)len + 1);
  rewind(f);
  KT_EQ(fread(text, 1, (size_t)len, f), len);
  fclose(f);
  char count[64];
  snprintf(count, sizeof(count), "count=\"%d\"", N);
  KT_CONTAINS(text, "<malloc version=");
  KT_CONTAINS(text, count); /* the class of 3000 bytes holds exactly these */
  free(text);
  for (int i = 0; i < N; i++) free(p[i]);
  errno = 0;
  KT_EQ(malloc_info(1, stderr), -1); /* glibc: options must be 0 */
  KT_EQ(errno, EINVAL);
}

static void malloc_stats_and_mallopt(void) {
  char buf[16384];
  void *p = malloc(12345);
  kt_stderr_begin();
  malloc_stats();
  kt_stderr_end(buf, sizeof(buf));
  free(p);
  KT_CHECK(strlen(buf) > 0);
  /* glibc's malloc_stats starts with "Arena 0:"; keel's is keel's table. */
  KT_CHECK(strstr(buf, "Arena 0:") == NULL);
  KT_EQ(mallopt(M_ARENA_MAX, 2), 1);
  KT_EQ(mallopt(M_TRIM_THRESHOLD, 128 * 1024), 1);
  KT_EQ(mallopt(M_MMAP_THRESHOLD, 1 << 20), 1);
  p = malloc(100);
  KT_CHECK(p != NULL);
  free(p);
}

/* ---- bad frees through the plain names ------------------------------- */

static void free_child(void *p) {
  free(p);
}

static void free_twice_child(void *p) {
  void *again = ht_launder(p);
  free(p);
  free(again);
}

static void realloc_child(void *p) {
  void *q = realloc(p, 64);
  (void)q;
}

static void usable_size_child(void *p) {
  (void)malloc_usable_size(p);
}

static void expect_invalid(void (*fn)(void *), void *p) {
  char expect[64];
  snprintf(expect, sizeof(expect), "invalid pointer %p", p);
  kt_expect_abort(__FILE__, __LINE__, fn, p, expect, NULL, 0);
}

static void invalid_free_aborts(void) {
  char stack[32];
  memset(stack, 0, sizeof(stack));
  expect_invalid(free_child, ht_launder(stack));
  uint8_t *p = malloc(4200); /* 4352-byte class, 64 KiB pages */
  expect_invalid(free_child, p + 16);
  uint8_t *m = mmap(NULL, MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  KT_REQUIRE(m != MAP_FAILED);
  expect_invalid(free_child, m);
  char expect[64];
  snprintf(expect, sizeof(expect), "keel: free: invalid pointer %p", (void *)stack);
  KT_EXPECT_ABORT(free_child, ht_launder(stack), expect);
  /* realloc of a pointer keel never returned aborts the same way, naming
   * realloc. */
  snprintf(expect, sizeof(expect), "keel: realloc: invalid pointer %p", (void *)stack);
  KT_EXPECT_ABORT(realloc_child, ht_launder(stack), expect);
  snprintf(expect, sizeof(expect), "keel: realloc: invalid pointer %p", (void *)(m + 4096));
  KT_EXPECT_ABORT(realloc_child, m + 4096, expect);
  munmap(m, MiB);
  /* Regression (found by review): a block boundary after the last whole
   * block of p's page (4352-byte blocks: 15 fill 65,280 bytes of its
   * 64 KiB) was taken by free, realloc and malloc_usable_size as a block,
   * and handed out twice after the free. */
  uint8_t *tail = (uint8_t *)((uintptr_t)p & ~(uintptr_t)(64 * KiB - 1)) + 15 * 4352;
  KT_CHECK(malloc_usable_size(p) == 4352);
  snprintf(expect, sizeof(expect), "keel: free: invalid pointer %p", (void *)tail);
  KT_EXPECT_ABORT(free_child, tail, expect);
  snprintf(expect, sizeof(expect), "keel: realloc: invalid pointer %p", (void *)tail);
  KT_EXPECT_ABORT(realloc_child, tail, expect);
  snprintf(expect, sizeof(expect), "keel: malloc_usable_size: invalid pointer %p", (void *)tail);
  KT_EXPECT_ABORT(usable_size_child, tail, expect);
  free(p);
}

static void double_free_aborts(void) {
  void *keep = malloc(40);
  void *p = malloc(40);
  char expect[64];
  snprintf(expect, sizeof(expect), "keel: free: double free of %p", p);
  KT_EXPECT_ABORT(free_twice_child, p, expect);
  free(p);
  free(keep);
}

/* ---- KEEL_OPTIONS=stats=1 -------------------------------------------- */

/* The first line keel_heap_print_stats writes: the table's header, which the
 * exit-time table must contain too. */
static void stats_header(char *out, size_t len) {
  FILE *f = tmpfile();
  keel_heap_print_stats(f);
  rewind(f);
  if (fgets(out, (int)len, f) == NULL) out[0] = 0;
  out[strcspn(out, "\n")] = 0;
  fclose(f);
}

/* Runs argv with extra environment entries, returns its stderr (malloc'd)
 * and exit status. */
static char *run_capture(char *const argv[], char *const extra_env[], int *status) {
  int pipefd[2];
  if (pipe(pipefd) != 0) return NULL;
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(pipefd[1], STDERR_FILENO);
    close(pipefd[0]);
    close(pipefd[1]);
    int devnull = open("/dev/null", O_RDWR);
    dup2(devnull, STDIN_FILENO);
    dup2(devnull, STDOUT_FILENO);
    for (int i = 0; extra_env[i] != NULL; i++) putenv(extra_env[i]);
    execv(argv[0], argv);
    _exit(127);
  }
  close(pipefd[1]);
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  ssize_t r;
  while ((r = read(pipefd[0], buf + n, cap - 1 - n)) > 0) {
    n += (size_t)r;
    if (n == cap - 1) buf = realloc(buf, cap *= 2);
  }
  buf[n] = 0;
  close(pipefd[0]);
  waitpid(pid, status, 0);
  return buf;
}

/* `--pthread-exit`: a worker frees a large block (the purge thread starts),
 * main ends with pthread_exit: the process must end when the worker does,
 * with exit status 0 and stdio flushed, as with glibc. */
static void *exit_worker(void *arg) {
  (void)arg;
  start_purge_thread();
  fputs("worker done\n", stderr);
  return NULL;
}
/* Runs on whichever thread ends last, the purge thread included: it needs
 * a full-size stack there (it had 256 KiB) and unblocked signals. */
static void big_stack_atexit(void) {
  volatile char big[512 << 10];
  memset((char *)big, 1, sizeof big);
  sigset_t cur;
  pthread_sigmask(SIG_SETMASK, NULL, &cur);
  fputs(sigismember(&cur, SIGTERM) ? "atexit: SIGTERM blocked\n" : "atexit ok\n", stderr);
}
static int pthread_exit_main(void) {
  atexit(big_stack_atexit);
  pthread_t t;
  pthread_create(&t, NULL, exit_worker, NULL);
  printf("buffered"); /* flushed by exit(), if the process exits */
  pthread_exit(NULL);
}

static int child_main(void) {
  void *keep[64];
  for (int i = 0; i < 64; i++) keep[i] = malloc((size_t)(i + 1) * 40);
  for (int i = 0; i < 64; i += 2) free(keep[i]);
  return 0; /* the odd ones stay live: the table shows them at exit */
}

static void stats_option_prints_table_at_exit(void) {
  char header[512];
  stats_header(header, sizeof(header));
  KT_REQUIRE(header[0] != 0);
  char *argv[] = {"/proc/self/exe", "--child", NULL};
  char opt_on[] = "KEEL_OPTIONS=stats=1", opt_off[] = "KEEL_OPTIONS=";
  char *on[] = {opt_on, NULL}, *off[] = {opt_off, NULL};
  int status = -1;
  char *err = run_capture(argv, on, &status);
  KT_REQUIRE(err != NULL);
  KT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  KT_CONTAINS(err, header);
  free(err);
  /* Without the option nothing is printed. */
  err = run_capture(argv, off, &status);
  KT_REQUIRE(err != NULL);
  KT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  KT_STREQ(err, "");
  free(err);
}

/* The same through LD_PRELOAD into a Debian program. perl, not a coreutils
 * program: those close stderr in an atexit handler (gnulib close_stdout),
 * before any library destructor could print. */
static void stats_option_under_ld_preload(void) {
  const char *perl = "/usr/bin/perl";
  if (access(perl, X_OK) != 0) {
    printf("  (no %s: skipped)\n", perl);
    return;
  }
  char header[512];
  stats_header(header, sizeof(header));
  char preload[1024];
  snprintf(preload, sizeof(preload), "LD_PRELOAD=%s", KEEL_MALLOC_LIB);
  char opt_on[] = "KEEL_OPTIONS=stats=1";
  char *env[] = {preload, opt_on, NULL};
  char *argv[] = {(char *)perl, "-e", "my @a = map { 'x' x $_ } 1 .. 5000; print scalar(@a)", NULL};
  int status = -1;
  char *err = run_capture(argv, env, &status);
  KT_REQUIRE(err != NULL);
  KT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  KT_CONTAINS(err, header);
  free(err);
}

/* Regression (audit of issue 4): the purge thread outlived the program's
 * last thread and kept the process alive for good (a zombie main, every
 * signal blocked: only SIGKILL ended it, and stdout was never flushed). */
/* Runs this program with `mode`; its exit status in *status and its output
 * in buf; false (and it is killed) if it outlives `limit_ms`. */
static bool run_self(const char *mode, int limit_ms, int *status, char *buf, size_t cap) {
  int out[2];
  if (pipe(out) != 0) return false;
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    dup2(out[1], STDERR_FILENO);
    close(out[0]);
    close(out[1]);
    unsetenv("KEEL_OPTIONS"); /* stats=1 would add its table to the output */
    execl("/proc/self/exe", "test_malloc_override", mode, (char *)NULL);
    _exit(127);
  }
  close(out[1]);
  pid_t got = 0;
  for (int ms = 0; ms < limit_ms && (got = waitpid(pid, status, WNOHANG)) == 0; ms += 10)
    usleep(10 * 1000);
  if (got == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, status, 0);
  }
  size_t len = 0;
  ssize_t n;
  while (len < cap - 1 && (n = read(out[0], buf + len, cap - 1 - len)) > 0) len += (size_t)n;
  close(out[0]);
  buf[len] = 0;
  return got != 0;
}

/* `--fork-pthread-exit`: a thread of this process holds a heap and stays;
 * a child forked then starts the purge thread from a thread of its own and
 * ends main with pthread_exit. The child inherited the parent's count of
 * live heaps, which then never fell to zero there, and the purge thread
 * kept the child alive for good (review of the fix, helper-77). Exit
 * status 0 if the child ended within 10 s. */
static void *parent_holder(void *arg) {
  void *k[1000];
  for (int i = 0; i < 1000; i++) k[i] = malloc(64);
  for (int i = 0; i < 1000; i++) free(k[i]);
  pause();
  return arg;
}
static int fork_pthread_exit_main(void) {
  pthread_t w;
  pthread_create(&w, NULL, parent_holder, NULL);
  usleep(100 * 1000);
  pid_t pid = fork();
  if (pid == 0) {
    pthread_t t;
    pthread_create(&t, NULL, exit_worker, NULL);
    pthread_exit(NULL);
  }
  int st = 0;
  pid_t got = 0;
  for (int ms = 0; ms < 10000 && (got = waitpid(pid, &st, WNOHANG)) == 0; ms += 10)
    usleep(10 * 1000);
  if (got == 0) kill(pid, SIGKILL);
  return got != 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}

static void last_thread_ends_process(void) {
  char buf[4096];
  int status = 0;
  if (!run_self("--pthread-exit", 20000, &status, buf, sizeof buf))
    kt_fail(__FILE__, __LINE__, "the process outlived its last thread by 20 s");
  KT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  KT_CONTAINS(buf, "worker done");
  KT_CONTAINS(buf, "buffered");
  KT_CONTAINS(buf, "atexit ok");
  /* The same in a child forked while another thread holds a heap. */
  KT_CHECK(run_self("--fork-pthread-exit", 20000, &status, buf, sizeof buf));
  KT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* `--single-thread` (`--single-thread-fork`: in a child forked after a
 * thread ran): a process with one thread frees 64 MiB for a delayed
 * purge and goes on calling the allocator now and then. keel starts no
 * thread of its own there (one would make unshare(CLONE_NEWUSER) fail with
 * EINVAL, and a seccomp filter without clone kill the process), yet the
 * memory is purged, inline, by those later calls. Once the process has
 * started a thread, the next free starts the purge thread. */
static int threads_now(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  int n = -1;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "Threads: %d", &n) == 1) break;
  if (f != NULL) fclose(f);
  return n;
}
static void *idle_worker(void *arg) {
  void *volatile x = malloc(100); /* a forked child sees a thread by its allocating */
  free(x);
  return arg;
}
static int single_thread_main(bool forked) {
  if (forked) { /* a child of a process that had a thread: glibc's flag is false there */
    pthread_t w;
    pthread_create(&w, NULL, idle_worker, NULL);
    pthread_join(w, NULL);
    pid_t pid = fork();
    if (pid != 0) {
      int st = 1;
      waitpid(pid, &st, 0);
      return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
  }
  enum { N = 4096 };
  static void *p[N];
  for (int i = 0; i < N; i++) memset(p[i] = malloc(16 << 10), 1, 16 << 10);
  size_t rss0 = kt_rss_kb();
  for (int i = 0; i < N; i++) free(p[i]);
  double end = kt_now() + 3;
  size_t rss1 = rss0;
  while (kt_now() < end && (rss1 = kt_rss_kb()) + 32 * 1024 > rss0) {
    /* A large free: one of the slow paths that purge inline (volatile: gcc
     * drops a malloc whose block is only freed). */
    void *volatile q = malloc(8 * MiB);
    free(q);
    usleep(20 * 1000);
  }
  int t1 = threads_now();
  errno = 0;
  int un = unshare(CLONE_NEWUSER); /* EPERM where user namespaces are off */
  int un_errno = errno;
  pthread_t t;
  pthread_create(&t, NULL, idle_worker, NULL);
  pthread_join(t, NULL);
  void *volatile q = malloc(8 * MiB);
  free(q);
  int t2 = threads_now();
  printf("threads %d, rss %zu -> %zu KiB, unshare %d (%s), then %d threads\n", t1, rss0, rss1, un,
         strerror(un_errno), t2);
  return t1 == 1 && rss1 + 32 * 1024 <= rss0 && !(un != 0 && un_errno == EINVAL) && t2 == 2 ? 0 : 1;
}

static void single_thread_gets_no_purge_thread(void) {
  char buf[4096];
  int status = 0;
  KT_REQUIRE(run_self("--single-thread", 20000, &status, buf, sizeof buf));
  printf("  %s", buf);
  KT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  /* The same in a child forked from a process that had started a thread
   * (review, helper-81: it still got a purge thread). */
  KT_REQUIRE(run_self("--single-thread-fork", 20000, &status, buf, sizeof buf));
  printf("  forked: %s", buf);
  KT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* ---- libkeel.so is dlopen-able --------------------------------------- */

static void *(*g_k_malloc)(size_t);
static void (*g_k_free)(void *);
static void *dl_worker(void *arg) {
  (void)arg;
  for (int i = 0; i < 100; i++) g_k_free(g_k_malloc((size_t)(i + 1) * 64));
  g_k_free(g_k_malloc(8 * MiB));
  return NULL;
}
static void *dl_worker_idle(void *arg) {
  return arg;
}

static void libkeel_dlopen_without_static_tls(void) {
  void *h = dlopen(KEEL_SHARED_LIB, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    kt_fail(__FILE__, __LINE__, "dlopen(%s): %s", KEEL_SHARED_LIB, dlerror());
    return;
  }
  struct link_map *lm = NULL;
  KT_REQUIRE(dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm != NULL);
  /* DF_STATIC_TLS marks initial-exec TLS: what makes a late dlopen fail
   * with "cannot allocate memory in static TLS block". */
  for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; d++)
    if (d->d_tag == DT_FLAGS && (d->d_un.d_val & DF_STATIC_TLS))
      kt_fail(__FILE__, __LINE__, "%s has DF_STATIC_TLS", KEEL_SHARED_LIB);
  void *(*k_malloc)(size_t) = (void *(*)(size_t))dlsym(h, "keel_malloc");
  void (*k_free)(void *) = (void (*)(void *))dlsym(h, "keel_free");
  KT_REQUIRE(k_malloc != NULL && k_free != NULL);
  void *p = k_malloc(1000);
  KT_CHECK(p != NULL);
  memset(p, 0, 1000);
  k_free(p);
  /* Its own threads (the purge thread, started by a large free) and the
   * TLS destructors of threads that used it run its code after dlclose:
   * it is never unloaded (it crashed the process). */
  bool nodelete = false;
  for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; d++)
    if (d->d_tag == DT_FLAGS_1 && (d->d_un.d_val & DF_1_NODELETE)) nodelete = true;
  KT_CHECK(nodelete);
  g_k_malloc = k_malloc;
  g_k_free = k_free;
  pthread_t t[4];
  for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, dl_worker, NULL);
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  dlclose(h);
  usleep(300 * 1000); /* the purge thread's ticks, after the close */
  pthread_create(&t[0], NULL, dl_worker_idle, NULL);
  pthread_join(t[0], NULL);
}

static const kt_case_t cases[] = {
    KT_CASE(symbols_resolve_to_keel),
    KT_CASE(stats_see_every_allocator),
    KT_CASE(usable_size_matches_classes),
    KT_CASE(free_sized_frees),
    KT_CASE(malloc_zero_and_free_null),
    KT_CASE(realloc_zero_frees),
    KT_CASE(posix_memalign_rules),
    KT_CASE(aligned_alloc_rules),
    KT_CASE(memalign_valloc_pvalloc),
    KT_CASE(memalign_rounds_alignment_up_like_glibc),
    KT_CASE(overflow_is_enomem),
    KT_CASE(mallinfo2_reports_keel),
    KT_CASE(mallinfo2_large_block_usable),
    KT_CASE(malloc_trim_returns_memory),
    KT_CASE(malloc_stats_and_mallopt),
    KT_CASE(malloc_info_reports_keel),
    KT_CASE(invalid_free_aborts),
    KT_CASE(double_free_aborts),
    KT_CASE(stats_option_prints_table_at_exit),
    KT_CASE(stats_option_under_ld_preload),
    KT_CASE(libkeel_dlopen_without_static_tls),
    KT_CASE(last_thread_ends_process),
    KT_CASE(single_thread_gets_no_purge_thread),
};

int main(int argc, char **argv) {
  /* `--child`: the program run with KEEL_OPTIONS=stats=1 by a case above. */
  if (argc > 1 && strcmp(argv[1], "--child") == 0) return child_main();
  if (argc > 1 && strcmp(argv[1], "--pthread-exit") == 0) return pthread_exit_main();
  if (argc > 1 && strcmp(argv[1], "--single-thread") == 0) return single_thread_main(false);
  if (argc > 1 && strcmp(argv[1], "--single-thread-fork") == 0) return single_thread_main(true);
  if (argc > 1 && strcmp(argv[1], "--fork-pthread-exit") == 0) return fork_pthread_exit_main();
  return kt_main(argc, argv, cases, sizeof(cases) / sizeof(cases[0]));
}
