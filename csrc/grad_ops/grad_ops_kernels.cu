// SPDX-License-Identifier: Apache-2.0
//
// The gradient pipeline's element-wise passes as multi-segment kernels (see grad_ops.h for the batch layout).
//
// A launch covers up to kMaxSegments segments; block b finds its segment by a binary search over block_end and
// handles kBlockElems consecutive elements of it. When both arrays of the segment are 16-byte aligned, a thread
// moves kUnroll groups of kVec consecutive elements with 16-byte vector loads and stores (element by element for
// a group cut by the segment's end). Otherwise (a view at an odd offset, as in a flat bucket) the block moves its
// elements one per thread and step, so consecutive threads touch consecutive elements and every warp access is
// coalesced; all of a thread's loads are issued before the first store in both layouts. All arithmetic is
// float32; results are rounded once to the destination type, round to nearest even, as torch's casts do.

#include "grad_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ds_grad_ops {
namespace {

template <typename T>
struct Io;

template <>
struct Io<float> {
    static __device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
    static __device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
    static __device__ __forceinline__ float round(float v) { return v; }
    static __device__ __forceinline__ void load8(const float* p, float (&v)[kVec])
    {
        const float4 a = reinterpret_cast<const float4*>(p)[0];
        const float4 b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
    static __device__ __forceinline__ void store8(float* p, const float (&v)[kVec])
    {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
};

template <>
struct Io<__nv_bfloat16> {
    using T = __nv_bfloat16;
    static __device__ __forceinline__ float load(const T* p, int64_t i) { return __bfloat162float(p[i]); }
    static __device__ __forceinline__ void store(T* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
    static __device__ __forceinline__ float round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
    static __device__ __forceinline__ void load8(const T* p, float (&v)[kVec])
    {
        const uint4 raw = *reinterpret_cast<const uint4*>(p);
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int k = 0; k < kVec / 2; ++k) {
            const float2 f = __bfloat1622float2(pairs[k]);
            v[2 * k] = f.x, v[2 * k + 1] = f.y;
        }
    }
    static __device__ __forceinline__ void store8(T* p, const float (&v)[kVec])
    {
        uint4 raw;
        __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
        for (int k = 0; k < kVec / 2; ++k) pairs[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
        *reinterpret_cast<uint4*>(p) = raw;
    }
};

template <>
struct Io<__half> {
    using T = __half;
    static __device__ __forceinline__ float load(const T* p, int64_t i) { return __half2float(p[i]); }
    static __device__ __forceinline__ void store(T* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
    static __device__ __forceinline__ float round(float v) { return __half2float(__float2half_rn(v)); }
    static __device__ __forceinline__ void load8(const T* p, float (&v)[kVec])
    {
        const uint4 raw = *reinterpret_cast<const uint4*>(p);
        const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
        for (int k = 0; k < kVec / 2; ++k) {
            const float2 f = __half22float2(pairs[k]);
            v[2 * k] = f.x, v[2 * k + 1] = f.y;
        }
    }
    static __device__ __forceinline__ void store8(T* p, const float (&v)[kVec])
    {
        uint4 raw;
        __half2* pairs = reinterpret_cast<__half2*>(&raw);
#pragma unroll
        for (int k = 0; k < kVec / 2; ++k) pairs[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
        *reinterpret_cast<uint4*>(p) = raw;
    }
};

// The segment block ``block`` belongs to: the first i with block < block_end[i].
__device__ __forceinline__ int find_segment(const SegmentBatch& batch, int32_t block)
{
    int lo = 0, hi = batch.count - 1;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (batch.block_end[mid] <= block)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

__device__ __forceinline__ bool aligned16(const void* a, const void* b)
{
    return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

// The misaligned layout of axpy_kernel: element start + j * kThreads + threadIdx.x for every j.
template <typename D, typename S, bool kAccumulate>
__device__ __forceinline__ void axpy_strided(D* dst, const S* src, int64_t dst_len, int64_t src_len, int64_t start,
                                             float f)
{
    constexpr int kSteps = kVec * kUnroll;
    float in[kSteps];
    float out[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
        const int64_t i = start + j * kThreads + threadIdx.x;
        in[j] = i < src_len ? Io<S>::load(src, i) : 0.0f;
        if (kAccumulate) out[j] = i < src_len ? Io<D>::load(dst, i) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
        const int64_t i = start + j * kThreads + threadIdx.x;
        if (i < src_len)
            Io<D>::store(dst, i, kAccumulate ? out[j] + f * in[j] : f * in[j]);
        else if (!kAccumulate && i < dst_len)
            Io<D>::store(dst, i, 0.0f);  // padding
    }
}

// dst = (kAccumulate ? dst : 0) + factor * src over one block's share of one segment.
template <typename D, typename S, bool kAccumulate>
__global__ void __launch_bounds__(kThreads) axpy_kernel(const SegmentBatch batch, float factor, const float* factor_ptr)
{
    const int s = find_segment(batch, static_cast<int32_t>(blockIdx.x));
    D* dst = static_cast<D*>(batch.seg[s].dst);
    const S* src = static_cast<const S*>(batch.seg[s].src);
    const int64_t dst_len = batch.seg[s].dst_len;
    const int64_t src_len = batch.seg[s].src_len;
    const int32_t first_block = s == 0 ? 0 : batch.block_end[s - 1];
    const int64_t start = static_cast<int64_t>(blockIdx.x - first_block) * kBlockElems;
    const float f = factor_ptr != nullptr ? *factor_ptr : factor;
    if (!aligned16(dst, src)) {
        axpy_strided<D, S, kAccumulate>(dst, src, dst_len, src_len, start, f);
        return;
    }

    int64_t first[kUnroll];
    bool whole[kUnroll];
    float in[kUnroll][kVec];
    float out[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        first[u] = start + static_cast<int64_t>(u * kThreads + threadIdx.x) * kVec;
        whole[u] = first[u] + kVec <= src_len;
    }
    // All loads of the thread are issued before the first use, so they are in flight together.
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        if (whole[u]) {
            Io<S>::load8(src + first[u], in[u]);
            if (kAccumulate) Io<D>::load8(dst + first[u], out[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        if (whole[u]) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) out[u][k] = kAccumulate ? out[u][k] + f * in[u][k] : f * in[u][k];
            Io<D>::store8(dst + first[u], out[u]);
        } else {
            for (int k = 0; k < kVec; ++k) {
                const int64_t i = first[u] + k;
                if (i >= dst_len) break;
                if (i < src_len) {
                    const float v = f * Io<S>::load(src, i);
                    Io<D>::store(dst, i, kAccumulate ? Io<D>::load(dst, i) + v : v);
                } else if (!kAccumulate) {
                    Io<D>::store(dst, i, 0.0f);  // padding
                }
            }
        }
    }
}

__device__ __forceinline__ float block_sum(float value)
{
    __shared__ float warp_sums[kThreads / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_down_sync(0xffffffffu, value, offset);
    if (lane == 0) warp_sums[warp] = value;
    __syncthreads();
    value = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
    if (warp == 0) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_down_sync(0xffffffffu, value, offset);
    }
    return value;
}

// The misaligned layout of sumsq_kernel: element start + j * kThreads + threadIdx.x for every j.
template <typename T, bool kScale>
__device__ __forceinline__ float sumsq_strided(T* data, int64_t len, int64_t start, float f)
{
    constexpr int kSteps = kVec * kUnroll;
    float v[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
        const int64_t i = start + j * kThreads + threadIdx.x;
        v[j] = i < len ? Io<T>::load(data, i) : 0.0f;
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
        const int64_t i = start + j * kThreads + threadIdx.x;
        if (kScale && i < len) {
            v[j] = Io<T>::round(f * v[j]);
            Io<T>::store(data, i, v[j]);
        }
        sum += v[j] * v[j];
    }
    return sum;
}

// The aligned layout of sumsq_kernel: kUnroll groups of kVec consecutive elements per thread.
template <typename T, bool kScale>
__device__ __forceinline__ float sumsq_vector(T* data, int64_t len, int64_t start, float f)
{
    int64_t first[kUnroll];
    bool whole[kUnroll];
    float v[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        first[u] = start + static_cast<int64_t>(u * kThreads + threadIdx.x) * kVec;
        whole[u] = first[u] + kVec <= len;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (whole[u]) Io<T>::load8(data + first[u], v[u]);
    float sum = 0.0f;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        if (whole[u]) {
            if (kScale) {
#pragma unroll
                for (int k = 0; k < kVec; ++k) v[u][k] = Io<T>::round(f * v[u][k]);
                Io<T>::store8(data + first[u], v[u]);
            }
#pragma unroll
            for (int k = 0; k < kVec; ++k) sum += v[u][k] * v[u][k];
        } else {
            for (int k = 0; k < kVec; ++k) {
                const int64_t i = first[u] + k;
                if (i >= len) break;
                float x = Io<T>::load(data, i);
                if (kScale) {
                    x = Io<T>::round(f * x);
                    Io<T>::store(data, i, x);
                }
                sum += x * x;
            }
        }
    }
    return sum;
}

// partials[base + block] = the sum of squares of one block's share of one segment (after the in-place scale).
template <typename T, bool kScale>
__global__ void __launch_bounds__(kThreads)
    sumsq_kernel(const SegmentBatch batch, float factor, const float* factor_ptr, float* partials, int64_t base)
{
    const int s = find_segment(batch, static_cast<int32_t>(blockIdx.x));
    T* data = static_cast<T*>(batch.seg[s].dst);
    const int64_t len = batch.seg[s].dst_len;
    const int32_t first_block = s == 0 ? 0 : batch.block_end[s - 1];
    const int64_t start = static_cast<int64_t>(blockIdx.x - first_block) * kBlockElems;
    const float f = kScale ? (factor_ptr != nullptr ? *factor_ptr : factor) : 1.0f;
    float sum = aligned16(data, data) ? sumsq_vector<T, kScale>(data, len, start, f)
                                      : sumsq_strided<T, kScale>(data, len, start, f);
    sum = block_sum(sum);
    if (threadIdx.x == 0) partials[base + blockIdx.x] = sum;
}

constexpr int kFinishThreads = 1024;

__global__ void __launch_bounds__(kFinishThreads) sum_partials_kernel(const float* partials, int64_t count, float* out)
{
    __shared__ double warp_sums[kFinishThreads / 32];
    double value = 0.0;
    for (int64_t i = threadIdx.x; i < count; i += kFinishThreads) value += static_cast<double>(partials[i]);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_down_sync(0xffffffffu, value, offset);
    if (lane == 0) warp_sums[warp] = value;
    __syncthreads();
    if (warp == 0) {
        value = warp_sums[lane];  // kFinishThreads / 32 == 32 warps: one per lane
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_down_sync(0xffffffffu, value, offset);
        if (lane == 0) out[0] = static_cast<float>(value);
    }
}

int32_t grid_of(const SegmentBatch& batch) { return batch.count > 0 ? batch.block_end[batch.count - 1] : 0; }

template <typename D, typename S>
cudaError_t axpy_typed(const SegmentBatch& batch, bool accumulate, float factor, const float* factor_ptr,
                       cudaStream_t stream)
{
    const int32_t grid = grid_of(batch);
    if (grid == 0) return cudaSuccess;
    if (accumulate)
        axpy_kernel<D, S, true><<<grid, kThreads, 0, stream>>>(batch, factor, factor_ptr);
    else
        axpy_kernel<D, S, false><<<grid, kThreads, 0, stream>>>(batch, factor, factor_ptr);
    return cudaGetLastError();
}

template <typename D>
cudaError_t axpy_dst(const SegmentBatch& batch, DType src_type, bool accumulate, float factor,
                     const float* factor_ptr, cudaStream_t stream)
{
    switch (src_type) {
        case DType::kFloat32: return axpy_typed<D, float>(batch, accumulate, factor, factor_ptr, stream);
        case DType::kBFloat16: return axpy_typed<D, __nv_bfloat16>(batch, accumulate, factor, factor_ptr, stream);
        case DType::kFloat16: return axpy_typed<D, __half>(batch, accumulate, factor, factor_ptr, stream);
    }
    return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t sumsq_typed(const SegmentBatch& batch, bool scale, float factor, const float* factor_ptr,
                        float* partials, int64_t base, cudaStream_t stream)
{
    const int32_t grid = grid_of(batch);
    if (grid == 0) return cudaSuccess;
    if (scale)
        sumsq_kernel<T, true><<<grid, kThreads, 0, stream>>>(batch, factor, factor_ptr, partials, base);
    else
        sumsq_kernel<T, false><<<grid, kThreads, 0, stream>>>(batch, factor, factor_ptr, partials, base);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_axpy(const SegmentBatch& batch,
                        DType dst_type,
                        DType src_type,
                        bool accumulate,
                        float factor,
                        const float* factor_ptr,
                        cudaStream_t stream)
{
    switch (dst_type) {
        case DType::kFloat32: return axpy_dst<float>(batch, src_type, accumulate, factor, factor_ptr, stream);
        case DType::kBFloat16:
            return axpy_dst<__nv_bfloat16>(batch, src_type, accumulate, factor, factor_ptr, stream);
        case DType::kFloat16: return axpy_dst<__half>(batch, src_type, accumulate, factor, factor_ptr, stream);
    }
    return cudaErrorInvalidValue;
}

cudaError_t launch_sumsq(const SegmentBatch& batch,
                         DType type,
                         bool scale,
                         float factor,
                         const float* factor_ptr,
                         float* partials,
                         int64_t partial_base,
                         cudaStream_t stream)
{
    switch (type) {
        case DType::kFloat32:
            return sumsq_typed<float>(batch, scale, factor, factor_ptr, partials, partial_base, stream);
        case DType::kBFloat16:
            return sumsq_typed<__nv_bfloat16>(batch, scale, factor, factor_ptr, partials, partial_base, stream);
        case DType::kFloat16:
            return sumsq_typed<__half>(batch, scale, factor, factor_ptr, partials, partial_base, stream);
    }
    return cudaErrorInvalidValue;
}

cudaError_t launch_sum_partials(const float* partials, int64_t count, float* out, cudaStream_t stream)
{
    sum_partials_kernel<<<1, kFinishThreads, 0, stream>>>(partials, count, out);
    return cudaGetLastError();
}

}  // namespace ds_grad_ops
