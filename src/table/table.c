/* keel table: create, destroy, insert, lookup, references and removal.
 *
 * The index is keel's own RCU hash table (index.h: one-pointer buckets, at
 * most one entry per bucket, resized incrementally by writers): a lookup
 * hashes the key, loads one bucket and walks 1.5 nodes on average, comparing
 * keys in the node (byte-string keys: length first, then the caller's
 * bytes). What the entry state adds on a lookup is one acquire load of the
 * state word (same cache line as the chain link) and, once per LRU pass,
 * setting its ACCESSED bit.
 *
 * See table_internal.h for the entry state machine; lru.c for caching,
 * eviction and the deferred free.
 */
#define _GNU_SOURCE /* PTHREAD_MUTEX_ADAPTIVE_NP */
/* The last put's read-side section is liburcu's inline one outside TSan
 * builds (see rcu.c for why TSan builds call out of line). */
#if !defined(__SANITIZE_THREAD__)
#define _LGPL_SOURCE
#endif
#include <stdlib.h>
#include <time.h>

#include "base/die.h"
#include "table_internal.h"

static keel_atomic(uint32_t) table_tags; /* tags 1..0xfffe, then wrap */

/* --- keys ------------------------------------------------------------------ */

/* Validates a lookup key and hashes it; false (errno EINVAL) if malformed. */
KEEL_INLINE bool key_prepare(const keel_table_t *t, const void *key, size_t len, table_key_t *k,
                             uint64_t *hash, const char *call) {
  if (t->cfg.key_type == KEEL_TABLE_KEY_U64) {
    if (keel_unlikely(len != sizeof(uint64_t) || key == NULL)) goto bad;
    memcpy(&k->u64, key, sizeof k->u64);
    *hash = _keel_hash_u64(k->u64, t->seed);
    return true;
  }
  if (keel_unlikely(len > t->cfg.key_max || (key == NULL && len != 0))) goto bad;
  k->p = key;
  k->len = len;
  *hash = _keel_hash_bytes(key, len, t->seed);
  return true;
bad:
  _keel_reject(call, "key %p of %zu bytes (a %s key, at most %u)", key, len,
               t->cfg.key_type == KEEL_TABLE_KEY_U64 ? "u64" : "byte", t->cfg.key_max);
  errno = EINVAL;
  return false;
}

/* Finds a node inside a read-side section; NULL if absent. */
KEEL_INLINE keel_table_node_t *find(keel_table_t *t, const void *key, size_t len,
                                    const char *call) {
  table_key_t k = {0, NULL, 0};
  uint64_t hash;
  if (!key_prepare(t, key, len, &k, &hash, call)) return NULL;
  keel_table_node_t *n = tidx_find(t, hash, &k);
  if (n == NULL) errno = ENOENT;
  return n;
}

/* --- create / destroy ------------------------------------------------------ */

static uint64_t table_seed(const keel_table_t *t) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t s = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)(uintptr_t)t;
  return _keel_hash_u64(s, 0x9e3779b97f4a7c15ull);
}

static bool config_valid(keel_table_config_t *c) {
  if (c->key_type != KEEL_TABLE_KEY_U64 && c->key_type != KEEL_TABLE_KEY_BYTES) return false;
  if (c->key_type == KEEL_TABLE_KEY_BYTES) {
    if (c->key_max == 0) c->key_max = 255;
    if (c->key_max > KEEL_TABLE_KEY_MAX) return false;
  } else {
    c->key_max = sizeof(uint64_t);
  }
  /* A byte limit needs something to charge. */
  if (c->max_bytes != 0 && c->entry_size == 0 && c->key_type == KEEL_TABLE_KEY_U64) return false;
  return true;
}

keel_table_t *keel_table_create(const keel_table_config_t *config) {
  if (config == NULL) {
    _keel_reject("keel_table_create", "config is NULL");
    goto inval;
  }
  keel_table_config_t cfg = *config;
  if (!config_valid(&cfg)) {
    _keel_reject("keel_table_create",
                 "key_type %d, key_max %u (at most %d), max_bytes %zu with entry_size %zu",
                 (int)config->key_type, config->key_max, KEEL_TABLE_KEY_MAX, config->max_bytes,
                 config->entry_size);
    goto inval;
  }
  keel_table_t *t = aligned_alloc(KEEL_CACHE_LINE, sizeof *t);
  if (t == NULL) goto nomem;
  memset(t, 0, sizeof *t);
  t->cfg = cfg;
  t->seed = table_seed(t);
  t->limited = cfg.max_entries != 0 || cfg.max_bytes != 0;
  uint32_t tag;
  do tag = keel_fetch_add_relaxed(&table_tags, 1) % 0xfffeu + 1;
  while (tag == 0);
  t->tag = (uint16_t)tag;
  /* Adaptive: a shard's hold is a list link or unlink, shorter than a
   * futex sleep and wake. */
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
  for (int i = 0; i < TABLE_SHARDS; i++) {
    pthread_mutex_init(&t->shards[i].lock, &attr);
    CDS_INIT_LIST_HEAD(&t->shards[i].lru);
    t->shards[i].table = t;
  }
  pthread_mutexattr_destroy(&attr);
  if (_keel_tidx_init(t, cfg.size_hint) != 0) {
    for (int i = 0; i < TABLE_SHARDS; i++) pthread_mutex_destroy(&t->shards[i].lock);
    free(t);
    goto nomem;
  }
  return t;
inval:
  errno = EINVAL;
  return NULL;
nomem:
  errno = ENOMEM;
  return NULL;
}

static long sum_shards(const keel_table_t *t, bool unburied) {
  long s = 0;
  for (int i = 0; i < TABLE_SHARDS; i++)
    s += unburied ? keel_load_relaxed(&t->shards[i].unburied)
                  : keel_load_relaxed(&t->shards[i].in_table);
  return s;
}

/* Destroy, once nothing references any entry: forget the LRU lists (their
 * links are reused below, and no one else may touch the table now), collect
 * every entry in one walk of the buckets (a walk of the LRU lists would
 * visit the same entries in random order, a cache miss each), wait one grace
 * period for readers that started before the destroy, then free the entries
 * directly and the index with them. */
static int destroy_collect(keel_table_node_t *n, void *arg) {
  keel_table_node_t **dead = arg;
  uint32_t v = keel_load_relaxed(node_ref(n));
  keel_store_relaxed(node_ref(n), (v & ~REF_ON_LRU) | REF_DEAD | REF_BURIED);
  n->_lru[0] = *dead;
  *dead = n;
  return 0;
}

static void destroy_entries(keel_table_t *t) {
  for (int i = 0; i < TABLE_SHARDS; i++) {
    CDS_INIT_LIST_HEAD(&t->shards[i].lru);
    keel_store_relaxed(&t->shards[i].lru_len, 0);
  }
  keel_store_relaxed(&t->lru_total, 0);
  keel_table_node_t *dead = NULL;
  _keel_tidx_walk_alone(t, destroy_collect, &dead);
  urcu_memb_synchronize_rcu();
  _keel_rcu_tsan_gp_acquire();
  while (dead != NULL) {
    keel_table_node_t *next = dead->_lru[0];
    if (t->cfg.free_fn != NULL) t->cfg.free_fn(dead, t->cfg.free_arg);
    dead = next;
  }
}

static int referenced(keel_table_node_t *n, void *arg) {
  (void)arg;
  return (keel_load_acquire(node_ref(n)) & REF_COUNT) != 0;
}

int keel_table_destroy(keel_table_t *t) {
  if (t == NULL) return 0;
  rcu_ensure_registered();
  if (urcu_memb_read_ongoing()) /* would wait for itself */
    return KEEL_REJECT(KEEL_EINVAL, "keel_table_destroy", "called inside a read-side section");
  /* Referenced entries: in the table with a count, or removed and not yet
   * released (their last put would touch the table). */
  int busy = sum_shards(t, true) != sum_shards(t, false);
  if (!busy) busy = _keel_tidx_walk_alone(t, referenced, NULL);
  if (busy) return KEEL_EBUSY;
  /* Earlier removals' deferred frees first: they run on liburcu's call_rcu
   * thread, and the free callback must not run on two threads at once
   * (review, helper-89: it did, with destroy_entries' own). */
  _keel_table_gc_drain(t);
  destroy_entries(t);
  /* Arrays replaced by resizes are freed by call_rcu callbacks: let them
   * run, so that none outlives the table's destruction. */
  if (keel_load_relaxed(&t->ix.resizes) != 0) urcu_memb_barrier();
  _keel_tidx_fini(t);
  for (int i = 0; i < TABLE_SHARDS; i++) pthread_mutex_destroy(&t->shards[i].lock);
  free(t);
  return 0;
}

/* --- insert / lookup ------------------------------------------------------- */

/* Takes a reference unless the entry is dying (DEAD with none left); with
 * `strict`, unless it is DEAD at all (lookups by key never return removed
 * entries). */
static bool ref_try(keel_table_node_t *n, bool strict) {
  keel_atomic(uint32_t) *ref = node_ref(n);
  uint32_t v = keel_load_relaxed(ref);
  do {
    if ((v & REF_DEAD) && (strict || (v & REF_COUNT) == 0)) return false;
    if (keel_unlikely((v & REF_COUNT) == REF_COUNT))
      keel_die("keel_table_ref", "reference count overflow at %p", (void *)n);
  } while (!keel_cas_weak_acq_rel(ref, &v, (v + 1) | REF_ACCESSED));
  return true;
}

/* Claims a node for insertion into t: 0, or KEEL_EINVAL for a bad key or a
 * node already in a table. A CAS, so one insert wins even if two race on the
 * same node; only the winner writes the tag. The release store then orders
 * the caller's writes to its entry, and the tag, before any reader that
 * finds the node and loads the word (see tidx_find). The CAS costs about
 * 8 ns where a node is claimed on every call (get_or_insert with a reused
 * spare node, measured for issue 7): a check and a store would do if that
 * race were left to the caller. */
static int node_claim(keel_table_t *t, keel_table_node_t *n, uint16_t *old_tag, const char *call) {
  if (t->cfg.key_type == KEEL_TABLE_KEY_BYTES &&
      (n->_tag == 0xffff || n->_key_len > t->cfg.key_max || (n->key.bytes == NULL && n->_key_len)))
    return KEEL_REJECT(KEEL_EINVAL, call, "node %p: key %p of %u bytes (at most %u)", (void *)n,
                       (const void *)n->key.bytes, (unsigned)n->_key_len, t->cfg.key_max);
  keel_atomic(uint32_t) *ref = node_ref(n);
  uint32_t v = keel_load_relaxed(ref);
  if ((v & REF_LINKED) || !keel_cas_strong_acq_rel(ref, &v, REF_LINKED | 1u))
    return KEEL_REJECT(KEEL_EINVAL, call, "node %p is already in a table", (void *)n);
  *old_tag = n->_tag;
  n->_tag = t->tag;
  /* A new entry counts as used (it was created to be used): ACCESSED from
   * the start, so the first lookups after an insert, which are most of
   * them in a table filled and then read, find the bit set and do not
   * write the node (a locked OR on every first touch cost 25-30% of a
   * lookup at 1M entries). The shrinker's pass clears it like any other. */
  keel_store_release(ref, REF_LINKED | REF_ACCESSED | 1u);
  return 0;
}

/* Undoes node_claim for a node that was never published: nobody else can
 * have seen it, and the caller may insert or free it again. */
static void node_unclaim(keel_table_node_t *n, uint16_t old_tag) {
  keel_store_relaxed(node_ref(n), 0);
  n->_tag = old_tag;
}

/* Counts a node that _keel_tidx_add published, and applies the limit. */
static void node_added(keel_table_t *t, keel_table_node_t *n) {
  table_shard_t *s = node_shard(t, n);
  keel_fetch_add_relaxed(&s->unburied, 1);
  if (shard_count_add(s, 1)) _keel_tidx_check(t);
  if (t->limited) {
    keel_fetch_add_relaxed(&t->charge, node_charge(t, n));
    _keel_table_enforce_limit(t);
  }
}

int keel_table_insert(keel_table_t *t, keel_table_node_t *n) {
  if (t == NULL || n == NULL)
    return KEEL_REJECT(KEEL_EINVAL, "keel_table_insert", "table %p, node %p", (void *)t, (void *)n);
  uint16_t old_tag;
  int rc = node_claim(t, n, &old_tag, "keel_table_insert");
  if (rc != 0) return rc;
  uint64_t hash = node_hash(t, n);
  _keel_rcu_read_lock();
  keel_table_node_t *got = _keel_tidx_add(t, n, hash);
  _keel_rcu_read_unlock();
  if (got != n) {
    node_unclaim(n, old_tag);
    return KEEL_EEXIST;
  }
  node_added(t, n);
  return 0;
}

/* e is still linked but DEAD from a zero count: an evictor or remove_key
 * marked it and has not yet deleted it from the index. Rather than wait for
 * that thread (which may be preempted), delete it here: whoever wins
 * _keel_tidx_del is the removal owner (table_internal.h). Won here, the
 * unlink is marked HELPED, and the marker reports the removal as its own
 * (remove_key's 0, the shrinker's count); lost, to the marker or a
 * keel_table_remove, there is nothing left to do. Inside a read-side
 * section. */
static void help_remove(keel_table_t *t, keel_table_node_t *e) {
  if (_keel_tidx_del(t, e, NULL, REF_HELPED) == 0) _keel_table_removed(t, e);
}

keel_table_node_t *keel_table_get_or_insert(keel_table_t *t, keel_table_node_t *n) {
  if (t == NULL || n == NULL) {
    _keel_reject("keel_table_get_or_insert", "table %p, node %p", (void *)t, (void *)n);
    goto inval;
  }
  uint16_t old_tag;
  if (node_claim(t, n, &old_tag, "keel_table_get_or_insert") != 0) goto inval;
  uint64_t hash = node_hash(t, n);
  _keel_rcu_read_lock();
  keel_table_node_t *e;
  /* Usually one pass. Another only when the entry found is dying, and the
   * next pass cannot find that one again: help_remove deleted it. */
  while ((e = _keel_tidx_add(t, n, hash)) != n) {
    if (ref_try(e, true)) {
      _keel_rcu_read_unlock();
      node_unclaim(n, old_tag);
      return e;
    }
    help_remove(t, e);
  }
  _keel_rcu_read_unlock();
  node_added(t, n);
  return n;
inval:
  errno = EINVAL;
  return NULL;
}

keel_table_node_t *keel_table_lookup(keel_table_t *t, const void *key, size_t len) {
  keel_table_node_t *n = find(t, key, len, "keel_table_lookup");
  if (keel_likely(n != NULL)) {
    /* Second chance for the shrinker; written once per LRU pass, so a hot
     * entry's line stays shared between reading cores. */
    if (!(keel_load_relaxed(node_ref(n)) & REF_ACCESSED))
      atomic_fetch_or_explicit(node_ref(n), REF_ACCESSED, memory_order_relaxed);
  }
  return n;
}

keel_table_node_t *keel_table_get(keel_table_t *t, const void *key, size_t len) {
  _keel_rcu_read_lock();
  keel_table_node_t *n = find(t, key, len, "keel_table_get");
  if (n != NULL && !ref_try(n, true)) {
    errno = ENOENT;
    n = NULL;
  }
  _keel_rcu_read_unlock();
  return n;
}

bool keel_table_ref(keel_table_node_t *n) {
  return ref_try(n, false);
}

/* --- put / remove ---------------------------------------------------------- */

static inline void put_read_lock(void) {
#if defined(_LGPL_SOURCE)
  if (keel_unlikely(!URCU_TLS(urcu_memb_reader).registered)) _keel_rcu_register_slow();
  urcu_memb_read_lock();
#else
  _keel_rcu_read_lock();
#endif
}

static inline void put_read_unlock(void) {
#if defined(_LGPL_SOURCE)
  urcu_memb_read_unlock();
#else
  _keel_rcu_read_unlock();
#endif
}

KEEL_NOINLINE static void put_misuse(keel_table_t *t, keel_table_node_t *n, uint32_t v) {
  if (n->_tag != t->tag)
    keel_die("keel_table_put", "entry %p belongs to another table (not %p)", (void *)n, (void *)t);
  keel_die("keel_table_put", "entry %p has no reference to put (state 0x%x)", (void *)n, v);
}

void keel_table_put(keel_table_t *t, keel_table_node_t *n) {
  keel_atomic(uint32_t) *ref = node_ref(n);
  if (keel_unlikely(n->_tag != t->tag)) put_misuse(t, n, keel_load_relaxed(ref));
  /* Release: the caller's use of the entry happens before its free. While
   * the count stays above zero our reference keeps the entry alive, so one
   * CAS that leaves it above zero needs nothing more. */
  uint32_t v = keel_load_relaxed(ref);
  if (keel_likely((v & REF_COUNT) > 1) && keel_cas_weak_acq_rel(ref, &v, v - 1)) return;
  /* Maybe the last reference. From the moment the count reads zero a
   * remover or the shrinker may mark the entry dead and bury it, and it is
   * freed a grace period later; the read-side section, entered before the
   * decrement, keeps it allocated until put_last has done with its LRU
   * links (without it, lru_add could touch a freed node). */
  put_read_lock();
  uint32_t old = keel_fetch_sub_acq_rel(ref, 1);
  if (keel_unlikely((old & REF_COUNT) == 0)) put_misuse(t, n, old);
  if ((old & REF_COUNT) == 1) _keel_table_put_last(t, n, old - 1);
  put_read_unlock();
}

int keel_table_remove(keel_table_t *t, keel_table_node_t *n) {
  if (t == NULL || n == NULL)
    return KEEL_REJECT(KEEL_EINVAL, "keel_table_remove", "table %p, node %p", (void *)t, (void *)n);
  uint32_t v = keel_load_acquire(node_ref(n));
  if (n->_tag != t->tag || !(v & REF_LINKED))
    return KEEL_REJECT(KEEL_EINVAL, "keel_table_remove", "node %p is not in table %p", (void *)n,
                       (void *)t);
  if (v & REF_DEAD) return KEEL_ENOENT;
  _keel_rcu_read_lock();
  int rc = _keel_tidx_del(t, n, NULL, 0);
  _keel_rcu_read_unlock();
  if (rc != 0) return KEEL_ENOENT; /* another remover or the shrinker won */
  _keel_table_removed(t, n);
  return 0;
}

int keel_table_remove_key(keel_table_t *t, const void *key, size_t len) {
  int rc = 0;
  _keel_rcu_read_lock();
  keel_table_node_t *n = find(t, key, len, "keel_table_remove_key");
  if (n == NULL) {
    rc = errno == EINVAL ? KEEL_EINVAL : KEEL_ENOENT;
    goto out;
  }
  /* DEAD first, from a count of zero, so that nobody takes a reference
   * between the check and the removal (the evictor's order). */
  keel_atomic(uint32_t) *ref = node_ref(n);
  uint32_t v = keel_load_relaxed(ref);
  do {
    if (v & REF_DEAD) {
      rc = KEEL_ENOENT;
      goto out;
    }
    if (v & REF_COUNT) {
      rc = KEEL_EBUSY;
      goto out;
    }
  } while (!keel_cas_weak_acq_rel(ref, &v, v | REF_DEAD));
  if (_keel_tidx_del(t, n, NULL, 0) == 0)
    _keel_table_removed(t, n);
  else if (!(keel_load_relaxed(ref) & REF_HELPED))
    rc = KEEL_ENOENT; /* a concurrent keel_table_remove owns it */
  /* else a get_or_insert unlinked it for us (help_remove) and did the rest */
out:
  _keel_rcu_read_unlock();
  return rc;
}

/* --- walking and counting ---------------------------------------------------- */

int keel_table_for_each(keel_table_t *t, int (*fn)(keel_table_node_t *node, void *arg), void *arg) {
  _keel_rcu_read_lock();
  int rc = _keel_tidx_walk(t, fn, arg);
  _keel_rcu_read_unlock();
  return rc;
}

size_t keel_table_count(const keel_table_t *t) {
  long c = sum_shards(t, false);
  return c > 0 ? (size_t)c : 0;
}

void keel_table_stats(const keel_table_t *t, keel_table_stats_t *st) {
  memset(st, 0, sizeof *st);
  st->entries = keel_table_count(t);
  long pending = sum_shards(t, true) - (long)st->entries;
  st->removed_referenced = pending > 0 ? (size_t)pending : 0;
  for (int i = 0; i < TABLE_SHARDS; i++)
    st->lru_entries += keel_load_relaxed(&t->shards[i].lru_len);
  st->evicted = keel_load_relaxed(&t->evicted);
  st->charged_bytes = t->cfg.max_bytes ? keel_load_relaxed(&t->charge) : 0;
  st->buckets = _keel_tidx_buckets(t);
  st->resizes = keel_load_relaxed(&t->ix.resizes);
  st->resizing = keel_load_relaxed(&t->ix.resizing) != 0;
}
