#!/bin/bash
# Twenty-first session's device calls (run from the repository root with .whl/ carried; w1b is
# gpu_call_fourteenth.sh's), on a host of 2 or more GPUs:
#   ovlf  issue 20's deliverable 4 at the fast end: weights.overlap against the refresh inside step(), 406M, one rank
#         per GPU as 2 nodes x 1 (e2e --transport nodes, GPUs 0 and 1), timed as a loop that reads its loss
#         (--step-sync stream, DeepSpeed's throughput timer unsynchronized for both), 30 timed steps, each pair its
#         own e2e call, the two configs' order alternating; RATES (default "off off off off": the unshaped sockets,
#         where the twentieth session's two pairs disagreed) lists the knob setting of each pair; the rows now carry
#         the end-to-end step (cycle_ms_per_step). A pair that would start with under 130 s left is not started.
#   hfo   the HF Trainer with weights.overlap on a GPU (benchmarks/gpu_hf.sh, CONFIG=sdp4bit_overlap.json
#         COMPARE=sdp4bit.json): 4 ranks sharing GPU 0 as 2 nodes x 2 and, beside it, GPU 1 as 4 x 1 (STEPS, default
#         50): the overlapped run against the refresh inside step() step by step, then stopped half-way (a checkpoint
#         saved right after a step, its refresh possibly still in flight) and resumed; the held-out loss after
#         training and after from_pretrained
#   ovlab (added after the session's calls, for the next) both modes in ONE process: e2e --overlap-blocks 5
#         (train_gpt.py switches engine.sdp4bit.overlap on off off on ... in blocks of 5 steps; each block's first
#         step left out; pairs of adjacent blocks compared), so the spread between processes that kept ovlf's
#         unshaped pairs unresolved (0.72-1.37) drops out: on GPUs 0+1 the 406M and the 1.3B as 2x1 at each knob
#         setting of RATES (default "off 5"), then, where a 4-GPU host is lent, 2x2 and 4x1 the same way; 60 timed
#         steps after 10 untimed (the timed steps start at a pair: 6 pairs of blocks) per run; MODELS and TOPS (since
#         the twenty-second session) pick the models and topologies (TOPS="4x1 2x2" needs a host of 4 GPUs)
# usage: bash THIS COMMIT BUDGET_S ovlf|hfo|ovlab
# Everything comes back as $OUT/results.tgz (the device returns at most 8 files).
commit=$1; budget=$2
case "$3" in ovlf|hfo|ovlab) ;; *) echo "usage: $0 COMMIT BUDGET_S ovlf|hfo|ovlab" >&2; exit 2 ;; esac
[ $(nvidia-smi -L | wc -l) -ge 2 ] || { echo "$3 needs a host of 2 or more GPUs" >&2; exit 2; }
left() { local s=$((budget - SECONDS - $1)); [ $s -gt 0 ] || s=1; echo $s; }   # seconds to a margin before the budget
source benchmarks/results/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
build_kernels
case "$3" in
ovlf)
  i=0; order=(sdp4bit_overlap sdp4bit)
  for r in ${RATES:-off off off off}; do i=$((i + 1))
    [ $(left 0) -ge 130 ] || { echo "pair $i ($r) not started: $(left 0) s left"; break; }
    CUDA_VISIBLE_DEVICES=0,1 python3 -m benchmarks e2e --transport nodes --models 406M --topologies 2x1 \
      --configs ${order[@]} --link-gbps $r --nccl-sockets 4x4 --probe-link --warmup 3 --timed 30 --timeout 150 \
      --step-sync stream --train-arg=--ds-set --train-arg=timers.throughput.synchronized=false \
      --out $OUT/ovlf$i --deadline $(left 0) > $OUT/ovlf$i.log 2>&1
    grep "\[e2e\]" $OUT/ovlf$i.log; order=(${order[1]} ${order[0]}); done ;;
ovlab)
  G=$(nvidia-smi -L | wc -l); i=0
  for r in ${RATES:-off 5}; do for m in ${MODELS:-406M 1.3B}; do for t in ${TOPS:-2x1 $([ $G -ge 4 ] && echo 4x1 2x2)}; do i=$((i + 1))
    [ $(left 0) -ge 150 ] || { echo "run $i ($m $t $r) not started: $(left 0) s left"; break 3; }
    ng=2; [ $t = 2x1 ] || ng=4
    [ $G -ge $ng ] || { echo "run $i ($m $t $r) skipped: $t needs $ng GPUs, the host has $G"; continue; }
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ng - 1))) python3 -m benchmarks e2e --transport nodes --models $m \
      --topologies $t --configs sdp4bit_overlap --overlap-blocks 5 --link-gbps $r --nccl-sockets 4x4 --probe-link \
      --warmup 10 --timed 60 --timeout 200 --step-sync stream --out $OUT/ovlab$i --deadline $(left 0) \
      > $OUT/ovlab$i.log 2>&1
    grep "\[e2e\]" $OUT/ovlab$i.log; done; done; done ;;
hfo)  # (OUT under /tmp: the Trainer's checkpoints would make results.tgz too large to come back)
  rm -rf /tmp/hfo_*   # a warm machine's earlier runs would be resumed or packed
  for g in 0 1; do gpn=$(( g == 0 ? 2 : 1 ))
    (CUDA_VISIBLE_DEVICES=$g RANKS_PER_GPU=4 NPROC=4 GPUS_PER_NODE=$gpn WHEELS=.whl/hf OUT=/tmp/hfo_${gpn} \
       CONFIG=sdp4bit_overlap.json COMPARE=sdp4bit.json STEPS=${STEPS:-50} \
       timeout $(left 20) bash benchmarks/gpu_hf.sh > $OUT/hfo_${gpn}.log 2>&1; echo "rc $?" >> $OUT/hfo_${gpn}.log) &
  done; wait; tail -n 9 $OUT/hfo_*.log
  for d in /tmp/hfo_*; do [ -d $d ] || continue   # the logs only, not the checkpoints
    (cd $d && find . -name log.json -o -name env.txt | tar czf $OUT/$(basename $d)_logs.tgz -T -); done ;;
esac
pack_out
