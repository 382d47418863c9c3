/* Baselines for the `table` suite.
 *
 * list-1024, list-16k: the Linux DLM's resource table before 2009: a fixed
 * array of buckets, each a mutex and a singly linked list searched from the
 * head (an insert searches for a duplicate first, as dlm_find_rsb did).
 * rbtree-1024: the DLM's patch: the same 1,024 buckets, each a red-black
 * tree. glibc's tsearch/tfind/tdelete are its red-black tree (non-intrusive:
 * it allocates a 3-word node per entry with malloc, which the bytes-per-entry
 * figure includes). rculfhash: liburcu's lock-free table with the same
 * parameters keel gives it (4,096 buckets at least, presized to a quarter of
 * the expected count, auto-resize with accounting), an intrusive node of
 * 16 bytes plus the key, lookups in a memb read-side section; rculfhash-40
 * is the same with the node padded to the size of keel's.
 */
#define _GNU_SOURCE
#define _LGPL_SOURCE /* inline read-side: how a tuned liburcu user calls it */
#include <errno.h>
#include <pthread.h>
#include <search.h>
#include <stdlib.h>
#include <string.h>

#include <urcu/urcu-memb.h>

#include <urcu/rculfhash.h>

#include "baseline_table.h"

/* --- fixed buckets of lists ------------------------------------------------ */

typedef struct list_node {
  struct list_node *next;
  uint64_t key;
} list_node_t;

typedef struct list_bucket {
  pthread_mutex_t lock;
  list_node_t *head;
} __attribute__((aligned(64))) list_bucket_t;

typedef struct list_table {
  size_t mask;
  list_bucket_t b[];
} list_table_t;

static void *list_create(size_t buckets) {
  list_table_t *t = aligned_alloc(64, sizeof *t + buckets * sizeof(list_bucket_t));
  t->mask = buckets - 1;
  for (size_t i = 0; i < buckets; i++) {
    pthread_mutex_init(&t->b[i].lock, NULL);
    t->b[i].head = NULL;
  }
  return t;
}
static void *list_create_1k(size_t n) {
  (void)n;
  return list_create(1024);
}
static void *list_create_16k(size_t n) {
  (void)n;
  return list_create(16384);
}

static void list_node_init(void *node, uint64_t key) {
  list_node_t *n = node;
  n->next = NULL;
  n->key = key;
}

static list_bucket_t *list_bucket(list_table_t *t, uint64_t key) {
  return &t->b[tb_hash(key) & t->mask];
}

static list_node_t *list_find(list_bucket_t *b, uint64_t key) {
  for (list_node_t *n = b->head; n != NULL; n = n->next)
    if (n->key == key) return n;
  return NULL;
}

static void list_load(void *tp, void *node) {
  list_node_t *n = node;
  list_bucket_t *b = list_bucket(tp, n->key);
  n->next = b->head;
  b->head = n;
}

static int list_insert(void *tp, void *node) {
  list_node_t *n = node;
  list_bucket_t *b = list_bucket(tp, n->key);
  int rc = 0;
  pthread_mutex_lock(&b->lock);
  if (list_find(b, n->key) != NULL) {
    rc = -EEXIST;
  } else {
    n->next = b->head;
    b->head = n;
  }
  pthread_mutex_unlock(&b->lock);
  return rc;
}

static int list_lookup(void *tp, uint64_t key) {
  list_bucket_t *b = list_bucket(tp, key);
  pthread_mutex_lock(&b->lock);
  list_node_t *n = list_find(b, key);
  pthread_mutex_unlock(&b->lock);
  return n != NULL;
}

static int list_remove(void *tp, uint64_t key) {
  list_bucket_t *b = list_bucket(tp, key);
  int rc = -ENOENT;
  pthread_mutex_lock(&b->lock);
  for (list_node_t **pp = &b->head; *pp != NULL; pp = &(*pp)->next) {
    if ((*pp)->key == key) {
      *pp = (*pp)->next;
      rc = 0;
      break;
    }
  }
  pthread_mutex_unlock(&b->lock);
  return rc;
}

/* --- fixed buckets of red-black trees (glibc tsearch) ----------------------- */

typedef struct tree_bucket {
  pthread_mutex_t lock;
  void *root;
} __attribute__((aligned(64))) tree_bucket_t;

typedef struct tree_table {
  tree_bucket_t b[1024];
} tree_table_t;

static int key_cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void *tree_create(size_t n) {
  (void)n;
  tree_table_t *t = aligned_alloc(64, sizeof *t);
  for (int i = 0; i < 1024; i++) {
    pthread_mutex_init(&t->b[i].lock, NULL);
    t->b[i].root = NULL;
  }
  return t;
}

static void tree_node_init(void *node, uint64_t key) {
  *(uint64_t *)node = key;
}

static tree_bucket_t *tree_bucket(tree_table_t *t, uint64_t key) {
  return &t->b[tb_hash(key) & 1023];
}

static int tree_insert(void *tp, void *node) {
  tree_bucket_t *b = tree_bucket(tp, *(uint64_t *)node);
  pthread_mutex_lock(&b->lock);
  void **got = tsearch(node, &b->root, key_cmp);
  pthread_mutex_unlock(&b->lock);
  if (got == NULL) return -ENOMEM;
  return *got == node ? 0 : -EEXIST;
}

static void tree_load(void *tp, void *node) {
  (void)tree_insert(tp, node);
}

static int tree_lookup(void *tp, uint64_t key) {
  tree_bucket_t *b = tree_bucket(tp, key);
  pthread_mutex_lock(&b->lock);
  void **got = tfind(&key, &b->root, key_cmp);
  pthread_mutex_unlock(&b->lock);
  return got != NULL;
}

static int tree_remove(void *tp, uint64_t key) {
  tree_bucket_t *b = tree_bucket(tp, key);
  pthread_mutex_lock(&b->lock);
  int rc = tfind(&key, &b->root, key_cmp) != NULL ? 0 : -ENOENT;
  if (rc == 0) tdelete(&key, &b->root, key_cmp);
  pthread_mutex_unlock(&b->lock);
  return rc;
}

/* --- raw rculfhash --------------------------------------------------------- */

typedef struct lf_node {
  struct cds_lfht_node n;
  uint64_t key;
} lf_node_t;

static void *lf_create(size_t expected) {
  unsigned long init = 4096;
  while (init < expected / 4 && init < (1ul << 27)) init <<= 1;
  return cds_lfht_new_flavor(init, 4096, 1ul << 27, CDS_LFHT_AUTO_RESIZE | CDS_LFHT_ACCOUNTING,
                             &urcu_memb_flavor, NULL);
}

static void lf_node_init(void *node, uint64_t key) {
  lf_node_t *n = node;
  cds_lfht_node_init(&n->n);
  n->key = key;
}

static int lf_match(struct cds_lfht_node *n, const void *key) {
  return caa_container_of(n, lf_node_t, n)->key == *(const uint64_t *)key;
}

static int lf_insert(void *ht, void *node) {
  lf_node_t *n = node;
  urcu_memb_read_lock();
  struct cds_lfht_node *got = cds_lfht_add_unique(ht, tb_hash(n->key), lf_match, &n->key, &n->n);
  urcu_memb_read_unlock();
  return got == &n->n ? 0 : -EEXIST;
}

static void lf_load(void *ht, void *node) {
  (void)lf_insert(ht, node);
}

static int lf_lookup(void *ht, uint64_t key) {
  struct cds_lfht_iter it;
  urcu_memb_read_lock();
  cds_lfht_lookup(ht, tb_hash(key), lf_match, &key, &it);
  int found = cds_lfht_iter_get_node(&it) != NULL;
  urcu_memb_read_unlock();
  return found;
}

static int lf_remove(void *ht, uint64_t key) {
  struct cds_lfht_iter it;
  int rc = -ENOENT;
  urcu_memb_read_lock();
  cds_lfht_lookup(ht, tb_hash(key), lf_match, &key, &it);
  struct cds_lfht_node *n = cds_lfht_iter_get_node(&it);
  if (n != NULL && cds_lfht_del(ht, n) == 0) rc = 0; /* slab memory: nothing to free */
  urcu_memb_read_unlock();
  return rc;
}

/* rculfhash-40: the same table with the node padded to keel's 40 bytes, so
 * that a comparison with keel separates what keel's index gains (one-pointer
 * buckets, short chains) from what its larger node (reference count, LRU
 * links) costs in cache and TLB. */
typedef struct lf40_node {
  lf_node_t n;
  char pad[16];
} lf40_node_t;

static void lf_thread_start(void) {
  urcu_memb_register_thread();
}
static void lf_thread_end(void) {
  urcu_memb_unregister_thread();
}

static const tb_impl_t baselines[] = {
    {"list-1024", sizeof(list_node_t), list_create_1k, list_node_init, list_load, list_insert,
     list_lookup, list_remove, NULL, NULL},
    {"list-16k", sizeof(list_node_t), list_create_16k, list_node_init, list_load, list_insert,
     list_lookup, list_remove, NULL, NULL},
    {"rbtree-1024", sizeof(uint64_t), tree_create, tree_node_init, tree_load, tree_insert,
     tree_lookup, tree_remove, NULL, NULL},
    {"rculfhash", sizeof(lf_node_t), lf_create, lf_node_init, lf_load, lf_insert, lf_lookup,
     lf_remove, lf_thread_start, lf_thread_end},
    {"rculfhash-40", sizeof(lf40_node_t), lf_create, lf_node_init, lf_load, lf_insert, lf_lookup,
     lf_remove, lf_thread_start, lf_thread_end},
};

const tb_impl_t *tb_baseline(const char *name) {
  for (size_t i = 0; i < sizeof baselines / sizeof baselines[0]; i++)
    if (strcmp(baselines[i].name, name) == 0) return &baselines[i];
  return NULL;
}
