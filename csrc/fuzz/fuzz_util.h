/* Helpers shared by the libFuzzer harnesses: read bounded values from the fuzzer's bytes. */
#ifndef POSENC_FUZZ_UTIL_H
#define POSENC_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* A check of the harness: abort (libFuzzer then saves the input) naming the line. */
#define REQUIRE(c)                                                                  \
    do {                                                                            \
        if (!(c)) {                                                                 \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #c);  \
            abort();                                                                \
        }                                                                           \
    } while (0)

typedef struct fuzz_bytes {
    const uint8_t *p;
    size_t n;
} fuzz_bytes;

/* The next byte (0 once the input is used up). */
static inline unsigned fuzz_byte(fuzz_bytes *b) {
    if (!b->n) return 0;
    --b->n;
    return *b->p++;
}

/* A value in [0, bound). */
static inline unsigned fuzz_below(fuzz_bytes *b, unsigned bound) {
    return bound ? fuzz_byte(b) % bound : 0;
}

static inline uint64_t fuzz_u64(fuzz_bytes *b) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = v << 8 | fuzz_byte(b);
    return v;
}

/* Deterministic stream for bulk data, seeded from the input. */
static inline uint64_t fuzz_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

#endif
