/* keel table: the index, a chained hash table of one-pointer buckets with
 * RCU readers and incremental resizing.
 *
 * Why not rculfhash. keel 0.1 wrapped liburcu's rculfhash. At 16M entries
 * its lookups cost 3 to 4 cache misses: its bucket array of 16-byte dummy
 * nodes, then a walk of a split-ordered chain at 1 to 8 entries per bucket,
 * every node a miss. Raw rculfhash with a 24-byte node ran lookups 1.5x
 * faster than keel's 48-byte wrapper (the misses were the same; the larger
 * node doubled the TLB reach), and a chained table of 8-byte buckets at a
 * load factor of at most 1 ran them 2.4x faster than raw rculfhash (measured
 * for issue 7, 2 threads, 16M entries). This is that table, as GFS2 and
 * Linux's rhashtable build it: one pointer per bucket, a lookup is one
 * bucket load and a walk of 1.5 nodes on average.
 *
 * Layout. An array is a power of two of buckets; a bucket word holds the
 * first node of its chain (NULL-terminated through node->_next), with bit 0
 * as the bucket's lock, or the value MOVED once its chain was migrated into
 * the next array. Writers (insert, remove, migration) take the bucket lock
 * (a bit spinlock: critical sections are a few loads and stores), readers
 * never do: they load the bucket and follow _next with acquire loads.
 * Nodes are linked in at the head with one release store that publishes them;
 * an unlink changes its predecessor only, so a reader standing on a removed
 * node still reaches the rest of the chain. A node is inserted at most once
 * in its life and freed a grace period after its removal (table.c), so no
 * reader ever sees it reused.
 *
 * Resizing. The table grows to keep at most one entry per bucket (its count
 * is checked when an insert walks a chain of 5 or more, whenever a shard's
 * count crosses a multiple of 128, and when a resize ends) and halves when
 * under a quarter, down to the size its hint asked for (at least
 * TIDX_MIN_BUCKETS). A resize allocates the next array (the one allocation
 * a write may make; if it fails the table just stays as it is) and
 * publishes it in array->next; from then on every insert and removal
 * migrates a few buckets of the old array (claimed with one fetch-and-add):
 * 1 per write while growing, so a grow that starts at one entry per bucket
 * has ended by the time the count has doubled (the old array's unmoved
 * buckets hold about two entries each by then, on average); 16 while
 * shrinking (buckets a quarter full are cheap to move), so a shrink that
 * starts at a quarter ends after a sixteenth, well before the removals that
 * follow can empty the table. An array of TIDX_BATCH_MIN buckets or more
 * grows at the same rate in whole cache lines: a thread's first write
 * during the grow and every TIDX_BATCH-th after it (a thread-local count)
 * claims TIDX_BATCH buckets, one line of the cache-aligned array, and
 * prefetches their first nodes before moving any. One-bucket claims put
 * two threads' migrations into the same lines of both arrays: with them,
 * 4M inserts from 64 buckets on 2 threads took 1.6x the CPU (median of 6
 * interleaved runs on the 2-core host; no change at 1 thread), and the
 * claim counter was written 8 times as often. A thread
 * pays ahead (at most TIDX_BATCH - 1 buckets), never behind, so a grow ends
 * no later than with one-bucket claims. Growing moves about one node per
 * insert over a table's life (each doubling moves every entry once), the
 * cost rculfhash pays in its resize thread. No thread of its own: the writer
 * that migrates the last bucket makes the new array current and frees the
 * old one after a grace period.
 *
 * Migrating a bucket holds its lock throughout and moves its chain's tail
 * first: the tail is linked at the head of its new bucket (its _next now
 * leads into the new chain), then cut from the old chain. A reader standing
 * on a moved tail walks on into the new chain, having seen the whole old
 * chain, and reaches NULL; no reader ever loses the rest of an old chain.
 * Then the old bucket becomes MOVED. The invariants:
 *  - a key's node is in the old array while its old bucket is not MOVED,
 *    in the new array after; inserts go to the old bucket unless it is
 *    MOVED, so a duplicate check under one bucket lock is complete;
 *  - a node is linked into the new array before it is cut from the old, so
 *    a reader that misses it in the old chain (the cut is visible to it)
 *    finds array->next set and the node there.
 * Lookups therefore walk the current array's bucket and, if the key was not
 * there, the next array's (only while a resize is in flight).
 *
 * Walks (keel_table_for_each) need every entry exactly once while entries
 * migrate under them: they visit the walk's first array index by index, and
 * follow a MOVED bucket into the buckets of later arrays that took its
 * chain, keeping the nodes whose hash belongs to that index (index.c).
 * Walks and migration never wait for each other.
 */
#ifndef KEEL_TABLE_INDEX_H
#define KEEL_TABLE_INDEX_H

#include <stdint.h>

#include <urcu/urcu-memb.h>

#include "base/atomic.h"
#include "base/common.h"

#define TIDX_LOCK  ((uintptr_t)1) /* bucket word: locked by a writer */
#define TIDX_MOVED ((uintptr_t)2) /* bucket word: chain migrated to array->next (final) */

#define TIDX_MIN_BUCKETS      64u               /* the smallest array (512 bytes) */
#define TIDX_MAX_INIT_BUCKETS ((size_t)1 << 27) /* the largest a hint asks for (1 GiB) */
#define TIDX_HELP_GROW        1u  /* buckets each write migrates while the table grows */
#define TIDX_HELP_SHRINK      16u /* ... while it shrinks */
#define TIDX_CHAIN_CHECK      5u  /* an insert that walks this many nodes checks the load */
#define TIDX_BATCH            8u  /* buckets in a cache line: a growing large array's claim */
#define TIDX_BATCH_MIN        ((size_t)1 << 14) /* arrays from this size claim in lines */

typedef struct tidx_array {
  size_t mask;                                  /* buckets - 1 */
  void *raw;                                    /* what calloc returned, or NULL */
  size_t map_len;                               /* bytes mapped, if not from calloc */
  keel_atomic(struct tidx_array *) next;        /* the array being migrated into */
  struct rcu_head rcu;                          /* frees the array once replaced */
  size_t help;                                  /* buckets per write while migrating out */
  keel_atomic(size_t) claim KEEL_CACHE_ALIGNED; /* next bucket to migrate */
  keel_atomic(size_t) moved;                    /* buckets migrated */
  keel_atomic(uintptr_t) b[] KEEL_CACHE_ALIGNED;
} tidx_array_t;

/* What a keel_table holds of the index. */
typedef struct tidx {
  keel_atomic(tidx_array_t *) arr; /* the current array */
  keel_atomic(int) resizing;       /* a next array is being made or migrated into */
  keel_atomic(size_t) resizes;     /* resizes finished */
  size_t min_buckets;              /* the size the hint asked for: never shrinks below */
} tidx_t;

KEEL_INLINE struct keel_table_node *tidx_first(uintptr_t head) {
  return (struct keel_table_node *)(head & ~TIDX_LOCK);
}

#endif /* KEEL_TABLE_INDEX_H */
