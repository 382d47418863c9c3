/* Stress: many threads (64 by default, oversubscribed on small machines)
 * hammer a few hot resources through every path: blocking and asynchronous
 * requests by name, conversions by handle, NOQUEUE tries, timeouts, upgrades
 * that may deadlock, cancels. Invariants checked inside every critical
 * section and at the end:
 *  - no two incompatible grants, ever: each holder counts itself into a
 *    per-resource, per-mode counter on entry and checks that no mode
 *    incompatible with its own is counted;
 *  - a plain (non-atomic) counter per resource is incremented only under PW
 *    or EX: lost updates (or, under TSan, a race report) mean two writers
 *    overlapped; its final value equals the number of write sections;
 *  - the value block travels with the counter: each writer finds the last
 *    writer's counter in it (VALBLK on every request and release).
 * KEEL_TEST_THREADS and KEEL_TEST_ITERS size it; kt_scale divides under
 * sanitizers. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "lock/lockspace.h"
#include "lock_test_util.h"

#define NRES 4

typedef struct hot {
  char name[24];
  int held[KEEL_LOCK_MODES]; /* atomic: holders in each mode */
  uint64_t counter;          /* plain: changed only under PW/EX */
  long writes;               /* atomic: write sections done */
} hot_t;

static hot_t hot[NRES];
static keel_lockspace_t *ls;
static long iters;
static long stats[8]; /* atomic: grants, eagain, timeouts, deadlocks, cancels, async */

static void count(int i) {
  __atomic_fetch_add(&stats[i], 1, __ATOMIC_RELAXED);
}

static void section(int r, int mode, keel_lksb_t *s) {
  hot_t *h = &hot[r];
  __atomic_fetch_add(&h->held[mode], 1, __ATOMIC_SEQ_CST);
  for (int m = 0; m < KEEL_LOCK_MODES; m++) {
    int n = __atomic_load_n(&h->held[m], __ATOMIC_SEQ_CST) - (m == mode);
    if (n > 0 && !kt_compat[m][mode])
      kt_fail(__FILE__, __LINE__, "%s: %s granted while %d hold %s", h->name,
              keel_lock_mode_name(mode), n, keel_lock_mode_name(m));
  }
  if (mode == KEEL_LOCK_PW || mode == KEEL_LOCK_EX) {
    uint64_t lvb;
    memcpy(&lvb, s->valblk, sizeof(lvb));
    if (lvb != h->counter)
      kt_fail(__FILE__, __LINE__, "%s: value block %llu, counter %llu", h->name,
              (unsigned long long)lvb, (unsigned long long)h->counter);
    h->counter++;
    memcpy(s->valblk, &h->counter, sizeof(h->counter));
    __atomic_fetch_add(&h->writes, 1, __ATOMIC_RELAXED);
  } else if (mode == KEEL_LOCK_PR) {
    volatile uint64_t c = h->counter; /* no writer may run now */
    (void)c;
  }
  if ((mode & 1) == 0) sched_yield(); /* let others pile up behind half the time */
  __atomic_fetch_sub(&h->held[mode], 1, __ATOMIC_SEQ_CST);
}

static unsigned rnd(uint64_t *s, unsigned n) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return (unsigned)(*s % n);
}

static int rnd_mode(uint64_t *s) {
  /* PR-heavy with writers, as a file system's metadata locks. */
  static const int m[] = {KEEL_LOCK_PR, KEEL_LOCK_PR, KEEL_LOCK_PR, KEEL_LOCK_CR,
                          KEEL_LOCK_CW, KEEL_LOCK_PW, KEEL_LOCK_EX, KEEL_LOCK_EX};
  return m[rnd(s, 8)];
}

static void async_ast(void *arg) {
  __atomic_store_n((int *)arg, 1, __ATOMIC_RELEASE);
}

static void *worker(void *arg) {
  uint64_t seed = 0x9e3779b97f4a7c15ull * ((uintptr_t)arg + 1);
  keel_lksb_t nl[NRES]; /* a held NL lock per resource: the by-handle path */
  memset(nl, 0, sizeof(nl));
  for (int r = 0; r < NRES; r++)
    if (keel_lock(ls, hot[r].name, strlen(hot[r].name), KEEL_LOCK_NL, KEEL_LOCK_VALBLK, &nl[r],
                  NULL, NULL, NULL) != 0)
      kt_fail(__FILE__, __LINE__, "NL lock failed");
  for (long i = 0; i < iters; i++) {
    int r = (int)rnd(&seed, NRES), mode = rnd_mode(&seed), rc;
    const char *name = hot[r].name;
    keel_lksb_t s = {0};
    switch (rnd(&seed, 6)) {
      case 0: /* blocking, by name */
        rc = keel_lock(ls, name, strlen(name), mode, KEEL_LOCK_VALBLK, &s, NULL, NULL, NULL);
        if (rc != 0) kt_fail(__FILE__, __LINE__, "keel_lock: %d", rc);
        section(r, mode, &s);
        count(0);
        rc = keel_unlock(&s, KEEL_LOCK_VALBLK);
        if (rc != 0) kt_fail(__FILE__, __LINE__, "keel_unlock: %d", rc);
        break;
      case 1: /* by handle: NL -> mode -> NL */
        rc = keel_lock_convert(&nl[r], mode, KEEL_LOCK_VALBLK);
        if (rc != 0) kt_fail(__FILE__, __LINE__, "convert up: %d", rc);
        section(r, mode, &nl[r]);
        count(0);
        rc = keel_lock_convert(&nl[r], KEEL_LOCK_NL, KEEL_LOCK_VALBLK);
        if (rc != 0) kt_fail(__FILE__, __LINE__, "convert down: %d", rc);
        break;
      case 2: /* NOQUEUE */
        rc = keel_lock(ls, name, strlen(name), mode, KEEL_LOCK_VALBLK | KEEL_LOCK_NOQUEUE, &s, NULL,
                       NULL, NULL);
        if (rc == KEEL_EAGAIN) {
          count(1);
          break;
        }
        section(r, mode, &s);
        count(0);
        keel_unlock(&s, KEEL_LOCK_VALBLK);
        break;
      case 3: /* short timeout */
        s.timeout_ms = 1;
        rc = keel_lock(ls, name, strlen(name), mode, KEEL_LOCK_VALBLK | KEEL_LOCK_TIMEOUT, &s, NULL,
                       NULL, NULL);
        if (rc == KEEL_ETIMEDOUT) {
          count(2);
          if (s.lock != NULL) kt_fail(__FILE__, __LINE__, "timed out but holds a lock");
          break;
        }
        if (rc != 0) kt_fail(__FILE__, __LINE__, "timed keel_lock: %d", rc);
        section(r, mode, &s);
        count(0);
        keel_unlock(&s, KEEL_LOCK_VALBLK);
        break;
      case 4: /* upgrade PR -> EX by handle: may close a conversion deadlock */
        rc = keel_lock_convert(&nl[r], KEEL_LOCK_PR, KEEL_LOCK_VALBLK);
        if (rc != 0) kt_fail(__FILE__, __LINE__, "convert PR: %d", rc);
        section(r, KEEL_LOCK_PR, &nl[r]);
        rc = keel_lock_convert(&nl[r], KEEL_LOCK_EX, KEEL_LOCK_VALBLK);
        if (rc == KEEL_EDEADLK) {
          count(3);
        } else if (rc != 0) {
          kt_fail(__FILE__, __LINE__, "convert EX: %d", rc);
        } else {
          section(r, KEEL_LOCK_EX, &nl[r]);
          count(0);
        }
        keel_lock_convert(&nl[r], KEEL_LOCK_NL, KEEL_LOCK_VALBLK);
        break;
      default: { /* asynchronous: sometimes cancelled, sometimes with a timeout */
        int done = 0;
        unsigned v = rnd(&seed, 3), flags = KEEL_LOCK_VALBLK;
        if (v == 1) {
          flags |= KEEL_LOCK_TIMEOUT; /* expired by the lockspace's timer thread */
          s.timeout_ms = 1;
        }
        rc = keel_lock(ls, name, strlen(name), mode, flags, &s, async_ast, NULL, &done);
        if (rc != 0) kt_fail(__FILE__, __LINE__, "async keel_lock: %d", rc);
        if (v == 0 && keel_unlock(&s, KEEL_LOCK_CANCEL) == 0) count(4);
        while (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) sched_yield();
        if (s.status == KEEL_ECANCELED || s.status == KEEL_ETIMEDOUT) {
          if (s.lock != NULL) kt_fail(__FILE__, __LINE__, "failed but holds a lock");
          if (s.status == KEEL_ETIMEDOUT) count(6);
          break;
        }
        section(r, mode, &s);
        count(5);
        keel_unlock(&s, KEEL_LOCK_VALBLK);
      }
    }
  }
  for (int r = 0; r < NRES; r++) keel_unlock(&nl[r], 0);
  return NULL;
}

static void hot_run(unsigned ls_flags, long default_iters) {
  int nt = (int)kt_env_int("KEEL_TEST_THREADS", 64);
  iters = kt_env_int("KEEL_TEST_ITERS", kt_scale(default_iters));
  keel_lockspace_config_t cfg = {.flags = ls_flags};
  ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL && nt <= 1024);
  memset(hot, 0, sizeof(hot));
  memset(stats, 0, sizeof(stats));
  for (int r = 0; r < NRES; r++) snprintf(hot[r].name, sizeof(hot[r].name), "hot-%d", r);
  pthread_t t[1024];
  for (long i = 0; i < nt; i++) pthread_create(&t[i], NULL, worker, (void *)i);
  for (int i = 0; i < nt; i++) pthread_join(t[i], NULL);
  printf("  %d threads x %ld: %ld grants, %ld EAGAIN, %ld timeouts, %ld deadlocks, %ld cancels, "
         "%ld async grants, %ld async timeouts\n",
         nt, iters, stats[0], stats[1], stats[2], stats[3], stats[4], stats[5], stats[6]);
  for (int r = 0; r < NRES; r++) {
    KT_EQ(hot[r].counter, hot[r].writes);
    keel_lksb_t s = {0};
    KT_EQ(keel_lock(ls, hot[r].name, strlen(hot[r].name), KEEL_LOCK_PR, KEEL_LOCK_VALBLK, &s, NULL,
                    NULL, NULL),
          0);
    uint64_t lvb;
    memcpy(&lvb, s.valblk, sizeof(lvb));
    KT_EQ(lvb, hot[r].counter);
    keel_res_t *res = s.lock->res;
    __keel_mutex_lock(&res->mu);
    KT_CHECK(__keel_res_validate(res));
    KT_EQ(res->granted[KEEL_LOCK_PR], 1);
    __keel_mutex_unlock(&res->mu);
    KT_EQ(keel_unlock(&s, 0), 0);
  }
  KT_CHECK(stats[0] > 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0); /* nothing left held */
}

static void hot_resources(void) {
  hot_run(0, 8000);
}

/* The same with callbacks on keel's sched: ASTs and BASTs run on its workers
 * while 64 threads wait for them. */
static void hot_resources_sched(void) {
  hot_run(KEEL_LOCKSPACE_SCHED, 2000);
}

/* Churn: many names, a cache of 8 resources and a thread shrinking all the
 * time, so resources are dropped and re-created while others look them up.
 * If a name ever had two live resources, two EX holders would meet in the
 * per-name counters (and the plain counter would lose updates). */
#define NCHURN 64
static hot_t churn[NCHURN];
static int churn_stop; /* atomic */

static void churn_section(int i, int mode) {
  hot_t *h = &churn[i];
  __atomic_fetch_add(&h->held[mode], 1, __ATOMIC_SEQ_CST);
  for (int m = 0; m < KEEL_LOCK_MODES; m++) {
    int n = __atomic_load_n(&h->held[m], __ATOMIC_SEQ_CST) - (m == mode);
    if (n > 0 && !kt_compat[m][mode])
      kt_fail(__FILE__, __LINE__, "%s: %s granted while %d hold %s", h->name,
              keel_lock_mode_name(mode), n, keel_lock_mode_name(m));
  }
  if (mode == KEEL_LOCK_EX) {
    h->counter++;
    __atomic_fetch_add(&h->writes, 1, __ATOMIC_RELAXED);
  }
  __atomic_fetch_sub(&h->held[mode], 1, __ATOMIC_SEQ_CST);
}

static void *churn_worker(void *arg) {
  uint64_t seed = 0x51afd7ed558ccd25ull * ((uintptr_t)arg + 1);
  for (long k = 0; k < iters; k++) {
    int i = (int)rnd(&seed, NCHURN), mode = rnd(&seed, 2) ? KEEL_LOCK_EX : KEEL_LOCK_PR;
    keel_lksb_t s = {0};
    int rc = keel_lock(ls, churn[i].name, strlen(churn[i].name), mode, 0, &s, NULL, NULL, NULL);
    if (rc != 0) kt_fail(__FILE__, __LINE__, "keel_lock: %d", rc);
    churn_section(i, mode);
    keel_unlock(&s, 0);
  }
  return NULL;
}

static void *shrinker(void *arg) {
  (void)arg;
  while (!__atomic_load_n(&churn_stop, __ATOMIC_ACQUIRE)) {
    keel_lockspace_shrink(ls, 1000);
    sched_yield();
  }
  return NULL;
}

static void churn_resources(void) {
  int nt = (int)kt_env_int("KEEL_TEST_THREADS", 64) / 4 + 1;
  iters = kt_env_int("KEEL_TEST_ITERS", kt_scale(8000));
  keel_lockspace_config_t cfg = {.cache_max = 8};
  ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL && nt <= 1024);
  memset(churn, 0, sizeof(churn));
  for (int i = 0; i < NCHURN; i++) snprintf(churn[i].name, sizeof(churn[i].name), "churn-%d", i);
  __atomic_store_n(&churn_stop, 0, __ATOMIC_RELAXED);
  pthread_t t[1024], sh;
  pthread_create(&sh, NULL, shrinker, NULL);
  for (long i = 0; i < nt; i++) pthread_create(&t[i], NULL, churn_worker, (void *)i);
  for (int i = 0; i < nt; i++) pthread_join(t[i], NULL);
  __atomic_store_n(&churn_stop, 1, __ATOMIC_RELEASE);
  pthread_join(sh, NULL);
  keel_table_stats_t st;
  keel_table_stats(ls->table, &st);
  printf("  %d threads x %ld on %d names, cache 8: %zu resources dropped\n", nt, iters, NCHURN,
         st.evicted);
  KT_CHECK(st.evicted > 0);
  for (int i = 0; i < NCHURN; i++) KT_EQ(churn[i].counter, churn[i].writes);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Timer churn: threads queue timed asynchronous requests (0-3 ms) on a few
 * names, so that timer passes, re-arms and disarms by the last unlock race
 * with one another. Once all is unlocked no entry is left and every resource
 * can be dropped: an entry or a reference lost or leaked in a race shows as
 * a count off here (or an abort in the table's reference checks). */
#define NTIMER 8

static void *timer_worker(void *arg) {
  uint64_t seed = 0x2545f4914f6cdd1dull * ((uintptr_t)arg + 1);
  for (long k = 0; k < iters; k++) {
    char name[16];
    int n = snprintf(name, sizeof(name), "tw-%u", rnd(&seed, NTIMER)), done = 0;
    keel_lksb_t s = {.timeout_ms = rnd(&seed, 4)};
    /* A quarter are cancelled instead (untimed: lock.h's note on cancels). */
    bool cancel = rnd(&seed, 4) == 0;
    int rc = keel_lock(ls, name, (size_t)n, KEEL_LOCK_EX, cancel ? 0 : KEEL_LOCK_TIMEOUT, &s,
                       async_ast, NULL, &done);
    if (rc != 0) kt_fail(__FILE__, __LINE__, "keel_lock: %d", rc);
    if (cancel && keel_unlock(&s, KEEL_LOCK_CANCEL) == 0) count(4);
    while (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) sched_yield();
    if (s.status == KEEL_ETIMEDOUT) count(2);
    if (s.status != 0) continue;
    count(0);
    if (rnd(&seed, 2)) sched_yield(); /* hold it a while: others queue */
    keel_unlock(&s, 0);
  }
  return NULL;
}

static void timer_churn(void) {
  int nt = (int)kt_env_int("KEEL_TEST_THREADS", 64) / 4 + 1;
  iters = kt_env_int("KEEL_TEST_ITERS", kt_scale(8000));
  ls = keel_lockspace_create(NULL);
  KT_REQUIRE(ls != NULL && nt <= 1024);
  memset(stats, 0, sizeof(stats));
  pthread_t t[1024];
  for (long i = 0; i < nt; i++) pthread_create(&t[i], NULL, timer_worker, (void *)i);
  for (int i = 0; i < nt; i++) pthread_join(t[i], NULL);
  printf("  %d threads x %ld on %d names: %ld grants, %ld timeouts, %ld cancels\n", nt, iters,
         NTIMER, stats[0], stats[2], stats[4]);
  KT_CHECK(stats[2] > 0);
  /* A pass in flight when the last lock went drops its entry when it ends. */
  for (int k = 0; k < 1000 && ls->timer != NULL; k++) {
    pthread_mutex_lock(&ls->timer->mu);
    size_t n = ls->timer->n;
    pthread_mutex_unlock(&ls->timer->mu);
    if (n == 0) break;
    usleep(1000);
  }
  if (ls->timer != NULL) KT_EQ(ls->timer->n, 0);
  size_t cached = keel_table_count(ls->table);
  for (int k = 0; k < 1000 && keel_lockspace_shrink(ls, NTIMER) < cached; k++) usleep(1000);
  KT_EQ(keel_table_count(ls->table), 0);
  keel_table_stats_t st;
  keel_table_stats(ls->table, &st);
  KT_EQ(st.removed_referenced, 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Non-forced releases racing callback chains on sched (keel's own threads,
 * the callers a release cannot hold back; from helper-74's review). Each
 * chain locks a resource, converts it, unlocks it and locks the next, from
 * its ASTs, over 37 names. While a pin is held every release must say
 * KEEL_EBUSY and refuse nothing; once the pin is dropped the releases go on
 * until one goes ahead, and then the chain still running (chain 0) has been
 * refused exactly once, and none saw an error. With FORCE, the chains end
 * by cancellation and are never refused a lock before it. A release that
 * ignored the requests racing its walk (a veto) failed here within 300
 * rounds ("convert refused" or a refused chain). */
#define NCHAIN 2

typedef struct chain {
  keel_lockspace_t *ls;
  keel_lksb_t lksb;
  unsigned n, seed;
  int idx;
  int phase;               /* 0: waiting for a new lock's grant, 1: for a conversion's */
  int refused, ended, bad; /* atomic */
  int *phase2;             /* atomic: 1 once the pin is dropped */
} chain_t;

static int force_mode;
static void chain_ast(void *arg);

static void chain_next(chain_t *c) {
  char name[48];
  int len = snprintf(name, sizeof name, "c%pr%u", (void *)c, c->n++ % 37);
  if ((rand_r(&c->seed) & 7) == 0)
    usleep(rand_r(&c->seed) % (__atomic_load_n(c->phase2, __ATOMIC_RELAXED) ? 300 : 30));
  else if ((rand_r(&c->seed) & 3) == 0)
    sched_yield();
  c->phase = 0;
  int rc = keel_lock(c->ls, name, (size_t)len, KEEL_LOCK_PR, 0, &c->lksb, chain_ast, NULL, c);
  if (rc == KEEL_ESHUTDOWN && force_mode) {
    __atomic_store_n(&c->ended, 3, __ATOMIC_SEQ_CST);
  } else if (rc == KEEL_ESHUTDOWN) {
    if (!__atomic_load_n(c->phase2, __ATOMIC_SEQ_CST))
      __atomic_fetch_add(&c->refused, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&c->ended, 1, __ATOMIC_SEQ_CST);
  } else if (rc != 0) {
    fprintf(stderr, "keel_lock rc %d\n", rc);
    __atomic_fetch_add(&c->bad, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&c->ended, 1, __ATOMIC_SEQ_CST);
  }
}

static void chain_ast(void *arg) {
  chain_t *c = arg;
  int st = __atomic_load_n(&c->lksb.status, __ATOMIC_SEQ_CST);
  if (st != 0 && force_mode && st == KEEL_ECANCELED) {
    __atomic_store_n(&c->ended, 3, __ATOMIC_SEQ_CST);
    return;
  }
  if (st != 0) {
    fprintf(stderr, "ast status %d\n", st);
    __atomic_fetch_add(&c->bad, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&c->ended, 1, __ATOMIC_SEQ_CST);
    return;
  }
  if (c->phase == 0) {
    c->phase = 1;
    int rc = keel_lock_convert(&c->lksb, KEEL_LOCK_EX, 0);
    if (rc == 0) return; /* its AST comes */
    if (rc != 0 && force_mode) {
      keel_unlock(&c->lksb, 0);
      __atomic_store_n(&c->ended, 3, __ATOMIC_SEQ_CST);
      return;
    }
    if (rc == KEEL_ESHUTDOWN) {
      /* Must not happen: a granted lock exists, so no non-forced release goes ahead. */
      fprintf(stderr, "convert refused\n");
      __atomic_fetch_add(&c->bad, 1, __ATOMIC_SEQ_CST);
    } else {
      fprintf(stderr, "convert rc %d\n", rc);
      __atomic_fetch_add(&c->bad, 1, __ATOMIC_SEQ_CST);
    }
  }
  if (keel_unlock(&c->lksb, 0) != 0 && !force_mode) {
    fprintf(stderr, "unlock failed\n");
    __atomic_fetch_add(&c->bad, 1, __ATOMIC_SEQ_CST);
  }
  if (c->idx != 0 && __atomic_load_n(c->phase2, __ATOMIC_SEQ_CST)) {
    __atomic_fetch_add(&c->refused, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&c->ended, 2, __ATOMIC_SEQ_CST); /* stopped on its own */
    return;
  }
  chain_next(c);
}

static void release_races_callbacks_mode(int force, long rounds) {
  force_mode = force;
  long busy_tries = kt_sanitized() ? 50 : 200;
  unsigned long succ_after = 0, total_busy = 0;
  for (long r = 0; r < rounds; r++) {
    keel_lockspace_config_t cfg = {.flags = KEEL_LOCKSPACE_SCHED};
    keel_lockspace_t *ls = keel_lockspace_create(&cfg);
    KT_REQUIRE(ls != NULL);
    int phase2 = 0;
    keel_lksb_t pin = {0};
    KT_EQ(keel_lock(ls, "pin", 3, KEEL_LOCK_EX, 0, &pin, NULL, NULL, NULL), 0);
    chain_t c[NCHAIN];
    memset(c, 0, sizeof c);
    for (int i = 0; i < NCHAIN; i++) {
      c[i].ls = ls;
      c[i].seed = (unsigned)(r * 31 + i);
      c[i].phase2 = &phase2;
      c[i].n = (unsigned)i * 5;
      c[i].idx = i;
      KT_EQ(keel_lock(ls, i ? "r0" : "r1", 2, KEEL_LOCK_PR, 0, &c[i].lksb, chain_ast, NULL, &c[i]),
            0);
    }
    for (long i = 0; i < busy_tries; i++) KT_EQ(keel_lockspace_release(ls, 0), KEEL_EBUSY);
    if (force_mode) {
      KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
      for (int i = 0; i < NCHAIN; i++) {
        KT_CHECK(__atomic_load_n(&c[i].ended, __ATOMIC_SEQ_CST) != 0);
        KT_EQ(__atomic_load_n(&c[i].refused, __ATOMIC_SEQ_CST), 0);
        KT_EQ(__atomic_load_n(&c[i].bad, __ATOMIC_SEQ_CST), 0);
      }
      continue;
    }
    __atomic_store_n(&phase2, 1, __ATOMIC_SEQ_CST);
    KT_EQ(keel_unlock(&pin, 0), 0);
    int rc;
    unsigned long tries = 0;
    while ((rc = keel_lockspace_release(ls, 0)) == KEEL_EBUSY) {
      tries++;
      if ((tries & 63) == 0) sched_yield();
    }
    KT_EQ(rc, 0);
    total_busy += tries;
    succ_after++;
    /* Drained: every chain has ended, refused exactly once, after the pin. */
    for (int i = 0; i < NCHAIN; i++) {
      KT_EQ(__atomic_load_n(&c[i].ended, __ATOMIC_SEQ_CST), i ? 2 : 1);
      KT_EQ(__atomic_load_n(&c[i].refused, __ATOMIC_SEQ_CST), 0);
      KT_EQ(__atomic_load_n(&c[i].bad, __ATOMIC_SEQ_CST), 0);
    }
    KT_EQ(keel_lockspace_release(ls, 0), KEEL_ESHUTDOWN); /* graveyard check */
  }
  if (!force)
    printf("  %lu rounds: releases that found the lockspace busy before one went ahead: %lu\n",
           succ_after, total_busy);
}

static void release_races_callbacks(void) {
  long rounds = kt_env_int("KEEL_TEST_RELEASE_ROUNDS", kt_sanitized() ? 60 : 300);
  release_races_callbacks_mode(0, rounds);
  release_races_callbacks_mode(1, rounds / 3);
}

KT_MAIN(KT_CASE(release_races_callbacks), KT_CASE(hot_resources), KT_CASE(hot_resources_sched),
        KT_CASE(churn_resources), KT_CASE(timer_churn))
