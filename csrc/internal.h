/* Internal helpers shared by the kernel files: sizes, tuning constants, per-ISA entry points
 * (the per-element conversions and arithmetic are in rope_math.h). */
#ifndef POSENC_INTERNAL_H
#define POSENC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "posenc.h"
#include "rope_math.h"

/* Problems below this many elements run on one thread: a parallel region costs more. */
#define PE_SERIAL_ELEMENTS ((int64_t)1 << 15)

/* Outputs of at least this many bytes (the size of a typical L3) are written with
 * streaming stores: they do not stay in cache anyway, and skipping the read-for-ownership
 * of each output line saves a third of the memory traffic.  Smaller outputs stay in cache
 * for the attention that reads them next. */
#define PE_STREAM_BYTES ((int64_t)32 << 20)

/* Tokens per tile when the heads are the outer dimension in memory: the tile's cos/sin
 * rows (fp32) stay in L1 while each head's rows of the tile are rotated. */
#define PE_TOKEN_TILE 16

/* Chunk of a dynamically scheduled loop of n items on nt threads: about 8 chunks per
 * thread, so a thread that starts late (a busy machine) hands its share to the others. */
static inline int64_t pe_chunk(int64_t n, int nt) {
    const int64_t c = n / (8 * (int64_t)(nt > 0 ? nt : 1));
    return c < 1 ? 1 : c;
}

static inline size_t pe_dtype_size(pe_dtype t) {
    switch (t) {
    case PE_FLOAT32: return 4;
    case PE_FLOAT64: return 8;
    case PE_BFLOAT16:
    case PE_FLOAT16: return 2;
    }
    return 0;
}

static inline int pe_dtype_valid(pe_dtype t) { return pe_dtype_size(t) != 0; }

/* Slot of rotary channel e (R = rotary width). */
static inline int64_t pe_slot(pe_pairing p, int64_t e, int64_t R) {
    return p == PE_PAIR_HALF ? (e < R / 2 ? e : e - R / 2) : e / 2;
}

/* Per-ISA implementations: arguments are validated by the public wrappers. */
#define PE_DECLARE_ISA(sfx)                                                                   \
    int pe_rope_apply##sfx(const pe_rope_args *a);                                            \
    int pe_rope_table_grad##sfx(const pe_rope_args *a, const void *gq, const int64_t gqs[3],  \
                                const void *gk, const int64_t gks[3], pe_dtype gdt,           \
                                void *dcos, void *dsin);                                      \
    int pe_rope_tables##sfx(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin);

PE_DECLARE_ISA(_baseline)
PE_DECLARE_ISA(_avx2)
PE_DECLARE_ISA(_avx512)

#endif /* POSENC_INTERNAL_H */
