/* The sweeper's side of the owner/sweeper hand-off (see pool_impl.h), and
 * what happens to an object as it enters or leaves a list: debug patterns,
 * the tools' view (track.h), the return to the heap.
 */
#include <linux/membarrier.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/die.h"
#include "pool_impl.h"
#include "track.h"

int _keel_pool_fence_heavy;

static int sys_membarrier(int cmd) {
  return (int)syscall(__NR_membarrier, cmd, 0, 0);
}

void _keel_pool_handoff_init(void) {
  /* Registration is per process and must precede the first expedited call;
   * it is done before any pool handle exists, so every fast path that reads
   * _keel_pool_fence_heavy happens after this store. */
  int cmds = sys_membarrier(MEMBARRIER_CMD_QUERY);
  if (cmds < 0 || !(cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) ||
      sys_membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) != 0)
    _keel_pool_fence_heavy = 1;
}

void _keel_pool_handoff_barrier(void) {
  /* Forces every running owner through a full barrier between its busy
   * store and its req load (and orders this thread's req stores before its
   * busy loads). In the fallback mode nothing is needed here: the owners'
   * exchange and the seq_cst req stores and busy loads order themselves. */
  if (!_keel_pool_fence_heavy && sys_membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) != 0) {
    /* The kernel accepted the registration, so this cannot fail; owners are
     * not fencing, so carrying on would risk two threads on one list. */
    keel_die("keel_pool_sweep", "membarrier failed after registration (errno %d)", errno);
  }
}

/* Appends list b (tail tb) before list a. */
static pool_hdr_t *pool_list_join(pool_hdr_t *b, pool_hdr_t *a) {
  if (b == NULL) return a;
  pool_hdr_t *t = b;
  while (t->next != NULL) t = t->next;
  t->next = a;
  return b;
}

static size_t pool_list_len(const pool_hdr_t *h) {
  size_t n = 0;
  for (; h != NULL; h = h->next) n++;
  return n;
}

#if KEEL_DEBUG >= 2
/* Debug-full validator: every object on a list carries its pool's tag with
 * the free bit, and the list ends (a cycle would mean a corrupted link). */
static void pool_list_validate(const keel_pool_t *p, const pool_hdr_t *h) {
  size_t n = 0;
  for (; h != NULL; h = h->next, n++) {
    if (h->tag != (p->f.tag | POOL_TAG_FREE))
      keel_die("keel_pool_sweep", "corrupt cached object %p in pool '%s' (tag %#lx)",
               (const void *)(h + 1), p->name, (unsigned long)h->tag);
    if (n > ((size_t)1 << 40)) keel_die("keel_pool_sweep", "cycle in a list of pool '%s'", p->name);
  }
}
#endif

pool_hdr_t *__keel_pool_sub_service(pool_sub_t *sp, uint32_t req, size_t *n) {
#if KEEL_DEBUG >= 2
  pool_list_validate(sp->pool, sp->f.hot);
  pool_list_validate(sp->pool, sp->f.cold);
#endif
  pool_hdr_t *gone = sp->f.cold;
  sp->f.cold = NULL;
  if (req == POOL_REQ_SWEEP) {
    sp->f.cold = sp->f.hot;
    sp->f.hot = NULL;
  } else if (req == POOL_REQ_DRAIN) {
    gone = pool_list_join(sp->f.hot, gone);
    sp->f.hot = NULL;
  }
  /* Release pairs with the owner's (seq_cst) load of req in its fast path:
   * once it sees NONE it also sees the lists as left here. */
  keel_store_release(&sp->f.req, POOL_REQ_NONE);
  /* The walk costs what the frees after it cost anyway, and keeps the
   * counters exact without a count per list in the fast path. */
  *n = pool_list_len(gone);
  return gone;
}

static void pool_check_pattern(keel_pool_t *p, const unsigned char *o, const char *call) {
  for (size_t i = 0; i < p->obj_size; i++)
    if (keel_unlikely(o[i] != POOL_FREE_BYTE))
      keel_die(call, "%p modified after free in pool '%s' (byte %zu is 0x%02x)", (const void *)o,
               p->name, i, o[i]);
}

void _keel_pool_obj_cached(keel_pool_t *p, void *obj) {
  if (p->f.flags & POOL_F_DEBUG) memset(obj, POOL_FREE_BYTE, p->obj_size);
  POOL_ASAN_POISON(obj, p->obj_size);
  if (p->f.flags & POOL_F_TRACK) POOL_VG_FREE(obj);
}

/* The pattern check, with the object readable to the tools for its span. */
static void pool_obj_check(keel_pool_t *p, void *obj, const char *call) {
  if (!(p->f.flags & POOL_F_DEBUG)) return;
  if (p->f.flags & POOL_F_TRACK) POOL_VG_DEFINED(obj, p->obj_size);
  pool_check_pattern(p, obj, call);
}

void _keel_pool_obj_reused(keel_pool_t *p, void *obj, const char *call) {
  POOL_ASAN_UNPOISON(obj, p->obj_size);
  if (p->f.flags & POOL_F_TRACK) POOL_VG_ALLOC(obj, p->obj_size);
  pool_obj_check(p, obj, call);
  if (p->f.flags & POOL_F_TRACK) POOL_VG_UNDEFINED(obj, p->obj_size); /* as malloc's contents */
}

void _keel_pool_obj_fresh(keel_pool_t *p, void *obj) {
  if (p->f.flags & POOL_F_TRACK) POOL_VG_ALLOC(obj, p->obj_size);
  if (p->f.flags & POOL_F_DEBUG) memset(obj, POOL_NEW_BYTE, p->obj_size);
}

/* A cached object going back to the heap: checked, then plain memory again
 * (the heap reuses it for anything). */
static void pool_obj_released(keel_pool_t *p, void *obj, const char *call) {
  POOL_ASAN_UNPOISON(obj, p->obj_size);
  pool_obj_check(p, obj, call);
  if (p->f.flags & POOL_F_TRACK) POOL_VG_UNDEFINED(obj, p->obj_size);
}

void _keel_pool_release_list(keel_pool_t *p, pool_hdr_t *list, size_t n, const char *call) {
  while (list != NULL) {
    pool_hdr_t *next = list->next;
    void *obj = list + 1;
    pool_obj_released(p, obj, call);
    /* For pool_free_check: the heap's free writes only the first word. */
    list->next = (pool_hdr_t *)(p->f.tag | POOL_TAG_RELEASED);
    keel_free((char *)obj - p->hdr_size);
    list = next;
  }
  keel_fetch_add_relaxed(&p->heap_frees, n); /* a statistic: no order needed */
}
