"""qWD: the ZeRO-3 weight all-gather as a 4-bit all-gather of weight *differences* to a persistent replica.

What is kept
------------
Every rank ``s`` owns an fp32 master shard ``master_flat`` [M] and the bf16 shard ``own_flat`` [M] of the
same parameters (DeepSpeed's flat partition: the concatenation over the parameters ``i`` of a sub-group of
their ``P_i``-element pieces; ``M`` is the same on every rank).  Copies of the other ranks' bf16 shards
(the *replica*) persist across steps in places the caller owns and hands in as destination views:

* ``level="full"``: every rank keeps all weights, so rank ``r`` applies the payload of every source.
* ``level="node"``: the DeepSpeed hpZ secondary partition kept across steps; with ``N`` nodes and ``g``
  ranks per node, rank ``(n, l)`` keeps primary partitions ``l*N .. l*N+N-1`` of every parameter, i.e. it
  applies the payloads of those ``N`` sources only.

Per step (:meth:`WeightDeltaAllGather.refresh`)
-----------------------------------------------
1. Owner: one fused op quantizes ``delta = master - float(own_flat)`` group-wise (``bits``, ``group_size``)
   and sets ``own_flat = cast(float(own_flat) + float(code) * scale)``.  The rounding error stays in the
   master-replica gap and re-enters the next delta, so the replica tracks the master to within one step's
   quantization error instead of drifting.  ``mode='direct'`` (the paper's qW ablation) quantizes the
   master itself and sets ``own_flat = cast(deq)``.  Stochastic rounding uses the stream
   ``make_key(seed, step, bucket_id, owner_rank)``: reproducible, never from a clock.
2. Wire format of one source: ``[codes (Mpad * bits / 8 bytes) | fp32 scales (4 * Mpad / group_size
   bytes)]`` in one uint8 buffer of ``B`` bytes (``Mpad`` = M padded to a whole group), so each level is a
   single collective carrying codes and scales together.
3. Inter-node all-gather among the ranks with the same local index: each payload crosses to every other
   node exactly once.  After it, rank ``(n, l)`` holds the payloads of sources ``(n', l)`` for all ``n'``.
4. Intra-node redistribution:
   * ``full``: an all-gather over the node (everyone needs everything, so nothing better exists).
   * ``node``: an all-to-all in which each rank sends each peer exactly the payloads that peer needs.
     Source ``s`` is needed on a node by exactly one local index, ``s // N``, so every received payload is
     forwarded at most once and each rank holds at most ``2N`` payloads (inter result and all-to-all
     result), never ``world`` of them.  An intra all-gather would have sent ``g - 1`` times as much and
     held ``g`` times the memory.  The inter rows are already ordered by destination (``(n'*g + l) // N``
     is non-decreasing in ``n'``), so the all-to-all reads them in place.
5. Receivers apply each payload to its destination pieces with the backend's fused
   ``dequant_add_segments_`` (op 6): one launch per source and destination buffer, whatever the pieces'
   offsets (group-aligned or not), with the owner's element-wise fp32 operations (no fused multiply-add),
   hence the owner's bits.  The destinations come either as prebuilt segment plans against one flat buffer
   (:func:`~deepspeed_sdp4bit.segments.make_segment_plan`, built once by the caller: nothing per piece per
   step) or as ``(view, offset)`` lists, which are grouped by the views' storage into plans cached across
   steps.  The own source's pieces (node level, or a full replica kept apart from ``own_flat``) are copied
   from ``own_flat``, which is bit-identical by construction.

Byte accounting (``stats``, per :meth:`refresh`, bytes this rank puts on the wire)
--------------------------------------------------------------------------------
With ``B = Mpad * bits / 8 + 4 * Mpad / group_size`` (``bits + 32 / group_size`` bits per value:
4.016 for 4 bits and group 2048):

* ``inter``: ``(N - 1) * B`` (a ring all-gather: every rank sends ``N - 1`` chunks of ``B`` bytes); values
  recorded ``(N - 1) * Mpad``, so ``stats.bits_per_value("inter")`` is exactly ``bits + 32 / group_size``.
* ``intra``, full: ``(g - 1) * N * B`` (ring all-gather of the ``N`` payloads each rank holds).
* ``intra``, node: ``B`` times the number of this rank's inter rows whose destination ``s // N`` is another
  local rank (the part sent to itself is a local copy and not counted); at most ``N * B``.
* ``baseline``: the same schedule carrying the unquantized ``M`` values of ``own_flat``'s dtype (2 bytes
  for bf16), so the compression ratio compares like with like.

:meth:`full_sync` (start, checkpoint load) sends ``own_flat`` unquantized over the same schedule and counts
its bytes in ``sync_stats`` rather than ``stats``, keeping the per-step numbers clean.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import reference as R
from ..config import WeightsConfig
from ..ops import get_backend
from ..segments import SegmentPlan, make_segment_plan
from ..topology import Topology, TopologyShape
from .stats import CommStats
from .buffers import BufferPool

LEVELS = ("node", "full")

DstItem = Union[torch.Tensor, Tuple[torch.Tensor, int], SegmentPlan]
DstMap = Dict[int, Union[SegmentPlan, Sequence[DstItem]]]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def sources_needed(shape: TopologyShape, level: str, rank: int) -> List[int]:
    """Data-parallel source ranks whose partitions ``rank`` keeps at ``level``, ascending."""
    W, N = shape.world_size, shape.num_nodes
    if not 0 <= rank < W:
        raise ValueError(f"rank must be in [0, {W}), got {rank}")
    if level == "full":
        return list(range(W))
    l = shape.local_of(rank)
    return list(range(l * N, l * N + N))


def make_plan(shape: TopologyShape, level: str, rank: int) -> dict:
    """Row layouts and split counts of both transport levels for one rank (pure topology arithmetic)."""
    sh, r = shape, rank
    N, g = sh.num_nodes, sh.gpus_per_node
    l = sh.local_of(r)
    inter_sources = [sh.rank_of(n2, l) for n2 in range(N)]  # row n2 of the inter all-gather result
    plan = {"inter_sources": inter_sources}
    if level == "full":
        plan["intra_needed"] = g > 1
        # intra all-gather output is [g, N] rows: row (l2, n2) holds source n2*g + l2.
        plan["out_sources"] = [sh.rank_of(n2, l2) for l2 in range(g) for n2 in range(N)]
        plan["intra_sent_rows"] = (g - 1) * N
    else:
        # With one node every rank keeps only its own partition; with one rank per node the inter
        # result is already everything: no intra step in either case.
        plan["intra_needed"] = N > 1 and g > 1
        dest = [s // N for s in inter_sources]  # the local index that keeps each inter row
        plan["send_rows"] = [dest.count(l2) for l2 in range(g)]
        mine = sources_needed(sh, level, r)
        by_peer = [[s for s in mine if sh.local_of(s) == l2] for l2 in range(g)]
        plan["recv_rows"] = [len(x) for x in by_peer]
        plan["out_sources"] = [s for x in by_peer for s in x]
        plan["intra_sent_rows"] = sum(c for l2, c in enumerate(plan["send_rows"]) if l2 != l)
    if not plan["intra_needed"]:
        # Then the inter rows are exactly what this rank keeps (g == 1: all sources; N == 1 at node
        # level: itself).
        plan["out_sources"] = inter_sources
        plan["intra_sent_rows"] = 0
    return plan


def expected_wire_bytes(M: int, shape: TopologyShape, cfg: WeightsConfig, level: Optional[str] = None,
                        rank: int = 0, dtype: torch.dtype = torch.bfloat16) -> Dict[str, int]:
    """Bytes ``rank`` sends in one :meth:`WeightDeltaAllGather.refresh` of an ``M``-element shard, by the
    formula of the module docstring (what ``stats`` counts): ``inter``, ``intra``, ``total`` and
    ``baseline`` (the same schedule with the unquantized values of ``dtype``)."""
    level = cfg.replica if level is None else level
    plan = make_plan(shape, level, rank)
    Mpad = R.padded_numel(M, cfg.group_size)
    B = R.payload_bytes(Mpad, cfg.bits) + 4 * (Mpad // cfg.group_size)
    inter_rows = shape.num_nodes - 1
    intra_rows = plan["intra_sent_rows"] if plan["intra_needed"] else 0
    size = torch.empty((), dtype=dtype).element_size()
    return {"inter": inter_rows * B, "intra": intra_rows * B, "total": (inter_rows + intra_rows) * B,
            "baseline": (inter_rows + intra_rows) * M * size}


class WeightDeltaAllGather:
    """The qWD weight all-gather of one data-parallel group (see the module docstring).

    Args:
        topology: a :class:`~deepspeed_sdp4bit.topology.Topology` (its ``intra_group``/``inter_group`` are
            used; ``group`` is the data-parallel group).
        cfg: :class:`~deepspeed_sdp4bit.config.WeightsConfig` (bits, group_size, rounding, mode).
        seed: seeds the stochastic-rounding streams.
        backend: kernel backend name for :func:`~deepspeed_sdp4bit.ops.get_backend` (resolved on the
            device of the first tensors seen).
        level: ``"node"`` or ``"full"``; default ``cfg.replica``.

    Attributes:
        stats: bytes this rank sends per level (``"inter"``, ``"intra"``) over :meth:`refresh` calls.
        sync_stats: the same for :meth:`full_sync`.
    """

    def __init__(self, topology: Topology, cfg: WeightsConfig, seed: int, backend: str = "auto",
                 level: Optional[str] = None):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a deepspeed_sdp4bit Topology, got {type(topology).__name__}")
        if not isinstance(cfg, WeightsConfig):
            raise TypeError(f"cfg must be a WeightsConfig, got {type(cfg).__name__}")
        level = cfg.replica if level is None else level
        if level is None:
            raise ValueError(f"level must be one of {LEVELS}: cfg.replica is omitted (the integration chooses it "
                             f"per run), so pass level=")
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.topology = topology
        self.shape = topology.shape
        self.rank = topology.rank
        self.cfg = cfg
        self.bits = int(cfg.bits)
        self.group_size = int(cfg.group_size)
        self.rounding = cfg.rounding
        self.mode = cfg.mode
        self.seed = seed
        self.level = level
        self.backend_name = backend
        self._backend = None
        self.stats = CommStats()
        self.sync_stats = CommStats()
        # Persistent buffers (send row, inter/intra receive rows), grown to the largest bucket seen and shared
        # by all buckets.
        self._pool = BufferPool()
        # Segment plans of (view, offset) destination lists, per (bucket, source): (signature, plans).
        self._view_plans: Dict[Tuple[int, int], Tuple[tuple, List[SegmentPlan]]] = {}
        self._checked = set()
        self._plan = self._make_plan()

    # ------------------------------------------------------------------------------------------------------
    # who needs what
    # ------------------------------------------------------------------------------------------------------
    def sources_needed(self, rank: Optional[int] = None) -> List[int]:
        """Data-parallel source ranks whose partitions ``rank`` (default: this rank) keeps, ascending."""
        return sources_needed(self.shape, self.level, self.rank if rank is None else rank)

    def _make_plan(self) -> dict:
        return make_plan(self.shape, self.level, self.rank)

    # ------------------------------------------------------------------------------------------------------
    # argument checks
    # ------------------------------------------------------------------------------------------------------
    def _resolve_backend(self, device: torch.device):
        if self._backend is None:
            self._backend = get_backend(self.backend_name, device)
        return self._backend

    def _normalize_dst(self, dst: DstMap, M: int, dtype: torch.dtype, device: torch.device, bucket_id: int
                       ) -> Dict[int, List[SegmentPlan]]:
        """``dst`` as {source: [segment plans]}: prebuilt plans checked against the partition of M (O(1) each),
        views checked one by one and grouped by storage into plans (cached while the views stay the same)."""
        if not isinstance(dst, dict):
            raise TypeError(f"dst must be a dict {{source rank: [views or (view, offset)]}}, got "
                            f"{type(dst).__name__}")
        needed = set(self.sources_needed())
        extra = sorted(set(dst) - needed)
        if extra:
            raise ValueError(f"dst has sources {extra} that rank {self.rank} does not keep at level "
                             f"{self.level!r} (it keeps {sorted(needed)})")
        # A needed source with no destination would leave that replica piece stale for good; only the own
        # source may be absent (its replica is own_flat itself).
        missing = sorted(needed - set(dst) - {self.rank})
        if missing:
            raise ValueError(f"dst lacks sources {missing} that rank {self.rank} keeps at level "
                             f"{self.level!r}; pass an empty list if a source has nothing here")
        out: Dict[int, List[SegmentPlan]] = {}
        for s, items in dst.items():
            if isinstance(items, torch.Tensor):
                raise TypeError(f"dst[{s}] must be a SegmentPlan or a list of views or (view, offset) pairs, not a "
                                "tensor")
            if isinstance(items, SegmentPlan):
                items = [items]
            pos = 0
            norm = []
            plans = []
            for k, item in enumerate(items):
                if isinstance(item, SegmentPlan):
                    b = item.dst
                    if b.dtype != dtype:
                        raise ValueError(f"dst[{s}][{k}]: the plan's buffer has dtype {b.dtype}; it must match "
                                         f"own_flat's {dtype} for the replicas to stay bit-identical")
                    if item.device != device:
                        raise ValueError(f"dst[{s}][{k}]: the plan is for {item.device}, own_flat is on {device}")
                    if item.src_end > M:
                        raise ValueError(f"dst[{s}][{k}]: the plan reads source elements up to {item.src_end}, "
                                         f"outside the partition [0, {M})")
                    plans.append(item)
                    continue
                if isinstance(item, torch.Tensor):
                    view, off = item, pos
                elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor):
                    view, off = item[0], int(item[1])
                else:
                    raise TypeError(f"dst[{s}][{k}] must be a tensor, a (tensor, source offset) pair or a "
                                    "SegmentPlan")
                L = view.numel()
                if view.dim() != 1 or not view.is_contiguous():
                    raise ValueError(f"dst[{s}][{k}] must be a contiguous 1-D view, got shape "
                                     f"{tuple(view.shape)} (contiguous={view.is_contiguous()})")
                if view.dtype != dtype:
                    raise ValueError(f"dst[{s}][{k}] has dtype {view.dtype}; it must match own_flat's "
                                     f"{dtype} for the replicas to stay bit-identical")
                if view.device != device:
                    raise ValueError(f"dst[{s}][{k}] is on {view.device}, own_flat on {device}")
                if off < 0 or off + L > M:
                    raise ValueError(f"dst[{s}][{k}] covers source elements [{off}, {off + L}), outside the "
                                     f"partition [0, {M})")
                norm.append((view, off))
                pos = off + L
            out[s] = plans + self._plans_of_views(int(bucket_id), s, norm)
        return out

    def _plans_of_views(self, bucket_id: int, s: int, items: List[Tuple[torch.Tensor, int]]) -> List[SegmentPlan]:
        """Segment plans of checked ``(view, offset)`` items of source ``s``: one per storage the views live in
        (the plan's buffer spans the storage), cached per (bucket, source) while the views stay the same."""
        items = [(v, off) for v, off in items if v.numel()]
        sig = tuple((v.untyped_storage().data_ptr(), v.storage_offset(), v.numel(), off) for v, off in items)
        hit = self._view_plans.get((bucket_id, s))
        if hit is not None and hit[0] == sig:
            return hit[1]
        groups: Dict[int, List[int]] = {}
        for k, (v, _) in enumerate(items):
            groups.setdefault(v.untyped_storage().data_ptr(), []).append(k)
        plans = []
        for idx in groups.values():
            v0 = items[idx[0]][0]
            st = v0.untyped_storage()
            base = torch.empty(0, dtype=v0.dtype, device=v0.device).set_(st, 0, (st.nbytes() // v0.element_size(),))
            try:
                plans.append(make_segment_plan([items[k][1] for k in idx], [items[k][0].storage_offset() for k in idx],
                                               [items[k][0].numel() for k in idx], base))
            except ValueError as e:  # name the items rather than the plan's segment numbers
                raise ValueError(f"dst[{s}]: views {idx} share a storage and {e}") from e
        # (the plans' buffers keep the storages alive, so a cached signature cannot match other tensors)
        self._view_plans[(bucket_id, s)] = (sig, plans)
        return plans

    def _check_consistent(self, M: int, bucket_id: int, device: torch.device) -> None:
        """Once per (bucket, M): all ranks agree on M and the settings (else collectives would hang)."""
        key = (bucket_id, M)
        if key in self._checked:
            return
        mode_id = ("diff", "direct").index(self.mode)
        vals = [M, self.bits, self.group_size, mode_id, LEVELS.index(self.level), bucket_id]
        t = torch.tensor(vals + [-v for v in vals], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.topology.group)
        hi, lo = t[: len(vals)].tolist(), [-v for v in t[len(vals):].tolist()]
        if hi != lo:
            names = ["M (partition numel)", "bits", "group_size", "mode", "level", "bucket_id"]
            bad = [f"{nm}: {a}..{b}" for nm, a, b in zip(names, lo, hi) if a != b]
            raise ValueError(f"WeightDeltaAllGather: ranks disagree on {', '.join(bad)} (rank {self.rank} "
                             f"has M={M}); every rank must pass partitions of the same size and config")
        self._checked.add(key)

    @staticmethod
    def _check_flat(name: str, t: torch.Tensor, dtypes=None) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
        if dtypes is not None and t.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")

    # ------------------------------------------------------------------------------------------------------
    # transport
    # ------------------------------------------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, B: int, pool: BufferPool, stats: CommStats, values: int,
                  baseline_row_bytes: int) -> Tuple[torch.Tensor, List[int]]:
        """Move every source's ``B``-byte row to the ranks that keep it.

        Args: send uint8 [B] (this rank's row); pool: where the "inter" / "intra" receive rows live.
        Returns: rows uint8 [R, B] and the source rank of each row.
        """
        plan = self._plan
        N = self.shape.num_nodes
        dev = send.device
        stats.begin_call()
        if N > 1:
            inter = pool.get("inter", N * B, torch.uint8, dev)
            _all_gather_single(inter, send, group=self.topology.inter_group)
            stats.add("inter", (N - 1) * B, (N - 1) * values)
            stats.add_baseline((N - 1) * baseline_row_bytes)
            inter = inter.view(N, B)
        else:
            inter = send.view(1, B)
        if not plan["intra_needed"]:
            return inter, plan["out_sources"]
        rows = len(plan["out_sources"])
        out = pool.get("intra", rows * B, torch.uint8, dev)
        if self.level == "full":
            _all_gather_single(out, inter.reshape(-1), group=self.topology.intra_group)
        else:
            dist.all_to_all_single(out, inter.reshape(-1), [c * B for c in plan["recv_rows"]],
                                   [c * B for c in plan["send_rows"]], group=self.topology.intra_group)
        k = plan["intra_sent_rows"]
        stats.add("intra", k * B, k * values)
        stats.add_baseline(k * baseline_row_bytes)
        return out.view(rows, B), plan["out_sources"]

    # ------------------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()  # the fp32 master is an optimizer Parameter: never record a graph
    def refresh(self, master_flat: torch.Tensor, own_flat: torch.Tensor, dst: DstMap, step: int,
                bucket_id: int = 0) -> None:
        """One qWD round: quantize this rank's delta, update ``own_flat``, apply every needed payload.

        Args:
            master_flat: fp32 [M], this rank's master shard.
            own_flat: bf16/fp16/fp32 [M], this rank's replica shard, updated in place.
            dst: {source rank: a :class:`~deepspeed_sdp4bit.segments.SegmentPlan` or a list of items}, an item
                being a SegmentPlan, a 1-D view (placed right after the previous view, the first at source
                offset 0) or a ``(view, source_offset)`` pair; view k receives source elements ``[offset,
                offset + len)``, a plan's segment ``(s0, d0, L)`` writes source elements ``[s0, s0 + L)`` to
                ``plan.dst[d0:d0 + L]``.  Prebuilt plans (built once by the caller against one flat buffer per
                sub-group, ``segments.make_segment_plan``) cost O(1) per step; views are checked every step
                and grouped into cached plans.  Every source of :meth:`sources_needed` other than this rank
                must be a key; this rank's items (if given) get a copy of the updated ``own_flat``.  No two
                pieces of one source may overlap.
            step: optimizer step (stochastic-rounding stream).
            bucket_id: distinguishes buckets of one step (stream; buffers are shared).
        """
        self._check_flat("master_flat", master_flat, (torch.float32,))
        self._check_flat("own_flat", own_flat, (torch.bfloat16, torch.float16, torch.float32))
        M = own_flat.numel()
        if M == 0:
            raise ValueError("own_flat is empty: a bucket must hold at least one element")
        if master_flat.numel() != M:
            raise ValueError(f"master_flat has {master_flat.numel()} elements but own_flat has {M}")
        if master_flat.device != own_flat.device:
            raise ValueError(f"master_flat is on {master_flat.device}, own_flat on {own_flat.device}")
        dev = own_flat.device
        views = self._normalize_dst(dst, M, own_flat.dtype, dev, int(bucket_id))
        self._check_consistent(M, int(bucket_id), dev)
        backend = self._resolve_backend(dev)
        bits, gs = self.bits, self.group_size
        Mpad = R.padded_numel(M, gs)
        G = Mpad // gs
        pb = R.payload_bytes(Mpad, bits)
        B = pb + 4 * G

        send = self._pool.get("send", B, torch.uint8, dev)
        key = R.make_key(self.seed, int(step), int(bucket_id), self.rank)
        backend.weight_delta_quantize(master_flat, own_flat, bits, gs, self.rounding,
                                      key if self.rounding == "stochastic" else None, 0, self.mode,
                                      out=send[:pb], out_scales=send[pb:].view(torch.float32))

        rows, sources = self._exchange(send, B, self._pool, self.stats, Mpad, M * own_flat.element_size())

        for row, s in zip(rows, sources):
            items = views.get(s)
            if not items:
                continue
            if s == self.rank:
                self._copy_own(own_flat, items)
                continue
            self._apply(row[:pb], row[pb:].view(torch.float32), items, backend, dev)
        if self.rank in views and self.rank not in sources:
            self._copy_own(own_flat, views[self.rank])

    @staticmethod
    def _copy_own(own_flat: torch.Tensor, plans: List[SegmentPlan], cache: bool = True) -> None:
        for plan in plans:
            plan.copy_from(own_flat, cache=cache)

    def _apply(self, payload: torch.Tensor, scales: torch.Tensor, plans: List[SegmentPlan], backend, dev) -> None:
        """Apply one source's payload to its pieces, bit-identical to the owner's update: one op 6 launch per
        destination buffer."""
        for plan in plans:
            backend.dequant_add_segments_(plan.dst, payload, scales, self.bits, self.group_size, self.mode, plan)

    # ------------------------------------------------------------------------------------------------------
    # exact resynchronisation
    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def full_sync(self, own_flat: torch.Tensor, dst: DstMap, master_flat: Optional[torch.Tensor] = None,
                  bucket_id: int = 0) -> None:
        """Exact (unquantized) broadcast of every ``own_flat`` to the same destinations as :meth:`refresh`.

        For the start of training and after a checkpoint load.  If ``master_flat`` (fp32 [M]) is given,
        ``own_flat`` is first set to ``cast(master_flat)``, so afterwards every replica copy equals
        ``cast(master)`` exactly and the next :meth:`refresh` sends only new differences.  Temporary buffers
        (``M * element_size`` bytes per row) are freed on return: this is rare, the per-step buffers stay
        small.

        Args: own_flat bf16/fp16/fp32 [M]; dst as in :meth:`refresh`; master_flat optional fp32 [M].
        """
        self._check_flat("own_flat", own_flat, (torch.bfloat16, torch.float16, torch.float32))
        M = own_flat.numel()
        if M == 0:
            raise ValueError("own_flat is empty: a bucket must hold at least one element")
        if master_flat is not None:
            self._check_flat("master_flat", master_flat, (torch.float32,))
            if master_flat.numel() != M:
                raise ValueError(f"master_flat has {master_flat.numel()} elements but own_flat has {M}")
            own_flat.copy_(master_flat)
        dev = own_flat.device
        views = self._normalize_dst(dst, M, own_flat.dtype, dev, int(bucket_id))
        self._check_consistent(M, int(bucket_id), dev)
        B = M * own_flat.element_size()
        send = own_flat.view(torch.uint8)
        # a pool of its own, dropped on return: these rows are M * element_size bytes, not 4-bit
        rows, sources = self._exchange(send, B, BufferPool(), self.sync_stats, M, B)
        for row, s in zip(rows, sources):
            items = views.get(s)
            if not items:
                continue
            if s == self.rank:
                self._copy_own(own_flat, items)
            else:  # a temporary row: no cached slices of it
                self._copy_own(row.view(own_flat.dtype), items, cache=False)
        if self.rank in views and self.rank not in sources:
            self._copy_own(own_flat, views[self.rank])

    def __repr__(self):
        return (f"WeightDeltaAllGather(level={self.level!r}, mode={self.mode!r}, bits={self.bits}, "
                f"group_size={self.group_size}, rounding={self.rounding!r}, rank={self.rank}, "
                f"{self.shape.num_nodes}x{self.shape.gpus_per_node})")
