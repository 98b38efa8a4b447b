"""Segment plans of op 6 (``dequant_add_segments_``): which source elements go to which destination elements.

A plan is built ONCE (when the replica layout is known) from three integer lists: segment ``k`` maps source
elements ``[src_offset[k], src_offset[k] + length[k])`` of one source's flat partition (its payload codes) to
destination elements ``[dst_offset[k], dst_offset[k] + length[k])`` of one flat destination buffer.  Building
checks everything that does not change from step to step (offsets non-negative, destination ranges inside the
buffer, no two segments overlapping in the destination, source ranges inside ``src_numel`` when given) and
precomputes the kernels' tile tables, so that a call checks two integers and launches once.

Tile table (what the kernels read): int64 ``[T, 3]`` rows ``(src_start, dst_start, count)``, the segments cut at
multiples of ``block`` in destination coordinates (so an interior tile starts on a ``block`` boundary of the
buffer and holds ``block`` elements; a segment's first and last tile may be shorter).  One program (Triton) or
thread block (CUDA) per row.  Tables are cached per ``(block, device)``; the one for :data:`GPU_TILE` on the
plan's device is built with the plan, so a GPU call never allocates nor copies from the host.

Speed (compiled kernels): elements whose source index and destination index are congruent modulo 16 (Triton) or
8 (CUDA), in buffers whose base addresses are 16-byte aligned, take the vector path; all others are correct but
slower.  A piece of parameter i from source s sits at source offset sum_{j<i} P_j and destination offset
start_i + s * P_i, with DeepSpeed's P_j = ceil(numel_j / world): where every P_j is a multiple of 16 (the 24-layer
d2048 GPT at 4 ranks: multiples of 512), a flat replica buffer that starts every parameter at a multiple of 16
elements keeps every piece on the vector path.

This module depends on torch only (a leaf): the reference, the backends and the collectives import it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

# Elements per tile of the compiled kernels (Triton on GPUs and CUDA share it): built with the plan.
GPU_TILE = 4096

IntList = Union[Sequence[int], torch.Tensor]


def _as_int_list(v: IntList, name: str) -> List[int]:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor or a list of ints, got a {v.dim()}-D {v.dtype} "
                             "tensor")
        return [int(x) for x in v.cpu().tolist()]
    try:
        out = [int(x) for x in v]
    except TypeError as e:
        raise TypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got {type(v).__name__}") from e
    for i, (x, y) in enumerate(zip(out, v)):
        if isinstance(y, float) and float(x) != y:
            raise ValueError(f"{name}[{i}] must be an integer, got {y!r}")
    return out


class SegmentPlan:
    """A validated segment list plus the kernels' tile tables (see the module docstring).

    Build it with :func:`make_segment_plan`.  Attributes (read-only by convention):

    * ``dst``: the flat destination buffer the plan was built against (1-D contiguous float tensor);
    * ``src_offset``, ``dst_offset``, ``length``: the non-empty segments, int64 CPU tensors (in the given order;
      zero-length segments dropped);
    * ``num_segments``; ``numel`` (elements written per call, the sum of the lengths);
    * ``src_end`` (one past the largest source element read; a call needs a payload of at least that many
      codes) and ``dst_end`` (one past the largest destination element written);
    * ``device``: where the tile tables live (the buffer's device).
    """

    def __init__(self, dst: torch.Tensor, src_offset: torch.Tensor, dst_offset: torch.Tensor,
                 length: torch.Tensor):
        self.dst = dst
        self.device = dst.device
        self.src_offset = src_offset
        self.dst_offset = dst_offset
        self.length = length
        self.num_segments = int(length.numel())
        self.numel = int(length.sum()) if self.num_segments else 0
        self.src_end = int((src_offset + length).max()) if self.num_segments else 0
        self.dst_end = int((dst_offset + length).max()) if self.num_segments else 0
        self._tiles: Dict[Tuple[int, torch.device], torch.Tensor] = {}
        self._copy_cache: Optional[Tuple[tuple, List[torch.Tensor], List[torch.Tensor]]] = None
        if self.device.type == "cuda":
            self.tiles(GPU_TILE)

    # ------------------------------------------------------------------------------------------------------
    def segments(self) -> List[Tuple[int, int, int]]:
        """The non-empty segments as ``(src_offset, dst_offset, length)`` tuples (host ints)."""
        return list(zip(self.src_offset.tolist(), self.dst_offset.tolist(), self.length.tolist()))

    def tiles(self, block: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """int64 ``[T, 3]`` ``(src_start, dst_start, count)`` on ``device`` (default: the plan's), the segments cut
        at multiples of ``block`` in destination coordinates (``count <= block``).  Cached: built on first use."""
        device = self.device if device is None else torch.device(device)
        key = (int(block), device)
        t = self._tiles.get(key)
        if t is None:
            t = tile_table(self.src_offset, self.dst_offset, self.length, int(block)).to(device)
            self._tiles[key] = t
        return t

    def copy_from(self, src: torch.Tensor, cache: bool = True) -> None:
        """``dst[dst_offset + j] = src[src_offset + j]`` for every segment (no quantization): the own source's
        pieces, copied from the owner's flat partition.  ``src``: 1-D contiguous, the buffer's dtype and device,
        at least ``src_end`` elements.  With ``cache``, the slice lists are kept for the next call with the same
        ``src`` (one multi-tensor copy per call, nothing per segment in Python)."""
        if not isinstance(src, torch.Tensor) or src.dim() != 1 or not src.is_contiguous():
            raise ValueError("copy_from: src must be a contiguous 1-D tensor")
        if src.dtype != self.dst.dtype or src.device != self.dst.device:
            raise ValueError(f"copy_from: src is {src.dtype} on {src.device}, the plan's buffer {self.dst.dtype} on "
                             f"{self.dst.device}")
        if src.numel() < self.src_end:
            raise ValueError(f"copy_from: src has {src.numel()} elements, the plan reads up to {self.src_end}")
        if not self.num_segments:
            return
        key = (src.data_ptr(), src.numel(), src.dtype, src.device)
        if self._copy_cache is not None and self._copy_cache[0] == key:
            _, dsts, srcs = self._copy_cache
        else:
            dsts, srcs = [], []
            for s, d, n in self.segments():
                dsts.append(self.dst[d: d + n])
                srcs.append(src[s: s + n])
            # (the cached slices keep src's storage alive, so its address cannot be reused by another tensor)
            if cache:
                self._copy_cache = (key, dsts, srcs)
        copy_ = getattr(torch, "_foreach_copy_", None)
        if copy_ is not None and len(dsts) > 1:
            copy_(dsts, srcs)
        else:
            for a, b in zip(dsts, srcs):
                a.copy_(b)

    def __repr__(self):
        return (f"SegmentPlan({self.num_segments} segments, {self.numel} elements, src_end={self.src_end}, "
                f"dst {self.dst.dtype}[{self.dst.numel()}] on {self.device})")


def tile_table(src_offset: torch.Tensor, dst_offset: torch.Tensor, length: torch.Tensor, block: int) -> torch.Tensor:
    """int64 CPU ``[T, 3]`` rows ``(src_start, dst_start, count)``: every (non-empty) segment cut at the multiples
    of ``block`` in destination coordinates, in segment order."""
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    keep = length > 0
    d0, s0, ln = dst_offset[keep].to(torch.int64), src_offset[keep].to(torch.int64), length[keep].to(torch.int64)
    if ln.numel() == 0:
        return torch.zeros(0, 3, dtype=torch.int64)
    first = d0 // block
    last = (d0 + ln - 1) // block
    per = last - first + 1                                  # tiles of each segment
    seg = torch.repeat_interleave(torch.arange(ln.numel()), per)
    starts = torch.cumsum(per, 0) - per                     # index of each segment's first tile
    cell = first[seg] + (torch.arange(seg.numel()) - starts[seg])
    lo = torch.maximum(cell * block, d0[seg])
    hi = torch.minimum((cell + 1) * block, d0[seg] + ln[seg])
    return torch.stack([s0[seg] + (lo - d0[seg]), lo, hi - lo], dim=1).contiguous()


def make_segment_plan(src_offset: IntList, dst_offset: IntList, length: IntList, dst: torch.Tensor,
                      src_numel: Optional[int] = None) -> SegmentPlan:
    """Validate a segment list against the flat buffer ``dst`` and build its :class:`SegmentPlan`.

    Args:
        src_offset, dst_offset, length: equally long lists (or 1-D integer tensors) of ints; segment ``k`` maps
            source elements ``[src_offset[k], +length[k])`` to ``dst`` elements ``[dst_offset[k], +length[k])``.
            Any offsets (odd ones with 4-bit codes too) and lengths >= 0 (0: skipped).
        dst: the 1-D contiguous float32/float16/bfloat16 buffer the plan writes (op 6's ``dst``).
        src_numel: the source partition's size, when known: every source range must lie inside it (a call
            checks the payload it gets in any case).
    Raises ``ValueError`` naming the segment: negative offset or length, a destination range outside ``dst``, a
    source range outside ``src_numel``, two segments overlapping in ``dst``.
    """
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"dst must be a torch.Tensor, got {type(dst).__name__}")
    if dst.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dst must be float32, float16 or bfloat16, got {dst.dtype}")
    if dst.dim() != 1 or not dst.is_contiguous():
        raise ValueError(f"dst must be a contiguous 1-D buffer, got shape {tuple(dst.shape)} "
                         f"(contiguous={dst.is_contiguous()})")
    so = _as_int_list(src_offset, "src_offset")
    do = _as_int_list(dst_offset, "dst_offset")
    ln = _as_int_list(length, "length")
    if not len(so) == len(do) == len(ln):
        raise ValueError(f"src_offset, dst_offset and length must be equally long, got {len(so)}, {len(do)}, "
                         f"{len(ln)}")
    n = dst.numel()
    keep = []
    for k, (s, d, L) in enumerate(zip(so, do, ln)):
        if L < 0 or s < 0 or d < 0:
            raise ValueError(f"segment {k} (src_offset={s}, dst_offset={d}, length={L}): offsets and length must "
                             "be >= 0")
        if L == 0:
            continue
        if d + L > n:
            raise ValueError(f"segment {k} writes dst[{d}:{d + L}], outside the buffer of {n} elements")
        if src_numel is not None and s + L > src_numel:
            raise ValueError(f"segment {k} reads source elements [{s}, {s + L}), outside the partition of "
                             f"{src_numel}")
        keep.append(k)
    by_dst = sorted(keep, key=lambda k: do[k])
    for a, b in zip(by_dst, by_dst[1:]):
        if do[b] < do[a] + ln[a]:
            raise ValueError(f"segments {a} and {b} overlap in dst: [{do[a]}, {do[a] + ln[a]}) and "
                             f"[{do[b]}, {do[b] + ln[b]})")
    t = lambda v: torch.tensor([v[k] for k in keep], dtype=torch.int64)  # noqa: E731
    return SegmentPlan(dst, t(so), t(do), t(ln))
