#!/usr/bin/env bash
# End-to-end runs on the lent GPU machine (2 GPUs): what benchmarks/results/README.md reports.
#
#   bash benchmarks/gpu_e2e.sh parity      # ZeRO-3 vs SDP4Bit loss per step + collectives alone
#   bash benchmarks/gpu_e2e.sh throughput nvlink sockets   # 406M GPT, ZeRO-3 / ZeRO++ / SDP4Bit, 2 GPUs as 2 x 1
#
# Results go to $OUT (the device tool brings them back) or ./runs when OUT is unset: each phase's summary.json
# and one tar.gz of all its per-run logs (the device tool brings back at most 8 files).
# BACKEND=cuda|triton|torch|auto (default auto) picks the sdp4bit kernel backend of every run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs}
WORK=$(mktemp -d /tmp/sdp4bit_e2e.XXXX)
mkdir -p "$OUT"
pack() {  # summary.json of each phase under $OUT, the per-run logs as one archive
  for d in "$WORK"/*/; do
    name=$(basename "$d")
    cp "$d/summary.json" "$OUT/${name}_summary.json" 2>/dev/null
    tar -czf "$OUT/${name}_logs.tar.gz" -C "$WORK" "$name"
  done
}
trap pack EXIT
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
# NVLink multicast must stay off on these machines; DeepSpeed 0.19.8's op_builder cannot parse "9.0a".
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=32 PYTHONUNBUFFERED=1
# our own extension builds for sm_90a (and shares its cache with benchmarks/gpu_kernel_check.sh)
export SDP4BIT_CUDA_ARCH_LIST=${SDP4BIT_CUDA_ARCH_LIST:-9.0a} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"

phase=${1:-parity}
BACKEND=${BACKEND:-auto}
# the config's automatic choice is the omitted key ("auto" is refused in the sdp4bit block: accelerate reserves it)
BACKEND_SET=()
[ "$BACKEND" != auto ] && BACKEND_SET=(--sdp4bit-set "kernel_backend=\"$BACKEND\"")
case "$phase" in
parity)
  # a named backend that cannot run fails here, before any training starts (cuda: the JIT build happens here)
  python3 -c "
import torch
from deepspeed_sdp4bit import ops
print('requested backend:', ops.get_backend('$BACKEND', 'cuda').name)
" 2>&1 | tail -3
  python3 benchmarks/run_matrix.py --configs zero3 sdp4bit --topologies 2x1 1x2 --transports nvlink \
      "${BACKEND_SET[@]}" --out "$WORK/parity" --timeout 280 -- --d-model 256 --layers 4 --heads 4 --seq 256 --micro-batch 8 \
      --steps 150 --lr 1e-3 --warmup 10 --eval-every 0 --eval-batches 8 --torch-adam yes \
      --ds-set zero_optimization.stage3_param_persistence_threshold=0 2>&1 | grep -v "^\[rank" | tail -8
  for t in nvlink sockets; do
    env_t=""
    [ "$t" = sockets ] && env_t="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
    env $env_t SDP4BIT_TRANSPORT=$t timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        benchmarks/bench_collectives.py --gpus-per-node 1 --backend "$BACKEND" --sizes-mb 25 100 400 --iters 5 \
        --out "$OUT/collectives_$t.json" 2>&1 | grep -v "^\[rank\|Warning\|warn" | tail -5
  done
  ;;
throughput)
  shift
  # CONFIGS="zero3 sdp4bit" skips ZeRO++ (and its 75 s quantizer build) for a quick re-measure
  python3 benchmarks/run_matrix.py --configs ${CONFIGS:-zero3 zeropp sdp4bit} --topologies 2x1 --transports "${@:-nvlink}" \
      "${BACKEND_SET[@]}" --out "$WORK/throughput" --timeout 170 -- --d-model 1024 --layers 24 --heads 16 --seq 1024 \
      --micro-batch 4 --steps 20 --random-tokens --eval-batches 0 --torch-adam yes 2>&1 \
      | grep -v "^\[rank" | tail -8
  ;;
*)
  echo "unknown phase $phase (parity | throughput TRANSPORT)"; exit 2 ;;
esac
