/* Benchmark suite "pheap": keel's persistent heap against libpmemobj (PMDK
 * 1.12) in the same run, same file system (/dev/shm), same flush mode.
 *
 * Modes: "force" cases run keel with pheap_flush=clwb (or the best CPU
 * flush) and libpmemobj with PMEM_IS_PMEM_FORCE=1: both treat the mapping as
 * persistent memory and flush cache lines. "msync" cases run keel with
 * pheap_flush=msync and libpmemobj with PMEM_IS_PMEM_FORCE=0, where both
 * call msync. libpmemobj is linked only when pkg-config finds it; otherwise
 * its impl prints a note and is skipped.
 *
 * Throughput cases run for a fixed window (0.25 s x scale). Where an
 * operation leaves objects behind (tx-alloc, publish), they are freed in
 * untimed gaps between timed batches of 64, so the heap stays small and only
 * the measured operation is charged. Seconds, while every thread has a CPU:
 * the threads' wall-clock time in timed batches, averaged. Once threads
 * outnumber the CPUs the process may use (_keel_os_ncpu): their CPU time in timed
 * batches, summed and divided by those CPUs. There a batch of ~20 us either
 * runs whole or waits out ~100 time slices, and the wall-clock figure of one
 * binary swung tenfold between runs. The CPU-clock figure is CPU cost per
 * operation rather than throughput: time a thread spends asleep (on a lane
 * or arena lock) is not charged, time spent spinning is, so it holds as
 * throughput only while sleepers leave no CPU idle (checked at stop 15:
 * both implementations kept 2 CPUs busy at 256 threads). Extra cpu_ns_per_op
 * is the CPU-clock figure at every thread count. Every throughput case
 * reports flushes and barriers per operation as extras: keel's own counters.
 * For libpmemobj the same extras come from interposing libpmem's
 * pmem_flush/drain/persist/msync/mem* from this binary; libpmemobj 1.12
 * calls them through its own internal pointers, so they read 0 there (its
 * counts are not measured here; PMDK's own figures are ~3 per atomic alloc,
 * ~5 per tx_alloc). Objects are 64 bytes unless named.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <keel/pheap.h>

#include "base/clock.h"
#include "base/os.h"
#include "bench.h"
#include "pheap/pheap_int.h"

#ifdef KEEL_HAVE_PMEMOBJ
#include <libpmemobj.h>
#endif

#define PB_MAXT  256
#define PB_BATCH 64
#define PB_POOL  ((size_t)512 << 20)

enum { PB_KEEL, PB_PMDK };
enum { PB_ALLOCFREE, PB_TXALLOC, PB_PUBLISH, PB_ADDRANGE, PB_SIZES };

typedef struct pb_root {
  keel_poff_t slot[PB_MAXT][8]; /* keel destinations */
  uint64_t oid[PB_MAXT][8][2];  /* PMEMoid destinations (pool uuid, off) */
  keel_poff_t buf[PB_MAXT];     /* add_range targets */
  uint64_t pbuf[PB_MAXT][2];
} pb_root_t;

typedef struct pb {
  int impl, op, threads;
  size_t size; /* object or range bytes */
  int batch;   /* publish batch */
  double window;
  char path[128];
  keel_pheap_t *kp;
  pb_root_t *root;
#ifdef KEEL_HAVE_PMEMOBJ
  PMEMobjpool *pop;
#endif
  _Atomic uint64_t ops, timed_ns, timed_cpu_ns, flushes, barriers;
  uint64_t start_ns;
  size_t pool_bytes; /* 0: PB_POOL */
} pb_t;

/* ---- libpmemobj flush counting by interposition ---- */
static __thread uint64_t pm_flushes, pm_barriers;
#ifdef KEEL_HAVE_PMEMOBJ
#include <libpmem.h>
#define PB_NEXT(name, type)                                                                        \
  static __typeof__(&name) real_##name;                                                            \
  if (!real_##name) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)
void pmem_flush(const void *a, size_t n) {
  PB_NEXT(pmem_flush, void (*)(const void *, size_t));
  pm_flushes++;
  real_pmem_flush(a, n);
}
void pmem_drain(void) {
  PB_NEXT(pmem_drain, void (*)(void));
  pm_barriers++;
  real_pmem_drain();
}
void pmem_persist(const void *a, size_t n) {
  PB_NEXT(pmem_persist, void (*)(const void *, size_t));
  pm_flushes++, pm_barriers++;
  real_pmem_persist(a, n);
}
int pmem_msync(const void *a, size_t n) {
  PB_NEXT(pmem_msync, int (*)(const void *, size_t));
  pm_flushes++, pm_barriers++;
  return real_pmem_msync(a, n);
}
#define PB_MEMF(name, T)                                                                           \
  void *name(void *d, T s, size_t n, unsigned f) {                                                 \
    PB_NEXT(name, void *(*)(void *, T, size_t, unsigned));                                         \
    pm_flushes++;                                                                                  \
    if (!(f & (PMEM_F_MEM_NODRAIN | PMEM_F_MEM_NOFLUSH))) pm_barriers++;                           \
    return real_##name(d, s, n, f);                                                                \
  }
PB_MEMF(pmem_memcpy, const void *)
PB_MEMF(pmem_memmove, const void *)
PB_MEMF(pmem_memset, int)
#endif

/* ---- one pool per child ---- */
static int pb_open(pb_t *b, const kb_params_t *p, bool force) {
  if (p->threads > PB_MAXT) { /* the root holds PB_MAXT threads' slots */
    fprintf(stderr, "pheap bench: at most %d threads\n", PB_MAXT);
    return 1;
  }
  snprintf(b->path, sizeof b->path, "/dev/shm/keel-bench-pheap-%d", (int)getpid());
  unlink(b->path);
  b->window = 0.25 * p->scale;
  b->threads = p->threads;
  if (strcmp(p->impl, "keel") == 0) {
    b->impl = PB_KEEL;
    if (keel_options_set(force ? "pheap_flush=clwb" : "pheap_flush=msync") != 0) return 1;
    b->kp = keel_pheap_create(b->path, "bench", b->pool_bytes ? b->pool_bytes : PB_POOL, 0);
    if (!b->kp) {
      fprintf(stderr, "pheap bench: %s\n", keel_pheap_errmsg());
      return 1;
    }
    b->root = keel_pheap_root(b->kp, sizeof *b->root);
    return b->root == NULL;
  }
#ifdef KEEL_HAVE_PMEMOBJ
  b->impl = PB_PMDK;
  /* libpmem reads this on its first pmem_is_pmem, i.e. at pool create. */
  setenv("PMEM_IS_PMEM_FORCE", force ? "1" : "0", 1);
  b->pop = pmemobj_create(b->path, "bench", b->pool_bytes ? b->pool_bytes : PB_POOL, 0600);
  if (!b->pop) {
    fprintf(stderr, "pheap bench: pmemobj_create: %s\n", pmemobj_errormsg());
    return 1;
  }
  PMEMoid r = pmemobj_root(b->pop, sizeof *b->root);
  b->root = pmemobj_direct(r);
  return 0;
#else
  fprintf(stderr, "libpmemobj not found by pkg-config at build time: impl skipped\n");
  return 1;
#endif
}

/* A pb_t with its pool created (pool_bytes: 0 for PB_POOL), or NULL. */
static pb_t *pb_new(const kb_params_t *p, bool force, size_t pool_bytes) {
  pb_t *b = calloc(1, sizeof *b);
  if (b == NULL) return NULL;
  b->pool_bytes = pool_bytes;
  if (pb_open(b, p, force) != 0) {
    free(b);
    return NULL;
  }
  return b;
}

static void pb_close(pb_t *b) {
  if (b->kp) keel_pheap_close(b->kp);
#ifdef KEEL_HAVE_PMEMOBJ
  if (b->pop) pmemobj_close(b->pop);
#endif
  unlink(b->path);
}

static void counters(pb_t *b, uint64_t *f, uint64_t *d) {
  if (b->impl == PB_KEEL) {
    ph_tcache_t *tc = _keel_ph_tcache(b->kp);
    *f = tc->flushes;
    *d = tc->barriers;
  } else {
    *f = pm_flushes;
    *d = pm_barriers;
  }
}

/* ---- the operations; `leftover` collects offsets to free untimed ---- */
#ifdef KEEL_HAVE_PMEMOBJ
static PMEMoid *poid(pb_t *b, int t, int k) {
  return (PMEMoid *)b->root->oid[t][k];
}
#endif

static void op_keel(pb_t *b, int t, keel_poff_t *left, int *nl) {
  keel_pheap_t *ph = b->kp;
  switch (b->op) {
    case PB_ALLOCFREE:
    case PB_SIZES:
      keel_pheap_alloc(ph, &b->root->slot[t][0], b->size, 1);
      keel_pheap_free(ph, &b->root->slot[t][0]);
      break;
    case PB_TXALLOC:
      keel_tx_begin(ph);
      left[(*nl)++] = keel_tx_alloc(b->size, 1);
      keel_tx_commit();
      keel_tx_end();
      break;
    case PB_PUBLISH: {
      keel_pheap_act_t a[64];
      for (int i = 0; i < b->batch; i++) {
        keel_pheap_reserve(ph, &a[i], b->size, 1);
        left[(*nl)++] = a[i].off;
      }
      keel_pheap_publish(ph, a, (size_t)b->batch);
      break;
    }
    case PB_ADDRANGE: {
      char *p = keel_pheap_ptr(ph, b->root->buf[t]);
      keel_tx_begin(ph);
      keel_tx_add_range(p, b->size);
      memset(p, (int)*nl, b->size);
      keel_tx_commit();
      keel_tx_end();
      break;
    }
  }
}

static void free_keel(pb_t *b, keel_poff_t *left, int n) {
  for (int i = 0; i < n; i++) keel_pheap_free(b->kp, &left[i]);
}

#ifdef KEEL_HAVE_PMEMOBJ
static void op_pmdk(pb_t *b, int t, PMEMoid *left, int *nl) {
  PMEMobjpool *pop = b->pop;
  switch (b->op) {
    case PB_ALLOCFREE:
    case PB_SIZES:
      pmemobj_alloc(pop, poid(b, t, 0), b->size, 1, NULL, NULL);
      pmemobj_free(poid(b, t, 0));
      break;
    case PB_TXALLOC: {
      volatile PMEMoid o = OID_NULL;
      TX_BEGIN(pop) {
        o = pmemobj_tx_alloc(b->size, 1);
      }
      TX_END
      left[(*nl)++] = (PMEMoid){o.pool_uuid_lo, o.off};
      break;
    }
    case PB_PUBLISH: {
      struct pobj_action a[64];
      for (int i = 0; i < b->batch; i++) left[(*nl)++] = pmemobj_reserve(pop, &a[i], b->size, 1);
      pmemobj_publish(pop, a, (size_t)b->batch);
      break;
    }
    case PB_ADDRANGE: {
      char *volatile p = pmemobj_direct(*(PMEMoid *)b->root->pbuf[t]);
      int v = *nl;
      TX_BEGIN(pop) {
        pmemobj_tx_add_range_direct(p, b->size);
        memset(p, v, b->size);
      }
      TX_END
      break;
    }
  }
}
#endif

static void pb_worker(int t, void *arg) {
  pb_t *b = arg;
  union {
    keel_poff_t k[PB_BATCH * 64];
#ifdef KEEL_HAVE_PMEMOBJ
    PMEMoid p[PB_BATCH * 64];
#endif
  } *left = malloc(sizeof *left);
  if (b->op == PB_ADDRANGE) {
    if (b->impl == PB_KEEL) keel_pheap_zalloc(b->kp, &b->root->buf[t], 4096, 2);
#ifdef KEEL_HAVE_PMEMOBJ
    else
      pmemobj_zalloc(b->pop, (PMEMoid *)b->root->pbuf[t], 4096, 2);
#endif
  }
  uint64_t end = b->start_ns + (uint64_t)(b->window * 1e9), ops = 0, ns = 0, cpu = 0, fl = 0,
           ba = 0;
  for (;;) {
    int nl = 0;
    uint64_t f0, d0, f1, d1;
    counters(b, &f0, &d0);
    uint64_t c0 = kb_thread_cpu_ns(), t0 = keel_clock_ns();
    int per = b->op == PB_PUBLISH ? PB_BATCH / b->batch + 1 : PB_BATCH;
    for (int i = 0; i < per; i++) {
      if (b->impl == PB_KEEL) op_keel(b, t, left->k, &nl);
#ifdef KEEL_HAVE_PMEMOBJ
      else
        op_pmdk(b, t, left->p, &nl);
#endif
    }
    uint64_t t1 = keel_clock_ns(), c1 = kb_thread_cpu_ns();
    counters(b, &f1, &d1);
    ns += t1 - t0;
    cpu += c1 - c0;
    fl += f1 - f0;
    ba += d1 - d0;
    ops += (uint64_t)per * (b->op == PB_PUBLISH ? (uint64_t)b->batch : 1);
    if (b->impl == PB_KEEL) free_keel(b, left->k, nl);
#ifdef KEEL_HAVE_PMEMOBJ
    else
      for (int i = 0; i < nl; i++) pmemobj_free(&left->p[i]);
#endif
    if (t1 >= end) break;
  }
  free(left);
  atomic_fetch_add(&b->ops, ops);
  atomic_fetch_add(&b->timed_ns, ns);
  atomic_fetch_add(&b->timed_cpu_ns, cpu);
  atomic_fetch_add(&b->flushes, fl);
  atomic_fetch_add(&b->barriers, ba);
}

static int pb_run(const kb_params_t *p, kb_result_t *r, bool force, int op, size_t size,
                  int batch) {
  pb_t *b = pb_new(p, force, 0);
  if (b == NULL) return 1;
  b->op = op;
  b->size = size;
  b->batch = batch;
  b->start_ns = keel_clock_ns();
  kb_run_threads(p->threads, pb_worker, b);
  /* Oversubscribed: the CPUs ran the timed batches side by side, so the
   * CPU time divides by the number of CPUs, not of threads. */
  int ncpu = _keel_os_ncpu();
  bool over = p->threads > ncpu;
  r->ops = (double)b->ops;
  r->seconds =
      over ? (double)b->timed_cpu_ns / 1e9 / (double)ncpu : (double)b->timed_ns / 1e9 / p->threads;
  kb_extra(r, "cpu_ns_per_op", (double)b->timed_cpu_ns / (double)b->ops);
  kb_extra(r, "flushes_per_op", (double)b->flushes / (double)b->ops);
  kb_extra(r, "barriers_per_op", (double)b->barriers / (double)b->ops);
  pb_close(b);
  free(b);
  return 0;
}

#define PB_CASE(fn, force, op, size, batch)                                                        \
  static int fn(const kb_params_t *p, kb_result_t *r) {                                            \
    return pb_run(p, r, force, op, size, batch);                                                   \
  }
PB_CASE(pb_allocfree_force, true, PB_ALLOCFREE, 64, 1)
PB_CASE(pb_allocfree_msync, false, PB_ALLOCFREE, 64, 1)
PB_CASE(pb_txalloc_force, true, PB_TXALLOC, 64, 1)
PB_CASE(pb_txalloc_msync, false, PB_TXALLOC, 64, 1)
PB_CASE(pb_publish1_force, true, PB_PUBLISH, 64, 1)
PB_CASE(pb_publish1_msync, false, PB_PUBLISH, 64, 1)
PB_CASE(pb_publish8_force, true, PB_PUBLISH, 64, 8)
PB_CASE(pb_publish64_force, true, PB_PUBLISH, 64, 64)
PB_CASE(pb_range8, true, PB_ADDRANGE, 8, 1)
PB_CASE(pb_range64, true, PB_ADDRANGE, 64, 1)
PB_CASE(pb_range256, true, PB_ADDRANGE, 256, 1)
PB_CASE(pb_range4096, true, PB_ADDRANGE, 4096, 1)

/* alloc+free at each size from 64 B to 256 KiB (force mode): extras give
 * ns per pair per size; the metric is the total. */
static int pb_sizes(const kb_params_t *p, kb_result_t *r) {
  static const size_t sz[] = {64, 256, 1024, 4096, 16384, 65536, 262144};
  kb_params_t q = *p;
  q.scale = p->scale / 4;
  double ops = 0, sec = 0;
  for (size_t i = 0; i < sizeof sz / sizeof sz[0]; i++) {
    kb_result_t one = {0};
    if (pb_run(&q, &one, true, PB_SIZES, sz[i], 1) != 0) return 1;
    char key[32];
    snprintf(key, sizeof key, "ns_%zu", sz[i]);
    kb_extra(r, key, one.seconds * 1e9 / one.ops);
    ops += one.ops;
    sec += one.seconds;
  }
  r->ops = ops;
  r->seconds = sec;
  return 0;
}

/* Internal fragmentation, 100 B to 4 MiB in 100 B steps: (media bytes -
 * requested) / media bytes, averaged. keel's media bytes are the block (or
 * extent) plus its share of the run's unused tail; libpmemobj's are its
 * usable size plus its 16-byte header (what it reports for a 64 B request:
 * 112 + 16), measured by allocating each size. */
static int pb_frag(const kb_params_t *p, kb_result_t *r) {
  pb_t *b = pb_new(p, true, 0);
  if (b == NULL) return 1;
  double s132 = 0, s4m = 0, b132 = 0;
  int n132 = 0, n4m = 0;
  uint64_t t0 = keel_clock_ns();
  for (size_t sz = 100; sz <= ((size_t)4 << 20); sz += 100) {
    double media, block = 0;
    if (b->impl == PB_KEEL) {
      int c = _keel_ph_class_of(sz + PH_OBJ_HDR);
      if (c >= 0) {
        const ph_class_t *k = &_keel_ph_classes[c];
        media = (double)k->chunks * PH_CHUNK / k->nblocks;
        block = k->block;
      } else
        media = (double)((sz + PH_OBJ_HDR + PH_CHUNK - 1) / PH_CHUNK * PH_CHUNK);
    } else {
#ifdef KEEL_HAVE_PMEMOBJ
      PMEMoid o;
      if (pmemobj_alloc(b->pop, &o, sz, 1, NULL, NULL) != 0) break;
      media = (double)pmemobj_alloc_usable_size(o) + 16;
      block = media;
      pmemobj_free(&o);
#else
      media = 0;
#endif
    }
    double f = (media - (double)sz) / media;
    if (block == 0) block = media;
    if (sz <= 132 * 1024) s132 += f, n132++, b132 += (block - (double)sz) / block;
    s4m += f, n4m++;
  }
  r->ops = n4m;
  r->seconds = (double)(keel_clock_ns() - t0) / 1e9;
  kb_extra(r, "avg_frag_100B_132K", s132 / n132);
  kb_extra(r, "avg_frag_100B_4M", s4m / n4m);
  /* Block (or usable + header) only, without run tails: what libpmemobj's
   * figure measures, for a like-for-like ratio. */
  kb_extra(r, "avg_frag_block_100B_132K", b132 / n132);
  pb_close(b);
  free(b);
  return 0;
}

/* N atomic allocations of 64..1000 B, left live. */
static void pb_fill(pb_t *b, long n) {
  uint64_t s = 1;
  for (long i = 0; i < n; i++) {
    size_t sz = 64 + (size_t)(kb_rand(&s) % 936);
    if (b->impl == PB_KEEL) {
      keel_poff_t o;
      keel_pheap_alloc(b->kp, &o, sz, 1);
    }
#ifdef KEEL_HAVE_PMEMOBJ
    else {
      PMEMoid o;
      pmemobj_alloc(b->pop, &o, sz, 1, NULL, NULL);
    }
#endif
  }
}

/* Closes the pool if this process has it open (crash: a child had it and
 * died), then times open and the first allocation: keel rebuilds lazily
 * (the first allocation of a class boots runs until one of its class has
 * room), so timing one allocation makes both pay that. */
static void pb_time_open(pb_t *b, bool close_first, double *open_ms, double *total_ms) {
  uint64_t t0 = 0, tm = 0, t1 = 0;
  if (b->impl == PB_KEEL) {
    if (close_first) keel_pheap_close(b->kp);
    t0 = keel_clock_ns();
    b->kp = keel_pheap_open(b->path, "bench");
    tm = keel_clock_ns();
    keel_poff_t o;
    keel_pheap_alloc(b->kp, &o, 64, 1);
    t1 = keel_clock_ns();
  }
#ifdef KEEL_HAVE_PMEMOBJ
  else {
    if (close_first) pmemobj_close(b->pop);
    t0 = keel_clock_ns();
    b->pop = pmemobj_open(b->path, "bench");
    tm = keel_clock_ns();
    PMEMoid o;
    pmemobj_alloc(b->pop, &o, 64, 1, NULL, NULL);
    t1 = keel_clock_ns();
  }
#endif
  *open_ms = (double)(tm - t0) / 1e6;
  *total_ms = (double)(t1 - t0) / 1e6;
}

/* Open (with volatile rebuild) of pools of 64 MiB, 512 MiB and 2 GiB, each
 * a tenth full of 64..1000 B objects (13k, 105k and 420k x scale), closed
 * cleanly; ms. The headline is the 512 MiB pool (the size the other cases
 * use). */
static int pb_open_time(const kb_params_t *p, kb_result_t *r) {
  static const struct {
    size_t bytes;
    const char *key, *only, *objs;
  } pools[] = {{(size_t)64 << 20, "open_ms_64M", "open_only_ms_64M", "objects_64M"},
               {(size_t)512 << 20, "open_ms_512M", "open_only_ms_512M", "objects_512M"},
               {(size_t)2 << 30, "open_ms_2G", "open_only_ms_2G", "objects_2G"}};
  for (size_t i = 0; i < sizeof pools / sizeof *pools; i++) {
    long n = (long)((double)(pools[i].bytes / 5120) * p->scale);
    pb_t *b = pb_new(p, true, pools[i].bytes);
    if (b == NULL) return 1;
    pb_fill(b, n);
    double only, total;
    pb_time_open(b, true, &only, &total);
    kb_extra(r, pools[i].key, total);
    kb_extra(r, pools[i].only, only);
    kb_extra(r, pools[i].objs, (double)n);
    if (pools[i].bytes == PB_POOL) {
      r->ops = 1;
      r->seconds = total / 1e3;
      kb_extra(r, "open_ms", total);
    }
    pb_close(b);
    free(b);
  }
  return 0;
}

/* Open after a crash: the 512 MiB pool of pb_open_time is closed, a child
 * opens it, makes 2000 atomic alloc+free pairs, begins a transaction that
 * snapshots 64 bytes of the root and overwrites them, and _exits inside it
 * as a crash would; then open + first allocation, with recovery (both roll
 * the transaction back; keel also replays the logs its last checkpoint
 * left, up to a checkpoint interval per lane), in ms. */
static int pb_recover_time(const kb_params_t *p, kb_result_t *r) {
  pb_t *b = pb_new(p, true, 0);
  if (b == NULL) return 1;
  long n = (long)(100000 * p->scale);
  pb_fill(b, n);
  if (b->impl == PB_KEEL) keel_pheap_close(b->kp);
#ifdef KEEL_HAVE_PMEMOBJ
  else
    pmemobj_close(b->pop);
#endif
  b->kp = NULL;
#ifdef KEEL_HAVE_PMEMOBJ
  b->pop = NULL;
#endif
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    if (b->impl == PB_KEEL) {
      keel_pheap_t *ph = keel_pheap_open(b->path, "bench");
      if (ph == NULL) _exit(2);
      for (int i = 0; i < 2000; i++) {
        keel_poff_t o;
        keel_pheap_alloc(ph, &o, 64 + (size_t)(i % 900), 1);
        keel_pheap_free(ph, &o);
      }
      pb_root_t *root = keel_pheap_root(ph, sizeof *root);
      keel_tx_begin(ph);
      keel_tx_add_range(root->slot, 64);
      memset(root->slot, 0x5a, 64);
      _exit(0); /* a crash inside the transaction */
    }
#ifdef KEEL_HAVE_PMEMOBJ
    else {
      PMEMobjpool *pop = pmemobj_open(b->path, "bench");
      if (pop == NULL) _exit(2);
      for (int i = 0; i < 2000; i++) {
        PMEMoid o;
        pmemobj_alloc(pop, &o, 64 + (size_t)(i % 900), 1, NULL, NULL);
        pmemobj_free(&o);
      }
      pb_root_t *root = pmemobj_direct(pmemobj_root(pop, sizeof *root));
      TX_BEGIN(pop) {
        pmemobj_tx_add_range_direct(root->oid, 64);
        memset(root->oid, 0x5a, 64);
        _exit(0); /* a crash inside the transaction */
      }
      TX_END
    }
#endif
    _exit(0); /* a crash: no close */
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "pheap bench: the crashing child failed\n");
    unlink(b->path);
    free(b);
    return 1;
  }
  double only, total;
  pb_time_open(b, false, &only, &total);
  /* Both must have rolled the transaction back. */
  const unsigned char *snap = NULL;
  if (b->impl == PB_KEEL) {
    pb_root_t *root = keel_pheap_root(b->kp, sizeof *root);
    snap = root ? (const unsigned char *)root->slot : NULL;
  }
#ifdef KEEL_HAVE_PMEMOBJ
  else {
    pb_root_t *root = pmemobj_direct(pmemobj_root(b->pop, sizeof *root));
    snap = root ? (const unsigned char *)root->oid : NULL;
  }
#endif
  if (snap == NULL || snap[0] == 0x5a) {
    fprintf(stderr, "pheap bench: the crashed transaction was not rolled back\n");
    pb_close(b);
    free(b);
    return 1;
  }
  r->ops = 1;
  r->seconds = total / 1e3;
  kb_extra(r, "recover_ms", total);
  kb_extra(r, "recover_only_ms", only);
  if (b->impl == PB_KEEL) {
    keel_pheap_stats_t s;
    keel_pheap_stats(b->kp, &s);
    kb_extra(r, "recovered_logs", (double)s.recovered_logs);
  }
  kb_extra(r, "objects", (double)n);
  pb_close(b);
  free(b);
  return 0;
}

static const kb_impl_t pb_impls[] = {{"keel", NULL}, {"libpmemobj", NULL}, {NULL, NULL}};

static const kb_case_t pb_cases[] = {
    {"alloc-free", "atomic alloc + free of 64 B into a pool slot (FORCE: CPU flushes)",
     pb_allocfree_force, pb_impls, true, NULL, false},
    {"alloc-free-msync", "the same with msync as the flush", pb_allocfree_msync, pb_impls, true,
     NULL, false},
    {"tx-alloc", "transaction with one tx_alloc of 64 B (FORCE)", pb_txalloc_force, pb_impls, true,
     NULL, false},
    {"tx-alloc-msync", "the same with msync", pb_txalloc_msync, pb_impls, true, NULL, false},
    {"publish-1", "reserve + publish of one 64 B object (FORCE)", pb_publish1_force, pb_impls, true,
     NULL, false},
    {"publish-1-msync", "the same with msync", pb_publish1_msync, pb_impls, true, NULL, false},
    {"publish-8", "8 reserves + one publish; per object (FORCE)", pb_publish8_force, pb_impls, true,
     NULL, false, 0, "1,2"},
    {"publish-64", "64 reserves + one publish; per object (FORCE)", pb_publish64_force, pb_impls,
     true, NULL, false, 0, "1,2"},
    {"tx-range-8", "transaction: tx_add_range of 8 B + store (FORCE)", pb_range8, pb_impls, true,
     NULL, false, 0, "1,2"},
    {"tx-range-64", "the same, 64 B", pb_range64, pb_impls, true, NULL, false, 0, "1,2"},
    {"tx-range-256", "the same, 256 B", pb_range256, pb_impls, true, NULL, false, 0, "1,2"},
    {"tx-range-4096", "the same, 4096 B", pb_range4096, pb_impls, true, NULL, false, 0, "1,2"},
    {"sizes", "alloc+free at 64 B..256 KiB (ns per pair; per size in the JSON, FORCE)", pb_sizes,
     pb_impls, true, "ns_per_op", true, 0, "1,2"},
    {"frag", "average internal fragmentation, 100 B..132 KiB and ..4 MiB in 100 B steps", pb_frag,
     pb_impls, false, "avg_frag_100B_132K", true},
    {"open", "open + first alloc of a pool a tenth full (ms; 512 MiB; extras: 64 MiB, 2 GiB)",
     pb_open_time, pb_impls, false, "open_ms", true},
    {"recover", "open + first alloc after a crash inside a transaction (ms)", pb_recover_time,
     pb_impls, false, "recover_ms", true},
    {NULL}};

KB_SUITE(pheap, {"pheap", "persistent heap against libpmemobj (FORCE and msync modes)", pb_cases,
                 "1,2,64,256", NULL})
