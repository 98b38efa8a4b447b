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
