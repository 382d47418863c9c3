/* pheap persistence: the one path by which stores reach the media.
 *
 * _keel_pm_flush(addr, len) starts write-back of the lines of a range;
 * _keel_pm_drain() is the persist barrier: when it returns, everything
 * flushed before it by this thread is durable. Modes (KEEL_OPTIONS
 * pheap_flush):
 *   clwb / clflushopt / clflush  flush = one instruction per 64-byte line,
 *                  drain = SFENCE (after CLFLUSH too: it is ordered, but the
 *                  logs' non-temporal stores are not). Only correct where the
 *                  mapping is DAX (stores in the CPU caches are the only
 *                  volatile copy); "auto" picks the best the CPU has when the
 *                  MAP_SYNC mapping succeeded.
 *   msync          flush records the page range, drain msyncs the span of
 *                  them in one call; auto's choice for
 *                  any file that is not DAX. On a memory file system
 *                  (tmpfs, ramfs, hugetlbfs) the drain is fdatasync(fd)
 *                  instead: msync(MS_SYNC) is the file's fsync over the range
 *                  (mm/msync.c), and there fsync is a no-op whatever the range,
 *                  so the two calls make the same promise; fdatasync skips
 *                  msync's VMA walk under mmap_lock (121 against 185 ns
 *                  here), a lock that mmap, munmap and mprotect of a
 *                  server's other threads take for writing. It syncs
 *                  through the pool's own fd, held open until close (growth
 *                  and simulated media use it too). Everywhere else the
 *                  range matters (a disk file would write every dirty page
 *                  of the pool), so msync. The bench's msync cases run on
 *                  /dev/shm and so measure this call.
 *   none           nothing (benchmarks of the algorithm alone; not durable).
 * Simulated media (tests, _keel_ph_sim_next): the pool is mapped privately,
 * so a store reaches the file only when a drain pwrite()s the lines flushed
 * before it; _keel_pm_sim_crash writes a seeded torn subset of the flushed but
 * undrained lines and is what a test's crash hook calls before _exit.
 *
 * Logs are written with _keel_pm_write_nt: non-temporal stores in the CPU
 * modes, which reach the persistence domain at the next SFENCE without a
 * flush (measured here, AMD EPYC: 100 ns for a line written so and fenced,
 * against 300-450 ns for a store + CLWB/CLFLUSHOPT + SFENCE).
 * Every drain runs _keel_ph_barrier_hook first, which is how tests number
 * barriers and crash at barrier k. Flush calls and barriers are counted per
 * thread cache.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/die.h"
#include "base/options.h"
#include "pheap/pheap_int.h"

int _keel_ph_fault = PH_S_NONE;
void (*_keel_ph_barrier_hook)(keel_pheap_t *ph, ph_tcache_t *tc);
bool _keel_ph_sim_next;

static int cpu_flush_best(void) {
  unsigned a, b, c, d;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    if (b & (1u << 24)) return KEEL_FLUSH_CLWB;
    if (b & (1u << 23)) return KEEL_FLUSH_CLFLUSHOPT;
  }
  return KEEL_FLUSH_CLFLUSH;
}

static bool cpu_has(int mode) {
  unsigned a, b, c, d;
  if (mode == KEEL_FLUSH_CLFLUSH) return true;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return mode == KEEL_FLUSH_CLWB ? (b & (1u << 24)) != 0 : (b & (1u << 23)) != 0;
}

/* Resolves the option for this pool; `dax` tells whether MAP_SYNC worked. */
int _keel_pm_mode(keel_pheap_t *ph) {
  int opt = (int)_keel_option(KEEL_OPT_pheap_flush);
  (void)ph;
  if (opt == KEEL_FLUSH_AUTO) return KEEL_FLUSH_MSYNC; /* caller upgrades on DAX */
  if (opt >= KEEL_FLUSH_CLWB && opt <= KEEL_FLUSH_CLFLUSH && !cpu_has(opt)) {
    _keel_warn("pheap_flush=%s: this CPU lacks it, using the best it has",
               opt == KEEL_FLUSH_CLWB ? "clwb" : "clflushopt");
    return cpu_flush_best();
  }
  return opt;
}

/* Exposed for pool.c: the CPU mode auto picks on DAX. */
int _keel_pm_cpu_best(void) KEEL_HIDDEN;
int _keel_pm_cpu_best(void) {
  return cpu_flush_best();
}

const char *_keel_pm_mode_name(const keel_pheap_t *ph) {
  if (ph->sim) return "simulated media (tests)";
  switch (ph->flush_mode) {
    case KEEL_FLUSH_CLWB:
      return "clwb";
    case KEEL_FLUSH_CLFLUSHOPT:
      return "clflushopt";
    case KEEL_FLUSH_CLFLUSH:
      return "clflush";
    case KEEL_FLUSH_MSYNC:
      return ph->ram_fs ? "msync (as fdatasync: memory file system)" : "msync";
    case KEEL_FLUSH_NONE:
      return "none (not durable)";
    default:
      return "unresolved";
  }
}

/* One msync per barrier, over the span of every page flushed since the
 * last: a barrier's cost in this mode is the system call (180 ns here on
 * tmpfs whatever the length; on a disk file, one journal commit), and the
 * clean pages inside the span cost nothing more (writeback looks pages up by
 * their dirty tag). Pages that other threads dirtied inside it are written a
 * barrier early, which they needed anyway. Before, each separate range had
 * its own call (the benchmarks' barriers mostly flush one range: level). */
static void ms_add(ph_tcache_t *tc, uint64_t lo, uint64_t hi) {
  if (tc->ms_lo == tc->ms_hi) {
    tc->ms_lo = lo;
    tc->ms_hi = hi;
    return;
  }
  if (lo < tc->ms_lo) tc->ms_lo = lo;
  if (hi > tc->ms_hi) tc->ms_hi = hi;
}

static void sim_add(ph_tcache_t *tc, uint64_t line) {
  if (tc->sim_n == tc->sim_cap) {
    unsigned cap = tc->sim_cap ? tc->sim_cap * 2 : 256;
    uint64_t *n = realloc(tc->sim_lines, cap * sizeof *n);
    if (n == NULL) keel_die("pheap sim", "out of memory for the line set");
    tc->sim_lines = n;
    tc->sim_cap = cap;
  }
  tc->sim_lines[tc->sim_n++] = line;
}

void _keel_pm_flush(keel_pheap_t *ph, ph_tcache_t *tc, const void *p, size_t len,
                    enum ph_site site) {
  if (len == 0) return;
  if (keel_unlikely(_keel_ph_fault == (int)site) && site != PH_S_NONE) return;
  ph_tc_count(&tc->flushes);
  uintptr_t a = (uintptr_t)p & ~(uintptr_t)(PH_LINE - 1), end = (uintptr_t)p + len;
  if (keel_unlikely(ph->sim)) {
    for (; a < end; a += PH_LINE) sim_add(tc, a - (uintptr_t)ph->view.base);
    return;
  }
  switch (ph->flush_mode) {
    case KEEL_FLUSH_CLWB:
      for (; a < end; a += PH_LINE) __asm__ __volatile__("clwb %0" : "+m"(*(volatile char *)a));
      break;
    case KEEL_FLUSH_CLFLUSHOPT:
      for (; a < end; a += PH_LINE)
        __asm__ __volatile__("clflushopt %0" : "+m"(*(volatile char *)a));
      break;
    case KEEL_FLUSH_CLFLUSH:
      for (; a < end; a += PH_LINE) __asm__ __volatile__("clflush %0" : "+m"(*(volatile char *)a));
      break;
    case KEEL_FLUSH_MSYNC: {
      uint64_t pg = 4096, lo = (a - (uintptr_t)ph->view.base) & ~(pg - 1);
      uint64_t hi = KEEL_ALIGN_UP(end - (uintptr_t)ph->view.base, pg);
      ms_add(tc, lo, hi);
      break;
    }
    default:
      break;
  }
}

/* Simulated media's writes: a cache line goes back to memory with its
 * value at that moment, and a later write-back of the same line carries a
 * later value. sim_pwrite reads the mapping, then writes the file: two
 * threads doing so for one line could land in the reverse order, the older
 * value last (a run's bitmap word read before another thread's free cleared
 * a bit, written after that free's drain: the free was lost on the media,
 * found by the multi-threaded crash sweep). So each read-and-write is one
 * step under this lock. Tests only: real media has no such window. */
static pthread_mutex_t sim_lock = PTHREAD_MUTEX_INITIALIZER;

/* Writes [off, off + len) of the mapping to the file, 8-aligned. The bytes
 * go through word-sized atomic loads, as a cache line's write-back reads
 * each word whole: other threads may be storing to the same lines (their
 * own words), which a byte copy by pwrite would race with. Caller holds
 * sim_lock. Not seen by TSan: a write-back reads words that other threads
 * store to with plain stores, by design (their fields beside ours). */
__attribute__((no_sanitize("thread"))) static void sim_pwrite(keel_pheap_t *ph, uint64_t off,
                                                              uint64_t len) {
  uint64_t buf[512];
  while (len) {
    uint64_t n = len < sizeof buf ? len : sizeof buf;
    for (uint64_t i = 0; i < n / 8; i++)
      buf[i] =
          __atomic_load_n((const uint64_t *)(void *)(ph->view.base + off) + i, __ATOMIC_RELAXED);
    if (pwrite(ph->fd, buf, n, (off_t)off) != (ssize_t)n) keel_die("pheap sim", "pwrite failed");
    off += n;
    len -= n;
  }
}

static void sim_write_line(keel_pheap_t *ph, uint64_t off, unsigned mask) {
  if (mask == 0xff) {
    sim_pwrite(ph, off, PH_LINE);
    return;
  }
  for (unsigned w = 0; w < PH_LINE / 8; w++)
    if (mask & (1u << w)) sim_pwrite(ph, off + w * 8, 8);
}

void _keel_pm_drain(keel_pheap_t *ph, ph_tcache_t *tc) {
  if (keel_unlikely(_keel_ph_barrier_hook != NULL)) _keel_ph_barrier_hook(ph, tc);
  ph_tc_count(&tc->barriers);
  if (keel_unlikely(ph->sim)) {
    /* Runs of consecutive lines go out in one pwrite. */
    pthread_mutex_lock(&sim_lock);
    for (unsigned i = 0, j; i < tc->sim_n; i = j) {
      for (j = i + 1; j < tc->sim_n && tc->sim_lines[j] == tc->sim_lines[j - 1] + PH_LINE; j++) {}
      sim_pwrite(ph, tc->sim_lines[i], (uint64_t)(j - i) * PH_LINE);
    }
    pthread_mutex_unlock(&sim_lock);
    tc->sim_n = 0;
  } else {
    switch (ph->flush_mode) {
      case KEEL_FLUSH_CLWB:
      case KEEL_FLUSH_CLFLUSHOPT:
      case KEEL_FLUSH_CLFLUSH:
        /* CLFLUSH itself is ordered with stores, but the logs' non-temporal
         * stores (_keel_pm_write_nt) are not: without the fence a later
         * store (the apply) could reach the media before the log. */
        __asm__ __volatile__("sfence" ::: "memory");
        break;
      case KEEL_FLUSH_MSYNC:
        /* The raw system call: glibc's msync() is a cancellation point, and
         * a barrier must not be one (a thread cancelled inside a commit
         * would leave its lane locked and its log in flight). It also spares
         * the wrapper's two cancellation-state switches per call. */
        if (tc->ms_hi != tc->ms_lo && (ph->ram_fs ? syscall(SYS_fdatasync, ph->fd)
                                                  : syscall(SYS_msync, ph->view.base + tc->ms_lo,
                                                            tc->ms_hi - tc->ms_lo, MS_SYNC)) != 0)
          keel_die("keel_pheap persist", "%s failed on %s", ph->ram_fs ? "fdatasync" : "msync",
                   ph->path);
        tc->ms_lo = tc->ms_hi = 0;
        break;
      default:
        break;
    }
  }
}

void _keel_pm_write_nt(keel_pheap_t *ph, ph_tcache_t *tc, void *dst, const void *src, size_t len,
                       enum ph_site site) {
  int m = ph->flush_mode;
  if (ph->sim || (m != KEEL_FLUSH_CLWB && m != KEEL_FLUSH_CLFLUSHOPT && m != KEEL_FLUSH_CLFLUSH) ||
      (keel_unlikely(_keel_ph_fault == (int)site) && site != PH_S_NONE)) {
    memcpy(dst, src, len);
    _keel_pm_flush(ph, tc, dst, len, site);
    return;
  }
  ph_tc_count(&tc->flushes);
  long long *d = dst;
  const long long *s = src;
  for (size_t i = 0; i < len / 8; i++) __builtin_ia32_movnti64(d + i, s[i]);
}

static uint64_t sim_rand(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545f4914f6cdd1dull;
}

void _keel_pm_sim_crash(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t seed, bool torn) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  /* A random subset, in a random order, each line whole or torn at 8 bytes:
   * what write-back may have done before power failed. */
  for (unsigned i = tc->sim_n; i > 1; i--) {
    unsigned j = (unsigned)(sim_rand(&s) % i);
    uint64_t t = tc->sim_lines[i - 1];
    tc->sim_lines[i - 1] = tc->sim_lines[j];
    tc->sim_lines[j] = t;
  }
  pthread_mutex_lock(&sim_lock);
  for (unsigned i = 0; i < tc->sim_n; i++) {
    uint64_t r = sim_rand(&s);
    if (r & 1) continue;
    sim_write_line(ph, tc->sim_lines[i], torn ? (unsigned)(r >> 8) & 0xff : 0xff);
  }
  pthread_mutex_unlock(&sim_lock);
  tc->sim_n = 0;
}

void _keel_pm_sim_writeall(keel_pheap_t *ph) {
  uint64_t size = keel_load_relaxed(&ph->size);
  pthread_mutex_lock(&sim_lock);
  sim_pwrite(ph, 0, size);
  pthread_mutex_unlock(&sim_lock);
}
