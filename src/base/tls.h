/* Thread-local storage for keel.
 *
 * Two builds of the same sources exist (see CMakeLists.txt):
 *  - libkeel.so / libkeel.a: the default TLS model, so that libkeel.so can be
 *    dlopen'ed after start-up ("cannot allocate memory in static TLS block" is
 *    what initial-exec costs a dlopen'ed library: jemalloc #937, mimalloc #147).
 *    On x86-64 gcc is given -mtls-dialect=gnu2 so a dynamic TLS access is a
 *    TLS descriptor call of a few instructions, not __tls_get_addr.
 *  - libkeel-malloc.so (KEEL_MALLOC_OVERRIDE): initial-exec, one %fs-relative
 *    load. It is preloaded or linked at start-up, never dlopen'ed, so its
 *    static TLS block is always reserved.
 *
 * keel_thread_exit_hook() gives a module a callback at thread exit without a
 * pthread key of its own per object (the key count is limited to 1024).
 */
#ifndef KEEL_BASE_TLS_H
#define KEEL_BASE_TLS_H

#include "common.h"

#if defined(KEEL_MALLOC_OVERRIDE)
#define KEEL_TLS __thread __attribute__((tls_model("initial-exec")))
#else
#define KEEL_TLS __thread
#endif

typedef struct keel_thread_hook {
  void (*fn)(void *arg); /* called once in the exiting thread, in reverse order of arming */
  void *arg;
  struct keel_thread_hook *next; /* owned by tls.c while armed */
} keel_thread_hook_t;

/* Arms *hook to run when the calling thread exits (once; re-arming an armed
 * hook is a no-op). The hook memory must stay valid until it runs or is
 * disarmed. Does not allocate. Returns 0 or KEEL_EAGAIN if no pthread key
 * could be created. */
int _keel_thread_hook_arm(keel_thread_hook_t *hook) KEEL_HIDDEN;

/* Disarms a hook armed by the calling thread; safe if it is not armed. */
void _keel_thread_hook_disarm(keel_thread_hook_t *hook) KEEL_HIDDEN;

#endif /* KEEL_BASE_TLS_H */
