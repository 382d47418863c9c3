/* Thread-exit hooks on one pthread key.
 *
 * Every module that keeps per-thread state (heap, pool, sched) needs to hear
 * about thread exit; a pthread key per module would be fine, a key per pool
 * would not (PTHREAD_KEYS_MAX is 1024 and keys above 31 make glibc allocate
 * on pthread_setspecific). So keel creates one key, early, whose value is the
 * head of an intrusive list of hooks armed by that thread. Hooks are owned by
 * their modules: arming never allocates.
 *
 * Invariant: a hook is armed iff it is on its thread's list; `next` is only
 * touched by the owning thread (and by the key destructor, in that thread).
 */
#include "tls.h"

#include <pthread.h>

static pthread_key_t hook_key;
static pthread_once_t hook_once = PTHREAD_ONCE_INIT;
static int hook_key_ok;

/* Marks "armed" for a hook at the end of a list, whose next is NULL too. */
static keel_thread_hook_t hook_tail_sentinel;

static void hooks_run(void *head) {
  keel_thread_hook_t *h = head;
  while (h != NULL && h != &hook_tail_sentinel) {
    keel_thread_hook_t *next = h->next;
    h->next = NULL;
    h->fn(h->arg);
    h = next;
  }
  /* A hook may re-arm during its run (a module that used keel while exiting);
   * glibc calls the destructor again, up to PTHREAD_DESTRUCTOR_ITERATIONS. */
}

static void hook_key_create(void) {
  hook_key_ok = pthread_key_create(&hook_key, hooks_run) == 0;
}

int _keel_thread_hook_arm(keel_thread_hook_t *hook) {
  pthread_once(&hook_once, hook_key_create);
  if (!hook_key_ok) return KEEL_EAGAIN;
  if (hook->next != NULL) return 0; /* already armed */
  keel_thread_hook_t *head = pthread_getspecific(hook_key);
  hook->next = head != NULL ? head : &hook_tail_sentinel;
  if (pthread_setspecific(hook_key, hook) != 0) {
    hook->next = NULL;
    return KEEL_EAGAIN;
  }
  return 0;
}

void _keel_thread_hook_disarm(keel_thread_hook_t *hook) {
  if (!hook_key_ok || hook->next == NULL) return;
  keel_thread_hook_t *head = pthread_getspecific(hook_key);
  if (head == hook) {
    pthread_setspecific(hook_key, hook->next == &hook_tail_sentinel ? NULL : hook->next);
  } else {
    for (keel_thread_hook_t *h = head; h != NULL && h != &hook_tail_sentinel; h = h->next) {
      if (h->next == hook) {
        h->next = hook->next;
        break;
      }
    }
  }
  hook->next = NULL;
}
