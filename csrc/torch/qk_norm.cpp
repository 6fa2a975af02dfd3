// posenc::qk_norm_rope and qk_norm_rope_backward: the per-head RMSNorm + RoPE of q and k
// (posenc.h, pe_qk_norm_rope) and its gradients (q, k and the two weights).  Validate -> fill pe_qk_norm_args -> run the CPU kernel.
// CPU only: CUDA tensors are refused (NotImplementedError from Python, see
// posenc_torch/ops.py) until the CUDA kernels have run on a GPU.
#include <cmath>

#include "shim.h"

namespace posenc {
namespace {

// Dims of seq and heads in a 4-D q/k: (B, H, T, D) with heads_first, else (B, T, H, D).
struct QkLayout {
    size_t seq, heads;
    const char* text;
};

QkLayout qk_layout(bool heads_first) {
    return heads_first ? QkLayout{2, 1, "(batch, heads, seq, head_dim)"}
                       : QkLayout{1, 2, "(batch, seq, heads, head_dim)"};
}

void strides_of(int64_t dst[3], const Meta& m, const QkLayout& L) {
    dst[0] = m.stride(0);
    dst[1] = m.stride(L.seq);
    dst[2] = m.stride(L.heads);
}

void same_dtype(const Meta& m, int32_t want, const char* name) {
    PE_CHECK_TYPE(m.dtype == want, name, " dtype ", scalar_type(m.dtype),
                  " must equal q dtype ", scalar_type(want));
}

// A weight has q's dtype, or is float32 where the form converts the weight to fp32 anyway
// (every form but 0, the Llama form, which multiplies in the weight's dtype after rounding
// to q's: there an fp32 weight would change the result's dtype).  Returns whether it is an
// fp32 weight beside 16-bit tensors.
bool weight_is_f32(const Meta& m, int32_t q_dtype, int64_t form, const char* name) {
    if (m.dtype == q_dtype) return false;
    const DtypeCodes& c = dtype_codes();
    const bool sixteen = q_dtype == c.bf16 || q_dtype == c.f16;
    PE_CHECK_TYPE(m.dtype == c.f32 && sixteen && form != PE_NORM_WEIGHT, name, " dtype ",
                  scalar_type(m.dtype), " must equal q dtype ", scalar_type(q_dtype),
                  sixteen ? " (or be Float for the norms that apply the weight in fp32: "
                            "one_plus_weight, weight_f32, pow)"
                          : "");
    return true;
}

// The checked problem: sizes, dtypes, tables and weights; everything but the tensors' data.
struct Problem {
    pe_qk_norm_args a{};
    Tensor q, k, cos, sin, qw, kw;
    Meta qm, km;
    QkLayout L;
};

Problem check(const Tensor& q_in, const Tensor& k_in, const Tensor& cos_in, const Tensor& sin_in,
              const Tensor& qw_in, const Tensor& kw_in, double eps, int64_t form,
              int64_t pairing, int64_t sum_lanes, bool heads_first) {
    const QkLayout L = qk_layout(heads_first);
    const Meta qm(q_in), km(k_in), cm(cos_in), sm(sin_in), qwm(qw_in), kwm(kw_in);
    const Tensor* all[6] = {&q_in, &k_in, &cos_in, &sin_in, &qw_in, &kw_in};
    const Meta* metas[6] = {&qm, &km, &cm, &sm, &qwm, &kwm};
    const char* names[6] = {"q", "k", "cos", "sin", "q_weight", "k_weight"};
    for (int i = 0; i < 6; ++i) PE_CHECK_VALUE(metas[i]->is_cpu(), names[i],
                                               " must be a CPU tensor, got device ",
                                               DeviceName{*all[i]});
    PE_CHECK_VALUE(qm.dim() == 4, "q must be 4-D ", L.text, ", got shape ", Shape{qm.sizes});
    PE_CHECK_VALUE(km.dim() == 4, "k must be 4-D ", L.text, ", got shape ", Shape{km.sizes});
    const pe_dtype dt = to_pe_dtype(qm.dtype, "q");
    for (int i = 1; i < 4; ++i) same_dtype(*metas[i], qm.dtype, names[i]);
    PE_CHECK_VALUE(form >= PE_NORM_WEIGHT && form <= PE_NORM_POW,
                   "form must be 0 (weight), 1 (one_plus_weight), 2 (weight_f32) or 3 (pow), "
                   "got ", form);
    const bool qw_f32 = weight_is_f32(qwm, qm.dtype, form, "q_weight");
    const bool kw_f32 = weight_is_f32(kwm, qm.dtype, form, "k_weight");
    const IntList qs = qm.sizes, ks = km.sizes;
    const int64_t B = qs[0], T = qs[L.seq], D = qs[3];
    PE_CHECK_VALUE(ks[0] == B, "k batch size ", ks[0], " must equal q batch size ", B);
    PE_CHECK_VALUE(ks[L.seq] == T, "k sequence length ", ks[L.seq],
                   " must equal q sequence length ", T);
    PE_CHECK_VALUE(ks[3] == D, "k head_dim ", ks[3], " must equal q head_dim ", D);
    PE_CHECK_VALUE(cm.dim() == 3, "cos must be 3-D (batch, seq, rot_dim), got shape ",
                   Shape{cm.sizes});
    PE_CHECK_VALUE(same(sm.sizes, cm.sizes), "sin shape ", Shape{sm.sizes},
                   " must equal cos shape ", Shape{cm.sizes});
    const int64_t Bc = cm.size(0), R = cm.size(2);
    PE_CHECK_VALUE(Bc == 1 || Bc == B, "cos batch size ", Bc, " must be 1 or the batch size ", B);
    PE_CHECK_VALUE(cm.size(1) == T, "cos sequence length ", cm.size(1),
                   " must equal the sequence length of q ", T);
    PE_CHECK_VALUE(R >= 2 && R % 2 == 0 && R <= D, "the rotary width (the last dim of cos) ",
                   R, " must be even, >= 2 and at most head_dim ", D);
    PE_CHECK_VALUE(qwm.dim() == 1 && qwm.size(0) == D, "q_weight must have shape (", D,
                   ",) (head_dim), got shape ", Shape{qwm.sizes});
    PE_CHECK_VALUE(kwm.dim() == 1 && kwm.size(0) == D, "k_weight must have shape (", D,
                   ",) (head_dim), got shape ", Shape{kwm.sizes});
    PE_CHECK_VALUE(eps >= 0 && std::isfinite(eps), "eps must be finite and >= 0, got ", eps);
    PE_CHECK_VALUE(pairing == PE_PAIR_HALF || pairing == PE_PAIR_ADJACENT,
                   "pairing must be 0 (half) or 1 (adjacent), got ", pairing);
    PE_CHECK_VALUE(sum_lanes == 1 || sum_lanes == 4 || sum_lanes == 8 || sum_lanes == 16,
                   "sum_lanes must be 1, 4, 8 or 16, got ", sum_lanes);

    Problem p{{}, Tensor(channel_contiguous(q_in, qm)), Tensor(channel_contiguous(k_in, km)),
              cos_in, sin_in, qw_in, kw_in, qm, km, L};
    if (!cm.channel_dense() || !same(sm.strides, cm.strides)) {
        p.cos = torch::stable::contiguous(cos_in);
        p.sin = torch::stable::contiguous(sin_in);
    }
    if (qwm.size(0) > 1 && qwm.stride(0) != 1) p.qw = torch::stable::contiguous(qw_in);
    if (kwm.size(0) > 1 && kwm.stride(0) != 1) p.kw = torch::stable::contiguous(kw_in);
    // one fp32 weight beside 16-bit tensors: both as fp32 (the conversion is exact)
    if (qw_f32 != kw_f32) {
        Tensor& w16 = qw_f32 ? p.kw : p.qw;
        w16 = torch::stable::contiguous(converted(w16, ScalarType::Float));
    }
    p.qm = Meta(p.q);
    p.km = Meta(p.k);
    const Meta pcm(p.cos);
    pe_qk_norm_args& a = p.a;
    a.batch = B;
    a.seq = T;
    a.head_dim = D;
    a.rot_dim = R;
    a.pairing = static_cast<pe_pairing>(pairing);
    a.form = static_cast<pe_norm_form>(form);
    a.dtype = dt;
    a.weight_f32 = qw_f32 || kw_f32;
    a.eps = eps;
    a.sum_lanes = static_cast<int>(sum_lanes);
    a.cos = p.cos.const_data_ptr();
    a.sin = p.sin.const_data_ptr();
    a.table_batch = Bc;
    a.table_stride[0] = pcm.stride(0);
    a.table_stride[1] = pcm.stride(1);
    a.nthreads = num_threads();
    a.q.heads = qs[L.heads];
    a.k.heads = ks[L.heads];
    a.q.x = p.q.const_data_ptr();
    a.k.x = p.k.const_data_ptr();
    strides_of(a.q.x_stride, p.qm, L);
    strides_of(a.k.x_stride, p.km, L);
    a.q.weight = p.qw.const_data_ptr();
    a.k.weight = p.kw.const_data_ptr();
    return p;
}

int32_t rstd_dtype(pe_dtype dt) {
    return dt == PE_FLOAT64 ? dtype_codes().f64 : dtype_codes().f32;
}

// rstd of x (shape without the channel dim), contiguous, bound to t.
Tensor bind_rstd(pe_qk_norm_tensor& t, const Meta& xm, const QkLayout& L, pe_dtype dt) {
    const std::array<int64_t, 3> sizes{xm.size(0), xm.size(1), xm.size(2)};
    Tensor r = empty(sizes, rstd_dtype(dt), xm, "rstd");
    const Meta rm(r);
    t.rstd = r.mutable_data_ptr();
    t.rstd_stride[0] = rm.stride(0);
    t.rstd_stride[1] = rm.stride(L.seq);
    t.rstd_stride[2] = rm.stride(L.heads);
    return r;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> qk_norm_rope_impl(
    const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
    const Tensor& q_weight, const Tensor& k_weight, double eps, int64_t form, int64_t pairing,
    int64_t sum_lanes, bool heads_first) {
    Problem p = check(q, k, cos, sin, q_weight, k_weight, eps, form, pairing, sum_lanes,
                      heads_first);
    const Output qo = output_like(q, Meta(q), p.qm.dtype);
    const Output ko = output_like(k, Meta(k), p.km.dtype);
    p.a.q.out = qo.t.mutable_data_ptr();
    p.a.k.out = ko.t.mutable_data_ptr();
    strides_of(p.a.q.out_stride, qo.m, p.L);
    strides_of(p.a.k.out_stride, ko.m, p.L);
    Tensor qr = bind_rstd(p.a.q, p.qm, p.L, p.a.dtype);
    Tensor kr = bind_rstd(p.a.k, p.km, p.L, p.a.dtype);
    check_status(pe_qk_norm_rope(&p.a), "posenc::qk_norm_rope");
    return {qo.t, ko.t, qr, kr};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> qk_norm_rope_backward_impl(
    const Tensor& grad_q, const Tensor& grad_k, const Tensor& q, const Tensor& k,
    const Tensor& cos, const Tensor& sin, const Tensor& q_weight, const Tensor& k_weight,
    const Tensor& q_rstd, const Tensor& k_rstd, double eps, int64_t form, int64_t pairing,
    int64_t sum_lanes, bool heads_first, const std::optional<Tensor>& q_pow,
    const std::optional<Tensor>& k_pow) {
    Problem p = check(q, k, cos, sin, q_weight, k_weight, eps, form, pairing, sum_lanes,
                      heads_first);
    const Meta gqm(grad_q), gkm(grad_k), qrm(q_rstd), krm(k_rstd);
    PE_CHECK_VALUE(gqm.is_cpu() && gkm.is_cpu() && qrm.is_cpu() && krm.is_cpu(),
                   "grad_q, grad_k, q_rstd and k_rstd must be CPU tensors");
    PE_CHECK_VALUE(same(gqm.sizes, p.qm.sizes), "grad_q shape ", Shape{gqm.sizes},
                   " must equal q shape ", Shape{p.qm.sizes});
    PE_CHECK_VALUE(same(gkm.sizes, p.km.sizes), "grad_k shape ", Shape{gkm.sizes},
                   " must equal k shape ", Shape{p.km.sizes});
    same_dtype(gqm, p.qm.dtype, "grad_q");
    same_dtype(gkm, p.qm.dtype, "grad_k");
    const int32_t rd = rstd_dtype(p.a.dtype);
    PE_CHECK_TYPE(qrm.dtype == rd && krm.dtype == rd, "q_rstd and k_rstd must be ",
                  scalar_type(rd));
    const IntList qs = p.qm.sizes, ks = p.km.sizes;
    PE_CHECK_VALUE(qrm.dim() == 3 && qrm.size(0) == qs[0] && qrm.size(1) == qs[1] &&
                       qrm.size(2) == qs[2],
                   "q_rstd must have shape ", Shape{IntList(qs.data(), 3)}, ", got ",
                   Shape{qrm.sizes});
    PE_CHECK_VALUE(krm.dim() == 3 && krm.size(0) == ks[0] && krm.size(1) == ks[1] &&
                       krm.size(2) == ks[2],
                   "k_rstd must have shape ", Shape{IntList(ks.data(), 3)}, ", got ",
                   Shape{krm.sizes});
    const Tensor gq = channel_contiguous(grad_q, gqm), gk = channel_contiguous(grad_k, gkm);
    const Meta gqd(gq), gkd(gk);
    p.a.q.grad = gq.const_data_ptr();
    p.a.k.grad = gk.const_data_ptr();
    strides_of(p.a.q.grad_stride, gqd, p.L);
    strides_of(p.a.k.grad_stride, gkd, p.L);
    p.a.q.rstd = const_cast<void*>(q_rstd.const_data_ptr());
    p.a.k.rstd = const_cast<void*>(k_rstd.const_data_ptr());
    // rstd (B, d1, d2): its own strides in the (b, t, h) order of the layout
    p.a.q.rstd_stride[0] = qrm.stride(0);
    p.a.q.rstd_stride[1] = qrm.stride(p.L.seq);
    p.a.q.rstd_stride[2] = qrm.stride(p.L.heads);
    p.a.k.rstd_stride[0] = krm.stride(0);
    p.a.k.rstd_stride[1] = krm.stride(p.L.seq);
    p.a.k.rstd_stride[2] = krm.stride(p.L.heads);
    // pow: torch's pow(ms, -1.5) of each row, made by the caller with torch's own kernel
    if (form == PE_NORM_POW) {
        const std::pair<const std::optional<Tensor>*, const Meta*> pows[2] = {{&q_pow, &qrm},
                                                                              {&k_pow, &krm}};
        pe_qk_norm_tensor* ts[2] = {&p.a.q, &p.a.k};
        const char* names[2] = {"q_pow", "k_pow"};
        for (int i = 0; i < 2; ++i) {
            PE_CHECK_VALUE(pows[i].first->has_value(), names[i],
                           " (pow(ms, -1.5) of each row) is required for form 3 (pow)");
            const Tensor& t = pows[i].first->value();
            const Meta m(t), &r = *pows[i].second;
            PE_CHECK_VALUE(m.is_cpu(), names[i], " must be a CPU tensor");
            PE_CHECK_TYPE(m.dtype == rd, names[i], " must be ", scalar_type(rd));
            PE_CHECK_VALUE(same(m.sizes, r.sizes), names[i], " shape ", Shape{m.sizes},
                           " must equal the rstd shape ", Shape{r.sizes});
            ts[i]->ms_pow = t.const_data_ptr();
            ts[i]->ms_pow_stride[0] = m.stride(0);
            ts[i]->ms_pow_stride[1] = m.stride(p.L.seq);
            ts[i]->ms_pow_stride[2] = m.stride(p.L.heads);
        }
    }
    const Output dq = contiguous_output(p.qm, p.qm.dtype);
    const Output dk = contiguous_output(p.km, p.km.dtype);
    p.a.q.out = dq.t.mutable_data_ptr();
    p.a.k.out = dk.t.mutable_data_ptr();
    strides_of(p.a.q.out_stride, dq.m, p.L);
    strides_of(p.a.k.out_stride, dk.m, p.L);
    // The weights' gradients: the sum over the token and head dims of autograd's product
    // (laid out contiguous in q's shape), the call autograd's sum_to makes, then rounded to
    // the weight dtype as autograd rounds a gradient of another dtype.  fp32 / 16-bit: the
    // kernel adds the products in the order of torch's sum on this many threads; fp64:
    // the products are written and torch sums them.
    const int32_t wd = form == PE_NORM_WEIGHT ? p.qm.dtype : rd;
    p.a.sum_threads = num_threads();
    p.a.heads_first = heads_first;
    const bool f64 = p.a.dtype == PE_FLOAT64;
    const std::array<int64_t, 1> dsize{p.a.head_dim};
    Tensor wgq, wgk;
    std::optional<Output> wq, wk;
    if (f64) {
        wq.emplace(contiguous_output(p.qm, wd));
        wk.emplace(contiguous_output(p.km, wd));
        p.a.q.wprod = wq->t.mutable_data_ptr();
        p.a.k.wprod = wk->t.mutable_data_ptr();
        strides_of(p.a.q.wprod_stride, wq->m, p.L);
        strides_of(p.a.k.wprod_stride, wk->m, p.L);
    } else {
        wgq = empty(IntList(dsize.data(), 1), wd, p.qm, "q_weight gradient");
        wgk = empty(IntList(dsize.data(), 1), wd, p.km, "k_weight gradient");
        p.a.q.wgrad = wgq.mutable_data_ptr();
        p.a.k.wgrad = wgk.mutable_data_ptr();
    }
    check_status(pe_qk_norm_rope_backward(&p.a), "posenc::qk_norm_rope_backward");
    if (f64) {
        const std::array<int64_t, 3> rows{0, 1, 2};
        wgq = torch::stable::sum(wq->t, IntList(rows.data(), rows.size()), false);
        wgk = torch::stable::sum(wk->t, IntList(rows.data(), rows.size()), false);
    }
    return {dq.t, dk.t, converted(wgq, q_weight.scalar_type()),
            converted(wgk, k_weight.scalar_type())};
}

}  // namespace posenc
