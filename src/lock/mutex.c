/* keel_mutex: a three-state futex mutex with a brief adaptive spin.
 *
 * Why a spin at all: a critical section of the lock manager is ~20-50 ns, far
 * shorter than a futex sleep/wake round trip (~2-5 us), so a locker that finds
 * the mutex held is usually better off waiting a few hundred cycles.
 * Why only briefly, and never when others sleep: with hundreds of threads on a
 * few cores the holder is often descheduled; spinning then burns the very CPU
 * it needs (GlusterFS's spinlocks made a multiplexed test 3x slower). So the
 * spin stops at KEEL_MUTEX_SPIN polls, and is skipped when the state is
 * already 2 (someone gave up and sleeps: the mutex is contended beyond what a
 * spin can win).
 */

#include "base/atomic.h"
#include "mutex.h"

/* Polls of the state before sleeping: about the cost of the futex sleep and
 * wake it may save (~2 us), so spinning never costs much more than sleeping
 * would. One poll is one PAUSE: measured 57 ns on the AMD EPYC build host,
 * ~40 ns on Intel Skylake and later, a few ns on older Intel parts. The lock
 * suite's mutex case on the (heavily shared, 2-core) build host could not
 * tell 24, 30 and 100 polls apart from the noise; 100 (~6 us here) is
 * longer than the round trip it saves, so the bound follows the argument. */
#define KEEL_MUTEX_SPIN 32

void _keel_mutex_wake(keel_mutex_t *m) {
  keel_futex_wake(&m->state, 1);
}

KEEL_NOINLINE void _keel_mutex_lock_slow(keel_mutex_t *m) {
  for (int i = 0; i < KEEL_MUTEX_SPIN; i++) {
    uint32_t c = __atomic_load_n(&m->state, __ATOMIC_RELAXED);
    if (c == 2) break; /* sleepers already: join them */
    if (c == 0 &&
        __atomic_compare_exchange_n(&m->state, &c, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
      return;
    keel_cpu_relax();
  }
  /* Announce a sleeper (2) and sleep until an exchange finds it free. The
   * exchange takes the mutex in state 2 even if nobody else sleeps: at worst
   * one needless FUTEX_WAKE at unlock. Acquire as in the fast path. */
  while (__atomic_exchange_n(&m->state, 2, __ATOMIC_ACQUIRE) != 0) keel_futex_wait(&m->state, 2);
}

void keel_mutex_init(keel_mutex_t *m) {
  __atomic_store_n(&m->state, 0, __ATOMIC_RELAXED);
}

void keel_mutex_lock(keel_mutex_t *m) {
  __keel_mutex_lock(m);
}

bool keel_mutex_trylock(keel_mutex_t *m) {
  uint32_t c = 0;
  return __atomic_compare_exchange_n(&m->state, &c, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
}

void keel_mutex_unlock(keel_mutex_t *m) {
  __keel_mutex_unlock(m);
}
