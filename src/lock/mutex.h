/* keel_mutex internals: the inline fast paths, so the lock manager's own
 * critical sections (one per resource operation) cost one CAS to enter and one
 * exchange to leave, with no call into the exported functions. The slow paths
 * live in mutex.c. Never installed.
 *
 * Protocol (Drepper, "Futexes Are Tricky", mutex 2): state 0 free, 1 held,
 * 2 held with possible sleepers. A locker that gives up spinning swaps in 2
 * and sleeps while the old value was not 0; so whoever holds the mutex after a
 * sleeper went to sleep has state 2 and its unlock issues FUTEX_WAKE.
 */
#ifndef KEEL_LOCK_MUTEX_H
#define KEEL_LOCK_MUTEX_H

#include <keel/lock.h>

#include "base/common.h"
#include "base/futex.h"

void _keel_mutex_lock_slow(keel_mutex_t *m) KEEL_HIDDEN;
void _keel_mutex_wake(keel_mutex_t *m) KEEL_HIDDEN;

/* One CAS. Acquire: the critical section's loads see the stores made before
 * the previous holder's release in __keel_mutex_unlock. */
KEEL_INLINE void __keel_mutex_lock(keel_mutex_t *m) {
  uint32_t c = 0;
  if (keel_unlikely(!__atomic_compare_exchange_n(&m->state, &c, 1, false, __ATOMIC_ACQUIRE,
                                                 __ATOMIC_RELAXED)))
    _keel_mutex_lock_slow(m);
}

/* One exchange. Release: publishes the critical section's stores to the next
 * holder's acquire. A FUTEX_WAKE only if someone announced a sleep (2). */
KEEL_INLINE void __keel_mutex_unlock(keel_mutex_t *m) {
  if (keel_unlikely(__atomic_exchange_n(&m->state, 0, __ATOMIC_RELEASE) == 2)) _keel_mutex_wake(m);
}

#endif /* KEEL_LOCK_MUTEX_H */
