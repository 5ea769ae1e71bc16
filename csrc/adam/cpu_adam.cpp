// SPDX-License-Identifier: Apache-2.0
//
// The host Adam/AdamW step: one multithreaded pass over flat float32 parameters, gradients and moments that
// updates them in place and, optionally, writes the updated parameters rounded to bfloat16 or float16 into a
// given buffer (the upload buffer of an offloaded optimizer) in the same pass, instead of a second pass that
// reads the parameters again.
//
// The arithmetic is torch's single-tensor Adam, in the same order and in float32:
//   Adam (L2):  g = g + wd * p                              (only when wd != 0)
//   AdamW:      p = p * (1 - lr * wd)
//   m = m + (1 - beta1) * (g - m)                           (torch's lerp for a weight below one half)
//   v = v * beta2 + ((1 - beta2) * g) * g
//   p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)   (bc1 = 1 - beta1^t, bc2 = 1 - beta2^t)
// with every scalar computed in double by the caller and rounded to float once. The gradient is first multiplied
// by ``grad_scale`` (the clipping coefficient; 1 leaves it as is), rounded to float, exactly as a separate pass
// ``g *= grad_scale`` over the gradient would, so a clipped step needs no pass of its own. The op is built with
// -ffp-contract=off: every operation is rounded on its own (no fused multiply-add), so the result of an element does
// not depend on the compiler's choices, and the same sequence of torch operations elsewhere (on a GPU) matches it. The caller (Python) checks
// dtypes, sizes and contiguity and passes raw addresses: this file needs no torch headers, so it compiles in
// seconds and does not depend on torch's C++ ABI. A rejected argument is reported by returning its message
// (empty on success), not by a C++ exception, as in csrc/grad_ops.
//
// Optional backup buffers receive each element's parameter, moments and previous 16-bit copy as read, before the
// update, in the same pass: a speculative step (one that starts before the gradient norm is known) can then be
// undone bit for bit without a pass of its own over the state.

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

namespace {

enum OutKind : int { kNoCopy = 0, kBFloat16 = 1, kFloat16 = 2 };

#if defined(__FLT16_MANT_DIG__)
constexpr bool kHasFloat16 = true;
#else
constexpr bool kHasFloat16 = false;
#endif

struct AdamArgs {
    float* param;
    const float* grad;
    float* exp_avg;
    float* exp_avg_sq;
    uint16_t* out;  // bf16 or fp16 bits, or null
    float* backup_param;  // the values before the step (a speculative step's rollback), or all null
    float* backup_exp_avg;
    float* backup_exp_avg_sq;
    uint16_t* backup_out;  // the previous bits of ``out`` (with ``out``), or null
    int64_t numel;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float weight_decay;  // Adam's L2 coefficient (AdamW folds its decay into decay_factor)
    float decay_factor;  // AdamW's 1 - lr * wd; 1 for Adam
    float neg_step_size;  // -lr / bc1
    float bias_correction2_sqrt;
    float eps;
    float grad_scale;
    int threads;
};

// Round to nearest even, as torch's bfloat16 conversion does; NaN stays a quiet NaN.
inline uint16_t to_bfloat16(float value)
{
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint32_t rounding = ((bits >> 16) & 1u) + 0x7FFFu;
    const uint16_t rounded = static_cast<uint16_t>((bits + rounding) >> 16);
    return value != value ? static_cast<uint16_t>(0x7FC0) : rounded;  // a select, so the loop vectorizes
}

inline uint16_t to_float16(float value)
{
#if defined(__FLT16_MANT_DIG__)
    _Float16 half = static_cast<_Float16>(value);  // IEEE round to nearest even
    uint16_t bits;
    std::memcpy(&bits, &half, sizeof(bits));
    return bits;
#else
    (void)value;
    return 0;
#endif
}

template <bool kL2, int kOut, bool kBackup>
void adam_pass(const AdamArgs& a)
{
    float* __restrict__ param = a.param;
    float* __restrict__ backup_param = a.backup_param;
    float* __restrict__ backup_exp_avg = a.backup_exp_avg;
    float* __restrict__ backup_exp_avg_sq = a.backup_exp_avg_sq;
    uint16_t* __restrict__ backup_out = a.backup_out;
    const float* __restrict__ grad = a.grad;
    float* __restrict__ exp_avg = a.exp_avg;
    float* __restrict__ exp_avg_sq = a.exp_avg_sq;
    uint16_t* __restrict__ out = a.out;
    const float one_minus_beta1 = a.one_minus_beta1, beta2 = a.beta2, one_minus_beta2 = a.one_minus_beta2;
    const float weight_decay = a.weight_decay, decay_factor = a.decay_factor, neg_step_size = a.neg_step_size;
    const float bc2_sqrt = a.bias_correction2_sqrt, eps = a.eps, grad_scale = a.grad_scale;
    const int64_t numel = a.numel;

#pragma omp parallel for simd num_threads(a.threads) schedule(simd : static)
    for (int64_t i = 0; i < numel; ++i) {
        float p = param[i];
        if (kBackup) {
            backup_param[i] = p;
            backup_exp_avg[i] = exp_avg[i];
            backup_exp_avg_sq[i] = exp_avg_sq[i];
            if (kOut != kNoCopy) backup_out[i] = out[i];
        }
        float g = grad[i] * grad_scale;
        if (kL2) g = g + weight_decay * p;
        p = p * decay_factor;
        float m = exp_avg[i];
        m = m + one_minus_beta1 * (g - m);
        float v = exp_avg_sq[i] * beta2;
        v = v + (one_minus_beta2 * g) * g;
        const float denom = std::sqrt(v) / bc2_sqrt + eps;
        p = p + (neg_step_size * m) / denom;
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (kOut == kBFloat16) out[i] = to_bfloat16(p);
        if (kOut == kFloat16) out[i] = to_float16(p);
    }
}

template <bool kL2, bool kBackup>
void dispatch_out(const AdamArgs& a, int out_kind)
{
    switch (out_kind) {
        case kNoCopy: adam_pass<kL2, kNoCopy, kBackup>(a); break;
        case kBFloat16: adam_pass<kL2, kBFloat16, kBackup>(a); break;
        default: adam_pass<kL2, kFloat16, kBackup>(a); break;
    }
}

template <bool kL2>
void dispatch_backup(const AdamArgs& a, int out_kind)
{
    if (a.backup_param != nullptr)
        dispatch_out<kL2, true>(a, out_kind);
    else
        dispatch_out<kL2, false>(a, out_kind);
}

// Below this many elements a step runs on the calling thread: starting the team costs more than it saves.
constexpr int64_t kSerialBelow = 1 << 15;

std::string adam_step(uintptr_t param,
               uintptr_t grad,
               uintptr_t exp_avg,
               uintptr_t exp_avg_sq,
               int64_t numel,
               double lr,
               double beta1,
               double beta2,
               double eps,
               double weight_decay,
               bool adamw_mode,
               double bias_correction1,
               double bias_correction2_sqrt,
               uintptr_t out,
               int out_kind,
               int threads,
               double grad_scale,
               uintptr_t backup_param,
               uintptr_t backup_exp_avg,
               uintptr_t backup_exp_avg_sq,
               uintptr_t backup_out)
{
    if (numel < 0) return "cpu_adam: numel must be >= 0";
    if (out_kind < kNoCopy || out_kind > kFloat16) return "cpu_adam: unknown output kind";
    if (out_kind == kFloat16 && !kHasFloat16) return "cpu_adam: this build has no float16 conversion";
    if (out_kind != kNoCopy && out == 0) return "cpu_adam: an output kind without a buffer";
    if (param == 0 || grad == 0 || exp_avg == 0 || exp_avg_sq == 0) return numel == 0 ? "" : "cpu_adam: a null buffer";
    const bool backup = backup_param != 0 || backup_exp_avg != 0 || backup_exp_avg_sq != 0 || backup_out != 0;
    if (backup && (backup_param == 0 || backup_exp_avg == 0 || backup_exp_avg_sq == 0))
        return "cpu_adam: a backup needs the parameter's and both moments' buffers";
    if (backup && (out_kind != kNoCopy) != (backup_out != 0))
        return "cpu_adam: a backup with an output kind needs the output's backup buffer (and only then)";
    if (numel == 0) return "";
    AdamArgs a;
    a.backup_param = reinterpret_cast<float*>(backup_param);
    a.backup_exp_avg = reinterpret_cast<float*>(backup_exp_avg);
    a.backup_exp_avg_sq = reinterpret_cast<float*>(backup_exp_avg_sq);
    a.backup_out = reinterpret_cast<uint16_t*>(backup_out);
    a.param = reinterpret_cast<float*>(param);
    a.grad = reinterpret_cast<const float*>(grad);
    a.exp_avg = reinterpret_cast<float*>(exp_avg);
    a.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq);
    a.out = reinterpret_cast<uint16_t*>(out);
    a.numel = numel;
    a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    a.beta2 = static_cast<float>(beta2);
    a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    a.weight_decay = static_cast<float>(adamw_mode ? 0.0 : weight_decay);
    a.decay_factor = static_cast<float>(adamw_mode ? 1.0 - lr * weight_decay : 1.0);
    a.neg_step_size = static_cast<float>(-lr / bias_correction1);
    a.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
    a.eps = static_cast<float>(eps);
    a.grad_scale = static_cast<float>(grad_scale);
    a.threads = (numel < kSerialBelow || threads < 1) ? 1 : threads;
    if (!adamw_mode && weight_decay != 0.0)
        dispatch_backup<true>(a, out_kind);
    else
        dispatch_backup<false>(a, out_kind);
    return "";
}

int max_threads()
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "Host Adam/AdamW over flat float32 tensors, with an optional bf16/fp16 copy of the result";
    m.def("adam_step",
          &adam_step,
          "One Adam/AdamW step over raw float32 buffers; returns an error message, empty on success",
          py::arg("param"),
          py::arg("grad"),
          py::arg("exp_avg"),
          py::arg("exp_avg_sq"),
          py::arg("numel"),
          py::arg("lr"),
          py::arg("beta1"),
          py::arg("beta2"),
          py::arg("eps"),
          py::arg("weight_decay"),
          py::arg("adamw_mode"),
          py::arg("bias_correction1"),
          py::arg("bias_correction2_sqrt"),
          py::arg("out"),
          py::arg("out_kind"),
          py::arg("threads"),
          py::arg("grad_scale") = 1.0,
          py::arg("backup_param") = 0,
          py::arg("backup_exp_avg") = 0,
          py::arg("backup_exp_avg_sq") = 0,
          py::arg("backup_out") = 0,
          py::call_guard<py::gil_scoped_release>());
    m.def("has_backup", []() { return true; }, "Whether adam_step takes backup buffers (a speculative step's rollback)");
    m.def("has_float16", []() { return kHasFloat16; }, "Whether float16 output is available");
    m.def("max_threads", &max_threads, "OpenMP's default team size");
}
