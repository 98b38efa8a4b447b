# Fused chunk sums, run 3 (device tool, nvidia-h200-x2, carry .whl): the Triton op 2 / op 3 tests on a GPU (the
# persistent kernel with 8 chunks is new), then the end-to-end parity phase with kernel_backend=auto.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
(export PYTHONPATH=/tmp/site:$PWD; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    -k "requant or inverse or plan" > $OUT/tests_triton.txt 2>&1; tail -1 $OUT/tests_triton.txt)
BACKEND=auto timeout 420 bash benchmarks/gpu_e2e.sh parity
