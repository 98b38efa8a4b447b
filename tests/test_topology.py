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
