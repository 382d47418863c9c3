/* sched and fork before the pool's first call has finished: each case runs
 * in a child of its own, forked from a test process that has never called
 * sched, so pthread_once has not yet registered fork.c's handlers there.
 *
 * This executable interposes sched_getaffinity(2), which the default
 * configuration reads (keel_sched_config_default, via _keel_os_ncpu) while
 * init holds life_lock: armed, it holds the calling thread there until the
 * test lets it go. A held thread waits for a flag, never for a length of
 * time; alarm() only keeps a broken build from hanging.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <keel/sched.h>

#include "harness.h"
#include "sched/sched_int.h"

static atomic_int hold_aff, aff_held, aff_release;

int sched_getaffinity(pid_t pid, size_t size, cpu_set_t *set) {
  static int (*real)(pid_t, size_t, cpu_set_t *);
  if (real == NULL)
    real = (int (*)(pid_t, size_t, cpu_set_t *))dlsym(RTLD_NEXT, "sched_getaffinity");
  if (atomic_exchange(&hold_aff, 0)) {
    atomic_store(&aff_held, 1);
    while (!atomic_load(&aff_release)) kt_sleep_ms(0.2);
  }
  return real(pid, size, set);
}

static int wait_child(pid_t pid) {
  int status = 0;
  if (pid < 0) return -1;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

static atomic_int ran;
static void ran_fn(keel_job_t *j) {
  (void)j;
  atomic_store(&ran, 1);
}

/* The grandchild, forked while another thread's first call holds
 * life_lock: it must find that lock free and a pool of its own to start. */
static int grandchild(void) {
  alarm(30); /* a hang kills it with SIGALRM */
  if (pthread_mutex_trylock(&_keel_sched.life_lock) != 0) return 2; /* the parent's, held */
  pthread_mutex_unlock(&_keel_sched.life_lock);
  if (atomic_load(&_keel_sched.state) != SCHED_UNINIT) return 3;
#if !defined(KEEL_TSAN) /* TSan does not support creating threads after such a fork */
  keel_job_t j;
  keel_job_init(&j, ran_fn, 0);
  if (keel_sched_submit(&j) != 0) return 4;
  for (int i = 0; i < 20000 && !atomic_load(&ran); i++) kt_sleep_ms(1);
  if (!atomic_load(&ran)) return 5;
  if (keel_sched_shutdown(KEEL_SCHED_DRAIN) != 0) return 6;
#endif
  return 0;
}

enum { FIRST_STATS, FIRST_AFTER, FIRST_INIT };

static keel_job_t first_timer;
static void *first_call(void *a) {
  switch ((int)(uintptr_t)a) {
    case FIRST_STATS: {
      keel_sched_stats_t st;
      keel_sched_stats(&st);
      break;
    }
    case FIRST_AFTER:
      keel_job_init(&first_timer, ran_fn, 0);
      keel_sched_after(&first_timer, 600000);
      break;
    default:
      keel_sched_init(NULL);
  }
  return NULL;
}

/* The child: its first call, on thread A, is held inside init; the main
 * thread forks meanwhile. */
static int child(int which) {
  alarm(60);
  atomic_store(&hold_aff, 1);
  pthread_t a;
  if (pthread_create(&a, NULL, first_call, (void *)(uintptr_t)which) != 0) return 20;
  while (!atomic_load(&aff_held)) kt_sleep_ms(0.2);
  pid_t pid = fork();
  if (pid == 0) _exit(grandchild());
  atomic_store(&aff_release, 1);
  pthread_join(a, NULL);
  int st = wait_child(pid);
  keel_sched_shutdown(KEEL_SCHED_CANCEL);
  return st;
}

static int run_case(int which) {
  pid_t pid = fork();
  if (pid == 0) _exit(child(which));
  return wait_child(pid);
}

/* Review bug (second sched review) 1: fork.c's handlers were registered by
 * init_locked, after life_lock was taken and the default configuration read,
 * and keel_sched_after lazy-initialised before registering; a fork by
 * another thread meanwhile gave the child a held life_lock and no handler,
 * and its first submit hung. Every entry point now registers them first. */
static void fork_during_first_stats(void) {
  KT_EQ(run_case(FIRST_STATS), 0);
}

static void fork_during_first_after(void) {
  KT_EQ(run_case(FIRST_AFTER), 0);
}

static void fork_during_first_init(void) {
  KT_EQ(run_case(FIRST_INIT), 0);
}

KT_MAIN(KT_CASE(fork_during_first_stats), KT_CASE(fork_during_first_after),
        KT_CASE(fork_during_first_init))
