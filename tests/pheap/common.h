/* Helpers shared by the pheap tests: pool paths, file fingerprints. */
#ifndef KEEL_TESTS_PHEAP_COMMON_H
#define KEEL_TESTS_PHEAP_COMMON_H

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <keel/pheap.h>

/* A fresh pool path under /dev/shm (or /tmp), removed first. */
static inline const char *tp_path(char *buf, size_t len, const char *tag) {
  const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf(buf, len, "%s/keel-pheap-test-%d-%s", dir, (int)getpid(), tag);
  unlink(buf);
  return buf;
}

/* A fingerprint of a file's bytes and size (to show a failed open left it
 * untouched). */
static inline uint64_t tp_fingerprint(const char *path) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return 0;
  uint64_t h = 1469598103934665603ull;
  unsigned char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0)
    for (ssize_t i = 0; i < n; i++) h = (h ^ buf[i]) * 1099511628211ull;
  struct stat st;
  fstat(fd, &st);
  close(fd);
  return h ^ (uint64_t)st.st_size;
}

/* A deferrer for keel_pheap_set_deferrer: one worker thread that runs the
 * jobs it is handed (the pool keeps at most one outstanding). Stands in for
 * a keel sched job. */
#include <pthread.h>
#include <stdbool.h>
typedef struct tp_worker {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  keel_pheap_work_fn fn;
  void *arg;
  bool stop;
  long ran;
  pthread_t th;
} tp_worker_t;

static void *tp_worker_main(void *p) {
  tp_worker_t *w = p;
  pthread_mutex_lock(&w->lock);
  for (;;) {
    while (!w->fn && !w->stop) pthread_cond_wait(&w->cond, &w->lock);
    if (!w->fn) break;
    keel_pheap_work_fn fn = w->fn;
    void *arg = w->arg;
    w->fn = NULL;
    pthread_mutex_unlock(&w->lock);
    fn(arg);
    pthread_mutex_lock(&w->lock);
    w->ran++;
  }
  pthread_mutex_unlock(&w->lock);
  return NULL;
}

static inline int tp_defer(void *arg, keel_pheap_work_fn fn, void *work_arg) {
  tp_worker_t *w = arg;
  pthread_mutex_lock(&w->lock);
  int rc = w->fn || w->stop ? -1 : 0;
  if (rc == 0) {
    w->fn = fn;
    w->arg = work_arg;
    pthread_cond_signal(&w->cond);
  }
  pthread_mutex_unlock(&w->lock);
  return rc;
}

static inline void tp_worker_start(tp_worker_t *w) {
  pthread_mutex_init(&w->lock, NULL);
  pthread_cond_init(&w->cond, NULL);
  w->fn = NULL;
  w->stop = false;
  w->ran = 0;
  pthread_create(&w->th, NULL, tp_worker_main, w);
}

/* Runs what is queued, then joins. */
static inline void tp_worker_stop(tp_worker_t *w) {
  pthread_mutex_lock(&w->lock);
  w->stop = true;
  pthread_cond_signal(&w->cond);
  pthread_mutex_unlock(&w->lock);
  pthread_join(w->th, NULL);
  pthread_mutex_destroy(&w->lock);
  pthread_cond_destroy(&w->cond);
}

#endif
