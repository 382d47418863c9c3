/* Dispatch: from the incoming queues to the order in which jobs run.
 *
 * Under sched.lock a worker splices each incoming wfcqueue whole (one xchg,
 * however many jobs) into a private staging queue of the same shard:
 *  - the fast lane (normal jobs of the default client) stays a FIFO per
 *    shard in staging: together they are the default client's normal queue,
 *    taken with one dequeue per job, shard after shard, and no list
 *    operation (the fast path: ~10 ns a job less than sorting);
 *  - the other queue (everything else) is sorted onto each client's
 *    per-level list.
 * Both use wfcqueue's non-blocking variants: a producer preempted between its
 * xchg and its link store (common with 64 producers on 2 cores) would make
 * the blocking ones poll(2) for 10 ms with the mutex held; here the unlinked
 * node holds back its shard only, *stuck is set, and a worker that finds
 * nothing else yields instead of parking. When every staged shard of the
 * fast lane starts half-linked, the default client loses its turn (to the
 * tail of the normal ring) and, alone there, the normal level is passed
 * over for the rest of that dispatch: other clients and levels go on.
 *
 * Taking a job: pick the level (below), then the client at the head of that
 * level's ring, which keeps its turn for KEEL_SCHED_QUANTUM jobs or until it
 * runs dry, then rotates to the tail. Levels: while low jobs wait, at least
 * one dispatch in KEEL_SCHED_LOW_EVERY is low; while normal ones wait, at
 * least one in KEEL_SCHED_NORMAL_EVERY is normal or low; otherwise the
 * highest waiting level. The default client is one ring member like any
 * other, so a flood of its jobs cannot starve a client's or a high job.
 *
 * Cancel needs O(1) removal, so it first "flattens" staging onto the default
 * client's normal list (each job moves at most once; FIFO kept, since the
 * list holds the older part of that queue and staging the newer).
 */
#include "sched/sched_int.h"

struct keel_sched_client _keel_sched_default_client;
#define DEFAULT_CLIENT (&_keel_sched_default_client)

static bool staging_empty(void) {
  return _keel_sched.stage_mask == 0;
}

static void publish_staged(void) {
  sched_t *s = &_keel_sched;
  /* seq_cst: the chain-wake argument of park.c covers staged as nlocal. */
  atomic_store(&s->staged, (s->stage_mask | s->stage2_mask) != 0);
}

/* Keeps bit i of *mask equal to "q is not empty". */
static void track(uint64_t *mask, unsigned i, sched_q_t *q) {
  if (cds_wfcq_empty(&q->head, &q->tail))
    *mask &= ~(1ull << i);
  else
    *mask |= 1ull << i;
}

/* The first set bit of m at or after `from`, wrapping; m != 0. */
static unsigned next_bit(uint64_t m, unsigned from) {
  uint64_t hi = from < 64 ? m & (~0ull << from) : 0;
  return (unsigned)__builtin_ctzll(hi ? hi : m);
}

static void ring_join(struct keel_sched_client *c, unsigned p) {
  if (c->in_ring[p]) return;
  c->in_ring[p] = true;
  cds_list_add_tail(&c->ring[p], &_keel_sched.levels[p].ring);
}

static void ring_leave(struct keel_sched_client *c, unsigned p) {
  if (!c->in_ring[p]) return;
  c->in_ring[p] = false;
  c->used[p] = 0;
  cds_list_del(&c->ring[p]);
}

/* Whether c still has level-p jobs after one left. */
static bool client_waits(struct keel_sched_client *c, unsigned p) {
  return c->n[p] > 0 || (c == DEFAULT_CLIENT && p == PRIO_NORMAL && !staging_empty());
}

/* Acquire: pairs with the producer's release CAS to QUEUED (or the timer's
 * release store), so the job's fields written before submit are visible. */
static keel_job_t *staged_job(struct cds_wfcq_node *node) {
  keel_job_t *job = _keel_node_job(node);
  unsigned st = _keel_job_state(job);
  KEEL_ASSERT(st == JOB_QUEUED);
  (void)st;
  return job;
}

static void place(keel_job_t *job) {
  sched_t *s = &_keel_sched;
  unsigned p = _keel_job_prio(job);
  struct keel_sched_client *c = job->client ? job->client : DEFAULT_CLIENT;
  /* A fired timer moves from c's ntimers to n[] under this lock, so
   * client_destroy sees it counted in exactly one of them. */
  if (job->_l[1] == SCHED_FIRED && job->client != NULL) keel_fetch_sub_relaxed(&c->ntimers, 1);
  cds_list_add_tail(_keel_job_link(job), &c->q[p]);
  c->n[p]++;
  s->levels[p].n++;
  ring_join(c, p);
  __atomic_store_n(&job->_state, JOB_LOCAL, __ATOMIC_RELAXED); /* the lock orders it */
}

/* Drains a staging queue through place(); true if a half-linked node
 * stopped it. */
static bool place_all(struct __cds_wfcq_head *h, struct cds_wfcq_tail *t) {
  uint64_t placed = 0;
  bool stuck = false;
  for (;;) {
    struct cds_wfcq_node *n = __cds_wfcq_dequeue_nonblocking(h, t);
    if (n == NULL) break;
    if (n == CDS_WFCQ_WOULDBLOCK) {
      stuck = true;
      break;
    }
    place(staged_job(n));
    placed++;
  }
  /* seq_cst: pairs with nidle in park.c (a parking worker sees it). */
  if (placed) atomic_fetch_add(&_keel_sched.nlocal, placed);
  return stuck;
}

/* Splices every incoming queue; sorts the jobs that are not fast-lane.
 * Costs two emptiness checks per shard (a load of a head line the
 * dispatcher owns, and of the tail line only when the head is empty). */
static bool pull(void) {
  sched_t *s = &_keel_sched;
  bool stuck = false;
  for (unsigned i = 0; i < SCHED_SHARDS; i++) {
    sched_shard_t *in = &s->in[i];
    enum cds_wfcq_ret r =
        __cds_wfcq_splice_nonblocking(&s->stage[i].head, &s->stage[i].tail, &in->head, &in->tail);
    if (r == CDS_WFCQ_RET_WOULDBLOCK)
      stuck = true;
    else if (r != CDS_WFCQ_RET_SRC_EMPTY)
      s->stage_mask |= 1ull << i;
    r = __cds_wfcq_splice_nonblocking(&s->stage2[i].head, &s->stage2[i].tail, &in->head2,
                                      &in->tail2);
    if (r == CDS_WFCQ_RET_WOULDBLOCK) stuck = true;
    if (r == CDS_WFCQ_RET_WOULDBLOCK || r == CDS_WFCQ_RET_SRC_EMPTY) {
      if (!(s->stage2_mask & (1ull << i))) continue; /* nothing left to sort */
    }
    stuck |= place_all(&s->stage2[i].head, &s->stage2[i].tail);
    track(&s->stage2_mask, i, &s->stage2[i]);
  }
  if (!staging_empty()) ring_join(DEFAULT_CLIENT, PRIO_NORMAL);
  return stuck;
}

bool __keel_sched_flatten(void) {
  sched_t *s = &_keel_sched;
  bool stuck = pull();
  for (uint64_t m = s->stage_mask; m != 0; m &= m - 1) {
    unsigned i = (unsigned)__builtin_ctzll(m);
    stuck |= place_all(&s->stage[i].head, &s->stage[i].tail);
    track(&s->stage_mask, i, &s->stage[i]);
  }
  publish_staged();
  return stuck;
}

static bool level_waits(int p) {
  return !cds_list_empty(&_keel_sched.levels[p].ring);
}

/* The level to take from next, or -1; levels in `skip` count as empty. */
static int pick_level(unsigned skip) {
  sched_t *s = &_keel_sched;
  bool hw = !(skip & (1u << PRIO_HIGH)) && level_waits(PRIO_HIGH);
  bool nw = !(skip & (1u << PRIO_NORMAL)) && level_waits(PRIO_NORMAL);
  bool lw = !(skip & (1u << PRIO_LOW)) && level_waits(PRIO_LOW);
  if (lw && (s->since_low >= KEEL_SCHED_LOW_EVERY - 1 || (!hw && !nw))) return PRIO_LOW;
  if (nw && (s->since_normal >= KEEL_SCHED_NORMAL_EVERY - 1 || !hw)) return PRIO_NORMAL;
  return hw ? PRIO_HIGH : -1;
}

/* After a level-p dispatch. Counting only while a level waits makes the
 * bound "one in every N dispatches while waiting", with no credit saved up
 * while it is empty. */
static void account(int p, bool nw, bool lw) {
  sched_t *s = &_keel_sched;
  s->since_low = p == PRIO_LOW ? 0 : (lw ? s->since_low + 1 : 0);
  s->since_normal = p != PRIO_HIGH ? 0 : (nw ? s->since_normal + 1 : 0);
}

/* The default client's next fast-lane job, one shard after another (each
 * shard is FIFO; the rotation keeps a busy shard from holding up the rest).
 * NULL with *stuck set if every non-empty shard starts with a half-linked
 * node. */
static keel_job_t *take_staged(bool *stuck) {
  sched_t *s = &_keel_sched;
  uint64_t m = s->stage_mask; /* shards to try, in rotation from stage_next */
  while (m != 0) {
    unsigned i = next_bit(m, s->stage_next);
    m &= ~(1ull << i);
    struct cds_wfcq_node *n = __cds_wfcq_dequeue_nonblocking(&s->stage[i].head, &s->stage[i].tail);
    if (n == CDS_WFCQ_WOULDBLOCK) {
      *stuck = true;
      continue;
    }
    track(&s->stage_mask, i, &s->stage[i]);
    if (n == NULL) continue;
    s->stage_next = (i + 1) % SCHED_SHARDS;
    /* The shard's next job is read (its link, its fields) only when the
     * rotation comes back here: fetch it now, so that with many shards
     * staged their misses overlap instead of running one after another
     * under the lock (a deep queue of jobs from 64 producers is cold). */
    struct cds_wfcq_node *next = CMM_LOAD_SHARED(s->stage[i].head.node.next);
    if (next != NULL) __builtin_prefetch(next);
    return staged_job(n);
  }
  return NULL;
}

/* The next job of level p's head client; NULL if its next job is still
 * half-linked in staging (*stuck set) or, for the default client, if its
 * staging turned out empty (it has left the ring). *listed counts jobs
 * taken off the lists. */
static keel_job_t *take_one(int p, bool *stuck, uint64_t *listed) {
  sched_level_t *L = &_keel_sched.levels[p];
  struct keel_sched_client *c = cds_list_first_entry(&L->ring, struct keel_sched_client, ring[p]);
  keel_job_t *job;
  if (c->n[p] > 0) {
    job = _keel_link_job(c->q[p].next);
    cds_list_del(_keel_job_link(job));
    c->n[p]--;
    L->n--;
    (*listed)++;
  } else {
    KEEL_ASSERT(c == DEFAULT_CLIENT && p == PRIO_NORMAL);
    job = take_staged(stuck);
    if (job == NULL) {
      /* Staging is empty (leave the ring now) or every non-empty shard
       * starts half-linked (stay; the caller yields). */
      if (!*stuck) ring_leave(c, (unsigned)p);
      return NULL;
    }
  }
  /* The default client's fast lane leaves the ring lazily, when a take
   * finds it empty: checking 8 staging shards after every job cost more. */
  bool lazy = c == DEFAULT_CLIENT && p == PRIO_NORMAL;
  if (!lazy && c->n[p] == 0) {
    ring_leave(c, (unsigned)p);
  } else if (++c->used[p] >= KEEL_SCHED_QUANTUM) {
    c->used[p] = 0;
    if (L->ring.next != L->ring.prev) _keel_list_move_tail(&c->ring[p], &L->ring);
  }
  __atomic_store_n(&job->_state, JOB_TAKEN, __ATOMIC_RELAXED); /* the lock orders it */
  return job;
}

/* One worker's dispatch: up to `max` jobs in dispatch order. */
unsigned __keel_sched_dispatch(keel_job_t **out, unsigned max, bool *stuck) {
  sched_t *s = &_keel_sched;
  *stuck = pull();
  unsigned n = 0;
  uint64_t listed = 0;
  int p;
  unsigned skip = 0; /* levels whose only client's next job is half-linked */
  while (n < max && (p = pick_level(skip)) >= 0) {
    bool nw = level_waits(PRIO_NORMAL), lw = level_waits(PRIO_LOW);
    bool half = false;
    keel_job_t *job = take_one(p, &half, &listed);
    *stuck |= half;
    if (job == NULL) {
      /* The default client's fast lane is half-linked (a producer was
       * preempted inside its enqueue): it loses its turn, and if no other
       * client waits at this level the level is passed over. Breaking out
       * here held back every client and level until that producer ran
       * (review, helper-84: a high job waited 500 ms). Every other ring
       * member has listed jobs, so each pass takes a job or skips. */
      if (half) {
        sched_level_t *L = &s->levels[p];
        if (L->ring.next != L->ring.prev) {
          struct keel_sched_client *c = DEFAULT_CLIENT;
          c->used[p] = 0;
          _keel_list_move_tail(&c->ring[p], &L->ring);
        } else {
          skip |= 1u << p;
        }
      }
      continue; /* or the default client left the ring: pick again */
    }
    account(p, nw, lw);
    out[n++] = job;
    if (job->flags & KEEL_JOB_BLOCKING) break; /* nothing waits behind a sleeper */
  }
  if (listed) keel_fetch_sub_relaxed(&s->nlocal, listed);
  publish_staged();
  return n;
}

/* Removes a LOCAL job (cancel). */
void __keel_sched_unlink(keel_job_t *job) {
  sched_t *s = &_keel_sched;
  unsigned p = _keel_job_prio(job);
  struct keel_sched_client *c = job->client ? job->client : DEFAULT_CLIENT;
  cds_list_del(_keel_job_link(job));
  s->levels[p].n--;
  c->n[p]--;
  if (!client_waits(c, p)) ring_leave(c, p);
  keel_fetch_sub_relaxed(&s->nlocal, 1);
}
