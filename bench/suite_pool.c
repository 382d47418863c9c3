/* Benchmark suite "pool": keel's object pools against plain malloc under
 * every allocator and against GlusterFS's old locked pools (issue 5, part 6).
 *
 * Case "gluster" models a GlusterFS server with brick multiplexing: B bricks
 * (80) share one process, each served by T threads, so --threads 80..320
 * means T = 1..4 (a thread count below B gives B = threads, T = 1). Every
 * thread does create, write and unlink of F files (10000 x --size); each of
 * those file operations allocates a dict (128 B), a call stub (512 B) and a
 * frame (256 B), writes into them, frees the dict and the stub itself and,
 * for every other operation, hands the frame to another thread of its brick
 * (the next brick's when T = 1) which frees it: the reply path. Hand-offs go
 * through one single-producer ring per thread (256 slots; a full ring means
 * the sender frees the frame itself), the same code for every impl.
 *
 * Impls: "keel-pool" (three keel pools on keel's heap, linked in, with the
 * opt-in inline fast paths of keel/pool.h), "keel-pool-call" (the same
 * pools through the library's functions, what a program gets without
 * KEEL_POOL_INLINE), plain
 * malloc/free under each allocator (the harness preloads it), and the old
 * GlusterFS pools with a global mutex or spinlock per object type (bench/
 * baseline_locked_pools.c, over glibc malloc, arenas of 4096 objects as
 * GlusterFS sized its dict pool).
 *
 * Idle memory: every run sets pool_sweep_s (and keel's heap_purge_ms) to
 * N = 100 ms. Workers first allocate and free one object of each type and
 * touch 16 KiB of stack, then RSS is read with every thread alive and idle
 * ("rss_pre_kb"); after the load they stay alive, idle, for 2N seconds
 * (plus 10% for the length of a sweep pass) and RSS is read again ("rss_idle_kb", "idle_rss_pct" = growth over pre-load
 * in %; "idle_cached_bytes" for keel's pools). Case "idle" reports that figure
 * as its metric at 320 threads.
 *
 * "load_cpu_s" and "ops_per_cpu_s" give the process's user+sys time over
 * the load alone ("load_user_s" and "load_sys_s" split it): on a shared
 * machine wall time (ops_per_s) also measures the other tenants, CPU time
 * much less so.
 *
 * Case "hot": one thread allocating and freeing one 256-byte object in a
 * loop, i.e. the cost of an alloc+free pair from the hot list (ns_per_op).
 *
 * Size: F = 10000, not the 1000. At 1000 a keel-pool run at 320
 * threads lasted about 20 ms, shorter than the thread start-up it sits
 * between, and the figures were noise. At 10000 the whole suite (3 cases,
 * 9 impls, 3 repetitions) takes about 2 min on the 2-core development
 * machine (127 s in `make bench`); the spinlock pool is most of it. Each worker also stops at a 2 s x size deadline, so
 * a pathological impl cannot stall the suite; ops counts only what was
 * done. */
#define _GNU_SOURCE
#include <alloca.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <keel/keel.h>
#define KEEL_POOL_INLINE
#include <keel/pool.h>

#include "baseline_locked_pools.h"
#include "base/clock.h"
#include "bench.h"

enum { GL_DICT, GL_STUB, GL_FRAME, GL_TYPES };
static const size_t gl_size[GL_TYPES] = {128, 512, 256};
static const char *const gl_name[GL_TYPES] = {"dict", "call-stub", "frame"};

#define GL_BRICKS      80
#define GL_FILES       10000
#define GL_RING        256
#define GL_SWEEP_MS    100
#define GL_ARENA_COUNT 4096

typedef enum { GL_POOL, GL_POOL_CALL, GL_MALLOC, GL_MUTEX, GL_SPIN } gl_kind_t;

/* A single-producer single-consumer ring: the producer is the one thread
 * whose partner owns the ring. head and tail on their own lines. */
typedef struct gl_ring {
  _Atomic uint32_t head __attribute__((aligned(64))); /* consumer's */
  _Atomic uint32_t tail __attribute__((aligned(64))); /* producer's */
  void *slot[GL_RING];
} gl_ring_t;

typedef struct gl_ctx {
  gl_kind_t kind;
  keel_pool_t *pool[GL_TYPES];
  kb_locked_pool_t *lp[GL_TYPES];
  int threads, bricks;
  long files;
  double deadline_s;
  gl_ring_t *rings;
  pthread_barrier_t bar;
  _Atomic uint64_t start_ns, end_ns;
  _Atomic long ops;
  size_t rss_pre_kb, rss_idle_kb;
  double cpu_start_s, cpu_end_s; /* process user+sys at the start and end of the load */
  double sys_start_s, sys_end_s; /* the sys part of it */
  uint64_t idle_cached;
} gl_ctx_t;

/* User + sys seconds of the whole process so far, and the sys part. */
static double gl_cpu_s(double *sys) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  *sys = (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 + *sys;
}

/* keel's pools, inline or called. */
static inline bool gl_keel(const gl_ctx_t *c) {
  return c->kind == GL_POOL || c->kind == GL_POOL_CALL;
}

static inline void *gl_alloc(gl_ctx_t *c, int t) {
  void *p;
  switch (c->kind) {
    case GL_POOL:
      p = keel_pool_alloc(c->pool[t]);
      break;
    case GL_POOL_CALL:
      p = (keel_pool_alloc)(c->pool[t]);
      break;
    case GL_MALLOC:
      p = malloc(gl_size[t]);
      break;
    default:
      p = kb_locked_pool_alloc(c->lp[t]);
      break;
  }
  if (p == NULL) {
    fprintf(stderr, "pool bench: allocation of a %s failed\n", gl_name[t]);
    abort();
  }
  return p;
}

static inline void gl_free(gl_ctx_t *c, int t, void *p) {
  switch (c->kind) {
    case GL_POOL:
      keel_pool_free(c->pool[t], p);
      break;
    case GL_POOL_CALL:
      (keel_pool_free)(c->pool[t], p);
      break;
    case GL_MALLOC:
      free(p);
      break;
    default:
      kb_locked_pool_free(c->lp[t], p);
      break;
  }
}

/* Thread i's partner: the next thread of its brick, or of the next brick
 * when bricks have one thread. A permutation, so every ring has one
 * producer. */
static int gl_partner(const gl_ctx_t *c, int i) {
  if (c->threads <= c->bricks) return (i + 1) % c->threads;
  int next = i + c->bricks;
  return next < c->threads ? next : i % c->bricks;
}

static bool gl_send(gl_ring_t *r, void *p) {
  uint32_t t = atomic_load_explicit(&r->tail, memory_order_relaxed);
  /* Acquire: the consumer is done with the slot before we reuse it. */
  if (t - atomic_load_explicit(&r->head, memory_order_acquire) == GL_RING) return false;
  r->slot[t % GL_RING] = p;
  atomic_store_explicit(&r->tail, t + 1, memory_order_release); /* publishes the slot */
  return true;
}

static void gl_drain(gl_ctx_t *c, gl_ring_t *r) {
  uint32_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
  uint32_t t = atomic_load_explicit(&r->tail, memory_order_acquire); /* pairs with gl_send */
  if (h == t) return;
  for (; h != t; h++) {
    char *f = r->slot[h % GL_RING];
    f[8] = 2; /* the reply writes the frame before it goes */
    gl_free(c, GL_FRAME, f);
  }
  atomic_store_explicit(&r->head, h, memory_order_release); /* slots free for reuse */
}

/* One file operation: the three allocations, some writes, the frees. */
static inline void gl_fop(gl_ctx_t *c, gl_ring_t *to, int op, long f) {
  char *d = gl_alloc(c, GL_DICT);
  char *s = gl_alloc(c, GL_STUB);
  char *fr = gl_alloc(c, GL_FRAME);
  memset(d, op, 64);                      /* dict: a few key/value slots */
  memset(s, (int)f, op == 1 ? 512 : 128); /* stub: args; a write carries more */
  memset(fr, 0, 64);                      /* frame: the call's root */
  kb_escape(d);
  kb_escape(s);
  gl_free(c, GL_DICT, d);
  gl_free(c, GL_STUB, s);
  if (((f + op) & 1) == 0 || !gl_send(to, fr)) gl_free(c, GL_FRAME, fr);
}

static void gl_worker(int i, void *arg) {
  gl_ctx_t *c = arg;
  gl_ring_t *mine = &c->rings[i], *to = &c->rings[gl_partner(c, i)];
  /* Warm-up: the allocator's per-thread state and the stack depth the load
   * reaches exist before the pre-load RSS is read. */
  volatile char *stack = alloca(16 << 10);
  memset((char *)stack, 0, 16 << 10);
  for (int t = 0; t < GL_TYPES; t++) gl_free(c, t, gl_alloc(c, t));
  if (pthread_barrier_wait(&c->bar) == PTHREAD_BARRIER_SERIAL_THREAD) {
    c->rss_pre_kb = kb_rss_kb();
    c->cpu_start_s = gl_cpu_s(&c->sys_start_s);
    atomic_store(&c->start_ns, keel_clock_ns());
  }
  pthread_barrier_wait(&c->bar);
  uint64_t deadline = atomic_load(&c->start_ns) + (uint64_t)(c->deadline_s * 1e9);
  long f, done = 0;
  for (f = 0; f < c->files; f++) {
    for (int op = 0; op < 3; op++) { /* create, write, unlink */
      gl_drain(c, mine);
      gl_fop(c, to, op, f);
    }
    done += 3;
    if ((f & 63) == 63 && keel_clock_ns() > deadline) break;
  }
  /* The end of the timed region is the last worker's finish. */
  uint64_t now = keel_clock_ns(), prev = atomic_load(&c->end_ns);
  while (now > prev && !atomic_compare_exchange_weak(&c->end_ns, &prev, now)) {}
  atomic_fetch_add(&c->ops, done);
  /* Nobody sends any more; CPU time of the load, on a machine whose other
   * tenants make wall time noisy, is read here. */
  if (pthread_barrier_wait(&c->bar) == PTHREAD_BARRIER_SERIAL_THREAD)
    c->cpu_end_s = gl_cpu_s(&c->sys_end_s);
  gl_drain(c, mine);
  if (pthread_barrier_wait(&c->bar) == PTHREAD_BARRIER_SERIAL_THREAD) {
    /* Idle, every thread alive, 2N (+10%: the sweeper's bound is two
     * periods plus one pass, and the last frees were the drains above). */
    usleep(2 * GL_SWEEP_MS * 1100);
    c->rss_idle_kb = kb_rss_kb();
    if (gl_keel(c)) {
      for (int t = 0; t < GL_TYPES; t++) {
        keel_pool_stats_t st;
        keel_pool_stats(c->pool[t], &st);
        c->idle_cached += st.cached_bytes;
      }
    }
  }
  pthread_barrier_wait(&c->bar);
}

static int gl_setup(gl_ctx_t *c, const kb_params_t *p, int threads) {
  memset(c, 0, sizeof(*c));
  if (strcmp(p->impl, "keel-pool") == 0)
    c->kind = GL_POOL;
  else if (strcmp(p->impl, "keel-pool-call") == 0)
    c->kind = GL_POOL_CALL;
  else if (strcmp(p->impl, "mutex-pool") == 0)
    c->kind = GL_MUTEX;
  else if (strcmp(p->impl, "spin-pool") == 0)
    c->kind = GL_SPIN;
  else
    c->kind = GL_MALLOC;
  char opts[96];
  snprintf(opts, sizeof(opts), "pool_sweep_s=%dms,heap_purge_ms=%d", GL_SWEEP_MS, GL_SWEEP_MS);
  keel_options_set(opts);
  for (int t = 0; t < GL_TYPES; t++) {
    if (gl_keel(c)) c->pool[t] = keel_pool_create(gl_name[t], gl_size[t], 0, NULL);
    if (c->kind == GL_MUTEX || c->kind == GL_SPIN)
      c->lp[t] = kb_locked_pool_create(gl_size[t], GL_ARENA_COUNT,
                                       c->kind == GL_SPIN ? KB_LOCK_SPIN : KB_LOCK_MUTEX);
    if ((gl_keel(c) && c->pool[t] == NULL) ||
        ((c->kind == GL_MUTEX || c->kind == GL_SPIN) && c->lp[t] == NULL)) {
      fprintf(stderr, "pool bench: cannot create the %s pool\n", gl_name[t]);
      return 1;
    }
  }
  c->threads = threads;
  c->bricks = threads < GL_BRICKS ? threads : GL_BRICKS;
  c->files = (long)(GL_FILES * p->scale);
  if (c->files < 1) c->files = 1;
  c->deadline_s = 2 * (p->scale < 1 ? 1 : p->scale);
  c->rings = aligned_alloc(64, sizeof(gl_ring_t) * (size_t)threads);
  if (c->rings == NULL) return 1;
  memset(c->rings, 0, sizeof(gl_ring_t) * (size_t)threads);
  pthread_barrier_init(&c->bar, NULL, (unsigned)threads);
  return 0;
}

static void gl_teardown(gl_ctx_t *c) {
  pthread_barrier_destroy(&c->bar);
  free(c->rings);
  for (int t = 0; t < GL_TYPES; t++) {
    if (c->pool[t] != NULL && keel_pool_destroy(c->pool[t]) != 0)
      fprintf(stderr, "pool bench: pool %s still has live objects\n", gl_name[t]);
    if (c->lp[t] != NULL) kb_locked_pool_destroy(c->lp[t]);
  }
}

static int gl_measure(const kb_params_t *p, kb_result_t *r, int threads) {
  gl_ctx_t *c = malloc(sizeof(*c));
  if (c == NULL || gl_setup(c, p, threads) != 0) return 1;
  kb_run_threads(threads, gl_worker, c);
  r->ops = (double)atomic_load(&c->ops);
  r->seconds = (double)(atomic_load(&c->end_ns) - atomic_load(&c->start_ns)) * 1e-9;
  kb_extra(r, "bricks", c->bricks);
  kb_extra(r, "files", (double)c->files);
  double cpu = c->cpu_end_s - c->cpu_start_s;
  double sys = c->sys_end_s - c->sys_start_s;
  kb_extra(r, "load_cpu_s", cpu);
  kb_extra(r, "load_user_s", cpu - sys);
  kb_extra(r, "load_sys_s", sys);
  kb_extra(r, "ops_per_cpu_s", cpu > 0 ? r->ops / cpu : 0);
  kb_extra(r, "rss_pre_kb", (double)c->rss_pre_kb);
  kb_extra(r, "rss_idle_kb", (double)c->rss_idle_kb);
  kb_extra(r, "idle_rss_pct",
           c->rss_pre_kb
               ? 100.0 * ((double)c->rss_idle_kb - (double)c->rss_pre_kb) / (double)c->rss_pre_kb
               : 0);
  if (gl_keel(c)) {
    kb_extra(r, "idle_cached_bytes", (double)c->idle_cached);
    double allocs = 0, heap = 0, hot = 0;
    for (int t = 0; t < GL_TYPES; t++) {
      keel_pool_stats_t st;
      keel_pool_stats(c->pool[t], &st);
      allocs += (double)st.allocs;
      heap += (double)st.heap_allocs;
      hot += (double)st.hot_hits;
    }
    kb_extra(r, "hot_hit_pct", allocs > 0 ? 100 * hot / allocs : 0);
    kb_extra(r, "heap_call_pct", allocs > 0 ? 100 * heap / allocs : 0);
  }
  if (c->kind == GL_MUTEX || c->kind == GL_SPIN)
    kb_extra(r, "pool_held_kb", (double)(3 * kb_locked_pool_held_bytes(c->lp[0])) / 1024);
  gl_teardown(c);
  free(c);
  return 0;
}

static int gl_case(const kb_params_t *p, kb_result_t *r) {
  return gl_measure(p, r, p->threads);
}

static int gl_idle_case(const kb_params_t *p, kb_result_t *r) {
  return gl_measure(p, r, 4 * GL_BRICKS);
}

/* hot: alloc+free pairs of one 256-byte object, read the clock per 1024. */
static int hot_case(const kb_params_t *p, kb_result_t *r) {
  gl_ctx_t *c = malloc(sizeof(*c));
  if (c == NULL || gl_setup(c, p, 1) != 0) return 1;
  uint64_t len = (uint64_t)(0.3e9 * p->scale), t0 = keel_clock_ns(), t1;
  double ops = 0;
  keel_pool_t *kp = c->pool[GL_FRAME];
  kb_locked_pool_t *lp = c->lp[GL_FRAME];
  do {
    switch (c->kind) { /* one loop per kind: no dispatch inside */
      case GL_POOL:
        for (int k = 0; k < 1024; k++) {
          void *o = keel_pool_alloc(kp);
          kb_escape(o);
          keel_pool_free(kp, o);
        }
        break;
      case GL_POOL_CALL:
        for (int k = 0; k < 1024; k++) {
          void *o = (keel_pool_alloc)(kp);
          kb_escape(o);
          (keel_pool_free)(kp, o);
        }
        break;
      case GL_MALLOC:
        for (int k = 0; k < 1024; k++) {
          void *o = malloc(256);
          kb_escape(o);
          free(o);
        }
        break;
      default:
        for (int k = 0; k < 1024; k++) {
          void *o = kb_locked_pool_alloc(lp);
          kb_escape(o);
          kb_locked_pool_free(lp, o);
        }
        break;
    }
    ops += 1024;
    t1 = keel_clock_ns();
  } while (t1 - t0 < len);
  r->ops = ops;
  r->seconds = (double)(t1 - t0) * 1e-9;
  gl_teardown(c);
  free(c);
  return 0;
}

static const kb_impl_t gl_impls[] = {{"keel-pool", NULL}, {"keel-pool-call", NULL},
                                     KB_MALLOC_IMPLS,     {"mutex-pool", NULL},
                                     {"spin-pool", NULL}, {NULL, NULL}};

static const kb_case_t gl_cases[] = {
    {"gluster", "B=80 bricks x T threads: create/write/unlink, dict+stub+frame per op, replies",
     gl_case, gl_impls, true, NULL, false},
    {"idle", "RSS growth over pre-load, 2N s after the load (320 threads, N = 100 ms)",
     gl_idle_case, gl_impls, false, "idle_rss_pct", true},
    {"hot", "single-thread alloc+free of a 256 B object (hot list / thread cache)", hot_case,
     gl_impls, false, "ns_per_op", true},
    {NULL}};

KB_SUITE(pool, {.name = "pool",
                .help = "object pools: GlusterFS brick model, idle memory, hot alloc+free",
                .cases = gl_cases,
                .default_threads = "64,80,160,256,320"})
