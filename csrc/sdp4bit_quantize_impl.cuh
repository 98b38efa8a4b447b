// Op 1's kernel template, (swizzle) + block Hadamard + group quantization of a float tensor
// (reference.hadamard_quantize). Compiled once per input dtype, each in its own translation unit
// (sdp4bit_quantize_f32.cu / _f16.cu / _bf16.cu), so that the JIT build compiles them in parallel: as one file
// they took ~100 s of nvcc, one dtype ~35 s. sdp4bit_quantize.cu dispatches on the dtype.
#pragma once

#include "sdp4bit_device.cuh"

namespace sdp4bit {
namespace op1 {

using namespace dev;

template <typename T>
struct SrcTensor {  // a float tensor, optionally read through the [rows, cols, seg] -> [cols, rows, seg] swizzle
    const T* x;
    int64_t n;
    int64_t rows, cols, seg;  // rows == 0: no swizzle
    FastDiv div_per_col;      // by rows * seg
    FastDiv div_seg;          // by seg
    bool seg_vec;             // seg % 8 == 0: an 8-element vector never straddles two segments

    __device__ __forceinline__ int64_t src_index(int64_t o) const
    {
        // output order is [cols, rows, seg], input order [rows, cols, seg]
        const int64_t c = div_per_col(o);
        const int64_t rem = o - c * div_per_col.d;
        const int64_t r = div_seg(rem);
        return (r * cols + c) * seg + (rem - r * seg);
    }

    template <bool VEC>
    __device__ __forceinline__ void load(int64_t o, float (&v)[8]) const
    {
        if (rows == 0) {
            load_vals(x, o, n, VEC, true, v);
        } else if (VEC && seg_vec) {
            if (o < n) {
                load_vals(x, src_index(o), n, true, true, v);
            } else {
#pragma unroll
                for (int t = 0; t < kVec; ++t) v[t] = 0.0f;
            }
        } else {
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[t] = (o + t < n) ? to_f(x[src_index(o + t)]) : 0.0f;
        }
    }

    // the wide kernel: 32 elements at output index o (a multiple of 32); wide_ok() guarantees seg % 32 == 0
    // (a lane's run never straddles two segments) and a 16-byte aligned x
    static constexpr bool kHasWide = true;
    // launch bound: 40 resident warps per SM (at most 48 registers, what the compiler picks for op 1 without a
    // bound on blocks; "at least 1 block" of 256 threads let it take 64 and ran 8% slower on an H200, and 48
    // warps spilled)
    static constexpr int kMinWarps = 40;
    bool x_aligned;
    bool wide_ok() const { return x_aligned && (rows == 0 || seg % kWide == 0); }

    // n % 32 == 0 (n is a multiple of the group size), so a lane's run is either all inside or all past n
    __device__ __forceinline__ void load_wide(int64_t o, float (&v)[kWide]) const
    {
        if (o >= n) {
#pragma unroll
            for (int t = 0; t < kWide; ++t) v[t] = 0.0f;
            return;
        }
        const uint4* p = reinterpret_cast<const uint4*>(x + (rows == 0 ? o : src_index(o)));
#pragma unroll
        for (int j = 0; j < kWide / kVec; ++j) {
            float w[kVec];
            if constexpr (sizeof(T) == 4) {
                const uint4 a = __ldg(p + 2 * j), b = __ldg(p + 2 * j + 1);
                w[0] = __uint_as_float(a.x); w[1] = __uint_as_float(a.y);
                w[2] = __uint_as_float(a.z); w[3] = __uint_as_float(a.w);
                w[4] = __uint_as_float(b.x); w[5] = __uint_as_float(b.y);
                w[6] = __uint_as_float(b.z); w[7] = __uint_as_float(b.w);
            } else {
                unpack_words(__ldg(p + j), w, x);
            }
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[j * kVec + t] = w[t];
        }
    }

    __device__ __forceinline__ void finish(int64_t, const float (&)[8], float) const {}
};

template <typename T>
cudaError_t run(const T* x, int64_t n, int hadamard, int64_t rows, int64_t cols, const QuantSpec& q,
                uint8_t* payload, float* scales, cudaStream_t stream)
{
    SrcTensor<T> src;
    src.x = x;
    src.n = n;
    src.rows = rows > 0 ? rows : 0;
    src.cols = rows > 0 ? cols : 0;
    src.seg = rows > 0 ? n / (rows * cols) : 0;
    src.div_per_col.init(rows > 0 ? rows * src.seg : 1);
    src.div_seg.init(rows > 0 ? src.seg : 1);
    src.seg_vec = rows == 0 || src.seg % kVec == 0;
    // the register tiles need vector loads; a swizzle with seg % 8 != 0 goes through the streaming kernel
    src.x_aligned = aligned(x, 16);
    const bool vec = src.x_aligned && src.seg_vec;
    return launch_quant(src, q, n, payload, scales, hadamard, vec, stream);
}

}  // namespace op1
}  // namespace sdp4bit

// One explicit instantiation of op1::run per dtype, in the .cu that names it; every other translation unit
// sees the declaration only.
#define SDP4BIT_OP1_SIGNATURE(T)                                                                   \
    cudaError_t sdp4bit::op1::run<T>(const T*, int64_t, int, int64_t, int64_t, const sdp4bit::QuantSpec&, \
                                     uint8_t*, float*, cudaStream_t)
#define SDP4BIT_OP1_INSTANTIATE(T) template SDP4BIT_OP1_SIGNATURE(T);
extern template SDP4BIT_OP1_SIGNATURE(float);
extern template SDP4BIT_OP1_SIGNATURE(__half);
extern template SDP4BIT_OP1_SIGNATURE(__nv_bfloat16);
