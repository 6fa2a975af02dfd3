/*
 * The inner loops of the RoPE rows (rope_f32.h), one head row of head_dim 128 each, as
 * plain functions for counting their instructions (scripts/loop_insns.py compiles this file
 * with each variant's flags and reads the machine code; nothing links it).  Rows of the
 * table and the positions-in paths, forward and backward, all run these same loops: only
 * the tables they read differ.  Row mode: no streaming stores, no prefetch, NaN-free tables.
 * probe_bf16_heads is the bf16 row as a token's heads run it (rot_half_rows_pairs): 32 rows
 * 128 channels apart, the tables read once for all of them where the variant holds them in
 * registers.
 */
#include "rope_f32.h"

#ifdef PE_VW
void probe_fp32_row(const char *x, char *o, const float *c, const float *ss) {
    const row_mode m = {0, 0, 0, 0};
    rot_half_row(x, o, c, ss, 64, PE_FLOAT32, 0, m);
}

void probe_bf16_row(const char *x, char *o, const float *c, const float *ss) {
    const row_mode m = {0, 0, 0, 0};
    rot_half_row_pairs(x, o, c, ss, 64, m, NULL);
}

void probe_bf16_heads(const char *x, char *o, const float *c, const float *ss) {
    const row_mode m = {0, 0, 0, 0};
    rot_half_rows_pairs(x, 128, o, 128, 32, c, ss, 64, m);
}

/* probe_bf16_heads with tables that pass bf16_dot_tables: the avx512bf16 variant rotates by
 * dot products of bf16 pairs (rot_half_rows_dot); the others ignore the flag. */
void probe_bf16_heads_dot(const char *x, char *o, const float *c, const float *ss) {
    const row_mode m = {0, 0, 0, 1};
    rot_half_rows_pairs(x, 128, o, 128, 32, c, ss, 64, m);
}
#endif
