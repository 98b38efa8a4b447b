#!/bin/bash
# The runs of findings.md's rule for moving weights.overlap_below_gbps from 6 to 12 (twenty-fourth session, "A rule
# for moving the threshold", set before any run of it; run in the twenty-fifth session, findings.md has the
# verdict).  Run from the repository root with .whl/ carried.  MODES, in the order given, each skipped with a line
# when the budget is too short:
#   thr12  logical nodes of this host (e2e --transport nodes, 4 x 4 NCCL sockets between nodes, the knob on them):
#          in one e2e process per cell the default (weights.overlap omitted: its row records the engine's probe
#          reading, the rule's criterion; with the threshold at 6 it switches nothing where the probe reads more) and
#          sdp4bit_overlap (forced on), both with --overlap-blocks 5 --warmup 10 --timed 60 --step-sync stream.
#          RUNS lists MODEL:TOPOLOGY:KNOB (default "406M:2x1:10 1.3B:2x1:10"; 4x1 and 2x2 need 4 GPUs and are skipped
#          on fewer).  A cell counts for the rule only where the default's probe read 8-12 Gb/s; if it read outside,
#          run the cell again at another knob setting (the knob does not pin the rate above 5 Gb/s).
# usage: bash THIS COMMIT BUDGET_S thr12
# Everything comes back as $OUT/results.tgz (the device returns at most 8 files).
commit=$1; budget=$2; shift 2
[ $# -ge 1 ] || { echo "usage: $0 COMMIT BUDGET_S thr12" >&2; exit 2; }
for m in "$@"; do case $m in thr12) ;; *) echo "unknown mode $m (thr12)" >&2; exit 2 ;; esac; done
source benchmarks/results/device_env.sh   # (left, gpus, build_kernels, pack_out)
gpus; build_kernels
for m in "$@"; do echo "== $m at $SECONDS s"; case $m in
thr12)
  i=0
  for spec in ${RUNS:-406M:2x1:10 1.3B:2x1:10}; do i=$((i + 1))
    IFS=: read -r mdl t r <<< "$spec"
    need=260; [ $mdl = 1.3B ] && need=330
    [ $(left 0) -ge $need ] || { echo "run $i ($spec) not started: $(left 0) s left"; continue; }
    ng=2; [ $t = 2x1 ] || ng=4
    [ $G -ge $ng ] || { echo "run $i ($spec) skipped: $t needs $ng GPUs, the host has $G"; continue; }
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ng - 1))) python3 -m benchmarks e2e --transport nodes --models $mdl \
      --topologies $t --configs sdp4bit sdp4bit_overlap --overlap-blocks 5 --link-gbps $r --nccl-sockets 4x4 \
      --probe-link --warmup 10 --timed 60 --timeout 200 --step-sync stream --out $OUT/thr$i --deadline $(left 0) \
      > $OUT/thr$i.log 2>&1
    grep "\[e2e\]" $OUT/thr$i.log
    python3 -c "import glob, json, sys
for f in glob.glob(sys.argv[1] + '/e2e_*.json'):
    for r in json.load(open(f))['rows']:
        ab, ch = r.get('overlap_ab') or {}, r.get('overlap_choice') or {}
        print('  ', r.get('model'), r.get('topology'), r.get('config'), r.get('link_gbps'), 'probe', ch.get('gbps'),
              'on' if ch.get('on') else 'off', 'ratio', ab.get('cycle_ratio'), r.get('overlap_ab_error') or '')" \
      $OUT/thr$i
  done ;;
esac; done
pack_out
