#!/bin/bash
# Twenty-third session's device calls (run from the repository root with .whl/ carried); MODES run in the order
# given, each skipped with a line when the budget is too short for it:
#   ctest   the CUDA integration tests on GPU 0 (4 NCCL ranks sharing it, each its own host): weights.overlap omitted
#           and decided by the engine's probe of the link (test_automatic_overlap_on_cuda), the overlap against the
#           refresh inside step(), no host synchronization from SDP4Bit in a step; output in ctest.txt
#   ovauto  the default config (configs/sdp4bit.json: weights.overlap omitted, so the engine's probe decides) as
#           logical nodes of this host (e2e --transport nodes, 4 x 4 NCCL sockets between nodes, the knob on them),
#           e2e --overlap-blocks 5 --warmup 10 --timed 60 --step-sync stream (as the twenty-second session's ovlab):
#           where the probe turned the overlap on, both modes timed in one process; where it left it off, the run
#           switches nothing and its row says why.  RUNS lists MODEL:TOPOLOGY:KNOB (default
#           "406M:2x1:5 1.3B:2x1:5 406M:2x1:off"; 4x1 and 2x2 need a host of 4 GPUs and are skipped on fewer)
# usage: bash THIS COMMIT BUDGET_S MODE...
# Everything comes back as $OUT/results.tgz (the device returns at most 8 files).
commit=$1; budget=$2; shift 2
[ $# -ge 1 ] || { echo "usage: $0 COMMIT BUDGET_S ctest|ovauto..." >&2; exit 2; }
for m in "$@"; do case $m in ctest|ovauto) ;; *) echo "unknown mode $m (ctest, ovauto)" >&2; exit 2 ;; esac; done
left() { local s=$((budget - SECONDS - $1)); [ $s -gt 0 ] || s=1; echo $s; }   # seconds to a margin before the budget
source benchmarks/results/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
G=$(nvidia-smi -L | wc -l)
build_kernels
for m in "$@"; do echo "== $m at $SECONDS s"; case $m in
ctest)
  [ $(left 0) -ge 60 ] || { echo "ctest not started: $(left 0) s left"; continue; }
  t=tests/test_integration.py
  CUDA_VISIBLE_DEVICES=0 timeout $(left 10) python3 -m pytest -q -p no:cacheprovider -rs \
    $t::test_automatic_overlap_on_cuda $t::test_overlap_on_cuda_matches_the_refresh_inside_step \
    $t::test_no_host_synchronization_from_sdp4bit_in_a_step_on_cuda > $OUT/ctest.txt 2>&1; echo "rc $?" >> $OUT/ctest.txt
  tail -n 4 $OUT/ctest.txt ;;
ovauto)
  i=0
  for spec in ${RUNS:-406M:2x1:5 1.3B:2x1:5 406M:2x1:off}; do i=$((i + 1))
    IFS=: read -r mdl t r <<< "$spec"
    need=150; [ $mdl = 1.3B ] && need=200
    [ $(left 0) -ge $need ] || { echo "run $i ($spec) not started: $(left 0) s left"; continue; }
    ng=2; [ $t = 2x1 ] || ng=4
    [ $G -ge $ng ] || { echo "run $i ($spec) skipped: $t needs $ng GPUs, the host has $G"; continue; }
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ng - 1))) python3 -m benchmarks e2e --transport nodes --models $mdl \
      --topologies $t --configs sdp4bit --overlap-blocks 5 --link-gbps $r --nccl-sockets 4x4 --probe-link \
      --warmup 10 --timed 60 --timeout 200 --step-sync stream --out $OUT/ovauto$i --deadline $(left 0) \
      > $OUT/ovauto$i.log 2>&1
    grep "\[e2e\]" $OUT/ovauto$i.log
    python3 -c "import glob, json, sys
for f in glob.glob(sys.argv[1] + '/e2e_*.json'):
    for r in json.load(open(f))['rows']:
        if 'overlap_choice' in r or 'overlap_ab' in r:
            print('  choice', r.get('model'), r.get('topology'), r.get('link_gbps'), r.get('overlap_choice'),
                  r.get('overlap_ab_error') or '')" $OUT/ovauto$i
  done ;;
esac; done
pack_out
