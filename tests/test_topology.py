"""Topology: the injected nodes x ranks-per-node layout and its process groups on 4 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from deepspeed_sdp4bit.topology import Topology, TopologyShape, resolve_gpus_per_node
from dist_utils import run_distributed


def test_shape_arithmetic():
    s = TopologyShape(2, 3)
    assert s.world_size == 6
    assert [s.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [s.local_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert s.intra_ranks(1) == [3, 4, 5] and s.inter_ranks(2) == [2, 5]
    with pytest.raises(ValueError):
        TopologyShape(0, 2)


def test_resolve_gpus_per_node(monkeypatch):
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_gpus_per_node(None, 8) == 2
    assert resolve_gpus_per_node(4, 8) == 4
    with pytest.raises(ValueError, match="divide"):
        resolve_gpus_per_node(3, 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        resolve_gpus_per_node(None, 8)


def _groups_worker(rank, world, gpus_per_node):
    topo = Topology.build(gpus_per_node)
    t = torch.tensor([float(rank)])
    intra = t.clone()
    dist.all_reduce(intra, group=topo.intra_group)
    inter = t.clone()
    dist.all_reduce(inter, group=topo.inter_group)
    return topo.node, topo.local, float(intra), float(inter), topo.describe()


@pytest.mark.parametrize("gpn", [2, 1, 4])
def test_groups_on_four_gloo_ranks(gpn):
    res = run_distributed(_groups_worker, 4, args=(gpn,))
    shape = TopologyShape(4 // gpn, gpn)
    for r, (node, local, intra, inter, _) in enumerate(res):
        assert (node, local) == (shape.node_of(r), shape.local_of(r))
        assert intra == sum(shape.intra_ranks(node))
        assert inter == sum(shape.inter_ranks(local))


def _auto_worker(rank, world):
    return Topology.build(None).gpus_per_node


def test_auto_uses_the_launchers_local_size_not_the_hardware():
    # 4 ranks started as 2 "hosts" of 2 ranks each
    assert run_distributed(_auto_worker, 4, local_world_size=2) == [2, 2, 2, 2]


def _probe_worker(rank, world, gpn):
    topo = Topology.build(gpn)
    sent = []
    orig = dist.all_gather_into_tensor

    def counted(out, x, group=None, **k):   # what the probe puts on the inter-node groups
        sent.append((x.numel() * x.element_size(), dist.get_world_size(group)))
        return orig(out, x, group=group, **k)
    dist.all_gather_into_tensor = counted
    try:
        gbps = topo.probe_inter_gbps("cpu", mib=0.25, calls=2)
    finally:
        dist.all_gather_into_tensor = orig
    return gbps, sent


def test_link_probe_times_the_inter_node_groups_and_every_rank_reads_the_same():
    res = run_distributed(_probe_worker, 4, args=(2,))
    assert len({g for g, _ in res}) == 1 and 0 < res[0][0] < float("inf")
    for _, sent in res:   # one untimed call and two timed ones, 0.25 MiB each over a group of the 2 nodes
        assert sent == [(1 << 18, 2)] * 3
    four = run_distributed(_probe_worker, 4, args=(1,))   # 4 nodes: each rank still sends 0.25 MiB a call
    assert len({g for g, _ in four}) == 1 and all(sent == [((1 << 18) // 3, 4)] * 3 for _, sent in four)
    one = run_distributed(_probe_worker, 4, args=(4,))   # one node: no link to probe, nothing sent
    assert all(g == float("inf") and sent == [] for g, sent in one)
    with pytest.raises(ValueError, match="calls >= 1 and mib > 0"):
        Topology(shape=TopologyShape(2, 1), rank=0, group=None, global_ranks=[0, 1]).probe_inter_gbps("cpu", calls=0)
