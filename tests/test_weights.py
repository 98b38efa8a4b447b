"""Tests of the qWD weight all-gather (deepspeed_sdp4bit/collectives/weights.py).

A single 4-rank gloo spawn (shared by all tests here, because a spawn costs far more than the checks) runs
every multi-rank check for the topologies 2x2, 4x1 (4 nodes of 1) and 1x4, with several instances driven in
lockstep from the same master trajectory, and returns snapshots; the assertions run here in the parent.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed_sdp4bit import reference as R
from deepspeed_sdp4bit.collectives.weights import WeightDeltaAllGather
from deepspeed_sdp4bit.config import WeightsConfig
from deepspeed_sdp4bit.ops import get_backend
from deepspeed_sdp4bit.topology import Topology, TopologyShape

from dist_utils import run_distributed

SEED = 4321
PARAMS = [1, 37, 1285, 4096 + 3]     # odd sizes; the first is pure padding on every rank but 0
SMALL_PARAMS = [1, 5, 37]            # for the cheap 1000-step run
# (nodes, gpus per node) -> (steps of the main run, steps of the cheap long run).  2x2 is the case with
# both transport levels; 4x1 (inter only) and 1x4 (intra only) are the degenerate ones, run shorter.
PLAN = {(2, 2): (200, 1000), (4, 1): (40, 0), (1, 4): (40, 0)}
TOPOLOGIES = list(PLAN)


SHORT = 50
# name -> (level, mode, bits, rounding, group_size, bucket_id, steps it runs (None = all))
INSTANCES = {
    "full4": ("full", "diff", 4, "nearest", 64, 0, None),
    "node4": ("node", "diff", 4, "nearest", 64, 1, None),
    "direct": ("full", "direct", 4, "nearest", 64, 2, SHORT),
    "node8s": ("node", "diff", 8, "stochastic", 32, 3, SHORT),
    "node4g2048": ("node", "diff", 4, "nearest", 2048, 4, SHORT),
}
# The cheap long run: node level (its all-to-all path is the intricate one; full level runs 200 steps above).
LONG_INSTANCES = {
    "node4": ("node", "diff", 4, "nearest", 32, 1, None),
}


def _snap_steps(steps):
    return tuple(sorted({1, 13, min(SHORT, steps), steps}))


def _active_steps(spec, steps):
    """Steps an instance takes part in (the ablation/format instances stop early to save time)."""
    return steps if spec[6] is None else min(spec[6], steps)


def _layout(params, world):
    """DeepSpeed ZeRO-3 partitioning: P_i = ceil(numel_i / world); offsets of each piece in a flat shard."""
    P = [-(-n // world) for n in params]
    offs = [sum(P[:i]) for i in range(len(P))]
    return P, offs, sum(P)


def _valid_len(numel, P, s):
    """Elements of partition s of a param that are real (not padding)."""
    return max(0, min(P, numel - s * P))


def _bits(t):
    """Integer view for bit-exact comparison (distinguishes -0.0 from 0.0)."""
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t.contiguous().view(torch.int32)


# --------------------------------------------------------------------------------------------------------
# the multi-rank worker
# --------------------------------------------------------------------------------------------------------
class _Holder:
    """One instance plus the replica storage it writes into, laid out as DeepSpeed would."""

    def __init__(self, topo, params, spec, world, M, P, offs):
        level, mode, bits, rounding, gs, bucket, _ = spec
        cfg = WeightsConfig(mode=mode, bits=bits, rounding=rounding, group_size=gs, replica=level)
        # Node-level instances use a scratch of two groups, so unaligned views are applied window by window.
        scratch = 2 * gs if level == "node" else 1 << 22
        self.ag = WeightDeltaAllGather(topo, cfg, SEED, backend="torch", level=level, scratch_elements=scratch)
        self.spec, self.bucket, self.gs, self.bits = spec, bucket, gs, bits
        self.own = torch.full((M,), float("nan"), dtype=torch.bfloat16)
        self.dst = {}
        N = topo.num_nodes
        if level == "full":
            # param.data of every param, trimmed to its true size; every source writes its valid piece.
            self.store = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in params]
            for s in range(world):
                self.dst[s] = [(self.store[i][s * P[i]: s * P[i] + _valid_len(n, P[i], s)], offs[i])
                               for i, n in enumerate(params) if _valid_len(n, P[i], s) > 0]
            self.mirror = {}
        else:
            # hpZ secondary partition: N untrimmed pieces per param, passed as consecutive plain views, plus
            # a group-aligned mirror of source elements [gs, M) to exercise the fused dequant_add_ path.
            self.store = [torch.full((N * p,), float("nan"), dtype=torch.bfloat16) for p in P]
            self.mirror = {}
            for j, s in enumerate(self.ag.sources_needed()):
                items = [self.store[i][j * P[i]: (j + 1) * P[i]] for i in range(len(P))]
                if M > gs:
                    self.mirror[s] = torch.full((M - gs,), float("nan"), dtype=torch.bfloat16)
                    items.append((self.mirror[s], gs))
                self.dst[s] = items

    def snapshot(self):
        return {"own": self.own.clone(), "store": [t.clone() for t in self.store],
                "mirror": {s: t.clone() for s, t in self.mirror.items()}}


class _WireCounter:
    """Wraps the collectives weights.py calls and counts the bytes this rank really sends."""

    def __init__(self, weights_mod, dist):
        self.bytes = {}
        self.current = None
        orig_ag, orig_a2a = weights_mod._all_gather_single, dist.all_to_all_single

        def ag(out, inp, group=None, async_op=False):
            k = dist.get_world_size(group)
            self._add("inter" if id(group) in self.inter_groups else "intra",
                      (k - 1) * inp.numel() * inp.element_size())
            return orig_ag(out, inp, group=group, async_op=async_op)

        def a2a(out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
            me = dist.get_rank(group)
            self._add("intra", sum(c for i, c in enumerate(in_splits) if i != me) * inp.element_size())
            return orig_a2a(out, inp, out_splits, in_splits, group=group, async_op=async_op)

        weights_mod._all_gather_single = ag
        dist.all_to_all_single = a2a
        self.inter_groups = set()

    def _add(self, level, n):
        d = self.bytes.setdefault(self.current, {})
        d[level] = d.get(level, 0) + n


def _adam_like_step(master, gen, lr):
    """An Adam-sized move: each element by at most lr, signs random (m / sqrt(v) is O(1))."""
    u = torch.tanh(torch.randn(master.shape, generator=gen))
    master.sub_(lr * u)


def _lr(step, total):
    return 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))


def _run_instances(rank, world, topo, params, specs, steps, snap_steps, counter, check_keys):
    P, offs, M = _layout(params, world)
    gen = torch.Generator().manual_seed(1000 + rank)
    # The full initial weights are the same on every rank; each rank's master is its own shard of them.
    full_gen = torch.Generator().manual_seed(77)
    master = torch.empty(M)
    for i, n in enumerate(params):
        w = torch.zeros(P[i] * world)
        w[:n] = 0.02 * torch.randn(n, generator=full_gen)
        master[offs[i]: offs[i] + P[i]] = w[rank * P[i]: (rank + 1) * P[i]]

    holders = {name: _Holder(topo, params, spec, world, M, P, offs) for name, spec in specs.items()}
    out = {name: {"snaps": {}, "max_ratio": 0.0, "err_first": 0.0, "err_last": 0.0, "mean_err": 0.0,
                  "key_ok": [], "other_key_differs": []} for name in specs}

    # Start: replicas are garbage (NaN) until the exact broadcast.
    for name, h in holders.items():
        counter.current = (name, "sync")
        h.ag.full_sync(h.own, h.dst, master_flat=master, bucket_id=h.bucket)
        out[name]["snaps"]["start"] = h.snapshot()
    out["_master_start"] = master.clone()

    for step in range(1, steps + 1):
        _adam_like_step(master, gen, _lr(step, steps))
        for name, h in holders.items():
            level, mode, bits, rounding, gs, bucket, _ = h.spec
            n_act = _active_steps(h.spec, steps)
            if step > n_act:
                continue
            window = max(1, n_act // 4)
            o = out[name]
            prev = h.own.clone()
            delta = master - prev.float()
            counter.current = (name, "refresh")
            h.ag.refresh(master, h.own, h.dst, step=step, bucket_id=bucket)
            err = (master - h.own.float()).abs()
            o["mean_err"] += float(err.mean()) / n_act
            if step <= window:
                o["err_first"] = max(o["err_first"], float(err.max()))
            if step > n_act - window:
                o["err_last"] = max(o["err_last"], float(err.max()))
            if mode == "diff":
                # One step's quantization error of the *current* delta (half a step for nearest rounding,
                # under one step for stochastic), plus the bf16 rounding of the result.
                scale = R.group_scales(delta, bits, gs).repeat_interleave(gs)[:M]
                q_err = (0.5 if rounding == "nearest" else 1.0) * scale * (1 + 1e-6)
                bound = q_err + 2.0 ** -8 * h.own.float().abs() + 1e-6 * master.abs()
                ratio = float((err / bound.clamp_min(1e-30)).max())
                o["max_ratio"] = max(o["max_ratio"], ratio)
            if check_keys and rounding == "stochastic" and step in (1, 2, n_act):
                # The owner's update is the reference op with the stream (seed, step, bucket, owner rank).
                mine = prev.clone()
                R.weight_delta_quantize(master, mine, bits, gs, rounding,
                                        R.make_key(SEED, step, bucket, rank), 0, mode)
                o["key_ok"].append(bool(torch.equal(_bits(mine), _bits(h.own))))
                other = prev.clone()
                R.weight_delta_quantize(master, other, bits, gs, rounding,
                                        R.make_key(SEED, step + 1, bucket, rank), 0, mode)
                o["other_key_differs"].append(not torch.equal(_bits(other), _bits(h.own)))
            if step in snap_steps:
                o["snaps"][step] = h.snapshot()

    for name, h in holders.items():
        out[name]["stats"] = h.ag.stats.as_dict()
        out[name]["bpv_inter"] = h.ag.stats.bits_per_value("inter")
        sizes = h.ag._pool.sizes()
        out[name]["buf_bytes"] = {k: sizes.get(k, 0) for k in ("send", "inter", "intra")}

    # Simulated checkpoint load: the master changes arbitrarily, full_sync restores exact equality.
    load_gen = torch.Generator().manual_seed(555 + rank)
    master = torch.randn(M, generator=load_gen) * 0.3
    out["_master_loaded"] = master.clone()
    for name, h in holders.items():
        counter.current = (name, "sync")
        h.ag.full_sync(h.own, h.dst, master_flat=master, bucket_id=h.bucket)
        out[name]["snaps"]["loaded"] = h.snapshot()
        out[name]["sync_stats"] = h.ag.sync_stats.as_dict()
    # ... and qWD carries on from there, still bit-identical.
    for step in range(steps + 1, steps + 4):
        _adam_like_step(master, gen, 1e-3)
        for name, h in holders.items():
            counter.current = (name, "refresh_after")
            h.ag.refresh(master, h.own, h.dst, step=step, bucket_id=h.bucket)
    for name, h in holders.items():
        out[name]["snaps"]["after_load"] = h.snapshot()
    return out


def _worker(rank, world, shapes):
    """All topologies in one spawn (a spawn costs far more than the collectives), each fully checked."""
    import time

    import torch.distributed as dist

    from deepspeed_sdp4bit.collectives import weights as weights_mod

    counter = _WireCounter(weights_mod, dist)
    results = {}
    for shape in shapes:
        num_nodes, gpus_per_node = shape
        assert num_nodes * gpus_per_node == world
        topo = Topology.build(gpus_per_node)
        counter.inter_groups.add(id(topo.inter_group))
        counter.bytes = {}
        t0 = time.time()
        steps, long_steps = PLAN[shape]
        main = _run_instances(rank, world, topo, PARAMS, INSTANCES, steps, _snap_steps(steps), counter, True)
        main_wire = counter.bytes
        counter.bytes = {}
        long = None
        if long_steps:
            long = _run_instances(rank, world, topo, SMALL_PARAMS, LONG_INSTANCES, long_steps, (long_steps,),
                                  counter, False)
        results[shape] = {"main": main, "long": long, "wire": main_wire, "time": time.time() - t0}
    results["autograd"] = _autograd_check(rank, world, topo)
    return results


def _autograd_check(rank, world, topo):
    """DeepSpeed's fp32 master partitions are Parameters (requires_grad=True).  A refresh that recorded an
    autograd graph would chain it onto the persistent replica buffers and leak memory every step."""
    from deepspeed_sdp4bit.collectives.weights import WeightDeltaAllGather

    wsync = WeightDeltaAllGather(topo, WeightsConfig(replica="full"), seed=0, backend="torch", level="full")
    M = 4096
    master = torch.nn.Parameter(torch.randn(M, generator=torch.Generator().manual_seed(rank)))
    own = master.detach().to(torch.bfloat16)
    full = torch.zeros(world * M, dtype=torch.bfloat16)
    dst = {s: [(full[s * M:(s + 1) * M], 0)] for s in wsync.sources_needed() if s != rank}
    for step in range(2):
        with torch.no_grad():
            master.add_(1e-3)
        wsync.refresh(master, own, dst, step=step)
    wsync.full_sync(own, dst, master_flat=master)
    return {"own": own.requires_grad or own.grad_fn is not None,
            "full": full.requires_grad or full.grad_fn is not None}


# --------------------------------------------------------------------------------------------------------
# parent-side checks
# --------------------------------------------------------------------------------------------------------
_CACHE = {}


def _results(shape):
    """This topology's per-rank results of the single spawn shared by every test here."""
    if "all" not in _CACHE:
        # local_world_size only sets the launcher variables; each Topology is built with an explicit shape.
        _CACHE["all"] = run_distributed(_worker, world_size=4, args=(TOPOLOGIES,), local_world_size=2)
    return [r[shape] for r in _CACHE["all"]]


def _check_identity(res, params, specs, shape, key, expect=None):
    """Every copy of every element equals the owner's own_flat, bit for bit, and nothing is left NaN."""
    world = len(res)
    N, g = shape
    P, offs, M = _layout(params, world)
    sh = TopologyShape(*shape)
    checked = 0
    steps = PLAN[shape][0] if specs is INSTANCES else PLAN[shape][1]
    for name, spec in specs.items():
        level = spec[0]
        gs = spec[4]
        if isinstance(key, int) and key > _active_steps(spec, steps):
            continue  # this instance stopped earlier; its own last step is among the snapshot keys
        owners = [res[s][name]["snaps"][key]["own"] for s in range(world)]
        if expect is not None:
            for s in range(world):
                assert torch.equal(_bits(owners[s]), _bits(expect[s])), (name, key, s)
        for r in range(world):
            snap = res[r][name]["snaps"][key]
            assert torch.equal(_bits(snap["own"]), _bits(owners[r]))
            if level == "full":
                for i, n in enumerate(params):
                    assert not torch.isnan(snap["store"][i]).any(), (name, key, r, i)
                    for s in range(world):
                        L = _valid_len(n, P[i], s)
                        got = snap["store"][i][s * P[i]: s * P[i] + L]
                        want = owners[s][offs[i]: offs[i] + L]
                        assert torch.equal(_bits(got), _bits(want)), (name, key, r, s, i)
                        checked += L
            else:
                l = sh.local_of(r)
                for j in range(N):
                    s = l * N + j
                    for i in range(len(params)):
                        got = snap["store"][i][j * P[i]: (j + 1) * P[i]]
                        want = owners[s][offs[i]: offs[i] + P[i]]
                        assert torch.equal(_bits(got), _bits(want)), (name, key, r, s, i)
                        checked += P[i]
                    if M > gs:
                        assert torch.equal(_bits(snap["mirror"][s]), _bits(owners[s][gs:])), (name, key, r, s)
    assert checked > 0


@pytest.mark.parametrize("shape", TOPOLOGIES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_replicas_bit_identical(shape):
    steps = PLAN[shape][0]
    res = [x["main"] for x in _results(shape)]
    for key in ["start", *_snap_steps(steps)]:
        _check_identity(res, PARAMS, INSTANCES, shape, key)
    # At the start and after the checkpoint load every copy is exactly bf16(master).
    for key, mkey in (("start", "_master_start"), ("loaded", "_master_loaded")):
        expect = [res[s][mkey].to(torch.bfloat16) for s in range(len(res))]
        _check_identity(res, PARAMS, INSTANCES, shape, key, expect=expect)
    _check_identity(res, PARAMS, INSTANCES, shape, "after_load")
    # The replicas really moved with the master (the test would be vacuous if nothing changed).
    r0 = res[0]["full4"]["snaps"]
    assert not torch.equal(_bits(r0["start"]["own"]), _bits(r0[steps]["own"]))


@pytest.mark.parametrize("shape", [s for s in TOPOLOGIES if PLAN[s][1]], ids=lambda s: f"{s[0]}x{s[1]}")
def test_long_run_bit_identical_and_bounded(shape):
    res = [x["long"] for x in _results(shape)]
    _check_identity(res, SMALL_PARAMS, LONG_INSTANCES, shape, PLAN[shape][1])
    for r in res:
        for name in LONG_INSTANCES:
            assert r[name]["max_ratio"] <= 1.0, (name, r[name]["max_ratio"])
            assert r[name]["err_last"] <= 1.5 * r[name]["err_first"], (name, r[name])


@pytest.mark.parametrize("shape", TOPOLOGIES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_error_tracks_master(shape):
    res = [x["main"] for x in _results(shape)]
    for r in res:
        for name, spec in INSTANCES.items():
            if spec[1] != "diff":
                continue
            # Never above one step's quantization error (+ bf16 rounding) of the current delta...
            assert 0.0 < r[name]["max_ratio"] <= 1.0, (name, r[name]["max_ratio"])
            # ... and no growth over the run (the learning rate decays, so honest errors do not grow).
            assert r[name]["err_last"] <= 1.5 * r[name]["err_first"], (name, r[name])
        # Quantizing the weights themselves (qW) is far worse than quantizing their differences.
        assert r["direct"]["mean_err"] > 5 * r["full4"]["mean_err"], (r["direct"]["mean_err"],
                                                                      r["full4"]["mean_err"])
        # Stochastic rounding uses the stream make_key(seed, step, bucket_id, owner rank).
        assert r["node8s"]["key_ok"] == [True] * 3
        assert r["node8s"]["other_key_differs"] == [True] * 3


@pytest.mark.parametrize("shape", TOPOLOGIES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_stats_bytes(shape):
    out = _results(shape)
    N, g = shape
    world = N * g
    steps = PLAN[shape][0]
    sh = TopologyShape(N, g)
    P, offs, M = _layout(PARAMS, world)
    for r, x in enumerate(out):
        res, wire = x["main"], x["wire"]
        l = sh.local_of(r)
        for name, spec in INSTANCES.items():
            level, mode, bits, rounding, gs, bucket, _ = spec
            n_act = _active_steps(spec, steps)
            Mpad = -(-M // gs) * gs
            B = Mpad * bits // 8 + 4 * (Mpad // gs)
            if level == "full":
                intra_rows = (g - 1) * N
            else:
                # rows (sources n'*g + l) that another local rank keeps
                intra_rows = sum(1 for n2 in range(N) if (n2 * g + l) // N != l) if g > 1 else 0
            st = res[name]["stats"]
            assert st["calls"] == n_act
            assert st["bytes_by_level"].get("inter", 0) == n_act * (N - 1) * B
            assert st["bytes_by_level"].get("intra", 0) == n_act * intra_rows * B
            # What the counted bytes claim is what was handed to the collectives.
            w = wire.get((name, "refresh"), {})
            assert w.get("inter", 0) == st["bytes_by_level"].get("inter", 0)
            assert w.get("intra", 0) == st["bytes_by_level"].get("intra", 0)
            ws = wire.get((name, "sync"), {})
            ss = res[name]["sync_stats"]
            assert ss["calls"] == 2
            assert ws.get("inter", 0) == ss["bytes_by_level"].get("inter", 0) == 2 * (N - 1) * M * 2
            assert ws.get("intra", 0) == ss["bytes_by_level"].get("intra", 0) == 2 * intra_rows * M * 2
            # Baseline: the same schedule carrying M bf16 values per source.
            assert st["baseline_bytes"] == n_act * ((N - 1) + intra_rows) * M * 2
            if N > 1:
                assert res[name]["bpv_inter"] == bits + 32 / gs
            if level == "node":
                # Node level holds at most 2N payloads (inter result + all-to-all result), never world.
                assert res[name]["buf_bytes"]["inter"] <= N * B and res[name]["buf_bytes"]["intra"] <= N * B
        if N > 1:
            assert out[r]["main"]["node4g2048"]["bpv_inter"] == pytest.approx(4.015625)


# --------------------------------------------------------------------------------------------------------
# single-process checks
# --------------------------------------------------------------------------------------------------------
def _fake_topology(num_nodes, gpus_per_node, rank):
    shape = TopologyShape(num_nodes, gpus_per_node)
    return Topology(shape=shape, rank=rank, group=None, global_ranks=list(range(shape.world_size)))


@pytest.mark.parametrize("shape", [(2, 2), (4, 1), (1, 4), (2, 4), (4, 2), (3, 2), (2, 3), (4, 4)])
def test_transport_plan(shape):
    """Every rank receives exactly the sources it keeps; all-to-all send and receive counts match."""
    N, g = shape
    sh = TopologyShape(N, g)
    for level in ("full", "node"):
        cfg = WeightsConfig(replica=level)
        ags = [WeightDeltaAllGather(_fake_topology(N, g, r), cfg, 0) for r in range(sh.world_size)]
        for r, ag in enumerate(ags):
            plan = ag._plan
            assert sorted(plan["out_sources"]) == ag.sources_needed()
            if level == "full":
                assert ag.sources_needed() == list(range(sh.world_size))
            else:
                assert len(ag.sources_needed()) == N
            if level == "node" and plan["intra_needed"]:
                n, l = sh.node_of(r), sh.local_of(r)
                for l2 in range(g):
                    peer = ags[sh.rank_of(n, l2)]._plan
                    assert plan["send_rows"][l2] == peer["recv_rows"][l]
                assert plan["intra_sent_rows"] <= N
        if level == "node":
            # every partition is kept by exactly one rank per node
            for n in range(N):
                kept = sorted(s for l in range(g) for s in ags[sh.rank_of(n, l)].sources_needed())
                assert kept == list(range(sh.world_size))


@pytest.mark.parametrize("scratch", [1, 96, 1 << 22])
@pytest.mark.parametrize("mode", ["diff", "direct"])
@pytest.mark.parametrize("bits,gs", [(4, 32), (8, 64)])
def test_apply_views_bit_identical(mode, bits, gs, scratch):
    """Receivers' per-view application (aligned or not, any scratch window) gives the owner's bits."""
    cfg = WeightsConfig(bits=bits, group_size=gs, mode=mode, replica="node")
    ag = WeightDeltaAllGather(_fake_topology(1, 1, 0), cfg, 0, backend="torch", scratch_elements=scratch)
    gen = torch.Generator().manual_seed(bits * 1000 + gs)
    M = 5 * gs + 7
    # Deltas comparable to the weights, so that a receiver rounding in another order would show.
    owner = (0.05 * torch.randn(M, generator=gen)).to(torch.bfloat16)
    master = owner.float() + 0.02 * torch.randn(M, generator=gen)
    receiver = owner.clone()
    before = owner.clone()
    payload, scales = R.weight_delta_quantize(master, owner, bits, gs, "nearest", None, 0, mode)
    # Cut the receiver's copy into pieces at aligned and unaligned offsets (including one element).
    cuts = [0, 1, gs - 3, gs, 2 * gs + 5, 2 * gs + 6, 4 * gs, M]
    items = [(receiver[a:b], a) for a, b in zip(cuts[:-1], cuts[1:])]
    ag._apply(payload, scales, items, get_backend("torch"), torch.device("cpu"))
    assert torch.equal(_bits(receiver), _bits(owner))
    assert (_bits(owner) != _bits(before)).float().mean() > 0.5  # the update really changed the replica


def test_bad_arguments():
    topo = _fake_topology(2, 2, 1)
    with pytest.raises(ValueError, match="level"):
        WeightDeltaAllGather(topo, WeightsConfig(), 0, level="rack")
    with pytest.raises(TypeError, match="cfg"):
        WeightDeltaAllGather(topo, {"bits": 4}, 0)
    with pytest.raises(ValueError, match="seed"):
        WeightDeltaAllGather(topo, WeightsConfig(replica="node"), -1)
    with pytest.raises(ValueError, match="scratch_elements"):
        WeightDeltaAllGather(topo, WeightsConfig(replica="node"), 0, scratch_elements=0)
    ag = WeightDeltaAllGather(topo, WeightsConfig(replica="node"), 0)
    assert ag.sources_needed() == [2, 3]          # rank 1 = node 0, local 1 keeps partitions 2 and 3
    assert ag.sources_needed(0) == [0, 1]
    with pytest.raises(ValueError, match="rank"):
        ag.sources_needed(4)
    M = 10
    master, own = torch.zeros(M), torch.zeros(M, dtype=torch.bfloat16)
    ok = {2: [torch.zeros(M, dtype=torch.bfloat16)], 3: [torch.zeros(M, dtype=torch.bfloat16)]}
    # Argument errors are raised before any collective, so no process group is needed here.
    with pytest.raises(ValueError, match="does not keep"):
        ag.refresh(master, own, {**ok, 0: []}, step=1)
    with pytest.raises(ValueError, match="lacks sources"):
        ag.refresh(master, own, {2: []}, step=1)
    with pytest.raises(ValueError, match="dtype"):
        ag.refresh(master, own, {**ok, 3: [torch.zeros(M)]}, step=1)
    with pytest.raises(ValueError, match="outside the partition"):
        ag.refresh(master, own, {**ok, 3: [(torch.zeros(4, dtype=torch.bfloat16), 7)]}, step=1)
    with pytest.raises(ValueError, match="outside the partition"):
        ag.refresh(master, own, {**ok, 3: [torch.zeros(6, dtype=torch.bfloat16)] * 2}, step=1)
    with pytest.raises(ValueError, match="master_flat"):
        ag.refresh(torch.zeros(M + 1), own, ok, step=1)
    with pytest.raises(ValueError, match="master_flat must have dtype"):
        ag.refresh(master.double(), own, ok, step=1)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        ag.refresh(master, own, {**ok, 2: [torch.zeros(4, 4, dtype=torch.bfloat16)]}, step=1)
    with pytest.raises(TypeError, match="dst"):
        ag.refresh(master, own, [torch.zeros(M)], step=1)


def test_refresh_records_no_autograd_graph():
    _results(TOPOLOGIES[0])
    for rank, res in enumerate(_CACHE["all"]):
        assert res["autograd"] == {"own": False, "full": False}, rank
