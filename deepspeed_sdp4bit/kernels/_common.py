"""Python-side argument checks and plumbing shared by the Triton and CUDA backends.

Both kernel backends wrap their launches in the same validation: bit widths, group sizes, rounding and
mode strings, caller-supplied ``out=`` buffers and the ``[k, bytes]`` chunk stacks of ops 2 and 3, gathered
per op in the ``*_plan`` functions.  Device checks stay with each backend (the CUDA binding requires CUDA
tensors; the Triton backend also runs CPU tensors under its interpreter).  Keeping
one copy here means the two backends reject the same inputs with the same wording, which the tests (and
users switching ``kernel_backend``) rely on.

Nothing here touches a device or imports Triton/the CUDA extension, so it is safe to import on any machine.
Every check raises ``TypeError`` for a non-tensor where a tensor is needed and ``ValueError`` otherwise,
with a message naming the offending argument.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Tuple

import torch

from .. import backend as _backend
from .. import reference as R

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(t: torch.Tensor, name: str) -> None:
    """``t`` must be a float32/float16/bfloat16 tensor (any shape)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_typed(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    """``t`` must be a tensor of exactly ``dtype`` (any shape)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def check_bits(bits: int, name: str = "bits") -> int:
    """``bits`` must be 4 or 8; returns the largest code magnitude (7 or 127)."""
    if bits not in (4, 8):
        raise ValueError(f"{name} must be 4 or 8, got {bits}")
    return R.qmax_for_bits(bits)


def check_group_size(group_size: int, bits: int, name: str = "group_size") -> None:
    """``group_size`` must be a positive int, and even for 4-bit codes (two codes share a byte).

    Backends may add their own limits on top (the CUDA kernels need multiples of 8; the binding says so).
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{name} must be a positive int, got {group_size!r}")
    if bits == 4 and group_size % 2:
        raise ValueError(f"4-bit groups must have an even size, got {name}={group_size}")


def check_rounding(rounding: str, key: Optional[int]) -> bool:
    """``rounding`` must be one of ``reference.ROUNDING_MODES``; stochastic needs a key.

    Returns True for stochastic rounding.
    """
    if rounding not in R.ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {R.ROUNDING_MODES}, got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("stochastic rounding needs a key (see reference.make_key)")
    return rounding == "stochastic"


def check_mode(mode: str) -> bool:
    """``mode`` of the replica update must be 'diff' or 'direct'; returns True for 'diff'."""
    if mode not in ("diff", "direct"):
        raise ValueError(f"mode must be 'diff' or 'direct', got {mode!r}")
    return mode == "diff"


def buffer(out: Optional[torch.Tensor], numel: int, dtype: torch.dtype, device: torch.device,
           name: str) -> torch.Tensor:
    """A flat ``[numel]`` ``dtype`` buffer on ``device``: ``out`` after checking it, or a new one.

    ``out`` may have any shape but must hold exactly ``numel`` elements of ``dtype``, live on ``device``
    and be contiguous, because the kernels write it in place through its flat view.
    """
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if out.numel() != numel or out.dtype != dtype:
        raise ValueError(f"{name} buffer has {out.numel()} x {out.dtype}, needs {numel} x {dtype}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}, expected {device}")
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is written in place)")
    return out


def chunks(payloads: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int
           ) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """Validate the k received chunks of ops 2 and 3 and return ``(payloads, scales, k, m)``.

    Args:
        payloads: uint8 [k, m*bits/8], k >= 1 (one row per chunk); m a multiple of ``group_size``.
        scales: float32 [k, m/group_size].
        bits, group_size: already checked by the caller (``check_bits`` / ``check_group_size``).
    Returns:
        ``payloads`` [k, m*bits/8] and ``scales`` [k, m/group_size] with unit stride along the row (copied
        only when needed; rows may still be strided), the chunk count k and the elements per chunk m.
    """
    check_typed(payloads, "payloads", torch.uint8)
    check_typed(scales, "scales", torch.float32)
    if payloads.dim() != 2:
        raise ValueError(f"payloads must be 2-D [k, bytes], got shape {tuple(payloads.shape)}")
    k = payloads.shape[0]
    if k < 1:
        raise ValueError("payloads must hold at least one chunk (k >= 1)")
    m = payloads.shape[1] * 8 // bits
    if m % group_size:
        raise ValueError(f"payloads hold {m} codes per chunk, not a multiple of group_size {group_size}")
    if tuple(scales.shape) != (k, m // group_size):
        raise ValueError(f"scales must have shape {(k, m // group_size)} for payloads of shape "
                         f"{tuple(payloads.shape)}, got {tuple(scales.shape)}")
    if payloads.stride(1) != 1:
        payloads = payloads.contiguous()
    if scales.stride(1) != 1:
        scales = scales.contiguous()
    return payloads, scales, k, m


def requant_plan(payloads: torch.Tensor, scales: torch.Tensor, in_bits: int, out_bits: int, group_size: int,
                 rounding: str, key: Optional[int], out_group_size: Optional[int]
                 ) -> Tuple[torch.Tensor, torch.Tensor, int, int, int, int, bool]:
    """Op 2's argument checks, shared by both backends (``dequant_sum_requant``'s arguments).

    Returns ``(payloads, scales, k, m, out_group_size, m_pad, stochastic)``: the chunks as ``chunks`` returns
    them, the output group size (default ``group_size``), the sum's length zero-padded to a multiple of it,
    and whether rounding is stochastic.
    """
    check_bits(in_bits, "in_bits")
    check_bits(out_bits, "out_bits")
    check_group_size(group_size, in_bits)
    ogs = out_group_size or group_size
    check_group_size(ogs, out_bits, "out_group_size")
    stoch = check_rounding(rounding, key)
    payloads, scales, k, m = chunks(payloads, scales, in_bits, group_size)
    return payloads, scales, k, m, ogs, R.num_groups(m, ogs) * ogs, stoch


def quantize_plan(x: torch.Tensor, bits: int, group_size: int, hadamard_size: Optional[int], rounding: str,
                  key: Optional[int], swizzle: Optional[Tuple[int, int]]) -> Tuple[int, bool, int, int]:
    """Op 1's argument checks, shared by both backends (``hadamard_quantize``'s arguments).

    The Hadamard size itself is checked by each backend beforehand (their limits differ); here only that it
    divides the group.  Returns ``(qmax, stochastic, rows, cols)`` with ``(rows, cols)`` from ``swizzle``,
    ``(0, 0)`` without one.
    """
    check_float(x, "x")
    qmax = check_bits(bits)
    check_group_size(group_size, bits)
    stoch = check_rounding(rounding, key)
    if hadamard_size and group_size % hadamard_size:
        raise ValueError(f"group_size {group_size} must be a multiple of hadamard_size {hadamard_size}")
    n = x.numel()
    if n % group_size:
        raise ValueError(f"numel {n} must be a multiple of group_size {group_size}")
    rows = cols = 0
    if swizzle is not None:
        rows, cols = (int(v) for v in swizzle)
        if rows < 1 or cols < 1 or n % (rows * cols):
            raise ValueError(f"numel {n} is not divisible into {rows}x{cols} segments (swizzle={swizzle})")
    return qmax, stoch, rows, cols


def inverse_checks(payloads: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                   hadamard_size: Optional[int], out_dtype: torch.dtype, out: Optional[torch.Tensor]
                   ) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """Op 3's argument checks, shared by all backends (``dequant_sum_inverse_hadamard``'s arguments).

    Returns ``(payloads, scales, k, m)``, the chunks as :func:`chunks` returns them.  ``out``, when given, must
    be float, hold at least m elements, sit on the chunks' device and be contiguous (its first m elements are
    written); otherwise ``out_dtype`` must be a float dtype.
    """
    check_bits(bits)
    check_group_size(group_size, bits)
    payloads, scales, k, m = chunks(payloads, scales, bits, group_size)
    if hadamard_size and m % hadamard_size:
        raise ValueError(f"numel {m} is not a multiple of the hadamard size {hadamard_size}")
    device = payloads.device
    if out is None:
        if out_dtype not in FLOAT_DTYPES:
            raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
        return payloads, scales, k, m
    check_float(out, "out")
    if out.numel() < m:
        raise ValueError(f"out has {out.numel()} elements, needs {m}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, expected {device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return payloads, scales, k, m


def inverse_plan(payloads: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                 hadamard_size: Optional[int], out_dtype: torch.dtype, out: Optional[torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor]:
    """:func:`inverse_checks` and the kernels' output: ``(payloads, scales, k, m, out)``, ``out`` as given or a
    new ``out_dtype`` [m] tensor on the chunks' device."""
    payloads, scales, k, m = inverse_checks(payloads, scales, bits, group_size, hadamard_size, out_dtype, out)
    if out is None:
        out = torch.empty(m, dtype=out_dtype, device=payloads.device)
    return payloads, scales, k, m, out


def weight_delta_plan(master: torch.Tensor, replica: torch.Tensor, bits: int, group_size: int, rounding: str,
                      key: Optional[int], mode: str) -> Tuple[int, bool, bool, int]:
    """Op 4's argument checks, shared by both backends (``weight_delta_quantize``'s arguments).

    Returns ``(qmax, stochastic, diff, ngroups)``; the last group is zero-padded.
    """
    check_float(master, "master")
    check_float(replica, "replica")
    qmax = check_bits(bits)
    check_group_size(group_size, bits)
    stoch = check_rounding(rounding, key)
    diff = check_mode(mode)
    if master.numel() != replica.numel():
        raise ValueError(f"master has {master.numel()} elements but replica has {replica.numel()}")
    if not replica.is_contiguous():
        raise ValueError("replica must be contiguous (it is updated in place)")
    return qmax, stoch, diff, R.num_groups(replica.numel(), group_size)


def _update_checks(dst: torch.Tensor, name: str, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                   group_size: int, mode: str) -> bool:
    """The argument checks ops 5 and 6 share: a float destination, uint8 payload, fp32 scales, bits, group size
    and mode (True for 'diff')."""
    check_float(dst, name)
    check_typed(payload, "payload", torch.uint8)
    check_typed(scales, "scales", torch.float32)
    check_bits(bits)
    check_group_size(group_size, bits)
    return check_mode(mode)


def _check_whole_groups(ncodes: int, scales: torch.Tensor, group_size: int) -> None:
    if ncodes % group_size or scales.numel() != ncodes // group_size:
        raise ValueError(f"payload of {ncodes} codes needs {ncodes // group_size} scales for group_size "
                         f"{group_size} (and a whole number of groups), got {scales.numel()} scales")


def dequant_add_plan(replica: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                     group_size: int, mode: str) -> bool:
    """Op 5's argument checks, shared by both backends (``dequant_add_``'s arguments); True for 'diff'.

    The payload must hold at least ``replica.numel()`` codes in whole groups, with one scale per group.
    """
    diff = _update_checks(replica, "replica", payload, scales, bits, group_size, mode)
    ncodes = payload.numel() * 8 // bits
    n = replica.numel()
    if ncodes < n:
        raise ValueError(f"payload holds {ncodes} codes for a replica of {n}")
    _check_whole_groups(ncodes, scales, group_size)
    if not replica.is_contiguous():
        raise ValueError("replica must be contiguous (it is updated in place)")
    return diff


def dequant_add_segments_plan(dst: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                              group_size: int, mode: str, segments: Any) -> bool:
    """Op 6's argument checks, shared by all backends (``dequant_add_segments_``'s arguments); True for 'diff'.

    O(1) per call: everything about the segments themselves was checked when the plan was built.  ``dst`` must
    be a 1-D contiguous float buffer on the plan's device holding at least ``segments.dst_end`` elements; the
    payload must hold whole groups (one scale each) and at least ``segments.src_end`` codes.
    """
    from ..segments import SegmentPlan  # a leaf module
    diff = _update_checks(dst, "dst", payload, scales, bits, group_size, mode)
    if not isinstance(segments, SegmentPlan):
        raise TypeError(f"segments must be a SegmentPlan (deepspeed_sdp4bit.segments.make_segment_plan), got "
                        f"{type(segments).__name__}")
    if dst.dim() != 1 or not dst.is_contiguous():
        raise ValueError(f"dst must be a contiguous 1-D buffer (it is updated in place), got shape "
                         f"{tuple(dst.shape)}")
    if dst.device != segments.device:
        raise ValueError(f"dst is on {dst.device} but the segment plan was built for {segments.device}")
    if dst.numel() < segments.dst_end:
        raise ValueError(f"dst has {dst.numel()} elements, the segments write up to {segments.dst_end}")
    if payload.device != dst.device or scales.device != dst.device:
        raise ValueError(f"payload ({payload.device}) and scales ({scales.device}) must be on dst's device "
                         f"{dst.device}")
    ncodes = payload.numel() * 8 // bits
    if ncodes < segments.src_end:
        raise ValueError(f"payload holds {ncodes} codes, the segments read up to {segments.src_end}")
    _check_whole_groups(ncodes, scales, group_size)
    return diff


def backend_from(name: str, source: Any, probe: Callable[[torch.device], Tuple[bool, str]]) -> "_backend.Backend":
    """``backend.Backend(name, ...)`` with the ops named in ``backend.OP_NAMES`` taken from ``source``.

    ``source`` is a module (its attributes) or a mapping such as ``globals()``; an op it lacks makes
    ``backend.Backend`` raise ``ValueError`` naming the missing ops.  ``probe(device) -> (ok, reason)``.
    """
    if isinstance(source, Mapping):
        found = {op: source[op] for op in _backend.OP_NAMES if op in source}
    else:
        found = {op: getattr(source, op) for op in _backend.OP_NAMES if hasattr(source, op)}
    return _backend.Backend(name, found, probe=probe)
