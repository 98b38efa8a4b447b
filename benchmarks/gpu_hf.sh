#!/usr/bin/env bash
# examples/train_hf.py on the GPUs of one host: ZeRO-3 and SDP4Bit through the Hugging Face Trainer, the same
# 200 steps (STEPS), then a run stopped half-way and resumed. Needs transformers and accelerate on the machine:
# `pip install -e ".[hf]"`, or, without a package index there, wheels carried in $WHEELS
# (made elsewhere with `pip download "transformers>=5.24" "accelerate>=1.15" -d wheels`; installed with --no-deps into
# /tmp/site_hf, put first on PYTHONPATH here, all but torch*, triton*, nvidia* and numpy* wheels, which would shadow the
# machine's own torch).  Transformers >= 5.24 and accelerate >= 1.15 already importable are used as they are (their
# versions are printed and land in each run's log.json; the eighteenth session's GPU run used the image's 5.17, before
# this check).
#   OUT=/tmp/out NPROC=2 bash benchmarks/gpu_hf.sh
# RANKS_PER_GPU=N: N ranks share each GPU, each its own NCCL host (benchmarks/share_gpu.py; NPROC defaults to N x GPUs),
# so one GPU runs a multi-node job; GPUS_PER_NODE=G injects the topology (sdp4bit.topology.gpus_per_node) into the
# SDP4Bit runs, e.g. 4 ranks as 2 nodes x 2: both levels active (one node of 4 would leave SDP4Bit off).
# CONFIG=F (configs/F, default sdp4bit.json): the SDP4Bit config trained, stopped and resumed; COMPARE=F (default
# zero3.json): the config it is compared with step by step (an SDP4Bit one also gets GPUS_PER_NODE), e.g.
# CONFIG=sdp4bit_overlap.json COMPARE=sdp4bit.json: does the overlapped refresh change any loss under the Trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sdp4bit_hf}
STEPS=${STEPS:-200}
[ "$STEPS" -ge 2 ] || { echo "STEPS must be >= 2 (the resume check stops half-way)" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # required on multi-GPU hosts
RPG=${RANKS_PER_GPU:-1}
# (the GPUs this command may use: CUDA_VISIBLE_DEVICES's list where it is set, even empty, else every GPU of the host)
if [ -z "${NPROC:-}" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then NGPU=$(echo "$CUDA_VISIBLE_DEVICES" | tr , '\n' | { grep -c . || true; })
  else NGPU=$(nvidia-smi -L | wc -l); fi
  NPROC=$(( RPG * NGPU ))
fi
[ "$NPROC" -ge 1 ] || { echo "no GPU to run on (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-}'); set NPROC" >&2; exit 2; }
SHARE=(); [ "$RPG" -gt 1 ] && SHARE=(benchmarks/share_gpu.py)
TOPO=(); [ -n "${GPUS_PER_NODE:-}" ] && TOPO=(--ds-set "sdp4bit.topology.gpus_per_node=$GPUS_PER_NODE")
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site_hf${PYTHONPATH:+:$PYTHONPATH}
# (the versions setup.py's hf extra declares; an older install on the machine is shadowed by the carried wheels)
# (under a lock: two of these commands side by side would otherwise install into one folder at once)
( flock 9
  if ! python3 -c "import transformers as t, accelerate as a; from packaging.version import Version as V
assert V(t.__version__) >= V('5.24') and V(a.__version__) >= V('1.15')" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site_hf \
      $(ls "${WHEELS:-wheels}"/*.whl | grep -v -E '/(torch|triton|nvidia|numpy)[_-]')
  fi ) 9> /tmp/site_hf.lock
python3 -c "import transformers, accelerate; print('transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
python3 -m deepspeed_sdp4bit | tee "$OUT/env.txt"
run() {  # name config extra...
  local name=$1 cfg=$2; shift 2
  SDP4BIT_RANKS_PER_GPU=$RPG python3 -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "${SHARE[@]}" examples/train_hf.py \
      --ds-config "configs/$cfg" --out "$OUT/$name" --max-steps "$STEPS" --d-model 256 --layers 4 --heads 4 --seq 256 \
      --micro-batch 8 "$@" 2>&1 | { grep -v "^\[rank" || true; } | tail -3
}
CONFIG=${CONFIG:-sdp4bit.json}; COMPARE=${COMPARE:-zero3.json}
A=${CONFIG%.json}; B=${COMPARE%.json}
[ "$A" != "$B" ] && [ "$A" != resume ] && [ "$B" != resume ] ||
  { echo "CONFIG and COMPARE: two configs, neither named resume" >&2; exit 2; }
for c in "$CONFIG" "$COMPARE"; do [ -f "configs/$c" ] || { echo "no configs/$c" >&2; exit 2; }; done
BTOPO=(); [ "$COMPARE" != zero3.json ] && BTOPO=("${TOPO[@]}")
run "$B" "$COMPARE" "${BTOPO[@]}"
run "$A" "$CONFIG" "${TOPO[@]}"
run resume "$CONFIG" --stop-at $(( STEPS / 2 )) "${TOPO[@]}"
run resume "$CONFIG" --resume "${TOPO[@]}"
python3 - "$OUT" "$A" "$B" <<'PY'
import json, os, sys
out, a, b = sys.argv[1:]
L = {n: json.load(open(os.path.join(out, n, "log.json"))) for n in (b, a, "resume")}
z, s, r = (L[n]["losses"] for n in (b, a, "resume"))
print(f"max |{a} - {b}| per step:", max(abs(s[k] - z[k]) for k in z), "(identical)" if s == z else "")
print("max |resumed - uninterrupted| per step:", max(abs(r[k] - s[k]) for k in r))
for n, d in L.items():
    print(n, "held-out", d["eval_loss"], "reloaded", d.get("reloaded_eval_loss"))
PY
