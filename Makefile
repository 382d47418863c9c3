# keel: the two commands a user needs are `make bench` and `make test`.
#
#   make                 Release build into build/ (installs missing Debian packages first)
#   make test            Release build + ctest, then ASan+UBSan (build-asan/), then TSan (build-tsan/)
#   make bench           Release build, every benchmark suite at its default size;
#                        JSON and PNG plots in bench/results/
#   make install PREFIX=/usr/local
#   make format          clang-format -i on every C file
#   make clean
#
# JOBS sets build parallelism; CTEST_ARGS is passed to every ctest run
# (e.g. CTEST_ARGS="-L unit").
SHELL := /bin/bash
JOBS ?= $(shell nproc)
PREFIX ?= /usr/local
CTEST_ARGS ?=
CMAKE ?= cmake

.PHONY: all build deps test test-release test-asan test-tsan bench install format clean

all: build

deps:
	@scripts/install-deps

# configure(dir, extra cmake args)
define configure
	$(CMAKE) -S . -B $(1) $(2) >/dev/null
endef

build: deps
	$(call configure,build,-DCMAKE_BUILD_TYPE=Release)
	$(CMAKE) --build build -j $(JOBS) -- --no-print-directory

# One stage: configure, build, run ctest; prints the stage's time.
define stage
	@start=$$(date +%s); echo "== test stage $(1): $(3)"; \
	$(CMAKE) -S . -B $(2) $(4) >/dev/null && \
	$(CMAKE) --build $(2) -j $(JOBS) -- --no-print-directory && \
	(cd $(2) && ctest --output-on-failure --timeout 900 -j 2 $(CTEST_ARGS)); rc=$$?; \
	echo "== test stage $(1) took $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc
endef

test: deps
	@t0=$$(date +%s); \
	$(MAKE) --no-print-directory test-release && \
	$(MAKE) --no-print-directory test-asan && \
	$(MAKE) --no-print-directory test-tsan; rc=$$?; \
	echo "== make test: $$(( $$(date +%s) - t0 )) s in all (exit $$rc)"; exit $$rc

test-release:
	$(call stage,release,build,Release build,-DCMAKE_BUILD_TYPE=Release)

test-asan:
	$(call stage,asan,build-asan,ASan+UBSan,-DCMAKE_BUILD_TYPE=Debug -DKEEL_SANITIZE=address)

test-tsan:
	$(call stage,tsan,build-tsan,TSan,-DCMAKE_BUILD_TYPE=Debug -DKEEL_SANITIZE=thread)

bench: build
	@scripts/run-bench

install: build
	$(CMAKE) --install build --prefix $(PREFIX)

format:
	@git ls-files '*.c' '*.h' | xargs clang-format -i

clean:
	rm -rf build build-asan build-tsan
