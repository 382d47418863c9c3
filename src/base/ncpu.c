/* How many CPUs the process may use: what sizes sched's pool and pheap's
 * arenas.
 *
 * Two limits, the smaller wins:
 *  - the calling thread's affinity mask (taskset, cgroup cpusets), not the
 *    online count;
 *  - the CPU bandwidth quota of the process's cgroup, rounded up: cgroup v2
 *    cpu.max ("QUOTA PERIOD" or "max PERIOD") of its cgroup and of every
 *    ancestor (a parent's limit binds its children), or cgroup v1
 *    cpu.cfs_quota_us / cpu.cfs_period_us. A container given 1.5 CPUs of a
 *    64-CPU host (docker --cpus=1.5, a Kubernetes CPU limit) counts 2, not
 *    64: threads beyond the quota only queue for it.
 * The cgroup path comes from /proc/self/cgroup and is looked up under the
 * usual mount points; in a container with its own cgroup namespace the path
 * is "/" and the mount is the container's own cgroup. Anything unreadable
 * counts as no limit. v1 mounts are looked for under the cgroup root by
 * their controller list (cpu,cpuacct and the like), not in mountinfo: a
 * co-mount under another name or another root reads as no limit. Like the
 * rest of base, no allocation: stack buffers and read(2).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "os.h"

/* Test hooks: where /proc/self/cgroup and the cgroup mounts are. */
const char *_keel_os_cgroup_file = "/proc/self/cgroup";
const char *_keel_os_cgroup_root = "/sys/fs/cgroup";

/* Reads up to cap-1 bytes of a small file, NUL-terminated; false if none. */
static bool read_small(const char *path, char *buf, size_t cap) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n, got = 0;
  while ((size_t)got < cap - 1) {
    n = read(fd, buf + got, cap - 1 - (size_t)got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += n;
  }
  close(fd);
  buf[got] = '\0';
  return got > 0;
}

/* The quota in thousandths of a CPU of one cgroup directory, or 0 if it
 * sets none. v2 names cpu.max; v1 (v1 set) names the cfs pair. */
static uint64_t dir_quota_milli(const char *dir, bool v1) {
  char path[1024], buf[128];
  long long quota = -1, period = 0;
  if (!v1) {
    if (snprintf(path, sizeof path, "%s/cpu.max", dir) >= (int)sizeof path) return 0;
    if (!read_small(path, buf, sizeof buf) || strncmp(buf, "max", 3) == 0) return 0;
    if (sscanf(buf, "%lld %lld", &quota, &period) != 2) return 0;
  } else {
    if (snprintf(path, sizeof path, "%s/cpu.cfs_quota_us", dir) >= (int)sizeof path) return 0;
    if (!read_small(path, buf, sizeof buf) || sscanf(buf, "%lld", &quota) != 1) return 0;
    if (snprintf(path, sizeof path, "%s/cpu.cfs_period_us", dir) >= (int)sizeof path) return 0;
    if (!read_small(path, buf, sizeof buf) || sscanf(buf, "%lld", &period) != 1) return 0;
  }
  /* The bound keeps quota * 1000 in range (kernel quotas are below 2^44). */
  if (quota <= 0 || period <= 0 || quota > (1ll << 50)) return 0;
  /* Rounded up, so the CPU count rounds up too and is never 0. */
  return ((uint64_t)quota * 1000 + (uint64_t)period - 1) / (uint64_t)period;
}

/* The smallest quota along `mount`/`rel` and its ancestors up to `mount`
 * (0: none). rel starts with '/'. */
static uint64_t chain_quota_milli(const char *mount, const char *rel, bool v1) {
  char dir[1024];
  if (snprintf(dir, sizeof dir, "%s%s", mount, strcmp(rel, "/") == 0 ? "" : rel) >= (int)sizeof dir)
    return 0;
  size_t root = strlen(mount);
  uint64_t best = 0;
  for (;;) {
    uint64_t q = dir_quota_milli(dir, v1);
    if (q != 0 && (best == 0 || q < best)) best = q;
    char *slash = strrchr(dir, '/');
    if (slash == NULL || (size_t)(slash - dir) < root) break;
    *slash = '\0';
  }
  return best;
}

/* Whether the comma-separated controller list names `c` exactly. */
static bool has_controller(const char *list, const char *c) {
  size_t n = strlen(c);
  for (const char *t = list;; t++) {
    if (strncmp(t, c, n) == 0 && (t[n] == ',' || t[n] == '\0')) return true;
    if ((t = strchr(t, ',')) == NULL) return false;
  }
}

/* The CPU quota of this process's cgroup in thousandths, 0 if none. */
static uint64_t cgroup_quota_milli(void) {
  char buf[4096];
  if (!read_small(_keel_os_cgroup_file, buf, sizeof buf)) return 0;
  uint64_t best = 0;
  for (char *line = buf, *next; line != NULL && *line; line = next) {
    next = strchr(line, '\n');
    if (next != NULL) *next++ = '\0';
    char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (c2 == NULL || c2[1] != '/') continue;
    *c2 = '\0';
    const char *ctrl = c1 + 1, *rel = c2 + 1;
    /* Outside our cgroup namespace's root ("/../x"): not under the mount. */
    if (strstr(rel, "/..") != NULL) continue;
    uint64_t q = 0;
    char mount[512];
    if (*ctrl == '\0') { /* "0::/path": the v2 unified hierarchy */
      q = chain_quota_milli(_keel_os_cgroup_root, rel, false);
    } else {
      if (!has_controller(ctrl, "cpu")) continue; /* v1: the cpu controller's line */
      /* The mount is usually named by the controller list as the kernel
       * prints it, else by the common spellings. */
      const char *const dirs[] = {ctrl, "cpu,cpuacct", "cpuacct,cpu", "cpu"};
      for (size_t i = 0; i < sizeof dirs / sizeof dirs[0] && q == 0; i++) {
        if (snprintf(mount, sizeof mount, "%s/%s", _keel_os_cgroup_root, dirs[i]) >=
            (int)sizeof mount)
          continue;
        if (access(mount, F_OK) == 0) q = chain_quota_milli(mount, rel, true);
      }
    }
    if (q != 0 && (best == 0 || q < best)) best = q;
  }
  return best;
}

int _keel_os_ncpu(void) {
  int n;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
    n = CPU_COUNT(&set);
  } else {
    long on = sysconf(_SC_NPROCESSORS_ONLN);
    n = on < 1 ? 1 : (int)on;
  }
  uint64_t q = cgroup_quota_milli();
  if (q != 0) {
    uint64_t cpus = (q + 999) / 1000;
    if (cpus < (uint64_t)n) n = (int)cpus;
  }
  return n < 1 ? 1 : n;
}
