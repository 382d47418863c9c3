/* pheap heap: chunks, runs and blocks (the volatile side of allocation).
 *
 * Persistent truth is only the chunk words and run bitmaps (pheap_int.h);
 * everything here is rebuilt from them lazily, so open walks nothing and
 * costs the same whatever the pool size. A boot cursor (ph->booted) splits
 * the chunks: below it chunk_free/chunk_run and the runs' vfree bitmaps are
 * built, above it nothing is known. The cursor moves one run (or free
 * chunk) at a time, under ph->lock, and only when an operation needs it:
 * a refill whose class has no partial run boots runs until one of its class
 * with free blocks turns up (else it creates one); the first-fit chunk
 * search boots as it scans; a free (or any call naming an object) boots up
 * to the object's run. Each run is read (header and bitmap) at most once
 * per open. Empty runs found while booting go back to free chunks (one
 * store of 0 to their chunk word): no log of this session can name a run
 * above the cursor (nothing there was allocated or freed yet), and recovery
 * left every older log below the watermark.
 *
 * Invariant per run: every block is in exactly one of these states:
 * allocated (bit set on media), in `vfree`, in some thread cache, or held by
 * an operation in flight (reservation, tx allocation, or a free between its
 * barrier and its return). navail == popcount(vfree); listed <=> on the
 * partial list of its arena (r->arena) and class, and every run with
 * navail > 0 is on one.
 *
 * Locks: ph->lock guards the chunk arrays and growth; the lock of (arena a,
 * class c)'s classq guards its partial list and the vfree bitmaps of its
 * runs. The allocation fast path (tcache pop) takes neither.
 *
 * Arenas (pheap_int.h): a cache refills from its arena's runs and boots
 * runs into its arena. With none there, it adopts another arena's run that
 * that arena is not drawing from (any but the head of its list: after a
 * reopen one thread's boot may have listed every run in its arena), and
 * only then creates a run. A fixed pool takes blocks from another arena's
 * runs before it creates one (its chunks may be all that other classes and
 * large objects have left), and any pool does once no run can be created
 * (full, or corrupt past the boot cursor), so arenas never make a pool
 * report full while a run of the class has free blocks.
 */
#include <stdlib.h>
#include <string.h>

#include "base/die.h"
#include "pheap/pheap_int.h"

#define ATOMIC64(p) ((keel_atomic(uint64_t) *)(void *)(p))

static inline ph_run_hdr_t *run_hdr(keel_pheap_t *ph, const ph_run_t *r) {
  return (ph_run_hdr_t *)(ph->view.base + ph_chunk_off(ph, r->chunk));
}
static inline uint64_t *run_bitmap(keel_pheap_t *ph, uint32_t chunk) {
  return (uint64_t *)(ph->view.base + ph_chunk_off(ph, chunk) + PH_RUN_HDR);
}

static inline ph_classq_t *classq_of(keel_pheap_t *ph, unsigned arena, unsigned cls) {
  return &ph->classq[arena * _keel_ph_nclasses + cls];
}

static int __boot_one(keel_pheap_t *ph, ph_tcache_t *tc);
static int boot_for_class(keel_pheap_t *ph, ph_tcache_t *tc, unsigned cls);

/* First fit of k contiguous free chunks inside one zone; UINT32_MAX if none
 * (then every chunk is booted). Boots chunks as it scans. ph->lock held. */
static uint32_t __chunks_find(keel_pheap_t *ph, ph_tcache_t *tc, uint32_t k) {
  uint32_t n = keel_load_relaxed(&ph->nchunks), run = 0;
  for (uint32_t c = 0; c < n; c++) {
    while (c >= keel_load_relaxed(&ph->booted))
      if (__boot_one(ph, tc) != 0) return UINT32_MAX; /* corrupt: no space there */
    if (c % PH_ZONE_CHUNKS == 0) run = 0;             /* extents never cross a zone */
    run = ph->chunk_free[c] ? run + 1 : 0;
    if (run == k) return c + 1 - k;
  }
  return UINT32_MAX;
}

/* Takes k free chunks, growing the pool if needed. ph->lock held. */
static int __chunks_take(keel_pheap_t *ph, ph_tcache_t *tc, uint32_t k, uint32_t *out) {
  uint32_t c = __chunks_find(ph, tc, k);
  if (c == UINT32_MAX) {
    if (keel_load_relaxed(&ph->booted) < keel_load_relaxed(&ph->nchunks))
      return KEEL_ECORRUPT; /* the scan stopped at a bad chunk word */
    int rc = __keel_ph_grow(ph, tc, k);
    if (rc != 0) return rc;
    /* New chunks are zero (free) and known: the cursor follows. */
    keel_store_release(&ph->booted, keel_load_relaxed(&ph->nchunks));
    c = __chunks_find(ph, tc, k);
    KEEL_ASSERT(c != UINT32_MAX); /* growth made room for exactly this extent */
    if (c == UINT32_MAX) return KEEL_ENOSPC;
  }
  memset(ph->chunk_free + c, 0, k);
  *out = c;
  return 0;
}

static ph_run_t *run_new(uint32_t chunk, uint32_t cls, uint32_t nblocks, unsigned arena) {
  ph_run_t *r = calloc(1, sizeof *r);
  if (r == NULL) return NULL;
  r->vfree = calloc((nblocks + 63) / 64, 8);
  if (r->vfree == NULL) {
    free(r);
    return NULL;
  }
  r->chunk = chunk;
  r->cls = cls;
  keel_store_relaxed(&r->arena, arena);
  return r;
}

/* Puts r on its class's list of runs with free blocks; q->lock held. */
static void __run_list(ph_classq_t *q, ph_run_t *r) {
  r->listed = true;
  r->next = q->partial;
  q->partial = r;
}

/* Formats a new run for class cls. Checkpoints, then two barriers: header and zeroed bitmap
 * first, then the chunk word that makes it a run (a crash in between leaves
 * free chunks with some bytes written, which is harmless). */
static int run_create(keel_pheap_t *ph, ph_tcache_t *tc, unsigned cls, ph_run_t **out) {
  const ph_class_t *k = &_keel_ph_classes[cls];
  /* The chunks may have been freed by a log still above the watermark; its
   * replay after a crash would clobber the unlogged run word we are about to
   * write, so make every earlier log checkpointed first. */
  _keel_ph_checkpoint(ph, tc);
  pthread_mutex_lock(&ph->lock);
  uint32_t c;
  int rc = __chunks_take(ph, tc, k->chunks, &c);
  ph_run_t *r = rc == 0 ? run_new(c, cls, k->nblocks, tc->arena) : NULL;
  if (rc == 0 && r == NULL) {
    memset(ph->chunk_free + c, 1, k->chunks);
    rc = KEEL_ENOMEM;
  }
  if (rc != 0) {
    pthread_mutex_unlock(&ph->lock);
    return rc;
  }
  /* A free that gave these chunks back after the checkpoint above drew its
   * log's seq before we took them (it logs, then gives under ph->lock):
   * retire it too. Logs in flight need no ph->lock to finish. */
  _keel_ph_checkpoint_past(ph, tc, atomic_load(&ph->seq));
  ph_run_hdr_t *h = (ph_run_hdr_t *)(ph->view.base + ph_chunk_off(ph, c));
  *h = (ph_run_hdr_t){
      .block = k->block, .nblocks = k->nblocks, .data_off = k->data_off, .magic = PH_RUN_MAGIC};
  memset(run_bitmap(ph, c), 0, (k->nblocks + 63) / 64 * 8);
  _keel_pm_flush(ph, tc, h, k->data_off, PH_S_RUN);
  _keel_pm_drain(ph, tc);
  keel_store_release(ATOMIC64(ph_cword(ph, c)), PH_CW_MAKE(PH_CW_RUN, k->chunks));
  _keel_pm_flush(ph, tc, ph_cword(ph, c), 8, PH_S_RUN_CWORD);
  _keel_pm_drain(ph, tc);
  for (uint32_t i = 0; i < k->nblocks / 64; i++) r->vfree[i] = ~0ull;
  if (k->nblocks % 64) r->vfree[k->nblocks / 64] = (1ull << (k->nblocks % 64)) - 1;
  r->navail = k->nblocks;
  for (uint32_t i = 0; i < k->chunks; i++) ph->chunk_run[c + i] = r;
  pthread_mutex_unlock(&ph->lock);
  *out = r;
  return 0;
}

static inline keel_poff_t block_off(keel_pheap_t *ph, const ph_run_t *r, uint32_t i) {
  const ph_class_t *k = &_keel_ph_classes[r->cls];
  return ph_chunk_off(ph, r->chunk) + k->data_off + (uint64_t)i * k->block + PH_OBJ_HDR;
}

/* A list of class cls with a partial run (tc's own arena first), its lock
 * held; NULL if there is none. */
static ph_classq_t *steal_q(keel_pheap_t *ph, ph_tcache_t *tc, unsigned cls) {
  for (unsigned i = 0; i < ph->narenas; i++) {
    ph_classq_t *q = classq_of(ph, (tc->arena + i) % ph->narenas, cls);
    pthread_mutex_lock(&q->lock);
    if (q->partial != NULL) return q;
    pthread_mutex_unlock(&q->lock);
  }
  return NULL;
}

/* Moves into tc's arena a partial run of class cls that another arena is
 * not drawing from (the second of its list or later); true if one moved.
 * Both lists are locked, lower arena first, so that give_run, which locks
 * by r->arena, never sees the run unlisted in between. */
static bool adopt(keel_pheap_t *ph, ph_tcache_t *tc, unsigned cls) {
  for (unsigned i = 1; i < ph->narenas; i++) {
    unsigned a = (tc->arena + i) % ph->narenas;
    ph_classq_t *from = classq_of(ph, a, cls), *to = classq_of(ph, tc->arena, cls);
    ph_classq_t *first = a < tc->arena ? from : to, *second = a < tc->arena ? to : from;
    pthread_mutex_lock(&first->lock);
    pthread_mutex_lock(&second->lock);
    ph_run_t *r = from->partial != NULL ? from->partial->next : NULL;
    if (r != NULL) {
      from->partial->next = r->next;
      keel_store_relaxed(&r->arena, tc->arena);
      __run_list(to, r);
    }
    pthread_mutex_unlock(&second->lock);
    pthread_mutex_unlock(&first->lock);
    if (r != NULL) return true;
  }
  return false;
}

/* Moves up to half a cache of blocks from the class's runs in the cache's
 * arena (another's when the file comment says so); classq lock taken here.
 * 0 or ENOSPC/ENOMEM/ECORRUPT. */
static KEEL_NOINLINE int refill(keel_pheap_t *ph, ph_tcache_t *tc, unsigned cls) {
  ph_classq_t *q = classq_of(ph, tc->arena, cls);
  pthread_mutex_lock(&q->lock);
  while (q->partial == NULL) {
    pthread_mutex_unlock(&q->lock);
    /* Runs not booted yet may have free blocks of this class: boot until
     * one lists itself in our arena (or none is left); then adopt one. */
    int rc = boot_for_class(ph, tc, cls);
    if (rc == 0 && adopt(ph, tc, cls)) rc = 1;
    if (rc == 0) {
      ph_classq_t *other = ph->fixed ? steal_q(ph, tc, cls) : NULL;
      if (other != NULL) {
        q = other; /* locked, with a partial run */
        break;
      }
      ph_run_t *r;
      if ((rc = run_create(ph, tc, cls, &r)) == 0) {
        pthread_mutex_lock(&q->lock);
        __run_list(q, r);
        continue;
      }
    }
    if (rc < 0) {
      /* No run of our own to be had: blocks from any arena's runs. */
      ph_classq_t *other = steal_q(ph, tc, cls);
      if (other == NULL) return rc;
      q = other;
      break;
    }
    pthread_mutex_lock(&q->lock);
  }
  ph_run_t *r = q->partial;
  uint32_t want = PH_TC_MAX / 2, words = (_keel_ph_classes[cls].nblocks + 63) / 64;
  for (uint32_t w = 0; w < words && tc->c[cls].n < want; w++) {
    while (r->vfree[w] && tc->c[cls].n < want) {
      unsigned b = (unsigned)__builtin_ctzll(r->vfree[w]);
      r->vfree[w] &= r->vfree[w] - 1;
      r->navail--;
      tc->c[cls].off[tc->c[cls].n++] = block_off(ph, r, w * 64 + b);
    }
  }
  if (r->navail == 0) {
    q->partial = r->next;
    r->listed = false;
  }
  pthread_mutex_unlock(&q->lock);
  return 0;
}

/* Whole chunks for `block` bytes. Only the chunk word (published by the
 * caller's log) and the object header are ever written: the body is not
 * touched, so a large object costs no memory until it is used. */
static int take_huge(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t block, keel_poff_t *off) {
  uint32_t k = (uint32_t)((block + PH_CHUNK - 1) / PH_CHUNK);
  KEEL_ASSERT(k <= PH_ZONE_CHUNKS); /* block <= KEEL_PHEAP_MAX_ALLOC + header: a zone holds it */
  pthread_mutex_lock(&ph->lock);
  uint32_t c;
  int rc = __chunks_take(ph, tc, k, &c);
  pthread_mutex_unlock(&ph->lock);
  if (rc == 0) *off = ph_chunk_off(ph, c) + PH_OBJ_HDR;
  return rc;
}

int _keel_ph_take_chunks(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t bytes, keel_poff_t *off) {
  return take_huge(ph, tc, bytes, off);
}

int _keel_ph_take(keel_pheap_t *ph, ph_tcache_t *tc, size_t size, int *cls, keel_poff_t *off) {
  if (keel_unlikely(size == 0 || size > KEEL_PHEAP_MAX_ALLOC))
    return KEEL_REJECT(KEEL_EINVAL, "pheap", "allocation of %zu bytes (1 to %llu)", size,
                       (unsigned long long)KEEL_PHEAP_MAX_ALLOC);
  int c = _keel_ph_class_of(size + PH_OBJ_HDR);
  *cls = c;
  if (keel_unlikely(c < 0)) return take_huge(ph, tc, size + PH_OBJ_HDR, off);
  if (keel_unlikely(tc->c[c].n == 0)) {
    int rc = refill(ph, tc, (unsigned)c);
    if (rc != 0) return rc;
  }
  *off = tc->c[c].off[--tc->c[c].n];
  return 0;
}

static void give_run(keel_pheap_t *ph, keel_poff_t off) {
  uint32_t chunk = _keel_ph_chunk_at(ph, off);
  ph_run_t *r = ph->chunk_run[chunk];
  const ph_class_t *k = &_keel_ph_classes[r->cls];
  uint32_t i = (uint32_t)((off - PH_OBJ_HDR - ph_chunk_off(ph, r->chunk) - k->data_off) / k->block);
  ph_classq_t *q;
  for (;;) { /* the lock of the list r belongs to, checked under it (adopt) */
    unsigned a = keel_load_relaxed(&r->arena);
    q = classq_of(ph, a, r->cls);
    pthread_mutex_lock(&q->lock);
    if (keel_load_relaxed(&r->arena) == a) break;
    pthread_mutex_unlock(&q->lock);
  }
  KEEL_ASSERT(!(r->vfree[i / 64] & (1ull << (i % 64))));
  r->vfree[i / 64] |= 1ull << (i % 64);
  r->navail++;
  if (!r->listed) __run_list(q, r);
  pthread_mutex_unlock(&q->lock);
}

void _keel_ph_give(keel_pheap_t *ph, ph_tcache_t *tc, int cls, keel_poff_t off) {
  if (cls < 0) {
    uint32_t c = _keel_ph_chunk_at(ph, off - PH_OBJ_HDR);
    const ph_objhdr_t *h = (const ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR);
    uint64_t k = (h->size + PH_OBJ_HDR + PH_CHUNK - 1) / PH_CHUNK;
    pthread_mutex_lock(&ph->lock);
    memset(ph->chunk_free + c, 1, k);
    pthread_mutex_unlock(&ph->lock);
    return;
  }
  if (keel_likely(tc->c[cls].n < PH_TC_MAX)) {
    tc->c[cls].off[tc->c[cls].n++] = off;
    return;
  }
  give_run(ph, off);
}

void _keel_ph_tcache_return(keel_pheap_t *ph, ph_tcache_t *tc) KEEL_HIDDEN;
void _keel_ph_tcache_return(keel_pheap_t *ph, ph_tcache_t *tc) {
  for (unsigned c = 0; c < _keel_ph_nclasses; c++) {
    while (tc->c[c].n) give_run(ph, tc->c[c].off[--tc->c[c].n]);
  }
}

ph_redo_entry_t _keel_ph_mark(keel_pheap_t *ph, int cls, keel_poff_t off, bool alloc) {
  uint64_t base = off - PH_OBJ_HDR;
  if (cls < 0) {
    uint32_t c = _keel_ph_chunk_at(ph, base);
    const ph_objhdr_t *h = (const ph_objhdr_t *)(ph->view.base + base);
    uint64_t k = (h->size + PH_OBJ_HDR + PH_CHUNK - 1) / PH_CHUNK;
    uint64_t w = (uint64_t)((char *)ph_cword(ph, c) - ph->view.base);
    return (ph_redo_entry_t){w | PH_OP_SET, alloc ? PH_CW_MAKE(PH_CW_HUGE, k) : 0};
  }
  ph_run_t *r = ph->chunk_run[_keel_ph_chunk_at(ph, base)];
  const ph_class_t *k = &_keel_ph_classes[r->cls];
  uint64_t i = (base - ph_chunk_off(ph, r->chunk) - k->data_off) / k->block;
  uint64_t w = ph_chunk_off(ph, r->chunk) + PH_RUN_HDR + i / 64 * 8;
  return (ph_redo_entry_t){w | (alloc ? PH_OP_OR : PH_OP_ANDNOT), 1ull << (i % 64)};
}

/* First call naming an object past the boot cursor: boot up to its run. */
static KEEL_NOINLINE void boot_for_object(keel_pheap_t *ph, uint32_t c, keel_poff_t off,
                                          const char *call) {
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (tc == NULL) keel_die(call, "out of memory rebuilding the heap of %s", ph->path);
  if (_keel_ph_boot_upto(ph, tc, c) != 0)
    keel_die(call, "offset 0x%llx: the heap of %s is corrupt before it (keel pheap check)",
             (unsigned long long)off, ph->path);
}

/* Finds the class whose block is exactly `block`, or -1. */
static int class_exact(uint32_t block) {
  int c = _keel_ph_class_of(block);
  return c >= 0 && _keel_ph_classes[c].block == block ? c : -1;
}

/* Whether off is the start of an allocated block of class k in the run at
 * chunk `run`: on a block boundary, inside the run, its bitmap bit set. */
static bool run_block_live(keel_pheap_t *ph, uint32_t run, const ph_class_t *k, keel_poff_t off) {
  uint64_t rel = off - PH_OBJ_HDR - ph_chunk_off(ph, run), i = (rel - k->data_off) / k->block;
  return rel >= k->data_off && (rel - k->data_off) % k->block == 0 && i < k->nblocks &&
         (keel_load_relaxed(ATOMIC64(run_bitmap(ph, run) + i / 64)) & (1ull << (i % 64)));
}

/* _keel_ph_live_class in a forked child, for a pool of the parent's: read
 * from the media alone (chunk words, run header, bitmap), as
 * keel_pheap_foreach reads them. The child's volatile index is the
 * parent's as it was at fork, and booting more of it would take the
 * parent's locks. A run's word is on its first chunk only, at most
 * PH_MAX_RUN_CHUNKS - 1 chunks back. */
static KEEL_NOINLINE int forked_live_class(keel_pheap_t *ph, uint32_t c, keel_poff_t off,
                                           const char *call) {
  uint64_t w = keel_load_acquire(ATOMIC64(ph_cword(ph, c)));
  if (PH_CW_TYPE(w) == PH_CW_HUGE && off == ph_chunk_off(ph, c) + PH_OBJ_HDR) return -1;
  for (uint32_t back = 0; back < PH_MAX_RUN_CHUNKS && back <= c; back++) {
    w = keel_load_acquire(ATOMIC64(ph_cword(ph, c - back)));
    if (PH_CW_TYPE(w) == PH_CW_FREE) continue; /* a run's later chunk, or free */
    if (PH_CW_TYPE(w) != PH_CW_RUN || PH_CW_LEN(w) <= back) break;
    uint32_t h = c - back;
    const ph_run_hdr_t *rh = (const ph_run_hdr_t *)(ph->view.base + ph_chunk_off(ph, h));
    int cls = class_exact(rh->block);
    if (cls < 0 || !run_block_live(ph, h, &_keel_ph_classes[cls], off)) break;
    return cls;
  }
  keel_die(call, "offset 0x%llx is not a live object of %s", (unsigned long long)off, ph->path);
}

int _keel_ph_live_class(keel_pheap_t *ph, keel_poff_t off, const char *call) {
  uint32_t c = off >= PH_OBJ_HDR ? _keel_ph_chunk_at(ph, off - PH_OBJ_HDR) : UINT32_MAX;
  if (c == UINT32_MAX)
    keel_die(call, "offset 0x%llx is not inside the heap of %s", (unsigned long long)off, ph->path);
  if (keel_unlikely(_keel_ph_forked(ph))) return forked_live_class(ph, c, off, call);
  /* Acquire pairs with the release in __boot_one: chunk_run is built. */
  if (keel_unlikely(c >= keel_load_acquire(&ph->booted))) boot_for_object(ph, c, off, call);
  ph_run_t *r = ph->chunk_run[c];
  if (r == NULL) {
    uint64_t w = keel_load_acquire(ATOMIC64(ph_cword(ph, c)));
    if (PH_CW_TYPE(w) != PH_CW_HUGE || off != ph_chunk_off(ph, c) + PH_OBJ_HDR)
      keel_die(call, "offset 0x%llx is not a live object of %s (double free?)",
               (unsigned long long)off, ph->path);
    return -1;
  }
  if (!run_block_live(ph, r->chunk, &_keel_ph_classes[r->cls], off))
    keel_die(call, "offset 0x%llx is not a live object of %s (double free?)",
             (unsigned long long)off, ph->path);
  return (int)r->cls;
}

size_t _keel_ph_usable_new(keel_pheap_t *ph, int cls, keel_poff_t off) {
  if (cls >= 0) return _keel_ph_classes[cls].block - PH_OBJ_HDR;
  /* Huge: its chunk word is written by the publish; the length as
   * _keel_ph_mark will write it. */
  uint64_t size = ((const ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR))->size;
  return (size + PH_OBJ_HDR + PH_CHUNK - 1) / PH_CHUNK * PH_CHUNK - PH_OBJ_HDR;
}

size_t _keel_ph_usable(keel_pheap_t *ph, int cls, keel_poff_t off) {
  if (cls >= 0) return _keel_ph_usable_new(ph, cls, off);
  uint64_t w = *ph_cword(ph, _keel_ph_chunk_at(ph, off - PH_OBJ_HDR));
  return PH_CW_LEN(w) * PH_CHUNK - PH_OBJ_HDR;
}

void _keel_ph_init_obj(keel_pheap_t *ph, keel_poff_t off, size_t size, uint64_t type, bool zero) {
  ph_objhdr_t *h = (ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR);
  h->size = size;
  h->type = type;
  if (zero) memset(h + 1, 0, size);
}

int _keel_ph_heap_boot(keel_pheap_t *ph, ph_tcache_t *tc) {
  (void)tc;
  keel_store_relaxed(&ph->booted, 0);
  return 0;
}

/* Boots the run or free chunk at the cursor and moves it past; ph->lock
 * held. Lock order: ph->lock, then a classq lock. 0 or KEEL_ECORRUPT (the
 * cursor stays: nothing past a bad chunk word is trusted). */
static int __boot_one(keel_pheap_t *ph, ph_tcache_t *tc) {
  uint32_t c = keel_load_relaxed(&ph->booted), n = keel_load_relaxed(&ph->nchunks);
  if (c >= n) return 0;
  uint64_t w = *ph_cword(ph, c);
  uint32_t len = PH_CW_LEN(w), t = PH_CW_TYPE(w);
  if (t == PH_CW_FREE) {
    ph->chunk_free[c] = 1;
    keel_store_release(&ph->booted, c + 1);
    return 0;
  }
  if ((t != PH_CW_RUN && t != PH_CW_HUGE) || len == 0 ||
      c % PH_ZONE_CHUNKS + len > PH_ZONE_CHUNKS || c + len > n)
    return KEEL_ECORRUPT;
  if (t == PH_CW_RUN) {
    ph_run_hdr_t *h = (ph_run_hdr_t *)(ph->view.base + ph_chunk_off(ph, c));
    int cls = class_exact(h->block);
    if (h->magic != PH_RUN_MAGIC || cls < 0 || _keel_ph_classes[cls].chunks != len ||
        _keel_ph_classes[cls].nblocks != h->nblocks)
      return KEEL_ECORRUPT;
    ph_run_t *r = run_new(c, (uint32_t)cls, h->nblocks, tc->arena);
    if (r == NULL) keel_die("keel_pheap", "out of memory rebuilding a run of %s", ph->path);
    const uint64_t *bm = run_bitmap(ph, c);
    for (uint32_t i = 0; i < h->nblocks; i += 64) {
      uint32_t left = h->nblocks - i;
      uint64_t valid = left >= 64 ? ~0ull : (1ull << left) - 1;
      r->vfree[i / 64] = ~bm[i / 64] & valid;
      r->navail += (uint32_t)__builtin_popcountll(r->vfree[i / 64]);
    }
    if (r->navail == h->nblocks) { /* empty: give the chunks back */
      free(r->vfree);
      free(r);
      keel_store_release(ATOMIC64(ph_cword(ph, c)), 0);
      _keel_pm_flush(ph, tc, ph_cword(ph, c), 8, PH_S_GIVEBACK);
      _keel_pm_drain(ph, tc);
      memset(ph->chunk_free + c, 1, len);
    } else {
      for (uint32_t i = 0; i < len; i++) ph->chunk_run[c + i] = r;
      if (r->navail) {
        ph_classq_t *q = classq_of(ph, tc->arena, (unsigned)cls);
        pthread_mutex_lock(&q->lock);
        __run_list(q, r);
        pthread_mutex_unlock(&q->lock);
      }
    }
  }
  /* Release: a reader that sees the cursor past c sees chunk_run/chunk_free. */
  keel_store_release(&ph->booted, c + len);
  return 0;
}

/* Boots runs (into tc's arena) until one of class cls with free blocks is
 * listed there: 1, or 0 when every chunk is booted, or KEEL_ECORRUPT. */
static int boot_for_class(keel_pheap_t *ph, ph_tcache_t *tc, unsigned cls) {
  if (keel_load_acquire(&ph->booted) >= keel_load_acquire(&ph->nchunks)) return 0;
  ph_classq_t *q = classq_of(ph, tc->arena, cls);
  int rc = 0;
  pthread_mutex_lock(&ph->lock);
  while (keel_load_relaxed(&ph->booted) < keel_load_relaxed(&ph->nchunks)) {
    if ((rc = __boot_one(ph, tc)) != 0) break;
    pthread_mutex_lock(&q->lock);
    bool found = q->partial != NULL;
    pthread_mutex_unlock(&q->lock);
    if (found) {
      rc = 1;
      break;
    }
  }
  pthread_mutex_unlock(&ph->lock);
  return rc;
}

int _keel_ph_boot_upto(keel_pheap_t *ph, ph_tcache_t *tc, uint32_t chunk) {
  int rc = 0;
  pthread_mutex_lock(&ph->lock);
  while (rc == 0 && keel_load_relaxed(&ph->booted) <= chunk &&
         keel_load_relaxed(&ph->booted) < keel_load_relaxed(&ph->nchunks))
    rc = __boot_one(ph, tc);
  pthread_mutex_unlock(&ph->lock);
  return rc;
}

void _keel_ph_heap_fini(keel_pheap_t *ph) {
  if (ph->chunk_run == NULL) return;
  uint32_t n = keel_load_relaxed(&ph->nchunks);
  for (uint32_t c = 0; c < n;) {
    ph_run_t *r = ph->chunk_run[c];
    if (r == NULL) {
      c++;
      continue;
    }
    c += _keel_ph_classes[r->cls].chunks; /* a run's chunks all point to it: skip them */
    free(r->vfree);
    free(r);
  }
}

int keel_pheap_foreach(keel_pheap_t *ph, uint64_t type,
                       int (*fn)(keel_pheap_t *ph, keel_poff_t off, void *arg), void *arg) {
  uint32_t n = keel_load_acquire(&ph->nchunks);
  for (uint32_t c = 0; c < n;) {
    /* Acquire pairs with the release in run_create: a run word seen here
     * comes with its header and bitmap. */
    uint64_t w = keel_load_acquire(ATOMIC64(ph_cword(ph, c)));
    uint32_t len = PH_CW_LEN(w) ? PH_CW_LEN(w) : 1;
    if (PH_CW_TYPE(w) == PH_CW_HUGE) {
      keel_poff_t off = ph_chunk_off(ph, c) + PH_OBJ_HDR;
      const ph_objhdr_t *h = (const ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR);
      if (type == KEEL_PHEAP_ANY_TYPE || h->type == type) {
        int rc = fn(ph, off, arg);
        if (rc) return rc;
      }
    } else if (PH_CW_TYPE(w) == PH_CW_RUN) {
      const ph_run_hdr_t *rh = (const ph_run_hdr_t *)(ph->view.base + ph_chunk_off(ph, c));
      uint64_t *bm = run_bitmap(ph, c);
      for (uint32_t i = 0; i < rh->nblocks; i += 64) {
        uint64_t bits = keel_load_relaxed(ATOMIC64(bm + i / 64));
        for (; bits; bits &= bits - 1) {
          uint32_t b = i + (uint32_t)__builtin_ctzll(bits);
          keel_poff_t off =
              ph_chunk_off(ph, c) + rh->data_off + (uint64_t)b * rh->block + PH_OBJ_HDR;
          const ph_objhdr_t *h = (const ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR);
          if (type == KEEL_PHEAP_ANY_TYPE || h->type == type) {
            int rc = fn(ph, off, arg);
            if (rc) return rc;
          }
        }
      }
    }
    c += len;
  }
  return 0;
}
