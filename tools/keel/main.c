/* keel: the command-line tool. `keel --help` lists the subcommands. */
#include <stdio.h>
#include <string.h>

#include <keel/keel.h>

#include "cmd.h"

static keel_cmd_t *cmds;

void keel_cmd_register(keel_cmd_t *cmd) {
  /* Keep the list sorted by name so --help reads the same every time. */
  keel_cmd_t **link = &cmds;
  while (*link != NULL && strcmp((*link)->name, cmd->name) < 0) link = &(*link)->next;
  cmd->next = *link;
  *link = cmd;
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: keel COMMAND [ARGS]\n\nkeel %s: runtime library for multi-threaded C "
          "servers.\n\ncommands:\n",
          keel_version());
  for (keel_cmd_t *c = cmds; c != NULL; c = c->next) {
    char left[64];
    snprintf(left, sizeof(left), "%s %s", c->name, c->usage);
    fprintf(out, "  %-28s %s\n", left, c->help);
  }
  fprintf(out, "\nRuntime options are read from KEEL_OPTIONS=\"name=value,...\"; see `keel stats "
               "--options`.\n");
}

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
      strcmp(argv[1], "help") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (strcmp(argv[1], "--version") == 0) {
    printf("keel %s\n", keel_version());
    return 0;
  }
  for (keel_cmd_t *c = cmds; c != NULL; c = c->next) {
    if (strcmp(c->name, argv[1]) == 0) return c->run(argc - 1, argv + 1);
  }
  fprintf(stderr, "keel: unknown command '%s'; see `keel --help`\n", argv[1]);
  return 2;
}
