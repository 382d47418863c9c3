/* keel table: the LRU of unreferenced entries, eviction, and deferred free.
 *
 * LRU. Entries whose count falls to zero are appended to their shard's list
 * (cold at the head). The list is lazy, as in Linux's dcache: a later get
 * does not take the entry off (that would put a lock on the lookup path);
 * the shrinker drops referenced entries from the list when it meets them,
 * and their next put-to-zero appends them again. A lookup or get marks an
 * entry ACCESSED; the shrinker rotates such an entry to the tail once,
 * clearing the bit (second chance, i.e. CLOCK on the list), so an entry
 * survives a pass if it was used since the last one.
 *
 * Cost: the put that drops the last reference takes the shard lock only when
 * the entry is not already on the list (first release, or after the shrinker
 * dropped it); a put of a cached entry that was looked up again is lock-free.
 * Shrinking holds one shard lock at a time for a bounded scan (at most twice
 * the shard's length per call).
 *
 * Trimming (max_unused): the put that adds an entry to the LRU checks the
 * table-wide LRU length, kept only for such tables, and shrinks until it is
 * back at the limit; entries that the scan takes off because they are
 * referenced count towards that as well as evictions, since the limit is on
 * the list. The total is one shared counter updated under the shard locks
 * when an entry joins or leaves a list, so a put that finds its entry still
 * listed (a cached entry used again) neither writes nor reads it.
 *
 * Deferred free: see table_internal.h.
 */
#include <stdlib.h>

#include "base/die.h"
#include "table_internal.h"

/* --- deferred free ------------------------------------------------------------ */

static void gc_launch(table_shard_t *s);

static void gc_free_batch(keel_table_t *t, keel_table_node_t *n) {
  _keel_rcu_tsan_gp_acquire();
  while (n != NULL) { /* only tables with a free_fn bury into a grave (bury_set) */
    keel_table_node_t *next = n->_lru[0];
    t->cfg.free_fn(n, t->cfg.free_arg);
    n = next;
  }
}

/* Runs on liburcu's call_rcu thread a grace period after the batch was
 * taken. The batch's nodes were all unlinked from the index before the
 * batch was taken, so no reader can still hold them. */
static void gc_callback(struct rcu_head *head) {
  table_shard_t *s = caa_container_of(head, table_shard_t, gc_head);
  _keel_rcu_tsan_handoff_acquire(head);
  gc_free_batch(s->table, s->gc_batch);
  uintptr_t g = GRAVE_INFLIGHT;
  /* Going idle is one CAS from "in flight, empty" to 0, the callback's last
   * access to the table: destroy waits for every grave to read 0. */
  if (keel_cas_strong_acq_rel(&s->grave, &g, 0)) return;
  gc_launch(s);
}

/* Takes what is in the grave as the next batch (the in-flight bit stays). */
static void gc_launch(table_shard_t *s) {
  uintptr_t g = keel_xchg_acq_rel(&s->grave, GRAVE_INFLIGHT);
  s->gc_batch = (keel_table_node_t *)(g & ~GRAVE_INFLIGHT);
  KEEL_ASSERT(s->gc_batch != NULL);
  _keel_rcu_tsan_handoff_release(&s->gc_head);
  urcu_memb_call_rcu(&s->gc_head, gc_callback);
}

/* The grave half of a burial: BURIED is set, by the caller. */
static void bury_set(keel_table_t *t, keel_table_node_t *n) {
  table_shard_t *s = node_shard(t, n);
  keel_fetch_sub_relaxed(&s->unburied, 1);
  /* Without a free function a batch would wait a grace period to do
   * nothing: the caller owns the memory and waits for readers itself
   * (table.h). Skipping the grave saves a CAS on a shared line per removal
   * and the grace periods (a membarrier IPI to every CPU each) that the
   * batches cost: a quarter of a removal's CPU at 256 threads on 2 cores.
   * (The walk of such a batch was already skipped: chasing its chain cost
   * one cold node per miss, a seventh of a remove's CPU in a table of 1M.) */
  if (t->cfg.free_fn == NULL) return;
  uintptr_t g = keel_load_relaxed(&s->grave);
  do n->_lru[0] = (keel_table_node_t *)(g & ~GRAVE_INFLIGHT);
  while (!keel_cas_weak_acq_rel(&s->grave, &g, (uintptr_t)n | GRAVE_INFLIGHT));
  if (!(g & GRAVE_INFLIGHT)) {
    rcu_ensure_registered(); /* call_rcu enters a read-side section */
    gc_launch(s);
  }
}

static void bury_check(keel_table_node_t *n, uint32_t v) {
  if (keel_unlikely(v & REF_BURIED))
    keel_die("keel_table", "entry %p freed twice (state 0x%x)", (void *)n, v);
  KEEL_ASSERT((v & (REF_DEAD | REF_ON_LRU | REF_COUNT)) == REF_DEAD);
}

void _keel_table_bury(keel_table_t *t, keel_table_node_t *n) {
  bury_check(n, keel_fetch_or_acq_rel(node_ref(n), REF_BURIED));
  bury_set(t, n);
}

void _keel_table_gc_drain(keel_table_t *t) {
  /* The barrier waits for every callback queued before it; a callback that
   * finds more work queues another, hence the loop. */
  for (int i = 0; i < TABLE_SHARDS; i++) {
    while (keel_load_acquire(&t->shards[i].grave) != 0) urcu_memb_barrier();
  }
}

/* --- LRU ------------------------------------------------------------------ */

/* Counts d nodes onto (or off) a locked shard's list, and into the table's
 * total when a max_unused limit reads it. */
static void lru_count(keel_table_t *t, table_shard_t *s, size_t d) {
  keel_store_relaxed(&s->lru_len, keel_load_relaxed(&s->lru_len) + d);
  if (t->cfg.max_unused != 0) keel_fetch_add_relaxed(&t->lru_total, d);
}

static void lru_unlink(keel_table_t *t, table_shard_t *s, keel_table_node_t *n) {
  cds_list_del(node_lru(n));
  lru_count(t, s, (size_t)-1);
}

/* Clears ON_LRU of a DEAD entry its removal owner has just unlinked (shard
 * lock held) and, when no reference is left, sets BURIED in the same CAS:
 * DEAD from a count of zero, none can appear. Returns whether it set
 * BURIED; the caller then hands the entry to bury_set. With references
 * left, the last put buries it once ON_LRU is clear. */
static bool lru_leave(keel_table_node_t *n) {
  keel_atomic(uint32_t) *ref = node_ref(n);
  uint32_t v = keel_load_relaxed(ref), nv;
  do nv = (v & ~REF_ON_LRU) | ((v & REF_COUNT) == 0 ? REF_BURIED : 0);
  while (!keel_cas_weak_acq_rel(ref, &v, nv));
  if (!(nv & REF_BURIED)) return false;
  bury_check(n, v & ~REF_ON_LRU);
  return true;
}

static void lru_rotate(table_shard_t *s, keel_table_node_t *n) {
  cds_list_del(node_lru(n));
  cds_list_add_tail(node_lru(n), &s->lru);
}

/* Appends an unreferenced live entry to its shard's LRU. */
static void lru_add(keel_table_t *t, keel_table_node_t *n) {
  table_shard_t *s = node_shard(t, n);
  keel_atomic(uint32_t) *ref = node_ref(n);
  pthread_mutex_lock(&s->lock);
  uint32_t v = keel_load_relaxed(ref);
  do {
    /* Referenced again (its put will add it), dying, or already there. */
    if (v & (REF_COUNT | REF_DEAD | REF_ON_LRU)) goto out;
  } while (!keel_cas_weak_acq_rel(ref, &v, v | REF_ON_LRU));
  cds_list_add_tail(node_lru(n), &s->lru);
  lru_count(t, s, 1);
out:
  pthread_mutex_unlock(&s->lock);
}

void _keel_table_put_last(keel_table_t *t, keel_table_node_t *n, uint32_t v) {
  if (v & REF_DEAD) {
    if (!(v & REF_ON_LRU)) _keel_table_bury(t, n); /* else the removal owner will */
    return;
  }
  if (!(v & REF_ON_LRU)) {
    lru_add(t, n);
    if (t->cfg.max_unused != 0) _keel_table_trim(t, n);
  }
  if (t->limited) _keel_table_enforce_limit(t);
}

/* Off the LRU by the removal owner, then burial if the count is zero.
 * Locked instructions are most of a removal's cost once its lines are in
 * cache: an entry that a zero-count marker made DEAD (remove_key, the
 * evictor) is not marked again, and leaving the LRU and burial are one CAS
 * when nothing references the entry. */
void _keel_table_removed(keel_table_t *t, keel_table_node_t *n) {
  table_shard_t *s = node_shard(t, n);
  /* Counted first: once buried, the entry may be freed under us (a caller
   * outside a read-side section), and node_charge reads it. */
  if (shard_count_add(s, -1)) _keel_tidx_check(t);
  if (t->limited) keel_fetch_sub_relaxed(&t->charge, node_charge(t, n));
  keel_atomic(uint32_t) *ref = node_ref(n);
  uint32_t v = keel_load_acquire(ref);
  /* DEAD already: set from a count of zero, which then stays zero (ref_try
   * refuses such an entry), and ON_LRU is ours alone to clear. */
  if (!(v & REF_DEAD)) v = keel_fetch_or_acq_rel(ref, REF_DEAD) | REF_DEAD;
  if (v & REF_ON_LRU) {
#ifndef KEEL_TSAN
    /* The unlink writes both neighbours, cold in a large table: start their
     * misses before the lock. The links are read without it, so they may
     * be stale; a prefetch of a stale address costs nothing but the fetch.
     * (TSan would report the unlocked read; it gains nothing there.) */
    struct cds_list_head *l = node_lru(n);
    __builtin_prefetch(__atomic_load_n(&l->prev, __ATOMIC_RELAXED), 1);
    __builtin_prefetch(__atomic_load_n(&l->next, __ATOMIC_RELAXED), 1);
#endif
    /* Once DEAD, only this thread clears ON_LRU and nobody sets it. */
    pthread_mutex_lock(&s->lock);
    lru_unlink(t, s, n);
    bool buried = lru_leave(n);
    pthread_mutex_unlock(&s->lock);
    if (buried) bury_set(t, n);
  } else if ((v & REF_COUNT) == 0) {
    _keel_table_bury(t, n);
  }
}

/* --- shrinking ------------------------------------------------------------ */

/* One step at the cold end of a locked shard: drops a referenced entry from
 * the list, rotates a recently used one, or evicts. Returns true if an
 * entry was evicted. */
static bool shrink_step(keel_table_t *t, table_shard_t *s, keel_table_node_t *n, bool *check) {
  keel_atomic(uint32_t) *ref = node_ref(n);
  uint32_t v = keel_load_relaxed(ref);
  for (;;) {
    if (v & REF_DEAD) {
      /* A remover owns it and waits for this lock to unlink it. */
      lru_rotate(s, n);
      return false;
    }
    if (v & REF_COUNT) {
      /* Unlink first, then clear ON_LRU only if still referenced and alive:
       * once ON_LRU is clear a removal owner may bury the node and reuse
       * its links, so the links must be ours no longer. If the last
       * reference went meanwhile (its put saw ON_LRU and left the entry to
       * us) or a remover marked it DEAD (it will unlink it after us), the
       * node goes back on the list. */
      lru_unlink(t, s, n);
      do {
        if (!(v & REF_COUNT) || (v & REF_DEAD)) {
          cds_list_add_tail(node_lru(n), &s->lru);
          lru_count(t, s, 1);
          return false;
        }
      } while (!keel_cas_weak_acq_rel(ref, &v, v & ~REF_ON_LRU));
      return false;
    }
    if (v & REF_ACCESSED) {
      if (!keel_cas_weak_acq_rel(ref, &v, v & ~REF_ACCESSED)) continue;
      lru_rotate(s, n);
      return false;
    }
    if (keel_cas_weak_acq_rel(ref, &v, v | REF_DEAD)) break;
  }
  /* DEAD from a zero count: no new reference can appear. */
  if (_keel_tidx_del(t, n, check, 0) != 0) {
    /* keel_table_remove deleted it first, or a get_or_insert did for us
     * (HELPED: an eviction to count); either unlinks it after us. */
    lru_rotate(s, n);
    if (!(keel_load_relaxed(ref) & REF_HELPED)) return false;
    keel_fetch_add_relaxed(&t->evicted, 1);
    return true;
  }
  if (shard_count_add(s, -1)) *check = true; /* after the shard lock */
  if (t->limited) keel_fetch_sub_relaxed(&t->charge, node_charge(t, n));
  lru_unlink(t, s, n);
  keel_fetch_add_relaxed(&t->evicted, 1);
  if (lru_leave(n)) bury_set(t, n); /* always: DEAD from zero */
  return true;
}

/* True once a trim to `keep` LRU entries is done (SIZE_MAX: not a trim). */
static bool trimmed(keel_table_t *t, size_t keep) {
  return keep != SIZE_MAX && keel_load_relaxed(&t->lru_total) <= keep;
}

/* Shrinks one shard. `once`: visit each entry at most once, so that one used
 * since the last pass keeps its second chance through this call. */
static size_t shrink_shard(keel_table_t *t, table_shard_t *s, size_t want, size_t keep, bool once) {
  size_t done = 0;
  bool check = false;
  pthread_mutex_lock(&s->lock);
  /* Each step removes the head or moves it to the tail, so twice the
   * length visits every entry at least once after its bit was cleared. */
  size_t len = keel_load_relaxed(&s->lru_len), budget = once ? len : 2 * len + 1;
  for (unsigned steps = 1;
       done < want && budget-- > 0 && !cds_list_empty(&s->lru) && !trimmed(t, keep); steps++) {
    if (shrink_step(t, s, lru_node(s->lru.next), &check)) done++;
    /* Every 256 steps let the shard's other users in, and start the resize
     * the evictions asked for (never under the lock: it may allocate). */
    if (steps % 256 == 0) {
      pthread_mutex_unlock(&s->lock);
      if (check) _keel_tidx_check(t);
      check = false;
      pthread_mutex_lock(&s->lock);
    }
  }
  pthread_mutex_unlock(&s->lock);
  if (check) _keel_tidx_check(t);
  return done;
}

/* Evicts up to n entries, visiting the shards from `start` on, and stopping
 * early once the LRU holds at most `keep` (SIZE_MAX: no such stop). */
static size_t shrink_to(keel_table_t *t, size_t n, size_t keep, unsigned start) {
  size_t done = 0;
  /* Spread the work: each shard gives its share, then any shard gives what
   * is still missing. A trim's first pass visits each entry once, so that
   * recently used ones keep their second chance through it. */
  size_t share = n / TABLE_SHARDS + 1;
  _keel_rcu_read_lock(); /* _keel_tidx_del needs a read-side section */
  for (int pass = 0; pass < 2 && done < n && !trimmed(t, keep); pass++) {
    for (unsigned i = 0; i < TABLE_SHARDS && done < n && !trimmed(t, keep); i++) {
      size_t want = n - done;
      if (pass == 0 && want > share) want = share;
      bool once = pass == 0 && keep != SIZE_MAX;
      done += shrink_shard(t, &t->shards[(start + i) % TABLE_SHARDS], want, keep, once);
    }
  }
  _keel_rcu_read_unlock();
  return done;
}

size_t keel_table_shrink(keel_table_t *t, size_t n) {
  if (t == NULL || n == 0) return 0;
  return shrink_to(t, n, SIZE_MAX, keel_fetch_add_relaxed(&t->cursor, 1));
}

void _keel_table_trim(keel_table_t *t, keel_table_node_t *n) {
  size_t total = keel_load_relaxed(&t->lru_total), keep = t->cfg.max_unused;
  if (keel_likely(total <= keep)) return;
  /* At most the excess is evicted: referenced entries taken off the list
   * make up the rest. The lists are in release order only each on its own:
   * starting from the shard after n's and ending with n's keeps the entry
   * just released, the newest, unless every other list is empty (n is at
   * its own list's tail, so that one is reached last anyway). */
  unsigned own = (unsigned)(node_shard(t, n) - t->shards);
  shrink_to(t, total - keep, keep, own + 1);
}

void _keel_table_enforce_limit(keel_table_t *t) {
  size_t charge = keel_load_relaxed(&t->charge);
  size_t limit = t->cfg.max_bytes ? t->cfg.max_bytes : t->cfg.max_entries;
  if (keel_likely(charge <= limit)) return;
  if (t->cfg.max_bytes == 0) {
    keel_table_shrink(t, charge - limit);
    return;
  }
  /* Bytes: entries differ in size; evict what the average entry says is
   * over, and again while still over (a short key list overshoots by less
   * than one entry). */
  while ((charge = keel_load_relaxed(&t->charge)) > limit) {
    size_t count = keel_table_count(t);
    size_t avg = count ? charge / count : charge;
    if (keel_table_shrink(t, (charge - limit) / (avg ? avg : 1) + 1) == 0) break;
  }
}
