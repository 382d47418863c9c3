/* pheap SIGKILL fuzzing on the real mmap path: a child runs threads doing
 * transactions (transfers between accounts, allocations and frees) and
 * atomic publishes and frees; the parent kills it at a random moment,
 * reopens (recovery) and checks the invariants: every account group still
 * sums to its initial value (transactions are all-or-nothing), every slot
 * points to a live object of the right type whose contents were written
 * before it was published, and the heap walk counts exactly the objects
 * the slots reach, and each thread's big object (snapshot 160 KiB at a
 * time, past the lane's undo area, so overflow blocks are chained while
 * checkpoints race) holds pairs of words that cancel. In about half the
 * rounds checkpoints run on a background worker (keel_pheap_set_deferrer).
 * Rounds continue on the same pool.
 *
 * KEEL_TEST_ROUNDS (default 40, scaled down under sanitizers) and
 * KEEL_TEST_THREADS (default 4).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "common.h"
#include "harness.h"
#include "pheap/pheap_int.h"

#define LAYOUT     "kill"
#define MAXT       8
#define NSLOT      16
#define NACC       8
#define T_TX       101
#define T_PUB      102
#define T_ATOM     103
#define T_BIG      104
#define INITIAL    1000
/* Big transactions: BIG_RANGES ranges of BIG_RANGE bytes; word i of range
 * k < BIG_RANGES / 2 and word i of range k + BIG_RANGES / 2 always sum to 0. */
#define BIG_RANGES 20
#define BIG_RANGE  (8u << 10)
#define BIG_BYTES  (BIG_RANGES * BIG_RANGE)

typedef struct root {
  int64_t acc[MAXT][NACC];
  keel_poff_t slot[MAXT][NSLOT];
  keel_poff_t big[MAXT];
} root_t;

typedef struct tag {
  uint64_t thread, slot, magic;
} tag_t;
#define MAGIC 0x6b65656c70686561ull

static keel_pheap_t *g_ph;
static root_t *g_root;

static void big_tx(uint64_t t, uint64_t s) {
  int64_t *w = keel_pheap_ptr(g_ph, g_root->big[t]);
  const size_t half = BIG_BYTES / 2 / 8;
  int64_t d = (int64_t)(s % 1000) + 1;
  keel_tx_begin(g_ph);
  for (unsigned k = 0; k < BIG_RANGES; k++)
    if (keel_tx_add_range((char *)w + k * BIG_RANGE, BIG_RANGE) != 0) {
      keel_tx_end(); /* rolled back already; nothing stored yet */
      return;
    }
  for (size_t i = 0; i < half; i++) {
    w[i] += d;
    w[i + half] -= d;
  }
  if ((s >> 20) % 4 == 0)
    keel_tx_abort(0);
  else
    keel_tx_commit();
  keel_tx_end();
}

static void *worker(void *arg) {
  uint64_t t = (uint64_t)(uintptr_t)arg, s = 0x9e3779b97f4a7c15ull * (t + 1) ^ (uint64_t)getpid();
  for (;;) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    unsigned a = s % NACC, b = (s >> 8) % NACC, k = (s >> 16) % NSLOT;
    size_t size = sizeof(tag_t) + (s >> 24) % 2000;
    keel_poff_t *slot = &g_root->slot[t][k];
    tag_t tag = {t, k, MAGIC};
    if ((s >> 50) % 8 == 0) {
      big_tx(t, s);
      continue;
    }
    switch ((s >> 40) % 4) {
      case 0: /* transfer */
        keel_tx_begin(g_ph);
        keel_tx_add_range(&g_root->acc[t][a], 8);
        keel_tx_add_range(&g_root->acc[t][b], 8);
        g_root->acc[t][a] -= 7;
        g_root->acc[t][b] += 7;
        keel_tx_commit();
        keel_tx_end();
        break;
      case 1: /* tx alloc or free */
        keel_tx_begin(g_ph);
        keel_tx_add_range(slot, 8);
        if (*slot) {
          keel_tx_free(*slot);
          *slot = 0;
        } else {
          keel_poff_t o = keel_tx_alloc(size, T_TX);
          if (o) memcpy(keel_pheap_ptr(g_ph, o), &tag, sizeof tag);
          *slot = o;
        }
        keel_tx_commit();
        keel_tx_end();
        break;
      case 2: { /* publish */
        if (*slot) break;
        keel_pheap_act_t act[2];
        if (keel_pheap_reserve(g_ph, &act[0], size, T_PUB) != 0) break;
        memcpy(keel_pheap_ptr(g_ph, act[0].off), &tag, sizeof tag);
        keel_pheap_persist(g_ph, keel_pheap_ptr(g_ph, act[0].off), sizeof tag);
        keel_pheap_set_value(g_ph, &act[1], slot, act[0].off);
        keel_pheap_publish(g_ph, act, 2);
        break;
      }
      default: /* atomic alloc or free */
        if (*slot)
          keel_pheap_free(g_ph, slot);
        else
          keel_pheap_alloc(g_ph, slot, size, T_ATOM);
    }
  }
  return NULL;
}

static void child(const char *p, int nt) {
  _keel_ph_ring_limit = 8; /* wrap often: checkpoints race the workers */
  g_ph = keel_pheap_open(p, LAYOUT);
  if (g_ph == NULL) _exit(3);
  g_root = keel_pheap_root(g_ph, sizeof *g_root);
  /* Every other round, checkpoints run on a background worker. */
  static tp_worker_t w;
  if (getpid() & 1) {
    tp_worker_start(&w);
    keel_pheap_set_deferrer(g_ph, tp_defer, &w);
  }
  pthread_t th[MAXT];
  for (int i = 0; i < nt; i++) pthread_create(&th[i], NULL, worker, (void *)(uintptr_t)i);
  for (;;) pause();
}

static int count_cb(keel_pheap_t *ph, keel_poff_t off, void *arg) {
  (void)ph;
  (void)off;
  ++*(long *)arg;
  return 0;
}

static void test_sigkill_rounds(void) {
  char p[256];
  tp_path(p, sizeof p, "kill");
  int nt = (int)kt_env_int("KEEL_TEST_THREADS", 4);
  if (nt > MAXT) nt = MAXT;
  long rounds = kt_scale(kt_env_int("KEEL_TEST_ROUNDS", 40));
  keel_pheap_t *ph = keel_pheap_create(p, LAYOUT, KEEL_PHEAP_MIN_SIZE, 0);
  KT_REQUIRE(ph != NULL);
  root_t *r = keel_pheap_root(ph, sizeof *r);
  for (int t = 0; t < MAXT; t++)
    for (int a = 0; a < NACC; a++) r->acc[t][a] = INITIAL;
  keel_pheap_persist(ph, r->acc, sizeof r->acc);
  for (int t = 0; t < MAXT; t++) KT_EQ(keel_pheap_zalloc(ph, &r->big[t], BIG_BYTES, T_BIG), 0);
  keel_pheap_close(ph);
  uint64_t seed = (uint64_t)time(NULL);
  long recovered = 0, big_changed = 0;
  for (long round = 0; round < rounds; round++) {
    pid_t pid = fork();
    if (pid == 0) child(p, nt);
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    struct timespec ts = {0, (long)(2 + (seed >> 33) % 40) * 1000000L};
    nanosleep(&ts, NULL);
    kill(pid, SIGKILL);
    int st;
    waitpid(pid, &st, 0);
    KT_REQUIRE(WIFSIGNALED(st));
    ph = keel_pheap_open(p, LAYOUT);
    KT_REQUIRE(ph != NULL);
    keel_pheap_stats_t sts;
    keel_pheap_stats(ph, &sts);
    recovered += (long)sts.recovered_logs;
    r = keel_pheap_root(ph, sizeof *r);
    long reach = 1 + MAXT, walk = 0;
    for (int t = 0; t < MAXT; t++) {
      KT_REQUIRE(keel_pheap_type(ph, r->big[t]) == T_BIG);
      const int64_t *w = keel_pheap_ptr(ph, r->big[t]);
      size_t bad = 0;
      for (size_t i = 0; i < BIG_BYTES / 2 / 8; i++) bad += w[i] + w[i + BIG_BYTES / 2 / 8] != 0;
      KT_EQ(bad, 0);
      big_changed += w[0] != 0;
      int64_t sum = 0;
      for (int a = 0; a < NACC; a++) sum += r->acc[t][a];
      KT_EQ(sum, INITIAL * NACC);
      for (int k = 0; k < NSLOT; k++) {
        keel_poff_t o = r->slot[t][k];
        if (!o) continue;
        reach++;
        uint64_t type = keel_pheap_type(ph, o);
        KT_CHECK(type == T_TX || type == T_PUB || type == T_ATOM);
        KT_CHECK(keel_pheap_usable_size(ph, o) >= sizeof(tag_t)); /* aborts if not live */
        if (type != T_ATOM) {
          tag_t tag;
          memcpy(&tag, keel_pheap_ptr(ph, o), sizeof tag);
          KT_CHECK(tag.thread == (uint64_t)t && tag.slot == (uint64_t)k && tag.magic == MAGIC);
        }
      }
    }
    keel_pheap_foreach(ph, KEEL_PHEAP_ANY_TYPE, count_cb, &walk);
    KT_EQ(walk, reach);
    keel_pheap_close(ph);
    KT_EQ(keel_pheap_check(p), 0);
  }
  printf("  %ld kill rounds, %ld logs recovered, %ld big objects seen changed\n", rounds, recovered,
         big_changed);
  unlink(p);
}

KT_MAIN(KT_CASE(test_sigkill_rounds))
