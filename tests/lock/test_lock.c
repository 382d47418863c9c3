/* Unit tests of the lock manager and keel_mutex: the compatibility matrix on
 * real locks, queue order, conversion deadlock, value blocks, timeouts,
 * blocking waits, BASTs, the resource cache, and the mutex. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/options.h"
#include "harness.h"
#include "lock/lockspace.h"
#include "lock_test_util.h"

#define NAME(s) (s), strlen(s)

typedef struct rec {
  int asts, basts, last_status, last_bast;
  int order[16];
  int norder;
  int id;
  int *log; /* shared order log */
  int *nlog;
} rec_t;

/* Atomic counts: a callback may run on any thread (the one that granted). */
static void rec_ast(void *arg) {
  rec_t *r = arg;
  __atomic_fetch_add(&r->asts, 1, __ATOMIC_SEQ_CST);
  if (r->log) r->log[(*r->nlog)++] = r->id;
}
static void rec_bast(void *arg, int mode) {
  rec_t *r = arg;
  __atomic_store_n(&r->last_bast, mode, __ATOMIC_SEQ_CST);
  __atomic_fetch_add(&r->basts, 1, __ATOMIC_SEQ_CST);
}

/* Records every BAST's mode in r->order. */
static void log_bast(void *arg, int mode) {
  rec_t *r = arg;
  int i = __atomic_fetch_add(&r->norder, 1, __ATOMIC_SEQ_CST);
  if (i < 16) r->order[i] = mode;
}

static keel_lockspace_t *new_ls(void) {
  keel_lockspace_t *ls = keel_lockspace_create(NULL);
  KT_REQUIRE(ls != NULL);
  return ls;
}

/* A holder hears of a requested mode only if it is above every mode it was
 * told of since its last grant (the DLM's highbast rule): with PR, EX, PR
 * queued behind its EX it gets BASTs for PR and EX, not a second PR (it
 * got PR, EX, PR when only the last mode sent was remembered). */
static void bast_highest_only(void) {
  keel_lockspace_t *ls = new_ls();
  rec_t h = {0}, w[3] = {{0}};
  keel_lksb_t hx = {0}, wx[3] = {{0}};
  KT_EQ(keel_lock(ls, NAME("hb"), KEEL_LOCK_EX, 0, &hx, NULL, log_bast, &h), 0);
  static const int modes[3] = {KEEL_LOCK_PR, KEEL_LOCK_EX, KEEL_LOCK_PR};
  for (int i = 0; i < 3; i++)
    KT_EQ(keel_lock(ls, NAME("hb"), modes[i], 0, &wx[i], rec_ast, NULL, &w[i]), 0);
  KT_EQ(h.norder, 2);
  KT_EQ(h.order[0], KEEL_LOCK_PR);
  KT_EQ(h.order[1], KEEL_LOCK_EX);
  KT_EQ(keel_unlock(&hx, 0), 0); /* PR granted; EX waits behind it */
  for (int i = 0; i < 3; i++) {
    if (w[i].asts == 1) KT_EQ(keel_unlock(&wx[i], 0), 0);
  }
  for (int i = 0; i < 3; i++) {
    if (wx[i].lock != NULL) KT_EQ(keel_unlock(&wx[i], 0), 0);
  }
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Every pair of modes, on real locks: the second is granted at once iff the
 * spec's matrix says the two are compatible. */
static void compat_matrix(void) {
  keel_lockspace_t *ls = new_ls();
  for (int a = 0; a < KEEL_LOCK_MODES; a++)
    for (int b = 0; b < KEEL_LOCK_MODES; b++) {
      KT_EQ(keel_lock_compatible(a, b), kt_compat[a][b]);
      keel_lksb_t x = {0}, y = {0};
      KT_EQ(keel_lock(ls, NAME("m"), a, 0, &x, NULL, NULL, NULL), 0);
      int rc = keel_lock(ls, NAME("m"), b, KEEL_LOCK_NOQUEUE, &y, NULL, NULL, NULL);
      KT_EQ(rc, kt_compat[a][b] ? 0 : KEEL_EAGAIN);
      if (rc == 0) KT_EQ(keel_unlock(&y, 0), 0);
      KT_CHECK(y.lock == NULL);
      KT_EQ(keel_unlock(&x, 0), 0);
    }
  KT_CHECK(!keel_lock_compatible(-1, 0) && !keel_lock_compatible(0, 6));
  KT_STREQ(keel_lock_mode_name(KEEL_LOCK_PW), "PW");
  KT_STREQ(keel_lock_mode_name(9), "??");
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* A waiting EX stops later PRs that are compatible with the granted PR
 * (no barging); release grants in FIFO order. */
static void fifo_no_barging(void) {
  keel_lockspace_t *ls = new_ls();
  int log[16], nlog = 0;
  rec_t r[4] = {{.id = 0}, {.id = 1}, {.id = 2}, {.id = 3}};
  keel_lksb_t s[4] = {{0}};
  for (int i = 0; i < 4; i++) r[i].log = log, r[i].nlog = &nlog;
  KT_EQ(keel_lock(ls, NAME("f"), KEEL_LOCK_PR, 0, &s[0], rec_ast, rec_bast, &r[0]), 0);
  KT_EQ(keel_lock(ls, NAME("f"), KEEL_LOCK_EX, 0, &s[1], rec_ast, rec_bast, &r[1]), 0);
  KT_EQ(keel_lock(ls, NAME("f"), KEEL_LOCK_PR, 0, &s[2], rec_ast, rec_bast, &r[2]), 0);
  KT_EQ(keel_lock(ls, NAME("f"), KEEL_LOCK_CR, KEEL_LOCK_NOQUEUE, &s[3], rec_ast, NULL, &r[3]),
        KEEL_EAGAIN);
  KT_EQ(nlog, 1); /* only the first PR */
  KT_EQ(r[0].basts, 1);
  KT_EQ(r[0].last_bast, KEEL_LOCK_EX);
  KT_EQ(keel_unlock(&s[0], 0), 0);
  KT_EQ(nlog, 2);
  KT_EQ(log[1], 1);     /* EX next */
  KT_EQ(r[1].basts, 1); /* told that the PR behind it waits */
  KT_EQ(keel_unlock(&s[1], 0), 0);
  KT_EQ(nlog, 3);
  KT_EQ(log[2], 2);
  KT_EQ(keel_unlock(&s[2], 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Two PR holders both converting to EX: the second closes the cycle and gets
 * KEEL_EDEADLK, keeping PR; releasing it lets the first through. A third
 * lock converting from NL (which blocks nobody) just waits. */
static void conversion_deadlock(void) {
  keel_lockspace_t *ls = new_ls();
  rec_t ra = {0}, rb = {0}, rc_ = {0};
  keel_lksb_t a = {0}, b = {0}, c = {0};
  KT_EQ(keel_lock(ls, NAME("d"), KEEL_LOCK_PR, 0, &a, rec_ast, NULL, &ra), 0);
  KT_EQ(keel_lock(ls, NAME("d"), KEEL_LOCK_PR, 0, &b, rec_ast, NULL, &rb), 0);
  KT_EQ(keel_lock(ls, NAME("d"), KEEL_LOCK_NL, 0, &c, rec_ast, NULL, &rc_), 0);
  KT_EQ(keel_lock_convert(&a, KEEL_LOCK_EX, 0), 0);
  KT_EQ(ra.asts, 1);                                /* queued: no AST yet */
  KT_EQ(keel_lock_convert(&c, KEEL_LOCK_EX, 0), 0); /* NL blocks nobody: waits */
  KT_EQ(keel_lock_convert(&b, KEEL_LOCK_EX, 0), KEEL_EDEADLK);
  KT_EQ(rb.asts, 1); /* no AST for a failure returned at once */
  KT_EQ(b.lock->gr, KEEL_LOCK_PR);
  KT_EQ(keel_unlock(&a, 0), KEEL_EBUSY); /* converting */
  KT_EQ(keel_unlock(&b, 0), 0);
  KT_EQ(ra.asts, 2);
  KT_EQ(a.status, 0);
  KT_EQ(a.lock->gr, KEEL_LOCK_EX);
  KT_EQ(rc_.asts, 1);
  KT_EQ(keel_unlock(&a, 0), 0);
  KT_EQ(rc_.asts, 2);
  KT_EQ(keel_unlock(&c, 0), 0);
  /* Three-way: PR, PR, PR; each converts to PW. The second closes a cycle
   * with the first. */
  keel_lksb_t s[3] = {{0}};
  for (int i = 0; i < 3; i++)
    KT_EQ(keel_lock(ls, NAME("d3"), KEEL_LOCK_PR, 0, &s[i], rec_ast, NULL, &ra), 0);
  KT_EQ(keel_lock_convert(&s[0], KEEL_LOCK_PW, 0), 0);
  KT_EQ(keel_lock_convert(&s[1], KEEL_LOCK_PW, 0), KEEL_EDEADLK);
  KT_EQ(keel_lock_convert(&s[2], KEEL_LOCK_NL, 0), 0); /* a down-conversion never deadlocks */
  KT_EQ(keel_unlock(&s[1], 0), 0);
  KT_EQ(s[0].lock->gr, KEEL_LOCK_PW);
  for (int i = 0; i < 3; i += 2) KT_EQ(keel_unlock(&s[i], 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* QUECVT: a conversion that could be granted waits behind pending ones. */
static void quecvt(void) {
  keel_lockspace_t *ls = new_ls();
  rec_t r = {0};
  keel_lksb_t a = {0}, b = {0}, c = {0};
  KT_EQ(keel_lock(ls, NAME("q"), KEEL_LOCK_CR, 0, &a, rec_ast, NULL, &r), 0);
  KT_EQ(keel_lock(ls, NAME("q"), KEEL_LOCK_PR, 0, &b, rec_ast, NULL, &r), 0);
  KT_EQ(keel_lock(ls, NAME("q"), KEEL_LOCK_NL, 0, &c, rec_ast, NULL, &r), 0);
  KT_EQ(keel_lock_convert(&a, KEEL_LOCK_PW, 0), 0); /* blocked by PR: waits */
  KT_EQ(a.lock->queue, KEEL_Q_CONVERT);
  KT_EQ(keel_lock_convert(&c, KEEL_LOCK_CR, KEEL_LOCK_QUECVT), 0);
  KT_EQ(c.lock->queue, KEEL_Q_CONVERT);             /* queued behind a */
  KT_EQ(keel_lock_convert(&b, KEEL_LOCK_NL, 0), 0); /* unblocks a, then c */
  KT_EQ(a.lock->gr, KEEL_LOCK_PW);
  KT_EQ(c.lock->gr, KEEL_LOCK_CR);
  KT_EQ(keel_unlock(&a, 0), 0);
  KT_EQ(keel_lock_convert(&c, KEEL_LOCK_PR, KEEL_LOCK_QUECVT), 0); /* nothing pending: at once */
  KT_EQ(c.lock->gr, KEEL_LOCK_PR);
  KT_EQ(keel_unlock(&b, 0), 0);
  KT_EQ(keel_unlock(&c, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* QUECVT on a conversion that is not an up-conversion: KEEL_EINVAL, as in the
 * DLM, and nothing changes. (Queued, EX -> PR behind a CR request that EX
 * blocks was reported as a deadlock that the demotion would have resolved.) */
static void quecvt_down(void) {
  keel_lockspace_t *ls = new_ls();
  rec_t r = {0};
  keel_lksb_t a = {0}, b = {0};
  KT_EQ(keel_lock(ls, NAME("qd"), KEEL_LOCK_EX, 0, &a, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("qd"), KEEL_LOCK_NL, 0, &b, rec_ast, NULL, &r), 0);
  KT_EQ(keel_lock_convert(&b, KEEL_LOCK_CR, 0), 0); /* waits behind EX */
  KT_EQ(b.lock->queue, KEEL_Q_CONVERT);
  KT_EQ(keel_lock_convert(&a, KEEL_LOCK_PR, KEEL_LOCK_QUECVT), KEEL_EINVAL);
  KT_EQ(keel_lock_convert(&a, KEEL_LOCK_EX, KEEL_LOCK_QUECVT), KEEL_EINVAL); /* same mode */
  KT_EQ(a.lock->gr, KEEL_LOCK_EX);
  KT_EQ(a.lock->queue, KEEL_Q_GRANT);
  KT_EQ(keel_lock_convert(&a, KEEL_LOCK_PR, 0), 0); /* without it: granted, b follows */
  KT_EQ(a.lock->gr, KEEL_LOCK_PR);
  KT_EQ(b.lock->gr, KEEL_LOCK_CR);
  KT_EQ(keel_unlock(&a, 0), 0);
  KT_EQ(keel_unlock(&b, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* A thread's blocking request on a lockspace and its outcome. */
typedef struct waiter {
  keel_lockspace_t *ls;
  keel_lksb_t lksb;
  int rc;
} waiter_t;

static void *blocked_lock(void *arg) {
  waiter_t *b = arg;
  b->rc = keel_lock(b->ls, NAME("blk"), KEEL_LOCK_EX, 0, &b->lksb, NULL, NULL, NULL);
  return NULL;
}

/* A blocked keel_lock (no AST) cancelled from another thread: the blocked
 * call returns KEEL_ECANCELED and owns the cleanup (the cancel used to free
 * the request too: a double free). */
static void cancel_blocked_from_thread(void) {
  for (int it = 0; it < 50; it++) {
    keel_lockspace_t *ls = new_ls();
    keel_lksb_t h = {0};
    KT_EQ(keel_lock(ls, NAME("blk"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
    waiter_t b = {.ls = ls, .rc = 1};
    pthread_t t;
    KT_EQ(pthread_create(&t, NULL, blocked_lock, &b), 0);
    int rc;
    /* ENOENT until the request is published; from then on it waits on h. */
    while ((rc = keel_unlock(&b.lksb, KEEL_LOCK_CANCEL)) == KEEL_ENOENT) usleep(it % 2 ? 200 : 10);
    KT_EQ(rc, 0);
    KT_EQ(pthread_join(t, NULL), 0);
    KT_EQ(b.rc, KEEL_ECANCELED);
    KT_EQ(__atomic_load_n(&b.lksb.lock, __ATOMIC_ACQUIRE), NULL);
    KT_EQ(keel_unlock(&b.lksb, 0), KEEL_ENOENT);
    KT_EQ(keel_unlock(&h, 0), 0);
    KT_EQ(keel_lockspace_release(ls, 0), 0);
  }
}

/* A forced release right after an unlock granted a blocked caller, which may
 * not have left its wait yet: release used to free that lock under it. */
static void force_release_after_grant(void) {
  for (int it = 0; it < 50; it++) {
    keel_lockspace_t *ls = new_ls();
    keel_lksb_t h = {0};
    KT_EQ(keel_lock(ls, NAME("blk"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
    waiter_t b = {.ls = ls, .rc = 1};
    pthread_t t;
    KT_EQ(pthread_create(&t, NULL, blocked_lock, &b), 0);
    /* Queued once it counts as a sleeper; then sometimes asleep, sometimes not. */
    while (__atomic_load_n(&ls->sleepers, __ATOMIC_ACQUIRE) == 0) usleep(10);
    if (it % 2) usleep(500);
    KT_EQ(keel_unlock(&h, 0), 0); /* grants the blocked caller and wakes it */
    KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
    KT_EQ(pthread_join(t, NULL), 0);
    /* Granted (its status read before the release overwrote it) or not. */
    KT_CHECK(b.rc == 0 || b.rc == KEEL_ECANCELED);
  }
}

/* Value blocks: written by PW/EX on unlock and on down-conversion, read on
 * every other grant, ignored without VALBLK. */
static void value_blocks(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t w = {0}, r = {0};
  KT_EQ(keel_lock(ls, NAME("v"), KEEL_LOCK_EX, KEEL_LOCK_VALBLK, &w, NULL, NULL, NULL), 0);
  for (int i = 0; i < KEEL_LOCK_LVB_LEN; i++) KT_EQ(w.valblk[i], 0); /* fresh: zeros */
  memcpy(w.valblk, "generation-1", 13);
  KT_EQ(keel_unlock(&w, KEEL_LOCK_VALBLK), 0);
  KT_EQ(keel_lock(ls, NAME("v"), KEEL_LOCK_PR, KEEL_LOCK_VALBLK, &r, NULL, NULL, NULL), 0);
  KT_STREQ((char *)r.valblk, "generation-1");
  memcpy(r.valblk, "reader-scribble", 16); /* a PR holder cannot write it */
  KT_EQ(keel_unlock(&r, KEEL_LOCK_VALBLK), 0);
  /* Down-conversion EX -> NL writes; up-conversion NL -> PR reads. */
  KT_EQ(keel_lock(ls, NAME("v"), KEEL_LOCK_EX, KEEL_LOCK_VALBLK, &w, NULL, NULL, NULL), 0);
  KT_STREQ((char *)w.valblk, "generation-1");
  memcpy(w.valblk, "generation-2", 13);
  KT_EQ(keel_lock_convert(&w, KEEL_LOCK_NL, KEEL_LOCK_VALBLK), 0);
  memset(w.valblk, 0, sizeof(w.valblk));
  KT_EQ(keel_lock_convert(&w, KEEL_LOCK_PR, KEEL_LOCK_VALBLK), 0);
  KT_STREQ((char *)w.valblk, "generation-2");
  /* Without VALBLK nothing moves. */
  memcpy(w.valblk, "untouched", 10);
  KT_EQ(keel_lock_convert(&w, KEEL_LOCK_EX, 0), 0);
  KT_STREQ((char *)w.valblk, "untouched");
  KT_EQ(keel_unlock(&w, 0), 0);
  KT_EQ(keel_lock(ls, NAME("v"), KEEL_LOCK_CR, KEEL_LOCK_VALBLK, &r, NULL, NULL, NULL), 0);
  KT_STREQ((char *)r.valblk, "generation-2");
  /* A waiter granted later reads the block its predecessor wrote. */
  keel_lksb_t x = {0};
  rec_t rx = {0};
  KT_EQ(keel_lock(ls, NAME("v"), KEEL_LOCK_EX, KEEL_LOCK_VALBLK, &x, rec_ast, NULL, &rx), 0);
  KT_EQ(rx.asts, 0);
  KT_EQ(keel_unlock(&r, 0), 0);
  KT_EQ(rx.asts, 1);
  KT_STREQ((char *)x.valblk, "generation-2");
  /* A conversion of an EX lock to EX writes, as in the DLM (it read, and
   * the holder's new value was lost); so does PW to PW. PW to EX reads. */
  memcpy(x.valblk, "generation-3", 13);
  KT_EQ(keel_lock_convert(&x, KEEL_LOCK_EX, KEEL_LOCK_VALBLK), 0);
  KT_STREQ((char *)x.valblk, "generation-3");
  KT_EQ(keel_lock_convert(&x, KEEL_LOCK_PW, 0), 0);
  memcpy(x.valblk, "generation-4", 13);
  KT_EQ(keel_lock_convert(&x, KEEL_LOCK_PW, KEEL_LOCK_VALBLK), 0);
  memset(x.valblk, 0, sizeof(x.valblk));
  KT_EQ(keel_lock_convert(&x, KEEL_LOCK_EX, KEEL_LOCK_VALBLK), 0);
  KT_STREQ((char *)x.valblk, "generation-4");
  KT_EQ(keel_unlock(&x, 0), 0);
  KT_EQ(keel_lock(ls, NAME("v"), KEEL_LOCK_CR, KEEL_LOCK_VALBLK, &r, NULL, NULL, NULL), 0);
  KT_STREQ((char *)r.valblk, "generation-4");
  KT_EQ(keel_unlock(&r, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

static uint64_t now_ms(void) {
  return (uint64_t)(kt_now() * 1000);
}

/* Blocking requests and conversions that time out: KEEL_ETIMEDOUT after the
 * timeout, the new request gone, the conversion back at its granted mode,
 * and the queues unblocked for those behind. */
static void timeouts_blocking(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0}, w = {0}, n = {0};
  KT_EQ(keel_lock(ls, NAME("t"), KEEL_LOCK_PR, 0, &h, NULL, NULL, NULL), 0);
  w.timeout_ms = 50;
  uint64_t t0 = now_ms();
  KT_EQ(keel_lock(ls, NAME("t"), KEEL_LOCK_EX, KEEL_LOCK_TIMEOUT, &w, NULL, NULL, NULL),
        KEEL_ETIMEDOUT);
  KT_CHECK(now_ms() - t0 >= 49);
  KT_CHECK(w.lock == NULL);
  KT_EQ(w.status, KEEL_ETIMEDOUT);
  KT_EQ(keel_lock(ls, NAME("t"), KEEL_LOCK_NL, 0, &n, NULL, NULL, NULL), 0);
  n.timeout_ms = 20;
  KT_EQ(keel_lock_convert(&n, KEEL_LOCK_EX, KEEL_LOCK_TIMEOUT), KEEL_ETIMEDOUT);
  KT_EQ(n.lock->gr, KEEL_LOCK_NL);
  KT_EQ(n.lock->queue, KEEL_Q_GRANT);
  /* Granted in time: no timeout. */
  n.timeout_ms = 10000;
  KT_EQ(keel_lock_convert(&n, KEEL_LOCK_CR, KEEL_LOCK_TIMEOUT), 0);
  KT_EQ(keel_unlock(&n, 0), 0);
  KT_EQ(keel_unlock(&h, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

typedef struct flag {
  int done; /* atomic */
  int status;
} flag_t;
static void flag_ast(void *arg) {
  flag_t *f = arg;
  __atomic_store_n(&f->done, 1, __ATOMIC_RELEASE);
}
static void wait_flag(flag_t *f) {
  while (!__atomic_load_n(&f->done, __ATOMIC_ACQUIRE)) usleep(1000);
}

/* Asynchronous requests time out on the lockspace's timer thread. */
static void timeouts_async(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0}, w = {0}, c = {0};
  flag_t fw = {0}, fc = {0};
  KT_EQ(keel_lock(ls, NAME("ta"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("ta"), KEEL_LOCK_NL, 0, &c, flag_ast, NULL, &fc), 0);
  wait_flag(&fc);
  fc.done = 0;
  w.timeout_ms = 30;
  c.timeout_ms = 60;
  uint64_t t0 = now_ms();
  KT_EQ(keel_lock(ls, NAME("ta"), KEEL_LOCK_PR, KEEL_LOCK_TIMEOUT, &w, flag_ast, NULL, &fw), 0);
  KT_EQ(keel_lock_convert(&c, KEEL_LOCK_EX, KEEL_LOCK_TIMEOUT), 0);
  wait_flag(&fw);
  KT_CHECK(now_ms() - t0 >= 29);
  KT_EQ(w.status, KEEL_ETIMEDOUT);
  KT_CHECK(w.lock == NULL);
  wait_flag(&fc);
  KT_CHECK(now_ms() - t0 >= 59);
  KT_EQ(c.status, KEEL_ETIMEDOUT);
  KT_EQ(c.lock->gr, KEEL_LOCK_NL);
  /* One that is granted before its deadline is not touched by the timer. */
  fw.done = 0;
  w.timeout_ms = 20;
  KT_EQ(keel_lock(ls, NAME("ta"), KEEL_LOCK_CR, KEEL_LOCK_TIMEOUT, &w, flag_ast, NULL, &fw), 0);
  KT_EQ(keel_unlock(&h, 0), 0);
  wait_flag(&fw);
  KT_EQ(w.status, 0);
  usleep(40000);
  KT_EQ(w.lock->gr, KEEL_LOCK_CR);
  KT_EQ(keel_unlock(&w, 0), 0);
  KT_EQ(keel_unlock(&c, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Armed timer entries, read under the timer's mutex (0 before it starts). */
static size_t timer_entries(keel_lockspace_t *ls) {
  keel_ls_timer_t *t = __atomic_load_n(&ls->timer, __ATOMIC_ACQUIRE);
  if (t == NULL) return 0;
  pthread_mutex_lock(&t->mu);
  size_t n = t->n;
  pthread_mutex_unlock(&t->mu);
  return n;
}

/* Bug: a timed asynchronous request that queued left a timer entry holding a
 * reference on its resource until its deadline, even once granted and
 * unlocked: 10,000 rounds of "hold EX, queue EX with a 1-hour timeout, unlock
 * both" left 10,000 entries and a resource that shrink could not drop (and
 * 16M of them overflowed the table's reference count). Now a resource has at
 * most one entry, and it goes with the resource's last lock. */
static void timer_entry_goes_with_last_lock(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0}, w = {.timeout_ms = 3600 * 1000}, n = {0};
  flag_t f = {0};
  size_t most = 0;
  for (int i = 0; i < 10000; i++) {
    KT_EQ(keel_lock(ls, NAME("tg"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
    KT_EQ(keel_lock(ls, NAME("tg"), KEEL_LOCK_EX, KEEL_LOCK_TIMEOUT, &w, flag_ast, NULL, &f), 0);
    KT_EQ(w.lock->queue, KEEL_Q_WAIT);
    size_t e = timer_entries(ls);
    if (e > most) most = e;
    KT_EQ(keel_unlock(&h, 0), 0); /* grants w; its AST runs here */
    KT_EQ(w.status, 0);
    KT_EQ(keel_unlock(&w, 0), 0);
  }
  KT_EQ(most, 1);
  KT_EQ(timer_entries(ls), 0);
  KT_EQ(keel_table_count(ls->table), 1);
  KT_EQ(keel_lockspace_shrink(ls, 10), 1); /* unused, unpinned */
  KT_EQ(keel_table_count(ls->table), 0);

  /* With a lock held all along, the same rounds (new requests, conversions,
   * cancels) share one entry; it goes with the last lock. */
  KT_EQ(keel_lock(ls, NAME("tg"), KEEL_LOCK_NL, 0, &n, NULL, NULL, NULL), 0);
  keel_lksb_t c = {.timeout_ms = 3600 * 1000};
  KT_EQ(keel_lock(ls, NAME("tg"), KEEL_LOCK_NL, 0, &c, flag_ast, NULL, &f), 0);
  for (int i = 0; i < 3000; i++) {
    KT_EQ(keel_lock(ls, NAME("tg"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
    switch (i % 3) {
      case 0: /* a new request, granted */
        KT_EQ(keel_lock(ls, NAME("tg"), KEEL_LOCK_PR, KEEL_LOCK_TIMEOUT, &w, flag_ast, NULL, &f),
              0);
        KT_EQ(keel_unlock(&h, 0), 0);
        KT_EQ(keel_unlock(&w, 0), 0);
        break;
      case 1: /* a new request, cancelled */
        KT_EQ(keel_lock(ls, NAME("tg"), KEEL_LOCK_PR, KEEL_LOCK_TIMEOUT, &w, flag_ast, NULL, &f),
              0);
        KT_EQ(keel_unlock(&w, KEEL_LOCK_CANCEL), 0);
        KT_EQ(w.status, KEEL_ECANCELED);
        KT_EQ(keel_unlock(&h, 0), 0);
        break;
      default: /* a conversion, granted, and converted back */
        KT_EQ(keel_lock_convert(&c, KEEL_LOCK_PR, KEEL_LOCK_TIMEOUT), 0);
        KT_EQ(c.lock->queue, KEEL_Q_CONVERT);
        KT_EQ(keel_unlock(&h, 0), 0);
        KT_EQ(c.lock->gr, KEEL_LOCK_PR);
        KT_EQ(keel_lock_convert(&c, KEEL_LOCK_NL, 0), 0);
    }
    KT_CHECK(timer_entries(ls) <= 1);
  }
  KT_EQ(timer_entries(ls), 1); /* nothing waits, but locks are held: it stays until due */
  KT_EQ(keel_unlock(&c, 0), 0);
  KT_EQ(keel_unlock(&n, 0), 0);
  KT_EQ(timer_entries(ls), 0);
  KT_EQ(keel_lockspace_shrink(ls, 10), 1);
  keel_table_stats_t st;
  keel_table_stats(ls->table, &st);
  KT_EQ(st.removed_referenced, 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* One entry per resource still times out every request: a later, shorter
 * timeout brings the entry forward, and each pass re-arms for the next
 * deadline pending. */
static void timer_rearms_for_next_deadline(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0}, w[3] = {{.timeout_ms = 3600 * 1000}, {.timeout_ms = 40}, {.timeout_ms = 80}};
  flag_t f[3] = {{0}};
  KT_EQ(keel_lock(ls, NAME("tr"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
  uint64_t t0 = now_ms();
  for (int i = 0; i < 3; i++)
    KT_EQ(keel_lock(ls, NAME("tr"), KEEL_LOCK_PR, KEEL_LOCK_TIMEOUT, &w[i], flag_ast, NULL, &f[i]),
          0);
  KT_EQ(timer_entries(ls), 1);
  wait_flag(&f[1]);
  KT_CHECK(now_ms() - t0 >= 39);
  KT_EQ(w[1].status, KEEL_ETIMEDOUT);
  KT_CHECK(w[1].lock == NULL);
  wait_flag(&f[2]);
  KT_CHECK(now_ms() - t0 >= 79);
  KT_EQ(w[2].status, KEEL_ETIMEDOUT);
  KT_EQ(__atomic_load_n(&f[0].done, __ATOMIC_ACQUIRE), 0); /* the 1-hour one still waits */
  KT_EQ(w[0].lock->queue, KEEL_Q_WAIT);
  KT_EQ(timer_entries(ls), 1);
  KT_EQ(keel_unlock(&w[0], KEEL_LOCK_CANCEL), 0);
  KT_EQ(keel_unlock(&h, 0), 0);
  KT_EQ(timer_entries(ls), 0);
  KT_EQ(keel_lockspace_shrink(ls, 10), 1);
  /* A forced release with armed resources: their requests are cancelled and
   * the entries' references dropped (ASan reports a leak otherwise). */
  KT_EQ(keel_lock(ls, NAME("tr"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("tr2"), KEEL_LOCK_EX, 0, &w[1], NULL, NULL, NULL), 0);
  f[0].done = f[2].done = 0;
  w[2].timeout_ms = 3600 * 1000;
  KT_EQ(keel_lock(ls, NAME("tr"), KEEL_LOCK_PR, KEEL_LOCK_TIMEOUT, &w[0], flag_ast, NULL, &f[0]),
        0);
  KT_EQ(keel_lock(ls, NAME("tr2"), KEEL_LOCK_PR, KEEL_LOCK_TIMEOUT, &w[2], flag_ast, NULL, &f[2]),
        0);
  KT_EQ(timer_entries(ls), 2);
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
  KT_EQ(w[0].status, KEEL_ECANCELED);
  KT_EQ(w[2].status, KEEL_ECANCELED);
}

/* Checks the timer's heap order and its index both ways, under its mutex. */
static bool timer_consistent(keel_lockspace_t *ls) {
  keel_ls_timer_t *t = ls->timer;
  bool ok = true;
  pthread_mutex_lock(&t->mu);
  for (size_t i = 0; i < t->n; i++) {
    if (i > 0 && t->heap[(i - 1) / 2].deadline_ns > t->heap[i].deadline_ns) ok = false;
    if (t->heap[i].slot >= t->index_cap || t->index[t->heap[i].slot] != i + 1) ok = false;
    for (size_t j = 0; j < i; j++) ok &= t->heap[j].res != t->heap[i].res;
  }
  size_t used = 0;
  for (size_t s = 0; s < t->index_cap; s++) used += t->index[s] != 0;
  ok &= used == t->n && 2 * t->n <= t->index_cap;
  pthread_mutex_unlock(&t->mu);
  return ok;
}

/* Many armed resources taken out in a scrambled order, some by their
 * deadlines: the heap and its index stay consistent throughout. */
static void timer_many_resources(void) {
  enum { N = 600 };
  keel_lockspace_t *ls = new_ls();
  static keel_lksb_t h[N], w[N];
  static flag_t f[N];
  char name[32];
  memset(h, 0, sizeof(h));
  memset(w, 0, sizeof(w));
  memset(f, 0, sizeof(f));
  for (int i = 0; i < N; i++) {
    int n = snprintf(name, sizeof(name), "tm-%d", i);
    /* Every 7th expires within 20-80 ms, the rest in an hour or more. */
    w[i].timeout_ms = i % 7 == 0 ? 20 + (uint32_t)(i * 37 % 60) : 3600 * 1000 + (uint32_t)i;
    KT_EQ(keel_lock(ls, name, (size_t)n, KEEL_LOCK_EX, 0, &h[i], NULL, NULL, NULL), 0);
    KT_EQ(keel_lock(ls, name, (size_t)n, KEEL_LOCK_EX, KEEL_LOCK_TIMEOUT, &w[i], flag_ast, NULL,
                    &f[i]),
          0);
  }
  /* One entry per resource, less those a slow host already saw expire. */
  size_t armed = timer_entries(ls);
  KT_CHECK(armed <= N && armed >= N - (N + 6) / 7);
  KT_CHECK(timer_consistent(ls));
  for (int i = 0; i < N; i += 7) wait_flag(&f[i]);
  KT_EQ(timer_entries(ls), N - (N + 6) / 7);
  KT_CHECK(timer_consistent(ls));
  for (int k = 0; k < N; k++) {
    int i = (int)((size_t)k * 379 % N); /* 379 is prime to N: each once */
    if (i % 7 == 0) {
      KT_EQ(w[i].status, KEEL_ETIMEDOUT);
    } else {
      KT_EQ(keel_unlock(&w[i], KEEL_LOCK_CANCEL), 0);
    }
    KT_EQ(keel_unlock(&h[i], 0), 0);
    if (k % 50 == 0) KT_CHECK(timer_consistent(ls));
  }
  KT_EQ(timer_entries(ls), 0);
  KT_EQ(keel_lockspace_shrink(ls, 2 * N), N);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

static void *blocker(void *arg) {
  waiter_t *w = arg;
  w->rc = keel_lock(w->ls, NAME("b"), KEEL_LOCK_EX, 0, &w->lksb, NULL, NULL, NULL);
  if (w->rc == 0) w->rc = keel_unlock(&w->lksb, 0);
  return NULL;
}

/* A blocking request sleeps until another thread's unlock grants it. */
static void blocking_wait(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0};
  rec_t r = {0};
  KT_EQ(keel_lock(ls, NAME("b"), KEEL_LOCK_PR, 0, &h, rec_ast, rec_bast, &r), 0);
  waiter_t w[4];
  pthread_t t[4];
  for (int i = 0; i < 4; i++) {
    w[i] = (waiter_t){.ls = ls, .rc = 1};
    pthread_create(&t[i], NULL, blocker, &w[i]);
  }
  while (__atomic_load_n(&r.basts, __ATOMIC_RELAXED) == 0) usleep(1000);
  usleep(20000);
  KT_EQ(keel_unlock(&h, 0), 0);
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    KT_EQ(w[i].rc, 0);
  }
  KT_EQ(__atomic_load_n(&r.basts, __ATOMIC_SEQ_CST), 1);
  KT_EQ(__atomic_load_n(&r.last_bast, __ATOMIC_SEQ_CST), KEEL_LOCK_EX);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Cancel of a waiting new request and of a conversion. */
static void cancel(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0}, w = {0}, c = {0};
  rec_t rw = {0}, rc_ = {0};
  KT_EQ(keel_lock(ls, NAME("c"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("c"), KEEL_LOCK_PR, 0, &w, rec_ast, NULL, &rw), 0);
  KT_EQ(keel_unlock(&w, 0), KEEL_EBUSY);
  KT_EQ(keel_unlock(&w, KEEL_LOCK_CANCEL), 0);
  KT_EQ(rw.asts, 1);
  KT_EQ(w.status, KEEL_ECANCELED);
  KT_CHECK(w.lock == NULL);
  KT_EQ(keel_lock(ls, NAME("c"), KEEL_LOCK_NL, 0, &c, rec_ast, NULL, &rc_), 0);
  KT_EQ(keel_lock_convert(&c, KEEL_LOCK_PW, 0), 0);
  KT_EQ(keel_unlock(&c, KEEL_LOCK_CANCEL), 0);
  KT_EQ(c.status, KEEL_ECANCELED);
  KT_EQ(c.lock->gr, KEEL_LOCK_NL);
  KT_EQ(keel_unlock(&c, KEEL_LOCK_CANCEL), KEEL_ENOENT); /* nothing pending */
  KT_EQ(keel_unlock(&c, 0), 0);
  KT_EQ(keel_unlock(&h, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* keel_lock with KEEL_LOCK_CONVERT converts by lksb and may replace the AST. */
static void convert_flag(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t a = {0};
  rec_t r1 = {0}, r2 = {0};
  KT_EQ(keel_lock(ls, NAME("k"), KEEL_LOCK_NL, 0, &a, rec_ast, NULL, &r1), 0);
  KT_EQ(keel_lock(ls, NULL, 0, KEEL_LOCK_EX, KEEL_LOCK_CONVERT, &a, rec_ast, NULL, &r2), 0);
  KT_EQ(r1.asts, 1);
  KT_EQ(r2.asts, 1);
  KT_EQ(a.lock->gr, KEEL_LOCK_EX);
  KT_EQ(keel_unlock(&a, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* A conversion by keel_lock (KEEL_LOCK_CONVERT) that fails at once with
 * KEEL_EAGAIN, KEEL_EDEADLK or KEEL_EINVAL leaves the lock's AST, BAST and
 * arg as they were. They used to be replaced before the conversion was
 * tried, so the lock's next BAST and AST went to the failed request's. */
static void convert_failure_keeps_callbacks(void) {
  keel_lockspace_t *ls = new_ls();
  rec_t r1 = {0}, rn[3] = {{0}}, rb = {0}, rc_ = {0}; /* rn: each failed request's */
  keel_lksb_t a = {0}, b = {0}, c = {0};
  KT_EQ(keel_lock(ls, NAME("cbf"), KEEL_LOCK_PR, 0, &a, rec_ast, rec_bast, &r1), 0);
  KT_EQ(keel_lock(ls, NAME("cbf"), KEEL_LOCK_PR, 0, &b, rec_ast, NULL, &rb), 0);
  unsigned cvt = KEEL_LOCK_CONVERT;
  /* b's PR blocks EX: KEEL_EAGAIN under NOQUEUE. */
  KT_EQ(
      keel_lock(ls, NULL, 0, KEEL_LOCK_EX, cvt | KEEL_LOCK_NOQUEUE, &a, rec_ast, rec_bast, &rn[0]),
      KEEL_EAGAIN);
  KT_EQ(keel_lock_convert(&b, KEEL_LOCK_PW, 0), 0); /* waits for a's PR */
  KT_EQ(r1.basts, 1);
  KT_EQ(r1.last_bast, KEEL_LOCK_PW);
  /* b's PW waits for a's PR: a's EX would wait for b's PR. */
  KT_EQ(keel_lock(ls, NULL, 0, KEEL_LOCK_EX, cvt, &a, rec_ast, rec_bast, &rn[1]), KEEL_EDEADLK);
  /* QUECVT on a down-conversion. */
  KT_EQ(keel_lock(ls, NULL, 0, KEEL_LOCK_NL, cvt | KEEL_LOCK_QUECVT, &a, rec_ast, rec_bast, &rn[2]),
        KEEL_EINVAL);
  KT_EQ(a.lock->gr, KEEL_LOCK_PR);
  /* EX, above the PW a was told of: a second BAST, through a's own. */
  KT_EQ(keel_lock(ls, NAME("cbf"), KEEL_LOCK_EX, 0, &c, rec_ast, NULL, &rc_), 0); /* waits */
  KT_EQ(r1.basts, 2);
  KT_EQ(r1.last_bast, KEEL_LOCK_EX);
  KT_EQ(keel_lock_convert(&a, KEEL_LOCK_NL, 0), 0); /* granted at once; b's PW follows */
  KT_EQ(r1.asts, 2);
  KT_EQ(rb.asts, 2);
  for (int i = 0; i < 3; i++) KT_EQ(rn[i].asts + rn[i].basts, 0);
  KT_EQ(keel_unlock(&b, 0), 0); /* c's EX follows */
  KT_EQ(rc_.asts, 1);
  KT_EQ(keel_unlock(&c, 0), 0);
  KT_EQ(keel_unlock(&a, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* A conversion that is queued has its callbacks installed: its cancel
 * completes through the new AST, and the lock keeps the new ones (as in the
 * DLM, where they are set when the request is accepted). */
static void convert_cancel_callbacks(void) {
  keel_lockspace_t *ls = new_ls();
  rec_t r1 = {0}, r2 = {0}, rb = {0};
  keel_lksb_t a = {0}, b = {0};
  KT_EQ(keel_lock(ls, NAME("cbc"), KEEL_LOCK_PR, 0, &a, rec_ast, rec_bast, &r1), 0);
  KT_EQ(keel_lock(ls, NAME("cbc"), KEEL_LOCK_PR, 0, &b, rec_ast, NULL, &rb), 0);
  KT_EQ(keel_lock(ls, NULL, 0, KEEL_LOCK_EX, KEEL_LOCK_CONVERT, &a, rec_ast, rec_bast, &r2), 0);
  KT_EQ(a.lock->queue, KEEL_Q_CONVERT);
  KT_EQ(keel_unlock(&a, KEEL_LOCK_CANCEL), 0);
  KT_EQ(a.status, KEEL_ECANCELED);
  KT_EQ(r2.asts, 1); /* the cancel's completion */
  KT_EQ(r1.asts, 1); /* the first grant only */
  KT_EQ(a.lock->gr, KEEL_LOCK_PR);
  KT_EQ(keel_lock_convert(&b, KEEL_LOCK_EX, 0), 0); /* waits for a's PR */
  KT_EQ(r2.basts, 1);
  KT_EQ(r1.basts, 0);
  KT_EQ(keel_unlock(&a, 0), 0); /* b's EX granted */
  KT_EQ(rb.asts, 2);
  KT_EQ(keel_unlock(&b, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Unused resources stay cached, are found again, and are dropped by shrink
 * and by the cache limit. */
static void resource_cache(void) {
  keel_lockspace_t *ls = new_ls();
  char name[32];
  keel_lksb_t s = {0};
  for (int i = 0; i < 1000; i++) {
    int n = snprintf(name, sizeof(name), "res-%d", i);
    KT_EQ(keel_lock(ls, name, (size_t)n, KEEL_LOCK_EX, KEEL_LOCK_VALBLK, &s, NULL, NULL, NULL), 0);
    memcpy(s.valblk, name, (size_t)n + 1);
    KT_EQ(keel_unlock(&s, KEEL_LOCK_VALBLK), 0);
  }
  KT_EQ(keel_table_count(ls->table), 1000);
  /* Cached: the value block survives while nobody holds a lock. */
  KT_EQ(keel_lock(ls, NAME("res-7"), KEEL_LOCK_PR, KEEL_LOCK_VALBLK, &s, NULL, NULL, NULL), 0);
  KT_STREQ((char *)s.valblk, "res-7");
  KT_EQ(keel_lockspace_shrink(ls, 5000), 999); /* all but the one held */
  KT_EQ(keel_table_count(ls->table), 1);
  KT_EQ(keel_unlock(&s, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);

  keel_lockspace_config_t cfg = {.cache_max = 100};
  ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL);
  for (int i = 0; i < 1000; i++) {
    int n = snprintf(name, sizeof(name), "res-%d", i);
    KT_EQ(keel_lock(ls, name, (size_t)n, KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), 0);
    KT_EQ(keel_unlock(&s, 0), 0);
  }
  KT_CHECK(keel_table_count(ls->table) <= 101);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* The cache limit's default comes from the lock_cache_max option. */
static void cache_option(void) {
  _keel_option_set(KEEL_OPT_lock_cache_max, 50);
  keel_lockspace_t *ls = new_ls();
  _keel_options_reset();
  char name[32];
  keel_lksb_t s = {0};
  for (int i = 0; i < 200; i++) {
    int n = snprintf(name, sizeof(name), "opt-%d", i);
    KT_EQ(keel_lock(ls, name, (size_t)n, KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), 0);
    KT_EQ(keel_unlock(&s, 0), 0);
  }
  KT_CHECK(keel_table_count(ls->table) <= 51);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Bug: cache_max was the table's max_entries, which counts resources with
 * locks held too. With cache_max = 2 and r1, r2 held, the unlock of r3 put
 * its resource over the limit and dropped it at once: relocking read an
 * empty value block. The limit is on unused resources only. */
static void cache_max_counts_unused_only(void) {
  keel_lockspace_config_t cfg = {.cache_max = 2};
  keel_lockspace_t *ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL);
  keel_lksb_t r1 = {0}, r2 = {0}, r3 = {0};
  KT_EQ(keel_lock(ls, NAME("r1"), KEEL_LOCK_EX, 0, &r1, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("r2"), KEEL_LOCK_EX, 0, &r2, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("r3"), KEEL_LOCK_EX, KEEL_LOCK_VALBLK, &r3, NULL, NULL, NULL), 0);
  memcpy(r3.valblk, "hello", 6);
  KT_EQ(keel_unlock(&r3, KEEL_LOCK_VALBLK), 0);
  KT_EQ(keel_table_count(ls->table), 3);
  memset(r3.valblk, 0, sizeof(r3.valblk));
  KT_EQ(keel_lock(ls, NAME("r3"), KEEL_LOCK_PR, KEEL_LOCK_VALBLK, &r3, NULL, NULL, NULL), 0);
  KT_STREQ((char *)r3.valblk, "hello");
  KT_EQ(keel_unlock(&r3, 0), 0);

  /* With cache_max = 50 and 100 resources held throughout, 1,000 others
   * locked and unlocked: at most 50 of those stay, and the newest is one. */
  KT_EQ(keel_unlock(&r1, 0), 0);
  KT_EQ(keel_unlock(&r2, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
  cfg.cache_max = 50;
  ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL);
  static keel_lksb_t held[100];
  char name[32];
  memset(held, 0, sizeof(held));
  for (int i = 0; i < 100; i++) {
    int n = snprintf(name, sizeof(name), "held-%d", i);
    KT_EQ(keel_lock(ls, name, (size_t)n, KEEL_LOCK_NL, 0, &held[i], NULL, NULL, NULL), 0);
  }
  keel_lksb_t s = {0};
  for (int i = 0; i < 1000; i++) {
    int n = snprintf(name, sizeof(name), "free-%d", i);
    KT_EQ(keel_lock(ls, name, (size_t)n, KEEL_LOCK_EX, KEEL_LOCK_VALBLK, &s, NULL, NULL, NULL), 0);
    memcpy(s.valblk, name, (size_t)n + 1);
    KT_EQ(keel_unlock(&s, KEEL_LOCK_VALBLK), 0);
    KT_CHECK(keel_table_count(ls->table) <= 100 + 50);
  }
  KT_EQ(keel_table_count(ls->table), 100 + 50);
  KT_EQ(keel_lock(ls, NAME("free-999"), KEEL_LOCK_PR, KEEL_LOCK_VALBLK, &s, NULL, NULL, NULL), 0);
  KT_STREQ((char *)s.valblk, "free-999");
  KT_EQ(keel_unlock(&s, 0), 0);
  /* The held ones become unused in turn: the cache stays at 50. */
  for (int i = 0; i < 100; i++) KT_EQ(keel_unlock(&held[i], 0), 0);
  KT_EQ(keel_table_count(ls->table), 50);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Callbacks run with no resource lock held: an AST may unlock its own lock
 * and request another on the same resource without deadlocking. */
typedef struct reenter {
  keel_lksb_t first, second;
  int second_rc, second_asts;
} reenter_t;

static void reenter_second_ast(void *arg) {
  reenter_t *r = arg;
  r->second_asts++;
}
static void reenter_ast(void *arg) {
  reenter_t *r = arg;
  KT_EQ(keel_unlock(&r->first, 0), 0);
  r->second_rc = keel_lock(NULL, NULL, 0, 0, 0, NULL, NULL, NULL, NULL); /* EINVAL, no harm */
  KT_EQ(r->second_rc, KEEL_EINVAL);
}
static keel_lockspace_t *reenter_ls;
static void reenter_request_ast(void *arg) {
  reenter_t *r = arg;
  r->second_rc =
      keel_lock(reenter_ls, NAME("re"), KEEL_LOCK_EX, 0, &r->second, reenter_second_ast, NULL, r);
}

static void callbacks_reenter(void) {
  keel_lockspace_t *ls = reenter_ls = new_ls();
  reenter_t r = {0};
  keel_lksb_t h = {0};
  /* Granted at once: the AST runs before keel_lock returns and unlocks. */
  KT_EQ(keel_lock(ls, NAME("re"), KEEL_LOCK_EX, 0, &r.first, reenter_ast, NULL, &r), 0);
  KT_CHECK(r.first.lock == NULL);
  /* Granted by another call's release: that AST requests on the same
   * resource, which is granted at once (its own AST runs nested). */
  KT_EQ(keel_lock(ls, NAME("re"), KEEL_LOCK_PR, 0, &h, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("re"), KEEL_LOCK_PR, 0, &r.first, NULL, NULL, NULL), 0);
  KT_EQ(keel_unlock(&r.first, 0), 0);
  keel_lksb_t w = {0};
  KT_EQ(keel_lock(ls, NAME("re"), KEEL_LOCK_CW, 0, &w, reenter_request_ast, NULL, &r), 0);
  KT_EQ(keel_unlock(&h, 0), 0); /* grants w; its AST asks for EX, which waits on w */
  KT_EQ(r.second_rc, 0);
  KT_EQ(r.second_asts, 0);
  KT_EQ(keel_unlock(&w, 0), 0); /* grants the EX */
  KT_EQ(r.second_asts, 1);
  KT_EQ(keel_unlock(&r.second, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* KEEL_LOCKSPACE_SCHED: callbacks run on sched workers, one at a time, in
 * grant order; a forced release runs its notices before it returns. */
typedef struct sched_rec {
  pthread_t caller;
  int order[16];
  int n;                     /* atomic */
  int on_caller, concurrent; /* atomic */
  int inside;                /* atomic */
  int basts;                 /* atomic */
} sched_rec_t;
static sched_rec_t srec;
typedef struct sched_lock {
  keel_lksb_t lksb;
  int id;
} sched_lock_t;

static void sched_ast(void *arg) {
  sched_lock_t *l = arg;
  if (__atomic_fetch_add(&srec.inside, 1, __ATOMIC_SEQ_CST) != 0)
    __atomic_store_n(&srec.concurrent, 1, __ATOMIC_SEQ_CST);
  if (pthread_equal(pthread_self(), srec.caller))
    __atomic_store_n(&srec.on_caller, 1, __ATOMIC_SEQ_CST);
  usleep(1000); /* long enough for a second drainer to show up, if there were one */
  int i = __atomic_load_n(&srec.n, __ATOMIC_SEQ_CST);
  if (i < 16) srec.order[i] = l->id;
  __atomic_store_n(&srec.n, i + 1, __ATOMIC_SEQ_CST);
  __atomic_fetch_sub(&srec.inside, 1, __ATOMIC_SEQ_CST);
}
static void sched_bast(void *arg, int mode) {
  (void)arg;
  (void)mode;
  __atomic_fetch_add(&srec.basts, 1, __ATOMIC_SEQ_CST);
}
static void sched_wait_n(int n) {
  for (int k = 0; k < 10000 && __atomic_load_n(&srec.n, __ATOMIC_SEQ_CST) < n; k++) usleep(1000);
}

static void sched_callbacks(void) {
  keel_lockspace_config_t cfg = {.flags = KEEL_LOCKSPACE_SCHED};
  keel_lockspace_t *ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL);
  memset(&srec, 0, sizeof(srec));
  srec.caller = pthread_self();
  sched_lock_t l[6];
  memset(l, 0, sizeof(l));
  for (int i = 0; i < 6; i++) l[i].id = i;
  KT_EQ(keel_lock(ls, NAME("s"), KEEL_LOCK_EX, 0, &l[0].lksb, sched_ast, sched_bast, &l[0]), 0);
  sched_wait_n(1);
  for (int i = 1; i < 5; i++) /* PR, PR, EX, PR: all wait behind the EX */
    KT_EQ(keel_lock(ls, NAME("s"), i == 3 ? KEEL_LOCK_EX : KEEL_LOCK_PR, 0, &l[i].lksb, sched_ast,
                    NULL, &l[i]),
          0);
  /* l[0] is told before it lets go: a BAST still queued when its lock is
   * unlocked is dropped (keel_unlock). */
  for (int k = 0; k < 10000 && __atomic_load_n(&srec.basts, __ATOMIC_SEQ_CST) < 1; k++)
    usleep(1000);
  KT_EQ(keel_unlock(&l[0].lksb, 0), 0); /* grants 1 and 2 */
  sched_wait_n(3);
  KT_EQ(keel_unlock(&l[1].lksb, 0), 0);
  KT_EQ(keel_unlock(&l[2].lksb, 0), 0); /* grants 3 */
  sched_wait_n(4);
  KT_EQ(keel_unlock(&l[3].lksb, 0), 0); /* grants 4 */
  sched_wait_n(5);
  KT_EQ(srec.n, 5);
  for (int i = 0; i < 5; i++) KT_EQ(srec.order[i], i);
  KT_EQ(srec.on_caller, 0);
  KT_EQ(srec.concurrent, 0);
  KT_CHECK(__atomic_load_n(&srec.basts, __ATOMIC_SEQ_CST) >= 1); /* l[0] was told */
  /* Blocking calls are unaffected: granted at once, no callback. */
  keel_lksb_t b = {0};
  KT_EQ(keel_lock(ls, NAME("s2"), KEEL_LOCK_EX, 0, &b, NULL, NULL, NULL), 0);
  KT_EQ(keel_unlock(&b, 0), 0);
  /* A burst of grants from one call: one batch, in order, never concurrent. */
  srec.n = 0;
  KT_EQ(keel_lock(ls, NAME("s3"), KEEL_LOCK_EX, 0, &b, NULL, NULL, NULL), 0);
  sched_lock_t m[12];
  memset(m, 0, sizeof(m));
  for (int i = 0; i < 12; i++) {
    m[i].id = i;
    KT_EQ(keel_lock(ls, NAME("s3"), KEEL_LOCK_PR, 0, &m[i].lksb, sched_ast, NULL, &m[i]), 0);
  }
  KT_EQ(keel_unlock(&b, 0), 0);
  sched_wait_n(12);
  for (int i = 0; i < 12; i++) KT_EQ(srec.order[i], i);
  KT_EQ(srec.concurrent, 0);
  /* A forced release: the notices have run when it returns. */
  srec.n = 0;
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
  KT_EQ(__atomic_load_n(&srec.n, __ATOMIC_SEQ_CST), 13); /* 12 PR holders + l[4] */
  for (int i = 0; i < 12; i++) KT_CHECK(m[i].lksb.lock == NULL);
}

/* --- callbacks after unlock ----------------------------------------------------- */

/* The owner of w1 is done with it in its grant AST: it unlocks and frees its
 * argument. A BAST for w1 (w2 waits for its PR) was queued in the same
 * dispatch, behind that AST: it must not run (it did, on freed memory). */
typedef struct owner {
  keel_lksb_t s;
  int basts;
} owner_t;
static void owner_ast(void *arg) {
  owner_t *o = arg;
  KT_EQ(keel_unlock(&o->s, 0), 0);
  memset(o, 0xa5, sizeof *o);
  free(o); /* unlocked: keel calls nothing with o any more */
}
static void owner_bast(void *arg, int mode) {
  owner_t *o = arg;
  (void)mode;
  o->basts++; /* ASan: use after free if it runs after the AST */
  kt_fail(__FILE__, __LINE__, "BAST of a lock its AST had unlocked");
}
static void no_bast_after_unlock(void) {
  keel_lockspace_t *ls = new_ls();
  rec_t r = {0};
  keel_lksb_t u = {0}, w2 = {0};
  owner_t *o = calloc(1, sizeof *o);
  KT_REQUIRE(o != NULL);
  KT_EQ(keel_lock(ls, NAME("b"), KEEL_LOCK_EX, 0, &u, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("b"), KEEL_LOCK_PR, 0, &o->s, owner_ast, owner_bast, o), 0);
  KT_EQ(keel_lock(ls, NAME("b"), KEEL_LOCK_EX, 0, &w2, rec_ast, NULL, &r), 0);
  KT_EQ(keel_unlock(&u, 0), 0); /* grants w1 (AST unlocks it), which grants w2 */
  KT_EQ(r.asts, 1);
  KT_EQ(w2.lock->gr, KEEL_LOCK_EX);
  KT_EQ(keel_unlock(&w2, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0); /* nothing left referenced */
}

/* A BAST that unlocks its own lock: keel_unlock must not wait for the BAST
 * it is called from, and the lock is freed once the BAST returns. */
static void self_unlock_bast(void *arg, int mode) {
  keel_lksb_t *s = arg;
  (void)mode;
  KT_EQ(keel_unlock(s, 0), 0);
  KT_CHECK(s->lock == NULL);
}
static void bast_unlocks_own_lock(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0}, w = {0};
  KT_EQ(keel_lock(ls, NAME("s"), KEEL_LOCK_PR, 0, &h, NULL, self_unlock_bast, &h), 0);
  KT_EQ(keel_lock(ls, NAME("s"), KEEL_LOCK_EX, 0, &w, NULL, NULL, NULL), 0); /* BAST; granted */
  KT_CHECK(h.lock == NULL);
  KT_EQ(w.lock->gr, KEEL_LOCK_EX);
  KT_EQ(keel_unlock(&w, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* keel_unlock on one thread while the lock's BAST runs on another: it
 * returns only after the BAST has, so the owner may free arg at once. The
 * BAST runs in the requester's keel_lock (inline dispatch). */
typedef struct slow_bast {
  int running, release, ended, unlock_returned, order_bad; /* atomic */
  keel_lockspace_t *ls;
  keel_lksb_t h, w;
} slow_bast_t;
static void slow_bast_fn(void *arg, int mode) {
  slow_bast_t *b = arg;
  (void)mode;
  __atomic_store_n(&b->running, 1, __ATOMIC_SEQ_CST);
  for (int i = 0; i < 5000 && !__atomic_load_n(&b->release, __ATOMIC_SEQ_CST); i++) usleep(1000);
  if (__atomic_load_n(&b->unlock_returned, __ATOMIC_SEQ_CST))
    __atomic_store_n(&b->order_bad, 1, __ATOMIC_SEQ_CST);
  __atomic_store_n(&b->ended, 1, __ATOMIC_SEQ_CST);
}
static void *slow_bast_requester(void *arg) {
  slow_bast_t *b = arg;
  KT_EQ(keel_lock(b->ls, NAME("w"), KEEL_LOCK_EX, 0, &b->w, NULL, NULL, NULL), 0);
  return NULL;
}
static void *slow_bast_unlocker(void *arg) {
  slow_bast_t *b = arg;
  KT_EQ(keel_unlock(&b->h, 0), 0);
  if (!__atomic_load_n(&b->ended, __ATOMIC_SEQ_CST))
    __atomic_store_n(&b->order_bad, 1, __ATOMIC_SEQ_CST);
  __atomic_store_n(&b->unlock_returned, 1, __ATOMIC_SEQ_CST);
  return NULL;
}
static void unlock_waits_for_running_bast(void) {
  slow_bast_t b = {.ls = new_ls()};
  KT_EQ(keel_lock(b.ls, NAME("w"), KEEL_LOCK_PR, 0, &b.h, NULL, slow_bast_fn, &b), 0);
  pthread_t rq, un;
  pthread_create(&rq, NULL, slow_bast_requester, &b);
  while (!__atomic_load_n(&b.running, __ATOMIC_SEQ_CST)) usleep(1000);
  pthread_create(&un, NULL, slow_bast_unlocker, &b);
  usleep(20000); /* the unlocker reaches its wait (a slow host only makes this test weaker) */
  KT_EQ(__atomic_load_n(&b.unlock_returned, __ATOMIC_SEQ_CST), 0);
  __atomic_store_n(&b.release, 1, __ATOMIC_SEQ_CST);
  pthread_join(un, NULL);
  pthread_join(rq, NULL);
  KT_EQ(__atomic_load_n(&b.order_bad, __ATOMIC_SEQ_CST), 0);
  KT_EQ(b.w.lock->gr, KEEL_LOCK_EX);
  KT_EQ(keel_unlock(&b.w, 0), 0);
  KT_EQ(keel_lockspace_release(b.ls, 0), 0);
}

/* A forced release whose cancel AST asks for a new lock: KEEL_ESHUTDOWN, and
 * the release completes (the lock it took aborted the release before). */
typedef struct relock {
  keel_lockspace_t *ls;
  keel_lksb_t s, again;
  int rc;
  atomic_int once;
} relock_t;
/* With KEEL_LOCKSPACE_SCHED the grant AST may still be queued when the
 * release cancels the lock: it runs on a worker while the release writes
 * the status, and may see KEEL_ECANCELED too (lock.h: read it atomically). */
static void relock_ast(void *arg) {
  relock_t *r = arg;
  if (__atomic_load_n(&r->s.status, __ATOMIC_ACQUIRE) == KEEL_ECANCELED &&
      !atomic_exchange(&r->once, 1))
    r->rc = keel_lock(r->ls, NAME("again"), KEEL_LOCK_EX, 0, &r->again, NULL, NULL, NULL);
}
static void force_release_refuses_new_requests(void) {
  for (int sched = 0; sched < 2; sched++) {
    keel_lockspace_config_t cfg = {.flags = sched ? KEEL_LOCKSPACE_SCHED : 0};
    relock_t r = {.ls = keel_lockspace_create(&cfg), .rc = 1};
    KT_REQUIRE(r.ls != NULL);
    KT_EQ(keel_lock(r.ls, NAME("x"), KEEL_LOCK_EX, 0, &r.s, relock_ast, NULL, &r), 0);
    KT_EQ(keel_lockspace_release(r.ls, KEEL_LOCKSPACE_FORCE), 0);
    KT_EQ(r.rc, KEEL_ESHUTDOWN);
    KT_CHECK(r.again.lock == NULL);
  }
}

/* Two BASTs of one lock run at once on two requesters' threads (CW, then
 * PR, both blocked by its EX; PR after CW, since a holder hears only of a
 * mode above those it was told of): keel_unlock returns only after both
 * have. */
typedef struct two_basts {
  keel_lockspace_t *ls;
  keel_lksb_t h, r[2];
  int running[2], go[2], ended[2], unlock_returned, order_bad; /* atomic */
} two_basts_t;
static two_basts_t tb;
static __thread int tb_slot = -1;
static void tb_bast(void *arg, int mode) {
  (void)arg;
  (void)mode;
  int i = tb_slot;
  __atomic_store_n(&tb.running[i], 1, __ATOMIC_SEQ_CST);
  for (int k = 0; k < 5000 && !__atomic_load_n(&tb.go[i], __ATOMIC_SEQ_CST); k++) usleep(1000);
  if (__atomic_load_n(&tb.unlock_returned, __ATOMIC_SEQ_CST))
    __atomic_store_n(&tb.order_bad, 1, __ATOMIC_SEQ_CST);
  __atomic_store_n(&tb.ended[i], 1, __ATOMIC_SEQ_CST);
}
static void *tb_requester(void *arg) {
  tb_slot = (int)(intptr_t)arg;
  int mode = tb_slot == 0 ? KEEL_LOCK_CW : KEEL_LOCK_PR;
  KT_EQ(keel_lock(tb.ls, NAME("t"), mode, 0, &tb.r[tb_slot], NULL, NULL, NULL), 0);
  return NULL;
}
static void *tb_unlocker(void *arg) {
  (void)arg;
  KT_EQ(keel_unlock(&tb.h, 0), 0);
  __atomic_store_n(&tb.unlock_returned, 1, __ATOMIC_SEQ_CST);
  return NULL;
}
static void unlock_waits_for_every_running_bast(void) {
  memset(&tb, 0, sizeof tb);
  tb.ls = new_ls();
  KT_EQ(keel_lock(tb.ls, NAME("t"), KEEL_LOCK_EX, 0, &tb.h, NULL, tb_bast, NULL), 0);
  pthread_t rq[2], un;
  for (intptr_t i = 0; i < 2; i++) {
    pthread_create(&rq[i], NULL, tb_requester, (void *)i);
    while (!__atomic_load_n(&tb.running[i], __ATOMIC_SEQ_CST)) usleep(1000);
  }
  pthread_create(&un, NULL, tb_unlocker, NULL);
  __atomic_store_n(&tb.go[0], 1, __ATOMIC_SEQ_CST); /* one returns, the other still runs */
  while (!__atomic_load_n(&tb.ended[0], __ATOMIC_SEQ_CST)) usleep(1000);
  usleep(20000);
  KT_EQ(__atomic_load_n(&tb.unlock_returned, __ATOMIC_SEQ_CST), 0);
  __atomic_store_n(&tb.go[1], 1, __ATOMIC_SEQ_CST);
  pthread_join(un, NULL);
  KT_EQ(__atomic_load_n(&tb.order_bad, __ATOMIC_SEQ_CST), 0);
  pthread_join(rq[0], NULL); /* granted CW; PR waits for it */
  KT_EQ(keel_unlock(&tb.r[0], 0), 0);
  pthread_join(rq[1], NULL);
  KT_EQ(keel_unlock(&tb.r[1], 0), 0);
  KT_EQ(keel_lockspace_release(tb.ls, 0), 0);
}

/* BAST(L1) takes a lock that sends BAST(L2) inline on the same thread, and
 * BAST(L2) unlocks L1: keel_unlock must not wait for the outer frame (its
 * own thread's), which hung. */
typedef struct nested {
  keel_lockspace_t *ls;
  keel_lksb_t l1, l2, q1, q2;
  int inner_done;
} nested_t;
static nested_t nb;
static void nb_ast(void *arg) {
  (void)arg;
}
static void nb_inner(void *arg, int mode) {
  (void)arg;
  (void)mode;
  KT_EQ(keel_unlock(&nb.l1, 0), 0);
  nb.inner_done = 1;
}
static void nb_outer(void *arg, int mode) {
  (void)arg;
  (void)mode;
  KT_EQ(keel_lock(nb.ls, NAME("r2"), KEEL_LOCK_EX, 0, &nb.q2, nb_ast, NULL, NULL), 0);
}
static void nested_bast_unlocks_outer_lock(void) {
  memset(&nb, 0, sizeof nb);
  nb.ls = new_ls();
  KT_EQ(keel_lock(nb.ls, NAME("r1"), KEEL_LOCK_EX, 0, &nb.l1, NULL, nb_outer, NULL), 0);
  KT_EQ(keel_lock(nb.ls, NAME("r2"), KEEL_LOCK_EX, 0, &nb.l2, NULL, nb_inner, NULL), 0);
  KT_EQ(keel_lock(nb.ls, NAME("r1"), KEEL_LOCK_EX, 0, &nb.q1, nb_ast, NULL, NULL), 0);
  KT_EQ(nb.inner_done, 1);
  KT_CHECK(nb.l1.lock == NULL);
  KT_EQ(nb.q1.lock->gr, KEEL_LOCK_EX); /* granted by the unlock of l1 */
  KT_EQ(keel_lockspace_release(nb.ls, KEEL_LOCKSPACE_FORCE), 0);
}

/* A forced release while the timer thread delivers a BAST (a timed-out
 * request's cancel unblocked another that the holder blocks): the release
 * neither frees the holder's lock under that BAST nor trips over it. h (PR)
 * is told of EX when w asks for it; g (PR) waits behind w, and x (EX)
 * behind g; when w times out, the timer thread's pass grants g, which x
 * then waits for: g's BAST comes from that pass. (As this test had it, all
 * waiters behind one holder already told of EX, the pass owed no BAST and
 * the test released after waiting 5 s for one; review, helper-86.) */
static int tr_basts, tr_mode; /* atomic */
static pthread_t tr_main, tr_thread;
static void tr_bast(void *arg, int mode) {
  (void)arg;
  tr_thread = pthread_self();
  __atomic_store_n(&tr_mode, mode, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&tr_basts, 1, __ATOMIC_SEQ_CST);
  usleep(100000); /* the release comes while it runs */
}
static void nop_ast(void *arg) {
  (void)arg;
}
static void nop_bast(void *arg, int mode) {
  (void)arg;
  (void)mode;
}
static void force_release_during_timer_bast(void) {
  keel_lockspace_t *ls = new_ls();
  /* 300 ms: g and x must queue before w times out, on a loaded machine. */
  keel_lksb_t h = {0}, w = {.timeout_ms = 300}, g = {0}, x = {0};
  __atomic_store_n(&tr_basts, 0, __ATOMIC_SEQ_CST);
  __atomic_store_n(&tr_mode, -1, __ATOMIC_SEQ_CST);
  tr_main = pthread_self();
  KT_EQ(keel_lock(ls, NAME("t"), KEEL_LOCK_PR, 0, &h, NULL, nop_bast, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("t"), KEEL_LOCK_EX, KEEL_LOCK_TIMEOUT, &w, nop_ast, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("t"), KEEL_LOCK_PR, 0, &g, nop_ast, tr_bast, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("t"), KEEL_LOCK_EX, 0, &x, nop_ast, NULL, NULL), 0);
  KT_EQ(__atomic_load_n(&tr_basts, __ATOMIC_SEQ_CST), 0); /* g waits: nobody to tell */
  for (int k = 0; k < 5000 && __atomic_load_n(&tr_basts, __ATOMIC_SEQ_CST) == 0; k++) usleep(1000);
  KT_REQUIRE(__atomic_load_n(&tr_basts, __ATOMIC_SEQ_CST) == 1);
  KT_EQ(__atomic_load_n(&tr_mode, __ATOMIC_SEQ_CST), KEEL_LOCK_EX);
  KT_CHECK(!pthread_equal(tr_thread, tr_main)); /* the timer thread's */
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
  KT_CHECK(h.lock == NULL && g.lock == NULL && x.lock == NULL);
  KT_EQ(__atomic_load_n(&tr_basts, __ATOMIC_SEQ_CST), 1);
}

/* Callbacks that keep making callbacks (SCHED: a BAST converts down to NL,
 * the AST converts back up to EX, two locks ping-pong): a forced release
 * still ends, because cancelling takes the locks out of their lksbs. */
typedef struct pingpong {
  keel_lksb_t s;
  long *n;
} pingpong_t;
static void pp_ast(void *arg) {
  pingpong_t *p = arg;
  __atomic_add_fetch(p->n, 1, __ATOMIC_RELAXED);
  /* Atomic: the forced release writes it while the drainer runs this. */
  if (__atomic_load_n(&p->s.status, __ATOMIC_RELAXED) != 0) return;
  (void)keel_lock_convert(&p->s, KEEL_LOCK_EX, 0); /* KEEL_ENOENT once cancelled */
}
static void pp_bast(void *arg, int mode) {
  pingpong_t *p = arg;
  (void)mode;
  (void)keel_lock_convert(&p->s, KEEL_LOCK_NL, 0);
}
static void force_release_during_callback_storm(void) {
  keel_lockspace_config_t cfg = {.flags = KEEL_LOCKSPACE_SCHED};
  keel_lockspace_t *ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL);
  long n = 0;
  pingpong_t a = {.n = &n}, b = {.n = &n};
  KT_EQ(keel_lock(ls, NAME("p"), KEEL_LOCK_EX, 0, &a.s, pp_ast, pp_bast, &a), 0);
  KT_EQ(keel_lock(ls, NAME("p"), KEEL_LOCK_EX, 0, &b.s, pp_ast, pp_bast, &b), 0);
  for (int k = 0; k < 5000 && __atomic_load_n(&n, __ATOMIC_RELAXED) < 100; k++) usleep(1000);
  KT_CHECK(__atomic_load_n(&n, __ATOMIC_RELAXED) >= 100);
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
}

/* A lock unlocked while its BAST still waits in the callback queue (held up
 * behind a slow AST), then a forced release: the lock stays counted on its
 * resource until its BAST has been dropped (the release lost its count and
 * the resource, evicted by cache_max = 1, was freed under the BAST). */
static int slow_gate; /* atomic */
static void slow_gate_ast(void *arg) {
  (void)arg;
  for (int k = 0; k < 5000 && !__atomic_load_n(&slow_gate, __ATOMIC_SEQ_CST); k++) usleep(1000);
}
static void never_bast(void *arg, int mode) {
  (void)arg;
  (void)mode;
  kt_fail(__FILE__, __LINE__, "BAST of a lock unlocked before it ran");
}
static void *open_gate_later(void *arg) {
  (void)arg;
  usleep(50000);
  __atomic_store_n(&slow_gate, 1, __ATOMIC_SEQ_CST);
  return NULL;
}
static void force_release_with_owed_bast(void) {
  keel_lockspace_config_t cfg = {.flags = KEEL_LOCKSPACE_SCHED, .cache_max = 1};
  keel_lockspace_t *ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL);
  static keel_lksb_t hold[64];
  keel_lksb_t g = {0}, a = {0}, b = {0};
  __atomic_store_n(&slow_gate, 0, __ATOMIC_SEQ_CST);
  KT_EQ(keel_lock(ls, NAME("gate"), KEEL_LOCK_EX, 0, &g, slow_gate_ast, NULL, NULL), 0);
  for (int i = 0; i < 64; i++) {
    char nm[8];
    int l = snprintf(nm, sizeof nm, "n%d", i);
    memset(&hold[i], 0, sizeof hold[i]);
    KT_EQ(keel_lock(ls, nm, (size_t)l, KEEL_LOCK_NL, 0, &hold[i], NULL, NULL, NULL), 0);
  }
  KT_EQ(keel_lock(ls, NAME("r"), KEEL_LOCK_EX, 0, &a, nop_ast, never_bast, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("r"), KEEL_LOCK_PR, 0, &b, nop_ast, NULL, NULL), 0); /* BAST queued */
  KT_EQ(keel_unlock(&a, 0), 0); /* owed: left to its BAST; b granted */
  pthread_t t;
  pthread_create(&t, NULL, open_gate_later, NULL);
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
  pthread_join(t, NULL);
}

/* A BAST queued while its lock held EX, delivered after the lock converted
 * down to NL (which granted the request it reported): stale, skipped, as
 * the DLM skips it; it reported PR to a lock at NL (review, helper-86). */
static int stale_basts; /* atomic */
static void count_stale_bast(void *arg, int mode) {
  (void)arg;
  (void)mode;
  __atomic_add_fetch(&stale_basts, 1, __ATOMIC_SEQ_CST);
}
static int w_granted; /* atomic */
static void w_ast(void *arg) {
  (void)arg;
  __atomic_store_n(&w_granted, 1, __ATOMIC_SEQ_CST);
}
static void no_stale_bast_after_down_convert(void) {
  keel_lockspace_config_t cfg = {.flags = KEEL_LOCKSPACE_SCHED};
  keel_lockspace_t *ls = keel_lockspace_create(&cfg);
  KT_REQUIRE(ls != NULL);
  keel_lksb_t g = {0}, l = {0}, w = {0};
  __atomic_store_n(&slow_gate, 0, __ATOMIC_SEQ_CST);
  __atomic_store_n(&stale_basts, 0, __ATOMIC_SEQ_CST);
  __atomic_store_n(&w_granted, 0, __ATOMIC_SEQ_CST);
  KT_EQ(keel_lock(ls, NAME("gate"), KEEL_LOCK_EX, 0, &g, slow_gate_ast, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("r"), KEEL_LOCK_EX, 0, &l, nop_ast, count_stale_bast, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("r"), KEEL_LOCK_PR, 0, &w, w_ast, NULL, NULL), 0); /* BAST(PR) queued */
  KT_EQ(keel_lock_convert(&l, KEEL_LOCK_NL, 0), 0); /* granted at once; so is w */
  __atomic_store_n(&slow_gate, 1, __ATOMIC_SEQ_CST);
  for (int k = 0; k < 5000 && !__atomic_load_n(&w_granted, __ATOMIC_SEQ_CST); k++) usleep(1000);
  KT_REQUIRE(__atomic_load_n(&w_granted, __ATOMIC_SEQ_CST));
  KT_EQ(keel_unlock(&l, 0), 0); /* waits for a BAST of l still running: it has run or gone */
  KT_EQ(__atomic_load_n(&stale_basts, __ATOMIC_SEQ_CST), 0);
  KT_EQ(keel_unlock(&w, 0), 0);
  KT_EQ(keel_unlock(&g, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* An AST on the timer thread blocks in keel_lock on a lock the main thread
 * holds; a forced release must cancel that wait before it joins the timer
 * thread (joining first hung). */
typedef struct timer_blocked {
  keel_lockspace_t *ls;
  keel_lksb_t a, b, b2, a2;
  int in_ast, rc; /* atomic */
} timer_blocked_t;
static timer_blocked_t tbk;
static void timer_blocking_ast(void *arg) {
  (void)arg;
  __atomic_store_n(&tbk.in_ast, 1, __ATOMIC_SEQ_CST);
  int rc = keel_lock(tbk.ls, NAME("a"), KEEL_LOCK_EX, 0, &tbk.a2, NULL, NULL, NULL);
  __atomic_store_n(&tbk.rc, rc, __ATOMIC_SEQ_CST);
}
static void force_release_cancels_timer_thread_wait(void) {
  memset(&tbk, 0, sizeof tbk);
  tbk.ls = new_ls();
  KT_EQ(keel_lock(tbk.ls, NAME("a"), KEEL_LOCK_EX, 0, &tbk.a, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(tbk.ls, NAME("b"), KEEL_LOCK_EX, 0, &tbk.b, NULL, NULL, NULL), 0);
  tbk.b2.timeout_ms = 10;
  KT_EQ(keel_lock(tbk.ls, NAME("b"), KEEL_LOCK_EX, KEEL_LOCK_TIMEOUT, &tbk.b2, timer_blocking_ast,
                  NULL, NULL),
        0);
  while (!__atomic_load_n(&tbk.in_ast, __ATOMIC_SEQ_CST)) usleep(1000);
  usleep(20000); /* into its wait (a slow host only makes this weaker) */
  KT_EQ(keel_lockspace_release(tbk.ls, KEEL_LOCKSPACE_FORCE), 0);
  KT_EQ(__atomic_load_n(&tbk.rc, __ATOMIC_SEQ_CST), KEEL_ECANCELED);
}

/* QUECVT belongs to conversions: on a new request it is KEEL_EINVAL. */
static void quecvt_new_request(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t s = {0};
  KT_EQ(keel_lock(ls, NAME("q"), KEEL_LOCK_PR, KEEL_LOCK_QUECVT, &s, NULL, NULL, NULL),
        KEEL_EINVAL);
  KT_CHECK(s.lock == NULL);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Bug: a NOQUEUE request that failed (KEEL_EAGAIN) was published in
 * lksb->lock during its critical section and freed just after it, so a
 * KEEL_LOCK_CANCEL on another thread that read it there locked and read a
 * freed lkb (keel_die "not a live lock", SEGV, or ASan's use after free). A
 * request that fails at once is now never published. A prober thread
 * watches lksb->lock through a loop of such failures (a sighting fails the
 * test, with nothing dereferenced), then cancels through it (every cancel
 * must find no lock). Before the fix the sighting came within milliseconds,
 * also with both threads on one CPU; after it the test cannot fail by timing. */
typedef struct noq_probe {
  keel_lksb_t s;
  bool cancel;
  long stop, seen, bad, calls; /* atomic */
} noq_probe_t;
static void *noq_prober(void *arg) {
  noq_probe_t *p = arg;
  while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
    if (!p->cancel) {
      if (__atomic_load_n(&p->s.lock, __ATOMIC_ACQUIRE) != NULL)
        __atomic_fetch_add(&p->seen, 1, __ATOMIC_RELAXED);
    } else if (keel_unlock(&p->s, KEEL_LOCK_CANCEL) != KEEL_ENOENT) {
      __atomic_fetch_add(&p->bad, 1, __ATOMIC_RELAXED);
    }
    __atomic_fetch_add(&p->calls, 1, __ATOMIC_RELAXED);
  }
  return NULL;
}
static void noqueue_failure_never_published(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0};
  KT_EQ(keel_lock(ls, NAME("nq"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
  for (int cancel = 0; cancel < 2; cancel++) {
    noq_probe_t p = {.cancel = cancel};
    pthread_t t;
    KT_REQUIRE(pthread_create(&t, NULL, noq_prober, &p) == 0);
    while (__atomic_load_n(&p.calls, __ATOMIC_RELAXED) == 0) sched_yield();
    double end = kt_now() + 0.75;
    long n = 0;
    while (kt_now() < end && __atomic_load_n(&p.seen, __ATOMIC_RELAXED) == 0) {
      for (int k = 0; k < 64; k++, n++) {
        KT_EQ(keel_lock(ls, NAME("nq"), KEEL_LOCK_PR, KEEL_LOCK_NOQUEUE, &p.s,
                        k % 2 ? nop_ast : NULL, NULL, NULL),
              KEEL_EAGAIN);
      }
    }
    __atomic_store_n(&p.stop, 1, __ATOMIC_RELEASE);
    pthread_join(t, NULL);
    if (p.seen != 0) { /* the cancel round would use freed locks: not run */
      kt_fail(__FILE__, __LINE__, "lksb->lock showed a failed request's lkb %ld times in %ld",
              p.seen, n);
      break;
    }
    KT_EQ(p.bad, 0);
    KT_CHECK(n > 0 && p.s.lock == NULL);
  }
  KT_EQ(keel_unlock(&h, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* ---- keel_mutex ---- */

static keel_mutex_t mtx = KEEL_MUTEX_INIT;
static long mcount;
static void *mutex_worker(void *arg) {
  long n = (long)arg;
  for (long i = 0; i < n; i++) {
    keel_mutex_lock(&mtx);
    mcount++; /* plain: a broken mutex loses updates and TSan reports it */
    keel_mutex_unlock(&mtx);
  }
  return NULL;
}

static void mutex_basic(void) {
  keel_mutex_t m;
  keel_mutex_init(&m);
  KT_CHECK(keel_mutex_trylock(&m));
  KT_CHECK(!keel_mutex_trylock(&m));
  keel_mutex_unlock(&m);
  KT_CHECK(keel_mutex_trylock(&m));
  keel_mutex_unlock(&m);
  KT_EQ(m.state, 0);
}

/* 64 threads (oversubscribed on small machines) hammer one mutex. */
static void mutex_stress(void) {
  int nt = (int)kt_env_int("KEEL_TEST_THREADS", 64);
  long iters = kt_env_int("KEEL_TEST_ITERS", kt_scale(20000));
  pthread_t t[256];
  mcount = 0;
  for (int i = 0; i < nt; i++) pthread_create(&t[i], NULL, mutex_worker, (void *)iters);
  for (int i = 0; i < nt; i++) pthread_join(t[i], NULL);
  KT_EQ(mcount, nt * iters);
  KT_EQ(mtx.state, 0);
}

/* By-name lookups over names of every length, hits and misses, the same
 * names in two lockspaces, from several threads (a per-thread spare
 * resource was tried for keel_table_get_or_insert: this pinned it). */
static void *spare_thread(void *arg) {
  keel_lockspace_t **ls = arg;
  keel_lksb_t s = {0};
  char name[KEEL_LOCK_NAME_MAX];
  memset(name, 'n', sizeof(name));
  for (size_t len = 1; len <= KEEL_LOCK_NAME_MAX; len++) {
    for (int k = 0; k < 2; k++) { /* 0: miss, creates; 1: hit, leaves the spare */
      KT_EQ(keel_lock(ls[k % 2 ? 0 : 1], name, len, KEEL_LOCK_PR, 0, &s, NULL, NULL, NULL), 0);
      KT_EQ(keel_unlock(&s, 0), 0);
      KT_EQ(keel_lock(ls[k % 2 ? 1 : 0], name, len, KEEL_LOCK_PR, 0, &s, NULL, NULL, NULL), 0);
      KT_EQ(keel_unlock(&s, 0), 0);
    }
  }
  /* Long names again after short ones: the spare is big enough, reused. */
  for (size_t len = KEEL_LOCK_NAME_MAX; len >= 1; len--) {
    KT_EQ(keel_lock(ls[0], name, len, KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), 0);
    KT_EQ(keel_unlock(&s, 0), 0);
  }
  return NULL;
}

static void lookup_spare(void) {
  keel_lockspace_t *ls[2] = {new_ls(), new_ls()};
  spare_thread(ls);
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, spare_thread, ls);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  for (int k = 0; k < 2; k++) {
    KT_EQ(keel_table_count(ls[k]->table), KEEL_LOCK_NAME_MAX);
    keel_table_stats_t st;
    keel_table_stats(ls[k]->table, &st);
    KT_EQ(st.removed_referenced, 0);
    KT_EQ(keel_lockspace_release(ls[k], 0), 0);
  }
}

/* A release that finds locks returns KEEL_EBUSY and changes nothing, also
 * for requests and conversions that race its check (as a timer's or
 * sched's callbacks do, which the caller cannot hold back): they go ahead.
 * Before, they got KEEL_ESHUTDOWN during the walk. Then, once the
 * lockspace is idle, a release goes through. (The pin keeps every release
 * busy; test_lock_stress's release_races_callbacks covers the releases
 * that go ahead, and the vetoes.) */
typedef struct busy_race {
  keel_lockspace_t *ls;
  int stop, refused, done; /* atomic */
} busy_race_t;
static void *busy_racer(void *arg) {
  busy_race_t *b = arg;
  while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
    keel_lksb_t s = {0};
    int rc = keel_lock(b->ls, NAME("racer"), KEEL_LOCK_PR, 0, &s, NULL, NULL, NULL);
    if (rc == 0) {
      rc = keel_lock_convert(&s, KEEL_LOCK_EX, 0);
      if (keel_unlock(&s, 0) != 0) rc = -1000;
    }
    if (rc != 0) __atomic_fetch_add(&b->refused, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&b->done, 1, __ATOMIC_RELAXED);
  }
  return NULL;
}
static void release_busy_changes_nothing(void) {
  busy_race_t b = {.ls = keel_lockspace_create(NULL)};
  KT_REQUIRE(b.ls != NULL);
  keel_lksb_t pin = {0};
  KT_EQ(keel_lock(b.ls, NAME("pin"), KEEL_LOCK_EX, 0, &pin, NULL, NULL, NULL), 0);
  pthread_t th;
  pthread_create(&th, NULL, busy_racer, &b);
  /* The racer running first, or the releases could all be over before it. */
  while (__atomic_load_n(&b.done, __ATOMIC_RELAXED) == 0) sched_yield();
  int n = kt_sanitized() ? 500 : 5000;
  for (int i = 0; i < n; i++) {
    KT_EQ(keel_lockspace_release(b.ls, 0), KEEL_EBUSY);
    if (i % 16 == 0) sched_yield(); /* let the racer run between checks */
  }
  __atomic_store_n(&b.stop, 1, __ATOMIC_RELEASE);
  pthread_join(th, NULL);
  KT_EQ(__atomic_load_n(&b.refused, __ATOMIC_RELAXED), 0);
  KT_EQ(keel_unlock(&pin, 0), 0);
  KT_EQ(keel_lockspace_release(b.ls, 0), 0);
}

/* Review (helper-86, finding 1): keel_lockspace_shrink, which a memory
 * pressure callback calls at any time, ran its eviction on the table of a
 * lockspace being released: "resource table still referenced", "freed
 * twice" or SIGSEGV in 5 runs of 5. Now the release waits for a shrink
 * under way, and a shrink that starts later does nothing. */
static keel_lockspace_t *_Atomic shrink_target;
static _Atomic int shrink_stop;
static void *shrinker(void *arg) {
  (void)arg;
  while (!atomic_load(&shrink_stop)) {
    keel_lockspace_t *ls = atomic_load(&shrink_target);
    if (ls != NULL) keel_lockspace_shrink(ls, 1000);
  }
  return NULL;
}

static void shrink_races_release(void) {
  atomic_store(&shrink_stop, 0);
  atomic_store(&shrink_target, NULL);
  pthread_t t;
  KT_REQUIRE(pthread_create(&t, NULL, shrinker, NULL) == 0);
  int rounds = (int)kt_scale(100); /* below the 1,024 released handles kept */
  for (int r = 0; r < rounds; r++) {
    keel_lockspace_t *ls = keel_lockspace_create(NULL);
    KT_REQUIRE(ls != NULL);
    for (int i = 0; i < 64; i++) {
      uint32_t name = (uint32_t)i;
      keel_lksb_t sb = {0};
      KT_EQ(keel_lock(ls, &name, sizeof(name), KEEL_LOCK_EX, 0, &sb, NULL, NULL, NULL), 0);
      KT_EQ(keel_unlock(&sb, 0), 0);
    }
    atomic_store(&shrink_target, ls);
    sched_yield();
    KT_EQ(keel_lockspace_release(ls, 0), 0);
    KT_EQ(keel_lockspace_shrink(ls, 1000), 0); /* released: nothing, no fault */
  }
  atomic_store(&shrink_stop, 1);
  pthread_join(t, NULL);
}

KT_MAIN(KT_CASE(compat_matrix), KT_CASE(release_busy_changes_nothing), KT_CASE(bast_highest_only),
        KT_CASE(fifo_no_barging), KT_CASE(conversion_deadlock), KT_CASE(quecvt),
        KT_CASE(quecvt_down), KT_CASE(cancel_blocked_from_thread),
        KT_CASE(force_release_after_grant), KT_CASE(value_blocks), KT_CASE(timeouts_blocking),
        KT_CASE(timeouts_async), KT_CASE(timer_entry_goes_with_last_lock),
        KT_CASE(timer_rearms_for_next_deadline), KT_CASE(timer_many_resources),
        KT_CASE(blocking_wait), KT_CASE(cancel), KT_CASE(convert_flag),
        KT_CASE(convert_failure_keeps_callbacks), KT_CASE(convert_cancel_callbacks),
        KT_CASE(resource_cache), KT_CASE(cache_option), KT_CASE(cache_max_counts_unused_only),
        KT_CASE(callbacks_reenter), KT_CASE(sched_callbacks), KT_CASE(mutex_basic),
        KT_CASE(mutex_stress), KT_CASE(lookup_spare), KT_CASE(no_bast_after_unlock),
        KT_CASE(bast_unlocks_own_lock), KT_CASE(unlock_waits_for_running_bast),
        KT_CASE(force_release_refuses_new_requests), KT_CASE(quecvt_new_request),
        KT_CASE(unlock_waits_for_every_running_bast), KT_CASE(nested_bast_unlocks_outer_lock),
        KT_CASE(force_release_during_timer_bast), KT_CASE(force_release_during_callback_storm),
        KT_CASE(force_release_with_owed_bast), KT_CASE(force_release_cancels_timer_thread_wait),
        KT_CASE(noqueue_failure_never_published), KT_CASE(shrink_races_release),
        KT_CASE(no_stale_bast_after_down_convert))
