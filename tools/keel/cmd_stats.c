/* keel stats: what the library is configured to do, and (as modules land)
 * what it is doing. `--options` prints the runtime options table. */
#include <stdio.h>
#include <string.h>

#include <keel/keel.h>

#include "cmd.h"

static int cmd_stats(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--options") == 0) {
    keel_options_print(stdout);
    return 0;
  }
  if (argc == 1) {
    printf("keel %s\n\n", keel_version());
    keel_options_print(stdout);
    return 0;
  }
  fprintf(stderr, "usage: keel stats [--options]\n");
  return 2;
}

KEEL_CMD(stats, "stats", "[--options]", "print the runtime options table (and library statistics)",
         cmd_stats)
