/* Tests of src/pool: the hot/cold/sweep state machine, hooks, alignment,
 * stats and reclaim, thread exit, the sweeper on a short period, and every
 * bad-input behaviour of issue 5 (each in a forked child where it aborts).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <keel/heap.h>
#include <keel/pool.h>
#if defined(KEEL_POOL_INLINE) && !defined(keel_pool_alloc)
#error "KEEL_POOL_INLINE did not select the inline fast paths"
#endif

#include "base/options.h"
#include "base/os.h"
#include "harness.h"
#include "heap/internal.h"
#include "heap/shared.h"
#include "oom.h"
#include "pool/pool_impl.h"

#if defined(KEEL_ASAN)
#include <sanitizer/asan_interface.h>
#endif

static keel_pool_stats_t stats(keel_pool_t *p) {
  keel_pool_stats_t st;
  keel_pool_stats(p, &st);
  return st;
}

/* The sweeper must not run during the deterministic cases: a day-long
 * period, applied at once with a kick. */
static void sweeper_quiet(void) {
  _keel_option_set(KEEL_OPT_pool_sweep_s, 86400000);
  _keel_pool_sweeper_kick();
}

static void state_machine(void) {
  sweeper_quiet();
  keel_pool_t *p = keel_pool_create("sm", 100, 0, NULL);
  KT_REQUIRE(p != NULL);
  void *o[8];
  for (int i = 0; i < 8; i++) KT_REQUIRE((o[i] = keel_pool_alloc(p)) != NULL);
  keel_pool_stats_t st = stats(p);
  KT_EQ(st.heap_allocs, 8);
  KT_EQ(st.live, 8);
  KT_EQ(st.cached, 0);
  for (int i = 0; i < 8; i++) keel_pool_free(p, o[i]);
  st = stats(p);
  KT_EQ(st.live, 0);
  KT_EQ(st.cached, 8);
  KT_EQ(st.cached_bytes, 8 * st.block_bytes);
  /* Hot hits, LIFO: the last freed comes back first. */
  void *a = keel_pool_alloc(p);
  KT_CHECK(a == o[7]);
  keel_pool_free(p, a);
  for (int i = 0; i < 8; i++) o[i] = keel_pool_alloc(p);
  st = stats(p);
  KT_EQ(st.hot_hits, 9);
  KT_EQ(st.heap_allocs, 8);
  for (int i = 0; i < 8; i++) keel_pool_free(p, o[i]);
  /* Sweep 1: hot turns cold, nothing freed. */
  KT_EQ(keel_pool_sweep(p), 0);
  st = stats(p);
  KT_EQ(st.sweeps, 1);
  KT_EQ(st.cached, 8);
  KT_EQ(st.heap_frees, 0);
  /* The hot list is empty: the next allocation is a cold hit. */
  a = keel_pool_alloc(p);
  KT_EQ(stats(p).cold_hits, 1);
  keel_pool_free(p, a); /* hot: 1, cold: 7 */
  /* Sweep 2: the 7 cold go to the heap, the 1 hot turns cold. */
  keel_pool_sweep(p);
  st = stats(p);
  KT_EQ(st.heap_frees, 7);
  KT_EQ(st.cached, 1);
  /* Sweep 3: empty. */
  keel_pool_sweep(p);
  st = stats(p);
  KT_EQ(st.heap_frees, 8);
  KT_EQ(st.cached, 0);
  KT_EQ(st.cached_bytes, 0);
  KT_EQ(st.sweeps, 3);
  /* With both lists empty the heap is called again. */
  a = keel_pool_alloc(p);
  KT_EQ(stats(p).heap_allocs, 9);
  keel_pool_free(p, a);
  st = stats(p);
  KT_EQ(st.allocs, st.hot_hits + st.cold_hits + st.heap_allocs);
  KT_EQ(keel_pool_destroy(p), 0);
}

/* A pool whose n objects sit on this thread's hot list, swept once while
 * the thread was "mid-call" (busy set by hand): the sweep's request is left
 * pending on the sub-pool, returned in *spp. */
static keel_pool_t *pool_with_pending_sweep(const char *name, int n, pool_sub_t **spp) {
  keel_pool_t *p = keel_pool_create(name, 64, 0, NULL);
  KT_REQUIRE(p != NULL);
  void *o[16];
  KT_REQUIRE(n <= 16);
  for (int i = 0; i < n; i++) o[i] = keel_pool_alloc(p);
  for (int i = 0; i < n; i++) keel_pool_free(p, o[i]); /* hot: n */
  pool_sub_t *sp = pool_sub_get(p);
  KT_REQUIRE(sp != NULL);
  keel_store_relaxed(&sp->f.busy, 1); /* as if this thread were mid-call */
  KT_EQ(keel_pool_sweep(p), 0);
  *spp = sp;
  return p;
}

/* The hand-off: a sweep that finds the owner inside a call leaves the
 * request, and the owner's next call carries it out. */
static void owner_services_pending_sweep(void) {
  sweeper_quiet();
  pool_sub_t *sp;
  keel_pool_t *p = pool_with_pending_sweep("handoff", 4, &sp);
  KT_EQ(keel_load_relaxed(&sp->f.req), POOL_REQ_SWEEP);
  KT_EQ(stats(p).heap_frees, 0);
  keel_store_relaxed(&sp->f.busy, 0);
  /* The next alloc sees the request: hot turns cold under the lock, then
   * the object comes from the cold list. */
  void *a = keel_pool_alloc(p); /* hot: 0, cold: 3 */
  KT_EQ(keel_load_relaxed(&sp->f.req), POOL_REQ_NONE);
  KT_EQ(stats(p).cold_hits, 1);
  keel_store_relaxed(&sp->f.busy, 1);
  keel_pool_sweep(p);
  keel_store_relaxed(&sp->f.busy, 0);
  KT_EQ(keel_load_relaxed(&sp->f.req), POOL_REQ_SWEEP);
  /* This time a free carries it out: the 3 cold go to the heap. */
  keel_pool_free(p, a);
  KT_EQ(keel_load_relaxed(&sp->f.req), POOL_REQ_NONE);
  keel_pool_stats_t st = stats(p);
  KT_EQ(st.heap_frees, 3);
  KT_EQ(st.cached, 1);
  KT_EQ(st.sweeps, 2);
  KT_EQ(keel_pool_destroy(p), 0);
}

/* keel_pool_reclaim stops once it has freed enough, withdrawing its own
 * requests but not a sweep an earlier pass left for a busy owner. */
static void reclaim_keeps_pending_sweep(void) {
  sweeper_quiet();
  keel_pool_t *a = keel_pool_create("reclaim-first", 64, 0, NULL);
  keel_pool_free(a, keel_pool_alloc(a));
  pool_sub_t *sb;
  keel_pool_t *b = pool_with_pending_sweep("reclaim-busy", 1, &sb); /* after a on the list */
  KT_EQ(keel_load_relaxed(&sb->f.req), POOL_REQ_SWEEP);
  KT_EQ(keel_pool_reclaim(1), stats(a).block_bytes); /* a's object satisfies the goal */
  KT_EQ(keel_load_relaxed(&sb->f.req), POOL_REQ_SWEEP);
  keel_store_relaxed(&sb->f.busy, 0);
  keel_pool_free(b, keel_pool_alloc(b)); /* the owner does the sweep: hot turns cold */
  KT_EQ(keel_load_relaxed(&sb->f.req), POOL_REQ_NONE);
  KT_EQ(stats(b).cold_hits, 1);
  KT_EQ(keel_pool_destroy(a), 0);
  KT_EQ(keel_pool_destroy(b), 0);
}

static int init_calls, fini_calls;
static void obj_init(void *o, void *arg) {
  KT_CHECK(arg == &init_calls);
  KT_EQ(((unsigned char *)o)[0], 0); /* zalloc: init sees the zeroed object */
  ((unsigned char *)o)[1] = 0x5a;
  init_calls++;
}
static void obj_fini(void *o, void *arg) {
  KT_CHECK(arg == &init_calls);
  KT_EQ(((unsigned char *)o)[1], 0x5a);
  fini_calls++;
}

static void hooks_and_zalloc(void) {
  keel_pool_ops_t ops = {obj_init, obj_fini, &init_calls};
  keel_pool_t *p = keel_pool_create("hooked", 48, 0, &ops);
  KT_REQUIRE(p != NULL);
  for (int round = 0; round < 3; round++) {
    unsigned char *o = keel_pool_zalloc(p);
    KT_REQUIRE(o != NULL);
    KT_EQ(o[1], 0x5a);
    for (int i = 2; i < 48; i++) KT_EQ(o[i], 0);
    memset(o, 0xff, 48);
    o[1] = 0x5a;
    keel_pool_free(p, o);
  }
  KT_EQ(init_calls, 3);
  KT_EQ(fini_calls, 3);
  /* zalloc zeroes a reused object on the plain fast path too. */
  keel_pool_t *q = keel_pool_create("plain", 200, 0, NULL);
  unsigned char *o = keel_pool_alloc(q);
  memset(o, 0xaa, 200);
  keel_pool_free(q, o);
  o = keel_pool_zalloc(q);
  for (int i = 0; i < 200; i++) KT_EQ(o[i], 0);
  keel_pool_free(q, o);
  KT_EQ(keel_pool_destroy(p), 0);
  KT_EQ(keel_pool_destroy(q), 0);
}

static void alignment(void) {
  static const size_t aligns[] = {0, 1, 8, 16, 32, 64, 256, 4096};
  for (size_t i = 0; i < KEEL_ARRAY_SIZE(aligns); i++) {
    size_t al = aligns[i] ? aligns[i] : 16;
    keel_pool_t *p = keel_pool_create("aligned", 24, aligns[i], NULL);
    KT_REQUIRE(p != NULL);
    void *o[5];
    for (int k = 0; k < 5; k++) {
      o[k] = keel_pool_alloc(p);
      KT_REQUIRE(o[k] != NULL);
      KT_EQ((uintptr_t)o[k] % (al < 16 ? 16 : al), 0);
      memset(o[k], k, 24);
    }
    for (int k = 0; k < 5; k++) keel_pool_free(p, o[k]);
    KT_EQ(keel_pool_destroy(p), 0);
  }
}

static void bad_create(void) {
  errno = 0;
  KT_CHECK(keel_pool_create("dict", 0, 0, NULL) == NULL && errno == EINVAL);
  errno = 0;
  KT_CHECK(keel_pool_create("dict", 64, 3, NULL) == NULL && errno == EINVAL);
  errno = 0;
  KT_CHECK(keel_pool_create("dict", 64, 8192, NULL) == NULL && errno == EINVAL);
  errno = 0;
  KT_CHECK(keel_pool_create("dict", 64, (size_t)1 << 63, NULL) == NULL && errno == EINVAL);
  errno = 0;
  KT_CHECK(keel_pool_create("dict", KEEL_POOL_MAX_OBJ + 1, 0, NULL) == NULL && errno == EINVAL);
  errno = 0;
  KT_CHECK(keel_pool_create("dict", SIZE_MAX, 0, NULL) == NULL && errno == EINVAL);
  errno = 0;
  KT_CHECK(keel_pool_create(NULL, 64, 0, NULL) == NULL && errno == EINVAL);
  /* A long name is cut, not rejected. */
  keel_pool_t *p = keel_pool_create("a-name-that-is-much-longer-than-thirty-one-bytes", 8, 0, NULL);
  KT_REQUIRE(p != NULL);
  KT_EQ(strlen(stats(p).name), KEEL_POOL_NAME_MAX);
  KT_EQ(keel_pool_destroy(p), 0);
}

static void wrong_pool_child(void *arg) {
  (void)arg;
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  keel_pool_t *stub = keel_pool_create("stub", 128, 0, NULL);
  keel_pool_free(dict, keel_pool_alloc(stub));
}

static void double_free_child(void *arg) {
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  void *o = keel_pool_alloc(dict);
  if (arg != NULL) { /* the double free sees a pool other than the first free's */
    keel_pool_free(dict, keel_pool_alloc(dict));
  }
  keel_pool_free(dict, o);
  keel_pool_free(dict, o);
}

/* Double free of an object another thread freed first (and still caches). */
static sem_t freed, never;
static void *free_in_thread(void *arg) {
  void **a = arg;
  keel_pool_free(a[0], a[1]);
  sem_post(&freed);
  sem_wait(&never); /* stay alive: exiting would return the object to the heap */
  return NULL;
}
static void double_free_cross_child(void *arg) {
  (void)arg;
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  void *a[2] = {dict, keel_pool_alloc(dict)};
  sem_init(&freed, 0, 0);
  sem_init(&never, 0, 0);
  pthread_t t;
  pthread_create(&t, NULL, free_in_thread, a);
  sem_wait(&freed);
  keel_pool_free(dict, a[1]);
}

/* Double free of an object the pool has since given back to the heap (two
 * sweeps: hot, then cold, then freed). Its header's tag is the heap's link
 * by then; it was reported as a foreign object. */
static void double_free_released_child(void *arg) {
  (void)arg;
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  void *o = keel_pool_alloc(dict);
  keel_pool_free(dict, o);
  keel_pool_sweep(dict);
  keel_pool_sweep(dict);
  if (stats(dict).cached != 0) abort(); /* not "double free": the test fails */
  keel_pool_free(dict, o);
}

/* The same for an object of 1 MiB: the heap maps such a block alone, and
 * after the two sweeps and a forced collection the mapping is gone. The
 * second free read the header there and died of SIGSEGV. */
static void double_free_released_large_child(void *arg) {
  (void)arg;
  keel_pool_t *big = keel_pool_create("big", 1 << 20, 0, NULL);
  void *o = keel_pool_alloc(big);
  keel_pool_free(big, o);
  keel_pool_sweep(big);
  keel_pool_sweep(big);
  if (stats(big).cached != 0) abort();
  keel_heap_collect(true); /* the heap's cache of large mappings: unmapped */
  keel_pool_free(big, o);
}

/* The same for a class carved from pages (helper-81's finding): after the
 * two sweeps the pages empty, and a forced collection gives a segment with
 * nothing else in it back to the OS. The second free read the header in the
 * unmapped segment and died of SIGSEGV; the heap now keeps such segments
 * mapped, purged (segment.c). The child fills whole segments (24 MiB of
 * objects) and frees twice one whose segment really went back: it left the
 * segment map and its page is not resident (mincore). `arg` is the
 * object size: 1000 B (64 KiB pages) and 200 KB (a page of its own span). */
static void double_free_released_segment_child(void *arg) {
  size_t size = (size_t)(uintptr_t)arg, n = (24u << 20) / size;
  keel_pool_t *p = keel_pool_create("seg", size, 0, NULL);
  void **o = malloc(n * sizeof(*o));
  if (o == NULL) abort();
  for (size_t i = 0; i < n; i++) o[i] = keel_pool_alloc(p);
  for (size_t i = 0; i < n; i++) keel_pool_free(p, o[i]);
  keel_pool_sweep(p);
  keel_pool_sweep(p);
  if (stats(p).cached != 0) abort();
  keel_heap_collect(true);
  long pg = sysconf(_SC_PAGESIZE);
  for (size_t i = 0; i < n; i++) {
    if (_keel_segmap_has(_keel_segment_of(o[i]))) continue; /* its segment is still in use */
    void *page = (void *)((uintptr_t)o[i] & ~(uintptr_t)(pg - 1));
    unsigned char in = 0;
    if (mincore(page, (size_t)pg, &in) == 0 && (in & 1)) {
      fprintf(stderr, "test: a released segment is still resident\n");
      abort();
    }
    keel_pool_free(p, o[i]);
  }
  fprintf(stderr, "test: no segment went back to the OS\n");
  abort();
}

/* An object whose first word is its pool's address (a back pointer), freed
 * through a pointer 16 bytes into it: that word sits where a header's tag
 * would. With the tag equal to the pool's address this passed for a live
 * object, went on the hot list, and the next alloc returned it. */
static void interior_pointer_child(void *arg) {
  (void)arg;
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  uintptr_t *o = keel_pool_alloc(dict);
  o[0] = (uintptr_t)dict;
  o[1] = 0;
  keel_pool_free(dict, &o[2]);
}

/* A pointer to the first byte of a mapping whose previous page is not
 * mapped: the header read there died of SIGSEGV. */
static void page_start_child(void *arg) {
  (void)arg;
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  long pg = sysconf(_SC_PAGESIZE);
  char *m = mmap(NULL, 2 * (size_t)pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED || munmap(m, (size_t)pg) != 0) abort();
  keel_pool_free(dict, m + pg);
}

/* Use after destroy, with other pools created since (no more than
 * POOL_RECYCLE_AFTER dead ones): the stale handle still aborts. Recycled at
 * once, as before, it became the first of those pools, and an allocation
 * through it returned one of theirs. */
static void after_destroy_child(void *arg) {
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  void *o = keel_pool_alloc(dict);
  keel_pool_free(dict, o);
  keel_pool_destroy(dict);
  for (int i = 0; i < POOL_RECYCLE_AFTER; i++) {
    keel_pool_t *other = keel_pool_create("frame", 4096, 0, NULL);
    if (i == POOL_RECYCLE_AFTER - 1) break; /* one stays alive */
    keel_pool_destroy(other);
  }
  switch ((int)(intptr_t)arg) {
    case 0:
      keel_pool_alloc(dict);
      break;
    case 1:
      keel_pool_free(dict, o);
      break;
    case 2:
      keel_pool_sweep(dict);
      break;
    case 3:
      keel_pool_destroy(dict);
      break;
    default:
      keel_pool_zalloc(dict);
      break;
  }
}

static void scribble_child(void *arg) {
  (void)arg;
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  unsigned char *o = keel_pool_alloc(dict);
  keel_pool_free(dict, o);
#if defined(KEEL_ASAN)
  /* A stray write ASan cannot see (from uninstrumented code, say). */
  __asan_unpoison_memory_region(o, 128);
#endif
  o[77] = 1;
  keel_pool_alloc(dict);
}

/* A stray write over a cached object's header, caught by the debug-full
 * list validator at the next sweep. */
static void corrupt_header_child(void *arg) {
  (void)arg;
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  void *o = keel_pool_alloc(dict);
  keel_pool_free(dict, o);
  ((uintptr_t *)o)[-2] ^= 0x40;
  keel_pool_sweep(dict);
}

/* Regression (a NULL pool crashed the fast paths): keel_pool_alloc(NULL)
 * and keel_pool_free(NULL, obj) read the pool before any check and died of
 * SIGSEGV, where keel_pool_stats and keel_pool_destroy said "NULL pool".
 * Every call now aborts naming itself, the inline fast paths (this file is
 * also built with KEEL_POOL_INLINE) included. */
static void null_pool_child(void *arg) {
  keel_pool_t *dict = keel_pool_create("dict", 128, 0, NULL);
  void *o = keel_pool_alloc(dict);
  /* Not a pool object: its header's tag is 0, the address of a NULL pool. */
  static uintptr_t fake[4];
  keel_pool_stats_t st;
  switch ((int)(intptr_t)arg) {
    case 0:
      keel_pool_alloc(NULL);
      break;
    case 1:
      keel_pool_zalloc(NULL);
      break;
    case 2:
      keel_pool_free(NULL, o);
      break;
    case 3:
      keel_pool_free(NULL, &fake[2]);
      break;
    case 4:
      keel_pool_sweep(NULL);
      break;
    case 5:
      keel_pool_stats(NULL, &st);
      break;
    default:
      keel_pool_destroy(NULL);
      break;
  }
}

static void null_pool_aborts(void) {
  /* No sweeper in the children (see bad_input_aborts). */
  keel_store_relaxed(&_keel_pool_sweeper_manual, 1);
  static const char *const calls[] = {"keel_pool_alloc",  "keel_pool_zalloc", "keel_pool_free",
                                      "keel_pool_free",   "keel_pool_sweep",  "keel_pool_stats",
                                      "keel_pool_destroy"};
  for (int i = 0; i < 7; i++) {
    char want[128];
    snprintf(want, sizeof(want), "keel: %s: NULL pool", calls[i]);
    KT_CHECK(
        kt_expect_abort(__FILE__, __LINE__, null_pool_child, (void *)(intptr_t)i, want, NULL, 0));
  }
  keel_store_relaxed(&_keel_pool_sweeper_manual, 0);
}

static void bad_input_aborts(void) {
  char out[512];
  /* The children must not start the sweeper: TSan cannot follow a thread
   * created after a multi-threaded fork (the heap's purge thread runs). */
  keel_store_relaxed(&_keel_pool_sweeper_manual, 1);
  KT_CHECK(kt_expect_abort(__FILE__, __LINE__, wrong_pool_child, NULL,
                           "does not belong to pool 'dict'", out, sizeof(out)));
  KT_CONTAINS(out, "keel: keel_pool_free: 0x");
  KT_CHECK(kt_expect_abort(__FILE__, __LINE__, double_free_child, NULL, "in pool 'dict'", out,
                           sizeof(out)));
  KT_CONTAINS(out, "keel: keel_pool_free: double free of 0x");
  KT_EXPECT_ABORT(double_free_child, "x", "keel: keel_pool_free: double free of 0x");
  KT_EXPECT_ABORT(double_free_cross_child, NULL, "keel: keel_pool_free: double free of 0x");
  KT_EXPECT_ABORT(double_free_released_child, NULL, "keel: keel_pool_free: double free of 0x");
  KT_EXPECT_ABORT(double_free_released_large_child, NULL,
                  "is not a live object of pool 'big' (freed twice?)");
  /* Under a finite RLIMIT_AS the heap unmaps such segments (the exception
   * heap/shared.h states), and that double free faults as before. */
  for (uintptr_t size = 1000; size <= 200000 && !_keel_os_as_limited(); size += 199000) {
    KT_CHECK(kt_expect_abort(__FILE__, __LINE__, double_free_released_segment_child, (void *)size,
                             "freed twice after its memory went back to the OS", out, sizeof(out)));
    KT_CONTAINS(out, "keel: keel_pool_free: 0x");
    KT_CONTAINS(out, "does not belong to pool 'seg'");
  }
  KT_CHECK(kt_expect_abort(__FILE__, __LINE__, interior_pointer_child, NULL,
                           "does not belong to pool 'dict'", out, sizeof(out)));
  KT_CHECK(kt_expect_abort(__FILE__, __LINE__, page_start_child, NULL,
                           "does not belong to pool 'dict'", out, sizeof(out)));
  static const char *const calls[] = {"keel_pool_alloc", "keel_pool_free", "keel_pool_sweep",
                                      "keel_pool_destroy", "keel_pool_zalloc"};
  for (int i = 0; i < 5; i++) {
    char want[128];
    snprintf(want, sizeof(want), "keel: %s: pool 'dict'", calls[i]);
    KT_CHECK(kt_expect_abort(__FILE__, __LINE__, after_destroy_child, (void *)(intptr_t)i, want,
                             out, sizeof(out)));
    KT_CONTAINS(out, "used after keel_pool_destroy");
  }
#if KEEL_DEBUG >= 1
  KT_CHECK(kt_expect_abort(__FILE__, __LINE__, scribble_child, NULL, "modified after free", out,
                           sizeof(out)));
  KT_CONTAINS(out, "keel: keel_pool_alloc: 0x");
  KT_CONTAINS(out, "in pool 'dict' (byte 77 is 0x01)");
#else
  (void)scribble_child;
#endif
#if KEEL_DEBUG >= 2
  KT_EXPECT_ABORT(corrupt_header_child, NULL, "keel: keel_pool_sweep: corrupt cached object 0x");
#else
  (void)corrupt_header_child;
#endif
  keel_store_relaxed(&_keel_pool_sweeper_manual, 0);
}

static void destroy_busy(void) {
  keel_pool_t *p = keel_pool_create("busy", 64, 0, NULL);
  void *a = keel_pool_alloc(p), *b = keel_pool_alloc(p);
  keel_pool_free(p, b);
  KT_EQ(keel_pool_destroy(p), KEEL_EBUSY);
  /* Still fully usable. */
  keel_pool_stats_t st = stats(p);
  KT_EQ(st.live, 1);
  KT_EQ(st.cached, 1);
  void *c = keel_pool_alloc(p);
  KT_CHECK(c == b);
  keel_pool_free(p, c);
  keel_pool_free(p, a);
  KT_EQ(keel_pool_destroy(p), 0);
}

/* Objects freed by another thread count against the pool, not the thread. */
static void *alloc_in_thread(void *arg) {
  return keel_pool_alloc(arg);
}
static void *churn_in_thread(void *arg) {
  keel_pool_t *p = arg;
  void *o[16];
  for (int i = 0; i < 16; i++) o[i] = keel_pool_alloc(p);
  for (int i = 0; i < 16; i++) keel_pool_free(p, o[i]);
  return NULL;
}

static void thread_exit_releases(void) {
  sweeper_quiet();
  keel_pool_t *p = keel_pool_create("exit", 300, 0, NULL);
  pthread_t t;
  pthread_create(&t, NULL, churn_in_thread, p);
  pthread_join(t, NULL);
  keel_pool_stats_t st = stats(p);
  KT_EQ(st.threads, 0);
  KT_EQ(st.cached, 0); /* the exiting thread's 16 went back to the heap */
  KT_EQ(st.heap_frees, 16);
  KT_EQ(st.allocs, 16);
  /* Allocated there, freed here: live goes to zero, destroy succeeds. */
  void *o;
  pthread_create(&t, NULL, alloc_in_thread, p);
  pthread_join(t, &o);
  KT_EQ(stats(p).live, 1);
  KT_EQ(keel_pool_destroy(p), KEEL_EBUSY);
  keel_pool_free(p, o);
  st = stats(p);
  KT_EQ(st.live, 0);
  KT_EQ(st.threads, 1);
  KT_EQ(keel_pool_destroy(p), 0);
}

static void reclaim(void) {
  sweeper_quiet();
  keel_pool_t *p = keel_pool_create("reclaim-a", 1000, 0, NULL);
  keel_pool_t *q = keel_pool_create("reclaim-b", 50, 0, NULL);
  void *o[40];
  for (int i = 0; i < 40; i++) o[i] = keel_pool_alloc(i < 20 ? p : q);
  for (int i = 0; i < 40; i++) keel_pool_free(i < 20 ? p : q, o[i]);
  size_t total = stats(p).cached_bytes + stats(q).cached_bytes;
  KT_CHECK(total > 0);
  KT_EQ(keel_pool_reclaim(0), 0);
  size_t got = keel_pool_reclaim(1);
  KT_CHECK(got >= 1);
  size_t rest = stats(p).cached_bytes + stats(q).cached_bytes;
  KT_EQ(got + rest, total);
  KT_EQ(keel_pool_reclaim(SIZE_MAX), rest);
  KT_EQ(stats(p).cached, 0);
  KT_EQ(stats(q).cached, 0);
  KT_EQ(keel_pool_reclaim(SIZE_MAX), 0);
  KT_EQ(keel_pool_destroy(p), 0);
  KT_EQ(keel_pool_destroy(q), 0);
}

/* A memory-pressure handler's reclaim lowers RSS at once: it hands the
 * heap's free pages to the OS, not to the heap's delayed purge. */
static void reclaim_returns_memory(void) {
  sweeper_quiet();
  enum { N = 32, SIZE = 1 << 20 };
  keel_pool_t *p = keel_pool_create("reclaim-big", SIZE, 0, NULL);
  KT_REQUIRE(p != NULL);
  void *o[N];
  for (int i = 0; i < N; i++) {
    o[i] = keel_pool_alloc(p);
    KT_REQUIRE(o[i] != NULL);
    memset(o[i], i + 1, SIZE);
  }
  /* From here on no check returns early, so the option is always put back. */
  int64_t purge_ms = _keel_option(KEEL_OPT_heap_purge_ms);
  _keel_option_set(KEEL_OPT_heap_purge_ms, 3600000);
  for (int i = 0; i < N; i++) keel_pool_free(p, o[i]);
  size_t loaded = kt_rss_kb();
  KT_EQ(keel_pool_reclaim(SIZE_MAX), (size_t)N * stats(p).block_bytes);
  size_t after = kt_rss_kb();
  _keel_option_set(KEEL_OPT_heap_purge_ms, purge_ms);
  printf("  reclaim: rss %zu KiB loaded, %zu after\n", loaded, after);
  /* Most of it: without the collect about half went (the heap's own
   * handling of these 1 MiB blocks), with it nearly all. */
  if (!kt_sanitized()) KT_CHECK(after < loaded - (size_t)N * SIZE / 1024 * 3 / 4);
  KT_EQ(keel_pool_destroy(p), 0);
}

static void print_stats(void) {
  keel_pool_t *p = keel_pool_create("dict", 128, 0, NULL);
  keel_pool_t *q = keel_pool_create("call-stub", 512, 0, NULL);
  keel_pool_free(p, keel_pool_alloc(p));
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  keel_pool_print_stats(f);
  fclose(f);
  KT_CONTAINS(buf, "dict");
  KT_CONTAINS(buf, "call-stub");
  KT_CONTAINS(buf, "total");
  free(buf);
  KT_EQ(keel_pool_destroy(p), 0);
  KT_EQ(keel_pool_destroy(q), 0);
}

/* keel_pool_print_stats formats under the registry lock but writes after
 * it: with the stream blocked (a pipe nobody reads), pools are still
 * created, used by new threads and destroyed. It wrote under the lock. */
static int stats_pipe[2];
static void *stats_printer(void *arg) {
  keel_pool_print_stats((FILE *)arg); /* blocks in fflush until the pipe is read */
  fflush((FILE *)arg);
  return NULL;
}
static void *first_use(void *arg) {
  keel_pool_free(arg, keel_pool_alloc(arg));
  return NULL;
}
static void print_stats_unlocked_write(void) {
  keel_pool_t *p = keel_pool_create("dict", 128, 0, NULL);
  KT_REQUIRE(pipe(stats_pipe) == 0);
  /* Fill the pipe, then give the printer a stream with no buffer. */
  /* One page of pipe, filled but for the header line, so that the printer
   * blocks on its first pool's line (the header was always written
   * outside the lock). */
  KT_REQUIRE(fcntl(stats_pipe[1], F_SETPIPE_SZ, 4096) == 4096);
  char junk[4096] = {0};
  char hdr[256];
  int hl = snprintf(hdr, sizeof(hdr), "%-20s %8s %8s %12s %12s %12s %12s %10s %10s %12s %7s %7s\n",
                    "pool", "size", "block", "allocs", "hot", "cold", "heap", "live", "cached",
                    "cached_B", "sweeps", "threads");
  KT_REQUIRE(write(stats_pipe[1], junk, 4096 - (size_t)hl) == 4096 - hl);
  FILE *f = fdopen(stats_pipe[1], "w");
  KT_REQUIRE(f != NULL);
  setvbuf(f, NULL, _IONBF, 0);
  pthread_t printer, user;
  pthread_create(&printer, NULL, stats_printer, f);
  kt_sleep_ms(50); /* the printer is blocked in its first write */
  alarm(60);       /* a hang is the failure */
  keel_pool_t *q = keel_pool_create("call-stub", 512, 0, NULL);
  KT_REQUIRE(q != NULL);
  pthread_create(&user, NULL, first_use, p); /* a new thread's sub-pool */
  pthread_join(user, NULL);
  KT_EQ(keel_pool_destroy(q), 0);
  alarm(0);
  /* Drain the pipe until the printer is done. */
  fcntl(stats_pipe[0], F_SETFL, O_NONBLOCK);
  for (;;) {
    ssize_t r = read(stats_pipe[0], junk, sizeof(junk));
    if (r <= 0 && pthread_tryjoin_np(printer, NULL) == 0) break;
    if (r <= 0) kt_sleep_ms(1);
  }
  fclose(f);
  close(stats_pipe[0]);
  KT_EQ(keel_pool_destroy(p), 0);
}

/* A forked child can stop and restart the sweeper (destroy its last pool,
 * create another) and exit: the parent's sweeper, waiting on the condition
 * variable at the fork, is not a waiter there. It hung in the broadcast. */
static void fork_child_sweeper_child(void *arg) {
  alarm(20);                    /* a hang is the failure: SIGALRM, not the abort expected */
  keel_pool_destroy(arg);       /* the parent's, the last pool: the sweeper stops */
  for (int i = 0; i < 2; i++) { /* restarts and stops: each stop broadcasts */
    keel_pool_t *c = keel_pool_create("child", 64, 0, NULL);
    kt_sleep_ms(30); /* the child's sweeper waits on the condition variable */
    keel_pool_destroy(c);
  }
  fprintf(stderr, "child done\n");
  abort(); /* the harness's way to hand back the child's stderr */
}
static void fork_child_restarts_sweeper(void) {
#if defined(KEEL_TSAN)
  /* TSan cannot follow a thread created after a multi-threaded fork ("dup
   * thread"), and the child's restarts create one: the plain and ASan
   * builds run this case. */
  return;
#endif
  keel_pool_t *p = keel_pool_create("parent", 64, 0, NULL); /* the sweeper runs */
  KT_REQUIRE(p != NULL);
  kt_sleep_ms(50); /* it is waiting on its condition variable */
  KT_EXPECT_ABORT(fork_child_sweeper_child, p, "child done");
  KT_EQ(keel_pool_destroy(p), 0);
}

/* A sweep still pending from the period before (the owner was mid-call and
 * has not called since) and the next one are two sweeps: after them
 * nothing is cached. Merged into one, as before, the hot list's objects
 * stayed a third period. */
static void pending_sweep_counts_twice(void) {
  sweeper_quiet();
  pool_sub_t *sp;
  keel_pool_t *p = pool_with_pending_sweep("twice", 16, &sp);
  keel_store_relaxed(&sp->f.busy, 0);
  KT_EQ(stats(p).cached, 16);
  KT_EQ(keel_pool_sweep(p), 0); /* this thread idle: the pass does both */
  keel_pool_stats_t st = stats(p);
  KT_EQ(st.cached, 0);
  KT_EQ(st.heap_frees, 16);
  KT_EQ(keel_pool_destroy(p), 0);
}

/* Descriptors are recycled oldest first, so ids stay bounded under churn
 * and a thread's stale slot for a recycled id is never reused. */
static void create_destroy_churn(void) {
  for (int i = 0; i < 200; i++) {
    keel_pool_t *p = keel_pool_create("churn", 32 + (size_t)i, 0, NULL);
    KT_REQUIRE(p != NULL);
    KT_CHECK(p->f.id < 8 + POOL_RECYCLE_AFTER + 1);
    KT_CHECK(p->f.id < KEEL_POOL_FAST_SLOTS);
    void *o = keel_pool_alloc(p);
    keel_pool_free(p, o);
    KT_EQ(keel_pool_destroy(p), 0);
  }
  /* More pools than the inline slots: the slot array grows. */
  keel_pool_t *ps[80];
  for (int i = 0; i < 80; i++) ps[i] = keel_pool_create("many", 16, 0, NULL);
  for (int i = 0; i < 80; i++) keel_pool_free(ps[i], keel_pool_alloc(ps[i]));
  for (int i = 0; i < 80; i++) KT_EQ(keel_pool_destroy(ps[i]), 0);
}

/* keel_pool_destroy clears the slot of every live thread that used the pool,
 * so when the descriptor (and its id) is recycled, that thread's next call,
 * inline or not, attaches a fresh sub-pool instead of popping from the
 * destroyed one's lists. */
static keel_pool_t *volatile slot_pool;
static atomic_int slot_step;
static void *slot_user(void *arg) {
  (void)arg;
  keel_pool_free(slot_pool, keel_pool_alloc(slot_pool)); /* a sub-pool with one cached */
  atomic_store(&slot_step, 1);
  while (atomic_load(&slot_step) != 2) sched_yield(); /* main destroys and recreates */
  void *o = keel_pool_alloc(slot_pool);
  KT_CHECK(o != NULL);
  keel_pool_free(slot_pool, o);
  return NULL;
}

static void destroy_clears_live_threads_slots(void) {
  sweeper_quiet();
  keel_pool_t *p = keel_pool_create("slot-a", 72, 0, NULL);
  slot_pool = p;
  atomic_store(&slot_step, 0);
  pthread_t t;
  KT_EQ(pthread_create(&t, NULL, slot_user, NULL), 0);
  while (atomic_load(&slot_step) != 1) sched_yield();
  uint32_t id = p->f.id;
  KT_EQ(keel_pool_destroy(p), 0); /* the thread's one cached object goes back */
  /* Descriptors are recycled oldest first, once POOL_RECYCLE_AFTER others
   * have died: create and destroy until p's comes back (same id, so the
   * same slot in the thread). */
  keel_pool_t *q;
  int tries = 0;
  while ((q = keel_pool_create("slot-b", 72, 0, NULL)) != NULL && q->f.id != id && ++tries < 512)
    KT_EQ(keel_pool_destroy(q), 0);
  KT_REQUIRE(q != NULL && q->f.id == id);
  slot_pool = q;
  atomic_store(&slot_step, 2);
  pthread_join(t, NULL);
  keel_pool_stats_t st = stats(q);
  KT_EQ(st.allocs, 1);
  KT_EQ(st.heap_allocs, 1); /* fresh, not a hot hit from p's old list */
  KT_EQ(st.hot_hits, 0);
  KT_EQ(st.live, 0);
  KT_EQ(keel_pool_destroy(q), 0);
}

/* RSS after a load falls within `wait` seconds to below `below` KiB, or
 * the last reading. */
static size_t rss_falls(size_t below, double wait) {
  double t0 = kt_now();
  size_t rss;
  while ((rss = kt_rss_kb()) >= below && kt_now() - t0 < wait) usleep(5000);
  return rss;
}

/* The sweeper alone takes idle memory back to zero: its second pass frees
 * the cached objects and hands the pages to the OS. The heap's own delayed
 * purge is pushed out of the test's reach (heap_purge_ms), so only the
 * sweeper's keel_heap_collect can make RSS fall. */
static void idle_returns_to_zero(void) {
  sweeper_quiet();
  enum { N = 48, SIZE = 1 << 20 };
  keel_pool_t *p = keel_pool_create("idle", SIZE, 0, NULL);
  KT_REQUIRE(p != NULL);
  keel_heap_collect(true);
  size_t rss0 = kt_rss_kb();
  void *o[N];
  for (int i = 0; i < N; i++) {
    o[i] = keel_pool_alloc(p);
    KT_REQUIRE(o[i] != NULL);
    memset(o[i], i, SIZE);
  }
  /* From here on no check returns early, so the option is always put back. */
  int64_t purge_ms = _keel_option(KEEL_OPT_heap_purge_ms);
  _keel_option_set(KEEL_OPT_heap_purge_ms, 3600000);
  for (int i = 0; i < N; i++) keel_pool_free(p, o[i]);
  size_t rss_loaded = kt_rss_kb();
  KT_EQ(stats(p).cached_bytes, (uint64_t)N * stats(p).block_bytes);
  uint64_t sweeps0 = stats(p).sweeps;
  _keel_option_set(KEEL_OPT_pool_sweep_s, 50);
  _keel_pool_sweeper_kick();
  double t0 = kt_now();
  /* Two 50 ms periods; the bound only keeps a broken sweeper from hanging
   * the test (timing is the benchmark's business, not this test's). */
  while (stats(p).cached_bytes != 0 && kt_now() - t0 < 30) usleep(5000);
  double took = kt_now() - t0;
  keel_pool_stats_t st = stats(p);
  KT_EQ(st.cached_bytes, 0);
  KT_CHECK(st.sweeps >= sweeps0 + 2);
  /* The pass that emptied the cache collects right after it. */
  /* Most of it: without the sweeper's collect about half went (the heap's
   * own handling of these 1 MiB blocks), with it nearly all. */
  size_t fall = (size_t)N * SIZE / 1024 * 3 / 4, rss1 = 0;
  if (!kt_sanitized()) { /* ASan's quarantine keeps freed memory resident */
    rss1 = rss_falls(rss_loaded - fall, 5);
    KT_CHECK(rss_loaded > rss0 + fall);
    KT_CHECK(rss1 < rss_loaded - fall);
  }
  _keel_option_set(KEEL_OPT_heap_purge_ms, purge_ms);
  printf("  idle: rss %zu KiB before, %zu loaded, %zu after two sweeps (%.0f ms)\n", rss0,
         rss_loaded, rss1, took * 1000);
  sweeper_quiet();
  KT_EQ(keel_pool_destroy(p), 0);
}

typedef struct oom_thread_arg {
  keel_pool_t *p;
  void *obj; /* freed by the thread, which has no sub-pool and gets none */
  void *got; /* what the thread's alloc returned */
  int alloc_errno;
} oom_thread_arg_t;

static void *oom_thread(void *arg) {
  oom_thread_arg_t *a = arg;
  errno = 0;
  a->got = keel_pool_alloc(a->p);
  a->alloc_errno = errno;
  keel_pool_free(a->p, a->obj);
  return NULL;
}

/* Every pool call that can run out of memory, under a real shortage (the OS
 * refuses new mappings: src/base/os.h's fault injection, and tests/oom.h
 * takes what the heap still holds): it fails with NULL + ENOMEM, or, for
 * free, sends the object straight to the heap; the pool's counters stay
 * exact (destroy is not refused for objects that are gone), cached objects
 * are still served, the pool works once memory is back, and nothing leaks. */
static void out_of_memory(void) {
  sweeper_quiet();
  kt_hoard_t h = {0};
  /* create: recycled descriptors first, then a new one that cannot be had. */
  keel_pool_t *made[4096];
  size_t n_made = 0;
  kt_oom_begin(&h);
  keel_pool_t *np;
  errno = 0;
  while (n_made < 4096 && (np = keel_pool_create("oom-create", 64, 0, NULL)) != NULL)
    made[n_made++] = np;
  KT_CHECK(n_made < 4096);
  KT_EQ(errno, ENOMEM);
  kt_oom_end(&h);
  for (size_t i = 0; i < n_made; i++) KT_EQ(keel_pool_destroy(made[i]), 0);

  keel_pool_t *p = keel_pool_create("oom", 200, 0, NULL);
  keel_pool_t *q = keel_pool_create("oom-aligned", 100, 256, NULL);
  KT_REQUIRE(p != NULL && q != NULL);
  keel_pool_free(p, keel_pool_alloc(p)); /* this thread's sub-pools exist */
  keel_pool_free(q, keel_pool_alloc(q));
  keel_pool_reclaim(SIZE_MAX);
  size_t live0 = kt_heap_live_bytes();
  void *o[4];
  for (int i = 0; i < 4; i++) KT_REQUIRE((o[i] = keel_pool_alloc(p)) != NULL);

  kt_oom_begin(&h);
  /* A cached object is still served; the next needs the heap and fails. */
  keel_pool_free(p, o[0]);
  KT_CHECK(keel_pool_alloc(p) == o[0]);
  errno = 0;
  KT_CHECK(keel_pool_alloc(p) == NULL && errno == ENOMEM);
  errno = 0;
  KT_CHECK(keel_pool_zalloc(p) == NULL && errno == ENOMEM);
  errno = 0;
  KT_CHECK(keel_pool_alloc(q) == NULL && errno == ENOMEM);
  /* A thread new to the pool cannot get a sub-pool: its alloc fails, its
   * free of another thread's object goes straight to the heap. */
  oom_thread_arg_t a = {.p = p, .obj = o[1]};
  pthread_t t;
  KT_REQUIRE(pthread_create(&t, NULL, oom_thread, &a) == 0);
  pthread_join(t, NULL);
  KT_CHECK(a.got == NULL);
  KT_EQ(a.alloc_errno, ENOMEM);
  keel_pool_stats_t st = stats(p);
  KT_EQ(st.live, 3);
  KT_EQ(st.cached, 0);
  KT_EQ(keel_pool_destroy(p), KEEL_EBUSY);
  kt_oom_end(&h);

  /* Memory is back: everything works, and the counters add up. */
  void *z = keel_pool_zalloc(p), *y = keel_pool_alloc(q);
  KT_REQUIRE(z != NULL && y != NULL);
  KT_CHECK(((uintptr_t)y & 255) == 0);
  keel_pool_free(p, z);
  keel_pool_free(q, y);
  keel_pool_free(p, o[0]);
  keel_pool_free(p, o[2]);
  keel_pool_free(p, o[3]);
  st = stats(p);
  KT_EQ(st.live, 0);
  KT_EQ(st.allocs, st.frees);
  KT_EQ(st.cached, st.heap_allocs - st.heap_frees);
  keel_pool_reclaim(SIZE_MAX);
  KT_EQ(stats(p).cached, 0);
  KT_EQ(stats(q).cached, 0);
  KT_EQ(kt_heap_live_bytes(), live0);
  KT_EQ(keel_pool_destroy(p), 0);
  KT_EQ(keel_pool_destroy(q), 0);
}

/* Pages of the heap holding blocks of `block` bytes (pool objects: the
 * class the shared heaps use for them), over every heap. */
static size_t class_pages(size_t block) {
  int cls = _keel_class_aligned(block, 16);
  keel_heap_stats_t st;
  keel_heap_stats(&st);
  return cls >= 0 ? st.classes[cls].pages : 0;
}

typedef struct idle_worker {
  keel_pool_t *p;
  sem_t *loaded, *go;
} idle_worker_t;

static void *idle_worker(void *arg) {
  idle_worker_t *w = arg;
  void *o[200];
  for (int i = 0; i < 200; i++) KT_REQUIRE((o[i] = keel_pool_alloc(w->p)) != NULL);
  for (int i = 0; i < 200; i++) keel_pool_free(w->p, o[i]);
  sem_post(w->loaded);
  sem_wait(w->go); /* idle, holding its sub-pool, until the checks are done */
  return NULL;
}

/* Issue 5's idle RSS: threads that used a pool and then block (a server
 * between bursts) run no code, so nothing they own can be collected. Pool
 * objects come from the shared heaps (heap/shared.h), which any thread
 * collects: after two sweeps and a collect, the pages that held the
 * workers' objects are gone although every worker is still alive. */
static void idle_threads_keep_no_pages(void) {
  sweeper_quiet();
  KT_EQ(_keel_option(KEEL_OPT_pool_shared_heap), 1);
  enum { T = 8 };
  keel_pool_t *p = keel_pool_create("idle-threads", 2000, 0, NULL);
  KT_REQUIRE(p != NULL);
  size_t block = stats(p).block_bytes;
  keel_heap_collect(true);
  size_t pages0 = class_pages(block);
  sem_t loaded, go;
  sem_init(&loaded, 0, 0);
  sem_init(&go, 0, 0);
  idle_worker_t w = {p, &loaded, &go};
  pthread_t t[T];
  for (int i = 0; i < T; i++) KT_REQUIRE(pthread_create(&t[i], NULL, idle_worker, &w) == 0);
  for (int i = 0; i < T; i++) sem_wait(&loaded);
  size_t pages1 = class_pages(block);
  KT_CHECK(pages1 > pages0);
  KT_EQ(stats(p).cached, (uint64_t)T * 200);
  keel_pool_sweep(p); /* hot lists turn cold */
  keel_pool_sweep(p); /* cold lists go to the heap */
  KT_EQ(stats(p).cached, 0);
  keel_heap_collect(true);
  size_t pages2 = class_pages(block);
  KT_CHECK(pages2 <= pages0);
  printf("  pages of the %zu-byte class: %zu before, %zu loaded, %zu idle\n", block, pages0, pages1,
         pages2);
  for (int i = 0; i < T; i++) sem_post(&go);
  for (int i = 0; i < T; i++) pthread_join(t[i], NULL);
  sem_destroy(&loaded);
  sem_destroy(&go);
  KT_EQ(keel_pool_destroy(p), 0);
}

KT_MAIN(KT_CASE(state_machine), KT_CASE(owner_services_pending_sweep),
        KT_CASE(reclaim_keeps_pending_sweep), KT_CASE(hooks_and_zalloc), KT_CASE(alignment),
        KT_CASE(bad_create), KT_CASE(bad_input_aborts), KT_CASE(null_pool_aborts),
        KT_CASE(destroy_busy), KT_CASE(thread_exit_releases), KT_CASE(reclaim),
        KT_CASE(reclaim_returns_memory), KT_CASE(print_stats), KT_CASE(print_stats_unlocked_write),
        KT_CASE(fork_child_restarts_sweeper), KT_CASE(pending_sweep_counts_twice),
        KT_CASE(create_destroy_churn), KT_CASE(destroy_clears_live_threads_slots),
        KT_CASE(idle_returns_to_zero), KT_CASE(out_of_memory), KT_CASE(idle_threads_keep_no_pages))
