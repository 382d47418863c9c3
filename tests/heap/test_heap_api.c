/* The heap's public API, edge by edge (issue 4, parts 1, 4 and 6).
 *
 * Runs in the release, ASan and TSan builds through the keel_* entry points
 * (keel_static), so keel's own allocator is under test in every build even
 * where a sanitizer owns malloc. Covers: glibc edge semantics (size 0, NULL,
 * realloc to 0, overflow -> ENOMEM, bad alignment -> EINVAL), the size-class
 * table against the waste bounds, alignment of every class at every
 * alignment up to 1 MiB, realloc across every class boundary and between
 * small and large with contents checked, stats bookkeeping, RSS returned by
 * keel_heap_collect, and the abort messages for invalid and double frees.
 *
 * Single-threaded except where a case says otherwise, so keel_heap_stats is
 * exact here (its figures are exact for a quiescent heap).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <keel/heap.h>

#include "base/common.h" /* KEEL_TSAN */
#include "harness.h"
#include "heap_test_util.h"

#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)

static keel_heap_class_info_t classes[KEEL_HEAP_MAX_CLASSES];
static size_t n_classes;

/* The class table, read once; every case that needs it calls this. */
static void load_classes(void) {
  if (n_classes != 0) return;
  size_t n = keel_heap_classes(NULL, 0);
  KT_REQUIRE(n > 0 && n <= KEEL_HEAP_MAX_CLASSES);
  KT_EQ(keel_heap_classes(classes, n), n);
  n_classes = n;
}

/* The largest request served from a size class; above it blocks are mapped. */
static size_t large_threshold(void) {
  load_classes();
  return classes[n_classes - 1].size;
}

static bool aligned(const void *p, size_t a) {
  return ((uintptr_t)p & (a - 1)) == 0;
}

/* ---- size 0, NULL, glibc semantics ---------------------------------- */

static void malloc_zero_unique(void) {
  enum { N = 64 };
  void *p[N];
  for (int i = 0; i < N; i++) {
    p[i] = keel_malloc(0);
    KT_REQUIRE(p[i] != NULL);
    KT_CHECK(aligned(p[i], 8));
    for (int j = 0; j < i; j++) KT_CHECK(p[i] != p[j]);
  }
  for (int i = 0; i < N; i++) keel_free(p[i]);
  /* calloc(0, n) and calloc(n, 0) are malloc(0): unique, not NULL. */
  void *a = keel_calloc(0, 16), *b = keel_calloc(16, 0);
  KT_CHECK(a != NULL && b != NULL && a != b);
  keel_free(a);
  keel_free(b);
}

static void free_null(void) {
  errno = 1234;
  keel_free(NULL);
  keel_free_sized(NULL, 0);
  keel_free_sized(NULL, 100);
  KT_EQ(errno, 1234); /* free never touches errno */
  KT_EQ(keel_usable_size(NULL), 0);
}

/* keel/heap.h: 16-aligned, except that a block whose class size is not a
 * multiple of 16 (24, 40, 56, 72, 88, 104, 120) may be only 8-aligned. */
static void malloc_alignment_as_documented(void) {
  enum { N = 4 };
  for (size_t size = 0; size <= 4 * KiB; size++) {
    void *p[N];
    for (int k = 0; k < N; k++) {
      p[k] = keel_malloc(size);
      KT_REQUIRE(p[k] != NULL);
      size_t want = keel_usable_size(p[k]) % 16 == 0 ? 16 : 8;
      if (!aligned(p[k], want))
        kt_fail(__FILE__, __LINE__, "malloc(%zu) = %p (usable %zu): not %zu-aligned", size, p[k],
                keel_usable_size(p[k]), want);
    }
    for (int k = 0; k < N; k++) keel_free(p[k]);
  }
}

/* The stricter rule, off by default (KEEL_TEST_STRICT_ALIGN=1 runs it).
 * C23 7.24.3: a block must suit any object with a fundamental alignment
 * whose size is <= the request; a 16-byte long double fits in malloc(24),
 * so that needs 16 (and glibc gives 16 to every block). keel's 8-byte steps
 * from 64 to 128 (needed for the 12.5% waste bound) and its 24/40/56
 * classes give 8-aligned blocks there: code that puts a 16-aligned header in
 * a buffer of header + 8 bytes would fault on an aligned SSE access. This
 * is a trade-off for the lead to decide, so it does not gate the build. */
static size_t required_align(size_t size) {
  if (size >= 16) return 16;
  size_t a = 1;
  while (a * 2 <= size) a *= 2;
  return a;
}

static void malloc_16_aligned_from_16_bytes(void) {
  if (!kt_env_int("KEEL_TEST_STRICT_ALIGN", 0)) {
    printf("  (C23/glibc 16-byte rule not enforced; KEEL_TEST_STRICT_ALIGN=1 checks it)\n");
    return;
  }
  size_t reported = 0;
  for (size_t size = 0; size <= 4 * KiB; size++) {
    void *p = keel_malloc(size);
    KT_REQUIRE(p != NULL);
    if (!aligned(p, required_align(size)) && reported++ < 8)
      kt_fail(__FILE__, __LINE__, "malloc(%zu) = %p: not %zu-aligned", size, p,
              required_align(size));
    keel_free(p);
  }
}

static void realloc_null_allocates(void) {
  void *p = keel_realloc(NULL, 100);
  KT_REQUIRE(p != NULL);
  KT_CHECK(keel_usable_size(p) >= 100);
  ht_fill(p, 0, 100, 7);
  KT_EQ(ht_check(p, 0, 100, 7), SIZE_MAX);
  keel_free(p);
  /* realloc(NULL, 0) is malloc(0): a unique pointer. */
  void *z = keel_realloc(NULL, 0);
  KT_CHECK(z != NULL);
  keel_free(z);
}

/* Live blocks of the class serving `size`, for checking that a call freed. */
static size_t live_in_class(size_t size) {
  static keel_heap_stats_t st;
  keel_heap_stats(&st);
  int c = keel_heap_class_of(size);
  return c >= 0 ? st.classes[c].live : st.large_live;
}

static void realloc_zero_frees(void) {
  const size_t sizes[] = {1, 100, 4108, 100 * KiB, 4 * MiB};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    size_t before = live_in_class(sizes[i]);
    void *p = keel_malloc(sizes[i]);
    KT_REQUIRE(p != NULL);
    KT_EQ(live_in_class(sizes[i]), before + 1);
    errno = 0;
    KT_CHECK(keel_realloc(p, 0) == NULL); /* glibc: frees p, returns NULL */
    KT_EQ(live_in_class(sizes[i]), before);
  }
}

/* Child side: keel_realloc(p, 0) freed p, so freeing it again is a double
 * free. Another block of the class keeps the page alive, so p is still on
 * the page's free list when the second free comes. */
static void realloc_zero_then_free_child(void *arg) {
  void *p = arg;
  void *keep = keel_malloc(48);
  KT_CHECK(keel_realloc(p, 0) == NULL);
  keel_free(ht_launder(p));
  keel_free(keep);
}

static void realloc_zero_then_free_is_double_free(void) {
  void *p = keel_malloc(48);
  KT_REQUIRE(p != NULL);
  char expect[64];
  snprintf(expect, sizeof(expect), "keel: free: double free of %p", p);
  KT_EXPECT_ABORT(realloc_zero_then_free_child, p, expect);
  keel_free(p);
}

/* ---- calloc ---------------------------------------------------------- */

static bool all_zero(const void *p, size_t n) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != 0) return false;
  return true;
}

static void calloc_zeroes(void) {
  load_classes();
  /* Dirty a block of every class, free it, then calloc the same size: the
   * block calloc returns is most likely the one just dirtied. */
  for (size_t i = 0; i < n_classes; i++) {
    size_t size = classes[i].size;
    void *d = keel_malloc(size);
    KT_REQUIRE(d != NULL);
    memset(d, 0xA5, size);
    keel_free(d);
    for (int k = 0; k < 2; k++) {
      uint8_t *p = keel_calloc(1, size);
      KT_REQUIRE(p != NULL);
      if (!all_zero(p, size)) kt_fail(__FILE__, __LINE__, "calloc(1, %zu) not zeroed", size);
      memset(p, 0x5A, size);
      keel_free(p);
    }
  }
  /* Large blocks, including one whose memory was used and freed before. */
  size_t top = kt_sanitized() ? 8 * MiB : 32 * MiB; /* byte loops are slow instrumented */
  for (size_t size = 2 * large_threshold(); size <= top; size *= 2) {
    uint8_t *p = keel_calloc(size / 8, 8);
    KT_REQUIRE(p != NULL);
    KT_CHECK(all_zero(p, size));
    memset(p, 0x77, size);
    keel_free(p);
    p = keel_calloc(size, 1);
    KT_REQUIRE(p != NULL);
    KT_CHECK(all_zero(p, size));
    keel_free(p);
  }
}

static void calloc_overflow_enomem(void) {
  const size_t bad[][2] = {
      {SIZE_MAX, 2},         {2, SIZE_MAX},
      {SIZE_MAX / 2 + 1, 2}, {(size_t)1 << 32, (size_t)1 << 32},
      {SIZE_MAX, SIZE_MAX},  {(SIZE_MAX / 16) + 1, 16},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    errno = 0;
    void *p = keel_calloc(bad[i][0], bad[i][1]);
    KT_CHECK(p == NULL);
    KT_EQ(errno, ENOMEM);
  }
  /* The largest product that does not overflow is still far too big. */
  errno = 0;
  KT_CHECK(keel_calloc(SIZE_MAX / 16, 16) == NULL);
  KT_EQ(errno, ENOMEM);
}

/* ---- too big, bad alignment ---------------------------------------- */

static void malloc_huge_enomem(void) {
  const size_t huge[] = {SIZE_MAX,
                         SIZE_MAX - 1,
                         SIZE_MAX - 4095,
                         SIZE_MAX - 2 * MiB,
                         (size_t)PTRDIFF_MAX + 1,
                         (size_t)PTRDIFF_MAX,
                         (size_t)1 << 62,
                         (size_t)1 << 56};
  for (size_t i = 0; i < sizeof(huge) / sizeof(huge[0]); i++) {
    errno = 0;
    KT_CHECK(keel_malloc(huge[i]) == NULL);
    KT_EQ(errno, ENOMEM);
    errno = 0;
    KT_CHECK(keel_aligned_alloc(64, huge[i]) == NULL);
    KT_EQ(errno, ENOMEM);
    errno = 0;
    KT_CHECK(keel_aligned_alloc(MiB, huge[i]) == NULL);
    KT_EQ(errno, ENOMEM);
  }
  /* The heap still works afterwards. */
  void *p = keel_malloc(100);
  KT_CHECK(p != NULL);
  keel_free(p);
}

static void realloc_huge_enomem_keeps_block(void) {
  const size_t sizes[] = {24, 4108, 200 * KiB, 3 * MiB};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    uint8_t *p = keel_malloc(sizes[i]);
    KT_REQUIRE(p != NULL);
    ht_fill(p, 0, sizes[i], 99);
    errno = 0;
    KT_CHECK(keel_realloc(p, SIZE_MAX) == NULL);
    KT_EQ(errno, ENOMEM);
    errno = 0;
    KT_CHECK(keel_realloc(p, (size_t)PTRDIFF_MAX + 1) == NULL);
    KT_EQ(errno, ENOMEM);
    /* On failure p is untouched and still owned by the caller. */
    KT_EQ(ht_check(p, 0, sizes[i], 99), SIZE_MAX);
    KT_CHECK(keel_usable_size(p) >= sizes[i]);
    keel_free(p);
  }
}

static void aligned_alloc_bad_alignment_einval(void) {
  const size_t bad[] = {
      0, 3, 6, 12, 24, 48, 100, 768, 4097, 5000, 3 * MiB, SIZE_MAX, SIZE_MAX / 2 + 2};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    errno = 0;
    void *p = keel_aligned_alloc(bad[i], 64);
    if (p != NULL) {
      kt_fail(__FILE__, __LINE__, "aligned_alloc(%zu, 64) = %p, want NULL", bad[i], p);
      keel_free(p);
    }
    KT_EQ(errno, EINVAL);
  }
}

/* ---- usable size and the class table ------------------------------- */

static void usable_size_covers_request(void) {
  load_classes();
  for (size_t size = 0; size <= 16 * KiB; size += (size < 1024 ? 1 : 7)) {
    void *p = keel_malloc(size);
    KT_REQUIRE(p != NULL);
    size_t u = keel_usable_size(p);
    int c = keel_heap_class_of(size);
    KT_REQUIRE(c >= 0 && (size_t)c < n_classes);
    if (u < size || u != classes[c].size)
      kt_fail(__FILE__, __LINE__, "usable(malloc(%zu)) = %zu, class %d size %zu", size, u, c,
              classes[c].size);
#if !defined(__SANITIZE_ADDRESS__)
    /* All usable bytes are the caller's (glibc's contract). Not under ASan,
     * where keel may poison the tail beyond the request. */
    memset(p, 0xC3, u);
#endif
    keel_free(p);
  }
  for (size_t size = large_threshold() - 1; size <= 64 * MiB; size = size * 3 + 1) {
    void *p = keel_malloc(size);
    KT_REQUIRE(p != NULL);
    KT_CHECK(keel_usable_size(p) >= size);
    keel_free(p);
  }
}

static void classes_table_consistent(void) {
  load_classes();
  size_t prev = 0;
  for (size_t i = 0; i < n_classes; i++) {
    const keel_heap_class_info_t *c = &classes[i];
    KT_CHECK(c->size > prev);
    KT_CHECK(c->size % 8 == 0 || c->size % 16 == 0);
    KT_EQ(c->max_req, c->size);
    /* Consecutive classes cover every request: no gap, no overlap. */
    KT_EQ(c->min_req, i == 0 ? c->min_req : prev + 1);
    KT_CHECK(c->per_page >= 1);
    KT_CHECK(c->per_page * c->size <= c->page_size);
    /* Exact 8- or 16-byte steps up to 64 bytes. */
    if (c->size <= 64 && c->size - prev != 8 && c->size - prev != 16)
      kt_fail(__FILE__, __LINE__, "class %zu: %zu after %zu (want an 8/16-byte step)", i, c->size,
              prev);
    /* At most 12.5% internal waste from 64 bytes up: (size - min_req) / size,
     * the smallest request counted as 1 byte (a malloc(0) wastes all). */
    size_t lo = c->min_req > 0 ? c->min_req : 1;
    double worst = (double)(c->size - lo) / (double)c->size;
    if (c->size > 64 && worst > 0.125 + 1e-9)
      kt_fail(__FILE__, __LINE__, "class %zu (%zu..%zu): worst waste %.3f > 0.125", i, c->min_req,
              c->size, worst);
    if (c->worst_waste < worst - 1e-6 || c->worst_waste > worst + 1e-6)
      kt_fail(__FILE__, __LINE__, "class %zu: reported worst_waste %.4f, computed %.4f", i,
              c->worst_waste, worst);
    KT_CHECK(c->avg_waste >= 0 && c->avg_waste <= 1);
    /* The page remainder (bytes no block can use) is a second waste on top;
     * the issue bounds only the first, so this is a sanity bound that a
     * badly chosen page size (say two blocks in a page) would break. */
    double cost = (double)c->page_size / (double)c->per_page;
    if (cost > 1.25 * (double)c->size)
      kt_fail(__FILE__, __LINE__, "class %zu: %zu x %zu in a %zu-byte page: %.0f bytes each", i,
              c->per_page, c->size, c->page_size, cost);
    prev = c->size;
  }
  KT_CHECK(classes[0].min_req <= 1);
  KT_EQ(keel_heap_class_of(0), 0);
  KT_EQ(keel_heap_class_of(1), 0);
  KT_EQ(keel_heap_class_of(large_threshold() + 1), -1);
  KT_EQ(keel_heap_class_of(SIZE_MAX), -1);
  /* keel_heap_class_of agrees with the table for every request it serves. */
  for (size_t i = 0; i < n_classes; i++) {
    size_t step = classes[i].size > 64 * KiB ? 61 : 1;
    for (size_t s = classes[i].min_req; s <= classes[i].max_req; s += step)
      if (keel_heap_class_of(s) != (int)i) {
        kt_fail(__FILE__, __LINE__, "class_of(%zu) = %d, want %zu", s, keel_heap_class_of(s), i);
        break;
      }
    KT_EQ(keel_heap_class_of(classes[i].max_req), (int)i);
  }
}

/* The Squid case: a 4096+12-byte object must not cost two pages. */
static void class_4108_costs_under_1_15x(void) {
  load_classes();
  int c = keel_heap_class_of(4108);
  KT_REQUIRE(c >= 0);
  const keel_heap_class_info_t *ci = &classes[c];
  double per_block = (double)ci->page_size / (double)ci->per_page;
  if (per_block > 4108 * 1.15)
    kt_fail(__FILE__, __LINE__, "4108 -> class %zu, %zu per %zu-byte page: %.0f bytes each",
            ci->size, ci->per_page, ci->page_size, per_block);
  void *p = keel_malloc(4108);
  KT_CHECK(keel_usable_size(p) == ci->size);
  keel_free(p);
}

/* ---- alignment ------------------------------------------------------ */

/* Allocates `size` at `align` K times, checks each, frees them. Only the head
 * and tail are written: the full pattern would make this case slow without
 * finding more (the overlap test writes whole blocks). */
static void check_aligned(size_t align, size_t size) {
  enum { K = 3 };
  void *p[K];
  for (int k = 0; k < K; k++) {
    p[k] = keel_aligned_alloc(align, size);
    if (p[k] == NULL) {
      kt_fail(__FILE__, __LINE__, "aligned_alloc(%zu, %zu) failed", align, size);
      kt_abort_case();
    }
    size_t u = keel_usable_size(p[k]);
    if (!aligned(p[k], align) || u < size)
      kt_fail(__FILE__, __LINE__, "aligned_alloc(%zu, %zu) = %p, usable %zu", align, size, p[k], u);
    size_t head = size < 64 ? size : 64;
    ht_fill(p[k], 0, head, (uint32_t)k);
    ht_fill(p[k], size - head, size, (uint32_t)k);
  }
  for (int k = 0; k < K; k++) {
    size_t head = size < 64 ? size : 64;
    if (ht_check(p[k], 0, head, (uint32_t)k) != SIZE_MAX ||
        ht_check(p[k], size - head, size, (uint32_t)k) != SIZE_MAX)
      kt_fail(__FILE__, __LINE__, "aligned_alloc(%zu, %zu): block %d overwritten", align, size, k);
    keel_free(p[k]);
  }
}

static void alignment_every_class_up_to_1mib(void) {
  load_classes();
  for (size_t i = 0; i < n_classes; i++)
    for (size_t align = 1; align <= MiB; align *= 2) {
      check_aligned(align, classes[i].size);
      if (classes[i].min_req > 0) check_aligned(align, classes[i].min_req);
    }
}

static void alignment_large(void) {
  size_t t = large_threshold();
  const size_t sizes[] = {t + 1, 2 * t + 17, 5 * MiB + 123, 17 * MiB};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
    for (size_t align = 1; align <= 2 * MiB; align *= 2) check_aligned(align, sizes[i]);
}

/* glibc serves any power-of-two alignment; programs ask for 4 MiB+ (huge
 * page or DMA-friendly buffers) with posix_memalign and expect success. */
static void aligned_alloc_above_2mib_alignment(void) {
  for (size_t align = 4 * MiB; align <= 64 * MiB; align *= 4) {
    const size_t sizes[] = {64, 300 * KiB, 5 * MiB};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
      errno = 0;
      void *p = keel_aligned_alloc(align, sizes[i]);
      if (p == NULL) {
        kt_fail(__FILE__, __LINE__, "aligned_alloc(%zu MiB, %zu) = NULL, errno %d", align / MiB,
                sizes[i], errno);
        continue;
      }
      KT_CHECK(aligned(p, align) && keel_usable_size(p) >= sizes[i]);
      memset(p, 1, sizes[i]);
      keel_free(p);
    }
  }
}

/* ---- many live blocks ----------------------------------------------- */

typedef struct {
  uint8_t *p;
  size_t size;
} blk_t;

static int by_address(const void *a, const void *b) {
  uintptr_t x = (uintptr_t)((const blk_t *)a)->p, y = (uintptr_t)((const blk_t *)b)->p;
  return x < y ? -1 : x > y;
}

/* Sizes mostly small, a tail up to 256 KiB, a few large. */
static size_t mixed_size(uint64_t *rng) {
  uint64_t r = ht_rand(rng) % 1000;
  if (r < 700) return ht_range(rng, 0, 512);
  if (r < 950) return ht_range(rng, 513, 16 * KiB);
  if (r < 998) return ht_range(rng, 16 * KiB, 256 * KiB);
  return ht_range(rng, 256 * KiB, 4 * MiB);
}

static void blocks_do_not_overlap(void) {
  size_t n = (size_t)kt_scale(kt_env_int("KEEL_TEST_ITERS", 20000));
  blk_t *b = calloc(n, sizeof(*b));
  KT_REQUIRE(b != NULL);
  uint64_t rng = 42;
  for (size_t i = 0; i < n; i++) {
    b[i].size = mixed_size(&rng);
    b[i].p = keel_malloc(b[i].size);
    KT_REQUIRE(b[i].p != NULL);
    ht_fill(b[i].p, 0, b[i].size, (uint32_t)i);
  }
  for (size_t i = 0; i < n; i++)
    if (ht_check(b[i].p, 0, b[i].size, (uint32_t)i) != SIZE_MAX)
      kt_fail(__FILE__, __LINE__, "block %zu (%p, %zu bytes) overwritten", i, (void *)b[i].p,
              b[i].size);
  qsort(b, n, sizeof(*b), by_address);
  for (size_t i = 1; i < n; i++) {
    size_t u = keel_usable_size(b[i - 1].p);
    if (b[i - 1].p + u > b[i].p)
      kt_fail(__FILE__, __LINE__, "%p+%zu overlaps %p", (void *)b[i - 1].p, u, (void *)b[i].p);
  }
  /* Free in a random order. */
  for (size_t i = n; i > 1; i--) {
    size_t j = ht_range(&rng, 0, i - 1);
    keel_free(b[j].p);
    b[j] = b[i - 1];
  }
  keel_free(b[0].p);
  free(b);
}

/* A block freed by a thread that did not allocate it goes back to the heap. */
static void *alloc_thread(void *arg) {
  void **out = arg;
  for (int i = 0; i < 1000; i++) {
    out[i] = keel_malloc(200);
    ht_fill(out[i], 0, 200, (uint32_t)i);
  }
  return NULL;
}

static void cross_thread_free(void) {
  void **blocks = calloc(1000, sizeof(void *));
  size_t before = live_in_class(200);
  pthread_t t;
  KT_REQUIRE(pthread_create(&t, NULL, alloc_thread, blocks) == 0);
  pthread_join(t, NULL);
  KT_EQ(live_in_class(200), before + 1000);
  for (int i = 0; i < 1000; i++) {
    KT_REQUIRE(blocks[i] != NULL);
    KT_EQ(ht_check(blocks[i], 0, 200, (uint32_t)i), SIZE_MAX);
    keel_free(blocks[i]);
  }
  KT_EQ(live_in_class(200), before);
  free(blocks);
}

/* Regression (a heap made after the thread's exit hook ran): a pthread-key
 * destructor created after keel's key, allocating in every destructor round
 * (re-setting its value to run again, as libraries do to run after the
 * others), ran after keel's exit hook; its malloc made a new thread heap and
 * re-armed the hook, which glibc's last round never runs: a heap and a
 * 64 KiB page leaked per thread (501 heaps active after 500 threads). Such
 * late allocations come from the shared heaps now: no heap outlives its
 * thread.
 *
 * TSan tears its thread state down in the last destructor round (its own
 * key's destructor re-arms itself until then), so instrumented code that
 * runs after it there crashes TSan: under TSan the destructor stops a round
 * earlier, which still allocates after keel's hook ran (and checks that
 * path for races) but no longer shows the leak; the other builds do. */
#if defined(KEEL_TSAN)
#define LATE_ROUNDS 3
#else
#define LATE_ROUNDS 8 /* past PTHREAD_DESTRUCTOR_ITERATIONS (4): every round */
#endif
static pthread_key_t late_key;

static void late_dtor(void *v) {
  long round = (long)v;
  void *p = keel_malloc(100); /* say, a log line formatted at thread exit */
  KT_CHECK(p != NULL);
  memset(p, 0x5a, 100);
  void *q = keel_realloc(p, 300);
  KT_CHECK(q != NULL);
  keel_free(q);
  if (round < LATE_ROUNDS) pthread_setspecific(late_key, (void *)(round + 1)); /* next round too */
}

static void *late_thread(void *arg) {
  (void)arg;
  keel_free(keel_malloc(32));
  pthread_setspecific(late_key, (void *)1L);
  return NULL;
}

static void late_destructor_malloc_keeps_no_heap(void) {
  enum { T = 40 };
  keel_free(keel_malloc(1)); /* keel's key exists before ours, so its hook runs first */
  KT_REQUIRE(pthread_key_create(&late_key, late_dtor) == 0);
  keel_heap_stats_t *st = malloc(sizeof(*st));
  keel_heap_stats(st);
  size_t threads0 = st->threads;
  for (int i = 0; i < T; i++) {
    pthread_t t;
    KT_REQUIRE(pthread_create(&t, NULL, late_thread, NULL) == 0);
    pthread_join(t, NULL); /* after the thread's key destructors ran */
  }
  keel_heap_stats(st);
  KT_EQ(st->threads, threads0);
  pthread_key_delete(late_key);
  free(st);
}

/* ---- realloc -------------------------------------------------------- */

/* Reallocs one block through `sizes`, checking after each step that the
 * bytes both sizes share survived and refilling the new tail. */
static void realloc_walk(const size_t *sizes, size_t n, uint32_t seed) {
  uint8_t *p = keel_malloc(sizes[0]);
  KT_REQUIRE(p != NULL);
  ht_fill(p, 0, sizes[0], seed);
  size_t cur = sizes[0];
  for (size_t i = 1; i < n; i++) {
    uint8_t *q = keel_realloc(p, sizes[i]);
    if (q == NULL) {
      kt_fail(__FILE__, __LINE__, "realloc(%zu -> %zu) failed", cur, sizes[i]);
      keel_free(p);
      return;
    }
    size_t keep = cur < sizes[i] ? cur : sizes[i];
    size_t bad = ht_check(q, 0, keep, seed);
    if (bad != SIZE_MAX) {
      kt_fail(__FILE__, __LINE__, "realloc(%zu -> %zu): byte %zu lost", cur, sizes[i], bad);
      keel_free(q);
      return;
    }
    if (keel_usable_size(q) < sizes[i])
      kt_fail(__FILE__, __LINE__, "realloc(%zu -> %zu): usable %zu", cur, sizes[i],
              keel_usable_size(q));
    ht_fill(q, keep, sizes[i], seed);
    p = q;
    cur = sizes[i];
  }
  keel_free(p);
}

static void realloc_across_classes_preserves_contents(void) {
  load_classes();
  size_t *sizes = calloc(4 * n_classes + 8, sizeof(size_t));
  size_t n = 0;
  /* Up through every class boundary (last request of a class, first of the
   * next), into large, then back down the same way. */
  sizes[n++] = 1;
  for (size_t i = 0; i < n_classes; i++) {
    sizes[n++] = classes[i].size;
    sizes[n++] = classes[i].size + 1;
  }
  size_t up = n;
  for (size_t i = up; i-- > 0;) sizes[n++] = sizes[i];
  realloc_walk(sizes, n, 1);
  /* Shrinking by one byte at a time across a few boundaries stays correct. */
  size_t down[64];
  for (size_t i = 0; i < 64; i++) down[i] = 1100 - i * 17;
  realloc_walk(down, 64, 2);
  free(sizes);
}

static void realloc_small_large_roundtrip(void) {
  size_t t = large_threshold();
  const size_t walk[] = {
      8, t + 1, 16, 3 * t, 100, 4108, 8 * MiB, t, t + 1, t - 1, 1, 20 * MiB, 64,
  };
  realloc_walk(walk, sizeof(walk) / sizeof(walk[0]), 3);
}

static void realloc_large_grow_shrink(void) {
  size_t top = kt_sanitized() ? 24 * MiB : 160 * MiB;
  size_t sizes[64], n = 0;
  for (size_t s = MiB + 5; s <= top && n < 32; s += s / 2) sizes[n++] = s;
  for (size_t i = n; i-- > 0 && n < 63;) sizes[n++] = sizes[i] - 4095;
  sizes[n++] = 200;
  realloc_walk(sizes, n, 4);
}

/* The end of the mapping that holds p (/proc/self/maps), or NULL. */
static uint8_t *mapping_end(const void *p) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (f == NULL) return NULL;
  unsigned long lo, hi;
  uint8_t *end = NULL;
  char line[512];
  while (end == NULL && fgets(line, sizeof line, f))
    if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && (uintptr_t)p >= lo && (uintptr_t)p < hi)
      end = (uint8_t *)(uintptr_t)hi;
  fclose(f);
  return end;
}

/* Growth of a large block where the address space after it is free stays in
 * place (mremap without a move, so no copy and the same address). The room
 * is made sure of first: a MAP_FIXED_NOREPLACE probe of the bytes the growth
 * needs, unmapped again at once. Another thread of the process could map
 * there in between, so a few tries are allowed. Large blocks are aligned to
 * 4 MiB, which leaves room after most of them. */
static void realloc_large_grows_in_place(void) {
  size_t old = 4 * MiB, grown = old + 3 * MiB;
  int tries = 0, in_place = 0, probed = 0;
  void *held[16]; /* blocks without room, kept so the next try gets another mapping */
  int nheld = 0;
  for (; tries < 16 && in_place == 0; tries++) {
    uint8_t *p = keel_malloc(old);
    KT_REQUIRE(p != NULL);
    ht_fill(p, 0, old, 9);
    uint8_t *end = mapping_end(p);
    KT_REQUIRE(end != NULL);
    if ((size_t)(end - p) >= grown) { /* a larger mapping from the cache: no growth to see */
      held[nheld++] = p;
      continue;
    }
    size_t room = grown - old + 4096; /* what the growth needs past the mapping, and a page */
    void *probe = mmap(end, room, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE | MAP_NORESERVE, -1, 0);
    if (probe != end) { /* taken (or an older kernel placed it elsewhere) */
      if (probe != MAP_FAILED) munmap(probe, room);
      held[nheld++] = p;
      continue;
    }
    munmap(probe, room);
    probed++;
    uint8_t *q = keel_realloc(p, grown);
    KT_REQUIRE(q != NULL);
    KT_EQ(ht_check(q, 0, old, 9), SIZE_MAX);
    in_place += q == p;
    keel_free(q);
  }
  for (int i = 0; i < nheld; i++) keel_free(held[i]);
  printf("  %d of %d tries found room after the block; %d grew in place\n", probed, tries,
         in_place);
  KT_CHECK(probed > 0); /* else nothing was checked */
  KT_EQ(in_place, 1);
}

/* Growth when something was mapped just after the block: the block must move
 * (or grow elsewhere) with its contents. */
static void realloc_large_grow_with_neighbour(void) {
  void *blockers[24];
  size_t nb = 0;
  uint8_t *p = keel_malloc(2 * MiB);
  KT_REQUIRE(p != NULL);
  ht_fill(p, 0, 2 * MiB, 5);
  size_t cur = 2 * MiB;
  for (int i = 0; i < 12; i++) {
    blockers[nb++] = keel_malloc(2 * MiB + 4096 * (size_t)i);
    size_t next = cur + MiB + 333;
    uint8_t *q = keel_realloc(p, next);
    KT_REQUIRE(q != NULL);
    size_t bad = ht_check(q, 0, cur, 5);
    if (bad != SIZE_MAX)
      kt_fail(__FILE__, __LINE__, "grow %zu -> %zu lost byte %zu", cur, next, bad);
    ht_fill(q, cur, next, 5);
    p = q;
    cur = next;
  }
  for (size_t i = 0; i < nb; i++) keel_free(blockers[i]);
  keel_free(p);
}

static void free_sized_matches(void) {
  uint64_t rng = 9;
  size_t before_live, before_large;
  keel_heap_stats_t *st = calloc(1, sizeof(*st));
  keel_heap_stats(st);
  before_live = st->live_bytes;
  before_large = st->large_live;
  for (int i = 0; i < 2000; i++) {
    size_t size = mixed_size(&rng);
    void *p = keel_malloc(size);
    KT_REQUIRE(p != NULL);
    keel_free_sized(p, size);
  }
  void *a = keel_aligned_alloc(4096, 5000);
  keel_free_sized(a, 5000);
  keel_heap_stats(st);
  KT_EQ(st->live_bytes, before_live);
  KT_EQ(st->large_live, before_large);
  free(st);
}

/* Debug builds check the size hint: one larger than the block aborts. */
#if defined(KEEL_DEBUG) && KEEL_DEBUG >= 1
static void free_sized_child(void *p) {
  keel_free_sized(p, keel_usable_size(p) + 1);
}
#endif

static void free_sized_too_large_aborts_in_debug(void) {
#if defined(KEEL_DEBUG) && KEEL_DEBUG >= 1
  void *p = keel_malloc(100);
  KT_EXPECT_ABORT(free_sized_child, p, "keel: free_sized: size ");
  keel_free(p);
#else
  printf("  (release build: the size hint is not checked)\n");
#endif
}

/* ---- stats ---------------------------------------------------------- */

static void stats_track_small_blocks(void) {
  load_classes();
  enum { N = 1000, SIZE = 100 };
  int c = keel_heap_class_of(SIZE);
  KT_REQUIRE(c >= 0);
  size_t csize = classes[c].size;
  keel_heap_stats_t *s0 = calloc(3, sizeof(*s0)), *s1 = s0 + 1, *s2 = s0 + 2;
  keel_heap_stats(s0);
  KT_EQ(s0->n_classes, n_classes);
  for (size_t i = 0; i < n_classes; i++) KT_EQ(s0->classes[i].size, classes[i].size);
  KT_CHECK(s0->threads >= 1);
  void **p = calloc(N, sizeof(void *));
  for (int i = 0; i < N; i++) p[i] = keel_malloc(SIZE);
  keel_heap_stats(s1);
  const keel_heap_class_stats_t *a = &s0->classes[c], *b = &s1->classes[c];
  KT_EQ(b->live - a->live, N);
  KT_EQ(b->allocs - a->allocs, N);
  KT_EQ(b->frees, a->frees);
  /* Requested bytes per class are an estimate (live x the class's mean
   * request since start: free is not told the size), so they are checked
   * against the class's bounds, not for the exact N * SIZE. */
  KT_CHECK(b->requested_bytes - a->requested_bytes >= N * classes[c].min_req);
  KT_CHECK(b->requested_bytes - a->requested_bytes <= N * csize);
  KT_EQ(b->usable_bytes - a->usable_bytes, N * csize);
  KT_EQ(s1->live_bytes - s0->live_bytes, N * csize);
  /* N blocks need at least N / per_page pages of this class. */
  KT_CHECK(b->pages >= (N + classes[c].per_page - 1) / classes[c].per_page);
  KT_CHECK(b->usable_bytes == b->live * csize);
  KT_CHECK(b->requested_bytes <= b->usable_bytes);
  KT_CHECK(s1->committed_bytes >= s1->live_bytes);
  KT_CHECK(s1->mapped_bytes >= s1->committed_bytes);
  for (int i = 0; i < N; i++) keel_free(p[i]);
  keel_heap_stats(s2);
  const keel_heap_class_stats_t *d = &s2->classes[c];
  KT_EQ(d->live, a->live);
  KT_EQ(d->frees - a->frees, N);
  KT_CHECK(d->requested_bytes >= d->live * classes[c].min_req);
  KT_CHECK(d->requested_bytes <= d->live * csize);
  KT_EQ(d->usable_bytes, a->usable_bytes);
  KT_EQ(s2->live_bytes, s0->live_bytes);
  /* Per-class sums match the totals (no large blocks are live here). */
  size_t live = 0, req = 0;
  for (size_t i = 0; i < s2->n_classes; i++) {
    live += s2->classes[i].usable_bytes;
    req += s2->classes[i].requested_bytes;
  }
  if (s2->large_live == 0) {
    KT_EQ(live, s2->live_bytes);
    KT_EQ(req, s2->requested_bytes);
  } else {
    KT_CHECK(live <= s2->live_bytes && req <= s2->requested_bytes);
  }
  KT_CHECK(s2->requested_bytes <= s2->live_bytes);
  free(p);
  free(s0);
}

/* Regression: the owner's fast-path frees were published to other threads'
 * keel_heap_stats only when the owner collected the page, so a thread whose
 * current page never ran dry showed every block it had ever allocated as
 * live (a churn loop: 5.9 million live for 32,768). Here a thread frees on
 * its fast path, keeps K blocks and waits; another thread's stats must show
 * exactly K more live blocks of the class. */
enum { OT_LOOPS = 100000, OT_KEEP = 7, OT_SIZE = 100 };
static sem_t ot_ready, ot_go;

static void *ot_thread(void *arg) {
  (void)arg;
  void *keep[OT_KEEP];
  for (int i = 0; i < OT_LOOPS; i++) keel_free(keel_malloc(OT_SIZE));
  for (int i = 0; i < OT_KEEP; i++) keep[i] = keel_malloc(OT_SIZE);
  sem_post(&ot_ready);
  sem_wait(&ot_go);
  for (int i = 0; i < OT_KEEP; i++) keel_free(keep[i]);
  return NULL;
}

static void stats_see_other_threads_frees(void) {
  int c = keel_heap_class_of(OT_SIZE);
  KT_REQUIRE(c >= 0);
  keel_heap_stats_t *s0 = calloc(2, sizeof(*s0)), *s1 = s0 + 1;
  sem_init(&ot_ready, 0, 0);
  sem_init(&ot_go, 0, 0);
  keel_heap_stats(s0);
  pthread_t t;
  KT_REQUIRE(pthread_create(&t, NULL, ot_thread, NULL) == 0);
  sem_wait(&ot_ready);
  keel_heap_stats(s1);
  const keel_heap_class_stats_t *a = &s0->classes[c], *b = &s1->classes[c];
  KT_EQ(b->live - a->live, OT_KEEP);
  KT_EQ(b->allocs - a->allocs, OT_LOOPS + OT_KEEP);
  KT_EQ(b->frees - a->frees, OT_LOOPS);
  sem_post(&ot_go);
  pthread_join(t, NULL);
  sem_destroy(&ot_ready);
  sem_destroy(&ot_go);
  free(s0);
}

/* Regression (found by review): keel_heap_stats read its static segment
 * totals after releasing the lock that guards them, so two concurrent
 * callers raced (TSan) and one could return the other's mapped, committed,
 * purged and abandoned figures. */
static void *sc_thread(void *arg) {
  keel_heap_stats_t *st = arg;
  for (int i = 0; i < 200; i++) keel_heap_stats(st);
  return NULL;
}

static void stats_concurrent_callers(void) {
  keel_heap_stats_t *st = calloc(2, sizeof(*st));
  pthread_t t;
  KT_REQUIRE(pthread_create(&t, NULL, sc_thread, st) == 0);
  sc_thread(st + 1);
  pthread_join(t, NULL);
  for (int i = 0; i < 2; i++) KT_CHECK(st[i].mapped_bytes >= st[i].committed_bytes);
  free(st);
}

static void stats_track_large_blocks(void) {
  const size_t size = 8 * MiB + 5;
  keel_heap_stats_t *s0 = calloc(3, sizeof(*s0)), *s1 = s0 + 1, *s2 = s0 + 2;
  keel_heap_stats(s0);
  void *p = keel_malloc(size);
  KT_REQUIRE(p != NULL);
  memset(p, 1, size);
  keel_heap_stats(s1);
  KT_EQ(s1->large_live - s0->large_live, 1);
  KT_CHECK(s1->large_bytes - s0->large_bytes >= size);
  KT_CHECK(s1->large_bytes - s0->large_bytes < size + 4 * MiB);
  KT_CHECK(s1->live_bytes - s0->live_bytes >= size);
  KT_EQ(s1->requested_bytes - s0->requested_bytes, size);
  /* A cached mapping may be reused, so mapped need not grow; it covers
   * every live large block either way. */
  KT_CHECK(s1->mapped_bytes >= s1->large_bytes);
  KT_CHECK(s1->committed_bytes >= s1->live_bytes);
  keel_free(p);
  keel_heap_stats(s2);
  KT_EQ(s2->large_live, s0->large_live);
  KT_EQ(s2->large_bytes, s0->large_bytes);
  KT_EQ(s2->live_bytes, s0->live_bytes);
  KT_EQ(s2->requested_bytes, s0->requested_bytes);
  free(s0);
}

/* Regression (live_bytes counted large blocks as mapped): live_bytes is
 * "usable bytes of live blocks", yet for a large block it added the whole
 * mapping, header page and alignment gap included (2 MiB-aligned 300 KiB:
 * 2,404,352 bytes where keel_usable_size says 307,200). Now each large
 * block adds its usable size; large_bytes stays the mapped size. */
static void stats_large_live_bytes_are_usable(void) {
  keel_heap_stats_t *s0 = calloc(2, sizeof(*s0)), *s1 = s0 + 1;
  enum { N = 4 };
  const struct {
    size_t align, size;
  } cases[N] = {
      {0, 8 * MiB + 5},                  /* plain: the header page only */
      {2 * MiB, 300 * KiB},              /* aligned in a segment: a 2 MiB gap */
      {8 * MiB, 100},                    /* aligned above half a segment: its own list */
      {64 * KiB, large_threshold() + 1}, /* aligned, just above the classes */
  };
  void *p[N];
  size_t usable = 0;
  keel_heap_stats(s0);
  for (size_t i = 0; i < N; i++) {
    p[i] = cases[i].align == 0 ? keel_malloc(cases[i].size)
                               : keel_aligned_alloc(cases[i].align, cases[i].size);
    KT_REQUIRE(p[i] != NULL);
    KT_CHECK(keel_usable_size(p[i]) >= cases[i].size);
    usable += keel_usable_size(p[i]);
    keel_heap_stats(s1);
    KT_EQ(s1->live_bytes - s0->live_bytes, usable);
  }
  KT_EQ(s1->large_live - s0->large_live, N);
  KT_CHECK(s1->large_bytes - s0->large_bytes > usable + 2 * MiB); /* mapped: gaps included */
  KT_CHECK(s1->requested_bytes <= s1->live_bytes);
  for (size_t i = 0; i < N; i++) keel_free(p[i]);
  keel_heap_stats(s1);
  KT_EQ(s1->live_bytes, s0->live_bytes);
  KT_EQ(s1->large_bytes, s0->large_bytes);
  free(s0);
}

static void print_stats_lists_classes_in_use(void) {
  load_classes();
  enum { N = 777 };
  const size_t SIZE = 3000;
  int c = keel_heap_class_of(SIZE);
  KT_REQUIRE(c >= 0);
  void **p = calloc(N, sizeof(void *));
  for (int i = 0; i < N; i++) p[i] = keel_malloc(SIZE);
  FILE *f = tmpfile();
  KT_REQUIRE(f != NULL);
  keel_heap_print_stats(f);
  long len = ftell(f);
  KT_CHECK(len > 0);
  rewind(f);
  char *text = calloc(1, (size_t)len + 1);
  KT_EQ(fread(text, 1, (size_t)len, f), len);
  fclose(f);
  /* The row of the class in use names its size and its live count. */
  char size_s[32], live_s[32];
  snprintf(size_s, sizeof(size_s), "%zu", classes[c].size);
  snprintf(live_s, sizeof(live_s), "%d", N);
  KT_CONTAINS(text, size_s);
  KT_CONTAINS(text, live_s);
  for (int i = 0; i < N; i++) keel_free(p[i]);
  free(text);
  free(p);
}

/* ---- returning memory ----------------------------------------------- */

/* Fills `total` bytes of `size`-byte blocks, frees them, collects, and checks
 * RSS fell by most of it. Sanitizer shadow memory for the range stays
 * resident, so only the fall is checked there, not the end level. */
static void check_collect_returns(size_t size, size_t total, bool force) {
  size_t n = total / size;
  void **p = calloc(n, sizeof(void *));
  KT_REQUIRE(p != NULL);
  keel_heap_collect(true);
  size_t rss0 = kt_rss_kb();
  for (size_t i = 0; i < n; i++) {
    p[i] = keel_malloc(size);
    KT_REQUIRE(p[i] != NULL);
    memset(p[i], 0x3C, size);
  }
  size_t rss1 = kt_rss_kb();
  KT_CHECK(rss1 >= rss0 + total / KiB * 3 / 4);
  for (size_t i = 0; i < n; i++) keel_free(p[i]);
  if (!force) {
    int64_t ms = 1000;
    keel_option_get("heap_purge_ms", &ms);
    usleep((useconds_t)(ms + ms / 2 + 50) * 1000);
  }
  keel_heap_collect(force);
  size_t rss2 = kt_rss_kb();
  size_t fell = rss1 > rss2 ? rss1 - rss2 : 0;
  if (fell < total / KiB * 3 / 4)
    kt_fail(__FILE__, __LINE__,
            "%zu x %zu bytes: RSS %zu KiB -> %zu KiB full -> %zu KiB after free+collect(%d)", n,
            size, rss0, rss1, rss2, force);
  if (!kt_sanitized() && rss2 > rss0 + 8 * KiB)
    kt_fail(__FILE__, __LINE__, "RSS %zu KiB after, %zu KiB before", rss2, rss0);
  free(p);
}

static void collect_returns_rss_small(void) {
  check_collect_returns(1000, 64 * MiB, true);
  check_collect_returns(48, 32 * MiB, true);
}

static void collect_returns_rss_large(void) {
  check_collect_returns(64 * MiB, 64 * MiB, true);
  check_collect_returns(6 * MiB, 60 * MiB, true);
}

static void purge_after_delay(void) {
  int64_t ms = 1000;
  keel_option_get("heap_purge_ms", &ms);
  if (ms > 3000) {
    printf("  (purge_after_delay: heap_purge_ms=%lld is too long to wait for; skipped)\n",
           (long long)ms);
    return;
  }
  check_collect_returns(2000, 32 * MiB, false);
}

/* ---- bad input ------------------------------------------------------ */

static void free_ptr_child(void *p) {
  keel_free(p);
}

static void realloc_ptr_child(void *p) {
  void *q = keel_realloc(p, 256);
  (void)q;
}

static void free_twice_child(void *p) {
  void *again = ht_launder(p);
  keel_free(p);
  keel_free(again);
}

/* kt_expect_abort for "keel: CALL: invalid pointer %p" through `child`: the
 * message names the call that was made. */
static void expect_invalid(void (*child)(void *), void *p, const char *call) {
  char expect[96];
  snprintf(expect, sizeof(expect), "keel: %s: invalid pointer %p", call, p);
  KT_EXPECT_ABORT(child, p, expect);
}

static void bad_free_stack_address(void) {
  char buf[64];
  memset(buf, 0, sizeof(buf));
  expect_invalid(free_ptr_child, ht_launder(buf), "free");
  expect_invalid(free_ptr_child, ht_launder(buf + 16), "free");
}

static void bad_free_interior_pointer(void) {
  const size_t sizes[] = {64, 4108, 100 * KiB, 8 * MiB};
  const size_t offs[] = {8, 16, 4096};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    uint8_t *p = keel_malloc(sizes[i]);
    KT_REQUIRE(p != NULL);
    for (size_t j = 0; j < sizeof(offs) / sizeof(offs[0]); j++)
      if (offs[j] < sizes[i]) expect_invalid(free_ptr_child, p + offs[j], "free");
    keel_free(p);
  }
}

static void bad_free_foreign_mmap(void) {
  size_t len = 4 * MiB;
  uint8_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  KT_REQUIRE(m != MAP_FAILED);
  memset(m, 0, 4096);
  expect_invalid(free_ptr_child, m, "free");
  expect_invalid(free_ptr_child, m + 64, "free");
  expect_invalid(free_ptr_child, m + 2 * MiB, "free");
  munmap(m, len);
}

static void bad_realloc_invalid_pointer(void) {
  char buf[64];
  memset(buf, 0, sizeof(buf));
  expect_invalid(realloc_ptr_child, ht_launder(buf), "realloc");
  uint8_t *p = keel_malloc(4108);
  KT_REQUIRE(p != NULL);
  expect_invalid(realloc_ptr_child, p + 16, "realloc");
  keel_free(p);
  uint8_t *m = mmap(NULL, MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  KT_REQUIRE(m != MAP_FAILED);
  expect_invalid(realloc_ptr_child, m, "realloc");
  munmap(m, MiB);
}

static void double_free_small(void) {
  load_classes();
  /* Every class small enough to share a page; a neighbour keeps the page
   * alive so the freed block is still on the page's free list. */
  for (size_t i = 0; i < n_classes; i++) {
    if (classes[i].per_page < 2) continue;
    void *keep = keel_malloc(classes[i].size);
    void *p = keel_malloc(classes[i].size);
    KT_REQUIRE(keep != NULL && p != NULL);
    char expect[64];
    snprintf(expect, sizeof(expect), "keel: free: double free of %p", p);
    KT_EXPECT_ABORT(free_twice_child, p, expect);
    keel_free(p);
    keel_free(keep);
  }
}

/* A free block's link overwritten (a write after free, or an overflow out
 * of the block before it in the page) must make the malloc that meets it
 * die naming the block, not hand out a wild pointer or fault. Blocks a and
 * b are neighbours: b is freed, then a overflows into b by one word. */
static void overflow_into_free_child(void *arg) {
  const char *data = arg;
  uint8_t *v[256], *a = NULL, *b = NULL;
  for (int i = 0; i < 256 && b == NULL; i++) {
    v[i] = keel_malloc(64);
    for (int j = 0; j < i && b == NULL; j++) {
      if (v[j] + 64 == v[i]) a = v[j], b = v[i];
      if (v[i] + 64 == v[j]) a = v[i], b = v[j];
    }
  }
  if (b == NULL) _exit(3); /* no neighbours: the test cannot run */
  keel_free(b);
  memcpy(a + 64, data, 8); /* the overflow */
  for (int i = 0; i < 8; i++) ht_launder(keel_malloc(64));
}

static void write_after_free_child(void *arg) {
  (void)arg;
  uint64_t *p = keel_malloc(200);
  keel_free(p);
  p[0] = 12345; /* the first word of a freed block: its link */
  for (int i = 0; i < 8; i++) ht_launder(keel_malloc(200));
}

static void overwritten_link_is_named(void) {
  static const char *const words[] = {"ABCDEFGH", "\x01\x00\x00\x00\x00\x00\x00\x00",
                                      "\xff\xff\xff\xff\xff\xff\xff\xff"};
  for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++)
    KT_EXPECT_ABORT(overflow_into_free_child, (void *)words[i],
                    "keel: malloc: free-list link of 0x");
  KT_EXPECT_ABORT(write_after_free_child, NULL, "keel: malloc: free-list link of 0x");
}

/* Double frees where one free or both come from a thread that does not own
 * the block: the first free puts it on a list of its page (the owner's
 * local free list, or the page's remote list until the owner collects it),
 * which is the detection bound. Regression test for a bug it
 * found: the remote free path pushed without any check, so "owner, remote",
 * "remote, owner" and "remote, remote" went undetected; the block sat twice
 * on the page's lists and a later malloc from that page died of SIGSEGV in
 * the fast path instead of keel_die naming the double free. */
static void *free_in_thread(void *p) {
  keel_free(p);
  return NULL;
}

static void free_by_thread(void *p) {
  pthread_t t;
  if (pthread_create(&t, NULL, free_in_thread, p) == 0) pthread_join(t, NULL);
}

static void remote_then_remote_child(void *p) {
  free_by_thread(p);
  free_by_thread(ht_launder(p));
}

static void remote_then_owner_child(void *p) {
  free_by_thread(p);
  keel_free(ht_launder(p));
}

static void owner_then_remote_child(void *p) {
  keel_free(p);
  free_by_thread(ht_launder(p));
}

static void double_free_across_threads(void) {
  void (*children[])(void *) = {remote_then_remote_child, remote_then_owner_child,
                                owner_then_remote_child};
  const char *names[] = {"remote, remote", "remote, owner", "owner, remote"};
  const size_t sizes[] = {64, 20000}; /* a thread-local class, a shared one */
  for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++)
    for (size_t i = 0; i < sizeof(children) / sizeof(children[0]); i++) {
      void *keep = keel_malloc(sizes[s]);
      void *p = keel_malloc(sizes[s]);
      char expect[64], out[4096];
      snprintf(expect, sizeof(expect), "keel: free: double free of %p", p);
      if (!kt_expect_abort(__FILE__, __LINE__, children[i], p, expect, out, sizeof(out)))
        printf("  (double free of a %zu-byte block, %s: not detected)\n", sizes[s], names[i]);
      keel_free(p);
      keel_free(keep);
    }
}

/* The same through a full page: a remote free of a block of a page the
 * owner filled goes to the owner heap's delayed list, not to the page, and
 * its link there is a plain pointer to the previous delayed block (or
 * NULL), not a link of its page. The second free must still be named: by
 * the owner's free at once, by another thread's at the owner's next drain
 * (the bound for that case). */
static void **full_blocks;
static size_t full_n;

static void fill_page_of(size_t size, void *p) {
  /* Allocate until the owner has taken a fresh page: p's page is full then. */
  full_n = 0;
  for (int i = 0; i < 4096; i++) {
    void *q = keel_malloc(size);
    full_blocks[full_n++] = q;
    if (((uintptr_t)q ^ (uintptr_t)p) >= 65536 && i > 64) break; /* well into another page */
  }
}

static void delayed_remote_remote_child(void *p) {
  free_by_thread(p);
  free_by_thread(ht_launder(p));
  /* Neither freer can see the owner's delayed list: the owner's next drain
   * (its malloc slow path, when a page runs out) finds the block's link
   * rewritten. */
  for (int i = 0; i < 20000; i++) ht_launder(keel_malloc(64));
}

static void delayed_remote_owner_child(void *p) {
  free_by_thread(p);
  keel_free(ht_launder(p));
}

static void delayed_remote_owner_malloc_child(void *p) {
  free_by_thread(p);
  /* The owner's slow path drains the delayed list before it frees again. */
  for (int i = 0; i < 10000; i++) keel_free(keel_malloc(64));
  keel_free(ht_launder(p));
}

/* Regression (audit of issue 4): a large block that went straight back to
 * the OS (too big for the cache), or a huge one (aligned past 2 MiB), is
 * unmapped by its free, and a second free was called an invalid pointer. */
static void free_twice_child_any(void *p) {
  keel_free(p);
  keel_free(ht_launder(p));
}

static void double_free_unmapped_large(void) {
  void *p = keel_malloc((size_t)600 << 20); /* past the large cache's limit */
  KT_REQUIRE(p != NULL);
  char expect[64];
  snprintf(expect, sizeof(expect), "keel: free: double free of %p", p);
  KT_EXPECT_ABORT(free_twice_child_any, p, expect);
  keel_free(p);
  p = keel_aligned_alloc((size_t)4 << 20, 100);
  KT_REQUIRE(p != NULL);
  snprintf(expect, sizeof(expect), "keel: free: double free of %p", p);
  KT_EXPECT_ABORT(free_twice_child_any, p, expect);
  keel_free(p);
}

static void double_free_through_delayed_list(void) {
  void (*children[])(void *) = {delayed_remote_remote_child, delayed_remote_owner_child,
                                delayed_remote_owner_malloc_child};
  full_blocks = keel_malloc(4096 * sizeof(void *));
  KT_REQUIRE(full_blocks != NULL);
  for (size_t i = 0; i < sizeof(children) / sizeof(children[0]); i++) {
    void *p = keel_malloc(64);
    KT_REQUIRE(p != NULL);
    fill_page_of(64, p);
    char expect[64];
    snprintf(expect, sizeof(expect), "keel: free: double free of %p", p);
    KT_EXPECT_ABORT(children[i], p, expect);
    keel_free(p);
    for (size_t j = 0; j < full_n; j++) keel_free(full_blocks[j]);
  }
  keel_free(full_blocks);
}

/* Regression (found by review): realloc by the owner of a block another
 * thread freed while its page was full (so the free waits on the owner's
 * delayed list, linked by a plain pointer). realloc's check for a freed
 * block did not drain that list, as free does, and a shrink that stays in
 * place returned the freed block live; the owner's next drain put it back
 * on its page's free list, to be handed out a second time. */
static void delayed_remote_then_realloc_child(void *p) {
  free_by_thread(p);
  void *q = keel_realloc(ht_launder(p), 60); /* 64-byte block: stays in place */
  (void)q;
}

static void realloc_of_block_on_delayed_list_aborts(void) {
  full_blocks = keel_malloc(4096 * sizeof(void *));
  KT_REQUIRE(full_blocks != NULL);
  void *p = keel_malloc(64);
  KT_REQUIRE(p != NULL);
  fill_page_of(64, p);
  char expect[64];
  snprintf(expect, sizeof(expect), "keel: realloc: double free of %p", p);
  KT_EXPECT_ABORT(delayed_remote_then_realloc_child, p, expect);
  keel_free(p);
  for (size_t j = 0; j < full_n; j++) keel_free(full_blocks[j]);
  keel_free(full_blocks);
}

/* A 100 KB block's span is retired once freed; a new small page then starts
 * at its first slice, and the slice map sends the stale pointer's slice to
 * that page, where it is a multiple of the block size but past the page's
 * span. Its second free used to be accepted and the block handed out again. */
static void stale_span_free_child(void *arg) {
  (void)arg;
  static const size_t sizes[] = {8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120};
  void *keep[sizeof(sizes) / sizeof(sizes[0])];
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) keep[i] = keel_malloc(sizes[i]);
  char *p1 = keel_malloc(100000), *p2 = keel_malloc(100000);
  keel_free(p1);
  keel_free(p2);
  keel_heap_collect(true);
  void *s = keel_malloc(128); /* a class not used yet: a new page */
  (void)s;
  (void)keep;
  keel_free(ht_launder(p2));
}

static void double_free_stale_span(void) {
  KT_EXPECT_ABORT(stale_span_free_child, NULL, "keel: free: ");
}

static void *realloc_in_thread(void *p) {
  return keel_realloc(p, 40);
}

/* realloc of a block its owner has freed, from another thread: the in-place
 * path returned it live while it was still on the owner's free list. */
static void realloc_freed_from_other_thread_child(void *arg) {
  (void)arg;
  void *p = keel_malloc(48);
  keel_free(p);
  pthread_t t;
  if (pthread_create(&t, NULL, realloc_in_thread, ht_launder(p)) != 0) return;
  pthread_join(t, NULL);
}

static void realloc_freed_from_other_thread_aborts(void) {
  KT_EXPECT_ABORT(realloc_freed_from_other_thread_child, NULL, "keel: realloc: double free of");
}

/* Size 0 with an alignment of 256 KiB or more is a real block: it used to
 * point one past its own mapping (usable size "invalid pointer"). */
static void aligned_alloc_size_zero(void) {
  for (size_t align = 256 * KiB; align <= 16 * MiB; align *= 2) {
    void *p = keel_aligned_alloc(align, 0);
    KT_REQUIRE(p != NULL);
    KT_EQ((uintptr_t)p % align, 0);
    KT_CHECK(keel_usable_size(p) >= 1);
    void *q = keel_realloc(p, 10);
    KT_REQUIRE(q != NULL);
    keel_free(q);
  }
}

static void double_free_large(void) {
  void *p = keel_malloc(8 * MiB);
  KT_REQUIRE(p != NULL);
  /* Either message is right for a block already unmapped or cached; what
   * matters is the abort before anything is corrupted. */
  KT_EXPECT_ABORT(free_twice_child, p, "keel: free: ");
  keel_free(p);
}

static void realloc_after_free_child(void *p) {
  keel_free(p);
  void *q = keel_realloc(ht_launder(p), 1000);
  (void)q;
}

/* Regression test for a bug it found: keel_realloc of a freed block that
 * would stay in place (new size between half the block and the block)
 * returned the freed block unchecked, live for the caller and on the page's
 * free list at once (first for every class, then for the shared-heap classes
 * above 8 KiB); and a realloc that moved copied from the freed block before
 * the free found the double free (ASan reported that read first). */
static void realloc_in_place_child(void *p) {
  size_t size = keel_usable_size(p) - 8; /* stays in place: above half the block */
  keel_free(p);
  void *q = keel_realloc(ht_launder(p), size);
  (void)q;
}

static void realloc_in_place_of_freed_block_aborts(void) {
  /* Thread-local classes, and classes above 8 KiB (shared heaps). */
  const size_t sizes[] = {200, 4108, 20000, 100 * KiB};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    void *keep = keel_malloc(sizes[i]);
    void *p = keel_malloc(sizes[i]);
    char expect[64];
    snprintf(expect, sizeof(expect), "double free of %p", p);
    char out[4096];
    if (!kt_expect_abort(__FILE__, __LINE__, realloc_in_place_child, p, expect, out, sizeof(out)))
      printf("  (realloc of a freed %zu-byte block: not detected)\n", sizes[i]);
    keel_free(p);
    keel_free(keep);
  }
}

static void realloc_after_free_aborts(void) {
  void *keep = keel_malloc(200);
  void *p = keel_malloc(200);
  char expect[64];
  snprintf(expect, sizeof(expect), "double free of %p", p);
  KT_EXPECT_ABORT(realloc_after_free_child, p, expect);
  keel_free(p);
  keel_free(keep);
}

KT_MAIN(KT_CASE(malloc_zero_unique), KT_CASE(free_null), KT_CASE(malloc_alignment_as_documented),
        KT_CASE(malloc_16_aligned_from_16_bytes), KT_CASE(realloc_null_allocates),
        KT_CASE(realloc_zero_frees), KT_CASE(realloc_zero_then_free_is_double_free),
        KT_CASE(calloc_zeroes), KT_CASE(calloc_overflow_enomem), KT_CASE(malloc_huge_enomem),
        KT_CASE(realloc_huge_enomem_keeps_block), KT_CASE(aligned_alloc_bad_alignment_einval),
        KT_CASE(usable_size_covers_request), KT_CASE(classes_table_consistent),
        KT_CASE(class_4108_costs_under_1_15x), KT_CASE(alignment_every_class_up_to_1mib),
        KT_CASE(alignment_large), KT_CASE(aligned_alloc_above_2mib_alignment),
        KT_CASE(blocks_do_not_overlap), KT_CASE(cross_thread_free),
        KT_CASE(late_destructor_malloc_keeps_no_heap),
        KT_CASE(realloc_across_classes_preserves_contents), KT_CASE(realloc_small_large_roundtrip),
        KT_CASE(realloc_large_grow_shrink), KT_CASE(realloc_large_grows_in_place),
        KT_CASE(realloc_large_grow_with_neighbour), KT_CASE(free_sized_matches),
        KT_CASE(free_sized_too_large_aborts_in_debug), KT_CASE(stats_track_small_blocks),
        KT_CASE(stats_see_other_threads_frees), KT_CASE(stats_concurrent_callers),
        KT_CASE(stats_track_large_blocks), KT_CASE(stats_large_live_bytes_are_usable),
        KT_CASE(print_stats_lists_classes_in_use), KT_CASE(collect_returns_rss_small),
        KT_CASE(collect_returns_rss_large), KT_CASE(purge_after_delay),
        KT_CASE(bad_free_stack_address), KT_CASE(bad_free_interior_pointer),
        KT_CASE(bad_free_foreign_mmap), KT_CASE(bad_realloc_invalid_pointer),
        KT_CASE(double_free_small), KT_CASE(overwritten_link_is_named),
        KT_CASE(double_free_across_threads), KT_CASE(double_free_unmapped_large),
        KT_CASE(double_free_through_delayed_list), KT_CASE(realloc_of_block_on_delayed_list_aborts),
        KT_CASE(double_free_large), KT_CASE(double_free_stale_span),
        KT_CASE(aligned_alloc_size_zero), KT_CASE(realloc_freed_from_other_thread_aborts),
        KT_CASE(realloc_after_free_aborts), KT_CASE(realloc_in_place_of_freed_block_aborts))
