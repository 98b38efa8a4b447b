"""Collectives alone: SDP4Bit gradient reduce-scatter and weight refresh vs NCCL bf16, per bucket size.

Run through the suite (``python -m benchmarks collectives --topology 2x1 --out DIR``, which also shares GPUs
with ``--ranks-per-gpu``), or launch one process per GPU, e.g. on 2 GPUs acting as 2 logical nodes of 1 GPU:

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_collectives.py --gpus-per-node 1 \
        --sizes-mb 25 100 400 --out results.json

and add ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` in front for the socket-only transport (every communicator
of the process is then slow, the intra-node level too).  Sizes are bf16 bucket bytes per rank.  Each
measurement is the median of ``--iters`` timed calls after ``--warmup`` calls, bracketed by a barrier and a
device synchronize, on random normal data (never zeros).
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def _timeit(fn, warmup, iters, device):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus-per-node", type=int, required=True)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[25, 100, 400, 1000])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", default="auto", help="sdp4bit kernel backend")
    ap.add_argument("--transport", default=os.environ.get("SDP4BIT_TRANSPORT", "default"),
                    help="label stored with the results (the NCCL env variables decide the real transport)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from deepspeed_sdp4bit.collectives.gradients import GradientReducer
    from deepspeed_sdp4bit.collectives.weights import WeightDeltaAllGather
    from deepspeed_sdp4bit.config import parse_block
    from deepspeed_sdp4bit.topology import Topology

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology.build(args.gpus_per_node)
    cfg = parse_block({} if args.backend == "auto" else {"kernel_backend": args.backend})   # "auto": key omitted
    reducer = GradientReducer(topo, cfg.gradients, cfg.seed, backend=args.backend)
    wsync = WeightDeltaAllGather(topo, cfg.weights, cfg.seed, backend=args.backend, level="full")
    rows = []
    for mb in args.sizes_mb:
        n = int(mb * 2**20 / 2) // (world * 2048) * (world * 2048)  # bf16 elements, group aligned
        shard = n // world
        g = torch.Generator(device=device).manual_seed(1000 + rank)
        grads = torch.randn(n, device=device, dtype=torch.bfloat16, generator=g)
        out = torch.empty(shard, device=device, dtype=torch.bfloat16)
        full = torch.empty(n, device=device, dtype=torch.bfloat16)
        own = torch.randn(shard, device=device, generator=g).to(torch.bfloat16)
        master = own.float() + 1e-3 * torch.randn(shard, device=device, generator=g)
        # full-level refresh: every source's partition lands in one contiguous slice of a full replica
        dst = {s: [(full[s * shard:(s + 1) * shard], 0)] for s in wsync.sources_needed()}
        row = {"bucket_mb": mb, "elements": n, "world": world, "gpus_per_node": args.gpus_per_node,
               "transport": args.transport}
        row["nccl_reduce_scatter_ms"] = _timeit(
            lambda: dist.reduce_scatter_tensor(out, grads), args.warmup, args.iters, device)
        reducer.stats.reset()
        row["sdp4bit_reduce_scatter_ms"] = _timeit(
            lambda: reducer.reduce_scatter_flat(grads), args.warmup, args.iters, device)
        row["sdp4bit_reduce_scatter_bytes"] = reducer.stats.as_dict()
        row["nccl_all_gather_ms"] = _timeit(
            lambda: dist.all_gather_into_tensor(full, own), args.warmup, args.iters, device)
        wsync.stats.reset()
        row["sdp4bit_weight_refresh_ms"] = _timeit(
            lambda: wsync.refresh(master, own, dst, step=0), args.warmup, args.iters, device)
        row["sdp4bit_weight_refresh_bytes"] = wsync.stats.as_dict()
        rows.append(row)
        if rank == 0:
            print(f"{mb:7.0f} MB  RS nccl {row['nccl_reduce_scatter_ms']:8.2f} ms  sdp4bit "
                  f"{row['sdp4bit_reduce_scatter_ms']:8.2f} ms | AG nccl {row['nccl_all_gather_ms']:8.2f} ms  "
                  f"qWD {row['sdp4bit_weight_refresh_ms']:8.2f} ms", flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "rows": rows}, f,
                      indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
