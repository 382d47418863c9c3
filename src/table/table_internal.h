/* keel table internals: the table struct, the entry state word, the hashes.
 *
 * An entry's life, as the bits of its state word (node->_ref) record it:
 *
 *   init --insert--> LINKED|1 --put--> LINKED|0 (+ON_LRU) --get--> LINKED|1 ...
 *                      |                    |
 *                   remove            shrink / limit / remove_key
 *                      v                    v
 *                 LINKED|DEAD|n  --last put-->  LINKED|DEAD|0 & !ON_LRU: buried
 *
 * Invariants (each bit is changed only as stated):
 *  - COUNT is the number of references callers hold. It goes up only by a
 *    CAS that sees !(DEAD && COUNT == 0), so a dying entry is never revived.
 *  - LINKED is set by the insert that wins the CAS from an unlinked word and
 *    is never cleared: a node is inserted at most once in its life.
 *  - DEAD means "no longer findable, or about to be": set once, by the thread
 *    that removes the entry from the index (after its _keel_tidx_del) or by
 *    the evictor (a CAS from COUNT == 0, before its _keel_tidx_del). Exactly
 *    one thread's _keel_tidx_del succeeds for an entry; it is the "removal
 *    owner" and takes the entry off its LRU.
 *  - HELPED is set, under the bucket lock, by a get_or_insert whose
 *    _keel_tidx_del unlinked an entry that a zero-count marker (remove_key,
 *    the evictor) made DEAD. The marker's own _keel_tidx_del then fails, and
 *    the bit tells it the removal was done on its behalf and is its to
 *    report (not a concurrent keel_table_remove's).
 *  - ON_LRU mirrors membership of the shard's LRU list and changes only under
 *    that shard's lock; it is set only by a CAS that sees !DEAD.
 *  - ACCESSED is set by lookups (second chance) and cleared by the shrinker;
 *    it never changes whether an entry is alive.
 *  - The entry is buried (handed to the deferred free) by the one atomic
 *    operation whose result is DEAD && COUNT == 0 && !ON_LRU: that state is
 *    final (nothing can raise COUNT or set ON_LRU on a DEAD entry), so
 *    exactly one thread observes the transition into it.
 *
 * Deferred free: in a table with a free_fn, buried entries go on a
 * per-shard Treiber stack (the "grave", linked through _lru[0], free once an
 * entry is off the LRU); without one, burial only counts them out. Its
 * low bit says that a batch is in flight through call_rcu: the thread that
 * pushes onto a grave without that bit sets it and launches the batch; the
 * callback frees its batch after the grace period, takes the next one or
 * clears the bit with one CAS, its last access to the table. One rcu_head
 * per shard instead of one per entry saves 16 bytes per entry and lets the
 * callback find the table (for free_fn) without a pointer in every node.
 * Per shard, not per table: with one grave every removal on 16 cores
 * CASed the same cache line (remove cost 3.5x raw rculfhash's there).
 */
#ifndef KEEL_TABLE_INTERNAL_H
#define KEEL_TABLE_INTERNAL_H

#include <keel/table.h>

#include <pthread.h>
#include <string.h>

#include <urcu/list.h>
#include <urcu/urcu-memb.h>

#include "base/atomic.h"
#include "base/common.h"
#include "index.h"

/* State word bits. */
#define REF_COUNT    0x00ffffffu /* references held by callers (16M: overflow aborts) */
#define REF_LINKED   (1u << 24)  /* inserted (never cleared) */
#define REF_DEAD     (1u << 25)  /* removed from the index, or being evicted */
#define REF_ON_LRU   (1u << 26)  /* on its shard's LRU list (shard lock) */
#define REF_ACCESSED (1u << 27)  /* inserted or looked up since the shrinker last passed */
#define REF_BURIED   (1u << 28)  /* handed to the deferred free (checked in debug) */
#define REF_HELPED   (1u << 29)  /* unlinked by get_or_insert for its DEAD marker */

/* LRU shards: put-to-zero, eviction, counting and the deferred free are
 * spread over this many shards, chosen by the node's address; the shrinker
 * visits them in turn. 32 keeps 64 threads on a handful of cores from
 * queueing on one lock. 256 measured faster writers on the 16-core device
 * machine (insert 12.6M vs 8.9M/s at 16 threads) but was not kept: a small
 * max_entries or max_unused made every insert walk and lock many empty
 * shards (30 locks per insert+put at max_entries=100, against 2), the
 * index's shrink check (every 128th count change of a shard) stopped
 * firing below 256 x 128 entries, and each load check sums every shard. */
#define TABLE_SHARDS 32

typedef struct table_shard {
  pthread_mutex_t lock;         /* guards lru, lru_len and every ON_LRU bit of its nodes */
  struct cds_list_head lru;     /* cold at the head, recently released at the tail */
  keel_atomic(size_t) lru_len;  /* nodes on lru (written under lock, read by stats) */
  keel_atomic(long) in_table;   /* inserted - removed, for the nodes of this shard */
  keel_atomic(long) unburied;   /* inserted - buried: in_table + removed but referenced */
  keel_atomic(uintptr_t) grave; /* buried nodes of this shard | GRAVE_INFLIGHT */
  keel_table_node_t *gc_batch;  /* the batch waiting for its grace period */
  struct rcu_head gc_head;
  struct keel_table *table; /* for the callback */
} KEEL_CACHE_ALIGNED table_shard_t;

struct keel_table {
  tidx_t ix; /* the index (index.h) */
  keel_table_config_t cfg;
  uint64_t seed;                 /* per-table hash seed */
  uint16_t tag;                  /* stamped into every node this table inserts */
  bool limited;                  /* max_entries or max_bytes set */
  keel_atomic(size_t) charge;    /* limited tables: entries, or bytes with max_bytes */
  keel_atomic(size_t) lru_total; /* with max_unused: the sum of the shards' lru_len */
  keel_atomic(size_t) evicted;   /* removed by shrink and the limit */
  keel_atomic(unsigned) cursor;  /* next shard the shrinker starts from */
  table_shard_t shards[TABLE_SHARDS];
};

#define GRAVE_INFLIGHT ((uintptr_t)1)

KEEL_INLINE keel_atomic(uint32_t) * node_ref(keel_table_node_t *n) {
  return (keel_atomic(uint32_t) *)&n->_ref;
}

KEEL_INLINE keel_atomic(keel_table_node_t *) * node_next(keel_table_node_t *n) {
  return (keel_atomic(keel_table_node_t *) *)&n->_next;
}

KEEL_INLINE struct cds_list_head *node_lru(keel_table_node_t *n) {
  return (struct cds_list_head *)(void *)n->_lru;
}

KEEL_INLINE keel_table_node_t *lru_node(struct cds_list_head *l) {
  return (keel_table_node_t *)(void *)((char *)l - offsetof(keel_table_node_t, _lru));
}

KEEL_INLINE table_shard_t *node_shard(keel_table_t *t, const keel_table_node_t *n) {
  /* Nodes are at least 8-aligned and usually sit in 64-byte-or-larger
   * structs: fold the address so neighbours land in different shards. */
  uintptr_t a = (uintptr_t)n;
  return &t->shards[((a >> 4) ^ (a >> 11)) % TABLE_SHARDS];
}

/* Bytes charged against max_bytes for one entry. */
KEEL_INLINE size_t node_charge(const keel_table_t *t, const keel_table_node_t *n) {
  if (t->cfg.max_bytes == 0) return 1;
  return t->cfg.entry_size + (t->cfg.key_type == KEEL_TABLE_KEY_BYTES ? n->_key_len : 0);
}

/* --- hashing (hash.c) ------------------------------------------------------ */

/* 64-bit finaliser of a u64 key under a seed: every input bit reaches the
 * low bits that pick the bucket, so sequential keys spread evenly. */
KEEL_INLINE uint64_t _keel_hash_u64(uint64_t k, uint64_t seed) {
  k ^= seed;
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull; /* MurmurHash3's fmix64 constants */
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

/* Hash of a byte string under a seed (multiply-fold, 16 bytes a step). */
uint64_t _keel_hash_bytes(const void *p, size_t len, uint64_t seed) KEEL_HIDDEN;

/* The hash of an entry's key. */
KEEL_INLINE uint64_t node_hash(const keel_table_t *t, const keel_table_node_t *n) {
  if (t->cfg.key_type == KEEL_TABLE_KEY_U64) return _keel_hash_u64(n->key.u64, t->seed);
  return _keel_hash_bytes(n->key.bytes, n->_key_len, t->seed);
}

/* A lookup key: a u64, or bytes. */
typedef struct table_key {
  uint64_t u64;
  const void *p;
  size_t len;
} table_key_t;

/* Whether a reader's node has key k (a BYTES table's; U64 tables compare
 * inline in tidx_find). */
KEEL_INLINE bool match_bytes(const keel_table_node_t *n, const table_key_t *k) {
  return n->_key_len == k->len && (k->len == 0 || memcmp(n->key.bytes, k->p, k->len) == 0);
}

/* Whether two entries of t have the same key (the index's duplicate check). */
KEEL_INLINE bool node_same_key(const keel_table_t *t, const keel_table_node_t *a,
                               const keel_table_node_t *b) {
  if (t->cfg.key_type == KEEL_TABLE_KEY_U64) return a->key.u64 == b->key.u64;
  return match_bytes(a, &(table_key_t){.p = b->key.bytes, .len = b->_key_len});
}

/* --- the index (index.h, index.c) ---------------------------------------- */

/* Finds the entry with key k (hash h) inside a read-side section: the
 * current array's bucket, then, only while a resize is in flight and the key
 * was not there, the next array's (index.h says why that is complete).
 * The key type is tested once, outside the walk. The acquire load of the
 * found node's state word pairs with the release that inserted it
 * (node_claim): what the caller wrote into its entry before the insert is
 * visible to whoever finds it (the bucket's release store publishes the
 * node as well; this one states it for the fields, and TSan sees it). */
KEEL_INLINE keel_table_node_t *tidx_find(keel_table_t *t, uint64_t h, const table_key_t *k) {
  const bool u64 = t->cfg.key_type == KEEL_TABLE_KEY_U64;
  tidx_array_t *a = keel_load_acquire(&t->ix.arr);
  do {
    uintptr_t head = keel_load_acquire(&a->b[h & a->mask]);
    if (head != TIDX_MOVED) {
      keel_table_node_t *n = tidx_first(head);
      if (keel_likely(u64)) {
        for (; n != NULL; n = keel_load_acquire(node_next(n)))
          if (n->key.u64 == k->u64) goto found;
      } else {
        for (; n != NULL; n = keel_load_acquire(node_next(n)))
          if (match_bytes(n, k)) goto found;
      }
      continue; /* to the next array, if any */
    found:
      (void)keel_load_acquire(node_ref(n));
      return n;
    }
  } while (keel_unlikely((a = keel_load_acquire(&a->next)) != NULL));
  return NULL;
}

/* An array for about `hint` entries (at least TIDX_MIN_BUCKETS); -1 if no
 * memory. */
int _keel_tidx_init(keel_table_t *t, size_t hint) KEEL_HIDDEN;
/* Frees the arrays (destroy: no other thread uses the table). */
void _keel_tidx_fini(keel_table_t *t) KEEL_HIDDEN;
/* Links n unless an entry with its key is there; returns n, or that entry.
 * Inside a read-side section. */
keel_table_node_t *_keel_tidx_add(keel_table_t *t, keel_table_node_t *n, uint64_t hash) KEEL_HIDDEN;
/* Unlinks n: 0, or -1 if it is not in the table (removed by another thread).
 * Inside a read-side section. With `check` NULL it may check the load and
 * allocate a bucket array; a caller under a lock passes a flag instead,
 * set when it must call _keel_tidx_check after its unlock. `mark` is ORed
 * into n's state word under the bucket lock if this call unlinks n, so a
 * thread whose own call then fails sees it (REF_HELPED). */
int _keel_tidx_del(keel_table_t *t, keel_table_node_t *n, bool *check, uint32_t mark) KEEL_HIDDEN;
/* Calls fn on every entry once, in bucket order, inside a read-side
 * section, while other threads read and write; stops at fn's first non-zero
 * return and returns it (KEEL_ENOMEM if a long chain could not be copied). */
int _keel_tidx_walk(keel_table_t *t, int (*fn)(keel_table_node_t *, void *), void *arg) KEEL_HIDDEN;
/* The same for a table no other thread uses (destroy): no locks, no copies. */
int _keel_tidx_walk_alone(keel_table_t *t, int (*fn)(keel_table_node_t *, void *),
                          void *arg) KEEL_HIDDEN;
/* Starts a resize if the count asks for one. */
void _keel_tidx_check(keel_table_t *t) KEEL_HIDDEN;
/* Buckets of the current array. */
size_t _keel_tidx_buckets(const keel_table_t *t) KEEL_HIDDEN;

/* Changes a shard's count of entries in the table. True every 128th value:
 * the caller then checks the load with _keel_tidx_check, after releasing any
 * lock it holds (a check may allocate a bucket array). */
KEEL_INLINE bool shard_count_add(table_shard_t *s, long d) {
  long v = keel_fetch_add_relaxed(&s->in_table, d) + d;
  return keel_unlikely((v & 127) == 0);
}

/* --- RCU (rcu.c) ----------------------------------------------------------- */

/* Registers the calling thread with urcu-memb if it is not (see table.h). */
void _keel_rcu_register_slow(void) KEEL_HIDDEN;
bool _keel_rcu_registered(void) KEEL_HIDDEN;

KEEL_INLINE void rcu_ensure_registered(void) {
  if (keel_unlikely(!_keel_rcu_registered())) _keel_rcu_register_slow();
}

/* keel_table_read_lock/unlock without the exported symbol's PLT hop. */
void _keel_rcu_read_lock(void) KEEL_HIDDEN;
void _keel_rcu_read_unlock(void) KEEL_HIDDEN;

/* Tells TSan that a grace period orders every earlier read-side section
 * before what follows it (liburcu's own ordering is invisible to TSan). */
void _keel_rcu_tsan_gp_acquire(void) KEEL_HIDDEN;

/* The same for call_rcu's queue: what the caller did before call_rcu(head)
 * happens before the callback (TSan checks an atomic access before the
 * acquire it performs, so a callback's first access to memory allocated
 * since its thread last synchronised would otherwise be reported). */
void _keel_rcu_tsan_handoff_release(void *head) KEEL_HIDDEN;
void _keel_rcu_tsan_handoff_acquire(void *head) KEEL_HIDDEN;

/* --- LRU, eviction and deferred free (lru.c) ------------------------------- */

/* The put that dropped the last reference; v is the state it left. */
void _keel_table_put_last(keel_table_t *t, keel_table_node_t *n, uint32_t v) KEEL_HIDDEN;

/* The removal owner's bookkeeping after its cds_lfht_del succeeded: counts,
 * DEAD, off the LRU, and burial if nothing references the entry. */
void _keel_table_removed(keel_table_t *t, keel_table_node_t *n) KEEL_HIDDEN;

/* Hands a final entry to the deferred free. */
void _keel_table_bury(keel_table_t *t, keel_table_node_t *n) KEEL_HIDDEN;

/* Applies the soft limit if the table is over it. */
void _keel_table_enforce_limit(keel_table_t *t) KEEL_HIDDEN;

/* Shrinks the LRU back to max_unused entries if it is longer (max_unused
 * set), sparing n, the entry whose release made it longer, if it can. */
void _keel_table_trim(keel_table_t *t, keel_table_node_t *n) KEEL_HIDDEN;

/* Waits until no deferred-free batch of t is pending (destroy). */
void _keel_table_gc_drain(keel_table_t *t) KEEL_HIDDEN;

#endif /* KEEL_TABLE_INTERNAL_H */
