"""``python -m benchmarks e2e``: step time of the GPT under ZeRO-3, ZeRO++, SDP4Bit and its ablations.

One ``examples/train_gpt.py`` process group per (model, topology, config), on random tokens (vocab 50304), with
``--warmup`` untimed steps then ``--timed`` timed ones (``--timed-slow`` for the configs of ``--slow``, which
take seconds per step over sockets).  Per config one row (see ``row_fields`` in the README of the results
folder): ms/step = median of the timed steps (min and max beside it), tokens/s, peak memory (max over ranks),
bytes on the wire per step per level, and the no-communication bound: the world-1 ZeRO-3 step time of the same
model x the ranks sharing one device, with ``bound_fraction`` = bound / ms_per_step.  The world-1 time comes
from a ``1x1`` zero3 row of this run, else the newest one of the results file (same GPU name).

Bytes on the wire (per rank per step): SDP4Bit's own collectives as counted by ``engine.sdp4bit_summary()``;
DeepSpeed's traffic by formula over the parameter count P and world W (persistent small parameters, padding and
ZeRO++ scales ignored): ZeRO-3 bf16 all-gather in forward and in backward, 2 x 2P(W-1)/W, and reduce-scatter
2P(W-1)/W; ZeRO++ (hpZ 1) int8 gathers 2 x P(W-1)/W and 4-bit qgZ P(W-1)/(2W); SDP4Bit replica node: bf16
gathers inside the node 2 x 2P(g-1)/g; replica full: none.  The formula is an upper bound for DeepSpeed's
traffic: ZeRO-3 (and ZeRO++) gather a parameter again in backward only when they released it after forward, which
they do not while its next use lies within ``stage3_max_reuse_distance`` (1e9 elements by default) or was already
prefetched.  So every run also counts what each rank really sent (train_gpt.py ``--count-wire-bytes``,
examples/wire_count.py): ``wire_counted_per_step`` by collective and group, ``wire_counted_total`` and
``wire_counted_inter`` (groups that span NCCL hosts, i.e. what crosses the inter-node link).

Under the bandwidth knob (``--link-gbps R [R ...]``, benchmarks/link.py: an LD_PRELOAD limit of each rank's TCP
egress; share-GPU mode, ``--transport sockets`` / ``nodes`` or CPU) every config runs once per rate; rows carry
``link_gbps`` (requested; null = unshaped), ``link_measured_gbps`` / ``link_measured_source`` (the
``linkrate`` collective row with the same settings and machine measured nearest in time, from OUT/linkrate.json
or ``--link-rates-from``; null when none was measured yet), ``nccl_socket_nthreads`` / ``nccl_nsocks_perthread``
(null = NCCL's default), ``link_stats`` (the shim's own count: bytes the busiest process sent, seconds it slept)
and ``link_stats_short`` (why that count cannot have seen the run's traffic, when it is below a step's bytes).

``--paired`` (exactly two configs): both in ONE train_gpt.py process per (model, topology), their steps alternating
A B B A ..., so a ratio that the spread between processes would hide (e.g. SDP4Bit off vs ZeRO-3, the same code)
is measured step by step: both rows get ``paired_with`` and ``paired`` (the per-step log ratio to the partner:
``n``, ``log_ratio_mean``, ``log_ratio_se``, ``ratio_median``); they have no peak memory and no counted bytes (only
the formula's ``wire_bytes_*``), bound nothing, and stay out of the tables, the fit and every goal but the same-code
ones.  ``--profile-steps N`` runs N more steps under torch.profiler after the timed ones: rank 0's Chrome trace
and top-operator tables land in ``OUT/<run id>_profiles/``, and each row gets ``profile``, per profiled step its
wall time, the GPU's busy time (the union of its kernel, copy and memset intervals) and the host's synchronize time.
``--overlap-blocks N`` (configs that overlap their weight refresh, or leave ``weights.overlap`` to the engine's probe
of the link): train_gpt.py switches ``weights.overlap`` on and off in blocks of N steps in one process; rows get
``overlap_ab`` (:func:`overlap_ab_stats`) and stay out of every table but overlap.md's own (their step median mixes
both modes); a row whose engine left the overlap off (the key omitted, a fast link) switched nothing: ``overlap_ab``
None and ``overlap_ab_error`` say so.  Rows of engines that decided the overlap themselves carry ``overlap_choice``
(the probe's reading and the decision).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional

from . import link, suite

SLOW_DEFAULT = ["zero3", "zeropp", "tlq_hs"]
# --step-sync (train_gpt.py's): what each timed step waits for, in words
STEP_SYNC = {"device": "every stream", "stream": "the current stream"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["406M"], choices=sorted(suite.MODELS))
    p.add_argument("--topologies", nargs="+", default=["1x1"], help="NODESxGPUS, e.g. 1x1 2x2 4x1 2x4 8x1")
    p.add_argument("--configs", nargs="+", default=["zero3", "sdp4bit"],
                   help="NAME[:REPLICA]: a configs/ name (zero3 zeropp sdp4bit qwd tlq_hs ...) and optionally "
                        "node/full for sdp4bit.weights.replica; 'sdp4bit' alone = the shipped default")
    p.add_argument("--ranks-per-gpu", type=int, default=1,
                   help="ranks sharing one GPU, each its own NCCL host (sockets); e.g. 4 for 4 ranks on one GPU")
    p.add_argument("--share-gpu", action="store_true", help="all ranks of each run on one GPU (= --ranks-per-gpu "
                                                            "equal to the run's world size)")
    p.add_argument("--transport", choices=sorted(suite.TRANSPORTS), default="nvlink",
                   help="NCCL setting on a multi-GPU host without sharing (share-GPU mode is always sockets)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--timed", type=int, default=4, help="timed steps (>= 2)")
    p.add_argument("--timed-slow", type=int, default=2, help="timed steps of the --slow configs (>= 2)")
    p.add_argument("--warmup-slow", type=int, default=None, help="untimed steps of the --slow configs "
                                                                 "(default: --warmup)")
    p.add_argument("--slow", nargs="*", default=SLOW_DEFAULT, help="config names that get --timed-slow")
    p.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU (automatic without a GPU)")
    p.add_argument("--out", required=True, help="folder for this run's results file and logs")
    p.add_argument("--results", default=None, help="JSON list the rows are merged into (default OUT/throughput.json)")
    p.add_argument("--bound-from", nargs="*", default=[str(suite.ONE_GPU / "throughput.json")],
                   help="more row files to take the world-1 step time from")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per config before it is killed")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole call: configs that would start too late are recorded as skipped")
    p.add_argument("--link-gbps", nargs="+", default=None, metavar="R",
                   help="run every config under the bandwidth knob at each rate R (Gb/s of TCP egress per rank; "
                        "'off' = unshaped), see benchmarks/link.py")
    p.add_argument("--link-delay-us", default=None, metavar="D",
                   help="one-way delay in microseconds of every byte each rank sends over TCP (the knob's delay line, "
                        "see benchmarks/link.py), for every config and rate of the call")
    p.add_argument("--nccl-sockets", default="default", metavar="TxS",
                   help="NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD, e.g. 4x4 (default: NCCL's own)")
    p.add_argument("--link-rates-from", nargs="*", default=[str(suite.ONE_GPU / "linkrate.json")],
                   help="linkrate row files to take each rate's measured value from (besides OUT/linkrate.json)")
    p.add_argument("--probe-link", action="store_true",
                   help="measure the link inside this run: before the first config of each (rate, rank count), the "
                            "linkrate collectives with this run's ranks and socket setting; the rows of that rate and "
                            "rank count take their link_measured_gbps from it (rows in OUT/linkrate.json)")
    p.add_argument("--probe-mb", type=float, default=64.0, help="MiB per rank and collective of --probe-link")
    p.add_argument("--probe-seconds", type=float, default=1.0, help="seconds per collective of --probe-link")
    p.add_argument("--paired", action="store_true",
                   help="time the two --configs in ONE process per (model, topology), their steps alternating "
                        "A B B A ... (train_gpt.py --paired-ds-config): each row gets `paired` (the per-step ratio "
                        "to its partner: median, mean and standard error of the log ratio), for a ratio that the "
                        "spread between processes would hide; no peak memory, no byte count, not a bound")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="profile the last N steps of each run (train_gpt.py --profile-steps): rank 0's Chrome "
                        "trace and top ops come back in OUT/<run id>_profiles/")
    p.add_argument("--step-sync", choices=tuple(STEP_SYNC), default="device",
                   help="what each timed step waits for (train_gpt.py --step-sync; recorded as the rows' "
                        "step_sync): 'device' every stream (every row up to the nineteenth session), which times "
                        "an overlapped weight refresh (weights.overlap) inside its own step, so the overlap cannot "
                        "show a gain; 'stream' the current stream, as a training loop that reads its loss")
    p.add_argument("--overlap-blocks", type=int, default=0, metavar="N",
                   help="time the overlapped weight refresh against the refresh inside step() in ONE process: "
                        "train_gpt.py --overlap-blocks N switches weights.overlap in blocks of N steps (on off off "
                        "on ...); each config must overlap (e.g. sdp4bit_overlap) or leave it to the engine (the "
                        "key omitted: a run it left off switches nothing); rows get overlap_ab (per pair of "
                        "blocks, on over off: mean and standard error of the log ratio) and stay out of every other "
                        "table; use with --step-sync stream (else the overlap cannot show a gain)")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for train_gpt.py (repeat; e.g. --train-arg=--zero-init)")


def _wire_bytes(variant: suite.Variant, n_params: int, world: int, gpn: int, last: Optional[dict]) -> Dict[str, int]:
    """Bytes this rank puts on the wire per step, per level (see the module docstring)."""
    P, W = n_params, world
    cfg = variant.load()
    out: Dict[str, float] = {}
    if W == 1:
        return {}
    ring = (W - 1) / W
    sdp = cfg.get("sdp4bit") or {}
    zo = cfg.get("zero_optimization") or {}
    active = bool(sdp) and sdp.get("enabled", True)
    w_on = active and (sdp.get("weights") or {}).get("enabled", True)
    g_on = active and (sdp.get("gradients") or {}).get("enabled", True)
    if last:
        for coll in ("gradients", "weights"):
            for level, b in ((last.get(coll) or {}).get("bytes_by_level") or {}).items():
                out[f"sdp4bit_{coll}_{level}"] = b
    if zo.get("zero_quantized_weights"):
        out["zeropp_int8_allgather_world"] = 2 * P * ring
    elif w_on:
        replica = last.get("replica") if last else None
        replica = replica or variant.replica or (sdp.get("weights") or {}).get("replica")
        if replica == "node" and gpn > 1 and W // gpn > 1:
            out["ds_bf16_allgather_intra"] = 2 * 2 * P * (gpn - 1) / gpn
    else:
        out["ds_bf16_allgather_world"] = 2 * 2 * P * ring
    if zo.get("zero_quantized_gradients"):
        out["zeropp_4bit_reduce_world"] = 0.5 * P * ring
    elif not g_on:
        out["ds_bf16_reduce_scatter_world"] = 2 * P * ring
    return {k: int(v) for k, v in out.items()}


def _find_bound(model: str, gpu: Optional[str], rows: List[dict], gpu_count: Optional[int] = None) -> Optional[dict]:
    """The newest ok 1x1 zero3 row of ``model`` on the same GPU name among ``rows``, of a machine with the same
    number of GPUs (``gpu_count``, the same kind of machine) where one exists."""
    cands = [r for r in rows if r.get("config") == "zero3" and r.get("topology") == "1x1"
             and r.get("model") == model and r.get("status") == "ok" and r.get("gpu") == gpu
             and r.get("ms_per_step") and not r.get("paired_with")]   # a paired row shared its process
    same_kind = [r for r in cands if gpu_count is not None and r.get("gpu_count") == gpu_count]
    return max(same_kind or cands, key=lambda r: r.get("created", "")) if cands else None


def rebind(row: dict, rows: List[dict]) -> bool:
    """Give ``row`` the bound of its own kind of machine where its bound came from another kind (a call on a
    4-GPU host without a world-1 row took a one-GPU machine's from the committed rows) and a row of its kind now
    exists; returns whether it changed."""
    src = next((r for r in rows if r.get("row_id") == row.get("bound_source")), None)
    if src is None or row.get("gpu_count") is None or src.get("gpu_count") == row.get("gpu_count"):
        return False
    b = _find_bound(row.get("model"), row.get("gpu"), rows, row.get("gpu_count"))
    if b is None or b.get("gpu_count") != row.get("gpu_count"):
        return False
    row.pop("bound_ms", None)
    return set_bound(row, rows)


def set_bound(row: dict, rows: List[dict]) -> bool:
    """Give ``row`` (a timed row without a bound) its no-communication bound from ``rows``: ``bound_ms`` = the
    world-1 ZeRO-3 step of its model on the same GPU name (``_find_bound``) x its ranks per device,
    ``bound_fraction`` = bound / its step, ``bound_source`` = that row's id.  Used when the row is measured and
    again by ``merge`` for rows whose call had no such row (their machine's world-1 row came in another call).
    Returns whether a bound was set."""
    if not row.get("ms_per_step") or row.get("bound_ms") is not None or not row.get("ranks_per_device") \
            or row.get("paired_with"):   # a paired row's step shared its process with another engine
        return False
    b = _find_bound(row.get("model"), row.get("gpu"), rows, row.get("gpu_count"))
    if b is None:
        return False
    row["bound_ms"] = b["ms_per_step"] * row["ranks_per_device"]
    row["bound_fraction"] = row["bound_ms"] / row["ms_per_step"]
    row["bound_source"] = b["row_id"]
    return True


def run(args) -> int:
    from deepspeed_sdp4bit.config import parse_block   # the block as this commit reads it (config_snapshot)

    cpu = args.cpu or not suite.on_gpu()
    if args.timed < 2 or args.timed_slow < 2:
        raise SystemExit("e2e: --timed and --timed-slow must be >= 2 (ms/step is a median of repetitions)")
    if args.warmup < 1 or (args.warmup_slow is not None and args.warmup_slow < 1):
        raise SystemExit("e2e: --warmup and --warmup-slow must be >= 1 (the first step includes one-time work)")
    variants = [suite.Variant.parse(c) for c in args.configs]
    if args.paired and len(variants) != 2:
        raise SystemExit(f"e2e: --paired times two configs against each other; got {len(variants)} ({args.configs})")
    if args.paired and args.step_sync == "stream":
        raise SystemExit("e2e: --paired with --step-sync stream: what one engine leaves in flight (an overlapped "
                         "weight refresh) would run during its partner's timed step; pair with --step-sync device")
    if args.paired and variants[0].label == variants[1].label:
        raise SystemExit(f"e2e: --paired needs two different configs, got {variants[0].label} twice")
    if args.paired:
        n = args.timed_slow if any(v.config in args.slow for v in variants) else args.timed
        if n < PAIRED_MIN_STEPS or n % 2:
            raise SystemExit(f"e2e: --paired needs an even number of at least {PAIRED_MIN_STEPS} timed steps (each "
                             f"config first in half of them); got {n} (--timed, or --timed-slow for the configs of "
                             f"--slow: {' '.join(args.slow) or 'none'})")
    if args.profile_steps < 0:
        raise SystemExit(f"e2e: --profile-steps must be >= 0, got {args.profile_steps}")
    bad = overlap_blocks_error(args, variants)
    if bad:
        raise SystemExit(f"e2e: {bad}")
    try:
        rates = [link.parse_gbps(g) for g in args.link_gbps] if args.link_gbps else [None]
        threads, nsocks = link.parse_sockets(args.nccl_sockets)
        delay = link.parse_delay_us(args.link_delay_us)
    except ValueError as e:
        raise SystemExit(f"e2e: {e}")
    if (args.link_gbps or threads or delay) and not cpu and not args.share_gpu and args.ranks_per_gpu == 1 \
            and args.transport not in suite.TCP_TRANSPORTS:
        raise SystemExit("e2e: --link-gbps / --link-delay-us / --nccl-sockets concern TCP traffic: use them with "
                         "--share-gpu / --ranks-per-gpu, --transport sockets / nodes, or on CPU (NVLink and shared "
                         "memory bypass sockets)")
    if args.transport == "nodes" and (args.share_gpu or args.ranks_per_gpu > 1):
        raise SystemExit("e2e: --transport nodes runs one rank per GPU (each node's GPUs one NCCL host); it "
                         "excludes --share-gpu / --ranks-per-gpu")
    # fewer ranks first (1x1 gives the bound), otherwise in the order given
    topos = sorted({t: suite.parse_topology(t) for t in args.topologies}.items(),
                   key=lambda kv: (kv[1][0] * kv[1][1], args.topologies.index(kv[0])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else out / "throughput.json"
    run_id = suite.new_run_id("e2e")
    meta = suite.run_meta("e2e", run_id, args)
    gpu = meta["machine"]["gpu_name"] if not cpu else None
    n_gpus = meta["machine"]["gpu_count"] if not cpu else 0
    work = suite.work_dir(run_id)  # outside OUT: only a few files may come back from a GPU machine
    deadline = suite.Deadline(args.deadline)
    rows: List[dict] = []
    independent: Dict[tuple, dict] = {}
    doc = {"meta": meta, "rows": rows}
    res_file = out / f"{run_id}.json"

    def bound_rows() -> List[dict]:   # re-read: this call's own rows become bounds as they are written
        return list(rows) + suite.load_rows_from([results] + [Path(x) for x in args.bound_from])

    # the measured link rates do not change during the call: read once
    link_rows = suite.load_rows_from([out / "linkrate.json"] + [Path(x) for x in args.link_rates_from]) \
        if args.link_gbps or delay else []
    probes: Dict[tuple, Optional[dict]] = {}   # (rate, ranks) -> this run's all-gather linkrate row

    def probe(gbps, world: int) -> Optional[dict]:
        """--probe-link: this run's own measurement of the link at (rate, ranks), once."""
        if (gbps, world) not in probes:
            prow = link.measure_collectives(meta, work, cpu, world, [gbps], threads, nsocks, args.probe_mb,
                                            args.probe_seconds, ["all_gather", "all_to_all"],
                                            min(args.timeout, 180.0), deadline, delay_us=delay)
            for r in prow:
                r["probe_of"] = run_id
            doc.setdefault("link_probes", []).extend(prow)
            suite.merge_rows(out / "linkrate.json", prow)
            ok = [r for r in prow if r.get("status") == "ok" and r.get("op") == "all_gather"]
            probes[(gbps, world)] = ok[0] if ok else None
        return probes[(gbps, world)]

    for gbps, model in ((g, m) for g in rates for m in args.models):  # every config once per link rate
        shape = suite.MODELS[model]
        for topo, (nodes, gpn) in topos:
            world = nodes * gpn
            rpg = world if args.share_gpu else args.ranks_per_gpu
            rpg = max(1, min(rpg, world))
            if not cpu and world > rpg * max(n_gpus, 1):
                raise SystemExit(f"e2e: topology {topo} has {world} ranks but {n_gpus} GPU(s) x "
                                 f"--ranks-per-gpu {rpg}; pass --ranks-per-gpu {world} (or --share-gpu)")
            share = (not cpu) and rpg > 1
            # --transport nodes: each logical node its own NCCL host (NVLink inside, sockets between)
            hosts = (not cpu) and (not share) and world > 1 and args.transport == "nodes"
            if args.probe_link and world > 1 and not (cpu or share or hosts):
                raise SystemExit("e2e: --probe-link measures the sockets of share-GPU ranks, of the nodes of "
                                 f"--transport nodes (or gloo on CPU); topology {topo} runs one rank per GPU here")
            for v in variants[:1] if args.paired else variants:
                partner = variants[1] if args.paired else None
                slow = v.config in args.slow or (partner is not None and partner.config in args.slow)
                warmup = args.warmup_slow if slow and args.warmup_slow is not None else args.warmup
                n_timed = args.timed_slow if slow else args.timed
                # --profile-steps: that many more steps after the timed ones (the profiler slows the steps it records)
                steps = warmup + n_timed + args.profile_steps
                name = (f"{model}_{topo}_{v.label.replace(':', '-')}" + (f"_{link.label(gbps)}g" if args.link_gbps
                                                                         else "")
                        + (f"_d{delay:g}us" if delay else "") + ("_paired" if partner else ""))
                row = {"row_id": f"{run_id}/{name}", "run_id": run_id, "created": meta["created"],
                       "commit": meta["commit"], "gpu": gpu, "gpu_count": n_gpus,
                       "machine": suite.device_label(meta["machine"]),
                       "config": v.config, "variant": v.label, "replica_requested": v.replica,
                       "default": v.is_default, "topology": topo, "nodes": nodes, "gpus_per_node": gpn,
                       "ranks": world, "ranks_per_device": world if cpu else rpg, "model": model,
                       "micro_batch": args.micro_batch, "seq": args.seq, "warmup_steps": warmup,
                       "mode": ("cpu gloo" if cpu else ("share-GPU sockets" if share else
                                                        f"{n_gpus} GPUs, {args.transport}")) if world > 1
                       else ("cpu" if cpu else "1 GPU"),
                       "link_gbps": gbps, "nccl_socket_nthreads": threads, "nccl_nsocks_perthread": nsocks,
                       "link_delay_us": delay, "step_sync": args.step_sync}
                if any(x.replica == "node" for x in (v, partner) if x) and gpn == 1 and nodes > 1:
                    row.update(status="skipped", reason="replica node with one rank per node is the full "
                                                        "replica; the integration refuses it")
                    rows.extend([row] + _skipped_partner(row, partner))
                    continue
                ds_set = v.ds_set(gpn, share)
                one_gpu_flag = not cpu and not share and not hosts and gpn == 1 and world > 1
                # Nothing of this run depends on the node layout (no sdp4bit block, no hpZ size, no per-rank
                # GPU split): ZeRO-3 and ZeRO++ in share-GPU mode.  Such a run is measured once per call and
                # model and rank count, and its row stands for every topology with those ranks.
                row["topology_independent"] = (not one_gpu_flag and not hosts and partner is None
                                               and all(v.ds_set(g, share) == ds_set for g in (1, 2, 3)))
                ikey = (model, v.label, world, rpg, gbps)
                if row["topology_independent"] and ikey in independent:
                    src = independent[ikey]
                    keep = {k: row[k] for k in ("row_id", "topology", "nodes", "gpus_per_node")}
                    row.update({k: val for k, val in src.items() if k not in keep})
                    row.update(keep, reused_from=src["row_id"])
                    rows.append(row)
                    print(f"[e2e] {name}: the run of {src['topology']} (same command), "
                          f"{row.get('ms_per_step') or 0:.1f} ms/step", flush=True)
                    suite.write_json(res_file, doc)
                    suite.merge_rows(results, [row])
                    continue
                # (a reused run above costs nothing: only a new run waits for the deadline)
                if deadline.left() < 90:  # too little left for start-up and two timed steps
                    row.update(status="skipped", reason="the call's --deadline was reached")
                    both = [row] + _skipped_partner(row, partner)
                    rows.extend(both)
                    suite.write_json(res_file, doc)
                    suite.merge_rows(results, both)
                    continue
                # the link between nodes: in --transport nodes the probe runs one rank per node (on one GPU, each
                # its own host: the same sockets and knob); a single node has no such link
                probe_ranks = nodes if hosts else world
                probed = probe(gbps, probe_ranks) if args.probe_link and probe_ranks > 1 else None
                log_json = work / f"{name}.json"
                targs = ["--ds-config", str(v.path()), "--log-json", str(log_json), "--no-progress",
                         "--d-model", str(shape["d_model"]), "--layers", str(shape["layers"]),
                         "--heads", str(shape["heads"]), "--seq", str(args.seq),
                         "--micro-batch", str(args.micro_batch), "--steps", str(steps), "--random-tokens",
                         "--eval-every", "0", "--eval-batches", "0", "--torch-adam", "yes",
                         "--log-flush", "1",  # a config killed at its timeout keeps the steps it timed
                         "--step-sync", args.step_sync]
                # every parameter of d64 is below ZeRO-3's persistence threshold
                extra = ["zero_optimization.stage3_param_persistence_threshold=0"] if model == "tiny" else []
                # the partner's: its own, then what applies to the whole run (as the primary's --ds-set below)
                partner_sets = (partner.ds_set(gpn, share) + extra + suite.ds_sets_of(args.train_arg)
                                if partner else [])
                if partner is None:   # bytes each rank sent, counted per step (wire_counted_*)
                    targs.append("--count-wire-bytes")
                else:
                    targs += ["--paired-ds-config", str(partner.path())]
                    for kv in partner_sets:
                        targs += ["--paired-ds-set", kv]
                if args.overlap_blocks:
                    targs += ["--overlap-blocks", str(args.overlap_blocks)]
                if args.profile_steps:
                    targs += ["--profile-steps", str(args.profile_steps),
                              "--profile-dir", str(out / f"{run_id}_profiles")]
                for kv in ds_set + extra:
                    targs += ["--ds-set", kv]
                if one_gpu_flag:
                    targs.append("--one-gpu-per-rank")
                targs += list(args.train_arg)
                # what this run reads: the file with every --ds-set the command passes, the block resolved
                row["config_snapshot"] = suite.config_snapshot(
                    suite.apply_ds_set(v.load(), suite.ds_sets_of(targs)), None, parse_block)
                cmd, env = suite.launch_command(suite.TRAIN, targs, world, rpg, cpu,
                                                gpus_per_host=gpn if hosts else None)
                if not cpu and not share:
                    env.update(suite.TRANSPORTS[args.transport])
                stats_dir = work / f"{name}_link"
                env.update(link.knob_env(gbps, stats_dir, threads, nsocks, delay_us=delay))
                row["command"] = " ".join(f"{k}={val}" for k, val in env.items()) + " " + " ".join(cmd)
                timeout = min(args.timeout, deadline.left() - 15)
                print(f"[e2e] {name}: {steps} steps, timeout {timeout:.0f} s", flush=True)
                rc, wall = suite.run_process(cmd, env, work / f"{name}.log", timeout)
                row.update(rc=rc, wall_s=round(wall, 1))
                row["timed_steps_requested"] = n_timed
                row.update(_summarize(log_json, warmup, v, world, gpn, n_timed=n_timed,
                                      asked_blocks=args.overlap_blocks))
                if gbps is not None or delay:
                    row["link_stats"] = link.stats_summary(link.read_stats(stats_dir))
                m = probed
                if m is not None:
                    row["link_probe"] = True
                elif args.probe_link and probe_ranks > 1:
                    # the probe failed or was skipped: said on the row, and no other run's rate stands in for it
                    row.update(link_probe=False, link_probe_reason="this run's link probe gave no all-gather rate "
                                                                   "(see its rows in OUT/linkrate.json)")
                elif args.link_gbps or delay:
                    m = link.measured_rate(row, link_rows)
                if m is not None or args.link_gbps or delay or args.probe_link:
                    row.update(link_measured_gbps=m["measured_gbps"] if m else None,
                               link_measured_source=m["row_id"] if m else None)
                if rc != 0 or row.get("status") != "ok":
                    row["status"] = "failed" if rc != "timeout" else "timeout"
                    row["error_tail"] = suite.log_tail(work / f"{name}.log")
                short = link.uncounted(row) if "link_stats" in row else None   # ok rows only (a killed run wrote none)
                if short:
                    row["link_stats_short"] = short
                    print(f"[e2e] {name}: WARNING {short}", flush=True)
                trace = out / f"{run_id}_profiles" / f"{name}.trace.json.gz"
                profile = None   # the trace's steps of both engines, read once
                if args.profile_steps and trace.is_file():
                    profile = summarize_trace(trace)
                    row["profile"] = [x for x in profile if x["tag"] == "A"]
                    row["profile_trace"] = trace.name
                elif args.profile_steps:
                    row["profile_missing"] = ("no trace: the run ended before its profile was written (killed, "
                                              "stopped or failed; see its log)")
                rows.append(row)
                if partner is not None:
                    snap = suite.config_snapshot(suite.apply_ds_set(partner.load(), partner_sets), None, parse_block)
                    rows.append(_partner_row(row, partner, snap, log_json, warmup, world, gpn, profile))
                if row["topology_independent"]:
                    independent[ikey] = row
                set_bound(row, bound_rows())
                msg = (f"{row['ms_per_step']:.1f} ms/step (min {row['ms_min']:.1f}, max {row['ms_max']:.1f})"
                       if row.get("ms_per_step") else f"{row['status']} (rc {rc})")
                print(f"[e2e] {name}: {msg}, wall {wall:.0f} s", flush=True)
                suite.write_json(res_file, doc)
                suite.merge_rows(results, [r for r in rows if r["row_id"] == row["row_id"]
                                           or r.get("paired_with") == row["row_id"]])
    suite.write_json(res_file, doc)
    suite.merge_rows(results, rows)
    suite.pack_logs(work, out / f"{run_id}_logs.tar.gz")
    print(f"[e2e] results: {res_file}; rows merged into {results}", flush=True)
    return 0 if all(r.get("status") in ("ok", "skipped") for r in rows) else 1


GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")   # the host waits


def summarize_trace(path: Path) -> List[dict]:
    """Per profiled step of a train_gpt.py ``--profile-steps`` Chrome trace (the ``train_step N TAG`` marks; TAG A
    is the --ds-config engine, B the paired one): ``wall_ms``, ``gpu_busy_ms`` (the union of the GPU's kernel,
    memcpy and memset intervals inside the step: the time the GPU worked), ``gpu_busy_fraction``, ``gpu_ops`` (those
    intervals) and ``cpu_sync_ms`` (the union of the host's CUDA synchronize calls: waiting for the GPU).  The
    profiler slows the host: these steps run longer than timed ones, and the first includes its start."""
    import gzip
    doc = json.loads(gzip.open(path).read() if str(path).endswith(".gz") else Path(path).read_text())
    ev = [e for e in (doc.get("traceEvents", []) if isinstance(doc, dict) else doc)
          if e.get("ph") == "X" and "ts" in e and "dur" in e]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in GPU_EVENTS)
    syncs = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "cuda_runtime"
                   and e.get("name") in SYNC_CALLS)

    def union(spans, t0, t1):   # (length of the union of the spans clipped to [t0, t1], how many touch it)
        total, end, n = 0.0, t0, 0
        for a, b in spans:   # sorted by start
            a, b = max(a, t0), min(b, t1)
            if b <= a:
                continue
            n += 1
            if b > end:
                total += b - max(a, end)
                end = b
        return total, n

    out = []
    for e in sorted((e for e in ev if e.get("cat") == "user_annotation"
                     and str(e.get("name", "")).startswith("train_step ")), key=lambda e: e["ts"]):
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        busy, n = union(gpu, t0, t1)
        _, step, tag = e["name"].split()
        out.append({"step": int(step), "tag": tag, "wall_ms": e["dur"] / 1e3, "gpu_busy_ms": busy / 1e3,
                    "gpu_busy_fraction": busy / e["dur"] if e["dur"] else None, "gpu_ops": n,
                    "cpu_sync_ms": union(syncs, t0, t1)[0] / 1e3})
    return out


PAIRED_MIN_STEPS = 10   # fewer paired steps give no standard error worth a verdict
PAIRED_KEYS = {"ms": "paired_ms", "loss": "paired_loss", "sdp4bit": "paired_sdp4bit"}


def _partner_row(row: dict, partner: suite.Variant, snapshot: dict, log_json: Path, warmup: int, world: int,
                 gpn: int, profile: Optional[List[dict]] = None) -> dict:
    """``--paired``: the row of the second config, timed in ``row``'s process; both rows get ``paired_with`` (the
    other's id) and ``paired`` (:func:`paired_stats` of their own steps over the other's); ``profile``: the run's
    :func:`summarize_trace`, whose B steps are the partner's ``profile``."""
    other = dict(row, config_snapshot=snapshot, **_partner_identity(row, partner))
    for k in ("ms_per_step", "ms_min", "ms_max", "tokens_per_s", "timed_steps", "wire_bytes_per_step",
              "wire_bytes_total", "loss_last", "replica", "steps_ms", "cycle_ms_per_step", "steps_cycle_ms", "error"):
        other.pop(k, None)
    if log_json.is_file():
        got = _summarize(log_json, warmup, partner, world, gpn, paired=True, n_timed=row.get("timed_steps_requested"))
        other.update(got)
        if row.get("status") != "ok":
            other["status"] = row["status"]
    if profile is not None:
        other["profile"] = [x for x in profile if x["tag"] == "B"]
    # (train_gpt builds the --ds-config engine, row's, first)
    for a, b, order in ((row, other, "first"), (other, row, "second")):
        a["paired_with"] = b["row_id"]
        a.pop("peak_mem_bytes", None)   # both engines share the process: neither one's peak
        n = a.get("timed_steps_requested")
        a["paired"] = paired_stats((a.get("steps_ms") or [])[:warmup + n], (b.get("steps_ms") or [])[:warmup + n], warmup)
        if a["paired"] is not None:
            a["paired"]["built"] = order
    return other


def _partner_identity(row: dict, partner: suite.Variant) -> dict:
    """What tells the partner's row from ``row``: its id (``row``'s with the partner's label), config, variant."""
    name = row["row_id"].rsplit("/", 1)[1].replace(f"_{row['variant'].replace(':', '-')}_",
                                                   f"_{partner.label.replace(':', '-')}_", 1)
    return {"row_id": f"{row['run_id']}/{name}", "config": partner.config, "variant": partner.label,
            "replica_requested": partner.replica, "default": partner.is_default}


def _skipped_partner(row: dict, partner: Optional[suite.Variant]) -> List[dict]:
    """``--paired``: the partner's row of a skipped run (none without a partner), both linked by ``paired_with``."""
    if partner is None:
        return []
    other = dict(row, **_partner_identity(row, partner))
    row["paired_with"], other["paired_with"] = other["row_id"], row["row_id"]
    return [other]


def paired_built(row: dict) -> Optional[str]:
    """Which engine of its paired process ``row`` timed: "first" (train_gpt's --ds-config engine, built first) or
    "second" (the --paired-ds-config one, built after it).  Rows written before ``paired["built"]`` existed: read
    from their command (None when both engines came from one config file, where the command cannot tell)."""
    st = row.get("paired") or {}
    if st.get("built"):
        return st["built"]
    cmd = row.get("command") or ""
    a, b = (re.search(rf"{flag} (\S+)", cmd) for flag in ("--ds-config", "--paired-ds-config"))
    if not a or not b or Path(a.group(1)).stem == Path(b.group(1)).stem:
        return None
    return {Path(a.group(1)).stem: "first", Path(b.group(1)).stem: "second"}.get(row.get("config"))


def paired_stats(ms: List[float], other_ms: List[float], warmup: int) -> Optional[dict]:
    """Step by step, ``ms`` over ``other_ms`` (two engines of one process, steps alternating), past ``warmup``:
    ``n``, ``ratio_median``, ``log_ratio_mean`` and its standard error ``log_ratio_se`` (natural log), or None with
    fewer than 2 steps."""
    logs = [math.log(a / b) for a, b in zip(ms[warmup:], other_ms[warmup:]) if a > 0 and b > 0]
    if len(logs) < 2:
        return None
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    return {"n": len(logs), "ratio_median": math.exp(suite.median(logs)), "log_ratio_mean": mean,
            "log_ratio_se": sd / math.sqrt(len(logs)), "order": "A B B A ... (each first in every other step)"}


def _summarize(log_json: Path, warmup: int, v: suite.Variant, world: int, gpn: int, paired: bool = False,
               n_timed: Optional[int] = None, asked_blocks: int = 0) -> dict:
    """Numbers of one train_gpt.py log (see the module docstring) over its ``n_timed`` steps after ``warmup`` (all
    after it when None; --profile-steps come after those); ``paired``: of its --paired-ds-config engine;
    ``asked_blocks``: the run's ``--overlap-blocks`` (a row whose engine switched nothing says why)."""
    if not log_json.is_file():
        return {"status": "failed"}
    doc = json.loads(log_json.read_text())
    meta, steps, final = doc.get("meta", {}), doc.get("steps", []), doc.get("final") or {}
    if paired:
        steps = [dict(r, **{k: r.get(p) for k, p in PAIRED_KEYS.items()}) for r in steps]
        meta = dict(meta, sdp4bit_replica=meta.get("paired_sdp4bit_replica"))
    timed = steps[warmup:None if n_timed is None else warmup + n_timed]
    out: dict = {"n_params": meta.get("n_params"), "steps_done": len(steps),
                 "versions": meta.get("versions"), "env": meta.get("env"),
                 "replica": meta.get("sdp4bit_replica"), "steps_ms": [round(r["ms"], 2) for r in steps]}
    if final.get("error"):
        out["error"] = final["error"]
    if len(timed) < 2:
        out["status"] = "failed"
        return out
    ms = [r["ms"] for r in timed]
    med = suite.median(ms)
    out.update(status="ok" if final and not final.get("error") else "failed", timed_steps=len(ms),
               ms_per_step=med, ms_min=min(ms), ms_max=max(ms),
               tokens_per_s=meta["tokens_per_step"] / (med / 1e3),
               peak_mem_bytes=final.get("peak_mem_bytes_max_over_ranks",
                                        max(r.get("peak_mem_bytes", 0) for r in steps)),
               peak_mem_kind=meta.get("peak_mem_kind"), loss_last=steps[-1]["loss"])
    last = steps[-1].get("sdp4bit")
    if last is not None:
        last = dict(last, replica=out["replica"])
    out["wire_bytes_per_step"] = _wire_bytes(v, meta["n_params"], world, gpn, last)
    out["wire_bytes_total"] = sum(out["wire_bytes_per_step"].values())
    out["wire_bytes_source"] = "sdp4bit_* levels: engine.sdp4bit_summary() of the last step; others: formula"
    out.update(_counted(timed))
    chosen = meta.get("sdp4bit_overlap_choice")   # weights.overlap omitted: the engine's probe and decision
    if chosen is not None:
        out["overlap_choice"] = chosen
    blocks = (meta.get("args") or {}).get("overlap_blocks")
    if asked_blocks and not blocks:   # (train_gpt.py switched nothing: the automatic choice left it off)
        why = meta.get("overlap_blocks_left_off") or (chosen or {}).get("reason") or "no reason recorded"
        out.update(overlap_ab=None,
                   overlap_ab_error=f"nothing switched: weights.overlap omitted and decided off ({why})")
    if blocks:
        try:
            out["overlap_ab"] = overlap_ab_stats(timed, blocks)
        except ValueError as e:   # (recorded, not raised: the call's other runs still count)
            out.update(overlap_ab=None, overlap_ab_error=str(e))
    cycle = [r.get("cycle_ms") for r in timed]
    if all(c is not None for c in cycle):   # (train_gpt.py records it from d5eaee5 on; not for paired engines)
        # from one step's end to the next: the loop's untimed work between steps included
        out.update(cycle_ms_per_step=suite.median(cycle), steps_cycle_ms=[round(c, 2) for c in cycle])
    return out


def overlap_blocks_error(args: argparse.Namespace, variants: List[suite.Variant]) -> Optional[str]:
    """What is wrong with ``--overlap-blocks`` in these arguments (None: nothing, or not given)."""
    n_blocks = args.overlap_blocks
    if not n_blocks:
        return None
    if n_blocks < 2 or args.paired:
        return f"--overlap-blocks must be >= 2 and excludes --paired, got {n_blocks}{' with --paired' * args.paired}"
    if args.step_sync != "stream":
        return ("--overlap-blocks needs --step-sync stream (waiting for every stream holds each overlapped refresh "
                "inside the step that queued it: both modes would time the same)")
    from deepspeed_sdp4bit.config import SDP4BitConfigError, find_block, parse_block
    for v in variants:   # each config's own warm-up and timed steps (the --slow configs': --*-slow)
        cfg = suite.apply_ds_set(v.load(), suite.ds_sets_of(args.train_arg))
        try:
            what = parse_block(find_block(cfg)).never_overlaps
        except SDP4BitConfigError as e:
            return f"{v.label}: {e}"
        if what:
            return (f"--overlap-blocks switches weights.overlap, which {v.label} {what} (sdp4bit_overlap turns it "
                    f"on; with the key omitted the engine decides, and a run it left off switches nothing)")
        slow = v.config in args.slow
        warm = (args.warmup_slow if args.warmup_slow is not None else args.warmup) if slow else args.warmup
        n = args.timed_slow if slow else args.timed
        pairs = len(block_pairs(range(warm + 1, warm + n + 1), n_blocks))
        if pairs < 2:
            more = "--timed-slow" if slow else "--timed"
            return (f"--overlap-blocks {n_blocks}: {v.label}'s timed steps {warm + 1}..{warm + n} hold {pairs} "
                    f"pair(s) of blocks with a step of each after its first, 2 needed (more {more}; a warm-up of a "
                    f"multiple of {2 * n_blocks} steps starts the timed steps at a pair)")
    return None


def block_pairs(steps, blocks: int) -> List[int]:
    """The pairs ``j`` of blocks (``2j``, ``2j+1``, blocks of ``blocks`` steps from step 1) in which both blocks
    have a step of ``steps`` (1-based) other than their first."""
    have = {(st - 1) // blocks for st in steps if (st - 1) % blocks}
    return sorted(j for j in {b // 2 for b in have} if 2 * j in have and 2 * j + 1 in have)


def overlap_ab_stats(timed: List[dict], blocks: int) -> Optional[dict]:
    """train_gpt.py --overlap-blocks N: the overlapped weight refresh against the refresh inside ``step()`` in one
    process.  Steps are in blocks of N (``overlap`` on in blocks 0, 3, 4, 7, ...); the first step of each block is
    half of either mode and left out.  Blocks 2j and 2j+1 (one of each mode, each mode first in every other
    pair) make a pair: per pair the log of the on block's median over the off block's, of ``ms`` and of
    ``cycle_ms``; ``n`` pairs with both blocks timed (:func:`block_pairs`), ``ratio`` = exp(mean), ``log_ratio_se``,
    and the medians of the steps of each mode in those pairs (``on_ms`` / ``off_ms``, ``on_cycle_ms`` /
    ``off_cycle_ms``).  None with fewer than 2 pairs."""
    by: Dict[int, List[dict]] = {}
    for r in timed:
        if "overlap" in r and not r.get("block_first"):
            by.setdefault((r["step"] - 1) // blocks, []).append(r)
    out: dict = {"blocks": blocks, "order": "on off off on ... (blocks of N; a block's first step left out)"}
    for key, name in (("ms", ""), ("cycle_ms", "cycle_")):
        logs, on_steps, off_steps = [], [], []
        for j in block_pairs([r["step"] for blk in by.values() for r in blk], blocks):
            pair = [by[2 * j], by[2 * j + 1]]
            if any(r.get(key) is None for blk in pair for r in blk):
                continue   # (cycle_ms: none for a run's or a resumed run's first step)
            on, off = (pair if pair[0][0]["overlap"] else pair[::-1])
            if not all(r["overlap"] for r in on) or any(r["overlap"] for r in off):
                raise ValueError(f"overlap_ab_stats: blocks {2 * j} and {2 * j + 1} are not one of each mode")
            logs.append(math.log(suite.median([r[key] for r in on]) / suite.median([r[key] for r in off])))
            on_steps += [r[key] for r in on]
            off_steps += [r[key] for r in off]
        if len(logs) < 2:
            return None if key == "ms" else out
        m, se = suite.mean_se(logs)
        out.update({f"{name}n": len(logs), f"{name}ratio": math.exp(m), f"{name}log_ratio_mean": m,
                    f"{name}log_ratio_se": se, f"on_{name}ms": suite.median(on_steps),
                    f"off_{name}ms": suite.median(off_steps)})
    return out


def _counted(timed: List[dict]) -> dict:
    """The counter's bytes (examples/wire_count.py, rank 0) of the timed step with the median total:
    ``wire_counted_per_step`` by ``op@group:intra|inter``, ``wire_counted_total``, ``wire_counted_inter`` (groups
    spanning NCCL hosts: what crosses the inter-node link, every byte in share-GPU mode)."""
    steps = [r["wire_counted"] for r in timed if isinstance(r.get("wire_counted"), dict)]
    if not steps or len(steps) != len(timed):
        return {}
    med = sorted(steps, key=lambda d: sum(d.values()))[(len(steps) - 1) // 2]
    return {"wire_counted_per_step": {k: int(v) for k, v in sorted(med.items())},
            "wire_counted_total": int(sum(med.values())),
            "wire_counted_inter": int(sum(v for k, v in med.items() if k.endswith(":inter"))),
            "wire_counted_source": "examples/wire_count.py: torch.distributed collectives of rank 0, the timed "
                                   "step with the median total"}
