/* Benchmark suite "table": keel's resource table against the DLM-style fixed
 * tables and raw rculfhash (issue 7).
 *
 * Each run builds a table of N entries with 8-byte keys (N = 1M x --size:
 * 1M by default, 10M with --size large, 16M with --size 16), untimed, then
 * measures one operation for a fixed window of 0.2 s on `threads` threads:
 *   insert      new keys into the table of N (duplicate check included;
 *               keel releases each entry after inserting it, so it is cached)
 *   lookup_hit  random present keys
 *   lookup_miss random absent keys
 *   remove      random present keys, by key
 * A window rather than a fixed count keeps a slow peer (1,024 lists of 10,000
 * entries) from costing the suite more time than a fast one; the build is
 * what dominates (0.3-0.6 s of CPU per child at 1M, so the default suite,
 * 5 impls x 4 cases x 4 thread counts x 3 repetitions = 240 children, takes
 * about 2.5 minutes on 2 idle cores). The default thread list leaves out 8
 * (make bench must finish every suite in 15 minutes on 2 cores); give
 * --threads 1,2,8,64,256 for the full list. At --size large or 16 a child builds
 * 10M or 16M entries (5-20 s each): pick cases, impls and threads, e.g.
 *   keel-bench table --size 16 --case lookup_hit --threads 2 --reps 3
 * Extras on every case: bytes_per_entry, cpu_ns_per_op (the workers' CPU time
 * per operation, the figure to compare on a shared machine, where wall-clock
 * rates mostly measure the other tenants) and build_s.
 *
 * Entries live in one slab per run (the caller's memory, as an intrusive
 * table expects), so no impl pays malloc per entry except rbtree-1024, whose
 * glibc tree allocates its own nodes. Extra "bytes_per_entry" is
 * (RSS after the build - RSS before) / N: slab plus the table's own memory,
 * so keel's 40-byte node (key included) and 8-byte buckets and rculfhash's
 * 24-byte node and 16-byte buckets are compared as they are. keel's rows
 * also give its index's buckets and resizes after the build. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <keel/table.h>

#include "baseline_table.h"
#include "base/clock.h"
#include "bench.h"

#define TB_WINDOW_S 0.2

/* --- keel behind the common interface --------------------------------------- */

static void *keel_create(size_t expected) {
  keel_table_config_t c = {.key_type = KEEL_TABLE_KEY_U64, .size_hint = expected};
  return keel_table_create(&c);
}
static void keel_node_init(void *node, uint64_t key) {
  keel_table_node_init_u64(node, key);
}
static int keel_insert(void *t, void *node) {
  int rc = keel_table_insert(t, node);
  if (rc == 0) keel_table_put(t, node); /* cached, unreferenced: the common state */
  return rc;
}
static void keel_load(void *t, void *node) {
  (void)keel_insert(t, node);
}
static int keel_lookup(void *t, uint64_t key) {
  keel_table_read_lock();
  int found = keel_table_lookup_u64(t, key) != NULL;
  keel_table_read_unlock();
  return found;
}
static int keel_remove(void *t, uint64_t key) {
  return keel_table_remove_key(t, &key, sizeof key);
}

static const tb_impl_t keel_impl = {"keel",      sizeof(keel_table_node_t),
                                    keel_create, keel_node_init,
                                    keel_load,   keel_insert,
                                    keel_lookup, keel_remove,
                                    NULL,        NULL};

static const tb_impl_t *impl_find(const char *name) {
  return strcmp(name, "keel") == 0 ? &keel_impl : tb_baseline(name);
}

/* --- runs -------------------------------------------------------------------- */

enum tb_op { TB_INSERT, TB_HIT, TB_MISS, TB_REMOVE };

typedef struct tb_run {
  const tb_impl_t *impl;
  void *table;
  char *slab;
  size_t n;
  int threads;
  enum tb_op op;
  _Atomic uint64_t start_ns; /* the window opens when the first worker starts */
  _Atomic long ops;
  _Atomic uint64_t end_ns; /* latest worker finish */
  _Atomic uint64_t cpu_ns; /* workers' CPU time in the window, summed */
} tb_run_t;

static void *slab_at(tb_run_t *r, size_t i) {
  return r->slab + i * r->impl->node_size;
}

/* Build: two threads insert disjoint halves where the impl is thread-safe
 * (all are; the list tables' bulk load is not, so they load alone). */
static void build_worker(int i, void *arg) {
  tb_run_t *r = arg;
  bool parallel = r->impl->thread_start != NULL || r->impl == &keel_impl;
  if (!parallel && i != 0) return;
  int step = parallel ? 2 : 1;
  if (r->impl->thread_start) r->impl->thread_start();
  for (size_t k = (size_t)i; k < r->n; k += (size_t)step) {
    void *node = slab_at(r, k);
    r->impl->node_init(node, k);
    r->impl->load(r->table, node);
  }
  if (r->impl->thread_end) r->impl->thread_end();
}

static uint64_t window_deadline(tb_run_t *r) {
  uint64_t zero = 0, now = keel_clock_ns();
  if (!atomic_compare_exchange_strong(&r->start_ns, &zero, now)) now = zero;
  return now + (uint64_t)(TB_WINDOW_S * 1e9);
}

static void note_end(tb_run_t *r) {
  uint64_t now = keel_clock_ns(), cur = atomic_load(&r->end_ns);
  while (now > cur && !atomic_compare_exchange_weak(&r->end_ns, &cur, now)) {}
}

/* Fresh entries for timed inserts come from per-thread chunks. */
#define TB_CHUNK 65536

typedef struct tb_worker {
  tb_run_t *r;
  uint64_t seed;
  char *chunk;
  size_t used;                               /* entries used in chunk */
  uint64_t next_new;                         /* next key to insert (stripes of the keys above n) */
  size_t stripe, base, pos, stride, removed; /* remove: this thread's keys, permuted */
  long bad;
} tb_worker_t;

/* One operation; false when a remover has no key left. */
static bool one_op(tb_worker_t *w) {
  tb_run_t *r = w->r;
  const tb_impl_t *im = r->impl;
  switch (r->op) {
    case TB_HIT:
      w->bad += !im->lookup(r->table, kb_rand(&w->seed) % r->n);
      return true;
    case TB_MISS:
      w->bad += im->lookup(r->table, r->n + kb_rand(&w->seed) % r->n);
      return true;
    case TB_INSERT: {
      if (w->chunk == NULL || w->used == TB_CHUNK) {
        w->chunk = calloc(TB_CHUNK, im->node_size);
        w->used = 0;
      }
      void *node = w->chunk + w->used++ * im->node_size;
      im->node_init(node, w->next_new);
      w->next_new += (uint64_t)r->threads;
      w->bad += im->insert(r->table, node) != 0;
      return true;
    }
    case TB_REMOVE:
      if (w->removed == w->stripe) return false;
      w->bad += im->remove(r->table, w->base + w->pos) != 0;
      w->pos = (w->pos + w->stride) % w->stripe; /* stride is coprime to stripe */
      w->removed++;
      return true;
  }
  return false;
}

static size_t gcd(size_t a, size_t b) {
  while (b) {
    size_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

static void measure_worker(int i, void *arg) {
  tb_run_t *r = arg;
  if (r->impl->thread_start) r->impl->thread_start();
  tb_worker_t w = {.r = r, .seed = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1)};
  w.next_new = r->n + (uint64_t)i;
  w.stripe = r->n / (size_t)r->threads;
  w.base = (size_t)i * w.stripe;
  if (w.stripe > 0) {
    w.pos = kb_rand(&w.seed) % w.stripe;
    w.stride = (size_t)(kb_rand(&w.seed) % w.stripe) | 1;
    while (gcd(w.stride, w.stripe) != 1) w.stride += 2;
  }
  uint64_t deadline = window_deadline(r), cpu0 = kb_thread_cpu_ns();
  long ops = 0;
  for (bool more = true; more;) {
    for (int j = 0; j < 64 && (more = one_op(&w)); j++) ops++;
    if (keel_clock_ns() >= deadline) more = false;
  }
  note_end(r);
  atomic_fetch_add(&r->cpu_ns, kb_thread_cpu_ns() - cpu0);
  atomic_fetch_add(&r->ops, ops);
  if (w.bad) fprintf(stderr, "table bench: %s: %ld unexpected results\n", r->impl->name, w.bad);
  if (r->impl->thread_end) r->impl->thread_end();
}

static int tb_case(const kb_params_t *p, kb_result_t *res, enum tb_op op) {
  tb_run_t *r = calloc(1, sizeof *r);
  r->impl = impl_find(p->impl);
  if (r->impl == NULL) {
    fprintf(stderr, "table bench: no impl %s\n", p->impl);
    return 1;
  }
  r->n = (size_t)(1000000 * p->scale);
  if (r->n < 1000) r->n = 1000;
  r->threads = p->threads;
  r->op = op;
  size_t rss0 = kb_rss_kb();
  r->slab = calloc(r->n, r->impl->node_size);
  r->table = r->impl->create(r->n);
  if (r->slab == NULL || r->table == NULL) {
    fprintf(stderr, "table bench: out of memory for %zu entries\n", r->n);
    return 1;
  }
  double tb = kb_now();
  kb_run_threads(2, build_worker, r);
  tb = kb_now() - tb;
  size_t rss1 = kb_rss_kb();
  if (r->impl == &keel_impl) {
    keel_table_stats_t st;
    keel_table_stats(r->table, &st);
    kb_extra(res, "buckets", (double)st.buckets);
    kb_extra(res, "resizes", (double)st.resizes);
    kb_extra(res, "resizing", st.resizing);
  }
  kb_run_threads(p->threads, measure_worker, r);
  res->ops = (double)atomic_load(&r->ops);
  res->seconds = (double)(atomic_load(&r->end_ns) - atomic_load(&r->start_ns)) / 1e9;
  kb_extra(res, "entries", (double)r->n);
  kb_extra(res, "bytes_per_entry", (double)(rss1 - rss0) * 1024.0 / (double)r->n);
  kb_extra(res, "node_bytes", (double)r->impl->node_size);
  kb_extra(res, "build_s", tb);
  /* CPU time per operation: on a shared machine, wall-clock rates mostly
   * measure the other tenants; CPU time still includes cache misses. */
  kb_extra(res, "cpu_ns_per_op", (double)atomic_load(&r->cpu_ns) / (res->ops ? res->ops : 1));
  return 0; /* the child exits; tearing down 16M entries is not measured */
}

static int tb_insert(const kb_params_t *p, kb_result_t *r) {
  return tb_case(p, r, TB_INSERT);
}
static int tb_hit(const kb_params_t *p, kb_result_t *r) {
  return tb_case(p, r, TB_HIT);
}
static int tb_miss(const kb_params_t *p, kb_result_t *r) {
  return tb_case(p, r, TB_MISS);
}
static int tb_remove(const kb_params_t *p, kb_result_t *r) {
  return tb_case(p, r, TB_REMOVE);
}

static const kb_impl_t tb_impls[] = {{"keel", NULL},        {"rculfhash", NULL}, {"list-16k", NULL},
                                     {"rbtree-1024", NULL}, {"list-1024", NULL}, {NULL, NULL}};

/* lookup_hit also runs rculfhash-40 (its node padded to keel's 40 bytes):
 * keel against it measures keel's index with the node size equal; keel
 * against rculfhash adds the cost of keel's larger node in cache and TLB. */
static const kb_impl_t tb_impls_hit[] = {
    {"keel", NULL},     {"rculfhash", NULL},   {"rculfhash-40", NULL},
    {"list-16k", NULL}, {"rbtree-1024", NULL}, {"list-1024", NULL},
    {NULL, NULL}};

static const kb_case_t tb_cases[] = {
    {"lookup_hit", "random present keys, one read-side section each", tb_hit, tb_impls_hit, true,
     NULL, false},
    {"lookup_miss", "random absent keys", tb_miss, tb_impls, true, NULL, false},
    {"insert", "new keys into a table of N (keel: insert + put)", tb_insert, tb_impls, true, NULL,
     false},
    {"remove", "present keys, by key", tb_remove, tb_impls, true, NULL, false},
    {NULL}};

KB_SUITE(table, {"table",
                 "RCU resource table vs DLM-style fixed hash tables and raw rculfhash "
                 "(N = 1M x --size)",
                 tb_cases, "1,2,64,256", NULL})
