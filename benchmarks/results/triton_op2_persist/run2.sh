# second A/B of the persistent Triton op 2 (device tool, nvidia-h200, carry .whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for mb in 64 128 512; do
  for v in "0 8 64 2" "1 8 64 2" "1 16 32 2" "1 12 64 0" "1 16 32 0"; do
    set -- $v
    args="--size-mb $mb --ks 2,3,4 --backends triton --op2-persist $1 --op2-pps $2 --triton-rows $3 --op2-row64-max-k $4"
    echo "== $args" >> $OUT/ab2.txt
    timeout 100 python3 benchmarks/bench_chunk_counts.py $args 2>&1 | grep -v WARN | grep requant >> $OUT/ab2.txt
  done
done
