"""Bytes each GPU sends per optimizer step, by collective and level: SDP4Bit vs ZeRO-3 vs ZeRO++ (a model).

The one bytes model of the project (the environment report ``python -m deepspeed_sdp4bit`` and
``benchmarks/projection.py`` use it).  SDP4Bit's rows come from the collectives' own formulas, which the tests
check against the bytes the collectives really send: :func:`collectives.gradients.expected_wire_bytes`
(TLq-HS) and :func:`collectives.weights.expected_wire_bytes` (qWD refresh).  Assumptions:

* ``params`` values, bf16 weights and gradients, DeepSpeed's even split (``ceil(params / W)`` per rank, one
  flat tensor: per-tensor padding and bucketing are ignored), data parallelism only, ``accum`` micro-steps
  per optimizer step (every micro-step gathers the weights twice and reduce-scatters the gradients; the
  weight refresh runs once per step).  For ZeRO-3 and ZeRO++ the backward gather is an upper bound: DeepSpeed
  keeps a parameter from forward to backward when its next use lies within ``stage3_max_reuse_distance`` (1e9
  elements by default) or was prefetched, and then sends nothing; counted (``examples/wire_count.py``), a 406M
  GPT is gathered once per step (``benchmarks/results/one_gpu/wire_counts.json``).
* Flat collectives over the world (level ``world``) are rings: each GPU sends ``(W - 1)`` chunks.
* ZeRO++ (DeepSpeed's qwZ + hpZ + qgZ): int8 forward all-gather over the world with one fp32 scale per 2048
  values, backward all-gather of the bf16 hpZ secondary partition inside the node, 4-bit gradients through
  an intra- then an inter-node all-to-all (modelled with the TLq-HS formula at 4/4 bits, one scale per 2048).
* SDP4Bit: the qWD refresh once per step; the forward/backward gathers stay bf16 inside the node
  (``replica="node"``: DeepSpeed's hpZ gathers of the node replica; with one node that is the world) or
  vanish (``replica="full"``); TLq-HS for the gradients.  A disabled half falls back to ZeRO-3's rows.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .config import GradientsConfig, SDP4BitConfig
from .topology import TopologyShape

BF16 = 2
# ZeRO++ quantizes weights to int8 and gradients to int4 with fp32 scales (taken as one per 2048 values).
ZEROPP_GROUP = 2048
SCHEMES = ("zero3", "zero++", "sdp4bit")


def _row(collective: str, level: str, nbytes: float, note: str) -> Dict[str, object]:
    return {"collective": collective, "level": level, "bytes": int(round(nbytes)), "note": note}


def _ring_all_gather(world: int, shard: int, bytes_per_value: float) -> float:
    return (world - 1) * shard * bytes_per_value


def step_bytes(scheme: str, params: int, shape: TopologyShape, cfg: Optional[SDP4BitConfig] = None,
               accum: int = 1) -> List[Dict[str, object]]:
    """Rows ``{"collective", "level" (intra/inter/world), "bytes" (per GPU per optimizer step), "note"}``.

    ``cfg`` (the parsed block) is needed for ``"sdp4bit"``; ``weights.replica`` must be ``"node"`` or
    ``"full"`` there.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if params < 1 or accum < 1:
        raise ValueError(f"params and accum must be >= 1, got {params} and {accum}")
    from .collectives import gradients as G
    from .collectives import weights as Wt

    W, N, g = shape.world_size, shape.num_nodes, shape.gpus_per_node
    S = -(-int(params) // W)                      # DeepSpeed's partition: ceil(P / W) per rank
    rows: List[Dict[str, object]] = []

    def zero3_gathers():
        rows.append(_row("forward all-gather", "world", accum * _ring_all_gather(W, S, BF16), "bf16"))
        rows.append(_row("backward all-gather", "world", accum * _ring_all_gather(W, S, BF16), "bf16"))

    def zero3_grads():
        rows.append(_row("gradient reduce-scatter", "world", accum * (W - 1) * S * BF16, "bf16 ring"))

    if scheme == "zero3":
        zero3_gathers()
        zero3_grads()
    elif scheme == "zero++":
        rows.append(_row("forward all-gather (qwZ)", "world",
                         accum * _ring_all_gather(W, S, 1 + 4 / ZEROPP_GROUP), "int8 + fp32 scale / 2048"))
        sec = -(-int(params) // g)                # hpZ secondary partition: the node holds the model
        rows.append(_row("backward all-gather (hpZ)", "intra", accum * (g - 1) * sec * BF16, "bf16, in the node"))
        q = G.expected_wire_bytes(S, shape, GradientsConfig(intra_bits=4, inter_bits=4, group_size=ZEROPP_GROUP,
                                                            hadamard=False))
        for lvl in ("intra", "inter"):
            if q[lvl]:
                rows.append(_row("gradient all-to-all (qgZ)", lvl, accum * q[lvl], "int4 + fp32 scale / 2048"))
    else:
        if cfg is None:
            raise ValueError("step_bytes('sdp4bit', ...) needs the parsed sdp4bit block (cfg)")
        if cfg.weights.enabled and cfg.enabled:
            level = cfg.weights.replica
            if level not in Wt.LEVELS:
                raise ValueError(f"sdp4bit.weights.replica must be one of {Wt.LEVELS} here, got {level!r}")
            # the busiest rank of the node (the intra share of the node level depends on the local index)
            ref = [Wt.expected_wire_bytes(S, shape, cfg.weights, level, r) for r in range(g)]
            busiest = max(ref, key=lambda d: d["total"])
            what = f"{cfg.weights.bits}-bit {cfg.weights.mode} + fp32 scale / {cfg.weights.group_size}"
            for lvl in ("intra", "inter"):
                if busiest[lvl]:
                    rows.append(_row("weight refresh (qWD)", lvl, busiest[lvl], what))
            if level == "node":
                # DeepSpeed's hpZ gathers of the node replica (one node: each rank's own partition, the world)
                sec = -(-int(params) // g)
                for when in ("forward", "backward"):
                    rows.append(_row(f"{when} all-gather (node replica)", "intra", accum * (g - 1) * sec * BF16,
                                     "bf16, in the node"))
        else:
            zero3_gathers()
        if cfg.gradients.enabled and cfg.enabled:
            q = G.expected_wire_bytes(S, shape, cfg.gradients)
            for lvl, bits in (("intra", cfg.gradients.intra_bits), ("inter", cfg.gradients.inter_bits)):
                if q[lvl]:
                    what = ("bf16" if bits == 16 else f"{bits}-bit + fp32 scale / {cfg.gradients.group_size}"
                            + (", Hadamard" if cfg.gradients.hadamard else ""))
                    rows.append(_row("gradient all-to-all (TLq-HS)", lvl, accum * q[lvl], what))
        else:
            zero3_grads()
    return [r for r in rows if r["bytes"]]


def totals(rows: List[Dict[str, object]]) -> Dict[str, int]:
    """Bytes per level and ``"total"`` of :func:`step_bytes` rows."""
    out: Dict[str, int] = {}
    for r in rows:
        out[r["level"]] = out.get(r["level"], 0) + r["bytes"]
    out["total"] = sum(r["bytes"] for r in rows)
    return out


def node_link_bytes(rows: List[Dict[str, object]], shape: TopologyShape) -> float:
    """Bytes crossing one node's inter-node link per step: the ``inter`` rows of its GPUs, plus the share of
    each flat (``world``) ring that has to leave the node, ``(N - 1) / N`` of the payload, a lower bound that
    NCCL's rings approach."""
    W, N, g = shape.world_size, shape.num_nodes, shape.gpus_per_node
    inter = sum(r["bytes"] for r in rows if r["level"] == "inter") * g
    world = sum(r["bytes"] for r in rows if r["level"] == "world")
    if W > 1 and N > 1:
        inter += world / (W - 1) * W * (N - 1) / N   # the payload is the per-GPU bytes * W / (W - 1)
    return inter
