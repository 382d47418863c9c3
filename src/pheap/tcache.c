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
 *
 * A thread using more pools than slots evicts one cache (retired: blocks
 * back to runs, then freed). A cache held across calls is pinned and never
 * evicted: the only holder is an open transaction (tx.c keeps tx.tc from
 * begin to end), and a thread has at most one, so with PH_TC_SLOTS >= 2
 * some slot is always unpinned.
 *
 * Fork: a child inherits the parent's pools (the MAP_SHARED mapping, the
 * flock'd file description) and copies of their volatile state, while the
 * parent goes on using them. Any change the child made (an allocation, a
 * rollback, close's checkpoint raising the watermark past the parent's logs
 * in flight) would corrupt the parent's pool, and the locks the parent's
 * other threads held at fork stay held in the child. So the child handler
 * bumps _keel_ph_fork_gen: calls that would change such a pool die naming
 * it, reads work, and close forgets the child's copy without touching the
 * file or taking a pool lock. registry_lock is held across fork, so the
 * child finds it free.
 */
#include <stdlib.h>

#include "base/die.h"
#include "base/tls.h"
#include "pheap/pheap_int.h"

#define PH_TC_SLOTS 4

/* Empty: tc == NULL. Stale: id no longer live (tc freed by close, never
 * dereferenced). pins > 0: tc is held across calls and must stay. */
typedef struct tc_slot {
  keel_pheap_t *ph;
  uint64_t id;
  ph_tcache_t *tc;
  unsigned pins; /* open transactions on this cache: 0 or 1 */
} tc_slot_t;

/* One transaction per thread pins at most one slot; the rest must leave
 * one to evict. */
_Static_assert(PH_TC_SLOTS >= 2, "a thread's pinned slot must leave one to evict");

static __thread tc_slot_t tc_slots[PH_TC_SLOTS];
static __thread keel_thread_hook_t tc_hook;
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
keel_atomic(unsigned) _keel_ph_fork_gen;

static void atfork_prepare(void) {
  pthread_mutex_lock(&registry_lock);
}
static void atfork_parent(void) {
  pthread_mutex_unlock(&registry_lock);
}
static void atfork_child(void) {
  pthread_mutex_unlock(&registry_lock);
  keel_store_relaxed(&_keel_ph_fork_gen, keel_load_relaxed(&_keel_ph_fork_gen) + 1);
  _keel_ph_flying = 0; /* the parent's logs (forked from a deferrer) are not the child's */
}
static void atfork_register(void) {
  if (pthread_atfork(atfork_prepare, atfork_parent, atfork_child) != 0)
    keel_die("keel_pheap", "pthread_atfork failed");
}

void _keel_ph_forked_die(keel_pheap_t *ph, const char *call) {
  keel_die(call,
           "%s: used in a forked child, but the pool is the parent's (a child may read it "
           "and close it; to change it, close it and open it again once the parent has "
           "closed it)",
           ph->path);
}

void _keel_ph_tcache_return(keel_pheap_t *ph, ph_tcache_t *tc) KEEL_HIDDEN;

/* Detaches tc from its (live) pool: blocks back to runs, counters kept. */
static void tc_retire(ph_tcache_t *tc) {
  keel_pheap_t *ph = tc->ph;
  _keel_ph_tcache_return(ph, tc);
  /* Counted in the dead totals and off the list in one step under the
   * lock keel_pheap_stats reads both under, so it sees them once. */
  pthread_mutex_lock(&ph->lock);
  keel_fetch_add_relaxed(&ph->dead_flushes, tc->flushes);
  keel_fetch_add_relaxed(&ph->dead_barriers, tc->barriers);
  keel_fetch_add_relaxed(&ph->dead_tx_commits, tc->tx_commits);
  keel_fetch_add_relaxed(&ph->dead_tx_aborts, tc->tx_aborts);
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
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, atfork_register);
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
  /* A parent's pool in a forked child: its runs and lock are not ours. */
  if (s->tc != NULL && id_live(s->id) && !_keel_ph_forked(s->ph)) tc_retire(s->tc);
  pthread_mutex_unlock(&registry_lock);
  *s = (tc_slot_t){NULL, 0, NULL, 0};
}

static void tc_thread_exit(void *arg) {
  (void)arg;
  for (unsigned i = 0; i < PH_TC_SLOTS; i++)
    if (tc_slots[i].tc) tc_slot_release(&tc_slots[i]);
}

/* The slot for a new cache: an empty or stale one, else the first unpinned
 * one from id % PH_TC_SLOTS (a thread cycling through more pools than slots
 * spreads its evictions). registry_lock held: a live id's cache cannot be
 * freed by close while we read or retire it. */
static tc_slot_t *__tc_slot_pick(uint64_t id) {
  for (unsigned i = 0; i < PH_TC_SLOTS; i++)
    if (tc_slots[i].tc == NULL || !id_live(tc_slots[i].id)) return &tc_slots[i];
  for (unsigned i = 0; i < PH_TC_SLOTS; i++) {
    tc_slot_t *s = &tc_slots[(id + i) % PH_TC_SLOTS];
    if (s->pins == 0) return s;
  }
  return NULL;
}

static KEEL_NOINLINE ph_tcache_t *tcache_slow(keel_pheap_t *ph) {
  pthread_mutex_lock(&registry_lock);
  tc_slot_t *s = __tc_slot_pick(ph->id);
  if (s == NULL) keel_die("keel_pheap", "every thread cache slot of this thread is pinned");
  /* Evict; a parent's pool in a forked child is only forgotten here (its
   * runs and lock are not ours; close frees the cache). */
  if (s->tc != NULL && id_live(s->id) && !_keel_ph_forked(s->ph)) tc_retire(s->tc);
  *s = (tc_slot_t){NULL, 0, NULL, 0};
  pthread_mutex_unlock(&registry_lock);
  ph_tcache_t *tc = calloc(1, sizeof *tc + _keel_ph_nclasses * sizeof tc->c[0]);
  if (tc == NULL) return NULL;
  tc->ph = ph;
  tc->id = ph->id;
  static keel_atomic(unsigned) lane_rr;
  tc->lane_hint = keel_fetch_add_relaxed(&lane_rr, 1) % PH_NLANES;
  tc->arena = keel_fetch_add_relaxed(&ph->arena_rr, 1) % ph->narenas;
  pthread_mutex_lock(&ph->lock);
  tc->next = ph->caches;
  ph->caches = tc;
  pthread_mutex_unlock(&ph->lock);
  tc_hook.fn = tc_thread_exit;
  _keel_thread_hook_arm(&tc_hook);
  *s = (tc_slot_t){ph, ph->id, tc, 0};
  return tc;
}

ph_tcache_t *_keel_ph_tcache(keel_pheap_t *ph) {
  PH_NOT_FORKED(ph, "keel_pheap");
  for (unsigned i = 0; i < PH_TC_SLOTS; i++)
    if (tc_slots[i].ph == ph && tc_slots[i].id == ph->id) return tc_slots[i].tc;
  return tcache_slow(ph);
}

/* The slot holding tc; NULL only if its pool was closed since (misuse: a
 * transaction open across close). Compares pointers, never reads tc. */
static tc_slot_t *tc_slot_of(const ph_tcache_t *tc) {
  for (unsigned i = 0; i < PH_TC_SLOTS; i++)
    if (tc_slots[i].tc == tc) return &tc_slots[i];
  return NULL;
}

ph_tcache_t *_keel_ph_tcache_pin(keel_pheap_t *ph) {
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (tc != NULL) tc_slot_of(tc)->pins++; /* just found or installed: in a slot */
  return tc;
}

void _keel_ph_tcache_unpin(ph_tcache_t *tc) {
  tc_slot_t *s = tc_slot_of(tc);
  KEEL_ASSERT(s == NULL || s->pins > 0);
  if (s != NULL && s->pins > 0) s->pins--;
}

static void tcaches_free(keel_pheap_t *ph, bool forked) {
  pthread_mutex_lock(&registry_lock);
  for (size_t i = 0; i < nlive; i++)
    if (live_ids[i] == ph->id) live_ids[i] = live_ids[--nlive];
  if (nlive == 0) {
    free(live_ids); /* no leak report at exit once every pool is closed */
    live_ids = NULL;
    live_cap = 0;
  }
  if (!forked) pthread_mutex_lock(&ph->lock);
  ph_tcache_t *tc = ph->caches;
  ph->caches = NULL;
  if (!forked) pthread_mutex_unlock(&ph->lock);
  for (unsigned i = 0; i < PH_TC_SLOTS; i++)
    if (tc_slots[i].id == ph->id) tc_slots[i] = (tc_slot_t){NULL, 0, NULL, 0};
  while (tc) {
    ph_tcache_t *next = tc->next;
    free(tc->sim_lines);
    free(tc);
    tc = next;
  }
  pthread_mutex_unlock(&registry_lock);
}

void _keel_ph_tcaches_destroy(keel_pheap_t *ph) {
  tcaches_free(ph, false);
}

void _keel_ph_tcaches_forget(keel_pheap_t *ph) {
  tcaches_free(ph, true);
}
