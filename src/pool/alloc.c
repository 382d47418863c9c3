/* keel_pool_alloc, keel_pool_zalloc, keel_pool_free: the per-thread fast
 * paths and their slow (`_generic`) halves.
 *
 * Fast path, alloc: TLS slot lookup, busy = 1, load req, pop hot, busy = 0,
 * write the tag: about a dozen instructions, no RMW, no lock. Free is the
 * mirror image plus the tag check. Everything else (first use by a thread, an
 * empty hot list, a pending sweep request, hooks, debug builds, misuse) goes
 * to the generic functions below. A program built with KEEL_POOL_INLINE runs
 * the same pop and push (keel/pool.h) inline and calls these functions for
 * the rest.
 */
#include <string.h>

#include "base/die.h"
#include "base/options.h"
#include "heap/shared.h"
#include "pool_impl.h"
#include "track.h"

/* Pops from the calling thread's hot list, or NULL for the generic path.
 * `heavy` is a constant false on the plain fast path. The pop itself is
 * keel/pool.h's, which the inline fast paths use too. */
KEEL_INLINE pool_hdr_t *pool_pop_fast(keel_pool_t *p, bool heavy) {
  pool_sub_t *sp = pool_sub_get(p);
  if (keel_unlikely(sp == NULL)) return NULL;
  return keel_pool_inline_pop(&sp->f, heavy);
}

/* Takes an object from sp's lists under sp->lock, doing any pending sweep
 * request first (its objects go to the heap after the lock is dropped). */
static pool_hdr_t *pool_pop_locked(keel_pool_t *p, pool_sub_t *sp) {
  size_t n = 0;
  pthread_mutex_lock(&sp->lock);
  uint32_t req = keel_load_relaxed(&sp->f.req);
  pool_hdr_t *gone = req != POOL_REQ_NONE ? __keel_pool_sub_service(sp, req, &n) : NULL;
  pool_hdr_t *h = sp->f.hot;
  if (h != NULL) {
    sp->f.hot = h->next;
    keel_pool_inline_count(&sp->f.hot_hits);
  } else if ((h = sp->f.cold) != NULL) {
    sp->f.cold = h->next;
    keel_pool_inline_count(&sp->f.cold_hits);
  }
  keel_pool_inline_leave(&sp->f);
  pthread_mutex_unlock(&sp->lock);
  if (gone != NULL) _keel_pool_release_list(p, gone, n, "keel_pool_alloc");
  return h;
}

/* A new object's block. By default from the heap's shared heaps
 * (heap/shared.h), not the calling thread's: a thread heap's pages go back
 * to the OS only when their owner runs, so the objects a sweep frees for a
 * thread that stays idle (blocked for hours, as in a server between bursts)
 * would keep its pages resident for good. The shared heaps cost a mutex per
 * heap call, about 20 ns uncontended where a thread heap's malloc takes 3;
 * heap calls are under 1% of a pool's allocations in steady use (0.16% in
 * `keel-bench pool --case gluster`). A pool whose allocating threads rarely
 * free (pure producer/consumer) calls the heap on nearly every allocation:
 * pool_shared_heap=0 keeps those calls on the thread heap. */
static void *pool_heap_alloc(keel_pool_t *p) {
  if (_keel_option(KEEL_OPT_pool_shared_heap)) return _keel_malloc_shared(p->block_size, p->align);
  return p->align <= 16 ? keel_malloc(p->block_size) : keel_aligned_alloc(p->align, p->block_size);
}

static KEEL_NOINLINE void *pool_alloc_generic(keel_pool_t *p, bool zero) {
  static const char *const call[2] = {"keel_pool_alloc", "keel_pool_zalloc"};
  if (keel_unlikely(p == NULL)) _keel_pool_check_live(p, call[zero]); /* dies: "NULL pool" */
  /* Pools with hooks, debug checks or the fallback fence still pop without
   * a lock; only the per-object extras below are added. */
  pool_hdr_t *h = p->f.flags != 0 ? pool_pop_fast(p, p->f.flags & POOL_F_FENCE) : NULL;
  void *obj;
  if (h != NULL) {
    obj = h + 1;
    _keel_pool_obj_reused(p, obj, call[zero]);
  } else {
    _keel_pool_check_live(p, call[zero]);
    pool_sub_t *sp = pool_sub_get(p);
    if (sp == NULL && (sp = _keel_pool_sub_attach(p)) == NULL) return NULL;
    if ((h = pool_pop_locked(p, sp)) != NULL) {
      obj = h + 1;
      _keel_pool_obj_reused(p, obj, call[zero]);
    } else {
      void *block = pool_heap_alloc(p);
      if (block == NULL) {
        errno = ENOMEM;
        return NULL;
      }
      keel_pool_inline_count(&sp->f.heap_allocs);
      _keel_pool_sweeper_ensure(); /* cheap when running; restarts it in a forked child */
      KEEL_ASSERT(((uintptr_t)block & (p->hdr_size - 1)) == 0);
      obj = (char *)block + p->hdr_size;
      h = pool_hdr(obj);
      _keel_pool_obj_fresh(p, obj);
    }
  }
  h->tag = p->f.tag;
  if (zero) memset(obj, 0, p->obj_size);
  if (p->ops.init != NULL) p->ops.init(obj, p->ops.arg);
  return obj;
}

/* Parenthesised names: the definitions stand even where keel/pool.h's
 * KEEL_POOL_INLINE macros are in force.
 *
 * A NULL pool is tested for before the first load through it, so that it
 * reaches the generic path and dies there naming the call ("NULL pool", as
 * keel_pool_stats and keel_pool_destroy say) rather than with a SIGSEGV.
 * Every fast-path load goes through the pool (its flags, its id for the
 * slot), so no ordering of them can stand in for the test: it is one
 * compare and a never-taken branch. */
void *(keel_pool_alloc)(keel_pool_t *p) {
  if (keel_likely(p != NULL && p->f.flags == 0)) {
    pool_hdr_t *h = pool_pop_fast(p, false);
    if (keel_likely(h != NULL)) {
      h->tag = p->f.tag;
      return h + 1;
    }
  }
  return pool_alloc_generic(p, false);
}

void *keel_pool_zalloc(keel_pool_t *p) {
  if (keel_likely(p != NULL && p->f.flags == 0)) {
    pool_hdr_t *h = pool_pop_fast(p, false);
    if (keel_likely(h != NULL)) {
      h->tag = p->f.tag;
      return memset(h + 1, 0, p->obj_size);
    }
  }
  return pool_alloc_generic(p, true);
}

/* A header's link, read where the heap may have freed the block (ASan has
 * it poisoned then; the block is still mapped: the heap vouched for it). */
POOL_ASAN_UNCHECKED static uintptr_t pool_hdr_link(const pool_hdr_t *h) {
  return (uintptr_t)h->next;
}

/* A header's tag, read the same way: in a segment the heap has retained
 * after the block's last free, ASan has the whole segment poisoned. */
POOL_ASAN_UNCHECKED static uintptr_t pool_hdr_tag(const pool_hdr_t *h) {
  return h->tag;
}

/* The misuse checks, in the order that gives the most precise message.
 * The header of an object that is not at a page start lies on obj's own
 * page, so it can be read at once: a block carved from a heap page stays
 * readable (heap/shared.h: the exceptions are there), so even an object
 * freed twice after its memory went back to the OS reads as zeros there
 * (a tag no pool has: this message). At a page start (the fast paths send
 * every such object here) the header is read only once the heap confirms
 * that the block it would be in exists: else a pointer to the start of a
 * mapping would die of SIGSEGV instead of this message. The same for every
 * object of a pool whose blocks are mappings of their own (POOL_F_MAPPED).
 * A tag that does not match costs a lookup in the heap's segment map (an
 * interior pointer is no block start). */
static void pool_free_check(keel_pool_t *p, void *obj) {
  _keel_pool_check_live(p, "keel_pool_free");
  pool_hdr_t *h = pool_hdr(obj);
  bool mapped = p->f.flags & POOL_F_MAPPED;
  if (keel_likely(!mapped && ((uintptr_t)obj & 4095) != 0 && pool_hdr_tag(h) == p->f.tag)) return;
  void *block = (char *)obj - p->hdr_size;
  if (((uintptr_t)obj & (p->hdr_size - 1)) != 0 || !_keel_heap_is_block(block)) {
    /* Not a block of the heap now: a foreign pointer, or an object freed
     * twice whose memory went back to the OS after its first free. */
    if (mapped)
      keel_die("keel_pool_free", "%p is not a live object of pool '%s' (freed twice?)", obj,
               p->name);
    keel_die("keel_pool_free",
             "%p does not belong to pool '%s' (no block of keel's heap: a foreign pointer, or "
             "one freed twice after its memory went back to the OS)",
             obj, p->name);
  }
  uintptr_t tag = pool_hdr_tag(h);
  if (tag == p->f.tag) return;
  if (tag == (p->f.tag | POOL_TAG_FREE) || pool_hdr_link(h) == (p->f.tag | POOL_TAG_RELEASED))
    keel_die("keel_pool_free", "double free of %p in pool '%s'", obj, p->name);
  keel_die("keel_pool_free", "%p does not belong to pool '%s'", obj, p->name);
}

static KEEL_NOINLINE void pool_free_generic(keel_pool_t *p, void *obj) {
  pool_free_check(p, obj);
  if (p->ops.fini != NULL) p->ops.fini(obj, p->ops.arg);
  pool_hdr_t *h = pool_hdr(obj);
  h->tag = p->f.tag | POOL_TAG_FREE;
  _keel_pool_obj_cached(p, obj);
  pool_sub_t *sp = pool_sub_get(p);
  if (sp == NULL && (sp = _keel_pool_sub_attach(p)) == NULL) {
    /* No memory for a sub-pool: the object goes straight back to the heap,
     * counted as a free with the exited threads' counters (there is no
     * sub-pool to hold it), or the pool would count it live for ever and
     * keel_pool_destroy would refuse with KEEL_EBUSY. */
    pthread_mutex_lock(&p->lock);
    p->gone_frees++;
    pthread_mutex_unlock(&p->lock);
    h->next = NULL;
    _keel_pool_release_list(p, h, 1, "keel_pool_free");
    return;
  }
  if (keel_pool_inline_push(&sp->f, h, p->f.flags & POOL_F_FENCE)) return; /* false: req set */
  size_t n = 0;
  pthread_mutex_lock(&sp->lock);
  uint32_t req = keel_load_relaxed(&sp->f.req);
  pool_hdr_t *gone = req != POOL_REQ_NONE ? __keel_pool_sub_service(sp, req, &n) : NULL;
  h->next = sp->f.hot;
  sp->f.hot = h;
  keel_pool_inline_count(&sp->f.frees);
  keel_pool_inline_leave(&sp->f);
  pthread_mutex_unlock(&sp->lock);
  if (gone != NULL) _keel_pool_release_list(p, gone, n, "keel_pool_free");
}

void(keel_pool_free)(keel_pool_t *p, void *obj) {
  if (keel_unlikely(obj == NULL)) return;
  pool_hdr_t *h = pool_hdr(obj);
  pool_sub_t *sp = keel_likely(p != NULL) ? pool_sub_get(p) : NULL; /* NULL: generic, dies */
  /* At a page start: the generic path checks the block before the header. */
  if (keel_likely(sp != NULL && p->f.flags == 0 && ((uintptr_t)obj & 4095) != 0 &&
                  h->tag == p->f.tag)) { /* flags first: POOL_F_MAPPED's header is not read */
    h->tag = p->f.tag | POOL_TAG_FREE;
    if (keel_likely(keel_pool_inline_push(&sp->f, h, false))) return;
    h->tag = p->f.tag; /* let the generic path see it as live again */
  }
  pool_free_generic(p, obj);
}
