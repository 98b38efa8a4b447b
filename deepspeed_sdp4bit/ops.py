"""Op dispatch (bitsandbytes style): a torch backend that runs everywhere, CUDA and Triton override it.

The collectives call ``get_backend(config.kernel_backend, device)`` once and then the six ops through the
returned :class:`Backend`; they never import a kernel module directly, so kernels plug in without touching
the collectives.  Every backend implements the signatures of the reference ops in ``reference.py`` plus
optional ``out``/``out_scales`` buffers, so a caller can reuse its buffers across steps.

``auto`` picks, for CUDA tensors, each op from the fastest available backend (``AUTO_ORDER``: cuda or triton,
then torch) and says which, once; for CPU tensors it is torch.  A backend asked for by name that cannot run
raises with the reason.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Tuple

import torch

from . import reference as R
from .backend import BACKEND_NAMES, OP_NAMES, Backend  # noqa: F401 - re-exported (the dispatch's names)
from .kernels import _common  # the kernels' argument checks: the torch backend rejects the same inputs alike

logger = logging.getLogger("deepspeed_sdp4bit")


def _copy_out(t: torch.Tensor, out: Optional[torch.Tensor], what: str) -> torch.Tensor:
    if out is None:
        return t
    if out.numel() != t.numel() or out.dtype != t.dtype:
        raise ValueError(f"{what} buffer has {out.numel()} x {out.dtype}, needs {t.numel()} x {t.dtype}")
    out.view(-1).copy_(t.view(-1))
    return out


# ----- torch backend: the reference ops, with out buffers and device placement -----
def _t_hadamard_quantize(x, bits, group_size, hadamard_size, rounding="nearest", key=None, offset=0,
                         swizzle=None, out=None, out_scales=None):
    _common.quantize_plan(x, bits, group_size, hadamard_size, rounding, key, swizzle)
    p, s = R.hadamard_quantize(x, bits, group_size, hadamard_size, rounding, key, offset, swizzle)
    return _copy_out(p.to(x.device), out, "out"), _copy_out(s.to(x.device), out_scales, "out_scales")


def _t_dequant_sum_requant(payloads, scales, in_bits, out_bits, group_size, rounding="nearest", key=None,
                           offset=0, out_group_size=None, out=None, out_scales=None):
    _common.requant_plan(payloads, scales, in_bits, out_bits, group_size, rounding, key, out_group_size)
    p, s = R.dequant_sum_requant(payloads, scales, in_bits, out_bits, group_size, rounding, key, offset,
                                 out_group_size)
    return _copy_out(p, out, "out"), _copy_out(s, out_scales, "out_scales")


def _t_dequant_sum_inverse_hadamard(payloads, scales, bits, group_size, hadamard_size,
                                    out_dtype=torch.float32, post_scale=1.0, out=None):
    # (checks ``out`` too: float, at least m elements, the chunks' device, contiguous)
    _common.inverse_checks(payloads, scales, bits, group_size, hadamard_size, out_dtype, out)
    if out is not None:
        out_dtype = out.dtype
    y = R.dequant_sum_inverse_hadamard(payloads, scales, bits, group_size, hadamard_size, out_dtype, post_scale)
    if out is not None:
        out.view(-1)[: y.numel()].copy_(y)
        return out
    return y


def _t_weight_delta_quantize(master, replica, bits, group_size, rounding="nearest", key=None, offset=0,
                             mode="diff", out=None, out_scales=None):
    _common.weight_delta_plan(master, replica, bits, group_size, rounding, key, mode)
    p, s = R.weight_delta_quantize(master, replica, bits, group_size, rounding, key, offset, mode)
    return _copy_out(p, out, "out"), _copy_out(s, out_scales, "out_scales")


def _t_dequant_add_(replica, payload, scales, bits, group_size, mode="diff"):
    _common.dequant_add_plan(replica, payload, scales, bits, group_size, mode)
    return R.dequant_add_(replica, payload, scales, bits, group_size, mode)


def _t_dequant_add_segments_(dst, payload, scales, bits, group_size, mode, segments):
    _common.dequant_add_segments_plan(dst, payload, scales, bits, group_size, mode, segments)
    return R.dequant_add_segments_(dst, payload, scales, bits, group_size, mode, segments)


TORCH_BACKEND = Backend(
    "torch",
    {
        "hadamard_quantize": _t_hadamard_quantize,
        "dequant_sum_requant": _t_dequant_sum_requant,
        "dequant_sum_inverse_hadamard": _t_dequant_sum_inverse_hadamard,
        "weight_delta_quantize": _t_weight_delta_quantize,
        "dequant_add_": _t_dequant_add_,
        "dequant_add_segments_": _t_dequant_add_segments_,
    },
    probe=lambda device: (True, "pure torch, runs on any device"),
)

# name -> zero-argument factory returning a Backend (import lazily: triton/CUDA may be absent)
_FACTORIES: Dict[str, Callable[[], Backend]] = {"torch": lambda: TORCH_BACKEND}
_CACHE: Dict[str, Backend] = {}
_ANNOUNCED = set()


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Register a backend factory (called lazily the first time the backend is asked for)."""
    _FACTORIES[name] = factory
    _CACHE.pop(name, None)


def _load(name: str) -> Backend:
    if name not in _CACHE:
        if name not in _FACTORIES:
            raise ValueError(f"unknown kernel backend {name!r}; known: {sorted(_FACTORIES)}")
        _CACHE[name] = _FACTORIES[name]()
    return _CACHE[name]


def _try(name: str, device: torch.device) -> Tuple[Optional[Backend], str]:
    try:
        b = _load(name)
    except Exception as e:  # noqa: BLE001 - becomes the reason in the message
        return None, f"{type(e).__name__}: {e}"
    ok, why = b.available(device)
    return (b if ok else None), why


# ``auto`` on CUDA devices: per op, the backends in order of measured speed (nvidia-h200,
# benchmarks/results/kernels/kernels_h200.json at 64-2048 MiB and kernels_h200_chunk_counts.txt, seventh session): CUDA
# leads op 1 by 8 points of copy bandwidth and op 5 by 2-3; op 4 by 1-2 points at 64-128 MiB, level at 512 MiB
# and 11 points behind at 2 GiB (kept on CUDA for its lead at the smaller sizes; the drop at 2 GiB was not looked
# into); Triton leads op 2 by 1-10 points at 2 and 4-8 chunks, level (+-1) at 3, and op 3 by 1.5-11 points up to
# 8 chunks.  Every backend gives the reference's bits, so mixing them changes speed only (and every rank makes the
# same choice from the same lists).
AUTO_ORDER: Dict[str, Tuple[str, ...]] = {
    "hadamard_quantize": ("cuda", "triton", "torch"),
    "dequant_sum_requant": ("triton", "cuda", "torch"),
    "dequant_sum_inverse_hadamard": ("triton", "cuda", "torch"),
    "weight_delta_quantize": ("cuda", "triton", "torch"),
    "dequant_add_": ("cuda", "triton", "torch"),
    # op 6 follows op 5 (the same per-element work through a tile table); not measured yet: run
    # ``benchmarks/bench_kernels.py --segments`` on a GPU and reorder if Triton wins.
    "dequant_add_segments_": ("cuda", "triton", "torch"),
}
# Ops whose order changes with the chunk count k (payloads.shape[0]): above max_k chunks, the second order.
# Measured at k = 12, 16 and 32 (benchmarks/results/kernels/kernels_h200_chunk_counts_more.txt, 512 then 64 MiB): Triton's
# op 3 runs its run-time chunk loop above 8 chunks (nodes) and was 6-9 points behind CUDA at 512 MiB and 11-12 at
# 64 MiB; Triton's op 2 (GPUs per node) was 3-4 points behind at 512 MiB and up to 12 at 64 MiB (level at k = 16).
AUTO_ORDER_MANY_CHUNKS: Dict[str, Tuple[int, Tuple[str, ...]]] = {
    "dequant_sum_requant": (8, ("cuda", "triton", "torch")),
    "dequant_sum_inverse_hadamard": (8, ("cuda", "triton", "torch")),
}


def _by_chunks(max_k: int, few: Callable, many: Callable) -> Callable:
    """An op taking ``few`` for payloads of at most ``max_k`` chunks (and for anything not a 2-D tensor, whose
    error ``few`` then reports), ``many`` above."""
    def op(payloads, *args, **kwargs):
        many_chunks = isinstance(payloads, torch.Tensor) and payloads.dim() == 2 and payloads.shape[0] > max_k
        return (many if many_chunks else few)(payloads, *args, **kwargs)
    return op


class AutoBackend(Backend):
    """``auto``: each op from the first backend of its ``AUTO_ORDER`` list that runs on the device (by chunk
    count where ``AUTO_ORDER_MANY_CHUNKS`` has a second list).  ``picks``: op -> what it runs, in words."""

    def __init__(self, few: Dict[str, Backend], many: Dict[str, Tuple[int, Backend]]):
        ops, self.picks = {}, {}
        for op, b in few.items():
            ops[op], self.picks[op] = getattr(b, op), b.name
            if op in many and many[op][1] is not b:
                max_k, mb = many[op]
                ops[op] = _by_chunks(max_k, getattr(b, op), getattr(mb, op))
                self.picks[op] = f"{b.name} (k <= {max_k}), {mb.name} (k > {max_k})"
        super().__init__("auto", ops, probe=lambda device: (True, "each op from an available backend"))

    def __repr__(self):
        return f"AutoBackend({self.picks})"


def _auto_backend(device: torch.device) -> Backend:
    if device.type != "cuda":
        b, why = _try("torch", device)
        if b is None:
            raise RuntimeError(f"no sdp4bit kernel backend can run on {device}: torch: {why}")
        return b
    tried: Dict[str, Tuple[Optional[Backend], str]] = {}

    def first(op: str, order: Tuple[str, ...]) -> Backend:
        for cand in order:
            if cand not in tried:
                tried[cand] = _try(cand, device)
            if tried[cand][0] is not None:
                return tried[cand][0]
        reasons = "; ".join(f"{n}: {why}" for n, (_, why) in tried.items())
        raise RuntimeError(f"no sdp4bit kernel backend can run {op} on {device}: {reasons}")

    few = {op: first(op, AUTO_ORDER[op]) for op in OP_NAMES}
    many = {op: (max_k, first(op, order)) for op, (max_k, order) in AUTO_ORDER_MANY_CHUNKS.items()}
    b = AutoBackend(few, many)
    key = (tuple(sorted(b.picks.items())), device.type)
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        skipped = "; ".join(f"{n}: {why}" for n, (bk, why) in tried.items() if bk is None)
        logger.info("sdp4bit kernel_backend=auto on %s: %s%s", device.type,
                    "; ".join(f"{op}={n}" for op, n in b.picks.items()),
                    f" (unavailable: {skipped})" if skipped else "")
    return b


def get_backend(name: str = "auto", device="cpu") -> Backend:
    """The backend to use for tensors on ``device``.

    ``auto``: on CUDA devices each op from the first available backend of its ``AUTO_ORDER`` list (the fastest
    measured; for ops 2 and 3 by chunk count, ``AUTO_ORDER_MANY_CHUNKS``); anything else gets torch.  A named backend
    that cannot run on ``device`` raises ``RuntimeError`` naming the reason (never a silent fallback).
    """
    if name not in BACKEND_NAMES and name not in _FACTORIES:
        raise ValueError(f"sdp4bit.kernel_backend must be one of {BACKEND_NAMES}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        return _auto_backend(device)
    b, why = _try(name, device)
    if b is None:
        raise RuntimeError(f"sdp4bit.kernel_backend={name!r} cannot run on {device}: {why}")
    return b


def _register_builtin_kernels() -> None:
    """Hook the in-tree kernels into the registry (their modules import lazily)."""
    def triton_factory():
        from .kernels import triton_backend
        return triton_backend.make_backend()

    def cuda_factory():
        from .kernels import cuda_backend
        return cuda_backend.make_backend()

    register_backend("triton", triton_factory)
    register_backend("cuda", cuda_factory)


_register_builtin_kernels()
