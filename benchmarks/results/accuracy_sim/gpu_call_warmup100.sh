#!/bin/bash
# Issue 21, tenth session: the 86M GPT with a 100-step warm-up (the 25-step one spiked in some seeds and the spikes
# decided the 500-step gaps), 8 data seeds of ZeRO-3 and SDP4Bit (2x2, 4x1), 4 of the fp32-sum floor and of 8 bits
# between nodes: 32 processes, 8 per GPU of a 4-GPU host.  usage: bash THIS COMMIT BUDGET_S
W="--warmup 100 --min-lr-ratio 0.1"; jobs=()
for s in 1 2 3 4 5 6 7 8; do for v in "zero3 --topologies 2x2" "sdp4bit --topologies 2x2" "sdp4bit --topologies 4x1"; do jobs+=("--variants $v --data-seeds $s $W"); done; done
for s in 1 2 3 4; do jobs+=("--variants zero3_fp32 --topologies 2x2 --data-seeds $s $W" "--variants sdp4bit_inter8 --topologies 2x2 --data-seeds $s $W"); done
exec bash "$(dirname "$0")/gpu_call.sh" "$1" "$2" "${jobs[@]}"
