# Sourced by every device-call script (run from the repository root with .whl/ carried, as ../shared/device.md
# says): installs the wheels, sets the environment every command there needs, and defines the two steps the
# scripts share.  Needs $commit (the commit the rows record) set before it is sourced.
# (once per machine and set of wheels, by their checksums, under a lock: a second install would replace packages
# another job of the same call may be importing)
( flock 9
  sha256sum .whl/*.whl > /tmp/site_wheels.new || exit 1
  cmp -s /tmp/site_wheels.new /tmp/site/.wheels 2>/dev/null && exit 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && mv /tmp/site_wheels.new /tmp/site/.wheels ) 9> /tmp/site.lock || exit 1
export PYTHONPATH=/tmp/site:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=32 PYTHONUNBUFFERED=1 SDP4BIT_CUDA_ARCH_LIST=9.0a TORCH_EXTENSIONS_DIR=/tmp/torch_extensions SDP4BIT_COMMIT=${commit:?set commit before sourcing device_env.sh}
# a build killed by an earlier call's deadline leaves its lock behind, and the next build would wait on it forever
find /tmp/torch_extensions -name lock -delete 2>/dev/null
# left MARGIN: the seconds from now to MARGIN before the call's budget ($budget, set by the calling script), at least 1
left() { local s=$((budget - SECONDS - $1)); [ $s -gt 0 ] || s=1; echo $s; }
# gpus: the host's GPUs (name, memory) printed, their count in $G
gpus() { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; G=$(nvidia-smi -L | wc -l); }
# build_kernels [LOG]: JIT-build the CUDA ops once (runs side by side would each start the build), print the build's
# last line (the whole output to LOG if given) and the script's clock
build_kernels() {
  local log=${1:-/tmp/sdp4bit_build.txt} lines=1; [ -n "$1" ] && lines=2
  python3 -c "from deepspeed_sdp4bit import _native; _native.load_extension()" > "$log" 2>&1
  tail -n $lines "$log"; echo "built at $SECONDS s"
}
# pack_out: everything under $OUT into $OUT/results.tgz (the device returns at most 8 files); packed outside $OUT and
# moved in, since a tar written into the folder it reads fails with "file changed"
pack_out() { tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tgz "$OUT"/; }
