"""What SDP4Bit decides to run before DeepSpeed builds anything (integration.plan_run / choose_replica).

Pure functions of the ds_config, the world size, the model size and the accelerator's memory: no ranks.
The engine-level consequences (plain ZeRO-3 bit for bit when off) are tested in the engine tests.
"""

from __future__ import annotations

import copy

import pytest

from deepspeed_sdp4bit import SDP4BitConfigError
from deepspeed_sdp4bit.integration import choose_replica, plan_run

GiB = 1 << 30


def _ds(block=None, **zero):
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, **zero}}
    if block is not None:
        cfg["sdp4bit"] = block
    return cfg


def test_world_size_one_is_off_and_untouched():
    ds = _ds({"topology": {"gpus_per_node": 1}})
    before = copy.deepcopy(ds)
    plan = plan_run(ds, 1, n_params=1000, device_bytes=80 * GiB)
    assert plan.ds_config is ds and ds == before   # DeepSpeed sees the caller's dict, unmodified
    assert not plan.cfg.active and "world size 1" in plan.off_reason


@pytest.mark.parametrize("gpn", [2, 4])
def test_single_node_is_off_unless_asked(gpn):
    plan = plan_run(_ds({"topology": {"gpus_per_node": gpn}}), gpn, n_params=1000, device_bytes=80 * GiB)
    assert not plan.cfg.active and "one node" in plan.off_reason and "quantize_single_node" in plan.off_reason
    assert plan.ds_config["zero_optimization"] == {"stage": 3}
    # opted in: the gradients are quantized; a small model gets the full replica (all-gathered in the node)
    on = plan_run(_ds({"topology": {"gpus_per_node": gpn}, "quantize_single_node": True}), gpn,
                  n_params=1000, device_bytes=80 * GiB)
    assert on.off_reason is None and on.cfg.active and on.cfg.gradients.enabled
    assert on.cfg.weights.enabled and on.cfg.weights.replica == "full"


def test_single_node_node_replica_leaves_weights_to_zero3():
    block = {"topology": {"gpus_per_node": 4}, "quantize_single_node": True, "weights": {"replica": "node"}}
    plan = plan_run(_ds(block), 4)
    assert plan.cfg.active and plan.cfg.gradients.enabled and not plan.cfg.weights.enabled
    assert "zero_hpz_partition_size" not in plan.ds_config["zero_optimization"]
    assert any("own partition" in n for n in plan.notes)
    # nothing left at all: off, with the reason
    block["gradients"] = {"enabled": False}
    plan = plan_run(_ds(block), 4)
    assert not plan.cfg.active and "own partition" in plan.off_reason


def test_omitted_replica_full_when_it_fits_the_budget():
    block = {"topology": {"gpus_per_node": 2}}
    small = plan_run(_ds(block), 4, n_params=1_000_000_000, device_bytes=80 * GiB)  # 2 GB <= 20 GB
    assert small.cfg.weights.replica == "full" and small.off_reason is None
    zero = small.ds_config["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] >= 1 << 40 and "zero_hpz_partition_size" not in zero
    assert any("replica 'full'" in n and "full_replica_budget" in n and "bf16 copy 1.86 GiB" in n for n in small.notes)
    # a small model's copy in MiB, not "0.00 GiB"
    tiny = plan_run(_ds(block), 4, n_params=1_000_000, device_bytes=80 * GiB)
    assert any("bf16 copy 1.9 MiB <= 0.25 x 80.0 GiB" in n for n in tiny.notes)

    big = plan_run(_ds(block), 4, n_params=20_000_000_000, device_bytes=80 * GiB)    # 40 GB > 20 GB
    assert big.cfg.weights.replica == "node"
    assert big.ds_config["zero_optimization"]["zero_hpz_partition_size"] == 2
    # the budget is a key: half the memory lets the 40 GB copy be full
    half = plan_run(_ds({**block, "weights": {"full_replica_budget": 0.5}}), 4, n_params=20_000_000_000,
                    device_bytes=80 * GiB)
    assert half.cfg.weights.replica == "full"


def test_omitted_replica_one_rank_per_node():
    block = {"topology": {"gpus_per_node": 1}}
    assert plan_run(_ds(block), 4, n_params=10**6, device_bytes=80 * GiB).cfg.weights.replica == "full"
    # too big for a full copy, and a node replica would be the whole model too: weights go uncompressed
    plan = plan_run(_ds(block), 4, n_params=50 * 10**9, device_bytes=80 * GiB)
    assert plan.cfg.active and plan.cfg.gradients.enabled and not plan.cfg.weights.enabled
    assert any("uncompressed" in n for n in plan.notes)


def test_omitted_replica_without_model_size_matches_zero_init():
    # deepspeed.zero.Init partitions before the model exists: the same answer in both hooks
    assert choose_replica(2, None, 0.25, 80 * GiB)[0] == "node"
    assert choose_replica(1, None, 0.25, 80 * GiB)[0] == "full"
    # an explicit hpZ size asks for per-node copies, and must still match gpus_per_node
    assert choose_replica(2, 10, 0.25, 80 * GiB, hpz=2)[0] == "node"
    with pytest.raises(SDP4BitConfigError, match="zero_hpz_partition_size"):
        plan_run(_ds({"topology": {"gpus_per_node": 2}}, zero_hpz_partition_size=4), 4, n_params=10,
                 device_bytes=80 * GiB)


def test_explicit_replica_is_kept_whatever_the_size():
    block = {"topology": {"gpus_per_node": 2}, "weights": {"replica": "node"}}
    plan = plan_run(_ds(block), 4, n_params=10, device_bytes=80 * GiB)
    assert plan.cfg.weights.replica == "node" and not plan.notes
    with pytest.raises(NotImplementedError, match="replica='full'"):
        plan_run(_ds({"topology": {"gpus_per_node": 1}, "weights": {"replica": "node"}}), 4)


def test_overlap_with_the_node_replica_is_said_not_silently_dropped():
    block = {"topology": {"gpus_per_node": 2}, "weights": {"replica": "node", "overlap": True}}
    plan = plan_run(_ds(block), 4)
    assert plan.cfg.weights.replica == "node" and any("weights.overlap" in n and "full replica only" in n
                                                       for n in plan.notes)
    full = plan_run(_ds({**block, "weights": {"replica": "full", "overlap": True}}), 4)
    assert [n for n in full.notes if "overlap" in n] == [
        "weights.overlap: timers.throughput.synchronized set to false (DeepSpeed's throughput timer would wait for "
        "the whole device, the refresh included, at the end of every step)"]


def test_overlap_unsynchronizes_deepspeeds_throughput_timer():
    """DeepSpeed's throughput timer (on and synchronized by default) synchronizes the device when step() ends and
    a forward starts, which would wait for the overlapped refresh every step."""
    block = {"topology": {"gpus_per_node": 2}, "weights": {"replica": "full", "overlap": True}}
    ds = _ds(block)
    plan = plan_run(ds, 4)
    assert plan.ds_config["timers"] == {"throughput": {"synchronized": False}} and "timers" not in ds
    # the user's other timer keys are kept; an explicit false, or the timer off, are left alone
    kept = plan_run(dict(_ds(block), timers={"throughput": {"enabled": True}}), 4).ds_config["timers"]
    assert kept == {"throughput": {"enabled": True, "synchronized": False}}
    for t in ({"throughput": {"synchronized": False}}, {"throughput": {"enabled": False}}):
        assert plan_run(dict(_ds(block), timers=t), 4).ds_config["timers"] == t
    # read as DeepSpeed reads it: whatever it takes for true is refused
    for v, said in ((True, "true"), ("true", '"true"'), (1, "1")):
        with pytest.raises(SDP4BitConfigError, match=rf"timers\.throughput\.synchronized={said} .* remove that key"):
            plan_run(dict(_ds(block), timers={"throughput": {"synchronized": v}}), 4)
    # planning the prepared config again gives the same config, and no second note
    again = plan_run(plan.ds_config, 4)
    assert again.ds_config == plan.ds_config and not any("overlap" in n for n in again.notes)
    # without the overlap (or with the node replica, refreshed inside step()) DeepSpeed's timer is untouched
    for w in ({"replica": "full"}, {"replica": "node", "overlap": True}):
        assert "timers" not in plan_run(_ds({**block, "weights": w}), 4).ds_config


@pytest.mark.parametrize("nodes,gpn,block,want", [
    (2, 2, {}, "weights: 4-bit differences to the 'full' replica; gradients: 8-bit inside a node, 4-bit between nodes"),
    (2, 1, {"gradients": {"inter8_steps": 100}}, "gradients: 4-bit between nodes (8-bit for the first 100 steps)"),
    (1, 4, {}, "gradients: 8-bit inside a node ("),
    (2, 2, {"weights": {"mode": "direct"}}, "weights: 4-bit weights themselves (the qW ablation), 'full' replica"),
    (2, 2, {"weights": {"enabled": False}, "gradients": {"enabled": False}},
     "weights: ZeRO-3's gathers; gradients: ZeRO-3's reduce-scatter"),
])
def test_the_start_up_line_names_the_levels_that_run(nodes, gpn, block, want):
    from types import SimpleNamespace

    from deepspeed_sdp4bit.config import parse_block
    from deepspeed_sdp4bit.integration import _on_line

    cfg = parse_block({**block, "weights": {"replica": "full", **block.get("weights", {})}})
    from deepspeed_sdp4bit.topology import TopologyShape

    state = SimpleNamespace(topology=SimpleNamespace(num_nodes=nodes, gpus_per_node=gpn,
                                                     shape=TopologyShape(nodes, gpn)), cfg=cfg,
                            weights=object() if cfg.weights.enabled else None, level=cfg.weights.replica,
                            reducer=object() if cfg.gradients.enabled else None)
    line = _on_line(state)
    assert line.startswith(f"on: {nodes} node(s) x {gpn} rank(s); ") and want in line, line


def test_world_size_one_needs_no_topology(monkeypatch):
    # python train.py / a notebook: no launcher variables; a cluster's gpus_per_node in the file
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    for block in ({}, {"topology": {"gpus_per_node": 8}}):
        plan = plan_run(_ds(block), 1)
        assert not plan.cfg.active and "world size 1" in plan.off_reason


def test_a_node_larger_than_the_job_is_one_node():
    plan = plan_run(_ds({"topology": {"gpus_per_node": 8}}), 4)
    assert not plan.cfg.active and "one node of 4 ranks" in plan.off_reason
    with pytest.raises(SDP4BitConfigError, match="must divide"):
        plan_run(_ds({"topology": {"gpus_per_node": 3}}), 4)


@pytest.mark.parametrize("hpz, block, top, replica", [
    # DeepSpeed's own integer and boolean keys as its (lax) config models read them
    ("2", {"topology": {"gpus_per_node": 2}}, {}, "node"),               # asks for per-node copies
    ("2", {}, {}, "node"),                                               # the same, gpus_per_node omitted
    ("1", {"weights": {"replica": "full"}, "topology": {"gpus_per_node": 2}}, {}, "full"),
    (1, {"topology": {"gpus_per_node": 2}}, {"sequence_parallel_size": "1"}, None),
])
def test_deepspeed_keys_read_as_deepspeed_reads_them(hpz, block, top, replica, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ds = {**_ds(block, zero_hpz_partition_size=hpz, zero_quantized_weights="false"), **top}
    plan = plan_run(ds, 4, n_params=1000, device_bytes=80 * GiB)
    assert plan.cfg.active and (replica is None or plan.cfg.weights.replica == replica)
    if replica == "node":
        assert plan.ds_config["zero_optimization"]["zero_hpz_partition_size"] == 2


def test_hf_auto_persistence_threshold_is_replaced_for_the_full_replica():
    # HF's ZeRO-3 template says "auto" there and fills it only after the model is built
    ds = _ds({"topology": {"gpus_per_node": 1}, "weights": {"replica": "full"}},
             stage3_param_persistence_threshold="auto")
    plan = plan_run(ds, 4)
    assert plan.ds_config["zero_optimization"]["stage3_param_persistence_threshold"] >= 1 << 40


@pytest.mark.parametrize("block,n_params,world", [
    ({"topology": {"gpus_per_node": 2}}, 10**6, 4),                    # omitted replica -> full
    ({"topology": {"gpus_per_node": 2}}, 20 * 10**9, 4),               # omitted replica -> node
    ({"topology": {"gpus_per_node": 1}}, 50 * 10**9, 4),               # no replica fits -> weights off
    ({"topology": {"gpus_per_node": 4}, "quantize_single_node": True,
      "weights": {"replica": "node"}}, 10**6, 4),                      # node on one node -> weights off
    ({"topology": {"gpus_per_node": 2}, "weights": {"replica": "full"}}, None, 4),
])
def test_the_prepared_config_plans_to_the_same_run(block, n_params, world):
    # DeepSpeed's engine partitions the model through deepspeed.zero.Init with the config it was handed, and
    # our zero.Init hook plans that config again without the model's size: it must decide the same (an omitted
    # replica chosen "full" from the size was re-planned "node", and DeepSpeed built hpZ secondary partitions
    # that went stale on a checkpoint load)
    given = _ds(copy.deepcopy(block))
    before = copy.deepcopy(given)
    first = plan_run(given, world, n_params=n_params, device_bytes=80 * GiB)
    assert first.cfg.active
    again = plan_run(first.ds_config, world)
    assert again.cfg == first.cfg and again.ds_config == first.ds_config
    assert given == before   # the caller's config is not written to
