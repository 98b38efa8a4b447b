// Ops 4, 5 and 6: the two halves of qWD (reference.weight_delta_quantize, reference.dequant_add_ and its segmented
// form reference.dequant_add_segments_).
#include "sdp4bit_device.cuh"

namespace sdp4bit {
namespace {

using namespace dev;

template <typename T>
struct SrcWeightDelta {  // master - replica (diff) or master (direct); finish() updates the replica in place
    static constexpr bool kHasWide = false;  // the weights' groups of 2048 take quant_block_kernel
    const float* master;
    T* replica;
    int64_t n;
    int diff;

    template <bool VEC>
    __device__ __forceinline__ void load(int64_t o, float (&v)[8]) const
    {
        load_vals(master, o, n, VEC, true, v);
        if (diff) {
            float r[8];
            load_vals<T>(replica, o, n, VEC, false, r);  // plain loads: this kernel writes the replica
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[t] = __fsub_rn(v[t], r[t]);
        }
    }

    // replica = cast(float(replica) + code * scale) (diff) or cast(code * scale) (direct).  The vector is
    // aligned exactly when the loads were (same pointers), so `vec` follows from the pointers.
    __device__ __forceinline__ void finish(int64_t o, const float (&mk)[8], float scale) const
    {
        if (o >= n) return;
        const bool vec = (reinterpret_cast<uintptr_t>(replica) % 16 == 0) &&
                         (reinterpret_cast<uintptr_t>(master) % 16 == 0);
        float r[8];
        if (diff) {
            // re-read rather than keep the replica in registers: it is still in L1/L2, and keeping it would
            // double the registers of the 2048-element tiles.  Only this thread writes these elements.
            load_vals<T>(replica, o, n, vec, false, r);
        }
#pragma unroll
        for (int t = 0; t < kVec; ++t) {
            const float d = __fmul_rn(code_float(mk[t]), scale);
            r[t] = diff ? __fadd_rn(r[t], d) : d;
        }
        store_vals<T>(replica, o, n, vec, r);
    }
};

template <typename T>
cudaError_t weight_delta(const float* master, T* replica, int64_t n, int diff, const QuantSpec& q, uint8_t* payload,
                         float* scales, cudaStream_t stream)
{
    SrcWeightDelta<T> src;
    src.master = master;
    src.replica = replica;
    src.n = n;
    src.diff = diff;
    const bool vec = aligned(master, 16) && aligned(replica, 16);
    const int64_t n_pad = (n + q.group_size - 1) / q.group_size * q.group_size;
    return launch_quant(src, q, n_pad, payload, scales, 0, vec, stream);
}

// Op 5: elementwise, one vector of 8 per thread, grid-stride.
template <typename T, int BITS>
__global__ void __launch_bounds__(kThreads) dequant_add_kernel(T* __restrict__ replica, int64_t n,
                                                              const uint8_t* __restrict__ payload,
                                                              const float* __restrict__ scales, FastDiv div_group,
                                                              int diff, bool vec)
{
    const int64_t nvec = (n + kVec - 1) / kVec;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t iv = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; iv < nvec; iv += stride) {
        const int64_t o = iv * kVec;
        float c[8];
        load_codes<BITS>(payload, o, vec, c);
        const float s = __ldg(scales + div_group(o));
        float r[8];
        if (diff) load_vals<T>(replica, o, n, vec, false, r);
#pragma unroll
        for (int t = 0; t < kVec; ++t) {
            const float d = __fmul_rn(c[t], s);
            r[t] = diff ? __fadd_rn(r[t], d) : d;
        }
        store_vals<T>(replica, o, n, vec, r);
    }
}

template <typename T>
cudaError_t dequant_add(T* replica, int64_t n, const uint8_t* payload, const float* scales, int bits, int64_t group,
                        int diff, cudaStream_t stream)
{
    if (n == 0) return cudaSuccess;
    const bool vec = aligned(replica, 16) && aligned(payload, bits == 8 ? 8 : 4);
    const int64_t nvec = (n + kVec - 1) / kVec;
    const int64_t blocks = (nvec + kThreads - 1) / kThreads;
    const unsigned int grid = static_cast<unsigned int>(blocks < (1ll << 30) ? blocks : (1ll << 30));
    FastDiv dg;
    dg.init(group);
    if (bits == 8) {
        dequant_add_kernel<T, 8><<<grid, kThreads, 0, stream>>>(replica, n, payload, scales, dg, diff, vec);
    } else {
        dequant_add_kernel<T, 4><<<grid, kThreads, 0, stream>>>(replica, n, payload, scales, dg, diff, vec);
    }
    return cudaGetLastError();
}

// Op 6: op 5 through a tile table.  Block b handles row b of `tiles`, (src_start, dst_start, count): destination
// elements [dst_start, dst_start + count) take source codes from src_start on.  A thread owns vectors of 8
// destination elements on the 8-aligned grid of the buffer; a vector wholly inside the tile whose source index is
// a multiple of 8 takes op 5's vector path (one scale: group_size is a multiple of 8), any other element the
// scalar path with its own code and scale.  Same arithmetic everywhere: RN(code * scale), then RN(dst + that).
template <int BITS>
__device__ __forceinline__ float code_at(const uint8_t* __restrict__ payload, int64_t i)
{
    if constexpr (BITS == 8) {
        return static_cast<float>(static_cast<int8_t>(payload[i]));
    } else {
        const int b = (payload[i >> 1] >> ((i & 1) * 4)) & 0xF;
        return static_cast<float>(b >= 8 ? b - 16 : b);
    }
}

template <typename T, int BITS>
__global__ void __launch_bounds__(kThreads) dequant_add_segments_kernel(T* __restrict__ dst,
                                                                       const uint8_t* __restrict__ payload,
                                                                       const float* __restrict__ scales,
                                                                       const int64_t* __restrict__ tiles,
                                                                       FastDiv div_group, int diff, bool vec_dst,
                                                                       bool vec_codes)
{
    const int64_t* row = tiles + 3 * static_cast<int64_t>(blockIdx.x);
    const int64_t s0 = __ldg(row), d0 = __ldg(row + 1), cnt = __ldg(row + 2);
    const int64_t d_end = d0 + cnt;
    const int64_t shift = s0 - d0;
    for (int64_t d = (d0 & ~static_cast<int64_t>(kVec - 1)) + static_cast<int64_t>(threadIdx.x) * kVec; d < d_end;
         d += static_cast<int64_t>(kThreads) * kVec) {
        const int64_t s = d + shift;
        if (d >= d0 && d + kVec <= d_end && (s & (kVec - 1)) == 0) {
            float c[8];
            load_codes<BITS>(payload, s, vec_codes, c);
            const float sc = __ldg(scales + div_group(s));
            float r[8];
            if (diff) load_vals<T>(dst, d, d_end, vec_dst, false, r);
#pragma unroll
            for (int t = 0; t < kVec; ++t) {
                const float v = __fmul_rn(c[t], sc);
                r[t] = diff ? __fadd_rn(r[t], v) : v;
            }
            store_vals<T>(dst, d, d_end, vec_dst, r);
        } else {
#pragma unroll
            for (int t = 0; t < kVec; ++t) {
                const int64_t e = d + t;
                if (e < d0 || e >= d_end) continue;
                const float v = __fmul_rn(code_at<BITS>(payload, e + shift), __ldg(scales + div_group(e + shift)));
                dst[e] = from_f<T>(diff ? __fadd_rn(to_f(dst[e]), v) : v);
            }
        }
    }
}

template <typename T>
cudaError_t dequant_add_segments(T* dst, const uint8_t* payload, const float* scales, const int64_t* tiles,
                                 int64_t num_tiles, int bits, int64_t group, int diff, cudaStream_t stream)
{
    if (num_tiles == 0) return cudaSuccess;
    if (num_tiles > INT32_MAX) return cudaErrorInvalidValue;
    // vector accesses need the buffers' base addresses aligned (element offsets are checked per vector)
    const bool vec_dst = aligned(dst, 16);
    const bool vec_codes = aligned(payload, bits == 8 ? 8 : 4);
    FastDiv dg;
    dg.init(group);
    const unsigned int grid = static_cast<unsigned int>(num_tiles);
    if (bits == 8) {
        dequant_add_segments_kernel<T, 8><<<grid, kThreads, 0, stream>>>(dst, payload, scales, tiles, dg, diff,
                                                                          vec_dst, vec_codes);
    } else {
        dequant_add_segments_kernel<T, 4><<<grid, kThreads, 0, stream>>>(dst, payload, scales, tiles, dg, diff,
                                                                          vec_dst, vec_codes);
    }
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_weight_delta_quantize(const float* master, void* replica, FloatKind replica_kind, int64_t n,
                                         int diff, const QuantSpec& q, uint8_t* payload, float* scales,
                                         cudaStream_t stream)
{
    switch (replica_kind) {
        case FloatKind::kF32:
            return weight_delta(master, static_cast<float*>(replica), n, diff, q, payload, scales, stream);
        case FloatKind::kF16:
            return weight_delta(master, static_cast<__half*>(replica), n, diff, q, payload, scales, stream);
        case FloatKind::kBF16:
            return weight_delta(master, static_cast<__nv_bfloat16*>(replica), n, diff, q, payload, scales, stream);
    }
    return cudaErrorInvalidValue;
}

cudaError_t launch_dequant_add(void* replica, FloatKind replica_kind, int64_t n, const uint8_t* payload,
                               const float* scales, int bits, int64_t group_size, int diff, cudaStream_t stream)
{
    switch (replica_kind) {
        case FloatKind::kF32:
            return dequant_add(static_cast<float*>(replica), n, payload, scales, bits, group_size, diff, stream);
        case FloatKind::kF16:
            return dequant_add(static_cast<__half*>(replica), n, payload, scales, bits, group_size, diff, stream);
        case FloatKind::kBF16:
            return dequant_add(static_cast<__nv_bfloat16*>(replica), n, payload, scales, bits, group_size, diff,
                               stream);
    }
    return cudaErrorInvalidValue;
}

cudaError_t launch_dequant_add_segments(void* dst, FloatKind dst_kind, const uint8_t* payload, const float* scales,
                                        const int64_t* tiles, int64_t num_tiles, int bits, int64_t group_size,
                                        int diff, cudaStream_t stream)
{
    switch (dst_kind) {
        case FloatKind::kF32:
            return dequant_add_segments(static_cast<float*>(dst), payload, scales, tiles, num_tiles, bits, group_size,
                                        diff, stream);
        case FloatKind::kF16:
            return dequant_add_segments(static_cast<__half*>(dst), payload, scales, tiles, num_tiles, bits, group_size,
                                        diff, stream);
        case FloatKind::kBF16:
            return dequant_add_segments(static_cast<__nv_bfloat16*>(dst), payload, scales, tiles, num_tiles, bits,
                                        group_size, diff, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace sdp4bit
