// Device code shared by the SDP4Bit kernels (included by sdp4bit_quantize_impl.cuh, whose op 1 compiles once
// per input dtype in sdp4bit_quantize_{f32,f16,bf16}.cu, and by sdp4bit_reduce.cu and sdp4bit_weights.cu; each
// compiles on its own so that a build compiles them in parallel).
//
// Layout: a lane owns kVec = 8 contiguous elements (one 16-byte load of bf16/fp16, two of fp32), a warp
// step covers 256 contiguous elements.  A Hadamard block of up to 256 elements lives in one warp step: its
// strides 1, 2, 4 are inside a lane and 8..128 are lane shuffles, in the reference's stage order, so every
// intermediate is the same fp32 value as in torch.
//
// The wide kernels (ops 1-3 with power-of-two groups of 32..1024 elements, the gradient path) give a lane
// kWide = 32 contiguous elements instead: a Hadamard block of 32 is then entirely in registers (no shuffles),
// a group of 128 spans 4 lanes (2 shuffles per 32 elements for its maximum), and codes leave in 16-byte stores.
//
// Exactness (deepspeed_sdp4bit/reference.py is the definition):
// * rounding-sensitive arithmetic uses explicitly rounded intrinsics (__fadd_rn, __fmul_rn, __fmaf_rn, ...),
//   which nvcc never contracts or approximates, whatever the build flags;
// * y = x * RN(1/scale): one __frcp_rn per group (IEEE, the reference's 1 / scale) and one __fmul_rn per
//   element; scale = absmax / qmax is IEEE-correctly rounded: RN(absmax * RN(1/qmax)) followed by two FMA
//   residual corrections (exact by Markstein's theorem while absmax is well inside the normal range),
//   __fdiv_rn otherwise;
// * stochastic rounding: one counter hash per pair of elements, 16 bits each (bits 7..22 of the hash and of
//   its 16-bit rotation), put under the exponent of 1.0 by one AND-OR as u1 in (1, 2);
//   floor(RN(y + u1)) - 1 is RD(RN(y + u1) + (1.5*2^23 - 1));
// * integers and floats convert through the "magic" constant 1.5*2^23 (exact for |v| < 2^22) instead of
//   I2F/F2I/FRND, which run at a quarter of the FP32 rate: floor(t) is the low mantissa bits of
//   RD(t + 1.5*2^23), and a code c is the float 1.5*2^23 + c, whose low byte/nibble is c's two's complement;
// * group maxima compare |x| as unsigned bit patterns (or with max.NaN on sm_80+): exact, and NaN propagates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "sdp4bit_kernels.cuh"

namespace sdp4bit {
namespace dev {

constexpr int kVec = 8;                          // elements per lane per step
constexpr int kWide = 32;                        // elements per lane in the wide kernels
constexpr int kWarp = 32;
constexpr int kWideStep = kWide * kWarp;         // elements per warp in the wide kernels
constexpr int kStep = kVec * kWarp;              // elements per warp step
constexpr int kThreads = 256;                    // threads per block
constexpr int kWarpsPerBlock = kThreads / kWarp;
// The wide kernels' blocks (ops 1-3 on the gradient path): 2 warps, except where a group spans warps (a block
// then holds whole groups: kThreads).  A warp owns 1024 elements there and needs microseconds for them, so small
// blocks give the grid a finer-grained tail: on an H200, 64-thread blocks ran ops 1-3 1-2 points of copy
// bandwidth faster than 256-thread ones at 64-512 MiB (benchmarks/results/tiles/ at a66b8a4).
constexpr int kWideThreads = 64;
constexpr int kWideWarpsPerBlock = kWideThreads / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kMagic = 12582912.0f;            // 1.5 * 2^23
constexpr uint32_t kMagicBits = 0x4B400000u;     // bits of kMagic

// ------------------------------------------------------------------------------------------------------
// scalar helpers
// ------------------------------------------------------------------------------------------------------

// floor(x / d) for a divisor fixed at launch: a 32x32-bit high multiply, an add and a shift (Granlund-Montgomery
// with the 33-bit trick) instead of the ~20-instruction division routine, for 0 <= x < 2^32; 64-bit division
// above that.  init() runs on the host.
struct FastDiv {
    int64_t d;
    uint32_t mul;
    uint32_t shift;
    bool small;  // d < 2^32: the multiply path applies

    void init(int64_t divisor)
    {
        d = divisor > 0 ? divisor : 1;
        small = d < (1ll << 32);
        shift = 0;
        mul = 0;
        if (small) {
            while ((1ull << shift) < static_cast<uint64_t>(d)) ++shift;
            mul = static_cast<uint32_t>((((1ull << 32) * ((1ull << shift) - static_cast<uint64_t>(d))) /
                                         static_cast<uint64_t>(d)) + 1);
        }
    }

    __device__ __forceinline__ int64_t operator()(int64_t x) const
    {
        if (small && static_cast<uint64_t>(x) < (1ull << 32)) {
            const uint32_t x32 = static_cast<uint32_t>(x);
            const uint64_t t = static_cast<uint64_t>(__umulhi(x32, mul)) + x32;
            return static_cast<int64_t>(t >> shift);
        }
        return x / d;
    }
};

// reference.mix32 ('lowbias32'): uint32 arithmetic wraps exactly like the reference's masked int64 math.
__device__ __forceinline__ uint32_t mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// u1 of the even / odd counter of a pair with hash h: bits 7..22 of h, or of h rotated by 16 bits (a byte
// permute), under the exponent of 1.0 with the half-step 2^-17 set.
// `one` holds kU1Bits; passing it at run time (QuantOut::u1_bits) lets it sit in a register, which makes
// the AND-OR one LOP3 (a LOP3 takes a single immediate, so two constants would cost two).
constexpr uint32_t kU1Bits = 0x3F800040u;
__device__ __forceinline__ float u1_even(uint32_t h, uint32_t one = kU1Bits)
{
    return __uint_as_float((h & 0x7fff80u) | one);
}
__device__ __forceinline__ float u1_odd(uint32_t h, uint32_t one = kU1Bits)
{
    return u1_even(__byte_perm(h, 0u, 0x1032u), one);
}

// reference.stochastic_uniforms for the N counters c0 .. c0+N-1 (ODD: c0 is odd): u1 in (1, 2), exact.
// Pair j of the run is pair index p0 + j; an even counter takes the low 16 bits of its pair's hash, an odd one
// the high 16 bits.
template <int N, bool ODD>
__device__ __forceinline__ void uniforms1(uint32_t key, int64_t c0, float (&u)[N])
{
    constexpr int NP = N / 2 + (ODD ? 1 : 0);  // pairs touched
    const int64_t p0 = c0 >> 1;                // arithmetic shift, like the reference
    const uint32_t lo0 = static_cast<uint32_t>(static_cast<uint64_t>(p0));
    const uint32_t hi0 = static_cast<uint32_t>(static_cast<uint64_t>(p0 >> 32));
    uint32_t h[NP];
    if (hi0 == 0 && lo0 <= 0xffffffffu - NP) {  // the common case: pair indices below 2^32, no carry
        // mix32's first step on (lo ^ key) is lo ^ (lo >> 16) ^ (key ^ (key >> 16)): one shift and one 3-way xor
        const uint32_t kk = key ^ (key >> 16);
#pragma unroll
        for (int j = 0; j < NP; ++j) {
            const uint32_t lo = lo0 + j;
            uint32_t x = lo ^ (lo >> 16) ^ kk;
            x *= 0x7feb352du;
            x ^= x >> 15;
            x *= 0x846ca68bu;
            h[j] = x ^ (x >> 16);
        }
    } else {
#pragma unroll
        for (int j = 0; j < NP; ++j) {
            const uint32_t lo = lo0 + j;
            const uint32_t hi = hi0 + (lo < lo0 ? 1u : 0u);  // the high word of p0 + j
            uint32_t x = mix32(lo ^ key);
            if (hi != 0) x = mix32(x ^ hi);
            h[j] = x;
        }
    }
#pragma unroll
    for (int t = 0; t < N; ++t) {
        const int j = ODD ? (t + 1) >> 1 : t >> 1;
        const bool odd_counter = ODD ? ((t & 1) == 0) : ((t & 1) == 1);
        u[t] = odd_counter ? u1_odd(h[j]) : u1_even(h[j]);
    }
}

// reference.stochastic_uniforms for 2*NP counters c0 .. c0+2*NP-1 where c0 is a non-negative multiple of 2*NP
// (NP a power of two <= 2^16) and the pair indices stay below 2^32 (the launcher checks offset and size).
// Then the pair indices lo0 + j = lo0 | j share their high 16 bits, and mix32's first xor-shift of
// (lo ^ key) is d ^ j with d computed once: one hash costs 7 instructions, not 9.
template <int NP>
__device__ __forceinline__ void uniforms1_aligned(uint32_t key, uint32_t one, int64_t c0, float (&u)[2 * NP])
{
    const uint32_t lo0 = static_cast<uint32_t>(c0 >> 1);
    const uint32_t d = lo0 ^ (lo0 >> 16) ^ key ^ (key >> 16);
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        uint32_t x = d ^ static_cast<uint32_t>(j);
        x *= 0x7feb352du;
        x ^= x >> 15;
        x *= 0x846ca68bu;
        x ^= x >> 16;
        u[2 * j] = u1_even(x, one);
        u[2 * j + 1] = u1_odd(x, one);
    }
}

template <int N>
__device__ __forceinline__ void uniforms1_any(uint32_t key, int64_t c0, float (&u)[N])
{
    if (c0 & 1) {
        uniforms1<N, true>(key, c0, u);
    } else {
        uniforms1<N, false>(key, c0, u);
    }
}

// ---- codes <-> floats through the magic constant ----
// Code c (|c| <= 127) -> kMagic + c.  `code_float` undoes it exactly.
__device__ __forceinline__ float code_float(float magic_code) { return __fsub_rn(magic_code, kMagic); }

// reference.round_codes for a valid group: y = x * r is finite and |y| <= qmax.  STOCH: u1 in (1, 2).
template <bool STOCH>
__device__ __forceinline__ float round_to_magic(float y, float u1)
{
    // |y| <= qmax (group_q fits the reciprocal), so the codes land in [-qmax, qmax] without a clamp
    if constexpr (STOCH) {
        // floor(RN(y + u1)) - 1
        return __fadd_rd(__fadd_rn(y, u1), kMagic - 1.0f);
    } else {
        // sign(y) * floor(RN(|y| + 0.5))
        const float m = __fadd_rd(__fadd_rn(fabsf(y), 0.5f), kMagic);
        return __fadd_rn(copysignf(__fsub_rn(m, kMagic), y), kMagic);
    }
}

// ---- code words: the payload as 32-bit words (4 int8 codes, or 8 int4 codes with element 2i in the low
// nibble of byte i), to and from codes given as floats ----
// Decoding flips the sign bit of each field (c + 128 / c + 8, unsigned), puts it under the 2^23 exponent with a
// byte permute and subtracts: no integer-to-float conversion instruction.  Encoding takes the low byte of each
// magic float (kMagic + c: the code's two's complement) with byte permutes.

// c[0..4) = the 4 int8 codes of w
__device__ __forceinline__ void decode_bytes(uint32_t w, float* c)
{
    const uint32_t x = w ^ 0x80808080u;
#pragma unroll
    for (int t = 0; t < 4; ++t) c[t] = __fsub_rn(__uint_as_float(__byte_perm(x, 0x4Bu, 0x4550u | t)), 8388736.0f);
}

// c[0..8) = the 8 int4 codes of w
__device__ __forceinline__ void decode_nibbles(uint32_t w, float* c)
{
    const uint32_t x = w ^ 0x88888888u;
    const uint32_t ev = x & 0x0f0f0f0fu;  // elements 0, 2, 4, 6 (low nibbles), one per byte
    const uint32_t od = (x >> 4) & 0x0f0f0f0fu;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        c[2 * t] = __fsub_rn(__uint_as_float(__byte_perm(ev, 0x4Bu, 0x4550u | t)), 8388616.0f);
        c[2 * t + 1] = __fsub_rn(__uint_as_float(__byte_perm(od, 0x4Bu, 0x4550u | t)), 8388616.0f);
    }
}

// the low bytes of 4 words, in order, as one word
__device__ __forceinline__ uint32_t low_bytes(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3)
{
    return __byte_perm(__byte_perm(b0, b1, 0x0040u), __byte_perm(b2, b3, 0x0040u), 0x5410u);
}

// the word of 4 int8 codes mk[0..4) (magic floats)
__device__ __forceinline__ uint32_t encode_bytes(const float* mk)
{
    return low_bytes(__float_as_uint(mk[0]), __float_as_uint(mk[1]), __float_as_uint(mk[2]), __float_as_uint(mk[3]));
}

// the word of 8 int4 codes mk[0..8): the even elements' bytes keep their low nibbles, the odd elements' bytes
// shifted by 4 give the high nibbles (one bit-select)
__device__ __forceinline__ uint32_t encode_nibbles(const float* mk)
{
    const uint32_t ev = low_bytes(__float_as_uint(mk[0]), __float_as_uint(mk[2]), __float_as_uint(mk[4]),
                                  __float_as_uint(mk[6]));
    const uint32_t od = low_bytes(__float_as_uint(mk[1]), __float_as_uint(mk[3]), __float_as_uint(mk[5]),
                                  __float_as_uint(mk[7]));
    return (ev & 0x0f0f0f0fu) | ((od << 4) & 0xf0f0f0f0u);
}

// 8 payload codes of element o (o a multiple of 8) as floats.
template <int BITS>
__device__ __forceinline__ void load_codes(const uint8_t* __restrict__ payload, int64_t o, bool vec, float (&c)[8])
{
    if constexpr (BITS == 8) {
        uint32_t lo, hi;
        if (vec) {
            const uint2 w = __ldg(reinterpret_cast<const uint2*>(payload + o));
            lo = w.x;
            hi = w.y;
        } else {
            lo = hi = 0;
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                lo |= static_cast<uint32_t>(payload[o + t]) << (8 * t);
                hi |= static_cast<uint32_t>(payload[o + 4 + t]) << (8 * t);
            }
        }
        decode_bytes(lo, c);
        decode_bytes(hi, c + 4);
    } else {
        uint32_t w;
        const uint8_t* b = payload + o / 2;
        if (vec) {
            w = __ldg(reinterpret_cast<const unsigned int*>(b));
        } else {
            w = static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[1]) << 8) |
                (static_cast<uint32_t>(b[2]) << 16) | (static_cast<uint32_t>(b[3]) << 24);
        }
        decode_nibbles(w, c);
    }
}

// Store 8 codes given as magic floats.
template <int BITS>
__device__ __forceinline__ void store_codes(uint8_t* __restrict__ payload, int64_t o, bool vec, const float (&mk)[8])
{
    if constexpr (BITS == 8) {
        const uint32_t lo = encode_bytes(mk), hi = encode_bytes(mk + 4);
        if (vec) {
            *reinterpret_cast<uint2*>(payload + o) = make_uint2(lo, hi);
        } else {
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                payload[o + t] = static_cast<uint8_t>(lo >> (8 * t));
                payload[o + 4 + t] = static_cast<uint8_t>(hi >> (8 * t));
            }
        }
    } else {
        const uint32_t w = encode_nibbles(mk);
        uint8_t* p = payload + o / 2;
        if (vec) {
            *reinterpret_cast<uint32_t*>(p) = w;
        } else {
#pragma unroll
            for (int t = 0; t < 4; ++t) p[t] = static_cast<uint8_t>(w >> (8 * t));
        }
    }
}

// ---- float vectors of 8 elements ----
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ uint4 ld16(const void* p, bool nc)
{
    const uint4* q = reinterpret_cast<const uint4*>(p);
    return nc ? __ldg(q) : *q;
}

__device__ __forceinline__ void unpack_words(uint4 w, float (&v)[8], const __nv_bfloat16*)
{
    const uint32_t a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // bf16 -> fp32 is a 16-bit shift (element 2k is the low half)
        v[2 * k] = __uint_as_float(a[k] << 16);
        v[2 * k + 1] = __uint_as_float(a[k] & 0xffff0000u);
    }
}

__device__ __forceinline__ void unpack_words(uint4 w, float (&v)[8], const __half*)
{
    const uint32_t a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&a[k]));
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
    }
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, const __nv_bfloat16*)
{
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // round to nearest even, lo in the low half
    return *reinterpret_cast<const uint32_t*>(&p);
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, const __half*)
{
    const __half2 p = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
}

// v = p[i .. i+8) as fp32, zeros at and beyond `limit`.  VEC: p + i is 16-byte aligned whenever i is a
// multiple of 8 (checked on the host) and i + 8 <= limit is checked here.  nc: read-only during the kernel.
template <typename T>
__device__ __forceinline__ void load_vals(const T* __restrict__ p, int64_t i, int64_t limit, bool vec, bool nc,
                                          float (&v)[8])
{
    if (vec && i + kVec <= limit) {
        if constexpr (sizeof(T) == 4) {
            const uint4 a = ld16(p + i, nc);
            const uint4 b = ld16(p + i + 4, nc);
            v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y);
            v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
            v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y);
            v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
        } else {
            unpack_words(ld16(p + i, nc), v, p);
        }
    } else {
#pragma unroll
        for (int t = 0; t < kVec; ++t) v[t] = (i + t < limit) ? to_f(p[i + t]) : 0.0f;
    }
}

// p[i .. min(i+8, limit)) = cast(v) with round-to-nearest-even (torch's .to(dtype)).
template <typename T>
__device__ __forceinline__ void store_vals(T* __restrict__ p, int64_t i, int64_t limit, bool vec, const float (&v)[8])
{
    if (vec && i + kVec <= limit) {
        uint4* q = reinterpret_cast<uint4*>(p + i);
        if constexpr (sizeof(T) == 4) {
            q[0] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                              __float_as_uint(v[3]));
            q[1] = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
                              __float_as_uint(v[7]));
        } else {
            const T* tag = nullptr;
            q[0] = make_uint4(pack2(v[0], v[1], tag), pack2(v[2], v[3], tag), pack2(v[4], v[5], tag),
                              pack2(v[6], v[7], tag));
        }
    } else {
#pragma unroll
        for (int t = 0; t < kVec; ++t) {
            if (i + t < limit) p[i + t] = from_f<T>(v[t]);
        }
    }
}

// The butterfly stages inside a lane: strides 1, 2, .., N/2 over the lane's N contiguous values (straight-line
// code).
template <int N>
__device__ __forceinline__ void in_lane_stages(float (&v)[N])
{
#pragma unroll
    for (int s = 1; s < N; s <<= 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if ((i & s) == 0) {
                const float a = v[i], b = v[i + s];
                v[i] = __fadd_rn(a, b);
                v[i + s] = __fsub_rn(a, b);
            }
        }
    }
}

// The butterfly stages that pair lanes: for m = 1, 2, .. < `lanes`, lane `lane` combines its N values with
// those of lane ^ m.  The lower lane holds a and gets a + b, the upper holds b and gets a - b; p + (+-1)*v is
// one rounding of an exact product, so it is bit-identical to p + v and p - v.
template <int N>
__device__ __forceinline__ void lane_stages(float (&v)[N], int lanes, int lane)
{
    for (int m = 1; m < lanes; m <<= 1) {
        const float sgn = (lane & m) ? -1.0f : 1.0f;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const float p = __shfl_xor_sync(kFullMask, v[i], m);
            v[i] = __fmaf_rn(v[i], sgn, p);
        }
    }
}

// Block Hadamard butterfly of size h (power of two, 8..256) over a warp step: lane `lane` holds elements
// 8*lane .. 8*lane+7.  Stages in the reference's order (stride 1, 2, ..., h/2); every lane of the warp must
// call it (shuffles), lanes past the data holding zeros, which stay in their own blocks.  Sizes 2 and 4 are
// refused by the binding: they would need the in-lane stages to be conditional, which costs every size.
__device__ __forceinline__ void hadamard_step(float (&v)[8], int h, int lane)
{
    in_lane_stages(v);
    lane_stages(v, h >> 3, lane);  // stride 8*m: the partner lane differs in bit m
}

// ------------------------------------------------------------------------------------------------------
// group quantization
// ------------------------------------------------------------------------------------------------------
struct QuantOut {
    uint8_t* payload;
    float* scales;
    int64_t group;
    int64_t n_pad;  // quantized elements (a multiple of group)
    float qmax;
    float rq;       // RN(1 / qmax)
    int group_shift;  // log2(group) when group is a power of two (the register tiles), else -1
    uint32_t key;
    uint32_t u1_bits;  // kU1Bits, as a run-time value (see u1_even)
    int64_t offset;
    bool vec;  // payload aligned for 8-byte (bits=8) / 4-byte (bits=4) stores
};

// RN(a / b) given r = RN(1/b): RN(a*r) and two FMA residual corrections (the sequence of CUDA's div.rn fast
// path; exact by Markstein's theorem while every intermediate is a normal number, see group_q).
__device__ __forceinline__ float div_fast(float a, float b, float r)
{
    const float q0 = __fmul_rn(a, r);
    const float e0 = __fmaf_rn(-q0, b, a);  // exact residual
    const float q1 = __fmaf_rn(e0, r, q0);
    const float e1 = __fmaf_rn(-q1, b, a);
    return __fmaf_rn(e1, r, q1);
}

struct GroupQ {
    float scale;
    float r;     // RN(1 / scale): y = RN(x * r)
    bool valid;  // scale > 0 and finite and 1/scale finite: codes are computed (else they are 0)
};

__device__ __forceinline__ GroupQ group_q(uint32_t absmax_bits, float qmax, float rq)
{
    GroupQ g;
    const float absmax = __uint_as_float(absmax_bits);
    // scale = absmax / qmax, IEEE: the reciprocal path while absmax is a normal number well above 2^-126
    g.scale = (absmax >= 0x1p-90f && absmax <= 3.402823466e38f) ? div_fast(absmax, qmax, rq)
                                                                  : __fdiv_rn(absmax, qmax);
    g.r = __frcp_rn(g.scale);  // IEEE: inf for 0 and for scales below 2^-127, NaN for NaN
    g.valid = g.scale > 0.0f && g.scale <= 3.402823466e38f && g.r <= 3.402823466e38f;
    // reference.fit_reciprocal: r lowered an ulp at a time (at most twice) until absmax * r <= qmax, so that
    // |x * r| <= qmax for the whole group and rounding needs no clamp
    if (g.valid) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (__fmul_rn(absmax, g.r) > qmax) g.r = __uint_as_float(__float_as_uint(g.r) - 1u);
        }
    }
    return g;
}

// Codes of N elements of one group (as magic floats), counters offset + o .. offset + o + N - 1.
template <int N, bool STOCH>
__device__ __forceinline__ void codes_of(const QuantOut& q, int64_t o, const float (&v)[N], const GroupQ& g,
                                         float (&mk)[N])
{
    if (!g.valid) {
#pragma unroll
        for (int t = 0; t < N; ++t) mk[t] = kMagic;  // code 0
        return;
    }
    float u[N];
    if constexpr (STOCH) {
        uniforms1_any<N>(q.key, q.offset + o, u);
    } else {
#pragma unroll
        for (int t = 0; t < N; ++t) u[t] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < N; ++t) mk[t] = round_to_magic<STOCH>(__fmul_rn(v[t], g.r), u[t]);
}

template <int BITS, bool STOCH, class Src>
__device__ __forceinline__ void quantize_vector(const Src& src, const QuantOut& q, int64_t o, const float (&v)[8],
                                                const GroupQ& g)
{
    float mk[8];
    codes_of<8, STOCH>(q, o, v, g, mk);
    store_codes<BITS>(q.payload, o, q.vec, mk);
    src.finish(o, mk, g.scale);
}

__device__ __forceinline__ uint32_t abs_bits_max(uint32_t m, float x)
{
    return max(m, __float_as_uint(x) & 0x7fffffffu);
}

// Register-resident tiles: a warp owns S steps (S*256 elements), all loaded before any arithmetic so that
// S independent loads per lane are in flight.  SPG = steps per group: 1 when group_size divides 256
// (group_size/8 lanes per group, reduced by a partial butterfly of shuffles), else group_size = 256*SPG.
// launch_quant_t uses SPG = 1 only (larger groups go to quant_block_kernel), so group_size is a power of
// two here and the scale index is a shift (q.group_shift).
// Only launched when every pointer is aligned for vector access.
// HAD: a Hadamard transform is applied (compile-time, so the butterfly is straight-line code).
template <class Src, int BITS, bool STOCH, int S, int SPG, bool HAD>
__global__ void __launch_bounds__(kThreads) quant_tiles_kernel(Src src, QuantOut q, int hadamard, int64_t num_tiles)
{
    static_assert(S % SPG == 0, "a tile holds whole groups");
    const int lane = threadIdx.x & (kWarp - 1);
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x / kWarp);
    if (tile >= num_tiles) return;  // uniform per warp: shuffles below see full warps
    const int64_t base = tile * (static_cast<int64_t>(kStep) * S) + lane * kVec;

    float v[S][kVec];
#pragma unroll
    for (int s = 0; s < S; ++s) src.template load<true>(base + s * kStep, v[s]);
    if constexpr (HAD) {
#pragma unroll
        for (int s = 0; s < S; ++s) hadamard_step(v[s], hadamard, lane);
    }

    const int lanes_per_group = (SPG == 1) ? static_cast<int>(q.group / kVec) : kWarp;
#pragma unroll
    for (int g = 0; g < S / SPG; ++g) {
        uint32_t m = 0;
#pragma unroll
        for (int s = g * SPG; s < (g + 1) * SPG; ++s) {
#pragma unroll
            for (int t = 0; t < kVec; ++t) m = abs_bits_max(m, v[s][t]);
        }
#pragma unroll
        for (int off = kWarp / 2; off >= 1; off >>= 1) {
            if (off < lanes_per_group) m = max(m, __shfl_xor_sync(kFullMask, m, off));
        }
        const GroupQ gq = group_q(m, q.qmax, q.rq);
#pragma unroll
        for (int s = g * SPG; s < (g + 1) * SPG; ++s) {
            const int64_t o = base + s * kStep;
            if (o < q.n_pad) quantize_vector<BITS, STOCH>(src, q, o, v[s], gq);
        }
        const int64_t o0 = base + g * SPG * kStep;
        if ((lane & (lanes_per_group - 1)) == 0 && o0 < q.n_pad) q.scales[o0 >> q.group_shift] = gq.scale;
    }
}

// Group sizes 512..8192 that are multiples of 256 (the weights' 2048): one block of group_size/8 threads per
// group, one vector per thread, the maximum reduced through shared memory.  Few registers per thread keep the
// SM full of warps (keeping a 2048-element group in one warp's registers needs ~150 registers per lane).
// Only launched when every pointer is aligned for vector access.
template <class Src, int BITS, bool STOCH>
__global__ void __launch_bounds__(1024) quant_block_kernel(Src src, QuantOut q, int hadamard)
{
    __shared__ uint32_t warp_max[32];
    const int lane = threadIdx.x & (kWarp - 1);
    const int64_t grp = blockIdx.x;
    const int64_t o = grp * q.group + threadIdx.x * kVec;
    float v[8];
    src.template load<true>(o, v);
    if (hadamard > 1) hadamard_step(v, hadamard, lane);  // warps cover aligned 256-element steps
    uint32_t m = 0;
#pragma unroll
    for (int t = 0; t < kVec; ++t) m = abs_bits_max(m, v[t]);
    m = __reduce_max_sync(kFullMask, m);
    if (lane == 0) warp_max[threadIdx.x / kWarp] = m;
    __syncthreads();
    const int nwarps = blockDim.x / kWarp;
    for (int w = 0; w < nwarps; ++w) m = max(m, warp_max[w]);
    const GroupQ gq = group_q(m, q.qmax, q.rq);
    quantize_vector<BITS, STOCH>(src, q, o, v, gq);
    if (threadIdx.x == 0) q.scales[grp] = gq.scale;
}

// Any group size (a multiple of 8) and unaligned pointers: one warp per group, two passes over it (maximum,
// then codes); the second pass mostly hits L2.
template <class Src, int BITS, bool STOCH>
__global__ void __launch_bounds__(kThreads) quant_groups_stream_kernel(Src src, QuantOut q, int hadamard,
                                                                      int64_t num_groups, bool vec)
{
    const int lane = threadIdx.x & (kWarp - 1);
    const int64_t grp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x / kWarp);
    if (grp >= num_groups) return;
    const int64_t start = grp * q.group;
    const int64_t steps = (q.group + kStep - 1) / kStep;

    auto load = [&](int64_t in_group, float (&v)[8]) {
        if (in_group < q.group) {
            if (vec) {
                src.template load<true>(start + in_group, v);
            } else {
                src.template load<false>(start + in_group, v);
            }
        } else {
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[t] = 0.0f;
        }
        if (hadamard > 1) hadamard_step(v, hadamard, lane);  // a partial step holds whole blocks
    };

    uint32_t m = 0;
    for (int64_t st = 0; st < steps; ++st) {
        float v[8];
        load(st * kStep + lane * kVec, v);
#pragma unroll
        for (int t = 0; t < kVec; ++t) m = abs_bits_max(m, v[t]);
    }
    m = __reduce_max_sync(kFullMask, m);
    const GroupQ gq = group_q(m, q.qmax, q.rq);

    for (int64_t st = 0; st < steps; ++st) {
        const int64_t in_group = st * kStep + lane * kVec;
        float v[8];
        load(in_group, v);
        if (in_group < q.group) quantize_vector<BITS, STOCH>(src, q, start + in_group, v, gq);
    }
    if (lane == 0) q.scales[grp] = gq.scale;
}

// ------------------------------------------------------------------------------------------------------
// wide lanes: 32 contiguous elements per lane (ops 1-3 on the gradient path)
// ------------------------------------------------------------------------------------------------------

// Staging through shared memory.  A lane owning 32 contiguous elements accesses global memory with a stride
// of 32 elements between lanes: for loads the L1 absorbs it (a lane's 16-byte loads share 32-byte sectors), but
// stores of 64..128 bytes per lane (the float outputs of op 3) write half sectors scattered over 8..32 lines
// per instruction and ran at a third of the copy bandwidth.  Those go through a per-warp shared buffer and
// leave in fully coalesced 16-byte stores (chunk c of the tile by lane c % 32).  Chunk indices are
// XOR-swizzled within 128-byte rows so that both access patterns are free of bank conflicts.

__device__ __forceinline__ int swz(int c) { return c ^ ((c >> 3) & 7); }

// Coalesced store of a warp tile of 32*LB bytes: lane `lane` gives its LB bytes (chunks lane*LB/16 ..); chunk
// c of the tile goes to addr(c) when valid(c).
template <int LB, class Addr, class Valid>
__device__ __forceinline__ void warp_store_staged(uint4* sm, int lane, Addr addr, Valid valid,
                                                  const uint4 (&d)[LB / 16])
{
    constexpr int R = LB / 16;
#pragma unroll
    for (int i = 0; i < R; ++i) sm[swz(lane * R + i)] = d[i];
    __syncwarp();
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int c = r * kWarp + lane;
        if (valid(c)) *addr(c) = sm[swz(c)];
    }
    __syncwarp();
}

// 32 codes (a lane's payload words: 8 for bits=8, 4 for bits=4) as floats.
template <int BITS>
__device__ __forceinline__ void decode_codes32(const uint4 (&d)[BITS / 4], float (&c)[kWide])
{
    constexpr int kPer = 32 / BITS;  // codes per word
#pragma unroll
    for (int i = 0; i < BITS; ++i) {
        const uint4& q = d[i / 4];
        const uint32_t w = (i & 3) == 0 ? q.x : (i & 3) == 1 ? q.y : (i & 3) == 2 ? q.z : q.w;
        if constexpr (BITS == 8) {
            decode_bytes(w, c + kPer * i);
        } else {
            decode_nibbles(w, c + kPer * i);
        }
    }
}

// Store lane's 32 codes (magic floats) at element o (a multiple of 32; the payload is 16-byte aligned).
// Direct 16-byte stores: 32 (bits=8) or 16 (bits=4) contiguous bytes per lane.
template <int BITS>
__device__ __forceinline__ void store_codes32(uint8_t* __restrict__ payload, int64_t o, const float (&mk)[kWide])
{
    constexpr int kPer = 32 / BITS;
    uint32_t w[BITS];  // 8 words (bits=8) or 4 words (bits=4)
#pragma unroll
    for (int i = 0; i < BITS; ++i) w[i] = BITS == 8 ? encode_bytes(mk + kPer * i) : encode_nibbles(mk + kPer * i);
    uint4* p = reinterpret_cast<uint4*>(payload + o * BITS / 8);
#pragma unroll
    for (int i = 0; i < BITS / 4; ++i) p[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
}

// Zero codes for the lane's 32 elements at o (a group whose scale is not usable).
template <int BITS>
__device__ __forceinline__ void store_zero_codes32(uint8_t* __restrict__ payload, int64_t o)
{
    uint4* p = reinterpret_cast<uint4*>(payload + o * BITS / 8);
#pragma unroll
    for (int i = 0; i < BITS / 4; ++i) p[i] = make_uint4(0u, 0u, 0u, 0u);
}

// Lane's 32 codes at element o of a payload whose rows are 16-byte aligned, as words.
template <int BITS>
__device__ __forceinline__ void load_code_words(const uint8_t* __restrict__ payload, int64_t o, uint4 (&d)[BITS / 4])
{
    const uint4* p = reinterpret_cast<const uint4*>(payload + o * BITS / 8);
#pragma unroll
    for (int i = 0; i < BITS / 4; ++i) d[i] = __ldg(p + i);
}

// Lane's 32 floats as 16-byte words of type T (fp32: 8 words, bf16/fp16: 4 words), round to nearest even.
template <typename T>
__device__ __forceinline__ void floats_to_words(const float (&v)[kWide], uint4 (&d)[sizeof(T) * 2])
{
#pragma unroll
    for (int j = 0; j < kWide / kVec; ++j) {
        const float* f = v + j * kVec;
        if constexpr (sizeof(T) == 4) {
            d[2 * j] = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                                  __float_as_uint(f[3]));
            d[2 * j + 1] = make_uint4(__float_as_uint(f[4]), __float_as_uint(f[5]), __float_as_uint(f[6]),
                                      __float_as_uint(f[7]));
        } else {
            const T* tag = nullptr;
            d[j] = make_uint4(pack2(f[0], f[1], tag), pack2(f[2], f[3], tag), pack2(f[4], f[5], tag),
                              pack2(f[6], f[7], tag));
        }
    }
}

// Block Hadamard of size h (power of two, 32..1024) where lane `lane` holds elements 32*lane .. 32*lane+31 of
// a 1024-element warp chunk: strides 1..16 inside the lane (straight-line code: a conditional stage would make
// the compiler copy registers at every merge), 32.. as lane shuffles (partner lane xor m), in the reference's
// stage order.  Every lane of the warp must call it.  Blocks of 8 and 16 take the 8-element-per-lane kernels.
__device__ __forceinline__ void hadamard_wide(float (&v)[kWide], int h, int lane)
{
    in_lane_stages(v);
    lane_stages(v, h >> 5, lane);
}

// max(m, |x|) that returns NaN when either is NaN (m >= 0 or NaN).
__device__ __forceinline__ float absmax_nan(float m, float x)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(x)));
    return r;
#else
    return __uint_as_float(max(__float_as_uint(m), __float_as_uint(x) & 0x7fffffffu));
#endif
}

// Ops 1 and 2 on the wide layout: one warp per 1024 elements, one lane per 32, groups of 32..8192 elements
// (a power of two: group_shift 5..13).  A group of up to 1024 spans 1..32 lanes of one warp (shuffles); with
// MULTI (groups of 2048..8192) it spans 2..8 warps of the block, whose maxima meet in shared memory (a block of
// kWarpsPerBlock = 8 warps holds whole groups).  Src provides load_wide(o, v): the 32 elements at o (zeros at
// and past its end).  Only launched when every pointer is 16-byte aligned (checked on the host).
// ALIGNED (stochastic rounding only): the counters offset + o are non-negative multiples of 32 with pair
// indices below 2^32, so the uniforms take uniforms1_aligned.  The codes are computed and stored inside the
// valid-group branch (an invalid group stores zero words): had the branches merged into one store, the
// compiler would pre-fill all 32 code registers for the rare invalid case.
// Blocks of kWideThreads, or kThreads with MULTI.  The launch bound keeps Src's resident warps per SM (its
// register cap), except for the general counter hash (stochastic, not ALIGNED: rare offsets and groups across
// warps), whose extra registers would spill under it.
template <bool MULTI>
constexpr int kWideThreadsFor = MULTI ? kThreads : kWideThreads;
// Launch-bound blocks per SM that keep WARPS warps resident with blocks of THREADS threads (a Src's kMinWarps:
// its register cap, whatever the block size).
template <int WARPS, int THREADS>
constexpr int kMinBlocksFor = WARPS * kWarp / THREADS;

template <class Src, int BITS, bool STOCH, bool HAD, bool ALIGNED, bool MULTI>
__global__ void __launch_bounds__(kWideThreadsFor<MULTI>,
                                  (STOCH && !ALIGNED) ? 1 : kMinBlocksFor<Src::kMinWarps, kWideThreadsFor<MULTI>>)
    quant_wide_kernel(Src src, QuantOut q, int hadamard, int64_t num_warps)
{
    constexpr int kWarps = kWideThreadsFor<MULTI> / kWarp;
    const int lane = threadIdx.x & (kWarp - 1);
    const int warp = threadIdx.x / kWarp;
    const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
    // uniform per warp: shuffles below see full warps (MULTI keeps every warp for the block barrier; warps past
    // the end load zeros and store nothing)
    if (!MULTI && w >= num_warps) return;
    const int64_t o = w * kWideStep + lane * kWide;
    float v[kWide];
    src.load_wide(o, v);
    if constexpr (HAD) hadamard_wide(v, hadamard, lane);
    float m = 0.0f;
#pragma unroll
    for (int t = 0; t < kWide; ++t) m = absmax_nan(m, v[t]);
    const int lanes_per_group = MULTI ? kWarp : 1 << (q.group_shift - 5);
#pragma unroll
    for (int off = 1; off < kWarp; off <<= 1) {
        if (off < lanes_per_group) m = absmax_nan(m, __shfl_xor_sync(kFullMask, m, off));
    }
    if constexpr (MULTI) {
        __shared__ float warp_max[kWarps];
        if (lane == 0) warp_max[warp] = m;
        __syncthreads();
        const int warps_per_group = 1 << (q.group_shift - 10);
        const int first = warp & ~(warps_per_group - 1);
        m = warp_max[first];
        for (int i = 1; i < warps_per_group; ++i) m = absmax_nan(m, warp_max[first + i]);
    }
    if (o >= q.n_pad) return;  // whole groups: the lanes of a group agree
    const GroupQ g = group_q(__float_as_uint(m), q.qmax, q.rq);
    if (g.valid) {
        float u[kWide];
        if constexpr (STOCH && ALIGNED) {
            uniforms1_aligned<kWide / 2>(q.key, q.u1_bits, q.offset + o, u);
        } else if constexpr (STOCH) {
            uniforms1_any<kWide>(q.key, q.offset + o, u);
        } else {
#pragma unroll
            for (int t = 0; t < kWide; ++t) u[t] = 0.0f;
        }
        float mk[kWide];
#pragma unroll
        for (int t = 0; t < kWide; ++t) mk[t] = round_to_magic<STOCH>(__fmul_rn(v[t], g.r), u[t]);
        store_codes32<BITS>(q.payload, o, mk);
    } else {
        store_zero_codes32<BITS>(q.payload, o);
    }
    if ((o & ((int64_t{1} << q.group_shift) - 1)) == 0) q.scales[o >> q.group_shift] = g.scale;  // group's first lane
}

// ------------------------------------------------------------------------------------------------------
// host side
// ------------------------------------------------------------------------------------------------------
inline bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

inline unsigned int blocks_for(int64_t warps, int warps_per_block = kWarpsPerBlock)
{
    return static_cast<unsigned int>((warps + warps_per_block - 1) / warps_per_block);
}

inline QuantOut make_out(const QuantSpec& q, int64_t n_pad, uint8_t* payload, float* scales)
{
    QuantOut o;
    o.payload = payload;
    o.scales = scales;
    o.group = q.group_size;
    o.n_pad = n_pad;
    o.qmax = static_cast<float>((1 << (q.bits - 1)) - 1);
    o.rq = 1.0f / o.qmax;  // host IEEE division: RN(1/qmax)
    o.group_shift = -1;
    for (int b = 0; b < 62; ++b) {
        if ((1ll << b) == q.group_size) o.group_shift = b;
    }
    o.key = q.key;
    o.u1_bits = kU1Bits;
    o.offset = q.offset;
    o.vec = aligned(payload, q.bits == 8 ? 8 : 4);
    return o;
}

template <class Src, int BITS, bool STOCH, bool HAD>
void launch_quant_wide(const Src& src, const QuantOut& q, int hadamard, cudaStream_t stream)
{
    const int64_t nw = (q.n_pad + kWideStep - 1) / kWideStep;
    // counters offset .. offset + n_pad - 1: multiples of 32 per lane, pair indices (counter >> 1) < 2^32
    const bool aligned_counters = q.offset >= 0 && q.offset % kWide == 0 && q.offset + q.n_pad <= (1ll << 33);
    const unsigned int blocks = blocks_for(nw, kWideWarpsPerBlock);  // (MULTI: blocks of kWarpsPerBlock warps)
    if (q.group_shift > 10) {  // groups across warps: rare in the gradient path, counters taken generally
        quant_wide_kernel<Src, BITS, STOCH, HAD, false, true>
            <<<blocks_for(nw), kWideThreadsFor<true>, 0, stream>>>(src, q, hadamard, nw);
    } else if (STOCH && aligned_counters) {  // (ALIGNED = STOCH: no separate nearest-rounding instance)
        quant_wide_kernel<Src, BITS, STOCH, HAD, STOCH, false>
            <<<blocks, kWideThreadsFor<false>, 0, stream>>>(src, q, hadamard, nw);
    } else {
        quant_wide_kernel<Src, BITS, STOCH, HAD, false, false>
            <<<blocks, kWideThreadsFor<false>, 0, stream>>>(src, q, hadamard, nw);
    }
}

// Kernel by group size: the wide kernels where Src has them (power-of-two groups of 32..8192), else register
// tiles for divisors of 256, a block per group for multiples of 256 up to 8192, the streaming kernel for
// everything else and whenever a pointer is misaligned.
template <class Src, int BITS, bool STOCH>
cudaError_t launch_quant_t(const Src& src, const QuantOut& q, int hadamard, bool vec, cudaStream_t stream)
{
    const int64_t g = q.group;
    if constexpr (Src::kHasWide) {
        // 32 elements per lane: power-of-two groups of 32..8192, no Hadamard or blocks of 32..1024 (one warp),
        // 16-byte aligned payload, Src's own conditions
        if (src.wide_ok() && q.group_shift >= 5 && q.group_shift <= 13 && aligned(q.payload, 16) &&
            (hadamard <= 1 || (hadamard >= kWide && hadamard <= g && hadamard <= kWideStep))) {
            if (hadamard > 1) {
                launch_quant_wide<Src, BITS, STOCH, true>(src, q, hadamard, stream);
            } else {
                launch_quant_wide<Src, BITS, STOCH, false>(src, q, hadamard, stream);
            }
            return cudaGetLastError();
        }
    }
    if (vec && q.vec && g <= kStep && kStep % g == 0) {
        const int64_t nt = (q.n_pad + static_cast<int64_t>(kStep) * 4 - 1) / (kStep * 4);
        if (hadamard > 1) {
            quant_tiles_kernel<Src, BITS, STOCH, 4, 1, true>
                <<<blocks_for(nt), kThreads, 0, stream>>>(src, q, hadamard, nt);
        } else {
            quant_tiles_kernel<Src, BITS, STOCH, 4, 1, false>
                <<<blocks_for(nt), kThreads, 0, stream>>>(src, q, hadamard, nt);
        }
    } else if (vec && q.vec && g % kStep == 0 && g <= 1024 * kVec && q.n_pad / g < (1ll << 31)) {
        quant_block_kernel<Src, BITS, STOCH>
            <<<static_cast<unsigned int>(q.n_pad / g), static_cast<unsigned int>(g / kVec), 0, stream>>>(src, q,
                                                                                                   hadamard);
    } else {
        const int64_t ng = q.n_pad / g;
        quant_groups_stream_kernel<Src, BITS, STOCH>
            <<<blocks_for(ng), kThreads, 0, stream>>>(src, q, hadamard, ng, vec);
    }
    return cudaGetLastError();
}

template <class Src>
cudaError_t launch_quant(const Src& src, const QuantSpec& spec, int64_t n_pad, uint8_t* payload, float* scales,
                         int hadamard, bool vec, cudaStream_t stream)
{
    if (n_pad == 0) return cudaSuccess;
    const QuantOut q = make_out(spec, n_pad, payload, scales);
    if (spec.bits == 8) {
        return spec.stochastic ? launch_quant_t<Src, 8, true>(src, q, hadamard, vec, stream)
                               : launch_quant_t<Src, 8, false>(src, q, hadamard, vec, stream);
    }
    return spec.stochastic ? launch_quant_t<Src, 4, true>(src, q, hadamard, vec, stream)
                           : launch_quant_t<Src, 4, false>(src, q, hadamard, vec, stream);
}

}  // namespace dev
}  // namespace sdp4bit
