#!/bin/bash
# The device call of the GPU accuracy-sim runs (gpu_86m_500.json): installs the wheels of ../shared/device.md,
# builds the CUDA ops, runs one accuracy-sim process per JOB, dealt round-robin over the host's GPUs (8 at a time fill an H200), then
# packs the run files and logs into $OUT/runs.tgz.  Run from the repository root with .whl/ carried.
# usage: bash benchmarks/results/accuracy_sim/gpu_call.sh COMMIT BUDGET_S "JOB1" "JOB2" ...   (each JOB: extra accuracy-sim args; one process each)
commit=$1; budget=$2; shift 2
source benchmarks/results/device_env.sh
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/logs/gpu.txt
build_kernels $OUT/logs/build.txt
(while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> $OUT/logs/util.txt; sleep 10; done) & mon=$!
# SIM_MODEL: the model and schedule arguments (default: the 86M GPT of issue 21; the d128 L4 model of the CPU
# runs is "--d-model 128 --layers 4 --heads 4 --seq 128 --micro-batch 8 --lr 1e-3 --warmup 20 --min-lr-ratio 0.1
# --steps 500 --eval-batches 4 --probe-every 25")
SIM_MODEL=${SIM_MODEL:-"--d-model 768 --layers 12 --heads 12 --seq 1024 --micro-batch 8 --lr 6e-4 --steps 500 --eval-batches 8 --probe-every 50"}
COMMON="--device cuda --backend auto --threads 2 --deterministic $SIM_MODEL --bucket-size 50000000 --ref-cache /tmp/sim_ref --verbose"
# the JOBs are dealt round-robin over the GPUs the call may use: CUDA_VISIBLE_DEVICES if set, else every GPU
IFS=, read -ra gpus <<< "${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)}"
[ "${#gpus[@]}" -ge 1 ] || gpus=(0)
i=0; pids=()
for job in "$@"; do
  i=$((i+1))
  CUDA_VISIBLE_DEVICES=${gpus[$(( (i-1) % ${#gpus[@]} ))]} python3 -m benchmarks accuracy-sim $COMMON $job --out $OUT/sim_$i.json --deadline $((budget-SECONDS)) > $OUT/logs/job_$i.txt 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
kill $mon
python3 -m benchmarks accuracy-sim --distances $OUT/sim_*.json --ref-cache /tmp/sim_ref --out /dev/null
for f in $OUT/logs/job_*.txt; do echo "== $f"; grep -v "^  " $f | tail -5; grep "step" $f | tail -2; done
cd $OUT && tar czf runs.tgz logs sim_*.json && rm -rf logs sim_*.json
