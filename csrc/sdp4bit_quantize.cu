// Op 1: (swizzle) + block Hadamard + group quantization of a float tensor (reference.hadamard_quantize): the
// dtype dispatch. The kernel template is in sdp4bit_quantize_impl.cuh, instantiated per dtype in
// sdp4bit_quantize_{f32,f16,bf16}.cu.
#include "sdp4bit_quantize_impl.cuh"

namespace sdp4bit {

cudaError_t launch_hadamard_quantize(const void* x, FloatKind x_kind, int64_t n, int hadamard_size,
                                     int64_t swizzle_rows, int64_t swizzle_cols, const QuantSpec& q,
                                     uint8_t* payload, float* scales, cudaStream_t stream)
{
    switch (x_kind) {
        case FloatKind::kF32:
            return op1::run(static_cast<const float*>(x), n, hadamard_size, swizzle_rows, swizzle_cols, q, payload,
                            scales, stream);
        case FloatKind::kF16:
            return op1::run(static_cast<const __half*>(x), n, hadamard_size, swizzle_rows, swizzle_cols, q, payload,
                            scales, stream);
        case FloatKind::kBF16:
            return op1::run(static_cast<const __nv_bfloat16*>(x), n, hadamard_size, swizzle_rows, swizzle_cols, q,
                            payload, scales, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace sdp4bit
