/* Public RoPE entry points: argument checks, then the SIMD variant for this CPU. */
#include "internal.h"

int pe_mrope_axis_map(int64_t n_slots, const int64_t sections[3], int interleaved,
                      uint8_t *axis_of_slot) {
    if (n_slots < 0 || !sections || !axis_of_slot) return PE_ERR_ARG;
    if (sections[0] < 0 || sections[1] < 0 || sections[2] < 0) return PE_ERR_ARG;
    if (sections[0] + sections[1] + sections[2] != n_slots) return PE_ERR_ARG;
    for (int64_t i = 0; i < n_slots; ++i) {
        if (interleaved) {
            axis_of_slot[i] = (i % 3 == 1 && i < 3 * sections[1]) ? 1
                              : (i % 3 == 2 && i < 3 * sections[2]) ? 2 : 0;
        } else {
            axis_of_slot[i] = i < sections[0] ? 0 : i < sections[0] + sections[1] ? 1 : 2;
        }
    }
    return PE_OK;
}

/* Empty tensors may have NULL data: pointers are checked only where data is touched. */
static int tensor_ok(const pe_rope_tensor *x, int empty) {
    if (x->heads == 0) return 1;
    return x->heads > 0 && pe_dtype_valid(x->in_dtype) && pe_dtype_valid(x->out_dtype) &&
           (empty || (x->in && x->out));
}

/* Sizes and options, independent of the angle source. */
static int sizes_ok(const pe_rope_args *a) {
    if (!a || a->batch < 0 || a->seq < 0 || a->head_dim < 0) return 0;
    if (a->rot_dim < 2 || a->rot_dim % 2 || a->rot_dim > a->head_dim) return 0;
    if (a->pairing != PE_PAIR_HALF && a->pairing != PE_PAIR_ADJACENT) return 0;
    const uint8_t *axis = a->src.axis_of_slot;
    if (axis) {
        for (int64_t i = 0; i < a->rot_dim / 2; ++i)
            if (axis[i] > 2) return 0;
    }
    return 1;
}

static int positions_ok(const pe_rope_source *s, int64_t batch) {
    return s->pos && s->inv_freq && (s->pos_batch == 1 || s->pos_batch == batch);
}

static int table_shape_ok(const pe_rope_source *s, int64_t batch) {
    return pe_dtype_valid(s->table_dtype) && (s->table_batch == 1 || s->table_batch == batch);
}

typedef int (*apply_fn)(const pe_rope_args *);
typedef int (*grad_fn)(const pe_rope_args *, const void *, const int64_t[3], const void *,
                       const int64_t[3], pe_dtype, void *, void *);
typedef int (*tables_fn)(const pe_rope_args *, pe_dtype, void *, void *);

int pe_rope_apply(const pe_rope_args *a) {
    if (!sizes_ok(a)) return PE_ERR_ARG;
    const int empty = a->batch == 0 || a->seq == 0;
    if (!tensor_ok(&a->q, empty) || !tensor_ok(&a->k, empty)) return PE_ERR_ARG;
    if (empty) return PE_OK;
    const pe_rope_source *s = &a->src;
    if (s->pos ? !positions_ok(s, a->batch)
               : !(s->cos && s->sin && table_shape_ok(s, a->batch)))
        return PE_ERR_ARG;
    static const apply_fn fns[] = {pe_rope_apply_baseline, pe_rope_apply_avx2, pe_rope_apply_avx512};
    return fns[pe_isa_current()](a);
}

/* The tables are written densely, (A, Bc, T, R); with B = 0 and Bc = 1 they are zeros. */
int pe_rope_table_grad(const pe_rope_args *a, const void *grad_q, const int64_t grad_q_stride[3],
                       const void *grad_k, const int64_t grad_k_stride[3], pe_dtype grad_dtype,
                       void *dcos, void *dsin) {
    if (!sizes_ok(a) || a->src.pos || !table_shape_ok(&a->src, a->batch) ||
        !pe_dtype_valid(grad_dtype))
        return PE_ERR_ARG;
    const int no_input = a->batch == 0 || a->seq == 0;
    if (!tensor_ok(&a->q, no_input) || !tensor_ok(&a->k, no_input)) return PE_ERR_ARG;
    if (!no_input && ((a->q.heads && !grad_q) || (a->k.heads && !grad_k))) return PE_ERR_ARG;
    if (a->src.table_batch == 0 || a->seq == 0) return PE_OK;
    if (!dcos || !dsin) return PE_ERR_ARG;
    static const grad_fn fns[] = {pe_rope_table_grad_baseline, pe_rope_table_grad_avx2,
                                  pe_rope_table_grad_avx512};
    return fns[pe_isa_current()](a, grad_q, grad_q_stride, grad_k, grad_k_stride, grad_dtype,
                                 dcos, dsin);
}

int pe_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin) {
    if (!sizes_ok(a) || !pe_dtype_valid(out_dtype) || a->src.pos_batch < 0) return PE_ERR_ARG;
    if (a->src.pos_batch == 0 || a->seq == 0) return PE_OK;
    if (!positions_ok(&a->src, a->batch) || !cos || !sin) return PE_ERR_ARG;
    static const tables_fn fns[] = {pe_rope_tables_baseline, pe_rope_tables_avx2, pe_rope_tables_avx512};
    return fns[pe_isa_current()](a, out_dtype, cos, sin);
}
