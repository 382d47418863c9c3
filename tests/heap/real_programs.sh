#!/usr/bin/env bash
# Runs unmodified Debian programs with and without LD_PRELOAD of a malloc
# library and compares what they print (and their exit status) byte for byte.
#
#   tests/heap/real_programs.sh [LIB]      LIB defaults to $KEEL_MALLOC_LIB,
#                                          then build/lib/libkeel-malloc.so
#   KEEL_REAL_ONLY=sqlite3 ...             runs only the named case(s)
#
# Cases: python3 (large dicts, lists, sets built and dropped; and threads,
# a fork-context process pool and a fork), perl, git
# (init/add/commit/log/repack/archive in a temporary repository with fixed
# author and dates), sort of a million lines, gcc compiling and running a C
# program, xz round trip (multi-threaded), sqlite3 inserting and querying
# 100k rows, coreutils/tar/sed/find copying and listing a tree (their
# libselinux allocates before our constructors run). Everything a case runs is preloaded, helpers included. A
# program that is not installed is skipped with a note (scripts/install-deps
# installs them as optional packages). Any other LIB (e.g. libjemalloc.so.2)
# works too; the script knows nothing of keel beyond the default path.
#
# Prints one line per case and "N passed, N failed"; exits 1 if any failed,
# else 77 if any was skipped (ctest then reports the test as skipped).
set -u

here=$(cd "$(dirname "$0")" && pwd)
lib=${1:-${KEEL_MALLOC_LIB:-$here/../../build/lib/libkeel-malloc.so}}
if [ ! -f "$lib" ]; then
  echo "real_programs: no malloc library at $lib"
  echo "0 passed, 1 failed"
  exit 1
fi
lib=$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")

work=$(mktemp -d "${TMPDIR:-/tmp}/keel-real.XXXXXX")
trap '[ -n "${KEEL_REAL_KEEP:-}" ] || rm -rf "$work"' EXIT
unset LD_PRELOAD
export LC_ALL=C TZ=UTC

passed=0
failed=0
skipped=0

# The Debian binary of a program (not a pyenv/venv shim on PATH), or nothing.
find_prog() {
  local d
  for d in /usr/bin /bin; do
    if [ -x "$d/$1" ]; then
      echo "$d/$1"
      return
    fi
  done
  command -v "$1" 2>/dev/null || true
}

wanted() {
  [ -z "${KEEL_REAL_ONLY:-}" ] && return 0
  case " $KEEL_REAL_ONLY " in *" $1 "*) return 0 ;; esac
  return 1
}

# run_case NAME FUNCTION PROGRAM...: runs FUNCTION in a fresh directory
# twice, without and then with LD_PRELOAD, and compares stdout + exit status.
run_case() {
  local name=$1 fn=$2
  shift 2
  wanted "$name" || return 0
  local p
  for p in "$@"; do
    if [ -z "$(find_prog "$p")" ]; then
      echo "skip $name ($p is not installed; scripts/install-deps installs it)"
      skipped=$((skipped + 1))
      return 0
    fi
  done
  local mode t0 t1 times=""
  for mode in plain preload; do
    local dir=$work/$name.$mode
    mkdir -p "$dir"
    t0=$(date +%s.%N)
    (
      cd "$dir" || exit 99
      if [ "$mode" = preload ]; then export LD_PRELOAD=$lib; fi
      "$fn"
    ) >"$work/$name.$mode.out" 2>"$work/$name.$mode.err"
    echo "exit status $?" >>"$work/$name.$mode.out"
    t1=$(date +%s.%N)
    times="$times $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1fs", b - a }')"
  done
  if cmp -s "$work/$name.plain.out" "$work/$name.preload.out"; then
    echo "ok   $name (plain, preloaded:$times)"
    passed=$((passed + 1))
  else
    echo "FAIL $name: output differs under LD_PRELOAD=$lib"
    diff "$work/$name.plain.out" "$work/$name.preload.out" | head -20 | sed 's/^/    /'
    echo "    stderr with preload (tail):"
    tail -20 "$work/$name.preload.err" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
  rm -rf "$work/$name.plain" "$work/$name.preload"
}

# ---- the cases (each runs in its own empty directory) ----------------------

# The library really is mapped in preloaded processes: otherwise every
# comparison below would pass without testing anything.
check_loaded() {
  wanted loaded || return 0
  local n
  n=$(LD_PRELOAD=$lib grep -c "$(basename "$lib")" /proc/self/maps)
  if [ "${n:-0}" -ge 1 ]; then
    echo "ok   loaded ($(basename "$lib") is mapped in preloaded processes)"
    passed=$((passed + 1))
  else
    echo "FAIL loaded: $(basename "$lib") is not in a preloaded process's maps"
    failed=$((failed + 1))
  fi
}

case_python3() {
  PYTHONHASHSEED=0 "$(find_prog python3)" - <<'EOF'
import gc, hashlib, json
h = hashlib.sha256()
for rnd in range(3):
    d = {f"key{i}-{rnd}": (i, str(i * i), [i] * (i % 7)) for i in range(200000)}
    lists = [list(range(i % 60)) for i in range(60000)]
    s = set(range(rnd, 600000, 3))
    blobs = [bytes(range(i % 256)) * (1 + i % 5) for i in range(20000)]
    doc = json.loads(json.dumps({k: v[1] for k, v in list(d.items())[:50000]}))
    h.update(repr(sorted(d.items())[-3:]).encode())
    h.update(str((len(d), sum(map(len, lists)), len(s), len(doc))).encode())
    h.update(hashlib.md5(b"".join(blobs)).digest())
    del d, lists, s, blobs, doc
    gc.collect()
    # Many small objects freed in an order unlike their allocation.
    objs = [[str(i)] * 3 for i in range(300000)]
    del objs[::2]
    h.update(str(len(objs)).encode())
    del objs
print(h.hexdigest())
EOF
}

# Threads, a process pool and a bare fork: blocks cross threads (results
# handed back to the main thread), and children inherit a heap other
# threads were using at the fork.
case_python3_threads() {
  PYTHONHASHSEED=0 "$(find_prog python3)" - <<'EOF'
import hashlib, json, multiprocessing as mp, os, threading
def work(i):
    d = {str(j): [j] * (j % 13) for j in range(20000 + i)}
    return hashlib.md5(json.dumps(d, sort_keys=True).encode()).hexdigest()
res = [None] * 16
def run(i): res[i] = work(i)
threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
for t in threads: t.start()
for t in threads: t.join()
print(res)
with mp.get_context("fork").Pool(4) as pool: print(pool.map(work, range(8)))
pid = os.fork()
if pid == 0:
    print("child", work(99), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
EOF
}

case_perl() {
  PERL_HASH_SEED=0 PERL_PERTURB_KEYS=0 perl - <<'EOF'
use strict; use warnings; use Digest::MD5;
my $ctx = Digest::MD5->new;
for my $round (1 .. 3) {
  my %h;
  $h{"k$_-$round"} = [$_, "v" x ($_ % 50)] for 1 .. 150000;
  my @keys = sort keys %h;
  $ctx->add($_, $h{$_}[0], $h{$_}[1]) for @keys[0 .. 999];
  my @big = map { "x" x ($_ % 3000) } 1 .. 20000;
  my $total = 0; $total += length for @big;
  my $text = join "", map { "line $_ of round $round\n" } 1 .. 100000;
  my @lines = grep { /7/ } split /\n/, $text;
  (my $subst = $text) =~ s/line (\d+)/L$1/g;
  $ctx->add(scalar(@keys), $total, scalar(@lines), length($subst));
}
print $ctx->hexdigest, "\n";
EOF
}

case_git() {
  export HOME=$PWD GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
  export GIT_AUTHOR_NAME=keel GIT_AUTHOR_EMAIL=keel@example.org
  export GIT_COMMITTER_NAME=keel GIT_COMMITTER_EMAIL=keel@example.org
  git init -q repo && cd repo || return 1
  git symbolic-ref HEAD refs/heads/main
  local c f
  for c in $(seq 1 15); do
    for f in $(seq 1 40); do
      seq $((f * c)) $((f * c + 200 + c)) >"file$f.txt"
    done
    mkdir -p "dir$((c % 4))"
    printf 'commit %s\n' "$c" >"dir$((c % 4))/note$c"
    git add -A
    export GIT_AUTHOR_DATE="2024-01-01T00:$(printf %02d "$c"):00Z"
    export GIT_COMMITTER_DATE=$GIT_AUTHOR_DATE
    git commit -q -m "commit $c"
  done
  git log --stat --format='%H %an <%ae> %ad %s'
  git diff HEAD~7 HEAD | md5sum
  git blame -s file3.txt | tail -5
  git repack -a -d -q --threads=2
  git fsck --full --no-progress 2>&1
  git archive --format=tar HEAD | md5sum
  git rev-list --count HEAD
}

make_sort_input() {
  awk 'BEGIN { srand(1); for (i = 0; i < 1000000; i++)
         printf "%08d %s %d\n", int(rand() * 100000000), substr("abcdefghij", 1 + i % 10), i }' \
    >"$work/sort.in"
}

case_sort() {
  sort --parallel=2 -S 64M "$work/sort.in" | md5sum
  sort -S 4M -T . -k3,3nr "$work/sort.in" | head -3
  sort -u -k2,2 "$work/sort.in" | wc -l
}

case_gcc() {
  cat >prog.c <<'EOF'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
struct node { struct node *l, *r; int key; };
static struct node *insert(struct node *t, int key) {
  if (t == NULL) { t = calloc(1, sizeof(*t)); t->key = key; return t; }
  if (key < t->key) t->l = insert(t->l, key); else t->r = insert(t->r, key);
  return t;
}
static long sum(const struct node *t, int depth, int *max) {
  if (t == NULL) return 0;
  if (depth > *max) *max = depth;
  return t->key + sum(t->l, depth + 1, max) + sum(t->r, depth + 1, max);
}
static void drop(struct node *t) { if (t) { drop(t->l); drop(t->r); free(t); } }
int main(void) {
  unsigned x = 12345;
  struct node *t = NULL;
  for (int i = 0; i < 200000; i++) { x = x * 1103515245u + 12345u; t = insert(t, (int)(x >> 8)); }
  int depth = 0;
  long s = sum(t, 0, &depth);
  char *buf = NULL; size_t len = 0;
  for (int i = 0; i < 1000; i++) { buf = realloc(buf, len + 64); len += (size_t)sprintf(buf + len, "%d,", i); }
  printf("sum %ld depth %d len %zu tail %s\n", s, depth, len, buf + len - 8);
  free(buf);
  drop(t);
  return 0;
}
EOF
  gcc -O2 -Wall -c prog.c -o prog.o && gcc -o prog prog.o -lm || return 1
  md5sum prog.o | cut -d' ' -f1
  ./prog
}

make_xz_input() {
  # ~7 MB, partly compressible: text with numbers plus pseudo-random lines.
  awk 'BEGIN { srand(2); for (i = 0; i < 300000; i++) {
         if (i % 3) printf "record %d value %d\n", i, int(rand() * 1000);
         else printf "%x%x%x\n", int(rand() * 2^31), int(rand() * 2^31), int(rand() * 2^31) } }' \
    >"$work/xz.in"
}

case_xz() {
  xz -2 -T2 --block-size=1MiB -c "$work/xz.in" >a.xz || return 1
  md5sum <a.xz
  xz -dc -T2 a.xz | md5sum
  head -c 1000000 "$work/xz.in" | xz -7 -T1 -c >b.xz
  md5sum <b.xz
  xz -dc b.xz | md5sum
  xz -t a.xz b.xz && echo tested
}

case_sqlite3() {
  sqlite3 test.db <<'EOF'
PRAGMA cache_size = -32000;
CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL, grp INT, blob BLOB);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 100000)
  INSERT INTO t SELECT x, 'name' || (x * 7919 % 100003), x * 0.5, x % 97, zeroblob(x % 300) FROM c;
CREATE INDEX t_name ON t(name);
CREATE INDEX t_grp ON t(grp, v);
SELECT count(*), sum(v), min(name), max(name), sum(length(blob)) FROM t;
SELECT grp, count(*), sum(id) FROM t GROUP BY grp ORDER BY grp LIMIT 5;
SELECT id, name FROM t WHERE name LIKE 'name123%' ORDER BY id LIMIT 5;
UPDATE t SET v = v * 2, name = upper(name) WHERE grp = 3;
DELETE FROM t WHERE grp = 5;
SELECT count(*), sum(v) FROM t;
SELECT group_concat(name, ',') FROM (SELECT name FROM t ORDER BY name DESC LIMIT 10);
SELECT a.grp, count(*) FROM t a JOIN t b ON a.id = b.id + 1 WHERE a.grp < 3 GROUP BY a.grp;
VACUUM;
PRAGMA integrity_check;
EOF
}

# coreutils, tar, sed, find and id link libselinux, whose constructor
# mallocs before the preloaded library's own constructors have run: the
# first calls meet an allocator that has initialised nothing.
case_coreutils() {
  local src=$here/../../src
  id -u
  mkdir tree && cp -r "$src" tree/src && cp -a tree copy || return 1
  ls -lR --time-style=+ copy | awk '{ $3 = $4 = ""; print }' | md5sum
  find copy -name '*.c' | sort | xargs cat | sed -e 's/keel/KEEL/g' | md5sum
  tar -C copy -cf t.tar src && mkdir x && tar -C x -xf t.tar && diff -r tree/src x/src && echo same
  du -s --apparent-size x | cut -f1
  stat -c '%s %n' t.tar
}

# ---- run -------------------------------------------------------------------

echo "real programs with LD_PRELOAD=$lib"
check_loaded
if wanted sort && [ -n "$(find_prog sort)" ]; then make_sort_input; fi
if wanted xz && [ -n "$(find_prog xz)" ]; then make_xz_input; fi
run_case python3 case_python3 python3
run_case python3-threads case_python3_threads python3
run_case perl case_perl perl
run_case git case_git git seq md5sum
run_case sort case_sort sort md5sum
run_case gcc case_gcc gcc md5sum
run_case xz case_xz xz md5sum
run_case sqlite3 case_sqlite3 sqlite3
run_case coreutils case_coreutils ls cp id find sed tar du stat xargs md5sum

[ "$skipped" -gt 0 ] && echo "($skipped skipped: not installed)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ] || exit 1
if [ $((passed + skipped)) -eq 0 ]; then
  echo "no case ran (KEEL_REAL_ONLY names none?)"
  exit 1
fi
# A program the issue names that is missing makes the run incomplete: ctest
# reports the test as skipped (SKIP_RETURN_CODE 77), not as passed.
[ "$skipped" -eq 0 ] || exit 77
