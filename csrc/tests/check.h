/* The check macro shared by the C test programs: count a failure, say where, go on. */
#ifndef POSENC_TEST_CHECK_H
#define POSENC_TEST_CHECK_H

#include <stdio.h>

static int failures = 0;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            ++failures;                                                    \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);           \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
        }                                                                  \
    } while (0)

/* Exit status of a test program: 0 when no check failed. */
static inline int check_report(const char *program) {
    if (failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", program, failures);
        return 1;
    }
    printf("%s: all checks passed\n", program);
    return 0;
}

#endif
