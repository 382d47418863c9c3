/* pheap atomic actions: alloc, free, reserve/publish/cancel, root.
 *
 * Each is one redo log (log.c): allocation state (a run bitmap bit or a
 * huge extent's chunk word), the object header words and the destination
 * word change together. One barrier makes the log durable; the words are
 * then changed in the cache and reach the media at the next checkpoint (or
 * by replay after a crash). zalloc spends one more barrier first, so the
 * zeroed body is durable before the log that publishes it. A reservation
 * writes its header in the cache only; publish logs it. The contents a
 * caller writes into a reservation are the caller's to persist before
 * publishing (keel_pheap_persist), as with any plain store.
 */
#include <string.h>

#include "base/die.h"
#include "pheap/pheap_int.h"

static inline bool in_pool(keel_pheap_t *ph, const void *p, size_t len) {
  const char *c = p;
  return c >= ph->view.base + PH_HDR_BYTES &&
         c + len <= ph->view.base + keel_load_relaxed(&ph->size);
}

/* The log entries that publish a block: its allocation bit (or chunk word)
 * and its header words. Replay rewrites the header, so the header needs no
 * flush of its own, and an older log above the watermark that allocated the
 * same block before it was freed (and whose replay rewrites the header with
 * that allocation's size and type) is always followed by these. */
size_t _keel_ph_publish_entries(keel_pheap_t *ph, int cls, keel_poff_t off, ph_redo_entry_t *e) {
  const ph_objhdr_t *h = (const ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR);
  e[0] = (ph_redo_entry_t){(off - PH_OBJ_HDR) | PH_OP_SET, h->size};
  e[1] = (ph_redo_entry_t){(off - PH_OBJ_HDR + 8) | PH_OP_SET, h->type};
  e[2] = _keel_ph_mark(ph, cls, off, true);
  return PH_PUBLISH_ENTRIES;
}

/* One atomic operation: log, barrier, apply in cache (flushed by the next
 * checkpoint). */
static void atomic_op(keel_pheap_t *ph, ph_tcache_t *tc, const ph_redo_entry_t *e, size_t n) {
  ph_lane_t *l = _keel_ph_lane_get(ph, tc, false);
  _keel_ph_log_write(ph, tc, l, _keel_ph_log_seq(ph, tc, l, n), 0, e, n);
  _keel_pm_drain(ph, tc);
  _keel_ph_log_apply(ph, tc, l, e, n, true);
  _keel_ph_lane_put(tc, l);
}

static int alloc_common(keel_pheap_t *ph, keel_poff_t *dest, size_t size, uint64_t type,
                        bool zero) {
  /* A log entry is a word offset with the op in its low 3 bits: a
   * misaligned destination would turn into another op (or a COVER). */
  if (ph == NULL || dest == NULL || ((uintptr_t)dest & 7))
    return KEEL_REJECT(KEEL_EINVAL, zero ? "keel_pheap_zalloc" : "keel_pheap_alloc",
                       "pool %p, dest %p", (void *)ph, (void *)dest);
  PH_NOT_FORKED(ph, zero ? "keel_pheap_zalloc" : "keel_pheap_alloc");
  if (keel_unlikely(_keel_ph_tx_snapshots(ph, dest)))
    return KEEL_REJECT(KEEL_EINVAL, zero ? "keel_pheap_zalloc" : "keel_pheap_alloc",
                       "destination %p is in this thread's transaction's snapshot (keel_tx_alloc "
                       "is the transactional allocation)",
                       (void *)dest);
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (keel_unlikely(tc == NULL)) return KEEL_ENOMEM;
  int cls;
  keel_poff_t off;
  int rc = _keel_ph_take(ph, tc, size, &cls, &off);
  if (rc != 0) return rc;
  _keel_ph_init_obj(ph, off, size, type, zero);
  if (zero) {
    /* The zeroed body must be durable before the log can be. */
    _keel_pm_flush(ph, tc, ph->view.base + off, size, PH_S_ZBODY);
    _keel_pm_drain(ph, tc);
  }
  bool logged = in_pool(ph, dest, 8) || (void *)dest == (void *)&ph->hdr->root_off;
  ph_redo_entry_t e[PH_PUBLISH_ENTRIES + 2];
  size_t n = _keel_ph_publish_entries(ph, cls, off, e);
  /* The zeroed body is durable before the log; naming it keeps recovery
   * from replaying an older log's store into it (the block may have held an
   * object that was some atomic operation's destination). */
  if (zero) e[n++] = (ph_redo_entry_t){off | PH_OP_COVER, KEEL_ALIGN_UP(size, (size_t)8)};
  if (logged) e[n++] = (ph_redo_entry_t){(uint64_t)((char *)dest - ph->view.base) | PH_OP_SET, off};
  atomic_op(ph, tc, e, n);
  if (!logged) *dest = off;
  return 0;
}

int keel_pheap_alloc(keel_pheap_t *ph, keel_poff_t *dest, size_t size, uint64_t type) {
  return alloc_common(ph, dest, size, type, false);
}

int keel_pheap_zalloc(keel_pheap_t *ph, keel_poff_t *dest, size_t size, uint64_t type) {
  return alloc_common(ph, dest, size, type, true);
}

int keel_pheap_free(keel_pheap_t *ph, keel_poff_t *dest) {
  if (ph == NULL || dest == NULL || ((uintptr_t)dest & 7)) /* see alloc_common */
    return KEEL_REJECT(KEEL_EINVAL, "keel_pheap_free", "pool %p, dest %p", (void *)ph,
                       (void *)dest);
  keel_poff_t off = *dest;
  if (off == 0) return 0;
  PH_NOT_FORKED(ph, "keel_pheap_free");
  /* Dies, as other misuse of a free does: callers count on a free not
   * failing (pheap.h). */
  if (keel_unlikely(_keel_ph_tx_snapshots(ph, dest)))
    keel_die("keel_pheap_free",
             "destination %p is in this thread's transaction's snapshot (keel_tx_free is the "
             "transactional free) in %s",
             (void *)dest, ph->path);
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (keel_unlikely(tc == NULL)) return KEEL_ENOMEM;
  int cls = _keel_ph_live_class(ph, off, "keel_pheap_free");
  ph_redo_entry_t e[2] = {_keel_ph_mark(ph, cls, off, false),
                          {(uint64_t)((char *)dest - ph->view.base) | PH_OP_SET, 0}};
  /* Freeing needs only the log: no space is allocated, so it never fails
   * for lack of room (the ring is reused after a checkpoint). */
  bool logged = in_pool(ph, dest, 8);
  atomic_op(ph, tc, e, logged ? 2 : 1);
  if (!logged) *dest = 0;
  _keel_ph_give(ph, tc, cls, off);
  return 0;
}

size_t keel_pheap_usable_size(keel_pheap_t *ph, keel_poff_t off) {
  if (ph == NULL || off == 0) return 0;
  size_t n;
  if (_keel_ph_tx_new_usable(ph, off, &n)) return n;
  return _keel_ph_usable(ph, _keel_ph_live_class(ph, off, "keel_pheap_usable_size"), off);
}

uint64_t keel_pheap_type(keel_pheap_t *ph, keel_poff_t off) {
  if (ph == NULL || off == 0) return 0;
  return ((const ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR))->type;
}

int keel_pheap_reserve(keel_pheap_t *ph, keel_pheap_act_t *act, size_t size, uint64_t type) {
  if (ph == NULL || act == NULL)
    return KEEL_REJECT(KEEL_EINVAL, "keel_pheap_reserve", "pool %p, act %p", (void *)ph,
                       (void *)act);
  PH_NOT_FORKED(ph, "keel_pheap_reserve");
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (keel_unlikely(tc == NULL)) return KEEL_ENOMEM;
  int cls;
  keel_poff_t off;
  int rc = _keel_ph_take(ph, tc, size, &cls, &off);
  if (rc != 0) return rc;
  _keel_ph_init_obj(ph, off, size, type, false);
  *act = (keel_pheap_act_t){PH_ACT_RESERVE, (uint32_t)cls, off, NULL, 0};
  return 0;
}

void keel_pheap_set_value(keel_pheap_t *ph, keel_pheap_act_t *act, uint64_t *dest, uint64_t value) {
  if (!in_pool(ph, dest, 8))
    keel_die("keel_pheap_set_value", "destination %p is not inside the pool %s", (void *)dest,
             ph->path);
  if ((uintptr_t)dest & 7) /* see alloc_common */
    keel_die("keel_pheap_set_value", "destination %p in %s is not 8-byte aligned", (void *)dest,
             ph->path);
  *act = (keel_pheap_act_t){PH_ACT_SET, 0, 0, dest, value};
}

void keel_pheap_defer_free(keel_pheap_t *ph, keel_pheap_act_t *act, keel_poff_t off) {
  int cls = _keel_ph_live_class(ph, off, "keel_pheap_defer_free");
  *act = (keel_pheap_act_t){PH_ACT_FREE, (uint32_t)cls, off, NULL, 0};
}

long _keel_ph_acts_entries(keel_pheap_t *ph, const keel_pheap_act_t *acts, size_t n,
                           ph_redo_entry_t *e, size_t cap, const char *call) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (acts[i].kind == PH_ACT_NONE) continue;
    if (k + PH_PUBLISH_ENTRIES > cap) return -1;
    switch (acts[i].kind) {
      case PH_ACT_RESERVE:
        k += _keel_ph_publish_entries(ph, (int)acts[i].cls, acts[i].off, e + k);
        break;
      case PH_ACT_FREE:
        /* The block is still allocated until the log is applied, so the
         * live check of defer_free passes twice; given back twice, it would
         * be handed out twice. */
        for (size_t j = 0; j < i; j++)
          if (acts[j].kind == PH_ACT_FREE && acts[j].off == acts[i].off)
            keel_die(call, "offset 0x%llx is freed twice in one publish of %s",
                     (unsigned long long)acts[i].off, ph->path);
        /* Live still, in the class it had: a keel_pheap_free of it since
         * defer_free (or keel_tx_free) checked would have it handed out
         * twice, and an object of another class at the offset since then
         * would be freed with the wrong bit or extent. */
        if (_keel_ph_live_class(ph, acts[i].off, call) != (int)acts[i].cls)
          keel_die(call, "offset 0x%llx of %s was freed and reused since it was queued",
                   (unsigned long long)acts[i].off, ph->path);
        e[k++] = _keel_ph_mark(ph, (int)acts[i].cls, acts[i].off, false);
        break;
      case PH_ACT_SET:
        e[k++] = (ph_redo_entry_t){(uint64_t)((char *)acts[i].dest - ph->view.base) | PH_OP_SET,
                                   acts[i].value};
        break;
      default:
        keel_die("keel_pheap_publish", "action %p has unknown kind %u", (void *)&acts[i],
                 acts[i].kind);
    }
  }
  return (long)k;
}

void _keel_ph_acts_done(keel_pheap_t *ph, ph_tcache_t *tc, keel_pheap_act_t *acts, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (acts[i].kind == PH_ACT_FREE) _keel_ph_give(ph, tc, (int)acts[i].cls, acts[i].off);
    acts[i].kind = PH_ACT_NONE;
  }
}

int keel_pheap_publish(keel_pheap_t *ph, keel_pheap_act_t *acts, size_t n) {
  if (ph == NULL || (acts == NULL && n))
    return KEEL_REJECT(KEEL_EINVAL, "keel_pheap_publish", "pool %p, %zu acts at %p", (void *)ph, n,
                       (void *)acts);
  PH_NOT_FORKED(ph, "keel_pheap_publish");
  /* keel_tx_publish is the transactional one: its commit makes the stores. */
  for (size_t i = 0; i < n; i++)
    if (acts[i].kind == PH_ACT_SET && keel_unlikely(_keel_ph_tx_snapshots(ph, acts[i].dest)))
      return KEEL_REJECT(KEEL_EINVAL, "keel_pheap_publish",
                         "destination %p is in this thread's transaction's snapshot "
                         "(keel_tx_publish is the transactional publish)",
                         (void *)acts[i].dest);
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (keel_unlikely(tc == NULL)) return KEEL_ENOMEM;
  ph_redo_entry_t e[PH_REDO_MAX];
  long k = _keel_ph_acts_entries(ph, acts, n, e, PH_REDO_MAX, "keel_pheap_publish");
  if (k < 0) return KEEL_ENOSPC;
  if (k == 0) return 0;
  atomic_op(ph, tc, e, (size_t)k);
  _keel_ph_acts_done(ph, tc, acts, n);
  return 0;
}

void keel_pheap_cancel(keel_pheap_t *ph, keel_pheap_act_t *acts, size_t n) {
  if (ph == NULL || acts == NULL) return;
  PH_NOT_FORKED(ph, "keel_pheap_cancel");
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (tc == NULL) return;
  for (size_t i = 0; i < n; i++) {
    if (acts[i].kind == PH_ACT_RESERVE) _keel_ph_give(ph, tc, (int)acts[i].cls, acts[i].off);
    acts[i].kind = PH_ACT_NONE;
  }
}

void *keel_pheap_root(keel_pheap_t *ph, size_t size) {
  if (ph == NULL || size == 0) {
    _keel_reject("keel_pheap_root", "pool %p, size %zu", (void *)ph, size);
    errno = EINVAL;
    return NULL;
  }
  if (keel_unlikely(_keel_ph_forked(ph))) {
    /* A child may read the parent's root; allocating it is a change. */
    keel_poff_t off = ph->hdr->root_off;
    if (off == 0 || keel_pheap_usable_size(ph, off) < size)
      _keel_ph_forked_die(ph, "keel_pheap_root");
    return ph->view.base + off;
  }
  pthread_mutex_lock(&ph->root_lock);
  _keel_ph_holds++; /* a transaction's thread may wait for root_lock */
  int rc = 0;
  if (ph->hdr->root_off == 0)
    rc = keel_pheap_zalloc(ph, (keel_poff_t *)&ph->hdr->root_off, size, PH_ROOT_TYPE);
  keel_poff_t off = ph->hdr->root_off;
  _keel_ph_holds--;
  pthread_mutex_unlock(&ph->root_lock);
  if (rc == 0 && keel_pheap_usable_size(ph, off) < size) rc = KEEL_EINVAL;
  if (rc != 0) {
    errno = -rc;
    return NULL;
  }
  return ph->view.base + off;
}

void keel_pheap_persist(keel_pheap_t *ph, const void *p, size_t len) {
  PH_NOT_FORKED(ph, "keel_pheap_persist");
  _keel_ph_not_in_flight(ph, "keel_pheap_persist"); /* it would wait for its own log */
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (tc == NULL) keel_die("keel_pheap_persist", "out of memory for the thread cache");
  _keel_pm_flush(ph, tc, p, len, PH_S_PERSIST);
  _keel_pm_drain(ph, tc);
  /* A plain store may overwrite a word an atomic operation's log (still
   * above the watermark) sets, or any byte of a small object a transaction
   * created (its commit log carries the body); replaying that log after a
   * crash would undo the store, so the logs are retired first: every log drawn so far, not
   * just up to the oldest operation still in flight on another thread (a
   * single checkpoint stops there, leaving later logs, this thread's own
   * included, to be replayed over the store). Such an operation finishes
   * without waiting for this thread (it is not in flight itself: a
   * transaction is only at its commit). */
  if (_keel_ph_deferred(ph)) _keel_ph_checkpoint_past(ph, tc, atomic_load(&ph->seq));
}
