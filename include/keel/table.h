/* keel table: an RCU resource table for tens of millions of entries.
 *
 * A hash table of caller-owned, reference-counted entries: one-pointer
 * buckets kept at most one entry each, RCU (liburcu's memb flavour) for
 * readers. Lookups take no lock and never wait for writers or for a resize;
 * inserts and removals lock one bucket for a few stores (a bit lock in the
 * bucket word); the bucket array grows and shrinks with the contents,
 * migrated a few buckets at a time by the writes that follow. Entries
 * are intrusive: the caller embeds a keel_table_node_t in its own struct and
 * gets back to it with keel_table_entry(). Removed entries are handed to the
 * config's free callback after an RCU grace period, so a reader that found
 * an entry may keep reading it until its read-side section ends.
 *
 * References. An entry holds a count of references. keel_table_insert()
 * and keel_table_get() return with one reference held for the caller;
 * keel_table_lookup() takes none: its result is valid only until the
 * enclosing keel_table_read_unlock(). keel_table_put() drops a reference. An
 * entry whose count falls to zero stays in the table, cached, on the table's
 * LRU list; keel_table_shrink() (or the optional limit in the config) removes
 * such entries, least recently used first. An entry removed while referenced
 * leaves the table at once (no new lookup finds it) and is freed after its
 * last keel_table_put() and a grace period.
 *
 *   state                   lookup finds it   get succeeds   on the LRU
 *   in table, count > 0     yes               yes            maybe (lazily)
 *   in table, count = 0     yes               yes            yes
 *   removed, count > 0      no                no (*)         no
 *   removed, count = 0      no                no             no: freed after a grace period
 *   (*) keel_table_ref() on a pointer the caller already holds a reference to always succeeds.
 *
 * Concurrency: every function below may run concurrently with every other on
 * the same table, except keel_table_destroy(), which must be the last call
 * on its table. Readers never block. Writers, keel_table_for_each() and
 * shrinking block one another only on short locks: a bucket's (held for a
 * chain walk and a few stores) and the LRU shards' (held for a list splice),
 * never across a grace period.
 *
 * RCU threads. liburcu's memb flavour requires every thread that enters a
 * read-side section to be registered. keel does this for its callers: the
 * first keel_table_* call from a thread that liburcu does not yet know
 * registers it (urcu_memb_register_thread, one mutex acquisition), and keel
 * unregisters it when the thread exits (a keel thread-exit hook), but only
 * if keel was the one that registered it. A thread that registered itself
 * with urcu_memb_register_thread() is used as is and must stay registered
 * while it uses keel tables. Read-side sections are liburcu's: they nest, and
 * keel_table_read_lock() is interchangeable with urcu_memb_read_lock() on a
 * registered thread.
 *
 * Misuse: inserting a node that is already in a table -> KEEL_EINVAL;
 * removing an entry twice -> KEEL_ENOENT; removing an entry of another
 * table -> KEEL_EINVAL (both leave every table unchanged); keel_table_put()
 * on an entry with no reference, or with the wrong table, would corrupt the
 * LRU and aborts ("keel: keel_table_put: ... at 0x..."). Tables are told
 * apart by a 16-bit tag; two live tables share a tag only after 65,535
 * tables have been created, and only then could a wrong-table call slip by.
 */
#ifndef KEEL_TABLE_H
#define KEEL_TABLE_H

#include <keel/keel.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct keel_table keel_table_t;

/* The node the caller embeds in its entry (40 bytes, 8-aligned). Its fields
 * are keel's except `key`, which the caller sets with keel_table_node_init_*
 * before insertion and must not change while the entry is in the table (or
 * until the free callback runs). For byte-string keys the node points at the
 * caller's key bytes, which must stay valid and unchanged as long. */
typedef struct keel_table_node {
  /* What a lookup touches comes first and fits in 24 bytes. */
  struct keel_table_node *_next; /* the bucket's chain */
  uint32_t _ref;                 /* reference count and state bits */
  uint16_t _tag;                 /* tag of the table the entry was inserted into */
  uint16_t _key_len;             /* byte-string keys: length in bytes */
  union {
    uint64_t u64;      /* KEEL_TABLE_KEY_U64 */
    const void *bytes; /* KEEL_TABLE_KEY_BYTES: the caller's key bytes */
  } key;
  void *_lru[2]; /* LRU links while cached; free-list link once removed */
} keel_table_node_t;

/* The caller's struct from a pointer to its embedded node. */
#define keel_table_entry(node, type, member)                                                       \
  ((type *)(void *)((char *)(node)-offsetof(type, member)))

typedef enum keel_table_key_type {
  KEEL_TABLE_KEY_U64 = 0,   /* 64-bit integer keys */
  KEEL_TABLE_KEY_BYTES = 1, /* byte strings of 0..key_max bytes, compared with memcmp */
} keel_table_key_type_t;

/* Longest byte-string key any table accepts. */
#define KEEL_TABLE_KEY_MAX 65535u

typedef struct keel_table_config {
  keel_table_key_type_t key_type;
  uint32_t key_max;   /* BYTES: longest key accepted, 1..KEEL_TABLE_KEY_MAX (0: 255) */
  size_t size_hint;   /* expected entries: presizes the bucket array (0: small, grows) */
  size_t max_entries; /* soft limit on entries (0: none); see below */
  size_t max_bytes;   /* soft limit on bytes (0: none), each entry charged
                         entry_size + its key length */
  size_t max_unused;  /* soft limit on the LRU, i.e. on unreferenced entries
                         (0: none); see below */
  size_t entry_size;  /* bytes charged per entry for max_bytes (the caller's struct) */
  /* Called once per removed entry, after a grace period and after its last
   * reference was put, on liburcu's call_rcu thread (for entries still in
   * the table at destroy: in the destroying thread, once the others have
   * run); it usually frees the caller's struct. One table's calls do not
   * overlap unless the program gave liburcu per-CPU call_rcu threads. It
   * must not call keel_table_destroy() nor wait for a grace period. NULL:
   * keel forgets the entry once it is unlinked; a reader may still see it
   * until a grace period has passed (urcu_memb_synchronize_rcu), so the
   * caller reuses its memory only after one. */
  void (*free_fn)(keel_table_node_t *node, void *arg);
  void *free_arg;
  const char *name; /* shown in diagnostics; may be NULL */
} keel_table_config_t;

/* Soft limits: when an insert or a put leaves the table above max_entries or
 * max_bytes, that call removes unreferenced entries, least recently used
 * first, until it is back under the limit or none is left. Referenced
 * entries are never removed by the limit, so the table can stay above it
 * while they are held; no insert fails because of the limit.
 *
 * max_unused bounds the cache of unreferenced entries alone, however many are
 * referenced (a lock manager's "keep at most N unused resources"): when a put
 * that drops an entry's last reference puts it on the LRU and the LRU then
 * holds more than max_unused entries, that put trims it back to max_unused,
 * as keel_table_shrink would (least recently used first, second chance). The
 * LRU is lazy (see keel_table_shrink): an entry referenced again stays on it,
 * and counts, until a shrink or a trim passes it and takes it off, which
 * counts towards the trim. So after a trim at most max_unused entries are
 * unreferenced (plus those released meanwhile by puts that have not trimmed
 * yet, one per concurrent put), and a trim may drop an unreferenced entry
 * while referenced ones still count. Costs one shared counter update per
 * entry that joins or leaves the LRU (not per put: a cached entry looked up
 * and released again stays on it) and nothing on lookups. */

/* Prepares a node for a KEEL_TABLE_KEY_U64 table. Does not allocate. */
static inline void keel_table_node_init_u64(keel_table_node_t *node, uint64_t key) {
  *node = (keel_table_node_t){.key.u64 = key};
}

/* Prepares a node for a KEEL_TABLE_KEY_BYTES table; `key` (len bytes) must
 * outlive the entry. A len above KEEL_TABLE_KEY_MAX is remembered (tag
 * 0xffff, which no table uses) so that insert rejects it with KEEL_EINVAL. */
static inline void keel_table_node_init_bytes(keel_table_node_t *node, const void *key,
                                              size_t len) {
  *node = (keel_table_node_t){.key.bytes = key, ._key_len = (uint16_t)len};
  if (len > KEEL_TABLE_KEY_MAX) node->_tag = 0xffff;
}

/* Creates a table. Allocates about 4 KiB (32 LRU shards) plus 8 bytes per
 * bucket: the size hint rounded up to a power of two, at least 64 buckets
 * (the table never shrinks below that). Starts no thread. NULL with errno
 * EINVAL (bad config) or ENOMEM. */
KEEL_API keel_table_t *keel_table_create(const keel_table_config_t *config);

/* Destroys a table that no one references: if an entry in it has a count
 * above zero, or a removed entry has not had its last put yet, returns
 * KEEL_EBUSY and changes nothing. Otherwise every entry is removed and
 * passed to free_fn, and the call waits for those callbacks and the table's
 * pending deferred frees before freeing the table. Blocks for grace periods;
 * inside a read-side section it would wait for itself and returns
 * KEEL_EINVAL instead. Must not run from a free callback or concurrently
 * with any other call on this table. NULL is a no-op returning 0. */
KEEL_API int keel_table_destroy(keel_table_t *table);

/* Inserts an initialised node; on success the caller holds one reference.
 * KEEL_EEXIST if the key is present (table and node unchanged), KEEL_EINVAL
 * if the key is longer than key_max or the node is already in a table.
 * Locks one bucket briefly. The insert that takes the table past one entry
 * per bucket allocates the next bucket array (twice the size; if that fails
 * the table works on, fuller); while a resize is in flight each insert and
 * removal moves a few buckets (1 growing, 16 shrinking) into the new array. On a table over its limit it
 * also evicts (LRU shard locks, see keel_table_shrink). May run inside a
 * read-side section. */
KEEL_API int keel_table_insert(keel_table_t *table, keel_table_node_t *node);

/* Inserts an initialised node unless its key is present; either way the caller
 * gets one reference: to node (inserted) or to the live entry with that key
 * (node untouched; the caller may free it). One hash, one bucket pass.
 * NULL with errno EINVAL for what insert rejects with KEEL_EINVAL. Locks and
 * allocates as insert; may run inside a read-side section. */
KEEL_API keel_table_node_t *keel_table_get_or_insert(keel_table_t *table, keel_table_node_t *node);

/* Enters / leaves an RCU read-side section (nestable; registers the thread
 * on first use, see "RCU threads" above). Wait-free: a few instructions. */
KEEL_API void keel_table_read_lock(void);
KEEL_API void keel_table_read_unlock(void);

/* Finds the entry with this key, taking no reference: must be called inside
 * keel_table_read_lock()/unlock(), and the result is valid until that
 * unlock (it may be concurrently removed; it is then still readable but no
 * longer in the table). For KEEL_TABLE_KEY_U64 tables key points to a
 * uint64_t and len is 8. NULL with errno ENOENT (absent) or EINVAL (bad
 * length). Lock-free, never blocks, writes nothing shared except to mark the
 * entry recently used (once per LRU pass). */
KEEL_API keel_table_node_t *keel_table_lookup(keel_table_t *table, const void *key, size_t len);

/* keel_table_lookup for U64 tables. */
static inline keel_table_node_t *keel_table_lookup_u64(keel_table_t *table, uint64_t key) {
  return keel_table_lookup(table, &key, sizeof key);
}

/* Finds the entry with this key and takes a reference on it (put it with
 * keel_table_put). Needs no read-side section. NULL with errno ENOENT if
 * absent (or being removed), EINVAL for a bad length. Lock-free. */
KEEL_API keel_table_node_t *keel_table_get(keel_table_t *table, const void *key, size_t len);

static inline keel_table_node_t *keel_table_get_u64(keel_table_t *table, uint64_t key) {
  return keel_table_get(table, &key, sizeof key);
}

/* Takes a reference on an entry found by keel_table_lookup (inside the same
 * read-side section) or one the caller already holds a reference to. False
 * if the entry has been removed and has no reference left (it is dying).
 * Lock-free (one compare-and-swap). */
KEEL_API bool keel_table_ref(keel_table_node_t *node);

/* Drops a reference taken by insert, get or ref. When the count reaches zero
 * the entry goes on the LRU (one short lock, the first time only) or, if it
 * was removed, is freed after a grace period. Aborts if the entry has no
 * reference or belongs to another table. Never blocks on a grace period. */
KEEL_API void keel_table_put(keel_table_t *table, keel_table_node_t *node);

/* Removes an entry from the table: no lookup finds it after this returns.
 * The caller must hold a reference or be inside a read-side section. The
 * entry is freed after its last reference is put and a grace period.
 * KEEL_ENOENT if it was already removed (by this or another thread, or by
 * shrinking), KEEL_EINVAL if it was never inserted or belongs to another
 * table. Locks the entry's bucket briefly (plus one short LRU lock if the
 * entry was cached). */
KEEL_API int keel_table_remove(keel_table_t *table, keel_table_node_t *node);

/* Removes the entry with this key if it has no references; KEEL_ENOENT if
 * absent, KEEL_EBUSY if referenced (nothing changes). */
KEEL_API int keel_table_remove_key(keel_table_t *table, const void *key, size_t len);

/* Calls fn(node, arg) for the entries in the table, inside one read-side
 * section, until fn returns non-zero (that value is returned; 0 when all were
 * visited). Safe against concurrent inserts, removals and resizes: every
 * entry present for the whole walk is visited exactly once; entries added or
 * removed during it may or may not be. fn may call insert, get, ref, put and
 * remove (the node it was given included) but not destroy or anything that
 * waits for a grace period. A long walk delays every deferred free, bucket
 * arrays replaced by resizes during it included (8 bytes per bucket). Copies
 * each bucket's chain under its lock before calling fn on it; KEEL_ENOMEM if
 * a chain of more than 32 entries could not be copied. */
KEEL_API int keel_table_for_each(keel_table_t *table, int (*fn)(keel_table_node_t *node, void *arg),
                                 void *arg);

/* Entries in the table (exact when no insert or removal is running; during
 * them, off by at most the number in flight). Lock-free, O(number of LRU
 * shards). */
KEEL_API size_t keel_table_count(const keel_table_t *table);

/* Removes up to n unreferenced entries, least recently used first (an entry
 * inserted or looked up since the last pass gets a second chance); returns how many were
 * removed. What a memory-pressure callback calls. Takes the LRU shard locks
 * in turn; never waits for a grace period. */
KEEL_API size_t keel_table_shrink(keel_table_t *table, size_t n);

/* A snapshot of a table's state (each field read separately). */
typedef struct keel_table_stats {
  size_t entries;            /* as keel_table_count */
  size_t lru_entries;        /* entries on the LRU (unreferenced, or referenced since) */
  size_t removed_referenced; /* removed entries not yet released (freed after their last put) */
  size_t evicted;            /* entries removed by shrink and the limit since creation */
  size_t charged_bytes;      /* bytes counted against max_bytes (0 without one) */
  size_t buckets;            /* buckets of the index (8 bytes each) */
  size_t resizes;            /* resizes of the index finished since creation */
  bool resizing;             /* a resize is in flight */
} keel_table_stats_t;

/* Fills *stats. Lock-free; enters a read-side section (so registers the
 * calling thread with RCU on its first use, see "RCU threads"). */
KEEL_API void keel_table_stats(const keel_table_t *table, keel_table_stats_t *stats);

#ifdef __cplusplus
}
#endif
#endif /* KEEL_TABLE_H */
