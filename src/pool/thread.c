/* Threads come and go: sub-pool creation on a thread's first use of a pool,
 * and release at thread exit.
 *
 * A thread's slots map pool ids to its sub-pools; the first 32 are the
 * exported TLS array keel_pool_slots_v2 (the inline fast paths of keel/pool.h
 * read it), so most programs never allocate an array. At thread exit (a
 * base/tls.h hook, armed on first use, so no pthread key per pool) every
 * sub-pool is unlinked and its cached objects go straight back to the heap:
 * the heap's own cross-thread free path is the orphan list, and an exiting
 * thread's cache is bounded by what it freed since the last sweep.
 */
#include <errno.h>
#include <string.h>

#include "base/die.h"
#include "pool_impl.h"

KEEL_TLS pool_tls_t _keel_pool_tls;
/* Exported: keel/pool.h declares it for inline callers. The default TLS
 * model keeps libkeel.so loadable by dlopen (base/tls.h); a PIE program's
 * accesses are initial-exec anyway. */
KEEL_API _Thread_local struct keel_pool_sub_fast *keel_pool_slots_v2[KEEL_POOL_FAST_SLOTS];

/* Concatenates sp's lists into one; the caller owns sp outright. */
static pool_hdr_t *pool_sub_take_all(pool_sub_t *sp, size_t *n) {
  pool_hdr_t *all = sp->f.cold, **tail = &all;
  size_t k = 0;
  while (*tail != NULL) {
    tail = &(*tail)->next;
    k++;
  }
  *tail = sp->f.hot;
  for (pool_hdr_t *h = sp->f.hot; h != NULL; h = h->next) k++;
  sp->f.hot = sp->f.cold = NULL;
  *n = k;
  return all;
}

void __keel_pool_sub_retire(pool_sub_t *sp, pool_hdr_t **list, size_t *n) {
  keel_pool_t *p = sp->pool;
  cds_list_del(&sp->link);
  p->gone_hot += keel_load_relaxed(&sp->f.hot_hits);
  p->gone_cold += keel_load_relaxed(&sp->f.cold_hits);
  p->gone_heap += keel_load_relaxed(&sp->f.heap_allocs);
  p->gone_frees += keel_load_relaxed(&sp->f.frees);
  pool_tls_t *t = sp->owner;
  KEEL_ASSERT(*pool_slot(t, p->f.id) == &sp->f);
  *pool_slot(t, p->f.id) = NULL;
  *list = pool_sub_take_all(sp, n);
  pthread_mutex_destroy(&sp->lock);
  keel_free(sp);
}

/* The exit hook: retires every sub-pool of the exiting thread. */
static void pool_thread_exit(void *arg) {
  pool_tls_t *t = arg;
  _keel_pool_registry_lock();
  uint32_t n = t->n_slots > KEEL_POOL_FAST_SLOTS ? t->n_slots : KEEL_POOL_FAST_SLOTS;
  for (uint32_t id = 0; id < n; id++) {
    pool_sub_t *sp = pool_sub_of(*pool_slot(t, id));
    if (sp == NULL) continue;
    keel_pool_t *p = sp->pool;
    pool_hdr_t *list;
    size_t n;
    pthread_mutex_lock(&p->lock);
    __keel_pool_sub_retire(sp, &list, &n);
    pthread_mutex_unlock(&p->lock);
    /* Under the registry lock p cannot be destroyed meanwhile; freeing is
     * quick next to the lock's other users (sweeps hold it far longer). */
    if (list != NULL) _keel_pool_release_list(p, list, n, "keel_pool (thread exit)");
  }
  keel_free(t->slots);
  t->slots = NULL;
  t->n_slots = 0;
  t->hook_armed = false;
  _keel_pool_registry_unlock();
}

/* Makes room for slot `id`. Caller holds the registry lock (destroy reads
 * other threads' slot arrays under it). */
static int __pool_slots_grow(pool_tls_t *t, uint32_t id) {
  if (id < KEEL_POOL_FAST_SLOTS || id < t->n_slots) return 0;
  uint32_t n = t->n_slots ? t->n_slots : 2 * KEEL_POOL_FAST_SLOTS;
  while (n <= id) n *= 2;
  struct keel_pool_sub_fast **s = keel_calloc(n, sizeof(*s));
  if (s == NULL) return KEEL_ENOMEM;
  if (t->slots != NULL) memcpy(s, t->slots, t->n_slots * sizeof(*s));
  keel_free(t->slots);
  t->slots = s;
  t->n_slots = n;
  return 0;
}

pool_sub_t *_keel_pool_sub_attach(keel_pool_t *p) {
  pool_tls_t *t = &_keel_pool_tls;
  pool_sub_t *sp = keel_aligned_alloc(KEEL_CACHE_LINE, sizeof(*sp));
  if (sp == NULL) goto nomem;
  memset(sp, 0, sizeof(*sp));
  pthread_mutex_init(&sp->lock, NULL);
  sp->pool = p;
  sp->owner = t;
  _keel_pool_registry_lock();
  t->fast = keel_pool_slots_v2; /* before any slot is set or the exit hook runs */
  if (__pool_slots_grow(t, p->f.id) != 0) {
    _keel_pool_registry_unlock();
    pthread_mutex_destroy(&sp->lock);
    keel_free(sp);
    goto nomem;
  }
  if (!t->hook_armed) {
    t->hook.fn = pool_thread_exit;
    t->hook.arg = t;
    if (_keel_thread_hook_arm(&t->hook) == 0)
      t->hook_armed = true;
    else
      _keel_warn("keel_pool: no thread-exit hook; this thread's pool caches leak at exit");
  }
  pthread_mutex_lock(&p->lock);
  cds_list_add_tail(&sp->link, &p->subs);
  pthread_mutex_unlock(&p->lock);
  *pool_slot(t, p->f.id) = &sp->f;
  _keel_pool_registry_unlock();
  return sp;
nomem:
  errno = ENOMEM;
  return NULL;
}
