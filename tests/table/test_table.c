/* Unit tests of the table: the API contract, references, the LRU, limits
 * and every bad-input behaviour listed in issue 7. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <keel/table.h>
#include <urcu/urcu-memb.h>

#include "harness.h"
#include "table/table_internal.h"

typedef struct item {
  keel_table_node_t node;
  char name[40];
  keel_atomic(int) freed; /* atomic: the test waits for frees through liburcu */
} item_t;

static keel_atomic(long) frees;

static void item_free(keel_table_node_t *n, void *arg) {
  (void)arg;
  item_t *it = keel_table_entry(n, item_t, node);
  keel_fetch_add_relaxed(&it->freed, 1);
  keel_fetch_add_relaxed(&frees, 1);
}

/* Waits until every deferred free queued so far has run. */
static void wait_frees(void) {
  urcu_memb_synchronize_rcu();
  urcu_memb_barrier();
  urcu_memb_barrier();
}

static keel_table_t *u64_table(size_t max_entries) {
  keel_table_config_t c = {.key_type = KEEL_TABLE_KEY_U64,
                           .max_entries = max_entries,
                           .free_fn = item_free,
                           .name = "test"};
  keel_table_t *t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  return t;
}

static item_t *items_new(size_t n, uint64_t base) {
  item_t *v = calloc(n, sizeof *v);
  for (size_t i = 0; i < n; i++) keel_table_node_init_u64(&v[i].node, base + i);
  return v;
}

static void create_bad_config(void) {
  KT_CHECK(keel_table_create(NULL) == NULL && errno == EINVAL);
  keel_table_config_t c = {.key_type = 7};
  KT_CHECK(keel_table_create(&c) == NULL && errno == EINVAL);
  c = (keel_table_config_t){.key_type = KEEL_TABLE_KEY_BYTES, .key_max = KEEL_TABLE_KEY_MAX + 1};
  KT_CHECK(keel_table_create(&c) == NULL && errno == EINVAL);
  c = (keel_table_config_t){.key_type = KEEL_TABLE_KEY_U64, .max_bytes = 1000};
  KT_CHECK(keel_table_create(&c) == NULL && errno == EINVAL);
  KT_EQ(keel_table_destroy(NULL), 0);
}

static void insert_lookup_get_put(void) {
  keel_table_t *t = u64_table(0);
  item_t *v = items_new(1000, 100);
  for (int i = 0; i < 1000; i++) KT_EQ(keel_table_insert(t, &v[i].node), 0);
  KT_EQ(keel_table_count(t), 1000);
  keel_table_read_lock();
  KT_CHECK(keel_table_lookup_u64(t, 100 + 7) == &v[7].node);
  KT_CHECK(keel_table_lookup_u64(t, 99) == NULL && errno == ENOENT);
  KT_CHECK(keel_table_lookup(t, "abc", 3) == NULL && errno == EINVAL);
  keel_table_read_unlock();
  keel_table_node_t *n = keel_table_get_u64(t, 100 + 999);
  KT_CHECK(n == &v[999].node);
  KT_EQ(n->_ref & REF_COUNT, 2); /* insert's reference and get's */
  KT_CHECK(keel_table_ref(n));
  keel_table_put(t, n);
  keel_table_put(t, n);
  for (int i = 0; i < 1000; i++) keel_table_put(t, &v[i].node);
  keel_table_stats_t st;
  keel_table_stats(t, &st);
  KT_EQ(st.entries, 1000);
  KT_EQ(st.lru_entries, 1000);
  long f0 = keel_load_relaxed(&frees);
  KT_EQ(keel_table_destroy(t), 0);
  KT_EQ(keel_load_relaxed(&frees) - f0, 1000);
  for (int i = 0; i < 1000; i++) KT_EQ(keel_load_relaxed(&v[i].freed), 1);
  free(v);
}

/* Issue 7, part 4: a duplicate key gives KEEL_EEXIST and changes nothing. */
static void duplicate_key_eexist(void) {
  keel_table_t *t = u64_table(0);
  item_t *v = items_new(2, 5);
  keel_table_node_init_u64(&v[1].node, 5);
  KT_EQ(keel_table_insert(t, &v[0].node), 0);
  KT_EQ(keel_table_insert(t, &v[1].node), KEEL_EEXIST);
  KT_EQ(keel_table_count(t), 1);
  KT_EQ(v[1].node._ref, 0); /* the rejected node is untouched, reusable */
  KT_CHECK(keel_table_get_u64(t, 5) == &v[0].node);
  keel_table_put(t, &v[0].node);
  keel_table_put(t, &v[0].node);
  /* A node already in a table cannot be inserted again, anywhere. */
  keel_table_t *t2 = u64_table(0);
  KT_EQ(keel_table_insert(t2, &v[0].node), KEEL_EINVAL);
  KT_EQ(keel_table_insert(t, &v[0].node), KEEL_EINVAL);
  KT_EQ(keel_table_count(t2), 0);
  KT_EQ(keel_table_destroy(t2), 0);
  KT_EQ(keel_table_destroy(t), 0);
  free(v);
}

/* Issue 7, part 4: removing twice -> KEEL_ENOENT; from another table or a
 * node never inserted -> KEEL_EINVAL; neither table changes. */
static void remove_twice_and_foreign(void) {
  keel_table_t *a = u64_table(0), *b = u64_table(0);
  item_t *v = items_new(3, 1);
  KT_EQ(keel_table_insert(a, &v[0].node), 0);
  KT_EQ(keel_table_insert(b, &v[1].node), 0);
  KT_EQ(keel_table_remove(b, &v[0].node), KEEL_EINVAL);
  KT_EQ(keel_table_remove(a, &v[2].node), KEEL_EINVAL); /* never inserted */
  KT_EQ(keel_table_count(a), 1);
  KT_EQ(keel_table_count(b), 1);
  KT_EQ(keel_table_remove(a, &v[0].node), 0);
  KT_EQ(keel_table_remove(a, &v[0].node), KEEL_ENOENT);
  KT_EQ(keel_table_count(a), 0);
  keel_table_read_lock();
  KT_CHECK(keel_table_lookup_u64(a, 1) == NULL);
  keel_table_read_unlock();
  /* Removed but still referenced: not freed until the last put. */
  wait_frees();
  KT_EQ(keel_load_relaxed(&v[0].freed), 0);
  keel_table_put(a, &v[0].node);
  wait_frees();
  KT_EQ(keel_load_relaxed(&v[0].freed), 1);
  KT_EQ(keel_table_remove_key(b, &(uint64_t){2}, 8), KEEL_EBUSY); /* insert's ref held */
  keel_table_put(b, &v[1].node);
  KT_EQ(keel_table_remove_key(b, &(uint64_t){2}, 8), 0);
  KT_EQ(keel_table_remove_key(b, &(uint64_t){2}, 8), KEEL_ENOENT);
  KT_EQ(keel_table_destroy(a), 0);
  KT_EQ(keel_table_destroy(b), 0);
  wait_frees();
  KT_EQ(keel_load_relaxed(&v[1].freed), 1);
  free(v);
}

/* Issue 7, part 4: destroy with referenced entries -> KEEL_EBUSY. */
static void destroy_busy(void) {
  keel_table_t *t = u64_table(0);
  item_t *v = items_new(10, 0);
  for (int i = 0; i < 10; i++) KT_EQ(keel_table_insert(t, &v[i].node), 0);
  for (int i = 0; i < 9; i++) keel_table_put(t, &v[i].node);
  KT_EQ(keel_table_destroy(t), KEEL_EBUSY);
  KT_EQ(keel_table_count(t), 10);
  /* Removed but referenced still counts. */
  KT_EQ(keel_table_remove(t, &v[9].node), 0);
  KT_EQ(keel_table_destroy(t), KEEL_EBUSY);
  keel_table_put(t, &v[9].node);
  KT_EQ(keel_table_destroy(t), 0);
  for (int i = 0; i < 10; i++) KT_EQ(keel_load_relaxed(&v[i].freed), 1);
  free(v);
}

/* Review (helper-89): destroy freed the table's remaining entries in its
 * own thread while deferred frees of earlier removals could still run on
 * liburcu's call_rcu thread: the free callback ran on two threads at once.
 * It now drains those first. The callback on the destroying thread holds
 * the window open (up to 200 ms) until a callback has run elsewhere: before
 * the fix one ran meanwhile; now all of them ran before. */
static keel_atomic(int) cb_inside, cb_overlap, cb_elsewhere;
static _Atomic(pthread_t) cb_destroyer;
static void overlap_free(keel_table_node_t *n, void *arg) {
  (void)n;
  (void)arg;
  if (atomic_fetch_add(&cb_inside, 1) != 0) atomic_store(&cb_overlap, 1);
  if (!pthread_equal(pthread_self(), atomic_load(&cb_destroyer))) {
    atomic_fetch_add(&cb_elsewhere, 1);
  } else {
    for (int k = 0; k < 2000 && atomic_load(&cb_elsewhere) == 0; k++) usleep(100);
  }
  atomic_fetch_sub(&cb_inside, 1);
}

static void destroy_frees_on_one_thread(void) {
  keel_table_config_t c = {.key_type = KEEL_TABLE_KEY_U64, .free_fn = overlap_free};
  keel_table_t *t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  atomic_store(&cb_overlap, 0);
  atomic_store(&cb_elsewhere, 0);
  atomic_store(&cb_destroyer, pthread_self());
  item_t *v = items_new(1000, 0);
  for (int i = 0; i < 1000; i++) {
    KT_EQ(keel_table_insert(t, &v[i].node), 0);
    keel_table_put(t, &v[i].node);
  }
  for (int i = 0; i < 500; i++) KT_EQ(keel_table_remove(t, &v[i].node), 0); /* deferred */
  KT_EQ(keel_table_destroy(t), 0);                                          /* the other 500 here */
  KT_CHECK(atomic_load(&cb_elsewhere) > 0);
  KT_EQ(atomic_load(&cb_overlap), 0);
  free(v);
}

/* Issue 7, part 4: a key longer than the limit -> KEEL_EINVAL. */
static void bytes_keys_and_key_limit(void) {
  keel_table_config_t c = {.key_type = KEEL_TABLE_KEY_BYTES, .key_max = 32, .free_fn = item_free};
  keel_table_t *t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  item_t *v = calloc(100, sizeof *v);
  for (int i = 0; i < 100; i++) {
    int len = snprintf(v[i].name, sizeof v[i].name, "resource/%d/", i * 7919);
    keel_table_node_init_bytes(&v[i].node, v[i].name, (size_t)len);
    KT_EQ(keel_table_insert(t, &v[i].node), 0);
    keel_table_put(t, &v[i].node);
  }
  keel_table_read_lock();
  for (int i = 0; i < 100; i++) {
    char k[40];
    int len = snprintf(k, sizeof k, "resource/%d/", i * 7919);
    KT_CHECK(keel_table_lookup(t, k, (size_t)len) == &v[i].node);
    KT_CHECK(keel_table_lookup(t, k, (size_t)len - 1) == NULL); /* a prefix is another key */
  }
  char big[70000];
  memset(big, 'x', sizeof big);
  KT_CHECK(keel_table_lookup(t, big, 33) == NULL && errno == EINVAL);
  keel_table_read_unlock();
  item_t longer, huge, empty;
  keel_table_node_init_bytes(&longer.node, big, 33);
  KT_EQ(keel_table_insert(t, &longer.node), KEEL_EINVAL);
  keel_table_node_init_bytes(&huge.node, big, sizeof big); /* above KEEL_TABLE_KEY_MAX */
  KT_EQ(keel_table_insert(t, &huge.node), KEEL_EINVAL);
  keel_table_node_init_bytes(&empty.node, "", 0);
  KT_EQ(keel_table_insert(t, &empty.node), 0);
  KT_CHECK(keel_table_get(t, "", 0) == &empty.node);
  KT_CHECK(keel_table_get(t, NULL, 0) == &empty.node); /* an empty key may be NULL */
  keel_table_put(t, &empty.node);
  keel_table_put(t, &empty.node);
  keel_table_put(t, &empty.node);
  KT_EQ(keel_table_count(t), 101);
  KT_EQ(keel_table_destroy(t), 0);
  free(v);
}

static void put_without_reference(void *arg) {
  (void)arg;
  keel_table_t *t = u64_table(0);
  item_t it;
  keel_table_node_init_u64(&it.node, 1);
  keel_table_insert(t, &it.node);
  keel_table_put(t, &it.node);
  keel_table_put(t, &it.node);
}

static void put_wrong_table(void *arg) {
  (void)arg;
  keel_table_t *a = u64_table(0), *b = u64_table(0);
  item_t it;
  keel_table_node_init_u64(&it.node, 1);
  keel_table_insert(a, &it.node);
  keel_table_put(b, &it.node);
}

/* Misuse that would corrupt the LRU aborts with a message. */
static void put_misuse_aborts(void) {
  KT_EXPECT_ABORT(put_without_reference, NULL, "keel_table_put: entry");
  KT_EXPECT_ABORT(put_without_reference, NULL, "has no reference");
  KT_EXPECT_ABORT(put_wrong_table, NULL, "belongs to another table");
}

/* Shrink drops unreferenced entries, least recently released first within
 * each LRU shard (the lists are ordered each on its own), gives a looked-up
 * entry a second chance, and never drops a referenced one. 25,600 entries
 * put ~800 in each of the 32 shards, so evicting half takes about half of
 * each shard that the shrink visits (it stops once it has its count, so a
 * shard may give nothing), from its cold end. */
static void lru_shrink_order(void) {
  keel_table_t *t = u64_table(0);
  enum { N = 25600 };
  item_t *v = items_new(N, 0);
  for (int i = 0; i < N; i++) KT_EQ(keel_table_insert(t, &v[i].node), 0);
  for (int i = 0; i < N; i++) keel_table_put(t, &v[i].node); /* released in key order */
  keel_table_node_t *held = keel_table_get_u64(t, 3);        /* referenced */
  KT_CHECK(held != NULL);
  /* New entries count as used; clear the bits as a pass over every shard
   * would (one shrink call visits each shard for its share only). */
  for (int i = 0; i < N; i++) {
    KT_CHECK(keel_load_relaxed(node_ref(&v[i].node)) & REF_ACCESSED);
    atomic_fetch_and(node_ref(&v[i].node), ~REF_ACCESSED);
  }
  keel_table_read_lock();
  KT_CHECK(keel_table_lookup_u64(t, 10) != NULL); /* used since that pass */
  keel_table_read_unlock();
  KT_EQ(keel_table_shrink(t, N / 2), N / 2);
  KT_EQ(keel_table_count(t), N - N / 2);
  /* Per shard, every evicted entry was released before every survivor
   * (3 is referenced and 10 had its second chance: both survive). */
  static int last_gone[TABLE_SHARDS], first_kept[TABLE_SHARDS];
  for (int i = 0; i < TABLE_SHARDS; i++) last_gone[i] = -1, first_kept[i] = N;
  keel_table_read_lock();
  KT_CHECK(keel_table_lookup_u64(t, 3) == held);
  KT_CHECK(keel_table_lookup_u64(t, 10) != NULL);
  for (int i = 0; i < N; i++) {
    if (i == 3 || i == 10) continue;
    size_t sh = (size_t)(node_shard(t, &v[i].node) - t->shards);
    if (keel_table_lookup_u64(t, (uint64_t)i) == NULL)
      last_gone[sh] = i;
    else if (first_kept[sh] == N)
      first_kept[sh] = i;
  }
  keel_table_read_unlock();
  int gone_shards = 0;
  for (int i = 0; i < TABLE_SHARDS; i++) {
    KT_CHECK(last_gone[i] < first_kept[i]);
    gone_shards += last_gone[i] >= 0;
  }
  KT_CHECK(gone_shards > TABLE_SHARDS / 2);
  /* Referenced entries survive any shrink. */
  KT_EQ(keel_table_shrink(t, SIZE_MAX), N - N / 2 - 1);
  KT_EQ(keel_table_count(t), 1);
  keel_table_put(t, held);
  KT_EQ(keel_table_shrink(t, SIZE_MAX), 1);
  KT_EQ(keel_table_count(t), 0);
  KT_EQ(keel_table_shrink(t, SIZE_MAX), 0);
  KT_EQ(keel_table_destroy(t), 0);
  for (int i = 0; i < N; i++) KT_EQ(keel_load_relaxed(&v[i].freed), 1);
  free(v);
}

/* A new entry counts as used (its second-chance bit is set at insert), so
 * the lookups of a table filled and then read do not write the nodes; a
 * shrink still clears the bits and evicts every unreferenced entry. */
static void new_entries_second_chance(void) {
  keel_table_t *t = u64_table(0);
  enum { N = 64 };
  item_t *v = items_new(N, 0);
  for (int i = 0; i < N; i++) KT_EQ(keel_table_insert(t, &v[i].node), 0);
  for (int i = 0; i < N; i++) keel_table_put(t, &v[i].node);
  uint32_t before = keel_load_relaxed(node_ref(&v[N - 1].node));
  keel_table_read_lock();
  KT_CHECK(keel_table_lookup_u64(t, N - 1) != NULL);
  keel_table_read_unlock();
  KT_EQ(keel_load_relaxed(node_ref(&v[N - 1].node)), before); /* not written */
  KT_EQ(keel_table_shrink(t, SIZE_MAX), N); /* all unreferenced: all go, second chance or not */
  KT_EQ(keel_table_count(t), 0);
  KT_EQ(keel_table_destroy(t), 0);
  for (int i = 0; i < N; i++) KT_EQ(keel_load_relaxed(&v[i].freed), 1);
  free(v);
}

/* The soft limit: inserts beyond max_entries evict released entries. */
static void entry_limit(void) {
  keel_table_t *t = u64_table(100);
  enum { N = 5000 };
  item_t *v = items_new(N, 0);
  for (int i = 0; i < N; i++) {
    KT_EQ(keel_table_insert(t, &v[i].node), 0);
    keel_table_put(t, &v[i].node);
    KT_CHECK(keel_table_count(t) <= 101);
  }
  keel_table_stats_t st;
  keel_table_stats(t, &st);
  KT_EQ(st.entries, 100);
  KT_EQ(st.evicted, N - 100);
  /* Referenced entries are never dropped: the table stays above the limit. */
  item_t *w = items_new(150, 1000000);
  for (int i = 0; i < 150; i++) KT_EQ(keel_table_insert(t, &w[i].node), 0);
  KT_EQ(keel_table_count(t), 150);
  for (int i = 0; i < 150; i++) keel_table_put(t, &w[i].node);
  KT_EQ(keel_table_count(t), 100);
  KT_EQ(keel_table_destroy(t), 0);
  wait_frees();
  for (int i = 0; i < N; i++) KT_EQ(keel_load_relaxed(&v[i].freed), 1);
  free(v);
  free(w);
}

/* max_unused bounds the unreferenced entries only: referenced ones neither
 * count nor push a just-released entry out (the lock manager's cache_max was
 * max_entries, and with that many locked resources an unlock dropped its
 * resource at once). */
static item_t *item_of(keel_table_node_t *n) {
  return keel_table_entry(n, item_t, node);
}

static void unused_limit(void) {
  keel_table_config_t c = {
      .key_type = KEEL_TABLE_KEY_U64, .max_unused = 10, .free_fn = item_free, .name = "test"};
  keel_table_t *t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  enum { HELD = 100, N = 1000 };
  item_t *h = items_new(HELD, 0), *v = items_new(N, 1000000);
  for (int i = 0; i < HELD; i++) KT_EQ(keel_table_insert(t, &h[i].node), 0);
  /* Far above 10 entries, but one unreferenced: it stays. */
  KT_EQ(keel_table_insert(t, &v[0].node), 0);
  keel_table_put(t, &v[0].node);
  KT_EQ(keel_table_count(t), HELD + 1);
  keel_table_stats_t st;
  for (int i = 1; i < N; i++) {
    KT_EQ(keel_table_insert(t, &v[i].node), 0);
    keel_table_put(t, &v[i].node);
    keel_table_stats(t, &st);
    KT_CHECK(st.lru_entries <= 10);
    KT_EQ(keel_load_relaxed(&t->lru_total), st.lru_entries);
    KT_REQUIRE(st.entries <= HELD + 10);
    keel_table_node_t *got = keel_table_get_u64(t, 1000000 + (uint64_t)i);
    KT_REQUIRE(got != NULL); /* the entry just released is the newest: kept */
    keel_table_put(t, got);
  }
  KT_EQ(st.entries, HELD + 10);
  KT_EQ(st.evicted, N - 10);
  for (int i = 0; i < HELD; i++) KT_EQ(keel_load_relaxed(&h[i].freed), 0);
  /* Cached entries referenced again stay listed, and count, until a trim
   * passes them: taking them off counts towards the trim, and they survive. */
  keel_table_node_t *ref[10];
  int nref = 0;
  for (int i = 0; i < N; i++) {
    keel_table_node_t *got = keel_table_get_u64(t, 1000000 + (uint64_t)i);
    if (got != NULL) ref[nref++] = got;
    KT_REQUIRE(nref <= 10);
  }
  KT_EQ(nref, 10);
  for (int i = 0; i < HELD; i++) keel_table_put(t, &h[i].node);
  keel_table_stats(t, &st);
  KT_CHECK(st.lru_entries <= 10);
  KT_CHECK(st.entries >= 10 && st.entries <= 10 + 10); /* + at most 10 unreferenced */
  for (int i = 0; i < 10; i++) KT_EQ(keel_load_relaxed(&item_of(ref[i])->freed), 0);
  for (int i = 0; i < 10; i++) keel_table_put(t, ref[i]);
  keel_table_stats(t, &st);
  KT_CHECK(st.lru_entries <= 10);
  KT_EQ(st.entries, st.lru_entries); /* all unreferenced, all listed */
  KT_EQ(keel_table_shrink(t, 1000), st.entries);
  keel_table_stats(t, &st);
  KT_EQ(st.lru_entries, 0);
  KT_EQ(keel_load_relaxed(&t->lru_total), 0);
  KT_EQ(keel_table_destroy(t), 0);
  wait_frees();
  free(h);
  free(v);
}

static void byte_limit(void) {
  keel_table_config_t c = {.key_type = KEEL_TABLE_KEY_BYTES,
                           .max_bytes = 10000,
                           .entry_size = sizeof(item_t),
                           .free_fn = item_free};
  keel_table_t *t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  item_t *v = calloc(1000, sizeof *v);
  for (int i = 0; i < 1000; i++) {
    int len = snprintf(v[i].name, sizeof v[i].name, "k%d", i);
    keel_table_node_init_bytes(&v[i].node, v[i].name, (size_t)len);
    KT_EQ(keel_table_insert(t, &v[i].node), 0);
    keel_table_put(t, &v[i].node);
  }
  keel_table_stats_t st;
  keel_table_stats(t, &st);
  KT_CHECK(st.charged_bytes <= 10000);
  KT_CHECK(st.charged_bytes > 10000 - 2 * (sizeof(item_t) + 8));
  KT_EQ(keel_table_destroy(t), 0);
  free(v);
}

static int count_cb(keel_table_node_t *n, void *arg) {
  (void)n;
  (*(size_t *)arg)++;
  return 0;
}

typedef struct remove_ctx {
  keel_table_t *t;
  size_t seen;
} remove_ctx_t;

static int remove_cb(keel_table_node_t *n, void *arg) {
  remove_ctx_t *c = arg;
  c->seen++;
  if (n->key.u64 % 2 == 0) KT_EQ(keel_table_remove(c->t, n), 0); /* the current node */
  return 0;
}

static int stop_cb(keel_table_node_t *n, void *arg) {
  (void)n;
  return ++*(int *)arg == 10 ? 42 : 0;
}

static void for_each_visits_and_removes(void) {
  keel_table_t *t = u64_table(0);
  enum { N = 10000 };
  item_t *v = items_new(N, 0);
  for (int i = 0; i < N; i++) {
    KT_EQ(keel_table_insert(t, &v[i].node), 0);
    keel_table_put(t, &v[i].node);
  }
  size_t n = 0;
  KT_EQ(keel_table_for_each(t, count_cb, &n), 0);
  KT_EQ(n, N);
  remove_ctx_t c = {t, 0};
  KT_EQ(keel_table_for_each(t, remove_cb, &c), 0);
  KT_EQ(c.seen, N);
  KT_EQ(keel_table_count(t), N / 2);
  int k = 0;
  KT_EQ(keel_table_for_each(t, stop_cb, &k), 42);
  KT_EQ(keel_table_destroy(t), 0);
  for (int i = 0; i < N; i++) KT_EQ(keel_load_relaxed(&v[i].freed), 1);
  free(v);
}

/* The table grows from its minimum to a million entries and back. */
static void grow_and_shrink(void) {
  keel_table_t *t = u64_table(0);
  size_t n = (size_t)kt_scale(1000000);
  item_t *v = items_new(n, 0);
  /* Past 8192 entries every shard's count has crossed 128 and checks the
   * load each 128 of its changes, so the table doubles one step at a time:
   * a grow ends before the count doubles again. Below that the only check
   * is a long chain's, and a resize sizes the array to the count it finds
   * (pow2_ceil): one from 64 buckets at 150 entries goes to 256 (helper-91
   * measured 12 resizes for 13 doublings in 14 runs of 40). */
  size_t early = n < 8192 ? n : 8192;
  keel_table_stats_t st0, st;
  for (size_t i = 0; i < n; i++) {
    if (i == early) keel_table_stats(t, &st0);
    KT_EQ(keel_table_insert(t, &v[i].node), 0);
    keel_table_put(t, &v[i].node);
  }
  if (early == n) keel_table_stats(t, &st0);
  KT_EQ(keel_table_count(t), n);
  /* At most two entries per bucket (one, or a grow under way). */
  keel_table_stats(t, &st);
  KT_CHECK(st.buckets * 2 >= n);
  size_t doublings = 0;
  for (size_t b = st0.buckets; b < st.buckets; b *= 2) doublings++;
  KT_EQ(st.resizes - st0.resizes, doublings); /* each resize one doubling */
  for (size_t i = 0; i < n; i += 97) KT_CHECK(keel_table_get_u64(t, i) == &v[i].node);
  for (size_t i = 0; i < n; i += 97) keel_table_put(t, &v[i].node);
  KT_EQ(keel_table_shrink(t, SIZE_MAX), n);
  KT_EQ(keel_table_count(t), 0);
  /* Evictions are writes: they shrank the array back towards 64 buckets. */
  size_t grown = st.buckets, resizes = st.resizes;
  keel_table_stats(t, &st);
  KT_CHECK(st.buckets <= 4096 && st.buckets < grown);
  KT_CHECK(st.resizes > resizes);
  KT_EQ(keel_table_destroy(t), 0);
  for (size_t i = 0; i < n; i++) KT_EQ(keel_load_relaxed(&v[i].freed), 1);
  free(v);
}

/* A grow of a large array driven only by threads that each insert 7 entries
 * and exit: every one of them must help (line claims pay ahead), or the
 * grow never ends and chains grow without bound. */
typedef struct few_writes {
  keel_table_t *t;
  item_t *v;
} few_writes_t;
static void *insert_seven(void *arg) {
  few_writes_t *w = arg;
  for (int i = 0; i < 7; i++) {
    KT_EQ(keel_table_insert(w->t, &w->v[i].node), 0);
    keel_table_put(w->t, &w->v[i].node);
  }
  return NULL;
}
static void grow_by_short_lived_threads(void) {
  keel_table_config_t c = {
      .key_type = KEEL_TABLE_KEY_U64, .size_hint = TIDX_BATCH_MIN, .free_fn = item_free};
  keel_table_t *t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  size_t threads = 5 * TIDX_BATCH_MIN / 7; /* 5/2 entries per bucket of the first array */
  item_t *v = items_new(threads * 7, 0);
  for (size_t i = 0; i < threads; i++) {
    few_writes_t w = {t, v + i * 7};
    pthread_t th;
    KT_REQUIRE(pthread_create(&th, NULL, insert_seven, &w) == 0);
    pthread_join(th, NULL);
  }
  keel_table_stats_t st;
  keel_table_stats(t, &st);
  KT_CHECK(st.resizes >= 1);
  KT_CHECK(st.buckets * 2 >= keel_table_count(t));
  KT_EQ(keel_table_destroy(t), 0);
  free(v);
}

/* The state between two arrays, held still: inserting stops as soon as a
 * grow has started, so most buckets are still in the old array and a few
 * are MOVED. Every key is found, no absent one is, a walk visits each
 * entry once, removals and inserts work in both arrays, and the writes
 * that follow finish the resize. */
static int count_visits(keel_table_node_t *n, void *arg) {
  uint8_t *seen = arg;
  seen[n->key.u64]++;
  return 0;
}

static void resize_in_flight(void) {
  keel_table_t *t = u64_table(0);
  size_t n = 20000;
  item_t *v = items_new(n, 0);
  keel_table_stats_t st;
  size_t in = 0;
  do {
    KT_EQ(keel_table_insert(t, &v[in].node), 0);
    keel_table_put(t, &v[in].node);
    in++;
    keel_table_stats(t, &st);
  } while (!(st.resizing && st.resizes >= 3) && in < n);
  KT_REQUIRE(st.resizing);
  /* A few writes more: some buckets MOVED, most not. */
  for (int k = 0; k < 3; k++, in++) {
    KT_EQ(keel_table_insert(t, &v[in].node), 0);
    keel_table_put(t, &v[in].node);
  }
  keel_table_stats(t, &st);
  KT_CHECK(st.resizing);
  keel_table_read_lock();
  for (size_t i = 0; i < in; i++) KT_CHECK(keel_table_lookup_u64(t, i) == &v[i].node);
  for (size_t i = in; i < in + 1000; i++) KT_CHECK(keel_table_lookup_u64(t, i) == NULL);
  keel_table_read_unlock();
  uint8_t *seen = calloc(n, 1);
  KT_EQ(keel_table_for_each(t, count_visits, seen), 0);
  for (size_t i = 0; i < n; i++) KT_EQ(seen[i], i < in ? 1 : 0);
  /* Removals in both arrays (by node and by key) and a duplicate check. */
  for (size_t i = 0; i < in; i += 3) KT_EQ(keel_table_remove(t, &v[i].node), 0);
  for (size_t i = 1; i < in; i += 3) {
    uint64_t k = i;
    KT_EQ(keel_table_remove_key(t, &k, sizeof k), 0);
  }
  item_t dup;
  keel_table_node_init_u64(&dup.node, 2);
  KT_EQ(keel_table_insert(t, &dup.node), KEEL_EEXIST);
  /* Writes finish the resize. */
  size_t mid = in;
  for (; in < n; in++) {
    KT_EQ(keel_table_insert(t, &v[in].node), 0);
    keel_table_put(t, &v[in].node);
  }
  keel_table_stats(t, &st);
  KT_CHECK(!st.resizing || st.resizes >= 4);
  keel_table_read_lock();
  for (size_t i = 0; i < n; i++) {
    bool present = i >= mid || i % 3 == 2;
    KT_CHECK(keel_table_lookup_u64(t, i) == (present ? &v[i].node : NULL));
  }
  keel_table_read_unlock();
  memset(seen, 0, n);
  KT_EQ(keel_table_for_each(t, count_visits, seen), 0);
  size_t live = 0;
  for (size_t i = 0; i < n; i++) {
    KT_CHECK(seen[i] <= 1);
    live += seen[i];
  }
  KT_EQ(live, keel_table_count(t));
  keel_table_stats(t, &st);
  KT_CHECK(st.buckets * 2 >= live);
  KT_EQ(keel_table_destroy(t), 0);
  free(seen);
  free(v);
}

/* A walk whose callback grows the table under it, single-threaded so the
 * interleaving is the same every run: the inserts migrate buckets between
 * the walk's visits, to arrays 2, 4, 8... times the size the walk started
 * on. Every entry there at the start is visited once; the new ones at most
 * once; and resizing went on during the walk. */
typedef struct grow_walk {
  keel_table_t *t;
  item_t *extra;
  size_t n_extra, used;
  uint8_t *seen; /* by key */
} grow_walk_t;

static int grow_during_walk(keel_table_node_t *n, void *arg) {
  grow_walk_t *g = arg;
  g->seen[n->key.u64]++;
  for (int k = 0; k < 16 && g->used < g->n_extra; k++, g->used++) {
    KT_EQ(keel_table_insert(g->t, &g->extra[g->used].node), 0);
    keel_table_put(g->t, &g->extra[g->used].node);
  }
  return 0;
}

static void walk_while_table_grows(void) {
  keel_table_t *t = u64_table(0);
  size_t n = 2000, n_extra = 16 * n;
  item_t *v = items_new(n, 0), *extra = items_new(n_extra, n);
  for (size_t i = 0; i < n; i++) {
    KT_EQ(keel_table_insert(t, &v[i].node), 0);
    keel_table_put(t, &v[i].node);
  }
  keel_table_stats_t st0, st;
  keel_table_stats(t, &st0);
  grow_walk_t g = {t, extra, n_extra, 0, calloc(n + n_extra, 1)};
  KT_EQ(keel_table_for_each(t, grow_during_walk, &g), 0);
  keel_table_stats(t, &st);
  KT_CHECK(st.resizes >= st0.resizes + 3); /* the walk held nothing up */
  for (size_t i = 0; i < n; i++) KT_EQ(g.seen[i], 1);
  for (size_t i = n; i < n + n_extra; i++) KT_CHECK(g.seen[i] <= 1);
  KT_EQ(keel_table_count(t), n + n_extra);
  KT_EQ(keel_table_destroy(t), 0);
  free(g.seen);
  free(v);
  free(extra);
}

/* Thousands of resizes during one walk (its callback, on its first call,
 * grows the table from 64 buckets and shrinks it back, round after round):
 * the walk follows every MOVED bucket through all those arrays without a
 * stack frame per array, and still visits each entry present throughout
 * exactly once. */
#define CW_CHURN 1000

typedef struct cycle_walk {
  keel_table_t *t;
  keel_table_node_t *churn;
  int rounds;
  uint8_t seen[64];
  bool cycled;
} cycle_walk_t;

static int cycle_during_walk(keel_table_node_t *n, void *arg) {
  cycle_walk_t *c = arg;
  if (n->key.u64 < 64) c->seen[n->key.u64]++;
  if (c->cycled) return 0;
  c->cycled = true;
  for (int round = 0; round < c->rounds; round++) {
    keel_table_node_t *r = c->churn + (size_t)round * CW_CHURN;
    for (int i = 0; i < CW_CHURN; i++) {
      keel_table_node_init_u64(&r[i], 1000 + (uint64_t)round * CW_CHURN + (uint64_t)i);
      KT_EQ(keel_table_insert(c->t, &r[i]), 0);
      keel_table_put(c->t, &r[i]);
    }
    for (int i = 0; i < CW_CHURN; i++) KT_EQ(keel_table_remove(c->t, &r[i]), 0);
  }
  return 0;
}

static void *cycle_walk_thread(void *arg) {
  cycle_walk_t *c = arg;
  keel_table_stats_t st0, st;
  keel_table_stats(c->t, &st0);
  KT_EQ(keel_table_for_each(c->t, cycle_during_walk, c), 0);
  keel_table_stats(c->t, &st);
  KT_CHECK(st.resizes >= st0.resizes + (size_t)c->rounds / 2);
  return NULL;
}

static void walk_through_many_resizes(void) {
  /* Fresh nodes every round (a removed node is not reusable before a grace
   * period, and the walk's read-side section holds one off); the test owns
   * them, so no free callback. */
  keel_table_config_t cfg = {.key_type = KEEL_TABLE_KEY_U64};
  cycle_walk_t *c = calloc(1, sizeof *c);
  c->t = keel_table_create(&cfg);
  KT_REQUIRE(c->t != NULL);
  item_t *v = items_new(64, 0);
  /* Release: 1,000 rounds (thousands of arrays) on a 32 KiB stack, which a
   * frame per array overflows; sanitizers: fewer, on a larger stack. */
  c->rounds = kt_sanitized() ? 300 : 1000;
  c->churn = calloc((size_t)c->rounds * CW_CHURN, sizeof *c->churn);
  for (int i = 0; i < 64; i++) KT_EQ(keel_table_insert(c->t, &v[i].node), 0);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, kt_sanitized() ? 1u << 20 : 32u << 10);
  pthread_t th;
  KT_EQ(pthread_create(&th, &attr, cycle_walk_thread, c), 0);
  pthread_join(th, NULL);
  pthread_attr_destroy(&attr);
  for (int i = 0; i < 64; i++) KT_EQ(c->seen[i], 1);
  for (int i = 0; i < 64; i++) keel_table_put(c->t, &v[i].node);
  KT_EQ(keel_table_destroy(c->t), 0);
  free(c->churn);
  free(c);
  free(v);
}

/* A size hint beyond any sane table is capped (the table grows past the cap
 * by itself), not an allocation of terabytes or a shift past 63. */
static void huge_size_hint(void) {
  keel_table_config_t c = {.key_type = KEEL_TABLE_KEY_U64, .size_hint = SIZE_MAX};
  keel_table_t *t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  keel_table_stats_t st;
  keel_table_stats(t, &st);
  KT_EQ(st.buckets, (size_t)1 << 27);
  item_t it;
  keel_table_node_init_u64(&it.node, 7);
  KT_EQ(keel_table_insert(t, &it.node), 0);
  keel_table_put(t, &it.node);
  KT_CHECK(keel_table_get_u64(t, 7) == &it.node);
  keel_table_put(t, &it.node);
  KT_EQ(keel_table_destroy(t), 0);
}

/* A thread that never registered with RCU can use a table, and exiting
 * unregisters it (a grace period afterwards does not wait for it). */
static void *unregistered_thread(void *arg) {
  keel_table_t *t = arg;
  keel_table_node_t *n = keel_table_get_u64(t, 1);
  KT_CHECK(n != NULL);
  keel_table_put(t, n);
  return NULL;
}

static void thread_registration(void) {
  keel_table_t *t = u64_table(0);
  item_t it;
  keel_table_node_init_u64(&it.node, 1);
  KT_EQ(keel_table_insert(t, &it.node), 0);
  keel_table_put(t, &it.node);
  for (int i = 0; i < 8; i++) {
    pthread_t th;
    pthread_create(&th, NULL, unregistered_thread, t);
    pthread_join(th, NULL);
  }
  urcu_memb_synchronize_rcu(); /* would hang on a leaked reader */
  KT_EQ(keel_table_destroy(t), 0);
}

static void destroy_inside_read_section(void) {
  keel_table_t *t = u64_table(0);
  keel_table_read_lock();
  KT_EQ(keel_table_destroy(t), KEEL_EINVAL);
  keel_table_read_unlock();
  KT_EQ(keel_table_destroy(t), 0);
}

/* get_or_insert: inserts a new key with one reference; for a present key
 * returns the entry with a reference (a cached one too) and leaves the
 * caller's node untouched; a removed entry is not returned. */
static void get_or_insert_basic(void) {
  keel_table_t *t = u64_table(0);
  item_t *v = items_new(4, 7);
  keel_table_node_init_u64(&v[1].node, 7);
  keel_table_node_init_u64(&v[2].node, 7);
  keel_table_node_init_u64(&v[3].node, 7);
  KT_CHECK(keel_table_get_or_insert(t, &v[0].node) == &v[0].node);
  KT_EQ(v[0].node._ref & REF_COUNT, 1);
  KT_CHECK(keel_table_get_or_insert(t, &v[1].node) == &v[0].node);
  KT_EQ(v[0].node._ref & REF_COUNT, 2);
  KT_EQ(v[1].node._ref, 0); /* untouched and reusable */
  KT_EQ(v[1].node._tag, 0);
  KT_EQ(keel_table_count(t), 1);
  keel_table_put(t, &v[0].node);
  keel_table_put(t, &v[0].node);
  /* Cached (count 0, on the LRU): found and referenced again. */
  KT_CHECK(keel_table_get_or_insert(t, &v[1].node) == &v[0].node);
  KT_EQ(v[0].node._ref & REF_COUNT, 1);
  /* Removed while referenced: no longer found, so the new node goes in. */
  KT_EQ(keel_table_remove(t, &v[0].node), 0);
  KT_CHECK(keel_table_get_or_insert(t, &v[1].node) == &v[1].node);
  KT_EQ(keel_table_count(t), 1);
  keel_table_put(t, &v[0].node);
  keel_table_put(t, &v[1].node);
  wait_frees();
  KT_EQ(keel_load_relaxed(&v[0].freed), 1);
  KT_EQ(keel_table_destroy(t), 0);
  KT_EQ(keel_load_relaxed(&v[1].freed), 1);
  KT_EQ(keel_load_relaxed(&v[2].freed), 0);
  /* Byte-string keys. */
  keel_table_config_t c = {.key_type = KEEL_TABLE_KEY_BYTES, .key_max = 16, .free_fn = item_free};
  t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  keel_table_node_init_bytes(&v[2].node, "glock/2/42", 10);
  keel_table_node_init_bytes(&v[3].node, "glock/2/42", 10);
  KT_CHECK(keel_table_get_or_insert(t, &v[2].node) == &v[2].node);
  KT_CHECK(keel_table_get_or_insert(t, &v[3].node) == &v[2].node);
  KT_EQ(v[3].node._ref, 0);
  keel_table_put(t, &v[2].node);
  keel_table_put(t, &v[2].node);
  KT_EQ(keel_table_destroy(t), 0);
  KT_EQ(keel_load_relaxed(&v[3].freed), 0);
  free(v);
}

/* Bad input: what insert rejects with KEEL_EINVAL, get_or_insert rejects with
 * NULL and errno EINVAL, changing no table. */
static void get_or_insert_bad_input(void) {
  keel_table_t *t = u64_table(0);
  item_t *v = items_new(2, 1);
  errno = 0;
  KT_CHECK(keel_table_get_or_insert(NULL, &v[0].node) == NULL && errno == EINVAL);
  errno = 0;
  KT_CHECK(keel_table_get_or_insert(t, NULL) == NULL && errno == EINVAL);
  KT_CHECK(keel_table_get_or_insert(t, &v[0].node) == &v[0].node);
  /* A node already in a table: this one or another. */
  keel_table_t *t2 = u64_table(0);
  errno = 0;
  KT_CHECK(keel_table_get_or_insert(t2, &v[0].node) == NULL && errno == EINVAL);
  errno = 0;
  KT_CHECK(keel_table_get_or_insert(t, &v[0].node) == NULL && errno == EINVAL);
  KT_EQ(v[0].node._ref & REF_COUNT, 1);
  KT_EQ(keel_table_count(t2), 0);
  KT_EQ(keel_table_destroy(t2), 0);
  keel_table_put(t, &v[0].node);
  KT_EQ(keel_table_destroy(t), 0);
  /* Keys longer than the table's limit, or than any table's. */
  keel_table_config_t c = {.key_type = KEEL_TABLE_KEY_BYTES, .key_max = 8, .free_fn = item_free};
  t = keel_table_create(&c);
  KT_REQUIRE(t != NULL);
  static char big[KEEL_TABLE_KEY_MAX + 2];
  keel_table_node_init_bytes(&v[1].node, big, 9);
  errno = 0;
  KT_CHECK(keel_table_get_or_insert(t, &v[1].node) == NULL && errno == EINVAL);
  keel_table_node_init_bytes(&v[1].node, big, sizeof big);
  errno = 0;
  KT_CHECK(keel_table_get_or_insert(t, &v[1].node) == NULL && errno == EINVAL);
  KT_EQ(keel_table_count(t), 0);
  KT_EQ(keel_table_destroy(t), 0);
  free(v);
}

/* An entry marked DEAD by an evictor that has not yet deleted it (the window
 * between its CAS and its cds_lfht_del, held open here by hand): get_or_insert
 * must not return it nor wait for the evictor, but delete it itself, insert
 * the new node, and leave the old entry to be freed once. */
static void get_or_insert_helps_dying_entry(void) {
  keel_table_t *t = u64_table(0);
  item_t *v = items_new(2, 3);
  keel_table_node_init_u64(&v[1].node, 3);
  KT_EQ(keel_table_insert(t, &v[0].node), 0);
  keel_table_put(t, &v[0].node); /* cached, on the LRU */
  KT_CHECK(v[0].node._ref & REF_ON_LRU);
  atomic_fetch_or(node_ref(&v[0].node), REF_DEAD); /* the evictor's CAS */
  KT_CHECK(keel_table_get_or_insert(t, &v[1].node) == &v[1].node);
  KT_EQ(keel_table_count(t), 1);
  KT_CHECK(!(v[0].node._ref & REF_ON_LRU));
  wait_frees();
  KT_EQ(keel_load_relaxed(&v[0].freed), 1);
  keel_table_read_lock();
  KT_CHECK(keel_table_lookup_u64(t, 3) == &v[1].node);
  keel_table_read_unlock();
  /* The shrinker meets no trace of the old entry. */
  keel_table_put(t, &v[1].node);
  KT_EQ(keel_table_shrink(t, 10), 1);
  KT_EQ(keel_table_destroy(t), 0);
  KT_EQ(keel_load_relaxed(&v[0].freed), 1);
  KT_EQ(keel_load_relaxed(&v[1].freed), 1);
  free(v);
}

KT_MAIN(KT_CASE(create_bad_config), KT_CASE(destroy_frees_on_one_thread),
        KT_CASE(insert_lookup_get_put), KT_CASE(duplicate_key_eexist),
        KT_CASE(remove_twice_and_foreign), KT_CASE(destroy_busy), KT_CASE(bytes_keys_and_key_limit),
        KT_CASE(put_misuse_aborts), KT_CASE(lru_shrink_order), KT_CASE(new_entries_second_chance),
        KT_CASE(entry_limit), KT_CASE(unused_limit), KT_CASE(byte_limit),
        KT_CASE(for_each_visits_and_removes), KT_CASE(grow_and_shrink), KT_CASE(resize_in_flight),
        KT_CASE(walk_while_table_grows), KT_CASE(walk_through_many_resizes),
        KT_CASE(huge_size_hint), KT_CASE(thread_registration), KT_CASE(destroy_inside_read_section),
        KT_CASE(get_or_insert_basic), KT_CASE(get_or_insert_bad_input),
        KT_CASE(get_or_insert_helps_dying_entry), KT_CASE(grow_by_short_lived_threads))
