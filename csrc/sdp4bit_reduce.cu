// Ops 2 and 3: dequantize k received chunks, sum them in chunk order in fp32, then either requantize
// (reference.dequant_sum_requant) or inverse-Hadamard, scale and cast (reference.dequant_sum_inverse_hadamard).
#include "sdp4bit_device.cuh"

namespace sdp4bit {
namespace {

using namespace dev;

template <int BITS>
struct SrcDequantSum {
    const uint8_t* payloads;
    const float* scales;
    int64_t row_bytes;       // payload bytes per chunk
    int64_t scales_per_row;  // groups per chunk
    int64_t m;               // elements per chunk (a multiple of 8)
    FastDiv div_group;       // by the input group size
    int k;

    // acc = c_0 * s_0; acc = fma(c_1, s_1, acc); ... (reference.dequant_sum: one rounded multiply for the
    // first chunk, one fused multiply-add for each other).  Elements at and past m (output padding) are zeros.
    template <bool VEC>
    __device__ __forceinline__ void load(int64_t o, float (&v)[8]) const
    {
        if (o >= m) {
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[t] = 0.0f;
            return;
        }
        const int64_t g = div_group(o);
        {
            float c[8];
            load_codes<BITS>(payloads, o, VEC, c);
            const float s = __ldg(scales + g);
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[t] = __fmul_rn(c[t], s);
        }
#pragma unroll 4
        for (int j = 1; j < k; ++j) {
            float c[8];
            load_codes<BITS>(payloads + j * row_bytes, o, VEC, c);
            const float s = __ldg(scales + j * scales_per_row + g);
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[t] = __fmaf_rn(c[t], s, v[t]);
        }
    }

    // The wide kernels: 32 elements at o (a multiple of 32) share one scale per chunk, and every row's codes
    // are 16-byte aligned.
    static constexpr bool kHasWide = true;
    bool rows_aligned;  // payloads 16-byte aligned
    bool wide_ok() const
    {
        return rows_aligned && m % kWide == 0 && (row_bytes % 16) == 0 && div_group.d % kWide == 0;
    }

    // The lane's 32 sums at o (zeros at and past m).  kMinWarps: at most 64 registers (32 resident warps per
    // SM, from 80 registers and 24 warps) ran ops 2 and 3 5-13% faster on an H200 for k = 1..8.
    // (Loading the first 2 or 4 chunks ahead of decoding them, with chunks past k predicated off, ran slower:
    // 96 registers, or spills at 64.)
    static constexpr int kMinWarps = 32;
    __device__ __forceinline__ void load_wide(int64_t o, float (&v)[kWide]) const
    {
        if (o >= m) {
#pragma unroll
            for (int t = 0; t < kWide; ++t) v[t] = 0.0f;
            return;
        }
        const int64_t g = div_group(o);
        {
            uint4 d[BITS / 4];
            load_code_words<BITS>(payloads, o, d);
            float c[kWide];
            decode_codes32<BITS>(d, c);
            const float s = __ldg(scales + g);
#pragma unroll
            for (int t = 0; t < kWide; ++t) v[t] = __fmul_rn(c[t], s);  // acc = d_0 (keeps -0.0)
        }
#pragma unroll 2
        for (int j = 1; j < k; ++j) {
            uint4 d[BITS / 4];
            load_code_words<BITS>(payloads + j * row_bytes, o, d);
            float c[kWide];
            decode_codes32<BITS>(d, c);
            const float s = __ldg(scales + j * scales_per_row + g);
#pragma unroll
            for (int t = 0; t < kWide; ++t) v[t] = __fmaf_rn(c[t], s, v[t]);
        }
    }

    __device__ __forceinline__ void finish(int64_t, const float (&)[8], float) const {}
};

template <int BITS>
SrcDequantSum<BITS> make_sum(const uint8_t* payloads, const float* scales, int k, int64_t m, int64_t group)
{
    SrcDequantSum<BITS> s;
    s.payloads = payloads;
    s.scales = scales;
    s.row_bytes = m * BITS / 8;
    s.scales_per_row = m / group;
    s.m = m;
    s.div_group.init(group);
    s.k = k;
    s.rows_aligned = aligned(payloads, 16);
    return s;
}

// Op 3: a warp owns kSumSteps steps; sum, inverse butterfly, one fp32 multiply, cast.
constexpr int kSumSteps = 4;

template <int BITS, typename TO, bool HAD>
__global__ void __launch_bounds__(kThreads) dequant_sum_ih_kernel(SrcDequantSum<BITS> src, TO* __restrict__ out,
                                                                 int hadamard, float factor, bool vec_in,
                                                                 bool vec_out, int64_t num_tiles)
{
    const int lane = threadIdx.x & (kWarp - 1);
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x / kWarp);
    if (tile >= num_tiles) return;
    const int64_t base = tile * (static_cast<int64_t>(kStep) * kSumSteps) + lane * kVec;
    float v[kSumSteps][kVec];
    if (vec_in) {
#pragma unroll
        for (int s = 0; s < kSumSteps; ++s) src.template load<true>(base + s * kStep, v[s]);
    } else {
#pragma unroll
        for (int s = 0; s < kSumSteps; ++s) src.template load<false>(base + s * kStep, v[s]);
    }
#pragma unroll
    for (int s = 0; s < kSumSteps; ++s) {
        if constexpr (HAD) hadamard_step(v[s], hadamard, lane);
#pragma unroll
        for (int t = 0; t < kVec; ++t) v[s][t] = __fmul_rn(v[s][t], factor);
        const int64_t o = base + s * kStep;
        if (o < src.m) store_vals<TO>(out, o, src.m, vec_out, v[s]);
    }
}

// Op 3 on the wide layout (32 elements per lane, blocks of kWideThreads, see quant_wide_kernel); only when
// src.wide_ok() and the output is 16-byte aligned.
template <int BITS, typename TO, bool HAD>
__global__ void __launch_bounds__(kWideThreads, kMinBlocksFor<SrcDequantSum<BITS>::kMinWarps, kWideThreads>)
    dequant_sum_ih_wide_kernel(SrcDequantSum<BITS> src, TO* __restrict__ out, int hadamard, float factor,
                               int64_t num_warps)
{
    __shared__ uint4 stage[kWideWarpsPerBlock][2 * sizeof(TO) * kWarp];  // a warp tile of TO
    const int lane = threadIdx.x & (kWarp - 1);
    const int wib = threadIdx.x / kWarp;
    const int64_t w = static_cast<int64_t>(blockIdx.x) * kWideWarpsPerBlock + wib;
    if (w >= num_warps) return;
    const int64_t tile0 = w * kWideStep;
    float v[kWide];
    src.load_wide(tile0 + lane * kWide, v);
    if constexpr (HAD) hadamard_wide(v, hadamard, lane);
#pragma unroll
    for (int t = 0; t < kWide; ++t) v[t] = __fmul_rn(v[t], factor);
    uint4 d[sizeof(TO) * 2];
    floats_to_words<TO>(v, d);
    constexpr int kPer = 16 / sizeof(TO);
    uint4* base = reinterpret_cast<uint4*>(out + tile0);
    const int64_t valid_chunks = (src.m - tile0) / kPer;  // m % 32 == 0: whole chunks
    warp_store_staged<kWide * sizeof(TO)>(
        stage[wib], lane, [&](int c) { return base + c; }, [&](int c) { return c < valid_chunks; }, d);
}

template <int BITS>
cudaError_t requant(const uint8_t* payloads, const float* in_scales, int k, int64_t m, int64_t in_group,
                    const QuantSpec& q, uint8_t* payload, float* scales, cudaStream_t stream)
{
    const auto src = make_sum<BITS>(payloads, in_scales, k, m, in_group);
    const int64_t n_pad = (m + q.group_size - 1) / q.group_size * q.group_size;
    // rows start at multiples of 8 (bits=8) or 4 (bits=4) bytes because m % 8 == 0
    const bool vec = aligned(payloads, BITS == 8 ? 8 : 4);
    return launch_quant(src, q, n_pad, payload, scales, 0, vec, stream);
}

template <int BITS, typename TO>
cudaError_t inverse(const uint8_t* payloads, const float* in_scales, int k, int64_t m, int64_t group, int hadamard,
                    float factor, TO* out, cudaStream_t stream)
{
    if (m == 0) return cudaSuccess;
    const auto src = make_sum<BITS>(payloads, in_scales, k, m, group);
    if (src.wide_ok() && aligned(out, 16) && (hadamard <= 1 || hadamard >= kWide)) {  // blocks of 8, 16: below
        const int64_t nw = (m + kWideStep - 1) / kWideStep;
        if (hadamard > 1) {
            dequant_sum_ih_wide_kernel<BITS, TO, true>
                <<<blocks_for(nw, kWideWarpsPerBlock), kWideThreads, 0, stream>>>(src, out, hadamard, factor, nw);
        } else {
            dequant_sum_ih_wide_kernel<BITS, TO, false>
                <<<blocks_for(nw, kWideWarpsPerBlock), kWideThreads, 0, stream>>>(src, out, hadamard, factor, nw);
        }
        return cudaGetLastError();
    }
    const int64_t nt = (m + static_cast<int64_t>(kStep) * kSumSteps - 1) / (kStep * kSumSteps);
    const bool vin = aligned(payloads, BITS == 8 ? 8 : 4);
    const bool vout = aligned(out, 16);
    if (hadamard > 1) {
        dequant_sum_ih_kernel<BITS, TO, true>
            <<<blocks_for(nt), kThreads, 0, stream>>>(src, out, hadamard, factor, vin, vout, nt);
    } else {
        dequant_sum_ih_kernel<BITS, TO, false>
            <<<blocks_for(nt), kThreads, 0, stream>>>(src, out, hadamard, factor, vin, vout, nt);
    }
    return cudaGetLastError();
}

template <int BITS>
cudaError_t inverse_any(const uint8_t* payloads, const float* in_scales, int k, int64_t m, int64_t group,
                        int hadamard, float factor, void* out, FloatKind out_kind, cudaStream_t stream)
{
    switch (out_kind) {
        case FloatKind::kF32:
            return inverse<BITS>(payloads, in_scales, k, m, group, hadamard, factor, static_cast<float*>(out), stream);
        case FloatKind::kF16:
            return inverse<BITS>(payloads, in_scales, k, m, group, hadamard, factor, static_cast<__half*>(out), stream);
        case FloatKind::kBF16:
            return inverse<BITS>(payloads, in_scales, k, m, group, hadamard, factor,
                                 static_cast<__nv_bfloat16*>(out), stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_dequant_sum_requant(const uint8_t* payloads, const float* in_scales, int k, int64_t m,
                                       int in_bits, int64_t in_group, const QuantSpec& q, uint8_t* payload,
                                       float* scales, cudaStream_t stream)
{
    return in_bits == 8 ? requant<8>(payloads, in_scales, k, m, in_group, q, payload, scales, stream)
                        : requant<4>(payloads, in_scales, k, m, in_group, q, payload, scales, stream);
}

cudaError_t launch_dequant_sum_inverse_hadamard(const uint8_t* payloads, const float* in_scales, int k,
                                                int64_t m, int bits, int64_t group_size, int hadamard_size,
                                                float factor, void* out, FloatKind out_kind,
                                                cudaStream_t stream)
{
    return bits == 8 ? inverse_any<8>(payloads, in_scales, k, m, group_size, hadamard_size, factor, out, out_kind,
                                      stream)
                     : inverse_any<4>(payloads, in_scales, k, m, group_size, hadamard_size, factor, out, out_kind,
                                      stream);
}

}  // namespace sdp4bit
