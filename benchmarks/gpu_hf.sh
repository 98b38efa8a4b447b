#!/usr/bin/env bash
# examples/train_hf.py on the GPUs of one host: ZeRO-3 and SDP4Bit through the Hugging Face Trainer, the same
# 200 steps, then a run stopped at step 100 and resumed. Needs transformers and accelerate on the machine:
# `pip install -e ".[hf]"`, or, without a package index there, wheels carried in $WHEELS
# (made elsewhere with `pip download "transformers>=5.24" "accelerate>=1.15" -d wheels`).
#   OUT=/tmp/out NPROC=2 bash benchmarks/gpu_hf.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sdp4bit_hf}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT"
if ! python3 -c "import transformers, accelerate" 2>/dev/null; then
  python3 -m pip install --no-index --find-links "${WHEELS:-wheels}" "transformers>=5.24" "accelerate>=1.15"
fi
python3 -m deepspeed_sdp4bit | tee "$OUT/env.txt"
run() {  # name config extra...
  local name=$1 cfg=$2; shift 2
  python3 -m torch.distributed.run --standalone --nproc_per_node "$NPROC" examples/train_hf.py \
      --ds-config "configs/$cfg" --out "$OUT/$name" --max-steps 200 --d-model 256 --layers 4 --heads 4 --seq 256 \
      --micro-batch 8 "$@" 2>&1 | grep -v "^\[rank" | tail -3
}
run zero3 zero3.json
run sdp4bit sdp4bit.json
run resume sdp4bit.json --stop-at 100
run resume sdp4bit.json --resume
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
L = {n: json.load(open(os.path.join(out, n, "log.json"))) for n in ("zero3", "sdp4bit", "resume")}
z, s, r = (L[n]["losses"] for n in ("zero3", "sdp4bit", "resume"))
print("max |sdp4bit - zero3| per step:", max(abs(s[k] - z[k]) for k in z))
print("max |resumed - uninterrupted| per step:", max(abs(r[k] - s[k]) for k in r))
for n, d in L.items():
    print(n, "held-out", d["eval_loss"], "reloaded", d.get("reloaded_eval_loss"))
PY
