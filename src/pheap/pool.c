/* pheap pools: create, open (validate, lock, map, recover), close, grow.
 *
 * Open order: lock the file (flock, so a second opener in any process gets
 * KEEL_ELOCKED), read and validate the header with pread before mapping
 * anything, so a bad file is reported and never written; then map, recover
 * (log.c) and bump the epoch (one barrier). The volatile heap is rebuilt
 * lazily on first use (heap.c), so open time does not grow with the pool.
 * A corrupt chunk word or run header is then found when first reached:
 * allocation fails with KEEL_ECORRUPT, a call naming an object past it dies
 * naming the pool (keel pheap check names the problem offline).
 *
 * Mapping: a PROT_NONE reservation (PH_RESERVE, 4x the pool, or the pool
 * plus room for one largest object, whichever is most) holds the file
 * mapping at its start, so growth maps the new tail in place (MAP_FIXED over
 * the reservation) and no pointer into the pool ever moves. Growth: extend
 * the file (zeros = free chunks, see pheap_int.h), fsync so the new size
 * survives, map the tail, and only then store the new size word and persist
 * it: a crash in between leaves a file longer than the pool says, which open
 * accepts (the extra bytes are reused by the next growth). Growth is for one
 * extent that found no room: it extends the pool to where that extent fits
 * inside one zone (into the next zone when the last one's free tail is too
 * short), and by a quarter more when the reservation allows.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/die.h"
#include "base/options.h"
#include "base/os.h"
#include "pheap/pheap_int.h"

#ifndef MAP_SHARED_VALIDATE
#define MAP_SHARED_VALIDATE 0x03
#endif
#ifndef MAP_SYNC
#define MAP_SYNC 0x80000
#endif

#if defined(KEEL_ASAN) || defined(KEEL_TSAN)
#define PH_RESERVE ((uint64_t)8 << 30) /* sanitizers shadow what is mapped: keep it modest */
#else
#define PH_RESERVE ((uint64_t)64 << 30)
#endif

int _keel_pm_cpu_best(void) KEEL_HIDDEN;
int _keel_ph_registry_add(keel_pheap_t *ph) KEEL_HIDDEN;
static keel_atomic(uint64_t) ph_ids;

/* Whether fd's file system keeps its files in memory only (tmpfs, ramfs,
 * hugetlbfs): there the page cache is the media and fsync does nothing. */
static bool on_ram_fs(int fd) {
  struct statfs s;
  if (fstatfs(fd, &s) != 0) return false;
  return s.f_type == TMPFS_MAGIC || s.f_type == RAMFS_MAGIC || s.f_type == HUGETLBFS_MAGIC;
}

static void *fail_null(int err) {
  errno = -err;
  return NULL;
}

static int map_tail(keel_pheap_t *ph, uint64_t from, uint64_t to, bool first) {
  int flags = ph->sim ? MAP_PRIVATE | MAP_FIXED : MAP_SHARED | MAP_FIXED;
  void *want = ph->view.base + from, *p = MAP_FAILED;
  if (!ph->sim && ph->flush_mode == -1) {
    /* auto: MAP_SYNC only succeeds on DAX, where CPU flushes are enough. */
    p = mmap(want, to - from, PROT_READ | PROT_WRITE, MAP_SHARED_VALIDATE | MAP_SYNC | MAP_FIXED,
             ph->fd, (off_t)from);
    ph->flush_mode = p != MAP_FAILED ? _keel_pm_cpu_best() : KEEL_FLUSH_MSYNC;
  } else if (!ph->sim && first == false && ph->flush_mode != KEEL_FLUSH_MSYNC &&
             ph->flush_mode != KEEL_FLUSH_NONE) {
    p = mmap(want, to - from, PROT_READ | PROT_WRITE, MAP_SHARED_VALIDATE | MAP_SYNC | MAP_FIXED,
             ph->fd, (off_t)from);
  }
  if (p == MAP_FAILED)
    p = mmap(want, to - from, PROT_READ | PROT_WRITE, flags, ph->fd, (off_t)from);
  return p == MAP_FAILED ? -errno : 0;
}

/* locks: destroy the mutexes (not in a forked child, where a thread of
 * the parent may have held one at fork). */
static void ph_free_volatile(keel_pheap_t *ph, bool locks) {
  if (ph->classq && locks)
    for (unsigned i = 0; i < ph->narenas * _keel_ph_nclasses; i++)
      pthread_mutex_destroy(&ph->classq[i].lock);
  free(ph->classq);
  for (unsigned i = 0; i < PH_NLANES && locks; i++) pthread_mutex_destroy(&ph->lanes[i].lock);
  if (locks) {
    pthread_mutex_destroy(&ph->ckpt_lock);
    pthread_mutex_destroy(&ph->lock);
    pthread_mutex_destroy(&ph->root_lock);
  }
  free(ph->chunk_free);
  free(ph->chunk_run);
  free(ph->path);
  if (ph->view.base) munmap(ph->view.base, ph->reserve);
  if (ph->fd >= 0) close(ph->fd); /* drops the flock */
  free(ph);
}

/* Zeroed memory on a cache-line boundary: the pool's lanes, its hot counter
 * and the class queues are line-aligned types, and calloc gives 16 bytes. */
static void *zalloc_lines(size_t n) {
  void *p;
  if (posix_memalign(&p, KEEL_CACHE_LINE, n) != 0) return NULL;
  return memset(p, 0, n);
}

/* Maps a validated pool and brings it up; consumes fd. */
void _keel_ph_lanes_attach(keel_pheap_t *ph) {
  for (unsigned i = 0; i < PH_NLANES; i++) {
    char *l = ph->view.base + ph->hdr->lanes_off + i * PH_LANE_BYTES;
    ph->lanes[i].ring = l;
    ph->lanes[i].undo = (ph_undo_t *)(void *)(l + PH_REDO_BYTES);
    ph->lanes[i].idx = i;
  }
}

static keel_pheap_t *ph_start(const char *path, int fd, uint64_t size, unsigned flags) {
  keel_pheap_t *ph = zalloc_lines(sizeof *ph);
  if (ph == NULL) {
    close(fd);
    return fail_null(_keel_ph_err(KEEL_ENOMEM, path, "out of memory"));
  }
  ph->fd = fd;
  ph->gen = keel_load_relaxed(&_keel_ph_fork_gen);
  pthread_mutex_init(&ph->lock, NULL);
  pthread_mutex_init(&ph->root_lock, NULL);
  for (unsigned i = 0; i < PH_NLANES; i++) {
    pthread_mutex_init(&ph->lanes[i].lock, NULL);
    atomic_init(&ph->lanes[i].dirty_lock, 0);
  }
  pthread_mutex_init(&ph->ckpt_lock, NULL);
  ph->path = strdup(path);
  ph->sim = _keel_ph_sim_next;
  ph->ram_fs = on_ram_fs(fd);
  ph->fixed = (flags & KEEL_PHEAP_FIXED) != 0;
  ph->sparse = (flags & KEEL_PHEAP_SPARSE) != 0;
  ph->id = keel_fetch_add_relaxed(&ph_ids, 1) + 1;
  int opt = (int)_keel_option(KEEL_OPT_pheap_flush);
  ph->flush_mode = opt == KEEL_FLUSH_AUTO ? -1 : _keel_pm_mode(ph);
  /* Growth maps within the reservation, so it bounds the pool for this
   * session: 4x its size, at least PH_RESERVE, and always room for one more
   * object of KEEL_PHEAP_MAX_ALLOC (at worst the rest of the last zone and
   * then a whole zone). */
  ph->reserve = size * 4 > PH_RESERVE ? KEEL_ALIGN_UP(size * 4, PH_CHUNK) : PH_RESERVE;
  if (ph->reserve < size + 2 * PH_ZONE_BYTES) ph->reserve = size + 2 * PH_ZONE_BYTES;
  void *base =
      mmap(NULL, ph->reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  int rc;
  if (base == MAP_FAILED) {
    rc = _keel_ph_err(KEEL_ENOMEM, path, "cannot reserve %llu bytes of address space",
                      (unsigned long long)ph->reserve);
    goto fail;
  }
  ph->view.base = base;
  if ((rc = map_tail(ph, 0, size, true)) != 0) {
    rc = _keel_ph_err(rc, path, "mmap failed: %s", strerror(-rc));
    goto fail;
  }
  keel_store_relaxed(&ph->size, size);
  ph->hdr = (ph_header_t *)ph->view.base;
  _keel_ph_classes_init();
  ph->chunk_cap = _keel_ph_chunks_for(ph->hdr->heap_off, ph->reserve);
  ph->chunk_free = calloc(ph->chunk_cap, 1);
  ph->chunk_run = calloc(ph->chunk_cap, sizeof *ph->chunk_run);
  unsigned ncpu = (unsigned)_keel_os_ncpu();
  ph->narenas = ncpu < PH_ARENAS_MIN ? PH_ARENAS_MIN : ncpu > PH_ARENAS_MAX ? PH_ARENAS_MAX : ncpu;
  ph->classq = zalloc_lines((size_t)ph->narenas * _keel_ph_nclasses * sizeof *ph->classq);
  if (!ph->path || !ph->chunk_free || !ph->chunk_run || !ph->classq) {
    rc = _keel_ph_err(KEEL_ENOMEM, path, "out of memory");
    goto fail;
  }
  for (unsigned i = 0; i < ph->narenas * _keel_ph_nclasses; i++)
    pthread_mutex_init(&ph->classq[i].lock, NULL);
  _keel_ph_lanes_attach(ph);
  keel_store_relaxed(&ph->nchunks, _keel_ph_chunks_for(ph->hdr->heap_off, size));
  ph_tcache_t *tc = _keel_ph_registry_add(ph) == 0 ? _keel_ph_tcache(ph) : NULL;
  if (tc == NULL) {
    rc = _keel_ph_err(KEEL_ENOMEM, path, "out of memory");
    goto fail;
  }
  if ((rc = _keel_ph_recover(ph, tc)) < 0) goto fail; /* a corrupted log: nothing written */
  ph->recovered = (uint64_t)rc;
  /* A new epoch: every seq of this session is above every log on media
   * (and above the watermark), so no stale log can ever pass for a new one. */
  ph->hdr->epoch++;
  /* One barrier for the epoch and the watermark recovery raised (adjacent
   * words of one line): no operation of this session runs before it, and a
   * crash before it makes the next open replay the same logs again. */
  _Static_assert(offsetof(ph_header_t, ckpt_seq) == offsetof(ph_header_t, epoch) + 8,
                 "epoch and ckpt_seq are flushed as one range");
  _keel_pm_flush(ph, tc, &ph->hdr->epoch, 16, PH_S_EPOCH);
  _keel_pm_drain(ph, tc);
  keel_store_relaxed(&ph->seq, ph->hdr->epoch << 40);
  keel_store_relaxed(&ph->ckpt_seq, ph->hdr->ckpt_seq);
  if ((rc = _keel_ph_heap_boot(ph, tc)) != 0) {
    rc = _keel_ph_err(rc, path, "heap rebuild failed: %s", keel_strerror(rc));
    goto fail;
  }
  return ph;
fail:
  _keel_ph_tcaches_destroy(ph);
  _keel_ph_heap_fini(ph);
  ph_free_volatile(ph, true);
  return fail_null(rc);
}

static int lock_file(int fd, const char *path) {
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) return 0;
  if (errno == EWOULDBLOCK)
    return _keel_ph_err(KEEL_ELOCKED, path, "pool is already open (locked by another handle)");
  return _keel_ph_err(-errno, path, "flock failed: %s", strerror(errno));
}

keel_atomic(unsigned long) _keel_ph_reserve_calls;

/* Gives the file blocks for [from, to), growing it to `to` if shorter: a
 * store into the mapping there can then not meet a full file system (the
 * kernel's only answer to that is SIGBUS). 0 or a negated errno (a full
 * file system is -ENOSPC, which is KEEL_ENOSPC). */
static int file_reserve(int fd, uint64_t from, uint64_t to) {
  keel_fetch_add_relaxed(&_keel_ph_reserve_calls, 1);
  int e;
  while ((e = posix_fallocate(fd, (off_t)from, (off_t)(to - from))) == EINTR) {}
  return -e;
}

/* Whether [0, size) of the pool file may have a hole. posix_fallocate
 * over a file that has all its blocks still visits every page (86 ms to
 * open a 512 MiB pool on tmpfs, against 9 for libpmemobj), so open asks
 * first. SEEK_HOLE cannot answer: tmpfs and ext4 report reserved but
 * unwritten blocks as holes. FIEMAP lists extents, reserved ones included,
 * so a gap below `size` is a hole. Without FIEMAP (tmpfs) the block count
 * decides, against the whole file (a crashed growth leaves reserved blocks
 * past the pool's end); blocks reserved past EOF with FALLOC_FL_KEEP_SIZE
 * could still hide a hole there, and keel never makes those. */
static bool file_may_have_holes(int fd, const struct stat *st, uint64_t size) {
  enum { N = 64 };
  struct fiemap *fm = malloc(sizeof *fm + N * sizeof fm->fm_extents[0]);
  if (fm == NULL) return true;
  uint64_t pos = 0;
  int answer = -1; /* -1: FIEMAP could not tell */
  while (answer < 0) {
    memset(fm, 0, sizeof *fm);
    fm->fm_start = pos;
    fm->fm_length = size - pos;
    fm->fm_extent_count = N;
    if (ioctl(fd, FS_IOC_FIEMAP, fm) != 0) break;
    if (fm->fm_mapped_extents == 0) answer = 1; /* nothing from pos on */
    for (unsigned i = 0; i < fm->fm_mapped_extents && answer < 0; i++) {
      const struct fiemap_extent *e = &fm->fm_extents[i];
      if (e->fe_logical > pos) {
        answer = 1; /* a gap */
        break;
      }
      if (e->fe_logical + e->fe_length > pos) pos = e->fe_logical + e->fe_length;
      if (pos >= size)
        answer = 0;
      else if (e->fe_flags & FIEMAP_EXTENT_LAST)
        answer = 1;
    }
  }
  free(fm);
  if (answer >= 0) return answer;
  return (uint64_t)st->st_blocks * 512 < (uint64_t)st->st_size;
}

keel_pheap_t *keel_pheap_open(const char *path, const char *layout) {
  if (path == NULL || layout == NULL)
    return fail_null(_keel_ph_err(KEEL_EINVAL, path, "path and layout are required"));
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return fail_null(_keel_ph_err(-errno, path, "cannot open: %s", strerror(errno)));
  int rc = lock_file(fd, path);
  struct stat st;
  ph_header_t h;
  if (rc == 0 && fstat(fd, &st) != 0) rc = _keel_ph_err(-errno, path, "fstat: %s", strerror(errno));
  if (rc == 0 && (uint64_t)st.st_size < sizeof h)
    rc = _keel_ph_err(KEEL_ECORRUPT, path, "truncated: %lld bytes is smaller than a pool header",
                      (long long)st.st_size);
  if (rc == 0 && pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h)
    rc = _keel_ph_err(KEEL_ECORRUPT, path, "cannot read the pool header");
  if (rc == 0) rc = _keel_ph_header_check(&h, path, (uint64_t)st.st_size, layout);
  /* A pool that is not sparse has its blocks; reserving them again fills
   * the holes of a file copied sparse or extended by other means. */
  uint64_t size = rc == 0 ? _keel_ph_size_from_word(h.size_word) : 0;
  if (rc == 0 && !(h.flags & KEEL_PHEAP_SPARSE) && file_may_have_holes(fd, &st, size) &&
      (rc = file_reserve(fd, 0, size)) != 0)
    rc = _keel_ph_err(rc, path,
                      "cannot reserve the pool's %llu bytes on the file system (%s): a store "
                      "into a hole would raise SIGBUS",
                      (unsigned long long)size, strerror(-rc));
  if (rc != 0) {
    close(fd);
    return fail_null(rc);
  }
  return ph_start(path, fd, size, (unsigned)h.flags);
}

keel_pheap_t *keel_pheap_create(const char *path, const char *layout, size_t size, unsigned flags) {
  if (path == NULL || layout == NULL)
    return fail_null(_keel_ph_err(KEEL_EINVAL, path, "path and layout are required"));
  if (strlen(layout) > KEEL_PHEAP_LAYOUT_MAX)
    return fail_null(
        _keel_ph_err(KEEL_EINVAL, path, "layout name longer than %d bytes", KEEL_PHEAP_LAYOUT_MAX));
  if (size < KEEL_PHEAP_MIN_SIZE)
    return fail_null(_keel_ph_err(KEEL_EINVAL, path, "size %zu is below the minimum %zu", size,
                                  KEEL_PHEAP_MIN_SIZE));
  if (flags & ~(KEEL_PHEAP_FIXED | KEEL_PHEAP_SPARSE))
    return fail_null(_keel_ph_err(KEEL_EINVAL, path, "unknown flags 0x%x", flags));
  size = KEEL_ALIGN_DOWN(size, (size_t)4096);
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return fail_null(_keel_ph_err(-errno, path, "cannot create: %s", strerror(errno)));
  int rc = lock_file(fd, path);
  /* A sparse pool is sized; any other has its blocks reserved, which sizes
   * it too. */
  if (rc == 0 && (flags & KEEL_PHEAP_SPARSE) && ftruncate(fd, (off_t)size) != 0)
    rc = _keel_ph_err(-errno, path, "cannot size the file: %s", strerror(errno));
  if (rc == 0 && !(flags & KEEL_PHEAP_SPARSE) && (rc = file_reserve(fd, 0, size)) != 0)
    rc = _keel_ph_err(rc, path, "cannot reserve %zu bytes on the file system: %s", size,
                      strerror(-rc));
  if (rc == 0) {
    ph_header_t h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, PH_MAGIC, sizeof PH_MAGIC);
    h.version = PH_VERSION;
    h.hdr_bytes = PH_HDR_BYTES;
    strcpy(h.layout, layout);
    h.nlanes = PH_NLANES;
    h.lane_bytes = PH_LANE_BYTES;
    h.lanes_off = PH_HDR_BYTES;
    h.heap_off = PH_HDR_BYTES + PH_NLANES * PH_LANE_BYTES;
    h.chunk_bytes = PH_CHUNK;
    h.zone_chunks = PH_ZONE_CHUNKS;
    h.flags = flags;
    h.uuid[0] = keel_clock_ns();
    h.uuid[1] = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)&h;
    h.csum = _keel_ph_csum(&h, offsetof(ph_header_t, csum), 0);
    h.size_word = _keel_ph_size_word(size);
    /* The header is written last and synced: a crash before this leaves a
     * file without a valid header, which open rejects (never half a pool). */
    if (pwrite(fd, &h, sizeof h, 0) != (ssize_t)sizeof h || fsync(fd) != 0)
      rc = _keel_ph_err(KEEL_EINVAL, path, "cannot write the header: %s", strerror(errno));
  }
  if (rc != 0) {
    unlink(path);
    close(fd);
    return fail_null(rc);
  }
  keel_pheap_t *ph = ph_start(path, fd, size, flags);
  if (ph == NULL) {
    int e = errno;
    unlink(path);
    errno = e;
  }
  return ph;
}

int keel_pheap_close(keel_pheap_t *ph) {
  if (ph == NULL) return KEEL_REJECT(KEEL_EINVAL, "keel_pheap_close", "pool is NULL");
  if (keel_unlikely(_keel_ph_forked(ph))) {
    /* The parent's pool: forget our copy; the file, its flock (shared with
     * the parent's descriptor) and the parent's logs are left alone. */
    _keel_ph_tx_forget(ph);
    _keel_ph_tcaches_forget(ph);
    _keel_ph_heap_fini(ph);
    ph_free_volatile(ph, false);
    return 0;
  }
  /* An open transaction holds a lane and a pinned thread cache that close
   * would free under it. (A thread that exits inside one rolls it back;
   * close it only after joining that thread, whose exit is still inside
   * the pool until then.) */
  bool open_tx = false;
  pthread_mutex_lock(&ph->lock);
  for (ph_tcache_t *tc = ph->caches; tc && !open_tx; tc = tc->next)
    open_tx = keel_load_relaxed(&tc->tx_lane) != NULL;
  pthread_mutex_unlock(&ph->lock);
  if (open_tx)
    return KEEL_REJECT(KEEL_EBUSY, "keel_pheap_close", "%s: a transaction on it is still open",
                       ph->path);
  /* A deferred checkpoint still queued or running holds ph (the deferrer
   * promised to run what it accepted). */
  while (keel_load_acquire(&ph->defer_req)) sched_yield();
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (tc) _keel_ph_checkpoint(ph, tc); /* the next open has nothing to replay */
  if (ph->sim) _keel_pm_sim_writeall(ph);
  _keel_ph_tcaches_destroy(ph);
  _keel_ph_heap_fini(ph);
  ph_free_volatile(ph, true);
  return 0;
}

/* Pool bytes that hold chunks [0, n), n > 0: up to the end of chunk n - 1
 * (its zone's words included). */
static uint64_t size_for_chunks(const keel_pheap_t *ph, uint64_t n) {
  uint64_t last = n - 1;
  return ph->hdr->heap_off + last / PH_ZONE_CHUNKS * PH_ZONE_BYTES + PH_ZONE_META +
         (last % PH_ZONE_CHUNKS + 1) * PH_CHUNK;
}

int __keel_ph_grow(keel_pheap_t *ph, ph_tcache_t *tc, uint32_t need) {
  if (ph->fixed) return KEEL_ENOSPC;
  uint32_t have = keel_load_relaxed(&ph->nchunks);
  /* Where the extent will start: on the free chunks that end the last
   * zone, or at the next zone if it would not fit before the zone's end
   * (extents never cross one). Appending just `need` chunks could leave it
   * straddling the boundary, unplaceable. */
  uint64_t start = have;
  while (start % PH_ZONE_CHUNKS != 0 && ph->chunk_free[start - 1]) start--;
  if (start % PH_ZONE_CHUNKS + need > PH_ZONE_CHUNKS)
    start = (start / PH_ZONE_CHUNKS + 1) * PH_ZONE_CHUNKS;
  /* A quarter more (8 MiB at least) amortises the fsync and the map;
   * where the reservation has no room for that, just the extent. */
  uint64_t want = have + (have / 4 > 32 ? have / 4 : 32), end = start + need;
  uint64_t size = size_for_chunks(ph, want > end ? want : end), least = size_for_chunks(ph, end);
  if (size > ph->reserve) size = least;
  if (size > ph->reserve) return KEEL_ENOSPC;
  uint64_t old = keel_load_relaxed(&ph->size);
  if (!ph->sparse) {
    /* From the mapped end, whatever the file's length: a reservation that
     * failed part way may have lengthened it over holes. Short of room for
     * the quarter more, room for the extent alone will do. */
    if (file_reserve(ph->fd, old, size) != 0) {
      if (size == least || file_reserve(ph->fd, old, least) != 0) return KEEL_ENOSPC;
      size = least;
    }
    if (fsync(ph->fd) != 0) return KEEL_ENOSPC;
  } else {
    struct stat st;
    if (fstat(ph->fd, &st) != 0) return KEEL_ENOSPC;
    if ((uint64_t)st.st_size < size && (ftruncate(ph->fd, (off_t)size) != 0 || fsync(ph->fd) != 0))
      return KEEL_ENOSPC;
  }
  if (map_tail(ph, old, size, false) != 0) return KEEL_ENOSPC;
  keel_store_relaxed(&ph->size, size);
  ph->hdr->size_word = _keel_ph_size_word(size);
  _keel_pm_flush(ph, tc, &ph->hdr->size_word, 8, PH_S_GROW);
  _keel_pm_drain(ph, tc);
  uint32_t n = _keel_ph_chunks_for(ph->hdr->heap_off, size);
  for (uint32_t c = have; c < n; c++) ph->chunk_free[c] = 1;
  keel_store_release(&ph->nchunks, n); /* publishes chunk_free/chunk_run for the new chunks */
  keel_fetch_add_relaxed(&ph->grows, 1);
  return 0;
}
