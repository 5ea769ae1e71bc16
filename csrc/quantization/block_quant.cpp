// SPDX-License-Identifier: Apache-2.0
//
// Block quantization of rows on the host, for ZeRO++'s quantized transports (qwZ, qgZ): the native version of
// deepspeed/runtime/zero/gradients/block_quant.py, computing the same bits in one threaded pass per row block instead of a
// chain of torch operations.
//
// A row of ``numel`` values is cut into blocks of ``block`` values (the last padded with zeros); each block gets
//   scale = max|x| / qmax                 (qmax = 2^(bits-1) - 1, float32 division)
//   q     = clamp(nearbyint(x / s), -qmax, qmax)  (s = scale, or 1 where scale is 0; round half to even)
// and a packed row is the codes (one byte each for 8 bits; two per byte for 4 bits, the even element in the low
// nibble) followed by the float32 scales. Dequantization writes float(q) * scale, rounded once to the output's
// dtype (float32 or bfloat16, round to nearest even, as torch casts).
//
// As in csrc/adam, the caller (Python) checks dtypes, sizes and contiguity and passes raw addresses, so the file
// needs no torch headers; a rejected argument is reported by returning its message (empty on success).

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace py = pybind11;

namespace {

enum Kind : int { kFloat32 = 0, kBFloat16 = 1 };

inline float load(const void* base, int kind, int64_t i)
{
    if (kind == kBFloat16) {
        uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof(value));
        return value;
    }
    return static_cast<const float*>(base)[i];
}

inline void store(void* base, int kind, int64_t i, float value)
{
    if (kind == kBFloat16) {
        uint32_t bits;
        std::memcpy(&bits, &value, sizeof(bits));
        uint16_t out;
        if (std::isnan(value)) {
            out = 0x7FC0;
        } else {
            bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
            out = static_cast<uint16_t>(bits >> 16);
        }
        static_cast<uint16_t*>(base)[i] = out;
        return;
    }
    static_cast<float*>(base)[i] = value;
}

std::string check(int bits, int64_t block, int kind)
{
    if (bits != 4 && bits != 8) return "block_quant: bits must be 4 or 8";
    if (block < 2 || block % 2) return "block_quant: the block size must be even";
    if (kind != kFloat32 && kind != kBFloat16) return "block_quant: values must be float32 or bfloat16";
    return "";
}

}  // namespace

// ``x``: rows x numel values (row stride ``x_stride`` elements); ``out``: rows x row_bytes bytes.
std::string quantize_rows(uintptr_t x, int kind, int64_t x_stride, uintptr_t out, int64_t rows, int64_t numel,
                          int bits, int64_t block)
{
    std::string error = check(bits, block, kind);
    if (!error.empty()) return error;
    const int64_t blocks = std::max<int64_t>(1, (numel + block - 1) / block);
    const int64_t payload = blocks * block * bits / 8;
    const int64_t row_bytes = payload + 4 * blocks;
    const float top = static_cast<float>((1 << (bits - 1)) - 1);
    const void* src = reinterpret_cast<const void*>(x);
    uint8_t* dst = reinterpret_cast<uint8_t*>(out);
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < rows * blocks; ++task) {
        const int64_t r = task / blocks, b = task % blocks;
        const int64_t begin = b * block, end = std::min(numel, begin + block);
        const int64_t base = r * x_stride;
        float amax = 0.0f;
        for (int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(load(src, kind, base + i)));
        const float scale = amax / top;
        const float safe = scale > 0.0f ? scale : 1.0f;
        uint8_t* row = dst + r * row_bytes;
        std::memcpy(row + payload + 4 * b, &scale, sizeof(float));
        if (bits == 8) {
            int8_t* codes = reinterpret_cast<int8_t*>(row) + begin;
            for (int64_t i = begin; i < begin + block; ++i) {
                const float v = i < end ? load(src, kind, base + i) : 0.0f;
                codes[i - begin] = static_cast<int8_t>(std::min(top, std::max(-top, std::nearbyint(v / safe))));
            }
        } else {
            uint8_t* codes = row + begin / 2;
            for (int64_t i = begin; i < begin + block; i += 2) {
                const float v0 = i < end ? load(src, kind, base + i) : 0.0f;
                const float v1 = i + 1 < end ? load(src, kind, base + i + 1) : 0.0f;
                const int q0 = static_cast<int>(std::min(top, std::max(-top, std::nearbyint(v0 / safe))));
                const int q1 = static_cast<int>(std::min(top, std::max(-top, std::nearbyint(v1 / safe))));
                codes[(i - begin) / 2] = static_cast<uint8_t>((q0 & 0xF) | ((q1 & 0xF) << 4));
            }
        }
    }
    return "";
}

// ``packed``: rows x row_bytes bytes; ``out``: rows x numel values (row stride ``out_stride`` elements).
std::string dequantize_rows(uintptr_t packed, uintptr_t out, int kind, int64_t out_stride, int64_t rows,
                            int64_t numel, int bits, int64_t block)
{
    std::string error = check(bits, block, kind);
    if (!error.empty()) return error;
    const int64_t blocks = std::max<int64_t>(1, (numel + block - 1) / block);
    const int64_t payload = blocks * block * bits / 8;
    const int64_t row_bytes = payload + 4 * blocks;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(packed);
    void* dst = reinterpret_cast<void*>(out);
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < rows * blocks; ++task) {
        const int64_t r = task / blocks, b = task % blocks;
        const int64_t begin = b * block, end = std::min(numel, begin + block);
        const uint8_t* row = src + r * row_bytes;
        float scale;
        std::memcpy(&scale, row + payload + 4 * b, sizeof(float));
        const int64_t base = r * out_stride;
        for (int64_t i = begin; i < end; ++i) {
            int q;
            if (bits == 8) {
                q = reinterpret_cast<const int8_t*>(row)[i];
            } else {
                const uint8_t byte = row[i / 2];
                q = (i % 2) ? (byte >> 4) : (byte & 0xF);
                if (q >= 8) q -= 16;
            }
            store(dst, kind, base + i, static_cast<float>(q) * scale);
        }
    }
    return "";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "Symmetric block quantization of rows (ZeRO++ qwZ / qgZ) on the host";
    m.def("quantize_rows",
          &quantize_rows,
          "Pack rows into codes and float32 block scales; returns an error message, empty on success",
          py::arg("x"),
          py::arg("kind"),
          py::arg("x_stride"),
          py::arg("out"),
          py::arg("rows"),
          py::arg("numel"),
          py::arg("bits"),
          py::arg("block"));
    m.def("dequantize_rows",
          &dequantize_rows,
          "Unpack rows into float32 or bfloat16 values; returns an error message, empty on success",
          py::arg("packed"),
          py::arg("out"),
          py::arg("kind"),
          py::arg("out_stride"),
          py::arg("rows"),
          py::arg("numel"),
          py::arg("bits"),
          py::arg("block"));
}
