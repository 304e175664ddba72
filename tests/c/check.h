/* check.h - FAIL / CHECK for the C test programs in tests/c: print where and why, exit 1. */
#ifndef WX_TEST_CHECK_H
#define WX_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                       \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        exit(1);                                                                                   \
    } while (0)
#define CHECK(c, ...)                                                                              \
    do {                                                                                           \
        if (!(c))                                                                                  \
            FAIL(__VA_ARGS__);                                                                     \
    } while (0)

#endif
