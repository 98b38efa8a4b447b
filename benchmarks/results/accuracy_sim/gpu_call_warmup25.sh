#!/bin/bash
# Issue 21, planned in the twelfth session (not run yet): under the 25-step warm-up of gpu_86m_500.json the 4-bit
# gradients cost loss right after the lr peak (the reports' "when the gap opens" table); does sending the node sums
# at 8 bits for the first 100 steps only (sdp4bit_inter8_first100) remove that cost?  ZeRO-3 again (a machine other
# than an H200 of this software gives other deterministic trajectories), the shipped config and the variant at 2x2
# and 4x1, data seeds 1-6: 30 processes, dealt over the host's GPUs.  usage: bash THIS COMMIT BUDGET_S first100
W="--warmup 25 --min-lr-ratio 0.1"; jobs=()
case "$3" in
first100)
  for s in 1 2 3 4 5 6; do
    jobs+=("--variants zero3 --topologies 2x2 --data-seeds $s $W")
    for t in 2x2 4x1; do for v in sdp4bit sdp4bit_inter8_first100; do jobs+=("--variants $v --topologies $t --data-seeds $s $W"); done; done
  done ;;
*) echo "usage: $0 COMMIT BUDGET_S first100" >&2; exit 2 ;;
esac
exec bash "$(dirname "$0")/gpu_call.sh" "$1" "$2" "${jobs[@]}"
