/* Baselines for the pool suite: GlusterFS's memory pool before the
 * per-thread design (libglusterfs mem-pool.c, 3.x), with one lock per pool
 * taken on every get and put: a pthread mutex, or a pthread spinlock (what
 * GlusterFS used where the platform had one). Written for comparison only. */
#ifndef KEEL_BENCH_BASELINE_LOCKED_POOLS_H
#define KEEL_BENCH_BASELINE_LOCKED_POOLS_H

#include <stddef.h>

typedef struct kb_locked_pool kb_locked_pool_t;

typedef enum kb_lock_kind { KB_LOCK_MUTEX, KB_LOCK_SPIN } kb_lock_kind_t;

/* A pool of obj_size-byte objects with `count` preallocated in one arena;
 * NULL if out of memory. */
kb_locked_pool_t *kb_locked_pool_create(size_t obj_size, size_t count, kb_lock_kind_t kind);
/* An object from the arena's free list, or from malloc once it is empty. */
void *kb_locked_pool_alloc(kb_locked_pool_t *lp);
/* Back to the free list (arena objects) or to free() (overflow objects). */
void kb_locked_pool_free(kb_locked_pool_t *lp, void *obj);
/* Frees the arena; every object must have been returned. */
void kb_locked_pool_destroy(kb_locked_pool_t *lp);
/* Bytes the pool holds whether used or not: the arena (never given back). */
size_t kb_locked_pool_held_bytes(const kb_locked_pool_t *lp);

#endif
