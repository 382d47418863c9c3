/* Stress tests of the table: threads against each other with invariant
 * checks. Sizes come from the environment and scale down under sanitizers:
 *   KEEL_TEST_REPS     grow-from-tiny repetitions        (3; 2 sanitized)
 *   KEEL_TEST_KEYS     keys per grow repetition          (2M; /8 ASan, /32 TSan)
 *   KEEL_TEST_ENTRIES  entries of the big mixed test     (10M; /8 ASan, /32 TSan)
 *   KEEL_TEST_THREADS  writer threads                    (4)
 *   KEEL_TEST_SECONDS  duration of the timed phases      (3)
 *   KEEL_TEST_ALARM    seconds before a hang is declared (240)
 *   KEEL_TEST_STALL    CPU seconds without progress before a hang is declared (60;
 *                      twice that for the big mixed test)
 * The full run (100 repetitions of 2M keys) is
 *   KEEL_TEST_REPS=100 ./build/tests/test_table_stress grow
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <keel/table.h>
#include <urcu/urcu-memb.h>

#include "harness.h"
#include "table/table_internal.h"

#define MAGIC_LIVE  0x4c495645u /* "LIVE" */
#define MAGIC_FREED 0x44454144u /* "DEAD" */

typedef struct item {
  keel_table_node_t node;
  uint64_t payload; /* key * PAYLOAD_MUL, checked by readers */
  keel_atomic(uint32_t) magic;
  keel_atomic(int) holders; /* references this test holds, per its own count */
  bool in_array;            /* part of a preallocated array: not free()d */
} item_t;

#define PAYLOAD_MUL 0x9e3779b97f4a7c15ull

static keel_atomic(long) n_freed;
static keel_atomic(long) n_inserted;

static void item_free(keel_table_node_t *n, void *arg) {
  (void)arg;
  item_t *it = keel_table_entry(n, item_t, node);
  if (keel_load_relaxed(&it->holders) != 0) kt_fail(__FILE__, __LINE__, "freed while referenced");
  if (keel_xchg_acq_rel(&it->magic, MAGIC_FREED) != MAGIC_LIVE)
    kt_fail(__FILE__, __LINE__, "freed twice or never live");
  keel_fetch_add_relaxed(&n_freed, 1);
  if (!it->in_array) free(it);
}

static item_t *item_new(uint64_t key) {
  item_t *it = calloc(1, sizeof *it);
  keel_table_node_init_u64(&it->node, key);
  it->payload = key * PAYLOAD_MUL;
  keel_store_relaxed(&it->magic, MAGIC_LIVE);
  return it;
}

/* Checks an entry found for key inside a read-side section. */
static void check_found(keel_table_node_t *n, uint64_t key) {
  item_t *it = keel_table_entry(n, item_t, node);
  if (n->key.u64 != key || it->payload != key * PAYLOAD_MUL)
    kt_fail(__FILE__, __LINE__, "key %" PRIu64 " found entry for %" PRIu64, key, n->key.u64);
  if (keel_load_relaxed(&it->magic) != MAGIC_LIVE)
    kt_fail(__FILE__, __LINE__, "key %" PRIu64 ": entry freed inside a read-side section", key);
}

/* TSan runs these 5-15x slower than ASan: a further quarter keeps the
 * stage near its two-minute budget on 2 shared cores. */
static long tsan_quarter(long n) {
#if defined(KEEL_TSAN)
  return n / 4 > 0 ? n / 4 : 1;
#else
  return n;
#endif
}

static uint64_t rnd(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "test_table_stress: timed out (hang?)\n";
  ssize_t r = write(2, msg, sizeof msg - 1);
  (void)r;
  abort();
}

static void arm_alarm(void) {
  signal(SIGALRM, on_alarm);
  alarm((unsigned)kt_env_int("KEEL_TEST_ALARM", 240));
}

static keel_atomic(int) stop;

/* Watchdog of the grow and big tests: a livelock (the failure rculfhash
 * showed when started tiny) spins, so it shows as KEEL_TEST_STALL seconds of
 * this process's CPU time spent with no insert, removal or free finishing.
 * CPU time, not wall time: on 2 cores shared with a load of 30, the test
 * got a fifteenth of a core and a wall-clock stall limit fired with nothing
 * wrong. A hang that sleeps is left to CTest's timeout. */
static keel_atomic(long) progress;
static keel_atomic(long) watch_rep;
static keel_atomic(int) watch_stop;

static double process_cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *watchdog(void *arg) {
  long stall_s = *(long *)arg, last = -1;
  double since = process_cpu_s();
  while (!keel_load_relaxed(&watch_stop)) {
    usleep(100000);
    /* Inserts and frees count too: the big test's fill and destroy. */
    long p =
        keel_load_relaxed(&progress) + keel_load_relaxed(&n_inserted) + keel_load_relaxed(&n_freed);
    double now = process_cpu_s();
    if (p != last) {
      last = p;
      since = now;
    } else if (now - since > (double)stall_s) {
      fprintf(
          stderr,
          "test_table_stress: no progress in %ld s of CPU time, repetition %ld (%ld ops done)\n",
          stall_s, keel_load_relaxed(&watch_rep), p);
      abort();
    }
  }
  return NULL;
}

/* --- grow from tiny, repeatedly ------------------------------------------------ */

typedef struct grow_ctx {
  keel_table_t *t;
  item_t *items;
  size_t n;
  int threads;
} grow_ctx_t;

/* A worker thread of the grow and resize tests: its test's context. */
typedef struct worker {
  void *c;
  int id;
  pthread_t th;
} worker_t;

static void *grow_writer(void *arg) {
  worker_t *w = arg;
  grow_ctx_t *c = w->c;
  for (size_t i = (size_t)w->id; i < c->n; i += (size_t)c->threads) {
    int rc = keel_table_insert(c->t, &c->items[i].node);
    if (rc != 0) kt_fail(__FILE__, __LINE__, "insert %zu: %d", i, rc);
    keel_table_put(c->t, &c->items[i].node);
    keel_fetch_add_relaxed(&progress, 1);
  }
  return NULL;
}

static void *grow_reader(void *arg) {
  grow_ctx_t *c = arg;
  uint64_t s = 88172645463325252ull;
  while (!keel_load_relaxed(&stop)) {
    uint64_t k = rnd(&s) % c->n;
    keel_table_read_lock();
    keel_table_node_t *n = keel_table_lookup_u64(c->t, k);
    if (n != NULL) check_found(n, k);
    keel_table_read_unlock();
  }
  return NULL;
}

static void *grow_remover(void *arg) {
  worker_t *w = arg;
  grow_ctx_t *c = w->c;
  for (size_t i = (size_t)w->id; i < c->n; i += (size_t)c->threads) {
    uint64_t k = i;
    int rc = keel_table_remove_key(c->t, &k, sizeof k);
    if (rc != 0) kt_fail(__FILE__, __LINE__, "remove_key %zu: %d", i, rc);
    keel_fetch_add_relaxed(&progress, 1);
  }
  return NULL;
}

static void run_workers(grow_ctx_t *c, void *(*fn)(void *)) {
  worker_t w[64];
  for (int i = 0; i < c->threads; i++) {
    w[i] = (worker_t){c, i, 0};
    pthread_create(&w[i].th, NULL, fn, &w[i]);
  }
  for (int i = 0; i < c->threads; i++) pthread_join(w[i].th, NULL);
}

/* Tables start at the minimum size (no hint) and grow to millions of
 * entries under concurrent inserts and lookups, then shrink back as every
 * entry is removed; repeated, under an alarm: the regression test for
 * rculfhash's small-table auto-resize livelock (issue 7). */
static void grow_from_tiny_repeatedly(void) {
  long reps = kt_env_int("KEEL_TEST_REPS", kt_sanitized() ? 2 : 3);
  size_t n = (size_t)kt_env_int("KEEL_TEST_KEYS", tsan_quarter(kt_scale(2000000)));
  int threads = (int)kt_env_int("KEEL_TEST_THREADS", 4);
  if (threads > 64) threads = 64;
  long stall_s = kt_env_int("KEEL_TEST_STALL", 60);
  item_t *items = calloc(n, sizeof *items);
  KT_REQUIRE(items != NULL);
  pthread_t wd;
  keel_store_relaxed(&watch_stop, 0);
  pthread_create(&wd, NULL, watchdog, &stall_s);
  double t0 = kt_now();
  for (long r = 0; r < reps; r++) {
    keel_store_relaxed(&watch_rep, r);
    for (size_t i = 0; i < n; i++) {
      keel_table_node_init_u64(&items[i].node, i);
      items[i].payload = i * PAYLOAD_MUL;
      keel_store_relaxed(&items[i].magic, MAGIC_LIVE);
      items[i].in_array = true;
    }
    keel_table_config_t cfg = {.key_type = KEEL_TABLE_KEY_U64, .free_fn = item_free};
    grow_ctx_t c = {keel_table_create(&cfg), items, n, threads};
    KT_REQUIRE(c.t != NULL);
    long f0 = keel_load_relaxed(&n_freed);
    keel_store_relaxed(&stop, 0);
    pthread_t rd;
    pthread_create(&rd, NULL, grow_reader, &c);
    run_workers(&c, grow_writer);
    KT_EQ(keel_table_count(c.t), n);
    for (size_t i = 0; i < n; i += 7) {
      keel_table_read_lock();
      KT_CHECK(keel_table_lookup_u64(c.t, i) == &items[i].node);
      keel_table_read_unlock();
    }
    run_workers(&c, grow_remover);
    keel_store_relaxed(&stop, 1);
    pthread_join(rd, NULL);
    KT_EQ(keel_table_count(c.t), 0);
    KT_EQ(keel_table_destroy(c.t), 0);
    KT_EQ(keel_load_relaxed(&n_freed) - f0, (long)n);
  }
  keel_store_relaxed(&watch_stop, 1);
  pthread_join(wd, NULL);
  printf("  grow: %ld x %zu keys, %d writers + 1 reader: %.1f s\n", reps, n, threads,
         kt_now() - t0);
  free(items);
}

/* --- resizes under readers and walkers ----------------------------------------- */

/* A small stable set of entries, held referenced, while writers insert and
 * remove a churning set in waves big enough to grow the index from the
 * stable size to hundreds of times that and shrink it back, over and over.
 * Readers assert that every stable key is found on every lookup and that
 * keys never inserted are not; a walker, walking back to back, asserts that
 * each walk visits every stable entry exactly once (and, by the count of
 * resizes at the end, that walks do not hold resizing up). These are the invariants migration must keep
 * (src/table/index.h): a key is findable in the old array or the new one
 * at every instant, and a walk sees each entry once. */
#define RS_STABLE 2048u
#define RS_ABSENT (1ull << 40) /* keys from here on are never inserted */

typedef struct rs_ctx {
  keel_table_t *t;
  keel_atomic(int) done; /* the writers have finished: readers and walker stop */
  size_t wave;           /* churn keys per writer per wave */
  int writers;
  keel_atomic(long) lookups, walks;
} rs_ctx_t;

static void *rs_reader(void *arg) {
  worker_t *w = arg;
  rs_ctx_t *c = w->c;
  uint64_t s = 0x2545f4914f6cdd1dull + (uint64_t)w->id;
  long n = 0;
  while (!keel_load_relaxed(&c->done)) {
    keel_table_read_lock();
    for (int i = 0; i < 64; i++) {
      uint64_t k = rnd(&s) % RS_STABLE;
      keel_table_node_t *e = keel_table_lookup_u64(c->t, k);
      if (e == NULL) kt_fail(__FILE__, __LINE__, "stable key %" PRIu64 " not found", k);
      check_found(e, k);
      if (keel_table_lookup_u64(c->t, RS_ABSENT + rnd(&s) % 4096) != NULL)
        kt_fail(__FILE__, __LINE__, "a key never inserted was found");
    }
    keel_table_read_unlock();
    n += 128;
  }
  keel_fetch_add_relaxed(&c->lookups, n);
  return NULL;
}

static int rs_visit(keel_table_node_t *n, void *arg) {
  uint8_t *seen = arg;
  if (n->key.u64 < RS_STABLE) seen[n->key.u64]++;
  return 0;
}

static void *rs_walker(void *arg) {
  worker_t *w = arg;
  rs_ctx_t *c = w->c;
  uint8_t seen[RS_STABLE];
  long n = 0;
  while (!keel_load_relaxed(&c->done)) {
    memset(seen, 0, sizeof seen);
    keel_table_for_each(c->t, rs_visit, seen);
    for (unsigned k = 0; k < RS_STABLE; k++)
      if (seen[k] != 1)
        kt_fail(__FILE__, __LINE__, "walk visited stable key %u %u times", k, seen[k]);
    n++;
  }
  keel_fetch_add_relaxed(&c->walks, n);
  return NULL;
}

static void *rs_writer(void *arg) {
  worker_t *w = arg;
  rs_ctx_t *c = w->c;
  item_t **mine = calloc(c->wave, sizeof *mine);
  uint64_t base = RS_STABLE + (uint64_t)w->id * c->wave;
  /* Two waves at least, however slow the machine: each grows the index
   * several times and shrinks it back. */
  for (int waves = 0; waves < 2 || !keel_load_relaxed(&stop); waves++) {
    for (size_t i = 0; i < c->wave; i++) {
      mine[i] = item_new(base + i);
      if (keel_table_insert(c->t, &mine[i]->node) != 0) kt_fail(__FILE__, __LINE__, "insert");
      keel_table_put(c->t, &mine[i]->node);
      keel_fetch_add_relaxed(&progress, 1);
    }
    for (size_t i = 0; i < c->wave; i++) {
      uint64_t k = base + i;
      if (keel_table_remove_key(c->t, &k, sizeof k) != 0) kt_fail(__FILE__, __LINE__, "remove");
      keel_fetch_add_relaxed(&progress, 1);
    }
  }
  free(mine);
  return NULL;
}

static void resizes_under_readers_and_walkers(void) {
  int writers = (int)kt_env_int("KEEL_TEST_THREADS", 4);
  if (writers > 16) writers = 16;
  double secs = (double)kt_env_int("KEEL_TEST_SECONDS", 3);
  keel_table_config_t cfg = {.key_type = KEEL_TABLE_KEY_U64, .free_fn = item_free};
  /* Waves of at least 16 times the stable set, so that each one grows the
   * index 16-fold and the removals shrink it back (a shrink needs the count
   * under a quarter of the buckets). */
  size_t wave = (size_t)tsan_quarter(kt_scale(100000)) / (size_t)writers;
  if (wave < 16 * RS_STABLE / (size_t)writers) wave = 16 * RS_STABLE / (size_t)writers;
  rs_ctx_t c = {.t = keel_table_create(&cfg), .wave = wave, .writers = writers};
  KT_REQUIRE(c.t != NULL);
  item_t *stable = calloc(RS_STABLE, sizeof *stable);
  for (unsigned i = 0; i < RS_STABLE; i++) {
    keel_table_node_init_u64(&stable[i].node, i);
    stable[i].payload = i * PAYLOAD_MUL;
    keel_store_relaxed(&stable[i].magic, MAGIC_LIVE);
    stable[i].in_array = true;
    KT_EQ(keel_table_insert(c.t, &stable[i].node), 0); /* held: never evicted */
  }
  keel_table_stats_t st0;
  keel_table_stats(c.t, &st0);
  keel_store_relaxed(&stop, 0);
  long stall_s = kt_env_int("KEEL_TEST_STALL", 60);
  pthread_t wd;
  keel_store_relaxed(&watch_stop, 0);
  pthread_create(&wd, NULL, watchdog, &stall_s);
  worker_t w[2 + 1 + 16];
  int nw = 0;
  for (int i = 0; i < 2; i++, nw++) {
    w[nw] = (worker_t){&c, i, 0};
    pthread_create(&w[nw].th, NULL, rs_reader, &w[nw]);
  }
  w[nw] = (worker_t){&c, 0, 0};
  pthread_create(&w[nw].th, NULL, rs_walker, &w[nw]);
  nw++;
  for (int i = 0; i < writers; i++, nw++) {
    w[nw] = (worker_t){&c, i, 0};
    pthread_create(&w[nw].th, NULL, rs_writer, &w[nw]);
  }
  usleep((useconds_t)(secs * 1e6));
  keel_store_relaxed(&stop, 1);
  for (int i = 3; i < nw; i++) pthread_join(w[i].th, NULL); /* writers */
  keel_store_relaxed(&c.done, 1);
  for (int i = 0; i < 3; i++) pthread_join(w[i].th, NULL);
  keel_store_relaxed(&watch_stop, 1);
  pthread_join(wd, NULL);
  keel_table_stats_t st;
  keel_table_stats(c.t, &st);
  printf("  resize: %zu resizes in %.0f s (%d writers, waves of %zu), %ld lookups, %ld walks\n",
         st.resizes - st0.resizes, secs, writers, c.wave, keel_load_relaxed(&c.lookups),
         keel_load_relaxed(&c.walks));
  /* Each wave takes the index from 2048 entries to 16 times that and back:
   * two waves give at least 4 finished resizes. */
  KT_CHECK(st.resizes - st0.resizes >= 4);
  KT_CHECK(keel_load_relaxed(&c.walks) > 0);
  KT_EQ(keel_table_count(c.t), RS_STABLE);
  for (unsigned i = 0; i < RS_STABLE; i++) keel_table_put(c.t, &stable[i].node);
  KT_EQ(keel_table_destroy(c.t), 0);
  free(stable);
}

/* --- big table, mixed readers and writers ------------------------------------ */

typedef struct mix_ctx {
  keel_table_t *t;
  size_t n; /* keys [0, n/2) are stable (held referenced); [n/2, n) churn */
  int writers;
} mix_ctx_t;

typedef struct mix_worker {
  mix_ctx_t *c;
  int id;
  long ops;
  pthread_t th;
} mix_worker_t;

static void *mix_reader(void *arg) {
  mix_worker_t *w = arg;
  mix_ctx_t *c = w->c;
  uint64_t s = 0x2545f4914f6cdd1dull + (uint64_t)w->id;
  while (!keel_load_relaxed(&stop)) {
    keel_table_read_lock();
    for (int i = 0; i < 64; i++) {
      uint64_t k = rnd(&s) % c->n;
      keel_table_node_t *n = keel_table_lookup_u64(c->t, k);
      if (n != NULL)
        check_found(n, k);
      else if (k < c->n / 2)
        kt_fail(__FILE__, __LINE__, "stable key %" PRIu64 " not found", k);
    }
    keel_table_read_unlock();
    w->ops += 64;
  }
  return NULL;
}

/* Each writer owns the churning keys k with k % writers == id: it gets,
 * removes and re-inserts them; the shrinker may evict them meanwhile. */
static void *mix_writer(void *arg) {
  mix_worker_t *w = arg;
  mix_ctx_t *c = w->c;
  uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(w->id + 1);
  size_t half = c->n / 2, span = (c->n - half) / (size_t)c->writers;
  while (!keel_load_relaxed(&stop)) {
    uint64_t k = half + (rnd(&s) % span) * (size_t)c->writers + (size_t)w->id;
    keel_table_node_t *n = keel_table_get_u64(c->t, k);
    if (n != NULL) {
      item_t *it = keel_table_entry(n, item_t, node);
      keel_fetch_add_relaxed(&it->holders, 1);
      check_found(n, k);
      int rc = keel_table_remove(c->t, n);
      if (rc != 0 && rc != KEEL_ENOENT) kt_fail(__FILE__, __LINE__, "remove: %d", rc);
      keel_fetch_sub_relaxed(&it->holders, 1);
      keel_table_put(c->t, n);
    } else {
      item_t *it = item_new(k);
      int rc = keel_table_insert(c->t, &it->node);
      if (rc == 0) {
        keel_fetch_add_relaxed(&n_inserted, 1);
        keel_table_put(c->t, &it->node);
      } else if (rc == KEEL_EEXIST) { /* an eviction was between DEAD and delete */
        free(it);
      } else {
        kt_fail(__FILE__, __LINE__, "insert: %d", rc);
      }
    }
    w->ops++;
  }
  return NULL;
}

static void *mix_shrinker(void *arg) {
  mix_worker_t *w = arg;
  while (!keel_load_relaxed(&stop)) {
    w->ops += (long)keel_table_shrink(w->c->t, 256);
    usleep(1000);
  }
  return NULL;
}

static int count_cb(keel_table_node_t *n, void *arg) {
  (void)n;
  (*(size_t *)arg)++;
  return 0;
}

/* Issue 7: 10 million entries under concurrent readers and writers. */
static void big_table_readers_writers(void) {
  size_t n = (size_t)kt_env_int("KEEL_TEST_ENTRIES", tsan_quarter(kt_scale(10000000)));
  int writers = (int)kt_env_int("KEEL_TEST_THREADS", 4);
  double secs = (double)kt_env_int("KEEL_TEST_SECONDS", 3);
  if (writers > 32) writers = 32;
  size_t half = n / 2;
  item_t *stable = calloc(half, sizeof *stable);
  KT_REQUIRE(stable != NULL);
  keel_table_config_t cfg = {.key_type = KEEL_TABLE_KEY_U64, .size_hint = n, .free_fn = item_free};
  mix_ctx_t c = {keel_table_create(&cfg), n, writers};
  KT_REQUIRE(c.t != NULL);
  /* The stall watchdog, not a fixed alarm: on 2 loaded cores the fill and
   * destroy of 10M entries took over 240 s (the alarm this replaced fired
   * there). Destroy's unlink walk (about 15 s of CPU) shows no progress,
   * hence twice the grow test's allowance. */
  long stall_s = 2 * kt_env_int("KEEL_TEST_STALL", 60);
  pthread_t wd;
  keel_store_relaxed(&watch_stop, 0);
  keel_store_relaxed(&watch_rep, 0);
  pthread_create(&wd, NULL, watchdog, &stall_s);
  double t0 = kt_now();
  long f0 = keel_load_relaxed(&n_freed), i0 = keel_load_relaxed(&n_inserted);
  /* Stable half: inserted and kept referenced, so never evicted. */
  for (size_t i = 0; i < half; i++) {
    keel_table_node_init_u64(&stable[i].node, i);
    stable[i].payload = i * PAYLOAD_MUL;
    keel_store_relaxed(&stable[i].magic, MAGIC_LIVE);
    stable[i].in_array = true;
    KT_EQ(keel_table_insert(c.t, &stable[i].node), 0);
    if ((i & 1023) == 0) keel_fetch_add_relaxed(&progress, 1);
  }
  for (size_t k = half; k < n; k++) { /* churning half, released */
    item_t *it = item_new(k);
    KT_EQ(keel_table_insert(c.t, &it->node), 0);
    keel_fetch_add_relaxed(&n_inserted, 1);
    keel_table_put(c.t, &it->node);
  }
  double t_fill = kt_now() - t0;
  KT_EQ(keel_table_count(c.t), n);
  keel_store_relaxed(&stop, 0);
  enum { READERS = 2 };
  mix_worker_t w[READERS + 32 + 1];
  int nw = 0;
  for (int i = 0; i < READERS; i++, nw++) {
    w[nw] = (mix_worker_t){&c, i, 0, 0};
    pthread_create(&w[nw].th, NULL, mix_reader, &w[nw]);
  }
  for (int i = 0; i < writers; i++, nw++) {
    w[nw] = (mix_worker_t){&c, i, 0, 0};
    pthread_create(&w[nw].th, NULL, mix_writer, &w[nw]);
  }
  w[nw] = (mix_worker_t){&c, 0, 0, 0};
  pthread_create(&w[nw].th, NULL, mix_shrinker, &w[nw]);
  nw++;
  usleep((useconds_t)(secs * 1e6));
  keel_store_relaxed(&stop, 1);
  long rops = 0, wops = 0;
  for (int i = 0; i < nw; i++) {
    pthread_join(w[i].th, NULL);
    if (i < READERS)
      rops += w[i].ops;
    else
      wops += w[i].ops;
  }
  size_t walked = 0;
  keel_table_for_each(c.t, count_cb, &walked);
  KT_EQ(walked, keel_table_count(c.t));
  KT_CHECK(walked >= half);
  /* Destroy refuses while the stable half is referenced. */
  KT_EQ(keel_table_destroy(c.t), KEEL_EBUSY);
  for (size_t i = 0; i < half; i++) keel_table_put(c.t, &stable[i].node);
  double t_d = kt_now();
  KT_EQ(keel_table_destroy(c.t), 0);
  t_d = kt_now() - t_d;
  long inserted = keel_load_relaxed(&n_inserted) - i0 + (long)half;
  KT_EQ(keel_load_relaxed(&n_freed) - f0, inserted);
  keel_store_relaxed(&watch_stop, 1);
  pthread_join(wd, NULL);
  printf("  mixed: %zu entries (fill %.1f s, destroy %.1f s), %d readers %.0f lookups/s, "
         "%d writers %.0f ops/s\n",
         n, t_fill, t_d, READERS, (double)rops / secs, writers, (double)wops / secs);
  free(stable);
}

/* --- hot keys: references against removal and eviction ----------------------- */

typedef struct hot_ctx {
  keel_table_t *t;
  int keys;
} hot_ctx_t;

static void *hot_worker(void *arg) {
  mix_worker_t *w = arg;
  hot_ctx_t *c = (hot_ctx_t *)(void *)w->c;
  uint64_t s = 0xdeadbeefcafef00dull ^ ((uint64_t)w->id << 32);
  while (!keel_load_relaxed(&stop)) {
    uint64_t k = rnd(&s) % (uint64_t)c->keys;
    switch (rnd(&s) % 9) {
      case 0: { /* insert */
        item_t *it = item_new(k);
        int rc = keel_table_insert(c->t, &it->node);
        if (rc == 0) {
          keel_fetch_add_relaxed(&n_inserted, 1);
          keel_table_put(c->t, &it->node);
        } else {
          if (rc != KEEL_EEXIST) kt_fail(__FILE__, __LINE__, "insert: %d", rc);
          free(it);
        }
        break;
      }
      case 1: { /* get, hold, maybe remove, put */
        keel_table_node_t *n = keel_table_get_u64(c->t, k);
        if (n == NULL) break;
        item_t *it = keel_table_entry(n, item_t, node);
        keel_fetch_add_relaxed(&it->holders, 1);
        check_found(n, k);
        if (rnd(&s) % 2) {
          int rc = keel_table_remove(c->t, n);
          if (rc != 0 && rc != KEEL_ENOENT) kt_fail(__FILE__, __LINE__, "remove: %d", rc);
        }
        check_found(n, k); /* still ours after removal */
        keel_fetch_sub_relaxed(&it->holders, 1);
        keel_table_put(c->t, n);
        break;
      }
      case 2: { /* remove by key */
        int rc = keel_table_remove_key(c->t, &k, sizeof k);
        if (rc != 0 && rc != KEEL_ENOENT && rc != KEEL_EBUSY)
          kt_fail(__FILE__, __LINE__, "remove_key: %d", rc);
        break;
      }
      case 3:
        keel_table_shrink(c->t, 4);
        break;
      case 4: { /* get or insert: against eviction and remove_key, the helped removal */
        item_t *it = item_new(k);
        keel_table_node_t *n = keel_table_get_or_insert(c->t, &it->node);
        if (n == NULL) kt_fail(__FILE__, __LINE__, "get_or_insert: errno %d", errno);
        if (n == &it->node) {
          keel_fetch_add_relaxed(&n_inserted, 1);
        } else {
          free(it);
          it = keel_table_entry(n, item_t, node);
        }
        keel_fetch_add_relaxed(&it->holders, 1);
        check_found(n, k);
        keel_fetch_sub_relaxed(&it->holders, 1);
        keel_table_put(c->t, n);
        break;
      }
      default: { /* lookup, take a reference inside the section */
        keel_table_read_lock();
        keel_table_node_t *n = keel_table_lookup_u64(c->t, k);
        if (n != NULL) {
          check_found(n, k);
          if (keel_table_ref(n)) {
            item_t *it = keel_table_entry(n, item_t, node);
            keel_fetch_add_relaxed(&it->holders, 1);
            keel_table_read_unlock();
            check_found(n, k);
            keel_fetch_sub_relaxed(&it->holders, 1);
            keel_table_put(c->t, n);
            break;
          }
        }
        keel_table_read_unlock();
      }
    }
    w->ops++;
  }
  return NULL;
}

/* Many threads on a few keys: every path that changes an entry's state
 * (get, ref, put, remove, remove_key, shrink, the limit) races every other;
 * an entry must never be freed while referenced nor freed twice, and every
 * inserted entry must be freed exactly once by the end. */
static void hot_keys_refcount_races(void) {
  int threads = (int)kt_env_int("KEEL_TEST_HOT_THREADS", kt_sanitized() ? 8 : 64);
  double secs = (double)kt_env_int("KEEL_TEST_SECONDS", 3);
  if (threads > 64) threads = 64;
  keel_table_config_t cfg = {
      .key_type = KEEL_TABLE_KEY_U64, .max_entries = 24, .free_fn = item_free};
  hot_ctx_t c = {keel_table_create(&cfg), 32};
  KT_REQUIRE(c.t != NULL);
  arm_alarm();
  long f0 = keel_load_relaxed(&n_freed), i0 = keel_load_relaxed(&n_inserted);
  keel_store_relaxed(&stop, 0);
  mix_worker_t w[64];
  for (int i = 0; i < threads; i++) {
    w[i] = (mix_worker_t){(mix_ctx_t *)(void *)&c, i, 0, 0};
    pthread_create(&w[i].th, NULL, hot_worker, &w[i]);
  }
  usleep((useconds_t)(secs * 1e6));
  keel_store_relaxed(&stop, 1);
  long ops = 0;
  for (int i = 0; i < threads; i++) {
    pthread_join(w[i].th, NULL);
    ops += w[i].ops;
  }
  KT_CHECK(keel_table_count(c.t) <= 32);
  KT_EQ(keel_table_destroy(c.t), 0);
  KT_EQ(keel_load_relaxed(&n_freed) - f0, keel_load_relaxed(&n_inserted) - i0);
  alarm(0);
  printf("  hot: %d threads on 32 keys: %.0f ops/s, %ld inserts\n", threads, (double)ops / secs,
         keel_load_relaxed(&n_inserted) - i0);
}

/* --- get or insert: one winner per key ----------------------------------------- */

typedef struct goi_ctx {
  keel_table_t *t;
  int keys, threads, rounds;
  pthread_barrier_t bar;
  keel_atomic(int) * winners; /* per key, this round */
  keel_atomic(long) inserted;
} goi_ctx_t;

typedef struct goi_worker {
  goi_ctx_t *c;
  int id;
  pthread_t th;
  keel_table_node_t **held; /* per key: the entry this thread holds a reference to */
} goi_worker_t;

static void *goi_thread(void *arg) {
  goi_worker_t *w = arg;
  goi_ctx_t *c = w->c;
  uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(w->id + 1);
  for (int r = 0; r < c->rounds; r++) {
    /* From a start of this thread's own, forwards or backwards, so each key
     * is raced by threads arriving at different moments. Keys are new each
     * round. */
    uint64_t start = rnd(&s) % (uint64_t)c->keys, keys = (uint64_t)c->keys;
    for (uint64_t i = 0; i < keys; i++) {
      uint64_t idx = w->id % 2 ? (start + i) % keys : (start + keys - i) % keys;
      uint64_t k = idx + (uint64_t)r * 1000003u;
      item_t *it = item_new(k);
      keel_table_node_t *n = keel_table_get_or_insert(c->t, &it->node);
      if (n == NULL) kt_fail(__FILE__, __LINE__, "get_or_insert: errno %d", errno);
      if (n == &it->node) {
        keel_fetch_add_relaxed(&c->winners[idx], 1);
        keel_fetch_add_relaxed(&c->inserted, 1);
      } else {
        if (it->node._ref != 0) kt_fail(__FILE__, __LINE__, "losing node was changed");
        free(it);
      }
      check_found(n, k);
      w->held[idx] = n;
    }
    pthread_barrier_wait(&c->bar); /* every thread holds a reference to every key */
    if (w->id == 0) {
      for (int k = 0; k < c->keys; k++) {
        if (keel_load_relaxed(&c->winners[k]) != 1)
          kt_fail(__FILE__, __LINE__, "round %d key %d: %d inserts won", r, k,
                  keel_load_relaxed(&c->winners[k]));
        keel_store_relaxed(&c->winners[k], 0);
        uint32_t v = keel_load_relaxed(node_ref(w->held[k]));
        if ((v & REF_COUNT) != (uint32_t)c->threads)
          kt_fail(__FILE__, __LINE__, "round %d key %d: %u references, %d holders", r, k,
                  v & REF_COUNT, c->threads);
      }
      if (keel_table_count(c->t) != (size_t)c->keys)
        kt_fail(__FILE__, __LINE__, "round %d: %zu entries", r, keel_table_count(c->t));
    }
    pthread_barrier_wait(&c->bar);
    for (int k = 0; k < c->keys; k++) keel_table_put(c->t, w->held[k]);
    pthread_barrier_wait(&c->bar);
    /* Unreferenced now: shrinking drops the whole round. */
    if (w->id == 0 && keel_table_shrink(c->t, (size_t)c->keys) != (size_t)c->keys)
      kt_fail(__FILE__, __LINE__, "round %d: shrink left entries", r);
    pthread_barrier_wait(&c->bar);
  }
  return NULL;
}

/* Threads race keel_table_get_or_insert on the same keys: exactly one insert
 * wins per key, every caller gets a reference to the winner, the losers'
 * nodes are untouched, and after the puts every entry is unreferenced and
 * freed exactly once (LeakSanitizer checks the losers were freed). */
static void get_or_insert_one_winner(void) {
  goi_ctx_t c = {.keys = (int)kt_env_int("KEEL_TEST_GOI_KEYS", kt_sanitized() ? 256 : 4096),
                 .threads = (int)kt_env_int("KEEL_TEST_GOI_THREADS", kt_sanitized() ? 8 : 32),
                 .rounds = (int)kt_env_int("KEEL_TEST_GOI_ROUNDS", kt_sanitized() ? 4 : 16)};
  keel_table_config_t cfg = {.key_type = KEEL_TABLE_KEY_U64, .free_fn = item_free};
  c.t = keel_table_create(&cfg);
  KT_REQUIRE(c.t != NULL);
  c.winners = calloc((size_t)c.keys, sizeof *c.winners);
  pthread_barrier_init(&c.bar, NULL, (unsigned)c.threads);
  arm_alarm();
  long f0 = keel_load_relaxed(&n_freed);
  goi_worker_t *w = calloc((size_t)c.threads, sizeof *w);
  for (int i = 0; i < c.threads; i++) {
    w[i] = (goi_worker_t){&c, i, 0, calloc((size_t)c.keys, sizeof(keel_table_node_t *))};
    pthread_create(&w[i].th, NULL, goi_thread, &w[i]);
  }
  for (int i = 0; i < c.threads; i++) {
    pthread_join(w[i].th, NULL);
    free(w[i].held);
  }
  KT_EQ(keel_load_relaxed(&c.inserted), (long)c.keys * c.rounds);
  KT_EQ(keel_table_count(c.t), 0);
  KT_EQ(keel_table_destroy(c.t), 0);
  KT_EQ(keel_load_relaxed(&n_freed) - f0, keel_load_relaxed(&c.inserted));
  alarm(0);
  pthread_barrier_destroy(&c.bar);
  free(c.winners);
  free(w);
  printf("  get_or_insert: %d threads x %d keys x %d rounds, one winner each\n", c.threads, c.keys,
         c.rounds);
}

/* Removers and the shrinker race get_or_insert on a few hot keys. A
 * get_or_insert that meets an entry a remover or the shrinker has marked
 * DEAD deletes it on the marker's behalf (help_remove), and the marker must
 * still report the removal as its own: every entry inserted is accounted
 * for exactly once, by a remove_key that returned 0, by a shrink's count,
 * or by still being in the table at the end. */
typedef struct rk_ctx {
  keel_table_t *t;
  int keys;
  long ops;
  keel_atomic(long) inserted, removed, evicted;
  keel_atomic(int) done;
} rk_ctx_t;

static void *rk_worker(void *arg) {
  rk_ctx_t *c = arg;
  uint64_t s = (uint64_t)(uintptr_t)&s | 1;
  for (long i = 0; i < c->ops; i++) {
    uint64_t k = rnd(&s) % (uint64_t)c->keys;
    item_t *it = item_new(k);
    keel_table_node_t *n = keel_table_get_or_insert(c->t, &it->node);
    if (n == NULL) kt_fail(__FILE__, __LINE__, "get_or_insert: errno %d", errno);
    if (n == &it->node)
      keel_fetch_add_relaxed(&c->inserted, 1);
    else
      free(it);
    keel_table_put(c->t, n);
    if (rnd(&s) % 4 == 0) continue; /* left cached, for the shrinker */
    int rc = keel_table_remove_key(c->t, &k, sizeof k);
    if (rc == 0)
      keel_fetch_add_relaxed(&c->removed, 1);
    else if (rc != KEEL_ENOENT && rc != KEEL_EBUSY)
      kt_fail(__FILE__, __LINE__, "remove_key: %d", rc);
  }
  return NULL;
}

static void *rk_shrinker(void *arg) {
  rk_ctx_t *c = arg;
  while (!keel_load_relaxed(&c->done)) {
    keel_fetch_add_relaxed(&c->evicted, (long)keel_table_shrink(c->t, 2));
    sched_yield();
  }
  return NULL;
}

static void remove_key_accounting(void) {
  rk_ctx_t c = {.keys = 4, .ops = tsan_quarter(kt_sanitized() ? 50000 : 400000)};
  keel_table_config_t cfg = {.key_type = KEEL_TABLE_KEY_U64, .free_fn = item_free};
  c.t = keel_table_create(&cfg);
  KT_REQUIRE(c.t != NULL);
  arm_alarm();
  long f0 = keel_load_relaxed(&n_freed);
  enum { W = 4 };
  pthread_t th[W], sh;
  pthread_create(&sh, NULL, rk_shrinker, &c);
  for (int i = 0; i < W; i++) pthread_create(&th[i], NULL, rk_worker, &c);
  for (int i = 0; i < W; i++) pthread_join(th[i], NULL);
  keel_store_relaxed(&c.done, 1);
  pthread_join(sh, NULL);
  long ins = keel_load_relaxed(&c.inserted), rem = keel_load_relaxed(&c.removed),
       ev = keel_load_relaxed(&c.evicted), left = (long)keel_table_count(c.t);
  printf("  remove_key: %ld inserted, %ld removed by key, %ld evicted, %ld left\n", ins, rem, ev,
         left);
  KT_EQ(rem + ev + left, ins);
  KT_EQ(keel_table_destroy(c.t), 0);
  KT_EQ(keel_load_relaxed(&n_freed) - f0, ins);
  alarm(0);
}

KT_MAIN(KT_CASE(hot_keys_refcount_races), KT_CASE(grow_from_tiny_repeatedly),
        KT_CASE(resizes_under_readers_and_walkers), KT_CASE(big_table_readers_writers),
        KT_CASE(get_or_insert_one_winner), KT_CASE(remove_key_accounting))
