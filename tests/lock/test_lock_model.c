/* Model-based test of the lock manager's queues.
 *
 * Random requests, conversions, unlocks and cancels on a few locks over a few
 * resources, through the public API with ASTs and BASTs, are checked after
 * every step against a reference model written for clarity, not speed: it
 * keeps each queue as an array, tests compatibility pairwise against the
 * spec's matrix and re-derives everything from the rules in lock.h. Checked:
 * return codes, the exact sequence of callbacks (kind, lock, status or mode),
 * the exact contents and order of every grant, convert and wait queue, and
 * every held lock's value block (requests, conversions and unlocks carry
 * VALBLK at random, each with a fresh value written by the caller).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "lock/lockspace.h"
#include "lock_test_util.h"

#define NLOCKS 10
#define NRES   3

enum { IDLE, GRANTED, CONVERTING, WAITING };

typedef struct tlock {
  keel_lksb_t lksb;
  int id;
  bool has_bast;
  /* model */
  int state, res, gr, rq, bast_mode;
  unsigned flags; /* of the request in progress or last granted */
  uint64_t vb;    /* what lksb.valblk must hold (its first 8 bytes) */
} tlock_t;

typedef struct ev {
  char kind; /* 'A' ast, 'B' bast */
  int id, val;
} ev_t;

#define EVMAX 256
static ev_t got[EVMAX], want[EVMAX];
static int ngot, nwant;
static tlock_t L[NLOCKS];
static const char *names[NRES] = {"alpha", "beta", "a-much-longer-resource-name-of-forty-bytes"};

/* model queues per resource: lock ids in order */
typedef struct mq {
  int v[NLOCKS];
  int n;
} mq_t;
static mq_t grantq[NRES], convq[NRES], waitq[NRES];
static uint64_t mlvb[NRES]; /* each resource's value block (first 8 bytes) */

static void ast(void *arg) {
  tlock_t *t = arg;
  if (ngot < EVMAX) got[ngot++] = (ev_t){'A', t->id, t->lksb.status};
}
static void bast(void *arg, int mode) {
  tlock_t *t = arg;
  if (ngot < EVMAX) got[ngot++] = (ev_t){'B', t->id, mode};
}
static void expect(char kind, int id, int val) {
  if (nwant < EVMAX) want[nwant++] = (ev_t){kind, id, val};
}

static void mq_del(mq_t *q, int id) {
  for (int i = 0; i < q->n; i++)
    if (q->v[i] == id) {
      memmove(&q->v[i], &q->v[i + 1], (size_t)(q->n - i - 1) * sizeof(int));
      q->n--;
      return;
    }
}
static void mq_add(mq_t *q, int id) {
  q->v[q->n++] = id;
}

/* Is `mode` compatible with the granted mode of every other lock on r? */
static bool m_compat(int r, int self, int mode) {
  mq_t *qs[2] = {&grantq[r], &convq[r]};
  for (int k = 0; k < 2; k++)
    for (int i = 0; i < qs[k]->n; i++) {
      tlock_t *o = &L[qs[k]->v[i]];
      if (o->id != self && !kt_compat[o->gr][mode]) return false;
    }
  return true;
}

/* Value blocks (the DLM's table): a PW/EX holder going down or to its own
 * mode writes its block, any other grant with VALBLK reads the resource's. */
static void m_grant(tlock_t *t) {
  if (t->flags & KEEL_LOCK_VALBLK) {
    if (t->gr >= KEEL_LOCK_PW && t->rq <= t->gr)
      mlvb[t->res] = t->vb;
    else
      t->vb = mlvb[t->res];
  }
  mq_del(&convq[t->res], t->id);
  mq_del(&waitq[t->res], t->id);
  mq_add(&grantq[t->res], t->id);
  t->gr = t->rq;
  t->rq = -1;
  t->bast_mode = -1;
  t->state = GRANTED;
  expect('A', t->id, 0);
}

static void m_basts(int r, tlock_t *req);

/* Grant heads while compatible; the head left blocked BASTs its blockers. */
static void m_pass(int r) {
  for (;;) {
    tlock_t *h;
    if (convq[r].n)
      h = &L[convq[r].v[0]];
    else if (waitq[r].n)
      h = &L[waitq[r].v[0]];
    else
      return;
    if (!m_compat(r, h->id, h->rq)) {
      m_basts(r, h);
      return;
    }
    m_grant(h);
  }
}

static void m_basts(int r, tlock_t *req) {
  mq_t *qs[2] = {&grantq[r], &convq[r]};
  for (int k = 0; k < 2; k++)
    for (int i = 0; i < qs[k]->n; i++) {
      tlock_t *o = &L[qs[k]->v[i]];
      if (o == req || !o->has_bast || o->bast_mode >= req->rq || kt_compat[o->gr][req->rq])
        continue;
      o->bast_mode = req->rq;
      expect('B', o->id, req->rq);
    }
}

static int m_request(tlock_t *t, int r, int mode, unsigned flags) {
  t->res = r;
  t->rq = mode;
  t->flags = flags;
  if (!convq[r].n && !waitq[r].n && m_compat(r, -1, mode)) {
    m_grant(t);
    return 0;
  }
  if (flags & KEEL_LOCK_NOQUEUE) {
    t->rq = -1;
    return KEEL_EAGAIN;
  }
  t->state = WAITING;
  mq_add(&waitq[r], t->id);
  m_basts(r, t);
  return 0;
}

/* An up-conversion: some mode gets along with the granted one but not with
 * the requested one (the DLM allows QUECVT only on these). */
static bool m_up(int gr, int mode) {
  for (int x = 0; x < KEEL_LOCK_MODES; x++)
    if (kt_compat[gr][x] && !kt_compat[mode][x]) return true;
  return false;
}

static int m_convert(tlock_t *t, int mode, unsigned flags) {
  int r = t->res;
  if ((flags & KEEL_LOCK_QUECVT) && !m_up(t->gr, mode)) return KEEL_EINVAL;
  if ((!(flags & KEEL_LOCK_QUECVT) || !convq[r].n) && m_compat(r, t->id, mode)) {
    t->rq = mode;
    t->flags = flags;
    mq_del(&grantq[r], t->id);
    m_grant(t);
    m_pass(r);
    return 0;
  }
  for (int i = 0; i < convq[r].n; i++)
    if (!kt_compat[t->gr][L[convq[r].v[i]].rq]) return KEEL_EDEADLK;
  if (flags & KEEL_LOCK_NOQUEUE) return KEEL_EAGAIN;
  t->rq = mode;
  t->flags = flags;
  t->state = CONVERTING;
  mq_del(&grantq[r], t->id);
  mq_add(&convq[r], t->id);
  m_basts(r, t);
  return 0;
}

static void m_unlock(tlock_t *t, unsigned flags) {
  if ((flags & KEEL_LOCK_VALBLK) && t->gr >= KEEL_LOCK_PW) mlvb[t->res] = t->vb;
  mq_del(&grantq[t->res], t->id);
  t->state = IDLE;
  t->gr = -1;
  m_pass(t->res);
}

static void m_cancel(tlock_t *t) {
  int r = t->res;
  t->rq = -1;
  if (t->state == CONVERTING) {
    mq_del(&convq[r], t->id);
    mq_add(&grantq[r], t->id);
    t->state = GRANTED;
  } else {
    mq_del(&waitq[r], t->id);
    t->state = IDLE;
  }
  expect('A', t->id, KEEL_ECANCELED);
  m_pass(r);
}

/* Compares one keel queue with the model's. */
static bool same_queue(struct cds_list_head *q, mq_t *m, int qkind) {
  int i = 0;
  keel_lkb_t *l;
  cds_list_for_each_entry(l, q, q) {
    if (i >= m->n) return false;
    tlock_t *t = l->arg;
    if (t->id != m->v[i] || l->queue != qkind) return false;
    if (l->gr != t->gr || l->rq != t->rq) return false;
    i++;
  }
  return i == m->n;
}

static bool check_state(keel_lockspace_t *ls, long step) {
  bool ok = true;
  if (ngot != nwant || memcmp(got, want, (size_t)ngot * sizeof(ev_t)) != 0) {
    kt_fail(__FILE__, __LINE__, "step %ld: callbacks differ (got %d, want %d)", step, ngot, nwant);
    for (int i = 0; i < ngot || i < nwant; i++)
      fprintf(stderr, "  got %c%d:%d  want %c%d:%d\n", i < ngot ? got[i].kind : '-',
              i < ngot ? got[i].id : 0, i < ngot ? got[i].val : 0, i < nwant ? want[i].kind : '-',
              i < nwant ? want[i].id : 0, i < nwant ? want[i].val : 0);
    ok = false;
  }
  for (int r = 0; r < NRES && ok; r++) {
    keel_res_t *res = _keel_dir_attach(ls, names[r], strlen(names[r])); /* locked */
    KT_REQUIRE(res != NULL);
    bool last = __keel_dir_detach(res);
    bool same = same_queue(&res->grantq, &grantq[r], KEEL_Q_GRANT) &&
                same_queue(&res->convertq, &convq[r], KEEL_Q_CONVERT) &&
                same_queue(&res->waitq, &waitq[r], KEEL_Q_WAIT) && __keel_res_validate(res);
    __keel_mutex_unlock(&res->mu);
    if (last) _keel_dir_put(res);
    if (!same) {
      kt_fail(__FILE__, __LINE__, "step %ld: queues of %s differ from the model", step, names[r]);
      ok = false;
    }
  }
  for (int i = 0; i < NLOCKS && ok; i++) {
    if ((L[i].lksb.lock != NULL) != (L[i].state != IDLE)) {
      kt_fail(__FILE__, __LINE__, "step %ld: lock %d lksb.lock wrong", step, i);
      ok = false;
    }
    if (L[i].state != IDLE && memcmp(L[i].lksb.valblk, &L[i].vb, sizeof(L[i].vb)) != 0) {
      kt_fail(__FILE__, __LINE__, "step %ld: lock %d value block differs from the model", step, i);
      ok = false;
    }
  }
  ngot = nwant = 0;
  return ok;
}

static uint64_t rng = 88172645463325252ull;
static unsigned rnd(unsigned n) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (unsigned)(rng % n);
}

static int pick(int state) {
  int c[NLOCKS], n = 0;
  for (int i = 0; i < NLOCKS; i++)
    if (L[i].state == state || (state == WAITING && L[i].state == CONVERTING)) c[n++] = i;
  return n ? c[rnd((unsigned)n)] : -1;
}

/* The caller writes a fresh value into a lock's block before acting on it. */
static void new_vb(tlock_t *t) {
  t->vb = ((uint64_t)rnd(1u << 30) << 30) | rnd(1u << 30);
  memcpy(t->lksb.valblk, &t->vb, sizeof(t->vb));
}

/* Modes weighted toward the interesting conflicts (PR, EX). */
static int rnd_mode(void) {
  static const int m[] = {0, 1, 2, 3, 3, 4, 5, 5};
  return m[rnd(8)];
}

static void model_random_ops(void) {
  keel_lockspace_t *ls = keel_lockspace_create(NULL);
  KT_REQUIRE(ls != NULL);
  memset(L, 0, sizeof(L));
  memset(grantq, 0, sizeof(grantq));
  memset(convq, 0, sizeof(convq));
  memset(waitq, 0, sizeof(waitq));
  memset(mlvb, 0, sizeof(mlvb));
  for (int i = 0; i < NLOCKS; i++) {
    L[i].id = i;
    L[i].gr = L[i].rq = L[i].bast_mode = -1;
    L[i].has_bast = i % 3 != 0;
  }
  long steps = kt_env_int("KEEL_TEST_ITERS", kt_scale(200000));
  long counts[8] = {0};
  for (long s = 0; s < steps; s++) {
    unsigned op = rnd(100);
    int i, rc, mrc;
    if (op < 35 && (i = pick(IDLE)) >= 0) {
      int r = (int)rnd(NRES), mode = rnd_mode();
      unsigned flags = (rnd(5) == 0 ? KEEL_LOCK_NOQUEUE : 0) | (rnd(2) ? KEEL_LOCK_VALBLK : 0);
      tlock_t *t = &L[i];
      t->bast_mode = -1;
      new_vb(t);
      mrc = m_request(t, r, mode, flags);
      rc = keel_lock(ls, names[r], strlen(names[r]), mode, flags, &t->lksb, ast,
                     t->has_bast ? bast : NULL, t);
      counts[0]++;
    } else if (op < 65 && (i = pick(GRANTED)) >= 0) {
      int mode = rnd_mode();
      unsigned flags = (rnd(5) == 0 ? KEEL_LOCK_NOQUEUE : 0) |
                       (rnd(3) == 0 ? KEEL_LOCK_QUECVT : 0) | (rnd(2) ? KEEL_LOCK_VALBLK : 0);
      new_vb(&L[i]);
      mrc = m_convert(&L[i], mode, flags);
      rc = keel_lock_convert(&L[i].lksb, mode, flags);
      counts[mrc == KEEL_EDEADLK ? 2 : 1]++;
    } else if (op < 85 && (i = pick(GRANTED)) >= 0) {
      unsigned flags = rnd(2) ? KEEL_LOCK_VALBLK : 0;
      new_vb(&L[i]);
      m_unlock(&L[i], flags);
      mrc = 0;
      rc = keel_unlock(&L[i].lksb, flags);
      counts[3]++;
    } else if (op < 95 && (i = pick(WAITING)) >= 0) {
      m_cancel(&L[i]);
      mrc = 0;
      rc = keel_unlock(&L[i].lksb, KEEL_LOCK_CANCEL);
      counts[4]++;
    } else if ((i = pick(WAITING)) >= 0) {
      /* Misuse that must change nothing: operations on a pending lock. */
      mrc = KEEL_EBUSY;
      rc = rnd(2) ? keel_unlock(&L[i].lksb, 0) : keel_lock_convert(&L[i].lksb, KEEL_LOCK_NL, 0);
      counts[5]++;
    } else {
      continue;
    }
    if (rc != mrc) {
      kt_fail(__FILE__, __LINE__, "step %ld op %u lock %d: rc %d, model %d", s, op, i, rc, mrc);
      break;
    }
    if (!check_state(ls, s)) break;
  }
  printf("  model: %ld requests, %ld conversions, %ld deadlocks, %ld unlocks, %ld cancels, %ld "
         "busy\n",
         counts[0], counts[1], counts[2], counts[3], counts[4], counts[5]);
  KT_CHECK(counts[2] > 0 && counts[4] > 0); /* the interesting paths were taken */
  KT_EQ(keel_lockspace_release(ls, KEEL_LOCKSPACE_FORCE), 0);
}

KT_MAIN(KT_CASE(model_random_ops))
