/* Every bad input the lock manager's issue lists, and a few more: each gets a
 * clear error code (or, where acting would write through a stale pointer, an
 * abort naming the call), and nothing is corrupted: after each, the locks
 * involved still work and the resource validates. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "lock/lockspace.h"

#define NAME(s) (s), strlen(s)

static keel_lockspace_t *new_ls(void) {
  keel_lockspace_t *ls = keel_lockspace_create(NULL);
  KT_REQUIRE(ls != NULL);
  return ls;
}

static bool res_ok(keel_lksb_t *s) {
  keel_res_t *res = s->lock->res;
  __keel_mutex_lock(&res->mu);
  bool ok = __keel_res_validate(res);
  __keel_mutex_unlock(&res->mu);
  return ok;
}

static void null_lksb(void) {
  keel_lockspace_t *ls = new_ls();
  KT_EQ(keel_lock(ls, NAME("x"), KEEL_LOCK_EX, 0, NULL, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lock_convert(NULL, KEEL_LOCK_EX, 0), KEEL_EINVAL);
  KT_EQ(keel_unlock(NULL, 0), KEEL_EINVAL);
  KT_EQ(keel_table_count(ls->table), 0); /* nothing was created */
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

static void bad_modes_and_flags(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t s = {0};
  KT_EQ(keel_lock(ls, NAME("x"), -1, 0, &s, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lock(ls, NAME("x"), KEEL_LOCK_MODES, 0, &s, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lock(ls, NAME("x"), KEEL_LOCK_EX, 0x1000, &s, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lock(ls, NAME("x"), KEEL_LOCK_EX, KEEL_LOCK_CANCEL, &s, NULL, NULL, NULL),
        KEEL_EINVAL);
  KT_CHECK(s.lock == NULL);
  KT_EQ(keel_lock(ls, NAME("x"), KEEL_LOCK_PR, 0, &s, NULL, NULL, NULL), 0);
  /* Converting to an invalid mode: refused, the lock keeps PR. */
  KT_EQ(keel_lock_convert(&s, 6, 0), KEEL_EINVAL);
  KT_EQ(keel_lock_convert(&s, -3, 0), KEEL_EINVAL);
  KT_EQ(keel_lock(ls, NULL, 0, 42, KEEL_LOCK_CONVERT, &s, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lock_convert(&s, KEEL_LOCK_EX, KEEL_LOCK_CONVERT), KEEL_EINVAL);
  KT_EQ(keel_unlock(&s, KEEL_LOCK_NOQUEUE), KEEL_EINVAL);
  KT_EQ(s.lock->gr, KEEL_LOCK_PR);
  KT_CHECK(res_ok(&s));
  KT_EQ(keel_lock_convert(&s, KEEL_LOCK_EX, 0), 0);
  KT_EQ(keel_unlock(&s, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

static void bad_names(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t s = {0};
  char big[KEEL_LOCK_NAME_MAX + 1];
  memset(big, 'n', sizeof(big));
  KT_EQ(keel_lock(ls, big, sizeof(big), KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lock(ls, "", 0, KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lock(ls, NULL, 3, KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lock(ls, big, KEEL_LOCK_NAME_MAX, KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), 0);
  KT_EQ(keel_unlock(&s, 0), 0);
  /* Names are bytes: embedded NULs and prefixes are distinct names. */
  keel_lksb_t a = {0}, b = {0};
  KT_EQ(keel_lock(ls, "a\0b", 3, KEEL_LOCK_EX, KEEL_LOCK_NOQUEUE, &a, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, "a\0c", 3, KEEL_LOCK_EX, KEEL_LOCK_NOQUEUE, &b, NULL, NULL, NULL), 0);
  KT_EQ(keel_unlock(&b, 0), 0);
  KT_EQ(keel_lock(ls, "a", 1, KEEL_LOCK_EX, KEEL_LOCK_NOQUEUE, &b, NULL, NULL, NULL), 0);
  KT_EQ(keel_unlock(&b, 0), 0);
  KT_EQ(keel_unlock(&a, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* Unlocking or converting a lock that is not held: KEEL_ENOENT, twice over. */
static void not_held(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t s = {0};
  KT_EQ(keel_unlock(&s, 0), KEEL_ENOENT);
  KT_EQ(keel_lock_convert(&s, KEEL_LOCK_EX, 0), KEEL_ENOENT);
  KT_EQ(keel_lock(ls, NAME("y"), KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), 0);
  KT_EQ(keel_unlock(&s, 0), 0);
  KT_EQ(keel_unlock(&s, 0), KEEL_ENOENT); /* double unlock */
  KT_EQ(keel_unlock(&s, KEEL_LOCK_CANCEL), KEEL_ENOENT);
  KT_EQ(keel_lock_convert(&s, KEEL_LOCK_NL, 0), KEEL_ENOENT);
  /* A failed NOQUEUE request leaves nothing held either. */
  keel_lksb_t h = {0}, t = {0};
  KT_EQ(keel_lock(ls, NAME("y"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("y"), KEEL_LOCK_EX, KEEL_LOCK_NOQUEUE, &t, NULL, NULL, NULL),
        KEEL_EAGAIN);
  KT_EQ(keel_unlock(&t, 0), KEEL_ENOENT);
  KT_CHECK(res_ok(&h));
  KT_EQ(keel_unlock(&h, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

/* A released lockspace: KEEL_ESHUTDOWN for every call on it. */
static void use_after_release(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t s = {0};
  KT_EQ(keel_lockspace_release(ls, 0), 0);
  KT_EQ(keel_lock(ls, NAME("z"), KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), KEEL_ESHUTDOWN);
  KT_EQ(keel_lockspace_release(ls, 0), KEEL_ESHUTDOWN);
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), KEEL_ESHUTDOWN);
  KT_EQ(keel_lockspace_shrink(ls, 10), 0);
  KT_CHECK(s.lock == NULL);
  KT_EQ(keel_lock(NULL, NAME("z"), KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL), KEEL_EINVAL);
  KT_EQ(keel_lockspace_release(NULL, 0), KEEL_EINVAL);
  keel_lockspace_config_t bad = {.flags = 0x80};
  errno = 0;
  KT_CHECK(keel_lockspace_create(&bad) == NULL && errno == EINVAL);
  ls = new_ls();
  KT_EQ(keel_lockspace_release(ls, 7), KEEL_EINVAL);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

static int cancelled;
static void count_ast(void *arg) {
  keel_lksb_t *s = arg;
  if (s->status == KEEL_ECANCELED && s->lock == NULL) cancelled++;
}

/* Release with locks held: KEEL_EBUSY and everything still works; with FORCE
 * every lock and request is cancelled with notice. */
static void release_busy_and_force(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t g = {0}, w = {0}, c = {0}, b = {0};
  KT_EQ(keel_lock(ls, NAME("r"), KEEL_LOCK_PR, 0, &g, count_ast, NULL, &g), 0);
  KT_EQ(keel_lockspace_release(ls, 0), KEEL_EBUSY);
  KT_EQ(keel_lock(ls, NAME("r"), KEEL_LOCK_EX, 0, &w, count_ast, NULL, &w), 0); /* waits */
  KT_EQ(keel_lock(ls, NAME("r2"), KEEL_LOCK_NL, 0, &c, count_ast, NULL, &c), 0);
  KT_EQ(keel_lock(ls, NAME("r3"), KEEL_LOCK_EX, 0, &b, NULL, NULL, NULL), 0); /* no AST */
  KT_EQ(keel_lock_convert(&g, KEEL_LOCK_CR, 0), 0);                           /* still usable */
  KT_EQ(keel_lockspace_release(ls, 0), KEEL_EBUSY);
  cancelled = 0;
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
  KT_EQ(cancelled, 3);
  KT_EQ(b.status, KEEL_ECANCELED);
  KT_CHECK(b.lock == NULL && g.lock == NULL && w.lock == NULL && c.lock == NULL);
  KT_EQ(keel_unlock(&g, 0), KEEL_ENOENT); /* the handles are dead, not dangling */
  KT_EQ(keel_lock(ls, NAME("r"), KEEL_LOCK_EX, 0, &g, NULL, NULL, NULL), KEEL_ESHUTDOWN);
}

typedef struct blocked {
  keel_lockspace_t *ls;
  keel_lksb_t lksb;
  int convert, timed, rc, started; /* started: atomic */
} blocked_t;

static void *blocked_caller(void *arg) {
  blocked_t *b = arg;
  unsigned flags = b->timed ? KEEL_LOCK_TIMEOUT : 0;
  b->lksb.timeout_ms = 60000;
  __atomic_store_n(&b->started, 1, __ATOMIC_RELEASE);
  if (b->convert)
    b->rc = keel_lock_convert(&b->lksb, KEEL_LOCK_EX, flags); /* from NL */
  else
    b->rc = keel_lock(b->ls, NAME("fb"), KEEL_LOCK_EX, flags, &b->lksb, NULL, NULL, NULL);
  return NULL;
}

/* A forced release while callers are blocked in keel_lock / keel_lock_convert:
 * they return KEEL_ECANCELED holding nothing, and release waits for them. */
static void release_force_blocked(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0};
  KT_EQ(keel_lock(ls, NAME("fb"), KEEL_LOCK_PR, 0, &h, NULL, NULL, NULL), 0);
  blocked_t b[4];
  pthread_t t[4];
  for (int i = 0; i < 4; i++) {
    b[i] = (blocked_t){.ls = ls, .convert = i & 1, .timed = i >> 1, .rc = 1};
    if (b[i].convert) /* NL first, while nothing waits: granted at once */
      KT_EQ(keel_lock(ls, NAME("fb"), KEEL_LOCK_NL, 0, &b[i].lksb, NULL, NULL, NULL), 0);
  }
  for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, blocked_caller, &b[i]);
  for (int i = 0; i < 4; i++)
    while (!__atomic_load_n(&b[i].started, __ATOMIC_ACQUIRE)) usleep(1000);
  usleep(50000); /* let them block */
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    KT_EQ(b[i].rc, KEEL_ECANCELED);
    KT_CHECK(b[i].lksb.lock == NULL);
  }
  KT_CHECK(h.lock == NULL);
}

/* An lksb copied by value: its lock belongs to the original; acting on the
 * copy would corrupt the lock's state, so keel aborts naming the call. */
static void unlock_copy(void *arg) {
  keel_lockspace_t *ls = keel_lockspace_create(NULL);
  keel_lksb_t s = {0};
  (void)arg;
  keel_lock(ls, NAME("c"), KEEL_LOCK_EX, 0, &s, NULL, NULL, NULL);
  keel_lksb_t copy = s;
  keel_unlock(&copy, 0);
}
static void unlock_garbage(void *arg) {
  static uint64_t junk[32];
  keel_lksb_t s = {.lock = (keel_lkb_t *)junk};
  (void)arg;
  keel_lock_convert(&s, KEEL_LOCK_NL, 0);
}
static void unlock_stale(void *arg) {
  keel_lockspace_t *ls = keel_lockspace_create(NULL);
  keel_lksb_t s = {0}, keep = {0};
  (void)arg;
  keel_lock(ls, NAME("c"), KEEL_LOCK_EX, 0, &keep, NULL, NULL, NULL);
  keel_lock(ls, NAME("c"), KEEL_LOCK_NL, 0, &s, NULL, NULL, NULL);
  keel_lksb_t copy = s;
  keel_unlock(&s, 0);
  keel_unlock(&copy, 0); /* its lock was freed by the unlock above */
}

static void corrupt_handles_abort(void) {
  KT_EXPECT_ABORT(unlock_copy, NULL, "keel: keel_unlock: lock");
  KT_EXPECT_ABORT(unlock_garbage, NULL, "keel: keel_lock_convert: lksb");
}
static void stale_handle_abort(void) {
  if (kt_sanitized()) return; /* a deliberate use after free */
  /* After free the lkb's magic reads DEAD unless malloc reused the bytes. */
  char out[512];
  kt_expect_abort(__FILE__, __LINE__, unlock_stale, NULL, "keel: keel_unlock:", out, sizeof(out));
}

/* A request while the same lksb's request is pending: KEEL_EBUSY. */
static void busy_lksb(void) {
  keel_lockspace_t *ls = new_ls();
  keel_lksb_t h = {0}, w = {0};
  KT_EQ(keel_lock(ls, NAME("q"), KEEL_LOCK_EX, 0, &h, NULL, NULL, NULL), 0);
  KT_EQ(keel_lock(ls, NAME("q"), KEEL_LOCK_EX, 0, &w, count_ast, NULL, &w), 0);
  KT_EQ(keel_lock_convert(&w, KEEL_LOCK_NL, 0), KEEL_EBUSY);
  KT_EQ(keel_unlock(&w, 0), KEEL_EBUSY);
  KT_CHECK(res_ok(&h));
  KT_EQ(keel_unlock(&h, 0), 0);
  KT_EQ(w.status, 0);
  KT_EQ(keel_unlock(&w, 0), 0);
  KT_EQ(keel_lockspace_release(ls, 0), 0);
}

KT_MAIN(KT_CASE(null_lksb), KT_CASE(bad_modes_and_flags), KT_CASE(bad_names), KT_CASE(not_held),
        KT_CASE(use_after_release), KT_CASE(release_busy_and_force), KT_CASE(release_force_blocked),
        KT_CASE(corrupt_handles_abort), KT_CASE(stale_handle_abort), KT_CASE(busy_lksb))
