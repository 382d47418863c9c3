/* Subcommands of the `keel` tool. Each tools/keel/cmd_*.c file defines one
 * and registers it with KEEL_CMD(name, help, fn); main.c dispatches. */
#ifndef KEEL_TOOL_CMD_H
#define KEEL_TOOL_CMD_H

typedef struct keel_cmd {
  const char *name;
  const char *usage;                 /* arguments, e.g. "[SIZE]" */
  const char *help;                  /* one line */
  int (*run)(int argc, char **argv); /* argv[0] is the subcommand name */
  struct keel_cmd *next;
} keel_cmd_t;

void keel_cmd_register(keel_cmd_t *cmd);

#define KEEL_CMD(id, name_, usage_, help_, fn_)                                                    \
  static keel_cmd_t keel_cmd_##id = {name_, usage_, help_, fn_, 0};                                \
  __attribute__((constructor)) static void keel_cmd_register_##id(void) {                          \
    keel_cmd_register(&keel_cmd_##id);                                                             \
  }

#endif
