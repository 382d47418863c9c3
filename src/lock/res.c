/* The resource state machine: grant, convert and wait queues, the grant rules,
 * conversion deadlock detection, value blocks and blocking callbacks.
 *
 * Rules (those of the Linux DLM; lock.h states them for users):
 *   new request    granted at once iff compatible with all granted modes and
 *                  the convert and wait queues are empty, else queued (FIFO);
 *   conversion     granted at once iff compatible with the other locks'
 *                  granted modes (QUECVT: and no conversion waits), else it
 *                  waits at the convert queue's tail keeping its granted mode;
 *   grant pass     while the convert queue's head is compatible grant it; when
 *                  that queue is empty, the same for the wait queue's head.
 * Cost: every compatibility test is one mask operation on res->gmask (the
 * modes held), so a request is O(1) and a grant pass O(locks granted).
 *
 * Conversion deadlock. Waiting locks hold their granted modes, and the convert
 * queue is strict FIFO, so a conversion C about to wait at the tail waits for
 * every conversion ahead of it. If one of those, L, requests a mode that C's
 * granted mode blocks, L also waits for C: a cycle, which C closes. Conversely
 * if no waiting conversion is blocked by C's granted mode, nothing waits for C
 * (new requests hold nothing), so C closes no cycle. Hence the test below is
 * exact for cycles within a resource; cycles across resources are the
 * caller's to avoid (or to break with KEEL_LOCK_TIMEOUT), as in the DLM.
 */
#include <stdio.h>
#include <string.h>

#include "base/die.h"
#include "lock_internal.h"

/* Rows of the DLM matrix in lock.h as masks over NL CR CW PR PW EX (bit 0 NL). */
const uint8_t _keel_lock_compat_mask[KEEL_LOCK_MODES] = {
    [KEEL_LOCK_NL] = 0x3f, /* all */
    [KEEL_LOCK_CR] = 0x1f, /* all but EX */
    [KEEL_LOCK_CW] = 0x07, /* NL CR CW */
    [KEEL_LOCK_PR] = 0x0b, /* NL CR PR */
    [KEEL_LOCK_PW] = 0x03, /* NL CR */
    [KEEL_LOCK_EX] = 0x01, /* NL */
};

void _keel_res_init(keel_res_t *res, const void *name, size_t namelen) {
  memset(res, 0, offsetof(keel_res_t, name));
  memcpy(res->name, name, namelen);
  keel_table_node_init_bytes(&res->node, res->name, namelen);
  CDS_INIT_LIST_HEAD(&res->grantq);
  CDS_INIT_LIST_HEAD(&res->convertq);
  CDS_INIT_LIST_HEAD(&res->waitq);
  res->namelen = (uint8_t)namelen;
}

static void res_count(keel_res_t *res, int mode, int delta) {
  res->granted[mode] += (uint32_t)delta;
  if (res->granted[mode] != 0)
    res->gmask |= (uint8_t)(1u << mode);
  else
    res->gmask &= (uint8_t) ~(1u << mode);
}

/* Notifies the owner of lkb that its request completed with status. `now`:
 * during the owner's own call (granted at once), where a blocking caller is
 * not waiting and needs no wake: it saves a locked exchange on the fast path. */
static void notify(keel_lkb_t *lkb, int status, bool now, keel_dispatch_t *d) {
  _keel_lksb_set_status(lkb->lksb, status);
  if (lkb->ast != NULL) {
    keel_delivery_t e = {.kind = KEEL_DELIVER_AST, .fn.ast = lkb->ast, .arg = lkb->arg};
    _keel_dispatch_push(d, &e);
  } else if (!now) {
    /* Release: the waiter's acquire load of wake sees status (and the whole
     * grant) once it sees 1. A FUTEX_WAKE only if the waiter announced its
     * sleep (2): a request granted at once costs no system call. */
    if (__atomic_exchange_n(&lkb->wake, 1, __ATOMIC_RELEASE) == 2) {
      keel_delivery_t e = {.kind = KEEL_DELIVER_WAKE, .fn.wake = &lkb->wake};
      _keel_dispatch_push(d, &e);
    }
  }
}

/* Value block on a grant from mode `from` (-1: new) to `to`: a holder of PW or
 * EX converting down or to its own mode writes the caller's block; any other
 * grant (new, up, PW to EX) reads it. The DLM's dlm_lvb_operations table: a
 * same-mode conversion read before, and the holder's new value was lost
 * (audit repro lvb_same_mode). */
static void lvb_on_grant(keel_res_t *res, keel_lkb_t *lkb, int from, int to) {
  if (!(lkb->flags & KEEL_LOCK_VALBLK)) return;
  if (from >= KEEL_LOCK_PW && to <= from) {
    memcpy(res->lvb, lkb->lksb->valblk, KEEL_LOCK_LVB_LEN);
  } else {
    memcpy(lkb->lksb->valblk, res->lvb, KEEL_LOCK_LVB_LEN);
  }
}

/* Grants lkb's pending request (it is on the convert or wait queue). */
static void grant(keel_res_t *res, keel_lkb_t *lkb, bool now, keel_dispatch_t *d) {
  int from = lkb->gr, to = lkb->rq;
  if (from >= 0) res_count(res, from, -1);
  res_count(res, to, +1);
  lkb->gr = (int8_t)to;
  lkb->rq = -1;
  lkb->bast_mode = -1;
  lkb->queue = KEEL_Q_GRANT;
  keel_q_move_tail(&lkb->q, &res->grantq);
  lvb_on_grant(res, lkb, from, to);
  notify(lkb, 0, now, d);
}

static void bast_queue(struct cds_list_head *q, const keel_lkb_t *req, keel_dispatch_t *d) {
  keel_lkb_t *l;
  cds_list_for_each_entry(l, q, q) {
    if (l == req || l->bast == NULL || l->bast_mode >= req->rq) continue;
    if (_keel_lock_compat_mask[req->rq] & (1u << l->gr)) continue;
    l->bast_mode = req->rq;
    l->basts++; /* dropped by _keel_lkb_bast; l stays allocated until then */
    keel_delivery_t e = {.kind = KEEL_DELIVER_BAST, .mode = req->rq, .fn.bast = l};
    _keel_dispatch_push(d, &e);
  }
}

/* Tells each holder whose granted mode blocks req that req waits: only for
 * a mode above the highest it was sent since its last grant (the DLM's
 * lkb_highbast rule: a holder told of an EX request, which it meets by
 * dropping to NL, need not hear of a PR one). Remembering only the last
 * mode sent repeated BASTs for waiters alternating PR, EX, PR (audit
 * repro bast_repeat). */
static void send_basts(keel_res_t *res, const keel_lkb_t *req, keel_dispatch_t *d) {
  bast_queue(&res->grantq, req, d);
  bast_queue(&res->convertq, req, d);
}

int __keel_res_request(keel_res_t *res, keel_lkb_t *lkb, keel_dispatch_t *d) {
  if (keel_q_empty(&res->convertq) && keel_q_empty(&res->waitq) &&
      __keel_res_compat(res, lkb->rq, -1)) {
    cds_list_add_tail(&lkb->q, &res->waitq); /* grant() moves it */
    grant(res, lkb, true, d);
    return 0;
  }
  if (lkb->flags & KEEL_LOCK_NOQUEUE) return KEEL_EAGAIN;
  lkb->queue = KEEL_Q_WAIT;
  cds_list_add_tail(&lkb->q, &res->waitq);
  send_basts(res, lkb, d);
  return 0;
}

/* True if a conversion from `gr` that waits at the convert queue's tail would
 * close a cycle (see the file comment). */
static bool conversion_deadlock(const keel_res_t *res, int gr) {
  const keel_lkb_t *l;
  cds_list_for_each_entry(l, &res->convertq, q) {
    if (!(_keel_lock_compat_mask[l->rq] & (1u << gr))) return true;
  }
  return false;
}

/* The conversion is accepted (granted or queued): its flags, mode and
 * callbacks become lkb's, so a grant at once already notifies cb's ast. Never
 * before: keel returns a refusal (KEEL_EINVAL, EDEADLK, EAGAIN) with no AST,
 * so the lock must stay as it was, as the DLM leaves a convert its argument
 * check refuses. (The DLM installs them once that check passes and reports
 * EAGAIN and EDEADLK through the new AST; keel returns those at once.) */
static void convert_accept(keel_lkb_t *lkb, int mode, unsigned flags, const keel_lock_cbs_t *cb) {
  lkb->flags = flags;
  lkb->rq = (int8_t)mode;
  if (cb != NULL) {
    lkb->ast = cb->ast;
    lkb->bast = cb->bast;
    lkb->arg = cb->arg;
  }
}

int __keel_res_convert(keel_res_t *res, keel_lkb_t *lkb, int mode, unsigned flags,
                       const keel_lock_cbs_t *cb, keel_dispatch_t *d) {
  KEEL_ASSERT(lkb->queue == KEEL_Q_GRANT);
  /* QUECVT only on an up-conversion, as in the DLM: one to a mode that is
   * compatible with less than the granted one. A down-conversion never has
   * to wait, and queueing it behind a conversion it blocks would report a
   * deadlock that granting it would have resolved. */
  if ((flags & KEEL_LOCK_QUECVT) &&
      (_keel_lock_compat_mask[lkb->gr] & ~_keel_lock_compat_mask[mode]) == 0)
    return KEEL_REJECT(KEEL_EINVAL, "keel_lock_convert",
                       "QUECVT on a conversion from mode %d to %d, which is not up", lkb->gr, mode);
  bool cvt_waiting = !keel_q_empty(&res->convertq);
  if ((!(flags & KEEL_LOCK_QUECVT) || !cvt_waiting) && __keel_res_compat(res, mode, lkb->gr)) {
    convert_accept(lkb, mode, flags, cb);
    grant(res, lkb, true, d);
    /* A weaker mode may unblock the heads; checking them costs two loads. */
    if (!keel_q_empty(&res->convertq) || !keel_q_empty(&res->waitq))
      __keel_res_grant_pending(res, d);
    return 0;
  }
  if (conversion_deadlock(res, lkb->gr)) return KEEL_EDEADLK;
  if (flags & KEEL_LOCK_NOQUEUE) return KEEL_EAGAIN;
  convert_accept(lkb, mode, flags, cb);
  lkb->queue = KEEL_Q_CONVERT;
  keel_q_move_tail(&lkb->q, &res->convertq);
  send_basts(res, lkb, d);
  return 0;
}

void __keel_res_unlock(keel_res_t *res, keel_lkb_t *lkb, unsigned flags, keel_dispatch_t *d) {
  KEEL_ASSERT(lkb->queue == KEEL_Q_GRANT);
  if ((flags & KEEL_LOCK_VALBLK) && lkb->gr >= KEEL_LOCK_PW) {
    memcpy(res->lvb, lkb->lksb->valblk, KEEL_LOCK_LVB_LEN);
  }
  res_count(res, lkb->gr, -1);
  cds_list_del(&lkb->q);
  lkb->queue = KEEL_Q_NONE;
  lkb->gr = -1;
  if (!keel_q_empty(&res->convertq) || !keel_q_empty(&res->waitq)) __keel_res_grant_pending(res, d);
}

void __keel_res_cancel(keel_res_t *res, keel_lkb_t *lkb, int status, keel_dispatch_t *d) {
  KEEL_ASSERT(lkb->queue == KEEL_Q_CONVERT || lkb->queue == KEEL_Q_WAIT);
  lkb->rq = -1;
  if (lkb->queue == KEEL_Q_CONVERT) {
    lkb->queue = KEEL_Q_GRANT;
    keel_q_move_tail(&lkb->q, &res->grantq);
  } else {
    lkb->queue = KEEL_Q_NONE;
    cds_list_del(&lkb->q);
  }
  notify(lkb, status, false, d);
  __keel_res_grant_pending(res, d);
}

/* Grants heads while compatible. The head left blocked (if any) has its
 * blockers told with a BAST: they may be locks granted in this pass, or
 * conversions granted at once since the head was queued. */
void __keel_res_grant_pending(keel_res_t *res, keel_dispatch_t *d) {
  for (;;) {
    keel_lkb_t *h;
    if (!keel_q_empty(&res->convertq))
      h = cds_list_first_entry(&res->convertq, keel_lkb_t, q);
    else if (!keel_q_empty(&res->waitq))
      h = cds_list_first_entry(&res->waitq, keel_lkb_t, q);
    else
      return;
    if (!__keel_res_compat(res, h->rq, h->gr)) {
      send_basts(res, h, d);
      return;
    }
    grant(res, h, false, d);
  }
}

static bool fail(const keel_res_t *res, const char *what) {
  fprintf(stderr, "keel: lock resource %p (%.*s): %s\n", (const void *)res, (int)res->namelen,
          res->name, what);
  return false;
}

bool __keel_res_validate(const keel_res_t *res) {
  uint32_t count[KEEL_LOCK_MODES] = {0};
  const keel_lkb_t *l;
  cds_list_for_each_entry(l, &res->grantq, q) {
    if (l->queue != KEEL_Q_GRANT || !keel_mode_valid(l->gr) || l->rq >= 0)
      return fail(res, "bad lock on the grant queue");
    count[l->gr]++;
  }
  cds_list_for_each_entry(l, &res->convertq, q) {
    if (l->queue != KEEL_Q_CONVERT || !keel_mode_valid(l->gr) || !keel_mode_valid(l->rq))
      return fail(res, "bad lock on the convert queue");
    count[l->gr]++;
  }
  cds_list_for_each_entry(l, &res->waitq, q) {
    if (l->queue != KEEL_Q_WAIT || l->gr >= 0 || !keel_mode_valid(l->rq))
      return fail(res, "bad lock on the wait queue");
  }
  for (int m = 0; m < KEEL_LOCK_MODES; m++) {
    if (count[m] != res->granted[m]) return fail(res, "granted count mismatch");
    if (!!(res->gmask & (1u << m)) != (count[m] != 0)) return fail(res, "granted mask mismatch");
  }
  /* No two incompatible grants. */
  for (int a = 0; a < KEEL_LOCK_MODES; a++)
    for (int b = a; b < KEEL_LOCK_MODES; b++) {
      if (!count[a] || !count[b] || (a == b && count[a] < 2)) continue;
      if (!(_keel_lock_compat_mask[a] & (1u << b))) return fail(res, "incompatible grants");
    }
  return true;
}
