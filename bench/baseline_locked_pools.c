/* The old GlusterFS memory pool, for the pool suite (see the header).
 *
 * As in mem-pool.c: mem_pool_new() callocs one arena of `count` objects,
 * each preceded by a small header, and threads them on a free list; mem_get
 * takes the pool lock and pops the list, or, when the arena is exhausted,
 * callocs a standalone object marked as such; mem_put takes the lock and
 * pushes arena objects back, freeing standalone ones. The arena is only
 * given back by mem_pool_destroy, so the pool's memory never shrinks: the
 * idle-RSS column shows that cost, the throughput columns the lock's. */
#define _GNU_SOURCE
#include "baseline_locked_pools.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct lp_obj {
  struct lp_obj *next; /* free-list link while free */
  uintptr_t in_arena;  /* 1: arena object; 0: calloc'ed overflow */
} lp_obj_t;            /* 16 bytes: objects stay 16-aligned */

struct kb_locked_pool {
  kb_lock_kind_t kind;
  pthread_mutex_t mu;
  pthread_spinlock_t spin;
  lp_obj_t *free_list; /* under the lock */
  size_t obj_size, stride, count;
  char *arena;
};

static inline void lp_lock(kb_locked_pool_t *lp) {
  if (lp->kind == KB_LOCK_SPIN)
    pthread_spin_lock(&lp->spin);
  else
    pthread_mutex_lock(&lp->mu);
}

static inline void lp_unlock(kb_locked_pool_t *lp) {
  if (lp->kind == KB_LOCK_SPIN)
    pthread_spin_unlock(&lp->spin);
  else
    pthread_mutex_unlock(&lp->mu);
}

kb_locked_pool_t *kb_locked_pool_create(size_t obj_size, size_t count, kb_lock_kind_t kind) {
  kb_locked_pool_t *lp = calloc(1, sizeof(*lp));
  if (lp == NULL) return NULL;
  lp->kind = kind;
  lp->obj_size = obj_size;
  lp->stride = sizeof(lp_obj_t) + ((obj_size + 15) & ~(size_t)15);
  lp->count = count;
  lp->arena = calloc(count, lp->stride);
  if (lp->arena == NULL) {
    free(lp);
    return NULL;
  }
  pthread_mutex_init(&lp->mu, NULL);
  pthread_spin_init(&lp->spin, PTHREAD_PROCESS_PRIVATE);
  for (size_t i = count; i-- > 0;) {
    lp_obj_t *o = (lp_obj_t *)(lp->arena + i * lp->stride);
    o->in_arena = 1;
    o->next = lp->free_list;
    lp->free_list = o;
  }
  return lp;
}

void *kb_locked_pool_alloc(kb_locked_pool_t *lp) {
  lp_lock(lp);
  lp_obj_t *o = lp->free_list;
  if (o != NULL) lp->free_list = o->next;
  lp_unlock(lp);
  if (o == NULL) { /* arena exhausted: GlusterFS fell back to calloc */
    o = calloc(1, sizeof(lp_obj_t) + lp->obj_size);
    if (o == NULL) return NULL;
  }
  return o + 1;
}

void kb_locked_pool_free(kb_locked_pool_t *lp, void *obj) {
  lp_obj_t *o = (lp_obj_t *)obj - 1;
  if (!o->in_arena) {
    free(o);
    return;
  }
  lp_lock(lp);
  o->next = lp->free_list;
  lp->free_list = o;
  lp_unlock(lp);
}

void kb_locked_pool_destroy(kb_locked_pool_t *lp) {
  pthread_mutex_destroy(&lp->mu);
  pthread_spin_destroy(&lp->spin);
  free(lp->arena);
  free(lp);
}

size_t kb_locked_pool_held_bytes(const kb_locked_pool_t *lp) {
  return lp->count * lp->stride;
}
