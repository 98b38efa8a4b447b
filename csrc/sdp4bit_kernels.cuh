// Launchers of the SDP4Bit CUDA kernels: plain C++ types only (no torch), so that the kernels compile with
// nvcc and the CUDA headers alone, and the torch binding (sdp4bit_bindings.cpp) is ordinary host C++.
//
// Every launcher checks nothing: the binding validates devices, dtypes, sizes and alignment first.  Each
// returns the error of its launch (cudaGetLastError), never synchronizes, and allocates nothing.
// The exact arithmetic of every op is defined by deepspeed_sdp4bit/reference.py.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace sdp4bit {

// Floating dtypes the kernels read and write (the binding maps torch dtypes to these).
enum class FloatKind : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// How groups are quantized and where codes and scales go.
struct QuantSpec {
    int bits;            // 4 or 8
    int64_t group_size;  // elements per scale, a positive multiple of 8
    int stochastic;      // 0: round half away from zero, 1: floor(y + u1) - 1 with the counter hash
    uint32_t key;        // stream key of stochastic rounding (reference.make_key)
    int64_t offset;      // counter of element 0 (stochastic rounding)
};

// Op 1.  x [n] (n a multiple of group_size and, when swizzle_rows > 0, of rows*cols) read as [rows, cols, seg]
// and quantized in [cols, rows, seg] order; hadamard_size 0 = none, else a power of two in 2..256 dividing
// group_size.  payload [n*bits/8], scales [n/group_size].
cudaError_t launch_hadamard_quantize(const void* x, FloatKind x_kind, int64_t n, int hadamard_size,
                                     int64_t swizzle_rows, int64_t swizzle_cols, const QuantSpec& q,
                                     uint8_t* payload, float* scales, cudaStream_t stream);

// Op 2.  payloads [k, m*in_bits/8] (rows contiguous), in_scales [k, m/in_group]; the fp32 sum of the k
// dequantized chunks is requantized with q (q.group_size may differ from in_group).  The output covers m
// rounded up to a multiple of q.group_size, the padding being zeros: payload [n_pad*q.bits/8], scales
// [n_pad/q.group_size].
cudaError_t launch_dequant_sum_requant(const uint8_t* payloads, const float* in_scales, int k, int64_t m,
                                       int in_bits, int64_t in_group, const QuantSpec& q, uint8_t* payload,
                                       float* scales, cudaStream_t stream);

// Op 3.  out[i] = cast(butterfly(sum)[i] * factor) for i < m (hadamard_size 0: no butterfly); factor is the
// fp32 value the reference computes in double (post_scale / hadamard_size).
cudaError_t launch_dequant_sum_inverse_hadamard(const uint8_t* payloads, const float* in_scales, int k,
                                                int64_t m, int bits, int64_t group_size, int hadamard_size,
                                                float factor, void* out, FloatKind out_kind,
                                                cudaStream_t stream);

// Op 4.  master fp32 [n], replica [n] (updated in place); diff != 0: quantize master - replica and add the
// dequantized delta to the replica, else quantize master and overwrite the replica with it.  payload
// [n_pad*bits/8], scales [n_pad/group_size], n_pad = n rounded up to a multiple of group_size.
cudaError_t launch_weight_delta_quantize(const float* master, void* replica, FloatKind replica_kind, int64_t n,
                                         int diff, const QuantSpec& q, uint8_t* payload, float* scales,
                                         cudaStream_t stream);

// Op 5.  replica [n] += dequantize(payload, scales) in place (diff == 0: replica = dequantized values).
// payload holds at least n codes, scales one per group_size codes.
cudaError_t launch_dequant_add(void* replica, FloatKind replica_kind, int64_t n, const uint8_t* payload,
                               const float* scales, int bits, int64_t group_size, int diff,
                               cudaStream_t stream);

// Op 6.  Op 5 through a tile table: tiles [num_tiles, 3] int64 rows (src_start, dst_start, count), for j < count
// dst[dst_start + j] = cast(float(dst[dst_start + j]) + code[src_start + j] * scale[(src_start + j) / group_size])
// (diff == 0: cast(code * scale)).  Rows must not overlap in dst; the binding checks the bounds the plan recorded.
cudaError_t launch_dequant_add_segments(void* dst, FloatKind dst_kind, const uint8_t* payload, const float* scales,
                                        const int64_t* tiles, int64_t num_tiles, int bits, int64_t group_size,
                                        int diff, cudaStream_t stream);

}  // namespace sdp4bit
