/* Thread heaps: the slow paths of malloc and free, cross-thread frees, thread
 * exit, and collection.
 *
 * Cross-thread free (no lock): a block freed by a thread that does not own
 * its page is pushed on the page's `thread_free` with one CAS; the owner
 * takes the whole list with one CAS when the page's free list runs dry.
 *
 * Full pages: a page with no free block leaves its heap's queue (so the
 * allocation slow path never scans it) and its thread_free state becomes
 * USE_DELAYED. The next remote free of one of its blocks goes instead to the
 * owner heap's `delayed` list (one CAS), which tells the owner the page has
 * room again; later remote frees go to the page as usual. The owner drains
 * `delayed` in its slow path and puts such pages back in its queue.
 * (mimalloc's delayed free, which this follows.)
 *
 * Owners that stop allocating: full pages of a heap whose thread is idle are
 * still returned. The purge thread holds the heap as a collector (see the
 * owner/collector exclusion below) and drains its `delayed` list itself:
 * this is safe because an owner's fast paths never touch a full page (its
 * flags send them to the slow path, which excludes the collector). When all
 * of a full page's blocks are back it is freed to its
 * segment and purged after the delay. This is what keeps producer/consumer
 * servers from holding memory their consumers freed (mimalloc #333, #1364).
 * Pages still in an idle owner's queue (not full) keep their remote frees
 * until the owner allocates, frees, or exits: at most the pages it was
 * allocating from when it went idle.
 *
 * Thread exit: the exit hook drains the heap, frees pages whose blocks are
 * all back, and abandons the rest to a global per-class queue (behind 16
 * striped locks, segment.c) that other threads adopt from before taking
 * new pages; the purge thread frees abandoned pages once their last block
 * comes back. The heap struct goes on a small free list for the next
 * thread (beyond 8 it is unmapped), so 10,000 short-lived threads use a
 * handful of heaps and no more pages than the live ones need. What the thread allocates after its hook ran (in a
 * later pthread-key destructor) comes from the shared heaps: a heap made
 * then would never be handed back.
 *
 * Double free: every list of a page (free, local_free, thread_free) links
 * its blocks with links encoded by the page key, so a block on one of them
 * has a first word that decodes into its own segment, which a live block's
 * almost never does (malloc clears it). Both free paths test that word; the
 * owner's slow path confirms by walking the page's lists, a remote freer by
 * the same walk made racily (_keel_page_has_free_block_remote), before it
 * would push the block a second time.
 *
 * Locks: owner slow paths take no lock (the handshake below); collectors
 * and the fork handler take heap->lock; order: registry_lock > heap (lock
 * or handshake) > segment lock > large lock.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <linux/membarrier.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <string.h>

#include "base/clock.h"
#include "base/die.h"
#include "base/futex.h"
#include "base/options.h"
#include "base/os.h"
#include "heap/alloc.h"
#include "heap/internal.h"
#include "heap/shared.h"
#include "heap/track.h"

keel_page_t _keel_empty_page; /* free == NULL: always empty */
keel_heap_t _keel_empty_heap = {.direct = {[0 ... KEEL_CLASS_COUNT_MAX - 1] = &_keel_empty_page}};
KEEL_TLS keel_heap_t *_keel_heap_tls = &_keel_empty_heap;
keel_atomic(size_t) _keel_orphan_frees[KEEL_CLASS_COUNT_MAX];

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static keel_heap_t *heaps_all;  /* every mapped heap */
static keel_heap_t *heaps_free; /* heaps of exited threads, for reuse */
static unsigned heaps_free_n;
/* Exited heaps kept for the next threads; the rest are unmapped, so a burst
 * of threads leaves no heap memory behind (8 KiB each). Unmapping is safe:
 * after abandonment no page points to the heap, no remote freer holds it
 * (abandonment waits out DELAYING), and collectors and statistics only
 * reach heaps through the registry, under registry_lock. */
#define HEAPS_FREE_MAX 8
static keel_atomic(size_t) heaps_active;
static uint64_t heap_seed;

/* ---- owner/collector exclusion ----
 * What needs excluding: the owner's slow paths and a collector draining the
 * owner's full pages (the owner's fast paths never touch those). Collectors
 * are rare (the purge thread, a few times a second, and only for heaps with
 * a delayed list); owner slow paths are not (every page switch, every free
 * into a full page). So the owner's side is made cheap with an asymmetric
 * Dekker handshake: the owner stores `owner_busy` and loads `collector`
 * with only a compiler barrier between them, and the collector, after
 * storing `collector`, issues membarrier(PRIVATE_EXPEDITED), which runs a
 * full fence on every thread of the process before `owner_busy` is read.
 * Either the owner's store came before that fence (the collector sees it
 * and waits) or the owner's load comes after it (the owner sees the
 * collector and waits). The owner pays two plain stores and a load instead
 * of an atomic exchange that would drain its store buffer (full of misses
 * to freed blocks in a churning server): measured 26% of a random-churn
 * run was that exchange.
 *
 * Without membarrier (old kernels, seccomp) and under TSan (which cannot
 * see the ordering membarrier gives) both sides take `lock`, a
 * test-and-set lock. `lock` also serialises collectors among themselves.
 * The mode is chosen once, before the first heap exists. */

static bool asym_ok; /* written before the first heap is published (registry_lock) */

static void asym_init(void) {
#if !defined(KEEL_TSAN)
  asym_ok = syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
#endif
}

/* Waiting sleeps on a futex after a short spin: with hundreds of threads
 * on few cores a spinning (even yielding) waiter steals the time the holder
 * needs — measured: 1.1 s per fork of a process with 64 allocating threads
 * when owners spun on a fork in progress. Lock words: 0 free, 1 held,
 * 2 held with sleepers (Drepper, "Futexes are tricky", mutex 2). */
static void futex_wait(keel_atomic(int) * w, int val) {
  keel_futex_wait(w, (uint32_t)val);
}

static void futex_wake_all(keel_atomic(int) * w) {
  keel_futex_wake(w, INT_MAX);
}

static bool heap_trylock(keel_heap_t *heap) {
  int c = 0;
  /* Acquire: the previous holder's changes to the heap are visible. */
  return keel_load_relaxed(&heap->lock) == 0 && keel_cas_strong_acq_rel(&heap->lock, &c, 1);
}

static void heap_lock(keel_heap_t *heap) {
  for (int i = 0; i < 100; i++) {
    if (heap_trylock(heap)) return;
    keel_cpu_relax();
  }
  while (keel_xchg_acq_rel(&heap->lock, 2) != 0) futex_wait(&heap->lock, 2);
}

static void heap_unlock(keel_heap_t *heap) {
  /* Release: publishes our changes to the next holder. */
  if (keel_xchg_release(&heap->lock, 0) == 2) futex_wake_all(&heap->lock);
}

/* Sleeps until no collector holds the heap (collector: 0, 1, 2 as a lock word). */
static void wait_collector(keel_heap_t *heap) {
  int c = keel_load_acquire(&heap->collector);
  for (int i = 0; c != 0 && i < 100; i++) {
    keel_cpu_relax();
    c = keel_load_acquire(&heap->collector);
  }
  while (c != 0) {
    if (c == 2 || keel_cas_strong_acq_rel(&heap->collector, &c, 2)) {
      futex_wait(&heap->collector, 2);
      c = keel_load_acquire(&heap->collector);
    }
  }
}

/* The owner's side, around every slow path that touches its lists. */
static void owner_enter(keel_heap_t *heap) {
  if (!asym_ok) {
    heap_lock(heap);
    return;
  }
  for (;;) {
    keel_store_relaxed(&heap->owner_busy, 1);
    atomic_signal_fence(memory_order_seq_cst); /* the CPU fence is the collector's membarrier */
    /* Acquire: a finished collector's changes to our pages are visible. */
    if (keel_load_acquire(&heap->collector) == 0) return;
    keel_store_relaxed(&heap->owner_busy, 0);
    wait_collector(heap);
  }
}

static void owner_exit(keel_heap_t *heap) {
  if (!asym_ok) {
    heap_unlock(heap);
    return;
  }
  keel_store_release(&heap->owner_busy, 0); /* publishes our changes to a collector */
}

static void asym_fence(void) {
  /* Cannot fail once registered; if it did, the handshake would be unsound,
   * so say so rather than corrupt a heap. */
  if (syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0) {
    keel_die("heap", "membarrier failed after registration");
  }
}

static void collector_release(keel_heap_t *heap) {
  /* Release: our changes to the owner's pages are visible to it. */
  if (keel_xchg_release(&heap->collector, 0) == 2) futex_wake_all(&heap->collector);
}

/* The collector's side. Without `wait`, gives up on a busy owner. */
static bool collector_enter(keel_heap_t *heap, bool wait) {
  if (wait)
    heap_lock(heap);
  else if (!heap_trylock(heap))
    return false;
  if (!asym_ok) return true;
  keel_store_relaxed(&heap->collector, 1);
  asym_fence();
  /* An owner that is busy is inside a short slow path: spin, then yield
   * (the owner may be preempted; collectors are rare and may wait). */
  for (unsigned spins = 0; keel_load_acquire(&heap->owner_busy) != 0; spins++) {
    if (!wait) {
      collector_release(heap);
      heap_unlock(heap);
      return false;
    }
    if (spins < 100)
      keel_cpu_relax();
    else
      sched_yield();
  }
  return true;
}

static void collector_exit(keel_heap_t *heap) {
  if (asym_ok) collector_release(heap);
  heap_unlock(heap);
}

/* ---- queues (caller holds heap->lock) ---- */

/* ---- thread_free state changes by the owner ---- */

/* Sets the page's delayed-free state, waiting out a remote freer that is in
 * the middle of pushing to the owner's delayed list (a few instructions).
 * Fails (for USE_DELAYED) when blocks are waiting on thread_free: the caller
 * collects them first, since a full page must start with an empty list. */
static bool tf_set_state(keel_page_t *page, unsigned state) {
  uintptr_t w = keel_load_relaxed(&page->thread_free);
  for (unsigned spins = 0;; spins++) {
    if (KEEL_TF_STATE(w) == KEEL_TF_DELAYING) {
      if (spins > 64)
        sched_yield();
      else
        keel_cpu_relax();
      w = keel_load_relaxed(&page->thread_free);
      continue;
    }
    if (state == KEEL_TF_USE_DELAYED && KEEL_TF_PTR(w) != NULL) return false;
    if (KEEL_TF_STATE(w) == state) return true;
    if (keel_cas_weak_acq_rel(&page->thread_free, &w, (w & ~(uintptr_t)3) | state)) return true;
  }
}

/* ---- full pages (caller holds heap->lock) ---- */

static bool __page_to_full(keel_heap_t *heap, keel_page_t *page) {
  if (!tf_set_state(page, KEEL_TF_USE_DELAYED)) return false;
  __keel_page_queue_remove(&heap->queue[page->cls], page);
  if (heap->direct[page->cls] == page) heap->direct[page->cls] = &_keel_empty_page;
  keel_store_relaxed(&page->flags, KEEL_PAGE_IN_FULL);
  __keel_page_queue_push_back(&heap->full, page);
  return true;
}

static void __page_unfull(keel_heap_t *heap, keel_page_t *page) {
  __keel_page_queue_remove(&heap->full, page);
  __keel_page_queue_push_back(&heap->queue[page->cls], page);
  /* Waits out a freer mid-way through the delayed hand-off: a page is
   * DELAYING only while on a full list, which fork's prepare relies on. */
  tf_set_state(page, KEEL_TF_NORMAL);
  /* Release: everything done to the page under the lock is visible to an
   * owner whose free fast path sees flags == 0 (acquire there). */
  keel_store_release(&page->flags, 0);
}

/* Frees a page whose blocks are all back; it is on `q`. */
static void __page_retire(keel_heap_t *heap, keel_page_queue_t *q, keel_page_t *page) {
  __keel_page_queue_remove(q, page);
  if (heap->direct[page->cls] == page) {
    keel_page_t *first = heap->queue[page->cls].first;
    heap->direct[page->cls] = first != NULL ? first : &_keel_empty_page;
  }
  keel_store_relaxed(&page->flags, 0);
  _keel_page_free(page);
}

/* A block freed on a page this heap owns, slow cases: the page is full, or
 * the block came through the delayed list. `owner` is true when the calling
 * thread owns the heap (it may put pages back in its queues); a collector
 * working for an idle owner keeps pages full and re-arms them instead. */
static void __free_local(keel_heap_t *heap, keel_page_t *page, keel_block_t *b, bool owner) {
  KEEL_TRACK_FREE(b, page->bsize);
  b->next = _keel_encode(page, page->local_free);
  page->local_free = b;
  _keel_used_dec(page);
  bool full = keel_load_relaxed(&page->flags) & KEEL_PAGE_IN_FULL;
  if (!full) {
    if (_keel_used(page) == 0 && owner) {
      keel_page_queue_t *q = &heap->queue[page->cls];
      if (!(q->first == page && q->last == page)) __page_retire(heap, q, page);
    }
    return;
  }
  if (!owner) __keel_page_collect_thread_free(page);
  if (_keel_used(page) == 0) {
    __page_retire(heap, &heap->full, page);
  } else if (owner) {
    __page_unfull(heap, page);
  } else {
    /* Re-arm the notification; blocks that raced in are collected first. */
    while (!tf_set_state(page, KEEL_TF_USE_DELAYED)) {
      __keel_page_collect_thread_free(page);
      if (_keel_used(page) == 0) {
        __page_retire(heap, &heap->full, page);
        return;
      }
    }
  }
}

static void push_delayed(keel_heap_t *heap, keel_block_t *b) {
  keel_block_t *head = keel_load_relaxed(&heap->delayed);
  do {
    b->next = (uintptr_t)head;
    /* Release: the link is written before the block is published. */
  } while (!keel_cas_weak_acq_rel(&heap->delayed, &head, b));
}

/* Pushes b on its page's thread_free as a remote free would, keeping the
 * page's delayed-free state. */
static void page_push_thread_free(keel_page_t *page, keel_block_t *b) {
  uintptr_t w = keel_load_relaxed(&page->thread_free);
  do {
    keel_block_t *head = KEEL_TF_PTR(w);
    b->next = _keel_encode(page, head != NULL ? head : _keel_list_end(page));
    /* Release: b's link is written before the block is published. */
  } while (!keel_cas_weak_acq_rel(&page->thread_free, &w,
                                  KEEL_TF_MAKE(b, KEEL_TF_COUNT(w) + 1, KEEL_TF_STATE(w))));
}

/* A delayed-list link is a plain pointer to a block of a small page (or
 * NULL). A block freed again while it waits there gets a page link instead
 * (encoded: the page key's top bit is set, no user pointer has it) and so
 * does one the owner freed and drained already; a write after free leaves
 * anything. Following such a link would corrupt another page's lists. */
static bool delayed_link_ok(const keel_block_t *next) {
  if (next == NULL) return true;
  if ((uintptr_t)next >> 47 != 0) return false;
  keel_segment_t *seg = _keel_segment_of(next);
  if (!_keel_segmap_has(seg) || seg->kind != KEEL_SEG_SMALL) return false;
  return _keel_page_has_block(_keel_page_of(seg, next), next);
}

static void __drain_delayed(keel_heap_t *heap, bool owner) {
  if (keel_load_relaxed(&heap->delayed) == NULL) return;
  /* Acquire: the pushers' link writes happen before their release CAS. */
  keel_block_t *b = keel_xchg_acquire(&heap->delayed, NULL);
  while (b != NULL) {
    keel_block_t *next = (keel_block_t *)b->next;
    if (keel_unlikely(!delayed_link_ok(next))) _keel_die_double_free("free", b);
    keel_page_t *page = _keel_page_of(_keel_segment_of(b), b);
    /* Its freer has pushed it but not yet reset the page's DELAYING state:
     * freeing it now could retire the page under that freer's last CAS.
     * Leave it for the next drain (a few instructions from now). */
    if (KEEL_TF_STATE(keel_load_acquire(&page->thread_free)) == KEEL_TF_DELAYING) {
      push_delayed(heap, b);
    } else if (!owner && !(keel_load_relaxed(&page->flags) & KEEL_PAGE_IN_FULL)) {
      /* A collector, and the owner has put the page back in its queue (a
       * local free into it) since b was pushed: the owner's fast paths use
       * the page's lists again, which the collector excludes only from slow
       * paths, so b goes where a remote free goes. (flags cannot change
       * while we hold the heap: only the owner's slow paths change it.) */
      page_push_thread_free(page, b);
    } else {
      /* Counted as a remote free by its freer. */
      keel_store_relaxed(&page->remote_in, keel_load_relaxed(&page->remote_in) + 1);
      __free_local(heap, page, b, owner);
    }
    b = next;
  }
}

/* ---- thread heaps ---- */

static void heap_thread_exit(void *arg);

/* Set once this thread's exit hook ran. From then on the thread never gets
 * a heap again: one made later (by a pthread-key destructor or another
 * module's exit hook that allocates or frees) would re-arm the hook, which
 * glibc's last destructor round never runs, so the heap and its pages would
 * never be handed back. Such a thread allocates from the shared heaps
 * (malloc_thread) and frees as a stranger. Before that, a thread that only
 * frees (a consumer) gets a heap for its counters on its first free
 * (counting_heap): one shared atomic counter per class would bounce between
 * every consumer's cache. */
static KEEL_TLS bool tls_exited;

static keel_heap_t *heap_get(void) {
  pthread_mutex_lock(&registry_lock);
  if (heaps_all == NULL) asym_init(); /* before the first heap exists */
  keel_heap_t *heap = heaps_free;
  if (heap != NULL) {
    heaps_free = heap->next_free;
    heaps_free_n--;
  } else {
    heap = _keel_os_alloc(KEEL_ALIGN_UP(sizeof(keel_heap_t), 4096), 4096);
    if (heap != NULL) {
      keel_store_relaxed(&heap->lock, 0);
      heap->next_all = heaps_all;
      heap->prev_all = NULL;
      if (heaps_all != NULL) heaps_all->prev_all = heap;
      heaps_all = heap;
      heap->rng = (heap_seed += 0x9e3779b97f4a7c15ull) ^ keel_clock_ns() ^ (uintptr_t)heap;
    }
  }
  if (heap != NULL) heap->active = true;
  pthread_mutex_unlock(&registry_lock);
  return heap;
}

keel_heap_t *_keel_heap_init_thread(void) {
  _keel_classes_init();
  keel_heap_t *heap = heap_get();
  if (heap == NULL) return NULL;
  for (unsigned c = 0; c < KEEL_CLASS_COUNT_MAX; c++) heap->direct[c] = &_keel_empty_page;
  keel_fetch_add_relaxed(&heaps_active, 1);
  _keel_purge_note_thread();
  heap->exit_hook.fn = heap_thread_exit;
  heap->exit_hook.arg = heap;
  heap->exit_hook.next = NULL;
  _keel_heap_tls = heap;
  /* Without the hook (no pthread key left) the heap is simply never
   * abandoned: its pages stay with it, as in a thread that never exits. */
  (void)_keel_thread_hook_arm(&heap->exit_hook);
  return heap;
}

/* Gives every page away: freed if all its blocks are back, else abandoned. */
static void __heap_abandon_pages(keel_heap_t *heap) {
  /* First stop remote freers from using the delayed list, then drain it:
   * after this no one will push to heap->delayed again. */
  /* Every page, not only full ones: a page put back in the queue may still
   * be DELAYING (its freer has not reset it yet), and the drain would defer
   * that block forever. */
  for (keel_page_t *p = heap->full.first; p != NULL; p = p->next) {
    tf_set_state(p, KEEL_TF_NEVER_DELAYED);
  }
  for (unsigned c = 0; c < _keel_class_count; c++) {
    for (keel_page_t *p = heap->queue[c].first; p != NULL; p = p->next) {
      tf_set_state(p, KEEL_TF_NEVER_DELAYED);
    }
  }
  __drain_delayed(heap, true);
  KEEL_ASSERT(keel_load_relaxed(&heap->delayed) == NULL);
  keel_page_t *empty = NULL;
  for (unsigned c = 0; c <= _keel_class_count; c++) {
    keel_page_queue_t *q = c < _keel_class_count ? &heap->queue[c] : &heap->full;
    keel_page_t *page;
    while ((page = q->first) != NULL) {
      __keel_page_queue_remove(q, page);
      tf_set_state(page, KEEL_TF_NEVER_DELAYED);
      __keel_page_collect_thread_free(page);
      keel_store_relaxed(&page->flags, 0);
      if (_keel_used(page) == 0) {
        page->next = empty;
        empty = page;
      } else {
        keel_store_release(&page->heap, NULL);
        _keel_page_abandon(page);
      }
    }
    if (c < _keel_class_count) heap->direct[c] = &_keel_empty_page;
  }
  /* The empty pages under one segment-lock hold, not one each: short-lived
   * threads on many cores queued on that lock. */
  _keel_pages_free(empty);
}

static void heap_thread_exit(void *arg) {
  keel_heap_t *heap = arg;
  /* From here this thread frees like a stranger (remote path). */
  _keel_heap_tls = &_keel_empty_heap;
  tls_exited = true;
  owner_enter(heap);
  __heap_abandon_pages(heap);
  owner_exit(heap);
  keel_fetch_sub_relaxed(&heaps_active, 1);
  pthread_mutex_lock(&registry_lock);
  heap->active = false;
  /* Its frees of other threads' blocks count on in the global counters. */
  for (unsigned c = 0; c < KEEL_CLASS_COUNT_MAX; c++) {
    size_t n = keel_load_relaxed(&heap->remote_frees[c]);
    if (n != 0) keel_fetch_add_relaxed(&_keel_orphan_frees[c], n);
    keel_store_relaxed(&heap->remote_frees[c], 0);
  }
  if (heaps_free_n < HEAPS_FREE_MAX) {
    heap->next_free = heaps_free;
    heaps_free = heap;
    heaps_free_n++;
    heap = NULL;
  } else {
    if (heap->prev_all != NULL)
      heap->prev_all->next_all = heap->next_all;
    else
      heaps_all = heap->next_all;
    if (heap->next_all != NULL) heap->next_all->prev_all = heap->prev_all;
  }
  pthread_mutex_unlock(&registry_lock);
  if (heap != NULL) _keel_os_release(heap, KEEL_ALIGN_UP(sizeof(keel_heap_t), 4096));
  _keel_purge_schedule();
}

/* ---- malloc slow path ---- */

/* Finds a page of class cls with a free block and makes it current. */
static keel_page_t *__find_page(keel_heap_t *heap, unsigned cls) {
  __drain_delayed(heap, true);
  keel_page_queue_t *q = &heap->queue[cls];
  keel_page_t *page, *next, *uncarved = NULL;
  /* Blocks freed back to any page of the class are used before fresh memory
   * is carved: other threads' frees land on older pages while the current
   * one is still being carved, and carving first grows RSS by what they
   * freed. */
  for (page = q->first; page != NULL; page = next) {
    next = page->next;
    __keel_page_collect_lists(page);
    if (!_keel_list_empty(page->free)) goto found;
    if (keel_load_relaxed(&page->capacity) < page->reserved) {
      if (uncarved == NULL) uncarved = page;
      continue;
    }
    if (!__page_to_full(heap, page)) next = page; /* blocks raced in: collect again */
  }
  if (uncarved != NULL) {
    __keel_page_extend(uncarved);
    page = uncarved;
    goto found;
  }
  while ((page = _keel_page_adopt(cls, heap)) != NULL) {
    __keel_page_collect(page);
    if (!_keel_list_empty(page->free)) {
      __keel_page_queue_push_front(q, page);
      goto found;
    }
    __keel_page_queue_push_front(q, page);
    if (!__page_to_full(heap, page)) {
      __keel_page_collect(page);
      goto found;
    }
  }
  page = _keel_page_alloc(cls, heap);
  if (page == NULL) return NULL;
  __keel_page_collect(page);
  __keel_page_queue_push_front(q, page);
found:
  KEEL_ASSERT_FULL(_keel_page_validate(page)); /* debug-full builds: walk the page */
  if (q->first != page) {
    __keel_page_queue_remove(q, page);
    __keel_page_queue_push_front(q, page);
  }
  heap->direct[cls] = page;
  return page;
}

static void *malloc_class(keel_heap_t *heap, unsigned cls, size_t size) {
  keel_page_t *page = heap->direct[cls];
  if (keel_likely(!_keel_list_empty(page->free))) {
    __keel_page_sample_request(page, size);
    return _keel_page_pop(page);
  }
  owner_enter(heap);
  page = __find_page(heap, cls);
  owner_exit(heap);
  if (page == NULL || _keel_list_empty(page->free)) {
    errno = ENOMEM;
    return NULL;
  }
  __keel_page_sample_request(page, size);
  return _keel_page_pop(page);
}

/* ---- the shared heap ----
 * Classes above KEEL_SHARED_MIN (8 KiB, where pages grow from 64 KiB to
 * 256 KiB and 1 MiB) come from a few heaps shared by all threads (4 shards,
 * picked by the thread's TLS address), each behind a mutex, instead of
 * per-thread pages. A thread heap keeps at least one block per class it
 * uses, and every block it carved for its peak: for the classes from 8 KiB
 * to 256 KiB that is megabytes per thread. Measured, 64 threads exchanging
 * mixed sizes (60-90 MiB live, 2 cores): peak RSS 680 MiB with every class
 * per thread; 310 MiB with classes above 8 KiB shared; 290 MiB above 4 KiB
 * (glibc 31, jemalloc 63, tcmalloc 183, mimalloc 276). Such blocks are a
 * few percent of allocations in the loads we measured, and each is big
 * enough that a mutex costs little next to writing it. A shared heap is a
 * heap like any other, except that no thread owns it: every free of its
 * blocks runs as its owner under its mutex (free_foreign: onto local_free,
 * with the owner's double-free checks), as do its allocations, and the
 * purge thread collects it. The pool takes every class from here
 * (_keel_malloc_shared, heap/shared.h) for the same reason: no owner must
 * run for its emptied pages to go back. Order: shard locks before
 * registry_lock. */
#define SHARED_SHARDS 4 /* like a few jemalloc arenas: threads spread by TLS address */

typedef struct shared_shard {
  pthread_mutex_t lock;
  keel_atomic(keel_heap_t *) heap; /* set once, under lock; compared without it */
} KEEL_CACHE_ALIGNED shared_shard_t;

static shared_shard_t shared[SHARED_SHARDS] = {
    [0 ... SHARED_SHARDS - 1] = {PTHREAD_MUTEX_INITIALIZER, NULL}};

static void *malloc_shared(unsigned cls, size_t size) {
  /* Thread stacks (and so TLS blocks) are far apart: bits above 16 spread. */
  shared_shard_t *sh = &shared[((uintptr_t)&tls_exited >> 16) % SHARED_SHARDS];
  void *p = NULL;
  pthread_mutex_lock(&sh->lock);
  keel_heap_t *heap = keel_load_relaxed(&sh->heap);
  if (heap == NULL) {
    heap = heap_get();
    if (heap != NULL) {
      for (unsigned c = 0; c < KEEL_CLASS_COUNT_MAX; c++) heap->direct[c] = &_keel_empty_page;
      keel_store_relaxed(&sh->heap, heap);
    }
  }
  if (heap != NULL) p = malloc_class(heap, cls, size);
  pthread_mutex_unlock(&sh->lock);
  if (p == NULL) errno = ENOMEM;
  return p;
}

void *_keel_malloc_shared(size_t size, size_t align) {
  if (align < 16) align = 16;
  int cls = size <= KEEL_LARGE_MAX ? _keel_class_aligned(size, align) : -1;
  if (cls < 0) return _keel_large_alloc(size, align, false);
  return malloc_shared((unsigned)cls, size);
}

static void heap_collect_own(keel_heap_t *heap, bool force, bool retire_current);

static void shared_collect(bool force) {
  for (int i = 0; i < SHARED_SHARDS; i++) {
    pthread_mutex_lock(&shared[i].lock);
    /* Empty current pages go too: no thread keeps allocating here for
     * certain, and an idle shared heap must not hold a page per class. */
    keel_heap_t *heap = keel_load_relaxed(&shared[i].heap);
    if (heap != NULL) heap_collect_own(heap, force, true);
    pthread_mutex_unlock(&shared[i].lock);
  }
}

/* A block of class cls for the calling thread, whose heap is `heap`: its
 * first allocation makes the heap, unless its exit hook has run already
 * (tls_exited: a late allocation goes to the shared heaps, see there). Only
 * the malloc slow paths come here, so the extra test costs the fast path
 * nothing. */
static void *malloc_thread(keel_heap_t *heap, unsigned cls, size_t size) {
  if (keel_unlikely(heap == &_keel_empty_heap)) {
    if (tls_exited) return malloc_shared(cls, size);
    if ((heap = _keel_heap_init_thread()) == NULL) {
      errno = ENOMEM;
      return NULL;
    }
  }
  return malloc_class(heap, cls, size);
}

void *_keel_malloc_generic(keel_heap_t *heap, size_t size) {
  if (size > KEEL_LARGE_MAX) return _keel_large_alloc(size, 0, false);
  unsigned cls = _keel_class_of(size);
  if (_keel_class_size[cls] > KEEL_SHARED_MIN) return malloc_shared(cls, size);
  void *p = malloc_thread(heap, cls, size);
  _keel_purge_schedule(); /* pages may have been freed draining the delayed list */
  return p;
}

void *_keel_malloc_in_class(unsigned cls, size_t size) {
  if (_keel_class_size[cls] > KEEL_SHARED_MIN) return malloc_shared(cls, size);
  return malloc_thread(_keel_heap_tls, cls, size);
}

/* ---- free slow path ---- */

void _keel_heap_page_emptied(keel_heap_t *heap, keel_page_t *page) {
  owner_enter(heap);
  keel_page_queue_t *q = &heap->queue[page->cls];
  /* Keep the only page of a class: a loop that allocates and frees one
   * block would otherwise take and return a page every time. */
  if (_keel_used(page) == 0 && !(q->first == page && q->last == page)) __page_retire(heap, q, page);
  owner_exit(heap);
  _keel_purge_schedule();
}

static void free_remote(keel_heap_t *me, keel_page_t *page, keel_block_t *b, const char *call) {
  /* Everything read from the page is read before b is published: once it
   * is, the owner may take it, empty the page and give it to another class. */
  unsigned cls = page->cls;
  /* Cross-thread double free: a block still on a list of its page (the
   * owner's free or local_free, or thread_free) has a link into its own
   * segment; a live block almost never does, and then the walk clears it.
   * Pushing it again would make the list a cycle. */
  if (keel_unlikely(_keel_block_maybe_free(page, b)) && _keel_page_has_free_block_remote(page, b)) {
    _keel_die_double_free(call, b);
  }
  KEEL_TRACK_FREE(b, page->bsize);
  uintptr_t w = keel_load_relaxed(&page->thread_free), nw;
  unsigned state;
  do {
    state = KEEL_TF_STATE(w);
    if (state == KEEL_TF_USE_DELAYED) {
      nw = (w & ~(uintptr_t)3) | KEEL_TF_DELAYING;
    } else {
      keel_block_t *head = KEEL_TF_PTR(w);
      b->next = _keel_encode(page, head != NULL ? head : _keel_list_end(page));
      nw = KEEL_TF_MAKE(b, KEEL_TF_COUNT(w) + 1, state);
    }
    /* Release: b's link is written before the block is published; acquire:
     * on the delayed branch, we read page->heap after claiming DELAYING. */
  } while (!keel_cas_weak_acq_rel(&page->thread_free, &w, nw));
  if (state == KEEL_TF_USE_DELAYED) {
    /* While we hold DELAYING the owner cannot abandon the page (it waits)
     * nor free b from its delayed list (it defers it), so the page and its
     * heap stay as they are until we reset the state. */
    keel_heap_t *owner = keel_load_acquire(&page->heap);
    push_delayed(owner, b);
    w = keel_load_relaxed(&page->thread_free);
    while (!keel_cas_weak_acq_rel(&page->thread_free, &w, (w & ~(uintptr_t)3) | KEEL_TF_NORMAL)) {}
    /* The owner may be idle: the purge thread drains its list if so. */
    _keel_purge_note_work();
    _keel_purge_schedule();
  }
  if (me != &_keel_empty_heap) {
    _keel_counter_add(&me->remote_frees[cls], 1);
  } else {
    keel_fetch_add_relaxed(&_keel_orphan_frees[cls], 1);
  }
}

static keel_heap_t *counting_heap(keel_heap_t *me) {
  if (keel_likely(me != &_keel_empty_heap) || tls_exited) return me;
  keel_heap_t *h = _keel_heap_init_thread();
  return h != NULL ? h : me;
}

/* The shard whose heap owns page, or NULL: a pointer comparison, never a
 * dereference of page->heap (a thread heap may be unmapped meanwhile). */
static shared_shard_t *shard_of(const keel_page_t *page) {
  keel_heap_t *owner = keel_load_relaxed(&page->heap);
  for (int i = 0; i < SHARED_SHARDS; i++) {
    if (owner != NULL && owner == keel_load_relaxed(&shared[i].heap)) return &shared[i];
  }
  return NULL;
}

/* A free of a block this thread's heap does not own; the caller checked
 * that it is a carved block of the page (_keel_page_has_block). A shared
 * heap's block is freed as its owner, under the shard's mutex: onto
 * local_free, with the double-free checks an owner makes (the mutex is what
 * allocation takes anyway for these sizes). Any other goes on the page's
 * thread_free. */
static void free_foreign(keel_page_t *page, keel_block_t *b, const char *call) {
  shared_shard_t *sh = shard_of(page);
  if (sh == NULL) {
    free_remote(counting_heap(_keel_heap_tls), page, b, call);
    return;
  }
  pthread_mutex_lock(&sh->lock);
  keel_heap_t *heap = keel_load_relaxed(&sh->heap);
  if (_keel_block_maybe_free(page, b) && _keel_page_has_free_block(page, b)) {
    pthread_mutex_unlock(&sh->lock);
    _keel_die_double_free(call, b);
  }
  owner_enter(heap);
  __free_local(heap, page, b, true); /* retires the page if it was its last block */
  owner_exit(heap);
  pthread_mutex_unlock(&sh->lock);
  _keel_purge_schedule(); /* with no lock held: it may create the purge thread */
}

/* For the owner of p's page, before the link test: a remote free of a
 * block of a full page goes to the owner heap's delayed list, where its
 * link is a plain pointer that test cannot recognise. Drained, such a block
 * is on a list of its page, where the test finds it; and if it was the
 * page's last block in use, the page is gone, and so p was freed (a live
 * block keeps its page). Shared heaps' delayed lists stay empty: their
 * blocks are freed as their owner (free_foreign). */
static void check_not_delayed(keel_heap_t *heap, keel_page_t *page, void *p, const char *call) {
  if (keel_load_relaxed(&page->flags) == 0 || keel_load_relaxed(&heap->delayed) == NULL) return;
  owner_enter(heap);
  __drain_delayed(heap, true);
  owner_exit(heap);
  if (keel_load_relaxed(&page->heap) != heap || !_keel_page_has_block(page, p))
    _keel_die_double_free(call, p);
  _keel_purge_schedule(); /* the drain may have freed pages; no heap lock is held */
}

void _keel_check_not_free(keel_page_t *page, void *p, const char *call) {
  /* The owner reads its page's lists (a shared heap's, under its mutex),
   * after draining its delayed list as its free does; another thread's
   * page gets the racy walk a remote free makes, since realloc may return
   * the block in place, where no free of ours follows to find it (a block
   * freed by its owner, or by another thread while its page was full, came
   * back to life). A block of another thread's page that waits on that
   * thread's delayed list is not seen here: we cannot read another heap's
   * list (it may be unmapped), and the owner's drain notices only once the
   * block's first word is written (a second remote free rewrites it). */
  shared_shard_t *sh = NULL;
  keel_block_t *b = p;
  keel_heap_t *heap = _keel_heap_tls;
  if (keel_load_relaxed(&page->heap) != heap) {
    if ((sh = shard_of(page)) == NULL) {
      if (keel_unlikely(_keel_block_maybe_free(page, b)) &&
          _keel_page_has_free_block_remote(page, b))
        _keel_die_double_free(call, p);
      return;
    }
    pthread_mutex_lock(&sh->lock);
  } else {
    check_not_delayed(heap, page, p, call);
  }
  bool freed = _keel_block_maybe_free(page, b) && _keel_page_has_free_block(page, b);
  if (sh != NULL) pthread_mutex_unlock(&sh->lock);
  if (freed) _keel_die_double_free(call, p);
}

void _keel_free_other(keel_page_t *page, void *p, const char *call) {
  /* Not a carved block (bsize 0: a large block, a header, a free span; or
   * an interior or never-carved pointer): the generic path sorts them out
   * and dies for the invalid ones. Other threads' capacity is read racily:
   * see keel_page_t. */
  if (!_keel_page_has_block(page, p)) {
    _keel_free_generic(p, call);
    return;
  }
  free_foreign(page, p, call);
}

void _keel_free_generic(void *p, const char *call) {
  if (p == NULL) return;
  keel_segment_t *seg = _keel_segment_of(p);
  if (!_keel_segmap_has(seg)) {
    if (_keel_huge_free(p)) return; /* aligned to more than 2 MiB */
    _keel_die_invalid(call, p);
  }
  if (seg->kind != KEEL_SEG_SMALL) {
    if (seg->kind == KEEL_SEG_LARGE && (uint8_t *)p == (uint8_t *)seg + seg->user_off) {
      _keel_large_free(seg);
      return;
    }
    if ((uint8_t *)p == (uint8_t *)seg + seg->user_off) _keel_die_double_free(call, p);
    _keel_die_invalid(call, p);
  }
  keel_page_t *page = _keel_page_of(seg, p);
  /* Also for another thread's page: a block past its carved end would go on
   * its thread_free and be handed out twice (capacity read racily: see
   * keel_page_t). */
  if (!_keel_page_has_block(page, p)) _keel_die_invalid(call, p);
  keel_block_t *b = p;
  keel_heap_t *heap = _keel_heap_tls;
  if (keel_load_relaxed(&page->heap) != heap) {
    free_foreign(page, b, call);
    return;
  }
  check_not_delayed(heap, page, p, call);
  /* On a list of the page: its first word decodes to a link into this
   * segment, confirmed by a walk. */
  if (_keel_block_maybe_free(page, b) && _keel_page_has_free_block(page, b)) {
    _keel_die_double_free(call, p);
  }
  if (keel_load_relaxed(&page->flags) == 0) {
    /* The fast path's case, reached by a false link hint. */
    _keel_push_local(page, b);
    if (_keel_used_dec(page) && page != heap->direct[page->cls])
      _keel_heap_page_emptied(heap, page);
    return;
  }
  owner_enter(heap);
  __free_local(heap, page, b, true);
  owner_exit(heap);
  _keel_purge_schedule();
}

/* ---- collection ---- */

/* The calling thread's own heap: everything free goes back. */
static void heap_collect_own(keel_heap_t *heap, bool force, bool retire_current) {
  size_t purged = 0;
  owner_enter(heap);
  __drain_delayed(heap, true);
  for (unsigned c = 0; c < _keel_class_count; c++) {
    keel_page_queue_t *q = &heap->queue[c];
    keel_page_t *next;
    for (keel_page_t *p = q->first; p != NULL; p = next) {
      next = p->next;
      __keel_page_collect_thread_free(p);
      if (_keel_used(p) == 0 && (force || retire_current || p != heap->direct[c])) {
        __page_retire(heap, q, p);
      } else if (force) {
        purged += __keel_page_purge_free(p);
      }
    }
  }
  owner_exit(heap);
  keel_fetch_add_relaxed(&_keel_purged_bytes, purged);
}

typedef struct {
  keel_heap_t *self;
  bool force;
} collect_arg_t;

static void heap_collect_other(keel_heap_t *heap, void *argp) {
  collect_arg_t *arg = argp;
  if (heap == arg->self || !heap->active) return;
  if (keel_load_relaxed(&heap->delayed) == NULL) return;
  /* Another thread's heap: only its full pages (see the file comment). A
   * busy owner is left alone unless forced. */
  if (!collector_enter(heap, arg->force)) return;
  __drain_delayed(heap, false);
  collector_exit(heap);
}

void _keel_heaps_visit(keel_heap_visit_fn fn, void *arg) {
  pthread_mutex_lock(&registry_lock);
  for (keel_heap_t *h = heaps_all; h != NULL; h = h->next_all) fn(h, arg);
  pthread_mutex_unlock(&registry_lock);
}

void _keel_heaps_collect(bool force) {
  shared_collect(force);
  keel_heap_t *self = _keel_heap_tls;
  if (self != &_keel_empty_heap) heap_collect_own(self, force, false);
  collect_arg_t arg = {self, force};
  _keel_heaps_visit(heap_collect_other, &arg);
}

size_t _keel_heaps_active(void) {
  return keel_load_relaxed(&heaps_active);
}

/* ---- fork ---- */

/* Every heap is held as by a collector (one membarrier for all), and the
 * segment and large locks are taken, so the child inherits consistent lists;
 * all is released on both sides (the child's only thread is the one that
 * took them). Other threads' heaps stay in the child with their pages, as
 * in glibc's arenas; their blocks can still be freed there (remote path). */
void _keel_heap_fork_prepare(void) {
  _keel_stats_fork_lock();    /* outermost: held across the locks below */
  _keel_large_release_lock(); /* a collector holds it, then the large lock */
  _keel_large_move_lock();    /* a moving realloc holds it alone */
  for (int i = 0; i < SHARED_SHARDS; i++) pthread_mutex_lock(&shared[i].lock);
  pthread_mutex_lock(&registry_lock);
  for (keel_heap_t *h = heaps_all; h != NULL; h = h->next_all) {
    heap_lock(h);
    if (asym_ok) keel_store_relaxed(&h->collector, 1);
  }
  if (asym_ok && heaps_all != NULL) {
    asym_fence();
    for (keel_heap_t *h = heaps_all; h != NULL; h = h->next_all) {
      while (keel_load_acquire(&h->owner_busy) != 0) sched_yield();
    }
  }
  /* A remote freer between claiming DELAYING on a full page and setting it
   * back (free_remote: a few instructions, no lock) would leave the child
   * a page stuck in that state, and every tf_set_state on it there would
   * spin for good. Such a page is on its heap's full list (__page_unfull
   * waits the state out), with every heap locked no page enters or leaves
   * one, and the freer needs no lock to finish: wait for it. (Not if the
   * freer is this thread, forking from a signal handler: not
   * async-signal-safe, as with any atfork handler.) */
  for (keel_heap_t *h = heaps_all; h != NULL; h = h->next_all)
    for (keel_page_t *p = h->full.first; p != NULL; p = p->next)
      while (KEEL_TF_STATE(keel_load_acquire(&p->thread_free)) == KEEL_TF_DELAYING) sched_yield();
  _keel_segments_lock();
  _keel_large_lock();
}

/* The locks prepare took, but move_lock: see the two handlers below. */
static void fork_unlock(void) {
  _keel_large_unlock();
  _keel_segments_unlock();
  for (keel_heap_t *h = heaps_all; h != NULL; h = h->next_all) collector_exit(h);
  pthread_mutex_unlock(&registry_lock);
  for (int i = SHARED_SHARDS - 1; i >= 0; i--) pthread_mutex_unlock(&shared[i].lock);
  _keel_large_release_unlock();
  _keel_stats_fork_unlock();
}

void _keel_heap_fork_parent(void) {
  fork_unlock();
  _keel_large_move_unlock();
}

void _keel_heap_fork_child(void) {
  fork_unlock();
  _keel_large_move_child_reset(); /* an rwlock's unlock goes by thread id: the child's is new */
  /* membarrier registration belongs to the parent's mm; the child has one
   * thread, so switching mode here races with no one. */
  if (asym_ok) asym_init();
  /* The parent's other threads, and their heaps' counts, are gone: the
   * purge thread's end (purge.c) waits for this count to reach zero. */
  keel_store_relaxed(&heaps_active, _keel_heap_tls != &_keel_empty_heap ? 1 : 0);
  _keel_segments_fork_child();
  _keel_purge_fork_child();
}

__attribute__((constructor(102))) static void heap_ctor(void) {
  pthread_atfork(_keel_heap_fork_prepare, _keel_heap_fork_parent, _keel_heap_fork_child);
}
