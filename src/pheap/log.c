/* pheap logs: lanes, redo logs, recovery.
 *
 * An atomic operation (alloc, free, publish) and a transaction's commit use
 * a redo log: entries "word op= value" are written to the lane's log with a
 * checksum that covers the seq, and one barrier makes the log durable: from
 * then on the operation has happened (recovery replays it). The entries are
 * applied in place and flushed, and a second barrier makes them durable:
 * 2 barriers in all, where PMDK spends 3 because it persists the emptying of
 * the log too.
 *
 * Why the emptying may wait. Replaying an already applied log is harmless
 * (OR, AND-NOT and SET of the same values) unless a later operation changed
 * the same words; recovery replays all valid logs in seq order, so a later
 * operation whose log is still valid wins anyway. The one danger is a log L1
 * still valid on media after a later conflicting operation's own log was
 * retired. But any operation that can conflict with L1 starts after L1's
 * caller returned (it uses the object L1 made), and every persist barrier
 * first flushes every retired-but-unflushed log header (ph->pending, see
 * persist.c): so L1's emptying is durable before the later operation's first
 * barrier, hence before any of its stores can matter. Stores made with no
 * pheap call at all (plain stores to the destination, then a crash before
 * any barrier) are the exception: persist them with keel_pheap_persist or a
 * transaction, which also flush pending retirements first.
 *
 * A log also vouches for data that had to be durable before it (object
 * headers, a transaction's new bytes): rather than spend a barrier to order
 * that data before the log, the log carries a checksum of it (CHK entries +
 * dsum) and recovery treats a log whose data does not match as never
 * committed. Past PH_CHK_MAX_BYTES the writer spends the barrier instead.
 * A stale log whose data was later changed fails the same test, which is
 * right: it was applied before its caller returned.
 *
 * Recovery order at open: (1) every lane's valid redo log and every undo log
 * whose transaction did not commit (no valid redo log with the same seq) is
 * collected; (2) they are processed in seq order: redo replayed, undo rolled
 * back newest entry first; (3) one barrier; (4) every undo log is emptied,
 * barrier, then every redo log, barrier (undo first: see below). A crash anywhere in recovery leaves the
 * logs valid and the replay idempotent, so the next open simply redoes it.
 */
#include <stdlib.h>
#include <string.h>

#include "base/die.h"
#include "pheap/pheap_int.h"

#define ATOMIC64(p) ((keel_atomic(uint64_t) *)(void *)(p))

uint64_t _keel_ph_next_seq(keel_pheap_t *ph) { return keel_fetch_add_relaxed(&ph->seq, 1) + 1; }

ph_lane_t *_keel_ph_lane_get(keel_pheap_t *ph, ph_tcache_t *tc) {
  unsigned h = tc->lane_hint;
  for (unsigned i = 0; i < PH_NLANES; i++) {
    ph_lane_t *l = &ph->lanes[(h + i) % PH_NLANES];
    if (pthread_mutex_trylock(&l->lock) == 0) {
      tc->lane_hint = l->idx;
      return l;
    }
  }
  ph_lane_t *l = &ph->lanes[h];
  pthread_mutex_lock(&l->lock); /* more threads than lanes: wait for ours */
  return l;
}

void _keel_ph_lane_put(keel_pheap_t *ph, ph_lane_t *l) {
  (void)ph;
  pthread_mutex_unlock(&l->lock);
}

static uint64_t redo_csum(const ph_redo_t *r, uint64_t seq, uint64_t n) {
  return _keel_ph_csum(r->e, n * sizeof r->e[0],
                       seq * 0x9e3779b97f4a7c15ull ^ n ^ r->dsum * 0xbf58476d1ce4e5b9ull);
}

static uint64_t data_sum(keel_pheap_t *ph, const ph_redo_entry_t *e, size_t n) {
  uint64_t h = 0x243f6a8885a308d3ull, size = keel_load_relaxed(&ph->size);
  for (size_t i = 0; i < n; i++) {
    if ((e[i].off_op & 7) != PH_OP_CHK) continue;
    uint64_t off = e[i].off_op & ~(uint64_t)7;
    if (off + e[i].val > size) return 0; /* cannot match: the data is not there */
    h = _keel_ph_csum(ph->view.base + off, e[i].val, h);
  }
  return h;
}

bool _keel_ph_redo_data_ok(keel_pheap_t *ph, const ph_redo_t *r) {
  return data_sum(ph, r->e, r->n) == r->dsum;
}

bool _keel_ph_chk_add(ph_redo_entry_t *e, size_t *n, size_t cap, uint64_t off, uint64_t len,
                      uint64_t *chk_bytes) {
  if (*n == cap || *chk_bytes + len > PH_CHK_MAX_BYTES || (off & 7)) return false;
  *chk_bytes += len;
  e[(*n)++] = (ph_redo_entry_t){off | PH_OP_CHK, len};
  return true;
}

void _keel_ph_redo_write(keel_pheap_t *ph, ph_tcache_t *tc, ph_lane_t *l, uint64_t seq,
                         const ph_redo_entry_t *e, size_t n) {
  ph_redo_t *r = l->redo;
  memcpy(r->e, e, n * sizeof *e);
  r->n = n;
  r->dsum = data_sum(ph, e, n);
  r->csum = redo_csum(r, seq, n);
  keel_store_relaxed(ATOMIC64(&r->seq), seq); /* other drains may flush this line */
  _keel_pm_flush(ph, tc, r, 64 + n * sizeof *e, PH_S_REDO);
}

bool _keel_ph_redo_valid(const ph_redo_t *r) {
  uint64_t seq = keel_load_relaxed(ATOMIC64((void *)&r->seq));
  return seq != 0 && r->n <= PH_REDO_MAX && r->csum == redo_csum(r, seq, r->n);
}

static void apply_one(keel_pheap_t *ph, ph_tcache_t *tc, const ph_redo_entry_t *e) {
  uint64_t off = e->off_op & ~(uint64_t)7;
  if (off + 8 > keel_load_relaxed(&ph->size)) return; /* defensive: never write outside */
  keel_atomic(uint64_t) *w = ATOMIC64(ph->view.base + off);
  switch (e->off_op & 7) {
  case PH_OP_CHK:
    return;
  case PH_OP_SET:
    keel_store_release(w, e->val); /* release: readers of chunk words see the object */
    break;
  case PH_OP_OR:
    keel_fetch_or_acq_rel(w, e->val);
    break;
  case PH_OP_ANDNOT:
    keel_fetch_and_acq_rel(w, ~e->val);
    break;
  }
  _keel_pm_flush(ph, tc, (void *)w, 8, PH_S_APPLY);
}

void _keel_ph_redo_apply(keel_pheap_t *ph, ph_tcache_t *tc, const ph_redo_entry_t *e, size_t n) {
  for (size_t i = 0; i < n; i++) apply_one(ph, tc, &e[i]);
}

void _keel_ph_redo_retire(keel_pheap_t *ph, ph_lane_t *l) {
  static keel_atomic(uint64_t) gen;
  keel_store_relaxed(ATOMIC64(&l->redo->seq), 0);
  /* Release: a drain that sees the generation flushes the line after the
   * store above. */
  keel_store_release(&ph->pending[l->idx], keel_fetch_add_relaxed(&gen, 1) + 1);
}

static uint64_t undo_csum(uint64_t seq, const ph_undo_entry_t *e) {
  return _keel_ph_csum(e + 1, e->len, seq * 0xc2b2ae3d27d4eb4full ^ e->off * 31 ^ e->len);
}

bool _keel_ph_undo_next(const ph_undo_t *u, uint64_t *pos, const ph_undo_entry_t **out) {
  uint64_t cap = sizeof u->data;
  if (*pos + sizeof(ph_undo_entry_t) > cap) return false;
  const ph_undo_entry_t *e = (const ph_undo_entry_t *)(u->data + *pos);
  if (e->len == 0 || e->len > cap - *pos - sizeof *e || e->csum != undo_csum(u->seq, e)) return false;
  *out = e;
  *pos += sizeof *e + KEEL_ALIGN_UP(e->len, (uint64_t)8);
  return true;
}

/* For tx.c: the checksum an undo entry must carry. */
uint64_t _keel_ph_undo_csum(uint64_t seq, const ph_undo_entry_t *e) KEEL_HIDDEN;
uint64_t _keel_ph_undo_csum(uint64_t seq, const ph_undo_entry_t *e) { return undo_csum(seq, e); }

/* Restores an undo log's snapshots, newest first. */
void _keel_ph_undo_rollback(keel_pheap_t *ph, ph_tcache_t *tc, ph_undo_t *u) KEEL_HIDDEN;
void _keel_ph_undo_rollback(keel_pheap_t *ph, ph_tcache_t *tc, ph_undo_t *u) {
  const ph_undo_entry_t *stack[256], *e;
  const ph_undo_entry_t **v = stack;
  size_t n = 0, cap = 256;
  uint64_t pos = 0;
  while (_keel_ph_undo_next(u, &pos, &e)) {
    if (n == cap) {
      const ph_undo_entry_t **nv = malloc(cap * 2 * sizeof *nv);
      if (nv == NULL) keel_die("keel_pheap recovery", "out of memory");
      memcpy(nv, v, n * sizeof *nv);
      if (v != stack) free(v);
      v = nv;
      cap *= 2;
    }
    v[n++] = e;
  }
  uint64_t size = keel_load_relaxed(&ph->size);
  while (n--) {
    e = v[n];
    if (e->off + e->len > size || e->off < PH_HDR_BYTES) continue;
    memcpy(ph->view.base + e->off, e + 1, e->len);
    _keel_pm_flush(ph, tc, ph->view.base + e->off, e->len, PH_S_ROLLBACK);
  }
  if (v != stack) free(v);
}

typedef struct rec_item {
  uint64_t seq;
  unsigned lane;
  bool undo;
} rec_item_t;

static int rec_cmp(const void *a, const void *b) {
  const rec_item_t *x = a, *y = b;
  return x->seq < y->seq ? -1 : x->seq > y->seq;
}

int _keel_ph_recover(keel_pheap_t *ph, ph_tcache_t *tc) {
  rec_item_t items[2 * PH_NLANES];
  unsigned n = 0;
  for (unsigned i = 0; i < PH_NLANES; i++) {
    ph_lane_t *l = &ph->lanes[i];
    /* A log whose vouched-for data is not all there never committed. */
    bool rv = _keel_ph_redo_valid(l->redo) && _keel_ph_redo_data_ok(ph, l->redo);
    if (rv) items[n++] = (rec_item_t){l->redo->seq, i, false};
    if (l->undo->seq != 0 && !(rv && l->redo->seq == l->undo->seq))
      items[n++] = (rec_item_t){l->undo->seq, i, true};
  }
  if (n == 0) return 0;
  qsort(items, n, sizeof items[0], rec_cmp);
  for (unsigned i = 0; i < n; i++) {
    ph_lane_t *l = &ph->lanes[items[i].lane];
    if (items[i].undo)
      _keel_ph_undo_rollback(ph, tc, l->undo);
    else
      _keel_ph_redo_apply(ph, tc, l->redo->e, l->redo->n);
  }
  _keel_pm_drain(ph, tc);
  /* Undo logs are emptied before redo logs, in separate barriers: an undo
   * log left valid beside an emptied redo log of the same seq would roll a
   * committed transaction back at the next open. */
  for (unsigned i = 0; i < PH_NLANES; i++) {
    ph_lane_t *l = &ph->lanes[i];
    if (l->undo->seq) {
      l->undo->seq = 0;
      _keel_pm_flush(ph, tc, l->undo, 8, PH_S_NONE);
    }
  }
  _keel_pm_drain(ph, tc);
  for (unsigned i = 0; i < PH_NLANES; i++) {
    ph_lane_t *l = &ph->lanes[i];
    if (l->redo->seq) {
      l->redo->seq = 0;
      _keel_pm_flush(ph, tc, l->redo, 8, PH_S_NONE);
    }
  }
  _keel_pm_drain(ph, tc);
  return (int)n;
}
