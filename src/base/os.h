/* Memory from the operating system: reserve address space, commit it, give it
 * back. Everything here is a thin, allocation-free layer over mmap, mprotect
 * and madvise, so the heap can call it from inside malloc.
 *
 * States of a range: reserved (PROT_NONE, no memory, no commit charge) ->
 * committed (read-write; pages appear on first touch) -> purged (still
 * read-write, contents dropped, RSS falls; MADV_DONTNEED, or MADV_FREE when
 * `lazy`, which the kernel reclaims only under pressure) -> decommitted
 * (back to PROT_NONE) or retired (read-only zeros: no memory, no commit
 * charge, but every address still reads) -> released (unmapped).
 */
#ifndef KEEL_BASE_OS_H
#define KEEL_BASE_OS_H

#include <stdbool.h>
#include <stddef.h>

#include "common.h"

/* The base page size and the transparent huge page size (2 MiB default). */
size_t _keel_os_page_size(void) KEEL_HIDDEN;
size_t _keel_os_huge_page_size(void) KEEL_HIDDEN;

/* Reserves `size` bytes aligned to `align` (a power of two, at least a page),
 * inaccessible. NULL with errno ENOMEM on failure. */
void *_keel_os_reserve(size_t size, size_t align) KEEL_HIDDEN;

/* Maps `size` read-write bytes aligned to `align`; NULL with errno ENOMEM. */
void *_keel_os_alloc(size_t size, size_t align) KEEL_HIDDEN;

/* Makes a reserved range read-write. 0 or KEEL_ENOMEM. */
int _keel_os_commit(void *p, size_t size) KEEL_HIDDEN;

/* Returns a range's memory and its commit charge; the range stays reserved. */
int _keel_os_decommit(void *p, size_t size) KEEL_HIDDEN;

/* Maps fresh read-only zero pages over a range: its memory and commit
 * charge go back, and any read of it still succeeds (zeros, the kernel's
 * shared zero page); _keel_os_commit makes it read-write again (like a
 * reserved range, then without commit accounting under overcommit modes 0
 * and 1; mode 2 charges it there). 0 or -errno (e.g. ENOMEM at the
 * process's limit of mappings; before Linux 6.12 such a failure could leave
 * the range unmapped). Under mlockall(MCL_FUTURE) the zero pages count as
 * locked. */
int _keel_os_retire(void *p, size_t size) KEEL_HIDDEN;

/* Whether the process's address space is limited (RLIMIT_AS finite). */
bool _keel_os_as_limited(void) KEEL_HIDDEN;

/* Whether the page at p is mapped at all (mincore). */
bool _keel_os_mapped(void *p) KEEL_HIDDEN;

/* Drops a committed range's contents (RSS falls now, or under pressure when
 * lazy); it stays read-write and reads back as zero after a non-lazy purge. */
int _keel_os_purge(void *p, size_t size, bool lazy) KEEL_HIDDEN;

/* Resizes the mapping at p from old to size bytes: in place when to is
 * NULL, else moved onto the reserved range `to` (page tables only, no copy).
 * Returns the new base, or NULL with errno ENOMEM (p is then unchanged). */
void *_keel_os_remap(void *p, size_t old, size_t size, void *to) KEEL_HIDDEN;

/* Unmaps a range. */
int _keel_os_release(void *p, size_t size) KEEL_HIDDEN;

/* Asks for transparent huge pages on a range (advice only). */
void _keel_os_advise_huge(void *p, size_t size) KEEL_HIDDEN;

/* Fault injection, for tests of out-of-memory paths (compiled into every
 * build, off unless a test turns it on). After _keel_os_fault_set(n) with
 * n >= 0, the next n calls that obtain memory (_keel_os_reserve,
 * _keel_os_alloc, _keel_os_commit, a growing _keel_os_remap) succeed and
 * every later one fails as if the kernel refused it (NULL + ENOMEM, or KEEL_ENOMEM), until
 * _keel_os_fault_set(-1). Cost while off: one relaxed load per call that is
 * about to make a system call. Any thread may call it. */
void _keel_os_fault_set(long n) KEEL_HIDDEN;
/* Calls failed by the injection since start (tests check they hit it). */
size_t _keel_os_fault_hits(void) KEEL_HIDDEN;

/* The process's resident set size in KiB (from /proc/self/statm), or 0. */
size_t _keel_os_rss_kb(void) KEEL_HIDDEN;

/* CPUs the process may use, at least 1: the calling thread's affinity mask
 * (taskset and cgroup cpusets narrow it, the online count does not), capped
 * by its cgroup's CPU quota rounded up (ncpu.c). What sizes thread pools
 * and arenas. */
int _keel_os_ncpu(void) KEEL_HIDDEN;
/* Tests: where ncpu.c reads /proc/self/cgroup and finds the cgroup mounts. */
extern const char *_keel_os_cgroup_file KEEL_HIDDEN;
extern const char *_keel_os_cgroup_root KEEL_HIDDEN;

#endif /* KEEL_BASE_OS_H */
