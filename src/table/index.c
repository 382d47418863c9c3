/* keel table: the index's writers: bucket locks, insert, removal, resizing,
 * migration and walks. See index.h for the design and its invariants; the
 * lookup is table_internal.h's tidx_find.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "base/die.h"
#include "base/os.h"
#include "base/tls.h"
#include "table_internal.h"

/* --- arrays ------------------------------------------------------------------ */

/* An array of `buckets`, zeroed. A small one comes from calloc, aligned by
 * hand to a cache line so that the migrators' counters and the buckets do
 * not share lines with what readers load. One that fills a huge page or
 * more is mapped directly (fresh zero pages, committed as they fill), and
 * one a resize makes (`dense`) asks for transparent huge pages: 2 MiB
 * faults instead of 512 (a grow to 2M buckets took 4,096 faults inside
 * inserts), and a bucket load that misses the TLB walks one level less:
 * 11% less CPU per insert in the runs index.h quotes.
 * A grow's array is over half full from the start, a shrink's half the size
 * of an array that was resident, so huge pages add no memory there. The
 * first array stays on small pages: a size hint far above what the table
 * ever holds would otherwise be resident in full. */
static tidx_array_t *array_new(size_t buckets, bool dense) {
  size_t bytes = sizeof(tidx_array_t) + buckets * sizeof(uintptr_t);
  size_t huge = _keel_os_huge_page_size();
  tidx_array_t *a;
  if (bytes >= huge) {
    size_t len = KEEL_ALIGN_UP(bytes, _keel_os_page_size());
    a = _keel_os_alloc(len, huge);
    if (a == NULL) return NULL;
    /* Whole huge pages only: the header puts a power of two of buckets just
     * past a 2 MiB boundary, and advice over that tail made its last few
     * buckets fault in a whole huge page (2^18 buckets: 4 MiB resident). */
    if (dense) _keel_os_advise_huge(a, KEEL_ALIGN_DOWN(bytes, huge));
    a->map_len = len;
  } else {
    void *raw = calloc(1, bytes + KEEL_CACHE_LINE);
    if (raw == NULL) return NULL;
    a = (tidx_array_t *)KEEL_ALIGN_UP((uintptr_t)raw, (uintptr_t)KEEL_CACHE_LINE);
    a->raw = raw;
  }
  a->mask = buckets - 1;
  return a;
}

static void array_free(tidx_array_t *a) {
  if (a == NULL) return;
  if (a->map_len != 0)
    (void)_keel_os_release(a, a->map_len);
  else
    free(a->raw);
}

static void array_free_cb(struct rcu_head *head) {
  tidx_array_t *a = caa_container_of(head, tidx_array_t, rcu);
  _keel_rcu_tsan_handoff_acquire(head);
  _keel_rcu_tsan_gp_acquire();
  array_free(a);
}

static size_t pow2_ceil(size_t x) {
  return x <= 1 ? 1 : (size_t)1 << (64 - __builtin_clzll((unsigned long long)(x - 1)));
}

int _keel_tidx_init(keel_table_t *t, size_t hint) {
  /* A hint above 2^27 entries is taken as 2^27 (1 GiB of buckets, committed
   * as they fill): the table grows past it by itself. */
  if (hint > TIDX_MAX_INIT_BUCKETS) hint = TIDX_MAX_INIT_BUCKETS;
  size_t n = pow2_ceil(hint);
  if (n < TIDX_MIN_BUCKETS) n = TIDX_MIN_BUCKETS;
  tidx_array_t *a = array_new(n, false);
  if (a == NULL) return -1;
  t->ix.min_buckets = n;
  keel_store_relaxed(&t->ix.arr, a);
  return 0;
}

void _keel_tidx_fini(keel_table_t *t) {
  tidx_array_t *a = keel_load_relaxed(&t->ix.arr);
  array_free(keel_load_relaxed(&a->next));
  array_free(a);
}

size_t _keel_tidx_buckets(const keel_table_t *t) {
  _keel_rcu_read_lock(); /* keeps the array allocated */
  tidx_array_t *a = keel_load_acquire(&((keel_table_t *)t)->ix.arr);
  size_t n = a->mask + 1;
  _keel_rcu_read_unlock();
  return n;
}

/* --- bucket locks ------------------------------------------------------------ */

/* Spins briefly, then yields: with hundreds of threads on a few cores the
 * holder may be preempted, and spinning would only keep it off the CPU. */
static void backoff(unsigned *spins) {
  if (++*spins < 64)
    keel_cpu_relax();
  else
    sched_yield();
}

/* Locks a bucket and returns its chain head, or TIDX_MOVED (not locked:
 * the state is final) if its chain has been migrated. */
static uintptr_t bucket_lock(keel_atomic(uintptr_t) * b) {
  unsigned spins = 0;
  uintptr_t v = keel_load_acquire(b);
  for (;;) {
    if (v == TIDX_MOVED) return v;
    if (!(v & TIDX_LOCK) && atomic_compare_exchange_weak_explicit(
                                b, &v, v | TIDX_LOCK, memory_order_acquire, memory_order_acquire))
      return v;
    if (v & TIDX_LOCK) {
      backoff(&spins);
      v = keel_load_acquire(b);
    }
  }
}

/* Unlocks a bucket, storing its (new) head; the release publishes every
 * node linked under the lock. */
KEEL_INLINE void bucket_unlock(keel_atomic(uintptr_t) * b, uintptr_t head) {
  keel_store_release(b, head);
}

/* Locks the bucket of `hash` in the array that holds its chain now: the
 * current one, or the next one if that bucket was migrated. */
static keel_atomic(uintptr_t) * bucket_lock_hash(keel_table_t *t, uint64_t hash, uintptr_t *head) {
  tidx_array_t *a = keel_load_acquire(&t->ix.arr);
  for (;;) {
    keel_atomic(uintptr_t) *b = &a->b[hash & a->mask];
    uintptr_t v = bucket_lock(b);
    if (v != TIDX_MOVED) {
      *head = v;
      return b;
    }
    a = keel_load_acquire(&a->next);
  }
}

/* --- resizing ---------------------------------------------------------------- */

/* The size the load asks of an array of `size` buckets: grow above one
 * entry per bucket (to between a half and one), halve below a quarter but
 * never below the size the hint asked for. Halving, not a jump to the
 * count: the resize takes size/16 writes, during which the count may grow
 * again, and a half-size array still holds what a quarter grows to in
 * that time at a load of at most one. */
static size_t want_buckets(keel_table_t *t, size_t size) {
  size_t count = keel_table_count(t);
  if (count > size) return pow2_ceil(count);
  if (count < size / 4 && size / 2 >= t->ix.min_buckets) return size / 2;
  return size;
}

/* Starts a resize if the load asks for one and none is under way. */
void _keel_tidx_check(keel_table_t *t) {
  if (keel_load_relaxed(&t->ix.resizing)) return;
  _keel_rcu_read_lock(); /* keeps the array read here allocated */
  tidx_array_t *a = keel_load_acquire(&t->ix.arr);
  size_t size = a->mask + 1;
  _keel_rcu_read_unlock();
  if (want_buckets(t, size) == size) return;
  int idle = 0;
  if (!atomic_compare_exchange_strong(&t->ix.resizing, &idle, 1)) return;
  /* With the flag held the current array has no next one: the last resize
   * made its array current before it cleared the flag. Decide again on
   * that array (it may be newer than the one above). */
  a = keel_load_acquire(&t->ix.arr);
  size_t want = want_buckets(t, a->mask + 1);
  tidx_array_t *to = want != a->mask + 1 ? array_new(want, true) : NULL;
  if (to == NULL) { /* no resize needed after all, or no memory: stay as is */
    keel_store_release(&t->ix.resizing, 0);
    return;
  }
  /* Buckets each write moves (index.h): a grow starts at one entry per
   * bucket and must end before the count doubles; a shrink starts at a
   * quarter and must end before the removals that follow empty the table. */
  a->help = want > a->mask + 1 ? TIDX_HELP_GROW : TIDX_HELP_SHRINK;
  keel_store_release(&a->next, to);
}

/* Moves one node, the tail of its old chain, to the head of its new
 * bucket (its link now leads into the new chain), then cuts it from the
 * old chain: index.h says why a reader never loses the rest of a chain. */
static void move_tail(keel_table_t *t, tidx_array_t *to, keel_table_node_t *prev,
                      keel_table_node_t *tail) {
  keel_atomic(uintptr_t) *nb = &to->b[node_hash(t, tail) & to->mask];
  uintptr_t nh = bucket_lock(nb); /* `to` has no MOVED bucket before it is current */
  keel_store_release(node_next(tail), tidx_first(nh));
  bucket_unlock(nb, (uintptr_t)tail);
  if (prev != NULL) keel_store_release(node_next(prev), NULL);
}

/* Moves bucket i of `from` into `to`, tail first, holding its lock. A
 * chain of up to 32 nodes is collected once and moved from its end; a
 * longer one (only a table whose growth lagged far behind) is walked again
 * for each tail. */
static void migrate_bucket(keel_table_t *t, tidx_array_t *from, tidx_array_t *to, size_t i) {
  keel_atomic(uintptr_t) *b = &from->b[i];
  uintptr_t head = bucket_lock(b);
  KEEL_ASSERT(head != TIDX_MOVED);
  keel_table_node_t *chain[32], *p = tidx_first(head);
  size_t n = 0;
  for (; p != NULL && n < 32; p = keel_load_relaxed(node_next(p))) chain[n++] = p;
  if (p == NULL) {
    while (n > 0) {
      n--;
      move_tail(t, to, n > 0 ? chain[n - 1] : NULL, chain[n]);
    }
  } else {
    keel_table_node_t *first = tidx_first(head);
    while (first != NULL) {
      keel_table_node_t *prev = NULL, *tail = first, *nx;
      while ((nx = keel_load_relaxed(node_next(tail))) != NULL) {
        prev = tail;
        tail = nx;
      }
      move_tail(t, to, prev, tail);
      if (prev == NULL) first = NULL;
    }
  }
  bucket_unlock(b, TIDX_MOVED);
}

/* The migrator of the last bucket: the next array becomes current and the
 * old one is freed after a grace period. */
static void resize_finish(keel_table_t *t, tidx_array_t *from, tidx_array_t *to) {
  keel_store_release(&t->ix.arr, to);
  keel_fetch_add_relaxed(&t->ix.resizes, 1);
  _keel_rcu_tsan_handoff_release(&from->rcu);
  urcu_memb_call_rcu(&from->rcu, array_free_cb);
  keel_store_release(&t->ix.resizing, 0);
}

/* This thread's writes during the grow of claim_from (migrate_some): the
 * first and every TIDX_BATCH-th after it claims a line of buckets. */
static KEEL_TLS const tidx_array_t *claim_from;
static KEEL_TLS unsigned claim_tick;
_Static_assert(TIDX_BATCH % TIDX_HELP_GROW == 0, "a line claim is a whole number of writes' share");

/* A write's share of a resize in flight: from->help buckets, or, in a large
 * array that grows, a cache line of TIDX_BATCH buckets at the first and
 * every TIDX_BATCH-th write of this thread (index.h). The first node of every claimed bucket is
 * prefetched before any is moved: each move is a locked exchange, after
 * which the next bucket's miss would start only once the last finished.
 * Inside a read-side section (it keeps `from` allocated). True if it
 * finished the resize. */
static bool migrate_some(keel_table_t *t) {
  tidx_array_t *from = keel_load_acquire(&t->ix.arr);
  tidx_array_t *to = keel_load_acquire(&from->next);
  if (to == NULL) return false;
  size_t size = from->mask + 1, n = from->help;
  if (n < TIDX_BATCH && size >= TIDX_BATCH_MIN) {
    /* Pay ahead, never behind: a thread that writes once during a grow
     * still claims a line, so threads that each write a few times (or exit)
     * cannot leave the grow unfinished. A new array restarts the count (an
     * array reallocated at the same address only shifts it). */
    if (claim_from != from) {
      claim_from = from;
      claim_tick = 0;
    }
    if (claim_tick++ % (TIDX_BATCH / n) != 0) return false;
    n = TIDX_BATCH;
  }
  size_t lo = keel_fetch_add_relaxed(&from->claim, n);
  if (lo >= size) return false;
  size_t hi = lo + n < size ? lo + n : size;
  for (size_t i = lo; i < hi; i++) {
    keel_table_node_t *first = tidx_first(keel_load_relaxed(&from->b[i]));
    if ((uintptr_t)first > TIDX_MOVED) __builtin_prefetch(first); /* not empty or MOVED */
  }
  for (size_t i = lo; i < hi; i++) migrate_bucket(t, from, to, i);
  if (keel_fetch_add_acq_rel(&from->moved, hi - lo) + (hi - lo) != size) return false;
  resize_finish(t, from, to);
  return true;
}

/* After a write: its share of a resize in flight. When that finished the
 * resize, the load is checked again (checks are dropped while a resize
 * runs, and shrinking has no other trigger than counts crossing multiples
 * of 128), at once or, for a caller under an LRU shard lock, by the caller
 * after its unlock (a check may allocate). */
KEEL_INLINE void write_done(keel_table_t *t, bool *check) {
  if (keel_likely(!keel_load_relaxed(&t->ix.resizing)) || !migrate_some(t)) return;
  if (check != NULL)
    *check = true;
  else
    _keel_tidx_check(t);
}

/* --- insert and remove --------------------------------------------------------- */

keel_table_node_t *_keel_tidx_add(keel_table_t *t, keel_table_node_t *n, uint64_t hash) {
  uintptr_t head;
  keel_atomic(uintptr_t) *b = bucket_lock_hash(t, hash, &head);
  unsigned len = 0;
  for (keel_table_node_t *p = tidx_first(head); p != NULL; p = keel_load_relaxed(node_next(p))) {
    if (node_same_key(t, p, n)) {
      bucket_unlock(b, head);
      return p;
    }
    len++;
  }
  keel_store_relaxed(node_next(n), tidx_first(head));
  bucket_unlock(b, (uintptr_t)n);
  if (keel_unlikely(len >= TIDX_CHAIN_CHECK)) _keel_tidx_check(t);
  write_done(t, NULL);
  return n;
}

int _keel_tidx_del(keel_table_t *t, keel_table_node_t *n, bool *check, uint32_t mark) {
  uintptr_t head;
  keel_atomic(uintptr_t) *b = bucket_lock_hash(t, node_hash(t, n), &head);
  keel_table_node_t *prev = NULL;
  for (keel_table_node_t *p = tidx_first(head); p != NULL; p = keel_load_relaxed(node_next(p))) {
    if (p != n) {
      prev = p;
      continue;
    }
    /* For the marker whose own unlink will fail (REF_HELPED); the bucket
     * unlock below publishes it. */
    if (mark) atomic_fetch_or_explicit(node_ref(n), mark, memory_order_relaxed);
    /* n keeps its link: a reader standing on it still reaches the rest. */
    keel_table_node_t *nx = keel_load_relaxed(node_next(n));
    if (prev == NULL) {
      bucket_unlock(b, (uintptr_t)nx);
    } else {
      keel_store_release(node_next(prev), nx);
      bucket_unlock(b, head);
    }
    write_done(t, check);
    return 0;
  }
  bucket_unlock(b, head);
  return -1; /* not in the table: another thread removed it */
}

/* --- walks --------------------------------------------------------------------- */

/* A walk goes through the buckets of the array that was current when it
 * started, index by index. Bucket i's chain is copied under its lock and fn
 * is called on the copy after the unlock (fn may write to the table; the
 * nodes stay allocated for the walk's read-side section). If bucket i has
 * been migrated, its entries are wherever its chain went: the buckets of
 * the next array that take keys from i (i, i + S, ... when growing from S;
 * i & newmask when shrinking), and so on down any later arrays. Those
 * buckets also hold entries from other paths (a shrink merges buckets, and
 * a grow then a shrink brings two paths back to one bucket), so a path
 * keeps the (mask, index) of the largest array it has passed through and
 * takes only the nodes whose hash gives that index: every node has exactly
 * one path, its hash's. A bucket's state is final once MOVED and read under
 * its lock, and nodes only move forward, so an entry that stays in the
 * table throughout is copied exactly once, whatever migration does. */
typedef struct walk {
  keel_table_t *t;
  int (*fn)(keel_table_node_t *, void *);
  void *arg;
  keel_table_node_t **v; /* the copy: inl, or malloc'ed when a chain is longer */
  size_t cap;
  keel_table_node_t *inl[32];
} walk_t;

static bool walk_grow(walk_t *w) {
  size_t cap = w->cap * 2;
  keel_table_node_t **v = malloc(cap * sizeof *v);
  if (v == NULL) return false;
  memcpy(v, w->v, w->cap * sizeof *v);
  if (w->v != w->inl) free(w->v);
  w->v = v;
  w->cap = cap;
  return true;
}

/* Visits bucket i of a for the path whose largest array so far has mask
 * fmask and index fidx. */
static int walk_bucket(walk_t *w, tidx_array_t *a, size_t i, size_t fmask, size_t fidx) {
  keel_atomic(uintptr_t) * b;
  uintptr_t head;
  /* Recursion only where the path widens (an array larger than any on it
   * so far: one call per bucket that takes part of it), a loop elsewhere
   * (one bucket can hold the path's nodes): the depth is at most log2 of
   * the largest array over the walk's first, however many resizes run
   * during the walk. */
  while ((head = bucket_lock(b = &a->b[i])) == TIDX_MOVED) {
    tidx_array_t *to = keel_load_acquire(&a->next);
    if (to->mask <= fmask) {
      a = to;
      i = fidx & to->mask;
      continue;
    }
    /* Buckets of `to` that take keys from i and agree with the path on
     * the bits of fmask: each starts a wider path. */
    for (size_t j = i; j <= to->mask; j += a->mask + 1) {
      if (((j ^ fidx) & fmask) != 0) continue;
      int rc = walk_bucket(w, to, j, to->mask, j);
      if (rc != 0) return rc;
    }
    return 0;
  }
  /* In an array as large as the path's largest, the index agrees with the
   * path's, so every node of the bucket is the path's; in a smaller one,
   * buckets have merged. */
  bool filter = a->mask < fmask;
  size_t n = 0;
  for (keel_table_node_t *p = tidx_first(head); p != NULL; p = keel_load_relaxed(node_next(p))) {
    if (filter && (node_hash(w->t, p) & fmask) != fidx) continue;
    if (n == w->cap && !walk_grow(w)) {
      bucket_unlock(b, head);
      return KEEL_ENOMEM;
    }
    w->v[n++] = p;
  }
  bucket_unlock(b, head);
  for (size_t k = 0; k < n; k++) {
    (void)keel_load_acquire(node_ref(w->v[k])); /* see tidx_find */
    int rc = w->fn(w->v[k], w->arg);
    if (rc != 0) return rc;
  }
  return 0;
}

int _keel_tidx_walk(keel_table_t *t, int (*fn)(keel_table_node_t *, void *), void *arg) {
  walk_t w = {.t = t, .fn = fn, .arg = arg, .cap = 32};
  w.v = w.inl;
  tidx_array_t *a = keel_load_acquire(&t->ix.arr);
  int rc = 0;
  for (size_t i = 0; i <= a->mask && rc == 0; i++) rc = walk_bucket(&w, a, i, a->mask, i);
  if (w.v != w.inl) free(w.v);
  return rc;
}

int _keel_tidx_walk_alone(keel_table_t *t, int (*fn)(keel_table_node_t *, void *), void *arg) {
  /* Nothing moves: every entry is in a live bucket of the current array or
   * in the next one (only the current array can have a next). */
  tidx_array_t *a = keel_load_acquire(&t->ix.arr);
  tidx_array_t *next = keel_load_acquire(&a->next);
  for (int k = 0; k < 2 && a != NULL; k++, a = next) {
    for (size_t i = 0; i <= a->mask; i++) {
      uintptr_t h = keel_load_acquire(&a->b[i]);
      if (h == TIDX_MOVED) continue;
      for (keel_table_node_t *p = tidx_first(h); p != NULL; p = keel_load_acquire(node_next(p))) {
        int rc = fn(p, arg);
        if (rc != 0) return rc;
      }
    }
  }
  return 0;
}
