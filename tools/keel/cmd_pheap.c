/* keel pheap check|info FILE: offline consistency check and a summary of a
 * closed persistent-heap pool (read-only: neither recovers nor writes). */
#include <stdio.h>
#include <string.h>

#include <keel/pheap.h>

#include "cmd.h"

int _keel_ph_info_file(const char *path, FILE *out);

static int cmd_pheap(int argc, char **argv) {
  if (argc != 3 || (strcmp(argv[1], "check") != 0 && strcmp(argv[1], "info") != 0)) {
    fprintf(stderr, "usage: keel pheap check|info FILE\n");
    return 2;
  }
  int rc = strcmp(argv[1], "check") == 0 ? keel_pheap_check(argv[2])
                                         : _keel_ph_info_file(argv[2], stdout);
  if (rc != 0) {
    fprintf(stderr, "keel pheap %s: %s (%s)\n", argv[1], keel_pheap_errmsg(), keel_strerror(rc));
    return 1;
  }
  if (strcmp(argv[1], "check") == 0) printf("%s\n", keel_pheap_errmsg());
  return 0;
}

KEEL_CMD(pheap, "pheap", "check|info FILE",
         "check a persistent-heap pool offline, or print its layout, sizes and objects", cmd_pheap)
