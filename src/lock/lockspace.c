/* Lockspaces: creation and release, the resource directory on a keel table,
 * the timer for asynchronous timeouts, and the use-after-release check.
 *
 * Use after release. A lockspace handle is a pointer the caller may keep by
 * mistake after keel_lockspace_release. Returning KEEL_ESHUTDOWN for it needs
 * the header to stay readable, so release frees everything but the small
 * header, marks it dead, and parks it in a ring of the last
 * KEEL_LS_GRAVEYARD released headers (freed when pushed out, or at exit). A
 * handle older than that is a plain use after free, as for any C object.
 *
 * Timeouts of asynchronous requests. One thread per lockspace and at most one
 * heap entry per resource, armed for the earliest deadline among its timed
 * asynchronous requests (keel_ls_timer in lockspace.h states the invariants).
 * An entry holds a table reference and a count in res->nlkb; the detach of a
 * resource's last lock takes the entry out of the heap at once, and the pass
 * at a deadline re-arms for the next one or drops the entry. So the heap
 * never holds more entries than there are resources with locks, and an
 * unused resource is never pinned (each queued request used to push an entry
 * and a reference that stayed until its deadline, granted or not).
 */
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/die.h"
#include "base/options.h"
#include "lockspace.h"

#define KEEL_LS_GRAVEYARD 1024

static pthread_mutex_t graveyard_mu = PTHREAD_MUTEX_INITIALIZER;
static keel_lockspace_t *graveyard[KEEL_LS_GRAVEYARD];
static size_t graveyard_next;

static void ls_bury(keel_lockspace_t *ls) {
  pthread_mutex_lock(&graveyard_mu);
  keel_lockspace_t *old = graveyard[graveyard_next];
  graveyard[graveyard_next] = ls;
  graveyard_next = (graveyard_next + 1) % KEEL_LS_GRAVEYARD;
  pthread_mutex_unlock(&graveyard_mu);
  free(old);
}

__attribute__((destructor)) static void graveyard_free(void) {
  for (size_t i = 0; i < KEEL_LS_GRAVEYARD; i++) {
    free(graveyard[i]);
    graveyard[i] = NULL;
  }
}

/* ---- the resource directory ---------------------------------------------- */

/* On liburcu's call_rcu thread, after a grace period: nobody can reach res. */
static void res_free(keel_table_node_t *node, void *arg) {
  (void)arg;
  keel_res_t *res = keel_table_entry(node, keel_res_t, node);
  KEEL_ASSERT(__keel_res_unused(res));
  free(res);
}

/* Creates and inserts the resource, returned locked with nlkb = 1 and the
 * reference insert gives; NULL on EEXIST (someone else created it first: the
 * caller looks again) or, with errno set, when out of memory. */
KEEL_NOINLINE static keel_res_t *dir_create(keel_lockspace_t *ls, const void *name, size_t namelen,
                                            bool *retry) {
  keel_res_t *res = malloc(sizeof(*res) + namelen);
  if (res == NULL) return NULL;
  _keel_res_init(res, name, namelen);
  res->ls = ls;
  res->nlkb = 1;
  __keel_mutex_lock(&res->mu); /* before it is visible: uncontended */
  int rc = keel_table_insert(ls->table, &res->node);
  if (rc == 0) {
    /* An RMW on ls->magic after the insert, paired with the release's
     * exchange to PROBING or CLOSING before its walk: if the exchange reads
     * this one, the insert happens before the walk, which finds the
     * resource; else keel_lock's load after it sees the release. (A fence
     * would do on its own, but TSan does not model fences.) */
    (void)__atomic_fetch_add(&ls->magic, 0, __ATOMIC_SEQ_CST);
    return res;
  }
  __keel_mutex_unlock(&res->mu);
  free(res);
  if (rc == KEEL_EEXIST) {
    *retry = true;
  } else {
    errno = -rc;
  }
  return NULL;
}

keel_res_t *_keel_dir_attach(keel_lockspace_t *ls, const void *name, size_t namelen) {
  for (;;) {
    keel_table_read_lock();
    keel_table_node_t *n = keel_table_lookup(ls->table, name, namelen);
    if (keel_likely(n != NULL)) {
      keel_res_t *res = keel_table_entry(n, keel_res_t, node);
      __keel_mutex_lock(&res->mu);
      if (keel_likely(res->nlkb > 0) || keel_table_ref(n)) {
        res->nlkb++;
        keel_table_read_unlock();
        return res;
      }
      /* Dropped by the table since the lookup: find or make its successor. */
      __keel_mutex_unlock(&res->mu);
      keel_table_read_unlock();
      continue;
    }
    keel_table_read_unlock();
    bool retry = false;
    keel_res_t *res = dir_create(ls, name, namelen, &retry);
    if (res != NULL || !retry) return res;
  }
}
void _keel_dir_put(keel_res_t *res) {
  keel_table_put(res->ls->table, &res->node);
}

/* ---- create, shrink ------------------------------------------------------ */

keel_lockspace_t *keel_lockspace_create(const keel_lockspace_config_t *config) {
  keel_lockspace_config_t c = config ? *config : (keel_lockspace_config_t){0};
  keel_lockspace_t *ls = calloc(1, sizeof(*ls));
  if (ls == NULL) return NULL;
  keel_table_config_t tc = {
      .key_type = KEEL_TABLE_KEY_BYTES,
      .key_max = KEEL_LOCK_NAME_MAX,
      .size_hint = c.size_hint,
      /* On unused resources only: locked ones neither count nor push a
       * just-released one out (max_entries counted them, so with cache_max
       * resources held an unlock's put dropped its resource, value block
       * and all, at once). Checked by the put that releases a resource's
       * last lock and lists it on the table's LRU, nowhere else. */
      .max_unused = c.cache_max ? c.cache_max : (size_t)_keel_option(KEEL_OPT_lock_cache_max),
      .entry_size = sizeof(keel_res_t),
      .free_fn = res_free,
      .name = "keel lockspace",
  };
  if (c.flags & ~KEEL_LOCKSPACE_SCHED) {
    _keel_reject("keel_lockspace_create", "unknown flags 0x%x", c.flags & ~KEEL_LOCKSPACE_SCHED);
    free(ls);
    errno = EINVAL;
    return NULL;
  }
  if ((c.flags & KEEL_LOCKSPACE_SCHED) && (ls->cbq = _keel_cbq_create()) == NULL) {
    free(ls);
    errno = ENOMEM;
    return NULL;
  }
  ls->table = keel_table_create(&tc);
  if (ls->table == NULL) {
    int e = errno;
    if (ls->cbq) _keel_cbq_destroy(ls->cbq);
    free(ls);
    errno = e;
    return NULL;
  }
  pthread_mutex_init(&ls->timer_once, NULL);
  ls->magic = KEEL_LS_MAGIC;
  return ls;
}

int _keel_ls_veto(keel_lockspace_t *ls) {
  /* PROBING -> VETOED, or the value that stopped it: the release's CAS
   * PROBING -> CLOSING and ours are ordered on the word, so either we veto
   * first and that release says KEEL_EBUSY, or it went ahead and we back
   * out. VETOED (another request vetoed) and MAGIC (a release that has
   * already given up) let us go on as well; a request that read an older
   * round's PROBING and vetoes a later round only makes it busy. */
  uint32_t m = KEEL_LS_PROBING;
  if (__atomic_compare_exchange_n(&ls->magic, &m, KEEL_LS_VETOED, false, __ATOMIC_SEQ_CST,
                                  __ATOMIC_SEQ_CST))
    return 0;
  return _keel_ls_open(m) ? 0 : KEEL_ESHUTDOWN;
}

/* A memory-pressure callback cannot know that a release is under way:
 * shrink counts itself in, then reads the state (seq_cst on both sides,
 * as release stores CLOSING and then reads the count), so either it sees
 * CLOSING and does nothing, or the release waits for it before it
 * destroys the table (review, helper-86: the eviction ran on a table
 * being destroyed; "freed twice", SIGSEGV). */
size_t keel_lockspace_shrink(keel_lockspace_t *ls, size_t n) {
  if (_keel_ls_check(ls) != 0) return 0;
  __atomic_fetch_add(&ls->shrinkers, 1, __ATOMIC_SEQ_CST);
  size_t dropped = 0;
  if (_keel_ls_open(__atomic_load_n(&ls->magic, __ATOMIC_SEQ_CST)))
    dropped = keel_table_shrink(ls->table, n);
  __atomic_fetch_sub(&ls->shrinkers, 1, __ATOMIC_SEQ_CST);
  return dropped;
}

/* ---- the timer ------------------------------------------------------------ */

/* The index: heap positions by resource address (see keel_ls_timer). */

static size_t index_home(const keel_ls_timer_t *t, const keel_res_t *res) {
  uint64_t h = (uint64_t)(uintptr_t)res * 0x9e3779b97f4a7c15ull; /* Fibonacci hashing */
  return (size_t)(h ^ (h >> 32)) & (t->index_cap - 1);
}

/* The slot that records res, or SIZE_MAX. At most half full: a probe ends. */
static size_t index_find(const keel_ls_timer_t *t, const keel_res_t *res) {
  if (t->index_cap == 0) return SIZE_MAX;
  size_t mask = t->index_cap - 1;
  for (size_t s = index_home(t, res);; s = (s + 1) & mask) {
    size_t p = t->index[s];
    if (p == 0) return SIZE_MAX;
    if (t->heap[p - 1].res == res) return s;
  }
}

/* Records heap[pos] (not yet in the index) in a free slot. */
static void index_add(keel_ls_timer_t *t, size_t pos) {
  size_t mask = t->index_cap - 1, s = index_home(t, t->heap[pos].res);
  while (t->index[s] != 0) s = (s + 1) & mask;
  t->index[s] = pos + 1;
  t->heap[pos].slot = s;
}

/* Frees slot s, shifting back the entries of its probe run that may take it
 * (no tombstones, so probes stay short however many entries come and go). */
static void index_del(keel_ls_timer_t *t, size_t s) {
  size_t mask = t->index_cap - 1;
  for (size_t j = (s + 1) & mask; t->index[j] != 0; j = (j + 1) & mask) {
    size_t home = index_home(t, t->heap[t->index[j] - 1].res);
    if (((j - home) & mask) < ((j - s) & mask)) continue; /* s is outside [home, j) */
    t->index[s] = t->index[j];
    t->heap[t->index[s] - 1].slot = s;
    s = j;
  }
  t->index[s] = 0;
}

static void index_grow(keel_ls_timer_t *t) {
  size_t cap = t->index_cap ? 2 * t->index_cap : 64;
  size_t *ix = calloc(cap, sizeof(*ix));
  if (ix == NULL) keel_die("keel_lock", "out of memory queueing a lock timeout");
  free(t->index);
  t->index = ix;
  t->index_cap = cap;
  for (size_t i = 0; i < t->n; i++) index_add(t, i);
}

/* The heap. Every store of an entry updates its index slot. */

static void heap_place(keel_ls_timer_t *t, size_t i, keel_timer_ent_t e) {
  t->heap[i] = e;
  t->index[e.slot] = i + 1;
}

static void heap_up(keel_ls_timer_t *t, size_t i) {
  keel_timer_ent_t e = t->heap[i];
  while (i > 0 && t->heap[(i - 1) / 2].deadline_ns > e.deadline_ns) {
    heap_place(t, i, t->heap[(i - 1) / 2]);
    i = (i - 1) / 2;
  }
  heap_place(t, i, e);
}

static void heap_down(keel_ls_timer_t *t, size_t i) {
  keel_timer_ent_t e = t->heap[i];
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= t->n) break;
    if (c + 1 < t->n && t->heap[c + 1].deadline_ns < t->heap[c].deadline_ns) c++;
    if (t->heap[c].deadline_ns >= e.deadline_ns) break;
    heap_place(t, i, t->heap[c]);
    i = c;
  }
  heap_place(t, i, e);
}

static void heap_push(keel_ls_timer_t *t, keel_res_t *res, uint64_t deadline_ns) {
  if (t->n == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 64;
    keel_timer_ent_t *h = realloc(t->heap, cap * sizeof(*h));
    if (h == NULL) keel_die("keel_lock", "out of memory queueing a lock timeout");
    t->heap = h;
    t->cap = cap;
  }
  if (2 * (t->n + 1) > t->index_cap) index_grow(t);
  size_t i = t->n++;
  t->heap[i] = (keel_timer_ent_t){.deadline_ns = deadline_ns, .res = res};
  index_add(t, i);
  heap_up(t, i);
}

/* Takes heap[i] out of the heap and the index and returns it. */
static keel_timer_ent_t heap_remove(keel_ls_timer_t *t, size_t i) {
  keel_timer_ent_t e = t->heap[i];
  index_del(t, e.slot); /* may move other slots: read the last entry after it */
  if (i != --t->n) {
    heap_place(t, i, t->heap[t->n]);
    if (i > 0 && t->heap[(i - 1) / 2].deadline_ns > t->heap[i].deadline_ns)
      heap_up(t, i);
    else
      heap_down(t, i);
  }
  return e;
}

/* Arms res for deadline_ns (res->mu and t->mu held). True if that made a new
 * entry, which takes over the count and reference the caller supplies; false
 * if res was armed already (now for the earlier of the two deadlines). */
static bool __timer_arm(keel_ls_timer_t *t, keel_res_t *res, uint64_t deadline_ns) {
  uint64_t first = t->n ? t->heap[0].deadline_ns : UINT64_MAX;
  size_t s = index_find(t, res);
  bool fresh = s == SIZE_MAX;
  if (fresh) {
    heap_push(t, res, deadline_ns);
  } else if (deadline_ns < t->heap[t->index[s] - 1].deadline_ns) {
    size_t i = t->index[s] - 1;
    t->heap[i].deadline_ns = deadline_ns;
    heap_up(t, i);
  }
  if (t->heap[0].deadline_ns < first) pthread_cond_signal(&t->cv); /* a new earliest deadline */
  return fresh;
}

static bool timed_async(const keel_lkb_t *l) {
  return l->ast != NULL && (l->flags & KEEL_LOCK_TIMEOUT);
}

/* The first timed asynchronous request past its deadline on res, or NULL. */
static keel_lkb_t *first_expired(keel_res_t *res, uint64_t now) {
  struct cds_list_head *qs[2] = {&res->convertq, &res->waitq};
  for (int i = 0; i < 2; i++) {
    keel_lkb_t *l;
    cds_list_for_each_entry(l, qs[i], q) {
      if (timed_async(l) && l->deadline_ns <= now) return l;
    }
  }
  return NULL;
}

/* The earliest deadline of res's pending timed asynchronous requests, or
 * UINT64_MAX if none is pending. */
static uint64_t next_deadline(const keel_res_t *res) {
  const struct cds_list_head *qs[2] = {&res->convertq, &res->waitq};
  uint64_t next = UINT64_MAX;
  for (int i = 0; i < 2; i++) {
    const keel_lkb_t *l;
    cds_list_for_each_entry(l, qs[i], q) {
      if (timed_async(l) && l->deadline_ns < next) next = l->deadline_ns;
    }
  }
  return next;
}

/* Cancels res's requests past now with KEEL_ETIMEDOUT (res->mu held); the
 * new requests among them are detached and put on gone for the caller to
 * free. The caller holds a count in nlkb, so no detach here is the last. */
static void __expire(keel_res_t *res, uint64_t now, keel_dispatch_t *d,
                     struct cds_list_head *gone) {
  keel_lkb_t *l;
  /* A cancel may grant others and reorder the queues: rescan each time. */
  while ((l = first_expired(res, now)) != NULL) {
    __keel_res_cancel(res, l, KEEL_ETIMEDOUT, d);
    if (l->queue == KEEL_Q_NONE) {
      _keel_lksb_set_lock(l->lksb, NULL);
      cds_list_add(&l->q, gone);
      bool last = __keel_dir_detach(res);
      KEEL_ASSERT(!last);
      (void)last;
    }
  }
}

/* The pass for an entry that came due, on the timer thread, which owns the
 * entry's count and reference: expires what is due, then hands both on to a
 * new entry for the next deadline, or drops them. */
static void timer_fire(keel_ls_timer_t *t, keel_res_t *res) {
  keel_dispatch_t d;
  keel_dispatch_init(&d, res->ls->cbq);
  CDS_LIST_HEAD(gone);
  bool kept = false, last = false;
  uint64_t now = keel_clock_ns();
  __keel_mutex_lock(&res->mu);
  /* nlkb == 0 (every count gone, ours included) cannot happen now that a
   * forced release stops the timer before it cancels; kept as a guard. */
  if (res->nlkb != 0) {
    __expire(res, now, &d, &gone);
    uint64_t next = next_deadline(res);
    if (next != UINT64_MAX) {
      pthread_mutex_lock(&t->mu);
      kept = __timer_arm(t, res, next);
      pthread_mutex_unlock(&t->mu);
    }
    if (!kept) last = __keel_dir_detach(res);
  }
  __keel_mutex_unlock(&res->mu);
  keel_dispatch(&d);
  keel_lkb_t *l, *tmp;
  cds_list_for_each_entry_safe(l, tmp, &gone, q) _keel_lkb_free(l);
  if (!kept) _keel_dir_put(res);
  if (last) _keel_dir_put(res);
}

static void *timer_main(void *arg) {
  keel_ls_timer_t *t = arg;
  pthread_mutex_lock(&t->mu);
  while (!t->stop) {
    if (t->n == 0) {
      pthread_cond_wait(&t->cv, &t->mu);
      continue;
    }
    uint64_t now = keel_clock_ns(), when = t->heap[0].deadline_ns;
    if (when > now) {
      struct timespec ts = {.tv_sec = (time_t)(when / 1000000000u),
                            .tv_nsec = (long)(when % 1000000000u)};
      pthread_cond_timedwait(&t->cv, &t->mu, &ts);
      continue;
    }
    keel_timer_ent_t e = heap_remove(t, 0); /* in flight: a disarm no longer finds it */
    pthread_mutex_unlock(&t->mu);
    timer_fire(t, e.res);
    pthread_mutex_lock(&t->mu);
  }
  pthread_mutex_unlock(&t->mu);
  return NULL;
}

static keel_ls_timer_t *timer_start(keel_lockspace_t *ls) {
  pthread_mutex_lock(&ls->timer_once);
  keel_ls_timer_t *t = __atomic_load_n(&ls->timer, __ATOMIC_ACQUIRE);
  if (t == NULL) {
    t = calloc(1, sizeof(*t));
    if (t == NULL) keel_die("keel_lock", "out of memory starting the lock timeout timer");
    pthread_mutex_init(&t->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&t->thread, NULL, timer_main, t);
    if (rc != 0) keel_die("keel_lock", "cannot start the lock timeout thread: %s", strerror(rc));
    t->started = true;
    /* Release: a thread that loads ls->timer sees it initialised. */
    __atomic_store_n(&ls->timer, t, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&ls->timer_once);
  return t;
}

void _keel_ls_timer_add(keel_lockspace_t *ls, keel_lkb_t *lkb) {
  keel_ls_timer_t *t = __atomic_load_n(&ls->timer, __ATOMIC_ACQUIRE);
  if (t == NULL) t = timer_start(ls);
  keel_res_t *res = lkb->res;
  pthread_mutex_lock(&t->mu);
  if (__timer_arm(t, res, lkb->deadline_ns)) {
    /* The new entry's count and reference. lkb is attached, so nlkb > 0
     * already holds a reference: the ref cannot fail, and one per resource
     * cannot overflow the table's count. */
    res->nlkb++;
    bool ok = keel_table_ref(&res->node);
    KEEL_ASSERT(ok);
    (void)ok;
  }
  pthread_mutex_unlock(&t->mu);
}

bool __keel_ls_timer_disarm(keel_res_t *res) {
  /* Acquire pairs with timer_start's release; any arm of res happened
   * before, under the res->mu we hold, so a timer that armed res is seen. */
  keel_ls_timer_t *t = __atomic_load_n(&res->ls->timer, __ATOMIC_ACQUIRE);
  if (t == NULL) return false;
  pthread_mutex_lock(&t->mu);
  size_t s = index_find(t, res);
  if (s != SIZE_MAX) heap_remove(t, t->index[s] - 1);
  pthread_mutex_unlock(&t->mu);
  if (s == SIZE_MAX) return false; /* in flight: timer_fire drops the count */
  res->nlkb = 0;
  /* The entry's reference, under res->mu. Not the last: the one nlkb held
   * stays until the caller's _keel_dir_put after the unlock, so this put is
   * one CAS (or, if that loses a race, a fetch_sub inside a read-side
   * section): it frees nothing and takes no table lock. */
  keel_table_put(res->ls->table, &res->node);
  return true;
}

/* Ends the timer thread's passes: it finishes the one it is in, if any, and
 * exits. Entries stay (and may still be added) until timer_stop. */
static void timer_halt(keel_lockspace_t *ls) {
  keel_ls_timer_t *t = __atomic_load_n(&ls->timer, __ATOMIC_ACQUIRE);
  if (t == NULL) return;
  pthread_mutex_lock(&t->mu);
  t->stop = true;
  pthread_cond_signal(&t->cv);
  pthread_mutex_unlock(&t->mu);
}

/* Halts the timer and joins its thread: no pass runs or posts callbacks
 * after it. The timer itself stays (a callback may still arm or disarm an
 * entry) until timer_free. */
static void timer_join(keel_lockspace_t *ls) {
  keel_ls_timer_t *t = __atomic_load_n(&ls->timer, __ATOMIC_ACQUIRE);
  if (t == NULL || t->joined) return;
  timer_halt(ls);
  pthread_join(t->thread, NULL);
  t->joined = true;
}

/* Drops the entries left and frees the joined timer; runs once no callback
 * can run any more (the release drained them), so no arm or disarm races
 * with it. Each entry holds a count in its resource's nlkb and a reference:
 * both go, as in a disarm (not through __keel_dir_detach, whose disarm
 * would look for the entry in this heap). */
static void timer_free(keel_lockspace_t *ls) {
  keel_ls_timer_t *t = __atomic_load_n(&ls->timer, __ATOMIC_ACQUIRE);
  if (t == NULL) return;
  timer_join(ls);
  __atomic_store_n(&ls->timer, NULL, __ATOMIC_RELEASE);
  while (t->n != 0) {
    keel_res_t *res = heap_remove(t, 0).res;
    __keel_mutex_lock(&res->mu);
    bool last = --res->nlkb == 0;
    __keel_mutex_unlock(&res->mu);
    _keel_dir_put(res); /* the entry's own */
    if (last) _keel_dir_put(res);
  }
  free(t->heap);
  free(t->index);
  pthread_cond_destroy(&t->cv);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

/* ---- release -------------------------------------------------------------- */

static int busy_fn(keel_table_node_t *node, void *arg) {
  (void)arg;
  keel_res_t *res = keel_table_entry(node, keel_res_t, node);
  __keel_mutex_lock(&res->mu);
  bool unused = __keel_res_unused(res);
  __keel_mutex_unlock(&res->mu);
  return unused ? 0 : 1;
}

typedef struct cancel_ctx {
  keel_dispatch_t d;
  struct cds_list_head gone; /* cancelled locks the release frees at its end */
  struct cds_list_head owed; /* cancelled locks still owed BASTs, held by the release */
} cancel_ctx_t;

/* Cancels every lock on q (res->mu held, the release counted in nlkb). The
 * lksbs stop leading to them, the ASTs get KEEL_ECANCELED and blocked calls
 * are woken with it. No lock is freed before the release has drained every
 * callback and joined the timer thread (a callback may hold one it read
 * from its lksb before the cancel): each stays counted on its resource, on
 * `gone`, or, if it is still owed BASTs, on `owed` with a count of the
 * release's in basts, and is `released` so that neither its last BAST nor
 * its blocked caller (gr = -1 tells wait_blocking it holds nothing) frees
 * it. */
static void cancel_queue(struct cds_list_head *q, cancel_ctx_t *c) {
  keel_lkb_t *l, *tmp;
  cds_list_for_each_entry_safe(l, tmp, q, q) {
    bool sleeper = l->ast == NULL && l->queue != KEEL_Q_GRANT;
    cds_list_del(&l->q);
    l->queue = KEEL_Q_NONE;
    _keel_lksb_set_status(l->lksb, KEEL_ECANCELED);
    _keel_lksb_set_lock(l->lksb, NULL);
    l->released = true;
    if (l->basts != 0) {
      l->basts++; /* the release's hold */
      cds_list_add_tail(&l->q, &c->owed);
    } else {
      cds_list_add_tail(&l->q, &c->gone);
    }
    if (sleeper) {
      l->gr = -1;
      /* seq_cst: pairs with sleeper_enter's increment of ls->sleepers before
       * its load of wake (see keel_lockspace_release). */
      if (__atomic_exchange_n(&l->wake, 1, __ATOMIC_SEQ_CST) == 2) {
        keel_delivery_t e = {.kind = KEEL_DELIVER_WAKE, .fn.wake = &l->wake};
        _keel_dispatch_push(&c->d, &e);
      }
    } else if (l->ast != NULL) {
      keel_delivery_t e = {.kind = KEEL_DELIVER_AST, .fn.ast = l->ast, .arg = l->arg};
      _keel_dispatch_push(&c->d, &e);
    }
  }
}

static int cancel_fn(keel_table_node_t *node, void *arg) {
  keel_res_t *res = keel_table_entry(node, keel_res_t, node);
  __keel_mutex_lock(&res->mu);
  /* nlkb == 0: unused and cached, nothing to cancel. Else the release
   * counts itself in, so res stays until its second walk, whatever the
   * locks it cancels do meanwhile. */
  if (res->nlkb != 0 && !res->release_held) {
    res->nlkb++;
    res->release_held = true;
    cancel_queue(&res->grantq, arg);
    cancel_queue(&res->convertq, arg);
    cancel_queue(&res->waitq, arg);
    memset(res->granted, 0, sizeof(res->granted));
    res->gmask = 0;
  }
  __keel_mutex_unlock(&res->mu);
  return 0;
}

/* The end of a lock the release cancelled (no callback can run any more):
 * one on `gone` is detached and freed; one on `owed` loses the release's
 * hold, and goes with it if no BAST is owed any more (else the last BAST
 * frees it, as after keel_unlock). */
static void release_drop_lkb(keel_lkb_t *l, bool gone) {
  keel_res_t *res = l->res;
  bool free_it, last = false;
  __keel_mutex_lock(&res->mu);
  if (gone) {
    free_it = true;
    last = __keel_dir_detach(res);
  } else {
    free_it = __keel_lkb_unowe(res, l, &last); /* l is released: cancel_queue */
  }
  __keel_mutex_unlock(&res->mu);
  _keel_lkb_retire(res, l, free_it, last);
}

/* The release's second walk: its own count on each resource it cancelled. */
static int uncount_fn(keel_table_node_t *node, void *arg) {
  (void)arg;
  keel_res_t *res = keel_table_entry(node, keel_res_t, node);
  __keel_mutex_lock(&res->mu);
  bool held = res->release_held, last = false;
  if (held) {
    res->release_held = false;
    last = __keel_dir_detach(res);
  }
  __keel_mutex_unlock(&res->mu);
  if (last) _keel_dir_put(res);
  return 0;
}

/* Once CLOSING: returns when no keel_lockspace_shrink is under way (none
 * starts: they read CLOSING). */
static void shrinkers_leave(keel_lockspace_t *ls) {
  while (__atomic_load_n(&ls->shrinkers, __ATOMIC_SEQ_CST) != 0) sched_yield();
}

int keel_lockspace_release(keel_lockspace_t *ls, unsigned flags) {
  int rc = _keel_ls_check(ls);
  if (rc != 0) return rc;
  if (flags & ~KEEL_LOCKSPACE_FORCE)
    return KEEL_REJECT(KEEL_EINVAL, "keel_lockspace_release", "unknown flags 0x%x",
                       flags & ~KEEL_LOCKSPACE_FORCE);
  /* Once CLOSING, new requests and conversions get KEEL_ESHUTDOWN (from a
   * callback still queued or one the release causes, or the timer's): a
   * lock taken now would escape the cancel and keep the table referenced
   * past its destroy. A forced release sets it at once. Without FORCE the
   * release must refuse nothing unless it goes ahead, yet a request may
   * take a resource its busy walk has passed. So the walk runs under
   * PROBING, and a request that meets it (after attaching, under res->mu)
   * turns it into VETOED and goes on; conversions go on too (their granted
   * lock makes the walk find the lockspace busy). The release then goes
   * ahead only by a CAS from PROBING to CLOSING: a veto, or a lock found,
   * makes it KEEL_EBUSY and the lockspace live again, with nothing refused
   * and nobody made to wait. A request that read MAGIC under res->mu
   * before PROBING was set is one the walk finds (res->mu orders them; for
   * a resource just created, see dir_create). */
  bool force = flags & KEEL_LOCKSPACE_FORCE;
  (void)__atomic_exchange_n(&ls->magic, force ? KEEL_LS_CLOSING : KEEL_LS_PROBING,
                            __ATOMIC_SEQ_CST);
  cancel_ctx_t c;
  CDS_INIT_LIST_HEAD(&c.gone);
  CDS_INIT_LIST_HEAD(&c.owed);
  if (!force) {
    uint32_t m = KEEL_LS_PROBING;
    if (keel_table_for_each(ls->table, busy_fn, NULL) != 0 ||
        !__atomic_compare_exchange_n(&ls->magic, &m, KEEL_LS_CLOSING, false, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST)) {
      /* Live again, from PROBING or VETOED only: a forced release that
       * (misused, concurrently) set CLOSING keeps it. */
      m = __atomic_load_n(&ls->magic, __ATOMIC_SEQ_CST);
      while ((m == KEEL_LS_PROBING || m == KEEL_LS_VETOED) &&
             !__atomic_compare_exchange_n(&ls->magic, &m, KEEL_LS_MAGIC, false, __ATOMIC_SEQ_CST,
                                          __ATOMIC_SEQ_CST)) {}
      return KEEL_EBUSY;
    }
    shrinkers_leave(ls);
  } else {
    shrinkers_leave(ls);
    /* The timer's passes end (one under way finishes); its thread is joined
     * only after the cancel, which wakes a call it may be blocked in. */
    timer_halt(ls);
    keel_dispatch_init(&c.d, ls->cbq);
    if (keel_table_for_each(ls->table, cancel_fn, &c) != 0)
      keel_die("keel_lockspace_release", "out of memory walking the resources");
    /* Notices run outside the table walk's read-side section: an AST may call
     * anything but keel_lockspace_release on this lockspace (new requests
     * and conversions get KEEL_ESHUTDOWN, the cancelled locks are gone from
     * their lksbs). */
    keel_dispatch(&c.d);
    /* Blocked callers may still be inside a wait (a timed one about to take
     * its resource's mutex): resources and locks stay until all have left.
     * Each counts itself in before its first load of wake, and every wake
     * word was set above (seq_cst on both sides), so a caller that counts
     * itself in later sees wake == 1 and touches no resource. */
    while (__atomic_load_n(&ls->sleepers, __ATOMIC_SEQ_CST) != 0) sched_yield();
  }
  /* Then no pass may post a callback (the thread's calls are cancelled or
   * refused), and the callbacks drain: the notices above, those they cause,
   * the BASTs owed to released locks. Only then do the cancelled locks and
   * the timer go: a callback may hold a lock it read from its lksb before
   * the cancel, or arm and disarm entries. */
  timer_join(ls);
  if (ls->cbq != NULL) {
    _keel_cbq_destroy(ls->cbq);
    ls->cbq = NULL;
  }
  timer_free(ls);
  keel_lkb_t *l, *tmp;
  cds_list_for_each_entry_safe(l, tmp, &c.gone, q) release_drop_lkb(l, true);
  cds_list_for_each_entry_safe(l, tmp, &c.owed, q) release_drop_lkb(l, false);
  if ((flags & KEEL_LOCKSPACE_FORCE) && keel_table_for_each(ls->table, uncount_fn, NULL) != 0)
    keel_die("keel_lockspace_release", "out of memory walking the resources");
  rc = keel_table_destroy(ls->table);
  if (rc != 0) keel_die("keel_lockspace_release", "resource table still referenced (%d)", rc);
  ls->table = NULL;
  pthread_mutex_destroy(&ls->timer_once);
  __atomic_store_n(&ls->magic, KEEL_LS_DEAD, __ATOMIC_RELAXED);
  ls_bury(ls);
  return 0;
}
