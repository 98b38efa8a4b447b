"""``python -m benchmarks collectives``: the quantized collectives alone.

``--layout gpt`` (one process, one GPU): the qWD weight refresh of one rank on DeepSpeed's real per-parameter
partition layout of a GPT.  The model is built on the meta device; each parameter's partition is
``ceil(numel / W)`` elements (DeepSpeed pads a parameter to a multiple of W and splits it evenly), the flat
partition of a sub-group concatenates them in ``model.parameters()`` order (sub-groups as
``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups`` cuts them, ``--sub-group-size``), and the destination
segment plans are the ones the engine's replica object builds (``integration._Replica.sub_group``: one flat
buffer per sub-group holding the full parameters at ``full``, the hpZ secondary tensors at ``node``).  The exchange is replaced by rows quantized beforehand
from random data (one per source), so what is timed is ``WeightDeltaAllGather.refresh`` minus the network:
the owner's quantize-and-update and the application of every kept source to its views.  Reported: ms per
refresh (median of ``--iters``, CUDA events; the master moves by a little noise between iterations, outside
the timed region), the bytes the refresh touches (owner: fp32 master + bf16 replica read, replica written,
payload written; each kept source: payload read, its views read and written), GB/s on those bytes, and the
same bytes as a device-to-device copy (``copy_``, read + write) for the ceiling.  ``--compare-aligned`` adds
the same partition applied as one group-aligned view per source (the fused fast path).

Without ``--layout`` it runs benchmarks/bench_collectives.py on ``--topology``'s ranks (torchrun; with
``--ranks-per-gpu`` several ranks share a GPU as in e2e): gradient reduce-scatter and weight refresh of flat
buckets against NCCL bf16.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import types
from pathlib import Path

from . import suite


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=("gpt",), default=None, help="the weight refresh on a GPT's real layout")
    p.add_argument("--model", default="1.3B", choices=sorted(suite.MODELS))
    p.add_argument("--topology", default="4x1", help="NODESxGPUS whose layout is simulated / whose ranks run")
    p.add_argument("--replica", choices=("full", "node"), default="full")
    p.add_argument("--rank", type=int, default=0, help="(layout) the data-parallel rank simulated")
    p.add_argument("--backend", default="auto", help="sdp4bit kernel backend")
    p.add_argument("--sub-group-size", type=int, default=10 ** 9, help="zero_optimization.sub_group_size")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compare-aligned", action="store_true", help="also time one aligned view per source")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[25, 100, 400], help="(flat) bucket sizes")
    p.add_argument("--ranks-per-gpu", type=int, default=1)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=400.0)


# ------------------------------------------------------------------------------------------- layout

def gpt_layout(model: str, world: int, sub_group_size: int):
    """[(name, numel, partition_numel)] per sub-group of the GPT ``model`` partitioned over ``world`` ranks."""
    import torch

    sys.path.insert(0, str(suite.REPO / "examples"))
    from gpt import GPT, GPTConfig

    shape = suite.MODELS[model]
    with torch.device("meta"):
        m = GPT(GPTConfig(vocab=50304, seq_len=1024, d_model=shape["d_model"], n_layers=shape["layers"],
                          n_heads=shape["heads"]))
    params = [(n, p.numel(), math.ceil(p.numel() / world)) for n, p in m.named_parameters()]
    total = sum(P for _, _, P in params)
    if sub_group_size >= total:
        return [params]
    groups, cur, size = [], [], 0
    for i, item in enumerate(params):  # DeepSpeed's rule: close a sub-group once it reaches the size
        cur.append(item)
        size += item[2]
        if size >= sub_group_size or i == len(params) - 1:
            groups.append(cur)
            cur, size = [], 0
    return groups


class _Param:
    """What ``integration._Replica.sub_group`` reads of a DeepSpeed parameter."""

    def __init__(self, name, numel, P):
        self.name, self.ds_numel, self._P = name, numel, P

    def partition_numel(self):
        return self._P


def layout_views(groups, topo, wsync, replica: str, alloc):
    """[(items, M, dst)] per sub-group, ``dst`` = {source: SegmentPlan}: what the engine's replica object
    (``integration._Replica.sub_group``) builds for this layout, one flat buffer per sub-group made by
    ``alloc(numel)`` (random bf16 for timing, a meta tensor to look at the layout alone)."""
    from deepspeed_sdp4bit.integration import _Replica

    out = []
    for items in groups:
        layout, off = [], 0
        for name, numel, P in items:
            layout.append((_Param(name, numel, P), off, P))
            off += P
        buf, _, plans = _Replica.sub_group(layout, off, topo, replica, wsync.sources_needed(), None, None,
                                           new=lambda n, dtype, device: alloc(n))
        out.append((items, off, plans))
    return out


def _refresh_layout(args, out: Path) -> int:
    import torch
    import torch.distributed as dist

    from deepspeed_sdp4bit import reference as R
    from deepspeed_sdp4bit.collectives.weights import WeightDeltaAllGather
    from deepspeed_sdp4bit.config import parse_block
    from deepspeed_sdp4bit.ops import get_backend
    from deepspeed_sdp4bit.topology import Topology, TopologyShape

    cpu = args.cpu or not torch.cuda.is_available()
    dev = torch.device("cpu" if cpu else "cuda")
    nodes, gpn = suite.parse_topology(args.topology)
    W = nodes * gpn
    if not 0 <= args.rank < W:
        raise SystemExit(f"collectives: --rank must be in [0, {W})")
    if args.replica == "node" and (nodes == 1 or gpn == 1):
        raise SystemExit("collectives: replica node needs several nodes of several ranks (e.g. 2x2)")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)  # _check_consistent's all-reduce: one rank
    block = {"weights": {"replica": args.replica}}
    if args.backend != "auto":   # "auto" is the omitted key (the config refuses the string)
        block["kernel_backend"] = args.backend
    cfg = parse_block(block)
    topo = Topology(shape=TopologyShape(nodes, gpn), rank=args.rank, group=None, global_ranks=list(range(W)))
    wsync = WeightDeltaAllGather(topo, cfg.weights, cfg.seed, backend=args.backend, level=args.replica)
    backend = get_backend(args.backend, dev)
    groups = gpt_layout(args.model, W, args.sub_group_size)
    gs, bits = cfg.weights.group_size, cfg.weights.bits
    meta = suite.run_meta("collectives", suite.new_run_id("collectives"), args)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(1234 + args.rank)

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    def timed(fn, before=None):
        ts = []
        for i in range(args.warmup + args.iters):
            if before is not None:
                before()
            sync()
            if cpu:
                import time
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            else:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                sync()
                ts.append(a.elapsed_time(b))
        return ts[args.warmup:]

    views_by_group = layout_views(groups, topo, wsync, args.replica,
                                  lambda n: torch.randn(n, generator=gen, device=dev).to(torch.bfloat16))
    for gi, (items, M, dst) in enumerate(views_by_group):
        # the rows the exchange would deliver: every source's payload, quantized from random data
        Mpad = R.padded_numel(M, gs)
        pb = R.payload_bytes(Mpad, bits)
        B = pb + 4 * (Mpad // gs)
        sources = wsync._plan["out_sources"]
        rows_t = torch.empty(len(sources), B, dtype=torch.uint8, device=dev)
        for k in range(len(sources)):
            m_ = torch.randn(M, generator=gen, device=dev)
            o_ = (m_ + 0.01 * torch.randn(M, generator=gen, device=dev)).to(torch.bfloat16)
            backend.weight_delta_quantize(m_, o_, bits, gs, cfg.weights.rounding, None, 0, cfg.weights.mode,
                                          out=rows_t[k, :pb], out_scales=rows_t[k, pb:].view(torch.float32))
        wsync._exchange = lambda send, B_, pool, stats, values, base: (rows_t, sources)
        own = torch.randn(M, generator=gen, device=dev).to(torch.bfloat16)
        master = own.float() + 1e-3 * torch.randn(M, generator=gen, device=dev)
        noise = 1e-4 * torch.randn(M, generator=gen, device=dev)
        step = [0]

        def nudge():
            master.add_(noise)

        def refresh(d=dst):
            wsync.refresh(master, own, d, step=step[0], bucket_id=gi)
            step[0] += 1

        # (source, offset in its flat partition, length) of every piece kept here
        views = [(s, so, n) for s, plan in dst.items() for so, _, n in plan.segments()]
        n_elems = sum(n for _, _, n in views)
        aligned = sum(n for _, so, n in views if so % gs == 0)
        touched = 4 * M + 2 * M + 2 * M + B  # owner: master, own read, own write, payload write
        touched += sum(B for s in dst if s != args.rank)  # payload reads
        touched += sum(4 * n for _, _, n in views)  # each piece read and written (bf16)
        ms = timed(refresh, nudge)
        src = torch.empty(touched // 2 // 2, dtype=torch.bfloat16, device=dev).normal_(generator=gen)
        dst_c = torch.empty_like(src)
        ms_copy = timed(lambda: dst_c.copy_(src))
        row = {"sub_group": gi, "params": len(items), "partition_numel": M, "views": len(views),
               "view_elements": n_elems, "aligned_fraction": aligned / n_elems if n_elems else None,
               "bytes_touched": touched, "ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
               "copy_ms": statistics.median(ms_copy)}
        row["gbs"] = touched / row["ms"] / 1e6
        row["copy_gbs"] = touched / row["copy_ms"] / 1e6
        row["fraction_of_copy"] = row["copy_ms"] / row["ms"]
        if args.compare_aligned:
            flat = {}
            for s in dst:
                flat[s] = [(torch.randn(M, generator=gen, device=dev).to(torch.bfloat16), 0)]
            ms_a = timed(lambda: refresh(flat), nudge)
            t_a = 8 * M + B + sum(B + 4 * M for s in flat if s != args.rank) + (4 * M if args.rank in flat else 0)
            row.update(aligned_ms=statistics.median(ms_a), aligned_bytes=t_a,
                       aligned_gbs=t_a / statistics.median(ms_a) / 1e6)
        rows.append(row)
        print(f"[collectives] {args.model} {args.topology} rank {args.rank} {args.replica} sub-group {gi}: "
              f"{len(items)} params, {len(views)} views, {100 * row['aligned_fraction']:.0f}% of elements in "
              f"aligned views; refresh {row['ms']:.2f} ms = {row['gbs']:.0f} GB/s on {touched / 1e9:.2f} GB, "
              f"copy {row['copy_gbs']:.0f} GB/s ({100 * row['fraction_of_copy']:.0f}% of copy)"
              + (f"; one aligned view per source: {row['aligned_gbs']:.0f} GB/s" if args.compare_aligned else ""),
              flush=True)
    doc = {"meta": meta, "layout": {"model": args.model, "topology": args.topology, "replica": args.replica,
                                    "rank": args.rank, "backend": getattr(backend, "name", args.backend)},
           "rows": rows}
    path = out / f"{meta['run_id']}_refresh_{args.model}_{args.topology}_{args.replica}.json"
    suite.write_json(path, doc)
    print(f"[collectives] results: {path}")
    return 0


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.layout:
        return _refresh_layout(args, out)
    cpu = args.cpu or not suite.on_gpu()
    nodes, gpn = suite.parse_topology(args.topology)
    world = nodes * gpn
    rpg = max(1, min(args.ranks_per_gpu, world))
    run_id = suite.new_run_id("collectives")
    target = out / f"{run_id}_flat_{args.topology}.json"
    sargs = ["--gpus-per-node", str(gpn), "--backend", args.backend, "--iters", str(args.iters),
             "--warmup", str(args.warmup), "--out", str(target),
             "--transport", "gloo" if cpu else ("share-GPU sockets" if rpg > 1 else "default"),
             "--sizes-mb"] + [str(s) for s in args.sizes_mb]
    cmd, env = suite.launch_command(Path(__file__).resolve().parent / "bench_collectives.py", sargs, world, rpg, cpu)
    work = suite.work_dir(run_id)
    rc, wall = suite.run_process(cmd, env, work / "collectives.log", args.timeout)
    print("\n".join(suite.log_tail(work / "collectives.log", 12)))
    suite.pack_logs(work, out / f"{run_id}_logs.tar.gz")
    if rc == 0 and target.is_file():
        print(f"[collectives] rc 0, {wall:.0f} s; results: {target}")
        return 0
    print(f"[collectives] failed (rc {rc}, {wall:.0f} s): no results file; the log is in "
          f"{out / (run_id + '_logs.tar.gz')}")
    return 1
