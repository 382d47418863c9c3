/* Heap statistics: per-class counters summed over every thread heap.
 *
 * Each heap counts its own allocations (and requested bytes) and frees,
 * whoever owns the freed block; a class's live count is the difference of
 * the sums. Owners' frees are not counted by the free fast path but derived
 * per page from its counters (__keel_page_frees), so every thread's figures
 * are current. The requested bytes of live blocks are estimated as live x
 * the class's average request since start: free() is not told the size,
 * and keeping it per block would cost a word per block.
 *
 * The table is formatted with snprintf into a stack buffer and written line
 * by line, to a FILE or, at exit (KEEL_OPTIONS=stats=1), with write(2): the
 * exit report must not allocate from the heap it is describing.
 */
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "base/options.h"
#include "heap/internal.h"

#include <keel/heap.h>

typedef struct {
  size_t remote_frees[KEEL_CLASS_COUNT_MAX];
} sums_t;

/* keel_heap_stats's static sums, and print_table's static table. Both
 * locks are outermost: print_lock is held across keel_heap_stats, which
 * takes sums_lock and then the registry, heap and segment locks. Fork's
 * prepare handler takes them first (_keel_stats_fork_lock): a child of a
 * thread that was inside either would otherwise wait on it for good. */
static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t sums_lock = PTHREAD_MUTEX_INITIALIZER;

void _keel_stats_fork_lock(void) {
  pthread_mutex_lock(&print_lock);
  pthread_mutex_lock(&sums_lock);
}

void _keel_stats_fork_unlock(void) {
  pthread_mutex_unlock(&sums_lock);
  pthread_mutex_unlock(&print_lock);
}

static void sum_heap(keel_heap_t *h, void *arg) {
  sums_t *s = arg;
  for (unsigned c = 0; c < _keel_class_count; c++) {
    s->remote_frees[c] += keel_load_relaxed(&h->remote_frees[c]);
  }
}

KEEL_API void keel_heap_stats(keel_heap_stats_t *st) {
  _keel_classes_init();
  memset(st, 0, sizeof(*st));
  /* Static (too big for a small thread stack), under a lock of their own. */
  static sums_t sums;
  static keel_seg_totals_t seg;
  pthread_mutex_lock(&sums_lock);
  memset(&sums, 0, sizeof(sums));
  /* Remote frees first, page counters second: a block allocated and freed
   * remotely in between is then counted as allocated, never as freed only. */
  _keel_heaps_visit(sum_heap, &sums);
  _keel_segments_totals(&seg);
  st->n_classes = _keel_class_count;
  for (unsigned c = 0; c < _keel_class_count; c++) {
    keel_heap_class_stats_t *cs = &st->classes[c];
    size_t frees = seg.frees[c] + sums.remote_frees[c] + keel_load_relaxed(&_keel_orphan_frees[c]);
    cs->size = _keel_class_size[c];
    cs->allocs = seg.allocs[c];
    cs->frees = frees;
    /* Counters are read one by one while others run: clamp a transient
     * negative to zero. */
    cs->live = seg.allocs[c] > frees ? seg.allocs[c] - frees : 0;
    cs->usable_bytes = cs->live * cs->size;
    cs->requested_bytes =
        seg.samples[c] == 0
            ? cs->usable_bytes
            : (size_t)((double)seg.requested[c] / (double)seg.samples[c] * (double)cs->live);
    cs->pages = seg.pages[c];
    st->live_bytes += cs->usable_bytes;
    st->requested_bytes += cs->requested_bytes;
  }
  /* Read under the lock: another caller rewrites the static seg. */
  size_t seg_mapped = seg.mapped, seg_committed = seg.committed;
  st->purged_bytes = seg.purged;
  st->abandoned_pages = seg.abandoned_pages;
  pthread_mutex_unlock(&sums_lock);
  size_t large_live, large_bytes, large_cached, large_req;
  _keel_large_totals(&large_live, &large_bytes, &large_cached, &large_req);
  st->large_live = large_live;
  st->large_bytes = large_bytes;
  /* Usable bytes, as for a class (and keel_usable_size): not the mapping's
   * header page or alignment gap, which large_bytes and the mapped and
   * committed totals do count. */
  st->live_bytes += _keel_large_usable();
  st->requested_bytes += large_req;
  st->mapped_bytes = seg_mapped + large_bytes + large_cached;
  st->committed_bytes = seg_committed + large_bytes + large_cached;
  st->threads = _keel_heaps_active();
}

typedef void (*line_fn)(void *ctx, const char *line);

static void print_table(line_fn out, void *ctx) {
  static keel_heap_stats_t st; /* 8 KiB: static, the exit path may run on a small stack */
  pthread_mutex_lock(&print_lock);
  keel_heap_stats(&st);
  char line[256];
  snprintf(line, sizeof(line), "%8s %12s %14s %14s %10s %8s %7s\n", "class", "live", "requested",
           "usable", "allocs", "pages", "waste");
  out(ctx, line);
  for (size_t c = 0; c < st.n_classes; c++) {
    const keel_heap_class_stats_t *cs = &st.classes[c];
    if (cs->allocs == 0 && cs->pages == 0) continue;
    double waste =
        cs->usable_bytes == 0
            ? 0.0
            : 100.0 * (double)(cs->usable_bytes - cs->requested_bytes) / (double)cs->usable_bytes;
    snprintf(line, sizeof(line), "%8zu %12zu %14zu %14zu %10zu %8zu %6.1f%%\n", cs->size, cs->live,
             cs->requested_bytes, cs->usable_bytes, cs->allocs, cs->pages, waste);
    out(ctx, line);
  }
  snprintf(line, sizeof(line),
           "large: %zu live, %zu bytes mapped\n"
           "total: %zu live bytes (%zu requested), %zu mapped, %zu committed, %zu purged\n"
           "threads: %zu heaps active, %zu abandoned pages\n",
           st.large_live, st.large_bytes, st.live_bytes, st.requested_bytes, st.mapped_bytes,
           st.committed_bytes, st.purged_bytes, st.threads, st.abandoned_pages);
  out(ctx, line);
  pthread_mutex_unlock(&print_lock);
}

static void to_file(void *ctx, const char *line) {
  fputs(line, (FILE *)ctx);
}

static void to_fd(void *ctx, const char *line) {
  int fd = *(int *)ctx;
  size_t len = strlen(line);
  while (len > 0) {
    ssize_t n = write(fd, line, len);
    if (n <= 0) return;
    line += n;
    len -= (size_t)n;
  }
}

KEEL_API void keel_heap_print_stats(FILE *out) {
  print_table(to_file, out);
}

void _keel_heap_print_stats_fd(int fd) {
  print_table(to_fd, &fd);
}

/* stats=1 prints at exit through a private duplicate of stderr taken at
 * start-up: coreutils (ls, cp, ...) close stderr from an atexit handler,
 * which runs before this destructor. A program that closes every descriptor
 * still loses the table; nothing else does. */
static int stats_fd = -1;

__attribute__((constructor)) static void stats_at_start(void) {
  if (_keel_option(KEEL_OPT_stats)) stats_fd = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3);
}

__attribute__((destructor)) static void stats_at_exit(void) {
  if (_keel_option(KEEL_OPT_stats)) {
    int fd = stats_fd >= 0 ? stats_fd : STDERR_FILENO;
    to_fd(&fd, "keel heap statistics at exit:\n");
    _keel_heap_print_stats_fd(fd);
  }
}
