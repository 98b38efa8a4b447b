"""SDP4Bit inside DeepSpeed 0.19 ZeRO-3 (deepspeed_sdp4bit.integration), on 4 gloo ranks as 2 nodes x 2.

All multi-rank scenarios run in ONE spawn (a module-scoped fixture); each test below asserts on its part of
the result.  Tolerances (mean loss over the 4 ranks, tiny GPT, AdamW lr 3e-3, 5 steps):

* exact path = gradients at 16 bits on both levels, weights disabled: the only difference from plain ZeRO-3
  is the summation order/precision of the reduce-scatter (fp32 sums of bf16 values instead of a bf16 ring),
  so |loss - plain| <= 2e-3 at every step (observed ~3e-4).
* full default SDP4Bit (8/4-bit gradients with Hadamard, 4-bit weight differences): |loss - plain| <= 3e-2
  (observed ~3e-3).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile

import pytest
import torch

from dist_utils import run_distributed

WORLD, GPN = 4, 2
STEPS = 5
TOPO = {"topology": {"gpus_per_node": GPN}, "kernel_backend": "torch"}
EXACT = dict(TOPO, weights={"enabled": False}, gradients={"intra_bits": 16, "inter_bits": 16})
DEFAULT = dict(TOPO)
FULL = dict(TOPO, weights={"replica": "full"})


# --------------------------------------------------------------------------------------------------------
# the one multi-rank run
# --------------------------------------------------------------------------------------------------------
def _flat_state(engine):
    """This rank's fp32 master and bf16 partitions (flat) and its secondary tensors, as CPU clones."""
    opt = engine.optimizer
    return {
        "master": [f.detach().clone() for f in opt.fp32_partitioned_groups_flat],
        "own": [f.detach().clone() for f in opt.fp16_partitioned_groups_flat],
        "sec": {p.ds_id: (None if p.ds_secondary_tensor is None else p.ds_secondary_tensor.detach().clone())
                for g in opt.fp16_groups for p in g},
    }


def _replica_report(engine):
    """What this rank keeps of every parameter: primary partition, secondary tensor, full replica buffer."""
    st = engine.sdp4bit
    out = {"level": st.level, "local": st.topology.local, "params": {}}
    for items in st.layout:
        for p, _, P in items:
            d = {"P": P, "numel": p.ds_numel, "primary": p.ds_tensor.detach().clone()}
            if st.level == "node":
                d["secondary"] = p.ds_secondary_tensor.detach().clone()
            else:
                d["replica"] = st.replica[id(p)].detach().clone()
                # the param's data must BE the replica buffer (no hidden copy that would go stale)
                d["data_is_replica"] = p.data.data_ptr() == st.replica[id(p)].data_ptr()
            out["params"][p.ds_id] = d
    return out


def _worker(rank, world_size, ckpt_dir):
    import ds_utils
    import deepspeed_sdp4bit  # noqa: F401  (installs the hooks)

    ds_utils.prepare_deepspeed_env()
    res = {}
    cfg = ds_utils.base_config

    # (a) plain ZeRO-3 vs the exact path vs the default SDP4Bit, same seed and data
    plain = ds_utils.make_engine(cfg())
    res["plain_norm"] = []
    res["plain"] = ds_utils.train_steps(plain, STEPS, rank, norms=res["plain_norm"])
    res["plain_has_state"] = hasattr(plain, "sdp4bit") or getattr(plain.optimizer, "_sdp4bit", None) is not None
    del plain

    exact = ds_utils.make_engine(cfg(sdp4bit=EXACT))
    res["exact_norm"] = []
    res["exact"] = ds_utils.train_steps(exact, STEPS, rank, norms=res["exact_norm"])
    res["exact_summary"] = exact.sdp4bit_summary()
    del exact

    # contiguous-gradient path (reduce_scatter=False): DeepSpeed all-reduces there; we route it too
    contig_plain = ds_utils.make_engine(cfg(zero_extra={"reduce_scatter": False}))
    res["contig_plain"] = ds_utils.train_steps(contig_plain, 3, rank)
    del contig_plain
    contig = ds_utils.make_engine(cfg(sdp4bit=EXACT, zero_extra={"reduce_scatter": False}))
    res["contig_exact"] = ds_utils.train_steps(contig, 3, rank)
    res["contig_summary"] = contig.sdp4bit_summary()
    del contig

    # (b) default SDP4Bit, node replica; replicas right after init, then after STEPS steps
    node_cfg = dict(DEFAULT, summary_interval=STEPS)
    node = ds_utils.make_engine(cfg(sdp4bit=node_cfg))
    res["init_params"] = {k: v.to(torch.bfloat16) for k, v in ds_utils.full_params_fp32(node).items()}
    res["model_init"] = {k: v.detach().to(torch.bfloat16) for k, v in ds_utils.make_model(0).named_parameters()}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        res["default_norm"] = []
        res["default"] = ds_utils.train_steps(node, STEPS, rank, norms=res["default_norm"])
    res["printed"] = buf.getvalue()
    res["default_summary"] = node.sdp4bit_summary()
    res["node_replicas"] = _replica_report(node)
    res["node_hpz"] = node.optimizer.zero_hpz_partition_size
    res["node_gathered"] = {k: ds_utils.tensor_hash(v) for k, v in ds_utils.full_params_fp32(node).items()}
    fs = _flat_state(node)
    res["node_master_vs_own"] = [(m.to(o.dtype).float() - o.float()).abs().max().item()
                                 for m, o in zip(fs["master"], fs["own"])]

    # (d) checkpoint: save after STEPS, continue 3 steps; a fresh engine (other init) loads and continues
    node.save_checkpoint(ckpt_dir, tag="t")
    res["after_save"] = _replica_report(node)
    res["uninterrupted"] = ds_utils.train_steps(node, 3, rank, start_step=STEPS)
    del node
    resumed = ds_utils.make_engine(cfg(sdp4bit=node_cfg), seed=7)
    resumed.load_checkpoint(ckpt_dir, tag="t")
    res["resumed_step"] = resumed.sdp4bit.step
    res["resumed"] = ds_utils.train_steps(resumed, 3, rank, start_step=STEPS)
    del resumed

    # (b) full replica
    full = ds_utils.make_engine(cfg(sdp4bit=FULL))
    res["full"] = ds_utils.train_steps(full, STEPS, rank)
    res["full_replicas"] = _replica_report(full)
    res["full_summary"] = full.sdp4bit_summary()
    del full

    # model built under deepspeed.zero.Init with the user's config (the hook hands zero.Init the hpZ setting)
    zi = ds_utils.make_engine(cfg(sdp4bit=DEFAULT), zero_init=True)
    res["zero_init"] = ds_utils.train_steps(zi, STEPS, rank)
    res["zero_init_replicas"] = _replica_report(zi)
    del zi

    # (f) gradient accumulation 2 + clipping, plain and SDP4Bit
    ga_plain = ds_utils.make_engine(cfg(grad_accum=2, clip=0.05))
    res["ga_plain"] = ds_utils.train_steps(ga_plain, 3, rank)
    del ga_plain
    ga = ds_utils.make_engine(cfg(grad_accum=2, clip=0.05, sdp4bit=DEFAULT))
    res["ga"] = ds_utils.train_steps(ga, 3, rank)
    res["ga_norm"] = float(ga.get_global_grad_norm())
    res["ga_summary"] = ga.sdp4bit_summary()
    del ga

    # (c) fp16 with an overflow injected on rank 1 at step 1 (its loss times inf)
    def inject(loss, step, micro):
        return loss * float("inf") if (step == 1 and rank == 1) else loss

    for name, block in (("fp16_plain", None), ("fp16", DEFAULT)):
        e = ds_utils.make_engine(cfg(dtype="fp16", sdp4bit=block))
        rec = {"loss": [], "scale": [], "skipped": [], "summary_skipped": [], "unchanged": []}
        for s in range(4):
            before = _flat_state(e) if block else None
            rec["loss"] += ds_utils.train_steps(e, 1, rank, start_step=s, loss_hook=inject)
            rec["scale"].append(float(e.optimizer.loss_scale))
            rec["skipped"].append(int(e.skipped_steps))
            if block:
                after = _flat_state(e)
                same = all(torch.equal(a, b) for k in ("master", "own") for a, b in zip(before[k], after[k]))
                same = same and all(torch.equal(before["sec"][i], after["sec"][i]) for i in before["sec"])
                rec["unchanged"].append(same)
                rec["summary_skipped"].append(e.sdp4bit_summary()["skipped"])
        rec["finite"] = all(torch.isfinite(f).all().item() for f in e.optimizer.fp32_partitioned_groups_flat)
        res[name] = rec
        del e
    return res


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory(prefix="sdp4bit_ckpt_") as d:
        return run_distributed(_worker, WORLD, args=(d,), local_world_size=GPN)


def _close(a, b, tol):
    assert len(a) == len(b)
    diffs = [abs(x - y) for x, y in zip(a, b)]
    assert max(diffs) <= tol, f"losses differ by up to {max(diffs):.2e} (> {tol}): {a} vs {b}"


# --------------------------------------------------------------------------------------------------------
# (a) losses
# --------------------------------------------------------------------------------------------------------
def test_plain_engine_untouched(runs):
    assert not runs[0]["plain_has_state"]
    assert runs[0]["plain"][-1] < runs[0]["plain"][0]  # the tiny model learns at all


def test_exact_path_matches_plain_zero3(runs):
    r = runs[0]
    _close(r["exact"], r["plain"], 2e-3)
    # Adam hides a wrong gradient scale from the loss; the gradient norm does not
    _close(r["exact_norm"], r["plain_norm"], 2e-3 * max(r["plain_norm"]))
    # the reducer really carried the gradients (both levels, unquantized: exactly the baseline volume)
    g = r["exact_summary"]["gradients"]
    assert g["bytes_by_level"]["intra"] > 0 and g["bytes_by_level"]["inter"] > 0
    assert g["bytes"] == g["baseline_bytes"]
    assert "weights" not in r["exact_summary"]


def test_contiguous_gradient_path_routed(runs):
    r = runs[0]
    _close(r["contig_exact"], r["contig_plain"], 2e-3)
    assert r["contig_summary"]["gradients"]["bytes"] > 0


def test_default_sdp4bit_close_to_plain(runs):
    r = runs[0]
    _close(r["default"], r["plain"], 3e-2)
    _close(r["default_norm"], r["plain_norm"], 5e-2 * max(r["plain_norm"]))
    _close(r["full"], r["plain"], 3e-2)
    s = r["default_summary"]
    assert s["step"] == STEPS - 1 and not s["skipped"]
    # 8-bit intra / 4-bit inter gradients and 4-bit weight differences: well below the bf16 volume (this
    # tiny model's 8..96-element pieces each start a 128-group (align_params): ~1.8x here, 2.3x on the d128 GPT)
    assert s["gradients"]["compression"] > 1.6
    # (the weight partitions of this tiny model's ~2000-element sub-groups are padded to one 2048 group)
    assert s["weights"]["compression"] > 1.8
    assert s["bytes"] == s["gradients"]["bytes"] + s["weights"]["bytes"]


def test_zero_init_model_trains_with_node_replicas(runs):
    N = WORLD // GPN
    for r in runs:
        _close(r["zero_init"], runs[0]["plain"], 3e-2)
        rep = r["zero_init_replicas"]
        assert rep["level"] == "node"
        for ds_id, d in rep["params"].items():
            l, P = rep["local"], d["P"]
            for j in range(N):
                owner = runs[l * N + j]["zero_init_replicas"]["params"][ds_id]["primary"]
                assert torch.equal(d["secondary"][j * P:(j + 1) * P], owner), (ds_id, l, j)


def test_summary_printed_on_rank0_only(runs):
    assert "[sdp4bit] step 4" in runs[0]["printed"]
    assert all("[sdp4bit]" not in r["printed"] for r in runs[1:])


# --------------------------------------------------------------------------------------------------------
# (b) replicas
# --------------------------------------------------------------------------------------------------------
def test_first_forward_sees_exact_initial_weights(runs):
    for r in runs:
        for name, v in r["model_init"].items():
            assert torch.equal(r["init_params"][name], v), name


def test_node_replicas_bit_identical(runs):
    N = WORLD // GPN
    assert all(r["node_hpz"] == GPN for r in runs)
    ids = runs[0]["node_replicas"]["params"].keys()
    for ds_id in ids:
        for r in runs:
            rep = r["node_replicas"]
            d = rep["params"][ds_id]
            l, P = rep["local"], d["P"]
            # secondary piece j of local index l is primary partition l*N + j: bit-identical to its owner's
            for j in range(N):
                owner = runs[l * N + j]["node_replicas"]["params"][ds_id]["primary"]
                assert torch.equal(d["secondary"][j * P:(j + 1) * P], owner), (ds_id, l, j)
        # ranks with the same local index hold the same secondary (hash compare)
        for l in range(GPN):
            hashes = {_hash(runs[n * GPN + l]["node_replicas"]["params"][ds_id]["secondary"]) for n in range(N)}
            assert len(hashes) == 1, (ds_id, l)
    # what the forward gathers is the same everywhere
    assert all(r["node_gathered"] == runs[0]["node_gathered"] for r in runs)


def test_replica_is_not_just_a_cast_of_the_master(runs):
    # qWD: the bf16 partition is the owner's replica (master minus the unsent residual), close to the master
    d = runs[0]["node_master_vs_own"]
    assert len(d) > 1, "the test model should have several optimizer sub-groups"
    assert max(d) > 0.0, "bf16 partition equals bf16(master) exactly: the qWD refresh did not run"
    assert max(d) < 5e-2


def test_full_replicas_bit_identical(runs):
    for ds_id, d0 in runs[0]["full_replicas"]["params"].items():
        P, n = d0["P"], d0["numel"]
        owners = torch.cat([runs[s]["full_replicas"]["params"][ds_id]["primary"] for s in range(WORLD)])[:n]
        for r in runs:
            d = r["full_replicas"]["params"][ds_id]
            assert d["data_is_replica"], ds_id
            assert torch.equal(d["replica"], owners), ds_id


def _hash(t):
    import ds_utils

    return ds_utils.tensor_hash(t)


# --------------------------------------------------------------------------------------------------------
# (c) fp16 overflow
# --------------------------------------------------------------------------------------------------------
def test_fp16_overflow_step_skipped(runs):
    for r in runs:
        p, q = r["fp16_plain"], r["fp16"]
        assert q["skipped"] == [0, 1, 1, 1] == p["skipped"]
        assert q["scale"] == p["scale"] and q["scale"][1] == q["scale"][0] / 2
        assert q["summary_skipped"] == [False, True, False, False]
        assert q["unchanged"] == [False, True, False, False]
        assert q["finite"]
    _close(runs[0]["fp16"]["loss"], runs[0]["fp16_plain"]["loss"], 3e-2)


# --------------------------------------------------------------------------------------------------------
# (d) checkpoint
# --------------------------------------------------------------------------------------------------------
def test_checkpoint_resume_equals_uninterrupted(runs):
    for r in runs:
        assert r["resumed_step"] == STEPS
    # replicas, master, optimizer state and the rounding streams all come back: identical losses
    _close(runs[0]["resumed"], runs[0]["uninterrupted"], 1e-6)
    # saving leaves the replicas exact (the epilogue resync changes nothing)
    for r in runs:
        for ds_id, d in r["after_save"]["params"].items():
            assert torch.equal(d["secondary"], r["node_replicas"]["params"][ds_id]["secondary"])


# --------------------------------------------------------------------------------------------------------
# (f) gradient accumulation and clipping
# --------------------------------------------------------------------------------------------------------
def test_grad_accumulation_and_clipping(runs):
    r = runs[0]
    _close(r["ga"], r["ga_plain"], 3e-2)
    assert r["ga_norm"] > 0.05  # clipping was active
    # two micro-steps per step: twice the gradient volume of one micro-step (same buckets)
    assert r["ga_summary"]["gradients"]["bytes"] == 2 * r["default_summary"]["gradients"]["bytes"]


# --------------------------------------------------------------------------------------------------------
# (e) config errors: raised before DeepSpeed does anything, so no spawn is needed
# --------------------------------------------------------------------------------------------------------
def _initialize(config):
    import ds_utils
    import deepspeed_sdp4bit  # noqa: F401
    import deepspeed

    model = ds_utils.make_model(0)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c.update(sdp4bits=c.pop("sdp4bit")), "sdp4bits"),
    (lambda c: c["zero_optimization"].update(stage=2), "stage"),
    (lambda c: c["zero_optimization"].update(zero_quantized_gradients=True), "zero_quantized_gradients"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "cpu"}), "offload_optimizer"),
    (lambda c: c["zero_optimization"].update(offload_param={"device": "cpu"}), "offload_param"),
    (lambda c: c["sdp4bit"]["weights"].update(bitz=4), "bitz"),
])
def test_config_errors_name_the_key(mutate, needle):
    from deepspeed_sdp4bit import SDP4BitConfigError
    import ds_utils

    cfg = ds_utils.base_config(sdp4bit={"topology": {"gpus_per_node": 2}, "weights": {}})
    mutate(cfg)
    with pytest.raises(SDP4BitConfigError, match=needle):
        _initialize(cfg)


def test_config_error_from_json_path(tmp_path):
    from deepspeed_sdp4bit import SDP4BitConfigError
    import ds_utils

    cfg = ds_utils.base_config()
    cfg["SDP4Bit"] = {}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(SDP4BitConfigError, match="SDP4Bit"):
        _initialize(str(path))


def test_prepare_ds_config_adjusts_and_refuses():
    import ds_utils
    from deepspeed_sdp4bit import SDP4BitConfigError
    from deepspeed_sdp4bit.integration import prepare_ds_config

    base = ds_utils.base_config(sdp4bit=dict(TOPO))
    ds, cfg = prepare_ds_config(base, WORLD)
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == GPN
    assert "zero_hpz_partition_size" not in base["zero_optimization"]  # the caller's dict is not modified

    with pytest.warns(UserWarning, match="stage3_param_persistence_threshold"):
        ds, _ = prepare_ds_config(ds_utils.base_config(sdp4bit=FULL), WORLD)
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] >= 1 << 40

    bad = ds_utils.base_config(sdp4bit=dict(TOPO), zero_extra={"zero_hpz_partition_size": 4})
    with pytest.raises(SDP4BitConfigError, match="zero_hpz_partition_size"):
        prepare_ds_config(bad, WORLD)
    one = ds_utils.base_config(sdp4bit={"topology": {"gpus_per_node": 1}})
    with pytest.raises(NotImplementedError, match="replica='full'"):
        prepare_ds_config(one, WORLD)
    # inactive block: the config passes through untouched
    off = ds_utils.base_config(sdp4bit={"enabled": False})
    assert prepare_ds_config(off, WORLD)[0] is off


def test_version_check_and_idempotent_install():
    import deepspeed
    from deepspeed_sdp4bit import integration

    with pytest.raises(ImportError, match="0.19"):
        integration.check_deepspeed_version("0.18.4")
    before = deepspeed.initialize
    assert integration.install() and integration.install()
    assert deepspeed.initialize is before and getattr(before, "_sdp4bit_wrapped", False)
