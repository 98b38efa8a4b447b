"""TLq-HS gradient reduce-scatter: exactness at 16 bits, bit-equality with the simulator, error bounds,
wire bytes, non-finite propagation, pipelining and reproducibility, on 4 gloo ranks as 2x2, 4x1 and 1x4.

One spawn per topology runs every distributed check (a 4-rank spawn costs several seconds on CI).  Every
rank regenerates all ranks' inputs from fixed seeds, so it can compute the exact result and the simulator's
result for itself locally.
"""

import math
import zlib

import pytest
import torch
import torch.distributed as dist

from deepspeed_sdp4bit.collectives.gradients import (GradientReducer, ResidualStore, expected_list_wire_bytes,
                                                     expected_wire_bytes, list_layout, make_plan,
                                                     partition_numels, segment_numel_for, settings_at,
                                                     simulate_reduce_scatter, simulate_reduce_scatter_flat)
from deepspeed_sdp4bit.collectives.stats import CommStats
from deepspeed_sdp4bit.config import GradientsConfig
from deepspeed_sdp4bit import reference as R
from deepspeed_sdp4bit.topology import Topology, TopologyShape
from dist_utils import run_distributed

WORLD = 4
LIST_SIZES = [1, 7, 1285, 1009, 0]   # odd sizes, a prime, an empty tensor; S = 1 + 2 + 322 + 253 + 0
SEED = 4321


# ----------------------------------------------------------------------------------------------------------
# inputs and expectations computed independently of the code under test
# ----------------------------------------------------------------------------------------------------------
def _gen(*words):
    # crc32, not hash(): str hashes are salted per process and every rank must draw the same numbers
    return torch.Generator().manual_seed(zlib.crc32(repr(words).encode()))


def _int_tensors(rank, dtype):
    g = _gen("int", rank)
    return [torch.randint(-8, 9, (n,), generator=g).to(dtype) for n in LIST_SIZES]


def _normal_flats(tag, S, world=WORLD, dtype=torch.float32):
    return [torch.randn(world * S, generator=_gen(tag, r)).to(dtype) for r in range(world)]


def _student_t_flats(tag, S, world=WORLD):
    # Student-t with 2 degrees of freedom: z / sqrt(chi2_2 / 2), heavy tails like real gradients
    out = []
    for r in range(world):
        g = _gen(tag, r)
        z = torch.randn(world * S, generator=g)
        chi2 = torch.randn(world * S, generator=g) ** 2 + torch.randn(world * S, generator=g) ** 2
        out.append(z / torch.sqrt(chi2 / 2))
    return out


def _ds_slice(total, world, rank):
    """DeepSpeed reduce_scatter_coalesced's share of one tensor for ``rank``."""
    n = total.numel()
    chunk = math.ceil(n / world)
    return total.reshape(-1)[rank * chunk:min((rank + 1) * chunk, n)]


def _ds_interleave(tensors, world):
    """DeepSpeed's flat layout [world * S]: for each rank, each tensor's padded partition."""
    parts = []
    for r in range(world):
        for t in tensors:
            chunk = math.ceil(t.numel() / world)
            piece = t.reshape(-1)[r * chunk:r * chunk + chunk]
            parts.append(piece)
            parts.append(torch.zeros(chunk - piece.numel(), dtype=t.dtype))
    return torch.cat(parts)


def _error_bound(inputs, shape, cfg, op):
    """Per-element bound on |result - exact| for every rank's output, from the inputs alone.

    Per group (G elements of a padded destination segment; H applied blockwise when cfg.hadamard) let
    M_i = max|H x_i| on rank i.  A quantization to q = 2**(b-1)-1 levels errs by at most r * scale per
    element (r = 1/2 nearest, 1 stochastic) with scale = max/q.  Two levels: node n's intra sum has error
    <= sum_i r M_i / q1 and magnitude <= sum_i M_i (1 + r/q1); the requantization adds r * that / q2.
    Summing over nodes gives B in the transformed domain; the inverse (H e)/h is an average of +-e_j so its
    magnitude is <= max|e| <= B.  A 16-bit (or absent) level has 1/q = 0.  Slack: fp32 rounding.
    """
    W = shape.world_size
    S = inputs[0].numel() // W
    G = cfg.group_size
    Sp = -(-S // G) * G
    r = 0.5 if cfg.rounding == "nearest" else 1.0
    inv_q1 = 0.0 if (shape.gpus_per_node == 1 or cfg.intra_bits == 16) else 1.0 / R.qmax_for_bits(cfg.intra_bits)
    inv_q2 = 0.0 if (shape.num_nodes == 1 or cfg.inter_bits == 16) else 1.0 / R.qmax_for_bits(cfg.inter_bits)
    M = []
    for x in inputs:
        seg = torch.zeros(W, Sp)
        seg[:, :S] = x.float().view(W, S)
        z = R.hadamard_transform(seg.reshape(-1), cfg.hadamard_size).view(W, Sp) if cfg.hadamard else seg
        M.append(z.view(W, Sp // G, G).abs().amax(dim=2))           # [dest, group]
    B = torch.zeros(W, Sp // G)
    for n in range(shape.num_nodes):
        ranks = shape.intra_ranks(n)
        m_sum = sum(M[i] for i in ranks)
        B += r * m_sum * inv_q1 + r * m_sum * (1 + r * inv_q1) * inv_q2
    slack = 1e-5 * sum(M)
    post = 1.0 / W if op == "mean" else 1.0
    per_elem = ((B + slack) * post).repeat_interleave(G, dim=1)[:, :S]
    return per_elem                                                   # [dest, S]


def _exact(inputs, op):
    W = len(inputs)
    total = sum(x.double() for x in inputs).view(W, -1)
    return total / W if op == "mean" else total


# ----------------------------------------------------------------------------------------------------------
# the distributed checks (one spawn runs them on all three topologies)
# ----------------------------------------------------------------------------------------------------------
def _check_exact_16bit(topo, rank, W):
    """(a) both levels 16-bit: exact, DeepSpeed list layout, bf16/fp16/fp32, equal to dist reduce-scatter."""
    cfg = GradientsConfig(intra_bits=16, inter_bits=16, rounding="nearest")
    red = GradientReducer(topo, cfg, seed=SEED)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        mine = _int_tensors(rank, dtype)
        before = [t.clone() for t in mine]
        totals = [sum(_int_tensors(q, torch.float32)[i] for q in range(W)) for i in range(len(LIST_SIZES))]
        for op in ("sum", "mean"):
            outs = red.reduce_scatter(mine, op=op)
            assert len(outs) == len(LIST_SIZES)
            for i, (o, tot) in enumerate(zip(outs, totals)):
                want = _ds_slice(tot, W, rank) / (W if op == "mean" else 1)
                assert o.dtype == dtype and o.shape == want.shape, (dtype, op, i, o.shape, want.shape)
                assert torch.equal(o, want.to(dtype)), (dtype, op, i)
        assert all(torch.equal(a, b) for a, b in zip(mine, before)), "inputs were modified"
        # flat API against torch.distributed's own reduce-scatter of the same buffer
        flat = _ds_interleave(mine, W)
        ref = torch.empty(flat.numel() // W, dtype=dtype)
        # reduce_scatter_single is the current name; reduce_scatter_tensor the older (deprecated) one
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(ref, flat.clone())
        assert torch.equal(red.reduce_scatter_flat(flat, op="sum"), ref), dtype
    # a single tensor argument is accepted like a one-element list
    t = _int_tensors(rank, torch.float32)[2]
    assert torch.equal(red.reduce_scatter(t, op="sum")[0], red.reduce_scatter([t], op="sum")[0])


def _check_quantized(topo, rank, W, shape):
    """(b) bits 8/4 (and mixed): bit-equal to the simulator, within the derived bound; list path too."""
    S = 300                                    # not a multiple of 128: exercises the internal padding
    xs = _normal_flats("q", S)
    exact = _exact(xs, "mean")
    max_err = 0.0
    for rounding in ("nearest", "stochastic"):
        for hadamard in (True, False):
            cfg = GradientsConfig(intra_bits=8, inter_bits=4, rounding=rounding, hadamard=hadamard)
            red = GradientReducer(topo, cfg, seed=SEED)
            for op in ("mean", "sum"):
                out = red.reduce_scatter_flat(xs[rank], op=op, step=3, bucket_id=1)
                sim = simulate_reduce_scatter_flat(xs, shape, cfg, SEED, step=3, bucket_id=1, op=op)
                assert torch.equal(out, sim[rank]), (rounding, hadamard, op)
                want = exact[rank] * (W if op == "sum" else 1)
                err = (out.double() - want).abs()
                bound = _error_bound(xs, shape, cfg, op)[rank].double()
                assert bool((err <= bound).all()), (rounding, hadamard, op, float((err - bound).max()))
                if op == "mean":
                    max_err = max(max_err, float(err.max()))
    assert max_err > 0, "quantized levels must actually quantize"

    # mixed widths (only distinct paths on two levels): still the simulator's bits and within the bound
    if shape.num_nodes > 1 and shape.gpus_per_node > 1:
        for bits in ((16, 4), (8, 16), (4, 8)):
            cfg = GradientsConfig(intra_bits=bits[0], inter_bits=bits[1], rounding="stochastic")
            out = GradientReducer(topo, cfg, seed=SEED).reduce_scatter_flat(xs[rank], step=1)
            sim = simulate_reduce_scatter_flat(xs, shape, cfg, SEED, step=1)
            assert torch.equal(out, sim[rank]), bits
            bound = _error_bound(xs, shape, cfg, "mean")[rank].double()
            assert bool(((out.double() - exact[rank]).abs() <= bound).all()), bits

    # list API in bf16: the list simulator's bits (pieces group-aligned); with align_params=False it is
    # the flat algorithm on DeepSpeed's packed interleaved layout
    tensors = [[torch.randn(n, generator=_gen("l", q, n)).bfloat16() for n in LIST_SIZES] for q in range(W)]
    for align in (True, False):
        cfg = GradientsConfig(rounding="stochastic", align_params=align)
        outs = GradientReducer(topo, cfg, seed=SEED).reduce_scatter(tensors[rank], step=2, bucket_id=5)
        sim = simulate_reduce_scatter(tensors, shape, cfg, SEED, step=2, bucket_id=5)[rank]
        assert all(o.dtype == torch.bfloat16 and torch.equal(o, w) for o, w in zip(outs, sim)), align
        if align:
            continue
        flat = simulate_reduce_scatter_flat([_ds_interleave(t, W) for t in tensors], shape, cfg, SEED, step=2,
                                            bucket_id=5)[rank]
        col = 0
        for o, n, chunk in zip(outs, LIST_SIZES, partition_numels(LIST_SIZES, W)):
            want = flat[col:col + chunk][:max(0, min(chunk, n - rank * chunk))]
            assert torch.equal(o, want), n
            col += chunk


def _check_hadamard_helps(topo, rank, W):
    """(b) on heavy-tailed inputs the Hadamard transform lowers the error (nearest, same inputs)."""
    S = 512
    xs = _student_t_flats("t", S)
    exact = _exact(xs, "mean")
    sq = {}
    for hadamard in (True, False):
        cfg = GradientsConfig(rounding="nearest", hadamard=hadamard)
        out = GradientReducer(topo, cfg, seed=SEED).reduce_scatter_flat(xs[rank])
        e = torch.tensor([float(((out.double() - exact[rank]) ** 2).sum())])
        dist.all_reduce(e)
        sq[hadamard] = float(e)
    return sq[True] / sq[False]


def _check_bytes(topo, rank, W, shape):
    """(c) stats equal the wire formula; 8.25 and 4.25 bits per value; baseline is a bf16 ring RS."""
    S = 300
    N, g = shape.num_nodes, shape.gpus_per_node
    Sp = 384                                   # 300 padded to groups of 128
    cfg = GradientsConfig(intra_bits=8, inter_bits=4, group_size=128)
    red = GradientReducer(topo, cfg, seed=SEED)
    xs = _normal_flats("b", S)
    red.reduce_scatter_flat(xs[rank])
    red.reduce_scatter_flat(xs[rank])
    st = red.stats
    want_intra = (g - 1) * N * Sp * (8 / 8 + 4 / 128)          # g-1 peers, N segments each, + fp32 scales
    want_inter = (N - 1) * Sp * (4 / 8 + 4 / 128)
    got = dict(st.last_call)
    assert got.get("intra", 0) == want_intra and got.get("inter", 0) == want_inter, got
    assert st.calls == 2 and st.bytes_by_level.get("intra", 0) == 2 * want_intra
    assert st.last_baseline_bytes == (W - 1) * S * 2
    formula = expected_wire_bytes(S, shape, cfg, torch.float32)
    assert formula["intra"] == want_intra and formula["inter"] == want_inter and formula["padded_segment"] == Sp
    if g > 1:
        assert st.bits_per_value("intra") == 8.25
    if N > 1:
        assert st.bits_per_value("inter") == 4.25
    assert st.total_bytes < st.baseline_bytes
    d = st.as_dict()
    assert d["calls"] == 2 and d["total_bytes"] == st.total_bytes
    st.reset()
    assert st.calls == 0 and st.total_bytes == 0 and st.baseline_bytes == 0

    # the list API counts its (unpadded) DeepSpeed segment; 16-bit levels send the dtype's bytes
    cfg16 = GradientsConfig(intra_bits=16, inter_bits=16)
    red16 = GradientReducer(topo, cfg16, seed=SEED)
    red16.reduce_scatter(_int_tensors(rank, torch.bfloat16))
    S_list = sum(math.ceil(n / W) for n in LIST_SIZES)
    assert segment_numel_for(LIST_SIZES, W) == S_list
    assert red16.stats.last_call.get("intra", 0) == (g - 1) * N * S_list * 2
    assert red16.stats.last_call.get("inter", 0) == (N - 1) * S_list * 2
    assert red16.stats.last_baseline_bytes == (W - 1) * S_list * 2

    # the quantized list API: every piece starts a group (LIST_SIZES: pieces 1, 2, 322, 253, 0 at columns
    # 0, 128, 256, 640, 893: 893 values, 896 with the group padding, where the packed layout has 578 -> 640)
    for align, S_wire in ((True, 896), (False, 640)):
        cfg = GradientsConfig(intra_bits=8, inter_bits=4, group_size=128, align_params=align)
        redl = GradientReducer(topo, cfg, seed=SEED)
        redl.reduce_scatter(_int_tensors(rank, torch.bfloat16))
        want = {"intra": (g - 1) * N * S_wire * (8 / 8 + 4 / 128), "inter": (N - 1) * S_wire * (4 / 8 + 4 / 128)}
        got = redl.stats.last_call
        assert got.get("intra", 0) == want["intra"] and got.get("inter", 0) == want["inter"], (align, got)
        assert redl.stats.last_baseline_bytes == (W - 1) * S_list * 2
        formula = expected_list_wire_bytes(LIST_SIZES, shape, cfg)
        assert (formula["intra"], formula["inter"], formula["padded_segment"]) == (
            want["intra"], want["inter"], S_wire), (align, formula)
        assert formula["align_padding"] == (893 - S_list if align else 0)
        assert formula["baseline"] == (W - 1) * S_list * 2

    # buffer reuse: no new communication buffer for a repeated or smaller size
    n_alloc = red.buffer_allocations()
    assert n_alloc > 0
    red.reduce_scatter_flat(xs[rank])
    red.reduce_scatter_flat(_normal_flats("small", 100)[rank])
    assert red.buffer_allocations() == n_alloc


def _check_nonfinite(topo, rank, W):
    """(d) NaN on one rank, inf on another: non-finite at the owners' groups, finite everywhere else."""
    S = 300
    G = 128
    bad = {(2, 5): float("nan"), (0, 200): float("inf")}   # (destination, index) -> value
    xs = _normal_flats("nf", S)
    xs[1][2 * S + 5] = float("nan")
    xs[3][0 * S + 200] = float("inf")
    for cfg in (GradientsConfig(rounding="stochastic"), GradientsConfig(intra_bits=16, inter_bits=16)):
        out = GradientReducer(topo, cfg, seed=SEED).reduce_scatter_flat(xs[rank])
        finite = torch.isfinite(out)
        mine = [idx for (dest, idx) in bad if dest == rank]
        for idx in mine:
            assert not bool(finite[idx]), (cfg.intra_bits, idx)
        # outside the group of a bad element everything stays finite (the error is confined to its group)
        allowed = torch.zeros(S, dtype=torch.bool)
        for idx in mine:
            lo = idx // G * G
            allowed[lo:lo + G] = True
        assert bool(finite[~allowed].all()), cfg.intra_bits


def _check_pipeline_and_steps(topo, rank, W, shape):
    """(e) pipeline_chunks=2 equals 1 for nearest and equals the simulator for SR; (f) reproducible SR."""
    S = 300                                    # 3 groups: chunks of 1 and 2 groups
    xs = _normal_flats("p", S)
    k1 = GradientReducer(topo, GradientsConfig(rounding="nearest"), seed=SEED)
    k2 = GradientReducer(topo, GradientsConfig(rounding="nearest", pipeline_chunks=2), seed=SEED)
    assert len(make_plan(S, shape, k2.cfg).chunks) == 2
    assert torch.equal(k1.reduce_scatter_flat(xs[rank]), k2.reduce_scatter_flat(xs[rank]))
    for bits in ((8, 4), (16, 16), (8, 16), (16, 4)):
        # every level kind with chunks in flight together (16-bit levels chunk per element, not per group)
        cfg_k = GradientsConfig(intra_bits=bits[0], inter_bits=bits[1], rounding="stochastic", pipeline_chunks=3)
        out = GradientReducer(topo, cfg_k, seed=SEED).reduce_scatter_flat(xs[rank], step=7)
        assert torch.equal(out, simulate_reduce_scatter_flat(xs, shape, cfg_k, SEED, step=7)[rank]), bits
        if bits == (16, 16):
            assert torch.equal(out, GradientReducer(topo, GradientsConfig(intra_bits=16, inter_bits=16), seed=SEED)
                               .reduce_scatter_flat(xs[rank], step=7)), "chunking changed a 16-bit reduce"

    # error feedback: the collective's residuals evolve as the simulator's, step after step, new inputs each step
    for intra in (8, 16):
        cfg_ef = GradientsConfig(intra_bits=intra, rounding="stochastic", pipeline_chunks=2, error_feedback=True)
        red_ef, res = GradientReducer(topo, cfg_ef, seed=SEED), [ResidualStore() for _ in range(W)]
        for t in (3, 4):
            xt = _normal_flats(("ef", t), S)
            out = red_ef.reduce_scatter_flat(xt[rank], step=t)
            assert torch.equal(out, simulate_reduce_scatter_flat(xt, shape, cfg_ef, SEED, step=t, residuals=res)[rank])
        mine, sim = red_ef.residuals.tensors(), res[rank].tensors()
        assert sorted(mine, key=repr) == sorted(sim, key=repr) and (not sim) == (shape.num_nodes == 1)
        assert all(torch.equal(mine[k], sim[k]) for k in sim), intra

    # gradients.inter8_steps: steps below it are the 8-bit config's, bit for bit and byte for byte, later ones the
    # 4-bit config's; the collective switches where the simulator does (flat and list layouts)
    cfg_i8 = GradientsConfig(rounding="stochastic", pipeline_chunks=2, inter8_steps=2)
    red_i8 = GradientReducer(topo, cfg_i8, seed=SEED)
    for t, bits in ((0, 8), (1, 8), (2, 4), (9, 4)):
        like = GradientReducer(topo, GradientsConfig(rounding="stochastic", pipeline_chunks=2, inter_bits=bits),
                               seed=SEED)
        before = dict(red_i8.stats.bytes_by_level)
        out = red_i8.reduce_scatter_flat(xs[rank], step=t)
        assert torch.equal(out, like.reduce_scatter_flat(xs[rank], step=t)), (t, bits)
        assert torch.equal(out, simulate_reduce_scatter_flat(xs, shape, cfg_i8, SEED, step=t)[rank]), t
        sent = {k: v - before.get(k, 0) for k, v in red_i8.stats.bytes_by_level.items()}
        assert sent == dict(like.stats.bytes_by_level), (t, sent, like.stats.bytes_by_level)
        ts = [xs[rank][:70].clone(), xs[rank][70:301].clone()]
        got = red_i8.reduce_scatter(ts, step=t)
        want = simulate_reduce_scatter([[x[:70].clone(), x[70:301].clone()] for x in xs], shape, cfg_i8, SEED,
                                       step=t)[rank]
        assert all(torch.equal(g, w) for g, w in zip(got, want)), t
    assert red_i8.cfg.inter_bits == 4 and red_i8.cfg_at(1).inter_bits == 8 and red_i8.cfg_at(2) is red_i8.cfg
    # the 8-bit steps' buffers are dropped at the first step past them: the pool then holds the 4-bit sizes only
    fresh = GradientReducer(topo, cfg_i8, seed=SEED)
    fresh.reduce_scatter_flat(xs[rank], step=0)
    fresh.reduce_scatter_flat(xs[rank], step=5)
    plain = GradientReducer(topo, GradientsConfig(rounding="stochastic", pipeline_chunks=2), seed=SEED)
    plain.reduce_scatter_flat(xs[rank], step=5)
    assert fresh.buffer_bytes() == plain.buffer_bytes()
    fresh.reduce_scatter_flat(xs[rank], step=1)   # back before the switch (a rollback to an earlier checkpoint)
    assert fresh.buffer_bytes() > plain.buffer_bytes() or shape.num_nodes == 1
    fresh.reduce_scatter_flat(xs[rank], step=6)   # ... and past it again: dropped again
    assert fresh.buffer_bytes() == plain.buffer_bytes()
    # with error feedback too: the residuals carry across the switch as the simulator's do
    cfg_efi8 = GradientsConfig(rounding="stochastic", pipeline_chunks=2, error_feedback=True, inter8_steps=1)
    red_efi8, res = GradientReducer(topo, cfg_efi8, seed=SEED), [ResidualStore() for _ in range(W)]
    for t in (0, 1, 2):
        xt = _normal_flats(("efi8", t), S)
        out = red_efi8.reduce_scatter_flat(xt[rank], step=t)
        assert torch.equal(out, simulate_reduce_scatter_flat(xt, shape, cfg_efi8, SEED, step=t, residuals=res)[rank]), t
        red_efi8.residuals.end_step()
        for d in res:
            d.end_step()
    mine, sim = red_efi8.residuals.tensors(), res[rank].tensors()
    assert sorted(mine, key=repr) == sorted(sim, key=repr) and all(torch.equal(mine[k], sim[k]) for k in sim)

    red = GradientReducer(topo, GradientsConfig(rounding="stochastic"), seed=SEED)
    a = red.reduce_scatter_flat(xs[rank], step=5)
    b = red.reduce_scatter_flat(xs[rank], step=5)
    c = red.reduce_scatter_flat(xs[rank], step=6)
    d = red.reduce_scatter_flat(xs[rank], step=5, bucket_id=1)
    e = GradientReducer(topo, GradientsConfig(rounding="stochastic"), seed=SEED + 1).reduce_scatter_flat(
        xs[rank], step=5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d) and not torch.equal(a, e)

    # different ranks draw different rounding bits: with identical inputs everywhere and one 8-bit level
    # (no transform), equal bits would make the sum of the W codes a multiple of W for every element
    if shape.num_nodes == 1:
        cfg = GradientsConfig(intra_bits=8, rounding="stochastic", hadamard=False)
        x = _normal_flats("same", S)[0]
        out = GradientReducer(topo, cfg, seed=SEED).reduce_scatter_flat(x, op="sum").double()
        seg = torch.zeros(-(-S // 128) * 128)
        seg[:S] = x.view(W, S)[rank]
        scale = (seg.view(-1, 128).abs().amax(dim=1) / 127).repeat_interleave(128)[:S].double()
        code_sums = torch.round(out / scale)
        assert float((out / scale - code_sums).abs().max()) < 1e-3
        assert float((code_sums.remainder(W) != 0).double().mean()) > 0.3


TOPOLOGIES = {"2x2": 2, "4x1": 1, "1x4": 4}    # name (nodes x ranks per node) -> gpus_per_node


def _worker(rank, world):
    # All three layouts in one spawn: process start-up (torch, deepspeed imports) dominates the cost.
    results = {}
    for name, gpus_per_node in TOPOLOGIES.items():
        torch.manual_seed(0)
        topo = Topology.build(gpus_per_node)
        shape = topo.shape
        try:
            _check_exact_16bit(topo, rank, world)
            _check_quantized(topo, rank, world, shape)
            ratio = _check_hadamard_helps(topo, rank, world)
            _check_bytes(topo, rank, world, shape)
            _check_nonfinite(topo, rank, world)
            _check_pipeline_and_steps(topo, rank, world, shape)
        except AssertionError as e:
            raise AssertionError(f"topology {name}: {e}") from e
        results[name] = {"hadamard_mse_ratio": ratio, "shape": (shape.num_nodes, shape.gpus_per_node)}
    return results


def test_gradient_reducer_distributed():
    res = run_distributed(_worker, WORLD)
    for name, gpus_per_node in TOPOLOGIES.items():
        assert all(r[name]["shape"] == (WORLD // gpus_per_node, gpus_per_node) for r in res), name
        # every rank saw the same all-reduced errors; heavy tails: the transform must cut the squared error
        assert res[0][name]["hadamard_mse_ratio"] < 0.6, (name, res[0][name])


# ----------------------------------------------------------------------------------------------------------
# single-process checks
# ----------------------------------------------------------------------------------------------------------
def _fake_topology(num_nodes, gpus_per_node, rank=0):
    # validation happens before any communication, so no process group is needed here
    shape = TopologyShape(num_nodes, gpus_per_node)
    return Topology(shape=shape, rank=rank, group=None, global_ranks=list(range(shape.world_size)))


def test_bad_inputs_raise_clear_errors():
    red = GradientReducer(_fake_topology(2, 2), GradientsConfig(), seed=1)
    with pytest.raises(ValueError, match="multiple of the data-parallel world"):
        red.reduce_scatter_flat(torch.zeros(10))
    with pytest.raises(ValueError, match="op must be one of"):
        red.reduce_scatter_flat(torch.zeros(8), op="max")
    with pytest.raises(ValueError, match="dtype"):
        red.reduce_scatter_flat(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D"):
        red.reduce_scatter_flat(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="step"):
        red.reduce_scatter_flat(torch.zeros(8), step=-1)
    with pytest.raises(ValueError, match="share one dtype"):
        red.reduce_scatter([torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="at least one"):
        red.reduce_scatter([])
    with pytest.raises(TypeError, match="GradientsConfig"):
        GradientReducer(_fake_topology(2, 2), {"intra_bits": 8}, seed=1)
    with pytest.raises(ValueError, match="seed"):
        GradientReducer(_fake_topology(2, 2), GradientsConfig(), seed=-3)
    with pytest.raises(ValueError, match="backend"):
        GradientReducer(_fake_topology(2, 2), GradientsConfig(), seed=1, backend="cudnn")
    with pytest.raises(ValueError, match="one tensor per rank"):
        simulate_reduce_scatter_flat([torch.zeros(8)], TopologyShape(2, 2), GradientsConfig(), 1)


def test_plan_chunks_are_group_aligned_and_cover_the_segment():
    shape = TopologyShape(2, 2)
    for S, K in ((1, 4), (300, 2), (1000, 3), (129, 64)):
        plan = make_plan(S, shape, GradientsConfig(pipeline_chunks=K))
        assert plan.padded == -(-S // 128) * 128
        starts = [a for a, _ in plan.chunks]
        lengths = [L for _, L in plan.chunks]
        assert all(L > 0 and L % 128 == 0 for L in lengths) and sum(lengths) == plan.padded
        assert starts == [sum(lengths[:i]) for i in range(len(lengths))]
        assert len(plan.chunks) == min(K, plan.padded // 128)
    # both levels at 16 bits: no padding, no transform
    plan = make_plan(300, shape, GradientsConfig(intra_bits=16, inter_bits=16))
    assert plan.padded == 300 and plan.hadamard is None


def test_list_layout_starts_every_piece_on_a_group():
    parts, cols, S = list_layout(LIST_SIZES, WORLD, 1)            # DeepSpeed's packed layout
    assert parts == [1, 2, 322, 253, 0] and cols == [0, 1, 3, 325, 578] and S == 578
    parts, cols, S = list_layout(LIST_SIZES, WORLD, 128)
    assert cols == [0, 128, 256, 640, 893] and S == 893
    # 16-bit levels: nothing is quantized, so nothing is aligned
    cfg16 = GradientsConfig(intra_bits=16, inter_bits=16)
    assert expected_list_wire_bytes(LIST_SIZES, TopologyShape(2, 2), cfg16)["align_padding"] == 0


def _crush_bucket(W):
    """A bucket like DeepSpeed's: a weight with O(1) gradients, a bias with 1e-3 gradients, an odd-sized
    weight, a norm gain with 1e-4 gradients (the small ones share groups with the large ones when packed)."""
    sizes, scales = [1000, 40, 1285, 24], [1.0, 1e-3, 1.0, 1e-4]
    return [[(torch.randn(n, generator=_gen("crush", q, n)) * s + s).bfloat16() for n, s in zip(sizes, scales)]
            for q in range(W)]


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (4, 1), (1, 4)])
def test_small_gradients_next_to_large_ones_survive(nodes, gpus):
    """Issue 21: a large gradient's abs-max must not set the scale of a neighbouring bias or norm gain."""
    shape = TopologyShape(nodes, gpus)
    W = shape.world_size
    tensors = _crush_bucket(W)
    exact = [sum(tensors[q][i].double() for q in range(W)) / W for i in range(len(tensors[0]))]
    rel = {}
    for align in (True, False):
        # the default config must be the aligned one: this test fails with the packed layout as default
        cfg = GradientsConfig() if align else GradientsConfig(align_params=False)
        outs = simulate_reduce_scatter(tensors, shape, cfg, SEED, step=1)
        rel[align] = []
        for i, e in enumerate(exact):
            got = torch.cat([outs[r][i].double() for r in range(W)])
            rel[align].append(float((got - e).norm() / e.norm()))
    # aligned: every tensor is quantized on its own scale (measured 0.03-0.24 at 4 bits, 0.002-0.01 at 8)
    assert max(rel[True]) < 0.35 and rel[True][1] < 0.15 and rel[True][3] < 0.15, rel[True]
    # packed (the old layout): the bias and the norm gain drown in their neighbours' quantization noise
    assert rel[False][1] > 2 and rel[False][3] > 2, rel[False]


def test_one_rank_world_is_identity_and_sends_nothing():
    x = torch.randn(37, generator=_gen("one"))
    out = simulate_reduce_scatter_flat([x], TopologyShape(1, 1), GradientsConfig(), 1)[0]
    assert torch.equal(out, x)
    assert expected_wire_bytes(37, TopologyShape(1, 1), GradientsConfig())["total"] == 0


def test_degenerate_sizes_need_no_communication():
    # one rank: the reduce is the input itself (mean over one rank), nothing goes on the wire
    red = GradientReducer(_fake_topology(1, 1), GradientsConfig(), seed=1)
    ts = [torch.randn(n, generator=_gen("w1", n)).bfloat16() for n in (5, 0, 130)]
    outs = red.reduce_scatter(ts)
    assert all(torch.equal(o, t) for o, t in zip(outs, ts))
    assert red.stats.total_bytes == 0 and red.stats.calls == 1
    # empty tensors only: every rank gets empty partitions without touching a process group
    red4 = GradientReducer(_fake_topology(2, 2, rank=3), GradientsConfig(), seed=1)
    outs = red4.reduce_scatter([torch.zeros(0), torch.zeros(0)])
    assert [o.numel() for o in outs] == [0, 0]


def test_stats_dataclass():
    st = CommStats()
    st.begin_call()
    st.add("intra", 33, 32)
    st.add("intra", 33, 32)
    st.add_baseline(100)
    assert st.bytes_by_level == {"intra": 66} and st.bits_per_value("intra") == 8.25
    assert st.as_dict()["compression"] == pytest.approx(100 / 66)
    with pytest.raises(ValueError, match="nbytes"):
        st.add("intra", -1)
    with pytest.raises(ValueError, match="level"):
        st.add("", 1)
    st.reset()
    assert st.as_dict()["total_bytes"] == 0 and st.calls == 0


@pytest.mark.parametrize("nodes,gpus,intra_bits", [(2, 2, 8), (4, 1, 8), (2, 2, 16)])
def test_error_feedback_carries_the_inter_level_rounding_error(nodes, gpus, intra_bits):
    """gradients.error_feedback: fed the same gradients T times, the sum of what arrives follows T times the exact
    reduce to within about one step's error (without it the stochastic errors add up, growing as sqrt(T)); the
    residuals are bf16, one per (bucket, chunk); a non-finite input leaves finite residuals; and it needs a
    quantized inter level."""
    shape = TopologyShape(nodes, gpus)
    W, S, T = shape.world_size, 1024, 24
    inputs = _normal_flats(("ef", nodes, gpus), S, W)
    exact = [sum(x.view(W, S)[r] for x in inputs) / W for r in range(W)]
    errs = {}
    for ef in (False, True):
        cfg = GradientsConfig(intra_bits=intra_bits, inter_bits=4, error_feedback=ef, pipeline_chunks=2)
        res = [ResidualStore() for _ in range(W)] if ef else None
        total = [torch.zeros(S) for _ in range(W)]
        for t in range(T):
            outs = simulate_reduce_scatter_flat(inputs, shape, cfg, SEED, step=t, bucket_id=3, residuals=res)
            for r in range(W):
                total[r] += outs[r].float()
        errs[ef] = max(float((total[r] - T * exact[r]).norm() / exact[r].norm()) for r in range(W))
        if ef:
            assert all([k[1] for k in d.keys()] == [0, 1] and all(k[0] == ("bucket", 3, S) for k in d.keys())
                       and all(v.dtype == torch.bfloat16 for v in d.tensors().values()) for d in res)
            one_step = max(float((outs[r].float() - exact[r]).norm() / exact[r].norm()) for r in range(W))
    assert errs[True] < 2 * one_step and errs[True] < errs[False] / 3, errs
    # an overflowing step: the residuals stay finite (DeepSpeed skips the step; end_step(skipped) drops them)
    cfg = GradientsConfig(intra_bits=intra_bits, inter_bits=4, error_feedback=True)
    res = [ResidualStore() for _ in range(W)]
    bad = [x.clone() for x in inputs]
    bad[0][5] = float("inf")
    simulate_reduce_scatter_flat(bad, shape, cfg, SEED, step=0, residuals=res)
    assert all(torch.isfinite(v.float()).all() and v.abs().sum() > 0 for d in res for v in d.tensors().values())
    for d in res:
        d.end_step(skipped=True)
    assert all(d.nbytes() == 0 for d in res)
    with pytest.raises(ValueError, match="needs residuals: one ResidualStore per rank"):
        simulate_reduce_scatter_flat(inputs, shape, cfg, SEED)
    with pytest.raises(ValueError, match="error_feedback carries the inter-node level's quantization error, but "
                                         "inter_bits is 16"):
        GradientsConfig(inter_bits=16, error_feedback=True)


def test_residual_store_keys_and_steps():
    """One residual per key, zeros at first, kept while used; a step that does not use one drops it; a skipped step
    drops all; the bucket key, not the call count, names a residual (gradient accumulation reuses it)."""
    st = ResidualStore()
    a = st.get((("p", 1, 2), 0), 8, "cpu")
    assert a.dtype == torch.bfloat16 and not a.any()
    a.fill_(1.0)
    assert st.get((("p", 1, 2), 0), 8, "cpu").sum() == 8   # the second micro-step finds what the first left
    st.get((("p", 3), 0), 4, "cpu")
    st.end_step()
    assert st.nbytes() == 2 * (8 + 4)
    st.get((("p", 1, 2), 0), 8, "cpu")
    st.end_step()
    assert st.keys() == [(("p", 1, 2), 0)] and st.tensors()[(("p", 1, 2), 0)].sum() == 8
    st.get((("p", 1, 2), 0), 8, "cpu")
    st.end_step(skipped=True)
    assert st.nbytes() == 0 and st.keys() == []


def test_inter8_steps_config_and_one_node():
    """gradients.inter8_steps: 8 bits between nodes below the step, the config itself from it on; refused where
    the inter level is not at 4 bits; on one node it changes nothing, and the reducer says so."""
    cfg = GradientsConfig(inter8_steps=100)
    early = settings_at(cfg, 99)
    assert early.inter_bits == 8 and early.inter8_steps == 0 and GradientsConfig(**early.model_dump()) == early
    assert settings_at(cfg, 100) is cfg and settings_at(GradientsConfig(), 0).inter_bits == 4
    for bits in (8, 16):
        with pytest.raises(ValueError, match=f"inter8_steps sends the inter-node level at 8 bits .* inter_bits is {bits}"):
            GradientsConfig(inter_bits=bits, inter8_steps=10)
    with pytest.raises(ValueError, match="inter8_steps"):
        GradientsConfig(inter8_steps=-1)
    shape = TopologyShape(1, 4)
    inputs = _normal_flats("i8", 256, 4)
    a = simulate_reduce_scatter_flat(inputs, shape, GradientsConfig(inter8_steps=5), SEED, step=0)
    b = simulate_reduce_scatter_flat(inputs, shape, GradientsConfig(), SEED, step=0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.warns(UserWarning, match="inter8_steps has nothing to change on one node"):
        GradientReducer(_fake_topology(1, 4), GradientsConfig(inter8_steps=5), seed=SEED)


def test_error_feedback_does_nothing_on_one_node():
    """On one node there is no inter level: error feedback keeps no residual, the result is the plain one, and the
    reducer says so."""
    shape = TopologyShape(1, 4)
    inputs = _normal_flats("ef1", 256, 4)
    res = [ResidualStore() for _ in range(4)]
    a = simulate_reduce_scatter_flat(inputs, shape, GradientsConfig(error_feedback=True), SEED, residuals=res)
    b = simulate_reduce_scatter_flat(inputs, shape, GradientsConfig(), SEED)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and all(d.nbytes() == 0 for d in res)
    with pytest.warns(UserWarning, match="error_feedback has nothing to carry on one node"):
        GradientReducer(_fake_topology(1, 4), GradientsConfig(error_feedback=True), seed=SEED)
