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

#endif
