/* Stress: KEEL_TEST_THREADS producers (64 by default) submit, resubmit,
 * time and cancel their own jobs at random, with random priorities and
 * clients, while the pool grows and shrinks; a fraction of jobs resubmit
 * themselves from inside fn. Invariant checked per job at the end:
 *   successful submits + armed timers == runs + cancel notices,
 * i.e. every accepted job ran exactly once or was cancelled with notice.
 * Deterministic per producer (xorshift seeded by its index).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include <keel/sched.h>

#include "harness.h"

#define container_of(p, T, m) ((T *)(void *)((char *)(p)-offsetof(T, m)))

typedef struct sjob {
  keel_job_t job;
  atomic_long accepted; /* submits and timers that returned 0 */
  atomic_long runs, cancels;
  atomic_int resubmit; /* fn resubmits itself this many more times */
} sjob_t;

enum { JOBS_PER_PRODUCER = 32, CLIENTS = 8 };

static keel_sched_client_t *clients[CLIENTS];
static atomic_long shutdown_rejects;

static void sjob_fn(keel_job_t *j) {
  sjob_t *s = container_of(j, sjob_t, job);
  atomic_fetch_add(&s->runs, 1);
  if (atomic_load(&s->resubmit) > 0) {
    atomic_fetch_sub(&s->resubmit, 1);
    /* Accepted is counted before the submit so a fast run cannot see
     * runs > accepted; a failed submit takes it back. */
    atomic_fetch_add(&s->accepted, 1);
    int rc = keel_sched_submit(j);
    if (rc != 0) atomic_fetch_sub(&s->accepted, 1);
    if (rc == KEEL_ESHUTDOWN) atomic_fetch_add(&shutdown_rejects, 1);
  }
}

static void sjob_cancel(keel_job_t *j) {
  atomic_fetch_add(&container_of(j, sjob_t, job)->cancels, 1);
}

static uint64_t xs(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}

typedef struct producer {
  pthread_t th;
  int index;
  long iters;
  sjob_t jobs[JOBS_PER_PRODUCER];
  long busy, cancelled_ok;
} producer_t;

static void one_op(producer_t *p, uint64_t *seed) {
  uint64_t r = xs(seed);
  sjob_t *s = &p->jobs[r % JOBS_PER_PRODUCER];
  unsigned op = (unsigned)(r >> 8) % 16;
  if (op < 3) { /* cancel one of ours */
    int rc = keel_sched_cancel(&s->job);
    KT_CHECK(rc == 0 || rc == KEEL_EBUSY || rc == KEEL_ENOENT);
    p->cancelled_ok += rc == 0;
    return;
  }
  if ((r >> 30) % 8 == 0) atomic_store(&s->resubmit, 3);
  atomic_fetch_add(&s->accepted, 1);
  int rc = op < 5 ? keel_sched_after(&s->job, (r >> 40) % 3) : keel_sched_submit(&s->job);
  if (rc != 0) atomic_fetch_sub(&s->accepted, 1);
  KT_CHECK(rc == 0 || rc == KEEL_EBUSY);
  p->busy += rc == KEEL_EBUSY;
}

static void *producer_main(void *arg) {
  producer_t *p = arg;
  uint64_t seed = 0x9E3779B97F4A7C15ull * (uint64_t)(p->index + 1);
  for (long i = 0; i < p->iters; i++) {
    one_op(p, &seed);
    if (i % 256 == 0) sched_yield();
  }
  return NULL;
}

static void check_jobs(producer_t *ps, int n) {
  long accepted = 0, runs = 0, cancels = 0, bad = 0;
  for (int i = 0; i < n; i++)
    for (int j = 0; j < JOBS_PER_PRODUCER; j++) {
      sjob_t *s = &ps[i].jobs[j];
      long a = atomic_load(&s->accepted), r = atomic_load(&s->runs), c = atomic_load(&s->cancels);
      accepted += a;
      runs += r;
      cancels += c;
      bad += a != r + c;
    }
  KT_EQ(bad, 0);
  KT_EQ(accepted, runs + cancels);
  KT_CHECK(runs > 0);
  printf("  %ld accepted = %ld runs + %ld cancel notices\n", accepted, runs, cancels);
}

static void stress(int how) {
  int nprod = (int)kt_env_int("KEEL_TEST_THREADS", 64);
  long iters = kt_scale(kt_env_int("KEEL_TEST_ITERS", 30000));
  keel_sched_shutdown(KEEL_SCHED_DRAIN);
  keel_sched_config_t cfg = {1, 8, 20, 5};
  KT_REQUIRE(keel_sched_init(&cfg) == 0);
  for (int i = 0; i < CLIENTS; i++) KT_REQUIRE((clients[i] = keel_sched_client_create()) != NULL);
  producer_t *ps = calloc((size_t)nprod, sizeof(*ps));
  KT_REQUIRE(ps != NULL);
  keel_sched_stats_t before;
  keel_sched_stats(&before);
  for (int i = 0; i < nprod; i++) {
    ps[i].index = i;
    ps[i].iters = iters;
    for (int j = 0; j < JOBS_PER_PRODUCER; j++) {
      /* Priority and client are fixed per job: a job's fields may only
       * change while it is idle, which a producer cannot know while the job
       * may be resubmitting itself. */
      unsigned f = j % 3 == 0 ? KEEL_JOB_HIGH : (j % 3 == 1 ? KEEL_JOB_LOW : 0);
      keel_job_init(&ps[i].jobs[j].job, sjob_fn, f);
      ps[i].jobs[j].job.on_cancel = sjob_cancel;
      ps[i].jobs[j].job.client = j % 4 == 0 ? NULL : clients[(i + j) % CLIENTS];
    }
    pthread_create(&ps[i].th, NULL, producer_main, &ps[i]);
  }
  for (int i = 0; i < nprod; i++) pthread_join(ps[i].th, NULL);
  KT_EQ(keel_sched_shutdown(how), 0);
  check_jobs(ps, nprod);
  keel_sched_stats_t after;
  keel_sched_stats(&after);
  long accepted = 0;
  for (int i = 0; i < nprod; i++)
    for (int j = 0; j < JOBS_PER_PRODUCER; j++) accepted += atomic_load(&ps[i].jobs[j].accepted);
  KT_EQ((long)(after.submitted - before.submitted), accepted);
  KT_EQ(after.run + after.cancelled - before.run - before.cancelled, accepted);
  KT_EQ(after.threads, 0);
  KT_CHECK(after.spawned >= before.spawned + 1);
  for (int i = 0; i < CLIENTS; i++) KT_EQ(keel_sched_client_destroy(clients[i]), 0);
  free(ps);
}

static void stress_drain(void) {
  stress(KEEL_SCHED_DRAIN);
}

static void stress_cancel(void) {
  stress(KEEL_SCHED_CANCEL);
}

/* Producers race a shutdown: each submit either is accepted (and then runs
 * or is cancelled with notice) or returns KEEL_ESHUTDOWN with the job still
 * the producer's. */
static atomic_int race_stop;
static atomic_long race_accepted;
static void *racer_main(void *arg) {
  producer_t *p = arg;
  uint64_t seed = (uint64_t)p->index * 7919 + 1;
  while (!atomic_load(&race_stop)) {
    sjob_t *s = &p->jobs[xs(&seed) % JOBS_PER_PRODUCER];
    atomic_fetch_add(&s->accepted, 1);
    int rc = keel_sched_submit(&s->job);
    if (rc != 0) atomic_fetch_sub(&s->accepted, 1);
    if (rc == 0) atomic_fetch_add(&race_accepted, 1);
    KT_CHECK(rc == 0 || rc == KEEL_EBUSY || rc == KEEL_ESHUTDOWN);
    if (rc == KEEL_ESHUTDOWN) p->busy++;
    if (p->busy > 100) break;
  }
  return NULL;
}

static void shutdown_race(void) {
  int nprod = (int)kt_env_int("KEEL_TEST_THREADS", 64) / 4 + 1;
  keel_sched_shutdown(KEEL_SCHED_DRAIN);
  keel_sched_config_t cfg = {2, 4, 1000, 20};
  KT_REQUIRE(keel_sched_init(&cfg) == 0);
  producer_t *ps = calloc((size_t)nprod, sizeof(*ps));
  atomic_store(&race_stop, 0);
  atomic_store(&race_accepted, 0);
  for (int i = 0; i < nprod; i++) {
    ps[i].index = i;
    for (int j = 0; j < JOBS_PER_PRODUCER; j++) {
      keel_job_init(&ps[i].jobs[j].job, sjob_fn, 0);
      ps[i].jobs[j].job.on_cancel = sjob_cancel;
    }
    pthread_create(&ps[i].th, NULL, racer_main, &ps[i]);
  }
  /* Shut down while they submit (not before the first has started). */
  double end = kt_now() + 10;
  while (atomic_load(&race_accepted) < 1000 && kt_now() < end) sched_yield();
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_CANCEL), 0);
  atomic_store(&race_stop, 1);
  for (int i = 0; i < nprod; i++) pthread_join(ps[i].th, NULL);
  check_jobs(ps, nprod);
  free(ps);
}

/* Timers armed from inside blocking jobs (so in the heaps of workers the
 * pool keeps adding) while idle_ms is 1 ms (so workers retire all the time,
 * handing their heaps on) and producers cancel the timed jobs at random:
 * cancel, fire and hand-over race on every timer. Same invariant per job. */
enum { ARMERS = 8 };
typedef struct armer {
  sjob_t s;      /* its own accounting */
  sjob_t target; /* the job it times, from inside its fn */
  atomic_uint n; /* runs so far: picks the next delay */
} armer_t;

static void armer_fn(keel_job_t *j) {
  armer_t *a = container_of(j, armer_t, s.job);
  atomic_fetch_add(&a->s.runs, 1);
  struct timespec ts = {0, 50000};
  nanosleep(&ts, NULL); /* KEEL_JOB_BLOCKING: the pool grows past the CPUs */
  unsigned ms = 1 + atomic_fetch_add(&a->n, 1) * 7 % 20;
  atomic_fetch_add(&a->target.accepted, 1);
  int rc = keel_sched_after(&a->target.job, ms);
  if (rc != 0) atomic_fetch_sub(&a->target.accepted, 1);
  KT_CHECK(rc == 0 || rc == KEEL_EBUSY || rc == KEEL_ESHUTDOWN);
}

typedef struct tproducer {
  pthread_t th;
  int index;
  long iters;
  armer_t a[ARMERS];
} tproducer_t;

static void *tproducer_main(void *arg) {
  tproducer_t *p = arg;
  uint64_t seed = 0x2545F4914F6CDD1Dull * (uint64_t)(p->index + 1);
  for (long i = 0; i < p->iters; i++) {
    uint64_t r = xs(&seed);
    armer_t *a = &p->a[r % ARMERS];
    if ((r >> 8) % 4 == 0) {
      int rc = keel_sched_cancel(&a->target.job);
      KT_CHECK(rc == 0 || rc == KEEL_EBUSY || rc == KEEL_ENOENT);
    } else {
      atomic_fetch_add(&a->s.accepted, 1);
      int rc = keel_sched_submit(&a->s.job);
      if (rc != 0) atomic_fetch_sub(&a->s.accepted, 1);
      KT_CHECK(rc == 0 || rc == KEEL_EBUSY);
    }
    if (i % 64 == 0) {
      struct timespec ts = {0, 2000000};
      nanosleep(&ts, NULL); /* idle gaps: let workers retire */
    }
  }
  return NULL;
}

static void timers_retire_churn(void) {
  int nprod = (int)kt_env_int("KEEL_TEST_THREADS", 64) / 8 + 1;
  long iters = kt_scale(kt_env_int("KEEL_TEST_ITERS", 30000)) / 10 + 1;
  keel_sched_shutdown(KEEL_SCHED_DRAIN);
  keel_sched_config_t cfg = {1, 8, 1, 5};
  KT_REQUIRE(keel_sched_init(&cfg) == 0);
  tproducer_t *ps = calloc((size_t)nprod, sizeof(*ps));
  KT_REQUIRE(ps != NULL);
  keel_sched_stats_t before, after;
  keel_sched_stats(&before);
  for (int i = 0; i < nprod; i++) {
    ps[i].index = i;
    ps[i].iters = iters;
    for (int k = 0; k < ARMERS; k++) {
      keel_job_init(&ps[i].a[k].s.job, armer_fn, KEEL_JOB_BLOCKING);
      ps[i].a[k].s.job.on_cancel = sjob_cancel;
      keel_job_init(&ps[i].a[k].target.job, sjob_fn, k % 3 == 0 ? KEEL_JOB_LOW : 0);
      ps[i].a[k].target.job.on_cancel = sjob_cancel;
    }
    pthread_create(&ps[i].th, NULL, tproducer_main, &ps[i]);
  }
  for (int i = 0; i < nprod; i++) pthread_join(ps[i].th, NULL);
  /* Let the timers fire (a drain would cancel them), however loaded. */
  double end = kt_now() + 60;
  do {
    keel_sched_stats(&after);
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  } while ((after.timers | after.queued | after.running) != 0 && kt_now() < end);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_DRAIN), 0);
  long bad = 0, timed = 0, runs = 0;
  for (int i = 0; i < nprod; i++)
    for (int k = 0; k < ARMERS; k++) {
      sjob_t *x[2] = {&ps[i].a[k].s, &ps[i].a[k].target};
      for (int m = 0; m < 2; m++)
        bad +=
            atomic_load(&x[m]->accepted) != atomic_load(&x[m]->runs) + atomic_load(&x[m]->cancels);
      timed += atomic_load(&ps[i].a[k].target.accepted);
      runs += atomic_load(&ps[i].a[k].target.runs);
    }
  KT_EQ(bad, 0);
  KT_CHECK(timed > 0);
  keel_sched_stats(&after);
  KT_EQ(after.threads, 0);
  printf("  %ld timers armed in workers, %ld fired; %llu workers retired\n", timed, runs,
         (unsigned long long)(after.retired - before.retired));
  free(ps);
}

/* keel_sched_after racing a re-init: init publishes RUNNING before its
 * first worker is on sched.workers, and keel_sched_after took the first
 * entry of that empty list (its head, as a worker): memory corrupted, the
 * next shutdown hung. Armers time their jobs (some due within the
 * iteration, some never) while the main thread shuts down and re-inits;
 * every accepted timer must run or be cancelled with notice, and the
 * client's count of timers must be back at 0. */
static atomic_int reinit_stop;
static keel_sched_client_t *reinit_client;
static void *rearmer_main(void *arg) {
  producer_t *p = arg;
  uint64_t seed = (uint64_t)p->index * 104729 + 3;
  while (!atomic_load(&reinit_stop)) {
    uint64_t r = xs(&seed);
    sjob_t *s = &p->jobs[r % JOBS_PER_PRODUCER];
    atomic_fetch_add(&s->accepted, 1);
    int rc = keel_sched_after(&s->job, (r >> 8) % 2 ? 1 : 600000);
    if (rc != 0) atomic_fetch_sub(&s->accepted, 1);
    KT_CHECK(rc == 0 || rc == KEEL_EBUSY || rc == KEEL_ESHUTDOWN);
    if (rc == KEEL_ESHUTDOWN) sched_yield(); /* let the re-init in */
  }
  return NULL;
}

static void after_reinit_race(void) {
  enum { NARM = 4 };
  enum { REINITS = 300 }; /* not scaled: each is short, and the window is hit rarely */
  keel_sched_shutdown(KEEL_SCHED_DRAIN);
  keel_sched_config_t cfg = {1, 2, 1000, 20};
  KT_REQUIRE(keel_sched_init(&cfg) == 0);
  KT_REQUIRE((reinit_client = keel_sched_client_create()) != NULL);
  producer_t *ps = calloc(NARM, sizeof(*ps));
  KT_REQUIRE(ps != NULL);
  atomic_store(&reinit_stop, 0);
  for (int i = 0; i < NARM; i++) {
    ps[i].index = i;
    for (int j = 0; j < JOBS_PER_PRODUCER; j++) {
      keel_job_init(&ps[i].jobs[j].job, sjob_fn, j % 3 == 0 ? KEEL_JOB_LOW : 0);
      ps[i].jobs[j].job.on_cancel = sjob_cancel;
      ps[i].jobs[j].job.client = j % 2 ? reinit_client : NULL;
    }
    pthread_create(&ps[i].th, NULL, rearmer_main, &ps[i]);
  }
  for (long i = 0; i < REINITS; i++) {
    KT_EQ(keel_sched_shutdown(i % 2 ? KEEL_SCHED_CANCEL : KEEL_SCHED_DRAIN), 0);
    KT_EQ(keel_sched_init(&cfg), 0);
    if (i % 8 == 0) { /* now and then a pool that lives long enough to fire timers */
      struct timespec ts = {0, 2000000};
      nanosleep(&ts, NULL);
    }
  }
  atomic_store(&reinit_stop, 1);
  for (int i = 0; i < NARM; i++) pthread_join(ps[i].th, NULL);
  KT_EQ(keel_sched_shutdown(KEEL_SCHED_CANCEL), 0);
  check_jobs(ps, NARM);
  KT_EQ(keel_sched_client_destroy(reinit_client), 0);
  free(ps);
}

KT_MAIN(KT_CASE(stress_drain), KT_CASE(stress_cancel), KT_CASE(shutdown_race),
        KT_CASE(timers_retire_churn), KT_CASE(after_reinit_race))
