#!/bin/bash
# Issue 21's constant-lr runs (thirteenth session): the 86M GPT of gpu_86m_500.json, 500 steps at lr 6e-4 from
# step 0 (no warm-up, no decay): ZeRO-3, the shipped config and sdp4bit_inter8_first100 at 2x2 and 4x1, data
# seeds 1-6: 30 processes dealt over the host's GPUs.  usage: bash THIS COMMIT BUDGET_S
W="--warmup 0 --min-lr-ratio 1.0"; jobs=()
for s in 1 2 3 4 5 6; do
  jobs+=("--variants zero3 --topologies 2x2 --data-seeds $s $W")
  for t in 2x2 4x1; do for v in sdp4bit sdp4bit_inter8_first100; do jobs+=("--variants $v --topologies $t --data-seeds $s $W"); done; done
done
exec bash "$(dirname "$0")/gpu_call.sh" "$1" "$2" "${jobs[@]}"
