// SPDX-License-Identifier: Apache-2.0
//
// Bindings of the gradient pipeline's CUDA kernels: each function checks its tensors (CUDA, one device,
// contiguous, float32/bfloat16/float16, sizes), cuts the work into segment batches (grad_ops.h) and launches
// them on the current stream. Contracts: deepspeed/runtime/zero/gradients/grad_ops.py, whose torch implementations these
// replace; the Python wrappers are in deepspeed/ops/grad_ops_native.py.
//
// A rejected input or a failed launch is reported by returning the message (empty when all went well), which
// the Python wrapper raises as RuntimeError: no C++ exception crosses from libc10 through this library, which
// crashed the process with some toolchains (the extension built by GCC 13 against a torch built by another).
// Every check runs before the first launch, so a rejected call changes nothing.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <climits>
#include <string>
#include <tuple>
#include <vector>

#include "grad_ops.h"

namespace ds = ds_grad_ops;

namespace {

using Error = std::string;  // empty: no error

// Return the message built from the arguments when ``cond`` does not hold.
#define DS_REQUIRE(cond, ...) \
    do {                      \
        if (!(cond)) return c10::str(__VA_ARGS__); \
    } while (0)

// Forward the error of a call that returns one.
#define DS_TRY(call)                          \
    do {                                      \
        Error ds_error_ = (call);             \
        if (!ds_error_.empty()) return ds_error_; \
    } while (0)

Error dtype_of(const at::Tensor& t, const char* fn, const char* what, size_t index, ds::DType& type)
{
    switch (t.scalar_type()) {
        case at::kFloat: type = ds::DType::kFloat32; return {};
        case at::kBFloat16: type = ds::DType::kBFloat16; return {};
        case at::kHalf: type = ds::DType::kFloat16; return {};
        default:
            return c10::str("grad_ops.", fn, ": ", what, "[", index, "] is ", t.scalar_type(),
                            "; the native kernels take float32, bfloat16 and float16 tensors");
    }
}

// Every tensor is a contiguous CUDA tensor on ``device``; the first one sets it.
Error check_tensor(const at::Tensor& t, const char* fn, const char* what, size_t index, c10::Device& device,
                   bool& have_device)
{
    DS_REQUIRE(t.defined(), "grad_ops.", fn, ": ", what, "[", index, "] is an undefined tensor");
    DS_REQUIRE(t.is_cuda(), "grad_ops.", fn, ": ", what, "[", index, "] is on ", t.device(),
               "; the native kernels take CUDA tensors");
    DS_REQUIRE(t.is_contiguous(), "grad_ops.", fn, ": ", what, "[", index,
               "] is not contiguous; the native kernels take contiguous tensors (DS_GRAD_OPS=torch keeps the "
               "torch implementation, which takes any layout)");
    if (!have_device) {
        device = t.device();
        have_device = true;
    }
    DS_REQUIRE(t.device() == device, "grad_ops.", fn, ": ", what, "[", index, "] is on ", t.device(),
               " but the first tensor is on ", device);
    return {};
}

Error launch_status(cudaError_t error, const char* fn)
{
    DS_REQUIRE(error == cudaSuccess, "grad_ops.", fn, ": kernel launch failed: ", cudaGetErrorString(error));
    return {};
}

// For a 0-dim device tensor factor, a pointer to it as float32 (kept alive by ``holder``); null otherwise.
Error factor_pointer(const c10::optional<at::Tensor>& factor_tensor, const c10::Device& device, at::Tensor& holder,
                     const float*& pointer, const char* fn)
{
    pointer = nullptr;
    if (!factor_tensor.has_value()) return {};
    const at::Tensor& t = *factor_tensor;
    DS_REQUIRE(t.numel() == 1, "grad_ops.", fn, ": a tensor factor must have one element, not ", t.numel());
    DS_REQUIRE(t.device() == device, "grad_ops.", fn, ": the factor is on ", t.device(), " but the tensors on ",
               device);
    DS_REQUIRE(t.scalar_type() == at::kFloat, "grad_ops.", fn, ": a tensor factor must be float32, not ",
               t.scalar_type());
    holder = t.contiguous();
    pointer = holder.data_ptr<float>();
    return {};
}

// Collects segments of one (dst type, src type) pair and launches a batch when it is full or the pair changes.
class AxpyLauncher {
public:
    AxpyLauncher(bool accumulate, float factor, const float* factor_ptr, cudaStream_t stream, const char* fn)
        : accumulate_(accumulate), factor_(factor), factor_ptr_(factor_ptr), stream_(stream), fn_(fn)
    {
        batch_.count = 0;
    }

    Error add(void* dst, const void* src, int64_t dst_len, int64_t src_len, ds::DType dst_type, ds::DType src_type)
    {
        if (dst_len == 0) return {};
        const int64_t blocks = ds::blocks_for(dst_len);
        const int64_t used = batch_.count ? batch_.block_end[batch_.count - 1] : 0;
        if (batch_.count && (batch_.count == ds::kMaxSegments || dst_type != dst_type_ || src_type != src_type_ ||
                             used + blocks > INT32_MAX))
            DS_TRY(flush());
        dst_type_ = dst_type;
        src_type_ = src_type;
        const int64_t start = batch_.count ? batch_.block_end[batch_.count - 1] : 0;
        batch_.seg[batch_.count] = ds::Segment{dst, src, dst_len, src_len};
        batch_.block_end[batch_.count] = static_cast<int32_t>(start + blocks);
        ++batch_.count;
        return {};
    }

    // The source type of the batch being filled (a zero-filling segment joins it rather than starting another).
    ds::DType src_type() const { return src_type_; }

    Error flush()
    {
        if (batch_.count == 0) return {};
        const cudaError_t status =
            ds::launch_axpy(batch_, dst_type_, src_type_, accumulate_, factor_, factor_ptr_, stream_);
        batch_.count = 0;
        return launch_status(status, fn_);
    }

private:
    ds::SegmentBatch batch_;
    ds::DType dst_type_ = ds::DType::kFloat32, src_type_ = ds::DType::kFloat32;
    bool accumulate_;
    float factor_;
    const float* factor_ptr_;
    cudaStream_t stream_;
    const char* fn_;
};

char* byte_ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

Error check_size(int64_t numel, const char* fn)
{
    DS_REQUIRE(ds::blocks_for(numel) <= INT32_MAX, "grad_ops.", fn, ": a tensor of ", numel,
               " elements is too large for one launch");
    return {};
}

cudaStream_t current_stream(const c10::Device& device)
{
    return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

// dsts[i] = [dsts[i] +] factor * srcs[i] for every i (equal element counts).
Error pairwise(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs, bool accumulate,
               double factor, const c10::optional<at::Tensor>& factor_tensor, const char* fn, const char* dst_name,
               const char* src_name)
{
    DS_REQUIRE(dsts.size() == srcs.size(), "grad_ops.", fn, ": ", dsts.size(), " ", dst_name, " but ", srcs.size(),
               " ", src_name);
    if (dsts.empty()) return {};
    c10::Device device(c10::kCUDA);
    bool have_device = false;
    std::vector<ds::DType> dst_types(dsts.size()), src_types(srcs.size());
    for (size_t i = 0; i < dsts.size(); ++i) {
        DS_TRY(check_tensor(dsts[i], fn, dst_name, i, device, have_device));
        DS_TRY(check_tensor(srcs[i], fn, src_name, i, device, have_device));
        DS_TRY(dtype_of(dsts[i], fn, dst_name, i, dst_types[i]));
        DS_TRY(dtype_of(srcs[i], fn, src_name, i, src_types[i]));
        DS_REQUIRE(dsts[i].numel() == srcs[i].numel(), "grad_ops.", fn, ": ", dst_name, "[", i, "] has ",
                   dsts[i].numel(), " elements but ", src_name, "[", i, "] has ", srcs[i].numel());
        DS_TRY(check_size(dsts[i].numel(), fn));
    }
    const c10::cuda::CUDAGuard guard(device);
    at::Tensor holder;
    const float* factor_ptr = nullptr;
    DS_TRY(factor_pointer(factor_tensor, device, holder, factor_ptr, fn));
    AxpyLauncher launcher(accumulate, static_cast<float>(factor), factor_ptr, current_stream(device), fn);
    for (size_t i = 0; i < dsts.size(); ++i)
        DS_TRY(launcher.add(dsts[i].data_ptr(), srcs[i].data_ptr(), dsts[i].numel(), srcs[i].numel(), dst_types[i],
                            src_types[i]));
    return launcher.flush();
}

Error scale_accumulate(const std::vector<at::Tensor>& targets, const std::vector<at::Tensor>& grads, double factor,
                       const c10::optional<at::Tensor>& factor_tensor)
{
    return pairwise(targets, grads, true, factor, factor_tensor, "scale_accumulate", "targets", "grads");
}

Error cast_copy(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs)
{
    return pairwise(dsts, srcs, false, 1.0, c10::nullopt, "cast_copy", "dsts", "srcs");
}

Error scale_(const std::vector<at::Tensor>& tensors, double coef, const c10::optional<at::Tensor>& coef_tensor)
{
    return pairwise(tensors, tensors, false, coef, coef_tensor, "scale_", "tensors", "tensors");
}

// out[:n] = [out[:n] +] factor * cat(grads); out[n:] zeroed unless accumulating (or ``exact``: n == out.numel()).
Error flatten(const std::vector<at::Tensor>& grads, const at::Tensor& out, double factor,
              const c10::optional<at::Tensor>& factor_tensor, bool accumulate, bool exact, const char* fn)
{
    c10::Device device(c10::kCUDA);
    bool have_device = false;
    DS_TRY(check_tensor(out, fn, "out", 0, device, have_device));
    ds::DType out_type;
    DS_TRY(dtype_of(out, fn, "out", 0, out_type));
    DS_REQUIRE(out.dim() == 1, "grad_ops.", fn, ": out must be flat, not of shape ", out.sizes());
    int64_t total = 0;
    std::vector<ds::DType> types(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
        DS_TRY(check_tensor(grads[i], fn, "grads", i, device, have_device));
        DS_TRY(dtype_of(grads[i], fn, "grads", i, types[i]));
        total += grads[i].numel();
    }
    DS_REQUIRE(total <= out.numel(), "grad_ops.", fn, ": the tensors hold ", total, " elements but out only ",
               out.numel());
    DS_REQUIRE(!exact || total == out.numel(), "grad_ops.", fn, ": the tensors hold ", total,
               " elements but out has ", out.numel());
    DS_TRY(check_size(out.numel(), fn));
    const c10::cuda::CUDAGuard guard(device);
    at::Tensor holder;
    const float* factor_ptr = nullptr;
    DS_TRY(factor_pointer(factor_tensor, device, holder, factor_ptr, fn));
    AxpyLauncher launcher(accumulate, static_cast<float>(factor), factor_ptr, current_stream(device), fn);
    const int64_t item = out.element_size();
    int64_t offset = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
        const int64_t n = grads[i].numel();
        DS_TRY(launcher.add(byte_ptr(out) + offset * item, grads[i].data_ptr(), n, n, out_type, types[i]));
        offset += n;
    }
    if (!accumulate && total < out.numel())
        DS_TRY(launcher.add(byte_ptr(out) + total * item, nullptr, out.numel() - total, 0, out_type,
                            launcher.src_type()));
    return launcher.flush();
}

Error flatten_into(const std::vector<at::Tensor>& grads, const at::Tensor& out, double factor,
                   const c10::optional<at::Tensor>& factor_tensor, bool accumulate)
{
    return flatten(grads, out, factor, factor_tensor, accumulate, false, "flatten_into");
}

Error pack_cast(const std::vector<at::Tensor>& srcs, const at::Tensor& out)
{
    return flatten(srcs, out, 1.0, c10::nullopt, false, true, "pack_cast");
}

// rows[r, off_i : off_i + c_i] = [rows +] factor * chunk r of grads[i] (c_i = ceil(n_i / W), zero padded).
Error chunk_into(const std::vector<at::Tensor>& grads, const at::Tensor& rows, double factor,
                 const c10::optional<at::Tensor>& factor_tensor, bool accumulate)
{
    const char* fn = "chunk_into";
    c10::Device device(c10::kCUDA);
    bool have_device = false;
    DS_TRY(check_tensor(rows, fn, "rows", 0, device, have_device));
    DS_REQUIRE(rows.dim() == 2, "grad_ops.chunk_into: rows must be [world, columns], not of shape ", rows.sizes());
    ds::DType rows_type;
    DS_TRY(dtype_of(rows, fn, "rows", 0, rows_type));
    const int64_t world = rows.size(0), columns = rows.size(1);
    DS_REQUIRE(world > 0, "grad_ops.chunk_into: rows has no row");
    std::vector<ds::DType> types(grads.size());
    std::vector<int64_t> chunk(grads.size());
    int64_t total = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
        DS_TRY(check_tensor(grads[i], fn, "grads", i, device, have_device));
        DS_TRY(dtype_of(grads[i], fn, "grads", i, types[i]));
        const int64_t n = grads[i].numel();
        chunk[i] = n == 0 ? 1 : (n + world - 1) / world;
        total += chunk[i];
    }
    DS_REQUIRE(total == columns, "grad_ops.chunk_into: the chunks take ", total, " columns but rows has ", columns);
    DS_TRY(check_size(columns, fn));
    const c10::cuda::CUDAGuard guard(device);
    at::Tensor holder;
    const float* factor_ptr = nullptr;
    DS_TRY(factor_pointer(factor_tensor, device, holder, factor_ptr, fn));
    AxpyLauncher launcher(accumulate, static_cast<float>(factor), factor_ptr, current_stream(device), fn);
    const int64_t item = rows.element_size();
    for (int64_t r = 0; r < world; ++r) {
        int64_t column = 0;
        for (size_t i = 0; i < grads.size(); ++i) {
            const int64_t n = grads[i].numel();
            const int64_t begin = std::min(n, r * chunk[i]);
            const int64_t src_len = std::min(n - begin, chunk[i]);
            const char* src = n ? static_cast<const char*>(grads[i].data_ptr()) + begin * grads[i].element_size()
                                : nullptr;
            DS_TRY(launcher.add(byte_ptr(rows) + (r * columns + column) * item, src, chunk[i], src_len, rows_type,
                                types[i]));
            column += chunk[i];
        }
    }
    return launcher.flush();
}

// The sum of squares of every element as a 0-dim float32 tensor on the tensors' device; with ``scale`` every
// tensor is first multiplied in place by ``unscale`` (or by the one-element device tensor ``unscale_tensor``).
// Returns (result, "") or (undefined, the error).
std::tuple<at::Tensor, Error> partial_sq_norm(const std::vector<at::Tensor>& tensors, bool scale, double unscale,
                                              const c10::optional<at::Tensor>& unscale_tensor)
{
    const char* fn = "partial_sq_norm";
    const auto failed = [](Error error) { return std::make_tuple(at::Tensor(), std::move(error)); };
    if (tensors.empty()) return failed("grad_ops.partial_sq_norm: the native kernel needs at least one tensor");
    c10::Device device(c10::kCUDA);
    bool have_device = false;
    std::vector<ds::DType> types(tensors.size());
    int64_t partial_count = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
        Error error = check_tensor(tensors[i], fn, "tensors", i, device, have_device);
        if (error.empty()) error = dtype_of(tensors[i], fn, "tensors", i, types[i]);
        if (error.empty()) error = check_size(tensors[i].numel(), fn);
        if (!error.empty()) return failed(std::move(error));
        partial_count += ds::blocks_for(tensors[i].numel());
    }
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = current_stream(device);
    at::Tensor holder;
    const float* factor_ptr = nullptr;
    if (scale) {
        Error error = factor_pointer(unscale_tensor, device, holder, factor_ptr, fn);
        if (!error.empty()) return failed(std::move(error));
    }
    const auto float_options = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor result = at::empty({}, float_options);
    at::Tensor partials = at::empty({std::max<int64_t>(partial_count, 1)}, float_options);

    ds::SegmentBatch batch;
    batch.count = 0;
    ds::DType batch_type = ds::DType::kFloat32;
    int64_t base = 0;  // the first partial of the batch being filled
    auto flush = [&]() -> Error {
        if (batch.count == 0) return {};
        const cudaError_t status = ds::launch_sumsq(batch, batch_type, scale, static_cast<float>(unscale), factor_ptr,
                                                    partials.data_ptr<float>(), base, stream);
        base += batch.block_end[batch.count - 1];
        batch.count = 0;
        return launch_status(status, fn);
    };
    for (size_t i = 0; i < tensors.size(); ++i) {
        const int64_t n = tensors[i].numel();
        if (n == 0) continue;
        const int64_t blocks = ds::blocks_for(n);
        const int64_t used = batch.count ? batch.block_end[batch.count - 1] : 0;
        if (batch.count && (batch.count == ds::kMaxSegments || types[i] != batch_type || used + blocks > INT32_MAX)) {
            Error error = flush();
            if (!error.empty()) return failed(std::move(error));
        }
        batch_type = types[i];
        const int64_t start = batch.count ? batch.block_end[batch.count - 1] : 0;
        batch.seg[batch.count] = ds::Segment{tensors[i].data_ptr(), nullptr, n, 0};
        batch.block_end[batch.count] = static_cast<int32_t>(start + blocks);
        ++batch.count;
    }
    Error error = flush();
    if (error.empty())
        error = launch_status(ds::launch_sum_partials(partials.data_ptr<float>(), base, result.data_ptr<float>(),
                                                      stream),
                              fn);
    if (!error.empty()) return failed(std::move(error));
    return std::make_tuple(result, Error());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "CUDA kernels of the gradient pipeline (deepspeed/runtime/zero/gradients/grad_ops.py); each returns an error "
              "message, empty on success";
    m.def("scale_accumulate", &scale_accumulate, "targets[i] += factor * grads[i]");
    m.def("flatten_into", &flatten_into, "out[:n] = [out[:n] +] factor * cat(grads); tail zeroed unless accumulating");
    m.def("chunk_into", &chunk_into, "rank-major copy-in of every gradient's W chunks");
    m.def("partial_sq_norm", &partial_sq_norm, "sum of squares (after an optional in-place scale)");
    m.def("scale_", &scale_, "tensors[i] *= coef");
    m.def("cast_copy", &cast_copy, "dsts[i].copy_(srcs[i]) with the cast");
    m.def("pack_cast", &pack_cast, "out = cat(srcs) cast to out's dtype");
    m.def("segment_limits", []() {
        return std::make_tuple(ds::kMaxSegments, static_cast<int64_t>(ds::kBlockElems));
    }, "(segments per launch, elements per block)");
}
