"""Count the bytes each rank sends through ``torch.distributed`` collectives, whoever issues them.

DeepSpeed (ZeRO-3 gathers and reduce-scatters, ZeRO++'s quantized ones, persistent-parameter all-reduces) and
SDP4Bit's collectives all go through the ``torch.distributed`` functions patched here, so one counter measures
every config alike, where a formula would have to know, for instance, whether ZeRO-3 gathers a parameter again
in backward (it does not while the parameter's next use lies within ``stage3_max_reuse_distance`` elements).

:func:`install` must run before DeepSpeed is imported (``deepspeed.comm`` keeps references to the functions it
finds when it starts).  Bytes a rank sends per call, for a group of ``g`` ranks (what a ring or pairwise
exchange sends; NCCL's tree and in-network algorithms differ, the data volume does not):

===================================  =======================================
all_gather_into_tensor(out, in)      ``in.nbytes * (g - 1)`` (also all_gather_single, _all_gather_base)
all_gather(list, t)                  ``t.nbytes * (g - 1)``
all_gather_coalesced(lists, ins)     ``sum(ins nbytes) * (g - 1)``
reduce_scatter_tensor(out, in)       ``in.nbytes * (g - 1) / g`` (also reduce_scatter_single, _base)
reduce_scatter(out, list)            ``sum(list nbytes) * (g - 1) / g``
all_to_all_single(out, in, ...)      ``in.nbytes`` less the rank's own split
all_to_all(outs, ins)                ``sum(ins nbytes)`` less the rank's own
all_reduce(t), all_reduce_coalesced  ``2 * nbytes * (g - 1) / g``
broadcast(t), reduce(t)              ``t.nbytes * (g - 1) / g`` (a chain's bytes, averaged over its ranks)
scatter(t, list, src)                the source: ``sum(list nbytes)`` less its own; the others nothing
gather(t, list, dst)                 ``t.nbytes`` on every rank but the destination
send(t), isend(t), batch_isend_irecv  the bytes of the sends (receives send nothing)
===================================  =======================================

A call is counted once it has returned (a call that raises is not), and a call made from inside another counted
call (torch's deprecated names call the new ones) is not counted again.

Counts are per rank, by ``"<op>@<group size>:<intra|inter>"``: ``inter`` where the group spans several nodes
(node = global rank // ``LOCAL_WORLD_SIZE``, as torchrun and ``benchmarks/share_gpu.py`` set it), so its ring or
exchange crosses the inter-node link (a point-to-point send: where its peer is on another node);
:func:`snapshot` returns the running totals (a step's bytes are the difference of two snapshots).
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Callable, Dict, Optional

_COUNTS: Dict[str, float] = {}
_ORIG: Dict[str, Callable] = {}
_INSIDE = threading.local()   # a counted call made by another one (torch's deprecated names call the new ones)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    import torch.distributed as dist
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


_SPANS: Dict[object, bool] = {}


def _node(rank: int) -> int:
    return rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _spans_nodes(group) -> bool:
    """Whether the group's ranks sit on more than one node (cached per group)."""
    import torch.distributed as dist
    if group not in _SPANS:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        _SPANS[group] = len({_node(r) for r in ranks}) > 1
    return _SPANS[group]


def _p2p_sent(name: str, args, kwargs) -> Dict[str, float]:
    """Bytes of point-to-point sends by ``"<op>@<group size>:<intra|inter>"``, the span from the peer's node."""
    import torch.distributed as dist

    def global_peer(group, peer, group_peer):
        if group_peer is not None and group is not None:
            return dist.get_global_rank(group, group_peer)
        return group_peer if peer is None else peer

    if name in ("send", "isend"):
        names = ("tensor", "dst", "group")
        full = dict(zip(names, args))
        full.update(kwargs)
        sends = [(full["tensor"], full.get("group"), global_peer(full.get("group"), full.get("dst"),
                                                                  full.get("group_dst")))]
    else:   # batch_isend_irecv
        ops = args[0] if args else kwargs.get("p2p_op_list") or []
        sends = [(o.tensor, getattr(o, "group", None), global_peer(getattr(o, "group", None), o.peer,
                                                                   getattr(o, "group_peer", None)))
                 for o in ops if getattr(getattr(o, "op", None), "__name__", "") in ("isend", "send")]
    out: Dict[str, float] = {}
    me = dist.get_rank()
    for t, group, peer in sends:
        g = _group_size(group)
        span = "inter" if peer is None or _node(peer) != _node(me) else "intra"
        key = f"{name}@{g}:{span}"
        out[key] = out.get(key, 0.0) + _nbytes(t)
    return out


# where each collective takes its ``group`` when given by position
_GROUP_POS = {"all_gather_into_tensor": 2, "_all_gather_base": 2, "all_gather_single": 2, "all_gather": 2,
              "all_gather_coalesced": 2, "reduce_scatter_tensor": 3, "_reduce_scatter_base": 3,
              "reduce_scatter_single": 3, "reduce_scatter": 3, "all_to_all_single": 4, "all_to_all": 2,
              "all_reduce": 2, "all_reduce_coalesced": 2, "broadcast": 2, "reduce": 3, "scatter": 3, "gather": 3}


def _group_arg(name: str, args, kwargs):
    """The ``group`` a call was given (None: the world)."""
    if "group" in kwargs:
        return kwargs["group"]
    pos = _GROUP_POS[name]
    return args[pos] if len(args) > pos else None


def _sent(name: str, args, kwargs, group, g: int) -> float:
    """Bytes this rank sends in one call of a collective over ``group`` of ``g`` ranks (the module's table)."""
    import torch.distributed as dist

    def arg(i, key):
        return kwargs[key] if key in kwargs else (args[i] if len(args) > i else None)

    def my_rank():
        return dist.get_rank(group) if group is not None else dist.get_rank()

    if name in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
        return _nbytes(arg(1, "input_tensor")) * (g - 1)
    if name == "all_gather":
        return _nbytes(arg(1, "tensor")) * (g - 1)
    if name == "all_gather_coalesced":
        return sum(_nbytes(t) for t in arg(1, "input_tensor_list")) * (g - 1)
    if name in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single"):
        return _nbytes(arg(1, "input")) * (g - 1) / g
    if name == "reduce_scatter":
        return sum(_nbytes(t) for t in arg(1, "input_list")) * (g - 1) / g
    if name == "all_to_all_single":
        inp, splits = arg(1, "input"), arg(3, "input_split_sizes")
        if splits:   # less the rows this rank keeps
            row = _nbytes(inp) // max(1, inp.shape[0]) if inp.dim() else inp.element_size()
            return _nbytes(inp) - splits[my_rank()] * row
        return _nbytes(inp) * (g - 1) / g
    if name == "all_to_all":
        me = my_rank()
        return sum(_nbytes(t) for i, t in enumerate(arg(1, "input_tensor_list")) if i != me)
    if name in ("all_reduce", "all_reduce_coalesced"):
        t = arg(0, "tensor" if name == "all_reduce" else "tensors")
        n = sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else _nbytes(t)
        return 2 * n * (g - 1) / g
    if name in ("broadcast", "reduce"):
        return _nbytes(arg(0, "tensor")) * (g - 1) / g
    if name in ("scatter", "gather"):
        t, lst = arg(0, "tensor"), arg(1, "scatter_list" if name == "scatter" else "gather_list")
        local = kwargs.get("group_src" if name == "scatter" else "group_dst")
        if local is not None:   # the root as a rank of the group
            is_root = my_rank() == local
        else:                   # the root as a global rank
            is_root = dist.get_rank() == arg(2, "src" if name == "scatter" else "dst")
        if name == "scatter":
            return sum(_nbytes(x) for x in (lst or [])) - _nbytes(t) if is_root else 0
        return 0 if is_root else _nbytes(t)
    raise KeyError(name)


_P2P = ("send", "isend", "batch_isend_irecv")
_OPS = tuple(_GROUP_POS) + _P2P


def install() -> None:
    """Patch the collectives of ``torch.distributed`` (and of ``distributed_c10d``, where DeepSpeed's coalesced
    gathers look them up) to count; idempotent."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _ORIG:
        return
    for name in _OPS:
        orig = getattr(c10d, name, None) or getattr(dist, name, None)
        if orig is None:
            continue
        _ORIG[name] = orig

        @functools.wraps(orig)
        def counted(*args, __name=name, __orig=orig, **kwargs):
            if getattr(_INSIDE, "depth", 0):   # the outer call counts these bytes
                return __orig(*args, **kwargs)
            _INSIDE.depth = 1
            try:
                out = __orig(*args, **kwargs)
            finally:
                _INSIDE.depth = 0
            try:
                if __name in _P2P:
                    sent = _p2p_sent(__name, args, kwargs)
                else:
                    group = _group_arg(__name, args, kwargs)
                    g = _group_size(group)
                    b = _sent(__name, args, kwargs, group, g) if g > 1 else 0
                    span = "inter" if b and _spans_nodes(group) else "intra"
                    sent = {f"{__name.lstrip('_')}@{g}:{span}": float(b)} if b else {}
            except Exception as e:  # noqa: BLE001 - a count that cannot be made must not pass as zero
                raise RuntimeError(f"wire_count: cannot count {__name}: {type(e).__name__}: {e}") from e
            for key, b in sent.items():
                _COUNTS[key] = _COUNTS.get(key, 0.0) + b
            return out

        for mod in (dist, c10d):
            if getattr(mod, name, None) is orig:
                setattr(mod, name, counted)


def installed() -> bool:
    return bool(_ORIG)


def snapshot() -> Dict[str, float]:
    """Running totals (bytes this rank sent) by ``"<op>@<group size>:<intra|inter>"``."""
    return dict(_COUNTS)


def delta(after: Dict[str, float], before: Optional[Dict[str, float]]) -> Dict[str, float]:
    """``after - before`` per key (keys with nothing sent in between left out)."""
    before = before or {}
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}
