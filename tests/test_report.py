"""``python -m deepspeed_sdp4bit``: the environment report, the config linter, and the bytes model behind it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from deepspeed_sdp4bit import __main__ as report
from deepspeed_sdp4bit.collectives import gradients as G
from deepspeed_sdp4bit.collectives import weights as Wt
from deepspeed_sdp4bit.config import SDP4BitConfig, SDP4BitConfigError, parse_block, parse_ds_config
from deepspeed_sdp4bit.step_bytes import node_link_bytes, step_bytes, totals
from deepspeed_sdp4bit.topology import TopologyShape

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


def _write(tmp_path, cfg, name="ds.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)


def test_environment_report_names_versions_and_backends(capsys):
    assert report.main([]) == 0
    out = capsys.readouterr().out
    for key in ("torch:", "deepspeed:", "triton:", "nvcc:", "ninja:", "kernel backends:", "cuda op:",
                "buildable:"):
        assert key in out, key
    assert f"torch: {torch.__version__}" in out
    assert "  torch: usable" in out
    if not torch.cuda.is_available():
        assert "  cuda: not usable: no CUDA device" in out


def test_linter_ok_prints_levels_and_bytes(capsys):
    rc = report.main(["--ds-config", str(CONFIGS / "sdp4bit.json"), "--world", "16", "--gpus-per-node", "8",
                      "--params", "1.3e9"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "2 node(s) x 8 GPU(s)" in out and "zero_hpz_partition_size=8" in out
    assert "intra-node all-to-all over 8 ranks: 8-bit" in out and "inter-node all-to-all over 2 ranks: 4-bit" in out
    for scheme in ("zero3:", "zero++:", "sdp4bit:"):
        assert scheme in out
    # each ratio with ZeRO-3's / ZeRO++'s backward gathers counted (an upper bound on their bytes) and without
    import re
    assert "sdp4bit sends, as a fraction of" in out and "across each node's link" in out
    ratios = re.findall(r"\n    zero3 +([\d.]+)x  ([\d.]+)x\n    zero3, its backward gathers skipped +([\d.]+)x  "
                        r"([\d.]+)x\n", out)
    assert len(ratios) == 1, out
    both, link, once, once_link = (float(x) for x in ratios[0])
    assert once > both and once_link > link
    p = report.plan(json.loads((CONFIGS / "sdp4bit.json").read_text()), 16, 8, int(1.3e9))
    fwd = [r for r in p["bytes"]["zero3"]["rows"] if not r["collective"].startswith("backward all-gather")]
    assert len(fwd) == len(p["bytes"]["zero3"]["rows"]) - 1
    assert once == pytest.approx(p["bytes"]["sdp4bit"]["totals"]["total"] / sum(r["bytes"] for r in fwd), abs=1e-3)


def test_linter_notes_a_missing_batch_size_and_the_early_8_bit_steps():
    """deepspeed.initialize refuses a config without a batch size: the linter says so (a note: the examples and the
    HF Trainer add it); gradients.inter8_steps is noted (the engine logs the same note), the levels are the later
    steps'."""
    ds = json.loads((CONFIGS / "sdp4bit.json").read_text())
    note = "no train_batch_size / train_micro_batch_size_per_gpu"
    assert any(note in x for x in report.plan(ds, 16, 8)["lines"])
    ds.update(train_micro_batch_size_per_gpu=4)
    ds["sdp4bit"]["gradients"]["inter8_steps"] = 100
    lines = report.plan(ds, 16, 8)["lines"]
    assert not any(note in x for x in lines)
    inter = [x for x in lines if x.startswith("gradients, inter-node")]
    assert len(inter) == 1 and "4-bit, group 128" in inter[0]
    assert ("note: gradients: the inter-node level at 8 bits for the first 100 optimizer steps, then 4 "
            "(gradients.inter8_steps)") in lines
    # one node, quantized on request: no inter-node level, no note (SDP4Bit active there)
    ds["sdp4bit"].update(topology={"gpus_per_node": 16}, quantize_single_node=True)
    p1 = report.plan(ds, 16, 16)
    assert p1["active"] and not any("inter8_steps" in x for x in p1["lines"])
    # with --params, the bytes are the later steps' (said on the bytes' own header)
    ds["sdp4bit"].update(topology={"gpus_per_node": 8}, quantize_single_node=False)
    text = report.format_plan(report.plan(ds, 16, 8, 10 ** 9))
    assert "of the steps after the first 100, which send more between nodes: gradients.inter8_steps" in text
    # no optimizer in the config: the engine may have none (a forward-only engine), SDP4Bit off there; said once
    opt = "note: no optimizer in this ds_config"
    assert not any(x.startswith(opt) for x in report.plan(ds, 16, 8)["lines"])
    ds.pop("optimizer")
    assert sum(x.startswith(opt) for x in report.plan(ds, 16, 8)["lines"]) == 1


def test_linter_says_how_the_overlap_of_the_full_replica_is_set():
    """The full replica between nodes: the overlap decided when the engine is built (the key omitted, with the
    threshold), or as given, or off where the ds_config's own throughput timer synchronizes (as the engine
    decides it: unprobed); the node replica between nodes: off; nothing to say on one node."""
    ds = json.loads((CONFIGS / "sdp4bit.json").read_text())
    full = dict(ds, sdp4bit=dict(ds["sdp4bit"], weights=dict(ds["sdp4bit"]["weights"], replica="full")))

    def said(cfg, world=16, gpn=8):
        return [x for x in report.plan(cfg, world, gpn)["lines"] if x.startswith("weights.overlap:")]
    assert said(full) == ["weights.overlap: decided when the engine is built: on where the link between nodes "
                          "measures below 6 Gb/s per rank (weights.overlap_below_gbps), on a GPU; logged"]
    full["sdp4bit"]["weights"]["overlap_below_gbps"] = 2.5
    assert "below 2.5 Gb/s per rank" in said(full)[0]
    del full["sdp4bit"]["weights"]["overlap_below_gbps"]
    full["sdp4bit"]["weights"]["overlap"] = False
    assert said(full) == ["weights.overlap: off (given)"]
    full["sdp4bit"]["weights"]["overlap"] = True
    assert said(full) == ["weights.overlap: on (given) on a GPU; the refresh runs inside step() on a CPU"]
    del full["sdp4bit"]["weights"]["overlap"]
    timer = dict(full, timers={"throughput": {"synchronized": True}})
    assert said(timer) == ["weights.overlap: off: the ds_config sets timers.throughput.synchronized=true, which "
                           "waits for the whole device at every step's end (the link not probed; remove that key "
                           "to let the engine decide)"]
    for tp in ({"synchronized": False}, {"synchronized": True, "enabled": False}, {}):   # the engine decides
        assert said(dict(full, timers={"throughput": tp})) == said(full) and "decided" in said(full)[0], tp
        assert not [x for x in report.plan(dict(full, timers={"throughput": tp}), 16, 8)["lines"] if "timers" in x]
    for tp in (None, [1], {"synchronised": True}):   # a block DeepSpeed itself refuses: said before the launch
        lines = report.plan(dict(full, timers={"throughput": tp}), 16, 8)["lines"]
        assert any(x.startswith("note: deepspeed.initialize will refuse this ds_config's timers block (") for x in
                   lines), (tp, lines)
    # the shipped config without --params: the node replica (the model size unknown), which never overlaps
    assert said(ds) == ["weights.overlap: off (the node replica is refreshed inside step(); only the full replica "
                        "overlaps its refresh)"]
    assert said(dict(full, sdp4bit=dict(full["sdp4bit"], quantize_single_node=True)), 8, 8) == []


def test_plan_bytes_are_the_models():
    ds = json.loads((CONFIGS / "sdp4bit.json").read_text())
    p = report.plan(ds, 16, 8, 10 ** 9)
    shape, cfg = TopologyShape(2, 8), SDP4BitConfig.model_validate(p["cfg"])   # automatic choices made
    for scheme in ("zero3", "zero++", "sdp4bit"):
        assert p["bytes"][scheme]["totals"] == totals(step_bytes(scheme, 10 ** 9, shape, cfg))
    s, z = p["bytes"]["sdp4bit"], p["bytes"]["zero3"]
    assert s["node_link"] < 0.2 * z["node_link"]     # ~4 bits instead of 3 x 16 across nodes


def test_omitted_topology_uses_gpus_per_node_and_config_value_wins(capsys):
    ds = json.loads((CONFIGS / "sdp4bit.json").read_text())
    assert report.plan(ds, 8, 4)["shape"] == [2, 4]
    ds["sdp4bit"]["topology"] = {"gpus_per_node": 2}
    p = report.plan(ds, 8, 4)
    assert p["shape"] == [4, 2]
    assert any("gpus_per_node=2 is used, not --gpus-per-node 4" in ln for ln in p["lines"])
    del ds["sdp4bit"]["topology"]
    with pytest.raises(SDP4BitConfigError, match="LOCAL_WORLD_SIZE.*pass --gpus-per-node"):
        report.plan(ds, 8, None)
    # as the integration plans a job: a single process needs no launcher (no LOCAL_WORLD_SIZE), and a configured
    # node larger than the job holds the whole job
    p = report.plan(ds, 1, None)
    assert p["shape"] == [1, 1] and any("world size 1: there is nothing to send" in ln for ln in p["lines"])
    ds["sdp4bit"]["topology"] = {"gpus_per_node": 8}
    assert report.plan(ds, 4, None)["shape"] == [1, 4]


@pytest.mark.parametrize("mutate", [
    lambda c: c["sdp4bit"].update(kernel_backend="auto"),
    lambda c: c["zero_optimization"].update(stage=2),
    lambda c: c["sdp4bit"]["weights"].update(bitz=4),
    lambda c: c["sdp4bit"].update(topology={"gpus_per_node": True}),
    lambda c: c.update(sdp4bit=None),
    lambda c: c["zero_optimization"].update(zero_quantized_gradients=True),
])
def test_linter_gives_the_runtime_error_and_exit_1(tmp_path, capsys, mutate):
    cfg = json.loads((CONFIGS / "sdp4bit.json").read_text())
    mutate(cfg)
    with pytest.raises(SDP4BitConfigError) as e:
        parse_ds_config(cfg)
    assert report.main(["--ds-config", _write(tmp_path, cfg), "--world", "4", "--gpus-per-node", "2"]) == 1
    assert str(e.value) in capsys.readouterr().err


def test_linter_says_an_overridden_persistence_threshold_as_a_note(tmp_path, capsys, recwarn):
    cfg = json.loads((CONFIGS / "sdp4bit.json").read_text())
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1000
    cfg["sdp4bit"].setdefault("weights", {})["replica"] = "full"
    assert report.main(["--ds-config", _write(tmp_path, cfg), "--world", "4", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "note: sdp4bit.weights.replica='full' keeps every parameter whole on every rank: overriding " \
           "zero_optimization.stage3_param_persistence_threshold=1000" in out
    assert not [w for w in recwarn if "overriding" in str(w.message)]   # a note, not a Python warning


def test_linter_gives_deepspeeds_own_zero_section_error(tmp_path, capsys):
    """A misspelt key of zero_optimization, which DeepSpeed refuses before anything of SDP4Bit, fails the linter too
    (exit 1, the key named), with or without an sdp4bit block; HF's "auto" values there pass (accelerate fills them)."""
    for name in ("sdp4bit", "zero3"):
        cfg = json.loads((CONFIGS / f"{name}.json").read_text())
        cfg["zero_optimization"].update(stage3_prefetch_bucketsize=5)
        assert report.main(["--ds-config", _write(tmp_path, cfg), "--world", "4", "--gpus-per-node", "2"]) == 1
        err = capsys.readouterr().err
        assert "zero_optimization: deepspeed.initialize refuses it" in err and "stage3_prefetch_bucketsize" in err
        # every key DeepSpeed refuses is named
        cfg["zero_optimization"].update(reduce_bucket_sise=5)
        assert report.main(["--ds-config", _write(tmp_path, cfg), "--world", "4", "--gpus-per-node", "2"]) == 1
        err = capsys.readouterr().err
        assert "stage3_prefetch_bucketsize: Extra inputs" in err and "reduce_bucket_sise: Extra inputs" in err
        for k in ("stage3_prefetch_bucketsize", "reduce_bucket_sise"):
            del cfg["zero_optimization"][k]
        cfg["zero_optimization"].update(reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                                        offload_param={"device": "none", "buffer_size": "auto"})
        assert report.main(["--ds-config", _write(tmp_path, cfg), "--world", "4", "--gpus-per-node", "2"]) == 0, \
            capsys.readouterr().err
    # what DeepSpeed is given is checked: the full replica replaces the persistence thresholds, whatever they were
    cfg = json.loads((CONFIGS / "sdp4bit.json").read_text())
    cfg["sdp4bit"].setdefault("weights", {})["replica"] = "full"
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=-1)
    assert report.main(["--ds-config", _write(tmp_path, cfg), "--world", "4", "--gpus-per-node", "2"]) == 0, \
        capsys.readouterr().err
    # DeepSpeed's legacy boolean form of the section, without an sdp4bit block: DeepSpeed reads it as stage 1
    assert report.main(["--ds-config", _write(tmp_path, {"zero_optimization": True}), "--world", "4",
                        "--gpus-per-node", "2"]) == 0
    assert report.main(["--ds-config", _write(tmp_path, {"zero_optimization": None}), "--world", "4",
                        "--gpus-per-node", "2"]) == 1


def test_linter_refuses_a_topology_that_does_not_divide_the_world(capsys, tmp_path):
    # gpus_per_node omitted: the launcher's ranks per host, here --gpus-per-node, is what does not divide
    assert report.main(["--ds-config", str(CONFIGS / "sdp4bit.json"), "--world", "6", "--gpus-per-node", "4"]) == 1
    err = capsys.readouterr().err
    assert "the launcher's ranks per host (LOCAL_WORLD_SIZE=4; sdp4bit.topology.gpus_per_node omitted) must " \
           "divide the data-parallel world size 6 (here: --gpus-per-node 4)" in err
    # set in the config: the key is named
    cfg = json.loads((CONFIGS / "sdp4bit.json").read_text())
    cfg["sdp4bit"]["topology"] = {"gpus_per_node": 4}
    assert report.main(["--ds-config", _write(tmp_path, cfg), "--world", "6"]) == 1
    assert "sdp4bit.topology.gpus_per_node=4 must divide the data-parallel world size 6" in capsys.readouterr().err


def test_plain_config_passes(capsys):
    assert report.main(["--ds-config", str(CONFIGS / "zero3.json"), "--world", "8", "--gpus-per-node", "8"]) == 0
    assert "no active sdp4bit block" in capsys.readouterr().out


def test_every_shipped_config_lints():
    for path in sorted(CONFIGS.glob("*.json")):
        report.plan(json.loads(path.read_text()), 16, 8, 10 ** 8)


def test_command_line_exit_status(tmp_path):
    bad = _write(tmp_path, {"zero_optimization": {"stage": 3}, "sdp4bit": {"seed": "auto"}})
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "deepspeed_sdp4bit", "--ds-config", bad, "--world", "2",
                        "--gpus-per-node", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 1 and "sdp4bit.seed" in p.stderr and "omit the key" in p.stderr


def test_command_line_json_is_the_whole_stdout_even_where_deepspeed_warns(tmp_path):
    """``--json`` and ``--keys`` are read by tools: DeepSpeed's import-time warning (here 'Setting accelerator to
    CPU', without DS_ACCELERATOR on a machine without a GPU) goes to stderr in that process, not into the JSON."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DS_ACCELERATOR", None)
    args = [sys.executable, "-m", "deepspeed_sdp4bit", "--ds-config", str(CONFIGS / "sdp4bit.json"), "--world", "4",
            "--gpus-per-node", "2", "--json"]
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["world"] == 4
    k = subprocess.run([sys.executable, "-m", "deepspeed_sdp4bit", "--keys"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert k.returncode == 0 and k.stdout.startswith("|"), k.stdout[:200]


# ----- the bytes model --------------------------------------------------------------------------------------
def test_zero3_rows_are_three_bf16_rings():
    P, shape = 1000003, TopologyShape(2, 4)
    S = -(-P // 8)
    t = totals(step_bytes("zero3", P, shape, accum=2))
    assert t == {"world": 2 * 3 * 7 * S * 2, "total": 2 * 3 * 7 * S * 2}


def test_sdp4bit_rows_are_the_collectives_formulas():
    P, shape = 10 ** 6, TopologyShape(2, 4)
    cfg = parse_block({"weights": {"replica": "node"}})  # an omitted replica is chosen per run (plan_run)
    S = -(-P // 8)
    rows = step_bytes("sdp4bit", P, shape, cfg)
    by = {(r["collective"], r["level"]): r["bytes"] for r in rows}
    g = G.expected_wire_bytes(S, shape, cfg.gradients)
    assert by[("gradient all-to-all (TLq-HS)", "intra")] == g["intra"]
    assert by[("gradient all-to-all (TLq-HS)", "inter")] == g["inter"]
    w = max((Wt.expected_wire_bytes(S, shape, cfg.weights, "node", r) for r in range(4)), key=lambda d: d["total"])
    assert by[("weight refresh (qWD)", "inter")] == w["inter"]
    assert by[("forward all-gather (node replica)", "intra")] == 3 * (P // 4) * 2


def test_disabled_halves_fall_back_to_zero3_rows():
    P, shape = 10 ** 6, TopologyShape(2, 2)
    off = parse_block({"weights": {"enabled": False}, "gradients": {"enabled": False}})
    assert totals(step_bytes("sdp4bit", P, shape, off)) == totals(step_bytes("zero3", P, shape))


def test_node_link_matches_the_per_value_model():
    # what crosses one node's link per step, (N - 1) / N of each payload: ZeRO-3 6 bytes per parameter,
    # SDP4Bit (4 + 32/2048)/8 + (4 + 32/128)/8 (the default block)
    P, shape = 2 ** 24, TopologyShape(4, 8)
    z = node_link_bytes(step_bytes("zero3", P, shape), shape)
    s = node_link_bytes(step_bytes("sdp4bit", P, shape, parse_block({"weights": {"replica": "node"}})), shape)
    assert z == pytest.approx(3 / 4 * P * 6, rel=1e-6)
    assert s == pytest.approx(3 / 4 * P * ((4 + 32 / 2048) / 8 + (4 + 32 / 128) / 8), rel=1e-3)
