#!/bin/bash
# Issue 21: does `accuracy --deterministic` (torch's deterministic algorithms) make a repeat of one run give the same
# losses on a GPU?  The ZeRO-3 replay of the 86M, seed 1, constant lr, twice, 40 steps each, one process after the
# other (repeats of one ZeRO-3 seed differed by 0.9-1.5% at 500 steps without it).  usage: bash THIS COMMIT BUDGET_S
commit=$1; budget=$2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 SDP4BIT_COMMIT=$commit
nvidia-smi --query-gpu=name --format=csv,noheader
for i in 1 2; do
  python3 -m benchmarks accuracy --share-gpu --deterministic --topologies 2x2 --configs zero3:replay --seeds 1 --steps 40 --schedules constant --out $OUT/d$i --deadline $((budget-SECONDS)) 2>&1 | grep "\[accuracy\].*: "
done
tar czf /tmp/results.tgz -C $OUT . && find $OUT -mindepth 1 -delete && mv /tmp/results.tgz $OUT/
