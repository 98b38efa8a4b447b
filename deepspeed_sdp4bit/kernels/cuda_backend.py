"""CUDA backend: the five SDP4Bit ops as compiled kernels (``csrc/``), bit-exact with ``reference.py``.

:func:`make_backend` returns ``ops.Backend("cuda", ...)``; :mod:`deepspeed_sdp4bit.ops` calls it lazily.
The extension is JIT-built through DeepSpeed's op builder (``op_builder/sdp4bit.py``, located by
:mod:`deepspeed_sdp4bit._native`) the first time the probe or an op needs it; a failed build is reported
by the probe with its reason, so ``kernel_backend="auto"`` moves on to the next backend.

The wrappers here have the reference signatures plus optional ``out=`` / ``out_scales=`` buffers (used in
place, nothing allocated when given) and do argument normalization only; the C++ binding checks every
tensor (device, dtype, contiguity, sizes) and the group/Hadamard constraints, and launches on the current
CUDA stream without synchronizing.  The binding returns its error messages and the wrappers raise them
(``ValueError``; ``RuntimeError`` for a failed launch).

Kernel limits beyond the reference: group sizes must be multiples of 8 and Hadamard sizes powers of two in
8..256 (the config allows group sizes that are multiples of 32 and Hadamard sizes 32..256).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import ops as _ops
from .. import reference as R

__all__ = [
    "make_backend",
    "hadamard_quantize",
    "dequant_sum_requant",
    "dequant_sum_inverse_hadamard",
    "weight_delta_quantize",
    "dequant_add_",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def _rounding(rounding: str, key: Optional[int]) -> Tuple[int, int]:
    """(0 nearest / 1 stochastic, key as uint32)."""
    if rounding == "nearest":
        return 0, 0
    if rounding == "stochastic":
        if key is None:
            raise ValueError("stochastic rounding needs a key (see reference.make_key)")
        return 1, int(key) & 0xFFFFFFFF
    raise ValueError(f"rounding must be one of {R.ROUNDING_MODES}, got {rounding!r}")


def _mode(mode: str) -> int:
    if mode == "diff":
        return 1
    if mode == "direct":
        return 0
    raise ValueError(f"mode must be 'diff' or 'direct', got {mode!r}")


def _bits(bits: int, name: str = "bits") -> int:
    if bits not in (4, 8):
        raise ValueError(f"{name} must be 4 or 8, got {bits}")
    return int(bits)


def _hadamard(h: Optional[int]) -> int:
    return int(h) if h else 0


def _buffer(out: Optional[torch.Tensor], numel: int, dtype: torch.dtype, device: torch.device,
            name: str) -> torch.Tensor:
    """``out`` (checked: ``numel`` x ``dtype``, contiguous, on ``device``) or a new flat buffer."""
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


def _chunks(payloads: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int
            ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """payloads as contiguous [k, bytes], scales flat contiguous; returns them and m (elements per chunk)."""
    if payloads.dim() != 2:
        raise ValueError(f"payloads must be 2-D [k, bytes], got shape {tuple(payloads.shape)}")
    m = payloads.shape[1] * 8 // bits
    return payloads.contiguous(), scales.reshape(-1).contiguous(), m


# ----------------------------------------------------------------------------------------------------------
# the five ops
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
    _bits(bits)
    stoch, k = _rounding(rounding, key)
    xf = x.reshape(-1)
    if not xf.is_contiguous():
        xf = xf.contiguous()
    n = xf.numel()
    rows = cols = 0
    if swizzle is not None:
        rows, cols = (int(v) for v in swizzle)
        if rows < 1 or cols < 1:
            raise ValueError(f"swizzle must be (rows >= 1, cols >= 1), got {swizzle}")
    payload = _buffer(out, n * bits // 8, torch.uint8, x.device, "out")
    scales = _buffer(out_scales, n // group_size if group_size > 0 else 0, torch.float32, x.device, "out_scales")
    _launch("hadamard_quantize", xf, bits, int(group_size), _hadamard(hadamard_size), stoch, k, int(offset), rows,
            cols, payload, scales)
    return payload, scales


def dequant_sum_requant(payloads: torch.Tensor, scales: torch.Tensor, in_bits: int, out_bits: int,
                        group_size: int, rounding: str = "nearest", key: Optional[int] = None,
                        offset: int = 0, out_group_size: Optional[int] = None,
                        out: Optional[torch.Tensor] = None, out_scales: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Op 2 (``reference.dequant_sum_requant``): dequantize k chunks, fp32 sum in chunk order, requantize.

    Args:
        payloads: uint8 [k, m*in_bits/8]; scales: float32 [k, m/group_size] (any shape of that many).
        out_group_size: output group size (default ``group_size``); the sum is zero-padded to a multiple.
        out: optional uint8 [m_pad*out_bits/8]; out_scales: optional float32 [m_pad/out_group_size].
    Returns: payload uint8 [m_pad*out_bits/8], scales float32 [m_pad/out_group_size].
    """
    _bits(in_bits, "in_bits")
    _bits(out_bits, "out_bits")
    stoch, k = _rounding(rounding, key)
    ogs = int(out_group_size or group_size)
    payloads, scales, m = _chunks(payloads, scales, in_bits, group_size)
    m_pad = R.num_groups(m, ogs) * ogs if ogs > 0 else 0
    payload = _buffer(out, m_pad * out_bits // 8, torch.uint8, payloads.device, "out")
    oscales = _buffer(out_scales, m_pad // ogs if ogs > 0 else 0, torch.float32, payloads.device, "out_scales")
    _launch("dequant_sum_requant", payloads, scales, in_bits, out_bits, int(group_size), stoch, k, int(offset), ogs,
            payload, oscales)
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
    _bits(bits)
    payloads, scales, m = _chunks(payloads, scales, bits, group_size)
    if out is None:
        if out_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
        out = torch.empty(m, dtype=out_dtype, device=payloads.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
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
    _bits(bits)
    stoch, k = _rounding(rounding, key)
    diff = _mode(mode)
    if not replica.is_contiguous():
        raise ValueError("replica must be contiguous (it is updated in place)")
    if master.numel() != replica.numel():
        raise ValueError(f"master has {master.numel()} elements but replica has {replica.numel()}")
    mf = master.reshape(-1)
    if mf.dtype in (torch.float16, torch.bfloat16):
        mf = mf.float()
    mf = mf.contiguous()
    n = replica.numel()
    n_pad = R.num_groups(n, group_size) * group_size if group_size > 0 else 0
    payload = _buffer(out, n_pad * bits // 8, torch.uint8, replica.device, "out")
    scales = _buffer(out_scales, n_pad // group_size if group_size > 0 else 0, torch.float32, replica.device,
                     "out_scales")
    _launch("weight_delta_quantize", mf, replica.view(-1), bits, int(group_size), stoch, k, int(offset), diff,
            payload, scales)
    return payload, scales


def dequant_add_(replica: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                 group_size: int, mode: str = "diff") -> torch.Tensor:
    """Op 5 (``reference.dequant_add_``): ``replica = cast(float(replica) + deq)`` in place.

    Args: replica [n] contiguous float32/float16/bfloat16; payload uint8 [n_pad*bits/8] (at least n codes, a
        whole number of groups); scales float32 [n_pad/group_size].  ``mode='direct'``: ``cast(deq)``.
    Returns: ``replica``.
    """
    _bits(bits)
    diff = _mode(mode)
    if not replica.is_contiguous():
        raise ValueError("replica must be contiguous (it is updated in place)")
    _launch("dequant_add_", replica.view(-1), payload.reshape(-1).contiguous(), scales.reshape(-1).contiguous(),
            bits, int(group_size), diff)
    return replica


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


def make_backend() -> "_ops.Backend":
    """The ``cuda`` backend: the five ops above and a probe (CUDA device, CUDA torch, extension builds)."""
    return _ops.Backend(
        "cuda",
        {
            "hadamard_quantize": hadamard_quantize,
            "dequant_sum_requant": dequant_sum_requant,
            "dequant_sum_inverse_hadamard": dequant_sum_inverse_hadamard,
            "weight_delta_quantize": weight_delta_quantize,
            "dequant_add_": dequant_add_,
        },
        probe=_probe,
    )
