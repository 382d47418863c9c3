/* pheap inspection: offline check, stats, info.
 *
 * keel_pheap_check maps a closed pool privately (the file is never written)
 * and verifies, in order: the header (as open does), the logs a crash left
 * (as open's recovery does before it writes anything), then, on the heap as
 * that recovery would leave it (it runs on the private copy), every chunk
 * word (known type, extent inside its zone and the pool), every run (magic,
 * block size of a known class, bitmap bits only below nblocks), every live
 * object header (requested size fits the block or extent), and that the root
 * offset is a live object. So check and open agree: a pool with logs to
 * replay was called corrupt where the replay would have mended it, and one
 * whose logs open refuses was called ok. Valid logs are reported, not
 * errors: the next open recovers them.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/die.h"
#include "base/options.h"
#include "pheap/pheap_int.h"

typedef struct walk {
  const char *base;
  const ph_header_t *h;
  uint64_t size;
  uint32_t nchunks;
  keel_pheap_stats_t st;
  unsigned pending_logs;
} walk_t;

static uint64_t w_zone(const walk_t *w, uint32_t c) {
  return w->h->heap_off + (uint64_t)(c / PH_ZONE_CHUNKS) * PH_ZONE_BYTES;
}
static uint64_t w_chunk(const walk_t *w, uint32_t c) {
  return w_zone(w, c) + PH_ZONE_META + (uint64_t)(c % PH_ZONE_CHUNKS) * PH_CHUNK;
}
static uint64_t w_cword(const walk_t *w, uint32_t c) {
  return ((const uint64_t *)(w->base + w_zone(w, c)))[c % PH_ZONE_CHUNKS];
}

static bool w_live(const walk_t *w, uint64_t off) {
  for (uint32_t c = 0; c < w->nchunks;) {
    uint64_t cw = w_cword(w, c);
    uint32_t len = PH_CW_LEN(cw) ? PH_CW_LEN(cw) : 1;
    uint64_t lo = w_chunk(w, c), hi = lo + (uint64_t)len * PH_CHUNK;
    if (off >= lo && off < hi) {
      if (PH_CW_TYPE(cw) == PH_CW_HUGE) return off == lo + PH_OBJ_HDR;
      if (PH_CW_TYPE(cw) != PH_CW_RUN) return false;
      const ph_run_hdr_t *r = (const ph_run_hdr_t *)(w->base + lo);
      uint64_t rel = off - PH_OBJ_HDR - lo;
      if (rel < r->data_off || (rel - r->data_off) % r->block) return false;
      uint64_t i = (rel - r->data_off) / r->block;
      const uint64_t *bm = (const uint64_t *)(w->base + lo + PH_RUN_HDR);
      return i < r->nblocks && (bm[i / 64] >> (i % 64) & 1);
    }
    c += len;
  }
  return false;
}

static int walk_heap(walk_t *w, const char *path) {
  _keel_ph_classes_init();
  for (uint32_t c = 0; c < w->nchunks;) {
    uint64_t cw = w_cword(w, c);
    uint32_t t = PH_CW_TYPE(cw), len = PH_CW_LEN(cw);
    if (t == PH_CW_FREE) {
      if (cw != 0) return _keel_ph_err(KEEL_ECORRUPT, path, "chunk %u: bad free chunk word", c);
      w->st.free_bytes += PH_CHUNK;
      c++;
      continue;
    }
    if ((t != PH_CW_RUN && t != PH_CW_HUGE) || len == 0 ||
        c % PH_ZONE_CHUNKS + len > PH_ZONE_CHUNKS || c + len > w->nchunks)
      return _keel_ph_err(KEEL_ECORRUPT, path, "chunk %u: bad chunk word 0x%llx", c,
                          (unsigned long long)cw);
    uint64_t lo = w_chunk(w, c);
    if (t == PH_CW_HUGE) {
      const ph_objhdr_t *o = (const ph_objhdr_t *)(w->base + lo);
      if (o->size == 0 || (o->size + PH_OBJ_HDR + PH_CHUNK - 1) / PH_CHUNK != len)
        return _keel_ph_err(KEEL_ECORRUPT, path,
                            "chunk %u: large object size %llu does not fit %u chunks", c,
                            (unsigned long long)o->size, len);
      w->st.huge_bytes += (uint64_t)len * PH_CHUNK;
      w->st.live_objects++;
      w->st.live_bytes += o->size;
      w->st.usable_bytes += (uint64_t)len * PH_CHUNK - PH_OBJ_HDR;
    } else {
      const ph_run_hdr_t *r = (const ph_run_hdr_t *)(w->base + lo);
      int cls = _keel_ph_class_of(r->block);
      if (r->magic != PH_RUN_MAGIC || cls < 0 || _keel_ph_classes[cls].block != r->block ||
          _keel_ph_classes[cls].nblocks != r->nblocks || _keel_ph_classes[cls].chunks != len ||
          _keel_ph_classes[cls].data_off != r->data_off)
        return _keel_ph_err(KEEL_ECORRUPT, path, "chunk %u: bad run header", c);
      const uint64_t *bm = (const uint64_t *)(w->base + lo + PH_RUN_HDR);
      for (uint32_t i = 0; i < (r->nblocks + 63) / 64 * 64; i++) {
        if (!(bm[i / 64] >> (i % 64) & 1)) continue;
        if (i >= r->nblocks)
          return _keel_ph_err(KEEL_ECORRUPT, path, "chunk %u: bitmap bit %u beyond the run", c, i);
        const ph_objhdr_t *o =
            (const ph_objhdr_t *)(w->base + lo + r->data_off + (uint64_t)i * r->block);
        if (o->size == 0 || o->size > r->block - PH_OBJ_HDR)
          return _keel_ph_err(KEEL_ECORRUPT, path,
                              "chunk %u block %u: object size %llu does not fit", c, i,
                              (unsigned long long)o->size);
        w->st.live_objects++;
        w->st.live_bytes += o->size;
        w->st.usable_bytes += r->block - PH_OBJ_HDR;
      }
      w->st.run_bytes += (uint64_t)len * PH_CHUNK;
    }
    c += len;
  }
  w->st.heap_bytes = (uint64_t)w->nchunks * PH_CHUNK;
  w->st.pool_bytes = w->size;
  if (w->h->root_off && !w_live(w, w->h->root_off))
    return _keel_ph_err(KEEL_ECORRUPT, path, "root offset 0x%llx is not a live object",
                        (unsigned long long)w->h->root_off);
  return 0;
}

/* Open's recovery (log.c) on the private copy at w->base: a pool struct
 * with just what recovery reads, no flushes (KEEL_FLUSH_NONE) and no file. */
static int recover_copy(walk_t *w, const char *path) {
  keel_pheap_t *ph = NULL; /* cache-line aligned, as the struct asks */
  if (posix_memalign((void **)&ph, KEEL_CACHE_LINE, sizeof *ph) != 0) ph = NULL;
  if (ph != NULL) memset(ph, 0, sizeof *ph);
  ph_tcache_t *tc = calloc(1, sizeof *tc);
  int rc = 0;
  if (ph == NULL || tc == NULL) {
    rc = _keel_ph_err(KEEL_ENOMEM, path, "out of memory");
  } else {
    ph->view.base = (char *)w->base;
    keel_store_relaxed(&ph->size, w->size);
    ph->fd = -1;
    ph->flush_mode = KEEL_FLUSH_NONE;
    ph->path = (char *)path;
    ph->hdr = (ph_header_t *)(void *)ph->view.base;
    _keel_ph_lanes_attach(ph);
    rc = _keel_ph_recover(ph, tc);
    if (rc > 0) rc = 0;
  }
  free(tc);
  free(ph);
  return rc;
}

/* Checks a closed pool; fills *w. Keeps the mapping in *map (caller unmaps). */
static int check_file(const char *path, walk_t *w, void **map, uint64_t *maplen) {
  memset(w, 0, sizeof *w);
  *map = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return _keel_ph_err(-errno, path, "cannot open: %s", strerror(errno));
  int rc = 0;
  struct stat st;
  ph_header_t h;
  if (flock(fd, LOCK_SH | LOCK_NB) != 0)
    rc = _keel_ph_err(KEEL_ELOCKED, path, "pool is open in another handle");
  if (rc == 0 && fstat(fd, &st) != 0) rc = _keel_ph_err(-errno, path, "fstat failed");
  if (rc == 0 && (uint64_t)st.st_size < sizeof h)
    rc = _keel_ph_err(KEEL_ECORRUPT, path, "truncated: %lld bytes is smaller than a pool header",
                      (long long)st.st_size);
  if (rc == 0 && pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h)
    rc = _keel_ph_err(KEEL_ECORRUPT, path, "cannot read the pool header");
  if (rc == 0) rc = _keel_ph_header_check(&h, path, (uint64_t)st.st_size, NULL);
  if (rc == 0) {
    w->size = _keel_ph_size_from_word(h.size_word);
    /* Read-only; remapped writable (private: the file is never written)
     * only if recovery must run on it (recover_copy), which a host with
     * strict overcommit charges for the whole pool. */
    void *p = mmap(NULL, w->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED)
      rc = _keel_ph_err(-errno, path, "mmap failed: %s", strerror(errno));
    else {
      *map = p;
      *maplen = w->size;
      w->base = p;
      w->h = p;
      w->nchunks = _keel_ph_chunks_for(h.heap_off, w->size);
      for (unsigned i = 0; i < PH_NLANES && rc == 0; i++) {
        const char *l = w->base + h.lanes_off + i * PH_LANE_BYTES;
        uint64_t useq = ((const ph_undo_t *)(l + PH_REDO_BYTES))->seq;
        for (unsigned pos = 0; pos < PH_RING_LINES && rc == 0; pos++) {
          const ph_redo_t *r = _keel_ph_ring_log(l, pos, h.ckpt_seq);
          if (r == NULL) continue;
          w->pending_logs++;
          if ((r->seq >> 40) > h.epoch) /* as open's recovery refuses it (log.c) */
            rc = _keel_ph_err(KEEL_ECORRUPT, path,
                              "redo log at line %u of lane %u has seq %#llx, beyond the pool's "
                              "epoch %llu",
                              pos, i, (unsigned long long)r->seq, (unsigned long long)h.epoch);
        }
        if (useq != 0) w->pending_logs++;
        if (rc == 0 && (useq >> 40) > h.epoch)
          rc = _keel_ph_err(KEEL_ECORRUPT, path,
                            "undo log of lane %u has seq %#llx, beyond the pool's epoch %llu", i,
                            (unsigned long long)useq, (unsigned long long)h.epoch);
      }
      if (rc == 0 && w->pending_logs) {
        void *q = mmap(p, w->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE | MAP_FIXED,
                       fd, 0);
        if (q == MAP_FAILED)
          rc = _keel_ph_err(-errno, path, "mmap for recovery failed: %s", strerror(errno));
        else
          rc = recover_copy(w, path);
      }
      if (rc == 0) rc = walk_heap(w, path);
    }
  }
  close(fd);
  return rc;
}

int keel_pheap_check(const char *path) {
  walk_t w;
  void *map;
  uint64_t len = 0;
  int rc = check_file(path, &w, &map, &len);
  if (map) munmap(map, len);
  if (rc == 0)
    _keel_ph_err(0, path, "ok: %llu live objects, %u log(s) to recover at next open",
                 (unsigned long long)w.st.live_objects, w.pending_logs);
  return rc;
}

int keel_pheap_stats(keel_pheap_t *ph, keel_pheap_stats_t *st) {
  if (ph == NULL || st == NULL)
    return KEEL_REJECT(KEEL_EINVAL, "keel_pheap_stats", "pool %p, stats %p", (void *)ph,
                       (void *)st);
  PH_NOT_FORKED(ph, "keel_pheap_stats"); /* the parent's counters, under its lock */
  walk_t w;
  memset(&w, 0, sizeof w);
  w.base = ph->view.base;
  w.h = ph->hdr;
  w.size = keel_load_relaxed(&ph->size);
  w.nchunks = keel_load_acquire(&ph->nchunks);
  int rc = walk_heap(&w, ph->path);
  *st = w.st;
  pthread_mutex_lock(&ph->lock); /* the dead totals and the list agree under it */
  st->flushes = keel_load_relaxed(&ph->dead_flushes);
  st->barriers = keel_load_relaxed(&ph->dead_barriers);
  st->tx_commits = keel_load_relaxed(&ph->dead_tx_commits);
  st->tx_aborts = keel_load_relaxed(&ph->dead_tx_aborts);
  for (ph_tcache_t *tc = ph->caches; tc; tc = tc->next) {
    /* Racy reads of other threads' counters: statistics, not invariants. */
    st->flushes += __atomic_load_n(&tc->flushes, __ATOMIC_RELAXED);
    st->barriers += __atomic_load_n(&tc->barriers, __ATOMIC_RELAXED);
    st->tx_commits += __atomic_load_n(&tc->tx_commits, __ATOMIC_RELAXED);
    st->tx_aborts += __atomic_load_n(&tc->tx_aborts, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&ph->lock);
  st->grows = keel_load_relaxed(&ph->grows);
  st->recovered_logs = ph->recovered;
  st->deferred_checkpoints = keel_load_relaxed(&ph->defer_done);
  return rc;
}

static void print_stats(FILE *out, const ph_header_t *h, const keel_pheap_stats_t *st) {
  fprintf(out, "layout        %s\nversion       %u\npool bytes    %llu\nheap bytes    %llu\n",
          h->layout, h->version, (unsigned long long)st->pool_bytes,
          (unsigned long long)st->heap_bytes);
  fprintf(out, "run bytes     %llu\nlarge bytes   %llu\nfree bytes    %llu\n",
          (unsigned long long)st->run_bytes, (unsigned long long)st->huge_bytes,
          (unsigned long long)st->free_bytes);
  fprintf(out, "live objects  %llu (%llu bytes asked, %llu usable)\nroot          0x%llx\n",
          (unsigned long long)st->live_objects, (unsigned long long)st->live_bytes,
          (unsigned long long)st->usable_bytes, (unsigned long long)h->root_off);
  fprintf(out, "growable      %s\nfile blocks   %s\nopens         %llu\n",
          h->flags & KEEL_PHEAP_FIXED ? "no" : "yes",
          h->flags & KEEL_PHEAP_SPARSE ? "sparse" : "reserved", (unsigned long long)h->epoch);
}

int keel_pheap_print_info(keel_pheap_t *ph, FILE *out) {
  keel_pheap_stats_t st;
  int rc = keel_pheap_stats(ph, &st);
  print_stats(out, ph->hdr, &st);
  fprintf(out, "flushes       %llu\nbarriers      %llu\ngrows         %llu\n",
          (unsigned long long)st.flushes, (unsigned long long)st.barriers,
          (unsigned long long)st.grows);
  fprintf(out, "tx commits    %llu\ntx aborts     %llu\nrecovered     %llu log(s) at open\n",
          (unsigned long long)st.tx_commits, (unsigned long long)st.tx_aborts,
          (unsigned long long)st.recovered_logs);
  fprintf(out, "bg checkpts   %llu\nflush mode    %s\n",
          (unsigned long long)st.deferred_checkpoints, _keel_pm_mode_name(ph));
  return rc;
}

/* For `keel pheap info` on a closed file (read-only). */
int _keel_ph_info_file(const char *path, FILE *out) KEEL_HIDDEN;
int _keel_ph_info_file(const char *path, FILE *out) {
  walk_t w;
  void *map;
  uint64_t len = 0;
  int rc = check_file(path, &w, &map, &len);
  if (map) {
    fprintf(out, "file          %s\n", path);
    print_stats(out, w.h, &w.st);
    fprintf(out, "pending logs  %u\n", w.pending_logs);
    munmap(map, len);
  }
  return rc;
}
