"""examples/wire_count.py: the bytes each rank sends, per collective, on 2 gloo ranks (a node each, so every
group crosses nodes) and on 2 ranks of one node."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

from dist_utils import run_distributed  # noqa: E402


def _worker(rank, world):
    import torch
    import torch.distributed as dist
    import wire_count

    wire_count.install()
    wire_count.install()   # idempotent
    t = torch.ones(1000, dtype=torch.float32)   # 4000 bytes
    out = {}

    def step(name, fn):
        before = wire_count.snapshot()
        fn()
        out[name] = wire_count.delta(wire_count.snapshot(), before)

    step("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(2000), t))
    step("all_gather_by_position", lambda: dist.all_gather_into_tensor(torch.empty(2000), t, None))
    step("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(500), t))
    step("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(1000), t))
    splits = [300, 700] if rank == 0 else [700, 300]   # each rank sends 700 rows to the other, keeps 300
    step("all_to_all_uneven", lambda: dist.all_to_all_single(torch.empty(1000), t, splits, splits))
    step("all_reduce", lambda: dist.all_reduce(t.clone()))
    step("broadcast", lambda: dist.broadcast(t.clone(), 0))
    step("all_gather_list", lambda: dist.all_gather([torch.empty(1000), torch.empty(1000)], t))
    step("reduce_scatter_list", lambda: dist.reduce_scatter(torch.empty(1000), [t.clone(), t.clone()]))
    step("all_to_all_list", lambda: dist.all_to_all([torch.empty(500), torch.empty(500)],
                                                    [torch.ones(500), torch.ones(500)]))
    step("gather", lambda: dist.gather(t, [torch.empty(1000), torch.empty(1000)] if rank == 0 else None, dst=0))
    step("scatter", lambda: dist.scatter(torch.empty(1000), [t.clone(), t.clone()] if rank == 0 else None, src=0))

    def p2p():
        ops = [dist.P2POp(dist.isend, t, 1 - rank), dist.P2POp(dist.irecv, torch.empty(1000), 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    step("batch_isend_irecv", p2p)
    t2 = torch.ones(1000)
    step("_all_gather_base", lambda: dist.distributed_c10d._all_gather_base(torch.empty(2000), t2))
    step("all_gather_single", lambda: dist.distributed_c10d.all_gather_single(torch.empty(2000), t2))
    step("all_gather_coalesced", lambda: dist.all_gather_coalesced([[torch.empty(1000)] for _ in range(world)], [t2]))
    step("reduce_scatter_single", lambda: dist.distributed_c10d.reduce_scatter_single(torch.empty(500), t2))
    step("reduce", lambda: dist.reduce(t2.clone(), 0))
    step("all_reduce_coalesced", lambda: dist.all_reduce_coalesced([t2.clone()]))

    def send_recv(fn_send, fn_recv):
        def go():
            if rank == 0:
                w = fn_send(t2, 1)
            else:
                w = fn_recv(torch.empty(1000), 0)
            if hasattr(w, "wait"):   # isend / irecv give a work handle; send / recv finish in the call
                w.wait()
        return go
    step("send", send_recv(dist.send, dist.recv))          # send calls isend: counted once
    step("isend", send_recv(dist.isend, dist.irecv))
    step("scatter_group_src", lambda: dist.scatter(torch.empty(1000), [t2.clone(), t2.clone()] if rank == 0 else None,
                                                   group_src=0))
    step("gather_group_dst", lambda: dist.gather(t2, [torch.empty(1000), torch.empty(1000)] if rank == 0 else None,
                                                 group_dst=0))
    try:   # a call that fails is not counted
        dist.all_to_all_single(torch.empty(3), torch.empty(5))
    except Exception:  # noqa: BLE001
        pass
    out["failed_left_no_count"] = wire_count.snapshot() == wire_count.snapshot() and \
        sum(wire_count.snapshot().values()) == sum(sum(v.values()) for v in out.values() if isinstance(v, dict))
    return out


@pytest.mark.parametrize("local", [1, 2], ids=["two-nodes", "one-node"])
def test_bytes_each_rank_sends(local):
    runs = run_distributed(_worker, 2, (), local_world_size=local)
    span = "inter" if local == 1 else "intra"
    for rank, r in enumerate(runs):
        def one(name):
            (k, v), = r[name].items()
            assert k.endswith(f"@2:{span}"), k
            return k.split("@")[0], v
        assert one("all_gather_into_tensor") == ("all_gather_into_tensor", 4000)
        assert one("all_gather_by_position") == ("all_gather_into_tensor", 4000)
        assert one("reduce_scatter_tensor") == ("reduce_scatter_tensor", 2000)
        assert one("all_to_all_single") == ("all_to_all_single", 2000)
        # uneven splits: what goes to the other rank (rows of 4 bytes)
        assert one("all_to_all_uneven") == ("all_to_all_single", 700 * 4)
        assert one("all_reduce") == ("all_reduce", 4000)
        assert one("broadcast") == ("broadcast", 2000)
        assert one("all_gather_list") == ("all_gather", 4000)
        assert one("reduce_scatter_list") == ("reduce_scatter", 4000)
        assert one("all_to_all_list") == ("all_to_all", 2000)
        assert r["gather"] == ({} if rank == 0 else {f"gather@2:{span}": 4000})
        assert r["scatter"] == ({f"scatter@2:{span}": 4000} if rank == 0 else {})
        assert one("batch_isend_irecv") == ("batch_isend_irecv", 4000)
        assert r["failed_left_no_count"]
        for name, op in (("_all_gather_base", "all_gather_base"), ("all_gather_single", "all_gather_single")):
            assert one(name) == (op, 4000)   # once, though one calls the other
        assert one("all_gather_coalesced") == ("all_gather_coalesced", 4000)
        assert one("reduce_scatter_single") == ("reduce_scatter_single", 2000)
        assert one("reduce") == ("reduce", 2000)
        assert one("all_reduce_coalesced") == ("all_reduce_coalesced", 4000)
        for name in ("send", "isend"):
            assert r[name] == ({f"{name}@2:{span}": 4000} if rank == 0 else {}), (name, r[name])
        assert r["scatter_group_src"] == ({f"scatter@2:{span}": 4000} if rank == 0 else {})
        assert r["gather_group_dst"] == ({} if rank == 0 else {f"gather@2:{span}": 4000})


def _p2p_worker(rank, world):
    import torch
    import torch.distributed as dist
    import wire_count

    wire_count.install()
    t = torch.ones(1000)
    peer = rank ^ 1      # the other rank of the same node (2 ranks per node)
    far = (rank + 2) % 4  # a rank of the other node
    out = {}
    for name, p in (("near", peer), ("far", far)):
        before = wire_count.snapshot()
        ops = [dist.P2POp(dist.isend, t, p), dist.P2POp(dist.irecv, torch.empty(1000), p)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out[name] = wire_count.delta(wire_count.snapshot(), before)
    return out


def test_a_send_crosses_nodes_where_its_peer_is_on_another_node():
    # 4 ranks, 2 per node: the world group spans nodes, a send to the node's other rank does not cross them
    for r in run_distributed(_p2p_worker, 4, (), local_world_size=2):
        assert r["near"] == {"batch_isend_irecv@4:intra": 4000}
        assert r["far"] == {"batch_isend_irecv@4:inter": 4000}
