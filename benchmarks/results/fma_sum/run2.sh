# Fused chunk sums, run 2 (device tool, nvidia-h200, carry .whl): ops 2 and 3 against the chunk count, then Triton
# op 2 as the persistent kernel for 3 and 8 chunks too (A/B against the default, persistent for 4 only).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCH_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
for mb in 512 64; do
    timeout 200 python3 benchmarks/bench_chunk_counts.py --size-mb $mb --ks 2,3,4,8 2>&1 | grep -v WARN >> $OUT/chunk_counts.txt
done
for mb in 64 512; do for ks in 4 3,4,8; do
    echo "== --size-mb $mb --op2-persist-ks $ks" >> $OUT/op2_persist_ks.txt
    timeout 60 python3 benchmarks/bench_chunk_counts.py --size-mb $mb --ks 3,8 --backends triton --op2-persist-ks $ks \
        2>&1 | grep requant >> $OUT/op2_persist_ks.txt
done; done
# compute-sanitizer over the persistent kernels where programs prefetch past the last tile (64 MiB: op 3 k=3, op 2 k=4)
cat > /tmp/memcheck.py <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
import bench_kernels as B, bench_chunk_counts as CC
from deepspeed_sdp4bit.kernels import triton_backend as T
for op, k in ((3, 3), (2, 4), (3, 8)):
    name, make, _, _, run = CC.cases(64 * B.MB, k)[0 if op == 2 else 1]
    run(T, make())
    torch.cuda.synchronize()
    print("ran", name, "k =", k, flush=True)
PY
CS=$(ls /usr/local/cuda*/bin/compute-sanitizer | head -1)
timeout 150 $CS --tool memcheck --print-limit 5 python3 /tmp/memcheck.py 2>&1 | grep -v "Host Frame" > $OUT/memcheck.txt
