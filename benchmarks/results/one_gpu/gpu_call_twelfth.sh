#!/bin/bash
# Twelfth session's device calls on a 4-GPU host (run from the repository root with .whl/ carried):
#   paired  issue 20's 1% goals where SDP4Bit is off (world size 1; one node of 4 GPUs on NVLink), each pair of
#           configs timed in ONE process, steps alternating (e2e --paired), the last 3 steps profiled
#   nvlink  issue 23's fast end: 406M 2x2 on NVLink (no link knob), ZeRO++, SDP4Bit and ZeRO-3, twice
#   long    the paired world-1 runs with 300 timed steps (40 left the 1% goal unresolved), then 1.3B 1x4 with 200
#   w1x4    (thirteenth session) issue 20's world-size-1 1.3B goal alone: one paired process per GPU, 400 timed
#           steps each (the goals table pools a cell's paired runs on one machine kind)
#   w1x4r   the same with the engines built in the other order (SDP4Bit's first) and 300 timed steps: w1x4's four
#           runs all had ZeRO-3's engine built first, so a build-order effect would look like SDP4Bit's cost
#           (M=406M before the command: the 406M instead of the 1.3B)
#   w1x4b   (planned, not run) both orders in one call, 300 timed steps: GPUs 0 and 3 ZeRO-3's engine built first, 1
#           and 2 SDP4Bit's, so each order has a GPU in each half of the host (w1x4 and w1x4r ran in different calls,
#           whose host conditions differed); the GPU topology is logged
#   nvr     (planned, not run) one node of 4 GPUs on NVLink, 406M and 1.3B paired with SDP4Bit's engine built first,
#           200 timed steps each: the 1x4 cells have runs of the other order only
# usage: bash THIS COMMIT BUDGET_S paired|nvlink|long|w1|w1x4|w1x4r|w1x4b|nvr   (w1: paired's world-1 part alone)
# Everything comes back as $OUT/results.tgz (the device returns at most 8 files).  The first call of the session
# returned 8 of its files: the world-1 part was run again (w1), so its 1x4 rows are those of the first call.
commit=$1; budget=$2
source benchmarks/results/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T=40; [ "$3" = long ] && T=300
P="--paired --slow --warmup 3 --timed $T --profile-steps 3"
[ "$3" = long ] && P="--paired --slow --warmup 3 --timed $T"
case "$3" in
paired|w1|long)
  # world size 1: the two models at once, each on its own GPU (steps alternate inside each process)
  CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks e2e --models 406M --topologies 1x1 --configs zero3 sdp4bit $P --timeout 400 --out $OUT/w1_406M --deadline $((budget-SECONDS)) > $OUT/w1_406M.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 -m benchmarks e2e --models 1.3B --topologies 1x1 --configs zero3 sdp4bit $P --timeout 400 --out $OUT/w1_1.3B --deadline $((budget-SECONDS)) > $OUT/w1_1.3B.log 2>&1 &
  wait; grep "\[e2e\]" $OUT/w1_*.log
  [ "$3" = paired ] && for m in 406M 1.3B; do python3 -m benchmarks e2e --transport nvlink --models $m --topologies 1x4 --configs zero3 sdp4bit $P --timeout 200 --out $OUT/n_$m --deadline $((budget-SECONDS)) 2>&1 | grep "\[e2e\]"; done
  [ "$3" = long ] && python3 -m benchmarks e2e --transport nvlink --models 1.3B --topologies 1x4 --configs zero3 sdp4bit ${P/--timed $T/--timed 200} --timeout 240 --out $OUT/n_1.3B --deadline $((budget-SECONDS)) 2>&1 | grep "\[e2e\]" ;;
w1x4|w1x4r|w1x4b)
  C="zero3 sdp4bit"; N=400; [ "$3" = w1x4r ] && C="sdp4bit zero3" && N=300; [ "$3" = w1x4b ] && N=300
  [ "$3" = w1x4b ] && nvidia-smi topo -m
  for g in 0 1 2 3; do [ "$3" = w1x4b ] && case $g in 1|2) C="sdp4bit zero3";; *) C="zero3 sdp4bit";; esac
    CUDA_VISIBLE_DEVICES=$g python3 -m benchmarks e2e --models ${M:-1.3B} --topologies 1x1 --configs $C --paired --slow --warmup 3 --timed $N --timeout 450 --out $OUT/w1_${M:-1.3B}_g$g --deadline $((budget-SECONDS)) > $OUT/w1_${M:-1.3B}_g$g.log 2>&1 & done
  wait; grep "\[e2e\]" $OUT/w1_*.log ;;
nvr)
  for m in 406M 1.3B; do python3 -m benchmarks e2e --transport nvlink --models $m --topologies 1x4 --configs sdp4bit zero3 --paired --slow --warmup 3 --timed 200 --timeout 240 --out $OUT/nr_$m --deadline $((budget-SECONDS)) 2>&1 | grep "\[e2e\]"; done ;;
nvlink)
  python3 -c "from deepspeed.ops.op_builder import QuantizerBuilder; QuantizerBuilder().load()" > /tmp/dsq.txt 2>&1 & q=$!; build_kernels; wait $q; tail -1 /tmp/dsq.txt; echo "both built at $SECONDS s"
  for i in 1 2; do python3 -m benchmarks e2e --transport nvlink --models 406M --topologies 2x2 --configs zeropp sdp4bit zero3 --slow --timed 12 --timeout 90 --out $OUT/nv --deadline $((budget-SECONDS)) 2>&1 | grep "\[e2e\]"; done ;;
*) echo "usage: $0 COMMIT BUDGET_S paired|nvlink|long|w1|w1x4|w1x4r|w1x4b|nvr" >&2; exit 2 ;;
esac
pack_out
