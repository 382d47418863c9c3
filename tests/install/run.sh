#!/usr/bin/env bash
# Install test: installs keel into a temporary prefix as `make install` does,
# then builds and runs a tiny program against it twice: with pkg-config, and
# with CMake's find_package(keel). Usage: run.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

# The README's command when this is the tree's own build/, as a user runs it;
# cmake --install for other build directories.
if [ "$(readlink -f "$build")" = "$(readlink -f "$src/build")" ]; then
  make -C "$src" --no-print-directory install PREFIX="$prefix" >/dev/null
else
  cmake --install "$build" --prefix "$prefix" >/dev/null
fi
for f in include/keel/keel.h include/keel/heap.h; do
  [ -f "$prefix/$f" ] || { echo "install: missing $f"; exit 1; }
done
libdir=$(dirname "$(find "$prefix" -name libkeel.so -print -quit)")
[ -n "$libdir" ] && [ -f "$libdir/libkeel.a" ] || { echo "install: libkeel.so/.a missing"; exit 1; }
pc=$(find "$prefix" -name keel.pc -print -quit)
[ -n "$pc" ] || { echo "install: keel.pc missing"; exit 1; }

mkdir -p "$tmp/app"
cat >"$tmp/app/main.c" <<'C'
#include <keel/keel.h>
#include <stdio.h>
#include <string.h>
int main(void) {
  int64_t v = -1;
  if (keel_option_get("pool_sweep_s", &v) != 0 || v != 10000) return 1;
  if (strcmp(keel_strerror(KEEL_EBUSY), "busy (in use)") != 0) return 2;
  printf("keel %s ok\n", keel_version());
  return 0;
}
C

# 1. pkg-config, shared and static.
export PKG_CONFIG_PATH=$(dirname "$pc")
cc -o "$tmp/app/pc_shared" "$tmp/app/main.c" $(pkg-config --cflags --libs keel) -Wl,-rpath,"$libdir"
"$tmp/app/pc_shared" | grep -q '^keel .* ok$'
cc -o "$tmp/app/pc_static" "$tmp/app/main.c" $(pkg-config --cflags keel) "$libdir/libkeel.a" \
  $(pkg-config --libs --static keel | sed 's/-lkeel//')
"$tmp/app/pc_static" | grep -q '^keel .* ok$'
echo "install: pkg-config build runs"

# 1b. The opt-in inline pool fast paths against the installed shared library:
# the program reads libkeel.so's exported TLS slots itself.
cat >"$tmp/app/inline.c" <<'C'
#define KEEL_POOL_INLINE
#include <keel/pool.h>
#include <stdio.h>
int main(void) {
  keel_pool_t *p = keel_pool_create("inline", 48, 0, NULL);
  if (p == NULL) return 1;
  void *o = keel_pool_alloc(p); /* first use: the library's path */
  keel_pool_free(p, o);
  for (int i = 0; i < 1000; i++) { /* then the inline pop and push */
    void *x = keel_pool_alloc(p);
    if (x != o) return 2;
    keel_pool_free(p, x);
  }
  keel_pool_stats_t st;
  keel_pool_stats(p, &st);
  if (st.allocs != 1001 || st.frees != 1001 || st.hot_hits != 1000 || st.live != 0) return 3;
  if (keel_pool_destroy(p) != 0) return 4;
  printf("inline pool ok\n");
  return 0;
}
C
cc -std=c11 -Wall -Wextra -pedantic -Werror -O2 -o "$tmp/app/inline" "$tmp/app/inline.c" \
  $(pkg-config --cflags --libs keel) -Wl,-rpath,"$libdir"
"$tmp/app/inline" | grep -q '^inline pool ok$'
# It really reads the slots itself (versioned layout), not only calls.
nm -u "$tmp/app/inline" | grep -q 'keel_pool_slots_v2'
# A library loaded with dlopen after start-up needs no static TLS.
if readelf -d "$libdir/libkeel.so" | grep -q STATIC_TLS; then
  echo "install: libkeel.so needs static TLS"; exit 1
fi
# Without the option the header stays clean for C99 and C++ includers.
printf '#include <keel/pool.h>\nint main(void) {\n  keel_pool_stats_t st = {0};\n  return (int)st.live;\n}\n' >"$tmp/app/c99.c"
cc -std=c99 -pedantic-errors -Wall -Werror $(pkg-config --cflags keel) -c -o "$tmp/app/c99.o" "$tmp/app/c99.c"
if command -v c++ >/dev/null; then
  cp "$tmp/app/c99.c" "$tmp/app/cxx.cc"
  c++ -std=c++11 -pedantic-errors -Wall -Werror $(pkg-config --cflags keel) -c -o "$tmp/app/cxx.o" "$tmp/app/cxx.cc"
fi
echo "install: inline pool fast paths run against libkeel.so"

# 2. CMake find_package, shared and static targets.
cat >"$tmp/app/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(keel_install_test C)
find_package(keel REQUIRED)
add_executable(app_shared main.c)
target_link_libraries(app_shared keel::keel)
add_executable(app_static main.c)
target_link_libraries(app_static keel::keel_static)
CM
cmake -S "$tmp/app" -B "$tmp/app/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_RPATH="$libdir" >/dev/null
cmake --build "$tmp/app/build" >/dev/null
"$tmp/app/build/app_shared" | grep -q '^keel .* ok$'
"$tmp/app/build/app_static" | grep -q '^keel .* ok$'
echo "install: find_package build runs"
echo "1 passed, 0 failed"
