"""examples/train_hf.py: SDP4Bit through the Hugging Face Trainer / accelerate, on 2 gloo ranks (torchrun).

Five launches: ZeRO-3 (configs/zero3.json, unchanged) and SDP4Bit for 2 * HALF steps each, and SDP4Bit
stopped after HALF steps (checkpointed), resumed with ``resume_from_checkpoint``, then resumed once more.  SDP4Bit is
configs/sdp4bit.json with the 2 ranks as 2 nodes x 1 and the full replica (``topology.gpus_per_node = 1``,
``weights.replica = "full"``), so that both the inter-node gradient level and the weight refresh are on the
wire.  Tolerances (tiny GPT-2, bytes of this package's source, lr 6e-4):

* SDP4Bit vs ZeRO-3, per step (mean loss over the ranks): |diff| <= 0.02 (observed 0.0050: 4-bit gradients
  across the "nodes", 4-bit weight differences).
* save_model -> from_pretrained: the held-out loss of the reloaded model equals the engine's within 1e-3
  (observed equal: the same bf16 weights, the same bf16 forward).
* resume: every step after the resume equals the uninterrupted run within 1e-4, "4 decimals" (observed equal); the
  log covers the whole run; resuming a finished run trains nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the Hugging Face extra is not installed: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="the Hugging Face extra is not installed: pip install -e '.[hf]'")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 2
HALF = 6


def _sdp4bit_2x1(tmp):
    cfg = json.loads(open(os.path.join(REPO, "configs", "sdp4bit.json")).read())
    cfg["sdp4bit"]["topology"] = {"gpus_per_node": 1}
    cfg["sdp4bit"]["weights"]["replica"] = "full"
    path = os.path.join(str(tmp), "sdp4bit_2x1.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _launch(out, config, *extra):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
           os.path.join(REPO, "tests", "hf_launch.py"), "--ds-config", os.path.join(REPO, "configs", config),
           "--out", str(out), "--data", os.path.join(REPO, "deepspeed_sdp4bit"), "--max-steps", str(2 * HALF),
           *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    with open(os.path.join(out, "log.json")) as f:
        log = json.load(f)
    log["losses"] = {int(k): v for k, v in log["losses"].items()}
    return log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    sdp = _sdp4bit_2x1(d)
    return {
        "zero3": _launch(d / "zero3", "zero3.json"),
        "sdp4bit": _launch(d / "sdp4bit", sdp),
        "stopped": _launch(d / "resume", sdp, "--stop-at", str(HALF)),
        "resumed": _launch(d / "resume", sdp, "--resume"),
        # the finished run resumed again: nothing to do (transformers alone would train a step past max_steps)
        "again": _launch(d / "resume", sdp, "--resume"),
        "dir": d / "resume",
    }


def test_every_rank_trains_in_one_world(runs):
    # accelerate alone would run each CPU rank as its own world of 1 (the example's CPU branch says why)
    assert all(runs[k]["world"] == RANKS for k in ("zero3", "sdp4bit", "stopped", "resumed"))


def test_sdp4bit_is_active_through_the_trainer(runs):
    s = runs["sdp4bit"]["sdp4bit_summary"]
    assert s is not None
    for part in ("gradients", "weights"):
        assert 0 < s[part]["bytes_by_level"]["inter"] < s[part]["baseline_bytes"], s
    assert runs["zero3"]["sdp4bit_summary"] is None
    # the replica the engine kept (full where it fits), its refresh inside step() on a CPU (no side stream)
    assert runs["sdp4bit"]["sdp4bit_state"] == {"replica": "full", "overlap": False}
    assert runs["zero3"]["sdp4bit_state"] is None


def test_loss_close_to_zero3(runs):
    z, s = runs["zero3"]["losses"], runs["sdp4bit"]["losses"]
    assert sorted(z) == sorted(s) == list(range(1, 2 * HALF + 1))
    diffs = [abs(z[k] - s[k]) for k in z]
    assert max(diffs) <= 0.02, diffs
    assert s[2 * HALF] < s[1] - 0.2  # it learns


@pytest.mark.parametrize("name", ["zero3", "sdp4bit", "resumed"])
def test_save_model_reloads_with_from_pretrained(runs, name):
    r = runs[name]
    assert abs(r["reloaded_eval_loss"] - r["eval_loss"]) <= 1e-3, (r["reloaded_eval_loss"], r["eval_loss"])


def test_resume_continues_like_the_uninterrupted_run(runs):
    full, stopped, resumed = runs["sdp4bit"]["losses"], runs["stopped"]["losses"], runs["resumed"]["losses"]
    assert sorted(stopped) == list(range(1, HALF + 1))
    # the resumed run's log is the whole run's: the steps before the checkpoint as the first part logged them
    assert sorted(resumed) == list(range(1, 2 * HALF + 1))
    assert all(resumed[k] == stopped[k] for k in stopped)
    for k in resumed:
        assert abs(resumed[k] - full[k]) <= 1e-4, (k, resumed[k], full[k])
    assert abs(runs["resumed"]["eval_loss"] - runs["sdp4bit"]["eval_loss"]) <= 1e-4
    # resuming the finished run trained nothing and left its log and checkpoints alone
    assert runs["again"] == runs["resumed"]
    assert {p.name for p in runs["dir"].glob("checkpoint-*")} == {f"checkpoint-{HALF}", f"checkpoint-{2 * HALF}"}


def test_a_new_run_refuses_an_out_dir_with_another_runs_checkpoints(tmp_path):
    """Without --resume, checkpoints already in --out belong to another run (a later --resume would take whichever
    is latest): refused before anything is built, naming the step and both ways out."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_hf", os.path.join(REPO, "examples", "train_hf.py"))
    train_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_hf)
    (tmp_path / "checkpoint-21").mkdir()
    (tmp_path / "checkpoint-21" / "trainer_state.json").write_text(json.dumps({"global_step": 21}))
    argv = ["--ds-config", os.path.join(REPO, "configs", "sdp4bit.json"), "--out", str(tmp_path), "--max-steps", "20"]
    with pytest.raises(SystemExit, match=r"already holds checkpoints of another run \(the latest at step 21\): pass "
                                         r"--resume to go on from it, or give an empty --out"):
        train_hf.main(argv)   # (with --resume it goes on: the launched "again" run above)

