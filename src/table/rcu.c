/* RCU for keel's callers: lazy thread registration and read-side sections.
 *
 * liburcu's memb flavour needs each reader thread registered (a mutex and a
 * list insertion, ~1 us) and unregistered before it exits, or grace periods
 * wait for it forever. keel registers a thread the first time it needs to,
 * asking liburcu itself whether the thread is registered (its per-thread
 * reader state), so a thread the application registered is never registered
 * twice, and arms a keel thread-exit hook that unregisters it only if keel
 * registered it.
 *
 * Outside TSan builds this file is compiled with _LGPL_SOURCE so that
 * read_lock/unlock are liburcu's inline versions (a TLS load, an increment
 * and a compiler barrier) instead of a call; the inlined code is under the
 * ten-line LGPL allowance liburcu documents for this purpose.
 */
#if !defined(__SANITIZE_THREAD__)
#define _LGPL_SOURCE
#endif
#include <urcu/urcu-memb.h>
/* For the per-thread `registered` flag, without pulling in the inline
 * read-side code in TSan builds: inlined there, liburcu's grace-period
 * wake-up word would be instrumented while its writers in the library are
 * not, and TSan would report liburcu against itself. */
#include <urcu/static/urcu-memb.h>

#include "base/die.h"
#include "base/tls.h"
#include "table_internal.h"

#if defined(KEEL_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

/* The hook that unregisters the thread; armed iff keel registered it. */
static KEEL_TLS keel_thread_hook_t rcu_exit_hook;

static void rcu_thread_exit(void *arg) {
  (void)arg;
  if (URCU_TLS(urcu_memb_reader).registered) urcu_memb_unregister_thread();
}

bool _keel_rcu_registered(void) {
  return URCU_TLS(urcu_memb_reader).registered;
}

void _keel_rcu_register_slow(void) {
  urcu_memb_register_thread();
  rcu_exit_hook.fn = rcu_thread_exit;
  /* Without a hook (no pthread key could be made) the thread stays
   * registered after exit and later grace periods would wait on it: refuse
   * loudly rather than hang. */
  if (_keel_thread_hook_arm(&rcu_exit_hook) != 0)
    keel_die("keel_table", "cannot arm the thread-exit hook that unregisters RCU readers");
}

#if defined(KEEL_TSAN)
/* Every read-side section releases into this token and each deferred free
 * acquires it after its grace period: exactly the order a grace period
 * guarantees, stated to TSan (one shared sync object; TSan builds only). */
static char rcu_tsan_gp_token;
void _keel_rcu_tsan_gp_acquire(void) {
  __tsan_acquire(&rcu_tsan_gp_token);
}
#define rcu_tsan_section_end() __tsan_release(&rcu_tsan_gp_token)
void _keel_rcu_tsan_handoff_release(void *head) {
  __tsan_release(head);
}
void _keel_rcu_tsan_handoff_acquire(void *head) {
  __tsan_acquire(head);
}
#else
void _keel_rcu_tsan_gp_acquire(void) {}
void _keel_rcu_tsan_handoff_release(void *head) {
  (void)head;
}
void _keel_rcu_tsan_handoff_acquire(void *head) {
  (void)head;
}
#define rcu_tsan_section_end() ((void)0)
#endif

void _keel_rcu_read_lock(void) {
  rcu_ensure_registered();
  urcu_memb_read_lock();
}

void _keel_rcu_read_unlock(void) {
  rcu_tsan_section_end();
  urcu_memb_read_unlock();
}

void keel_table_read_lock(void) {
  _keel_rcu_read_lock();
}

void keel_table_read_unlock(void) {
  _keel_rcu_read_unlock();
}
