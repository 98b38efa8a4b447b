python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
S=$SECONDS
timeout 300 python3 benchmarks/sweep_tiles.py --sizes-mb 64,512 --cuda-threads 32,64,128 --triton-rows 32,64,128 --out $OUT/sweep2.json > $OUT/sweep2.txt 2>&1
echo "sweep rc=$? $((SECONDS-S)) s" >> $OUT/cc.txt
for mb in 512 64; do echo "== --size-mb $mb --ks 2,3,4,8" >> $OUT/cc.txt; timeout 150 python3 benchmarks/bench_chunk_counts.py --size-mb $mb --ks 2,3,4,8 >> $OUT/cc.txt 2>&1; done
for pad in 0 512 98304; do echo "== --size-mb 64 --ks 4 --backends triton --row-pad $pad" >> $OUT/cc.txt; timeout 60 python3 benchmarks/bench_chunk_counts.py --size-mb 64 --ks 4 --backends triton --row-pad $pad >> $OUT/cc.txt 2>&1; done
echo "done $((SECONDS-S)) s" >> $OUT/cc.txt
