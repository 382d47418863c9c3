/* The lock suite's peers: keel's lock logic over fixed-size hash tables, as
 * the Linux DLM kept its resources (see baseline_lock_tables.c). */
#ifndef KEEL_BENCH_BASELINE_LOCK_TABLES_H
#define KEEL_BENCH_BASELINE_LOCK_TABLES_H

#include <keel/lock.h>
#include <stddef.h>

typedef enum bl_kind { BL_LIST, BL_RBTREE } bl_kind_t;
typedef struct bl_table bl_table_t;

/* A fixed table of nbuckets buckets (a mutex each) holding chains (BL_LIST)
 * or red-black trees (BL_RBTREE); unused resources stay cached until there
 * are more than cache_max resources, as in a keel lockspace. */
bl_table_t *bl_create(bl_kind_t kind, size_t nbuckets, size_t cache_max);
void bl_destroy(bl_table_t *t);
/* keel_lock / keel_unlock, blocking (no AST), over this table. */
int bl_lock(bl_table_t *t, const void *name, size_t len, int mode, unsigned flags,
            keel_lksb_t *lksb);
int bl_unlock(bl_table_t *t, keel_lksb_t *lksb);
size_t bl_count(bl_table_t *t);

#endif
