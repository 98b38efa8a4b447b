"""Bandwidth of the SDP4Bit kernels (CUDA and Triton backends) and of DeepSpeed's own quantizer ops.

For each op and input size (bytes of the op's inputs, 8 MB .. 2 GB by default):

* correctness first: every backend is compared with ``reference.py`` at a small size (torch.equal on codes
  and scales, NaN-aware equality on floats); a backend that disagrees is still timed but flagged;
* median time per call: the calls are captured in a CUDA graph (no host launch overhead), each replay
  running enough calls to move >= 1 GB, cycling through several input sets when one set would fit in L2;
  timed with CUDA events after warm-up; eager timing is the fallback when capture fails;
* GB/s of logical bytes (inputs read once + outputs written once) and percent of a device-to-device copy
  (``dst.copy_(src)``, read + write bytes) measured the same way at the same size.

DeepSpeed's QuantizerBuilder ops run on fp16 (all they take) with their own quantization scheme; they are
timed on inputs of the same size next to the closest configuration of ours (``swizzle_quant`` vs op 1 with
the same swizzle, ``quantized_reduction`` vs op 2 with 4-bit input, ``quantize`` vs op 1 without Hadamard).

Usage: ``python -m benchmarks kernels --out results.json [--sizes-mb 8,32,128,512,2048]
[--backends cuda,triton] [--no-deepspeed]``.  Prints a table, writes all numbers as JSON to ``--out``.

``--segments`` instead times op 6 (``dequant_add_segments_``) on a layout-true replica refresh (see
:func:`bench_segments`): every source's payload applied to one flat bf16 buffer holding a GPT's parameters, against
the windowed torch path it replaced and a device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_sdp4bit import reference as R  # noqa: E402

MB = 1 << 20
L2_DEFEAT_BYTES = 256 * MB       # input sets cycled per replay so that one set never stays in L2 (50 MB)
BYTES_PER_REPLAY = 1 << 30       # each graph replay moves at least this much
MAX_CALLS_PER_REPLAY = 256


# ----------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------
def time_calls(calls: List[Callable[[], object]], bytes_per_call: int, reps: int = 15) -> Dict[str, object]:
    """Median seconds per call of ``calls`` (one closure per input set), graph-captured when possible."""
    per_replay = max(1, min(MAX_CALLS_PER_REPLAY, math.ceil(BYTES_PER_REPLAY / max(bytes_per_call, 1))))
    seq = [calls[i % len(calls)] for i in range(max(per_replay, len(calls)))]
    for f in calls:  # compile / JIT / autotune outside the timed region
        f()
    torch.cuda.synchronize()
    mode = "cuda-graph"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in seq[: min(len(seq), 3)]:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in seq:
                f()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 - fall back to eager timing, and say so
        torch.cuda.synchronize()
        mode = f"eager ({type(e).__name__}: {str(e)[:120]})"

        def run():
            for f in seq:
                f()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(seq))
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "calls_per_replay": len(seq), "input_sets": len(calls), "timing": mode}


def n_sets(input_bytes: int) -> int:
    return max(1, min(32, math.ceil(L2_DEFEAT_BYTES / max(input_bytes, 1))))


def copy_bandwidth(size_bytes: int) -> Dict[str, object]:
    """Device-to-device copy of ``size_bytes`` (read + write counted), same method as the ops.

    Two copies: ``dst.copy_(src)`` (cudaMemcpyAsync) and ``torch.neg(src, out=dst)`` (an elementwise kernel
    with vector loads); the faster one is the ceiling the ops are compared with.
    """
    k = n_sets(size_bytes)
    src = [torch.empty(size_bytes // 4, device="cuda").uniform_() for _ in range(k)]
    dst = [torch.empty_like(s) for s in src]
    t_memcpy = time_calls([(lambda d=d, s=s: d.copy_(s)) for d, s in zip(dst, src)], 2 * size_bytes)
    t_kernel = time_calls([(lambda d=d, s=s: torch.neg(s, out=d)) for d, s in zip(dst, src)], 2 * size_bytes)
    del src, dst
    g_memcpy = 2 * size_bytes / t_memcpy["median_s"] / 1e9
    g_kernel = 2 * size_bytes / t_kernel["median_s"] / 1e9
    best = t_memcpy if g_memcpy >= g_kernel else t_kernel
    return dict(best, gbps=max(g_memcpy, g_kernel), memcpy_gbps=g_memcpy, elementwise_gbps=g_kernel,
                ceiling="memcpy" if g_memcpy >= g_kernel else "elementwise neg")


# ----------------------------------------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------------------------------------
def load_backends(names: List[str]) -> Dict[str, object]:
    out = {}
    for name in names:
        try:
            if name == "cuda":
                from deepspeed_sdp4bit.kernels import cuda_backend as mod
            elif name == "triton":
                from deepspeed_sdp4bit.kernels import triton_backend as mod
            else:
                raise ValueError(f"unknown backend {name}")
            b = mod.make_backend()
            ok, why = b.available(torch.device("cuda"))
            out[name] = b if ok else f"unavailable: {why}"
        except Exception as e:  # noqa: BLE001 - recorded in the JSON
            out[name] = f"import failed: {type(e).__name__}: {e}"
    return out


def load_deepspeed_quantizer():
    """DeepSpeed's QuantizerBuilder module (JIT build), or the reason it could not be had."""
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        # DeepSpeed 0.19.8 cannot parse arch-specific entries such as 9.0a: give it the plain arch
        if saved and "a" in saved.replace("+PTX", ""):
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
                t.rstrip("af") for t in saved.replace(" ", ";").split(";") if t)
        from deepspeed.ops.op_builder import QuantizerBuilder
        t0 = time.time()
        mod = QuantizerBuilder().load()
        return mod, time.time() - t0
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", 0.0
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


# ----------------------------------------------------------------------------------------------------------
# correctness at a small size
# ----------------------------------------------------------------------------------------------------------
def _eq(got: torch.Tensor, want: torch.Tensor) -> bool:
    got = got.detach().cpu().reshape(-1)
    want = want.detach().cpu().reshape(-1)
    if got.dtype != want.dtype or got.numel() != want.numel():
        return False
    if got.is_floating_point():
        gn, wn = torch.isnan(got), torch.isnan(want)
        return bool(torch.equal(gn, wn)) and bool(torch.equal(got[~gn], want[~wn]))
    return bool(torch.equal(got, want))


def check_correct(b) -> Dict[str, bool]:
    g = torch.Generator().manual_seed(0)
    res = {}
    key = R.make_key(1234, 1, 2)
    x = (torch.randn(128 * 512, generator=g) * 0.01).bfloat16()
    p0, s0 = R.hadamard_quantize(x, 8, 128, 32, "stochastic", key, 7, swizzle=(2, 4))
    p1, s1 = b.hadamard_quantize(x.cuda(), 8, 128, 32, "stochastic", key, 7, swizzle=(2, 4))
    res["hadamard_quantize"] = _eq(p1, p0) and _eq(s1, s0)
    chunks = [R.hadamard_quantize(torch.randn(128 * 64, generator=g), 8, 128, 32) for _ in range(4)]
    pay = torch.stack([c[0] for c in chunks])
    sc = torch.stack([c[1] for c in chunks])
    p0, s0 = R.dequant_sum_requant(pay, sc, 8, 4, 128, "stochastic", key, 3)
    p1, s1 = b.dequant_sum_requant(pay.cuda(), sc.cuda(), 8, 4, 128, "stochastic", key, 3)
    res["dequant_sum_requant"] = _eq(p1, p0) and _eq(s1, s0)
    pay4 = torch.stack([p0, p0])
    sc4 = torch.stack([s0, s0])
    y0 = R.dequant_sum_inverse_hadamard(pay4, sc4, 4, 128, 32, torch.bfloat16, 0.125)
    y1 = b.dequant_sum_inverse_hadamard(pay4.cuda(), sc4.cuda(), 4, 128, 32, torch.bfloat16, 0.125)
    res["dequant_sum_inverse_hadamard"] = _eq(y1, y0)
    master = torch.randn(2048 * 9 + 5, generator=g)
    rep = (master + torch.randn(master.numel(), generator=g) * 1e-3).bfloat16()
    rep_ref = rep.clone()
    p0, s0 = R.weight_delta_quantize(master, rep_ref, 4, 2048)
    rep_gpu = rep.cuda()
    p1, s1 = b.weight_delta_quantize(master.cuda(), rep_gpu, 4, 2048)
    res["weight_delta_quantize"] = _eq(p1, p0) and _eq(s1, s0) and _eq(rep_gpu, rep_ref)
    recv = rep.cuda()
    b.dequant_add_(recv, p0.cuda(), s0.cuda(), 4, 2048)
    res["dequant_add_"] = _eq(recv, rep_ref)
    return res


# ----------------------------------------------------------------------------------------------------------
# the ops at one size: builds input sets and closures per backend
# ----------------------------------------------------------------------------------------------------------
def rand_payload(rows: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, device="cuda")


def rand_scales(rows: int, n: int) -> torch.Tensor:
    return torch.rand(rows, n, device="cuda") * 0.01 + 1e-4


def op_cases(size: int):
    """(op, config, input_bytes, output_bytes, make_inputs, {backend: fn(inputs)}) per op at ``size`` bytes."""
    cases = []
    key = R.make_key(1234, 5, 6)

    # op 1: the gradient intra-node level: bf16, Hadamard 32, 8-bit groups of 128, stochastic, swizzled
    n = size // 2 // 2048 * 2048
    g = 128
    cases.append(dict(
        op="hadamard_quantize", config="bf16 h32 g128 8-bit stochastic swizzle(2,4)",
        in_bytes=2 * n, out_bytes=n + 4 * n // g,
        make=lambda n=n: {"x": torch.randn(n, device="cuda", dtype=torch.bfloat16),
                          "out": torch.empty(n, dtype=torch.uint8, device="cuda"),
                          "os": torch.empty(n // 128, device="cuda")},
        run=lambda b, d: b.hadamard_quantize(d["x"], 8, 128, 32, "stochastic", key, 0, (2, 4), out=d["out"],
                                             out_scales=d["os"])))

    # op 2: intra-node receive: k=4 chunks of 8-bit g128 -> 4-bit g128, stochastic
    k = 4
    m = size // (k * (1 + 4 / 128)) // 2048 * 2048
    m = int(m)
    cases.append(dict(
        op="dequant_sum_requant", config="k4 8-bit g128 -> 4-bit g128 stochastic",
        in_bytes=k * (m + 4 * m // 128), out_bytes=m // 2 + 4 * m // 128,
        make=lambda m=m: {"p": rand_payload(k, m), "s": rand_scales(k, m // 128),
                          "out": torch.empty(m // 2, dtype=torch.uint8, device="cuda"),
                          "os": torch.empty(m // 128, device="cuda")},
        run=lambda b, d: b.dequant_sum_requant(d["p"], d["s"], 8, 4, 128, "stochastic", key, 0, out=d["out"],
                                               out_scales=d["os"])))

    # op 3: inter-node receive: k=2 chunks of 4-bit g128 -> inverse Hadamard 32 -> bf16
    k3 = 2
    m3 = int(size // (k3 * (0.5 + 4 / 128)) // 2048 * 2048)
    cases.append(dict(
        op="dequant_sum_inverse_hadamard", config="k2 4-bit g128 h32 -> bf16",
        in_bytes=k3 * (m3 // 2 + 4 * m3 // 128), out_bytes=2 * m3,
        make=lambda m3=m3: {"p": rand_payload(k3, m3 // 2), "s": rand_scales(k3, m3 // 128),
                            "out": torch.empty(m3, dtype=torch.bfloat16, device="cuda")},
        run=lambda b, d: b.dequant_sum_inverse_hadamard(d["p"], d["s"], 4, 128, 32, post_scale=0.125,
                                                        out=d["out"])))

    # op 4: the owner's qWD: fp32 master, bf16 replica, 4-bit g2048, nearest, diff
    n4 = size // 6 // 2048 * 2048
    cases.append(dict(
        op="weight_delta_quantize", config="fp32 master, bf16 replica, 4-bit g2048 nearest diff",
        in_bytes=6 * n4, out_bytes=2 * n4 + n4 // 2 + 4 * n4 // 2048,
        make=lambda n4=n4: (lambda mst: {"m": mst, "r": (mst + 1e-3 * torch.randn_like(mst)).bfloat16(),
                                        "out": torch.empty(n4 // 2, dtype=torch.uint8, device="cuda"),
                                        "os": torch.empty(n4 // 2048, device="cuda")})(
            torch.randn(n4, device="cuda")),
        run=lambda b, d: b.weight_delta_quantize(d["m"], d["r"], 4, 2048, out=d["out"], out_scales=d["os"])))

    # op 5: every receiver's qWD: bf16 replica += 4-bit g2048
    n5 = int(size // (2.5 + 4 / 2048) // 2048 * 2048)
    cases.append(dict(
        op="dequant_add_", config="bf16 replica += 4-bit g2048",
        in_bytes=2 * n5 + n5 // 2 + 4 * n5 // 2048, out_bytes=2 * n5,
        make=lambda n5=n5: {"r": torch.randn(n5, device="cuda").bfloat16(), "p": rand_payload(1, n5 // 2).view(-1),
                            "s": rand_scales(1, n5 // 2048).view(-1)},
        run=lambda b, d: b.dequant_add_(d["r"], d["p"], d["s"], 4, 2048)))
    return cases


def ds_cases(size: int, ds):
    """DeepSpeed quantizer ops and our closest configuration at ``size`` input bytes (fp16 input).

    Two group sizes: 2048 (ZeRO++'s weight groups) and 128 (our gradient groups, where our kernels also run
    their real configuration: Hadamard 32 and stochastic rounding, against DeepSpeed's plain nearest rounding).
    """
    return _ds_cases_g(size, ds, 2048, False) + _ds_cases_g(size, ds, 128, True)


def _ds_cases_g(size: int, ds, G: int, gradient_config: bool):
    n = size // 2 // (8 * 2048) * (8 * 2048)
    out = []
    had, rnd, key = (32, "stochastic", 77) if gradient_config else (None, "nearest", None)
    extra = " (ours: + Hadamard 32, stochastic)" if gradient_config else ""

    def make_x():  # fp16 input and 4-bit outputs, shared by the swizzle_quant and quantize cases
        return {"x": torch.randn(n, device="cuda", dtype=torch.float16),
                "out": torch.empty(n // 2, dtype=torch.uint8, device="cuda"),
                "os": torch.empty(n // G, device="cuda")}

    sym = ds.Symmetric
    out.append(dict(
        op="ds.swizzle_quant vs ours", config=f"fp16 4-bit g{G} swizzle nodes=2 x gpus=4{extra}",
        in_bytes=2 * n, out_bytes=n // 2 + 4 * n // G,
        make=make_x,
        ds=lambda d: ds.swizzle_quant(d["x"], n // G, 4, sym, 1, 2, 4),
        ours=lambda b, d: b.hadamard_quantize(d["x"], 4, G, had, rnd, key, 0, (2, 4), out=d["out"],
                                              out_scales=d["os"])))
    out.append(dict(
        op="ds.quantize vs ours", config=f"fp16 4-bit g{G} (no Hadamard, no swizzle)",
        in_bytes=2 * n, out_bytes=n // 2 + 4 * n // G,
        make=make_x,
        ds=lambda d: ds.quantize(d["x"], n // G, 4, sym),
        ours=lambda b, d: b.hadamard_quantize(d["x"], 4, G, None, out=d["out"], out_scales=d["os"])))
    # reduction of 4 chunks of 4-bit data to one (qgZ's intra-node step): input bytes = size
    dev = 4
    m = int(size // (0.5 + 4 / G) // (dev * 8 * 2048) * (dev * 8 * 2048))  # total elements over the 4 chunks
    out.append(dict(
        op="ds.quantized_reduction vs ours", config=f"4 chunks 4-bit g{G} -> 4-bit g{G}"
                                                    + (" (ours: stochastic)" if gradient_config else ""),
        in_bytes=m // 2 + 4 * m // G, out_bytes=m // dev // 2 + 4 * m // dev // G,
        make=lambda m=m: {"p": rand_payload(dev, m // dev // 2), "s": rand_scales(dev, m // dev // G),
                          "out": torch.empty(m // dev // 2, dtype=torch.uint8, device="cuda"),
                          "os": torch.empty(m // dev // G, device="cuda")},
        ds=lambda d: ds.quantized_reduction(d["p"].view(torch.int8).view(-1), d["s"].view(-1), m // G,
                                            m // G // dev, 4, sym, dev),
        ours=lambda b, d: b.dequant_sum_requant(d["p"], d["s"], 4, 4, G, rnd, key, out=d["out"],
                                                out_scales=d["os"])))
    return out


# ----------------------------------------------------------------------------------------------------------
# op 6 on a layout-true replica refresh
# ----------------------------------------------------------------------------------------------------------
def gpt_param_sizes(layers: int, d: int, vocab: int, seq: int) -> List[int]:
    """numel of a GPT-2 style model's parameters in ``model.parameters()`` order (embeddings, per layer: ln1 w/b,
    qkv w/b, proj w/b, ln2 w/b, fc1 w/b, fc2 w/b; final ln w/b).  24 layers, d 2048, vocab 50304: 1.31 B."""
    layer = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [vocab * d, seq * d] + layer * layers + [d, d]


def _old_windowed_apply(payload, scales, items, backend, bits, gs, mode, scratch_elements=1 << 22):
    """The receivers' path that op 6 replaced (collectives/weights.py before it): op 5 for views starting on a group
    boundary, windowed torch code for the rest.  Kept here, verbatim in its arithmetic, as the baseline."""
    unaligned = []
    for view, off in items:
        L = view.numel()
        if off % gs == 0:
            g0, ng = off // gs, R.num_groups(L, gs)
            backend.dequant_add_(view, payload[g0 * gs * bits // 8: (g0 + ng) * gs * bits // 8],
                                 scales[g0: g0 + ng], bits, gs, mode)
        else:
            unaligned.append((view, off))
    if not unaligned:
        return
    win = max(1, scratch_elements // gs) * gs
    lo = min(off for _, off in unaligned) // gs * gs
    hi = max(R.num_groups(off + v.numel(), gs) for v, off in unaligned) * gs
    scratch = torch.empty(min(win, hi - lo), dtype=torch.float32, device=payload.device)
    for w0 in range(lo, hi, win):
        w1 = min(w0 + win, hi)
        pieces = [(v, off, max(off, w0), min(off + v.numel(), w1)) for v, off in unaligned]
        pieces = [p for p in pieces if p[2] < p[3]]
        if not pieces:
            continue
        deq = scratch[: w1 - w0]
        codes = R.unpack_codes(payload[w0 * bits // 8: w1 * bits // 8], bits)
        torch.mul(codes.view(-1, gs).float(), scales[w0 // gs: w1 // gs].view(-1, 1), out=deq.view(-1, gs))
        parts = [view[a - off: b - off] for view, off, a, b in pieces]
        d = torch.cat([deq[a - w0: b - w0] for _, _, a, b in pieces])
        cur = torch.cat(parts)
        new = (cur.float() + d).to(cur.dtype) if mode == "diff" else d.to(cur.dtype)
        torch._foreach_copy_(parts, list(new.split([p.numel() for p in parts])))


def _eager_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` timed eagerly with CUDA events (host overhead included)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_segments(args) -> Dict[str, object]:
    """Op 6 on the replica refresh of one rank at replica "full": ``--seg-world`` ranks, the GPT of
    :func:`gpt_param_sizes` as ONE flat bf16 buffer (parameters back to back), one sub-group (the flat partition of
    every parameter's piece, DeepSpeed's ``P_i = ceil(numel_i / world)``), 4-bit codes in groups of 2048, diff.

    Rank 0 applies the payloads of sources 1..world-1 (random codes and scales): per source one op 6 call with a
    plan built beforehand, against the windowed path it replaced (op 5 of the cuda backend for group-aligned
    views) on the same views.  Bytes touched per source: its codes and scales for the pieces + 2 x the pieces' bf16
    bytes (read and write); percent of a device copy (``copy_bandwidth``) of the same bytes.  Both paths are timed
    eagerly (host overhead included: one call per source is what a refresh does); op 6 is also timed in a CUDA
    graph (kernels only).  The results of the two paths are compared bit for bit.
    """
    from deepspeed_sdp4bit.segments import make_segment_plan
    bits, gs, mode, W = 4, 2048, "diff", args.seg_world
    sizes = gpt_param_sizes(args.seg_layers, args.seg_d, args.seg_vocab, args.seg_seq)
    P = [-(-n // W) for n in sizes]
    offs = [0]
    for p in P[:-1]:
        offs.append(offs[-1] + p)
    M = sum(P)
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    N = sum(sizes)
    Mpad = R.padded_numel(M, gs)
    flat = torch.randn(N, device="cuda").bfloat16()
    g = torch.Generator(device="cuda").manual_seed(0)
    pay = {s: torch.randint(0, 256, (Mpad * bits // 8,), dtype=torch.uint8, device="cuda", generator=g)
           for s in range(1, W)}
    sc = {s: torch.rand(Mpad // gs, device="cuda", generator=g) * 1e-3 for s in range(1, W)}
    plans, items = {}, {}
    unaligned_elems = total_elems = 0
    t0 = time.time()
    for s in range(1, W):
        segs = [(offs[i], starts[i] + s * P[i], max(0, min(P[i], n - s * P[i]))) for i, n in enumerate(sizes)]
        segs = [x for x in segs if x[2] > 0]
        plans[s] = make_segment_plan(*zip(*segs), flat, src_numel=M)
        items[s] = [(flat[d: d + L], o) for o, d, L in segs]
        total_elems += sum(L for _, _, L in segs)
        unaligned_elems += sum(L for o, _, L in segs if o % gs)
    plan_s = time.time() - t0
    backends = {k: v for k, v in load_backends([b for b in args.backends.split(",") if b]).items()
                if not isinstance(v, str)}
    if "cuda" not in backends:
        sys.exit("--segments needs the cuda backend (the old path's op 5 and the reference timing)")
    cuda_b = backends["cuda"]
    srcs = list(range(1, W))
    touched = sum(plans[s].numel * (2 * 2 + bits / 8) + 4 * R.num_groups(plans[s].numel, gs) for s in srcs)
    cp = copy_bandwidth(int(touched) // 2)  # copy_bandwidth counts read + write of its size
    res = {"layout": dict(layers=args.seg_layers, d=args.seg_d, vocab=args.seg_vocab, seq=args.seg_seq, world=W,
                          params=len(sizes), numel=N, partition_numel=M, group_size=gs, bits=bits, mode=mode,
                          sources_applied=len(srcs), elements_applied=total_elems,
                          unaligned_fraction=unaligned_elems / total_elems, plan_build_s=plan_s),
           "bytes_touched": touched, "copy": cp, "rows": []}

    def row(name, ms, timing):
        gbps = touched / (ms / 1e3) / 1e9
        res["rows"].append(dict(path=name, ms=ms, gbps=gbps, pct_copy=100 * gbps / cp["gbps"], timing=timing))
        print(f"  {name:34s} {ms:9.3f} ms {gbps:7.0f} GB/s {100 * gbps / cp['gbps']:6.1f}% copy  [{timing}]")

    print(f"layout: {len(sizes)} params, {N / 1e9:.3f} B elements, M = {M} per rank, {len(srcs)} sources, "
          f"{100 * unaligned_elems / total_elems:.1f}% of the applied elements in views not on a group boundary; "
          f"plans built in {plan_s:.2f} s; {touched / 1e9:.3f} GB touched; copy {cp['gbps']:.0f} GB/s")
    for name, b in backends.items():
        run = (lambda b=b: [b.dequant_add_segments_(flat, pay[s], sc[s], bits, gs, mode, plans[s]) for s in srcs])
        row(f"op6 {name} (eager)", _eager_ms(run, args.reps), "eager")
        t = time_calls([run], int(touched), args.reps)
        row(f"op6 {name} (graph)", t["median_s"] * 1e3, t["timing"][:10])
    old = (lambda: [_old_windowed_apply(pay[s], sc[s], items[s], cuda_b, bits, gs, mode) for s in srcs])
    row("old windowed + op5 cuda (eager)", _eager_ms(old, max(3, args.reps // 3)), "eager")
    # bit for bit: the two paths from the same start
    start = flat.clone()
    for name, b in backends.items():
        flat.copy_(start)
        for s in srcs:
            b.dequant_add_segments_(flat, pay[s], sc[s], bits, gs, mode, plans[s])
        new = flat.clone()
        flat.copy_(start)
        old()
        res.setdefault("bit_identical_to_old", {})[name] = bool(torch.equal(new.view(torch.int16),
                                                                            flat.view(torch.int16)))
        del new
    print(f"op 6 bit-identical to the old path: {res['bit_identical_to_old']}")
    return res


# ----------------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="python -m benchmarks kernels --chunk-counts ...: the gradient pipeline's "
                                        "chunk-count sweep instead (benchmarks/bench_chunk_counts.py; its own "
                                        "options, --chunk-counts --help)")
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--sizes-mb", default="8,32,128,512,2048", help="input sizes in MiB, comma separated")
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's QuantizerBuilder ops")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--single-pass-mb", type=int, default=0,
                    help="run each op of the cuda backend once at this size and exit (for a profiler such as ncu)")
    ap.add_argument("--segments", action="store_true",
                    help="time op 6 on a layout-true replica refresh instead (bench_segments), write --out, exit")
    ap.add_argument("--seg-layers", type=int, default=24)
    ap.add_argument("--seg-d", type=int, default=2048)
    ap.add_argument("--seg-vocab", type=int, default=50304)
    ap.add_argument("--seg-seq", type=int, default=2048)
    ap.add_argument("--seg-world", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA device")
    if args.segments:
        props = torch.cuda.get_device_properties(0)
        out = {"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda, "argv": sys.argv,
               "method": bench_segments.__doc__, "segments": bench_segments(args)}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
        return
    if args.single_pass_mb:
        b = load_backends(["cuda"])["cuda"]
        if isinstance(b, str):
            sys.exit(b)
        for case in op_cases(args.single_pass_mb * MB):
            d = case["make"]()
            case["run"](b, d)
            torch.cuda.synchronize()
            print(f"ran {case['op']} ({case['config']}) once at {args.single_pass_mb} MiB")
            del d
        return
    sizes = [int(s) * MB for s in args.sizes_mb.split(",") if s]
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name, "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}", "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "argv": sys.argv, "method": __doc__, "copy": {}, "rows": [],
        "correct": {}, "backends": {},
    }
    backends = load_backends([b for b in args.backends.split(",") if b])
    for name, b in backends.items():
        result["backends"][name] = b if isinstance(b, str) else "ok"
        if not isinstance(b, str):
            try:
                result["correct"][name] = check_correct(b)
            except Exception as e:  # noqa: BLE001
                result["correct"][name] = f"check failed: {type(e).__name__}: {e}"
                traceback.print_exc()
    live = {k: v for k, v in backends.items() if not isinstance(v, str)}
    ds, ds_build_s = (None, 0.0) if args.no_deepspeed else load_deepspeed_quantizer()
    result["deepspeed_quantizer"] = ("skipped" if args.no_deepspeed else
                                     (f"ok (load {ds_build_s:.1f} s)" if not isinstance(ds, str) else ds))
    print(f"device {props.name}; backends {result['backends']}; deepspeed {result['deepspeed_quantizer']}")
    print(f"correct vs reference: {json.dumps(result['correct'])}")

    rows = result["rows"]
    for size in sizes:
        cp = copy_bandwidth(size)
        result["copy"][str(size)] = cp
        print(f"copy {size // MB} MiB: memcpy {cp['memcpy_gbps']:.0f} GB/s, "
              f"elementwise {cp['elementwise_gbps']:.0f} GB/s ({cp['timing']})")

        def record(op, config, backend, in_b, out_b, t):
            gbps = (in_b + out_b) / t["median_s"] / 1e9
            row = dict(op=op, config=config, size_mb=size // MB, backend=backend, in_bytes=in_b, out_bytes=out_b,
                       median_us=t["median_s"] * 1e6, gbps=gbps, pct_copy=100 * gbps / cp["gbps"],
                       timing=t["timing"], input_sets=t["input_sets"], calls_per_replay=t["calls_per_replay"])
            rows.append(row)
            print(f"  {op:30s} {backend:8s} {size // MB:6d} MiB {row['median_us']:10.1f} us {gbps:7.0f} GB/s "
                  f"{row['pct_copy']:5.1f}% copy  [{t['timing'][:10]}]")

        for case in op_cases(size):
            sets = [case["make"]() for _ in range(n_sets(case["in_bytes"]))]
            for name, b in live.items():
                try:
                    t = time_calls([(lambda d=d, b=b: case["run"](b, d)) for d in sets],
                                   case["in_bytes"] + case["out_bytes"], args.reps)
                    record(case["op"], case["config"], name, case["in_bytes"], case["out_bytes"], t)
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(op=case["op"], size_mb=size // MB, backend=name, error=f"{type(e).__name__}: {e}"))
                    print(f"  {case['op']} {name}: {type(e).__name__}: {e}")
            del sets
            torch.cuda.empty_cache()
        if ds is not None and not isinstance(ds, str):
            for case in ds_cases(size, ds):
                sets = [case["make"]() for _ in range(n_sets(case["in_bytes"]))]
                runs = [("deepspeed", lambda d: case["ds"](d))] + [(k, (lambda d, b=b: case["ours"](b, d)))
                                                                   for k, b in live.items()]
                for name, fn in runs:
                    try:
                        t = time_calls([(lambda d=d, fn=fn: fn(d)) for d in sets],
                                       case["in_bytes"] + case["out_bytes"], args.reps)
                        record(case["op"], case["config"], name, case["in_bytes"], case["out_bytes"], t)
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(op=case["op"], size_mb=size // MB, backend=name,
                                         error=f"{type(e).__name__}: {e}"))
                        print(f"  {case['op']} {name}: {type(e).__name__}: {e}")
                del sets
                torch.cuda.empty_cache()

    # the summary table last (the tail of the output is what a remote run returns)
    print("\nop                              backend     MiB   median_us    GB/s  %copy")
    for r in rows:
        if "error" in r:
            print(f"{r['op'][:31]:31s} {r['backend']:9s} {r['size_mb']:5d}  ERROR {r['error'][:60]}")
        else:
            print(f"{r['op'][:31]:31s} {r['backend']:9s} {r['size_mb']:5d} {r['median_us']:11.1f} {r['gbps']:7.0f} "
                  f"{r['pct_copy']:6.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
