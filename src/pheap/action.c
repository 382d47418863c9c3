/* pheap atomic actions: alloc, free, reserve/publish/cancel, root.
 *
 * Each is one redo log (log.c): allocation state (a run bitmap bit or a
 * huge extent's chunk word) and the destination word change together.
 * Barrier 1 makes the object header (and zeroed body, for zalloc) plus the
 * log durable; barrier 2 the applied words. The object header is flushed in
 * barrier 1 because once the bit can be durable the header must be too (a
 * walk after a crash reads its type and size). A reservation writes its
 * header without flushing; publish flushes it (and the object's requested
 * bytes) in its barrier 1.
 */
#include <string.h>

#include "base/die.h"
#include "pheap/pheap_int.h"

static inline bool in_pool(keel_pheap_t *ph, const void *p, size_t len) {
  const char *c = p;
  return c >= ph->view.base + PH_HDR_BYTES && c + len <= ph->view.base + keel_load_relaxed(&ph->size);
}

static int alloc_common(keel_pheap_t *ph, keel_poff_t *dest, size_t size, uint64_t type, bool zero) {
  if (ph == NULL || dest == NULL) return KEEL_EINVAL;
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (keel_unlikely(tc == NULL)) return KEEL_ENOMEM;
  int cls;
  keel_poff_t off;
  int rc = _keel_ph_take(ph, tc, size, &cls, &off);
  if (rc != 0) return rc;
  _keel_ph_init_obj(ph, tc, off, size, type, zero, true);
  bool logged = in_pool(ph, dest, 8) || (void *)dest == (void *)&ph->hdr->root_off;
  ph_redo_entry_t e[3] = {_keel_ph_mark(ph, cls, off, true),
                          {(uint64_t)((char *)dest - ph->view.base) | PH_OP_SET, off}};
  size_t n = logged ? 2 : 1;
  uint64_t chk = 0;
  if (!_keel_ph_chk_add(e, &n, 3, off - PH_OBJ_HDR, PH_OBJ_HDR + (zero ? size : 0), &chk))
    _keel_pm_drain(ph, tc); /* a big zeroed body: order it before the log */
  ph_lane_t *l = _keel_ph_lane_get(ph, tc);
  _keel_ph_redo_write(ph, tc, l, _keel_ph_next_seq(ph), e, n);
  _keel_pm_drain(ph, tc);
  _keel_ph_redo_apply(ph, tc, e, n);
  _keel_pm_drain(ph, tc);
  _keel_ph_redo_retire(ph, l);
  _keel_ph_lane_put(ph, l);
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
  if (ph == NULL || dest == NULL) return KEEL_EINVAL;
  keel_poff_t off = *dest;
  if (off == 0) return 0;
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (keel_unlikely(tc == NULL)) return KEEL_ENOMEM;
  int cls = _keel_ph_live_class(ph, off, "keel_pheap_free");
  ph_redo_entry_t e[2] = {_keel_ph_mark(ph, cls, off, false),
                          {(uint64_t)((char *)dest - ph->view.base) | PH_OP_SET, 0}};
  if (in_pool(ph, dest, 8)) {
    ph_lane_t *l = _keel_ph_lane_get(ph, tc);
    _keel_ph_redo_write(ph, tc, l, _keel_ph_next_seq(ph), e, 2);
    _keel_pm_drain(ph, tc);
    _keel_ph_redo_apply(ph, tc, e, 2);
    _keel_pm_drain(ph, tc);
    _keel_ph_redo_retire(ph, l);
    _keel_ph_lane_put(ph, l);
  } else {
    /* Nothing persistent points here: the free is one 64-bit store (the
     * bitmap word or chunk word) and its flush. */
    _keel_ph_redo_apply(ph, tc, e, 1);
    _keel_pm_drain(ph, tc);
    *dest = 0;
  }
  _keel_ph_give(ph, tc, cls, off);
  return 0;
}

size_t keel_pheap_usable_size(keel_pheap_t *ph, keel_poff_t off) {
  if (ph == NULL || off == 0) return 0;
  return _keel_ph_usable(ph, _keel_ph_live_class(ph, off, "keel_pheap_usable_size"), off);
}

uint64_t keel_pheap_type(keel_pheap_t *ph, keel_poff_t off) {
  if (ph == NULL || off == 0) return 0;
  return ((const ph_objhdr_t *)(ph->view.base + off - PH_OBJ_HDR))->type;
}

int keel_pheap_reserve(keel_pheap_t *ph, keel_pheap_act_t *act, size_t size, uint64_t type) {
  if (ph == NULL || act == NULL) return KEEL_EINVAL;
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (keel_unlikely(tc == NULL)) return KEEL_ENOMEM;
  int cls;
  keel_poff_t off;
  int rc = _keel_ph_take(ph, tc, size, &cls, &off);
  if (rc != 0) return rc;
  _keel_ph_init_obj(ph, tc, off, size, type, false, false);
  *act = (keel_pheap_act_t){PH_ACT_RESERVE, (uint32_t)cls, off, NULL, 0};
  return 0;
}

void keel_pheap_set_value(keel_pheap_t *ph, keel_pheap_act_t *act, uint64_t *dest, uint64_t value) {
  if (!in_pool(ph, dest, 8))
    keel_die("keel_pheap_set_value", "destination %p is not inside the pool %s", (void *)dest,
             ph->path);
  *act = (keel_pheap_act_t){PH_ACT_SET, 0, 0, dest, value};
}

void keel_pheap_defer_free(keel_pheap_t *ph, keel_pheap_act_t *act, keel_poff_t off) {
  int cls = _keel_ph_live_class(ph, off, "keel_pheap_defer_free");
  *act = (keel_pheap_act_t){PH_ACT_FREE, (uint32_t)cls, off, NULL, 0};
}

long _keel_ph_acts_entries(keel_pheap_t *ph, const keel_pheap_act_t *acts, size_t n,
                           ph_redo_entry_t *e, size_t cap) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (acts[i].kind == PH_ACT_NONE) continue;
    if (k == cap) return -1;
    switch (acts[i].kind) {
    case PH_ACT_RESERVE:
    case PH_ACT_FREE:
      e[k++] = _keel_ph_mark(ph, (int)acts[i].cls, acts[i].off, acts[i].kind == PH_ACT_RESERVE);
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

/* Flushes reserved objects' headers and requested bytes and vouches for
 * them in the log (CHK entries into e[*k..cap)). Returns false if some could
 * not be vouched for: the caller must then drain before writing the log. */
static bool acts_flush(keel_pheap_t *ph, ph_tcache_t *tc, const keel_pheap_act_t *acts, size_t n,
                       ph_redo_entry_t *e, size_t *k, size_t cap, uint64_t *chk) {
  bool all = true;
  for (size_t i = 0; i < n; i++) {
    if (acts[i].kind != PH_ACT_RESERVE) continue;
    const ph_objhdr_t *h = (const ph_objhdr_t *)(ph->view.base + acts[i].off - PH_OBJ_HDR);
    _keel_pm_flush(ph, tc, h, PH_OBJ_HDR + h->size, PH_S_OBJHDR);
    if (all && !_keel_ph_chk_add(e, k, cap, acts[i].off - PH_OBJ_HDR, PH_OBJ_HDR + h->size, chk))
      all = false;
  }
  return all;
}

void _keel_ph_acts_done(keel_pheap_t *ph, ph_tcache_t *tc, keel_pheap_act_t *acts, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (acts[i].kind == PH_ACT_FREE) _keel_ph_give(ph, tc, (int)acts[i].cls, acts[i].off);
    acts[i].kind = PH_ACT_NONE;
  }
}

bool _keel_ph_acts_flush(keel_pheap_t *ph, ph_tcache_t *tc, const keel_pheap_act_t *acts,
                         size_t n, ph_redo_entry_t *e, size_t *k, size_t cap,
                         uint64_t *chk) KEEL_HIDDEN;
bool _keel_ph_acts_flush(keel_pheap_t *ph, ph_tcache_t *tc, const keel_pheap_act_t *acts,
                         size_t n, ph_redo_entry_t *e, size_t *k, size_t cap, uint64_t *chk) {
  return acts_flush(ph, tc, acts, n, e, k, cap, chk);
}

int keel_pheap_publish(keel_pheap_t *ph, keel_pheap_act_t *acts, size_t n) {
  if (ph == NULL || (acts == NULL && n)) return KEEL_EINVAL;
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (keel_unlikely(tc == NULL)) return KEEL_ENOMEM;
  ph_redo_entry_t e[PH_REDO_MAX];
  long k = _keel_ph_acts_entries(ph, acts, n, e, PH_REDO_MAX);
  if (k < 0) return KEEL_ENOSPC;
  if (k == 0) return 0;
  size_t nk = (size_t)k;
  uint64_t chk = 0;
  if (!acts_flush(ph, tc, acts, n, e, &nk, PH_REDO_MAX, &chk)) _keel_pm_drain(ph, tc);
  ph_lane_t *l = _keel_ph_lane_get(ph, tc);
  _keel_ph_redo_write(ph, tc, l, _keel_ph_next_seq(ph), e, nk);
  _keel_pm_drain(ph, tc);
  _keel_ph_redo_apply(ph, tc, e, nk);
  _keel_pm_drain(ph, tc);
  _keel_ph_redo_retire(ph, l);
  _keel_ph_lane_put(ph, l);
  _keel_ph_acts_done(ph, tc, acts, n);
  return 0;
}

void keel_pheap_cancel(keel_pheap_t *ph, keel_pheap_act_t *acts, size_t n) {
  if (ph == NULL || acts == NULL) return;
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (tc == NULL) return;
  for (size_t i = 0; i < n; i++) {
    if (acts[i].kind == PH_ACT_RESERVE) _keel_ph_give(ph, tc, (int)acts[i].cls, acts[i].off);
    acts[i].kind = PH_ACT_NONE;
  }
}

void *keel_pheap_root(keel_pheap_t *ph, size_t size) {
  if (ph == NULL || size == 0) {
    errno = EINVAL;
    return NULL;
  }
  pthread_mutex_lock(&ph->root_lock);
  int rc = 0;
  if (ph->hdr->root_off == 0)
    rc = keel_pheap_zalloc(ph, (keel_poff_t *)&ph->hdr->root_off, size, PH_ROOT_TYPE);
  keel_poff_t off = ph->hdr->root_off;
  pthread_mutex_unlock(&ph->root_lock);
  if (rc == 0 && keel_pheap_usable_size(ph, off) < size) rc = KEEL_EINVAL;
  if (rc != 0) {
    errno = -rc;
    return NULL;
  }
  return ph->view.base + off;
}

void keel_pheap_persist(keel_pheap_t *ph, const void *p, size_t len) {
  ph_tcache_t *tc = _keel_ph_tcache(ph);
  if (tc == NULL) keel_die("keel_pheap_persist", "out of memory for the thread cache");
  _keel_pm_flush(ph, tc, p, len, PH_S_NONE);
  _keel_pm_drain(ph, tc);
}
