/* Inline callback delivery: see dispatch.h for why and where. */
#include <stdlib.h>
#include <string.h>

#include "base/die.h"
#include "dispatch.h"
#include "mutex.h"

void _keel_dispatch_push(keel_dispatch_t *d, const keel_delivery_t *e) {
  if (keel_unlikely(d->n == d->cap)) {
    uint32_t cap = d->cap * 2;
    keel_delivery_t *v = malloc(cap * sizeof(*v));
    if (v == NULL) keel_die("keel_lock", "out of memory queueing %u lock callbacks", cap);
    memcpy(v, d->v, d->n * sizeof(*v));
    if (d->v != d->inl) free(d->v);
    d->v = v;
    d->cap = cap;
  }
  d->v[d->n++] = *e;
}

void _keel_dispatch_run(keel_dispatch_t *d) {
  for (uint32_t i = 0; i < d->n; i++) {
    keel_delivery_t *e = &d->v[i];
    switch (e->kind) {
      case KEEL_DELIVER_AST:
        e->fn.ast(e->arg);
        break;
      case KEEL_DELIVER_BAST:
        e->fn.bast(e->arg, e->mode);
        break;
      case KEEL_DELIVER_WAKE:
        /* The word was set to 1 under the resource mutex; its waiter may have
         * seen that, returned and freed the lkb holding it already. FUTEX_WAKE
         * on such an address is harmless: the kernel touches no memory for it
         * and at worst wakes an unrelated waiter on reused memory spuriously,
         * which every futex waiter tolerates (glibc's semaphores rely on the
         * same). Doing the system call here keeps it out of the critical
         * section. */
        _keel_lock_futex_wake(e->fn.wake, 1);
        break;
    }
  }
  if (d->v != d->inl) free(d->v);
  keel_dispatch_init(d);
}
