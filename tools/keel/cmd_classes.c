/* keel classes: the heap's size classes, or where one request size goes.
 *
 *   keel classes        every class: size, requests served, waste, blocks per page
 *   keel classes 4108   the class serving 4108 bytes and what a block costs
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <keel/heap.h>

#include "cmd.h"

static void print_all(void) {
  keel_heap_class_info_t info[KEEL_HEAP_MAX_CLASSES];
  size_t n = keel_heap_classes(info, KEEL_HEAP_MAX_CLASSES);
  printf("%5s %8s %19s %8s %8s %9s %9s\n", "class", "size", "requests", "worst", "average", "page",
         "per page");
  for (size_t c = 0; c < n; c++) {
    const keel_heap_class_info_t *ci = &info[c];
    char range[40];
    snprintf(range, sizeof(range), "%zu..%zu", ci->min_req, ci->max_req);
    printf("%5zu %8zu %19s %7.1f%% %7.1f%% %8zuK %9zu\n", c, ci->size, range,
           100.0 * ci->worst_waste, 100.0 * ci->avg_waste, ci->page_size >> 10, ci->per_page);
  }
  printf("\n%zu classes; requests above %zu bytes are mapped directly.\n"
         "worst: (size - smallest request) / size; average: over every request size the class\n"
         "serves, counting each block's share of the page remainder.\n",
         n, info[n - 1].size);
}

static int print_one(const char *arg) {
  char *end;
  errno = 0;
  unsigned long long req = strtoull(arg, &end, 0);
  if (errno != 0 || *end != 0 || arg[0] == '-') {
    fprintf(stderr, "keel classes: '%s' is not a size in bytes\n", arg);
    return 2;
  }
  /* The large path's own bound: the request, a page of header and a 4 MiB
   * segment's alignment slack must stay within PTRDIFF_MAX. */
  if (req > (unsigned long long)PTRDIFF_MAX - 4096 - (4u << 20)) {
    printf("%llu bytes: too close to PTRDIFF_MAX, refused: malloc returns NULL with ENOMEM\n", req);
    return 0;
  }
  int c = keel_heap_class_of((size_t)req);
  if (c < 0) {
    printf("%llu bytes: above the largest class, mapped directly: one mapping of %llu KiB "
           "(4 KiB header + the request, rounded up to a page)\n",
           req, (req + 4096 + 4095) / 4096 * 4);
    return 0;
  }
  keel_heap_class_info_t info[KEEL_HEAP_MAX_CLASSES];
  keel_heap_classes(info, KEEL_HEAP_MAX_CLASSES);
  const keel_heap_class_info_t *ci = &info[c];
  double cost = (double)ci->page_size / (double)ci->per_page;
  size_t r = req == 0 ? 1 : (size_t)req;
  printf("%llu bytes -> class %d: %zu-byte blocks (serves %zu..%zu)\n", req, c, ci->size,
         ci->min_req, ci->max_req);
  printf("  internal waste: %zu bytes (%.1f%% of the block)\n", ci->size - r,
         100.0 * (double)(ci->size - r) / (double)ci->size);
  printf("  page: %zu KiB holds %zu blocks, %zu bytes left over\n", ci->page_size >> 10,
         ci->per_page, ci->page_size - ci->per_page * ci->size);
  printf("  cost per block with the page remainder: %.0f bytes = %.3fx the request\n", cost,
         cost / (double)r);
  return 0;
}

static int cmd_classes(int argc, char **argv) {
  if (argc == 1) {
    print_all();
    return 0;
  }
  if (argc == 2 && strcmp(argv[1], "--help") != 0) return print_one(argv[1]);
  fprintf(stderr, "usage: keel classes [SIZE]\n");
  return 2;
}

KEEL_CMD(classes, "classes", "[SIZE]", "print the heap's size classes, or where SIZE bytes go",
         cmd_classes)
