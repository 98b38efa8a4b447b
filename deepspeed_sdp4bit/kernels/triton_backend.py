"""Triton kernels for the six SDP4Bit ops, bit-exact with :mod:`deepspeed_sdp4bit.reference`.

Public entry point: :func:`make_backend` returns ``ops.Backend("triton", ...)``; :mod:`deepspeed_sdp4bit.ops`
calls it lazily the first time the ``triton`` backend is asked for.  The six ops have the reference
signatures plus optional ``out=`` / ``out_scales=`` buffers (written in place when given, allocated
otherwise), exactly like the torch backend in ``ops.py``.

Devices
-------
The backend is available for CUDA tensors when Triton imports.  When the environment variable
``TRITON_INTERPRET=1`` is set *before this module is imported*, Triton decorates every kernel as an
interpreted function; the probe then also accepts CPU tensors, which run through Triton's numpy
interpreter (slow: meant for CI on CPU machines, see ``tests/conftest.py``).  Whether the kernels are
interpreted is fixed at import time, so the probe looks at the decorated kernels, not at the variable.

How bit-exactness with the reference is kept
--------------------------------------------
* All math is fp32.  Divisions (the per-group scale and its reciprocal) use ``tl.math.div_rn`` (IEEE
  round-to-nearest; plain ``/`` may lower to an approximate division on GPUs).  Kernels are launched with
  ``enable_fp_fusion=False`` so that a multiply and a following add are never contracted into one FMA
  (``x * inv + u1``, a replica plus a dequantized delta: two roundings in the reference); where the reference
  fuses (chunk sums), the kernels call ``tl.fma``.  And (NVIDIA) with
  ``enable_reflect_ftz=False`` so that ``floor`` keeps subnormals like torch does.
* The Hadamard transform is the reference butterfly, stage by stage (strides 1, 2, ..., h/2), done with
  reshape/permute/split/join; no ``tl.dot`` (its accumulation order differs, and the interpreter
  mishandles bf16 dots).
* ``absmax`` propagates NaN explicitly (``tl.max`` may drop NaN on GPUs).
* Stochastic rounding uses the reference's counter hash (``mix32`` in uint32 arithmetic), one hash per pair
  of counters.
* bf16 is widened by a shift; compiled kernels narrow fp32 to bf16 with the GPU's round-to-nearest-even
  conversion, the interpreter (whose cast truncates) with integer rounding that matches torch, NaN included.
* On NVIDIA GPUs the row kernels use inline PTX (``tl.inline_asm_elementwise``) for what Triton has no operation
  for: the round-down add that gives ``floor`` in one instruction, byte permutes that pack codes into bytes and
  (op 2) decode them, and bf16 widening two values at a time. The interpreter and other backends run plain
  Triton code for the same steps, with the same bits (``SDP4BIT_TRITON_PTX=0`` selects it on NVIDIA GPUs too).

Launch shape
------------
Ops 1-3 first try the *row kernels*: a program owns R rows of B consecutive elements (B = the Hadamard size,
or 32 without a transform; op 2: 64 for up to 2 chunks where the group sizes allow, else 32), one row per thread on
GPUs, held as a tuple of [R, 8] slabs so that a whole row stays in one thread's registers (butterfly, group
maximum and rounding without shared memory or shuffles).  They apply when a group is a power-of-two number of
rows, a swizzle segment holds whole rows and, for stochastic rounding, the offset is even with every pair index
below 2**32 (``_rows_plan``, ``_pairs_fit``); everything else (odd offsets, groups such as 96, Hadamard sizes
above 64, counters past 2**33) takes the general kernels below, which the tests cover as well.  Op 2's row kernel
also compiles the chunk count k in when k <= 8 (``_unrolled_chunks``), so that all chunks' loads are issued first.

Persistent row kernels: op 2 with 4 chunks of 8-bit codes and op 3 with 3..8 chunks of 4-bit codes (rows of 32)
run a fixed grid of a few programs per SM that loop over the tiles, loading the next tile's codes (as int32 words)
while computing the current one; with one program per tile, a launch of a few waves loads everything first and
computes last (``_OP2_PERSIST_KS``, ``_OP3_PERSIST_KS``; used only where each program loops at least twice).

General kernels: grouped ops (1, 2, 4) give each program ``GPP`` whole groups as a [GPP, BLOCK_G] tile
(BLOCK_G = the group size rounded up to a power of two, extra columns masked); ops 3 and 5 give each program
a flat block.  On GPUs a tile is ~4096 elements (8 warps); under the interpreter, where every program pays a
Python cost per instruction, one program takes up to 32768 elements.  Group sizes, bit widths, Hadamard
size, rounding mode and dtypes are compile-time constants, so each configuration compiles once.
"""

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import backend as _backend
from .. import reference as R
from ._common import (backend_from, buffer, dequant_add_plan, dequant_add_segments_plan, inverse_plan,
                      quantize_plan, requant_plan, weight_delta_plan)

__all__ = [
    "make_backend",
    "is_interpreted",
    "hadamard_quantize",
    "dequant_sum_requant",
    "dequant_sum_inverse_hadamard",
    "weight_delta_quantize",
    "dequant_add_",
    "dequant_add_segments_",
]

# dtype "kind" codes the kernels specialize on: how to widen/narrow to/from fp32
_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# jit-visible constants (globals must be constexpr to be read inside kernels)
# (no NaN global: Triton re-checks globals by equality at every launch, and NaN != NaN fails that check)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)


# ----------------------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _mix32(x):
    """lowbias32 hash of a uint32 tensor (wraps mod 2**32, logical shifts: x is unsigned)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _uniform1(key_u32, ctr, NEED_HI: tl.constexpr):
    """fp32 ``u1`` in (1, 2) for int64 counters ``ctr`` of stream ``key_u32`` (reference.stochastic_uniforms)."""
    p = ctr >> 1  # the pair index: one hash serves two counters
    h = _mix32(p.to(tl.uint32) ^ key_u32)  # int64 -> uint32 keeps the low 32 bits
    if NEED_HI:
        # only compiled in when some pair index is >= 2**32 (or negative), as the reference does
        hi = p >> 32
        h = tl.where(hi != 0, _mix32(h ^ hi.to(tl.uint32)), h)
    h = tl.where((ctr & 1) != 0, (h << 16) | (h >> 16), h)  # an odd counter: the other 16 bits
    return ((h & 0x7FFF80) | 0x3F800040).to(tl.float32, bitcast=True)


@triton.jit
def _load_f32(ptr, mask, KIND: tl.constexpr):
    """Load fp32/fp16/bf16 (bf16 passed as an int16 view) and widen to fp32 exactly."""
    if KIND == 2:
        bits = tl.load(ptr, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        v = (bits << 16).to(tl.float32, bitcast=True)
    else:
        v = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _store_from_f32(ptr, v, mask, KIND: tl.constexpr):
    """Narrow fp32 to the buffer's dtype with round-to-nearest-even and store (bf16 as an int16 view)."""
    if KIND == 2 and _NATIVE_BF16:
        tl.store(ptr, v.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)  # RNE, like torch
    elif KIND == 2:
        # torch's fp32->bf16 rule: add 0x7fff + lsb and keep the high half; NaN becomes 0x7fc0.  Written
        # with integers because the interpreter's own fp32->bf16 cast truncates.
        u = v.to(tl.uint32, bitcast=True)
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(ptr, r.to(tl.int32).to(tl.int16), mask=mask)
    elif KIND == 1:
        tl.store(ptr, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def _butterfly(x, N: tl.constexpr, LOG_H: tl.constexpr):
    """Unnormalized block Hadamard of flat fp32 ``x`` [N], blocks of 2**LOG_H, in the reference order.

    Stage of stride S: view as [N/(2S), 2, S]; the pair (a, b) = (row 0, row 1) becomes (a + b, a - b).
    """
    for i in tl.static_range(LOG_H):
        # stride S = 1 << i (written inline: a constexpr cannot be re-bound inside the unrolled loop)
        v = tl.permute(tl.reshape(x, [N // (2 << i), 2, 1 << i]), [0, 2, 1])  # [N/2S, S, 2]: pair last
        a, b = tl.split(v)
        v = tl.join(a + b, a - b)
        x = tl.reshape(tl.permute(v, [0, 2, 1]), [N])
    return x


@triton.jit
def _quantize_rows(x, ctr, key_u32, QMAX: tl.constexpr, STOCH: tl.constexpr, NEED_HI: tl.constexpr):
    """Quantize each row of fp32 ``x`` [R, C] as one group (masked-out entries must be 0).

    ``ctr`` [R, C] int64 are the stochastic-rounding counters.  Returns int8 codes [R, C], fp32 scales [R].
    """
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    absmax = tl.max(tl.abs(x), axis=1)
    nan = tl.full(absmax.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    absmax = tl.where(has_nan, nan, absmax)  # tl.max may drop NaN; the reference propagates it
    scale = tl.math.div_rn(absmax, QMAX * 1.0)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)  # inf for scale < 2**-127
    valid = (scale > 0.0) & (scale <= _FLT_MAX) & (inv <= _FLT_MAX)  # false for 0, inf and NaN
    inv = tl.where(valid, inv, 1.0)
    # reference.fit_reciprocal: lower inv by an ulp (its bits minus one: inv is a positive normal) while
    # absmax * inv > qmax, at most twice
    am = tl.where(valid, absmax, 0.0)
    for _ in tl.static_range(2):
        lowered = (inv.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
        inv = tl.where(am * inv > QMAX * 1.0, lowered, inv)
    y = x * inv[:, None]  # one rounded multiply (launched without fp fusion: never an FMA with the add)
    if STOCH:
        t = y + _uniform1(key_u32, ctr, NEED_HI)
        r = tl.floor(t)
        # floor may be lowered with flush-to-zero (libdevice): a subnormal t would give 0, not floor(t)
        r = tl.where(r > t, r - 1.0, r) - 1.0
    else:
        r = tl.floor(tl.abs(y) + 0.5)  # half away from zero
        r = tl.where(y < 0.0, -r, r)
    ok = valid[:, None] & (r == r) & (tl.abs(r) <= _FLT_MAX)
    r = tl.minimum(tl.maximum(r, -QMAX * 1.0), QMAX * 1.0)
    codes = tl.where(ok, r, 0.0).to(tl.int8)
    return codes, scale


@triton.jit
def _store_code_rows(out_ptr, codes, grp, gmask, GS: tl.constexpr, BLOCK_G: tl.constexpr,
                     BITS: tl.constexpr):
    """Store int8 codes [R, BLOCK_G] of groups ``grp`` [R] as payload bytes (first GS columns valid).

    bits=8: ``out_ptr`` is an int8 view of the payload.  bits=4: uint8, element 2i low nibble, 2i+1 high.
    """
    if BITS == 8:
        col = tl.arange(0, BLOCK_G)
        m = gmask[:, None] & (col < GS)[None, :]
        tl.store(out_ptr + grp[:, None] * GS + col[None, :], codes, mask=m)
    else:
        HALF: tl.constexpr = BLOCK_G // 2
        lo, hi = tl.split(tl.reshape(codes, [codes.shape[0], HALF, 2]))
        byte = (lo.to(tl.int32) & 0xF) | ((hi.to(tl.int32) & 0xF) << 4)
        col2 = tl.arange(0, HALF)
        m = gmask[:, None] & (col2 < GS // 2)[None, :]
        tl.store(out_ptr + grp[:, None] * (GS // 2) + col2[None, :], byte.to(tl.uint8), mask=m)


@triton.jit
def _load_codes_f32(p_ptr, g, mask, BITS: tl.constexpr):
    """fp32 codes of elements ``g`` (int64) from a payload (bits=8: int8 view; bits=4: uint8 nibbles)."""
    if BITS == 8:
        c = tl.load(p_ptr + g, mask=mask, other=0).to(tl.float32)
    else:
        byte = tl.load(p_ptr + (g >> 1), mask=mask, other=0).to(tl.int32)  # uint8 -> zero-extended
        nib = (byte >> ((g & 1) * 4).to(tl.int32)) & 0xF
        c = tl.where(nib >= 8, nib - 16, nib).to(tl.float32)  # 4-bit two's complement
    return c


@triton.jit
def _dequant_sum(p_ptr, p_stride, s_ptr, s_stride, k, g, mask, GS: tl.constexpr, BITS: tl.constexpr):
    """fp32 ``acc = c_0 * s_0; acc = fma(c_1, s_1, acc); ...`` over k chunks for elements ``g`` (any shape,
    int64): reference.dequant_sum."""
    sg = g // GS
    acc = _load_codes_f32(p_ptr, g, mask, BITS) * tl.load(s_ptr + sg, mask=mask, other=0.0)
    for _ in range(1, k):
        # advance the row pointers step by step: no 32-bit j * stride product that could overflow
        p_ptr += p_stride
        s_ptr += s_stride
        acc = tl.fma(_load_codes_f32(p_ptr, g, mask, BITS), tl.load(s_ptr + sg, mask=mask, other=0.0), acc)
    return acc


# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------
_NO_SPEC = ["key", "offset"]
_ROWS_NO_SPEC = ["key", "offset", "ubits"]  # ubits: a register constant (see _rows_uniforms), never specialized
_UBITS = 0x7FFF80


@triton.jit(do_not_specialize=_NO_SPEC)
def _hadamard_quantize_kernel(x_ptr, out_ptr, scale_ptr, ngroups, rows, cols, seg, key, offset,
                              GS: tl.constexpr, BLOCK_G: tl.constexpr, GPP: tl.constexpr,
                              BITS: tl.constexpr, QMAX: tl.constexpr, LOG_H: tl.constexpr,
                              SWIZZLE: tl.constexpr, STOCH: tl.constexpr, NEED_HI: tl.constexpr,
                              IN_KIND: tl.constexpr):
    """Op 1 on GPP groups per program: gather (swizzled) input, butterfly, quantize, store payload+scales."""
    pid = tl.program_id(0).to(tl.int64)
    grp = pid * GPP + tl.arange(0, GPP)
    col = tl.arange(0, BLOCK_G)
    gmask = grp < ngroups
    mask = gmask[:, None] & (col < GS)[None, :]
    o = grp[:, None] * GS + col[None, :]  # element index in output order
    # SWIZZLE: output is [cols, rows, seg]; element (c, r, e) comes from input [rows, cols, seg] at (r, c, e).
    # All index products are int64 because o is (no scalar casts: rows/cols may be specialized constants).
    if SWIZZLE == 2:
        # seg is a multiple of GS: a group never straddles segments, so map once per group (cheap)
        o0 = grp * GS
        q = o0 // seg
        c = q // rows
        r = q - c * rows
        src = ((r * cols + c) * seg + (o0 - q * seg))[:, None] + col[None, :]
    elif SWIZZLE == 1:
        q = o // seg
        c = q // rows
        r = q - c * rows
        src = (r * cols + c) * seg + (o - q * seg)
    else:
        src = o
    x = _load_f32(x_ptr + src, mask, IN_KIND)
    if LOG_H > 0:
        x = tl.reshape(_butterfly(tl.reshape(x, [GPP * BLOCK_G]), GPP * BLOCK_G, LOG_H), [GPP, BLOCK_G])
    key_u32 = key.to(tl.uint32, bitcast=True)
    codes, scale = _quantize_rows(x, o + offset.to(tl.int64), key_u32, QMAX, STOCH, NEED_HI)
    tl.store(scale_ptr + grp, scale, mask=gmask)
    _store_code_rows(out_ptr, codes, grp, gmask, GS, BLOCK_G, BITS)


@triton.jit(do_not_specialize=_NO_SPEC)
def _dequant_sum_requant_kernel(p_ptr, p_stride, s_ptr, s_stride, k, m, out_ptr, oscale_ptr, ngroups,
                                key, offset,
                                IN_GS: tl.constexpr, IN_BITS: tl.constexpr,
                                GS: tl.constexpr, BLOCK_G: tl.constexpr, GPP: tl.constexpr,
                                BITS: tl.constexpr, QMAX: tl.constexpr,
                                STOCH: tl.constexpr, NEED_HI: tl.constexpr):
    """Op 2 on GPP output groups per program: dequantize + sum k chunks, requantize."""
    pid = tl.program_id(0).to(tl.int64)
    grp = pid * GPP + tl.arange(0, GPP)
    col = tl.arange(0, BLOCK_G)
    gmask = grp < ngroups
    o = grp[:, None] * GS + col[None, :]
    mask = gmask[:, None] & (col < GS)[None, :] & (o < m)  # o >= m: zero padding of the last group
    acc = _dequant_sum(p_ptr, p_stride, s_ptr, s_stride, k, o, mask, IN_GS, IN_BITS)
    acc = tl.where(mask, acc, 0.0)
    key_u32 = key.to(tl.uint32, bitcast=True)
    codes, scale = _quantize_rows(acc, o + offset.to(tl.int64), key_u32, QMAX, STOCH, NEED_HI)
    tl.store(oscale_ptr + grp, scale, mask=gmask)
    _store_code_rows(out_ptr, codes, grp, gmask, GS, BLOCK_G, BITS)


@triton.jit
def _dequant_sum_inverse_hadamard_kernel(p_ptr, p_stride, s_ptr, s_stride, k, m, out_ptr, factor,
                                         IN_GS: tl.constexpr, IN_BITS: tl.constexpr, BLOCK: tl.constexpr,
                                         LOG_H: tl.constexpr, OUT_KIND: tl.constexpr):
    """Op 3 on BLOCK elements per program: dequantize + sum k chunks, butterfly, * factor, cast."""
    pid = tl.program_id(0).to(tl.int64)
    g = pid * BLOCK + tl.arange(0, BLOCK)
    mask = g < m  # m is a multiple of the Hadamard size, so whole blocks are in or out
    acc = _dequant_sum(p_ptr, p_stride, s_ptr, s_stride, k, g, mask, IN_GS, IN_BITS)
    if LOG_H > 0:
        acc = _butterfly(tl.where(mask, acc, 0.0), BLOCK, LOG_H)
    _store_from_f32(out_ptr + g, acc * factor, mask, OUT_KIND)


@triton.jit(do_not_specialize=_NO_SPEC)
def _weight_delta_quantize_kernel(master_ptr, replica_ptr, out_ptr, scale_ptr, n, ngroups, key, offset,
                                  GS: tl.constexpr, BLOCK_G: tl.constexpr, GPP: tl.constexpr,
                                  BITS: tl.constexpr, QMAX: tl.constexpr, STOCH: tl.constexpr,
                                  NEED_HI: tl.constexpr, DIFF: tl.constexpr,
                                  M_KIND: tl.constexpr, R_KIND: tl.constexpr):
    """Op 4 on GPP groups per program: delta (or master), quantize, store payload, update replica."""
    pid = tl.program_id(0).to(tl.int64)
    grp = pid * GPP + tl.arange(0, GPP)
    col = tl.arange(0, BLOCK_G)
    gmask = grp < ngroups
    o = grp[:, None] * GS + col[None, :]
    mask = gmask[:, None] & (col < GS)[None, :] & (o < n)
    src = _load_f32(master_ptr + o, mask, M_KIND)
    if DIFF:
        rep = _load_f32(replica_ptr + o, mask, R_KIND)
        src = src - rep
    key_u32 = key.to(tl.uint32, bitcast=True)
    codes, scale = _quantize_rows(src, o + offset.to(tl.int64), key_u32, QMAX, STOCH, NEED_HI)
    tl.store(scale_ptr + grp, scale, mask=gmask)
    _store_code_rows(out_ptr, codes, grp, gmask, GS, BLOCK_G, BITS)
    deq = codes.to(tl.float32) * scale[:, None]
    if DIFF:
        deq = rep + deq
    _store_from_f32(replica_ptr + o, deq, mask, R_KIND)


@triton.jit
def _dequant_add_kernel(replica_ptr, p_ptr, s_ptr, n, GS: tl.constexpr, BITS: tl.constexpr,
                        BLOCK: tl.constexpr, DIFF: tl.constexpr, R_KIND: tl.constexpr):
    """Op 5 on BLOCK elements per program: replica = cast(float(replica) + deq) (or cast(deq))."""
    pid = tl.program_id(0).to(tl.int64)
    g = pid * BLOCK + tl.arange(0, BLOCK)
    mask = g < n
    deq = _load_codes_f32(p_ptr, g, mask, BITS) * tl.load(s_ptr + g // GS, mask=mask, other=0.0)
    if DIFF:
        deq = _load_f32(replica_ptr + g, mask, R_KIND) + deq
    _store_from_f32(replica_ptr + g, deq, mask, R_KIND)


@triton.jit
def _dequant_add_segments_kernel(dst_ptr, p_ptr, s_ptr, tiles_ptr, GS: tl.constexpr, BITS: tl.constexpr,
                                 BLOCK: tl.constexpr, DIFF: tl.constexpr, R_KIND: tl.constexpr):
    """Op 6: one program per tile-table row ``(src_start, dst_start, count)``, op 5's arithmetic on it.

    A whole tile (count == BLOCK) whose source and destination starts are multiples of 16 takes an unmasked
    path with alignment hints (vector loads and stores on GPUs); any other tile the masked one.  Same bits
    (the interpreter runs both paths too).
    """
    pid = tl.program_id(0).to(tl.int64)
    src0 = tl.load(tiles_ptr + 3 * pid)
    dst0 = tl.load(tiles_ptr + 3 * pid + 1)
    cnt = tl.load(tiles_ptr + 3 * pid + 2)
    g = tl.arange(0, BLOCK)
    whole = (cnt == BLOCK) & (src0 % 16 == 0) & (dst0 % 16 == 0)
    if whole:
        # (x // 16) * 16 == x here; written so, the compiler knows the starts are multiples of 16, and the mask is
        # all true at compile time: vector loads and stores
        _segment_tile((src0 // 16) * 16 + g, (dst0 // 16) * 16 + g, g < BLOCK, dst_ptr, p_ptr, s_ptr, GS, BITS,
                      DIFF, R_KIND)
    else:
        _segment_tile(src0 + g, dst0 + g, g < cnt, dst_ptr, p_ptr, s_ptr, GS, BITS, DIFF, R_KIND)


@triton.jit
def _segment_tile(s, d, mask, dst_ptr, p_ptr, s_ptr, GS: tl.constexpr, BITS: tl.constexpr, DIFF: tl.constexpr,
                  R_KIND: tl.constexpr):
    """dst[d] = cast(float(dst[d]) + code[s] * scale[s // GS]) (or cast(code * scale)) where ``mask``."""
    deq = _load_codes_f32(p_ptr, s, mask, BITS) * tl.load(s_ptr + s // GS, mask=mask, other=0.0)
    if DIFF:
        deq = _load_f32(dst_ptr + d, mask, R_KIND) + deq
    _store_from_f32(dst_ptr + d, deq, mask, R_KIND)


# ----------------------------------------------------------------------------------------------------------
# row-block kernels (the fast path of ops 1-3)
# ----------------------------------------------------------------------------------------------------------
# A program owns R rows of B consecutive elements (B = the Hadamard size, or 32 without a transform), one
# row per thread on GPUs.  A row is held as a tuple of A = B/8 slabs, each an [R, 8] tensor, so the layout
# Triton picks puts a whole row in one thread's registers: the butterfly, the group maximum over the row and
# the rounding are register arithmetic with no shared memory or shuffles (the 2-D formulation above lets
# Triton spread a row over lanes, and every butterfly stage then went through shared memory).  Groups are GB
# consecutive rows (a power of two).  Codes convert to and from floats through the magic constant 1.5 * 2**23
# (exact for |v| < 2**22): no float<->int conversion instructions, which run at a quarter of the FP32 rate.
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: bits 0x4B400000, whose low 23 bits are 0


@triton.jit
def _split_cols(x, R: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """[R, W] -> tuple of W [R] tensors; column i lands at position bitrev(i) (split halves by the low bit)."""
    parts = (x,)
    for lvl in tl.static_range(LOG_W):
        out = ()
        for j in tl.static_range(1 << lvl):
            a, b = tl.split(tl.reshape(parts[j], [R, W >> (lvl + 1), 2]))
            out = out + (a, b)
        parts = out
    res = ()
    for j in tl.static_range(W):
        res = res + (tl.reshape(parts[j], [R]),)
    return res


@triton.jit
def _join_cols(e, R: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """Inverse of :func:`_split_cols`: tuple of W [R] tensors (bit-reversed positions) -> [R, W]."""
    parts = ()
    for j in tl.static_range(W):
        parts = parts + (tl.reshape(e[j], [R, 1]),)
    for lvl in tl.static_range(LOG_W):
        out = ()
        for j in tl.static_range(W >> (lvl + 1)):
            out = out + (tl.reshape(tl.join(parts[2 * j], parts[2 * j + 1]), [R, 2 << lvl]),)
        parts = out
    return parts[0]


@triton.jit
def _butterfly_rows(xs, R: tl.constexpr, A: tl.constexpr, LOG_A: tl.constexpr):
    """The reference butterfly (strides 1, 2, ..., 8A/2) on rows held as a tuple of A [R, 8] slabs."""
    out = ()
    for a in tl.static_range(A):
        # strides 1, 2, 4 inside a slab: on its 8 columns as separate tensors (stride s sits at position
        # distance 4 >> s after the bit-reversing split)
        e = _split_cols(xs[a], R, 8, 3)
        for s in tl.static_range(3):
            f = ()
            for p in tl.static_range(8):
                if (p & (4 >> s)) == 0:
                    f = f + (e[p] + e[p + (4 >> s)],)
                else:
                    f = f + (e[p - (4 >> s)] - e[p],)
            e = f
        out = out + (_join_cols(e, R, 8, 3),)
    xs = out
    for s in tl.static_range(LOG_A):  # strides 8, 16, ...: between slabs
        out = ()
        for a in tl.static_range(A):
            if (a & (1 << s)) == 0:
                out = out + (xs[a] + xs[a + (1 << s)],)
            else:
                out = out + (xs[a - (1 << s)] - xs[a],)
        xs = out
    return xs


@triton.jit
def _rows_uniforms(prow, key_u32, ubits, a, R: tl.constexpr, ALIGNED: tl.constexpr):
    """``u1`` [R, 8] of slab ``a``: the pairs ``prow + 4a + 0..3`` (uint32; ``prow ^ key`` when ALIGNED).

    ``ubits`` is the mask 0x7FFF80 passed as a kernel argument: held in a register, ``(h & ubits) | 0x3F800040``
    is one LOP3 (a LOP3 takes a single immediate).
    """
    j = (tl.arange(0, 4) + a * 4).to(tl.uint32)[None, :]
    if ALIGNED:
        h = _mix32(prow[:, None] ^ j)  # prow: pair index ^ key, a multiple of B/2 > 4a + 3: OR == ADD
    else:
        h = _mix32((prow[:, None] + j) ^ key_u32)
    ue = ((h & ubits) | 0x3F800040).to(tl.float32, bitcast=True)
    uo = ((((h << 16) | (h >> 16))) & ubits | 0x3F800040).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(ue, uo), [R, 8])


@triton.jit
def _quantize_store_rows(xs, out_ptr, scale_ptr, pid, blk0, r, rmask, nrows, key, offset, ubits,
                         R: tl.constexpr, A: tl.constexpr, GB: tl.constexpr, BITS: tl.constexpr,
                         QMAX: tl.constexpr, STOCH: tl.constexpr, ALIGNED: tl.constexpr):
    """Quantize rows (tuple of A [R, 8] fp32 slabs; GB rows per group) and store codes and scales.

    ``blk0``: the program's first row (int64); ``r`` = arange(R); rows at and past ``nrows`` are not stored.
    Stochastic counters: element e of the output has counter ``offset + e`` (offset even, pairs < 2**32).
    """
    B: tl.constexpr = A * 8
    G: tl.constexpr = R // GB
    # group absmax as the integer maximum of |x|'s bits: NaN bits sort above inf, so one reduction finds both
    mb = xs[0].to(tl.int32, bitcast=True) & 0x7FFFFFFF
    for a in tl.static_range(1, A):
        mb = tl.maximum(mb, xs[a].to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    mb = tl.max(tl.reshape(tl.max(mb, axis=1), [G, GB]), axis=1)
    absmax = tl.where(mb > 0x7F800000, 0x7FC00000, mb).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(absmax, QMAX * 1.0)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    valid = (scale > 0.0) & (scale <= _FLT_MAX) & (inv <= _FLT_MAX)
    inv = tl.where(valid, inv, 1.0)
    am = tl.where(valid, absmax, 0.0)
    for _ in tl.static_range(2):  # reference.fit_reciprocal
        lowered = (inv.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
        inv = tl.where(am * inv > QMAX * 1.0, lowered, inv)
    gi = tl.arange(0, G)
    tl.store(scale_ptr + pid.to(tl.int64) * G + gi, scale, mask=blk0 + gi * GB < nrows)
    inv_r = tl.reshape(tl.broadcast_to(inv[:, None], [G, GB]), [R])[:, None]
    valid_r = tl.reshape(tl.broadcast_to(valid[:, None], [G, GB]), [R])[:, None]
    if STOCH:
        prow = (((blk0 * B + offset) >> 1) + r * (B // 2)).to(tl.uint32)
        key_u32 = key.to(tl.uint32, bitcast=True)
        if ALIGNED:
            prow = prow ^ key_u32
    smask = rmask[:, None] & (tl.arange(0, 8 * BITS // 8) >= 0)[None, :]
    keep = tl.where(valid_r, -1, 0).to(tl.int8)  # (PTX packing) a code's bits kept, or none (invalid group)
    for a in tl.static_range(A):
        # |y| <= qmax in a valid group (fitted reciprocal): codes need no clamp, and t is never subnormal
        y = xs[a] * inv_r
        if STOCH:
            c = _floor_bits(y + _rows_uniforms(prow, key_u32, ubits, a, R, ALIGNED), True)
        else:
            c = _floor_bits(tl.abs(y) + 0.5, False)  # sign(y) * floor(|y| + 0.5)
            c = tl.where(y < 0.0, -c, c)  # -(M + n) keeps -n's low byte
        byte = _pack_codes(c, valid_r, keep, R, BITS)
        tl.store(out_ptr + (r[:, None] * (B * BITS // 8) + (a * BITS + tl.arange(0, BITS))[None, :]), byte,
                 mask=smask)


@triton.jit
def _floor_bits(t, STOCH: tl.constexpr):
    """Bits of RD(t + C), C = M - 1 (STOCH: M + floor(t) - 1) or M (M + floor(t)), M = 1.5 * 2**23: the code's
    two's complement in the low 8 (or 4) bits, the only bits stored, so M's bits (0 mod 256) need not be
    subtracted."""
    if _PTX_ROUND:
        c = _ptx_floor_bits(t, STOCH)
    else:
        # RD(t + C) = n - (n > t + C) with n = RN(t + C), compared as n - C > t (exact)
        if STOCH:
            mg = t + (_MAGIC - 1.0)
            back = mg - (_MAGIC - 1.0)
        else:
            mg = t + _MAGIC
            back = mg - _MAGIC
        c = mg.to(tl.int32, bitcast=True)
        c = tl.where(back > t, c - 1, c)
    return c


@triton.jit
def _pack_codes(c, valid_r, keep, R: tl.constexpr, BITS: tl.constexpr):
    """Payload bytes [R, 8] (BITS=8, int8) or [R, 4] (BITS=4, uint8, element 2i in the low nibble) of the int32
    codes ``c`` [R, 8] (code in the low bits); rows where ``valid_r`` is false (``keep`` 0) get code 0."""
    if BITS == 8:
        if _PTX_ROUND:
            byte = _ptx_pack_bytes(c, keep)
        else:
            byte = tl.where(valid_r, c, 0).to(tl.int8)
    else:
        lo, hi = tl.split(tl.reshape(c, [R, 4, 2]))
        if _PTX_ROUND:
            byte = _ptx_pack_nibbles(lo, hi, keep)
        else:
            byte = tl.where(valid_r, (lo & 0xF) | ((hi & 0xF) << 4), 0).to(tl.uint8)
    return byte


# ---- PTX fast paths of the row kernels (compiled NVIDIA builds: ``_PTX``) ----
# Triton exposes neither a round-down add nor byte permutes, and its own code for these steps costs ~9
# instructions per element (rounding: three adds, a compare and a predicated correction; packing: byte
# extraction, masking, selects).  Inline PTX does them in ~2.75 (8-bit) and, for decoding, in ~1.25 instead of
# ~3.  ``pack=4`` hands 4 elements of a thread to one asm instance, with narrow (8/16-bit) values packed into
# one 32-bit register, byte i for element i.  Which 4 depends on the layout Triton picks (with fewer rows than
# threads they come from 4 different rows), so every input is per element: the group-validity mask is an int8
# tensor, packed like the codes, and ANDed byte by byte.  The interpreter (and non-NVIDIA builds) take the
# plain Triton code beside each call; both give the same bits, and the tests run both (interpreter in CI,
# compiled on GPUs).
@triton.jit
def _ptx_floor_bits(t, STOCH: tl.constexpr):
    """Bits of RD(t + C) with C = 1.5*2**23 - 1 (STOCH: floor(t) - 1) or 1.5*2**23 (floor(t)): int32."""
    if STOCH:
        asm: tl.constexpr = "add.rm.f32 $0, $1, 0f4B3FFFFF;"
    else:
        asm: tl.constexpr = "add.rm.f32 $0, $1, 0f4B400000;"
    return tl.inline_asm_elementwise(asm=asm, constraints="=r,r", args=[t], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _ptx_pack_bytes(c, keep):
    """int8 codes from the low bytes of int32 ``c``; ``keep`` (int8, 0 or -1 per element) zeroes the codes of
    an invalid group.  Byte permutes: 3 per 4 codes."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi, w;
        prmt.b32 lo, $1, $2, 0x0040;
        prmt.b32 hi, $3, $4, 0x0040;
        prmt.b32 w, lo, hi, 0x5410;
        and.b32 $0, w, $5;
        }""",
        constraints="=r,r,r,r,r,r", args=[c, keep], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _ptx_pack_nibbles(lo, hi, keep):
    """uint8 bytes ``(lo & 0xF) | (hi << 4)`` of int32 codes ``lo`` (even elements) and ``hi`` (odd ones)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 e0, e1, ev, o0, o1, od, w;
        prmt.b32 e0, $1, $2, 0x0040;
        prmt.b32 e1, $3, $4, 0x0040;
        prmt.b32 ev, e0, e1, 0x5410;
        prmt.b32 o0, $5, $6, 0x0040;
        prmt.b32 o1, $7, $8, 0x0040;
        prmt.b32 od, o0, o1, 0x5410;
        shl.b32 od, od, 4;
        and.b32 ev, ev, 0x0F0F0F0F;
        and.b32 od, od, 0xF0F0F0F0;
        or.b32 w, ev, od;
        and.b32 $0, w, $9;
        }""",
        constraints="=r,r,r,r,r,r,r,r,r,r", args=[lo, hi, keep], dtype=tl.uint8, is_pure=True, pack=4)


# 4 int8 codes in one register ($4) -> bits of 2**23 + 128 + code for each ($0..$3): the sign bits flipped, then a
# byte permute of each under the exponent byte 0x4B.
_DECODE_BYTES_ASM = tl.constexpr("""{
        .reg .b32 x, e;
        xor.b32 x, $4, 0x80808080;
        mov.b32 e, 0x4B;
        prmt.b32 $0, x, e, 0x4550;
        prmt.b32 $1, x, e, 0x4551;
        prmt.b32 $2, x, e, 0x4552;
        prmt.b32 $3, x, e, 0x4553;
        }""")


@triton.jit
def _ptx_decode_bytes(b):
    """int8 codes -> bits of 2**23 + 128 + code (int32): sign flip, then a byte permute under the exponent."""
    return tl.inline_asm_elementwise(
        asm=_DECODE_BYTES_ASM,
        constraints="=r,=r,=r,=r,r", args=[b], dtype=tl.int32, is_pure=True, pack=4)


# 8 int4 codes in one register ($8) -> bits of 2**23 + 8 + code: the low nibbles of bytes 0..3 in $0..$3, the high
# ones in $4..$7.
_DECODE_NIBBLES_ASM = tl.constexpr("""{
        .reg .b32 x, ev, od, e;
        xor.b32 x, $8, 0x88888888;
        and.b32 ev, x, 0x0F0F0F0F;
        shr.b32 od, x, 4;
        and.b32 od, od, 0x0F0F0F0F;
        mov.b32 e, 0x4B;
        prmt.b32 $0, ev, e, 0x4550;
        prmt.b32 $1, ev, e, 0x4551;
        prmt.b32 $2, ev, e, 0x4552;
        prmt.b32 $3, ev, e, 0x4553;
        prmt.b32 $4, od, e, 0x4550;
        prmt.b32 $5, od, e, 0x4551;
        prmt.b32 $6, od, e, 0x4552;
        prmt.b32 $7, od, e, 0x4553;
        }""")


@triton.jit
def _ptx_decode_nibbles(b):
    """uint8 bytes of two int4 codes -> (low, high) bits of 2**23 + 8 + code (int32 each)."""
    return tl.inline_asm_elementwise(
        asm=_DECODE_NIBBLES_ASM,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[b], dtype=(tl.int32, tl.int32), is_pure=True, pack=4)


@triton.jit
def _ptx_widen_bf16(bits):
    """bf16 bits (int16) -> fp32, two per register: the low half shifted up, the high half masked."""
    return tl.inline_asm_elementwise(
        asm="""{
        shl.b32 $0, $2, 16;
        and.b32 $1, $2, 0xFFFF0000;
        }""",
        constraints="=r,=r,r", args=[bits], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _decode_slab(p_ptr, r, a, rmask, R: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr, PTX: tl.constexpr):
    """fp32 codes [R, 8] of slab ``a`` of rows ``r`` (B elements each) from a payload row at ``p_ptr``.

    The code's two's complement, sign bit flipped, goes under the exponent of 2**23: no int->float convert.
    """
    if BITS == 8:
        col = (a * 8 + tl.arange(0, 8))[None, :]
        b = tl.load(p_ptr + (r[:, None] * B + col), mask=rmask[:, None] & (col >= 0), other=0)
        if PTX:
            mb = _ptx_decode_bytes(b)
        else:
            # (b ^ 0x80) | 0x4B000000 as one XOR: the zero-extended byte does not reach the exponent bits
            mb = b.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x4B000080
        c = mb.to(tl.float32, bitcast=True) - 8388736.0  # 2**23 + 128
    else:
        col = (a * 4 + tl.arange(0, 4))[None, :]
        b = tl.load(p_ptr + (r[:, None] * (B // 2) + col), mask=rmask[:, None] & (col >= 0), other=0)
        if PTX:
            lb, hb = _ptx_decode_nibbles(b)
        else:
            lb = (b.to(tl.int32) & 0xF) ^ 0x4B000008
            hb = (b.to(tl.int32) >> 4) ^ 0x4B000008
        lo = lb.to(tl.float32, bitcast=True) - 8388616.0  # 2**23 + 8
        hi = hb.to(tl.float32, bitcast=True) - 8388616.0
        c = tl.reshape(tl.join(lo, hi), [R, 8])  # element 2i: the low nibble
    return c


@triton.jit
def _fold_chunk(codes, s, acc, A: tl.constexpr, FIRST: tl.constexpr):
    """One chunk folded into the sum, slab by slab (tuples of A [R, 8] slabs, ``s`` [R, 1]): ``codes * s`` for
    the first chunk, ``fma(codes, s, acc)`` for the others (reference.dequant_sum)."""
    out = ()
    for a in tl.static_range(A):
        if FIRST:
            out = out + (codes[a] * s,)
        else:
            out = out + (tl.fma(codes[a], s, acc[a]),)
    return out


@triton.jit
def _chunk_into(acc, p_ptr, s_ptr, sg, r, rmask, R: tl.constexpr, A: tl.constexpr, IN_BITS: tl.constexpr,
                PTX_DECODE: tl.constexpr, FIRST: tl.constexpr):
    """A chunk's rows folded into ``acc`` (_fold_chunk); ``sg``: each row's scale index."""
    s = tl.load(s_ptr + sg, mask=rmask, other=0.0)[:, None]
    codes = ()
    for a in tl.static_range(A):
        codes = codes + (_decode_slab(p_ptr, r, a, rmask, R, A * 8, IN_BITS, PTX_DECODE),)
    return _fold_chunk(codes, s, acc, A, FIRST)


@triton.jit
def _dequant_sum_rows(p_ptr, p_stride, s_ptr, s_stride, k, blk0, r, rmask, R: tl.constexpr, A: tl.constexpr,
                      IN_GS: tl.constexpr, IN_BITS: tl.constexpr, PTX_DECODE: tl.constexpr, K: tl.constexpr):
    """Rows ``blk0 + r`` of the fp32 chunk sum (reference.dequant_sum) over k chunks, as a tuple of A [R, 8] slabs.

    Row i covers chunk elements ``i*B .. i*B + B-1`` (B = 8A divides IN_GS); rows outside ``rmask`` are 0.
    K > 0: k == K is a compile-time count and the chunk loop is unrolled, so that every chunk's loads can be in
    flight at once; K == 0: a loop over the run-time k.
    """
    B: tl.constexpr = A * 8
    p_ptr += blk0 * (B * IN_BITS // 8)
    sg = (blk0 + r) * B // IN_GS  # each row's input scale
    acc = _chunk_into((), p_ptr, s_ptr, sg, r, rmask, R, A, IN_BITS, PTX_DECODE, True)
    # the row pointers advance step by step: no 32-bit j * stride product that could overflow
    if K > 0:
        for _ in tl.static_range(1, K):
            p_ptr += p_stride
            s_ptr += s_stride
            acc = _chunk_into(acc, p_ptr, s_ptr, sg, r, rmask, R, A, IN_BITS, PTX_DECODE, False)
    else:
        for _ in range(1, k):
            p_ptr += p_stride
            s_ptr += s_stride
            acc = _chunk_into(acc, p_ptr, s_ptr, sg, r, rmask, R, A, IN_BITS, PTX_DECODE, False)
    return acc


@triton.jit(do_not_specialize=_ROWS_NO_SPEC)
def _hadamard_quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, nrows, rows, cols, seg, key, offset, ubits,
                                   A: tl.constexpr, LOG_A: tl.constexpr, R: tl.constexpr, GB: tl.constexpr,
                                   BITS: tl.constexpr, QMAX: tl.constexpr, HAD: tl.constexpr,
                                   SWIZZLE: tl.constexpr, STOCH: tl.constexpr, ALIGNED: tl.constexpr,
                                   IN_KIND: tl.constexpr):
    """Op 1 on R rows of B = 8A output elements per program (see the section comment)."""
    B: tl.constexpr = A * 8
    pid = tl.program_id(0)
    blk0 = pid.to(tl.int64) * R
    r = tl.arange(0, R)
    rmask = blk0 + r < nrows
    if SWIZZLE:
        # output [cols, rows, seg] from input [rows, cols, seg]; B divides seg: a row never straddles segments
        o0 = (blk0 + r) * B
        q = o0 // seg
        c = q // rows
        src = tl.multiple_of((q - c * rows) * cols * seg + c * seg + (o0 - q * seg), 8)
        xp = x_ptr + src[:, None]
    else:
        xp = x_ptr + blk0 * B + (r * B)[:, None]
    col = tl.arange(0, 8)[None, :]
    mask = rmask[:, None] & (col >= 0)
    xs = ()
    for a in tl.static_range(A):
        if IN_KIND == 2 and _PTX_WIDEN:
            xs = xs + (_ptx_widen_bf16(tl.load(xp + (col + a * 8), mask=mask, other=0)),)
        else:
            xs = xs + (_load_f32(xp + (col + a * 8), mask, IN_KIND),)
    if HAD:
        xs = _butterfly_rows(xs, R, A, LOG_A)
    _quantize_store_rows(xs, out_ptr + blk0 * (B * BITS // 8), scale_ptr, pid, blk0, r, rmask, nrows, key,
                         offset, ubits, R, A, GB, BITS, QMAX, STOCH, ALIGNED)


@triton.jit
def _load_rows_words(p_ptr, p_stride, s_ptr, s_stride, blk0, r, rmask, R: tl.constexpr, A: tl.constexpr,
                     IN_GS: tl.constexpr, IN_BITS: tl.constexpr, K: tl.constexpr):
    """The codes (as int32 words: loop-carried bytes would take a register each) and the scales of rows
    ``blk0 + r`` of all K chunks: a tuple over chunks of (tuple of A [R, W] word slabs, W = IN_BITS // 4, and
    [R, 1] scales); rows outside ``rmask`` load zeros.  ``p_ptr``/``p_stride`` in int32 words."""
    B: tl.constexpr = A * 8
    W: tl.constexpr = IN_BITS // 4  # words per slab of 8 codes
    p_ptr += blk0 * (A * W)
    sg = (blk0 + r) * B // IN_GS
    col = tl.arange(0, W)[None, :]
    mask = rmask[:, None] & (col >= 0)
    out = ()
    for _ in tl.static_range(K):
        words = ()
        for a in tl.static_range(A):
            words = words + (tl.load(p_ptr + (r[:, None] * (A * W) + a * W + col), mask=mask, other=0),)
        out = out + ((words, tl.load(s_ptr + sg, mask=rmask, other=0.0)[:, None]),)
        p_ptr += p_stride
        s_ptr += s_stride
    return out


@triton.jit
def _tile_words(p_ptr, p_stride, s_ptr, s_stride, tile, r, in_rows, R: tl.constexpr, A: tl.constexpr,
                IN_GS: tl.constexpr, IN_BITS: tl.constexpr, K: tl.constexpr):
    """_load_rows_words of tile ``tile`` (rows ``tile * R + r``; rows at and past ``in_rows`` load zeros, so does a
    tile past the end)."""
    blk = tile.to(tl.int64) * R
    return _load_rows_words(p_ptr, p_stride, s_ptr, s_stride, blk, r, blk + r < in_rows, R, A, IN_GS, IN_BITS, K)


@triton.jit
def _decode_words(w, R: tl.constexpr, BITS: tl.constexpr, PTX: tl.constexpr):
    """fp32 codes [R, 8] of a slab of code words: [R, 2] (8-bit: byte i of word j is element 4j + i) or [R, 1]
    (4-bit: the low nibble of byte i is element 2i, the high one 2i + 1)."""
    if BITS == 8:
        if PTX:
            b0, b1, b2, b3 = _ptx_decode_word(w)
        else:
            x = w ^ -0x7F7F7F80  # 0x80808080: flip each code's sign bit
            b0 = (x & 0xFF) | 0x4B000000
            b1 = ((x >> 8) & 0xFF) | 0x4B000000
            b2 = ((x >> 16) & 0xFF) | 0x4B000000
            b3 = ((x >> 24) & 0xFF) | 0x4B000000
        even = tl.reshape(tl.join(b0, b2), [R, 4])  # elements 0, 2, 4, 6
        odd = tl.reshape(tl.join(b1, b3), [R, 4])
        c = tl.reshape(tl.join(even, odd), [R, 8])
        return c.to(tl.float32, bitcast=True) - 8388736.0  # 2**23 + 128
    else:
        if PTX:
            l0, l1, l2, l3, h0, h1, h2, h3 = _ptx_decode_word_nibbles(w)
        else:
            x = w ^ -0x77777778  # 0x88888888: flip each code's sign bit
            l0 = (x & 0xF) | 0x4B000000
            h0 = ((x >> 4) & 0xF) | 0x4B000000
            l1 = ((x >> 8) & 0xF) | 0x4B000000
            h1 = ((x >> 12) & 0xF) | 0x4B000000
            l2 = ((x >> 16) & 0xF) | 0x4B000000
            h2 = ((x >> 20) & 0xF) | 0x4B000000
            l3 = ((x >> 24) & 0xF) | 0x4B000000
            h3 = ((x >> 28) & 0xF) | 0x4B000000
        # nibble n of byte i = 2 b1 + b0 is element 4 b1 + 2 b0 + n.  Each join adds the fastest axis, so the
        # slowest index is joined first: over b1, then b0, then n -> [R, 1, 2, 2, 2] in (b1, b0, n) order.
        y0 = tl.join(tl.join(l0, l2), tl.join(l1, l3))
        y1 = tl.join(tl.join(h0, h2), tl.join(h1, h3))
        c = tl.reshape(tl.join(y0, y1), [R, 8])
        return c.to(tl.float32, bitcast=True) - 8388616.0  # 2**23 + 8


@triton.jit
def _ptx_decode_word(w):
    """int32 words of 4 int8 codes -> bits of 2**23 + 128 + code for each byte (4 int32 outputs, byte i in the
    i-th): the asm of _ptx_decode_bytes, one word per instance."""
    return tl.inline_asm_elementwise(
        asm=_DECODE_BYTES_ASM,
        constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
        pack=1)


@triton.jit
def _ptx_decode_word_nibbles(w):
    """int32 words of 8 int4 codes -> bits of 2**23 + 8 + code: the low nibbles of bytes 0..3, then the high ones
    (8 int32 outputs): the asm of _ptx_decode_nibbles, one word per instance."""
    return tl.inline_asm_elementwise(
        asm=_DECODE_NIBBLES_ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[w],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _sum_rows_words(raw, R: tl.constexpr, A: tl.constexpr, IN_BITS: tl.constexpr, PTX: tl.constexpr,
                    K: tl.constexpr):
    """The fp32 chunk sum (tuple of A [R, 8] slabs) of codes loaded by _load_rows_words (reference.dequant_sum)."""
    acc = ()
    for j in tl.static_range(K):
        codes = ()
        for a in tl.static_range(A):
            codes = codes + (_decode_words(raw[j][0][a], R, IN_BITS, PTX),)
        acc = _fold_chunk(codes, raw[j][1], acc, A, j == 0)
    return acc


@triton.jit(do_not_specialize=_ROWS_NO_SPEC)
def _dequant_sum_requant_persistent_kernel(p_ptr, p_stride, s_ptr, s_stride, in_rows, out_ptr, oscale_ptr, nrows,
                                           ntiles, key, offset, ubits, A: tl.constexpr, R: tl.constexpr,
                                           GB: tl.constexpr, IN_GS: tl.constexpr, IN_BITS: tl.constexpr,
                                           BITS: tl.constexpr, QMAX: tl.constexpr, STOCH: tl.constexpr,
                                           ALIGNED: tl.constexpr, K: tl.constexpr):
    """Op 2 over tiles of R rows, a program per few tiles: the next tile's codes load while this one computes."""
    B: tl.constexpr = A * 8
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, R)
    tile = pid
    raw = _tile_words(p_ptr, p_stride, s_ptr, s_stride, tile, r, in_rows, R, A, IN_GS, IN_BITS, K)
    while tile < ntiles:
        nxt = tile + nprog
        raw_next = _tile_words(p_ptr, p_stride, s_ptr, s_stride, nxt, r, in_rows, R, A, IN_GS, IN_BITS, K)
        blk0 = tile.to(tl.int64) * R
        xs = _sum_rows_words(raw, R, A, IN_BITS, _PTX_DECODE, K)
        _quantize_store_rows(xs, out_ptr + blk0 * (B * BITS // 8), oscale_ptr, tile, blk0, r, blk0 + r < nrows,
                             nrows, key, offset, ubits, R, A, GB, BITS, QMAX, STOCH, ALIGNED)
        raw = raw_next
        tile = nxt


@triton.jit(do_not_specialize=_ROWS_NO_SPEC)
def _dequant_sum_requant_rows_kernel(p_ptr, p_stride, s_ptr, s_stride, k, in_rows, out_ptr, oscale_ptr, nrows,
                                     key, offset, ubits, A: tl.constexpr, R: tl.constexpr, GB: tl.constexpr,
                                     IN_GS: tl.constexpr, IN_BITS: tl.constexpr, BITS: tl.constexpr,
                                     QMAX: tl.constexpr, STOCH: tl.constexpr, ALIGNED: tl.constexpr,
                                     K: tl.constexpr):
    """Op 2 on R rows of B = 8A elements per program; rows at and past ``in_rows`` are the zero padding."""
    B: tl.constexpr = A * 8
    pid = tl.program_id(0)
    blk0 = pid.to(tl.int64) * R
    r = tl.arange(0, R)
    xs = _dequant_sum_rows(p_ptr, p_stride, s_ptr, s_stride, k, blk0, r, blk0 + r < in_rows, R, A, IN_GS,
                           IN_BITS, _PTX_DECODE, K)
    _quantize_store_rows(xs, out_ptr + blk0 * (B * BITS // 8), oscale_ptr, pid, blk0, r, blk0 + r < nrows,
                         nrows, key, offset, ubits, R, A, GB, BITS, QMAX, STOCH, ALIGNED)


@triton.jit
def _dequant_sum_inverse_hadamard_rows_kernel(p_ptr, p_stride, s_ptr, s_stride, k, nrows, out_ptr, factor,
                                              A: tl.constexpr, LOG_A: tl.constexpr, R: tl.constexpr,
                                              IN_GS: tl.constexpr, IN_BITS: tl.constexpr, HAD: tl.constexpr,
                                              OUT_KIND: tl.constexpr, PTX_DECODE: tl.constexpr):
    """Op 3 on R rows of B = 8A elements per program: sum, butterfly, * factor, cast, store."""
    B: tl.constexpr = A * 8
    blk0 = tl.program_id(0).to(tl.int64) * R
    r = tl.arange(0, R)
    rmask = blk0 + r < nrows
    # The run-time chunk loop (the unrolled one ran up to 2 points slower here), and the PTX decoding only from
    # ``_OP3_PTX_DECODE_MIN_K`` chunks on (see there).
    xs = _dequant_sum_rows(p_ptr, p_stride, s_ptr, s_stride, k, blk0, r, rmask, R, A, IN_GS, IN_BITS, PTX_DECODE,
                           0)
    if HAD:
        xs = _butterfly_rows(xs, R, A, LOG_A)
    col = tl.arange(0, 8)[None, :]
    op = out_ptr + blk0 * B + (r * B)[:, None]
    for a in tl.static_range(A):
        _store_from_f32(op + (col + a * 8), xs[a] * factor, rmask[:, None] & (col >= 0), OUT_KIND)


@triton.jit
def _dequant_sum_inverse_hadamard_persistent_kernel(p_ptr, p_stride, s_ptr, s_stride, nrows, ntiles, out_ptr,
                                                    factor, A: tl.constexpr, LOG_A: tl.constexpr, R: tl.constexpr,
                                                    IN_GS: tl.constexpr, IN_BITS: tl.constexpr, HAD: tl.constexpr,
                                                    OUT_KIND: tl.constexpr, PTX_DECODE: tl.constexpr,
                                                    K: tl.constexpr):
    """Op 3 over tiles of R rows, a program per few tiles: the next tile's codes load while this one computes (as
    _dequant_sum_requant_persistent_kernel)."""
    B: tl.constexpr = A * 8
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, R)
    col = tl.arange(0, 8)[None, :]
    tile = pid
    raw = _tile_words(p_ptr, p_stride, s_ptr, s_stride, tile, r, nrows, R, A, IN_GS, IN_BITS, K)
    while tile < ntiles:
        nxt = tile + nprog
        raw_next = _tile_words(p_ptr, p_stride, s_ptr, s_stride, nxt, r, nrows, R, A, IN_GS, IN_BITS, K)
        blk0 = tile.to(tl.int64) * R
        xs = _sum_rows_words(raw, R, A, IN_BITS, PTX_DECODE, K)
        if HAD:
            xs = _butterfly_rows(xs, R, A, LOG_A)
        op = out_ptr + blk0 * B + (r * B)[:, None]
        smask = (blk0 + r < nrows)[:, None] & (col >= 0)
        for a in tl.static_range(A):
            _store_from_f32(op + (col + a * 8), xs[a] * factor, smask, OUT_KIND)
        raw = raw_next
        tile = nxt


def is_interpreted() -> bool:
    """True when the kernels were decorated under ``TRITON_INTERPRET=1`` (they then also run on CPU)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - layout of older/newer triton
        return type(_dequant_add_kernel).__name__ == "InterpretedFunction"
    return isinstance(_dequant_add_kernel, InterpretedFunction)


_INTERPRETED = is_interpreted()
# Compiled kernels narrow fp32 to bf16 with the GPU's own round-to-nearest-even conversion (one instruction
# per two values); the interpreter's cast truncates, so there the rounding is done with integers.  (Read by
# ``_store_from_f32`` when a kernel compiles or, interpreted, runs: defining it here, after the kernels, is fine.)
_NATIVE_BF16 = tl.constexpr(not _INTERPRETED)
# Inline PTX in the row kernels (see ``_ptx_floor_bits``): compiled kernels on NVIDIA GPUs only.
# SDP4BIT_TRITON_PTX=0 (read at import) keeps the plain Triton code there too: a fallback should a Triton
# release mishandle inline asm, and the A/B switch of the benchmarks.
_PTX = tl.constexpr(not _INTERPRETED and torch.version.hip is None
                    and os.environ.get("SDP4BIT_TRITON_PTX", "1") != "0")
# Each PTX step on its own (benchmarks/ab_triton_ptx.py at a66b8a4 switches them off one at a time):
_PTX_ROUND = _PTX  # round-down adds and code packing (ops 1, 2)
_PTX_DECODE = _PTX  # code decoding (op 2; op 3 from _OP3_PTX_DECODE_MIN_K chunks on)
_PTX_WIDEN = _PTX  # bf16 widening (op 1)
# Op 3 with the PTX decoding, at 512 MiB on an H200: k = 2 chunks 69% of copy bandwidth against 82% with the plain
# code (the SASS has fewer instructions; the cause was not found), but k = 3 83% against 78%, k = 4 81% against 74%
# and k = 8 76% against 67% (benchmarks/results/kernels_h200_op3_ptx_*.txt at a66b8a4).  So op 3 decodes with PTX from 3
# chunks (nodes) on.
_OP3_PTX_DECODE_MIN_K = 3


# ----------------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------------
# Elements per program.  On GPUs a few groups per program keep registers modest and the grid large; under
# the interpreter every program costs a fixed Python overhead per instruction, so one program covers as
# much as possible (numpy then does the work in bulk).
_GPU_TILE = 4096
_INTERP_TILE = 1 << 15
# Op 6's tiles under the interpreter: a program per tile, so small ones keep the tests' many short segments
# cheap (on GPUs op 6 uses _GPU_TILE, = segments.GPU_TILE, whose table the plan builds up front).
_SEG_INTERP_TILE = 1 << 10


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _groups_per_program(group_size: int, ngroups: int) -> Tuple[int, int]:
    """(BLOCK_G, GPP) for a grouped kernel: BLOCK_G = pow2 >= group_size, GPP groups per program."""
    block_g = _pow2_at_least(max(group_size, 2))
    if _INTERPRETED:
        gpp = min(max(1, _INTERP_TILE // block_g), _pow2_at_least(ngroups))
    else:
        gpp = max(1, _GPU_TILE // block_g)
    return block_g, gpp


def _elements_per_program(n: int, min_block: int = 1) -> int:
    tile = min(_INTERP_TILE, _pow2_at_least(n)) if _INTERPRETED else _GPU_TILE
    return max(tile, _pow2_at_least(min_block))


def _num_warps(tile_elems: int) -> int:
    return 4 if tile_elems <= 2048 else 8


# The row kernels hold a whole row (B fp32 values) in one thread's registers: B = 64 at most.
_ROWS_MAX_B = 64
# Rows per program on GPUs (one per thread: 2 warps), unless a group needs more.  On an H200, 64 rows ran ops 1
# and 3 0.2-1.5 points of copy bandwidth faster than 128 and tied for op 2; 256 lost up to 7 points in op 1
# (benchmarks/results/tiles/ and benchmarks/sweep_tiles.py at a66b8a4).
_GPU_ROWS = 64


def _rows_plan(b: int, group_size: int, nrows: int) -> Optional[Tuple[int, int, int]]:
    """``(R, GB, num_warps)`` for the row kernels with rows of ``b`` elements, or None when they do not apply.

    A group must be a power-of-two number GB of rows, and a program holds whole groups: R rows, one per thread
    on GPUs (``_GPU_ROWS`` rows, more when a group is larger, up to 256 = 8 warps; never fewer than the 32
    threads of a warp, so that a thread holds whole rows whatever the input size, which the inline PTX's packed
    operands need: at least 4 elements per thread).
    """
    if b > _ROWS_MAX_B or group_size % b:
        return None
    gb = group_size // b
    if gb & (gb - 1):
        return None
    if _INTERPRETED:
        rows = max(gb, min(_pow2_at_least(nrows), max(1, _INTERP_TILE // b)))
        return rows, gb, 4
    rows = max(gb, 32, min(_pow2_at_least(nrows), _GPU_ROWS))
    if rows > 256:
        return None
    return rows, gb, max(1, rows // 32)


# Op 2's row kernel unrolls the loop over the k received chunks (the GPUs of a node) when k is at most this: one
# compiled kernel per k, with every chunk's loads issued before the sums; on an H200 that ran op 2 3-5 points of
# copy bandwidth faster for k = 2..8, while op 3 (k = nodes) ran up to 2 points slower and keeps the run-time loop
# (benchmarks/results/triton_unroll/ at a66b8a4).  False: the run-time loop for every k (an A/B switch of
# benchmarks/ab_triton_ptx.py at a66b8a4).
_UNROLL_CHUNKS = True
_MAX_UNROLLED_CHUNKS = 8


# Op 2's rows are 64 elements long for up to this many chunks (where both group sizes are multiples of 64), else
# 32.  Rows of 64 spread a thread's fixed work (group scale, addresses) over twice the elements: 22.4 instead of
# 25.7 SASS instructions per element at k = 2 (sm_90; 96 registers instead of 56), and on an H200 op 2 at k = 2
# ran 72.7% instead of 68.1% of copy at 512 MiB (69.5 vs 66.2 at 128, 65.2 vs 64.9 at 64 MiB).  With more chunks
# the registers run out (127 at k = 4) and rows of 64 lost: 78.3 vs 83.5% at k = 4, 82.0 vs 92.4% at k = 8
# (benchmarks/results/triton_op2_rows/ at a66b8a4).
_OP2_ROW64_MAX_K = 2


def _op2_row(k: int, group_size: int, out_group_size: int) -> int:
    """Op 2's row length for k chunks and these group sizes."""
    return 64 if k <= _OP2_ROW64_MAX_K and group_size % 64 == 0 and out_group_size % 64 == 0 else 32


# Op 2 with 8-bit input and k in _OP2_PERSIST_KS as a persistent kernel: 8 programs per SM (all resident at its
# 128 registers), each looping over tiles and loading the next tile while it computes this one.  With one program
# per tile, a launch of a few waves loads everything first and computes last; the loop overlaps the two.  On an
# H200 at k = 4 it ran 78.5 / 82.5 / 84.5% of copy at 64 / 128 / 512 MiB instead of 74 / 78-79 / 83; at k = 2 and 3
# it was up to 3 points slower (rows of 64 at k = 2: 128 registers) or even, so those keep one program per tile
# (benchmarks/results/triton_op2_persist/ at a66b8a4).  k = 8 needed 255 registers until chunk sums were fused (one FMA per
# chunk): now 128, and the persistent kernel ran 82.5 / 97.9% of copy at 64 / 512 MiB instead of 79.0 / 95.6,
# while k = 3 went from 73.5 / 81.7 to 75.1 / 78.5 and stays as it was; k = 5 went from 82.2 / 96.3 to 85.8 / 97.1,
# but k = 6 and 7 fell from 80-81 / 95-98 to 69-75 / 84-85 and keep one program per tile (benchmarks/results/
# fma_sum/ at a66b8a4).  (Compiled for sm_90, k = 5..7 take 167-168 registers where 4 and 8 take 128: only 6 of the 8
# programs per SM are resident; capped at 128, 6 and 7 spill.)  Under the interpreter a few programs, so that the
# loop runs.
_OP2_PERSIST = True
_OP2_PERSIST_KS = (4, 5, 8)
_PERSIST_PROGRAMS_PER_SM = 8
# Op 3 the same way for 3..8 chunks (80 registers at k = 4, 128 at k = 8: 8 programs of 2 warps fit an SM).  On an
# H200 at 64 / 128 / 512 MiB it ran k = 3 at 86.8 / 87.4 / 87.8% of copy instead of 78.9 / 82.3 / 84.3, k = 4 at
# 89.4 / 89.6 / 90.4 instead of 76.2 / 79.5 / 82.2, and k = 8 at 78.9 / 83.1 / 84.6 instead of 68.0 / 73.0 / 76.7;
# k = 2 was level or up to a point slower and keeps one program per tile; k = 5..7 were not measured (between
# the gains at 4 and 8).  (benchmarks/results/triton_op3_persist/ at a66b8a4)
_OP3_PERSIST = True
_OP3_PERSIST_KS = (3, 4, 5, 6, 7, 8)
_PERSIST_PROGRAMS = 3 if _INTERPRETED else 0  # > 0: this many programs (tests set it to loop on GPUs too)
_SM_COUNT = {}


def _persistent_programs(device: torch.device) -> int:
    if _PERSIST_PROGRAMS > 0:
        return _PERSIST_PROGRAMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx] * _PERSIST_PROGRAMS_PER_SM


def _persistent_grid(ntiles: int, payloads: torch.Tensor) -> int:
    """Programs for a persistent kernel over ``ntiles`` tiles of the chunks ``payloads``, or 0 where it does not
    apply: the chunk rows must read as int32 words, and each program must loop at least twice (with one tile
    each there is nothing to overlap)."""
    if payloads.data_ptr() % 4 or payloads.stride(0) % 4:
        return 0
    nprog = _persistent_programs(payloads.device)
    return nprog if 2 * nprog <= ntiles else 0


def _unrolled_chunks(k: int) -> int:
    """Op 2's row kernel: the compile-time chunk count K for k chunks, 0 for the run-time loop."""
    return int(k) if _UNROLL_CHUNKS and 1 <= k <= _MAX_UNROLLED_CHUNKS else 0


def _pairs_fit(stoch: bool, offset: int, count: int) -> bool:
    """Whether the row kernels' pair hashing applies: an even offset and every pair index below 2**32."""
    return not stoch or (offset % 2 == 0 and 0 <= offset and offset + count <= (1 << 33))


# enable_reflect_ftz=False (NVIDIA option): libdevice functions (floor) without flush-to-zero, so subnormals
# behave as in torch.  Other backends do not know the option, so it is only passed for CUDA builds.
_EXTRA_OPTIONS = {"enable_reflect_ftz": False} if torch.version.hip is None else {}


def _launch(kernel, grid, *args, tile_elems: int = 0, num_warps: Optional[int] = None, **const):
    # enable_fp_fusion=False: a multiply and a following add stay two roundings unless tl.fma says otherwise
    kernel[grid](*args, **const, num_warps=num_warps or _num_warps(tile_elems), enable_fp_fusion=False,
                 **_EXTRA_OPTIONS)


# ----------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------
def _check_device(device: torch.device, **tensors) -> None:
    if device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError("the triton backend runs CPU tensors only under TRITON_INTERPRET=1 "
                           "(set before deepspeed_sdp4bit.kernels.triton_backend is imported)")
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")


def _log_hadamard(hadamard_size: Optional[int]) -> int:
    if not hadamard_size:
        return 0
    R._check_hadamard_size(hadamard_size)
    return int(hadamard_size).bit_length() - 1


def _key_i32(key: Optional[int]) -> int:
    """The uint32 key as a signed int32 bit pattern (one kernel argument type whatever the value)."""
    k = int(key or 0) & 0xFFFFFFFF
    return k - (1 << 32) if k >= (1 << 31) else k


def _need_hi(offset: int, count: int) -> bool:
    """Whether a counter in [offset, offset + count) may have a pair index with high bits (a superset test)."""
    return offset < 0 or offset + count > (1 << 32)


def _code_view(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat payload as the kernels address it: int8 codes for bits=8, packed uint8 for bits=4."""
    flat = payload.view(-1)
    return flat.view(torch.int8) if bits == 8 else flat


def _float_view(t: torch.Tensor) -> torch.Tensor:
    """Flat float tensor as the kernels address it (bf16 through an int16 view, see ``_load_f32``)."""
    flat = t.view(-1)
    return flat.view(torch.int16) if t.dtype == torch.bfloat16 else flat


# ----------------------------------------------------------------------------------------------------------
# the six ops
# ----------------------------------------------------------------------------------------------------------
def hadamard_quantize(x: torch.Tensor, bits: int, group_size: int, hadamard_size: Optional[int],
                      rounding: str = "nearest", key: Optional[int] = None, offset: int = 0,
                      swizzle: Optional[Tuple[int, int]] = None, out: Optional[torch.Tensor] = None,
                      out_scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 1 (see ``reference.hadamard_quantize``): optional swizzle and block Hadamard, group quantize.

    Args:
        x: [n] (read flat) float32/float16/bfloat16, n a multiple of ``group_size`` (and of rows*cols when
           ``swizzle=(rows, cols)``); ``group_size`` a multiple of ``hadamard_size`` (None/0: no transform).
        out: optional uint8 [n*bits/8]; out_scales: optional float32 [n/group_size].
    Returns:
        payload uint8 [n*bits/8], scales float32 [n/group_size] (``out``/``out_scales`` when given).
    """
    log_h = _log_hadamard(hadamard_size)
    qmax, stoch, rows, cols = quantize_plan(x, bits, group_size, hadamard_size, rounding, key, swizzle)
    n = x.numel()
    if swizzle is None:
        rows = cols = 1
    seg = n // (rows * cols)
    device = x.device
    _check_device(device, out=out, out_scales=out_scales)
    ngroups = n // group_size
    payload = buffer(out, n * bits // 8, torch.uint8, device, "out")
    scales = buffer(out_scales, ngroups, torch.float32, device, "out_scales")
    if ngroups == 0:
        return payload, scales
    xf = _float_view(x.reshape(-1).contiguous())
    b = hadamard_size if log_h else 32
    nrows = n // b
    plan = (_rows_plan(b, group_size, nrows) if (swizzle is None or seg % b == 0) and _pairs_fit(stoch, int(offset), n)
            else None)
    if plan is not None:
        rows_pp, gb, nw = plan
        _launch(_hadamard_quantize_rows_kernel, (triton.cdiv(nrows, rows_pp),),
                xf, _code_view(payload, bits), scales.view(-1), nrows, rows, cols, seg, _key_i32(key), int(offset),
                _UBITS, num_warps=nw, A=b // 8, LOG_A=(b // 8).bit_length() - 1, R=rows_pp, GB=gb, BITS=bits, QMAX=qmax,
                HAD=bool(log_h), SWIZZLE=swizzle is not None, STOCH=stoch, ALIGNED=stoch and int(offset) % b == 0,
                IN_KIND=_KIND[x.dtype])
        return payload, scales
    block_g, gpp = _groups_per_program(group_size, ngroups)
    if log_h:
        # the butterfly reshapes the flat tile into blocks of h: the tile must hold whole blocks
        block_g = max(block_g, hadamard_size)
    _launch(_hadamard_quantize_kernel, (triton.cdiv(ngroups, gpp),),
            xf, _code_view(payload, bits), scales.view(-1), ngroups, rows, cols, seg,
            _key_i32(key), int(offset), tile_elems=gpp * block_g,
            GS=group_size, BLOCK_G=block_g, GPP=gpp, BITS=bits, QMAX=qmax, LOG_H=log_h,
            SWIZZLE=0 if swizzle is None else (2 if seg % group_size == 0 else 1), STOCH=stoch,
            NEED_HI=stoch and _need_hi(int(offset), n),
            IN_KIND=_KIND[x.dtype])
    return payload, scales


def dequant_sum_requant(payloads: torch.Tensor, scales: torch.Tensor, in_bits: int, out_bits: int,
                        group_size: int, rounding: str = "nearest", key: Optional[int] = None,
                        offset: int = 0, out_group_size: Optional[int] = None,
                        out: Optional[torch.Tensor] = None, out_scales: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 2 (see ``reference.dequant_sum_requant``): dequantize k chunks, fp32 sum in order, requantize.

    Args:
        payloads: uint8 [k, m*in_bits/8]; scales: float32 [k, m/group_size].
        out_group_size: output group size (default ``group_size``); m is zero-padded to a multiple of it.
        out: optional uint8 [m_pad*out_bits/8]; out_scales: optional float32 [m_pad/out_group_size].
    Returns: payload uint8 [m_pad*out_bits/8], scales float32 [m_pad/out_group_size].
    """
    payloads, scales, k, m, ogs, m_pad, stoch = requant_plan(payloads, scales, in_bits, out_bits, group_size,
                                                             rounding, key, out_group_size)
    qmax = R.qmax_for_bits(out_bits)
    device = payloads.device
    _check_device(device, scales=scales, out=out, out_scales=out_scales)
    ngroups = m_pad // ogs
    payload = buffer(out, m_pad * out_bits // 8, torch.uint8, device, "out")
    oscales = buffer(out_scales, ngroups, torch.float32, device, "out_scales")
    if ngroups == 0:
        return payload, oscales
    in_view = payloads.view(torch.int8) if in_bits == 8 else payloads
    b = _op2_row(k, group_size, ogs)
    plan = (_rows_plan(b, ogs, m_pad // b) if group_size % b == 0 and _pairs_fit(stoch, int(offset), m_pad)
            else None)
    if plan is not None:
        rows_pp, gb, nw = plan
        kk = _unrolled_chunks(k)
        ntiles = triton.cdiv(m_pad // b, rows_pp)
        nprog = _persistent_grid(ntiles, payloads) if _OP2_PERSIST and in_bits == 8 and kk in _OP2_PERSIST_KS else 0
        if nprog:
            words = payloads.view(torch.int32)
            _launch(_dequant_sum_requant_persistent_kernel, (nprog,),
                    words, words.stride(0), scales, scales.stride(0), m // b, _code_view(payload, out_bits),
                    oscales.view(-1), m_pad // b, ntiles, _key_i32(key), int(offset), _UBITS, num_warps=nw,
                    A=b // 8, R=rows_pp, GB=gb, IN_GS=group_size, IN_BITS=in_bits, BITS=out_bits,
                    QMAX=qmax, STOCH=stoch, ALIGNED=stoch and int(offset) % b == 0, K=kk)
            return payload, oscales
        _launch(_dequant_sum_requant_rows_kernel, (ntiles,),
                in_view, payloads.stride(0), scales, scales.stride(0), k, m // b, _code_view(payload, out_bits),
                oscales.view(-1), m_pad // b, _key_i32(key), int(offset), _UBITS, num_warps=nw,
                A=b // 8, R=rows_pp, GB=gb, IN_GS=group_size, IN_BITS=in_bits, BITS=out_bits,
                QMAX=qmax, STOCH=stoch, ALIGNED=stoch and int(offset) % b == 0, K=kk)
        return payload, oscales
    block_g, gpp = _groups_per_program(ogs, ngroups)
    _launch(_dequant_sum_requant_kernel, (triton.cdiv(ngroups, gpp),),
            in_view, payloads.stride(0),
            scales, scales.stride(0), k, m, _code_view(payload, out_bits), oscales.view(-1), ngroups,
            _key_i32(key), int(offset), tile_elems=gpp * block_g,
            IN_GS=group_size, IN_BITS=in_bits, GS=ogs, BLOCK_G=block_g, GPP=gpp, BITS=out_bits, QMAX=qmax,
            STOCH=stoch, NEED_HI=stoch and _need_hi(int(offset), m_pad))
    return payload, oscales


def dequant_sum_inverse_hadamard(payloads: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                                 hadamard_size: Optional[int], out_dtype: torch.dtype = torch.float32,
                                 post_scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Op 3 (see ``reference.dequant_sum_inverse_hadamard``): dequantize + sum k chunks, inverse Hadamard.

    ``out = cast(butterfly(sum) * fp32(post_scale / hadamard_size))`` (no Hadamard: ``* fp32(post_scale)``).

    Args:
        payloads: uint8 [k, m*bits/8]; scales: float32 [k, m/group_size]; m a multiple of hadamard_size.
        out_dtype: float32/float16/bfloat16.  out: optional contiguous buffer of >= m elements; its dtype
            then replaces ``out_dtype`` and its first m elements are written (like the torch backend).
    Returns: ``out_dtype`` [m] (or ``out``).
    """
    log_h = _log_hadamard(hadamard_size)
    payloads, scales, k, m, res = inverse_plan(payloads, scales, bits, group_size, hadamard_size, out_dtype, out)
    _check_device(payloads.device, scales=scales)
    if m == 0:
        return res
    factor = post_scale / hadamard_size if log_h else post_scale
    factor32 = torch.tensor(factor, dtype=torch.float32).item()  # rounded once to fp32, then passed exactly
    in_view = payloads.view(torch.int8) if bits == 8 else payloads
    b = hadamard_size if log_h else 32
    plan = _rows_plan(b, group_size, m // b)  # b divides group_size, hence m, whenever a plan is returned
    if plan is not None:
        rows_pp, _, nw = plan
        ntiles = triton.cdiv(m // b, rows_pp)
        # (measured with 4-bit codes in rows of 32: the gradient path's inter-node level; 8-bit codes or rows of 64
        # double the words each thread carries)
        persist = _OP3_PERSIST and k in _OP3_PERSIST_KS and bits == 4 and b == 32
        nprog = _persistent_grid(ntiles, payloads) if persist else 0
        if nprog:
            words = payloads.view(torch.int32)
            _launch(_dequant_sum_inverse_hadamard_persistent_kernel, (nprog,),
                    words, words.stride(0), scales, scales.stride(0), m // b, ntiles, _float_view(res), factor32,
                    num_warps=nw, A=b // 8, LOG_A=(b // 8).bit_length() - 1, R=rows_pp, IN_GS=group_size,
                    IN_BITS=bits, HAD=bool(log_h), OUT_KIND=_KIND[res.dtype],
                    PTX_DECODE=bool(_PTX_DECODE) and k >= _OP3_PTX_DECODE_MIN_K, K=k)
            return res
        _launch(_dequant_sum_inverse_hadamard_rows_kernel, (ntiles,),
                in_view, payloads.stride(0), scales, scales.stride(0), k, m // b, _float_view(res), factor32,
                num_warps=nw, A=b // 8, LOG_A=(b // 8).bit_length() - 1, R=rows_pp, IN_GS=group_size,
                IN_BITS=bits, HAD=bool(log_h), OUT_KIND=_KIND[res.dtype],
                PTX_DECODE=bool(_PTX_DECODE) and k >= _OP3_PTX_DECODE_MIN_K)
        return res
    block = _elements_per_program(m, hadamard_size or 1)
    _launch(_dequant_sum_inverse_hadamard_kernel, (triton.cdiv(m, block),),
            in_view, payloads.stride(0),
            scales, scales.stride(0), k, m, _float_view(res), factor32, tile_elems=block,
            IN_GS=group_size, IN_BITS=bits, BLOCK=block, LOG_H=log_h, OUT_KIND=_KIND[res.dtype])
    return res


def weight_delta_quantize(master: torch.Tensor, replica: torch.Tensor, bits: int, group_size: int,
                          rounding: str = "nearest", key: Optional[int] = None, offset: int = 0,
                          mode: str = "diff", out: Optional[torch.Tensor] = None,
                          out_scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 4 (see ``reference.weight_delta_quantize``): quantize master - replica (or master), update replica.

    Args:
        master: [n] float32 (float16/bfloat16 accepted, widened exactly); replica: [n] contiguous
            float32/float16/bfloat16, updated in place to ``cast(float(replica) + deq)`` (``direct``:
            ``cast(deq)``).  n need not be a multiple of ``group_size`` (the last group is zero-padded).
        out: optional uint8 [n_pad*bits/8]; out_scales: optional float32 [n_pad/group_size].
    Returns: payload uint8 [n_pad*bits/8], scales float32 [n_pad/group_size].
    """
    qmax, stoch, diff, ngroups = weight_delta_plan(master, replica, bits, group_size, rounding, key, mode)
    device = replica.device
    _check_device(device, master=master, out=out, out_scales=out_scales)
    n = replica.numel()
    payload = buffer(out, ngroups * group_size * bits // 8, torch.uint8, device, "out")
    scales = buffer(out_scales, ngroups, torch.float32, device, "out_scales")
    if ngroups == 0:
        return payload, scales
    block_g, gpp = _groups_per_program(group_size, ngroups)
    _launch(_weight_delta_quantize_kernel, (triton.cdiv(ngroups, gpp),),
            _float_view(master.reshape(-1).contiguous()), _float_view(replica), _code_view(payload, bits),
            scales.view(-1), n, ngroups, _key_i32(key), int(offset), tile_elems=gpp * block_g,
            GS=group_size, BLOCK_G=block_g, GPP=gpp, BITS=bits, QMAX=qmax, STOCH=stoch,
            NEED_HI=stoch and _need_hi(int(offset), ngroups * group_size), DIFF=diff,
            M_KIND=_KIND[master.dtype], R_KIND=_KIND[replica.dtype])
    return payload, scales


def dequant_add_(replica: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                 group_size: int, mode: str = "diff") -> torch.Tensor:
    """Op 5 (see ``reference.dequant_add_``): ``replica = cast(float(replica) + deq)`` in place.

    Args: replica [n] contiguous float32/float16/bfloat16; payload uint8 [n_pad*bits/8] (at least n codes,
        a whole number of groups); scales float32 [n_pad/group_size].  ``mode='direct'``: ``cast(deq)``.
    Returns: ``replica``.
    """
    diff = dequant_add_plan(replica, payload, scales, bits, group_size, mode)
    n = replica.numel()
    device = replica.device
    _check_device(device, payload=payload, scales=scales)
    if n == 0:
        return replica
    block = _elements_per_program(n)
    _launch(_dequant_add_kernel, (triton.cdiv(n, block),),
            _float_view(replica), _code_view(payload.contiguous(), bits), scales.reshape(-1).contiguous(), n,
            tile_elems=block, GS=group_size, BITS=bits, BLOCK=block, DIFF=diff, R_KIND=_KIND[replica.dtype])
    return replica


def dequant_add_segments_(dst: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                          group_size: int, mode: str, segments) -> torch.Tensor:
    """Op 6 (see ``reference.dequant_add_segments_``): op 5 through a segment plan, one launch.

    Args: dst [n] contiguous float32/float16/bfloat16 (the plan's buffer or one of its size and device);
        payload uint8 (whole groups, at least ``segments.src_end`` codes); scales float32 [groups];
        segments a ``segments.SegmentPlan``.  ``mode='direct'``: ``cast(deq)``.
    Returns: ``dst``.
    """
    diff = dequant_add_segments_plan(dst, payload, scales, bits, group_size, mode, segments)
    device = dst.device
    _check_device(device, payload=payload, scales=scales)
    if segments.num_segments == 0:
        return dst
    block = _SEG_INTERP_TILE if _INTERPRETED else _GPU_TILE
    tiles = segments.tiles(block)
    _launch(_dequant_add_segments_kernel, (tiles.shape[0],),
            _float_view(dst), _code_view(payload.contiguous(), bits), scales.reshape(-1).contiguous(), tiles,
            tile_elems=block, GS=group_size, BITS=bits, BLOCK=block, DIFF=diff, R_KIND=_KIND[dst.dtype])
    return dst


# ----------------------------------------------------------------------------------------------------------
# backend
# ----------------------------------------------------------------------------------------------------------
def _probe(device: torch.device) -> Tuple[bool, str]:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
        if _INTERPRETED:
            return True, "triton interpreter (TRITON_INTERPRET=1): correct but slow"
        return True, f"triton {triton.__version__} kernels"
    if device.type == "cpu":
        if _INTERPRETED:
            return True, "triton interpreter on CPU (TRITON_INTERPRET=1 was set at import): for tests, slow"
        return False, ("triton kernels need a CUDA device; CPU tensors run only through the interpreter "
                       "(set TRITON_INTERPRET=1 before importing the backend)")
    return False, f"triton backend supports cuda devices (and cpu under TRITON_INTERPRET=1), not {device.type}"


def make_backend() -> "_backend.Backend":
    """The ``triton`` backend: the six ops above and a probe (CUDA; CPU only under TRITON_INTERPRET=1)."""
    return backend_from("triton", globals(), _probe)
