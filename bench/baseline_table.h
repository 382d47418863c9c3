/* The tables the `table` suite measures, behind one small interface: keel's
 * (suite_table.c) and the baselines (baseline_table.c): fixed hash tables of
 * 1,024 and 16,384 list buckets and of 1,024 red-black-tree buckets, a mutex
 * per bucket (the Linux DLM before and after its 2009 patches), and raw
 * liburcu rculfhash configured as keel configures it. */
#ifndef KEEL_BENCH_BASELINE_TABLE_H
#define KEEL_BENCH_BASELINE_TABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct tb_impl {
  const char *name;
  size_t node_size;                 /* bytes per entry in the caller's slab (node and key) */
  void *(*create)(size_t expected); /* a table for about `expected` entries */
  void (*node_init)(void *node, uint64_t key);
  void (*load)(void *t, void *node);    /* build phase: a key known to be absent */
  int (*insert)(void *t, void *node);   /* 0, or -EEXIST (duplicate check included) */
  int (*lookup)(void *t, uint64_t key); /* 1 if present (the entry is read), 0 if not */
  int (*remove)(void *t, uint64_t key); /* 0, or -ENOENT */
  void (*thread_start)(void);           /* per worker thread (RCU registration), may be NULL */
  void (*thread_end)(void);
} tb_impl_t;

/* The baselines, by name: "list-1024", "list-16k", "rbtree-1024", "rculfhash",
 * "rculfhash-40" (rculfhash with its node padded to keel's 40 bytes). */
const tb_impl_t *tb_baseline(const char *name);

/* The bucket hash every table uses (MurmurHash3's 64-bit finaliser). */
static inline uint64_t tb_hash(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

#endif /* KEEL_BENCH_BASELINE_TABLE_H */
