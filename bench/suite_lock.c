/* Benchmark suite "lock": keel's lock manager and keel_mutex (issue 7).
 *
 * Cases
 *   rmrf     the `rm -rf` analogue: for each of N resources take EX and
 *            release it, leaving the resource to be dropped by the cache
 *            limit (1M resources, keel's default). N = 1M at the default
 *            size, 16M with --size large (else 1M x the size's scale).
 *            Peers: the same lock logic over fixed tables of 1,024 and 16K
 *            list buckets and 1,024 rbtree buckets. A peer is stopped after
 *            3 s x scale and its rate taken over what it did: its table was
 *            then smaller than at the end, so its rate is flattered and the
 *            ratio to keel is a lower bound.
 *   mix      contended: 16 hot resources, 90% PR and 10% EX, lock and unlock
 *            by name, for a fixed window; threads 1..256 (oversubscribed).
 *   byname   uncontended lock + unlock by name of one cached resource
 *            (ns_per_op is one pair). Target: <= 300 ns.
 *   handle   uncontended lock + unlock by handle: convert a held NL lock to
 *            EX and back (one pair per op). Target: <= 100 ns.
 *   mutex    keel_mutex vs pthread_mutex vs pthread_spinlock: a short
 *            critical section and a little work outside it, for a fixed
 *            window; at 64 and 256 threads on few cores the spinlock's
 *            preempted holders make spinners burn whole time slices.
 * Throughput cases run for 0.3 s x scale, reading the clock once per 64 ops.
 * byname and handle also report best_batch_ns, the fastest batch of 64 pairs:
 * on a shared, loaded machine the median includes preemptions, the best batch
 * is the code's own cost.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <keel/lock.h>

#include "baseline_lock_tables.h"
#include "bench.h"

#define LB_CACHE (1u << 20) /* keel's default cache_max, given to the peers too */

/* The directory under test: keel's lockspace or a fixed table. */
typedef struct lb_dir {
  keel_lockspace_t *ls;
  bl_table_t *bl;
} lb_dir_t;

static int lb_open(const kb_params_t *p, lb_dir_t *d) {
  memset(d, 0, sizeof(*d));
  if (strcmp(p->impl, "keel") == 0) {
    keel_lockspace_config_t c = {.cache_max = LB_CACHE};
    d->ls = keel_lockspace_create(&c);
  } else if (strcmp(p->impl, "list-1024") == 0) {
    d->bl = bl_create(BL_LIST, 1024, LB_CACHE);
  } else if (strcmp(p->impl, "list-16k") == 0) {
    d->bl = bl_create(BL_LIST, 16384, LB_CACHE);
  } else if (strcmp(p->impl, "rbtree-1024") == 0) {
    d->bl = bl_create(BL_RBTREE, 1024, LB_CACHE);
  } else {
    fprintf(stderr, "lock bench: unknown impl %s\n", p->impl);
    return -1;
  }
  return d->ls || d->bl ? 0 : -1;
}

static void lb_close(lb_dir_t *d) {
  if (d->ls) keel_lockspace_release(d->ls, 0);
  if (d->bl) bl_destroy(d->bl);
}

static inline int lb_lock(lb_dir_t *d, const void *name, size_t len, int mode, keel_lksb_t *s) {
  return d->ls ? keel_lock(d->ls, name, len, mode, 0, s, NULL, NULL, NULL)
               : bl_lock(d->bl, name, len, mode, 0, s);
}

static inline int lb_unlock(lb_dir_t *d, keel_lksb_t *s) {
  return d->ls ? keel_unlock(s, 0) : bl_unlock(d->bl, s);
}

/* A GFS2-like glock name: lock type and inode number, 16 bytes. */
typedef struct lb_name {
  uint64_t type, number;
} lb_name_t;

static const kb_impl_t lb_dir_impls[] = {
    {"keel", NULL}, {"list-1024", NULL}, {"list-16k", NULL}, {"rbtree-1024", NULL}, {NULL, NULL}};

/* ---- rmrf --------------------------------------------------------------- */

static int lb_rmrf(const kb_params_t *p, kb_result_t *r) {
  uint64_t n = strcmp(p->size, "large") == 0 ? (16u << 20) : (uint64_t)((1u << 20) * p->scale);
  double cap = 3.0 * p->scale;
  lb_dir_t d;
  if (lb_open(p, &d) != 0) return -1;
  keel_lksb_t s = {0};
  lb_name_t name = {.type = 2};
  uint64_t i = 0;
  double t0 = kb_now(), stop = t0 + cap;
  for (; i < n; i++) {
    name.number = i * 0x9e3779b97f4a7c15ull; /* inode numbers, scattered */
    if (lb_lock(&d, &name, sizeof(name), KEEL_LOCK_EX, &s) != 0) abort();
    lb_unlock(&d, &s);
    if (d.bl && (i & 1023) == 0 && kb_now() > stop) break;
  }
  r->seconds = kb_now() - t0;
  r->ops = (double)i;
  kb_extra(r, "resources", (double)n);
  kb_extra(r, "done_fraction", (double)i / (double)n);
  kb_extra(r, "cached_at_end", d.ls ? 0 : (double)bl_count(d.bl));
  lb_close(&d);
  return 0;
}

/* ---- mix ---------------------------------------------------------------- */

#define LB_HOT 16

typedef struct lb_mix {
  lb_dir_t d;
  double stop;
  long ops;                 /* atomic */
  uint64_t counter[LB_HOT]; /* written under EX only */
} lb_mix_t;

static void lb_mix_thread(int id, void *arg) {
  lb_mix_t *m = arg;
  uint64_t seed = 0x2545f4914f6cdd1dull * (uint64_t)(id + 1);
  lb_name_t name = {.type = 2};
  keel_lksb_t s = {0};
  long ops = 0;
  for (;;) {
    for (int k = 0; k < 64; k++) {
      uint64_t x = kb_rand(&seed);
      int h = (int)(x % LB_HOT);
      int mode = (x >> 32) % 10 == 0 ? KEEL_LOCK_EX : KEEL_LOCK_PR;
      name.number = (uint64_t)h;
      lb_lock(&m->d, &name, sizeof(name), mode, &s);
      if (mode == KEEL_LOCK_EX)
        m->counter[h]++;
      else
        kb_escape(m->counter[h]);
      lb_unlock(&m->d, &s);
    }
    ops += 64;
    if (kb_now() > m->stop) break;
  }
  __atomic_fetch_add(&m->ops, ops, __ATOMIC_RELAXED);
}

static int lb_mix(const kb_params_t *p, kb_result_t *r) {
  lb_mix_t *m = calloc(1, sizeof(*m));
  if (lb_open(p, &m->d) != 0) return -1;
  m->stop = kb_now() + 0.3 * p->scale;
  r->seconds = kb_run_threads(p->threads, lb_mix_thread, m);
  r->ops = (double)m->ops;
  lb_close(&m->d);
  free(m);
  return 0;
}

/* ---- byname, handle ----------------------------------------------------- */

static int lb_byname(const kb_params_t *p, kb_result_t *r) {
  lb_dir_t d;
  if (lb_open(p, &d) != 0) return -1;
  lb_name_t name = {.type = 2, .number = 42};
  keel_lksb_t s = {0};
  lb_lock(&d, &name, sizeof(name), KEEL_LOCK_EX, &s); /* create it: then cached */
  lb_unlock(&d, &s);
  double t0 = kb_now(), stop = t0 + 0.3 * p->scale, best = 1e9, t = t0;
  long ops = 0;
  do {
    for (int k = 0; k < 64; k++) {
      lb_lock(&d, &name, sizeof(name), KEEL_LOCK_EX, &s);
      lb_unlock(&d, &s);
    }
    ops += 64;
    double u = kb_now();
    if (u - t < best) best = u - t;
    t = u;
  } while (t < stop);
  r->seconds = kb_now() - t0;
  r->ops = (double)ops;
  kb_extra(r, "best_batch_ns", best * 1e9 / 64);
  lb_close(&d);
  return 0;
}

static int lb_handle(const kb_params_t *p, kb_result_t *r) {
  keel_lockspace_t *ls = keel_lockspace_create(NULL);
  lb_name_t name = {.type = 2, .number = 42};
  keel_lksb_t s = {0};
  if (ls == NULL || keel_lock(ls, &name, sizeof(name), KEEL_LOCK_NL, 0, &s, NULL, NULL, NULL))
    return -1;
  double t0 = kb_now(), stop = t0 + 0.3 * p->scale, best = 1e9, t = t0;
  long ops = 0;
  do {
    for (int k = 0; k < 64; k++) {
      keel_lock_convert(&s, KEEL_LOCK_EX, 0);
      keel_lock_convert(&s, KEEL_LOCK_NL, 0);
    }
    ops += 64;
    double u = kb_now();
    if (u - t < best) best = u - t;
    t = u;
  } while (t < stop);
  r->seconds = kb_now() - t0;
  r->ops = (double)ops;
  kb_extra(r, "best_batch_ns", best * 1e9 / 64);
  keel_unlock(&s, 0);
  keel_lockspace_release(ls, 0);
  return 0;
}

/* ---- mutex -------------------------------------------------------------- */

typedef struct lb_mtx {
  int kind; /* 0 keel, 1 pthread_mutex, 2 pthread_spinlock */
  keel_mutex_t km;
  pthread_mutex_t pm;
  pthread_spinlock_t ps;
  double stop;
  uint64_t shared; /* under the lock */
  long ops;        /* atomic */
} lb_mtx_t;

static inline void lb_mtx_lock(lb_mtx_t *m) {
  if (m->kind == 0)
    keel_mutex_lock(&m->km);
  else if (m->kind == 1)
    pthread_mutex_lock(&m->pm);
  else
    pthread_spin_lock(&m->ps);
}

static inline void lb_mtx_unlock(lb_mtx_t *m) {
  if (m->kind == 0)
    keel_mutex_unlock(&m->km);
  else if (m->kind == 1)
    pthread_mutex_unlock(&m->pm);
  else
    pthread_spin_unlock(&m->ps);
}

/* ~20 ns of dependent arithmetic. */
static inline uint64_t lb_work(uint64_t x, int n) {
  for (int i = 0; i < n; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
  return x;
}

static void lb_mtx_thread(int id, void *arg) {
  lb_mtx_t *m = arg;
  uint64_t x = (uint64_t)id;
  long ops = 0;
  for (;;) {
    for (int k = 0; k < 64; k++) {
      lb_mtx_lock(m);
      m->shared = lb_work(m->shared, 8); /* the critical section */
      lb_mtx_unlock(m);
      x = lb_work(x, 32); /* work outside it */
    }
    ops += 64;
    if (kb_now() > m->stop) break;
  }
  kb_escape(x);
  __atomic_fetch_add(&m->ops, ops, __ATOMIC_RELAXED);
}

static int lb_mutex(const kb_params_t *p, kb_result_t *r) {
  lb_mtx_t *m = calloc(1, sizeof(*m));
  m->kind = strcmp(p->impl, "keel_mutex") == 0 ? 0 : strcmp(p->impl, "pthread_mutex") == 0 ? 1 : 2;
  keel_mutex_init(&m->km);
  pthread_mutex_init(&m->pm, NULL);
  pthread_spin_init(&m->ps, PTHREAD_PROCESS_PRIVATE);
  m->stop = kb_now() + 0.3 * p->scale;
  r->seconds = kb_run_threads(p->threads, lb_mtx_thread, m);
  r->ops = (double)m->ops;
  free(m);
  return 0;
}

static const kb_impl_t lb_keel_only[] = {{"keel", NULL}, {NULL, NULL}};
static const kb_impl_t lb_mutex_impls[] = {
    {"keel_mutex", NULL}, {"pthread_mutex", NULL}, {"pthread_spin", NULL}, {NULL, NULL}};

static const kb_case_t lb_cases[] = {
    {"rmrf", "rm -rf analogue: EX+unlock on each of N resources (1M; 16M with --size large)",
     lb_rmrf, lb_dir_impls, false, NULL, false},
    {"mix", "16 hot resources, 90% PR / 10% EX by name", lb_mix, lb_dir_impls, true, NULL, false},
    {"byname", "uncontended lock+unlock by name (ns_per_op: one pair; target <= 300)", lb_byname,
     lb_dir_impls, false, "ns_per_op", true},
    {"handle", "uncontended lock+unlock by handle (ns_per_op: one pair; target <= 100)", lb_handle,
     lb_keel_only, false, "ns_per_op", true},
    {"mutex", "keel_mutex vs pthread_mutex vs pthread_spinlock, short critical section", lb_mutex,
     lb_mutex_impls, true, NULL, false},
    {NULL}};

KB_SUITE(lock, {"lock", "DLM-style lock manager over keel's table vs fixed tables; keel_mutex",
                lb_cases, "1,2,8,64,256", NULL})
