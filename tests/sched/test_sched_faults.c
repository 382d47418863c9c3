/* sched tests that need a thread held at one exact point: each pins a bug
 * found by review, with no sleep deciding the outcome.
 *
 * This executable interposes syscall(2), which keel's futex calls go
 * through (base/futex.h), so a test can hold a worker right after a futex
 * wait or wake returns until the main thread has set up the race, then let
 * it go. A held thread waits for a flag, never for a length of time; a cap
 * of seconds only keeps a broken build from hanging. Everything not armed
 * passes straight through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <keel/sched.h>

#include "base/clock.h"
#include "harness.h"
#include "sched_test.h"
#include "sched/sched_int.h"

/* ---- syscall interposition ------------------------------------------- */

static atomic_int main_tid; /* the test's thread: never held */
__attribute__((constructor)) static void note_main_tid(void) {
  atomic_store(&main_tid, gettid());
}
/* Armed: the next worker futex wait that times out holds its thread. */
static atomic_int hold_timeout, timeout_held, timeout_release;
/* Armed: the next futex wake of a worker's word by a thread of keel's
 * holds that thread once the wake is done. */
static atomic_int hold_wake, wake_held, wake_release;
/* Armed: the next worker futex wait that returns woken (or finds its word
 * already set by a waker) holds its thread. */
static atomic_int hold_woken, woken_held, woken_release;
/* Futex wakes of the monitor by the test's thread (pokes from MON_INF). */
static atomic_int main_pokes;
/* Futex wakes of the monitor by keel's threads (pokes, ends of naps). */
static atomic_int keel_pokes;
/* Futex waits begun on a worker's word (parks), and those not yet returned. */
static atomic_int worker_waits, workers_waiting;

static long real_syscall(long n, long a[6]) {
  static long (*real)(long, ...);
  if (real == NULL) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  return real(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}

static void hold_for_at_most(atomic_int *release, double sec) {
  double end = kt_now() + sec;
  while (!atomic_load(release) && kt_now() < end) kt_sleep_ms(0.5);
}

static void hold_until(atomic_int *release) {
  hold_for_at_most(release, 10);
}

long syscall(long n, ...) {
  va_list ap;
  va_start(ap, n);
  long a[6];
  for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
  va_end(ap);
  bool worker_wait = n == SYS_futex && (int)(a[1] & FUTEX_CMD_MASK) == FUTEX_WAIT_BITSET &&
                     (void *)a[0] != (void *)&_keel_sched.mon_mode;
  if (worker_wait) {
    atomic_fetch_add(&worker_waits, 1);
    atomic_fetch_add(&workers_waiting, 1);
  }
  long rc = real_syscall(n, a);
  int err = errno;
  if (worker_wait) atomic_fetch_sub(&workers_waiting, 1);
  if (n != SYS_futex) return rc;
  int cmd = (int)(a[1] & FUTEX_CMD_MASK);
  bool worker_word = (void *)a[0] != (void *)&_keel_sched.mon_mode;
  if (gettid() == atomic_load(&main_tid)) {
    if (cmd == FUTEX_WAKE && !worker_word) atomic_fetch_add(&main_pokes, 1);
    errno = err;
    return rc;
  }
  if (cmd == FUTEX_WAKE && !worker_word) atomic_fetch_add(&keel_pokes, 1);
  if (worker_wait && (rc == 0 || err == EAGAIN) && atomic_exchange(&hold_woken, 0)) {
    atomic_store(&woken_held, 1);
    hold_until(&woken_release);
  }
  if (cmd == FUTEX_WAIT_BITSET && rc == -1 && err == ETIMEDOUT && worker_word &&
      atomic_exchange(&hold_timeout, 0)) {
    atomic_store(&timeout_held, 1);
    hold_until(&timeout_release);
  }
  if (cmd == FUTEX_WAKE && worker_word && atomic_exchange(&hold_wake, 0)) {
    atomic_store(&wake_held, 1);
    hold_until(&wake_release);
  }
  errno = err;
  return rc;
}

/* A KEEL_JOB_BLOCKING job that holds its worker until released (blocking:
 * the monitor may grow the pool past it even on one CPU). */
static atomic_int gate_open, gate_entered;
static void gate_fn(keel_job_t *j) {
  (void)j;
  atomic_store(&gate_entered, 1);
  while (!atomic_load(&gate_open)) kt_sleep_ms(0.2);
}
static keel_job_t gate_job;
static void gate_close(void) {
  atomic_store(&gate_open, 0);
  atomic_store(&gate_entered, 0);
  keel_job_init(&gate_job, gate_fn, KEEL_JOB_BLOCKING);
  KT_EQ(keel_sched_submit(&gate_job), 0);
  KT_REQUIRE(kt_wait_for(flag_set, &gate_entered, 10));
}

static bool retired_one(void *a) {
  (void)a;
  keel_sched_stats_t st;
  keel_sched_stats(&st);
  return st.retired >= 1;
}

/* Review bug 1: a worker above min that a waker popped from the idle stack
 * after its retire deadline, and whose work another took, came back to park
 * with that deadline already past; park returned at once without the retire
 * check, so it looped take/spin/park on a CPU and never retired (another
 * worker retired in its place, once idle long enough). Here the other
 * worker is held in a job, so only the looping one could retire. */
static void past_deadline_retires(void) {
  start(1, 2, 50, 600000);
  gate_close(); /* W1 */
  atomic_store(&timeout_held, 0);
  atomic_store(&timeout_release, 0);
  atomic_store(&hold_timeout, 1); /* before W2 exists: it cannot time out first */
  tjob_t j0;
  tjob_init(&j0, 0);
  KT_EQ(keel_sched_submit(&j0.job), 0);                 /* no worker idle: the monitor adds W2 */
  KT_REQUIRE(kt_wait_for(flag_set, &timeout_held, 10)); /* W2 timed out at its retire time */
  /* W2 is still on the idle stack: this submit's kick pops it for J, which
   * nobody can take (W1 held, W2 held) and which is then cancelled. */
  tjob_t j;
  tjob_init(&j, 0);
  KT_EQ(keel_sched_submit(&j.job), 0);
  KT_CHECK(atomic_load(&_keel_sched.nidle) == 0);
  KT_EQ(keel_sched_cancel(&j.job), 0);
  atomic_store(&timeout_release, 1);
  KT_CHECK(kt_wait_for(retired_one, NULL, 10));
  atomic_store(&gate_open, 1);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
  KT_EQ(atomic_load(&j0.runs), 1);
  KT_EQ(atomic_load(&j.cancels), 1);
}

/* ---- thread creation failures (_keel_sched_create_hook) ------------- */

static atomic_int creates, fail_at; /* fail_at: the n-th creation fails */

static int fail_nth(void) {
  return atomic_fetch_add(&creates, 1) + 1 == atomic_load(&fail_at) ? EAGAIN : 0;
}

static void fail_creation(int nth) {
  atomic_store(&creates, 0);
  atomic_store(&fail_at, nth);
  __atomic_store_n(&_keel_sched_create_hook, fail_nth, __ATOMIC_RELEASE);
}

static void creations_ok(void) {
  __atomic_store_n(&_keel_sched_create_hook, NULL, __ATOMIC_RELEASE);
}

static bool ran_once(void *a) {
  return atomic_load(&((tjob_t *)a)->runs) == 1;
}

/* With W1 held in the gate job, submits j0: no worker is idle, so the
 * monitor creates W2, through `hook` (set first: a BLOCKING gate job may
 * itself make the monitor add W2). Returns once the hook has set *entered. */
static void monitor_creates_w2(int (*hook)(void), tjob_t *j0, atomic_int *entered) {
  __atomic_store_n(&_keel_sched_create_hook, hook, __ATOMIC_RELEASE);
  gate_close(); /* W1 */
  tjob_init(j0, 0);
  KT_EQ(keel_sched_submit(&j0->job), 0);
  KT_REQUIRE(kt_wait_for(flag_set, entered, 10));
}

/* Second review, bug 4: try_retire compared nthreads, which counts a
 * worker whose pthread_create is still in progress, with min; W1 retired on
 * that count, W2's creation then failed, and the RUNNING pool had no worker
 * (min 1): keel_sched_after spun on KEEL_EAGAIN for ever. Here the monitor
 * is held creating W2 while W1 times out at its retire deadline and makes
 * its retire check; then W2's creation fails. */
static atomic_int create_in, create_release;
static int hold_then_fail(void) {
  atomic_store(&create_in, 1);
  hold_until(&create_release);
  return EAGAIN;
}

static uint64_t retired_before; /* statistics count since the process started */
static uint64_t retired_now(void) {
  keel_sched_stats_t st;
  keel_sched_stats(&st);
  return st.retired - retired_before;
}

static bool one_parked(void *a) {
  (void)a;
  keel_sched_stats_t st;
  keel_sched_stats(&st);
  return st.threads == 1 && st.idle == 1;
}

static bool parked_again(void *a) {
  return retired_now() > 0 || atomic_load(&worker_waits) > *(int *)a;
}

static void no_retire_below_min(void) {
  start(1, 2, 50, 600000);
  /* W1 alone, parked: one still starting made the gate job wait and the
   * monitor add a W2 before the hook was set (which then ran j0). */
  KT_REQUIRE(kt_wait_for(one_parked, NULL, 10));
  retired_before = retired_now();
  /* The hook before the gate (1 run in 20 had W2 run j0 otherwise). */
  atomic_store(&create_in, 0);
  atomic_store(&create_release, 0);
  tjob_t j0;
  monitor_creates_w2(hold_then_fail, &j0, &create_in);
  atomic_store(&timeout_held, 0);
  atomic_store(&timeout_release, 0);
  atomic_store(&hold_timeout, 1);
  atomic_store(&gate_open, 1); /* W1 runs j0, parks until its retire deadline */
  KT_REQUIRE(kt_wait_for(flag_set, &timeout_held, 10));
  int waits = atomic_load(&worker_waits);
  atomic_store(&timeout_release, 1); /* its retire check, W2 still starting */
  KT_REQUIRE(kt_wait_for(parked_again, &waits, 10));
  atomic_store(&create_release, 1); /* W2's creation fails */
  KT_EQ(retired_now(), 0);
  creations_ok();
  tjob_t t;
  tjob_init(&t, 0);
  KT_EQ(keel_sched_after(&t.job, 1), 0);
  KT_CHECK(kt_wait_for(ran_once, &t, 10));
  KT_EQ(atomic_load(&j0.runs), 1);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
}

/* Review (helper-84, finding 1): the monitor runs the on_cancels of the
 * timers of a worker it could not create; one that called
 * keel_sched_shutdown there waited for the workers, which wait for those
 * timers to be notified, by the monitor: a hang for ever. From the monitor
 * thread (here its creation hook, where such on_cancels run) init and
 * shutdown now give KEEL_EDEADLK. */
static atomic_int mon_calls, mon_done, mon_shutdown_rc, mon_init_rc;
static int call_from_monitor(void) {
  if (atomic_fetch_add(&mon_calls, 1) == 0) {
    atomic_store(&mon_shutdown_rc, keel_sched_shutdown(KEEL_SCHED_DRAIN));
    atomic_store(&mon_init_rc, keel_sched_init(NULL));
    atomic_store(&mon_done, 1);
  }
  return EAGAIN;
}

static void lifecycle_from_monitor(void) {
  start(1, 2, 600000, 600000);
  KT_REQUIRE(kt_wait_for(one_parked, NULL, 10));
  atomic_store(&mon_calls, 0);
  atomic_store(&mon_done, 0);
  atomic_store(&mon_shutdown_rc, 1);
  atomic_store(&mon_init_rc, 1);
  tjob_t j0;
  monitor_creates_w2(call_from_monitor, &j0, &mon_calls);
  KT_REQUIRE(kt_wait_for(flag_set, &mon_done, 10)); /* before the fix: a hang */
  KT_EQ(atomic_load(&mon_shutdown_rc), KEEL_EDEADLK);
  KT_EQ(atomic_load(&mon_init_rc), KEEL_EDEADLK);
  creations_ok();
  atomic_store(&gate_open, 1);
  KT_CHECK(kt_wait_for(ran_once, &j0, 10));
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
}

/* Back to a pool never initialised, for the lazy-init cases: after a full
 * shutdown nothing is left that UNINIT would not also describe. */
static void uninit(void) {
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
  atomic_store(&_keel_sched.state, SCHED_UNINIT);
}

/* Review bug 2: one transient pthread_create failure during the lazy init
 * made the first submit fail (right) and every later one fail with
 * KEEL_ESHUTDOWN although nobody had shut the pool down: the failed init
 * left SHUTDOWN behind, and the lazy init runs only from UNINIT. */
static void lazy_init_retried(void) {
  uninit();
  tjob_t t;
  tjob_init(&t, 0);
  fail_creation(1);
  KT_EQ(keel_sched_submit(&t.job), KEEL_EAGAIN);
  creations_ok();
  KT_EQ(atomic_load(&_keel_sched.state), SCHED_UNINIT);
  KT_EQ(keel_sched_submit(&t.job), 0); /* inits again */
  KT_CHECK(kt_wait_for(ran_once, &t, 10));
  /* The same for an explicit init, whose failure leaves UNINIT (or a
   * shutdown pool) as it was; and a later thread failing as the first. */
  uninit();
  fail_creation(2);
  keel_sched_config_t cfg = {2, 2, 1000, 20};
  KT_EQ(keel_sched_init(&cfg), KEEL_EAGAIN);
  creations_ok();
  KT_EQ(atomic_load(&_keel_sched.state), SCHED_UNINIT);
  tjob_init(&t, 0);
  KT_EQ(keel_sched_submit(&t.job), 0);
  KT_CHECK(kt_wait_for(ran_once, &t, 10));
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
  fail_creation(1);
  KT_EQ(keel_sched_init(&cfg), KEEL_EAGAIN);
  creations_ok();
  KT_EQ(keel_sched_submit(&t.job), KEEL_ESHUTDOWN); /* shut down before, still */
  KT_EQ(keel_sched_init(&cfg), 0);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
}

/* Review bug 3: init published RUNNING before it created its threads, so a
 * timer could be armed meanwhile; when a creation then failed, init's stop()
 * cancelled that timer and ran its on_cancel in the init thread, which
 * holds life_lock, and an on_cancel calling keel_sched_shutdown or
 * keel_sched_init deadlocked there instead of getting KEEL_EDEADLK. Since
 * review bug E (failed_init_is_no_shutdown) an init accepts nothing until
 * its threads exist, so a failed one runs no on_cancel at all; what is left
 * to pin is the init thread itself calling keel while it creates threads
 * (here from the creation hook): KEEL_EDEADLK at once, not a wait for
 * itself, and nothing accepted. */
static keel_job_t life_timer, life_job;
static atomic_int life_after_rc, life_submit_rc, life_init_rc, life_shutdown_rc;

static int call_then_fail_second(void) {
  if (atomic_fetch_add(&creates, 1) + 1 != 2) return 0;
  keel_job_init(&life_timer, tjob_fn, 0);
  keel_job_init(&life_job, tjob_fn, 0);
  atomic_store(&life_after_rc, keel_sched_after(&life_timer, 600000));
  atomic_store(&life_submit_rc, keel_sched_submit(&life_job));
  atomic_store(&life_init_rc, keel_sched_init(NULL));
  atomic_store(&life_shutdown_rc, keel_sched_shutdown(KEEL_SCHED_CANCEL));
  return EAGAIN;
}

static void on_cancel_of_failed_init(void) {
  keel_sched_config_t cfg = {2, 2, 1000, 20};
  for (int lazy = 0; lazy < 2; lazy++) {
    uninit();
    atomic_store(&creates, 0);
    __atomic_store_n(&_keel_sched_create_hook, call_then_fail_second, __ATOMIC_RELEASE);
    tjob_t t;
    tjob_init(&t, 0);
    KT_EQ(lazy ? keel_sched_submit(&t.job) : keel_sched_init(&cfg), KEEL_EAGAIN);
    creations_ok();
    KT_EQ(atomic_load(&life_after_rc), KEEL_EDEADLK);
    KT_EQ(atomic_load(&life_submit_rc), KEEL_EDEADLK);
    KT_EQ(atomic_load(&life_init_rc), KEEL_EDEADLK);
    KT_EQ(atomic_load(&life_shutdown_rc), KEEL_EDEADLK);
    KT_EQ(atomic_load(&_keel_sched.state), SCHED_UNINIT);
    KT_EQ(_keel_job_state(&life_timer), JOB_IDLE); /* still the caller's */
    KT_EQ(_keel_job_state(&life_job), JOB_IDLE);
  }
  KT_EQ(keel_sched_init(&cfg), 0); /* nothing left held */
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
}

/* Third review, bug E (repro e_failed_init_eshutdown): a failed lazy init
 * that nobody shut down made a concurrent submit fail with KEEL_ESHUTDOWN
 * (it read STOPPING, which init's stop() published while undoing the
 * start), and jobs accepted while init was creating its threads (the state
 * was RUNNING from its start) were then cancelled. The first creation
 * fails here. From the creation hook the init thread submits K, lets B
 * submit and waits until B has returned or sleeps on life_lock; K's
 * on_cancel, should a failed init cancel K, lets C submit during the undo.
 * Neither may be told KEEL_ESHUTDOWN; a job accepted must run, not be
 * cancelled; one refused stays the caller's. B, waiting for the failed
 * init, then starts the pool itself. */
typedef struct racer {
  tjob_t t;
  atomic_int go, done, rc;
  pthread_t thread;
} racer_t;
static racer_t racer_b, racer_c;
static tjob_t init_k;
static atomic_int init_k_rc;

static void *racer_main(void *a) {
  racer_t *r = a;
  if (kt_wait_for(flag_set, &r->go, 30)) atomic_store(&r->rc, keel_sched_submit(&r->t.job));
  atomic_store(&r->done, 1);
  return NULL;
}

/* Someone sleeps on life_lock: glibc's lock word of a normal mutex is 2
 * once a waiter has gone to sleep (it is 1 while merely held). */
static bool life_lock_waited_on(void) {
  return __atomic_load_n(&_keel_sched.life_lock.__data.__lock, __ATOMIC_RELAXED) == 2;
}

static void init_k_cancel(keel_job_t *j) { /* runs only if the failed init cancels K */
  tjob_cancel(j);
  atomic_store(&racer_c.go, 1);
  kt_wait_for(flag_set, &racer_c.done, 10);
}

static int submit_then_fail_first(void) {
  if (atomic_fetch_add(&creates, 1) != 0) return 0;
  tjob_init(&init_k, 0);
  init_k.job.on_cancel = init_k_cancel;
  atomic_store(&init_k_rc, keel_sched_submit(&init_k.job));
  atomic_store(&racer_b.go, 1);
  double end = kt_now() + 10;
  while (!atomic_load(&racer_b.done) && !life_lock_waited_on() && kt_now() < end) kt_sleep_ms(0.2);
  return EAGAIN;
}

static bool settled(void *a) {
  tjob_t *t = a;
  return atomic_load(&t->runs) + atomic_load(&t->cancels) > 0;
}

/* A job whose submit returned rc: run once and never cancelled if accepted,
 * untouched if not. */
static void check_owner(tjob_t *t, int rc) {
  if (rc == 0) KT_CHECK(kt_wait_for(settled, t, 10));
  KT_EQ(atomic_load(&t->runs), rc == 0);
  KT_EQ(atomic_load(&t->cancels), 0);
}

static void failed_init_is_no_shutdown(void) {
  uninit();
  racer_t *racers[] = {&racer_b, &racer_c};
  for (int i = 0; i < 2; i++) {
    racer_t *r = racers[i];
    tjob_init(&r->t, 0);
    atomic_store(&r->go, 0);
    atomic_store(&r->done, 0);
    atomic_store(&r->rc, 1);
    KT_REQUIRE(pthread_create(&r->thread, NULL, racer_main, r) == 0);
  }
  atomic_store(&init_k_rc, 1);
  atomic_store(&creates, 0);
  __atomic_store_n(&_keel_sched_create_hook, submit_then_fail_first, __ATOMIC_RELEASE);
  tjob_t first;
  tjob_init(&first, 0);
  KT_EQ(keel_sched_submit(&first.job), KEEL_EAGAIN); /* its own init failed */
  atomic_store(&racer_c.go, 1);
  for (int i = 0; i < 2; i++) pthread_join(racers[i]->thread, NULL);
  creations_ok();
  KT_EQ(atomic_load(&init_k_rc), KEEL_EDEADLK); /* the init thread, waiting for itself */
  KT_EQ(atomic_load(&racer_b.rc), 0);           /* B's own init, after the failed one */
  KT_EQ(atomic_load(&racer_c.rc), 0);
  check_owner(&init_k, atomic_load(&init_k_rc));
  check_owner(&racer_b.t, atomic_load(&racer_b.rc));
  check_owner(&racer_c.t, atomic_load(&racer_c.rc));
  check_owner(&first, KEEL_EAGAIN);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
}

/* ---- timers ---------------------------------------------------------- */

/* Review bug 4: a fired timer was counted off its client's ntimers only
 * after _keel_sched_enqueue, whose kick wakes a parked worker; that worker
 * could run the job first, and the job's fn calling
 * keel_sched_client_destroy for its only job got KEEL_EBUSY (sched.h: busy
 * only while a job of it is queued or timed). Here the thread that fired
 * the timer is held right after that wake until the job's fn has run. */
static keel_sched_client_t *fired_client;
static atomic_int destroy_rc = 1, fired_ran;
static void destroy_own_client(keel_job_t *j) {
  (void)j;
  atomic_store(&destroy_rc, keel_sched_client_destroy(fired_client));
  atomic_store(&fired_ran, 1);
}

static void destroy_from_fired_job(void) {
  start(2, 2, 60000, 600000); /* the owner fires and wakes the other */
  fired_client = keel_sched_client_create();
  KT_REQUIRE(fired_client != NULL);
  keel_job_t t;
  keel_job_init(&t, destroy_own_client, 0);
  t.client = fired_client;
  atomic_store(&wake_held, 0);
  atomic_store(&wake_release, 0);
  atomic_store(&hold_wake, 1);
  KT_EQ(keel_sched_after(&t, 20), 0);
  KT_CHECK(kt_wait_for(flag_set, &fired_ran, 10));
  atomic_store(&wake_release, 1);
  atomic_store(&hold_wake, 0);
  KT_EQ(atomic_load(&destroy_rc), 0);
  if (atomic_load(&destroy_rc) != 0) {
    KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0); /* then the client is free */
    KT_EQ(keel_sched_client_destroy(fired_client), 0);
  }
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
}

/* ---- wake-ups ---------------------------------------------------------- */

/* Review bug 5: a worker that takes a batch of one and leaves work behind
 * chain-woke no parked sibling and poked the monitor only in MON_INF; with
 * the monitor napping block_ms/2 (here 300 s: a worker owning a timer is in
 * a long job) the work left behind waited for that nap while a worker sat
 * parked. L, a blocking job (it ends its batch), waits for J, submitted
 * right behind it; J must run on the parked worker while L holds its own.
 * (Third review, bug 2: L's take now ends the nap instead of waking a
 * sibling itself; the monitor, ticking again, wakes one for J.) */
static atomic_int owner_in, owner_release, j_ran, l_saw_j;
static keel_job_t owner_timer;

static void owner_fn(keel_job_t *j) {
  (void)j;
  keel_job_init(&owner_timer, tjob_fn, 0);
  KT_EQ(keel_sched_after(&owner_timer, 600000), 0); /* on this worker */
  atomic_store(&owner_in, 1);
  hold_for_at_most(&owner_release, 60); /* longer than L waits for J */
}

static void l_fn(keel_job_t *j) {
  (void)j;
  hold_until(&j_ran);
  atomic_store(&l_saw_j, atomic_load(&j_ran));
}

static void j_fn(keel_job_t *j) {
  (void)j;
  atomic_store(&j_ran, 1);
}

static bool monitor_naps(void *a) {
  (void)a;
  return atomic_load(&_keel_sched.mon_mode) == MON_NAP;
}

static bool n_asleep(void *a);

/* Every worker parked before the owner's job is queued: a tick that saw work
 * waiting with none parked (workers still spinning after init) would nap
 * for that instead (MON_FULL, block_ms/2 = 300 s here), not for the timer. */
static void start_parked(unsigned n) {
  start(n, n, 60000, 600000);
  KT_REQUIRE(kt_wait_for(n_asleep, (void *)(uintptr_t)n, 10));
}

static void batch_of_one_wakes_when_monitor_naps(void) {
  start_parked(3);
  keel_job_t owner, l, j;
  keel_job_init(&owner, owner_fn, 0);
  keel_job_init(&l, l_fn, KEEL_JOB_BLOCKING);
  keel_job_init(&j, j_fn, 0);
  KT_EQ(keel_sched_submit(&owner), 0);
  KT_REQUIRE(kt_wait_for(flag_set, &owner_in, 10));
  KT_REQUIRE(kt_wait_for(monitor_naps, NULL, 10));
  KT_EQ(keel_sched_submit(&l), 0);
  KT_EQ(keel_sched_submit(&j), 0);
  KT_CHECK(kt_wait_for(flag_set, &l_saw_j, 20));
  atomic_store(&owner_release, 1);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_CANCEL), 0); /* cancels the timer */
}

/* Review bug 6: keel_sched_after from outside the pool poked the monitor
 * only if the owner's seq said it was inside a job; an owner that had read
 * next_deadline (no timer yet) and had not yet published its odd seq was
 * missed by both sides, and with the monitor in MON_INF the timer fired
 * when that job ended (10 ms late by 591 ms in the review's run). That
 * window cannot be held from outside, so this checks the fix's rule: a
 * timer armed from outside pokes a monitor asleep without deadline, here
 * with the owner parked (the old rule's no). In an idle pool at min nothing
 * else wakes the monitor, so it is still in MON_INF when after() looks. */
static bool monitor_sleeps(void *a) {
  (void)a;
  return atomic_load(&_keel_sched.mon_mode) == MON_INF;
}

static void after_from_outside_pokes(void) {
  start(1, 1, 60000, 600000);
  KT_REQUIRE(kt_wait_for(monitor_sleeps, NULL, 10)); /* after its 20 ms linger */
  tjob_t t;
  tjob_init(&t, 0);
  int before = atomic_load(&main_pokes);
  KT_EQ(keel_sched_after(&t.job, 600000), 0);
  KT_EQ(atomic_load(&main_pokes), before + 1);
  KT_EQ(keel_sched_cancel(&t.job), 0);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
}

/* Third review, bug 1: a timer armed while the monitor was between its
 * last linger tick (which looked before the timer existed) and its MON_INF
 * store: keel_sched_after read MON_TICK and skipped its poke, go_inf
 * re-checked backlog and zombies but not timers, and the monitor slept for
 * good; the owner, inside a long job, fired the 10 ms timer when that job
 * ended (1500 ms in the review's repro d2_after_lost_poke). The monitor is
 * held at that point (_keel_sched_sleep_hook) while the timer is armed,
 * from the owner's own job and from outside on that worker. The owner's
 * job lasts until the timer has run, 5 s at most; 500 ms is the bound. */
static atomic_int sleep_hold, sleep_held, sleep_release;
static void hold_before_sleep(void) {
  if (!atomic_exchange(&sleep_hold, 0)) return;
  atomic_store(&sleep_held, 1);
  hold_until(&sleep_release);
}

static keel_job_t late_timer;
static atomic_int late_ran, late_from_job, late_owner_in;
static sched_worker_t *_Atomic late_owner;
static _Atomic uint64_t late_armed_ns, late_ran_ns;

static void late_fn(keel_job_t *j) {
  (void)j;
  atomic_store(&late_ran_ns, keel_clock_ns());
  atomic_store(&late_ran, 1);
}

static void late_arm(void) {
  keel_job_init(&late_timer, late_fn, 0);
  atomic_store(&late_armed_ns, keel_clock_ns());
  KT_EQ(keel_sched_after(&late_timer, 10), 0);
}

static void late_owner_fn(keel_job_t *j) {
  (void)j;
  atomic_store(&late_owner, _keel_sched_self);
  atomic_store(&late_owner_in, 1);
  if (atomic_load(&late_from_job)) {
    hold_until(&sleep_held);
    late_arm(); /* on this worker */
    atomic_store(&sleep_release, 1);
  }
  hold_for_at_most(&late_ran, 5);
}

static void timer_armed_as_monitor_sleeps(void) {
  for (int from_job = 1; from_job >= 0; from_job--) {
    start(2, 2, 60000, 20);
    atomic_store(&late_from_job, from_job);
    atomic_store(&late_ran, 0);
    atomic_store(&late_owner_in, 0);
    atomic_store(&sleep_held, 0);
    atomic_store(&sleep_release, 0);
    keel_job_t owner;
    keel_job_init(&owner, late_owner_fn, 0);
    KT_EQ(keel_sched_submit(&owner), 0);
    KT_REQUIRE(kt_wait_for(flag_set, &late_owner_in, 10));
    /* The next time the monitor is about to sleep for good: once the job's
     * start is MON_LINGER_NS behind it. It may be asleep already (the pool
     * was quiet since init, and a parked worker took the job): poked. */
    atomic_store(&sleep_hold, 1);
    __atomic_store_n(&_keel_sched_sleep_hook, hold_before_sleep, __ATOMIC_RELEASE);
    _keel_sched_poke();
    KT_REQUIRE(kt_wait_for(flag_set, &sleep_held, 10));
    tjob_t probe;
    tjob_init(&probe, 0);
    if (!from_job) {
      /* Owners from outside go round-robin: a probe for the other worker
       * (parked: it sleeps until its own deadline), then ours. */
      KT_EQ(keel_sched_after(&probe.job, 600000), 0);
      if (probe.job._l[0] == atomic_load(&late_owner)) {
        KT_EQ(keel_sched_cancel(&probe.job), 0);
        tjob_init(&probe, 0);
        KT_EQ(keel_sched_after(&probe.job, 600000), 0);
      }
      late_arm();
      KT_CHECK(late_timer._l[0] == atomic_load(&late_owner));
      atomic_store(&sleep_release, 1);
    }
    KT_CHECK(kt_wait_for(flag_set, &late_ran, 10));
    uint64_t late_ms = (atomic_load(&late_ran_ns) - atomic_load(&late_armed_ns)) / 1000000u;
    if (late_ms >= 500)
      kt_fail(__FILE__, __LINE__, "from %s: 10 ms timer ran after %" PRIu64 " ms",
              from_job ? "its owner's job" : "outside", late_ms);
    __atomic_store_n(&_keel_sched_sleep_hook, NULL, __ATOMIC_RELEASE);
    KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
    if (!from_job) KT_EQ(atomic_load(&probe.cancels), 1);
  }
}

/* Third review, bug 2: while the monitor napped (a worker owning a timer
 * inside a long job: tick() napped whenever one did, busy pool or not),
 * every take of one that left work behind woke a parked sibling: 3.1-3.2
 * wake-ups per burst of 4 against 2.0 without the timer (review repro
 * f_nap_wakes). Here each burst is two jobs, the worker woken for the first
 * held until the second is queued, so that its batch of one leaves work
 * behind: one wake-up per burst (it runs both), where the nap made two.
 * The monitor, whose nap that take ends, then ticks through the busy
 * period (bursts 2 ms apart, a tenth of its linger) instead of napping
 * between bursts and being poked out of each nap. Counts, not times: a
 * worker off its CPU a millisecond or two may cost a burst the monitor's
 * wake-up, and a gap stretched past the linger a poke, so the bounds leave
 * half the bursts for that. */
/* On the idle stack and in (or entering) their futex wait: a worker only
 * pushed may still see the next job in its re-check and take it unwoken. */
static bool n_asleep(void *a) {
  keel_sched_stats_t st;
  keel_sched_stats(&st);
  int n = (int)(uintptr_t)a;
  return st.idle == (unsigned)n && atomic_load(&workers_waiting) == n;
}

static bool both_ran(void *a) {
  tjob_t *t = a;
  return atomic_load(&t[0].runs) == 1 && atomic_load(&t[1].runs) == 1;
}

static void nap_burst_wakes_one(void) {
  enum { BURSTS = 20 };
  start_parked(4);
  atomic_store(&owner_in, 0);
  atomic_store(&owner_release, 0);
  keel_job_t owner;
  keel_job_init(&owner, owner_fn, 0);
  KT_EQ(keel_sched_submit(&owner), 0);
  KT_REQUIRE(kt_wait_for(flag_set, &owner_in, 10));
  KT_REQUIRE(kt_wait_for(monitor_naps, NULL, 10));
  keel_sched_stats_t before, after;
  keel_sched_stats(&before);
  int pokes = atomic_load(&keel_pokes);
  for (int i = 0; i < BURSTS; i++) {
    KT_REQUIRE(kt_wait_for(n_asleep, (void *)(uintptr_t)3, 10));
    tjob_t t[2];
    tjob_init(&t[0], 0);
    tjob_init(&t[1], 0);
    atomic_store(&woken_held, 0);
    atomic_store(&woken_release, 0);
    atomic_store(&hold_woken, 1);
    KT_EQ(keel_sched_submit(&t[0].job), 0); /* wakes one parked worker */
    KT_REQUIRE(kt_wait_for(flag_set, &woken_held, 10));
    KT_EQ(keel_sched_submit(&t[1].job), 0);
    atomic_store(&woken_release, 1);
    KT_REQUIRE(kt_wait_for(both_ran, t, 10));
    kt_sleep_ms(2); /* past the monitor's next ticks, well within its linger */
  }
  keel_sched_stats(&after);
  uint64_t wakeups = after.wakeups - before.wakeups;
  pokes = atomic_load(&keel_pokes) - pokes;
  if (wakeups > BURSTS + BURSTS / 2)
    kt_fail(__FILE__, __LINE__, "%" PRIu64 " wake-ups for %d bursts", wakeups, BURSTS);
  if (pokes > BURSTS / 2) kt_fail(__FILE__, __LINE__, "%d pokes for %d bursts", pokes, BURSTS);
  atomic_store(&owner_release, 1);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_CANCEL), 0); /* cancels the timer */
}

/* Review of this stop: a take that left work behind with a worker parked
 * and read MON_NAP ended the nap (MON_POKED) while the monitor was between
 * its look and its sleep; the monitor then stored its nap over MON_POKED
 * and the work waited the whole nap (block_ms/2: 1 s here) with a worker
 * parked. The monitor is held there (_keel_sched_tick_hook) while j1 and j2
 * are queued: j1's worker leaves j2 behind and ends the nap, or reads the
 * mode before the nap is stored; either way j2 must start well before the
 * nap would have ended. */
static atomic_int nap_hook_armed, nap_held, nap_release, nap_long_release, nap_j1_release;
static _Atomic uint64_t nap_j2_ns;
static keel_job_t nap_timer;

static void nap_hold_hook(uint64_t wait) {
  if (wait <= 1000000u || !atomic_exchange(&nap_hook_armed, 0)) return;
  atomic_store(&nap_held, 1);
  hold_until(&nap_release);
}

static void nap_long_fn(keel_job_t *j) {
  (void)j;
  keel_job_init(&nap_timer, tjob_fn, 0);
  KT_EQ(keel_sched_after(&nap_timer, 100000), 0); /* on this worker: the monitor naps for it */
  hold_for_at_most(&nap_long_release, 30);
}

static void nap_j1_fn(keel_job_t *j) {
  (void)j;
  hold_for_at_most(&nap_j1_release, 30);
}

static void nap_j2_fn(keel_job_t *j) {
  (void)j;
  atomic_store(&nap_j2_ns, keel_clock_ns());
}

static bool j2_ran(void *a) {
  (void)a;
  return atomic_load(&nap_j2_ns) != 0;
}

static void unnap_between_look_and_nap(void) {
  start(3, 3, 100000, 2000);
  KT_REQUIRE(kt_wait_for(n_asleep, (void *)(uintptr_t)3, 10));
  keel_job_t lj, j1, j2;
  keel_job_init(&lj, nap_long_fn, 0);
  keel_job_init(&j1, nap_j1_fn, 0);
  keel_job_init(&j2, nap_j2_fn, 0);
  KT_EQ(keel_sched_submit(&lj), 0);
  KT_REQUIRE(kt_wait_for(monitor_naps, NULL, 10));
  __atomic_store_n(&_keel_sched_tick_hook, nap_hold_hook, __ATOMIC_RELEASE);
  atomic_store(&nap_hook_armed, 1);
  KT_REQUIRE(kt_wait_for(flag_set, &nap_held, 10)); /* the nap ran out: the next look is held */
  uint64_t t0 = keel_clock_ns();
  KT_EQ(keel_sched_submit(&j1), 0);
  KT_EQ(keel_sched_submit(&j2), 0);
  kt_sleep_ms(20); /* j1's worker takes j1 and leaves j2 behind */
  atomic_store(&nap_release, 1);
  KT_REQUIRE(kt_wait_for(j2_ran, NULL, 10));
  uint64_t ms = (atomic_load(&nap_j2_ns) - t0) / 1000000u;
  if (ms >= 500) kt_fail(__FILE__, __LINE__, "j2 started %" PRIu64 " ms after its submit", ms);
  __atomic_store_n(&_keel_sched_tick_hook, NULL, __ATOMIC_RELEASE);
  atomic_store(&nap_j1_release, 1);
  atomic_store(&nap_long_release, 1);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_CANCEL), 0); /* cancels the timer */
}

KT_MAIN(KT_CASE(past_deadline_retires), KT_CASE(no_retire_below_min),
        KT_CASE(lifecycle_from_monitor), KT_CASE(lazy_init_retried),
        KT_CASE(on_cancel_of_failed_init), KT_CASE(failed_init_is_no_shutdown),
        KT_CASE(destroy_from_fired_job), KT_CASE(batch_of_one_wakes_when_monitor_naps),
        KT_CASE(after_from_outside_pokes), KT_CASE(timer_armed_as_monitor_sleeps),
        KT_CASE(nap_burst_wakes_one), KT_CASE(unnap_between_look_and_nap))
