/* Peers for the lock suite: the same lock logic as keel (src/lock/res.c's
 * queues, grant rules and lkbs, unchanged) over the resource directories the
 * Linux DLM used before keel's: a fixed array of buckets, each with a mutex,
 * holding
 *   - a doubly linked list (the DLM's rsbtbl: 1,024 buckets; 16K was the
 *     first proposed fix), or
 *   - a red-black tree (the later DLM patch: 1,024 buckets of rbtrees); the
 *     tree is glibc's tsearch, a red-black tree with its own node per entry.
 * Unused resources (no locks) stay cached on a per-bucket toss list, as the
 * DLM's were, and the oldest are dropped once there are more than cache_max
 * resources, so the peers cache exactly as much as a keel lockspace does.
 * Only the directory differs: keel's is its RCU table (lock-free lookups,
 * resizing); these pay a bucket mutex and a chain or tree walk per lookup.
 */
#define _GNU_SOURCE
#include "baseline_lock_tables.h"

#include <pthread.h>
#include <search.h>
#include <stdlib.h>
#include <string.h>

#include "lock/lock_internal.h"

typedef struct bl_res {
  struct cds_list_head chain; /* BL_LIST: bucket chain */
  struct cds_list_head lru;   /* on the bucket's toss list while ref == 0 */
  uint32_t ref;               /* under the bucket mutex */
  uint32_t hash;
  keel_res_t res; /* last: ends in the name */
} bl_res_t;

typedef struct bl_bucket {
  pthread_mutex_t mu;
  struct cds_list_head chain; /* BL_LIST */
  void *root;                 /* BL_RBTREE: tsearch root */
  struct cds_list_head lru;
} __attribute__((aligned(64))) bl_bucket_t;

struct bl_table {
  bl_kind_t kind;
  size_t nbuckets, cache_max;
  size_t count;  /* atomic: resources in the table */
  size_t cursor; /* atomic: next bucket to evict from */
  bl_bucket_t *b;
};

/* FNV-1a, 32 bits: what a 2000s kernel hash table would use (the DLM used jhash). */
static uint32_t bl_hash(const void *p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 16777619u;
  return h;
}

bl_table_t *bl_create(bl_kind_t kind, size_t nbuckets, size_t cache_max) {
  bl_table_t *t = calloc(1, sizeof(*t));
  t->kind = kind;
  t->nbuckets = nbuckets;
  t->cache_max = cache_max;
  t->b = aligned_alloc(64, nbuckets * sizeof(bl_bucket_t));
  for (size_t i = 0; i < nbuckets; i++) {
    pthread_mutex_init(&t->b[i].mu, NULL);
    CDS_INIT_LIST_HEAD(&t->b[i].chain);
    CDS_INIT_LIST_HEAD(&t->b[i].lru);
    t->b[i].root = NULL;
  }
  return t;
}

static void bl_noop(void *p) {
  (void)p;
}

void bl_destroy(bl_table_t *t) {
  for (size_t i = 0; i < t->nbuckets; i++) {
    bl_bucket_t *b = &t->b[i];
    bl_res_t *r, *tmp;
    if (t->kind == BL_RBTREE) tdestroy(b->root, bl_noop);
    cds_list_for_each_entry_safe(r, tmp, &b->lru, lru) free(r);
    pthread_mutex_destroy(&b->mu);
  }
  free(t->b);
  free(t);
}

size_t bl_count(bl_table_t *t) {
  return __atomic_load_n(&t->count, __ATOMIC_RELAXED);
}

static int bl_cmp(const void *a, const void *b) {
  const bl_res_t *x = a, *y = b;
  if (x->hash != y->hash) return x->hash < y->hash ? -1 : 1;
  if (x->res.namelen != y->res.namelen) return x->res.namelen < y->res.namelen ? -1 : 1;
  return memcmp(x->res.name, y->res.name, x->res.namelen);
}

static bl_res_t *bl_find(bl_table_t *t, bl_bucket_t *b, bl_res_t *key) {
  if (t->kind == BL_RBTREE) {
    void *n = tfind(key, &b->root, bl_cmp);
    return n ? *(bl_res_t **)n : NULL;
  }
  bl_res_t *r;
  cds_list_for_each_entry(r, &b->chain, chain) {
    if (r->hash == key->hash && r->res.namelen == key->res.namelen &&
        memcmp(r->res.name, key->res.name, key->res.namelen) == 0)
      return r;
  }
  return NULL;
}

/* Drops one unused resource, from the buckets in turn. */
static void bl_evict(bl_table_t *t) {
  for (size_t k = 0; k < t->nbuckets; k++) {
    size_t i = __atomic_fetch_add(&t->cursor, 1, __ATOMIC_RELAXED) % t->nbuckets;
    bl_bucket_t *b = &t->b[i];
    pthread_mutex_lock(&b->mu);
    if (!cds_list_empty(&b->lru)) {
      bl_res_t *r = cds_list_first_entry(&b->lru, bl_res_t, lru);
      cds_list_del(&r->lru);
      if (t->kind == BL_RBTREE)
        tdelete(r, &b->root, bl_cmp);
      else
        cds_list_del(&r->chain);
      __atomic_fetch_sub(&t->count, 1, __ATOMIC_RELAXED);
      pthread_mutex_unlock(&b->mu);
      free(r);
      return;
    }
    pthread_mutex_unlock(&b->mu);
  }
}

static bl_res_t *bl_get(bl_table_t *t, const void *name, size_t len) {
  struct {
    bl_res_t r;
    char name[KEEL_LOCK_NAME_MAX];
  } key;
  key.r.hash = bl_hash(name, len);
  key.r.res.namelen = (uint8_t)len;
  memcpy(key.r.res.name, name, len);
  bl_bucket_t *b = &t->b[key.r.hash % t->nbuckets];
  pthread_mutex_lock(&b->mu);
  bl_res_t *r = bl_find(t, b, &key.r);
  if (r != NULL) {
    if (r->ref++ == 0) cds_list_del(&r->lru);
    pthread_mutex_unlock(&b->mu);
    return r;
  }
  r = malloc(sizeof(*r) + len);
  if (r == NULL) {
    pthread_mutex_unlock(&b->mu);
    return NULL;
  }
  _keel_res_init(&r->res, name, len);
  r->hash = key.r.hash;
  r->ref = 1;
  if (t->kind == BL_RBTREE)
    tsearch(r, &b->root, bl_cmp);
  else
    cds_list_add(&r->chain, &b->chain);
  size_t n = __atomic_add_fetch(&t->count, 1, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&b->mu);
  if (n > t->cache_max) bl_evict(t);
  return r;
}

static void bl_put(bl_table_t *t, bl_res_t *r) {
  bl_bucket_t *b = &t->b[r->hash % t->nbuckets];
  pthread_mutex_lock(&b->mu);
  if (--r->ref == 0) cds_list_add_tail(&r->lru, &b->lru);
  pthread_mutex_unlock(&b->mu);
}

/* keel_lock's by-name path (src/lock/lock.c) with bl_get for the lookup. */
int bl_lock(bl_table_t *t, const void *name, size_t len, int mode, unsigned flags,
            keel_lksb_t *lksb) {
  keel_lkb_t *lkb = malloc(sizeof(*lkb));
  bl_res_t *r = bl_get(t, name, len);
  if (lkb == NULL || r == NULL) abort();
  *lkb = (keel_lkb_t){.magic = KEEL_LKB_MAGIC,
                      .gr = -1,
                      .rq = (int8_t)mode,
                      .bast_mode = -1,
                      .flags = flags,
                      .res = &r->res,
                      .lksb = lksb};
  lksb->lock = lkb;
  keel_dispatch_t d;
  keel_dispatch_init(&d, NULL);
  __keel_mutex_lock(&r->res.mu);
  int rc = __keel_res_request(&r->res, lkb, &d);
  bool waiting = lkb->queue == KEEL_Q_WAIT;
  __keel_mutex_unlock(&r->res.mu);
  keel_dispatch(&d);
  if (rc != 0) {
    lksb->lock = NULL;
    free(lkb);
    bl_put(t, r);
    return rc;
  }
  while (waiting) {
    uint32_t w = __atomic_load_n(&lkb->wake, __ATOMIC_ACQUIRE);
    if (w == 1) break;
    if (w == 0 &&
        !__atomic_compare_exchange_n(&lkb->wake, &w, 2, false, __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE))
      continue;
    keel_futex_wait(&lkb->wake, 2);
  }
  return 0;
}

int bl_unlock(bl_table_t *t, keel_lksb_t *lksb) {
  keel_lkb_t *lkb = lksb->lock;
  keel_res_t *res = lkb->res;
  keel_dispatch_t d;
  keel_dispatch_init(&d, NULL);
  __keel_mutex_lock(&res->mu);
  __keel_res_unlock(res, lkb, 0, &d);
  __keel_mutex_unlock(&res->mu);
  keel_dispatch(&d);
  lksb->lock = NULL;
  free(lkb);
  bl_put(t, (bl_res_t *)((char *)res - offsetof(bl_res_t, res)));
  return 0;
}
