"""CUDA backend: the six SDP4Bit ops as compiled kernels (``csrc/``), bit-exact with ``reference.py``.

:func:`make_backend` returns ``ops.Backend("cuda", ...)``; :mod:`deepspeed_sdp4bit.ops` calls it lazily.
The extension is JIT-built through DeepSpeed's op builder (``op_builder/sdp4bit.py``, located by
:mod:`deepspeed_sdp4bit._native`) the first time the probe or an op needs it; a failed build is reported
by the probe with its reason, so ``kernel_backend="auto"`` moves on to the next backend.

The wrappers here have the reference signatures plus optional ``out=`` / ``out_scales=`` buffers (used in place,
nothing allocated when given). They run the checks shared with the Triton backend (:mod:`._common`'s per-op
plans: dtypes, bit widths, group sizes, rounding/mode strings, ``out`` buffers, chunk shapes, swizzle and
Hadamard divisibility) and normalize arguments; the C++ binding checks every tensor again (device, dtype,
contiguity, sizes) and the kernel's group/Hadamard constraints, and launches on the current CUDA stream without
synchronizing. The binding returns its error messages and the wrappers raise them (``ValueError``;
``RuntimeError`` for a failed launch).

Kernel limits beyond the reference: group sizes must be multiples of 8 and Hadamard sizes powers of two in
8..256 (the config allows group sizes that are multiples of 32 and Hadamard sizes 32..256).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import backend as _backend
from ..segments import GPU_TILE
from ._common import (backend_from, buffer, dequant_add_plan, dequant_add_segments_plan, inverse_plan,
                      quantize_plan, requant_plan, weight_delta_plan)

__all__ = [
    "make_backend",
    "hadamard_quantize",
    "dequant_sum_requant",
    "dequant_sum_inverse_hadamard",
    "weight_delta_quantize",
    "dequant_add_",
    "dequant_add_segments_",
]

def _ext():
    from .. import _native
    return _native.load_extension()


def _launch(op: str, *args) -> None:
    """Call binding ``op``; it validates its arguments and returns "" once launched, else the reason.

    The binding returns errors instead of throwing them (see csrc/sdp4bit_bindings.cpp): they are raised here,
    ``ValueError`` for bad arguments and ``RuntimeError`` for a failed launch.
    """
    err = getattr(_ext(), op)(*args)
    if err:
        raise (RuntimeError if err.startswith("CUDA error") else ValueError)(f"sdp4bit cuda {op}: {err}")


def _key_u32(stoch: bool, key: Optional[int]) -> int:
    """The binding's uint32 key argument: the key's low 32 bits for stochastic rounding, else 0."""
    return int(key) & 0xFFFFFFFF if stoch else 0


def _hadamard(h: Optional[int]) -> int:
    return int(h) if h else 0


def _dense(payloads: torch.Tensor, scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunks checked by ``_common.chunks`` as the binding takes them: [k, bytes] contiguous, scales flat."""
    return payloads.contiguous(), scales.reshape(-1).contiguous()


# ----------------------------------------------------------------------------------------------------------
# the six ops
# ----------------------------------------------------------------------------------------------------------
def hadamard_quantize(x: torch.Tensor, bits: int, group_size: int, hadamard_size: Optional[int],
                      rounding: str = "nearest", key: Optional[int] = None, offset: int = 0,
                      swizzle: Optional[Tuple[int, int]] = None, out: Optional[torch.Tensor] = None,
                      out_scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 1 (``reference.hadamard_quantize``): optional swizzle, block Hadamard, group quantize, pack.

    Args:
        x: [n] CUDA float32/float16/bfloat16 (read flat), n a multiple of ``group_size`` (and of rows*cols
           with ``swizzle=(rows, cols)``); ``group_size`` a multiple of 8 and of ``hadamard_size``
           (None/0: no transform; else a power of two in 8..256).
        out: optional uint8 [n*bits/8]; out_scales: optional float32 [n/group_size].
    Returns: payload uint8 [n*bits/8], scales float32 [n/group_size] (``out``/``out_scales`` when given).
    """
    _, stoch, rows, cols = quantize_plan(x, bits, group_size, hadamard_size, rounding, key, swizzle)
    xf = x.reshape(-1)
    if not xf.is_contiguous():
        xf = xf.contiguous()
    n = xf.numel()
    payload = buffer(out, n * bits // 8, torch.uint8, x.device, "out")
    scales = buffer(out_scales, n // group_size, torch.float32, x.device, "out_scales")
    _launch("hadamard_quantize", xf, bits, int(group_size), _hadamard(hadamard_size), int(stoch),
            _key_u32(stoch, key), int(offset), rows, cols, payload, scales)
    return payload, scales


def dequant_sum_requant(payloads: torch.Tensor, scales: torch.Tensor, in_bits: int, out_bits: int,
                        group_size: int, rounding: str = "nearest", key: Optional[int] = None,
                        offset: int = 0, out_group_size: Optional[int] = None,
                        out: Optional[torch.Tensor] = None, out_scales: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 2 (``reference.dequant_sum_requant``): dequantize k chunks, fp32 sum in chunk order, requantize.

    Args:
        payloads: uint8 [k, m*in_bits/8]; scales: float32 [k, m/group_size].
        out_group_size: output group size (default ``group_size``); the sum is zero-padded to a multiple.
        out: optional uint8 [m_pad*out_bits/8]; out_scales: optional float32 [m_pad/out_group_size].
    Returns: payload uint8 [m_pad*out_bits/8], scales float32 [m_pad/out_group_size].
    """
    payloads, scales, _, m, ogs, m_pad, stoch = requant_plan(payloads, scales, in_bits, out_bits, group_size,
                                                             rounding, key, out_group_size)
    payloads, scales = _dense(payloads, scales)
    payload = buffer(out, m_pad * out_bits // 8, torch.uint8, payloads.device, "out")
    oscales = buffer(out_scales, m_pad // ogs, torch.float32, payloads.device, "out_scales")
    _launch("dequant_sum_requant", payloads, scales, in_bits, out_bits, int(group_size), int(stoch),
            _key_u32(stoch, key), int(offset), int(ogs), payload, oscales)
    return payload, oscales


def dequant_sum_inverse_hadamard(payloads: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                                 hadamard_size: Optional[int], out_dtype: torch.dtype = torch.float32,
                                 post_scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Op 3 (``reference.dequant_sum_inverse_hadamard``): sum k dequantized chunks, inverse Hadamard, cast.

    ``out = cast(butterfly(sum) * fp32(post_scale / hadamard_size))`` (no Hadamard: ``* fp32(post_scale)``).

    Args:
        payloads: uint8 [k, m*bits/8]; scales: float32 [k, m/group_size]; m a multiple of hadamard_size.
        out_dtype: float32/float16/bfloat16.  out: optional contiguous buffer of >= m elements whose dtype
            replaces ``out_dtype``; its first m elements are written.
    Returns: ``out_dtype`` [m] (or ``out``).
    """
    payloads, scales, _, _, out = inverse_plan(payloads, scales, bits, group_size, hadamard_size, out_dtype, out)
    payloads, scales = _dense(payloads, scales)
    _launch("dequant_sum_inverse_hadamard", payloads, scales, bits, int(group_size), _hadamard(hadamard_size),
            float(post_scale), out)
    return out


def weight_delta_quantize(master: torch.Tensor, replica: torch.Tensor, bits: int, group_size: int,
                          rounding: str = "nearest", key: Optional[int] = None, offset: int = 0,
                          mode: str = "diff", out: Optional[torch.Tensor] = None,
                          out_scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 4 (``reference.weight_delta_quantize``): quantize master - replica (or master), update the replica.

    Args:
        master: [n] float32 (float16/bfloat16 are widened first, exactly, at the cost of a copy);
        replica: [n] contiguous float32/float16/bfloat16, updated in place to ``cast(float(replica) + deq)``
            (``mode='direct'``: ``cast(deq)``).  n need not be a multiple of ``group_size``.
        out: optional uint8 [n_pad*bits/8]; out_scales: optional float32 [n_pad/group_size].
    Returns: payload uint8 [n_pad*bits/8], scales float32 [n_pad/group_size].
    """
    _, stoch, diff, ngroups = weight_delta_plan(master, replica, bits, group_size, rounding, key, mode)
    mf = master.reshape(-1)
    if mf.dtype in (torch.float16, torch.bfloat16):
        mf = mf.float()
    mf = mf.contiguous()
    n_pad = ngroups * group_size
    payload = buffer(out, n_pad * bits // 8, torch.uint8, replica.device, "out")
    scales = buffer(out_scales, n_pad // group_size, torch.float32, replica.device, "out_scales")
    _launch("weight_delta_quantize", mf, replica.view(-1), bits, int(group_size), int(stoch), _key_u32(stoch, key),
            int(offset), int(diff), payload, scales)
    return payload, scales


def dequant_add_(replica: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                 group_size: int, mode: str = "diff") -> torch.Tensor:
    """Op 5 (``reference.dequant_add_``): ``replica = cast(float(replica) + deq)`` in place.

    Args: replica [n] contiguous float32/float16/bfloat16; payload uint8 [n_pad*bits/8] (at least n codes, a
        whole number of groups); scales float32 [n_pad/group_size].  ``mode='direct'``: ``cast(deq)``.
    Returns: ``replica``.
    """
    diff = dequant_add_plan(replica, payload, scales, bits, group_size, mode)
    _launch("dequant_add_", replica.view(-1), payload.reshape(-1).contiguous(), scales.reshape(-1).contiguous(),
            bits, int(group_size), int(diff))
    return replica


def dequant_add_segments_(dst: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                          group_size: int, mode: str, segments) -> torch.Tensor:
    """Op 6 (``reference.dequant_add_segments_``): op 5 through a segment plan, one launch, in place.

    Args: dst [n] contiguous float32/float16/bfloat16 on the plan's device; payload uint8 (whole groups, at least
        ``segments.src_end`` codes); scales float32 [groups]; segments a ``segments.SegmentPlan`` (its tile table
        for ``segments.GPU_TILE`` was built with it: nothing is allocated or copied here).
    Returns: ``dst``.
    """
    diff = dequant_add_segments_plan(dst, payload, scales, bits, group_size, mode, segments)
    if segments.num_segments == 0:
        return dst
    _launch("dequant_add_segments_", dst, payload.reshape(-1).contiguous(), scales.reshape(-1).contiguous(), bits,
            int(group_size), int(diff), segments.tiles(GPU_TILE), int(segments.src_end), int(segments.dst_end))
    return dst


# ----------------------------------------------------------------------------------------------------------
# backend
# ----------------------------------------------------------------------------------------------------------
def _probe(device: torch.device) -> Tuple[bool, str]:
    """Whether the compiled kernels can run on ``device``, and why not (builds the extension if needed)."""
    if device.type != "cuda":
        return False, f"the cuda backend runs on CUDA tensors only, not on {device.type}"
    if not torch.cuda.is_available():
        return False, ("torch.cuda.is_available() is False (torch built without CUDA, or no GPU visible); "
                       f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    try:
        _ext()
    except Exception as e:  # noqa: BLE001 - the reason goes to the caller
        return False, str(e)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    return True, f"sdp4bit_quant CUDA extension on sm_{major}{minor}"


def make_backend() -> "_backend.Backend":
    """The ``cuda`` backend: the six ops above and a probe (CUDA device, CUDA torch, extension builds)."""
    return backend_from("cuda", globals(), _probe)
