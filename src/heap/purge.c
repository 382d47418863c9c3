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
 *
 * Not in a process with one thread (glibc's __libc_single_threaded, false
 * for good from its first pthread_create): a thread of ours would make it
 * multi-threaded behind its back, and then unshare(CLONE_NEWUSER) fails
 * with EINVAL, a seccomp filter that forbids clone kills it with SIGSYS, a
 * fork-heavy program pays for a second thread's atfork locking. Its
 * collections run inline instead, at most once a tick, in the slow paths
 * that call _keel_purge_schedule (no lock held). The price: what such a
 * process frees and then leaves alone while it sleeps stays resident until
 * its next call into those paths (mimalloc's purge behaves so always). The
 * thread starts at the first schedule after the process gains a thread.
 * A child forked from a multi-threaded process has one thread too, though
 * glibc's flag stays false there: keel counts it single-threaded from the
 * fork until another thread of it first allocates (_keel_purge_note_thread;
 * one that never does is not seen, and the child only keeps purging inline).
 *
 * It ends when it finds itself the process's last live thread (main returned
 * through pthread_exit, or a child forked from another thread let that one
 * end): glibc then exits the process, atexit handlers and stdio flushes
 * included, within a tick of the last thread's end; so the thread has a
 * 2 MiB stack, and restores the signal mask of the thread that started it
 * first. Kept alive, it held the process for good, and with
 * every signal blocked only SIGKILL ended it. It looks (a read of
 * /proc/self/stat) only when no thread holds a keel heap any more: the
 * read costs hundreds of microseconds with thousands of threads, and its
 * open could take the lowest free descriptor from a program that counts on
 * it (close(0); open(...)).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/single_threaded.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/options.h"
#include "heap/internal.h"

enum { BG_NONE, BG_STARTING, BG_RUNNING, BG_FAILED };
static keel_atomic(int) bg_state;
static keel_atomic(int) work_noted;
static sigset_t creator_mask; /* the signal mask to run the process's exit with */

void _keel_purge_note_work(void) {
  if (!keel_load_relaxed(&work_noted)) keel_store_relaxed(&work_noted, 1);
}

/* Whether the calling thread (never the main one) is the process's only
 * live one: /proc/self/stat, read without allocating, counts the threads
 * (field 20), a main thread that ended with pthread_exit among them as a
 * zombie until the process ends, and gives the main thread's state (field
 * 3). False if it cannot be read. */
static bool only_thread(void) {
  char buf[1024];
  int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = 0;
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
  if (p == NULL || p[1] != ' ') return false;
  char state = p[2];
  for (int field = 2; field < 20; field++) {
    p = strchr(p + 1, ' ');
    if (p == NULL) return false;
  }
  return (p[1] == '1' && p[2] == ' ') || (p[1] == '2' && p[2] == ' ' && state == 'Z');
}

/* The purge period: a quarter of heap_purge_ms, within [10 ms, 1 s]. */
static int64_t tick_ms(void) {
  int64_t tick = _keel_option(KEEL_OPT_heap_purge_ms) / 4;
  return tick < 10 ? 10 : tick > 1000 ? 1000 : tick;
}

static void collect_all(void) {
  _keel_heaps_collect(false);
  _keel_segments_collect(false);
  _keel_large_collect(false);
}

static void *purge_main(void *arg) {
  (void)arg;
  for (;;) {
    if (_keel_heaps_active() == 0 && only_thread()) {
      pthread_sigmask(SIG_SETMASK, &creator_mask, NULL);
      keel_store_relaxed(&bg_state, BG_NONE);
      return NULL; /* glibc's exit(0) for the last thread */
    }
    int64_t tick = tick_ms();
    struct timespec ts = {(time_t)(tick / 1000), (long)(tick % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    collect_all();
  }
  return NULL;
}

/* The single-threaded process's tick (see the file comment). The deadline
 * moves before the collection, which may come back here; by CAS, because a
 * forked child's second thread may come here too before it first allocates
 * (a free of another thread's block). */
static keel_atomic(uint64_t) inline_next_ms;
static void purge_inline(void) {
  uint64_t now = keel_clock_coarse_ms(), next = keel_load_relaxed(&inline_next_ms);
  if (now < next) return;
  if (!keel_cas_strong_acq_rel(&inline_next_ms, &next, now + (uint64_t)tick_ms())) return;
  collect_all();
}

/* Set in a forked child; its only thread then is fork_thread. */
static keel_atomic(int) forked_single;
static pthread_t fork_thread;

void _keel_purge_note_thread(void) {
  if (keel_unlikely(keel_load_relaxed(&forked_single)) &&
      !pthread_equal(pthread_self(), fork_thread))
    keel_store_relaxed(&forked_single, 0);
}

void _keel_purge_schedule(void) {
  if (keel_likely(keel_load_relaxed(&bg_state) != BG_NONE)) return;
  if (!keel_load_relaxed(&work_noted)) return;
  if (__libc_single_threaded || keel_load_relaxed(&forked_single)) {
    purge_inline();
    return;
  }
  int expected = BG_NONE;
  if (!keel_cas_strong_acq_rel(&bg_state, &expected, BG_STARTING)) return;
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  creator_mask = old; /* before the thread exists: it reads it */
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  /* Room for the process's exit (atexit handlers, destructors) if it ends
   * last; address space only. Not the default size: a forked child's
   * threads would then reuse its stack, and its thread id, which TSan
   * refuses ("dup thread"). */
  pthread_attr_setstacksize(&attr, 2 << 20);
  pthread_t t;
  int rc = pthread_create(&t, &attr, purge_main, NULL);
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  keel_store_relaxed(&bg_state, rc == 0 ? BG_RUNNING : BG_FAILED);
}

void _keel_purge_fork_child(void) {
  keel_store_relaxed(&bg_state, BG_NONE);
  fork_thread = pthread_self();
  keel_store_relaxed(&forked_single, 1);
}
