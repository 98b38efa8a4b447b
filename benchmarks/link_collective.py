"""One rank of ``python -m benchmarks linkrate --collective`` (started by torchrun; on a GPU through
share_gpu.py, so every rank is its own NCCL host and all traffic is TCP through the link knob).

Per rate (``--rates``: set in turn through the preloaded shim's ``sdp4bit_link_set_gbps``, so one process group
measures them all; without ``--rates``: the process as it is, unshaped) and op (all-gather into one tensor,
all-to-all): one untimed call whose result is checked element by element against the other ranks' inputs
(regenerated from their seeds: the data went through intact), then timed calls (barrier, op, synchronize) until
``--seconds`` have passed (at least 3, the same count on every rank).  Rank 0 writes ``--out-json``: per rate and
op the median time over the calls (the slowest rank's median), the bytes each rank sends per call in a ring /
pairwise exchange, and the rate those bytes give.
"""

import argparse
import ctypes
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--mb", type=float, default=256.0, help="MiB each rank contributes per call")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--ops", nargs="+", default=["all_gather", "all_to_all"])
    ap.add_argument("--rates", nargs="*", type=float, default=None, help="Gb/s, set in turn through the shim")
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    set_rate = None
    if args.rates:
        try:
            set_rate = ctypes.CDLL(None).sdp4bit_link_set_gbps
        except AttributeError:
            raise SystemExit("link_collective.py: --rates needs the link shim preloaded (benchmarks/link.py)")
        set_rate.argtypes, set_rate.restype = [ctypes.c_double], ctypes.c_int
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        dev, dtype = torch.device("cpu"), torch.float32
    else:
        dev, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), torch.bfloat16
        torch.cuda.set_device(dev)
    esize = torch.tensor([], dtype=dtype).element_size()
    n = max(world, int(args.mb * 2 ** 20 / esize) // world * world)

    def data(r: int) -> torch.Tensor:  # rank r's input, random (never time on zeros)
        g = torch.Generator().manual_seed(1000 + r)
        return torch.randn(n, generator=g).to(dtype).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    x = data(rank)
    want = {"all_gather": torch.cat([data(r) for r in range(world)]),
            "all_to_all": torch.cat([data(r)[rank * (n // world):(rank + 1) * (n // world)] for r in range(world)])}
    result = {"world": world, "elements_per_rank": n, "dtype": str(dtype), "backend": dist.get_backend(),
              "by_rate": {}, "bytes_sent_all_ops": 0}
    for gbps in args.rates or [None]:
        if gbps is not None and set_rate(gbps) != 0:
            raise SystemExit(f"link_collective.py: the shim refused the rate {gbps}")
        ops = result["by_rate"][str(gbps)] = {}
        for op in args.ops:
            if op == "all_gather":
                out = torch.empty(world * n, dtype=dtype, device=dev)
                call = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
                sent = (world - 1) * n * esize  # ring: every rank forwards W - 1 chunks
            elif op == "all_to_all":
                out = torch.empty(n, dtype=dtype, device=dev)
                call = lambda: dist.all_to_all_single(out, x)  # noqa: E731
                sent = (world - 1) * (n // world) * esize
            else:
                raise SystemExit(f"unknown op {op!r}")
            dist.barrier()
            t0 = time.perf_counter()
            call()
            sync()
            first = time.perf_counter() - t0
            intact = bool(torch.equal(out, want[op]))  # what every rank had, regenerated from its seed
            iters = torch.tensor([max(3, math.ceil(args.seconds / max(first, 1e-6)))], device=dev)
            dist.all_reduce(iters, op=dist.ReduceOp.MAX)
            times = []
            for _ in range(int(iters.item())):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                call()
                sync()
                times.append(time.perf_counter() - t0)
            every = [None] * world
            dist.all_gather_object(every, {"median_s": statistics.median(times), "intact": intact})
            slow = max(e["median_s"] for e in every)
            calls = 1 + len(times)
            result["bytes_sent_all_ops"] += calls * sent
            ops[op] = {"calls": calls, "seconds": slow, "bytes_per_rank": sent, "bytes_sent_total": calls * sent,
                       "measured_gbps": sent * 8 / slow / 1e9, "intact": all(e["intact"] for e in every),
                       "median_s_per_rank": [e["median_s"] for e in every]}
    if rank == 0:
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
