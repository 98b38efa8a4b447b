"""Run a script as one of several ranks that share a GPU, each rank acting as its own host.

torchrun starts ``python benchmarks/share_gpu.py SCRIPT ARGS...`` once per rank; before SCRIPT (and torch) is
imported this sets, from torchrun's LOCAL_RANK and ``SDP4BIT_RANKS_PER_GPU`` (N)::

    NCCL_HOSTID=fakehost$LOCAL_RANK   CUDA_VISIBLE_DEVICES=<visible GPU LOCAL_RANK // N>
    LOCAL_RANK=0   LOCAL_WORLD_SIZE=1   LOCAL_SIZE=1

so NCCL treats every rank as its own host (two ranks with one host id on one GPU are refused) and carries all
traffic over sockets, and DeepSpeed counts one GPU per node (ZeRO++'s qgZ is active; hpZ must be 1).
Compute of the N ranks of one GPU is serialized: a step's no-communication bound is N x the world-1 step.
"""

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: share_gpu.py SCRIPT [ARGS...] (started by torchrun, one process per rank)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    per = int(os.environ.get("SDP4BIT_RANKS_PER_GPU", "1"))
    if per < 1:
        raise SystemExit(f"share_gpu.py: SDP4BIT_RANKS_PER_GPU must be >= 1, got {per}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(64)]
    if local // per >= len(devices):
        raise SystemExit(f"share_gpu.py: local rank {local} with {per} ranks per GPU needs GPU {local // per}, "
                         f"only {len(devices)} visible")
    os.environ.update({"NCCL_HOSTID": f"fakehost{local}", "CUDA_VISIBLE_DEVICES": devices[local // per],
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "LOCAL_SIZE": "1"})
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
