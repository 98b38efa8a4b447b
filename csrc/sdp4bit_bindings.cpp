// torch binding of the SDP4Bit kernels (sdp4bit_quantize*.cu, sdp4bit_reduce.cu, sdp4bit_weights.cu).
//
// Every function validates all of its tensors (device, dtype, contiguity, sizes) and the group/Hadamard
// constraints before launching, then launches on the current CUDA stream of the tensors' device under a
// device guard.  Outputs are passed in by the caller (the Python wrapper allocates them when the user gives
// none), so nothing here allocates and nothing synchronizes with the host.
//
// Errors are *returned* as a message ("" = launched) and the Python wrapper raises them, and messages are
// built here with std::string alone.  On the GPU image this was built for (torch 2.11+cu130, g++ from
// /opt/gcc), formatting a message the usual way (TORCH_CHECK, or c10's string builder streaming a c10::Device
// into an ostringstream) crashed the interpreter with a segmentation fault instead of raising, while a C++
// exception with a literal message did reach Python from a minimal extension.  SDP_REQUIRE is TORCH_CHECK
// without the throw and without c10's stream formatting.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "sdp4bit_kernels.cuh"

namespace {

// ---- message formatting with std::string only ----
const char* dtype_name(at::ScalarType t)
{
    switch (t) {
        case at::kFloat: return "float32";
        case at::kHalf: return "float16";
        case at::kBFloat16: return "bfloat16";
        case at::kDouble: return "float64";
        case at::kByte: return "uint8";
        case at::kChar: return "int8";
        case at::kShort: return "int16";
        case at::kInt: return "int32";
        case at::kLong: return "int64";
        case at::kBool: return "bool";
        default: return "another dtype";
    }
}

std::string device_name(const at::Device& d)
{
    if (d.is_cpu()) return "cpu";
    if (d.is_cuda()) return d.has_index() ? "cuda:" + std::to_string(static_cast<int>(d.index())) : "cuda";
    return "device type #" + std::to_string(static_cast<int>(d.type()));
}

void put(std::string& s, const char* x) { s += x; }
void put(std::string& s, const std::string& x) { s += x; }
void put(std::string& s, at::ScalarType t) { s += dtype_name(t); }
void put(std::string& s, const at::Device& d) { s += device_name(d); }
template <typename T, typename std::enable_if<std::is_integral<T>::value, int>::type = 0>
void put(std::string& s, T x)
{
    s += std::to_string(static_cast<long long>(x));
}

template <typename... A>
std::string cat(const A&... a)
{
    std::string s;
    (put(s, a), ...);
    return s;
}

}  // namespace

#define SDP_REQUIRE(cond, ...)                  \
    do {                                        \
        if (!(cond)) return cat(__VA_ARGS__);   \
    } while (0)

// propagate the message of a check helper
#define SDP_TRY(expr)                          \
    do {                                       \
        std::string sdp_err_ = (expr);         \
        if (!sdp_err_.empty()) return sdp_err_; \
    } while (0)

namespace {

using sdp4bit::FloatKind;
using sdp4bit::QuantSpec;

constexpr int64_t kMinHadamard = 8;    // the three in-lane butterfly stages always run
constexpr int64_t kMaxHadamard = 256;  // one warp step of 32 lanes x 8 elements

std::string float_kind(const at::Tensor& t, const char* name, FloatKind* kind)
{
    switch (t.scalar_type()) {
        case at::kFloat: *kind = FloatKind::kF32; return {};
        case at::kHalf: *kind = FloatKind::kF16; return {};
        case at::kBFloat16: *kind = FloatKind::kBF16; return {};
        default: return cat(name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
    }
}

std::string check_cuda(const at::Tensor& t, const char* name, const at::Device& device)
{
    SDP_REQUIRE(t.defined(), name, " must be a tensor, got an undefined one");
    SDP_REQUIRE(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
    SDP_REQUIRE(t.device() == device, name, " is on ", t.device(), " but the op runs on ", device);
    SDP_REQUIRE(t.is_contiguous(), name, " must be contiguous");
    return {};
}

std::string check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype)
{
    SDP_REQUIRE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
    return {};
}

std::string check_bits(int64_t bits, const char* name)
{
    SDP_REQUIRE(bits == 4 || bits == 8, name, " must be 4 or 8, got ", bits);
    return {};
}

std::string check_group(int64_t group_size, const char* name)
{
    SDP_REQUIRE(group_size >= 8 && group_size % 8 == 0, name,
                " must be a positive multiple of 8 for the CUDA kernels (8 elements per lane), got ", group_size);
    return {};
}

std::string check_hadamard(int64_t h, const char* name)
{
    SDP_REQUIRE(h == 0 || (h >= kMinHadamard && h <= kMaxHadamard && (h & (h - 1)) == 0), name,
                " must be 0 (none) or a power of two in ", kMinHadamard, "..", kMaxHadamard,
                " for the CUDA kernels, got ", h);
    return {};
}

std::string check_rounding(int64_t rounding)
{
    SDP_REQUIRE(rounding == 0 || rounding == 1, "rounding must be 0 (nearest) or 1 (stochastic), got ", rounding);
    return {};
}

std::string check_mode(int64_t diff)
{
    SDP_REQUIRE(diff == 0 || diff == 1, "mode must be 1 (diff) or 0 (direct), got ", diff);
    return {};
}

// a payload (uint8) and scales (fp32) output pair of n_pad quantized elements
std::string check_outputs(const at::Tensor& out, const at::Tensor& out_scales, int64_t n_pad, int64_t bits,
                          int64_t group_size, const at::Device& device)
{
    SDP_TRY(check_cuda(out, "out", device));
    SDP_TRY(check_dtype(out, "out", at::kByte));
    SDP_REQUIRE(out.numel() == n_pad * bits / 8, "out has ", out.numel(), " elements, expected ", n_pad * bits / 8);
    SDP_TRY(check_cuda(out_scales, "out_scales", device));
    SDP_TRY(check_dtype(out_scales, "out_scales", at::kFloat));
    SDP_REQUIRE(out_scales.numel() == n_pad / group_size, "out_scales has ", out_scales.numel(),
                " elements, expected ", n_pad / group_size);
    return {};
}

QuantSpec make_spec(int64_t bits, int64_t group_size, int64_t rounding, int64_t key, int64_t offset)
{
    QuantSpec q;
    q.bits = static_cast<int>(bits);
    q.group_size = group_size;
    q.stochastic = static_cast<int>(rounding);
    q.key = static_cast<uint32_t>(static_cast<uint64_t>(key) & 0xffffffffull);  // reference: key & MASK32
    q.offset = offset;
    return q;
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// payloads [k, m*bits/8] uint8 and scales (k*m/group fp32) of a dequant-sum op; sets m.
std::string check_chunks(const at::Tensor& payloads, const at::Tensor& scales, int64_t bits, int64_t group_size,
                         const at::Device& device, int64_t* m_out)
{
    SDP_TRY(check_cuda(payloads, "payloads", device));
    SDP_TRY(check_dtype(payloads, "payloads", at::kByte));
    SDP_REQUIRE(payloads.dim() == 2, "payloads must be 2-D [k, bytes per chunk], got ", payloads.dim(), "-D");
    const int64_t k = payloads.size(0);
    SDP_REQUIRE(k >= 1 && k <= INT32_MAX, "payloads must hold at least one chunk (k >= 1), got k = ", k);
    const int64_t m = payloads.size(1) * 8 / bits;
    SDP_REQUIRE(m % group_size == 0, "each chunk holds ", m, " elements, not a multiple of group_size ", group_size);
    SDP_TRY(check_cuda(scales, "scales", device));
    SDP_TRY(check_dtype(scales, "scales", at::kFloat));
    SDP_REQUIRE(scales.numel() == k * (m / group_size), "scales has ", scales.numel(), " elements, expected k * m / ",
                "group_size = ", k, " * ", m, " / ", group_size, " = ", k * (m / group_size));
    *m_out = m;
    return {};
}

std::string launched(cudaError_t err)
{
    SDP_REQUIRE(err == cudaSuccess, "CUDA error: kernel launch failed: ", cudaGetErrorString(err));
    return {};
}

cudaStream_t current_stream(const at::Device& device)
{
    return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

// ---------------------------------------------------------------------------------------------------------
// op 1
// ---------------------------------------------------------------------------------------------------------
std::string hadamard_quantize(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t hadamard_size,
                              int64_t rounding, int64_t key, int64_t offset, int64_t swizzle_rows,
                              int64_t swizzle_cols, at::Tensor& out, at::Tensor& out_scales)
{
    SDP_REQUIRE(x.defined() && x.is_cuda(), "x must be a CUDA tensor, got one on ",
                x.defined() ? x.device() : at::Device(at::kCPU));
    const at::Device device = x.device();
    SDP_TRY(check_cuda(x, "x", device));
    FloatKind kind;
    SDP_TRY(float_kind(x, "x", &kind));
    SDP_TRY(check_bits(bits, "bits"));
    SDP_TRY(check_group(group_size, "group_size"));
    SDP_TRY(check_hadamard(hadamard_size, "hadamard_size"));
    SDP_TRY(check_rounding(rounding));
    const int64_t n = x.numel();
    SDP_REQUIRE(n % group_size == 0, "x has ", n, " elements, not a multiple of group_size ", group_size);
    SDP_REQUIRE(hadamard_size == 0 || group_size % hadamard_size == 0, "group_size ", group_size,
                " must be a multiple of hadamard_size ", hadamard_size);
    SDP_REQUIRE((swizzle_rows == 0) == (swizzle_cols == 0) && swizzle_rows >= 0 && swizzle_cols >= 0,
                "swizzle must be (rows >= 1, cols >= 1) or (0, 0) for none, got (", swizzle_rows, ", ", swizzle_cols,
                ")");
    SDP_REQUIRE(swizzle_rows == 0 || n % (swizzle_rows * swizzle_cols) == 0, "x has ", n,
                " elements, not divisible into ", swizzle_rows, "x", swizzle_cols, " segments");
    SDP_TRY(check_outputs(out, out_scales, n, bits, group_size, device));
    if (n == 0) return {};

    const c10::cuda::CUDAGuard guard(device);
    return launched(sdp4bit::launch_hadamard_quantize(
        x.data_ptr(), kind, n, static_cast<int>(hadamard_size), swizzle_rows, swizzle_cols,
        make_spec(bits, group_size, rounding, key, offset), static_cast<uint8_t*>(out.data_ptr()),
        static_cast<float*>(out_scales.data_ptr()), current_stream(device)));
}

// ---------------------------------------------------------------------------------------------------------
// op 2
// ---------------------------------------------------------------------------------------------------------
std::string dequant_sum_requant(const at::Tensor& payloads, const at::Tensor& scales, int64_t in_bits,
                                int64_t out_bits, int64_t group_size, int64_t rounding, int64_t key, int64_t offset,
                                int64_t out_group_size, at::Tensor& out, at::Tensor& out_scales)
{
    SDP_REQUIRE(payloads.defined() && payloads.is_cuda(), "payloads must be a CUDA tensor");
    const at::Device device = payloads.device();
    SDP_TRY(check_bits(in_bits, "in_bits"));
    SDP_TRY(check_bits(out_bits, "out_bits"));
    SDP_TRY(check_group(group_size, "group_size"));
    SDP_TRY(check_group(out_group_size, "out_group_size"));
    SDP_TRY(check_rounding(rounding));
    int64_t m = 0;
    SDP_TRY(check_chunks(payloads, scales, in_bits, group_size, device, &m));
    const int64_t n_pad = round_up(m, out_group_size);
    SDP_TRY(check_outputs(out, out_scales, n_pad, out_bits, out_group_size, device));
    if (m == 0) return {};

    const c10::cuda::CUDAGuard guard(device);
    return launched(sdp4bit::launch_dequant_sum_requant(
        static_cast<const uint8_t*>(payloads.data_ptr()), static_cast<const float*>(scales.data_ptr()),
        static_cast<int>(payloads.size(0)), m, static_cast<int>(in_bits), group_size,
        make_spec(out_bits, out_group_size, rounding, key, offset), static_cast<uint8_t*>(out.data_ptr()),
        static_cast<float*>(out_scales.data_ptr()), current_stream(device)));
}

// ---------------------------------------------------------------------------------------------------------
// op 3
// ---------------------------------------------------------------------------------------------------------
std::string dequant_sum_inverse_hadamard(const at::Tensor& payloads, const at::Tensor& scales, int64_t bits,
                                         int64_t group_size, int64_t hadamard_size, double post_scale,
                                         at::Tensor& out)
{
    SDP_REQUIRE(payloads.defined() && payloads.is_cuda(), "payloads must be a CUDA tensor");
    const at::Device device = payloads.device();
    SDP_TRY(check_bits(bits, "bits"));
    SDP_TRY(check_group(group_size, "group_size"));
    SDP_TRY(check_hadamard(hadamard_size, "hadamard_size"));
    int64_t m = 0;
    SDP_TRY(check_chunks(payloads, scales, bits, group_size, device, &m));
    SDP_REQUIRE(hadamard_size == 0 || m % hadamard_size == 0, "each chunk holds ", m,
                " elements, not a multiple of hadamard_size ", hadamard_size);
    SDP_TRY(check_cuda(out, "out", device));
    FloatKind kind;
    SDP_TRY(float_kind(out, "out", &kind));
    SDP_REQUIRE(out.numel() >= m, "out has ", out.numel(), " elements, needs at least ", m);
    if (m == 0) return {};
    // the reference computes the factor in Python double and rounds it once to fp32
    const double factor = hadamard_size ? post_scale / static_cast<double>(hadamard_size) : post_scale;

    const c10::cuda::CUDAGuard guard(device);
    return launched(sdp4bit::launch_dequant_sum_inverse_hadamard(
        static_cast<const uint8_t*>(payloads.data_ptr()), static_cast<const float*>(scales.data_ptr()),
        static_cast<int>(payloads.size(0)), m, static_cast<int>(bits), group_size, static_cast<int>(hadamard_size),
        static_cast<float>(factor), out.data_ptr(), kind, current_stream(device)));
}

// ---------------------------------------------------------------------------------------------------------
// op 4
// ---------------------------------------------------------------------------------------------------------
std::string weight_delta_quantize(const at::Tensor& master, at::Tensor& replica, int64_t bits, int64_t group_size,
                                  int64_t rounding, int64_t key, int64_t offset, int64_t diff, at::Tensor& out,
                                  at::Tensor& out_scales)
{
    SDP_REQUIRE(master.defined() && master.is_cuda(), "master must be a CUDA tensor");
    const at::Device device = master.device();
    SDP_TRY(check_cuda(master, "master", device));
    SDP_TRY(check_dtype(master, "master", at::kFloat));
    SDP_TRY(check_cuda(replica, "replica", device));
    FloatKind kind;
    SDP_TRY(float_kind(replica, "replica", &kind));
    SDP_REQUIRE(master.numel() == replica.numel(), "master has ", master.numel(), " elements but replica has ",
                replica.numel());
    SDP_TRY(check_bits(bits, "bits"));
    SDP_TRY(check_group(group_size, "group_size"));
    SDP_TRY(check_rounding(rounding));
    SDP_TRY(check_mode(diff));
    const int64_t n = master.numel();
    const int64_t n_pad = round_up(n, group_size);
    SDP_TRY(check_outputs(out, out_scales, n_pad, bits, group_size, device));
    if (n == 0) return {};

    const c10::cuda::CUDAGuard guard(device);
    return launched(sdp4bit::launch_weight_delta_quantize(
        static_cast<const float*>(master.data_ptr()), replica.data_ptr(), kind, n, static_cast<int>(diff),
        make_spec(bits, group_size, rounding, key, offset), static_cast<uint8_t*>(out.data_ptr()),
        static_cast<float*>(out_scales.data_ptr()), current_stream(device)));
}

// ---------------------------------------------------------------------------------------------------------
// ops 5 and 6
// ---------------------------------------------------------------------------------------------------------
// what both replica updates check: the destination (CUDA, contiguous, float; sets kind), bits, group size, mode,
// a uint8 payload and fp32 scales on its device
std::string check_update(const at::Tensor& dst, const char* name, const at::Tensor& payload, const at::Tensor& scales,
                         int64_t bits, int64_t group_size, int64_t diff, const at::Device& device, FloatKind* kind)
{
    SDP_TRY(check_cuda(dst, name, device));
    SDP_TRY(float_kind(dst, name, kind));
    SDP_TRY(check_bits(bits, "bits"));
    SDP_TRY(check_group(group_size, "group_size"));
    SDP_TRY(check_mode(diff));
    SDP_TRY(check_cuda(payload, "payload", device));
    SDP_TRY(check_dtype(payload, "payload", at::kByte));
    SDP_TRY(check_cuda(scales, "scales", device));
    SDP_TRY(check_dtype(scales, "scales", at::kFloat));
    return {};
}

// the payload's `codes` codes are whole groups with one scale each
std::string check_whole_groups(const at::Tensor& scales, int64_t codes, int64_t group_size)
{
    SDP_REQUIRE(scales.numel() * group_size == codes, "scales has ", scales.numel(), " elements but the payload holds ",
                codes, " codes = ", codes / group_size, " groups of ", group_size,
                (codes % group_size ? " (not a whole number of groups)" : ""));
    return {};
}

std::string dequant_add_(at::Tensor& replica, const at::Tensor& payload, const at::Tensor& scales, int64_t bits,
                         int64_t group_size, int64_t diff)
{
    SDP_REQUIRE(replica.defined() && replica.is_cuda(), "replica must be a CUDA tensor");
    const at::Device device = replica.device();
    FloatKind kind;
    SDP_TRY(check_update(replica, "replica", payload, scales, bits, group_size, diff, device, &kind));
    const int64_t n = replica.numel();
    const int64_t codes = payload.numel() * 8 / bits;
    SDP_REQUIRE(codes >= n, "payload holds ", codes, " codes for a replica of ", n);
    SDP_TRY(check_whole_groups(scales, codes, group_size));
    if (n == 0) return {};

    const c10::cuda::CUDAGuard guard(device);
    return launched(sdp4bit::launch_dequant_add(replica.data_ptr(), kind, n,
                                                static_cast<const uint8_t*>(payload.data_ptr()),
                                                static_cast<const float*>(scales.data_ptr()), static_cast<int>(bits),
                                                group_size, static_cast<int>(diff), current_stream(device)));
}

// op 6.  tiles: the plan's int64 [T, 3] table (segments.SegmentPlan.tiles) on dst's device; src_end / dst_end: the
// plan's bounds (one past the largest source code read / destination element written), checked against the
// tensors here.  The table's rows were validated when the plan was built (inside [0, src_end) x [0, dst_end),
// no overlap in dst); reading them back here would cost a device-to-host copy per call.
std::string dequant_add_segments_(at::Tensor& dst, const at::Tensor& payload, const at::Tensor& scales, int64_t bits,
                                  int64_t group_size, int64_t diff, const at::Tensor& tiles, int64_t src_end,
                                  int64_t dst_end)
{
    SDP_REQUIRE(dst.defined() && dst.is_cuda(), "dst must be a CUDA tensor");
    const at::Device device = dst.device();
    FloatKind kind;
    SDP_TRY(check_update(dst, "dst", payload, scales, bits, group_size, diff, device, &kind));
    SDP_REQUIRE(dst.dim() == 1, "dst must be 1-D, got ", dst.dim(), "-D");
    SDP_TRY(check_cuda(tiles, "tiles", device));
    SDP_TRY(check_dtype(tiles, "tiles", at::kLong));
    SDP_REQUIRE(tiles.dim() == 2 && tiles.size(1) == 3, "tiles must be [T, 3] (src_start, dst_start, count), got ",
                tiles.dim(), "-D with ", tiles.dim() == 2 ? tiles.size(1) : 0, " columns");
    SDP_REQUIRE(tiles.size(0) <= INT32_MAX, "tiles has ", tiles.size(0), " rows, at most ", INT32_MAX, " supported");
    const int64_t codes = payload.numel() * 8 / bits;
    SDP_REQUIRE(src_end >= 0 && src_end <= codes, "payload holds ", codes, " codes, the segments read up to ", src_end);
    SDP_REQUIRE(dst_end >= 0 && dst_end <= dst.numel(), "dst has ", dst.numel(), " elements, the segments write up to ",
                dst_end);
    SDP_TRY(check_whole_groups(scales, codes, group_size));
    if (tiles.size(0) == 0) return {};

    const c10::cuda::CUDAGuard guard(device);
    return launched(sdp4bit::launch_dequant_add_segments(
        dst.data_ptr(), kind, static_cast<const uint8_t*>(payload.data_ptr()),
        static_cast<const float*>(scales.data_ptr()), static_cast<const int64_t*>(tiles.data_ptr()), tiles.size(0),
        static_cast<int>(bits), group_size, static_cast<int>(diff), current_stream(device)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "SDP4Bit CUDA kernels (deepspeed_sdp4bit.kernels.cuda_backend wraps these).  Each function returns '' "
              "when it launched, else the reason it did not (the wrapper raises it).";
    m.def("hadamard_quantize", &hadamard_quantize,
          "op 1: x, bits, group_size, hadamard_size (0 none), rounding (0/1), key, offset, swizzle_rows, "
          "swizzle_cols (0, 0 none), out uint8 [n*bits/8], out_scales fp32 [n/group_size] -> error message");
    m.def("dequant_sum_requant", &dequant_sum_requant,
          "op 2: payloads [k, bytes], scales, in_bits, out_bits, group_size, rounding, key, offset, "
          "out_group_size, out, out_scales -> error message");
    m.def("dequant_sum_inverse_hadamard", &dequant_sum_inverse_hadamard,
          "op 3: payloads [k, bytes], scales, bits, group_size, hadamard_size (0 none), post_scale, out "
          "-> error message");
    m.def("weight_delta_quantize", &weight_delta_quantize,
          "op 4: master fp32, replica (in place), bits, group_size, rounding, key, offset, diff (1) / direct (0), "
          "out, out_scales -> error message");
    m.def("dequant_add_", &dequant_add_,
          "op 5: replica (in place), payload, scales, bits, group_size, diff (1/0) -> error message");
    m.def("dequant_add_segments_", &dequant_add_segments_,
          "op 6: dst (in place), payload, scales, bits, group_size, diff (1/0), tiles int64 [T, 3], src_end, "
          "dst_end -> error message");
}
