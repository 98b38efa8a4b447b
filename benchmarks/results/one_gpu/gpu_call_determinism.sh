#!/bin/bash
# Issue 21: does `accuracy --deterministic` (torch's deterministic algorithms) make a repeat of one run give the same
# losses on a GPU?  The 86M, seed 1, constant lr, 40 steps, 4 ranks on one GPU, each config twice, one process after
# the other (repeats of one seed differed by 0.1-2.6% at their last common step without it): the ZeRO-3 replay
# ("zero3"), then SDP4Bit 2x2 after the kernel build ("sdp4bit").  Run at 79adf81 on one H100 in three calls (the
# replay's second run, skipped by the first call's deadline, sent again alone; then the SDP4Bit part).
# usage: bash THIS COMMIT BUDGET_S [zero3|sdp4bit|both]
commit=$1; budget=$2; what=${3:-both}
source benchmarks/results/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
twice() {  # CONFIG OUTPREFIX
  for i in 1 2; do
    python3 -m benchmarks accuracy --share-gpu --deterministic --topologies 2x2 --configs $1 --seeds 1 --steps 40 --schedules constant --out $OUT/$2$i --deadline $((budget-SECONDS)) 2>&1 | grep "\[accuracy\].*: "
  done
}
case "$what" in zero3|both) twice zero3:replay d ;; esac
case "$what" in sdp4bit|both)
  build_kernels
  twice sdp4bit s ;; esac
pack_out
