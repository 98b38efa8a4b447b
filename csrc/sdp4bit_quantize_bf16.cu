// Op 1's kernels for __nv_bfloat16 input (see sdp4bit_quantize_impl.cuh).
#include "sdp4bit_quantize_impl.cuh"

SDP4BIT_OP1_INSTANTIATE(__nv_bfloat16)
