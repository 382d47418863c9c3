/* pheap internals: the on-media format and the volatile handle.
 *
 * File layout (all offsets from the pool base; every region page aligned):
 *
 *   [0, 4 KiB)         pool header: the immutable part (magic, version,
 *                      layout, geometry) under one checksum, then on its own
 *                      cache line the mutable words (size, root, epoch,
 *                      checkpoint watermark), each one 64-bit store.
 *   [4 KiB, heap_off)  NLANES lanes of LANE_BYTES: a redo log ring (16 KiB)
 *                      and an undo log (48 KiB, extended by a chain of
 *                      overflow blocks taken from the heap, tx.c). A thread
 *                      holds a lane for one atomic operation or one whole
 *                      transaction.
 *   [heap_off, size)   zones: PH_ZONE_META bytes of chunk words (one per
 *                      chunk), then up to PH_ZONE_CHUNKS chunks of 256 KiB;
 *                      the pool ends inside its last zone (a partial zone:
 *                      its chunk words are all there, its chunks only up to
 *                      the pool's size). A chunk word of 0 is a free chunk,
 *                      so extending the file (zero fill) adds free chunks with
 *                      no other write; a run or huge object is described only
 *                      by the word of its first chunk (the others stay 0).
 *                      An extent never crosses a zone.
 *
 * Zone size (format 2): one extent must hold the largest object,
 * KEEL_PHEAP_MAX_ALLOC with its 16-byte header, 2^16 + 1 chunks; a zone has
 * that rounded up to a whole 4 KiB page of chunk words, 66048 chunks (16.1
 * GiB) under 129 pages (516 KiB) of words. Format 1 had 512-chunk zones (128
 * MiB under one page), so nothing larger than 128 MiB could be allocated;
 * its pools are refused by version (KEEL_EVERSION): its chunks and chunk
 * words lie at other offsets.
 * The wider words cost a small pool 512 KiB of its size (at the 8 MiB
 * minimum, 13 chunks instead of format 1's 15) but no memory or disk beyond
 * the pages used: a page of words is written only once a chunk it describes
 * is (the file stays sparse there), and one zone serves pools up to 16 GiB.
 *
 * Runs: a run of k chunks holds blocks of one size; it starts with a 64-byte
 * run header and an allocation bitmap (bit set = allocated). The bitmap is
 * the only persistent truth about a block, so free is one 64-bit AND plus its
 * flush. Every block starts with the 16-byte object header
 * {requested size, type}; the user's offset points just past it.
 *
 * Seq numbers order logs for recovery: seq = epoch << 40 | counter, where the
 * epoch is bumped (and persisted) at every open, so seqs never repeat across
 * sessions and every new seq is above the watermark recovery left.
 */
#ifndef KEEL_PHEAP_INT_H
#define KEEL_PHEAP_INT_H

#include <pthread.h>
#include <stdint.h>

#include <keel/pheap.h>

#include "base/atomic.h"
#include "base/common.h"

#define PH_MAGIC          "KEELPHP"
#define PH_VERSION        2u /* 1: 512-chunk zones (see the file comment) */
#define PH_HDR_BYTES      4096u
#define PH_CHUNK          ((uint64_t)256 << 10)
#define PH_ZONE_CHUNKS    66048u /* (2^16 + 1) chunks rounded up to a page of words */
#define PH_ZONE_META      ((uint64_t)PH_ZONE_CHUNKS * 8)
#define PH_ZONE_BYTES     (PH_ZONE_META + PH_ZONE_CHUNKS * PH_CHUNK)
/* Log lanes: threads beyond this wait for a lane (measured: 16 lanes lost 2x
 * to libpmemobj at 256 threads); transactions take PH_TX_LANES of them. */
#define PH_NLANES         64u
/* Lanes no transaction takes: what a thread that holds a lane or root_lock
 * waits on (log.c). Two, so that such waits do not all queue on one. */
#define PH_ATOMIC_LANES   2u
#define PH_TX_LANES       (PH_NLANES - PH_ATOMIC_LANES)
#define PH_REDO_BYTES     (16u << 10)
#define PH_LANE_BYTES     ((uint64_t)64 << 10)
#define PH_UNDO_BYTES     (PH_LANE_BYTES - PH_REDO_BYTES)
#define PH_OBJ_HDR        16u
#define PH_RUN_HDR        64u
#define PH_MAX_RUN_CHUNKS 16u
#define PH_LINE           64u
/* seq = epoch << 40 | counter must not wrap: a pool whose epoch has reached
 * this (after 2^24 - 1 opens, or corrupted) is not opened. */
#define PH_EPOCH_LIMIT    ((1ull << 24) - 1)

_Static_assert(PH_ZONE_CHUNKS *PH_CHUNK >= KEEL_PHEAP_MAX_ALLOC + PH_OBJ_HDR,
               "a zone holds the largest object");
_Static_assert(PH_ZONE_META % 4096 == 0, "chunks start page aligned");

/* Chunk word: type in the top byte, length in chunks in the low 32 bits. */
#define PH_CW_FREE       0u
#define PH_CW_RUN        1u
#define PH_CW_HUGE       2u
#define PH_CW_TYPE(w)    ((unsigned)((w) >> 56))
#define PH_CW_LEN(w)     ((uint32_t)(w))
#define PH_CW_MAKE(t, n) (((uint64_t)(t) << 56) | (uint32_t)(n))

/* The immutable header, covered by `csum`. */
typedef struct ph_header {
  char magic[8];
  uint32_t version;
  uint32_t hdr_bytes;
  char layout[KEEL_PHEAP_LAYOUT_MAX + 1];
  uint64_t nlanes, lane_bytes, lanes_off;
  uint64_t heap_off, chunk_bytes, zone_chunks;
  uint64_t flags; /* KEEL_PHEAP_FIXED, KEEL_PHEAP_SPARSE */
  uint64_t uuid[2];
  uint64_t reserved[12];
  uint64_t csum; /* over every byte before it */
  /* Mutable words, each checked on its own, on their own line. */
  uint64_t size_word KEEL_CACHE_ALIGNED; /* pool bytes/4096 (40 bits) | check (24 bits) */
  uint64_t root_off;                     /* set by an atomic alloc */
  uint64_t epoch;                        /* bumped at each open */
  uint64_t ckpt_seq;                     /* logs at or below it are applied and durable */
} ph_header_t;

/* Redo logs live in a per-lane ring of PH_REDO_BYTES: a log is a 48-byte
 * header and its entries, starting on a cache line; it occupies whole lines.
 * Entries are (word offset | op, value) applied in order. */
/* CHK: not applied; (off, len) names bytes that had to be durable no later
 * than the log (a transaction's new data): the log's `dsum` covers them, so
 * a log that became durable in the same barrier as data that did not is
 * recognised as never committed (see log.c). */
/* COVER: not applied, not checksummed; (off, len) names bytes a committed
 * transaction wrote that a barrier made durable before the log (past the CHK
 * budget). Recovery, like for CHK, replays no older log's store into them. */
enum { PH_OP_SET = 0, PH_OP_OR = 1, PH_OP_ANDNOT = 2, PH_OP_CHK = 3, PH_OP_COVER = 4 };
/* A CHK entry names bytes exactly: the word offset in off_op, and in val the
 * byte within that word the range starts at (bits 32-34) and its length
 * (bits 0-31: at most PH_CHK_MAX_BYTES). COVER's val is a plain length.
 * Older libraries (format version 2 too) wrote only whole-word CHK ranges,
 * which read the same here; a commit log with a range starting mid-word,
 * left by a crash, must be recovered by this library or a later one (an
 * older one refuses it as naming bytes outside the pool). */
#define PH_CHK_VAL(off, len) ((((uint64_t)(off)&7) << 32) | (uint64_t)(len))
/* New-object bytes a transaction with no snapshot carries in its commit log
 * as SET entries (16 log bytes per word), sparing the barrier that would
 * otherwise order them before the log (tx.c). */
#define PH_TX_BODY_BYTES     256u
/* Data a log may vouch for by checksum; beyond it a barrier orders the data
 * first. */
#define PH_CHK_MAX_BYTES                                                                           \
  1024u /* past it an ordering barrier beats checksumming (measured, 4 KiB ranges) */
typedef struct ph_redo_entry {
  uint64_t off_op; /* 8-aligned pool offset | op in the low 3 bits */
  uint64_t val;
} ph_redo_entry_t;

/* A CHK entry's bytes (PH_CHK_VAL). */
static inline void ph_chk_range(const ph_redo_entry_t *e, uint64_t *lo, uint64_t *len) {
  *lo = (e->off_op & ~(uint64_t)7) + ((e->val >> 32) & 7);
  *len = (uint32_t)e->val;
}
typedef struct ph_redo {
  uint64_t seq; /* global order; valid only above the header's ckpt_seq */
  uint64_t tx;  /* undo seq this log commits, or 0 */
  uint64_t n;
  uint64_t dsum; /* over the bytes the CHK entries name, in order */
  uint64_t pad;
  uint64_t csum; /* over the header words above and the n entries */
  ph_redo_entry_t e[];
} ph_redo_t;
#define PH_REDO_HDR   48u
#define PH_REDO_MAX   ((PH_REDO_BYTES - PH_REDO_HDR) / sizeof(ph_redo_entry_t))
#define PH_RING_LINES (PH_REDO_BYTES / PH_LINE)

/* An undo log: header line, then entries {off, len, csum, data padded to 8}
 * appended in order; a segment ends at the first entry whose checksum (which
 * covers the tx seq) fails. Past the lane's 48 KiB the log goes on in a chain
 * of overflow blocks (`next`): each is a heap block that stays free in its
 * run's bitmap (a volatile reservation, so a crash leaks nothing) and starts
 * with the same seq, so a stale link or block from an older transaction ends
 * the chain. A link is durable before any entry is written past it. */
typedef struct ph_undo {
  uint64_t seq;  /* the open transaction's seq, 0: none */
  uint64_t next; /* first overflow block (pool offset of its header), 0: none */
  uint64_t pad[6];
  uint8_t data[PH_UNDO_BYTES - 64];
} ph_undo_t;
typedef struct ph_undo_ovf {
  uint64_t seq;  /* the transaction's seq; any other value: not in the chain */
  uint64_t next; /* next block, 0: none */
  uint64_t cap;  /* data bytes, PH_OVF_CAP */
  uint64_t pad[5];
  uint8_t data[];
} ph_undo_ovf_t;
/* Overflow block: one whole chunk (user bytes after the object header,
 * whose size word give reads), so 200 KiB of snapshots take one block and
 * one checkpoint; a chunk because a run class this large would span a
 * 4 MiB run. */
#define PH_OVF_BYTES (PH_CHUNK - PH_OBJ_HDR)
#define PH_OVF_CAP   (PH_OVF_BYTES - sizeof(ph_undo_ovf_t))
/* Overflow blocks a lane keeps for its next transaction (volatile): at most
 * 64 lanes x 256 KiB held back, only by lanes whose transactions overflow. */
#define PH_OVF_KEEP  1u
typedef struct ph_undo_entry {
  uint64_t off, len, csum;
} ph_undo_entry_t;

typedef struct ph_run_hdr {
  uint32_t block; /* block bytes including the object header */
  uint32_t nblocks;
  uint32_t data_off; /* first block, from the run start */
  uint32_t magic;
  uint64_t pad[6];
} ph_run_hdr_t;
#define PH_RUN_MAGIC 0x52554e31u

typedef struct ph_objhdr {
  uint64_t size;
  uint64_t type;
} ph_objhdr_t;

/* ---- allocation classes (classes.c) ---- */
typedef struct ph_class {
  uint32_t block;   /* bytes per block including the header */
  uint32_t chunks;  /* chunks per run */
  uint32_t nblocks; /* blocks per run */
  uint32_t data_off;
} ph_class_t;
extern ph_class_t _keel_ph_classes[] KEEL_HIDDEN;
extern unsigned _keel_ph_nclasses KEEL_HIDDEN;
void _keel_ph_classes_init(void) KEEL_HIDDEN;
/* Class for a block of `block` bytes, or -1 if it needs a huge extent. */
int _keel_ph_class_of(uint64_t block) KEEL_HIDDEN;

/* ---- volatile state ---- */
typedef struct ph_run {
  uint32_t chunk; /* global chunk index of its first chunk */
  uint32_t cls;
  uint32_t navail; /* bits set in vfree */
  /* Whose partial list it joins. Changes only under the classq locks of
   * both the old and the new arena (adoption), so a reader that locked
   * its arena's list and then reads it unchanged may use that list. */
  keel_atomic(uint32_t) arena;
  bool listed; /* on its arena's partial list of its class */
  struct ph_run *next;
  uint64_t *vfree; /* free and not handed to any cache */
} ph_run_t;

/* Arenas: every run belongs to one, and a thread cache refills from its
 * own arena's runs. Threads in different arenas then never share a run, so
 * their allocations and frees never write the same bitmap line (a line two
 * threads' atomic ORs and flushes pass back and forth: publish-1 ran no
 * faster at 2 threads than at 1 with one shared list per class). Blocks a
 * thread frees go back to the run's arena. A cache with no run of its own
 * adopts a run another arena is not drawing from before it makes one
 * (heap.c: refill). One per CPU, at least
 * PH_ARENAS_MIN (oversubscribed threads spread further), PH_ARENAS_MAX at
 * most (each keeps a partly used run per class it serves). */
#define PH_ARENAS_MIN 4u
#define PH_ARENAS_MAX 64u

typedef struct ph_classq {
  pthread_mutex_t lock;
  ph_run_t *partial; /* runs with navail > 0 */
} KEEL_CACHE_ALIGNED ph_classq_t;

#define PH_TC_MAX 16
typedef struct ph_tcache ph_tcache_t;

/* A lane: its log ring and undo log, and (volatile) where the next log goes,
 * the seq of the operation between its log write and its apply (0: none),
 * and the lines its atomic operations changed without flushing them (the
 * next checkpoint flushes them). */
#define PH_DIRTY_MAX 256
typedef struct ph_lane {
  pthread_mutex_t lock;
  char *ring;
  ph_undo_t *undo;
  unsigned idx;
  unsigned ring_pos;                  /* next free line in the ring */
  keel_atomic(uint64_t) ring_max_seq; /* highest seq of a log in the ring (any kind) */
  keel_atomic(uint64_t) inflight;
  keel_atomic(uint32_t) dirty_lock; /* a spin lock: dirty_lock() in log.c */
  unsigned ndirty;
  uint64_t dirty[PH_DIRTY_MAX]; /* line offsets */
  /* Overflow blocks kept reserved for the lane's next transaction (under
   * `lock`): no log can store into them, so reuse needs no checkpoint. */
  unsigned nkeep;
  keel_poff_t keep[PH_OVF_KEEP];
} KEEL_CACHE_ALIGNED ph_lane_t;

struct ph_tcache {
  keel_pheap_t *ph;
  uint64_t id;
  ph_tcache_t *next; /* ph->caches, under ph->lock */
  unsigned lane_hint;
  /* Held by this thread's open transaction, or NULL; close reads it from
   * another thread. */
  keel_atomic(ph_lane_t *) tx_lane;
  bool flying;    /* a log of this thread is in flight (_keel_ph_log_seq) */
  unsigned arena; /* whose runs refill this cache */
  uint64_t flushes, barriers;
  uint64_t tx_commits, tx_aborts; /* per cache: a shared counter cost a line transfer per tx */
  /* msync mode: the span of the pages flushed since the last drain
   * (ms_lo == ms_hi: none), which the drain syncs in one call. */
  uint64_t ms_lo, ms_hi;
  /* simulated media: lines flushed since the last drain */
  uint64_t *sim_lines;
  unsigned sim_n, sim_cap;
  struct {
    uint32_t n;
    uint64_t off[PH_TC_MAX];
  } c[]; /* per class */
};

struct keel_pheap {
  struct keel_pheap_view_ view; /* must be first: keel_pheap_ptr reads it */
  keel_atomic(uint64_t) size;   /* mapped and usable bytes */
  uint64_t reserve;             /* reserved address space */
  uint64_t id;
  unsigned gen; /* _keel_ph_fork_gen when opened: another means a forked child */
  int fd;
  int flush_mode; /* KEEL_FLUSH_* resolved */
  bool sim;       /* simulated media: private map, pwrite at drain */
  bool ram_fs;    /* the file is on a memory file system (msync mode: see persist.c) */
  bool fixed;
  bool sparse; /* growth leaves holes (KEEL_PHEAP_SPARSE) */
  char *path;
  ph_header_t *hdr;
  /* Every log draws from it: a line of its own, so the fields read on every
   * operation (above) do not move between CPUs with it. */
  KEEL_CACHE_ALIGNED keel_atomic(uint64_t) seq;
  KEEL_CACHE_ALIGNED pthread_mutex_t lock; /* chunks, growth, caches list */
  pthread_mutex_t root_lock;               /* first keel_pheap_root */
  ph_tcache_t *caches;
  uint8_t *chunk_free;           /* per global chunk: 1 free (volatile) */
  ph_run_t **chunk_run;          /* per global chunk: the run it heads */
  keel_atomic(uint32_t) nchunks; /* chunks that exist now (grows under lock) */
  /* Chunks [0, booted) have their volatile state (chunk_free, chunk_run,
   * runs on partial lists) built from media; beyond it nothing is known yet.
   * Grows under `lock` (heap.c: lazy rebuild); release-stored. */
  keel_atomic(uint32_t) booted;
  uint32_t chunk_cap;  /* array capacity */
  ph_classq_t *classq; /* [arena * _keel_ph_nclasses + class] */
  unsigned narenas;
  keel_atomic(unsigned) arena_rr; /* the next cache's arena */
  ph_lane_t lanes[PH_NLANES];
  pthread_mutex_t ckpt_lock;          /* one checkpoint at a time */
  keel_atomic(uint32_t) ckpt_busy;    /* a hint: ckpt_lock is held (log.c: ckpt_enter) */
  keel_atomic(uint32_t) ckpt_spinner; /* a thread spins for ckpt_lock */
  keel_atomic(uint64_t) ckpt_seq;     /* volatile copy of hdr->ckpt_seq */
  keel_atomic(uint64_t) grows;
  uint64_t recovered;
  /* Counters of caches retired (their threads exited or were evicted). */
  keel_atomic(uint64_t) dead_flushes, dead_barriers, dead_tx_commits, dead_tx_aborts;
  /* Background checkpoints (keel_pheap_set_deferrer): defer_req is 1 from
   * a request until its job ends (one outstanding); defer_done counts them. */
  keel_pheap_defer_fn defer;
  void *defer_arg;
  keel_atomic(uint32_t) defer_req;
  keel_atomic(uint64_t) defer_done;
};

/* A cache's counter: only its thread writes it, keel_pheap_stats reads it
 * meanwhile (relaxed: a plain load and store on x86). */
KEEL_INLINE void ph_tc_count(uint64_t *c) {
  __atomic_store_n(c, *c + 1, __ATOMIC_RELAXED);
}

/* ---- geometry helpers ---- */
KEEL_INLINE uint64_t ph_zone_off(const keel_pheap_t *ph, uint32_t z) {
  return ph->hdr->heap_off + (uint64_t)z * PH_ZONE_BYTES;
}
KEEL_INLINE uint64_t *ph_cword(const keel_pheap_t *ph, uint32_t chunk) {
  return (uint64_t *)(ph->view.base + ph_zone_off(ph, chunk / PH_ZONE_CHUNKS)) +
         chunk % PH_ZONE_CHUNKS;
}
KEEL_INLINE uint64_t ph_chunk_off(const keel_pheap_t *ph, uint32_t chunk) {
  return ph_zone_off(ph, chunk / PH_ZONE_CHUNKS) + PH_ZONE_META +
         (uint64_t)(chunk % PH_ZONE_CHUNKS) * PH_CHUNK;
}
/* The chunk holding offset `off`, or UINT32_MAX outside the chunk space. */
uint32_t _keel_ph_chunk_at(const keel_pheap_t *ph, uint64_t off) KEEL_HIDDEN;
/* Chunks that fit in a pool of `size` bytes with heap at heap_off. */
uint32_t _keel_ph_chunks_for(uint64_t heap_off, uint64_t size) KEEL_HIDDEN;

/* ---- checksums and header words (format.c) ---- */
uint64_t _keel_ph_csum(const void *p, size_t len, uint64_t seed) KEEL_HIDDEN;
uint64_t _keel_ph_size_word(uint64_t size) KEEL_HIDDEN;
/* Size from a size word, or 0 if its check fails. */
uint64_t _keel_ph_size_from_word(uint64_t w) KEEL_HIDDEN;
/* Validates a header read from `path` of `file_size` bytes; 0 or error with
 * the message set. */
int _keel_ph_header_check(const ph_header_t *h, const char *path, uint64_t file_size,
                          const char *layout) KEEL_HIDDEN;
/* Sets this thread's keel_pheap_errmsg text; returns err. */
int _keel_ph_err(int err, const char *path, const char *fmt, ...) KEEL_PRINTF(3, 4) KEEL_HIDDEN;

/* ---- persistence (persist.c) ---- */
/* Flush-site ids for fault injection (tests remove one site at a time). */
enum ph_site {
  PH_S_NONE = 0,
  PH_S_REDO,       /* redo log before the barrier that commits it */
  PH_S_APPLY,      /* redo entries applied */
  PH_S_UNDO,       /* undo entry's header before the caller may store */
  PH_S_UNDO_INV,   /* undo invalidation at commit */
  PH_S_TXDATA,     /* snapshot ranges' new contents at commit */
  PH_S_TXNEW,      /* objects allocated by the transaction at commit */
  PH_S_ROLLBACK,   /* restored bytes at abort/recovery */
  PH_S_RUN,        /* run header + bitmap before the chunk word (PH_S_RUN_CWORD) */
  PH_S_CKPT,       /* deferred lines at a checkpoint */
  PH_S_SNAPSHOT,   /* not a flush: the snapshot copy in keel_tx_add_range */
  PH_S_PERSIST,    /* keel_pheap_persist's range */
  PH_S_GIVEBACK,   /* an empty run's chunk word, given back */
  PH_S_WMARK,      /* the watermark a checkpoint raises */
  PH_S_EPOCH,      /* the epoch open raises */
  PH_S_GROW,       /* the size word growth raises */
  PH_S_REC_TORN,   /* recovery: a torn commit log retired */
  PH_S_REC_UNDO,   /* recovery: an undo log emptied */
  PH_S_ABORT_INV,  /* undo log emptied after an abort's rollback */
  PH_S_UNDO_TAIL,  /* an undo entry's padded last word (a length not a multiple of 8) */
  PH_S_DIRTY_FULL, /* a line flushed at once: its lane's checkpoint list was full */
  PH_S_ZBODY,      /* zalloc's zeroed body before its allocation is logged */
  PH_S_RUN_CWORD,  /* a new run's chunk word */
  PH_S_UNDO_START, /* an undo log's seq and first link, at its first snapshot */
  PH_S_UNDO_BODY,  /* an undo entry's whole words */
  PH_S_UNDO_OVF,   /* an undo overflow block's header */
  PH_S_UNDO_LINK,  /* the link to an undo overflow block */
  PH_S_COUNT
};
extern int _keel_ph_fault KEEL_HIDDEN; /* site to skip, PH_S_NONE normally */
/* Called at the start of every persist barrier with the running count (tests
 * crash the process there). NULL normally. */
extern void (*_keel_ph_barrier_hook)(keel_pheap_t *ph, ph_tcache_t *tc) KEEL_HIDDEN;
/* When set before open/create, pools use simulated media (tests). */
extern bool _keel_ph_sim_next KEEL_HIDDEN;
/* posix_fallocate calls on pool files (tests: open of a whole pool makes none). */
extern keel_atomic(unsigned long) _keel_ph_reserve_calls KEEL_HIDDEN;

void _keel_pm_flush(keel_pheap_t *ph, ph_tcache_t *tc, const void *p, size_t len,
                    enum ph_site site) KEEL_HIDDEN;
void _keel_pm_drain(keel_pheap_t *ph, ph_tcache_t *tc) KEEL_HIDDEN;
/* Copies len bytes (8-aligned) to pool memory with non-temporal stores where
 * the mode flushes by CPU instruction (the lines need no flush then), else
 * memcpy + flush. The caller drains. */
void _keel_pm_write_nt(keel_pheap_t *ph, ph_tcache_t *tc, void *dst, const void *src, size_t len,
                       enum ph_site site) KEEL_HIDDEN;
int _keel_pm_mode(keel_pheap_t *ph) KEEL_HIDDEN;                    /* resolves pheap_flush */
const char *_keel_pm_mode_name(const keel_pheap_t *ph) KEEL_HIDDEN; /* for print_info */
/* Simulated media: writes a seeded subset of the lines flushed but not yet
 * drained (torn at 8-byte granularity when `torn`), as a crash would. */
void _keel_pm_sim_crash(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t seed, bool torn) KEEL_HIDDEN;
/* Copies every byte of the mapping to the file (sim mode close). */
void _keel_pm_sim_writeall(keel_pheap_t *ph) KEEL_HIDDEN;

/* ---- thread caches (tcache.c) ---- */
ph_tcache_t *_keel_ph_tcache(keel_pheap_t *ph) KEEL_HIDDEN;
/* Bumped in a forked child (pthread_atfork, tcache.c). A pool opened under
 * another generation was opened by the parent, which still uses the shared
 * mapping: the child may read it and close it (forgetting its copy, the
 * file untouched), nothing else. */
extern keel_atomic(unsigned) _keel_ph_fork_gen KEEL_HIDDEN;
KEEL_NORETURN void _keel_ph_forked_die(keel_pheap_t *ph, const char *call) KEEL_HIDDEN;
static inline bool _keel_ph_forked(keel_pheap_t *ph) {
  return ph->gen != keel_load_relaxed(&_keel_ph_fork_gen);
}
#define PH_NOT_FORKED(ph, call)                                                                    \
  do {                                                                                             \
    if (keel_unlikely(_keel_ph_forked(ph))) _keel_ph_forked_die(ph, call);                         \
  } while (0)
/* Close in a forked child: this thread's slots and the pool's caches are
 * forgotten without a lock another (parent) thread may have held at fork. */
void _keel_ph_tcaches_forget(keel_pheap_t *ph) KEEL_HIDDEN;
/* The same for this thread's transaction on ph, if one is open (tx.c). */
void _keel_ph_tx_forget(keel_pheap_t *ph) KEEL_HIDDEN;
/* As _keel_ph_tcache, and the cache is not evicted (freed) until unpinned:
 * for a caller that keeps the pointer across API calls (a transaction). At
 * most one pin per thread. NULL: out of memory. */
ph_tcache_t *_keel_ph_tcache_pin(keel_pheap_t *ph) KEEL_HIDDEN;
void _keel_ph_tcache_unpin(ph_tcache_t *tc) KEEL_HIDDEN;
void _keel_ph_tcaches_destroy(keel_pheap_t *ph) KEEL_HIDDEN;

/* ---- heap (heap.c) ---- */
/* Open: nothing is walked (the rebuild is lazy, heap.c); 0. */
int _keel_ph_heap_boot(keel_pheap_t *ph, ph_tcache_t *tc) KEEL_HIDDEN;
/* Builds the volatile state of every chunk below `chunk` + 1 (the whole run
 * that holds it); ph->lock NOT held. 0 or KEEL_ECORRUPT. */
int _keel_ph_boot_upto(keel_pheap_t *ph, ph_tcache_t *tc, uint32_t chunk) KEEL_HIDDEN;
void _keel_ph_heap_fini(keel_pheap_t *ph) KEEL_HIDDEN;
/* Takes a free block (volatile reservation) for `size` user bytes; writes
 * nothing persistent. *cls = class or -1 for huge (then the chunk word SET
 * is what publishes it). 0 or KEEL_ENOSPC/EINVAL. */
int _keel_ph_take(keel_pheap_t *ph, ph_tcache_t *tc, size_t size, int *cls,
                  keel_poff_t *off) KEEL_HIDDEN;
/* Takes `bytes` (object header included) as whole chunks, never a run
 * block (undo overflow). */
int _keel_ph_take_chunks(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t bytes,
                         keel_poff_t *off) KEEL_HIDDEN;
/* Returns a volatile reservation (never published, or freed and durable). */
void _keel_ph_give(keel_pheap_t *ph, ph_tcache_t *tc, int cls, keel_poff_t off) KEEL_HIDDEN;
/* The redo entry that publishes (alloc) or frees a block. Aborts on a bad
 * offset when `must_live`. */
ph_redo_entry_t _keel_ph_mark(keel_pheap_t *ph, int cls, keel_poff_t off, bool alloc) KEEL_HIDDEN;
/* Validates `off` as a live object and returns its class (-1 huge); dies with
 * `call` in the message otherwise. */
int _keel_ph_live_class(keel_pheap_t *ph, keel_poff_t off, const char *call) KEEL_HIDDEN;
size_t _keel_ph_usable(keel_pheap_t *ph, int cls, keel_poff_t off) KEEL_HIDDEN;
/* The same for a block of class cls taken but not yet published. */
size_t _keel_ph_usable_new(keel_pheap_t *ph, int cls, keel_poff_t off) KEEL_HIDDEN;
/* Writes the object header in cache (and zeroes the body if asked); the
 * allocation's log carries the header words to the media (publish entries). */
void _keel_ph_init_obj(keel_pheap_t *ph, keel_poff_t off, size_t size, uint64_t type,
                       bool zero) KEEL_HIDDEN;

/* ---- logs and lanes (log.c) ---- */
/* A lane for one operation (for_tx: for a transaction, which never takes
 * the last PH_ATOMIC_LANES); inside a transaction, the transaction's own.
 * put releases any other. */
ph_lane_t *_keel_ph_lane_get(keel_pheap_t *ph, ph_tcache_t *tc, bool for_tx) KEEL_HIDDEN;
/* Nonzero while this thread holds a transaction's lane or a root_lock: its
 * waits for a lane go to the lanes transactions never take (log.c). */
extern __thread unsigned _keel_ph_holds KEEL_HIDDEN;
/* Logs this thread has in flight, over every pool (tc->flying is one pool's):
 * nonzero only while a deferrer called from inside an operation runs. */
extern __thread unsigned _keel_ph_flying KEEL_HIDDEN;
/* Dies naming `call` if this thread has a log in flight on any pool: the
 * caller would wait for a watermark that log holds back (a deferrer must
 * queue its work and return, not call the pool). */
void _keel_ph_not_in_flight(keel_pheap_t *ph, const char *call) KEEL_HIDDEN;
void _keel_ph_lane_put(ph_tcache_t *tc, ph_lane_t *l) KEEL_HIDDEN;
uint64_t _keel_ph_next_seq(keel_pheap_t *ph) KEEL_HIDDEN;
/* Makes room in the lane's ring for a log of n entries (a wrap waits for
 * the watermark), then draws the log's seq and marks the lane in flight
 * until _keel_ph_log_apply (deferred) or _keel_ph_log_end. The draw is a
 * locked add, which waits for the write-back of every line flushed before
 * it: an operation that flushes data ahead of its log draws first, so that
 * write-back overlaps the log's and one barrier waits for both. */
uint64_t _keel_ph_log_seq(keel_pheap_t *ph, ph_tcache_t *tc, ph_lane_t *l, size_t n) KEEL_HIDDEN;
/* Writes log `seq` of n entries (committing undo seq `tx`, or 0) into the
 * lane's ring, where _keel_ph_log_seq made room for them, and starts its
 * write-back; the caller then drains. */
void _keel_ph_log_write(keel_pheap_t *ph, ph_tcache_t *tc, ph_lane_t *l, uint64_t seq, uint64_t tx,
                        const ph_redo_entry_t *e, size_t n) KEEL_HIDDEN;
/* Applies entries in place. deferred: the touched lines are left for the
 * next checkpoint (atomic operations) and the lane's in-flight state ends;
 * otherwise they are flushed now (the caller drains) and the caller ends it
 * with _keel_ph_log_end once nothing of the operation is left to persist. */
void _keel_ph_log_apply(keel_pheap_t *ph, ph_tcache_t *tc, ph_lane_t *l, const ph_redo_entry_t *e,
                        size_t n, bool deferred) KEEL_HIDDEN;
/* Ends the in-flight state of a log applied with deferred = false: from here
 * a checkpoint may raise the watermark past it. */
void _keel_ph_log_end(ph_tcache_t *tc, ph_lane_t *l) KEEL_HIDDEN;
/* Lines of the ring a lane uses before it wraps (PH_RING_LINES; tests
 * shrink it to make wraps and checkpoints frequent). */
extern unsigned _keel_ph_ring_limit KEEL_HIDDEN;
/* True if some log (atomic or commit) is still above the watermark: recovery
 * would replay it over a later plain store. */
bool _keel_ph_deferred(keel_pheap_t *ph) KEEL_HIDDEN;
/* Asks the deferrer (if any, and none is outstanding) for a background
 * checkpoint. Never blocks. */
void _keel_ph_checkpoint_soon(keel_pheap_t *ph) KEEL_HIDDEN;
/* Flushes every deferred line and raises the durable watermark (2 barriers). */
void _keel_ph_checkpoint(keel_pheap_t *ph, ph_tcache_t *tc) KEEL_HIDDEN;
/* Checkpoints (yielding between tries) until the watermark is at least `need`:
 * every log up to that seq then has its effects durable. */
void _keel_ph_checkpoint_past(keel_pheap_t *ph, ph_tcache_t *tc, uint64_t need) KEEL_HIDDEN;
/* True if the data named by a log's CHK entries still matches its dsum. */
bool _keel_ph_redo_data_ok(keel_pheap_t *ph, const ph_redo_t *r) KEEL_HIDDEN;
/* Appends a CHK entry for [off, off+len) if the budget (*chk_bytes) allows;
 * false otherwise: the caller then needs a barrier before writing the log.
 * The range is exact to the byte (ph_chk_range): bytes around it in the
 * same words may belong to fields other threads change meanwhile, and a
 * checksum over them would call a whole commit log torn. */
bool _keel_ph_chk_add(ph_redo_entry_t *e, size_t *n, size_t cap, uint64_t off, uint64_t len,
                      uint64_t *chk_bytes) KEEL_HIDDEN;
/* Crash recovery (see log.c). Returns logs processed, or KEEL_ECORRUPT
 * (with the pool's error set) for a log naming bytes outside the pool. */
int _keel_ph_recover(keel_pheap_t *ph, ph_tcache_t *tc) KEEL_HIDDEN;
/* Points ph->lanes at the lane areas of the mapping (view.base, hdr). */
void _keel_ph_lanes_attach(keel_pheap_t *ph) KEEL_HIDDEN;
/* Undo log entry walk in one segment (the lane's area or an overflow
 * block's data) of `cap` bytes. */
bool _keel_ph_undo_next(const uint8_t *data, uint64_t cap, uint64_t seq, uint64_t *pos,
                        const ph_undo_entry_t **out) KEEL_HIDDEN;
/* The overflow block at `off` if it belongs to the undo log of `seq`, else
 * NULL (the chain ends). */
const ph_undo_ovf_t *_keel_ph_undo_ovf(keel_pheap_t *ph, uint64_t off, uint64_t seq) KEEL_HIDDEN;
/* A valid log header at ring line `pos` with seq above `above`, or NULL. */
const ph_redo_t *_keel_ph_ring_log(const char *ring, unsigned pos, uint64_t above) KEEL_HIDDEN;

/* ---- atomic actions (action.c) ---- */
enum { PH_ACT_NONE = 0, PH_ACT_RESERVE = 1, PH_ACT_SET = 2, PH_ACT_FREE = 3 };
/* Writes the entries that publish block `off` into e (its two header words,
 * then its allocation bit or chunk word); returns PH_PUBLISH_ENTRIES. */
#define PH_PUBLISH_ENTRIES     3u
#define PH_PUBLISH_HDR_ENTRIES 2u /* the header words lead */
size_t _keel_ph_publish_entries(keel_pheap_t *ph, int cls, keel_poff_t off,
                                ph_redo_entry_t *e) KEEL_HIDDEN;
/* Whether this thread's open transaction on ph snapshots any byte of the
 * word at p. An atomic operation's store there would be undone by the
 * transaction's abort, yet replayed by recovery after a crash. */
bool _keel_ph_tx_snapshots(keel_pheap_t *ph, const void *p) KEEL_HIDDEN;
/* The usable size of `off` if this thread's open transaction on ph
 * allocated it (not live until the commit); false otherwise. */
bool _keel_ph_tx_new_usable(keel_pheap_t *ph, keel_poff_t off, size_t *usable) KEEL_HIDDEN;
/* Redo entries for n actions into e (capacity cap); -1 if too many. Dies
 * naming `call` if a free's block is no longer live (freed twice). */
long _keel_ph_acts_entries(keel_pheap_t *ph, const keel_pheap_act_t *acts, size_t n,
                           ph_redo_entry_t *e, size_t cap, const char *call) KEEL_HIDDEN;
/* After the actions are durable: frees return their blocks. */
void _keel_ph_acts_done(keel_pheap_t *ph, ph_tcache_t *tc, keel_pheap_act_t *acts,
                        size_t n) KEEL_HIDDEN;

/* ---- growth (pool.c) ---- */
/* Grows the pool so that an extent of `need` (<= PH_ZONE_CHUNKS) free chunks
 * exists inside one zone; ph->lock held, every chunk booted (the caller's
 * scan found no such extent). 0 or KEEL_ENOSPC. */
int __keel_ph_grow(keel_pheap_t *ph, ph_tcache_t *tc, uint32_t need) KEEL_HIDDEN;

#define PH_ROOT_TYPE (UINT64_MAX - 1)

/* ---- transactions (tx.c) ---- */
/* The tx store check in simulated media (tests): called at commit with the
 * tx's ranges; returns the number of dirty bytes outside them. */
extern uint64_t _keel_ph_stray_bytes KEEL_HIDDEN;
extern bool _keel_ph_stray_check KEEL_HIDDEN;

#endif /* KEEL_PHEAP_INT_H */
