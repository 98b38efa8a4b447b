"""Nodes x GPUs-per-node over the data-parallel group, injected rather than read from the hardware.

Data-parallel rank ``r`` lives on node ``r // gpus_per_node`` with local index ``r % gpus_per_node``.
Intra-node groups hold the ranks of one node; inter-node groups hold the ranks with one local index (one
per node).  Because the shape is given, one host can act as several logical nodes (4 GPUs as 2 x 2) and CPU
tests can run 2 nodes x 2 ranks with gloo.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TopologyShape:
    """Pure arithmetic of the layout; no process groups (usable in single-process simulations)."""

    num_nodes: int
    gpus_per_node: int

    def __post_init__(self):
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"topology needs num_nodes >= 1 and gpus_per_node >= 1, got "
                             f"{self.num_nodes} x {self.gpus_per_node}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def rank_of(self, node: int, local: int) -> int:
        return node * self.gpus_per_node + local

    def intra_ranks(self, node: int) -> List[int]:
        """Data-parallel ranks of one node, by local index."""
        return [self.rank_of(node, l) for l in range(self.gpus_per_node)]

    def inter_ranks(self, local: int) -> List[int]:
        """Data-parallel ranks with one local index, by node."""
        return [self.rank_of(n, local) for n in range(self.num_nodes)]


def launcher_ranks_per_host() -> Optional[int]:
    """This host's ranks as the launcher says (``LOCAL_WORLD_SIZE``, or ``LOCAL_SIZE``), None where unset."""
    env = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return None if env is None else int(env)


def resolve_gpus_per_node(setting: Optional[int], world_size: int) -> int:
    """``gpus_per_node`` from the config: an int, or None (the key omitted) = the launcher's LOCAL_WORLD_SIZE.

    The automatic choice never looks at ``torch.cuda.device_count()``: the launcher knows how many ranks it
    started on this host, the hardware does not know how the user wants the job split into nodes.
    """
    if setting is None:
        gpn = launcher_ranks_per_host()
        if gpn is None:
            raise ValueError("sdp4bit.topology.gpus_per_node is omitted (= the launcher's LOCAL_WORLD_SIZE) but "
                             "LOCAL_WORLD_SIZE is not set (the deepspeed launcher and torchrun set it); set "
                             "gpus_per_node to an integer")
    else:
        gpn = int(setting)
    if gpn < 1 or world_size % gpn:
        what = (f"sdp4bit.topology.gpus_per_node={gpn}" if setting is not None else
                f"the launcher's ranks per host (LOCAL_WORLD_SIZE={gpn}; sdp4bit.topology.gpus_per_node omitted)")
        raise ValueError(f"{what} must divide the data-parallel world size {world_size}")
    return gpn


def job_gpus_per_node(setting: Optional[int], world_size: int) -> int:
    """``gpus_per_node`` of a job of ``world_size`` ranks, as the integration plans it: 1 for a single process
    (which needs no launcher, so no LOCAL_WORLD_SIZE), a configured node larger than the job clamped to the job
    (every rank on one node), else :func:`resolve_gpus_per_node`."""
    if world_size == 1:
        return 1
    if setting is not None and int(setting) >= world_size:
        setting = world_size
    return resolve_gpus_per_node(setting, world_size)


@dataclass
class Topology:
    """The layout over a live data-parallel group, with its intra- and inter-node process groups.

    Build with :meth:`build`; every rank of the world must call it (``new_group`` is collective).
    """

    shape: TopologyShape
    rank: int                      # data-parallel rank
    group: Optional[object]        # the data-parallel group (None = WORLD)
    global_ranks: List[int]        # global rank of each data-parallel rank
    intra_group: Optional[object] = field(default=None, repr=False)
    inter_group: Optional[object] = field(default=None, repr=False)

    @property
    def num_nodes(self) -> int:
        return self.shape.num_nodes

    @property
    def gpus_per_node(self) -> int:
        return self.shape.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def node(self) -> int:
        return self.shape.node_of(self.rank)

    @property
    def local(self) -> int:
        return self.shape.local_of(self.rank)

    @classmethod
    def build(cls, gpus_per_node: Optional[int], group=None) -> "Topology":
        """Create the topology over ``group`` (default: WORLD) with subgroups on every rank.

        Only a data-parallel group equal to the world is supported for now: creating the subgroups of several
        data-parallel groups needs every group's membership, which a model-parallel engine would have to pass.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before building an sdp4bit Topology")
        world = dist.get_world_size()
        size = dist.get_world_size(group)
        if size != world:
            raise NotImplementedError(
                f"sdp4bit needs the data-parallel group to be the whole world (got {size} of {world} ranks); "
                "model parallelism together with sdp4bit is not supported yet")
        global_ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
        gpn = job_gpus_per_node(gpus_per_node, size)   # (a node larger than the job: the job is one node)
        shape = TopologyShape(size // gpn, gpn)
        rank = dist.get_rank(group)
        intra = inter = None
        # Every rank creates every subgroup in the same order (new_group is collective over the world).
        for node in range(shape.num_nodes):
            g = dist.new_group([global_ranks[r] for r in shape.intra_ranks(node)])
            if node == shape.node_of(rank):
                intra = g
        for local in range(shape.gpus_per_node):
            g = dist.new_group([global_ranks[r] for r in shape.inter_ranks(local)])
            if local == shape.local_of(rank):
                inter = g
        return cls(shape=shape, rank=rank, group=group, global_ranks=global_ranks, intra_group=intra,
                   inter_group=inter)

    def probe_inter_gbps(self, device, mib: float = 8.0, calls: int = 3) -> float:
        """The link between nodes as the weight refresh uses it: Gb/s per rank of an all-gather over the inter-node
        groups, every group at once (the node's ranks share its link, as in a step), in which each rank sends
        ``mib`` MiB whatever the number of nodes (chunks of ``mib / (num_nodes - 1)`` MiB, at least 64 KiB).

        One untimed call, then ``calls`` timed ones, each after a barrier over the data-parallel group and a
        device synchronize; rate = the bytes a rank sends in a ring all-gather, ``(num_nodes - 1)`` chunks, x 8 /
        the slowest rank's median time.  Every rank returns the same number (``inf`` on one node: no link to
        measure).  Collective over the data-parallel group.
        """
        if calls < 1 or not mib > 0:
            raise ValueError(f"probe_inter_gbps needs calls >= 1 and mib > 0, got calls={calls}, mib={mib}")
        if self.num_nodes == 1:
            return math.inf
        device = torch.device(device)
        n = max(1 << 16, int(mib * (1 << 20)) // (self.num_nodes - 1))
        x = torch.arange(n, dtype=torch.int32, device=device).to(torch.uint8)   # (not zeros)
        out = torch.empty(self.num_nodes * n, dtype=torch.uint8, device=device)
        tick = torch.zeros(1, dtype=torch.float32, device=device)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def barrier():
            dist.all_reduce(tick, group=self.group)
            sync()

        dist.all_gather_into_tensor(out, x, group=self.inter_group)   # (connections set up, untimed)
        times = []
        for _ in range(calls):
            barrier()
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(out, x, group=self.inter_group)
            sync()
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
        return (self.num_nodes - 1) * n * 8 / max(float(slowest.item()), 1e-9) / 1e9

    def describe(self) -> str:
        return (f"{self.num_nodes} node(s) x {self.gpus_per_node} rank(s) per node; data-parallel rank "
                f"{self.rank} = node {self.node}, local {self.local}")
