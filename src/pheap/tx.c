/* pheap transactions: undo log for user data, redo log for allocation state.
 *
 * keel_tx_add_range copies the bytes about to change into the lane's undo
 * log (entry = {off, len, checksum over the tx seq and the data}) and ends
 * with a barrier, so the snapshot is durable before the caller's first
 * store. The range cache (a sorted array of disjoint ranges per transaction)
 * makes repeated or overlapping adds snapshot only bytes not yet covered, and
 * a fully covered add costs no barrier at all. Objects allocated in the
 * transaction need no snapshot: they vanish on abort.
 *
 * tx_alloc only reserves (volatile); tx_free and tx_publish only queue. A
 * transaction that snapshot nothing commits like an atomic operation: its
 * commit log carries the bodies of its new objects when they are small
 * (PH_TX_BODY_BYTES in all), so 1 barrier makes both durable; larger ones
 * are ordered before the log by a barrier of their own (2). Otherwise, at
 * commit: (1) flush the snapshot ranges and the new objects, write the commit
 * log (bit sets for allocations, clears for frees, queued value stores; its
 * `tx` names the undo log) with CHK entries whose checksum vouches for those
 * new bytes, so they need no barrier of their own (past 1 KiB a barrier
 * orders them first instead, and COVER entries still name them so recovery
 * replays no older store over them): barrier 1, after which the transaction is
 * committed (recovery finds a commit log for the undo log, with its data
 * intact, and discards the undo log instead of rolling back); (2) apply the
 * entries, flush them and empty the undo log: barrier 2. The lane stays in
 * flight until barrier 2, so no checkpoint passes the commit log while the
 * undo log is still valid, and the log pins the lane's ring until a
 * checkpoint passes it (log.c). A transaction that snapshot nothing
 * and allocated nothing commits with no barrier.
 * Abort: restore snapshots newest first, barrier, empty the undo log,
 * barrier; reservations go back to the thread cache.
 *
 * Undo overflow: past the lane's 48 KiB the undo log goes on in 256 KiB
 * blocks (whole chunks) taken from the heap as volatile reservations (their bitmap bits
 * stay clear, so a crash leaks nothing and recovery needs no free), chained
 * from the lane's undo header (pheap_int.h). Extending: write the block's
 * header {tx seq, next 0} and the link to it, one barrier, then entries.
 * A fresh block is used only once the watermark has passed every log drawn
 * before it was taken (a checkpoint, 2 barriers): such a log may store into
 * the block (the destination of an atomic operation on an object freed
 * since), and recovery would replay it over the snapshots before rolling
 * them back. Logs drawn later cannot name the block: it is ours. After commit
 * or abort has emptied the undo log (durably), the lane keeps PH_OVF_KEEP
 * blocks for its next transaction (no checkpoint to reuse them) and gives
 * the rest back. No block to be had: the add fails with KEEL_ENOSPC and the
 * transaction rolls back. Cost per 256 KiB of overflow: 3 barriers (1 when
 * the lane kept the block).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/die.h"
#include "base/tls.h"
#include "pheap/pheap_int.h"

uint64_t _keel_ph_stray_bytes;
bool _keel_ph_stray_check;

uint64_t _keel_ph_undo_csum(uint64_t seq, const ph_undo_entry_t *e) KEEL_HIDDEN;
void _keel_ph_undo_rollback(keel_pheap_t *ph, ph_tcache_t *tc, ph_undo_t *u) KEEL_HIDDEN;

typedef struct tx_range {
  uint64_t lo, hi;
} tx_range_t;

typedef struct tx_new {
  keel_poff_t off;
  int cls;
} tx_new_t;

/* A thread's transaction. Invariants: depth > 0 <=> lane held; ranges sorted
 * and disjoint; undo_pos = bytes of undo entries written in the current
 * segment (seg, seg_cap: the lane's area, then the last overflow block);
 * link = the durable `next` word that chains the segment after it;
 * ovf[0..novf) = the chain's blocks, in order; at most one of
 * committed/aborted. */
typedef struct ph_tx {
  keel_pheap_t *ph;
  ph_tcache_t *tc;
  ph_lane_t *lane;
  int depth, err;
  bool committed, aborted, undo_started;
  uint64_t seq, undo_pos;
  uint8_t *seg;
  uint64_t seg_cap;
  uint64_t *link;
  keel_poff_t *ovf;
  size_t novf, ovfcap;
  tx_range_t *ranges;
  size_t nr, rcap;
  tx_new_t *news;
  size_t nn, ncap;
  keel_pheap_act_t *acts;
  size_t na, acap;
} ph_tx_t;

static __thread ph_tx_t tx;
static __thread keel_thread_hook_t tx_hook;

/* Thread exit: an open transaction, then the transaction's arrays (kept
 * between transactions). */
static void tx_thread_exit(void *arg) {
  (void)arg;
  /* A thread that ends inside a transaction would keep its lane locked for
   * good (a thread whose lane search starts there then waits forever) and
   * its reserved blocks: roll the transaction back, end it, and say so. Our
   * hook was armed after the thread cache's, so the cache is still here. */
  if (tx.depth > 0 && _keel_ph_forked(tx.ph)) {
    _keel_ph_tx_forget(tx.ph); /* the parent's: its thread goes on with it */
  } else if (tx.depth > 0) {
    _keel_warn("keel_tx_end: %s: a thread exited inside a transaction; %s", tx.ph->path,
               tx.committed ? "it had committed: ended" : "rolled back");
    keel_tx_abort(KEEL_ECANCELED); /* nothing to undo once committed */
    while (tx.depth > 0) keel_tx_end();
  }
  free(tx.ranges);
  free(tx.news);
  free(tx.acts);
  free(tx.ovf);
  tx.ranges = NULL;
  tx.news = NULL;
  tx.acts = NULL;
  tx.ovf = NULL;
  tx.rcap = tx.ncap = tx.acap = tx.ovfcap = 0;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap * 2 : 16;
  while (c < need) c *= 2;
  void *n = realloc(*p, c * elem);
  if (n == NULL) return KEEL_ENOMEM;
  *p = n;
  *cap = c;
  return 0;
}

/* After the undo log is durably empty: the lane keeps the first overflow
 * blocks for its next transaction, the heap gets the rest back. */
static void ovf_release(void) {
  ph_lane_t *l = tx.lane;
  for (size_t i = 0; i < tx.novf; i++) {
    if (l->nkeep < PH_OVF_KEEP)
      l->keep[l->nkeep++] = tx.ovf[i];
    else
      _keel_ph_give(tx.ph, tx.tc, -1, tx.ovf[i]);
  }
  tx.novf = 0;
}

static void tx_rollback(void) {
  keel_pheap_t *ph = tx.ph;
  if (tx.undo_started) {
    _keel_ph_undo_rollback(ph, tx.tc, tx.lane->undo);
    _keel_pm_drain(ph, tx.tc);
    uint64_t zero = 0;
    _keel_pm_write_nt(ph, tx.tc, &tx.lane->undo->seq, &zero, 8, PH_S_ABORT_INV);
    _keel_pm_drain(ph, tx.tc);
    tx.undo_started = false;
  }
  ovf_release();
  for (size_t i = 0; i < tx.nn; i++) _keel_ph_give(ph, tx.tc, tx.news[i].cls, tx.news[i].off);
  tx.nn = 0;
  keel_pheap_cancel(ph, tx.acts, tx.na);
  tx.na = 0;
  tx.nr = 0;
  ph_tc_count(&tx.tc->tx_aborts);
}

/* Any failure inside a transaction aborts it at once (flat semantics). */
static int tx_fail(int err) {
  if (!tx.aborted && !tx.committed) {
    tx_rollback();
    tx.aborted = true;
    tx.err = err;
  }
  return err;
}

/* A transaction open in the parent when it forked lives on in the child's
 * copy of this thread: the parent's thread goes on with it, so the child
 * must neither commit nor roll it back. */
static void tx_not_forked(const char *call) {
  if (tx.depth > 0) PH_NOT_FORKED(tx.ph, call);
}

static int tx_check(void) {
  if (tx.depth == 0) return KEEL_EPERM;
  tx_not_forked("keel_tx");
  if (tx.aborted || tx.committed) return KEEL_ECANCELED;
  return 0;
}

int keel_tx_begin(keel_pheap_t *ph) {
  if (ph == NULL) {
    if (tx.depth > 0) tx.depth++; /* a level, as below: the caller's end pairs with it */
    return KEEL_REJECT(KEEL_EINVAL, "keel_tx_begin", "pool is NULL");
  }
  PH_NOT_FORKED(ph, "keel_tx_begin");
  /* A transaction inherited from the parent is the parent's: one on a pool
   * of the child's own replaces it. */
  if (tx.depth > 0 && _keel_ph_forked(tx.ph)) _keel_ph_tx_forget(tx.ph);
  if (tx.depth > 0) {
    /* A level all the same: the caller's keel_tx_end pairs with every
     * begin (pheap.h), and must not end the outer transaction. */
    if (tx.ph != ph && ++tx.depth)
      return KEEL_REJECT(KEEL_EINVAL, "keel_tx_begin",
                         "nested in a transaction of another pool (%s, not %s)", tx.ph->path,
                         ph->path);
    tx.depth++;
    return tx.aborted ? KEEL_ECANCELED : 0;
  }
  /* Pinned: other pools this thread uses before keel_tx_end must not evict
   * (free) the cache tx.tc points to. */
  ph_tcache_t *tc = _keel_ph_tcache_pin(ph);
  if (tc == NULL) return KEEL_ENOMEM;
  /* Armed at every begin (a no-op while armed), after the pin armed the
   * cache's hook: a transaction begun in a late TLS destructor, after our
   * hooks ran, still gets its exit hook, and it runs before the cache's. */
  tx_hook.fn = tx_thread_exit;
  _keel_thread_hook_arm(&tx_hook);
  tx.ph = ph;
  tx.tc = tc;
  tx.lane = _keel_ph_lane_get(ph, tc, true);
  keel_store_relaxed(&tc->tx_lane, tx.lane);
  _keel_ph_holds++;
  tx.depth = 1;
  tx.err = 0;
  tx.committed = tx.aborted = tx.undo_started = false;
  tx.seq = 0; /* drawn with the undo log (undo_append): most transactions have none */
  tx.undo_pos = 0;
  tx.seg = tx.lane->undo->data;
  tx.seg_cap = sizeof tx.lane->undo->data;
  tx.link = &tx.lane->undo->next;
  tx.novf = 0;
  tx.nr = tx.nn = tx.na = 0;
  return 0;
}

void _keel_ph_tx_forget(keel_pheap_t *ph) {
  if (tx.depth == 0 || tx.ph != ph) return;
  _keel_ph_holds--;
  _keel_ph_tcache_unpin(tx.tc); /* compares pointers; reads nothing of it */
  tx.depth = 0;
  tx.ph = NULL;
  tx.tc = NULL;
  tx.lane = NULL;
  tx.na = tx.nn = tx.nr = 0;
}

int keel_tx_depth(void) {
  return tx.depth;
}

bool _keel_ph_tx_snapshots(keel_pheap_t *ph, const void *p) {
  if (keel_likely(tx.depth == 0) || tx.ph != ph || tx.aborted || tx.committed) return false;
  uint64_t lo = (uint64_t)((const char *)p - ph->view.base), hi = lo + 8;
  for (size_t i = 0; i < tx.nr; i++)
    if (lo < tx.ranges[i].hi && hi > tx.ranges[i].lo) return true;
  return false;
}

bool _keel_ph_tx_new_usable(keel_pheap_t *ph, keel_poff_t off, size_t *usable) {
  if (keel_likely(tx.depth == 0) || tx.ph != ph || tx.aborted || tx.committed) return false;
  for (size_t i = 0; i < tx.nn; i++) {
    if (tx.news[i].off != off) continue;
    *usable = _keel_ph_usable_new(ph, tx.news[i].cls, off);
    return true;
  }
  for (size_t i = 0; i < tx.na; i++) /* a reservation published with the transaction */
    if (tx.acts[i].kind == PH_ACT_RESERVE && tx.acts[i].off == off) {
      *usable = _keel_ph_usable_new(ph, (int)tx.acts[i].cls, off);
      return true;
    }
  return false;
}

/* The bytes of this transaction's new object i that commit makes durable
 * (flush_new_objects): its requested size, from its header. Not the usable
 * size: the tail past the request is not flushed (so a range there is
 * snapshotted like any other), and a huge object's chunk word, which gives
 * its usable size, is written only at commit. */
static uint64_t obj_end(keel_poff_t o) {
  return o + ((const ph_objhdr_t *)(tx.ph->view.base + o - PH_OBJ_HDR))->size;
}

static uint64_t new_end(size_t i) {
  return obj_end(tx.news[i].off);
}

static bool in_new(uint64_t lo, uint64_t hi) {
  for (size_t i = 0; i < tx.nn; i++)
    if (lo >= tx.news[i].off && hi <= new_end(i)) return true;
  return false;
}

/* A block for the undo chain: one the lane kept, or a fresh reservation once
 * the watermark has passed every log drawn before it (see the file comment). */
static int ovf_take(keel_poff_t *off) {
  keel_pheap_t *ph = tx.ph;
  ph_lane_t *l = tx.lane;
  if (l->nkeep) {
    *off = l->keep[--l->nkeep];
    return 0;
  }
  int rc = _keel_ph_take_chunks(ph, tx.tc, PH_OVF_BYTES + PH_OBJ_HDR, off);
  if (rc) return rc;
  /* Only _keel_ph_give reads it (the chunk word stays 0: free on media). */
  ((ph_objhdr_t *)(ph->view.base + *off - PH_OBJ_HDR))->size = PH_OVF_BYTES;
  /* Every log that could name the block was drawn before we took it (its
   * free returned first); seq_cst: read after the take. Our lane is not in
   * flight, so the checkpoints below do not wait on us. */
  _keel_ph_checkpoint_past(ph, tx.tc, atomic_load(&ph->seq));
  return 0;
}

/* Chains a new overflow block after the current segment: its header and the
 * link are durable (1 barrier) before any entry goes into it. */
static int undo_extend(void) {
  keel_pheap_t *ph = tx.ph;
  keel_poff_t off;
  if (grow((void **)&tx.ovf, &tx.ovfcap, tx.novf + 1, sizeof *tx.ovf)) return KEEL_ENOMEM;
  int rc = ovf_take(&off);
  if (rc) return rc;
  ph_undo_ovf_t *b = keel_pheap_ptr(ph, off);
  ph_undo_ovf_t h = {.seq = tx.seq, .next = 0, .cap = PH_OVF_CAP};
  _keel_pm_write_nt(ph, tx.tc, b, &h, sizeof h, PH_S_UNDO_OVF);
  _keel_pm_write_nt(ph, tx.tc, tx.link, &off, 8, PH_S_UNDO_LINK);
  _keel_pm_drain(ph, tx.tc);
  tx.ovf[tx.novf++] = off;
  tx.link = &b->next;
  tx.seg = b->data;
  tx.seg_cap = PH_OVF_CAP;
  tx.undo_pos = 0;
  return 0;
}

/* Writes one entry of len bytes (it fits the segment) and flushes it. */
static void undo_entry(uint64_t off, uint64_t len) {
  keel_pheap_t *ph = tx.ph;
  /* Entry header and data go out with non-temporal stores where the mode
   * allows (no flush, no cache pollution by the copy); the last partial
   * word of the data is padded through a bounce word. */
  ph_undo_entry_t *e = (ph_undo_entry_t *)(tx.seg + tx.undo_pos);
  ph_undo_entry_t h = {off, len, 0};
  uint64_t body = len & ~(uint64_t)7, tail = 0;
  memcpy(&tail, ph->view.base + off + body, len - body);
  /* The checksum covers exactly len bytes, as rollback reads them. */
  h.csum = _keel_ph_csum(ph->view.base + off, len, tx.seq * 0xc2b2ae3d27d4eb4full ^ off * 31 ^ len);
  _keel_pm_write_nt(ph, tx.tc, e, &h, sizeof h, PH_S_UNDO);
  if (body) _keel_pm_write_nt(ph, tx.tc, e + 1, ph->view.base + off, body, PH_S_UNDO_BODY);
  if (len > body) _keel_pm_write_nt(ph, tx.tc, (char *)(e + 1) + body, &tail, 8, PH_S_UNDO_TAIL);
  tx.undo_pos += sizeof *e + KEEL_ALIGN_UP(len, (uint64_t)8);
}

/* Appends a snapshot of [off, off + len) to the undo log, split across
 * segments as they fill, and flushes it (the caller drains). */
static int undo_append(uint64_t off, uint64_t len) {
  keel_pheap_t *ph = tx.ph;
  ph_undo_t *u = tx.lane->undo;
  if (!tx.undo_started) {
    /* seq and an empty link in one line: a stale link from an older
     * transaction would fail the block's seq check anyway. */
    uint64_t hw[2] = {tx.seq = _keel_ph_next_seq(ph), 0};
    _keel_pm_write_nt(ph, tx.tc, &u->seq, hw, sizeof hw, PH_S_UNDO_START);
    tx.undo_started = true;
  }
  if (keel_unlikely(_keel_ph_fault == PH_S_SNAPSHOT)) return 0;
  while (len) {
    /* Room for an entry header and at least one word, else a new segment. */
    uint64_t room = tx.seg_cap - tx.undo_pos;
    if (room < sizeof(ph_undo_entry_t) + 8) {
      int rc = undo_extend();
      if (rc) return rc;
      continue;
    }
    uint64_t piece = KEEL_ALIGN_DOWN(room - sizeof(ph_undo_entry_t), (uint64_t)8);
    if (piece > len) piece = len;
    undo_entry(off, piece);
    off += piece;
    len -= piece;
  }
  return 0;
}

int keel_tx_add_range(void *ptr, size_t size) {
  int rc = tx_check();
  if (rc) return rc;
  keel_pheap_t *ph = tx.ph;
  if (size == 0) return 0;
  /* Compared as offsets: ptr + size may wrap. */
  if ((char *)ptr < ph->view.base + ph->hdr->heap_off ||
      (char *)ptr > ph->view.base + keel_load_relaxed(&ph->size) ||
      size > (size_t)(ph->view.base + keel_load_relaxed(&ph->size) - (char *)ptr))
    return tx_fail(KEEL_REJECT(KEEL_EINVAL, "keel_tx_add_range",
                               "%p + %zu bytes is not inside the heap of %s", ptr, size, ph->path));
  uint64_t lo = (uint64_t)((char *)ptr - ph->view.base), hi = lo + size;
  if (in_new(lo, hi)) return 0;
  /* First cached range ending after lo. */
  size_t a = 0, b = tx.nr;
  while (a < b) {
    size_t m = (a + b) / 2;
    if (tx.ranges[m].hi <= lo)
      a = m + 1;
    else
      b = m;
  }
  uint64_t cur = lo;
  bool added = false;
  size_t i = a;
  for (; i < tx.nr && tx.ranges[i].lo < hi; i++) {
    if (tx.ranges[i].lo > cur) {
      if ((rc = undo_append(cur, tx.ranges[i].lo - cur)) != 0) return tx_fail(rc);
      added = true;
    }
    if (tx.ranges[i].hi > cur) cur = tx.ranges[i].hi;
  }
  if (cur < hi) {
    if ((rc = undo_append(cur, hi - cur)) != 0) return tx_fail(rc);
    added = true;
  }
  if (!added) return 0;
  /* Merge [lo, hi) with ranges a..i-1 (those it overlaps). */
  uint64_t nlo = lo, nhi = hi;
  if (a < i && tx.ranges[a].lo < nlo) nlo = tx.ranges[a].lo;
  if (a < i && tx.ranges[i - 1].hi > nhi) nhi = tx.ranges[i - 1].hi;
  if (a == i) {
    if (grow((void **)&tx.ranges, &tx.rcap, tx.nr + 1, sizeof *tx.ranges))
      return tx_fail(KEEL_ENOMEM);
    memmove(tx.ranges + a + 1, tx.ranges + a, (tx.nr - a) * sizeof *tx.ranges);
    tx.nr++;
  } else if (i - a > 1) {
    memmove(tx.ranges + a + 1, tx.ranges + i, (tx.nr - i) * sizeof *tx.ranges);
    tx.nr -= i - a - 1;
  }
  tx.ranges[a] = (tx_range_t){nlo, nhi};
  _keel_pm_drain(ph, tx.tc);
  return 0;
}

static keel_poff_t tx_alloc_common(size_t size, uint64_t type, bool zero) {
  int rc = tx_check();
  if (rc == 0 && grow((void **)&tx.news, &tx.ncap, tx.nn + 1, sizeof *tx.news))
    rc = tx_fail(KEEL_ENOMEM);
  int cls;
  keel_poff_t off = 0;
  if (rc == 0 && (rc = _keel_ph_take(tx.ph, tx.tc, size, &cls, &off)) != 0) tx_fail(rc);
  if (rc != 0) {
    errno = -rc;
    return 0;
  }
  _keel_ph_init_obj(tx.ph, off, size, type, zero);
  tx.news[tx.nn++] = (tx_new_t){off, cls};
  return off;
}

keel_poff_t keel_tx_alloc(size_t size, uint64_t type) {
  return tx_alloc_common(size, type, false);
}
keel_poff_t keel_tx_zalloc(size_t size, uint64_t type) {
  return tx_alloc_common(size, type, true);
}

int keel_tx_free(keel_poff_t off) {
  int rc = tx_check();
  if (rc || off == 0) return rc;
  for (size_t i = 0; i < tx.nn; i++) {
    if (tx.news[i].off != off) continue;
    _keel_ph_give(tx.ph, tx.tc, tx.news[i].cls, off); /* never durable: just drop it */
    tx.news[i] = tx.news[--tx.nn];
    return 0;
  }
  /* The block stays allocated until commit, so the live check passes
   * twice (commit would also catch it, later and under another name). */
  for (size_t i = 0; i < tx.na; i++)
    if (tx.acts[i].kind == PH_ACT_FREE && tx.acts[i].off == off)
      keel_die("keel_tx_free", "offset 0x%llx is freed twice in one transaction on %s",
               (unsigned long long)off, tx.ph->path);
  if (grow((void **)&tx.acts, &tx.acap, tx.na + 1, sizeof *tx.acts)) return tx_fail(KEEL_ENOMEM);
  keel_pheap_defer_free(tx.ph, &tx.acts[tx.na++], off);
  return 0;
}

int keel_tx_publish(keel_pheap_act_t *acts, size_t n) {
  int rc = tx_check();
  if (rc) return rc;
  if (grow((void **)&tx.acts, &tx.acap, tx.na + n, sizeof *tx.acts)) return tx_fail(KEEL_ENOMEM);
  for (size_t i = 0; i < n; i++) {
    if (acts[i].kind == PH_ACT_NONE) continue;
    tx.acts[tx.na++] = acts[i];
    acts[i].kind = PH_ACT_NONE; /* the transaction owns it now */
  }
  return 0;
}

static bool covered(uint64_t off) {
  for (size_t i = 0; i < tx.novf; i++)
    if (off >= tx.ovf[i] - PH_OBJ_HDR && off < tx.ovf[i] + PH_OVF_BYTES) return true;
  for (size_t i = 0; i < tx.nr; i++)
    if (off >= tx.ranges[i].lo && off < tx.ranges[i].hi) return true;
  for (size_t i = 0; i < tx.nn; i++) {
    if (off >= tx.news[i].off - PH_OBJ_HDR && off < new_end(i)) return true;
  }
  for (size_t i = 0; i < tx.na; i++) {
    /* A reservation's extent as commit flushes it (see new_end). */
    if (tx.acts[i].kind != PH_ACT_RESERVE) continue;
    if (off >= tx.acts[i].off - PH_OBJ_HDR && off < obj_end(tx.acts[i].off)) return true;
  }
  return false;
}

/* Simulated media only: bytes that differ between the mapping and the file
 * outside the logs and this transaction's ranges and objects were stored
 * without keel_tx_add_range (single-threaded tests). */
static void stray_check(void) {
  keel_pheap_t *ph = tx.ph;
  uint64_t size = keel_load_relaxed(&ph->size), heap = ph->hdr->heap_off;
  char buf[4096];
  for (uint64_t off = heap; off < size; off += sizeof buf) {
    if (pread(ph->fd, buf, sizeof buf, (off_t)off) != (ssize_t)sizeof buf) return;
    if (memcmp(buf, ph->view.base + off, sizeof buf) == 0) continue;
    for (uint64_t j = 0; j < sizeof buf; j++)
      if (buf[j] != ph->view.base[off + j] && !covered(off + j)) _keel_ph_stray_bytes++;
  }
}

/* Names [off, off + len) in the commit log: a CHK entry while the checksum
 * budget lasts, then COVER entries of the whole words (the caller then
 * orders the data with a barrier). False once the log has no room left. */
static bool name_range(ph_redo_entry_t *e, size_t *k, uint64_t off, uint64_t len, uint64_t *chk,
                       bool *vouched) {
  if (*vouched && _keel_ph_chk_add(e, k, PH_REDO_MAX, off, len, chk)) return true;
  *vouched = false;
  if (*k == PH_REDO_MAX) return false;
  uint64_t lo = KEEL_ALIGN_DOWN(off, (uint64_t)8);
  e[(*k)++] = (ph_redo_entry_t){lo | PH_OP_COVER, KEEL_ALIGN_UP(off + len, (uint64_t)8) - lo};
  return true;
}

/* The header of the i-th object this transaction created (tx_alloc'ed, or
 * reserved and published with it), or NULL where act i is no reservation. */
static const ph_objhdr_t *new_object(keel_pheap_t *ph, size_t i) {
  keel_poff_t off;
  if (i < tx.nn)
    off = tx.news[i].off;
  else if (tx.acts[i - tx.nn].kind == PH_ACT_RESERVE)
    off = tx.acts[i - tx.nn].off;
  else
    return NULL;
  return (const ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR);
}

/* Words of a new object's body: its requested size, whole words. */
static uint64_t body_words_of(const ph_objhdr_t *h) {
  return KEEL_ALIGN_UP(h->size, (uint64_t)8) / 8;
}

/* Where the word at `off` lies in the objects this transaction created. */
enum { NEW_NONE, NEW_HEADER, NEW_BODY };
static int new_object_part(keel_pheap_t *ph, uint64_t off) {
  for (size_t i = 0; i < tx.nn + tx.na; i++) {
    const ph_objhdr_t *h = new_object(ph, i);
    if (h == NULL) continue;
    uint64_t lo = (uint64_t)((const char *)h - ph->view.base);
    if (off >= lo && off < lo + PH_OBJ_HDR) return NEW_HEADER;
    if (off >= lo + PH_OBJ_HDR && off < lo + PH_OBJ_HDR + 8 * body_words_of(h)) return NEW_BODY;
  }
  return NEW_NONE;
}

/* Names every object this transaction created in the commit log, so
 * recovery replays no older log's store into its body. Returns whether
 * there was one; *named turns false once the log has no room left. */
static bool name_new_objects(keel_pheap_t *ph, ph_redo_entry_t *e, size_t *k, uint64_t *chk,
                             bool *vouched, bool *named) {
  bool any = false;
  for (size_t i = 0; i < tx.nn + tx.na; i++) {
    const ph_objhdr_t *h = new_object(ph, i);
    if (h == NULL) continue;
    if (*named)
      *named = name_range(e, k, (uint64_t)((const char *)h - ph->view.base), PH_OBJ_HDR + h->size,
                          chk, vouched);
    any = true;
  }
  return any;
}

/* Flushes those objects, header and body. Each header is read before its
 * own flush: CLWB may evict the line (it does on AMD), and reading it after
 * costs a trip to memory (a fifth of tx-alloc). */
static void flush_new_objects(keel_pheap_t *ph, ph_tcache_t *tc) {
  for (size_t i = 0; i < tx.nn + tx.na; i++) {
    const ph_objhdr_t *h = new_object(ph, i);
    if (h != NULL) _keel_pm_flush(ph, tc, h, PH_OBJ_HDR + h->size, PH_S_TXNEW);
  }
}

/* Drops from e, in place, the entries that rewrite the headers of the
 * objects tx_alloc'ed in this transaction (each object's publish entries
 * lead the log, headers first: _keel_ph_publish_entries), and the `nbody`
 * body entries that follow them (carry_bodies), and returns how many are
 * left to apply. Those words already hold the values (the allocation and
 * the caller wrote them, and flush_new_objects made them durable no later
 * than the commit log): the entries are there for replay only. Applying
 * them would store to a line the flush just evicted (CLWB does on AMD), and
 * the next locked instruction would wait for that line to come back from
 * memory (4% of tx-alloc here). The log was written before this, whole.
 * Reservations published with the transaction and the caller's own SETs are
 * applied, but for SETs into carried bodies, stored before the bodies were
 * read. */
static size_t to_apply(keel_pheap_t *ph, ph_redo_entry_t *e, size_t n, size_t nbody) {
  size_t m = 0, lead = tx.nn * PH_PUBLISH_ENTRIES;
  for (size_t i = 0; i < lead; i += PH_PUBLISH_ENTRIES)
    for (size_t j = PH_PUBLISH_HDR_ENTRIES; j < PH_PUBLISH_ENTRIES; j++) e[m++] = e[i + j];
  for (size_t i = lead + nbody; i < n; i++)
    if (nbody == 0 || (e[i].off_op & 7) != PH_OP_SET ||
        new_object_part(ph, e[i].off_op & ~(uint64_t)7) != NEW_BODY) /* stored early */
      e[m++] = e[i];
  return m;
}

/* Words of the new objects' bodies (requested sizes, whole words) if the
 * commit log can carry them all as SET entries next to its other `k`
 * entries, within PH_TX_BODY_BYTES; else 0. */
static size_t body_words(keel_pheap_t *ph, size_t k) {
  size_t words = 0;
  for (size_t i = 0; i < tx.nn + tx.na; i++) {
    const ph_objhdr_t *h = new_object(ph, i);
    if (h == NULL) continue;
    words += body_words_of(h);
    if (words * 8 > PH_TX_BODY_BYTES) return 0;
  }
  return k + words <= PH_REDO_MAX ? words : 0;
}

/* A transaction that snapshot nothing and created small objects: their
 * bodies go into the commit log as SET entries, between the new objects'
 * publish entries and the queued actions, so one barrier makes the log and
 * the flushed bodies durable together. A crash that let the log reach the
 * media before a body line did replays the body from the log; replay in seq
 * order lets any later log's store into the object win, and a plain store
 * made durable with keel_pheap_persist retires this log first. Queued SETs
 * into the new objects are made before the bodies are read, so the log's
 * values are the final ones; their own entries follow and store the same.
 * Inserts `nbody` entries at e[lead]; returns the new count. */
static size_t carry_bodies(keel_pheap_t *ph, ph_redo_entry_t *e, size_t k, size_t nbody) {
  /* Only into bodies: a SET into a new object's header (misuse) would change
   * the size that body_words counted. */
  for (size_t i = 0; i < tx.na; i++)
    if (tx.acts[i].kind == PH_ACT_SET &&
        new_object_part(ph, (uint64_t)((char *)tx.acts[i].dest - ph->view.base)) == NEW_BODY)
      *tx.acts[i].dest = tx.acts[i].value;
  size_t lead = tx.nn * PH_PUBLISH_ENTRIES, at = lead;
  memmove(e + lead + nbody, e + lead, (k - lead) * sizeof *e);
  for (size_t i = 0; i < tx.nn + tx.na; i++) {
    const ph_objhdr_t *h = new_object(ph, i);
    if (h == NULL) continue;
    const uint64_t *w = (const uint64_t *)(const void *)(h + 1);
    uint64_t off = (uint64_t)((const char *)w - ph->view.base);
    uint64_t words = body_words_of(h);
    if (words > lead + nbody - at) /* its size changed since body_words read it */
      keel_die("keel_tx_commit", "a new object's header in %s changed during the commit", ph->path);
    for (uint64_t j = 0; j < words; j++)
      e[at++] = (ph_redo_entry_t){(off + 8 * j) | PH_OP_SET, w[j]};
  }
  if (at != lead + nbody)
    keel_die("keel_tx_commit", "a new object's header in %s changed during the commit", ph->path);
  return k + nbody;
}

/* A commit log that cannot name every range it covers: instead, the
 * watermark passes every older log, so recovery replays none of their
 * stores into our ranges. A plain checkpoint stops below an older operation
 * still in flight (whose log may store into a block we took since), so this
 * waits for them; our seq is drawn, and no operation in flight waits on the
 * watermark for anything newer than itself, so the oldest always finishes.
 * Then our own flushes are drained (the checkpoint may have been another's). */
static void retire_older(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t seq) {
  _keel_ph_checkpoint_past(ph, tc, seq - 1);
  _keel_pm_drain(ph, tc);
}

static int tx_commit_outer(void) {
  keel_pheap_t *ph = tx.ph;
  ph_tcache_t *tc = tx.tc;
  if (keel_unlikely(_keel_ph_stray_check) && ph->sim) stray_check();
  /* A queued store into a word that a snapshot range covers only in part:
   * the rest of the word is snapshotted now (its bytes are as before the
   * transaction), so the early store below, and any rollback, treat the
   * word whole. Else the store, made by the apply after the commit log's
   * checksum, could reach the media while the undo log still stands, and
   * recovery, taking the commit for torn, rolled back half the word. */
  for (size_t i = 0; i < tx.na; i++) {
    if (tx.acts[i].kind != PH_ACT_SET) continue;
    uint64_t off = (uint64_t)((char *)tx.acts[i].dest - ph->view.base);
    /* The header of an object this transaction created: the commit reads
     * its size (flush extents, carried bodies) and would go by a value the
     * caller chose. */
    if (new_object_part(ph, off) == NEW_HEADER)
      return tx_fail(KEEL_REJECT(KEEL_EINVAL, "keel_tx_commit",
                                 "queued destination %p is the header of an object created in "
                                 "this transaction (pool %s)",
                                 (void *)tx.acts[i].dest, ph->path));
    unsigned n = 0;
    for (unsigned b = 0; b < 8; b++) n += covered(off + b);
    if (n != 0 && n != 8) {
      int rc = keel_tx_add_range(tx.acts[i].dest, 8);
      if (rc) return rc; /* the transaction is aborted already */
    }
  }
  ph_redo_entry_t e[PH_REDO_MAX];
  size_t k = 0;
  if (tx.nn > PH_REDO_MAX / PH_PUBLISH_ENTRIES) return tx_fail(KEEL_ENOSPC);
  /* Header words too, not just the bit: an older log of an allocation of the
   * same block (freed since) may still be above the watermark, and its
   * replay rewrites the header; ours must come after it. */
  for (size_t i = 0; i < tx.nn; i++)
    k += _keel_ph_publish_entries(ph, tx.news[i].cls, tx.news[i].off, e + k);
  long m = _keel_ph_acts_entries(ph, tx.acts, tx.na, e + k, PH_REDO_MAX - k, "keel_tx_commit");
  if (m < 0) return tx_fail(KEEL_ENOSPC);
  k += (size_t)m;
  if (k == 0 && !tx.undo_started) {
    tx.committed = true;
    ph_tc_count(&tx.tc->tx_commits);
    return 0;
  }
  size_t nbody = tx.undo_started ? 0 : body_words(ph, k);
  if (nbody != 0) {
    /* Nothing snapshot, small new objects: one barrier (carry_bodies). */
    k = carry_bodies(ph, e, k, nbody);
    uint64_t seq = _keel_ph_log_seq(ph, tc, tx.lane, k); /* before the flushes (pheap_int.h) */
    flush_new_objects(ph, tc);
    _keel_ph_log_write(ph, tc, tx.lane, seq, 0, e, k);
    _keel_pm_drain(ph, tc); /* committed, the bodies durable */
    _keel_ph_log_apply(ph, tc, tx.lane, e, to_apply(ph, e, k, nbody), true);
  } else if (!tx.undo_started) {
    /* Nothing snapshot: flush the new objects, order them with a barrier,
     * then log like an atomic operation (deferred apply, log.c), naming them
     * (COVER) so recovery replays no older store into their bodies. */
    bool vouched = false, named = true;
    uint64_t chk = 0;
    bool data = name_new_objects(ph, e, &k, &chk, &vouched, &named);
    uint64_t seq = _keel_ph_log_seq(ph, tc, tx.lane, k); /* before the flushes (pheap_int.h) */
    flush_new_objects(ph, tc);
    if (!named)
      retire_older(ph, tc, seq);
    else if (data)
      _keel_pm_drain(ph, tc);
    _keel_ph_log_write(ph, tc, tx.lane, seq, 0, e, k);
    _keel_pm_drain(ph, tc); /* committed */
    _keel_ph_log_apply(ph, tc, tx.lane, e, to_apply(ph, e, k, 0), true);
  } else {
    /* The new bytes must be durable no later than the commit log: the log
     * vouches for them by checksum (CHK entries), or past the budget a
     * barrier orders them first. Either way the log names every range
     * (CHK or COVER) so that recovery replays no older log's store over
     * them; if the log cannot name them all, retire_older retires the
     * older logs instead. */
    uint64_t chk = 0;
    bool vouched = true, named = true;
    /* Queued stores into bytes the log vouches for (a snapshot range or a
     * new object) are made now, before the checksum is taken: made by the
     * apply after it, they would change vouched-for bytes, and a crash once
     * they reached the media but before the undo log was emptied would make
     * recovery take the commit log for a torn one and roll the snapshots
     * back under the replayed allocation changes. The undo log (or the
     * object's being new) covers them until the commit is durable. */
    for (size_t i = 0; i < tx.na; i++)
      if (tx.acts[i].kind == PH_ACT_SET &&
          covered((uint64_t)((char *)tx.acts[i].dest - ph->view.base)))
        *tx.acts[i].dest = tx.acts[i].value;
    for (size_t i = 0; i < tx.nr && named; i++)
      named = name_range(e, &k, tx.ranges[i].lo, tx.ranges[i].hi - tx.ranges[i].lo, &chk, &vouched);
    name_new_objects(ph, e, &k, &chk, &vouched, &named);
    uint64_t seq = _keel_ph_log_seq(ph, tc, tx.lane, k); /* before the flushes (pheap_int.h) */
    for (size_t i = 0; i < tx.nr; i++)
      _keel_pm_flush(ph, tc, ph->view.base + tx.ranges[i].lo, tx.ranges[i].hi - tx.ranges[i].lo,
                     PH_S_TXDATA);
    flush_new_objects(ph, tc);
    if (!named)
      retire_older(ph, tc, seq);
    else if (!vouched)
      _keel_pm_drain(ph, tc);
    _keel_ph_log_write(ph, tc, tx.lane, seq, tx.seq, e, k);
    _keel_pm_drain(ph, tc); /* committed */
    /* Applied, flushed and the undo log emptied before commit returns: from
     * then on recovery replays this log whatever its data (log.c). */
    _keel_ph_log_apply(ph, tc, tx.lane, e, to_apply(ph, e, k, 0), false);
    uint64_t zero = 0; /* non-temporal: the line is not re-read until the next tx */
    _keel_pm_write_nt(ph, tc, &tx.lane->undo->seq, &zero, 8, PH_S_UNDO_INV);
    _keel_pm_drain(ph, tc);
    /* Only now may the watermark pass the commit log: recovery finds a
     * still-valid undo log's commit only above it (log.c). */
    _keel_ph_log_end(tc, tx.lane);
    ovf_release();
  }
  tx.undo_started = false;
  _keel_ph_acts_done(ph, tc, tx.acts, tx.na);
  tx.na = tx.nn = tx.nr = 0;
  tx.committed = true;
  ph_tc_count(&tx.tc->tx_commits);
  return 0;
}

int keel_tx_commit(void) {
  int rc = tx_check();
  if (rc) return tx.depth && tx.aborted ? tx.err : rc;
  if (tx.depth > 1) return 0;
  return tx_commit_outer();
}

void keel_tx_abort(int err) {
  if (tx.depth == 0) return;
  tx_not_forked("keel_tx_abort");
  tx_fail(err < 0 ? err : KEEL_ECANCELED);
}

int keel_tx_end(void) {
  if (tx.depth == 0) return KEEL_EPERM;
  tx_not_forked("keel_tx_end");
  if (--tx.depth > 0) return tx.aborted ? tx.err : 0;
  if (!tx.committed && !tx.aborted) tx_fail(KEEL_ECANCELED);
  int rc = tx.committed ? 0 : tx.err;
  keel_store_relaxed(&tx.tc->tx_lane, NULL);
  _keel_ph_lane_put(tx.tc, tx.lane);
  _keel_ph_holds--;
  _keel_ph_tcache_unpin(tx.tc);
  tx.ph = NULL;
  tx.tc = NULL;
  tx.lane = NULL;
  /* Keep the arrays for the next transaction unless one grew large. */
  if (tx.rcap > 1024) {
    free(tx.ranges);
    tx.ranges = NULL;
    tx.rcap = 0;
  }
  if (tx.ncap > 1024) {
    free(tx.news);
    tx.news = NULL;
    tx.ncap = 0;
  }
  if (tx.acap > 1024) {
    free(tx.acts);
    tx.acts = NULL;
    tx.acap = 0;
  }
  if (tx.ovfcap > 1024) {
    free(tx.ovf);
    tx.ovf = NULL;
    tx.ovfcap = 0;
  }
  return rc;
}
