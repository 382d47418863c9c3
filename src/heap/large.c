/* Large blocks (above 256 KiB): mapped directly, 4 MiB-aligned, with a
 * one-page header (the segment header layout, so free finds it by masking).
 *
 * Choice: a small cache of freed mappings instead of purge-and-refault.
 * jemalloc and mimalloc carve large blocks out of their arenas and purge
 * them on a timer, so a program cycling 5-25 MiB buffers refaults (and the
 * kernel re-zeroes) every page each cycle: 16-20 s of sys time where glibc,
 * which keeps such chunks in its heap, spends about 1 s. keel keeps up to
 * 16 freed mappings (at most a quarter of the live large bytes, between
 * 32 MiB and 1 GiB) for heap_purge_ms; a new large request
 * takes the closest one and resizes it with mremap, which moves page tables,
 * not pages: the part that is kept does not fault again, a shrink unmaps the
 * tail at once (RSS falls), a growth faults only the new part. A mapping at
 * most twice the request is used as it is: shrinking it would only make the
 * next, larger request fault the tail back in (measured on 5-25 MiB blocks:
 * sys time 0.37 s with shrinking, 0.32 s without, glibc 0.28 s; peak RSS
 * 363 -> 382 MiB, glibc 416 MiB). The cost: up to one request's worth of
 * resident tail per reused mapping until it is freed. Mappings that
 * stay unused past the delay are unmapped.
 *
 * Spares: while the cache holds fewer than CACHE_SPARES mappings, a request
 * that none of them fits gets a fresh mapping and leaves them cached. With
 * a program that frees one block and then allocates one, growing the only
 * cached mapping faulted its new part in about every other time and left
 * the cache empty, with no choice for the next request; a few spares of
 * assorted sizes let most requests find one that fits (5-25 MiB blocks:
 * sys time 0.39-0.58 s -> 0.31-0.35 s, glibc 0.31-0.42 s in the same runs;
 * peak RSS 386 -> 413 MiB, glibc 420 MiB). The limits on cached bytes are
 * unchanged.
 *
 * realloc of a large block is the same mremap: in place when the address
 * space after it is free, else moved (MREMAP_FIXED into a fresh aligned
 * reservation), never copied.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/mman.h>

#include "base/clock.h"
#include "base/die.h"
#include "base/options.h"
#include "base/os.h"
#include "heap/internal.h"
#if defined(KEEL_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

#define CACHE_SLOTS     16
#define CACHE_MAX_BYTES ((size_t)1 << 30)
#define CACHE_MIN_BYTES ((size_t)32 << 20)
#define CACHE_SPARES    4

typedef struct {
  keel_segment_t *seg;
  uint64_t freed_at;
} cache_slot_t;

static pthread_mutex_t large_lock = PTHREAD_MUTEX_INITIALIZER;
/* Held by the collector from taking mappings out of the cache until it has
 * unmapped them, and by fork's prepare handler (before every other heap
 * lock): a child is never forked in between, when it would inherit up to
 * the whole cache (1 GiB) mapped and resident with no record of it. Only
 * the collector and fork take it, so malloc and free never wait on the
 * munmaps; fork waits for them. */
static pthread_mutex_t release_lock = PTHREAD_MUTEX_INITIALIZER;
void (*_keel_large_collect_pause)(void);
void (*_keel_large_remap_moved)(void *old, void *to);
static cache_slot_t cache[CACHE_SLOTS];
static unsigned cache_n;
static size_t cache_bytes;
static keel_atomic(size_t) live_count, live_bytes, live_requested, cached_bytes_pub;
/* Of live_bytes (mapped), the bytes before each block: the header page and
 * any alignment gap, so that live_bytes - live_hdr_bytes is what the blocks
 * can use (keel_usable_size), which keel_heap_stats reports as live. Set at
 * allocation; realloc keeps a block's offset, so it leaves this alone. */
static keel_atomic(size_t) live_hdr_bytes;

void _keel_large_lock(void) {
  pthread_mutex_lock(&large_lock);
}
void _keel_large_unlock(void) {
  pthread_mutex_unlock(&large_lock);
}
void _keel_large_release_lock(void) {
  pthread_mutex_lock(&release_lock);
}
void _keel_large_release_unlock(void) {
  pthread_mutex_unlock(&release_lock);
}

static size_t page_up(size_t n) {
  return KEEL_ALIGN_UP(n, _keel_os_page_size());
}

/* Resizes a mapping, moving it (page tables only) if it cannot grow in
 * place; keeps the segment map in step. NULL if the address space is full.
 * The old base's bit is cleared before the move, while the range is still
 * ours (as release() does before munmap): the moment mremap unmaps it,
 * another thread's fresh mapping may land there and set the same bit, and
 * a clear after the move wiped that bit, so the other block's free died
 * with "invalid pointer" (found by review). A failed move leaves the
 * mapping where it was, so its bit goes back; no one else can have mapped
 * the still-mapped range meanwhile. A destination above the space the map
 * covers is refused like a full address space.
 *
 * The move holds move_lock for reading, and fork takes it for writing: a
 * child forked between the clear and the set would inherit the block with
 * no bit at either address (its free there died "invalid pointer"), and
 * one forked after the reservation a stray one. Readers never wait on each
 * other; writers are preferred, so a stream of moves cannot hold fork off.
 * A fork from a signal handler that interrupted a move on the same thread
 * waits for ever on that read hold (as it would on any allocator lock a
 * handler interrupts: glibc's manual marks fork AS-Unsafe for its atfork
 * handlers). */
static pthread_rwlock_t move_lock = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;

void _keel_large_move_lock(void) {
  pthread_rwlock_wrlock(&move_lock);
}
void _keel_large_move_unlock(void) {
  pthread_rwlock_unlock(&move_lock);
}
void _keel_large_move_child_reset(void) {
#if defined(KEEL_TSAN)
  /* TSan's rwlock_init keeps the write hold fork_prepare recorded, and
   * every lock the child took after it made a false order edge. */
  __tsan_mutex_pre_unlock(&move_lock, 0);
  __tsan_mutex_post_unlock(&move_lock, 0);
#endif
  pthread_rwlockattr_t a;
  pthread_rwlockattr_init(&a);
  pthread_rwlockattr_setkind_np(&a, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  pthread_rwlock_init(&move_lock, &a);
  pthread_rwlockattr_destroy(&a);
}

/* _keel_os_alloc for a large or huge block, tried once more where retained
 * segments took the address space it needed (a RLIMIT_AS set after they
 * were retained: the next collection would unmap them anyway). */
static void *large_map(size_t size, size_t align) {
  void *p = _keel_os_alloc(size, align);
  if (p == NULL && _keel_segments_unretain_for_space()) p = _keel_os_alloc(size, align);
  return p;
}

static keel_segment_t *remap(keel_segment_t *seg, size_t old, size_t size) {
  if (size == old) return seg;
  if (_keel_os_remap(seg, old, size, NULL) == seg) return seg; /* the base stays: its bit too */
  pthread_rwlock_rdlock(&move_lock);
  void *to = _keel_os_reserve(size, KEEL_SEGMENT_SIZE);
  if (to == NULL && _keel_segments_unretain_for_space())
    to = _keel_os_reserve(size, KEEL_SEGMENT_SIZE);
  if (to != NULL && !_keel_segmap_covers(to)) {
    _keel_os_release(to, size);
    to = NULL;
  }
  if (to != NULL) {
    _keel_segmap_set(seg, false);
    if (_keel_os_remap(seg, old, size, to) == to) {
      if (keel_unlikely(_keel_large_remap_moved != NULL)) _keel_large_remap_moved(seg, to);
      _keel_segmap_set(to, true);
    } else {
      _keel_segmap_set(seg, true);
      _keel_os_release(to, size);
      to = NULL;
    }
  }
  pthread_rwlock_unlock(&move_lock);
  return to;
}

/* The most the cache may hold: a quarter of the live large bytes (at least
 * 32 MiB, at most 1 GiB), enough to turn over the blocks a program cycles
 * through, not so much that freed mappings dominate its RSS. */
static size_t cache_limit(void) {
  size_t limit = keel_load_relaxed(&live_bytes) / 4;
  if (limit < CACHE_MIN_BYTES) limit = CACHE_MIN_BYTES;
  if (limit > CACHE_MAX_BYTES) limit = CACHE_MAX_BYTES;
  return limit;
}

/* Takes the cached mapping closest in size to `size` (the smallest that is
 * large enough, else the largest), or none while the cache keeps spares
 * (see the file comment). */
static keel_segment_t *cache_take(size_t size) {
  if (keel_load_relaxed(&cached_bytes_pub) == 0) return NULL;
  pthread_mutex_lock(&large_lock);
  int best = -1;
  for (unsigned i = 0; i < cache_n; i++) {
    size_t m = cache[i].seg->mapped;
    if (best < 0) {
      best = (int)i;
      continue;
    }
    size_t b = cache[best].seg->mapped;
    bool fits = m >= size, bfits = b >= size;
    if ((fits && (!bfits || m < b)) || (!fits && !bfits && m > b)) best = (int)i;
  }
  keel_segment_t *seg = NULL;
  /* Spares only where the fresh mapping can join them once freed: with no
   * room left for it, it would be unmapped at every free and mapped and
   * faulted in again at every request until the spares aged out (found by
   * review: 6,400 faults a cycle for a 20 MiB spare and 25 MiB requests). */
  if (best >= 0 && cache[best].seg->mapped < size && cache_n < CACHE_SPARES &&
      cache_bytes + size <= cache_limit())
    best = -1;
  if (best >= 0) {
    seg = cache[best].seg;
    cache[best] = cache[--cache_n];
    cache_bytes -= seg->mapped;
    keel_store_relaxed(&cached_bytes_pub, cache_bytes);
  }
  pthread_mutex_unlock(&large_lock);
  return seg;
}

/* The user pointers of the last large and huge blocks unmapped. A second
 * free of one finds no mapping and would be called an invalid pointer:
 * _keel_die_invalid asks here first, to say "double free" (once its slot
 * is reused, or if another mapping now has the address, the message is
 * the plainer one; either way the process aborts). Written racily: read
 * only on the way to an abort. */
#define GONE_SLOTS 64
static keel_atomic(uintptr_t) gone[GONE_SLOTS];
static keel_atomic(unsigned) gone_next;

static void note_gone(const void *user) {
  unsigned i = keel_fetch_add_relaxed(&gone_next, 1) % GONE_SLOTS;
  keel_store_relaxed(&gone[i], (uintptr_t)user);
}

bool _keel_large_gone(const void *p) {
  bool found = false;
  for (unsigned i = 0; i < GONE_SLOTS && !found; i++)
    found = keel_load_relaxed(&gone[i]) == (uintptr_t)p;
  if (!found) return false;
  /* And still unmapped: a pointer into a mapping made there since (the
   * program's own mmap) is an invalid pointer, not our block. */
  unsigned char v;
  uintptr_t page = (uintptr_t)p & ~(uintptr_t)(_keel_os_page_size() - 1);
  return mincore((void *)page, 1, &v) != 0 && errno == ENOMEM;
}

static void release(keel_segment_t *seg) {
  note_gone((uint8_t *)seg + seg->user_off);
  _keel_segmap_set(seg, false);
  _keel_os_release(seg, seg->mapped);
}

/* Alignments above half a segment: the user pointer is then segment-aligned
 * itself, so no header can sit at `p & ~(segment size - 1)`. Such blocks
 * are not in the segment map; they are found on this list (under
 * large_lock) by the slow paths that meet a pointer the map does not know,
 * before they call it invalid. Rare (posix_memalign of 4 MiB and up), so a
 * list walk is fine. Layout: the header at the mapping's base, the block at
 * base + align (address space only: the gap is never touched). */
typedef struct huge_hdr {
  struct huge_hdr *next;
  void *user;
  size_t mapped, size;
} huge_hdr_t;

static huge_hdr_t *huge_list;

static void *huge_alloc(size_t size, size_t align) {
  if (size > PTRDIFF_MAX - align - KEEL_SEGMENT_SIZE) {
    _keel_reject("malloc", "%zu bytes (aligned to %zu) is above PTRDIFF_MAX", size, align);
    errno = ENOMEM;
    return NULL;
  }
  size_t mapped = page_up(align + size);
  huge_hdr_t *h = large_map(mapped, align);
  if (h == NULL) return NULL;
  h->user = (uint8_t *)h + align;
  h->mapped = mapped;
  h->size = size;
  pthread_mutex_lock(&large_lock);
  h->next = huge_list;
  huge_list = h;
  pthread_mutex_unlock(&large_lock);
  keel_fetch_add_relaxed(&live_count, 1);
  keel_fetch_add_relaxed(&live_bytes, mapped);
  keel_fetch_add_relaxed(&live_hdr_bytes, align);
  keel_fetch_add_relaxed(&live_requested, size);
  return h->user;
}

/* The huge block starting at p: unlinked when `take`. Caller holds large_lock. */
static huge_hdr_t *__huge_find(const void *p, bool take) {
  for (huge_hdr_t **link = &huge_list; *link != NULL; link = &(*link)->next) {
    huge_hdr_t *h = *link;
    if (h->user != p) continue;
    if (take) *link = h->next;
    return h;
  }
  return NULL;
}

bool _keel_huge_free(void *p) {
  if (keel_load_relaxed(&live_count) == 0) return false;
  pthread_mutex_lock(&large_lock);
  huge_hdr_t *h = __huge_find(p, true);
  pthread_mutex_unlock(&large_lock);
  if (h == NULL) return false;
  keel_fetch_sub_relaxed(&live_count, 1);
  keel_fetch_sub_relaxed(&live_bytes, h->mapped);
  keel_fetch_sub_relaxed(&live_hdr_bytes, (size_t)((uint8_t *)h->user - (uint8_t *)h));
  keel_fetch_sub_relaxed(&live_requested, h->size);
  note_gone(h->user);
  _keel_os_release(h, h->mapped);
  return true;
}

size_t _keel_huge_usable(const void *p) {
  if (keel_load_relaxed(&live_count) == 0) return 0;
  pthread_mutex_lock(&large_lock);
  huge_hdr_t *h = __huge_find(p, false);
  size_t n = h != NULL ? h->mapped - (size_t)((uint8_t *)h->user - (uint8_t *)h) : 0;
  pthread_mutex_unlock(&large_lock);
  return n;
}

void *_keel_large_alloc(size_t size, size_t align, bool zero) {
  /* A zero-size block still needs a byte of its own: with an alignment of
   * 2 MiB or more, size 0 put the pointer one past its own mapping, so
   * usable_size and free called it invalid. */
  if (size == 0) size = 1;
  size_t off = KEEL_LARGE_HDR;
  if (align > off) off = align;
  if (align > KEEL_SEGMENT_SIZE / 2) return huge_alloc(size, align); /* zero: fresh mapping */
  if (size > PTRDIFF_MAX - off - KEEL_SEGMENT_SIZE) {
    _keel_reject("malloc", "%zu bytes is above PTRDIFF_MAX", size);
    errno = ENOMEM;
    return NULL;
  }
  size_t need = page_up(off + size);
  keel_segment_t *seg = cache_take(need);
  bool fresh = seg == NULL;
  if (seg != NULL && seg->mapped >= need && seg->mapped - need <= need) {
    need = seg->mapped; /* keep its tail resident: no unmap now, no refault later */
  } else if (seg != NULL) {
    keel_segment_t *s = remap(seg, seg->mapped, need);
    if (s == NULL) {
      release(seg);
      fresh = true;
    }
    seg = s;
  }
  if (seg == NULL) {
    seg = large_map(need, KEEL_SEGMENT_SIZE);
    if (seg == NULL || !_keel_segmap_covers(seg)) {
      if (seg != NULL) _keel_os_release(seg, need);
      errno = ENOMEM;
      return NULL;
    }
    _keel_segmap_set(seg, true);
  }
  seg->kind = KEEL_SEG_LARGE;
  seg->mapped = need;
  seg->user_off = off;
  seg->req = size;
  uint8_t *p = (uint8_t *)seg + off;
  if (zero && !fresh) memset(p, 0, size);
  keel_fetch_add_relaxed(&live_count, 1);
  keel_fetch_add_relaxed(&live_bytes, need);
  keel_fetch_add_relaxed(&live_hdr_bytes, off);
  keel_fetch_add_relaxed(&live_requested, size);
  return p;
}

void _keel_large_free(keel_segment_t *seg) {
  keel_fetch_sub_relaxed(&live_count, 1);
  keel_fetch_sub_relaxed(&live_bytes, seg->mapped);
  keel_fetch_sub_relaxed(&live_hdr_bytes, seg->user_off);
  keel_fetch_sub_relaxed(&live_requested, seg->req);
  seg->kind = KEEL_SEG_LARGE_CACHED;
  bool cached = false;
  if (_keel_option(KEEL_OPT_heap_purge_ms) > 0) {
    pthread_mutex_lock(&large_lock);
    if (cache_n < CACHE_SLOTS && cache_bytes + seg->mapped <= cache_limit()) {
      cache[cache_n].seg = seg;
      cache[cache_n].freed_at = keel_clock_coarse_ms();
      cache_n++;
      cache_bytes += seg->mapped;
      keel_store_relaxed(&cached_bytes_pub, cache_bytes);
      cached = true;
      _keel_purge_note_work();
    }
    pthread_mutex_unlock(&large_lock);
  }
  if (!cached) release(seg);
  _keel_purge_schedule();
}

void *_keel_large_realloc(keel_segment_t *seg, size_t size) {
  size_t off = seg->user_off;
  if (size > PTRDIFF_MAX - off - KEEL_SEGMENT_SIZE) {
    _keel_reject("realloc", "%zu bytes is above PTRDIFF_MAX", size);
    errno = ENOMEM;
    return NULL;
  }
  size_t old = seg->mapped, oldreq = seg->req, need = page_up(off + size);
  keel_segment_t *s = remap(seg, old, need);
  if (s == NULL) {
    errno = ENOMEM;
    return NULL;
  }
  s->mapped = need;
  s->req = size;
  keel_fetch_add_relaxed(&live_bytes, need - old);
  keel_fetch_add_relaxed(&live_requested, size - oldreq);
  return (uint8_t *)s + off;
}

size_t _keel_large_collect(bool force) {
  if (keel_load_relaxed(&cached_bytes_pub) == 0) return 0;
  uint64_t now = keel_clock_coarse_ms();
  uint64_t delay = (uint64_t)_keel_option(KEEL_OPT_heap_purge_ms);
  keel_segment_t *out[CACHE_SLOTS];
  unsigned n = 0;
  pthread_mutex_lock(&release_lock);
  pthread_mutex_lock(&large_lock);
  for (unsigned i = 0; i < cache_n;) {
    if (force || now >= cache[i].freed_at + delay) {
      out[n++] = cache[i].seg;
      cache_bytes -= cache[i].seg->mapped;
      cache[i] = cache[--cache_n];
    } else {
      i++;
    }
  }
  keel_store_relaxed(&cached_bytes_pub, cache_bytes);
  pthread_mutex_unlock(&large_lock);
  if (keel_unlikely(_keel_large_collect_pause != NULL) && n > 0) _keel_large_collect_pause();
  size_t bytes = 0;
  for (unsigned i = 0; i < n; i++) {
    bytes += out[i]->mapped;
    release(out[i]);
  }
  pthread_mutex_unlock(&release_lock);
  keel_fetch_add_relaxed(&_keel_purged_bytes, bytes);
  return bytes;
}

bool _keel_large_pending(void) {
  return keel_load_relaxed(&cached_bytes_pub) != 0;
}

void _keel_large_totals(size_t *live, size_t *bytes, size_t *cached, size_t *requested) {
  *live = keel_load_relaxed(&live_count);
  *bytes = keel_load_relaxed(&live_bytes);
  *cached = keel_load_relaxed(&cached_bytes_pub);
  *requested = keel_load_relaxed(&live_requested);
}

size_t _keel_large_usable(void) {
  size_t bytes = keel_load_relaxed(&live_bytes), hdr = keel_load_relaxed(&live_hdr_bytes);
  return bytes > hdr ? bytes - hdr : 0; /* read one by one while others run */
}
