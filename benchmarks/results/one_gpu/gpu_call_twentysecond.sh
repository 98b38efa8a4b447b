#!/bin/bash
# Twenty-second session's device calls (run from the repository root with .whl/ carried), any host (ovlab: 2 or more
# GPUs); MODES run in the order given (ovlab last), each skipped with a line when the budget is too short for it:
#   w1all  issue 20's world-size-1 goal, the 1.3B on EVERY GPU of the host side by side (gpu_call_fourteenth.sh's w1b
#          put the 406M on all but GPU 0), both build orders on each GPU, one paired process after the other: even
#          GPUs ZeRO-3's engine first, then SDP4Bit's; odd GPUs the other way round (e2e --paired --slow, 120 timed
#          steps each); meant for H100 hosts, where fewer than 3 runs of each order were on record; the second run
#          of a GPU starts only with 200 s left (after the session's calls: one started with 183 s and hit its
#          deadline at step 113)
#   ctest  the CUDA tests on GPU 0: the integration tests that need CUDA (the overlapped refresh against the refresh
#          inside step(), switched at run time; no host synchronization from SDP4Bit in a step), the CUDA kernels'
#          bit-exact tests and the environment report; output in ctest.txt
#   ovlab  gpu_call_twentyfirst.sh's ovlab (both overlap modes in one process) with this call's budget; MODELS, TOPS
#          and RATES pass through (e.g. TOPS="4x1 2x2" on a 4-GPU host whose 2x1 cells ran in an earlier call)
# usage: bash THIS COMMIT BUDGET_S MODE...
# Everything comes back as $OUT/results.tgz (the device returns at most 8 files).
commit=$1; budget=$2; shift 2
[ $# -ge 1 ] || { echo "usage: $0 COMMIT BUDGET_S w1all|ctest|ovlab..." >&2; exit 2; }
for m in "$@"; do case $m in w1all|ctest|ovlab) ;; *) echo "unknown mode $m (w1all, ctest, ovlab)" >&2; exit 2 ;; esac; done
case " $* " in *" ovlab "*) [ "${@: -1}" = ovlab ] || { echo "ovlab must be the last mode (it packs the results)" >&2; exit 2; } ;; esac
left() { local s=$((budget - SECONDS - $1)); [ $s -gt 0 ] || s=1; echo $s; }   # seconds to a margin before the budget
source benchmarks/results/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
G=$(nvidia-smi -L | wc -l)
build_kernels
for m in "$@"; do echo "== $m at $SECONDS s"; case $m in
w1all)
  [ $(left 0) -ge 240 ] || { echo "w1all not started: $(left 0) s left"; continue; }
  w1() {  # GPU CONFIGS...
    local g=$1; shift
    CUDA_VISIBLE_DEVICES=$g python3 -m benchmarks e2e --models 1.3B --topologies 1x1 --configs "$@" --paired --slow \
      --warmup 3 --timed 120 --timeout 240 --out $OUT/w1_1.3B_g${g}_$1 --deadline $(left 0) >> $OUT/w1_1.3B_g$g.log 2>&1
  }
  second() {  # GPU CONFIGS...: w1 where a whole run still fits
    if [ $(left 0) -ge 200 ]; then w1 "$@"; else echo "GPU $1: second run not started: $(left 0) s left"; fi
  }
  for g in $(seq 0 $((G - 1))); do
    if [ $((g % 2)) = 0 ]; then (w1 $g zero3 sdp4bit; second $g sdp4bit zero3) & else (w1 $g sdp4bit zero3; second $g zero3 sdp4bit) & fi
  done; wait; grep -h "\[e2e\].*wall" $OUT/w1_*.log ;;
ctest)
  [ $(left 0) -ge 60 ] || { echo "ctest not started: $(left 0) s left"; continue; }
  t=tests/test_integration.py
  CUDA_VISIBLE_DEVICES=0 timeout $(left 10) python3 -m pytest -q -p no:cacheprovider -rs \
    $t::test_overlap_on_cuda_matches_the_refresh_inside_step $t::test_no_host_synchronization_from_sdp4bit_in_a_step_on_cuda \
    tests/test_kernels_cuda.py tests/test_report.py::test_environment_report_names_versions_and_backends \
    > $OUT/ctest.txt 2>&1; echo "rc $?" >> $OUT/ctest.txt
  tail -n 4 $OUT/ctest.txt ;;
ovlab)
  [ $G -ge 2 ] || { echo "ovlab not run: it needs 2 or more GPUs, the host has $G"; continue; }
  # (the other script sources device_env.sh and builds again: both are no-ops the second time; it packs $OUT at its
  # end, so ovlab comes last)
  bash benchmarks/results/one_gpu/gpu_call_twentyfirst.sh $commit $(left 0) ovlab; exit ;;
esac; done
pack_out
