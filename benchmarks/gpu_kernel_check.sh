#!/bin/bash
# Build, test, profile and benchmark the SDP4Bit kernels on a GPU machine in one go (what the device tool runs):
#   bash benchmarks/gpu_kernel_check.sh            (logs and JSON under $OUT, default /tmp/sdp4bit_out)
# Steps: install the carried wheels (.whl/), JIT-build our extension with TORCH_CUDA_ARCH_LIST=9.0a (the
# preset that DeepSpeed 0.19.8's own parser cannot read), build DeepSpeed's QuantizerBuilder in the background
# for the comparison (with 9.0), probe the binding's error path in a subprocess (host backtrace through
# cuda-gdb if it crashes), run the CUDA kernel tests (and the Triton ones unless SKIP_TRITON_TESTS=1), profile
# one pass of each op with ncu, then the benchmark.  Each step has a time limit so that the whole fits one
# 10-minute command.
# Env: BENCH_SIZES_MB (default 8,32,128,512,2048), BENCH_NAME (JSON name, default kernels), SKIP_TRITON_TESTS=1,
# TRITON_TEST_TIMEOUT (seconds, default 150: each Triton configuration compiles on first use), SKIP_NCU=1,
# SKIP_BENCH=1.
set -u
OUT=${OUT:-/tmp/sdp4bit_out}
mkdir -p "$OUT"
log=$OUT/log.txt
start=$SECONDS
stamp() { echo "[$((SECONDS - start)) s] $*" | tee -a "$log"; }

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" | tee -a "$log"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    nvcc --version | tail -2
    c++ --version | head -1
    nproc
} >> "$log" 2>&1

stamp "background: DeepSpeed QuantizerBuilder (TORCH_CUDA_ARCH_LIST=9.0)"
(TORCH_CUDA_ARCH_LIST=9.0 timeout 420 python3 -c \
    "import time; t=time.time(); from deepspeed.ops.op_builder import QuantizerBuilder; QuantizerBuilder().load(); print('ds quantizer built in', round(time.time()-t,1), 's')" \
    > /tmp/ds_build.txt 2>&1) &
ds_pid=$!
stamp "building sdp4bit_quant (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
timeout 300 python3 -c "
import time; t = time.time()
from deepspeed_sdp4bit import _native
ext = _native.load_extension(verbose=True)
print('sdp4bit_quant built/loaded in', round(time.time() - t, 1), 's:', ext.__file__)
" > "$OUT/build.txt" 2>&1
stamp "build rc=$?"
tail -2 "$OUT/build.txt" | tee -a "$log"
so=$(find "$TORCH_EXTENSIONS_DIR" -name "sdp4bit_quant.so" | head -1)
if [ -n "$so" ]; then
    cuobjdump --list-elf "$so" 2>&1 | tee -a "$log"
    cuobjdump -sass "$so" 2>/dev/null | gzip > "$OUT/sass.txt.gz"
fi

# The binding's error path on its own first, in a subprocess: a crash there is diagnosed with a host backtrace.
cat > /tmp/binding_probe.py <<'PROBE'
import torch
from deepspeed_sdp4bit import _native
ext = _native.load_extension()
x = torch.randn(1024, device="cuda")
out = torch.empty(512, dtype=torch.uint8, device="cuda")
sc = torch.empty(8, device="cuda")
print("valid:", repr(ext.hadamard_quantize(x, 4, 128, 32, 0, 0, 0, 0, 0, out, sc)))
print("cpu x:", repr(ext.hadamard_quantize(x.cpu(), 4, 128, 32, 0, 0, 0, 0, 0, out, sc)))
print("f64 x:", repr(ext.hadamard_quantize(x.double(), 4, 128, 32, 0, 0, 0, 0, 0, out, sc)))
torch.cuda.synchronize()
PROBE
stamp "binding error-path probe"
timeout 60 python3 -X faulthandler /tmp/binding_probe.py > /tmp/probe.txt 2>&1
rc=$?
stamp "binding probe rc=$rc"
tail -4 /tmp/probe.txt | tee -a "$log"
if [ $rc -ne 0 ] && command -v cuda-gdb >/dev/null; then
    timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 /tmp/binding_probe.py 2>&1 | tail -40 >> "$log"
fi

stamp "pytest CUDA kernels"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs --tb=short --maxfail=25 tests/test_cuda_compile.py \
    tests/test_kernels_cuda.py -k "not test_cu_files_compile" > "$OUT/pytest_cuda.txt" 2>&1
stamp "pytest CUDA rc=$?"
tail -4 "$OUT/pytest_cuda.txt" | tee -a "$log"

if [ -f tests/test_kernels_triton.py ] && [ "${SKIP_TRITON_TESTS:-0}" != 1 ]; then
    stamp "pytest Triton kernels (on CUDA)"
    timeout "${TRITON_TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rs --tb=short --maxfail=10 tests/test_kernels_triton.py \
        >> "$OUT/pytest_cuda.txt" 2>&1
    stamp "pytest Triton rc=$?"
    tail -2 "$OUT/pytest_cuda.txt" | tee -a "$log"
fi

if [ "${SKIP_NCU:-0}" != 1 ] && command -v ncu >/dev/null; then
    stamp "ncu: one pass of each op at 512 MiB"
    timeout 120 ncu --target-processes all -k "regex:quant|dequant" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        python3 benchmarks/bench_kernels.py --out /tmp/unused.json --single-pass-mb 512 > "$OUT/ncu.txt" 2>&1
    stamp "ncu rc=$?"
fi

wait $ds_pid
stamp "deepspeed quantizer build rc=$?"
tail -1 /tmp/ds_build.txt | tee -a "$log"
tail -5 /tmp/ds_build.txt >> "$OUT/build.txt"

if [ "${SKIP_BENCH:-0}" != 1 ]; then
    left=$((575 - (SECONDS - start)))
    stamp "benchmark (limit ${left} s)"
    timeout $left python3 benchmarks/bench_kernels.py --out "$OUT/${BENCH_NAME:-kernels}.json" \
        --sizes-mb "${BENCH_SIZES_MB:-8,32,128,512,2048}" > "$OUT/bench.txt" 2>&1
    stamp "benchmark rc=$?"
    tail -62 "$OUT/bench.txt"
fi
stamp "done"
