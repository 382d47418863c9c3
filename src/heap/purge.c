/* The purge thread: returns free memory to the OS when the process is idle.
 *
 * Choice: a background thread, started lazily (the first time memory is
 * freed for a delayed purge), as jemalloc's background_thread. A purge that
 * only runs inside malloc/free calls never runs in a process that frees a
 * gigabyte and then sleeps, which is exactly when RSS should fall. The
 * thread wakes every heap_purge_ms / 4 (at least 10 ms, at most 1 s) and:
 * drains the delayed lists of idle heaps (full pages whose blocks other
 * threads freed), frees abandoned pages whose blocks all came back, purges
 * slices free longer than heap_purge_ms, and unmaps cached large mappings
 * unused as long. It blocks every signal and never allocates.
 *
 * heap_purge_ms=0 ("at once") still needs the thread. A span a running
 * thread frees is purged inline (segment.c), but the first two jobs above
 * have no one else to do them: an abandoned page is freed only when someone
 * looks at it after its last block came back (the freer pushed it with one
 * CAS and cannot know), and an idle owner never drains its delayed list.
 * With 0 the thread runs at its 10 ms floor and ages nothing, so such memory
 * goes back within a tick; the price is 100 wake-ups a second, each a few
 * uncontended lock round trips when there is nothing to do, which is what
 * asking for "at once" buys. (It used to stay home with 0: measured, a
 * producer that exited or idled after 1M 64-byte allocations kept 72 MiB
 * resident and 977 abandoned pages for good, against 9.7 MiB with the
 * default delay.)
 *
 * It is created outside every heap lock (callers of _keel_purge_schedule
 * hold none): pthread_create allocates the new thread's TLS through malloc,
 * which may be us. After fork the child has no purge thread; the next
 * schedule in the child starts one.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <time.h>

#include "base/options.h"
#include "heap/internal.h"

enum { BG_NONE, BG_STARTING, BG_RUNNING, BG_FAILED };
static keel_atomic(int) bg_state;
static keel_atomic(int) work_noted;

void _keel_purge_note_work(void) {
  if (!keel_load_relaxed(&work_noted)) keel_store_relaxed(&work_noted, 1);
}

static void *purge_main(void *arg) {
  (void)arg;
  for (;;) {
    int64_t delay = _keel_option(KEEL_OPT_heap_purge_ms);
    int64_t tick = delay / 4;
    if (tick < 10) tick = 10;
    if (tick > 1000) tick = 1000;
    struct timespec ts = {(time_t)(tick / 1000), (long)(tick % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    _keel_heaps_collect(false);
    _keel_segments_collect(false);
    _keel_large_collect(false);
  }
  return NULL;
}

void _keel_purge_schedule(void) {
  if (keel_likely(keel_load_relaxed(&bg_state) != BG_NONE)) return;
  if (!keel_load_relaxed(&work_noted)) return;
  int expected = BG_NONE;
  if (!keel_cas_strong_acq_rel(&bg_state, &expected, BG_STARTING)) return;
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 256 << 10);
  pthread_t t;
  int rc = pthread_create(&t, &attr, purge_main, NULL);
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  keel_store_relaxed(&bg_state, rc == 0 ? BG_RUNNING : BG_FAILED);
}

void _keel_purge_fork_child(void) {
  keel_store_relaxed(&bg_state, BG_NONE);
}
