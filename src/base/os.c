/* OS memory: see os.h for the states a range goes through.
 *
 * Alignment beyond the page size is had by over-reserving `size + align` and
 * unmapping the two ends, so no address space stays wasted. No function here
 * allocates or takes a lock: the heap calls them from inside malloc.
 */
#define _GNU_SOURCE
#include "os.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "atomic.h"

#ifndef MAP_NORESERVE
#define MAP_NORESERVE 0
#endif

static keel_atomic(size_t) page_size_cache;

size_t _keel_os_page_size(void) {
  size_t ps = keel_load_relaxed(&page_size_cache);
  if (keel_unlikely(ps == 0)) {
    long v = sysconf(_SC_PAGESIZE);
    ps = v > 0 ? (size_t)v : 4096;
    keel_store_relaxed(&page_size_cache, ps); /* idempotent: every thread computes the same */
  }
  return ps;
}

size_t _keel_os_huge_page_size(void) {
  static keel_atomic(size_t) cache;
  size_t hs = keel_load_relaxed(&cache);
  if (hs != 0) return hs;
  hs = (size_t)2 << 20;
  int fd = open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    char buf[32];
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n > 0) {
      size_t v = 0;
      for (ssize_t i = 0; i < n && buf[i] >= '0' && buf[i] <= '9'; i++)
        v = v * 10 + (size_t)(buf[i] - '0');
      if (KEEL_IS_POW2(v)) hs = v;
    }
  }
  keel_store_relaxed(&cache, hs);
  return hs;
}

/* Fault injection (os.h): -1 off; otherwise how many more calls succeed. */
static keel_atomic(long) fault_left = -1;
static keel_atomic(size_t) fault_hits;

void _keel_os_fault_set(long n) {
  keel_store_relaxed(&fault_left, n < 0 ? -1 : n);
}

size_t _keel_os_fault_hits(void) {
  return keel_load_relaxed(&fault_hits);
}

/* True when the injection says this call fails. The countdown is claimed
 * with a CAS so that n successes are handed out exactly, whichever threads
 * ask; relaxed is enough: it orders nothing but itself. */
static bool fault_now(void) {
  long left = keel_load_relaxed(&fault_left);
  while (keel_unlikely(left >= 0)) {
    if (left == 0) {
      atomic_fetch_add_explicit(&fault_hits, 1, memory_order_relaxed);
      return true;
    }
    if (atomic_compare_exchange_weak_explicit(&fault_left, &left, left - 1, memory_order_relaxed,
                                              memory_order_relaxed))
      return false;
  }
  return false;
}

static void *map_aligned(size_t size, size_t align, int prot, int flags) {
  if (fault_now()) {
    errno = ENOMEM;
    return NULL;
  }
  size_t ps = _keel_os_page_size();
  if (align < ps) align = ps;
  if (size == 0 || !KEEL_IS_POW2(align) || size > SIZE_MAX - align) {
    errno = ENOMEM;
    return NULL;
  }
  size = KEEL_ALIGN_UP(size, ps);
  flags |= MAP_PRIVATE | MAP_ANONYMOUS;
  void *p = mmap(NULL, size, prot, flags, -1, 0);
  if (p == MAP_FAILED) goto fail;
  if (((uintptr_t)p & (align - 1)) == 0) return p;
  /* Unaligned: retry with room to trim both ends to the alignment. */
  munmap(p, size);
  p = mmap(NULL, size + align, prot, flags, -1, 0);
  if (p == MAP_FAILED) goto fail;
  uintptr_t start = KEEL_ALIGN_UP((uintptr_t)p, align);
  size_t head = start - (uintptr_t)p, tail = align - head;
  if (head != 0) munmap(p, head);
  if (tail != 0) munmap((void *)(start + size), tail);
  return (void *)start;
fail:
  errno = ENOMEM;
  return NULL;
}

void *_keel_os_reserve(size_t size, size_t align) {
  return map_aligned(size, align, PROT_NONE, MAP_NORESERVE);
}

void *_keel_os_alloc(size_t size, size_t align) {
  return map_aligned(size, align, PROT_READ | PROT_WRITE, 0);
}

int _keel_os_commit(void *p, size_t size) {
  if (fault_now()) return KEEL_ENOMEM;
  return mprotect(p, size, PROT_READ | PROT_WRITE) == 0 ? 0 : KEEL_ENOMEM;
}

int _keel_os_decommit(void *p, size_t size) {
  /* Mapping fresh PROT_NONE pages over the range drops the pages and the
   * commit charge in one call, where madvise+mprotect would take two. */
  void *q =
      mmap(p, size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return q == p ? 0 : -errno;
}

bool _keel_os_as_limited(void) {
  struct rlimit rl;
  return getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY;
}

bool _keel_os_mapped(void *p) {
  unsigned char v;
  void *page = (void *)((uintptr_t)p & ~(uintptr_t)(_keel_os_page_size() - 1));
  return mincore(page, 1, &v) == 0 || errno != ENOMEM;
}

int _keel_os_retire(void *p, size_t size) {
  void *q =
      mmap(p, size, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return q == p ? 0 : -errno;
}

int _keel_os_purge(void *p, size_t size, bool lazy) {
#ifdef MADV_FREE
  if (lazy && madvise(p, size, MADV_FREE) == 0) return 0;
#else
  (void)lazy;
#endif
  return madvise(p, size, MADV_DONTNEED) == 0 ? 0 : -errno;
}

void *_keel_os_remap(void *p, size_t old, size_t size, void *to) {
  if (size > old && fault_now()) {
    errno = ENOMEM;
    return NULL;
  }
  void *q = to == NULL ? mremap(p, old, size, 0)
                       : mremap(p, old, size, MREMAP_MAYMOVE | MREMAP_FIXED, to);
  if (q == MAP_FAILED || (to != NULL && q != to)) {
    errno = ENOMEM;
    return NULL;
  }
  return q;
}

int _keel_os_release(void *p, size_t size) {
  return munmap(p, size) == 0 ? 0 : -errno;
}

void _keel_os_advise_huge(void *p, size_t size) {
#ifdef MADV_HUGEPAGE
  (void)madvise(p, size, MADV_HUGEPAGE);
#else
  (void)p, (void)size;
#endif
}

size_t _keel_os_rss_kb(void) {
  int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[128];
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  /* statm: size resident shared text lib data dt, in pages. */
  const char *s = buf;
  while (*s && *s != ' ') s++;
  size_t pages = 0;
  for (s++; *s >= '0' && *s <= '9'; s++) pages = pages * 10 + (size_t)(*s - '0');
  return pages * (_keel_os_page_size() / 1024);
}
