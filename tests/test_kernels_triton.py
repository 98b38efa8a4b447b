"""The Triton backend against reference.py: codes, scales and float outputs must be bit-identical.

On machines without a GPU, conftest.py sets TRITON_INTERPRET=1 before anything imports triton, so the
kernels run on CPU tensors through Triton's interpreter (slow per program: sizes here are small).  On a GPU
machine the same tests run on the CUDA device (marked ``gpu``); the CPU variant is then skipped with its
reason, because compiled Triton kernels cannot take CPU tensors.

References are always computed on CPU copies of the inputs (the reference's stochastic rounding builds its
counters on CPU), and the backend's outputs are moved to CPU for comparison.
"""

import contextlib
import math
import os

import pytest
import torch

from deepspeed_sdp4bit import ops
from deepspeed_sdp4bit import reference as R
from deepspeed_sdp4bit.kernels import triton_backend as T
from deepspeed_sdp4bit.segments import make_segment_plan

pytestmark = pytest.mark.filterwarnings(
    # the interpreter computes with numpy, which warns on inf - inf and overflow that the tests feed it
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning",
    "ignore:All-NaN slice encountered:RuntimeWarning")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROUNDINGS = ("nearest", "stochastic")
KEY = R.make_key(20240531, 7, 3)  # some stream; a second one above 2**31 is used in the offset test
SMALL_TILE = 128  # elements per program when a case asks for several programs (partial last one too)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cpu" and not T.is_interpreted():
        pytest.skip("CPU tensors need the triton interpreter: TRITON_INTERPRET=1 must be set before import "
                    "(tests/conftest.py sets it only on machines without a GPU)")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    return torch.device(request.param)


@pytest.fixture
def backend(device):
    return ops.get_backend("triton", device)


@pytest.fixture(scope="module")
def each_case():
    """``each_case(device, check, n, *args)`` runs ``check(device, ci, *args)`` for every case index ``ci < n``.

    On a GPU it runs them here, one after the other.  Under the interpreter (single-threaded Python: ops 1-3 over
    all their cases are most of this file's time) it hands them to as many worker processes as the machine has
    cores (forked as dist_utils starts its gloo ranks), which run exactly what this process would; the first
    failing case (by index) fails the test with its own assertion message.
    """
    pool = []

    def run(device, check, n, *args):
        if device.type != "cpu" or n < 2 or (os.cpu_count() or 1) < 2:
            for ci in range(n):
                check(device, ci, *args)
            return
        if not pool:
            import dist_utils

            pool.append(dist_utils.process_pool(min(os.cpu_count(), 4)))
        # the last cases of each list are the long ones (many programs): handed out first, they do not run alone
        futures = {ci: pool[0].submit(check, "cpu", ci, *args) for ci in reversed(range(n))}
        errors = []
        for ci in range(n):   # every case finishes (or fails) before the test ends
            try:
                futures[ci].result()
            except Exception as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
        if errors:
            raise errors[0]

    yield run
    if pool:
        pool[0].shutdown()


@contextlib.contextmanager
def tiles(elems):
    """Temporarily set the elements per program (None: the backend's defaults) to force several programs."""
    saved = (T._INTERP_TILE, T._GPU_TILE, T._GPU_ROWS, T._PERSIST_PROGRAMS)
    if elems is not None:
        T._INTERP_TILE = T._GPU_TILE = elems
        T._GPU_ROWS = max(1, elems // 32)  # the row kernels: still a warp of rows at least (see _rows_plan)
        T._PERSIST_PROGRAMS = 2  # persistent kernels: programs loop over several tiles on GPUs too
    try:
        yield
    finally:
        T._INTERP_TILE, T._GPU_TILE, T._GPU_ROWS, T._PERSIST_PROGRAMS = saved


# ----------------------------------------------------------------------------------------------------------
# comparison helpers
# ----------------------------------------------------------------------------------------------------------
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_same_floats(got, want, what):
    """Bitwise equality of float tensors (so -0.0 != +0.0), except that any NaN matches any NaN.

    NaN payload bits are not compared: GPUs produce a canonical NaN where the CPU keeps the input's.
    """
    got = got.detach().cpu().reshape(-1)
    want = want.detach().cpu().reshape(-1)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN at {torch.nonzero(gn != wn).view(-1)[:8].tolist()}"
    gi = got[~gn].view(_INT_VIEW[got.dtype])
    wi = want[~wn].view(_INT_VIEW[want.dtype])
    bad = torch.nonzero(gi != wi).view(-1)
    assert bad.numel() == 0, (f"{what}: {bad.numel()} of {gi.numel()} values differ, first "
                              f"{got[~gn][bad[:4]].tolist()} vs {want[~wn][bad[:4]].tolist()}")


def assert_same_bytes(got, want, what):
    got = got.detach().cpu().reshape(-1)
    want = want.detach().cpu().reshape(-1)
    assert got.dtype == want.dtype == torch.uint8, f"{what}: dtypes {got.dtype}, {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = torch.nonzero(got != want).view(-1)
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {got.numel()} bytes differ, first at {bad[:8].tolist()}"


# ----------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------
def _student_t(n, df, gen):
    z = torch.randn(n, generator=gen)
    chi2 = (torch.randn(n, df, generator=gen) ** 2).sum(1)
    return z / torch.sqrt(chi2 / df)


def make_data(kind, n, group_size, qmax, seed):
    """fp32 [n] test data.

    normal: N(0, 4).  heavy: Student-t (df=2) with a few 1e3 outliers.  special: per group, cycling:
    all zeros (with -0.0), exact rounding ties at scale 1, NaN, +inf, -inf with NaN, subnormals only,
    1.0 next to negative subnormals, values near fp32 max (sums overflow, fp16 casts give inf), scales
    just above and just below 2**-127 (where 1 / scale overflows).
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=gen) * 2
    if kind == "heavy":
        x = _student_t(n, 2, gen)
        idx = torch.randint(0, n, (max(1, n // 50),), generator=gen)
        x[idx] = x[idx].sign() * 1e3 + x[idx]
        return x
    assert kind == "special"
    x = torch.randn(n, generator=gen)
    tiny = 1.401298464324817e-45  # smallest fp32 subnormal
    for gi in range(math.ceil(n / group_size)):
        lo, hi = gi * group_size, min(n, (gi + 1) * group_size)
        g = x[lo:hi]
        pat = gi % 9
        if pat == 0:
            g.zero_()
            g[::3] = -0.0
        elif pat == 1:
            # absmax = qmax -> scale exactly 1, so y = x and every k + 0.5 is a tie (round away from zero)
            ties = torch.arange(g.numel(), dtype=torch.float32) % (2 * qmax) - qmax + 0.5
            g.copy_(ties)
            g[0] = qmax
        elif pat == 2:
            g[g.numel() // 2] = float("nan")
        elif pat == 3:
            g[-1] = float("inf")
        elif pat == 4:
            g[0] = float("-inf")
            g[-1] = float("nan")
        elif pat == 5:
            g.copy_(torch.randint(-3, 4, (g.numel(),), generator=gen).float() * tiny)
        elif pat == 6:
            g.copy_(-torch.randint(0, 4, (g.numel(),), generator=gen).float() * tiny)
            g[0] = 1.0
        elif pat == 7:
            g.mul_(1e38)
        else:
            # absmax / qmax just below 2**-127 (odd groups: 1 / scale overflows, codes 0) or just above it
            g.mul_((2.0 ** -121.2 if gi % 2 else 2.0 ** -118) / max(float(g.abs().max()), 1e-30))
    return x


def random_chunks(k, m, bits, group_size, seed, special_scales=True):
    """Raw payloads uint8 [k, m*bits/8] with every code value (4-bit -8 too) and fp32 scales [k, m/gs].

    With ``special_scales`` some scales are 0, inf and NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    payloads = torch.randint(0, 256, (k, m * bits // 8), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales = torch.rand(k, m // group_size, generator=gen) * 0.1
    if special_scales and scales.numel() >= 4:
        flat = scales.view(-1)
        flat[1] = 0.0
        flat[-1] = float("inf")
        flat[flat.numel() // 2] = float("nan")
    return payloads, scales


def quantized_chunks(k, m, bits, group_size, seed):
    """Payloads/scales produced by the reference quantizer from special/heavy data (NaN/inf scales)."""
    ps, ss = [], []
    for j in range(k):
        kind = ("special", "heavy", "normal")[j % 3]
        x = make_data(kind, m, group_size, R.qmax_for_bits(bits), seed + j)
        codes, s = R.quantize_groups(x, bits, group_size)
        ps.append(R.pack_codes(codes, bits))
        ss.append(s)
    return torch.stack(ps), torch.stack(ss)


# "finite": no special scales, where a NaN/inf group would hide wrong values next to it (the zero padding)
CHUNK_SOURCES = {"quantized": quantized_chunks, "random": random_chunks,
                 "finite": lambda *a, **kw: random_chunks(*a, special_scales=False, **kw)}


def chunk_inputs(source, k, group_size, groups, bits, seed):
    """``(m, payloads, scales)``: ``k`` chunks of ``m = group_size * groups`` elements from ``CHUNK_SOURCES[source]``."""
    m = group_size * groups
    return (m, *CHUNK_SOURCES[source](k, m, bits, group_size, seed=seed))


def _triton_on(device):
    """A case check's device (text where it runs in a worker process of ``each_case``) and the Triton backend there."""
    device = torch.device(device)
    return device, ops.get_backend("triton", device)


# ----------------------------------------------------------------------------------------------------------
# op 1: hadamard_quantize
# ----------------------------------------------------------------------------------------------------------
# (group_size, groups, hadamard_size, swizzle, tile)
HQ_CASES = [
    (64, 1, None, None, None),
    (64, 7, None, None, SMALL_TILE),
    (64, 7, 32, None, None),
    (64, 3, 32, None, SMALL_TILE),
    (64, 6, 32, (2, 3), SMALL_TILE),  # segments of whole groups
    (64, 3, None, (2, 3), None),  # segments of 32 elements: groups straddle segments
    (64, 3, 32, (3, 2), SMALL_TILE),  # the same with a transform, over several programs
    (96, 3, 32, None, None),  # group size not a power of two
    (2048, 1, 32, None, None),  # the weight group size, with a transform
    (32, 10, 32, None, None),  # >= 9 groups: every special pattern, both sides of the 2**-127 scale
    (128, 5, 64, None, SMALL_TILE),  # rows of 64 (eight slabs) in the row kernels
    (256, 2, 128, None, None),  # a Hadamard size above the row kernels' 64: the general kernel
]


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hadamard_quantize_matches_reference(backend, device, dtype, bits, rounding, each_case):
    each_case(device, _check_hadamard_quantize, len(HQ_CASES), dtype, bits, rounding)


def _check_hadamard_quantize(device, ci, dtype, bits, rounding):
    device, backend = _triton_on(device)
    qmax = R.qmax_for_bits(bits)
    gs, ng, h, sw, tile = HQ_CASES[ci]
    for kind in ("normal", "heavy", "special"):
        x = make_data(kind, gs * ng, gs, qmax, seed=100 * ci + len(kind)).to(dtype)
        offset = 12345 * ci
        want_p, want_s = R.hadamard_quantize(x, bits, gs, h, rounding, KEY, offset, sw)
        with tiles(tile):
            got_p, got_s = backend.hadamard_quantize(x.to(device), bits, gs, h, rounding, KEY, offset, sw)
        what = f"{kind} gs={gs} groups={ng} h={h} swizzle={sw} tile={tile}"
        assert got_p.device.type == device.type, f"payload on {got_p.device}, input on {device}: {what}"
        assert_same_bytes(got_p, want_p, "payload " + what)
        assert_same_floats(got_s, want_s, "scales " + what)


@pytest.mark.parametrize("offset", (4321, 4322, 4320), ids=("odd-general", "even-rows", "aligned-rows"))
@pytest.mark.parametrize("bits", (4, 8))
def test_stochastic_uniforms_exact_at_decision_boundaries(backend, device, bits, offset):
    """Inputs placed exactly on floor(y + u1)'s decision boundary for their own counter's u1.

    With scale 1 (the first element is qmax), element i gets y = 2 - u1_i (so y + u1_i = 2, code 1) or
    y = 2 - u1_i - 2**-23 (y + u1_i = 2 - 2**-23, code 0): the codes match the reference only if every u1_i
    is bit-identical, which random data alone would almost never reveal.  An odd offset makes pairs of
    counters that share a hash straddle the vectors of the kernels (the general kernel); an even one takes the
    row kernel's pair hashing, a multiple of the row size its aligned form.
    """
    n = 256
    assert (T._rows_plan(32, n, n // 32) is not None) and T._pairs_fit(True, offset, n) == (offset % 2 == 0)
    u1 = R.stochastic_uniforms(KEY, torch.arange(n, dtype=torch.int64) + offset)
    x = 2.0 - u1  # exact (Sterbenz)
    x[1::2] -= 2.0 ** -23  # exact: 2 - u1 is a multiple of 2**-17 in (0, 1)
    x[0] = R.qmax_for_bits(bits)
    want_p, want_s = R.hadamard_quantize(x, bits, n, None, "stochastic", KEY, offset)
    codes = R.unpack_codes(want_p, bits)
    assert torch.equal(codes[2::2], torch.ones(n // 2 - 1, dtype=torch.int8))  # the construction holds
    assert torch.equal(codes[1::2], torch.zeros(n // 2, dtype=torch.int8))
    got_p, got_s = backend.hadamard_quantize(x.to(device), bits, n, None, "stochastic", KEY, offset)
    assert_same_bytes(got_p, want_p, "payload")
    assert_same_floats(got_s, want_s, "scales")


def test_row_kernel_plan():
    """Which inputs the row kernels take (the cases above cover both kernels of each op through this rule)."""
    plan = T._rows_plan
    assert plan(32, 128, 1 << 20)[1] == 4  # 4 rows of 32 per group of 128
    assert plan(32, 8192, 1 << 20)[1] == 256  # the largest group: 256 rows, 8 warps on a GPU
    assert plan(64, 128, 64) is not None  # rows of 64
    assert plan(128, 256, 64) is None  # rows above 64 values per thread: the general kernel
    assert plan(32, 96, 64) is None  # 3 rows per group: not a power of two
    assert plan(64, 32, 64) is None  # groups smaller than a row
    assert [T._unrolled_chunks(k) for k in (1, 2, 8, 9)] == [1, 2, 8, 0]  # op 2's chunk loop unrolled up to 8
    # op 2's row length: 64 up to 2 chunks where both group sizes are multiples of 64
    assert [T._op2_row(k, 128, 128) for k in (1, 2, 3, 8)] == [64, 64, 32, 32]
    assert T._op2_row(2, 64, 32) == 32 and T._op2_row(2, 32, 128) == 32
    if not T._INTERPRETED:  # on GPUs a program has at least a warp of rows, one per thread
        assert plan(32, 64, 3) == (32, 2, 1)
        assert plan(32, 128, 1 << 20) == (T._GPU_ROWS, 4, T._GPU_ROWS // 32)  # rows per program, one per thread
    assert T._pairs_fit(False, 7, 64)  # nearest rounding hashes nothing
    assert not T._pairs_fit(True, 7, 64)  # odd offset: pairs straddle rows
    assert not T._pairs_fit(True, 2 ** 33 - 64, 256)  # pair indices at or above 2**32: a second hash round
    assert not T._pairs_fit(True, -64, 256)  # negative counters
    assert T._pairs_fit(True, 2 ** 33 - 512, 512)  # the last pair below 2**32


def test_hadamard_quantize_counters_above_2_32(backend, device):
    """Stochastic counters crossing 2**32 or negative (the reference's second hash round), key >= 2**31."""
    key = R.make_key(5, 2 ** 40 + 3) | 0x80000000
    x = make_data("heavy", 64 * 3, 64, 7, seed=9)
    for offset in (2 ** 32 - 100, 2 ** 33 - 192, 2 ** 33 + 17, -50):  # rows, rows to the last pair, general x2
        want_p, want_s = R.hadamard_quantize(x, 4, 64, 32, "stochastic", key, offset)
        got_p, got_s = backend.hadamard_quantize(x.to(device), 4, 64, 32, "stochastic", key, offset)
        assert_same_bytes(got_p, want_p, f"payload offset={offset}")
        assert_same_floats(got_s, want_s, f"scales offset={offset}")


# ----------------------------------------------------------------------------------------------------------
# op 2: dequant_sum_requant
# ----------------------------------------------------------------------------------------------------------
# (k, group_size, out_group_size, input groups, chunk source, tile, counter offset)
# Op 2's row kernel takes rows of 64 for up to 2 chunks where both group sizes allow it (else 32); an offset that
# is a multiple of the row length takes its aligned counter hashing, another even one the general pair hashing,
# an odd one the grouped kernel.
DSR_CASES = [
    (1, 64, None, 1, "quantized", None, 0),
    (3, 64, None, 7, "quantized", SMALL_TILE, 999),
    (3, 64, 32, 3, "quantized", None, 1998),
    (2, 32, 96, 7, "random", SMALL_TILE, 2997),  # m = 224 -> 3 output groups, the last one zero-padded
    (4, 64, 128, 3, "random", None, 3996),  # m = 192 -> 2 output groups, padded
    (9, 64, None, 2, "quantized", None, 4995),  # more chunks than op 2's row kernel unrolls: its run-time loop
    (2, 128, None, 9, "random", SMALL_TILE, 640),  # rows of 64, aligned counters, several programs
    (1, 64, 128, 8, "random", SMALL_TILE, 96),  # rows of 64, even offset not a multiple of 64
    (3, 128, None, 4, "random", SMALL_TILE, 640),  # 3 chunks: rows of 32 again
    (4, 128, None, 32, "random", SMALL_TILE, 256),  # 4 chunks of 8-bit codes: the persistent kernel, tiles looped
    (4, 128, 512, 30, "finite", SMALL_TILE, 512),  # the persistent kernel, zero-padded rows (m = 3840 of 4096)
    (8, 128, None, 12, "quantized", SMALL_TILE, 256),  # the persistent kernel with 8 chunks
    (5, 128, None, 8, "random", SMALL_TILE, 128),  # and with 5
]


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("in_bits,out_bits", [(8, 4), (4, 8), (8, 8), (4, 4)])
def test_dequant_sum_requant_matches_reference(backend, device, in_bits, out_bits, rounding, each_case):
    each_case(device, _check_dequant_sum_requant, len(DSR_CASES), in_bits, out_bits, rounding)


def _check_dequant_sum_requant(device, ci, in_bits, out_bits, rounding):
    device, backend = _triton_on(device)
    k, gs, ogs, ng, source, tile, offset = DSR_CASES[ci]
    m, payloads, scales = chunk_inputs(source, k, gs, ng, in_bits, seed=7 * ci + in_bits)
    want_p, want_s = R.dequant_sum_requant(payloads, scales, in_bits, out_bits, gs, rounding, KEY,
                                           offset, ogs)
    with tiles(tile):
        got_p, got_s = backend.dequant_sum_requant(payloads.to(device), scales.to(device), in_bits,
                                                   out_bits, gs, rounding, KEY, offset, ogs)
    what = f"k={k} gs={gs} ogs={ogs} m={m} {source} tile={tile}"
    assert_same_bytes(got_p, want_p, "payload " + what)
    assert_same_floats(got_s, want_s, "scales " + what)


# ----------------------------------------------------------------------------------------------------------
# op 3: dequant_sum_inverse_hadamard
# ----------------------------------------------------------------------------------------------------------
# (k, group_size, hadamard_size, input groups, post_scale, chunk source, tile)
DSIH_CASES = [
    (1, 64, 32, 1, 1.0, "quantized", None),
    (3, 64, 32, 7, 1.0 / 3.0, "random", SMALL_TILE),
    (4, 32, None, 3, 0.125, "random", None),
    (2, 128, 32, 3, 1e-3, "quantized", SMALL_TILE),
    (2, 64, 64, 3, 2.0, "random", None),
    (2, 128, 128, 2, 0.5, "random", None),  # Hadamard size above the row kernels' 64: the general kernel
    (3, 32, 64, 4, 1.0, "quantized", SMALL_TILE),  # groups smaller than a row: the general kernel
    (9, 64, 32, 2, 1.0, "random", None),  # many chunks (op 3's row kernel always loops at run time)
    (4, 128, 32, 41, 0.5, "random", SMALL_TILE),  # the persistent kernel (k = 4), looping, a partial last tile
    (8, 64, None, 64, 1.0, "quantized", SMALL_TILE),  # the persistent kernel (k = 8), no Hadamard
]


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_dequant_sum_inverse_hadamard_matches_reference(backend, device, out_dtype, bits, each_case):
    each_case(device, _check_dequant_sum_inverse_hadamard, len(DSIH_CASES), out_dtype, bits)


def _check_dequant_sum_inverse_hadamard(device, ci, out_dtype, bits):
    device, backend = _triton_on(device)
    k, gs, h, ng, post, source, tile = DSIH_CASES[ci]
    m, payloads, scales = chunk_inputs(source, k, gs, ng, bits, seed=11 * ci + bits)
    want = R.dequant_sum_inverse_hadamard(payloads, scales, bits, gs, h, out_dtype, post)
    with tiles(tile):
        got = backend.dequant_sum_inverse_hadamard(payloads.to(device), scales.to(device), bits, gs, h,
                                                   out_dtype, post)
    assert_same_floats(got, want, f"k={k} gs={gs} h={h} m={m} post={post} {source} tile={tile}")


# ----------------------------------------------------------------------------------------------------------
# op 4 and op 5: weight_delta_quantize / dequant_add_
# ----------------------------------------------------------------------------------------------------------
# (group_size, n, master data, tile)
WD_CASES = [
    (64, 64, "normal", None),
    (64, 64 * 3 - 6, "heavy", SMALL_TILE),  # zero-padded last group
    (64, 64 * 7 - 1, "special", SMALL_TILE),  # padded, odd n (4-bit payload still whole bytes)
    (2048, 2048 + 300, "heavy", None),
]


def _master_and_replica(kind, n, gs, qmax, dtype, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    replica = (torch.randn(n, generator=gen) * 0.05).to(dtype)
    delta = make_data(kind, n, gs, qmax, seed) * 1e-3
    master = replica.float() + delta
    return master, replica


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_delta_quantize_matches_reference(backend, device, dtype, bits, rounding):
    qmax = R.qmax_for_bits(bits)
    for ci, (gs, n, kind, tile) in enumerate(WD_CASES):
        for mode in ("diff", "direct"):
            master, replica = _master_and_replica(kind, n, gs, qmax, dtype, seed=31 * ci + bits)
            want_rep = replica.clone()
            want_p, want_s = R.weight_delta_quantize(master, want_rep, bits, gs, rounding, KEY, 77 * ci, mode)
            got_rep = replica.to(device)
            with tiles(tile):
                got_p, got_s = backend.weight_delta_quantize(master.to(device), got_rep, bits, gs, rounding, KEY,
                                                             77 * ci, mode)
            what = f"{kind} gs={gs} n={n} mode={mode} tile={tile}"
            assert_same_bytes(got_p, want_p, "payload " + what)
            assert_same_floats(got_s, want_s, "scales " + what)
            assert_same_floats(got_rep, want_rep, "replica " + what)
            # the owner's in-place update equals every receiver's (op 5 on the same payload)
            recv = replica.to(device)
            with tiles(tile):
                backend.dequant_add_(recv, got_p, got_s, bits, gs, mode)
            assert_same_floats(recv, got_rep, "receiver replica " + what)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequant_add_matches_reference(backend, device, dtype, bits):
    for ci, (gs, n, _, tile) in enumerate(WD_CASES):
        ng = R.num_groups(n, gs)
        payloads, scales = random_chunks(1, ng * gs, bits, gs, seed=5 * ci + bits)
        for mode in ("diff", "direct"):
            gen = torch.Generator().manual_seed(ci)
            replica = (torch.randn(n, generator=gen) * 3).to(dtype)
            replica[::17] = 0.0
            want = R.dequant_add_(replica.clone(), payloads[0], scales[0], bits, gs, mode)
            got = replica.to(device)
            with tiles(tile):
                ret = backend.dequant_add_(got, payloads[0].to(device), scales[0].to(device), bits, gs, mode)
            assert ret is got, "dequant_add_ must return the replica it updated"
            assert_same_floats(got, want, f"gs={gs} n={n} mode={mode} tile={tile}")


# op 6: dequant_add_segments_ (layouts from test_segments.segment_layout: odd starts, length-1 pieces, pieces across
# group boundaries, an empty segment, and a long piece whose tiles take the kernel's whole-tile path)
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequant_add_segments_matches_reference(backend, device, dtype, bits, monkeypatch):
    from test_segments import segment_layout
    monkeypatch.setattr(T, "_SEG_INTERP_TILE", 32)  # several tiles per piece under the interpreter too
    gs = 32
    M = gs * 9 + 5
    ng = R.num_groups(M, gs)
    payloads, scales = random_chunks(1, ng * gs, bits, gs, seed=40 + bits)
    so, do, ln, n = segment_layout(M, gs, 64, 160, seed=bits)
    gen = torch.Generator().manual_seed(bits)
    base = (torch.randn(n, generator=gen) * 3).to(dtype)
    base[::7] = float("nan")  # stray writes into the gaps would show
    plan_ref = make_segment_plan(so, do, ln, base)
    for tile in (None, SMALL_TILE):
        for mode in ("diff", "direct"):
            want = R.dequant_add_segments_(base.clone(), payloads[0], scales[0], bits, gs, mode, plan_ref)
            got = base.to(device)
            with tiles(tile):
                plan = make_segment_plan(so, do, ln, got)
                ret = backend.dequant_add_segments_(got, payloads[0].to(device), scales[0].to(device), bits, gs,
                                                    mode, plan)
            assert ret is got, "dequant_add_segments_ must return the dst it updated"
            assert_same_floats(got, want, f"segments gs={gs} mode={mode} tile={tile}")
    # the owner's op 4 and a receiver's op 6 on pieces of the shard placed anywhere: the same bits
    master, replica = _master_and_replica("heavy", M, gs, R.qmax_for_bits(bits), dtype, seed=bits)
    owner = replica.clone()
    p, s = R.weight_delta_quantize(master, owner, bits, gs)
    recv = torch.zeros(n, dtype=dtype)
    for s0, d0, L in zip(so, do, ln):
        recv[d0: d0 + L] = replica[s0: s0 + L]
    recv = recv.to(device)
    plan = make_segment_plan(so, do, ln, recv)
    backend.dequant_add_segments_(recv, p.to(device), s.to(device), bits, gs, "diff", plan)
    for s0, d0, L in zip(so, do, ln):
        assert_same_floats(recv[d0: d0 + L], owner[s0: s0 + L], f"receiver piece {s0}+{L} at {d0}")


# ----------------------------------------------------------------------------------------------------------
# out buffers, dispatch, errors
# ----------------------------------------------------------------------------------------------------------
def test_out_buffers_are_filled_in_place(backend, device):
    x = make_data("normal", 64 * 3, 64, 7, seed=1).to(device)
    p0, s0 = backend.hadamard_quantize(x, 4, 64, 32, "stochastic", KEY, 5)
    out = torch.full((96,), 0xAA, dtype=torch.uint8, device=device)
    out_s = torch.full((3,), -1.0, device=device)
    p1, s1 = backend.hadamard_quantize(x, 4, 64, 32, "stochastic", KEY, 5, out=out, out_scales=out_s)
    assert p1 is out and s1 is out_s
    assert_same_bytes(out, p0, "op1 out")
    assert_same_floats(out_s, s0, "op1 out_scales")

    payloads, scales = quantized_chunks(2, 128, 8, 64, seed=2)
    payloads, scales = payloads.to(device), scales.to(device)
    p0, s0 = backend.dequant_sum_requant(payloads, scales, 8, 4, 64)
    out = torch.zeros(64, dtype=torch.uint8, device=device)
    out_s = torch.zeros(2, device=device)
    p1, s1 = backend.dequant_sum_requant(payloads, scales, 8, 4, 64, out=out, out_scales=out_s)
    assert p1 is out and s1 is out_s
    assert_same_bytes(out, p0, "op2 out")
    assert_same_floats(out_s, s0, "op2 out_scales")

    y0 = backend.dequant_sum_inverse_hadamard(payloads, scales, 8, 64, 32, torch.bfloat16, 0.5)
    big = torch.full((200,), 7.0, dtype=torch.bfloat16, device=device)  # longer than needed, like torch's
    y1 = backend.dequant_sum_inverse_hadamard(payloads, scales, 8, 64, 32, post_scale=0.5, out=big)
    assert y1 is big
    assert_same_floats(big[:128], y0, "op3 out")
    assert torch.all(big[128:] == 7.0), "op3 wrote past the result"

    master = torch.randn(130, device=device)
    rep_a = torch.zeros(130, dtype=torch.bfloat16, device=device)
    rep_b = rep_a.clone()
    p0, s0 = backend.weight_delta_quantize(master, rep_a, 4, 64, "stochastic", KEY, 3)
    out = torch.zeros(96, dtype=torch.uint8, device=device)
    out_s = torch.zeros(3, device=device)
    p1, s1 = backend.weight_delta_quantize(master, rep_b, 4, 64, "stochastic", KEY, 3, out=out, out_scales=out_s)
    assert p1 is out and s1 is out_s
    assert_same_bytes(out, p0, "op4 out")
    assert_same_floats(out_s, s0, "op4 out_scales")
    assert_same_floats(rep_b, rep_a, "op4 replica")


def test_backend_dispatch_and_probe(device):
    b = ops.get_backend("triton", device)
    assert b.name == "triton"
    for name in ops.OP_NAMES:
        assert callable(getattr(b, name))
    ok, why = b.available(torch.device("cpu"))
    assert ok == T.is_interpreted(), why
    ok, why = b.available(torch.device("meta"))
    assert not ok and "meta" in why


def test_bad_inputs_raise(backend, device):
    x = torch.randn(128, device=device)
    payloads, scales = quantized_chunks(2, 128, 8, 64, seed=3)
    payloads, scales = payloads.to(device), scales.to(device)
    rep = torch.zeros(128, device=device)
    seg_plan = make_segment_plan([0, 64], [64, 0], [64, 64], rep)
    cases = [
        (lambda: backend.hadamard_quantize(x.double(), 8, 64, 32), "x must be float32"),
        (lambda: backend.hadamard_quantize(x.to(torch.int32), 8, 64, 32), "x must be float32"),
        (lambda: backend.hadamard_quantize(x[:100], 8, 64, None), "multiple of group_size"),
        (lambda: backend.hadamard_quantize(x, 3, 64, None), "bits must be 4 or 8"),
        (lambda: backend.hadamard_quantize(x, 8, 64, 48), "power of two"),
        (lambda: backend.hadamard_quantize(x, 8, 32, 64), "multiple of hadamard_size"),
        (lambda: backend.hadamard_quantize(x, 4, 63, None), "even size"),
        (lambda: backend.hadamard_quantize(x, 8, 64, None, "up"), "rounding must be one of"),
        (lambda: backend.hadamard_quantize(x, 8, 64, None, "stochastic"), "needs a key"),
        (lambda: backend.hadamard_quantize(x, 8, 64, None, swizzle=(3, 1)), "segments"),
        (lambda: backend.hadamard_quantize(x, 8, 64, None, out=torch.zeros(64, dtype=torch.uint8,
                                                                            device=device)), "out buffer"),
        (lambda: backend.hadamard_quantize(x, 8, 64, None, out_scales=torch.zeros(2, dtype=torch.float16,
                                                                                  device=device)),
         "out_scales buffer"),
        (lambda: backend.dequant_sum_requant(payloads.float(), scales, 8, 4, 64), "payloads must be torch.uint8"),
        (lambda: backend.dequant_sum_requant(payloads, scales.half(), 8, 4, 64), "scales must be torch.float32"),
        (lambda: backend.dequant_sum_requant(payloads, scales[:, :1], 8, 4, 64), "scales must have shape"),
        (lambda: backend.dequant_sum_requant(payloads[0], scales, 8, 4, 64), "2-D"),
        (lambda: backend.dequant_sum_requant(payloads, scales, 8, 4, 64, out_group_size=63), "even size"),
        (lambda: backend.dequant_sum_requant(payloads, scales, 8, 5, 64), "out_bits must be 4 or 8"),
        (lambda: backend.dequant_sum_inverse_hadamard(payloads, scales, 8, 64, 3), "power of two"),
        (lambda: backend.dequant_sum_inverse_hadamard(payloads, scales, 8, 64, 256), "multiple of the hadamard"),
        (lambda: backend.dequant_sum_inverse_hadamard(payloads, scales, 8, 64, 32, torch.int8), "out_dtype"),
        (lambda: backend.dequant_sum_inverse_hadamard(payloads, scales, 8, 64, 32,
                                                      out=torch.zeros(100, device=device)), "needs 128"),
        (lambda: backend.weight_delta_quantize(x, rep[:100], 8, 64), "elements but replica has"),
        (lambda: backend.weight_delta_quantize(x, rep.long(), 8, 64), "replica must be float32"),
        (lambda: backend.weight_delta_quantize(x, rep, 8, 64, mode="sum"), "mode must be"),
        (lambda: backend.weight_delta_quantize(x, rep.view(2, 64).t(), 8, 64), "contiguous"),
        (lambda: backend.dequant_add_(rep, payloads[0, :32], scales[0, :1], 8, 64), "payload holds 32 codes"),
        (lambda: backend.dequant_add_(rep, payloads[0], scales[0, :1], 8, 64), "scales"),
        (lambda: backend.dequant_add_(rep, payloads[0].to(torch.int8), scales[0], 8, 64),
         "payload must be torch.uint8"),
        (lambda: backend.dequant_add_(rep, payloads[0], scales[0], 8, 64, mode="x"), "mode must be"),
        (lambda: backend.dequant_add_segments_(rep, payloads[0], scales[0], 8, 64, "diff", [(0, 0, 4)]),
         "SegmentPlan"),
        (lambda: backend.dequant_add_segments_(rep[:100], payloads[0], scales[0], 8, 64, "diff", seg_plan),
         "write up to 128"),
        (lambda: backend.dequant_add_segments_(rep, payloads[0, :32], scales[0, :1], 8, 64, "diff", seg_plan),
         "read up to 128"),
        (lambda: backend.dequant_add_segments_(rep, payloads[0], scales[0, :1], 8, 64, "diff", seg_plan), "scales"),
        (lambda: backend.dequant_add_segments_(rep, payloads[0], scales[0], 8, 64, "x", seg_plan), "mode must be"),
    ]
    for fn, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            fn()
