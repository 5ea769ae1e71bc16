// SPDX-License-Identifier: Apache-2.0
//
// The interface between the bindings (grad_ops.cpp, which sees torch) and the kernels (grad_ops_kernels.cu,
// which sees only CUDA): every pass is a batch of segments, each a pair of flat arrays, launched as one grid.
//
// A segment writes dst[0, dst_len) from src[0, src_len) (src_len <= dst_len). The positions past src_len are
// padding: zeroed when overwriting, left alone when accumulating. A segment with no source (src null,
// src_len 0) only zeroes. The batch is passed by value as the kernel's parameter block, so a launch needs no
// host-to-device copy of its metadata; it must stay under the 4 KiB that every CUDA version accepts.

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ds_grad_ops {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct Segment {
    void* dst;
    const void* src;
    int64_t dst_len;
    int64_t src_len;
};

// 96 segments (3072 bytes) and their block offsets (388 bytes) keep the parameter block under 4 KiB.
constexpr int kMaxSegments = 96;

// Each block of a launch handles kBlockElems consecutive elements of one segment.
constexpr int kThreads = 256;
constexpr int kVec = 8;     // elements per vector access (16 bytes of bf16/fp16, 32 of fp32)
constexpr int kUnroll = 2;  // vector accesses in flight per thread
constexpr int64_t kBlockElems = static_cast<int64_t>(kThreads) * kVec * kUnroll;

struct SegmentBatch {
    Segment seg[kMaxSegments];
    // block_end[i]: one past the last block of segment i, counted from the launch's first block.
    int32_t block_end[kMaxSegments];
    int32_t count;
};

inline int64_t blocks_for(int64_t elems) { return (elems + kBlockElems - 1) / kBlockElems; }

// dst = (accumulate ? dst : 0) + factor * src, in float32, rounded once to dst's type. ``factor_ptr`` (a device
// float, or null for ``factor``) lets a factor computed on the device be used without a host sync.
cudaError_t launch_axpy(const SegmentBatch& batch,
                        DType dst_type,
                        DType src_type,
                        bool accumulate,
                        float factor,
                        const float* factor_ptr,
                        cudaStream_t stream);

// Squares summed per block into partials[partial_base + block] (float32). With ``scale`` each element is first
// multiplied in place by the factor (rounded to its type), and the squares are those of the stored values.
// Segments read and write ``dst`` (``src`` is ignored).
cudaError_t launch_sumsq(const SegmentBatch& batch,
                         DType type,
                         bool scale,
                         float factor,
                         const float* factor_ptr,
                         float* partials,
                         int64_t partial_base,
                         cudaStream_t stream);

// out[0] = the sum of partials[0, count), summed in double in a fixed order (the result does not depend on
// the launch), rounded to float32.
cudaError_t launch_sum_partials(const float* partials, int64_t count, float* out, cudaStream_t stream);

}  // namespace ds_grad_ops
