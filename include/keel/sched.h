/* keel sched: one process-wide, auto-scaling thread pool.
 *
 * The caller embeds a keel_job_t in its own struct and submits it; a worker
 * thread later calls job->fn(job) exactly once per submit (the callback finds
 * its struct with container_of). Submitting never allocates and costs one
 * atomic exchange on a wait-free queue (liburcu's wfcqueue); workers take
 * jobs in batches under a short mutex and park on a futex when there is no
 * work, one of them woken when a submit finds the queue empty (a burst the
 * woken worker drains as fast as it arrives can wake more: each submit may
 * find the queue empty again). The pool starts with
 * min_threads workers, adds one (rate-limited) while jobs wait and no worker
 * is idle, never runs more than max_threads, and retires a worker idle for
 * idle_ms. keel never uses process signals.
 *
 * Scheduling order (all decided under the dispatch mutex):
 *  - three priority levels; while low-priority jobs wait, at least one in
 *    every KEEL_SCHED_LOW_EVERY dispatches is a low one, and while normal
 *    ones wait at least one in every KEEL_SCHED_NORMAL_EVERY is normal or low;
 *  - within a level, clients (keel_sched_client_t, e.g. one per connection)
 *    are served round-robin, KEEL_SCHED_QUANTUM jobs per turn: once client B
 *    has a job waiting, any other single client gets at most
 *    KEEL_SCHED_QUANTUM of its own jobs of that level dispatched before B's
 *    next turn (the bound that tests/sched checks), plus what workers had
 *    already taken (at most KEEL_SCHED_BATCH per worker).
 *  - jobs one thread submits for one client and level are dispatched in
 *    submit order (and start in it on one worker).
 *
 * Concurrency:
 *   submit, run, after, cancel,   any thread, any time, concurrently with
 *   stats, client_create/destroy  each other and from inside jobs
 *   init, shutdown                serialised with each other; KEEL_EDEADLK from
 *                                 inside a job, from an on_cancel that a
 *                                 shutdown runs, or from one that keel's
 *                                 monitor thread runs
 * A job belongs to keel from a successful submit (or keel_sched_after) until
 * keel calls its fn or on_cancel; from that call on it is the caller's again
 * (fn may free or resubmit it). Ordering: what the submitter wrote before a
 * successful submit happens before fn (or on_cancel) runs; keel's own
 * accesses to a job happen before any later successful submit of it. A job
 * may be resubmitted while its fn still runs (it may then run twice at once
 * on two workers; ordering those is the caller's business).
 *
 * Calling submit, run, after or stats before keel_sched_init initialises the pool
 * with the defaults of KEEL_OPTIONS (sched_min_threads, sched_max_threads,
 * sched_idle_ms, sched_block_ms, sched_spin_us). The others need no running
 * pool and start none: cancel finds no job (KEEL_ENOENT), client create and
 * destroy touch only the client, and shutdown leaves a never-started pool
 * shut down without starting threads to stop them.
 *
 * fork: the child gets a pool of its own, not yet started (its first call
 * starts it with the parent's configuration), or a shut-down one if the
 * parent's was shut down or shutting down; statistics start at 0. The
 * parent's jobs, queued, timed or running, stay the parent's: their copies
 * in the child are never run or cancelled (do not submit, cancel or wait
 * for them there). Clients are the child's to use and destroy. A child
 * forked inside a job ends when that job returns, and one forked inside an
 * on_cancel on keel's monitor thread when that returns (it delivers none of
 * the parent's other notices): its own pool, if it started one, is shut
 * down with KEEL_SCHED_DRAIN, then the thread that ran the callback calls
 * exit(0), so atexit handlers run and any thread of the child's own ends
 * too. To end otherwise, exec or _exit before returning.
 */
#ifndef KEEL_SCHED_H
#define KEEL_SCHED_H

#include <keel/keel.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct keel_job keel_job_t;
typedef struct keel_sched_client keel_sched_client_t;
typedef void (*keel_job_fn)(keel_job_t *job);

/* Job flags: one priority (default normal) or'ed with KEEL_JOB_BLOCKING.
 * A job that may sleep should say so: a worker ends its batch at a
 * BLOCKING job, so no job waits behind it. An undeclared job that runs past
 * block_ms counts as blocking too (the pool grows, other workers take the
 * queue), but the jobs its worker had already taken with it (at most
 * KEEL_SCHED_BATCH - 1, fewer when the queue runs short) start only after
 * it: they are not handed to another worker, which could start them after
 * later jobs of the same submitter (the start order promised below). */
#define KEEL_JOB_NORMAL           0u
#define KEEL_JOB_HIGH             1u
#define KEEL_JOB_LOW              2u
#define KEEL_JOB_BLOCKING         4u /* may sleep: ends a batch; the pool may grow past the CPUs */
/* keel_sched_run only: a job that shutdown cancels runs fn(arg) at once in
 * the cancelling thread instead of being dropped (work that must happen,
 * e.g. a keel_pheap deferrer's, whose pool close waits for it). */
#define KEEL_JOB_RUN_IF_CANCELLED 8u

/* Scheduling bounds (see above). */
#define KEEL_SCHED_QUANTUM      4  /* jobs per client turn within a level */
#define KEEL_SCHED_LOW_EVERY    8  /* low gets >= 1 of every 8 dispatches while waiting */
#define KEEL_SCHED_NORMAL_EVERY 4  /* normal+low get >= 1 of every 4 while waiting */
#define KEEL_SCHED_BATCH        16 /* most jobs a worker takes per dispatch */

/* A job. The caller sets the first four fields (keel_job_init does); the
 * fields starting with '_' belong to keel and must be zero when the job is
 * first submitted. 64 bytes on LP64. */
struct keel_job {
  keel_job_fn fn;              /* runs once per submit, on a worker thread */
  keel_job_fn on_cancel;       /* runs instead of fn when cancelled; may be NULL */
  keel_sched_client_t *client; /* fairness domain; NULL: the shared default client */
  unsigned flags;              /* KEEL_JOB_* */
  unsigned _state;             /* keel: idle, queued, timer, taken */
  void *_q;                    /* keel: wait-free queue link */
  void *_l[2];                 /* keel: client FIFO link, or timer owner and heap slot */
  uint64_t _t;                 /* keel: timer deadline (monotonic ns) */
};

/* Prepares a job for its first submit. Does not allocate. */
static inline void keel_job_init(keel_job_t *job, keel_job_fn fn, unsigned flags) {
  *job = (keel_job_t){0};
  job->fn = fn;
  job->flags = flags;
}

/* The largest max_threads keel_sched_init accepts. */
#define KEEL_SCHED_THREADS_MAX 65536u

typedef struct keel_sched_config {
  unsigned min_threads; /* workers kept alive, >= 1 */
  unsigned max_threads; /* most workers ever running, >= min_threads, <= KEEL_SCHED_THREADS_MAX */
  unsigned idle_ms;     /* a worker above min idle this long retires */
  unsigned block_ms;    /* a job running this long counts as blocking */
} keel_sched_config_t;

/* Fills *cfg with the KEEL_OPTIONS defaults (max 0 there means 16 per
 * usable CPU, at most 1024; usable: the affinity mask, capped by the
 * cgroup's CPU quota). Does not allocate or block. */
KEEL_API void keel_sched_config_default(keel_sched_config_t *cfg);

/* Starts the pool (cfg NULL: defaults): 0, KEEL_EINVAL (max 0, min 0,
 * min > max or max > KEEL_SCHED_THREADS_MAX), KEEL_EBUSY (already running),
 * KEEL_ENOMEM/EAGAIN (no thread), KEEL_EDEADLK (from inside a job, or from
 * an on_cancel that a shutdown or the monitor thread runs). Until it has
 * created every thread it accepts no job or timer: other threads' submits
 * wait for it. A failed init leaves the pool as it was (a lazy one is tried
 * again by the next call: a submit that waited tries it itself), having
 * accepted and cancelled nothing. Allowed again after keel_sched_shutdown.
 * Allocates; creates threads. */
KEEL_API int keel_sched_init(const keel_sched_config_t *cfg);

/* Queues a job: 0; KEEL_EINVAL (job or job->fn NULL); KEEL_EBUSY (already
 * queued, timed or taken); KEEL_ESHUTDOWN (after shutdown); on any error the
 * caller keeps the job. Never blocks or allocates; lock-free, any thread;
 * except before the pool has started, when it starts it or waits for an
 * init in progress, and fails as that init does (KEEL_ENOMEM, KEEL_EAGAIN;
 * KEEL_EDEADLK in the thread running it). */
KEEL_API int keel_sched_submit(keel_job_t *job);

/* Runs fn(arg) on a worker: malloc's a small job, freed before fn runs or
 * when shutdown cancels it (fn then never runs, unless flags has
 * KEEL_JOB_RUN_IF_CANCELLED: then it runs in the shutting-down thread).
 * 0, KEEL_EINVAL, KEEL_ENOMEM, KEEL_ESHUTDOWN (fn not run). */
KEEL_API int keel_sched_run(void (*fn)(void *arg), void *arg, unsigned flags);

/* Submits the job after `ms` milliseconds (never earlier; ms 0 submits now).
 * The timer lives in the heap of the calling worker, or of a worker picked
 * round-robin. Takes a mutex; may allocate to grow that heap (KEEL_ENOMEM).
 * Same errors as keel_sched_submit. Should the picked worker's thread fail
 * to start and no other worker have memory to take the timer, it is
 * cancelled with notice on keel's monitor thread. */
KEEL_API int keel_sched_after(keel_job_t *job, uint64_t ms);

/* Cancels a queued or timed job: its on_cancel runs in the calling thread
 * before this returns 0. KEEL_EBUSY: running or taken by a worker (it will
 * run); KEEL_ENOENT: not queued (never submitted, fn already called, or
 * already being cancelled by another cancel or a shutdown, whose thread
 * calls on_cancel); KEEL_EINVAL: NULL. Takes the dispatch
 * mutex; may briefly yield while a preempted producer finishes an enqueue. */
KEEL_API int keel_sched_cancel(keel_job_t *job);

/* Shutdown modes. */
#define KEEL_SCHED_DRAIN  0 /* run everything queued, then stop */
#define KEEL_SCHED_CANCEL 1 /* call on_cancel for everything queued, then stop */

/* Stops the pool: new submits fail with KEEL_ESHUTDOWN; pending timers are
 * cancelled with notice in both modes; queued jobs run (DRAIN, the pool still
 * growing up to max while they wait behind blocked workers) or are cancelled
 * (CANCEL; jobs a worker has already taken still run); every on_cancel it
 * causes runs in the calling thread; returns after every worker has exited
 * and been joined. Blocks.
 * KEEL_EDEADLK from inside a job, from an on_cancel that shutdown itself
 * runs, or from one on keel's monitor thread; KEEL_EINVAL for a bad mode;
 * 0 if already shut down. Serialised with keel_sched_init. */
KEEL_API int keel_sched_shutdown(int how);

/* A fairness domain (e.g. one per connection). create: NULL + errno ENOMEM
 * or ESHUTDOWN; allocates. destroy: KEEL_EBUSY while any of its jobs is
 * queued or timed (keel_sched_after, not yet fired: cancel or let them run
 * first); takes the dispatch mutex. */
KEEL_API keel_sched_client_t *keel_sched_client_create(void);
KEEL_API int keel_sched_client_destroy(keel_sched_client_t *client);

typedef struct keel_sched_stats {
  uint64_t submitted;      /* accepted submits, timers included, since process start */
  uint64_t run;            /* fn calls returned */
  uint64_t cancelled;      /* on_cancel notices (cancel, shutdown) */
  uint64_t queued;         /* submitted - run - cancelled - running - timers */
  uint64_t running;        /* jobs inside fn now */
  uint64_t timers;         /* timers not yet fired */
  uint64_t spawned;        /* worker threads started */
  uint64_t retired;        /* worker threads that exited */
  unsigned threads;        /* workers alive */
  unsigned idle;           /* workers parked */
  uint64_t wakeups;        /* parked workers woken for work */
  uint64_t run_prio[3];    /* run, by priority: high, normal, low */
  uint64_t queued_prio[3]; /* queued, by priority (fast lane included) */
} keel_sched_stats_t;

/* A snapshot of the counters (each exact, the set not atomic). Takes the
 * dispatch mutex; does not allocate. */
KEEL_API int keel_sched_stats(keel_sched_stats_t *stats);

#ifdef __cplusplus
}
#endif
#endif /* KEEL_SCHED_H */
