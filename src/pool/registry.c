/* The process-wide pool registry: descriptors, create and destroy, stats.
 *
 * Descriptors live in a table indexed by pool id (the id also indexes every
 * thread's slot array). A destroyed descriptor stays in the table, marked
 * dead, on a FIFO of descriptors to recycle, and is reused only once
 * POOL_RECYCLE_AFTER others have died after it: until then a stale handle
 * aborts with its pool's name (reused at once, as before, a destroyed
 * pool's handle silently became the next pool created). Memory held is
 * bounded by the most pools ever alive at once, plus that many dead ones;
 * so are the ids, which a program with up to 15 pools alive keeps within
 * the inline slots (KEEL_POOL_FAST_SLOTS) however many it churns.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "base/die.h"
#include "heap/shared.h"
#include "pool_impl.h"

#include "track.h"

/* Debug builds pattern-fill (POOL_F_DEBUG) the pools created while this is
 * set; tests clear it to reach the flag-free fast paths in those builds. */
int _keel_pool_debug = KEEL_DEBUG >= 1;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t registry_once = PTHREAD_ONCE_INIT;
static keel_pool_t **table; /* by id; under registry_lock */
static uint32_t table_len, table_cap;
static CDS_LIST_HEAD(recycle); /* dead descriptors, oldest first */
static size_t n_dead;          /* on `recycle` */
struct cds_list_head _keel_pool_live = CDS_LIST_HEAD_INIT(_keel_pool_live);
static size_t n_live;

void _keel_pool_registry_lock(void) {
  pthread_mutex_lock(&registry_lock);
}

void _keel_pool_registry_unlock(void) {
  pthread_mutex_unlock(&registry_lock);
}

void _keel_pool_check_live(const keel_pool_t *p, const char *call) {
  /* Acquire pairs with the release in create: a live pool is fully built. */
  if (keel_unlikely(p == NULL)) keel_die(call, "NULL pool");
  if (keel_unlikely(keel_load_acquire(&p->live) != 1))
    keel_die(call, "pool '%s' (%p) used after keel_pool_destroy", p->name, (const void *)p);
}

/* fork: take every pool lock in order so the child inherits none held. */
static void pool_atfork_prepare(void) {
  pthread_mutex_lock(&registry_lock);
  keel_pool_t *p;
  pool_for_each_live(p) {
    pthread_mutex_lock(&p->lock);
    pool_sub_t *sp;
    pool_for_each_sub(sp, p) pthread_mutex_lock(&sp->lock);
  }
  _keel_pool_sweeper_atfork_prepare();
}

static void pool_atfork_release(void) {
  keel_pool_t *p;
  pool_for_each_live(p) {
    pool_sub_t *sp;
    pool_for_each_sub(sp, p) pthread_mutex_unlock(&sp->lock);
    pthread_mutex_unlock(&p->lock);
  }
  pthread_mutex_unlock(&registry_lock);
}

static void pool_atfork_parent(void) {
  _keel_pool_sweeper_atfork_parent();
  pool_atfork_release();
}

static void pool_atfork_child(void) {
  _keel_pool_sweeper_atfork_child();
  pool_atfork_release();
}

static void registry_init(void) {
  _keel_pool_handoff_init();
  pthread_atfork(pool_atfork_prepare, pool_atfork_parent, pool_atfork_child);
}

/* A descriptor for a new pool: the oldest dead one, or a new table entry.
 * Caller holds registry_lock. */
static keel_pool_t *__pool_desc_get(void) {
  if (n_dead > POOL_RECYCLE_AFTER) {
    keel_pool_t *p = cds_list_first_entry(&recycle, keel_pool_t, reg);
    cds_list_del(&p->reg);
    n_dead--;
    return p;
  }
  if (table_len == table_cap) {
    uint32_t cap = table_cap ? table_cap * 2 : 16;
    keel_pool_t **t = keel_realloc(table, cap * sizeof(*t));
    if (t == NULL) return NULL;
    table = t;
    table_cap = cap;
  }
  keel_pool_t *p = keel_aligned_alloc(KEEL_CACHE_LINE, sizeof(*p));
  if (p == NULL) return NULL;
  memset(p, 0, sizeof(*p));
  p->f.id = table_len;
  pthread_mutex_init(&p->lock, NULL);
  table[table_len++] = p;
  return p;
}

/* A new pool's tag key (pool_impl.h): splitmix64 over a seed from the
 * kernel, so keys differ between pools and between runs. Caller holds
 * registry_lock. */
static uintptr_t __pool_tag_key(void) {
  static uint64_t state;
  if (state == 0) {
    if (getrandom(&state, sizeof(state), GRND_NONBLOCK) != (ssize_t)sizeof(state)) {
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      state = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)(uintptr_t)&ts;
    }
    state |= 1;
  }
  uint64_t z = keel_splitmix64(&state);
  /* Bits 0 and 1 clear: the free and released marks (a pool is 64-byte
   * aligned, so its address has them clear too). */
  return (uintptr_t)z & ~(uintptr_t)3;
}

static void pool_setup(keel_pool_t *p, const char *name, size_t obj_size, size_t align,
                       const keel_pool_ops_t *ops) {
  snprintf(p->name, sizeof(p->name), "%s", name);
  p->obj_size = obj_size;
  p->obj_bytes = (uint32_t)obj_size;
  p->align = align;
  p->hdr_size = (uint32_t)(align > POOL_HDR_MIN ? align : POOL_HDR_MIN);
  /* A multiple of 16 even for smaller alignments: keel_malloc gives a block
   * the alignment of its size class, and classes 8 bytes apart exist. */
  p->block_size = KEEL_ALIGN_UP(p->hdr_size + obj_size, p->hdr_size);
  p->ops = ops != NULL ? *ops : (keel_pool_ops_t){0};
  p->f.tag = (uintptr_t)p ^ __pool_tag_key();
  p->f.flags = (p->ops.init ? POOL_F_INIT : 0) | (p->ops.fini ? POOL_F_FINI : 0);
  if (_keel_pool_fence_heavy) p->f.flags |= POOL_F_FENCE;
  if (POOL_ON_VALGRIND()) p->f.flags |= POOL_F_TRACK;
  if (_keel_pool_debug) p->f.flags |= POOL_F_DEBUG;
  if (_keel_heap_mapped_alone(p->block_size, p->align)) p->f.flags |= POOL_F_MAPPED;
#if defined(KEEL_ASAN)
  p->f.flags |= POOL_F_POISON;
#endif
  CDS_INIT_LIST_HEAD(&p->subs);
  p->gone_allocs = p->gone_frees = p->gone_hot = p->gone_cold = p->gone_heap = 0;
  keel_store_relaxed(&p->heap_frees, 0);
  keel_store_relaxed(&p->sweeps, 0);
}

keel_pool_t *keel_pool_create(const char *name, size_t obj_size, size_t align,
                              const keel_pool_ops_t *ops) {
  if (align == 0) align = 16;
  if (name == NULL || obj_size == 0 || obj_size > KEEL_POOL_MAX_OBJ || !KEEL_IS_POW2(align) ||
      align > KEEL_POOL_MAX_ALIGN) {
    _keel_reject("keel_pool_create",
                 "'%s': obj_size %zu (1 to %zu), align %zu (a power of two up to %zu)",
                 name ? name : "(null)", obj_size, (size_t)KEEL_POOL_MAX_OBJ, align,
                 (size_t)KEEL_POOL_MAX_ALIGN);
    errno = EINVAL;
    return NULL;
  }
  pthread_once(&registry_once, registry_init);
  pthread_mutex_lock(&registry_lock);
  keel_pool_t *p = __pool_desc_get();
  if (p != NULL) {
    pool_setup(p, name, obj_size, align, ops);
    cds_list_add_tail(&p->reg, &_keel_pool_live);
    n_live++;
    /* Release pairs with the acquire in _keel_pool_check_live. */
    keel_store_release(&p->live, 1);
  }
  pthread_mutex_unlock(&registry_lock);
  if (p == NULL) {
    errno = ENOMEM;
    return NULL;
  }
  _keel_pool_sweeper_ensure();
  return p;
}

/* Sums the pool's counters into *st. Caller holds p->lock. */
static void __pool_sum(keel_pool_t *p, keel_pool_stats_t *st) {
  memset(st, 0, sizeof(*st));
  st->name = p->name;
  st->obj_size = p->obj_size;
  st->block_bytes = p->block_size;
  st->hot_hits = p->gone_hot;
  st->cold_hits = p->gone_cold;
  st->heap_allocs = p->gone_heap;
  st->frees = p->gone_frees;
  pool_sub_t *sp;
  pool_for_each_sub(sp, p) {
    st->hot_hits += keel_load_relaxed(&sp->f.hot_hits);
    st->cold_hits += keel_load_relaxed(&sp->f.cold_hits);
    st->heap_allocs += keel_load_relaxed(&sp->f.heap_allocs);
    st->frees += keel_load_relaxed(&sp->f.frees);
    st->threads++;
  }
  st->allocs = st->hot_hits + st->cold_hits + st->heap_allocs;
  st->heap_frees = keel_load_relaxed(&p->heap_frees);
  st->sweeps = keel_load_relaxed(&p->sweeps);
  /* Counters are read one by one while others run: clamp the differences
   * so a snapshot never shows a negative count. */
  st->live = st->allocs > st->frees ? st->allocs - st->frees : 0;
  uint64_t out = st->heap_allocs > st->heap_frees ? st->heap_allocs - st->heap_frees : 0;
  st->cached = out > st->live ? out - st->live : 0;
  st->cached_bytes = st->cached * p->block_size;
}

void keel_pool_stats(const keel_pool_t *cp, keel_pool_stats_t *st) {
  keel_pool_t *p = (keel_pool_t *)cp; /* the lock is the only thing written */
  _keel_pool_check_live(p, "keel_pool_stats");
  pthread_mutex_lock(&p->lock);
  __pool_sum(p, st);
  pthread_mutex_unlock(&p->lock);
}

int keel_pool_destroy(keel_pool_t *p) {
  _keel_pool_check_live(p, "keel_pool_destroy");
  pool_hdr_t *lists = NULL;
  size_t n = 0;
  pthread_mutex_lock(&registry_lock);
  pthread_mutex_lock(&p->lock);
  keel_pool_stats_t st;
  __pool_sum(p, &st);
  if (st.live != 0) {
    pthread_mutex_unlock(&p->lock);
    pthread_mutex_unlock(&registry_lock);
    return KEEL_EBUSY;
  }
  pool_sub_t *sp;
  pool_for_each_sub(sp, p) {
    pool_hdr_t *l;
    size_t k;
    __keel_pool_sub_retire(sp, &l, &k);
    while (l != NULL) { /* concatenate; order does not matter */
      pool_hdr_t *next = l->next;
      l->next = lists;
      lists = l;
      l = next;
    }
    n += k;
  }
  keel_store_relaxed(&p->live, 0); /* the registry lock orders it for the next create */
  cds_list_del(&p->reg);
  bool last = --n_live == 0;
  pthread_mutex_unlock(&p->lock);
  pthread_mutex_unlock(&registry_lock);
  /* Off the live list and not yet on `recycle`: no create can take the
   * descriptor while the release below reads its layout and counts into
   * it (put on `recycle` first, a create on another thread rewrote
   * hdr_size under the release, which then freed wrong pointers). */
  _keel_pool_release_list(p, lists, n, "keel_pool_destroy");
  pthread_t tid;
  pthread_mutex_lock(&registry_lock);
  cds_list_add_tail(&p->reg, &recycle);
  n_dead++;
  /* Re-checked under the registry lock: a create racing with us either
   * sees the sweeper stopped here and starts another, or was first and
   * keeps this one. */
  bool stopped = last && n_live == 0 && _keel_pool_sweeper_stop_begin(&tid);
  pthread_mutex_unlock(&registry_lock);
  if (stopped) pthread_join(tid, NULL);
  return 0;
}

/* One pool's line of keel_pool_print_stats, taken under the registry lock
 * and printed after it: a stream that blocks (a full pipe) or a thread
 * cancelled in fprintf must not hold up every pool's thread exits, first
 * uses and sweeps, nor leave the lock held. */
typedef struct pool_line {
  char name[sizeof(((keel_pool_t *)0)->name)];
  keel_pool_stats_t st;
} pool_line_t;

void keel_pool_print_stats(FILE *out) {
  keel_pool_stats_t tot = {0};
  pthread_mutex_lock(&registry_lock);
  size_t n = 0, cap = n_live;
  pool_line_t *lines = cap ? keel_malloc(cap * sizeof(*lines)) : NULL;
  keel_pool_t *p;
  if (lines != NULL || cap == 0) {
    pool_for_each_live(p) {
      pthread_mutex_lock(&p->lock);
      __pool_sum(p, &lines[n].st);
      pthread_mutex_unlock(&p->lock);
      memcpy(lines[n].name, p->name, sizeof(lines[n].name));
      lines[n].st.name = lines[n].name;
      n++;
    }
  }
  pthread_mutex_unlock(&registry_lock);
  if (lines == NULL && cap != 0) {
    fprintf(out, "keel_pool_print_stats: out of memory for %zu pools\n", cap);
    return;
  }
  fprintf(out, "%-20s %8s %8s %12s %12s %12s %12s %10s %10s %12s %7s %7s\n", "pool", "size",
          "block", "allocs", "hot", "cold", "heap", "live", "cached", "cached_B", "sweeps",
          "threads");
  for (size_t i = 0; i < n; i++) {
    const keel_pool_stats_t *st = &lines[i].st;
    fprintf(out,
            "%-20s %8zu %8zu %12" PRIu64 " %12" PRIu64 " %12" PRIu64 " %12" PRIu64 " %10" PRIu64
            " %10" PRIu64 " %12" PRIu64 " %7" PRIu64 " %7" PRIu64 "\n",
            st->name, st->obj_size, st->block_bytes, st->allocs, st->hot_hits, st->cold_hits,
            st->heap_allocs, st->live, st->cached, st->cached_bytes, st->sweeps, st->threads);
    tot.allocs += st->allocs;
    tot.hot_hits += st->hot_hits;
    tot.cold_hits += st->cold_hits;
    tot.heap_allocs += st->heap_allocs;
    tot.live += st->live;
    tot.cached += st->cached;
    tot.cached_bytes += st->cached_bytes;
  }
  keel_free(lines);
  fprintf(out,
          "%-20s %8s %8s %12" PRIu64 " %12" PRIu64 " %12" PRIu64 " %12" PRIu64 " %10" PRIu64
          " %10" PRIu64 " %12" PRIu64 "\n",
          "total", "", "", tot.allocs, tot.hot_hits, tot.cold_hits, tot.heap_allocs, tot.live,
          tot.cached, tot.cached_bytes);
}
