// Issue rates of the integer instructions the SDP4Bit kernels lean on (PRMT, LOP3, SHF) next to FADD,
// alone and mixed with FADD, on the GPU at hand: warp-instructions per clock per SM.
//   nvcc -O3 -arch=sm_90a -o /tmp/int_pipe_rates benchmarks/micro/int_pipe_rates.cu && /tmp/int_pipe_rates
// Each thread runs 8 independent dependency chains (enough to hide the latency) for ITERS iterations; the
// asm volatile blocks keep each instruction as written.  One chain step per instruction kind:
//   prmt: x = prmt(x, y, 0x1032)   lop3: x = (x ^ y) & z   shf: x = funnel-shift(x, y, 5)   fadd: f = f + g
// (ptxas folds chains of integer adds, so IADD3 is not measured.)
#include <cstdio>
#include <cuda_runtime.h>

constexpr int ITERS = 4096;
constexpr int CHAINS = 8;

template <int KIND>
__device__ __forceinline__ void step(unsigned (&x)[CHAINS], float (&f)[CHAINS], unsigned y, unsigned z, float g)
{
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
        if (KIND == 0 || KIND == 5) asm volatile("prmt.b32 %0, %0, %1, 0x1032;" : "+r"(x[c]) : "r"(y));
        if (KIND == 1 || KIND == 6) asm volatile("lop3.b32 %0, %0, %1, %2, 0x28;" : "+r"(x[c]) : "r"(y), "r"(z));
        if (KIND == 2) asm volatile("shf.l.wrap.b32 %0, %0, %1, 5;" : "+r"(x[c]) : "r"(y));
        if (KIND >= 4) asm volatile("add.f32 %0, %0, %1;" : "+f"(f[c]) : "f"(g));
    }
}

template <int KIND>
__global__ void rate_kernel(unsigned* out, unsigned y, unsigned z, float g)
{
    unsigned x[CHAINS];
    float f[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
        x[c] = threadIdx.x * 7u + c;
        f[c] = static_cast<float>(c);
    }
    for (int i = 0; i < ITERS; ++i) step<KIND>(x, f, y, z, g);
    unsigned acc = 0;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) acc ^= x[c] ^ __float_as_uint(f[c]);
    if (acc == 0x12345678u) out[0] = acc;  // keeps the chains alive
}

template <int KIND>
void measure(const char* name, int per_step, int sms, float clock_ghz)
{
    unsigned* out;
    cudaMalloc(&out, 4);
    const int blocks = sms * 8, threads = 256;
    rate_kernel<KIND><<<blocks, threads>>>(out, 0x01234567u, 0x0f0f0f0fu, 1e-30f);  // warm-up
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a);
    for (int r = 0; r < 5; ++r) rate_kernel<KIND><<<blocks, threads>>>(out, 0x01234567u, 0x0f0f0f0fu, 1e-30f);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    const double warp_instr = 5.0 * blocks * (threads / 32) * static_cast<double>(ITERS) * CHAINS * per_step;
    const double clocks = ms * 1e-3 * clock_ghz * 1e9;
    printf("%-14s %8.3f ms  %6.2f warp-instructions / clock / SM\n", name, ms, warp_instr / clocks / sms);
    cudaFree(out);
}

int main()
{
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    int khz = 0;
    cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
    const float ghz = khz / 1e6f;
    printf("%s, %d SMs, clock %.2f GHz (rates assume this clock)\n", p.name, p.multiProcessorCount, ghz);
    measure<0>("prmt", 1, p.multiProcessorCount, ghz);
    measure<1>("lop3", 1, p.multiProcessorCount, ghz);
    measure<2>("shf", 1, p.multiProcessorCount, ghz);
    measure<4>("fadd", 1, p.multiProcessorCount, ghz);
    measure<5>("prmt + fadd", 2, p.multiProcessorCount, ghz);
    measure<6>("lop3 + fadd", 2, p.multiProcessorCount, ghz);
    return 0;
}
