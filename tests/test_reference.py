"""Properties of the reference math (reference.py): the definitions every kernel is checked against."""

import math
from fractions import Fraction

import pytest
import torch

from deepspeed_sdp4bit import reference as R

ODD_SIZES = [1, 7, 127, 1285, 4099]


def _heavy(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # StudentT samples from the global generator
    x = torch.distributions.StudentT(2.0).sample((n,)) if n else torch.empty(0)
    # a few huge outliers on top of a Student-t body
    idx = torch.randint(0, max(n, 1), (max(n // 200, 1),), generator=g)
    if n:
        x[idx] *= 100
    return x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_bound_nearest(bits, n, dtype):
    group = 128
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    codes, scales = R.quantize_groups(x, bits, group)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.numel() == R.padded_numel(n, group) and scales.numel() == R.num_groups(n, group)
    qmax = R.qmax_for_bits(bits)
    assert int(codes.abs().max()) <= qmax
    y = R.dequantize_groups(codes, scales, group, n)
    assert y.numel() == n
    # nearest rounding: |err| <= scale / 2 per element (plus fp32 rounding of the division)
    per_elem_scale = scales.repeat_interleave(group)[:n]
    err = (y - x.float()).abs()
    assert bool((err <= per_elem_scale * (0.5 + 1e-5)).all())
    # the group's absmax element is represented exactly up to rounding: the top code is used
    assert int(codes.abs().max()) == qmax


def test_padding_never_leaks():
    x = torch.randn(130)
    codes, scales = R.quantize_groups(x, 4, 128)
    assert codes.numel() == 256
    assert bool((codes[130:] == 0).all())
    # the padded tail does not change the scale of the last group (abs-max of real elements only)
    assert torch.equal(scales[1], x[128:].abs().max() / 7)


@pytest.mark.parametrize("bits", [4, 8])
def test_all_zero_group_gives_zero_scale_no_nan(bits):
    x = torch.zeros(300)
    x[200:] = torch.randn(100)
    codes, scales = R.quantize_groups(x, bits, 128)
    assert scales[0] == 0 and bool(torch.isfinite(scales).all())
    y = R.dequantize_groups(codes, scales, 128, 300)
    assert bool(torch.isfinite(y).all()) and bool((y[:128] == 0).all())


def test_subnormal_absmax_does_not_blow_up():
    x = torch.full((128,), 1e-42)
    codes, scales = R.quantize_groups(x, 4, 128)
    y = R.dequantize_groups(codes, scales, 128)
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("bits", [4, 8])
def test_non_finite_propagates_to_its_group_only(bad, bits):
    x = torch.randn(384)
    x[130] = bad
    codes, scales = R.quantize_groups(x, bits, 128)
    y = R.dequantize_groups(codes, scales, 128)
    assert not bool(torch.isfinite(y[128:256]).any())       # the whole group is poisoned
    assert bool(torch.isfinite(y[:128]).all()) and bool(torch.isfinite(y[256:]).all())
    assert not math.isfinite(float(scales[1]))


def test_int4_packing_identity_and_layout():
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(5)
    packed = R.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() // 2
    assert torch.equal(R.unpack_int4(packed), codes)
    # element 2i in the low nibble, 2i+1 in the high nibble
    p = R.pack_int4(torch.tensor([1, -2], dtype=torch.int8))
    assert int(p[0]) == (1 | (0xE << 4))
    with pytest.raises(ValueError, match="even"):
        R.pack_int4(torch.zeros(3, dtype=torch.int8))


def test_pack_codes_8bit_is_a_view_of_the_codes():
    codes = torch.randint(-127, 128, (64,), dtype=torch.int8)
    assert torch.equal(R.unpack_codes(R.pack_codes(codes, 8), 8), codes)


@pytest.mark.parametrize("h", [2, 32, 64, 128, 256])
def test_hadamard_matrix_orthogonality_and_butterfly(h):
    H = R.hadamard_matrix(h)
    assert torch.equal(H @ H.T, h * torch.eye(h))
    x = torch.randn(3 * h, dtype=torch.float64).float()
    want = (H.double() @ x.double().view(3, h).T).T.reshape(-1)
    got = R.hadamard_transform(x, h)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-4)
    back = R.inverse_hadamard_transform(got, h)
    assert torch.allclose(back, x, rtol=0, atol=1e-5)


def test_hadamard_rejects_bad_sizes():
    with pytest.raises(ValueError, match="power of two"):
        R.hadamard_transform(torch.zeros(48), 48)
    with pytest.raises(ValueError, match="multiple"):
        R.hadamard_transform(torch.zeros(40), 32)


def test_hadamard_makes_outliers_cheaper_to_quantize():
    x = _heavy(128 * 64, seed=3)
    plain = R.dequantize_groups(*R.quantize_groups(x, 4, 128), 128)
    p, s = R.hadamard_quantize(x, 4, 128, 32)
    rot = R.inverse_hadamard_transform(R.dequantize_groups(R.unpack_codes(p, 4), s, 128), 32)
    assert (rot - x).norm() < 0.8 * (plain - x).norm()


def _py_mix32(x):
    """lowbias32 in plain Python integers (the reference's definition, written independently)."""
    m = 0xFFFFFFFF
    x &= m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return x


def test_counter_rng_is_reproducible_and_uniform():
    k = R.make_key(7, 3, 1)
    offs = torch.arange(200_000)
    u1 = R.stochastic_uniforms(k, offs)
    assert torch.equal(u1, R.stochastic_uniforms(k, offs))
    u = u1 - 1.0  # exact: u1 is in (1, 2)
    assert float(u.min()) >= 2.0 ** -17 and float(u.max()) <= 1.0 - 2.0 ** -17
    assert abs(float(u.double().mean()) - 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1) / offs.numel()
    assert float((hist - 0.1).abs().max()) < 0.005
    # the 2**16 centred points: (u - 2**-17) * 2**16 is an integer
    k16 = (u.double() - 2.0 ** -17) * 2.0 ** 16
    assert torch.equal(k16, k16.round())
    # two neighbours share one hash but use its two halves: not equal, and not correlated
    even, odd = u[0::2].double(), u[1::2].double()
    assert float((even == odd).double().mean()) < 0.001
    assert abs(float(torch.corrcoef(torch.stack([even, odd]))[0, 1])) < 0.01
    # other keys give other streams; pair indices beyond 2**32 and negative counters are handled
    assert not torch.equal(u1, R.stochastic_uniforms(R.make_key(7, 3, 2), offs))
    assert not torch.equal(R.stochastic_uniforms(k, offs + (1 << 33)), u1)
    neg = R.stochastic_uniforms(k, torch.arange(-4, 0))
    assert bool(((neg > 1.0) & (neg < 2.0)).all())


def test_counter_rng_matches_pure_python():
    key = 0x9E3779B9
    offs = [0, 1, 2, 3, 12345, 2 ** 33 + 5, -1, -2, -3]
    got = R.stochastic_uniforms(key, torch.tensor(offs, dtype=torch.int64)).tolist()
    for c, g in zip(offs, got):
        p = c >> 1
        h = _py_mix32((p & 0xFFFFFFFF) ^ key)
        if p >> 32:
            h = _py_mix32(h ^ ((p >> 32) & 0xFFFFFFFF))
        if c & 1:  # the odd counter of a pair takes the bits the even one leaves: h rotated by 16
            h = ((h << 16) | (h >> 16)) & 0xFFFFFFFF
        k = (h >> 7) & 0xFFFF
        assert g == 1.0 + k * 2.0 ** -16 + 2.0 ** -17, c


def test_mix32_matches_pure_python():
    vals = [0, 1, 2, 0xFFFFFFFF, 0x12345678, 0x80000000, 99991]
    got = R.mix32(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [_py_mix32(v) for v in vals]


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased_over_seeds(bits):
    torch.manual_seed(0)
    x = torch.randn(256)
    acc = torch.zeros(256, dtype=torch.float64)
    trials = 400
    for seed in range(trials):
        c, s = R.quantize_groups(x, bits, 128, "stochastic", key=R.make_key(seed, 0))
        acc += R.dequantize_groups(c, s, 128).double()
    mean = acc / trials
    scale = float(x.abs().max()) / R.qmax_for_bits(bits)
    # the std of one SR sample is <= scale/2, so the mean of `trials` is within 5 sigma of x
    assert float((mean - x.double()).abs().max()) < 5 * 0.5 * scale / math.sqrt(trials)
    # while nearest rounding has a systematic error of up to scale/2 on some elements
    cn, sn = R.quantize_groups(x, bits, 128)
    assert float((R.dequantize_groups(cn, sn, 128) - x).abs().max()) > 0.2 * scale


def test_stochastic_rounding_depends_on_offset_and_key_only():
    x = torch.randn(512)
    k = R.make_key(1, 2)
    a = R.quantize_groups(x, 4, 128, "stochastic", key=k, offset=0)[0]
    b = R.quantize_groups(x, 4, 128, "stochastic", key=k, offset=0)[0]
    c = R.quantize_groups(x, 4, 128, "stochastic", key=k, offset=512)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="key"):
        R.quantize_groups(x, 4, 128, "stochastic")


def test_swizzle_is_segment_transpose():
    x = torch.arange(2 * 3 * 4, dtype=torch.float32)
    y = R.swizzle_segments(x, 2, 3).view(3, 2, 4)
    assert torch.equal(y[1, 0], x[4:8]) and torch.equal(y[0, 1], x[12:16])


def _py_rn32(v):
    """Round-to-nearest-even of an exact Fraction to fp32, as a Python float (inf past the largest finite)."""
    if v == 0:
        return 0.0
    mag = abs(v)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if Fraction(2) ** e > mag:
        e -= 1  # now 2**e <= mag < 2**(e + 1)
    ulp = Fraction(2) ** (max(e, -126) - 23)  # subnormals share the ulp of the smallest normal binade
    n = round(mag / ulp)  # Fraction rounds ties to even
    out = float(n * ulp) if n * ulp < Fraction(2) ** 128 else math.inf
    return out if v > 0 else -out


def test_fma_f32_rounds_once():
    g = torch.Generator().manual_seed(7)

    def sample(n):
        mant = torch.rand(n, generator=g) * 2 - 1
        exps = torch.randint(-140, 60, (n,), generator=g).float()
        return (mant * torch.pow(2.0, exps)).float()  # wide exponent range, subnormals included

    a, b, c = sample(3000), sample(3000), sample(3000)
    a[:300] = torch.randint(-127, 128, (300,), generator=g).float()  # codes, as in a chunk sum
    # the double-rounding trap: 2**30 + 192 - 2**-40 is a hair below a midpoint, but its nearest fp64 is the
    # midpoint itself, whose round-to-even goes the wrong way (naive fp64 gives 2**30 + 256)
    a[0], b[0], c[0] = 8 + 2 ** -20, 8 - 2 ** -20, 2 ** 30 + 128
    got = R.fma_f32(a, b, c)
    assert float(got[0]) == 2 ** 30 + 128
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        want = _py_rn32(Fraction(x) * Fraction(y) + Fraction(z))
        assert r == want and math.copysign(1, r) == math.copysign(1, want) or r == want == 0, (x, y, z, r, want)
    specials = R.fma_f32(torch.tensor([0.0, math.inf, 3e38, 1.0]), torch.tensor([math.inf, 1.0, 10.0, math.nan]),
                         torch.tensor([1.0, -math.inf, 0.0, 0.0]))
    assert math.isnan(specials[0]) and math.isnan(specials[1]) and specials[2] == math.inf
    assert math.isnan(specials[3])


def test_dequant_sum_fuses_later_chunks():
    """acc = RN(c_0 s_0), then acc = RN(c_j s_j + acc) for each later chunk, checked in exact arithmetic."""
    torch.manual_seed(3)
    k, m, g = 3, 256, 128
    codes = torch.randint(-127, 128, (k, m), dtype=torch.int8)
    scales = torch.rand(k, m // g) * 1e-2 + 1e-3
    got = R.dequant_sum(codes.view(torch.uint8), scales, 8, g).tolist()
    unfused = 0
    for i in range(m):
        terms = [(Fraction(int(codes[j, i])), Fraction(float(scales[j, i // g]))) for j in range(k)]
        acc = _py_rn32(terms[0][0] * terms[0][1])
        plain = acc
        for cj, sj in terms[1:]:
            acc = _py_rn32(cj * sj + Fraction(acc))
            plain = _py_rn32(Fraction(plain) + Fraction(_py_rn32(cj * sj)))
        assert got[i] == acc, i
        unfused += plain != acc
    assert unfused > 0  # the data tells fused from unfused sums apart


def test_fused_ops_agree_with_their_pieces():
    torch.manual_seed(1)
    k, m, g, h = 3, 512, 128, 32
    chunks = [torch.randn(m) for _ in range(k)]
    qs = [R.hadamard_quantize(c, 8, g, h) for c in chunks]
    payloads = torch.stack([p for p, _ in qs])
    scales = torch.stack([s for _, s in qs])
    total = R.dequant_sum(payloads, scales, 8, g)
    p4, s4 = R.dequant_sum_requant(payloads, scales, 8, 4, g)
    assert torch.equal(R.unpack_codes(p4, 4), R.quantize_groups(total, 4, g)[0])
    out = R.dequant_sum_inverse_hadamard(p4.unsqueeze(0), s4.unsqueeze(0), 4, g, h, torch.float32, 1 / k)
    exact = sum(chunks) / k
    assert float((out - exact).abs().max()) < 0.25 * float(exact.abs().max())
    assert R.dequant_sum_inverse_hadamard(p4.unsqueeze(0), s4.unsqueeze(0), 4, g, h, torch.bfloat16).dtype \
        == torch.bfloat16


def test_weight_delta_owner_and_receiver_agree_bitwise():
    torch.manual_seed(2)
    master = torch.randn(5000)
    owner = master.to(torch.bfloat16)
    receiver = owner.clone()
    for step in range(50):
        master += 1e-3 * torch.randn(5000)
        p, s = R.weight_delta_quantize(master, owner, 4, 2048)
        R.dequant_add_(receiver, p, s, 4, 2048)
        assert torch.equal(owner, receiver)
    # error feedback: the replica stays within about one step's quantization error of the master
    assert float((owner.float() - master).abs().max()) < 2e-2


def test_weight_direct_mode_quantizes_the_weights():
    master = torch.randn(4096)
    rep = torch.zeros(4096, dtype=torch.bfloat16)
    p, s = R.weight_delta_quantize(master, rep, 4, 2048, mode="direct")
    assert torch.equal(rep, R.dequantize_groups(R.unpack_codes(p, 4), s, 2048).to(torch.bfloat16))
    with pytest.raises(ValueError, match="mode"):
        R.weight_delta_quantize(master, rep, 4, 2048, mode="delta")
    with pytest.raises(ValueError, match="elements"):
        R.weight_delta_quantize(master, rep[:10], 4, 2048)


def test_wire_bits():
    assert R.wire_bits_per_value(4, 2048) == pytest.approx(4.015625)
    assert R.wire_bits_per_value(8, 128) == 8.25
    assert R.wire_bits_per_value(4, 128) == 4.25


def test_reciprocal_is_fitted_so_codes_need_no_clamp():
    """|x * inv| <= qmax for every group (the kernels round without clamping), over many random groups with
    absmax on all sorts of mantissas, and inv stays within 2 ulps of 1 / scale."""
    torch.manual_seed(3)
    for bits in (4, 8):
        qmax = R.qmax_for_bits(bits)
        x = torch.randn(4096, 64) * torch.exp(torch.randn(4096, 1) * 20).clamp(1e-30, 1e30)
        absmax = R.group_absmax(x.view(-1), 64)
        scale = absmax / float(qmax)
        raw = 1.0 / scale
        inv = R.fit_reciprocal(absmax.view(-1, 1), raw.view(-1, 1), bits).view(-1)
        assert bool((absmax * inv <= qmax).all())
        ulps = raw.view(torch.int32) - inv.view(torch.int32)
        assert int(ulps.min()) >= 0 and int(ulps.max()) <= 2
        assert int(ulps.max()) >= 1  # the adjustment does happen
        codes, _ = R.quantize_groups(x.view(-1), bits, 64)
        assert int(codes.abs().max()) == qmax  # the largest element still reaches qmax
