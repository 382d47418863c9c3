/* Helpers shared by the lock tests. */
#ifndef KEEL_TESTS_LOCK_UTIL_H
#define KEEL_TESTS_LOCK_UTIL_H

#include <keel/lock.h>

/* The DLM matrix as printed in the docs, written out independently of the
 * masks in src/lock/res.c, so the tests check the code against the spec. */
static const int kt_compat[KEEL_LOCK_MODES][KEEL_LOCK_MODES] = {
    /*        NL CR CW PR PW EX */
    /* NL */ {1, 1, 1, 1, 1, 1},
    /* CR */ {1, 1, 1, 1, 1, 0},
    /* CW */ {1, 1, 1, 0, 0, 0},
    /* PR */ {1, 1, 0, 1, 0, 0},
    /* PW */ {1, 1, 0, 0, 0, 0},
    /* EX */ {1, 0, 0, 0, 0, 0},
};

#endif
