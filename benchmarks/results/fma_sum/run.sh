# Fused chunk sums (device tool, nvidia-h200, carry .whl).
# run 1: the full kernel check: build, CUDA and Triton kernel tests on the GPU, benchmark (kernels_h200.json)
SKIP_NCU=1 TRITON_TEST_TIMEOUT=260 BENCH_NAME=kernels_h200 BENCH_SIZES_MB=8,32,64,128,512,2048 \
    bash benchmarks/gpu_kernel_check.sh
rm -f $OUT/sass.txt.gz
