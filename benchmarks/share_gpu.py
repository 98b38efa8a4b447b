"""Run a script as one rank of a logical host that NCCL sees as its own machine.

torchrun starts ``python benchmarks/share_gpu.py SCRIPT ARGS...`` once per rank; before SCRIPT (and torch) is
imported this sets the rank's environment from torchrun's LOCAL_RANK and one of two settings:

``SDP4BIT_RANKS_PER_GPU`` = N (several ranks share a GPU)::

    NCCL_HOSTID=fakehost$LOCAL_RANK   CUDA_VISIBLE_DEVICES=<visible GPU LOCAL_RANK // N>
    LOCAL_RANK=0   LOCAL_WORLD_SIZE=1   LOCAL_SIZE=1

so NCCL treats every rank as its own host (two ranks with one host id on one GPU are refused) and carries all
traffic over sockets, and DeepSpeed counts one GPU per node (ZeRO++'s qgZ is active; hpZ must be 1).
Compute of the N ranks of one GPU is serialized: a step's no-communication bound is N x the world-1 step.

``SDP4BIT_GPUS_PER_HOST`` = G (one rank per GPU, G GPUs per logical node)::

    NCCL_HOSTID=fakenode$((LOCAL_RANK / G))   CUDA_VISIBLE_DEVICES=<the node's G visible GPUs>
    LOCAL_RANK=$((LOCAL_RANK % G))   LOCAL_WORLD_SIZE=G   LOCAL_SIZE=G

so the ranks of one logical node reach each other over NVLink (same host id) and other nodes over sockets
(NCCL's network transport, where the link knob can shape it), and DeepSpeed counts G GPUs per node (ZeRO++'s
hpZ = G and qgZ across nodes are what they would be on a real cluster of such nodes).
"""

import os
import runpy
import sys
from typing import Dict, Optional


def rank_env(local: int, ranks_per_gpu: int, gpus_per_host: Optional[int],
             visible: Optional[str]) -> Dict[str, str]:
    """The environment of local rank ``local`` (see the module docstring); ValueError on a bad setting."""
    devices = visible.split(",") if visible else [str(i) for i in range(64)]
    if gpus_per_host is not None:
        if ranks_per_gpu != 1:
            raise ValueError("SDP4BIT_GPUS_PER_HOST (one rank per GPU) and SDP4BIT_RANKS_PER_GPU > 1 exclude "
                             "each other")
        if gpus_per_host < 1:
            raise ValueError(f"SDP4BIT_GPUS_PER_HOST must be >= 1, got {gpus_per_host}")
        node, idx = divmod(local, gpus_per_host)
        mine = devices[node * gpus_per_host:(node + 1) * gpus_per_host]
        if len(mine) < gpus_per_host:
            raise ValueError(f"local rank {local} with {gpus_per_host} GPUs per host needs GPUs "
                             f"{node * gpus_per_host}..{(node + 1) * gpus_per_host - 1}, only {len(devices)} "
                             "visible")
        g = str(gpus_per_host)
        return {"NCCL_HOSTID": f"fakenode{node}", "CUDA_VISIBLE_DEVICES": ",".join(mine),
                "LOCAL_RANK": str(idx), "LOCAL_WORLD_SIZE": g, "LOCAL_SIZE": g}
    if ranks_per_gpu < 1:
        raise ValueError(f"SDP4BIT_RANKS_PER_GPU must be >= 1, got {ranks_per_gpu}")
    if local // ranks_per_gpu >= len(devices):
        raise ValueError(f"local rank {local} with {ranks_per_gpu} ranks per GPU needs GPU "
                         f"{local // ranks_per_gpu}, only {len(devices)} visible")
    return {"NCCL_HOSTID": f"fakehost{local}", "CUDA_VISIBLE_DEVICES": devices[local // ranks_per_gpu],
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "LOCAL_SIZE": "1"}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: share_gpu.py SCRIPT [ARGS...] (started by torchrun, one process per rank)")
    host = os.environ.get("SDP4BIT_GPUS_PER_HOST")
    try:
        env = rank_env(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("SDP4BIT_RANKS_PER_GPU", "1")),
                       int(host) if host else None, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as e:
        raise SystemExit(f"share_gpu.py: {e}")
    os.environ.update(env)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
