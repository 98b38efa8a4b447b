# Fused chunk sums, run 4 (device tool, nvidia-h200, carry .whl): the chunk counts `auto` had not been measured at
# (op 3: 5-7 nodes and more than 8; op 2: 5-7 GPUs per node), and Triton op 2 as the persistent kernel for 5-7.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCH_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
python3 -c "from deepspeed_sdp4bit import _native; _native.load_extension()" > $OUT/build.txt 2>&1
for mb in 512 64; do
    timeout 150 python3 benchmarks/bench_chunk_counts.py --size-mb $mb --ks 5,6,7,12,16,32 2>&1 | grep -v WARN >> $OUT/chunk_counts_more.txt
done
for mb in 64 512; do for ks in 4,8 4,5,6,7,8; do
    echo "== --size-mb $mb --op2-persist-ks $ks" >> $OUT/op2_persist_ks_5to7.txt
    timeout 60 python3 benchmarks/bench_chunk_counts.py --size-mb $mb --ks 5,6,7 --backends triton --op2-persist-ks $ks \
        2>&1 | grep requant >> $OUT/op2_persist_ks_5to7.txt
done; done
