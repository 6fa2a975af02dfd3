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

static int tensor_ok(const pe_rope_tensor *x, int64_t D) {
    if (x->heads == 0) return 1;
    return x->heads > 0 && x->in && x->out && pe_dtype_valid(x->in_dtype) &&
           pe_dtype_valid(x->out_dtype) && D > 0;
}

static int args_ok(const pe_rope_args *a) {
    if (!a || a->batch < 0 || a->seq < 0 || a->head_dim < 0) return 0;
    if (a->rot_dim < 2 || a->rot_dim % 2 || a->rot_dim > a->head_dim) return 0;
    if (a->pairing != PE_PAIR_HALF && a->pairing != PE_PAIR_ADJACENT) return 0;
    const pe_rope_source *s = &a->src;
    if (s->axis_of_slot) {
        for (int64_t i = 0; i < a->rot_dim / 2; ++i)
            if (s->axis_of_slot[i] > 2) return 0;
    }
    if (s->pos) {
        if (!s->inv_freq || (s->pos_batch != 1 && s->pos_batch != a->batch)) return 0;
    } else {
        if (!s->cos || !s->sin || !pe_dtype_valid(s->table_dtype)) return 0;
        if (s->table_batch != 1 && s->table_batch != a->batch) return 0;
    }
    return 1;
}

typedef int (*apply_fn)(const pe_rope_args *);
typedef int (*grad_fn)(const pe_rope_args *, const void *, const int64_t[3], const void *,
                       const int64_t[3], pe_dtype, void *, void *);
typedef int (*tables_fn)(const pe_rope_args *, pe_dtype, void *, void *);

int pe_rope_apply(const pe_rope_args *a) {
    if (!args_ok(a) || !tensor_ok(&a->q, a->head_dim) || !tensor_ok(&a->k, a->head_dim))
        return PE_ERR_ARG;
    if (a->batch == 0 || a->seq == 0) return PE_OK;
    static const apply_fn fns[] = {pe_rope_apply_baseline, pe_rope_apply_avx2, pe_rope_apply_avx512};
    return fns[pe_isa_current()](a);
}

int pe_rope_table_grad(const pe_rope_args *a, const void *grad_q, const int64_t grad_q_stride[3],
                       const void *grad_k, const int64_t grad_k_stride[3], pe_dtype grad_dtype,
                       void *dcos, void *dsin) {
    if (!args_ok(a) || a->src.pos || !dcos || !dsin || !pe_dtype_valid(grad_dtype)) return PE_ERR_ARG;
    if (!a->q.in || !grad_q || (a->k.heads && (!a->k.in || !grad_k))) return PE_ERR_ARG;
    static const grad_fn fns[] = {pe_rope_table_grad_baseline, pe_rope_table_grad_avx2,
                                  pe_rope_table_grad_avx512};
    return fns[pe_isa_current()](a, grad_q, grad_q_stride, grad_k, grad_k_stride, grad_dtype,
                                 dcos, dsin);
}

int pe_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin) {
    if (!args_ok(a) || !a->src.pos || !cos || !sin || !pe_dtype_valid(out_dtype)) return PE_ERR_ARG;
    if (a->src.pos_batch == 0 || a->seq == 0) return PE_OK;
    static const tables_fn fns[] = {pe_rope_tables_baseline, pe_rope_tables_avx2, pe_rope_tables_avx512};
    return fns[pe_isa_current()](a, out_dtype, cos, sin);
}
