"""TLq-HS: the gradient reduce-scatter as two quantized all-to-alls (intra-node, then inter-node).

Data-parallel rank ``r = node * g + local`` (``N`` nodes, ``g`` ranks per node, ``W = N * g``).  The input
of one call is a flat buffer ``[W * S]`` whose segment ``d`` holds what rank ``d`` must receive reduced.

Algorithm (both levels quantized, the paper's setting)::

    pad every segment to S_p (a multiple of group_size; the padding is zeros and is never returned)
    1. hadamard_quantize(x, intra_bits, swizzle=(N, g))      # H fused before the quantizer; the output is
                                                             # in intra all-to-all order: peer l' gets the
                                                             # segments of ranks (0,l'), (1,l'), ..., (N-1,l')
    2. all_to_all_single on topology.intra_group             # codes and scales
    3. dequant_sum_requant(intra_bits -> inter_bits)         # no transform: H H = h I cancels later
    4. all_to_all_single on topology.inter_group             # peer n' gets the segment of rank (n', local)
    5. dequant_sum_inverse_hadamard(post_scale = 1/W or 1)   # sum of transforms = transform of the sum

One-level fallbacks: with one node only the intra level runs (quantized at ``intra_bits``), with one rank per
node only the inter level runs (at ``inter_bits``); either way the single level is
``hadamard_quantize -> all_to_all -> dequant_sum_inverse_hadamard``.  With one rank in total the result is
the input itself (times 1/W = 1), nothing is sent and nothing is quantized.

16 bits at a level means that level sends the values unquantized, in the input's dtype (bf16 and fp16 inputs
send bf16/fp16, fp32 inputs send fp32), and sums what it receives in fp32, sequentially in peer order.  The
Hadamard transform spans exactly the quantized levels: it is applied by the first quantization and inverted
by the last dequantization, so a 16-bit level never carries transformed values and with both levels at 16
bits there is no transform at all: for integer-valued inputs whose partial sums are representable in the
input dtype the result is exact (equal to ``torch.distributed`` reduce-scatter).  Partial sums of a 16-bit
inter level are cast to the input dtype before sending (fp16 can overflow to inf there, as a plain fp16
reduce-scatter would).

Communication: each level uses two ``all_to_all_single`` calls, one for the uint8 codes and one for the fp32
scales, issued back to back (asynchronously) on the same group.  One combined buffer would need the codes and
scales of each peer to be adjacent, which the fused quantize op cannot write (its ``out``/``out_scales`` are
two contiguous buffers in peer order), so a combined call would cost a copy of the whole payload on every
level; the second call costs only its latency and carries 32/group_size bits per value.

Stochastic rounding: the quantization of level ``level`` (0 = intra, 1 = inter) of pipeline chunk ``chunk``
on data-parallel rank ``rank`` uses the stream ``reference.make_key(seed, step, bucket_id, level, rank,
chunk)`` with counter = element index in the buffer being quantized.  The bits are therefore reproducible
from (seed, step, bucket_id), differ between ranks, and *do* change with ``pipeline_chunks`` (the chunk index
and the buffer layout enter the counter).  With nearest rounding the result does not depend on
``pipeline_chunks`` at all: chunks are group-aligned, so every group sees exactly the same values and sums.

Pipelining: ``pipeline_chunks = K`` splits every destination segment into K group-aligned chunks (fewer if
the segment has fewer groups); chunk i's inter all-to-all is issued asynchronously and completed while chunk
i+1 is quantized and exchanged within the node.

Buffers: all send and receive buffers come from a grow-only pool keyed by (role, dtype, device): after the
first call of a given size (or any larger size) no communication buffer is allocated again.  The returned
tensors are freshly allocated (the caller owns them); they are views of one ``[S_p]`` output.

List layout (:meth:`GradientReducer.reduce_scatter`, what DeepSpeed's buckets go through): tensor ``i`` of
``n_i`` elements contributes DeepSpeed's piece of ``P_i = ceil(n_i / W)`` elements to every destination
segment.  DeepSpeed packs the pieces back to back; here each piece starts at a multiple of ``group_size``
(``cfg.align_params``, :func:`list_layout`), so no quantization group and no Hadamard block holds two
parameters.  Packed, a bias or norm gain sharing a group with a weight gets that weight's scale, and at 4 bits
(error ~ abs-max / 7) its values round to noise (issue 21: LayerNorm gradients with relative errors of 1-3,
biases up to 4.6, against 0.1-0.3 aligned); aligned, every tensor is quantized on its own scale.  The gaps are zeros (fewer than
``group_size`` per tensor per segment); the outputs are read back from the same columns.

Accounting (:class:`~deepspeed_sdp4bit.collectives.stats.CommStats`): per level, the bytes this rank sends
to *other* ranks (the share of its all-to-all input addressed to itself never leaves the device, so it is
excluded), the number of values those bytes carry (padding and alignment gaps included), and
``baseline_bytes``: what a ring bf16 reduce-scatter of the unpadded segments would send from this rank,
``(W - 1) * S * 2`` (for the list API, S = DeepSpeed's packed ``sum(ceil(n_i / W))``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import ops
from .. import reference as R
from ..config import GradientsConfig
from ..topology import Topology, TopologyShape
from .stats import CommStats
from .buffers import BufferPool

LEVEL_IDS = {"intra": 0, "inter": 1}   # the ``level`` word of the stochastic-rounding key
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OPS = ("mean", "sum")
BASELINE_BYTES_PER_VALUE = 2            # the bf16 reduce-scatter the accounting compares against

Msg = Tuple[torch.Tensor, ...]          # (payload uint8, scales fp32) for a quantized level, (values,) for 16


# ----------------------------------------------------------------------------------------------------------
# plan: the pure arithmetic of one call (shared by the collective, the simulator and the byte formula)
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Level:
    name: str     # "intra" or "inter"
    bits: int     # 4, 8 or 16
    peers: int    # size of the process group of this level

    @property
    def quantized(self) -> bool:
        return self.bits != 16

    @property
    def level_id(self) -> int:
        return LEVEL_IDS[self.name]


@dataclass(frozen=True)
class ReducePlan:
    """How one reduce-scatter of segments of ``segment`` elements runs on a ``shape`` topology.

    Attributes:
        padded: S_p, the segment padded to a multiple of ``unit`` (group_size if any level quantizes, else 1).
        chunks: (start, length) of each pipeline chunk inside a padded segment; lengths are multiples of unit.
        levels: the levels that run, in order (empty when the world has one rank).
        hadamard: the Hadamard block size, or None (no quantized level, or ``cfg.hadamard`` off).
        comm_dtype: dtype of the values a 16-bit level sends (the input's dtype).
    """

    shape: TopologyShape
    segment: int
    padded: int
    unit: int
    chunks: Tuple[Tuple[int, int], ...]
    levels: Tuple[_Level, ...]
    group_size: int
    hadamard: Optional[int]
    rounding: str
    comm_dtype: torch.dtype
    error_feedback: bool = False

    @property
    def world(self) -> int:
        return self.shape.world_size


def _check_cfg(cfg) -> GradientsConfig:
    if not isinstance(cfg, GradientsConfig):
        raise TypeError(f"cfg must be a deepspeed_sdp4bit.config.GradientsConfig, got {type(cfg).__name__}")
    return cfg


def make_plan(segment: int, shape: TopologyShape, cfg: GradientsConfig,
              dtype: torch.dtype = torch.bfloat16) -> ReducePlan:
    """The :class:`ReducePlan` for destination segments of ``segment`` elements (unpadded) in ``dtype``."""
    cfg = _check_cfg(cfg)
    if not isinstance(shape, TopologyShape):
        raise TypeError(f"shape must be a TopologyShape, got {type(shape).__name__}")
    if int(segment) < 0:
        raise ValueError(f"segment must be >= 0 elements, got {segment}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gradient dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    segment = int(segment)
    levels: List[_Level] = []
    if shape.world_size > 1:
        if shape.gpus_per_node > 1:
            levels.append(_Level("intra", cfg.intra_bits, shape.gpus_per_node))
        if shape.num_nodes > 1:
            levels.append(_Level("inter", cfg.inter_bits, shape.num_nodes))
    any_q = any(l.quantized for l in levels)
    unit = cfg.group_size if any_q else 1
    padded = R.padded_numel(segment, unit)
    n_units = padded // unit
    k = max(1, min(cfg.pipeline_chunks, n_units))
    # Group-aligned chunks of near-equal size: chunk c holds units [c*n/k, (c+1)*n/k).
    bounds = [c * n_units // k for c in range(k + 1)]
    chunks = tuple((bounds[c] * unit, (bounds[c + 1] - bounds[c]) * unit) for c in range(k)) if padded else ()
    return ReducePlan(shape=shape, segment=segment, padded=padded, unit=unit, chunks=chunks,
                      levels=tuple(levels), group_size=cfg.group_size,
                      hadamard=cfg.hadamard_size if (cfg.hadamard and any_q) else None,
                      rounding=cfg.rounding, comm_dtype=dtype, error_feedback=cfg.error_feedback)


def settings_at(cfg: GradientsConfig, step: int) -> GradientsConfig:
    """The settings optimizer step ``step`` runs with: ``cfg`` with ``inter_bits`` 8 while ``step <
    cfg.inter8_steps`` (issue 21; a valid config of its own, with ``inter8_steps`` 0), else ``cfg`` itself.  The
    collective and its simulation both ask here."""
    return cfg.model_copy(update={"inter_bits": 8, "inter8_steps": 0}) if step < cfg.inter8_steps else cfg


def _level_bytes_per_value(level: _Level, group_size: int, comm_dtype: torch.dtype) -> float:
    if level.quantized:
        return level.bits / 8 + 4 / group_size
    return torch.empty((), dtype=comm_dtype).element_size()


def expected_wire_bytes(segment_numel: int, shape: TopologyShape, cfg: GradientsConfig,
                        dtype: torch.dtype = torch.bfloat16) -> Dict[str, float]:
    """Bytes one rank sends to other ranks in one reduce-scatter, by the formula (not by measuring).

    Args:
        segment_numel: S, elements each rank receives (unpadded; for a DeepSpeed list, see
            :func:`segment_numel_for`).
        dtype: the gradients' dtype (decides what a 16-bit level sends).
    Returns a dict:
        ``padded_segment`` S_p; ``intra`` = (g-1) * N * S_p * b_intra and ``inter`` = (N-1) * S_p * b_inter
        with ``b = bits/8 + 4/group_size`` for a quantized level, the dtype's size for a 16-bit one (an
        absent level sends 0); ``intra_values``/``inter_values`` the values those bytes carry;
        ``baseline`` = (W-1) * S * 2, a ring bf16 reduce-scatter; ``total`` = intra + inter.
    """
    plan = make_plan(segment_numel, shape, cfg, dtype)
    out: Dict[str, float] = {"padded_segment": plan.padded, "intra": 0, "inter": 0,
                             "intra_values": 0, "inter_values": 0}
    for lvl in plan.levels:
        # a level with p peers sends (p - 1) of its p equal messages away; the whole buffer is W*S_p for the
        # first level, N*S_p for the inter level of a two-level reduce
        total_values = plan.world * plan.padded if lvl is plan.levels[0] else plan.shape.num_nodes * plan.padded
        values = total_values // lvl.peers * (lvl.peers - 1)
        nbytes = values * _level_bytes_per_value(lvl, plan.group_size, dtype)
        out[lvl.name] = int(round(nbytes))
        out[lvl.name + "_values"] = values
    out["baseline"] = (plan.world - 1) * plan.segment * BASELINE_BYTES_PER_VALUE
    out["total"] = out["intra"] + out["inter"]
    return out


def partition_numels(numels: Sequence[int], world: int) -> List[int]:
    """DeepSpeed's per-tensor partition size ``ceil(n / world)`` for each tensor numel."""
    return [-(-int(n) // world) for n in numels]


def segment_numel_for(numels: Sequence[int], world: int) -> int:
    """S of a list reduce-scatter in DeepSpeed's layout: ``sum(ceil(n / world))`` over the tensors."""
    return sum(partition_numels(numels, world))


def list_unit(shape: TopologyShape, cfg: GradientsConfig) -> int:
    """Alignment of each tensor's piece inside a destination segment of a list reduce-scatter.

    ``cfg.group_size`` when ``cfg.align_params`` and some level quantizes (every piece starts a new
    quantization group, hence a new Hadamard block), else 1 (DeepSpeed's packed layout).
    """
    cfg = _check_cfg(cfg)
    return make_plan(0, shape, cfg).unit if cfg.align_params else 1


def list_layout(numels: Sequence[int], world: int, unit: int) -> Tuple[List[int], List[int], int]:
    """Where each tensor's piece lies in a destination segment of a list reduce-scatter.

    Returns ``(parts, cols, S)``: DeepSpeed's piece sizes ``ceil(n / world)``, each piece's first column (the
    running sum of the previous pieces, rounded up to a multiple of ``unit``) and the segment length (the
    last piece's end; callers pad it further to whole groups).  ``unit = 1`` is DeepSpeed's layout.
    """
    parts = partition_numels(numels, world)
    cols, col = [], 0
    for chunk in parts:
        col = R.padded_numel(col, unit) if chunk else col
        cols.append(col)
        col += chunk
    return parts, cols, col


def list_segment_numel(numels: Sequence[int], shape: TopologyShape, cfg: GradientsConfig) -> int:
    """S that a list reduce-scatter of tensors of ``numels`` puts on the wire (before group padding)."""
    return list_layout(numels, shape.world_size, list_unit(shape, cfg))[2]


def expected_list_wire_bytes(numels: Sequence[int], shape: TopologyShape, cfg: GradientsConfig,
                             dtype: torch.dtype = torch.bfloat16) -> Dict[str, float]:
    """:func:`expected_wire_bytes` of :meth:`GradientReducer.reduce_scatter` on tensors of ``numels``: the
    segment is the aligned one (:func:`list_segment_numel`), the baseline DeepSpeed's unpadded
    ``(W - 1) * sum(ceil(n / W)) * 2``; ``align_padding`` is what the alignment adds per segment."""
    out = expected_wire_bytes(list_segment_numel(numels, shape, cfg), shape, cfg, dtype)
    S = segment_numel_for(numels, shape.world_size)
    out["align_padding"] = list_segment_numel(numels, shape, cfg) - S
    out["baseline"] = (shape.world_size - 1) * S * BASELINE_BYTES_PER_VALUE
    return out


# ----------------------------------------------------------------------------------------------------------
# buffers
# ----------------------------------------------------------------------------------------------------------
def _msg_buffers(pool: BufferPool, role: str, level: _Level, plan: ReducePlan, full_values: int, off: int,
                 n: int, device) -> Msg:
    """Slices [off, off+n) (in values) of the role's buffers sized for ``full_values`` values."""
    if not level.quantized:
        v = pool.get(role + ".values", full_values, plan.comm_dtype, device)
        return (v[off:off + n],)
    b, g = level.bits, plan.group_size
    p = pool.get(role + ".payload", full_values * b // 8, torch.uint8, device)
    s = pool.get(role + ".scales", full_values // g, torch.float32, device)
    return (p[off * b // 8:(off + n) * b // 8], s[off // g:(off + n) // g])


# ----------------------------------------------------------------------------------------------------------
# the stages, identical for the collective and the single-process simulator
# ----------------------------------------------------------------------------------------------------------
def _key(plan: ReducePlan, seed: int, step: int, bucket_id: int, level: _Level, rank: int, chunk: int):
    if plan.rounding != "stochastic":
        return None
    return R.make_key(seed, step, bucket_id, level.level_id, rank, chunk)


def _raw_sum(values: torch.Tensor, peers: int) -> torch.Tensor:
    """fp32 sum over the ``peers`` rows of ``values`` [peers * m], sequential in peer order -> [m]."""
    rows = values.view(peers, -1)
    acc = rows[0].float()
    for j in range(1, peers):
        acc = acc + rows[j].float()
    return acc


def _stage_input(plan: ReducePlan, flat: torch.Tensor, pool: BufferPool) -> torch.Tensor:
    """The input in chunk-major padded layout: chunk c is the [W, L_c] block at offset W * start_c.

    Without padding and with one chunk this is ``flat`` itself (no copy).
    """
    W, S = plan.world, plan.segment
    if plan.padded == S and len(plan.chunks) == 1:
        return flat
    stage = pool.get("input", W * plan.padded, flat.dtype, flat.device)
    src = flat.view(W, S)
    for a, L in plan.chunks:
        blk = stage[W * a:W * (a + L)].view(W, L)
        valid = max(0, min(S - a, L))
        if valid:
            blk[:, :valid].copy_(src[:, a:a + valid])
        if valid < L:
            blk[:, valid:].zero_()  # padding: its codes are 0 and it never reaches an output
    return stage


def _carried(plan: ReducePlan, level: _Level) -> bool:
    """Whether ``level`` carries its quantization error into the next step (error feedback: the inter level)."""
    return plan.error_feedback and level.name == "inter" and level.quantized


def _quantize_carrying(plan: ReducePlan, be, y: torch.Tensor, level: _Level, send: Msg, key,
                       residual: torch.Tensor) -> Msg:
    """Error feedback: send ``q(y + residual)`` and keep ``residual = y + residual - dequant(sent)``.

    ``y`` [n] fp32 is already in the transformed domain (the Hadamard of the level input, or the sum of
    transformed chunks), so the quantization runs without a transform and the residual lives in that domain.  A
    non-finite value leaves a zero, not a poisoned residual; DeepSpeed skips such a step and
    :meth:`ResidualStore.end_step` then drops all residuals.
    """
    y = y + residual.float()
    be.hadamard_quantize(y, level.bits, plan.group_size, None, plan.rounding, key, 0, swizzle=None,
                         out=send[0], out_scales=send[1])
    sent = be.dequant_sum_inverse_hadamard(send[0].view(1, -1), send[1].view(1, -1), level.bits, plan.group_size,
                                           None, out_dtype=torch.float32, post_scale=1.0)
    residual.copy_(torch.nan_to_num(y - sent, nan=0.0, posinf=0.0, neginf=0.0))
    return send


def _first_send(plan: ReducePlan, be, x: torch.Tensor, L: int, send: Msg, key,
                residual: Optional[torch.Tensor] = None) -> Msg:
    """Level-1 message from the chunk input ``x`` [W * L] (destination order) into ``send`` buffers."""
    lvl = plan.levels[0]
    N, g = plan.shape.num_nodes, plan.shape.gpus_per_node
    swizzle = (N, g) if (lvl.name == "intra" and N > 1) else None
    if residual is not None:   # the one level is the inter level (one GPU per node): no swizzle
        y = R.hadamard_transform(x.float(), plan.hadamard) if plan.hadamard else x.float()
        return _quantize_carrying(plan, be, y, lvl, send, key, residual)
    if lvl.quantized:
        be.hadamard_quantize(x, lvl.bits, plan.group_size, plan.hadamard, plan.rounding, key, 0,
                             swizzle=swizzle, out=send[0], out_scales=send[1])
        return send
    if swizzle is None:
        return (x,)  # already in all-to-all order and in the comm dtype: send the input as is
    send[0].view(g, N, L).copy_(x.view(N, g, L).transpose(0, 1))
    return send


def _mid_send(plan: ReducePlan, be, recv: Msg, send: Msg, key, residual: Optional[torch.Tensor] = None) -> Msg:
    """Level-2 (inter) message from what the intra level received (two-level reduces only)."""
    l1, l2 = plan.levels
    g = l1.peers
    if residual is not None:   # the node sum, in the transformed domain, then the carried quantization
        if l1.quantized:
            acc = be.dequant_sum_inverse_hadamard(recv[0].view(g, -1), recv[1].view(g, -1), l1.bits,
                                                  plan.group_size, None, out_dtype=torch.float32, post_scale=1.0)
        else:
            acc = _raw_sum(recv[0], g)
            acc = R.hadamard_transform(acc, plan.hadamard) if plan.hadamard else acc
        return _quantize_carrying(plan, be, acc, l2, send, key, residual)
    if l1.quantized:
        pay, sc = recv[0].view(g, -1), recv[1].view(g, -1)
        if l2.quantized:
            be.dequant_sum_requant(pay, sc, l1.bits, l2.bits, plan.group_size, plan.rounding, key, 0,
                                   out=send[0], out_scales=send[1])
        else:
            # last quantized level: undo the transform here so the 16-bit level carries plain values
            be.dequant_sum_inverse_hadamard(pay, sc, l1.bits, plan.group_size, plan.hadamard,
                                            out_dtype=plan.comm_dtype, post_scale=1.0, out=send[0])
        return send
    acc = _raw_sum(recv[0], g)
    if l2.quantized:
        be.hadamard_quantize(acc, l2.bits, plan.group_size, plan.hadamard, plan.rounding, key, 0,
                             swizzle=None, out=send[0], out_scales=send[1])
    else:
        send[0].copy_(acc)
    return send


def _finish(plan: ReducePlan, be, recv: Msg, out: torch.Tensor, post_scale: float) -> None:
    """Reduce what the last level received into ``out`` [L] (the output dtype)."""
    lvl = plan.levels[-1]
    if lvl.quantized:
        be.dequant_sum_inverse_hadamard(recv[0].view(lvl.peers, -1), recv[1].view(lvl.peers, -1), lvl.bits,
                                        plan.group_size, plan.hadamard, out_dtype=out.dtype,
                                        post_scale=post_scale, out=out)
    else:
        acc = _raw_sum(recv[0], lvl.peers)
        # same rounding as the fused op: one fp32 multiply by fp32(post_scale), then the cast
        out.copy_(acc * torch.tensor(post_scale, dtype=torch.float32, device=acc.device))


class ResidualStore:
    """Error feedback's residuals on one rank (``gradients.error_feedback``): per (bucket key, pipeline chunk,
    size) a bf16 tensor of the inter level's send, zeros at first.

    The bucket key names the bucket's parameters (the integration passes their DeepSpeed ids), so the micro-steps
    of gradient accumulation share a bucket's residual and two buckets of equal sizes never do.  ``end_step``:
    after a step DeepSpeed skipped (a non-finite gradient), every residual is dropped (that step's gradients were
    thrown away, so their rounding error must not be carried, and the error carried into it was spent on them:
    at most one step's rounding error is lost); otherwise the residuals not used in the step are dropped (a bucket
    that no longer appears frees its memory).
    """

    def __init__(self):
        self._res: Dict[tuple, torch.Tensor] = {}
        self._used: set = set()

    def get(self, key: tuple, n: int, device) -> torch.Tensor:
        r = self._res.get(key)
        if r is None or r.numel() != n or r.device != torch.device(device):
            r = self._res[key] = torch.zeros(n, dtype=torch.bfloat16, device=device)
        self._used.add(key)
        return r

    def end_step(self, skipped: bool = False) -> None:
        if skipped:
            self.clear()
            return
        self._res = {k: v for k, v in self._res.items() if k in self._used}
        self._used = set()

    def clear(self) -> None:
        """Drop every residual (a skipped step; a state loaded from a checkpoint)."""
        self._res, self._used = {}, set()

    def keys(self) -> List[tuple]:
        return sorted(self._res, key=repr)

    def tensors(self) -> Dict[tuple, torch.Tensor]:
        return dict(self._res)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._res.values())


def _bucket_key(bucket_id: int, sizes) -> tuple:
    """A residual's bucket key when the caller names none: the bucket's index in the step and its size(s)."""
    return ("bucket", bucket_id, sizes)


def _residual(store: Optional[ResidualStore], plan: ReducePlan, level: _Level, key: tuple, chunk: int, n: int,
              device) -> Optional[torch.Tensor]:
    """The residual of ``level``'s send for (bucket ``key``, ``chunk``), or None when the level carries nothing."""
    if store is None or not _carried(plan, level):
        return None
    return store.get((key, chunk), n, device)


def _post_scale(op: str, world: int) -> float:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return 1.0 / world if op == "mean" else 1.0


def _check_flat(flat: torch.Tensor, world: int, what: str = "flat") -> int:
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(flat).__name__}")
    if flat.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what} dtype must be one of {SUPPORTED_DTYPES}, got {flat.dtype}")
    if flat.dim() != 1:
        raise ValueError(f"{what} must be 1-D [world * S], got shape {tuple(flat.shape)}")
    if flat.numel() % world:
        raise ValueError(f"{what} has {flat.numel()} elements, not a multiple of the data-parallel world "
                         f"size {world}")
    return flat.numel() // world


def _check_ints(step: int, bucket_id: int) -> None:
    for name, v in (("step", step), ("bucket_id", bucket_id)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")


# ----------------------------------------------------------------------------------------------------------
# the collective
# ----------------------------------------------------------------------------------------------------------
class GradientReducer:
    """Two-level quantized reduce-scatter (TLq-HS) over a :class:`~deepspeed_sdp4bit.topology.Topology`.

    Args:
        topology: the built topology (its ``intra_group`` / ``inter_group`` are used).
        cfg: ``GradientsConfig`` (bits per level, group, Hadamard, rounding, pipeline chunks); ``cfg.enabled``
            is not looked at: whoever builds a reducer wants it to run.
        seed: seeds every stochastic-rounding stream (with step, bucket, level, rank, chunk).
        backend: kernel backend name for :func:`deepspeed_sdp4bit.ops.get_backend` (resolved per device).
    """

    def __init__(self, topology: Topology, cfg: GradientsConfig, seed: int, backend: str = "auto"):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a deepspeed_sdp4bit.topology.Topology, got "
                            f"{type(topology).__name__}")
        self.topology = topology
        self.cfg = _check_cfg(cfg)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < (1 << 32):
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        self.seed = seed
        self._early = settings_at(self.cfg, 0) if self.cfg.inter8_steps else None   # built once
        self._early_buffers = self._early is not None   # the 8-bit steps' larger buffers, dropped once after them
        if backend not in ops.BACKEND_NAMES:
            raise ValueError(f"backend must be one of {ops.BACKEND_NAMES}, got {backend!r}")
        self.backend_name = backend
        self._backends: Dict[torch.device, ops.Backend] = {}
        self._pool = BufferPool()
        self.stats = CommStats()
        # error feedback (cfg.error_feedback): the inter level's residuals; ends its steps through end_step
        self.residuals: Optional[ResidualStore] = ResidualStore() if self.cfg.error_feedback else None
        if self.cfg.inter8_steps and topology.shape.num_nodes == 1:
            warnings.warn("sdp4bit: gradients.inter8_steps has nothing to change on one node (no inter-node level)",
                          stacklevel=2)
        if self.cfg.error_feedback and topology.shape.num_nodes == 1:
            warnings.warn("sdp4bit: gradients.error_feedback has nothing to carry on one node (no inter-node "
                          "level): it keeps no residual", stacklevel=2)

    # -- helpers --
    def cfg_at(self, step: int) -> GradientsConfig:
        """:func:`settings_at` of this reducer's settings (the early ones built once)."""
        return self._early if self._early is not None and step < self.cfg.inter8_steps else self.cfg

    def _settings(self, step: int, bucket_id: int) -> GradientsConfig:
        """:meth:`cfg_at` for a reduce of ``step`` (``step`` and ``bucket_id`` checked first), resolved once per call;
        the first reduce past ``inter8_steps`` drops the cached buffers (the pool only grows: the 8-bit inter-node
        messages would stay at twice the size the later steps use)."""
        _check_ints(step, bucket_id)
        cfg = self.cfg_at(step)
        if cfg is not self.cfg:
            self._early_buffers = True   # (again, after a rollback to a checkpoint from before the switch)
        elif self._early_buffers:
            self._pool.clear()
            self._early_buffers = False
        return cfg

    def _backend(self, device: torch.device) -> ops.Backend:
        device = torch.device(device)
        if device not in self._backends:
            self._backends[device] = ops.get_backend(self.backend_name, device)
        return self._backends[device]

    def _group(self, level: _Level):
        return self.topology.intra_group if level.name == "intra" else self.topology.inter_group

    def _all_to_all(self, level: _Level, send: Msg, recv: Msg, async_op: bool):
        """Exchange ``send`` into ``recv`` (one all_to_all_single per tensor) and count the bytes."""
        group = self._group(level)
        works = []
        for s, r in zip(send, recv):
            works.append(dist.all_to_all_single(r, s, group=group, async_op=True))
        p = level.peers
        nbytes = sum(t.numel() * t.element_size() for t in send) // p * (p - 1)
        # values carried: payload bytes * 8 / bits for a quantized level, the element count for a 16-bit one
        n_values = send[0].numel() * 8 // level.bits if level.quantized else send[0].numel()
        self.stats.add(level.name, nbytes, n_values // p * (p - 1))
        if not async_op:
            for w in works:
                w.wait()
            return []
        return works

    def buffer_bytes(self) -> int:
        """Bytes held by the cached communication buffers."""
        return self._pool.nbytes()

    def buffer_allocations(self) -> int:
        """How many communication buffers have been allocated so far (grows with new, larger sizes and after the pool
        is dropped: :meth:`clear_buffers`, and once past ``inter8_steps``)."""
        return self._pool.allocations

    def clear_buffers(self) -> None:
        """Drop the cached buffers (they are re-created on the next call)."""
        self._pool.clear()

    # -- public API --
    @torch.no_grad()
    def reduce_scatter_flat(self, flat: torch.Tensor, op: str = "mean", step: int = 0,
                            bucket_id: int = 0, residual_key: Optional[tuple] = None) -> torch.Tensor:
        """Reduce-scatter a flat buffer.

        Args:
            flat: [W * S] bf16/fp16/fp32; segment r (elements r*S .. r*S+S-1) is what rank r receives.
            op: ``mean`` (sum / W) or ``sum``.
            step, bucket_id: non-negative ints entering the stochastic-rounding keys (the same on all ranks).
            residual_key: with error feedback, what names this bucket's residual (default: bucket_id and size).
        Returns: [S] in ``flat``'s dtype, this rank's reduced segment (a fresh tensor).
        """
        W = self.topology.world_size
        S = _check_flat(flat, W)
        return self._reduce(flat, S, S, op, self._settings(step, bucket_id), step, bucket_id,
                            residual_key or _bucket_key(bucket_id, S))

    @torch.no_grad()
    def reduce_scatter(self, tensors: Union[Sequence[torch.Tensor], torch.Tensor], op: str = "mean",
                       step: int = 0, bucket_id: int = 0, residual_key: Optional[tuple] = None) -> List[torch.Tensor]:
        """Reduce-scatter a list of tensors in DeepSpeed's ``reduce_scatter_coalesced`` layout, in one call.

        For a tensor ``t`` of ``n`` elements and ``chunk = ceil(n / W)``, rank ``r`` receives the reduced
        ``t.flatten()[r*chunk : min((r+1)*chunk, n)]`` (shorter or empty on the last ranks) in t's dtype.
        All tensors must share one dtype and device.  The inputs are not modified.  ``residual_key``: with
        error feedback, what names the bucket's residual (the integration passes its parameters' ids; default:
        bucket_id and the tensors' sizes).

        Returns: one 1-D tensor per input tensor (views of one fresh output buffer).
        """
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = list(tensors)
        if not tensors:
            raise ValueError("tensors must hold at least one tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        dtype, device = tensors[0].dtype, tensors[0].device
        for i, t in enumerate(tensors):
            if t.dtype != dtype or t.device != device:
                raise ValueError(f"all tensors must share one dtype and device; tensors[0] is {dtype} on "
                                 f"{device}, tensors[{i}] is {t.dtype} on {t.device}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"tensor dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        W, rank = self.topology.world_size, self.topology.rank
        numels = [t.numel() for t in tensors]
        cfg = self._settings(step, bucket_id)
        parts, cols, S = list_layout(numels, W, list_unit(self.topology.shape, cfg))
        plan = make_plan(S, self.topology.shape, cfg, dtype)
        # Write the interleaved layout straight into a padded [W, S_p] buffer (one copy of the inputs).
        buf = self._pool.get("list_input", W * plan.padded, dtype, device).view(W, plan.padded)
        _write_list_input(buf, tensors, parts, cols)
        out = self._reduce(buf.view(-1), plan.padded, sum(parts), op, cfg, step, bucket_id,
                           residual_key or _bucket_key(bucket_id, tuple(numels)))
        return _split_output(out, numels, parts, cols, rank)

    # -- the algorithm --
    def _reduce(self, flat: torch.Tensor, S: int, S_baseline: int, op: str, cfg: GradientsConfig, step: int,
                bucket_id: int, rkey: tuple) -> torch.Tensor:
        """``cfg``: the call's settings (:meth:`_settings`, step and bucket checked there)."""
        post = _post_scale(op, self.topology.world_size)
        plan = make_plan(S, self.topology.shape, cfg, flat.dtype)
        rank = self.topology.rank
        self.stats.begin_call()
        self.stats.add_baseline((plan.world - 1) * S_baseline * BASELINE_BYTES_PER_VALUE)
        out = torch.empty(plan.padded, dtype=flat.dtype, device=flat.device)
        if not plan.levels or S == 0:
            if S:
                out.copy_(flat.float() * torch.tensor(post, dtype=torch.float32))
            return out[:S]
        be = self._backend(flat.device)
        x_all = _stage_input(plan, flat, self._pool)
        W, N = plan.world, plan.shape.num_nodes
        two = len(plan.levels) == 2
        pending = []
        for c, (a, L) in enumerate(plan.chunks):
            l1 = plan.levels[0]
            send1 = _msg_buffers(self._pool, "send1", l1, plan, W * plan.padded, W * a, W * L, flat.device)
            msg1 = _first_send(plan, be, x_all[W * a:W * (a + L)], L, send1,
                               _key(plan, self.seed, step, bucket_id, l1, rank, c),
                               _residual(self.residuals, plan, l1, rkey, c, W * L, flat.device))
            recv1 = _msg_buffers(self._pool, "recv1", l1, plan, W * plan.padded, W * a, W * L, flat.device)
            self._all_to_all(l1, msg1, recv1, async_op=False)
            if not two:
                _finish(plan, be, recv1, out[a:a + L], post)
                continue
            l2 = plan.levels[1]
            send2 = _msg_buffers(self._pool, "send2", l2, plan, N * plan.padded, N * a, N * L, flat.device)
            msg2 = _mid_send(plan, be, recv1, send2, _key(plan, self.seed, step, bucket_id, l2, rank, c),
                             _residual(self.residuals, plan, l2, rkey, c, N * L, flat.device))
            recv2 = _msg_buffers(self._pool, "recv2", l2, plan, N * plan.padded, N * a, N * L, flat.device)
            works = self._all_to_all(l2, msg2, recv2, async_op=True)
            # finish the previous chunk while this chunk's inter-node exchange is in flight
            for (pa, pL, pworks, precv) in pending:
                for w in pworks:
                    w.wait()
                _finish(plan, be, precv, out[pa:pa + pL], post)
            pending = [(a, L, works, recv2)]
        for (pa, pL, pworks, precv) in pending:
            for w in pworks:
                w.wait()
            _finish(plan, be, precv, out[pa:pa + pL], post)
        return out[:S]


def _write_partitioned(dst: torch.Tensor, src: torch.Tensor, chunk: int) -> None:
    """Write flat ``src`` [n] into ``dst`` [W, chunk] row by row, zero-filling the ragged tail."""
    n = src.numel()
    full = n // chunk if chunk else 0
    if full:
        dst[:full].copy_(src[:full * chunk].view(full, chunk))
    rem = n - full * chunk
    if full < dst.shape[0]:
        if rem:
            dst[full, :rem].copy_(src[full * chunk:])
            dst[full, rem:].zero_()
        else:
            dst[full].zero_()
        dst[full + 1:].zero_()


def _write_list_input(buf: torch.Tensor, tensors: Sequence[torch.Tensor], parts: Sequence[int],
                      cols: Sequence[int]) -> None:
    """Fill ``buf`` [W, S_p]: tensor i's pieces at columns ``cols[i]`` (see :func:`list_layout`), zeros
    everywhere else (alignment gaps and the group padding at the end)."""
    end = 0
    for t, chunk, col in zip(tensors, parts, cols):
        if col > end:
            buf[:, end:col].zero_()
        _write_partitioned(buf[:, col:col + chunk], t.reshape(-1), chunk)
        end = col + chunk
    if buf.shape[1] > end:
        buf[:, end:].zero_()


def _split_output(out: torch.Tensor, numels: Sequence[int], parts: Sequence[int], cols: Sequence[int],
                  rank: int) -> List[torch.Tensor]:
    res = []
    for n, chunk, col in zip(numels, parts, cols):
        length = max(0, min(chunk, n - rank * chunk))
        res.append(out.narrow(0, col, length))
    return res


# ----------------------------------------------------------------------------------------------------------
# single-process simulation
# ----------------------------------------------------------------------------------------------------------
def _route(plan: ReducePlan, level: _Level, msgs: List[Msg]) -> List[Msg]:
    """What each rank receives from an all-to-all of ``level`` given every rank's message (peer-major)."""
    shape = plan.shape
    if level.name == "intra":
        group_of = lambda r: shape.intra_ranks(shape.node_of(r))  # noqa: E731
        index_of = shape.local_of
    else:
        group_of = lambda r: shape.inter_ranks(shape.local_of(r))  # noqa: E731
        index_of = shape.node_of
    out = []
    for r in range(plan.world):
        me = index_of(r)
        peers = group_of(r)
        out.append(tuple(torch.cat([msgs[q][k].view(level.peers, -1)[me] for q in peers])
                         for k in range(len(msgs[r]))))
    return out


@torch.no_grad()
def simulate_reduce_scatter_flat(inputs: List[torch.Tensor], shape: TopologyShape, cfg: GradientsConfig,
                                 seed: int, step: int = 0, bucket_id: int = 0, op: str = "mean",
                                 backend: str = "torch", residuals: Optional[List[ResidualStore]] = None,
                                 residual_key: Optional[tuple] = None) -> List[torch.Tensor]:
    """The collective run for all ranks in one process: same stages, same ops, same bits.

    Args:
        inputs: W flat tensors [W * S] (one per data-parallel rank, same dtype), as given to
            :meth:`GradientReducer.reduce_scatter_flat`.
        shape: the topology shape; cfg, seed, step, bucket_id, op: as for the collective.
        backend: kernel backend used for the ops (on the inputs' device).
        residuals, residual_key: with ``cfg.error_feedback``, one :class:`ResidualStore` per rank kept between
            calls (each rank's ``GradientReducer.residuals``; required then) and the bucket's key in them.
    Returns: W tensors [S], what each rank's ``reduce_scatter_flat`` returns.
    """
    W = shape.world_size
    if len(inputs) != W:
        raise ValueError(f"inputs must hold one tensor per rank ({W}), got {len(inputs)}")
    S = _check_flat(inputs[0], W, "inputs[0]")
    for r, x in enumerate(inputs):
        if _check_flat(x, W, f"inputs[{r}]") != S or x.dtype != inputs[0].dtype:
            raise ValueError(f"inputs[{r}] must have {W * S} elements of {inputs[0].dtype}, like inputs[0]")
    post = _post_scale(op, W)
    _check_ints(step, bucket_id)
    cfg = settings_at(_check_cfg(cfg), step)
    plan = make_plan(S, shape, cfg, inputs[0].dtype)
    if cfg.error_feedback and (residuals is None or len(residuals) != W
                               or not all(isinstance(x, ResidualStore) for x in residuals)):
        raise ValueError(f"cfg.error_feedback needs residuals: one ResidualStore per rank ({W}) kept between calls")
    stores = residuals if cfg.error_feedback else [None] * W
    rkey = residual_key or _bucket_key(bucket_id, S)
    dtype, device = inputs[0].dtype, inputs[0].device
    outs = [torch.empty(plan.padded, dtype=dtype, device=device) for _ in range(W)]
    if not plan.levels or S == 0:
        if S:
            outs[0].copy_(inputs[0].float() * torch.tensor(post, dtype=torch.float32))
        return [o[:S] for o in outs]
    be = ops.get_backend(backend, device)
    pools = [BufferPool() for _ in range(W)]
    x_all = [_stage_input(plan, inputs[r], pools[r]) for r in range(W)]
    N = shape.num_nodes
    for c, (a, L) in enumerate(plan.chunks):
        l1 = plan.levels[0]
        msgs1 = []
        for r in range(W):
            send = _msg_buffers(pools[r], "send1", l1, plan, W * L, 0, W * L, device)
            msgs1.append(_first_send(plan, be, x_all[r][W * a:W * (a + L)], L, send,
                                     _key(plan, seed, step, bucket_id, l1, r, c),
                                     _residual(stores[r], plan, l1, rkey, c, W * L, device)))
        recv1 = _route(plan, l1, msgs1)
        if len(plan.levels) == 1:
            for r in range(W):
                _finish(plan, be, recv1[r], outs[r][a:a + L], post)
            continue
        l2 = plan.levels[1]
        msgs2 = []
        for r in range(W):
            send = _msg_buffers(pools[r], "send2", l2, plan, N * L, 0, N * L, device)
            msgs2.append(_mid_send(plan, be, recv1[r], send, _key(plan, seed, step, bucket_id, l2, r, c),
                                   _residual(stores[r], plan, l2, rkey, c, N * L, device)))
        recv2 = _route(plan, l2, msgs2)
        for r in range(W):
            _finish(plan, be, recv2[r], outs[r][a:a + L], post)
    return [o[:S] for o in outs]


@torch.no_grad()
def simulate_reduce_scatter(tensors: Sequence[Sequence[torch.Tensor]], shape: TopologyShape,
                            cfg: GradientsConfig, seed: int, step: int = 0, bucket_id: int = 0, op: str = "mean",
                            backend: str = "torch", residuals: Optional[List[ResidualStore]] = None,
                            residual_key: Optional[tuple] = None) -> List[List[torch.Tensor]]:
    """:meth:`GradientReducer.reduce_scatter` run for all ranks in one process (same layout, same bits).

    Args:
        tensors: per rank, the list of tensors that rank hands to ``reduce_scatter`` (same numels and dtype
            on every rank).
    Returns: per rank, the list of 1-D partitions that rank's ``reduce_scatter`` returns.
    """
    W = shape.world_size
    if len(tensors) != W:
        raise ValueError(f"tensors must hold one list per rank ({W}), got {len(tensors)}")
    numels = [t.numel() for t in tensors[0]]
    for r, ts in enumerate(tensors):
        if [t.numel() for t in ts] != numels:
            raise ValueError(f"tensors[{r}] has numels {[t.numel() for t in ts]}, tensors[0] {numels}")
    dtype = tensors[0][0].dtype
    _check_ints(step, bucket_id)
    cfg = settings_at(_check_cfg(cfg), step)
    parts, cols, S = list_layout(numels, W, list_unit(shape, cfg))
    Sp = make_plan(S, shape, cfg, dtype).padded
    flats = []
    for ts in tensors:
        buf = torch.empty(W, Sp, dtype=dtype, device=ts[0].device)
        _write_list_input(buf, ts, parts, cols)
        flats.append(buf.view(-1))
    outs = simulate_reduce_scatter_flat(flats, shape, cfg, seed, step=step, bucket_id=bucket_id, op=op,
                                        backend=backend, residuals=residuals,
                                        residual_key=residual_key or _bucket_key(bucket_id, tuple(numels)))
    return [_split_output(outs[r], numels, parts, cols, r) for r in range(W)]
