"""Reference math for SDP4Bit in pure torch.

Every function here is the *definition* of an op: the CUDA and Triton kernels must reproduce its codes and
scales bit for bit (nearest and seeded stochastic rounding alike) and its float outputs within rounding.
All arithmetic is fp32 whatever the input dtype, and the order of every floating-point operation is fixed
by the docstrings, so that a kernel that follows the same order gets the same bits.

Conventions shared by all ops
-----------------------------
* Tensors are flat (1-D).  A "group" is ``group_size`` contiguous elements with one fp32 scale.
* Symmetric abs-max quantization to ``bits`` in {4, 8}: ``qmax = 2**(bits-1) - 1`` (7 or 127), levels
  ``-qmax..qmax``.  Per group: ``absmax = max|x|`` (NaN if any element is NaN, inf if any is inf),
  ``scale = absmax / qmax`` (fp32, IEEE division), ``inv = 1 / scale`` (fp32, IEEE division, once per
  group), lowered one ulp at a time (at most twice in practice) while ``absmax * inv > qmax`` (fp32
  product), and ``y = x * inv`` (one rounded fp32 multiply per element).  A multiply by the group's
  reciprocal instead of a division per element keeps the kernels' per-element work small, and the
  adjustment guarantees ``|y| <= qmax`` so that rounding needs no clamp; every backend rounds these steps
  the same way, so the codes stay bit-identical.
* Rounding of ``y`` to a code:
    - ``nearest``: half away from zero, ``sign(y) * floor(|y| + 0.5)`` (the ``+ 0.5`` is exact for |y| < 2**22);
    - ``stochastic``: ``floor(y + u1) - 1``, where ``y + u1`` is one rounded fp32 add and ``u1`` in (1, 2)
      comes from :func:`stochastic_uniforms` of ``(key, offset + i)``: ``u1 = 1 + (k + 1/2) * 2**-16`` with
      ``k`` a 16-bit random integer, so ``u1 - 1`` is uniform on 2**16 points centred in [0, 1) and
      E[code] = y up to the 2**-17 resolution of ``u1``.  (Written as ``u1 - 1`` rather than ``u`` because a
      kernel then gets ``u1`` from the hash with one bitwise OR, no int-to-float conversion.)
  which lands in ``[-qmax, qmax]`` because ``|y| <= qmax`` and ``1 < u1 < 2``. Where ``scale`` is 0 (all-zero
  group, or absmax so small that absmax/qmax underflows), not finite, or so small that ``1 / scale`` overflows
  (scale < 2**-127), or where ``y`` is not finite, the code is 0.
* Dequantization is ``float(code) * scale`` (one rounded fp32 multiply) where the value stands alone (the
  first chunk of a sum, the weight delta added to a replica).  A non-finite scale therefore gives a
  non-finite value for every element of its group (0 * inf = NaN), so an inf/NaN gradient on any rank still
  shows up as non-finite after the collective (fp16 overflow check).
* Sizes that are not a multiple of ``group_size`` are zero-padded at the end; codes of the padding are
  0 and callers trim outputs to the true size, so padding never reaches a result.
* Wire format ("payload"): bits=8 codes are int8 stored as uint8 bytes; bits=4 codes are packed two per byte,
  element ``2i`` in the low nibble and ``2i+1`` in the high nibble, each a 4-bit two's complement number.
* Sums over received chunks are sequential in chunk order, fp32, each later chunk fused into the sum:
  ``acc = RN(c_0 * s_0); acc = fma(c_1, s_1, acc); ...`` (:func:`fma_f32`, one rounding per chunk).  The
  fused form is one instruction per element and chunk where a multiply and an add are two, and ops 2 and 3
  are bound by instruction issue on GPUs (with 4 chunks this saves 3 of about 38 instructions per element).
* Block Hadamard transform of size ``h`` (power of two): the unnormalized Sylvester matrix ``H_h`` applied to
  each contiguous block of ``h`` elements, computed by the butterfly below with stages of stride
  1, 2, 4, ..., h/2; at a stage of stride ``s`` the pair ``(a, b) = (x[i], x[i+s])`` with ``i mod 2s < s``
  becomes ``(a + b, a - b)``.  ``H_h @ H_h = h * I`` so the inverse is the same butterfly followed by a
  multiply by ``1/h`` (exact: a power of two).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

ROUNDING_MODES = ("nearest", "stochastic")
_MASK32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------------
def qmax_for_bits(bits: int) -> int:
    """Largest code magnitude for ``bits`` (4 -> 7, 8 -> 127)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return (1 << (bits - 1)) - 1


def num_groups(numel: int, group_size: int) -> int:
    """Number of groups covering ``numel`` elements (the last one zero-padded)."""
    return -(-numel // group_size)


def padded_numel(numel: int, multiple: int) -> int:
    return num_groups(numel, multiple) * multiple


def pad_flat(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` flattened and zero-padded at the end to a multiple of ``multiple`` (no copy if already)."""
    x = x.reshape(-1)
    n = padded_numel(x.numel(), multiple)
    if n == x.numel():
        return x
    out = x.new_zeros(n)
    out[: x.numel()] = x
    return out


def payload_bytes(numel: int, bits: int) -> int:
    """Bytes of codes for ``numel`` elements (numel even for bits=4)."""
    if bits == 4:
        if numel % 2:
            raise ValueError(f"4-bit payload needs an even number of elements, got {numel}")
        return numel // 2
    if bits == 8:
        return numel
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``RN(a * b + c)`` with one rounding (IEEE fusedMultiplyAdd, CUDA's ``fmaf``, Triton's ``tl.fma``).

    ``a``, ``b``, ``c``: fp32, broadcastable.  torch has no fused fp32 multiply-add that is guaranteed on every
    device, so it is built from fp64: ``p = a * b`` is exact (24 + 24 bits), ``s = p + c`` rounds, and TwoSum's
    exact error ``e`` tells whether and which way it did.  An inexact ``s`` with an even significand is moved
    one ulp towards ``p + c`` (round to odd), so converting to fp32 rounds once, correctly: odd rounding to 53
    bits followed by round-to-nearest to 24 bits equals round-to-nearest (53 >= 24 + 2, Boldo & Melquiond
    2008), subnormal and overflowing results included.  Non-finite values propagate as in IEEE arithmetic.
    """
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - p  # TwoSum (Knuth): s + e == p + c exactly, for finite s
    e = (p - (s - bb)) + (c64 - bb)
    bits = s.contiguous().view(torch.int64)
    fix = torch.isfinite(s) & (e != 0) & ((bits & 1) == 0)
    # the bit pattern + 1 is the next value away from zero (either sign), - 1 the next towards it
    away = (e > 0) == (s > 0)
    bits = torch.where(fix, bits + torch.where(away, 1, -1), bits)
    return bits.view(torch.float64).float()


# ----------------------------------------------------------------------------------------------------------
# counter-based random numbers (identical in torch, CUDA and Triton: 32-bit integer arithmetic only)
# ----------------------------------------------------------------------------------------------------------
def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2**32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo, hi = b & 0xFFFF, b >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 'lowbias32' integer hash on uint32 values held in an int64 tensor.

    x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16   (all mod 2**32)
    """
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def mix32_int(x: int) -> int:
    """:func:`mix32` on one Python int."""
    return int(mix32(torch.tensor([x & _MASK32], dtype=torch.int64))[0])


def make_key(seed: int, *words: int) -> int:
    """A uint32 stream key from a seed and any number of integers (step, rank, bucket, level, ...).

    ``k = mix32(seed); for w in words: k = mix32(k ^ (w mod 2**32))``.  Different tuples give independent
    streams, the same tuple the same stream on every rank and every backend: stochastic rounding is
    reproducible from (seed, step, tensor offset) and never from a clock.
    """
    k = mix32_int(seed)
    for w in words:
        k = mix32_int(k ^ (int(w) & _MASK32))
    return k


def stochastic_uniforms(key: int, offsets: torch.Tensor) -> torch.Tensor:
    """fp32 ``u1`` in (1, 2) for element counters ``offsets`` (int64) of stream ``key``.

    One 32-bit hash serves two neighbouring counters (16 random bits each), which halves the kernels' hashing
    work: the pair index ``p = offset >> 1`` (arithmetic shift) gives ``h = mix32((p mod 2**32) ^ key)``,
    and for ``p >= 2**32`` or ``p < 0`` additionally ``h = mix32(h ^ ((p >> 32) mod 2**32))``.  An even
    counter takes the 16 bits ``k = (h >> 7) & 0xFFFF``, an odd one the other 16, ``k = (rotl16(h) >> 7) &
    0xFFFF`` with ``rotl16(h) = (h << 16 | h >> 16) mod 2**32``; then ``u1`` is the float with bits
    ``0x3F800040 | (k << 7)``, i.e. ``1 + k * 2**-16 + 2**-17`` (exact).  Taking bits 7..22 (of ``h`` or of its
    16-bit rotation) puts them straight under the exponent of 1.0: a kernel builds an even ``u1`` with one
    bitwise AND-OR and an odd one with a byte permute more.
    """
    offsets = offsets.to(torch.int64)
    p = offsets >> 1
    h = mix32((p & _MASK32) ^ (key & _MASK32))
    hi = p >> 32
    if bool((hi != 0).any()):
        h = torch.where(hi != 0, mix32(h ^ (hi & _MASK32)), h)
    rot = ((h << 16) | (h >> 16)) & _MASK32
    k7 = torch.where((offsets & 1) == 1, rot, h) & 0x7FFF80  # k << 7
    return (k7 | 0x3F800040).to(torch.int32).view(torch.float32)


# ----------------------------------------------------------------------------------------------------------
# group quantization
# ----------------------------------------------------------------------------------------------------------
def group_absmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 ``max |x|`` [num_groups] of flat ``x`` (zero-padded), NaN if the group has a NaN."""
    xg = pad_flat(x.float(), group_size).view(-1, group_size)
    absmax = xg.abs().amax(dim=1)
    nan = torch.isnan(xg).any(dim=1)  # amax's NaN propagation is not guaranteed on every device
    return torch.where(nan, torch.full_like(absmax, float("nan")), absmax)


def scales_from_absmax(absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 group scales ``absmax / qmax`` (one IEEE fp32 division each), NaN/inf propagated.

    The divisor is a tensor of absmax's shape and device: torch on CUDA divides by a scalar (a Python number or a
    0-dim CPU tensor) as a multiply by its reciprocal, an ulp off the division in some scales (emulated on the
    CPU over 10^7 values: 4.5% of them for qmax 127, 54% for qmax 7)."""
    return absmax / torch.full_like(absmax, float(qmax_for_bits(bits)), dtype=torch.float32)


def group_scales(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """fp32 scales [num_groups] of flat ``x`` (zero-padded): ``absmax / qmax``, NaN/inf propagated."""
    return scales_from_absmax(group_absmax(x, group_size), bits)


def round_codes(y: torch.Tensor, bits: int, rounding: str, key: Optional[int], offset: int,
                valid: torch.Tensor) -> torch.Tensor:
    """Codes (int8) from fp32 ``y = x * (1 / scale)`` by the rounding rule in the module docstring.

    ``valid`` marks elements whose scale is positive and finite; other codes are 0.
    """
    qmax = qmax_for_bits(bits)
    if rounding == "nearest":
        r = torch.sign(y) * torch.floor(y.abs() + 0.5)
    elif rounding == "stochastic":
        if key is None:
            raise ValueError("stochastic rounding needs a key (see make_key)")
        offs = torch.arange(y.numel(), dtype=torch.int64, device=y.device) + int(offset)
        u1 = stochastic_uniforms(key, offs).view_as(y)
        r = torch.floor(y + u1) - 1.0
    else:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    ok = valid & torch.isfinite(r)
    r = torch.where(ok, r.clamp(-qmax, qmax), torch.zeros_like(r))
    return r.to(torch.int8)


def fit_reciprocal(absmax: torch.Tensor, inv: torch.Tensor, bits: int) -> torch.Tensor:
    """``inv`` lowered one ulp at a time while ``absmax * inv > qmax`` (fp32): then ``|x * inv| <= qmax`` for
    every ``|x| <= absmax`` (rounding is monotonic).  ``inv`` = RN(1 / RN(absmax / qmax)) is within about an
    ulp of qmax / absmax, so two steps always suffice (checked)."""
    qmax = float(qmax_for_bits(bits))
    for _ in range(2):
        over = absmax * inv > qmax
        inv = torch.where(over, torch.nextafter(inv, torch.zeros_like(inv)), inv)
    if bool((absmax * inv > qmax).any()):
        raise AssertionError("fit_reciprocal: two steps did not suffice")
    return inv


def quantize_groups(x: torch.Tensor, bits: int, group_size: int, rounding: str = "nearest",
                    key: Optional[int] = None, offset: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group-wise symmetric abs-max quantization.

    Args:
        x: any shape, any float dtype; read flat.  Zero-padded to a multiple of ``group_size``.
        bits: 4 or 8.
        group_size: elements per scale (even when bits=4).
        rounding: ``nearest`` or ``stochastic`` (needs ``key``); ``offset`` is the counter of element 0.
    Returns:
        codes: int8 [padded_numel], values in [-qmax, qmax] (unpacked; see :func:`pack_codes`);
        scales: fp32 [num_groups].
    """
    if bits == 4 and group_size % 2:
        raise ValueError(f"4-bit groups must have an even size, got {group_size}")
    absmax = group_absmax(x, group_size)
    scales = scales_from_absmax(absmax, bits)
    xg = pad_flat(x.float(), group_size).view(-1, group_size)
    s = scales.view(-1, 1)
    inv = torch.ones_like(s) / s  # IEEE fp32 division, inf for s == 0 or s < 2**-127
    valid = (s > 0) & torch.isfinite(s) & torch.isfinite(inv)
    inv = torch.where(valid, inv, torch.ones_like(inv))
    inv = fit_reciprocal(torch.where(valid, absmax.view(-1, 1), torch.zeros_like(s)), inv, bits)
    y = xg * inv
    codes = round_codes(y, bits, rounding, key, offset, valid.expand_as(y))
    return codes.view(-1), scales


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                      numel: Optional[int] = None) -> torch.Tensor:
    """fp32 values ``float(code) * scale`` [numel] (default: all codes) from int8 codes and fp32 scales."""
    v = (codes.view(-1, group_size).float() * scales.view(-1, 1).float()).view(-1)
    return v if numel is None else v[:numel]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] (even count) -> uint8 bytes, element 2i low nibble, 2i+1 high nibble."""
    c = codes.reshape(-1)
    if c.numel() % 2:
        raise ValueError(f"pack_int4 needs an even number of codes, got {c.numel()}")
    u = c.to(torch.int16) & 0xF
    return (u[0::2] | (u[1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 bytes [n] -> int8 codes [2n] (sign-extended nibbles)."""
    p = packed.reshape(-1).to(torch.int16)
    lo = p & 0xF
    hi = (p >> 4) & 0xF
    out = torch.stack([lo, hi], dim=1).view(-1)
    return torch.where(out >= 8, out - 16, out).to(torch.int8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes -> payload bytes (uint8): packed for 4 bits, reinterpreted for 8 bits."""
    if bits == 4:
        return pack_int4(codes)
    if bits == 8:
        return codes.reshape(-1).view(torch.uint8)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def unpack_codes(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """payload bytes (uint8) -> int8 codes."""
    if bits == 4:
        return unpack_int4(payload)
    if bits == 8:
        return payload.reshape(-1).view(torch.int8)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


# ----------------------------------------------------------------------------------------------------------
# Hadamard
# ----------------------------------------------------------------------------------------------------------
def _check_hadamard_size(h: int) -> None:
    if h < 2 or h & (h - 1):
        raise ValueError(f"hadamard size must be a power of two >= 2, got {h}")


def hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Unnormalized block Hadamard transform (butterfly order of the module docstring).

    Args: x flat, numel a multiple of ``block``.  Returns fp32 of the same numel.
    """
    _check_hadamard_size(block)
    x = x.reshape(-1).float()
    if x.numel() % block:
        raise ValueError(f"numel {x.numel()} is not a multiple of the hadamard size {block}")
    y = x.view(-1, block)
    s = 1
    while s < block:
        v = y.view(-1, block // (2 * s), 2, s)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        y = torch.stack([a + b, a - b], dim=2).view(-1, block)
        s *= 2
    return y.reshape(-1)


def inverse_hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of :func:`hadamard_transform`: the same butterfly, then ``* (1/block)`` (exact)."""
    return hadamard_transform(x, block) * (1.0 / block)


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester ±1 matrix H_n (fp32), ``H_n @ x`` equals :func:`hadamard_transform` of ``x``."""
    _check_hadamard_size(n)
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


# ----------------------------------------------------------------------------------------------------------
# the fused ops the kernels implement (references)
# ----------------------------------------------------------------------------------------------------------
def swizzle_segments(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """View flat ``x`` as [rows, cols, seg] segments and return them in [cols, rows, seg] order (a copy)."""
    seg = x.numel() // (rows * cols)
    if seg * rows * cols != x.numel():
        raise ValueError(f"numel {x.numel()} is not divisible into {rows}x{cols} segments")
    return x.reshape(rows, cols, seg).transpose(0, 1).reshape(-1)


def hadamard_quantize(x: torch.Tensor, bits: int, group_size: int, hadamard_size: Optional[int],
                      rounding: str = "nearest", key: Optional[int] = None, offset: int = 0,
                      swizzle: Optional[Tuple[int, int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 1: (optional) block Hadamard, group quantize, payload, in all-to-all order.

    Args:
        x: flat [n], bf16/fp16/fp32, ``n`` a multiple of ``group_size`` (and of rows*cols*group_size when
           swizzled); ``group_size`` a multiple of ``hadamard_size``.
        swizzle: ``(rows, cols)``: x is [rows, cols, seg] segments, output is in [cols, rows, seg] order.
           The swizzle happens before quantization, so groups and stochastic-rounding offsets are those of
           the *output* order (element i of the output uses counter ``offset + i``).
    Returns:
        payload uint8 [n * bits / 8], scales fp32 [n / group_size].
    """
    x = x.reshape(-1)
    if x.numel() % group_size:
        raise ValueError(f"numel {x.numel()} must be a multiple of group_size {group_size}")
    if swizzle is not None:
        x = swizzle_segments(x, *swizzle)
    xf = x.float()
    if hadamard_size:
        if group_size % hadamard_size:
            raise ValueError(f"group_size {group_size} must be a multiple of hadamard_size {hadamard_size}")
        xf = hadamard_transform(xf, hadamard_size)
    codes, scales = quantize_groups(xf, bits, group_size, rounding, key, offset)
    return pack_codes(codes, bits), scales


def dequant_sum(payloads: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """fp32 sum over k chunks: payloads [k, m*bits/8] uint8, scales [k, m/group_size] -> [m].

    Sequential in chunk order, later chunks fused: ``acc = c_0 * s_0; acc = fma(c_1, s_1, acc); ...`` with
    ``c_j`` the codes as fp32 and ``s_j`` their group's scale (see the module docstring).
    """
    acc = dequantize_groups(unpack_codes(payloads[0], bits), scales[0], group_size)
    for j in range(1, payloads.shape[0]):
        codes = unpack_codes(payloads[j], bits).float().view(-1, group_size)
        acc = fma_f32(codes, scales[j].float().view(-1, 1), acc.view(-1, group_size)).view(-1)
    return acc


def dequant_sum_requant(payloads: torch.Tensor, scales: torch.Tensor, in_bits: int, out_bits: int,
                        group_size: int, rounding: str = "nearest", key: Optional[int] = None,
                        offset: int = 0, out_group_size: Optional[int] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 2: dequantize k chunks, fp32 sum, requantize to ``out_bits``.

    Args:
        payloads: uint8 [k, m*in_bits/8]; scales: fp32 [k, m/group_size].
        out_group_size: group size of the output (default ``group_size``).
    Returns: payload uint8 [m*out_bits/8], scales fp32 [m/out_group_size].
    """
    acc = dequant_sum(payloads, scales, in_bits, group_size)
    codes, s = quantize_groups(acc, out_bits, out_group_size or group_size, rounding, key, offset)
    return pack_codes(codes, out_bits), s


def dequant_sum_inverse_hadamard(payloads: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                                 hadamard_size: Optional[int], out_dtype: torch.dtype = torch.float32,
                                 post_scale: float = 1.0) -> torch.Tensor:
    """Op 3: dequantize k chunks, fp32 sum, inverse Hadamard, scale, cast.

    ``out = cast(butterfly(sum) * fp32(post_scale / hadamard_size))`` where the factor is computed in
    Python double and rounded once to fp32 (without Hadamard: ``cast(sum * fp32(post_scale))``).
    Returns ``out_dtype`` [m].
    """
    acc = dequant_sum(payloads, scales, bits, group_size)
    if hadamard_size:
        acc = hadamard_transform(acc, hadamard_size)
        factor = post_scale / hadamard_size
    else:
        factor = post_scale
    return (acc * torch.tensor(factor, dtype=torch.float32)).to(out_dtype)


def weight_delta_quantize(master: torch.Tensor, replica: torch.Tensor, bits: int, group_size: int,
                          rounding: str = "nearest", key: Optional[int] = None, offset: int = 0,
                          mode: str = "diff") -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 4: the owner's half of qWD, in one pass.  Updates ``replica`` in place.

    Args:
        master: fp32 [n] (the optimizer's master shard); replica: bf16/fp16/fp32 [n] (the persistent copy).
        mode: ``diff``: quantize ``delta = master - float(replica)`` and set
              ``replica = cast(float(replica) + deq)``;  ``direct`` (the paper's qW ablation): quantize
              ``master`` itself and set ``replica = cast(deq)``.
    Returns: payload uint8 [padded n * bits / 8], scales fp32 [num_groups].
    """
    if master.numel() != replica.numel():
        raise ValueError(f"master has {master.numel()} elements but replica has {replica.numel()}")
    if mode == "diff":
        src = master.reshape(-1).float() - replica.reshape(-1).float()
    elif mode == "direct":
        src = master.reshape(-1).float()
    else:
        raise ValueError(f"mode must be 'diff' or 'direct', got {mode!r}")
    codes, scales = quantize_groups(src, bits, group_size, rounding, key, offset)
    payload = pack_codes(codes, bits)
    _apply_codes(replica, codes, scales, group_size, add=(mode == "diff"))
    return payload, scales


def _apply_codes(replica: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                 add: bool) -> None:
    n = replica.numel()
    deq = dequantize_groups(codes, scales, group_size, n)
    flat = replica.view(-1)
    new = flat.float() + deq if add else deq
    flat.copy_(new.to(replica.dtype))


def dequant_add_(replica: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                 group_size: int, mode: str = "diff") -> torch.Tensor:
    """Op 5: every receiver's half of qWD: ``replica = cast(float(replica) + deq)`` in place
    (``mode='direct'``: ``replica = cast(deq)``).  Bit-identical to the owner's update in op 4.

    Args: replica [n] (any float dtype), payload uint8 [padded n * bits / 8], scales fp32 [num_groups].
    """
    codes = unpack_codes(payload, bits)
    if codes.numel() < replica.numel():
        raise ValueError(f"payload holds {codes.numel()} codes for a replica of {replica.numel()}")
    _apply_codes(replica, codes, scales, group_size, add=(mode == "diff"))
    return replica


def dequant_add_segments_(dst: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                          group_size: int, mode: str, segments) -> torch.Tensor:
    """Op 6: op 5 through a segment list, in place: one source's payload applied to many pieces of one buffer.

    Args:
        dst: 1-D contiguous bf16/fp16/fp32 [n] (e.g. one flat replica buffer holding many parameters).
        payload: uint8, the codes of one source's flat partition (packed as in the module docstring: 4-bit
            element ``2i`` in the low nibble of byte ``i``); scales: fp32 [G], one per ``group_size`` codes.
        segments: a :class:`~deepspeed_sdp4bit.segments.SegmentPlan` (``segments.make_segment_plan``): segment
            ``(s0, d0, L)`` does, for ``j`` in ``[0, L)``, with ``c = code[s0 + j]`` and ``s = scales[(s0 + j) //
            group_size]``:
              ``diff``:   ``dst[d0 + j] = cast(float(dst[d0 + j]) + RN(float(c) * s))``
              ``direct``: ``dst[d0 + j] = cast(RN(float(c) * s))``
            i.e. exactly :func:`dequant_add_` element by element (one rounded fp32 multiply, then one rounded
            fp32 add, never a fused multiply-add), so every receiver gets the owner's bits (op 4) whatever the
            segment's offsets.  Segments do not overlap in ``dst`` (the plan checks it).
    Returns: ``dst``.
    """
    codes = unpack_codes(payload, bits)
    if codes.numel() < segments.src_end:
        raise ValueError(f"payload holds {codes.numel()} codes, the segments read up to {segments.src_end}")
    add = mode == "diff"
    sc = scales.reshape(-1).float()
    for s0, d0, L in segments.segments():
        src = torch.arange(s0, s0 + L, dtype=torch.int64, device=codes.device)
        deq = codes[s0: s0 + L].float() * sc[src // group_size].to(codes.device)
        piece = dst[d0: d0 + L]
        piece.copy_((piece.float() + deq.to(piece.device) if add else deq.to(piece.device)).to(dst.dtype))
    return dst


def wire_bits_per_value(bits: int, group_size: int) -> float:
    """Bits on the wire per value for a quantized level: ``bits + 32 / group_size`` (fp32 scales)."""
    return bits + 32.0 / group_size
