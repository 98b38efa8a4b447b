# Fused chunk sums, run 5 (device tool, nvidia-h200, carry .whl): the Triton op 2 / op 3 tests on the GPU (the
# persistent op 2 with 5 chunks is new), then the persistent kernels against the one-program-per-tile kernels,
# bit for bit, at 64 MiB (thousands of tiles, programs looping ~2-20 times).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -k "requant or inverse or plan" \
    > $OUT/tests_triton.txt 2>&1; tail -1 $OUT/tests_triton.txt
cat > /tmp/persist_vs_rows.py <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
import bench_kernels as B, bench_chunk_counts as CC
from deepspeed_sdp4bit.kernels import triton_backend as T
for op, ks in ((2, (4, 5, 8)), (3, (3, 5, 8))):
    for k in ks:
        name, make, _, _, run = CC.cases(64 * B.MB, k)[0 if op == 2 else 1]
        d = make()
        got = run(T, d)
        got = [t.clone() for t in (got if isinstance(got, tuple) else (got,))]
        flag = "_OP2_PERSIST" if op == 2 else "_OP3_PERSIST"
        setattr(T, flag, False)
        want = run(T, d)
        want = want if isinstance(want, tuple) else (want,)
        setattr(T, flag, True)
        same = all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
        print(f"{name} k={k}: persistent == one program per tile: {same}", flush=True)
PY
timeout 120 python3 /tmp/persist_vs_rows.py 2>&1 | grep -v WARN | tee $OUT/persist_vs_rows.txt
