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
 *    that removes the entry from rculfhash (after its cds_lfht_del) or by the
 *    evictor (a CAS from COUNT == 0, before its cds_lfht_del). Exactly one
 *    thread wins cds_lfht_del for an entry; it is the "removal owner" and
 *    takes the entry off its LRU.
 *  - ON_LRU mirrors membership of the shard's LRU list and changes only under
 *    that shard's lock; it is set only by a CAS that sees !DEAD.
 *  - ACCESSED is set by lookups (second chance) and cleared by the shrinker;
 *    it never changes whether an entry is alive.
 *  - The entry is buried (handed to the deferred free) by the one atomic
 *    operation whose result is DEAD && COUNT == 0 && !ON_LRU: that state is
 *    final (nothing can raise COUNT or set ON_LRU on a DEAD entry), so
 *    exactly one thread observes the transition into it.
 *
 * Deferred free: buried entries go on a per-table Treiber stack (the "grave",
 * linked through _lru[0], free once an entry is off the LRU). Its low bit
 * says that a batch is in flight through call_rcu: the thread that pushes
 * onto a grave without that bit sets it and launches the batch; the callback
 * frees its batch after the grace period, takes the next one or clears the
 * bit with one CAS, its last access to the table. One rcu_head per table
 * instead of one per entry saves 16 bytes per entry and lets the callback
 * find the table (for free_fn) without a pointer in every node.
 */
#ifndef KEEL_TABLE_INTERNAL_H
#define KEEL_TABLE_INTERNAL_H

#include <keel/table.h>

#include <pthread.h>
#include <string.h>

#include <urcu/list.h>
#include <urcu/urcu-memb.h>

#include <urcu/rculfhash.h>

#include "base/atomic.h"
#include "base/common.h"

/* State word bits. */
#define REF_COUNT    0x00ffffffu /* references held by callers (16M: overflow aborts) */
#define REF_LINKED   (1u << 24)  /* inserted (never cleared) */
#define REF_DEAD     (1u << 25)  /* removed from rculfhash, or being evicted */
#define REF_ON_LRU   (1u << 26)  /* on its shard's LRU list (shard lock) */
#define REF_ACCESSED (1u << 27)  /* inserted or looked up since the shrinker last passed */
#define REF_BURIED   (1u << 28)  /* handed to the deferred free (checked in debug) */

/* LRU shards: put-to-zero, eviction and counting are spread over this many
 * cache lines, chosen by the node's address. 32 keeps 64 threads on a
 * handful of cores from queueing on one lock; the shrinker visits them in
 * turn. */
#define TABLE_SHARDS 32

/* Bucket counts handed to rculfhash. liburcu 0.13.2 started from 1 bucket
 * with auto-resize livelocked inside cds_lfht_add in about half of 2M-key
 * runs (measured for issue 7); from 4096 it never did, so no table starts
 * smaller. Its own policy never shrinks below 1024 per CPU. The largest size
 * bounds the virtual reservation of the mmap bucket allocator: 2^27 buckets
 * are 2 GiB of address space, committed only as the table grows, and serve
 * a billion entries at rculfhash's load factor of up to 8. */
#define TABLE_MIN_BUCKETS (1ul << 12)
#define TABLE_MAX_BUCKETS (1ul << 27)

typedef struct table_shard {
  pthread_mutex_t lock;        /* guards lru, lru_len and every ON_LRU bit of its nodes */
  struct cds_list_head lru;    /* cold at the head, recently released at the tail */
  keel_atomic(size_t) lru_len; /* nodes on lru (written under lock, read by stats) */
  keel_atomic(long) in_table;  /* inserted - removed, for the nodes of this shard */
  keel_atomic(long) unburied;  /* inserted - buried: in_table + removed but referenced */
} KEEL_CACHE_ALIGNED table_shard_t;

struct keel_table {
  struct cds_lfht *ht;
  keel_table_config_t cfg;
  uint64_t seed;                /* per-table hash seed */
  uint16_t tag;                 /* stamped into every node this table inserts */
  bool limited;                 /* max_entries or max_bytes set */
  keel_atomic(size_t) charge;   /* limited tables: entries, or bytes with max_bytes */
  keel_atomic(size_t) evicted;  /* removed by shrink and the limit */
  keel_atomic(unsigned) cursor; /* next shard the shrinker starts from */
  keel_atomic(uintptr_t) grave; /* buried nodes | GRAVE_INFLIGHT */
  keel_table_node_t *gc_batch;  /* the batch waiting for its grace period */
  struct rcu_head gc_head;
  table_shard_t shards[TABLE_SHARDS];
};

#define GRAVE_INFLIGHT ((uintptr_t)1)

KEEL_INLINE keel_atomic(uint32_t) * node_ref(keel_table_node_t *n) {
  return (keel_atomic(uint32_t) *)&n->_ref;
}

KEEL_INLINE struct cds_lfht_node *node_lfht(keel_table_node_t *n) {
  return (struct cds_lfht_node *)(void *)n->_lfht;
}

KEEL_INLINE keel_table_node_t *lfht_node(struct cds_lfht_node *l) {
  return (keel_table_node_t *)(void *)((char *)l - offsetof(keel_table_node_t, _lfht));
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

/* 64-bit finaliser of a u64 key under a seed: a bijection (so distinct keys
 * never share a reverse hash, and rculfhash's full-hash compare settles
 * almost every mismatch before the key is read). */
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

/* Waits until no deferred-free batch of t is pending (destroy). */
void _keel_table_gc_drain(keel_table_t *t) KEEL_HIDDEN;

#endif /* KEEL_TABLE_INTERNAL_H */
