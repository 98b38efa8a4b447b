"""The CUDA kernels (deepspeed_sdp4bit/kernels/cuda_backend.py, csrc/) against reference.py, bit for bit.

Codes, payload bytes and scales must be torch.equal to the reference (NaN positions compared separately);
float outputs (op 3, replicas of ops 4/5) too, since the kernels follow the reference's operation order.
Outputs are poisoned before each run so an element the kernel forgot to write shows up as a mismatch.

Needs a CUDA device and a toolchain that can JIT-build the extension: on a GPU machine a failed build is a
test failure, not a skip.
"""

from __future__ import annotations

import pytest
import torch

from deepspeed_sdp4bit import ops
from deepspeed_sdp4bit import reference as R
from deepspeed_sdp4bit.segments import GPU_TILE, make_segment_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
POISON = 0xA5         # byte poison of payload buffers
FPOISON = -7777.0     # float poison (finite: a NaN expected in the output must still be written)


@pytest.fixture(scope="module")
def cb():
    from deepspeed_sdp4bit.kernels import cuda_backend
    backend = cuda_backend.make_backend()
    ok, why = backend.available(torch.device("cuda"))
    assert ok, f"cuda backend unavailable on a CUDA machine: {why}"
    return backend


@pytest.fixture(scope="module", params=["cuda", "torch-on-cuda"])
def kb(request):
    """The backend the reference-matching tests check: the CUDA kernels, and the torch backend given CUDA tensors
    (the reference's own code, which must round on a GPU as on the CPU: ``kernel_backend: "torch"`` is allowed on
    any device, and the engine's backend comparisons on a GPU run it)."""
    if request.param == "torch-on-cuda":
        return ops.get_backend("torch", torch.device("cuda"))
    return request.getfixturevalue("cb")


# ----------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_data(kind: str, n: int, group: int, seed: int) -> torch.Tensor:
    """fp32 CPU test data of ``n`` elements (group-aware for the special cases)."""
    g = _gen(seed)
    if kind == "randn":
        return torch.randn(n, generator=g) * 0.02
    if kind == "heavy":
        # Student-t(2) body (ratio of normals) with rare huge outliers: the gradients SDP4Bit targets
        z = torch.randn(n, generator=g)
        chi = (torch.randn(n, generator=g) ** 2 + torch.randn(n, generator=g) ** 2) / 2
        x = z / chi.sqrt().clamp_min(1e-3)
        idx = torch.randint(0, n, (max(n // 300, 1),), generator=g)
        x[idx] *= 1000.0
        return x * 1e-3
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "special":
        x = torch.randn(n, generator=g)
        ng = n // group
        # ties: y = x * (1 / scale) lands on k + 0.5 exactly (scale 1 when the group's max is qmax = 7 or 127)
        if ng > 0:
            t = (torch.arange(group) % 14 - 7).float() + 0.5
            t[0] = 127.0
            x[:group] = t
        if ng > 1:
            x[group: 2 * group] = 0.0                        # all-zero group
        if ng > 2:
            x[2 * group + 3] = float("nan")                  # NaN group
        if ng > 3:
            x[3 * group + 1] = float("inf")                  # inf group
        if ng > 4:
            x[4 * group: 5 * group] *= 1e-39                 # denormal scales
        if ng > 5:
            x[5 * group + group // 2] = float("-inf")
        if ng > 6:
            x[6 * group: 7 * group] = 0.0
            x[6 * group + 5] = 1e-44                         # absmax/qmax underflows to 0
        if ng > 7:
            t = (torch.arange(group) % 14 - 7).float() + 0.5  # ties for 4 bits (max 7: scale 1)
            t[0] = 7.0
            x[7 * group: 8 * group] = t
        if ng > 8:
            # a normal scale with elements whose quotient or residual would underflow (the exact-division path)
            x[8 * group + 1] = 1e-35
            x[8 * group + 2] = -3e-40
            x[8 * group + 3] = 2.0 ** -101
            x[8 * group + 4] = -(2.0 ** -126)
        if ng > 9:
            # scale just above and (next group) just below 2**-127, where 1 / scale overflows: codes 0
            g9 = x[9 * group: 10 * group]
            g9.mul_(2.0 ** -118 / float(g9.abs().max()))
        if ng > 10:
            g10 = x[10 * group: 11 * group]
            g10.mul_(2.0 ** -121.2 / float(g10.abs().max()))
        return x
    raise ValueError(kind)


KINDS = ["randn", "heavy", "zeros", "special"]


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.detach().cpu().reshape(-1)
    want = want.detach().cpu().reshape(-1)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.numel() == want.numel(), f"{what}: {got.numel()} elements != {want.numel()}"
    if got.is_floating_point():
        gn, wn = torch.isnan(got), torch.isnan(want)
        assert torch.equal(gn, wn), f"{what}: NaN at {torch.nonzero(gn != wn)[:5].flatten().tolist()}"
        got, want = got[~gn], want[~wn]
    if not torch.equal(got, want):
        bad = torch.nonzero(got != want).flatten()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {got.numel()} differ; first at {i}: got {got[i].item()}, "
                             f"want {want[i].item()}")


def poisoned(numel: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A CUDA buffer of ``numel`` filled with garbage; ``offset`` > 0 returns a misaligned view into a larger one."""
    base = torch.empty(numel + offset, dtype=torch.uint8 if dtype == torch.uint8 else dtype, device="cuda")
    if dtype == torch.uint8:
        base.fill_(POISON)
    else:
        base.fill_(FPOISON)
    return base[offset:]


# ----------------------------------------------------------------------------------------------------------
# op 1
# ----------------------------------------------------------------------------------------------------------
# (group_size, hadamard_size, groups): register tiles (divisors of 256), a block per group (multiples of 256 up
# to 8192), the streaming kernel (96, 160, 16384), every Hadamard size the kernels take (8..256; the reference
# also defines 2 and 4, which the binding refuses), odd group counts for partial tiles, and >= 11 groups where
# the "special" data has all its cases.
OP1_CASES = [
    (128, 32, 7), (128, None, 9), (128, 128, 3), (32, 32, 33), (8, 8, 5), (16, 8, 3), (32, 16, 3), (64, 16, 11),
    (256, 256, 5), (512, 32, 3), (1024, 64, 3), (2048, None, 3), (2048, 256, 1), (96, 32, 7), (768, 256, 3),
    (4096, 32, 3), (160, 32, 5), (2048, 32, 9), (8192, 64, 3), (16384, None, 2), (512, None, 10),
    (128, 32, 11), (128, None, 12), (256, 64, 11),
]


@pytest.mark.parametrize("case", OP1_CASES, ids=lambda c: f"g{c[0]}-h{c[1]}-n{c[2]}")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_hadamard_quantize_matches_reference(kb, case, bits, rounding):
    group, had, ngroups = case
    n = group * ngroups
    key = R.make_key(1234, group, bits) if rounding == "stochastic" else None
    for kind in KINDS:
        for dtype in DTYPES:
            x = make_data(kind, n, group, seed=n + bits).to(dtype)
            # an odd counter offset (the general hash path) and a multiple of 32 (the wide kernels' aligned one)
            offset = 17 if dtype == torch.float32 else 64
            p_ref, s_ref = R.hadamard_quantize(x, bits, group, had, rounding, key, offset)
            out = poisoned(n * bits // 8, torch.uint8)
            out_s = poisoned(ngroups, torch.float32)
            p, s = kb.hadamard_quantize(x.cuda(), bits, group, had, rounding, key, offset, out=out, out_scales=out_s)
            assert p is out and s is out_s
            tag = f"{kind}/{dtype}/g{group}/h{had}/b{bits}/{rounding}"
            assert_same(s, s_ref, f"scales {tag}")
            assert_same(p, p_ref, f"payload {tag}")


@pytest.mark.parametrize("swz", [(2, 4, 128, 32), (2, 4, 96 * 4, 128), (4, 4, 20, 32), (3, 2, 2048, 2048)],
                         ids=["seg-multiple", "groups-straddle-segments", "seg-not-multiple-of-8", "big-groups"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_hadamard_quantize_swizzle(cb, swz, rounding):
    rows, cols, seg, group = swz
    n = rows * cols * seg
    had = 32 if group % 32 == 0 else None
    key = R.make_key(7, rows, cols) if rounding == "stochastic" else None
    for dtype in DTYPES:
        for bits in (4, 8):
            x = make_data("heavy", n, group, seed=seg).to(dtype)
            p_ref, s_ref = R.hadamard_quantize(x, bits, group, had, rounding, key, 5, swizzle=(rows, cols))
            p, s = cb.hadamard_quantize(x.cuda(), bits, group, had, rounding, key, 5, swizzle=(rows, cols))
            assert_same(s, s_ref, f"scales swizzle {swz} {dtype} b{bits}")
            assert_same(p, p_ref, f"payload swizzle {swz} {dtype} b{bits}")


# 0, 96 and 2**33 - 640 (the last pair index is 2**32 - 1) take the wide kernels' aligned-counter hash;
# 2**33 - 608 (one lane's pairs cross 2**32) and the others take the general one.
@pytest.mark.parametrize("offset", [0, 96, (1 << 33) - 640, (1 << 33) - 608, (1 << 32) - 37, -5, -64,
                                    3 * (1 << 32) + 11])
def test_stochastic_counters_past_32_bits(cb, offset):
    group, n = 128, 128 * 5
    key = R.make_key(99, 1, 2)
    x = make_data("randn", n, group, seed=3)
    for bits in (4, 8):
        p_ref, s_ref = R.hadamard_quantize(x, bits, group, 32, "stochastic", key, offset)
        p, s = cb.hadamard_quantize(x.cuda(), bits, group, 32, "stochastic", key, offset)
        assert_same(p, p_ref, f"payload offset={offset} b{bits}")
        assert_same(s, s_ref, f"scales offset={offset} b{bits}")


def test_misaligned_input_and_outputs(cb):
    """Views that start off a 16-byte boundary take the scalar path and must give the same bits."""
    group, n = 128, 128 * 7
    for dtype in DTYPES:
        big = make_data("heavy", n + 3, group, seed=11).to(dtype).cuda()
        x = big[1:1 + n]
        for bits in (4, 8):
            p_ref, s_ref = R.hadamard_quantize(x.cpu(), bits, group, 32)
            out = poisoned(n * bits // 8, torch.uint8, offset=1)
            p, s = cb.hadamard_quantize(x, bits, group, 32, out=out)
            assert_same(p, p_ref, f"misaligned payload {dtype} b{bits}")
            assert_same(s, s_ref, f"misaligned scales {dtype} b{bits}")


# ----------------------------------------------------------------------------------------------------------
# ops 2 and 3
# ----------------------------------------------------------------------------------------------------------
def make_chunks(k: int, m: int, bits: int, group: int, seed: int, kind: str):
    """[k, m*bits/8] payloads and [k, m/group] scales: real quantized data, or arbitrary bytes with odd scales."""
    g = _gen(seed)
    if kind == "quantized":
        ps, ss = [], []
        for j in range(k):
            x = make_data("heavy", m, group, seed=seed * 31 + j)
            p, s = R.hadamard_quantize(x, bits, group, None)
            ps.append(p)
            ss.append(s)
        return torch.stack(ps), torch.stack(ss)
    # every byte value (codes -128 and -8 included) and scales with inf, NaN, 0 and denormals
    payloads = torch.randint(0, 256, (k, m * bits // 8), generator=g, dtype=torch.uint8)
    scales = torch.rand(k, m // group, generator=g) * 0.01
    if m // group >= 4:
        scales[k - 1, 0] = float("inf")
        scales[0, 1] = float("nan")
        scales[k // 2, 2] = 0.0
        scales[0, 3] = 1e-41
    return payloads, scales


# (in group, out group or None, groups per chunk)
OP2_CASES = [(128, None, 7), (128, 256, 7), (128, 2048, 5), (96, 160, 5), (128, 4096, 3), (32, 8, 9), (256, 128, 3)]


@pytest.mark.parametrize("case", OP2_CASES, ids=lambda c: f"in{c[0]}-out{c[1]}-n{c[2]}")
@pytest.mark.parametrize("in_bits,out_bits", [(8, 4), (4, 4), (8, 8), (4, 8)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_dequant_sum_requant_matches_reference(kb, case, in_bits, out_bits, rounding):
    group, ogroup, ngroups = case
    m = group * ngroups
    key = R.make_key(5, in_bits, out_bits) if rounding == "stochastic" else None
    for k in (1, 3, 8):
        for kind in ("quantized", "bytes"):
            payloads, scales = make_chunks(k, m, in_bits, group, seed=k + m, kind=kind)
            offset = 40 if k == 3 else 0  # general and aligned counters (see the op 1 test)
            p_ref, s_ref = R.dequant_sum_requant(payloads, scales, in_bits, out_bits, group, rounding, key, offset,
                                                 ogroup)
            out = poisoned(p_ref.numel(), torch.uint8)
            out_s = poisoned(s_ref.numel(), torch.float32)
            p, s = kb.dequant_sum_requant(payloads.cuda(), scales.cuda(), in_bits, out_bits, group, rounding, key,
                                          offset, ogroup, out=out, out_scales=out_s)
            tag = f"k{k}/{kind}/in{group}/out{ogroup}/{in_bits}->{out_bits}/{rounding}"
            assert_same(s, s_ref, f"scales {tag}")
            assert_same(p, p_ref, f"payload {tag}")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("had", [None, 32, 256])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequant_sum_inverse_hadamard_matches_reference(kb, bits, had, out_dtype):
    group, m = 128, 256 * 7
    for k in (1, 4):
        for kind in ("quantized", "bytes"):
            payloads, scales = make_chunks(k, m, bits, group, seed=k * 7 + bits, kind=kind)
            for post_scale in (1.0, 1.0 / 3.0, 0.25):
                ref = R.dequant_sum_inverse_hadamard(payloads, scales, bits, group, had, out_dtype, post_scale)
                tag = f"k{k}/{kind}/b{bits}/h{had}/{out_dtype}/ps{post_scale}"
                got = kb.dequant_sum_inverse_hadamard(payloads.cuda(), scales.cuda(), bits, group, had, out_dtype,
                                                      post_scale)
                assert_same(got, ref, f"out {tag}")
                # out= larger than m, misaligned: only the first m elements are written
                buf = poisoned(m + 5, out_dtype, offset=1)
                got = kb.dequant_sum_inverse_hadamard(payloads.cuda(), scales.cuda(), bits, group, had,
                                                      post_scale=post_scale, out=buf)
                assert got is buf
                assert_same(buf[:m], ref, f"out= {tag}")
                assert bool((buf[m:] == FPOISON).all()), f"out= {tag}: wrote past m"


# ----------------------------------------------------------------------------------------------------------
# ops 4 and 5
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [128, 256, 2048, 96, 4096])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("mode", ["diff", "direct"])
def test_weight_delta_quantize_and_dequant_add(kb, group, bits, rounding, mode):
    key = R.make_key(77, group, bits) if rounding == "stochastic" else None
    for n in (group * 5, group * 5 - 3, 1001):
        for rdt in DTYPES:
            for misalign in (0, 1):
                g = _gen(n + group)
                master = torch.randn(n, generator=g) * 0.05
                if n > group:
                    master[group + 7] = float("nan")  # a non-finite group stays non-finite on every replica
                replica = (master + torch.randn(n, generator=g) * 1e-3).to(rdt)
                rep_ref = replica.clone()
                p_ref, s_ref = R.weight_delta_quantize(master, rep_ref, bits, group, rounding, key, 3, mode)

                mbuf = torch.empty(n + misalign, device="cuda")
                mbuf[misalign:] = master.cuda()
                rbuf = torch.empty(n + misalign, dtype=rdt, device="cuda")
                rbuf[misalign:] = replica.cuda()
                rep = rbuf[misalign:]
                out = poisoned(p_ref.numel(), torch.uint8, offset=misalign)
                out_s = poisoned(s_ref.numel(), torch.float32)
                p, s = kb.weight_delta_quantize(mbuf[misalign:], rep, bits, group, rounding, key, 3, mode,
                                                out=out, out_scales=out_s)
                tag = f"n{n}/{rdt}/g{group}/b{bits}/{rounding}/{mode}/mis{misalign}"
                assert_same(s, s_ref, f"scales {tag}")
                assert_same(p, p_ref, f"payload {tag}")
                assert_same(rep, rep_ref, f"replica {tag}")

                # op 5: a receiver applying the same payload reaches the owner's replica bit for bit
                recv = replica.cuda()
                recv_ref = R.dequant_add_(replica.clone(), p_ref, s_ref, bits, group, mode)
                res = kb.dequant_add_(recv, p_ref.cuda(), s_ref.cuda(), bits, group, mode)
                assert res is recv
                assert_same(recv, recv_ref, f"dequant_add_ {tag}")
                assert_same(recv, rep_ref, f"dequant_add_ vs owner {tag}")


def test_dequant_add_misaligned_and_arbitrary_bytes(cb):
    group, n = 2048, 2048 * 3 - 5
    g = _gen(5)
    for bits in (4, 8):
        payload = torch.randint(0, 256, (2048 * 3 * bits // 8,), generator=g, dtype=torch.uint8)
        scales = torch.rand(3, generator=g)
        scales[1] = float("inf")
        for rdt in DTYPES:
            for mode in ("diff", "direct"):
                replica = torch.randn(n, generator=g).to(rdt)
                ref = R.dequant_add_(replica.clone(), payload, scales, bits, group, mode)
                buf = torch.empty(n + 1, dtype=rdt, device="cuda")
                buf[1:] = replica.cuda()
                cb.dequant_add_(buf[1:], payload.cuda(), scales.cuda(), bits, group, mode)
                assert_same(buf[1:], ref, f"dequant_add_ misaligned {rdt} b{bits} {mode}")


# ----------------------------------------------------------------------------------------------------------
# op 6
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [64, 2048])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mode", ["diff", "direct"])
def test_dequant_add_segments_matches_reference(kb, group, bits, mode):
    """Layouts of test_segments.segment_layout (odd offsets, one-element pieces, a long piece over several tiles
    on the vector path), every dtype, buffers aligned or not: the reference's bits, gaps untouched."""
    from test_segments import segment_layout
    M = 3 * GPU_TILE + 2 * group + 5
    ng = (M + group - 1) // group
    g = _gen(group + bits)
    payload = torch.randint(0, 256, (ng * group * bits // 8,), generator=g, dtype=torch.uint8)
    scales = torch.rand(ng, generator=g) * 0.1
    scales[1], scales[-1] = float("inf"), float("nan")
    so, do, ln, n = segment_layout(M, group, 2 * group, 3 * GPU_TILE + 100, seed=bits)
    for rdt in DTYPES:
        base = torch.randn(n, generator=g).to(rdt)
        want = R.dequant_add_segments_(base.clone(), payload, scales, bits, group, mode,
                                       make_segment_plan(so, do, ln, base))
        for mis_dst, mis_pay in ((0, 0), (1, 0), (0, 1)):
            buf = torch.empty(n + mis_dst, dtype=rdt, device="cuda")
            dst = buf[mis_dst:]
            dst.copy_(base.cuda())
            pbuf = torch.empty(payload.numel() + mis_pay, dtype=torch.uint8, device="cuda")
            pbuf[mis_pay:] = payload.cuda()
            plan = make_segment_plan(so, do, ln, dst)
            res = kb.dequant_add_segments_(dst, pbuf[mis_pay:], scales.cuda(), bits, group, mode, plan)
            assert res is dst
            assert_same(dst, want, f"segments {rdt}/g{group}/b{bits}/{mode}/mis{mis_dst}{mis_pay}")


def test_dequant_add_segments_owner_equals_receiver(cb):
    group, bits = 2048, 4
    M = 5 * group + 77
    g = _gen(9)
    master = torch.randn(M, generator=g) * 0.05
    replica = (master + torch.randn(M, generator=g) * 1e-3).bfloat16().cuda()
    before = replica.clone()
    p, s = cb.weight_delta_quantize(master.cuda(), replica, bits, group)
    # pieces at odd source and destination offsets, reversed in the buffer
    cuts = [0, 1, 777, group, group + 4093, 4 * group, M]
    pieces = [(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])][::-1]
    dst = torch.zeros(M + 50, dtype=torch.bfloat16, device="cuda")
    so, do, ln, pos = [], [], [], 3
    for a, L in pieces:
        so.append(a), do.append(pos), ln.append(L)
        dst[pos: pos + L] = before[a: a + L]
        pos += L + 5
    cb.dequant_add_segments_(dst, p, s, bits, group, "diff", make_segment_plan(so, do, ln, dst))
    for a, d, L in zip(so, do, ln):
        assert_same(dst[d: d + L], replica[a: a + L], f"piece {a}+{L} at {d}")


# ----------------------------------------------------------------------------------------------------------
# plumbing: streams, no allocation with out buffers, no host synchronization, dispatch
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_side_stream_no_sync_no_alloc(cb, name):
    """All six ops of both compiled backends with ``out`` buffers, on a side stream: results right, no host
    synchronization (sync debug mode "error" raises on one), no device memory allocated."""
    if name == "triton":
        b = ops.get_backend("triton", "cuda")
        ok, why = b.available(torch.device("cuda"))
        if not ok:
            pytest.skip(f"triton backend unavailable: {why}")
    else:
        b = cb
    group, n, k, key = 128, 128 * 64, 4, R.make_key(1, 2, 3)
    x = make_data("heavy", n, group, seed=2).to(torch.bfloat16)
    p1, s1 = R.hadamard_quantize(x, 8, group, 32, "stochastic", key, 0)
    chunks = [R.hadamard_quantize(make_data("randn", n, group, seed=10 + j), 8, group, 32) for j in range(k)]
    pay, sc = torch.stack([c[0] for c in chunks]), torch.stack([c[1] for c in chunks])
    p2, s2 = R.dequant_sum_requant(pay, sc, 8, 4, group, "stochastic", key, 0)
    y3 = R.dequant_sum_inverse_hadamard(pay[:2], sc[:2], 8, group, 32, torch.bfloat16, 0.5)
    master = make_data("randn", n, group, seed=3)
    replica = (master + 0.01).to(torch.bfloat16)
    p4, s4 = R.weight_delta_quantize(master, replica.clone(), 4, 2048, "nearest", None, 0)
    rep4 = replica.clone()
    R.weight_delta_quantize(master, rep4, 4, 2048, "nearest", None, 0)
    rep5 = R.dequant_add_(replica.clone(), p4, s4, 4, 2048)
    # op 6: the replica's pieces reversed in a flat buffer, the plan built beforehand (as at attach time)
    seg = [(0, 1, 1000), (1000, 3000, n - 1000 - 5), (n - 5, 1003, 5)]
    so6, do6, ln6 = (list(v) for v in zip(*seg))
    buf6 = torch.zeros(n + 3000, dtype=torch.bfloat16)
    for a, d, L in seg:
        buf6[d: d + L] = replica[a: a + L]
    rep6 = R.dequant_add_segments_(buf6.clone(), p4, s4, 4, 2048, "diff", make_segment_plan(so6, do6, ln6, buf6))

    dev = {"x": x.cuda(), "pay": pay.cuda(), "sc": sc.cuda(), "master": master.cuda(), "p4": p4.cuda(),
           "s4": s4.cuda()}
    outs = {"p1": torch.empty(n, dtype=torch.uint8, device="cuda"), "s1": torch.empty(n // group, device="cuda"),
            "p2": torch.empty(n // 2, dtype=torch.uint8, device="cuda"), "s2": torch.empty(n // group, device="cuda"),
            "y3": torch.empty(n, dtype=torch.bfloat16, device="cuda"),
            "p4": torch.empty(n // 2, dtype=torch.uint8, device="cuda"), "s4": torch.empty(n // 2048, device="cuda")}

    def run_all(rep4_buf, rep5_buf, rep6_buf, plan6):
        b.hadamard_quantize(dev["x"], 8, group, 32, "stochastic", key, 0, out=outs["p1"], out_scales=outs["s1"])
        b.dequant_sum_requant(dev["pay"], dev["sc"], 8, 4, group, "stochastic", key, 0, out=outs["p2"],
                              out_scales=outs["s2"])
        b.dequant_sum_inverse_hadamard(dev["pay"][:2], dev["sc"][:2], 8, group, 32, post_scale=0.5, out=outs["y3"])
        b.weight_delta_quantize(dev["master"], rep4_buf, 4, 2048, "nearest", None, 0, out=outs["p4"],
                                out_scales=outs["s4"])
        b.dequant_add_(rep5_buf, dev["p4"], dev["s4"], 4, 2048)
        b.dequant_add_segments_(rep6_buf, dev["p4"], dev["s4"], 4, 2048, "diff", plan6)

    warm6 = buf6.cuda()
    run_all(replica.cuda(), replica.cuda(), warm6, make_segment_plan(so6, do6, ln6, warm6))  # build / warm up
    torch.cuda.synchronize()
    rep4_buf, rep5_buf, rep6_buf = replica.cuda(), replica.cuda(), buf6.cuda()
    plan6 = make_segment_plan(so6, do6, ln6, rep6_buf)
    for t in outs.values():
        t.fill_(POISON if t.dtype == torch.uint8 else FPOISON)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronization inside the ops raises
    try:
        with torch.cuda.stream(side):
            run_all(rep4_buf, rep5_buf, rep6_buf, plan6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.max_memory_allocated() == before, f"{name}: the ops allocated device memory despite out buffers"
    side.synchronize()
    for got, want, what in ((outs["p1"], p1, "op1 payload"), (outs["s1"], s1, "op1 scales"),
                            (outs["p2"], p2, "op2 payload"), (outs["s2"], s2, "op2 scales"),
                            (outs["y3"], y3, "op3 output"), (outs["p4"], p4, "op4 payload"),
                            (outs["s4"], s4, "op4 scales"), (rep4_buf, rep4, "op4 replica"),
                            (rep5_buf, rep5, "op5 replica"), (rep6_buf, rep6, "op6 buffer")):
        assert_same(got, want, f"{name} {what} on a side stream")


def test_auto_backend_picks_per_op(cb):
    """auto on a GPU: each op from the first backend of its AUTO_ORDER that runs here (both compiled ones do
    wherever Triton is installed, so the picks mix them); op 3 by chunk count (tests/test_ops.py checks the
    routing with stand-in backends)."""
    dev = torch.device("cuda")
    b = ops.get_backend("auto", dev)

    def first(order):
        for n in order:
            try:
                return n, ops.get_backend(n, dev)
            except RuntimeError:
                continue
        raise AssertionError(f"nothing of {order} runs here")

    for op, order in ops.AUTO_ORDER.items():
        want, nb = first(order)
        if op in ops.AUTO_ORDER_MANY_CHUNKS:
            max_k, many_order = ops.AUTO_ORDER_MANY_CHUNKS[op]
            many = first(many_order)[0]
            if many != want:
                assert b.picks[op] == f"{want} (k <= {max_k}), {many} (k > {max_k})", op
                continue
        assert b.picks[op] == want and getattr(b, op) is getattr(nb, op), op
    assert ops.get_backend("cuda", "cuda").name == "cuda"
    ok, why = cb.available(torch.device("cpu"))
    assert not ok and "CUDA tensors" in why


def test_empty_inputs(cb):
    x = torch.empty(0, device="cuda")
    p, s = cb.hadamard_quantize(x, 4, 128, 32)
    assert p.numel() == 0 and s.numel() == 0
    rep = torch.empty(0, device="cuda")
    p, s = cb.weight_delta_quantize(rep.clone(), rep, 4, 2048)
    assert p.numel() == 0 and s.numel() == 0
    dst = torch.ones(10, device="cuda")
    plan = make_segment_plan([0], [3], [0], dst)
    assert cb.dequant_add_segments_(dst, torch.zeros(8, dtype=torch.uint8, device="cuda"), torch.ones(1, device="cuda"),
                                    8, 8, "diff", plan) is dst
    assert torch.equal(dst, torch.ones(10, device="cuda"))


# ----------------------------------------------------------------------------------------------------------
# binding input checks
# ----------------------------------------------------------------------------------------------------------
def _ext():
    from deepspeed_sdp4bit import _native
    return _native.load_extension()


def _rejects(msg: str, needle: str) -> None:
    """The binding returns its error message instead of launching ('' means it launched)."""
    assert msg, f"the binding accepted an input it should reject ({needle!r})"
    assert needle in msg, f"expected {needle!r} in the binding's message {msg!r}"


def test_binding_rejects_bad_inputs(cb):
    ext = _ext()
    x = torch.randn(1024, device="cuda")
    out = torch.empty(512, dtype=torch.uint8, device="cuda")
    out_s = torch.empty(8, device="cuda")

    def hq(**kw):
        args = dict(x=x, bits=4, group=128, had=32, rnd=0, key=0, off=0, rows=0, cols=0, out=out, out_s=out_s)
        args.update(kw)
        return ext.hadamard_quantize(args["x"], args["bits"], args["group"], args["had"], args["rnd"], args["key"],
                                     args["off"], args["rows"], args["cols"], args["out"], args["out_s"])

    assert hq() == ""  # the baseline call is valid and launches
    _rejects(hq(x=x.cpu()), "CUDA tensor")
    _rejects(hq(x=x.to(torch.float64)), "x must be float32, float16 or bfloat16")
    _rejects(hq(x=torch.randn(2048, device="cuda")[::2]), "contiguous")
    _rejects(hq(bits=3), "bits must be 4 or 8")
    _rejects(hq(group=12), "multiple of 8")
    _rejects(hq(had=512, group=1024, out_s=torch.empty(1, device="cuda")), "hadamard_size")
    _rejects(hq(had=24), "hadamard_size")
    _rejects(hq(had=4), "power of two in 8..256")
    _rejects(hq(group=128, had=256), "multiple of hadamard_size")
    _rejects(hq(x=torch.randn(1000, device="cuda")), "not a multiple of group_size")
    _rejects(hq(rnd=2), "rounding")
    _rejects(hq(out=torch.empty(511, dtype=torch.uint8, device="cuda")), "out has")
    _rejects(hq(out=torch.empty(512, dtype=torch.int8, device="cuda")), "out must be")
    _rejects(hq(out=torch.empty(512, dtype=torch.uint8)), "out must be a CUDA tensor")
    _rejects(hq(out_s=torch.empty(8, dtype=torch.float16, device="cuda")), "out_scales")
    _rejects(hq(rows=3, cols=5), "segments")
    _rejects(hq(rows=2, cols=0), "swizzle")

    payloads = torch.zeros(4, 512, dtype=torch.uint8, device="cuda")
    scales = torch.ones(4, 8, device="cuda")
    dsr = ext.dequant_sum_requant
    assert dsr(payloads, scales, 4, 4, 128, 0, 0, 0, 128, out, out_s) == ""
    _rejects(dsr(payloads.view(-1), scales, 4, 4, 128, 0, 0, 0, 128, out, out_s), "2-D")
    _rejects(dsr(payloads, scales.reshape(-1)[:28], 4, 4, 128, 0, 0, 0, 128, out, out_s), "scales has")
    _rejects(dsr(payloads, scales.half(), 4, 4, 128, 0, 0, 0, 128, out, out_s), "scales must be")
    _rejects(dsr(payloads, scales, 4, 4, 128, 0, 0, 0, 100, out, out_s), "out_group_size")
    _rejects(dsr(payloads[:0], scales[:0], 4, 4, 128, 0, 0, 0, 128, out, out_s), "at least one chunk")
    _rejects(dsr(payloads, scales, 4, 4, 128, 0, 0, 0, 256, out, out_s), "out_scales has")
    dsih = ext.dequant_sum_inverse_hadamard
    assert dsih(payloads, scales, 4, 128, 32, 1.0, torch.empty(1024, device="cuda")) == ""
    _rejects(dsih(payloads, scales, 4, 128, 32, 1.0, torch.empty(1000, device="cuda")), "needs at least")
    _rejects(dsih(payloads, scales, 4, 128, 32, 1.0, torch.empty(1024, dtype=torch.int32, device="cuda")),
             "out must be float32")

    master = torch.randn(1000, device="cuda")
    rep = master.bfloat16()
    wout = torch.empty(512, dtype=torch.uint8, device="cuda")
    wsc = torch.empty(1, device="cuda")
    wdq = ext.weight_delta_quantize
    assert wdq(master, rep, 4, 1024, 0, 0, 0, 1, wout, wsc) == ""
    _rejects(wdq(master.half(), rep, 4, 1024, 0, 0, 0, 1, wout, wsc), "master must be")
    _rejects(wdq(master, rep[:999], 4, 1024, 0, 0, 0, 1, wout, wsc), "elements but replica")
    _rejects(wdq(master, rep, 4, 1024, 0, 0, 0, 2, wout, wsc), "mode")
    _rejects(wdq(master, torch.randn(2000, device="cuda").bfloat16()[::2], 4, 1024, 0, 0, 0, 1, wout, wsc),
             "contiguous")
    da = ext.dequant_add_
    assert da(rep, wout, wsc, 4, 1024, 1) == ""
    _rejects(da(torch.randn(2000, device="cuda"), wout, wsc, 4, 1024, 1), "payload holds")
    _rejects(da(rep, wout, torch.empty(2, device="cuda"), 4, 1024, 1), "scales has")
    _rejects(da(rep.double(), wout, wsc, 4, 1024, 1), "replica must be")
    das = ext.dequant_add_segments_
    tiles = torch.tensor([[0, 0, 1000]], dtype=torch.int64, device="cuda")
    assert das(rep, wout, wsc, 4, 1024, 1, tiles, 1000, 1000) == ""
    _rejects(das(rep.cpu(), wout, wsc, 4, 1024, 1, tiles, 1000, 1000), "CUDA tensor")
    _rejects(das(rep.double(), wout, wsc, 4, 1024, 1, tiles, 1000, 1000), "dst must be float32")
    _rejects(das(rep.view(10, 100), wout, wsc, 4, 1024, 1, tiles, 1000, 1000), "dst must be 1-D")
    _rejects(das(rep, wout, wsc, 4, 1024, 1, tiles.int(), 1000, 1000), "tiles must be int64")
    _rejects(das(rep, wout, wsc, 4, 1024, 1, tiles.view(-1), 1000, 1000), "tiles must be [T, 3]")
    _rejects(das(rep, wout, wsc, 4, 1024, 1, tiles.cpu(), 1000, 1000), "tiles must be a CUDA tensor")
    _rejects(das(rep, wout, wsc, 4, 1024, 1, tiles, 1025, 1000), "the segments read up to 1025")
    _rejects(das(rep, wout, wsc, 4, 1024, 1, tiles, 1000, 1001), "the segments write up to 1001")
    _rejects(das(rep, wout, torch.empty(2, device="cuda"), 4, 1024, 1, tiles, 1000, 1000), "scales has")
    _rejects(das(rep, wout, wsc, 4, 1020, 1, tiles, 1000, 1000), "multiple of 8")
    _rejects(das(rep, wout, wsc, 4, 1024, 2, tiles, 1000, 1000), "mode")
    _rejects(das(rep, wout.char(), wsc, 4, 1024, 1, tiles, 1000, 1000), "payload must be")
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="plan was built for cpu"):
        cb.dequant_add_segments_(rep, wout, wsc, 4, 1024, "diff", make_segment_plan([0], [0], [10], rep.cpu()))

    # the Python wrappers raise what the binding returns, and what the reference rejects, with its wording
    with pytest.raises(ValueError, match="hadamard_size"):
        cb.hadamard_quantize(x, 4, 128, 24)
    with pytest.raises(ValueError, match="CUDA tensor"):
        cb.dequant_add_(rep.cpu(), wout, wsc, 4, 1024)
    with pytest.raises(ValueError, match="needs a key"):
        cb.hadamard_quantize(x, 4, 128, 32, "stochastic")
    with pytest.raises(ValueError, match="rounding must be"):
        cb.hadamard_quantize(x, 4, 128, 32, "up")
    with pytest.raises(ValueError, match="mode must be"):
        cb.dequant_add_(rep, wout, wsc, 4, 1024, mode="sum")
    with pytest.raises(ValueError, match="contiguous"):
        cb.dequant_add_(torch.randn(2000, device="cuda")[::2], wout, wsc, 4, 1024)
    with pytest.raises(ValueError, match="buffer has"):
        cb.hadamard_quantize(x, 4, 128, 32, out=torch.empty(100, dtype=torch.uint8, device="cuda"))
