/* C11 atomics with the memory order spelled in the name, so that every
 * atomic step in keel states its ordering where it is written. Each use of an
 * acquire/release/seq_cst operation carries a comment saying which stores it
 * orders against which loads; relaxed ones say why no order is needed.
 */
#ifndef KEEL_BASE_ATOMIC_H
#define KEEL_BASE_ATOMIC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common.h"

#define keel_atomic(T) _Atomic(T)

#define keel_load_relaxed(p)     atomic_load_explicit((p), memory_order_relaxed)
#define keel_load_acquire(p)     atomic_load_explicit((p), memory_order_acquire)
#define keel_store_relaxed(p, v) atomic_store_explicit((p), (v), memory_order_relaxed)
#define keel_store_release(p, v) atomic_store_explicit((p), (v), memory_order_release)

#define keel_xchg_acq_rel(p, v) atomic_exchange_explicit((p), (v), memory_order_acq_rel)
#define keel_xchg_acquire(p, v) atomic_exchange_explicit((p), (v), memory_order_acquire)
#define keel_xchg_release(p, v) atomic_exchange_explicit((p), (v), memory_order_release)

#define keel_fetch_add_relaxed(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define keel_fetch_add_acq_rel(p, v) atomic_fetch_add_explicit((p), (v), memory_order_acq_rel)
#define keel_fetch_sub_relaxed(p, v) atomic_fetch_sub_explicit((p), (v), memory_order_relaxed)
#define keel_fetch_sub_acq_rel(p, v) atomic_fetch_sub_explicit((p), (v), memory_order_acq_rel)
#define keel_fetch_or_acq_rel(p, v)  atomic_fetch_or_explicit((p), (v), memory_order_acq_rel)
#define keel_fetch_and_acq_rel(p, v) atomic_fetch_and_explicit((p), (v), memory_order_acq_rel)

/* Weak CAS for retry loops; *expected is updated on failure. */
#define keel_cas_weak_acq_rel(p, expected, desired)                                                \
  atomic_compare_exchange_weak_explicit((p), (expected), (desired), memory_order_acq_rel,          \
                                        memory_order_acquire)
#define keel_cas_weak_release(p, expected, desired)                                                \
  atomic_compare_exchange_weak_explicit((p), (expected), (desired), memory_order_release,          \
                                        memory_order_relaxed)
#define keel_cas_strong_acq_rel(p, expected, desired)                                              \
  atomic_compare_exchange_strong_explicit((p), (expected), (desired), memory_order_acq_rel,        \
                                          memory_order_acquire)

#define keel_fence_seq_cst() atomic_thread_fence(memory_order_seq_cst)
#define keel_fence_acquire() atomic_thread_fence(memory_order_acquire)
#define keel_fence_release() atomic_thread_fence(memory_order_release)

/* A spin-wait hint: PAUSE on x86 (lets the sibling hyperthread run and
 * avoids the memory-order machine clear on loop exit), YIELD on arm64. */
KEEL_INLINE void keel_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");
#else
  atomic_signal_fence(memory_order_seq_cst);
#endif
}

#endif /* KEEL_BASE_ATOMIC_H */
