python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
(timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -k "inverse or plan" 2>&1 | tail -2) > $OUT/t3.txt
for mb in 64 512 128; do for ks in "" "2,3,4,8"; do
  echo "== --size-mb $mb --ks 2,3,4,8 --backends triton --op3-persist-ks '$ks'" >> $OUT/ab3.txt
  timeout 80 python3 benchmarks/bench_chunk_counts.py --size-mb $mb --ks 2,3,4,8 --backends triton --op3-persist-ks "$ks" 2>&1 | grep -v WARN | grep inverse >> $OUT/ab3.txt
done; done
