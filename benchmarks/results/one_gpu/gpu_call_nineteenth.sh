#!/bin/bash
# Nineteenth session's device calls (run from the repository root with .whl/ carried; w1b is
# gpu_call_fourteenth.sh's):
#   ovl  issue 20's deliverable 4 where it is meant to pay: the weight refresh overlapped with the next forward
#        (configs/sdp4bit_overlap.json, weights.overlap) against the shipped default (refresh inside step()), one
#        rank per GPU on a host of 4 GPUs as logical nodes (e2e --transport nodes: NVLink inside a node, the link
#        knob on the sockets between), 406M at 4x1 and 2x2, knob 2 and 5 Gb/s per rank; the two configs in one
#        order at 2 and in the other at 5 (separate processes: --paired would hand an overlapped refresh the other
#        engine's whole step to hide in)
#   hf   the Trainer path (benchmarks/gpu_hf.sh) with 4 ranks sharing GPU 0 as 2 nodes x 2 and, beside it, 4 ranks
#        sharing GPU 1 as 4 nodes x 1, with the carried transformers / accelerate wheels (.whl/hf) when the
#        machine's are older than the hf extra's
#   hf4  (after hf ran out of time) one rank per GPU, 4 GPUs as 2 nodes x 2, with the carried wheels
#   ovls (added after the session's calls; run in the twentieth session on 2 GPUs as 2x1: one_gpu/README.md)
#        ovl with each timed step waiting for the current stream only
#        (e2e --step-sync stream): ovl's steps waited for every stream, which holds the overlapped refresh inside the
#        step that queued it, so ovl measured the overlap's cost, never what it hides (as did DeepSpeed's throughput
#        timer, synchronized by default, at every step's end: since a4ae335 SDP4Bit sets it unsynchronized
#        with the overlap, so run ovls at a commit with that)
# usage: bash THIS COMMIT BUDGET_S ovl|ovls|hf|hf4
# Everything comes back as $OUT/results.tgz (the device returns at most 8 files).
commit=$1; budget=$2
case "$3" in ovl|ovls|hf|hf4) ;; *) echo "usage: $0 COMMIT BUDGET_S ovl|ovls|hf|hf4" >&2; exit 2 ;; esac
# (ovl needs 4 GPUs; ovls runs 4x1 and 2x2 on 4 or more, 2x1 on 2 or 3: the twentieth session was lent 2)
G=$(nvidia-smi -L | wc -l)
case "$3" in ovl) [ $G -ge 4 ] || { echo "ovl needs a host of 4 or more GPUs" >&2; exit 2; } ;;
  ovls) [ $G -ge 2 ] || { echo "ovls needs a host of 2 or more GPUs" >&2; exit 2; } ;; esac
left() { local s=$((budget - SECONDS - $1)); [ $s -gt 0 ] || s=1; echo $s; }   # seconds to a margin before the budget
source benchmarks/results/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
build_kernels
case "$3" in
ovl|ovls)
  # ovls: both configs with DeepSpeed's throughput timer unsynchronized (the plan does so for the overlapped one
  # only), so the two differ in weights.overlap alone
  m=$3; sync=device; tm=(); [ $m = ovls ] && sync=stream && tm=(--train-arg=--ds-set --train-arg=timers.throughput.synchronized=false)
  topos="4x1 2x2"; rates="2:sdp4bit_overlap:sdp4bit 5:sdp4bit:sdp4bit_overlap"
  # two GPUs: 2 nodes x 1, also unshaped (the step shortest there, so the forward the overlap can hide the largest share)
  [ $G -lt 4 ] && topos=2x1 && rates="$rates off:sdp4bit_overlap:sdp4bit"
  for r in $rates; do set -- ${r//:/ }
    python3 -m benchmarks e2e --transport nodes --models 406M --topologies $topos --configs $2 $3 --link-gbps $1 \
      --nccl-sockets 4x4 --probe-link --warmup 3 --timed 10 --timeout 120 --step-sync $sync "${tm[@]}" --out $OUT/$m$1 \
      --deadline $(left 0) > $OUT/$m$1.log 2>&1
    grep "\[e2e\]" $OUT/$m$1.log; done ;;
hf)  # (OUT under /tmp: the Trainer's checkpoints made the first call's results.tgz too large to come back)
  rm -rf /tmp/hf_share4_*   # a warm machine's earlier runs would be resumed or packed
  for g in 0 1; do gpn=$(( g == 0 ? 2 : 1 ))
    (CUDA_VISIBLE_DEVICES=$g RANKS_PER_GPU=4 NPROC=4 GPUS_PER_NODE=$gpn WHEELS=.whl/hf OUT=/tmp/hf_share4_${gpn} \
       timeout $(left 20) bash benchmarks/gpu_hf.sh > $OUT/hf_share4_${gpn}.log 2>&1; echo "rc $?" >> $OUT/hf_share4_${gpn}.log) &
  done; wait; tail -n 8 $OUT/hf_share4_*.log ;;
hf4)  # the nineteenth session's second try: one rank per GPU, 4 GPUs as 2 nodes x 2 (as in the eighteenth session),
      # now with transformers / accelerate at the hf extra's versions (in hf, ZeRO-3 over sockets took most of the
      # call and SDP4Bit's runs were cut)
  rm -rf /tmp/hf4
  WHEELS=.whl/hf OUT=/tmp/hf4 GPUS_PER_NODE=2 timeout $(left 15) bash benchmarks/gpu_hf.sh > $OUT/hf4.log 2>&1
  echo "rc $?" >> $OUT/hf4.log; tail -n 8 $OUT/hf4.log ;;
esac
case "$3" in hf*) for d in /tmp/hf4 /tmp/hf_share4_*; do [ -d $d ] || continue   # the logs only, not the checkpoints
  (cd $d && find . -name log.json -o -name env.txt | tar czf $OUT/$(basename $d)_logs.tgz -T -); done ;; esac
pack_out
