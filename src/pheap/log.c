/* pheap logs: lanes, redo log rings, checkpoints, recovery.
 *
 * Every change to allocation state (run bitmap words, huge chunk words,
 * object headers) and every destination store of an atomic operation is
 * written first as a redo log: a header {seq, tx, n, dsum, csum} and entries
 * "word op= value", with a checksum covering them. Logs go into the lane's
 * ring with non-temporal stores, and one barrier makes the log durable: from
 * then on the operation has happened, because recovery replays it.
 *
 * Atomic operations (alloc, free, publish) then apply the entries in the
 * cache and do NOT flush them: the lines are recorded in the lane's dirty
 * list, and a checkpoint flushes every lane's recorded lines at once, drains,
 * then stores and persists the watermark ckpt_seq: every log at or below it
 * has its effects durable and is ignored by recovery. So an atomic operation
 * costs 1 barrier, and a checkpoint (2 barriers, however many lines) is paid
 * once per ring wrap or full dirty list (each 30-60 operations of a lane).
 * With a deferrer (keel_pheap_set_deferrer) a lane past half its ring or
 * dirty list asks for a checkpoint on the application's worker (one request
 * outstanding per pool), so the wrap usually finds the watermark already
 * past its ring and the lanes stop only when the worker falls behind. The
 * dependency stays one way: pheap calls a function pointer, never sched.
 *
 * Why replaying logs above the watermark in seq order is correct: replay is
 * idempotent (OR, AND-NOT, SET of the same values), and an operation that
 * conflicts with another (frees what it allocated, changes the destination)
 * starts after the first returned, so it has a larger seq; both logs stay in
 * their rings until a checkpoint covers both (a ring is reused only once the
 * watermark covers all its logs), so the later one is replayed after. Writers
 * that change chunk words without a log (run creation) checkpoint first.
 *
 * The watermark: W = min(counter, oldest in-flight seq - 1). A lane announces
 * a lower bound of its seq before drawing it, so a checkpoint that reads the
 * counter and then sees no lane in flight knows every seq up to the counter
 * belongs to a finished operation whose lines are in a dirty list. A commit
 * log stays in flight until its undo log is emptied and that is durable:
 * recovery keeps a transaction only through a commit log above W, so a W
 * that passed the log while the undo log was still valid would roll back a
 * transaction whose allocation state was already applied and flushed (a
 * tx_alloc'd block left allocated with its destination restored to 0, or a
 * tx_free'd block left free with the destination still naming it).
 *
 * The counter is the one line every operation writes (one fetch-add per
 * log), and so what two threads share: 0 to 120 ns per operation on the
 * 2-vCPU build host, depending on where the host places the vCPUs (stop 15).
 * Per-lane Lamport clocks would remove it, but replay order must then follow
 * every causal chain the application makes, e.g. a destination store into
 * an object that another thread then frees and a third reallocates (its
 * COVER must replay after the store): the clock would have to travel with
 * the block holding any destination word. Not done; it is a protocol change.
 *
 * Transactions commit with a ring log too. One that snapshot nothing logs
 * like an atomic operation; its log carries its new objects' bodies as SET
 * entries when they are small (one barrier makes both durable), else a
 * barrier orders the bodies before the log, which names them (COVER). Those
 * SETs replay like any other: a later log's store wins by seq, a later
 * transaction's CHK or COVER range keeps them out, and a plain store made
 * durable with keel_pheap_persist retires them first. One with an undo log writes a commit log (tx = the undo log's
 * seq) whose CHK entries vouch for the new data by checksum, then applies and
 * flushes at once and empties the undo log: 2 barriers. Its log still pins
 * the ring until a checkpoint passes it, like every log (see log_write), so
 * a lane doing only transactions pays a checkpoint per ring wrap.
 *
 * Recovery at open: (1) logs above the watermark, except a commit log that
 * tore (its CHK data does not match while its undo log is still there), and
 * undo logs whose transaction has no such valid commit log are collected
 * (a torn commit log is retired: its seq zeroed); (2) processed in seq
 * order: logs replayed, undo logs rolled back newest entry first, overflow
 * chain included; (3) barrier; (4) undo logs
 * emptied, barrier; (5) the watermark raised past every log, made durable by
 * open's next barrier, which writes the new epoch in the same line. A crash
 * in recovery leaves the same logs to replay next time.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/die.h"
#include "pheap/pheap_int.h"

#define ATOMIC64(p) ((keel_atomic(uint64_t) *)(void *)(p))

unsigned _keel_ph_ring_limit = PH_RING_LINES;

uint64_t _keel_ph_next_seq(keel_pheap_t *ph) {
  return keel_fetch_add_relaxed(&ph->seq, 1) + 1;
}

__thread unsigned _keel_ph_holds;
__thread unsigned _keel_ph_flying;

void _keel_ph_not_in_flight(keel_pheap_t *ph, const char *call) {
  if (keel_unlikely(_keel_ph_flying))
    keel_die(call,
             "%s: a pool operation from inside another one's commit (a deferrer "
             "must queue its work and return, not call the pool)",
             ph->path);
}

/* Lanes [0, PH_TX_LANES) serve transactions and atomic operations; the
 * last PH_ATOMIC_LANES serve atomic operations only. A thread that holds
 * what others may wait for (_keel_ph_holds: a transaction's lane on some
 * pool, or a root_lock) and finds every lane busy waits on one of those:
 * they are held only by atomic operations, which finish without waiting for
 * a lane (their other waits are for logs already in flight, or for a
 * checkpoint, which waits for nothing else; the deferrer they may call must
 * not block, pheap.h), so its wait ends. Waiting on a transaction's lane
 * instead could close a cycle: a transaction on pool A whose atomic operation on B finds
 * every B lane held by transactions doing the same on A; or a root_lock
 * holder waiting on the lane of a transaction that waits for root_lock.
 * A thread that holds nothing may wait on any lane: it is in no cycle. */
ph_lane_t *_keel_ph_lane_get(keel_pheap_t *ph, ph_tcache_t *tc, bool for_tx) {
  /* This thread has a log in flight: we were called back from inside a
   * pheap operation (a deferrer that runs pool work itself). Going on could
   * wait forever: a ring wrap waits for the watermark, which that log holds
   * below it. */
  (void)tc;
  _keel_ph_not_in_flight(ph, "keel_pheap"); /* any pool's: B's op from A's deferrer too */
  /* An atomic operation inside this thread's transaction logs in the
   * transaction's lane, which is not in flight until its commit. Waiting
   * for a second lane of the same pool while holding one could close a
   * cycle: 64 threads each allocating inside a transaction held every lane
   * and each waited for the next one. */
  ph_lane_t *own = keel_load_relaxed(&tc->tx_lane);
  if (own != NULL) return own;
  unsigned n = for_tx ? PH_TX_LANES : PH_NLANES, h = tc->lane_hint % n;
  for (unsigned i = 0; i < n; i++) {
    ph_lane_t *l = &ph->lanes[(h + i) % n];
    if (pthread_mutex_trylock(&l->lock) == 0) {
      tc->lane_hint = l->idx;
      return l;
    }
  }
  /* More threads than lanes: wait for ours. */
  if (!for_tx && _keel_ph_holds) h = PH_TX_LANES + h % PH_ATOMIC_LANES;
  ph_lane_t *l = &ph->lanes[h];
  pthread_mutex_lock(&l->lock);
  return l;
}

void _keel_ph_lane_put(ph_tcache_t *tc, ph_lane_t *l) {
  if (l != keel_load_relaxed(&tc->tx_lane)) pthread_mutex_unlock(&l->lock);
}

static uint64_t redo_csum(const ph_redo_t *r) {
  uint64_t h = _keel_ph_csum(r, offsetof(ph_redo_t, csum), 0x7265646f);
  return _keel_ph_csum(r->e, r->n * sizeof r->e[0], h);
}

static uint64_t data_sum(keel_pheap_t *ph, const ph_redo_entry_t *e, size_t n) {
  uint64_t h = 0x243f6a8885a308d3ull, size = keel_load_relaxed(&ph->size);
  for (size_t i = 0; i < n; i++) {
    if ((e[i].off_op & 7) != PH_OP_CHK) continue;
    uint64_t off, len;
    ph_chk_range(&e[i], &off, &len);
    if (off > size || len > size - off) return 0; /* cannot match: the data is not there */
    h = _keel_ph_csum(ph->view.base + off, len, h);
  }
  return h;
}

bool _keel_ph_redo_data_ok(keel_pheap_t *ph, const ph_redo_t *r) {
  return data_sum(ph, r->e, r->n) == r->dsum;
}

bool _keel_ph_chk_add(ph_redo_entry_t *e, size_t *n, size_t cap, uint64_t off, uint64_t len,
                      uint64_t *chk_bytes) {
  if (*n == cap || *chk_bytes + len > PH_CHK_MAX_BYTES) return false;
  *chk_bytes += len;
  e[(*n)++] = (ph_redo_entry_t){(off & ~(uint64_t)7) | PH_OP_CHK, PH_CHK_VAL(off, len)};
  return true;
}

const ph_redo_t *_keel_ph_ring_log(const char *ring, unsigned pos, uint64_t above) {
  const ph_redo_t *r = (const ph_redo_t *)(ring + (size_t)pos * PH_LINE);
  if (r->seq <= above || r->n > PH_REDO_MAX ||
      pos * PH_LINE + PH_REDO_HDR + r->n * sizeof r->e[0] > PH_REDO_BYTES)
    return NULL;
  return r->csum == redo_csum(r) ? r : NULL;
}

static unsigned log_lines(size_t n) {
  return (unsigned)((PH_REDO_HDR + n * sizeof(ph_redo_entry_t) + PH_LINE - 1) / PH_LINE);
}

static unsigned ring_limit(unsigned lines) {
  return _keel_ph_ring_limit > lines && _keel_ph_ring_limit <= PH_RING_LINES ? _keel_ph_ring_limit
                                                                             : PH_RING_LINES;
}

uint64_t _keel_ph_log_seq(keel_pheap_t *ph, ph_tcache_t *tc, ph_lane_t *l, size_t n) {
  unsigned lines = log_lines(n);
  if (l->ring_pos + lines > ring_limit(lines)) {
    /* Reuse the ring only once the watermark covers every log in it, so no
     * log above the watermark is ever overwritten (see the file comment).
     * Before the draw: a lane in flight holds the watermark back, and with
     * more threads than CPUs lanes waiting out their wraps in flight held
     * each other back (atomic alloc+free at 64 threads: 2.6x slower). */
    _keel_ph_checkpoint_past(ph, tc, keel_load_relaxed(&l->ring_max_seq));
    l->ring_pos = 0;
  }
  /* Announce a lower bound of our seq before drawing it: the checkpoint
   * reads the counter, then the lanes (seq_cst), so either it sees the bound
   * or we draw a seq above the counter it read. The seq_cst fence orders the
   * relaxed store before the draw (on x86 the locked add already does, and
   * the fence compiles to nothing more). */
  keel_store_relaxed(&l->inflight, keel_load_relaxed(&ph->seq) + 1);
#if !defined(__x86_64__)
  atomic_thread_fence(memory_order_seq_cst);
#endif
  uint64_t seq = atomic_fetch_add(&ph->seq, 1) + 1;
  keel_store_relaxed(&l->inflight, seq);
  tc->flying = true;
  _keel_ph_flying++;
  return seq;
}

void _keel_ph_log_write(keel_pheap_t *ph, ph_tcache_t *tc, ph_lane_t *l, uint64_t seq, uint64_t tx,
                        const ph_redo_entry_t *e, size_t n) {
  unsigned lines = log_lines(n), limit = ring_limit(lines);
  if (keel_unlikely(l->ring_pos + lines > limit)) /* the undo log follows the ring */
    keel_die("keel_pheap log", "a log of %zu entries has no room in its ring (%s)", n, ph->path);
  union {
    ph_redo_t r;
    char b[PH_REDO_BYTES];
  } buf;
  buf.r = (ph_redo_t){.seq = seq, .tx = tx, .n = n, .dsum = data_sum(ph, e, n)};
  memcpy(buf.r.e, e, n * sizeof *e);
  buf.r.csum = redo_csum(&buf.r);
  _keel_pm_write_nt(ph, tc, l->ring + (size_t)l->ring_pos * PH_LINE, &buf,
                    KEEL_ALIGN_UP(PH_REDO_HDR + n * sizeof *e, (size_t)8), PH_S_REDO);
  l->ring_pos += lines;
  /* Every log pins the ring, a transaction's commit log too although its
   * effects are flushed before commit returns: recovery replays whatever
   * valid log above the watermark it finds, and a wrap can overwrite a later
   * log yet leave an earlier one whole further along the ring (when the next
   * log does not fit before the end). Replaying that stale log without the
   * later one that superseded it re-sets a freed block's bit (a leak) or
   * clears the bit of a block reallocated since (a dangling reference).
   * Cost: a lane doing only transactions checkpoints once per ring wrap. */
  keel_store_release(&l->ring_max_seq, seq);
  /* Past half the ring: a background checkpoint now usually spares the
   * wrap above its wait. */
  if (ph->defer && l->ring_pos > limit / 2) _keel_ph_checkpoint_soon(ph);
}

/* A lane's dirty list is shared by the lane's holder, which adds a few lines
 * per operation, and a checkpoint, which copies it out; each holds it for a
 * short loop that takes no other lock (a full list's flush may allocate in
 * simulated media, nothing more). So a spin lock, with one locked
 * instruction per pair where a pthread mutex has two: publish-1 took 195 ns
 * of CPU against 204 with the mutex (5 paired runs). A waiter yields every
 * 128 spins in case the holder lost its CPU (more threads than CPUs), and
 * past 8 yields sleeps 50 us instead: sched_yield lets only threads of its
 * own priority run, and a SCHED_FIFO waiter would otherwise starve a
 * preempted holder of lower priority on its CPU. */
static void dirty_lock(ph_lane_t *l) {
  unsigned spins = 0;
  while (atomic_exchange_explicit(&l->dirty_lock, 1, memory_order_acquire)) {
    while (keel_load_relaxed(&l->dirty_lock)) {
      if (++spins % 128 != 0) {
        keel_cpu_relax();
      } else if (spins <= 8 * 128) {
        sched_yield();
      } else {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
      }
    }
  }
}

static void dirty_unlock(ph_lane_t *l) {
  atomic_store_explicit(&l->dirty_lock, 0, memory_order_release);
}

/* Records lines for the next checkpoint (deduplicated against the recent
 * ones: an allocation burst touches the same bitmap and header lines). */
static void dirty_add(keel_pheap_t *ph, ph_tcache_t *tc, ph_lane_t *l, const uint64_t *lines,
                      unsigned n) {
  bool full = false;
  dirty_lock(l);
  for (unsigned i = 0; i < n; i++) {
    bool seen = false;
    for (unsigned k = l->ndirty > 16 ? l->ndirty - 16 : 0; k < l->ndirty && !seen; k++)
      seen = l->dirty[k] == lines[i];
    if (seen) continue;
    if (l->ndirty == PH_DIRTY_MAX) {
      /* Our op is in flight, so a checkpoint cannot cover it: flush the
       * line now, then let the checkpoint empty the list. */
      _keel_pm_flush(ph, tc, ph->view.base + lines[i], PH_LINE, PH_S_DIRTY_FULL);
      full = true;
      continue;
    }
    l->dirty[l->ndirty++] = lines[i];
  }
  bool half = l->ndirty > PH_DIRTY_MAX / 2;
  dirty_unlock(l);
  if (full)
    _keel_ph_checkpoint(ph, tc);
  else if (half && ph->defer)
    _keel_ph_checkpoint_soon(ph);
}

static uint64_t apply_one(keel_pheap_t *ph, ph_tcache_t *tc, const ph_redo_entry_t *e,
                          bool deferred) {
  uint64_t off = e->off_op & ~(uint64_t)7;
  if ((e->off_op & 7) == PH_OP_CHK || (e->off_op & 7) == PH_OP_COVER) return UINT64_MAX;
  if (off > keel_load_relaxed(&ph->size) - 8) return UINT64_MAX; /* defensive */
  keel_atomic(uint64_t) *w = ATOMIC64(ph->view.base + off);
  switch (e->off_op & 7) {
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
  if (!deferred) _keel_pm_flush(ph, tc, (void *)w, 8, PH_S_APPLY);
  return off & ~(uint64_t)(PH_LINE - 1);
}

void _keel_ph_log_apply(keel_pheap_t *ph, ph_tcache_t *tc, ph_lane_t *l, const ph_redo_entry_t *e,
                        size_t n, bool deferred) {
  uint64_t lines[16];
  unsigned nl = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t line = apply_one(ph, tc, &e[i], deferred);
    if (!deferred || line == UINT64_MAX) continue;
    if (nl && lines[nl - 1] == line) continue;
    lines[nl++] = line;
    if (nl == 16) {
      dirty_add(ph, tc, l, lines, nl);
      nl = 0;
    }
  }
  if (nl) dirty_add(ph, tc, l, lines, nl);
  /* Release: a checkpoint that sees us done also sees our dirty lines. */
  if (deferred) {
    keel_store_release(&l->inflight, 0);
    tc->flying = false;
    _keel_ph_flying--;
  }
}

void _keel_ph_log_end(ph_tcache_t *tc, ph_lane_t *l) {
  keel_store_release(&l->inflight, 0);
  tc->flying = false;
  _keel_ph_flying--;
}

bool _keel_ph_deferred(keel_pheap_t *ph) {
  uint64_t w = keel_load_acquire(&ph->ckpt_seq);
  for (unsigned i = 0; i < PH_NLANES; i++)
    if (keel_load_acquire(&ph->lanes[i].ring_max_seq) > w) return true;
  return false;
}

/* Takes ckpt_lock, or returns false as soon as the watermark reaches `need`
 * (0: never). Lanes doing the same work wrap at the same pace, so a lane
 * that needs a checkpoint often finds another lane's running: blocking on
 * the futex then cost a sleep per wrap (600 in a quarter second of
 * publish-1 at 2 threads), and in a virtual machine the idle CPU's wake-up
 * takes tens of microseconds, which made runs swing by a third. A checkpoint
 * ends in microseconds, so a waiter first spins, reading the busy hint
 * rather than writing the lock word, for at most PH_CKPT_SPIN_NS; past that
 * (the holder was preempted: more threads than CPUs) it blocks. */
#define PH_CKPT_SPIN_NS 10000u
static inline bool ckpt_covers(keel_pheap_t *ph, uint64_t need) {
  return need && keel_load_acquire(&ph->ckpt_seq) >= need;
}

static bool ckpt_enter(keel_pheap_t *ph, uint64_t need) {
  if (pthread_mutex_trylock(&ph->ckpt_lock) == 0) goto locked;
  /* One spinner at a time: with more threads than CPUs, the others would
   * spin while the holder waits for a CPU. */
  uint32_t idle = 0;
  if (atomic_compare_exchange_strong(&ph->ckpt_spinner, &idle, 1)) {
    uint64_t until = keel_clock_ns() + PH_CKPT_SPIN_NS;
    for (unsigned i = 1;; i++) {
      if (!keel_load_relaxed(&ph->ckpt_busy) && pthread_mutex_trylock(&ph->ckpt_lock) == 0) {
        keel_store_relaxed(&ph->ckpt_spinner, 0);
        goto locked;
      }
      if (ckpt_covers(ph, need) || (i % 64 == 0 && keel_clock_ns() > until)) break;
      keel_cpu_relax();
    }
    keel_store_relaxed(&ph->ckpt_spinner, 0);
  }
  if (ckpt_covers(ph, need)) return false;
  pthread_mutex_lock(&ph->ckpt_lock);
  if (ckpt_covers(ph, need)) { /* the one we waited out did it */
    pthread_mutex_unlock(&ph->ckpt_lock);
    return false;
  }
locked:
  keel_store_relaxed(&ph->ckpt_busy, 1);
  return true;
}

static void ckpt_exit(keel_pheap_t *ph) {
  keel_store_relaxed(&ph->ckpt_busy, 0);
  pthread_mutex_unlock(&ph->ckpt_lock);
}

/* The checkpoint itself; ckpt_lock held. */
static void checkpoint_locked(keel_pheap_t *ph, ph_tcache_t *tc) {
  uint64_t w = atomic_load(&ph->seq);
  atomic_thread_fence(memory_order_seq_cst); /* the counter, then the lanes */
  for (unsigned i = 0; i < PH_NLANES; i++) {
    uint64_t f = atomic_load(&ph->lanes[i].inflight);
    if (f && f - 1 < w) w = f - 1;
  }
  /* Each lane's list is copied out and emptied under its lock and flushed
   * after: the lane's thread adds to it on every atomic operation and would
   * otherwise wait out up to PH_DIRTY_MAX line flushes (a futex sleep each
   * time a background checkpoint passed). Lines added after the copy belong
   * to operations the watermark does not cover (it was read first). */
  uint64_t lines[PH_DIRTY_MAX];
  for (unsigned i = 0; i < PH_NLANES; i++) {
    ph_lane_t *l = &ph->lanes[i];
    dirty_lock(l);
    unsigned n = l->ndirty;
    memcpy(lines, l->dirty, n * sizeof lines[0]);
    l->ndirty = 0;
    dirty_unlock(l);
    for (unsigned k = 0; k < n; k++)
      _keel_pm_flush(ph, tc, ph->view.base + lines[k], PH_LINE, PH_S_CKPT);
  }
  _keel_pm_drain(ph, tc);
  if (w > ph->hdr->ckpt_seq) {
    keel_store_relaxed(ATOMIC64(&ph->hdr->ckpt_seq), w);
    _keel_pm_flush(ph, tc, &ph->hdr->ckpt_seq, 8, PH_S_WMARK);
    _keel_pm_drain(ph, tc);
    keel_store_release(&ph->ckpt_seq, w);
  }
}

/* A checkpoint, unless one the caller waited for reaches `need` (0: always). */
static void checkpoint_unless(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t need) {
  if (!ckpt_enter(ph, need)) return;
  checkpoint_locked(ph, tc);
  ckpt_exit(ph);
}

void _keel_ph_checkpoint(keel_pheap_t *ph, ph_tcache_t *tc) {
  checkpoint_unless(ph, tc, 0);
}

/* Whether some lane has a log at or below `need` in flight. */
static bool inflight_upto(keel_pheap_t *ph, uint64_t need) {
  for (unsigned i = 0; i < PH_NLANES; i++) {
    uint64_t f = atomic_load(&ph->lanes[i].inflight);
    if (f && f <= need) return true;
  }
  return false;
}

void _keel_ph_checkpoint_past(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t need) {
  while (keel_load_acquire(&ph->ckpt_seq) < need) {
    /* A checkpoint stops below the oldest log in flight: let the threads
     * with logs at or below `need` finish them first, rather than pay a
     * checkpoint per try (2 barriers each). */
    while (inflight_upto(ph, need) && keel_load_acquire(&ph->ckpt_seq) < need) sched_yield();
    /* A checkpoint that was running when we came may cover `need`. */
    checkpoint_unless(ph, tc, need);
  }
}

/* The deferred job: a checkpoint with the worker thread's own cache. */
static void checkpoint_job(void *arg) {
  keel_pheap_t *ph = arg;
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (tc) _keel_ph_checkpoint(ph, tc); /* no cache: the lanes checkpoint inline */
  keel_fetch_add_relaxed(&ph->defer_done, 1);
  /* Release: close, which waits for 0, sees the job's last touch of ph. */
  keel_store_release(&ph->defer_req, 0);
}

void _keel_ph_checkpoint_soon(keel_pheap_t *ph) {
  uint32_t idle = 0;
  if (keel_load_relaxed(&ph->defer_req) ||
      !atomic_compare_exchange_strong(&ph->defer_req, &idle, 1))
    return;
  if (ph->defer(ph->defer_arg, checkpoint_job, ph) != 0)
    keel_store_release(&ph->defer_req, 0); /* refused: checkpoints stay inline */
}

void keel_pheap_set_deferrer(keel_pheap_t *ph, keel_pheap_defer_fn defer, void *arg) {
  PH_NOT_FORKED(ph, "keel_pheap_set_deferrer");
  ph->defer = defer;
  ph->defer_arg = arg;
}

static uint64_t undo_csum(uint64_t seq, const ph_undo_entry_t *e) {
  return _keel_ph_csum(e + 1, e->len, seq * 0xc2b2ae3d27d4eb4full ^ e->off * 31 ^ e->len);
}

bool _keel_ph_undo_next(const uint8_t *data, uint64_t cap, uint64_t seq, uint64_t *pos,
                        const ph_undo_entry_t **out) {
  if (*pos + sizeof(ph_undo_entry_t) > cap) return false;
  const ph_undo_entry_t *e = (const ph_undo_entry_t *)(data + *pos);
  if (e->len == 0 || e->len > cap - *pos - sizeof *e || e->csum != undo_csum(seq, e)) return false;
  *out = e;
  *pos += sizeof *e + KEEL_ALIGN_UP(e->len, (uint64_t)8);
  return true;
}

const ph_undo_ovf_t *_keel_ph_undo_ovf(keel_pheap_t *ph, uint64_t off, uint64_t seq) {
  /* Bounds first: a torn or stale link may hold anything. */
  if (off == 0 || (off & 7) || off < ph->hdr->heap_off ||
      off + PH_OVF_BYTES > keel_load_relaxed(&ph->size))
    return NULL;
  const ph_undo_ovf_t *b = (const ph_undo_ovf_t *)(ph->view.base + off);
  return b->seq == seq && b->cap == PH_OVF_CAP ? b : NULL;
}

/* For tx.c: the checksum an undo entry must carry. */
uint64_t _keel_ph_undo_csum(uint64_t seq, const ph_undo_entry_t *e) KEEL_HIDDEN;
uint64_t _keel_ph_undo_csum(uint64_t seq, const ph_undo_entry_t *e) {
  return undo_csum(seq, e);
}

/* Restores an undo log's snapshots, newest first: the lane's segment, then
 * the overflow chain. A segment ends at its first invalid entry; the next
 * one is linked only after every entry before the link was durable. */
void _keel_ph_undo_rollback(keel_pheap_t *ph, ph_tcache_t *tc, ph_undo_t *u) KEEL_HIDDEN;
void _keel_ph_undo_rollback(keel_pheap_t *ph, ph_tcache_t *tc, ph_undo_t *u) {
  const ph_undo_entry_t *stack[256], *e;
  const ph_undo_entry_t **v = stack;
  size_t n = 0, cap = 256;
  uint64_t seq = u->seq, next = u->next, hops = 0;
  const uint8_t *data = u->data;
  uint64_t dcap = sizeof u->data;
  while (data) {
    uint64_t pos = 0;
    while (_keel_ph_undo_next(data, dcap, seq, &pos, &e)) {
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
    /* hops: a chain is at most as long as the pool has blocks; a cycle can
     * only come from corruption the seq check missed. */
    const ph_undo_ovf_t *b = _keel_ph_undo_ovf(ph, next, seq);
    if (b == NULL || ++hops > keel_load_relaxed(&ph->size) / PH_OVF_BYTES) break;
    data = b->data;
    dcap = PH_OVF_CAP;
    next = b->next;
  }
  uint64_t size = keel_load_relaxed(&ph->size);
  while (n--) {
    e = v[n];
    if (e->off < PH_HDR_BYTES || e->off > size || e->len > size - e->off) continue; /* defensive */
    memcpy(ph->view.base + e->off, e + 1, e->len);
    _keel_pm_flush(ph, tc, ph->view.base + e->off, e->len, PH_S_ROLLBACK);
  }
  if (v != stack) free(v);
}

typedef struct rec_item {
  uint64_t seq;
  const ph_redo_t *log; /* NULL: undo of lane `lane` */
  unsigned lane;
} rec_item_t;

static int rec_cmp(const void *a, const void *b) {
  const rec_item_t *x = a, *y = b;
  return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* True if later data (a CHK or COVER range of a later log: a transaction's
 * stores, a new object's body) covers the word at `off`: that data was
 * durable when its log was and is newer than what log `i` would store there,
 * so replaying the store would undo it. */
static bool overwritten_later(const rec_item_t *items, unsigned n, unsigned i, uint64_t off) {
  for (unsigned j = i + 1; j < n; j++) {
    const ph_redo_t *r = items[j].log;
    if (r == NULL) continue;
    for (size_t k = 0; k < r->n; k++) {
      unsigned op = (unsigned)(r->e[k].off_op & 7);
      if (op != PH_OP_CHK && op != PH_OP_COVER) continue;
      uint64_t lo = r->e[k].off_op & ~(uint64_t)7, len = r->e[k].val;
      if (op == PH_OP_CHK) ph_chk_range(&r->e[k], &lo, &len);
      /* Any word the range touches: the store would undo some of it. */
      if (off + 8 > lo && off < lo + len) return true;
    }
  }
  return false;
}

/* Whether every entry of a redo log names bytes inside the pool past the
 * pool header (a store may also name the header's root word). Checksums
 * catch tearing, not a corrupted or crafted file: an offset near 2^64 would
 * wrap a plain `off + len` bound and send a store or a checksum read
 * outside the mapping. */
static bool redo_in_bounds(uint64_t size, const ph_redo_t *r) {
  for (size_t k = 0; k < r->n; k++) {
    uint64_t off = r->e[k].off_op & ~(uint64_t)7;
    unsigned op = (unsigned)(r->e[k].off_op & 7);
    if (op == PH_OP_CHK || op == PH_OP_COVER) {
      uint64_t len = r->e[k].val;
      if (op == PH_OP_CHK) {
        if (len >> 35) return false; /* not a CHK value (PH_CHK_VAL) */
        ph_chk_range(&r->e[k], &off, &len);
      }
      if (off < PH_HDR_BYTES || off > size || len > size - off) return false;
    } else if (off != offsetof(ph_header_t, root_off) && (off < PH_HDR_BYTES || off > size - 8)) {
      return false;
    }
  }
  return true;
}

/* The same for an undo log's snapshots, the overflow chain included. */
static bool undo_in_bounds(keel_pheap_t *ph, const ph_undo_t *u) {
  uint64_t size = keel_load_relaxed(&ph->size), seq = u->seq, next = u->next, hops = 0, dcap;
  const uint8_t *data = u->data;
  const ph_undo_entry_t *e;
  for (dcap = sizeof u->data; data;) {
    uint64_t pos = 0;
    while (_keel_ph_undo_next(data, dcap, seq, &pos, &e))
      if (e->off < PH_HDR_BYTES || e->off > size || e->len > size - e->off) return false;
    const ph_undo_ovf_t *b = _keel_ph_undo_ovf(ph, next, seq);
    if (b == NULL || ++hops > size / PH_OVF_BYTES) break;
    data = b->data;
    dcap = PH_OVF_CAP;
    next = b->next;
  }
  return true;
}

/* Checks every log recovery would act on before it writes anything, so a
 * rejected pool is left as it was. */
static int logs_check(keel_pheap_t *ph) {
  uint64_t w = ph->hdr->ckpt_seq, size = keel_load_relaxed(&ph->size);
  for (unsigned i = 0; i < PH_NLANES; i++) {
    ph_lane_t *l = &ph->lanes[i];
    for (unsigned pos = 0; pos < PH_RING_LINES;) {
      const ph_redo_t *r = _keel_ph_ring_log(l->ring, pos, w);
      if (r == NULL) {
        pos++;
        continue;
      }
      /* Recovery raises the watermark to the highest seq it replays: one
       * from a later epoch than the pool's would put the watermark above
       * every seq of the sessions to come. */
      if ((r->seq >> 40) > ph->hdr->epoch)
        return _keel_ph_err(KEEL_ECORRUPT, ph->path,
                            "redo log at line %u of lane %u has seq %#llx, beyond the pool's "
                            "epoch %llu",
                            pos, i, (unsigned long long)r->seq, (unsigned long long)ph->hdr->epoch);
      if (!redo_in_bounds(size, r))
        return _keel_ph_err(KEEL_ECORRUPT, ph->path,
                            "redo log at line %u of lane %u names bytes outside the pool", pos, i);
      pos += log_lines(r->n);
    }
    if ((l->undo->seq >> 40) > ph->hdr->epoch)
      return _keel_ph_err(KEEL_ECORRUPT, ph->path,
                          "undo log of lane %u has seq %#llx, beyond the pool's epoch %llu", i,
                          (unsigned long long)l->undo->seq, (unsigned long long)ph->hdr->epoch);
    if (l->undo->seq != 0 && !undo_in_bounds(ph, l->undo))
      return _keel_ph_err(KEEL_ECORRUPT, ph->path,
                          "undo log of lane %u names bytes outside the pool", i);
  }
  return 0;
}

int _keel_ph_recover(keel_pheap_t *ph, ph_tcache_t *tc) {
  int rc = logs_check(ph);
  if (rc != 0) return rc;
  uint64_t w = ph->hdr->ckpt_seq, top = w;
  rec_item_t *items = malloc(PH_NLANES * (PH_RING_LINES + 1) * sizeof *items);
  if (items == NULL) keel_die("keel_pheap recovery", "out of memory");
  unsigned n = 0;
  for (unsigned i = 0; i < PH_NLANES; i++) {
    ph_lane_t *l = &ph->lanes[i];
    bool committed = false;
    for (unsigned pos = 0; pos < PH_RING_LINES;) {
      const ph_redo_t *r = _keel_ph_ring_log(l->ring, pos, w);
      if (r == NULL) {
        pos++;
        continue;
      }
      pos += log_lines(r->n);
      if (r->seq > top) top = r->seq;
      /* A commit log whose vouched-for data is not all there, while its
       * undo log is still in place, tore in its own barrier: it never
       * committed. Once the undo log is gone the commit finished (its
       * effects were flushed before it returned), so a mismatch then only
       * means the data changed since, and the log is replayed in order like
       * any other. */
      if (r->tx && r->tx == l->undo->seq) {
        if (!_keel_ph_redo_data_ok(ph, r)) {
          /* Retire it with the rollback's barrier, before the undo log is
           * emptied: a crash between that and the watermark would
           * otherwise leave a valid log with no undo log beside it, which
           * the next recovery replays as committed (found by the crash
           * sweep: a rolled-back tx_free cleared the bit of an object its
           * restored pointer still names). */
          keel_store_relaxed(ATOMIC64(&((ph_redo_t *)r)->seq), 0);
          _keel_pm_flush(ph, tc, r, 8, PH_S_REC_TORN);
          continue;
        }
        committed = true;
      }
      items[n++] = (rec_item_t){r->seq, r, i};
    }
    if (l->undo->seq != 0 && !committed) items[n++] = (rec_item_t){l->undo->seq, NULL, i};
  }
  if (n == 0) {
    free(items);
    return 0;
  }
  qsort(items, n, sizeof items[0], rec_cmp);
  for (unsigned i = 0; i < n; i++) {
    if (items[i].log == NULL) {
      _keel_ph_undo_rollback(ph, tc, ph->lanes[items[i].lane].undo);
      continue;
    }
    for (size_t k = 0; k < items[i].log->n; k++)
      if (!overwritten_later(items, n, i, items[i].log->e[k].off_op & ~(uint64_t)7))
        apply_one(ph, tc, &items[i].log->e[k], false);
  }
  _keel_pm_drain(ph, tc);
  /* Undo logs are emptied before the watermark passes their commit logs: an
   * undo log left valid with its commit log ignored would roll a committed
   * transaction back at the next open. */
  for (unsigned i = 0; i < PH_NLANES; i++) {
    ph_lane_t *l = &ph->lanes[i];
    if (l->undo->seq) {
      l->undo->seq = 0;
      _keel_pm_flush(ph, tc, l->undo, 8, PH_S_REC_UNDO);
    }
  }
  _keel_pm_drain(ph, tc);
  /* Durable with open's new epoch, the next barrier (pool.c); a crash
   * before it replays the same logs again. */
  if (top > w) ph->hdr->ckpt_seq = top;
  free(items);
  return (int)n;
}
