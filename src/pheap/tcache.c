/* pheap thread caches: per (thread, pool) stacks of free blocks per class,
 * plus the thread's flush/barrier counters and msync range set.
 *
 * Lookup is a scan of PH_TC_SLOTS thread-local slots comparing (pool, id):
 * no lock, no allocation once the cache exists. Pool ids are never reused,
 * so a slot left by a closed pool is recognised as stale without touching
 * the freed cache. A thread-exit hook hands cached blocks back to their runs
 * (under the registry lock, so it cannot race with close); close frees every
 * cache of the pool (the blocks they held are free on media anyway, and the
 * next open rebuilds everything from the bitmaps).
 */
#include <stdlib.h>

#include "base/die.h"
#include "base/tls.h"
#include "pheap/pheap_int.h"

#define PH_TC_SLOTS 4

typedef struct tc_slot {
  keel_pheap_t *ph;
  uint64_t id;
  ph_tcache_t *tc;
} tc_slot_t;

static __thread tc_slot_t tc_slots[PH_TC_SLOTS];
static __thread keel_thread_hook_t tc_hook;
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;

void _keel_ph_tcache_return(keel_pheap_t *ph, ph_tcache_t *tc) KEEL_HIDDEN;

/* Detaches tc from its (live) pool: blocks back to runs, counters kept. */
static void tc_retire(ph_tcache_t *tc) {
  keel_pheap_t *ph = tc->ph;
  _keel_ph_tcache_return(ph, tc);
  keel_fetch_add_relaxed(&ph->dead_flushes, tc->flushes);
  keel_fetch_add_relaxed(&ph->dead_barriers, tc->barriers);
  pthread_mutex_lock(&ph->lock);
  for (ph_tcache_t **p = &ph->caches; *p; p = &(*p)->next)
    if (*p == tc) {
      *p = tc->next;
      break;
    }
  pthread_mutex_unlock(&ph->lock);
  free(tc->sim_lines);
  free(tc);
}

/* Ids of open pools (registry_lock). A slot whose id is not here belongs to
 * a closed pool: its cache memory is gone and must not be touched. */
static uint64_t *live_ids;
static size_t nlive, live_cap;

static bool id_live(uint64_t id) {
  for (size_t i = 0; i < nlive; i++)
    if (live_ids[i] == id) return true;
  return false;
}

int _keel_ph_registry_add(keel_pheap_t *ph) KEEL_HIDDEN;
int _keel_ph_registry_add(keel_pheap_t *ph) {
  pthread_mutex_lock(&registry_lock);
  if (nlive == live_cap) {
    size_t cap = live_cap ? live_cap * 2 : 8;
    uint64_t *n = realloc(live_ids, cap * sizeof *n);
    if (n == NULL) {
      pthread_mutex_unlock(&registry_lock);
      return KEEL_ENOMEM;
    }
    live_ids = n;
    live_cap = cap;
  }
  live_ids[nlive++] = ph->id;
  pthread_mutex_unlock(&registry_lock);
  return 0;
}

static void tc_slot_release(tc_slot_t *s) {
  pthread_mutex_lock(&registry_lock);
  if (s->tc != NULL && id_live(s->id)) tc_retire(s->tc);
  pthread_mutex_unlock(&registry_lock);
  *s = (tc_slot_t){NULL, 0, NULL};
}

static void tc_thread_exit(void *arg) {
  (void)arg;
  for (unsigned i = 0; i < PH_TC_SLOTS; i++)
    if (tc_slots[i].tc) tc_slot_release(&tc_slots[i]);
}

static KEEL_NOINLINE ph_tcache_t *tcache_slow(keel_pheap_t *ph) {
  tc_slot_t *s = NULL;
  pthread_mutex_lock(&registry_lock);
  for (unsigned i = 0; i < PH_TC_SLOTS && s == NULL; i++)
    if (tc_slots[i].tc == NULL || !id_live(tc_slots[i].id)) s = &tc_slots[i];
  pthread_mutex_unlock(&registry_lock);
  if (s == NULL) s = &tc_slots[ph->id % PH_TC_SLOTS]; /* evict one */
  if (s->tc) tc_slot_release(s);
  ph_tcache_t *tc = calloc(1, sizeof *tc + _keel_ph_nclasses * sizeof tc->c[0]);
  if (tc == NULL) return NULL;
  tc->ph = ph;
  tc->id = ph->id;
  static keel_atomic(unsigned) lane_rr;
  tc->lane_hint = keel_fetch_add_relaxed(&lane_rr, 1) % PH_NLANES;
  pthread_mutex_lock(&ph->lock);
  tc->next = ph->caches;
  ph->caches = tc;
  pthread_mutex_unlock(&ph->lock);
  tc_hook.fn = tc_thread_exit;
  _keel_thread_hook_arm(&tc_hook);
  *s = (tc_slot_t){ph, ph->id, tc};
  return tc;
}

ph_tcache_t *_keel_ph_tcache(keel_pheap_t *ph) {
  for (unsigned i = 0; i < PH_TC_SLOTS; i++)
    if (tc_slots[i].ph == ph && tc_slots[i].id == ph->id) return tc_slots[i].tc;
  return tcache_slow(ph);
}

void _keel_ph_tcaches_destroy(keel_pheap_t *ph) {
  pthread_mutex_lock(&registry_lock);
  for (size_t i = 0; i < nlive; i++)
    if (live_ids[i] == ph->id) live_ids[i] = live_ids[--nlive];
  if (nlive == 0) {
    free(live_ids); /* no leak report at exit once every pool is closed */
    live_ids = NULL;
    live_cap = 0;
  }
  pthread_mutex_lock(&ph->lock);
  ph_tcache_t *tc = ph->caches;
  ph->caches = NULL;
  pthread_mutex_unlock(&ph->lock);
  for (unsigned i = 0; i < PH_TC_SLOTS; i++)
    if (tc_slots[i].id == ph->id) tc_slots[i] = (tc_slot_t){NULL, 0, NULL};
  while (tc) {
    ph_tcache_t *next = tc->next;
    free(tc->sim_lines);
    free(tc);
    tc = next;
  }
  pthread_mutex_unlock(&registry_lock);
}
